"""The control-plane simulation (bench/lab/sim.py) on a small run in virtual time: the real broker under churn, the
real run client on what it gossips, seconds of wall time."""

from __future__ import annotations

import logging

from shoal.bench.sim import SimConfig, run


def test_a_small_churning_run_in_virtual_time_promotes_within_the_bound_and_every_client_follows_the_table(caplog):
    caplog.set_level(logging.ERROR)
    r = run(SimConfig(n=40, lanes=8, duration_s=900, session_mean_s=400, observed=6, seed=3))
    assert r["joined"] > 40 and r["left"]["crash"] > 5 and r["left"]["leave"] > 5  # churn happened
    f = r["failure_to_promotion_s"]
    assert f["n"] > 0 and f["max"] <= f["bound"]  # a crashed seated member's slot goes to a backup in time
    assert r["sampled_clients"] >= 6 and r["sampled_client_mismatches"] == 0  # the real client ends where the rule does
    assert r["delta_bytes"]["n"] > 0 and r["delta_bytes"]["p50"] < r["table_bytes"]["max"] / 2
    u = r["per_node_unique_bytes_per_s"]
    assert u["poll (both ways)"] < 200  # an unchanged table's poll carries its digest, not the table
    assert r["wall_s"] < 60
