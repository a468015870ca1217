"""One running node per identity file on this machine: an exclusive lock beside the key file, held while the node
runs; when the default identity is taken, the next free default (identity-2.key, identity-3.key, …)."""

from __future__ import annotations

import errno
import hashlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)
MAX_DEFAULT_IDENTITIES = 64


class IdentityInUse(RuntimeError):
    """Another running node holds this identity."""


@dataclass(slots=True)
class IdentityLock:
    key_path: Path
    lock_path: Path
    fd: int

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # closing drops the lock
            self.fd = -1


def lock_path_of(key_path: Path) -> Path:
    return key_path.with_name(f"{key_path.name}.lock")


def _open_lock(key_path: Path, fallback_dir: Path | None) -> tuple[Path, int]:
    """The lock file beside the key, or when that folder is read-only (a key mounted read-only), one named after
    the key's absolute path in `fallback_dir`."""
    lock = lock_path_of(key_path)
    try:
        key_path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        return lock, os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as e:
        if fallback_dir is None or e.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
            raise
    digest = hashlib.sha256(str(key_path.resolve()).encode()).hexdigest()[:16]
    lock = Path(fallback_dir).expanduser() / "locks" / f"{key_path.name}-{digest}.lock"
    lock.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    return lock, os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)


def lock_identity(key_path: Path, fallback_dir: Path | None = None) -> IdentityLock:
    """Take the lock of `key_path` (the key itself need not exist yet); IdentityInUse if a live process holds it.
    The lock is the kernel's (flock), so it goes with the process that held it, however that process ended.
    `fallback_dir` (the shoal home) holds the lock when the key's folder is read-only."""
    import fcntl

    key_path = Path(key_path).expanduser()
    lock, fd = _open_lock(key_path, fallback_dir)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
        os.close(fd)
        if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise
        raise IdentityInUse(f"the identity {key_path} is in use by another shoal node on this machine"
                            + (f" (pid {holder})" if holder.isdigit() else "")) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return IdentityLock(key_path, lock, fd)


def default_identity(home: Path) -> IdentityLock:
    """The default identity in `home`, locked: identity.key, or when a running node holds it, the first free one of
    identity-2.key, identity-3.key, … (each created on first use, so a second node here gets its own peer id)."""
    for i in range(1, MAX_DEFAULT_IDENTITIES + 1):
        path = home / ("identity.key" if i == 1 else f"identity-{i}.key")
        try:
            lock = lock_identity(path)
        except IdentityInUse:
            continue
        if i > 1:
            log.info("the default identity is in use by another node here; using %s", path)
        return lock
    raise IdentityInUse(f"all {MAX_DEFAULT_IDENTITIES} default identities in {home} are in use by running nodes")
