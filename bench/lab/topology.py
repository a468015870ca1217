"""N network namespaces on a bridge that lives in a switch namespace, each link shaped by tbf per direction.

    node i  [{p}n{i}: {p}n{i}e  10.x.y.(i+1)] ──veth── [{p}sw: {p}n{i}s ─ bridge {p}br  10.x.y.254]

A node's upload is shaped on its own veth end (egress toward the switch), its download on the switch's end
(egress toward the node), so rates are per node and per direction. `shape()` replaces every qdisc, so one
topology serves several segments of a run at different rates. Nothing is created in the root namespace; every
namespace, and every process left inside one, goes when the topology is closed: on leaving the `with` block,
on an exception, at interpreter exit (atexit), and on SIGTERM/SIGHUP once `install_signal_teardown()` ran.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import signal
import time
from dataclasses import dataclass

from shoal.bench import netns
from shoal.bench.netns import NetnsError, run

log = logging.getLogger(__name__)

IFNAME_MAX = 15
# Without this, the kernel hands tbf 64 KiB GSO bursts: the queue overflows in whole bursts and a download
# (shaped behind the bridge, where the sender sees only loss) crawls at a fraction of its rate.
FRAME_BYTES = 1514
MIN_RATE_MBIT, MAX_RATE_MBIT = 0.1, 100_000.0


@dataclass(frozen=True, kw_only=True, slots=True)
class LinkShape:
    """One node's home link: upload (node -> swarm) and download rates; None leaves that direction unshaped."""

    up_mbit: float | None = None
    down_mbit: float | None = None

    def __post_init__(self) -> None:
        for name in ("up_mbit", "down_mbit"):
            v = getattr(self, name)
            if v is not None and not MIN_RATE_MBIT <= v <= MAX_RATE_MBIT:
                raise ValueError(f"{name} must be within [{MIN_RATE_MBIT}, {MAX_RATE_MBIT}] Mbit/s, not {v}")

    @property
    def shaped(self) -> bool:
        return self.up_mbit is not None or self.down_mbit is not None


UNSHAPED = LinkShape()


@dataclass(frozen=True, kw_only=True, slots=True)
class TopologyConfig:
    prefix: str  # every namespace, veth and bridge name starts with it
    nodes: int
    subnet: str = "10.15.0"  # a /24 that exists only inside these namespaces
    queue_latency_ms: float = 100.0  # tbf queue: what a home router buffers before dropping
    min_burst_bytes: int = 32 * 1024
    burst_ms: float = 10.0  # tbf bucket: at least this long at the link rate

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[a-z][a-z0-9]{0,7}", self.prefix):
            raise ValueError("prefix: 1-8 lower-case letters and digits, starting with a letter")
        if not 1 <= self.nodes <= 250:
            raise ValueError("nodes must be within [1, 250]")
        if len(self.veth_name(self.nodes - 1, "e")) > IFNAME_MAX:
            raise ValueError(f"prefix {self.prefix!r} makes interface names longer than {IFNAME_MAX} characters")
        parts = self.subnet.split(".")
        if len(parts) != 3 or not all(p.isdigit() and 0 <= int(p) <= 255 for p in parts):
            raise ValueError(f"subnet must be the first three octets of an IPv4 /24, not {self.subnet!r}")
        if self.queue_latency_ms <= 0 or self.min_burst_bytes < 2048 or self.burst_ms <= 0:
            raise ValueError("queue_latency_ms and burst_ms must be positive, min_burst_bytes at least 2048")

    def veth_name(self, i: int, end: str) -> str:
        return f"{self.prefix}n{i}{end}"


