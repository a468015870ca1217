"""Keeping a stage's replicas on one state: after a step, a published hash that differs from ours starts a vote
(node/run/votes.py); a replica outside the majority asks every member to keep its state a few steps ahead and loads
there the state the members agree on, from a random one of them (never one peer's word); at the end of the run the
final state is checked the same way (docs/architecture.md, "Consistency"). Members the vote finds lying are
penalized and reported to the broker (most members' reports evict)."""

from __future__ import annotations

import logging
from collections.abc import Callable

import trio

from shoal.node.run.config import RunConfig
from shoal.node.run.context import NodeServices
from shoal.node.run.entitled import AskPacer
from shoal.node.run.pulls import StatePulls, asked
from shoal.node.run.replica import Replica
from shoal.node.run.votes import Call, HashVotes
from shoal.swarm.net.rpc import RpcError
from shoal.swarm.run.group import Group
from shoal.swarm.state.agreed import NobodyHolds, NoSourceLeft
from shoal.swarm.state.transfer import StateTransferError

log = logging.getLogger(__name__)

FINAL_POLL_S = 0.5  # the end of a run: the pause between asks for the group's final hashes
VOTE_EXTRA_STEPS = 2  # after a vote, the next one waits the switch lead plus this many steps


Report = Callable[[Group, list[str]], None]  # (group, offenders): tell the broker (without waiting)


