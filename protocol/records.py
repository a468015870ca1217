"""Node records that travel the swarm: hardware profile, announcement, status (gossip-sized), leave notice."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, ClassVar

from shoal.protocol.errors import FieldError, SignatureError
from shoal.protocol.schema import (Bool, Choice, Float, Int, Nested, Optional, Seq, SignedRecord, Spec, Str, WireRecord,
                                   spec)
from shoal.protocol.signing import peer_id_from_public_key, public_key_from_peer_id

PEER_ID = Str(64, allow_empty=False)


@lru_cache(maxsize=1 << 14)
def _key_of(peer_id: str) -> bytes:
    return public_key_from_peer_id(peer_id)


@lru_cache(maxsize=1 << 14)
def _id_of(key: bytes) -> str:
    return peer_id_from_public_key(key)


@dataclass(frozen=True, slots=True)
class PeerKey(Spec):
    """A peer id that travels as the 32-byte Ed25519 public key it inlines (34 bytes packed, against 54 for the
    base58 text) and reads back as the peer id: for records that list many peers (the assignment table). Every shoal
    identity is an Ed25519 key; any other id is refused."""

    def check(self, name, v):
        try:
            if isinstance(v, (bytes, bytearray)):
                return _id_of(bytes(v))
            if isinstance(v, str):
                _key_of(v)
                return v
        except SignatureError as e:
            raise FieldError(name, str(e)) from None
        raise FieldError(name, f"expected a peer id, got {type(v).__name__}")

    def to_wire(self, v):
        return _key_of(v)


PEER_KEY = PeerKey()
MULTIADDR = Str(256, allow_empty=False)
TIME_S = Float(0.0, 1e11)  # unix seconds
DEVICE_KINDS = frozenset({"cpu", "cuda", "mps", "xpu"})
ROLES = frozenset({"idle", "active", "backup", "broker", "observer"})
# waiting: the run has fewer lanes than its minimum and does not train until more join
STATES = frozenset({"starting", "ready", "joining", "training", "syncing", "waiting", "done", "draining", "leaving"})
# how others reach a node: dialable from anywhere; dialable only from its own network (a LAN, this machine);
# only through a relay (behind a NAT); not at all (behind a NAT, no relay yet); not known (nobody dialed it back)
REACHABILITY = ("public", "lan", "relayed", "unreachable", "unknown")
HISTORY_POINTS = 16  # loss points (and as many held-out ones) a status record carries of the run so far


@dataclass(frozen=True, kw_only=True, slots=True)
class HardwareProfile(WireRecord):
    device_kind: str = spec(Choice(DEVICE_KINDS))
    device_name: str = spec(Str(128))
    memory_bytes: int = spec(Int(0, 2**50))  # device memory (GPU) or system RAM (CPU)
    matmul_tflops: float = spec(Float(0.0, 1e5))  # measured at start, fp32 on CPU, bf16/fp16 on GPU
    free_disk_bytes: int = spec(Int(0, 2**60))
    cpu_count: int = spec(Int(0, 4096), default=0)


@dataclass(frozen=True, kw_only=True, slots=True)
class Announcement(SignedRecord):
    KIND: ClassVar[str] = "announce"
    peer_id: str = spec(PEER_ID)
    addrs: tuple[str, ...] = spec(Seq(MULTIADDR, 16))
    software_version: str = spec(Str(32))
    protocol_version: int = spec(Int(0, 2**16))
    hardware: HardwareProfile = spec(Nested(HardwareProfile))
    started_at: float = spec(TIME_S)
    observer: bool = spec(Bool(), default=False)  # observers (dashboard, `shoal peers`) never take a slot
    reachability: str = spec(Choice(frozenset(REACHABILITY)), default="unknown")  # see REACHABILITY
    relay: bool = spec(Bool(), default=False)  # offers a circuit relay (v2) to peers that are not reachable
    revision: int = spec(Int(0, 2**31), default=0)  # re-announcements of one start: a higher one replaces a lower


CHECK_GRAINS = (4, 16, 64)  # a link end's checkpoint steps: the last two multiples of each
MAX_CHECKS = 2 * len(CHECK_GRAINS)


def checkpoint_steps(steps) -> list[int]:
    """Of `steps`, the checkpoint steps to keep (ascending): the last two multiples of each of CHECK_GRAINS."""
    keep: set[int] = set()
    for g in CHECK_GRAINS:
        keep.update(sorted(s for s in steps if s % g == 0)[-2:])
    return sorted(keep)


@dataclass(frozen=True, kw_only=True, slots=True)
class LinkStatus(WireRecord):
    """One lane link end of a pipeline stage: what crosses it and, with AQ-SGD, this end's store digest after
    `step` (the two ends of a link must agree; docs/pipeline.md, "AQ-SGD over a link", rule 5), and after a few earlier
    checkpoint steps: the last two multiples of 4, of 16 and of 64 (`check_steps`, oldest first, with
    `check_digests`), so that two ends whose records were taken at different steps still share steps to compare."""

    link: str = spec(Str(16, allow_empty=False))  # "b0/fwd": activations from stage 0 to stage 1
    peer: str = spec(PEER_ID)  # the other end
    side: str = spec(Choice(frozenset({"sender", "receiver"})))  # of the activations
    compression: str = spec(Choice(frozenset({"fp32", "fp16", "aqsgd"})))
    step: int | None = spec(Optional(Int(0, 2**62)), default=None)  # the step the digest was taken after
    digest: str = spec(Str(16), default="")  # its first 16 hex digits ("" without a store)
    rows: int = spec(Int(0, 2**40), default=0)
    nacks: int = spec(Int(0, 2**40), default=0)  # NACKs sent (receiver) or received (sender)
    check_steps: tuple[int, ...] = spec(Seq(Int(0, 2**62), MAX_CHECKS), default=(), omit_if_default=True)
    check_digests: tuple[str, ...] = spec(Seq(Str(16), MAX_CHECKS), default=(), omit_if_default=True)

    def __post_init__(self) -> None:
        WireRecord.__post_init__(self)
        if len(self.check_steps) != len(self.check_digests):
            raise FieldError("check_digests", f"{len(self.check_digests)} digests for {len(self.check_steps)} steps")


MAX_HELD = 8  # shards a status record lists


@dataclass(frozen=True, kw_only=True, slots=True)
class ShardHeld(WireRecord):
    """A shard a node keeps for others: shard `index` of `stage`'s snapshot at `revision` (protocol/shards.py)."""

    stage: int = spec(Int(0, 1023))
    revision: int = spec(Int(0, 2**62))
    index: int = spec(Int(0, 31))


