"""Circuit relay v2: the relay service with shoal's limits, reservations, and dialing a peer through a relay.

The service is py-libp2p 0.8.1's `CircuitV2Protocol` with three shoal-side fixes (subclass, no patching):
- one HOP message per stream (the library loops reading more and logs an error for every clean close);
- each circuit cleans up only its own two streams (the library files circuits under the destination's peer id,
  so a second circuit to the same peer overwrote the first and the first one's end reset the second);
- the circuit's duration is a deadline on every read (the library checks it only when data arrives, so an idle
  circuit outlived it), and on top of the per-circuit byte cap each source peer has a byte budget per window,
  so opening circuit after circuit does not turn the relay into a bulk pipe;
- reservations: one per peer, held only while its connection lives (the library counted a peer gone since as
  holding its slot until the reservation's TTL), at most `max_reservations_per_source` per source address (an
  IPv4 address, an IPv6 /64) and `reservations_per_source_window` new ones per source per window; a peer asking
  past a limit (or banned) is refused and penalized, so identities made on one machine cannot take every slot.
Bytes over the cap are never forwarded: the circuit is reset before them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import multiaddr
import trio
from libp2p.connection_types import ConnectionType
from libp2p.network.connection.raw_connection import RawConnection
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import info_from_p2p_addr
from libp2p.relay.circuit_v2.pb.circuit_pb2 import HopMessage
from libp2p.relay.circuit_v2.pb.circuit_pb2 import PeerId as CircuitPeerId
from libp2p.relay.circuit_v2.protocol import PROTOCOL_ID as HOP_PROTOCOL
from libp2p.relay.circuit_v2.protocol import CircuitV2Protocol, _is_relayed_stream
from libp2p.relay.circuit_v2.protocol_buffer import StatusCode
from libp2p.relay.circuit_v2.resources import RelayLimits
from libp2p.relay.circuit_v2.utils import read_delimited_msg, write_delimited_msg
from libp2p.tools.constants import MAX_READ_LEN

from shoal.swarm.net.addresses import source_key

log = logging.getLogger(__name__)
RELAY_MODES = ("auto", "on", "off")


class RelayError(ConnectionError):
    """A reservation or a relayed dial was refused or failed."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RelayConfig:
    service: str = "auto"  # serve as a relay: "auto" (when this node is public), "on", "off"
    max_reservations: int = 32  # peers holding a reservation on this relay at once
    max_reservations_per_source: int = 4  # ... from one source address (an IPv4 address, an IPv6 /64)
    reservations_per_source_window: int = 8  # new reservations one source may make per window
    reservation_ttl_s: int = 900
    circuit_duration_s: int = 120  # one relayed connection lives at most this long ...
    circuit_bytes: int = 1 << 20  # ... and carries at most this many bytes, both directions together
    max_circuits_per_peer: int = 4  # concurrent circuits to one reserved peer
    peer_bytes_per_window: int = 4 << 20  # bytes one source peer may push through us per window, all circuits
    window_s: float = 60.0
    reservations_wanted: int = 2  # an unreachable node holds this many reservations
    timeout_s: float = 10.0  # one reservation or relayed dial

    def __post_init__(self) -> None:
        if self.service not in RELAY_MODES:
            raise ValueError(f"relay service must be one of {RELAY_MODES}, not {self.service!r}")
        if min(self.max_reservations, self.max_reservations_per_source, self.reservations_per_source_window,
               self.reservation_ttl_s, self.circuit_duration_s, self.circuit_bytes, self.max_circuits_per_peer,
               self.peer_bytes_per_window) < 1 or self.window_s <= 0:
            raise ValueError("relay limits must be positive")
        if not 0 <= self.reservations_wanted <= 4 or self.timeout_s <= 0:
            raise ValueError("reservations_wanted must be 0..4 and timeout_s positive")

    def limits(self) -> RelayLimits:
        return RelayLimits(duration=self.circuit_duration_s, data=self.circuit_bytes,
                           max_circuit_conns=self.max_circuits_per_peer, max_reservations=self.max_reservations,
                           reservation_ttl=self.reservation_ttl_s)


