"""Which connection a stream to a peer takes: direct when there is one, through a relay, upgraded by hole punching.

What a peer announced decides how to reach it: a "relayed" peer is dialed through one of its relays (its
circuit addresses); everyone else is dialed directly by the swarm. Whenever two peers hold only a relayed
connection, the one with the smaller peer id starts DCUtR (one initiator, so two simultaneous sessions never
race for the same ports); the other one waits for the direct connection to appear. Streams of bulk protocols
(state transfer, synchronization rounds) never ride a relay: they wait for the hole punch, bounded, and fail
with `NoDirectPath` if it does not succeed -- relays carry control traffic only, within their limits.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import trio
from libp2p.abc import INotifee
from libp2p.peer.id import ID
from libp2p.relay.circuit_v2.dcutr import DCUtRProtocol

from shoal.swarm.net.reachability import RELAYED, is_private_ip, ip_port
from shoal.swarm.net.relay import dial_via_relay

log = logging.getLogger(__name__)


class NoDirectPath(ConnectionError):
    """Only a relayed path to the peer exists and hole punching did not make a direct one."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PathConfig:
    hole_punch: bool = True
    punch_timeout_s: float = 10.0  # a bulk stream waits this long for a hole punch
    retry_punch_after_s: float = 15.0  # after a failed punch, bulk streams to that peer fail at once this long
    relay_dial_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if min(self.punch_timeout_s, self.relay_dial_timeout_s) <= 0 or self.retry_punch_after_s < 0:
            raise ValueError("path timeouts must be positive")


def speaks(host, peer_id: ID | str, protocol: str) -> bool | None:
    """Whether the peer serves `protocol`, by what identify said of it (None: identify has not said yet)."""
    try:
        protocols = host.get_peerstore().get_protocols(peer_id if isinstance(peer_id, ID) else ID.from_base58(peer_id))
    except Exception:  # noqa: BLE001 - a peer the peerstore does not know
        return None
    return (protocol in [str(p) for p in protocols]) if protocols else None


def connection_kinds(host, peer: ID) -> tuple[bool, bool]:
    """(has a direct connection, has a relayed connection) to `peer`, from the connections' transport addresses."""
    direct = relayed = False
    for conn in host.get_network().get_connections(peer):
        if conn.is_closed:
            continue
        try:
            addrs = [str(a) for a in conn.get_transport_addresses()]
        except Exception:  # noqa: BLE001
            addrs = []
        if addrs and all("/p2p-circuit" in a for a in addrs):
            relayed = True
        elif addrs:
            direct = True
    return direct, relayed


class HolePuncher(DCUtRProtocol):
    """py-libp2p's DCUtR, driven by shoal: no background loop punching every relayed peer on its own, and the
    plain direct dial it tries first goes only to public addresses, briefly (0.8.1 dials every known address for
    its full dial timeout, 10 s, before punching: a NATed peer's private address never answers)."""

    def __init__(self, host, *, unilateral_timeout_s: float = 2.0):
        super().__init__(host, read_timeout=10, write_timeout=10, dial_timeout=5)
        self.unilateral_timeout_s = unilateral_timeout_s

    async def _auto_drive_loop(self) -> None:
        await trio.sleep_forever()

    async def _try_unilateral_upgrade(self, peer_id: ID) -> bool:
        try:
            known = self.host.get_peerstore().addrs(peer_id)
        except Exception:  # noqa: BLE001 - PeerStoreError: no address known (identify has not run over the relay)
            return False
        addrs = [a for a in known if (ipp := ip_port(str(a))) is not None and not is_private_ip(ipp[0])]
        if not addrs:
            return False
        with trio.move_on_after(self.unilateral_timeout_s):
            async with trio.open_nursery() as n:
                for a in addrs[:4]:
                    n.start_soon(self._dial_peer, peer_id, a)
        return await self._verify_direct_connection(peer_id)


