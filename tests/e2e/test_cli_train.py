"""`shoal run` and `shoal train` end to end, as a user runs them (subprocesses)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from shoal.node.cli.errors import Exit


def shoal(*args: str, cwd, check: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "shoal.node.cli", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"shoal {' '.join(args)} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


def metrics(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_train_builtin_default_then_resume(tmp_path):
    out = tmp_path / "out"
    first = shoal("train", "--steps", "3", "--out", str(out), "--threads", "1", "--no-progress", cwd=tmp_path)
    assert "step 3/3" in first.stderr
    assert [m["step"] for m in metrics(out)] == [1, 2, 3]
    assert (out / "ckpt-0000000003.pt").exists() and (out / "run.toml").exists()
    second = shoal("train", "--steps", "5", "--out", str(out), "--threads", "1", "--no-progress", cwd=tmp_path)
    assert "resumed at step 3" in second.stderr
    steps = metrics(out)
    assert [m["step"] for m in steps] == [1, 2, 3, 4, 5]
    assert all(m["loss"] > 0 and m["tokens_per_s"] > 0 for m in steps)


@pytest.mark.slow
def test_run_create_show_and_train_from_it(tmp_path):
    run = tmp_path / "run.toml"
    created = shoal(
        "run", "create", "-o", str(run), "--identity", str(tmp_path / "id.key"), "--layers", "1", "--d-model", "32",
        "--heads", "2", "--seq-len", "32", "--batch", "4", "--steps", "4", "--warmup", "1", "--eval-every", "2",
        "--ckpt-every", "2", "--keep", "1", cwd=tmp_path,
    )
    run_id = created.stdout.split("run id")[1].split()[0]
    shown = shoal("run", "show", str(run), cwd=tmp_path)
    assert run_id in shown.stdout and "signature  valid" in shown.stdout
    out = tmp_path / "out"
    shoal("train", "--run", str(run), "--out", str(out), "--threads", "1", "--no-progress", cwd=tmp_path)
    recs = metrics(out)
    assert [m["step"] for m in recs] == [1, 2, 3, 4] and "eval_loss" in recs[1]
    assert [p.name for p in sorted(out.glob("ckpt-*.pt"))] == ["ckpt-0000000004.pt"]

    tampered = tmp_path / "tampered.toml"
    tampered.write_text(run.read_text().replace("lr = 0.003", "lr = 0.3"))
    bad = shoal("run", "show", str(tampered), cwd=tmp_path, check=False)
    assert bad.returncode == 1 and "INVALID" in bad.stdout
    refused = shoal("train", "--run", str(tampered), "--out", str(out), cwd=tmp_path, check=False)
    assert refused.returncode == 2 and "signature" in refused.stderr


def test_invalid_manifest_names_the_field(tmp_path):
    run = tmp_path / "run.toml"
    run.write_text("[batch]\nbatch_size = 16\nmicro_batch_size = 5\n")
    from argparse import Namespace

    from shoal.node.cli import run as cmd_run

    assert cmd_run.main(Namespace(run_command="show", path=str(run))) == 2


def test_invalid_manifest_error_message(tmp_path, capsys):
    run = tmp_path / "run.toml"
    run.write_text("[plan]\nreplicas = 0\n")
    from argparse import Namespace

    from shoal.node.cli import run as cmd_run

    assert cmd_run.main(Namespace(run_command="show", path=str(run))) == 2
    assert "plan.replicas" in capsys.readouterr().err


@pytest.mark.slow
def test_ctrl_c_stops_after_the_step_with_a_checkpoint(tmp_path):
    import signal
    import time

    out = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, "-m", "shoal.node.cli", "train", "--steps", "100000", "--out", str(out), "--threads", "1", "--no-progress"],
        cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and not ((out / "metrics.jsonl").exists() and metrics(out)):
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert "checkpoint saved" in err
    step = metrics(out)[-1]["step"]
    assert (out / f"ckpt-{step:010d}.pt").exists()


def test_pipeline_manifests_train_across_nodes_only(tmp_path):
    run = tmp_path / "s2.toml"
    made = shoal("run", "create", "-o", str(run), "--identity", str(tmp_path / "id.key"), "--layers", "2",
                 "--stages", "2", "--pipeline-compression", "aqsgd", cwd=tmp_path)
    assert "run id" in made.stdout
    shown = shoal("run", "show", str(run), cwd=tmp_path).stdout
    assert "micro_batch_size = 2" in shown  # 16 sequences in 4 x 2 micro-batches
    assert 'compression = "aqsgd"' in shown
    refused = shoal("train", "--run", str(run), "--out", str(tmp_path / "out"), cwd=tmp_path, check=False)
    assert refused.returncode == Exit.USAGE, refused.stderr
    assert "across nodes" in refused.stderr and "Traceback" not in refused.stderr, refused.stderr
