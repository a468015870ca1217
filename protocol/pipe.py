"""Verified records passed on a local pipe (observer process -> dashboard process): length-prefixed msgpack."""

from __future__ import annotations

import struct
from typing import BinaryIO

from shoal.protocol.errors import DecodeError
from shoal.protocol.kinds import RECORD_TYPES
from shoal.protocol.schema import SignedRecord
from shoal.protocol.wire import MAX_RECORD_BYTES, pack, unpack

_LEN = struct.Struct(">I")


def encode_record(record: SignedRecord) -> bytes:
    body = pack({"kind": type(record).KIND, "record": record.to_wire()})
    return _LEN.pack(len(body)) + body


def read_record(f: BinaryIO, types: dict[str, type[SignedRecord]] = RECORD_TYPES) -> SignedRecord | None:
    """The next record from `f`, None at end of stream; DecodeError for a malformed or unknown one."""
    header = f.read(_LEN.size)
    if len(header) < _LEN.size:
        return None
    (n,) = _LEN.unpack(header)
    if n > MAX_RECORD_BYTES:
        raise DecodeError(f"record of {n} bytes on the pipe exceeds {MAX_RECORD_BYTES}")
    body = f.read(n)
    if len(body) < n:
        return None
    m = unpack(body)
    if not isinstance(m, dict) or m.get("kind") not in types:
        raise DecodeError("pipe record: unknown kind")
    return types[m["kind"]].from_wire(m.get("record"))
