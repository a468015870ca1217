"""GPU benchmark (not a test): shoal's trainer against a bare compiled bf16 loop of the same model and batch.

For each model and size, loops train the same model shape on the same corpus batches on one CUDA device:
- bare: torch.compile'd model, bf16 autocast, fused AdamW, clip_grad_norm_, batches already on the device, no
  host sync inside the loop (the ceiling). For the built-in GPT the model is shoal's own module; for a Hugging Face
  Llama (`--models llama`) it is `transformers`' own `LlamaForCausalLM` (SDPA, no cache) of the same config;
- shoal: `Trainer.step()` as a node runs it, with its defaults (compiled model, fused AdamW, one host sync per
  step for the step's loss and gradient norm);
- shoal eager (GPT only): `Trainer.step()` with compile and the fused optimizer off (what shoal did before);
- shoal S=2 (Llama, `--hf-stages 2`): the same Llama split into two stages, one Trainer each (defaults: compiled,
  fused AdamW, bf16), joined by the in-process lane (two threads on the one device), GPipe with 4 micro-batches.
  Shown to run and its throughput recorded; it is not compared with a bare loop (one device runs both stages).
The Llama has the GPT preset's layers, width, heads and sequence length, byte tokens (vocabulary 256) and SwiGLU
of width 8/3 d rounded up to 64. Bare and shoal loops are built (and compiled) once, then timed alternately
`--rounds` times (tokens/s over the timed steps after the warm-up, CUDA events); the result is the median of the
rounds' shoal/bare ratios. `--budget-s`: no new case starts after that many seconds (results are written after
every case). `--device cpu --steps 2 --warmup 1 --sizes tiny` checks the script itself without a GPU (no bf16, no
fused AdamW there). Writes JSON and Markdown.

    python bench/bench_gpu_train.py [--models gpt,llama] [--sizes small,base] [--steps 30] [--out bench/results]
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import shlex
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

from shoal.node.train.data import Samples, ShardedSampler, load_corpus
from shoal.node.train.lane import LocalLane
from shoal.node.train.model import GPTConfig, build_stage, lm_loss
from shoal.node.train.trainer import ExecOptions, Trainer, build_optimizer
from shoal.protocol import manifest as mf

REPO = Path(__file__).resolve().parents[1]


def optim(steps: int) -> mf.OptimSpec:
    return mf.OptimSpec(total_steps=steps, warmup_steps=min(10, steps))


def manifest(size: str, steps: int) -> mf.RunManifest:
    m = mf.RunManifest.default(size)
    return mf.RunManifest.default(size, optim=optim(steps), eval=mf.EvalSpec(every_steps=0, batches=1), seed=m.seed)


def hf_manifest(size: str, steps: int, stages: int = 1) -> mf.RunManifest:
    """A Llama of the GPT preset's shape, byte tokens; S > 1: 4 micro-batches per step."""
    from shoal.node.train.hfimport import arch_config, config_text

    layers, d, heads, seq = mf.MODEL_PRESETS[size]
    cfg = arch_config("llama", layers=layers, d_model=d, heads=heads, vocab=256, max_positions=max(seq, 2048))
    model = mf.ModelSpec.from_hf(mf.HFModelSpec(config=config_text(cfg)))
    b = mf.BatchSpec(batch_size=16, micro_batch_size=4 if stages > 1 else 16, seq_len=seq)
    return mf.RunManifest(seed=1, model=model, batch=b, optim=optim(steps), eval=mf.EvalSpec(every_steps=0, batches=1),
                          plan=mf.ParallelPlan(stages=stages, pipeline=mf.PipelineSpec(compression="none")))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(run_step, warmup: int, steps: int, device: torch.device) -> float:
    """Seconds per step over `steps` steps after `warmup` untimed ones (CUDA events on a GPU)."""
    for _ in range(warmup):
        run_step()
    sync(device)
    if device.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(steps):
            run_step()
        return (time.perf_counter() - t0) / steps
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        run_step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1000 / steps


