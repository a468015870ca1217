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
from shoal.protocol.manifest import ModelSpec, ParallelPlan, RunManifest, SyncSpec
from shoal.swarm.net.identity import peer_id_of
from shoal.swarm.net.penalty import Penalties
from shoal.swarm.net.pulse import Pulse, PulseConfig
from shoal.protocol.wire import pack
from shoal.protocol import PROTOCOL_VERSION
from shoal.protocol.envelope import signing_payload
from shoal.protocol.signing import sign
from shoal.swarm.net.rpc import BadRequest, RpcError
from shoal.swarm.run.broker import Broker, BrokerConfig, NotBroker
from shoal.swarm.run.context import RunContext
from shoal.swarm.run.client import RunClient, RunClientConfig
from shoal.swarm.run.group import Group
from shoal.protocol.tabledelta import table_digest
from tests.helpers.swarm import HW

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


def context(clock, replicas: int = 2, *, me=None, pulse=None, wall=lambda: 1.7e9, sent=None) -> RunContext:
    """`sent`: a list that collects what the context publishes (default: dropped)."""
    m = RunManifest.default(plan=ParallelPlan(replicas=replicas, sync=SyncSpec(method="allreduce")))

    async def publish(env: bytes) -> None:
        if sent is not None:
            sent.append(env)

    return RunContext(sh=me or signer(), manifest=m, register=lambda name, handler: None, publish=publish,
                      clock=clock, wall=wall, pulse=pulse)


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
        b.renew_lease()  # (its lease loop renews every second)
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
    assert b.seating.promotions[-1][1:] == ("s0r0", a, backup)


async def test_the_standby_stays_while_suspect_and_is_replaced_once_gone_and_a_suspect_is_never_named():
    """Re-naming the standby on every missed beat made it flap under load, and a broker that died between two
    versions of its table left nodes naming different standbys (two takeovers at one lease epoch)."""
    clock = FakeClock()
    b = Broker(context(clock, replicas=3), CFG)
    a, c, d = await admitted(b, 3)
    assert b.table.standby == a

    def beat(dt: float, silent: tuple[str, ...]) -> None:
        clock.advance(dt)
        b.renew_lease()
        for p in (a, c, d):
            if p not in silent:
                b.touch(p)
        b.check_liveness()

    beat(3.01, (a, c))  # the standby and the next candidate miss three beats
    assert b.providers[a].suspect and b.table.standby == a  # kept while suspect
    beat(1.0, (c,))  # the standby is back; c still silent
    assert not b.providers[a].suspect and b.providers[c].suspect and b.table.standby == a
    beat(1.0, ())
    beat(10.01, (a,))  # the standby is gone (fail_after_s of silence), c is back: c is named
    assert b.providers[a].state == GONE and b.table.standby == c
    beat(3.01, (c,))
    assert b.table.standby == c  # suspect, kept
    beat(7.01, (c,))  # gone: d, never suspect, is named
    assert b.providers[c].state == GONE and b.table.standby == d


async def test_a_straggler_moves_to_the_pool_on_its_third_miss_within_the_window_and_is_held_there():
    clock = FakeClock()
    b = Broker(context(clock), CFG)
    slow, other, backup = await admitted(b, 3)
    epoch = b.epochs[0]
    b.missed_round(slow, 0, "missed")
    clock.advance(100.01)  # the first miss leaves the window
    b.renew_lease()
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
        b.renew_lease()
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
    b.renew_lease()  # (its lease loop renews meanwhile)
    b.touch(s0), b.touch(b0)
    b.check_liveness()
    assert b.seating.dissolved == 1 and b.table.slot_of(s0) is None and b.table.backup_stage(s0) == 0


