"""Checkpoint files: checksummed, written atomically (temp, fsync, rename, fsync dir), last K kept, newest good one loaded."""

from __future__ import annotations

import hashlib
import io
import logging
import os
import re
import struct
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

MAGIC = b"SHOALCK1"
_HEADER = struct.Struct(">8s32sQ")  # magic, sha256 of the payload, payload length
_NAME = re.compile(r"^ckpt-(\d{10})\.pt$")


class CheckpointError(RuntimeError):
    """A checkpoint file is truncated, corrupt, or not a shoal checkpoint."""


def checkpoint_path(directory: Path, step: int) -> Path:
    return Path(directory) / f"ckpt-{step:010d}.pt"


def list_checkpoints(directory: Path) -> list[tuple[int, Path]]:
    """(step, path) of every checkpoint file in `directory`, oldest first."""
    d = Path(directory)
    if not d.is_dir():
        return []
    found = [(int(m.group(1)), d / name) for name in os.listdir(d) if (m := _NAME.match(name))]
    return sorted(found)


def save_checkpoint(directory: Path, step: int, state: dict[str, Any], *, keep_last: int = 3) -> Path:
    """Write `state` (tensors, numbers, strings, lists and dicts of them) as the checkpoint of `step`."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    torch.save(state, buf)
    payload = buf.getbuffer()
    path = checkpoint_path(d, step)
    write_atomic(path, [_HEADER.pack(MAGIC, hashlib.sha256(payload).digest(), len(payload)), payload])
    for _, old in list_checkpoints(d)[:-keep_last]:
        old.unlink(missing_ok=True)
    log.info("checkpoint step %d written to %s (%.1f MB)", step, path, len(payload) / 1e6)
    return path


def read_checkpoint(path: Path) -> dict[str, Any]:
    """Load one checkpoint, verifying its length and checksum first; CheckpointError if anything is off."""
    try:
        raw = Path(path).read_bytes()
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read: {e}") from e
    if len(raw) < _HEADER.size:
        raise CheckpointError(f"{path}: truncated ({len(raw)} bytes, shorter than the header)")
    magic, digest, length = _HEADER.unpack_from(raw)
    if magic != MAGIC:
        raise CheckpointError(f"{path}: not a shoal checkpoint (bad magic)")
    payload = memoryview(raw)[_HEADER.size :]
    if len(payload) != length:
        raise CheckpointError(f"{path}: truncated ({len(payload)} of {length} payload bytes)")
    if hashlib.sha256(payload).digest() != digest:
        raise CheckpointError(f"{path}: checksum mismatch (file corrupt)")
    return torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)


def load_latest(directory: Path) -> tuple[int, dict[str, Any]] | None:
    """The newest checkpoint that verifies, skipping (and logging) corrupt ones; None if there is none."""
    for step, path in reversed(list_checkpoints(directory)):
        try:
            return step, read_checkpoint(path)
        except CheckpointError as e:
            log.warning("skipping checkpoint: %s; trying the previous one", e)
    return None


def write_atomic(path: Path, parts: Iterable[bytes | bytearray | memoryview]) -> int:
    """Write `parts` to `path` so that it holds either all of them or what it held before: a temporary file beside
    it, fsync, rename over it, fsync the directory. Returns the bytes written."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")  # writers may share a folder
    n = 0
    try:
        with open(tmp, "wb") as f:
            for part in parts:
                n += f.write(part)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    _fsync_dir(path.parent)
    return n


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
