"""Consistency of a stage's replicas: this node's state hash per step, and the vote that brings a replica that
drifted from the group's agreed state back to it (PCCL's bit-parity, over RPC; the rule is swarm/state/vote.py).

A member's published hash (its signed status record) is a claim it must stand by: a vote is held at the step a
claim names, and a member that answers the vote otherwise than it published is lying. A member the vote leaves
in the minority must re-fetch the agreed state: its claims start no new vote for a grace of steps, and one still
off the agreed state after that (a second lost vote) is an offender. Offenders are penalized and reported by the
runtime, and their claims start no vote at all (one member's published lies cannot keep the group voting)."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import trio

from shoal.protocol.records import StatusRecord
from shoal.swarm.net.rpc import RpcError
from shoal.swarm.run.group import Group
from shoal.swarm.state.snapshot import HASH_CHARS
from shoal.swarm.state.vote import agreed, holder

log = logging.getLogger(__name__)

HASHES_KEPT = 64  # steps whose hash this node can still tell a voter
VOTE_LAG_STEPS = 2  # a vote is held at this many steps before our newest (every member of a lockstep group holds it)
MIN_VOTERS = 2  # a group of one has nobody to differ from (two that differ agree by the rule for a split)
LOSSES_TO_OFFEND = 2  # votes a member may lose, a grace apart, before it counts as an offender

Call = Callable[[str, str, Any], Awaitable[Any]]  # (peer, method, body) -> answer; raises RpcError


class HashVotes:
    """Owned by the event loop. `record` each step's hash; `note_claims` reads peers' published hashes and
    `due_claims` says which a vote can settle; `vote` asks the group at that step, names a peer to re-fetch from
    when ours is not the agreed hash, and finds the members that lie (`take_offenders`)."""

    def __init__(self, me: str, call: Call, *, keep: int = HASHES_KEPT, grace_steps: int = 8):
        self.me = me
        self.call = call
        self.keep = keep
        self.grace_steps = grace_steps  # a member that lost a vote has this long to re-fetch the agreed state
        self.hashes: dict[int, str] = {}
        self.votes = 0  # votes held after a peer's published hash differed from ours
        self._lost: dict[str, tuple[int, int]] = {}  # member -> (votes lost, step until which it may still differ)
        self.offenders: dict[str, str] = {}  # member -> why it counts as lying (cleared by `take_offenders`)
        self._offended: set[str] = set()  # members found lying: their claims start no vote
        self._pending: dict[str, tuple[int, str]] = {}  # member -> (step, hash) it published, not yet voted on
        self.claimants: Counter[str] = Counter()  # votes each member's published hash started

    def record(self, step: int, state_hash: str) -> None:
        self.hashes[step] = state_hash
        for old in sorted(self.hashes)[:-self.keep]:
            del self.hashes[old]

    def forget_after(self, step: int) -> None:
        """The run rolled back to `step`: the hashes of later steps will be recorded again."""
        for s in [s for s in self.hashes if s > step]:
            del self.hashes[s]

    def reloaded(self, step: int, state_hash: str) -> None:
        """This node loaded the state the group agrees on at `step` (a re-fetch): that is its hash there now, and the
        states it held before are gone (asked about them it holds none, and has no say); claims noted against them
        go at the next `note_claims`, as any claim about a step no longer held (a vote about them would only
        re-fetch again)."""
        for s in [s for s in self.hashes if s < step]:
            del self.hashes[s]
        self.hashes[step] = state_hash

    def newest(self) -> int | None:
        return max(self.hashes) if self.hashes else None

    def note_claims(self, group: Group | None, run_id: str, statuses: Iterable[tuple[str, StatusRecord]]) -> None:
        """Remember members of our group that published, for a step we still hold, a state hash other than ours
        (the first such claim of each, until a vote settles it). A member given a grace to re-fetch, or found
        lying, is left out; one that lost a vote and now publishes our hash is back on the agreed state."""
        self._pending = {p: c for p, c in self._pending.items() if c[0] in self.hashes}
        if group is None or group.size < MIN_VOTERS:
            return
        for peer, st in statuses:
            if (peer in self._lost and st.run_id == run_id and st.step in self.hashes
                    and st.state_hash == self.hashes[st.step] and st.step > self._lost[peer][1] - self.grace_steps):
                del self._lost[peer]  # its claim after the loss matches ours: back on the agreed state, as a vote
                #                       it won would show (both are its word); a later drift starts afresh
            if (peer in group.members and peer not in self._pending and st.run_id == run_id and st.state_hash
                    and st.state != "done" and st.step in self.hashes and st.state_hash != self.hashes[st.step]
                    and peer not in self._offended and st.step > self._lost.get(peer, (0, -1))[1]):
                self._pending[peer] = (st.step, st.state_hash)

    def due_claims(self) -> dict[str, tuple[int, str]]:
        """The remembered claims a vote can settle now: at steps every member of a lockstep group holds."""
        if not self.hashes:
            return {}
        newest = max(self.hashes) - VOTE_LAG_STEPS
        return {p: c for p, c in self._pending.items() if c[0] <= newest}

    def take_offenders(self) -> dict[str, str]:
        out, self.offenders = self.offenders, {}
        return out

    def _judge(self, step: int, votes: dict[str, str], agreed_hash: str | None, size: int,
               claims: dict[str, tuple[int, str]]) -> None:
        """After a vote at `step`: a claimant whose vote is not the hash it published for that step is lying; a
        member whose vote is not the agreed hash lost (a second loss after its grace: an offender)."""
        for peer, (at, claimed) in claims.items():
            if at == step and peer in votes and votes[peer] != claimed:
                self._offend(peer, f"published state hash {claimed[:12]} for step {step} and voted {votes[peer][:12]}")
        if agreed_hash is None or 2 * sum(h == agreed_hash for h in votes.values()) <= size:
            return  # no strict majority (a split settled by the rule): nobody is shown to be off it
        for peer, h in votes.items():
            if peer == self.me or h == agreed_hash or peer in self._offended:
                continue
            lost, until = self._lost.get(peer, (0, -1))
            if lost and step <= until:
                continue  # a step within the grace its lost vote gave it (or before): the same loss, not a second
            self._lost[peer] = (lost + 1, step + self.grace_steps)
            if lost + 1 >= LOSSES_TO_OFFEND:
                self._offend(peer, f"still off the group's agreed state at step {step} after losing {lost} vote(s)")
        for peer in [p for p, h in votes.items() if h == agreed_hash]:
            self._lost.pop(peer, None)  # it re-fetched: a later drift starts afresh

    def _offend(self, peer: str, why: str) -> None:
        self._offended.add(peer)
        self.offenders[peer] = f"hash vote: {why}"
        log.warning("hash vote: %s %s", peer, why)

    async def gather(self, group: Group, step: int) -> tuple[dict[str, str], set[str]]:
        """Every member's state hash at `step` (ours included; members that do not hold it yet are absent), and
        the members that answered that they hold none."""
        votes, abstained = {self.me: self.hashes[step]}, set()

        async def ask(peer: str) -> None:
            try:
                ans = await self.call(peer, "run.hash_at", step)
            except RpcError as e:
                log.info("hash vote: %s did not answer: %s", peer, e)
                return
            h = ans.get("hash") if isinstance(ans, dict) else None
            if isinstance(h, str) and 0 < len(h) <= 2 * HASH_CHARS:
                votes[peer] = h
            elif isinstance(ans, dict) and "hash" in ans and h is None:
                abstained.add(peer)

        async with trio.open_nursery() as n:
            for peer in group.members:
                if peer != self.me:
                    n.start_soon(ask, peer)
        return votes, abstained

    def source(self, group: Group, step: int, votes: dict[str, str], *, voters: int | None = None) -> str | None:
        """A peer holding the agreed hash at `step`, when ours is not it (None: we hold it, or none is agreed yet).
        `voters`: how many members can still vote (default: the whole group; fewer at the end of a run, when a
        member that is gone will never answer)."""
        self.votes += 1
        size = group.size if voters is None else voters
        top = agreed(votes, size)
        mine = votes[self.me]
        log.info("hash vote at step %d: %s, %d of %d members voted (ours %s)", step,
                 f"agreed on {top[:12]}" if top else "nothing agreed", len(votes), size, mine[:12])
        if top is None or top == mine:
            return None
        return holder(votes, top)

    async def vote(self, group: Group | None, claims: dict[str, tuple[int, str]] | None = None) -> str | None:
        """Vote at one recent step every member holds (members run in lockstep, within a step of each other): the
        step the newest of `claims` (`due_claims`) names, else VOTE_LAG_STEPS before our newest. Returns a
        member to re-fetch the agreed state from when ours is not it (None: ours is, or none is agreed yet);
        members found lying go to `offenders`.
        A member that answers that it holds no state at that step (one still entering the group, or that entered
        later) has no say: counting it against every hash would leave two members that differ undecided for as
        long as it cannot enter, and it cannot enter while they differ (an entry loads only what a majority of
        its sources hold)."""
        if group is None or group.size < MIN_VOTERS or not self.hashes:
            return None
        claims = claims or {}
        named = max((at for at, _ in claims.values() if at in self.hashes), default=None)
        step = named if named is not None else max(self.hashes) - VOTE_LAG_STEPS
        if step not in self.hashes:
            return None
        for peer in claims:
            self._pending.pop(peer, None)
            self.claimants[peer] += 1
        votes, abstained = await self.gather(group, step)
        size = group.size - len(abstained)
        src = self.source(group, step, votes, voters=size)
        self._judge(step, votes, agreed(votes, size), size, claims)
        return src

    async def rpc_hash_at(self, caller: str, body: Any) -> Any:
        if not isinstance(body, int) or isinstance(body, bool) or body < 0:
            raise ValueError("hash_at takes a step number")
        return {"hash": self.hashes.get(body)}
