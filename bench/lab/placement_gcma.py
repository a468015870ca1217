"""DT-FM's memetic search (GCMA), re-implemented from its scheduler (DS3Lab/DT-FM @cda948f,
`scheduler/heuristic_evolutionary_solver/scheduler.py`), as the baseline `shoal bench placement` measures against.

Faithful to the reference, step by step:
- a partition is a label per device (its stage group), every group of the same size D;
- a population of 100 random balanced partitions (a shuffled device list cut into groups of D);
- 4,900 offspring: two parents drawn uniformly (with replacement), five-point crossover (five devices take their
  label from parent 1 into a copy of parent 2), then the repair that walks the devices in order and moves each one
  whose group is over-full into the first under-full group;
- local search: one pass of cyclic partitioning ("default" mode: gains from the pipeline weights; a device's gain
  towards another group is its mean pipeline weight to that group's devices, towards its own group its smallest
  weight to a group mate; per group the unlocked device with the smallest own-group gain is the candidate, moved
  to the group of its largest gain; cycles of moves until the cycle returns to its start group, the best prefix
  kept and closed; at most one cycle per group; moved devices and receiving groups locked; the best prefix of
  cycles kept);
- each offspring is priced by DT-FM's partition cost (`CostModel.partition_cost`: exact bottleneck matchings and
  the best open path over the groups);
- the offspring replaces the worse of its parents if it is better. (The reference's acceptance line has a typo,
  `offspring_score > max(score1, offspring_score > score2)`; its intent is implemented.)

Differences, all said here: the reference seeds its generators by assignment (`random.seed = i`), so its runs are
not reproducible; here one `numpy.random.Generator(seed)` drives everything. Where the reference would fail (a
cycle with no movable device and no earlier move: an IndexError), the cycle ends. The pipeline weights are the cost
model's (both directions of a hop), twice the reference's one-way weight: every comparison the search makes is
unchanged by that factor.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from shoal.swarm.run.placement_cost import CostModel

POPULATION = 100
OFFSPRING = 4900
CROSSOVER_POINTS = 5


@dataclass
class GcmaResult:
    labels: np.ndarray  # the best partition found: device -> group
    grid: np.ndarray  # its wiring (stages x lanes)
    total: float
    seconds: float
    curve: list[float] = field(default_factory=list)  # the best total after each evaluation (100 + 4,900)


def random_partition(n: int, way: int, rng: np.random.Generator) -> np.ndarray:
    """A shuffled device list cut into `way` groups of n/way: the reference's initial individual, as labels."""
    labels = np.empty(n, dtype=np.intp)
    labels[rng.permutation(n)] = np.arange(n) // (n // way)
    return labels


def groups_of(labels: np.ndarray, way: int) -> list[np.ndarray]:
    return [np.flatnonzero(labels == j) for j in range(way)]


def five_point_crossover(p1: np.ndarray, p2: np.ndarray, way: int, rng: np.random.Generator) -> np.ndarray:
    n = len(p1)
    size = n // way
    child = p2.copy()
    points = rng.permutation(n)[:CROSSOVER_POINTS]
    child[points] = p1[points]
    sizes = np.bincount(child, minlength=way)
    for i in range(n):  # the reference's repair, in device order
        if sizes[child[i]] > size:
            j = int(np.flatnonzero(sizes < size)[0])
            sizes[j] += 1
            sizes[child[i]] -= 1
            child[i] = j
    return child


