"""Broker authority under attack (real nodes on 127.0.0.1): a stranger's tables, a standby deposing a live broker,
a takeover that skips a lease epoch, and replayed leases of a dead broker."""

from __future__ import annotations

import pytest
import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from shoal.swarm.net.dht_records import lease_key
from shoal.swarm.net.rpc import RpcError
from shoal.swarm.run.authority import RunAuthority
from shoal.swarm.run.client import RunClient
from shoal.swarm.run.tablerpc import fetch_table
from tests.adversarial.attacker import BCFG, CCFG, Attacker, signed_manifest, start, table_of
from tests.helpers.swarm import HW, wait_for

pytestmark = pytest.mark.slow


async def test_a_table_signed_by_a_stranger_is_refused_and_its_server_penalized():
    owner = Ed25519PrivateKey.generate()
    m = signed_manifest(owner)
    async with trio.open_nursery() as n:
        o = await start(n, m, key=owner, broker=True)
        a = await start(n, m, o.addrs, broker_id=o.peer_id)
        x = Attacker(await start(n, m, o.addrs, admit=False))  # a stranger: never admitted, never delegated
        forged = x.forged_table(m, standby=a.peer_id)
        x.serve_table(forged)
        x.listen("run.admit", "run.challenge", answer={"admitted": True})
        # a volunteer that --join'ed the attacker asks it for the run's table: refused, and the attacker penalized
        v = await start(n, m, [x.mem.addrs[0]], admit=False)
        with pytest.raises(RpcError, match="never authorised"):
            await fetch_table(v.node.sh, x.peer_id, m.run_id, authority=RunAuthority(m), penalties=v.node.penalties)
        assert any("never authorised" in r for r in v.node.penalties.reasons(x.peer_id))
        # told that the attacker is the broker, a run client does not even ask it for admission
        with pytest.raises(RpcError, match="no broker the run's owner authorised"):
            await RunClient(v.ctx, HW, broker_id=x.peer_id, config=CCFG, broker_config=BCFG).admit()
        assert not [h for h in x.heard if h[0] != "run.table"]
        # a member following the owner's broker ignores the forged table, however new it claims to be
        for _ in range(10):
            await x.gossip(forged)
            await trio.sleep(0.1)
        assert a.client.table.peer_id == o.peer_id and a.client.table.lease_epoch == 0
        assert not a.client.accept_envelope(forged, x.peer_id)
        n.cancel_scope.cancel()


async def test_a_standby_cannot_depose_a_live_broker_and_takes_over_only_at_the_next_epoch_after_the_lease():
    owner = Ed25519PrivateKey.generate()
    m = signed_manifest(owner)
    async with trio.open_nursery() as n:
        o = await start(n, m, key=owner, broker=True)
        s = await start(n, m, o.addrs, broker_id=o.peer_id)
        c = await start(n, m, o.addrs, broker_id=o.peer_id)
        await c.node.sh.connect(s.addrs[0])
        for mem in (s, c):
            await wait_for(lambda mem=mem: mem.client.table.standby == s.peer_id, 5, "the standby is known")
        delegation = RunAuthority(m).delegation(c.client.table.delegation)
        assert delegation is not None and s.peer_id in delegation.brokers  # the owner's word makes s standby
        # the standby turns: it signs its takeover now, while the owner's broker renews its lease
        x = Attacker(s)
        early = x.takeover_table(s.client.table)
        assert table_of(early).lease_epoch == 1
        refused = 0
        for _ in range(int(2 * BCFG.lease_timeout_s / 0.1)):  # twice the lease: the broker renews throughout
            await x.gossip(early)
            refused += not c.client.accept_envelope(early, s.peer_id)
            await trio.sleep(0.1)
        assert c.client.table.peer_id == o.peer_id and c.client.table.lease_epoch == 0
        assert refused == int(2 * BCFG.lease_timeout_s / 0.1)
        print(f"takeover attempts while the broker lived: {refused}, accepted: 0")
        # the broker dies; a stranger replays its captured leases (by gossip and into the DHT) to make it look
        # alive, and the standby offers a takeover that skips an epoch: the standby takes over at epoch 1, on time
        y = Attacker(await start(n, m, o.addrs, admit=False))
        await wait_for(lambda: len(y.captured_leases(o.peer_id)) >= 2, 5, "the stranger captures lease renewals")
        leases = y.captured_leases(o.peer_id)
        skip = x.takeover_table(c.client.table, epochs_ahead=2)
        o.kill()
        t0 = trio.current_time()
        async with trio.open_nursery() as replays:
            async def replay() -> None:
                while True:
                    for env in leases[-3:]:
                        await y.gossip(env)
                        try:  # y's own DHT store already refuses an older lease; peers' stores do too
                            with trio.move_on_after(0.5):
                                await y.mem.node.sh.dht.put_value(lease_key(o.peer_id), env)
                        except Exception:  # noqa: BLE001
                            pass
                    await trio.sleep(0.1)
            replays.start_soon(replay)
            assert not c.client.accept_envelope(skip, s.peer_id)  # lease epoch 2 after 0: never
            took = await wait_for(lambda: s.client.is_broker(), BCFG.lease_timeout_s + 8, "the standby's takeover")
            await wait_for(lambda: c.client.table.peer_id == s.peer_id, 10, "c follows the standby")
            followed = trio.current_time() - t0
            replays.cancel_scope.cancel()
        assert c.client.table.lease_epoch == 1
        assert c.node.penalties.reasons(y.peer_id) or s.node.penalties.reasons(y.peer_id)  # replays are penalized
        print(f"standby took over {took:.2f} s after the kill (lease {BCFG.lease_timeout_s} s, old leases replayed "
              f"every 0.1 s); c followed {followed:.2f} s after the kill")
        assert took < BCFG.lease_timeout_s + 5
        n.cancel_scope.cancel()
