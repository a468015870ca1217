"""shoal's placement planner: valid and deterministic plans, the brute-force optimum on small networks with sites,
plans that do not depend on how devices are numbered, slow devices left out; and the GCMA baseline's partitions
staying balanced."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.bench.placement_gcma import CyclicPartitioning, five_point_crossover, gcma, random_partition
from shoal.swarm.run.placement_cost import CostModel, Network, Workload
from shoal.swarm.run.placement_plan import Planner, PlannerConfig, plan, site_levels, skyline_fill


def sites_network(sizes, *, inside=(0.001, 1e9), between=((0.03, 1e8),), jitter=0.0, seed=0, speeds=()):
    """Devices in sites: `inside` (latency s, bandwidth bit/s) within a site; site pairs cycle through `between`."""
    rng = np.random.default_rng(seed)
    site = np.repeat(np.arange(len(sizes)), sizes)
    n = len(site)
    lat, bw = np.zeros((n, n)), np.zeros((n, n))
    pair = {}
    for a, b in itertools.combinations(range(len(sizes)), 2):
        pair[a, b] = pair[b, a] = between[len(pair) // 2 % len(between)]
    for i, j in itertools.permutations(range(n), 2):
        la, bb = inside if site[i] == site[j] else pair[site[i], site[j]]
        lat[i, j], bw[i, j] = la, bb * (1 + jitter * rng.uniform(-1, 1))
    bw = np.minimum(bw, bw.T)
    return Network(lat, bw, np.asarray(speeds, dtype=float)), site


def dtfm_like(S: int, D: int) -> Workload:
    return Workload(stages=S, lanes=D, grad_bytes=(6.5e7,) * S, fwd_bytes=(4.7e7,) * (S - 1),
                    bwd_bytes=(4.7e7,) * (S - 1))


class Ticks:
    """A clock that advances by a fixed step per reading: the time budget cuts a search at the same point."""

    def __init__(self, step: float = 1e-3):
        self.t, self.step = 0.0, step

    def __call__(self) -> float:
        self.t += self.step
        return self.t


def brute_force_best(model: CostModel) -> float:
    S, D, n = model.workload.stages, model.workload.lanes, model.n
    best = np.inf
    chunk = []
    for p in itertools.permutations(range(n), S * D):
        chunk.append(p)
        if len(chunk) == 20000:
            dp, pp, c = model.evaluate_many(np.array(chunk).reshape(-1, S, D))
            best = min(best, float((dp + pp + c).min()))
            chunk = []
    if chunk:
        dp, pp, c = model.evaluate_many(np.array(chunk).reshape(-1, S, D))
        best = min(best, float((dp + pp + c).min()))
    return best


def test_skyline_fill_puts_each_site_into_blocks_of_its_height():
    a, b = np.arange(0, 4), np.arange(4, 8)
    grid, spares = skyline_fill(2, 4, [(a, 2), (b, 2)])  # whole lanes
    assert grid.T.tolist() == [[0, 1], [2, 3], [4, 5], [6, 7]] and spares == []
    grid, _ = skyline_fill(2, 4, [(a, 1), (b, 1)])  # whole stage groups
    assert grid.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    grid, spares = skyline_fill(4, 2, [(a, 2), (b, 1), (np.arange(8, 11), 4)])  # mixed, and a spare
    assert grid.T.tolist() == [[0, 1, 4, 6], [2, 3, 5, 7]] and spares == [8, 9, 10]


def test_sites_are_found_at_the_gaps_between_link_figures():
    net, site = sites_network([4, 4, 2], jitter=0.05)
    levels = site_levels(CostModel(net, dtfm_like(2, 2)))
    assert len(np.unique(levels[0])) == 10 and len(np.unique(levels[-1])) == 1
    assert any(len(np.unique(lab)) == 3 and all(len(np.unique(lab[site == s])) == 1 for s in range(3))
               for lab in levels)


@pytest.mark.parametrize("sizes,S,D,between", [
    ([4, 4], 2, 4, ((0.03, 1e8),)),
    ([4, 4], 4, 2, ((0.03, 1e8),)),
    ([2, 2, 2, 2], 2, 4, ((0.01, 3e8), (0.08, 5e7))),
    ([3, 3, 1], 3, 2, ((0.02, 2e8), (0.05, 8e7))),  # a spare
    ([2, 2, 3], 2, 3, ((0.01, 5e8), (0.1, 2e7))),
])
def test_small_networks_with_sites_get_the_brute_force_optimum(sizes, S, D, between):
    net, _ = sites_network(sizes, between=between, jitter=0.02, seed=sum(sizes) * S)
    model = CostModel(net, dtfm_like(S, D))
    p = plan(model, config=PlannerConfig(time_budget_s=30.0))
    assert p.cost.total == pytest.approx(brute_force_best(model), rel=1e-9)


def test_a_plan_is_a_placement_and_the_rest_are_spares():
    net, _ = sites_network([5, 5, 3], jitter=0.1)
    p = plan(CostModel(net, dtfm_like(3, 3)), config=PlannerConfig(time_budget_s=5.0))
    used = p.grid.ravel().tolist()
    assert p.grid.shape == (3, 3) and len(set(used)) == 9
    assert sorted(used + list(p.spares)) == list(range(13))


def test_the_same_inputs_give_the_same_plan():
    net, _ = sites_network([8, 8, 8, 8], between=((0.01, 3e8), (0.05, 1e8), (0.1, 5e7)), jitter=0.2, seed=4)
    model = CostModel(net, dtfm_like(4, 8))
    a = Planner(model, PlannerConfig(time_budget_s=0.3), clock=Ticks()).plan()
    b = Planner(CostModel(net, dtfm_like(4, 8)), PlannerConfig(time_budget_s=0.3), clock=Ticks()).plan()
    assert np.array_equal(a.grid, b.grid) and a.spares == b.spares and a.cost == b.cost


def test_how_devices_are_numbered_does_not_change_the_cost_of_the_plan():
    net, _ = sites_network([8] * 4, between=((0.01, 3e8), (0.06, 1e8), (0.1, 4e7)), seed=2)
    wl = dtfm_like(4, 8)
    base = plan(CostModel(net, wl), config=PlannerConfig(time_budget_s=10.0)).cost.total
    for seed in range(3):
        perm = np.random.default_rng(seed).permutation(net.size)
        shuffled = Network(net.latency_s[np.ix_(perm, perm)], net.bandwidth_bps[np.ix_(perm, perm)])
        assert plan(CostModel(shuffled, wl), config=PlannerConfig(time_budget_s=10.0)).cost.total == \
            pytest.approx(base, rel=1e-12)


def test_a_slow_device_is_left_out_when_there_is_a_spare():
    net, _ = sites_network([5], speeds=[1e12, 1e12, 1e11, 1e12, 1e12])
    wl = Workload(stages=2, lanes=2, grad_bytes=(1e6, 1e6), fwd_bytes=(1e6,), bwd_bytes=(1e6,),
                  flops=(1e12, 1e12), micro_batches=4)
    p = plan(CostModel(net, wl))
    assert p.spares == (2,)


def test_the_planner_never_does_worse_than_the_layouts_it_starts_from():
    """Lanes kept inside sites (4 sites of 8 lanes' worth) is one of the layouts: the plan is at least as good."""
    net, site = sites_network([8] * 4, between=((0.01, 3e8), (0.06, 1e8)), jitter=0.1, seed=7)
    model = CostModel(net, dtfm_like(8, 4))
    lanes_in_sites = np.arange(32).reshape(4, 8).T
    assert plan(model).cost.total <= model.total(lanes_in_sites) + 1e-12


# -- the GCMA baseline --------------------------------------------------------------------------------------
@given(st.integers(0, 2**32 - 1), st.sampled_from([(16, 4), (12, 3), (64, 8), (10, 2)]))
@settings(max_examples=80, deadline=None)
def test_crossover_and_its_repair_keep_every_group_the_same_size(seed, shape):
    n, way = shape
    rng = np.random.default_rng(seed)
    child = five_point_crossover(random_partition(n, way, rng), random_partition(n, way, rng), way, rng)
    assert np.bincount(child, minlength=way).tolist() == [n // way] * way


@given(st.integers(0, 2**32 - 1))
@settings(max_examples=20, deadline=None)
def test_cyclic_partitioning_keeps_every_group_the_same_size(seed):
    net, _ = sites_network([4, 4, 4, 4], between=((0.01, 3e8), (0.06, 1e8)), jitter=0.3, seed=seed % 100)
    model = CostModel(net, dtfm_like(4, 4))
    out = CyclicPartitioning(model, 4)(random_partition(16, 4, np.random.default_rng(seed)))
    assert np.bincount(out, minlength=4).tolist() == [4] * 4


def test_gcma_improves_on_its_first_population_and_is_reproducible():
    net, _ = sites_network([4, 4, 4, 4], between=((0.01, 3e8), (0.06, 1e8), (0.1, 4e7)), jitter=0.1)
    model = CostModel(net, dtfm_like(4, 4))
    a = gcma(model, 0, population=20, offspring=60)
    assert a.curve[-1] < a.curve[19] and a.total == a.curve[-1] == model.total(a.grid)
    assert np.array_equal(gcma(model, 0, population=20, offspring=60).labels, a.labels)
