"""Moving a replica's state between nodes: a server for snapshots by revision, and a pull that verifies before loading."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack
import torch
import trio

from shoal.kernels.codec import dtype_name
from shoal.protocol.errors import ProtocolError
from shoal.protocol.wire import pack, unpack
from shoal.swarm.net.framing import (StreamClosed, close_quietly, exchange_failures, read_exactly, read_frame,
                                     write_frame)
from shoal.swarm.net.host import SwarmHost
from shoal.swarm.net.penalty import Penalties
from shoal.swarm.state.snapshot import DTYPES, Snapshot, StateTransferError, raw_bytes, state_hash, unflatten_state

log = logging.getLogger(__name__)

STATE_PROTOCOL = "/shoal/state/1.0.0"
MAX_NDIM = 8
MAX_NAME = 256
MAX_PREFIXES = 16


@dataclass(frozen=True, kw_only=True, slots=True)
class StateTransferConfig:
    max_total_bytes: int = 8 << 30  # refuse a state larger than this before reading any of it
    max_tensors: int = 1 << 16
    max_header_bytes: int = 16 << 20  # names, shapes and the plain values
    timeout_s: float = 300.0
    chunk_bytes: int = 1 << 20

    def __post_init__(self) -> None:
        if min(self.max_total_bytes, self.max_tensors, self.max_header_bytes, self.chunk_bytes) <= 0 \
                or self.timeout_s <= 0:
            raise ValueError("limits and the timeout must be positive")


# -- serving ------------------------------------------------------------------------------------------------
class StateServer:
    """Serves `provider()` (the latest Snapshot, or None) to any peer that asks on STATE_PROTOCOL."""

    def __init__(self, sh: SwarmHost, provider: Callable[[], Snapshot | None], *, penalties: Penalties | None = None,
                 config: StateTransferConfig = StateTransferConfig(),
                 by_revision: Callable[[int], Snapshot | None] | None = None, protocol: str = STATE_PROTOCOL,
                 allow: Callable[[str], bool] | None = None, may_hold: Callable[[int], bool] | None = None):
        self.sh = sh
        self.allow = allow  # whom state is served to (a run's members); None: anyone
        self.refused = 0
        self.provider = provider
        self.by_revision = by_revision  # serves requests for one exact revision (a joining replica's entry point)
        # whether this server may still come to hold a revision by its own training (None: it may); one it does not
        # hold and never will it answers with `never`: the server has no say about that revision's state
        self.may_hold = may_hold
        self.penalties = penalties
        self.config = config
        self.served = 0
        sh.set_handler(protocol, self._serve)  # another protocol id: another kind of state on the same machinery

    async def _serve(self, stream) -> None:
        peer = stream.muxed_conn.peer_id.to_base58()
        if (self.penalties is not None and self.penalties.is_banned(peer)) or \
                (self.allow is not None and not self.allow(peer)):
            self.refused += 1
            await stream.reset()
            return
        try:
            with trio.fail_after(self.config.timeout_s):
                req = unpack(await read_frame(stream, 4096), max_bytes=4096)
                if not isinstance(req, dict) or req.get("want") not in ("state", "hash"):
                    raise ProtocolError("state request must be {'want': 'state' or 'hash'}")
                rev, only = req.get("revision"), req.get("only")
                if rev is not None and (not isinstance(rev, int) or isinstance(rev, bool) or rev < 0):
                    raise ProtocolError("revision must be a non-negative int")
                if only is not None and not (isinstance(only, list) and 0 < len(only) <= MAX_PREFIXES and all(
                        isinstance(x, str) and 0 < len(x) <= MAX_NAME for x in only)):
                    raise ProtocolError(f"'only' must be a list of 1..{MAX_PREFIXES} name prefixes")
                if rev is None:
                    snap = self.provider()
                else:
                    snap = self.by_revision(rev) if self.by_revision is not None else None
                if snap is None:
                    what = "no state to serve yet" if rev is None else f"revision {rev} is not available"
                    never = rev is not None and self.may_hold is not None and not self.may_hold(rev)
                    await write_frame(stream, pack({"ok": False, "e": what, **({"never": True} if never else {})}))
                    await stream.close()
                    return
                if only is not None and req["want"] == "state":  # hashing a part takes a while: not on the loop
                    snap = await trio.to_thread.run_sync(snap.only, tuple(only))
                if req["want"] == "hash":  # what this replica holds, for a joiner to find the majority's state
                    hsh = snap.hash if only is None else await trio.to_thread.run_sync(part_hash, snap, tuple(only))
                    await write_frame(stream, pack({"ok": True, "revision": snap.revision, "hash": hsh}))
                    await stream.close()
                    return
                names = sorted(snap.tensors)
                entries = [[n, dtype_name(snap.tensors[n].dtype), list(snap.tensors[n].shape),
                            snap.tensors[n].numel() * snap.tensors[n].element_size()] for n in names]
                await write_frame(stream, pack({"ok": True, "revision": snap.revision, "hash": snap.hash,
                                                "skeleton": pack(snap.skeleton), "tensors": entries}))
                step = self.config.chunk_bytes
                for n in names:
                    t = snap.tensors[n]
                    if t.numel():
                        raw = raw_bytes(t)
                        for i in range(0, len(raw), step):
                            await stream.write(bytes(raw[i:i + step]))
                await stream.close()
                self.served += 1
        except ProtocolError as e:
            if self.penalties is not None:
                self.penalties.penalize(peer, f"bad state request: {e}")
            await stream.reset()
        except (StreamClosed, trio.TooSlowError) as e:
            log.info("state transfer to %s ended early: %s", peer, e)
            await stream.reset()


def part_hash(snap: Snapshot, prefixes: tuple[str, ...]) -> str:
    """The hash of the tensors under `prefixes` alone (no skeleton: its plain values, such as the replica's data
    position and RNG state, differ between replicas that hold the same synchronized state)."""
    return state_hash({k: v for k, v in snap.tensors.items() if k.startswith(prefixes)})


# -- pulling ------------------------------------------------------------------------------------------------
class NotServed(StateTransferError):
    """The peer answered that it does not hold the state asked for (no lie: a revision it no longer keeps)."""


def check_header(h: Any, config: StateTransferConfig) -> tuple[int, str, Any, list[tuple[str, torch.dtype, tuple, int]]]:
    """A state header from an untrusted source, checked field by field: (revision, hash, skeleton, tensor entries
    as (name, dtype, shape, bytes)); StateTransferError on anything off."""
    if not isinstance(h, dict):
        raise StateTransferError("header is not a map")
    if h.get("ok") is not True:
        raise NotServed(f"peer refused: {str(h.get('e'))[:200]}")
    rev, hsh, skel, entries = h.get("revision"), h.get("hash"), h.get("skeleton"), h.get("tensors")
    if not isinstance(rev, int) or isinstance(rev, bool) or rev < 0:
        raise StateTransferError("bad revision")
    if not isinstance(hsh, str) or len(hsh) != 64 or any(c not in "0123456789abcdef" for c in hsh):
        raise StateTransferError("bad hash")
    if not isinstance(skel, bytes) or not isinstance(entries, list) or len(entries) > config.max_tensors:
        raise StateTransferError("bad skeleton or tensor list")
    out, names, total = [], set(), 0
    for e in entries:
        if not (isinstance(e, list) and len(e) == 4 and isinstance(e[0], str) and 0 < len(e[0]) <= MAX_NAME
                and e[1] in DTYPES and isinstance(e[2], list) and len(e[2]) <= MAX_NDIM
                and isinstance(e[3], int) and not isinstance(e[3], bool)):
            raise StateTransferError(f"bad tensor entry {str(e)[:120]}")
        if e[0] in names:
            raise StateTransferError(f"tensor {e[0][:80]!r} listed twice")
        names.add(e[0])
        if not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= 1 << 40 for d in e[2]):
            raise StateTransferError(f"bad shape for {e[0][:80]!r}")
        dtype = DTYPES[e[1]]
        if e[3] != math.prod(e[2]) * torch.empty((), dtype=dtype).element_size():
            raise StateTransferError(f"{e[0][:80]!r}: {e[3]} bytes do not match its shape and dtype")
        total += e[3]
        if total > config.max_total_bytes:
            raise StateTransferError(f"state larger than the limit of {config.max_total_bytes} bytes")
        out.append((e[0], dtype, tuple(e[2]), e[3]))
    try:
        skeleton = msgpack.unpackb(skel, raw=False, strict_map_key=False, use_list=True, max_ext_len=0,
                                   max_str_len=len(skel), max_bin_len=len(skel), max_array_len=len(skel),
                                   max_map_len=len(skel))
    except Exception as e:  # noqa: BLE001 - any decoding failure of untrusted bytes
        raise StateTransferError(f"bad skeleton: {type(e).__name__}: {e}") from None
    return rev, hsh, skeleton, out


async def pull_state(sh: SwarmHost, peer_id: str, *, config: StateTransferConfig = StateTransferConfig(),
                     expect_hash: str | None = None, revision: int | None = None,
                     only: tuple[str, ...] | None = None, protocol: str = STATE_PROTOCOL) -> Snapshot:
    """Fetch `peer_id`'s current Snapshot (or exactly `revision`); verify sizes, dtypes and the hash.

    With `only`, just the tensors whose names start with those prefixes come (a partial snapshot: complete it
    with `Snapshot.merged`; its hash covers what was sent). Raises StateTransferError."""
    with exchange_failures(StateTransferError, f"state from {peer_id[:16]}…", config.timeout_s):
        stream = await sh.open_stream(peer_id, protocol, bulk=True)
        try:
            req: dict[str, object] = {"want": "state", "revision": revision}
            if only is not None:
                req["only"] = list(only)
            await write_frame(stream, pack(req))
            header = unpack(await read_frame(stream, config.max_header_bytes), max_bytes=config.max_header_bytes)
            rev, hsh, skeleton, entries = check_header(header, config)
            if revision is not None and rev != revision:
                raise StateTransferError(f"asked for revision {revision}, got {rev}")
            if expect_hash is not None and hsh != expect_hash:
                raise StateTransferError(f"peer serves hash {hsh[:12]}…, not the expected {expect_hash[:12]}…")
            tensors: dict[str, torch.Tensor] = {}
            for name, dtype, shape, nbytes in entries:
                if nbytes == 0:
                    tensors[name] = torch.empty(shape, dtype=dtype)
                    continue
                buf = bytearray(await read_exactly(stream, nbytes))
                tensors[name] = torch.frombuffer(buf, dtype=torch.uint8).view(dtype).reshape(shape)
        finally:
            await close_quietly(stream)
    got = await trio.to_thread.run_sync(state_hash, tensors, skeleton)  # a big state: not on the event loop
    if got != hsh:
        raise StateTransferError(f"state from {peer_id[:16]}… fails its checksum ({got[:12]}… != {hsh[:12]}…)")
    if only is None:
        unflatten_state(tensors, skeleton)  # every tensor reference resolves
    elif any(not k.startswith(only) for k in tensors):
        raise StateTransferError(f"state from {peer_id[:16]}… holds tensors that were not asked for")
    return Snapshot(tensors=tensors, skeleton=skeleton, revision=rev, hash=hsh)
