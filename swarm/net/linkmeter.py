"""What this node measures of its links: round-trip time and achievable bandwidth to each peer, each way, smoothed
(docs/placement.md, "Measured links").

Samples come from traffic the node carries anyway (a data-parallel message, a lane's activations, a state pull:
`received` / `sent` with the bytes and the seconds they took) and from short probes (swarm/net/linkprobe.py) where
there is none. A timed transfer smaller than `min_transfer_bytes` says too little about bandwidth and is ignored.
Transfers running at once in one direction share this node's access link, so each one's rate is scaled by how many
ran beside it (the cost model's pair bandwidth is what one transfer alone gets). Bandwidth is smoothed on a log
scale (one slow or fast sample moves it a little), round-trip time linearly; figures not refreshed for
`forget_after_s` are dropped. The clock is injected (monotonic seconds).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from shoal.protocol.links import MAX_LINKS, LinkFigure

UP, DOWN = "up", "down"


@dataclass(frozen=True, kw_only=True, slots=True)
class MeterConfig:
    min_transfer_bytes: int = 48 * 1024
    weight: float = 0.3  # of a new sample in the smoothed figure
    forget_after_s: float = 900.0
    max_peers: int = 1024

    def __post_init__(self) -> None:
        if self.min_transfer_bytes < 1 or not 0 < self.weight <= 1 or self.forget_after_s <= 0 or self.max_peers < 1:
            raise ValueError("min_transfer_bytes >= 1, 0 < weight <= 1, forget_after_s > 0 and max_peers >= 1")


@dataclass(slots=True)
class _Link:
    rtt_s: float = 0.0
    rtt_at: float = -math.inf
    up_bps: float = 0.0
    up_at: float = -math.inf
    down_bps: float = 0.0
    down_at: float = -math.inf
    samples: int = 0

    @property
    def newest(self) -> float:
        return max(self.rtt_at, self.up_at, self.down_at)


class LinkMeter:
    """This node's smoothed link figures by peer (see the module)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, config: MeterConfig = MeterConfig()):
        self.clock, self.config = clock, config
        self._links: dict[str, _Link] = {}
        self._in_flight = {UP: 0, DOWN: 0}
        self._area = {UP: 0.0, DOWN: 0.0}  # the integral of transfers in flight over time, by direction
        self._changed = {UP: clock(), DOWN: clock()}

    # -- samples ------------------------------------------------------------------------------------------
    def _link(self, peer: str) -> _Link:
        link = self._links.get(peer)
        if link is None:
            if len(self._links) >= self.config.max_peers:
                oldest = min(self._links, key=lambda p: self._links[p].newest)
                del self._links[oldest]
            link = self._links[peer] = _Link()
        return link

    def rtt(self, peer: str, seconds: float) -> None:
        if not math.isfinite(seconds) or seconds <= 0:
            return
        link = self._link(peer)
        now = self.clock()
        fresh = now - link.rtt_at > self.config.forget_after_s
        w = self.config.weight
        link.rtt_s = seconds if fresh else w * seconds + (1 - w) * link.rtt_s
        link.rtt_at = now
        link.samples += 1

    def transfer(self, peer: str, direction: str, nbytes: int, seconds: float, sharing: float = 1.0) -> None:
        """`nbytes` moved to (UP) or from (DOWN) `peer` in `seconds`, with `sharing` transfers in that direction
        at once on average."""
        if direction not in (UP, DOWN):
            raise ValueError(f"direction must be {UP!r} or {DOWN!r}")
        if nbytes < self.config.min_transfer_bytes or not math.isfinite(seconds) or seconds <= 0:
            return
        bps = 8.0 * nbytes / seconds * max(1.0, sharing)
        link = self._link(peer)
        now = self.clock()
        old, at = (link.up_bps, link.up_at) if direction == UP else (link.down_bps, link.down_at)
        if now - at > self.config.forget_after_s or old <= 0:
            new = bps
        else:
            w = self.config.weight
            new = math.exp(w * math.log(bps) + (1 - w) * math.log(old))
        if direction == UP:
            link.up_bps, link.up_at = new, now
        else:
            link.down_bps, link.down_at = new, now
        link.samples += 1

    def sent(self, peer: str, nbytes: int, seconds: float, sharing: float = 1.0) -> None:
        self.transfer(peer, UP, nbytes, seconds, sharing)

    def received(self, peer: str, nbytes: int, seconds: float, sharing: float = 1.0) -> None:
        self.transfer(peer, DOWN, nbytes, seconds, sharing)

    @contextmanager
    def timing(self, peer: str, direction: str, nbytes: int) -> Iterator[None]:
        """Time the enclosed transfer of `nbytes` and record it, counting the transfers beside it (a transfer that
        raises is not recorded)."""
        if nbytes < self.config.min_transfer_bytes:
            yield
            return
        self._count(direction, +1)
        t0, a0 = self.clock(), self._area[direction]
        try:
            yield
        finally:
            self._count(direction, -1)
        t1, a1 = self.clock(), self._area[direction]
        # the mean number of transfers in flight while this one ran (itself included)
        sharing = (a1 - a0) / (t1 - t0) if t1 > t0 else 1.0
        self.transfer(peer, direction, nbytes, t1 - t0, sharing)

    def _count(self, direction: str, delta: int) -> None:
        now = self.clock()
        self._area[direction] += self._in_flight[direction] * (now - self._changed[direction])
        self._changed[direction] = now
        self._in_flight[direction] += delta

    # -- figures ------------------------------------------------------------------------------------------
    def _fresh(self, at: float, now: float) -> bool:
        return now - at <= self.config.forget_after_s

    def figure(self, peer: str) -> LinkFigure | None:
        link = self._links.get(peer)
        if link is None:
            return None
        now = self.clock()
        rtt = link.rtt_s if self._fresh(link.rtt_at, now) else 0.0
        up = link.up_bps if self._fresh(link.up_at, now) else 0.0
        down = link.down_bps if self._fresh(link.down_at, now) else 0.0
        if not (rtt or up or down):
            return None
        return LinkFigure.of(peer, rtt_s=rtt, up_bps=up, down_bps=down, age_s=now - link.newest)

    def age_s(self, peer: str) -> float:
        """Seconds since the newest sample of `peer` (inf: none)."""
        link = self._links.get(peer)
        return math.inf if link is None else self.clock() - link.newest

    def complete(self, peer: str) -> bool:
        """Whether rtt and both directions are known and fresh."""
        link = self._links.get(peer)
        now = self.clock()
        return link is not None and all(self._fresh(t, now) for t in (link.rtt_at, link.up_at, link.down_at))

    def peers(self) -> list[str]:
        return list(self._links)

    def figures(self, prefer: Iterable[str] = (), limit: int = MAX_LINKS) -> tuple[LinkFigure, ...]:
        """At most `limit` figures for a report: `prefer`'s peers first (the ones this node works with), then the
        most recently measured."""
        prefer = [p for p in dict.fromkeys(prefer) if p in self._links]
        rest = sorted((p for p in self._links if p not in set(prefer)), key=lambda p: -self._links[p].newest)
        out = []
        for p in prefer + rest:
            f = self.figure(p)
            if f is not None:
                out.append(f)
            if len(out) >= limit:
                break
        return tuple(out)
