"""The group collective over real libp2p hosts: exchange, early messages buffered, garbage penalized, missing peers absent."""

from __future__ import annotations

from contextlib import AsyncExitStack

import trio

from shoal.swarm.run.collective import COLLECTIVE_PROTOCOL, Collective
from shoal.swarm.net.framing import write_frame
from shoal.swarm.net.penalty import Penalties, PenaltyConfig
from shoal.protocol.wire import pack
from tests.helpers.swarm import bare_host, wait_for


async def three_hosts(stack: AsyncExitStack, **kw):
    first = await stack.enter_async_context(bare_host())
    hosts = [first]
    for _ in range(2):
        hosts.append(await stack.enter_async_context(bare_host(join=[first.addrs[0]])))
    for h in hosts[1:]:  # a full mesh: every pair connected once up front
        for o in hosts:
            if o is not h and o.peer_id not in h.connected_peers():
                await h.connect(o.addrs[0])
    pens = [Penalties(PenaltyConfig(strikes_before_ban=1)) for _ in hosts]
    colls = [Collective(h, p, **kw) for h, p in zip(hosts, pens)]
    return hosts, pens, colls


async def test_all_to_all_exchange_and_counters():
    async with AsyncExitStack() as stack:
        hosts, _, colls = await three_hosts(stack)
        ids = [h.peer_id for h in hosts]
        got = {}

        async def one(i):
            sends = {p: f"{i}->{j}".encode() * 100 for j, p in enumerate(ids)}
            got[i] = await colls[i].exchange("t/0/a", sends, set(ids), timeout_s=10)

        async with trio.open_nursery() as n:
            for i in range(3):
                n.start_soon(one, i)
        for i in range(3):
            assert got[i] == {p: f"{j}->{i}".encode() * 100 for j, p in enumerate(ids)}
        for c in colls:
            assert c.messages_sent == 2 and c.messages_recv == 2
            assert 2 * 400 < c.bytes_sent < 2 * 400 + 200 and c.bytes_recv == c.bytes_sent


async def test_early_message_is_buffered_and_missing_peer_is_absent():
    async with AsyncExitStack() as stack:
        hosts, _, colls = await three_hosts(stack)
        a, b, c = (h.peer_id for h in hosts)
        # b sends before a starts waiting; c never sends
        assert await colls[1].exchange("t/1", {a: b"early"}, set(), timeout_s=5) == {}
        t0 = trio.current_time()
        out = await colls[0].exchange("t/1", {a: b"self"}, {a, b, c}, timeout_s=1.0)
        assert out == {a: b"self", b: b"early"}
        assert 0.9 < trio.current_time() - t0 < 3
        # a late message for a finished tag is dropped, not kept forever
        await colls[2].exchange("t/1", {a: b"late"}, set(), timeout_s=5)
        await wait_for(lambda: colls[0].late_dropped == 1, 5, "the late message to arrive")
        assert "t/1" not in colls[0]._inbox


async def test_garbage_and_oversized_messages_penalize_the_sender():
    async with AsyncExitStack() as stack:
        hosts, pens, colls = await three_hosts(stack, max_frame_bytes=1000)
        a, b = hosts[0].peer_id, hosts[1].peer_id
        s = await hosts[1].open_stream(a, COLLECTIVE_PROTOCOL)
        await write_frame(s, b"\xc1not msgpack")
        await s.close()
        await wait_for(lambda: pens[0].is_banned(b), 5, "b banned")
        # c announces more than the limit
        c = hosts[2].peer_id
        s = await hosts[2].open_stream(a, COLLECTIVE_PROTOCOL)
        await write_frame(s, pack({"tag": "x", "n": 10_000}))
        await s.close()
        await wait_for(lambda: pens[0].is_banned(c), 5, "c banned")
        assert colls[0]._inbox == {} and colls[0].bytes_recv == 0


async def test_a_leaving_node_ends_its_round_at_once_not_at_the_deadline():
    """close() (the node is leaving): an exchange waiting for a peer returns now with what it has, and a later one
    returns at once; a trainer thread blocked in the round is freed, so leaving takes no round deadline."""
    async with AsyncExitStack() as stack:
        hosts, _, colls = await three_hosts(stack)
        a, b, c = (h.peer_id for h in hosts)
        out = {}

        async def waiting():
            out["r"] = await colls[0].exchange("t/close", {a: b"self", b: b"x"}, {a, b, c}, timeout_s=30)

        t0 = trio.current_time()
        async with trio.open_nursery() as n:
            n.start_soon(waiting)
            await trio.sleep(0.5)
            colls[0].close()
        assert trio.current_time() - t0 < 3 and out["r"] == {a: b"self"}
        t1 = trio.current_time()
        assert await colls[0].exchange("t/after", {a: b"s"}, {a, b}, timeout_s=30) == {a: b"s"}
        assert trio.current_time() - t1 < 1
