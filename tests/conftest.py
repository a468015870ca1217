"""Test-wide settings: hypothesis profiles and a reaper for child processes a test forgot."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from hypothesis import HealthCheck, settings

from tests.helpers.processes import children

settings.register_profile(
    "ci", derandomize=True, deadline=None, max_examples=60, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("dev", deadline=None, max_examples=100)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))


@pytest.fixture
def one_torch_thread():
    """Torch on one thread for the test (several replicas train at once on a 2-core machine)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True, scope="session")
def reap_children():
    """Kill (by PID) any child process a test left running, so one failure cannot leak nodes into the next."""
    yield
    for pid in children(os.getpid()):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


CHILD_ENV = "SHOAL_TEST_IN_OWN_PROCESS"


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    """A test marked `own_process` runs in a fresh interpreter (pytest on its node id): in-process multi-node tests
    share one event loop and its timing with nothing left over from the tests before them (threads, sockets,
    caches of py-libp2p's). Its assertions are the test's own; a failure shows the child's output."""
    if pyfuncitem.get_closest_marker("own_process") is None or os.environ.get(CHILD_ENV):
        return None
    cfg = pyfuncitem.config
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", pyfuncitem.nodeid]
    profile = cfg.getoption("hypothesis_profile", None)
    if profile:
        cmd.append(f"--hypothesis-profile={profile}")
    r = subprocess.run(cmd, cwd=cfg.rootpath, env={**os.environ, CHILD_ENV: "1"}, capture_output=True, text=True,
                       timeout=280)
    if r.returncode != 0:
        pytest.fail(f"{pyfuncitem.nodeid} failed in its own process (exit {r.returncode}):\n"
                    f"{_failure_excerpt(r.stdout + r.stderr)}", pytrace=False)
    return True


def _failure_excerpt(out: str, head: int = 6000, tail: int = 3000) -> str:
    """The child's traceback (the start of its FAILURES section, which captured library chatter can push far from
    the end) and the end of its output."""
    at = out.find("= FAILURES =")
    if at < 0 or len(out) - at <= head + tail:
        return out[-(head + tail):]
    return f"{out[at:at + head]}\n[…]\n{out[-tail:]}"
