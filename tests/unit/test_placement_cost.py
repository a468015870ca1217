"""The placement cost model: its formulas against plain loops, DT-FM's exact sub-steps against brute force on six
devices or fewer, and monotony: a slower link never makes a placement cheaper."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.swarm.run.placement_cost import (
    CostModel, Network, Workload, bottleneck_matching, open_path)


def random_network(rng: np.random.Generator, n: int, *, symmetric: bool = False, speeds: bool = False) -> Network:
    lat = rng.uniform(0.0, 0.1, (n, n))
    bw = rng.choice([1e7, 5e7, 1e8, 1e9], (n, n)) * rng.uniform(0.5, 1.5, (n, n))
    if symmetric:
        lat, bw = (lat + lat.T) / 2, (bw + bw.T) / 2
    np.fill_diagonal(lat, 0.0)
    np.fill_diagonal(bw, 0.0)
    return Network(lat, bw, rng.uniform(1e12, 5e12, n) if speeds else ())


def workload(S: int, D: int, *, uniform: bool = True, flops: bool = False, micro: int = 4) -> Workload:
    g = (4e6,) * S if uniform else tuple(4e6 * (s + 1) for s in range(S))
    f = (2e6,) * (S - 1) if uniform else tuple(1e6 * (s + 1) for s in range(S - 1))
    b = f if uniform else tuple(3e6 for _ in range(S - 1))
    return Workload(stages=S, lanes=D, grad_bytes=g, fwd_bytes=f, bwd_bytes=b,
                    flops=tuple(1e12 * (s + 1) for s in range(S)) if flops else (), micro_batches=micro)


def naive_cost(net: Network, wl: Workload, grid) -> tuple[float, float, float]:
    """The module's formulas, written as loops over devices."""
    S, D = wl.stages, wl.lanes
    lat, bw = net.latency_s, net.bandwidth_bps
    dp = 0.0
    for s in range(S):
        for a in grid[s]:
            t = 0.0
            for b in grid[s]:
                if a != b:
                    t += lat[a][b] + lat[b][a] + 8 * wl.grad_bytes[s] / D * (1 / bw[a][b] + 1 / bw[b][a])
            dp = max(dp, t)
    pp = 0.0
    for s in range(S - 1):
        worst = 0.0
        for lane in range(D):
            a, b = grid[s][lane], grid[s + 1][lane]
            worst = max(worst, lat[a][b] + lat[b][a] + 8 * wl.fwd_bytes[s] / bw[a][b] + 8 * wl.bwd_bytes[s] / bw[b][a])
        pp += worst
    comp = 0.0
    if wl.flops:
        M = wl.micro_batches
        for lane in range(D):
            t = [wl.flops[s] / net.speed_flops[grid[s][lane]] for s in range(S)]
            comp = max(comp, sum(t) / M + (M - 1) / M * max(t))
    return dp, pp, comp


