"""The node's identity key file: the raw 32-byte Ed25519 private key seed, mode 0600, created atomically."""

from __future__ import annotations

import os
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat

SEED_BYTES = 32
DEFAULT_IDENTITY_PATH = Path("~/.shoal/identity.key")


class IdentityFileError(ValueError):
    """The identity file exists but does not hold a 32-byte Ed25519 seed."""


def load_or_create_identity(path: str | os.PathLike[str] = DEFAULT_IDENTITY_PATH) -> Ed25519PrivateKey:
    """Load the key at `path`, or create a fresh one there (parent made 0700, file 0600, never half-written)."""
    p = Path(path).expanduser()
    try:
        seed = p.read_bytes()
    except FileNotFoundError:
        return _create(p)
    if len(seed) != SEED_BYTES:
        raise IdentityFileError(f"{p}: expected a raw {SEED_BYTES}-byte Ed25519 seed, found {len(seed)} bytes")
    return Ed25519PrivateKey.from_private_bytes(seed)


def _create(p: Path) -> Ed25519PrivateKey:
    p.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    key = Ed25519PrivateKey.generate()
    seed = key.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())
    tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, seed)
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, p)  # fails if another process created the key meanwhile: then theirs wins
    except FileExistsError:
        os.unlink(tmp)
        return load_or_create_identity(p)
    os.unlink(tmp)
    dfd = os.open(p.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    return key
