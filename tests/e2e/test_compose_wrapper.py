"""compose/shoal-compose, the README's compose command, with either Compose a machine has: Compose v2's `docker
compose` or Debian's `docker-compose` v1.29 (same arguments); `exec` into a service with no running container is an
error that says why and what to do; a legacy build's dependency stage is named, not left dangling. The Docker
commands here are stand-ins that record what they were asked (tests/e2e/test_compose_e2e.py runs the real ones)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WRAPPER = ROOT / "compose" / "shoal-compose"
FILE = ROOT / "compose" / "docker-compose.yml"
TOOLS = ("basename", "dirname", "grep", "head", "tail")

STUB = """#!/bin/sh
echo "$(basename "$0") $*" >> "$STUB_LOG"
case "$(basename "$0") $*" in
  "docker compose version") exit "${STUB_V2:-1}" ;;
  *" ps --services --filter status=running") printf '%s\\n' $STUB_RUNNING ;;
  "docker images -q --filter dangling=true --filter label=org.shoal.stage=deps") printf '%s\\n' $STUB_DANGLING ;;
  "docker images -q shoal:deps") printf '%s\\n' $STUB_OLD ;;
esac
exit 0
"""


def run(tmp_path: Path, *args: str, v1: bool = True, v2: bool = False,
        **env: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    bin_ = tmp_path / "bin"
    bin_.mkdir(exist_ok=True)
    for old in bin_.iterdir():
        old.unlink()
    names = ["docker"] + (["docker-compose"] if v1 else [])
    for name in names:
        (bin_ / name).write_text(STUB)
        (bin_ / name).chmod(0o755)
    tools = tmp_path / "tools"  # the few commands the wrapper uses, and no real Docker or Compose
    tools.mkdir(exist_ok=True)
    for name in TOOLS:
        if not (tools / name).exists():
            (tools / name).symlink_to(shutil.which(name))
    log = tmp_path / "calls.log"
    log.unlink(missing_ok=True)
    r = subprocess.run(["/bin/sh", str(WRAPPER), *args], capture_output=True, text=True, timeout=30,
                       env={"PATH": f"{bin_}:{tools}", "STUB_LOG": str(log), "STUB_V2": "0" if v2 else "1", **env})
    return r, log.read_text().splitlines() if log.exists() else []


def test_either_compose_spelling_with_the_same_arguments(tmp_path):
    r, calls = run(tmp_path, "up", "-d", "--scale", "node=4")
    assert r.returncode == 0, r.stderr
    assert calls[-1] == f"docker-compose -f {FILE} up -d --scale node=4"  # Debian's Compose v1.29
    r, calls = run(tmp_path, "--profile", "gpu", "up", "-d", v2=True)
    assert r.returncode == 0 and calls[-1] == f"docker compose -f {FILE} --profile gpu up -d"  # Compose v2
    r, calls = run(tmp_path, "ps", v1=False)
    assert r.returncode == 127 and "apt-get install docker-compose" in r.stderr


def test_exec_into_a_service_with_no_running_container_says_so(tmp_path):
    r, calls = run(tmp_path, "exec", "-T", "node", "shoal", "doctor", STUB_RUNNING="bootstrap")
    assert r.returncode == 1 and "no container of service 'node' is running" in r.stderr and "logs" in r.stderr
    assert not any(" exec " in c for c in calls)
    r, calls = run(tmp_path, "exec", "-T", "node", "shoal", "doctor", STUB_RUNNING="bootstrap node")
    assert r.returncode == 0 and calls[-1].endswith("exec -T node shoal doctor")


def test_a_legacy_builds_dependency_stage_is_named_not_dangling(tmp_path):
    r, calls = run(tmp_path, "up", "-d", "--build", STUB_DANGLING="newdeps olddangling", STUB_OLD="prevdeps")
    assert r.returncode == 0, r.stderr
    assert "docker tag newdeps shoal:deps" in calls
    assert {"docker image rm olddangling", "docker image rm prevdeps"} <= set(calls)
    r, calls = run(tmp_path, "up", "-d")  # no build: no image housekeeping
    assert not any("images" in c for c in calls)
