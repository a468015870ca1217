"""When the broker moves providers to a better placement, and how fast (docs/placement.md, "Re-planning without
thrash").

A re-plan proposes a target grid (planner over the active providers and the backups, on the link book's planning
figures, which already ignore changes under 20 %). The target is adopted only when it pays:

    (C_now - C_target) x min(steps left, horizon) > migration cost + margin,  and  C_target <= (1 - min_gain) C_now

where the migration cost is the seconds the moved providers spend pulling their stage's state over their measured
links plus the AQ-SGD first visits of the lane links that re-form (`migration_seconds`). A target is then reached
one lane per `period_s` (never two moves within a period), the lanes that change least first; a provider moved
is not moved again for `peer_dwell_s`; a newer target replaces the one being reached only if it pays against the
current placement by the same rule. Before any of that the target's lanes are aligned to the current ones and,
among equally good targets, the one that keeps most providers in place is taken (`keep_in_place`), so a promoted
backup is preferred to a moved active provider whenever they tie.

Everything reads the injected clock: tests run it in virtual time.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from shoal.swarm.run.placement_cost import CostModel

TOL = 1e-9


@dataclass(frozen=True, kw_only=True, slots=True)
class ReplanConfig:
    check_s: float = 30.0  # the broker re-plans this often (and when providers join or leave)
    period_s: float = 60.0  # one lane moved per period at most
    min_gain: float = 0.10  # the target's step at least this much shorter
    margin_s: float = 60.0  # seconds the target must save beyond its migration cost
    peer_dwell_s: float = 600.0  # a provider moved is not moved again for this long
    horizon_steps: int = 5000  # steps left counted at most (a long run is not a licence to move for nothing)

    def __post_init__(self) -> None:
        if min(self.check_s, self.period_s) <= 0 or not 0 <= self.min_gain < 1 or self.margin_s < 0 \
                or self.peer_dwell_s < 0 or self.horizon_steps < 1:
            raise ValueError("positive check_s and period_s, 0 <= min_gain < 1, margin_s and peer_dwell_s >= 0, "
                             "horizon_steps >= 1")


@dataclass(frozen=True, slots=True)
class Verdict:
    adopt: bool
    why: str


def align_lanes(target: np.ndarray, current: np.ndarray) -> np.ndarray:
    """`target` with its lanes (columns) reordered so that as many devices as possible keep their lane and
    stage (greedy by overlap, ties by the lowest lane)."""
    S, D = target.shape
    overlap = np.array([[int(np.sum(target[:, i] == current[:, j])) for j in range(D)] for i in range(D)])
    out = np.empty_like(target)
    free_t, free_c = set(range(D)), set(range(D))
    while free_t:
        i, j = max(((i, j) for i in free_t for j in free_c), key=lambda ij: (overlap[ij], -ij[1], -ij[0]))
        out[:, j] = target[:, i]
        free_t.discard(i)
        free_c.discard(j)
    return out


def keep_in_place(model: CostModel, target: np.ndarray, current: np.ndarray) -> np.ndarray:
    """Among placements as good as `target` (within 1e-9), one that moves fewer devices: every cell whose device
    differs from `current` tries to take the current device back (swapping it with wherever the target put it,
    or with a spare), kept when the cost does not rise. Devices in backups (not in `current`) are thus used only
    where they help."""
    t = align_lanes(target, current)
    best = model.total(t)
    changed = True
    while changed:
        changed = False
        for s, lane in zip(*np.nonzero(t != current)):
            want = current[s, lane]
            g = t.copy()
            where = np.argwhere(g == want)
            if len(where):
                g[tuple(where[0])] = g[s, lane]
            g[s, lane] = want
            c = model.total(g)
            if c <= best + TOL * max(1.0, best):
                t, best, changed = g, min(best, c), True
    return t


@dataclass
class _Target:
    grid: np.ndarray  # peer ids (stages x lanes)
    cost: float
    since: float


@dataclass
class Replanner:
    """The migration state of one run (see the module). Grids are arrays of peer ids (stages x lanes)."""

    config: ReplanConfig = ReplanConfig()
    clock: Callable[[], float] = time.monotonic
    target: _Target | None = None
    last_move: float = -1e18
    moved_at: dict[str, float] = field(default_factory=dict)
    migrations: int = 0  # targets adopted
    moves: int = 0  # lane moves done

    def judge(self, now_cost: float, target_cost: float, migration_s: float, steps_left: int) -> Verdict:
        """Whether a target that costs `target_cost` per step is worth moving to from `now_cost`."""
        c = self.config
        if not np.isfinite(target_cost):
            return Verdict(False, "the target cannot train")
        if target_cost > (1 - c.min_gain) * now_cost:
            return Verdict(False, f"gain {1 - target_cost / now_cost:.1%} under {c.min_gain:.0%}")
        saved = (now_cost - target_cost) * min(steps_left, c.horizon_steps)
        if saved <= migration_s + c.margin_s:
            return Verdict(False, f"saves {saved:.0f} s over the run, moving costs {migration_s:.0f} s + "
                                  f"{c.margin_s:.0f} s margin")
        return Verdict(True, f"{now_cost:.3g} s -> {target_cost:.3g} s per step, saves {saved:.0f} s for "
                             f"{migration_s:.0f} s of moving")

    def offer(self, target: np.ndarray, target_cost: float, now_cost: float, migration_s: float,
              steps_left: int, held_cost: float | None = None) -> Verdict:
        """A re-plan's target; adopted when `judge` says it pays. While another target is being reached (priced
        `held_cost` on today's figures), the new one must also beat that one by `min_gain`: two plans of about
        the same worth never take turns."""
        v = self.judge(now_cost, target_cost, migration_s, steps_left)
        if not v.adopt:
            return v
        if self.target is not None and np.array_equal(self.target.grid, target):
            return v
        if self.target is not None and held_cost is not None and np.isfinite(held_cost) \
                and target_cost > (1 - self.config.min_gain) * held_cost:
            return Verdict(False, f"the plan being reached ({held_cost:.3g} s) is about as good")
        self.target = _Target(np.array(target, dtype=object), target_cost, self.clock())
        self.migrations += 1
        return v

    def drop(self) -> None:
        self.target = None

    def next_lane(self, current: np.ndarray) -> tuple[int, dict[tuple[int, int], str]] | None:
        """When a move is due: (the lane, {slot: peer}) that brings one more lane of the target about, the lane
        changing fewest providers first, none of whose providers moved within the dwell time; None when nothing is
        due (the period has not passed, the target is reached or none, or every remaining lane must wait)."""
        if self.target is None:
            return None
        now = self.clock()
        if now - self.last_move < self.config.period_s:
            return None
        t = self.target.grid
        if t.shape != current.shape:
            self.target = None
            return None
        lanes = [lane for lane in range(t.shape[1]) if not np.array_equal(t[:, lane], current[:, lane])]
        if not lanes:
            self.target = None  # reached
            return None
        dwell = self.config.peer_dwell_s

        def blocked(lane: int) -> bool:
            movers = {p for p in (*t[:, lane], *current[:, lane]) if not _same_slot(p, t, current)}
            return any(now - self.moved_at.get(p, -1e18) < dwell for p in movers)

        ready = [lane for lane in lanes if not blocked(lane)]
        if not ready:
            return None
        lane = min(ready, key=lambda x: (int(np.sum(t[:, x] != current[:, x])), x))
        return lane, {(s, lane): t[s, lane] for s in range(t.shape[0]) if t[s, lane] != current[s, lane]}

    def moved(self, peers: Sequence[str]) -> None:
        now = self.clock()
        self.last_move = now
        self.moves += 1
        for p in peers:
            self.moved_at[p] = now


def _same_slot(d: int, a: np.ndarray, b: np.ndarray) -> bool:
    wa, wb = np.argwhere(a == d), np.argwhere(b == d)
    return len(wa) == len(wb) == 1 and tuple(wa[0]) == tuple(wb[0])


def migration_seconds(model: CostModel, current: np.ndarray, target: np.ndarray, *, state_bytes: Sequence[float],
                      first_visit_bytes: float, sources: Callable[[int, int], Sequence[int]]) -> float:
    """What moving from `current` to `target` costs in seconds: each device that takes a new slot pulls its
    stage's state (`state_bytes[stage]`) from the fastest of `sources(stage, device)` over the measured link
    (the moves of one lane run at once: the slowest counts; lanes are moved one after another: they add up), and
    every lane link that re-forms then sends `first_visit_bytes` more (AQ-SGD first visits instead of deltas)
    over its own link (the slowest re-formed link of a lane counts, after the pulls)."""
    bw = model.network.bandwidth_bps
    lat = model.network.latency_s
    total = 0.0
    S, D = target.shape
    for lane in range(D):
        worst = 0.0
        for s in range(S):
            d = int(target[s, lane])
            if d == current[s, lane]:
                continue
            src = [int(x) for x in sources(s, d) if x != d]
            if src:
                pull = min(lat[x, d] + lat[d, x] + 8 * state_bytes[s] / bw[x, d] if bw[x, d] > 0 else np.inf
                           for x in src)
                worst = max(worst, pull)
        visits = 0.0
        for s in range(S - 1):
            a, b = int(target[s, lane]), int(target[s + 1, lane])
            if (a, b) != (int(current[s, lane]), int(current[s + 1, lane])) and first_visit_bytes > 0:
                visits = max(visits, 8 * first_visit_bytes / bw[a, b] if bw[a, b] > 0 else np.inf)
        total += worst + visits
    return total
