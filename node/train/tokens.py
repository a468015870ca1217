"""How text becomes token ids: bytes (the default: 256 ids, nothing to install) or a `tokenizer.json` (the
`tokenizers` library's format, as Hugging Face models ship it), which a run names by its sha256."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

#: names of the token that ends a document, looked for among a tokenizer's special tokens (first found wins)
END_OF_TEXT = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>")
BATCH_DOCS = 256  # documents encoded per call (the library encodes a batch on its threads)


class ByteTokens:
    """Text as its UTF-8 bytes; a document is a `# file: NAME` line, its bytes and a newline (the built-in
    corpus's layout since the first runs: run ids and corpus fingerprints stay as they were)."""

    name = "bytes"
    vocab_size = 256
    dtype = np.uint8

    def encode(self, docs: Iterable[tuple[str, bytes]]) -> Iterator[np.ndarray]:
        for name, body in docs:
            yield np.frombuffer(b"# file: " + name.encode() + b"\n" + body + b"\n", dtype=np.uint8)


class JsonTokenizer:
    """A `tokenizers` tokenizer.json: each document encoded alone (no special tokens added), documents joined by
    the tokenizer's end-of-text token when it has one."""

    dtype = np.int32

    def __init__(self, path: Path):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise MissingTokenizers() from None
        data = Path(path).read_bytes()
        self.name = hashlib.sha256(data).hexdigest()
        try:
            self.tok = Tokenizer.from_str(data.decode())
        except Exception as e:  # noqa: BLE001 - the library raises its own exception types
            raise ValueError(f"{path}: not a tokenizer.json the `tokenizers` library reads: {e}") from None
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        self.eos = next((t for t in (self.tok.token_to_id(s) for s in END_OF_TEXT) if t is not None), None)

    def encode(self, docs: Iterable[tuple[str, bytes]]) -> Iterator[np.ndarray]:
        batch: list[str] = []
        for _, body in docs:
            batch.append(body.decode("utf-8", errors="replace"))
            if len(batch) == BATCH_DOCS:
                yield from self._encode(batch)
                batch = []
        if batch:
            yield from self._encode(batch)

    def _encode(self, texts: list[str]) -> Iterator[np.ndarray]:
        for enc in self.tok.encode_batch(texts, add_special_tokens=False):
            ids = np.asarray(enc.ids, dtype=np.int32)
            yield ids if self.eos is None else np.append(ids, np.int32(self.eos))

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids)


class MissingTokenizers(RuntimeError):
    def __init__(self) -> None:
        super().__init__("this run names a tokenizer.json, which needs the `tokenizers` package: "
                         "pip install 'shoal[hf]'")


def load_tokenizer(path: Path | None) -> ByteTokens | JsonTokenizer:
    """Bytes without a file, else the tokenizer.json at `path` (checked against its hash by whoever fetched it)."""
    return ByteTokens() if path is None else JsonTokenizer(path)


def tokenizer_hash(path: Path) -> str:
    """The sha256 a manifest names a tokenizer.json by (of the file's bytes)."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()
