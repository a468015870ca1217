"""The node daemon: joins the swarm, announces itself, publishes status, keeps its membership view, leaves cleanly."""

from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from shoal.node.failure import describe
from shoal.node.links import LinksConfig, NodeLinks
from shoal.node.version import shoal_version
from shoal.protocol import PROTOCOL_VERSION
from shoal.protocol.envelope import Signed, seal
from shoal.protocol.records import Announcement, HardwareProfile, LeaveNotice, RunStatus, StatusRecord
from shoal.swarm.net.dht_records import announcement_key
from shoal.swarm.net.gossip import RecordGossip
from shoal.swarm.net.host import HostConfig, SwarmHost, open_host
from shoal.node.twins import TwinDetected, refuse_twin
from shoal.swarm.net.identity import load_or_create_identity, peer_id_of
from shoal.swarm.net.membership import Event, MAX_MEMBERS_ROWS, Membership, MembershipConfig, verified_members
from shoal.swarm.net.penalty import Penalties
from shoal.swarm.net.pulse import Pulse, steady_clock
from shoal.swarm.net.recent_peers import MAX_PEERS, load_recent_peers, save_recent_peers
from shoal.swarm.net.rpc import RpcError, RpcServer, call
from shoal.swarm.run.directory import RunDirectory

from shoal.node.run.context import NodeServices

if TYPE_CHECKING:
    from shoal.node.run.config import RunConfig
    from shoal.node.run.runtime import RunRuntime

log = logging.getLogger(__name__)


def status_gossip_s(status_interval_s: float, gone_after_s: float, fail_after_s: float | None = None) -> float:
    """How often an unchanged status record is gossiped: every second status interval, but at least twice per
    `gone_after_s` (and three times per the broker's `fail_after_s`), so silence still means what it meant (and a
    dashboard, which shows a peer stale after ~3 intervals of silence, never sees a live one go stale).
    A record whose role, state, slot, run or error changed goes out at once."""
    bounds = [2 * status_interval_s, gone_after_s / 2] + ([fail_after_s / 3] if fail_after_s else [])
    return max(status_interval_s, min(bounds))


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeConfig:
    host: HostConfig = field(default_factory=HostConfig)
    identity: Path | None = None  # None: an ephemeral identity (tests, observers)
    device: str = "auto"
    home: Path = Path("~/.shoal")
    status_file: Path | None = None
    status_interval_s: float = 2.0  # the status is refreshed (file, RPC answers) this often
    status_gossip_s: float | None = None  # an unchanged status is gossiped this often (None: status_gossip_s())
    announce_interval_s: float = 60.0  # re-gossip of the announcement (joiners also fetch it with `members`)
    rpc_timeout_s: float = 5.0
    nat_settle_s: float = 15.0  # with NAT traversal: at most this long for the first reachability verdict
    membership: MembershipConfig = field(default_factory=MembershipConfig)
    links: LinksConfig = field(default_factory=LinksConfig)  # probes and link reports (in a run)
    run: RunConfig | None = None  # train in this run (None: a plain swarm member)
    # the recent-peers file (None: none kept): dialed at start, so a restarted node finds its swarm without --join
    peers_file: Path | None = None
    remember_peers_s: float = 2.0  # the live peers are checked this often; the file is rewritten when they changed
    metrics_listen: tuple[str, int] | None = None  # serve Prometheus metrics here (node/metrics.py); None: off
    metrics_file: Path | None = None  # append a JSON line of the same figures every status interval (rotated)
    recall_timeout_s: float = 5.0  # dialing one remembered peer gives up after this long

    def __post_init__(self) -> None:
        if not 0.1 <= self.status_interval_s <= 60:
            raise ValueError("status_interval_s must be within [0.1, 60]")
        if self.remember_peers_s <= 0 or self.recall_timeout_s <= 0:
            raise ValueError("remember_peers_s and recall_timeout_s must be positive")
        if self.status_gossip_s is not None and not self.status_interval_s <= self.status_gossip_s <= 600:
            raise ValueError("status_gossip_s must be within [status_interval_s, 600]")
        if self.device not in ("auto", "cpu", "mps") and not self.device.startswith("cuda"):
            raise ValueError(f"--device must be auto, cpu, cuda, cuda:N or mps, not {self.device!r}")


