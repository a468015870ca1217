"""What a node's run needs from the node that hosts it: its host, its RPC server, its membership view, its penalties,
its pulse and the runs the swarm advertises, as one typed object (the run never sees the node itself)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from shoal.protocol.envelope import Signed
from shoal.protocol.manifest import RunManifest
from shoal.protocol.records import StatusRecord
from shoal.swarm.net.host import SwarmHost
from shoal.swarm.net.membership import Membership
from shoal.swarm.net.penalty import Penalties
from shoal.swarm.net.pulse import Pulse
from shoal.swarm.run.context import Clock, Handler, RunContext
from shoal.swarm.run.directory import ListedRun, RunDirectory

if TYPE_CHECKING:
    from shoal.node.links import NodeLinks


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeServices:
    """The node's parts a run uses. Everything here lives as long as the node's host does."""

    sh: SwarmHost
    key: Ed25519PrivateKey  # the node's identity: signs what it states for others (its stage's shard manifests)
    membership: Membership  # the live-peer view (its clock is the run's clock)
    penalties: Penalties
    register: Callable[[str, Handler], None]  # RpcServer.register: a handler for "run.*" methods
    publish: Callable[[bytes], Awaitable[None]]  # gossip a sealed envelope (never raises)
    ingest: Callable[[Callable[[Signed], None]], None]  # add a consumer of every verified record the node receives
    pulse: Pulse | None = None  # this process's pulse: tells its own freezes from its peers' silence
    joined_by_address: bool = False  # the node was started with --join (it may not start a run it finds nobody in)
    links: NodeLinks | None = None  # link probes and reports, everyone's reports in a link book (node/links.py)
    directory: RunDirectory = field(default_factory=RunDirectory)  # the runs the swarm advertises (fed by gossip)
    # asks the person at the terminal which of several open runs to join (None: such a node is refused with them)
    choose_run: Callable[[list[ListedRun]], Awaitable[ListedRun | None]] | None = None
    own_status: Callable[[], StatusRecord | None] = lambda: None  # the node's newest status record of itself

    @property
    def peer_id(self) -> str:
        return self.sh.peer_id

    @property
    def clock(self) -> Clock:
        """Monotonic seconds for every timeout of the run: the membership's clock (liveness compares both)."""
        return self.membership.clock

    def live(self) -> set[str]:
        """The peers the membership view holds live."""
        return {e.peer_id for e in self.membership.live_peers()}

    def statuses(self) -> Iterator[tuple[str, StatusRecord]]:
        """(peer, its newest status record) of every live peer that published one."""
        for e in self.membership.live_peers():
            if e.status_record is not None:
                yield e.peer_id, e.status_record

    def run_context(self, manifest: RunManifest, switch_step: Callable[[int], int], placer=None,
                    step: Callable[[], int] | None = None) -> RunContext:
        """What the broker and the run client of `manifest` need (swarm/run/context.py); `placer`: the broker's
        (None: first fit); `step`: this node's training step (the broker weighs it with the steps the others sign)."""
        return RunContext(sh=self.sh, manifest=manifest, register=self.register, publish=self.publish,
                          membership=self.membership, penalties=self.penalties, switch_step=switch_step,
                          step=step, clock=self.clock, pulse=self.pulse, placer=placer, own_status=self.own_status,
                          watch_closes=self.sh.watch_closes)
