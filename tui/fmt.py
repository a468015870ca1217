"""Short human-readable renderings of rates, sizes, durations and times for the dashboard's cells (sizes and peer
ids as everywhere in shoal: protocol/display.py)."""

from __future__ import annotations

import time as _time

from shoal.protocol.display import nbytes, si  # noqa: F401 - one formatting for shoal's tables and this


def rate(bytes_per_s: float) -> str:
    return si(bytes_per_s, "B/s")


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
