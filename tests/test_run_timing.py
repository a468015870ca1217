"""Timeouts, leases, stragglers and round deadlines in virtual time: the broker, the run client and the
synchronizers take a clock, so these tests assert exact times without sleeping (an injected fake clock for the
decisions, trio's MockClock with autojump for the broker's own loops)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from shoal.node.sync.allreduce import AllReduceSync
from shoal.node.sync.base import SyncConfig
from shoal.node.train.control import StepControl
from shoal.protocol.assignment import ACTIVE, BACKUP, GONE, AdmitRequest, BrokerLease
from shoal.protocol.envelope import open_envelope, seal
from shoal.protocol.assignment import RUN_RECORD_TYPES
from shoal.protocol.manifest import ParallelPlan, RunManifest, SyncSpec
from shoal.swarm.net.identity import peer_id_of
from shoal.swarm.net.penalty import Penalties
from shoal.swarm.run.broker import Broker, BrokerConfig
from shoal.swarm.run.context import RunContext
from shoal.swarm.run.client import RunClient
from shoal.swarm.run.group import Group
from tests.swarm_helpers import HW

CFG = BrokerConfig(heartbeat_s=1.0, suspect_after_beats=3, fail_after_s=10.0, lease_renew_s=1.0,
                   lease_timeout_s=6.0, straggler_misses=3, straggler_window_s=100.0, demote_hold_s=50.0)


class FakeClock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


def signer():
    key = Ed25519PrivateKey.generate()
    return SimpleNamespace(key=key, peer_id=peer_id_of(key))


def context(clock, replicas: int = 2) -> RunContext:
    m = RunManifest.default(plan=ParallelPlan(replicas=replicas, sync=SyncSpec(method="allreduce")))

    async def publish(env: bytes) -> None:
        pass

    return RunContext(sh=signer(), manifest=m, register=lambda name, handler: None, publish=publish,
                      clock=clock, wall=lambda: 1.7e9)


async def admitted(broker: Broker, n: int) -> list[str]:
    peers = [signer().peer_id for _ in range(n)]
    for p in peers:
        assert (await broker.admit(p, AdmitRequest(run_id=broker.ctx.run_id, hardware=HW))).admitted
    return peers


async def test_a_silent_member_is_suspect_after_three_beats_and_failed_after_fail_after_s():
    clock = FakeClock()
    b = Broker(context(clock), CFG)
    a, c, backup = await admitted(b, 3)
    assert b.table.slot_of(a) == (0, 0) and b.table.backup_stage(backup) == 0

    def check_at(dt: float) -> None:  # the others keep beating; `a` is silent
        clock.advance(dt)
        b.touch(c), b.touch(backup)
        b.check_liveness()

    check_at(3.0)  # exactly three beats: not yet suspect
    assert not b.providers[a].suspect
    check_at(0.01)
    assert b.providers[a].suspect and b.providers[a].state == ACTIVE
    check_at(10.0 - 3.01)  # exactly fail_after_s of silence: still in its slot
    assert b.providers[a].state == ACTIVE
    check_at(0.01)
    assert b.providers[a].state == GONE and b.table.slot_of(backup) == (0, 0)
    assert b.promotions[-1][1:] == ("s0r0", a, backup)


async def test_a_straggler_moves_to_the_pool_on_its_third_miss_within_the_window_and_is_held_there():
    clock = FakeClock()
    b = Broker(context(clock), CFG)
    slow, other, backup = await admitted(b, 3)
    epoch = b.epochs[0]
    b.missed_round(slow, 0, "missed")
    clock.advance(100.01)  # the first miss leaves the window
    b.missed_round(slow, 0, "missed")
    b.missed_round(slow, 0, "missed")
    assert b.providers[slow].state == ACTIVE and b.reforms == 3 and b.epochs[0] == epoch + 3
    b.missed_round(slow, 0, "missed")  # three within 100 s, and a backup of stage 0 can take its slot
    assert b.providers[slow].state == BACKUP and b.table.slot_of(backup) == (0, 0)
    assert b.providers[slow].hold_until == pytest.approx(clock() + 50.0)
    b.mark_failed(backup, "gone")  # its slot needs a backup now: the straggler is held for demote_hold_s
    assert b.table.slot_of(slow) is None

    def check_at(dt: float) -> None:
        clock.advance(dt)
        b.touch(slow), b.touch(other)
        b.check_liveness()

    check_at(49.99)
    assert b.table.slot_of(slow) is None
    check_at(0.01)
    assert b.table.slot_of(slow) == (0, 0)


async def test_lanes_fill_busiest_stage_first_and_backups_fill_only_their_stage():
    clock = FakeClock()
    ctx = context(clock)
    ctx.manifest = RunManifest.default(plan=ParallelPlan(stages=2, replicas=1, sync=SyncSpec(method="none")))
    assert ctx.manifest.stage_params(1) > ctx.manifest.stage_params(0)  # the untied head outweighs the embedding
    b = Broker(ctx, CFG)
    s1, s0, b0, b1 = await admitted(b, 4)
    assert b.table.slot_of(s1) == (1, 0) and b.table.slot_of(s0) == (0, 0)
    assert (b.table.backup_stage(b0), b.table.backup_stage(b1)) == (0, 1)
    epochs = b.epochs[:]
    b.mark_failed(s1, "gone")
    assert b.table.slot_of(b1) == (1, 0) and b.table.backup_stage(b0) == 0
    assert all(e > f for e, f in zip(b.epochs, epochs))  # lane completeness: every stage's group changes
    b.mark_failed(b1, "gone")  # no backup of stage 1 left: the slot stays empty, stage 0's backup stays put
    assert b.table.slot_of(b0) is None and b.table.members(1) == () and b.table.complete_lanes() == ()
    clock.advance(60.0)  # then the part-filled lane is dissolved: its member returns to the pool
    b.touch(s0), b.touch(b0)
    b.check_liveness()
    assert b.dissolved == 1 and b.table.slot_of(s0) is None and b.table.backup_stage(s0) == 0


async def test_the_broker_loop_fails_a_silent_member_at_fail_after_s_in_virtual_time(autojump_clock):
    ctx = context(trio.current_time)
    b = Broker(ctx, CFG)
    async with trio.open_nursery() as n:
        await n.start(b.run)
        a, other, backup = await admitted(b, 3)
        t0 = trio.current_time()
        while b.providers[a].state != GONE:
            b.touch(other), b.touch(backup)  # they answer; `a` is silent
            await trio.sleep(0.25)
        # checked every heartbeat: failed at the first check past fail_after_s
        assert 10.0 < trio.current_time() - t0 <= 10.0 + CFG.heartbeat_s + 0.25
        assert b.table.slot_of(backup) == (0, 0)
        n.cancel_scope.cancel()


async def test_the_standby_sees_the_lease_lapse_exactly_after_lease_timeout_s():
    clock = FakeClock()
    broker_ctx = context(clock)
    b = Broker(broker_ctx, CFG)
    me = signer()
    assert (await b.admit(me.peer_id, AdmitRequest(run_id=broker_ctx.run_id, hardware=HW))).admitted
    await admitted(b, 1)  # the first provider admitted after the broker is its standby: this node
    ctx = SimpleNamespace(me=me.peer_id, run_id=broker_ctx.run_id, clock=clock, wall=broker_ctx.wall)
    client = RunClient(ctx, HW, broker_id=broker_ctx.me, broker_config=CFG)
    assert client.accept_envelope(b.table_env, broker_ctx.me) and client.table.standby == me.peer_id
    clock.advance(6.0)
    assert not client.lease_lapsed()
    lease = BrokerLease(peer_id=broker_ctx.me, run_id=broker_ctx.run_id, lease_epoch=0, time=1.7e9,
                        expires_at=1.7e9 + 6)
    client.on_record(open_envelope(seal(lease, broker_ctx.sh.key), RUN_RECORD_TYPES))  # the broker renews
    clock.advance(6.0)
    assert not client.lease_lapsed()
    clock.advance(0.01)
    assert client.lease_lapsed()


def test_round_phases_wait_until_round_start_plus_k_timeouts_on_the_synchronizer_clock():
    clock = FakeClock()
    waits = []

    def exchange(tag, sends, expect, timeout_s):
        waits.append(round(timeout_s, 6))
        clock.advance(timeout_s if len(waits) == 1 else 1.0)  # the first phase runs to its deadline
        return {p: b for p, b in sends.items() if p == "me"}  # the other member is silent

    me, other = "me", "other"
    sync = AllReduceSync(exchange=exchange, penalties=Penalties(), config=SyncConfig(round_timeout_s=8.0),
                         clock=clock)
    model = torch.nn.Linear(4, 1)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    control = StepControl(step=0, group=Group(run_id="r" * 64, epoch=0, members=(me, other), me=me))
    sync.before_optimizer_step(model, None, control)
    # phase 1 waits one timeout; phase 2 waits until round start + 2 timeouts, i.e. what phase 1 left of it
    assert waits == [8.0, 8.0]
    assert control.missing == {other}  # nothing came from the other member
