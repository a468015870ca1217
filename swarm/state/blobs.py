"""Files a run names by sha256 (a model's initial weights, a tokenizer.json): a local store, a server that hands
out only the files a run names to the peers it admits, and a pull that checks size and hash before a file counts.

A manifest names such a file by hash and size, never by a path: a node gets it from the peers that hold it (the
run's owner first), writes it under a temporary name, and keeps it only when its bytes hash to the manifest's value
(a peer that sends other bytes is penalized). A pull that breaks resumes from the bytes already received.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path

import trio

from shoal.protocol.errors import ProtocolError
from shoal.protocol.manifest import is_sha256
from shoal.protocol.wire import pack, unpack
from shoal.swarm.net.framing import StreamClosed, close_quietly, read_frame, write_frame
from shoal.swarm.net.host import SwarmHost
from shoal.swarm.net.penalty import Penalties

log = logging.getLogger(__name__)

BLOB_PROTOCOL = "/shoal/blob/1.0.0"
CHUNK_BYTES = 1 << 20
HASH_CHUNK = 8 << 20


class BlobError(RuntimeError):
    """A file could not be had from any peer (or failed its hash); the message says which and why. `blame`: the
    peer sent every byte of a file that failed (not a resumed one, whose first bytes came from another)."""

    def __init__(self, message: str, *, blame: bool = False):
        super().__init__(message)
        self.blame = blame


def sha256_path(path: Path, prefix: int | None = None) -> hashlib._Hash:
    h = hashlib.sha256()
    left = prefix
    with open(path, "rb") as f:
        while left is None or left > 0:
            chunk = f.read(HASH_CHUNK if left is None else min(HASH_CHUNK, left))
            if not chunk:
                break
            h.update(chunk)
            if left is not None:
                left -= len(chunk)
    return h


class BlobStore:
    """Files under `root`, each named by the sha256 of its bytes. A file counts once its hash was checked (here,
    or when it was written); `path` answers only for such files."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self._checked: set[str] = set()

    def _file(self, digest: str) -> Path:
        if not is_sha256(digest):
            raise ValueError(f"not a sha256: {digest!r}")
        return self.root / digest

    def path(self, digest: str) -> Path | None:
        """The file with this hash, checked against it (once per process), or None."""
        p = self._file(digest)
        if not p.is_file():
            return None
        if digest not in self._checked:
            if sha256_path(p).hexdigest() != digest:
                log.warning("blob %s… does not match its hash: removed", digest[:16])
                p.unlink(missing_ok=True)
                return None
            self._checked.add(digest)
        return p

    def add_file(self, src: Path) -> tuple[str, int]:
        """Copy `src` into the store: (sha256, size)."""
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".add.{os.getpid()}.tmp"
        shutil.copyfile(src, tmp)
        digest = sha256_path(tmp).hexdigest()
        os.replace(tmp, self._file(digest))
        self._checked.add(digest)
        return digest, self._file(digest).stat().st_size

    def partial(self, digest: str) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        return self.root / f".{self._file(digest).name}.part"

    def commit(self, digest: str, part: Path) -> Path:
        final = self._file(digest)
        os.replace(part, final)
        self._checked.add(digest)
        return final


class BlobServer:
    """Serves the store's files whose hashes `named()` lists (the run's assets) to peers `allow` admits."""

    def __init__(self, sh: SwarmHost, store: BlobStore, named: Callable[[], Iterable[str]], *,
                 penalties: Penalties | None = None, allow: Callable[[str], bool] | None = None,
                 timeout_s: float = 600.0):
        self.store, self.named, self.penalties, self.allow, self.timeout_s = store, named, penalties, allow, timeout_s
        self.served = 0
        self.sent_bytes = 0
        sh.set_handler(BLOB_PROTOCOL, self._serve)

    async def _serve(self, stream) -> None:
        peer = stream.muxed_conn.peer_id.to_base58()
        if (self.penalties is not None and self.penalties.is_banned(peer)) or \
                (self.allow is not None and not self.allow(peer)):
            await stream.reset()
            return
        try:
            with trio.fail_after(self.timeout_s):
                req = unpack(await read_frame(stream, 1024), max_bytes=1024)
                if not isinstance(req, dict) or not isinstance(req.get("hash"), str) or not is_sha256(req["hash"]):
                    raise ProtocolError("blob request must be {'hash': sha256 hex, 'offset': int}")
                offset = req.get("offset", 0)
                if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
                    raise ProtocolError("offset must be a non-negative int")
                digest = req["hash"]
                path = self.store.path(digest) if digest in set(self.named()) else None
                if path is None:
                    await write_frame(stream, pack({"ok": False, "e": "not here"}))
                    await stream.close()
                    return
                size = path.stat().st_size
                await write_frame(stream, pack({"ok": True, "size": size}))
                with open(path, "rb") as f:
                    f.seek(min(offset, size))
                    while chunk := f.read(CHUNK_BYTES):
                        try:
                            await stream.write(chunk)
                        except Exception as e:  # py-libp2p's stream errors: the puller went away (it resumes)
                            raise StreamClosed(f"{type(e).__name__}: {e}") from e
                        self.sent_bytes += len(chunk)
                await close_quietly(stream)
                self.served += 1
        except ProtocolError as e:
            if self.penalties is not None:
                self.penalties.penalize(peer, f"bad blob request: {e}")
            await stream.reset()
        except (StreamClosed, trio.TooSlowError, OSError) as e:
            log.info("blob transfer to %s ended early: %s", peer[-8:], e)
            await stream.reset()


