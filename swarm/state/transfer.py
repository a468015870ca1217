"""Moving a replica's synchronized state between nodes (no pickle), state hashes, and PCCL's majority-hash election."""

from __future__ import annotations

import hashlib
import logging
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import msgpack
import torch
import trio

from shoal.protocol.errors import ProtocolError
from shoal.protocol.wire import pack, unpack
from shoal.swarm.net.framing import StreamClosed, close_quietly, read_exactly, read_frame, write_frame
from shoal.swarm.net.host import SwarmHost
from shoal.swarm.net.penalty import Penalties

log = logging.getLogger(__name__)

STATE_PROTOCOL = "/shoal/state/1.0.0"
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64,
    "int64": torch.int64, "int32": torch.int32, "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8,
    "bool": torch.bool}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
MAX_NDIM = 8
MAX_NAME = 256
MAX_PREFIXES = 16


class StateTransferError(RuntimeError):
    """A pull failed: the peer refused, vanished, was too slow, or sent something invalid (nothing was loaded)."""


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


# -- flattening ---------------------------------------------------------------------------------------------
def flatten_state(state: Any) -> tuple[dict[str, torch.Tensor], Any]:
    """Split a nested state (e.g. Trainer.state_dict()) into named tensors and a msgpack-able skeleton.

    Tensors become {"__t": name}; tuples {"__tuple": [...]}; maps with non-str (or "__") keys {"__map": [[k, v]]}.
    """
    tensors: dict[str, torch.Tensor] = {}

    def walk(v: Any, path: str) -> Any:
        if isinstance(v, torch.Tensor):
            if v.dtype not in DTYPE_NAMES:
                raise TypeError(f"{path}: dtype {v.dtype} cannot be transferred")
            tensors[path] = v.detach().cpu()
            return {"__t": path}
        if v is None or isinstance(v, (bool, int, float, str, bytes)):
            return v
        if isinstance(v, tuple):
            return {"__tuple": [walk(x, f"{path}/{i}") for i, x in enumerate(v)]}
        if isinstance(v, list):
            return [walk(x, f"{path}/{i}") for i, x in enumerate(v)]
        if isinstance(v, dict):
            if all(isinstance(k, str) and not k.startswith("__") for k in v):
                return {k: walk(x, f"{path}/{k}") for k, x in v.items()}
            return {"__map": [[k, walk(x, f"{path}/{k}")] for k, x in v.items()]}
        raise TypeError(f"{path}: {type(v).__name__} cannot be transferred")

    return tensors, walk(state, "")


def unflatten_state(tensors: dict[str, torch.Tensor], skeleton: Any) -> Any:
    def walk(v: Any) -> Any:
        if isinstance(v, list):
            return [walk(x) for x in v]
        if isinstance(v, dict):
            if set(v) == {"__t"}:
                if v["__t"] not in tensors:
                    raise StateTransferError(f"state names a tensor it did not send: {str(v['__t'])[:80]!r}")
                return tensors[v["__t"]]
            if set(v) == {"__tuple"} and isinstance(v["__tuple"], list):
                return tuple(walk(x) for x in v["__tuple"])
            if set(v) == {"__map"} and isinstance(v["__map"], list):
                out = {}
                for kv in v["__map"]:
                    if not isinstance(kv, list) or len(kv) != 2 or isinstance(kv[0], (list, dict)):
                        raise StateTransferError("malformed map entry in the state")
                    out[kv[0]] = walk(kv[1])
                return out
            return {k: walk(x) for k, x in v.items()}
        return v

    try:
        return walk(skeleton)
    except RecursionError:
        raise StateTransferError("state nested too deeply") from None


def tensor_refs(skeleton: Any) -> set[str]:
    """The names of the tensors a skeleton refers to."""
    out: set[str] = set()

    def walk(v: Any) -> None:
        if isinstance(v, list):
            for x in v:
                walk(x)
        elif isinstance(v, dict):
            if set(v) == {"__t"} and isinstance(v["__t"], str):
                out.add(v["__t"])
            else:
                for x in v.values():
                    walk(x)

    walk(skeleton)
    return out