def bare_step(m: mf.RunManifest, corpus, device: torch.device):
    """One step function of the bare loop (model, optimizer, batches made here)."""
    b = m.batch
    cuda = device.type == "cuda"
    if m.model.hf is None:
        model = build_stage(GPTConfig.from_spec(m.model, b.seq_len), 0, 1, seed=m.seed).to(device)
        compiled = torch.compile(model)

        def logits(x):
            return compiled(x)
    else:
        import transformers

        from shoal.node.train.hf import hf_config

        torch.manual_seed(m.seed)
        model = transformers.AutoModelForCausalLM.from_config(hf_config(m.model.hf)).to(device)
        compiled = torch.compile(model)

        def logits(x):
            return compiled(input_ids=x, use_cache=False).logits
    opt = build_optimizer(model, m.optim, fused=cuda)
    samples = Samples(corpus.train, b.seq_len)
    sampler = ShardedSampler(samples.num_samples, seed=m.seed)
    M = b.batch_size // b.micro_batch_size
    batches = []
    for _ in range(8):
        x, y = samples.get(sampler.next_ids(b.batch_size))
        batches.append([(xm.to(device), ym.to(device)) for xm, ym in zip(x.split(b.micro_batch_size),
                                                                        y.split(b.micro_batch_size))])
    i = [0]
    last = [torch.zeros(())]

    def step():
        for x, y in batches[i[0] % len(batches)]:
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
                loss = lm_loss(logits(x), y) / M
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), m.optim.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        last[0] = loss.detach()
        i[0] += 1

    step.last_loss = lambda: float(last[0]) * M
    return step


def alternate(runners: dict, warmup: int, steps: int, rounds: int, device: torch.device) -> dict[str, list[float]]:
    """Seconds per step of each runner, `rounds` times, the runners taking turns (warm-up only in the first)."""
    out: dict[str, list[float]] = {k: [] for k in runners}
    for r in range(rounds):
        for name, fn in runners.items():
            out[name].append(timed(fn, warmup if r == 0 else 1, steps, device))
    return out


def gpt_case(size: str, corpus, args, device: torch.device) -> dict:
    m = manifest(size, args.warmup + args.rounds * (args.steps + 1) + 5)
    tokens = m.batch.batch_size * m.batch.seq_len
    t_bare = alternate({"bare": bare_step(m, corpus, device)}, args.warmup, args.steps, 1, device)["bare"][0]
    t = Trainer(m, device=device, corpus=corpus, options=ExecOptions())
    t_shoal = timed(t.step, args.warmup, args.steps, device)
    e = Trainer(m, device=device, corpus=corpus, options=ExecOptions(compile="off", fused="off"))
    t_eager = timed(e.step, args.warmup, args.steps, device)
    return {"model": "gpt", "size": size, "stages": 1, "params": m.stage_params(0), "tokens_per_step": tokens,
            "bare_tokens_per_s": round(tokens / t_bare), "shoal_tokens_per_s": round(tokens / t_shoal),
            "shoal_eager_tokens_per_s": round(tokens / t_eager), "shoal_compiled": t.compiled,
            "shoal_fused": t.fused, "shoal_vs_bare": round(t_bare / t_shoal, 3),
            "eager_vs_bare": round(t_bare / t_eager, 3)}


def llama_case(size: str, corpus, args, device: torch.device, options: ExecOptions) -> dict:
    m = hf_manifest(size, args.warmup + args.rounds * (args.steps + 1) + 5)
    tokens = m.batch.batch_size * m.batch.seq_len
    bare = bare_step(m, corpus, device)
    t = Trainer(m, device=device, corpus=corpus, options=options)
    first: list[float] = []
    latest: list = [None]

    def shoal():
        r = latest[0] = t.step()
        if not first:  # read now (a warm-up step): a result read many steps late may see a reused read-back buffer
            first.append(r.loss)

    secs = alternate({"bare": bare, "shoal": shoal}, args.warmup, args.steps, args.rounds, device)
    ratios = [b / s for b, s in zip(secs["bare"], secs["shoal"])]
    first, last = first[0], latest[0].loss
    return {"model": "llama", "size": size, "stages": 1, "params": m.stage_params(0), "tokens_per_step": tokens,
            "bare_tokens_per_s": round(tokens / statistics.median(secs["bare"])),
            "shoal_tokens_per_s": round(tokens / statistics.median(secs["shoal"])),
            "shoal_vs_bare": round(statistics.median(ratios), 3), "ratios": [round(x, 3) for x in ratios],
            "shoal_compiled": t.compiled, "shoal_fused": t.fused, "shoal_autocast": str(t.autocast_dtype),
            "shoal_loss_first": round(first, 4), "shoal_loss_last": round(last, 4),
            "bare_loss_last": round(bare.last_loss(), 4)}


