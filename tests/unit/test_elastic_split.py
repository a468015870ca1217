"""An open run's rules without a network: elastic lanes (a newcomer seated as a new lane below the maximum, the pool
beyond it, shrinking on leaves), the global batch apportioned by speed with a liar's share bounded, and every
sequence of a step sent to exactly one lane (with its home lane kept across epochs)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.node.train.batch import GlobalOrder, StepBatch, assign, home_lanes
from shoal.protocol.assignment import AdmitRequest
from shoal.protocol.envelope import open_envelope, seal
from shoal.protocol.kinds import RECORD_TYPES
from shoal.protocol.manifest import BatchSpec, ModelSpec, ParallelPlan, RunManifest, SyncSpec
from shoal.protocol.records import StatusRecord
from shoal.protocol.split import apportion, clamp_speeds, shares
from shoal.swarm.net.identity import peer_id_of
from shoal.swarm.net.membership import Membership
from shoal.swarm.run.batchsplit import SplitConfig, step_time
from shoal.swarm.run.broker import Broker, BrokerConfig
from shoal.swarm.run.context import RunContext
from tests.helpers.swarm import HW


class FakeClock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def elastic(stages: int = 1, replicas: int = 2, lo: int = 1, hi: int = 4, backups: int = 0,
            batch: int = 12) -> RunManifest:
    return RunManifest.default(
        model=ModelSpec(size="custom", n_layers=max(2, stages)),
        batch=BatchSpec(batch_size=4, micro_batch_size=2 if stages > 1 else 4, global_batch=batch),
        plan=ParallelPlan(stages=stages, replicas=replicas, min_replicas=lo, max_replicas=hi, backups=backups,
                          sync=SyncSpec(method="allreduce")))


class Run:
    """A real Broker on a fake clock, with a membership view fed signed status records."""

    def __init__(self, m: RunManifest, split: SplitConfig = SplitConfig(every_s=0.0)):
        self.clock = FakeClock()
        me = SimpleNamespace(key=Ed25519PrivateKey.generate())
        me.peer_id = peer_id_of(me.key)
        self.membership = Membership(me.peer_id)
        self.keys: dict[str, Ed25519PrivateKey] = {}

        async def publish(env: bytes) -> None:
            pass

        self.step = 0  # the furthest step the members report (a change takes effect a few steps after it)
        ctx = RunContext(sh=me, manifest=m, register=lambda *a: None, publish=publish, clock=self.clock,
                         wall=time.time, membership=self.membership, switch_step=lambda stage: self.step + 3)
        self.b = Broker(ctx, BrokerConfig(heartbeat_s=1.0, fail_after_s=10.0, lease_renew_s=1.0, lease_timeout_s=6.0,
                                          split=split))

    async def join(self, n: int = 1) -> list[str]:
        out = []
        for _ in range(n):
            k = Ed25519PrivateKey.generate()
            pid = peer_id_of(k)
            self.keys[pid] = k
            assert (await self.b.admit(pid, AdmitRequest(run_id=self.b.ctx.run_id, hardware=HW))).admitted
            out.append(pid)
        return out

    def speed(self, pid: str, samples_per_s: float) -> None:
        rec = StatusRecord(peer_id=pid, seq=int(time.time() * 1e6), time=time.time(), run_id=self.b.ctx.run_id,
                           samples_per_s=samples_per_s)
        self.membership.observe(open_envelope(seal(rec, self.keys[pid]), RECORD_TYPES))

    def check(self) -> None:
        self.clock.t += 1.0
        self.b.renew_lease()
        for pid in self.keys:
            self.b.touch(pid)
        self.b.check_liveness()

    @property
    def lanes(self) -> tuple[int, ...]:
        return self.b.table.complete_lanes()


async def test_a_newcomer_is_a_new_lane_below_the_maximum_and_a_backup_beyond_it():
    r = Run(elastic(replicas=2, hi=3))
    a, b = await r.join(2)
    assert r.lanes == (0, 1) and r.b.table.replicas == 3
    epochs = r.b.epochs[:]
    (c,) = await r.join()
    assert r.b.table.slot_of(c) == (0, 2) and r.lanes == (0, 1, 2)  # seated at once, a lane of its own
    assert r.b.epochs[0] == epochs[0] + 1  # a group change: every member switches at the same step
    (d,) = await r.join()
    assert r.b.table.slot_of(d) is None and r.b.table.backup_stage(d) == 0  # at the maximum: the pool
    assert sum(r.b.table.lane_shares().values()) == 12 and sorted(r.b.table.lane_shares()) == [0, 1, 2]
    r.b.mark_failed(c, "left")  # a lane leaves: the backup takes its place, the run keeps 3 lanes
    assert r.b.table.slot_of(d) == (0, 2)
    r.b.mark_failed(d, "left")  # and once no backup is left, it shrinks
    assert r.lanes == (0, 1) and r.b.table.lane_shares() == {0: 6, 1: 6}
    r.b.mark_failed(b, "left")  # below what it started with, down to its minimum (1): one lane takes the batch
    assert r.lanes == (0,) and r.b.table.lane_shares() == {0: 12}


async def test_warm_backups_are_kept_before_new_lanes_form():
    r = Run(elastic(replicas=1, hi=4, backups=1))
    first, second = await r.join(2)
    assert r.b.table.slot_of(first) == (0, 0) and r.b.table.backup_stage(second) == 0  # kept warm
    (third,) = await r.join()
    assert len(r.lanes) == 2 and len(r.b.table.backups) == 1  # one more: the best of the two forms a lane
    assert r.b.table.backups[0] in (second, third)


async def test_a_pipeline_grows_by_whole_lanes_only():
    r = Run(elastic(stages=2, replicas=1, hi=3, batch=12))
    await r.join(2)  # the starting lane
    assert r.lanes == (0,)
    (x,) = await r.join()
    assert r.b.table.backup_stage(x) is not None and r.lanes == (0,)  # one stage's volunteer waits in the pool
    (y,) = await r.join()
    assert r.lanes == (0, 1) and {r.b.table.slot_of(x)[0], r.b.table.slot_of(y)[0]} == {0, 1}
    assert r.b.table.lane_shares() == {0: 6, 1: 6}  # whole micro-batches of 2 each


async def test_the_batch_follows_measured_speed_and_a_liar_takes_a_bounded_share():
    r = Run(elastic(replicas=3, hi=3, batch=60))
    a, b, c = await r.join(3)
    assert r.b.table.lane_shares() == {0: 20, 1: 20, 2: 20}  # no speeds yet: even
    for pid, v in ((a, 100.0), (b, 100.0), (c, 50.0)):
        r.speed(pid, v)
    r.check()
    lanes = {r.b.table.slot_of(p)[1]: p for p in (a, b, c)}
    got = {lanes[k]: n for k, n in r.b.table.lane_shares().items()}
    assert got == {a: 24, b: 24, c: 12}  # 2:2:1
    r.speed(c, 1e9)  # c claims a billion sequences per second
    r.check()
    got = {lanes[k]: n for k, n in r.b.table.lane_shares().items()}
    assert got[c] <= 60 * 4 / (4 + 1 + 1) and got[a] >= 1 and got[b] >= 1 and sum(got.values()) == 60
    r.speed(c, 1e-9)  # or to be a billion times slower: it still takes a share, nobody skips its samples
    r.check()
    got = {lanes[k]: n for k, n in r.b.table.lane_shares().items()}
    assert got[c] >= 60 * 0.25 / (0.25 + 2) - 1 and sum(got.values()) == 60


async def test_the_same_lanes_are_re_split_only_for_a_real_gain_and_not_too_often():
    r = Run(elastic(replicas=2, hi=2, batch=40), SplitConfig(every_s=5.0, gain=0.1))
    a, b = await r.join(2)
    r.speed(a, 100.0), r.speed(b, 104.0)
    version = r.b.table.version
    for _ in range(6):
        r.check()
    assert r.b.table.lane_shares() == {0: 20, 1: 20} and r.b.split.resplits == 0  # 4 % faster: not worth it
    r.speed(b, 200.0)
    r.step, epochs = 40, r.b.epochs[:]
    for _ in range(5):  # a gain must hold for every_s (5 s here, from the pass that first saw it) to be followed
        r.check()
        assert r.b.split.resplits == 0 and r.b.table.lane_shares() == {0: 20, 1: 20}
    r.check()
    assert r.b.split.resplits == 1 and sorted(r.b.table.lane_shares().values()) == [13, 27]
    assert r.b.table.version > version and r.b.table.switch_step(0) == 43  # from a step every member can reach
    assert r.b.epochs == epochs  # the same group: rounds and reports under way go on
    r.speed(b, 300.0)
    r.check()
    assert r.b.split.resplits == 1  # under every_s since the last split: kept


async def test_equal_lanes_whose_speeds_wander_in_turn_keep_their_split():
    """Three equal machines on a shared host: each lane is 40 % faster than the others in turn, for 4 s at a time.
    Every instant's speeds predict a step over 10 % shorter by a new split (what re-split such a swarm every
    every_s before); over any 5 s every lane was both fast and slow, so the split stays."""
    r = Run(elastic(replicas=3, hi=3, batch=48), SplitConfig(every_s=5.0, gain=0.1))
    lanes = await r.join(3)
    wanted = []
    for t in range(60):
        fast = lanes[(t // 4) % 3]
        speeds = {p: 140.0 if p == fast else 100.0 for p in lanes}
        for p, v in speeds.items():
            r.speed(p, v)
        now = {r.b.table.slot_of(p)[1]: v for p, v in speeds.items()}
        ideal = shares(48, r.b.split.granule, now, r.b.split.config.spread)
        wanted.append(step_time(r.b.split.current, now) > step_time(ideal, now) * 1.1)
        r.check()
    assert r.b.split.resplits == 0 and r.b.table.lane_shares() == {0: 16, 1: 16, 2: 16}
    assert all(wanted)  # though each instant's speeds predicted a gain over the threshold
    slow = lanes[0]  # one lane slows down for good: followed once it has held for every_s
    for _ in range(8):
        for p in lanes:
            r.speed(p, 50.0 if p == slow else 100.0)
        r.check()
    assert r.b.split.resplits == 1 and r.b.table.lane_shares()[r.b.table.slot_of(slow)[1]] < 16


@given(st.integers(1, 200), st.lists(st.floats(0.01, 1e4), min_size=1, max_size=12))
def test_apportion_gives_every_unit_once_each_lane_one_and_follows_the_weights(extra, ws):
    weights = dict(enumerate(ws))
    units = len(ws) + extra
    out = apportion(units, weights)
    assert sum(out.values()) == units and min(out.values()) >= 1
    total = sum(ws)
    lifted = sum(units * w / total < 1 for w in ws)  # lanes that take a unit their weight would not give them
    for r, w in weights.items():  # within one unit of their proportion (more only for what others were lifted by)
        assert abs(out[r] - units * w / total) < 1 + lifted + 1e-9
    assert apportion(units, weights) == out  # deterministic


@given(st.lists(st.floats(0.0, 1e6), min_size=1, max_size=9), st.floats(1.0, 16.0))
def test_clamped_speeds_bound_any_lanes_share(ws, spread):
    c = clamp_speeds(dict(enumerate(ws)), spread)
    s = sorted(c.values())
    assert s[-1] <= spread * s[(len(s) - 1) // 2] * (1 + 1e-9) and s[0] > 0


@settings(max_examples=60)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=6), st.integers(0, 2**32), st.integers(0, 50))
def test_every_sequence_of_a_step_goes_to_exactly_one_lane(parts, seed, step):
    B = sum(parts)
    lanes = tuple((3 * i + 1, n) for i, n in enumerate(parts))
    order = GlobalOrder(1000, seed=seed)
    got = [order.step_ids(step, StepBatch(B, lanes, r)) for r, _ in lanes]
    assert [len(g) for g in got] == parts
    together = torch.cat(got)
    assert sorted(together.tolist()) == sorted(order.ids(step * B, B).tolist())  # each once, none missing


def test_a_sequence_keeps_its_home_lane_across_epochs_and_a_new_lane_moves_few():
    ids = np.arange(5000)
    two = ((0, 32), (1, 32))
    home = home_lanes(ids, two, seed=1)
    assert abs((home == 0).mean() - 0.5) < 0.03
    order = GlobalOrder(640, seed=1)  # 10 steps of 64 per epoch: where does each sequence go, epoch after epoch?
    lane_of: dict[int, set[int]] = {}
    for step in range(40):
        ids_s = order.ids(step * 64, 64).numpy()
        for i, j in zip(ids_s, assign(ids_s, two, seed=1)):
            lane_of.setdefault(int(i), set()).add(int(j))
    stayed = sum(len(v) == 1 for v in lane_of.values()) / len(lane_of)
    assert stayed > 0.7  # four epochs: most sequences met the same lane's buffer every time (random: 1/8)
    three = ((0, 22), (1, 21), (2, 21))
    moved = (home_lanes(ids, three, seed=1) != home).mean()
    assert 0.3 < moved < 0.55  # a third lane takes its third, and slices shift: about half move (a third at best)


def test_one_lane_takes_the_stream_in_order_as_one_trainer_did():
    order = GlobalOrder(100, seed=3)
    assert order.step_ids(7, StepBatch(16, ((0, 16),), 0)).tolist() == order.ids(7 * 16, 16).tolist()


async def test_a_new_split_moves_no_members_entry_and_applies_from_its_switch_step():
    from shoal.swarm.run.timeline import GroupTimeline

    r = Run(elastic(replicas=2, hi=2, batch=40), SplitConfig(every_s=0.0, gain=0.1))
    a, b = await r.join(2)
    r.step = 10
    r.b.reform(0, "a newcomer's group")  # a group change: takes effect at step 13
    before = r.b.table
    r.speed(a, 100.0), r.speed(b, 300.0)
    r.step = 20
    r.check()  # a new split, from step 23
    after = r.b.table
    assert after.epochs == before.epochs and after.switch_step(0) == 23 and before.switch_step(0) == 13
    sched = GroupTimeline(a)
    sched.add(before), sched.add(after)
    assert sched.entry()[0] == 13  # a member entering at 13 still enters there
    assert sched.table_at(22, 0).lane_shares() == {0: 20, 1: 20} and sched.table_at(23, 0) is after
    assert sched.group_at(22).weights == (20, 20) and sorted(sched.group_at(23).weights) == [10, 30]  # 1:3
