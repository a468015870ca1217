"""A node's run runtime on real in-process nodes (127.0.0.1, one trio loop, a real broker): a replica whose state
hash leaves the majority re-fetches the majority's state, a node that joins a running run enters at an agreed
step with exactly the group's state, and a member sending poisoned updates is evicted for the backup."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import pytest
import torch
import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from shoal.node.run.config import RunConfig
from shoal.protocol.assignment import GONE
from shoal.protocol import manifest as mf
from shoal.swarm.net.identity import peer_id_of
from shoal.swarm.run.broker import BrokerConfig
from shoal.swarm.run.client import RunClientConfig
from tests.helpers.faults import poison
from tests.helpers.progress import wait_training
from tests.helpers.swarm import FAST, HW, running_node, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.own_process, pytest.mark.usefixtures("one_torch_thread")]


def manifest(sync: str, replicas: int = 3) -> mf.RunManifest:
    return mf.RunManifest(
        seed=3, model=mf.ModelSpec(size="custom", n_layers=1, d_model=32, n_heads=4),
        batch=mf.BatchSpec(batch_size=4, micro_batch_size=4, seq_len=32),
        optim=mf.OptimSpec(lr=3e-3, warmup_steps=2, total_steps=1000), eval=mf.EvalSpec(every_steps=0, batches=2),
        plan=mf.ParallelPlan(replicas=replicas,
                             sync=mf.SyncSpec(method=sync, cocktail=mf.CocktailSpec(warmup_steps=0))))


def node_config(m: mf.RunManifest, steps: int, **run):
    b = BrokerConfig(heartbeat_s=0.5, fail_after_s=8.0, lease_renew_s=1.0, lease_timeout_s=8.0, republish_s=1.0,
                     ping_timeout_s=1.0, dht_timeout_s=1.0)
    rc = RunConfig(manifest=m, threads=1, max_steps=steps, round_timeout_s=5.0, switch_lead_s=0.5, broker=b,
                   client=replace(RunClientConfig(), poll_s=0.5), **run)
    return replace(FAST, run=rc)


def hashes(nodes) -> set[str]:
    return {n.runtime.replica.sync.state_hash() for n in nodes}


def finished(nodes) -> bool:
    return all(n.runtime is not None and n.runtime.finished.is_set() for n in nodes)


def pace_until_entered(nodes, backup, steps: int, step_s: float = 0.05, margin_s: float = 75.0) -> None:
    """A step takes step_s, as a real model's would; from step 10 on (the tests' faults come at steps 5-10) the
    steps left are spread over `margin_s` of wall time until the promoted backup has entered, so that the run
    outlasts the failure detection (fail_after_s 8 s), the pull and the swap however loaded the machine is (a slot
    that could not be entered before the end is counted as done, and the test would then see nothing of the
    backup). Once the backup has entered, steps take step_s again. The margin is wall time, not a count of steps:
    a step count gave ~27 s, which a loaded CI machine once used up before the backup entered."""
    since: list[float] = []

    def pace(t) -> None:
        if backup.runtime.entry.entries or t.step_count < 10:
            time.sleep(step_s)
            return
        now = time.monotonic()
        if not since:
            since.append(now)
        left_s = since[0] + margin_s - now
        time.sleep(max(0.3, left_s / max(1, steps - t.step_count)))

    for x in nodes:
        x.runtime.replica.trainer.before_step_hooks.append(pace)


@pytest.mark.parametrize("sync", ["allreduce", "cocktail"])
async def test_a_replica_off_the_majority_hash_refetches_and_rejoins_it(sync):
    steps = 60
    cfg = node_config(manifest(sync), steps)
    async with running_node((), cfg) as first:
        addrs = first.sh.addrs
        async with running_node(addrs, cfg) as second, running_node(addrs, cfg) as victim:
            nodes = [first, second, victim]
            await wait_training([victim], 1, 5, 60, "training to get going")
            corrupted = []

            def corrupt(trainer) -> None:  # trainer thread, before a step, with no round in flight
                if corrupted:
                    return
                sync_ = victim.runtime.replica.sync
                sync_.close(trainer.model)
                with torch.no_grad():
                    if sync == "cocktail":
                        sync_.g[:256] += 0.01  # the synchronized copy itself (what cocktail's hash covers)
                    else:
                        next(trainer.model.parameters()).add_(1e-3)
                corrupted.append(trainer.step_count)

            victim.runtime.replica.trainer.before_step_hooks.append(corrupt)
            await wait_for(lambda: corrupted, 30, "the corruption")
            await wait_for(lambda: victim.runtime.consistency.refetches >= 1, 60, "the victim to re-fetch")
            await wait_for(lambda: finished(nodes), 120, "the run to finish")
            assert len(hashes(nodes)) == 1
            assert first.runtime.consistency.refetches == second.runtime.consistency.refetches == 0
            assert all(n.runtime.replica.trainer.step_count == steps for n in nodes)


async def test_a_refetch_whose_source_is_gone_is_given_up_and_voted_again():
    """The peer a hash vote named dies before the re-fetch: the pull gives up as soon as that peer is not live
    (instead of trying it for the whole state-pull timeout, then failing the node), and the replica votes again."""
    steps = 20
    cfg = node_config(manifest("allreduce", replicas=1), steps)
    async with running_node((), cfg) as node:
        await wait_for(lambda: finished([node]), 60, "a one-replica run")
        votes = node.runtime.consistency
        gone = peer_id_of(Ed25519PrivateKey.generate())  # never live: as a peer that died after the vote
        votes.pending = (steps, gone)
        with trio.fail_after(10):
            await votes.refetch(steps, None)
        assert votes.pending is None and votes.refetches == 0


async def test_a_late_joiner_enters_at_an_agreed_step_with_the_groups_state():
    steps = 50
    m = manifest("cocktail")
    cfg = node_config(m, steps, start_wait_s=1.0)  # two nodes start the run without waiting for the third slot
    async with running_node((), cfg) as first:
        async with running_node(first.sh.addrs, cfg) as second:
            await wait_training([first, second], 2, 10, 60, "two replicas to train")
            async with running_node(first.sh.addrs, cfg) as late:
                await wait_for(lambda: finished([first, second, late]), 120, "the run to finish with three")
                table = late.runtime.timeline.latest
                assert len(table.members(0)) == 3 and table.switch_step(0) > 10  # entered mid-run, not at step 0
                assert len(hashes([first, second, late])) == 1
                assert late.runtime.replica.trainer.step_count == steps


async def test_a_member_the_new_table_reaches_late_goes_back_to_the_switch_step():
    """A third replica joins while one member hears no table (its gossip lost, its polls unanswered): that member
    begins the switch step with the group before, whose rounds nobody answers any more. When the table reaches it
    (here handed over as its next poll would), its round in flight ends at once, it goes back to the switch step
    with the state it kept there (the joiner asked it to) and takes that step with the new group: the three hold
    the same state at every step, and no hash vote has anything to re-fetch."""
    steps = 60
    cfg = node_config(manifest("allreduce"), steps, start_wait_s=1.0)
    async with running_node((), cfg) as first, running_node(first.sh.addrs, cfg) as late:
        await wait_training([first, late], 2, 5, 60, "two replicas to train")
        t0 = time.monotonic()

        def pace(t) -> None:  # until the joiner is seated, the steps left are spread over 60 s of wall time: the run
            # must not end before the joiner's slot takes effect (a loaded machine starts its process slowly; the
            # slot then took effect after the last step, and there was no switch step to be late for)
            if len(first.runtime.timeline.latest.members(0)) < 3:
                time.sleep(max(0.2, (t0 + 60 - time.monotonic()) / max(1, steps - t.step_count)))
        for x in (first, late):
            x.runtime.replica.trainer.before_step_hooks.append(pace)
        deaf = [True]
        client = late.runtime.client
        accept = client._accept
        client._accept = lambda t, env, source: False if deaf[0] else accept(t, env, source)  # gossip and polls
        async with running_node(first.sh.addrs, cfg) as joiner:
            await wait_for(lambda: len(first.runtime.timeline.latest.members(0)) == 3, 60, "the joiner's table")
            switch = first.runtime.timeline.latest.switch_step(0)
            stepping = lambda: late.runtime._stepping  # noqa: E731 - (step, group) of the step in progress
            # the late member is at the switch step or past it with the group before (while it hears no table, every
            # step it begins from there on is with that group; its round at the switch step may end at the round
            # deadline before a poll sees it, as on CI's loaded machine once, and it then trains on alone)
            await wait_for(lambda: first.runtime.replica.at_step >= switch and stepping() is not None
                           and stepping()[0] >= switch, 60, "both at the switch step or past it")
            assert len(stepping()[1].members) == 2  # it began the switch step with the group before
            deaf[0] = False
            client.accept_envelope(first.runtime.client.table_env, first.peer_id)
            nodes = [first, late, joiner]
            await wait_for(lambda: finished(nodes), 120, "the run to finish with three")
            print(f"switch step {switch}; the late member went back {late.runtime.entry.caught_up} time(s); "
                  f"re-fetches {[n.runtime.consistency.refetches for n in nodes]}")
            assert late.runtime.entry.caught_up == 1
            assert [n.runtime.consistency.refetches for n in nodes] == [0, 0, 0]
            assert len(hashes(nodes)) == 1
            held = [n.runtime.consistency.hashes.hashes for n in nodes]
            common = set.intersection(*(set(h) for h in held))
            assert common and all(len({h[s] for h in held}) == 1 for s in common)


@pytest.mark.parametrize("sync", ["allreduce", "cocktail"])
async def test_a_poisoning_member_is_evicted_and_the_backup_takes_its_slot(sync):
    """NaN updates from one member: the others reject and report them, the broker evicts it on most members'
    word and bans it, the backup is promoted with the group's state, and the run ends bit-identical."""
    steps = 100
    cfg = node_config(manifest(sync), steps)
    async with running_node((), cfg) as first:
        addrs = first.sh.addrs
        async with running_node(addrs, cfg) as second, running_node(addrs, cfg) as bad, \
                running_node(addrs, cfg) as backup:
            await wait_training([first, second, bad], 3, 0, 60, "trainers")
            pace_until_entered((first, second, bad), backup, steps)
            await wait_training([first, second, bad], 3, 5, 60, "three replicas to train")
            assert backup.runtime.client.role() == "backup"
            bad.runtime.replica.sync.fault = poison("nan")
            broker = first.runtime.broker
            await wait_for(lambda: broker.table.provider_state(bad.peer_id) == GONE, 60, "the eviction")
            assert first.penalties.is_banned(bad.peer_id)
            assert broker.table.slot_of(backup.peer_id) is not None
            group = [first, second, backup]
            await wait_for(lambda: finished(group), 120, "the run to finish without the poisoner")
            assert len(hashes(group)) == 1
            assert all(n.runtime.replica.trainer.step_count == steps for n in group)


