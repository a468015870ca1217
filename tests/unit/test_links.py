"""Measured links: a node's smoothed figures, their compact signed report, and the broker's view that takes the
worse of a link's two ends, so that claiming a fast link one does not have gains nothing."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from shoal.protocol.envelope import open_envelope, seal
from shoal.protocol.errors import FieldError
from shoal.protocol.kinds import RECORD_TYPES
from shoal.protocol.links import MAX_LINKS, LinkFigure, LinkReport
from shoal.protocol.signing import peer_id_from_public_key, public_key_bytes
from shoal.swarm.net.linkmeter import DOWN, UP, LinkMeter, MeterConfig
from shoal.swarm.run.linkbook import BookConfig, LinkBook
from shoal.swarm.run.placement_cost import CostModel, Workload
from shoal.swarm.run.placement_plan import PlannerConfig, plan
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def keys(n: int):
    ks = [Ed25519PrivateKey.generate() for _ in range(n)]
    return ks, [peer_id_from_public_key(public_key_bytes(k)) for k in ks]


# -- the meter ------------------------------------------------------------------------------------------------
def test_small_transfers_say_nothing_and_the_first_sample_is_taken_as_is():
    clock = Clock()
    m = LinkMeter(clock, MeterConfig(min_transfer_bytes=1000))
    m.received("p", 999, 0.001)
    assert m.figure("p") is None
    m.received("p", 125_000, 0.1)  # 10 Mbit/s
    f = m.figure("p")
    assert f.down_kbps == 10_000 and f.up_kbps == 0 and f.rtt_100us == 0


def test_bandwidth_is_smoothed_on_a_log_scale_and_forgotten_when_old():
    clock = Clock()
    m = LinkMeter(clock, MeterConfig(min_transfer_bytes=1, weight=0.5, forget_after_s=100))
    m.sent("p", 1_000_000, 1.0)  # 8 Mbit/s
    m.sent("p", 1_000_000, 0.5)  # 16 Mbit/s
    assert m.figure("p").up_bps == pytest.approx(8e6 * 2 ** 0.5, rel=1e-3)  # the geometric middle
    m.rtt("p", 0.1)
    m.rtt("p", 0.2)
    assert m.figure("p").rtt_s == pytest.approx(0.15)
    clock.t = 101
    assert m.figure("p") is None and m.age_s("p") == pytest.approx(101)
    m.sent("p", 1_000_000, 2.0)
    assert m.figure("p").up_bps == pytest.approx(4e6)  # an old figure is not mixed in


def test_transfers_that_share_the_link_count_as_what_one_alone_gets():
    clock = Clock()
    m = LinkMeter(clock, MeterConfig(min_transfer_bytes=1))
    with m.timing("a", DOWN, 1_000_000):
        with m.timing("b", DOWN, 1_000_000):
            clock.t += 1.0
    assert m.figure("a").down_bps == pytest.approx(16e6)  # two at once: 8 Mbit/s each, 16 alone
    assert m.figure("b").down_bps == pytest.approx(16e6)
    with pytest.raises(RuntimeError):
        with m.timing("c", UP, 1_000_000):
            raise RuntimeError("reset")
    assert m.figure("c") is None


def test_a_report_prefers_the_peers_a_node_works_with_and_is_bounded():
    clock = Clock()
    m = LinkMeter(clock, MeterConfig(min_transfer_bytes=1))
    for i in range(MAX_LINKS + 10):
        clock.t += 1
        m.rtt(f"p{i}", 0.01)
    figs = m.figures(prefer=["p0", "p3"])
    assert len(figs) == MAX_LINKS and [f.peer for f in figs[:3]] == ["p0", "p3", f"p{MAX_LINKS + 9}"]


# -- the record -------------------------------------------------------------------------------------------------
def test_a_report_is_signed_compact_and_strict():
    ks, ids = keys(MAX_LINKS + 2)
    figs = tuple(LinkFigure.of(p, rtt_s=0.25, up_bps=1e9, down_bps=2e6, age_s=3) for p in ids[1:MAX_LINKS + 1])
    env = seal(LinkReport(peer_id=ids[0], seq=7, time=1.7e9, run_id="r" * 64, links=figs), ks[0])
    assert len(env) < 6000
    rec = open_envelope(env, RECORD_TYPES).record
    assert rec.figure(ids[1]).rtt_s == 0.25 and rec.figure(ids[1]).up_bps == 1e9
    with pytest.raises(FieldError):
        LinkReport(peer_id=ids[0], seq=1, time=1.0, links=figs + (figs[0],))  # too many
    with pytest.raises(FieldError):
        LinkReport(peer_id=ids[0], seq=1, time=1.0, links=(figs[0], figs[0]))  # twice
    with pytest.raises(FieldError):
        LinkReport(peer_id=ids[0], seq=1, time=1.0, links=(LinkFigure.of(ids[0], rtt_s=0.1, up_bps=1, down_bps=1),))
    assert LinkFigure.of(ids[1], rtt_s=1e-9, up_bps=1.0, down_bps=0).rtt_100us == 1  # measured stays non-zero


# -- the broker's view ------------------------------------------------------------------------------------------
def report(me: str, seq: int, figures: dict[str, tuple[float, float, float]]) -> LinkReport:
    return LinkReport(peer_id=me, seq=seq, time=1.0, links=tuple(
        LinkFigure.of(p, rtt_s=r, up_bps=u, down_bps=d) for p, (r, u, d) in figures.items()))


def honest_reports(truth: dict, peers: list[str], seq: int = 1) -> list[LinkReport]:
    """Every node's own view of a true network {(a, b): (rtt_s, bps a -> b)}."""
    return [report(a, seq, {b: (truth[a, b][0], truth[a, b][1], truth[b, a][1]) for b in peers if b != a})
            for a in peers]


