"""Writers cancelled while a connection is busy leave it whole (two real libp2p hosts on 127.0.0.1): a bulk stream
keeps the connection's writes contended while many small writes on other streams give up at short deadlines; the
connection then still carries new streams both ways (swarm/net/host.py: a Noise message, once encrypted, is sent
whole)."""

from __future__ import annotations

import trio

from shoal.swarm.net.framing import read_frame, write_frame
from tests.helpers.swarm import bare_host


ECHO, SINK = "/shoal-test/echo/1", "/shoal-test/sink/1"


async def test_writes_cancelled_on_a_busy_connection_leave_it_whole():
    async with bare_host() as a, bare_host(a.addrs) as b:
        sunk = 0

        async def sink(stream):
            nonlocal sunk
            while True:
                part = await stream.read(1 << 16)
                if not part:
                    return
                sunk += len(part)

        async def echo(stream):
            await write_frame(stream, await read_frame(stream, 1 << 20))
            await stream.close()

        a.set_handler(SINK, sink)
        a.set_handler(ECHO, echo)
        cancelled = 0
        async with trio.open_nursery() as n:
            bulk = await b.open_stream(a.peer_id, SINK)

            async def pour():
                for _ in range(40):
                    await bulk.write(bytes(1 << 20))

            n.start_soon(pour)
            for i in range(200):
                with trio.move_on_after(0.0005 * (i % 7)) as scope:
                    s = await b.open_stream(a.peer_id, ECHO)
                    await write_frame(s, b"x" * 2000)
                    await read_frame(s, 1 << 20)
                cancelled += scope.cancelled_caught
        assert cancelled > 50  # the deadlines did land in the middle of writes
        for x, y in ((b, a), (a, b)):
            y.set_handler(ECHO, echo)
            with trio.fail_after(10):
                s = await x.open_stream(y.peer_id, ECHO)
                await write_frame(s, b"still whole")
                assert await read_frame(s, 1 << 20) == b"still whole"
        with trio.fail_after(10):
            while sunk < 40 << 20:
                await trio.sleep(0.05)
