"""Is this node dialable? Address classes, the dial-back service (AutoNAT v1, fixed) and the verdict from peers.

A node asks peers it is connected to to dial it back (AutoNAT v1, `/libp2p/autonat/1.0.0`) at its candidate
addresses: its listen addresses and, for each IP a peer observed it at, that IP with its listen port (a NAT
that preserves ports, as Linux MASQUERADE does, maps the listen port to the same port outside). A dial-back that
reaches it on an address outside the private ranges makes it "public"; one that reaches it only on a private
address (a LAN, this machine) makes it "lan"; a definite failure from most servers makes it unreachable, and
the relay client then makes it "relayed".

py-libp2p 0.8.1's AutoNAT server dials back with `host.connect`, which returns at once when a connection to the
peer exists -- and the asking peer is always connected. It therefore answers OK without dialing, and a NATed
node that offers its NAT's address is told it is public. `DialBackService` dials a fresh connection instead
(`Swarm.dial_addr`), closes it, and rate-limits requests per peer.
"""

from __future__ import annotations

import ipaddress
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

import multiaddr
import trio
from libp2p.host.autonat.autonat import AUTONAT_PROTOCOL_ID, AutoNATService
from libp2p.host.autonat.pb.autonat_pb2 import Message
from libp2p.peer.id import ID

log = logging.getLogger(__name__)
PUBLIC, LAN, RELAYED, UNKNOWN = "public", "lan", "relayed", "unknown"  # protocol.records.REACHABILITY
DIALBACK_PROTOCOL = str(AUTONAT_PROTOCOL_ID)
_PRIVATE_NETS = tuple(ipaddress.ip_network(n) for n in (
    "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10", "127.0.0.0/8", "169.254.0.0/16",
    "0.0.0.0/8", "::1/128", "fc00::/7", "fe80::/10", "::/128"))


def is_private_ip(ip: str) -> bool:
    """RFC 1918, carrier-grade NAT, loopback, link-local, unspecified, IPv6 ULA: not dialable from the internet.

    (Explicit ranges, not `ipaddress.is_private`, which also counts documentation ranges such as the
    198.51.100.0/24 that the NAT tests use as their "internet".)"""
    try:
        a = ipaddress.ip_address(ip)
    except ValueError:
        return True
    return any(a in n for n in _PRIVATE_NETS)


def ip_port(addr: str) -> tuple[str, int] | None:
    """(ip, tcp port) of a TCP multiaddr, None for anything else (relayed addresses included)."""
    if "/p2p-circuit" in addr:
        return None
    try:
        ma = multiaddr.Multiaddr(addr)
        port = int(ma.value_for_protocol("tcp"))
    except Exception:  # noqa: BLE001 - not a TCP address
        return None
    for proto in ("ip4", "ip6"):
        try:
            return str(ma.value_for_protocol(proto)), port
        except Exception:  # noqa: BLE001
            continue
    return None


def candidate_addrs(listen: Iterable[str], observed_ips: Iterable[str]) -> list[str]:
    """Where others might dial us: concrete listen addresses, and each observed IP with each listen port."""
    out: list[str] = []
    ports = []
    for a in listen:
        ipp = ip_port(a)
        if ipp is None:
            continue
        ip, port = ipp
        ports.append((":" in ip, port))
        if ip not in ("0.0.0.0", "::"):
            out.append(f"/ip{6 if ':' in ip else 4}/{ip}/tcp/{port}")
    for ip in observed_ips:
        for v6, port in ports:
            if (":" in ip) == v6:
                out.append(f"/ip{6 if v6 else 4}/{ip}/tcp/{port}")
    return list(dict.fromkeys(out))


def classify(dialed_back: Iterable[str]) -> str:
    """The reachability that successful dial-backs at these addresses prove (UNKNOWN for none)."""
    ips = [ipp[0] for ipp in map(ip_port, dialed_back) if ipp]
    if any(not is_private_ip(ip) for ip in ips):
        return PUBLIC
    return LAN if ips else UNKNOWN


@dataclass(frozen=True, kw_only=True, slots=True)
class DialBackConfig:
    dial_timeout_s: float = 3.0  # one dial-back (a SYN and two retransmissions); a NAT that drops SYNs costs this
    per_peer_interval_s: float = 2.0  # a peer asking more often is refused
    max_concurrent: int = 4

    def __post_init__(self) -> None:
        if self.dial_timeout_s <= 0 or self.per_peer_interval_s < 0 or self.max_concurrent < 1:
            raise ValueError("dial-back limits must be positive")


