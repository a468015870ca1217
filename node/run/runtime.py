"""A node's part in a training run: admission, the trainer in a worker thread, group synchronization, hand-over.

Group changes take effect at the step the broker names in the table (`switch_steps`), so every member changes its
group at the same round boundary. A node that enters a group at step R first pulls the state at exactly revision R
(taken by the existing members at the start of step R, with any in-flight round applied), then trains step R with
them. Replicas compare state hashes after every round and a minority replica re-fetches from the majority.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import trio

from shoal.protocol.assignment import AssignmentTable
from shoal.protocol.manifest import RunManifest
from shoal.protocol.records import HardwareProfile
from shoal.swarm.run.broker import Broker, BrokerConfig, RunContext
from shoal.swarm.run.collective import Collective
from shoal.swarm.run.group import Group
from shoal.swarm.net.rpc import RpcError
from shoal.swarm.run.client import RunClient, RunClientConfig, fetch_table
from shoal.swarm.state.transfer import (MAX_PREFIXES, Snapshot, StateServer, StateTransferError, keep_warm,
                                        pull_state)

log = logging.getLogger(__name__)
MAX_TABLES = 64
MAX_SNAPSHOTS = 4


@dataclass(frozen=True, kw_only=True, slots=True)
class RunConfig:
    manifest: RunManifest | None = None  # None: fetched from the joined peers by `run_id`
    run_id: str | None = None
    secret: str | None = None
    device: str = "cpu"
    threads: int | None = None  # torch threads for the trainer (None: torch's default)
    max_steps: int | None = None  # stop training after this many steps (None: the manifest's total)
    switch_lead_s: float = 2.0  # group changes take effect this far ahead (time for the table to reach everyone)
    start_wait_s: float = 60.0  # a new run waits this long for its group to fill before step 0
    switch_lead_min_steps: int = 3
    backup_refresh_s: float = 30.0  # backups refresh their warm copy this often
    round_timeout_s: float = 20.0
    state_pull_timeout_s: float = 120.0
    final_check_s: float = 60.0  # at the end, how long to wait for the group's final hashes
    broker: BrokerConfig = field(default_factory=BrokerConfig)
    client: RunClientConfig = field(default_factory=RunClientConfig)

    def __post_init__(self) -> None:
        if (self.manifest is None) == (self.run_id is None):
            raise ValueError("give either a manifest or a run id")
        if self.max_steps is not None and self.max_steps < 0:
            raise ValueError("max_steps must be >= 0")
        if self.switch_lead_s < 0 or self.switch_lead_min_steps < 1:
            raise ValueError("switch lead must be >= 0 s and >= 1 step")
        if self.backup_refresh_s <= 0 or self.round_timeout_s <= 0:
            raise ValueError("--backup-refresh and --round-timeout must be positive")


class RunRuntime:
    """Owned by a Node: `await nursery.start(runtime.run, joined_peers)`; read `status_fields()` for the status."""

    def __init__(self, node, config: RunConfig, hardware: HardwareProfile):
        self.node = node
        self.config = config
        self.manifest: RunManifest | None = config.manifest
        self.hardware = hardware
        self.client: RunClient | None = None
        self.broker: Broker | None = None
        self.trainer = None
        self.sync = None
        self.tables: list[AssignmentTable] = []
        self.snapshots: dict[int, Snapshot] = {}
        self.latest: Snapshot | None = None
        self.warm: Snapshot | None = None  # a backup's recent copy of the run's state
        self.entries: list[dict[str, Any]] = []  # each time this node entered a group: step, bytes, seconds
        self._step_done: deque[float] = deque(maxlen=32)  # monotonic times at which recent steps finished
        self.snapshot_steps: set[int] = set()
        self.my_hashes: dict[int, str] = {}
        self.state = "joining"
        self.last = None
        self.error: str | None = None
        self.finished = trio.Event()
        self.refetches = 0
        self.votes = 0  # hash votes held after a peer's published hash differed from ours
        self._refetch: tuple[int, str] | None = None  # (step, majority peer): load that peer's state at that step
        self._vote_after = 0  # no new vote before this step
        self._start_deadline = time.monotonic() + config.start_wait_s
        self._rate_sample: tuple[float, int, int] | None = None
        self._up = self._down = 0.0
        self._token: trio.lowlevel.TrioToken | None = None
        self._nursery: trio.Nursery | None = None

    # -- what the node publishes ---------------------------------------------------------------------------
    def status_fields(self) -> dict[str, Any]:
        c, t, s = self.client, self.trainer, self.sync
        if self.manifest is None:
            return {"state": "joining"}
        fields: dict[str, Any] = {"run_id": self.manifest.run_id, "state": self.state}
        if c is not None:
            fields["role"] = "broker" if c.is_broker() else c.role()  # the broker may hold a slot too
            fields["slot"] = c.slot_name()
        state_hash = None
        if t is not None:
            fields["step"] = t.step_count
            if self.my_hashes:  # the hash this loop recorded with the step it publishes, never a pair torn by a
                if self.state == "done":  # running step; once done, the final state's
                    state_hash = self.my_hashes[max(self.my_hashes)]
                else:
                    fields["step"] = min(max(self.my_hashes), t.step_count)
                    state_hash = self.my_hashes.get(fields["step"])
            if self.last is not None:
                fields["loss"] = self.last.loss if math.isfinite(self.last.loss) else None
                fields["tokens_per_s"] = round(self.tokens_per_s(), 1)
            fields["eval_loss"] = t.last_eval_loss
        if s is not None and hasattr(s, "bytes_sent"):
            up, down = self._rates(s.bytes_sent, s.bytes_recv)
            fields.update(bytes_sent=s.bytes_sent, bytes_recv=s.bytes_recv, up_bytes_per_s=up, down_bytes_per_s=down,
                          compression_ratio=round(s.compression_ratio, 2),
                          state_hash=state_hash or s.state_hash() or None)
        if self.error:
            fields["error"] = self.error[:200]
        return fields

    def tokens_per_s(self) -> float:
        """Training progress by the wall clock over the last steps: waits for the group, the synchronizer and
        everything else between steps included (what the run really gets; one step's own figure counts compute)."""
        t = self._step_done
        if len(t) >= 2 and t[-1] > t[0]:
            return self.trainer.tokens_per_step * (len(t) - 1) / (t[-1] - t[0])
        return self.last.tokens_per_s if self.last is not None else 0.0

    def _rates(self, sent: int, recv: int) -> tuple[float, float]:
        """Bytes per second sent and received since the previous status (smoothed)."""
        now = time.monotonic()
        t0, s0, r0 = self._rate_sample or (now, sent, recv)
        self._rate_sample = (now, sent, recv)
        if now - t0 > 0:
            a = 0.5
            self._up = a * (sent - s0) / (now - t0) + (1 - a) * self._up
            self._down = a * (recv - r0) / (now - t0) + (1 - a) * self._down
        return round(self._up, 1), round(self._down, 1)

    # -- groups by step ------------------------------------------------------------------------------------
    def _on_table(self, table: AssignmentTable) -> None:
        if self.tables and not table.newer_than(self.tables[-1]):
            return
        self.tables = (self.tables + [table])[-MAX_TABLES:]
        for s in range(table.stages):
            if table.switch_step(s) > 0:
                self.snapshot_steps.add(table.switch_step(s))

    def table_at(self, step: int) -> AssignmentTable | None:
        """The newest table whose group has taken effect by `step`."""
        for t in reversed(self.tables):
            if t.switch_step(0) <= step:
                return t
        return None

    def group_at(self, step: int) -> Group | None:
        t = self.table_at(step)
        me = self.node.peer_id
        if t is None or t.slot_of(me) is None:
            return None
        stage = t.slot_of(me)[0]
        return Group(run_id=t.run_id, stage=stage, epoch=t.epochs[stage], members=t.members(stage), me=me)

    def _group_now(self) -> Group:
        g = self.group_at(self.trainer.step_count)
        if g is None:  # the loop only steps while in a group; a table can only add later switches
            raise RuntimeError("no group at this step")
        return g

    def _known_steps(self) -> list[tuple[int, float]]:
        """(step, tokens/s) of this node and of the run's peers, from their status records."""
        out = [(self.trainer.step_count if self.trainer else 0, 0.0)]
        for e in self.node.membership.live_peers():
            st = e.status_record
            if st is not None and st.run_id == self.manifest.run_id:
                out.append((st.step, st.tokens_per_s))
        return out

    def switch_step(self, stage: int) -> int:
        """Where a group change can take effect: the furthest step anyone reports, plus ~switch_lead_s of steps."""
        steps = self._known_steps()
        top = max(s for s, _ in steps)
        if top == 0:
            return 0  # nothing trained yet: the change can apply from the start
        tps = max((r for _, r in steps), default=0.0)
        per_step = self.manifest.batch.batch_size * self.manifest.batch.seq_len
        rate = tps / per_step if tps > 0 else 1.0
        return top + max(self.config.switch_lead_min_steps, math.ceil(self.config.switch_lead_s * rate))

    # -- snapshots -----------------------------------------------------------------------------------------
    def _before_step(self, trainer) -> None:
        """Trainer thread: take a snapshot at the steps where someone enters the group or asked for one."""
        step = trainer.step_count
        # also after step 1: the first snapshot with optimizer and synchronizer state, for backups' warm copies
        if step in self.snapshot_steps or self.latest is None or step % 50 == 0 or step == 1:
            self._close_round(trainer.model)  # the snapshot is the state at this round boundary
            snap = Snapshot.of(trainer.state_dict(), revision=step)
            self.latest = snap
            if step in self.snapshot_steps:
                self.snapshots[step] = snap
                for old in sorted(self.snapshots)[:-MAX_SNAPSHOTS]:
                    del self.snapshots[old]

    def _close_round(self, model) -> None:
        """Apply the synchronizer's in-flight round, if it keeps one (trainer thread)."""
        close = getattr(self.sync, "close", None)
        if close is not None:
            close(model)

    def _sync_hash(self) -> str:
        """The synchronized state's hash ("" for a synchronizer that keeps none)."""
        return self.sync.state_hash() if hasattr(self.sync, "state_hash") else ""

    def _snapshot_at(self, revision: int) -> Snapshot | None:
        return self.snapshots.get(revision) or (self.latest if self.latest and self.latest.revision == revision
                                                else None)

    async def _rpc_snapshot_at(self, caller: str, body: Any) -> Any:
        if not isinstance(body, int) or isinstance(body, bool) or body < 0:
            raise ValueError("snapshot_at takes a step number")
        self.snapshot_steps.add(body)
        return {"ok": True, "step": self.trainer.step_count if self.trainer else 0}

    async def pull_revision(self, revision: int, peers: list[str], *, only: tuple[str, ...] | None = None) -> Snapshot:
        """Pull exactly `revision` (or, with `only`, those tensors of it) from one of `peers` (live ones first),
        waiting while none has reached it."""
        from shoal.swarm.state.transfer import StateTransferConfig

        deadline = trio.current_time() + self.config.state_pull_timeout_s
        attempt = StateTransferConfig(timeout_s=min(30.0, self.config.state_pull_timeout_s))
        last = None
        while trio.current_time() < deadline:
            live = {e.peer_id for e in self.node.membership.live_peers()}
            for p in sorted(peers, key=lambda p: p not in live):
                if p not in live and last is not None:
                    continue  # a silent peer gets one try, then only live ones
                try:
                    return await pull_state(self.node.sh, p, revision=revision, config=attempt, only=only)
                except StateTransferError as e:
                    last = e
                    log.debug("revision %d from %s: %s", revision, p, e)
            await trio.sleep(0.2)
        raise StateTransferError(f"no peer served revision {revision} within {self.config.state_pull_timeout_s} s: "
                                 f"{last}")

    async def _pull_group_state(self, revision: int, peers: list[str]) -> tuple[Snapshot, int]:
        """The state to load at `revision`, and the bytes pulled for it. A backup with a warm copy pulls only what
        the synchronizer keeps bit-identical across the group, plus whatever the copy lacks (a copy taken before
        the first step has no optimizer state), and takes the rest from the copy: a short catch-up. Otherwise the
        whole state."""
        keys = getattr(self.sync, "group_state", None)
        if keys is not None and self.warm is not None:
            part = await self.pull_revision(revision, peers, only=keys)
            pulled, extra = part.nbytes, []
            missing = part.missing(self.warm)
            ask = tuple(sorted(missing)) if len(missing) <= MAX_PREFIXES else \
                tuple(sorted({"/" + name.split("/")[1] + "/" for name in missing}))  # a name is its own prefix
            if missing and len(ask) <= MAX_PREFIXES:
                extra.append(await self.pull_revision(revision, peers, only=ask))
                pulled += extra[0].nbytes
            try:
                return part.merged(self.warm, *extra), pulled
            except StateTransferError as e:
                log.info("the warm copy does not complete revision %d (%s): pulling all of it", revision, e)
        snap = await self.pull_revision(revision, peers)
        return snap, snap.nbytes

    async def _load(self, snap: Snapshot) -> None:
        """Load the group's state, then let the synchronizer restart local state from the synchronized one."""
        state = snap.state()

        def load() -> None:
            self.trainer.load_state_dict(state)
            self.sync.enter(self.trainer.model)

        await trio.to_thread.run_sync(load)

    # -- the loop ------------------------------------------------------------------------------------------
    async def _build_trainer(self, replica: int) -> None:
        def build():
            import torch

            from shoal.node.sync.base import SyncConfig
            from shoal.node.sync.factory import make_synchronizer
            from shoal.node.train.trainer import Trainer

            if self.config.threads:
                torch.set_num_threads(self.config.threads)
            sync = make_synchronizer(
                self.manifest, collective=self.collective, group_fn=self._group_now, trio_token=self._token,
                penalties=self.node.penalties, config=SyncConfig(round_timeout_s=self.config.round_timeout_s),
                on_missing=self._on_missing, on_offender=self._on_offender)
            trainer = Trainer(self.manifest, device=self.config.device, replica=replica, synchronizer=sync)
            trainer.before_step_hooks.append(self._before_step)
            return trainer, sync

        self.trainer, self.sync = await trio.to_thread.run_sync(build)

    def _on_missing(self, peers: list[str]) -> None:
        """Trainer thread: members missed a round's deadline; tell the broker (it checks them)."""
        self._report(missing=peers)

    def _on_offender(self, peer: str, reason: str) -> None:
        """Trainer thread: a member's update was rejected; tell the broker (most members' reports evict it)."""
        self.error = f"excluded {peer[-8:]}: {reason}"[:200]
        self._report(offenders=[peer])

    def _report(self, *, missing: list[str] = (), offenders: list[str] = ()) -> None:
        g = self.group_at(self.trainer.step_count)
        if g is not None and self.client is not None:
            report = functools.partial(self.client.report_missing, list(missing), epoch=g.epoch, stage=g.stage,
                                       offenders=list(offenders))
            trio.from_thread.run_sync(self._nursery.start_soon, report, trio_token=self._token)

    def _entry(self) -> tuple[int, int] | None:
        """(step, replica) at which this node's newest slot takes effect, or None when no table gives it one."""
        t = self.tables[-1] if self.tables else None
        slot = t.slot_of(self.node.peer_id) if t is not None else None
        return (t.switch_step(slot[0]), slot[1]) if slot is not None else None

    async def _enter(self, step: int, replica: int) -> None:
        """Take a place in the group from `step`: build the trainer, and unless the run starts here, load the
        state of exactly `step` from a replica that was in the group before."""
        self.state = "joining"
        if self.trainer is None:
            await self._build_trainer(replica)
        if step == 0 and self.trainer.step_count == 0:
            return
        prev = self.group_at(step - 1) if step > 0 else None
        peers = [m for m in (prev.members if prev else ()) if m != self.node.peer_id]
        if not peers:
            t = self.table_at(step)
            peers = [m for m in (t.members(0) if t else ()) if m != self.node.peer_id]
        t0 = time.monotonic()
        log.info("entering the group at step %d: pulling that revision from %s", step, [p[-8:] for p in peers])
        snap, pulled = await self._pull_group_state(step, peers)
        await self._load(snap)
        self.entries.append({"step": step, "bytes_pulled": pulled, "state_bytes": snap.nbytes,
                             "seconds": round(time.monotonic() - t0, 3)})
        log.info("entered the group at step %d with state from a replica: %d of %d bytes pulled (%.2f s)", step,
                 pulled, snap.nbytes, time.monotonic() - t0)

    def _group_full(self) -> bool:
        t = self.tables[-1] if self.tables else None
        return t is not None and len(t.members(0)) >= self.manifest.plan.replicas

    def _status_disagrees(self) -> bool:
        """A member of our group published, for a step we still hold, a state hash other than ours."""
        g = self.group_at(self.trainer.step_count)
        if g is None or g.size < 3:
            return False  # two replicas that differ have no majority to follow
        for e in self.node.membership.live_peers():
            st = e.status_record
            if (st is not None and e.peer_id in g.members and st.run_id == self.manifest.run_id and st.state_hash
                    and st.state != "done" and st.step in self.my_hashes and st.state_hash != self.my_hashes[st.step]):
                return True
        return False

    async def _gather_hashes(self, g: Group, step: int) -> dict[str, str]:
        """Every member's state hash at `step` (ours included; members that do not hold it yet are absent)."""
        votes = {self.node.peer_id: self.my_hashes[step]}

        async def ask(peer: str) -> None:
            try:
                ans = await self.node_call(peer, "run.hash_at", step)
            except RpcError as e:
                log.info("hash vote: %s did not answer: %s", peer, e)
                return
            h = ans.get("hash") if isinstance(ans, dict) else None
            if isinstance(h, str) and 0 < len(h) <= 64:
                votes[peer] = h

        async with trio.open_nursery() as n:
            for peer in g.members:
                if peer != self.node.peer_id:
                    n.start_soon(ask, peer)
        return votes

    def _majority_peer(self, g: Group, step: int, votes: dict[str, str]) -> str | None:
        """A peer holding the hash a strict majority of the group holds, when ours is not it."""
        self.votes += 1
        counts: dict[str, int] = {}
        for h in votes.values():
            counts[h] = counts.get(h, 0) + 1
        top, n_top = max(counts.items(), key=lambda kv: kv[1])
        mine = votes[self.node.peer_id]
        log.info("hash vote at step %d: %d of %d members hold %s (ours %s)", step, n_top, g.size, top[:12], mine[:12])
        if top == mine or n_top <= g.size // 2:
            return None
        return next(p for p, h in sorted(votes.items()) if h == top)

    async def _hash_vote(self) -> str | None:
        """Vote at one recent step every member holds (members run in lockstep, within a step of each other)."""
        g = self.group_at(self.trainer.step_count)
        if g is None or g.size < 3 or not self.my_hashes:
            return None
        step = max(self.my_hashes) - 2
        if step not in self.my_hashes:
            return None
        return self._majority_peer(g, step, await self._gather_hashes(g, step))

    async def _finish(self, limit: int) -> None:
        """The end of the run: apply the last round, then make sure this replica ends with the majority's state
        (a divergence in the last steps would otherwise outlive the run). The final state is revision limit + 1
        (what step limit + 1 would start from); every replica serves it, and a minority replica pulls it from a
        majority peer."""
        t, final_rev = self.trainer, limit + 1
        await trio.to_thread.run_sync(self._close_round, t.model)
        final = Snapshot.of(await trio.to_thread.run_sync(t.state_dict), revision=final_rev)
        self.snapshots[final_rev], self.latest = final, final
        self.my_hashes[final_rev] = self._sync_hash()
        g = self.group_at(limit - 1)
        if g is not None and g.size >= 3:
            self.state = "syncing"
            votes: dict[str, str] = {}
            with trio.move_on_after(self.config.final_check_s):
                while len(votes := await self._gather_hashes(g, final_rev)) < g.size:
                    await trio.sleep(0.5)  # the others are still on their last steps
            src = self._majority_peer(g, final_rev, votes) if votes else None
            if src is not None:
                snap = await self.pull_revision(final_rev, [src])
                await self._load(snap)
                self.refetches += 1
                self.my_hashes[final_rev] = self._sync_hash()
                log.warning("final state hash disagreed with the majority: re-fetched the final state from %s", src)
        t.last_eval_loss = await trio.to_thread.run_sync(t.evaluate)

    async def _rpc_hash_at(self, caller: str, body: Any) -> Any:
        if not isinstance(body, int) or isinstance(body, bool) or body < 0:
            raise ValueError("hash_at takes a step number")
        return {"hash": self.my_hashes.get(body)}

    async def _train(self) -> None:
        limit = self.config.max_steps if self.config.max_steps is not None else self.manifest.optim.total_steps
        while True:
            t = self.trainer
            step = t.step_count if t is not None else 0
            if t is not None and step >= limit:
                await self._finish(limit)
                self.state = "done"
                self.finished.set()
                await trio.sleep_forever()
            g = self.group_at(step) if t is not None else None
            if step == 0 and not self._group_full() and time.monotonic() < self._start_deadline:
                self.state = "ready"  # a new run: wait for the group to fill, so every replica starts at step 0
                with trio.move_on_after(0.5):
                    await self.client.wait_changed()
                continue
            if g is None:
                entry = self._entry()
                if entry is not None and (t is None or entry[0] > step) and entry[0] < limit:
                    await self._enter(*entry)  # (a slot from a step past the run's end is never entered)
                    continue
                self.state = "ready"  # a backup, or waiting for the step at which our slot takes effect
                with trio.move_on_after(1.0):
                    await self.client.wait_changed()
                continue
            if self._refetch is not None and step >= self._refetch[0]:
                src, self._refetch = self._refetch[1], None
                self.state = "syncing"
                snap = await self.pull_revision(step, [src])
                await self._load(snap)
                self.refetches += 1
                log.warning("state hash disagreed with the majority: re-fetched step %d from %s", step, src)
            self.state = "training"
            self.last = await trio.to_thread.run_sync(t.step)
            self._step_done.append(time.monotonic())
            self.my_hashes[t.step_count] = self._sync_hash()
            for old in sorted(self.my_hashes)[:-64]:
                del self.my_hashes[old]
            if self._refetch is None and t.step_count >= self._vote_after and self._status_disagrees():
                self._vote_after = t.step_count + self.config.switch_lead_min_steps + 2
                src = await self._hash_vote()
                if src is not None:  # ask the majority peer for a snapshot a few steps ahead, then load it there
                    target = t.step_count + self.config.switch_lead_min_steps
                    try:
                        await self.node_call(src, "run.snapshot_at", target)
                        self._refetch = (target, src)
                    except RpcError as e:
                        log.info("snapshot request to %s failed: %s", src, e)

    async def node_call(self, peer: str, method: str, body: Any) -> Any:
        from shoal.swarm.net.rpc import call

        return await call(self.node.sh, peer, method, body, timeout_s=self.config.client.rpc_timeout_s)

    async def _rpc_manifest(self, caller: str, body: Any) -> Any:
        if body != self.manifest.run_id:
            raise ValueError("this node trains another run")
        return self.manifest.to_bytes()

    async def fetch_manifest(self, run_id: str, peers: list[str]) -> RunManifest:
        """The signed manifest of `run_id` from one of `peers`, verified and checked against the id."""
        for p in peers:
            try:
                raw = await self.node_call(p, "run.manifest", run_id)
                m = RunManifest.from_bytes(raw)
                m.verify()
                if m.run_id != run_id:
                    raise ValueError("the manifest does not hash to the run id")
                return m
            except (RpcError, ValueError, TypeError) as e:
                log.info("manifest from %s: %s", p, e)
        raise ConnectionError(f"no joined peer gave the manifest of run {run_id[:16]}…")

    async def run(self, joined: list[str], *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        node = self.node
        self._token = trio.lowlevel.current_trio_token()
        if self.manifest is None:
            self.manifest = await self.fetch_manifest(self.config.run_id, joined)
        node.rpc.register("run.manifest", self._rpc_manifest)
        ctx = RunContext(sh=node.sh, manifest=self.manifest, register=node.rpc.register, publish=node.publish,
                         membership=node.membership, penalties=node.penalties, switch_step=self.switch_step)
        self.collective = Collective(node.sh, node.penalties)
        StateServer(node.sh, lambda: self.latest, penalties=node.penalties, by_revision=self._snapshot_at)
        node.rpc.register("run.snapshot_at", self._rpc_snapshot_at)
        node.rpc.register("run.hash_at", self._rpc_hash_at)
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            if not joined:  # the node started with the manifest hosts the broker
                self.broker = Broker(ctx, self.config.broker)
                await nursery.start(self.broker.run)
                broker_id = node.peer_id
            else:
                broker_id = None
                for p in joined:
                    try:
                        broker_id = (await fetch_table(node.sh, p, self.manifest.run_id)).record.peer_id
                        break
                    except (RpcError, Exception) as e:  # noqa: BLE001 - try the next joined peer
                        log.info("no run table from %s: %s", p, e)
                if broker_id is None:
                    raise ConnectionError(f"none of the joined peers knows run {self.manifest.run_id[:16]}…")
            self.client = RunClient(ctx, self.hardware, broker_id=broker_id, secret=self.config.secret,
                                    config=self.config.client, local_broker=self.broker)
            self.client.on_change.append(self._on_table)
            node.extra_ingest.append(self.client.on_record)
            await nursery.start(self.client.run)
            if self.client.table is not None:
                self._on_table(self.client.table)
            task_status.started(self)
            nursery.start_soon(functools.partial(  # backups refresh a copy so a promotion is a short catch-up
                keep_warm, node.sh, self.client, lambda snap: setattr(self, "warm", snap),
                every_s=self.config.backup_refresh_s))
            await self._train()

    async def leave(self) -> None:
        if self.client is not None:
            with trio.move_on_after(3):
                try:
                    await self.client.leave()
                except (RpcError, Exception) as e:  # noqa: BLE001 - leaving anyway
                    log.info("leave notice to the broker failed: %s", e)