async def test_a_lane_with_two_empty_slots_is_dissolved_once():
    clock = FakeClock()
    ctx = context(clock)
    ctx.manifest = RunManifest.default(plan=ParallelPlan(stages=3, replicas=1, sync=SyncSpec(method="none")),
                                       model=ModelSpec(size="custom", n_layers=3))
    b = Broker(ctx, CFG)
    peers = await admitted(b, 3)
    assert sorted(b.table.slot_of(p) for p in peers) == [(0, 0), (1, 0), (2, 0)]
    gone = [p for p in peers if b.table.slot_of(p)[0] in (0, 1)]
    for p in gone:  # both ends of one link, and no backup: two empty slots in lane 0
        b.mark_failed(p, "gone")
    survivor = next(p for p in peers if p not in gone)
    epochs = b.epochs[:]
    clock.advance(60.0)
    b.renew_lease()
    b.touch(survivor)
    b.check_liveness()
    assert b.seating.dissolved == 1 and b.table.slot_of(survivor) is None and b.table.backup_stage(survivor) == 2
    assert b.epochs == [e + 1 for e in epochs]  # one group change for the one lane


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
    client = RunClient(context(clock, me=me), HW, broker_id=broker_ctx.me, broker_config=CFG)
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


def test_the_first_round_of_an_epoch_waits_longer_for_a_member_entering_it_and_only_that_round():
    """An entering member pulls revision R once the others got there: its first round gets entry_grace_rounds more
    round timeouts (docs/architecture.md, "Entering a group"); later rounds, and members that were there, do not."""
    clock = FakeClock()
    waits = []

    def exchange(tag, sends, expect, timeout_s):
        waits.append(round(timeout_s, 6))
        return dict(sends)  # every member answers at once

    sync = AllReduceSync(exchange=lambda t, s, e, x: {**exchange(t, s, e, x), "new": s["me"]}, penalties=Penalties(),
                         config=SyncConfig(round_timeout_s=8.0, entry_grace_rounds=2.0), clock=clock)
    model = torch.nn.Linear(4, 1)

    def round_(step: int, epoch: int, entering: frozenset[str]) -> None:
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        g = Group(run_id="r" * 64, epoch=epoch, members=("me", "new"), me="me", entering=entering)
        sync.before_optimizer_step(model, None, StepControl(step=step, group=g))

    round_(10, 1, frozenset({"new"}))  # "new" enters at this epoch's first step
    assert waits == [24.0, 32.0]  # phase 1: 8 + 2 x 8; phase 2: round start + 2 x 8 + 16
    waits.clear()
    round_(11, 1, frozenset({"new"}))  # the same epoch's next round: no grace
    assert waits == [8.0, 16.0]
    waits.clear()
    round_(12, 2, frozenset())  # a re-formed group (same members): nobody enters, no grace
    assert waits == [8.0, 16.0]


# -- freezes, leases and restarts (issue 18) ----------------------------------------------------------------------
def tick(clock: FakeClock, pulse: Pulse, seconds: float) -> None:
    """The event loop running for `seconds`: the pulse ticks every 0.25 s."""
    for _ in range(round(seconds / 0.25)):
        clock.advance(0.25)
        pulse.check()


def test_the_pulse_tells_a_freeze_from_a_running_loop_and_restarts_silence_at_the_resume():
    clock = FakeClock()
    pulse = Pulse(clock, PulseConfig(tick_s=0.25, freeze_after_s=2.0))
    heard = clock()
    tick(clock, pulse, 5.0)
    assert pulse.silent_s(heard) == 5.0 and not pulse.freezes
    clock.advance(2.0)  # exactly the threshold: a slow loop, not a freeze
    assert pulse.check() == 0.0
    clock.advance(30.0)  # SIGSTOP: nothing ran for 30 s
    assert pulse.silent_s(heard) == 0.0  # noticed by whoever reads first, before any ticker runs
    assert pulse.freezes == [(clock(), 30.0)]
    tick(clock, pulse, 1.5)
    assert pulse.silent_s(heard) == 1.5


