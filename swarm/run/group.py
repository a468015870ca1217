"""A data-parallel group as one round sees it: a fixed, ordered member list under an epoch number."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True, slots=True)
class Group:
    """Membership changes only between rounds, and every change bumps `epoch`.

    `members` are the peer ids of the active replicas of one stage, sorted, so every member derives the same
    chunk ownership (member i serves chunk i) without talking. `entering`: the members that were not in the
    stage's group before this epoch: they pull the group's state before their first round, which waits longer for
    them (docs/architecture.md, "Entering a group").
    """

    run_id: str
    stage: int = 0
    epoch: int
    members: tuple[str, ...]
    me: str
    # weights[i]: the sequences members[i]'s lane computes per step (its share of the global batch): aggregation
    # weighs each member's contribution by it; empty: all equal
    weights: tuple[int, ...] = ()
    entering: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        if tuple(sorted(set(self.members))) != self.members:
            raise ValueError("group members must be sorted and unique")
        if self.weights and (len(self.weights) != len(self.members) or min(self.weights) < 1):
            raise ValueError("one positive weight per member")
        if self.me not in self.members:
            raise ValueError("this node is not a member of the group")
        if self.epoch < 0:
            raise ValueError("epoch must be >= 0")

    @property
    def size(self) -> int:
        return len(self.members)

    @property
    def rank(self) -> int:
        return self.members.index(self.me)

    def weight(self, member: str) -> int:
        """`member`'s weight in the group's aggregation (1 each when the group has none)."""
        return self.weights[self.members.index(member)] if self.weights else 1

    @property
    def even(self) -> bool:
        """Whether every member weighs the same (the plain mean is the weighted one)."""
        return len(set(self.weights)) <= 1

    def tag(self, round_: int, phase: str) -> str:
        return f"{self.epoch_tag()}{round_}/{phase}"

    def epoch_tag(self) -> str:
        """What every round tag of this group epoch starts with."""
        return f"{self.run_id[:16]}/{self.stage}/{self.epoch}/"
