"""Assignment records: strict validation, signatures, and acceptance by gossip and the DHT validator."""

from __future__ import annotations

import dataclasses
import time

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from shoal.protocol.assignment import (
    AdmitRequest, AdmitResponse, AssignmentTable, BrokerLease, MissingReport, ProviderEntry, SlotEntry)
from shoal.protocol.envelope import open_envelope, seal
from shoal.protocol.errors import FieldError, ProtocolError, SignatureError
from shoal.protocol.kinds import RECORD_TYPES
from shoal.swarm.net.dht_records import ShoalRecordValidator, lease_key, table_key
from shoal.swarm.net.identity import peer_id_of
from tests.helpers.swarm import HW

K1, K2, K3, K4 = (Ed25519PrivateKey.generate() for _ in range(4))
P1, P2, P3, P4 = (peer_id_of(k) for k in (K1, K2, K3, K4))


def table(**over) -> AssignmentTable:
    kw = dict(peer_id=P1, run_id="r" * 64, lease_epoch=0, version=3, time=time.time(), stages=1, replicas=2,
              epochs=(2,), standby=P2, slots=(SlotEntry(stage=0, replica=0, peer_id=P1),
                                              SlotEntry(stage=0, replica=1, peer_id=P2)),
              backups=(P3,), providers=(ProviderEntry(peer_id=P4, state="draining"),))
    kw.update(over)
    return AssignmentTable(**kw)


def test_table_round_trips_signed_and_answers_queries():
    t = table()
    signed = open_envelope(seal(t, K1), RECORD_TYPES)
    assert signed.record == t
    assert t.members(0) == tuple(sorted([P1, P2])) and t.slot_of(P2) == (0, 1) and t.slot_of(P3) is None
    assert t.provider_state(P3) == "backup" and t.provider_state(P1) == "active"
    assert t.provider_state(P4) == "draining" and t.provider_state(peer_id_of(Ed25519PrivateKey.generate())) is None
    assert t.provider_states() == {P1: "active", P2: "active", P3: "backup", P4: "draining"}
    assert table(version=4).newer_than(t) and table(lease_epoch=1, version=1).newer_than(t)
    assert not t.newer_than(table(version=4))
    with pytest.raises(SignatureError):
        seal(t, K2)  # only the broker named in the table can sign it


@pytest.mark.parametrize("bad", [
    dict(epochs=(1, 2)),  # one epoch per stage
    dict(slots=(SlotEntry(stage=0, replica=0, peer_id=P1), SlotEntry(stage=0, replica=0, peer_id=P2))),
    dict(slots=(SlotEntry(stage=0, replica=5, peer_id=P1),)),  # outside the plan
    dict(backups=(P2,)),  # in a slot and a backup
    dict(standby=P1),  # the broker as its own standby
    dict(providers=(ProviderEntry(peer_id=P4, state="draining"),) * 2),
    dict(providers=(ProviderEntry(peer_id=P3, state="backup"),)),  # a backup listed twice
    dict(providers=(ProviderEntry(peer_id=P1, state="active"),)),  # a slot holder listed twice
    dict(backups=("not-a-peer-id",), backup_stages=(0,)),  # a peer id that inlines no Ed25519 key
    dict(version=-1),
    dict(run_id=""),
])
def test_table_rejects_inconsistent_fields(bad):
    with pytest.raises(FieldError):
        table(**bad)


def test_wire_bodies_are_strict():
    with pytest.raises(FieldError):
        ProviderEntry.from_wire({"peer_id": P1, "state": "emperor"})
    # a listed peer travels as its 32-byte key and reads back as its id; any other length or type is refused
    wire = SlotEntry(stage=0, replica=0, peer_id=P1).to_wire()
    assert isinstance(wire["peer_id"], bytes) and len(wire["peer_id"]) == 32
    assert SlotEntry.from_wire(wire).peer_id == P1
    for bad in (wire["peer_id"][:31], wire["peer_id"] + b"\0", 5, None):
        with pytest.raises(FieldError):
            SlotEntry.from_wire({**wire, "peer_id": bad})
    with pytest.raises(FieldError):
        AdmitRequest.from_wire({"run_id": "r", "hardware": HW.to_wire(), "proof": 5})
    with pytest.raises(FieldError):
        AdmitRequest.from_wire({"run_id": "r", "hardware": HW.to_wire(), "proof": b"x" * 33})
    req = AdmitRequest.from_wire({"run_id": "r", "hardware": HW.to_wire(), "future_field": 1})
    assert req.proof is None and not req.backup_only
    assert AdmitResponse.from_wire(AdmitResponse(admitted=False, error="no").to_wire()).error == "no"
    with pytest.raises(FieldError):
        MissingReport.from_wire({"run_id": "r", "epoch": 1, "missing": ["x"] * 1000})
    with pytest.raises(FieldError):
        BrokerLease(peer_id=P1, run_id="r", lease_epoch=0, time=10.0, expires_at=5.0)


