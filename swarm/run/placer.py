"""Who sits where, by the network: the small interface the broker's seating asks (docs/placement.md, "Re-planning without thrash").

`Placer` has three questions: which free slot a newcomer takes, which backup fills a slot, and whether to move
providers to a better placement now. `FirstFit` answers as the seating always did (the caller's own order: the
lowest lane, the busiest stage; the backup ranked first; never a move). `NetworkPlacer` answers from the link book
and the cost model: a newcomer goes where it adds least to the step (its stage group's data-parallel exchange, its
lane links, its compute), a backup likewise; a re-plan runs the planner over the complete lanes' providers and the
backups and moves towards its plan one lane per period when the gain pays for the move (swarm/run/replan.py).

Calls are cheap and bounded: choosing a slot or a backup prices each candidate against a stage group and two lane
neighbours (no search); a re-plan is one planner run within `planner.time_budget_s`, meant for a worker thread
(`propose` reads only the snapshot it is given and the book; `apply` happens back on the broker's loop).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from shoal.swarm.run.linkbook import LinkBook
from shoal.swarm.run.placement_cost import CostModel, Network, Workload
from shoal.swarm.run.placement_plan import Planner, PlannerConfig
from shoal.swarm.run.replan import ReplanConfig, Replanner, keep_in_place, migration_seconds

log = logging.getLogger(__name__)

Slot = tuple[int, int]  # (stage, replica)


@dataclass(frozen=True, kw_only=True, slots=True)
class RunBytes:
    """What the run's steps move and compute, and what moving a provider costs (the node derives it from the
    manifest: node/run/workload.py)."""

    workload: Callable[[int], Workload]  # lanes -> the cost model's workload
    state_bytes: tuple[float, ...]  # per stage: the state a provider entering it pulls
    first_visit_bytes: float = 0.0  # a re-formed lane link's AQ-SGD first visits, beyond its deltas


@dataclass(frozen=True, slots=True)
class Seats:
    """A snapshot of the seating for a re-plan: the slots, the backups that may be promoted, the run's shape."""

    slots: Mapping[Slot, str]
    backups: Sequence[str]
    stages: int
    replicas: int
    steps_left: int


@dataclass(frozen=True, slots=True)
class Change:
    """One seating change: `assign` gives slots their new holders; `to_pool` leave the grid for the backup pool."""

    assign: dict[Slot, str]
    to_pool: tuple[str, ...]
    moved: tuple[str, ...]  # every provider whose slot changed
    why: str
    before_s: float = 0.0  # predicted step times
    after_s: float = 0.0


class Placer:
    """Today's rules (see the module): the no-op member of the interface."""

    name = "first fit"
    check_s: float | None = None  # how often the broker asks `propose` (None: never)
    last: dict = {}  # the last re-plan's figures, for logs and the bench (none here)

    def choose_slot(self, peer: str, free: Sequence[Slot], slots: Mapping[Slot, str]) -> Slot | None:
        return free[0] if free else None

    def choose_backup(self, slot: Slot, candidates: Sequence[str], slots: Mapping[Slot, str]) -> str | None:
        return candidates[0] if candidates else None

    def prepare(self, seats: Seats) -> object | None:
        """On the broker's loop: what a re-plan needs from the seats and the link book, copied (None: nothing to
        plan). `decide` then runs in a worker thread and touches nothing the loop changes."""
        return None

    def decide(self, job: object) -> Change | None:
        return None

    def propose(self, seats: Seats) -> Change | None:
        """`prepare` and `decide` in one call (tests, and callers without a worker thread)."""
        job = self.prepare(seats)
        return self.decide(job) if job is not None else None

    def bind(self, speed: Callable[[str], float]) -> None:
        """The seating tells where providers' speeds come from (their hardware profiles)."""

    def moved(self, change: Change) -> None:
        pass

    def forget(self, peer: str) -> None:
        pass


FirstFit = Placer


@dataclass(frozen=True, slots=True)
class _Job:
    seats: Seats
    lanes: list[int]
    peers: list[str]
    model: CostModel


