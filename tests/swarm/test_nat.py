"""Nodes behind real NATs: a public segment and two home networks behind MASQUERADE routers, in namespaces.

Needs root (CI runs as root) and iptables (`.ci/run` installs it); a namespace that cannot be made fails the
tests, it never skips them. Layout: the bootstrap P (public, serves as relay) on the public segment; A behind
NAT 0; B and a third host behind NAT 1. The routers drop unsolicited inbound packets, as home routers do; one
test turns that off to show what bare MASQUERADE does to a hole punch.
"""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

import pytest

from shoal.bench.nat_topology import Topology, TopologyConfig, wait_status
from shoal.node.train.hardware import hardware_profile

from tests.swarm.test_run_swarm import write_run  # the same small run as the loopback training tests

pytestmark = pytest.mark.slow
NATCHECK = "shoal.bench.natcheck"


@pytest.fixture(scope="module")
def topo():
    t = Topology(TopologyConfig(public_hosts=1, homes=(1, 2), firewall=True)).build()  # fails, never skips
    try:
        yield t
    finally:
        t.close()


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    h = tmp_path_factory.mktemp("home")
    hardware_profile("cpu", h)  # measured once, not by every node at once
    return h


class Swarm:
    def __init__(self, topo: Topology, workdir: Path, home: Path):
        self.topo, self.workdir = topo, workdir
        self.p = topo.start_node(topo.pub_ns(0), topo.pub_ip(0), workdir, "p", home=home)
        st = wait_status(self.p, lambda s: s.get("state") == "ready", 60, "P ready")
        self.join = st["addrs"][0]
        self.a = topo.start_node(topo.home_ns(0), topo.home_ip(0), workdir, "a", [self.join], home=home)
        self.b = topo.start_node(topo.home_ns(1), topo.home_ip(1), workdir, "b", [self.join], home=home)

    def stop(self) -> None:
        for n in (self.p, self.a, self.b):
            if n.alive:
                n.proc.send_signal(signal.SIGTERM)
        for n in (self.p, self.a, self.b):
            n.proc.wait(timeout=20)


@pytest.fixture(scope="module")
def swarm(topo, home, tmp_path_factory):
    s = Swarm(topo, tmp_path_factory.mktemp("swarm"), home)
    try:
        yield s
    finally:
        s.stop()


def relayed(s: dict) -> bool:
    return s.get("nat", {}).get("reachability") == "relayed"


def natcheck(topo: Topology, ns: str, *args: str, timeout_s: float = 90) -> dict:
    out = topo.run_tool(ns, [NATCHECK, *args], timeout_s)
    assert "error" not in out, out
    return out


def test_a_nated_node_joins_holds_a_relay_and_is_seen_by_all(swarm):
    sa = wait_status(swarm.a, relayed, 40, "A relayed")
    sb = wait_status(swarm.b, relayed, 40, "B relayed")
    sp = swarm.p.status()
    assert sp["nat"]["reachability"] == "public" and sp["nat"]["relay"]  # dialed back at its public address
    for s in (sa, sb):
        assert s["nat"]["relays"] == [sp["peer_id"]]
        assert s["nat"]["addrs"][0] == f"{swarm.join}/p2p-circuit/p2p/{s['peer_id']}"  # advertised first
        assert not s["nat"]["relay"]
    ids = {n: s["peer_id"] for n, s in (("p", sp), ("a", sa), ("b", sb))}
    for n, node in (("p", swarm.p), ("a", swarm.a), ("b", swarm.b)):
        others = {v for k, v in ids.items() if k != n}
        wait_status(node, lambda s: others <= set(s["peers"]), 30, f"{n} sees the other two")
    print(f"A reachable through the relay {sa['nat']['relayed_after_s']:.2f} s after it started")


def test_a_node_behind_the_other_nat_reaches_it_through_the_relay_then_directly(topo, swarm):
    a = wait_status(swarm.a, relayed, 40, "A relayed")
    out = natcheck(topo, topo.home_ns(1, 1), "reach", "--join", swarm.join, "--target", a["peer_id"])
    assert out["reachability"] == "relayed" and out["target_reachability"] == "relayed"  # A's announcement
    assert out["first_path"] == "relayed"  # the RPC went through P before anything else
    assert out["direct"], out  # then DCUtR made a direct connection across both NATs ...
    assert out["bulk_stream_path"] == "direct"  # ... which a bulk stream takes
    print(f"relayed RPC {out['relayed_rpc_s']:.2f} s, direct after {out['direct_s']:.2f} s")


