"""`shoal export`, `shoal swarm up --resume` and `shoal node --resume` on a folder without checkpoints: one line
that says so, exit 2 (the real `shoal` command)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow
SHOAL = [sys.executable, "-m", "shoal.node.cli"]


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
