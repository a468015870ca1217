"""hivemind as the baseline: its own virtual environment, and N hivemind peers started in the benchmark's namespaces.

hivemind and py-libp2p cannot share a process (a duplicate protobuf symbol), so hivemind runs in a venv of its own,
`$SHOAL_HOME/venv-bench-hivemind` by default (made on first use; also used by `shoal bench codecs`). The baseline's
scripts ship in this package; they import shoal's torch-only packages from wherever this shoal is installed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from shoal.node.localswarm import NodeProcess, tail
from shoal.bench.topology import Topology

HERE = Path(__file__).resolve().parent
TRAIN_SCRIPT = HERE / "hivemind_train.py"
CODECS_SCRIPT = HERE / "hivemind_codecs.py"
#: the environment variable through which the baseline's scripts learn where shoal's torch-only packages are
PACKAGES_ENV = "SHOAL_PACKAGE_DIRS"
#: torch pinned (only this build is served locally); hivemind 1.1.12's 8-bit codecs mis-decode with numpy >= 2;
#: tomli-w lets the baseline read shoal's run manifest
REQUIREMENTS = ["torch==2.13.0", "hivemind==1.1.12", "numpy<2", "tomli-w"]
CHECK_IMPORTS = "import hivemind, numpy, tomli_w"
INSTALL_TIMEOUT_S = 1200.0


def default_venv() -> Path:
    return Path(os.environ.get("SHOAL_HOME", "~/.shoal")).expanduser() / "venv-bench-hivemind"


def package_dirs_env() -> dict[str, str]:
    """The environment that lets the baseline's scripts import shoal.protocol, shoal.kernels and shoal.node from this
    installation (hivemind's venv cannot install shoal: py-libp2p and hivemind clash in one process)."""
    import json

    import shoal.kernels
    import shoal.node
    import shoal.protocol

    dirs = {name: str(Path(mod.__path__[0]).resolve()) for name, mod in
            (("protocol", shoal.protocol), ("kernels", shoal.kernels), ("node", shoal.node))}
    return {PACKAGES_ENV: json.dumps(dirs)}


def baseline_python(given: str | None = None, venv: Path | None = None) -> tuple[str | None, str]:
    """(python of a venv with hivemind, how it was found) or (None, why not); creates the venv when missing."""
    if given:
        return given, "given"
    VENV = venv if venv is not None else default_venv()
    py = VENV / "bin" / "python"
    try:
        if not py.exists():
            subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True, timeout=120)
        ok = subprocess.run([str(py), "-c", CHECK_IMPORTS], capture_output=True, timeout=120).returncode == 0
        if not ok:
            subprocess.run([str(py), "-m", "pip", "install", "-q", *REQUIREMENTS], check=True,
                           timeout=INSTALL_TIMEOUT_S)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as e:
        return None, f"could not set up {VENV}: {e}"
    return str(py), "auto venv"


@dataclass(frozen=True, kw_only=True, slots=True)
class HivemindSettings:
    compression: str = "none"  # "none" (hivemind's default), "fp16" or "8bit" (Uniform8BitQuantization)
    matchmaking_time_s: float = 3.0  # hivemind's quickstart value (its default, 15 s, is for large batches)
    averaging_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.compression not in ("none", "fp16", "8bit"):
            raise ValueError("hivemind compression: none, fp16 or 8bit")
        if self.matchmaking_time_s <= 0 or self.averaging_timeout_s <= 0:
            raise ValueError("hivemind timings must be positive")

    @property
    def label(self) -> str:
        return "hivemind" if self.compression == "none" else f"hivemind {self.compression}"


class HivemindSwarm:
    """N hivemind peers, peer i in namespace i; the same `nodes`/`topo`/`stop()` shape as NamespaceSwarm."""

    def __init__(self, *, python: str, topo: Topology, nodes: int, workdir: Path, manifest: Path, steps: int,
                 settings: HivemindSettings, time_limit_s: float, start_timeout_s: float = 120.0):
        self.python, self.topo, self.n, self.workdir = python, topo, nodes, workdir
        self.manifest, self.steps, self.settings = manifest, steps, settings
        self.time_limit_s, self.start_timeout_s = time_limit_s, start_timeout_s
        self.nodes: list[NodeProcess] = []

    def _start(self, i: int, peers: list[str]) -> NodeProcess:
        status, logf = self.workdir / f"hm{i}.json", self.workdir / f"hm{i}.log"
        status.unlink(missing_ok=True)
        s = self.settings
        cmd = [*self.topo.exec_argv(i), self.python, "-W", "ignore", str(TRAIN_SCRIPT), "--manifest", str(self.manifest),
               "--index", str(i), "--nodes", str(self.n), "--listen", self.topo.ip(i), "--status-file", str(status),
               "--steps", str(self.steps), "--compression", s.compression,
               "--matchmaking-time", str(s.matchmaking_time_s), "--averaging-timeout", str(s.averaging_timeout_s),
               "--time-limit", str(self.time_limit_s), "--initial-peers", *peers]
        with open(logf, "ab") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True, env={**os.environ, **package_dirs_env()})
        node = NodeProcess(i, proc, status, logf)
        self.nodes.append(node)
        return node

    def start(self) -> None:
        first = self._start(0, [])
        deadline = time.monotonic() + self.start_timeout_s
        while not (st := first.status() or {}).get("addrs"):
            if not first.alive or time.monotonic() > deadline:
                raise RuntimeError(f"hivemind peer 0 did not start: {tail(first.log_file)}")
            time.sleep(0.2)
        for i in range(1, self.n):
            self._start(i, st["addrs"])

    def stop(self, timeout_s: float = 15.0) -> dict[int, int | None]:
        """SIGTERM each peer's process group (the peer and its p2pd daemon), SIGKILL what outlives the timeout."""
        for n in self.nodes:
            _signal_group(n.proc.pid, signal.SIGTERM)
        deadline, codes = time.monotonic() + timeout_s, {}
        for n in self.nodes:
            try:
                codes[n.index] = n.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                codes[n.index] = None
        for n in self.nodes:
            _signal_group(n.proc.pid, signal.SIGKILL)  # p2pd may outlive its peer
            n.proc.wait()
        return codes


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)  # each peer was started in a session (and group) of its own
    except ProcessLookupError:
        pass
