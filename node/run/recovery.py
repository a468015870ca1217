"""Keeping a run's state, as one node sees it: what it does with the snapshots it takes (its slot's disk checkpoint,
its stage's erasure-coded shards, its own copy for a rollback), how the replacement of a stage that lost every
replica rebuilds the stage (shards first; with fewer than k, the newest disk checkpoint, said in the log and the
status the dashboard turns into events), which state each slot holder loads when the run rolls back, and a resumed
node's own checkpoint (docs/snapshots.md, docs/checkpoints.md). The runtime owns the trainer; this hands it states.

AQ-SGD link stores are not part of any of these states: after a rollback (and a resume) every link of the run starts
empty, so each sample's next visit goes in full (first visit), as on a link whose two ends are both new.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import trio

from shoal.node.run.checkpoints import (
    CheckpointMeta, CheckpointMissing, CheckpointWriter, ResumePoint, read_checkpoint, resume_point, slots_on_disk,
    state_step)
from shoal.node.run.shards import StageShards
from shoal.protocol.assignment import GONE, AssignmentTable, Rollback, slot_name
from shoal.protocol.manifest import RunManifest
from shoal.protocol.records import StatusRecord
from shoal.swarm.run.timeline import GroupTimeline
from shoal.swarm.state.shards import NotRecoverable
from shoal.swarm.state.snapshot import Snapshot

log = logging.getLogger(__name__)

MAX_ASKED = 64  # peers asked for a lost stage's shard manifests
OWN_MAX = 4  # own snapshots kept for rollbacks, however many other stages still need older ones


class StageRecovery:
    """`statuses()`: (peer, status record) of the live peers; `rollback(stage, revision, source)`: asks the broker
    to send the run back (None when accepted, else why not)."""

    def __init__(self, me: str, manifest: RunManifest, schedule: GroupTimeline, shards: StageShards, *,
                 statuses: Callable[[], Iterable[tuple[str, StatusRecord]]],
                 checkpoints: CheckpointWriter | None = None, checkpoint_root: Path | None = None,
                 resume_root: Path | None = None):
        self.me, self.manifest, self.schedule, self.shards = me, manifest, schedule, shards
        self.statuses = statuses
        self.checkpoints, self.checkpoint_root, self.resume_root = checkpoints, checkpoint_root, resume_root
        self.rebuilt: tuple[int, Snapshot, str] | None = None  # (stage, state, source) this node rebuilt
        self.notice: str | None = None  # the last recovery this node took part in, for the status record
        self.rebuilds: list[dict] = []  # what each rebuild took (the status file and the benchmark read these)

    # -- the snapshots a slot holder takes ------------------------------------------------------------------------
    def wants(self, step: int) -> bool:
        """Whether the state at `step` is to be snapshotted for a checkpoint or for shards."""
        return (self.checkpoints is not None and self.checkpoints.due(step)) or self.shards.due(step)

    def taken(self, snap: Snapshot, stage: int, replica: int, nursery: trio.Nursery) -> None:
        """A snapshot of this node's slot was taken (already a private copy): keep it for a rollback, encode it
        when this node is its stage's encoder, and hand it to the checkpoint writer; nothing here waits."""
        if self.shards.due(snap.revision):
            self._keep_own(snap)
            t = self.schedule.table_at(snap.revision, stage)
            if t is not None and self.shards.encoder(t, stage) == self.me:
                nursery.start_soon(self.shards.encode_and_place, snap, t, stage)
        if self.checkpoints is not None and self.checkpoints.due(state_step(snap)):
            self.checkpoints.offer(snap, self._meta(snap, stage, replica))

    async def final(self, snap: Snapshot, stage: int, replica: int) -> None:
        """The run's end: its last state is always checkpointed, and on disk before this returns."""
        if self.checkpoints is not None:
            self.checkpoints.offer(snap, self._meta(snap, stage, replica))
            await self.checkpoints.flush()

    def _meta(self, snap: Snapshot, stage: int, replica: int) -> CheckpointMeta:
        step = state_step(snap)
        seating: dict[str, str] = {}
        for st in range(self.manifest.plan.stages):
            t = self.schedule.table_at(step, st)
            for s in (t.slots if t is not None else ()):
                if s.stage == st:
                    seating[slot_name(s.stage, s.replica)] = s.peer_id
        return CheckpointMeta(run_id=self.manifest.run_id, stage=stage, replica=replica, step=step, peer_id=self.me,
                              state_hash=snap.hash, seating=seating, time=time.time())

    def _keep_own(self, snap: Snapshot) -> None:
        """Keep this snapshot for a rollback, with the newest one before it and any older one a stage's newest placed
        shards are of (a rollback goes to a revision every stage holds)."""
        own = self.shards.own
        own[snap.revision] = snap
        needed = {st.shards_placed for _, st in self.statuses() if st.run_id == self.manifest.run_id
                  and st.shards_placed is not None}
        newest = sorted(own)[-2:]
        for r in sorted(own):
            if r not in newest and (r not in needed or len(own) > OWN_MAX):
                del own[r]

    # -- a stage that lost every replica -------------------------------------------------------------------------
    def lost_stages(self, step: int, mine: int, holds_own: bool) -> list[int]:
        """The stages whose state nobody can serve at `step`: every member a stage had before it (in the newest table
        in force before `step` that gave the stage any) is gone by the newest table. A replacement entering that
        stage holds none of its state either. This node's own stage (`mine`) counts also when this node knows of no
        member before (it was seated straight into an emptied stage: no other live member now), and never when it holds
        the stage's state itself (`holds_own`: it trained in that stage up to here)."""
        latest = self.schedule.latest
        out = []
        for st in range(self.manifest.plan.stages):
            if st == mine and holds_own:
                continue
            before = next((set(t.members(st)) for t in reversed(self.schedule.tables)
                           if t.switch_step(st) <= step - 1 and t.members(st)), set()) - {self.me}
            if before:
                if all(latest.provider_state(p) == GONE for p in before):
                    out.append(st)
            elif st == mine and step > 0:  # seated straight into the slot: lost when it is the stage's only one
                now = self.schedule.table_at(step, st)
                if not any(p != self.me and latest.provider_state(p) != GONE for p in (now.members(st) if now else ())):
                    out.append(st)
        return out

    def _shard_peers(self, stage: int) -> list[str]:
        """Whom to ask for `stage`'s shards: peers whose status says they hold some, then the run's providers."""
        said = [p for p, st in self.statuses() if st.run_id == self.manifest.run_id and p != self.me
                and any(h.stage == stage for h in st.shards)]
        t = self.schedule.latest
        rest = [s.peer_id for s in t.slots] + list(t.backups) if t is not None else []
        return list(dict.fromkeys(p for p in said + rest if p != self.me))[:MAX_ASKED]

    async def rebuild(self, stage: int, replica: int, entry: int,
                      warm: Snapshot | None = None) -> tuple[int, str] | None:
        """The revision of `stage` (which lost every replica) to roll the run back to, and where its state comes
        from: the newest revision before `entry` that k good shards rebuild (every other stage keeps its own snapshot
        of the revisions shards were placed for) or, in a one-stage run, this node's warm copy of the stage (kept as a
        backup: the state its group agreed on, checked when pulled) when that is newer; else the newest step at which
        every stage has a disk checkpoint in this node's checkpoint folder (this slot's own first), else the run's
        start while no node can hold a disk checkpoint of the stage (`start_allowed`). None when none of these is to
        be had."""
        t0 = trio.current_time()
        if warm is not None and not (self.manifest.plan.stages == 1 and warm.revision < entry
                                     and isinstance(warm.skeleton, dict) and warm.skeleton.get("stage", 0) == stage):
            warm = None  # another stage would need its own state at that revision too, which none keeps
        try:
            got = await self.shards.rebuild(stage, self._shard_peers(stage), revision_ok=lambda r: r < entry)
        except NotRecoverable as e:
            log.warning("stage %d lost every replica, and its shards cannot rebuild it: %s", stage, e)
            why = str(e)
            if warm is not None:
                return self._from_warm(stage, warm, t0)
        else:
            if warm is not None and warm.revision > got.snapshot.revision:
                return self._from_warm(stage, warm, t0)
            self._note(stage, got.snapshot.revision, "shards", got.seconds, got.snapshot, holders=len(got.used),
                       rejected=len(got.rejected), bytes=got.bytes_pulled)
            log.warning("stage %d lost every replica: rebuilt its state at revision %d from %d shards (%.1f MB in "
                        "%.2f s, %d rejected), hash %s… as placed", stage, got.snapshot.revision, len(got.used),
                        got.bytes_pulled / 1e6, got.seconds, len(got.rejected), got.snapshot.hash[:12])
            self.rebuilt = (stage, got.snapshot, "shards")
            return got.snapshot.revision, "shards"
        disk = await trio.to_thread.run_sync(self._newest_on_disk, stage, replica)
        if disk is None and self.start_allowed(entry):
            self.notice = f"stage {stage} lost before its first checkpoint, no shards: the run goes back to its start"
            log.warning("stage %d lost every replica at step %d, before any node could checkpoint it, and no shards "
                        "rebuild it (%s): the run goes back to its start", stage, entry, why)
            self._note(stage, 0, "start", trio.current_time() - t0)
            return 0, "start"
        if disk is None:
            self.notice = f"stage {stage} lost: too few shards and no disk checkpoint of every stage here"
            log.error("stage %d is lost: %s; no disk checkpoint of every stage in %s either (%s)", stage, why,
                      self.checkpoint_root, "a node of the stage restarted with --resume can bring it back")
            return None
        snap, meta = disk
        self.notice = f"stage {stage} lost, too few shards: rolling back to disk checkpoint {meta.step}"
        log.warning("stage %d lost every replica and has too few shards: falling back to the disk checkpoint of "
                    "step %d (%s, hash %s…)", stage, meta.step, slot_name(meta.stage, meta.replica), snap.hash[:12])
        self._note(stage, meta.step, "disk", trio.current_time() - t0, snap)
        self.rebuilt = (stage, snap, "disk")
        return meta.step, "disk"

    def _note(self, stage: int, revision: int, source: str, seconds: float, snap: Snapshot | None = None,
              **more: int) -> None:
        """Record a rebuild for the status file and the benchmark."""
        self.rebuilds.append({"stage": stage, "revision": revision, "source": source,
                              **({"hash": snap.hash[:16]} if snap is not None else {}), "at": time.time(), **more,
                              "seconds": round(seconds, 3)})

    def _from_warm(self, stage: int, warm: Snapshot, t0: float) -> tuple[int, str]:
        self.notice = f"stage {stage} lost: rolling back to the warm copy of revision {warm.revision} kept here"
        log.warning("stage %d lost every replica: going back to the warm copy of revision %d this node kept as a "
                    "backup (hash %s…)", stage, warm.revision, warm.hash[:12])
        self._note(stage, warm.revision, "warm", trio.current_time() - t0, warm)
        self.rebuilt = (stage, warm, "warm")
        return warm.revision, "warm"

    def start_allowed(self, entry: int) -> bool:
        """Whether a stage lost at `entry` with nothing to rebuild it from may send the run back to its start: only
        while no node can hold a disk checkpoint of it (the first is written at step `checkpoint.every_steps`; with
        checkpoints at the end only, none before). Past that, a node of the stage restarted with `--resume` brings
        it back, and the run waits for one rather than lose its progress."""
        every = self.manifest.checkpoint.every_steps
        return every == 0 or entry <= every

    def _newest_on_disk(self, stage: int, replica: int) -> tuple[Snapshot, CheckpointMeta] | None:
        """Worker thread: `stage`'s checkpoint at the newest step every stage has one for, under the checkpoint
        folder."""
        if self.checkpoint_root is None:
            return None
        on_disk = slots_on_disk(self.checkpoint_root, self.manifest.run_id)
        stages = self.manifest.plan.stages
        steps = sorted({s for v in on_disk.values() for s in v}, reverse=True)
        for step in steps:
            if {st for (st, _), v in on_disk.items() if step in v} != set(range(stages)):
                continue
            for st, r in sorted(on_disk, key=lambda k: (k[1] != replica, k)):
                if st == stage and step in on_disk[(st, r)]:
                    try:
                        return read_checkpoint(self.checkpoint_root, self.manifest.run_id, st, r, step)
                    except CheckpointMissing as e:
                        log.warning("disk fallback: %s", e)
        return None

    # -- a rollback -------------------------------------------------------------------------------------------------
    @staticmethod
    def rollback_due(table: AssignmentTable | None, applied: int) -> Rollback | None:
        r = table.rollback if table is not None else None
        return r if r is not None and r.count > applied else None

    async def state_at(self, order: Rollback, stage: int, replica: int) -> Snapshot | None:
        """This slot's own state at the rollback's revision: the state this node rebuilt (the lost stage), its own
        snapshot (after shards), or its own disk checkpoint (after the disk fallback). None when it holds none: it
        then enters at that revision with its stage group's state, as a joiner does (after a warm copy, from the
        node that kept it). None after a rollback to the run's start: every slot builds its initial state again,
        from the manifest."""
        snap = None
        if self.rebuilt is not None and self.rebuilt[0] == stage and self.rebuilt[1].revision == order.revision \
                and order.source != "start":
            snap = self.rebuilt[1]
        elif order.source == "shards":
            snap = self.shards.own.get(order.revision)
        elif order.source == "disk" and self.checkpoint_root is not None:
            try:
                snap, _ = await trio.to_thread.run_sync(read_checkpoint, self.checkpoint_root, self.manifest.run_id,
                                                        stage, replica, order.revision)
            except CheckpointMissing as e:
                log.warning("rollback to disk checkpoint %d: %s", order.revision, e)
        if snap is not None and (not isinstance(snap.skeleton, dict) or snap.skeleton.get("stage", 0) != stage):
            return None
        self.notice = (f"rolled back to {order.revision} from {order.source}: stage {order.stage} had lost every "
                       f"replica")
        return snap

    def forget_after(self, revision: int) -> None:
        self.shards.forget_after(revision)
        if self.rebuilt is not None and self.rebuilt[1].revision > revision:
            self.rebuilt = None

    def report(self) -> dict:
        """For the status file: checkpoints written, shards held and placed, what encoding and rebuilds took."""
        ck, sh = self.checkpoints, self.shards
        return {"checkpoints": None if ck is None else {"last_step": ck.last_step, "written": ck.written[-4:],
                                                        "skipped": ck.skipped, "error": ck.error},
                "shards_held": [[h.stage, h.revision, h.index] for h in sh.holdings()],
                "shards_held_bytes": sh.store.nbytes,
                "shards_held_bytes_by_stage": {str(k): v for k, v in sh.store.nbytes_by_stage().items()},
                "shards_placed": sh.placed,
                "shard_holders": list(sh.placed_on), "encodes": sh.stats.revisions[-4:],
                "encodes_skipped": sh.stats.skipped, "own_revisions": sorted(sh.own), "rebuilds": self.rebuilds[-4:],
                "notice": self.notice}

    # -- a resumed run ------------------------------------------------------------------------------------------------
    def resume_plan(self) -> ResumePoint | None:
        return resume_point(self.resume_root, self.manifest.run_id, self.manifest.plan.stages) \
            if self.resume_root is not None else None

    async def resume_state(self, stage: int, replica: int, step: int) -> Snapshot | None:
        """This slot's checkpoint at `step` in the --resume folder, its hash checked (None: not there)."""
        if self.resume_root is None:
            return None
        try:
            snap, meta = await trio.to_thread.run_sync(read_checkpoint, self.resume_root, self.manifest.run_id, stage,
                                                       replica, step)
        except CheckpointMissing as e:
            log.info("resume: no checkpoint of %s at step %d here (%s): entering from the group",
                     slot_name(stage, replica), step, e)
            return None
        log.info("resume: %s at step %d from %s (written by %s, hash %s…)", slot_name(stage, replica), step,
                 self.resume_root, meta.peer_id[-8:], meta.state_hash[:12])
        return snap
