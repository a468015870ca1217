"""`shoal export`: take a run's trained model away as safetensors and a config a standard loader understands,
merging a pipeline's stages into one model; one exporter module per architecture (EXPORTERS)."""

from __future__ import annotations

import argparse

HELP = "write a run's trained model as safetensors + config (a pipeline's stages merged into one model)"
DESCRIPTION = """\
Write the model a run trained to a folder: model.safetensors, config.json and a
README.md with the few lines that load it. A pipeline's stages are merged into
one model. The source is a run's checkpoints:

  shoal export 5b721387 --out my-model             # a run id (prefix): its checkpoints under $SHOAL_HOME
  shoal export ~/.shoal/swarms/20250101-120000 --out my-model    # a `shoal swarm up` folder
  shoal export ~/.shoal/checkpoints/5b721387c0ffee12 --out m     # one run's checkpoint folder
  shoal export runs/5b721387c0ff --out my-model    # a `shoal train --out` folder

It takes the newest step at which every stage has a checkpoint (--step to choose
another). Across machines, each stage's holder has its stage's checkpoints in
its own --checkpoint-dir: copy the s<S>r<R> folders into one run folder first.
"""

#: the model's architecture -> the module that exports it (`export(manifest, stages, out, step=, source=)`)
EXPORTERS: dict[str, str] = {"shoal-gpt": "shoal.node.train.export_gpt", "hf": "shoal.node.train.export_hf"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("source", metavar="RUN_OR_DIR",
                   help="a run id (or its first 8+ characters), a run's checkpoint folder, a folder holding such "
                        "folders, a `shoal swarm up` folder, or a `shoal train --out` folder")
    p.add_argument("--out", required=True, metavar="DIR", help="where to write the model (created)")
    p.add_argument("--step", type=int, default=None, metavar="N",
                   help="export the checkpoints of this step (default: the newest at which every stage has one)")
    p.add_argument("--force", action="store_true", help="write into --out even when it already holds files")


def architecture(manifest) -> str:
    """Which exporter a run's model needs: a Hugging Face model's, or the built-in GPT's."""
    return "hf" if manifest.model.hf is not None else "shoal-gpt"


def exporter_module(manifest):
    """The module exporting this run's architecture: `export(manifest, stages, out, step=, source=)`."""
    import importlib

    return importlib.import_module(EXPORTERS[architecture(manifest)])


def main(args: argparse.Namespace) -> int:
    from pathlib import Path

    from shoal.node.cli.errors import CliError

    out = Path(args.out)
    if out.exists() and any(out.iterdir()) and not args.force:
        raise CliError(f"--out {out} is not empty", hint="choose an empty folder, or pass --force to write into it")
    run_dir = resolve_source(args.source)
    manifest, stages, step, source = read_stages(run_dir, args.step)
    exporter = exporter_module(manifest)
    extra = {}
    if manifest.data.tokenizer != "bytes":  # a Hugging Face run's tokenizer.json goes with the model
        extra["tokenizer"] = run_tokenizer(manifest)
    try:
        files = exporter.export(manifest, stages, out, step=step, source=source, **extra)
    except ValueError as e:
        raise CliError(f"{run_dir}: the checkpoints do not make the run's model: {e}") from None
    print(f"run {manifest.run_id[:16]}… step {step}: {len(stages)} stage(s) merged into {out}")
    for f in files:
        print(f"  {f} ({f.stat().st_size / 1e6:.1f} MB)")
    return 0


def run_tokenizer(manifest):
    """The run's tokenizer.json from this node's blob store (where `run create` and every node fetching it keep it);
    CliError when it is not there."""
    from shoal.node.cli.errors import CliError
    from shoal.node.cli.node import shoal_home
    from shoal.swarm.state.blobs import BlobStore

    root = shoal_home() / "blobs"
    path = BlobStore(root).path(manifest.data.tokenizer)
    if path is None:
        raise CliError(f"the run's tokenizer {manifest.data.tokenizer[:16]}… is not in {root}",
                       hint="export on a node that took part in the run (or its owner's machine)")
    return path


def resolve_source(text: str):
    """The run folder (one holding run.toml) that RUN_OR_DIR names; CliError with the candidates otherwise."""
    import re
    from pathlib import Path

    from shoal.node.cli.errors import CliError
    from shoal.node.cli.node import shoal_home
    from shoal.node.run.checkpoints import find_run_dirs

    path = Path(text).expanduser()
    if path.exists():
        found = find_run_dirs(path / "checkpoints") or find_run_dirs(path)  # a `swarm up` folder: its checkpoints
        if not found:
            raise CliError(f"{path} holds no run's checkpoints (no run.toml in it or in a folder under it)")
        if len(found) > 1:
            raise CliError(f"{path} holds the checkpoints of {len(found)} runs: "
                           + ", ".join(d.name for d in found[:6]), hint="name one of those folders")
        return found[0]
    if not re.fullmatch(r"[0-9a-f]{8,64}", text):
        raise CliError(f"{text}: no such folder, and not a run id")
    home = shoal_home()
    roots = [home / "checkpoints"] + sorted((home / "swarms").glob("*/checkpoints"), reverse=True)
    for root in roots:
        for d in find_run_dirs(root):
            if d.name.startswith(text[:16]) or text.startswith(d.name):
                return d
    raise CliError(f"no checkpoints of run {text} under {home}/checkpoints or {home}/swarms",
                   hint="pass the folder that holds them (a node's --checkpoint-dir, or a swarm up folder)")


def read_stages(run_dir, step: int | None):
    """(manifest, each stage's model weights, step, a description of the files) from a run folder: swarm
    checkpoints (one slot per stage, the lowest lane first) or a `shoal train` folder."""
    from shoal.node.cli.errors import CliError
    from shoal.node.run.checkpoints import CheckpointMissing, read_checkpoint, slots_on_disk
    from shoal.node.train import checkpoint as single
    from shoal.node.train.stages import trained_weights
    from shoal.protocol.errors import ProtocolError
    from shoal.protocol.manifest import RunManifest

    try:
        manifest = RunManifest.from_toml((run_dir / "run.toml").read_text())
    except (OSError, ProtocolError, ValueError) as e:
        raise CliError(f"{run_dir}/run.toml: not a run manifest: {e}") from None
    on_disk = slots_on_disk(run_dir.parent, manifest.run_id) if run_dir.name == manifest.run_id[:16] else {}
    stages = manifest.plan.stages
    if not on_disk:
        files = single.list_checkpoints(run_dir)
        if not files or stages != 1:
            raise CliError(f"{run_dir} holds no checkpoint of run {manifest.run_id[:16]}…")
        at = [s for s, _ in files if step is None or s == step]
        if not at:
            raise CliError(f"{run_dir} has no checkpoint of step {step} (it has {[s for s, _ in files]})")
        try:
            state = single.read_checkpoint(single.checkpoint_path(run_dir, at[-1]))
        except single.CheckpointError as e:
            raise CliError(str(e)) from None
        weights = trained_weights(manifest, 0, state)
        return manifest, [weights], at[-1], f"{single.checkpoint_path(run_dir, at[-1])}"
    common = set.intersection(*[{s for (st, _), v in on_disk.items() if st == i for s in v} for i in range(stages)])
    if not common:
        have = {f"s{st}r{r}": v for (st, r), v in on_disk.items()}
        raise CliError(f"{run_dir}: no step at which every stage has a checkpoint ({have})")
    if step is not None and step not in common:
        raise CliError(f"{run_dir}: not every stage has a checkpoint of step {step} (every stage has {sorted(common)})")
    step = max(common) if step is None else step
    models, used = [], []
    for i in range(stages):
        for st, r in sorted(k for k, v in on_disk.items() if k[0] == i and step in v):
            try:
                snap, _ = read_checkpoint(run_dir.parent, manifest.run_id, st, r, step)
            except CheckpointMissing as e:
                print(f"skipping {e}")
                continue
            models.append(trained_weights(manifest, i, snap.state()))
            used.append(f"s{st}r{r}")
            break
        else:
            raise CliError(f"{run_dir}: stage {i}'s checkpoints of step {step} are damaged")
    return manifest, models, step, f"{run_dir} step {step} ({', '.join(used)})"
