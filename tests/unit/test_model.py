"""The built-in GPT: shapes, causality, tied embeddings, sizes, and stages that compose to the whole model."""

from __future__ import annotations

import pytest
import torch

from shoal.node.train.model import GPTConfig, build_model, build_stage, lm_loss, stage_ranges
from shoal.protocol.manifest import MODEL_PRESETS, ModelSpec

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def cfg(**kw) -> GPTConfig:
    return GPTConfig(**{"n_layers": 3, "d_model": 32, "n_heads": 4, "seq_len": 16, **kw})


@pytest.mark.parametrize("positions", ["rope", "learned"])
def test_forward_shapes_and_initial_loss(positions):
    model = build_model(cfg(positions=positions), seed=1)
    x = torch.randint(0, 256, (2, 16))
    logits = model(x)
    assert logits.shape == (2, 16, 256)
    # a fresh model predicts close to uniform over the 256 byte tokens
    assert abs(lm_loss(logits, torch.randint(0, 256, (2, 16))).item() - torch.log(torch.tensor(256.0)).item()) < 0.3


@pytest.mark.parametrize("positions", ["rope", "learned"])
def test_causal(positions):
    model = build_model(cfg(positions=positions)).eval()
    x = torch.randint(0, 256, (1, 16))
    y = x.clone()
    y[0, 10:] = (y[0, 10:] + 1) % 256
    with torch.no_grad():
        assert torch.allclose(model(x)[0, :10], model(y)[0, :10], atol=1e-5)
        assert not torch.allclose(model(x)[0, 10:], model(y)[0, 10:], atol=1e-5)


def test_embeddings_are_tied_and_init_is_seeded():
    model = build_model(cfg(), seed=3)
    names = {n for n, _ in model.named_parameters()}
    assert "tok_emb.weight" in names and not any("lm_head" in n for n in names)
    again = build_model(cfg(), seed=3)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters(), strict=True))
    other = build_model(cfg(), seed=4)
    assert not torch.equal(model.tok_emb.weight, other.tok_emb.weight)


def test_sequence_longer_than_the_tables_is_refused():
    with pytest.raises(ValueError, match="covers 16"):
        build_model(cfg())(torch.zeros(1, 17, dtype=torch.long))


def test_stage_ranges_are_contiguous_and_balanced():
    assert stage_ranges(8, 3) == [(0, 3), (3, 6), (6, 8)]
    assert stage_ranges(4, 1) == [(0, 4)]
    assert stage_ranges(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    with pytest.raises(ValueError):
        stage_ranges(2, 3)


@pytest.mark.parametrize("num_stages", [2, 3])
def test_stages_compose_to_the_whole_model(num_stages):
    c = cfg()
    whole = build_model(c, seed=5).eval()
    stages = [build_stage(c, s, num_stages, seed=5).eval() for s in range(num_stages)]
    assert stages[0].has_embedding and stages[-1].has_head
    assert not stages[0].has_head and not stages[-1].has_embedding
    # each stage's parameters are exactly its slice of the whole model's (global names)
    full_sd = whole.state_dict()
    for st in stages:
        for k, v in st.state_dict().items():
            assert torch.equal(v, full_sd["tok_emb.weight" if k == "lm_head.weight" else k]), k
    x = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        h = x
        for st in stages:
            h = st(h)
        assert h.shape == (2, 16, 256)
        assert torch.allclose(h, whole(x), atol=1e-5)


def test_preset_sizes():
    counts = {}
    for size in ("tiny", "small"):
        spec = ModelSpec.preset(size)
        counts[size] = build_model(GPTConfig.from_spec(spec, MODEL_PRESETS[size][3])).num_params()
    assert counts["tiny"] < 1_000_000
    assert 10_000_000 < counts["small"] < 60_000_000
    n_layers, d, _, _ = MODEL_PRESETS["base"]
    assert 100_000_000 < n_layers * 12 * d * d + 256 * d < 500_000_000  # blocks + embedding of `base`
