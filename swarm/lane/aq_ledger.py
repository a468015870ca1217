"""What one link end's AQ-SGD stores held after each finished step: the digests its status record and status file
carry (the last step's, and the last few steps' so that observers sampling two ends at different moments compare
them at a step both hold) and the digests at checkpoint steps, which a stage's verification compares across a link
(docs/pipeline.md)."""

from __future__ import annotations

from collections import deque
from typing import Any

from shoal.protocol.records import LinkStatus, checkpoint_steps

DIGEST_HISTORY = 16  # steps of store digests each AQ-SGD link end keeps for its status file


class StoreLedger:
    """Kept by a LinkEnd: `settle` after each step with the end's stores (LinkEnd.stores())."""

    def __init__(self) -> None:
        self.settled: tuple[int, dict[str, dict[str, Any]]] | None = None  # (step, stores) after the last step
        #: (link, side) -> (step, digest) after each of the last DIGEST_HISTORY steps
        self.recent: dict[tuple[str, str], deque[tuple[int, str]]] = {}
        self.checks: dict[tuple[str, str], dict[int, str]] = {}  # (link, side) -> digests at checkpoint steps

    def settle(self, step: int, stores: dict[str, dict[str, Any]]) -> None:
        """`stores` ("b0/fwd" -> its side, digest, rows, NACKs) as they stand after `step`."""
        self.settled = (step, stores)
        for name, st in stores.items():
            key, digest = (name, st["side"]), st["digest"][:16]
            self.recent.setdefault(key, deque(maxlen=DIGEST_HISTORY)).append((step, digest))
            checks = self.checks.setdefault(key, {})
            checks[step] = digest
            for old in set(checks) - set(checkpoint_steps(checks)):
                del checks[old]

    def link_statuses(self, links: list[tuple[str, str, str]], compression: str) -> tuple[LinkStatus, ...]:
        """A LinkStatus per activation link (name, peer, side): its compression, and once a step settled the
        store's digest then, its rows and NACKs, and its digests at checkpoint steps."""
        out = []
        settled_at, stores = self.settled if self.settled is not None else (None, {})
        for name, peer, side in links:
            st = stores.get(name)
            checks = sorted(self.checks.get((name, side), {}).items())
            out.append(LinkStatus(link=name, peer=peer, side=side, compression=compression,
                                  **({"step": settled_at, "digest": st["digest"][:16], "rows": st["rows"],
                                      "nacks": st["nacks"], "check_steps": tuple(s for s, _ in checks),
                                      "check_digests": tuple(d for _, d in checks)} if st else {})))
        return tuple(out)

    def recent_digests(self) -> dict[str, dict[str, str]]:
        """"link/side" -> {step: digest} after each of the last steps."""
        return {f"{link}/{side}": {str(step): d for step, d in hist} for (link, side), hist in self.recent.items()}
