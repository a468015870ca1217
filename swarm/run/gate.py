"""Who may join a run, as its broker decides: the run's join policy and, for a private run, a fresh challenge that
the joiner answers with a proof of the join secret (protocol/admission.py), never the secret itself."""

from __future__ import annotations

from collections import OrderedDict

import trio

from shoal.protocol.admission import admission_key, new_nonce, proof_ok
from shoal.protocol.assignment import AdmitRequest
from shoal.swarm.run.context import RunContext

MAX_CHALLENGES = 1024  # outstanding admission challenges (one per caller, the oldest forgotten first)
CHALLENGE_TTL_S = 30.0


class AdmissionGate:
    """The broker's door: `refusal(peer, request)` says why a node may not join (None: it may); `challenge(peer)`
    hands out the nonce a private run's proof must answer, once, within CHALLENGE_TTL_S."""

    def __init__(self, ctx: RunContext, secret: str | None):
        self.ctx = ctx
        self.secret = secret  # a private run's join secret: the broker checks admission proofs with it
        self._key: bytes | None = None  # derived from the secret on first use (scrypt, off the loop)
        self._challenges: OrderedDict[str, tuple[bytes, float]] = OrderedDict()  # caller -> (nonce, issued at)

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

    def challenge(self, caller: str) -> bytes:
        """A fresh nonce for `caller`'s admission proof (one outstanding per caller, used once)."""
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
        if self._key is None:  # scrypt: keep the loop free
            salt = bytes.fromhex(self.ctx.manifest.join.secret_salt)
            self._key = await trio.to_thread.run_sync(admission_key, self.secret, salt)
        ok = proof_ok(self._key, req.proof, run_id=self.ctx.run_id, broker=self.ctx.me, joiner=peer_id,
                      nonce=req.nonce)
        return None if ok else "this run is private: wrong join secret"
