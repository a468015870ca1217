"""Run manifests: round trips, stable run ids, signatures, field errors; the identity key file."""

from __future__ import annotations

import dataclasses
import os
import stat

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shoal.swarm.net.identity import IdentityError, load_or_create_identity
from shoal.protocol.errors import FieldError, SignatureError
from shoal.protocol.manifest import (
    BatchSpec,
    JoinPolicy,
    OptimSpec,
    ParallelPlan,
    RunManifest,
    SyncSpec,
)
from shoal.protocol.signing import peer_id_from_public_key, public_key_bytes


@pytest.fixture(scope="module")
def key():
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    return Ed25519PrivateKey.from_private_bytes(bytes(range(32)))


def test_default_round_trips_through_toml_and_msgpack():
    m = RunManifest.default()
    assert RunManifest.from_toml(m.to_toml()) == m
    assert RunManifest.from_bytes(m.to_bytes()) == m
    assert len(m.run_id) == 64 and int(m.run_id, 16) >= 0


def test_run_id_is_stable_and_ignores_table_order(key):
    m = RunManifest.default("small", name="stable", created_at=1_700_000_000, seed=7).signed(key)
    text = m.to_toml()
    # the same content with the tables in another order is the same run
    blocks = text.split("\n\n")
    shuffled = "\n\n".join([blocks[0]] + list(reversed(blocks[1:])))
    again = RunManifest.from_toml(shuffled)
    assert again.run_id == m.run_id
    again.verify()
    assert RunManifest.default("small", name="stable", created_at=1_700_000_000, seed=7).signed(key).run_id == m.run_id
    assert dataclasses.replace(m, seed=8).run_id != m.run_id
    # the signature is not part of the id
    assert dataclasses.replace(m, signature=b"").run_id == m.run_id


def test_signed_manifest_verifies_and_tampering_fails(key):
    m = RunManifest.default().signed(key)
    assert m.owner == peer_id_from_public_key(public_key_bytes(key))
    m.verify()
    RunManifest.from_toml(m.to_toml()).verify()
    tampered = dataclasses.replace(m, optim=dataclasses.replace(m.optim, lr=1.0))
    with pytest.raises(SignatureError):
        tampered.verify()
    text = m.to_toml().replace("seed = 0", "seed = 1")
    with pytest.raises(SignatureError):
        RunManifest.from_toml(text).verify()
    with pytest.raises(SignatureError):
        RunManifest.default().verify()


def test_signature_of_another_owner_fails(key):
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    other = Ed25519PrivateKey.from_private_bytes(bytes(32))
    m = RunManifest.default().signed(key)
    forged = dataclasses.replace(m, owner=peer_id_from_public_key(public_key_bytes(other)))
    with pytest.raises(SignatureError):
        forged.verify()


@pytest.mark.parametrize(
    ("patch", "field"),
    [
        ("[plan]\nstages = 1\nreplicas = 0", "plan.replicas"),
        ("[plan]\nreplicas = 4", "plan.sync.method"),
        ("[plan.sync]\nmethod = \"gossip\"", "plan.sync.method"),
        ("[plan.sync.cocktail]\np = 2.0", "plan.sync.cocktail.p"),
        ("[plan.sync.cocktail]\nwarmup_bits = 3", "plan.sync.cocktail.warmup_bits"),
        ("[batch]\nbatch_size = 16\nmicro_batch_size = 5", "batch.micro_batch_size"),
        ("[model]\npositions = \"alibi\"", "model.positions"),
        ("[model]\nd_model = 100\nn_heads = 3", "model.n_heads"),
        ("[optim]\nlr = \"fast\"", "optim.lr"),
        ("[optim]\nwarmup_steps = 10\ntotal_steps = 5", "optim.warmup_steps"),
        ("[join]\nmode = \"allowlist\"\nallowlist = [\"not-a-peer\"]", "join.allowlist[0]"),
        ("[join]\nmode = \"secret\"", "join.secret_salt"),
        ("[join]\nmode = \"secret\"\nsecret_salt = \"00112233445566778899aabbccddeeff\"\nsecret_hash = \"" + "ab" * 32 + "\"",
         "join.secret_hash"),
        ("version = 99", "version"),
        ("seed = true", "seed"),
    ],
)
def test_invalid_fields_are_named(patch, field):
    with pytest.raises(FieldError) as e:
        RunManifest.from_toml(patch)
    assert e.value.field == field


