"""The libp2p host, built explicitly: persisted Ed25519 identity, TCP, Noise only, yamux only, Kademlia, GossipSub."""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import multiaddr
import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from libp2p import new_host
from libp2p.abc import INotifee
from libp2p.crypto.x25519 import create_new_key_pair as create_x25519_key_pair
from libp2p.custom_types import TProtocol
from libp2p.kad_dht.kad_dht import DHTMode, KadDHT
from libp2p.network.exceptions import SwarmException
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import info_from_p2p_addr
from libp2p.pubsub.gossipsub import PROTOCOL_ID_V11, GossipSub
from libp2p.pubsub.pubsub import Pubsub
from libp2p.security.noise.io import NoiseTransportReadWriter
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport
from libp2p.stream_muxer.yamux.yamux import PROTOCOL_ID as YAMUX_PROTOCOL_ID
from libp2p.stream_muxer.yamux.yamux import Yamux
from libp2p.tools.anyio_service import background_trio_service

from shoal.swarm.net.addresses import expand_wildcard
from shoal.swarm.net.identity import libp2p_key_pair, peer_id_of
from shoal.swarm.net.linkmeter import LinkMeter
from shoal.swarm.net.listen import AddressInUse, check_free, check_sole_listener

if TYPE_CHECKING:
    from shoal.swarm.net.nat import NatConfig, NatTraversal

log = logging.getLogger(__name__)


class _Pubsub(Pubsub):
    """py-libp2p's pubsub with an idempotent teardown of a blacklisted peer: its own teardown awaits the stream's
    reset and then deletes the peer, which raises KeyError (and takes the whole host down) when the peer's
    connection closed meanwhile and pubsub already removed it. A banned peer must not be able to crash a node."""

    async def _teardown_if_connected(self, peer_id) -> None:
        stream = self.peers.get(peer_id)
        if stream is not None:
            try:
                await stream.reset()
            except Exception:  # noqa: BLE001 - a stream already gone is what we wanted
                pass
            self.peers.pop(peer_id, None)
        self._forget_all_subscriptions(peer_id)


# py-libp2p's yamux by default also releases receive credit on reads its go-yamux-like rule would defer: a
# WINDOW_UPDATE frame (a packet, and an acknowledgement back) on nearly every read. Off, it sends about a third as
# many (measured: bench/results/network/overhead.md). The library reads this knob from the environment only.
os.environ.setdefault("PY_YAMUX_RELEASE_ON_READ", "0")

STALE_CONNECTION_RETRIES, STALE_CONNECTION_WAIT_S = 5, 0.1  # a closed connection leaves the list within moments
RELEASE_TIMEOUT_S = 2.0  # closing the sockets at exit
GOSSIP_MESSAGES_PER_PEER_S = 1000.0  # gossip messages one peer may forward a second (py-libp2p's default: 10)

# A Noise message, once encrypted, must reach the socket whole: py-libp2p encrypts (spending the next nonce) and
# then sends, and a writer whose deadline passed while it waited its turn for the connection (busy with bulk state
# or shard transfers) was cancelled at the send's first checkpoint; its peer then failed to decrypt everything after,
# and the connection, with every stream on it (lanes, RPCs), died without a word. Writes are finished here, shielded,
# and bounded: a peer that stops reading for WHOLE_WRITE_S has its connection closed (it is broken either way).
WHOLE_WRITE_S = 20.0
CLOSES_KEPT = 4096  # peers whose last connection closed, remembered (the newest)
# a peer whose last connection closed and is not back this long after has departed (a replaced connection, a
# reconnect come back sooner): the collective stops waiting for it, the broker pings it
RECONNECT_GRACE_S = 0.5


class ConnectionBroken(ConnectionError):
    """A message could not be sent whole within WHOLE_WRITE_S: the connection is closed."""


_noise_write = NoiseTransportReadWriter.write_msg


async def _whole_noise_write(self: NoiseTransportReadWriter, msg: bytes, prefix_encoded: bool = False) -> None:
    await trio.lowlevel.checkpoint_if_cancelled()  # a writer cancelled before its turn leaves with nothing spent
    with trio.CancelScope(shield=True):
        with trio.move_on_after(WHOLE_WRITE_S) as bound:
            await _noise_write(self, msg, prefix_encoded)
        if bound.cancelled_caught:
            with trio.move_on_after(RELEASE_TIMEOUT_S):
                await self.close()
    if bound.cancelled_caught:
        raise ConnectionBroken(f"a message was not sent within {WHOLE_WRITE_S} s: connection closed")