def _raw(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def state_hash(tensors: dict[str, torch.Tensor], skeleton: Any = None) -> str:
    """sha256 over every tensor's name, dtype, shape and bytes (sorted by name), then the plain values."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name]
        h.update(pack([name, DTYPE_NAMES[t.dtype], list(t.shape)]))
        if t.numel():
            h.update(_raw(t))
    h.update(pack(skeleton))
    return h.hexdigest()


@dataclass(frozen=True, kw_only=True, slots=True)
class Snapshot:
    """A frozen copy of a replica's state at `revision` (its synchronized step), with its hash."""

    tensors: dict[str, torch.Tensor]
    skeleton: Any
    revision: int
    hash: str

    @classmethod
    def of(cls, state: Any, revision: int) -> Snapshot:
        """Copy `state` (tensors cloned, so training can go on while this is served)."""
        tensors, skeleton = flatten_state(state)
        tensors = {k: v.clone() for k, v in tensors.items()}
        return cls(tensors=tensors, skeleton=skeleton, revision=revision, hash=state_hash(tensors, skeleton))

    def state(self) -> Any:
        return unflatten_state(self.tensors, self.skeleton)

    def only(self, prefixes: tuple[str, ...]) -> Snapshot:
        """The tensors whose names start with one of `prefixes`, with the whole skeleton (a partial snapshot)."""
        tensors = {k: v for k, v in self.tensors.items() if k.startswith(prefixes)}
        return Snapshot(tensors=tensors, skeleton=self.skeleton, revision=self.revision,
                        hash=state_hash(tensors, self.skeleton))

    def missing(self, *bases: Snapshot) -> set[str]:
        """Tensors the skeleton names that neither this partial snapshot nor `bases` hold."""
        have = set(self.tensors).union(*(b.tensors for b in bases))
        return tensor_refs(self.skeleton) - have

    def merged(self, *bases: Snapshot) -> Snapshot:
        """This partial snapshot completed with `bases`' other tensors (later bases win; a backup's warm copy
        first); raises StateTransferError when the skeleton names a tensor none of them holds."""
        tensors: dict[str, torch.Tensor] = {}
        for b in bases:
            tensors.update(b.tensors)
        tensors.update(self.tensors)
        unflatten_state(tensors, self.skeleton)
        return Snapshot(tensors=tensors, skeleton=self.skeleton, revision=self.revision,
                        hash=state_hash(tensors, self.skeleton))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


# -- serving ------------------------------------------------------------------------------------------------
class StateServer:
    """Serves `provider()` (the latest Snapshot, or None) to any peer that asks on STATE_PROTOCOL."""

    def __init__(self, sh: SwarmHost, provider: Callable[[], Snapshot | None], *, penalties: Penalties | None = None,
                 config: StateTransferConfig = StateTransferConfig(),
                 by_revision: Callable[[int], Snapshot | None] | None = None):
        self.sh = sh
        self.provider = provider
        self.by_revision = by_revision  # serves requests for one exact revision (a joining replica's entry point)
        self.penalties = penalties
        self.config = config
        self.served = 0
        sh.set_handler(STATE_PROTOCOL, self._serve)

    async def _serve(self, stream) -> None:
        peer = stream.muxed_conn.peer_id.to_base58()
        if self.penalties is not None and self.penalties.is_banned(peer):
            await stream.reset()
            return
        try:
            with trio.fail_after(self.config.timeout_s):
                req = unpack(await read_frame(stream, 4096), max_bytes=4096)
                if not isinstance(req, dict) or req.get("want") != "state":
                    raise ProtocolError("state request must be {'want': 'state'}")
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
                    await write_frame(stream, pack({"ok": False, "e": what}))
                    await stream.close()
                    return
                if only is not None:  # hashing the part takes a while on a big model: not on the event loop
                    snap = await trio.to_thread.run_sync(snap.only, tuple(only))
                names = sorted(snap.tensors)
                entries = [[n, DTYPE_NAMES[snap.tensors[n].dtype], list(snap.tensors[n].shape),
                            snap.tensors[n].numel() * snap.tensors[n].element_size()] for n in names]
                await write_frame(stream, pack({"ok": True, "revision": snap.revision, "hash": snap.hash,
                                                "skeleton": pack(snap.skeleton), "tensors": entries}))
                step = self.config.chunk_bytes
                for n in names:
                    t = snap.tensors[n]
                    if t.numel():
                        raw = _raw(t)
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


# -- pulling ------------------------------------------------------------------------------------------------
def _check_header(h: Any, config: StateTransferConfig) -> tuple[int, str, Any, list[tuple[str, torch.dtype, tuple, int]]]:
    if not isinstance(h, dict):
        raise StateTransferError("header is not a map")
    if h.get("ok") is not True:
        raise StateTransferError(f"peer refused: {str(h.get('e'))[:200]}")
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
        numel = 1
        for d in e[2]:
            if not isinstance(d, int) or isinstance(d, bool) or not 0 <= d <= 1 << 40:
                raise StateTransferError(f"bad shape for {e[0][:80]!r}")
            numel *= d
        dtype = DTYPES[e[1]]
        if e[3] != numel * torch.empty((), dtype=dtype).element_size():
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
                     only: tuple[str, ...] | None = None) -> Snapshot:
    """Fetch `peer_id`'s current Snapshot (or exactly `revision`); verify sizes, dtypes and the hash.

    With `only`, just the tensors whose names start with those prefixes come (a partial snapshot: complete it
    with `Snapshot.merged`; its hash covers what was sent). Raises StateTransferError."""
    try:
        with trio.fail_after(config.timeout_s):
            stream = await sh.open_stream(peer_id, STATE_PROTOCOL, bulk=True)
            try:
                req = {"want": "state", "revision": revision}
                if only is not None:
                    req["only"] = list(only)
                await write_frame(stream, pack(req))
                header = unpack(await read_frame(stream, config.max_header_bytes), max_bytes=config.max_header_bytes)
                rev, hsh, skeleton, entries = _check_header(header, config)
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
    except trio.TooSlowError:
        raise StateTransferError(f"state from {peer_id[:16]}… not received within {config.timeout_s} s") from None
    except (ProtocolError, StreamClosed) as e:
        raise StateTransferError(f"state from {peer_id[:16]}…: {e}") from e
    except StateTransferError:
        raise
    except Exception as e:
        raise StateTransferError(f"state from {peer_id[:16]}…: {type(e).__name__}: {e}") from e
    got = state_hash(tensors, skeleton)
    if got != hsh:
        raise StateTransferError(f"state from {peer_id[:16]}… fails its checksum ({got[:12]}… != {hsh[:12]}…)")
    if only is None:
        unflatten_state(tensors, skeleton)  # every tensor reference resolves
    elif any(not k.startswith(only) for k in tensors):
        raise StateTransferError(f"state from {peer_id[:16]}… holds tensors that were not asked for")
    return Snapshot(tensors=tensors, skeleton=skeleton, revision=rev, hash=hsh)


