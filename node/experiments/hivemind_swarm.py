"""hivemind as the baseline: its own virtual environment, and N hivemind peers started in the benchmark's namespaces.

hivemind and py-libp2p cannot share a process (a duplicate protobuf symbol), so hivemind runs in a venv of its own,
`.venv-bench-hivemind` in the checkout, made on first use (also used by `shoal bench codecs`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from shoal.node.cli.localswarm import NodeProcess, tail
from shoal.node.experiments.topology import Topology

REPO = Path(__file__).resolve().parents[2]
VENV = REPO / ".venv-bench-hivemind"
TRAIN_SCRIPT = REPO / "bench" / "hivemind_train.py"
#: torch pinned (only this build is served locally); hivemind 1.1.12's 8-bit codecs mis-decode with numpy >= 2;
#: tomli-w lets the baseline read shoal's run manifest
REQUIREMENTS = ["torch==2.13.0", "hivemind==1.1.12", "numpy<2", "tomli-w"]
CHECK_IMPORTS = "import hivemind, numpy, tomli_w"
INSTALL_TIMEOUT_S = 1200.0


def baseline_python(given: str | None = None) -> tuple[str | None, str]:
    """(python of a venv with hivemind, how it was found) or (None, why not); creates the venv when missing."""
    if given:
        return given, "given"
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
                                    start_new_session=True)
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
