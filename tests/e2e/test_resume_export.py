"""A stopped run goes on as if it had not stopped, and its model can be taken away (the real `shoal` command, node
processes on 127.0.0.1): `shoal swarm up --steps 12` then `--resume DIR --steps 20` ends with every slot's whole
state (weights, AdamW, CocktailSGD's error feedback, data position, RNG) bit for bit the state of an uninterrupted
`--steps 20` run of the same run (same keys, same run id); `shoal export` writes safetensors that load into the
whole model and give the checkpoint's logits."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shoal.node.run.checkpoints import read_checkpoint, slots_on_disk
from shoal.node.train import export_gpt
from shoal.node.train.model import build_stage
from shoal.protocol.manifest import RunManifest

pytestmark = pytest.mark.slow
SHOAL = [sys.executable, "-m", "shoal.node.cli"]


def swarm_up(home: Path, *args: str) -> dict:
    cmd = SHOAL + ["swarm", "up", "--nodes", "2", "--backups", "0", "--json", "--converge-timeout", "60", *args]
    r = subprocess.run(cmd, env={**os.environ, "SHOAL_HOME": str(home)}, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, f"{' '.join(args)}: exit {r.returncode}\n{r.stderr[-3000:]}"
    return json.loads(r.stdout)


def final_hashes(workdir: Path, run_id: str, step: int) -> dict[str, str]:
    root = workdir / "checkpoints"
    slots = slots_on_disk(root, run_id)
    assert slots and all(step in steps for steps in slots.values()), slots
    return {f"s{s}r{r}": json.loads((root / run_id[:16] / f"s{s}r{r}" / f"ckpt-{step:010d}.json").read_text())
            ["state_hash"] for s, r in slots}


def test_a_resumed_swarm_ends_bit_identical_to_an_uninterrupted_one_and_exports(tmp_path):
    home = tmp_path / "home"
    stopped, straight = tmp_path / "stopped", tmp_path / "straight"
    first = swarm_up(home, "--dir", str(stopped), "--steps", "12")
    assert first["run"]["steps"] >= 12
    run_id = RunManifest.from_toml((stopped / "run.toml").read_text()).run_id
    at_stop = final_hashes(stopped, run_id, 12)
    straight.mkdir()
    for key in stopped.glob("node*.key"):  # the same nodes: the same peer ids, run id and chunk owners
        shutil.copy(key, straight / key.name)
    resumed = swarm_up(home, "--resume", str(stopped), "--steps", "20")
    assert resumed["run"]["steps"] == 20 and all(e["source"] == "checkpoint" for n in resumed["nodes"]
                                                 for e in n.get("entries", [])[:1])
    swarm_up(home, "--dir", str(straight), "--steps", "20")
    assert RunManifest.from_toml((straight / "run.toml").read_text()).run_id == run_id
    assert final_hashes(stopped, run_id, 20) == final_hashes(straight, run_id, 20) != at_stop

    out = tmp_path / "model"
    r = subprocess.run(SHOAL + ["export", str(stopped), "--out", str(out)], env={**os.environ, "SHOAL_HOME": str(home)},
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "step 20" in r.stdout and (out / "model.safetensors").is_file()
    model = export_gpt.load(out)
    snap, _ = read_checkpoint(stopped / "checkpoints", run_id, 0, 0, 20)
    m = RunManifest.from_toml((stopped / "run.toml").read_text())
    ref = build_stage(export_gpt.model_config(m), 0, 1)
    ref.load_state_dict(export_gpt.stage_weights(m, 0, snap.state()))  # the last round, carried pending, applied
    tokens = torch.tensor([list(b"def resume(self):  return 42\n")])
    with torch.no_grad():
        assert torch.equal(model(tokens), ref.eval()(tokens))


@pytest.mark.parametrize("argv, said", [
    (["export", "{d}/empty", "--out", "{d}/m"], "holds no run's checkpoints"),
    (["swarm", "up", "--resume", "{d}/empty"], "not a `shoal swarm up` folder"),
    (["node", "--resume", "{d}/empty"], "holds no run's checkpoints"),
])
def test_resume_and_export_without_checkpoints_say_so(tmp_path, argv, said):
    (tmp_path / "empty").mkdir()
    r = subprocess.run(SHOAL + [a.format(d=tmp_path) for a in argv], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "SHOAL_HOME": str(tmp_path / "home")})
    assert r.returncode == 2, r.stderr
    assert said in r.stderr and "Traceback" not in r.stderr