NoiseTransportReadWriter.write_msg = _whole_noise_write


class JoinError(ConnectionError):
    """None of the --join addresses could be reached."""


@dataclass(frozen=True, kw_only=True, slots=True)
class HostConfig:
    listen: str = "/ip4/127.0.0.1/tcp/0"
    join: tuple[str, ...] = ()
    connect_timeout_s: float = 10.0
    refresh_timeout_s: float = 3.0  # the routing-table refresh after joining; best effort (the DHT refreshes later)
    gossip_heartbeat_s: int = 1  # GossipSub mesh maintenance; the library default (120 s) leaves meshes unformed
    dht_mode_server: bool = True  # observers run the DHT as clients
    nat: NatConfig | None = None  # reachability, relays, hole punching (None: a plain host, as in most tests)

    def __post_init__(self) -> None:
        for a in (self.listen, *self.join):
            try:
                multiaddr.Multiaddr(a)
            except Exception as e:
                raise ValueError(f"not a multiaddr: {a!r} ({e})") from e
        for a in self.join:
            if "/p2p/" not in a:
                raise ValueError(f"--join needs the peer id in the address (…/p2p/12D3Koo…): {a!r}")
        if self.connect_timeout_s <= 0 or self.refresh_timeout_s <= 0:
            raise ValueError("connect_timeout_s and refresh_timeout_s must be positive")


def _guard_dht(dht: KadDHT) -> None:
    """Only shoal's records and libp2p's public keys, within per-peer quotas (swarm/net/dht_quota.py)."""
    from libp2p.kad_dht.kad_dht import PROTOCOL_ID
    from libp2p.records.pubkey import PublicKeyValidator

    from shoal.swarm.net.dht_quota import DhtQuota
    from shoal.swarm.net.dht_records import NAMESPACE, ShoalRecordValidator

    quota = DhtQuota({NAMESPACE: ShoalRecordValidator(), "pk": PublicKeyValidator()},
                     stored=lambda key: key.encode() in dht.value_store.store)
    dht.validator, dht.validator_changed = quota, True
    dht.handle_stream = quota.wrap(dht.handle_stream)  # set_mode registers this attribute too
    if dht.mode == DHTMode.SERVER:
        dht.host.set_stream_handler(PROTOCOL_ID, dht.handle_stream)
    _servers_only(dht, str(PROTOCOL_ID))


def _servers_only(dht: KadDHT, kad: str) -> None:
    """The DHT deals with DHT servers only. py-libp2p adds every peer that opens a Kademlia stream to its routing
    table, observers (`shoal dash`, `shoal peers`, a starting node's twin check: DHT clients) included, and when its
    table is small it queries (and stores values at) every peer its peerstore ever held: a node then asked observers
    ("protocols not supported … /ipfs/kad/1.0.0") and, once they had exited, dialed them in vain (hundreds of
    "failed to store value … negative cache" lines a minute in a 4-node swarm). A peer enters the routing table once
    identify says it serves Kademlia, and a peer that does not is forgotten as it disconnects."""
    from shoal.swarm.net.paths import speaks

    add = dht.add_peer

    async def add_peer(peer_id, *, skip_server_mode_check: bool = False) -> bool:
        if speaks(dht.host, peer_id, kad) is not True:
            return False
        return await add(peer_id)

    dht.add_peer = add_peer
    dht.host.get_network().register_notifee(_ForgetClients(dht.host, kad))


class QuietNotifee(INotifee):
    """A libp2p notifee that ignores every event; a subclass overrides the ones it watches."""

    async def connected(self, network, conn) -> None:
        pass

    async def disconnected(self, network, conn) -> None:
        pass

    async def opened_stream(self, network, stream) -> None:
        pass

    async def closed_stream(self, network, stream) -> None:
        pass

    async def listen(self, network, multiaddr) -> None:
        pass

    async def listen_close(self, network, multiaddr) -> None:
        pass


