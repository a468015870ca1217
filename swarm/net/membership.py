"""The membership view: which peers are live, from their announcements, status records and leave notices."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from shoal.protocol.envelope import Signed, open_envelope
from shoal.protocol.errors import ProtocolError
from shoal.protocol.kinds import RECORD_TYPES
from shoal.protocol.records import Announcement, LeaveNotice, StatusRecord
from shoal.swarm.net.pulse import Pulse

ALIVE, SUSPECT, GONE, LEFT = "alive", "suspect", "gone", "left"
MAX_MEMBERS_ROWS = 1024
MAX_RELAYED_AGE_S = 3600.0
MAX_CLOCK_OFFSET_S = 5.0  # how far a record signer's wall clock may be ahead of ours (as a broker's lease assumes)


@dataclass(frozen=True, kw_only=True, slots=True)
class MembershipConfig:
    suspect_after_s: float = 6.0  # ~3 missed status intervals
    gone_after_s: float = 12.0
    forget_after_s: float = 600.0  # gone/left entries are dropped from the view after this long

    def __post_init__(self) -> None:
        if not 0 < self.suspect_after_s <= self.gone_after_s <= self.forget_after_s:
            raise ValueError("need 0 < suspect_after_s <= gone_after_s <= forget_after_s")


@dataclass(slots=True)
class PeerEntry:
    peer_id: str
    first_seen: float
    last_seen: float
    state: str = ALIVE
    announcement: Signed | None = None
    status: Signed | None = None
    left_at_unix: float = 0.0

    @property
    def live(self) -> bool:
        return self.state in (ALIVE, SUSPECT)

    @property
    def status_record(self) -> StatusRecord | None:
        rec = self.status.record if self.status else None
        return rec if isinstance(rec, StatusRecord) else None

    @property
    def announcement_record(self) -> Announcement | None:
        rec = self.announcement.record if self.announcement else None
        return rec if isinstance(rec, Announcement) else None


@dataclass(frozen=True, slots=True)
class Event:
    kind: str  # "join" | "gone" | "left" | "back"
    peer_id: str
    detail: str = ""


class Membership:
    def __init__(self, self_id: str, config: MembershipConfig = MembershipConfig(),
                 clock: Callable[[], float] = time.monotonic, pulse: Pulse | None = None):
        self.self_id = self_id
        self.config = config
        self.clock = clock
        self.pulse = pulse  # silence is counted from the end of this process's own last freeze (same clock)
        self.peers: dict[str, PeerEntry] = {}

    def observe(self, signed: Signed, *, age_s: float = 0.0) -> list[Event]:
        """Ingest a verified record (`age_s`: how long ago a relaying peer last heard from it)."""
        rec = signed.record
        pid = rec.peer_id
        if pid == self.self_id:
            return []
        seen_at = self.clock() - max(0.0, age_s)
        e = self.peers.get(pid)
        events: list[Event] = []
        if isinstance(rec, LeaveNotice):
            if e is not None and e.state != LEFT:
                e.state, e.left_at_unix = LEFT, rec.time
                events.append(Event("left", pid, rec.reason))
            return events
        if e is None:
            e = self.peers[pid] = PeerEntry(pid, first_seen=seen_at, last_seen=seen_at)
            events.append(Event("join", pid))
        elif isinstance(rec, StatusRecord) and e.state == LEFT and rec.time <= e.left_at_unix:
            return []  # a status sent before the leave notice, delivered late
        if isinstance(rec, StatusRecord):
            status = e.status_record
            if status is not None and rec.seq <= status.seq:
                return events
            e.status = signed
        elif isinstance(rec, Announcement):
            old = e.announcement_record
            if old is not None and (rec.started_at, rec.revision) < (old.started_at, old.revision):
                return events
            e.announcement = signed
        if seen_at > e.last_seen or not e.live:
            e.last_seen = max(e.last_seen, seen_at)
        if not e.live and self.clock() - e.last_seen < self.config.gone_after_s:
            e.state = ALIVE
            events.append(Event("back", pid))
        elif e.state == SUSPECT and self.clock() - e.last_seen < self.config.suspect_after_s:
            e.state = ALIVE
        return events

    def sweep(self) -> list[Event]:
        """Mark silent peers suspect, then gone; forget long-dead entries."""
        now = self.clock()
        events = []
        for pid, e in list(self.peers.items()):
            silent = self.pulse.silent_s(e.last_seen) if self.pulse is not None else now - e.last_seen
            if e.live and silent > self.config.gone_after_s:
                e.state = GONE
                events.append(Event("gone", pid, f"silent for {silent:.1f} s"))
            elif e.state == ALIVE and silent > self.config.suspect_after_s:
                e.state = SUSPECT
            elif not e.live and silent > self.config.forget_after_s:
                del self.peers[pid]
        return events

    def live_peers(self) -> list[PeerEntry]:
        return sorted((e for e in self.peers.values() if e.live), key=lambda e: e.peer_id)

    def age_s(self, e: PeerEntry) -> float:
        return max(0.0, self.clock() - e.last_seen)


def verified_members(rows: object, penalize: Callable[[str], object],
                     wall: Callable[[], float] = time.time) -> list[tuple[Signed, float]]:
    """The verified (record, age_s) pairs of a `members` reply: rows of [announcement, status, age_s].

    The relaying peer's age can only make a row older than its records say, never fresher: a row is at least as old
    as its status record's signed time (less MAX_CLOCK_OFFSET_S for the signer's clock), and a row without a status
    proves no freshness at all (MAX_RELAYED_AGE_S). So long-dead records cannot be served as live.
    A reply that is not a bounded list, and every malformed row or record, calls `penalize(reason)`."""
    if not isinstance(rows, list) or len(rows) > MAX_MEMBERS_ROWS:
        penalize("members reply is not a bounded list")
        return []
    out = []
    for row in rows:
        if not isinstance(row, list) or len(row) != 3 or isinstance(row[2], bool) \
                or not isinstance(row[2], (int, float)):
            penalize("members row must be [announcement, status, age_s]")
            continue
        records = []
        for raw in row[:2]:
            if raw is None:
                continue
            try:
                records.append(open_envelope(raw, RECORD_TYPES))
            except ProtocolError as e:
                penalize(f"bad members row: {e}")
        if len({r.record.peer_id for r in records}) > 1:
            penalize("members row mixes the records of two peers")
            continue
        status = [r.record for r in records if isinstance(r.record, StatusRecord)]
        floor = wall() - status[0].time - MAX_CLOCK_OFFSET_S if status else MAX_RELAYED_AGE_S
        age = min(max(float(row[2]), floor, 0.0), MAX_RELAYED_AGE_S)
        out += [(r, age) for r in records]
    return out
