"""The hardware profile a node announces: device, memory, a short matmul benchmark, free disk.

Measured in a short-lived subprocess (`python -m shoal.node.train.hardware`) so the daemon itself does not carry
torch until it trains, and cached per machine for a day: in $SHOAL_CACHE (default `$XDG_CACHE_HOME/shoal`, that is
`~/.cache/shoal`), which every node of the machine shares whatever its $SHOAL_HOME, so ten nodes started on one
machine measure it once (each probe is a fresh interpreter importing torch: about 2.5 s of a core).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from shoal.protocol.records import HardwareProfile

log = logging.getLogger(__name__)
CACHE_TTL_S = 24 * 3600


def _system_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 0


def measure(device: str = "auto", *, bench_s: float = 0.3) -> dict:
    """Run in the probe process: resolve the device and time a matmul on it."""
    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit(f"--device {device}: CUDA is not available on this machine")
        props = torch.cuda.get_device_properties(dev)
        name, memory, dtype, n = props.name, props.total_memory, torch.bfloat16, 4096
    else:
        import platform

        name, memory, dtype, n = platform.processor() or platform.machine() or "cpu", _system_memory_bytes(), torch.float32, 512
    a = torch.randn(n, n, device=dev, dtype=dtype)
    b = torch.randn(n, n, device=dev, dtype=dtype)
    (a @ b).sum().item()  # warm-up
    reps, t0 = 0, time.perf_counter()
    while True:
        c = a @ b
        reps += 1
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        elapsed = time.perf_counter() - t0
        if elapsed >= bench_s or reps >= 10_000:
            break
    del c
    return {
        "device_kind": dev.type,
        "device_name": name[:128],
        "memory_bytes": int(memory),
        "matmul_tflops": round(2 * n**3 * reps / elapsed / 1e12, 4),
        "cpu_count": os.cpu_count() or 0,
    }


def cache_dir() -> Path:
    """Where this machine's measurements are kept: $SHOAL_CACHE, else $XDG_CACHE_HOME/shoal, else ~/.cache/shoal."""
    if os.environ.get("SHOAL_CACHE"):
        return Path(os.environ["SHOAL_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "shoal"


def hardware_profile(device: str, home: Path | None, *, timeout_s: float = 120.0) -> HardwareProfile:
    """The profile for `device`, from the machine's cache (`cache_dir()`) when it is fresh, else measured by the
    probe subprocess; free disk is that of `home` (where the node keeps its state)."""
    cache = cache_dir() / f"hardware-{device.replace(':', '_')}.json"
    data = None
    try:
        if time.time() - cache.stat().st_mtime < CACHE_TTL_S:
            data = json.loads(cache.read_text())
    except (OSError, ValueError):  # none yet, unreadable or torn: measured
        data = None
    if data is None:
        t0 = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "shoal.node.train.hardware", "--device", device],
                              capture_output=True, text=True, timeout=timeout_s)
        if proc.returncode != 0:
            raise RuntimeError(f"hardware probe failed: {proc.stderr.strip()[-500:]}")
        data = json.loads(proc.stdout)
        log.info("hardware probe took %.1f s: %s", time.monotonic() - t0, data)
        tmp = cache.with_name(f".{cache.name}.{os.getpid()}")
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(data))
            os.replace(tmp, cache)
        except OSError as e:  # a cache folder that cannot be written (a user without a home): measured again
            log.info("hardware profile not cached at %s: %s", cache, e.strerror or e)
    where = home if home is not None and home.exists() else Path.cwd()
    free_disk = shutil.disk_usage(where).free
    return HardwareProfile(free_disk_bytes=free_disk, **data)


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(allow_abbrev=False,
                                description="Measure this machine's compute device and print JSON.")
    p.add_argument("--device", default="auto")
    print(json.dumps(measure(p.parse_args().device)))
