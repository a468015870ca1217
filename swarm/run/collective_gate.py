"""Which messages a node's collective takes: from members of a group epoch it knows, under that group's tags."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from shoal.protocol.assignment import GONE, AssignmentTable

EPOCHS_AHEAD = 4  # a provider's messages under an epoch this far past the newest known are kept for it


@dataclass(frozen=True, kw_only=True, slots=True)
class Refusal:
    why: str
    penalize: bool  # False: maybe an honest race (a group epoch this node has not heard of yet): dropped only


class CollectiveGate:
    """`gate(peer, tag)`: None to take the message, else a Refusal. A round's tag names the run, the stage and the
    group epoch (Group.tag); the sender must be a member of that stage's group at that epoch in one of the tables
    this node follows (tables are signed by the run's authorised broker). A tag of another run, or from a peer that
    is no member of a known epoch, is an offence; an epoch newer than any this node knows is dropped unpunished (the
    table naming it may still be on its way)."""

    def __init__(self, run_id: str, tables: Callable[[], Sequence[AssignmentTable]]):
        self.prefix = run_id[:16]
        self.tables = tables

    def __call__(self, peer: str, tag: str) -> Refusal | None:
        parts = tag.split("/")
        if len(parts) < 5 or parts[0] != self.prefix:
            return Refusal(why=f"tag {tag[:60]!r} is not one of this run's rounds", penalize=True)
        try:
            stage, epoch, round_ = int(parts[1]), int(parts[2]), int(parts[3])
        except ValueError:
            return Refusal(why=f"malformed round tag {tag[:60]!r}", penalize=True)
        if min(stage, epoch, round_) < 0:
            return Refusal(why=f"malformed round tag {tag[:60]!r}", penalize=True)
        known, newest, tables = False, -1, list(self.tables())
        for t in tables:
            if stage < t.stages:
                newest = max(newest, t.epochs[stage])
                if t.epochs[stage] == epoch:
                    known = True
                    if peer in t.group_members(stage):
                        return None
        if known:
            return Refusal(why=f"not a member of stage {stage}'s group at epoch {epoch}", penalize=True)
        # a group this node has not heard of yet (its table is on its way): taken into the bounded inbox from a
        # provider of the run (a backup just promoted sends under the new epoch), a few epochs ahead at most
        latest = tables[-1] if tables else None
        if latest is not None and newest < epoch <= newest + EPOCHS_AHEAD and \
                latest.provider_state(peer) not in (None, GONE):
            return None
        return Refusal(why=f"stage {stage} epoch {epoch} is unknown here", penalize=False)