def test_unknown_fields_are_ignored():
    m = RunManifest.from_toml('future_field = 3\n[model]\nsize = "tiny"\nexperts = 8\n')
    assert m == RunManifest.default()


def test_a_private_run_stores_no_verifier_of_its_secret_only_a_fresh_salt():
    policy = JoinPolicy.private()
    loaded = RunManifest.from_toml(RunManifest.default(join=policy).to_toml()).join
    assert loaded.mode == "secret" and loaded.secret_hash == "" and len(bytes.fromhex(loaded.secret_salt)) == 16
    assert JoinPolicy.private().secret_salt != JoinPolicy.private().secret_salt


def test_allowlist_admits_listed_peers_only(key):
    pid = peer_id_from_public_key(public_key_bytes(key))
    policy = JoinPolicy(mode="allowlist", allowlist=[pid])
    assert policy.allowlist == (pid,)
    assert policy.admits_peer(pid) and not policy.admits_peer("12D3KooWother")
    assert RunManifest.from_toml(RunManifest.default(join=policy).to_toml()).join == policy


def test_parallel_plan_carries_the_later_issues_settings():
    plan = ParallelPlan(stages=2, replicas=4, sync=SyncSpec(method="diloco"))
    m = RunManifest.default("small", plan=plan)
    back = RunManifest.from_toml(m.to_toml()).plan
    assert (back.stages, back.replicas, back.sync.method) == (2, 4, "diloco")
    c, d = back.sync.cocktail, back.sync.diloco
    assert (c.p, c.r, c.bits) == (0.1, 0.2, 4)
    assert (d.outer_lr, d.outer_momentum, d.e3m0) == (0.7, 0.9, False)
    assert (back.pipeline.fwd_bits, back.pipeline.bwd_bits) == (4, 8)


def test_aqsgd_settings_round_trip_and_bad_widths_are_named():
    from shoal.protocol.manifest import DataSpec, PipelineSpec

    pipe = PipelineSpec(compression="aqsgd", fwd_bits=2, bwd_bits=16, first_visit_bits=16, buffer="disk",
                        buffer_cap_mb=64)
    m = RunManifest.default("tiny", plan=ParallelPlan(stages=2, pipeline=pipe), data=DataSpec(train_subset=256))
    back = RunManifest.from_toml(m.to_toml())
    assert back.plan.pipeline == pipe and back.data.train_subset == 256 and back.run_id == m.run_id
    assert RunManifest.default("tiny").run_id == RunManifest.default("tiny", data=DataSpec()).run_id
    for bad, field in (({"fwd_bits": 5}, "fwd_bits"), ({"fwd_bits": 16}, "fwd_bits"), ({"bwd_bits": 6}, "bwd_bits"),
                       ({"first_visit_bits": 1}, "first_visit_bits"), ({"warmup_epochs": 2}, "warmup_epochs")):
        with pytest.raises(FieldError) as e:
            PipelineSpec(compression="aqsgd", **bad)
        assert e.value.field == field
    assert PipelineSpec(compression="none", fwd_bits=5).fwd_bits == 5  # not AQ-SGD: the widths are unused


@given(
    lr=st.floats(1e-6, 1.0),
    seed=st.integers(0, 2**63 - 1),
    micro=st.integers(1, 8),
    accum=st.integers(1, 8),
    steps=st.integers(1, 10**6),
)
def test_round_trip_property(lr, seed, micro, accum, steps):
    m = RunManifest.default(
        seed=seed,
        optim=OptimSpec(lr=lr, total_steps=steps, warmup_steps=min(steps, 10)),
        batch=BatchSpec(batch_size=micro * accum, micro_batch_size=micro, seq_len=64),
    )
    back = RunManifest.from_toml(m.to_toml())
    assert back == m and back.run_id == m.run_id
    assert RunManifest.from_bytes(m.to_bytes()).run_id == m.run_id


def test_identity_file_is_created_private_and_reloaded(tmp_path):
    path = tmp_path / "sub" / "identity.key"
    k1 = load_or_create_identity(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert path.stat().st_size == 32
    k2 = load_or_create_identity(path)
    assert public_key_bytes(k1) == public_key_bytes(k2)
    assert [p.name for p in path.parent.iterdir()] == ["identity.key"]
    path.write_bytes(b"short")
    with pytest.raises(IdentityError):
        load_or_create_identity(path)