def llama_stages(size: str, stages: int, corpus, args, device: torch.device, options: ExecOptions) -> dict:
    """S stages of one Llama on the one device, a thread each, joined by the in-process lane."""
    m = hf_manifest(size, args.warmup + args.steps + 5, stages)
    lane = LocalLane(stages, timeout_s=900)  # the first steps wait for the other stage's compilation
    trainers = [Trainer(m, device=device, stage=s, boundary=lane.boundary(s), corpus=corpus, options=options)
                for s in range(stages)]
    barrier = threading.Barrier(stages)
    seconds: dict[int, float] = {}
    losses: list[float] = []
    errors: list[str] = []

    def work(s: int) -> None:
        t = trainers[s]
        try:
            for _ in range(args.warmup):
                r = t.step()
                if s == stages - 1:
                    losses.append(r.loss)
            sync(device)
            barrier.wait()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                r = t.step()
                if s == stages - 1:
                    losses.append(r.loss)
            sync(device)
            seconds[s] = time.perf_counter() - t0
        except Exception as e:  # noqa: BLE001 - reported in the results
            errors.append(f"stage {s}: {type(e).__name__}: {e}"[:500])
            barrier.abort()

    threads = [threading.Thread(target=work, args=(s,)) for s in range(stages)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    tokens = m.batch.batch_size * m.batch.seq_len
    row = {"model": "llama", "size": size, "stages": stages, "params": sum(m.stage_params(s) for s in range(stages)),
           "tokens_per_step": tokens, "micro_batches": m.batch.batch_size // m.batch.micro_batch_size,
           "shoal_compiled": [t.compiled for t in trainers], "shoal_fused": [t.fused for t in trainers],
           "shoal_autocast": [str(t.autocast_dtype) for t in trainers], "errors": errors}
    if not errors:
        finite = [x for x in losses if x is not None and math.isfinite(x)]
        row |= {"shoal_tokens_per_s": round(tokens * args.steps / max(seconds.values())),
                "loss_first": round(losses[0], 4), "loss_last": round(losses[-1], 4),
                "losses_finite": len(finite) == len(losses), "steps": len(losses)}
    return row


def write(args, device: torch.device, rows: list[dict], skipped: list[str]) -> None:
    command = " ".join(["python", "bench/bench_gpu_train.py", *map(shlex.quote, sys.argv[1:])])
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    doc = {"command": command, "device": name, "torch": torch.__version__, "python": platform.python_version(),
           "time": time.strftime("%Y-%m-%d"), "rows": rows, "skipped": skipped}
    try:
        import transformers
        doc["transformers"] = transformers.__version__
    except ImportError:
        pass
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(doc, indent=1))
    lines = ["# shoal trainer vs a bare compiled bf16 loop", "", f"Command: `{command}` on {doc['device']}, torch "
             f"{doc['torch']}, Python {doc['python']}" + (f", transformers {doc['transformers']}" if "transformers"
                                                        in doc else "") + f" ({doc['time']}).", ""]
    gpt = [r for r in rows if r["model"] == "gpt"]
    if gpt:
        lines += ["| size | tokens/step | bare (compiled, fused, no sync) | shoal | shoal / bare | shoal eager | "
                  "eager / bare |", "|---|---:|---:|---:|---:|---:|---:|"]
        for r in gpt:
            lines.append(f"| {r['size']} | {r['tokens_per_step']:,} | {r['bare_tokens_per_s']:,} | "
                         f"{r['shoal_tokens_per_s']:,} | {r['shoal_vs_bare']:.2f} | {r['shoal_eager_tokens_per_s']:,}"
                         f" | {r['eager_vs_bare']:.2f} |")
        lines += ["", "bare: the same model under torch.compile, bf16 autocast, fused AdamW, gradient clipping, "
                  "batches already on the GPU, no host sync. shoal: Trainer.step() with its defaults (compiled, fused "
                  "AdamW, a non-finite step skipped on the device, loss and gradient norm read back asynchronously, "
                  "the next batch staged through pinned buffers; batches come from its sampler). shoal eager: compile "
                  "and fusion off.", ""]
    one = [r for r in rows if r["model"] == "llama" and r["stages"] == 1]
    if one:
        lines += ["## Hugging Face Llama: shoal's trainer vs a bare compiled `transformers` loop", "",
                  "| size | params | tokens/step | bare LlamaForCausalLM | shoal (HF stage) | shoal / bare (median) | "
                  "rounds | shoal compiled / fused / autocast | loss first -> last |",
                  "|---|---:|---:|---:|---:|---:|---|---|---|"]
        for r in one:
            lines.append(f"| {r['size']} | {r['params']:,} | {r['tokens_per_step']:,} | {r['bare_tokens_per_s']:,} | "
                         f"{r['shoal_tokens_per_s']:,} | {r['shoal_vs_bare']:.3f} | "
                         f"{', '.join(f'{x:.3f}' for x in r['ratios'])} | {r['shoal_compiled']} / {r['shoal_fused']}"
                         f" / {r['shoal_autocast']} | {r['shoal_loss_first']} -> {r['shoal_loss_last']} |")
        lines += ["", "bare: `transformers`' LlamaForCausalLM of the same config (SDPA, no cache), torch.compile, bf16 "
                  "autocast, fused AdamW, clipping, batches on the GPU, no host sync. shoal: Trainer.step() on the "
                  "manifest's HF stage (the library's modules) with its defaults. The two loops take turns each "
                  "round after one warm-up; target shoal / bare >= 0.95.", ""]
    split = [r for r in rows if r["model"] == "llama" and r["stages"] > 1]
    if split:
        lines += ["## Hugging Face Llama split into stages (one device, in-process lane)", "",
                  "| size | S | micro-batches | tokens/s | compiled | fused | autocast | loss first -> last | "
                  "all finite | errors |", "|---|---:|---:|---:|---|---|---|---|---|---|"]
        for r in split:
            lines.append(f"| {r['size']} | {r['stages']} | {r['micro_batches']} | {r.get('shoal_tokens_per_s', '-')} "
                         f"| {r['shoal_compiled']} | {r['shoal_fused']} | {r['shoal_autocast']} | "
                         f"{r.get('loss_first', '-')} -> {r.get('loss_last', '-')} | {r.get('losses_finite', '-')} | "
                         f"{'; '.join(r['errors']) or 'none'} |")
        lines += [""]
    if skipped:
        lines += [f"Not run (time budget of {args.budget_s:.0f} s spent): {', '.join(skipped)}.", ""]
    (args.out / f"{args.name}.md").write_text("\n".join(lines))


