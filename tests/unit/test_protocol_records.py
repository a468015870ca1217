"""Records and envelopes: round trips, signatures bound to peer ids, strict rejection of garbage."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import given
from hypothesis import strategies as st

from shoal.protocol.envelope import open_envelope, seal
from shoal.protocol.errors import DecodeError, FieldError, ProtocolError, SignatureError, TooLargeError, VersionError
from shoal.protocol.kinds import RECORD_TYPES
from shoal.protocol.records import (MAX_CHECKS, Announcement, HardwareProfile, LeaveNotice, LinkStatus, RunStatus,
                                    StatusRecord, checkpoint_steps)
from shoal.protocol.signing import b58decode, b58encode, peer_id_from_public_key, public_key_bytes
from shoal.protocol.wire import pack, unpack

KEY = Ed25519PrivateKey.from_private_bytes(bytes(range(32)))
PID = peer_id_from_public_key(public_key_bytes(KEY))
HW = HardwareProfile(device_kind="cpu", device_name="test", memory_bytes=2**30, matmul_tflops=0.1,
                     free_disk_bytes=2**33, cpu_count=2)


def announcement(**kw) -> Announcement:
    base = dict(peer_id=PID, addrs=("/ip4/127.0.0.1/tcp/1/p2p/" + PID,), software_version="0.1.0",
                protocol_version=1, hardware=HW, started_at=1.7e9)
    return Announcement(**{**base, **kw})


def test_peer_id_matches_libp2p():
    from libp2p.crypto.ed25519 import Ed25519PrivateKey as LK
    from libp2p.peer.id import ID

    lk = LK.from_bytes(KEY.private_bytes_raw())
    assert ID.from_pubkey(lk.get_public_key()).to_base58() == PID


@pytest.mark.parametrize("record", [
    announcement(),
    StatusRecord(peer_id=PID, seq=5, time=1.7e9, role="active", state="training", step=12, loss=2.5,
                 slot="s0r1", bytes_sent=10, compression_ratio=150.0, state_hash="ab" * 16),
    LeaveNotice(peer_id=PID, time=1.7e9, reason="shutdown"),
])
def test_round_trip(record):
    env = seal(record, KEY)
    signed = open_envelope(env, RECORD_TYPES)
    assert signed.record == record
    assert signed.raw == env


def test_status_record_is_gossip_sized():
    rec = StatusRecord(peer_id=PID, seq=2**40, time=1.7e9, role="broker", state="training", run_id="r" * 64,
                       slot="s9r99", step=10**9, loss=1.0, eval_loss=1.0, tokens_per_s=1e6, state_hash="f" * 64,
                       error="x" * 200)
    assert len(seal(rec, KEY)) < 1024


def test_a_status_with_a_full_loss_history_stays_gossip_sized():
    """The thinned history a late dashboard draws the run from: 16 training and 16 held-out points of a long run
    (steps to 10^6, losses in thousandths) cost ~300 bytes on top of a typical record."""
    from shoal.protocol.records import HISTORY_POINTS

    steps = tuple(range(0, 10**6, 10**6 // HISTORY_POINTS))[:HISTORY_POINTS]
    base = dict(peer_id=PID, seq=2**40, time=1.7e9, role="active", state="training", run_id="r" * 64, slot="s0r1",
                step=10**6, loss=2.5, eval_loss=2.6, tokens_per_s=1e4, state_hash="f" * 64, ratio_now=12.5)
    plain = StatusRecord(**base)
    full = StatusRecord(**base, history_steps=steps, history_mloss=(65_000,) * len(steps), eval_steps=steps,
                        eval_mloss=(65_000,) * len(steps))
    assert open_envelope(seal(full, KEY), RECORD_TYPES).record == full
    assert full.history()[1] == (steps[1], 65.0)
    extra = len(seal(full, KEY)) - len(seal(plain, KEY))
    assert extra < 320 and len(seal(full, KEY)) < 1024, extra


def test_link_checkpoints_are_the_last_two_multiples_of_each_grain_and_stay_gossip_sized():
    assert checkpoint_steps(range(200)) == [128, 176, 192, 196]
    assert checkpoint_steps([3, 5]) == [] and checkpoint_steps([4, 8, 12]) == [8, 12]
    steps = checkpoint_steps(range(10**9 - 200, 10**9))
    assert len(steps) == MAX_CHECKS

    def link(name: str, side: str) -> LinkStatus:
        return LinkStatus(link=name, peer=PID, side=side, compression="aqsgd", step=10**9, digest="f" * 16,
                          rows=2**40, nacks=10**6, check_steps=tuple(steps), check_digests=("e" * 16,) * len(steps))

    middle = StatusRecord(peer_id=PID, seq=2**40, time=1.7e9, role="active", state="training", run_id="r" * 64,
                          slot="s9r99", step=10**9, loss=1.0, eval_loss=1.0, tokens_per_s=1e6, state_hash="f" * 64,
                          lane_links=(link("b0/fwd", "receiver"), link("b1/fwd", "sender")))
    assert open_envelope(seal(middle, KEY), RECORD_TYPES).record == middle
    assert len(seal(middle, KEY)) < 1400  # a middle stage's record, both links with every checkpoint
    with pytest.raises(FieldError, match="check_digests"):
        LinkStatus(link="b0/fwd", peer=PID, side="sender", compression="aqsgd", check_steps=(4, 8),
                   check_digests=("a" * 16,))
    with pytest.raises(FieldError, match="check_steps"):
        LinkStatus(link="b0/fwd", peer=PID, side="sender", compression="aqsgd", check_steps=tuple(range(7)),
                   check_digests=("a",) * 7)


def test_a_run_status_maps_one_to_one_onto_the_status_record_and_is_checked_where_it_is_built():
    record = {f.name: f.type for f in dataclasses.fields(StatusRecord)}
    for f in dataclasses.fields(RunStatus):  # same name, the record's type (or None: unsaid)
        assert f.name in record, f.name
        assert f.type == (record[f.name] if record[f.name].endswith(" | None") else f"{record[f.name]} | None")
    with pytest.raises(FieldError, match="state"):
        RunStatus(state="dancing")
    with pytest.raises(FieldError, match="step"):
        RunStatus(step=-1)
    with pytest.raises(FieldError, match="lane_links"):
        RunStatus(lane_links=({"link": "b0/fwd"},))  # a link status lacking its peer
    said = RunStatus(state="training", step=7, loss=2.5, lane_links=(LinkStatus(
        link="b0/fwd", peer=PID, side="sender", compression="aqsgd"),))
    assert said.said().keys() == {"state", "step", "loss", "lane_links"}  # unsaid fields are left to the record
    rec = StatusRecord(peer_id=PID, seq=1, time=1.7e9, **said.said())
    assert rec.step == 7 and rec.role == "idle" and rec.lane_links == said.lane_links
    assert said.to_wire()["lane_links"] == [rec.lane_links[0].to_wire()]
    assert said.to_wire().keys() == said.said().keys()  # no run named: what it said
    named = RunStatus(run_id="r" * 64, state="training", step=3).to_wire()  # a run's: its optional fields too
    assert named["loss"] is None and named["slot"] is None and named["step"] == 3 and "tokens_per_s" not in named


def test_record_signed_by_another_key_is_rejected():
    other = Ed25519PrivateKey.generate()
    rec = announcement()
    with pytest.raises(SignatureError):
        seal(rec, other)  # refuses to sign for a peer id that is not the key's
    # forge: sign the body with another key but claim PID
    env = msgpack.unpackb(seal(rec, KEY), raw=False)
    from shoal.protocol.envelope import signing_payload

    env["sig"] = other.sign(signing_payload(env["kind"], env["body"]))
    with pytest.raises(SignatureError):
        open_envelope(pack(env), RECORD_TYPES)


def test_tampered_body_is_rejected():
    env = msgpack.unpackb(seal(StatusRecord(peer_id=PID, seq=1, time=1.0, step=3), KEY), raw=False)
    body = msgpack.unpackb(env["body"], raw=False)
    body["step"] = 4
    env["body"] = pack(body)
    with pytest.raises(SignatureError):
        open_envelope(pack(env), RECORD_TYPES)


def test_unknown_fields_are_ignored_missing_fields_named():
    wire = {**announcement().to_wire(), "future_field": [1, 2, 3]}
    assert Announcement.from_wire(wire) == announcement()
    del wire["addrs"]
    with pytest.raises(FieldError, match="addrs"):
        Announcement.from_wire(wire)


@pytest.mark.parametrize("field,value", [
    ("seq", -1), ("seq", True), ("time", float("nan")), ("role", "king"), ("state", 3), ("loss", "low"),
    ("slot", "x" * 33), ("peer_id", ""), ("tokens_per_s", -5.0), ("bytes_sent", 2**63),
])
def test_bad_field_values_are_rejected_with_the_field_named(field, value):
    wire = StatusRecord(peer_id=PID, seq=1, time=1.0).to_wire()
    wire[field] = value
    with pytest.raises(FieldError) as e:
        StatusRecord.from_wire(wire)
    assert e.value.field == field


def test_announcement_reachability_fields_are_strict_with_defaults_for_older_senders():
    circuit = f"/ip4/198.51.100.10/tcp/4001/p2p/{PID}/p2p-circuit/p2p/{PID}"
    ann = announcement(reachability="relayed", relay=False, revision=3, addrs=(circuit,))
    assert open_envelope(seal(ann, KEY), RECORD_TYPES).record == ann
    older = {k: v for k, v in ann.to_wire().items() if k not in ("reachability", "relay", "revision")}
    rec = Announcement.from_wire(older)  # a node from before these fields
    assert (rec.reachability, rec.relay, rec.revision) == ("unknown", False, 0)
    for field, value in (("reachability", "sometimes"), ("reachability", 1), ("relay", "yes"), ("revision", -1),
                         ("revision", 2**40)):
        with pytest.raises(FieldError) as e:
            Announcement.from_wire({**ann.to_wire(), field: value})
        assert e.value.field == field


def test_nested_field_errors_name_the_path():
    wire = announcement().to_wire()
    wire["hardware"]["device_kind"] = "abacus"
    with pytest.raises(FieldError, match="hardware.device_kind"):
        Announcement.from_wire(wire)


def test_size_limits_and_versions():
    with pytest.raises(TooLargeError):
        unpack(b"\x00" * 70_000)
    with pytest.raises(DecodeError):
        unpack(pack(list(range(5000))))  # array longer than any record needs
    env = msgpack.unpackb(seal(announcement(), KEY), raw=False)
    env["v"] = 99
    with pytest.raises(VersionError):
        open_envelope(pack(env), RECORD_TYPES)
    env["v"], env["kind"] = 1, "pickle"
    with pytest.raises(DecodeError, match="unknown record kind"):
        open_envelope(pack(env), RECORD_TYPES)


def test_base58_round_trip():
    for raw in (b"", b"\0\0\1", bytes(range(40))):
        assert b58decode(b58encode(raw)) == raw


@given(st.binary(max_size=2048))
def test_garbage_bytes_only_raise_protocol_errors(data):
    try:
        open_envelope(data, RECORD_TYPES)
    except ProtocolError:
        pass


GOOD = [seal(announcement(), KEY), seal(StatusRecord(peer_id=PID, seq=3, time=2.0, loss=1.5), KEY)]


@given(st.sampled_from(GOOD), st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1, max_size=8))
def test_mutated_envelopes_never_verify_wrongly(env, flips):
    data = bytearray(env)
    for pos, val in flips:
        data[pos % len(data)] = val
    try:
        signed = open_envelope(bytes(data), RECORD_TYPES)
    except ProtocolError:
        return
    # a mutation that still verifies must have left the signed content unchanged
    assert signed.record in [open_envelope(g, RECORD_TYPES).record for g in GOOD]


json_like = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70).filter(lambda i: -2**63 <= i < 2**64)
    | st.floats(allow_nan=True) | st.text(max_size=20) | st.binary(max_size=20),
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=10), children, max_size=5),
    max_leaves=20,
)


@given(st.dictionaries(st.sampled_from([f.name for f in dataclasses.fields(Announcement)] + ["x"]), json_like))
def test_structured_garbage_in_records_only_raises_protocol_errors(m):
    for cls in RECORD_TYPES.values():
        try:
            cls.from_wire(m)
        except ProtocolError:
            pass
