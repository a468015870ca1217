"""This machine's IP addresses, their scope (loopback, private, public), wildcard listen addresses made dialable,
join addresses checked as typed, and where a peer's connection comes from."""

from __future__ import annotations

import fcntl
import ipaddress
import logging
import socket
import struct

log = logging.getLogger(__name__)
SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address
SCOPES = ("loopback", "link-local", "private", "shared", "public")
JOIN_FORM = "/ip4/IP/tcp/PORT/p2p/PEER_ID"


def scope(ip: str) -> str:
    """loopback | link-local | private (RFC 1918, ULA) | shared (CGNAT 100.64/10) | public."""
    a = ipaddress.ip_address(ip)
    if a.is_loopback:
        return "loopback"
    if a.is_link_local:
        return "link-local"
    if a.version == 4 and a in ipaddress.ip_network("100.64.0.0/10"):
        return "shared"  # carrier-grade NAT: reachable only inside the provider's network
    if a.is_private:
        return "private"
    return "public"


def default_route_interfaces(route_table: str = "/proc/net/route") -> list[str]:
    """Interfaces that carry a default route (Linux), best metric first: their address is the one others reach."""
    try:
        with open(route_table) as f:
            rows = [line.split() for line in f.readlines()[1:]]
        return [r[0] for r in sorted((r for r in rows if len(r) > 7 and r[1] == "00000000"), key=lambda r: int(r[6]))]
    except (OSError, ValueError):
        return []


def local_ipv4() -> list[str]:
    """Every IPv4 address of this machine's interfaces (loopback included): the default route's interface first (a
    bridge for containers or a VPN comes later), then by scope (private, shared, public), loopback last."""
    found: dict[str, str] = {}  # address -> interface
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        names = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for name in names:
            try:
                raw = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address on this interface (or not Linux)
                continue
            found.setdefault(socket.inet_ntoa(raw[20:24]), name)
    if not found:  # other systems: whatever the host name resolves to
        try:
            found.update((str(ai[4][0]), "") for ai in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET))
        except OSError as e:
            log.debug("no addresses from the host name: %s", e)
        found.setdefault("127.0.0.1", "lo")
    routed = default_route_interfaces()

    def rank(ip: str) -> tuple:
        iface = found[ip]
        return (scope(ip) == "loopback", routed.index(iface) if iface in routed else len(routed),
                ipaddress.ip_address(ip))

    return sorted(found, key=rank)


def expand_wildcard(addrs: list[str], local: list[str] | None = None, limit: int = 16) -> list[str]:
    """Multiaddrs with /ip4/0.0.0.0/ replaced by one per local IPv4 address (non-loopback first), at most `limit`.

    A wildcard listen address cannot be dialed; these are the ones that can."""
    local = local_ipv4() if local is None else local
    out: list[str] = []
    for a in addrs:
        if a.startswith("/ip4/0.0.0.0/"):
            rest = a[len("/ip4/0.0.0.0"):]
            out += [f"/ip4/{ip}{rest}" for ip in local]
        else:
            out.append(a)
    out.sort(key=lambda a: a.startswith("/ip4/127."))  # stable: keeps each group's order
    return list(dict.fromkeys(out))[:limit]


def check_join_address(addr: str) -> str:
    """`addr` if it is a multiaddr that names a peer id, else ValueError saying what is wrong, in words (never the
    multiaddr library's repr of a protocol)."""
    import multiaddr

    try:
        ma = multiaddr.Multiaddr(addr)
    except Exception as e:  # noqa: BLE001 - the multiaddr library raises several kinds
        why = str(e).split(" (string:")[0].split(": ", 1)[-1]
        raise ValueError(f"--join {addr}: not an address of the form {JOIN_FORM} ({why})") from None
    if "p2p" not in [p.name for p in ma.protocols()]:
        raise ValueError(f"--join {addr}: the address lacks the node's peer id (…/p2p/12D3KooW…)")
    return addr


def source_key(conn) -> str:
    """Where a connection comes from, as limits per source count it (identities are free, addresses are not): its
    IPv4 address, its IPv6 /64 (one host's allocation), "via <relay>" for a relayed one, "?" when the transport does
    not say."""
    try:
        addrs = [str(a) for a in conn.get_transport_addresses()]
    except Exception:  # noqa: BLE001
        addrs = []
    for a in addrs:
        parts = a.split("/")
        if "p2p-circuit" in parts and "p2p" in parts:
            return f"via {parts[parts.index('p2p') + 1]}"
        if len(parts) > 2 and parts[1] == "ip4":
            return parts[2]
        if len(parts) > 2 and parts[1] == "ip6":
            try:
                return str(ipaddress.ip_network(f"{parts[2]}/64", strict=False))
            except ValueError:
                continue
    return "?"


def peer_source(host, peer_id) -> str:
    """`source_key` of the first open connection of `host` (a libp2p host) to `peer_id` (a libp2p ID): "?" when
    there is none."""
    for conn in host.get_network().get_connections(peer_id):
        if not conn.is_closed:
            return source_key(conn)
    return "?"
