"""GPU benchmark (not a test): shoal's trainer against a bare compiled bf16 loop of the same model and batch.

For each model size, three loops train the same GPT on the same corpus batches on one CUDA device:
- bare: torch.compile'd model, bf16 autocast, fused AdamW, clip_grad_norm_, batches already on the device, no
  host sync inside the loop (the ceiling);
- shoal: `Trainer.step()` as a node runs it, with its defaults (compiled model, fused AdamW, one host sync per
  step for the step's loss and gradient norm);
- shoal eager: `Trainer.step()` with compile and the fused optimizer off (what shoal did before).
Tokens/s are measured over the timed steps after the warm-up (compilation) with CUDA events; the ratios to
`bare` are the result. Writes JSON and Markdown.

    python bench/bench_gpu_train.py [--sizes small,base] [--steps 30] [--out bench/results]
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import sys
import time
from pathlib import Path

import torch

from shoal.node.train.data import Samples, ShardedSampler, load_corpus
from shoal.node.train.model import GPTConfig, build_stage, lm_loss
from shoal.node.train.trainer import ExecOptions, Trainer, build_optimizer
from shoal.protocol.manifest import EvalSpec, OptimSpec, RunManifest

REPO = Path(__file__).resolve().parents[1]


def manifest(size: str, steps: int) -> RunManifest:
    m = RunManifest.default(size)
    return RunManifest.default(size, optim=OptimSpec(total_steps=steps, warmup_steps=min(10, steps)),
                               eval=EvalSpec(every_steps=0, batches=1), seed=m.seed)


def timed(run_step, warmup: int, steps: int) -> float:
    """Seconds per step over `steps` steps after `warmup` untimed ones (CUDA events)."""
    for _ in range(warmup):
        run_step()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        run_step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1000 / steps


def bare(m: RunManifest, corpus, warmup: int, steps: int) -> float:
    b = m.batch
    cfg = GPTConfig.from_spec(m.model, b.seq_len)
    model = build_stage(cfg, 0, 1, seed=m.seed).cuda()
    opt = build_optimizer(model, m.optim, fused=True)
    fwd = torch.compile(model)
    samples = Samples(corpus.train, b.seq_len)
    sampler = ShardedSampler(samples.num_samples, seed=m.seed)
    M = b.batch_size // b.micro_batch_size
    batches = []
    for _ in range(8):
        x, y = samples.get(sampler.next_ids(b.batch_size))
        batches.append([(xm.cuda(), ym.cuda()) for xm, ym in zip(x.split(b.micro_batch_size),
                                                                y.split(b.micro_batch_size))])
    i = [0]

    def step():
        for x, y in batches[i[0] % len(batches)]:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = lm_loss(fwd(x), y) / M
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), m.optim.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        i[0] += 1

    return timed(step, warmup, steps)


def shoal(m: RunManifest, corpus, warmup: int, steps: int, options: ExecOptions) -> tuple[float, bool]:
    t = Trainer(m, device="cuda", corpus=corpus, options=options)
    return timed(t.step, warmup, steps), t.compiled


def main() -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="small,base")
    p.add_argument("--steps", type=int, default=30, help="timed steps per loop")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (compilation happens here)")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    p.add_argument("--name", default="gpu_train")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("bench_gpu_train: no CUDA device", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = True
    corpus = load_corpus("stdlib", 20)
    rows = []
    for size in args.sizes.split(","):
        m = manifest(size, args.warmup + args.steps + 5)
        tokens = m.batch.batch_size * m.batch.seq_len
        t_bare = bare(m, corpus, args.warmup, args.steps)
        t_shoal, compiled = shoal(m, corpus, args.warmup, args.steps, ExecOptions())
        t_eager, _ = shoal(m, corpus, args.warmup, args.steps, ExecOptions(compile="off", fused="off"))
        rows.append({"size": size, "params": m.stage_params(0), "tokens_per_step": tokens,
                     "bare_tokens_per_s": round(tokens / t_bare), "shoal_tokens_per_s": round(tokens / t_shoal),
                     "shoal_eager_tokens_per_s": round(tokens / t_eager), "shoal_compiled": compiled,
                     "shoal_vs_bare": round(t_bare / t_shoal, 3), "eager_vs_bare": round(t_bare / t_eager, 3)})
        print(json.dumps(rows[-1]), flush=True)
    command = " ".join(["python", "bench/bench_gpu_train.py", *map(shlex.quote, sys.argv[1:])])
    doc = {"command": command, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "python": platform.python_version(), "time": time.strftime("%Y-%m-%d"), "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(doc, indent=1))
    lines = ["# shoal trainer vs a bare compiled bf16 loop", "", f"Command: `{command}` on {doc['device']}, torch "
             f"{doc['torch']}, Python {doc['python']} ({doc['time']}).", "",
             "| size | tokens/step | bare (compiled, fused, no sync) | shoal | shoal / bare | shoal eager | eager / bare |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['size']} | {r['tokens_per_step']:,} | {r['bare_tokens_per_s']:,} | {r['shoal_tokens_per_s']:,}"
                     f" | {r['shoal_vs_bare']:.2f} | {r['shoal_eager_tokens_per_s']:,} | {r['eager_vs_bare']:.2f} |")
    lines += ["", "bare: the same model under torch.compile, bf16 autocast, fused AdamW, gradient clipping, batches "
              "already on the GPU, no host sync. shoal: Trainer.step() with its defaults (compiled, fused AdamW, "
              "a non-finite step skipped on the device, loss and gradient norm read back asynchronously, the next "
              "batch staged through pinned buffers; batches come from its sampler). shoal eager: compile and "
              "fusion off.", ""]
    (args.out / f"{args.name}.md").write_text("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
