"""Re-planning without thrash, in virtual time (trio's MockClock): the broker's network placer, fed noisy link
reports, moves a bad placement to a good one lane by lane, a period apart; under +-20 % noise it never moves; a
throttled link moves the run within the stated time; a moved provider is not moved again within its dwell time;
moves that do not pay for themselves are not made; newcomers and backups go where they add least."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import trio
import trio.testing

from shoal.protocol.links import LinkReport
from shoal.swarm.net.linkmeter import LinkMeter, MeterConfig
from shoal.swarm.run.linkbook import LinkBook
from shoal.swarm.run.placement_cost import Workload
from shoal.swarm.run.placer import NetworkPlacer, PlacerConfig, RunBytes, Seats
from shoal.swarm.run.replan import ReplanConfig, Replanner, align_lanes

S, D = 2, 4
PEERS = [f"p{i}" for i in range(8)]
SITE = {p: i % 2 for i, p in enumerate(PEERS)}  # p0 p2 p4 p6 in site 0, the odd ones in site 1
WORKLOAD = Workload(stages=S, lanes=D, grad_bytes=(2e6, 2e6), fwd_bytes=(8e6,), bwd_bytes=(8e6,))
RUN = RunBytes(workload=WORKLOAD.with_lanes, state_bytes=(5e6, 5e6), first_visit_bytes=1e6)
CONFIG = ReplanConfig(check_s=30, period_s=60, min_gain=0.10, margin_s=60, peer_dwell_s=600, horizon_steps=5000)


def truth(slow: dict | None = None) -> dict:
    """(a, b) -> (rtt_s, bit/s): 1 Gbit/s inside a site, 20 Mbit/s between; `slow` overrides pairs (both ways)."""
    out = {(a, b): (0.002, 1e9) if SITE[a] == SITE[b] else (0.04, 2e7) for a, b in itertools.permutations(PEERS, 2)}
    for (a, b), v in (slow or {}).items():
        out[a, b] = out[b, a] = v
    return out


class World:
    """The links as they are. Every 5 s each node measures each link once, every sample off by up to `noise`
    either way (uniformly), into its own link meter, and reports what its meter says."""

    def __init__(self, seed: int = 0, noise: float = 0.2):
        self.links, self.noise, self.rng, self.seq = truth(), noise, np.random.default_rng(seed), 0
        self.meters = {p: LinkMeter(trio.current_time, MeterConfig(min_transfer_bytes=1)) for p in PEERS}

    def report(self, book: LinkBook) -> None:
        self.seq += 1
        for a in PEERS:
            m = self.meters[a]
            for b in PEERS:
                if b != a:
                    n = 1 + self.noise * self.rng.uniform(-1, 1, 3)
                    m.rtt(b, self.links[a, b][0] * n[0])
                    m.sent(b, 10**6, 8e6 / (self.links[a, b][1] * n[1]))
                    m.received(b, 10**6, 8e6 / (self.links[b, a][1] * n[2]))
            book.ingest(LinkReport(peer_id=a, seq=self.seq, time=1.0, links=m.figures()))


def lanes_cross_sites(slots) -> int:
    return sum(SITE[slots[(0, r)]] != SITE[slots[(1, r)]] for r in range(D))


class Broker:
    """The broker's re-planning loop as it runs it: a re-plan every check_s, one change applied per proposal."""

    def __init__(self, slots: dict, backups=(), config: ReplanConfig = CONFIG, steps_left: int = 100_000):
        self.book = LinkBook()
        self.placer = NetworkPlacer(self.book, RUN, config=PlacerConfig(replan=config), clock=trio.current_time)
        self.slots, self.backups, self.steps_left = dict(slots), list(backups), steps_left
        self.changes: list[tuple[float, object]] = []

    def replan(self) -> None:
        change = self.placer.propose(Seats(self.slots, self.backups, S, D, self.steps_left))
        if change is None:
            return
        for slot, p in change.assign.items():
            self.slots[slot] = p
        self.backups = [b for b in self.backups if b not in change.assign.values()] + list(change.to_pool)
        self.placer.moved(change)
        self.changes.append((trio.current_time(), change))

    async def run(self, world: World, seconds: float, on_tick=None) -> None:
        end = trio.current_time() + seconds
        next_plan = trio.current_time()
        while trio.current_time() < end:
            world.report(self.book)
            if on_tick is not None:
                on_tick(trio.current_time())
            if trio.current_time() >= next_plan:
                self.replan()
                next_plan += CONFIG.check_s
            await trio.sleep(5)


BAD = {(0, r): PEERS[2 * r] for r in range(D)} | {(1, r): PEERS[2 * r + 1] for r in range(D)}  # every lane crosses
GOOD = {(0, 0): "p0", (1, 0): "p2", (0, 1): "p4", (1, 1): "p6", (0, 2): "p1", (1, 2): "p3", (0, 3): "p5",
        (1, 3): "p7"}


