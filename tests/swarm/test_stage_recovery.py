"""A stage that loses every replica comes back (real in-process nodes on 127.0.0.1, one trio loop, a real broker):
S=2, D=1, the stage-1 node killed; its replacement rebuilds it from k erasure-coded shards held outside the stage
(one holder's shard poisoned: it fails its hash, the holder is penalised, another shard is used), the rebuilt state
hashes to the revision the dead node placed, the run rolls back there and trains to its end; a peer outside the run
asking for shards is refused. With m+1 holders gone as well, the replacement falls back to the newest disk
checkpoint and says so."""

from __future__ import annotations

from dataclasses import replace

import pytest
import trio

from shoal.node.run.config import RunConfig
from shoal.protocol import manifest as mf
from shoal.protocol.assignment import GONE
from shoal.protocol.shards import SHARD_PROTOCOL, ShardRequest
from shoal.protocol.wire import pack
from shoal.swarm.net.framing import read_frame, write_frame
from shoal.swarm.run.broker import BrokerConfig
from shoal.swarm.run.client import RunClientConfig
from tests.helpers.swarm import FAST, bare_host, running_node, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.own_process, pytest.mark.usefixtures("one_torch_thread")]


def manifest(steps: int, *, snapshot_every: int = 5, ckpt_every: int = 10) -> mf.RunManifest:
    return mf.RunManifest(
        seed=5, model=mf.ModelSpec(size="custom", n_layers=2, d_model=32, n_heads=4),
        batch=mf.BatchSpec(batch_size=4, micro_batch_size=2, seq_len=32),
        optim=mf.OptimSpec(lr=3e-3, warmup_steps=2, total_steps=steps), eval=mf.EvalSpec(every_steps=0, batches=2),
        plan=mf.ParallelPlan(stages=2, replicas=1),
        checkpoint=mf.CheckpointSpec(every_steps=ckpt_every, keep_last=3, snapshot_every_steps=snapshot_every,
                                     parity=2))


def node_config(m: mf.RunManifest, ckpt_dir, **run):
    b = BrokerConfig(heartbeat_s=0.5, fail_after_s=4.0, lease_renew_s=1.0, lease_timeout_s=8.0, republish_s=1.0,
                     ping_timeout_s=1.0, dht_timeout_s=1.0, dissolve_after_s=300.0)
    rc = RunConfig(manifest=m, threads=1, round_timeout_s=5.0, switch_lead_s=0.5, broker=b, start_wait_s=30.0,
                   client=replace(RunClientConfig(), poll_s=0.5), checkpoint_dir=str(ckpt_dir), min_step_s=0.15,
                   **run)
    return replace(FAST, run=rc)


async def _node(cfg, join, *, task_status=trio.TASK_STATUS_IGNORED):
    """A node that can be killed (its scope cancelled: no leave notice, its host closes)."""
    with trio.CancelScope() as scope:
        async with running_node(join, cfg) as node:
            task_status.started((node, scope))
            await trio.sleep_forever()


def step(node) -> int:
    return node.runtime.at_step if node.runtime is not None else 0


def slot(node):
    return node.runtime.schedule.latest.slot_of(node.peer_id)


async def start_one_by_one(n, cfg, count: int, first=None):
    """Nodes admitted in order (each after the last one's place is in the table), so backups' stages alternate."""
    nodes = [first] if first is not None else []
    while len(nodes) < count:
        join = nodes[0][0].sh.addrs if nodes else ()
        node, kill = await n.start(_node, cfg, join)
        await wait_for(lambda: node.runtime is not None and node.runtime.client is not None
                       and node.runtime.client.table is not None
                       and node.peer_id in {p.peer_id for p in node.runtime.client.table.providers}, 30, "admission")
        nodes.append((node, kill))
    return nodes