@dataclass(slots=True)
class PeerRoute:
    reachability: str = "unknown"
    circuit_addrs: tuple[str, ...] = ()
    punch_failed_at: float = -1e18


@dataclass(slots=True)
class PunchStats:
    attempts: int = 0
    successes: int = 0
    times_s: list[float] = field(default_factory=list)


class Paths(INotifee):
    """Makes the path to a peer; a swarm notifee so that a new relayed connection starts the hole punch."""

    def __init__(self, host, puncher: HolePuncher | None, config: PathConfig = PathConfig(), *,
                 clock=time.monotonic):
        self.host = host
        self.puncher = puncher
        self.config = config
        self.clock = clock
        self.me = host.get_id()
        self.routes: dict[str, PeerRoute] = {}
        self.stats = PunchStats()
        self._punching: dict[ID, trio.Event] = {}
        self._nursery: trio.Nursery | None = None
        self._dial_locks: dict[str, trio.Lock] = {}
        self._preparing: set[str] = set()

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as n:
            self._nursery = n
            self.host.get_network().register_notifee(self)
            task_status.started()
            await trio.sleep_forever()

    def learn(self, peer_id: str, reachability: str, addrs: tuple[str, ...]) -> None:
        """What a peer announced: its reachability and (when relayed) its circuit addresses."""
        if peer_id == self.me.to_base58():
            return
        r = self.routes.setdefault(peer_id, PeerRoute())
        r.reachability = reachability
        r.circuit_addrs = tuple(a for a in addrs if "/p2p-circuit/p2p/" in a and a.endswith(peer_id))[:4]
        if len(self.routes) > 4096:
            self.routes.pop(next(iter(self.routes)))

    def circuit_addrs(self, peer_id: str) -> tuple[str, ...]:
        r = self.routes.get(peer_id)
        return r.circuit_addrs if r else ()

    # -- making a path ---------------------------------------------------------------------------------------
    async def ensure(self, peer_id: str, *, bulk: bool = False) -> None:
        """Before a stream to `peer_id`: dial a relayed peer through its relay; for bulk, insist on direct."""
        peer = ID.from_base58(peer_id)
        direct, relayed = connection_kinds(self.host, peer)
        if direct:
            return
        route = self.routes.get(peer_id)
        if not relayed and route is not None and route.reachability == RELAYED and route.circuit_addrs:
            await self.dial_relayed(peer_id)
            relayed = True
        if relayed and bulk:
            await self.wait_direct(peer)

    def prepare(self, peer_ids) -> None:
        """Start making direct paths to these peers in the background (e.g. a run's group as it forms), so that
        the first bulk stream does not pay for the relayed dial and the hole punch."""
        for p in peer_ids:
            if p != self.me.to_base58() and p not in self._preparing and self._nursery is not None:
                self._preparing.add(p)
                self._nursery.start_soon(self._prepare_one, p)

    async def _prepare_one(self, peer_id: str) -> None:
        try:
            with trio.move_on_after(self.config.relay_dial_timeout_s + self.config.punch_timeout_s):
                await self.ensure(peer_id, bulk=True)
        except (Exception, trio.TooSlowError) as e:  # noqa: BLE001 - the stream that needs it will say so
            log.debug("path to %s not prepared: %s: %s", peer_id, type(e).__name__, e)
        finally:
            self._preparing.discard(peer_id)

    async def dial_relayed(self, peer_id: str) -> None:
        """A relayed connection through the first of the peer's relays that takes us (one dial at a time)."""
        lock = self._dial_locks.setdefault(peer_id, trio.Lock())
        async with lock:
            if any(connection_kinds(self.host, ID.from_base58(peer_id))):
                return
            errors = []
            for addr in self.circuit_addrs(peer_id):
                try:
                    await dial_via_relay(self.host, addr, self.config.relay_dial_timeout_s)
                    log.info("relayed connection to %s via %s", peer_id, addr.split("/p2p-circuit")[0])
                    break
                except (Exception, trio.TooSlowError) as e:  # noqa: BLE001 - try the next relay
                    errors.append(f"{type(e).__name__}: {e}")
            else:
                raise ConnectionError(f"no relay of {peer_id[:16]}… took us: {'; '.join(errors) or 'no address'}")
            if len(self._dial_locks) > 4096:
                self._dial_locks.clear()

    async def wait_direct(self, peer: ID) -> None:
        """Wait (bounded) for the hole punch to `peer`; raise NoDirectPath when it does not come."""
        route = self.routes.setdefault(peer.to_base58(), PeerRoute())
        if self.puncher is None:
            raise NoDirectPath(f"only a relayed path to {peer.to_base58()[:16]}… (hole punching is off)")
        if self.clock() - route.punch_failed_at < self.config.retry_punch_after_s:
            raise NoDirectPath(f"only a relayed path to {peer.to_base58()[:16]}… (hole punch failed recently)")
        if self._initiates(peer):
            self._start_punch(peer)
        with trio.move_on_after(self.config.punch_timeout_s):
            while not connection_kinds(self.host, peer)[0]:
                ev = self._punching.get(peer)
                if ev is not None:
                    await ev.wait()
                    if connection_kinds(self.host, peer)[0]:
                        return
                    break  # our own punch ended without a direct connection
                await trio.sleep(0.1)
            else:
                return
        route.punch_failed_at = self.clock()
        raise NoDirectPath(f"hole punch to {peer.to_base58()[:16]}… did not make a direct connection")

    def _initiates(self, peer: ID) -> bool:
        return self.me.to_bytes() < peer.to_bytes()

    def _start_punch(self, peer: ID) -> None:
        if peer in self._punching or self._nursery is None or self.puncher is None:
            return
        self._punching[peer] = trio.Event()
        self._nursery.start_soon(self._punch, peer, self.puncher)

    async def _punch(self, peer: ID, puncher: HolePuncher) -> None:
        t0 = self.clock()
        self.stats.attempts += 1
        ok = False
        try:
            with trio.move_on_after(60):
                ok = await puncher.initiate_hole_punch(peer)
        except Exception as e:  # noqa: BLE001 - a failed punch leaves the relayed path
            log.info("hole punch to %s failed: %s: %s", peer, type(e).__name__, e)
        finally:
            ok = ok and connection_kinds(self.host, peer)[0]
            if ok:
                self.stats.successes += 1
                self.stats.times_s = (self.stats.times_s + [self.clock() - t0])[-100:]
            else:
                self.routes.setdefault(peer.to_base58(), PeerRoute()).punch_failed_at = self.clock()
            log.info("hole punch to %s: %s after %.2f s", peer, "direct" if ok else "failed", self.clock() - t0)
            self._punching.pop(peer).set()

    async def _after_relayed_connection(self, peer: ID) -> None:
        await trio.sleep(0.3)  # the relay tags the connection's circuit address after the upgrade
        direct, relayed = connection_kinds(self.host, peer)
        if relayed and not direct:
            self._start_punch(peer)

    # -- INotifee ----------------------------------------------------------------------------------------------
    async def connected(self, network, conn) -> None:
        try:
            peer = conn.muxed_conn.peer_id
        except Exception:  # noqa: BLE001
            return
        if self._nursery is not None and self.puncher is not None and self._initiates(peer):
            try:
                self._nursery.start_soon(self._after_relayed_connection, peer)
            except RuntimeError:  # the node is stopping: its nursery takes no new tasks
                pass

    async def disconnected(self, network, conn) -> None:
        return None

    async def opened_stream(self, network, stream) -> None:
        return None

    async def closed_stream(self, network, stream) -> None:
        return None

    async def listen(self, network, multiaddr) -> None:
        return None

    async def listen_close(self, network, multiaddr) -> None:
        return None
