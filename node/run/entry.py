"""Taking a place in a stage group (docs/architecture.md, "Entering a group"): at the switch step R the table names,
a node builds its trainer and loads exactly revision R, the whole entry state a majority of the group agrees on
(node/run/pulls.py); a slot that takes effect after the run's last step takes the run's final state instead; a
node far behind its group enters the group's next step; a stage whose lane failed waits for the lane to re-form."""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from shoal.node.run.config import RunConfig
from shoal.node.run.context import NodeServices
from shoal.node.run.entitled import majority_step
from shoal.node.run.lanes import StageLinks
from shoal.node.run.pulls import Ask, NotWanted, StatePulls
from shoal.node.run.recovery import StageRecovery
from shoal.node.run.replica import Replica
from shoal.node.run.snapshots import SnapshotStore
from shoal.protocol.assignment import AssignmentTable
from shoal.swarm.run.client import RunClient
from shoal.swarm.run.group import Group
from shoal.swarm.run.timeline import GroupTimeline
from shoal.swarm.state.agreed import NobodyHolds
from shoal.swarm.state.snapshot import Snapshot
from shoal.swarm.state.transfer import StateTransferError

log = logging.getLogger(__name__)

READY_POLL_S = 1.0  # a node waiting for a slot (or a backup) re-checks the table at least this often
LOST_CONFIRM_S = 3.0  # a stage whose members all say they cannot serve its state is asked again after this long

Build = Callable[[int, int], Awaitable[None]]  # (stage, replica) -> the replica's new trainer is built
Spawn = Callable[[Callable[[], Awaitable[Any]]], None]  # start a task in the run's nursery
Abstain = Callable[[Group, int], Awaitable[None]]


