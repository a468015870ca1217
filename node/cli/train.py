"""`shoal train`: train a run single-process on this machine, with checkpoints and a metrics log, resuming if it can."""

from __future__ import annotations

import argparse

HELP = "train a run on this machine alone (the built-in tiny model and stdlib corpus by default)"
DESCRIPTION = (
    "Trains one replica of a run's model on this machine, writing checkpoints and metrics.jsonl to --out\n"
    "and resuming from the newest good checkpoint there.\n\n"
    "  shoal train                                   built-in tiny GPT on the Python stdlib source\n"
    "  shoal train --run run.toml --device cuda --out runs/mine"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run", help="run manifest (TOML) from `shoal run create`; default: the built-in run")
    parser.add_argument("--size", choices=("tiny", "small", "base"), default="tiny", help="model of the built-in run, without --run (default: %(default)s)")
    parser.add_argument("--device", default="auto", metavar="DEVICE",
                        help="auto (CUDA, else MPS, else the CPU), cpu, cuda, cuda:N or mps (default: %(default)s)")
    parser.add_argument("--steps", type=int, help="stop once this many steps are done (default: the run's total)")
    parser.add_argument("--out", help="checkpoint and metrics folder (default: runs/RUN_ID_PREFIX)")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--no-progress", action="store_true", help="plain log lines instead of a progress bar")


def _trim_metrics(path, keep_through_step: int) -> None:
    """Drop metric lines past the step a resumed run continues from (they will be written again)."""
    import json
    import os

    if not path.exists():
        return
    kept = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= keep_through_step]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)


