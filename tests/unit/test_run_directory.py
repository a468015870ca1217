"""Run adverts and the directory of a swarm's runs: only the owner's word (or a broker it delegated) is listed, old
and forged adverts are not, and `--run NAME|ID-PREFIX` names runs by one rule."""

from __future__ import annotations

import dataclasses

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from shoal.protocol.advert import MAX_ADVERT_MANIFEST_BYTES, RunAdvert
from shoal.protocol.envelope import open_envelope, seal
from shoal.protocol.kinds import RECORD_TYPES
from shoal.protocol.manifest import JoinPolicy, ParallelPlan, RunManifest, SyncSpec
from shoal.swarm.net.dht_records import ShoalRecordValidator
from shoal.swarm.net.gossip import MAX_GOSSIP_BYTES
from shoal.swarm.net.identity import peer_id_of
from shoal.swarm.run.authority import RunAuthority
from shoal.swarm.run.directory import RunDirectory, matching, seal_advert

OWNER, OTHER = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
NOW = 1.7e9


def manifest(name: str = "demo", **kw) -> RunManifest:
    plan = ParallelPlan(replicas=2, max_replicas=8, sync=SyncSpec(method="cocktail"))
    return RunManifest.default(name=name, plan=plan, **kw).signed(OWNER)


def advert(m: RunManifest, key=OWNER, *, t: float = NOW, delegation: bytes | None = None, **over) -> bytes:
    env = seal_advert(key, m, broker=peer_id_of(key), wall=t, delegation=delegation, lanes=2, free_lanes=6,
                      backups=1, providers=3, step=40)
    if over:
        ad = dataclasses.replace(open_envelope(env, RECORD_TYPES).record, **over)
        env = seal(ad, key)
    return env


def directory(**kw) -> tuple[RunDirectory, list]:
    bad = []
    return RunDirectory(lambda: NOW + 1, on_bad=lambda peer, why: bad.append((peer, why)), **kw), bad


def test_an_owners_advert_is_listed_with_its_verified_manifest_and_fits_gossip():
    m = manifest()
    env = advert(m)
    assert len(env) < MAX_GOSSIP_BYTES and len(env) < 2 * len(m.to_bytes()) + 512
    ShoalRecordValidator().validate(f"/shoal/run/{peer_id_of(OWNER)}", env)  # a kind the DHT and gossip accept
    d, bad = directory()
    assert d.offer(env, "relay") and not bad
    [r] = d.runs()
    assert r.manifest == m and r.run_id == m.run_id and r.advert.lanes == 2 and not r.private
    assert "'demo'" in r.describe() and m.run_id[:12] in r.describe()


def test_a_run_not_signed_or_too_large_is_not_advertised():
    unsigned = RunManifest.default()
    assert seal_advert(OWNER, unsigned, broker=peer_id_of(OWNER), wall=NOW, delegation=None, lanes=1,
                       free_lanes=0, backups=0, providers=1, step=0) is None
    many = tuple(peer_id_of(Ed25519PrivateKey.generate()) for _ in range(400))
    big = manifest(join=JoinPolicy(mode="allowlist", allowlist=many))
    assert len(big.to_bytes()) > MAX_ADVERT_MANIFEST_BYTES
    assert advert_or_none(big) is None


def advert_or_none(m):
    return seal_advert(OWNER, m, broker=peer_id_of(OWNER), wall=NOW, delegation=None, lanes=1, free_lanes=0,
                       backups=0, providers=1, step=0)


def test_an_advert_by_someone_the_owner_never_delegated_is_refused_and_the_relayer_blamed():
    m = manifest()
    d, bad = directory()
    assert not d.offer(advert(m, OTHER), "relay")  # OTHER signs an advert of the owner's run
    assert not d.runs() and bad and bad[0][0] == "relay"
    env = RunAuthority(m).issue(OWNER, (peer_id_of(OTHER),), NOW - 5)
    assert d.offer(advert(m, OTHER, delegation=env), "relay")  # now the owner delegated it
    assert d.runs()[0].advert.peer_id == peer_id_of(OTHER)


@pytest.mark.parametrize("what", ["other run's manifest", "tampered manifest", "garbage"])
def test_an_advert_whose_manifest_does_not_check_out_is_refused(what):
    m, other = manifest(), manifest("other")
    if what == "other run's manifest":
        env = advert(m, manifest=other.to_bytes())
    elif what == "tampered manifest":
        raw = bytearray(m.to_bytes())
        raw[raw.index(b"demo")] = ord("x")  # the name changed after signing
        env = advert(m, manifest=bytes(raw))
    else:
        env = b"\x93\x01\x02"
    d, bad = directory()
    assert not d.offer(env, "relay") and not d.runs() and bad


def test_old_replayed_and_future_adverts_are_not_listed_and_a_run_goes_when_its_adverts_stop():
    m = manifest()
    d, _ = directory(ttl_s=45.0)
    assert not d.offer(advert(m, t=NOW - 50), "relay")  # issued 51 s before our clock: stale
    assert not d.offer(advert(m, t=NOW + 3600), "relay")  # from the future
    assert d.offer(advert(m, t=NOW - 10), "relay")
    assert not d.offer(advert(m, t=NOW - 20), "relay")  # older than the one kept
    d.wall = lambda: NOW + 34.9  # 44.9 s after it was issued
    assert d.runs()
    d.wall = lambda: NOW + 35.1
    assert not d.runs() and d.get(m.run_id) is None


def test_run_names_and_id_prefixes_name_runs_by_one_rule():
    a, b, c = manifest("alpha"), manifest("beta"), manifest("beta", seed=7)
    d, _ = directory()
    for m in (a, b, c):
        assert d.offer(advert(m), "relay")
    runs = d.runs()
    assert [r.run_id for r in matching(runs, "alpha")] == [a.run_id]
    assert len(matching(runs, "beta")) == 2  # a name two runs share names both
    assert [r.run_id for r in matching(runs, a.run_id[:6].upper())] == [a.run_id]
    assert matching(runs, a.run_id[:3]) == []  # too short a prefix names nothing
    assert [r.run_id for r in matching(runs, c.run_id)] == [c.run_id]
    assert matching(runs, "gamma") == []


def test_admits_says_which_runs_a_node_may_ask_to_join():
    from shoal.swarm.run.directory import ListedRun

    open_run = manifest()
    secret = manifest(join=JoinPolicy.private())
    me = peer_id_of(OTHER)
    listed = [ListedRun(RunAdvert.from_wire(open_envelope(advert(m), RECORD_TYPES).record.to_wire()), m, b"")
              for m in (open_run, secret, manifest(join=JoinPolicy(mode="allowlist", allowlist=(me,))))]
    assert [r.admits(me, has_secret=False) for r in listed] == [True, False, True]
    assert [r.admits("12D3KooWsomeoneelse", has_secret=True) for r in listed] == [True, True, False]
    assert listed[1].private and "private" in listed[1].describe()


def test_a_peer_lists_its_own_brokers_advert_and_ignores_its_other_records_quietly():
    from shoal.protocol.records import StatusRecord

    d, bad = directory()
    status = seal(StatusRecord(peer_id=peer_id_of(OWNER), seq=1, time=NOW), OWNER)
    assert not d.own(status) and not bad
    assert d.own(advert(manifest())) and len(d.runs()) == 1