async def test_a_stage_that_lost_its_only_node_is_rebuilt_from_shards(tmp_path):
    steps = 60
    cfg = node_config(manifest(steps), tmp_path / "ckpt")
    async with trio.open_nursery() as n:
        (n0, _), (n1, kill1), (b0, _), (b1, _), (h, _) = await start_one_by_one(n, cfg, 5)
        assert slot(n0) == (0, 0) and slot(n1) == (1, 0)
        table = n0.runtime.broker.table
        assert table.backup_stage(b1.peer_id) == 1 and table.backup_stage(b0.peer_id) == 0
        # stage 1's shards: b1 (keeps stage 1 warm), then b0 and h, then n0: k = 4 - m = 2
        await wait_for(lambda: n1.runtime.recovery.shards.placed is not None and
                       n1.runtime.recovery.shards.placed >= 10, 90, "stage 1's shards placed")
        rev = n1.runtime.recovery.shards.placed
        placed_hash = n1.runtime.recovery.shards.own[rev].hash
        held = {x.peer_id: x.runtime.recovery.shards.store.get(1, rev) for x in (n0, b0, b1, h)}
        assert all(held.values()) and sorted(s.index for s in held.values()) == [0, 1, 2, 3]
        assert held[b1.peer_id].index == 0 and held[b0.peer_id].index == 1
        assert max(len(s.data) for s in held.values()) <= placed_bytes(n1, rev) // 2 + 8
        # a peer outside the run asks b0 for its shard: refused, nothing served
        served = b0.runtime.recovery.shards.service.stats.served
        async with bare_host(n0.sh.addrs) as outsider:
            with pytest.raises(Exception):
                stream = await outsider.open_stream(b0.peer_id, SHARD_PROTOCOL)
                req = ShardRequest(want="shard", run_id=n0.runtime.manifest.run_id, stage=1, revision=rev, index=1)
                await write_frame(stream, pack(req.to_wire()))
                await read_frame(stream, 1 << 20)
        assert b0.runtime.recovery.shards.service.stats.refused >= 1
        assert b0.runtime.recovery.shards.service.stats.served == served
        # b0's shard goes bad (a lying or broken holder): the rebuild must notice and use h's instead
        poisoned = held[b0.peer_id]
        poisoned.data = bytes(len(poisoned.data))
        # hold the encoders back from placing newer revisions, so the rebuild meets the poisoned one
        for x in (n0, n1):
            x.runtime.recovery.shards.every_steps = 0
        killed_at = step(n1)
        kill1.cancel()
        await wait_for(lambda: b1.runtime.recovery.rebuilt is not None, 60, "the rebuild")
        rebuilt_stage, snap, source = b1.runtime.recovery.rebuilt
        assert (rebuilt_stage, source, snap.revision, snap.hash) == (1, "shards", rev, placed_hash)
        assert any("fails its hash" in r or "hashes to" in r for r in b1.penalties.reasons(b0.peer_id))
        await wait_for(lambda: n0.runtime.schedule.latest.rollback is not None, 30, "the rollback")
        order = n0.runtime.schedule.latest.rollback
        assert (order.revision, order.stage, order.source) == (rev, 1, "shards") and rev < killed_at
        await wait_for(lambda: all(x.runtime.finished.is_set() for x in (n0, b1)), 120, "the run to finish")
        assert step(n0) == step(b1) == steps
        assert "rolled back" in (n0.runtime.recovery.notice or "")
        n.cancel_scope.cancel()


def placed_bytes(node, rev) -> int:
    r = [x for x in node.runtime.recovery.shards.stats.revisions if x["revision"] == rev]
    return r[-1]["state_bytes"]


async def test_too_few_shards_fall_back_to_the_newest_disk_checkpoint(tmp_path):
    steps = 60
    cfg = node_config(manifest(steps), tmp_path / "ckpt")
    async with trio.open_nursery() as n:
        nodes = await start_one_by_one(n, cfg, 5)
        (n0, _), (n1, kill1) = nodes[:2]
        holders = nodes[2:]
        await wait_for(lambda: n1.runtime.recovery.shards.placed is not None
                       and n1.runtime.recovery.checkpoints.last_step is not None
                       and n1.runtime.recovery.checkpoints.last_step >= 10, 90, "shards and a checkpoint")
        # stage 1's shards are on the three backups and n0 (k = 2, m = 2): m + 1 = 3 holders go with the stage
        for _, kill in holders:
            kill.cancel()
        kill1.cancel()
        gone = [n1.peer_id] + [x.peer_id for x, _ in holders]
        await wait_for(lambda: all(n0.runtime.broker.table.provider_state(p) == GONE for p in gone), 30, "failures")
        newcomer, _ = await n.start(_node, cfg, n0.sh.addrs)  # takes the free slot s1r0, holding nothing
        await wait_for(lambda: newcomer.runtime.recovery is not None and newcomer.runtime.recovery.rebuilt
                       is not None, 60, "the fallback")
        _, snap, source = newcomer.runtime.recovery.rebuilt
        assert source == "disk" and snap.revision % 10 == 0
        assert "disk checkpoint" in newcomer.runtime.recovery.notice
        await wait_for(lambda: n0.runtime.schedule.latest.rollback is not None, 30, "the rollback")
        assert n0.runtime.schedule.latest.rollback.source == "disk"
        await wait_for(lambda: all(x.runtime.finished.is_set() for x in (n0, newcomer)), 120, "the run to finish")
        assert step(n0) == step(newcomer) == steps
        n.cancel_scope.cancel()