class RelayService(CircuitV2Protocol):
    """The STOP side for everyone (accept relayed connections); the HOP side (relay for others) while serving."""

    def __init__(self, host, config: RelayConfig, *, clock=time.monotonic):
        super().__init__(host, limits=config.limits(), allow_hop=False, read_timeout=int(config.timeout_s))
        self.config = config
        self.clock = clock
        self.serving = False
        self._window: dict[ID, list[float]] = {}  # source peer -> [window start, bytes in it]
        self.bytes_relayed = 0
        self.circuits_opened = 0
        self.circuits_cut = 0  # ended by a limit (bytes, duration, budget)
        self._cut: set[int] = set()
        self.reservations_refused = 0
        self._sources: dict[ID, str] = {}  # reserved peer -> its source address key
        self._new_by_source: dict[str, list[float]] = {}  # source -> when it made its recent new reservations
        # the node's penalty ledger (the node sets them): a peer asking past a limit is penalized; a banned one refused
        self.penalize: Callable[[str, str], object] | None = None
        self.banned: Callable[[str], bool] | None = None

    def serve(self, on: bool, set_handler) -> None:
        """Start or stop relaying for others; `set_handler` is SwarmHost.set_handler (guarded handlers)."""
        if on and not self.serving:
            set_handler(str(HOP_PROTOCOL), self._handle_hop_stream)
        elif not on and self.serving:
            self.host.remove_stream_handler(HOP_PROTOCOL)
        self.serving = on

    def _spent(self, peer: ID, n: int = 0) -> float:
        now = self.clock()
        w = self._window.get(peer)
        if w is None or now - w[0] >= self.config.window_s:
            if len(self._window) > 4096:
                self._window.clear()
            w = self._window[peer] = [now, 0.0]
        w[1] += n
        return w[1]

    async def _handle_hop_stream(self, stream) -> None:
        if _is_relayed_stream(stream):
            await self._send_status(stream, StatusCode.PERMISSION_DENIED, "no relaying over a relayed connection")
            await self._close_stream(stream)
            return
        try:
            with trio.fail_after(self.config.timeout_s):
                msg = await read_delimited_msg(stream, HopMessage)
        except (Exception, trio.TooSlowError) as e:  # noqa: BLE001 - a peer's garbage or silence
            log.info("relay: bad HOP request from %s: %s: %s", stream.muxed_conn.peer_id, type(e).__name__, e)
            await stream.reset()
            return
        if msg.type == HopMessage.RESERVE:
            msg.ClearField("peer")  # a reservation is for the peer that asks (0.8.1 would take any peer id given)
            why = self._reservation_refusal(stream.muxed_conn.peer_id, source_key(stream.muxed_conn))
            if why is not None:
                peer = stream.muxed_conn.peer_id
                self.reservations_refused += 1
                log.info("relay: reservation for %s refused: %s", peer, why)
                if self.penalize is not None:
                    self.penalize(peer.to_base58(), f"relay reservation: {why}")
                await self._send_status(stream, StatusCode.RESOURCE_LIMIT_EXCEEDED, why)
            else:
                await self._handle_reserve(stream, msg)
            await self._close_stream(stream)
        elif msg.type == HopMessage.CONNECT:
            source = stream.muxed_conn.peer_id
            if self._spent(source) >= self.config.peer_bytes_per_window:
                log.warning("relay: %s is over its byte budget; circuit refused", source)
                await self._send_status(stream, StatusCode.RESOURCE_LIMIT_EXCEEDED, "byte budget used up")
                await self._close_stream(stream)  # a close, not a reset: the status must reach the peer
                return
            self.circuits_opened += 1
            await self._handle_connect(stream, msg)
        else:
            await self._send_status(stream, StatusCode.MALFORMED_MESSAGE, "unexpected message type")
            await self._close_stream(stream)

    def _held(self) -> dict[ID, str]:
        """The reservations that count: live (not expired) and held by a connected peer, by peer -> source. A
        reservation whose peer went is dropped (the circuit v2 spec: a reservation lives with its connection)."""
        rm = self.resource_manager
        rm._clean_expired()
        for peer in [p for p in rm._reservations if not rm._is_peer_connected(p)]:
            del rm._reservations[peer]
        self._sources = {p: src for p, src in self._sources.items() if p in rm._reservations}
        return self._sources

    def reservations_held(self) -> int:
        return len(self._held())

    def _reservation_refusal(self, peer: ID, source: str) -> str | None:
        """Why `peer` (connected from `source`) gets no reservation now (None: it may reserve or refresh)."""
        if self.banned is not None and self.banned(peer.to_base58()):
            return "banned"
        held = self._held()
        if peer in self.resource_manager._reservations:
            return None  # a refresh of its own reservation
        cfg = self.config
        if sum(1 for src in held.values() if src == source) >= cfg.max_reservations_per_source:
            return f"{cfg.max_reservations_per_source} reservations are held from this source address"
        now = self.clock()
        recent = [t for t in self._new_by_source.get(source, ()) if now - t < cfg.window_s]
        if len(recent) >= cfg.reservations_per_source_window:
            self._new_by_source[source] = recent
            return f"{len(recent)} new reservations from this source address within {cfg.window_s:g} s"
        if len(self.resource_manager._reservations) >= cfg.max_reservations:
            return "every reservation slot is taken"
        self._new_by_source[source] = recent + [now]
        if len(self._new_by_source) > 4096:
            self._new_by_source = {k: v for k, v in self._new_by_source.items() if v and now - v[-1] < cfg.window_s}
        held[peer] = source
        return None

    async def _relay_data(self, src_stream, dst_stream, peer_id, deadline=None, circuit_data_limit=None) -> None:
        # the circuit's initiator pays: its stream is the inbound HOP stream, the other one is our STOP stream
        hop_side = src_stream if src_stream.get_protocol() == HOP_PROTOCOL else dst_stream
        source = hop_side.muxed_conn.peer_id
        cut = None
        try:
            while True:
                wait = None if deadline is None else deadline - time.monotonic()
                if wait is not None and wait <= 0:
                    cut = "duration"
                    break
                with trio.move_on_after(wait if wait is not None else float("inf")):
                    data = await src_stream.read(MAX_READ_LEN)
                    if not data:
                        break
                    if circuit_data_limit is not None:
                        if len(data) > circuit_data_limit[0]:
                            cut = "circuit bytes"
                            break
                        circuit_data_limit[0] -= len(data)
                    if self._spent(source, len(data)) > self.config.peer_bytes_per_window:
                        cut = "source byte budget"
                        break
                    with trio.fail_after(self.write_timeout):
                        await dst_stream.write(data)
                    self.bytes_relayed += len(data)
        except (Exception, trio.TooSlowError) as e:  # noqa: BLE001 - either side went away
            log.debug("relay circuit %s: %s: %s", source, type(e).__name__, e)
        finally:
            if cut is not None:
                if id(hop_side) not in self._cut:  # both directions may hit the limit: one circuit, one count
                    if len(self._cut) > 4096:
                        self._cut.clear()
                    self._cut.add(id(hop_side))
                    self.circuits_cut += 1
                    log.info("relay circuit from %s cut: %s limit", source, cut)
                for s in (src_stream, dst_stream):
                    try:
                        await s.reset()
                    except Exception:  # noqa: BLE001
                        pass
            else:
                for s in (src_stream, dst_stream):
                    await self._close_stream(s)
            for k, v in list(self._active_relays.items()):
                if src_stream in v or dst_stream in v:
                    del self._active_relays[k]


