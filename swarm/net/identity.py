"""The node's Ed25519 identity: a raw 32-byte seed in a 0600 key file, created on first run and reused after."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from shoal.protocol.signing import peer_id_from_public_key, public_key_bytes

if TYPE_CHECKING:
    from libp2p.crypto.keys import KeyPair

log = logging.getLogger(__name__)
SEED_BYTES = 32


class IdentityError(ValueError):
    """The identity file exists but cannot be used."""


def load_or_create_identity(path: Path | str | None) -> Ed25519PrivateKey:
    """Read the key at `path`, or create it (atomically, mode 0600) if absent. `None` means an ephemeral key."""
    if path is None:
        return Ed25519PrivateKey.generate()
    path = Path(path).expanduser()
    if path.exists():
        seed = path.read_bytes()
        if len(seed) != SEED_BYTES:
            raise IdentityError(f"{path}: expected a {SEED_BYTES}-byte Ed25519 seed, found {len(seed)} bytes")
        return Ed25519PrivateKey.from_private_bytes(seed)
    key = Ed25519PrivateKey.generate()
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, key.private_bytes_raw())
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)  # fails if another process created it meanwhile: then use theirs
    except FileExistsError:
        os.unlink(tmp)
        return load_or_create_identity(path)
    os.unlink(tmp)
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)  # the new name survives a crash
    finally:
        os.close(dfd)
    log.info("created identity %s at %s", peer_id_of(key), path)
    return key


def peer_id_of(key: Ed25519PrivateKey) -> str:
    return peer_id_from_public_key(public_key_bytes(key))


def libp2p_key_pair(key: Ed25519PrivateKey) -> KeyPair:
    """The same key in py-libp2p's types, so the libp2p peer id equals `peer_id_of(key)`."""
    from libp2p.crypto.ed25519 import Ed25519PrivateKey as Libp2pEd25519PrivateKey  # libp2p takes ~1 s to import:
    from libp2p.crypto.keys import KeyPair  # signing a run (`shoal run create`) does not need it

    private = Libp2pEd25519PrivateKey.from_bytes(key.private_bytes_raw())
    return KeyPair(private, private.get_public_key())
