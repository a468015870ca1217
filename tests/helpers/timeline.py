"""Where a test's time goes: with SHOAL_TEST_WAITS=1 each wait of the helpers (and each in-process node's start and
stop) prints how long it took, to the terminal even under pytest's capture (`pytest -p no:randomly FILE` then shows
a line per wait: the waits to shorten first when the suite is too slow)."""

from __future__ import annotations

import os
import sys
import time

ON = bool(os.environ.get("SHOAL_TEST_WAITS"))
_T0 = time.monotonic()


def note(what: str, seconds: float) -> None:
    if ON:
        print(f"[wait {time.monotonic() - _T0:7.1f}] {seconds:6.2f} s  {what}", file=sys.__stderr__, flush=True)
