"""Whose word counts against a member, as a run's broker weighs reports (no lone accuser).

Members report others that missed a round's deadline or sent updates they rejected. One report could be a lie, so
a report counts against the accused only when a strict majority of the *other* members of its group (reporters
included) made the same report for the same group epoch, or the broker's own measurement agrees (its ping, the
steps the accused signs in its status records). A group of two has no such majority: there the broker's own
measurement alone decides. A report that neither corroborates is the reporter's word against the group's: a
reporter that makes `false_to_penalize` of them within `window_s` is a false accuser, penalized, and its lone
reports are not acted on (no group re-formed for them) while that lasts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

MISSED, OFFENCE = "missed", "offence"


def majority_of_others(reporters: set[str], members: tuple[str, ...], accused: str) -> bool:
    """Whether `reporters` are a strict majority of `members` other than `accused` (a group of two never has
    one: one member's word against the other's)."""
    others = [m for m in members if m != accused]
    agreeing = len(reporters & set(others))
    return len(others) >= 2 and 2 * agreeing > len(others)


@dataclass(frozen=True, kw_only=True, slots=True)
class Verdict:
    counts: bool  # the report counts against the accused
    false_accusers: tuple[str, ...] = ()  # reporters just found to accuse falsely too often (penalize them)


class Accusations:
    """Reports by (kind, stage, epoch, accused), the reporters' unconfirmed ones, and the verdicts."""

    def __init__(self, clock: Callable[[], float], *, window_s: float, false_to_penalize: int):
        self.clock = clock
        self.window_s = window_s
        self.false_to_penalize = false_to_penalize
        # (kind, stage, epoch, accused) -> (its reporters, the accused's group at that epoch)
        self._reports: dict[tuple[str, int, int, str], tuple[set[str], tuple[str, ...]]] = {}
        self._false: dict[str, list[float]] = {}  # reporter -> when its reports went unconfirmed

    def report(self, kind: str, stage: int, epoch: int, accused: str, reporter: str,
               members: tuple[str, ...]) -> tuple[str, ...]:
        """Record a report (`members`: the accused's group at `epoch`). Reports of older epochs of that stage are
        settled as unconfirmed: returned are the reporters that this made false accusers (penalize them)."""
        false: list[str] = []
        for k in [k for k in self._reports if k[1] == stage and k[2] < epoch]:
            reporters, group = self._reports.pop(k)
            if len([m for m in group if m != k[3]]) >= 2:  # the others could have confirmed them, and did not
                false += [r for r in sorted(reporters) if self._unconfirmed(r)]
        entry = self._reports.setdefault((kind, stage, epoch, accused), (set(), members))
        entry[0].add(reporter)
        return tuple(dict.fromkeys(false))

    def reporters(self, kind: str, stage: int, epoch: int, accused: str) -> set[str]:
        return set(self._reports.get((kind, stage, epoch, accused), (set(), ()))[0])

    def judge(self, kind: str, stage: int, epoch: int, accused: str, members: tuple[str, ...], *,
              measured: bool | None, final: bool = True) -> Verdict:
        """The verdict on the reports of `accused` so far. `measured`: the broker's own measurement (True: it agrees
        with them, False: it contradicts them, None: it has none). Reports that count are settled. A `final`
        verdict that they do not count settles them as unconfirmed (their reporters marked) when the others could
        have confirmed them (a group of three or more) or the measurement contradicts them; otherwise they wait
        for more reports (until their epoch ends)."""
        reporters = self.reporters(kind, stage, epoch, accused)
        if measured is True or majority_of_others(reporters, members, accused):
            self._reports.pop((kind, stage, epoch, accused), None)
            return Verdict(counts=True)
        if not final:
            return Verdict(counts=False)
        self._reports.pop((kind, stage, epoch, accused), None)
        if measured is False or len([m for m in members if m != accused]) >= 2:
            return Verdict(counts=False, false_accusers=tuple(r for r in sorted(reporters) if self._unconfirmed(r)))
        return Verdict(counts=False)

    def _unconfirmed(self, reporter: str) -> bool:
        """Mark one unconfirmed report of `reporter`; True once it has made `false_to_penalize` within the window."""
        now = self.clock()
        recent = [t for t in self._false.get(reporter, ()) if now - t < self.window_s] + [now]
        self._false[reporter] = recent
        if len(self._false) > 1024:
            self._false = {r: ts for r, ts in self._false.items() if ts and now - ts[-1] < self.window_s}
        return len(recent) >= self.false_to_penalize

    def distrusted(self, reporter: str) -> bool:
        """Whether `reporter` made `false_to_penalize` unconfirmed reports within the window (its lone reports are
        not acted on)."""
        now = self.clock()
        return sum(1 for t in self._false.get(reporter, ()) if now - t < self.window_s) >= self.false_to_penalize