def two_sites(peers: list[str]) -> dict:
    site = {p: i % 2 for i, p in enumerate(peers)}
    return {(a, b): ((0.002, 1e9) if site[a] == site[b] else (0.06, 2e7))
            for a, b in itertools.permutations(peers, 2)}


def test_a_link_is_the_worse_of_its_two_ends():
    book = LinkBook()
    book.ingest(report("a", 1, {"b": (0.01, 100e6, 50e6)}))
    book.ingest(report("b", 1, {"a": (0.03, 80e6, 90e6)}))
    assert book.measured("a", "b") == (pytest.approx(0.03), pytest.approx(90e6), True)  # a's up 100, b's down 90
    assert book.measured("b", "a") == (pytest.approx(0.03), pytest.approx(50e6), True)  # b's up 80, a's down 50
    assert not book.ingest(report("a", 1, {"b": (0.001, 1e9, 1e9)}))  # not newer: ignored


def test_a_peer_claiming_fast_links_it_does_not_have_gains_nothing():
    """The liar's claims (every link 10 Gbit/s, 0.1 ms) change no planning figure and no plan: the other ends'
    views cap what it says; links no other end reports count as slow."""
    _, peers = keys(8)
    truth = two_sites(peers)
    liar = peers[3]
    honest, lying = LinkBook(), LinkBook()
    for r in honest_reports(truth, peers):
        honest.ingest(r)
        lying.ingest(r if r.peer_id != liar else report(liar, 2, {b: (1e-4, 1e10, 1e10) for b in peers if b != liar}))
    wl = Workload(stages=2, lanes=4, grad_bytes=(4e7, 4e7), fwd_bytes=(2e7,), bwd_bytes=(2e7,))
    a, b = honest.network(peers), lying.network(peers)
    assert np.array_equal(a.latency_s, b.latency_s) and np.array_equal(a.bandwidth_bps, b.bandwidth_bps)
    cfg = PlannerConfig(time_budget_s=5.0)
    assert np.array_equal(plan(CostModel(a, wl), config=cfg).grid, plan(CostModel(b, wl), config=cfg).grid)
    # alone (the other ends never report it), a fast claim counts as the slowest quarter of the confirmed links
    alone = LinkBook()
    for r in honest_reports(truth, peers):
        alone.ingest(r if r.peer_id != peers[0] else report(peers[0], 1, {}))
    alone.forget(peers[1])
    alone.ingest(report(peers[1], 5, {peers[0]: (1e-4, 1e10, 1e10)}))
    v = alone.views(peers)[(peers[1], peers[0])]
    assert not v.confirmed and v.bps <= 2e7 and v.rtt_s >= 0.06


