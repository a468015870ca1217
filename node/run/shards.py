"""A node's part in erasure-coded snapshots (docs/snapshots.md): as its stage's encoder (the member of the lowest
lane), every `snapshot_every_steps` it splits the stage's snapshot into k data + m parity shards in a worker thread
and hands them to peers outside the stage; as anyone, it holds other stages' shards and serves them to the run's
members; as every slot holder, it keeps its own snapshots of the last two such revisions, so the run can roll back
to one when another stage is rebuilt from its shards.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from shoal.protocol.assignment import AssignmentTable
from shoal.protocol.envelope import seal
from shoal.protocol.manifest import RunManifest
from shoal.protocol.records import MAX_HELD, ShardHeld
from shoal.protocol.shards import ShardManifest
from shoal.swarm.net.host import SwarmHost
from shoal.swarm.net.penalty import Penalties
from shoal.swarm.state import erasure
from shoal.swarm.state.blob import snapshot_parts
from shoal.swarm.state.shards import (
    Rebuilt, ShardConfig, ShardService, ShardStore, push_shards, recover_stage, sha256_hex, shard_holders)
from shoal.swarm.state.snapshot import Snapshot

log = logging.getLogger(__name__)

#: an encoder skips a snapshot revision when encoding would take more than this share of the time since its last
#: encoding began (docs/snapshots.md: the revisions every stage snapshots stay the grid; the rollback goes to one
#: whose shards are placed)
ENCODE_SHARE = 0.01


@dataclass(slots=True)
class EncodeStats:
    """What the encoder measured (the status file and the benchmark read these)."""

    revisions: list[dict] = field(default_factory=list)  # the last few: revision, k, m, bytes, encode_s, push_s, placed
    skipped: int = 0  # revisions not encoded because the previous one was still being placed


class StageShards:
    """`member(peer)`: a provider of the run; `tables()`: the run tables this node holds (oldest first)."""

    def __init__(self, sh: SwarmHost, key: Ed25519PrivateKey, manifest: RunManifest, penalties: Penalties, *,
                 member: Callable[[str], bool], tables: Callable[[], list[AssignmentTable]],
                 config: ShardConfig = ShardConfig(), clock: Callable[[], float] = time.monotonic):
        self.sh, self.key, self.manifest, self.penalties = sh, key, manifest, penalties
        self.tables, self.config, self.clock = tables, config, clock
        c = manifest.checkpoint
        self.every_steps, self.parity, self.max_k = c.snapshot_every_steps, c.parity, c.max_data_shards
        self.store = ShardStore()
        self.service = ShardService(sh, manifest.run_id, self.store, member=member, encoder_of=self.held_stage,
                                    penalties=penalties, config=config, clock=clock)
        self.own: dict[int, Snapshot] = {}  # this node's own snapshots at the last revisions encoded by its stage
        self.placed: int | None = None  # the newest revision of this node's stage it placed (as the encoder)
        self.placed_on: tuple[str, ...] = ()
        self.stats = EncodeStats()
        self._busy = False
        self._last_skip: str | None = None  # the reason of the last skipped revision (logging)
        self._last_at, self._last_encode_s = -1e18, 0.0  # when the last encoding began, and what it took

    def due(self, revision: int) -> bool:
        return self.every_steps > 0 and revision > 0 and revision % self.every_steps == 0

    def held_stage(self, peer: str, stage: int, revision: int) -> bool:
        """Whether `peer` held a slot of `stage` at `revision`, by the tables this node holds (any of them when none
        covers that revision)."""
        tables = self.tables()
        at = [t for t in tables if t.switch_step(stage) <= revision]
        for t in ([at[-1]] if at else tables):
            slot = t.slot_of(peer)
            if slot is not None and slot[0] == stage:
                return True
        return False

    def forget_after(self, revision: int) -> None:
        """The run rolled back to `revision`: what was snapshotted or held after it belongs to a past that is gone."""
        for r in [r for r in self.own if r > revision]:
            del self.own[r]
        for st in range(self.manifest.plan.stages):
            self.store.drop_newer(st, revision)
        if self.placed is not None and self.placed > revision:
            self.placed = None

    def holdings(self) -> tuple[ShardHeld, ...]:
        return tuple(self.store.holdings()[-MAX_HELD:])

    def encoder(self, table: AssignmentTable, stage: int) -> str | None:
        """The member of `stage` that encodes it under `table`: the one of the lowest lane."""
        slots = sorted((s.replica, s.peer_id) for s in table.slots if s.stage == stage)
        return slots[0][1] if slots else None

    def _skip(self, what: str, why: str) -> None:
        """A skipped revision: said at INFO when its reason changes, at DEBUG while it stays the same (a run with too
        few peers for shards would otherwise log a line every snapshot interval)."""
        # the kind of reason, not its figures (a peer count that changes is news; a revision number is not)
        reason = "placing" if "still being placed" in why else "share" if why.startswith("the last encoding") else why
        # the first skip of a run is DEBUG too: a swarm too small for shards is the common case at start, and the
        # status record's `shards` says what is placed
        level = logging.INFO if self._last_skip is not None and reason != self._last_skip else logging.DEBUG
        log.log(level, "%s: %s", what, why)
        self._last_skip = reason

    async def encode_and_place(self, snap: Snapshot, table: AssignmentTable, stage: int) -> None:
        """Split `snap` (this node's stage at its revision) into shards and hand them to their holders. Skipped when
        the previous revision is still being placed, or when too few peers can hold shards."""
        if self._busy:
            self.stats.skipped += 1
            self._skip(f"stage {stage} snapshot at revision {snap.revision} not encoded", "revision "
                       f"{self.stats.revisions[-1]['revision'] if self.stats.revisions else '?'} is still being placed")
            return
        since = self.clock() - self._last_at
        if self._last_encode_s > ENCODE_SHARE * since:
            self.stats.skipped += 1
            self._skip(f"stage {stage} snapshot at revision {snap.revision} not encoded", "the last encoding took "
                       f"{self._last_encode_s:.2f} s, more than {100 * ENCODE_SHARE:.0f} % of the {since:.1f} s since")
            return
        k, holders = shard_holders(table, stage, m=self.parity, max_k=self.max_k)
        if k < 1:
            self._skip(f"stage {stage} snapshot at revision {snap.revision} not encoded",
                       f"{len(holders)} peers outside the stage, {self.parity + 1} needed")
            return
        self._last_skip = None
        self._busy = True
        try:
            t0 = self.clock()
            snap, blob_len, shards, hashes = await trio.to_thread.run_sync(self._encode, snap, k)
            encode_s = self.clock() - t0
            self._last_at, self._last_encode_s = t0, encode_s
            if snap.revision in self.own:
                self.own[snap.revision] = snap  # with its hash now
            man = ShardManifest(peer_id=self.sh.peer_id, run_id=self.manifest.run_id, stage=stage,
                                revision=snap.revision, state_hash=snap.hash, state_bytes=blob_len, k=k,
                                m=self.parity, shard_bytes=len(shards[0]), shard_hashes=hashes, holders=holders,
                                time=time.time())
            raw = seal(man, self.key)
            t1 = self.clock()
            placed = await push_shards(self.sh, man, raw, shards, config=self.config)
            push_s = self.clock() - t1
        finally:
            self._busy = False
        self.stats.revisions = (self.stats.revisions + [{
            "revision": snap.revision, "hash": snap.hash[:16], "k": k, "m": self.parity, "state_bytes": blob_len,
            "shard_bytes": len(shards[0]), "encode_s": round(encode_s, 4), "push_s": round(push_s, 3),
            "placed": len(placed)}])[-8:]
        if len(placed) >= k:
            self.placed, self.placed_on = snap.revision, tuple(placed)
            log.info("stage %d snapshot at revision %d: %d+%d shards of %.1f MB placed on %d peers (encoded in "
                     "%.3f s, placed in %.2f s)", stage, snap.revision, k, self.parity, len(shards[0]) / 1e6,
                     len(placed), encode_s, push_s)
        else:
            log.warning("stage %d snapshot at revision %d: only %d of %d shards placed (%d needed)", stage,
                        snap.revision, len(placed), k + self.parity, k)

    def _encode(self, snap: Snapshot, k: int) -> tuple[Snapshot, int, list, tuple[str, ...]]:
        """Worker thread: the snapshot with its hash, its blob's length, the shards and their hashes."""
        snap = snap.hashed()
        parts = list(snapshot_parts(snap))  # built once: blob_size would pack the header a second time
        size = sum(len(p) for p in parts)
        shards = erasure.encode_parts(parts, size, k, self.parity)
        return snap, size, shards, tuple(sha256_hex(s) for s in shards)

    async def rebuild(self, stage: int, peers: list[str], revision_ok: Callable[[int], bool]) -> Rebuilt:
        """The newest revision of `stage` that k good shards held by `peers` rebuild (NotRecoverable if none)."""
        return await recover_stage(self.sh, peers, self.manifest.run_id, stage, penalties=self.penalties,
                                   signer_ok=lambda p, rev: self.held_stage(p, stage, rev), revision_ok=revision_ok,
                                   config=self.config, clock=self.clock, local=self.store)
