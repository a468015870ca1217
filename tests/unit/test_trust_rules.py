"""The rules behind the second trust pass, alone (no network): whose reports count against a member, which epochs a
collective takes, how old a relayed members row is, a chosen join secret's strength, and a source address."""

from __future__ import annotations

import time

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from shoal.protocol.admission import new_secret, weak_secret
from shoal.protocol.assignment import AssignmentTable, SlotEntry
from shoal.protocol.envelope import seal
from shoal.protocol.records import StatusRecord
from shoal.swarm.net.addresses import source_key
from shoal.swarm.net.identity import peer_id_of
from shoal.swarm.net.membership import MAX_RELAYED_AGE_S, verified_members
from shoal.swarm.run.accusations import MISSED, OFFENCE, Accusations, majority_of_others
from shoal.swarm.run.collective_gate import CollectiveGate, inbox_limits

IDS = sorted(peer_id_of(Ed25519PrivateKey.generate()) for _ in range(5))
RUN = "r" * 64


def test_a_report_counts_with_a_strict_majority_of_the_others_or_the_brokers_measurement():
    a, b, c, d = IDS[:4]
    assert majority_of_others({b, c}, (a, b, c), a) and not majority_of_others({b}, (a, b, c), a)
    assert not majority_of_others({b}, (a, b), a)  # two members: one word against one
    assert majority_of_others({b, c}, (a, b, c, d), a) and not majority_of_others({b}, (a, b, c, d), a)
    now = [0.0]
    acc = Accusations(lambda: now[0], window_s=600, false_to_penalize=3)
    members = (a, b, c)
    for i in range(2):  # b alone reports a: no count; after 3 unconfirmed reports b is a false accuser
        acc.report(MISSED, 0, i, a, b, members)
        v = acc.judge(MISSED, 0, i, a, members, measured=None)
        assert not v.counts and v.false_accusers == ()
    acc.report(MISSED, 0, 2, a, b, members)
    v = acc.judge(MISSED, 0, 2, a, members, measured=None)
    assert not v.counts and v.false_accusers == (b,) and acc.distrusted(b)
    now[0] += 601  # forgiven after the window
    assert not acc.distrusted(b)
    acc.report(MISSED, 0, 3, a, b, members)
    acc.report(MISSED, 0, 3, a, c, members)
    assert acc.judge(MISSED, 0, 3, a, members, measured=None).counts
    # two members: the broker's measurement decides either way
    assert acc.judge(MISSED, 0, 4, a, (a, b), measured=True).counts
    acc.report(MISSED, 0, 5, a, b, (a, b))
    assert acc.judge(MISSED, 0, 5, a, (a, b), measured=None).false_accusers == ()  # no measurement: no verdict
    # offences wait for their epoch's end: an unconfirmed reporter is marked only then
    acc2 = Accusations(lambda: 0.0, window_s=600, false_to_penalize=1)
    acc2.report(OFFENCE, 0, 7, a, b, members)
    assert not acc2.judge(OFFENCE, 0, 7, a, members, measured=None, final=False).counts
    assert acc2.report(OFFENCE, 0, 8, c, b, members) == (b,)  # epoch 7 settled: b's report went unconfirmed


def table(*, version: int, epoch: int, switch: int, members: list[str], backups: list[str] = ()) -> AssignmentTable:
    return AssignmentTable(peer_id=IDS[0], run_id=RUN, lease_epoch=0, version=version, time=time.time(), stages=1,
                           replicas=len(members), epochs=(epoch,), switch_steps=(switch,),
                           slots=tuple(SlotEntry(stage=0, replica=i, peer_id=p) for i, p in enumerate(members)),
                           backups=tuple(backups))


