"""Consistency of a stage's replicas: this node's state hash per step, and the vote that brings a replica that
drifted from the group's agreed state back to it (PCCL's bit-parity, over RPC; the rule is swarm/state/vote.py)."""

from __future__ import annotations

import logging
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

Call = Callable[[str, str, Any], Awaitable[Any]]  # (peer, method, body) -> answer; raises RpcError


class HashVotes:
    """Owned by the event loop. `record` each step's hash; `disagrees` reads peers' published hashes; `vote` asks
    the group at a recent step and names a peer to re-fetch from when ours is not the agreed hash."""

    def __init__(self, me: str, call: Call, *, keep: int = HASHES_KEPT):
        self.me = me
        self.call = call
        self.keep = keep
        self.hashes: dict[int, str] = {}
        self.votes = 0  # votes held after a peer's published hash differed from ours

    def record(self, step: int, state_hash: str) -> None:
        self.hashes[step] = state_hash
        for old in sorted(self.hashes)[:-self.keep]:
            del self.hashes[old]

    def forget_after(self, step: int) -> None:
        """The run rolled back to `step`: the hashes of later steps will be recorded again."""
        for s in [s for s in self.hashes if s > step]:
            del self.hashes[s]

    def newest(self) -> int | None:
        return max(self.hashes) if self.hashes else None

    def disagrees(self, group: Group | None, run_id: str, statuses: Iterable[tuple[str, StatusRecord]]) -> bool:
        """A member of our group published, for a step we still hold, a state hash other than ours."""
        if group is None or group.size < MIN_VOTERS:
            return False
        for peer, st in statuses:
            if (peer in group.members and st.run_id == run_id and st.state_hash and st.state != "done"
                    and st.step in self.hashes and st.state_hash != self.hashes[st.step]):
                return True
        return False

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

    async def vote(self, group: Group | None) -> str | None:
        """Vote at one recent step every member holds (members run in lockstep, within a step of each other).
        A member that answers that it holds no state at that step (one still entering the group, or that entered
        later) has no say: counting it against every hash would leave two members that differ undecided for as
        long as it cannot enter, and it cannot enter while they differ (an entry loads only what a majority of
        its sources hold)."""
        if group is None or group.size < MIN_VOTERS or not self.hashes:
            return None
        step = max(self.hashes) - VOTE_LAG_STEPS
        if step not in self.hashes:
            return None
        votes, abstained = await self.gather(group, step)
        return self.source(group, step, votes, voters=group.size - len(abstained))

    async def rpc_hash_at(self, caller: str, body: Any) -> Any:
        if not isinstance(body, int) or isinstance(body, bool) or body < 0:
            raise ValueError("hash_at takes a step number")
        return {"hash": self.hashes.get(body)}
