"""Robust aggregation at a chunk owner: no member weighs more than its share, a minority cannot turn the direction.

The owner of a chunk holds one contribution per member (already decoded, finite, and under the loose RMS clip of
`GroupSync.accept`). Before it averages them:

1. **Norm equalisation.** Every contribution is scaled down to at most `clip_factor` times the median of their
   norms. The median is set by the majority, so a member that scales its update up (by any factor under the loose
   clip) gets at most `clip_factor / n` of the aggregate's weight instead of taking it over.
2. **Direction check.** The reference is the coordinate-wise median of the contributions (a majority statistic: a
   minority cannot move it past the honest values). A contribution whose cosine with it is below `min_cosine` is
   left out of this round's mean, as long as those left out are a minority; the mean is then taken over the rest.
   A sign-flipped or otherwise opposed update falls here; an honest one points with the majority.
3. **Offenders.** A member left out in `offend_after` of its last `window_rounds` rounds is reported to the broker
   as an offender (which evicts and bans it once most members have, at a step every member agrees on): an honest
   member's noisy update falls below the line now and then, a poisoner's every round. Until then the owner leaves
   its updates out but keeps exchanging with it, so every member applies the same chunks.

Only the owner computes this, once per chunk and round, and every member applies the owner's broadcast, so
replicas stay bit-identical; the computation itself is deterministic (a fixed member order, no randomness).
Needs at least `min_members` contributions for the direction check (with two there is no majority).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True, kw_only=True, slots=True)
class RobustConfig:
    enabled: bool = True
    clip_factor: float = 1.5  # contributions scaled down to this multiple of the median norm
    min_cosine: float = 0.0  # below this cosine with the coordinate-wise median: left out of the round
    min_members: int = 3  # the direction check needs a majority
    window_rounds: int = 8
    offend_after: int = 5  # left out this often within the window: an offender

    def __post_init__(self) -> None:
        if self.clip_factor < 1 or not -1 <= self.min_cosine < 1 or self.min_members < 3:
            raise ValueError("need clip_factor >= 1, -1 <= min_cosine < 1 and min_members >= 3")
        if not 1 <= self.offend_after <= self.window_rounds:
            raise ValueError("need 1 <= offend_after <= window_rounds")


@dataclass(slots=True)
class Verdict:
    """One chunk's robust aggregation: what goes into the mean, and who was left out (with their cosines)."""

    kept: dict[str, torch.Tensor]
    left_out: dict[str, float] = field(default_factory=dict)
    cosines: dict[str, float] = field(default_factory=dict)


def robust_filter(parts: dict[str, torch.Tensor], order: Sequence[str], config: RobustConfig) -> Verdict:
    """Norm-equalise `parts` and leave out a minority opposed to the coordinate-wise median (see the module)."""
    names = [m for m in order if m in parts]
    if not config.enabled or len(names) < 2:
        return Verdict(kept=dict(parts))
    norms = {m: float(parts[m].norm()) for m in names}
    med = _median_low([norms[m] for m in names])
    kept: dict[str, torch.Tensor] = {}
    for m in names:
        limit = config.clip_factor * med
        kept[m] = parts[m] * (limit / norms[m]) if norms[m] > limit > 0 else parts[m]
    if len(names) < config.min_members:
        return Verdict(kept=kept)
    ref = torch.stack([kept[m] for m in names]).median(dim=0).values  # the lower middle for an even count
    ref_norm = float(ref.norm())
    if ref_norm == 0.0 or not math.isfinite(ref_norm):
        return Verdict(kept=kept)  # no direction the majority agrees on (e.g. sparse updates with disjoint support)
    cos = {}
    for m in names:
        n = float(kept[m].norm())
        cos[m] = float(torch.dot(kept[m], ref)) / (n * ref_norm) if n > 0 else 0.0
    out = {m for m in names if cos[m] < config.min_cosine}
    if not out or 2 * len(out) >= len(names):
        return Verdict(kept=kept, cosines=cos)  # no minority to leave out
    return Verdict(kept={m: v for m, v in kept.items() if m not in out}, left_out={m: cos[m] for m in out},
                   cosines=cos)


class Disagreements:
    """Per member, whether it was left out in each of its last `window_rounds` rounds (as one owner saw them)."""

    def __init__(self, config: RobustConfig):
        self.config = config
        self._seen: dict[str, deque[bool]] = {}

    def record(self, verdict: Verdict, me: str) -> list[str]:
        """Count this round; returns the members that just became offenders (their history starts afresh)."""
        return [m for m in verdict.cosines if m != me and self.note(m, m in verdict.left_out)]

    def note(self, member: str, disagreed: bool) -> bool:
        """Count one round of `member`; True when that made it an offender (its history then starts afresh)."""
        seen = self._seen.setdefault(member, deque(maxlen=self.config.window_rounds))
        seen.append(disagreed)
        if sum(seen) >= self.config.offend_after:
            seen.clear()
            return True
        return False


def _median_low(xs: list[float]) -> float:
    s = sorted(xs)
    return s[(len(s) - 1) // 2]
