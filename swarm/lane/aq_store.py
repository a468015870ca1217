"""One end's AQ-SGD store of one link: m(sample) rows in fp16, each with its version, and the store's digest.

docs/pipeline.md, "AQ-SGD over a link": a row's version is the step of its last write plus one (0 means "no row",
which is how a first visit is marked on the wire), and the digest is the XOR of blake2b(sample, version, row bytes) over
every row, updated on every write, so the two ends of a link can compare their stores with 32 bytes. The store holds
samples whose id is below its capacity (slots indexed by sample id: both ends decide alike with no coordination,
and nothing is ever evicted); samples beyond it always travel as first visits. Rows live in memory or in one disk
file mapped into memory.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import struct
from dataclasses import dataclass

import torch

DIGEST_BYTES = 32
_KEY = struct.Struct(">QQ")


@dataclass(frozen=True, kw_only=True, slots=True)
class StoreConfig:
    """Where one link end keeps its rows and how many it may keep."""

    row_shape: tuple[int, int]  # (seq_len, d_model)
    cap_mb: int = 4096  # at most this many MiB of rows per link end
    train_samples: int = 1 << 40  # ids below this exist (no slot is needed beyond)
    disk_path: str | None = None  # None: rows in memory; else this file holds them

    def __post_init__(self) -> None:
        if len(self.row_shape) != 2 or min(self.row_shape) < 1 or self.cap_mb < 1 or self.train_samples < 1:
            raise ValueError("row_shape (seq, hidden) positive, cap_mb >= 1, train_samples >= 1")

    @property
    def row_nbytes(self) -> int:
        return 2 * self.row_shape[0] * self.row_shape[1]

    @property
    def capacity(self) -> int:
        """Rows the store may hold: samples with ids below this are kept."""
        return min(self.cap_mb * (1 << 20) // self.row_nbytes, self.train_samples)


def row_hash(sid: int, version: int, row: torch.Tensor) -> int:
    h = hashlib.blake2b(_KEY.pack(sid, version), digest_size=DIGEST_BYTES)
    h.update(memoryview(row.contiguous().view(-1).view(torch.uint8).numpy()))
    return int.from_bytes(h.digest(), "big")


class LinkStore:
    """m(sample) and v(sample) of one end of one link (used from one task or thread at a time)."""

    def __init__(self, config: StoreConfig):
        self.config = config
        self.capacity = config.capacity
        self._versions: dict[int, int] = {}
        self._hashes: dict[int, int] = {}
        self._digest = 0
        self._mem: dict[int, torch.Tensor] | None = None
        self._disk: torch.Tensor | None = None
        if config.disk_path is None:
            self._mem = {}
        else:
            numel = self.capacity * config.row_shape[0] * config.row_shape[1]
            path = os.fspath(config.disk_path)
            if os.path.exists(path):
                os.unlink(path)  # a store starts empty: an old file's rows are not this store's
            self._disk = torch.from_file(path, shared=True, size=numel, dtype=torch.float16).view(
                self.capacity, *config.row_shape)

    def holds(self, sid: int) -> bool:
        """Whether this sample may have a row here (its id is below the capacity)."""
        return 0 <= sid < self.capacity

    def version(self, sid: int) -> int:
        """The version of the sample's row, 0 when there is none."""
        return self._versions.get(sid, 0)

    def get(self, sid: int) -> torch.Tensor:
        """The row (fp16, row_shape); the sample must have one."""
        if sid not in self._versions:
            raise KeyError(sid)
        if self._mem is not None:
            return self._mem[sid]
        assert self._disk is not None  # a store keeps its rows in memory or on disk
        return self._disk[sid]

    def put(self, sid: int, version: int, row: torch.Tensor) -> None:
        if not self.holds(sid) or version < 1:
            raise ValueError(f"sample {sid} (capacity {self.capacity}) at version {version}")
        row = row.to(torch.float16)
        if tuple(row.shape) != self.config.row_shape:
            raise ValueError(f"row of shape {tuple(row.shape)}, the store holds {self.config.row_shape}")
        if self._mem is not None:
            self._mem[sid] = row.clone()
        else:
            assert self._disk is not None  # a store keeps its rows in memory or on disk
            self._disk[sid].copy_(row)
        h = row_hash(sid, version, row)
        self._digest ^= self._hashes.get(sid, 0) ^ h
        self._hashes[sid] = h
        self._versions[sid] = version

    def digest(self) -> bytes:
        return self._digest.to_bytes(DIGEST_BYTES, "big")

    def __len__(self) -> int:
        return len(self._versions)

    def ids(self) -> list[int]:
        return sorted(self._versions)

    def snapshot(self) -> bytes:
        """Every (id, version, row) in id order as bytes: equal snapshots mean equal stores."""
        parts = []
        for sid in self.ids():
            parts.append(_KEY.pack(sid, self._versions[sid]))
            parts.append(self.get(sid).contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        return b"".join(parts)

    def max_version(self) -> int:
        return max(self._versions.values(), default=0)

    def export(self) -> dict:
        """Every row as plain tensors (ids int64, versions int64, rows fp16 (n, T, H)) and the digest (hex), for
        a hand-over through the state-transfer machinery (never pickled)."""
        ids = self.ids()
        rows = (torch.stack([self.get(i) for i in ids]) if ids
                else torch.empty((0, *self.config.row_shape), dtype=torch.float16))
        return {"ids": torch.tensor(ids, dtype=torch.int64), "versions": torch.tensor(
            [self._versions[i] for i in ids], dtype=torch.int64), "rows": rows.clone(), "digest": self.digest().hex()}

    def load(self, ids: torch.Tensor, versions: torch.Tensor, rows: torch.Tensor, digest: str, revision: int) -> None:
        """Replace this (empty) store by rows from the network: every id within capacity and once, every version
        in 1..revision, rows of this store's shape and finite, and their digest the one announced. Raises
        ValueError (nothing is kept then)."""
        n = ids.numel()
        if len(self):
            raise ValueError("a store is loaded only when empty")
        if (ids.dtype, versions.dtype, rows.dtype) != (torch.int64, torch.int64, torch.float16):
            raise ValueError(f"dtypes {ids.dtype}, {versions.dtype}, {rows.dtype}: expected int64, int64, float16")
        if ids.dim() != 1 or tuple(versions.shape) != (n,) or tuple(rows.shape) != (n, *self.config.row_shape):
            raise ValueError(f"shapes {list(ids.shape)}, {list(versions.shape)}, {list(rows.shape)} for {n} rows "
                             f"of {self.config.row_shape}")
        if n > self.capacity:
            raise ValueError(f"{n} rows, the store holds {self.capacity}")
        if n and (int(ids.min()) < 0 or int(ids.max()) >= self.capacity or ids.unique().numel() != n):
            raise ValueError("sample ids out of range or repeated")
        if n and (int(versions.min()) < 1 or int(versions.max()) > revision):
            raise ValueError(f"versions outside 1..{revision}")
        if not bool(torch.isfinite(rows).all()):
            raise ValueError("non-finite rows")
        try:
            for sid, v, row in zip(ids.tolist(), versions.tolist(), rows):
                self.put(sid, v, row)
            if self.digest().hex() != digest:
                raise ValueError(f"the rows hash to {self.digest().hex()[:16]}…, the sender announced {digest[:16]}…")
        except ValueError:
            self.clear()
            raise

    def close(self) -> None:
        """The link end is over: a disk store's file is removed (its mapping stays readable until the store is
        dropped, so nothing is left on disk however the node ends its links)."""
        if self._disk is not None and self.config.disk_path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.fspath(self.config.disk_path))

    def clear(self) -> None:
        self._versions.clear()
        self._hashes.clear()
        self._digest = 0
        if self._mem is not None:
            self._mem.clear()
