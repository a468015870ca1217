"""What writing checkpoints costs training: the step time with a checkpoint every 10 steps against none, in the
same run (one trainer, segments alternating), written the way a swarm node writes them: the state copied between
steps on the trainer's thread (as the runtime's snapshot), then serialised, hashed and written by the checkpoint
writer in a worker thread of its own while the next steps run.

Run: python bench/bench_checkpoint.py [--layers 4] [--d-model 256] [--segments 6] [--steps 40]
Writes checkpoint_overhead.json and .md (with this command) into --out (default bench/results).
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import trio

from shoal.node.run.checkpoints import CheckpointMeta, CheckpointWriter
from shoal.node.train.control import StepControl
from shoal.node.train.trainer import Trainer
from shoal.protocol import manifest as mf
from shoal.swarm.state.snapshot import Snapshot


async def run(args) -> dict:
    m = mf.RunManifest(seed=1, model=mf.ModelSpec(size="custom", n_layers=args.layers, d_model=args.d_model,
                                                    n_heads=8),
                       batch=mf.BatchSpec(batch_size=args.batch, micro_batch_size=args.batch, seq_len=128),
                       optim=mf.OptimSpec(total_steps=100_000, warmup_steps=10), eval=mf.EvalSpec(every_steps=0),
                       checkpoint=mf.CheckpointSpec(every_steps=args.every, keep_last=2))
    trainer = Trainer(m)
    segments = []
    with tempfile.TemporaryDirectory() as d:
        writer = CheckpointWriter(Path(d), m)
        async with trio.open_nursery() as n:
            await n.start(writer.run)
            for _ in range(3):  # warm-up steps
                await trio.to_thread.run_sync(trainer.step)
            for seg in range(args.segments):
                with_ckpt = seg % 2 == 1
                times = []
                for _ in range(args.steps):
                    t0 = time.perf_counter()
                    step = trainer.step_count
                    if with_ckpt and step % args.every == 0:
                        control = StepControl(step=step)
                        state = await trio.to_thread.run_sync(trainer.whole_state, control)
                        snap = Snapshot.of(state, step, copy=False, hashed=False)
                        writer.offer(snap, CheckpointMeta(run_id=m.run_id, stage=0, replica=0, step=step,
                                                          peer_id="bench", state_hash=""))
                    await trio.to_thread.run_sync(trainer.step)
                    times.append(time.perf_counter() - t0)
                segments.append({"checkpoints": with_ckpt, "step_s": statistics.mean(times),
                                 "steps": len(times)})
                print(json.dumps(segments[-1]), flush=True)
            await writer.flush()
            n.cancel_scope.cancel()
        written = writer.written
    on = [s["step_s"] for s in segments if s["checkpoints"]]
    off = [s["step_s"] for s in segments if not s["checkpoints"]]
    return {"segments": segments, "with_s": statistics.mean(on), "without_s": statistics.mean(off),
            "slowdown": statistics.mean(on) / statistics.mean(off) - 1, "writes": written,
            "params": sum(p.numel() for p in trainer.model.parameters())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--segments", type=int, default=6)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    cmd = "python bench/bench_checkpoint.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    res = trio.run(run, args) | {"command": cmd}
    w = res["writes"][-1]
    md = (f"# Checkpoint writes vs step time\n\n`{cmd}`\n\n"
          f"{res['params']:,}-parameter model (AdamW), one trainer; segments of {args.steps} steps alternate between "
          f"a checkpoint every {args.every} steps and none.\n\n| segment | checkpoints | mean step (s) |\n|---|---|---|\n"
          + "\n".join(f"| {i} | {'every ' + str(args.every) if s['checkpoints'] else 'none'} | {s['step_s']:.4f} |"
                      for i, s in enumerate(res["segments"]))
          + f"\n\nwith checkpoints {res['with_s']:.4f} s/step, without {res['without_s']:.4f} s/step: "
            f"{100 * res['slowdown']:+.2f} % (target <= 3 %); each checkpoint {w['bytes'] / 1e6:.1f} MB written in "
            f"{w['seconds']} s by the writer thread.\n")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "checkpoint_overhead.json").write_text(json.dumps(res, indent=1))
    (args.out / "checkpoint_overhead.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