async def test_the_pulse_counts_neither_the_nodes_start_nor_its_end_as_a_freeze(autojump_clock):
    """A node makes its pulse first and starts it seconds later, once its host is open; a thread it left finishing
    a step may read it after the node stopped. Neither gap is a freeze (each once logged "this process stood
    still" and restarted every silence timer)."""
    pulse = Pulse(trio.current_time)
    await trio.sleep(6.0)  # the node's start
    async with trio.open_nursery() as n:
        await n.start(pulse.run)
        await trio.sleep(3.0)
        assert pulse.check() == 0.0 and not pulse.freezes
        autojump_clock.jump(10.0)  # a real freeze while it runs
        await trio.sleep(0.5)
        assert [round(g) for _, g in pulse.freezes] == [10]
        n.cancel_scope.cancel()
    await trio.sleep(20.0)  # the node is gone
    assert pulse.check() == 0.0 and len(pulse.freezes) == 1


async def test_a_broker_frozen_past_its_lease_stands_down_before_it_acts():
    clock = FakeClock()
    b = Broker(context(clock, pulse=Pulse(clock)), CFG)
    a, c, backup = await admitted(b, 3)
    b.renew_lease()
    version, states = b.table.version, {p.peer_id: p.state for p in b.providers.values()}
    clock.advance(CFG.lease_timeout_s + 0.01)  # frozen: no renewal and no word from anyone for longer than the lease
    b.check_liveness()  # whichever of its tasks wakes first
    assert b.deposed and b.table.version == version  # no rebuild, nothing published
    assert {p.peer_id: p.state for p in b.providers.values()} == states  # nobody marked failed
    assert not b.mark_failed(a, "silent") and b.table.version == version
    with pytest.raises(NotBroker):
        await b.admit(signer().peer_id, AdmitRequest(run_id=b.ctx.run_id, hardware=HW))
    assert (await b.handle("run.table", c, None))["lease"] is None  # an answer is not a renewal


async def test_a_poll_naming_the_table_it_holds_gets_the_lease_alone_and_a_changed_table_in_full():
    clock = FakeClock()
    b = Broker(context(clock), CFG)
    a, c, backup = await admitted(b, 3)
    b.renew_lease()
    ask = {"run_id": b.ctx.run_id}
    full = await b.handle("run.table", c, ask)
    assert full["table"] == b.table_env and full["lease"] is not None
    held = table_digest(b.table_env)
    same = await b.handle("run.table", c, {**ask, "have": held})
    assert same == {"table": None, "lease": full["lease"]}
    assert len(pack(same)) < 400 < len(pack(full))
    b.mark_failed(a, "silent")  # a new version: a poll naming the old one gets it
    newer = await b.handle("run.table", c, {**ask, "have": held})
    assert newer["table"] == b.table_env and newer["table"] != full["table"]
    for bad in (b"x" * 15, b"x" * 17, "00" * 16, 7):
        with pytest.raises(BadRequest):
            await b.handle("run.table", c, {**ask, "have": bad})


async def test_a_broker_frozen_within_its_lease_fails_nobody_for_its_own_silence():
    clock = FakeClock()
    pulse = Pulse(clock)
    cfg = BrokerConfig(heartbeat_s=1.0, fail_after_s=4.0, lease_renew_s=1.0, lease_timeout_s=6.0)
    b = Broker(context(clock, pulse=pulse), cfg)
    a, c, backup = await admitted(b, 3)
    b.renew_lease()
    clock.advance(5.0)  # frozen for longer than fail_after_s, within the lease
    b.check_liveness()
    assert not b.deposed and all(p.state != GONE for p in b.providers.values())
    b.renew_lease()

    def run_for(seconds: float) -> None:
        tick(clock, pulse, seconds)
        b.renew_lease()
        b.touch(c), b.touch(backup)  # `a` stays silent
        b.check_liveness()

    run_for(4.0)  # silence counts from the resume: exactly fail_after_s, not yet failed
    assert b.providers[a].state == ACTIVE
    run_for(0.25)
    assert b.providers[a].state == GONE and b.table.slot_of(backup) is not None


