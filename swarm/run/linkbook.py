"""The broker's view of the links between a run's providers, from the nodes' signed link reports
(protocol/links.py; docs/placement.md, "Measured links").

Each node reports only what it measured itself. The figure of a link a -> b is the worse of the two ends' views:
the bandwidth is the smaller of a's "up to b" and b's "down from a", the round trip the larger of the two ends'.
A link one end alone reports (or neither) is unconfirmed, and priced as a slow link: no faster than the slowest
quarter of the confirmed links, no nearer than their farthest quarter, never better than what was claimed. So a
peer that claims a fast link it does not have gains nothing: the other end's view caps it, or it counts as slow.

The planner sees planning figures with hysteresis: a link's planning figure moves only when the measured one
differs from it by more than `hysteresis` (20 %: the noise of a home link), and `version` counts the moves, so the
broker re-plans on real changes only.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from shoal.protocol.links import LinkReport
from shoal.swarm.run.placement_cost import Network

Pair = tuple[str, str]


@dataclass(frozen=True, kw_only=True, slots=True)
class BookConfig:
    hysteresis: float = 0.2  # relative change of a link's figure before its planning figure moves
    rtt_floor_s: float = 0.002  # round trips differing by less than this never move a planning figure
    max_age_s: float = 900.0  # a report not renewed for this long is dropped
    default_rtt_s: float = 0.05  # priced when nothing at all is confirmed
    default_bps: float = 10e6
    max_reports: int = 4096

    def __post_init__(self) -> None:
        if not 0 <= self.hysteresis < 1 or self.rtt_floor_s < 0 or self.max_age_s <= 0:
            raise ValueError("0 <= hysteresis < 1, rtt_floor_s >= 0 and max_age_s > 0 are required")
        if self.default_rtt_s < 0 or self.default_bps <= 0 or self.max_reports < 1:
            raise ValueError("default_rtt_s >= 0, default_bps > 0 and max_reports >= 1 are required")


@dataclass(frozen=True, slots=True)
class LinkView:
    """One directed link a -> b as the planner prices it."""

    rtt_s: float
    bps: float
    confirmed: bool  # both ends measured it


class LinkBook:
    """Link reports by reporter, the pairwise figures and the planning figures (see the module)."""

    def __init__(self, config: BookConfig = BookConfig(), clock: Callable[[], float] = time.monotonic):
        self.config, self.clock = config, clock
        self._reports: dict[str, tuple[LinkReport, float]] = {}  # reporter -> (newest report, received at)
        self._plan: dict[Pair, LinkView] = {}  # planning figures (hysteresis applied)
        self.version = 0  # planning figures changed this many times

    # -- reports ------------------------------------------------------------------------------------------
    def ingest(self, report: LinkReport, run_id: str | None = None) -> bool:
        """Take a verified report (its envelope was signed by `report.peer_id`); an older one than held, or one
        for another run, is ignored. True if it was taken."""
        if run_id is not None and report.run_id not in (None, run_id):
            return False
        held = self._reports.get(report.peer_id)
        if held is not None and report.seq <= held[0].seq:
            return False
        if held is None and len(self._reports) >= self.config.max_reports:
            self.expire()
            if len(self._reports) >= self.config.max_reports:
                return False
        self._reports[report.peer_id] = (report, self.clock())
        return True

    def expire(self) -> None:
        now = self.clock()
        for p in [p for p, (_, at) in self._reports.items() if now - at > self.config.max_age_s]:
            del self._reports[p]

    def forget(self, peer: str) -> None:
        """A provider gone: its report and the planning figures of its links."""
        self._reports.pop(peer, None)
        for pair in [pr for pr in self._plan if peer in pr]:
            del self._plan[pair]

    def _view(self, reporter: str, peer: str):
        held = self._reports.get(reporter)
        if held is None or self.clock() - held[1] > self.config.max_age_s:
            return None
        return held[0].figure(peer)

    # -- figures ------------------------------------------------------------------------------------------
    def measured(self, a: str, b: str) -> tuple[float | None, float | None, bool]:
        """(rtt_s, bps of a -> b, confirmed): the worse of the two ends' views; None where neither end has one.
        Confirmed when both ends measured the bandwidth of that direction and at least one the round trip."""
        fa, fb = self._view(a, b), self._view(b, a)
        rtts = [f.rtt_s for f in (fa, fb) if f is not None and f.rtt_100us > 0]
        rates = [x for x in ((fa.up_bps if fa is not None else 0.0), (fb.down_bps if fb is not None else 0.0)) if x > 0]
        confirmed = len(rates) == 2 and bool(rtts)
        return (max(rtts) if rtts else None), (min(rates) if rates else None), confirmed

    def _unknown(self, confirmed: list[tuple[float, float]]) -> tuple[float, float]:
        """What an unconfirmed link is priced at: the slowest quarter's bandwidth, the farthest quarter's round
        trip among the confirmed links (defaults when none is)."""
        if not confirmed:
            return self.config.default_rtt_s, self.config.default_bps
        rtts = np.array([r for r, _ in confirmed])
        rates = np.array([b for _, b in confirmed])
        return float(np.quantile(rtts, 0.75)), float(np.quantile(rates, 0.25))

    def views(self, peers: Sequence[str]) -> dict[Pair, LinkView]:
        """The measured figure of every directed pair of `peers`, unconfirmed ones priced as slow links."""
        self.expire()
        raw = {(a, b): self.measured(a, b) for a in peers for b in peers if a != b}
        conf = [(r, bps) for r, bps, ok in raw.values() if ok and r is not None and bps is not None]
        slow_rtt, slow_bps = self._unknown(conf)
        out = {}
        for pair, (rtt, bps, ok) in raw.items():
            if ok and rtt is not None and bps is not None:  # confirmed: both figures known
                out[pair] = LinkView(rtt_s=rtt, bps=bps, confirmed=True)
            else:
                out[pair] = LinkView(rtt_s=max(slow_rtt, rtt or 0.0), bps=min(slow_bps, bps or math.inf),
                                     confirmed=False)
        return out

    def _moved(self, old: LinkView, new: LinkView) -> bool:
        h = self.config.hysteresis
        if old.confirmed != new.confirmed:
            return True
        if abs(new.rtt_s - old.rtt_s) > max(self.config.rtt_floor_s, h * old.rtt_s):
            return True
        return abs(new.bps - old.bps) > h * old.bps

    def network(self, peers: Sequence[str], speed_flops: Sequence[float] = ()) -> Network:
        """The planner's network over `peers` (in this order), from planning figures: a link's planning figure
        follows its measured one only when they differ by more than the hysteresis (each move bumps `version`)."""
        n = len(peers)
        index = {p: i for i, p in enumerate(peers)}
        lat, bw = np.zeros((n, n)), np.zeros((n, n))
        for (a, b), view in self.views(peers).items():
            old = self._plan.get((a, b))
            if old is None or self._moved(old, view):
                self._plan[(a, b)] = view
                if old is not None:
                    self.version += 1
            use = self._plan[(a, b)]
            i, j = index[a], index[b]
            lat[i, j], bw[i, j] = use.rtt_s / 2, use.bps
        return Network(lat, bw, np.asarray(speed_flops, dtype=float) if len(speed_flops) else np.zeros(n))