@pytest.fixture
def mock_clock():
    return trio.testing.MockClock(autojump_threshold=0)


async def test_a_bad_placement_is_moved_lane_by_lane_a_period_apart(mock_clock):
    b = Broker(BAD)
    await b.run(World(), 600)
    assert lanes_cross_sites(b.slots) == 0
    times = [t for t, _ in b.changes]
    assert len(times) >= 2 and all(t2 - t1 >= CONFIG.period_s for t1, t2 in zip(times, times[1:]))
    assert all(len({r for (_, r) in c.assign}) <= 2 for _, c in b.changes)  # one lane and the slots it swaps with
    assert b.placer.replanner.migrations == 1  # one target, reached in steps
    # reached within the first re-plan plus one period per lane that had to change
    assert times[-1] <= len(times) * CONFIG.period_s
    assert b.changes[-1][1].after_s < 0.5 * b.changes[0][1].before_s


async def test_ten_minutes_of_noise_move_nothing(mock_clock):
    b = Broker(GOOD)
    await b.run(World(seed=1, noise=0.2), 600)
    assert len(b.changes) <= 1 and b.placer.replanner.migrations <= 1
    assert b.changes == [], [c.why for _, c in b.changes]


async def test_a_throttled_link_moves_the_run_within_the_stated_time(mock_clock):
    """At t = 120 s the link inside lane 0 (p0 -> p2) drops to 5 Mbit/s: the next re-plan adopts a target and the
    first lane moves at once (the period since the last move has long passed)."""
    b = Broker(GOOD)
    world = World(seed=2, noise=0.1)
    throttled = {}

    def throttle(now):
        if now >= 120 and not throttled:
            world.links.update({k: v for k, v in truth({("p0", "p2"): (0.002, 5e6)}).items()
                                if k in (("p0", "p2"), ("p2", "p0"))})
            throttled["at"] = now

    await b.run(world, 600, throttle)
    assert b.changes, "the run never moved off the throttled link"
    first = b.changes[0][0]
    assert first - throttled["at"] <= CONFIG.check_s + 5  # the next re-plan (reports every 5 s)
    lane0 = [r for r in range(D) if {b.slots[(0, r)], b.slots[(1, r)]} == {"p0", "p2"}]
    assert lane0 == []  # p0 and p2 no longer share a lane


async def test_a_moved_provider_waits_out_its_dwell_time(mock_clock):
    cfg = ReplanConfig(check_s=30, period_s=60, min_gain=0.10, margin_s=0, peer_dwell_s=600, horizon_steps=5000)
    r = Replanner(cfg, trio.current_time)
    cur = np.array([["a", "b"], ["c", "d"]], dtype=object)
    tgt = np.array([["b", "a"], ["c", "d"]], dtype=object)
    assert r.offer(tgt, 1.0, 2.0, 0.0, 10_000).adopt
    lane, cells = r.next_lane(cur)
    r.moved(["a", "b"])
    await trio.sleep(61)
    # a new target that would move a again: blocked until 600 s after its move
    assert r.offer(np.array([["c", "b"], ["a", "d"]], dtype=object), 0.5, 1.0, 0.0, 10_000).adopt
    assert r.next_lane(tgt) is None
    await trio.sleep(600)
    assert r.next_lane(tgt) is not None


def test_a_move_that_does_not_pay_for_itself_is_not_made():
    r = Replanner(CONFIG)
    assert not r.judge(1.0, 0.95, 0.0, 10**6).adopt  # 5 % < 10 %
    assert not r.judge(1.0, 0.5, 1000.0, 100).adopt  # saves 50 s over 100 steps, moving costs 1000 s
    assert r.judge(1.0, 0.5, 1000.0, 10_000).adopt
    assert not r.judge(1.0, 0.5, 2500.0, 10**9).adopt  # the horizon caps what a long run is worth (2500 s)


def test_lanes_are_aligned_to_keep_providers_in_place():
    cur = np.array([[0, 1, 2], [3, 4, 5]])
    tgt = np.array([[2, 0, 1], [5, 3, 7]])
    assert align_lanes(tgt, cur).tolist() == [[0, 1, 2], [3, 7, 5]]


async def test_a_newcomer_and_a_backup_go_where_they_add_least():
    book = LinkBook()
    World(noise=0.0).report(book)
    placer = NetworkPlacer(book, RUN)
    slots = {(0, 0): "p0", (0, 1): "p1"}  # lane 0 starts in site 0, lane 1 in site 1
    assert placer.choose_slot("p3", [(1, 0), (1, 1)], slots) == (1, 1)  # next to its own site
    assert placer.choose_backup((1, 0), ["p5", "p7", "p2"], slots) == "p2"
