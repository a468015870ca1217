"""Keeping a stage's replicas on one state: after a step, a published hash that differs from ours starts a vote
(node/run/votes.py); a replica outside the majority asks a majority peer to keep its state a few steps ahead and
loads it there; at the end of the run the final state is checked the same way (docs/architecture.md, "Consistency").
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import trio

from shoal.node.run.config import RunConfig
from shoal.node.run.context import NodeServices
from shoal.node.run.pulls import StatePulls
from shoal.node.run.replica import Replica
from shoal.node.run.votes import Call, HashVotes
from shoal.swarm.net.rpc import RpcError
from shoal.swarm.run.group import Group
from shoal.swarm.state.transfer import StateTransferError

log = logging.getLogger(__name__)

FINAL_POLL_S = 0.5  # the end of a run: the pause between asks for the group's final hashes
VOTE_EXTRA_STEPS = 2  # after a vote, the next one waits the switch lead plus this many steps


class Consistency:
    """Owned by the event loop: `record` each step's hash, `check` after each step, `refetch` when due."""

    def __init__(self, services: NodeServices, config: RunConfig, replica: Replica, pulls: StatePulls, call: Call,
                 run_id: Callable[[], str]):
        self.services, self.config, self.replica, self.pulls = services, config, replica, pulls
        self.call = call
        self.run_id = run_id
        self.hashes = HashVotes(services.peer_id, call)
        self.refetches = 0  # states loaded from the majority after ours differed
        self.pending: tuple[int, str] | None = None  # (step, majority peer): load that peer's state at that step
        self._vote_after = 0  # no new vote before this step

    def record(self, step: int, state_hash: str) -> None:
        self.hashes.record(step, state_hash)

    def refetch_due(self, step: int) -> bool:
        return self.pending is not None and step >= self.pending[0]

    async def check(self, group: Group | None) -> None:
        """After a step: if a member published a different hash for a step we hold, vote; a minority replica asks
        a majority peer for a snapshot a few steps ahead and loads it there (`refetch`)."""
        step = self.replica.at_step
        if self.pending is not None or step < self._vote_after or \
                not self.hashes.disagrees(group, self.run_id(), self.services.statuses()):
            return
        lead = self.config.switch_lead_min_steps
        self._vote_after = step + lead + VOTE_EXTRA_STEPS
        src = await self.hashes.vote(group)
        if src is not None:
            target = step + lead
            try:
                await self.call(src, "run.snapshot_at", target)
                self.pending = (target, src)
            except RpcError as e:
                log.info("snapshot request to %s failed: %s", src, e)

    async def refetch(self, step: int) -> None:
        """Load the majority's state at `step` from the peer the vote named. Should that peer go (killed after the
        vote), the re-fetch is given up once it is no longer live, and the next vote names another."""
        assert self.pending is not None
        src, self.pending = self.pending[1], None
        self.replica.state = "syncing"
        try:
            snap = await self.pulls.revision(step, [src], wanted=lambda: src in self.services.live())
        except StateTransferError as e:
            log.warning("could not re-fetch step %d from %s (%s): voting again", step, src[-8:], e)
            return
        await self.replica.load(snap)
        self.refetches += 1
        log.warning("state hash disagreed with the majority: re-fetched step %d from %s", step, src)

    def voters(self, g: Group) -> set[str]:
        """The members of `g` that can still vote: this node and those its membership view holds live (a member
        killed near the end never answers; waiting for it would only hold the run's end up)."""
        live = self.services.live()
        return {m for m in g.members if m == self.services.peer_id or m in live}

    async def settle_final(self, g: Group, final_rev: int) -> None:
        """The end of the run: make sure this replica ends with the majority's final state (revision `final_rev`,
        already recorded here), pulling it from a member that holds the agreed hash when ours is not it."""
        self.replica.state = "syncing"
        votes: dict[str, str] = {}
        abstained: set[str] = set()  # members that hold no final state (one that never entered): after the
        #                              wait they have no say, as in a vote during the run
        with trio.move_on_after(self.config.final_check_s):
            while True:
                votes, abstained = await self.hashes.gather(g, final_rev)
                if len(votes) >= len(self.voters(g)):
                    break
                await trio.sleep(FINAL_POLL_S)  # the others are still on their last steps
        voters = self.voters(g) - abstained
        src = self.hashes.source(g, final_rev, votes, voters=len(voters)) if votes else None
        if src is None:
            return
        me = self.services.peer_id  # any member holding the agreed hash serves it, should the one named be gone
        holders = [src] + sorted(p for p, h in votes.items() if h == votes[src] and p not in (src, me))
        try:
            snap = await self.pulls.revision(final_rev, holders)
        except StateTransferError as e:
            log.warning("final state hash disagreed with the majority, and no member holding it served it "
                        "(%s): this replica ends with its own state", e)
            return
        await self.replica.load(snap)
        self.refetches += 1
        self.hashes.record(final_rev, self.replica.sync.state_hash())
        log.warning("final state hash disagreed with the majority: re-fetched the final state from one of %s",
                    [p[-8:] for p in holders])
