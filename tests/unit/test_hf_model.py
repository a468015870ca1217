"""Hugging Face models as a run's model: the stages compute the library's model, shoal's training follows a plain
`transformers` loop from the same weights and data (S = 1 and S = 2, fp32 on the CPU), and the manifest's parameter
counts are the modules' exact counts."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from shoal.node.train.data import Samples, ShardedSampler, load_corpus
from shoal.node.train.hf import HFStage
from shoal.node.train.hfimport import config_text, pack_weights, read_model_path
from shoal.node.train.lane import LocalLane
from shoal.node.train.stages import build_stage_model
from shoal.node.train.trainer import Trainer, build_optimizer, lr_at
from shoal.protocol.errors import FieldError
from shoal.protocol.hfconfig import FAMILIES
from shoal.protocol.manifest import (BatchSpec, DataSpec, EvalSpec, HFModelSpec, ModelSpec, OptimSpec, ParallelPlan,
                                     PipelineSpec, RunManifest)
from tests.helpers.hf_fixtures import TINY, hf_model_folder, sample_text, write_bpe

pytestmark = pytest.mark.usefixtures("one_torch_thread")
STEPS = 12


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A BPE tokenizer, a text corpus and a tiny Llama folder with weights, shared by the module's tests."""
    d = tmp_path_factory.mktemp("hf")
    tok = write_bpe(d / "tokenizer.json")
    text = d / "corpus.txt"
    text.write_text(sample_text(120_000), encoding="utf-8")
    return d, tok, text


def manifest_for(folder: Path, world, stages: int, weights_dir: Path) -> tuple[RunManifest, Path | None]:
    d, tok, text = world
    src = read_model_path(folder)
    weights = None
    hf = HFModelSpec(config=config_text(src.config))
    if src.weight_files:
        digest, size, weights = pack_weights(src.weight_files, weights_dir)
        hf = HFModelSpec(config=config_text(src.config), weights=digest, weights_bytes=size)
    from shoal.node.train.tokens import tokenizer_hash

    m = RunManifest(seed=3, model=ModelSpec.from_hf(hf),
                    data=DataSpec(source=str(text), tokenizer=tokenizer_hash(tok), heldout_every=10),
                    plan=ParallelPlan(stages=stages, pipeline=PipelineSpec(compression="none")),
                    batch=BatchSpec(batch_size=8, micro_batch_size=2, seq_len=32),
                    optim=OptimSpec(lr=3e-3, warmup_steps=3, total_steps=STEPS, grad_clip=1.0),
                    eval=EvalSpec(every_steps=0, batches=2))
    return m, weights


def shoal_losses(m: RunManifest, weights: Path | None, corpus) -> list[float]:
    S = m.plan.stages
    if S == 1:
        t = Trainer(m, corpus=corpus, weights=weights)
        return [t.step().loss for _ in range(STEPS)]
    lane = LocalLane(S, timeout_s=60)
    trainers = [Trainer(m, stage=s, boundary=lane.boundary(s), corpus=corpus, weights=weights) for s in range(S)]
    out: dict[int, list] = {}
    errors = []

    def work(s):
        try:
            out[s] = [trainers[s].step() for _ in range(STEPS)]
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(S)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    return [r.loss for r in out[S - 1]]


