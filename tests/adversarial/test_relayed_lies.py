"""Lies of a peer that relays what others said (real nodes on 127.0.0.1 in the test's trio loop): a `members` reply
that serves long-dead peers' records as fresh, and a `--join` peer that denies knowing the run a joiner came for."""

from __future__ import annotations

import pytest
import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from tests.helpers.swarm import running_node, wait_for

pytestmark = pytest.mark.slow


async def test_a_relaying_peer_cannot_serve_a_dead_peers_records_as_fresh():
    async with running_node() as victim, running_node([victim.sh.addrs[0]]) as liar:
        async with running_node() as dead:
            captured = [dead._announcement, dead._last_status]  # what any peer that heard it keeps
            dead_id = dead.peer_id
        await trio.sleep(9.0)  # the dead peer is silent for longer than a gone peer's 3 s (and the 5 s clock slack)
        liar.rpc.register("members", lambda caller, body: _rows([[*captured, 0.0]]))
        assert await victim.sync_from(liar.peer_id) == 2
        victim.membership.sweep()
        live = {e.peer_id for e in victim.membership.live_peers()}
        entry = victim.membership.peers.get(dead_id)
        print(f"a 9 s dead peer relayed with age 0: {'live' if dead_id in live else 'not live'} in the victim's view "
              f"(age taken: {victim.membership.age_s(entry):.1f} s)" if entry else "not taken")
        assert dead_id not in live
        # a row pairing the dead peer's announcement with a live peer's fresh status is refused and penalized
        liar.rpc.register("members", lambda caller, body: _rows([[captured[0], liar._last_status, 0.0]]))
        assert await victim.sync_from(liar.peer_id) == 0
        assert "mixes the records of two peers" in victim.penalties.reasons(liar.peer_id)[-1]


async def _rows(rows):
    return rows


async def test_a_join_peer_that_denies_the_run_does_not_make_a_joiner_give_up():
    """The joiner's only --join peer is a member of the swarm that answers "no table" for the run (and relays
    gossip like any node): the joiner asks the live peers whose status says they train the run, and is admitted."""
    from dataclasses import replace

    from tests.swarm.test_run_runtime import manifest, node_config

    owner = Ed25519PrivateKey.generate()
    m = manifest("allreduce", replicas=2).signed(owner)
    cfg = node_config(m, 400)
    async with running_node((), cfg, key=owner) as first:
        async with running_node([first.sh.addrs[0]]) as liar:
            for method in ("run.table", "run.manifest"):  # the liar's RPC: it knows no such run
                async def deny(caller, body):
                    raise ValueError("this node knows no such run")
                liar.rpc.register(method, deny)
            await wait_for(lambda: len(liar.membership.live_peers()) >= 1, 10, "the liar to see the owner")
            joiner_cfg = replace(cfg, run=replace(cfg.run, manifest=None, run_id=m.run_id))
            t0 = trio.current_time()
            async with running_node([liar.sh.addrs[0]], joiner_cfg) as joiner:
                await wait_for(lambda: joiner.runtime is not None and joiner.runtime.client is not None
                               and joiner.runtime.client.admitted, 60, "the joiner's admission")
                took = trio.current_time() - t0
                print(f"joined through a peer denying the run: admitted after {took:.1f} s")
                assert joiner.runtime.client.slot_name() == "s0r1"
