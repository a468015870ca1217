"""Relay reservations against identities made by the dozen on one machine (a real shoal node serving as relay,
attacker hosts in the test, all on 127.0.0.1): reservations are limited per source address and live only as long as
their connection, sybils asking past the limit are refused and penalized, and an honest NATed newcomer from
another address still gets one."""

from __future__ import annotations

from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import replace

import multiaddr
import pytest
import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import info_from_p2p_addr

from shoal.swarm.net.host import build_libp2p_host
from shoal.swarm.net.nat import NatConfig
from shoal.swarm.net.relay import RelayConfig, RelayError, reserve
from tests.helpers.swarm import FAST, running_node

SLOTS = 8  # the relay's reservations in this test (32 by default): the sybils would take them all
SYBILS = 12


@asynccontextmanager
async def identity():
    """A bare libp2p host with a fresh identity: all an attacker needs per sybil."""
    host = build_libp2p_host(Ed25519PrivateKey.generate(), "/ip4/127.0.0.1/tcp/0")
    async with host.run([multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]):
        yield host


async def reserve_from(host, relay_addr: str, source: str | None = None) -> str:
    """Connect to the relay (from `source`'s address when given) and ask for a reservation: "ok" or the refusal."""
    info = info_from_p2p_addr(multiaddr.Multiaddr(relay_addr))
    host.get_peerstore().add_addrs(info.peer_id, info.addrs, 600)
    if source is None:
        await host.connect(info)
    else:
        await host.get_network().dial_addr(info.addrs[0], info.peer_id, source=(source, 0))
    try:
        await reserve(host, info.peer_id.to_base58(), 5.0)
        return "ok"
    except RelayError as e:
        return str(e).rsplit(": ", 1)[-1]


async def test_sybils_on_one_address_cannot_take_every_relay_slot():
    relay_cfg = RelayConfig(service="on", max_reservations=SLOTS)
    cfg = replace(FAST, host=replace(FAST.host, nat=NatConfig(relay=relay_cfg)))
    async with running_node(config=cfg) as relay, AsyncExitStack() as stack:
        relay.sh.nat.relay.serve(True, relay.sh.set_handler)
        addr = relay.sh.addrs[0]
        sybils = [await stack.enter_async_context(identity()) for _ in range(SYBILS)]
        got = [await reserve_from(h, addr) for h in sybils]
        held = got.count("ok")
        refused = [ID(h.get_id().to_bytes()).to_base58() for h, g in zip(sybils, got) if g != "ok"]
        newcomer = await stack.enter_async_context(identity())
        honest = await reserve_from(newcomer, addr, source="127.0.0.2")
        print(f"relay with {SLOTS} slots: {SYBILS} sybils from 127.0.0.1 got {held} reservations; the newcomer from "
              f"127.0.0.2: {honest}")
        # sybils that disconnect free their slots (a reservation lives with its connection) ...
        for h in sybils[:held]:
            await h.get_network().close_peer(relay.sh.host.get_id())
        with trio.fail_after(5):
            while relay.sh.nat.relay.reservations_held() > 1:
                await trio.sleep(0.1)
        # ... but new identities from the same address are held to a rate
        late = [await reserve_from(await stack.enter_async_context(identity()), addr) for _ in range(8)]
        print(f"{relay.sh.nat.relay.reservations_refused} refusals; after the sybils disconnected, 8 more identities "
              f"from 127.0.0.1: {late.count('ok')} reserved")
        assert held == relay_cfg.max_reservations_per_source
        assert honest == "ok"
        assert all("RESOURCE_LIMIT_EXCEEDED" in g for g in got if g != "ok")
        assert all(relay.penalties.reasons(p) for p in refused)
        assert late.count("ok") == relay_cfg.reservations_per_source_window - relay_cfg.max_reservations_per_source
