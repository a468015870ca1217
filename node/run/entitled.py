"""Whose word a training node acts on and whom it serves: the run table's providers only, with progress reports
clamped to a bounded lead and snapshot requests kept near the current step and rate-limited per peer."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from shoal.protocol.assignment import GONE, AssignmentTable
from shoal.protocol.records import StatusRecord

MAX_STEP_LEAD = 64  # a member's reported step counts at most this far past the group's median (ours included)
MAX_RATE_RATIO = 4.0  # a member's reported tokens/s counts at most this many times the group's median
ASK_SLACK_S = 5.0  # AskPacer: its window is this much longer than a peer's, for requests delayed on the way


@dataclass(frozen=True, kw_only=True, slots=True)
class SnapshotLimits:
    window_steps: int = 64  # a snapshot may be asked for steps within window_steps of ours
    per_peer: int = 4  # requests for distinct steps per peer (asking for a step again is free) ...
    per_s: float = 10.0  # ... within this many seconds

    def __post_init__(self) -> None:
        if self.window_steps < 1 or self.per_peer < 1 or self.per_s <= 0:
            raise ValueError("snapshot limits must be positive")


def majority_step(others: Iterable[int], members: int) -> int | None:
    """The newest step a strict majority of a group of `members` (this node among them, behind all the others'
    steps in question) reports: the step `others` (the other members' reported steps) reach at least
    `members // 2 + 1` times. A pair has no majority but both: there the other's word decides. None: too few
    reports. One member's report (a replica that trained on alone, or a liar) cannot say the group is ahead."""
    steps = sorted(others, reverse=True)
    need = min(members // 2 + 1, max(members - 1, 1))
    return steps[need - 1] if len(steps) >= need else None


Asks = dict[str, list[tuple[float, int]]]  # peer -> (when, step) of its recent snapshot requests, oldest first


def recent_asks(book: Asks, peer: str, now: float, window_s: float) -> list[tuple[float, int]]:
    """`peer`'s requests in `book` younger than `window_s` (a new list); peers with none that young are dropped."""
    for p in [p for p, asks in book.items() if not asks or now - asks[-1][0] >= window_s]:
        del book[p]
    return [(t, s) for t, s in book.get(peer, ()) if now - t < window_s]


class Entitlement:
    """`table()`: the newest run table this node follows (None: none yet)."""

    def __init__(self, table: Callable[[], AssignmentTable | None], clock: Callable[[], float],
                 limits: SnapshotLimits = SnapshotLimits(), *, max_lead_steps: int = MAX_STEP_LEAD):
        self.table = table
        self.clock = clock
        self.limits = limits
        self.max_lead_steps = max_lead_steps
        self._asked: Asks = {}  # the members' requests to us

    def member(self, peer: str) -> bool:
        """A provider of the run (active, backup or draining) in the table we follow."""
        t = self.table()
        return t is not None and (t.slot_of(peer) is not None or t.provider_state(peer) not in (None, GONE))

    def progress(self, own_step: int, run_id: str, statuses: Iterable[tuple[str, StatusRecord]],
                 own_rate: float = 0.0) -> list[tuple[int, float]]:
        """(step, tokens/s) of this node and of the run's members: a record of anyone else is not counted, and a
        member's step or rate far beyond the group's is clamped. The group's figure is the lower median of every
        member's *and this node's own*: liars that are half of those counted (one of two members) cannot move it
        past an honest figure, so no report can push a group change (or the broker's table) out of reach."""
        rows = [(st.step, st.tokens_per_s) for peer, st in statuses if st.run_id == run_id and self.member(peer)]
        own = (own_step, own_rate)
        if not rows:
            return [own]
        top = max(own_step, int(statistics.median_low([own_step] + [s for s, _ in rows]))) + self.max_lead_steps
        rates = [r for _, r in [own, *rows] if r > 0]  # backups and members just starting report none
        rate_cap = MAX_RATE_RATIO * statistics.median_low(rates) if rates else 0.0
        return [own] + [(min(s, top), min(r, rate_cap)) for s, r in rows]

    def snapshot_refusal(self, peer: str, step: int, own_step: int) -> tuple[str, bool] | None:
        """Why `peer`'s request for a snapshot at `step` is refused, and whether that is an offence (None: keep
        it). Only members may ask, for a step near ours, for a few distinct steps within `per_s` (a step asked for
        again within it is free: the request changes nothing). Honest askers pace themselves (`AskPacer`)."""
        if not self.member(peer):
            return "snapshots are kept for the run's members only", False
        lim = self.limits
        if abs(step - own_step) > lim.window_steps:
            return f"step {step} is outside [{own_step - lim.window_steps}, {own_step + lim.window_steps}]", False
        now = self.clock()
        recent = recent_asks(self._asked, peer, now, lim.per_s)
        refusal = None
        if not any(s == step for _, s in recent):  # a step asked for again: free
            if len(recent) >= lim.per_peer:
                refusal = f"more than {lim.per_peer} snapshot requests within {lim.per_s:g} s", True
            else:
                recent.append((now, step))
        self._asked[peer] = recent
        return refusal


class AskPacer:
    """The asking side of `SnapshotLimits`: whether this node may ask `peer` to keep a step now without going over
    the peer's limit, with room to spare for requests that arrive closer together than they were sent (its window
    is `ASK_SLACK_S` longer, and a step asked for again is free only well inside the peer's window). An ask it holds
    back is one the peer did not answer."""

    def __init__(self, clock: Callable[[], float], limits: SnapshotLimits = SnapshotLimits()):
        self.clock, self.limits = clock, limits
        self._sent: Asks = {}  # our requests to each peer

    def allow(self, peer: str, step: int) -> bool:
        now, lim = self.clock(), self.limits
        recent = recent_asks(self._sent, peer, now, lim.per_s + ASK_SLACK_S)
        others = [(t, s) for t, s in recent if s != step]
        if any(s == step and now - t < lim.per_s - ASK_SLACK_S for t, s in recent):
            allowed = True  # the same step again, well inside the peer's window: free there
        elif len(others) >= lim.per_peer:
            allowed = False
        else:
            allowed, recent = True, others + [(now, step)]
        self._sent[peer] = recent
        return allowed
