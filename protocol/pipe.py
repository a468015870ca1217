"""Verified records passed on a local pipe (observer process -> dashboard process): length-prefixed msgpack. Besides
the gossiped kinds, the pipe carries the run's manifest (the observer fetched it from a peer and checked it against
its run id), so the dashboard can say what the run trains."""

from __future__ import annotations

import struct
from typing import Any, BinaryIO

from shoal.protocol.errors import DecodeError
from shoal.protocol.kinds import RECORD_TYPES
from shoal.protocol.manifest import RunManifest
from shoal.protocol.schema import WireRecord
from shoal.protocol.wire import MAX_RECORD_BYTES, pack, unpack

_LEN = struct.Struct(">I")
PIPE_TYPES: dict[str, type[WireRecord]] = {**RECORD_TYPES, "manifest": RunManifest}
_KINDS = {cls: kind for kind, cls in PIPE_TYPES.items()}


MAX_AGE_S = 86400.0


def encode_record(record: WireRecord, age_s: float = 0.0) -> bytes:
    """A record and how old it was when it reached the observer (a members snapshot's rows are as old as their
    sender says: a peer's last record from before it died is not news of it)."""
    msg: dict[str, Any] = {"kind": _KINDS[type(record)], "record": record.to_wire()}
    if age_s > 0:
        msg["age"] = float(min(age_s, MAX_AGE_S))
    body = pack(msg)
    if len(body) > MAX_RECORD_BYTES:
        raise ValueError(f"a {_KINDS[type(record)]} record of {len(body)} bytes does not fit the pipe")
    return _LEN.pack(len(body)) + body


def read_record(f: BinaryIO, types: dict[str, type[WireRecord]] = PIPE_TYPES) -> tuple[WireRecord, float] | None:
    """The next (record, its age in seconds) from `f`, None at end of stream; DecodeError for a malformed or unknown
    one."""
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
    age = m.get("age", 0.0)
    if isinstance(age, bool) or not isinstance(age, (int, float)) or not 0 <= age <= MAX_AGE_S:
        raise DecodeError("pipe record: bad age")
    return types[m["kind"]].from_wire(m.get("record")), float(age)