class _ForgetClients(QuietNotifee):
    """Drops a peer that does not serve the DHT from the peerstore once its last connection closes."""

    def __init__(self, host, kad: str):
        self.host, self.kad = host, kad

    async def disconnected(self, network, conn) -> None:
        from shoal.swarm.net.paths import speaks

        peer = conn.muxed_conn.peer_id
        if network.get_connections(peer) or speaks(self.host, peer, self.kad) is not False:
            return
        try:
            self.host.get_peerstore().clear_peerdata(peer)
        except Exception as e:  # noqa: BLE001 - already gone
            log.debug("forgetting %s: %s", peer, e)


class _LastCloses(QuietNotifee):
    """When each peer's last connection closed (py-libp2p removes a connection before it notifies), the newest
    CLOSES_KEPT; the watchers are told of each such close."""

    def __init__(self):
        self.at: OrderedDict[str, float] = OrderedDict()  # peer id -> trio time of the close
        self.watchers: list[Callable[[str], None]] = []

    async def disconnected(self, network, conn) -> None:
        try:
            peer = conn.muxed_conn.peer_id
            if network.get_connections(peer):
                return
            pid = peer.to_base58()
            self.at[pid] = trio.current_time()
            self.at.move_to_end(pid)
            while len(self.at) > CLOSES_KEPT:
                self.at.popitem(last=False)
            for watch in list(self.watchers):
                watch(pid)
        except Exception as e:  # noqa: BLE001 - a notifee must never raise into the network's task
            log.debug("close notice: %s", e)