async def test_the_broker_loops_stop_at_once_after_a_freeze_past_the_lease(autojump_clock):
    sent: list[bytes] = []
    ctx = context(trio.current_time, pulse=Pulse(trio.current_time))

    async def publish(env: bytes) -> None:
        sent.append(env)

    ctx.publish = publish
    b = Broker(ctx, CFG)
    async with trio.open_nursery() as n:
        await n.start(ctx.pulse.run)
        await n.start(b.run)
        peers = await admitted(b, 3)
        for _ in range(40):  # ten healthy seconds
            for p in peers:
                b.touch(p)
            await trio.sleep(0.25)
        assert not b.deposed and any(isinstance(open_envelope(e, RUN_RECORD_TYPES).record, BrokerLease) for e in sent)
        version, before = b.table.version, len(sent)
        autojump_clock.jump(CFG.lease_timeout_s + 4)  # SIGSTOP: the clock moves on while no task runs
        await trio.sleep(3 * CFG.heartbeat_s)  # every loop wakes, in whatever order
        assert b.deposed and b.table.version == version
        assert all(p.state != GONE for p in b.providers.values())
        assert not [e for e in sent[before:] if isinstance(open_envelope(e, RUN_RECORD_TYPES).record, BrokerLease)]
        n.cancel_scope.cancel()


async def standby_client(clock, pulse=None) -> tuple[Broker, RunClient, SimpleNamespace]:
    b = Broker(context(clock), CFG)
    me = signer()
    assert (await b.admit(me.peer_id, AdmitRequest(run_id=b.ctx.run_id, hardware=HW))).admitted
    await admitted(b, 1)
    client = RunClient(context(clock, me=me, pulse=pulse), HW, broker_id=b.ctx.me, broker_config=CFG)
    assert client.accept_envelope(b.table_env, b.ctx.me) and client.table.standby == me.peer_id
    return b, client, me


def lease_env(b: Broker, issued: float) -> bytes:
    return seal(BrokerLease(peer_id=b.ctx.me, run_id=b.ctx.run_id, lease_epoch=b.lease_epoch, time=issued,
                            expires_at=issued + 6), b.ctx.sh.key)


async def test_a_standby_that_was_frozen_waits_a_full_lease_before_taking_over():
    clock = FakeClock()
    pulse = Pulse(clock)
    _, client, _ = await standby_client(clock, pulse)
    clock.advance(30.0)  # the standby itself was frozen
    assert not client.lease_lapsed()
    tick(clock, pulse, CFG.lease_timeout_s)
    assert not client.lease_lapsed()
    tick(clock, pulse, 0.25)
    assert client.lease_lapsed()


async def test_only_a_renewal_of_the_lease_is_evidence_that_the_broker_lives():
    clock = FakeClock()
    b, client, _ = await standby_client(clock)
    first = lease_env(b, 1.7e9)
    client.accept_envelope(first, b.ctx.me)
    clock.advance(6.01)
    assert client.lease_lapsed()
    client.accept_envelope(first, b.ctx.me)  # the same lease again (a broker that stood down still serves it)
    assert client.lease_lapsed()
    client.accept_envelope(lease_env(b, 1.7e9 + 3), b.ctx.me)  # a renewal
    assert not client.lease_lapsed()


async def test_a_later_table_of_the_old_broker_cannot_make_a_node_reject_the_standbys_takeover():
    clock = FakeClock()
    b, client, me = await standby_client(clock)
    standby_table = b.table  # names `me` as standby
    late = signer().peer_id
    assert (await b.admit(late, AdmitRequest(run_id=b.ctx.run_id, hardware=HW))).admitted
    b.standby = late  # the old broker's post-freeze table names another standby
    b._rebuild()
    assert client.accept_envelope(b.table_env, b.ctx.me) and client.table.standby == late
    takeover = Broker.from_table(context(clock, me=me), CFG, standby_table)
    assert not client.accept_envelope(takeover.table_env, me.peer_id)  # not before the lease lapsed here
    clock.advance(CFG.lease_timeout_s + 0.1)
    assert client.accept_envelope(takeover.table_env, me.peer_id)  # `me` was the standby of this lease epoch
    assert client.broker_id == me.peer_id and client.table.lease_epoch == 1
    stranger = Broker.from_table(context(clock), CFG, standby_table)  # never named standby: not trusted
    assert not client.accept_envelope(stranger.table_env, stranger.ctx.me)


