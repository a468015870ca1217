"""Training data: the built-in stdlib corpus, local text/jsonl/parquet files or a Hugging Face dataset (streamed),
as byte tokens or a tokenizer's; a held-out split; deterministic sharding by sample id."""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from shoal.node.train.datacheck import INSTALL_HINT, DataUnavailable, require_datasets
from shoal.node.train.tokens import load_tokenizer
from shoal.protocol.manifest import RunManifest
from shoal.node.train.batch import GlobalOrder

log = logging.getLogger(__name__)

BLOCK_TOKENS = 64 * 1024  # the held-out split picks whole blocks of the corpus
FILE_SUFFIXES = (".txt", ".jsonl", ".parquet")
PROGRESS_TOKENS = 10_000_000  # a log line every this many tokens while a corpus is read
SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


@dataclass(frozen=True, slots=True)
class Corpus:
    """A token stream split into train and held-out parts; `fingerprint` names the exact bytes."""

    train: np.ndarray  # uint8 (bytes) or int32 token ids
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


def file_documents(path: Path, text_field: str = "text") -> Iterator[tuple[str, bytes]]:
    """A .txt file (one document), a .jsonl file (one document per line: a string or an object's `text_field`), a
    .parquet file (one document per row of its `text_field` column), or a folder of them (sorted paths)."""
    if path.is_dir():
        for p in sorted(path.rglob("*")):
            if p.suffix in FILE_SUFFIXES and p.is_file():
                yield from file_documents(p, text_field)
        return
    if path.suffix == ".jsonl":
        with path.open("rb") as f:
            for i, line in enumerate(f):
                if line.strip():
                    rec = json.loads(line)
                    text = rec.get(text_field) if isinstance(rec, dict) else rec
                    if not isinstance(text, str):
                        raise ValueError(f"{path}:{i + 1}: expected a string or an object with a {text_field!r} string")
                    yield f"{path.name}:{i + 1}", text.encode()
        return
    if path.suffix == ".parquet":
        yield from parquet_documents(path, text_field)
        return
    yield path.name, path.read_bytes()


