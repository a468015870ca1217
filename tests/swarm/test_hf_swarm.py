"""A Hugging Face Llama with its own BPE tokenizer and a parquet dataset, trained by two real node processes as a
2-stage pipeline with AQ-SGD between them; the joining node has none of the run's files and pulls the weights and
the tokenizer from the owner by hash."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shoal.node.localswarm import LocalSwarm, LocalSwarmConfig
from shoal.node.train.hfimport import config_text, pack_weights, read_model_path
from shoal.node.train.tokens import load_tokenizer, tokenizer_hash
from shoal.protocol import manifest as mf
from shoal.swarm.net.identity import load_or_create_identity
from shoal.swarm.state.blobs import BlobStore
from tests.helpers.hf_fixtures import hf_model_folder, sample_text, write_bpe, write_parquet
from tests.swarm.test_run_swarm import active, wait

pytestmark = pytest.mark.slow


class SeparateHomes(LocalSwarm):
    """Node i > 0 keeps its own $SHOAL_HOME (its own blob store): it starts with none of the run's files."""

    def launch_prefix(self, index: int) -> list[str]:
        return [] if index == 0 else ["env", f"SHOAL_HOME={self.config.home}-{index}"]


def test_a_two_stage_llama_swarm_pulls_its_files_from_peers_and_learns(tmp_path):
    steps = 25
    w = tmp_path / "w"
    w.mkdir()
    tok = write_bpe(tmp_path / "tokenizer.json")
    vocab = load_tokenizer(tok).vocab_size
    data = write_parquet(tmp_path / "corpus.parquet", sample_text(200_000), docs=400)
    src = read_model_path(hf_model_folder(tmp_path / "llama", "llama", vocab_size=vocab))
    owner_store = BlobStore(tmp_path / "home" / "blobs")  # what `shoal run create` does on the owner's machine
    digest, size, _ = pack_weights(src.weight_files, owner_store.root)
    tok_digest, _ = owner_store.add_file(tok)
    assert tok_digest == tokenizer_hash(tok)
    m = mf.RunManifest(
        seed=3, model=mf.ModelSpec.from_hf(mf.HFModelSpec(config=config_text(src.config), weights=digest,
                                                          weights_bytes=size)),
        data=mf.DataSpec(source=str(data), tokenizer=tok_digest),
        batch=mf.BatchSpec(batch_size=8, micro_batch_size=2, seq_len=32),
        optim=mf.OptimSpec(lr=3e-3, warmup_steps=5, total_steps=1000), eval=mf.EvalSpec(every_steps=0, batches=2),
        plan=mf.ParallelPlan(stages=2, replicas=1)).signed(load_or_create_identity(w / "node0.key"))
    assert m.plan.pipeline.compression == "aqsgd"
    run = w / "run.toml"
    run.write_text(m.to_toml())
    s = SeparateHomes(LocalSwarmConfig(nodes=2, workdir=w, home=tmp_path / "home", status_interval_s=0.5,
                                       gone_after_s=4.0, extra_node_args=("--run", str(run), "--threads", "1",
                                                                          "--steps", str(steps), "--round-timeout",
                                                                          "4", "--fail-after", "6")))
    try:
        s.start()
        wait(lambda: len(active(s)) == 2 and all(r.get("state") == "done" and r.get("step") == steps
                                                 for r in active(s)), 300, "the 2-stage Llama run to finish", s)
        rows = active(s)
        last = next(r for r in rows if r["slot"].startswith("s1"))
        joiner = BlobStore(Path(f"{tmp_path / 'home'}-1") / "blobs")
        assert joiner.path(digest) is not None and joiner.path(tok_digest) is not None  # pulled, checked
        lines = [json.loads(x) for x in (w / f"node{last['index']}.metrics.jsonl").read_text().splitlines()]
        losses = [x["loss"] for x in lines if x["loss"] is not None]
        assert losses and losses[-1] < losses[0] - 0.2, losses  # it learns (from ln(384) ~ 5.95 at the start)
        assert lines[-1]["bytes"]["lane"][0] > 0 and lines[-1]["stage"] == 1
    finally:
        s.stop()
