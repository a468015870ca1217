"""An open crowd on real in-process nodes (127.0.0.1, one trio loop, real brokers): a volunteer finds a run by
listing, by name, by id prefix or as the swarm's only open run, and is refused at once with the candidates when a
name or prefix names several runs or none; a volunteer is seated as a new lane and trains within seconds; the run
grows to its maximum (the next volunteer waits in the pool), shrinks as lanes leave and waits below its minimum;
the global batch is split by measured speed, a liar's share stays bounded, and the replicas stay bit-identical."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import replace

import pytest
import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from shoal.node.failure import leaves
from shoal.node.run.config import RunConfig
from shoal.node.run.preflight import UnknownRun
from shoal.node.run.resolve import AmbiguousRun, RunFinder
from shoal.protocol import manifest as mf
from shoal.swarm.net.identity import peer_id_of
from shoal.swarm.net.observer import Observer
from shoal.swarm.run.batchsplit import SplitConfig
from shoal.swarm.run.broker import BrokerConfig
from shoal.swarm.run.client import RunClientConfig
from shoal.swarm.run.directory import RunDirectory
from tests.helpers.swarm import FAST, running_node, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.own_process, pytest.mark.usefixtures("one_torch_thread")]
SECRET = "open sesame"
JOIN_BOUND_S = 30.0  # in-process, on a loaded 2-core machine (the benchmark measures it: bench/results/crowd.md)


def base(name: str, seed: int, **plan) -> mf.RunManifest:
    return mf.RunManifest(
        name=name, seed=seed, model=mf.ModelSpec(size="custom", n_layers=1, d_model=32, n_heads=4),
        batch=mf.BatchSpec(batch_size=4, micro_batch_size=4, seq_len=32, global_batch=12),
        optim=mf.OptimSpec(lr=3e-3, warmup_steps=2, total_steps=100000), eval=mf.EvalSpec(every_steps=0, batches=2),
        plan=mf.ParallelPlan(**{"replicas": 1, "sync": mf.SyncSpec(method="allreduce"), **plan}))


def sharing_a_prefix(ka, kb) -> tuple[mf.RunManifest, mf.RunManifest]:
    """An open run 'alpha' owned by `ka` and a private run 'beta' owned by `kb` whose ids start with the same 4 hex
    digits (found among a few hundred seeds: a birthday search)."""
    a = {}
    for seed in range(2000):
        m = dataclasses.replace(base("alpha", seed), owner=peer_id_of(ka))
        a.setdefault(m.run_id[:4], seed)
    for seed in range(2000):
        m = dataclasses.replace(base("beta", seed, max_replicas=1), owner=peer_id_of(kb),
                                join=mf.JoinPolicy.private(salt=b"\0" * 16))
        if m.run_id[:4] in a:
            ma = base("alpha", a[m.run_id[:4]]).signed(ka)
            return ma, dataclasses.replace(m, owner="").signed(kb)
    raise AssertionError("no shared prefix in 2000 x 2000 seeds")


def cfg(m: mf.RunManifest | None = None, select: str | None = None, *, secret: str | None = None,
        split: SplitConfig = SplitConfig(), **run):
    b = BrokerConfig(heartbeat_s=0.5, fail_after_s=8.0, lease_renew_s=1.0, lease_timeout_s=8.0, republish_s=1.0,
                     ping_timeout_s=1.0, dht_timeout_s=1.0, split=split)
    rc = RunConfig(manifest=m, select=select, secret=secret, threads=1, round_timeout_s=5.0, switch_lead_s=0.5,
                   broker=b, client=replace(RunClientConfig(), poll_s=0.5), **run)
    return replace(FAST, run=rc)


def in_run(node, run_id: str) -> bool:
    rt = node.runtime
    return rt is not None and rt.manifest is not None and rt.manifest.run_id == run_id and rt.client is not None \
        and rt.client.admitted


async def refused(addrs, config):
    """The errors a node started with `config` fails with, and its run's part (RunRuntime)."""
    made: list = []
    try:
        async with running_node(addrs, config, made=made):
            pass
    except BaseException as e:  # noqa: BLE001 - the node's start fails: that is the point
        return leaves(e), made[0].runtime
    raise AssertionError("the node started")