class SwarmHost:
    """A running libp2p host with its DHT and pubsub; create with `open_host`."""

    def __init__(self, host, dht: KadDHT, pubsub: Pubsub, key: Ed25519PrivateKey, config: HostConfig):
        self.host = host
        self.dht = dht
        self.pubsub = pubsub
        self.key = key
        self.config = config
        self.peer_id: str = peer_id_of(key)
        self.join_errors: dict[str, str] = {}  # --join address -> why bootstrap could not reach it
        #: control-plane payload bytes [sent, received]: RPC requests and answers, gossiped records (on the loop)
        self.control_bytes = [0, 0]
        self.nat: NatTraversal | None = None  # set by open_host when config.nat is given
        self.links = LinkMeter()  # what this node measures of its links (the traffic it carries, probes)
        self._closes = _LastCloses()  # when each peer's last connection closed (`watch_closes`, `closed_for`)
        host.get_network().register_notifee(self._closes)

    @property
    def addrs(self) -> list[str]:
        """Full multiaddrs (with /p2p/ID) that others can --join: a wildcard listen address (0.0.0.0) becomes one
        per local interface address, non-loopback first."""
        out = []
        for a in self.host.get_addrs():
            s = str(a)
            out.append(s if "/p2p/" in s else f"{s}/p2p/{self.peer_id}")
        return expand_wildcard(out)

    def watch_closes(self, on_close: Callable[[str], None]) -> Callable[[], None]:
        """Call `on_close(peer id)` (on the event loop) whenever the last connection to a peer closes: a process
        that dies has its connections closed at once, a frozen or partitioned one keeps them. Returns the function
        that stops watching."""
        watchers = self._closes.watchers
        watchers.append(on_close)
        return lambda: watchers.remove(on_close) if on_close in watchers else None

    def closed_for(self, peer_id: str) -> float | None:
        """Seconds (trio time) since the last connection to `peer_id` closed, while none is open; None when one is
        open or no close of it was seen."""
        at = self._closes.at.get(peer_id)
        return None if at is None or self.is_connected(peer_id) else trio.current_time() - at

    def is_connected(self, peer_id: str) -> bool:
        """Whether at least one connection to `peer_id` is open."""
        try:
            return bool(self.host.get_network().get_connections(ID.from_base58(peer_id)))
        except ValueError:  # not a peer id
            return False

    def connected_peers(self) -> list[str]:
        return [p.to_base58() for p in self.host.get_connected_peers()]

    def direct_peers(self) -> list[str]:
        """Connected peers with at least one direct (not relayed) connection."""
        from shoal.swarm.net.paths import connection_kinds

        return sorted(p.to_base58() for p in self.host.get_connected_peers() if connection_kinds(self.host, p)[0])

    async def connect(self, addr: str) -> str:
        """Dial a full multiaddr (a relayed one too), add the peer to the DHT routing table, return its peer id."""
        if "/p2p-circuit/p2p/" in addr:
            from shoal.swarm.net.relay import dial_via_relay

            conn = await dial_via_relay(self.host, addr, self.config.connect_timeout_s)
            return conn.muxed_conn.peer_id.to_base58()
        info = info_from_p2p_addr(multiaddr.Multiaddr(addr))
        # the address we are told to dial is the one dialed, even if this peer's other addresses failed a moment ago
        # (a peer that restarted listens on a new port: libp2p would keep dialing the old one, or refuse the dial
        # for a while from its negative cache)
        if info.peer_id not in self.host.get_network().connections:
            self.host.get_peerstore().clear_addrs(info.peer_id)
        self.host.get_network().unblock_peer(info.peer_id)
        with trio.fail_after(self.config.connect_timeout_s):
            await self.host.connect(info)
        await self.dht.add_peer(info.peer_id, skip_server_mode_check=True)
        return info.peer_id.to_base58()

    async def bootstrap(self) -> list[str]:
        """Connect to every --join address (concurrently) and refresh the routing table right away."""
        joined: list[str] = []

        async def one(addr: str) -> None:
            try:
                joined.append(await self.connect(addr))
            except Exception as e:  # trio.TooSlowError included
                why = f"no answer within {self.config.connect_timeout_s:g} s" if isinstance(e, trio.TooSlowError) \
                    else dial_failure(e)
                self.join_errors[addr] = why
                log.info("could not join %s: %s", addr, why)  # the caller decides whether that is an error

        async with trio.open_nursery() as n:
            for a in self.config.join:
                n.start_soon(one, a)
        if joined:
            try:
                with trio.move_on_after(self.config.refresh_timeout_s):
                    await self.dht.refresh_routing_table()
            except Exception as e:
                log.warning("routing table refresh failed: %s", e)
        return joined

    def join_error(self) -> JoinError:
        """The error for a bootstrap that reached none of the --join addresses, with each one's reason."""
        why = "; ".join(f"{a}: {e}" for a, e in self.join_errors.items())
        which = "any of the --join addresses" if len(self.config.join) > 1 else "the --join address"
        return JoinError(f"could not reach {which} ({why})")

    def set_handler(self, protocol: str, handler: Callable[[object], Awaitable[None]]) -> None:
        """Register a stream handler that can never take the host down: whatever escapes it is logged."""

        async def guarded(stream) -> None:
            try:
                await handler(stream)
            except trio.Cancelled:
                raise
            except BaseException as e:  # noqa: BLE001 - one escaped exception kills a py-libp2p host
                if isinstance(e, BaseExceptionGroup) and e.subgroup(lambda x: not isinstance(x, trio.Cancelled)) \
                        is None:
                    raise  # only cancellations, from a nursery inside the handler: the host is shutting down
                log.warning("handler %s failed: %s: %s", protocol, type(e).__name__, e)
                try:
                    await stream.reset()
                except BaseException:  # noqa: BLE001
                    pass

        self.host.set_stream_handler(TProtocol(protocol), guarded)

    async def prepare_path(self, peer_id: str) -> None:
        """Make the direct path a bulk stream to `peer_id` needs (a relayed dial and a hole punch for a NATed
        peer; nothing otherwise), so that a caller can bound opening the stream itself tightly."""
        if self.nat is not None:
            await self.nat.paths.ensure(peer_id, bulk=True)

    async def open_stream(self, peer_id: str, protocol: str, *, bulk: bool = False):
        """A stream to `peer_id`, on a direct connection when there is one.

        With NAT traversal on, a peer that announced itself as relayed is dialed through its relay, and a
        `bulk` stream (tensors, state) waits for a hole punch instead of riding a relay (NoDirectPath if none
        comes); a peer whose direct dial fails is tried through its relays."""
        if self.nat is None:
            return await self._new_stream(peer_id, protocol)
        paths = self.nat.paths
        await paths.ensure(peer_id, bulk=bulk)
        try:
            return await self._new_stream(peer_id, protocol)
        except Exception:
            if not paths.circuit_addrs(peer_id) or self.host.get_network().get_connections(ID.from_base58(peer_id)):
                raise
        await paths.dial_relayed(peer_id)
        await paths.ensure(peer_id, bulk=bulk)
        return await self._new_stream(peer_id, protocol)

    async def _new_stream(self, peer_id: str, protocol: str):
        """py-libp2p's new_stream, waiting out a connection that closed but is still listed: its swarm then answers
        "No valid connections" instead of dialing afresh, until the closed connection is removed (moments later)."""
        for attempt in range(STALE_CONNECTION_RETRIES + 1):
            try:
                return await self.host.new_stream(ID.from_base58(peer_id), [TProtocol(protocol)])
            except SwarmException as e:
                if "No valid connections" not in str(e) or attempt == STALE_CONNECTION_RETRIES:
                    raise
            await trio.sleep(STALE_CONNECTION_WAIT_S)
        raise AssertionError("unreachable")

    async def disconnect(self, peer_id: str) -> None:
        try:
            await self.host.disconnect(ID.from_base58(peer_id))
        except Exception as e:  # already gone
            log.debug("disconnect %s: %s", peer_id, e)