async def _node(cfg, join, stopped: trio.Event | None = None, key=None, hardware=HW, *,
                task_status=trio.TASK_STATUS_IGNORED):
    """A node that can be killed (its scope cancelled: no leave notice, its host closes); `stopped` is set once it
    is down; `key`: its identity (to restart it as the same peer); `hardware`: the profile it reports."""
    try:
        with trio.CancelScope() as scope:
            async with running_node(join, cfg, key=key, hardware=hardware) as node:
                task_status.started((node, scope))
                await trio.sleep_forever()
    finally:
        if stopped is not None:
            stopped.set()


@pytest.mark.parametrize("sync", ["cocktail", "diloco"])
async def test_a_warm_backup_takes_a_dead_members_slot_with_a_short_catch_up(sync):
    """The backup keeps a warm copy (the state its group agrees on, verified like any other); promoted, it pulls
    the entry state at the exact revision, which is only what the group keeps bit-identical (cocktail's g, DiLoCo's
    theta and outer momentum: the model and a fresh optimizer derive from it), and the run ends with every
    replica's synchronized state equal."""
    steps = 80
    m = manifest(sync)
    if sync == "diloco":
        m = replace(m, plan=replace(m.plan, sync=replace(m.plan.sync, diloco=mf.DilocoSpec(inner_steps=4))))
    cfg = node_config(m, steps, backup_refresh_s=1.0)
    async with trio.open_nursery() as n:
        first, _ = await n.start(_node, cfg, ())
        addrs = first.sh.addrs
        second, _ = await n.start(_node, cfg, addrs)
        victim, kill = await n.start(_node, cfg, addrs)
        backup, _ = await n.start(_node, cfg, addrs)
        await wait_training([first, second, victim], 3, 0, 60, "trainers")
        pace_until_entered((first, second, victim), backup, steps)
        await wait_training([victim], 1, 10, 60, "training under way")
        await wait_for(lambda: backup.runtime.warm is not None, 60, "a warm copy")
        kill.cancel()
        group = [first, second, backup]
        await wait_for(lambda: finished(group), 150, "the run to finish with the backup")
        entry = backup.runtime.entry.entries[-1]
        whole = first.runtime.replica.state_bytes()  # a member's whole state (the entry's lacks optimizer moments)
        assert entry["step"] > 10 and entry["bytes_pulled"] < whole / 2.4, (entry, whole)
        assert len(hashes(group)) == 1
        n.cancel_scope.cancel()


