"""Shard placement, a holder's store and the broker's rollback rule, without a network: holders are outside the
stage (backups first, one shard each), a holder keeps the newest committed revision and the one being written, a
signed manifest is checked field by field, and only a holder of a lost stage may send the run back."""

from __future__ import annotations

import pytest

from shoal.protocol.assignment import AdmitRequest, RollbackRequest
from shoal.protocol.envelope import seal
from shoal.protocol.errors import ProtocolError
from shoal.protocol.manifest import ParallelPlan, RunManifest, SyncSpec
from shoal.protocol.shards import ShardManifest
from shoal.swarm.run.broker import Broker
from shoal.swarm.state.shards import HeldShard, ShardStore, open_manifest, shard_holders
from tests.helpers.swarm import HW
from tests.unit.test_run_timing import CFG, FakeClock, context, signer


async def two_stage_broker(n: int):
    clock = FakeClock()
    ctx = context(clock)
    ctx.manifest = RunManifest.default(plan=ParallelPlan(stages=2, replicas=1, sync=SyncSpec(method="none")))
    b = Broker(ctx, CFG)
    peers = [signer().peer_id for _ in range(n)]
    for p in peers:
        assert (await b.admit(p, AdmitRequest(run_id=ctx.run_id, hardware=HW))).admitted
    return b, peers, ctx


async def test_holders_are_outside_the_stage_backups_first_one_shard_each():
    b, (s1, s0, w0, w1, w0b), _ = await two_stage_broker(5)
    t = b.table
    assert t.slot_of(s0) == (0, 0) and (t.backup_stage(w0), t.backup_stage(w1), t.backup_stage(w0b)) == (0, 1, 0)
    k, holders = shard_holders(t, 0, m=2, max_k=8)
    assert (k, holders) == (2, (w0, w0b, w1, s1))
    assert shard_holders(t, 0, m=1, max_k=2) == (2, (w0, w0b, w1))
    assert shard_holders(t, 0, m=4, max_k=8) == (0, ())  # 4 peers outside the stage, 5 needed


def manifest_for(encoder, holders, revision=10, k=2, m=1):
    return ShardManifest(peer_id=encoder.peer_id, run_id="r" * 64, stage=0, revision=revision, state_hash="a" * 64,
                         state_bytes=100, k=k, m=m, shard_bytes=56, shard_hashes=("b" * 64,) * (k + m),
                         holders=tuple(holders), time=1.7e9)


def test_a_manifest_is_checked_and_opened_only_with_its_signature():
    enc, others = signer(), [signer().peer_id for _ in range(3)]
    man = manifest_for(enc, others)
    assert open_manifest(seal(man, enc.key)) == man
    raw = bytearray(seal(man, enc.key))
    raw[-1] ^= 1  # the signature's last byte
    with pytest.raises(ProtocolError):
        open_manifest(bytes(raw))
    with pytest.raises(ProtocolError):  # a peer holding two shards
        manifest_for(enc, [others[0], others[0], others[1]])
    with pytest.raises(ProtocolError):  # the encoder holding one of its own
        manifest_for(enc, [enc.peer_id] + others[:2])
    with pytest.raises(ProtocolError):  # shards too small for the state
        ShardManifest(**{**man.to_wire(), "shard_bytes": 40, "shard_hashes": man.shard_hashes, "holders": man.holders})


def test_a_holder_keeps_the_newest_committed_revision_and_the_one_being_written():
    enc, others = signer(), [signer().peer_id for _ in range(3)]
    store = ShardStore()

    def put(rev):
        man = manifest_for(enc, others, revision=rev)
        store.put(HeldShard(manifest=man, raw=b"", index=1, data=bytes(56)))

    put(10)
    put(20)
    assert [h.revision for h in store.holdings()] == [20]  # nothing committed: only the newest
    assert store.commit(0, 20) and not store.commit(0, 10)
    put(30)
    put(40)
    assert [h.revision for h in store.holdings()] == [20, 40] and store.nbytes == 2 * 56
    store.commit(0, 40)
    assert [h.revision for h in store.holdings()] == [40]
    store.drop_newer(0, 30)
    assert store.holdings() == []


