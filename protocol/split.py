"""The global batch split across a run's lanes: whole units (sequences, or micro-batches for a pipeline lane) in
proportion to each lane's speed, every lane at least one unit, the same integers on every machine.

Speeds are what lanes report about themselves, so they are clamped around the median lane's (`clamp_speeds`): a lane
that claims to be faster than `spread` times the median is credited with `spread` times the median, one that claims
to be slower than 1/`spread` of it with that. A liar therefore takes at most `spread * m / (spread * m + rest)` of the
batch (m the median speed, rest the others' sum): with two lanes at most spread / (spread + 1); it cannot shrink the
others' shares below their clamped proportion, and every unit of the batch goes to some lane, so nobody skips
samples because of it. `apportion` is exact integer arithmetic (largest remainder, ties to the lower lane), so every
node that applies it to the same speeds gets the same shares.
"""

from __future__ import annotations

from collections.abc import Mapping
from fractions import Fraction
from statistics import median_low

DEFAULT_SPREAD = 4.0  # a lane's speed is credited within [median / 4, median * 4]


def clamp_speeds(speeds: Mapping[int, float | None], spread: float = DEFAULT_SPREAD) -> dict[int, float]:
    """Each lane's speed clamped into [median / spread, median * spread] of the lanes that reported one (a lane
    without a report, or with a non-positive one, is credited the median; with no reports at all every lane is
    equal)."""
    if spread < 1:
        raise ValueError("spread must be >= 1")
    known = [v for v in speeds.values() if v is not None and v > 0]
    if not known:
        return {r: 1.0 for r in speeds}
    med = median_low(known)
    return {r: min(max(v if v is not None and v > 0 else med, med / spread), med * spread)
            for r, v in speeds.items()}


def apportion(units: int, weights: dict[int, float]) -> dict[int, int]:
    """`units` split over the lanes of `weights` in proportion to them (largest remainder on exact fractions of the
    weights' float values, ties to the lower lane index), then every lane that got none takes one from the lane with
    the most (so each lane has at least one unit)."""
    lanes = sorted(weights)
    if not lanes:
        return {}
    if units < len(lanes):
        raise ValueError(f"{units} units cannot give each of {len(lanes)} lanes one")
    if any(not w > 0 for w in weights.values()):
        raise ValueError("weights must be positive")
    fr = {r: Fraction(weights[r]) for r in lanes}  # exact: float values are binary fractions
    total = sum(fr.values())
    ideal = {r: units * fr[r] / total for r in lanes}
    out = {r: int(ideal[r]) for r in lanes}
    left = units - sum(out.values())
    for r in sorted(lanes, key=lambda r: (-(ideal[r] - int(ideal[r])), r))[:left]:
        out[r] += 1
    for r in lanes:
        if out[r] == 0:
            donor = max(lanes, key=lambda q: (out[q], -q))
            out[donor] -= 1
            out[r] = 1
    return out


def shares(global_batch: int, granule: int, speeds: Mapping[int, float | None],
           spread: float = DEFAULT_SPREAD) -> dict[int, int]:
    """Sequences per lane: the global batch in units of `granule`, apportioned by the clamped speeds."""
    if global_batch % granule:
        raise ValueError(f"a global batch of {global_batch} is not a whole number of units of {granule}")
    return {r: n * granule for r, n in apportion(global_batch // granule, clamp_speeds(speeds, spread)).items()}


def even_shares(global_batch: int, granule: int, lanes: list[int]) -> dict[int, int]:
    """The global batch split as evenly as whole units allow (the lower lanes take the remainder)."""
    return shares(global_batch, granule, {r: None for r in lanes})