def plain_losses(folder: Path, m: RunManifest, corpus, *, untie: bool) -> list[float]:
    """The same training as a researcher would write it with `transformers` alone."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa", dtype=torch.float32)
    if untie and model.config.tie_word_embeddings:  # a split run's head is its own matrix, starting as the embedding
        model.config.tie_word_embeddings = False
        model.lm_head.weight = torch.nn.Parameter(model.get_input_embeddings().weight.detach().clone())
    model.train()
    b, o = m.batch, m.optim
    opt = build_optimizer(model, o)
    samples = Samples(corpus.train, b.seq_len)
    sampler = ShardedSampler(samples.num_samples, seed=m.seed)
    M = b.batch_size // b.micro_batch_size
    losses = []
    for step in range(STEPS):
        ids = sampler.next_ids(b.batch_size)
        total = 0.0
        for mids in ids.split(b.micro_batch_size):
            x, y = samples.get(mids)
            logits = model(input_ids=x).logits
            loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten()) / M
            loss.backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(list(model.parameters()), o.grad_clip)
        for g in opt.param_groups:
            g["lr"] = lr_at(o, step)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
    return losses


@pytest.mark.parametrize("family,stages", [("llama", 1), ("llama", 2), ("qwen2", 2), ("gpt2", 1)])
def test_training_follows_a_plain_transformers_loop(world, tmp_path, family, stages):
    d, tok, _ = world
    from shoal.node.train.tokens import load_tokenizer

    folder = hf_model_folder(tmp_path / family, family, vocab_size=load_tokenizer(tok).vocab_size)
    m, weights = manifest_for(folder, world, stages, tmp_path / "assets")
    corpus = load_corpus(m.data.source, m.data.heldout_every, tokenizer=tok)
    assert corpus.train.dtype.kind == "i" and int(corpus.train.max()) < m.model.vocab_size
    ours = shoal_losses(m, weights, corpus)
    ref = plain_losses(folder, m, corpus, untie=stages > 1)
    assert ours[-1] < ours[0] - 0.3  # it learns
    assert ours == pytest.approx(ref, rel=2e-5, abs=2e-5), (ours, ref)


@pytest.mark.parametrize("family", sorted(set(FAMILIES) - {"gpt2"}) + ["gpt2"])
def test_stages_are_the_library_model_and_counts_are_exact(tmp_path, family):
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = dict(TINY.get(family, TINY["llama"]))
    if family == "qwen3":
        kw["head_dim"] = 32
    cfg = AutoConfig.for_model(family, vocab_size=300, **kw)
    ref = AutoModelForCausalLM.from_config(cfg).eval()
    hf = HFModelSpec(config=config_text(cfg.to_dict()))
    m = RunManifest(model=ModelSpec.from_hf(hf), data=DataSpec(tokenizer="a" * 64), plan=ParallelPlan(stages=2),
                    batch=BatchSpec(seq_len=64))
    whole_state = ref.state_dict()
    stages = [build_stage_model(m, s) for s in range(2)]
    for s, st in enumerate(stages):
        assert st.num_params() == m.stage_params(s)
        own = st.state_dict()
        emb = "transformer.wte.weight" if family == "gpt2" else "model.embed_tokens.weight"
        st.load_state_dict({k: whole_state[k] if k in whole_state else whole_state[emb] for k in own})
    x = torch.randint(0, 300, (2, 24))
    with torch.no_grad():
        assert torch.equal(stages[1](stages[0](x)), ref(x).logits)
    one = RunManifest(model=ModelSpec.from_hf(hf), data=DataSpec(tokenizer="a" * 64), batch=BatchSpec(seq_len=64))
    assert one.stage_params(0) == sum(p.numel() for p in ref.parameters())


def test_a_stage_is_initialized_as_its_slice_of_the_whole_model(tmp_path):
    folder = hf_model_folder(tmp_path / "m", "llama", weights=False)
    hf = HFModelSpec(config=config_text(read_model_path(folder).config))
    whole = HFStage(hf, 0, 4, True, True, tied=False, seed=5)
    parts = [HFStage(hf, 0, 2, True, False, tied=False, seed=5), HFStage(hf, 2, 4, False, True, tied=False, seed=5)]
    w = whole.state_dict()
    for p in parts:
        for k, v in p.state_dict().items():
            assert torch.equal(v, w[k]), k
    assert torch.equal(w["lm_head.weight"], w["model.embed_tokens.weight"])  # an untied head starts as the embedding


def test_manifest_checks_the_config_against_the_plan(tmp_path):
    cfg = read_model_path(hf_model_folder(tmp_path / "m", "mistral", weights=False)).config
    hf = HFModelSpec(config=config_text(cfg))
    with pytest.raises(FieldError, match="sliding window"):
        RunManifest(model=ModelSpec.from_hf(hf), data=DataSpec(tokenizer="a" * 64), batch=BatchSpec(seq_len=200))
    with pytest.raises(FieldError, match="positions cover"):
        RunManifest(model=ModelSpec.from_hf(HFModelSpec(config=config_text({**cfg, "sliding_window": None}))),
                    data=DataSpec(tokenizer="a" * 64), batch=BatchSpec(seq_len=512))
    with pytest.raises(FieldError, match="does not match"):
        ModelSpec(**{**ModelSpec.from_hf(hf).to_wire(), "n_layers": 3})
    with pytest.raises(FieldError, match="not a family"):
        HFModelSpec(config=config_text({**cfg, "model_type": "bert"})).shape
    m = RunManifest(model=ModelSpec.from_hf(hf), data=DataSpec(tokenizer="a" * 64), plan=ParallelPlan(stages=2))
    assert RunManifest.from_toml(m.to_toml()) == m


def _saved_bytes_per_sample(model, x) -> float:
    total, seen = [0], set()

    def pack(t):
        if (t.data_ptr(), t.numel()) not in seen:
            seen.add((t.data_ptr(), t.numel()))
            total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x)
    return total[0] / x.shape[0]


def test_the_activation_estimate_counts_hf_layers_as_it_counts_the_built_in_gpts():
    """Per layer, what autograd keeps (fp32, CPU) over the memory estimate: the same factor for a Llama and GPT-2 as
    for the built-in GPT (whose estimate is calibrated on a GPU), within 10 %."""
    from shoal.node.train.hfimport import arch_config
    from shoal.node.train.memory import activation_bytes_per_sample

    def ratio(model_of) -> float:
        got, est = {}, {}
        for layers in (2, 4):
            m = RunManifest(model=model_of(layers), batch=BatchSpec(seq_len=64), plan=ParallelPlan(stages=2))
            got[layers] = _saved_bytes_per_sample(build_stage_model(m, 0), torch.randint(0, 256, (2, 64)))
            est[layers] = activation_bytes_per_sample(m, 0)
        return (got[4] - got[2]) / (est[4] - est[2])  # one layer's worth

    gpt = ratio(lambda n: ModelSpec(size="custom", n_layers=n, d_model=128, n_heads=4))
    for arch in ("llama", "gpt2"):
        hf = ratio(lambda n: ModelSpec.from_hf(HFModelSpec(config=config_text(
            arch_config(arch, layers=n, d_model=128, heads=4, vocab=256, max_positions=256)))))
        assert hf == pytest.approx(gpt, rel=0.1), (arch, hf, gpt)
