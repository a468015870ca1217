"""shoal's placement planner: which device holds which stage of which lane, for the cost model of
`placement_cost` (docs/placement.md, "The planner").

The step-time objective is a sum of maxima (the slowest stage group, the slowest lane at each boundary), so it is
flat under single swaps: moving one device off a bottleneck changes nothing while another one sits there. The planner
therefore works on structure first and devices last:

1. Sites: devices are clustered by their pipeline weights (single linkage at the largest gaps between the link
   figures), at a few levels from "every device alone" to "all in one".
2. Block layouts: sites fill the grid one after another, each in lane segments of its block height h (a segment
   goes into the lane filled least far: `skyline_fill`), so a site holds a block of h stages x some lanes (h = S:
   lanes inside sites; h = 1: stage groups inside sites). From every uniform height, a site-level hill climb
   swaps two sites in the order or changes one site's height, every neighbour priced at once.
3. Wiring: the best layouts get DT-FM's exact step for their stage groups (`CostModel.wire`: bottleneck matchings
   by threshold search, the best stage order).
4. Devices: a hill climb over swaps of two devices, or of a device and a spare, restricted to the devices on a
   bottleneck (every device in small networks), priced in batches; ties on the step time are broken by a smoothed
   objective (the mean lane at each boundary, the mean group), so a run of swaps can clear a bottleneck that one
   swap alone cannot.
5. Kicks: the best plan is perturbed by a few random swaps and climbed again (iterated local search), until
   `kicks` perturbations in a row bring nothing or the time is up.

Everything is deterministic for the same inputs (the seed orders ties only), and bounded by `time_budget_s`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from shoal.swarm.run.placement_cost import Cost, CostModel

GAP = 1.25  # a jump by this factor between sorted link weights separates two levels of sites
MAX_LEVELS = 6
TOP_LAYOUTS = 4  # layouts wired and polished device by device
TOL = 1e-9
MAX_SITES_SEARCHED = 16  # the order of at most this many sites is searched (pairs of sites: 120 layouts a step)


@dataclass(frozen=True, slots=True, eq=False)
class Plan:
    grid: np.ndarray  # (stages, lanes) device indices
    cost: Cost
    spares: tuple[int, ...]  # devices left out (the backup pool)
    seconds: float  # planning time
    how: str  # the layout it came from, for logs and the bench


@dataclass(frozen=True, kw_only=True, slots=True)
class PlannerConfig:
    time_budget_s: float = 1.5
    top_layouts: int = TOP_LAYOUTS
    polish_rounds: int = 200  # device swaps at most, per climb
    kicks: int = 40  # perturbations of the best plan (a few random swaps, then a climb) without a gain before it stops
    kick_swaps: int = 3
    full_neighbourhood: int = 24  # up to this many devices, a climb tries every swap, not only the bottlenecks'
    seed: int = 0  # orders the perturbations (the same seed, the same plan)

    def __post_init__(self) -> None:
        if self.time_budget_s <= 0 or self.top_layouts < 1 or self.polish_rounds < 0 or self.kicks < 0 \
                or self.kick_swaps < 1:
            raise ValueError("a positive time budget, top_layouts >= 1, kick_swaps >= 1, rounds and kicks >= 0")


def site_levels(model: CostModel) -> list[np.ndarray]:
    """Clusterings of the devices (a site label per device), coarsest last: single linkage on the symmetric
    pipeline weight, cut below each of the largest relative gaps in the sorted weights."""
    n = model.n
    w = np.maximum(model.pp_pair[0], model.pp_pair[0].T)
    off = w[~np.eye(n, dtype=bool)]
    finite = np.unique(off[np.isfinite(off)])
    levels = [np.arange(n)]
    if finite.size:
        ratios = finite[1:] / np.maximum(finite[:-1], 1e-300)
        cuts = np.flatnonzero(ratios >= GAP)
        cuts = cuts[np.argsort(-ratios[cuts], kind="stable")][:MAX_LEVELS - 2]
        for c in sorted(cuts.tolist()):
            levels.append(_components(w <= finite[c]))
        levels.append(_components(np.isfinite(w) | np.eye(n, dtype=bool)))
    out: list[np.ndarray] = []
    for lab in levels:
        if not any(np.array_equal(lab, o) for o in out):
            out.append(lab)
    return out


def _components(adj: np.ndarray) -> np.ndarray:
    n = adj.shape[0]
    label = np.full(n, -1, dtype=np.intp)
    nxt = 0
    for i in range(n):
        if label[i] >= 0:
            continue
        stack = [i]
        label[i] = nxt
        while stack:
            v = stack.pop()
            for u in np.flatnonzero(adj[v] & (label < 0)).tolist():
                label[u] = nxt
                stack.append(u)
        nxt += 1
    return label


def skyline_fill(stages: int, lanes: int, blocks) -> tuple[np.ndarray, list[int]]:
    """Fill the grid site by site: `blocks` is a sequence of (devices of one site, block height h). Each site's
    devices go, h at a time, into the lane filled least far (the lowest lane on ties), down h consecutive stages
    (fewer where the lane ends). Uniform h = S keeps lanes inside sites; h = 1 fills stage group after stage
    group. Devices left when the grid is full are returned as spares."""
    grid = np.full((stages, lanes), -1, dtype=np.intp)
    sky = np.zeros(lanes, dtype=np.intp)
    spares: list[int] = []
    for devices, h in blocks:
        i, k = 0, len(devices)
        while i < k:
            lane = int(np.argmin(sky))
            top = int(sky[lane])
            if top >= stages:
                spares.extend(int(d) for d in devices[i:])
                break
            t = min(h, stages - top, k - i)
            grid[top:top + t, lane] = devices[i:i + t]
            sky[lane] += t
            i += t
    return grid, spares


class Planner:
    """Plans placements for one cost model (see the module)."""

    def __init__(self, model: CostModel, config: PlannerConfig = PlannerConfig(), *,
                 clock: Callable[[], float] = time.perf_counter):
        self.model, self.config, self.clock = model, config, clock
        wl = model.workload
        self.S, self.D, self.n = wl.stages, wl.lanes, model.n
        self.slots = self.S * self.D
        self._cache: dict = {}

    # -- pricing ------------------------------------------------------------------------------------------
    def score(self, grids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Step time and the smoothed tie-break of K grids."""
        m = self.model
        dp_rows = m.dp_rows(grids)
        hops = m.pp_hops(grids)
        dp_group = dp_rows.max(axis=2)
        total = dp_group.max(axis=1) + hops.max(axis=2).sum(axis=1) + m.compute_of(grids)
        smooth = dp_group.mean(axis=1) + hops.mean(axis=2).sum(axis=1)
        return total, smooth

    # -- the plan -----------------------------------------------------------------------------------------
    def plan(self, order: np.ndarray | None = None) -> Plan:
        """The best placement found within the time budget. `order`: the devices in preference order (spares are
        taken from its end when the layouts tie); default: by index."""
        start = self.clock()
        deadline = start + self.config.time_budget_s
        devices = np.arange(self.n) if order is None else np.asarray(order, dtype=np.intp)
        layouts: list[tuple[float, float, np.ndarray, str]] = []
        for li, sites in enumerate(site_levels(self.model)):
            for h in range(self.S, 0, -1):
                grid, how = self._best_site_order(devices, sites, h, f"level {li}, h={h}", deadline)
                ts, sms = self.score(grid[None])
                layouts.append((float(ts[0]), float(sms[0]), grid, how))
                if self.clock() > deadline:
                    break
            if self.clock() > deadline:
                break
        layouts.sort(key=lambda x: (x[0], x[1]))
        best: tuple[float, float, np.ndarray, str] | None = None
        seen: list[np.ndarray] = []
        for t, sm, grid, how in layouts[:max(1, self.config.top_layouts)]:
            if any(np.array_equal(grid, g) for g in seen):
                continue
            seen.append(grid)
            cand = [(t, sm, grid, how)]
            wired = self.model.wire(list(grid), self._cache)
            wt, wsm = self.score(wired[None])
            cand.append((float(wt[0]), float(wsm[0]), wired, how + ", wired"))
            t, sm, grid, how = min(cand, key=lambda x: (x[0], x[1]))
            if self.clock() < deadline:
                grid, t, sm = self._polish(grid, devices, deadline)
                how += ", polished"
            if best is None or _better(t, sm, best[0], best[1]):
                best = (t, sm, grid, how)
        assert best is not None
        best = self._kick(best, devices, deadline)
        grid = best[2]
        used = set(grid.ravel().tolist())
        return Plan(grid=grid, cost=self.model.evaluate(grid), spares=tuple(d for d in devices.tolist()
                                                                              if d not in used),
                    seconds=self.clock() - start, how=best[3])

    # -- layouts ------------------------------------------------------------------------------------------
    def _layout(self, members: list[np.ndarray], order: list[int], heights: list[int]) -> np.ndarray:
        grid, _ = skyline_fill(self.S, self.D, [(members[s], heights[s]) for s in order])
        return grid

    def _best_site_order(self, devices: np.ndarray, sites: np.ndarray, h: int, how: str,
                         deadline: float) -> tuple[np.ndarray, str]:
        """Hill climb from every site at block height h, largest sites first: moves swap two sites in the fill
        order or give one site another block height; every neighbour is priced at once."""
        ids = np.unique(sites[devices]).tolist()
        members = {s: devices[sites[devices] == s] for s in ids}
        mem = [members[s] for s in ids]
        order = sorted(range(len(ids)), key=lambda i: (-len(mem[i]), ids[i]))
        heights = [h] * len(ids)
        cur = self._layout(mem, order, heights)
        if len(ids) > MAX_SITES_SEARCHED:  # many small sites: no site-level search (device swaps do the rest)
            return cur, how
        t, sm = self.score(cur[None])
        best = (float(t[0]), float(sm[0]))
        k = len(order)
        while self.clock() < deadline:
            cands: list[tuple[list[int], list[int]]] = []
            for i in range(k):
                for j in range(i + 1, k):
                    o = list(order)
                    o[i], o[j] = o[j], o[i]
                    cands.append((o, heights))
            for i in range(k):
                for hh in range(1, self.S + 1):
                    if hh != heights[i]:
                        hs = list(heights)
                        hs[i] = hh
                        cands.append((order, hs))
            if not cands:
                break
            grids = np.stack([self._layout(mem, o, hs) for o, hs in cands])
            tt, ss = self.score(grids)
            m = int(np.lexsort((ss, tt))[0])
            if not _better(tt[m], ss[m], *best):
                break
            (order, heights), cur, best = cands[m], grids[m], (float(tt[m]), float(ss[m]))
        return cur, how + (", heights " + ",".join(str(heights[i]) for i in order) if len(set(heights)) > 1 else "")

    # -- devices ------------------------------------------------------------------------------------------
    def _kick(self, best: tuple, devices: np.ndarray, deadline: float) -> tuple:
        """Iterated local search: a few random swaps of the best plan, a climb, the wiring of its groups; kept when
        better. Stops after `kicks` perturbations in a row without a gain, or at the deadline."""
        rng = np.random.default_rng(self.config.seed)
        t, sm, grid, how = best
        idle = 0
        pool = devices.copy()
        while idle < self.config.kicks and self.clock() < deadline:
            g = grid.ravel().copy()
            used = np.zeros(self.n, dtype=bool)
            used[g] = True
            spares = pool[~used[pool]]
            for _ in range(self.config.kick_swaps):
                a = int(rng.integers(self.slots))
                b = int(rng.integers(self.slots + len(spares)))
                if b < self.slots:
                    g[a], g[b] = g[b], g[a]
                else:
                    g[a], spares[b - self.slots] = spares[b - self.slots], g[a]
            cand, ct, csm = self._polish(g.reshape(self.S, self.D), devices, deadline)
            wired = self.model.wire(list(cand), self._cache)
            wt, wsm = (float(x[0]) for x in self.score(wired[None]))
            if _better(wt, wsm, ct, csm):
                cand, ct, csm = self._polish(wired, devices, deadline)
            if _better(ct, csm, t, sm):
                t, sm, grid, idle = ct, csm, cand, 0
                if not how.endswith(", kicked"):
                    how += ", kicked"
            else:
                idle += 1
        return t, sm, grid, how

    def _critical_cells(self, grid: np.ndarray) -> np.ndarray:
        """Cells on a bottleneck: the slowest stage group's members, each boundary's slowest lane's two ends, the
        slowest lane's compute."""
        m = self.model
        g = grid[None]
        crit = np.zeros((self.S, self.D), dtype=bool)
        dp_group = m.dp_rows(g)[0].max(axis=1)
        crit[dp_group >= dp_group.max() - TOL] = True
        if self.S > 1:
            hops = m.pp_hops(g)[0]
            worst = hops >= hops.max(axis=1, keepdims=True) - TOL
            crit[:-1] |= worst
            crit[1:] |= worst
        return np.flatnonzero(crit.ravel())

    def _polish(self, grid: np.ndarray, devices: np.ndarray, deadline: float) -> tuple[np.ndarray, float, float]:
        """Best-improvement swaps (a critical cell with any cell or spare) on (step time, smoothed), lexicographic."""
        cur = grid.copy()
        t, sm = (float(x[0]) for x in self.score(cur[None]))
        for _ in range(self.config.polish_rounds):
            if self.clock() > deadline:
                break
            flat = cur.ravel()
            used = np.zeros(self.n, dtype=bool)
            used[flat] = True
            spares = devices[~used[devices]]
            crit = self._critical_cells(cur) if self.slots + len(spares) > self.config.full_neighbourhood \
                else np.arange(self.slots)
            others = np.arange(self.slots)
            a = np.repeat(crit, len(others) + len(spares))
            b_cell = np.tile(np.concatenate([others, np.full(len(spares), -1)]), len(crit))
            b_dev = np.tile(np.concatenate([flat[others], spares]), len(crit))
            keep = b_cell != a
            a, b_cell, b_dev = a[keep], b_cell[keep], b_dev[keep]
            grids = np.repeat(flat[None], len(a), axis=0)
            rows = np.arange(len(a))
            grids[rows, a] = b_dev
            inside = b_cell >= 0
            grids[rows[inside], b_cell[inside]] = flat[a[inside]]
            tt, ss = self.score(grids.reshape(-1, self.S, self.D))
            i = int(np.lexsort((ss, tt))[0])
            if not _better(tt[i], ss[i], t, sm):
                break
            cur = grids[i].reshape(self.S, self.D)
            t, sm = float(tt[i]), float(ss[i])
        return cur, t, sm


def _better(t: float, sm: float, t0: float, sm0: float) -> bool:
    """(t, sm) before (t0, sm0): a shorter step, or the same step and a smaller smoothed objective."""
    return t < t0 - TOL * max(1.0, t0) or (t <= t0 + TOL * max(1.0, t0) and sm < sm0 - TOL * max(1.0, sm0))


def plan(model: CostModel, *, config: PlannerConfig = PlannerConfig(), order=None,
         clock: Callable[[], float] = time.perf_counter) -> Plan:
    return Planner(model, config, clock=clock).plan(order)