@dataclass(frozen=True, slots=True)
class Reservation:
    relay: str
    expires_at: float  # unix seconds
    relay_addrs: tuple[str, ...]  # the relay's addresses with its /p2p/ id; our circuit address builds on them

    def circuit_addrs(self, me: str) -> list[str]:
        return [f"{a}/p2p-circuit/p2p/{me}" for a in self.relay_addrs]


async def reserve(host, relay: str, timeout_s: float) -> Reservation:
    """Ask a connected relay for a reservation; its addresses come from the answer or the connection we use."""
    rid = ID.from_base58(relay)
    with trio.fail_after(timeout_s):
        stream = await host.new_stream(rid, [HOP_PROTOCOL])
        try:
            await write_delimited_msg(stream, HopMessage(type=HopMessage.RESERVE,
                                                         peer=CircuitPeerId(id=host.get_id().to_bytes())))
            resp = await read_delimited_msg(stream, HopMessage)
        finally:
            await _close(stream)
        remote = [str(a) for a in stream.muxed_conn.get_transport_addresses()]
    status = StatusCode(resp.status) if resp.HasField("status") else StatusCode.OK
    if status != StatusCode.OK or not resp.HasField("reservation"):
        raise RelayError(f"relay {relay[:16]}… refused the reservation: {status.name}")
    addrs = []
    for raw in list(resp.reservation.addrs)[:8]:
        try:
            a = str(multiaddr.Multiaddr(raw))
        except Exception:  # noqa: BLE001 - the relay's garbage is skipped
            continue
        if "/p2p-circuit" not in a:
            addrs.append(a if "/p2p/" in a else f"{a}/p2p/{relay}")
    for a in remote:  # where we reached it: proven dialable from here
        if "/p2p-circuit" not in a and "/ip4/0.0.0.0/" not in a:
            addrs.append(f"{a.split('/p2p/')[0]}/p2p/{relay}")
    addrs = [a for a in dict.fromkeys(addrs) if len(a) < 140]
    if not addrs:
        raise RelayError(f"relay {relay[:16]}… gave no address to advertise")
    expires = float(resp.reservation.expire) if resp.reservation.expire else time.time() + 60
    return Reservation(relay, min(expires, time.time() + 86400), tuple(addrs[:2]))


