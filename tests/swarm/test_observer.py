"""The observer `shoal dash` and `shoal peers` follow a swarm with: the death of the peer it joined through (often the
bootstrap, which hosts the broker) does not blind it, and every peer's records keep coming without a pause that
would show them stale and then "back"; it never becomes part of the nodes' DHT."""

from __future__ import annotations

import pytest
import trio

from shoal.protocol.records import StatusRecord
from shoal.swarm.net.membership import MembershipConfig
from shoal.swarm.net.observer import Observer
from tests.helpers.swarm import running_node, wait_for

pytestmark = pytest.mark.slow


async def test_the_observer_keeps_seeing_the_swarm_when_the_peer_it_joined_dies():
    heard: dict[str, float] = {}

    def on_signed(signed, age_s: float) -> None:
        if isinstance(signed.record, StatusRecord) and age_s < 1.0:  # heard now, not a snapshot's old row
            heard[signed.record.peer_id] = trio.current_time()

    async with trio.open_nursery() as outer:
        a_scope = trio.CancelScope()
        a_up = trio.Event()
        a_box = []

        async def run_a() -> None:
            with a_scope:
                async with running_node() as a:
                    a_box.append(a)
                    a_up.set()
                    await trio.sleep_forever()

        outer.start_soon(run_a)
        await a_up.wait()
        a = a_box[0]
        async with running_node(a.sh.addrs) as b, running_node(a.sh.addrs) as c:
            obs = Observer(list(a.sh.addrs), membership=MembershipConfig(suspect_after_s=1.5, gone_after_s=3.0),
                           on_signed=on_signed)
            async with trio.open_nursery() as n:
                await n.start(obs.run)
                await wait_for(lambda: {b.peer_id, c.peer_id} <= set(obs.sh.connected_peers()), 20,
                               "the observer to connect to more than the peer it joined")
                a_scope.cancel()  # the peer it joined through goes
                await wait_for(lambda: a.peer_id not in obs.sh.connected_peers(), 10, "a to be gone")
                t0 = trio.current_time()
                await trio.sleep(4.0)  # longer than a dashboard's stale threshold at these status intervals
                for node in (b, c):
                    assert heard[node.peer_id] > t0 + 2.0, (node.peer_id, heard[node.peer_id] - t0)
                n.cancel_scope.cancel()


async def test_an_observer_never_enters_a_nodes_dht_and_is_forgotten_when_it_goes():
    """An observer is a DHT client: nodes must not keep it as a DHT server (py-libp2p added any peer that sent it a
    Kademlia request), and once it has gone they forget it (py-libp2p's DHT queried, and stored values at, every peer
    its peerstore ever held when its routing table was small: hundreds of failed dials a minute to departed ones)."""
    from libp2p.peer.id import ID

    async with running_node() as a, running_node(a.sh.addrs) as b:
        obs = Observer(list(a.sh.addrs))
        async with trio.open_nursery() as n:
            await n.start(obs.run)
            gone = ID.from_base58(obs.sh.peer_id)
            await trio.sleep(3.0)  # its bootstrap's routing-table refresh has asked the nodes by now
            for node in (a, b):
                assert not node.sh.dht.routing_table.peer_in_table(gone)
            assert a.sh.dht.routing_table.peer_in_table(ID.from_base58(b.peer_id))  # servers still enter
            assert a.sh.host.get_peerstore().has_peer(gone)
            n.cancel_scope.cancel()
        await wait_for(lambda: not any(x.sh.host.get_peerstore().has_peer(gone) for x in (a, b)), 10,
                       "the nodes to forget the observer")
        assert a.sh.host.get_peerstore().has_peer(ID.from_base58(b.peer_id))