class Node:
    def __init__(self, config: NodeConfig, hardware: HardwareProfile, *, key: Ed25519PrivateKey | None = None):
        """`key`: the identity, already loaded (else read from `config.identity`)."""
        self.config = config
        self.hardware = hardware
        self.key = key if key is not None else load_or_create_identity(config.identity)
        self._peer_id = peer_id_of(self.key)
        self.sh: SwarmHost | None = None
        self.membership: Membership | None = None
        self.pulse = Pulse(steady_clock)  # one clock for the membership, the run's timeouts and freeze detection
        self.penalties = Penalties()
        self.directory = RunDirectory(on_bad=self.penalties.penalize)  # the runs the swarm advertises
        self.gossip: RecordGossip | None = None
        self.state = "starting"
        self.phase = "starting"  # what start-up is doing now, for the command line's progress
        self.role = "idle"
        self.started_at = time.time()
        self._t0 = time.monotonic()
        self._seq = 0
        self._announcement: bytes = b""
        self.events: list[tuple[float, Event]] = []
        self.rpc: RpcServer | None = None
        self._last_fields: dict[str, Any] = {}
        self.last_status: StatusRecord | None = None  # the newest status record this node made of itself
        self.runtime: RunRuntime | None = None
        self.metrics = None  # the Prometheus endpoint (node/metrics.py), when config.metrics_listen
        self.metrics_file = None
        self.extra_ingest: list = []  # more consumers of verified records (the run client)
        # asks the person at the terminal which of several open runs to join (the command line sets it when its
        # input is a terminal; None: such a node is refused with the candidates)
        self.choose_run = None
        self._remembered: dict[str, list[str]] = {}
        self._gossip_due = True  # publish the status at the next interval even if unchanged
        self._stop = trio.Event()
        self._hurry = False
        self._revision = 0
        self._paths_for = None  # the run table whose replicas we last prepared direct paths to
        self.links: NodeLinks | None = None  # link probes, this node's link reports, everyone's (the link book)

    @property
    def peer_id(self) -> str:
        return self._peer_id

    # -- records -------------------------------------------------------------------------------------------
    def ingest(self, signed: Signed, age_s: float = 0.0) -> None:
        assert self.membership is not None
        for ev in self.membership.observe(signed, age_s=age_s):
            self._event(ev)
        self.directory.observe(signed)
        if self.links is not None:
            self.links.ingest(signed)
        for consumer in self.extra_ingest:
            try:
                consumer(signed)
            except Exception as e:  # noqa: BLE001 - a consumer's bug must not stop record intake
                log.warning("record consumer failed: %s: %s", type(e).__name__, e)
        if self.sh is not None and self.sh.nat is not None:
            rec = signed.record
            if isinstance(rec, Announcement):
                entry = self.membership.peers.get(rec.peer_id)
                if entry is not None and entry.announcement is signed:  # the newest one we hold
                    self.sh.nat.learn(rec.peer_id, rec.reachability, rec.addrs)
            self._prepare_paths()

    def _prepare_paths(self) -> None:
        """When our run's table changes: start direct paths (relayed dial + hole punch) to the replicas we will
        exchange tensors with, so the first round does not wait for them."""
        client = self.runtime.client if self.runtime is not None else None
        table = client.table if client is not None else None
        if table is None or table is self._paths_for:
            return
        self._paths_for = table
        slots = {s.peer_id for s in table.slots}
        if self.peer_id in slots or self.peer_id in table.backups:
            self.sh.nat.paths.prepare(sorted(slots - {self.peer_id}))

    def _event(self, ev: Event) -> None:
        log.info("peer %s: %s %s", ev.peer_id, ev.kind, ev.detail)
        if ev.kind in ("join", "back"):
            self._gossip_due = True  # a newcomer learns of us from our next status, not one gossip period later
        self.events = (self.events + [(time.time(), ev)])[-200:]

    def status_record(self) -> StatusRecord:
        self._seq = max(self._seq + 1, int(time.time() * 1000))  # increasing across restarts too
        run = RunStatus()
        if self.runtime is not None and self.state not in ("starting", "leaving"):
            try:
                run = self.runtime.status()
            except Exception:  # noqa: BLE001 - a bug in reporting must not stop the node: say so and go on
                log.exception("run status unavailable")
                run = RunStatus(error="run status unavailable (see the node's log)")
        record = StatusRecord(peer_id=self.peer_id, seq=self._seq, time=time.time(),
                              peers_seen=len(self.membership.live_peers()) if self.membership else 0,
                              **{"role": self.role, "state": self.state, **run.said()})
        # what the status file repeats of it: the role and state it says, and the run's fields it said
        self._last_fields = {"role": record.role, "state": record.state, **run.to_wire()}
        self.last_status = record
        return record

    def members_snapshot(self) -> list[list[Any]]:
        """[announcement envelope, status envelope, age in seconds] for every live peer, this one included."""
        assert self.membership is not None
        rows: list[list[Any]] = [[self._announcement, self._last_status, 0.0]]
        for e in self.membership.live_peers()[: MAX_MEMBERS_ROWS - 1]:
            rows.append([e.announcement.raw if e.announcement else None, e.status.raw if e.status else None,
                         round(self.membership.age_s(e), 3)])
        return rows

    def ingest_snapshot(self, rows: Any, source: str) -> int:
        """Verify and ingest a members snapshot from `source`; anything malformed penalizes the source."""
        records = verified_members(rows, lambda why: self.penalties.penalize(source, why))
        for signed, age in records:
            self.ingest(signed, age_s=age)
        return len(records)

    # -- tasks ---------------------------------------------------------------------------------------------
    async def _rpc_members(self, caller: str, body: Any) -> Any:
        return self.members_snapshot()

    async def _rpc_announce(self, caller: str, body: Any) -> Any:
        return self._announcement

    async def _rpc_time(self, caller: str, body: Any) -> Any:
        """This node's wall clock (unix seconds), so a peer can measure its clock offset (`shoal doctor`)."""
        return time.time()

    async def publish(self, envelope: bytes) -> None:
        assert self.gossip is not None
        self.directory.own(envelope)  # this node's broker's advert: listed here too (`runs` answers with it)
        try:
            await self.gossip.publish(envelope)
        except Exception as e:  # noqa: BLE001 - a gossip hiccup must not stop the node
            log.warning("publish failed: %s: %s", type(e).__name__, e)

    @property
    def gossip_period_s(self) -> float:
        c = self.config
        if c.status_gossip_s is not None:
            return c.status_gossip_s
        return status_gossip_s(c.status_interval_s, c.membership.gone_after_s,
                               c.run.broker.fail_after_s if c.run is not None else None)

    def _take_metrics(self) -> None:
        """One sample of the node's figures for the metrics endpoint and file (on the loop, which owns them)."""
        if self.metrics is None and self.metrics_file is None:
            return
        from shoal.node.metrics import sample_node

        try:
            sample = sample_node(self)
        except Exception:  # noqa: BLE001 - a bug in reporting must not stop the node
            log.exception("metrics sample failed")
            return
        if self.metrics is not None:
            self.metrics.update(sample)
        if self.metrics_file is not None:
            self.metrics_file.append(sample)

    async def _status_loop(self) -> None:
        published_at, published = -math.inf, None
        while True:
            record = self.status_record()
            self._last_status = seal(record, self.key)
            changed = (record.role, record.state, record.run_id, record.slot, record.error)
            if (changed != published or self._gossip_due
                    or trio.current_time() - published_at >= self.gossip_period_s - 0.05):
                published_at, published, self._gossip_due = trio.current_time(), changed, False
                await self.publish(self._last_status)
            for ev in self.membership.sweep():
                self._event(ev)
            self.write_status_file()
            self._take_metrics()
            await trio.sleep(self.config.status_interval_s)

    async def _announce_loop(self) -> None:
        """Announce again soon after start (1, 2, 4, 8 s: the gossip mesh forms meanwhile, and peers must learn the
        new address of a node that restarted), then every `announce_interval_s`."""
        delay = 1.0
        while True:
            await trio.sleep(min(delay, self.config.announce_interval_s))
            delay *= 2
            await self.publish(self._announcement)

    # -- reachability (NAT traversal) ------------------------------------------------------------------------
    def _seal_announcement(self) -> bytes:
        sh = self.sh
        nat = sh.nat
        self._revision += 1
        return seal(Announcement(
            peer_id=sh.peer_id, addrs=tuple(nat.advertised_addrs() if nat else sh.addrs),
            software_version=shoal_version(), protocol_version=PROTOCOL_VERSION, hardware=self.hardware,
            started_at=self.started_at, reachability=nat.reachability if nat else "unknown",
            relay=bool(nat and nat.relay.serving), revision=self._revision), self.key)

    def relay_candidates(self) -> list[tuple[str, tuple[str, ...]]]:
        """Live peers that announce a relay service, for a node that needs one (the newest first)."""
        out = []
        for e in self.membership.live_peers() if self.membership else []:
            a = e.announcement_record
            if a is not None and a.relay and a.reachability == "public":
                out.append((e.first_seen, a.peer_id, tuple(x for x in a.addrs if "/p2p-circuit" not in x)))
        return [(pid, addrs) for _, pid, addrs in sorted(out)]

    async def _reannounce_loop(self) -> None:
        """Announce again whenever the reachability, the relay service or the advertised addresses change."""
        nat = self.sh.nat
        while True:
            await nat.changed.wait()
            await trio.sleep(0.2)  # one announcement for a burst of changes
            env = self._announcement = self._seal_announcement()
            log.info("reachability now %s", nat.describe())
            await self.publish(env)
            try:
                with trio.move_on_after(self.config.rpc_timeout_s):
                    await self.sh.dht.put_value(announcement_key(self.sh.peer_id), env)
            except Exception as e:  # noqa: BLE001 - the DHT copy is a convenience
                log.info("announcement not stored in the DHT: %s", e)

    async def sync_from(self, peer_id: str) -> int:
        try:
            rows = await call(self.sh, peer_id, "members", timeout_s=self.config.rpc_timeout_s)
        except RpcError as e:
            log.warning("could not fetch members from %s: %s", peer_id, e)
            return 0
        return self.ingest_snapshot(rows, peer_id)

    def write_status_file(self) -> None:
        path = self.config.status_file
        if path is None or self.sh is None:
            return
        live = self.membership.live_peers()
        doc = {
            "peer_id": self.peer_id, "addrs": self.sh.addrs, "state": self.state, "role": self.role,
            "peers": [e.peer_id for e in live], "pid": os.getpid(), "time": time.time(),
            "version": shoal_version(),
        }
        nat = self.sh.nat
        if nat is not None:
            doc["nat"] = {"reachability": nat.reachability, "relay": nat.relay.serving,
                          "relays": sorted(nat.reservations), "addrs": nat.advertised_addrs(),
                          "relayed_after_s": None if nat.relayed_since is None else nat.relayed_since - self._t0,
                          "direct_peers": self.sh.direct_peers(), "punch": [nat.paths.stats.attempts,
                                                                     nat.paths.stats.successes],
                          "relay_bytes": nat.relay.bytes_relayed, "relay_cut": nat.relay.circuits_cut}
        if self.runtime is not None:
            doc.update(self._last_fields)  # what the last status record said
            # re-fetches, entries, the state hashes, the sequences computed (its share of the global batch) and the
            # AQ-SGD link ends' digests of the last steps (replicas and link ends compare over a window, not one
            # sampled step), the warm copy's revision, link counters, and in a verified run what this stage
            # re-executed and found
            doc.update(self.runtime.detail().to_json())
            if self.runtime.recovery is not None:  # checkpoints, shards, rebuilds (node/run/recovery.py)
                doc["recovery"] = self.runtime.recovery.report()
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(doc, indent=1))
        os.replace(tmp, path)

    def stop(self, *, hurry: bool = False) -> None:
        """Leave the swarm. `hurry`: the whole swarm is going (a local swarm's supervisor is gone): a leave notice,
        no goodbye to the run's broker, which is leaving too."""
        self._hurry = hurry
        self._stop.set()

    # -- recent peers --------------------------------------------------------------------------------------
    async def _recall_peers(self, joined: list[str]) -> list[str]:
        """Dial the peers of the recent-peers file that `joined` lacks (concurrently); the peer ids reached."""
        path = self.config.peers_file
        remembered = load_recent_peers(path) if path is not None else {}
        self._remembered = remembered
        reached: list[str] = []

        async def one(pid: str, addrs: list[str]) -> None:
            for a in addrs:
                with trio.move_on_after(self.config.recall_timeout_s):
                    try:
                        reached.append(await self.sh.connect(a))
                        return
                    except Exception as e:  # noqa: BLE001 - a remembered peer may be gone for good
                        log.debug("remembered peer %s at %s: %s", pid, a, e)

        async with trio.open_nursery() as n:
            for pid, addrs in remembered.items():
                if pid not in joined and pid != self.peer_id:
                    n.start_soon(one, pid, addrs)
        if remembered:
            log.info("reached %d of %d remembered peers", len(reached), len(remembered))
        return reached

    def remember_peers(self) -> None:
        """Write the live peers' addresses (most recently seen first, then the ones remembered before)."""
        path = self.config.peers_file
        if path is None or self.membership is None:
            return
        peers: dict[str, list[str]] = {}
        for e in sorted(self.membership.live_peers(), key=lambda e: -e.last_seen):
            ann = e.announcement_record
            if ann is not None and ann.addrs:
                peers[e.peer_id] = list(ann.addrs)
        for pid, addrs in self._remembered.items():
            peers.setdefault(pid, addrs)
        peers = dict(list(peers.items())[:MAX_PEERS])
        if peers != self._remembered:
            try:
                save_recent_peers(path, peers)
                self._remembered = peers
            except OSError as e:
                log.warning("could not write the recent-peers file %s: %s", path, e)

    async def _remember_loop(self) -> None:
        while True:
            self.remember_peers()
            await trio.sleep(self.config.remember_peers_s)

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        c = self.config
        if c.metrics_file is not None:
            from shoal.node.metrics import MetricsFile

            self.metrics_file = MetricsFile(c.metrics_file)
        if c.metrics_listen is not None:  # bound before anything else, so a taken port fails at once
            from shoal.node.metrics import MetricsEndpoint

            self.metrics = MetricsEndpoint(*c.metrics_listen)
        try:
            await self._run(task_status=task_status)
        finally:
            if self.metrics is not None:
                self.metrics.close()
                self.metrics = None

    async def _run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        join = list(self.config.host.join)
        if any(a.rstrip("/").endswith(f"/p2p/{self.peer_id}") for a in join):
            raise TwinDetected(f"the --join address is this node's own peer id ({self.peer_id}): another node runs "
                               f"with this identity")
        if join:  # before joining as this identity, which would disturb a twin's connections
            self.phase = f"joining the swarm via {len(join)} address{'es' if len(join) > 1 else ''}"

            def checking() -> None:
                self.phase = "the swarm lists this node's peer id: checking that no other node runs with it"

            # through the --join addresses and the peers remembered from the last run (a restarted bootstrap may
            # listen elsewhere now; the node's own join below tries both too)
            remembered = load_recent_peers(self.config.peers_file) if self.config.peers_file is not None else {}
            via = join + [a for pid, addrs in remembered.items() if pid != self.peer_id for a in addrs[:1]
                          if a not in join]
            await refuse_twin(via, self.peer_id, gossip_period_s=self.gossip_period_s,
                              rpc_timeout_s=self.config.rpc_timeout_s, on_check=checking)
        async with open_host(self.key, self.config.host) as sh:
            self.sh = sh
            if hasattr(sh.dht.validator, "on_refuse"):  # a peer whose DHT puts are refused is penalized
                sh.dht.validator.on_refuse, sh.dht.validator.banned = self.penalties.penalize, self.penalties.is_banned
            if sh.nat is not None:  # so is a peer asking the relay past its limits
                sh.nat.relay.penalize, sh.nat.relay.banned = self.penalties.penalize, self.penalties.is_banned
            self.membership = Membership(sh.peer_id, self.config.membership, self.pulse.clock, self.pulse)
            self.gossip = RecordGossip(sh, self.penalties, self.ingest)
            rpc = self.rpc = RpcServer(sh, self.penalties, later=("run.",))
            rpc.register("members", self._rpc_members)
            rpc.register("announce", self._rpc_announce)
            rpc.register("time", self._rpc_time)
            rpc.register("runs", self.directory.rpc_runs)
            self.links = NodeLinks(sh, self.key, self.penalties, self.publish, self.config.links)  # probes, reports
            self._announcement = self._seal_announcement()
            self._last_status = seal(self.status_record(), self.key)
            async with trio.open_nursery() as nursery:
                await nursery.start(self.gossip.run)
                await nursery.start(self.pulse.run)
                joined = await self._join()
                for pid in joined:
                    await self.sync_from(pid)
                if sh.nat is not None:
                    sh.nat.relay_candidates = self.relay_candidates
                    await sh.nat.settle(joined, self.config.nat_settle_s)
                    self._announcement = self._seal_announcement()
                try:
                    with trio.move_on_after(self.config.rpc_timeout_s):  # a peer that cannot be dialed stalls it
                        await sh.dht.put_value(announcement_key(sh.peer_id), self._announcement)
                except Exception as e:  # noqa: BLE001 - the DHT copy is a convenience, gossip carries it too
                    log.info("announcement not stored in the DHT: %s", e)
                self.state = self.phase = "ready"
                await self.publish(self._announcement)
                try:
                    async with trio.open_nursery() as periodic:
                        periodic.start_soon(self._status_loop)
                        periodic.start_soon(self._announce_loop)
                        periodic.start_soon(self._remember_loop)
                        await periodic.start(self.links.run)
                        if sh.nat is not None:
                            await periodic.start(sh.nat.run)
                            periodic.start_soon(self._reannounce_loop)
                        if self.config.run is not None:
                            from shoal.node.run.runtime import RunRuntime

                            self.runtime = RunRuntime(self.run_services(), self.config.run, self.hardware)
                            await periodic.start(self._run_training, joined)
                        task_status.started(self)
                        await self._stop.wait()
                        if self.runtime is not None:
                            await self.runtime.leave(tell_broker=not self._hurry)
                        periodic.cancel_scope.cancel()  # no status may follow the leave notice
                except BaseException as e:  # refused, failed or interrupted: the swarm need not wait for silence
                    with trio.CancelScope(shield=True):
                        await self.publish_leave(describe(e), wait_s=1.0)
                    raise
                await self.leave(nursery)

    def run_services(self) -> NodeServices:
        """What this node's run may use of it."""
        assert self.sh is not None and self.membership is not None and self.rpc is not None
        return NodeServices(sh=self.sh, key=self.key, membership=self.membership, penalties=self.penalties,
                            register=self.rpc.register, publish=self.publish, ingest=self.extra_ingest.append,
                            pulse=self.pulse, joined_by_address=bool(self.config.host.join), links=self.links,
                            directory=self.directory, choose_run=self.choose_run,
                            own_status=lambda: self.last_status)

    async def _join(self) -> list[str]:
        """Connect to the --join addresses and the peers remembered from the last run; JoinError when none
        answers."""
        join = self.config.host.join
        joined = await self.sh.bootstrap()
        recalled = await self._recall_peers(joined)
        if join and not joined:
            if not recalled:
                raise self.sh.join_error()
            log.warning("none of --join %s answered; going on with %d remembered peers", list(join), len(recalled))
        return joined + [p for p in recalled if p not in joined]

    async def _run_training(self, joined: list[str], *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """The run's part of the node; a failure there is reported in the status, and the node leaves."""
        try:
            await self.runtime.run(joined, task_status=task_status)
        except Exception as e:
            log.info("training stopped: %s: %s", type(e).__name__, e, exc_info=True)  # the caller reports it
            self.runtime.error = f"{type(e).__name__}: {e}"
            self._last_status = seal(self.status_record(), self.key)
            await self.publish(self._last_status)
            raise

    async def publish_leave(self, reason: str, wait_s: float = 2.0) -> None:
        """Publish a leave notice and give it a moment to spread."""
        self.state = "leaving"
        self.write_status_file()
        notice = seal(LeaveNotice(peer_id=self.peer_id, time=time.time(), reason=reason[:200]), self.key)
        with trio.move_on_after(wait_s):
            await self.publish(notice)
            await trio.sleep(0.3)

    async def leave(self, nursery: trio.Nursery, reason: str = "shutdown") -> None:
        """Publish a leave notice, give it a moment to spread, then close everything."""
        await self.publish_leave(reason)
        nursery.cancel_scope.cancel()