def main() -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    p.add_argument("--models", default="gpt", help="gpt and/or llama (a Hugging Face Llama of the same shape)")
    p.add_argument("--sizes", default="small,base")
    p.add_argument("--steps", type=int, default=30, help="timed steps per loop (per round)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (compilation happens here)")
    p.add_argument("--rounds", type=int, default=3, help="Llama: turns of bare and shoal after the warm-up")
    p.add_argument("--hf-stages", type=int, default=0, help="Llama: also run it split into this many stages")
    p.add_argument("--budget-s", type=float, default=math.inf, help="start no case after this many seconds")
    p.add_argument("--device", default="cuda", help="cuda, or cpu to check the script itself")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    p.add_argument("--name", default="gpu_train")
    args = p.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench_gpu_train: no CUDA device", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = True
    corpus = load_corpus("stdlib", 20)
    options = ExecOptions() if device.type == "cuda" else ExecOptions(compile="on")
    cases = []
    for size in args.sizes.split(","):
        for model in args.models.split(","):
            if model == "gpt":
                cases.append((f"gpt {size}", lambda size=size: gpt_case(size, corpus, args, device)))
            elif model == "llama":
                cases.append((f"llama {size}", lambda size=size: llama_case(size, corpus, args, device, options)))
                if args.hf_stages > 1:
                    cases.append((f"llama {size} S={args.hf_stages}", lambda size=size: llama_stages(
                        size, args.hf_stages, corpus, args, device, options)))
            else:
                p.error(f"--models: gpt or llama, not {model!r}")
    t0, rows, skipped = time.monotonic(), [], []
    for name, case in cases:
        if time.monotonic() - t0 > args.budget_s:
            skipped.append(name)
            continue
        c0 = time.monotonic()
        rows.append(case() | {"case_seconds": round(time.monotonic() - c0, 1)})
        print(json.dumps(rows[-1]), flush=True)
        write(args, device, rows, skipped)
    write(args, device, rows, skipped)
    return 0


if __name__ == "__main__":
    sys.exit(main())
