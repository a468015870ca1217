"""Placement by reachability: who takes the roles others must dial, and which providers can share a group.

Pure functions over what providers announced (`protocol.records.REACHABILITY`). A role that others dial (chunk
owner, state server, stage neighbour) goes to the most reachable provider first: public, then LAN, then not yet
known, then relayed, then unreachable. A data-parallel group exchanges between every pair of members, so a group
may hold two NATed members only if a hole punch can join them; one whose punches failed fits only with members
that it can dial itself (public ones, or ones on its own network).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

DIAL_RANK = {"public": 0, "lan": 1, "unknown": 2, "relayed": 3, "unreachable": 4}
BEHIND_NAT = frozenset({"relayed", "unreachable"})


@dataclass(frozen=True, kw_only=True, slots=True)
class Reach:
    reachability: str = "unknown"
    network: str = ""  # peers with the same non-empty network (e.g. one home's public IP) dial each other directly
    punchable: bool = True  # False once hole punches to or from this provider have failed

    def __post_init__(self) -> None:
        if self.reachability not in DIAL_RANK:
            raise ValueError(f"unknown reachability {self.reachability!r}")


def dial_rank(r: Reach) -> tuple[int, int]:
    """Lower is easier to dial; among NATed providers, punchable ones first."""
    return DIAL_RANK[r.reachability], 0 if r.punchable else 1


def direct_possible(a: Reach, b: Reach) -> bool:
    """Can two providers get a direct connection (dialing one another, or by a hole punch)?"""
    if "public" in (a.reachability, b.reachability):
        return True  # the other one dials it
    if a.network and a.network == b.network:
        return True
    if a.reachability not in BEHIND_NAT and b.reachability not in BEHIND_NAT:
        return True  # LAN or not yet probed on both sides: one network, as far as anyone knows
    return a.punchable and b.punchable


def rank_for_dialed_roles(order: Sequence[str], reach: Mapping[str, Reach]) -> list[str]:
    """`order` (the broker's preference) re-ranked so the easiest to dial come first; ties keep their order."""
    return sorted(order, key=lambda p: dial_rank(reach.get(p, Reach())))


def place_group(candidates: Sequence[str], reach: Mapping[str, Reach], size: int,
                members: Sequence[str] = ()) -> list[str]:
    """Fill a group of `size` from `candidates` (in the broker's order), starting from `members` (who already hold
    slots): the most reachable first, each only if it can get a direct connection to every member chosen so
    far. Returns the whole group, at most `size` long; candidates that fit nowhere are left out (backups)."""
    if size < 0:
        raise ValueError("size must be >= 0")
    group = list(members)[:size]
    for p in rank_for_dialed_roles([c for c in candidates if c not in group], reach):
        if len(group) >= size:
            break
        rp = reach.get(p, Reach())
        if all(direct_possible(rp, reach.get(m, Reach())) for m in group):
            group.append(p)
    return group
