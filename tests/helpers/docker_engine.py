"""A private Docker engine for tests: its own network namespace, data root, exec root, pid file and socket.

The daemon runs inside a network namespace this helper creates (`sh13dk…`), so every bridge, veth and (with
--iptables=false) every rule it would make stays there: the host's interfaces and firewall are untouched, and other
tests' namespaces are not disturbed. It is stopped by PID, then everything left under its root (containerd and its
shims, mounts) is found by path and removed; the namespace is deleted. Nothing here skips: a missing tool or an
engine that does not start raises with the reason.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

#: command -> the Debian package that provides it
TOOLS = {"dockerd": "docker.io", "docker-compose": "docker-compose", "debootstrap": "debootstrap",
         "nsenter": "util-linux", "ip": "iproute2"}
NETNS_PREFIX = "sh13dk"


POLICY_RC = Path("/usr/sbin/policy-rc.d")


def ensure_tools() -> None:
    """Install the engine, compose and debootstrap from Debian's packages when missing (CI machines start bare).

    docker.io's install script must not start a system-wide daemon (it would add host firewall rules): invoke-rc.d
    asks /usr/sbin/policy-rc.d, so when there is none, one that refuses every service start stands there for the
    install (this machine's image already has such a one)."""
    missing = sorted({pkg for cmd, pkg in TOOLS.items() if shutil.which(cmd) is None})
    if not missing:
        return
    if os.geteuid() != 0:
        raise RuntimeError(f"missing {missing} and not root to install them: apt-get install {' '.join(missing)}")
    placed = not POLICY_RC.exists()
    if placed:
        POLICY_RC.write_text("#!/bin/sh\n# placed by shoal's tests for one apt-get install: start no services\nexit 101\n")
        POLICY_RC.chmod(0o755)
    try:
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        for cmd in (["apt-get", "update", "-q"],
                    ["apt-get", "install", "-y", "-q", "--no-install-recommends", "-o", "DPkg::Lock::Timeout=300",
                     *missing]):
            r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
            if r.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr[-2000:]}")
    finally:
        if placed:
            POLICY_RC.unlink(missing_ok=True)
    still = sorted(cmd for cmd in TOOLS if shutil.which(cmd) is None)
    if still:
        raise RuntimeError(f"installed {missing} but {still} are still not on PATH")


class DockerEngine:
    """`with DockerEngine() as engine:` a running dockerd; `engine.env` points docker and docker-compose at it."""

    def __init__(self, *, data_root: Path | None = None, start_timeout_s: float = 90.0):
        """`data_root`: where images and layers live (default: under the engine's own temporary root, removed at
        stop); a kept one is a cache of images between runs, used by one engine at a time (see `cached_data_root`)."""
        self.start_timeout_s = start_timeout_s
        # short: the daemon's unix sockets live under it (108-byte limit)
        self.root = Path(tempfile.mkdtemp(prefix="sh13d-", dir="/tmp"))
        self.data_root = data_root or self.root / "data"
        self.netns = f"{NETNS_PREFIX}{os.getpid()}"
        self.sock = self.root / "docker.sock"
        self.log = self.root / "dockerd.log"
        self.proc: subprocess.Popen | None = None
        self.env = {**os.environ, "DOCKER_HOST": f"unix://{self.sock}", "DOCKER_BUILDKIT": "0"}

    def __enter__(self) -> DockerEngine:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        subprocess.run(["ip", "netns", "add", self.netns], check=True, capture_output=True)
        subprocess.run(["ip", "-n", self.netns, "link", "set", "lo", "up"], check=True, capture_output=True)
        cmd = ["nsenter", f"--net=/run/netns/{self.netns}", "dockerd",
               "--data-root", str(self.data_root), "--exec-root", str(self.root / "exec"),
               "--pidfile", str(self.root / "dockerd.pid"), "-H", f"unix://{self.sock}",
               "--iptables=false", "--ip6tables=false", "--bridge=none"]
        with open(self.log, "wb") as out:  # nsenter execs dockerd: this PID is the daemon's
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"dockerd exited with {self.proc.returncode}:\n{self.log_tail()}")
            r = subprocess.run(["docker", "version", "--format", "{{.Server.Version}}"], env=self.env,
                               capture_output=True, text=True)
            if r.returncode == 0:
                self.forget_all_but_images()
                return
            time.sleep(0.5)
        raise RuntimeError(f"dockerd did not answer on {self.sock} within {self.start_timeout_s} s:\n{self.log_tail()}")

    def forget_all_but_images(self) -> None:
        """Containers, volumes and networks a killed earlier run left in a kept data root go; images stay."""
        for kind in ("container", "volume", "network"):
            self.docker(kind, "prune", "-f", timeout_s=120)

    def docker(self, *args: str, timeout_s: float = 120.0, check: bool = True) -> subprocess.CompletedProcess:
        r = subprocess.run(["docker", *args], env=self.env, capture_output=True, text=True, timeout=timeout_s)
        if check and r.returncode != 0:
            raise RuntimeError(f"docker {' '.join(args)} failed ({r.returncode}): {r.stderr[-2000:]}")
        return r

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def leftover_pids(self) -> list[int]:
        """Processes whose command line names this engine's roots (containerd, shims) and are not the daemon."""
        roots = (str(self.root).encode(), str(self.data_root).encode())
        out = []
        for d in Path("/proc").iterdir():
            if not d.name.isdigit() or (self.proc is not None and int(d.name) == self.proc.pid):
                continue
            try:
                cmdline = (d / "cmdline").read_bytes()
                if any(r in cmdline for r in roots):
                    out.append(int(d.name))
            except OSError:
                continue
        return out

    def mounts(self) -> list[str]:
        roots = (str(self.root), str(self.data_root))
        with open("/proc/self/mounts") as f:
            return [line.split()[1] for line in f if line.split()[1].startswith(roots)]

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM the daemon by PID (it stops its containers and its containerd), SIGKILL after the timeout; then
        the same for anything still running from its root, unmount what is left, delete the namespace and root."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for pid in self.leftover_pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for m in sorted(self.mounts(), key=len, reverse=True):
            subprocess.run(["umount", "-l", m], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.netns], capture_output=True)
        shutil.rmtree(self.root, ignore_errors=True)

    def leftovers(self) -> dict[str, object]:
        """What of this engine is still there after stop (all empty when it cleaned up)."""
        return {"daemon_running": self.proc is not None and self.proc.poll() is None, "pids": self.leftover_pids(),
                "mounts": self.mounts(), "netns": self.netns_exists(), "root": self.root.exists()}

    def netns_exists(self) -> bool:
        return Path("/run/netns", self.netns).exists()


@contextlib.contextmanager
def cached_data_root(cache: Path, max_bytes: int = 8 * 10**9):
    """A data root kept between runs under `cache` (images survive, so a rebuild reuses its layers), held with an
    exclusive lock and started afresh once it outgrows `max_bytes`; None (use a temporary one) while another run
    holds it."""
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / "engine.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield None
            return
        root = cache / "engine-data"
        try:
            if root.exists():
                du = subprocess.run(["du", "-sxb", str(root)], capture_output=True, text=True)
                if du.returncode != 0 or int(du.stdout.split()[0]) > max_bytes:
                    shutil.rmtree(root, ignore_errors=True)
            yield root
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