async def test_a_run_is_found_by_listing_name_prefix_or_alone_and_bad_names_are_refused_at_once():
    ka, kb = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    alpha, beta = sharing_a_prefix(ka, kb)
    async with running_node((), cfg(alpha), key=ka) as a, \
            running_node(a.sh.addrs, cfg(beta, secret=SECRET), key=kb) as b:
        addrs = a.sh.addrs
        await wait_for(lambda: in_run(a, alpha.run_id) and in_run(b, beta.run_id), 60, "both runs' brokers")
        # listing, as `shoal runs` does: an observer asks the joined peer, verified adverts only
        directory = RunDirectory()
        obs = Observer(addrs, on_signed=directory.observe)
        async with trio.open_nursery() as n:
            await n.start(obs.run)
            await RunFinder(obs.sh, directory).ask(obs.sh.connected_peers())
            await wait_for(lambda: len(directory.runs()) == 2, 15, "both runs listed")
            n.cancel_scope.cancel()
        listed = {r.name: r for r in directory.runs()}
        assert listed["alpha"].run_id == alpha.run_id and not listed["alpha"].private
        assert listed["beta"].run_id == beta.run_id and listed["beta"].private
        assert listed["beta"].advert.peer_id == b.peer_id and listed["alpha"].advert.lanes == 1
        # refused at once, with the candidates: a prefix both ids share, a name no run has, two runs to choose from
        shared = alpha.run_id[:4]
        for config, kind, words in (
                (cfg(select=shared), AmbiguousRun, [alpha.run_id[:12], beta.run_id[:12], "give more of the id"]),
                (cfg(select="gamma"), UnknownRun, ["'alpha'", "'beta'", "no run of the swarm"]),
                (cfg(select="", secret=SECRET), AmbiguousRun, ["2 open runs", "'alpha'", "'beta'"])):
            errs, runtime = await refused(addrs, config)
            err = next((e for e in errs if isinstance(e, kind)), None)
            assert err is not None, errs
            assert all(w in str(err) for w in words), str(err)
            # decided from the swarm's answer (the runs named above came from it), not from a wait running out:
            # a peer answered `runs`, and the node never went on to fetch a manifest by id or to ask for a table
            assert runtime.finder.answers >= 1, runtime.finder.answers
            assert runtime.manifest is None and runtime.client is None
        # found: by name (a private run, with its secret), by a longer prefix, alone (the only open run), and at
        # the prompt of a terminal when there are several
        async def pick_beta(runs):
            assert sorted(r.name for r in runs) == ["alpha", "beta"]
            return next(r for r in runs if r.name == "beta")

        for config, run, why, choose in (
                (cfg(select="beta", secret=SECRET), beta, "named by --run beta", None),
                (cfg(select=alpha.run_id[:8]), alpha, f"named by --run {alpha.run_id[:8]}", None),
                (cfg(select=""), alpha, "the only one of the swarm's 2 runs", None),
                (cfg(select="", secret=SECRET), beta, "chosen at the prompt", pick_beta)):
            async with running_node(addrs, config, choose_run=choose) as v:
                await wait_for(lambda: in_run(v, run.run_id), 30, f"a volunteer in {run.name}")
                assert why in v.runtime.finder.reason
                assert v.runtime.config.manifest is None  # from the advert: a network manifest (its data checked)


def steps_of(node) -> int:
    t = node.runtime.replica.trainer if node.runtime is not None else None
    return t.step_count if t is not None else 0