def main(args: argparse.Namespace) -> int:
    import json
    import signal
    import sys
    import threading
    import time
    from pathlib import Path

    import torch
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from shoal.node.train.checkpoint import CheckpointError
    from shoal.node.cli.run import read_manifest
    from shoal.node.train.trainer import Trainer
    from shoal.protocol.errors import ProtocolError, SignatureError
    from shoal.protocol.manifest import RunManifest

    console = Console(stderr=True, soft_wrap=True)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.run:
        try:
            manifest = read_manifest(args.run)
            if manifest.signature:
                manifest.verify()
        except (OSError, ProtocolError) as e:
            kind = "signature" if isinstance(e, SignatureError) else "manifest"
            print(f"shoal train: {args.run}: bad {kind}: {e}", file=sys.stderr)
            return 2
    else:
        manifest = RunManifest.default(args.size)
    out = Path(args.out or f"runs/{manifest.run_id[:12]}")
    out.mkdir(parents=True, exist_ok=True)
    if not (out / "run.toml").exists():
        (out / "run.toml").write_text(manifest.to_toml())
    total = args.steps if args.steps is not None else manifest.optim.total_steps

    if manifest.plan.stages > 1:
        print(f"shoal train: the run has {manifest.plan.stages} pipeline stages; train it across nodes "
              f"(shoal node --run, or shoal swarm up --stages {manifest.plan.stages})", file=sys.stderr)
        return 2
    from shoal.node.train.device import DeviceUnavailable

    from shoal.node.cli.hfmodel import blob_store
    from shoal.node.run.preflight import check_inputs
    from shoal.node.train.data import load_run_corpus

    check_inputs(manifest, manifest.data.source)  # packages, the Hub: one line with the fix (exit 12)
    store = blob_store()
    files = {}
    for digest, _ in manifest.blobs():  # the run's weights and tokenizer: here, from `shoal run create`
        files[digest] = store.path(digest)
        if files[digest] is None:
            print(f"shoal train: the run names file {digest[:16]}… (its {'weights' if _ else 'tokenizer'}), which is "
                  f"not in {store.root}; train it where it was created, or join a node that holds it "
                  f"(shoal node --run)", file=sys.stderr)
            return 12
    try:
        corpus = load_run_corpus(manifest, manifest.data.source, files.get(manifest.data.tokenizer))
        weights = files.get(manifest.model.hf.weights) if manifest.model.hf is not None else None
        trainer = Trainer(manifest, device=args.device, corpus=corpus, weights=weights)
    except DeviceUnavailable:
        raise  # its own exit status (node/cli/errors.py)
    except ValueError as e:
        print(f"shoal train: {e}", file=sys.stderr)
        return 2
    try:
        resumed = trainer.resume(out)
    except CheckpointError as e:
        print(f"shoal train: cannot resume from {out}: {e}", file=sys.stderr)
        return 2
    metrics_path = out / "metrics.jsonl"
    _trim_metrics(metrics_path, resumed or 0)
    console.print(
        f"run {manifest.run_id[:12]}  {manifest.model.describe()} ({trainer.model.num_params() / 1e6:.2f}M params) on "
        f"{trainer.device}  data: {trainer.corpus.description}  out: {out}"
        + (f"  resumed at step {resumed}" if resumed is not None else "")
    )
    ckpt_every = manifest.checkpoint.every_steps
    last_saved = trainer.step_count
    progress = Progress(
        TextColumn("[bold]train"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]}  eval {task.fields[eval]}  {task.fields[tps]} tok/s"),
        TimeRemainingColumn(),
        console=console,
        disable=args.no_progress or not console.is_terminal,
    )
    plain = progress.disable
    t_start = time.perf_counter()
    # Ctrl+C finishes the step under way (a checkpoint mid-step would not resume exactly); a second one aborts
    stop = []
    previous_handler = signal.getsignal(signal.SIGINT)

    def on_sigint(signum, frame):
        if stop:
            raise KeyboardInterrupt
        stop.append(signum)
        console.print("stopping after this step (Ctrl+C again to abort without a checkpoint)")

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, on_sigint)
    try:
        with progress, metrics_path.open("a") as metrics:
            task = progress.add_task("train", total=total, completed=trainer.step_count, loss="-", eval="-", tps="-")
            while trainer.step_count < total:
                r = trainer.step()
                rec = {"step": r.step, "loss": r.loss, "lr": r.lr, "grad_norm": r.grad_norm,
                       "tokens_per_s": r.tokens_per_s, "applied": r.applied, "time": time.time()}
                if r.eval_loss is not None:
                    rec["eval_loss"] = r.eval_loss
                metrics.write(json.dumps(rec) + "\n")
                metrics.flush()
                ev = f"{trainer.last_eval_loss:.3f}" if trainer.last_eval_loss is not None else "-"
                progress.update(task, completed=r.step, loss=f"{r.loss:.3f}", eval=ev, tps=f"{r.tokens_per_s:,.0f}")
                if plain and (r.eval_loss is not None or r.step == total or r.step % 10 == 0):
                    console.print(f"step {r.step}/{total}  loss {r.loss:.4f}  eval {ev}  {r.tokens_per_s:,.0f} tok/s")
                if ckpt_every and r.step % ckpt_every == 0:
                    trainer.save(out)
                    last_saved = r.step
                if stop:
                    break
    except KeyboardInterrupt:
        console.print(f"aborted in step {trainer.step_count + 1}; the last checkpoint in {out} is step {last_saved}")
        return 130
    finally:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, previous_handler)
    if stop:
        if trainer.step_count != last_saved:
            trainer.save(out)
        console.print(f"stopped at step {trainer.step_count}; checkpoint saved in {out}")
        return 130
    if trainer.step_count != last_saved:
        trainer.save(out)
    secs = time.perf_counter() - t_start
    done = trainer.step_count - (resumed or 0)
    tps = done * trainer.tokens_per_step / secs if done else 0.0
    console.print(f"done: step {trainer.step_count}, loss {trainer.last.loss if trainer.last else float('nan'):.4f}, "
                  f"{tps:,.0f} tok/s over {done} steps; checkpoints in {out}")
    return 0