async def test_only_a_holder_of_a_lost_stage_may_roll_the_run_back():
    b, (s1, s0, w0, w1), ctx = await two_stage_broker(4)
    b.switch_steps = [40, 40]  # the run trained to about step 40
    b._rebuild()
    ask = RollbackRequest(run_id=ctx.run_id, stage=0, revision=30, source="shards")
    assert "still has a member" in b.rollback_refusal(s0, ask)  # the stage's own node is alive
    assert "holds no slot" in b.rollback_refusal(s1, ask)
    b.mark_failed(s0, "gone")  # w0 takes the slot, from a step past 40
    assert b.table.slot_of(w0) == (0, 0)
    assert b.rollback_refusal(w0, ask) is None
    assert "past every step" in b.rollback_refusal(w0, RollbackRequest(**{**ask.to_wire(), "revision": 10**6}))
    ans = await b._rpc_rollback(w0, ask.to_wire())
    assert ans == {"accepted": True, "count": 1}
    t = b.table
    assert t.rollback.revision == 30 and t.switch_steps == (30, 30) and t.rollback.source == "shards"
    assert await b._rpc_rollback(w0, ask.to_wire()) == {"accepted": True, "count": 1}  # asked again: the same one


def recovery_of(me, broker, tables):
    from shoal.node.run.recovery import StageRecovery
    from shoal.swarm.run.timeline import GroupTimeline

    sched = GroupTimeline(me)
    for t in tables:
        sched.add(t)
    return StageRecovery(me, broker.ctx.manifest, sched, shards=None, statuses=lambda: [])


async def test_a_stage_is_lost_when_nobody_who_held_it_is_left():
    b, (s1, s0, w0, w1), ctx = await two_stage_broker(4)
    b.switch_steps = [40, 40]
    b._rebuild()
    before = b.table
    ctx.switch_step = lambda stage: 60  # the run trained to about step 55: changes take effect at 60
    b.mark_failed(s0, "gone")  # stage 0's only node: w0 takes its slot, holding none of it
    after = b.table
    entry = after.switch_step(0)
    assert after.slot_of(w0) == (0, 0) and entry > 40
    # the replacement: its own stage is lost; the other stage's node: stage 0 is lost, its own is not (it holds it)
    assert recovery_of(w0, b, [before, after]).lost_stages(entry, 0, holds_own=False) == [0]
    assert recovery_of(s1, b, [before, after]).lost_stages(entry, 1, holds_own=True) == [0]
    # a replica that loses one of two: nothing is lost
    b2, (a, c, d), ctx2 = await two_stage_broker_d2()
    t1 = b2.table
    ctx2.switch_step = lambda stage: 60
    b2.mark_failed(a, "gone")
    t2 = b2.table
    joiner = next(p for p in t2.members(0) if p not in t1.members(0))
    assert recovery_of(joiner, b2, [t1, t2]).lost_stages(t2.switch_step(0), 0, holds_own=False) == []
    # seated straight into a slot (no table before): lost only when nobody else holds the stage now
    assert recovery_of(joiner, b2, [t2]).lost_stages(t2.switch_step(0), 0, holds_own=False) == []
    b.mark_failed(w0, "gone")
    b.mark_failed(w1, "gone")
    emptied = b.table
    newcomer = signer().peer_id
    await b.admit(newcomer, AdmitRequest(run_id=ctx.run_id, hardware=HW))
    assert b.table.slot_of(newcomer) == (0, 0)
    assert recovery_of(newcomer, b, [emptied, b.table]).lost_stages(b.table.switch_step(0), 0, holds_own=False) == [0]


async def two_stage_broker_d2():
    clock = FakeClock()
    ctx = context(clock, replicas=2)
    b = Broker(ctx, CFG)
    peers = [signer().peer_id for _ in range(3)]
    for p in peers:
        assert (await b.admit(p, AdmitRequest(run_id=ctx.run_id, hardware=HW))).admitted
    b.switch_steps = [40]
    b._rebuild()
    return b, peers, ctx
