"""A provider whose process died, noticed from its closed connections (docs/broker.md, "Failure detection").

A process that dies (killed, crashed) has its TCP connections closed by its operating system at once; a frozen or
partitioned one keeps them. So when the last connection between the broker and one of its providers closes and
none is back within `reconnect_grace_s` (a replaced connection, a reconnect), the broker pings the provider; one that
neither answers nor has been heard from since its connections closed (no RPC, no status gossip by any path) is
marked failed then, about a second after it died, instead of after `fail_after_s` of silence. Everything else waits
for the silence timeout as before. The facts are the broker's own (its connections, its ping), never a peer's word.

Guards: one probe per provider at a time; a burst of closes (more than half of the run's other providers within a
few graces) is the broker's own link going, not theirs, and marks nobody; probes stop with the lease.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from typing import Protocol

import trio

from shoal.protocol.assignment import GONE
from shoal.swarm.net.rpc import RpcError, call
from shoal.swarm.run.brokerconfig import BrokerConfig
from shoal.swarm.run.context import RunContext
from shoal.swarm.run.seating import Provider

log = logging.getLogger(__name__)

QUEUE = 256  # closes waiting to be probed (more at once: the rest wait for the silence timeout)
BURST_GRACES = 4  # closes within this many graces count together as one burst


class Acts(Protocol):
    """The broker as this watch sees it: its providers, and what a probe makes it do."""

    ctx: RunContext
    config: BrokerConfig
    clock: Callable[[], float]
    providers: dict[str, Provider]

    def holds_lease(self) -> bool: ...
    def heard_since(self, peer_id: str, t: float) -> bool: ...
    def touch(self, peer_id: str) -> None: ...
    def mark_failed(self, peer_id: str, reason: str) -> bool: ...


class ClosedConnections:
    """Owned by the broker's event loop: `run` watches the host's connections (RunContext.watch_closes)."""

    def __init__(self, broker: Acts):
        self.b = broker
        self._send, self._recv = trio.open_memory_channel(QUEUE)  # (peer, when its last connection closed)
        self._probing: set[str] = set()
        self._closes: deque[tuple[float, str]] = deque(maxlen=4096)  # (when, provider): recent closes
        self.failed = 0  # providers marked failed here

    def _on_close(self, peer_id: str) -> None:
        """The host's callback (on its event loop): the last connection to `peer_id` closed."""
        if peer_id in self.b.providers and peer_id != self.b.ctx.me:
            try:
                self._send.send_nowait((peer_id, self.b.clock()))
            except trio.WouldBlock:
                pass  # a flood of closes: the silence timeout still holds for the rest

    async def run(self) -> None:
        watch = self.b.ctx.watch_closes
        if watch is None:
            return
        stop = watch(self._on_close)
        try:
            async with trio.open_nursery() as n:
                async for peer, closed_at in self._recv:
                    if not self.b.holds_lease():
                        break
                    self._closes.append((closed_at, peer))
                    if peer not in self._probing:
                        self._probing.add(peer)
                        n.start_soon(self._probe, peer, closed_at)
                n.cancel_scope.cancel()
        finally:
            stop()

    def _burst(self, now: float) -> bool:
        """More than half of the run's other providers lost their connections to us lately: ours is the link that
        went (or this process stood still), not theirs."""
        window = BURST_GRACES * self.b.config.reconnect_grace_s
        closed = {p for t, p in self._closes if now - t <= window}
        others = sum(1 for p in self.b.providers.values() if p.peer_id != self.b.ctx.me and p.state != GONE)
        return len(closed) > max(1, others // 2)

    async def _probe(self, peer: str, closed_at: float) -> None:
        try:
            await trio.sleep(self.b.config.reconnect_grace_s)
            ctx = self.b.ctx
            if ctx.sh.is_connected(peer) or self._burst(self.b.clock()):
                return
            try:
                await call(ctx.sh, peer, "run.ping", {"run_id": ctx.run_id}, timeout_s=self.b.config.ping_timeout_s)
            except RpcError as e:
                if self.b.heard_since(peer, closed_at) or self._burst(self.b.clock()):
                    return
                if self.b.mark_failed(peer, f"its connections closed and it does not answer: {e}"):
                    self.failed += 1
            else:
                self.b.touch(peer)
        finally:
            self._probing.discard(peer)
