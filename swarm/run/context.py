"""What the broker and the run client need from the node that hosts them: its host, the run, its clocks."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from shoal.protocol.manifest import RunManifest
from shoal.protocol.records import StatusRecord
from shoal.swarm.net.host import SwarmHost
from shoal.swarm.net.membership import Membership
from shoal.swarm.net.penalty import Penalties
from shoal.swarm.net.pulse import Pulse
from shoal.swarm.run.placer import Placer

Handler = Callable[[str, Any], Awaitable[Any]]
Clock = Callable[[], float]


@dataclass(kw_only=True, slots=True)
class RunContext:
    """What the broker and the run client need from the node that hosts them."""

    sh: SwarmHost
    manifest: RunManifest
    register: Callable[[str, Handler], None]  # RpcServer.register
    publish: Callable[[bytes], Awaitable[None]]  # gossip publish of a sealed envelope (must not raise)
    membership: Membership | None = None  # liveness from status gossip; RPC contact counts too
    penalties: Penalties | None = None
    # stage -> the first step at which a group change can safely take effect (every member must hear of the
    # new table before it reaches that step); None: changes take effect from step 0 (nothing trains yet)
    switch_step: Callable[[int], int] | None = None
    # the training step of the node hosting the broker (a member too, most often: the broker weighs its own step
    # with the steps others sign in their status records); None: it trains nothing
    step: Callable[[], int] | None = None
    # monotonic seconds for every timeout, lease and backoff (the membership's clock: liveness compares both);
    # wall-clock seconds only for what records carry (issue times, lease expiry)
    clock: Clock = time.monotonic
    wall: Clock = time.time
    # this process's pulse on `clock`: silence is measured from the end of its own last freeze (None: no freezes)
    pulse: Pulse | None = None
    # who sits where: which slot, which backup, when to move providers (None: first fit, never a move)
    placer: Placer | None = None
    # the hosting node's newest status record of itself (its membership view holds only the others')
    own_status: Callable[[], StatusRecord | None] = lambda: None
    # on_close(peer) whenever this node's last connection to a peer closes -> the function that stops it
    # (SwarmHost.watch_closes); None: closed connections are not watched (the silence timeout alone)
    watch_closes: Callable[[Callable[[str], None]], Callable[[], None]] | None = None
    _run_id: tuple[RunManifest | None, str] = field(default=(None, ""), init=False, repr=False, compare=False)

    def status_of(self, peer_id: str) -> StatusRecord | None:
        """The newest status record of `peer_id` in this run (this node's own included); None without one."""
        if peer_id == self.me:
            st = self.own_status()
        else:
            e = self.membership.peers.get(peer_id) if self.membership is not None else None
            st = e.status_record if e is not None else None
        return st if st is not None and st.run_id == self.run_id else None

    def silent_s(self, last_heard: float) -> float:
        """Seconds since `last_heard` (clock time), never counting silence across this process's own freeze."""
        return self.pulse.silent_s(last_heard) if self.pulse is not None else self.clock() - last_heard

    @property
    def run_id(self) -> str:
        """The manifest's run id, computed once per manifest (hashing it costs ~0.2 ms, and every RPC asks)."""
        m, rid = self._run_id
        if m is not self.manifest:
            rid = self.manifest.run_id
            self._run_id = (self.manifest, rid)
        return rid

    @property
    def me(self) -> str:
        return self.sh.peer_id
