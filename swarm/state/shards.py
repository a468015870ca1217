"""Erasure-coded snapshots between nodes: who holds which shard, the holder's store and service, pushing a stage's
shards to their holders, and rebuilding the stage's state from any k of them (docs/snapshots.md).

A holder keeps, per stage, the newest committed revision and the one being written, and serves them only to the
run's members at a bounded rate. Every shard travels with the encoder's signed manifest; a shard is taken only
when its bytes hash to the manifest's entry, and the rebuilt state only when it hashes to the manifest's whole-state
hash. A holder whose shard fails is penalised and another shard is used.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import trio

from shoal.protocol.assignment import AssignmentTable
from shoal.protocol.envelope import open_envelope
from shoal.protocol.errors import ProtocolError
from shoal.protocol.records import ShardHeld
from shoal.protocol.shards import MAX_SHARDS, SHARD_PROTOCOL, SHARD_RECORD_TYPES, ShardManifest, ShardRequest
from shoal.protocol.wire import pack, unpack
from shoal.swarm.net.framing import StreamClosed, close_quietly, exchange_failures, read_frame, write_frame
from shoal.swarm.net.host import SwarmHost
from shoal.swarm.net.penalty import Penalties
from shoal.swarm.state import erasure
from shoal.swarm.state.blob import read_snapshot
from shoal.swarm.state.snapshot import Snapshot, StateTransferError
from shoal.swarm.state.transfer import StateTransferConfig

log = logging.getLogger(__name__)

MAX_FRAME = 16 << 10  # requests and answers other than shard bytes
MAX_MANIFESTS = 4  # manifests one holder lists for one stage


@dataclass(frozen=True, kw_only=True, slots=True)
class ShardConfig:
    max_shard_bytes: int = 4 << 30  # refuse a shard larger than this before reading any of it
    timeout_s: float = 120.0  # one push or pull
    ask_timeout_s: float = 5.0  # one manifest request
    chunk_bytes: int = 1 << 20
    per_peer: int = 64  # requests a peer may make (an encoder's pushes and commits, a rebuild's asks) ...
    per_s: float = 10.0  # ... within this many seconds

    def __post_init__(self) -> None:
        if min(self.max_shard_bytes, self.chunk_bytes, self.per_peer) < 1 or \
                min(self.timeout_s, self.ask_timeout_s, self.per_s) <= 0:
            raise ValueError("shard limits and timeouts must be positive")


def shard_holders(table: AssignmentTable, stage: int, *, m: int, max_k: int) -> tuple[int, tuple[str, ...]]:
    """(k, holders) for `stage`'s shards under `table`: peers that are not the stage's own replicas, backups first
    (those keeping `stage` warm before the others: the likely replacement then holds a shard itself), then members
    of the other stages, lane by lane; one shard per peer. k is as large as the peers allow, at most `max_k`;
    (0, ()) when fewer than m + 1 peers can hold one."""
    own = set(table.members(stage))
    warm = [b for b in table.backups if table.backup_stage(b) == stage]
    other_backups = [b for b in table.backups if table.backup_stage(b) != stage]
    others = [s.peer_id for s in sorted(table.slots, key=lambda s: (s.replica, abs(s.stage - stage), s.stage))
              if s.stage != stage]
    cands = list(dict.fromkeys(p for p in warm + other_backups + others if p not in own))
    k = min(max_k, len(cands) - m, MAX_SHARDS - m)
    if k < 1:
        return 0, ()
    return k, tuple(cands[:k + m])


def sha256_hex(data: bytes | bytearray | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def open_manifest(raw: bytes) -> ShardManifest:
    signed = open_envelope(raw, SHARD_RECORD_TYPES, max_bytes=MAX_FRAME)
    if not isinstance(signed.record, ShardManifest):
        raise ProtocolError("not a shard manifest")
    return signed.record


# -- the holder -------------------------------------------------------------------------------------------------
@dataclass(slots=True)
class HeldShard:
    manifest: ShardManifest
    raw: bytes  # the sealed manifest, served as it came
    index: int
    data: bytes


class ShardStore:
    """The shards this node keeps for others, per stage: the newest committed revision and the one being written
    (owned by the event loop)."""

    def __init__(self) -> None:
        self._held: dict[int, dict[int, HeldShard]] = {}
        self.committed: dict[int, int] = {}

    def put(self, held: HeldShard) -> None:
        stage, rev = held.manifest.stage, held.manifest.revision
        self._held.setdefault(stage, {})[rev] = held
        self._trim(stage)

    def commit(self, stage: int, revision: int) -> bool:
        if revision not in self._held.get(stage, {}):
            return False
        self.committed[stage] = max(self.committed.get(stage, -1), revision)
        self._trim(stage)
        return True

    def _trim(self, stage: int) -> None:
        revs = self._held.get(stage, {})
        done = self.committed.get(stage, -1)
        newer = [r for r in revs if r > done]
        keep = {done} | ({max(newer)} if newer else set())
        for r in [r for r in revs if r not in keep]:
            del revs[r]

    def get(self, stage: int, revision: int) -> HeldShard | None:
        return self._held.get(stage, {}).get(revision)

    def manifests(self, stage: int) -> list[bytes]:
        revs = self._held.get(stage, {})
        return [revs[r].raw for r in sorted(revs, reverse=True)][:MAX_MANIFESTS]

    def holdings(self) -> list[ShardHeld]:
        return [ShardHeld(stage=s, revision=r, index=h.index) for s, revs in sorted(self._held.items())
                for r, h in sorted(revs.items())]

    @property
    def nbytes(self) -> int:
        return sum(len(h.data) for revs in self._held.values() for h in revs.values())

    def nbytes_by_stage(self) -> dict[int, int]:
        return {st: sum(len(h.data) for h in revs.values()) for st, revs in self._held.items() if revs}

    def drop_newer(self, stage: int, revision: int) -> None:
        """Forget revisions of `stage` after `revision` (the run rolled back past them)."""
        revs = self._held.get(stage, {})
        for r in [r for r in revs if r > revision]:
            del revs[r]


class RateLimit:
    """At most `per_peer` requests per peer within `per_s` seconds."""

    def __init__(self, per_peer: int, per_s: float, clock: Callable[[], float] = time.monotonic):
        self.per_peer, self.per_s, self.clock = per_peer, per_s, clock
        self._asked: dict[str, list[float]] = {}

    def allow(self, peer: str) -> bool:
        now = self.clock()
        recent = [t for t in self._asked.get(peer, []) if now - t < self.per_s]
        ok = len(recent) < self.per_peer
        self._asked[peer] = recent + [now] if ok else recent
        for p in [p for p, ts in self._asked.items() if not ts or now - ts[-1] >= self.per_s]:
            del self._asked[p]
        return ok


@dataclass(slots=True)
class ShardStats:
    served: int = 0
    refused: int = 0
    stored: int = 0
    rejected: list[str] = field(default_factory=list)  # why pushes were refused (the last few)


class ShardService:
    """Answers SHARD_PROTOCOL for `run_id`: stores pushed shards, serves manifests and shards. `member(peer)`: a
    provider of the run (only those are served); `encoder_of(peer, stage, revision)`: whether `peer` may have
    encoded `stage` at `revision` (it held a slot of that stage)."""

    def __init__(self, sh: SwarmHost, run_id: str, store: ShardStore, *, member: Callable[[str], bool],
                 encoder_of: Callable[[str, int, int], bool], penalties: Penalties,
                 config: ShardConfig = ShardConfig(), clock: Callable[[], float] = time.monotonic):
        self.sh, self.run_id, self.store = sh, run_id, store
        self.member, self.encoder_of, self.penalties, self.config = member, encoder_of, penalties, config
        self.limit = RateLimit(config.per_peer, config.per_s, clock)
        self.stats = ShardStats()
        sh.set_handler(SHARD_PROTOCOL, self._serve)

    async def _serve(self, stream) -> None:
        peer = stream.muxed_conn.peer_id.to_base58()
        if self.penalties.is_banned(peer) or not self.member(peer) or not self.limit.allow(peer):
            self.stats.refused += 1
            await stream.reset()
            return
        try:
            with trio.fail_after(self.config.timeout_s):
                req = ShardRequest.from_wire(unpack(await read_frame(stream, MAX_FRAME), max_bytes=MAX_FRAME))
                if req.run_id != self.run_id:
                    raise ProtocolError("a shard request for another run")
                if req.want == "manifest":
                    await self._answer(stream, {"ok": True, "manifests": self.store.manifests(req.stage)})
                elif req.want == "shard":
                    await self._send_shard(stream, req)
                elif req.want == "put":
                    await self._take(stream, peer, req)
                else:
                    if self._encoded_by(peer, req) and req.revision is not None:
                        self.store.commit(req.stage, req.revision)
                    await self._answer(stream, {"ok": True})
        except ProtocolError as e:
            self.penalties.penalize(peer, f"bad shard request: {e}")
            await _reset(stream)
        except (StreamClosed, trio.TooSlowError) as e:
            log.info("shard exchange with %s ended early: %s", peer[-8:], e)
            await _reset(stream)
        except Exception as e:  # noqa: BLE001 - a peer gone mid-answer (py-libp2p raises several kinds)
            log.info("shard exchange with %s failed: %s: %s", peer[-8:], type(e).__name__, e)
            await _reset(stream)

    async def _answer(self, stream, body: dict) -> None:
        await write_frame(stream, pack(body))
        await stream.close()

    def _encoded_by(self, peer: str, req: ShardRequest) -> bool:
        held = self.store.get(req.stage, req.revision) if req.revision is not None else None
        return held is not None and held.manifest.peer_id == peer

    async def _send_shard(self, stream, req: ShardRequest) -> None:
        held = self.store.get(req.stage, req.revision) if req.revision is not None else None
        if held is None or held.index != req.index:
            await self._answer(stream, {"ok": False, "e": f"no shard {req.index} of stage {req.stage} at revision "
                                                          f"{req.revision} here"})
            return
        await write_frame(stream, pack({"ok": True, "bytes": len(held.data)}))
        view, step = memoryview(held.data), self.config.chunk_bytes
        for i in range(0, len(view), step):
            await stream.write(bytes(view[i:i + step]))
        await stream.close()
        self.stats.served += 1

    async def _take(self, stream, peer: str, req: ShardRequest) -> None:
        if req.manifest is None or req.index is None:  # a put names both (ShardRequest checks it)
            raise ProtocolError("a put without its manifest or shard index")
        index = req.index
        try:
            man = open_manifest(req.manifest)
        except ProtocolError as e:
            raise ProtocolError(f"shard manifest: {e}") from None
        why = None
        if man.peer_id != peer:
            why = "the manifest is not the pusher's own"
        elif man.run_id != self.run_id or man.stage != req.stage or man.revision != req.revision:
            why = "the manifest names another run, stage or revision"
        elif man.index_of(self.sh.peer_id) != req.index:
            why = f"this node does not hold shard {req.index} in the manifest"
        elif man.shard_bytes > self.config.max_shard_bytes:
            why = f"a shard of {man.shard_bytes} bytes is over this node's limit"
        elif not self.encoder_of(peer, man.stage, man.revision):
            why = f"the pusher held no slot of stage {man.stage}"
        elif man.revision < self.store.committed.get(man.stage, -1):
            why = f"revision {man.revision} is older than the committed {self.store.committed[man.stage]}"
        if why is not None:
            self.stats.rejected = (self.stats.rejected + [why])[-8:]
            raise ProtocolError(why)
        data = await read_into(stream, man.shard_bytes, self.config.chunk_bytes)
        if sha256_hex(data) != man.shard_hashes[index]:
            raise ProtocolError(f"shard {index} does not hash to its manifest entry")
        self.store.put(HeldShard(manifest=man, raw=req.manifest, index=index, data=bytes(data)))
        self.stats.stored += 1
        await self._answer(stream, {"ok": True})


async def _reset(stream) -> None:
    try:
        await stream.reset()
    except Exception:  # noqa: BLE001 - already gone
        pass


async def read_into(stream, n: int, chunk: int) -> bytearray:
    """Exactly `n` bytes of `stream`, into one buffer allocated once."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        try:
            part = await stream.read(min(chunk, n - got))
        except Exception as e:  # py-libp2p raises on EOF and on reset (several exception types)
            raise StreamClosed(f"stream ended after {got} of {n} bytes: {type(e).__name__}") from e
        if not part:
            raise StreamClosed(f"stream ended after {got} of {n} bytes")
        view[got:got + len(part)] = part
        got += len(part)
    return buf


