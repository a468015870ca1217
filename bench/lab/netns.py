"""Network-namespace plumbing for the benchmarks: bounded `ip`/`tc` calls and sockets opened inside a namespace."""

from __future__ import annotations

import ctypes
import json
import logging
import os
import socket
import subprocess
import threading
from pathlib import Path

log = logging.getLogger(__name__)

CLONE_NEWNET = 0x40000000
NETNS_DIR = Path("/run/netns")
CMD_TIMEOUT_S = 10.0


class NetnsError(RuntimeError):
    """An `ip`/`tc` command failed, or namespaces cannot be made here (not root, no iproute2)."""


def run(*argv: str, timeout_s: float = CMD_TIMEOUT_S, check: bool = True) -> str:
    """Run one iproute2 command with a deadline; its stdout, or NetnsError with its stderr."""
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    except FileNotFoundError as e:
        raise NetnsError(f"{argv[0]} is not installed (apt-get install iproute2): {e}") from e
    except subprocess.TimeoutExpired as e:
        raise NetnsError(f"{' '.join(argv)} did not finish within {timeout_s} s") from e
    if check and r.returncode:
        raise NetnsError(f"{' '.join(argv)} failed ({r.returncode}): {r.stderr.strip()[:300]}")
    return r.stdout


def require_root() -> None:
    """Raise NetnsError saying why, unless this process can create network namespaces."""
    if os.geteuid() != 0:
        raise NetnsError("network namespaces need root (run as root, or in a container with CAP_NET_ADMIN)")
    run("ip", "-V")
    run("tc", "-V")


def list_namespaces() -> list[str]:
    out = run("ip", "-j", "netns", "list", check=False).strip()
    try:
        return [e["name"] for e in json.loads(out)] if out else []
    except (ValueError, KeyError, TypeError):
        return [line.split()[0] for line in out.splitlines() if line.strip()]


def pids_in(ns: str) -> list[int]:
    out = run("ip", "netns", "pids", ns, check=False)
    return [int(p) for p in out.split() if p.isdigit()]


def link_stats(ns: str) -> dict[str, dict[str, int]]:
    """ifname -> {tx_bytes, rx_bytes, tx_packets, rx_packets, tx_dropped} for every link in `ns` (one call)."""
    doc = json.loads(run("ip", "-n", ns, "-s", "-j", "link", "show") or "[]")
    out = {}
    for link in doc:
        s = link.get("stats64") or link.get("stats") or {}
        rx, tx = s.get("rx", {}), s.get("tx", {})
        out[link["ifname"]] = {"tx_bytes": tx.get("bytes", 0), "rx_bytes": rx.get("bytes", 0),
                               "tx_packets": tx.get("packets", 0), "rx_packets": rx.get("packets", 0),
                               "tx_dropped": tx.get("dropped", 0)}
    return out


_libc = None


def _setns(fd: int) -> None:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise NetnsError(f"setns failed: {os.strerror(err)}")


def socket_in(ns: str | None, family: int = socket.AF_INET, kind: int = socket.SOCK_STREAM) -> socket.socket:
    """A socket that lives in namespace `ns` (None: this process's own), made by a short-lived thread that entered it.

    A socket keeps the namespace it was created in, whichever thread uses it afterwards; the thread that entered
    the namespace ends right after, so no thread of this process stays in it."""
    if ns is None:
        return socket.socket(family, kind)
    box: list = []

    def make() -> None:
        try:
            fd = os.open(NETNS_DIR / ns, os.O_RDONLY)
            try:
                _setns(fd)
            finally:
                os.close(fd)
            box.append(socket.socket(family, kind))
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            box.append(e)

    t = threading.Thread(target=make, name=f"netns-{ns}", daemon=True)
    t.start()
    t.join(CMD_TIMEOUT_S)
    if not box:
        raise NetnsError(f"could not enter namespace {ns} within {CMD_TIMEOUT_S} s")
    if isinstance(box[0], BaseException):
        raise NetnsError(f"socket in namespace {ns}: {box[0]}") from box[0]
    return box[0]
