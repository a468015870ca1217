"""Placement by reachability: reachable providers take the dialed roles; groups hold only pairs that can connect."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shoal.protocol.records import REACHABILITY
from shoal.swarm.run.placement import DIAL_RANK, Reach, direct_possible, place_group, rank_for_dialed_roles

PUB, LAN, UNK, REL, UNR = (Reach(reachability=r) for r in ("public", "lan", "unknown", "relayed", "unreachable"))
REL_STUCK = Reach(reachability="relayed", punchable=False)


def test_every_announced_reachability_has_a_rank():
    assert set(DIAL_RANK) == set(REACHABILITY)
    with pytest.raises(ValueError):
        Reach(reachability="sometimes")


def test_reachable_providers_are_ranked_first_and_ties_keep_the_brokers_order():
    reach = {"a": REL, "b": PUB, "c": UNK, "d": LAN, "e": REL_STUCK, "f": PUB, "g": UNR}
    assert rank_for_dialed_roles(list("abcdefg"), reach) == ["b", "f", "d", "c", "a", "e", "g"]
    assert rank_for_dialed_roles(["x", "b"], reach) == ["b", "x"]  # nothing announced yet: "unknown"


def test_direct_paths():
    assert direct_possible(PUB, REL_STUCK) and direct_possible(REL_STUCK, PUB)  # the NATed one dials out
    assert direct_possible(REL, REL)  # a hole punch
    assert not direct_possible(REL, REL_STUCK) and not direct_possible(REL_STUCK, UNR)
    assert direct_possible(LAN, UNK) and direct_possible(LAN, LAN)
    same_home = Reach(reachability="relayed", punchable=False, network="203.0.113.7")
    assert direct_possible(same_home, same_home)
    assert not direct_possible(same_home, Reach(reachability="relayed", punchable=False, network="203.0.113.8"))


def test_a_group_never_pairs_two_nated_providers_that_cannot_punch():
    reach = {"n1": REL_STUCK, "n2": REL_STUCK, "p1": PUB, "p2": PUB, "n3": REL}
    assert place_group(["n1", "n2", "p1", "p2"], reach, 3) == ["p1", "p2", "n1"]  # n2 would need n1
    assert place_group(["n1", "n3", "p1"], reach, 3) == ["p1", "n3"]  # a punch needs both sides to cooperate
    assert place_group(["n2"], reach, 2, members=["n1"]) == ["n1"]  # the slot stays free rather than broken
    assert place_group(["n2", "p1"], reach, 2, members=["n1"]) == ["n1", "p1"]


def test_group_size_is_respected():
    reach = {c: PUB for c in "abcd"}
    assert place_group(list("abcd"), reach, 2) == ["a", "b"]
    assert place_group(list("abcd"), reach, 0) == []
    with pytest.raises(ValueError):
        place_group(["a"], reach, -1)


reaches = st.builds(Reach, reachability=st.sampled_from(sorted(DIAL_RANK)), punchable=st.booleans(),
                    network=st.sampled_from(["", "", "n1", "n2"]))


@given(st.dictionaries(st.sampled_from("abcdefgh"), reaches, min_size=1), st.integers(0, 8))
def test_every_pair_in_a_placed_group_can_connect(reach, size):
    group = place_group(sorted(reach), reach, size)
    assert len(group) == len(set(group)) <= size
    for x, y in itertools.combinations(group, 2):
        assert direct_possible(reach[x], reach[y])
    if group:  # the first member is the most reachable of all candidates
        assert DIAL_RANK[reach[group[0]].reachability] == min(DIAL_RANK[r.reachability] for r in reach.values())


async def test_the_broker_promotes_the_most_reachable_backup_that_can_reach_the_group():
    """Slot s0r0 frees up; of two backups, the public one is promoted ahead of the relayed one admitted first (what
    members dial should be dialable); when only the relayed one is left, it still fits a group of a public member."""
    import time
    from types import SimpleNamespace

    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from shoal.protocol.assignment import AdmitRequest
    from shoal.protocol.envelope import open_envelope, seal
    from shoal.protocol.kinds import RECORD_TYPES
    from shoal.protocol.manifest import ParallelPlan, RunManifest, SyncSpec
    from shoal.protocol.records import Announcement
    from shoal.swarm.net.identity import peer_id_of
    from shoal.swarm.net.membership import Membership
    from shoal.swarm.run.broker import Broker
    from shoal.swarm.run.context import RunContext
    from tests.helpers.swarm import HW

    keys = [Ed25519PrivateKey.generate() for _ in range(5)]
    ids = [peer_id_of(k) for k in keys]
    me = SimpleNamespace(key=Ed25519PrivateKey.generate(), peer_id=None)
    me.peer_id = peer_id_of(me.key)
    membership = Membership(me.peer_id)

    def announce(i: int, reachability: str) -> None:
        a = Announcement(peer_id=ids[i], addrs=("/ip4/127.0.0.1/tcp/1",), software_version="t", protocol_version=1,
                         hardware=HW, started_at=time.time(), reachability=reachability)
        membership.observe(open_envelope(seal(a, keys[i]), RECORD_TYPES))

    async def publish(env):
        pass

    m = RunManifest.default(plan=ParallelPlan(replicas=2, sync=SyncSpec(method="allreduce")))
    ctx = RunContext(sh=me, manifest=m, register=lambda *a: None, publish=publish, membership=membership)
    b = Broker(ctx)
    for i, r in enumerate(("public", "public", "relayed", "public")):
        announce(i, r)
    for pid in ids[:4]:
        assert (await b.admit(pid, AdmitRequest(run_id=m.run_id, hardware=HW))).admitted
    assert b.table.backups == (ids[2], ids[3])  # admitted in this order: the relayed one would come first
    b.mark_failed(ids[0], "gone")
    assert b.table.slot_of(ids[3]) == (0, 0)  # the public backup, ahead of the relayed one
    b.mark_failed(ids[3], "gone")
    assert b.table.slot_of(ids[2]) == (0, 0)  # the relayed one fits the public member
