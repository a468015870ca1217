"""A fixed --listen port belongs to one process. py-libp2p binds its TCP listeners with SO_REUSEPORT (for hole
punching), which lets a second process of the same user bind the same port and share its connections; so the port
is probed with a plain socket before the host binds it, and on Linux the listeners on it are counted after."""

from __future__ import annotations

import errno
import ipaddress
import logging
import os
import socket

import multiaddr

log = logging.getLogger(__name__)


class AddressInUse(OSError):
    """The --listen address is already in use by another process."""

    def __init__(self, listen: str, detail: str = ""):
        super().__init__(errno.EADDRINUSE, f"--listen {listen}: address already in use{detail}")

    def __str__(self) -> str:
        return self.strerror or ""


def tcp_endpoint(listen: str) -> tuple[int, str, int] | None:
    """(family, ip, port) of a /ip4|ip6/…/tcp/… multiaddr, None for anything else."""
    ma = multiaddr.Multiaddr(listen)
    protos = [p.name for p in ma.protocols()]
    if "tcp" not in protos:
        return None
    port = int(ma.value_for_protocol("tcp"))
    if "ip4" in protos:
        return socket.AF_INET, ma.value_for_protocol("ip4"), port
    if "ip6" in protos:
        return socket.AF_INET6, ma.value_for_protocol("ip6"), port
    return None


def check_free(listen: str) -> None:
    """Raise AddressInUse when another process listens on the fixed port of `listen` (port 0 is never taken)."""
    ep = tcp_endpoint(listen)
    if ep is None or ep[2] == 0:
        return
    family, ip, port = ep
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a connection in TIME_WAIT is no owner
        try:
            s.bind((ip, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise AddressInUse(listen, " (another process listens on that port)") from None
            raise


def _own_socket_inodes() -> set[str]:
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            out.add(target[8:-1])
    return out


def _listeners(family: int, ip: str, port: int) -> list[str]:
    """Inodes of the sockets listening on ip:port (or on the wildcard of the family), from /proc/net/tcp{,6}."""
    table = "/proc/net/tcp" if family == socket.AF_INET else "/proc/net/tcp6"
    want = ipaddress.ip_address(ip)
    inodes = []
    with open(table) as f:
        next(f)
        for line in f:
            cols = line.split()
            addr_hex, port_hex = cols[1].split(":")
            if cols[3] != "0A" or int(port_hex, 16) != port:  # 0A: LISTEN
                continue
            raw = bytes.fromhex(addr_hex)
            if family == socket.AF_INET:
                local = ipaddress.ip_address(raw[::-1])
            else:  # four little-endian 32-bit words
                local = ipaddress.ip_address(b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4)))
            if local == want or local.is_unspecified or want.is_unspecified:
                inodes.append(cols[9])
    return inodes


def check_sole_listener(listen: str) -> None:
    """After binding: raise AddressInUse when a socket of another process listens on the same fixed port (two
    processes that passed `check_free` at the same moment). Linux only; elsewhere `check_free` is the check."""
    ep = tcp_endpoint(listen)
    if ep is None or ep[2] == 0 or not os.path.exists("/proc/self/fd"):
        return
    try:
        others = set(_listeners(*ep)) - _own_socket_inodes()
    except (OSError, ValueError, IndexError) as e:
        log.debug("could not read the listening sockets: %s", e)
        return
    if others:
        raise AddressInUse(listen, " (another process listens on the same port)")
