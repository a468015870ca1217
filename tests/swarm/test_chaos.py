"""Seeded chaos on real node processes (127.0.0.1, bench/lab/chaos.py): a broker frozen past its lease, a
broker killed and restarted within a second, members killed, frozen and leaving, restarts with the same identity,
a member killed a few steps before the end. Every run ends with every step done, one state hash, one broker, and
every node exiting 0; after each fault there is exactly one broker again."""

from __future__ import annotations

import json

import pytest

from shoal.bench.chaos import ChaosConfig, ChaosResult, ChaosRun

pytestmark = pytest.mark.slow


def verdict(res: ChaosResult) -> str:
    return json.dumps(res.to_json(), indent=1)[:6000]


def applied(res: ChaosResult) -> list[str]:
    return [f.kind + (" near the end" if f.note == "near the end" else "") for f in res.faults if f.applied_s is not None]


def test_two_replicas_survive_a_broker_freeze_a_fast_broker_restart_and_a_kill_near_the_end(tmp_path):
    """Two replicas, no backup: every fault leaves a group of one, and the split of two must resolve."""
    res = ChaosRun(ChaosConfig(workdir=tmp_path, nodes=2, replicas=2, steps=300, seed=1, random_faults=0,
                               stop_s=(6.0, 7.0))).run()
    assert res.ok, verdict(res)
    assert sorted(applied(res)) == ["broker-freeze", "broker-restart", "kill near the end"], verdict(res)
    assert all(f.recovered_s is not None for f in res.faults), verdict(res)


def test_five_nodes_three_active_two_backups_survive_seeded_chaos(tmp_path):
    res = ChaosRun(ChaosConfig(workdir=tmp_path, nodes=5, replicas=3, steps=350, seed=2, random_faults=2,
                               stop_s=(6.0, 8.0))).run()
    assert res.ok, verdict(res)
    kinds = applied(res)
    assert {"broker-freeze", "broker-restart", "kill near the end"} <= set(kinds) and len(kinds) == 5, verdict(res)
    assert all(f.recovered_s is not None for f in res.faults), verdict(res)
