"""Who may join a run, as its broker decides: the run's join policy and, for a private run, a fresh challenge that
the joiner answers with a proof of the join secret (protocol/admission.py), never the secret itself. Wrong proofs
are rate-limited per source address and for the whole run, not only per identity (identities are free): past a
limit no proof is checked, so a guesser gets no answer either way, and an online guess at the secret costs the
window's time."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import trio
from libp2p.peer.id import ID

from shoal.protocol.admission import admission_key, new_nonce, proof_ok
from shoal.protocol.assignment import AdmitRequest
from shoal.swarm.net.addresses import peer_source
from shoal.swarm.run.context import RunContext

MAX_CHALLENGES = 1024  # outstanding admission challenges (one per caller, the oldest forgotten first)
CHALLENGE_TTL_S = 30.0


@dataclass(frozen=True, kw_only=True, slots=True)
class AdmissionLimits:
    """Wrong admission proofs a broker checks: per source address, and for the whole run, within `window_s`."""

    per_source: int = 5
    per_run: int = 30
    window_s: float = 600.0

    def __post_init__(self) -> None:
        if self.per_source < 1 or self.per_run < 1 or self.window_s <= 0:
            raise ValueError("admission limits must be positive")


class TooManyFailures(PermissionError):
    """Admission proofs from this source (or for this run) failed too often lately: none is checked for a while."""


class AdmissionGate:
    """The broker's door: `refusal(peer, request)` says why a node may not join (None: it may); `challenge(peer)`
    hands out the nonce a private run's proof must answer, once, within CHALLENGE_TTL_S."""

    def __init__(self, ctx: RunContext, secret: str | None, limits: AdmissionLimits = AdmissionLimits()):
        self.ctx = ctx
        self.secret = secret  # a private run's join secret: the broker checks admission proofs with it
        self.limits = limits
        self._key: bytes | None = None  # derived from the secret on first use (scrypt, off the loop)
        self._challenges: OrderedDict[str, tuple[bytes, float]] = OrderedDict()  # caller -> (nonce, issued at)
        self._failed: list[tuple[float, str]] = []  # (when, source) of the wrong proofs within the window
        self.limited = 0  # proofs and challenges refused for the limits

    def policy_refusal(self, peer_id: str, req: AdmitRequest) -> str | None:
        """Why `peer_id` may not join by the run's policy (None: it may). Cheap checks only: the proof is separate."""
        if req.run_id != self.ctx.run_id:
            return f"this broker serves run {self.ctx.run_id[:16]}…, not {req.run_id[:16]}…"
        pol = self.ctx.manifest.join
        if pol.mode == "allowlist" and not pol.admits_peer(peer_id):
            return "this run is private: peer is not on the run's allowlist"
        if pol.mode == "secret" and (req.proof is None or req.nonce is None):
            return "this run is private: a join secret is required"
        return None

    async def refusal(self, peer_id: str, req: AdmitRequest) -> str | None:
        """Why `peer_id` may not join (None: it may): the policy, then a private run's proof."""
        why = self.policy_refusal(peer_id, req)
        if why is None and self.ctx.manifest.join.mode == "secret":
            why = await self._proof_refusal(peer_id, req)
        return why

    def source(self, peer_id: str) -> str:
        """Where `peer_id`'s connection to this broker comes from (addresses.source_key)."""
        try:
            return peer_source(self.ctx.sh.host, ID.from_base58(peer_id))
        except Exception:  # noqa: BLE001 - not a peer id we can look up: counted with the unknown
            return "?"

    def over_limit(self, peer_id: str) -> str | None:
        """Why no proof from `peer_id` is checked now (None: it may be): too many wrong ones lately from its source
        address, or for the run."""
        if peer_id == self.ctx.me:
            return None
        lim, now = self.limits, self.ctx.clock()
        self._failed = [(t, src) for t, src in self._failed if now - t < lim.window_s]
        if len(self._failed) >= lim.per_run:
            wait = self._failed[-lim.per_run][0] + lim.window_s - now
            return f"too many wrong admission proofs for this run lately; retry in {wait:.0f} s"
        src = self.source(peer_id)
        mine = [t for t, s in self._failed if s == src]
        if len(mine) >= lim.per_source:
            wait = mine[-lim.per_source] + lim.window_s - now
            return f"too many wrong admission proofs from your address lately; retry in {wait:.0f} s"
        return None

    def challenge(self, caller: str) -> bytes:
        """A fresh nonce for `caller`'s admission proof (one outstanding per caller, used once); TooManyFailures
        while proofs from its source address (or for the run) are not being checked."""
        why = self.over_limit(caller)
        if why is not None:
            self.limited += 1
            raise TooManyFailures(why)
        nonce = new_nonce()
        self._challenges.pop(caller, None)
        self._challenges[caller] = (nonce, self.ctx.clock())
        while len(self._challenges) > MAX_CHALLENGES:
            self._challenges.popitem(last=False)
        return nonce

    async def _proof_refusal(self, peer_id: str, req: AdmitRequest) -> str | None:
        """Why `req`'s proof of the join secret fails (None: it holds): it must answer the nonce this broker gave
        `peer_id` (once, within CHALLENGE_TTL_S), for this run, this broker and `peer_id`."""
        issued = self._challenges.pop(peer_id, None)
        if req.proof is None or req.nonce is None:
            return "this run is private: a join secret is required"
        if issued is None or issued[0] != req.nonce or self.ctx.clock() - issued[1] > CHALLENGE_TTL_S:
            return "this run is private: the admission proof answers no challenge of this broker"
        if self.secret is None:
            return "this broker does not hold the run's join secret"
        why = self.over_limit(peer_id)  # guesses that took their challenges while the limit held: not checked
        if why is not None:
            self.limited += 1
            return why
        if self._key is None:  # scrypt: keep the loop free
            salt = bytes.fromhex(self.ctx.manifest.join.secret_salt)
            self._key = await trio.to_thread.run_sync(admission_key, self.secret, salt)
        ok = proof_ok(self._key, req.proof, run_id=self.ctx.run_id, broker=self.ctx.me, joiner=peer_id,
                      nonce=req.nonce)
        if ok:
            return None
        self._failed.append((self.ctx.clock(), self.source(peer_id)))
        return "this run is private: wrong join secret"