async def dial_via_relay(host, circuit_addr: str, timeout_s: float):
    """Open a relayed connection to the peer of `<relay addr>/p2p-circuit/p2p/<peer>`; returns the swarm conn."""
    relay_part, dest = circuit_addr.split("/p2p-circuit/p2p/", 1)
    dest_id = ID.from_base58(dest.split("/")[0])
    relay_info = info_from_p2p_addr(multiaddr.Multiaddr(relay_part))
    with trio.fail_after(timeout_s):
        await host.connect(relay_info)
        stream = await host.new_stream(relay_info.peer_id, [HOP_PROTOCOL])
        try:
            await write_delimited_msg(stream, HopMessage(type=HopMessage.CONNECT,
                                                         peer=CircuitPeerId(id=dest_id.to_bytes())))
            resp = await read_delimited_msg(stream, HopMessage)
            status = StatusCode(resp.status) if resp.HasField("status") else StatusCode.OK
            if status != StatusCode.OK:
                raise RelayError(f"relay {relay_info.peer_id} refused the circuit: {status.name}")
            ma = multiaddr.Multiaddr(f"/p2p/{relay_info.peer_id}/p2p-circuit/p2p/{dest_id}")
            raw = RawConnection(stream=stream, initiator=True, connection_type=ConnectionType.RELAYED,
                                addresses=[ma])
            return await host.upgrade_outbound_connection(raw, dest_id)
        except BaseException:
            try:
                await stream.reset()
            except Exception:  # noqa: BLE001
                pass
            raise


async def _close(stream) -> None:
    try:
        await stream.close()
    except Exception:  # noqa: BLE001
        try:
            await stream.reset()
        except Exception:  # noqa: BLE001
            pass
