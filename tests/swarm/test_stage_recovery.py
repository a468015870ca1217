"""A stage that loses every replica comes back (real in-process nodes on 127.0.0.1, one trio loop, a real broker):
S=2, D=1, the stage-0 node killed; its replacement rebuilds it from k erasure-coded shards held outside the stage
(one holder's shard poisoned: it fails its hash, the holder is penalised, another shard is used), the rebuilt state
hashes to the revision the dead node placed, the run rolls back there and trains to its end; a peer outside the run
asking for shards is refused. With m+1 holders gone as well, the replacement falls back to the newest disk
checkpoint and says so."""

from __future__ import annotations

import logging
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


@pytest.fixture(autouse=True)
def run_log(tmp_path):
    """The nodes' info log in the test's folder (the failure output keeps only warnings)."""
    h = logging.FileHandler(tmp_path / "nodes.log")
    h.setFormatter(logging.Formatter("%(relativeCreated)8.0f %(name)s %(message)s"))
    log = logging.getLogger("shoal")
    log.addHandler(h)
    level, log.level = log.level, logging.INFO
    yield tmp_path / "nodes.log"
    log.removeHandler(h)
    log.setLevel(level)
    h.close()


def node_config(m: mf.RunManifest, ckpt_dir, **run):
    b = BrokerConfig(heartbeat_s=0.5, fail_after_s=6.0, lease_renew_s=1.0, lease_timeout_s=8.0, republish_s=1.0,
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
    return node.runtime.replica.at_step if node.runtime is not None else 0


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
        nodes = await start_one_by_one(n, cfg, 5)
        broker = nodes[0][0]  # its node holds the stage with the most parameters (the last: the untied head)
        table = broker.runtime.broker.table
        (victim, kill), = [(x, k) for x, k in nodes if table.slot_of(x.peer_id) == (0, 0)]
        stage = 0
        # stage 0's shards: the backups keeping it warm (the one promoted first, then the other), the backup of
        # stage 1, then the broker's node (stage 1): k = 4 - m = 2
        warm = [x for x, _ in nodes if table.backup_stage(x.peer_id) == 0]
        other = [x for x, _ in nodes if table.backup_stage(x.peer_id) == 1]
        assert len(warm) == 2 and len(other) == 1
        shards = victim.runtime.recovery.shards
        try:
            await wait_for(lambda: shards.placed is not None and shards.placed >= 10 and len(shards.placed_on) == 4,
                           90, "stage 0's shards placed on all four holders")
        except AssertionError:
            raise AssertionError(f"placements {shards.stats.revisions}, on {shards.placed_on}, table "
                                 f"{victim.runtime.timeline.latest}") from None
        for x, _ in nodes:  # the encoders place no newer revision from here: the rebuild meets this one
            x.runtime.recovery.shards.every_steps = 0
        await wait_for(lambda: not shards._busy, 30, "the last placement to end")
        rev = shards.placed
        placed_hash = shards.own[rev].hash
        holders = warm + other + [broker]
        held = {x.peer_id: x.runtime.recovery.shards.store.get(stage, rev) for x in holders}
        assert all(held.values()), held
        assert [held[x.peer_id].index for x in holders] == [0, 1, 2, 3]
        state_bytes = [r for r in shards.stats.revisions if r["revision"] == rev][-1]["state_bytes"]
        assert max(len(h.data) for h in held.values()) <= state_bytes // 2 + 8  # state / k, k = 2
        # a peer outside the run asks a holder for its shard: refused, nothing served
        service = warm[1].runtime.recovery.shards.service
        served = service.stats.served
        async with bare_host(broker.sh.addrs) as outsider:
            with pytest.raises(Exception):
                stream = await outsider.open_stream(warm[1].peer_id, SHARD_PROTOCOL)
                req = ShardRequest(want="shard", run_id=broker.runtime.manifest.run_id, stage=stage, revision=rev,
                                   index=1)
                await write_frame(stream, pack(req.to_wire()))
                await read_frame(stream, 1 << 20)
        assert service.stats.refused >= 1 and service.stats.served == served
        # shard 1 goes bad at its holder (a lying or broken one): the rebuild must notice and use shard 2 instead
        bad = held[warm[1].peer_id]
        bad.data = bytes(len(bad.data))
        killed_at = step(victim)
        kill.cancel()
        replacement = warm[0]
        await wait_for(lambda: replacement.runtime.recovery.rebuilt is not None, 60, "the rebuild")
        rebuilt_stage, snap, source = replacement.runtime.recovery.rebuilt
        assert (rebuilt_stage, source, snap.revision, snap.hash) == (stage, "shards", rev, placed_hash)
        assert any("shard 1" in r for r in replacement.penalties.reasons(warm[1].peer_id))
        used = replacement.runtime.recovery.rebuilds[-1]
        assert used["rejected"] == 1 and used["holders"] == 2
        await wait_for(lambda: broker.runtime.timeline.latest.rollback is not None, 30, "the rollback")
        order = broker.runtime.timeline.latest.rollback
        assert (order.revision, order.stage, order.source) == (rev, stage, "shards") and rev < killed_at
        await wait_for(lambda: all(x.runtime.finished.is_set() for x in (broker, replacement)), 120,
                       "the run to finish")
        assert step(broker) == step(replacement) == steps
        assert "rolled back" in (broker.runtime.recovery.notice or "")
        n.cancel_scope.cancel()


async def test_too_few_shards_fall_back_to_the_newest_disk_checkpoint(tmp_path):
    steps = 60
    cfg = node_config(manifest(steps), tmp_path / "ckpt")
    async with trio.open_nursery() as n:
        nodes = await start_one_by_one(n, cfg, 5)
        (n0, _) = nodes[0]  # the broker's node
        (n1, kill1), = [(x, k) for x, k in nodes if n0.runtime.broker.table.slot_of(x.peer_id) == (0, 0)]
        holders = [(x, k) for x, k in nodes if x is not n0 and x is not n1]
        await wait_for(lambda: n1.runtime.recovery.shards.placed is not None
                       and n1.runtime.recovery.checkpoints.last_step is not None
                       and n1.runtime.recovery.checkpoints.last_step >= 10, 90, "shards and a checkpoint")
        # stage 0's shards are on the three backups and n0 (k = 2, m = 2): m + 1 = 3 holders go with the stage
        for _, kill in holders:
            kill.cancel()
        kill1.cancel()
        gone = [n1.peer_id] + [x.peer_id for x, _ in holders]
        await wait_for(lambda: all(n0.runtime.broker.table.provider_state(p) == GONE for p in gone), 30, "failures")
        newcomer, _ = await n.start(_node, cfg, n0.sh.addrs)  # takes the free slot s0r0, holding nothing
        await wait_for(lambda: newcomer.runtime.recovery is not None and newcomer.runtime.recovery.rebuilt
                       is not None, 60, "the fallback")
        _, snap, source = newcomer.runtime.recovery.rebuilt
        assert source == "disk" and snap.revision % 10 == 0
        assert "disk checkpoint" in newcomer.runtime.recovery.notice
        await wait_for(lambda: n0.runtime.timeline.latest.rollback is not None, 30, "the rollback")
        assert n0.runtime.timeline.latest.rollback.source == "disk"
        await wait_for(lambda: all(x.runtime.finished.is_set() for x in (n0, newcomer)), 120, "the run to finish")
        assert step(n0) == step(newcomer) == steps
        n.cancel_scope.cancel()