class CyclicPartitioning:
    """The reference's `cyclic_partitioning(..., mode="default")` over one model's pipeline weights."""

    def __init__(self, model: CostModel, way: int, weights: np.ndarray | None = None):
        """`weights`: the pipeline weight of each device pair (default: the model's first boundary's, halved: the
        reference's one-way weight). The bench passes the reference's own arithmetic (delay/1e3 + 8 c/β in ms,
        GB and Gbit/s) so that ties between equal weights break exactly as in the reference."""
        w = (model.pp_pair[0] / 2.0 if weights is None else np.asarray(weights, dtype=np.float64)).copy()
        np.fill_diagonal(w, 0.0)
        self.w, self.way, self.n = w, way, w.shape[0]
        self._eye = np.eye(self.n, dtype=bool)

    def gains(self, cur: np.ndarray, locked: np.ndarray):
        """The reference's `calculate_gain_default`: G_ij, G_i and each group's (device, target group)."""
        way, n = self.way, self.n
        onehot = np.zeros((n, way))
        onehot[np.arange(n), cur] = 1.0
        sizes = onehot.sum(axis=0)
        # the reference adds w/size for each device of the group in device order: the same sums, the same rounding
        # (a cumulative sum is sequential; adding the zeros of other groups' devices changes no bit)
        gain = np.zeros((n, way))
        for q in range(way):
            members = np.flatnonzero(cur == q)  # ascending, as the reference visits them
            if members.size:
                gain[:, q] = np.cumsum(self.w[:, members] / sizes[q], axis=1)[:, -1]
        same = (cur[:, None] == cur[None, :]) & ~self._eye
        own = np.where(same, self.w, np.inf).min(axis=1)
        gain[np.arange(n), cur] = own
        gain[locked] = 0.0
        # per group, the first unlocked device with the smallest (finite) own-group gain
        key = np.where(~locked & np.isfinite(own), own, np.inf)
        by_group = np.where(cur[None, :] == np.arange(way)[:, None], key[None, :], np.inf)
        v = by_group.argmin(axis=1)
        has = np.isfinite(by_group[np.arange(way), v])
        G_ij = gain[v] - gain[v, np.arange(way)][:, None]
        G_ij[np.arange(way), np.arange(way)] = -np.inf
        G_ij[~has] = -np.inf
        q = G_ij.argmax(axis=1)
        G_i = G_ij[np.arange(way), q]
        trace = [(int(v[p]), int(q[p])) if has[p] else (None, None) for p in range(way)]
        return G_ij, G_i, trace

    def __call__(self, offspring: np.ndarray) -> np.ndarray:
        way, n = self.way, self.n
        sums = [0.0]
        locked_part = np.zeros(way, dtype=bool)
        locked = np.zeros(n, dtype=bool)
        found = [offspring]
        for _ in range(way):
            cur = found[-1].copy()
            moves: list[tuple[int, int, int]] = []
            eps: list[float] = []
            tau: list[float] = []
            G_ij, G_i, trace = self.gains(cur, locked)
            s0 = si = int(np.argmax(G_i))
            for _ in range(n):
                v, pv = trace[si]
                if v is None:
                    if not moves:
                        break  # the reference fails here (no movable device, no earlier move)
                    v, pv = moves[-1][0], s0
                cur[v] = pv
                locked[v] = True
                locked_part[pv] = True
                moves.append((v, si, pv))
                eps.append(float(G_i[si]))
                tau.append(float(G_ij[si, s0]))
                si = pv
                if si == s0:
                    break
                G_ij, G_i, trace = self.gains(cur, locked)
            if not moves:
                break
            best_sum, best_l = 0.0, 0
            for i in range(1, len(eps)):
                gain = float(np.sum(eps[:i])) + tau[i]
                if gain > best_sum:
                    best_sum, best_l = gain, i
            for i in range(len(eps) - 1, best_l, -1):
                cur[moves[i][0]] = moves[i][1]
            cur[moves[best_l][0]] = s0
            found.append(cur)
            sums.append(best_sum)
            if locked_part.all():
                break
        best, m = 0.0, 0
        for i in range(1, len(sums)):
            prefix = float(np.sum(sums[:i]))
            if prefix > best:
                best, m = prefix, i - 1
        return found[m]


def gcma(model: CostModel, seed: int, *, population: int = POPULATION, offspring: int = OFFSPRING,
         weights: np.ndarray | None = None, clock=time.perf_counter) -> GcmaResult:
    """One GCMA run on `model` (its workload's stages are the groups, its lanes their size); `weights` as for
    `CyclicPartitioning`."""
    start = clock()
    rng = np.random.default_rng(seed)
    n, way = model.n, model.workload.stages
    if n != model.workload.slots:
        raise ValueError("GCMA places exactly stages x lanes devices")
    cache: dict = {}
    local = CyclicPartitioning(model, way, weights)

    def price(labels: np.ndarray) -> float:
        return model.partition_cost(groups_of(labels, way), cache).total

    pop = [random_partition(n, way, rng) for _ in range(population)]
    scores = [price(p) for p in pop]
    best_i = int(np.argmin(scores))
    best, best_labels = scores[best_i], pop[best_i]
    curve = list(np.minimum.accumulate(scores))
    for _ in range(offspring):
        i, j = (int(x) for x in rng.integers(population, size=2))
        child = local(five_point_crossover(pop[i], pop[j], way, rng))
        score = price(child)
        worse = i if scores[i] > scores[j] else j
        if score < scores[worse]:
            pop[worse], scores[worse] = child, score
        if score < best:
            best, best_labels = score, child
        curve.append(best)
        if len(cache) > 200_000:
            cache.clear()
    grid = model.wire(groups_of(best_labels, way), cache)
    return GcmaResult(labels=best_labels, grid=grid, total=model.total(grid), seconds=clock() - start, curve=curve)