# -- the encoder's side -------------------------------------------------------------------------------------------
async def _ask(sh: SwarmHost, peer: str, req: ShardRequest, timeout_s: float, payload: bytes | memoryview = b"",
               chunk: int = 1 << 20) -> dict:
    with trio.fail_after(timeout_s):
        stream = await sh.open_stream(peer, SHARD_PROTOCOL, bulk=bool(payload))
        try:
            await write_frame(stream, pack(req.to_wire()))
            view = memoryview(payload)
            for i in range(0, len(view), chunk):
                await stream.write(bytes(view[i:i + chunk]))
            ans = unpack(await read_frame(stream, MAX_FRAME), max_bytes=MAX_FRAME)
        finally:
            await close_quietly(stream)
    if not isinstance(ans, dict) or ans.get("ok") is not True:
        raise StateTransferError(f"{peer[-8:]} refused: {str(ans.get('e') if isinstance(ans, dict) else ans)[:200]}")
    return ans


async def push_shards(sh: SwarmHost, manifest: ShardManifest, raw: bytes, shards: list, *,
                      config: ShardConfig = ShardConfig()) -> list[str]:
    """Hand shard i to holder i (all at once), then tell those that took theirs that the revision is complete when
    at least k did. Returns the holders that keep a shard."""
    placed: list[str] = []

    async def one(i: int, peer: str) -> None:
        req = ShardRequest(want="put", run_id=manifest.run_id, stage=manifest.stage, revision=manifest.revision,
                           index=i, manifest=raw)
        try:
            await _ask(sh, peer, req, config.timeout_s, shards[i], config.chunk_bytes)
            placed.append(peer)
        except (StateTransferError, StreamClosed, ProtocolError, trio.TooSlowError, OSError) as e:
            log.info("shard %d of stage %d at revision %d to %s: %s", i, manifest.stage, manifest.revision,
                     peer[-8:], e)
        except Exception as e:  # noqa: BLE001 - a holder's failure is data (dial errors of every kind)
            log.info("shard %d to %s: %s: %s", i, peer[-8:], type(e).__name__, e)

    async with trio.open_nursery() as n:
        for i, peer in enumerate(manifest.holders):
            n.start_soon(one, i, peer)
    if len(placed) >= manifest.k:
        commit = ShardRequest(want="commit", run_id=manifest.run_id, stage=manifest.stage, revision=manifest.revision)
        async with trio.open_nursery() as n:
            for peer in placed:
                n.start_soon(_quiet, _ask(sh, peer, commit, config.ask_timeout_s))
    return placed


