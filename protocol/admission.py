"""A private run's admission proof: knowledge of the join secret shown by an HMAC of the broker's challenge, bound
to the run, the broker's and the joiner's peer ids, so the secret never travels and a proof cannot be replayed."""

from __future__ import annotations

import hashlib
import hmac
import secrets

SCRYPT_N, SCRYPT_R, SCRYPT_P = 2**14, 8, 1
NONCE_BYTES = 32
PROOF_DOMAIN = b"shoal/admit/v1\0"
DEFAULT_SECRET_BYTES = 32  # `shoal run create` generates secrets this long (256 bits) unless given one


def new_secret() -> str:
    """A fresh join secret with 256 bits of entropy (URL-safe text, easy to paste)."""
    return secrets.token_urlsafe(DEFAULT_SECRET_BYTES)


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def admission_key(secret: str, salt: bytes) -> bytes:
    """The key both sides derive from the secret (scrypt: every guess at a captured proof costs as much)."""
    return hashlib.scrypt(secret.encode(), salt=salt, n=SCRYPT_N, r=SCRYPT_R, p=SCRYPT_P, dklen=32)


def admission_proof(key: bytes, *, run_id: str, broker: str, joiner: str, nonce: bytes) -> bytes:
    msg = PROOF_DOMAIN + b"\0".join(x.encode() for x in (run_id, broker, joiner)) + b"\0" + nonce
    return hmac.new(key, msg, hashlib.sha256).digest()


def proof_ok(key: bytes, proof: bytes, *, run_id: str, broker: str, joiner: str, nonce: bytes) -> bool:
    return hmac.compare_digest(admission_proof(key, run_id=run_id, broker=broker, joiner=joiner, nonce=nonce), proof)
