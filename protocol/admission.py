"""A private run's admission proof: knowledge of the join secret shown by an HMAC of the broker's challenge, bound
to the run, the broker's and the joiner's peer ids, so the secret never travels and a proof cannot be replayed."""

from __future__ import annotations

import hashlib
import hmac
import math
import re
import secrets
import string

SCRYPT_N, SCRYPT_R, SCRYPT_P = 2**14, 8, 1
NONCE_BYTES = 32
PROOF_DOMAIN = b"shoal/admit/v1\0"
DEFAULT_SECRET_BYTES = 32  # `shoal run create` generates secrets this long (256 bits) unless given one


def new_secret() -> str:
    """A fresh join secret with 256 bits of entropy (URL-safe text, easy to paste)."""
    return secrets.token_urlsafe(DEFAULT_SECRET_BYTES)


MIN_SECRET_CHARS = 16  # a chosen secret shorter than this ...
MIN_SECRET_BITS = 80.0  # ... or estimated below this many bits is refused by `run create` unless told to use it


def secret_bits(secret: str) -> float:
    """A rough, generous-to-the-attacker estimate of a chosen secret's entropy: log2 of the alphabet its character
    classes span, times its length with runs of one character collapsed, at most twice its distinct characters
    ("aaaa…" and "abab…" count little). It cannot see dictionary words: it is a floor, not a blessing."""
    classes = (string.ascii_lowercase, string.ascii_uppercase, string.digits, string.punctuation + " ")
    pool = sum(len(c) for c in classes if any(ch in c for ch in secret))
    pool += 100 if any(not any(ch in c for c in classes) for ch in secret) else 0  # other scripts
    if not secret or pool < 2:
        return 0.0
    length = min(len(re.sub(r"(.)\1+", r"\1", secret)), 2 * len(set(secret)))
    return length * math.log2(pool)


def weak_secret(secret: str) -> str | None:
    """Why a chosen join secret is too easy to guess (None: it is not obviously so)."""
    if len(secret) < MIN_SECRET_CHARS:
        return f"it has {len(secret)} characters (fewer than {MIN_SECRET_CHARS})"
    bits = secret_bits(secret)
    if bits < MIN_SECRET_BITS:
        return f"it holds about {bits:.0f} bits of entropy (less than {MIN_SECRET_BITS:.0f})"
    return None


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
