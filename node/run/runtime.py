"""A node's part in a training run: setting it up, the step loop and its tables, one step (what it publishes of
the run: node/run/published.py).

The loop runs on the event loop and owns every piece of run state (tables, snapshots, hashes). Each training step
is one `StepControl`: the loop plans it (step number, the round's group), the trainer runs it in a worker thread,
and the loop reads back the result, the state hash and what the synchronizer learned about other members, then
acts on it (reports to the broker, votes). Nothing in the trainer thread calls back into the loop.

Group changes take effect at the step the broker names in the table (`switch_steps`), so every member changes its
group at the same round boundary. Entering a group (node/run/entry.py) loads exactly the revision of the switch
step; replicas compare state hashes after every round and a minority replica re-fetches from the majority
(node/run/consistency.py). The node is seen only through `NodeServices` (node/run/context.py).
"""

from __future__ import annotations

import contextlib
import logging
import math
from pathlib import Path
from typing import Any

import trio

from shoal.node.run.checkpoints import CheckpointWriter
from shoal.node.run.config import RunConfig
from shoal.node.run.consistency import Consistency
from shoal.node.run.context import NodeServices
from shoal.node.run.entitled import MAX_STEP_LEAD, Entitlement
from shoal.node.run.entry import READY_POLL_S, Entry
from shoal.node.run.find import fetch_manifest, find_table, serve_manifest
from shoal.node.run.lanes import StageLinks
from shoal.node.run.files import RunFiles
from shoal.node.run.preflight import NotTheOwner, check_inputs, data_source, preflight
from shoal.node.run.published import run_detail, run_status
from shoal.node.run.pulls import StatePulls
from shoal.node.run.recovery import StageRecovery
from shoal.node.run.replica import Replica
from shoal.node.run.resolve import RunFinder
from shoal.node.run.shards import StageShards
from shoal.node.run.snapshots import SnapshotStore
from shoal.node.run.status import Contribution, RunDetail
from shoal.node.run.verified import Checks, VerifiedStage
from shoal.node.run.verify import StageVerifier
from shoal.node.run.votes import MIN_VOTERS
from shoal.node.run.workload import make_placer
from shoal.node.sync.base import SyncConfig
from shoal.node.train.batch import StepBatch
from shoal.node.train.control import StepControl
from shoal.protocol.assignment import GONE, AssignmentTable, Rollback
from shoal.protocol.lane import FWD, LinkHello
from shoal.protocol.manifest import RunManifest
from shoal.protocol.records import HardwareProfile, RunStatus
from shoal.swarm.lane.hub import open_link_hub
from shoal.swarm.lane.spec import LinkConfig
from shoal.swarm.net.rpc import call
from shoal.swarm.run.broker import AdmissionError, Broker
from shoal.swarm.run.client import RunClient
from shoal.swarm.run.collective import Collective
from shoal.swarm.run.collective_gate import CollectiveGate, inbox_limits
from shoal.swarm.run.group import Group
from shoal.swarm.run.timeline import GroupTimeline
from shoal.swarm.state.snapshot import Snapshot
from shoal.swarm.state.transfer import StateServer

log = logging.getLogger(__name__)

START_POLL_S = 0.5  # a new run's first members re-check whether the group is full this often
RECENT_SAMPLES = 64  # steps whose share this node keeps for its status file
PROGRESS_EVERY_S = 1.0  # how often the furthest step the run reached is noted (RunRuntime._reached)


class ResumeError(RuntimeError):
    """--resume names a folder without a checkpoint of every stage of the run."""


