"""GPU kernels: the Triton quantize/pack and unpack/dequantize fast path against the torch reference on the same GPU
and against a device-to-device copy (the memory-bandwidth limit), with CocktailSGD's compressor; ratios in one run.

    python bench/bench_gpu_kernels.py [--numel 67108864] [--repeats 20] [--out bench/results]

Writes gpu_kernels.json and gpu_kernels.md. GB/s counts the fp32 input bytes read (as `shoal bench codecs` does);
the copy row counts the same bytes, so "x copy" is the share of the bandwidth limit the kernel reaches.
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import statistics
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def timed(fn, repeats: int) -> float:
    """Median seconds of `fn()` over `repeats` runs after two warm-ups, timed with CUDA events."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--numel", type=int, default=1 << 26, help="float32 values in the input (default 64M)")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_gpu_kernels: no CUDA device", file=sys.stderr)
        return 2
    from shoal.kernels import fastpath
    from shoal.kernels.cocktail import CocktailCompressor, CocktailConfig
    from shoal.kernels.quant import dequantize_bucketed_ref, quantize_bucketed_ref

    n = args.numel
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(n, device="cuda", generator=g) / (torch.rand(n, device="cuda", generator=g) + 0.05)
    out = torch.empty_like(x)
    rows = []

    def row(name: str, fn) -> None:
        s = timed(fn, args.repeats)
        rows.append({"kernel": name, "seconds": s, "gbps": n * 4 / s / 1e9})

    row("device copy (limit)", lambda: out.copy_(x))
    for bits in (2, 4, 8):
        q = fastpath.quantize_bucketed(x, bits, 128)
        row(f"Triton quantize+pack Q{bits}", lambda b=bits: fastpath.quantize_bucketed(x, b, 128))
        row(f"Triton unpack+dequantize Q{bits}", lambda q=q: fastpath.dequantize_bucketed(q))
        ref = quantize_bucketed_ref(x, bits, 128)
        row(f"torch reference quantize Q{bits}", lambda b=bits: quantize_bucketed_ref(x, b, 128))
        row(f"torch reference dequantize Q{bits}", lambda r=ref: dequantize_bucketed_ref(r))
        same = torch.equal(q.codes, ref.codes) and torch.equal(q.scales, ref.scales)
        rows[-4]["bit_identical_to_reference"] = bool(same)
    comp = CocktailCompressor(n, CocktailConfig(p=0.1, r=0.2, bits=4))
    m = comp.mask(7)
    row("CocktailSGD compress p=0.1 r=0.2 b=4 (mask, top-k, Q4, bitmap)",
        lambda: comp.compress(m.gather(x).to(torch.float16)))
    copy = rows[0]["gbps"]
    for r in rows:
        r["x_copy"] = r["gbps"] / copy
    fast_share = min(r["x_copy"] for r in rows if r["kernel"].startswith("Triton"))
    targets = [f"slowest Triton kernel reaches {100 * fast_share:.0f}% of device-copy bandwidth (target >= 30%): "
               f"{'met' if fast_share >= 0.30 else 'NOT met'}"]
    ident = all(r.get("bit_identical_to_reference", True) for r in rows)
    targets.append("Triton codes and scales bit-identical to the torch reference on this input: "
                   f"{'yes' if ident else 'NO'}")
    result = {
        "command": " ".join(shlex.quote(a) for a in ["python", "bench/bench_gpu_kernels.py", *sys.argv[1:]]),
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "machine": platform.machine(),
        "fast_path": fastpath.FAST_PATH_REASON, "numel": n, "repeats": args.repeats, "rows": rows, "targets": targets,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_kernels.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = ["# GPU kernels", "", f"Command: `{result['command']}`", "",
             f"{n:,} float32 values (Gaussian over uniform: heavy-tailed), bucket 128; {result['device']}, torch "
             f"{result['torch']}; median of {args.repeats} runs (CUDA events) after two warm-ups. GB/s counts the "
             f"fp32 input read. Fast path: {result['fast_path']}.", "",
             "| kernel | GB/s | x copy |", "|---|---:|---:|"]
    lines += [f"| {r['kernel']} | {r['gbps']:.1f} | {r['x_copy']:.2f} |" for r in rows]
    lines += ["", "## Targets", ""] + [f"- {t}" for t in targets]
    md = "\n".join(lines) + "\n"
    (args.out / "gpu_kernels.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
