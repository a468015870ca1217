"""What a training node says about itself beyond its status record (its status file), and what its status record
carries of its throughput, byte rates (synchronization and lane links together), the compression ratio over the same
window, a thinned history of its losses, and its contribution (what it computed into applied steps)."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

RECENT_STEPS = 32  # tokens/s is measured over this many recent steps
RATE_SMOOTHING = 0.5  # weight of the newest sample in the smoothed byte rates


class Throughput:
    """Tokens/s by the wall clock over recent steps, and smoothed up/down byte rates between status records.

    Times come from the caller's clock (monotonic seconds), so tests can drive it."""

    def __init__(self) -> None:
        self._step_done: deque[tuple[float, int]] = deque(maxlen=RECENT_STEPS)  # (time, tokens of the step)
        self._sample: tuple[float, int, int, int] | None = None
        self.up = self.down = self.up_fp32 = 0.0

    def step_done(self, now: float, tokens: int) -> None:
        self._step_done.append((now, tokens))

    def tokens_per_s(self, fallback: float = 0.0) -> float:
        """Training progress over the last steps: waits for the group, the synchronizer and everything else between
        steps included (what the run really gets; one step's own figure counts compute only). `fallback` (the last
        step's own figure) until two steps are done."""
        t = self._step_done
        if len(t) >= 2 and t[-1][0] > t[0][0]:
            return sum(n for _, n in list(t)[1:]) / (t[-1][0] - t[0][0])
        return fallback

    def steps_per_s(self) -> float:
        """Steps per second over the last steps (0 until two are done)."""
        t = self._step_done
        return (len(t) - 1) / (t[-1][0] - t[0][0]) if len(t) >= 2 and t[-1][0] > t[0][0] else 0.0

    def rates(self, now: float, sent: int, recv: int, sent_fp32: int) -> tuple[float, float, float | None]:
        """Bytes per second sent and received since the previous call (smoothed), and the compression ratio over
        the same window: what the sent tensors would take uncompressed (fp32) over what went on the wire. Every
        node's ratio is measured over its recent window, so a backup promoted late (which never sent the
        uncompressed warm-up steps) compares with the others. None while nothing is sent."""
        t0, s0, r0, f0 = self._sample or (now, sent, recv, sent_fp32)
        self._sample = (now, sent, recv, sent_fp32)
        if now - t0 > 0:
            a, dt = RATE_SMOOTHING, now - t0
            self.up = a * (sent - s0) / dt + (1 - a) * self.up
            self.down = a * (recv - r0) / dt + (1 - a) * self.down
            self.up_fp32 = a * (sent_fp32 - f0) / dt + (1 - a) * self.up_fp32
        ratio = round(self.up_fp32 / self.up, 2) if self.up >= 1.0 else None
        return round(self.up, 1), round(self.down, 1), ratio


class Thinned:
    """At most `cap` (step, value) points of a whole run, spread over it: when full, every other point goes and the
    gap a new point must keep from the last one doubles (a long run keeps ~cap points from its start to now)."""

    def __init__(self, cap: int):
        if cap < 2:
            raise ValueError("cap must be >= 2")
        self.cap = cap
        self.points: list[tuple[int, float]] = []
        self.gap = 1

    def add(self, step: int, value: float) -> None:
        if not math.isfinite(value) or value < 0 or (self.points and step - self.points[-1][0] < self.gap):
            return
        self.points.append((step, value))
        if len(self.points) > self.cap:
            self.points = self.points[::2]
            self.gap *= 2

    def fields(self, steps: str, values: str, upto: int) -> dict[str, tuple[int, ...]]:
        """The points up to step `upto` as a status record carries them: steps, and values in thousandths."""
        kept = [(s, v) for s, v in self.points if s <= upto]
        return {steps: tuple(s for s, _ in kept), values: tuple(min(round(v * 1000), 10**9) for _, v in kept)}


@dataclass(frozen=True, kw_only=True, slots=True)
class RunDetail:
    """What a node's status file adds about its run to what its status record says (local tools and tests read it;
    it never travels): re-fetches and entries, the state hashes, sequences computed and link-store digests of the last
    steps, the warm copy's revision, each lane link's counters, and a verified stage's checks."""

    refetches: int = 0  # states loaded from the group's majority after ours differed
    entries: tuple[dict[str, Any], ...] = ()  # the last times this node entered a group: step, bytes, seconds
    recent_hashes: dict[int, str] = field(default_factory=dict)  # step -> state hash, the last steps
    recent_samples: dict[int, int] = field(default_factory=dict)  # step -> sequences this lane computed (its share)
    warm_revision: int | None = None  # a backup's warm copy
    links: dict[str, Any] = field(default_factory=dict)  # "b0/fwd" -> neighbour, messages and bytes each way
    recent_link_digests: dict[str, dict[str, str]] = field(default_factory=dict)  # "b0/fwd/receiver" -> step -> digest
    verified: dict[str, Any] | None = None  # verified stages: checks, skips, confirmations, the last findings

    def to_json(self) -> dict[str, Any]:
        return {"refetches": self.refetches, "entries": list(self.entries),
                "recent_hashes": {str(k): v for k, v in sorted(self.recent_hashes.items())},
                "recent_samples": {str(k): v for k, v in sorted(self.recent_samples.items())},
                "warm_revision": self.warm_revision, "links": self.links,
                "recent_link_digests": self.recent_link_digests,
                **({"verified": self.verified} if self.verified is not None else {})}


class Contribution:
    """The sequences and tokens this node computed that went into applied steps (a step given up, or skipped for
    non-finite gradients, counts nothing). A step's result is read when the status is made (on a GPU it may still be
    on the device when the step returns), so counting never holds a step back."""

    def __init__(self) -> None:
        self.samples = 0
        self.tokens = 0
        self._pending: list = []  # StepResults not counted yet

    def add(self, result) -> None:
        self._pending.append(result)

    def fields(self) -> dict[str, int]:
        """The status record's samples_done and tokens_done (every pending step counted first)."""
        for r in self._pending:
            if r.applied:
                self.samples += r.samples
                self.tokens += r.tokens
        self._pending.clear()
        return {"samples_done": self.samples, "tokens_done": self.tokens}