async def test_a_node_torn_down_while_its_round_waits_stops_at_once_not_at_the_deadline():
    """Torn down without a leave (its task cancelled: a failure or an interrupt) while its trainer thread waits in a
    round for a member that sends nothing, a node stops within seconds, not at the round's 30 s deadline: a worker
    thread cannot be cancelled, so the run halts its round for it."""
    cfg = node_config(manifest("allreduce", replicas=2), 500)
    cfg = replace(cfg, run=replace(cfg.run, round_timeout_s=30.0))
    release = threading.Event()
    stopped = trio.Event()
    async with trio.open_nursery() as nursery:
        first, kill = await nursery.start(_node, cfg, (), stopped)
        second, _ = await nursery.start(_node, cfg, first.sh.addrs)
        await wait_training([first, second], 2, 3, 60, "two replicas")
        second.runtime.replica.trainer.before_step_hooks.append(lambda t: release.wait(60))  # silent from now on
        coll = first.runtime.collective
        await wait_for(lambda: coll._active, 20, "the first node's round to wait for the silent member")
        await trio.sleep(1.0)
        assert coll._active  # still waiting: the deadline is 29 s away
        t0 = trio.current_time()
        kill.cancel()
        await stopped.wait()
        took = trio.current_time() - t0
        release.set()
        nursery.cancel_scope.cancel()
    print(f"a node torn down while its round waited stopped in {took:.2f} s (the round's deadline: 30 s)")
    assert took < 5.0



