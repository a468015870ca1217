"""This node's side of NAT traversal: learn its reachability, relay for others when public, hold relays when not.

The loop: ask connected peers to dial us back (`reachability.ask_dialback`) -- at start, whenever the answer is
still unknown and new peers have connected, and every `reprobe_s`. Public (or `--relay on`): serve as a circuit
relay. Unreachable: reserve a slot on `reservations_wanted` relays (peers that announce a relay, else the peers
we joined through), advertise the circuit addresses, run the DHT as a client; "relayed" once a reservation
holds. Every change wakes `changed` so the node re-announces itself.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import trio
from libp2p.kad_dht.kad_dht import DHTMode
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo

from shoal.swarm.net.paths import Paths, PathConfig, HolePuncher, connection_kinds, speaks
from shoal.swarm.net.reachability import (DIALBACK_PROTOCOL, LAN, PUBLIC, RELAYED, UNKNOWN, UNREACHABLE,
                                          DialBackConfig, DialBackService, ask_dialback, candidate_addrs)
from shoal.swarm.net.relay import RelayConfig, RelayService, Reservation, reserve

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class NatConfig:
    relay: RelayConfig = field(default_factory=RelayConfig)
    dialback: DialBackConfig = field(default_factory=DialBackConfig)
    paths: PathConfig = field(default_factory=PathConfig)
    probe_timeout_s: float = 8.0  # one round of dial-back requests
    reprobe_s: float = 300.0
    check_s: float = 1.0  # how often the loop looks at peers and reservations

    def __post_init__(self) -> None:
        if min(self.probe_timeout_s, self.reprobe_s, self.check_s) <= 0:
            raise ValueError("NAT timers must be positive")


RelayCandidates = Callable[[], list[tuple[str, tuple[str, ...]]]]  # (peer id, its addresses), best first


class NatTraversal:
    """Owns the relay service, the dial-back service, the hole puncher and the paths of one SwarmHost."""

    def __init__(self, sh, config: NatConfig, *, clock=time.monotonic):
        self.sh = sh
        self.host = sh.host
        self.config = config
        self.clock = clock
        self.relay = RelayService(self.host, config.relay)
        self.dialback = DialBackService(self.host, config.dialback)
        self.puncher = HolePuncher(self.host) if config.paths.hole_punch else None
        self.paths = Paths(self.host, self.puncher, config.paths, clock=clock)
        self.reachability = UNKNOWN  # PUBLIC, LAN, RELAYED, UNREACHABLE or UNKNOWN
        self.dialed_at: tuple[str, ...] = ()
        self.reservations: dict[str, Reservation] = {}
        self.relay_candidates: RelayCandidates = lambda: []
        self.joined: list[str] = []
        self.changed = trio.Event()
        self.relayed_since: float | None = None  # monotonic time the first reservation held
        self._probed_peers: frozenset[str] = frozenset()
        self._last_probe = -1e18
        self._failed_relays: dict[str, float] = {}
        self.undialable: set[str] = set()  # peers that announced they cannot be dialed
        sh.set_handler(DIALBACK_PROTOCOL, self.dialback.handle_stream)
        guard_routing_table(sh.dht, lambda pid: pid.to_base58() in self.undialable)

    # -- what we tell others -------------------------------------------------------------------------------
    def advertised_addrs(self) -> list[str]:
        """Public: where we were dialed back. Relayed: our circuit addresses first. Always our listen addresses."""
        me = self.sh.peer_id
        out = [f"{a}/p2p/{me}" for a in self.dialed_at if self.reachability == PUBLIC]
        for r in self.reservations.values():
            out += r.circuit_addrs(me)
        out += self.sh.addrs
        return list(dict.fromkeys(out))[:16]

    def describe(self) -> str:
        if self.reachability == PUBLIC:
            text = f"public (dialed back at {', '.join(self.dialed_at)})"
        elif self.reachability == LAN:
            text = f"lan: direct on this network only (dialed back at {', '.join(self.dialed_at)})"
        elif self.reachability == RELAYED:
            text = "relayed: behind a NAT, reachable through " + ", ".join(
                f"{r[:16]}…" for r in self.reservations)
        elif self.reachability == UNREACHABLE:
            text = "unreachable: behind a NAT, no relay reserved yet"
        else:
            text = "unknown: no peer has dialed us back yet"
        return text + ("; relaying for others" if self.relay.serving else "")

    def _set(self, reachability: str, dialed_at: tuple[str, ...] = ()) -> None:
        if (reachability, dialed_at) != (self.reachability, self.dialed_at):
            log.info("reachability: %s -> %s %s", self.reachability, reachability, list(dialed_at))
            self.reachability, self.dialed_at = reachability, dialed_at
            self._wake()

    def _wake(self) -> None:
        self.changed.set()
        self.changed = trio.Event()

    def learn(self, peer_id: str, reachability: str, addrs: tuple[str, ...]) -> None:
        """A peer's announcement: how to reach it. Peers that nobody can dial leave our DHT routing table and stay
        out of it (their private addresses would cost every lookup a failed dial); they run their DHT as clients."""
        self.paths.learn(peer_id, reachability, addrs)
        if reachability in (RELAYED, UNREACHABLE):
            self.undialable.add(peer_id)
            if len(self.undialable) > 65536:
                self.undialable.clear()
            try:
                self.sh.dht.routing_table.remove_peer(ID.from_base58(peer_id))
            except Exception as e:  # noqa: BLE001 - not in the table
                log.debug("routing table: %s", e)
        else:
            self.undialable.discard(peer_id)

    # -- probing ------------------------------------------------------------------------------------------------
    def _direct_peers(self) -> list[str]:
        """Peers on a direct connection that may dial us back: not those identify says do not serve the dial-back
        protocol (observers: asking them only logged a failed stream)."""
        out = []
        for pid in self.host.get_connected_peers():
            if connection_kinds(self.host, pid)[0] and speaks(self.host, pid, DIALBACK_PROTOCOL) is not False:
                out.append(pid.to_base58())
        return out

    async def probe(self) -> None:
        """One round of dial-back requests to up to three directly connected peers (the joined ones first)."""
        peers = self._direct_peers()
        servers = [p for p in self.joined if p in peers] + [p for p in peers if p not in self.joined]
        self._probed_peers = frozenset(peers)
        self._last_probe = self.clock()
        if not servers:
            return
        manager = self.host._observed_addr_manager  # what peers saw us as (identify)
        observed = []
        if manager is not None:
            for a in manager.addrs(min_observers=1):
                parts = str(a).split("/")
                if len(parts) > 2 and "/p2p-circuit" not in str(a):
                    observed.append(parts[2])
        candidates = candidate_addrs(self.sh.addrs, observed)
        verdict = await ask_dialback(self.dialback, servers, candidates, self.config.probe_timeout_s)
        log.info("dial-back from %d of %d peers: %s %s", verdict.answers, len(servers[:3]), verdict.reachability,
                 list(verdict.dialed_at))
        if verdict.reachability in (PUBLIC, LAN):
            self._set(verdict.reachability, verdict.dialed_at)
        elif verdict.reachability == UNREACHABLE:
            self._set(RELAYED if self.reservations else UNREACHABLE)

    def _probe_due(self) -> bool:
        if self.clock() - self._last_probe >= self.config.reprobe_s:
            return True
        return self.reachability == UNKNOWN and bool(set(self._direct_peers()) - self._probed_peers)

    # -- relays ----------------------------------------------------------------------------------------------------
    def _serve_relay(self) -> None:
        mode = self.config.relay.service
        self.relay.serve(mode == "on" or (mode == "auto" and self.reachability == PUBLIC), self.sh.set_handler)

    async def _keep_reservations(self) -> None:
        now = time.time()
        for rid, r in list(self.reservations.items()):
            if r.expires_at <= now or not self.host.get_network().get_connections(ID.from_base58(rid)):
                log.info("reservation on relay %s lost", rid)
                del self.reservations[rid]
                self._wake()
            elif r.expires_at - now < 0.2 * self.config.relay.reservation_ttl_s:
                await self._reserve(rid, ())
        if self.reachability not in (UNREACHABLE, RELAYED):
            if self.reservations:
                self.reservations.clear()
                self._wake()
            return
        wanted = self.config.relay.reservations_wanted
        candidates = list(self.relay_candidates()) + [(p, ()) for p in self.joined]
        for rid, addrs in candidates:
            if len(self.reservations) >= wanted:
                break
            if rid in self.reservations or rid == self.sh.peer_id:
                continue
            if self.clock() - self._failed_relays.get(rid, -1e18) < 30.0:
                continue
            await self._reserve(rid, addrs)
        self._set(RELAYED if self.reservations else UNREACHABLE)

    async def _reserve(self, rid: str, addrs: tuple[str, ...]) -> None:
        try:
            if addrs and not self.host.get_network().get_connections(ID.from_base58(rid)):
                await self.sh.connect(next(a for a in addrs if "/p2p-circuit" not in a))
            r = await reserve(self.host, rid, self.config.relay.timeout_s)
        except (Exception, trio.TooSlowError, StopIteration) as e:  # noqa: BLE001 - try another relay
            log.info("no reservation on %s: %s: %s", rid, type(e).__name__, e)
            self._failed_relays[rid] = self.clock()
            return
        fresh = rid not in self.reservations
        self.reservations[rid] = r
        if fresh:
            if self.relayed_since is None:
                self.relayed_since = self.clock()
            log.info("reservation on relay %s: %s", rid, r.circuit_addrs(self.sh.peer_id))
            self._wake()

    async def _dht_mode(self) -> None:
        want = DHTMode.CLIENT if self.reachability in (UNREACHABLE, RELAYED) else (
            DHTMode.SERVER if self.sh.config.dht_mode_server else DHTMode.CLIENT)
        if self.sh.dht.mode != want:
            try:
                await self.sh.dht.switch_mode(want)
                # tell connected peers at once (identify push), so they stop keeping us in their routing tables
                with trio.move_on_after(self.config.probe_timeout_s):
                    await self.host._push_identify_to_all_peers()
            except Exception as e:  # noqa: BLE001 - the DHT mode is an optimisation
                log.info("DHT mode switch to %s failed: %s", want, e)

    async def step(self) -> None:
        """One pass: probe if due, then relay service, reservations and DHT mode to match the reachability."""
        if self._probe_due():
            await self.probe()
        self._serve_relay()
        await self._keep_reservations()
        await self._dht_mode()

    async def settle(self, joined: list[str], timeout_s: float) -> None:
        """The first verdict (and a reservation if we need one) before the node announces itself; bounded."""
        self.joined = list(joined)
        with trio.move_on_after(timeout_s):
            await self.step()
            while self.reachability == UNREACHABLE:
                await trio.sleep(self.config.check_s)
                await self.step()

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            try:
                await self.step()
            except (Exception, trio.TooSlowError) as e:  # noqa: BLE001 - one bad pass must not stop the loop
                log.warning("NAT traversal pass failed: %s: %s", type(e).__name__, e)
            await trio.sleep(self.config.check_s)


def guard_routing_table(dht, excluded: Callable[[ID], bool]) -> None:
    """Keep `excluded` peers out of the DHT routing table.

    py-libp2p 0.8.1 adds every peer that sends it a DHT request to its routing table, unchecked ("the peer
    initiated a KAD stream, so it must support server mode"): a NATed node running its DHT as a client lands in
    every table it queries, and each lookup then stalls dialing its private address. This wraps the table's
    `add_peer` (the one entry for every path that adds peers) on this DHT instance."""
    table = dht.routing_table
    add = table.add_peer

    async def add_peer(peer, *args, **kw):
        if excluded(peer.peer_id if isinstance(peer, PeerInfo) else peer):
            return False
        return await add(peer, *args, **kw)

    table.add_peer = add_peer
