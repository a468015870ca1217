"""The runs a swarm advertises, as one peer knows them: verified adverts, newest per run, forgotten when they stop.

Every node keeps a directory (fed by gossip, served to others by the `runs` RPC), and so does an observer that lists
a swarm's runs. An advert is kept only when the manifest it carries is signed by its owner and hashes to the run id,
and its signer is the owner or a broker the owner delegated (by a delegation not older than the newest one seen for
that run). `matching` is the one rule for which runs a `--run NAME|ID-PREFIX` names.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from shoal.protocol.advert import ADVERT_RECORD_TYPES, MAX_ADVERT_MANIFEST_BYTES, RunAdvert
from shoal.protocol.envelope import Signed, open_envelope, seal
from shoal.protocol.errors import ProtocolError, SignatureError
from shoal.protocol.manifest import RunManifest
from shoal.swarm.run.authority import RunAuthority

log = logging.getLogger(__name__)

MAX_RUNS = 64  # runs one peer keeps (the oldest seen is forgotten first)
ADVERT_TTL_S = 45.0  # a run whose broker stopped advertising it for this long is no longer listed
MAX_AHEAD_S = 60.0  # an advert issued further ahead of this peer's wall clock is refused
MIN_PREFIX = 4  # an id prefix shorter than this names no run (a name still may)


class AdvertRejected(ProtocolError):
    """An advert that is well formed but not the word of the run's owner or a broker it authorised."""


@dataclass(frozen=True, slots=True)
class ListedRun:
    """One advertised run: the broker's advert, the manifest it carries (verified), and the envelope as signed."""

    advert: RunAdvert
    manifest: RunManifest
    env: bytes

    @property
    def run_id(self) -> str:
        return self.advert.run_id

    @property
    def name(self) -> str:
        return self.manifest.name

    @property
    def private(self) -> bool:
        return self.manifest.join.mode != "open"

    def admits(self, peer_id: str, has_secret: bool) -> bool:
        """Whether a node may ask to join: an open run, a secret run with a secret at hand, or its allowlist."""
        join = self.manifest.join
        return (join.mode == "secret" and has_secret) or join.admits_peer(peer_id)  # admits_peer: open or listed

    def describe(self) -> str:
        """One line for lists and refusals: id prefix, name, model, shape, synchronizer, free lanes, private."""
        m, a = self.manifest, self.advert
        shape = f"{a.lanes} lane{'s' if a.lanes != 1 else ''}" + (f" x {m.plan.stages} stages" if m.plan.stages > 1
                                                                   else "")
        return (f"{self.run_id[:12]} '{m.name}': {m.model.size} GPT, {shape}, {m.plan.sync.method}, "
                f"{a.free_lanes} free, step {a.step}/{m.optim.total_steps}" + (", private" if self.private else ""))


def verify_advert(ad: RunAdvert, authority: RunAuthority | None = None) -> RunManifest:
    """The manifest `ad` carries, once checked: signed by its owner, hashing to the advertised run id, and `ad` signed
    by the owner or a broker the owner delegated (`authority`: what this peer knows of the run's delegations)."""
    try:
        m = RunManifest.from_bytes(ad.manifest)
        m.verify()
    except (ProtocolError, ValueError) as e:
        raise AdvertRejected(f"advert of run {ad.run_id[:16]}… carries no valid signed manifest: {e}") from None
    if m.run_id != ad.run_id:
        raise AdvertRejected(f"advert of run {ad.run_id[:16]}… carries the manifest of run {m.run_id[:16]}…")
    auth = authority if authority is not None else RunAuthority(m)
    if not auth.may_broker(ad.peer_id, ad.delegation):
        raise AdvertRejected(f"advert of run {ad.run_id[:16]}… signed by {ad.peer_id[:16]}…, whom the run's owner "
                             f"never authorised as broker")
    return m


def seal_advert(key: Ed25519PrivateKey, manifest: RunManifest, *, broker: str, wall: float,
                delegation: bytes | None, lanes: int, free_lanes: int, backups: int, providers: int,
                step: int) -> bytes | None:
    """The broker's sealed advert of its run (None: the run cannot be advertised, being unsigned or its manifest too
    large to carry)."""
    raw = manifest.to_bytes()
    if not manifest.signature or len(raw) > MAX_ADVERT_MANIFEST_BYTES:
        return None
    ad = RunAdvert(peer_id=broker, run_id=manifest.run_id, time=wall, manifest=raw,
                   delegation=delegation if broker != manifest.owner else None, lanes=lanes, free_lanes=free_lanes,
                   backups=backups, providers=providers, step=step)
    return seal(ad, key)