class Witnessed(RunClient):
    """A standby whose RPCs reach in-memory run clients (`peers`, by peer id: real RunClients answering with their
    own handler); anyone else, the broker included, does not answer, and the DHT holds no fresh lease."""

    peers: dict[str, RunClient] = {}

    async def _call(self, peer_id, method, body):
        if peer_id not in self.peers or method != "run.table":
            raise RpcError(f"{peer_id[:8]} does not answer")
        return await self.peers[peer_id]._rpc_table(self.me, body)

    async def _dht_lease_alive(self, broker):
        return False


async def starved_standby(clock, witness_lease) -> tuple[Broker, Witnessed, list[RunClient]]:
    """A standby whose lease evidence is `lease_timeout_s` old (it read no gossip while starved), and two members
    that each accepted `witness_lease(broker)` (an envelope) as the newest lease they saw."""
    b = Broker(context(clock), CFG)
    me = signer()
    assert (await b.admit(me.peer_id, AdmitRequest(run_id=b.ctx.run_id, hardware=HW))).admitted
    members = []
    for m in [signer(), signer()]:
        assert (await b.admit(m.peer_id, AdmitRequest(run_id=b.ctx.run_id, hardware=HW))).admitted
        members.append(RunClient(context(clock, me=m), HW, broker_id=b.ctx.me, broker_config=CFG))
    client = Witnessed(context(clock, me=me), HW, broker_id=b.ctx.me, broker_config=CFG)
    assert client.accept_envelope(b.table_env, b.ctx.me) and client.table.standby == me.peer_id
    assert client.accept_envelope(lease_env(b, 1.7e9 - 4), b.ctx.me)
    for m in members:
        assert m.accept_envelope(b.table_env, b.ctx.me)
        m.accept_envelope(witness_lease(b), b.ctx.me)
    client.peers = {m.me: m for m in members}
    assert sorted(client.lease_witnesses(client.table)) == sorted(client.peers)  # neither itself nor the broker
    clock.advance(CFG.lease_timeout_s + 0.5)
    assert client.lease_lapsed()
    return b, client, members


async def follow_once(client: RunClient) -> None:
    async with trio.open_nursery() as n:
        client._nursery = n
        await client._follow_once()
        n.cancel_scope.cancel()


async def test_a_starved_standby_does_not_take_over_while_members_hold_a_newer_renewal_of_the_lease():
    """Seen in a suite run with eight nodes starting at once on two cores: a standby that read its gossip late took
    over a live broker's run, every other member refused the takeover, and the run stayed split for minutes."""
    clock = FakeClock()
    b, client, members = await starved_standby(clock, lambda b: lease_env(b, 1.7e9))  # renewed after ours
    assert all(m._lease_env == lease_env(b, 1.7e9) for m in members)  # taken from gossip, served with the table
    await follow_once(client)
    assert not client.is_broker() and not client.lease_lapsed() and client.broker_id == b.ctx.me
    clock.advance(CFG.lease_timeout_s + 0.5)  # ... and once that renewal is as old, with no newer one: it takes over
    await follow_once(client)
    assert client.is_broker() and client.table.lease_epoch == 1


def forged_lease(b: Broker, lasts_s: float = 6) -> bytes:
    """A fresh lease in the broker's name, signed by someone else (lasting 0 s: a release)."""
    lease = BrokerLease(peer_id=b.ctx.me, run_id=b.ctx.run_id, lease_epoch=0, time=1.7e9,
                        expires_at=1.7e9 + lasts_s)
    body = pack(lease.to_wire())
    return pack({"v": PROTOCOL_VERSION, "kind": "lease", "body": body,
                 "sig": sign(signer().key, signing_payload("lease", body))})