async def _small_hub(nursery, cfg):
    """The node that starts the run and hosts its broker, on a machine too small to train it: a backup that is never
    promoted (it keeps no warm copy near the tests' faults either: backup_refresh_s is long for it)."""
    m = cfg.run.manifest
    small = replace(HW, memory_bytes=m.stage_memory_bytes(0) - 1)
    hub, _ = await nursery.start(_node, replace(cfg, run=replace(cfg.run, backup_refresh_s=600.0)), (), None, None,
                                 small)
    return hub


async def test_a_stage_whose_members_all_restarted_without_state_goes_back_to_the_start_and_trains_on():
    """Seen in a churn run: every member of a group lost its state (a leave and a kill, each restarted with its
    identity) while none counted as gone (each was admitted again), so the entering members asked each other for a
    revision none held, and the run stood still. Here both members are killed and restarted at once, within the
    broker's failure timeout: each keeps its slot and enters its re-formed group, finds from the other's answers
    (asked twice) that nobody holds the stage, and, with no shards and before any node could write a checkpoint,
    both ask to go back to the run's start; the broker takes that only from most of the stage. The run trains to its
    end from there, both replicas equal."""
    steps = 30
    m = manifest("allreduce", replicas=2)
    cfg = node_config(m, steps, backup_refresh_s=600.0)  # the broker's node keeps no warm copy near the entry
    slow = replace(cfg.run.broker, fail_after_s=120.0, reconnect_grace_s=120.0)  # a restart keeps its slot
    cfg = replace(cfg, run=replace(cfg.run, broker=slow))
    keys = [Ed25519PrivateKey.generate() for _ in range(2)]
    async with trio.open_nursery() as n:
        hub = await _small_hub(n, cfg)
        addrs = hub.sh.addrs
        first = [await n.start(_node, cfg, addrs, None, k) for k in keys]
        members = [x for x, _ in first]
        await wait_training(members, 2, 0, 60, "trainers")
        for x in members:
            x.runtime.replica.trainer.before_step_hooks.append(lambda t: time.sleep(0.1))
        await wait_training(members, 2, 6, 60, "two replicas")
        # the broker's node has heard from the members how far the run got (statuses every 0.5 s: under load a kill
        # in the first second of training came before any, and the restarted pair simply began the run again)
        await wait_for(lambda: hub.runtime.switch_step(0) > 6, 30, "the broker's node to see the run under way")
        ids = [x.peer_id for x in members]
        assert set(hub.runtime.client.table.members(0)) == set(ids)
        stopped = [x.runtime.replica.at_step for x in members]
        for _, kill in first:
            kill.cancel()
        again = [(await n.start(_node, cfg, addrs, None, k))[0] for k in keys]
        await wait_for(lambda: finished(again), 150, "the run to train to its end from its start")
        t = hub.runtime.client.table
        assert t.rollback is not None and (t.rollback.source, t.rollback.revision) == ("start", 0), t.rollback
        assert set(t.members(0)) == set(ids)  # nobody was failed: the same two, restarted
        assert all(any(r["source"] == "start" for r in x.runtime.recovery.rebuilds) for x in again)
        assert all(x.runtime.replica.at_step == steps for x in again) and len(hashes(again)) == 1
        print(f"both members restarted at steps {stopped}: the run went back to its start and trained to {steps}")
        n.cancel_scope.cancel()