class Entry:
    """Owned by the event loop. `entries`: each time this node entered a group (step, bytes, seconds)."""

    def __init__(self, *, services: NodeServices, config: RunConfig, run_id: str, replica: Replica,
                 timeline: GroupTimeline, pulls: StatePulls, client: RunClient, links: StageLinks | None,
                 build: Build, spawn: Spawn, recovery: StageRecovery, snapshots: SnapshotStore,
                 rolled: Callable[[], int], ask: Ask, abstain: Abstain | None = None):
        self.services, self.config, self.run_id = services, config, run_id
        self.replica, self.timeline, self.pulls, self.client, self.links = replica, timeline, pulls, client, links
        self.build, self.spawn = build, spawn
        self.recovery, self.snapshots, self.rolled = recovery, snapshots, rolled  # rolled: rollbacks applied
        self.ask = ask  # (peer, step): ask a member to keep its state at that step (Consistency.ask_snapshot)
        self.abstain = abstain  # (group, step): tell a group epoch's members this node will not enter it
        self.entries: list[dict[str, Any]] = []
        self.lane_broken_at: int | None = None  # the step at which this stage's lane failed, until re-formed
        self._lane_report_at = 0.0
        self._last: tuple[int, int] | None = None  # (step, group epoch) of the newest step this node trained
        self.caught_up = 0  # times this node went back to a switch step its group's table reached it after

    async def wait_for_table(self, timeout_s: float) -> None:
        with trio.move_on_after(timeout_s):
            await self.client.wait_changed()

    async def _trainer_for(self, stage: int, replica: int) -> None:
        r = self.replica
        if r.slot is not None and r.slot != (stage, replica):
            log.info("slot changes from s%dr%d to s%dr%d: a new trainer", *r.slot, stage, replica)
            if self.links is not None:
                await self.links.close()
            r.drop()  # another stage holds other parameters; another lane reads other samples
        if r.trainer is None:
            await self.build(stage, replica)

    async def enter(self, step: int, stage: int, replica: int) -> bool:
        """Take a place in the group from `step`: build the trainer, and unless the run starts here, load the
        state of exactly `step` from a replica that was in the group before. False when no state could be had
        (the node waited for the broker's next table; its own state is not at `step`)."""
        r = self.replica
        r.state = "joining"
        await self._trainer_for(stage, replica)
        if step == 0 and r.at_step == 0:
            return True
        if await self._entered_from_disk_or_shards(step, stage, replica):
            return True
        me = self.services.peer_id
        prev = self.timeline.group_at(step - 1) if step > 0 else None
        now = self.timeline.table_at(step, stage)
        staying = set(now.members(stage)) if now is not None else set()
        # the members that stay in the group serve the revision first (one that was counted failed may hold another)
        peers = sorted((m for m in (prev.members if prev else ()) if m != me), key=lambda m: m not in staying)
        latest = self.timeline.latest
        if not peers or (latest is not None and latest.rollback is not None and latest.rollback.revision == step):
            # (a rollback's revision: the stage's members now hold it, the one that rebuilt it at least)
            peers = [m for m in (now.members(stage) if now else ()) if m != me]
        if not peers and 0 < r.at_step < step and r.slot == (stage, replica):
            # the stage's only member (one lane) whose lane is re-formed further on: nobody trained the stage
            # meanwhile, nobody else holds it; it goes on from its own state at the re-formed step
            log.info("the only member of stage %d: going on from its own state at step %d (was at %d)", stage, step,
                     r.at_step)
            r.trainer.step_count = r.at_step = step
            return True
        clock = self.services.clock
        t0 = clock()
        log.info("entering the group at step %d: pulling that revision from %s", step, [p[-8:] for p in peers])
        entering = self.timeline.group_at(step, stage)  # the group epoch this entry is for
        try:
            snap = await self._pull_entry(step, stage, replica, peers)
            if snap is None:  # every member that had the stage lost its state: it is lost all the same
                await self._bring_back(stage, replica, step)
                return True
            await r.load(snap)
        except StateTransferError as e:  # no majority state to enter with (the replicas differ until their vote
            # settles it), a state that does not fit, or the slot changed: wait for the broker's next table and try
            # its entry then
            log.warning("could not enter the group at step %d: %s", step, e)
            if isinstance(e, NotWanted) and entering is not None and self.abstain is not None:
                # that group epoch goes on without this node: its members need not wait for it in its first round
                self.spawn(functools.partial(self.abstain, entering, step))
            r.state = "ready"
            await self.wait_for_table(READY_POLL_S)
            return False
        self._entered(step, snap.nbytes, t0)
        return True

    def _entered(self, step: int, pulled: int, t0: float) -> None:
        took, whole = self.services.clock() - t0, self.replica.state_bytes()
        self.entries.append({"step": step, "bytes_pulled": pulled, "state_bytes": whole, "seconds": round(took, 3)})
        log.info("entered the group at step %d with the state its members agree on: %d bytes pulled for a state of "
                 "%d (%.2f s)", step, pulled, whole, took)

    async def _entered_from_disk_or_shards(self, step: int, stage: int, replica: int) -> bool:
        """Entering at `step` without pulling from the group: a resumed node loads its own checkpoint of the slot;
        when every member a stage had before `step` is gone, the replacement of that stage rebuilds it (shards, else
        disk) and asks for the run to roll back, and the other stages wait for that rollback instead of pulling
        from members that cannot serve them (node/run/recovery.py). False: pull from the group as usual."""
        rec, r = self.recovery, self.replica
        snap = await rec.resume_state(stage, replica, step)
        if snap is not None:
            await r.load(snap, enter=False)
            self.snapshots.add(snap, exact=True)
            self.entries.append({"step": step, "bytes_pulled": 0, "state_bytes": snap.nbytes, "seconds": 0.0,
                                 "source": "checkpoint"})
            return True
        latest = self.timeline.latest
        if latest is not None and latest.rollback is not None and latest.rollback.revision == step:
            return False  # entering a rollback's revision: the stage's members serve it
        lost = rec.lost_stages(step, stage, holds_own=self._holds_own(stage, replica))
        if not lost:
            return False
        if stage in lost:
            await self._bring_back(stage, replica, step)
            return True
        r.state = "syncing"
        log.warning("stage(s) %s lost every replica: waiting for the run to roll back instead of entering at step %d",
                    lost, step)
        await self._wait_for_rollback(step, stage, replica)
        return True

    def _holds_own(self, stage: int, replica: int) -> bool:
        """This node trained in that slot up to here (it holds the stage's state itself)."""
        return self.replica.at_step > 0 and self.replica.slot == (stage, replica)

    async def _pull_entry(self, step: int, stage: int, replica: int, peers: list[str]) -> Snapshot | None:
        """The group's state at `step` from `peers` (the members the stage had before it), or None once the live ones
        have said twice, LOST_CONFIRM_S or more apart, that none of them holds that revision or trains toward it
        (each was restarted, or is entering itself: nobody can serve the stage, although none of them is gone), or
        once every one of them is gone by the newest table. Silence is no such answer: a pull nobody answers ends
        after `state_pull_timeout_s` (StateTransferError)."""
        def wanted() -> bool:
            return self.timeline.entry() == (step, stage, replica)

        deadline = trio.current_time() + self.config.state_pull_timeout_s
        said_once = False
        while True:
            try:
                return await self.pulls.revision(step, peers, wanted=wanted, gives_up_on=(NobodyHolds,))
            except NobodyHolds as e:
                if e.asked and said_once:
                    log.warning("stage %d: %s, said twice: its state is lost", stage, e)
                    return None
                said_once = said_once or e.asked > 0
                log.info("stage %d: %s; asking again in %.0f s", stage, e, LOST_CONFIRM_S)
            await trio.sleep(LOST_CONFIRM_S)
            if not wanted():
                raise NotWanted(f"revision {step} is no longer wanted (this node's slot changed)")
            if stage in self.recovery.lost_stages(step, stage, holds_own=self._holds_own(stage, replica)):
                log.warning("stage %d: every member it had before step %d is gone now", stage, step)
                return None  # (the members that went silent were found failed meanwhile)
            if trio.current_time() > deadline:
                raise StateTransferError(f"no member of stage {stage} answered for revision {step} within "
                                         f"{self.config.state_pull_timeout_s:g} s")

    async def _bring_back(self, stage: int, replica: int, step: int) -> None:
        """This node's stage lost every replica: rebuild it (shards, else a disk checkpoint, else the run's start while
        nobody can hold a checkpoint of it; node/run/recovery.py), ask the run to roll back there, and wait for the
        table that says so."""
        r = self.replica
        r.state = "syncing"
        got = await self.recovery.rebuild(stage, replica, step, warm=self.snapshots.warm)
        why = "nothing to rebuild it from" if got is None else await self.client.rollback(stage, *got)
        if why is not None:  # refused for now (another member of the stage has yet to ask, say), or no way back
            log.log(logging.ERROR if got is None else logging.WARNING,
                    "stage %d cannot come back now (%s): waiting for the next table", stage, why)
            r.state = "ready"
            await self.wait_for_table(self.config.round_timeout_s)
            return
        await self._wait_for_rollback(step, stage, replica)

    async def _wait_for_rollback(self, step: int, stage: int, replica: int) -> None:
        with trio.move_on_after(self.config.state_pull_timeout_s):
            while StageRecovery.rollback_due(self.timeline.latest, self.rolled()) is None \
                    and self.timeline.entry() == (step, stage, replica):
                await self.client.wait_changed()

    async def enter_at_end(self, limit: int, stage: int, replica: int) -> None:
        """Our slot takes effect at or past the run's last step (a slot filled near the end): the run ends before
        this node could train in it. Take the run's final state instead (revision limit + 1, which every replica of
        the stage serves once done), so this node ends with the group's state and counts as done with it."""
        r = self.replica
        r.state = "joining"
        if r.trainer is None:
            await self.build(stage, replica)
        tables = [t for t in (self.timeline.table_at(limit - 1, stage), self.timeline.latest) if t is not None]
        peers = sorted({m for t in tables for m in t.members(stage)} - {self.services.peer_id})
        log.info("our slot takes effect after the run's last step %d: pulling the final state from %s", limit,
                 [p[-8:] for p in peers])
        t0 = self.services.clock()
        try:
            snap = await self.pulls.revision(limit + 1, peers)
            await r.load(snap, step=limit)  # the final state: at step N
        except StateTransferError as e:
            log.warning("no final state the group agrees on (%s): this node ends with its own", e)
            return
        self._entered(limit + 1, snap.nbytes, t0)

    def left_behind(self, step: int) -> bool:
        """Most members of our stage report steps more than `switch_lead_min_steps` ahead of ours (we entered after
        the group's deadline, or stood still) and our slot in the newest table takes effect ahead of us: training
        through rounds the others have passed only meets deadlines; entering at that step with the group's state
        catches up at once. One member ahead of the rest (a replica that skipped the others and trained on alone, or
        one that publishes a step it never trained) does not count: entering would stall on a state only it holds."""
        entry, t = self.timeline.entry(), self.timeline.latest
        if entry is None or t is None or entry[0] <= step:
            return False
        members = set(t.members(entry[1])) - {self.services.peer_id}
        top = majority_step((st.step for peer, st in self.services.statuses()
                             if peer in members and st.run_id == self.run_id), len(members) + 1)
        if top is None or top - step <= self.config.switch_lead_min_steps:
            return False
        log.info("the group is at step %d, this node at %d: entering at step %d with the group's state", top, step,
                 entry[0])
        return True

    def ask_to_keep(self, table: AssignmentTable) -> None:
        """`table` (new here) re-forms our stage's group, with this node in it, at a switch step S ahead of us: ask the
        other members staying in it to keep their state at S, as this node does. A member the table reaches only
        after S (its gossip lost) then still holds it and can go back there (`caught_late`)."""
        stage = self.timeline.stage()
        me = self.services.peer_id
        if stage is None or stage >= table.stages or me not in table.members(stage):
            return
        switch = table.switch_step(stage)
        before = self.timeline.table_at(switch - 1, stage) if switch > self.replica.at_step else None
        if before is None or before.epochs[stage] == table.epochs[stage]:
            return
        for p in sorted(set(table.members(stage)) & set(before.members(stage)) - {me}):
            self.spawn(functools.partial(self.ask, p, switch))

    def trained(self, step: int, epoch: int) -> None:
        """This node trained `step` with its stage group's epoch `epoch`."""
        self._last = (step, epoch)

    async def caught_late(self, epoch: int, stage: int, step: int, forget: Callable[[int], None]) -> bool:
        """The table that re-formed our group as `epoch` at switch step S reached this node only now, at `step` > S,
        after it had begun S with the group before (the table's gossip was lost here and the next poll came after
        S; or, at a run's start, the broker placed a joiner at step 0 as this node began it): the members that had
        the table in time, and a node entering at S, wait for it at S. It goes back to S and forgets what came after
        (`forget`: the hashes it recorded); True when it did. Its state at S is the one it kept there (the members
        ask each other to: `ask_to_keep`), or at step 0 the run's initial state, which it builds again. Without that
        state, or in a pipeline (its lane's neighbours would be out of step with it), it trains on and the hash vote
        settles the difference."""
        start, last = self.timeline.epoch_start(stage, epoch), self._last
        # late: the newest step it trained is S or after, and with another epoch (on time, every step from S on is
        # trained with this one)
        if start is None or start >= step or last is None or last[0] < start or last[1] == epoch:
            return False
        self._last = None  # judged once
        snap = self.snapshots.at(start)
        late = f"stage {stage}'s group epoch {epoch} took effect at step {start}, its table reached this node at {step}"
        if (snap is None and start > 0) or self.links is not None:
            log.warning("%s: %s", late, "it holds no state there, trains on" if snap is None else
                        "a pipeline stage trains on")
            return False
        log.warning("%s: back to step %d", late, start)
        self.snapshots.forget_after(start)  # states of a past no member shares: never served
        forget(start)
        self.caught_up += 1
        if snap is None:
            self.replica.drop()  # built again at step 0 (the run's initial state) by the next entry
            return True
        try:
            await self.replica.load(snap)
        except StateTransferError as e:
            log.warning("could not go back to step %d: %s", start, e)
        return True

    def lane_failed(self, step: int) -> None:
        """The lane's step `step` was given up at this stage: wait for the lane to be re-formed."""
        self.lane_broken_at = step
        self._lane_report_at = self.services.clock() + self.config.round_timeout_s

    async def rejoin_lane(self, limit: int) -> None:
        """A stage whose lane step failed waits, instead of stepping on alone (its lane's stages would fall out of
        step with each other), for a table that re-forms its lane from a later switch step (a backup promoted into
        the failed slot, or the same members re-formed), and enters the lane there with its stage group's state at
        that step, as a joining replica does. The broker hears of the failure again every round timeout."""
        assert self.lane_broken_at is not None
        entry = self.timeline.entry()
        t = self.timeline.latest
        if entry is not None and t is not None and entry[0] > self.lane_broken_at and entry[2] in t.complete_lanes():
            # the lane stays broken here until this node holds its group's state at the re-formed switch step: an
            # entry that found no state (the slot changed again meanwhile, no majority yet) leaves the node at its
            # old step, where its lane's neighbours are not, and training that step would block them and its own
            # stage group (each waiting on the other's deadlines) instead of entering at the next table's step
            if entry[0] >= limit or await self.enter(*entry):
                self.lane_broken_at = None
            return
        self.replica.state = "ready"
        clock = self.services.clock
        if clock() >= self._lane_report_at:
            self._lane_report_at = clock() + self.config.round_timeout_s
            g = self.timeline.group_at(self.replica.at_step)
            prev, nxt = (self.links.peers if self.links is not None else None) or (None, None)
            if g is not None:
                client = self.client
                self.spawn(lambda: client.report_missing(
                    [], epoch=g.epoch, stage=g.stage, neighbours=[p for p in (prev, nxt) if p]))
        await self.wait_for_table(READY_POLL_S)
