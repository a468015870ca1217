"""Training data: the built-in stdlib corpus or local files as byte tokens, a held-out split, deterministic sharding."""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger(__name__)

BLOCK_BYTES = 64 * 1024  # the held-out split picks whole blocks of the corpus
SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


@dataclass(frozen=True, slots=True)
class Corpus:
    """A token stream split into train and held-out parts; `fingerprint` names the exact bytes."""

    train: np.ndarray  # uint8 tokens
    heldout: np.ndarray
    fingerprint: str
    description: str


def stdlib_documents() -> list[tuple[str, bytes]]:
    """Every *.py file under the running interpreter's stdlib (site-packages excluded), in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    docs = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith("."))
        for name in sorted(filenames):
            if name.endswith(".py"):
                path = Path(dirpath, name)
                try:
                    docs.append((str(path.relative_to(root)), path.read_bytes()))
                except OSError:  # a broken symlink or unreadable file: not worth failing over
                    continue
    return docs


def file_documents(path: Path) -> list[tuple[str, bytes]]:
    """A .txt file (one document), a .jsonl file (one document per line's "text"), or a folder of them."""
    if path.is_dir():
        return [d for p in sorted(path.rglob("*")) if p.suffix in (".txt", ".jsonl") for d in file_documents(p)]
    if path.suffix == ".jsonl":
        docs = []
        with path.open("rb") as f:
            for i, line in enumerate(f):
                if line.strip():
                    rec = json.loads(line)
                    text = rec.get("text") if isinstance(rec, dict) else rec
                    if not isinstance(text, str):
                        raise ValueError(f"{path}:{i + 1}: expected a string or an object with a 'text' string")
                    docs.append((f"{path.name}:{i + 1}", text.encode()))
        return docs
    return [(path.name, path.read_bytes())]


def hf_documents(name: str) -> list[tuple[str, bytes]]:  # pragma: no cover - needs the network
    try:
        import datasets
    except ImportError:
        raise ValueError(f"data source hf:{name} needs the `datasets` package (pip install datasets)") from None
    ds = datasets.load_dataset(name, split="train")
    return [(str(i), row["text"].encode()) for i, row in enumerate(ds)]


@functools.lru_cache(maxsize=4)
def load_corpus(source: str = "stdlib", heldout_every: int = 20) -> Corpus:
    """Concatenate a source's documents (a `# file:` line before each) and hold out every Nth block."""
    if source == "stdlib":
        docs, what = stdlib_documents(), f"python {sysconfig.get_python_version()} stdlib"
    elif source.startswith("hf:"):
        docs, what = hf_documents(source[3:]), source
    else:
        path = Path(source).expanduser()
        if not path.exists():
            raise ValueError(f"data source {source!r}: no such file (use 'stdlib', a .txt/.jsonl path or hf:NAME)")
        docs, what = file_documents(path), str(path)
    if not docs:
        raise ValueError(f"data source {source!r} holds no documents")
    data = b"".join(b"# file: " + name.encode() + b"\n" + body + b"\n" for name, body in docs)
    tokens = np.frombuffer(data, dtype=np.uint8)
    n_blocks = len(tokens) // BLOCK_BYTES
    if n_blocks >= 2 * heldout_every:
        blocks = tokens[: n_blocks * BLOCK_BYTES].reshape(n_blocks, BLOCK_BYTES)
        held = np.arange(n_blocks) % heldout_every == heldout_every - 1
        train = np.concatenate([blocks[~held].reshape(-1), tokens[n_blocks * BLOCK_BYTES :]])
        heldout = blocks[held].reshape(-1).copy()
    else:  # a small corpus: the last 1/N of it is held out
        cut = len(tokens) - max(len(tokens) // heldout_every, 1)
        train, heldout = tokens[:cut].copy(), tokens[cut:].copy()
    fp = hashlib.sha256(data).hexdigest()
    log.info("corpus %s: %d documents, %.1f MB, %d train / %d held-out tokens", what, len(docs), len(data) / 1e6, len(train), len(heldout))
    return Corpus(train=train, heldout=heldout, fingerprint=fp, description=f"{what}, {len(docs)} documents, {len(data) / 1e6:.1f} MB")


class Samples:
    """Non-overlapping windows of seq_len + 1 tokens; sample id i is window i (stable for a corpus and seq_len)."""

    def __init__(self, tokens: np.ndarray, seq_len: int):
        self.tokens = torch.from_numpy(np.ascontiguousarray(tokens))
        self.seq_len = seq_len
        self.num_samples = (len(tokens) - 1) // seq_len
        if self.num_samples < 1:
            raise ValueError(f"corpus of {len(tokens)} tokens is shorter than one sequence of {seq_len + 1}")

    def get(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets, both (len(ids), seq_len) int64."""
        offsets = ids[:, None] * self.seq_len + torch.arange(self.seq_len + 1)
        window = self.tokens[offsets].long()
        return window[:, :-1], window[:, 1:]


class ShardedSampler:
    """Replica `replica` of `replicas` reads global positions replica, replica + D, replica + 2D, ...

    The global stream is every sample once per epoch in an order fixed by (seed, epoch), so the D
    replicas together read every sample exactly once per epoch and never the same one. `position`
    counts the samples this replica has consumed; restoring it resumes at the right sample.
    """

    def __init__(self, num_samples: int, *, seed: int, replica: int = 0, replicas: int = 1, position: int = 0):
        if not 0 <= replica < replicas:
            raise ValueError(f"replica {replica} of {replicas}")
        self.num_samples, self.seed, self.replica, self.replicas = num_samples, seed, replica, replicas
        self.position = position
        self._epoch, self._perm = -1, torch.empty(0, dtype=torch.long)

    def _order(self, epoch: int) -> torch.Tensor:
        if epoch != self._epoch:
            g = torch.Generator().manual_seed((self.seed * 1_000_003 + epoch) % 2**63)
            self._epoch, self._perm = epoch, torch.randperm(self.num_samples, generator=g)
        return self._perm

    def ids_at(self, first: int, n: int) -> torch.Tensor:
        """The sample ids at this replica's positions first .. first + n - 1."""
        g = torch.arange(first, first + n, dtype=torch.long) * self.replicas + self.replica
        epochs, idx = g // self.num_samples, g % self.num_samples
        out = torch.empty(n, dtype=torch.long)
        for epoch in torch.unique(epochs).tolist():  # one or two epochs in a batch
            sel = epochs == epoch
            out[sel] = self._order(epoch)[idx[sel]]
        return out

    def next_ids(self, n: int) -> torch.Tensor:
        ids = self.ids_at(self.position, n)
        self.position += n
        return ids

    def epoch(self) -> int:
        return (self.position * self.replicas + self.replica) // self.num_samples


def heldout_batches(heldout: Samples, batch_size: int, num_batches: int) -> list[torch.Tensor]:
    """The fixed evaluation set: the first samples of the held-out split (wrapping if it is short)."""
    n = batch_size * num_batches
    ids = torch.arange(n) % heldout.num_samples
    return list(ids.split(batch_size))