def test_planning_figures_move_only_past_the_hysteresis():
    _, peers = keys(4)
    truth = two_sites(peers)
    book = LinkBook(BookConfig(hysteresis=0.2))
    for r in honest_reports(truth, peers):
        book.ingest(r)
    first = book.network(peers)
    noisy = {k: (r * 1.1, bps * 0.85) for k, (r, bps) in truth.items()}  # within 20 %
    for r in honest_reports(noisy, peers, seq=2):
        book.ingest(r)
    assert book.version == 0 and np.array_equal(book.network(peers).bandwidth_bps, first.bandwidth_bps)
    slower = dict(noisy)
    a, b = peers[0], peers[2]  # one link drops to a third
    slower[a, b] = (truth[a, b][0], truth[a, b][1] / 3)
    for r in honest_reports(slower, peers, seq=3):
        book.ingest(r)
    net = book.network(peers)
    assert book.version == 1 and net.bandwidth_bps[0, 2] == pytest.approx(truth[a, b][1] / 3, rel=1e-3)
    assert net.bandwidth_bps[2, 0] == first.bandwidth_bps[2, 0]


def test_reports_of_another_run_and_old_reports_are_dropped():
    clock = Clock()
    book = LinkBook(BookConfig(max_age_s=10), clock)
    r = LinkReport(peer_id="a", seq=1, time=1.0, run_id="x" * 64, links=())
    assert not book.ingest(r, run_id="y" * 64)
    assert book.ingest(r, run_id="x" * 64)
    book.ingest(report("b", 1, {"a": (0.01, 1e6, 1e6)}))
    clock.t = 11
    assert book.measured("b", "a") == (None, None, False)


# -- a node's part ---------------------------------------------------------------------------------------------
def node_links(me: str, clock):
    from types import SimpleNamespace

    from shoal.node.links import LinksConfig, NodeLinks

    sh = SimpleNamespace(peer_id=me, links=LinkMeter(clock, MeterConfig(min_transfer_bytes=1)),
                         set_handler=lambda protocol, handler: None)

    async def publish(env: bytes) -> None:
        pass

    return NodeLinks(sh, Ed25519PrivateKey.generate(), None, publish, LinksConfig(report_s=10, renew_s=60),
                     clock=clock, wall=lambda: 1.7e9)


def table(ids: list[str]):
    from shoal.protocol.assignment import AssignmentTable, SlotEntry

    slots = tuple(SlotEntry(stage=s, replica=r, peer_id=ids[2 * r + s]) for r in range(2) for s in range(2))
    return AssignmentTable(peer_id=ids[0], run_id="r" * 64, lease_epoch=0, version=1, time=1.0, stages=2,
                           replicas=2, epochs=(1, 1), slots=slots, backups=(ids[4],), backup_stages=(1,))


def test_a_node_works_with_its_lane_neighbours_and_its_group_and_reports_on_change():
    _, ids = keys(5)
    clock = Clock()
    nl = node_links(ids[0], clock)  # s0r0
    assert nl.report() is None and nl.run_id is None  # no run followed yet
    t = table(ids)
    nl.follow(lambda: t)
    assert nl.partners() == [ids[1], ids[2]]  # lane neighbour s1r0, group member s0r1
    assert set(nl.peers()) == set(ids)  # every provider of the run (itself left out when probing)
    assert nl._candidates()[:2] == [ids[1], ids[2]]
    backup = node_links(ids[4], clock)
    backup.follow(lambda: t)
    assert sorted(backup.partners()) == sorted([ids[1], ids[3]])  # the group of the stage it keeps warm
    nl.meter.rtt(ids[1], 0.01)
    first = nl.report()
    assert first is not None and first.run_id == "r" * 64 and [f.peer for f in first.links] == [ids[1]]
    clock.t += 11
    nl.meter.rtt(ids[1], 0.0105)  # a 5 % move: nothing to say
    assert nl.report() is None
    nl.meter.rtt(ids[1], 0.05)  # the smoothed figure moves past 20 %
    second = nl.report()
    assert second is not None and second.seq > first.seq
    clock.t += 61
    assert nl.report() is not None  # renewed regardless
