"""NAT traversal parts on real loopback hosts: dial-back, relay reservations and limits, paths for bulk streams."""

from __future__ import annotations

import socket
from contextlib import AsyncExitStack, asynccontextmanager

import multiaddr
import pytest
import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from libp2p.host.autonat.autonat import AutoNATService
from libp2p.host.autonat.pb.autonat_pb2 import Message
from libp2p.peer.id import ID

from shoal.swarm.net.host import HostConfig, open_host
from shoal.swarm.net.nat import NatConfig
from shoal.swarm.net.paths import NoDirectPath, PathConfig, connection_kinds
from shoal.swarm.net.reachability import (LAN, PUBLIC, UNKNOWN, UNREACHABLE, ask_dialback, candidate_addrs,
                                          classify, is_private_ip)
from shoal.swarm.net.relay import RelayConfig, RelayError, dial_via_relay, reserve

PING = "/ipfs/ping/1.0.0"


@asynccontextmanager
async def hosts(n: int, dht_clients: tuple[int, ...] = (), **nat_kw):
    """n hosts with NAT traversal, all joined to the first; `dht_clients` stay out of DHT routing tables (no peer
    finds and dials them on its own, as with a NATed peer)."""
    async with AsyncExitStack() as stack:
        out = []
        for i in range(n):
            join = (out[0].addrs[0],) if out else ()
            config = HostConfig(join=join, nat=NatConfig(**nat_kw), dht_mode_server=i not in dht_clients)
            sh = await stack.enter_async_context(open_host(Ed25519PrivateKey.generate(), config))
            await sh.bootstrap()
            out.append(sh)
        yield out


def nat_host(join: str, **nat_kw):
    return open_host(Ed25519PrivateKey.generate(), HostConfig(join=(join,), nat=NatConfig(**nat_kw)))


def closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def test_address_classes():
    assert is_private_ip("10.1.0.10") and is_private_ip("127.0.0.1") and is_private_ip("100.64.1.1")
    assert is_private_ip("fe80::1") and is_private_ip("not an ip")
    assert not is_private_ip("198.51.100.10") and not is_private_ip("8.8.8.8")  # TEST-NET counts as public here
    assert candidate_addrs(["/ip4/0.0.0.0/tcp/4001/p2p/x", "/ip4/10.0.0.2/tcp/4001"], ["203.0.113.5"]) == [
        "/ip4/10.0.0.2/tcp/4001", "/ip4/203.0.113.5/tcp/4001"]
    assert classify(["/ip4/203.0.113.5/tcp/1", "/ip4/10.0.0.2/tcp/1"]) == PUBLIC
    assert classify(["/ip4/127.0.0.1/tcp/1"]) == LAN
    assert classify([]) == UNKNOWN


async def test_dialback_dials_while_the_librarys_autonat_answers_ok_without_dialing():
    async with hosts(3) as (server, plain, client):
        AutoNATService(plain.host)  # py-libp2p 0.8.1's own server, for comparison
        for sh in (server, plain):
            await client.connect(sh.addrs[0])
        nowhere = [f"/ip4/127.0.0.1/tcp/{closed_port()}"]
        library = await client.nat.dialback.query_server(ID.from_base58(plain.peer_id),
                                                         [multiaddr.Multiaddr(a).to_bytes() for a in nowhere])
        assert library[0] == Message.OK  # the bug: it "reached" a port nobody listens on (it reused our connection)
        verdict = await ask_dialback(client.nat.dialback, [server.peer_id], nowhere, 10)
        assert verdict.reachability == UNREACHABLE and verdict.answers == 1
        await trio.sleep(server.nat.config.dialback.per_peer_interval_s)
        verdict = await ask_dialback(client.nat.dialback, [server.peer_id], client.addrs, 10)
        assert verdict.reachability == LAN and verdict.dialed_at == (client.addrs[0].split("/p2p/")[0],)
        assert server.nat.dialback.served == 2
        # a peer asking again at once is refused: it gets no answer, not a wrong one
        verdict = await ask_dialback(client.nat.dialback, [server.peer_id], client.addrs, 10)
        assert verdict.reachability == UNKNOWN and verdict.answers == 0


async def test_a_relay_serves_only_when_on_and_reserves_with_its_address():
    async with hosts(2) as (relay, target):
        with pytest.raises(Exception):  # the HOP protocol is not offered
            await reserve(target.host, relay.peer_id, 5)
        relay.nat.relay.serve(True, relay.set_handler)
        r = await reserve(target.host, relay.peer_id, 5)
        assert r.relay_addrs and all(a.endswith(f"/p2p/{relay.peer_id}") for a in r.relay_addrs)
        assert r.circuit_addrs(target.peer_id)[0] == f"{r.relay_addrs[0]}/p2p-circuit/p2p/{target.peer_id}"