@pytest.mark.parametrize("serve", [
    lambda b: lease_env(b, 1.7e9 - 4),  # the broker died: the members saw no renewal after ours either
    lambda b: lease_env(b, 1.7e9 - 12),  # a lying member replays an old lease of the broker
    forged_lease,  # ... or forges a fresh one
], ids=["same-lease", "replayed-old-lease", "forged-lease"])
async def test_a_standby_takes_over_when_no_member_holds_a_valid_newer_renewal(serve):
    clock = FakeClock()
    b, client, members = await starved_standby(clock, lambda b: lease_env(b, 1.7e9 - 4))
    for m in members:
        m._lease_env = serve(b)  # what each serves with its table (a liar serves what it would not accept itself)
    await follow_once(client)
    assert client.is_broker() and client.table.lease_epoch == 1 and client.takeovers


def release_env(b: Broker, issued: float) -> bytes:
    return seal(BrokerLease(peer_id=b.ctx.me, run_id=b.ctx.run_id, lease_epoch=b.lease_epoch, time=issued,
                            expires_at=issued), b.ctx.sh.key)


async def test_a_released_lease_lets_the_standby_take_over_at_once_and_the_members_accept_it():
    clock = FakeClock()
    b, client, me = await standby_client(clock)
    member = RunClient(context(clock), HW, broker_id=b.ctx.me, broker_config=CFG)
    assert member.accept_envelope(b.table_env, b.ctx.me)
    for c in (client, member):
        c.accept_envelope(lease_env(b, 1.7e9 - 2), b.ctx.me)
    takeover = Broker.from_table(context(clock, me=me), CFG, b.table)
    assert not client.lease_lapsed() and not member.accept_envelope(takeover.table_env, me.peer_id)
    for c in (client, member):
        c.accept_envelope(forged_lease(b, lasts_s=0), b.ctx.me)  # a release in the broker's name, not its own
        c.accept_envelope(release_env(b, 1.7e9 - 3), b.ctx.me)  # older than the renewal seen: proves nothing
    assert not client.lease_lapsed() and not member.accept_envelope(takeover.table_env, me.peer_id)
    for c in (client, member):
        c.accept_envelope(release_env(b, 1.7e9 - 1), b.ctx.me)
    assert client.lease_lapsed()  # at once: no wait for the lease to run out
    assert member.accept_envelope(takeover.table_env, me.peer_id) and member.broker_id == me.peer_id
    client.accept_envelope(lease_env(b, 1.7e9), b.ctx.me)  # a renewal after the release: the broker lives after all
    assert not client.lease_lapsed()


async def test_a_release_ends_its_lease_epoch_only():
    """A broker that released its lease and, nobody taking over, took it back under the next epoch holds that one:
    the release is no reason for the next standby to take over, nor for a member to accept its takeover."""
    clock = FakeClock()
    b, client, me = await standby_client(clock)
    client.accept_envelope(release_env(b, 1.7e9 - 1), b.ctx.me)
    assert client.lease_lapsed()
    b.lease_epoch += 1  # it took its lease back (the same peer, the next epoch); `me` is still its standby
    b._rebuild()
    assert client.accept_envelope(b.table_env, b.ctx.me) and client.table.lease_epoch == 1
    assert client.table.standby == me.peer_id and not client.lease_lapsed()


async def test_a_restarted_broker_releases_its_lease_by_gossip_and_with_its_table(autojump_clock):
    sent: list[bytes] = []
    client, old, others = await orphan(sent=sent)
    async with trio.open_nursery() as n:
        client._nursery = n
        n.start_soon(client._settle_lease)  # no takeover shows up: it waits
        await trio.sleep(1.0)
        leases = [open_envelope(e, RUN_RECORD_TYPES).record for e in sent]
        assert [(x.peer_id, x.lease_epoch, x.expires_at == x.time) for x in leases] == [(client.me, 0, True)]
        served = await client._rpc_table(old.table.standby, {"run_id": client.ctx.run_id})
        assert served["lease"] == sent[0]  # a standby polling the broker gets it too
        n.cancel_scope.cancel()


