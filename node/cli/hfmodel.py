"""`shoal run create`'s model and tokenizer: the built-in GPT preset, a Hugging Face model (`--model hf:PATH`) or
architecture (`--arch`), and a tokenizer.json; the files a run names by hash go into this machine's blob store
($SHOAL_HOME/blobs), from which the owner's node serves them to the run's nodes."""

from __future__ import annotations

import argparse
from pathlib import Path

HF_DEFAULT_SEQ = 512


def blob_store():
    from shoal.node.cli.node import shoal_home
    from shoal.swarm.state.blobs import BlobStore

    return BlobStore(shoal_home() / "blobs")


def tokenizer_file(arg: str | None, folder_tok: Path | None) -> Path | None:
    if arg is None:
        return folder_tok
    p = Path(arg).expanduser()
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file():
        raise ValueError(f"--tokenizer {arg}: no tokenizer.json there")
    return p


def model_and_tokenizer(args: argparse.Namespace, tie: bool | None):
    """(ModelSpec, the tokenizer's manifest value, seq_len) from the flags; files kept in the blob store."""
    from shoal.protocol import manifest as mf

    if args.model and args.arch:
        raise ValueError("give --model hf:PATH or --arch, not both")
    hf_model = bool(args.model or args.arch)
    if not hf_model:
        if args.kv_heads or args.ffn:
            raise ValueError("--kv-heads and --ffn size a Hugging Face architecture (--arch)")
        tok = tokenizer_file(args.tokenizer, None)
        vocab = _tokenizer_vocab(tok) if tok is not None else 256
        model = mf.ModelSpec.preset(args.size, positions=args.positions, tie_embeddings=tie, vocab_size=vocab)
        overrides = {k: v for k, v in (("n_layers", args.layers), ("d_model", args.d_model), ("n_heads", args.heads))
                     if v}
        if overrides:
            model = mf.ModelSpec(**{**model.to_wire(), **overrides, "size": "custom"})
        return model, _store_tokenizer(tok), args.seq_len or mf.MODEL_PRESETS[args.size][3]
    if args.tie_embeddings != "auto":
        raise ValueError("a Hugging Face model's config says whether its head is tied (--tie-embeddings is for the "
                         "built-in GPT)")
    from shoal.node.train.optional import require_transformers
    from shoal.node.train.hfimport import arch_config, config_text, pack_weights, read_model_path

    require_transformers()
    weights = ("", 0)
    if args.model:
        if not args.model.startswith("hf:"):
            raise ValueError(f"--model {args.model!r}: hf:PATH (a Hugging Face model folder or config.json)")
        if args.layers or args.d_model or args.heads:
            raise ValueError("--layers/--d-model/--heads size an --arch; a --model's config says its size")
        src = read_model_path(Path(args.model[3:]))
        config = src.config
        tok = tokenizer_file(args.tokenizer, src.tokenizer)
        if src.weight_files:
            store = blob_store()
            digest, size, _ = pack_weights(src.weight_files, store.root)
            weights = (digest, size)
    else:
        if not (args.layers and args.d_model and args.heads):
            raise ValueError(f"--arch {args.arch} needs --layers, --d-model and --heads")
        tok = tokenizer_file(args.tokenizer, None)
        seq = args.seq_len or HF_DEFAULT_SEQ
        config = arch_config(args.arch, layers=args.layers, d_model=args.d_model, heads=args.heads,
                             kv_heads=args.kv_heads, ffn=args.ffn, vocab=_tokenizer_vocab(tok) if tok else 256,
                             max_positions=max(seq, 1024), tie=None)
    hf = mf.HFModelSpec(config=config_text(config), weights=weights[0], weights_bytes=weights[1])
    model = mf.ModelSpec.from_hf(hf)
    if tok is not None and _tokenizer_vocab(tok) > model.vocab_size:
        raise ValueError(f"the tokenizer has {_tokenizer_vocab(tok)} tokens, the model's vocabulary "
                         f"{model.vocab_size}")
    if tok is None and model.vocab_size < 256:
        raise ValueError(f"the model's vocabulary ({model.vocab_size}) cannot hold byte tokens: give --tokenizer")
    seq = args.seq_len or min(HF_DEFAULT_SEQ, hf.shape.max_positions)
    return model, _store_tokenizer(tok), seq


def _tokenizer_vocab(path: Path) -> int:
    from shoal.node.train.tokens import JsonTokenizer

    return JsonTokenizer(path).vocab_size


def _store_tokenizer(tok: Path | None) -> str:
    if tok is None:
        return "bytes"
    _tokenizer_vocab(tok)  # it reads as a tokenizer
    digest, _ = blob_store().add_file(tok)
    return digest
