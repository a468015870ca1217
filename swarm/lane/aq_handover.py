"""AQ-SGD stores through churn: a node's stores by link position, which outlive its LinkEnds (a surviving neighbour
keeps its rows when the peer across the link changes), served through the state-transfer machinery on their own
protocol, and pulled by a replacement at the switch revision with every row validated and the digest checked.

docs/pipeline.md, "AQ-SGD over a link", rule 7: a replacement entering slot (s, r) at switch step R pulls the incoming
boundary's store from (s-1, r) and the outgoing one from (s+1, r) at revision R; the new side always pulls from the
surviving side; a link whose two ends are both new starts empty (its partner has no store to give). "At revision R"
means no row written at step R or later (versions are write step + 1, so every version is at most R).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from collections.abc import Callable
from typing import Any

import trio

from shoal.swarm.net.host import SwarmHost
from shoal.swarm.net.penalty import Penalties
from shoal.swarm.lane.aq_store import LinkStore, StoreConfig
from shoal.swarm.state.snapshot import Snapshot, StateTransferError
from shoal.swarm.state.transfer import StateServer, StateTransferConfig, pull_state

log = logging.getLogger(__name__)

AQ_STORE_PROTOCOL = "/shoal/aqstore/1.0.0"
SIDES = ("sender", "receiver")
OTHER_SIDE = {"sender": "receiver", "receiver": "sender"}


@dataclass(frozen=True, slots=True)
class StoreKey:
    """A link end's position: run, lane, boundary, and which side of the activations this end is."""

    run_id: str
    lane: int
    boundary: int
    side: str

    @property
    def name(self) -> str:
        return f"{self.run_id[:16]}-l{self.lane}-b{self.boundary}-{self.side}"

    def other(self) -> StoreKey:
        return StoreKey(self.run_id, self.lane, self.boundary, OTHER_SIDE[self.side])


class AQStores:
    """The node's AQ-SGD stores by position, and the server that hands them to a replacement."""

    def __init__(self, sh: SwarmHost, penalties: Penalties, *, timeout_s: float = 60.0,
                 max_total_bytes: int = 8 << 30, allow: Callable[[str], bool] | None = None):
        self.sh, self.penalties = sh, penalties
        self.config = StateTransferConfig(timeout_s=timeout_s, max_total_bytes=max_total_bytes, max_tensors=64)
        self._stores: dict[StoreKey, LinkStore] = {}
        self.handovers: list[dict[str, Any]] = []  # what this node pulled (for the status file and tests)
        StateServer(sh, lambda: None, penalties=penalties, config=self.config, by_revision=self._at,
                    protocol=AQ_STORE_PROTOCOL, allow=allow)

    def open(self, key: StoreKey, config: StoreConfig) -> tuple[LinkStore, bool]:
        """The store of `key` and whether it was here already (a store of another shape is replaced)."""
        st = self._stores.get(key)
        if st is not None and st.config == config:
            return st, True
        st = self._stores[key] = LinkStore(config)
        return st, False

    def get(self, key: StoreKey) -> LinkStore | None:
        return self._stores.get(key)

    def drop(self, key: StoreKey) -> None:
        """Forget a store (this node left that link position)."""
        st = self._stores.pop(key, None)
        if st is not None:
            st.close()

    def close(self) -> None:
        """Every store closed (the node's links are over): disk buffers leave nothing behind."""
        for key in list(self._stores):
            self.drop(key)

    def _at(self, revision: int) -> Snapshot | None:
        """Every store that is at `revision` (no row newer), as a snapshot the state server can cut by prefix."""
        state = {"stores": {k.name: st.export() for k, st in self._stores.items()
                            if len(st) and st.max_version() <= revision}}  # an empty store: a new end, nothing to give
        return Snapshot.of(state, revision, copy=False) if state["stores"] else None

    async def pull(self, peer: str, key: StoreKey, store: LinkStore, revision: int) -> bool:
        """Fill the empty `store` of `key` from the other end of its link, `peer`, at `revision`: True when rows came
        and check out; False when the peer has no such store (both ends new: the link starts empty) or the pull
        failed (the link starts empty; rule 3 repairs what differs). A peer that sends invalid rows is penalized."""
        other = key.other()
        prefix = f"/stores/{other.name}/"
        try:
            snap = await pull_state(self.sh, peer, revision=revision, only=(prefix,), config=self.config,
                                    protocol=AQ_STORE_PROTOCOL)
        except StateTransferError as e:
            log.info("AQ-SGD store %s from %s at revision %d: none (%s); the link starts empty", other.name,
                     peer[-8:], revision, e)
            return False
        t = snap.tensors
        names = {prefix + x for x in ("ids", "versions", "rows")}
        if not set(t):
            log.info("AQ-SGD store %s: %s has none at revision %d; the link starts empty", other.name, peer[-8:],
                     revision)
            return False
        try:
            entry = snap.skeleton["stores"][other.name] if isinstance(snap.skeleton, dict) else None
            digest = entry.get("digest") if isinstance(entry, dict) else None
            if set(t) != names or not isinstance(digest, str) or len(digest) != 64:
                raise ValueError(f"a store holds ids, versions, rows and a digest, got {sorted(t)[:4]}")
            await trio.to_thread.run_sync(store.load, t[prefix + "ids"], t[prefix + "versions"], t[prefix + "rows"],
                                          digest, revision)
        except (ValueError, KeyError, TypeError) as e:
            self.penalties.penalize(peer, f"AQ-SGD store hand-over: {e}")
            log.warning("AQ-SGD store %s from %s rejected: %s; the link starts empty", other.name, peer[-8:], e)
            return False
        self.handovers.append({"store": key.name, "peer": peer, "revision": revision, "rows": len(store),
                               "digest": store.digest().hex()})
        log.info("AQ-SGD store %s: %d rows pulled from %s at revision %d, digest %s… matches", key.name, len(store),
                 peer[-8:], revision, store.digest().hex()[:16])
        return True
