"""Erasure coding and state blobs by property: any k of k+m shards give the bytes back (RS, XOR, copies), fewer or
damaged ones are refused, and a snapshot survives the blob form bit for bit with its hash checked."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from shoal.swarm.state import erasure
from shoal.swarm.state.blob import blob_size, read_snapshot, snapshot_bytes, snapshot_parts
from shoal.swarm.state.snapshot import Snapshot, StateTransferError


@given(data=st.binary(min_size=0, max_size=3000), k=st.integers(1, 6), m=st.integers(0, 3), seed=st.integers(0, 99))
def test_any_k_shards_give_the_bytes_back(data, k, m, seed):
    shards = erasure.encode(data, k, m)
    assert len(shards) == k + m and len({len(s) for s in shards}) == 1
    assert len(shards[0]) == erasure.shard_size(len(data), k) and len(shards[0]) % 8 == 0
    keep = random.Random(seed).sample(range(k + m), k)
    assert erasure.decode({i: shards[i] for i in keep}, k, m, len(data)) == data


def test_every_subset_of_k_decodes_and_fewer_is_refused():
    data = bytes(random.Random(1).getrandbits(8) for _ in range(1001))
    for k, m in [(3, 2), (4, 1), (1, 2), (2, 2)]:
        shards = erasure.encode(data, k, m)
        for keep in itertools.combinations(range(k + m), k):
            assert erasure.decode({i: shards[i] for i in keep}, k, m, len(data)) == data
        with pytest.raises(erasure.ErasureError):
            erasure.decode({i: shards[i] for i in range(k - 1)}, k, m, len(data))
        with pytest.raises(erasure.ErasureError):  # a shard of the wrong size
            erasure.decode({0: shards[0][:-8], **{i: shards[i] for i in range(1, k)}}, k, m, len(data))
        with pytest.raises(erasure.ErasureError):  # an index outside the code
            erasure.decode({k + m: shards[0], **{i: shards[i] for i in range(1, k)}}, k, m, len(data))


def _snapshot() -> Snapshot:
    g = torch.Generator().manual_seed(0)
    state = {"model": {"w": torch.randn(5, 7, generator=g), "b": torch.zeros(0)}, "step": 12,
             "rng": {"python": (3, tuple(range(5)), None)}, "h": torch.randn(3, generator=g).half()}
    return Snapshot.of(state, 12)


def test_a_snapshot_survives_its_blob_and_erasure_coding():
    snap = _snapshot()
    blob = snapshot_bytes(snap)
    shards = erasure.encode(blob, 3, 2)
    back = read_snapshot(erasure.decode({1: shards[1], 3: shards[3], 4: shards[4]}, 3, 2, len(blob)),
                         expect_hash=snap.hash)
    assert back.hash == snap.hash and back.revision == 12
    assert all(torch.equal(back.tensors[k], v) for k, v in snap.tensors.items())
    assert back.state()["rng"]["python"] == (3, tuple(range(5)), None)


@given(data=st.binary(min_size=0, max_size=3000), cuts=st.lists(st.integers(0, 3000), max_size=6),
       k=st.integers(1, 6), m=st.integers(0, 3))
def test_encoding_parts_is_encoding_their_concatenation(data, cuts, k, m):
    """The encoder copies a state's parts into the padded string a slice at a time (the node encodes a snapshot's
    parts, never their join): the shards are those of the joined bytes, whatever the parts and slice size."""
    bounds = [0, *sorted(c % (len(data) + 1) for c in cuts), len(data)]
    parts = [data[a:b] for a, b in zip(bounds, bounds[1:])]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(erasure, "COPY_SLICE", 7)
        shards = erasure.encode_parts(parts, len(data), k, m)
        assert [bytes(x) for x in shards] == [bytes(x) for x in erasure.encode(data, k, m)]
        assert erasure.decode({i: shards[i] for i in range(m, k + m)}, k, m, len(data)) == data
        with pytest.raises(ValueError):
            erasure.encode_parts(parts, len(data) + 1, k, m)
        if data:
            with pytest.raises(ValueError):
                erasure.encode_parts(parts, len(data) - 1, k, m)


def test_a_snapshots_parts_encode_like_its_blob():
    snap = _snapshot()
    blob = snapshot_bytes(snap)
    assert blob_size(snap) == len(blob)
    assert [bytes(x) for x in erasure.encode_parts(snapshot_parts(snap), blob_size(snap), 3, 2)] == \
        [bytes(x) for x in erasure.encode(blob, 3, 2)]


def test_a_damaged_or_unexpected_blob_is_refused():
    snap = _snapshot()
    blob = bytearray(snapshot_bytes(snap))
    with pytest.raises(StateTransferError, match="expected"):
        read_snapshot(blob, expect_hash="0" * 64)
    blob[-3] ^= 1
    with pytest.raises(StateTransferError, match="fails its hash"):
        read_snapshot(blob)
    with pytest.raises(StateTransferError):
        read_snapshot(blob[:-1])
    with pytest.raises(StateTransferError, match="magic"):
        read_snapshot(b"NOTSHOAL" + bytes(blob[8:]))