@dataclass(frozen=True, kw_only=True, slots=True)
class StatusRecord(SignedRecord):
    """What a node is doing now; published every few seconds over gossip, so it stays a few hundred bytes."""

    KIND: ClassVar[str] = "status"
    peer_id: str = spec(PEER_ID)
    seq: int = spec(Int(0, 2**62))  # strictly increasing per peer: older ones are ignored
    time: float = spec(TIME_S)
    role: str = spec(Choice(ROLES), default="idle")
    state: str = spec(Choice(STATES), default="ready")
    run_id: str | None = spec(Optional(Str(80)), default=None)
    slot: str | None = spec(Optional(Str(32)), default=None)  # e.g. "s0r2": stage 0, replica 2
    warm_stage: int | None = spec(Optional(Int(0, 1023)), default=None)  # a backup: the stage it keeps warm
    step: int = spec(Int(0, 2**62), default=0)
    loss: float | None = spec(Optional(Float(-1e9, 1e9)), default=None)
    eval_loss: float | None = spec(Optional(Float(-1e9, 1e9)), default=None)
    tokens_per_s: float = spec(Float(0.0, 1e12), default=0.0)
    up_bytes_per_s: float = spec(Float(0.0, 1e13), default=0.0)
    down_bytes_per_s: float = spec(Float(0.0, 1e13), default=0.0)
    bytes_sent: int = spec(Int(0, 2**62), default=0)
    bytes_recv: int = spec(Int(0, 2**62), default=0)
    compression_ratio: float | None = spec(Optional(Float(0.0, 1e9)), default=None)  # the synchronizer's, since start
    link_bytes_sent: int = spec(Int(0, 2**62), default=0)  # a pipeline stage: wire bytes to its lane neighbours
    link_bytes_recv: int = spec(Int(0, 2**62), default=0)
    lane_links: tuple[LinkStatus, ...] = spec(Seq(Nested(LinkStatus), 4), default=(), omit_if_default=True)
    state_hash: str | None = spec(Optional(Str(80)), default=None)
    peers_seen: int = spec(Int(0, 1 << 20), default=0)
    error: str | None = spec(Optional(Str(200)), default=None)  # the most recent error, for the dashboard
    # this node's own compute speed, sequences per second (its share of a step over the step's compute time, recent
    # median): the broker splits the global batch by it (within bounds: protocol/split.py)
    samples_per_s: float = spec(Float(0.0, 1e9), default=0.0, omit_if_default=True)
    # what it computed that went into applied steps, since it started: sequences and their tokens
    samples_done: int = spec(Int(0, 2**62), default=0, omit_if_default=True)
    tokens_done: int = spec(Int(0, 2**62), default=0, omit_if_default=True)
    # erasure-coded snapshots: the shards this node keeps for others, and the newest revision of its own stage's
    # snapshot whose shards are placed (the stage's encoder only)
    shards: tuple[ShardHeld, ...] = spec(Seq(Nested(ShardHeld), MAX_HELD), default=(), omit_if_default=True)
    shards_placed: int | None = spec(Optional(Int(0, 2**62)), default=None, omit_if_default=True)
    # the last recovery of a lost stage this node took part in ("rolled back to 140 from shards …"), for the
    # dashboard's events
    recovery: str | None = spec(Optional(Str(200)), default=None, omit_if_default=True)
    # uncompressed (fp32) / wire bytes over the window of up_bytes_per_s (which counts the synchronizer's and the lane
    # links' bytes together): the same window on every node, a late-promoted backup's included
    ratio_now: float | None = spec(Optional(Float(0.0, 1e9)), default=None, omit_if_default=True)
    # the loss since this replica started, thinned to at most HISTORY_POINTS points (steps, then losses in
    # thousandths), and its held-out evaluations likewise: a dashboard started late draws the run so far from them
    history_steps: tuple[int, ...] = spec(Seq(Int(0, 2**62), HISTORY_POINTS), default=(), omit_if_default=True)
    history_mloss: tuple[int, ...] = spec(Seq(Int(0, 10**9), HISTORY_POINTS), default=(), omit_if_default=True)
    eval_steps: tuple[int, ...] = spec(Seq(Int(0, 2**62), HISTORY_POINTS), default=(), omit_if_default=True)
    eval_mloss: tuple[int, ...] = spec(Seq(Int(0, 10**9), HISTORY_POINTS), default=(), omit_if_default=True)

    def __post_init__(self) -> None:
        WireRecord.__post_init__(self)
        for steps, values in (("history_steps", "history_mloss"), ("eval_steps", "eval_mloss")):
            xs, ys = getattr(self, steps), getattr(self, values)
            if len(xs) != len(ys):
                raise FieldError(values, f"{len(ys)} values for {len(xs)} steps")
            if any(b <= a for a, b in zip(xs, xs[1:])):
                raise FieldError(steps, "steps must increase")
            if xs and xs[-1] > self.step:
                raise FieldError(steps, f"step {xs[-1]} is ahead of the record's step {self.step}")

    def history(self) -> list[tuple[int, float]]:
        """(step, training loss) of the thinned history."""
        return [(x, y / 1000) for x, y in zip(self.history_steps, self.history_mloss)]

    def evals(self) -> list[tuple[int, float]]:
        """(step, held-out loss) of the thinned evaluations."""
        return [(x, y / 1000) for x, y in zip(self.eval_steps, self.eval_mloss)]


