"""A whole swarm on this machine: N node processes on 127.0.0.1, the first one the bootstrap, stopped by PID."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)
RUN_FIELDS = ("run_id", "slot", "warm_stage", "step", "loss", "eval_loss", "tokens_per_s", "bytes_sent", "bytes_recv",
              "compression_ratio", "link_bytes_sent", "link_bytes_recv", "state_hash", "refetches", "entries",
              "warm_revision", "lane_links", "error")


@dataclass(frozen=True, kw_only=True, slots=True)
class LocalSwarmConfig:
    nodes: int = 3
    workdir: Path
    home: Path
    device: str = "cpu"
    status_interval_s: float = 1.0
    gone_after_s: float = 8.0
    start_timeout_s: float = 60.0
    extra_node_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not 1 <= self.nodes <= 64:
            raise ValueError("--nodes must be between 1 and 64")


@dataclass(slots=True)
class NodeProcess:
    index: int
    proc: subprocess.Popen
    status_file: Path
    log_file: Path
    started: float = field(default_factory=time.monotonic)

    def status(self) -> dict | None:
        try:
            return json.loads(self.status_file.read_text())
        except (OSError, ValueError):
            return None

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None


class LocalSwarm:
    def __init__(self, config: LocalSwarmConfig):
        self.config = config
        self.nodes: list[NodeProcess] = []
        config.workdir.mkdir(parents=True, exist_ok=True)

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["SHOAL_HOME"] = str(self.config.home)
        env.setdefault("PYTHONUNBUFFERED", "1")
        return env

    def warm_hardware_cache(self) -> None:
        """Measure the hardware once, so N nodes starting together do not all run the benchmark at once."""
        from shoal.node.train.hardware import hardware_profile

        hardware_profile(self.config.device, self.config.home)

    def launch_prefix(self, index: int) -> list[str]:
        """What node `index`'s command runs under (the network benchmark runs each in its own namespace)."""
        return []

    def listen_addr(self, index: int) -> str:
        return "/ip4/127.0.0.1/tcp/0"

    def start_node(self, index: int, join: list[str]) -> NodeProcess:
        wd = self.config.workdir
        status, logf = wd / f"node{index}.json", wd / f"node{index}.log"
        status.unlink(missing_ok=True)
        cmd = [*self.launch_prefix(index), sys.executable, "-m", "shoal.node.cli", "-v", "node",
               "--listen", self.listen_addr(index),
               "--identity", str(wd / f"node{index}.key"), "--status-file", str(status),
               "--device", self.config.device, "--status-interval", str(self.config.status_interval_s),
               "--gone-after", str(self.config.gone_after_s), *self.config.extra_node_args]
        for a in join:
            cmd += ["--join", a]
        with open(logf, "ab") as out:
            # a session of its own: Ctrl+C reaches only the supervisor, which stops the nodes by PID
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=self._env(), start_new_session=True)
        node = NodeProcess(index, proc, status, logf)
        if index < len(self.nodes):
            self.nodes[index] = node
        else:
            self.nodes.append(node)
        return node

    def wait_ready(self, node: NodeProcess) -> dict:
        deadline = time.monotonic() + self.config.start_timeout_s
        while time.monotonic() < deadline:
            st = node.status()
            if st and st.get("state") not in (None, "starting") and st.get("addrs"):
                return st
            if not node.alive:
                raise RuntimeError(f"node {node.index} exited with {node.proc.returncode}; log: {node.log_file}\n"
                                   + tail(node.log_file))
            time.sleep(0.1)
        raise TimeoutError(f"node {node.index} not ready after {self.config.start_timeout_s} s; log: {node.log_file}")

    def bootstrap_addrs(self) -> list[str]:
        st = self.nodes[0].status() if self.nodes else None
        return list(st["addrs"]) if st else []

    def start(self) -> None:
        self.warm_hardware_cache()
        first = self.start_node(0, [])
        self.wait_ready(first)
        join = self.bootstrap_addrs()
        for i in range(1, self.config.nodes):
            self.start_node(i, join)

    def peer_ids(self) -> dict[int, str]:
        out = {}
        for n in self.nodes:
            st = n.status()
            if st:
                out[n.index] = st["peer_id"]
        return out

    def converged(self) -> bool:
        """Every running node sees every other running node."""
        running = [n for n in self.nodes if n.alive]
        ids = {n.index: (n.status() or {}).get("peer_id") for n in running}
        if None in ids.values() or len(ids) < len(running):
            return False
        for n in running:
            seen = set((n.status() or {}).get("peers", []))
            if not {pid for i, pid in ids.items() if i != n.index} <= seen:
                return False
        return True

    def wait_converged(self, timeout_s: float) -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            if self.converged():
                return time.monotonic() - t0
            for n in self.nodes:
                if not n.alive:
                    raise RuntimeError(f"node {n.index} exited with {n.proc.returncode}:\n{tail(n.log_file)}")
            time.sleep(0.2)
        raise TimeoutError(f"the swarm did not converge within {timeout_s} s")

    def summary(self) -> list[dict]:
        rows = []
        for n in self.nodes:
            st = n.status() or {}
            row = {k: st.get(k) for k in RUN_FIELDS if k in st}
            row.update({"index": n.index, "peer_id": st.get("peer_id"), "pid": n.proc.pid,
                        "alive": n.alive, "state": st.get("state") if n.alive else "stopped",
                        "role": st.get("role"), "peers_seen": len(st.get("peers", [])), "peers": st.get("peers", []),
                        "addrs": st.get("addrs", []), "log": str(n.log_file)})
            rows.append(row)
        return rows

    def stop(self, timeout_s: float = 15.0) -> dict[int, int | None]:
        """SIGTERM every node by PID (a clean leave), SIGKILL what is still running after the timeout."""
        for n in self.nodes:
            if n.alive:
                n.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        codes = {}
        for n in self.nodes:
            try:
                codes[n.index] = n.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                n.proc.kill()
                codes[n.index] = n.proc.wait()
        return codes


def tail(path: Path, n: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""
