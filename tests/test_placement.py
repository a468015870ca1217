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
