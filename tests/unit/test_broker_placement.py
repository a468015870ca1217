"""The broker places and re-places by the network: with the real Broker and Seating (no libp2p) and a network
placer fed measured link reports, a run whose arrival order strung every lane across a slow link is moved, one lane
per period, to lanes inside the sites; each move is one seating change (new epochs, a new table); first fit never
moves; a failed slot is filled by the backup that adds least to the step."""

from __future__ import annotations

import itertools

import numpy as np
import trio

from shoal.protocol.assignment import ACTIVE, BACKUP, AdmitRequest
from shoal.protocol.links import LinkFigure, LinkReport
from shoal.protocol.manifest import ModelSpec, ParallelPlan, PipelineSpec, RunManifest, SyncSpec
from shoal.swarm.run.broker import Broker
from shoal.swarm.run.linkbook import LinkBook
from shoal.swarm.run.placement_cost import Workload
from shoal.swarm.run.placer import NetworkPlacer, Placer, PlacerConfig, RunBytes
from shoal.swarm.run.replan import ReplanConfig
from tests.helpers.swarm import HW
from tests.unit.test_run_timing import CFG, FakeClock, context, signer

REPLAN = ReplanConfig(check_s=30, period_s=60, min_gain=0.1, margin_s=60, peer_dwell_s=600)
RUN = RunBytes(workload=Workload(stages=2, lanes=4, grad_bytes=(2e6, 2e6), fwd_bytes=(8e6,), bwd_bytes=(8e6,)).with_lanes,
               state_bytes=(5e6, 5e6))


def pipeline_context(clock, placer):
    ctx = context(clock)
    ctx.manifest = RunManifest.default(model=ModelSpec.preset("tiny", n_layers=2), plan=ParallelPlan(
        stages=2, replicas=4, sync=SyncSpec(method="allreduce"), pipeline=PipelineSpec(compression="none")))
    ctx.placer = placer
    return ctx


def reports(book: LinkBook, site: dict[str, int], seq: int = 1) -> None:
    """Every provider's own view: 1 Gbit/s inside a site, 20 Mbit/s between sites."""
    for a in site:
        figs = []
        for b in site:
            if b != a:
                bps = 1e9 if site[a] == site[b] else 2e7
                figs.append(LinkFigure.of(b, rtt_s=0.002 if bps > 1e8 else 0.04, up_bps=bps, down_bps=bps))
        book.ingest(LinkReport(peer_id=a, seq=seq, time=1.0, links=tuple(figs)))


async def admit_alternating(b: Broker, n: int) -> tuple[list[str], dict[str, int]]:
    peers = [signer().peer_id for _ in range(n)]
    site = {p: i % 2 for i, p in enumerate(peers)}  # arrivals alternate between the two sites
    for p in peers:
        assert (await b.admit(p, AdmitRequest(run_id=b.ctx.run_id, hardware=HW))).admitted
    return peers, site


def crossing(b: Broker, site: dict[str, int]) -> int:
    return sum(site[b.table.slot_peer(0, r)] != site[b.table.slot_peer(1, r)] for r in range(4))


async def test_lanes_strung_across_the_slow_link_are_moved_inside_the_sites():
    clock = FakeClock()
    book = LinkBook(clock=clock)
    placer = NetworkPlacer(book, RUN, config=PlacerConfig(replan=REPLAN), clock=clock)
    b = Broker(pipeline_context(clock, placer), CFG)
    peers, site = await admit_alternating(b, 8)
    assert crossing(b, site) == 4  # first come, first seated: every lane crosses
    reports(book, site)
    epochs, versions, moves = list(b.epochs), b.table.version, []
    for _ in range(6):
        b.renew_lease()
        before = dict(b.seating.slots)
        if await b.replan_once():
            moves.append(clock())
            changed = {k for k in before if before[k] != b.seating.slots[k]}
            assert len({r for _, r in changed}) <= 2  # one lane brought about (and the slots it swapped with)
        clock.advance(REPLAN.period_s)
    assert crossing(b, site) == 0 and b.replans == len(moves) >= 2
    assert all(t2 - t1 >= REPLAN.period_s for t1, t2 in zip(moves, moves[1:]))
    assert all(e > e0 for e, e0 in zip(b.epochs, epochs)) and b.table.version > versions
    assert sorted(s.peer_id for s in b.table.slots) == sorted(peers)  # nobody lost, nobody twice
    assert all(b.providers[p].state == ACTIVE for p in peers)
    assert not await b.replan_once()  # reached: nothing more to do


async def test_first_fit_never_moves_anyone():
    clock = FakeClock()
    b = Broker(pipeline_context(clock, Placer()), CFG)
    _, site = await admit_alternating(b, 8)
    for _ in range(3):
        clock.advance(100)
        b.renew_lease()
        assert not await b.replan_once()
    assert crossing(b, site) == 4


async def test_a_failed_slot_takes_the_backup_that_adds_least():
    clock = FakeClock()
    book = LinkBook(clock=clock)
    placer = NetworkPlacer(book, RUN, config=PlacerConfig(replan=REPLAN), clock=clock)
    b = Broker(pipeline_context(clock, placer), CFG)
    peers, site = await admit_alternating(b, 10)  # 8 seated, two backups (one per site)
    backups = [p for p in peers if b.providers[p].state == BACKUP]
    assert len(backups) == 2 and {site[p] for p in backups} == {0, 1}
    reports(book, site)
    first = b.seating.backups()[0].peer_id  # the one first fit would promote
    # a slot whose lane neighbour sits in the other site than that backup: both backups keep its stage warm
    stage = next(s for s in (0, 1) if site[b.table.slot_peer(1 - s, 0)] != site[first])
    for p in backups:
        b.providers[p].stage = stage
    victim, neighbour = b.table.slot_peer(stage, 0), b.table.slot_peer(1 - stage, 0)
    b.mark_failed(victim, "killed")
    filled = b.table.slot_peer(stage, 0)
    assert filled in backups and filled != first and site[filled] == site[neighbour]  # by its lane neighbour