async def pull_blob(sh: SwarmHost, store: BlobStore, digest: str, size: int | None, peers: list[str], *,
                    penalties: Penalties | None = None, attempt_s: float = 600.0,
                    max_bytes: int = 1 << 46, progress: Callable[[int, int], None] | None = None) -> Path:
    """The file with this hash and size (None: any size up to `max_bytes`), from the store or else from the first of
    `peers` that has it; raises BlobError when none does."""
    have = store.path(digest)
    if have is not None:
        return have
    part = store.partial(digest)
    reasons = []
    for peer in peers:
        try:
            with trio.fail_after(attempt_s):
                got = await _pull_from(sh, store, digest, size, peer, part, max_bytes, progress)
        except (trio.TooSlowError, StreamClosed, ProtocolError, OSError) as e:
            reasons.append(f"{peer[-8:]}: {type(e).__name__}: {e}")
            continue
        except BlobError as e:
            reasons.append(f"{peer[-8:]}: {e}")
            part.unlink(missing_ok=True)
            if e.blame and penalties is not None:
                penalties.penalize(peer, f"blob {digest[:12]}…: {e}")
            continue
        if got is not None:
            return got
        reasons.append(f"{peer[-8:]}: does not hold it")
    raise BlobError(f"no peer gave file {digest[:16]}… ({'; '.join(reasons) or 'no peers to ask'})")


async def _pull_from(sh, store: BlobStore, digest: str, size: int | None, peer: str, part: Path, max_bytes: int,
                     progress) -> Path | None:
    offset = part.stat().st_size if part.exists() else 0
    stream = await sh.open_stream(peer, BLOB_PROTOCOL, bulk=True)
    try:
        await write_frame(stream, pack({"hash": digest, "offset": offset}))
        head = unpack(await read_frame(stream, 1024), max_bytes=1024)
        if not isinstance(head, dict) or not isinstance(head.get("ok"), bool):
            raise ProtocolError("bad blob header")
        if not head["ok"]:
            return None
        total = head.get("size")
        if not isinstance(total, int) or isinstance(total, bool) or total < 0 or total > max_bytes \
                or (size is not None and total != size):
            raise BlobError(f"peer announces size {total!r}, the run names {size}", blame=True)
        if offset > total:
            part.unlink(missing_ok=True)
            offset = 0
        h = await trio.to_thread.run_sync(sha256_path, part, offset) if offset else hashlib.sha256()
        with open(part, "ab" if offset else "wb") as f:
            f.truncate(offset)
            n = offset
            while n < total:
                try:
                    chunk = await stream.read(min(CHUNK_BYTES, total - n))
                except Exception as e:  # py-libp2p raises on EOF and reset
                    raise StreamClosed(f"after {n} of {total} bytes: {type(e).__name__}") from e
                if not chunk:
                    raise StreamClosed(f"after {n} of {total} bytes")
                f.write(chunk)
                h.update(chunk)
                n += len(chunk)
                if progress is not None:
                    progress(n, total)
    finally:
        await close_quietly(stream)
    if h.hexdigest() != digest:
        raise BlobError(f"bytes fail the hash ({h.hexdigest()[:12]}… != {digest[:12]}…)", blame=offset == 0)
    return store.commit(digest, part)
