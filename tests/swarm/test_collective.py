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


async def ended_at_once(coll: Collective, tag: str, me: str, peers: set[str], end) -> dict[str, bytes]:
    """An exchange under `tag` waiting for `peers` (who never send), then `end()` half a second in: what it returned,
    having returned within 3 s (the round's deadline is 30 s)."""
    out = {}

    async def waiting():
        out["r"] = await coll.exchange(tag, {me: b"self"}, {me, *peers}, timeout_s=30)

    t0 = trio.current_time()
    async with trio.open_nursery() as n:
        n.start_soon(waiting)
        await trio.sleep(0.5)
        end()
    assert trio.current_time() - t0 < 3
    return out["r"]


async def test_a_leaving_node_ends_its_round_at_once_not_at_the_deadline():
    """close() (the node is leaving): an exchange waiting for a peer returns now with what it has, and a later one
    returns at once; a trainer thread blocked in the round is freed, so leaving takes no round deadline."""
    async with AsyncExitStack() as stack:
        hosts, _, colls = await three_hosts(stack)
        a, b, c = (h.peer_id for h in hosts)
        assert await ended_at_once(colls[0], "t/close", a, {b, c}, colls[0].close) == {a: b"self"}
        t1 = trio.current_time()
        assert await colls[0].exchange("t/after", {a: b"s"}, {a, b}, timeout_s=30) == {a: b"s"}
        assert trio.current_time() - t1 < 1


async def test_a_given_up_group_epoch_ends_its_rounds_at_once_and_no_other():
    """give_up(prefix) (the table re-formed the group at a step this node had begun): an exchange of that epoch
    waiting for a peer returns now with what it has, a later one of that epoch at once, one of another epoch
    waits as before."""
    async with AsyncExitStack() as stack:
        hosts, _, colls = await three_hosts(stack)
        a, b, c = (h.peer_id for h in hosts)
        assert await ended_at_once(colls[0], "run/0/4/9/grad/rs", a, {b, c},
                                   lambda: colls[0].give_up("run/0/4/")) == {a: b"self"}
        t1 = trio.current_time()
        assert await colls[0].exchange("run/0/4/9/grad/ag", {a: b"s"}, {a, c}, timeout_s=30) == {a: b"s"}
        assert trio.current_time() - t1 < 1
        t2 = trio.current_time()
        assert await colls[0].exchange("run/0/5/9/grad/rs", {a: b"s"}, {a, c}, timeout_s=1.5) == {a: b"s"}
        assert trio.current_time() - t2 >= 1.4  # another epoch's round still waits for its members


async def test_a_message_for_an_epoch_not_known_yet_is_held_and_judged_when_the_round_begins():
    """A provider's message under a group epoch this node has not heard of (the table is on its way) is held, one per
    peer, and put to the gate again when this node's round under that tag begins: kept when the table named the
    sender, dropped and penalized when it did not; a second message of the same peer meanwhile is dropped."""
    from shoal.swarm.run.collective_gate import Refusal

    known: set[str] = set()  # the epochs this node's tables name, and who is in them
    async with AsyncExitStack() as stack:
        hosts = [await stack.enter_async_context(bare_host()) for _ in range(3)]
        for h in hosts[1:]:
            await h.connect(hosts[0].addrs[0])
        a, b, c = (h.peer_id for h in hosts)

        def gate(peer: str, tag: str):
            epoch = tag.split("/")[1]
            if epoch not in {k.split("/")[0] for k in known}:
                return Refusal(why=f"epoch {epoch} is unknown here", penalize=False, hold=True)
            return None if f"{epoch}/{peer}" in known else Refusal(why="not a member", penalize=True)
        pens = [Penalties(PenaltyConfig(strikes_before_ban=3)) for _ in hosts]
        coll = Collective(hosts[0], pens[0], gate=gate)
        senders = [Collective(h, p) for h, p in zip(hosts[1:], pens[1:])]
        await senders[0].exchange("r/7/30/rs", {a: b"from b"}, set(), timeout_s=5)
        await senders[1].exchange("r/7/30/rs", {a: b"from c"}, set(), timeout_s=5)
        await senders[0].exchange("r/7/31/rs", {a: b"b again"}, set(), timeout_s=5)
        await wait_for(lambda: len(coll._held) == 2 and coll.refused == 1, 5, "two held, the third dropped")
        known.update({"7/" + a, "7/" + b})  # the table comes: epoch 7 is a, b (not c)
        out = await coll.exchange("r/7/30/rs", {a: b"self"}, {a, b, c}, timeout_s=1.0)
        assert out == {a: b"self", b: b"from b"} and not coll._held
        assert pens[0].reasons(c) and not pens[0].reasons(b)


