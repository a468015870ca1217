"""The states a node serves to others: the latest snapshot, exact revisions joiners asked for, a backup's warm copy.

Owned by the event loop: the trainer thread only produces snapshots (returned from its worker call), and the
runtime stores them here between steps, so nothing here is written from two threads.
"""

from __future__ import annotations

from shoal.swarm.state.snapshot import Snapshot

MAX_EXACT = 4  # exact revisions kept for joiners (the newest ones)
MAX_REQUESTED = 64  # revisions asked for and not yet reached


class SnapshotStore:
    def __init__(self, *, every_steps: int, keep: int = MAX_EXACT):
        self.every_steps = every_steps
        self.keep = keep
        self.latest: Snapshot | None = None
        self.exact: dict[int, Snapshot] = {}
        self.requested: set[int] = set()
        self.warm: Snapshot | None = None  # a backup's recent copy of its stage's state

    def wanted(self, step: int) -> bool:
        """Whether to snapshot the state at revision `step` (before that step runs): a joiner's entry step, the
        first ones (step 1 is the first with optimizer and synchronizer state, for backups' warm copies), and
        every `every_steps`."""
        return step in self.requested or self.latest is None or step == 1 or step % self.every_steps == 0

    def request(self, step: int) -> None:
        """Keep the snapshot of `step` when it is taken (a group change takes effect there, or a peer asked)."""
        if step > 0 and (step in self.requested or len(self.requested) < MAX_REQUESTED):
            self.requested.add(step)

    def add(self, snap: Snapshot, *, exact: bool = False) -> None:
        self.latest = snap
        if exact or snap.revision in self.requested:
            self.requested.discard(snap.revision)
            self.exact[snap.revision] = snap
            for old in sorted(self.exact)[:-self.keep]:
                del self.exact[old]

    def forget_after(self, revision: int) -> None:
        """The run rolled back to `revision`: snapshots taken after it (and a warm copy from after it) are of a past
        that is gone and must never be served."""
        for r in [r for r in self.exact if r > revision]:
            del self.exact[r]
        self.requested = {r for r in self.requested if r <= revision}
        if self.latest is not None and self.latest.revision > revision:
            self.latest = None
        if self.warm is not None and self.warm.revision > revision:
            self.warm = None

    def at(self, revision: int) -> Snapshot | None:
        """The snapshot of exactly `revision`, if this node holds it."""
        if revision in self.exact:
            return self.exact[revision]
        return self.latest if self.latest is not None and self.latest.revision == revision else None
