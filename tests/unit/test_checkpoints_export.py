"""Swarm checkpoints on disk and the export: a slot's checkpoint round-trips with its whole-state hash checked, a
damaged one is refused, keep_last holds, the resume point is the newest step every seated slot has, and a two-stage
model's checkpoints export to safetensors that load back into the whole model with the same logits."""

from __future__ import annotations

import json

import pytest
import torch

from shoal.node.cli.export import read_stages, resolve_source
from shoal.node.run.checkpoints import (
    CheckpointMeta, CheckpointMissing, read_checkpoint, resume_point, slots_on_disk, write_checkpoint)
from shoal.node.train import export_gpt
from shoal.node.train.trainer import Trainer
from shoal.node.train.lane import LocalLane
from shoal.protocol import manifest as mf
from shoal.swarm.state.snapshot import Snapshot


def manifest(stages: int = 2) -> mf.RunManifest:
    return mf.RunManifest(seed=1, model=mf.ModelSpec(size="custom", n_layers=2, d_model=32, n_heads=4),
                          batch=mf.BatchSpec(batch_size=2, micro_batch_size=1, seq_len=16),
                          plan=mf.ParallelPlan(stages=stages, replicas=1), checkpoint=mf.CheckpointSpec(keep_last=2))


def write(root, m, stage, step, state, seating=None):
    snap = Snapshot.of(state, step)
    meta = CheckpointMeta(run_id=m.run_id, stage=stage, replica=0, step=step, peer_id=f"peer{stage}",
                          state_hash=snap.hash, seating=seating or {"s0r0": "peer0", "s1r0": "peer1"})
    write_checkpoint(root, m, snap, meta, keep_last=m.checkpoint.keep_last)
    return snap


def test_a_slot_checkpoint_round_trips_keeps_the_last_and_refuses_damage(tmp_path):
    m = manifest()
    for step in (10, 20, 30):
        snap = write(tmp_path, m, 0, step, {"step": step, "stage": 0, "w": torch.full((3,), float(step))})
    assert slots_on_disk(tmp_path, m.run_id) == {(0, 0): [20, 30]}
    back, meta = read_checkpoint(tmp_path, m.run_id, 0, 0, 30)
    assert back.hash == snap.hash == meta.state_hash and torch.equal(back.tensors["/w"], snap.tensors["/w"])
    path = tmp_path / m.run_id[:16] / "s0r0" / "ckpt-0000000030.state"
    raw = bytearray(path.read_bytes())
    raw[-2] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointMissing, match="hash"):
        read_checkpoint(tmp_path, m.run_id, 0, 0, 30)
    with pytest.raises(CheckpointMissing):
        read_checkpoint(tmp_path, m.run_id, 0, 0, 10)  # dropped by keep_last


def test_the_resume_point_is_the_newest_step_every_seated_slot_has(tmp_path):
    m = manifest()
    for stage, steps in ((0, (10, 20)), (1, (10,))):
        for step in steps:
            write(tmp_path, m, stage, step, {"step": step, "stage": stage, "w": torch.zeros(2)})
    p = resume_point(tmp_path, m.run_id, 2)
    assert (p.step, p.complete, p.seating) == (10, True, {"s0r0": "peer0", "s1r0": "peer1"})
    assert resume_point(tmp_path / "nothing", m.run_id, 2) is None


def test_two_stage_checkpoints_export_to_one_model_with_the_same_logits(tmp_path):
    m = manifest(2)
    lane = LocalLane(2)
    trainers = [Trainer(m, stage=s, boundary=lane.boundary(s)) for s in range(2)]
    import threading
    for _ in range(2):
        ths = [threading.Thread(target=t.step) for t in trainers]
        [th.start() for th in ths]
        [th.join() for th in ths]
    for s, t in enumerate(trainers):
        write(tmp_path, m, s, t.step_count, t.state_dict())
    run_dir = resolve_source(str(tmp_path))
    manifest_back, stages, step, _ = read_stages(run_dir, None)
    assert manifest_back.run_id == m.run_id and step == 2
    export_gpt.export(m, stages, tmp_path / "out", step=step)
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["architecture"] == "shoal-gpt" and cfg["model"]["tie_embeddings"] is False
    model = export_gpt.load(tmp_path / "out")
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = trainers[1].model.eval()(trainers[0].model.eval()(tokens))
        assert torch.equal(model(tokens), want)


def test_a_hugging_face_runs_swarm_checkpoints_export_through_shoal_export(tmp_path, monkeypatch):
    """`shoal export` of a split Hugging Face run's swarm checkpoints: its exporter is picked by the manifest, the
    run's tokenizer comes from the blob store, and transformers loads a model with the stages' logits."""
    import argparse
    import threading

    from transformers import AutoModelForCausalLM

    from shoal.node.cli import export as export_cli
    from shoal.node.train.data import load_corpus
    from shoal.node.train.hfimport import config_text, read_model_path
    from shoal.node.train.tokens import load_tokenizer, tokenizer_hash
    from shoal.swarm.state.blobs import BlobStore
    from tests.helpers.hf_fixtures import hf_model_folder, sample_text, write_bpe, write_jsonl

    monkeypatch.setenv("SHOAL_HOME", str(tmp_path / "home"))
    tok = write_bpe(tmp_path / "tokenizer.json")
    digest, _ = BlobStore(tmp_path / "home" / "blobs").add_file(tok)
    assert digest == tokenizer_hash(tok)
    jsonl = write_jsonl(tmp_path / "c.jsonl", sample_text(40_000))
    v = load_tokenizer(tok).vocab_size
    cfg = read_model_path(hf_model_folder(tmp_path / "m", "llama", vocab_size=v, weights=False)).config
    m = mf.RunManifest(seed=1, model=mf.ModelSpec.from_hf(mf.HFModelSpec(config=config_text(cfg))),
                       data=mf.DataSpec(source=str(jsonl), tokenizer=digest),
                       plan=mf.ParallelPlan(stages=2, replicas=1, pipeline=mf.PipelineSpec(compression="none")),
                       batch=mf.BatchSpec(batch_size=2, micro_batch_size=1, seq_len=16),
                       optim=mf.OptimSpec(lr=1e-2, warmup_steps=1, total_steps=4))
    corpus = load_corpus(str(jsonl), 20, tokenizer=tok)
    lane = LocalLane(2, timeout_s=60)
    trainers = [Trainer(m, stage=s, boundary=lane.boundary(s), corpus=corpus) for s in range(2)]
    ths = [threading.Thread(target=lambda t=t: [t.step() for _ in range(2)]) for t in trainers]
    [th.start() for th in ths]
    [th.join(60) for th in ths]
    root = tmp_path / "ckpt"
    for s, t in enumerate(trainers):
        write(root, m, s, t.step_count, t.state_dict())
    assert export_cli.architecture(m) == "hf"
    out = tmp_path / "out"
    assert export_cli.main(argparse.Namespace(source=str(root), out=str(out), step=None, force=False)) == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert (out / "tokenizer.json").read_bytes() == tok.read_bytes()
    ref = AutoModelForCausalLM.from_pretrained(out).eval()
    x = torch.randint(0, v, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(ref(x).logits, trainers[1].model.eval()(trainers[0].model.eval()(x)))