class Consistency:
    """Owned by the event loop: `record` each step's hash, `check` after each step, `refetch` when due."""

    def __init__(self, services: NodeServices, config: RunConfig, replica: Replica, pulls: StatePulls, call: Call,
                 run_id: Callable[[], str], report: Report):
        self.services, self.config, self.replica, self.pulls = services, config, replica, pulls
        self.call = call
        self.run_id = run_id
        self.report = report
        self.hashes = HashVotes(services.peer_id, call)
        self.pacer = AskPacer(services.clock)  # our snapshot requests, within what each peer accepts
        self.refetches = 0  # states loaded from the majority after ours differed
        self.pending: tuple[int, str] | None = None  # (step, majority peer): load that peer's state at that step
        self._vote_after = 0  # no new vote before this step

    def record(self, step: int, state_hash: str) -> None:
        self.hashes.record(step, state_hash)

    def forget_after(self, revision: int) -> None:
        """The run rolled back to `revision`: hashes recorded after it, a re-fetch planned after it, go; the next
        vote waits the switch lead."""
        self.hashes.forget_after(revision)
        self.pending = None
        self._vote_after = revision + self.config.switch_lead_min_steps

    def published(self, step: int) -> str | None:
        """The hash this node publishes for `step` (its status record's claim): none for a step at which a re-fetch
        is planned, whose state is about to be replaced by the agreed one (a claim is answered for in votes, and
        after the re-fetch this node holds, and answers, the agreed hash there)."""
        return None if self.refetch_due(step) else self.hashes.hashes.get(step)

    def refetch_due(self, step: int) -> bool:
        return self.pending is not None and step >= self.pending[0]

    async def ask_snapshot(self, peer: str, step: int) -> int | None:
        """Ask `peer` to keep its state at `step` (a re-fetch, a backup's warm copy, a group's switch step); its own
        step, or None (no answer, or not asked: this node keeps within the peer's limit on requests)."""
        if not self.pacer.allow(peer, step):
            log.info("not asking %s to keep step %d now: it was asked for other steps too often lately", peer[-8:],
                     step)
            return None
        try:
            ans = await self.call(peer, "run.snapshot_at", step)
        except RpcError as e:
            log.info("snapshot request to %s failed: %s", peer, e)
            return None
        got = ans.get("step") if isinstance(ans, dict) else None
        return got if isinstance(got, int) and not isinstance(got, bool) else None

    async def check(self, group: Group | None) -> None:
        """After a step: if a member published a different hash for a step we hold, vote; a minority replica asks
        every member for a snapshot a few steps ahead and loads the agreed one there (`plan_refetch`, `refetch`)."""
        step = self.replica.at_step
        self.hashes.note_claims(group, self.run_id(), self.services.statuses())
        claims = self.hashes.due_claims()
        if group is None or self.pending is not None or step < self._vote_after or not claims:
            return
        lead = self.config.switch_lead_min_steps
        self._vote_after = step + lead + VOTE_EXTRA_STEPS
        src = await self.hashes.vote(group, claims)
        offenders = self.hashes.take_offenders()
        for peer, why in offenders.items():  # most members' reports evict it (the broker's rule)
            self.services.penalties.penalize(peer, why)
        if offenders:
            self.report(group, sorted(offenders))
        if src is None:
            return
        await self.plan_refetch(group, src, step + lead)

    async def plan_refetch(self, group: Group, src: str, target: int) -> None:
        """Ask every other member of `group` to keep its state at `target` and plan to load the agreed one there
        (`pending`), once most of them, `src` (the member the vote named) among them, are still before `target` and
        so can keep it. When some are past it already, the target moves once ahead of the furthest; failing that,
        the next vote decides again. (A pull resting on fewer than most members' word would stall on a liar alone
        among them: it may say it holds the agreed state and serve another.)"""
        others = [p for p in group.members if p != self.services.peer_id]
        for _ in range(2):
            at = await asked(self.ask_snapshot, others, target)
            kept = [p for p, a in at.items() if a is not None and a < target]  # at the target or past it: too late
            if src in kept and 2 * len(kept) > len(others):
                self.pending = (target, src)
                return
            ahead = max((a for a in at.values() if a is not None), default=None)
            if ahead is None or ahead < target:
                break  # not for lack of time: more waiting cannot help
            target = ahead + self.config.switch_lead_min_steps
        log.info("no re-fetch planned at step %d: too few members can keep it; the next vote decides again", target)

    async def refetch(self, step: int, group: Group | None) -> None:
        """Load the state the group agrees on at `step` (the vote said ours is not it): its members hash their whole
        entry state there, and the one a majority holds is pulled from a random one of them. Given up (the next
        vote decides again) when no majority state can be had, or the member the vote named is gone, and at once
        when none of the members holds that revision or trains toward it (they are all entering or re-fetching
        themselves: waiting, this node not training either, would hold the whole group still)."""
        assert self.pending is not None
        src = self.pending[1]
        self.replica.state = "syncing"
        members = [m for m in (group.members if group is not None else (src,)) if m != self.services.peer_id]
        try:  # planned until the pull ends: meanwhile this node publishes no claim about the step it replaces
            await self.replica.load(await self.pulls.revision(step, members, wanted=lambda: src in self.services.live(),
                                                              gives_up_on=(NobodyHolds, NoSourceLeft)))
        except StateTransferError as e:
            log.warning("could not re-fetch step %d (%s): voting again", step, e)
            return
        finally:
            self.pending = None
        self.refetches += 1
        self.hashes.reloaded(step, self.replica.sync.state_hash())
        log.warning("state hash disagreed with the majority: re-fetched the state the members agree on at step %d",
                    step)

    def voters(self, g: Group) -> set[str]:
        """The members of `g` that can still vote: this node and those its membership view holds live (a member
        killed near the end never answers; waiting for it would only hold the run's end up)."""
        live = self.services.live()
        return {m for m in g.members if m == self.services.peer_id or m in live}

    async def settle_final(self, g: Group, final_rev: int) -> None:
        """The end of the run: make sure this replica ends with the majority's final state (revision `final_rev`,
        already recorded here), loading the state the members agree on when ours is not it."""
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
        others = sorted(voters - {self.services.peer_id})  # the final state the members agree on, from any of them
        try:
            await self.replica.load(await self.pulls.revision(final_rev, others), step=final_rev - 1)
        except StateTransferError as e:
            log.warning("final state hash disagreed with the majority, and no state the members agree on could be "
                        "loaded (%s): this replica ends with its own state", e)
            return
        self.refetches += 1
        self.hashes.record(final_rev, self.replica.sync.state_hash())
        log.warning("final state hash disagreed with the majority: loaded the final state the members agree on")