class RunRuntime:
    """Owned by a Node: `await nursery.start(runtime.run, joined_peers)`; `status()` for its status record."""

    def __init__(self, services: NodeServices, config: RunConfig, hardware: HardwareProfile):
        self.services = services
        self.config = config
        self.manifest: RunManifest | None = config.manifest
        self.data_source: str | None = None  # where the trainer reads tokens (preflight.data_source)
        self.hardware = hardware
        self.clock = services.clock
        self.replica = Replica(config, services.penalties)
        self.snapshots = SnapshotStore(every_steps=config.snapshot_every_steps)
        self.pulls = StatePulls(services, config, self.snapshots,
                                evicted=lambda: self.client.table.evicted if self.client and self.client.table else ())
        self.consistency = Consistency(services, config, self.replica, self.pulls, self.node_call,
                                       run_id=lambda: self._manifest().run_id, report=self._report_offenders)
        self.timeline = GroupTimeline(services.peer_id)
        self.entitled = Entitlement(lambda: self.client.table if self.client is not None else None, self.clock)
        self.finder = RunFinder(services.sh, services.directory, clock=self.clock,
                                rpc_timeout_s=config.client.rpc_timeout_s)  # a run to join, by its advert
        self.contribution = Contribution()  # what this node computed into applied steps
        self.step_samples: dict[int, int] = {}  # step -> sequences this lane computed, the last RECENT_SAMPLES
        # made in `run`, once the manifest is known:
        self.client: RunClient | None = None
        self.broker: Broker | None = None
        self.collective: Collective | None = None
        self.links: StageLinks | None = None  # a pipeline stage's links to its lane neighbours (several stages)
        self.verified: VerifiedStage | None = None  # a pipeline stage's part in verified stages (several stages)
        self.entry: Entry | None = None
        self.files: RunFiles | None = None  # the files the run names by hash (weights, tokenizer)
        self.recovery: StageRecovery | None = None  # checkpoints, shards, rollbacks (node/run/recovery.py)
        self._rolled = 0  # the count of the newest rollback this node applied
        # the furthest step the run is known to have reached: where a change takes effect never goes back before it
        # (every member that had trained there may have restarted without its state), but for a rollback
        self._reached = 0
        self._progress_at = -math.inf
        self.error: str | None = None
        self.finished = trio.Event()
        self._start_deadline = 0.0
        self._abandoned: dict[int, int] = {}  # stage -> the newest group epoch this node left when counted failed
        self._stepping: tuple[int, Group] | None = None  # the step in progress and its group
        self._token: trio.lowlevel.TrioToken | None = None
        self._nursery: trio.Nursery | None = None

    def _manifest(self) -> RunManifest:
        assert self.manifest is not None, "the run's manifest is known once run() started"
        return self.manifest

    @property
    def warm(self) -> Snapshot | None:
        return self.snapshots.warm

    # -- what the node publishes ---------------------------------------------------------------------------
    def status(self) -> RunStatus:
        """What this node's status record says about the run (checked as it is built)."""
        return run_status(self)

    def detail(self) -> RunDetail:
        """What the node's status file adds about the run."""
        return run_detail(self)

    # -- groups by step ------------------------------------------------------------------------------------
    def _on_table(self, table: AssignmentTable) -> None:
        if self.timeline.add(table):
            for step in self.timeline.switch_steps(table):
                self.snapshots.request(step)
            if self.entry is not None:
                self.entry.ask_to_keep(table)
            if StageRecovery.rollback_due(table, self._rolled) is not None and self.links is not None:
                # a step still waiting on a lane neighbour that is gone would hold the rollback up until its
                # deadline: the links go now (the rollback reopens them), and the step is given up at once
                self._nursery.start_soon(self.links.close)
            if table.provider_state(self.services.peer_id) == GONE and self.replica.at_step > 0:
                self._abandon(self.group_at(self.replica.at_step))
            self._count_out_failed(table)
            if self._stepping is not None and self.collective is not None \
                    and self._superseded(*self._stepping):
                # a table that re-formed our group at a step we are already in (it reached us late): the round in
                # flight waits for members that are elsewhere; it ends now, and the step is caught up with
                # (Entry.caught_late)
                self.collective.give_up(self._stepping[1].epoch_tag())

    def _count_out_failed(self, table: AssignmentTable) -> None:
        """Members of our group now that `table` counts failed are not waited for in its rounds: they leave it (a
        frozen one, once it wakes, sees the table and abandons the group), so a round waiting for one would wait
        for its deadline (docs/architecture.md, "Failure is data")."""
        if self.collective is None or self.replica.trainer is None:
            return
        groups = {self.group_at(self.replica.at_step), self._stepping[1] if self._stepping is not None else None}
        for g in groups - {None}:
            gone = {m for m in g.members if m != g.me and table.provider_state(m) == GONE}
            if gone:
                self.collective.count_out(g.epoch_tag(), gone)

    async def _abstain(self, group: Group, step: int) -> None:
        """Tell `group`'s other members that this node, which was to enter it at `step`, will not."""
        if self.collective is not None:
            log.info("telling the %d other members of stage %d's epoch %d that this node will not enter it at step %d",
                     group.size - 1, group.stage, group.epoch, step)
            await self.collective.abstain(group.epoch_tag(), step, set(group.members))

    def _superseded(self, step: int, group: Group) -> bool:
        """Whether the tables this node holds now give its stage another group epoch at `step` than `group`."""
        now = self.timeline.group_at(step, group.stage)
        return now is None or now.epoch != group.epoch

    def _abandon(self, group: Group | None) -> None:
        """The broker counts this node failed (it was frozen, or cut off) while it held `group`: the group goes on
        without it, so it never trains that group's remaining steps (they would be its own, served to nobody
        good); it waits to be placed again and then enters with the group's state."""
        if group is not None and group.epoch > self._abandoned.get(group.stage, -1):
            self._abandoned[group.stage] = group.epoch
            log.warning("the run counts this node failed: leaving the group of stage %d (epoch %d) at step %d",
                        group.stage, group.epoch, self.replica.at_step)

    def _group_to_train(self, step: int) -> Group | None:
        g = self.group_at(step)
        return None if g is not None and g.epoch <= self._abandoned.get(g.stage, -1) else g

    def group_at(self, step: int) -> Group | None:
        """The group of the trainer's stage at `step` (a node the newest table moves to another stage trains on in
        its old stage until the switch step; docs/placement.md, "Moving an active node")."""
        t = self.replica.trainer
        return self.timeline.group_at(step, t.stage if t is not None else None)

    def switch_step(self, stage: int) -> int:
        """Where a group change can take effect: the furthest step anyone reports (or this node saw reported before:
        members that restarted report less), plus ~switch_lead_s of steps (every stage of a run steps together, so
        the same bound serves each)."""
        m = self._manifest()
        steps = self._progress()
        top = self._reached
        if top == 0 and not self._begun(m.run_id):
            return 0  # nothing trained yet, nor under way: the change can apply from the start
        t = self.timeline.table_at(top, stage)
        if t is not None and len(t.complete_lanes()) < m.plan.lanes_min:
            return top  # below its minimum the run waits at `top`: the change applies there
        tps = max((r for _, r in steps), default=0.0)
        lanes = max(len(t.complete_lanes()), 1) if t is not None else m.plan.replicas
        per_step = m.global_batch * m.batch.seq_len / lanes  # a lane's tokens, on average
        th = self.replica.throughput
        own = th.steps_per_s() if th is not None else 0.0
        rate = max(tps / per_step, own) if tps > 0 or own > 0 else 1.0
        return top + max(self.config.switch_lead_min_steps, math.ceil(self.config.switch_lead_s * rate))

    def _progress(self) -> list[tuple[int, float]]:
        """(step, tokens/s) of this node and of the run's members, clamped (node/run/entitled.py), noting the
        furthest step among them in `_reached`."""
        r = self.replica
        own_rate = r.throughput.tokens_per_s(r.last.tokens_per_s) \
            if r.throughput is not None and r.last is not None else 0.0
        steps = self.entitled.progress(r.at_step, self._manifest().run_id, self.services.statuses(), own_rate)
        self._reached = max(self._reached, max(s for s, _ in steps))
        self._progress_at = self.clock()
        return steps

    def _begun(self, run_id: str) -> bool:
        """Whether this node, or a member by its status, is training the run: step 0 may be under way (its status
        says step 0 until it is done), so a change placed at step 0 would reach the members after they began it."""
        return self.replica.state == "training" or any(
            st.run_id == run_id and st.state == "training" and self.entitled.member(p)
            for p, st in self.services.statuses())

    def _lane_named(self, peer: str, hello: LinkHello) -> bool:
        """Whether the tables this node follows (in force from the step before ours, or announced) name `peer` at
        the dialing end of `hello`'s link and this node at the other (swarm/lane/hub.py asks, for every dial)."""
        lower, upper = hello.boundary, hello.boundary + 1
        dialer, mine = (lower, upper) if hello.direction == FWD else (upper, lower)
        return self.timeline.names_on_lane(peer, dialer, hello.lane, mine, max(0, self.replica.at_step - 1))

    def _group_full(self) -> bool:
        t = self.timeline.latest
        return t is not None and all(len(t.members(s)) >= self._manifest().plan.replicas for s in range(t.stages))

    # -- state between nodes -------------------------------------------------------------------------------
    async def _rpc_snapshot_at(self, caller: str, body: Any) -> Any:
        if not isinstance(body, int) or isinstance(body, bool) or body < 0:
            raise ValueError("snapshot_at takes a step number")
        refusal = self.entitled.snapshot_refusal(caller, body, self.replica.at_step)
        if refusal is not None:
            if refusal[1]:
                self.services.penalties.penalize(caller, f"snapshot_at: {refusal[0]}")
            raise ValueError(f"snapshot_at refused: {refusal[0]}")
        self.snapshots.request(body)
        return {"ok": True, "step": self.replica.at_step}

    def _may_hold(self, revision: int) -> bool:
        """Whether this node may still come to hold `revision` by its own training: it is training (or waiting, with
        its group below the run's minimum of lanes, to train on from where it stands) and not past it. Otherwise (it
        passed it without keeping it; a backup, a restarted node, a node entering or re-fetching the group's state,
        which would only echo what the others hold) its state server tells a puller it has no say about that
        revision, so an entry never waits on a member that cannot answer (docs/architecture.md, "Entering a
        group")."""
        r = self.replica
        return r.trainer is not None and r.state in ("training", "waiting") and r.at_step <= revision

    async def _build(self, stage: int, replica: int) -> None:
        assert self.collective is not None and self._token is not None and self.files is not None
        assert self.data_source is not None
        m = self._manifest()
        files = await self.files.fetch(self.client.table if self.client is not None else None)
        await self.replica.build(m, self.data_source, stage, replica, self.collective.blocking(self._token),
                                 tokenizer=files.get(m.data.tokenizer),
                                 weights=files.get(m.model.hf.weights) if m.model.hf is not None else None)

    # -- one step ------------------------------------------------------------------------------------------
    async def _step(self, group: Group) -> None:
        """Run step `at_step` with `group`: first the snapshot a joiner or a backup needs (stored before the step
        runs, so it is served while the group waits for the joiner), then the step itself; then act on it."""
        r = self.replica
        t = r.trainer
        table = self.timeline.table_at(r.at_step, t.stage)
        if self.links is not None:
            await self.links.connect(t, table, r.at_step)
        batch = StepBatch.in_table(self._manifest(), t.replica, table)
        control = StepControl(step=r.at_step, group=group, batch=batch)
        if self.recovery.wants(control.step):  # this slot's whole state: checkpoint, shards, hashed off this path
            self.recovery.taken(await r.take_whole(control), t.stage, t.replica, self._nursery)
        if self.snapshots.wanted(control.step):
            self.snapshots.add(await r.take(control))
        checks: Checks | None = await self.verified.before(control.step) if self.verified is not None else None
        t0 = self.clock()
        self._stepping = (control.step, group)
        try:
            result = await r.step(control, self.clock)
        finally:
            self._stepping = None
        if self.verified is not None:
            self.verified.after(group, checks)
        self.contribution.add(result)
        assert self.entry is not None
        self.entry.trained(control.step, group.epoch)
        self.step_samples[control.step] = result.samples  # this lane's share of the step (for the status file)
        self.step_samples.pop(control.step - RECENT_SAMPLES, None)
        if self._superseded(control.step, group):  # the table reached us late: the step is taken again with the
            control.missing.clear()  # new group (Entry.caught_late); its state is nobody's to claim, and the members
            #                          it missed were elsewhere
        else:
            self.consistency.record(r.at_step, control.state_hash)
        if control.missing and self._froze_since(t0):
            log.info("step %d: not reporting %d members missing: this process stood still during the step",
                     control.step, len(control.missing))
            control.missing.clear()
        self._report(control, group)
        if result.aborted is not None:  # the lane failed at this step: wait for it to be re-formed
            self.entry.lane_failed(control.step)
        rest = self.config.min_step_s - (self.clock() - t0)
        if rest > 0:
            await trio.sleep(rest)  # paced: a step takes at least min_step_s (a slower model, emulated)

    def _froze_since(self, t0: float) -> bool:
        """Whether this process stood still (SIGSTOP, suspend) since `t0`: the silence it saw then was its own."""
        pulse = self.services.pulse
        if pulse is None:
            return False
        pulse.check()
        return pulse.resumed_at >= t0

    def _report(self, control: StepControl, group: Group) -> None:
        """Tell the broker about members the step's rounds found missing or offending, and a lane neighbour a link
        failed to (it checks them: a silent one is replaced, one that answers makes it re-form the group; most
        members' offence reports evict)."""
        if control.offenders:
            peer, reason = next(iter(control.offenders.items()))
            self.error = f"excluded {peer[-8:]}: {reason}"[:200]
        result = control.result
        neighbours = [result.failed_peer] if result is not None and result.failed_peer else []
        if result is not None and result.aborted:
            self.error = f"lane step {control.step} aborted: {result.aborted}"[:200]
        client = self.client
        if (control.missing or control.offenders or neighbours) and client is not None:
            self._nursery.start_soon(lambda: client.report_missing(
                sorted(control.missing), epoch=group.epoch, stage=group.stage, offenders=sorted(control.offenders),
                neighbours=neighbours))

    def _report_offenders(self, group: Group, offenders: list[str]) -> None:
        """Tell the broker about members found lying in a hash vote (most members' reports evict)."""
        client = self.client
        if client is not None and self._nursery is not None:
            self._nursery.start_soon(lambda: client.report_missing([], epoch=group.epoch, stage=group.stage,
                                                                   offenders=offenders))

    async def _finish(self, limit: int) -> None:
        """The end of the run: apply the last round, then make sure this replica ends with the majority's state
        (a divergence in the last steps would otherwise outlive the run). The final state is revision limit + 1
        (what step limit + 1 would start from); every replica serves it, and a minority replica pulls it from a
        majority peer."""
        r, final_rev = self.replica, limit + 1
        g = self.group_at(limit - 1)
        control = StepControl(step=r.at_step, group=g)
        # the checkpoint of the end: the state as training would go on from it (a longer run's, bit for bit)
        resumable = await r.take_whole(StepControl(step=r.at_step, group=g))
        await r.close(control)  # the last round applied: the run's final state
        self.snapshots.add(await r.take(control, final_rev), exact=True)
        self.consistency.record(final_rev, r.sync.state_hash())
        if g is not None:
            self._report(control, g)
        if g is not None and g.size >= MIN_VOTERS:
            refetches = self.consistency.refetches
            await self.consistency.settle_final(g, final_rev)
            if self.consistency.refetches != refetches:  # the majority's final state replaced ours
                resumable = await r.take_whole(StepControl(step=r.at_step, group=g))
        await self.recovery.final(resumable, r.trainer.stage, r.trainer.replica)  # the run's end is always on disk
        await r.evaluate()

    async def _roll_back(self, order: Rollback) -> None:
        """The run goes back to `order.revision`: every trace of what came after it goes, and this slot's own state
        at that revision is loaded (or, when this node holds none, it enters there from its stage group)."""
        r, entry, rec = self.replica, self.entry, self.recovery
        assert entry is not None and rec is not None
        self._rolled, rev = order.count, order.revision
        self._reached = rev
        log.warning("rolling back to revision %d (%s): stage %d had lost every replica", rev, order.source,
                    order.stage)
        self.snapshots.forget_after(rev)
        self.consistency.forget_after(rev)
        rec.forget_after(rev)
        entry.lane_broken_at = None
        if self.links is not None:
            await self.links.close()
            self.links.drop_stores()  # AQ-SGD: every link of the run starts empty (first visits)
        latest = self.timeline.latest
        slot = latest.slot_of(self.services.peer_id) if latest is not None else None
        snap = await rec.state_at(order, *slot) if slot is not None and r.slot == slot else None
        if snap is None:
            if slot is not None:
                r.drop()  # enter at the revision with the stage group's state
            return
        snap = await trio.to_thread.run_sync(snap.hashed)  # served to joiners from here on
        data = snap.skeleton.get("data") if isinstance(snap.skeleton, dict) else None
        own = isinstance(data, dict) and data.get("replica") == slot[1]  # else another lane's (rebuilt) state
        await r.load(snap, enter=not own)
        self.snapshots.add(snap, exact=True)
        entry.entries.append({"step": rev, "bytes_pulled": 0, "state_bytes": snap.nbytes, "seconds": 0.0,
                              "source": f"rollback ({order.source})"})

    # -- the loop ------------------------------------------------------------------------------------------
    async def _train(self) -> None:
        m, r, entry = self._manifest(), self.replica, self.entry
        assert entry is not None
        limit = self.config.max_steps if self.config.max_steps is not None else m.optim.total_steps
        while True:
            if self.clock() - self._progress_at >= PROGRESS_EVERY_S:
                self._progress()  # where the run got to, while its members can still say so
            order = StageRecovery.rollback_due(self.timeline.latest, self._rolled)
            if order is not None:
                await self._roll_back(order)
                continue
            t, step = r.trainer, r.at_step
            if t is not None and step >= limit:
                await self._finish(limit)
                r.state = "done"
                self.finished.set()
                await trio.sleep_forever()
            if step == 0 and not self._group_full() and self.clock() < self._start_deadline:
                r.state = "ready"  # a new run: wait for the group to fill, so every replica starts at step 0
                await entry.wait_for_table(START_POLL_S)
                continue
            if entry.lane_broken_at is not None:
                await entry.rejoin_lane(limit)
                continue
            slot = self.timeline.entry()
            if t is not None and slot is not None and slot[0] == step and slot[1:] != r.slot and step < limit:
                # moved at this switch step (a re-plan; at step 0 before training began): the new slot's trainer,
                # with the new stage group's state at this step, as a promoted backup enters
                await entry.enter(*slot)
                continue
            g = self._group_to_train(step) if t is not None else None
            if g is not None and entry.left_behind(step):
                g = None  # enter our next group with its state rather than train through rounds the others passed
            if g is not None and await entry.caught_late(g.epoch, g.stage, step, self.consistency.forget_after):
                continue  # back at the switch step our group's table reached us after
            if g is None:
                slot = self.timeline.entry()
                if slot is not None and (t is None or slot[0] > step) and slot[0] < limit:
                    await entry.enter(*slot)
                    continue
                if slot is not None and (t is None or slot[0] > step):
                    await entry.enter_at_end(limit, *slot[1:])  # the run ends before this slot takes effect
                    continue
                r.state = "ready"  # a backup, or waiting for the step at which our slot takes effect
                await entry.wait_for_table(READY_POLL_S)
                continue
            if g.size < m.plan.lanes_min:
                r.state = "waiting"  # below the run's minimum of lanes: no step until more join
                await entry.wait_for_table(READY_POLL_S)
                continue
            if self.consistency.refetch_due(step):
                await self.consistency.refetch(step, self.group_at(step))
            r.state = "training"
            await self._step(g)
            await self.consistency.check(self.group_at(r.at_step))

    # -- RPC and set-up ------------------------------------------------------------------------------------
    async def node_call(self, peer: str, method: str, body: Any) -> Any:
        return await call(self.services.sh, peer, method, body, timeout_s=self.config.client.rpc_timeout_s)

    async def run(self, joined: list[str], *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        sv, cfg = self.services, self.config
        self._token = trio.lowlevel.current_trio_token()
        self._start_deadline = self.clock() + cfg.start_wait_s
        started = False

        def up() -> None:
            """The node is up: admitted to its run, or (joining the swarm's open run) waiting for one to appear."""
            nonlocal started
            if not started:
                started = True
                task_status.started(self)

        brokers: list[str] = []  # the broker of a run found by its advert: asked for the table too
        if self.manifest is None and cfg.run_id is None:
            found_run = await self.finder.find(cfg.select or None, lambda: joined or sv.sh.connected_peers(),
                                               me=sv.peer_id, has_secret=bool(cfg.secret), on_wait=up,
                                               choose=sv.choose_run)
            if isinstance(found_run, str):
                self.manifest = await fetch_manifest(sv, found_run, joined, cfg.client)
            else:
                self.manifest, brokers = found_run.manifest, [found_run.advert.peer_id]
                log.info("joining run %s (%s): %s", found_run.run_id[:16], found_run.name, self.finder.reason)
        elif self.manifest is None:
            assert cfg.run_id is not None
            self.manifest = await fetch_manifest(sv, cfg.run_id, joined, cfg.client)
        m = self.manifest
        preflight(m, cfg)  # the device's memory (run/preflight.py)
        if m.join.mode == "secret" and not cfg.secret:  # to prove it, or as broker to check it
            raise AdmissionError("this run is private: a join secret is required")
        self.data_source = data_source(m, cfg)  # never a path a network manifest chose
        await trio.to_thread.run_sync(check_inputs, m, self.data_source)  # packages, the Hub, files
        sync = m.plan.sync
        self.entitled.max_lead_steps = max(MAX_STEP_LEAD, 2 * sync.diloco.inner_steps
                                           if sync.method == "diloco" else 0)
        serve_manifest(sv, m)
        placer = None
        if sv.links is not None:
            if m.plan.placement == "network":  # measure links (probes, reports) for the broker's placer
                sv.links.follow(lambda: self.client.table if self.client is not None else None)
            placer = make_placer(m, sv.links.book, cfg.replan)
        ctx = sv.run_context(m, self.switch_step, placer, step=lambda: self.replica.at_step)
        lim = inbox_limits(m, cfg.round_timeout_s, SyncConfig().entry_grace_rounds)  # the replica's (replica.py)
        overlap = 1 + (sync.diloco.overlap_steps if sync.method == "diloco" else 0)  # a round runs on that long
        self.collective = Collective(sv.sh, sv.penalties,  # only members of known groups, under their tags
                                     gate=CollectiveGate(m.run_id, lambda: self.timeline.tables,
                                                         step=lambda: max(0, self.replica.at_step - overlap)),
                                     max_frame_bytes=lim.max_frame_bytes, max_wait_s=lim.max_wait_s,
                                     max_peer_buffer_bytes=lim.max_peer_buffer_bytes,
                                     max_buffer_bytes=lim.max_buffer_bytes)
        StateServer(sv.sh, lambda: self.snapshots.latest, penalties=sv.penalties, by_revision=self.snapshots.at,
                    may_hold=self._may_hold,
                    allow=self.entitled.member)  # model state for the run's members and backups only
        sv.register("run.snapshot_at", self._rpc_snapshot_at)
        self.recovery = self._recovery()
        self.files = RunFiles(sv, cfg, m, self.entitled)  # the run's weights and tokenizer, for peers that need them
        sv.register("run.hash_at", self.consistency.hashes.rpc_hash_at)
        plan = m.plan
        links = open_link_hub(sv.sh, sv.penalties, LinkConfig(), allow=self.entitled.member,
                              plan=(m.run_id, plan.stages, plan.lanes_max), named=self._lane_named) \
            if plan.stages > 1 else contextlib.nullcontext()  # a pipeline stage's links to its lane neighbours
        async with links as hub, trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self._halt_when_cancelled)
            if hub is not None:
                verifier = StageVerifier(
                    me=sv.peer_id, run_id=m.run_id, fraction=plan.pipeline.verify_fraction,
                    kind=plan.pipeline.wire_dtype, penalize=sv.penalties.penalize,
                    weights_hash=lambda step: self.consistency.hashes.hashes.get(step),
                    call=lambda p, method, b, max_response_bytes: call(
                        sv.sh, p, method, b, max_response_bytes=max_response_bytes, timeout_s=cfg.client.rpc_timeout_s))
                self.links = StageLinks(hub, self._token, m, sv.peer_id, cfg.aq_buffer_dir,
                                        verifier.transcript if verifier.enabled else None)
                self.verified = VerifiedStage(services=sv, verifier=verifier, replica=self.replica,
                                              timeline=self.timeline, links=self.links, client=lambda: self.client,
                                              call=self.node_call, spawn=nursery.start_soon,
                                              member=self.entitled.member)
            # a node that restarted finds its run again from its peers (the table may name this node as broker); the
            # run's owner joining a swarm with its manifest starts the run there unless the swarm already has it
            owner = bool(m.signature) and m.owner == sv.peer_id
            if owner and joined:
                await self.finder.ask(joined)  # the swarm's adverts: is this run already trained here?
            patient = ((sv.joined_by_address and not owner) or cfg.manifest is None
                       or sv.directory.get(m.run_id) is not None
                       or any(st.run_id == m.run_id for _, st in sv.statuses()))  # never start a second broker
            askable = joined + [b for b in brokers if b not in joined and b != sv.peer_id]
            found = await find_table(sv, m, askable, cfg.client, patient=patient) if askable else None
            if found is None and m.owner not in ("", sv.peer_id):
                raise NotTheOwner(f"nobody knows run {m.run_id[:16]}…, and only its owner "
                                  f"{m.owner[:16]}… (the identity that signed it) may start its broker; "
                                  f"this node is {sv.peer_id[:16]}…")
            if self.recovery.checkpoints is not None:
                await nursery.start(self.recovery.checkpoints.run)
            if found is None:  # nobody knows the run: the node started with the manifest hosts its broker
                self.broker = Broker(ctx, cfg.broker, secret=cfg.secret, resume=self._resume_plan())
                await nursery.start(self.broker.run)
            client = self.client = RunClient(
                ctx, self.hardware, broker_id=found[0].record.peer_id if found else sv.peer_id, secret=cfg.secret,
                config=cfg.client, broker_config=cfg.broker, local_broker=self.broker)
            client.on_change.append(self._on_table)
            if found is not None:
                client.accept_envelope(found[0].raw, found[1])
            sv.ingest(client.on_record)
            self.entry = Entry(services=sv, config=cfg, run_id=m.run_id, replica=self.replica,
                               timeline=self.timeline, pulls=self.pulls, client=client, links=self.links,
                               build=self._build, spawn=nursery.start_soon, recovery=self.recovery,
                               snapshots=self.snapshots, rolled=lambda: self._rolled,
                               ask=self.consistency.ask_snapshot, abstain=self._abstain)
            await nursery.start(client.run)
            if client.table is not None:
                self._on_table(client.table)
            up()
            nursery.start_soon(self.pulls.keep_warm, client, self.switch_step, self.consistency.ask_snapshot)
            await self._train()

    def _recovery(self) -> StageRecovery:
        sv, cfg, m = self.services, self.config, self._manifest()
        shards = StageShards(sv.sh, sv.key, m, sv.penalties, member=self.entitled.member,
                             tables=lambda: self.timeline.tables, clock=self.clock)
        root = Path(cfg.checkpoint_dir) if cfg.checkpoint_dir else None
        return StageRecovery(sv.peer_id, m, self.timeline, shards, statuses=lambda: list(sv.statuses()),
                             checkpoints=CheckpointWriter(root, m, clock=self.clock) if root else None,
                             checkpoint_root=root, resume_root=Path(cfg.resume_dir) if cfg.resume_dir else None)

    def _resume_plan(self) -> tuple[int, dict[str, str]] | None:
        """A node that starts the run's broker with --resume: the step its checkpoints go on from, and who sat
        where then (ResumeError when the folder holds no checkpoint of every stage)."""
        if self.config.resume_dir is None:
            return None
        m = self._manifest()
        point = self.recovery.resume_plan()
        if point is None:
            raise ResumeError(f"{self.config.resume_dir} holds no checkpoint of every stage of run "
                              f"{m.run_id[:16]}… to resume from")
        log.warning("resuming run %s at step %d from %s (%s)", m.run_id[:16], point.step, self.config.resume_dir,
                    "every slot checkpointed" if point.complete else
                    f"slots {point.slots} checkpointed; the others enter from their stage")
        return point.step, point.seating

    def _halt(self) -> None:
        """A round in progress ends now, and a wait on a lane link fails now: the trainer thread is not held to
        their deadlines."""
        if self.collective is not None:
            self.collective.close()
        if self.links is not None:
            self.links.halt()

    async def _halt_when_cancelled(self) -> None:
        """Sleeps for as long as the run goes on. Cancelled (the node torn down without a leave: interrupted, failed,
        or its task cancelled), it halts the run at once: a worker thread cannot be cancelled, so the run's nursery
        would otherwise wait for the trainer thread's round or lane wait to reach its deadline (seconds per stop)."""
        try:
            await trio.sleep_forever()
        finally:
            self._halt()

    async def leave(self, *, tell_broker: bool = True) -> None:
        """Leave the run: a round in progress ends now (the trainer thread is not held to its deadline), and the
        broker hears of it (it moves a backup into the slot at once) unless `tell_broker` is false."""
        self._halt()
        if self.client is not None and tell_broker:
            with trio.move_on_after(self.config.leave_timeout_s):
                try:
                    await self.client.leave()
                except Exception as e:  # noqa: BLE001 - leaving anyway
                    log.info("leave notice to the broker failed: %s", e)
