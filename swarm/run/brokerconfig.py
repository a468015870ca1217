"""The broker's settings: liveness and failure timeouts, the lease, stragglers, lanes, admission, the batch split."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from shoal.swarm.net.host import RECONNECT_GRACE_S
from shoal.swarm.run.batchsplit import SplitConfig
from shoal.swarm.run.gate import AdmissionLimits


@dataclass(frozen=True, kw_only=True, slots=True)
class BrokerConfig:
    heartbeat_s: float = 5.0  # how often liveness is checked (status gossip and RPC contact are the beats)
    suspect_after_beats: int = 3
    fail_after_s: float = 30.0  # silent this long: failed, its slot goes to a backup
    lease_renew_s: float = 3.0
    lease_timeout_s: float = 15.0  # a lease not renewed for this long lets the standby take over
    republish_s: float = 10.0  # the table is re-gossiped this often even when nothing changed
    ping_timeout_s: float = 2.0  # checking a member reported missing, or whose connections closed
    # a provider whose last connection to the broker closed and is not back within this long is pinged (a process
    # that died closes its connections at once: swarm/run/closes.py)
    reconnect_grace_s: float = RECONNECT_GRACE_S
    straggler_misses: int = 3  # a member that misses rounds (yet answers) this often within the window ...
    straggler_window_s: float = 600.0
    demote_hold_s: float = 300.0  # ... is moved to the backup pool, and not promoted again for this long
    # a member's step this far behind the others' (its own signed status) is the broker's own evidence that it
    # lags; reports of a missed round wait this long for the other members' before they are weighed
    straggler_lag_steps: int = 2
    corroborate_s: float = 1.0
    dht_timeout_s: float = 5.0
    # the table's DHT copy (a fallback for finding the broker and its standby) is rewritten at most this often: each
    # put stores the whole table on ~20 peers, ~770 KB/s from the broker at 1,000 providers if done on every change
    dht_table_s: float = 30.0
    # a pipeline lane with a slot empty this long and no backup of that stage to fill it is dissolved: its
    # members return to the backup pool (each keeping its stage warm)
    dissolve_after_s: float = 60.0
    admission: AdmissionLimits = field(default_factory=AdmissionLimits)  # wrong join-secret proofs checked
    split: SplitConfig = SplitConfig()  # the global batch across the lanes, by their speed

    def __post_init__(self) -> None:
        if not 0 < self.heartbeat_s <= self.fail_after_s:
            raise ValueError("need 0 < heartbeat_s <= fail_after_s")
        if not 0 < self.lease_renew_s < self.lease_timeout_s:
            raise ValueError("need 0 < lease_renew_s < lease_timeout_s")
        if self.suspect_after_beats < 1 or min(self.republish_s, self.ping_timeout_s, self.dht_timeout_s,
                                                   self.reconnect_grace_s) <= 0:
            raise ValueError("suspect_after_beats >= 1 and positive intervals are required")
        if self.dht_table_s < 0:
            raise ValueError("dht_table_s must not be negative")
        if self.dissolve_after_s <= 0:
            raise ValueError("dissolve_after_s must be positive")
        if self.straggler_misses < 1 or self.straggler_window_s <= 0 or self.demote_hold_s < 0:
            raise ValueError("straggler_misses >= 1, straggler_window_s > 0 and demote_hold_s >= 0 are required")
        if self.straggler_lag_steps < 1 or self.corroborate_s < 0:
            raise ValueError("straggler_lag_steps >= 1 and corroborate_s >= 0 are required")

    @classmethod
    def for_fail_after(cls, fail_after_s: float, **more: Any) -> BrokerConfig:
        """Settings scaled to one failure-detection time: the lease lapses after it too, liveness is checked three
        times within it (never less often than the default) and the lease renewed four times (each renewal is
        gossiped and put in the DHT: no more often than that)."""
        d = cls()
        return cls(fail_after_s=fail_after_s, lease_timeout_s=fail_after_s,
                   heartbeat_s=min(d.heartbeat_s, fail_after_s / 3), lease_renew_s=fail_after_s / 4, **more)
