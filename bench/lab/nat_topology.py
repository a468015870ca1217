"""A NAT test network in Linux network namespaces: a public segment and home networks behind MASQUERADE routers.

Layout (every name starts with the configured prefix and a per-process token, so runs never collide):

    <tag>-pub        the "internet": bridge br0, no addresses of its own
    <tag>-pubN       public host N: eth0 198.51.100.(10+N)/24 on br0
    <tag>-natH       home H's router: wan 198.51.100.(100+H)/24 on br0, bridge lan 10.(H+1).0.1/24,
                     ip_forward, iptables MASQUERADE out of wan; with `firewall` on (a home router's
                     default) unsolicited packets from wan are dropped instead of answered with a reset
    <tag>-hHK        host K of home H: eth0 10.(H+1).0.(10+K)/24 on the router's lan, default route via it

Every veth is created directly inside its namespaces, and both bridges live inside namespaces, so nothing
touches the root namespace. The public segment uses TEST-NET-2 (198.51.100.0/24), which is never routed
on the internet: traffic cannot leave the namespaces. Needs root (`ip netns`, `iptables`); anything that
fails raises `TopologyError` with the command and its output. `close()` kills the processes started with
`popen` (by PID) and deletes the namespaces, and with them every veth, bridge, route and rule.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from shoal.node.localswarm import NodeProcess, tail

log = logging.getLogger(__name__)
PUBLIC_NET = "198.51.100"
IPTABLES_HINT = "apt-get install -y iptables"


class TopologyError(RuntimeError):
    """A namespace, link, address or rule could not be made."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TopologyConfig:
    prefix: str = "sh14"
    public_hosts: int = 1
    homes: tuple[int, ...] = (1, 1)  # hosts per home network
    firewall: bool = True  # NAT routers drop unsolicited inbound packets (else the kernel answers with RST)

    def __post_init__(self) -> None:
        if not self.prefix.isalnum() or len(self.prefix) > 6:
            raise ValueError("prefix must be alphanumeric, at most 6 characters")
        if not 0 <= self.public_hosts <= 80 or not 0 <= len(self.homes) <= 9:
            raise ValueError("at most 80 public hosts and 9 homes")
        if any(not 1 <= k <= 50 for k in self.homes):
            raise ValueError("each home has 1..50 hosts")


def run_cmd(*argv: str, check: bool = True, timeout_s: float = 20.0) -> subprocess.CompletedProcess:
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise TopologyError(f"{' '.join(argv)}: {e}") from e
    if check and p.returncode != 0:
        raise TopologyError(f"{' '.join(argv)} exited {p.returncode}: {(p.stderr or p.stdout).strip()}")
    return p


def wait_status(node: NodeProcess, pred, timeout_s: float, what: str) -> dict:
    """Poll a node's status file until `pred(status)`; raise with the node's log tail when it does not come."""
    deadline = time.monotonic() + timeout_s
    st = None
    while time.monotonic() < deadline:
        st = node.status()
        if st is not None and pred(st):
            return st
        if not node.alive:
            break
        time.sleep(0.1)
    raise TimeoutError(f"{what}: not within {timeout_s} s (alive={node.alive}); status {st}\n{tail(node.log_file, 40)}")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale(prefix: str) -> list[str]:
    """Delete namespaces `<prefix>-<pid>-…` whose creating process is gone (a run that was killed)."""
    out = run_cmd("ip", "netns", "list", check=False).stdout
    removed = []
    for line in out.splitlines():
        name = line.split()[0] if line.split() else ""
        parts = name.split("-")
        if len(parts) >= 3 and parts[0] == prefix and parts[1].isdigit() and not _pid_alive(int(parts[1])):
            run_cmd("ip", "netns", "del", name, check=False)
            removed.append(name)
    return removed


