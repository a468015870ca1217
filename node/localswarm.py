"""A whole swarm on this machine: N node processes on 127.0.0.1, the first one the bootstrap, stopped by PID.

Nodes never outlive their supervisor: each is started with `--parent` (it leaves when this process is gone, even
after a SIGKILL), a signal that arrives while a node is being started is held until the node is on record, and
`stop` finishes even when more signals arrive. The swarm file ($SHOAL_HOME/local-swarm.json) names the supervisor
and every node by PID and start time, so `shoal swarm down` can stop a swarm whose terminal is gone."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)
RUN_FIELDS = ("run_id", "slot", "warm_stage", "step", "loss", "eval_loss", "tokens_per_s", "bytes_sent", "bytes_recv",
              "compression_ratio", "link_bytes_sent", "link_bytes_recv", "state_hash", "recent_hashes", "refetches",
              "entries", "warm_revision", "lane_links", "error", "samples_per_s", "samples_done", "tokens_done")
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
LOCAL_SWARM_FILE = "local-swarm.json"  # in $SHOAL_HOME: the swarm `shoal swarm up` runs here, for --local


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
    swarm_file: Path | None = None  # where to keep the record `shoal swarm down|status` read (None: none)
    # where node 0 listens (None: 127.0.0.1, this machine only); the others listen on the same interface, any port
    listen: str | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.nodes <= 64:
            raise ValueError("--nodes must be between 1 and 64")
        if self.listen is not None:
            parts = self.listen.strip("/").split("/")
            if len(parts) != 4 or parts[0] not in ("ip4", "ip6") or parts[2] != "tcp" or not parts[3].isdigit():
                raise ValueError(f"--listen {self.listen}: expected /ip4/ADDRESS/tcp/PORT (e.g. /ip4/0.0.0.0/tcp/4001)")


def process_start_time(pid: int) -> int | None:
    """The kernel's start time of process `pid` (Linux clock ticks since boot), to tell it from a later process
    that reuses the PID; None where /proc does not say (the PID alone is trusted then)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def same_process(pid: int, start_time: int | None) -> bool:
    """Whether `pid` still runs and is the process that was recorded (same start time)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    now = process_start_time(pid)
    if now is not None and _is_zombie(pid):
        return False
    return start_time is None or now is None or now == start_time


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False


class SignalGuard:
    """SIGINT, SIGTERM and SIGHUP become KeyboardInterrupt, except inside `critical()` (held until it ends) and
    once stopping has begun (noted in `repeated`, so a stop can hurry, but never interrupted)."""

    def __init__(self) -> None:
        self.depth = 0
        self.pending: int | None = None
        self.stopping = False
        self.repeated = 0

    def install(self) -> None:
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame) -> None:
        if self.stopping:
            self.repeated += 1
            return
        if self.depth:
            self.pending = signum
            return
        raise KeyboardInterrupt

    @contextlib.contextmanager
    def critical(self) -> Iterator[None]:
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1
            if not self.depth and self.pending is not None and not self.stopping:
                self.pending = None
                raise KeyboardInterrupt


@dataclass(slots=True)
class NodeProcess:
    index: int
    proc: subprocess.Popen
    status_file: Path
    log_file: Path  # the node's log (--log-file)
    out_file: Path | None = None  # what the node prints: start-up progress, status lines, its error line
    start_time: int | None = None
    started: float = field(default_factory=time.monotonic)

    def status(self) -> dict | None:
        try:
            return json.loads(self.status_file.read_text())
        except (OSError, ValueError):
            return None

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def exit_text(self) -> str:
        """'running', or how the process ended: 'exit 0', 'SIGKILL'."""
        return exit_text(self.proc.poll())


class LocalSwarm:
    def __init__(self, config: LocalSwarmConfig, guard: SignalGuard | None = None):
        self.config = config
        self.guard = guard or SignalGuard()  # installed by the command line; tests use it uninstalled
        self.nodes: list[NodeProcess] = []
        self.state = "starting"
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
        """Node 0 at `listen` (its port too), the others on its interface at any free port; 127.0.0.1 without it."""
        if self.config.listen is None:
            return "/ip4/127.0.0.1/tcp/0"
        if index == 0:
            return self.config.listen
        proto, host = self.config.listen.strip("/").split("/")[:2]
        return f"/{proto}/{host}/tcp/0"

    def start_node(self, index: int, join: list[str], *, address_file: Path | None = None,
                   join_wait_s: float | None = None) -> NodeProcess:
        wd = self.config.workdir
        status, logf, outf = wd / f"node{index}.json", wd / f"node{index}.log", wd / f"node{index}.out"
        status.unlink(missing_ok=True)
        cmd = [*self.launch_prefix(index), sys.executable, "-m", "shoal.node.cli", "node",
               "--listen", self.listen_addr(index),
               "--identity", str(wd / f"node{index}.key"), "--status-file", str(status), "--log-file", str(logf),
               "--metrics-file", str(wd / f"node{index}.metrics.jsonl"),  # each node's figures, in the swarm's folder
               "--device", self.config.device, "--status-interval", str(self.config.status_interval_s),
               "--gone-after", str(self.config.gone_after_s), "--parent", str(os.getpid()),
               *self.config.extra_node_args]
        if address_file is not None:
            cmd += ["--address-file", str(address_file)]
        if join_wait_s is not None:
            cmd += ["--join-wait", f"{join_wait_s:g}"]
        for a in join:
            cmd += ["--join", a]
        with self.guard.critical(), open(outf, "ab") as out:
            # a session of its own: Ctrl+C reaches only the supervisor, which stops the nodes by PID
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=self._env(), start_new_session=True)
            node = NodeProcess(index, proc, status, logf, outf, start_time=process_start_time(proc.pid))
            if index < len(self.nodes):
                self.nodes[index] = node
            else:
                self.nodes.append(node)
            self.write_swarm_file()
        return node

    def write_swarm_file(self) -> None:
        path = self.config.swarm_file
        if path is None:
            return
        doc = {"pid": os.getpid(), "start_time": process_start_time(os.getpid()), "state": self.state,
               "workdir": str(self.config.workdir), "bootstrap": self.bootstrap_addrs() if self.nodes else [],
               "nodes": [{"index": n.index, "pid": n.proc.pid, "start_time": n.start_time} for n in self.nodes]}
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(doc, indent=1))
        os.replace(tmp, path)

    def wait_ready(self, node: NodeProcess) -> dict:
        deadline = time.monotonic() + self.config.start_timeout_s
        while time.monotonic() < deadline:
            st = node.status()
            if st and st.get("state") not in (None, "starting") and st.get("addrs"):
                return st
            if not node.alive:
                raise RuntimeError(f"node {node.index} exited with {node.proc.returncode}:\n"
                                   + tail(node.out_file or node.log_file, 5) + f"\n(its log: {node.log_file})")
            time.sleep(0.1)
        raise TimeoutError(f"node {node.index} not ready after {self.config.start_timeout_s} s; log: {node.log_file}")

    def bootstrap_addrs(self) -> list[str]:
        st = self.nodes[0].status() if self.nodes else None
        return list(st["addrs"]) if st else []

    def start(self, progress: Callable[[str], None] = lambda text: None) -> None:
        progress("probing this machine's hardware (once for all nodes)…")
        self.warm_hardware_cache()
        n = self.config.nodes
        t0 = time.monotonic()
        # a small swarm's other nodes start with it and wait for the address it writes when it is up (--join
        # @FILE): their imports overlap its own instead of following them. A larger one's wait until it is up, as
        # before: 8 nodes starting at once on 2 cores had a starved standby declare the broker's lease lapsed
        # while the others still held it (a split run, tests/swarm/test_aqsgd_swarm.py, twice in one suite)
        together = n <= 2 * (os.cpu_count() or 1)
        progress("starting node 0 (the bootstrap and the run's broker)"
                 + (f" and nodes 1 to {n - 1}, which join it once it is up…" if n > 1 and together else "…"))
        address_file = self.config.workdir / "node0.addrs" if together else None
        if address_file is not None:
            address_file.unlink(missing_ok=True)
        first = self.start_node(0, [], address_file=address_file)
        if address_file is not None:
            for i in range(1, n):
                self.start_node(i, [f"@{address_file}"], join_wait_s=self.config.start_timeout_s)
        self.wait_ready(first)
        self.write_swarm_file()
        if address_file is None:
            join = self.bootstrap_addrs()
            for i in range(1, n):
                self.start_node(i, join)
        progress(f"node 0 is up after {time.monotonic() - t0:.1f} s" + (f"; nodes 1 to {n - 1} are joining it…"
                                                                       if n > 1 else ""))

    def peer_ids(self) -> dict[int, str]:
        out = {}
        for n in self.nodes:
            st = n.status()
            if st:
                out[n.index] = st["peer_id"]
        return out

    def seeing_all(self) -> int:
        """How many running nodes see every other running node."""
        running = [n for n in self.nodes if n.alive]
        ids = {n.index: (n.status() or {}).get("peer_id") for n in running}
        count = 0
        for n in running:
            seen = set((n.status() or {}).get("peers", []))
            others = {pid for i, pid in ids.items() if i != n.index}
            count += ids[n.index] is not None and None not in others and others <= seen
        return count

    def converged(self) -> bool:
        """Every running node sees every other running node."""
        running = [n for n in self.nodes if n.alive]
        return bool(running) and self.seeing_all() == len(running)

    def wait_converged(self, timeout_s: float, progress: Callable[[str], None] = lambda text: None) -> float:
        t0 = time.monotonic()
        last = None
        while time.monotonic() - t0 < timeout_s:
            if self.converged():
                self.state = "running"
                self.write_swarm_file()
                return time.monotonic() - t0
            for n in self.nodes:
                if not n.alive:
                    raise RuntimeError(f"node {n.index} exited with {n.proc.returncode}:\n"
                                       f"{tail(n.out_file or n.log_file, 5)}\n(its log: {n.log_file})")
            up = sum(1 for n in self.nodes if (n.status() or {}).get("state") not in (None, "starting"))
            now = (up, self.seeing_all())
            if now != last:
                progress(f"{now[0]}/{len(self.nodes)} nodes up, {now[1]}/{len(self.nodes)} see all the others…")
                last = now
            time.sleep(0.2)
        raise TimeoutError(f"the swarm did not converge within {timeout_s} s")

    def summary(self) -> list[dict]:
        rows = []
        for n in self.nodes:
            st = n.status() or {}
            row = {k: st.get(k) for k in RUN_FIELDS if k in st}
            row.update({"index": n.index, "peer_id": st.get("peer_id"), "pid": n.proc.pid,
                        "alive": n.alive, "state": st.get("state") if n.alive else "gone", "exit": n.exit_text(),
                        "role": st.get("role"), "peers_seen": len(st.get("peers", [])), "peers": st.get("peers", []),
                        "addrs": st.get("addrs", []), "log": str(n.log_file)})
            rows.append(row)
        return rows

    def stop(self, timeout_s: float = 15.0) -> dict[int, int | None]:
        """SIGTERM every node by PID (a clean leave), SIGKILL what is still running after the timeout (or at once
        when another stop signal arrives meanwhile). Signals cannot interrupt it."""
        self.guard.stopping = True
        self.state = "stopping"
        with contextlib.suppress(OSError):
            self.write_swarm_file()
        for n in self.nodes:
            if n.alive:
                n.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        codes: dict[int, int | None] = {}
        for n in self.nodes:
            while n.proc.poll() is None and time.monotonic() < deadline and not self.guard.repeated:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    n.proc.wait(timeout=0.1)
            if n.proc.poll() is None:
                n.proc.kill()
            codes[n.index] = n.proc.wait()
        return codes


def exit_text(code: int | None) -> str:
    """How a process ended, from its return code: 'running' (None), 'exit 0', 'SIGKILL'."""
    if code is None:
        return "running"
    if code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"
    return f"exit {code}"


def tail(path: Path, n: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def find_local_swarm(home: Path) -> list[str]:
    """Multiaddrs of a swarm started by `shoal swarm up` with this shoal home ([] if none is running)."""
    path = Path(home) / LOCAL_SWARM_FILE
    try:
        doc = json.loads(path.read_text())
        os.kill(int(doc["pid"]), 0)  # is the supervisor still alive?
        return [str(a) for a in doc["bootstrap"]]
    except (OSError, ValueError, KeyError, TypeError):
        return []