@pytest.mark.parametrize("S,D,n", [(1, 3, 4), (2, 2, 4), (2, 3, 6), (3, 2, 6), (2, 2, 6), (6, 1, 6)])
@pytest.mark.parametrize("uniform", [True, False])
def test_every_placement_of_up_to_six_devices_costs_what_the_formulas_say(S, D, n, uniform):
    rng = np.random.default_rng(S * 100 + D * 10 + n)
    net = random_network(rng, n, speeds=True)
    wl = workload(S, D, uniform=uniform, flops=True)
    model = CostModel(net, wl)
    grids = np.array([np.array(p[:S * D]).reshape(S, D) for p in itertools.permutations(range(n), S * D)])
    dp, pp, comp = model.evaluate_many(grids)
    for k in range(0, len(grids), max(1, len(grids) // 60)):
        want = naive_cost(net, wl, grids[k].tolist())
        assert (dp[k], pp[k], comp[k]) == pytest.approx(want, rel=1e-12)
        assert model.evaluate(grids[k]).total == pytest.approx(sum(want), rel=1e-12)


@pytest.mark.parametrize("S,D", [(2, 2), (2, 3), (3, 2)])
@pytest.mark.parametrize("symmetric", [True, False])
def test_wiring_given_stage_groups_is_the_brute_force_best(S, D, symmetric):
    """DT-FM's partition cost: over every stage order and every lane matching of the same groups, none is cheaper
    than `wire`'s, and `partition_cost` prices exactly that grid."""
    for trial in range(5):
        rng = np.random.default_rng(trial)
        net = random_network(rng, S * D, symmetric=symmetric)
        model = CostModel(net, workload(S, D))
        groups = [list(g) for g in np.split(rng.permutation(S * D), S)]
        best = np.inf
        for order in itertools.permutations(range(S)):
            for perms in itertools.product(itertools.permutations(range(D)), repeat=S):
                grid = np.array([[groups[order[s]][perms[s][lane]] for lane in range(D)] for s in range(S)])
                best = min(best, model.total(grid))
        wired = model.wire(groups)
        assert sorted(map(sorted, wired.tolist())) == sorted(map(sorted, groups))
        assert model.total(wired) == pytest.approx(best, rel=1e-12)
        assert model.partition_cost(groups).total == pytest.approx(best, rel=1e-12)


@given(st.integers(1, 6), st.integers(0, 2**32 - 1), st.sampled_from([2, 3, 10]))
@settings(max_examples=150, deadline=None)
def test_bottleneck_matching_is_the_brute_force_bottleneck(k, seed, distinct):
    w = np.random.default_rng(seed).integers(0, distinct, (k, k)).astype(float)  # few values: many ties
    value, perm = bottleneck_matching(w)
    brute = min(max(w[r, p[r]] for r in range(k)) for p in itertools.permutations(range(k)))
    assert value == brute
    assert sorted(perm.tolist()) == list(range(k)) and w[np.arange(k), perm].max() == value


def test_bottleneck_matching_with_missing_links():
    w = np.array([[1.0, np.inf], [np.inf, np.inf]])
    assert bottleneck_matching(w)[0] == np.inf
    w = np.array([[np.inf, 2.0], [3.0, np.inf]])
    value, perm = bottleneck_matching(w)
    assert value == 3.0 and perm.tolist() == [1, 0]


@given(st.integers(1, 6), st.integers(0, 2**32 - 1))
@settings(max_examples=100, deadline=None)
def test_open_path_is_the_brute_force_shortest_path(S, seed):
    c = np.random.default_rng(seed).uniform(0, 10, (S, S))
    cost, order = open_path(c)
    brute = min(sum(c[a, b] for a, b in zip(p, p[1:])) for p in itertools.permutations(range(S)))
    assert cost == pytest.approx(brute, rel=1e-12)
    assert sorted(order) == list(range(S))
    assert sum(c[a, b] for a, b in zip(order, order[1:])) == pytest.approx(cost, rel=1e-12)


def test_open_path_beyond_held_karp_is_a_valid_path():
    c = np.random.default_rng(0).uniform(0, 10, (14, 14))
    cost, order = open_path(c)
    assert sorted(order) == list(range(14))
    assert cost == pytest.approx(sum(c[a, b] for a, b in zip(order, order[1:])))


@given(st.integers(0, 2**32 - 1), st.sampled_from([(2, 2, 5), (3, 2, 6), (2, 3, 7)]), st.booleans(),
       st.floats(0.01, 0.99))
@settings(max_examples=120, deadline=None)
def test_a_slower_link_never_makes_a_step_cheaper(seed, shape, symmetric, factor):
    """For a fixed placement and for DT-FM's best wiring of fixed groups: lowering any one bandwidth (one
    direction, or both) never lowers the predicted step time."""
    S, D, n = shape
    rng = np.random.default_rng(seed)
    net = random_network(rng, n, symmetric=symmetric, speeds=True)
    wl = workload(S, D, uniform=symmetric, flops=True)
    grid = rng.permutation(n)[:S * D].reshape(S, D)
    a, b = rng.choice(n, 2, replace=False)
    slower = net.bandwidth_bps.copy()
    slower[a, b] *= factor
    if symmetric:
        slower[b, a] *= factor
    before, after = CostModel(net, wl), CostModel(Network(net.latency_s, slower, net.speed_flops), wl)
    assert after.total(grid) >= before.total(grid)
    # DT-FM's setting (one size for every stage and boundary, no compute), where the wiring is exact
    dtfm = workload(S, D)
    groups = list(grid)
    slow, fast = CostModel(after.network, dtfm), CostModel(net, dtfm)
    assert slow.partition_cost(groups).total >= fast.partition_cost(groups).total
    longer = net.latency_s.copy()
    longer[a, b] += 0.05
    assert CostModel(Network(longer, net.bandwidth_bps, net.speed_flops), wl).total(grid) >= before.total(grid)


def test_inputs_are_checked():
    with pytest.raises(ValueError, match="grad_bytes"):
        Workload(stages=2, lanes=1, grad_bytes=(1.0,))
    with pytest.raises(ValueError, match="fwd_bytes"):
        Workload(stages=2, lanes=1, grad_bytes=(1.0, 1.0), fwd_bytes=(1.0, 2.0))
    with pytest.raises(ValueError, match="square"):
        Network(np.zeros((2, 3)), np.ones((2, 3)))
    with pytest.raises(ValueError, match=">= 0"):
        Network(-np.ones((2, 2)), np.ones((2, 2)))
    with pytest.raises(ValueError, match="need 6 devices"):
        CostModel(random_network(np.random.default_rng(0), 4), workload(2, 3))


def test_a_missing_link_makes_a_placement_that_uses_it_infinitely_slow():
    net = random_network(np.random.default_rng(3), 4)
    net.bandwidth_bps[0, 1] = 0.0
    model = CostModel(net, workload(2, 2))
    assert model.total(np.array([[0, 2], [1, 3]])) == np.inf  # lane 0 sends 0 -> 1
    assert np.isfinite(model.total(np.array([[0, 2], [3, 1]])))  # 0 and 1 share neither a group nor a lane


def test_nothing_to_send_costs_nothing_over_a_missing_link():
    """One lane has no data-parallel bytes: a pair with no usable link prices 0 there, not NaN (0 x inf), with no
    numpy warning (the test suite turns warnings into errors)."""
    net = random_network(np.random.default_rng(4), 3)
    net.bandwidth_bps[0, 1] = net.bandwidth_bps[1, 0] = 0.0
    model = CostModel(net, Workload(stages=3, lanes=1, grad_bytes=(0.0,) * 3, fwd_bytes=(2e6, 2e6),
                                    bwd_bytes=(2e6, 2e6), micro_batches=4))
    assert not np.isnan(model.dp_pair).any() and not np.isnan(model.pp_pair).any()
    assert np.isfinite(model.total(np.array([[0], [2], [1]])))  # 0 and 1 never talk
    assert model.total(np.array([[0], [1], [2]])) == np.inf  # 0 -> 1 is a lane hop
