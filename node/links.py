"""A node's part in measuring links (docs/placement.md, "Measured links"): it answers probes, probes the run's
peers it has no fresh figures for, publishes its own figures in a signed link report, and keeps the link book of
everyone's reports (the broker plans from it; a standby that takes over has it already).

The traffic the node carries (data-parallel messages, lane frames) feeds the host's link meter directly
(swarm/run/collective.py, swarm/lane/end.py); probes fill in the peers it does not work with.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from shoal.protocol.assignment import ACTIVE, BACKUP, AssignmentTable
from shoal.protocol.envelope import Signed, seal
from shoal.protocol.links import MAX_LINKS, LinkFigure, LinkReport
from shoal.swarm.net.host import SwarmHost
from shoal.swarm.net.linkprobe import LinkProber, LinkProbeServer, ProbeConfig
from shoal.swarm.net.penalty import Penalties
from shoal.swarm.run.linkbook import LinkBook

log = logging.getLogger(__name__)

CANDIDATES = 16  # peers probed besides those a node works with, the least recently measured first


@dataclass(frozen=True, kw_only=True, slots=True)
class LinksConfig:
    probe: ProbeConfig = ProbeConfig()
    report_s: float = 30.0  # a report goes out this often when a figure moved by more than `change`
    renew_s: float = 120.0  # ... and this often regardless (the book drops reports not renewed)
    change: float = 0.2

    def __post_init__(self) -> None:
        if not 0 < self.report_s <= self.renew_s or self.change < 0:
            raise ValueError("need 0 < report_s <= renew_s and change >= 0")


def _moved(old: LinkFigure | None, new: LinkFigure, change: float) -> bool:
    if old is None:
        return True
    for a, b in ((old.rtt_100us, new.rtt_100us), (old.up_kbps, new.up_kbps), (old.down_kbps, new.down_kbps)):
        if (a == 0) != (b == 0) or abs(b - a) > change * max(a, 1):
            return True
    return False


class NodeLinks:
    """The probe server, the prober, the reporter and the link book of one node (see the module). `peers()`: the
    run's providers (who may be paired with this node); `partners()`: the ones it works with now."""

    def __init__(self, sh: SwarmHost, key: Ed25519PrivateKey, penalties: Penalties,
                 publish: Callable[[bytes], Awaitable[None]], config: LinksConfig = LinksConfig(), *,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time):
        self.sh, self.key, self.publish, self.config = sh, key, publish, config
        self.clock, self.wall = clock, wall
        self.meter = sh.links
        self.server = LinkProbeServer(sh, penalties, self.meter, config.probe, clock)
        self.book = LinkBook(clock=clock)
        self.table: Callable[[], AssignmentTable | None] = lambda: None
        self.prober = LinkProber(sh, self.meter, self._candidates, config.probe, clock)
        self._seq = int(wall() * 1000)  # increasing across restarts of one identity
        self._published: dict[str, LinkFigure] = {}
        self._published_at = -1e18
        self.reports = 0

    def follow(self, table: Callable[[], AssignmentTable | None]) -> None:
        """From now on: measure for the run whose current assignment table `table()` gives."""
        self.table = table

    @property
    def run_id(self) -> str | None:
        t = self.table()
        return t.run_id if t is not None else None

    def peers(self) -> list[str]:
        """The run's providers: who may be paired with this node."""
        t = self.table()
        return [] if t is None else [pid for pid, state in t.provider_states().items() if state in (ACTIVE, BACKUP)]

    def partners(self) -> list[str]:
        """Who this node works with now: its stage group and lane neighbours, or as a backup the group of the stage
        it keeps warm."""
        t, me = self.table(), self.sh.peer_id
        if t is None:
            return []
        slot = t.slot_of(me)
        if slot is None:
            stage = t.backup_stage(me)
            return [] if stage is None else list(t.members(stage))
        stage, lane = slot
        near = [t.slot_peer(s, lane) for s in (stage - 1, stage + 1) if 0 <= s < t.stages]
        return [p for p in near if p is not None] + [p for p in t.group_members(stage) if p != me]

    def _candidates(self) -> list[str]:
        me = self.sh.peer_id
        partners = [p for p in self.partners() if p != me]
        others = sorted((p for p in self.peers() if p != me and p not in set(partners)),
                        key=lambda p: (-self.meter.age_s(p), p))
        return partners + others[:CANDIDATES]

    def ingest(self, signed: Signed) -> None:
        """A verified record from gossip: link reports go into the book."""
        run_id = self.run_id
        if isinstance(signed.record, LinkReport) and run_id is not None:
            self.book.ingest(signed.record, run_id)

    def report(self) -> LinkReport | None:
        """This node's report now, or None when nothing moved since the last one and it is not due for renewal."""
        run_id = self.run_id
        if run_id is None:
            return None
        figures = self.meter.figures(prefer=self.partners(), limit=MAX_LINKS)
        if not figures:
            return None
        now = self.clock()
        due = now - self._published_at >= self.config.renew_s
        if not due and not any(_moved(self._published.get(f.peer), f, self.config.change) for f in figures):
            return None
        self._seq += 1
        self._published = {f.peer: f for f in figures}
        self._published_at = now
        return LinkReport(peer_id=self.sh.peer_id, seq=self._seq, time=self.wall(), run_id=run_id, links=figures)

    async def _report_loop(self) -> None:
        while True:
            await trio.sleep(self.config.report_s)
            rec = self.report()
            if rec is not None:
                self.book.ingest(rec, rec.run_id)  # our own view counts in our book too
                await self.publish(seal(rec, self.key))
                self.reports += 1

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as n:
            await n.start(self.prober.run)
            n.start_soon(self._report_loop)
            task_status.started()