def dial_failure(exc: BaseException) -> str:
    """The root cause of a failed dial, short ("connection refused"), from py-libp2p's chain of wrapped errors."""
    seen: set[int] = set()
    stack: list[BaseException | None] = [exc]
    deepest = exc
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno is not None and e.strerror:
            return e.strerror.lower()
        deepest = e
        stack += [e.__cause__, e.__context__, *getattr(e, "exceptions", ()), *getattr(e, "errors", ())]
    return str(deepest) or type(deepest).__name__


def build_libp2p_host(key: Ed25519PrivateKey, listen: str):
    """A host that speaks Noise only (no plaintext, secio or TLS fallback) and yamux only, and advertises (identify)
    addresses that can be dialed: a wildcard listen address as this machine's interface addresses (peers stored
    /ip4/0.0.0.0/tcp/N as ours and dialed it, which reaches whatever listens on N on their own machine)."""
    kp = libp2p_key_pair(key)
    noise = NoiseTransport(kp, noise_privkey=create_x25519_key_pair().private_key)
    return new_host(
        key_pair=kp,
        sec_opt={TProtocol(NOISE_PROTOCOL_ID): noise},
        muxer_opt={TProtocol(YAMUX_PROTOCOL_ID): Yamux},
        listen_addrs=[multiaddr.Multiaddr(listen)],
        enable_mDNS=False,
        enable_upnp=False,
        addrs_factory=_dialable,
    )


def _dialable(candidates: list[multiaddr.Multiaddr]) -> list[multiaddr.Multiaddr]:
    """The host's advertised addresses: wildcard ones expanded to this machine's interface addresses."""
    return [multiaddr.Multiaddr(a) for a in expand_wildcard([str(c) for c in candidates])]


async def _release_sockets(host) -> None:
    """Close the host's connections and listeners, also when its exit is cancelled: py-libp2p's own stop does it in
    a cancellable teardown, so a cancelled host kept its listener (a system task) and the connections peers had
    dialed to it, and those peers went on seeing it as connected."""
    network = host.get_network()
    with trio.CancelScope(shield=True), trio.move_on_after(RELEASE_TIMEOUT_S):
        for conns in list(network.connections.values()):
            for conn in list(conns):
                try:
                    await conn.close()
                    # a listed connection may be a closed duplicate whose muxed connection (shared with the live
                    # one py-libp2p kept, which may be listed nowhere) is still open
                    await conn.muxed_conn.close()
                except Exception as e:  # noqa: BLE001 - already closing; the socket goes either way
                    log.debug("closing a connection at exit: %s", e)
        for listener in list(network.listeners.values()):
            try:
                await listener.close()
            except Exception as e:  # noqa: BLE001
                log.debug("closing a listener at exit: %s", e)