class ScriptedStandby(RunClient):
    """A run client whose look at the standby is scripted (the network part, tested on real nodes elsewhere):
    the standby's takeover table shows up `takeover_after_s` virtual seconds after the start, or never."""

    takeover_env: bytes | None = None
    takeover_after_s: float = float("inf")
    started = 0.0

    async def _follow_standby(self) -> None:
        if self.takeover_env is not None and trio.current_time() - self.started >= self.takeover_after_s:
            self.accept_envelope(self.takeover_env, self.table.standby)


async def orphan(standby: bool = True, sent=None) -> tuple[ScriptedStandby, Broker, list[SimpleNamespace]]:
    """A node restarted with the broker's identity: the table it fetched names it broker, and it holds no lease.
    Also: its previous life's broker, and the other providers (signers: the standby can sign its takeover)."""
    me = signer()
    old = Broker(context(trio.current_time, me=me), CFG)  # its previous life
    others = [signer() for _ in range(3 if standby else 0)]
    for o in [me, *others]:  # the broker's node holds a slot too
        assert (await old.admit(o.peer_id, AdmitRequest(run_id=old.ctx.run_id, hardware=HW))).admitted
    assert (old.table.standby is not None) == standby
    client = ScriptedStandby(context(trio.current_time, me=me, sent=sent), HW, broker_id=me.peer_id, broker_config=CFG,
                             config=RunClientConfig(poll_s=3.0, rpc_timeout_s=5.0, retry_s=1.0))
    assert client.accept_envelope(old.table_env, me.peer_id) and client.orphaned()
    client.started = trio.current_time()
    return client, old, others


async def test_a_restarted_broker_takes_its_lease_back_only_after_a_takeover_could_have_happened(autojump_clock):
    client, old, _ = await orphan()
    assert client.takeover_s() == CFG.lease_timeout_s + 3.0 + 5.0 + CFG.dht_timeout_s
    async with trio.open_nursery() as n:
        client._nursery = n
        await client._settle_lease()
        took = trio.current_time() - client.started
        assert client.takeover_s() <= took < client.takeover_s() + 1.0  # a last look at the standby, then back
        assert client.is_broker() and client.table.peer_id == client.me
        assert client.table.lease_epoch == old.lease_epoch + 1  # legitimately: the next epoch, after the settle
        assert client.provider_state() == GONE  # its old slot is given up: it is admitted again, with state
        n.cancel_scope.cancel()


async def test_a_broker_frozen_past_its_lease_takes_it_back_in_its_slot(autojump_clock):
    """Seen in a churn run: the broker's node, frozen 6.8 s, came back holding the run's newest state (step 123),
    found no standby to take over, took its lease back and counted itself failed as a restarted broker is: it left
    its slot, and with the other members gone too the run rolled back 23 steps to a disk checkpoint. A broker that
    stood down in this process still holds its state: it keeps its slot, as a member frozen that long does."""
    client, old, _ = await orphan(standby=False)
    slot = old.table.slot_of(client.me)
    client.local_broker = old  # this process's own broker, not a previous life's
    old.stand_down("its lease lapsed while the process stood still")
    assert client.orphaned() and slot is not None
    async with trio.open_nursery() as n:
        client._nursery = n
        await client._settle_lease()
        assert client.is_broker() and client.table.lease_epoch == old.lease_epoch + 1
        assert client.provider_state() == ACTIVE and client.slot() == slot
        n.cancel_scope.cancel()