class Topology:
    """`with Topology(config) as topo:` builds it; `topo.shape([...])`, `topo.exec_argv(i)`, `topo.counters()`."""

    def __init__(self, config: TopologyConfig):
        self.config = config
        self.switch = f"{config.prefix}sw"
        self.bridge = f"{config.prefix}br"
        self.node_ns = [f"{config.prefix}n{i}" for i in range(config.nodes)]
        self.shapes: list[LinkShape] = [UNSHAPED] * config.nodes
        self.created = False

    # -- addresses -----------------------------------------------------------------------------------------
    def ip(self, i: int) -> str:
        return f"{self.config.subnet}.{i + 1}"

    @property
    def switch_ip(self) -> str:
        return f"{self.config.subnet}.254"

    def exec_argv(self, i: int) -> list[str]:
        """Prefix a command with this to run it inside node i's namespace."""
        return ["ip", "netns", "exec", self.node_ns[i]]

    # -- life cycle ----------------------------------------------------------------------------------------
    def __enter__(self) -> Topology:
        self.create()
        return self

    def __exit__(self, *exc) -> None:
        self.destroy()

    def create(self) -> None:
        """The switch namespace, then this topology's wiring (`_wire`); anything half made is destroyed on failure."""
        netns.require_root()
        remove_leftovers(self.config.prefix)
        self._check()
        _LIVE[id(self)] = self
        self.created = True
        try:
            run("ip", "netns", "add", self.switch)
            run("ip", "-n", self.switch, "link", "set", "lo", "up")
            self._wire()
        except BaseException:
            self.destroy()
            raise

    def _check(self) -> None:
        """Refuse a configuration this topology cannot build (before anything is made)."""

    def _wire(self) -> None:
        """One bridge in the switch namespace and every node on it."""
        c, sw = self.config, self.switch
        run("ip", "-n", sw, "link", "add", self.bridge, "type", "bridge")
        run("ip", "-n", sw, "addr", "add", f"{self.switch_ip}/24", "dev", self.bridge)
        run("ip", "-n", sw, "link", "set", self.bridge, "up")
        for i in range(c.nodes):
            self._add_node(i, self.bridge)
        log.info("topology %s: %d namespaces on bridge %s in %s", c.prefix, c.nodes, self.bridge, sw)

    def _add_node(self, i: int, bridge: str) -> None:
        """Node i's namespace, its veth to `bridge` in the switch namespace, its address."""
        c, sw, ns = self.config, self.switch, self.node_ns[i]
        frames = ("gso_max_size", str(FRAME_BYTES))  # segments of one frame, as a real link carries them
        e, s = c.veth_name(i, "e"), c.veth_name(i, "s")
        run("ip", "netns", "add", ns)
        run("ip", "link", "add", e, "netns", ns, "type", "veth", "peer", "name", s, "netns", sw)
        run("ip", "-n", sw, "link", "set", s, *frames, "master", bridge, "up")
        run("ip", "-n", ns, "link", "set", e, *frames)
        run("ip", "-n", ns, "link", "set", "lo", "up")
        run("ip", "-n", ns, "addr", "add", f"{self.ip(i)}/24", "dev", e)
        run("ip", "-n", ns, "link", "set", e, "up")

    def destroy(self) -> None:
        """Stop whatever runs inside the namespaces (by PID), then delete them; safe to call twice."""
        _LIVE.pop(id(self), None)
        if not self.created:
            return
        self.created = False
        for ns in [*self.node_ns, self.switch]:
            _delete_namespace(ns)

    # -- shaping -------------------------------------------------------------------------------------------
    def _tbf(self, ns: str, dev: str, rate_mbit: float | None) -> None:
        if rate_mbit is None:
            run("tc", "-n", ns, "qdisc", "del", "dev", dev, "root", check=False)  # back to the veth's noqueue
            return
        c = self.config
        rate_bps = rate_mbit * 1e6 / 8
        burst = max(c.min_burst_bytes, int(rate_bps * c.burst_ms / 1000))
        run("tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{rate_mbit}mbit",
            "burst", str(burst), "latency", f"{c.queue_latency_ms}ms")

    def shape(self, shapes: list[LinkShape]) -> None:
        """Set every node's upload (on its own veth end) and download (on the switch's end)."""
        if len(shapes) != self.config.nodes:
            raise ValueError(f"{len(shapes)} link shapes for {self.config.nodes} nodes")
        for i, sh in enumerate(shapes):
            self._tbf(self.node_ns[i], self.config.veth_name(i, "e"), sh.up_mbit)
            self._tbf(self.switch, self.config.veth_name(i, "s"), sh.down_mbit)
        self.shapes = list(shapes)

    def qdiscs(self) -> list[str]:
        """What tc reports for every shaped end (for the result files)."""
        out = []
        for i, ns in enumerate(self.node_ns):
            out += [f"{ns}: {q}" for q in run("tc", "-n", ns, "qdisc", "show").splitlines() if "tbf" in q]
        out += [f"{self.switch}: {q}" for q in run("tc", "-n", self.switch, "qdisc", "show").splitlines() if "tbf" in q]
        return out

    # -- counters ------------------------------------------------------------------------------------------
    def counters(self) -> list[dict[str, int]]:
        """Per node: bytes (and packets) it put on its link (`tx_*`) and took off it (`rx_*`), Ethernet frames
        as the veth counts them; read on the switch's ends in one call (the switch's rx is the node's tx)."""
        stats = netns.link_stats(self.switch)
        out = []
        for i in range(self.config.nodes):
            s = stats.get(self.config.veth_name(i, "s"))
            if s is None:
                raise NetnsError(f"no veth for node {i} in {self.switch}")
            out.append({"tx_bytes": s["rx_bytes"], "rx_bytes": s["tx_bytes"], "tx_packets": s["rx_packets"],
                        "rx_packets": s["tx_packets"]})
        return out


def _delete_namespace(ns: str, timeout_s: float = 5.0) -> None:
    if ns not in netns.list_namespaces():
        return
    deadline = time.monotonic() + timeout_s
    while (pids := netns.pids_in(ns)) and time.monotonic() < deadline:
        for pid in pids:  # processes in a namespace this suite made are the suite's own
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)
    run("ip", "netns", "del", ns, check=False)
    if ns in netns.list_namespaces():
        log.warning("namespace %s is still there after delete", ns)


def remove_leftovers(prefix: str) -> list[str]:
    """Delete namespaces a killed earlier run of this prefix left behind (exactly {prefix}sw and {prefix}n<i>)."""
    pat = re.compile(rf"{re.escape(prefix)}(sw|n\d+)")
    stale = [ns for ns in netns.list_namespaces() if pat.fullmatch(ns)]
    for ns in stale:
        log.warning("removing namespace %s left by an earlier run", ns)
        _delete_namespace(ns)
    return stale


_LIVE: dict[int, Topology] = {}


def _teardown_all() -> None:
    for topo in list(_LIVE.values()):
        try:
            topo.destroy()
        except Exception as e:  # noqa: BLE001 - at exit: tear down the rest anyway
            log.warning("teardown of %s failed: %s", topo.config.prefix, e)


atexit.register(_teardown_all)


def install_signal_teardown() -> None:
    """Turn SIGTERM and SIGHUP into SystemExit, so `with` blocks (and atexit) tear the topology down.
    (SIGINT already raises KeyboardInterrupt.)"""

    def on_signal(signum, frame):
        raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_signal)
