"""Tokenizers and data for real models: a tokenizer.json, text/jsonl/parquet sources, a streamed source read only
as far as the run needs, the hf: checks (package missing, Hub unreachable, offline) as one line before anything
trains, `shoal run create --model/--arch`, and export to a folder `transformers` loads with equal logits."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from shoal.node.train.checkpoint import load_latest
from shoal.node.train.data import load_corpus
from shoal.node.train.datacheck import DataUnavailable, check_source
from shoal.node.train.export_hf import ExportError, export
from shoal.node.train.lane import LocalLane
from shoal.node.train.stages import build_stage_model
from shoal.node.train.tokens import load_tokenizer, tokenizer_hash
from shoal.node.train.trainer import Trainer
from shoal.protocol.manifest import RunManifest
from tests.helpers.hf_fixtures import hf_model_folder, sample_text, write_bpe, write_jsonl, write_parquet

pytestmark = pytest.mark.usefixtures("one_torch_thread")
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    text = sample_text(150_000)
    tok = write_bpe(d / "tokenizer.json")
    return d, text, tok, write_jsonl(d / "c.jsonl", text), write_parquet(d / "c.parquet", text, column="body")


def shoal(*args, env=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "shoal.node.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})}, cwd=REPO)


def test_sources_tokenize_alike_and_stop_where_the_run_needs(files):
    d, text, tok, jsonl, parquet = files
    a = load_corpus(str(jsonl), 10, tokenizer=tok)
    b = load_corpus(str(parquet), 10, tokenizer=tok, hf=_hf(text_field="body"))
    assert a.fingerprint == b.fingerprint and a.train.dtype == np.int32  # the same documents, the same tokens
    t = load_tokenizer(tok)
    assert int(a.train.max()) < t.vocab_size and (a.train == t.eos).sum() > 100  # documents end with <|endoftext|>
    assert t.decode(a.train[:40].tolist()) == text[:len(t.decode(a.train[:40].tolist()))]  # the text, back
    part = load_corpus(str(jsonl), 10, tokenizer=tok, max_tokens=5000)
    assert len(part.train) + len(part.heldout) == 5000
    assert np.array_equal(np.concatenate([part.train, part.heldout]), np.concatenate([a.train, a.heldout])[:5000])
    assert load_corpus(str(jsonl), 10).train.dtype == np.uint8  # bytes stay the default
    with pytest.raises(ValueError, match="no column 'text'"):
        load_corpus(str(parquet), 10)


def _hf(**kw):
    from shoal.node.train.data import HFSource

    return HFSource(**kw)


def test_an_unreachable_hub_is_one_line_before_anything_trains(monkeypatch):
    with socket.socket() as s:  # a loopback port nobody listens on: the Hub is unreachable
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(v, raising=False)
    with pytest.raises(DataUnavailable, match=r"cannot reach the Hugging Face Hub at http://127.0.0.1:\d+ .*--data PATH"):
        check_source("hf:someone/corpus")
    with pytest.raises(DataUnavailable, match="no such file"):
        check_source("/nonexistent/corpus.txt")


def test_missing_datasets_and_offline_hub_fail_run_create_with_the_fix(tmp_path):
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "datasets.py").write_text("raise ImportError('datasets is not installed')\n")
    env = {"SHOAL_HOME": str(tmp_path / "home"), "PYTHONPATH": f"{shim}{os.pathsep}{REPO}"}
    r = shoal("run", "create", "--data", "hf:someone/corpus", "-o", str(tmp_path / "r.toml"), env=env)
    assert r.returncode == 12, r.stderr
    assert r.stderr.strip().splitlines() == ["shoal run create: an hf: data source needs the `datasets` package: "
                                             "pip install 'shoal[hf]'"]
    env = {"SHOAL_HOME": str(tmp_path / "home"), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "HF_HOME": str(tmp_path / "hf")}
    r = shoal("run", "create", "--data", "hf:someone/corpus", "-o", str(tmp_path / "r.toml"), env=env)
    assert r.returncode == 12, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "offline (HF_HUB_OFFLINE) and not in the local cache" in r.stderr
    assert not (tmp_path / "r.toml").exists()


def shoal_here(*args, capsys) -> tuple[int, str]:
    """The command in this process (its imports are the test's): exit status and stderr."""
    from shoal.node.cli import _main

    code = _main(list(args))
    return code, capsys.readouterr().err


def test_run_create_takes_a_model_folder_and_an_arch(files, tmp_path, monkeypatch, capsys):
    d, text, tok, jsonl, parquet = files
    monkeypatch.setenv("SHOAL_HOME", str(tmp_path / "home"))
    v = load_tokenizer(tok).vocab_size
    folder = hf_model_folder(tmp_path / "qwen", "qwen2", vocab_size=v)
    (folder / "tokenizer.json").write_bytes(tok.read_bytes())
    code, err = shoal_here("run", "create", "--model", f"hf:{folder}", "--stages", "2", "--data", str(parquet),
                           "--text-field", "body", "--seq-len", "64", "-o", str(tmp_path / "run.toml"), capsys=capsys)
    assert code == 0, err
    m = RunManifest.from_toml((tmp_path / "run.toml").read_text())
    m.verify()
    assert m.model.hf.shape.model_type == "qwen2" and m.model.hf.weights and m.data.text_field == "body"
    blobs = tmp_path / "home" / "blobs"
    assert {h for h, _ in m.blobs()} <= {p.name for p in blobs.iterdir()}  # what the owner's node will serve
    assert not m.model.tied(2) and m.model.hf.shape.tied  # a split tied model trains its own head
    code, err = shoal_here("run", "create", "--arch", "llama", "--layers", "4", "--d-model", "64", "--heads", "4",
                           "--kv-heads", "2", "--tokenizer", str(tok), "--data", str(jsonl), "-o",
                           str(tmp_path / "arch.toml"), capsys=capsys)
    assert code == 0, err
    a = RunManifest.from_toml((tmp_path / "arch.toml").read_text())
    sh = a.model.hf.shape
    assert (sh.layers, sh.d_model, sh.kv_heads, sh.vocab, a.model.hf.weights) == (4, 64, 2, v, "")
    code, err = shoal_here("run", "create", "--tokenizer", str(tok), "-o", str(tmp_path / "gpt.toml"), capsys=capsys)
    assert code == 0, err  # the built-in GPT with a tokenizer: its vocabulary is the tokenizer's
    g = RunManifest.from_toml((tmp_path / "gpt.toml").read_text())
    assert (g.model.size, g.model.vocab_size, g.data.tokenizer) == ("tiny", v, tokenizer_hash(tok))
    code, err = shoal_here("run", "create", "--arch", "llama", "--layers", "4", "-o", str(tmp_path / "x.toml"),
                           capsys=capsys)
    assert code == 2 and "needs --layers, --d-model and --heads" in err


@pytest.mark.parametrize("family,stages", [("llama", 2), ("gpt2", 1)])
def test_export_loads_in_transformers_with_equal_logits(files, tmp_path, family, stages):
    d, text, tok, jsonl, _ = files
    from transformers import AutoModelForCausalLM

    from shoal.node.train.hfimport import config_text, read_model_path
    from shoal.protocol.manifest import BatchSpec, DataSpec, HFModelSpec, ModelSpec, OptimSpec, ParallelPlan, PipelineSpec

    v = load_tokenizer(tok).vocab_size
    cfg = read_model_path(hf_model_folder(tmp_path / "m", family, vocab_size=v, weights=False)).config
    m = RunManifest(seed=1, model=ModelSpec.from_hf(HFModelSpec(config=config_text(cfg))),
                    data=DataSpec(source=str(jsonl), tokenizer="0" * 64),
                    plan=ParallelPlan(stages=stages, pipeline=PipelineSpec(compression="none")),
                    batch=BatchSpec(batch_size=4, micro_batch_size=2, seq_len=32),
                    optim=OptimSpec(lr=1e-2, warmup_steps=1, total_steps=4))
    corpus = load_corpus(str(jsonl), 20, tokenizer=tok)
    lane = LocalLane(stages, timeout_s=60)
    trainers = [Trainer(m, stage=s, boundary=lane.boundary(s) if stages > 1 else None, corpus=corpus)
                for s in range(stages)]
    threads = [threading.Thread(target=lambda t=t: [t.step() for _ in range(4)]) for t in trainers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for s, t in enumerate(trainers):
        t.save(tmp_path / f"s{s}")
    states = [load_latest(tmp_path / f"s{s}")[1] for s in range(stages)]
    models = [st["model"] for st in states]
    with pytest.raises(ExportError, match="stages given" if stages > 1 else "not the run's stage"):
        export(m, models[:1] if stages > 1 else [{}], tmp_path / "bad", step=4)
    files_written = export(m, models, tmp_path / "out", step=4, tokenizer=tok)
    assert [f.name for f in files_written] == ["config.json", "model.safetensors", "tokenizer.json"]
    ref = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert ref.config.tie_word_embeddings == m.model.tied(stages)
    x = torch.randint(0, v, (2, 32))
    with torch.no_grad():
        h = x
        for s, st in enumerate(states):
            part = build_stage_model(m, s, initial=False)
            part.load_state_dict(st["model"])
            h = part.eval()(h)
        assert torch.equal(h, ref(x).logits)
    from transformers import PreTrainedTokenizerFast

    assert PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "out" / "tokenizer.json")).vocab_size == v


def test_an_hf_dataset_streams_through_datasets_as_far_as_the_run_needs(files, tmp_path, monkeypatch):
    """A dataset folder `datasets` reads like a Hub dataset (offline: nothing to reach), streamed: the same tokens as
    the parquet file read directly, cut at the run's need."""
    d, text, tok, _, _ = files
    folder = tmp_path / "ds"
    folder.mkdir()
    write_parquet(folder / "train.parquet", text, docs=100)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    check_source(f"hf:{folder}")
    with pytest.raises(DataUnavailable, match="no split 'validation'"):
        check_source(f"hf:{folder}", hf_split="validation")
    with pytest.raises(DataUnavailable, match="no column 'body'"):
        check_source(f"hf:{folder}", text_field="body")
    streamed = load_corpus(f"hf:{folder}", 10, tokenizer=tok, max_tokens=6000)
    direct = load_corpus(str(folder / "train.parquet"), 10, tokenizer=tok)
    assert len(streamed.train) + len(streamed.heldout) == 6000
    assert np.array_equal(np.concatenate([streamed.train, streamed.heldout]),
                          np.concatenate([direct.train, direct.heldout])[:6000])
