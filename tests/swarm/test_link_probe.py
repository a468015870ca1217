"""Link probes over real libp2p hosts: both ends learn the link, the data-parallel traffic a node carries measures
its links too, and a peer that probes too often or asks for too much is refused and penalized."""

from __future__ import annotations

from contextlib import AsyncExitStack

import pytest
import trio

from shoal.protocol.wire import pack
from shoal.swarm.net.framing import frame
from shoal.swarm.net.linkprobe import (
    MAX_PROBE_BYTES, PROBE_PROTOCOL, LinkProber, LinkProbeServer, ProbeConfig, ProbeError, probe)
from shoal.swarm.net.penalty import Penalties, PenaltyConfig
from shoal.swarm.run.collective import Collective
from tests.helpers.swarm import bare_host, wait_for


async def two_hosts(stack: AsyncExitStack, config: ProbeConfig = ProbeConfig()):
    a = await stack.enter_async_context(bare_host())
    b = await stack.enter_async_context(bare_host(join=[a.addrs[0]]))
    pens = [Penalties(PenaltyConfig(strikes_before_ban=3)) for _ in range(2)]
    servers = [LinkProbeServer(h, p, h.links, config) for h, p in zip((a, b), pens)]
    return a, b, pens, servers


async def test_a_probe_measures_both_ways_and_the_other_end_records_its_own_view():
    async with AsyncExitStack() as stack:
        a, b, _, _ = await two_hosts(stack)
        r = await probe(b, a.peer_id, 256 * 1024, b.links)
        assert 0 < r.rtt_s < 1 and r.up_bps > 1e6 and r.down_bps > 1e6
        mine = b.links.figure(a.peer_id)
        assert mine.rtt_100us > 0 and mine.up_kbps > 0 and mine.down_kbps > 0
        theirs = a.links.figure(b.peer_id)  # a measured the 256 KiB it received and its write back, no round trip
        assert theirs is not None and theirs.down_kbps > 0 and theirs.up_kbps > 0 and theirs.rtt_100us == 0


async def test_the_prober_takes_the_least_known_peer_and_adapts_the_size():
    async with AsyncExitStack() as stack:
        a, b, _, _ = await two_hosts(stack, ProbeConfig(min_interval_s=0.0))
        prober = LinkProber(b, b.links, lambda: [a.peer_id, b.peer_id],
                            ProbeConfig(start_bytes=64 * 1024, min_bytes=64 * 1024, interval_s=0.1))
        assert prober.next_target() == a.peer_id  # never itself
        r = await prober.probe_once()
        assert r is not None and b.links.complete(a.peer_id)
        assert prober.next_target() is None  # fresh and complete: nothing to do until refresh_s
        assert prober._size[a.peer_id] == 128 * 1024  # loopback is fast: the next probe is larger


async def test_data_parallel_messages_measure_the_links_they_cross():
    async with AsyncExitStack() as stack:
        a, b, _, _ = await two_hosts(stack)
        ca, cb = Collective(a, Penalties()), Collective(b, Penalties())
        payload = bytes(512 * 1024)
        for i in range(2):  # the first message opens the stream; the second goes on the kept one
            async with trio.open_nursery() as n:
                n.start_soon(ca.exchange, f"t/{i}", {b.peer_id: payload}, {b.peer_id}, 10)
                n.start_soon(cb.exchange, f"t/{i}", {a.peer_id: payload}, {a.peer_id}, 10)
        assert a.links.figure(b.peer_id).down_kbps > 0 and a.links.figure(b.peer_id).up_kbps > 0
        assert b.links.figure(a.peer_id).down_kbps > 0


async def test_probing_too_often_or_too_much_is_refused_and_penalized():
    async with AsyncExitStack() as stack:
        a, b, pens, servers = await two_hosts(stack, ProbeConfig(min_interval_s=30.0))
        await probe(b, a.peer_id, 64 * 1024, b.links)
        with pytest.raises(ProbeError):
            await probe(b, a.peer_id, 64 * 1024, b.links)  # again within 30 s
        assert servers[0].refused == 1 and pens[0].strikes(b.peer_id) == 1
        # an oversized bulk request from a fresh peer: rejected before it is read
        c = await stack.enter_async_context(bare_host(join=[a.addrs[0]]))
        stream = await c.open_stream(a.peer_id, PROBE_PROTOCOL)
        await stream.write(frame(pack({"op": "bulk", "n": MAX_PROBE_BYTES + 1, "back": 0})))
        await wait_for(lambda: pens[0].strikes(c.peer_id) == 1, 10, "the oversized probe penalized")
        assert a.links.figure(c.peer_id) is None
        try:
            await stream.reset()
        except Exception:  # noqa: BLE001 - the server reset it already
            pass
