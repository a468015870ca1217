"""The one rule for which state hash a stage's replicas follow (PCCL's shared-state parity): a strict majority,
and a deterministic choice for a split that has none (two replicas with two hashes), so every group size agrees."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping


def agreed(votes: Mapping[str, str], group_size: int) -> str | None:
    """The hash a group of `group_size` members follows, from the members' hashes at one revision (`votes`: peer ->
    hash, every one read at that same revision).

    A hash more than half of the group holds wins (members that did not vote count against every hash). When every
    member voted and none holds such a majority (a split: 1:1 of two replicas, 2:2 of four), the most held hash wins,
    the lowest of those on a tie: every member computes the same choice from the same votes, so the split ends.
    None: no majority yet, and some members have not voted."""
    if not votes:
        return None
    counts = Counter(votes.values())
    top, n = min(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    return top if n > group_size // 2 or len(votes) >= group_size else None


def holder(votes: Mapping[str, str], state_hash: str) -> str:
    """The peer to pull `state_hash` from: the first, in peer-id order, of those that hold it."""
    return min(p for p, h in votes.items() if h == state_hash)