async def test_a_volunteer_becomes_a_new_lane_the_run_grows_to_its_maximum_shrinks_and_waits_below_its_minimum():
    key = Ed25519PrivateKey.generate()
    run = base("crowd", 1, replicas=2, min_replicas=2, max_replicas=3).signed(key)
    fast = SplitConfig(every_s=5.0)
    owner_cfg = cfg(run, split=fast, min_step_s=0.05)
    vol = cfg(select="", split=fast, min_step_s=0.05)
    async with running_node((), owner_cfg, key=key) as first:
        addrs = first.sh.addrs
        async with running_node(addrs, vol) as second:
            nodes = [first, second]
            await wait_for(lambda: min(map(steps_of, nodes)) >= 5, 60, "two lanes to train")
            t0 = time.monotonic()
            async with running_node(addrs, vol) as third:
                await wait_for(lambda: third.runtime.contribution.fields()["samples_done"] > 0, JOIN_BOUND_S,
                               "the volunteer's first applied step")
                joined_s = time.monotonic() - t0
                table = first.runtime.client.table
                assert table.slot_of(third.peer_id) == (0, 2) and table.complete_lanes() == (0, 1, 2)
                assert sum(table.lane_shares().values()) == 12 and min(table.lane_shares().values()) >= 1
                assert third.runtime.entry.entries and third.runtime.entry.entries[0]["step"] > 5  # entered mid-run with state
                async with running_node(addrs, vol) as fourth:  # at the maximum: the pool
                    await wait_for(lambda: fourth.runtime.client is not None and fourth.runtime.client.role()
                                   == "backup", 30, "the fourth volunteer in the pool")
                    assert len(first.runtime.client.table.complete_lanes()) == 3
                    third.stop()  # a lane leaves: the backup takes its place
                    await wait_for(lambda: first.runtime.client.table.slot_of(fourth.peer_id) == (0, 2), 30,
                                   "the backup seated in the leaver's lane")
                    await wait_for(lambda: steps_of(fourth) > 0 and fourth.runtime.replica.state == "training", 60,
                                   "the promoted backup to train")
                    fourth.stop()  # and with nobody to replace it, the run shrinks to its minimum
                    await wait_for(lambda: first.runtime.client.table.complete_lanes() == (0, 1), 30,
                                   "two lanes left")
                    shrunk = first.runtime.client.table.switch_step(0)
                    await wait_for(lambda: min(map(steps_of, nodes)) > shrunk + 3, 60, "two lanes to train on")
            assert sorted(first.runtime.client.table.lane_shares()) == [0, 1]
            common = set(first.runtime.consistency.hashes.hashes) & set(second.runtime.consistency.hashes.hashes)
            assert len(common) > 10 and all(first.runtime.consistency.hashes.hashes[s] == second.runtime.consistency.hashes.hashes[s]
                                            for s in common)
            second.stop()  # below the minimum of 2: the run waits
            await wait_for(lambda: first.runtime.replica.state == "waiting", 40, "the run to wait below its minimum")
            paused = steps_of(first)
            await trio.sleep(2.0)
            assert steps_of(first) == paused and first.runtime.replica.state == "waiting"
    print(f"a volunteer's first applied step {joined_s:.1f} s after its node started (in-process)")


async def test_the_batch_follows_speed_and_a_node_claiming_any_speed_takes_a_bounded_share():
    key = Ed25519PrivateKey.generate()
    run = base("speeds", 2, replicas=3, max_replicas=3, min_replicas=1).signed(key)
    run = dataclasses.replace(run, batch=mf.BatchSpec(batch_size=4, micro_batch_size=4, seq_len=32,
                                                      global_batch=30)).signed(key)
    fast = SplitConfig(every_s=1.0)
    async with running_node((), cfg(run, split=fast), key=key) as first:
        addrs = first.sh.addrs
        async with running_node(addrs, cfg(select="", split=fast)) as second, \
                running_node(addrs, cfg(select="", split=fast)) as liar:
            nodes = [first, second, liar]
            await wait_for(lambda: min(map(steps_of, nodes)) >= 5, 60, "three lanes to train")
            liar.runtime.replica.trainer.speed.rate = lambda: 1e9  # it claims a billion sequences a second

            def liar_share() -> int:
                t = first.runtime.client.table
                return t.lane_shares().get(t.slot_of(liar.peer_id)[1], 0)

            await wait_for(lambda: liar_share() > 10, 30, "a re-split for the liar's claim")
            t = first.runtime.client.table
            # credited at most 4x the median lane, which is an honest one, and the other honest one at least a
            # quarter of that: at most 4 / (4 + 1 + 1/4) of the batch, however fast it claims to be
            assert liar_share() <= 30 * 4 / (4 + 1 + 0.25)
            assert sum(t.lane_shares().values()) == 30 and min(t.lane_shares().values()) >= 1
            switch = t.switch_step(0)
            await wait_for(lambda: min(map(steps_of, nodes)) > switch + 3, 60, "steps with the new split")
            for n in nodes:  # each computed its lane's share of its last step, and all hold the same state
                at = n.runtime.timeline.table_at(n.runtime.replica.last.step - 1, 0)
                assert n.runtime.replica.last.samples == at.lane_shares()[at.slot_of(n.peer_id)[1]]
            common = set.intersection(*(set(n.runtime.consistency.hashes.hashes) for n in nodes))
            assert len({n.runtime.consistency.hashes.hashes[max(common)] for n in nodes}) == 1
