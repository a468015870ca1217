"""Length-prefixed messages on a libp2p stream, with a hard size limit checked before any allocation."""

from __future__ import annotations

import struct

from shoal.protocol.errors import DecodeError, TooLargeError

_LEN = struct.Struct(">I")
PREFIX_BYTES = _LEN.size  # the length prefix in front of every frame


class StreamClosed(ConnectionError):
    """The peer closed or reset the stream before a whole message arrived."""


async def read_exactly(stream, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        try:
            chunk = await stream.read(n - len(buf))
        except Exception as e:  # py-libp2p raises on EOF and on reset (several exception types)
            raise StreamClosed(f"stream ended after {len(buf)} of {n} bytes: {type(e).__name__}") from e
        if not chunk:
            raise StreamClosed(f"stream ended after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


async def read_frame(stream, max_bytes: int) -> bytes:
    header = await read_exactly(stream, _LEN.size)
    (n,) = _LEN.unpack(header)
    if n > max_bytes:
        raise TooLargeError(f"frame of {n} bytes exceeds the limit of {max_bytes}")
    if n == 0:
        raise DecodeError("empty frame")
    return await read_exactly(stream, n)


async def write_frame(stream, payload: bytes) -> None:
    await stream.write(_LEN.pack(len(payload)) + payload)


async def close_quietly(stream) -> None:
    """Close a stream whose peer may already be gone (py-libp2p raises on closing a reset stream)."""
    try:
        await stream.close()
    except Exception:  # noqa: BLE001 - nothing to do about a half-gone stream
        pass
