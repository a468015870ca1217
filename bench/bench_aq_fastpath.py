"""AQ-SGD's encode on one link end, per micro-batch: the Triton fast path on CUDA against the torch reference on the
same GPU and on the CPU. The wire bytes are checked equal across the three before anything is timed.

    python bench/bench_aq_fastpath.py [--rows 8 --seq 512 --hidden 1024 --reps 50] [--out bench/results/aq_fastpath.md]
"""

from __future__ import annotations

import argparse
import sys
import time
from contextlib import contextmanager

import torch

from shoal.kernels import fastpath
from shoal.swarm.lane.aq_codec import AQSpec, encode_acts
from shoal.swarm.lane.aq_store import LinkStore, StoreConfig


@contextmanager
def reference_only():
    saved = fastpath._FAST
    fastpath._FAST = None
    try:
        yield
    finally:
        fastpath._FAST = saved


def make_store(rows: int, seq: int, hidden: int, g: torch.Generator) -> tuple[LinkStore, torch.Tensor]:
    store = LinkStore(StoreConfig(row_shape=(seq, hidden), train_samples=rows))
    m = torch.randn(rows, seq, hidden, generator=g).to(torch.float16)
    for sid in range(rows):
        store.put(sid, 1, m[sid])
    return store, m


def timed(fn, reps: int, cuda: bool) -> float:
    fn()  # warm-up (compiles the kernels)
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps


def main() -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if not torch.cuda.is_available() or not fastpath.fast_path_active():
        print(f"needs CUDA and triton: {fastpath.FAST_PATH_REASON}", file=sys.stderr)
        return 2
    g = torch.Generator().manual_seed(0)
    store, m = make_store(a.rows, a.seq, a.hidden, g)
    acts = m.float() + torch.randn(a.rows, a.seq, a.hidden, generator=g) * 0.1  # every row a delta (4 bits)
    ids, spec, dev = list(range(a.rows)), AQSpec(), acts.cuda()
    fast = encode_acts(spec, store, ids, dev, set(), set())
    with reference_only():
        ref_gpu = encode_acts(spec, store, ids, dev, set(), set())
    ref_cpu = encode_acts(spec, store, ids, acts, set(), set())
    assert fast.frames == ref_gpu.frames == ref_cpu.frames, "the three paths put different bytes on the wire"
    t_fast = timed(lambda: encode_acts(spec, store, ids, dev, set(), set()), a.reps, True)
    with reference_only():
        t_ref_gpu = timed(lambda: encode_acts(spec, store, ids, dev, set(), set()), a.reps, True)
    t_cpu = timed(lambda: encode_acts(spec, store, ids, acts, set(), set()), max(3, a.reps // 10), False)
    wire = sum(len(f) for f in fast.frames)
    lines = [
        "# AQ-SGD encode per micro-batch: Triton fast path vs torch reference",
        "",
        f"command: `python bench/bench_aq_fastpath.py --rows {a.rows} --seq {a.seq} --hidden {a.hidden} --reps {a.reps}`",
        f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}; activations ({a.rows}, {a.seq}, {a.hidden}) "
        f"fp32, every row a 4-bit delta ({wire} bytes on the wire); the three paths' bytes are equal",
        "",
        "| path | ms per micro-batch | vs CPU reference |",
        "| --- | ---: | ---: |",
        f"| CPU, torch reference | {t_cpu * 1e3:.2f} | 1.00 |",
        f"| CUDA, torch reference | {t_ref_gpu * 1e3:.2f} | {t_cpu / t_ref_gpu:.1f}x |",
        f"| CUDA, Triton quantize/pack | {t_fast * 1e3:.2f} | {t_cpu / t_fast:.1f}x |",
        "",
        "Each encode includes the store reads (CPU, fp16), the move of the old rows to the device, the sender's own "
        "decode of what it sent (on the device: the new m it commits), the frame bytes and the new rows back to the host.",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
