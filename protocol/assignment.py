"""Run records owned by the broker: the lease, the signed assignment table, and admission request/response bodies."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar

from shoal.protocol.errors import FieldError
from shoal.protocol.manifest import MAX_LANES
from shoal.protocol.records import PEER_ID, PEER_KEY, TIME_S, HardwareProfile
from shoal.protocol.schema import (Bool, Bytes, Choice, Int, Nested, Optional, Seq, SignedRecord, Str, WireRecord,
                                   spec)

RUN_ID = Str(80, allow_empty=False)
MAX_STAGES = 64
MAX_REPLICAS = MAX_LANES
MAX_PROVIDERS = 1000  # providers admitted to one run at once: its full table stays under the gossip cap (below)
MAX_EVICTED = 64  # evicted peers a table lists (the newest): refused admission by the broker and its successors
MAX_GONE_LISTED = 32  # gone providers a table lists (the newest) beyond the MAX_PROVIDERS admitted ones

# docs/broker.md, "Providers and their states": REGISTERED -> BENCHMARKED -> BACKUP -> ACTIVE(stage) -> DRAINING -> GONE
REGISTERED, BENCHMARKED, BACKUP, ACTIVE, DRAINING, GONE = (
    "registered", "benchmarked", "backup", "active", "draining", "gone")
PROVIDER_STATES = frozenset({REGISTERED, BENCHMARKED, BACKUP, ACTIVE, DRAINING, GONE})
_SLOT = re.compile(r"^s(\d{1,4})r(\d{1,5})$")


def slot_name(stage: int, replica: int) -> str:
    """The slot label status records carry: stage 0, replica 2 -> "s0r2"."""
    return f"s{stage}r{replica}"


def parse_slot(name: str) -> tuple[int, int] | None:
    """"s0r2" -> (0, 2); None for anything else."""
    m = _SLOT.match(name) if isinstance(name, str) else None
    return (int(m.group(1)), int(m.group(2))) if m else None


@dataclass(frozen=True, kw_only=True, slots=True)
class BrokerLease(SignedRecord):
    """The broker's claim on a run, renewed every few seconds; `peer_id` is the holder and the signer."""

    KIND: ClassVar[str] = "lease"
    peer_id: str = spec(PEER_ID)
    run_id: str = spec(RUN_ID)
    lease_epoch: int = spec(Int(0, 2**62))  # +1 on every change of holder
    time: float = spec(TIME_S)  # issued at (unix seconds); the newest wins in the DHT
    expires_at: float = spec(TIME_S)

    def __post_init__(self) -> None:
        WireRecord.__post_init__(self)
        if self.expires_at < self.time:
            raise FieldError("expires_at", "before the time the lease was issued")


MAX_DELEGATES = 8


@dataclass(frozen=True, kw_only=True, slots=True)
class BrokerDelegation(SignedRecord):
    """The run owner's word on who besides itself may act as the run's broker (and so be named standby): signed
    by the owner (`peer_id`); a newer delegation (`time`) supersedes older ones."""

    KIND: ClassVar[str] = "delegation"
    peer_id: str = spec(PEER_ID)  # the run's owner
    run_id: str = spec(RUN_ID)
    brokers: tuple[str, ...] = spec(Seq(PEER_ID, MAX_DELEGATES))
    time: float = spec(TIME_S)

    def __post_init__(self) -> None:
        WireRecord.__post_init__(self)
        if self.peer_id in self.brokers or len(set(self.brokers)) != len(self.brokers):
            raise FieldError("brokers", "the owner or a peer listed twice")


@dataclass(frozen=True, kw_only=True, slots=True)
class SlotEntry(WireRecord):
    stage: int = spec(Int(0, MAX_STAGES - 1))
    replica: int = spec(Int(0, MAX_REPLICAS - 1))
    peer_id: str = spec(PEER_KEY)


@dataclass(frozen=True, kw_only=True, slots=True)
class LaneShare(WireRecord):
    """One lane's part of the global batch: the sequences each of its stages computes per step (protocol/split.py).
    Per-lane facts live here, apart from the slots, so that they can move with the lane when the table is split up."""

    replica: int = spec(Int(0, MAX_REPLICAS - 1))
    samples: int = spec(Int(1, 1 << 24))


