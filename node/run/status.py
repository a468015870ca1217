"""What a training node says about itself beyond its status record (its status file), and the throughput and link
rates its status record carries."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

RECENT_STEPS = 32  # tokens/s is measured over this many recent steps
RATE_SMOOTHING = 0.5  # weight of the newest sample in the smoothed byte rates


class Throughput:
    """Tokens/s by the wall clock over recent steps, and smoothed up/down byte rates between status records.

    Times come from the caller's clock (monotonic seconds), so tests can drive it."""

    def __init__(self, tokens_per_step: int):
        self.tokens_per_step = tokens_per_step
        self._step_done: deque[float] = deque(maxlen=RECENT_STEPS)
        self._sample: tuple[float, int, int] | None = None
        self.up = self.down = 0.0

    def step_done(self, now: float) -> None:
        self._step_done.append(now)

    def tokens_per_s(self, fallback: float = 0.0) -> float:
        """Training progress over the last steps: waits for the group, the synchronizer and everything else between
        steps included (what the run really gets; one step's own figure counts compute only). `fallback` (the last
        step's own figure) until two steps are done."""
        t = self._step_done
        if len(t) >= 2 and t[-1] > t[0]:
            return self.tokens_per_step * (len(t) - 1) / (t[-1] - t[0])
        return fallback

    def rates(self, now: float, sent: int, recv: int) -> tuple[float, float]:
        """Bytes per second sent and received since the previous call (smoothed)."""
        t0, s0, r0 = self._sample or (now, sent, recv)
        self._sample = (now, sent, recv)
        if now - t0 > 0:
            a = RATE_SMOOTHING
            self.up = a * (sent - s0) / (now - t0) + (1 - a) * self.up
            self.down = a * (recv - r0) / (now - t0) + (1 - a) * self.down
        return round(self.up, 1), round(self.down, 1)


@dataclass(frozen=True, kw_only=True, slots=True)
class RunDetail:
    """What a node's status file adds about its run to what its status record says (local tools and tests read it;
    it never travels): re-fetches and entries, the state hashes and link-store digests of the last steps, the warm
    copy's revision, each lane link's counters, and a verified stage's checks."""

    refetches: int = 0  # states loaded from the group's majority after ours differed
    entries: tuple[dict[str, Any], ...] = ()  # the last times this node entered a group: step, bytes, seconds
    recent_hashes: dict[int, str] = field(default_factory=dict)  # step -> state hash, the last steps
    warm_revision: int | None = None  # a backup's warm copy
    links: dict[str, Any] = field(default_factory=dict)  # "b0/fwd" -> neighbour, messages and bytes each way
    recent_link_digests: dict[str, dict[str, str]] = field(default_factory=dict)  # "b0/fwd/receiver" -> step -> digest
    verified: dict[str, Any] | None = None  # verified stages: checks, skips, confirmations, the last findings

    def to_json(self) -> dict[str, Any]:
        return {"refetches": self.refetches, "entries": list(self.entries),
                "recent_hashes": {str(k): v for k, v in sorted(self.recent_hashes.items())},
                "warm_revision": self.warm_revision, "links": self.links,
                "recent_link_digests": self.recent_link_digests,
                **({"verified": self.verified} if self.verified is not None else {})}
