"""Every node's view of its run: asks for admission, follows the signed table, takes over as broker when standby."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import trio

from shoal.protocol.admission import admission_key, admission_proof
from shoal.protocol.assignment import (
    ACTIVE, BACKUP, GONE, RUN_RECORD_TYPES, AdmitRequest, AdmitResponse, AssignmentTable, BrokerLease,
    MissingReport, RollbackRequest, slot_name)
from shoal.protocol.envelope import Signed, open_envelope, seal
from shoal.protocol.errors import ProtocolError
from shoal.protocol.records import HardwareProfile
from shoal.protocol.tabledelta import TableDelta, rebuild
from shoal.swarm.run.authority import RunAuthority
from shoal.swarm.run.broker import AdmissionError, Broker, BrokerConfig, NotBroker
from shoal.swarm.run.context import RunContext
from shoal.swarm.net.dht_records import lease_key, table_key
from shoal.swarm.net.rpc import RpcError, call
from shoal.swarm.run.group import Group
from shoal.swarm.run.tablerpc import table_answer, table_digest
from shoal.swarm.run.timeline import group_of

log = logging.getLogger(__name__)

LEASE_WITNESSES = 3  # members a standby asks for the broker's lease before it takes over


@dataclass(frozen=True, kw_only=True, slots=True)
class RunClientConfig:
    poll_s: float = 3.0  # how often the broker is asked for the table (gossip is the fast path; this also beats)
    rpc_timeout_s: float = 5.0
    # a broker that cannot be reached is asked again every retry_s for this long, and never for less than a
    # standby's takeover can take (RunClient.takeover_s), so a node that joins meanwhile finds the new broker
    admit_timeout_s: float = 40.0
    retry_s: float = 1.0
    # the most a lease signer's wall clock may be off ours: a lease that expired longer ago than this, or issued
    # further ahead, is no evidence that its broker lives (an old lease cannot be replayed)
    max_clock_offset_s: float = 5.0

    def __post_init__(self) -> None:
        if min(self.poll_s, self.rpc_timeout_s, self.retry_s, self.admit_timeout_s) <= 0:
            raise ValueError("positive intervals and at least one admission attempt are required")
        if self.max_clock_offset_s < 0:
            raise ValueError("max_clock_offset_s must not be negative")


class RunClient:
    """Start with `await nursery.start(client.run)`; it returns once admitted (raises AdmissionError if refused).

    `broker_id`: the broker to ask (this node's own id on the node that started the run with `local_broker`).
    Change notification: `await client.wait_changed()`, or `client.on_change.append(callback(table))`.
    """

    def __init__(self, ctx: RunContext, hardware: HardwareProfile, *, broker_id: str, secret: str | None = None,
                 config: RunClientConfig = RunClientConfig(), broker_config: BrokerConfig = BrokerConfig(),
                 local_broker: Broker | None = None, backup_only: bool = False):
        self.ctx = ctx
        self.clock = ctx.clock
        self.hardware = hardware
        self.secret = secret
        self._admission_key: bytes | None = None
        self.config = config
        self.broker_config = broker_config  # the lease timeout to watch, and the broker's settings on a takeover
        self.backup_only = backup_only
        self.local_broker = local_broker
        self._expected_broker = broker_id
        self.table: AssignmentTable | None = None
        self.table_env: bytes = b""
        self.admitted = False
        self.broker_alive_at = self.clock()  # the last evidence that the table's broker renews its lease
        self._lease_issued = 0.0  # issue time of the newest lease of the table's broker seen (its wall clock)
        self._lease_env: bytes | None = None  # ... that lease, signed: served with our table, so a standby can check
        self._released = False  # ... and it is a release: its broker's own word that it holds the lease no more
        self._standbys: set[str] = set()  # the standbys named by accepted tables of the current lease epoch
        self.deltas_applied = 0  # newer tables gossiped as deltas: rebuilt and taken
        self.deltas_missed = 0  # ... and not (made from a table we do not hold, or refused): the poll brings them
        self.authority = RunAuthority(ctx.manifest)
        self.on_change: list[Callable[[AssignmentTable], None]] = []
        self.takeovers: list[float] = []  # unix times this node became the broker
        self._changed = trio.Event()
        self._nursery: trio.Nursery | None = None
        if local_broker is not None:
            local_broker.on_change.append(lambda t, env: self._accept(t, env, t.peer_id))

    # -- what the trainer asks ------------------------------------------------------------------------------
    @property
    def me(self) -> str:
        return self.ctx.me

    @property
    def broker_id(self) -> str:
        return self.table.peer_id if self.table else self._expected_broker

    def is_broker(self) -> bool:
        return self.local_broker is not None and not self.local_broker.deposed

    def slot(self) -> tuple[int, int] | None:
        return self.table.slot_of(self.me) if self.table else None

    def slot_name(self) -> str | None:
        s = self.slot()
        return slot_name(*s) if s else None

    def provider_state(self) -> str | None:
        return self.table.provider_state(self.me) if self.table else None

    def evicted(self) -> bool:
        """The run evicted this node on a majority verdict (docs/broker.md, "Failure detection"): no broker of the run
        admits it again."""
        return self.table is not None and self.me in self.table.evicted

    def role(self) -> str:
        """The StatusRecord role: active (holds a slot), backup, broker (no slot), or idle."""
        if self.slot() is not None:
            return "active"
        if self.provider_state() == BACKUP:
            return "backup"
        return "broker" if self.is_broker() else "idle"

    def backup_stage(self) -> int | None:
        """The stage this node keeps warm while it is a backup (None: it is not one)."""
        return self.table.backup_stage(self.me) if self.table else None

    def epoch(self, stage: int) -> int:
        return self.table.epochs[stage] if self.table else 0

    def group(self) -> Group | None:
        """This node's group under the newest table (the runtime follows switch steps: GroupTimeline)."""
        return group_of(self.table, self.me) if self.table else None

    def lease_lapsed(self) -> bool:
        """This node is the standby and has had no evidence of the broker's lease for longer than its timeout
        (silence across this process's own freeze does not count: a standby that was frozen waits afresh), or the
        broker released it (restarted, it holds the lease no more: `release_lease`)."""
        t = self.table
        return t is not None and t.peer_id != self.me and t.standby == self.me and self._broker_lease_over()

    def _broker_lease_over(self) -> bool:
        """The table's broker released its lease, or renewed it last longer than its timeout ago (as this node
        sees it)."""
        return self._released or self.ctx.silent_s(self.broker_alive_at) > self.broker_config.lease_timeout_s

    def orphaned(self) -> bool:
        """The newest table names this node as the broker, yet no broker of ours holds the lease: this process
        restarted with the broker's identity, or its broker stood down when its lease lapsed."""
        t = self.table
        return t is not None and t.peer_id == self.me and not self.is_broker()

    def takeover_s(self) -> float:
        """The longest a standby's takeover can take once the broker stops renewing: the lease timeout, then the
        standby's next poll of the broker (up to an RPC timeout) and its look at the DHT. Admission retries and an
        orphaned lease wait this long (the one bound both use)."""
        b, c = self.broker_config, self.config
        return b.lease_timeout_s + c.poll_s + c.rpc_timeout_s + b.dht_timeout_s

    async def wait_changed(self) -> AssignmentTable:
        await self._changed.wait()
        assert self.table is not None  # a change is a table accepted
        return self.table

    # -- tables ----------------------------------------------------------------------------------------------
    def _trusted_signer(self, t: AssignmentTable) -> bool:
        why = self.authority.refuses(t)
        if why is not None:
            log.info("ignored a table of run %s: %s", t.run_id[:16], why)
            return False
        cur = self.table
        if cur is None:  # a signed run: any broker the owner authorised; an unsigned one: the broker we were told of
            return self.authority.signed or t.peer_id == self._expected_broker
        if t.peer_id == cur.peer_id:
            return t.lease_epoch >= cur.lease_epoch
        # a takeover: the next lease epoch, by a standby that a table of the current lease epoch named (not only the
        # newest one, so a later table of the old broker, which may name another standby, cannot make us reject the
        # legitimate one), once the broker's lease has lapsed as this node sees it (a standby cannot depose a live
        # broker); our own takeover, and one while we are the broker named without a lease, need no wait
        if t.lease_epoch != cur.lease_epoch + 1 or t.peer_id not in self._standbys:
            return False
        lapsed = self._broker_lease_over()
        if not (lapsed or (t.peer_id == self.me and self.is_broker()) or self.orphaned()):
            log.info("ignored %s's takeover of run %s: the lease of %s has not lapsed here", t.peer_id[:16],
                     t.run_id[:16], cur.peer_id[:16])
            return False
        return True

    def _accept(self, t: AssignmentTable, env: bytes, source: str) -> bool:
        if t.run_id != self.ctx.run_id or not t.newer_than(self.table) or not self._trusted_signer(t):
            return False
        new_broker = self.table is not None and t.peer_id != self.table.peer_id
        if self.table is None or t.lease_epoch != self.table.lease_epoch:
            self._standbys = set()
            self._released = False  # a release ends one lease epoch (a broker that took its lease back holds the next)
        if new_broker:
            self._lease_issued, self._lease_env, self._released = 0.0, None, False
        if t.standby is not None:
            self._standbys.add(t.standby)
        self.authority.note(t)
        self.table, self.table_env = t, env
        if new_broker or t.peer_id == source:
            self.broker_alive_at = self.clock()
        if new_broker:
            log.warning("run %s: broker is now %s (lease epoch %d)", t.run_id[:16], t.peer_id, t.lease_epoch)
        if self.local_broker is not None and t.peer_id != self.me and t.lease_epoch > self.local_broker.lease_epoch:
            self.local_broker.stand_down(f"{t.peer_id} holds lease epoch {t.lease_epoch}")
        self._changed.set()
        self._changed = trio.Event()
        for cb in list(self.on_change):
            try:
                cb(t)
            except Exception as e:  # noqa: BLE001
                log.warning("run listener failed: %s: %s", type(e).__name__, e)
        return True

    def accept_envelope(self, env: bytes, source: str) -> bool:
        try:
            signed = open_envelope(env, RUN_RECORD_TYPES)
        except ProtocolError as e:
            log.info("bad run record from %s: %s", source, e)
            return False
        if isinstance(signed.record, AssignmentTable):
            return self._accept(signed.record, signed.raw, source)  # True only if it became the current table
        return self.on_record(signed, source=source)

    def on_record(self, signed: Signed, source: str | None = None) -> bool:
        """Feed a verified gossip record (the daemon calls this for every record); True if it was a run record."""
        rec = signed.record
        if isinstance(rec, AssignmentTable):
            self._accept(rec, signed.raw, source or rec.peer_id)
            return True
        if isinstance(rec, TableDelta):
            self._on_delta(rec, source or rec.peer_id)
            return True
        if isinstance(rec, BrokerLease):
            t = self.table
            # evidence is a renewal: a lease issued later than any we saw (a re-served old lease proves nothing),
            # unexpired and not from the future by our clock, give or take the bounded clock offset; one that
            # expires as it is issued is a release (the broker's own word, signed as every lease: release_lease)
            now, slack = self.ctx.wall(), self.config.max_clock_offset_s
            if t is not None and rec.run_id == self.ctx.run_id and rec.peer_id == t.peer_id \
                    and rec.lease_epoch >= t.lease_epoch and rec.time > self._lease_issued and rec.time <= now + slack:
                if rec.expires_at <= rec.time:
                    self._lease_issued, self._lease_env, self._released = rec.time, signed.raw, True
                    log.info("run %s: %s released its lease (epoch %d)", self.ctx.run_id[:16], rec.peer_id[:16],
                             rec.lease_epoch)
                elif rec.expires_at + slack > now:
                    self._lease_issued, self._lease_env, self._released = rec.time, signed.raw, False
                    self.broker_alive_at = self.clock()
            return True
        return False

    def _on_delta(self, d: TableDelta, source: str) -> None:
        """A change of the table gossiped as a delta: rebuilt from the table we hold when it was made from that one,
        then taken as the whole table would be (its broker's signature checked). Otherwise the next poll brings the
        whole table (it names ours by digest, and ours is not the broker's)."""
        t = self.table
        if t is None or d.run_id != self.ctx.run_id or d.peer_id != t.peer_id or d.version <= t.version:
            return  # not our run's broker's, or a table we hold already
        applied = False
        if d.base_version == t.version:  # else made from a table we missed
            try:
                applied = self.accept_envelope(rebuild(self.table_env, d), source)
            except ProtocolError as e:
                log.info("table delta %d -> %d from %s not applied: %s", d.base_version, d.version, source, e)
        if applied:
            self.deltas_applied += 1
        else:
            self.deltas_missed += 1

    # -- requests to the broker ---------------------------------------------------------------------------
    async def _ask(self, method: str, body: Any) -> Any:
        if self.broker_id == self.me:
            broker = self.local_broker
            if broker is None or broker.deposed:  # (not is_broker())
                raise RpcError("this node is named the run's broker but holds no lease (yet)")
            try:
                return await broker.handle(method, self.me, body)
            except NotBroker as e:
                raise RpcError(str(e)) from e
        return await self._call(self.broker_id, method, body)

    async def _call(self, peer_id: str, method: str, body: Any) -> Any:
        return await call(self.ctx.sh, peer_id, method, body, timeout_s=self.config.rpc_timeout_s)

    async def admit(self) -> AdmitResponse:
        """Ask the broker for a place; raise AdmissionError if refused, RpcError if it could not be reached."""
        if not self.authority.may_broker(self.broker_id, self.table.delegation if self.table else None):
            raise RpcError(f"{self.broker_id[:16]}… is no broker the run's owner authorised: not asking it")
        nonce = proof = None
        if self.ctx.manifest.join.mode == "secret" and self.secret is not None:
            nonce, proof = await self._prove()
        req = AdmitRequest(run_id=self.ctx.run_id, hardware=self.hardware, nonce=nonce, proof=proof,
                           backup_only=self.backup_only)
        try:
            resp = AdmitResponse.from_wire(await self._ask("run.admit", req.to_wire()))
        except ProtocolError as e:
            raise RpcError(f"bad admission answer: {e}") from e
        if not resp.admitted:
            raise AdmissionError(resp.error or "refused")
        if resp.table is not None:
            self.accept_envelope(resp.table, self.broker_id)
        self.admitted = True
        log.info("admitted to run %s as %s", self.ctx.run_id[:16], resp.slot or resp.state)
        return resp

    async def _prove(self) -> tuple[bytes, bytes]:
        """Answer the broker's challenge with a proof of the join secret bound to this run, the broker we ask and
        this node (the secret itself is never sent)."""
        broker = self.broker_id
        ans = await self._ask("run.challenge", {"run_id": self.ctx.run_id})
        nonce = ans.get("nonce") if isinstance(ans, dict) else None
        if not isinstance(nonce, bytes) or len(nonce) != 32:
            raise RpcError("bad admission challenge")
        if self._admission_key is None:  # scrypt: keep the loop free
            salt = bytes.fromhex(self.ctx.manifest.join.secret_salt)
            self._admission_key = await trio.to_thread.run_sync(admission_key, self.secret, salt)
        return nonce, admission_proof(self._admission_key, run_id=self.ctx.run_id, broker=broker, joiner=self.me,
                                      nonce=nonce)

    async def report_missing(self, missing: Sequence[str], *, epoch: int, stage: int, offenders: Sequence[str] = (),
                             neighbours: Sequence[str] = ()) -> bool:
        """Tell the broker that `missing` members missed a round's deadline (it checks them: a silent one is
        replaced, one that answers makes it re-form the group), that `offenders` sent updates we rejected
        (evicted once most members say so), or that a link to these lane `neighbours` failed (checked alike)."""
        rep = MissingReport(run_id=self.ctx.run_id, stage=stage, epoch=epoch, missing=tuple(missing),
                            offenders=tuple(offenders), neighbours=tuple(neighbours))
        try:
            ans = await self._ask("run.report_missing", rep.to_wire())
        except RpcError as e:
            log.info("report_missing failed: %s", e)
            return False
        return isinstance(ans, dict) and ans.get("accepted") is True

    async def rollback(self, stage: int, revision: int, source: str) -> str | None:
        """Ask the broker to send the run back to `revision`, where this node (holding a slot of `stage`, which lost
        every replica) rebuilt the stage's state from `source`; None when accepted, else why not."""
        req = RollbackRequest(run_id=self.ctx.run_id, stage=stage, revision=revision, source=source)
        try:
            ans = await self._ask("run.rollback", req.to_wire())
        except RpcError as e:
            return str(e)
        if isinstance(ans, dict) and ans.get("accepted") is True:
            return None
        return str(ans.get("error") if isinstance(ans, dict) else ans)[:200]

    async def leave(self) -> None:
        """Graceful leave: the broker marks this node draining and moves a backup into its slot."""
        try:
            ans = await self._ask("run.leave", None)
            if isinstance(ans, dict) and isinstance(ans.get("table"), bytes):
                self.accept_envelope(ans["table"], self.broker_id)
        except RpcError as e:
            log.info("leave not acknowledged: %s", e)

    # -- following -----------------------------------------------------------------------------------------
    async def _poll(self, peer_id: str) -> bool:
        try:
            body: dict[str, Any] = {"run_id": self.ctx.run_id}
            if self.table_env:  # the answer carries the table only when it is not the one we hold
                body["have"] = table_digest(self.table_env)
            ans = await self._call(peer_id, "run.table", body)
        except RpcError as e:
            log.debug("table poll of %s failed: %s", peer_id, e)
            return False
        if not isinstance(ans, dict):
            return False
        if isinstance(ans.get("table"), bytes):
            self._check_served(ans["table"], peer_id)
            self.accept_envelope(ans["table"], peer_id)
        if isinstance(ans.get("lease"), bytes):
            self.accept_envelope(ans["lease"], peer_id)  # a renewal counts as evidence; merely answering does not
        return True

    def _check_served(self, env: bytes, peer_id: str) -> None:
        """Penalize a peer that served a table of our run whose broker the owner never authorised."""
        try:
            t = open_envelope(env, RUN_RECORD_TYPES).record
        except ProtocolError:
            return  # accept_envelope says so
        why = self.authority.refuses(t) if isinstance(t, AssignmentTable) and t.run_id == self.ctx.run_id else None
        if why is not None and self.ctx.penalties is not None:
            self.ctx.penalties.penalize(peer_id, f"served a run table {why}")

    async def _lease_seen_elsewhere(self) -> bool:
        """A last look before taking over, for evidence this standby may have missed (a starved process reads its
        gossip late, and its own poll of the broker may time out while the others are served): a fresh lease in the
        DHT, or a renewal newer than ours that a few of the run's members hold (each serves the newest it saw with
        its table). Only the broker's signed lease counts, under the same rule as gossip, so a member can neither
        forge one nor keep a dead broker alive past its lease by replaying an old one; a member that lies by
        silence only lets the takeover go ahead, as the DHT's answer alone did before. All asked at once, so a
        dead broker's takeover waits no longer than the DHT's timeout."""
        t = self.table
        if t is None:
            return False
        alive = False

        async def dht() -> None:
            nonlocal alive
            if await self._dht_lease_alive(t.peer_id):
                self.broker_alive_at = self.clock()
                alive = True

        asked = self.lease_witnesses(t)
        async with trio.open_nursery() as n:
            n.start_soon(dht)
            for p in asked:
                n.start_soon(self._poll, p)  # a newer lease in its answer is taken as gossip would be
        if alive or not self.lease_lapsed():
            log.warning("run %s: the lease of %s looked lapsed here, but %s shows it renewed: not taking over",
                        self.ctx.run_id[:16], t.peer_id[:16], "the DHT" if alive else "a member's answer")
            return True
        return False

    def lease_witnesses(self, t: AssignmentTable) -> list[str]:
        """Up to LEASE_WITNESSES providers to ask about the broker's lease: slot holders first, then backups (the
        table's order, so the same few are asked each time; neither us nor the broker)."""
        states = t.provider_states()
        order = [p for p, s in states.items() if s == ACTIVE] + [p for p, s in states.items() if s == BACKUP]
        return [p for p in order if p not in (self.me, t.peer_id)][:LEASE_WITNESSES]

    async def _dht_lease_alive(self, broker: str) -> bool:
        """A last look before taking over: is there a fresh lease of `broker` in the DHT?"""
        t = self.table
        if t is None:
            return False
        try:
            with trio.move_on_after(self.broker_config.dht_timeout_s):
                raw = await self.ctx.sh.dht.get_value(lease_key(broker))
                if raw:
                    lease = open_envelope(raw, RUN_RECORD_TYPES).record
                    return (isinstance(lease, BrokerLease) and lease.peer_id == broker
                            and lease.lease_epoch >= t.lease_epoch and lease.expires_at > self.ctx.wall()
                            and lease.time > self._lease_issued)  # not one older than a renewal or release seen
        except Exception as e:  # noqa: BLE001
            log.debug("dht lease lookup failed: %s", e)
        return False

    async def _dht_table(self, broker: str) -> None:
        try:
            with trio.move_on_after(self.broker_config.dht_timeout_s):
                raw = await self.ctx.sh.dht.get_value(table_key(broker))
                if raw:
                    self.accept_envelope(raw, broker)
        except Exception as e:  # noqa: BLE001
            log.debug("dht table lookup failed: %s", e)

    async def take_over(self) -> None:
        """Become the broker from the last table we hold, under the next lease epoch: we are its standby and the
        lease has expired, or we are its broker and take back a lease that nobody else took over."""
        assert self.table is not None and self._nursery is not None
        old = self.table.peer_id
        # our own broker stood down in this process (not a restart): the node kept its state, and its slot
        kept = self.local_broker is not None and old == self.me
        b = Broker.from_table(self.ctx, self.broker_config, self.table, secret=self.secret, holder_kept_state=kept)
        self.local_broker = b
        b.on_change.append(lambda t, env: self._accept(t, env, t.peer_id))
        await self._nursery.start(b.run)
        self.ctx.register("run.table", self._rpc_table)  # ours answers for the broker while it holds the lease
        assert b.table is not None  # a broker made from a table publishes its next version at once
        self._accept(b.table, b.table_env, self.me)
        self.takeovers.append(self.ctx.wall())
        log.warning("took over run %s from %s (lease epoch %d)", self.ctx.run_id[:16], old, b.lease_epoch)

    async def release_lease(self, t: AssignmentTable) -> None:
        """Say that the lease of `t`'s epoch, which this node's broker held (in a previous life of the process, or
        before it stood down), is void: a lease signed by us that expires as it is issued. The standby then takes
        over at once rather than when the lease would have run out; it gets the release by gossip, or with our
        table when it polls us (a standby polls the broker), and so do the other members, which accept its
        takeover on the same evidence."""
        now = self.ctx.wall()
        env = seal(BrokerLease(peer_id=self.me, run_id=self.ctx.run_id, lease_epoch=t.lease_epoch, time=now,
                               expires_at=now), self.ctx.sh.key)
        self.accept_envelope(env, self.me)  # ours to serve from now on
        await self.ctx.publish(env)

    async def _settle_lease(self) -> None:
        """This node is named the broker without holding the lease (`orphaned`): never ask ourselves for anything;
        wait for the lease to settle. A standby's takeover shows up as its table (polled here), and is followed; if
        none comes within `takeover_s`, or the table names no standby, take the lease back under the next epoch
        (a restarted node gives up its old place in its slot: it is admitted again, and enters a group with the
        group's state; a broker that stood down in this process keeps its slot and the state it holds)."""
        t = self.table
        if t is None:  # (orphaned: a table names this node)
            return
        deadline = self.clock() + self.takeover_s()
        log.warning("run %s: the table names this node as broker (lease epoch %d) but it holds no lease: waiting up "
                    "to %.0f s for %s to take over", self.ctx.run_id[:16], t.lease_epoch, self.takeover_s(),
                    t.standby or "a standby")
        if t.standby is not None:
            await self.release_lease(t)
        while self.orphaned() and t.standby is not None and self.clock() < deadline:
            await self._follow_standby()
            if self.orphaned():
                await trio.sleep(self.config.retry_s)
        if not self.orphaned():
            return
        log.warning("run %s: nobody took over: taking the lease back", self.ctx.run_id[:16])
        await self.take_over()

    async def _follow_once(self) -> None:
        t = self.table
        if t is None:
            return
        if self.orphaned():
            await self._settle_lease()  # ends following a takeover, or holding the lease again
        elif not self.is_broker():
            if not await self._poll(t.peer_id):
                await self._follow_standby()  # it may have taken over
            if self.lease_lapsed() and not await self._lease_seen_elsewhere():
                await self.take_over()
                return
        if self.admitted and self.evicted():
            self.admitted = False
            log.error("run %s evicted this node: most of its group rejected its updates; the run's brokers will not "
                      "admit it again", self.ctx.run_id[:16])
        elif self.admitted and self.provider_state() in (None, GONE):  # (a broker that took its lease back, too)
            log.warning("the table no longer lists this node as a provider; asking for admission again")
            try:
                await self.admit()
            except (RpcError, AdmissionError) as e:
                log.info("re-admission failed: %s", e)

    async def _admit_until_deadline(self) -> None:
        """Ask for admission until admitted (AdmissionError: refused, at once), retrying an unreachable broker for
        `admit_timeout_s`; meanwhile a takeover by the standby shows up as a new table (gossip or a poll of it)."""
        deadline = self.clock() + max(self.config.admit_timeout_s, self.takeover_s())
        attempt = 0
        while True:
            attempt += 1
            if self.orphaned():
                await self._settle_lease()
            try:
                await self.admit()
                return
            except RpcError as e:
                if self.clock() + self.config.retry_s > deadline:
                    raise RpcError(f"no answer from the run's broker for "
                                   f"{max(self.config.admit_timeout_s, self.takeover_s()):.0f} s ({attempt} attempts): "
                                   f"{e}") from e
                log.info("admission attempt %d failed: %s", attempt, e)
            await trio.sleep(self.config.retry_s)
            await self._follow_standby()

    async def _follow_standby(self) -> None:
        """While the broker does not answer, look for a takeover: the standby's table, by RPC or from the DHT."""
        t = self.table
        if t is not None and t.standby and t.standby != self.me and not await self._poll(t.standby):
            await self._dht_table(t.standby)

    async def _rpc_ping(self, caller: str, body: Any) -> Any:
        return {"ok": True}

    async def _rpc_table(self, caller: str, body: Any) -> Any:
        """The broker's answer while this node's broker holds the lease; otherwise the newest table we follow."""
        broker = self.local_broker
        if broker is not None and not broker.deposed:  # (is_broker())
            return await broker.handle("run.table", caller, body)
        ans: dict[str, Any] = {"table": table_answer(self.table_env, body)}
        if self._lease_env is not None:  # the newest renewal we saw: a standby asks before it takes over
            ans["lease"] = self._lease_env
        return ans

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        self.ctx.register("run.ping", self._rpc_ping)
        self.ctx.register("run.table", self._rpc_table)
        async with trio.open_nursery() as n:
            self._nursery = n
            await self._admit_until_deadline()
            task_status.started(self)
            while True:
                await trio.sleep(self.config.poll_s)
                await self._follow_once()