async def test_a_restarted_broker_follows_the_standby_that_took_over(autojump_clock):
    client, old, others = await orphan()
    standby = next(o for o in others if o.peer_id == old.table.standby)
    client.takeover_env = Broker.from_table(context(trio.current_time, me=standby), CFG, old.table).table_env
    client.takeover_after_s = 7.0
    async with trio.open_nursery() as n:
        client._nursery = n
        await client._settle_lease()
        assert trio.current_time() - client.started == 7.0  # polled every retry_s: seen at once
        assert not client.is_broker() and client.broker_id == standby.peer_id and not client.orphaned()
        n.cancel_scope.cancel()


async def test_with_no_standby_named_a_restarted_broker_takes_its_lease_back_at_once(autojump_clock):
    client, old, _ = await orphan(standby=False)
    async with trio.open_nursery() as n:
        client._nursery = n
        await client._settle_lease()
        assert trio.current_time() == client.started and client.is_broker()
        n.cancel_scope.cancel()


async def test_admission_retries_last_at_least_as_long_as_a_takeover_can_take(autojump_clock):
    slow = BrokerConfig(heartbeat_s=5.0, fail_after_s=60.0, lease_renew_s=3.0, lease_timeout_s=60.0)
    me = signer()
    client = RunClient(context(trio.current_time, me=me), HW, broker_id=signer().peer_id, broker_config=slow,
                       config=RunClientConfig(admit_timeout_s=40.0, retry_s=1.0))
    assert client.takeover_s() > 40.0

    async def unreachable() -> None:
        raise RpcError("no route")

    client.admit = unreachable
    t0 = trio.current_time()
    with pytest.raises(RpcError, match="no answer"):
        await client._admit_until_deadline()
    assert client.takeover_s() - 1.0 <= trio.current_time() - t0 <= client.takeover_s()


async def test_a_provider_that_restarts_in_its_slot_enters_again_ahead_and_a_backup_keeps_its_place():
    clock = FakeClock()
    progress = {"step": 0}
    ctx = context(clock)
    ctx.switch_step = lambda stage: progress["step"]
    b = Broker(ctx, CFG)
    a, c, first, second = await admitted(b, 4)
    assert b.table.backups == (first, second) and b.table.switch_step(0) == 0
    progress["step"] = 120  # the run trains on; then `a` restarts with its identity and asks again
    epoch, reforms = b.epochs[0], b.reforms
    resp = await b.admit(a, AdmitRequest(run_id=ctx.run_id, hardware=HW))
    assert resp.slot == "s0r0" and b.epochs[0] == epoch + 1 and b.reforms == reforms + 1
    assert b.table.switch_step(0) == 120  # it enters there, with the group's state
    await b.admit(first, AdmitRequest(run_id=ctx.run_id, hardware=HW))  # a backup restarts
    assert b.table.backups == (first, second) and b.epochs[0] == epoch + 1


async def test_members_the_table_counts_failed_are_counted_out_of_our_groups_rounds():
    """Seen in a churn run: a member frozen 8 s was counted failed and replaced, and the two others waited in their
    round for it until its deadline (16 s more). The runtime tells its collective, for the group it trains in (and
    the one of the step in flight), which members the newest table counts failed."""
    from shoal.node.run.runtime import RunRuntime

    clock = FakeClock()
    b = Broker(context(clock, replicas=3), CFG)
    me, a, c, backup = await admitted(b, 4)
    group = Group(run_id=b.ctx.run_id, epoch=2, members=tuple(sorted((me, a, c))), me=me)
    counted: list[tuple[str, set[str]]] = []
    rt = SimpleNamespace(collective=SimpleNamespace(count_out=lambda prefix, peers: counted.append((prefix, peers))),
                         replica=SimpleNamespace(trainer=object(), at_step=40), group_at=lambda step: group,
                         _stepping=(40, group))
    RunRuntime._count_out_failed(rt, b.table)
    assert counted == []  # nobody failed yet
    b.mark_failed(c, "frozen past fail_after_s")
    assert b.table.provider_state(c) == GONE and b.table.slot_of(backup) is not None
    RunRuntime._count_out_failed(rt, b.table)
    assert counted == [(group.epoch_tag(), {c})]