@asynccontextmanager
async def open_host(key: Ed25519PrivateKey, config: HostConfig) -> AsyncIterator[SwarmHost]:
    """The libp2p host with its DHT and GossipSub, closed on exit. A fixed listen port another process holds
    raises AddressInUse (swarm/net/listen.py).

    A failure while closing, after the caller's block ended normally, is logged and not raised: the
    node has already left (its leave notice is out), and a library teardown hiccup must not turn a
    clean stop into a crash. A failure inside the block propagates as usual, also when closing fails
    after it: py-libp2p's teardown can raise an error of its own (a connection arriving while its
    services stop spawns a task into a closed nursery: "Nursery is closed to new arrivals"), which
    would otherwise replace the block's error (a node refused at start would end with it)."""
    check_free(config.listen)
    host = build_libp2p_host(key, config.listen)
    closed_normally = False
    failure: BaseException | None = None  # the block's own error
    try:
        async with AsyncExitStack() as stack:
            try:
                await stack.enter_async_context(host.run([multiaddr.Multiaddr(config.listen)]))
            except Exception as e:
                if "Address already in use" in str(e):  # py-libp2p wraps the OSError in its own error
                    raise AddressInUse(config.listen) from e
                raise
            stack.push_async_callback(_release_sockets, host)
            check_sole_listener(config.listen)
            mode = DHTMode.SERVER if config.dht_mode_server else DHTMode.CLIENT
            dht = KadDHT(host, mode, enable_random_walk=False)
            router = GossipSub(
                protocols=[PROTOCOL_ID_V11],
                degree=6,
                degree_low=4,
                degree_high=12,
                heartbeat_interval=config.gossip_heartbeat_s,
                heartbeat_initial_delay=0.1,
                time_to_live=30,
            )
            # py-libp2p drops every message beyond 10 a second that one peer forwards on a topic, and logs a warning
            # each time: a peer forwards every peer's records (statuses, leases, tables), so a 4-node swarm already
            # passed it, and an observer (a dashboard) lost the records of peers it heard through that one (shown
            # stale, then "back" when a snapshot brought them). The bound scales with the swarm; shoal's own checks
            # (signatures, size limits, penalties: swarm/net/gossip.py) stand behind it.
            router.max_messages_per_topic_per_second = GOSSIP_MESSAGES_PER_PEER_S
            _guard_dht(dht)
            pubsub = _Pubsub(host, router, strict_signing=True, seen_ttl=60)
            await stack.enter_async_context(background_trio_service(dht))
            await stack.enter_async_context(background_trio_service(pubsub))
            await stack.enter_async_context(background_trio_service(router))
            await pubsub.wait_until_ready()
            sh = SwarmHost(host, dht, pubsub, key, config)
            if config.nat is not None:
                sh.nat = await stack.enter_async_context(_nat_services(sh, config.nat))
            log.info("host %s listening on %s", sh.peer_id, sh.addrs)
            try:
                yield sh
            except BaseException as e:
                failure = e
                raise
            closed_normally = True
    except Exception as e:  # raised again unless the block had ended normally, see the docstring
        if failure is not None and not _holds(e, failure):
            log.warning("closing the libp2p host raised %s: %s after the node failed (the host is closed anyway)",
                        type(e).__name__, e, exc_info=True)
            raise failure from None
        if not closed_normally:
            raise
        log.warning("closing the libp2p host raised %s: %s (the host is closed anyway)", type(e).__name__, e,
                    exc_info=True)


def _holds(exc: BaseException, inner: BaseException) -> bool:
    """`exc` is `inner` or an exception group holding it."""
    if exc is inner:
        return True
    return isinstance(exc, BaseExceptionGroup) and any(_holds(e, inner) for e in exc.exceptions)


@asynccontextmanager
async def _nat_services(sh: SwarmHost, config: NatConfig) -> AsyncIterator[NatTraversal]:
    """The relay (STOP side), the dial-back service, the hole puncher and the path notifee, stopped on exit.
    The reachability loop itself (probing, relaying, reservations) is started by the node: `sh.nat.run`."""
    from shoal.swarm.net.nat import NatTraversal

    nat = NatTraversal(sh, config)
    async with AsyncExitStack() as stack:
        await stack.enter_async_context(background_trio_service(nat.relay))
        if nat.puncher is not None:
            await stack.enter_async_context(background_trio_service(nat.puncher))
        nursery = await stack.enter_async_context(trio.open_nursery())
        await nursery.start(nat.paths.run)
        try:
            yield nat
        finally:
            nursery.cancel_scope.cancel()