@dataclass(frozen=True, kw_only=True, slots=True)
class PlacerConfig:
    replan: ReplanConfig = ReplanConfig()
    planner: PlannerConfig = PlannerConfig(time_budget_s=0.5)


class NetworkPlacer(Placer):
    """The network's answers (see the module). `speed(peer)`: its measured flop/s (0: unknown)."""

    name = "network"

    def __init__(self, book: LinkBook, run: RunBytes, speed: Callable[[str], float] = lambda p: 0.0,
                 config: PlacerConfig = PlacerConfig(), *, clock: Callable[[], float] = time.monotonic):
        self.book, self.run, self.speed, self.config, self.clock = book, run, speed, config, clock
        self.replanner = Replanner(config.replan, clock)
        self.check_s = config.replan.check_s
        self.last: dict = {}  # the last re-plan's figures, for logs and the bench

    # -- incremental: one candidate at a time ------------------------------------------------------------
    def _model(self, peers: list[str], lanes: int) -> CostModel:
        net = self.book.network(peers, [self.speed(p) for p in peers])
        wl = self.run.workload(lanes)
        pad = wl.slots - len(peers)  # the cost model wants room for a whole grid; pad with unreachable devices
        if pad > 0:
            n = len(peers) + pad
            lat, bw = np.zeros((n, n)), np.zeros((n, n))
            lat[:len(peers), :len(peers)] = net.latency_s
            bw[:len(peers), :len(peers)] = net.bandwidth_bps
            speed = np.zeros(n)
            speed[:len(peers)] = net.speed_flops
            net = Network(lat, bw, speed)
        return CostModel(net, wl)

    def _added_cost(self, slot: Slot, candidates: Sequence[str], slots: Mapping[Slot, str]) -> list[float]:
        """What each candidate adds to the step in `slot`: its stage group's slowest data-parallel member with it,
        its lane links to the neighbours present, its own compute."""
        stage, lane = slot
        group = [p for (s, _), p in slots.items() if s == stage and p not in candidates]
        near = {s: p for s in (stage - 1, stage + 1) if (p := slots.get((s, lane))) is not None}
        peers = list(dict.fromkeys([*candidates, *group, *near.values()]))
        m = self._model(peers, max(1, len(group) + 1))
        idx = {p: i for i, p in enumerate(peers)}
        g = np.array([idx[p] for p in group], dtype=np.intp)
        k = m.dp_kind[stage]
        out = []
        for c in candidates:
            i = idx[c]
            members = np.append(g, i)
            dp = m.dp_pair[k][np.ix_(members, members)].sum(axis=1).max() if len(members) > 1 else 0.0
            pp = 0.0
            if stage - 1 in near:
                pp += m.pp_pair[m.pp_kind[stage - 1]][idx[near[stage - 1]], i]
            if stage + 1 in near:
                pp += m.pp_pair[m.pp_kind[stage]][i, idx[near[stage + 1]]]
            out.append(float(dp + pp + m.compute_s[stage, i]))
        return out

    def bind(self, speed: Callable[[str], float]) -> None:
        self.speed = speed

    def _clearly_cheapest(self, costs: list[float]) -> int:
        """The caller's first choice, unless another is cheaper by more than min_gain (noise picks nothing)."""
        best = int(np.argmin(costs))
        return best if costs[best] < (1 - self.config.replan.min_gain) * costs[0] else 0

    def choose_slot(self, peer: str, free: Sequence[Slot], slots: Mapping[Slot, str]) -> Slot | None:
        if len(free) < 2:
            return free[0] if free else None
        return free[self._clearly_cheapest([self._added_cost(s, [peer], slots)[0] for s in free])]

    def choose_backup(self, slot: Slot, candidates: Sequence[str], slots: Mapping[Slot, str]) -> str | None:
        if len(candidates) < 2:
            return candidates[0] if candidates else None
        return candidates[self._clearly_cheapest(self._added_cost(slot, list(candidates), slots))]

    # -- re-planning --------------------------------------------------------------------------------------
    def prepare(self, seats: Seats) -> _Job | None:
        """The complete lanes, their providers and the backups, and the cost model over them (planning figures
        from the link book, read here on the broker's loop)."""
        S = seats.stages
        lanes = sorted(r for r in range(seats.replicas) if all((s, r) in seats.slots for s in range(S)))
        if not lanes:
            self.replanner.drop()
            return None
        active = [seats.slots[(s, r)] for r in lanes for s in range(S)]
        peers = list(dict.fromkeys(active + [b for b in seats.backups if b not in set(active)]))
        return _Job(seats, lanes, peers, self._model(peers, len(lanes)))

    def decide(self, job: object) -> Change | None:
        """A re-plan over the prepared providers; the next lane move towards an adopted target, when one is due
        (see swarm/run/replan.py). Runs in a worker thread: touches only `job` and the replanner."""
        assert isinstance(job, _Job)
        seats, lanes, peers, model = job.seats, job.lanes, job.peers, job.model
        S = seats.stages
        idx = {p: i for i, p in enumerate(peers)}
        current = np.array([[idx[seats.slots[(s, r)]] for r in lanes] for s in range(S)], dtype=np.intp)
        now_cost = model.total(current)
        plan = Planner(model, self.config.planner, clock=self.clock).plan()
        target = keep_in_place(model, plan.grid, current)
        target_cost = model.total(target)
        members = {s: [int(d) for d in current[s]] for s in range(S)}
        cost_s = migration_seconds(model, current, target, state_bytes=self.run.state_bytes,
                                   first_visit_bytes=self.run.first_visit_bytes, sources=lambda s, d: members[s])
        ids = np.array(peers + [""] * (model.n - len(peers)), dtype=object)
        now_ids, target_ids = ids[current], ids[target]
        held = self.replanner.target
        held_cost = None
        if held is not None:  # the target being reached must still pay from here, on today's figures
            ok = held.grid.shape == current.shape and all(p in idx for p in held.grid.ravel())
            held_cost = model.total(self._indices(held.grid, idx)) if ok else np.inf
            if not self.replanner.judge(now_cost, held_cost, 0.0, seats.steps_left).adopt:
                self.replanner.drop()
                held_cost = None
        verdict = self.replanner.offer(target_ids, target_cost, now_cost, cost_s, seats.steps_left, held_cost)
        self.last = {"now_s": now_cost, "target_s": target_cost, "migration_s": cost_s, "adopt": verdict.adopt,
                     "why": verdict.why, "planned_in_s": plan.seconds}
        step = self.replanner.next_lane(now_ids)
        if step is None:
            return None
        lane, cells = step
        grid = now_ids.copy()
        to_pool: list[str] = []
        for (s, ln), p in cells.items():
            old = grid[s, ln]
            where = np.argwhere(grid == p)
            if len(where):  # an active provider moves: the one it replaces takes its old slot
                grid[tuple(where[0])] = old
            else:  # a backup is promoted: the one it replaces goes to the pool
                to_pool.append(old)
            grid[s, ln] = p
        assign = {(s, lanes[ln]): grid[s, ln] for s in range(S) for ln in range(len(lanes))
                  if grid[s, ln] != now_ids[s, ln]}
        moved = tuple(sorted(set(assign.values()) | set(to_pool)))
        return Change(assign=assign, to_pool=tuple(to_pool), moved=moved,
                      why=f"lane {lanes[lane]} towards the plan "
                          f"({verdict.why if verdict.adopt else 'adopted earlier'})",
                      before_s=now_cost, after_s=float(model.total(self._indices(grid, idx))))

    @staticmethod
    def _indices(grid: np.ndarray, idx: Mapping[str, int]) -> np.ndarray:
        return np.array([[idx[p] for p in row] for row in grid], dtype=np.intp)

    def moved(self, change: Change) -> None:
        self.replanner.moved(change.moved)

    def forget(self, peer: str) -> None:
        self.book.forget(peer)