def test_dht_validator_accepts_signed_run_records_at_their_signers_key():
    v = ShoalRecordValidator()
    now = time.time()
    lease = seal(BrokerLease(peer_id=P1, run_id="r", lease_epoch=0, time=now, expires_at=now + 15), K1)
    v.validate(lease_key(P1), lease)
    v.validate(table_key(P1), seal(table(), K1))
    with pytest.raises(ValueError):
        v.validate(lease_key(P2), lease)  # stored under someone else's key
    newer = seal(BrokerLease(peer_id=P1, run_id="r", lease_epoch=0, time=now + 3, expires_at=now + 18), K1)
    assert v.select(lease_key(P1), [lease, newer]) == 1
    with pytest.raises(ProtocolError):
        open_envelope(lease[:-3] + b"zzz", RECORD_TYPES)


def test_run_client_trusts_only_the_broker_chain():
    from types import SimpleNamespace

    from shoal.swarm.run.client import RunClient

    now = [1000.0]
    m = SimpleNamespace(owner="", signature=b"", run_id="r" * 64, join=SimpleNamespace(mode="open"))
    ctx = SimpleNamespace(me=P3, run_id="r" * 64, manifest=m, clock=lambda: now[0], wall=time.time,
                          silent_s=lambda last: now[0] - last)
    c = RunClient(ctx, HW, broker_id=P1)
    assert not c.accept_envelope(seal(table(peer_id=P2, standby=P1), K2), P2)  # not the broker we asked
    assert c.accept_envelope(seal(table(), K1), P1) and c.role() == "backup"
    assert not c.accept_envelope(seal(table(version=2), K1), P1)  # older
    assert not c.accept_envelope(seal(table(peer_id=P3, standby=P1, version=9, slots=(), backups=()), K3), P3)
    # the standby named in the table may take over with a higher lease epoch
    t2 = table(peer_id=P2, standby=P3, lease_epoch=1, version=4, backups=(),
               slots=(SlotEntry(stage=0, replica=0, peer_id=P3),))
    assert not c.accept_envelope(seal(t2, K2), P2)  # not while the broker's lease has not lapsed here
    now[0] += c.broker_config.lease_timeout_s + 0.1
    assert not c.accept_envelope(seal(dataclasses.replace(t2, lease_epoch=2), K2), P2)  # not previous + 1
    assert c.accept_envelope(seal(t2, K2), P2)
    assert c.broker_id == P2 and c.slot_name() == "s0r0" and c.group().members == (P3,)
    assert not c.accept_envelope(seal(table(version=99), K1), P1)  # the deposed broker is no longer trusted
    assert not c.accept_envelope(b"\x00garbage", P1)


def test_the_group_timeline_follows_each_stages_switch_step():
    from shoal.swarm.run.timeline import GroupTimeline

    s = GroupTimeline(P2)
    two = dict(stages=2, replicas=1, epochs=(1, 1), standby=None, backups=(), providers=())
    first = table(version=1, slots=(SlotEntry(stage=0, replica=0, peer_id=P1),
                                     SlotEntry(stage=1, replica=0, peer_id=P2)), switch_steps=(0, 0), **two)
    assert s.add(first) and s.group_at(0).members == (P2,) and s.group_at(0).stage == 1
    # P3 replaces P1 in stage 0 from step 10; stage 1 (this node's) is unchanged
    moved = table(version=2, slots=(SlotEntry(stage=0, replica=0, peer_id=P3),
                                    SlotEntry(stage=1, replica=0, peer_id=P2)),
                  switch_steps=(10, 0), **{**two, "epochs": (2, 1)})
    assert s.add(moved) and not s.add(first)  # an older table is not kept
    assert s.table_at(9, 0) is first and s.table_at(10, 0) is moved and s.table_at(5, 1) is moved
    assert s.group_at(12).epoch == 1 and s.entry() == (0, 1, 0)
    assert s.switch_steps(moved) == {10}


def test_a_groups_entering_members_are_those_not_in_the_stages_group_before_its_switch_step():
    from shoal.swarm.run.timeline import GroupTimeline

    s = GroupTimeline(P1)
    one = dict(stages=1, replicas=3, standby=None, backups=(), providers=())
    first = table(version=1, slots=(SlotEntry(stage=0, replica=0, peer_id=P1),
                                    SlotEntry(stage=0, replica=1, peer_id=P2)), switch_steps=(0,), epochs=(1,), **one)
    grown = table(version=2, slots=(SlotEntry(stage=0, replica=0, peer_id=P1), SlotEntry(stage=0, replica=1, peer_id=P2),
                                    SlotEntry(stage=0, replica=2, peer_id=P3)), switch_steps=(20,), epochs=(2,), **one)
    reformed = dataclasses.replace(grown, version=3, switch_steps=(30,), epochs=(3,))
    assert s.add(first) and s.group_at(5).entering == frozenset()  # the run's first group: everyone starts fresh
    assert s.add(grown) and s.group_at(19).entering == frozenset()
    assert s.group_at(20).entering == frozenset({P3}) and s.group_at(25).entering == frozenset({P3})
    assert s.add(reformed) and s.group_at(30).entering == frozenset()  # the same members, next epoch