@dataclass(frozen=True, kw_only=True, slots=True)
class ProviderEntry(WireRecord):
    peer_id: str = spec(PEER_KEY)
    state: str = spec(Choice(PROVIDER_STATES))


# warm: a backup's warm copy (one-stage runs); start: revision 0, which every node builds from the manifest
ROLLBACK_SOURCES = ("shards", "disk", "warm", "start")


@dataclass(frozen=True, kw_only=True, slots=True)
class Rollback(WireRecord):
    """The run goes back to `revision` (the `count`-th time): a stage lost every replica and its replacement rebuilt
    its state at that revision from erasure-coded shards, from the warm copy it kept as a backup (a one-stage run),
    or from a disk checkpoint; every slot loads its own state at `revision` (or pulls it from the stage's members)
    and trains on from there. A stage lost before any node could hold a checkpoint of it, with no
    shards, sends the run back to its start (revision 0, `start`): every slot builds its initial state again
    (docs/snapshots.md)."""

    count: int = spec(Int(1, 2**31))
    revision: int = spec(Int(0, 2**62))
    source: str = spec(Choice(frozenset(ROLLBACK_SOURCES)))
    stage: int = spec(Int(0, MAX_STAGES - 1))  # the stage that was lost


@dataclass(frozen=True, kw_only=True, slots=True)
class AssignmentTable(SignedRecord):
    """Who does what in a run. Signed by the broker (`peer_id`); (lease_epoch, version) only ever grows.

    `epochs[s]` is stage s's group epoch: it changes whenever the set of active members of that stage changes.
    Only filled slots are listed; a stage's group is the sorted peer ids of its slots. Every provider is listed once:
    in a slot (active), among the backups, or in `providers` with its state (see `provider_states`). Peers in those
    lists travel as their 32-byte public keys (`PEER_KEY`): at MAX_PROVIDERS, with MAX_REPLICAS slots and every gone
    and evicted peer listed, the sealed table stays under the gossip cap (tests/unit/test_assignment.py).
    """

    KIND: ClassVar[str] = "table"
    peer_id: str = spec(PEER_ID)  # the broker
    run_id: str = spec(RUN_ID)
    lease_epoch: int = spec(Int(0, 2**62))
    version: int = spec(Int(0, 2**62))
    time: float = spec(TIME_S)
    stages: int = spec(Int(1, MAX_STAGES))
    replicas: int = spec(Int(1, MAX_REPLICAS))
    epochs: tuple[int, ...] = spec(Seq(Int(0, 2**62), MAX_STAGES))
    standby: str | None = spec(Optional(PEER_KEY), default=None)
    slots: tuple[SlotEntry, ...] = spec(Seq(Nested(SlotEntry), MAX_REPLICAS), default=())
    backups: tuple[str, ...] = spec(Seq(PEER_KEY, MAX_PROVIDERS), default=())  # best first
    # backup_stages[i]: the stage backups[i] keeps warm (and would fill); empty: every backup keeps stage 0
    backup_stages: tuple[int, ...] = spec(Seq(Int(0, MAX_STAGES - 1), MAX_PROVIDERS), default=())
    # the providers in no slot and not a backup (admitted a moment ago, draining, gone), with their states
    providers: tuple[ProviderEntry, ...] = spec(Seq(Nested(ProviderEntry), MAX_PROVIDERS), default=())
    # switch_steps[s]: the first training step at which stage s's group in this table takes effect; every
    # member changes its group at that same round boundary (empty: from step 0)
    switch_steps: tuple[int, ...] = spec(Seq(Int(0, 2**62), MAX_STAGES), default=())
    # the owner's sealed BrokerDelegation naming this table's broker and standby (a signed run's broker that is
    # not its owner carries it; see swarm/run/authority.py)
    delegation: bytes | None = spec(Optional(Bytes(4096)), default=None, omit_if_default=True)
    rollback: Rollback | None = spec(Optional(Nested(Rollback)), default=None, omit_if_default=True)  # the last one
    # members the run evicted on a majority verdict (their updates rejected by most of their group), oldest first:
    # refused admission for the rest of the run, by this broker and by a standby that takes over (docs/broker.md,
    # "Failure detection")
    evicted: tuple[str, ...] = spec(Seq(PEER_KEY, MAX_EVICTED), default=(), omit_if_default=True)
    # the global batch split over the complete lanes, in force from this table's switch steps (empty: even)
    shares: tuple[LaneShare, ...] = spec(Seq(Nested(LaneShare), MAX_REPLICAS), default=(), omit_if_default=True)

    def __post_init__(self) -> None:
        WireRecord.__post_init__(self)
        if len(self.epochs) != self.stages:
            raise FieldError("epochs", f"expected one epoch per stage ({self.stages}), got {len(self.epochs)}")
        if self.switch_steps and len(self.switch_steps) != self.stages:
            raise FieldError("switch_steps", f"expected one step per stage ({self.stages})")
        seen_slots, seen_peers = set(), set()
        for i, s in enumerate(self.slots):
            if s.stage >= self.stages or s.replica >= self.replicas:
                raise FieldError(f"slots[{i}]", f"{slot_name(s.stage, s.replica)} is outside the plan")
            if (s.stage, s.replica) in seen_slots or s.peer_id in seen_peers:
                raise FieldError(f"slots[{i}]", "slot or peer listed twice")
            seen_slots.add((s.stage, s.replica))
            seen_peers.add(s.peer_id)
        for i, b in enumerate(self.backups):
            if b in seen_peers:
                raise FieldError(f"backups[{i}]", "peer is both a backup and in a slot (or listed twice)")
            seen_peers.add(b)
        if self.backup_stages and len(self.backup_stages) != len(self.backups):
            raise FieldError("backup_stages", f"expected one stage per backup ({len(self.backups)})")
        if any(s >= self.stages for s in self.backup_stages):
            raise FieldError("backup_stages", f"a stage outside the plan's {self.stages}")
        if self.standby is not None and self.standby == self.peer_id:
            raise FieldError("standby", "the broker cannot be its own standby")
        if len({p.peer_id for p in self.providers}) != len(self.providers) or any(
                p.peer_id in seen_peers for p in self.providers):
            raise FieldError("providers", "peer listed twice, or also in a slot or among the backups")
        if len(seen_peers) + len(self.providers) > MAX_PROVIDERS + MAX_GONE_LISTED:
            raise FieldError("providers", f"more than {MAX_PROVIDERS} providers and {MAX_GONE_LISTED} gone ones")
        if len({x.replica for x in self.shares}) != len(self.shares) or any(
                x.replica >= self.replicas for x in self.shares):
            raise FieldError("shares", "a lane listed twice or outside the plan")

    # -- queries -------------------------------------------------------------------------------------------
    def provider_states(self) -> dict[str, str]:
        """Every provider the table lists -> its state: slot holders active, backups backup, the rest as listed."""
        out = {s.peer_id: ACTIVE for s in self.slots}
        out.update((b, BACKUP) for b in self.backups)
        out.update((p.peer_id, p.state) for p in self.providers)
        return out

    def slot_of(self, peer_id: str) -> tuple[int, int] | None:
        for s in self.slots:
            if s.peer_id == peer_id:
                return s.stage, s.replica
        return None

    def members(self, stage: int) -> tuple[str, ...]:
        """Every peer holding a slot of `stage`, sorted."""
        return tuple(sorted(s.peer_id for s in self.slots if s.stage == stage))

    def slot_peer(self, stage: int, replica: int) -> str | None:
        for s in self.slots:
            if s.stage == stage and s.replica == replica:
                return s.peer_id
        return None

    def complete_lanes(self) -> tuple[int, ...]:
        """The lanes (replica indices) whose every stage's slot is filled: only those train."""
        filled: dict[int, int] = {}
        for s in self.slots:
            filled[s.replica] = filled.get(s.replica, 0) + 1
        return tuple(sorted(r for r, n in filled.items() if n == self.stages))

    def group_members(self, stage: int) -> tuple[str, ...]:
        """The peers of `stage` in complete lanes, sorted: the stage's synchronization group (with one stage, every
        member)."""
        lanes = set(self.complete_lanes())
        return tuple(sorted(s.peer_id for s in self.slots if s.stage == stage and s.replica in lanes))

    def lane_shares(self) -> dict[int, int]:
        """Sequences per step of each lane the table gives a share (by lane index)."""
        return {x.replica: x.samples for x in self.shares}

    def backup_stage(self, peer_id: str) -> int | None:
        """The stage `peer_id` keeps warm as a backup, or None when it is not a backup."""
        for i, b in enumerate(self.backups):
            if b == peer_id:
                return self.backup_stages[i] if self.backup_stages else 0
        return None

    def switch_step(self, stage: int) -> int:
        return self.switch_steps[stage] if self.switch_steps else 0

    def provider_state(self, peer_id: str) -> str | None:
        """`peer_id`'s state as a provider of the run (None: not listed)."""
        if self.slot_of(peer_id) is not None:
            return ACTIVE
        if peer_id in self.backups:
            return BACKUP
        for p in self.providers:
            if p.peer_id == peer_id:
                return p.state
        return None

    def newer_than(self, other: AssignmentTable | None) -> bool:
        return other is None or (self.lease_epoch, self.version) > (other.lease_epoch, other.version)


