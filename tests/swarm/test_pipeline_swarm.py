"""Pipeline runs across real node processes on 127.0.0.1: S stages x D lanes learn with each stage's replicas
bit-identical and the bytes on every link as the formula says; killed stage nodes are replaced by backups of their
stage, a killed broker by the standby, and a lane no backup can repair is dissolved while the run goes on."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from shoal.node.localswarm import LocalSwarm
from shoal.protocol import manifest as mf
from shoal.swarm.net.identity import load_or_create_identity
from tests.helpers.progress import newest_step, training
from tests.swarm.test_run_swarm import active, make_swarm, wait

pytestmark = pytest.mark.slow
B, M, T, H = 8, 4, 32, 32  # sequences per step, micro-batches, tokens per sequence, hidden size


def write_run(workdir: Path, *, lanes: int, stages: int = 2, sync: str = "cocktail") -> tuple[Path, mf.RunManifest]:
    workdir.mkdir(parents=True, exist_ok=True)
    m = mf.RunManifest(
        seed=3, model=mf.ModelSpec(size="custom", n_layers=2, d_model=H, n_heads=4),
        batch=mf.BatchSpec(batch_size=B, micro_batch_size=B // M, seq_len=T),
        optim=mf.OptimSpec(lr=3e-3, warmup_steps=5, total_steps=1000), eval=mf.EvalSpec(every_steps=0, batches=2),
        plan=mf.ParallelPlan(stages=stages, replicas=lanes, pipeline=mf.PipelineSpec(compression="none"),
                             sync=mf.SyncSpec(method=sync, cocktail=mf.CocktailSpec(warmup_steps=0))))
    m = m.signed(load_or_create_identity(workdir / "node0.key"))
    path = workdir / "run.toml"
    path.write_text(m.to_toml())
    return path, m


def stage_of(r: dict) -> int:
    return int(r["slot"][1:].split("r")[0])


def done(s: LocalSwarm, steps: int, n: int) -> bool:
    rows = active(s)
    return len(rows) == n and all(r.get("state") == "done" and r.get("step") == steps for r in rows)


def test_two_stages_by_two_lanes_learn_with_equal_stage_hashes_and_bytes_as_the_formula(tmp_path):
    steps = 30
    run, m = write_run(tmp_path / "w", lanes=2)
    s = make_swarm(tmp_path, 4, run, steps)
    samples: list[tuple[float, float, int]] = []  # a stage-0 node's (time, up/s, link bytes sent) while it trains

    def sample() -> bool:
        for r in active(s):
            if stage_of(r) == 0 and r.get("state") == "training" and r.get("link_bytes_sent"):
                st = s.nodes[r["index"]].status() or {}
                samples.append((time.monotonic(), st.get("up_bytes_per_s") or 0.0, st.get("link_bytes_sent") or 0))
                break
        return done(s, steps, 4)

    try:
        s.start()
        wait(sample, 240, "2 stages x 2 lanes to finish", s)
        rows = active(s)
        for stage in (0, 1):  # each stage's replicas hold the same synchronized state
            assert len({r["state_hash"] for r in rows if stage_of(r) == stage}) == 1, rows
        assert len({r["state_hash"] for r in rows}) == 2  # and the two stages hold different parts of the model
        last = [r for r in rows if stage_of(r) == 1]
        assert all(r["loss"] < 4.5 and r["eval_loss"] < 4.8 for r in last), last  # from ~5.5 (uniform bytes)
        assert all(r["loss"] is None for r in rows if stage_of(r) == 0)
        # every training micro-batch's activations forward and gradients back at fp32, plus the final
        # evaluation's micro-batches at fp16, and nothing else as tensor payload: the two lanes together carry the
        # global batch (2 x M micro-batches) of every step, however it was split between them by their speed
        mb = (B // M) * T * H
        for stage in (0, 1):
            side = "sent" if stage == 0 else "recv"
            other = "recv" if side == "sent" else "sent"
            links = [s.nodes[r["index"]].status()["links"] for r in rows if stage_of(r) == stage]
            fwd, bwd = [x["b0/fwd"] for x in links], [x["b0/bwd"] for x in links]  # activations, gradients
            assert sum(x[side]["payload_bytes"] for x in fwd) == steps * 2 * M * mb * 4 + 2 * m.eval.batches * mb * 2
            assert sum(x[other]["payload_bytes"] for x in bwd) == steps * 2 * M * mb * 4, links
            assert all(x[other]["payload_bytes"] == 0 for x in fwd) and all(x[side]["payload_bytes"] == 0
                                                                            for x in bwd), links
            # what the same tensors weigh at fp32: the fp16 evaluation counts double its payload
            assert sum(x[side]["fp32_bytes"] for x in fwd) == steps * 2 * M * mb * 4 + 2 * m.eval.batches * mb * 4, \
                links
        # a stage's up/s counts its lane links (the dashboard's Wire and Ratio add them up): at least a good part
        # of the rate its link counter grew at (the rate is smoothed); the synchronizer alone sends ~1 % of it
        spans = [(a, b) for a in samples for b in samples if b[0] - a[0] >= 1.0 and b[2] > a[2]]
        assert spans, samples
        a, b = spans[0]
        link_rate = (b[2] - a[2]) / (b[0] - a[0])
        assert max(x[1] for x in samples if x[0] >= a[0]) >= 0.3 * link_rate, (link_rate, samples)
    finally:
        s.stop()


def test_stage_kills_are_repaired_by_backups_of_their_stage_then_a_lane_dissolves(tmp_path):
    """6 nodes: 2 stages x 2 lanes + a backup per stage. A stage-1 node dies, then a stage-0 node: each is replaced
    by its stage's backup and the lane trains again. Then the broker dies (it holds a slot too): the standby takes
    over, and with no backup left the broker's lane is dissolved; the other lane finishes the run."""
    steps = 150
    run, _ = write_run(tmp_path / "w", lanes=2)
    s = make_swarm(tmp_path, 6, run, steps, "--dissolve-after", "5")
    recovery = {}
    try:
        s.start()
        wait(lambda: training(s, 4, 10), 180,
             "training to get going", s)
        for stage in (1, 0):
            victim = next(r for r in active(s) if r["index"] != 0 and stage_of(r) == stage)
            backup = next(r for r in s.summary() if r.get("role") == "backup" and r.get("warm_stage") == stage)
            s.nodes[victim["index"]].proc.send_signal(signal.SIGKILL)
            t_kill = time.monotonic()
            wait(lambda: any(r["index"] != victim["index"] and r.get("slot") == victim["slot"] for r in active(s)),
                 60, f"a backup to take {victim['slot']}", s)
            at = newest_step(s)
            wait(lambda: training(s, 4, at + 4), 120,
                 f"both lanes training after the stage-{stage} kill", s)
            recovery[stage] = time.monotonic() - t_kill
            assert stage_of(next(r for r in active(s) if r["slot"] == victim["slot"])) == stage
            assert any(r["index"] == backup["index"] for r in active(s))
        broker_slot = next(r["slot"] for r in active(s) if r["index"] == 0)
        s.nodes[0].proc.send_signal(signal.SIGKILL)
        wait(lambda: len(active(s)) == 2 and len({r["slot"][-2:] for r in active(s)}) == 1, 90,
             "the broker's lane to be dissolved", s)
        survivors = active(s)
        assert broker_slot[-2:] not in {r["slot"][-2:] for r in survivors}
        wait(lambda: done(s, steps, 2), 300, "the run to finish on the other lane", s)
        rows = active(s)
        assert {stage_of(r) for r in rows} == {0, 1}
        print(f"recovery (kill -> both lanes training again): stage 1 {recovery[1]:.1f} s, stage 0 {recovery[0]:.1f} s")
    finally:
        s.stop()
