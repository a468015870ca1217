"""Pulling a run's state from its members, always the whole entry state a majority of them agrees on: one exact
revision (entering a group, a re-fetch, the final state) and a backup's warm copy."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Collection
from typing import Protocol

import trio

from shoal.node.run.config import RunConfig
from shoal.node.run.snapshots import SnapshotStore
from shoal.swarm.net.host import SwarmHost
from shoal.swarm.net.penalty import Penalties
from shoal.swarm.run.client import RunClient
from shoal.swarm.state.agreed import pull_agreed
from shoal.swarm.state.snapshot import Snapshot
from shoal.swarm.state.transfer import StateTransferConfig, StateTransferError

log = logging.getLogger(__name__)


class NotWanted(StateTransferError):
    """The pull was given up: the entry it was for is no longer this node's (a newer table moved its slot on)."""


PULL_RETRY_S = 0.2  # the pause between rounds of pull attempts while no majority has the revision
WARM_LEAD_STEPS = 4  # a backup asks the group to keep its state this many steps past the group's newest step


Ask = Callable[[str, int], Awaitable[int | None]]  # (peer, step): ask it to keep its state there; its own step or None


async def asked(ask: Ask, peers: list[str], step: int) -> dict[str, int | None]:
    """Every one of `peers` asked at once to keep its state at `step` (`ask`: its own step, or None when it did not
    answer): peer -> answer."""
    answers: dict[str, int | None] = {}

    async def one(p: str) -> None:
        answers[p] = await ask(p, step)
    async with trio.open_nursery() as n:
        for p in peers:
            n.start_soon(one, p)
    return answers


class Sources(Protocol):
    """What pulls need of the node: its host, who is live, and whom to penalize (node/run/context.NodeServices)."""

    @property
    def sh(self) -> SwarmHost: ...

    @property
    def penalties(self) -> Penalties: ...

    def live(self) -> set[str]: ...


class StatePulls:
    """A node's pulls of run state from the peers `sources` reaches."""

    def __init__(self, sources: Sources, config: RunConfig, snapshots: SnapshotStore,
                 evicted: Callable[[], Collection[str]] = tuple):
        self.sources, self.config, self.snapshots = sources, config, snapshots
        self.evicted = evicted  # the members the run evicted (the newest table's list): they have no say

    async def revision(self, revision: int, peers: list[str], *, wanted: Callable[[], bool] | None = None,
                       gives_up_on: tuple[type[StateTransferError], ...] = ()) -> Snapshot:
        """The whole entry state at exactly `revision` that the group's rule agrees on among `peers` (the members
        entitled to state it; the live ones vote, the others count as gone, and members the run evicted on a majority
        verdict have no say), from a random one of those holding it, checked before it is returned
        (swarm/state/agreed.py). Waits while no majority has reached the revision.
        `wanted`: asked before every retry; once False the pull is given up (the slot it was for has changed).
        `gives_up_on`: the failures that end the pull at once, raised as they are: NobodyHolds (none of the live
        peers holds the revision or trains toward it) and NoSourceLeft (every one holding the agreed state failed to
        serve it) for a re-fetch, which goes on from its own state while the next vote picks a new revision instead
        of standing still while its group-mates wait on it; NobodyHolds for an entry, whose stage is then lost.
        A source that serves another state than the hash it claimed is not pulled from again in this pull (retrying it
        would only fetch its lie again, and penalize it into a ban the group then feels as its silence)."""
        deadline = trio.current_time() + self.config.state_pull_timeout_s
        attempt = StateTransferConfig(timeout_s=min(self.config.state_pull_attempt_s, self.config.state_pull_timeout_s))
        last, rounds = None, 0
        refused: set[str] = set()  # served another state than the hash they claimed: never pulled from again here
        while trio.current_time() < deadline:
            if rounds and wanted is not None and not wanted():  # asked before every retry, with or without peers
                raise NotWanted(f"revision {revision} is no longer wanted (this node's slot changed): {last}")
            rounds += 1
            live, evicted = self.sources.live(), set(self.evicted())
            voters = [p for p in peers if (p in live or last is None) and p not in evicted]  # silent: one try
            try:
                return await pull_agreed(self.sources.sh, voters, revision=revision, voters=len(voters),
                                         config=attempt, penalties=self.sources.penalties, refused=refused)
            except StateTransferError as e:
                last = e
                log.debug("revision %d: %s", revision, e)
                if isinstance(e, gives_up_on):
                    raise
            await trio.sleep(PULL_RETRY_S)
        raise StateTransferError(f"no majority of the members served revision {revision} within "
                                 f"{self.config.state_pull_timeout_s} s: {last}")

    async def keep_warm(self, client: RunClient, target: Callable[[int], int], ask: Ask) -> None:
        """While this node is a backup (`client`: its run client), keep a warm copy of its stage's state: every
        `backup_refresh_s`, the whole entry state at a revision just ahead of the group (`target(stage)`), which
        each member is asked to keep (`ask(peer, step)` answers the member's own step, or None), verified like any
        other pull. When a member is past that revision already, the revision moves ahead of it once. A copy that
        cannot be had now is tried again at the next refresh."""
        while True:
            t, stage = client.table, client.backup_stage()
            members = list(t.members(stage)) if t is not None and stage is not None else []
            if members:
                await self._refresh_warm(client, stage, members, target(stage), ask)
            await trio.sleep(self.config.backup_refresh_s)

    async def _refresh_warm(self, client: RunClient, stage: int, members: list[str], step: int,
                            ask: Ask) -> None:
        for _ in range(2):
            answers = [a for a in (await asked(ask, members, step)).values() if a is not None]
            if not answers:
                log.info("no warm copy of stage %d now: no member answered the request to keep step %d", stage, step)
                return
            if max(answers) < step:
                break
            step = max(answers) + WARM_LEAD_STEPS  # the group is past it: once more, ahead of where it is
        try:
            with trio.fail_after(self.config.state_pull_timeout_s):
                self.snapshots.warm = await self.revision(step, members, wanted=lambda: client.backup_stage() == stage)
        except (StateTransferError, trio.TooSlowError) as e:
            log.info("no warm copy of stage %d at step %d: %s", stage, step, e)