def parquet_documents(path: Path, text_field: str) -> Iterator[tuple[str, bytes]]:
    """The `text_field` column of a parquet file, row by row, read one record batch at a time."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataUnavailable(f"{path}: reading parquet needs `pyarrow`: {INSTALL_HINT}") from None
    f = pq.ParquetFile(path)
    if text_field not in f.schema_arrow.names:
        raise ValueError(f"{path}: no column {text_field!r} (columns: {', '.join(f.schema_arrow.names)}); "
                         f"name the text column with --text-field")
    row = 0
    for batch in f.iter_batches(columns=[text_field], batch_size=1024):
        for text in batch.column(0).to_pylist():
            row += 1
            if isinstance(text, str):
                yield f"{path.name}:{row}", text.encode()


@dataclass(frozen=True, slots=True)
class HFSource:
    """Which part of a Hugging Face dataset a run reads: its configuration (subset), split and text column."""

    config: str = ""
    split: str = "train"
    text_field: str = "text"


def hf_documents(name: str, src: HFSource) -> Iterator[tuple[str, bytes]]:
    """The dataset's rows in the dataset's own order, streamed (nothing downloaded whole). `check_source` says
    what is wrong before this runs."""
    datasets = require_datasets()
    ds = datasets.load_dataset(name, src.config or None, split=src.split, streaming=True)
    for i, row in enumerate(ds):
        text = row.get(src.text_field)
        if isinstance(text, str):
            yield str(i), text.encode()


def source_documents(source: str, src: HFSource) -> tuple[Iterator[tuple[str, bytes]], str]:
    """The documents of a source, and how to name it in logs."""
    if source == "stdlib":
        return iter(stdlib_documents()), f"python {sysconfig.get_python_version()} stdlib"
    if source.startswith("hf:"):
        return hf_documents(source[3:], src), source
    path = Path(source).expanduser()
    if not path.exists():
        raise ValueError(f"data source {source!r}: no such file (use 'stdlib', a .txt/.jsonl/.parquet path or hf:NAME)")
    return file_documents(path, src.text_field), str(path)


@functools.lru_cache(maxsize=4)
def load_corpus(source: str = "stdlib", heldout_every: int = 20, *, tokenizer: Path | None = None,
                max_tokens: int = 0, hf: HFSource = HFSource()) -> Corpus:
    """A source's documents as tokens (bytes, or the tokenizer.json at `tokenizer`), streamed and encoded as they
    come, the first `max_tokens` of them (0: all); every Nth block of BLOCK_TOKENS held out."""
    docs, what = source_documents(source, hf)
    tok = load_tokenizer(tokenizer)
    parts, n, n_docs = [], 0, 0
    next_log = PROGRESS_TOKENS
    for ids in tok.encode(docs):
        parts.append(ids)
        n += len(ids)
        n_docs += 1
        if max_tokens and n >= max_tokens:
            break
        if n >= next_log:
            log.info("corpus %s: %d documents, %.1fM tokens so far%s", what, n_docs, n / 1e6,
                     f" of {max_tokens / 1e6:.1f}M" if max_tokens else "")
            next_log += PROGRESS_TOKENS
    if not n_docs:
        raise ValueError(f"data source {source!r} holds no documents")
    tokens = np.concatenate(parts) if len(parts) > 1 else parts[0]
    del parts
    if max_tokens:
        tokens = tokens[:max_tokens]
    n_blocks = len(tokens) // BLOCK_TOKENS
    if n_blocks >= 2 * heldout_every:
        blocks = tokens[: n_blocks * BLOCK_TOKENS].reshape(n_blocks, BLOCK_TOKENS)
        held = np.arange(n_blocks) % heldout_every == heldout_every - 1
        train = np.concatenate([blocks[~held].reshape(-1), tokens[n_blocks * BLOCK_TOKENS :]])
        heldout = blocks[held].reshape(-1).copy()
    else:  # a small corpus: the last 1/N of it is held out
        cut = len(tokens) - max(len(tokens) // heldout_every, 1)
        train, heldout = tokens[:cut].copy(), tokens[cut:].copy()
    h = hashlib.sha256(tokens.astype(tok.dtype, copy=False).tobytes())
    if tok.name != "bytes":  # byte corpora keep the fingerprint of their bytes alone, as before tokenizers
        h.update(b"\0tokenizer:" + tok.name.encode())
    fp = h.hexdigest()
    size = f"{len(tokens) / 1e6:.1f}M tokens" if tok.name != "bytes" else f"{len(tokens) / 1e6:.1f} MB"
    log.info("corpus %s: %d documents, %s, %d train / %d held-out tokens", what, n_docs, size, len(train), len(heldout))
    return Corpus(train=train, heldout=heldout, fingerprint=fp, description=f"{what}, {n_docs} documents, {size}")


def tokens_needed(manifest: RunManifest) -> int:
    """The tokens a run can consume: the global batch's samples over its steps (however the lanes split them), the
    held-out share on top, and a block per held-out period of margin. A streamed source is read this far and no
    further."""
    b, n = manifest.batch, manifest.data.heldout_every
    train = manifest.optim.total_steps * manifest.global_batch * b.seq_len + b.seq_len + 1
    return train * n // (n - 1) + n * BLOCK_TOKENS


def load_run_corpus(manifest: RunManifest, source: str, tokenizer: Path | None = None) -> Corpus:
    """The run's corpus from `source` (the manifest's, or the volunteer's own --data): its tokenizer, its hf:
    dataset part, and for a streamed source (hf:) only the tokens the run can consume."""
    d = manifest.data
    return load_corpus(source, d.heldout_every, tokenizer=tokenizer,
                       max_tokens=tokens_needed(manifest) if source.startswith("hf:") else 0,
                       hf=HFSource(config=d.hf_config, split=d.hf_split, text_field=d.text_field))


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
        self._stream = GlobalOrder(num_samples, seed=seed)  # the run's stream (node/train/batch.py)

    def ids_at(self, first: int, n: int) -> torch.Tensor:
        """The sample ids at this replica's positions first .. first + n - 1."""
        return self._stream.at(torch.arange(first, first + n, dtype=torch.long) * self.replicas + self.replica)

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
