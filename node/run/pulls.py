"""Pulling a run's model state from its members: one exact revision (agreed by a majority where it must be), the
short catch-up of a warm backup, and the backup's warm copy itself."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

import trio

from shoal.node.run.config import RunConfig
from shoal.node.run.snapshots import SnapshotStore
from shoal.swarm.net.host import SwarmHost
from shoal.swarm.net.penalty import Penalties
from shoal.swarm.run.client import RunClient
from shoal.swarm.state.agreed import pull_agreed
from shoal.swarm.state.snapshot import Snapshot
from shoal.swarm.state.transfer import MAX_PREFIXES, StateTransferConfig, StateTransferError, pull_state

log = logging.getLogger(__name__)

PULL_RETRY_S = 0.2  # the pause between rounds of pull attempts while no peer has the revision
AGREED_DEFAULT = ("/model/",)  # a synchronizer keeping everything identical: agree on the parameters at least


class Sources(Protocol):
    """What pulls need of the node: its host, who is live, and whom to penalize (node/run/context.NodeServices)."""

    @property
    def sh(self) -> SwarmHost: ...

    @property
    def penalties(self) -> Penalties: ...

    def live(self) -> set[str]: ...


class StatePulls:
    """A node's pulls of run state from the peers `sources` reaches."""

    def __init__(self, sources: Sources, config: RunConfig, snapshots: SnapshotStore):
        self.sources, self.config, self.snapshots = sources, config, snapshots

    async def revision(self, revision: int, peers: list[str], *, only: tuple[str, ...] | None = None,
                       agree_on: tuple[str, ...] | None = None,
                       wanted: Callable[[], bool] | None = None) -> Snapshot:
        """Pull exactly `revision` (or, with `only`, those tensors of it) from one of `peers` (live ones first),
        waiting while none has reached it. With `agree_on`, only a state whose part under those prefixes a strict
        majority of the live peers hold, from a random one of them (swarm/state/agreed.py). `wanted`: asked before
        every retry; once False the pull is given up (the slot it was for has changed)."""
        deadline = trio.current_time() + self.config.state_pull_timeout_s
        attempt = StateTransferConfig(timeout_s=min(self.config.state_pull_attempt_s, self.config.state_pull_timeout_s))
        last = None
        while trio.current_time() < deadline:
            if last is not None and wanted is not None and not wanted():
                raise StateTransferError(f"revision {revision} is no longer wanted (this node's slot changed): {last}")
            live = self.sources.live()
            if agree_on is not None:
                try:
                    return await pull_agreed(self.sources.sh, [p for p in peers if p in live or last is None],
                                             revision=revision, agree_on=agree_on, only=only, config=attempt,
                                             penalties=self.sources.penalties)
                except StateTransferError as e:
                    last = e
                    log.debug("revision %d: %s", revision, e)
                await trio.sleep(PULL_RETRY_S)
                continue
            for p in sorted(peers, key=lambda p: p not in live):
                if p not in live and last is not None:
                    continue  # a silent peer gets one try, then only live ones
                try:
                    return await pull_state(self.sources.sh, p, revision=revision, config=attempt, only=only)
                except StateTransferError as e:
                    last = e
                    log.debug("revision %d from %s: %s", revision, p, e)
            await trio.sleep(PULL_RETRY_S)
        raise StateTransferError(f"no peer served revision {revision} within {self.config.state_pull_timeout_s} s: "
                                 f"{last}")

    async def group_state(self, revision: int, peers: list[str], keys: tuple[str, ...] | None,
                          wanted: Callable[[], bool] | None = None) -> tuple[Snapshot, int]:
        """The state to load at `revision`, and the bytes pulled for it. `keys`: what the synchronizer keeps
        bit-identical across the group (None: everything). A backup with a warm copy pulls only that, plus whatever
        the copy lacks (a copy taken before the first step has no optimizer state), and takes the rest from the
        copy: a short catch-up. Otherwise the whole state."""
        warm = self.snapshots.warm
        agree_on = keys or AGREED_DEFAULT  # what every replica holds bit-identical: the majority's is pulled
        if keys is not None and warm is not None:
            part = await self.revision(revision, peers, only=keys, agree_on=agree_on, wanted=wanted)
            pulled, extra = part.nbytes, []
            missing = part.missing(warm)
            ask = tuple(sorted(missing)) if len(missing) <= MAX_PREFIXES else \
                tuple(sorted({"/" + name.split("/")[1] + "/" for name in missing}))  # a name is its own prefix
            if missing and len(ask) <= MAX_PREFIXES:
                extra.append(await self.revision(revision, peers, only=ask, wanted=wanted))
                pulled += extra[0].nbytes
            try:
                return await trio.to_thread.run_sync(lambda: part.merged(warm, *extra)), pulled
            except StateTransferError as e:
                log.info("the warm copy does not complete revision %d (%s): pulling all of it", revision, e)
        snap = await self.revision(revision, peers, agree_on=agree_on, wanted=wanted)
        return snap, snap.nbytes

    async def keep_warm(self, client: RunClient) -> None:
        """While this node is a backup (`client`: its run client), pull a fresh copy of its stage's state from an
        active replica every `backup_refresh_s`, so that a promotion is a short catch-up."""
        i = 0
        while True:
            t, stage = client.table, client.backup_stage()
            members = t.members(stage) if t is not None and stage is not None else ()
            if members:
                peer = members[i % len(members)]
                i += 1
                try:
                    self.snapshots.warm = await pull_state(self.sources.sh, peer)
                except StateTransferError as e:
                    log.info("warm copy from %s failed: %s", peer, e)
            await trio.sleep(self.config.backup_refresh_s)
