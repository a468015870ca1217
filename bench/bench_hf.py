"""Benchmark (not a test): a Llama-style Hugging Face config against the built-in GPT of the same size, trained by
shoal's trainer on this machine at S = 1 and S = 2 (two stages in one process, joined by the in-process lane).

Both models: 4 layers, width 256, 4 heads, byte tokens (vocabulary 256), the same batches. The Llama's MLP is SwiGLU
of width 8/3 d (rounded up to 704), so each layer holds ~12 d^2 weights like the GPT's 4x GELU MLP: the same size.
Pairs are run alternately (GPT, Llama, GPT, Llama, ...) and each pair's tokens/s ratio is kept; the median of the
ratios is the result (a shared machine's load moves both members of a pair alike). Writes JSON and Markdown.

    python bench/bench_hf.py [--steps 30] [--pairs 3] [--threads 2] [--out bench/results]
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

from shoal.node.train.data import load_corpus
from shoal.node.train.hfimport import arch_config, config_text
from shoal.node.train.lane import LocalLane
from shoal.node.train.trainer import Trainer
from shoal.protocol import manifest as mf

REPO = Path(__file__).resolve().parents[1]

LAYERS, D, HEADS, SEQ = 4, 256, 4, 128


def manifest(kind: str, stages: int, steps: int) -> mf.RunManifest:
    if kind == "gpt":
        model = mf.ModelSpec(size="custom", n_layers=LAYERS, d_model=D, n_heads=HEADS)
    else:
        cfg = arch_config("llama", layers=LAYERS, d_model=D, heads=HEADS, vocab=256, max_positions=1024)
        model = mf.ModelSpec.from_hf(mf.HFModelSpec(config=config_text(cfg)))
    return mf.RunManifest(seed=1, model=model, batch=mf.BatchSpec(batch_size=16, micro_batch_size=16 // (4 * stages)
                                                                  if stages > 1 else 16, seq_len=SEQ),
                          plan=mf.ParallelPlan(stages=stages, pipeline=mf.PipelineSpec(compression="none")),
                          optim=mf.OptimSpec(total_steps=steps + 10, warmup_steps=5),
                          eval=mf.EvalSpec(every_steps=0, batches=1))


def run(kind: str, stages: int, steps: int, warmup: int, corpus) -> dict:
    m = manifest(kind, stages, steps + warmup)
    lane = LocalLane(stages, timeout_s=120) if stages > 1 else None
    trainers = [Trainer(m, stage=s, boundary=lane.boundary(s) if lane else None, corpus=corpus) for s in range(stages)]
    times: dict[int, float] = {}
    losses: list[float] = []

    def work(s: int) -> None:
        t = trainers[s]
        for _ in range(warmup):
            t.step()
        t0 = time.perf_counter()
        for _ in range(steps):
            r = t.step()
            if s == stages - 1:
                losses.append(r.loss)
        times[s] = time.perf_counter() - t0

    threads = [threading.Thread(target=work, args=(s,)) for s in range(stages)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    seconds = max(times.values())
    tokens = steps * m.batch.batch_size * m.batch.seq_len
    return {"kind": kind, "stages": stages, "params": sum(m.stage_params(s) for s in range(stages)),
            "seconds": round(seconds, 3), "tokens_per_s": round(tokens / seconds, 1), "last_loss": round(losses[-1], 4)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=30, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--pairs", type=int, default=3, help="alternating GPT/Llama pairs per plan")
    p.add_argument("--threads", type=int, default=2, help="torch threads (the machine's cores)")
    p.add_argument("--stages", default="1,2")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    p.add_argument("--name", default="hf_models")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    corpus = load_corpus("stdlib", 20)
    rows: list[dict] = []
    for stages in map(int, args.stages.split(",")):
        for pair in range(args.pairs):
            g = run("gpt", stages, args.steps, args.warmup, corpus)
            h = run("llama", stages, args.steps, args.warmup, corpus)
            rows += [{**g, "pair": pair}, {**h, "pair": pair}]
            print(json.dumps(rows[-2]), json.dumps(rows[-1]), flush=True)
            lines = write(args, rows)  # after every pair: a run stopped early keeps what it measured
    print("\n".join(lines))
    return 0


def write(args, rows: list[dict]) -> list[str]:
    summary = []
    for stages in sorted({r["stages"] for r in rows}):
        gp = [r for r in rows if r["stages"] == stages and r["kind"] == "gpt"]
        hp = [r for r in rows if r["stages"] == stages and r["kind"] == "llama"]
        ratios = [h["tokens_per_s"] / g["tokens_per_s"] for g, h in zip(gp, hp)]
        summary.append({"stages": stages, "gpt_params": gp[0]["params"], "llama_params": hp[0]["params"],
                        "gpt_tokens_per_s": statistics.median(r["tokens_per_s"] for r in gp),
                        "llama_tokens_per_s": statistics.median(r["tokens_per_s"] for r in hp),
                        "llama_vs_gpt_median": round(statistics.median(ratios), 3),
                        "ratios": [round(x, 3) for x in ratios]})
    command = " ".join(["python", "bench/bench_hf.py", *map(shlex.quote, sys.argv[1:])])
    doc = {"command": command, "torch": torch.__version__, "python": platform.python_version(),
           "threads": args.threads, "time": time.strftime("%Y-%m-%d"), "summary": summary, "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(doc, indent=1))
    lines = ["# A Hugging Face Llama config vs the built-in GPT of the same size (CPU)", "",
             f"Command: `{command}`; torch {doc['torch']}, Python {doc['python']}, {args.threads} threads, "
             f"{doc['time']}. 4 layers, d {D}, {HEADS} heads, byte tokens, seq {SEQ}, 16 sequences per step "
             f"(S = 2: 8 micro-batches through the in-process lane), fp32 on the CPU, {args.steps} timed steps "
             f"after {args.warmup}.", "",
             "| S | GPT params | Llama params | GPT tokens/s | Llama tokens/s | Llama / GPT (median of pairs) | pairs |",
             "|---:|---:|---:|---:|---:|---:|---|"]
    for s in summary:
        lines.append(f"| {s['stages']} | {s['gpt_params']:,} | {s['llama_params']:,} | {s['gpt_tokens_per_s']:,.0f} | "
                     f"{s['llama_tokens_per_s']:,.0f} | {s['llama_vs_gpt_median']:.2f} | "
                     f"{', '.join(f'{x:.2f}' for x in s['ratios'])} |")
    lines += ["", "Target: within 10 % (ratio >= 0.90). Pairs ran alternately so load on the shared machine moves "
              "both sides of a ratio alike; absolute tokens/s on a shared 2-core machine are noise.", ""]
    (args.out / f"{args.name}.md").write_text("\n".join(lines))
    return lines


if __name__ == "__main__":
    raise SystemExit(main())