def test_relay_limits_hold_against_a_peer_pushing_bulk_data_through_it(topo, swarm):
    a = wait_status(swarm.a, relayed, 40, "A relayed")
    before = swarm.p.status()["nat"]
    out = natcheck(topo, topo.home_ns(1, 1), "flood", "--join", swarm.join, "--target", a["peer_id"],
                   "--via", swarm.join, "--seconds", "6", "--no-hole-punch")
    after = wait_status(swarm.p, lambda s: s["nat"]["relay_cut"] > before["relay_cut"], 10, "a circuit cut")["nat"]
    relayed_bytes = after["relay_bytes"] - before["relay_bytes"]
    # defaults: 1 MiB per circuit, 4 MiB per source per minute (both directions count)
    assert out["sent"] > 1 << 20 and out["circuits"] >= 2, out  # it pushed more than one circuit may carry
    assert relayed_bytes <= (4 << 20) + (1 << 20), (relayed_bytes, out)  # never more than the budget (+ A's share)
    assert out["echoed"] <= relayed_bytes
    # the relay goes on serving everyone else: a fresh peer behind NAT 1 still reaches A through it
    again = natcheck(topo, topo.home_ns(1, 1), "reach", "--join", swarm.join, "--target", a["peer_id"])
    assert again["first_path"] == "relayed" and again["relayed_rpc_s"] < 5
    print(f"pushed {out['sent'] / 2**20:.1f} MiB over {out['circuits']} circuits; relayed {relayed_bytes / 2**20:.2f}"
          f" MiB; {after['relay_cut'] - before['relay_cut']} circuits cut")


def test_bare_masquerade_resets_the_hole_punch_and_bulk_never_rides_the_relay(topo, swarm):
    """Without the routers' drop rules, the NAT's own TCP stack answers the first SYN of the punch with a reset
    (no socket listens on the router), the reset tears down the other NAT's fresh mapping, and on links this
    short the two SYNs never cross in flight: the punch fails, control traffic stays on the relay."""
    a = wait_status(swarm.a, relayed, 40, "A relayed")
    for h in (0, 1):
        topo.sh(topo.nat_ns(h), "iptables", "-w", "5", "-F", "INPUT")
        topo.sh(topo.nat_ns(h), "iptables", "-w", "5", "-F", "FORWARD")
    try:
        out = natcheck(topo, topo.home_ns(1, 1), "reach", "--join", swarm.join, "--target", a["peer_id"],
                       "--timeout", "8")
    finally:
        for h in (0, 1):
            topo.sh(topo.nat_ns(h), "iptables", "-w", "5", "-F", "INPUT")
            topo.sh(topo.nat_ns(h), "iptables", "-w", "5", "-F", "FORWARD")
            for chain in ("INPUT", "FORWARD"):
                topo.sh(topo.nat_ns(h), "iptables", "-w", "5", "-A", chain, "-i", "wan", "-m", "conntrack",
                        "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT")
                topo.sh(topo.nat_ns(h), "iptables", "-w", "5", "-A", chain, "-i", "wan", "-j", "DROP")
    assert out["first_path"] == "relayed" and out["relayed_rpc_s"] < 5  # the relay carries the RPC
    assert not out["direct"] and "did not make a direct connection" in out["why"], out


def test_training_with_two_of_three_replicas_behind_nats_ends_with_equal_hashes(topo, swarm, home,
                                                                               tmp_path_factory):
    swarm.stop()  # the CPU goes to training
    wd = tmp_path_factory.mktemp("train")
    run = write_run(wd, replicas=3)
    steps = 30
    args = ("--run", str(run), "--threads", "1", "--steps", str(steps), "--round-timeout", "10", "--fail-after", "8")
    p = topo.start_node(topo.pub_ns(0), topo.pub_ip(0), wd, "node0", (), args, home=home, port=4002)
    join = [wait_status(p, lambda s: s.get("state") not in (None, "starting"), 60, "P ready")["addrs"][0]]
    nodes = [p] + [topo.start_node(topo.home_ns(h), topo.home_ip(h), wd, f"node{h + 1}", join, args, home=home,
                                   port=4002) for h in (0, 1)]
    rows = [wait_status(n, lambda s: s.get("state") == "done" and s.get("step") == steps, 240, f"node{i} done")
            for i, n in enumerate(nodes)]
    print(json.dumps([{k: r.get(k) for k in ("slot", "step", "state_hash", "tokens_per_s")} for r in rows]))
    assert [r["nat"]["reachability"] for r in rows] == ["public", "relayed", "relayed"]
    assert len({r["state_hash"] for r in rows}) == 1  # the three replicas are bit-identical
    assert all(r["slot"] for r in rows) and all(r["loss"] < 4.5 for r in rows)
    a, b = rows[1], rows[2]
    assert b["peer_id"] in a["nat"]["direct_peers"] and a["peer_id"] in b["nat"]["direct_peers"]  # punched
    for n in nodes:
        n.proc.send_signal(signal.SIGTERM)
    assert [n.proc.wait(timeout=20) for n in nodes] == [0, 0, 0]
