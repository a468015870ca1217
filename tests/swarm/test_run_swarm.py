"""Training across real node processes on 127.0.0.1: loss falls, replicas stay bit-identical, kills are survived."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shoal.node.cli.errors import Exit
from shoal.node.localswarm import LocalSwarm, LocalSwarmConfig
from shoal.protocol import manifest as mf
from shoal.swarm.net.identity import load_or_create_identity
from tests.helpers.progress import newest_step, training
from tests.helpers.timeline import note

pytestmark = pytest.mark.slow
SHOAL = [sys.executable, "-m", "shoal.node.cli"]


def write_run(workdir: Path, *, replicas: int, sync: str = "cocktail", secret: str | None = None) -> Path:
    workdir.mkdir(parents=True, exist_ok=True)
    m = mf.RunManifest(
        seed=3, model=mf.ModelSpec(size="custom", n_layers=2, d_model=64, n_heads=4),
        batch=mf.BatchSpec(batch_size=8, micro_batch_size=8, seq_len=64),
        optim=mf.OptimSpec(lr=3e-3, warmup_steps=5, total_steps=1000), eval=mf.EvalSpec(every_steps=0, batches=4),
        plan=mf.ParallelPlan(replicas=replicas, sync=mf.SyncSpec(method=sync, cocktail=mf.CocktailSpec(warmup_steps=0),
                                                                 diloco=mf.DilocoSpec(inner_steps=5))),
        join=mf.JoinPolicy.private() if secret else mf.JoinPolicy())
    path = workdir / "run.toml"
    path.write_text(m.signed(load_or_create_identity(workdir / "node0.key")).to_toml())
    return path


def make_swarm(tmp_path: Path, nodes: int, run: Path, steps: int, *extra: str) -> LocalSwarm:
    args = ("--run", str(run), "--threads", "1", "--steps", str(steps), "--round-timeout", "4", "--fail-after", "4",
            *extra)
    return LocalSwarm(LocalSwarmConfig(nodes=nodes, workdir=run.parent, home=tmp_path / "home", status_interval_s=0.5,
                                       gone_after_s=4.0, extra_node_args=args))


def active(s: LocalSwarm) -> list[dict]:
    return [r for r in s.summary() if r["alive"] and r.get("slot")]


def wait(pred, timeout_s: float, what: str, s: LocalSwarm) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if pred():
            note(what, time.monotonic() - t0)
            return time.monotonic() - t0
        time.sleep(0.2)
    rows = [json.dumps({k: r.get(k) for k in ("index", "role", "slot", "step", "state", "state_hash", "error")})
            for r in s.summary()]
    raise AssertionError(f"timed out after {timeout_s} s: {what}\n" + "\n".join(rows) + "\n" + log_tails(s))


def log_tails(s: LocalSwarm, lines: int = 6, width: int = 220) -> str:
    """The last warnings and lane events of each node's log, one line each, cut to `width`: what a CI report shows
    of a failure."""
    out = []
    for i, n in enumerate(s.nodes):
        try:
            text = Path(n.log_file).read_text(errors="replace").splitlines()
        except OSError as e:
            out.append(f"node {i}: no log ({e})")
            continue
        worth = [ln for ln in text if re.search(r" (WARNING|ERROR) shoal|Traceback| entered | links: |aborted", ln)]
        worth = worth[-lines:]
        out += [f"node {i}: {ln[:width]}" for ln in worth]
    return "\n".join(out)


def done(s: LocalSwarm, steps: int, replicas: int) -> bool:
    rows = active(s)
    return len(rows) == replicas and all(r.get("state") == "done" and r.get("step") == steps for r in rows)


@pytest.mark.parametrize("sync", ["cocktail", "allreduce", "diloco"])
def test_replicas_learn_and_stay_bit_identical(tmp_path, sync):
    s = make_swarm(tmp_path, 3, write_run(tmp_path / "w", replicas=3, sync=sync), 40)
    try:
        s.start()
        wait(lambda: done(s, 40, 3), 150, "three replicas to finish 40 steps", s)
        rows = active(s)
        assert len({r["state_hash"] for r in rows}) == 1, rows  # synchronized state equal on every replica
        assert all(r["loss"] < 4.0 for r in rows)  # from ~5.5 (uniform over bytes) at the start
        assert all(r["eval_loss"] < 4.5 for r in rows)
        assert all(r["bytes_sent"] > 0 for r in rows)
        if sync == "cocktail":
            assert min(r["compression_ratio"] for r in rows) > 100
    finally:
        s.stop()


def test_a_killed_active_node_is_replaced_by_the_backup(tmp_path):
    s = make_swarm(tmp_path, 4, write_run(tmp_path / "w", replicas=3), 120)
    try:
        s.start()
        wait(lambda: training(s, 3, 15), 120, "training to get going", s)
        victim = next(r for r in active(s) if r["index"] != 0)  # not the broker
        backup = next(r for r in s.summary() if r.get("role") == "backup")
        s.nodes[victim["index"]].proc.send_signal(signal.SIGKILL)
        t_kill = time.monotonic()
        promoted = wait(lambda: any(r["index"] == backup["index"] for r in active(s)), 60, "the backup to be promoted",
                        s)
        step_at_kill = newest_step(s)
        wait(lambda: training(s, 3, step_at_kill + 6), 90, "training to go on", s)
        recovered = time.monotonic() - t_kill
        print(f"killed member: the backup promoted after {promoted:.1f} s, training on after {recovered:.1f} s")
        wait(lambda: done(s, 120, 3), 240, "the run to finish with the promoted node", s)
        rows = active(s)
        assert {r["index"] for r in rows} == {0, backup["index"]} | ({1, 2, 3} - {victim["index"], backup["index"]})
        assert len({r["state_hash"] for r in rows}) == 1, rows
        assert recovered < 90
    finally:
        s.stop()


def test_the_standby_takes_over_when_the_broker_is_killed(tmp_path):
    # survivors keep training while the lease runs out (--fail-after 4): long enough for the backup to enter after
    steps = 200
    s = make_swarm(tmp_path, 4, write_run(tmp_path / "w", replicas=3), steps)
    try:
        s.start()
        wait(lambda: training(s, 3, 15), 120, "training to get going", s)
        s.nodes[0].proc.send_signal(signal.SIGKILL)  # the broker, which also holds slot s0r0
        step_at_kill = newest_step(s)
        wait(lambda: any(r.get("role") == "broker" or (r.get("run_id") and r["index"] != 0 and r.get("is_broker"))
                         for r in s.summary()) or len(active(s)) == 3, 60, "a new broker and a full group", s)
        wait(lambda: training(s, 3, step_at_kill + 6), 120, "training to go on under the new broker", s)
        wait(lambda: done(s, steps, 3), 240, "the run to finish", s)
        assert len({r["state_hash"] for r in active(s)}) == 1
    finally:
        s.stop()


def test_a_private_run_refuses_a_node_without_the_secret(tmp_path):
    run = write_run(tmp_path / "w", replicas=2, secret="open sesame")
    s = make_swarm(tmp_path, 1, run, 1000, "--secret", "open sesame")
    try:
        s.start()
        out = subprocess.run([*SHOAL, "node", "--listen", "/ip4/127.0.0.1/tcp/0", "--run", str(run), "--join",
                              s.bootstrap_addrs()[0], "--identity", str(tmp_path / "intruder.key")],
                             capture_output=True, text=True, timeout=120,
                             env={"SHOAL_HOME": str(tmp_path / "home"), "PATH": "/usr/bin:/bin"})
        assert out.returncode == Exit.SECRET, out.stderr
        assert "join secret is required" in out.stderr
    finally:
        s.stop()
