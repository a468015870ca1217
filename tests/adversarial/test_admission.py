"""Admission to a private run under attack (real nodes on 127.0.0.1): the join secret never travels, a captured
proof cannot be replayed by another peer, to another broker or twice, and the public manifest holds nothing to
guess the secret against offline."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from shoal.protocol.admission import DEFAULT_SECRET_BYTES, admission_key, admission_proof, new_secret
from shoal.protocol.assignment import AdmitRequest, AdmitResponse
from shoal.protocol.manifest import JoinPolicy
from shoal.protocol.wire import pack
from shoal.swarm.net.rpc import RpcError
from shoal.swarm.run.broker import AdmissionError
from shoal.swarm.run.client import RunClient
from tests.adversarial.attacker import BCFG, CCFG, Attacker, signed_manifest, start
from tests.helpers.swarm import HW

pytestmark = pytest.mark.slow


def wiretap(mem, method: str) -> list[Any]:
    """What callers send to `method` on an honest broker (its handler still answers)."""
    seen: list[Any] = []

    async def tapped(caller: str, body: Any) -> Any:
        seen.append(body)
        return await mem.broker.handle(method, caller, body)
    mem.node.rpc.register(method, tapped)
    return seen


async def test_the_secret_never_travels_and_a_captured_proof_cannot_be_replayed():
    secret = new_secret()
    assert len(secret) >= DEFAULT_SECRET_BYTES  # 256 bits of entropy, URL-safe text
    owner = Ed25519PrivateKey.generate()
    m = signed_manifest(owner, join=JoinPolicy.private())
    # the manifest anyone may fetch holds no verifier: neither the secret nor anything derived from it
    raw = m.to_bytes()
    salt = bytes.fromhex(m.join.secret_salt)
    for derived in (secret.encode(), admission_key(secret, salt), hashlib.sha256(secret.encode()).digest(),
                    hashlib.scrypt(secret.encode(), salt=salt, n=2**14, r=8, p=1, dklen=32)):
        assert derived not in raw and derived.hex().encode() not in raw
    assert m.join.secret_hash == ""
    async with trio.open_nursery() as n:
        o = await start(n, m, key=owner, broker=True, secret=secret)
        admits = wiretap(o, "run.admit")
        j = await start(n, m, o.addrs, broker_id=o.peer_id, secret=secret)
        assert j.client.admitted and admits
        body = admits[-1]
        assert secret.encode() not in pack(body)  # what reached the broker: a nonce and a proof, no secret
        assert set(body) >= {"nonce", "proof"} and "secret" not in body
        x = Attacker(await start(n, m, o.addrs, admit=False))
        refused = 0
        # the captured request, replayed by another peer: it answers no challenge given to that peer
        ans = AdmitResponse.from_wire(await x.call(o.peer_id, "run.admit", body))
        refused += not ans.admitted
        assert "answers no challenge" in ans.error
        # with a challenge of its own, the captured proof (bound to the joiner's id and its nonce) is wrong
        nonce = (await x.call(o.peer_id, "run.challenge", {"run_id": m.run_id}))["nonce"]
        ans = AdmitResponse.from_wire(await x.call(o.peer_id, "run.admit", {**body, "nonce": nonce}))
        refused += not ans.admitted
        assert "wrong join secret" in ans.error
        # the joiner's own nonce, replayed by the joiner's connection (a second use): refused too
        ans = AdmitResponse.from_wire(await j.client._ask("run.admit", body))
        refused += not ans.admitted
        # a proof made for another broker (a fake broker relaying it) is bound to that broker's id
        x2 = Attacker(await start(n, m, o.addrs, admit=False))
        nonce = (await x2.call(o.peer_id, "run.challenge", {"run_id": m.run_id}))["nonce"]
        relayed = admission_proof(admission_key(secret, salt), run_id=m.run_id, broker=x.peer_id,
                                  joiner=x2.peer_id, nonce=nonce)
        ans = AdmitResponse.from_wire(await x2.call(o.peer_id, "run.admit", AdmitRequest(
            run_id=m.run_id, hardware=HW, nonce=nonce, proof=relayed).to_wire()))
        refused += not ans.admitted
        assert refused == 4 and x.peer_id not in o.broker.providers and x2.peer_id not in o.broker.providers
        assert len(o.node.penalties.reasons(x.peer_id)) >= 2 and o.node.penalties.reasons(x2.peer_id)
        # a wrong secret is refused; a fake broker is never sent a proof at all (only the owner's brokers are)
        with pytest.raises(AdmissionError, match="wrong join secret"):
            await RunClient(x2.mem.ctx, HW, broker_id=o.peer_id, secret="guess", config=CCFG,
                            broker_config=BCFG).admit()
        fake = Attacker(await start(n, m, o.addrs, admit=False))
        fake.listen("run.challenge", answer={"nonce": b"\0" * 32})
        fake.listen("run.admit", answer={"admitted": True})
        with pytest.raises(RpcError, match="no broker the run's owner authorised"):
            await RunClient(j.ctx, HW, broker_id=fake.peer_id, secret=secret, config=CCFG, broker_config=BCFG).admit()
        assert fake.heard == []
        n.cancel_scope.cancel()