@dataclass(frozen=True, kw_only=True, slots=True)
class RunStatus:
    """The part of a node's `StatusRecord` that its run fills in. Each field is the record's field of the same name
    and is checked by that field's spec when this is built (a bad value fails where it is made, not where the record
    is sealed); None leaves the field unsaid: the record keeps its default, or the node's own role and state."""

    state: str | None = None
    role: str | None = None
    run_id: str | None = None
    slot: str | None = None
    warm_stage: int | None = None
    step: int | None = None  # said once the node has a trainer
    loss: float | None = None
    eval_loss: float | None = None
    tokens_per_s: float | None = None
    up_bytes_per_s: float | None = None
    down_bytes_per_s: float | None = None
    bytes_sent: int | None = None
    bytes_recv: int | None = None
    compression_ratio: float | None = None
    link_bytes_sent: int | None = None
    link_bytes_recv: int | None = None
    lane_links: tuple[LinkStatus, ...] | None = None
    state_hash: str | None = None
    error: str | None = None
    samples_per_s: float | None = None  # this node's own compute speed (the broker splits the batch by it)
    samples_done: int | None = None  # what it computed that went into applied steps
    tokens_done: int | None = None
    shards: tuple[ShardHeld, ...] | None = None  # erasure-coded snapshots this node keeps for others
    shards_placed: int | None = None
    recovery: str | None = None
    ratio_now: float | None = None
    history_steps: tuple[int, ...] | None = None
    history_mloss: tuple[int, ...] | None = None
    eval_steps: tuple[int, ...] | None = None
    eval_mloss: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if v is not None:
                checked = _STATUS_SPECS[f.name].check(f.name, v)
                if checked is not v:
                    object.__setattr__(self, f.name, checked)

    def said(self) -> dict[str, Any]:
        """The fields this status sets, by name (the record's keyword arguments)."""
        return {f.name: v for f in dataclasses.fields(self) if (v := getattr(self, f.name)) is not None}

    def to_wire(self) -> dict[str, Any]:
        """The fields this status sets, as the record encodes them (plain maps and lists: JSON-ready); once it names
        a run, also None for each optional field it leaves unsaid (a run's status file always carries those)."""
        out = {k: _STATUS_SPECS[k].to_wire(v) for k, v in self.said().items()}
        if self.run_id is not None:
            for f in dataclasses.fields(self):
                if f.name not in out and isinstance(_STATUS_SPECS[f.name], Optional):
                    out[f.name] = None
        return out


@dataclass(frozen=True, kw_only=True, slots=True)
class LeaveNotice(SignedRecord):
    KIND: ClassVar[str] = "leave"
    peer_id: str = spec(PEER_ID)
    time: float = spec(TIME_S)
    reason: str = spec(Str(200), default="")


_STATUS_SPECS = {f.name: f.metadata["spec"] for f in dataclasses.fields(StatusRecord)}
_unknown = {f.name for f in dataclasses.fields(RunStatus)} - set(_STATUS_SPECS)
assert not _unknown, f"RunStatus fields that StatusRecord lacks: {_unknown}"

#: a node's own record kinds (protocol/kinds.py joins them with the run's into the table gossip and the DHT accept)
NODE_RECORD_TYPES: dict[str, type[SignedRecord]] = {cls.KIND: cls for cls in (Announcement, StatusRecord, LeaveNotice)}
