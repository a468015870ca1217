"""Which messages a node's collective takes: from members of a group epoch it knows, under that group's tags."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from shoal.protocol.assignment import AssignmentTable


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
        known = False
        for t in self.tables():
            if stage < t.stages and t.epochs[stage] == epoch:
                known = True
                if peer in t.group_members(stage):
                    return None
        if known:
            return Refusal(why=f"not a member of stage {stage}'s group at epoch {epoch}", penalize=True)
        return Refusal(why=f"stage {stage} epoch {epoch} is unknown here", penalize=False)