class RunDirectory:
    """The runs this peer has seen advertised (owned by the event loop). `observe` takes verified gossip records,
    `offer` sealed adverts from a peer's `runs` answer; `runs()` lists the live ones, newest first. An advert is live
    for `ttl_s` after the time it was issued (on the wall clock: a replayed old advert lists nothing)."""

    def __init__(self, wall: Callable[[], float] = time.time, *, ttl_s: float = ADVERT_TTL_S,
                 max_runs: int = MAX_RUNS, on_bad: Callable[[str, str], Any] | None = None):
        self.wall = wall
        self.ttl_s = ttl_s
        self.max_runs = max_runs
        self.on_bad = on_bad  # (peer, why): a peer that relayed or signed an advert that fails the checks
        self._runs: dict[str, ListedRun] = {}
        self._authority: dict[str, RunAuthority] = {}

    def observe(self, signed: Signed, source: str | None = None) -> bool:
        """Keep a verified advert record if it is the newest of its run; True when kept."""
        ad = signed.record
        if not isinstance(ad, RunAdvert):
            return False
        cur = self._runs.get(ad.run_id)
        now = self.wall()
        if (cur is not None and ad.time <= cur.advert.time) or not now - self.ttl_s < ad.time <= now + MAX_AHEAD_S:
            return False
        auth = self._authority.get(ad.run_id)  # kept beside its run's entry in _runs, dropped with it
        try:
            manifest = verify_advert(ad, auth)
        except AdvertRejected as e:
            log.info("run advert rejected: %s", e)
            if self.on_bad is not None:
                self.on_bad(source or ad.peer_id, str(e))
            return False
        if auth is None:
            auth = self._authority[ad.run_id] = RunAuthority(manifest)
        auth.note_delegation(ad.delegation)
        self._runs[ad.run_id] = ListedRun(ad, manifest, signed.raw)
        self._trim()
        return True

    def offer(self, env: Any, source: str) -> bool:
        """A sealed advert from `source`'s `runs` answer: opened, verified and kept like a gossiped one."""
        if not isinstance(env, bytes):
            if self.on_bad is not None:
                self.on_bad(source, "runs: an entry that is not an envelope")
            return False
        try:
            signed = open_envelope(env, ADVERT_RECORD_TYPES)
        except (ProtocolError, SignatureError) as e:
            if self.on_bad is not None:
                self.on_bad(source, f"runs: bad advert: {e}")
            return False
        return self.observe(signed, source)

    def own(self, env: bytes) -> bool:
        """A record this peer publishes itself (gossip does not hand it back): kept when it is an advert."""
        try:
            signed = open_envelope(env, ADVERT_RECORD_TYPES)
        except ProtocolError:
            return False  # another kind of record
        return self.observe(signed)

    def _trim(self) -> None:
        now = self.wall()
        for rid, r in list(self._runs.items()):
            if now - r.advert.time > self.ttl_s:
                del self._runs[rid]
                self._authority.pop(rid, None)
        while len(self._runs) > self.max_runs:
            oldest = min(self._runs.values(), key=lambda r: r.advert.time)
            del self._runs[oldest.run_id]
            self._authority.pop(oldest.run_id, None)

    def runs(self) -> list[ListedRun]:
        """The runs advertised within the last `ttl_s`, the oldest run first (by its manifest's creation time)."""
        self._trim()
        return sorted(self._runs.values(), key=lambda r: (r.manifest.created_at, r.run_id))

    def get(self, run_id: str) -> ListedRun | None:
        self._trim()
        return self._runs.get(run_id)

    async def rpc_runs(self, caller: str, body: Any) -> Any:
        """The `runs` RPC: the sealed adverts of every live run this peer knows."""
        return [r.env for r in self.runs()]


def matching(runs: list[ListedRun], query: str) -> list[ListedRun]:
    """The runs `query` names: its exact name, or its id when the query is a prefix of at least MIN_PREFIX hex
    digits (an exact name wins over prefixes)."""
    q = query.strip()
    named = [r for r in runs if r.name == q]
    if named:
        return named
    hexq = q.lower()
    if len(hexq) >= MIN_PREFIX and all(c in "0123456789abcdef" for c in hexq):
        return [r for r in runs if r.run_id.startswith(hexq)]
    return []