async def _quiet(aw) -> None:
    try:
        await aw
    except Exception as e:  # noqa: BLE001 - a commit that does not arrive leaves the revision "being written"
        log.info("shard commit: %s: %s", type(e).__name__, e)


# -- rebuilding a stage ----------------------------------------------------------------------------------------
class NotRecoverable(StateTransferError):
    """Fewer than k good shards of every revision that was asked for."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Rebuilt:
    snapshot: Snapshot
    manifest: ShardManifest
    used: tuple[str, ...]  # the holders whose shards went into it
    rejected: tuple[str, ...]  # holders whose shard failed its hash (penalised)
    bytes_pulled: int
    seconds: float


async def find_manifests(sh: SwarmHost, peers: list[str], run_id: str, stage: int, *,
                         signer_ok: Callable[[str, int], bool], config: ShardConfig = ShardConfig(),
                         local: ShardStore | None = None) -> dict[int, tuple[ShardManifest, set[str]]]:
    """revision -> (manifest, peers that hold a shard under it), asked of `peers` at once (and of `local`, this
    node's own store). A manifest counts only when its signature checks and its signer may have encoded the stage at
    that revision; two different manifests for one revision: the one more holders confirm."""
    seen: dict[int, dict[bytes, tuple[ShardManifest, set[str]]]] = {}

    async def one(peer: str) -> None:
        req = ShardRequest(want="manifest", run_id=run_id, stage=stage)
        try:
            raws = local.manifests(stage) if peer == sh.peer_id and local is not None else \
                (await _ask(sh, peer, req, config.ask_timeout_s)).get("manifests")
            if not isinstance(raws, list) or len(raws) > MAX_MANIFESTS:
                raise ProtocolError("bad manifest list")
            for raw in raws:
                if not isinstance(raw, bytes):
                    raise ProtocolError("bad manifest list")
                man = open_manifest(raw)
                if man.run_id != run_id or man.stage != stage or not signer_ok(man.peer_id, man.revision) \
                        or man.index_of(peer) is None:
                    continue  # not a shard this peer could hold for us
                key = hashlib.sha256(raw).digest()
                seen.setdefault(man.revision, {}).setdefault(key, (man, set()))[1].add(peer)
        except Exception as e:  # noqa: BLE001 - an absent or misbehaving holder is one fewer shard
            log.info("shard manifests of stage %d from %s: %s: %s", stage, peer[-8:], type(e).__name__, e)

    async with trio.open_nursery() as n:
        for p in dict.fromkeys(list(peers) + ([sh.peer_id] if local is not None else [])):
            n.start_soon(one, p)
    return {rev: max(by.values(), key=lambda mh: len(mh[1])) for rev, by in seen.items()}


async def pull_shard(sh: SwarmHost, peer: str, man: ShardManifest, index: int, *,
                     config: ShardConfig = ShardConfig()) -> bytearray:
    """Shard `index` of `man` from `peer`, checked against the manifest's hash (StateTransferError if not)."""
    req = ShardRequest(want="shard", run_id=man.run_id, stage=man.stage, revision=man.revision, index=index)
    with exchange_failures(StateTransferError, f"shard {index} from {peer[:16]}…", config.timeout_s):
        stream = await sh.open_stream(peer, SHARD_PROTOCOL, bulk=True)
        try:
            await write_frame(stream, pack(req.to_wire()))
            ans = unpack(await read_frame(stream, MAX_FRAME), max_bytes=MAX_FRAME)
            if not isinstance(ans, dict) or ans.get("ok") is not True:
                raise StateTransferError(f"refused: {str(ans.get('e') if isinstance(ans, dict) else ans)[:200]}")
            if ans.get("bytes") != man.shard_bytes:
                raise StateTransferError(f"offers {ans.get('bytes')!r} bytes, the manifest says {man.shard_bytes}")
            data = await read_into(stream, man.shard_bytes, config.chunk_bytes)
        finally:
            await close_quietly(stream)
    got = await trio.to_thread.run_sync(sha256_hex, data)
    if got != man.shard_hashes[index]:
        raise ShardForged(f"shard {index} hashes to {got[:12]}…, its manifest says {man.shard_hashes[index][:12]}…")
    return data


class ShardForged(StateTransferError):
    """A shard whose bytes do not hash to its manifest's entry."""


async def rebuild(sh: SwarmHost, man: ShardManifest, holders: set[str], *, penalties: Penalties,
                  config: ShardConfig = ShardConfig(), state_config: StateTransferConfig = StateTransferConfig(),
                  clock: Callable[[], float] = time.monotonic, local: ShardStore | None = None) -> Rebuilt:
    """The state of `man` from k of its shards (this node's own first, from `local`), pulled from `holders` k at a
    time in parallel; a shard that fails its hash penalises its holder and another holder's shard is pulled
    instead."""
    t0 = clock()
    me = sh.peer_id
    ranked = sorted((p != me, i, p) for p in holders if (i := man.index_of(p)) is not None)
    todo = [(i, p) for _, i, p in ranked]
    got: dict[int, bytearray] = {}
    used: list[str] = []
    rejected: list[str] = []
    pulled = 0
    while len(got) < man.k:
        batch, todo = todo[:man.k - len(got)], todo[man.k - len(got):]
        if not batch:
            raise NotRecoverable(f"stage {man.stage} at revision {man.revision}: {len(got)} good shards of the "
                                 f"{man.k} needed ({len(rejected)} failed their hash)")

        async def one(i: int, peer: str) -> None:
            nonlocal pulled
            try:
                mine = local.get(man.stage, man.revision) if peer == me and local is not None else None
                if mine is not None and mine.index == i and sha256_hex(mine.data) == man.shard_hashes[i]:
                    got[i] = bytearray(mine.data)
                    used.append(peer)
                    return
                got[i] = await pull_shard(sh, peer, man, i, config=config)
                used.append(peer)
                pulled += man.shard_bytes
            except ShardForged as e:
                rejected.append(peer)
                penalties.penalize(peer, f"shard {i} of stage {man.stage}: {e}")
                log.warning("shard %d of stage %d from %s fails its hash: %s", i, man.stage, peer[-8:], e)
            except StateTransferError as e:
                log.info("shard %d of stage %d from %s: %s", i, man.stage, peer[-8:], e)

        async with trio.open_nursery() as n:
            for i, peer in batch:
                n.start_soon(one, i, peer)

    def decode() -> Snapshot:
        blob = erasure.decode({i: got[i] for i in sorted(got)[:man.k]}, man.k, man.m, man.state_bytes)
        return read_snapshot(blob, config=state_config, expect_hash=man.state_hash)

    snap = await trio.to_thread.run_sync(decode)
    if snap.revision != man.revision:
        raise StateTransferError(f"the rebuilt state is of revision {snap.revision}, its manifest says "
                                 f"{man.revision}")
    return Rebuilt(snapshot=snap, manifest=man, used=tuple(used), rejected=tuple(rejected), bytes_pulled=pulled,
                   seconds=clock() - t0)


async def recover_stage(sh: SwarmHost, peers: list[str], run_id: str, stage: int, *, penalties: Penalties,
                        signer_ok: Callable[[str, int], bool], revision_ok: Callable[[int], bool] = lambda r: True,
                        config: ShardConfig = ShardConfig(), clock: Callable[[], float] = time.monotonic,
                        local: ShardStore | None = None) -> Rebuilt:
    """The newest revision of `stage` (among those `revision_ok` accepts) that k good shards rebuild; holders are
    found by asking `peers` (and `local`, this node's own store) for their manifests. NotRecoverable when no
    revision has k good shards."""
    found = await find_manifests(sh, peers, run_id, stage, signer_ok=signer_ok, config=config, local=local)
    tried = []
    for rev in sorted(found, reverse=True):
        man, holders = found[rev]
        if not revision_ok(rev):
            tried.append(f"{rev}: not held by every other stage")
            continue
        if len(holders) < man.k:
            tried.append(f"{rev}: {len(holders)} of {man.k} shards reachable")
            continue
        try:
            return await rebuild(sh, man, holders, penalties=penalties, config=config, clock=clock, local=local)
        except StateTransferError as e:
            tried.append(f"{rev}: {e}")
    raise NotRecoverable(f"stage {stage} cannot be rebuilt from shards: "
                         + ("; ".join(tried) if tried else f"no holder of {len(set(peers))} asked has any"))
