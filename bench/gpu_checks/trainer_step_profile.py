"""Where shoal's trainer spends its per-step time against a bare compiled loop (GPU check, not a test).

The case of bench/bench_gpu_train.py (`--models llama|gpt --sizes small`): shoal's `Trainer.step()` with its defaults
and the bare compiled bf16 loop of the same model and batches, built once, then:
- timed alternately (`--rounds` rounds of `--steps` steps, CUDA events; the ratio per round, as the benchmark does,
  but the order flips every round);
- per step with an empty queue (synchronize, call, note the host time until the call returns, synchronize): the
  host's launch cost of one step against the GPU's time for it;
- free-running (no synchronize): how long each call takes on the host, which shows a call that waits for the GPU;
- torch.profiler over `--profile-steps` steps of each: the host operations that cost most, the synchronizing CUDA
  calls (cudaStreamSynchronize, cudaEventSynchronize, cudaDeviceSynchronize, cudaMemcpy) and the GPU's busy time
  (the sum of its kernels' and copies' durations) against the wall time;
- the number of graphs torch.compile made and its graph breaks.
Writes NAME.json and NAME.txt (the profiler's tables) into --out.

    python bench/gpu_checks/trainer_step_profile.py --model llama --size small --out OUT
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
import bench_gpu_train as bg  # noqa: E402 - the benchmark's own model, manifests and bare loop

from shoal.node.train.data import load_corpus  # noqa: E402
from shoal.node.train.trainer import ExecOptions, Trainer  # noqa: E402

DEVICE = torch.device("cuda")


def SYNC() -> None:
    bg.sync(DEVICE)


SYNC_CALLS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize", "cudaMemcpy ",
              "cudaMemcpy", "aten::_local_scalar_dense", "aten::item")


def alternate(loops: dict, warmup: int, steps: int, rounds: int, device: torch.device) -> dict[str, list[float]]:
    """Seconds per step of each loop, `rounds` times, taking turns; the order flips every round (A B, B A, ...) so
    that neither loop always runs right after the other."""
    out: dict[str, list[float]] = {k: [] for k in loops}
    names = list(loops)
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            out[name].append(bg.timed(loops[name], warmup if r == 0 else 1, steps, device))
    return out


def per_step(fn, steps: int) -> dict:
    """Host seconds to issue one step with an empty queue, and the step's whole time (host + GPU)."""
    host, whole = [], []
    for _ in range(steps):
        SYNC()
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        SYNC()
        host.append(t1 - t0)
        whole.append(time.perf_counter() - t0)
    return {"host_ms": round(statistics.median(host) * 1e3, 3), "whole_ms": round(statistics.median(whole) * 1e3, 3)}


def free_running(fn, steps: int) -> dict:
    """Host seconds of each call when the calls follow one another with no synchronize."""
    SYNC()
    calls = []
    t_all = time.perf_counter()
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        calls.append(time.perf_counter() - t0)
    issued = time.perf_counter() - t_all
    SYNC()
    done = time.perf_counter() - t_all
    calls_ms = sorted(x * 1e3 for x in calls)
    return {"call_ms_median": round(statistics.median(calls_ms), 3), "call_ms_max": round(calls_ms[-1], 3),
            "call_ms_p90": round(calls_ms[int(0.9 * (len(calls_ms) - 1))], 3),
            "issued_s": round(issued, 4), "done_s": round(done, 4)}


def profile(fn, steps: int, label: str, text: list[str]) -> dict:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile

    SYNC()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEVICE.type == "cuda" else [])
    with tprofile(activities=acts) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            fn()
        SYNC()
        wall = time.perf_counter() - t0
    ka = prof.key_averages()
    text += [f"## {label}: top host operations by self CPU time ({steps} steps)",
             ka.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=70), "",
             f"## {label}: top by device time", ka.table(sort_by="self_device_time_total", row_limit=15,
                                                          max_name_column_width=70), ""]
    syncs = {e.key: {"count": e.count, "cpu_ms": round(e.cpu_time_total / 1e3, 3)} for e in ka
             if any(e.key.startswith(s.strip()) for s in SYNC_CALLS)}
    gpu_us = 0.0
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            gpu_us += ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
    launches = sum(e.count for e in ka if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC",
                                                    "cuLaunchKernelEx"))
    return {"wall_ms_per_step": round(wall / steps * 1e3, 3), "gpu_busy_ms_per_step": round(gpu_us / 1e3 / steps, 3),
            "gpu_busy_fraction": round(gpu_us / 1e6 / wall, 3), "sync_calls": syncs,
            "kernel_launches_per_step": round(launches / steps, 1),
            "host_ops_per_step": round(sum(e.count for e in ka if e.device_type == torch.autograd.DeviceType.CPU
                                           ) / steps, 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama", choices=("llama", "gpt"))
    ap.add_argument("--size", default="small")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--profile-steps", type=int, default=10)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    ap.add_argument("--name", default="trainer_step_profile")
    args = ap.parse_args()
    global DEVICE
    device = DEVICE = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = True
    corpus = load_corpus("stdlib", 20)
    total = args.warmup + args.rounds * (args.steps + 1) + 3 * args.steps + 2 * args.profile_steps + 20
    m = bg.hf_manifest(args.size, total) if args.model == "llama" else bg.manifest(args.size, total)
    bare = bg.bare_step(m, corpus, device)
    t = Trainer(m, device=device, corpus=corpus, options=ExecOptions())

    def shoal():
        t.step()

    loops = {"bare": bare, "shoal": shoal}
    t0 = time.perf_counter()
    secs = alternate(loops, args.warmup, args.steps, args.rounds, device)
    tokens = m.batch.batch_size * m.batch.seq_len
    res: dict = {"command": " ".join(["python", "bench/gpu_checks/trainer_step_profile.py", *sys.argv[1:]]),
                 "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "torch": torch.__version__,
                 "model": args.model, "size": args.size, "tokens_per_step": tokens,
                 "shoal_compiled": t.compiled, "shoal_fused": t.fused, "shoal_autocast": str(t.autocast_dtype),
                 "step_ms": {k: [round(x * 1e3, 3) for x in v] for k, v in secs.items()},
                 "ratios": [round(b / s, 3) for b, s in zip(secs["bare"], secs["shoal"])]}
    res["shoal_vs_bare_median"] = round(statistics.median(res["ratios"]), 3)
    res["timing_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(res), flush=True)
    for k, fn in loops.items():
        res[f"{k}_per_step"] = per_step(fn, args.steps // 2)
        res[f"{k}_free_running"] = free_running(fn, args.steps)
        print(k, res[f"{k}_per_step"], res[f"{k}_free_running"], flush=True)
    text: list[str] = []
    for k, fn in loops.items():
        res[f"{k}_profile"] = profile(fn, args.profile_steps, k, text)
        print(k, json.dumps(res[f"{k}_profile"]), flush=True)
    try:
        from torch._dynamo.utils import counters
        res["dynamo"] = {"graph_breaks": {str(k): v for k, v in counters["graph_break"].items()},
                         "unique_graphs": counters["stats"].get("unique_graphs"),
                         "calls_captured": counters["stats"].get("calls_captured")}
    except Exception as e:  # noqa: BLE001 - reported
        res["dynamo"] = f"{type(e).__name__}: {e}"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(res, indent=1))
    (args.out / f"{args.name}.txt").write_text("\n".join(text))
    print(json.dumps(res.get("dynamo")), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
