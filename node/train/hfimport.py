"""A Hugging Face model for a new run: its config (from a folder or a config.json, or built from `--arch` and sizes),
its weights packed into one safetensors file that the manifest names by sha256, its tokenizer.json. Used where a run
is created (`shoal run create --model hf:PATH`); nodes then get the files from peers by hash, never by path."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from shoal.protocol.hfconfig import FAMILIES, canonical_config

HASH_CHUNK = 8 << 20


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


@dataclass(frozen=True, kw_only=True, slots=True)
class HFSource:
    """What a local model path holds: the config, the safetensors files, a tokenizer.json."""

    config: dict
    weight_files: tuple[Path, ...]
    tokenizer: Path | None


def read_model_path(path: Path) -> HFSource:
    """A folder (config.json, *.safetensors, tokenizer.json) or a config.json alone."""
    path = Path(path).expanduser()
    if path.is_dir():
        cfg_path = path / "config.json"
        if not cfg_path.is_file():
            raise ValueError(f"{path}: no config.json (a Hugging Face model folder holds one)")
        files = tuple(sorted(path.glob("*.safetensors")))
        if not files and any(path.glob("*.bin")):
            raise ValueError(f"{path}: weights only as PyTorch .bin files; shoal reads safetensors (save the model "
                             f"with save_pretrained(..., safe_serialization=True))")
        tok = path / "tokenizer.json"
        folder_tok = tok if tok.is_file() else None
    elif path.is_file():
        cfg_path, files, folder_tok = path, (), None
    else:
        raise ValueError(f"{path}: no such folder or config.json")
    try:
        config = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"{cfg_path}: not a readable JSON config: {e}") from None
    if not isinstance(config, dict) or config.get("model_type") not in FAMILIES:
        mt = config.get("model_type") if isinstance(config, dict) else None
        raise ValueError(f"{cfg_path}: model_type {mt!r} is not one shoal splits into stages "
                         f"({', '.join(sorted(FAMILIES))})")
    return HFSource(config=config, weight_files=files, tokenizer=folder_tok)


def arch_config(arch: str, *, layers: int, d_model: int, heads: int, kv_heads: int | None = None,
                ffn: int | None = None, vocab: int, max_positions: int, tie: bool | None = None) -> dict:
    """A config for training from scratch: a family's defaults with these sizes (dropout off)."""
    from shoal.node.train.optional import require_transformers

    transformers = require_transformers()
    if arch not in FAMILIES:
        raise ValueError(f"--arch {arch!r}: one of {', '.join(sorted(FAMILIES))}")
    if arch == "gpt2":
        kw = dict(n_layer=layers, n_embd=d_model, n_head=heads, n_inner=ffn, vocab_size=vocab,
                  n_positions=max_positions, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                  bos_token_id=None, eos_token_id=None, tie_word_embeddings=True if tie is None else tie)
    else:
        # SwiGLU's usual width: 8/3 d rounded up to a multiple of 64
        kw = dict(num_hidden_layers=layers, hidden_size=d_model, num_attention_heads=heads,
                  num_key_value_heads=kv_heads or heads, head_dim=d_model // heads,
                  intermediate_size=ffn or -(-8 * d_model // 3 // 64) * 64, vocab_size=vocab,
                  max_position_embeddings=max_positions, tie_word_embeddings=bool(tie),
                  bos_token_id=None, eos_token_id=None, pad_token_id=None)
        if arch == "mistral":
            kw["sliding_window"] = None
    cfg = transformers.AutoConfig.for_model(arch, **kw)
    return json.loads(cfg.to_json_string(use_diff=False))


def config_text(config: dict) -> str:
    return canonical_config(config)


def pack_weights(files: tuple[Path, ...], out_dir: Path) -> tuple[str, int, Path]:
    """The weights as one safetensors file in `out_dir` (a single file is copied as it is; shards are merged):
    (sha256, size in bytes, path)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / f".weights.{os.getpid()}.tmp"
    if len(files) == 1:
        with open(files[0], "rb") as src, open(tmp, "wb") as dst:
            while chunk := src.read(HASH_CHUNK):
                dst.write(chunk)
    else:
        from safetensors.torch import load_file, save_file

        merged = {}
        for f in files:
            for k, v in load_file(str(f)).items():
                if k in merged:
                    raise ValueError(f"{f}: tensor {k} is in two weight files")
                merged[k] = v
        save_file(merged, str(tmp))
    digest = sha256_file(tmp)
    final = out_dir / digest
    os.replace(tmp, final)
    return digest, final.stat().st_size, final
