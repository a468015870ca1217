"""The one majority rule over replicas' state hashes (PCCL's shared-state parity): which state a replica follows."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping


def majority(votes: Mapping[str, str], group_size: int) -> str | None:
    """The hash more than half of a group of `group_size` members holds (members that did not vote count against
    every hash), or None when no hash has a strict majority."""
    if not votes:
        return None
    counts = Counter(votes.values())
    top, n = min(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    return top if n > group_size // 2 else None


def holder(votes: Mapping[str, str], state_hash: str) -> str:
    """The peer to pull `state_hash` from: the first, in peer-id order, of those that hold it."""
    return min(p for p, h in votes.items() if h == state_hash)
