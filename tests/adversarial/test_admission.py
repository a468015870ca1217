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


async def guess(sh, broker: str, m, secret: str) -> str:
    """One online guess at the join secret from host `sh`: the broker's answer, shortened."""
    from shoal.swarm.net.rpc import call

    try:
        nonce = (await call(sh, broker, "run.challenge", {"run_id": m.run_id}, timeout_s=5))["nonce"]
    except RpcError as e:
        return f"no challenge: {e}"
    key = admission_key(secret, bytes.fromhex(m.join.secret_salt))
    proof = admission_proof(key, run_id=m.run_id, broker=broker, joiner=sh.peer_id, nonce=nonce)
    ans = AdmitResponse.from_wire(await call(sh, broker, "run.admit", AdmitRequest(
        run_id=m.run_id, hardware=HW, nonce=nonce, proof=proof).to_wire(), timeout_s=5))
    return "admitted" if ans.admitted else ans.error


async def test_online_guesses_are_limited_per_source_address_and_per_run_not_only_per_identity():
    """An attacker with fresh identities for every few guesses: wrong proofs are checked only up to a budget per
    source address and one for the run; past it no proof is checked (no answer either way)."""
    from dataclasses import replace

    from shoal.swarm.run.broker import Broker
    from shoal.swarm.run.gate import AdmissionLimits
    from tests.helpers.swarm import bare_host

    secret = new_secret()
    owner = Ed25519PrivateKey.generate()
    m = signed_manifest(owner, join=JoinPolicy.private())
    lim = AdmissionLimits(per_source=5, per_run=8, window_s=600)
    async with trio.open_nursery() as n:
        o = await start(n, m, key=owner, broker=True, secret=secret, admit=False)
        o.broker.gate.limits = lim
        answers: list[str] = []
        t0 = trio.current_time()
        for i in range(7):  # 7 identities from 127.0.0.1, 3 guesses each
            async with bare_host(o.addrs) as sh:
                for g in range(3):
                    answers.append(await guess(sh, o.peer_id, m, f"guess-{i}-{g}"))
        for i in range(2):  # then more identities from another address: within the run's budget, then not
            async with bare_host() as sh:
                info = __import__("libp2p.peer.peerinfo", fromlist=["x"]).info_from_p2p_addr(
                    __import__("multiaddr").Multiaddr(o.addrs[0]))
                await sh.host.get_network().dial_addr(info.addrs[0], info.peer_id, source=("127.0.0.2", 0))
                for g in range(3):
                    answers.append(await guess(sh, o.peer_id, m, f"other-{i}-{g}"))
        took = trio.current_time() - t0
        checked = [a for a in answers if "wrong join secret" in a]
        limited = [a for a in answers if "too many wrong admission proofs" in a]
        print(f"{len(answers)} online guesses from 9 identities in {took:.1f} s: {len(checked)} checked (all wrong), "
              f"{len(limited)} refused unchecked; first refusal: {limited[0] if limited else None!r}")
        assert not any(a == "admitted" for a in answers)
        assert [("wrong join secret" in a) for a in answers[:21]] == [True] * lim.per_source + [False] * (21 - lim.per_source)
        assert "from your address" in answers[lim.per_source]
        assert len(checked) == lim.per_run and "for this run" in answers[-1]
        # the broker's own admission and an honest joiner's proof are the same code: the right secret still works
        # once the window has passed
        o.broker.gate.limits = replace(lim, window_s=1e-3)
        j = await start(n, m, o.addrs, broker_id=o.peer_id, secret=secret)
        assert j.client.admitted
        n.cancel_scope.cancel()


def test_run_create_refuses_a_weak_chosen_secret_unless_told(tmp_path, capsys):
    from shoal.node.cli import build_parser
    from shoal.node.cli import run as cmd_run

    def create(secret: str, *more: str) -> int:
        (tmp_path / "secret.txt").write_text(secret + "\n")
        args = build_parser().parse_args(["run", "create", "--join-secret-file", str(tmp_path / "secret.txt"),
                                          "--identity", str(tmp_path / "id.key"), "-o", str(tmp_path / "r.toml"),
                                          *more])
        return cmd_run.main(args)

    for weak in ("hunter2", "mysecretpassword", "a" * 40):
        assert create(weak) == 2
        err = capsys.readouterr().err
        assert "is weak" in err and "--allow-weak-secret" in err
    assert not (tmp_path / "r.toml").exists()
    assert create("mysecretpassword", "--allow-weak-secret") == 0
    assert "WARNING: the join secret" in capsys.readouterr().err
    assert create(new_secret()) == 0  # what `run create` makes itself when the file is missing
