"""`shoal export`: a run's model, joined from its stages' checkpoints, written where other tools read it."""

from __future__ import annotations

import argparse

HELP = "write a run's trained model for other tools (a Hugging Face model: a transformers folder)"
DESCRIPTION = """\
Join a run's stages' checkpoints (one per stage, of one step) into the whole model and write it out.
A Hugging Face model (--model hf:PATH, --arch) becomes a folder that
AutoModelForCausalLM.from_pretrained(DIR) loads: config.json (its head tied or untied as the run
trained it), model.safetensors (fp32) and the run's tokenizer.json when it names one.

  shoal export --run run.toml runs/mine -o exported/             a one-stage run's output folder
  shoal export --run run.toml s0/ckpt-0000002000.pt s1/ckpt-0000002000.pt -o exported/

Each CHECKPOINT is a checkpoint file or a folder of them (its newest good one is taken)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run", required=True, metavar="RUN.toml", help="the run's manifest")
    parser.add_argument("checkpoints", nargs="+", metavar="CHECKPOINT", help="one per stage: a file or a folder")
    parser.add_argument("-o", "--output", required=True, metavar="DIR", help="the folder to write")


def _load(path: str):
    from pathlib import Path

    from shoal.node.train import checkpoint

    p = Path(path)
    if p.is_dir():
        found = checkpoint.load_latest(p)
        if found is None:
            raise ValueError(f"{path}: no good checkpoint in this folder")
        return found[1]
    if not p.is_file():
        raise ValueError(f"{path}: no such checkpoint file or folder")
    return checkpoint.read_checkpoint(p)


def main(args: argparse.Namespace) -> int:
    import sys
    from pathlib import Path

    from shoal.node.cli.hfmodel import blob_store
    from shoal.node.cli.run import read_manifest
    from shoal.node.train.checkpoint import CheckpointError
    from shoal.node.train.export import ExportError, write_model
    from shoal.protocol.errors import ProtocolError

    try:
        manifest = read_manifest(args.run)
        states = [_load(c) for c in args.checkpoints]
    except (OSError, ProtocolError, ValueError, CheckpointError) as e:
        print(f"shoal export: {e}", file=sys.stderr)
        return 2
    tok = None
    if manifest.data.tokenizer != "bytes":
        tok = blob_store().path(manifest.data.tokenizer)
        if tok is None:
            print(f"shoal export: note: the run's tokenizer ({manifest.data.tokenizer[:16]}…) is not in this "
                  f"machine's blob store; the folder gets no tokenizer.json", file=sys.stderr)
    try:
        files = write_model(manifest, states, Path(args.output), tokenizer=tok)
    except ExportError as e:
        print(f"shoal export: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.output}: {', '.join(files)} ({manifest.model.describe()}, step {states[0]['step']})")
    return 0
