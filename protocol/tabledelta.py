"""A change of a run's table as it travels: what changed since the version a member holds, and the broker's signature
over the new table. The member rebuilds the new table from the one it holds and verifies that signature as if the
whole table had come, so a delta is only a shorter way to send a signed table: it proves nothing by itself, and a
member that cannot apply it (it missed a version, or holds another table) waits for the next full one (its poll
brings it within poll_s). docs/broker.md, "The table's size".

The changes are per field of the table's wire form: a field set anew, a field dropped (left at its default), or a
list spliced (its first `prefix` and last `suffix` items kept, the items between replaced): one provider promoted
from the pool is a few hundred bytes where the whole table at 1,000 providers is ~38 KB."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from dataclasses import dataclass
from typing import Any, ClassVar

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from shoal.protocol import PROTOCOL_VERSION
from shoal.protocol.assignment import RUN_ID, AssignmentTable
from shoal.protocol.envelope import seal
from shoal.protocol.errors import DecodeError, FieldError
from shoal.protocol.records import PEER_ID
from shoal.protocol.schema import Bytes, Int, SignedRecord, WireRecord, spec
from shoal.protocol.wire import pack, unpack

DIGEST_LEN = 16  # how a table is named: the first 16 bytes of its envelope's SHA-256
MAX_CHANGES_BYTES = 32 * 1024
SIG_LEN = 64
SET, DROP, SPLICE = "=", "-", "~"
_FIELDS = tuple(f.name for f in dataclasses.fields(AssignmentTable))  # the wire form's order (schema.to_wire)
_FIELD_SET = frozenset(_FIELDS)


@functools.lru_cache(maxsize=8)
def table_digest(env: bytes) -> bytes:
    """How a table is named in a poll (run.table's `have`) and in a delta: its envelope's SHA-256, first 16 bytes."""
    return hashlib.sha256(env).digest()[:DIGEST_LEN]


@dataclass(frozen=True, kw_only=True, slots=True)
class TableDelta(SignedRecord):
    """Table `version` as the changes from `base_version` (whose envelope's digest is `base_digest`), with the
    signature of the new table's envelope; signed by the broker (`peer_id`), who signed both tables."""

    KIND: ClassVar[str] = "table_delta"
    peer_id: str = spec(PEER_ID)  # the broker
    run_id: str = spec(RUN_ID)
    lease_epoch: int = spec(Int(0, 2**62))
    base_version: int = spec(Int(0, 2**62))
    version: int = spec(Int(1, 2**62))
    base_digest: bytes = spec(Bytes(DIGEST_LEN, exact=DIGEST_LEN))
    changes: bytes = spec(Bytes(MAX_CHANGES_BYTES))  # pack({field: [SET, value] | [DROP] | [SPLICE, p, s, items]})
    sig: bytes = spec(Bytes(SIG_LEN, exact=SIG_LEN))

    def __post_init__(self) -> None:
        WireRecord.__post_init__(self)
        if self.version <= self.base_version:
            raise FieldError("version", "not after base_version")


def _envelope(env: bytes) -> dict:
    e = unpack(env)
    if not isinstance(e, dict) or e.get("kind") != AssignmentTable.KIND or not isinstance(e.get("body"), bytes):
        raise DecodeError("not a table envelope")
    return e


def diff(base: dict, new: dict) -> dict:
    """The changes that turn the wire form `base` into `new`."""
    out: dict[str, list] = {}
    for k in base:
        if k not in new:
            out[k] = [DROP]
    for k, v in new.items():
        old = base.get(k)
        if k in base and old == v:
            continue
        if isinstance(old, list) and isinstance(v, list):
            p = 0
            while p < min(len(old), len(v)) and old[p] == v[p]:
                p += 1
            s = 0
            while s < min(len(old), len(v)) - p and old[-1 - s] == v[-1 - s]:
                s += 1
            out[k] = [SPLICE, p, s, v[p:len(v) - s]]
        else:
            out[k] = [SET, v]
    return out


def apply(base: dict, changes: Any) -> dict:
    """`base` with `changes` applied (as `diff` makes them); DecodeError on anything else."""
    if not isinstance(changes, dict):
        raise DecodeError("table delta: changes must be a map")
    out = dict(base)
    for k, op in changes.items():
        if not isinstance(k, str) or not isinstance(op, list) or not op:
            raise DecodeError("table delta: a change is [op, ...] under a field name")
        if op[0] == SET and len(op) == 2:
            out[k] = op[1]
        elif op[0] == DROP and len(op) == 1:
            out.pop(k, None)
        elif op[0] == SPLICE and len(op) == 4:
            old, p, s, items = out.get(k), op[1], op[2], op[3]
            if not isinstance(old, list) or not isinstance(items, list) or not all(
                    isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in (p, s)) or p + s > len(old):
                raise DecodeError(f"table delta: a splice of {k!r} that does not fit the table held")
            out[k] = old[:p] + items + old[len(old) - s:]
        else:
            raise DecodeError(f"table delta: unknown change of {k!r}")
    return out


def make_delta(base_env: bytes, new_env: bytes, key: Ed25519PrivateKey) -> bytes | None:
    """The sealed delta from the table `base_env` to `new_env` (both sealed by `key`'s broker, same lease epoch),
    or None when it would not be much shorter than the new table itself."""
    b, n = _envelope(base_env), _envelope(new_env)
    base, new = unpack(b["body"]), unpack(n["body"])
    changes = pack(diff(base, new))
    if len(changes) > min(MAX_CHANGES_BYTES, len(new_env) // 2):
        return None
    d = TableDelta(peer_id=new["peer_id"], run_id=new["run_id"], lease_epoch=new["lease_epoch"],
                   base_version=base["version"], version=new["version"], base_digest=table_digest(base_env),
                   changes=changes, sig=n["sig"])
    return seal(d, key)


def rebuild(base_env: bytes, delta: TableDelta) -> bytes:
    """The new table's envelope from the one held (`base_env`, which `delta.base_digest` must name): its fields in the
    table's order, its signature the broker's, checked (with every field) by whoever opens it, as for a table that
    came whole. DecodeError when the delta does not fit."""
    if table_digest(base_env) != delta.base_digest:
        raise DecodeError("table delta: made from another table than the one held")
    new = apply(unpack(_envelope(base_env)["body"]), unpack(delta.changes, max_bytes=MAX_CHANGES_BYTES))
    if not set(new) <= _FIELD_SET:
        raise DecodeError("table delta: a field the table does not have")
    if (new.get("peer_id"), new.get("run_id"), new.get("lease_epoch"), new.get("version")) != (
            delta.peer_id, delta.run_id, delta.lease_epoch, delta.version):
        raise DecodeError("table delta: the rebuilt table is not the one the delta names")
    body = pack({k: new[k] for k in _FIELDS if k in new})
    return pack({"v": PROTOCOL_VERSION, "kind": AssignmentTable.KIND, "body": body, "sig": delta.sig})
