"""What writing checkpoints costs training: the step time with a checkpoint every 10 steps against none, in the
same run (one trainer, segments alternating), written the way a swarm node writes them: the state copied between
steps on the trainer's thread (as the runtime's snapshot), then serialised, hashed and written by the checkpoint
writer in a worker thread of its own while the next steps run.

Run: python bench/bench_checkpoint.py [--layers 4] [--d-model 256] [--segments 6] [--steps 40] [--order abba]
Writes checkpoint_overhead.json and .md (with this command) into --out (default bench/results; --name renames them).

--order alternate (A B A B ...) or abba (A B B A, A B B A, ...): in each ABBA block a drift of the machine's speed
that is linear over the block weighs on both sides alike, so the block's ratio (B1 + B2) / (A1 + A2) measures the
checkpoints and not the drift; the median over blocks is reported.
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
                with_ckpt = seg % 2 == 1 if args.order == "alternate" else seg % 4 in (1, 2)
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
    t = [s["step_s"] for s in segments]
    blocks = [(t[i + 1] + t[i + 2]) / (t[i] + t[i + 3]) for i in range(0, len(t) - 3, 4)] \
        if args.order == "abba" else [t[i + 1] / t[i] for i in range(0, len(t) - 1, 2)]
    return {"segments": segments, "with_s": statistics.mean(on), "without_s": statistics.mean(off),
            "slowdown": statistics.mean(on) / statistics.mean(off) - 1, "writes": written,
            "order": args.order, "pair_ratios": blocks, "median_ratio": statistics.median(blocks),
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
    p.add_argument("--order", choices=("alternate", "abba"), default="alternate",
                   help="segment order: A B A B, or A B B A blocks that cancel a linear drift (see above)")
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    p.add_argument("--name", default="checkpoint_overhead", help="the results' file name, without .json/.md")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    cmd = "python bench/bench_checkpoint.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    res = trio.run(run, args) | {"command": cmd}
    w = res["writes"][-1]
    md = (f"# Checkpoint writes vs step time\n\n`{cmd}`\n\n"
          f"{res['params']:,}-parameter model (AdamW), one trainer; segments of {args.steps} steps alternate between "
          f"a checkpoint every {args.every} steps and none"
          f"{' in A B B A blocks (A: none)' if args.order == 'abba' else ''}.\n\n| segment | checkpoints | mean step (s) |\n|---|---|---|\n"
          + "\n".join(f"| {i} | {'every ' + str(args.every) if s['checkpoints'] else 'none'} | {s['step_s']:.4f} |"
                      for i, s in enumerate(res["segments"]))
          + f"\n\nwith checkpoints {res['with_s']:.4f} s/step, without {res['without_s']:.4f} s/step: "
            f"{100 * res['slowdown']:+.2f} % (target <= 3 %); each checkpoint {w['bytes'] / 1e6:.1f} MB written in "
            f"{w['seconds']} s by the writer thread.\n\n"
            f"{'ABBA block ratios (B1 + B2) / (A1 + A2)' if args.order == 'abba' else 'adjacent pair ratios B / A'}: "
            + ", ".join(f"{r:.3f}" for r in res["pair_ratios"])
            + f"; median **{res['median_ratio']:.3f} ({100 * (res['median_ratio'] - 1):+.1f} %)** (target <= 3 %).\n")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(res, indent=1))
    (args.out / f"{args.name}.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
