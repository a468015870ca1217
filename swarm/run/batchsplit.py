"""The broker's split of the global batch across the run's lanes: whole units in proportion to each lane's measured
speed (protocol/split.py), written into the table so that every member uses the same shares from the same step.

A lane's speed is the slowest of its stages' (each stage reports the sequences per second its own compute does, in
its signed status record). The split changes when the lanes change (a group change anyway) and, with the same lanes,
only when the step it would take is at least `gain` (15 %) shorter than the current split's, and no sooner than `every_s`
after the last change (each change re-forms every stage's group at an agreed step)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from shoal.protocol.split import DEFAULT_SPREAD, clamp_speeds, shares

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class SplitConfig:
    spread: float = DEFAULT_SPREAD  # a lane is credited within [median / spread, median * spread] of speed
    gain: float = 0.15  # same lanes: re-split only for a step at least this much shorter (predicted)
    every_s: float = 20.0  # ... and no sooner than this after the last split

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

    def for_lanes(self, lanes: list[int], speeds: dict[int, float | None]) -> dict[int, int]:
        """The split for `lanes`: kept while they are the lanes it splits over, else a new one by `speeds`."""
        if sorted(self.current) != sorted(lanes):
            self.current = shares(self.global_batch, self.granule, {r: speeds.get(r) for r in lanes},
                                  self.config.spread) if lanes else {}
            self.changed_at = self.clock()
        return self.current

    def better(self, speeds: dict[int, float | None]) -> dict[int, int] | None:
        """A split of the same lanes whose step is `gain` shorter than the current one's by `speeds` (None: keep the
        current one; also while the last change is under `every_s` old or a lane's speed is not known yet)."""
        lanes = sorted(self.current)
        if not lanes or self.clock() - self.changed_at < self.config.every_s \
                or any(speeds.get(r) is None for r in lanes):
            return None
        credited = clamp_speeds({r: speeds[r] for r in lanes}, self.config.spread)
        ideal = shares(self.global_batch, self.granule, credited, self.config.spread)
        now, then = step_time(self.current, credited), step_time(ideal, credited)
        if ideal == self.current or now <= then * (1 + self.config.gain):
            return None
        log.info("re-splitting the global batch of %d: %s -> %s (predicted step %.3g s -> %.3g s)",
                 self.global_batch, self.current, ideal, now, then)
        self.current, self.changed_at = ideal, self.clock()
        self.resplits += 1
        return ideal
