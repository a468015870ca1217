"""The host's time per `Trainer.step()` taken apart (GPU check, not a test): what shoal's trainer does on the CPU
each step beyond what a bare compiled loop does, on the model of bench/bench_gpu_train.py's Llama case.

1. Each per-step piece of host work timed alone on this machine (median of many calls, microseconds): the model's
   `train()` call, the sampler's ids, the corpus gather, the pinned staging of a batch, the list of parameters with
   gradients, the loss/norm read-back, a StepControl's stages.
2. The whole step's host time with an empty queue (synchronize, call, time until it returns, synchronize; median of
   `--steps`) with the trainer as it is, then with pieces replaced by cached results one after another on the same
   trainer (nothing recompiled): what removing each would save.
Writes NAME.json into --out.

    python bench/gpu_checks/trainer_host_breakdown.py --size small --out OUT
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_gpu_train as bg  # noqa: E402

from shoal.node.train.control import StepControl, StepStage  # noqa: E402
from shoal.node.train.data import load_corpus  # noqa: E402
from shoal.node.train.trainer import ExecOptions, Trainer  # noqa: E402


def micro_us(fn, n: int = 300) -> float:
    fn()
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return round(statistics.median(out) * 1e6, 1)


def host_ms(t: Trainer, steps: int, device: torch.device) -> float:
    out = []
    for _ in range(steps):
        bg.sync(device)
        t0 = time.perf_counter()
        t.step()
        out.append(time.perf_counter() - t0)
        bg.sync(device)
    return round(statistics.median(out) * 1e3, 3)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama", choices=("llama", "gpt"))
    ap.add_argument("--size", default="small")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    ap.add_argument("--name", default="trainer_host_breakdown")
    args = ap.parse_args()
    device = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = True
    corpus = load_corpus("stdlib", 20)
    m = bg.hf_manifest(args.size, 10 * args.steps + 50) if args.model == "llama" else bg.manifest(args.size,
                                                                                                  10 * args.steps + 50)
    t = Trainer(m, device=device, corpus=corpus, options=ExecOptions())
    for _ in range(3):
        t.step()
    bg.sync(device)
    b = m.batch
    ids = t.sampler.ids_at(t.sampler.position, b.batch_size)
    x, y = t.train_samples.get(ids)
    pieces = {
        "model.train()": lambda: t.model.train(),
        "sampler.ids_at": lambda: t.sampler.ids_at(t.sampler.position, b.batch_size),
        "samples.get": lambda: t.train_samples.get(ids),
        "micro_batches (gather + staging)": lambda: t._micro_batches(ids, t.train_samples),
        "params with grads": lambda: [p for p in t.model.parameters() if p.grad is not None],
        "StepControl stages": lambda: [StepControl(step=0).advance(s) for s in (StepStage.COMPUTE, StepStage.SYNC,
                                                                                 StepStage.DONE)],
    }
    loss = torch.zeros((), device=device)
    pieces["read-back (queue only)"] = lambda: t._read_back(0, loss, loss)
    res: dict = {"command": " ".join(["python", "bench/gpu_checks/trainer_host_breakdown.py", *sys.argv[1:]]),
                 "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                 "torch": torch.__version__, "model": args.model, "size": args.size,
                 "modules": sum(1 for _ in t.model.modules()), "params": sum(1 for _ in t.model.parameters()),
                 "piece_us": {k: micro_us(f) for k, f in pieces.items()}}
    print(json.dumps(res), flush=True)
    variants = {}
    variants["trainer as it is"] = host_ms(t, args.steps, device)
    t.model.train = lambda mode=True: t.model  # the model stays in training mode: evaluate() is never due here
    variants["+ no model.train() per step"] = host_ms(t, args.steps, device)
    cached = t.sampler.ids_at(t.sampler.position, b.batch_size)
    t.sampler.ids_at = lambda first, n: cached
    variants["+ ids cached"] = host_ms(t, args.steps, device)
    xy = t.train_samples.get(cached)
    t.train_samples.get = lambda ids: xy
    variants["+ gather cached"] = host_ms(t, args.steps, device)
    res["step_host_ms"] = variants
    print(json.dumps(variants), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