async def pull_from_any(sh: SwarmHost, peers: Iterable[str], *, config: StateTransferConfig = StateTransferConfig(),
                        expect_hash: str | None = None) -> tuple[str, Snapshot]:
    """Try `peers` in order (e.g. the majority's members) until one serves a valid state."""
    errors = []
    for p in peers:
        try:
            return p, await pull_state(sh, p, config=config, expect_hash=expect_hash)
        except StateTransferError as e:
            log.warning("state pull from %s failed: %s", p, e)
            errors.append(str(e))
    raise StateTransferError("no peer served the state: " + "; ".join(errors)[:500])


async def keep_warm(sh: SwarmHost, client, on_snapshot: Callable[[Snapshot], None], *, every_s: float = 60.0,
                    config: StateTransferConfig = StateTransferConfig()) -> None:
    """While `client` (a RunClient) is a backup, pull a fresh copy from an active replica every `every_s`."""
    i = 0
    while True:
        t = client.table
        if client.role() == "backup" and t is not None and t.members(0):
            members = t.members(0)
            peer = members[i % len(members)]
            i += 1
            try:
                on_snapshot(await pull_state(sh, peer, config=config))
            except StateTransferError as e:
                log.info("warm copy from %s failed: %s", peer, e)
        await trio.sleep(every_s)


# -- majority hash (PCCL shared-state parity) ---------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class HashReport:
    peer_id: str
    revision: int
    hash: str


@dataclass(frozen=True, kw_only=True, slots=True)
class Election:
    revision: int
    hash: str  # the most popular hash; ties go to the smallest hash string, so every peer elects the same
    agree: tuple[str, ...]  # peers holding it: sources to pull from
    deviating: tuple[str, ...]  # peers that must pull the state from an agreeing peer
    rejected: tuple[str, ...]  # wrong revision or duplicate reports: not counted


def elect_majority(reports: Iterable[HashReport], *, previous_revision: int | None) -> Election | None:
    """Elect the shared state's hash. Each report's revision must be exactly previous_revision + 1
    (with no previous revision, the most reported revision counts). None when no report counts."""
    seen: set[str] = set()
    valid, rejected = [], []
    reports = list(reports)
    if previous_revision is not None:
        want = previous_revision + 1
    else:
        revs = Counter(r.revision for r in reports)
        want = min(revs, key=lambda v: (-revs[v], -v)) if revs else 0
    for r in reports:
        if r.peer_id in seen or r.revision != want:
            rejected.append(r.peer_id)
        else:
            valid.append(r)
        seen.add(r.peer_id)
    if not valid:
        return None
    counts = Counter(r.hash for r in valid)
    best = min(counts, key=lambda h: (-counts[h], h))
    return Election(revision=want, hash=best, agree=tuple(sorted(r.peer_id for r in valid if r.hash == best)),
                    deviating=tuple(sorted(r.peer_id for r in valid if r.hash != best)),
                    rejected=tuple(sorted(set(rejected))))
