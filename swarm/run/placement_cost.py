"""The predicted time of one optimizer step for a placement: DT-FM's data-parallel and pipeline terms over the
measured links, with the run's real bytes after compression, plus per-stage compute from each device's speed.

A placement is a grid `grid[s, l]` = the device holding stage s of lane l (S stages x D lanes). With α_ab the
one-way latency (s) and β_ab the bandwidth (bit/s) from a to b (docs/placement.md, "The cost model"):

- data parallel: the members of a stage group s exchange their shards with every other member (a sharded parameter
  server: scatter and gather), g_s bytes per member per step after compression:
  DP = max_s max_{a in C_s} sum_{b in C_s, b != a} (α_ab + α_ba) + 8 (g_s / D) (1/β_ab + 1/β_ba)
  (DT-FM's 2(α + 8c/(βD)) when the links are symmetric);
- pipeline: each boundary s -> s+1 waits for its slowest lane, forward f_s bytes a -> b and backward b_s bytes b -> a:
  PP = sum_s max_l  α_ab + α_ba + 8 f_s/β_ab + 8 b_s/β_ba  with a = grid[s, l], b = grid[s+1, l]
  (DT-FM's 2 COST_PP when f_s = b_s = c_act);
- compute: a lane runs GPipe with M micro-batches, stage s of lane l taking t_sl = flops_s / speed(grid[s, l]) per
  step: COMPUTE = max_l ( sum_s t_sl / M + (M - 1)/M max_s t_sl ) (zero when the speeds are unknown);
- TOTAL = DP + PP + COMPUTE.

Everything is numpy over precomputed pair matrices: one placement costs tens of microseconds and `evaluate_many`
prices thousands at once. `wire` is DT-FM's own step for given stage groups: exact bottleneck matchings between
groups (threshold search) and the stage order that minimises the pipeline term (Held-Karp over open paths)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np

INF = float("inf")
HELD_KARP_MAX = 12  # stage counts up to this are ordered exactly; beyond, nearest neighbour and 2-opt


@dataclass(frozen=True, kw_only=True, slots=True)
class Workload:
    """What one optimizer step moves and computes, per stage and per stage boundary (after compression)."""

    stages: int
    lanes: int
    grad_bytes: tuple[float, ...]  # per stage: bytes a member's shard exchange moves per step (DT-FM's c_grad)
    fwd_bytes: tuple[float, ...] = ()  # per boundary s -> s+1: activation bytes one lane sends per step
    bwd_bytes: tuple[float, ...] = ()  # per boundary: gradient bytes one lane sends back per step
    flops: tuple[float, ...] = ()  # per stage: floating-point operations one lane's stage does per step (0: ignore)
    micro_batches: int = 1

    def __post_init__(self) -> None:
        if self.stages < 1 or self.lanes < 1 or self.micro_batches < 1:
            raise ValueError("stages, lanes and micro_batches must be >= 1")
        if len(self.grad_bytes) != self.stages:
            raise ValueError(f"grad_bytes needs one value per stage ({self.stages})")
        for name, want in (("fwd_bytes", self.stages - 1), ("bwd_bytes", self.stages - 1),
                           ("flops", self.stages)):
            got = getattr(self, name)
            if got and len(got) != want:
                raise ValueError(f"{name} needs {want} values, not {len(got)}")
        if any(v < 0 for v in (*self.grad_bytes, *self.fwd_bytes, *self.bwd_bytes, *self.flops)):
            raise ValueError("bytes and flops must be >= 0")

    @property
    def slots(self) -> int:
        return self.stages * self.lanes

    def with_lanes(self, lanes: int) -> Workload:
        return Workload(stages=self.stages, lanes=lanes, grad_bytes=self.grad_bytes, fwd_bytes=self.fwd_bytes,
                        bwd_bytes=self.bwd_bytes, flops=self.flops, micro_batches=self.micro_batches)


@dataclass(frozen=True, slots=True, eq=False)
class Network:
    """Pair latencies (s) and bandwidths (bit/s, a -> b) of n devices, and each device's speed (flop/s; 0: unknown).
    A missing link is bandwidth 0 (its cost is infinite)."""

    latency_s: np.ndarray
    bandwidth_bps: np.ndarray
    speed_flops: np.ndarray = field(default_factory=lambda: np.zeros(0))

    def __post_init__(self) -> None:
        lat = np.asarray(self.latency_s, dtype=np.float64)
        bw = np.asarray(self.bandwidth_bps, dtype=np.float64)
        n = lat.shape[0] if lat.ndim == 2 else -1
        if lat.shape != (n, n) or bw.shape != (n, n):
            raise ValueError("latency_s and bandwidth_bps must be square and of one size")
        if np.any(~np.isfinite(lat)) or np.any(lat < 0) or np.any(np.isnan(bw)) or np.any(bw < 0):
            raise ValueError("latencies must be finite and >= 0, bandwidths >= 0")
        speed = np.asarray(self.speed_flops, dtype=np.float64)
        if speed.size == 0:
            speed = np.zeros(n)
        if speed.shape != (n,) or np.any(~np.isfinite(speed)) or np.any(speed < 0):
            raise ValueError("speed_flops needs one finite value >= 0 per device")
        object.__setattr__(self, "latency_s", lat)
        object.__setattr__(self, "bandwidth_bps", bw)
        object.__setattr__(self, "speed_flops", speed)

    @property
    def size(self) -> int:
        return self.latency_s.shape[0]

    @classmethod
    def from_ms_gbps(cls, latency_ms, bandwidth_gbps, speed_flops=()) -> Network:
        """DT-FM's units (milliseconds, Gbit/s)."""
        return cls(np.asarray(latency_ms, dtype=np.float64) / 1e3, np.asarray(bandwidth_gbps, dtype=np.float64) * 1e9,
                   np.asarray(speed_flops, dtype=np.float64))


