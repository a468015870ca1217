"""The benchmark topology: namespaces on a bridge, tbf per node and direction checked by the TCP probe, full teardown.

Needs root and iproute2 (CI runs as root); without them the test fails with the reason, it never skips."""

from __future__ import annotations

import subprocess

import pytest

from shoal.bench import netns, probe
from shoal.bench.topology import LinkShape, Topology, TopologyConfig

PREFIX = "shtopot"  # this test's own names: shtopotsw, shtopotn0.., shtopotbr


def ours() -> list[str]:
    return [ns for ns in netns.list_namespaces() if ns.startswith(PREFIX)]


def test_shaped_topology_probe_and_teardown():
    netns.require_root()  # raises NetnsError (a failure) when namespaces cannot be made here
    config = TopologyConfig(prefix=PREFIX, nodes=3, subnet="10.251.7")
    quick = probe.ProbeConfig(seconds=1.5, warmup_s=0.3)  # a short window under a loaded CPU over-reads
    with Topology(config) as topo:
        assert sorted(ours()) == sorted([*topo.node_ns, topo.switch])
        assert netns.link_stats(topo.switch)[topo.bridge]  # the bridge lives in the switch namespace
        # asymmetric home links, one node left unshaped
        topo.shape([LinkShape(up_mbit=8, down_mbit=40), LinkShape(up_mbit=40, down_mbit=8), LinkShape()])
        results = {(r.node, r.direction): r for r in probe.verify(topo, quick)}
        for key in [(0, "up"), (0, "down"), (1, "up"), (1, "down")]:
            r = results[key]
            assert r.ok, r
        assert results[(0, "up")].measured_mbit < results[(0, "down")].measured_mbit / 3
        assert results[(2, "up")].ok and results[(2, "down")].ok  # unshaped: far above any home rate
        before = topo.counters()
        # reshaped in place for the next segment of a run
        topo.shape([LinkShape(up_mbit=20, down_mbit=20)] * 3)
        again = probe.verify(topo, quick)
        assert all(r.ok for r in again), again
        after = topo.counters()
        assert after[1]["tx_bytes"] - before[1]["tx_bytes"] > 20e6 / 8 * 0.5  # the probe's bytes, seen on the veth
        sleeper = subprocess.Popen([*topo.exec_argv(1), "sleep", "60"])
    assert sleeper.wait(timeout=10) != 0  # stopped by the teardown
    assert ours() == []


def test_teardown_on_exception():
    netns.require_root()
    with pytest.raises(RuntimeError, match="boom"):
        with Topology(TopologyConfig(prefix=PREFIX, nodes=2, subnet="10.251.8")):
            assert len(ours()) == 3
            raise RuntimeError("boom")
    assert ours() == []
