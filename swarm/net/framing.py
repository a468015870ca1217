"""Length-prefixed messages on a libp2p stream, with a hard size limit checked before any allocation; and the one
error a failed request/response exchange becomes."""

from __future__ import annotations

import contextlib
import struct
from collections.abc import Iterator

import trio

from shoal.protocol.errors import DecodeError, ProtocolError, TooLargeError

_LEN = struct.Struct(">I")
PREFIX_BYTES = _LEN.size  # the length prefix in front of every frame


class StreamClosed(ConnectionError):
    """The peer closed or reset the stream before a whole message arrived."""


@contextlib.contextmanager
def exchange_failures(error: type[Exception], what: str, timeout_s: float) -> Iterator[None]:
    """An exchange with a peer under a deadline of `timeout_s`, whose every failure is raised as one `error` naming
    `what` (the peer and what was asked): the deadline passing, a malformed or cut-off answer, or whatever the
    transport raises (py-libp2p's dial failures come as many types). An `error` raised inside passes as it is."""
    try:
        with trio.fail_after(timeout_s):
            yield
    except trio.TooSlowError:
        raise error(f"{what}: no answer within {timeout_s} s") from None
    except (ProtocolError, StreamClosed) as e:
        raise error(f"{what}: bad answer: {e}") from e
    except error:
        raise
    except Exception as e:  # noqa: BLE001 - anything else the transport raised
        raise error(f"{what}: {type(e).__name__}: {e}") from e


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


async def read_length(stream, max_bytes: int, reader: BufferedReader | None = None) -> int:
    """A frame's length prefix, checked against the limit (the body is still to read)."""
    raw = await reader.read(_LEN.size) if reader is not None else await read_exactly(stream, _LEN.size)
    (n,) = _LEN.unpack(raw)
    if n > max_bytes:
        raise TooLargeError(f"frame of {n} bytes exceeds the limit of {max_bytes}")
    if n == 0:
        raise DecodeError("empty frame")
    return n


async def read_frame(stream, max_bytes: int) -> bytes:
    return await read_exactly(stream, await read_length(stream, max_bytes))


class BufferedReader:
    """Reads a stream in large chunks and hands out exact byte counts: one read per message that arrived whole,
    rather than one per field (py-libp2p's yamux answers every read with a window update: a packet each)."""

    def __init__(self, stream, chunk_bytes: int = 1 << 16):
        self.stream = stream
        self.chunk_bytes = chunk_bytes
        self.buf = bytearray()

    async def read(self, n: int) -> bytes:
        while len(self.buf) < n:
            try:
                chunk = await self.stream.read(max(n - len(self.buf), self.chunk_bytes))
            except Exception as e:  # py-libp2p raises on EOF and on reset (several exception types)
                raise StreamClosed(f"stream ended after {len(self.buf)} of {n} bytes: {type(e).__name__}") from e
            if not chunk:
                raise StreamClosed(f"stream ended after {len(self.buf)} of {n} bytes")
            self.buf += chunk
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out


def frame(payload: bytes) -> bytes:
    """The bytes of one length-prefixed frame (to write several in one write)."""
    return _LEN.pack(len(payload)) + payload


async def write_frame(stream, payload: bytes) -> None:
    await stream.write(frame(payload))


async def close_quietly(stream) -> None:
    """Close a stream whose peer may already be gone (py-libp2p raises on closing a reset stream)."""
    try:
        await stream.close()
    except Exception:  # noqa: BLE001 - nothing to do about a half-gone stream
        pass