async def test_a_peer_killed_after_our_message_reached_it_is_not_waited_for():
    """Our message reached c, then c's process died: its connections closed and none came back within the grace, so
    the exchange ends then, not at its deadline (a killed member costs its group half a second, not a round
    timeout). A silent peer whose connections stay open (frozen, partitioned) is still waited for until the
    deadline (test_early_message_is_buffered_and_missing_peer_is_absent)."""
    async with AsyncExitStack() as stack:
        a_host = await stack.enter_async_context(bare_host())
        coll = Collective(a_host, Penalties())
        stop, closed_at = trio.Event(), []

        async def c_node(task_status=trio.TASK_STATUS_IGNORED):
            async with bare_host(join=[a_host.addrs[0]]) as h:
                if a_host.peer_id not in h.connected_peers():
                    await h.connect(a_host.addrs[0])
                Collective(h, Penalties())  # c takes our message (its handler is there), and never answers
                task_status.started(h.peer_id)
                await stop.wait()
            closed_at.append(trio.current_time())  # the process died: its host closed every connection

        async def kill_c():
            await wait_for(lambda: coll.messages_sent == 1, 10, "our message to reach c")
            stop.set()

        async with trio.open_nursery() as n:
            c = await n.start(c_node)
            a = a_host.peer_id
            n.start_soon(kill_c)
            out = await coll.exchange("t/kill", {a: b"self", c: b"for c"}, {a, c}, timeout_s=30.0)
            ended = trio.current_time()
        assert out == {a: b"self"} and coll.departed_skipped == 1
        assert ended - closed_at[0] < 2.0, ended - closed_at[0]


async def test_a_peer_counted_out_is_not_waited_for_in_that_epoch_only():
    """c is alive and silent (a frozen member keeps its connections): the round waits for it until the table that
    counts it failed reaches us (`count_out` for the group epoch), then ends at once with what it has; the epoch's
    later rounds do not wait for it either, while another epoch's round still does, until its deadline."""
    async with AsyncExitStack() as stack:
        hosts, _, colls = await three_hosts(stack)
        a, b, c = (h.peer_id for h in hosts)
        epoch = "run/0/3/"
        assert await colls[1].exchange(f"{epoch}7/up", {a: b"from b"}, set(), timeout_s=5) == {}
        t0 = trio.current_time()
        async with trio.open_nursery() as n:
            async def counted_out_later():
                await trio.sleep(0.5)
                colls[0].count_out(epoch, {c})

            n.start_soon(counted_out_later)
            out = await colls[0].exchange(f"{epoch}7/up", {a: b"self"}, {a, b, c}, timeout_s=30.0)
        assert out == {a: b"self", b: b"from b"}
        assert 0.4 < trio.current_time() - t0 < 3.0  # at the count-out, not the 30 s deadline
        t1 = trio.current_time()
        assert await colls[0].exchange(f"{epoch}8/up", {a: b"self"}, {a, c}, timeout_s=30.0) == {a: b"self"}
        assert trio.current_time() - t1 < 1.0
        t2 = trio.current_time()
        assert await colls[0].exchange("run/0/4/8/up", {a: b"self"}, {a, c}, timeout_s=1.0) == {a: b"self"}
        assert trio.current_time() - t2 >= 0.9  # another epoch: c is waited for until the deadline


async def test_a_member_that_will_not_enter_an_epoch_says_so_and_is_counted_out_there_alone():
    """c was to enter the group epoch at round 141 and its slot moved on before it could: it tells the epoch's
    members (`abstain`), and a's round stops waiting for c at once; b, silent, is still waited for (a message
    counts out its sender only), and c in another epoch too."""
    async with AsyncExitStack() as stack:
        hosts, _, colls = await three_hosts(stack)
        a, b, c = (h.peer_id for h in hosts)
        epoch = "run/0/7/"
        t0 = trio.current_time()
        async with trio.open_nursery() as n:
            async def c_abstains():
                await trio.sleep(0.5)
                await colls[2].abstain(epoch, 141, {a, b, c})

            n.start_soon(c_abstains)
            out = await colls[0].exchange(f"{epoch}141/up", {a: b"self"}, {a, c}, timeout_s=30.0)
        assert out == {a: b"self"} and 0.4 < trio.current_time() - t0 < 3.0
        t1 = trio.current_time()
        assert await colls[0].exchange(f"{epoch}142/up", {a: b"self"}, {a, b, c}, timeout_s=1.0) == {a: b"self"}
        assert trio.current_time() - t1 >= 0.9  # b was not counted out by c's word
        await wait_for(lambda: colls[1].messages_recv == 1, 5, "c's word to reach b")
        t2 = trio.current_time()
        assert await colls[1].exchange(f"{epoch}141/up", {b: b"self"}, {b, c}, timeout_s=30.0) == {b: b"self"}
        assert trio.current_time() - t2 < 1.0  # b had it before its round began
        t3 = trio.current_time()
        assert await colls[0].exchange("run/0/8/150/up", {a: b"self"}, {a, c}, timeout_s=1.0) == {a: b"self"}
        assert trio.current_time() - t3 >= 0.9