@dataclass(frozen=True, slots=True)
class Cost:
    dp: float
    pp: float
    compute: float

    @property
    def total(self) -> float:
        return self.dp + self.pp + self.compute


def _inverse(bw: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        inv = np.where(bw > 0, 1.0 / np.where(bw > 0, bw, 1.0), INF)
    np.fill_diagonal(inv, 0.0)
    return inv


def _seconds(bits: float, inv: np.ndarray) -> np.ndarray:
    """Seconds to move `bits` over every pair (inv = s per bit): nothing to move costs nothing, also over a pair
    with no usable link (0 x inf would be NaN: a run with one lane has no data-parallel bytes)."""
    return np.zeros_like(inv) if bits == 0 else bits * inv


class CostModel:
    """Prices placements of `workload` on `network` (see the module). Immutable after construction."""

    def __init__(self, network: Network, workload: Workload):
        self.network, self.workload = network, workload
        n, S, D = network.size, workload.stages, workload.lanes
        if S * D > n:
            raise ValueError(f"{S} stages x {D} lanes need {S * D} devices; the network has {n}")
        inv = _inverse(network.bandwidth_bps)
        lat = network.latency_s.copy()
        np.fill_diagonal(lat, 0.0)
        self.n = n
        lat2 = lat + lat.T  # there and back
        inv2 = inv + inv.T
        # data parallel: per stage, the pair matrix (a, b) -> (α_ab + α_ba) + 8 g_s/D (1/β_ab + 1/β_ba)
        self._dp_kinds, self.dp_kind = _kinds(workload.grad_bytes)
        self.dp_pair = np.stack([lat2 + _seconds(8.0 * g / D, inv2) for g in self._dp_kinds])
        # pipeline: per boundary, (a at s, b at s+1) -> α_ab + α_ba + 8 f/β_ab + 8 b/β_ba
        fwd = workload.fwd_bytes or (0.0,) * (S - 1)
        bwd = workload.bwd_bytes or (0.0,) * (S - 1)
        self._pp_kinds, self.pp_kind = _kinds(tuple(zip(fwd, bwd)))
        mats = [lat2 + _seconds(8.0 * f, inv) + _seconds(8.0 * b, inv.T) for f, b in self._pp_kinds] or [lat2]
        self.pp_pair = np.stack(mats)
        for m in self.pp_pair:
            np.fill_diagonal(m, INF)  # a device never sits at two stages of one lane
        # compute: per stage and device, seconds per step
        flops = np.asarray(workload.flops or (0.0,) * S, dtype=np.float64)
        speed = network.speed_flops
        with np.errstate(divide="ignore", invalid="ignore"):
            t = np.where(speed[None, :] > 0, flops[:, None] / np.where(speed > 0, speed, 1.0)[None, :], 0.0)
        self.compute_s = t  # (S, n)
        self.has_compute = bool(np.any(t > 0))
        self._dp_idx = np.asarray(self.dp_kind, dtype=np.intp)
        self._pp_idx = np.asarray(self.pp_kind, dtype=np.intp)
        self._stage_idx = np.arange(S)
        self._pp_symmetric = bool(np.array_equal(self.pp_pair[0], self.pp_pair[0].T))

    # -- pricing --------------------------------------------------------------------------------------------
    def evaluate(self, grid) -> Cost:
        dp, pp, comp = self.evaluate_many(np.asarray(grid)[None])
        return Cost(float(dp[0]), float(pp[0]), float(comp[0]))

    def total(self, grid) -> float:
        return self.evaluate(grid).total

    def evaluate_many(self, grids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """DP, PP and COMPUTE of K grids (K, S, D) at once."""
        g = np.asarray(grids, dtype=np.intp)
        return self.dp_rows(g).max(axis=(1, 2)), self.pp_hops(g).max(axis=2).sum(axis=1), self.compute_of(g)

    def dp_rows(self, g: np.ndarray) -> np.ndarray:
        """(K, S, D): each member's data-parallel time within its stage group."""
        k = self._dp_idx[None, :, None, None]
        return self.dp_pair[k, g[:, :, :, None], g[:, :, None, :]].sum(axis=3)

    def pp_hops(self, g: np.ndarray) -> np.ndarray:
        """(K, S-1, D): each lane's time across each boundary."""
        if g.shape[1] < 2:
            return np.zeros((g.shape[0], 1, g.shape[2]))
        k = self._pp_idx[None, :, None]
        return self.pp_pair[k, g[:, :-1, :], g[:, 1:, :]]

    def compute_of(self, g: np.ndarray) -> np.ndarray:
        if not self.has_compute:
            return np.zeros(g.shape[0])
        t = self.compute_s[self._stage_idx[None, :, None], g]  # (K, S, D)
        m = self.workload.micro_batches
        lane = t.sum(axis=1) / m + (m - 1) / m * t.max(axis=1)
        return lane.max(axis=1)

    # -- DT-FM's wiring of given stage groups ---------------------------------------------------------------
    def group_dp(self, group, stage: int = 0) -> float:
        m = np.asarray(group, dtype=np.intp)
        return float(self.dp_pair[self.dp_kind[stage]][np.ix_(m, m)].sum(axis=1).max())

    def _links_between(self, groups: list[np.ndarray], cache: dict | None) -> tuple[np.ndarray, dict]:
        """B[i, j]: the bottleneck of the best matching of group i (stage s) to group j (stage s+1) on the first
        boundary's weights, and that matching."""
        S = len(groups)
        w = self.pp_pair[0]
        pairs = list(itertools.combinations(range(S), 2) if self._pp_symmetric
                     else itertools.permutations(range(S), 2))
        B = np.zeros((S, S))
        perms: dict[tuple[int, int], np.ndarray] = {}
        keys = [(groups[i].tobytes(), groups[j].tobytes()) for i, j in pairs]
        todo = [n for n, key in enumerate(keys) if cache is None or key not in cache]
        if todo:
            G = np.stack(groups)
            ii = np.asarray([pairs[n][0] for n in todo])
            jj = np.asarray([pairs[n][1] for n in todo])
            vals, ps = bottleneck_matchings(w[G[ii][:, :, None], G[jj][:, None, :]])
            found = {n: (float(v), pm) for n, v, pm in zip(todo, vals, ps)}
            if cache is not None:
                for n, hit in found.items():
                    cache[keys[n]] = hit
        for n, (i, j) in enumerate(pairs):
            B[i, j], perms[i, j] = cache[keys[n]] if cache is not None else found[n]
            if self._pp_symmetric:
                inv = np.empty_like(perms[i, j])
                inv[perms[i, j]] = np.arange(len(inv))
                B[j, i], perms[j, i] = B[i, j], inv
        return B, perms

    def wire(self, groups, cache: dict | None = None) -> np.ndarray:
        """The best grid whose stage groups are `groups` (S groups of D devices): the stage order minimising the
        pipeline term (open paths over the groups, edges the exact bottleneck matchings between two groups), and
        lanes chained along it by those matchings. In DT-FM's setting (one size for every stage and boundary, no
        compute) this is the best grid with these groups; otherwise the order and lanes are chosen on the first
        boundary's pipeline weights alone. `cache` (a dict the
        caller keeps for one model) remembers matchings of group pairs seen before."""
        groups = [np.asarray(gr, dtype=np.intp) for gr in groups]
        S = len(groups)
        if S == 1:
            return groups[0][None, :].copy()
        B, perms = self._links_between(groups, cache)
        _, order = open_path(B)
        D = len(groups[0])
        grid = np.empty((S, D), dtype=np.intp)
        grid[0] = groups[order[0]]
        pos = np.arange(D)  # pos[l]: the index within the current group of lane l's device
        for s in range(1, S):
            pos = perms[order[s - 1], order[s]][pos]
            grid[s] = groups[order[s]][pos]
        return grid

    def partition_cost(self, groups, cache: dict | None = None) -> Cost:
        """DT-FM's cost of a partition into stage groups: the cost of its best wiring (`wire`)."""
        groups = [np.asarray(gr, dtype=np.intp) for gr in groups]
        if self.has_compute or len(self._dp_kinds) > 1 or len(self._pp_kinds) > 1 or len(groups) == 1:
            return self.evaluate(self.wire(groups, cache))
        G = np.stack(groups)
        dp = float(self.dp_pair[0][G[:, :, None], G[:, None, :]].sum(axis=2).max())
        B, _ = self._links_between(groups, cache)
        return Cost(dp, open_path(B)[0], 0.0)


def _kinds(values: tuple) -> tuple[list, list[int]]:
    """Distinct values and, per position, the index of its value (stages sharing bytes share one pair matrix)."""
    kinds: list = []
    idx = []
    for v in values:
        if v not in kinds:
            kinds.append(v)
        idx.append(kinds.index(v))
    return kinds, idx


# -- exact sub-problems ---------------------------------------------------------------------------------------
def bottleneck_matching(w: np.ndarray) -> tuple[float, np.ndarray]:
    """min over perfect matchings of the largest edge, and one matching reaching it (perm[row] = column)."""
    w = np.asarray(w, dtype=np.float64)
    if w.ndim != 2 or w.shape[0] != w.shape[1] or w.shape[0] == 0:
        raise ValueError("a square, non-empty matrix is needed")
    values, perms = bottleneck_matchings(w[None])
    return float(values[0]), perms[0]


def bottleneck_matchings(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`bottleneck_matching` of P matrices (P, k, k) at once.

    Edges are admitted in increasing weight, starting with every edge up to the lower bound that each row and
    column imposes (its cheapest edge; computed for all P at once); augmenting paths (Kuhn) then extend the matching
    from the rows still free after each admitted weight. The first weight at which the matching is perfect is the
    bottleneck (inf, with the identity, when only infinite edges would complete it)."""
    P, k = w.shape[0], w.shape[1]
    lower = np.maximum(w.min(axis=2).max(axis=1), w.min(axis=1).max(axis=1))
    packed = np.packbits(w <= lower[:, None, None], axis=2, bitorder="little")
    values = np.empty(P)
    perms = np.empty((P, k), dtype=np.intp)
    for p in range(P):
        adj = [int.from_bytes(r.tobytes(), "little") for r in packed[p]]
        values[p], perms[p] = _bottleneck_from(w[p], float(lower[p]), adj)
    return values, perms


def _bottleneck_from(w: np.ndarray, lower: float, adj: list[int]) -> tuple[float, np.ndarray]:
    k = w.shape[0]
    if not np.isfinite(lower):
        return INF, np.arange(k)
    match_col = [-1] * k  # column -> row
    match_row = [-1] * k  # row -> column

    def augment(r: int, seen: list[int]) -> bool:
        avail = adj[r] & ~seen[0]
        while avail:
            bit = avail & -avail
            c = bit.bit_length() - 1
            seen[0] |= bit
            if match_col[c] < 0 or augment(match_col[c], seen):
                match_col[c], match_row[r] = r, c
                return True
            avail = adj[r] & ~seen[0]
        return False

    free = [r for r in range(k) if not augment(r, [0])]
    level = lower
    if free:
        flat = w.ravel()
        above = np.flatnonzero(flat > lower)
        order = above[np.argsort(flat[above], kind="stable")].tolist()
        vals = flat[order].tolist()
        i, n = 0, len(vals)
        while free:
            if i >= n or vals[i] == INF:
                return INF, np.arange(k)
            level = vals[i]
            while i < n and vals[i] == level:
                r, c = divmod(order[i], k)
                adj[r] |= 1 << c
                i += 1
            free = [r for r in free if not augment(r, [0])]
    return level, np.asarray(match_row, dtype=np.intp)


def open_path(cost: np.ndarray) -> tuple[float, list[int]]:
    """The cheapest path visiting every node once (any start, any end; cost[i, j] for i then j): Held-Karp over
    subsets, one vectorised layer per subset size."""
    c = np.asarray(cost, dtype=np.float64)
    S = c.shape[0]
    if S == 1:
        return 0.0, [0]
    if S > HELD_KARP_MAX:
        return _path_heuristic(c)
    full = 1 << S
    dp = np.full((full, S), INF)
    parent = np.full((full, S), -1, dtype=np.intp)
    bits = 1 << np.arange(S)
    dp[bits, np.arange(S)] = 0.0
    masks = np.arange(full)
    popcount = np.zeros(full, dtype=np.intp)
    for b in range(S):
        popcount += (masks >> b) & 1
    for size in range(1, S):
        m = masks[popcount == size]
        ext = dp[m][:, :, None] + c[None, :, :]  # (masks, from i, to j)
        frm = ext.argmin(axis=1)
        best = np.take_along_axis(ext, frm[:, None, :], axis=1)[:, 0, :]
        free = (m[:, None] & bits[None, :]) == 0
        rows, cols = np.nonzero(free)
        target = m[rows] | bits[cols]
        dp[target, cols] = best[rows, cols]
        parent[target, cols] = frm[rows, cols]
    last = int(dp[full - 1].argmin())
    total = float(dp[full - 1, last])
    order, mask = [last], full - 1
    while parent[mask, order[-1]] >= 0:
        p = int(parent[mask, order[-1]])
        mask ^= 1 << order[-1]
        order.append(p)
    return total, order[::-1]


def _path_heuristic(c: np.ndarray) -> tuple[float, list[int]]:
    S = c.shape[0]
    best_cost, best = INF, list(range(S))
    for start in range(S):
        order, left = [start], set(range(S)) - {start}
        while left:
            nxt = min(left, key=lambda j: c[order[-1], j])
            order.append(nxt)
            left.remove(nxt)
        improved = True
        while improved:  # 2-opt on the open path
            improved = False
            for i in range(S - 1):
                for j in range(i + 2, S + 1):
                    cand = order[:i] + order[i:j][::-1] + order[j:]
                    if _path_cost(c, cand) < _path_cost(c, order) - 1e-15:
                        order, improved = cand, True
        cost = _path_cost(c, order)
        if cost < best_cost:
            best_cost, best = cost, order
    return best_cost, best


def _path_cost(c: np.ndarray, order) -> float:
    return float(sum(c[a, b] for a, b in zip(order, order[1:])))
