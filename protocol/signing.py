"""Ed25519 signatures over canonical msgpack, and libp2p peer ids derived from Ed25519 public keys."""

from __future__ import annotations

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from shoal.protocol.errors import SignatureError

_B58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
_B58_INDEX = {c: i for i, c in enumerate(_B58)}
# libp2p's PublicKey protobuf for Ed25519: field 1 (KeyType) = 1, field 2 (Data) = 32 bytes
_PB_PREFIX = b"\x08\x01\x12\x20"
# identity multihash (code 0x00) of the 36-byte protobuf
_MH_PREFIX = b"\x00\x24"
PEER_ID_BYTES = len(_MH_PREFIX) + len(_PB_PREFIX) + 32
SIGNATURE_BYTES = 64
PUBLIC_KEY_BYTES = 32


def b58encode(data: bytes) -> str:
    n = int.from_bytes(data, "big")
    out = []
    while n:
        n, r = divmod(n, 58)
        out.append(_B58[r])
    pad = len(data) - len(data.lstrip(b"\0"))
    return "1" * pad + "".join(reversed(out))


def b58decode(text: str) -> bytes:
    n = 0
    for c in text:
        try:
            n = n * 58 + _B58_INDEX[c]
        except KeyError:
            raise SignatureError(f"not base58: {c!r}") from None
    body = n.to_bytes((n.bit_length() + 7) // 8, "big") if n else b""
    pad = len(text) - len(text.lstrip("1"))
    return b"\0" * pad + body


def peer_id_from_public_key(public_key: bytes) -> str:
    """The libp2p peer id (base58 "12D3KooW...") of a raw 32-byte Ed25519 public key."""
    if len(public_key) != PUBLIC_KEY_BYTES:
        raise SignatureError(f"an Ed25519 public key has 32 bytes, got {len(public_key)}")
    return b58encode(_MH_PREFIX + _PB_PREFIX + public_key)


def public_key_from_peer_id(peer_id: str) -> bytes:
    """The raw Ed25519 public key inlined in a peer id; SignatureError if the id holds no Ed25519 key."""
    if not isinstance(peer_id, str) or len(peer_id) > 64:
        raise SignatureError("peer id is not a short string")
    raw = b58decode(peer_id)
    if len(raw) != PEER_ID_BYTES or not raw.startswith(_MH_PREFIX + _PB_PREFIX):
        raise SignatureError(f"peer id {peer_id[:16]}... does not inline an Ed25519 public key")
    return raw[len(_MH_PREFIX) + len(_PB_PREFIX) :]


def public_key_bytes(private_key: Ed25519PrivateKey) -> bytes:
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    return private_key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


def sign(private_key: Ed25519PrivateKey, payload: bytes) -> bytes:
    return private_key.sign(payload)


def verify(public_key: bytes, payload: bytes, signature: bytes) -> None:
    """Raise SignatureError unless `signature` is `public_key`'s signature of `payload`."""
    if not isinstance(signature, (bytes, bytearray)) or len(signature) != SIGNATURE_BYTES:
        raise SignatureError("signature must be 64 bytes")
    try:
        Ed25519PublicKey.from_public_bytes(bytes(public_key)).verify(bytes(signature), payload)
    except (InvalidSignature, ValueError) as e:
        raise SignatureError("signature does not verify") from e


def verify_peer(peer_id: str, payload: bytes, signature: bytes) -> None:
    """Verify a signature made by the key that `peer_id` names (the signer must be the claimed peer)."""
    verify(public_key_from_peer_id(peer_id), payload, signature)
