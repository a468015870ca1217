"""Signed envelopes: a record's canonical bytes plus the Ed25519 signature of the peer it names."""

from __future__ import annotations

from dataclasses import dataclass

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from shoal.protocol import PROTOCOL_VERSION
from shoal.protocol.errors import DecodeError, SignatureError, VersionError
from shoal.protocol.schema import SignedRecord
from shoal.protocol.signing import SIGNATURE_BYTES, peer_id_from_public_key, public_key_bytes, sign, verify_peer
from shoal.protocol.wire import MAX_RECORD_BYTES, pack, unpack

_DOMAIN = b"shoal/record/v1\0"


def signing_payload(kind: str, body: bytes) -> bytes:
    return _DOMAIN + kind.encode() + b"\0" + body


@dataclass(frozen=True, slots=True)
class Signed:
    """A verified record together with the exact bytes that were signed (so it can be relayed unchanged)."""

    record: SignedRecord
    raw: bytes


def seal(record: SignedRecord, key: Ed25519PrivateKey) -> bytes:
    """Encode and sign `record`; its `peer_id` must be the signing key's peer id."""
    signer = peer_id_from_public_key(public_key_bytes(key))
    if record.peer_id != signer:
        raise SignatureError(f"record names peer {record.peer_id}, but the key is {signer}")
    body = pack(record.to_wire())
    kind = type(record).KIND
    return pack({"v": PROTOCOL_VERSION, "kind": kind, "body": body, "sig": sign(key, signing_payload(kind, body))})


def open_envelope(data: bytes, types: dict[str, type[SignedRecord]], *, max_bytes: int = MAX_RECORD_BYTES) -> Signed:
    """Decode and verify an envelope from the network. Raises a ProtocolError subclass on any problem."""
    env = unpack(data, max_bytes=max_bytes)
    if not isinstance(env, dict):
        raise DecodeError("envelope: expected a map")
    v = env.get("v")
    if not isinstance(v, int) or isinstance(v, bool):
        raise DecodeError("envelope: missing version")
    if v != PROTOCOL_VERSION:
        raise VersionError(f"envelope version {v}, this build reads {PROTOCOL_VERSION}")
    kind, body, sig = env.get("kind"), env.get("body"), env.get("sig")
    if not isinstance(kind, str) or kind not in types:
        raise DecodeError(f"envelope: unknown record kind {kind!r}")
    if not isinstance(body, bytes) or not isinstance(sig, bytes) or len(sig) != SIGNATURE_BYTES:
        raise DecodeError("envelope: body and a 64-byte signature are required")
    record = types[kind].from_wire(unpack(body, max_bytes=max_bytes))
    verify_peer(record.peer_id, signing_payload(kind, body), sig)
    return Signed(record, bytes(data))