def test_a_node_moved_to_another_stage_keeps_its_old_stages_group_until_the_switch_step():
    # a re-plan swaps this node (P2, s1r0) with P1 (s0r0) from step 10: until step 10 the node still trains stage 1
    # (its trainer's stage); from step 10 it has no stage-1 group and enters stage 0 (node/run/runtime.py `_train`)
    from shoal.swarm.run.timeline import GroupTimeline

    s = GroupTimeline(P2)
    two = dict(stages=2, replicas=1, epochs=(1, 1), standby=None, backups=(), providers=())
    first = table(version=1, slots=(SlotEntry(stage=0, replica=0, peer_id=P1),
                                     SlotEntry(stage=1, replica=0, peer_id=P2)), switch_steps=(0, 0), **two)
    swapped = table(version=2, slots=(SlotEntry(stage=0, replica=0, peer_id=P2),
                                      SlotEntry(stage=1, replica=0, peer_id=P1)),
                    switch_steps=(10, 10), **{**two, "epochs": (2, 2)})
    assert s.add(first) and s.add(swapped)
    assert s.entry() == (10, 0, 0)
    assert s.group_at(9) is None  # the newest slot's stage (0): no group of it before step 10
    old = s.group_at(9, stage=1)
    assert old is not None and old.stage == 1 and old.members == (P2,) and old.epoch == 1
    assert s.group_at(10, stage=1) is None  # from the switch step the node holds no stage-1 slot
    new = s.group_at(10)
    assert new is not None and new.stage == 0 and new.members == (P2,) and new.epoch == 2


def test_a_table_at_every_limit_fits_the_gossip_cap_and_lists_each_provider_once():
    """MAX_PROVIDERS providers (MAX_REPLICAS of them in slots, the rest backups), MAX_GONE_LISTED gone ones, the
    MAX_EVICTED newest evictions, a lane share each and the owner's delegation: the sealed table is one gossip
    message. Peers travel as their 32-byte keys: a backup costs 35 bytes (its key and its stage)."""
    from shoal.protocol.assignment import (MAX_EVICTED, MAX_GONE_LISTED, MAX_PROVIDERS, MAX_REPLICAS,
                                           BrokerDelegation, LaneShare)
    from shoal.protocol.wire import pack
    from shoal.swarm.net.gossip import MAX_GOSSIP_BYTES

    keys = [Ed25519PrivateKey.generate() for _ in range(MAX_PROVIDERS + MAX_GONE_LISTED + MAX_EVICTED)]
    ids = [peer_id_of(k) for k in keys]
    seated, pool = ids[:MAX_REPLICAS], ids[MAX_REPLICAS:MAX_PROVIDERS]
    gone, evicted = ids[MAX_PROVIDERS:MAX_PROVIDERS + MAX_GONE_LISTED], ids[MAX_PROVIDERS + MAX_GONE_LISTED:]
    delegation = seal(BrokerDelegation(peer_id=P2, run_id="r" * 64, brokers=tuple(seated[1:9]), time=time.time()), K2)
    t = table(peer_id=seated[0], replicas=MAX_REPLICAS, standby=seated[1],
              slots=tuple(SlotEntry(stage=0, replica=i, peer_id=p) for i, p in enumerate(seated)),
              backups=tuple(pool), backup_stages=(0,) * len(pool),
              providers=tuple(ProviderEntry(peer_id=p, state="gone") for p in gone), evicted=tuple(evicted),
              delegation=delegation, shares=tuple(LaneShare(replica=i, samples=1 << 20) for i in range(MAX_REPLICAS)))
    env = seal(t, keys[0])
    assert len(env) < MAX_GOSSIP_BYTES, len(env)
    print(f"a table at every limit: {len(env):,} bytes sealed (gossip cap {MAX_GOSSIP_BYTES:,})")
    assert open_envelope(env, RECORD_TYPES).record == t
    assert len(t.provider_states()) == MAX_PROVIDERS + MAX_GONE_LISTED
    more = table(backups=tuple(pool[:100]), backup_stages=(0,) * 100)
    assert (len(pack(more.to_wire())) - len(pack(table(backups=(), backup_stages=()).to_wire()))) / 100 < 36
    with pytest.raises(FieldError):  # one more provider than the limit
        table(peer_id=seated[0], replicas=MAX_REPLICAS, standby=seated[1],
              slots=tuple(SlotEntry(stage=0, replica=i, peer_id=p) for i, p in enumerate(seated)),
              backups=tuple(pool) + (P3,), backup_stages=(0,) * (len(pool) + 1),
              providers=tuple(ProviderEntry(peer_id=p, state="gone") for p in gone + [P4]))
