"""Helpers for tests that run real shoal nodes on 127.0.0.1 inside the test's own trio loop."""

from __future__ import annotations

from contextlib import asynccontextmanager
from dataclasses import replace

import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from shoal.node.daemon import Node, NodeConfig
from shoal.protocol.records import HardwareProfile
from shoal.swarm.net.host import HostConfig, open_host
from shoal.swarm.net.membership import MembershipConfig
from tests.helpers.timeline import note

HW = HardwareProfile(device_kind="cpu", device_name="test", memory_bytes=2**30, matmul_tflops=0.1,
                     free_disk_bytes=2**33, cpu_count=2)
FAST = NodeConfig(status_interval_s=0.5, membership=MembershipConfig(suspect_after_s=1.5, gone_after_s=3.0))


@asynccontextmanager
async def running_node(join: list[str] = (), config: NodeConfig = FAST, penalties=None, key=None, choose_run=None,
                       made: list[Node] | None = None, hardware: HardwareProfile = HW):
    """A node running for as long as the block does; `key`: its identity (default: a fresh one); `choose_run`: what
    the person at its terminal would answer when the swarm has several open runs; `made`: the node is appended
    to it (to inspect a node whose start failed); `hardware`: the profile it reports."""
    node = Node(replace(config, host=replace(config.host, join=tuple(join))), hardware,
                **({"key": key} if key is not None else {}))
    if made is not None:
        made.append(node)
    if penalties is not None:
        node.penalties = penalties
    node.choose_run = choose_run
    async with trio.open_nursery() as n:
        t0 = trio.current_time()
        await n.start(node.run)
        note("a node's start", trio.current_time() - t0)
        try:
            yield node
        finally:
            t_stop = trio.current_time()
            n.cancel_scope.cancel()
    note("a node's stop", trio.current_time() - t_stop)


@asynccontextmanager
async def bare_host(join: list[str] = ()):
    """A plain shoal libp2p host with no node logic: a client that can send anything."""
    async with open_host(Ed25519PrivateKey.generate(), HostConfig(join=tuple(join))) as sh:
        await sh.bootstrap()
        yield sh


async def wait_for(pred, timeout_s: float, what: str, poll_s: float = 0.05) -> float:
    t0 = trio.current_time()
    with trio.move_on_after(timeout_s):
        while not pred():
            await trio.sleep(poll_s)
        note(what, trio.current_time() - t0)
        return trio.current_time() - t0
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
