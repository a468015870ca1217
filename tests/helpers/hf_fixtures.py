"""Tiny Hugging Face models, tokenizers and data the tests build themselves (nothing is downloaded): a byte-level
BPE trained with `tokenizers` on the interpreter's own source, text/jsonl/parquet files, and model folders written by
`transformers` (config.json + model.safetensors)."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

TINY = {  # per family: a config of 4 layers, width 64, with dropout off (the parity tests compare exact losses)
    "llama": dict(hidden_size=64, intermediate_size=160, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False),
    "qwen2": dict(hidden_size=64, intermediate_size=160, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True),
    "mistral": dict(hidden_size=64, intermediate_size=160, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=256, sliding_window=128),
    "gpt2": dict(n_embd=64, n_layer=4, n_head=4, n_positions=256, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                 bos_token_id=0, eos_token_id=0),
}


def sample_text(max_bytes: int = 400_000) -> str:
    """Real text: the first stdlib modules' source, in a fixed order, up to `max_bytes`."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out, n = [], 0
    for p in sorted(root.glob("*.py")):
        t = p.read_text(encoding="utf-8", errors="replace")
        out.append(t)
        n += len(t)
        if n >= max_bytes:
            break
    return "\n".join(out)[:max_bytes]


def write_bpe(path: Path, vocab_size: int = 384, text: str | None = None) -> Path:
    """A byte-level BPE tokenizer.json trained on `text` (the stdlib sample by default), `<|endoftext|>` special."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    text = text if text is not None else sample_text(200_000)
    tok.train_from_iterator(text.split("\n\n"), trainer=trainer)
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path


def write_jsonl(path: Path, text: str, docs: int = 200) -> Path:
    chunk = max(len(text) // docs, 1)
    with path.open("w", encoding="utf-8") as f:
        for i in range(docs):
            f.write(json.dumps({"text": text[i * chunk:(i + 1) * chunk]}) + "\n")
    return path


def write_parquet(path: Path, text: str, docs: int = 200, column: str = "text") -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    chunk = max(len(text) // docs, 1)
    pq.write_table(pa.table({column: [text[i * chunk:(i + 1) * chunk] for i in range(docs)]}), path, row_group_size=64)
    return path


def hf_model_folder(folder: Path, family: str = "llama", vocab_size: int = 384, *, weights: bool = True,
                    seed: int = 7, **overrides) -> Path:
    """A model folder as `save_pretrained` writes it: config.json, and random weights (model.safetensors)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(family, vocab_size=vocab_size, **{**TINY[family], **overrides})
    folder.mkdir(parents=True, exist_ok=True)
    if weights:
        torch.manual_seed(seed)
        AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    else:
        cfg.save_pretrained(folder)
    return folder
