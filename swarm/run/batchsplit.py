"""The broker's split of the global batch across the run's lanes: whole units in proportion to each lane's measured
speed (protocol/split.py), written into the table so that every member uses the same shares from the same step.

A lane's speed is the slowest of its stages' (each stage reports the sequences per second its own compute does, in
its signed status record). The split changes when the lanes change (a group change anyway) and, with the same lanes,
only when the step it would take is at least `gain` (15 %) shorter than the current split's throughout the last
`every_s` of speeds, and no sooner than `every_s` after the last change (each change re-forms every stage's group at
an agreed step). "Throughout": the current split priced at each lane's best speed of that window against the new one
at each lane's worst, so lanes of equal hardware whose speeds wander on a shared machine (each lane ahead in turn) are
not re-split after every wander, while a lasting difference (a slower machine, a lane that took other work) is
followed once it has held for `every_s`."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from shoal.protocol.split import DEFAULT_SPREAD, clamp_speeds, shares

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class SplitConfig:
    spread: float = DEFAULT_SPREAD  # a lane is credited within [median / spread, median * spread] of speed
    gain: float = 0.15  # same lanes: re-split only for a step at least this much shorter (predicted)
    every_s: float = 20.0  # ... throughout this long, and no sooner than this after the last split

    def __post_init__(self) -> None:
        if self.spread < 1 or self.gain < 0 or self.every_s < 0:
            raise ValueError("need spread >= 1, gain >= 0 and every_s >= 0")


def step_time(split: dict[int, int], speeds: dict[int, float]) -> float:
    """The predicted compute time of a step: its slowest lane's share over its speed."""
    return max((n / speeds[r] for r, n in split.items()), default=0.0)


class BatchSplit:
    """The current split (lane -> sequences) and when it changes (owned by the broker)."""

    def __init__(self, global_batch: int, granule: int, config: SplitConfig, clock: Callable[[], float]):
        self.global_batch, self.granule = global_batch, granule
        self.config = config
        self.clock = clock
        self.current: dict[int, int] = {}
        self.changed_at = -float("inf")
        self.resplits = 0  # changes with the same lanes (for their speeds)
        self._seen: dict[int, deque[tuple[float, float]]] = {}  # lane -> (time, speed) over the last every_s

    def _observe(self, speeds: dict[int, float | None]) -> dict[int, list[float]] | None:
        """Each lane's speeds over the last `every_s` (the one in force at its start included), or None while a lane
        has not been seen for that long (or its speed is not known now: its series starts again)."""
        now = self.clock()
        start = now - self.config.every_s
        out: dict[int, list[float]] = {}
        for r in self.current:  # (the series are dropped whenever `current` changes: none of another lane is left)
            v = speeds.get(r)
            if v is None:
                self._seen.pop(r, None)
                continue
            seen = self._seen.setdefault(r, deque())
            if not seen or seen[-1][1] != v:  # a value holds from when it was first seen (status records repeat it)
                seen.append((now, v))
            while len(seen) > 1 and seen[1][0] <= start:  # keep the newest from before the window: it held at its start
                seen.popleft()
            if seen[0][0] <= start:
                out[r] = [x for _, x in seen]
        return out if len(out) == len(self.current) else None

    def for_lanes(self, lanes: list[int], speeds: dict[int, float | None]) -> dict[int, int]:
        """The split for `lanes`: kept while they are the lanes it splits over, else a new one by `speeds`."""
        if sorted(self.current) != sorted(lanes):
            self.current = shares(self.global_batch, self.granule, {r: speeds.get(r) for r in lanes},
                                  self.config.spread) if lanes else {}
            self.changed_at = self.clock()
            self._seen.clear()  # a lane's number may now be another machine's
        return self.current

    def better(self, speeds: dict[int, float | None]) -> dict[int, int] | None:
        """A split of the same lanes by `speeds` whose step is `gain` shorter than the current one's throughout the
        last `every_s` (None: keep the current one; also while the last change is under `every_s` old or a lane's
        speed has not been known for that long). Called on every broker pass: each call is an observation."""
        lanes = sorted(self.current)
        window = self._observe(speeds) if lanes else None
        if window is None or self.clock() - self.changed_at < self.config.every_s:
            return None
        spread = self.config.spread
        ideal = shares(self.global_batch, self.granule, {r: speeds[r] for r in lanes}, spread)
        best = clamp_speeds({r: max(window[r]) for r in lanes}, spread)
        worst = clamp_speeds({r: min(window[r]) for r in lanes}, spread)
        now, then = step_time(self.current, best), step_time(ideal, worst)
        if ideal == self.current or now <= then * (1 + self.config.gain):
            return None
        log.info("re-splitting the global batch of %d: %s -> %s (predicted step %.3g s -> %.3g s at the lanes' "
                 "least favourable speeds of the last %g s)", self.global_batch, self.current, ideal, now, then,
                 self.config.every_s)
        self.current, self.changed_at = ideal, self.clock()
        self._seen.clear()  # the next change is judged on speeds measured under this one
        self.resplits += 1
        return ideal
