"""protocol/ and swarm/ type-check clean with mypy (settings in pyproject.toml, [tool.mypy]). The folders are the
`shoal.*` packages only once installed (setuptools' package-dir), so mypy reads them through a `shoal/` folder of
links made here; kernels/ comes along as what swarm imports. A new error fails with mypy's own report."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHECKED = ("protocol", "swarm")


def test_protocol_and_swarm_type_check_clean(tmp_path):
    package = tmp_path / "tree" / "shoal"
    package.mkdir(parents=True)
    for folder in ("protocol", "kernels", "swarm"):
        (package / folder).symlink_to(ROOT / folder, target_is_directory=True)
    args = [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
            "--cache-dir", str(tmp_path / "cache"), *(f"-p=shoal.{p}" for p in CHECKED)]
    done = subprocess.run(args, cwd=package.parent, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Success: no issues found" in done.stdout
