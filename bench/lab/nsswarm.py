"""A local swarm whose nodes each run in their own network namespace, and what the benchmark samples from it.

Samples: every node's status file (step, losses, synchronizer bytes), the veth counters of every link, and the
CPU time of every node process split by thread (the event loop, trio's worker threads, other threads).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from shoal.node.localswarm import LocalSwarm, LocalSwarmConfig
from shoal.bench.topology import Topology

CLK_TCK = os.sysconf("SC_CLK_TCK")


class NamespaceSwarm(LocalSwarm):
    """Node i runs under `ip netns exec` in the topology's namespace i and listens on its address there."""

    def __init__(self, config: LocalSwarmConfig, topo: Topology):
        if config.nodes > topo.config.nodes:
            raise ValueError(f"{config.nodes} nodes for a topology of {topo.config.nodes}")
        super().__init__(config)
        self.topo = topo

    def launch_prefix(self, index: int) -> list[str]:
        return self.topo.exec_argv(index)

    def listen_addr(self, index: int) -> str:
        return f"/ip4/{self.topo.ip(index)}/tcp/0"


def thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds of a process by thread kind: "loop" (the main thread: trio, libp2p, crypto, framing),
    "worker" (trio's worker threads: the trainer's steps), "other" (pools such as a synchronizer's background
    round), "children" (child processes). Threads that ended are not listed by /proc; their time is in "total"
    only."""
    out = {"loop": 0.0, "worker": 0.0, "other": 0.0, "children": 0.0, "total": 0.0}
    try:
        with open(f"/proc/{pid}/stat") as f:
            out["total"] = _cpu_fields(f.read())[1]
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                comm, cpu = _cpu_fields(f.read())
            # trio names its worker threads after the job in flight ("step from ...") or "Trio thread N"
            kind = "loop" if int(tid) == pid else "worker" if comm.startswith("Trio") or " from " in comm else "other"
            out[kind] += cpu
        out["children"] = sum(_tree_total(c) for c in _children(pid))  # e.g. hivemind's p2pd daemon
        out["total"] += out["children"]
    except (OSError, ValueError):
        pass  # the process ended meanwhile
    return out


def _children(pid: int) -> list[int]:
    kids = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/children") as f:
            kids += [int(c) for c in f.read().split()]
    return kids


def _tree_total(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as f:
            own = _cpu_fields(f.read())[1]
        return own + sum(_tree_total(c) for c in _children(pid))
    except (OSError, ValueError):
        return 0.0


def _cpu_fields(stat: str) -> tuple[str, float]:
    comm = stat[stat.index("(") + 1 : stat.rindex(")")]
    rest = stat[stat.rindex(")") + 2 :].split()
    return comm, (int(rest[11]) + int(rest[12])) / CLK_TCK  # utime, stime (fields 14, 15)


@dataclass(slots=True)
class Sample:
    """One look at the whole swarm."""

    time: float  # unix seconds
    status: list[dict]  # per node: its status file (empty when not there yet)
    links: list[dict[str, int]]  # per node: veth tx/rx bytes and packets
    cpu: list[dict[str, float]]  # per node: CPU seconds by thread kind


def sample(swarm: NamespaceSwarm) -> Sample:
    return Sample(time=time.time(), status=[n.status() or {} for n in swarm.nodes], links=swarm.topo.counters(),
                  cpu=[thread_cpu_s(n.proc.pid) for n in swarm.nodes])


@dataclass(slots=True)
class StepClock:
    """Each node's (status time, step) points, to place a step in time (status files lag by up to one interval)."""

    points: list[list[tuple[float, int]]] = field(default_factory=list)

    def add(self, s: Sample) -> None:
        while len(self.points) < len(s.status):
            self.points.append([])
        for pts, st in zip(self.points, s.status):
            t, step = st.get("time"), st.get("step")
            if t is not None and step is not None and (not pts or t > pts[-1][0]):
                pts.append((float(t), int(step)))

    def step_at(self, node: int, t: float) -> float:
        """Node's step at unix time t, linear between its reports (clamped at the ends)."""
        pts = self.points[node]
        if not pts:
            return 0.0
        if t <= pts[0][0]:
            return float(pts[0][1])
        for (t0, s0), (t1, s1) in zip(pts, pts[1:]):
            if t0 <= t <= t1:
                return s0 + (s1 - s0) * (t - t0) / (t1 - t0)
        return float(pts[-1][1])

    def time_at(self, node: int, step: int) -> float | None:
        """When node reached `step` (linear between its reports), or None if it has not."""
        pts = self.points[node]
        for (t0, s0), (t1, s1) in zip(pts, pts[1:]):
            if s0 < step <= s1:
                return t0 + (t1 - t0) * (step - s0) / (s1 - s0)
        if pts and pts[0][1] >= step:
            return pts[0][0]
        return None


def workdir_for(base: Path, name: str) -> Path:
    d = base / name
    d.mkdir(parents=True, exist_ok=True)
    return d