async def test_a_stage_whose_members_all_died_goes_back_to_the_promoted_backups_warm_copy():
    """Both members of a one-stage run die at once; no shards (too few peers outside the stage) and no disk
    checkpoint. The backup promoted into the stage holds a warm copy (the state the group agreed on, some steps
    back): the run rolls back to it, not to its start, and the backup trains on alone to the end. (The backup takes
    one warm copy, when the test says: a copy refreshed just ahead of the group could be of a revision past the
    step the broker places the entry at, which no rollback can go forward to.)"""
    steps = 150  # the backup, unpaced, trains most of them alone
    m = manifest("allreduce", replicas=2)
    cfg = node_config(m, steps, backup_refresh_s=600.0)
    async with trio.open_nursery() as n:
        hub = await _small_hub(n, cfg)
        addrs = hub.sh.addrs
        first = [await n.start(_node, cfg, addrs) for _ in range(2)]
        members = [x for x, _ in first]
        backup, _ = await n.start(_node, cfg, addrs)
        await wait_training(members, 2, 0, 60, "trainers")
        for x in members:
            x.runtime.replica.trainer.before_step_hooks.append(lambda t: time.sleep(0.3))
        await wait_training(members, 2, 3, 60, "training under way")
        rt = backup.runtime
        for _ in range(5):  # (a refresh that finds no copy now is tried again, as the backup's loop would)
            target = min(x.runtime.replica.at_step for x in members) + 2
            await rt.pulls._refresh_warm(rt.client, 0, [x.peer_id for x in members], target,
                                         rt.consistency.ask_snapshot)
            if rt.warm is not None:
                break
        assert rt.warm is not None, "no warm copy"
        await wait_for(lambda: min(x.runtime.replica.at_step for x in members) >= rt.warm.revision + 6, 60,
                       "the members well past the warm copy")  # (the newest copy: the backup's own loop refreshes too)
        stopped = [x.runtime.replica.at_step for x in members]
        for _, kill in first:
            kill.cancel()
        await wait_for(lambda: finished([backup]), 150, "the backup to train to the end")
        t = hub.runtime.client.table
        assert t.rollback is not None and t.rollback.source == "warm", t.rollback
        got = rt.recovery.rebuilds[-1]
        assert got["source"] == "warm" and got["revision"] == t.rollback.revision == rt.warm.revision > 0
        assert rt.replica.at_step == steps
        print(f"members died at steps {stopped}: the run went back to the warm copy of revision "
              f"{t.rollback.revision} ({got['seconds']:.1f} s to find it) and the backup trained on to {steps}")
        n.cancel_scope.cancel()