class DialBackService(AutoNATService):
    """AutoNAT v1 with a real dial-back: a fresh connection to the asked address, closed again at once."""

    def __init__(self, host, config: DialBackConfig = DialBackConfig(), *, clock=time.monotonic):
        super().__init__(host, serve=False)
        self.config = config
        self.clock = clock
        self._last_ask: dict[ID, float] = {}
        self._slots = trio.Semaphore(config.max_concurrent)
        self.served = 0

    async def _handle_dial(self, message: Message, observed_ip: str | None, is_relayed: bool) -> Message:
        try:
            peer = ID(message.dial.peer.id)
        except Exception:  # noqa: BLE001 - a malformed peer id in untrusted input
            return _status(Message.E_BAD_REQUEST, "bad peer id")
        now = self.clock()
        if now - self._last_ask.get(peer, -1e18) < self.config.per_peer_interval_s:
            return _status(Message.E_DIAL_REFUSED, "asked too often")
        if len(self._last_ask) > 4096:
            self._last_ask.clear()
        self._last_ask[peer] = now
        if self._slots.value == 0:
            return _status(Message.E_DIAL_REFUSED, "busy")
        async with self._slots:
            self.served += 1
            return await super()._handle_dial(message, observed_ip, is_relayed)

    async def _try_dial(self, peer_id: ID, addrs: list[bytes]) -> bytes | None:
        network = self.host.get_network()
        for raw in addrs[:4]:
            try:
                ma = multiaddr.Multiaddr(raw)
            except Exception:  # noqa: BLE001
                continue
            if "/p2p-circuit" in str(ma) or ip_port(str(ma)) is None:
                continue
            conn = None
            try:
                with trio.fail_after(self.config.dial_timeout_s):
                    conn = await network.dial_addr(ma, peer_id)
                return bytes(raw)
            except (Exception, trio.TooSlowError) as e:  # noqa: BLE001 - unreachable is the answer, not an error
                log.debug("dial-back to %s at %s failed: %s", peer_id, ma, e)
            finally:
                if conn is not None:
                    with trio.move_on_after(2.0):
                        try:
                            await conn.close()
                        except Exception:  # noqa: BLE001
                            pass
        return None


def _status(code: Message.ResponseStatus.ValueType, text: str) -> Message:
    m = Message()
    m.type = Message.DIAL_RESPONSE
    m.dialResponse.status = code
    m.dialResponse.statusText = text
    return m


@dataclass(frozen=True, slots=True)
class Verdict:
    reachability: str  # PUBLIC, LAN, UNKNOWN, or "unreachable" (the relay client turns that into RELAYED)
    dialed_at: tuple[str, ...] = ()  # the addresses servers reached us at
    answers: int = 0  # servers that gave a definite answer (reached us, or tried and failed)


UNREACHABLE = "unreachable"


async def ask_dialback(service: DialBackService, servers: list[str], candidates: list[str],
                       timeout_s: float) -> Verdict:
    """Ask up to three `servers` at once to dial us at `candidates`; a majority of definite answers decides.

    A server that refuses (no candidate matches the IP it sees us at, or it is busy) or fails says nothing."""
    reached: list[str] = []
    failed = 0
    raw = [multiaddr.Multiaddr(a).to_bytes() for a in candidates]

    async def one(server: str) -> None:
        nonlocal failed
        try:
            status, addr = await service.query_server(ID.from_base58(server), raw, timeout=timeout_s)
        except (Exception, trio.TooSlowError) as e:  # noqa: BLE001 - a server's failure is no answer
            log.debug("dial-back request to %s failed: %s", server, e)
            return
        if status == Message.OK and addr:
            try:
                reached.append(str(multiaddr.Multiaddr(addr)).split("/p2p/")[0])
            except Exception:  # noqa: BLE001
                pass
        elif status == Message.E_DIAL_ERROR:
            failed += 1

    if raw:
        async with trio.open_nursery() as n:
            for s in servers[:3]:
                n.start_soon(one, s)
    answers = len(reached) + failed
    if reached and len(reached) >= failed:
        return Verdict(classify(reached), tuple(dict.fromkeys(reached)), answers)
    return Verdict(UNREACHABLE if failed else UNKNOWN, (), answers)
