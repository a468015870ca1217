"""Another live node with this node's identity, seen from the swarm: the one that joins second refuses to go on.

A key file copied to a second machine (or a second path) is not caught by the local lock. When a node joins, it
asks the joined peers for their view of its own peer id twice, a few status periods apart: a status record that
moved on between the two is another process signing with this key right now (a node that ran with this identity
before and died sends nothing new, so a restart is not refused)."""

from __future__ import annotations

from dataclasses import dataclass

from shoal.protocol.envelope import Signed
from shoal.protocol.records import Announcement, StatusRecord


class TwinDetected(RuntimeError):
    """Another live node in the swarm holds this node's identity."""


@dataclass(frozen=True, kw_only=True, slots=True)
class OwnRecords:
    """What one peer's members snapshot says about this node's own peer id."""

    started_at: float | None = None  # the announcement's start time
    status_seq: int | None = None  # the newest status record's sequence number

    @staticmethod
    def of(records: list[Signed], peer_id: str) -> OwnRecords:
        started, seq = None, None
        for signed in records:
            rec = signed.record
            if rec.peer_id != peer_id:
                continue
            if isinstance(rec, Announcement):
                started = rec.started_at
            elif isinstance(rec, StatusRecord):
                seq = rec.seq if seq is None else max(seq, rec.seq)
        return OwnRecords(started_at=started, status_seq=seq)

    @property
    def seen(self) -> bool:
        return self.started_at is not None or self.status_seq is not None


def twin_alive(before: OwnRecords, after: OwnRecords, my_started_at: float) -> bool:
    """Whether the two views, taken before this node published anything, show another live holder of the key: its
    status moved on in between (or it announced a start other than ours that is newer than the first view's)."""
    if after.status_seq is not None and before.status_seq is not None and after.status_seq > before.status_seq:
        return True
    return (after.started_at is not None and after.started_at != my_started_at
            and before.started_at is not None and after.started_at > before.started_at)


def refusal(peer_id: str, via: str) -> TwinDetected:
    return TwinDetected(f"another node in the swarm runs with this identity ({peer_id}; seen by {via[-8:]}): "
                        f"two nodes must not share a key")
