"""Property tests for the rolling mask, the top-k bitmap codec and CocktailSGD error feedback (docs/sync.md,
"CocktailSGD")."""

from __future__ import annotations

import hashlib
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from shoal.kernels.cocktail import CocktailCompressor, CocktailConfig
from shoal.kernels.mask import RollingMask
from shoal.kernels.quant import NonFiniteError
from shoal.kernels.topk import decode_topk_parts, encode_topk, topk_count, topk_sizes


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


@given(size=st.integers(0, 5000), p=st.sampled_from([0.1, 0.25, 0.4, 0.5, 1.0]), step=st.integers(0, 10**6))
def test_mask_equal_across_replicas_and_gather_matches_indices(size, p, step):
    a, b = RollingMask(size, p, step, 16), RollingMask(size, p, step, 16)
    assert digest(a.indices()) == digest(b.indices())
    assert a.count % 16 == 0 and a.count <= size
    x = torch.arange(size, dtype=torch.float32)
    assert torch.equal(a.gather(x), x[a.indices()])
    assert len(set(a.indices().tolist())) == a.count  # no coordinate twice in one step


@pytest.mark.parametrize("p", [0.1, 0.2, 0.5])
def test_rolling_coverage(p):
    size = 128 * 10 * 120 + 37
    win = math.ceil(1 / p)
    hits = torch.zeros(size, dtype=torch.int32)
    first_window_done = False
    for step in range(0, size + win):  # eventually: a full roll over every offset
        m = RollingMask(size, p, step)
        if step < 5 * win and step % win == 0 and step:
            first_window_done = True
        cover = torch.zeros(size, dtype=torch.bool)
        if step < 5 * win:
            for t in range(step, step + win):
                cover[RollingMask(size, p, t).indices()] = True
            assert cover.float().mean() >= 0.99
        hits[m.indices()] += 1
        if step >= 5 * win and bool((hits > 0).all()):
            break
    assert first_window_done and bool((hits > 0).all())


@given(n=st.integers(0, 3000), r=st.sampled_from([0.1, 0.2, 0.5, 1.0]), bits=st.sampled_from([2, 3, 4, 8]), seed=st.integers(0, 999))
def test_topk_bytes_selection_and_determinism(n, r, bits, seed):
    d = torch.randn(n, generator=torch.Generator().manual_seed(seed)).half()
    e = encode_topk(d, r, bits, 128)
    k = topk_count(n, r, 128)
    assert e.count == k and e.nbytes == sum(topk_sizes(n, k, bits, 128))
    assert torch.equal(e.payload, encode_topk(d.clone(), r, bits, 128).payload)
    sel, vals = decode_topk_parts(e)
    assert int(sel.sum()) == k
    if 0 < k < n:  # the selection holds the k largest magnitudes
        assert d.float().abs()[sel].min() >= d.float().abs()[~sel].max()


def test_cocktail_bytes_match_formula():
    cfg = CocktailConfig(p=0.1, r=0.2, bits=4)
    size = 128 * 10 * 5 * 400  # n and k both multiples of 128: the formula is exact
    c = CocktailCompressor(size, cfg)
    x = torch.randn(size)
    g = torch.zeros(size, dtype=torch.float16)
    e = c.worker_compress(x, g, step=3)
    assert e.nbytes * 8 == pytest.approx(cfg.bits_per_param() * size)
    assert e.nbytes == cfg.payload_nbytes(size)
    assert size * 4 / e.nbytes >= 150


def test_nan_in_delta_is_rejected():
    c = CocktailCompressor(128 * 20)
    d = torch.randn(256)
    d[5] = float("nan")
    with pytest.raises(NonFiniteError):
        c.compress(d)


def simulate(n_workers: int, size: int, steps: int, cfg: CocktailConfig, lr: float = 0.05, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    c = CocktailCompressor(size, cfg)
    x = [torch.zeros(size) for _ in range(n_workers)]
    g = [torch.zeros(size, dtype=torch.float16) for _ in range(n_workers)]
    err = torch.zeros(size)
    for step in range(steps):
        for xi in x:  # local "training": each worker drifts on its own
            xi.add_(torch.randn(size, generator=gen), alpha=lr)
        before = torch.stack(x).mean(0) + err
        payloads = [c.worker_compress(xi, gi, step) for xi, gi in zip(x, g)]
        s_hat = c.server_aggregate(payloads, err, step)
        for xi, gi in zip(x, g):
            c.worker_apply(xi, gi, step, s_hat)
        after = torch.stack(x).mean(0) + err
        yield step, x, g, before, after


def test_conservation_and_g_bitwise_equal():
    cfg = CocktailConfig(p=0.25, r=0.5, bits=4, bucket=16)
    for step, x, g, before, after in simulate(4, 4096, 30, cfg):
        assert torch.allclose(before, after, atol=1e-5), step
        assert len({digest(gi) for gi in g}) == 1


def test_drift_stays_bounded():
    cfg = CocktailConfig(p=0.25, r=0.5, bits=4, bucket=16)
    norms = [max(float((xi - gi.float()).norm()) for xi, gi in zip(x, g)) for _, x, g, _, _ in simulate(3, 2048, 400, cfg)]
    assert max(norms[200:]) < 3 * max(norms[50:200]) + 1e-3