@dataclass(frozen=True, kw_only=True, slots=True)
class AdmitRequest(WireRecord):
    """Body of the broker's `run.admit` RPC; the caller's peer id comes from the authenticated channel."""

    run_id: str = spec(RUN_ID)
    hardware: HardwareProfile = spec(Nested(HardwareProfile))
    # a private run's admission proof: HMAC of the broker's challenge under the key derived from the join secret
    # (protocol/admission.py); the secret itself never travels
    nonce: bytes | None = spec(Optional(Bytes(32)), default=None)
    proof: bytes | None = spec(Optional(Bytes(32)), default=None)
    backup_only: bool = spec(Bool(), default=False)  # a provider that wants to wait in the pool


@dataclass(frozen=True, kw_only=True, slots=True)
class AdmitResponse(WireRecord):
    admitted: bool = spec(Bool())
    state: str | None = spec(Optional(Choice(PROVIDER_STATES)), default=None)
    slot: str | None = spec(Optional(Str(32)), default=None)
    error: str | None = spec(Optional(Str(300)), default=None)
    table: bytes | None = spec(Optional(Bytes(64 * 1024)), default=None)  # the signed table envelope


@dataclass(frozen=True, kw_only=True, slots=True)
class MissingReport(WireRecord):
    """Body of `run.report_missing`: members of a round at `epoch` that missed its deadline, members whose
    updates the reporter rejected (bad frames, non-finite or absurd values), and lane neighbours it lost."""

    run_id: str = spec(RUN_ID)
    stage: int = spec(Int(0, MAX_STAGES - 1), default=0)
    epoch: int = spec(Int(0, 2**62))
    missing: tuple[str, ...] = spec(Seq(PEER_ID, MAX_REPLICAS))
    offenders: tuple[str, ...] = spec(Seq(PEER_ID, MAX_REPLICAS), default=())
    # lane neighbours (the reporter's stage +- 1 of its lane) that a link to failed: a dial, a deadline, a close
    neighbours: tuple[str, ...] = spec(Seq(PEER_ID, 2), default=())


@dataclass(frozen=True, kw_only=True, slots=True)
class RollbackRequest(WireRecord):
    """Body of `run.rollback`: the caller, which holds a slot of `stage` (every replica of which was lost), has
    rebuilt that stage's state at `revision` from `source` and asks the run to go back there."""

    run_id: str = spec(RUN_ID)
    stage: int = spec(Int(0, MAX_STAGES - 1))
    revision: int = spec(Int(0, 2**62))
    source: str = spec(Choice(frozenset(ROLLBACK_SOURCES)))


RUN_RECORD_TYPES: dict[str, type[SignedRecord]] = {cls.KIND: cls for cls in (BrokerLease, AssignmentTable,
                                                                                   BrokerDelegation)}
