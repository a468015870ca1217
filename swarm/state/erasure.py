"""k data shards plus m parity shards of a byte string, and the string back from any k of them: Reed-Solomon over
GF(2^8) (zfec, from Tahoe-LAFS) for m >= 2, a plain XOR parity for m = 1, copies for k = 1 (docs/snapshots.md).

The string is zero-padded to a multiple of k (and of 8 bytes, for the XOR's wide words); the caller keeps its true
length. zfec releases the GIL while it codes, so a worker thread encodes without holding the event loop up.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import zfec

MAX_SHARDS = 256  # zfec's limit on k + m (GF(2^8))
#: bytes copied per slice while building the padded string in a worker thread: an event loop beside it never waits
#: on one copy of the whole state (a bytes join holds the GIL ~0.5 ms per MB on a small machine)
COPY_SLICE = 1 << 20


class ErasureError(ValueError):
    """Shards that cannot give the data back: too few, of unequal sizes, or indices outside the code."""


def shard_size(length: int, k: int) -> int:
    """The size of each shard of a `length`-byte string cut into `k`: a multiple of 8 bytes."""
    per = -(-max(length, 1) // k)
    return -(-per // 8) * 8


def _check(k: int, m: int) -> None:
    if k < 1 or m < 0 or k + m > MAX_SHARDS:
        raise ErasureError(f"need 1 <= k and 0 <= m with k + m <= {MAX_SHARDS}, got k={k}, m={m}")


def _xor(blocks: Sequence[bytes | bytearray | memoryview]) -> bytes:
    acc = np.frombuffer(blocks[0], dtype=np.uint64).copy()
    for b in blocks[1:]:
        np.bitwise_xor(acc, np.frombuffer(b, dtype=np.uint64), out=acc)
    return acc.tobytes()


def encode(data: bytes | bytearray | memoryview, k: int, m: int) -> list[bytes | memoryview]:
    """The k data shards (views of the padded string) and m parity shards, in index order 0..k+m-1."""
    _check(k, m)
    size = shard_size(len(data), k)
    if len(data) == size * k:
        return _encode_padded(memoryview(data), size, k, m)
    return encode_parts([data], len(data), k, m)


def encode_parts(parts: Iterable[bytes | bytearray | memoryview], length: int, k: int, m: int) \
        -> list[bytes | memoryview]:
    """`encode` of the concatenation of `parts` (`length` bytes in all), copied once into the padded string, a
    slice of at most COPY_SLICE bytes at a time by numpy, which releases the GIL (a worker thread encoding a big
    state then never holds it for long: zfec and hashlib release it too; a bytes join, a bytes + bytes and
    bytearray(n), which zero-fills, do not)."""
    _check(k, m)
    size = shard_size(length, k)
    buf = np.empty(size * k, dtype=np.uint8)  # not zeroed: every byte is written below
    at = 0
    for part in parts:
        src = np.frombuffer(part, dtype=np.uint8)
        if at + len(src) > length:
            raise ValueError(f"the parts hold more than the {length} bytes said")
        for i in range(0, len(src), COPY_SLICE):  # numpy copies without the GIL; slices bound any wait anyway
            piece = src[i:i + COPY_SLICE]
            buf[at:at + len(piece)] = piece
            at += len(piece)
    if at != length:
        raise ValueError(f"the parts hold {at} bytes, {length} said")
    buf[length:] = 0
    return _encode_padded(buf.data.toreadonly(), size, k, m)


def _encode_padded(padded: memoryview, size: int, k: int, m: int) -> list[bytes | memoryview]:
    blocks: list[bytes | memoryview] = [padded[i * size:(i + 1) * size] for i in range(k)]
    if m == 0:
        return list(blocks)
    if k == 1:
        return list(blocks) + [bytes(blocks[0]) for _ in range(m)]
    if m == 1:
        return list(blocks) + [_xor(blocks)]
    parity = zfec.Encoder(k, k + m).encode(tuple(blocks), tuple(range(k, k + m)))
    return list(blocks) + [bytes(p) for p in parity]


def decode(shards: Mapping[int, bytes | bytearray | memoryview], k: int, m: int, length: int) -> bytes:
    """The `length`-byte string from any k of its shards (index -> bytes); ErasureError when that cannot be."""
    _check(k, m)
    have = {i: s for i, s in shards.items() if 0 <= i < k + m}
    if len(have) < k or len(have) != len(shards):
        raise ErasureError(f"{len(have)} usable shards of {len(shards)} given, {k} needed (indices 0..{k + m - 1})")
    size = shard_size(length, k)
    if any(len(s) != size for s in have.values()):
        raise ErasureError(f"every shard of a {length}-byte string in {k} holds {size} bytes")
    if all(i in have for i in range(k)):
        out = b"".join(bytes(have[i]) for i in range(k))
    elif k == 1:
        out = bytes(next(iter(have.values())))
    elif m == 1:
        missing = next(i for i in range(k) if i not in have)
        rebuilt = _xor([have[i] for i in range(k + 1) if i != missing])
        out = b"".join(bytes(have[i]) if i != missing else rebuilt for i in range(k))
    else:
        use = sorted(have)[:k]
        out = b"".join(zfec.Decoder(k, k + m).decode(tuple(have[i] for i in use), tuple(use)))
    return out[:length]
