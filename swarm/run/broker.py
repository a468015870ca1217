"""The broker: admission, the backup pool, failure detection, promotion, and the signed assignment table it publishes."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterator
from typing import Any

import trio

from shoal.protocol.assignment import (
    ACTIVE, BACKUP, BENCHMARKED, DRAINING, GONE, MAX_EVICTED, MAX_GONE_LISTED, MAX_PROVIDERS, REGISTERED, AdmitRequest,
    AdmitResponse, AssignmentTable, BrokerLease, LaneShare, MissingReport, ProviderEntry, Rollback, RollbackRequest,
    SlotEntry, parse_slot, slot_name)
from shoal.protocol.envelope import seal
from shoal.protocol.tabledelta import make_delta
from shoal.swarm.net.dht_records import lease_key, table_key
from shoal.swarm.net.membership import LEFT
from shoal.swarm.net.rpc import parse_body
from shoal.swarm.run.authority import DELEGATES, RunAuthority
from shoal.swarm.run.batchsplit import BatchSplit
from shoal.swarm.run.brokerconfig import BrokerConfig
from shoal.swarm.run.closes import ClosedConnections
from shoal.swarm.run.context import Handler, RunContext
from shoal.swarm.run.directory import seal_advert
from shoal.swarm.run.gate import AdmissionGate
from shoal.swarm.run.placer import Placer, Seats
from shoal.swarm.run.reports import Reports
from shoal.swarm.run.seating import Provider, Seating
from shoal.swarm.run.tablerpc import table_answer

log = logging.getLogger(__name__)

NEW_BACKUP = 1 << 30  # a newly admitted backup's place: after every backup a taken-over table listed


class AdmissionError(RuntimeError):
    """Admission was refused; the message says why (wrong run, no secret, not on the allowlist, run full)."""


class NotBroker(RuntimeError):
    """This node's broker does not hold the run's lease (any more): ask the broker the newest table names."""


class Broker:
    """Runs on the broker node. Start with `await nursery.start(broker.run)`; the table is `broker.table`.

    Who sits where follows `seating.Seating`'s rules (slots, backups, whole lanes); the broker admits providers
    (through its `gate`), notices failures and leaves, keeps the group epochs and switch steps, and publishes the
    signed table under its lease. A change of one stage's group changes every stage's epoch when the run has
    several stages (lane completeness decides every stage's group)."""

    def __init__(self, ctx: RunContext, config: BrokerConfig = BrokerConfig(), *, lease_epoch: int = 0,
                 version: int = 0, secret: str | None = None, resume: tuple[int, dict[str, str]] | None = None):
        """`resume`: (step, slot name -> peer id): a stopped run going on from its checkpoints at `step`; every slot's
        group takes effect there, and each slot is kept for the peer that wrote its checkpoint until training
        begins (docs/checkpoints.md)."""
        self.ctx = ctx
        self.config = config
        self.clock = ctx.clock
        plan = ctx.manifest.plan
        self.stages, self.replicas = plan.stages, plan.lanes_max  # lane indices 0 .. lanes_max - 1
        self.lease_epoch = lease_epoch
        self.version = version
        self.epochs = [0] * self.stages
        self.switch_steps = [0] * self.stages
        self.providers: dict[str, Provider] = {}
        self.placer = ctx.placer if ctx.placer is not None else Placer()
        self.seating = Seating(ctx, self.providers, dissolve_after_s=config.dissolve_after_s, placer=self.placer)
        self.replans = 0  # moves to a better placement applied
        self._replan_now = trio.Event()  # providers joined or left: re-plan soon
        self.split = BatchSplit(ctx.manifest.global_batch, ctx.manifest.batch_granule, config.split, self.clock)
        self.standby: str | None = None
        self._order = itertools.count()
        self.table: AssignmentTable | None = None
        self.table_env: bytes = b""
        self.lease_env: bytes = b""
        self.deposed = False  # a newer broker took over, or our lease lapsed: stop acting, stop publishing
        self.renewed_at = self.clock()  # the last lease renewal this broker issued (clock seconds)
        self.on_change: list[Callable[[AssignmentTable, bytes], object]] = []  # called with each new table
        self.reforms = 0  # groups re-formed (same members, next epoch) after a member missed a round but answered
        self.reports = Reports(self)  # what members report against each other, weighed (swarm/run/reports.py)
        self.closes = ClosedConnections(self)  # providers whose processes died, from their closed connections
        self._dirty = trio.Event()
        self.authority = RunAuthority(ctx.manifest)
        self.gate = AdmissionGate(ctx, secret, config.admission)  # who may join
        self.delegation_env: bytes | None = None  # the owner's delegation naming this broker and its standby
        self.rollback: Rollback | None = None  # the run's last rollback (docs/snapshots.md)
        self.evicted: dict[str, None] = {}  # peers evicted on a majority verdict, oldest first (docs/broker.md)
        self._seated_since: dict[str, int] = {}  # slot holder -> the step from which it holds its slot's state
        self._start_asks: dict[int, set[str]] = {}  # stage -> members that asked to send the run back to its start
        self._pin_switch = False  # the next rebuild keeps switch_steps as set (a rollback sets them back)
        if resume is not None:
            self.switch_steps = [resume[0]] * self.stages
            self.seating.reserved = {slot: pid for name, pid in resume[1].items()
                                     if (slot := parse_slot(name)) is not None and slot[0] < self.stages
                                     and slot[1] < self.replicas}
        self.handlers: dict[str, Handler] = {"run.admit": self._rpc_admit, "run.challenge": self._rpc_challenge,
                                             "run.table": self._rpc_table,
                                             "run.leave": self._rpc_leave,
                                             "run.report_missing": self._rpc_report_missing,
                                             "run.rollback": self._rpc_rollback}
        self._rebuild()

    def _provider(self, peer_id: str, state: str, **kw: Any) -> Provider:
        return Provider(peer_id, state, next(self._order), last_contact=self.clock(), admitted_unix=self.ctx.wall(),
                        **kw)

    @classmethod
    def from_table(cls, ctx: RunContext, config: BrokerConfig, table: AssignmentTable, *,
                   secret: str | None = None, holder_kept_state: bool = False) -> Broker:
        """The standby's takeover: continue from the last published table under a new lease epoch. The old broker
        is counted failed (its node gives up its slot and is admitted again), except when this is its own process
        taking the lease back (`holder_kept_state`: it stood down, frozen past its lease, and nobody took over):
        its node still holds its slot's state, maybe the run's newest, and stays in its slot as a member frozen
        that long would."""
        b = cls(ctx, config, lease_epoch=table.lease_epoch + 1, version=table.version, secret=secret)
        b.delegation_env = table.delegation
        b.rollback = table.rollback
        b.evicted = dict.fromkeys(table.evicted)
        b.epochs = list(table.epochs)
        b.switch_steps = [table.switch_step(s) for s in range(table.stages)]
        b.split.current = table.lane_shares()
        backups = {pid: i for i, pid in enumerate(table.backups)}
        for pid, state in table.provider_states().items():
            b.providers[pid] = b._provider(pid, state, stage=table.backup_stage(pid) or 0,
                                           score=(backups.get(pid, len(backups)),),
                                           gone_at=b.clock() if state == GONE else 0.0)
        for s in table.slots:
            b.seating.slots[(s.stage, s.replica)] = s.peer_id
            b.providers.setdefault(s.peer_id, b._provider(s.peer_id, ACTIVE)).stage = s.stage
        old = table.peer_id
        if old in b.providers and b.providers[old].state != GONE and not (holder_kept_state and old == ctx.me):
            b.mark_failed(old, "the broker's lease expired")
        b._pick_standby()
        b._rebuild()
        return b

    # -- the table -----------------------------------------------------------------------------------------
    def _rebuild(self) -> None:
        """Seal the current state as a new table version and wake the publisher (never without the lease)."""
        if not self.holds_lease():
            return
        providers = sorted(self.providers.values(), key=lambda p: p.order)
        gone = sorted((p for p in providers if p.state == GONE), key=lambda p: -p.gone_at)
        for p in gone[MAX_GONE_LISTED:]:  # gone providers listed in the table, newest first; older ones forgotten
            del self.providers[p.peer_id]
        providers = [p for p in providers if p.peer_id in self.providers]
        self.version += 1
        prev = self.table
        for s in range(self.stages):
            if prev is not None and prev.epochs[s] != self.epochs[s] and self.ctx.switch_step is not None \
                    and not self._pin_switch:
                self.switch_steps[s] = max(self.switch_steps[s], self.ctx.switch_step(s))
        self._pin_switch = False
        seated = self.seating.slots
        self._seated_since = {pid: self._seated_since.get(pid, self.switch_steps[st]) for (st, _), pid in seated.items()}
        backups = self.seating.backups()
        listed = set(seated.values()) | {p.peer_id for p in backups}
        split = self.split.for_lanes(self.seating.complete_lanes(), self.lane_speeds())
        self.table = AssignmentTable(
            peer_id=self.ctx.me, run_id=self.ctx.run_id, lease_epoch=self.lease_epoch, version=self.version,
            time=self.ctx.wall(), stages=self.stages, replicas=self.replicas, epochs=tuple(self.epochs),
            standby=self.standby,
            slots=tuple(SlotEntry(stage=s, replica=r, peer_id=pid)
                        for (s, r), pid in sorted(self.seating.slots.items())),
            backups=tuple(p.peer_id for p in backups), backup_stages=tuple(p.stage for p in backups),
            providers=tuple(ProviderEntry(peer_id=p.peer_id, state=p.state) for p in providers
                            if p.peer_id not in listed),
            switch_steps=tuple(self.switch_steps), delegation=self.delegation_env, rollback=self.rollback,
            evicted=tuple(self.evicted),
            shares=tuple(LaneShare(replica=r, samples=n) for r, n in sorted(split.items())))
        self.table_env = seal(self.table, self.ctx.sh.key)
        for cb in list(self.on_change):
            try:
                cb(self.table, self.table_env)
            except Exception as e:  # noqa: BLE001 - a listener's bug must not stop the broker
                log.warning("table listener failed: %s: %s", type(e).__name__, e)
        self._dirty.set()

    def _group_changed(self, *stages: int) -> None:
        """A new epoch for each of `stages`' groups (once per mention); with several stages for every stage's (a
        lane's completeness decides each stage's group, so any slot change may change them all)."""
        for stage in stages:
            for s in (range(self.stages) if self.stages > 1 else (stage,)):
                self.epochs[s] += 1

    def lane_speeds(self) -> dict[int, float | None]:
        """Each complete lane's speed (sequences per second): its slowest stage's, as its members' signed status
        records report their own compute; None while a member has reported none."""
        by_lane: dict[int, list[float]] = {}
        unknown: set[int] = set()
        for (stage, lane), pid in self.seating.slots.items():
            st = self.ctx.status_of(pid)
            if st is not None and st.samples_per_s > 0:
                by_lane.setdefault(lane, []).append(st.samples_per_s)
            else:
                unknown.add(lane)
        return {lane: None if lane in unknown else min(by_lane[lane]) for lane in unknown | set(by_lane)}

    def _resplit(self) -> bool:
        """With the same lanes, a split by their speeds that shortens the step enough (BatchSplit.better): it takes
        effect at a switch step every member can still reach, as a group change does, but the groups stay (same
        members, same epoch: rounds, reports and entries under way are not disturbed). True when it did."""
        if self.ctx.switch_step is None or self.split.better(self.lane_speeds()) is None:
            return False
        for s in range(self.stages):
            self.switch_steps[s] = max(self.switch_steps[s], self.ctx.switch_step(s))
        return True

    def _pick_standby(self) -> None:
        """The standby: the longest-admitted live provider the run's owner authorises as broker. The owner's own
        broker authorises it (and the next candidates, so a successor can name a standby too) by a delegation.
        A suspect provider is not made standby, but the standby stays one while suspect, until it is gone: named
        anew on every missed beat, it flapped under load, and a broker dying between two versions of its table left
        nodes naming different standbys, two of which took over at one lease epoch (test_authority, loaded)."""
        auth, me = self.authority, self.ctx.me
        owner = auth.signed and me == auth.owner

        def fits(p: Provider | None, *, named: bool = False) -> bool:
            return p is not None and p.peer_id != me and p.state in (ACTIVE, BACKUP) and (named or not p.suspect) \
                and (owner or auth.may_broker(p.peer_id, self.delegation_env))

        def in_order() -> Iterator[str]:  # lazily, in admission order: keeping the standby sorts nothing
            yield from (p.peer_id for p in sorted(self.providers.values(), key=lambda p: p.order) if fits(p))

        candidates = in_order()
        if self.standby is None or not fits(self.providers.get(self.standby), named=True):
            self.standby = next(candidates, None)
        if owner and self.standby is not None:
            wanted = tuple([self.standby] + list(itertools.islice((c for c in candidates if c != self.standby),
                                                                  DELEGATES - 1)))
            d = auth.delegation(self.delegation_env)
            if d is None or d.brokers != wanted:
                self.delegation_env = auth.issue(self.ctx.sh.key, wanted, self.ctx.wall())

    # -- admission -----------------------------------------------------------------------------------------
    async def admit(self, peer_id: str, req: AdmitRequest) -> AdmitResponse:
        """Check the join policy, then place `peer_id` in a free slot or in the backup pool."""
        if not self.holds_lease():
            raise NotBroker("this node's broker does not hold the run's lease")
        why = await self.gate.refusal(peer_id, req)
        if why is None and peer_id in self.evicted:
            why = "evicted from this run: its updates were rejected by a majority of its group"
        if why is not None:
            if self.ctx.penalties is not None and peer_id != self.ctx.me:
                self.ctx.penalties.penalize(peer_id, f"admission refused: {why}")
            log.info("refused %s: %s", peer_id, why)
            return AdmitResponse(admitted=False, error=why)
        p = self.providers.get(peer_id)
        if p is not None and p.state in (ACTIVE, BACKUP):  # a retry, or a restart: it keeps its place
            p.last_contact, p.hardware = self.clock(), req.hardware
            self._reenter(p)
            return self._answer(p)
        if sum(1 for q in self.providers.values() if q.state != GONE) >= MAX_PROVIDERS:
            return AdmitResponse(admitted=False, error="the run has no room for more providers")
        # backups are promoted in admission order (after those a taken-over table listed): the hardware a provider
        # reports is its own word, so it may decide what fits it, never whom it jumps in the queue
        p = self._provider(peer_id, REGISTERED, hardware=req.hardware, score=(NEW_BACKUP,))
        self.providers[peer_id] = p
        p.state = BENCHMARKED  # the profile carries the node's measured compute and memory
        free = self.seating.seat(p, backup_only=req.backup_only)
        self._replan_now.set()
        if free is not None:
            self._group_changed(free[0])
        else:
            self._group_changed(*self.seating.grow(self.table))  # a one-stage run seats it in a new lane at once
        self._pick_standby()
        self._rebuild()
        slot = self.seating.slot_of(peer_id)
        log.info("admitted %s as %s", peer_id, slot_name(*slot) if slot else f"backup of stage {p.stage}")
        return self._answer(p)

    def _reenter(self, p: Provider) -> None:
        """A provider that asks for admission holds no state yet (it just started, or restarted with its identity).
        In a slot whose group took effect at a step the run has passed, it could never catch up: re-form its group
        so that it enters at a step still ahead, with the group's state. It holds the stage's state from that entry
        on, not from when it was first seated (what a rollback of its stage is checked against)."""
        if p.state != ACTIVE:
            return
        if self.ctx.switch_step is not None and self.ctx.switch_step(p.stage) > self.switch_steps[p.stage]:
            self.reform(p.stage, f"{p.peer_id[:16]}… (re)started in its slot and enters again")
        self._seated_since[p.peer_id] = self.switch_steps[p.stage]

    def _answer(self, p: Provider) -> AdmitResponse:
        slot = self.seating.slot_of(p.peer_id)
        return AdmitResponse(admitted=True, state=p.state, slot=slot_name(*slot) if slot else None,
                             table=self.table_env)

    # -- failures and leaves -------------------------------------------------------------------------------
    def mark_failed(self, peer_id: str, reason: str, *, state: str = GONE) -> bool:
        """Take `peer_id` out of its slot (promoting the best backup) or out of the pool. True if anything changed."""
        p = self.providers.get(peer_id)
        if p is None or p.state == GONE or (p.state == DRAINING and state == DRAINING) or not self.holds_lease():
            return False
        log.warning("provider %s %s: %s", peer_id, {DRAINING: "draining", BACKUP: "moved to the backup pool"}.get(
            state, "failed"), reason)
        p.state = state
        p.gone_at = self.clock() if state == GONE else 0.0
        self._group_changed(*self.seating.vacate(peer_id, self.table))
        self._replan_now.set()
        if state == GONE:
            self.placer.forget(peer_id)
        if self.standby == peer_id:
            self.standby = None
        self._pick_standby()
        self._rebuild()
        return True

    def touch(self, peer_id: str) -> None:
        p = self.providers.get(peer_id)
        if p is not None:
            p.last_contact = self.clock()

    def _silent_s(self, p: Provider) -> tuple[float, bool]:
        """Seconds since we last heard from `p` (RPC contact or status gossip, on the shared clock; silence across
        this process's own freeze does not count), and whether it said goodbye."""
        last, left = p.last_contact, False
        m = self.ctx.membership
        e = m.peers.get(p.peer_id) if m is not None else None
        if e is not None:
            left = e.state == LEFT and e.left_at_unix >= p.admitted_unix
            last = max(last, e.last_seen)
        return self.ctx.silent_s(last), left

    def heard_since(self, peer_id: str, t: float) -> bool:
        """Whether `peer_id` was heard from (RPC contact, or its status gossip by any path) after `t` (clock time)."""
        p = self.providers.get(peer_id)
        m = self.ctx.membership
        e = m.peers.get(peer_id) if m is not None else None
        return p is not None and max(p.last_contact, e.last_seen if e is not None else float("-inf")) > t

    def check_liveness(self) -> None:
        if not self.holds_lease():
            return
        for p in list(self.providers.values()):
            if p.peer_id == self.ctx.me or p.state == GONE:
                continue
            silent, left = self._silent_s(p)
            if left:  # (marking one failed publishes a new table itself)
                self.mark_failed(p.peer_id, "left the swarm")
            elif silent > self.config.fail_after_s:
                self.mark_failed(p.peer_id, f"silent for {silent:.1f} s")
            else:
                suspect = silent > self.config.suspect_after_beats * self.config.heartbeat_s
                if suspect != p.suspect:
                    p.suspect = suspect
                    log.info("provider %s %s", p.peer_id, "suspect" if suspect else "back")
        old_standby = self.standby
        changed = self.seating.fill_free_slots(self.table)
        changed += self.seating.grow(self.table)
        if self.stages > 1:
            changed += self.seating.dissolve_stale_lanes()
        self._group_changed(*changed)
        resplit = not changed and self._resplit()
        self._pick_standby()
        if changed or resplit or self.standby != old_standby:
            self._rebuild()

    # -- RPC -----------------------------------------------------------------------------------------------
    async def handle(self, method: str, caller: str, body: Any) -> Any:
        """Answer `method` for `caller` (the RPC server does this for remote callers; the client for its own node)."""
        return await self.handlers[method](caller, body)

    async def _rpc_admit(self, caller: str, body: Any) -> Any:
        return (await self.admit(caller, parse_body(AdmitRequest, body))).to_wire()

    async def _rpc_challenge(self, caller: str, body: Any) -> Any:
        if not self.holds_lease():
            raise NotBroker("this node's broker does not hold the run's lease")
        if not isinstance(body, dict) or body.get("run_id") != self.ctx.run_id:
            raise ValueError("a challenge is asked for this broker's run")
        return {"nonce": self.gate.challenge(caller)}

    async def _rpc_table(self, caller: str, body: Any) -> Any:
        """The table, and the lease while we hold it (only a live lease is evidence that this broker renews)."""
        self.touch(caller)
        return {"table": table_answer(self.table_env, body), "lease": self.lease_env if self.holds_lease() else None}

    async def _rpc_leave(self, caller: str, body: Any) -> Any:
        """A graceful leave: the caller drains (finishes its step, serves its state) while a backup takes its slot."""
        if not self.holds_lease():
            raise NotBroker("this node's broker does not hold the run's lease")
        self.mark_failed(caller, "leaving", state=DRAINING)
        return {"table": self.table_env}

    async def _rpc_report_missing(self, caller: str, body: Any) -> Any:
        rep = parse_body(MissingReport, body)
        table = self.table
        if table is None or not self.holds_lease():  # (a broker holding its lease has published a table)
            raise NotBroker("this node's broker does not hold the run's lease")
        return await self.reports.weigh(caller, rep, table)

    async def _rpc_rollback(self, caller: str, body: Any) -> Any:
        req = parse_body(RollbackRequest, body)
        if not self.holds_lease():
            raise NotBroker("this node's broker does not hold the run's lease")
        if req.source == "start" and self.table is not None and caller in self.table.members(req.stage):
            self._start_asks.setdefault(req.stage, set()).add(caller)
        why = self.rollback_refusal(caller, req)
        if why is not None:
            log.info("rollback to revision %d asked by %s refused: %s", req.revision, caller[-8:], why)
            return {"accepted": False, "error": why}
        r, table = self.rollback, self.table
        if r is None or table is None or (r.revision, r.stage) != (req.revision, req.stage) or \
                any(self._seated_since.get(p) != req.revision for p in table.members(req.stage)):
            r = self.roll_back(req.stage, req.revision, req.source)
        return {"accepted": True, "count": r.count}

    def rollback_refusal(self, caller: str, req: RollbackRequest) -> str | None:
        """Why `caller` may not send the run back to `req.revision` (None: it may). Only a holder of a slot of the lost
        stage may ask, and only while every holder of that stage came after the revision (none of them trained the
        stage's state through it: it must come from shards or disk), for a revision the run has reached. Back to the
        run's start (all its progress) only when most of the stage's members asked."""
        if req.run_id != self.ctx.run_id or req.stage >= self.stages:
            return "another run, or a stage outside the plan"
        members = self.table.members(req.stage) if self.table is not None else ()
        if caller not in members:
            return f"the caller holds no slot of stage {req.stage}"
        r = self.rollback
        if r is not None and (r.revision, r.stage) == (req.revision, req.stage) and \
                all(self._seated_since.get(p) == req.revision for p in members):
            return None  # asked again (a retry, or another replacement of the stage): already so
        if req.revision > max(self.switch_steps):
            return f"revision {req.revision} is past every step the run has reached"
        if any(self._seated_since.get(p, 0) <= req.revision for p in members):
            return f"stage {req.stage} still has a member that holds its state at revision {req.revision}"
        if req.source == "start":  # all the progress goes: not on one member's word
            if req.revision != 0:
                return "a rollback to the run's start goes to revision 0"
            asked, need = len(self._start_asks.get(req.stage, set()) & set(members)), len(members) // 2 + 1
            if asked < need:
                return (f"{asked} of the {len(members)} members of stage {req.stage} found it lost; going back to "
                        f"the run's start takes {need}")
        return None

    def roll_back(self, stage: int, revision: int, source: str) -> Rollback:
        """Send the run back to `revision`: every stage's group takes effect there again (next epoch), and every slot
        holder loads its own state at it."""
        r = self.rollback = Rollback(count=(self.rollback.count if self.rollback else 0) + 1, revision=revision,
                                     source=source, stage=stage)
        self.switch_steps = [revision] * self.stages
        self._group_changed(*range(self.stages))
        self._pin_switch = True
        self._seated_since = {pid: revision for pid in self._seated_since}
        self._start_asks.clear()
        log.warning("stage %d was lost: the run rolls back to revision %d (from %s; rollback %d)", stage, revision,
                    source, r.count)
        self._rebuild()
        return r

    def evict(self, peer_id: str, why: str) -> None:
        """Out of the run for good on a majority verdict: banned, listed in the table (refused admission by this
        broker and its successors), its slot to a backup."""
        if self.ctx.penalties is not None:
            self.ctx.penalties.ban(peer_id, why)
        self.evicted.pop(peer_id, None)
        self.evicted[peer_id] = None
        while len(self.evicted) > MAX_EVICTED:
            del self.evicted[next(iter(self.evicted))]
        if not self.mark_failed(peer_id, why):
            self._rebuild()  # (already gone: the table lists the eviction all the same)

    def missed_round(self, peer_id: str, stage: int, why: str) -> None:
        """A member missed a round yet answers: re-form its group, or, once it has missed `straggler_misses` rounds
        within the window and a backup of its stage can take its place, move it to the backup pool and hold it
        there for `demote_hold_s`."""
        p = self.providers.get(peer_id)
        if p is not None and self._straggler(p) and self.seating.promotable(stage):
            p.hold_until = self.clock() + self.config.demote_hold_s
            self.mark_failed(peer_id, f"{why}: {len(p.misses)} times in {self.config.straggler_window_s:.0f} s",
                             state=BACKUP)
        else:
            self.reform(stage, why)

    def _straggler(self, p: Provider) -> bool:
        """Count one more missed round; True once it has missed `straggler_misses` within the window."""
        now = self.clock()
        p.misses = [t for t in p.misses if now - t <= self.config.straggler_window_s] + [now]
        return len(p.misses) >= self.config.straggler_misses

    def reform(self, stage: int, reason: str) -> None:
        """The same members under the next epoch, from a step every member can still reach."""
        if not self.holds_lease():
            return
        self._group_changed(stage)
        self.reforms += 1
        log.info("re-forming the group of stage %d (epoch %d): %s", stage, self.epochs[stage], reason)
        self._rebuild()

    # -- tasks ---------------------------------------------------------------------------------------------
    def stand_down(self, reason: str) -> None:
        if not self.deposed:
            log.warning("broker standing down: %s", reason)
        self.deposed = True
        self._dirty.set()  # the publisher wakes and ends

    def holds_lease(self) -> bool:
        """Whether this broker may act: it is not deposed and renewed its lease within `lease_timeout_s` (monotonic
        time on the run's clock). A process frozen past its lease (SIGSTOP, a suspended laptop) finds out here,
        before it acts on anything, and stands down for good: a standby may hold the lease by now, and the lease
        record decides, not this broker's tables. (It checks before renewing too, so it never renews a lapsed
        lease; the standby counts from when a renewal reaches it, which is later, so this side notices first.)"""
        if self.deposed:
            return False
        idle = self.clock() - self.renewed_at
        if idle > self.config.lease_timeout_s:
            self.stand_down(f"its lease lapsed: last renewed {idle:.1f} s ago "
                            f"(the lease lasts {self.config.lease_timeout_s:g} s)")
            return False
        return True

    async def _put_dht(self, key: str, value: bytes) -> None:
        try:
            with trio.move_on_after(self.config.dht_timeout_s):
                await self.ctx.sh.dht.put_value(key, value)
        except Exception as e:  # noqa: BLE001 - the DHT copy is a fallback; gossip and RPC carry it too
            log.info("dht put %s failed: %s", key, e)

    async def _lease_loop(self) -> None:
        """Renew the lease every `lease_renew_s` by gossip (the DHT copy is written by `_lease_dht_loop`, whose
        slow puts must not delay a renewal)."""
        while self.holds_lease():
            await self.ctx.publish(self.renew_lease())
            await trio.sleep(self.config.lease_renew_s)

    def renew_lease(self) -> bytes:
        """Issue the next renewal of our lease (the caller made sure we still hold it); its sealed envelope."""
        now = self.ctx.wall()
        lease = BrokerLease(peer_id=self.ctx.me, run_id=self.ctx.run_id, lease_epoch=self.lease_epoch, time=now,
                            expires_at=now + self.config.lease_timeout_s)
        self.renewed_at = self.clock()
        self.lease_env = seal(lease, self.ctx.sh.key)
        return self.lease_env

    async def _lease_dht_loop(self) -> None:
        written = b""
        while self.holds_lease():
            if self.lease_env != written:
                written = self.lease_env
                await self._put_dht(lease_key(self.ctx.me), written)
            await trio.sleep(self.config.lease_renew_s)

    def advert(self) -> bytes | None:
        """The sealed advert of this run (swarm/run/directory.py): its manifest, lanes now and still free, backups,
        providers and the furthest step its members report (None: an unsigned run is not advertised)."""
        t = self.table
        lanes = len(t.complete_lanes()) if t is not None else 0
        live = [p for p in self.providers.values() if p.state != GONE]
        steps = [st.step for p in live if (st := self.ctx.status_of(p.peer_id)) is not None]
        return seal_advert(self.ctx.sh.key, self.ctx.manifest, broker=self.ctx.me, wall=self.ctx.wall(),
                           delegation=self.delegation_env, lanes=lanes,
                           free_lanes=max(self.ctx.manifest.plan.lanes_max - lanes, 0),
                           backups=sum(p.state == BACKUP for p in live), providers=len(live),
                           step=max(steps, default=0))

    async def _publish_loop(self) -> None:
        sent = b""  # the table last gossiped: a change goes out as a delta from it when that is much shorter
        put, put_at = b"", -float("inf")  # the table last written to the DHT, and when
        while self.holds_lease():
            self._dirty = trio.Event()
            env = self.table_env
            delta = make_delta(sent, env, self.ctx.sh.key) if sent and env != sent else None
            await self.ctx.publish(delta if delta is not None else env)  # unchanged: the whole table, re-gossiped
            sent = env
            ad = self.advert()
            if ad is not None:
                await self.ctx.publish(ad)
            if env != put and self.clock() - put_at >= self.config.dht_table_s:
                put, put_at = env, self.clock()
                await self._put_dht(table_key(self.ctx.me), env)
            with trio.move_on_after(self.config.republish_s):
                await self._dirty.wait()

    async def _liveness_loop(self) -> None:
        while self.holds_lease():
            await trio.sleep(self.config.heartbeat_s)
            self.check_liveness()

    def seats(self) -> Seats:
        """The seating as a re-plan sees it: slots, the backups that may be promoted, the steps left."""
        m = self.ctx.manifest
        done = self.ctx.switch_step(0) if self.ctx.switch_step is not None else 0
        backups = [b.peer_id for b in self.seating.backups() if not b.suspect and b.hold_until <= self.clock()]
        return Seats(dict(self.seating.slots), backups, self.stages, self.replicas,
                     max(0, m.optim.total_steps - done))

    async def replan_once(self) -> bool:
        """One re-plan: the placer plans on a snapshot of the seats in a worker thread (bounded by its time
        budget); a move it proposes is applied here, if the seats did not change meanwhile, as one seating change
        (new group epochs, a switch step, a new table). True if providers moved."""
        if self.ctx.switch_step is not None and self.ctx.switch_step(0) == 0:
            # no step done yet: a change now would take effect at step 0, which members may already be running
            # (they would pass its switch step in their old slots); moves wait for the first step
            return False
        seats = self.seats()
        job = self.placer.prepare(seats)
        if job is None:
            return False
        change = await trio.to_thread.run_sync(self.placer.decide, job)
        if self.placer.last:
            last = self.placer.last
            log.info("placement: %.4g s per step predicted now, %.4g s planned (moving costs %.3g s): %s",
                     last["now_s"], last["target_s"], last["migration_s"], last["why"])
        if change is None or not self.holds_lease():
            return False
        expected = {k: seats.slots[k] for k in change.assign if k in seats.slots}
        changed = self.seating.apply(change, expected)
        if not changed:
            return False
        self.placer.moved(change)
        self.replans += 1
        self._group_changed(*changed)
        self._pick_standby()
        self._rebuild()
        return True

    async def _replan_loop(self) -> None:
        """Re-plan every check period, and soon (a few seconds) after providers join or leave."""
        every = self.placer.check_s
        if every is None:
            return  # a placer that never moves anyone
        while self.holds_lease():
            with trio.move_on_after(every):
                await self._replan_now.wait()
                await trio.sleep(min(every, self.config.heartbeat_s))  # let a burst of joins settle
            self._replan_now = trio.Event()
            try:
                await self.replan_once()
            except Exception as e:  # noqa: BLE001 - a planner's bug must not stop the broker
                log.warning("re-plan failed: %s: %s", type(e).__name__, e)

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        for method, handler in self.handlers.items():
            self.ctx.register(method, handler)
        async with trio.open_nursery() as n:
            n.start_soon(self._lease_loop)
            n.start_soon(self._lease_dht_loop)
            n.start_soon(self._publish_loop)
            n.start_soon(self._liveness_loop)
            n.start_soon(self._replan_loop)
            n.start_soon(self.closes.run)
            log.info("broker for run %s (lease epoch %d)", self.ctx.run_id[:16], self.lease_epoch)
            task_status.started(self)