@dataclass(slots=True)
class Topology:
    """A built NAT topology; use as a context manager (build on enter, tear down on exit, also on failure)."""

    config: TopologyConfig
    tag: str = ""
    namespaces: list[str] = field(default_factory=list)
    procs: list[subprocess.Popen] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.tag:
            self.tag = f"{self.config.prefix}-{os.getpid()}-{os.urandom(2).hex()}"

    # -- names and addresses ---------------------------------------------------------------------------------
    def pub_ns(self, n: int) -> str:
        return f"{self.tag}-pub{n}"

    def pub_ip(self, n: int) -> str:
        return f"{PUBLIC_NET}.{10 + n}"

    def nat_ns(self, h: int) -> str:
        return f"{self.tag}-nat{h}"

    def nat_wan_ip(self, h: int) -> str:
        return f"{PUBLIC_NET}.{100 + h}"

    def home_ns(self, h: int, k: int = 0) -> str:
        return f"{self.tag}-h{h}{k}"

    def home_ip(self, h: int, k: int = 0) -> str:
        return f"10.{h + 1}.0.{10 + k}"

    # -- building ----------------------------------------------------------------------------------------------
    def _ns(self, name: str) -> str:
        run_cmd("ip", "netns", "add", name)
        self.namespaces.append(name)
        self.sh(name, "ip", "link", "set", "lo", "up")
        return name

    def sh(self, ns: str, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
        return run_cmd("ip", "netns", "exec", ns, *argv, check=check)

    def _veth(self, ns_a: str, name_a: str, ns_b: str, name_b: str) -> None:
        run_cmd("ip", "link", "add", name_a, "netns", ns_a, "type", "veth", "peer", "name", name_b, "netns", ns_b)
        self.sh(ns_a, "ip", "link", "set", name_a, "up")
        self.sh(ns_b, "ip", "link", "set", name_b, "up")

    def build(self) -> Topology:
        if os.geteuid() != 0:
            raise TopologyError("network namespaces need root (run the NAT tests as root, as CI does)")
        for tool in ("ip", "iptables"):
            if shutil.which(tool) is None:
                raise TopologyError(f"{tool} not found" + (f" ({IPTABLES_HINT})" if tool == "iptables" else ""))
        remove_stale(self.config.prefix)
        try:
            pub = self._ns(f"{self.tag}-pub")
            self.sh(pub, "ip", "link", "add", "br0", "type", "bridge")
            self.sh(pub, "ip", "link", "set", "br0", "up")
            for n in range(self.config.public_hosts):
                ns = self._ns(self.pub_ns(n))
                self._veth(ns, "eth0", pub, f"p{n}")
                self.sh(pub, "ip", "link", "set", f"p{n}", "master", "br0")
                self.sh(ns, "ip", "addr", "add", f"{self.pub_ip(n)}/24", "dev", "eth0")
            for h, hosts in enumerate(self.config.homes):
                self._router(h, hosts, pub)
        except BaseException:
            self.close()
            raise
        log.info("NAT topology %s: %d public hosts, homes %s", self.tag, self.config.public_hosts,
                 self.config.homes)
        return self

    def _router(self, h: int, hosts: int, pub: str) -> None:
        r = self._ns(self.nat_ns(h))
        self._veth(r, "wan", pub, f"n{h}")
        self.sh(pub, "ip", "link", "set", f"n{h}", "master", "br0")
        self.sh(r, "ip", "addr", "add", f"{self.nat_wan_ip(h)}/24", "dev", "wan")
        self.sh(r, "ip", "link", "add", "lan", "type", "bridge")
        self.sh(r, "ip", "link", "set", "lan", "up")
        self.sh(r, "ip", "addr", "add", f"10.{h + 1}.0.1/24", "dev", "lan")
        self.sh(r, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1")
        ipt = ("iptables", "-w", "5")
        self.sh(r, *ipt, "-t", "nat", "-A", "POSTROUTING", "-o", "wan", "-j", "MASQUERADE")
        if self.config.firewall:
            for chain in ("INPUT", "FORWARD"):
                self.sh(r, *ipt, "-A", chain, "-i", "wan", "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED",
                        "-j", "ACCEPT")
                self.sh(r, *ipt, "-A", chain, "-i", "wan", "-j", "DROP")
        for k in range(hosts):
            ns = self._ns(self.home_ns(h, k))
            self._veth(ns, "eth0", r, f"l{k}")
            self.sh(r, "ip", "link", "set", f"l{k}", "master", "lan")
            self.sh(ns, "ip", "addr", "add", f"{self.home_ip(h, k)}/24", "dev", "eth0")
            self.sh(ns, "ip", "route", "add", "default", "via", f"10.{h + 1}.0.1")

    # -- processes -------------------------------------------------------------------------------------------
    def popen(self, ns: str, argv: list[str], **kw) -> subprocess.Popen:
        """Start a process inside namespace `ns`; `close()` kills it by PID if it is still running."""
        p = subprocess.Popen(["ip", "netns", "exec", ns, *argv], **kw)
        self.procs.append(p)
        return p

    def start_node(self, ns: str, ip: str, workdir: Path, name: str, join: list[str] = (),
                   extra: tuple[str, ...] = (), home: Path | None = None, port: int = 4001) -> NodeProcess:
        """`shoal node` inside namespace `ns`, listening on `ip`:`port`, status and log in `workdir`."""
        status, logf = workdir / f"{name}.json", workdir / f"{name}.log"
        status.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "shoal.node.cli", "-v", "node", "--listen", f"/ip4/{ip}/tcp/{port}",
               "--identity", str(workdir / f"{name}.key"), "--status-file", str(status), "--device", "cpu",
               "--status-interval", "0.5", "--gone-after", "6", *extra]
        for a in join:
            cmd += ["--join", a]
        env = dict(os.environ, PYTHONUNBUFFERED="1", SHOAL_HOME=str(home or workdir / "home"))
        with open(logf, "ab") as out:
            proc = self.popen(ns, cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
        return NodeProcess(len(self.procs), proc, status, logf)

    def run_tool(self, ns: str, argv: list[str], timeout_s: float) -> dict:
        """Run a `python -m ...` tool inside `ns` that prints one JSON object last; its stderr is kept on failure."""
        p = self.popen(ns, [sys.executable, "-m", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            out, err = p.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
            raise TopologyError(f"{argv[0]} timed out after {timeout_s} s:\n{err[-3000:]}")
        lines = [x for x in out.splitlines() if x.startswith("{")]
        if not lines:
            raise TopologyError(f"{argv[0]} printed no result (exit {p.returncode}):\n{err[-3000:]}")
        doc = json.loads(lines[-1])
        doc["_stderr"] = err[-3000:]
        return doc

    def conntrack(self, h: int) -> str:
        """The router's conntrack table (for diagnostics), from /proc."""
        return self.sh(self.nat_ns(h), "cat", "/proc/net/nf_conntrack", check=False).stdout

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                log.warning("process %d did not exit", p.pid)
        self.procs.clear()
        for ns in reversed(self.namespaces):
            for attempt in range(3):
                if run_cmd("ip", "netns", "del", ns, check=False).returncode == 0:
                    break
                time.sleep(0.2 * (attempt + 1))
            else:
                log.warning("could not delete namespace %s", ns)
        self.namespaces.clear()

    def __enter__(self) -> Topology:
        return self.build()

    def __exit__(self, *exc) -> None:
        self.close()
