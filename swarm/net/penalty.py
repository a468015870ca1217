"""Misbehaving peers: count violations, ban with capped exponential backoff, forgive slowly."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class PenaltyConfig:
    strikes_before_ban: int = 3  # violations tolerated (logged and rejected) before the first ban
    ban_base_s: float = 10.0
    ban_max_s: float = 600.0
    forget_after_s: float = 300.0  # a peer with no violation for this long starts afresh

    def __post_init__(self) -> None:
        if self.strikes_before_ban < 1 or not 0 < self.ban_base_s <= self.ban_max_s:
            raise ValueError("need strikes_before_ban >= 1 and 0 < ban_base_s <= ban_max_s")


@dataclass(slots=True)
class _Record:
    strikes: int = 0
    bans: int = 0
    banned_until: float = 0.0
    last_violation: float = 0.0
    reasons: list[str] = field(default_factory=list)


class Penalties:
    """Per-peer violation ledger. `penalize` returns True when the call put the peer under a (new) ban."""

    def __init__(self, config: PenaltyConfig = PenaltyConfig(), clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.clock = clock
        self._peers: dict[str, _Record] = {}
        self.total = 0  # violations recorded since the start (every peer), for metrics
        self.bans_total = 0

    def penalize(self, peer_id: str, reason: str) -> bool:
        now = self.clock()
        self.total += 1
        r = self._peers.setdefault(peer_id, _Record())
        if r.last_violation and now - r.last_violation > self.config.forget_after_s:
            r.strikes = 0
        r.strikes += 1
        r.last_violation = now
        r.reasons = (r.reasons + [reason])[-5:]
        log.warning("peer %s violation %d: %s", peer_id, r.strikes, reason)
        if r.strikes >= self.config.strikes_before_ban and now >= r.banned_until:
            duration = min(self.config.ban_base_s * 2**r.bans, self.config.ban_max_s)
            r.bans += 1
            self.bans_total += 1
            r.strikes = 0
            r.banned_until = now + duration
            log.warning("peer %s banned for %.0f s (ban #%d)", peer_id, duration, r.bans)
            return True
        return False

    def ban(self, peer_id: str, reason: str) -> None:
        """Ban now, whatever the strike count (the next ban of the same peer lasts twice as long, up to the cap)."""
        r = self._peers.setdefault(peer_id, _Record())
        now = self.clock()
        duration = min(self.config.ban_base_s * 2**r.bans, self.config.ban_max_s)
        r.bans, r.strikes, r.last_violation = r.bans + 1, 0, now
        self.bans_total += 1
        r.banned_until = max(r.banned_until, now + duration)
        r.reasons = (r.reasons + [reason])[-5:]
        log.warning("peer %s banned for %.0f s (ban #%d): %s", peer_id, duration, r.bans, reason)

    def is_banned(self, peer_id: str) -> bool:
        r = self._peers.get(peer_id)
        return r is not None and self.clock() < r.banned_until

    def ban_remaining_s(self, peer_id: str) -> float:
        r = self._peers.get(peer_id)
        return max(0.0, r.banned_until - self.clock()) if r else 0.0

    def strikes(self, peer_id: str) -> int:
        """Violations since the peer's last ban (or since they were forgotten)."""
        r = self._peers.get(peer_id)
        return 0 if r is None else r.strikes

    def reasons(self, peer_id: str) -> list[str]:
        r = self._peers.get(peer_id)
        return list(r.reasons) if r else []


class Allowance:
    """A few unpunished refusals per peer within a window: what an honest race looks like (a peer acting on a table
    this node has not received yet). `take(peer)` is True while the peer is within its allowance; past it, the
    caller treats the next ones as offences."""

    MAX_PEERS = 1024  # peers remembered at once (those quiet for a window are forgotten first)

    def __init__(self, free: int, window_s: float, clock: Callable[[], float] = time.monotonic):
        if free < 0 or window_s <= 0:
            raise ValueError("need free >= 0 and window_s > 0")
        self.free, self.window_s, self.clock = free, window_s, clock
        self._used: dict[str, list[float]] = {}

    def take(self, peer_id: str) -> bool:
        now = self.clock()
        recent = [t for t in self._used.get(peer_id, ()) if now - t < self.window_s]
        if len(recent) >= self.free:
            self._used[peer_id] = recent
            return False
        self._used[peer_id] = recent + [now]
        if len(self._used) > self.MAX_PEERS:
            self._used = {p: ts for p, ts in self._used.items() if ts and now - ts[-1] < self.window_s}
        return True
