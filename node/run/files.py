"""The files a run names by hash (a Hugging Face model's weights, a tokenizer): this node's store of them, served to
the peers that need them, and fetched from the run's peers when missing, each checked against its hash."""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

from shoal.node.run.config import RunConfig
from shoal.node.run.context import NodeServices
from shoal.node.run.entitled import Entitlement
from shoal.protocol.assignment import AssignmentTable
from shoal.protocol.manifest import RunManifest
from shoal.swarm.state.blobs import BlobServer, BlobStore, pull_blob

log = logging.getLogger(__name__)


class RunFiles:
    """Made once the manifest is known; it serves the run's files from then on (to anyone in an open run, to the
    run's members in a private one)."""

    def __init__(self, services: NodeServices, config: RunConfig, manifest: RunManifest, entitled: Entitlement):
        self.services, self.config, self.manifest = services, config, manifest
        root = Path(config.blob_dir) if config.blob_dir else Path(tempfile.gettempdir()) / "shoal-blobs"
        self.blobs = BlobStore(root)
        BlobServer(services.sh, self.blobs, named=lambda: [h for h, _ in manifest.blobs()],
                   penalties=services.penalties, allow=None if manifest.join.mode == "open" else entitled.member)

    async def fetch(self, table: AssignmentTable | None) -> dict[str, Path | None]:
        """Digest -> local path of every file the run names: from the local store, else from peers (the owner, the
        broker, the table's members, then any live peer of the run), each checked against its hash."""
        m, sv = self.manifest, self.services
        got: dict[str, Path | None] = {}
        for digest, size in m.blobs():
            if self.blobs.path(digest) is None:
                members = [table.peer_id, *(s.peer_id for s in table.slots), *table.backups] if table is not None \
                    else []
                live = [peer for peer, st in sv.statuses() if st.run_id == m.run_id]
                peers = list(dict.fromkeys(p for p in [m.owner, *members, *live] if p and p != sv.peer_id))
                what = "weights" if size else "tokenizer"
                log.info("fetching the run's %s (%s…) from %d peers", what, digest[:12], len(peers))
                t0 = sv.clock()
                await pull_blob(sv.sh, self.blobs, digest, size, peers, penalties=sv.penalties,
                                attempt_s=self.config.blob_pull_attempt_s, max_bytes=size or (64 << 20))
                log.info("fetched the run's %s in %.1f s", what, sv.clock() - t0)
            got[digest] = self.blobs.path(digest)
        return got
