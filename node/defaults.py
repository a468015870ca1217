"""Defaults the command line and the run runtime share, in one place (importing this costs nothing: no torch)."""

from __future__ import annotations

ROUND_TIMEOUT_S = 20.0  # one exchange phase of a synchronization round
FAIL_AFTER_S = 30.0  # an active node (or the broker) silent this long is replaced
BACKUP_REFRESH_S = 30.0  # a backup refreshes its warm copy of its stage's state this often
DISSOLVE_AFTER_S = 60.0  # a pipeline lane whose empty slot no backup fills for this long is dissolved
