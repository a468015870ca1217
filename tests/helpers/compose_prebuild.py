"""The compose test's image, built in the background while the tests before it run.

A cold `compose/build-offline.sh` (CI machines start bare) spends ~3 minutes mostly waiting on the network and the
disk: apt-get for the engine and debootstrap, debootstrap itself, pip's wheelhouse, the image's install. Started as
this module's own process when the first test of tests/e2e begins (tests/conftest.py; only when the compose swarm
test is among the session's tests), it overlaps those waits with the CLI tests; the compose test then waits for it and
runs the same build itself, which finds every phase cached, so a failure here costs time and never hides one: the
test's own build reports it. Its output goes to `prebuild.log` in the build cache.

    python -m tests.helpers.compose_prebuild CACHE_DIR    # what the hook runs

The process stops its build and its private engine on SIGTERM (the session ending first)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: the build's cache: the base's tarball, the Debian packages, the wheelhouse and the engine's data root (images)
CACHE = Path(os.environ.get("SHOAL_BUILD_CACHE", Path.home() / ".cache" / "shoal" / "compose"))
LOG = "prebuild.log"

_job: subprocess.Popen | None = None


def start(cache: Path = CACHE) -> None:
    """Start the background build (once per session)."""
    global _job
    if _job is not None:
        return
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / LOG, "w") as log:
        _job = subprocess.Popen([sys.executable, "-m", "tests.helpers.compose_prebuild", str(cache)], cwd=ROOT,
                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)


def wait(timeout_s: float, cache: Path = CACHE) -> dict[str, float]:
    """Wait for the background build, if one was started: its exit status, its seconds (as its log says them) and
    how long this waited. A build still running at `timeout_s` is stopped."""
    if _job is None:
        return {}
    t0 = time.monotonic()
    try:
        code = _job.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        stop()
        code = -1
    took = re.findall(r"exited -?\d+ after (\d+) s", (cache / LOG).read_text(errors="replace"))
    return {"prebuild_exit": float(code), "prebuild_s": float(took[-1]) if took else float("nan"),
            "prebuild_waited_s": time.monotonic() - t0}


def stop(grace_s: float = 60.0) -> None:
    """Stop a background build that is still running (by its PID: it stops its engine), then its process group."""
    if _job is None or _job.poll() is not None:
        return
    _job.terminate()
    try:
        _job.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(_job.pid, signal.SIGKILL)  # whatever of its build is left (its own session: nothing else)
    except ProcessLookupError:
        pass
    _job.wait()


def _main(cache: Path) -> int:
    from tests.helpers.docker_engine import DockerEngine, cached_data_root, ensure_tools

    build: subprocess.Popen | None = None

    def on_term(signum, frame):
        if build is not None and build.poll() is None:
            build.terminate()
        raise SystemExit(128 + signum)  # unwinds the engine's context: it is stopped and removed

    signal.signal(signal.SIGTERM, on_term)
    t0 = time.monotonic()
    ensure_tools()
    print(f"prebuild: tools ready after {time.monotonic() - t0:.0f} s", flush=True)
    with cached_data_root(cache) as data_root:
        if data_root is None:
            print("prebuild: another run holds the engine cache; nothing to do", flush=True)
            return 0
        with DockerEngine(data_root=data_root) as engine:
            build = subprocess.Popen([str(ROOT / "compose" / "build-offline.sh")],
                                     env={**engine.env, "SHOAL_BUILD_CACHE": str(cache)})
            try:
                code = build.wait(timeout=1200)
            except subprocess.TimeoutExpired:
                build.kill()
                code = build.wait()
    print(f"prebuild: build-offline.sh exited {code} after {time.monotonic() - t0:.0f} s", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(_main(Path(sys.argv[1])))
