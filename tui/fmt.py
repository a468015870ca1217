"""Short human-readable renderings of rates, sizes, durations and times for the dashboard's cells."""

from __future__ import annotations

import time as _time


def si(value: float, unit: str = "", digits: int = 3) -> str:
    """1234567 -> '1.23M' (+unit); keeps `digits` significant digits."""
    v = float(value)
    for prefix in ("", "k", "M", "G", "T", "P"):
        if abs(v) < 999.5 or prefix == "P":
            break
        v /= 1000.0
    if v == int(v) and abs(v) < 1000:
        text = f"{int(v)}"
    else:
        whole = len(str(int(abs(v))))
        text = f"{v:.{max(digits - whole, 0)}f}"
    return f"{text}{prefix}{unit}"


def rate(bytes_per_s: float) -> str:
    return si(bytes_per_s, "B/s")


def nbytes(n: float) -> str:
    """Binary sizes for memory and disk: 8589934592 -> '8.0 GiB'."""
    v = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if v < 1024 or unit == "PiB":
            return f"{v:.0f} {unit}" if unit == "B" else f"{v:.1f} {unit}"
        v /= 1024.0
    raise AssertionError  # pragma: no cover


def ago(seconds: float) -> str:
    """Age of a last-seen time: '0s', '42s', '3m', '2h', '5d'."""
    s = max(0.0, seconds)
    if s < 60:
        return f"{s:.0f}s"
    if s < 3600:
        return f"{s // 60:.0f}m"
    if s < 86400:
        return f"{s // 3600:.0f}h"
    return f"{s // 86400:.0f}d"


def clock(t: float) -> str:
    """HH:MM:SS in UTC, so a recorded scenario renders the same everywhere."""
    return _time.strftime("%H:%M:%S", _time.gmtime(t))


def loss(v: float | None) -> str:
    return "-" if v is None else f"{v:.4f}"