def test_the_collective_takes_members_of_the_epoch_in_force_or_announced_only():
    a, b, c, backup = IDS[:4]
    tables = [table(version=1, epoch=1, switch=0, members=[a, b], backups=[c, backup]),
              table(version=2, epoch=2, switch=20, members=[a, b, c], backups=[backup])]
    step = [10]
    gate = CollectiveGate(RUN, lambda: tables, step=lambda: step[0], clock=lambda: 0.0)
    tag = lambda e, r=11: f"{RUN[:16]}/0/{e}/{r}/up"  # noqa: E731
    assert gate(b, tag(1)) is None and gate(c, tag(2)) is None  # in force; announced for step 20
    assert gate(c, tag(1)).penalize  # not a member of epoch 1
    assert not gate(backup, tag(3)).penalize  # an epoch nobody announced yet: refused, forgiven a few times
    for _ in range(8):
        gate(backup, tag(3))
    assert gate(backup, tag(3)).penalize  # ... then an offence
    assert gate(IDS[4], tag(3)).penalize  # a stranger is never forgiven
    step[0] = 25  # epoch 1 is over once epoch 2 is in force
    r = gate(b, tag(1))
    assert r is not None and not r.penalize and "over" in r.why


def test_inbox_limits_scale_with_the_run():
    from shoal.protocol.manifest import ModelSpec, ParallelPlan, RunManifest, SyncSpec

    m = RunManifest.default(plan=ParallelPlan(replicas=4, sync=SyncSpec(method="allreduce")))
    lim = inbox_limits(m, round_timeout_s=20.0, entry_grace_rounds=2.0)
    assert lim.max_frame_bytes >= 8 * m.stage_params(0) and lim.max_peer_buffer_bytes == 2 * lim.max_frame_bytes
    # a message waits as long as its sender waits for this node: two phases, and two more rounds for an entering node
    assert lim.max_buffer_bytes == 4 * lim.max_peer_buffer_bytes and lim.max_wait_s == 4 * 20.0 + 10.0
    big = RunManifest.default(model=ModelSpec.preset("small"), plan=ParallelPlan(replicas=2,
                                                                                sync=SyncSpec(method="allreduce")))
    assert inbox_limits(big, 20.0, 2.0).max_frame_bytes > lim.max_frame_bytes


def test_a_relayed_members_row_is_never_fresher_than_its_signed_status():
    key = Ed25519PrivateKey.generate()
    pid = peer_id_of(key)
    now = time.time()
    old = seal(StatusRecord(peer_id=pid, seq=1, time=now - 100.0, run_id=None), key)
    fresh = seal(StatusRecord(peer_id=pid, seq=2, time=now, run_id=None), key)
    blamed: list[str] = []
    rows = verified_members([[None, old, 0.0], [None, fresh, 1.5]], blamed.append, wall=lambda: now)
    assert [round(age, 1) for _, age in rows] == [95.0, 1.5] and not blamed
    assert verified_members([[None, None, 0.0]], blamed.append, wall=lambda: now) == []
    assert MAX_RELAYED_AGE_S > 95


@pytest.mark.parametrize("secret, weak", [("hunter2", True), ("mysecretpassword", True), ("a" * 40, True),
                                          ("correct horse battery staple", False), pytest.param(new_secret(), False, id="generated")])
def test_a_chosen_join_secret_is_weak_when_short_or_low_in_entropy(secret, weak):
    assert (weak_secret(secret) is not None) == weak


class _Conn:
    def __init__(self, *addrs):
        self.addrs = addrs

    def get_transport_addresses(self):
        return list(self.addrs)


def test_a_source_is_an_ipv4_address_an_ipv6_64_or_a_relay():
    assert source_key(_Conn("/ip4/203.0.113.7/tcp/4001")) == "203.0.113.7"
    assert source_key(_Conn("/ip6/2001:db8:1:2:3:4:5:6/tcp/4001")) == "2001:db8:1:2::/64"
    relay = IDS[0]
    assert source_key(_Conn(f"/p2p/{relay}/p2p-circuit")) == f"via {relay}"
    assert source_key(_Conn()) == "?"