async def ping_echo(stream, n: int) -> None:
    """n pings at once (the ping handler echoes every 32 bytes), then all n echoes."""
    await stream.write(b"p" * 32 * n)
    got = 0
    while got < 32 * n:
        data = await stream.read(32 * n - got)
        if not data:
            raise EOFError("ping stream ended")
        got += len(data)


async def test_a_bulk_push_is_cut_at_the_circuit_limit_and_other_circuits_to_the_same_peer_live_on():
    limit = 64 << 10
    async with hosts(4, relay=RelayConfig(service="on", circuit_bytes=limit, peer_bytes_per_window=8 << 20),
                     paths=PathConfig(hole_punch=False)) as (relay, target, pusher, other):
        relay.nat.relay.serve(True, relay.set_handler)
        r = await reserve(target.host, relay.peer_id, 5)
        circuit = r.circuit_addrs(target.peer_id)[0]
        # the pusher's circuit first: py-libp2p 0.8.1 files circuits under the destination, so the second one
        # overwrites the first's entry and the first one's end closed the second (fixed in RelayService)
        c_push = await dial_via_relay(pusher.host, circuit, 5)
        c_other = await dial_via_relay(other.host, circuit, 5)
        s_other = await _ping_stream(other, c_other)
        s_push = await _ping_stream(pusher, c_push)
        await ping_echo(s_other, 10)
        with pytest.raises(Exception):
            with trio.fail_after(30):
                while True:  # the ping handler echoes every 32 bytes: both directions count against the circuit
                    await ping_echo(s_push, 64)
        assert relay.nat.relay.circuits_cut == 1, (relay.nat.relay.circuits_cut, relay.nat.relay.bytes_relayed)
        assert relay.nat.relay.bytes_relayed <= 2 * limit  # the pusher's (cut at the limit) and the other circuit's
        assert not c_other.is_closed  # the other source's circuit to the same peer is untouched
        await ping_echo(await _ping_stream(other, c_other), 10)


async def test_a_source_over_its_byte_budget_gets_no_more_circuits():
    async with hosts(3, relay=RelayConfig(service="on", circuit_bytes=1 << 30, peer_bytes_per_window=128 << 10),
                     paths=PathConfig(hole_punch=False)) as (relay, target, pusher):
        relay.nat.relay.serve(True, relay.set_handler)
        circuit = (await reserve(target.host, relay.peer_id, 5)).circuit_addrs(target.peer_id)[0]
        conn = await dial_via_relay(pusher.host, circuit, 5)
        s = await _ping_stream(pusher, conn)
        with pytest.raises(Exception):
            with trio.fail_after(30):
                while True:
                    await ping_echo(s, 64)
        with pytest.raises(RelayError, match="RESOURCE_LIMIT_EXCEEDED"):
            await dial_via_relay(pusher.host, circuit, 5)


async def _ping_stream(sh, conn):
    from libp2p.custom_types import TProtocol
    from libp2p.protocol_muxer.multiselect_communicator import MultiselectCommunicator

    stream = await conn.new_stream()
    await sh.host.multiselect_client.select_one_of([TProtocol(PING)], MultiselectCommunicator(stream), 10)
    return stream


async def test_bulk_streams_refuse_the_relay_control_streams_take_it():
    """On one machine a hole punch cannot work (TCP simultaneous open inside one network stack fails with
    EADDRNOTAVAIL), so here punching is off: the NAT tests show the punch on a real NAT."""
    nat = dict(relay=RelayConfig(service="on"), paths=PathConfig(hole_punch=False))
    async with hosts(2, dht_clients=(1,), **nat) as (relay, target):
        relay.nat.relay.serve(True, relay.set_handler)
        r = await reserve(target.host, relay.peer_id, 5)
        circuit = tuple(r.circuit_addrs(target.peer_id))
        relay.nat.learn(target.peer_id, "relayed", circuit)  # its announcement: out of the routing table
        async with nat_host(relay.addrs[0], **nat) as client:
            await client.bootstrap()
            client.nat.learn(target.peer_id, "relayed", circuit)
            tid = ID.from_base58(target.peer_id)
            control = await client.open_stream(target.peer_id, PING)
            assert connection_kinds(client.host, tid) == (False, True)  # announced as relayed: through the relay
            await ping_echo(control, 2)
            with pytest.raises(NoDirectPath):
                await client.open_stream(target.peer_id, PING, bulk=True)
            await ping_echo(control, 2)  # the relayed connection still carries control traffic
            assert relay.nat.relay.bytes_relayed > 0
