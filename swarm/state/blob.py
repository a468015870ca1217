"""A snapshot as one byte string and back: the state-transfer header (revision, whole-state hash, skeleton, tensor
list) behind a length prefix, then every tensor's raw bytes in name order. The form disk checkpoints and
erasure-coded shards share; read back strictly (limits before allocation, no pickle) and checked against its hash."""

from __future__ import annotations

import struct
from collections.abc import Iterator

import torch

from shoal.kernels.codec import dtype_name
from shoal.protocol.errors import ProtocolError
from shoal.protocol.wire import pack, unpack
from shoal.swarm.state.snapshot import Snapshot, StateTransferError, raw_bytes, state_hash, unflatten_state
from shoal.swarm.state.transfer import StateTransferConfig, check_header

MAGIC = b"SHOALST1"
_PREFIX = struct.Struct(">8sI")  # magic, header length


def snapshot_parts(snap: Snapshot) -> Iterator[memoryview | bytes]:
    """The blob of `snap` in pieces (the prefix and header, then each tensor's bytes), without joining them."""
    names = sorted(snap.tensors)
    entries = [[n, dtype_name(snap.tensors[n].dtype), list(snap.tensors[n].shape),
                snap.tensors[n].numel() * snap.tensors[n].element_size()] for n in names]
    header = pack({"ok": True, "revision": snap.revision, "hash": snap.hash, "skeleton": pack(snap.skeleton),
                   "tensors": entries})
    yield _PREFIX.pack(MAGIC, len(header)) + header
    for n in names:
        if snap.tensors[n].numel():
            yield raw_bytes(snap.tensors[n])


def blob_size(snap: Snapshot) -> int:
    return sum(len(p) for p in snapshot_parts(snap))


def snapshot_bytes(snap: Snapshot) -> bytes:
    """The whole blob as one byte string (what erasure coding splits)."""
    return b"".join(snapshot_parts(snap))


def read_snapshot(data: bytes | bytearray | memoryview, *, config: StateTransferConfig = StateTransferConfig(),
                  expect_hash: str | None = None) -> Snapshot:
    """The snapshot a blob holds, every field and size checked before use and the whole-state hash recomputed
    (and, with `expect_hash`, compared with the hash the caller was told to expect). StateTransferError if not."""
    view = memoryview(data)
    if len(view) < _PREFIX.size:
        raise StateTransferError(f"state blob of {len(view)} bytes is shorter than its prefix")
    magic, hlen = _PREFIX.unpack_from(view)
    if magic != MAGIC:
        raise StateTransferError("not a shoal state blob (bad magic)")
    if hlen > config.max_header_bytes or _PREFIX.size + hlen > len(view):
        raise StateTransferError(f"state header of {hlen} bytes is over the limit or past the blob's end")
    try:
        header = unpack(view[_PREFIX.size:_PREFIX.size + hlen], max_bytes=config.max_header_bytes)
    except ProtocolError as e:
        raise StateTransferError(f"state header: {e}") from None
    rev, hsh, skeleton, entries = check_header(header, config)
    at = _PREFIX.size + hlen
    if at + sum(e[3] for e in entries) != len(view):
        raise StateTransferError(f"state blob holds {len(view) - at} tensor bytes, its header lists "
                                 f"{sum(e[3] for e in entries)}")
    tensors: dict[str, torch.Tensor] = {}
    for name, dtype, shape, nbytes in entries:
        buf = bytearray(view[at:at + nbytes])  # a private, writable copy: the tensor outlives `data`
        tensors[name] = torch.frombuffer(buf, dtype=torch.uint8).view(dtype).reshape(shape) if nbytes \
            else torch.empty(shape, dtype=dtype)
        at += nbytes
    got = state_hash(tensors, skeleton)
    if got != hsh:
        raise StateTransferError(f"state blob fails its hash ({got[:12]}… != {hsh[:12]}…)")
    if expect_hash is not None and got != expect_hash:
        raise StateTransferError(f"state blob hashes to {got[:12]}…, not the expected {expect_hash[:12]}…")
    unflatten_state(tensors, skeleton)  # every tensor reference resolves
    return Snapshot(tensors=tensors, skeleton=skeleton, revision=rev, hash=hsh)
