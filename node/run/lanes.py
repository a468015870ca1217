"""A pipeline stage's links to its lane neighbours, as a node's run holds them: opened to the neighbours that the
table in force names, replaced when one of them changes (a promoted backup, a re-formed lane), and their bytes
counted across replacements."""

from __future__ import annotations

import logging
import os
from typing import Any

import trio

from shoal.node.train.transcript import RecordingBoundary, Transcript
from shoal.protocol.assignment import AssignmentTable
from shoal.protocol.manifest import RunManifest
from shoal.protocol.records import LinkStatus
from shoal.swarm.lane.blocking import BlockingLinkEnd
from shoal.swarm.lane.end import LinkEnd
from shoal.swarm.lane.hub import LinkHub
from shoal.swarm.lane.spec import LaneSpec
from shoal.swarm.run.timeline import lane_peers

log = logging.getLogger(__name__)


class StageLinks:
    """This stage's links (several stages only): `connect` before each step, `close` when the slot changes."""

    def __init__(self, hub: LinkHub, token: trio.lowlevel.TrioToken, manifest: RunManifest, me: str,
                 buffer_dir: str | None, transcript: Transcript | None = None):
        self.hub, self._token, self.manifest, self.me = hub, token, manifest, me
        self.transcript = transcript  # a verified run: what crosses the links is recorded there (evidence)
        #: this run's AQ-SGD disk buffers: under the node's configured folder (its data directory), by run
        self.buffer_dir = None if buffer_dir is None else os.path.join(buffer_dir, manifest.run_id[:16])
        self.end: LinkEnd | None = None
        self.peers: tuple[str | None, str | None] | None = None  # (previous, next) stage's peer of the lane
        self._closed_bytes = (0, 0, 0)  # (sent, received, fp32 of the sent) on links closed since the start

    async def connect(self, trainer, table: AssignmentTable | None, step: int) -> None:
        """Make the links of `trainer`'s stage go to the lane neighbours that `table` (in force at `step`) names,
        closing the old ones first when a neighbour changed; the trainer's boundary is the new links."""
        peers = lane_peers(table, self.me) if table is not None else (None, None)
        if peers == self.peers and self.end is not None:
            return
        await self.close()
        spec = LaneSpec.from_manifest(self.manifest, stage=trainer.stage, lane=trainer.replica, prev_peer=peers[0],
                                      next_peer=peers[1], train_samples=trainer.train_samples.num_samples,
                                      eval_samples=trainer.heldout_samples.num_samples, buffer_dir=self.buffer_dir)
        self.end = self.hub.open(spec)
        self.peers = peers
        await self.end.adopt(step)  # AQ-SGD: a replacement pulls its links' stores from the survivors
        trainer.boundary = BlockingLinkEnd(self.end, self._token)
        if self.transcript is not None:
            trainer.boundary = RecordingBoundary(trainer.boundary, self.transcript, spec.kind)
        log.info("lane %d stage %d links: previous %s, next %s", trainer.replica, trainer.stage,
                 (peers[0] or "-")[-8:], (peers[1] or "-")[-8:])

    def halt(self) -> None:
        """This node is leaving: the trainer thread's waits on the lane fail now instead of at their deadlines."""
        if self.end is not None:
            self.end.halt("this node is leaving the run")

    async def close(self) -> None:
        """Close the current links; their bytes stay counted (counted while they are still the current ones)."""
        if self.end is not None:
            self._closed_bytes = self.bytes()
        end, self.end, self.peers = self.end, None, None
        if end is not None:
            await end.aclose()

    def drop_stores(self) -> None:
        """Forget every AQ-SGD store of this node (the run rolled back: each link starts empty, first visits)."""
        self.hub.aq_stores.close()

    def signatures(self, step: int, micro: int) -> dict[str, bytes]:
        """The signatures the current links hold for a training micro-batch (a verified run; empty otherwise)."""
        return self.end.signatures(step, micro) if self.end is not None else {}

    def counters(self) -> dict[str, Any]:
        """The current links ("b0/fwd"...): the neighbour and the messages and bytes each way."""
        return self.end.counters() if self.end is not None else {}

    def recent_digests(self) -> dict[str, dict[str, str]]:
        """"link/side" -> {step: digest} after each of the last steps (AQ-SGD stores; empty otherwise)."""
        return self.end.recent_digests() if self.end is not None else {}

    def bytes(self) -> tuple[int, int, int]:
        """Wire bytes (sent, received) on this stage's links since the start, and what the sent tensors would have
        taken on the fp32 wire."""
        sent, recv, fp32 = self._closed_bytes
        for c in self.counters().values():
            sent, recv = sent + c["sent"]["wire_bytes"], recv + c["recv"]["wire_bytes"]
            fp32 += c["sent"]["fp32_bytes"]
        return sent, recv, fp32

    def total_bytes(self) -> tuple[int, int] | None:
        """Wire bytes (sent, received) on this stage's links since the start; None before any link was opened."""
        return self.bytes()[:2] if self.end is not None or any(self._closed_bytes) else None

    def statuses(self) -> tuple[LinkStatus, ...] | None:
        """What the status record says of each current link (None: no links open)."""
        return self.end.link_statuses() if self.end is not None else None
