"""Repeated log records kept to a quota: the first few of a kind, then one per period that says how many were left
out. A node's log then grows with what changes, not with how often a library repeats itself (py-libp2p logs a
warning per failed DHT store, per rate-limited gossip message, per dial to a peer that left: thousands an hour)."""

from __future__ import annotations

import logging
import re
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

BURST = 5  # records of one kind written as they come
PERIOD_S = 3600.0  # then at most one per this long, with the count of those left out meanwhile
MAX_KINDS = 1024  # kinds remembered (the least recently seen forgotten first)

#: what varies between records of one kind: peer ids, multiaddrs and host:port, hex digests, numbers
_VARYING = re.compile(r"(12D3KooW|Qm)[1-9A-HJ-NP-Za-km-z]{20,}|(/(ip4|ip6|dns4?|tcp|udp|p2p)/[^\s/,')\]]+)+"
                      r"|\b[0-9a-f]{16,}\b|\d+(\.\d+)?")


def kind_of(record: logging.LogRecord) -> tuple[str, int, str]:
    """(logger, level, message with what varies replaced): records of one kind say the same thing."""
    try:
        text = record.getMessage()
    except Exception:  # noqa: BLE001 - a record whose arguments do not fit its format: its format is its kind
        text = str(record.msg)
    return record.name, record.levelno, _VARYING.sub("#", text)[:160]


@dataclass(slots=True)
class _Kind:
    written: int = 0
    left_out: int = 0
    since: float = 0.0  # when the current period began (the last record written after the burst)


class Quota:
    """`admit(record)`: whether to write it; a record written after some were left out carries their count in
    `record.shoal_left_out`. `summary()` says what was left out since each kind's last written record."""

    def __init__(self, burst: int = BURST, period_s: float = PERIOD_S, clock: Callable[[], float] = time.monotonic):
        if burst < 1 or period_s <= 0:
            raise ValueError("burst must be >= 1 and period_s > 0")
        self.burst, self.period_s, self.clock = burst, period_s, clock
        self._kinds: OrderedDict[tuple[str, int, str], _Kind] = OrderedDict()

    def admit(self, record: logging.LogRecord) -> bool:
        key = kind_of(record)
        k = self._kinds.pop(key, None) or _Kind()
        self._kinds[key] = k  # most recently seen last
        while len(self._kinds) > MAX_KINDS:
            self._kinds.popitem(last=False)
        now = self.clock()
        if k.written < self.burst:
            k.written += 1
            k.since = now
            return True
        if now - k.since < self.period_s:
            k.left_out += 1
            return False
        record.shoal_left_out = k.left_out
        k.left_out, k.since = 0, now
        return True

    def summary(self) -> list[str]:
        """One line per kind with records left out since its last written one."""
        return [f"{name}: {k.left_out} more like '{text}' left out (the log keeps {self.burst} of a kind, then one "
                f"per {self.period_s / 60:g} min)" for (name, _, text), k in self._kinds.items() if k.left_out]
