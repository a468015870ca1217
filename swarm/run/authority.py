"""Who may act as a run's broker: its owner, and the peers named by the owner's newest signed delegation."""

from __future__ import annotations

import logging

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from shoal.protocol.assignment import MAX_DELEGATES, RUN_RECORD_TYPES, AssignmentTable, BrokerDelegation
from shoal.protocol.envelope import open_envelope, seal
from shoal.protocol.errors import ProtocolError
from shoal.protocol.manifest import RunManifest

log = logging.getLogger(__name__)

DELEGATES = 3  # an owner that brokers names its standby and the next candidates, so a successor can name one too


class RunAuthority:
    """The run owner's word on brokers, as this node knows it. A signed run (the manifest names an owner) trusts a
    table only when its signer and the standby it names are the owner or named by the owner's delegation that the
    table carries, and that delegation is not older than the newest one this node has seen (a newer delegation
    revokes the peers it drops). An unsigned run exists only where its manifest was handed over locally (a node
    takes a manifest from the network only with a valid signature), and trusts the broker it was told of."""

    def __init__(self, manifest: RunManifest):
        self.owner = manifest.owner if manifest.signature else ""
        self.run_id = manifest.run_id
        self.newest = 0.0  # issue time of the newest owner delegation seen
        self._cache: tuple[bytes, BrokerDelegation | None] = (b"", None)

    @property
    def signed(self) -> bool:
        return bool(self.owner)

    def delegation(self, env: bytes | None) -> BrokerDelegation | None:
        """The owner's delegation in `env` (None: absent, malformed, another signer or another run)."""
        if not env:
            return None
        if self._cache[0] == env:
            return self._cache[1]
        d = None
        try:
            rec = open_envelope(env, RUN_RECORD_TYPES).record
            if isinstance(rec, BrokerDelegation) and rec.peer_id == self.owner and rec.run_id == self.run_id:
                d = rec
        except ProtocolError as e:
            log.info("bad broker delegation: %s", e)
        self._cache = (env, d)
        return d

    def may_broker(self, peer_id: str, delegation_env: bytes | None) -> bool:
        """Whether `peer_id` may sign the run's tables (and be named standby) under `delegation_env`."""
        if not self.signed or peer_id == self.owner:
            return True
        d = self.delegation(delegation_env)
        return d is not None and d.time >= self.newest and peer_id in d.brokers

    def refuses(self, t: AssignmentTable) -> str | None:
        """Why a table `t` is not the word of a broker the owner authorised (None: it is)."""
        if t.run_id != self.run_id:
            return "a table of another run"
        if not self.may_broker(t.peer_id, t.delegation):
            return f"signed by {t.peer_id[:16]}…, whom the run's owner never authorised as broker"
        if t.standby is not None and not self.may_broker(t.standby, t.delegation):
            return f"names {t.standby[:16]}… standby, whom the run's owner never authorised"
        return None

    def note(self, t: AssignmentTable) -> None:
        """An accepted table: remember its delegation's issue time (older delegations are superseded)."""
        self.note_delegation(t.delegation)

    def note_delegation(self, env: bytes | None) -> None:
        """An accepted record's delegation (a table's, a run advert's): its issue time supersedes older ones."""
        d = self.delegation(env)
        if d is not None:
            self.newest = max(self.newest, d.time)

    def issue(self, key: Ed25519PrivateKey, brokers: tuple[str, ...], time_s: float) -> bytes:
        """The owner's sealed delegation of `brokers` (the owner's own node calls this)."""
        d = BrokerDelegation(peer_id=self.owner, run_id=self.run_id, brokers=tuple(brokers[:MAX_DELEGATES]),
                             time=max(time_s, self.newest))
        self.newest = d.time
        return seal(d, key)
