"""Test-wide settings: hypothesis profiles and a reaper for child processes a test forgot."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from hypothesis import HealthCheck, settings

from tests.helpers import compose_prebuild
from tests.helpers.processes import children

settings.register_profile(
    "ci", derandomize=True, deadline=None, max_examples=60, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("dev", deadline=None, max_examples=100)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))

# the machine's hardware profile (node/train/hardware.py) is measured once for the whole session, not once per test's
# $SHOAL_HOME: every node process a test starts inherits this, and the user's own ~/.cache is left alone
_CACHE = None
if not os.environ.get("SHOAL_CACHE"):
    _CACHE = tempfile.TemporaryDirectory(prefix="shoal-test-cache-")
    os.environ["SHOAL_CACHE"] = _CACHE.name


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
    """Kill (by PID) any child process a test left running, so one failure cannot leak nodes into the next (the
    compose image's background build is stopped its own way first: it stops its Docker engine)."""
    yield
    compose_prebuild.stop()
    for pid in children(os.getpid()):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


CHILD_ENV = "SHOAL_TEST_IN_OWN_PROCESS"


class _Forker:
    """The parent's end of tests/helpers/forker.py: one process, started at the first `own_process` test, that forks
    a fresh child per test from an interpreter that imported the heavy modules once (a fresh interpreter per test
    spent ~5 s importing them)."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.buf = b""  # answers read and not yet taken

    def run(self, root: Path, args: list[str], timeout_s: float) -> tuple[int | None, str]:
        """(the child's exit code, None when it ran past `timeout_s` and was killed; its output)."""
        if self.proc is None or self.proc.poll() is not None:
            self.buf = b""
            self.proc = subprocess.Popen([sys.executable, "-m", "tests.helpers.forker"], cwd=root,
                                         env={**os.environ, CHILD_ENV: "1"}, stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, bufsize=0)
        with tempfile.NamedTemporaryFile(prefix="shoal-own-process-", suffix=".log") as out:
            self.proc.stdin.write((json.dumps({"args": args, "out": out.name}) + "\n").encode())
            pid = self._answer(time.monotonic() + 60)["pid"]  # the imports happen once, before the first answer
            try:
                code = self._answer(time.monotonic() + timeout_s)["code"]
            except TimeoutError:
                os.kill(pid, signal.SIGKILL)
                self._answer(time.monotonic() + 30)
                code = None
            return code, Path(out.name).read_text(errors="replace")

    def close(self) -> None:
        if self.proc is not None:
            self.proc.stdin.close()  # its loop ends at the end of its input
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc.stdout.close()
            self.proc = None

    def _answer(self, deadline: float) -> dict:
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.proc.stdout], [], [], left)[0]:
                raise TimeoutError("no answer from the forking process")
            chunk = os.read(self.proc.stdout.fileno(), 4096)
            if not chunk:
                raise RuntimeError(f"the forking process exited ({self.proc.wait()})")
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)


_FORKER = _Forker()


_COMPOSE_IN_SESSION: bool | None = None


def pytest_runtest_setup(item):
    """At the first test of tests/e2e, start building the compose test's image in the background when that test is
    in the session (tests/helpers/compose_prebuild.py): the CLI tests before it overlap its network waits."""
    global _COMPOSE_IN_SESSION
    if not item.nodeid.startswith("tests/e2e/"):
        return
    if _COMPOSE_IN_SESSION is None:
        _COMPOSE_IN_SESSION = any(i.get_closest_marker("compose_image") for i in item.session.items)
    if _COMPOSE_IN_SESSION:
        compose_prebuild.start()


def pytest_sessionfinish(session, exitstatus):
    compose_prebuild.stop()
    _FORKER.close()
    if _CACHE is not None:
        _CACHE.cleanup()


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    """A test marked `own_process` runs in a fresh process (pytest on its node id, forked from a clean interpreter
    that has only imported modules: tests/helpers/forker.py): in-process multi-node tests share one event loop and
    its timing with nothing left over from the tests before them (threads, sockets, caches of py-libp2p's). Its
    assertions are the test's own; a failure shows the child's output."""
    if pyfuncitem.get_closest_marker("own_process") is None or os.environ.get(CHILD_ENV):
        return None
    cfg = pyfuncitem.config
    # plugin modules the forking process imported already (anyio, by py-libp2p) cannot have their asserts rewritten
    args = ["-q", "-p", "no:randomly", "-W", "ignore::pytest.PytestAssertRewriteWarning", pyfuncitem.nodeid]
    profile = cfg.getoption("hypothesis_profile", None)
    if profile:
        args.append(f"--hypothesis-profile={profile}")
    code, out = _FORKER.run(cfg.rootpath, args, timeout_s=280)
    if code is None:
        pytest.fail(f"{pyfuncitem.nodeid} ran past 280 s in its own process and was killed:\n"
                    f"{_failure_excerpt(out)}", pytrace=False)
    if code != 0:
        pytest.fail(f"{pyfuncitem.nodeid} failed in its own process (exit {code}):\n"
                    f"{_failure_excerpt(out)}", pytrace=False)
    return True


def _failure_excerpt(out: str, head: int = 6000, tail: int = 3000) -> str:
    """The child's traceback (the start of its FAILURES section, which captured library chatter can push far from
    the end) and the end of its output."""
    at = out.find("= FAILURES =")
    if at < 0 or len(out) - at <= head + tail:
        return out[-(head + tail):]
    return f"{out[at:at + head]}\n[…]\n{out[-tail:]}"
