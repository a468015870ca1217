"""Baseline: hivemind's codecs on the same input, run in a separate interpreter with hivemind installed; prints JSON."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False)
    ap.add_argument("--input", required=True, help="a .pt file holding the float32 input tensor")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0)
    a = ap.parse_args()

    import torch

    if a.threads:
        torch.set_num_threads(a.threads)
    import hivemind
    from hivemind import compression as hc

    x = torch.load(a.input)
    n = x.numel()
    codecs = {
        "NoCompression": hc.NoCompression(),
        "Float16": hc.Float16Compression(),
        "ScaledFloat16": hc.ScaledFloat16Compression(),
        "Uniform8Bit": hc.Uniform8BitQuantization(),
        "Quantile8Bit": hc.Quantile8BitQuantization(),
        "Blockwise8Bit": hc.BlockwiseQuantization(),
    }
    rows = []
    for name, codec in codecs.items():
        info = hc.CompressionInfo.from_tensor(x)
        try:
            times = []
            for i in range(a.repeats + 1):
                t0 = time.perf_counter()
                msg = codec.compress(x, info)
                y = codec.extract(msg)
                dt = time.perf_counter() - t0
                if i:
                    times.append(dt)
            t = statistics.median(times)
            err = float((x - y.float()).norm() / x.norm())
            rows.append({
                "codec": f"hivemind {name}", "seconds": t, "gbps": n * 4 / t / 1e9,
                "bits_per_element": 8 * len(msg.buffer) / n, "rel_error": err, "wire_bytes": len(msg.buffer),
            })
        except Exception as e:  # noqa: BLE001 - e.g. Blockwise needs bitsandbytes
            rows.append({"codec": f"hivemind {name}", "error": f"{type(e).__name__}: {e}"[:200]})
    json.dump({"hivemind_version": hivemind.__version__, "torch": torch.__version__, "rows": rows}, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
