"""Erasure-coded snapshots on the wire: the signed manifest of one stage's snapshot at one revision (which holder
keeps which shard, every shard's hash and the whole state's hash) and a request to a shard holder (docs/snapshots.md;
what a holder keeps is in its status record: records.ShardHeld)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from shoal.protocol.errors import FieldError
from shoal.protocol.records import PEER_ID, TIME_S
from shoal.protocol.schema import Bytes, Choice, Int, Optional, Seq, SignedRecord, Str, WireRecord, spec

MAX_SHARDS = 32  # k + m: holders of one stage's snapshot
HASH_HEX = Str(64, allow_empty=False)  # sha256, lowercase hex
SHARD_PROTOCOL = "/shoal/shards/1.0.0"
SHARD_WANTS = ("manifest", "shard", "put", "commit")


def _hex64(name: str, v: str) -> None:
    if len(v) != 64 or any(c not in "0123456789abcdef" for c in v):
        raise FieldError(name, "expected a sha256 digest in lowercase hex")


@dataclass(frozen=True, kw_only=True, slots=True)
class ShardManifest(SignedRecord):
    """One stage's committed snapshot at `revision`, split into k data + m parity shards of `shard_bytes` each;
    holder i keeps shard i. Signed by the stage member that encoded it (`peer_id`)."""

    KIND: ClassVar[str] = "shards"
    peer_id: str = spec(PEER_ID)  # the encoder: a member of `stage` at `revision`
    run_id: str = spec(Str(80, allow_empty=False))
    stage: int = spec(Int(0, 1023))
    revision: int = spec(Int(0, 2**62))
    state_hash: str = spec(HASH_HEX)  # the whole state's hash (swarm/state/snapshot.py state_hash)
    state_bytes: int = spec(Int(1, 2**50))  # the blob's length before padding
    k: int = spec(Int(1, MAX_SHARDS))
    m: int = spec(Int(0, MAX_SHARDS - 1))
    shard_bytes: int = spec(Int(8, 2**50))
    shard_hashes: tuple[str, ...] = spec(Seq(HASH_HEX, MAX_SHARDS))
    holders: tuple[str, ...] = spec(Seq(PEER_ID, MAX_SHARDS))
    time: float = spec(TIME_S)

    def __post_init__(self) -> None:
        WireRecord.__post_init__(self)
        n = self.k + self.m
        if n > MAX_SHARDS:
            raise FieldError("m", f"k + m is at most {MAX_SHARDS}")
        if len(self.shard_hashes) != n or len(self.holders) != n:
            raise FieldError("holders", f"one holder and one hash per shard ({n})")
        if len(set(self.holders)) != n or self.peer_id in self.holders:
            raise FieldError("holders", "a peer holds at most one shard, and never the encoder")
        _hex64("state_hash", self.state_hash)
        for i, h in enumerate(self.shard_hashes):
            _hex64(f"shard_hashes[{i}]", h)
        if self.shard_bytes % 8 or not self.state_bytes <= self.shard_bytes * self.k <= self.state_bytes + 8 * self.k:
            raise FieldError("shard_bytes", f"{self.shard_bytes} bytes per shard do not fit a {self.state_bytes}-byte "
                                            f"state in {self.k}")

    def index_of(self, peer_id: str) -> int | None:
        return self.holders.index(peer_id) if peer_id in self.holders else None


@dataclass(frozen=True, kw_only=True, slots=True)
class ShardRequest(WireRecord):
    """A request on SHARD_PROTOCOL. `manifest`: the manifests the holder keeps for `stage` (newest first);
    `shard`: shard `index` of `revision`; `put`: the encoder hands over a shard (the sealed manifest in `manifest`,
    the shard's bytes follow); `commit`: every shard of `revision` is placed, older revisions may go."""

    want: str = spec(Choice(frozenset(SHARD_WANTS)))
    run_id: str = spec(Str(80, allow_empty=False))
    stage: int = spec(Int(0, 1023))
    revision: int | None = spec(Optional(Int(0, 2**62)), default=None)
    index: int | None = spec(Optional(Int(0, MAX_SHARDS - 1)), default=None)
    manifest: bytes | None = spec(Optional(Bytes(8192)), default=None)

    def __post_init__(self) -> None:
        WireRecord.__post_init__(self)
        if self.want in ("shard", "commit", "put") and self.revision is None:
            raise FieldError("revision", f"a {self.want} request names its revision")
        if self.want in ("shard", "put") and self.index is None:
            raise FieldError("index", f"a {self.want} request names the shard")
        if (self.want == "put") != (self.manifest is not None):
            raise FieldError("manifest", "a put, and only a put, carries the sealed manifest")


SHARD_RECORD_TYPES: dict[str, type[SignedRecord]] = {ShardManifest.KIND: ShardManifest}
