"""Files a run names by hash, between real hosts on 127.0.0.1: pulled and checked, only what the run names, never
a wrong file kept (its sender penalized), a broken pull resumed from the bytes it had."""

from __future__ import annotations

import hashlib
import os

import pytest
import trio

from shoal.protocol.wire import pack, unpack
from shoal.swarm.net.framing import read_frame, write_frame
from shoal.swarm.net.penalty import Penalties
from shoal.swarm.state.blobs import BLOB_PROTOCOL, BlobError, BlobServer, BlobStore, pull_blob
from tests.helpers.swarm import bare_host


def blob_file(tmp_path, n: int = 3 << 20) -> tuple[str, bytes]:
    data = os.urandom(n)
    src = tmp_path / "weights.safetensors"
    src.write_bytes(data)
    return str(src), data


async def test_a_named_file_is_pulled_and_checked(tmp_path):
    src, data = blob_file(tmp_path)
    owner = BlobStore(tmp_path / "owner")
    digest, size = owner.add_file(src)
    assert digest == hashlib.sha256(data).hexdigest() and size == len(data)
    other = BlobStore(tmp_path / "owner2")
    secret, _ = other.add_file(tmp_path / "weights.safetensors")  # same bytes, but not named by the run below
    async with bare_host() as server:
        BlobServer(server, owner, named=lambda: [digest])
        async with bare_host(server.addrs) as client:
            mine = BlobStore(tmp_path / "joiner")
            path = await pull_blob(client, mine, digest, size, [server.peer_id])
            assert path.read_bytes() == data and mine.path(digest) == path
            # a hash the run does not name is not served, whatever the server holds
            with pytest.raises(BlobError, match="does not hold it"):
                await pull_blob(client, BlobStore(tmp_path / "j2"), "ab" * 32, None, [server.peer_id])
            # a size other than the manifest's is refused before any byte is kept
            with pytest.raises(BlobError, match="announces size"):
                await pull_blob(client, BlobStore(tmp_path / "j3"), digest, size + 1, [server.peer_id])
            assert not list((tmp_path / "j3").glob("*"))


async def test_wrong_bytes_are_never_kept_and_their_sender_is_penalized(tmp_path):
    src, data = blob_file(tmp_path, 1 << 20)
    digest = hashlib.sha256(data).hexdigest()
    good = BlobStore(tmp_path / "good")
    good.add_file(src)

    async def liar(stream):  # announces the right size, sends other bytes
        unpack(await read_frame(stream, 1024), max_bytes=1024)
        await write_frame(stream, pack({"ok": True, "size": len(data)}))
        await stream.write(os.urandom(len(data)))
        await stream.close()

    async with bare_host() as bad, bare_host() as honest:
        bad.set_handler(BLOB_PROTOCOL, liar)
        BlobServer(honest, good, named=lambda: [digest])
        async with bare_host(bad.addrs + honest.addrs) as client:
            penalties = Penalties()
            mine = BlobStore(tmp_path / "mine")
            path = await pull_blob(client, mine, digest, len(data), [bad.peer_id, honest.peer_id],
                                   penalties=penalties)
            assert path.read_bytes() == data
            assert penalties.strikes(bad.peer_id) > 0 and penalties.strikes(honest.peer_id) == 0


async def test_a_broken_pull_resumes_where_it_stopped(tmp_path):
    src, data = blob_file(tmp_path, 3 << 20)
    store = BlobStore(tmp_path / "srv")
    digest, size = store.add_file(src)
    sent = []

    async with bare_host() as server:
        BlobServer(server, store, named=lambda: [digest])
        async with bare_host(server.addrs) as client:
            mine = BlobStore(tmp_path / "mine")
            with trio.fail_after(30), trio.CancelScope() as scope:  # stopped once its first MiB has landed
                def progress(n, total):
                    sent.append(n)
                    if n >= 1 << 20:
                        scope.cancel()
                await pull_blob(client, mine, digest, size, [server.peer_id], progress=progress)
            assert scope.cancelled_caught
            part = mine.partial(digest)
            assert part.exists() and part.stat().st_size >= 1 << 20 and mine.path(digest) is None
            resumed_from = part.stat().st_size
            seen = []
            path = await pull_blob(client, mine, digest, size, [server.peer_id], progress=lambda n, t: seen.append(n))
            assert path.read_bytes() == data and min(seen) > resumed_from
