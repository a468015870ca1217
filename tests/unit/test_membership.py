"""Membership view and penalties, in virtual time."""

from __future__ import annotations

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from shoal.protocol.envelope import Signed
from shoal.protocol.records import Announcement, HardwareProfile, LeaveNotice, StatusRecord
from shoal.protocol.signing import peer_id_from_public_key, public_key_bytes
from shoal.swarm.net.membership import ALIVE, GONE, LEFT, SUSPECT, Membership, MembershipConfig
from shoal.swarm.net.penalty import Penalties, PenaltyConfig


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def pid() -> str:
    return peer_id_from_public_key(public_key_bytes(Ed25519PrivateKey.generate()))


def status(p, seq, t=100.0):
    return Signed(StatusRecord(peer_id=p, seq=seq, time=t), b"")


def test_join_suspect_gone_back():
    clock, a = Clock(), pid()
    m = Membership("me", MembershipConfig(suspect_after_s=3, gone_after_s=6), clock)
    assert [e.kind for e in m.observe(status(a, 1))] == ["join"]
    clock.t += 4
    assert m.sweep() == [] and m.peers[a].state == SUSPECT
    assert [e.peer_id for e in m.live_peers()] == [a]
    clock.t += 3
    assert [e.kind for e in m.sweep()] == ["gone"]
    assert m.live_peers() == []
    assert [e.kind for e in m.observe(status(a, 2))] == ["back"]
    assert m.peers[a].state == ALIVE


def test_old_status_is_ignored_and_self_is_not_a_member():
    clock, a = Clock(), pid()
    m = Membership("me", MembershipConfig(), clock)
    m.observe(status(a, 5))
    m.observe(status(a, 3))
    assert m.peers[a].status_record.seq == 5
    assert m.observe(status("me", 1)) == [] and "me" not in m.peers


def test_leave_is_immediate_and_late_status_does_not_resurrect():
    clock, a = Clock(), pid()
    m = Membership("me", MembershipConfig(), clock)
    m.observe(status(a, 1, t=100.0))
    assert [e.kind for e in m.observe(Signed(LeaveNotice(peer_id=a, time=101.0), b""))] == ["left"]
    assert m.peers[a].state == LEFT and m.live_peers() == []
    m.observe(status(a, 2, t=100.5))  # sent before the leave, delivered after
    assert m.peers[a].state == LEFT
    clock.t += 1
    m.observe(status(a, 3, t=200.0))  # the same identity restarted
    assert m.peers[a].state == ALIVE


def test_age_reported_by_a_relay_counts():
    clock, a = Clock(), pid()
    m = Membership("me", MembershipConfig(suspect_after_s=3, gone_after_s=6), clock)
    m.observe(status(a, 1), age_s=7.0)
    m.sweep()
    assert m.peers[a].state == GONE


def test_penalties_ban_with_capped_backoff():
    clock = Clock()
    p = Penalties(PenaltyConfig(strikes_before_ban=2, ban_base_s=10, ban_max_s=25, forget_after_s=1000), clock)
    assert not p.penalize("x", "a")
    assert p.penalize("x", "b") and p.is_banned("x")
    assert p.ban_remaining_s("x") == 10
    clock.t += 11
    assert not p.is_banned("x")
    p.penalize("x", "c")
    assert p.penalize("x", "d") and p.ban_remaining_s("x") == 20
    clock.t += 21
    p.penalize("x", "e")
    assert p.penalize("x", "f") and p.ban_remaining_s("x") == 25  # capped
    assert not p.is_banned("y")
    assert p.reasons("x")[-1] == "f"


def test_a_later_announcement_of_the_same_start_replaces_an_earlier_one_never_the_reverse():
    a, m = pid(), Membership("me")
    hw = HardwareProfile(device_kind="cpu", device_name="t", memory_bytes=1, matmul_tflops=0.1, free_disk_bytes=1)

    def ann(rev, reach, started=5.0):
        return Signed(Announcement(peer_id=a, addrs=(), software_version="0", protocol_version=1, hardware=hw,
                                   started_at=started, reachability=reach, revision=rev), b"")

    m.observe(ann(1, "unknown"))
    m.observe(ann(2, "relayed"))
    m.observe(ann(1, "unknown"))  # an older copy, relayed late by a peer
    assert m.peers[a].announcement_record.reachability == "relayed"
    m.observe(ann(1, "public", started=6.0))  # a restart: a new start time wins whatever its revision
    assert m.peers[a].announcement_record.reachability == "public"
