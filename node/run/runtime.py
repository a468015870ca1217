"""A node's part in a training run: admission, the step loop, group changes, hand-over, consistency votes.

The loop runs on the event loop and owns every piece of run state (tables, snapshots, hashes). Each training step
is one `StepControl`: the loop plans it (step number, the round's group), the trainer runs it in a worker thread,
and the loop reads back the result, the state hash and what the synchronizer learned about other members, then
acts on it (reports to the broker, votes). Nothing in the trainer thread calls back into the loop.

Group changes take effect at the step the broker names in the table (`switch_steps`), so every member changes its
group at the same round boundary. A node that enters a group at step R first pulls the state at exactly revision R
(taken by the existing members at the start of step R, with any in-flight round applied), then trains step R with
them. Replicas compare state hashes after every round and a minority replica re-fetches from the majority.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from typing import Any

import trio

from shoal.node.run.config import RunConfig
from shoal.node.run.lanes import StageLinks
from shoal.node.run.preflight import UnknownRun, check_inputs, data_source, preflight
from shoal.node.run.pulls import StatePulls
from shoal.node.run.snapshots import SnapshotStore
from shoal.node.run.status import Throughput
from shoal.node.run.entitled import MAX_STEP_LEAD, Entitlement
from shoal.node.run.verify import StageVerifier
from shoal.node.run.votes import MIN_VOTERS, HashVotes
from shoal.node.sync.interface import Synchronizer
from shoal.node.train.checkpoint import CheckpointError
from shoal.node.train.control import StepControl, StepResult
from shoal.protocol.assignment import GONE, AssignmentTable
from shoal.protocol.envelope import Signed
from shoal.protocol.lane import FWD, LinkHello
from shoal.protocol.manifest import RunManifest
from shoal.protocol.records import HardwareProfile
from shoal.swarm.net.rpc import RpcError, call
from shoal.swarm.run.authority import RunAuthority
from shoal.swarm.run.broker import AdmissionError, Broker
from shoal.swarm.run.context import RunContext
from shoal.swarm.run.client import RunClient, fetch_table
from shoal.swarm.run.collective import Collective
from shoal.swarm.run.collective_gate import CollectiveGate, inbox_limits
from shoal.swarm.run.group import Group
from shoal.swarm.lane.hub import open_link_hub
from shoal.swarm.lane.spec import LinkConfig
from shoal.swarm.run.schedule import GroupSchedule
from shoal.swarm.state.blobs import BlobServer, BlobStore, pull_blob
from shoal.swarm.state.snapshot import Snapshot, flatten_state
from shoal.swarm.state.transfer import StateServer, StateTransferError

log = logging.getLogger(__name__)

READY_POLL_S = 1.0  # a node waiting for a slot (or a backup) re-checks the table at least this often
START_POLL_S = 0.5  # a new run's first members re-check whether the group is full this often
FINAL_POLL_S = 0.5  # the end of a run: the pause between asks for the group's final hashes
VOTE_EXTRA_STEPS = 2  # after a vote, the next one waits the switch lead plus this many steps
RUN_CLAIM_WAIT_S = 10.0  # a joiner asks about its run this long even when no live peer says it trains it


class _HalfLoaded(RuntimeError):
    """Loading a state failed after it began: the trainer holds part of it."""


class RunRuntime:
    """Owned by a Node: `await nursery.start(runtime.run, joined_peers)`; read `status_fields()` for the status."""

    def __init__(self, node, config: RunConfig, hardware: HardwareProfile):
        self.node = node
        self.config = config
        self.manifest: RunManifest | None = config.manifest
        self.data_source: str | None = None  # where the trainer reads tokens (preflight.data_source)
        self.hardware = hardware
        self.clock = node.membership.clock if node.membership is not None else trio.current_time
        self.client: RunClient | None = None
        self.broker: Broker | None = None
        self.collective: Collective | None = None
        self.trainer = None
        self.sync: Synchronizer | None = None
        self.schedule: GroupSchedule | None = None
        self.snapshots = SnapshotStore(every_steps=config.snapshot_every_steps)
        self.pulls = StatePulls(node, config, self.snapshots)
        self.hashes: HashVotes | None = None
        self.throughput: Throughput | None = None
        self.entries: list[dict[str, Any]] = []  # each time this node entered a group: step, bytes, seconds
        self.at_step = 0  # optimizer steps the trainer has done (updated between steps, on the loop)
        self.state = "joining"
        self.last: StepResult | None = None
        self.error: str | None = None
        self.finished = trio.Event()
        self.refetches = 0
        self._refetch: tuple[int, str] | None = None  # (step, majority peer): load that peer's state at that step
        self._vote_after = 0  # no new vote before this step
        self._start_deadline = 0.0
        self._abandoned: dict[int, int] = {}  # stage -> the newest group epoch this node left when counted failed
        self._token: trio.lowlevel.TrioToken | None = None
        self._nursery: trio.Nursery | None = None
        self.links: StageLinks | None = None  # a pipeline stage's links to its lane neighbours (several stages)
        self._lane_broken_at: int | None = None  # the step at which this stage's lane failed, until re-formed
        self.verifier: StageVerifier | None = None  # a pipeline stage's part in verified stages
        self._lane_report_at = 0.0

    @property
    def warm(self) -> Snapshot | None:
        return self.snapshots.warm

    @property
    def votes(self) -> int:
        return self.hashes.votes if self.hashes is not None else 0

    # -- what the node publishes ---------------------------------------------------------------------------
    def status_fields(self) -> dict[str, Any]:
        c, t, s = self.client, self.trainer, self.sync
        if self.manifest is None:
            return {"state": "joining"}
        fields: dict[str, Any] = {"run_id": self.manifest.run_id, "state": self.state}
        if c is not None:
            fields["role"] = "broker" if c.is_broker() else c.role()  # the broker may hold a slot too
            fields["slot"] = c.slot_name()
            fields["warm_stage"] = c.backup_stage()
        if t is not None:
            fields["step"] = self.at_step
            if self.last is not None:
                loss = self.last.loss  # None at a stage that is not the last
                fields["loss"] = loss if loss is not None and math.isfinite(loss) else None
                fields["tokens_per_s"] = round(self.throughput.tokens_per_s(self.last.tokens_per_s), 1)
            fields["eval_loss"] = t.last_eval_loss
        if self.links is not None:
            fields.update(self.links.status_fields())
        if s is not None:
            hashes = self.hashes.hashes
            # the hash recorded with the step published (once done, the final state's)
            state_hash = hashes[max(hashes)] if self.state == "done" and hashes else hashes.get(self.at_step)
            up, down = self.throughput.rates(self.clock(), s.bytes_sent, s.bytes_recv)
            fields.update(bytes_sent=s.bytes_sent, bytes_recv=s.bytes_recv, up_bytes_per_s=up, down_bytes_per_s=down,
                          compression_ratio=round(s.compression_ratio, 2), state_hash=state_hash or None)
        if self.error:
            fields["error"] = self.error[:200]
        return fields

    def link_counters(self) -> dict[str, Any]:
        """This stage's current lane links ("b0/fwd"...): the neighbour and the messages and bytes each way."""
        return self.links.counters() if self.links is not None else {}

    def link_digests(self) -> dict[str, dict[str, str]]:
        """This stage's AQ-SGD link ends ("b0/fwd/receiver"...): store digest by step, over the last steps."""
        return self.links.recent_digests() if self.links is not None else {}

    # -- groups by step ------------------------------------------------------------------------------------
    def _on_table(self, table: AssignmentTable) -> None:
        if self.schedule.add(table):
            for step in self.schedule.switch_steps(table):
                self.snapshots.request(step)
            if table.provider_state(self.node.peer_id) == GONE and self.at_step > 0:
                self._abandon(self.group_at(self.at_step))

    def _abandon(self, group: Group | None) -> None:
        """The broker counts this node failed (it was frozen, or cut off) while it held `group`: the group goes on
        without it, so it never trains that group's remaining steps (they would be its own, served to nobody
        good); it waits to be placed again and then enters with the group's state."""
        if group is not None and group.epoch > self._abandoned.get(group.stage, -1):
            self._abandoned[group.stage] = group.epoch
            log.warning("the run counts this node failed: leaving the group of stage %d (epoch %d) at step %d",
                        group.stage, group.epoch, self.at_step)

    def _group_to_train(self, step: int) -> Group | None:
        g = self.group_at(step)
        return None if g is not None and g.epoch <= self._abandoned.get(g.stage, -1) else g

    def group_at(self, step: int) -> Group | None:
        return self.schedule.group_at(step)

    def _known_steps(self) -> list[tuple[int, float]]:
        """(step, tokens/s) of this node and of the run's peers, from their status records."""
        statuses = [(e.peer_id, e.status_record) for e in self.node.membership.live_peers()
                    if e.status_record is not None]
        own_rate = self.throughput.tokens_per_s(self.last.tokens_per_s) \
            if self.throughput is not None and self.last is not None else 0.0
        return self.entitled.progress(self.at_step, self.manifest.run_id, statuses, own_rate)  # members, clamped

    def switch_step(self, stage: int) -> int:
        """Where a group change can take effect: the furthest step anyone reports, plus ~switch_lead_s of steps
        (every stage of a run steps together, so the same bound serves each)."""
        steps = self._known_steps()
        top = max(s for s, _ in steps)
        if top == 0:
            return 0  # nothing trained yet: the change can apply from the start
        tps = max((r for _, r in steps), default=0.0)
        per_step = self.manifest.batch.batch_size * self.manifest.batch.seq_len
        rate = tps / per_step if tps > 0 else 1.0
        return top + max(self.config.switch_lead_min_steps, math.ceil(self.config.switch_lead_s * rate))

    def _lane_named(self, peer: str, hello: LinkHello) -> bool:
        """Whether the tables this node follows (in force from the step before ours, or announced) name `peer` at
        the dialing end of `hello`'s link and this node at the other (swarm/lane/hub.py asks, for every dial)."""
        lower, upper = hello.boundary, hello.boundary + 1
        dialer, mine = (lower, upper) if hello.direction == FWD else (upper, lower)
        return self.schedule.names_on_lane(peer, dialer, hello.lane, mine, max(0, self.at_step - 1))

    # -- state between nodes -------------------------------------------------------------------------------
    async def _rpc_snapshot_at(self, caller: str, body: Any) -> Any:
        if not isinstance(body, int) or isinstance(body, bool) or body < 0:
            raise ValueError("snapshot_at takes a step number")
        refusal = self.entitled.snapshot_refusal(caller, body, self.at_step)
        if refusal is not None:
            if refusal[1]:
                self.node.penalties.penalize(caller, f"snapshot_at: {refusal[0]}")
            raise ValueError(f"snapshot_at refused: {refusal[0]}")
        self.snapshots.request(body)
        return {"ok": True, "step": self.at_step}

    async def _ask_snapshot(self, peer: str, step: int) -> int | None:
        """Ask `peer` to keep its state at `step` (a backup's warm copy); its own step, or None."""
        try:
            ans = await self.node_call(peer, "run.snapshot_at", step)
        except RpcError as e:
            log.info("snapshot request to %s failed: %s", peer, e)
            return None
        got = ans.get("step") if isinstance(ans, dict) else None
        return got if isinstance(got, int) and not isinstance(got, bool) else None

    async def _load(self, snap: Snapshot) -> None:
        """Load the group's entry state (pulled with the hash the group agrees on), then let the synchronizer restart
        local state from it. A state that does not fit this trainer is refused before any of it is loaded; one that
        fails while loading leaves a trainer of unknown state, which is dropped (rebuilt before the next entry).
        Either way StateTransferError: never an error that stops the node."""
        state = snap.state()

        def load() -> None:
            self.trainer.check_entry(state, snap.revision)  # CheckpointError: nothing loaded
            try:
                self.trainer.load_state_dict(state)
                self.sync.enter(self.trainer.model)
            except Exception as e:  # noqa: BLE001 - a half-loaded trainer must not train on
                raise _HalfLoaded(f"{type(e).__name__}: {e}") from e

        try:
            await trio.to_thread.run_sync(load)
        except CheckpointError as e:
            raise StateTransferError(f"the agreed state does not fit this trainer: {e}") from e
        except _HalfLoaded as e:
            self.trainer = self.sync = None
            raise StateTransferError(f"loading the agreed state failed half way ({e}): the trainer is rebuilt") from e
        self.at_step = self.trainer.step_count

    def _blob_root(self):
        import tempfile
        from pathlib import Path

        return Path(self.config.blob_dir) if self.config.blob_dir else Path(tempfile.gettempdir()) / "shoal-blobs"

    async def _fetch_blobs(self) -> dict[str, Any]:
        """The files the run names by hash (weights, tokenizer): from the local store, else from peers (the owner,
        the broker, the table's members, then any live peer of the run), each checked against its hash."""
        got: dict[str, Any] = {}
        for digest, size in self.manifest.blobs():
            if self.blobs.path(digest) is None:
                t = self.client.table if self.client is not None else None
                members = [t.peer_id, *(s.peer_id for s in t.slots), *t.backups] if t is not None else []
                live = [e.peer_id for e in self.node.membership.live_peers() if e.status_record is not None
                        and e.status_record.run_id == self.manifest.run_id]
                peers = list(dict.fromkeys(p for p in [self.manifest.owner, *members, *live]
                                           if p and p != self.node.peer_id))
                what = "weights" if size else "tokenizer"
                log.info("fetching the run's %s (%s…) from %d peers", what, digest[:12], len(peers))
                t0 = self.clock()
                await pull_blob(self.node.sh, self.blobs, digest, size, peers, penalties=self.node.penalties,
                                attempt_s=self.config.blob_pull_attempt_s, max_bytes=size or (64 << 20))
                log.info("fetched the run's %s in %.1f s", what, self.clock() - t0)
            got[digest] = self.blobs.path(digest)
        return got

    # -- entering a group ----------------------------------------------------------------------------------
    async def _build_trainer(self, stage: int, replica: int) -> None:
        from shoal.node.sync.base import SyncConfig
        from shoal.node.sync.factory import make_synchronizer
        from shoal.node.train.trainer import Trainer

        exchange = self.collective.blocking(self._token)
        files = await self._fetch_blobs()
        tokenizer = files.get(self.manifest.data.tokenizer)
        weights = files.get(self.manifest.model.hf.weights) if self.manifest.model.hf is not None else None

        def build():
            import torch

            from shoal.node.train.data import load_run_corpus
            from shoal.node.train.lane import Unconnected

            if self.config.threads:
                torch.set_num_threads(self.config.threads)
            sync = make_synchronizer(self.manifest, exchange=exchange, penalties=self.node.penalties,
                                     config=SyncConfig(round_timeout_s=self.config.round_timeout_s))
            boundary = Unconnected() if self.manifest.plan.stages > 1 else None  # links open before each step
            corpus = load_run_corpus(self.manifest, self.data_source, tokenizer)
            trainer = Trainer(self.manifest, device=self.config.device, stage=stage, replica=replica,
                              boundary=boundary, synchronizer=sync, corpus=corpus, weights=weights)
            return trainer, sync

        self.trainer, self.sync = await trio.to_thread.run_sync(build)
        self.throughput = Throughput(self.trainer.tokens_per_step)
        self.at_step = self.trainer.step_count

    async def _enter(self, step: int, stage: int, replica: int) -> None:
        """Take a place in the group from `step`: build the trainer, and unless the run starts here, load the
        state of exactly `step` from a replica that was in the group before."""
        self.state = "joining"
        if self.trainer is not None and (self.trainer.stage, self.trainer.replica) != (stage, replica):
            log.info("slot changes from s%dr%d to s%dr%d: a new trainer", self.trainer.stage, self.trainer.replica,
                     stage, replica)
            if self.links is not None:
                await self.links.close()
            self.trainer = None  # another stage holds other parameters; another lane reads other samples
        if self.trainer is None:
            await self._build_trainer(stage, replica)
        if step == 0 and self.at_step == 0:
            return
        me = self.node.peer_id
        prev = self.group_at(step - 1) if step > 0 else None
        now = self.schedule.table_at(step, stage)
        staying = set(now.members(stage)) if now is not None else set()
        # the members that stay in the group serve the revision first (one that was counted failed may hold another)
        peers = sorted((m for m in (prev.members if prev else ()) if m != me), key=lambda m: m not in staying)
        if not peers:
            t = self.schedule.table_at(step, stage)
            peers = [m for m in (t.members(stage) if t else ()) if m != me]
        t0 = self.clock()
        log.info("entering the group at step %d: pulling that revision from %s", step, [p[-8:] for p in peers])
        try:
            snap = await self.pulls.revision(step, peers, wanted=lambda: self.schedule.entry() == (step, stage, replica))
            await self._load(snap)
        except StateTransferError as e:  # no majority state to enter with (the replicas differ until their vote
            # settles it), a state that does not fit, or the slot changed: wait for the broker's next table and try
            # its entry then
            log.warning("could not enter the group at step %d: %s", step, e)
            self.state = "ready"
            await self._wait_for_table(READY_POLL_S)
            return
        took, pulled = self.clock() - t0, snap.nbytes
        whole = sum(t.numel() * t.element_size() for t in flatten_state(self.trainer.state_dict())[0].values())
        self.entries.append({"step": step, "bytes_pulled": pulled, "state_bytes": whole, "seconds": round(took, 3)})
        log.info("entered the group at step %d with the state its members agree on: %d bytes pulled for a state of "
                 "%d (%.2f s)", step, pulled, whole, took)

    async def _enter_at_end(self, limit: int, stage: int, replica: int) -> None:
        """Our slot takes effect at or past the run's last step (a slot filled near the end): the run ends before
        this node could train in it. Take the run's final state instead (revision limit + 1, which every replica of
        the stage serves once done), so this node ends with the group's state and counts as done with it."""
        self.state = "joining"
        if self.trainer is None:
            await self._build_trainer(stage, replica)
        tables = [t for t in (self.schedule.table_at(limit - 1, stage), self.schedule.latest) if t is not None]
        peers = sorted({m for t in tables for m in t.members(stage)} - {self.node.peer_id})
        log.info("our slot takes effect after the run's last step %d: pulling the final state from %s", limit,
                 [p[-8:] for p in peers])
        try:
            await self._load(await self.pulls.revision(limit + 1, peers))
        except StateTransferError as e:
            log.warning("no final state the group agrees on (%s): this node ends with its own", e)

    def _left_behind(self, step: int) -> bool:
        """The other members of our stage report steps more than `switch_lead_min_steps` ahead of ours (we entered
        after the group's deadline, or stood still) and our slot in the newest table takes effect ahead of us:
        training through rounds the others have passed only meets deadlines; entering at that step with the group's
        state catches up at once."""
        entry, t = self.schedule.entry(), self.schedule.latest
        if entry is None or entry[0] <= step:
            return False
        members = set(t.members(entry[1])) - {self.node.peer_id}
        top = max((e.status_record.step for e in self.node.membership.live_peers()
                   if e.peer_id in members and e.status_record is not None
                   and e.status_record.run_id == self.manifest.run_id), default=step)
        if top - step <= self.config.switch_lead_min_steps:
            return False
        log.info("the group is at step %d, this node at %d: entering at step %d with the group's state", top, step,
                 entry[0])
        return True

    def _group_full(self) -> bool:
        t = self.schedule.latest
        return t is not None and all(len(t.members(s)) >= self.manifest.plan.replicas for s in range(t.stages))

    # -- one step ------------------------------------------------------------------------------------------
    async def _step(self, group: Group) -> None:
        """Run step `at_step` with `group`: first the snapshot a joiner or a backup needs (stored before the step
        runs, so it is served while the group waits for the joiner), then the step itself; then act on it."""
        t = self.trainer
        if self.links is not None:
            await self.links.connect(t, self.schedule.table_at(self.at_step, t.stage), self.at_step)
        control = StepControl(step=self.at_step, group=group)
        if self.snapshots.wanted(control.step):
            self.snapshots.add(await trio.to_thread.run_sync(self._snapshot, control))
        checks = await self._before_checks(t, control.step)
        t0 = self.clock()
        self.last = await trio.to_thread.run_sync(t.step, control)
        self.at_step = t.step_count
        self.throughput.step_done(self.clock())
        if checks is not None:
            self._nursery.start_soon(self._verify, t, group, *checks)
        self.hashes.record(self.at_step, control.state_hash)
        if control.missing and self._froze_since(t0):
            log.info("step %d: not reporting %d members missing: this process stood still during the step",
                     control.step, len(control.missing))
            control.missing.clear()
        self._report(control, group)
        if self.last.aborted is not None:  # the lane failed at this step: wait for it to be re-formed
            self._lane_broken_at = control.step
            self._lane_report_at = self.clock() + self.config.round_timeout_s
        rest = self.config.min_step_s - (self.clock() - t0)
        if rest > 0:
            await trio.sleep(rest)  # paced: a step takes at least min_step_s (a slower model, emulated)

    # -- verified stages (node/run/verify.py) -----------------------------------------------------------------
    async def _before_checks(self, t, step: int) -> tuple[AssignmentTable, int, int, list[int]] | None:
        """A verified run, before step `step`: keep the stage's weights (any replica of the stage may ask for a
        re-execution of this step), and draw the micro-batches of the monitored lane to check; None: none."""
        v = self.verifier
        if v is None or not v.enabled:
            return None
        await trio.to_thread.run_sync(v.keep_weights, t, step)
        table = self.schedule.table_at(step, t.stage)
        lane = v.monitored_lane(table, t.replica) if table is not None else None
        if table is not None and self.sync is not None:
            await self._lane_statistics(table, t)
        micros = v.draw(t.micro_batches, lane) if lane is not None else []
        return (table, step, lane, micros) if micros else None

    async def _lane_statistics(self, table: AssignmentTable, t) -> None:
        """Cheap evidence between samples: a member this replica's aggregation left out or clipped points at its
        lane (a stage of that lane may have fed it tampered values). Its lane is checked more often here, and the
        lane neighbours of this stage (whose replicas check the stages it borders) are told."""
        lanes = {table.slot_of(m)[1] for m in self.sync.take_outliers() if table.slot_of(m) is not None}
        neighbours = [p for p in (self.links.peers or ()) if p is not None] if self.links is not None else []
        for lane in lanes - {t.replica}:
            await self._lane_hint(lane)
            for peer in neighbours:
                self._nursery.start_soon(self._send_hint, peer, lane)

    async def _lane_hint(self, lane: int) -> None:
        t = self.trainer
        table = self.schedule.table_at(self.at_step, t.stage) if t is not None else None
        if table is not None and self.verifier.monitored_lane(table, t.replica) == lane:
            self.verifier.boost(lane)

    async def _send_hint(self, peer: str, lane: int) -> None:
        try:
            await self.node_call(peer, "run.lane_hint", {"lane": lane})
        except RpcError as e:
            log.debug("lane hint to %s: %s", peer[-8:], e)

    async def _rpc_lane_hint(self, caller: str, body: Any) -> Any:
        """A lane neighbour's statistics point at `lane`: check it more often if this replica checks it."""
        if self.links is None or caller not in (self.links.peers or ()):
            raise PermissionError("lane hints come from this stage's lane neighbours only")
        if not isinstance(body, dict) or not isinstance(body.get("lane"), int) or isinstance(body.get("lane"), bool):
            raise ValueError("a lane hint names a lane")
        await self._lane_hint(body["lane"])
        return {"ok": True}

    async def _verify(self, t, group: Group, table: AssignmentTable, step: int, lane: int, micros: list[int], *,
                      confirming: bool = False) -> None:
        """Check the sampled micro-batches; act on a finding (see node/run/verify.py)."""
        for micro in micros:
            f = await self.verifier.check(t, table, step, micro, lane, confirming=confirming)
            if f is None or f.why == "equivocation":
                continue  # (a neighbour that signed two things is penalized here; its stage is not ours to report)
            if self.sync is not None:
                self.sync.distrust(f.suspect)
            if self.client is not None:
                await self.client.report_missing([], epoch=group.epoch, stage=group.stage, offenders=[f.suspect])
            if not confirming:  # the other replicas of the stage re-execute it too: most of them evict it
                for peer in group.members:
                    if peer not in (self.node.peer_id, f.suspect):
                        self._nursery.start_soon(self._ask_confirmation, peer, f)
            return

    async def _ask_confirmation(self, peer: str, f) -> None:
        try:
            await self.node_call(peer, "run.accuse", {"step": f.step, "micro": f.micro, "lane": f.lane})
        except RpcError as e:
            log.info("asking %s to re-check step %d #%d of lane %d: %s", peer[-8:], f.step, f.micro, f.lane, e)

    async def _rpc_accuse(self, caller: str, body: Any) -> Any:
        """Another replica of this stage found lane `lane`'s stage tampering at (step, micro): re-execute it here
        with the weights this replica held at that step, and report it too when it agrees."""
        t, g = self.trainer, self.group_at(self.at_step)
        if t is None or g is None or caller not in g.members or self.verifier is None:
            raise PermissionError("only a replica of this stage may ask for a re-check")
        if not isinstance(body, dict) or not all(isinstance(body.get(k), int) and not isinstance(body.get(k), bool)
                                                 for k in ("step", "micro", "lane")):
            raise ValueError("a re-check is asked as {step, micro, lane}")
        table = self.schedule.table_at(body["step"], t.stage)
        if table is None or body["lane"] not in table.complete_lanes() or body["lane"] == t.replica:
            raise ValueError("no such lane to re-check")
        self._nursery.start_soon(functools.partial(self._verify, t, g, table, body["step"], body["lane"],
                                                   [body["micro"]], confirming=True))
        return {"ok": True}

    def _froze_since(self, t0: float) -> bool:
        """Whether this process stood still (SIGSTOP, suspend) since `t0`: the silence it saw then was its own."""
        pulse = self.node.pulse
        if pulse is None:
            return False
        pulse.check()
        return pulse.resumed_at >= t0

    def _snapshot(self, control: StepControl, revision: int | None = None) -> Snapshot:
        """Worker thread: the state at the round boundary of `control.step`, as a snapshot (taken as revision
        `revision`, by default that step)."""
        state = self.trainer.snapshot(control)
        return Snapshot.of(state, control.step if revision is None else revision, copy=False)

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
        if (control.missing or control.offenders or neighbours) and self.client is not None:
            self._nursery.start_soon(lambda: self.client.report_missing(
                sorted(control.missing), epoch=group.epoch, stage=group.stage, offenders=sorted(control.offenders),
                neighbours=neighbours))

    async def _finish(self, limit: int) -> None:
        """The end of the run: apply the last round, then make sure this replica ends with the majority's state
        (a divergence in the last steps would otherwise outlive the run). The final state is revision limit + 1
        (what step limit + 1 would start from); every replica serves it, and a minority replica pulls it from a
        majority peer."""
        t, final_rev = self.trainer, limit + 1
        g = self.group_at(limit - 1)
        control = StepControl(step=self.at_step, group=g)
        final = await trio.to_thread.run_sync(self._snapshot, control, final_rev)
        self.snapshots.add(final, exact=True)
        self.hashes.record(final_rev, self.sync.state_hash())
        if g is not None:
            self._report(control, g)
        if g is not None and g.size >= MIN_VOTERS:
            self.state = "syncing"
            votes: dict[str, str] = {}
            abstained: set[str] = set()  # members that hold no final state (one that never entered): after the
            #                              wait they have no say, as in a vote during the run
            with trio.move_on_after(self.config.final_check_s):
                while True:
                    votes, abstained = await self.hashes.gather(g, final_rev)
                    if len(votes) >= len(self._voters(g)):
                        break
                    await trio.sleep(FINAL_POLL_S)  # the others are still on their last steps
            voters = self._voters(g) - abstained
            src = self.hashes.source(g, final_rev, votes, voters=len(voters)) if votes else None
            if src is not None:  # the final state the members agree on, from a random one holding it
                others = sorted(voters - {self.node.peer_id})
                try:
                    await self._load(await self.pulls.revision(final_rev, others))
                except StateTransferError as e:
                    log.warning("final state hash disagreed with the majority, and no state the members agree on "
                                "could be loaded (%s): this replica ends with its own state", e)
                else:
                    self.refetches += 1
                    self.hashes.record(final_rev, self.sync.state_hash())
                    log.warning("final state hash disagreed with the majority: loaded the final state the members "
                                "agree on")
        t.last_eval_loss = await trio.to_thread.run_sync(t.evaluate)

    def _live(self) -> set[str]:
        """The peers this node's membership view holds live."""
        return {e.peer_id for e in self.node.membership.live_peers()}

    def _voters(self, g: Group) -> set[str]:
        """The members of `g` that can still vote: this node and those its membership view holds live (a member
        killed near the end never answers; waiting for it would only hold the run's end up)."""
        live = self._live()
        return {m for m in g.members if m == self.node.peer_id or m in live}

    async def _refetch_now(self, step: int) -> None:
        """Load the state the group agrees on at `step` (the vote said ours is not it): its members hash their whole
        entry state there, and the one a majority holds is pulled from a random one of them. Given up (the next
        vote decides again) when no majority state can be had, or the member the vote named is gone."""
        src, self._refetch = self._refetch[1], None
        self.state = "syncing"
        g = self.group_at(step)
        members = [m for m in (g.members if g is not None else (src,)) if m != self.node.peer_id]
        try:
            await self._load(await self.pulls.revision(step, members, wanted=lambda: src in self._live()))
        except StateTransferError as e:
            log.warning("could not re-fetch step %d (%s): voting again", step, e)
            return
        self.refetches += 1
        log.warning("state hash disagreed with the majority: re-fetched the state the members agree on at step %d",
                    step)

    async def _check_consistency(self) -> None:
        """After a step: if a member published a different hash for a step we hold, vote; a minority replica asks
        a majority peer for a snapshot a few steps ahead and loads it there."""
        step = self.at_step
        statuses = [(e.peer_id, e.status_record) for e in self.node.membership.live_peers()
                    if e.status_record is not None]
        g = self.group_at(step)
        self.hashes.note_claims(g, self.manifest.run_id, statuses)
        claims = self.hashes.due_claims()
        if self._refetch is not None or step < self._vote_after or not claims:
            return
        self._vote_after = step + self.config.switch_lead_min_steps + VOTE_EXTRA_STEPS
        src = await self.hashes.vote(g, claims)
        offenders = self.hashes.take_offenders()
        for peer, why in offenders.items():  # most members' reports evict it (the broker's rule)
            self.node.penalties.penalize(peer, why)
        if offenders and self.client is not None:
            self._nursery.start_soon(lambda: self.client.report_missing(
                [], epoch=g.epoch, stage=g.stage, offenders=sorted(offenders)))
        if src is not None:  # every member keeps its state a few steps ahead: the majority's is loaded there
            target = step + self.config.switch_lead_min_steps
            kept: list[str] = []

            async def ask(peer: str) -> None:
                if await self._ask_snapshot(peer, target) is not None:
                    kept.append(peer)
            async with trio.open_nursery() as n:
                for peer in g.members:
                    if peer != self.node.peer_id:
                        n.start_soon(ask, peer)
            if src in kept:
                self._refetch = (target, src)

    async def _wait_for_table(self, timeout_s: float) -> None:
        with trio.move_on_after(timeout_s):
            await self.client.wait_changed()

    async def _rejoin_lane(self, limit: int) -> None:
        """A stage whose lane step failed waits, instead of stepping on alone (its lane's stages would fall out of
        step with each other), for a table that re-forms its lane from a later switch step (a backup promoted into
        the failed slot, or the same members re-formed), and enters the lane there with its stage group's state at
        that step, as a joining replica does. The broker hears of the failure again every round timeout."""
        entry = self.schedule.entry()
        t = self.schedule.latest
        if entry is not None and entry[0] > self._lane_broken_at and entry[2] in t.complete_lanes():
            self._lane_broken_at = None
            if entry[0] < limit:
                await self._enter(*entry)
            return
        self.state = "ready"
        if self.clock() >= self._lane_report_at:
            self._lane_report_at = self.clock() + self.config.round_timeout_s
            g = self.group_at(self.at_step)
            prev, nxt = (self.links.peers if self.links is not None else None) or (None, None)
            if g is not None:
                self._nursery.start_soon(lambda: self.client.report_missing(
                    [], epoch=g.epoch, stage=g.stage, neighbours=[p for p in (prev, nxt) if p]))
        await self._wait_for_table(READY_POLL_S)

    async def _train(self) -> None:
        limit = self.config.max_steps if self.config.max_steps is not None else self.manifest.optim.total_steps
        while True:
            t, step = self.trainer, self.at_step
            if t is not None and step >= limit:
                await self._finish(limit)
                self.state = "done"
                self.finished.set()
                await trio.sleep_forever()
            if step == 0 and not self._group_full() and self.clock() < self._start_deadline:
                self.state = "ready"  # a new run: wait for the group to fill, so every replica starts at step 0
                await self._wait_for_table(START_POLL_S)
                continue
            if self._lane_broken_at is not None:
                await self._rejoin_lane(limit)
                continue
            g = self._group_to_train(step) if t is not None else None
            if g is not None and self._left_behind(step):
                g = None  # enter our next group with its state rather than train through rounds the others passed
            if g is None:
                entry = self.schedule.entry()
                if entry is not None and (t is None or entry[0] > step) and entry[0] < limit:
                    await self._enter(*entry)
                    continue
                if entry is not None and (t is None or entry[0] > step):
                    await self._enter_at_end(limit, *entry[1:])  # the run ends before this slot takes effect
                    continue
                self.state = "ready"  # a backup, or waiting for the step at which our slot takes effect
                await self._wait_for_table(READY_POLL_S)
                continue
            if self._refetch is not None and step >= self._refetch[0]:
                await self._refetch_now(step)
            self.state = "training"
            await self._step(g)
            await self._check_consistency()

    # -- RPC and set-up ------------------------------------------------------------------------------------
    async def node_call(self, peer: str, method: str, body: Any) -> Any:
        return await call(self.node.sh, peer, method, body, timeout_s=self.config.client.rpc_timeout_s)

    async def _rpc_manifest(self, caller: str, body: Any) -> Any:
        if body != self.manifest.run_id:
            raise ValueError("this node trains another run")
        return self.manifest.to_bytes()

    def _training(self, run_id: str) -> list[str]:
        """The live peers whose status says they train run `run_id`."""
        return [e.peer_id for e in self.node.membership.live_peers()
                if e.status_record is not None and e.status_record.run_id == run_id]

    def _run_peers(self, run_id: str, joined: list[str]) -> list[str]:
        """Whom to ask about run `run_id`: the peers this node joined through, then the live peers whose status
        says they train it (one --join peer that denies the run must not keep a joiner from the others)."""
        return list(dict.fromkeys([*joined, *self._training(run_id)]))

    def _ask_again(self, run_id: str, since: float) -> bool:
        """Whether to ask about run `run_id` once more: within `admit_timeout_s`, and past RUN_CLAIM_WAIT_S only
        while a live peer says it trains the run (status records come by gossip within a few seconds: a run id
        nobody trains is given up on then)."""
        cfg, waited = self.config.client, self.clock() - since
        return waited + cfg.retry_s <= cfg.admit_timeout_s and (waited < RUN_CLAIM_WAIT_S or
                                                               bool(self._training(run_id)))

    async def fetch_manifest(self, run_id: str, joined: list[str]) -> RunManifest:
        """The signed manifest of `run_id`, verified and checked against the id, from one of the joined peers or
        the live peers training the run, asking again for `admit_timeout_s` (the others' status records come by
        gossip a little after the join)."""
        cfg, t0 = self.config.client, self.clock()
        while True:
            for p in self._run_peers(run_id, joined):
                try:
                    raw = await self.node_call(p, "run.manifest", run_id)
                    m = RunManifest.from_bytes(raw)
                    m.verify()
                    if m.run_id != run_id:
                        raise ValueError("the manifest does not hash to the run id")
                    return m
                except (RpcError, ValueError, TypeError) as e:
                    log.info("manifest from %s: %s", p, e)
            if not self._ask_again(run_id, t0):
                raise UnknownRun(f"no joined peer gave the manifest of run {run_id[:16]}…, nor any of the "
                                 f"{len(self._training(run_id))} live peers that say they train it")
            await trio.sleep(cfg.retry_s)

    async def _find_table(self, joined: list[str], *, patient: bool) -> tuple[Signed, str] | None:
        """The newest table the joined peers and the live peers training the run hold (and a peer that served it),
        asking again for `admit_timeout_s`. A node that is not `patient` (it holds the manifest, has no --join and
        reached peers only from its recent-peers file, none of which says it trains this run) asks once, and None
        means nobody knows the run: this node starts it."""
        cfg, t0 = self.config.client, self.clock()
        while True:
            best: tuple[Signed, str] | None = None
            for p in self._run_peers(self.manifest.run_id, joined):
                try:
                    got = await fetch_table(self.node.sh, p, self.manifest.run_id, timeout_s=cfg.rpc_timeout_s,
                                            authority=RunAuthority(self.manifest), penalties=self.node.penalties)
                except RpcError as e:
                    log.info("no run table from %s: %s", p, e)
                    continue
                if best is None or got.record.newer_than(best[0].record):
                    best = got, p
            if best is not None or not patient:
                return best
            if not self._ask_again(self.manifest.run_id, t0):
                raise UnknownRun(f"none of the joined peers knows run {self.manifest.run_id[:16]}…, nor any of "
                                 f"the {len(self._training(self.manifest.run_id))} live peers that say they train it")
            await trio.sleep(cfg.retry_s)

    async def run(self, joined: list[str], *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        node = self.node
        self._token = trio.lowlevel.current_trio_token()
        self._start_deadline = self.clock() + self.config.start_wait_s
        if self.manifest is None:
            self.manifest = await self.fetch_manifest(self.config.run_id, joined)
        preflight(self.manifest, self.config)  # the device's memory (run/preflight.py)
        if self.manifest.join.mode == "secret" and not self.config.secret:  # to prove it, or as broker to check it
            raise AdmissionError("this run is private: a join secret is required")
        self.data_source = data_source(self.manifest, self.config)  # never a path a network manifest chose
        await trio.to_thread.run_sync(check_inputs, self.manifest, self.data_source)  # packages, the Hub, files
        self.schedule = GroupSchedule(node.peer_id)
        self.hashes = HashVotes(node.peer_id, self.node_call)
        sync = self.manifest.plan.sync
        self.entitled = Entitlement(lambda: self.client.table if self.client is not None else None, self.clock,
                                    max_lead_steps=max(MAX_STEP_LEAD, 2 * sync.diloco.inner_steps
                                                       if sync.method == "diloco" else 0))
        node.rpc.register("run.manifest", self._rpc_manifest)
        ctx = RunContext(sh=node.sh, manifest=self.manifest, register=node.rpc.register, publish=node.publish,
                         membership=node.membership, penalties=node.penalties, switch_step=self.switch_step,
                         step=lambda: self.at_step, clock=self.clock, pulse=node.pulse)
        lim = inbox_limits(self.manifest, self.config.round_timeout_s)
        overlap = 1 + (sync.diloco.overlap_steps if sync.method == "diloco" else 0)  # a round runs on that long
        self.collective = Collective(node.sh, node.penalties,  # only members of known groups, under their tags
                                     gate=CollectiveGate(self.manifest.run_id, lambda: self.schedule.tables,
                                                         step=lambda: max(0, self.at_step - overlap)),
                                     max_frame_bytes=lim.max_frame_bytes, max_wait_s=lim.max_wait_s,
                                     max_peer_buffer_bytes=lim.max_peer_buffer_bytes,
                                     max_buffer_bytes=lim.max_buffer_bytes)
        StateServer(node.sh, lambda: self.snapshots.latest, penalties=node.penalties, by_revision=self.snapshots.at,
                    step=lambda: self.at_step,
                    allow=self.entitled.member)  # model state for the run's members and backups only
        node.rpc.register("run.snapshot_at", self._rpc_snapshot_at)
        self.blobs = BlobStore(self._blob_root())  # the run's weights and tokenizer, for peers that need them
        BlobServer(node.sh, self.blobs, named=lambda: [h for h, _ in self.manifest.blobs()], penalties=node.penalties,
                   allow=None if self.manifest.join.mode == "open" else self.entitled.member)
        node.rpc.register("run.hash_at", self.hashes.rpc_hash_at)
        plan = self.manifest.plan
        links = open_link_hub(node.sh, node.penalties, LinkConfig(), allow=self.entitled.member,
                              plan=(self.manifest.run_id, plan.stages, plan.replicas), named=self._lane_named) \
            if plan.stages > 1 else contextlib.nullcontext()  # a pipeline stage's links to its lane neighbours
        async with links as hub, trio.open_nursery() as nursery:
            self._nursery = nursery
            if hub is not None:
                self.verifier = StageVerifier(
                    me=node.peer_id, run_id=self.manifest.run_id, fraction=plan.pipeline.verify_fraction,
                    kind=plan.pipeline.wire_dtype, penalize=node.penalties.penalize,
                    weights_hash=lambda step: self.hashes.hashes.get(step),
                    call=lambda p, m, b, max_response_bytes: call(node.sh, p, m, b, max_response_bytes=max_response_bytes,
                                                                  timeout_s=self.config.client.rpc_timeout_s))
                self.links = StageLinks(hub, self._token, self.manifest, node.peer_id, self.config.aq_buffer_dir,
                                        self.verifier.transcript if self.verifier.enabled else None)
                self.verifier.signatures = self.links.signatures
                node.rpc.register("run.evidence", functools.partial(self.verifier.rpc_evidence,
                                                                    member=self.entitled.member))
                node.rpc.register("run.accuse", self._rpc_accuse)
                node.rpc.register("run.lane_hint", self._rpc_lane_hint)
            # a node that restarted finds its run again from its peers (the table may name this node as broker)
            patient = bool(node.config.host.join) or self.config.manifest is None or any(
                e.status_record is not None and e.status_record.run_id == self.manifest.run_id
                for e in node.membership.live_peers())  # a peer trains this run: never start a second one
            found = await self._find_table(joined, patient=patient) if joined else None
            if found is None and self.manifest.owner not in ("", node.peer_id):
                raise UnknownRun(f"nobody knows run {self.manifest.run_id[:16]}…, and only its owner "
                                 f"{self.manifest.owner[:16]}… may start its broker")
            if found is None:  # nobody knows the run: the node started with the manifest hosts its broker
                self.broker = Broker(ctx, self.config.broker, secret=self.config.secret)
                await nursery.start(self.broker.run)
            self.client = RunClient(ctx, self.hardware, broker_id=found[0].record.peer_id if found else node.peer_id,
                                    secret=self.config.secret, config=self.config.client,
                                    broker_config=self.config.broker, local_broker=self.broker)
            self.client.on_change.append(self._on_table)
            if found is not None:
                self.client.accept_envelope(found[0].raw, found[1])
            node.extra_ingest.append(self.client.on_record)
            await nursery.start(self.client.run)
            if self.client.table is not None:
                self._on_table(self.client.table)
            task_status.started(self)
            nursery.start_soon(self.pulls.keep_warm, self.client, self.switch_step, self._ask_snapshot)
            await self._train()

    async def leave(self) -> None:
        if self.client is not None:
            with trio.move_on_after(self.config.leave_timeout_s):
                try:
                    await self.client.leave()
                except Exception as e:  # noqa: BLE001 - leaving anyway
                    log.info("leave notice to the broker failed: %s", e)
