"""AQ-SGD state of one stage's ends of its lane links: the sender's store with its pending rows (committed on the
backward ACK, dropped when the step is given up) and the receiver's store with its version checks and NACKs.

docs/pipeline.md, "AQ-SGD over a link", rules 3-5: the receiver accepts a delta only against the version it holds, else
it NACKs those rows once and the sender resends them as first visits; the receiver commits on decode, the sender on
the ACK; each end keeps a digest of its store. A sender that breaks these rules (a delta against a version from the
future, a delta for a sample that has no slot, a delta again for a row it was NACKed, a NACK for rows it did not send
as deltas) is a violation (swarm/lane/end.py rejects and penalizes it).
"""

from __future__ import annotations

import os
from collections.abc import Set
from dataclasses import dataclass, field

import torch

from shoal.protocol.lane import Act, Nack
from shoal.swarm.lane.aq_codec import AQSpec, Encoding, apply_acts, encode_acts
from shoal.swarm.lane.aq_store import LinkStore, StoreConfig
from shoal.swarm.lane.spec import Violation


def store_config(spec: AQSpec, row_shape: tuple[int, int], train_samples: int, name: str) -> StoreConfig:
    """Where and how big one link end's store is (`name`: unique on this machine, for a disk file)."""
    path = None
    if spec.buffer == "disk":
        assert spec.buffer_dir is not None  # AQSpec: a disk buffer has its folder
        os.makedirs(spec.buffer_dir, exist_ok=True)
        path = os.path.join(spec.buffer_dir, f"{name}.fp16")
    return StoreConfig(row_shape=row_shape, cap_mb=spec.cap_mb, train_samples=train_samples, disk_path=path)


@dataclass(slots=True)
class _Pending:
    ids: list[int]
    acts: torch.Tensor  # float32 (B, T, H): what a NACKed row is resent from
    encoding: Encoding


@dataclass(slots=True)
class AQSender:
    """The activation sender's side of one link (stage s, toward s+1)."""

    spec: AQSpec
    store: LinkStore
    pending: dict[tuple[int, int], _Pending] = field(default_factory=dict)  # (step, micro)
    nacked_keys: set[tuple[int, int]] = field(default_factory=set)  # (step, micro) NACKed once already
    nacks: int = 0  # NACKs received
    resent_rows: int = 0

    def busy(self, step: int, micro: int) -> set[int]:
        """Samples of this step's earlier micro-batches, not yet committed: they go as first visits again."""
        return {sid for (s, m), p in self.pending.items() if s == step and m < micro for sid in p.ids}

    def encode(self, ids: list[int], acts: torch.Tensor, busy: set[int], force_first: Set[int] = frozenset()
               ) -> Encoding:
        """(Off the event loop.)"""
        return encode_acts(self.spec, self.store, ids, acts, set(force_first), busy)

    def record(self, step: int, micro: int, ids: list[int], acts: torch.Tensor, enc: Encoding) -> Act:
        self.pending[step, micro] = _Pending(ids, acts, enc)
        return Act(step=step, micro=micro, kind="aqsgd", ids=tuple(ids), base_versions=enc.base_versions,
                   n_first=enc.n_first, bits=self.spec.fwd_bits)

    def nacked(self, rec: Nack) -> _Pending:
        """A NACK arrived: the pending micro-batch it names (its rows must have gone as deltas)."""
        p = self.pending.get((rec.step, rec.micro))
        if p is None:
            raise Violation(f"NACK for step {rec.step} micro-batch {rec.micro}, which is not pending here")
        if (rec.step, rec.micro) in self.nacked_keys:
            raise Violation(f"a second NACK for step {rec.step} micro-batch {rec.micro}")
        if not rec.rows or any(r >= len(p.ids) or p.encoding.base_versions[r] == 0 for r in rec.rows):
            raise Violation(f"NACK of rows {list(rec.rows)[:8]} that were not sent as deltas")
        self.nacked_keys.add((rec.step, rec.micro))
        self.nacks += 1
        self.resent_rows += len(rec.rows)
        return p

    def commit(self, step: int, micro: int) -> None:
        """The micro-batch's backward arrived (the ACK): its rows become this end's m at version step + 1."""
        p = self.pending.pop((step, micro), None)
        if p is not None:
            for sid, row in p.encoding.rows:
                self.store.put(sid, step + 1, row)

    def drop(self, before_or_at: int) -> None:
        """Forget what was pending for steps up to this one (given up or over)."""
        for k in [k for k in self.pending if k[0] <= before_or_at]:
            del self.pending[k]
        self.nacked_keys = {k for k in self.nacked_keys if k[0] > before_or_at}


@dataclass(slots=True)
class AQReceiver:
    """The activation receiver's side of one link (stage s+1, from s)."""

    spec: AQSpec
    store: LinkStore
    nacked_keys: set[tuple[int, int]] = field(default_factory=set)  # (step, micro) NACKed once already
    nacks: int = 0  # NACKs sent

    def check(self, rec: Act, step: int) -> list[int]:
        """Rows to NACK (empty: the message decodes here). Raises Violation for what no honest sender sends."""
        rows, deltas = [], set()
        for i, (sid, base) in enumerate(zip(rec.ids, rec.base_versions)):
            if base == 0:
                continue
            if base > step:
                raise Violation(f"row {i}: a delta against version {base} at step {step} (from the future)")
            if not self.store.holds(sid):
                raise Violation(f"row {i}: a delta for sample {sid}, which has no slot (capacity "
                                f"{self.store.capacity})")
            if sid in deltas:
                raise Violation(f"row {i}: a second delta for sample {sid} in one micro-batch")
            deltas.add(sid)
            if self.store.version(sid) != base:
                rows.append(i)
        if rows and (rec.step, rec.micro) in self.nacked_keys:
            raise Violation(f"deltas against versions this end lacks, again after a NACK (rows {rows[:8]})")
        return rows

    def note_nack(self, rec: Act) -> None:
        self.nacked_keys = {k for k in self.nacked_keys if k[0] >= rec.step}
        self.nacked_keys.add((rec.step, rec.micro))
        self.nacks += 1

    def apply(self, rec: Act, groups: tuple[torch.Tensor | None, torch.Tensor | None]) -> torch.Tensor:
        """(Off the event loop.) m of every row, committed at version step + 1; float32 (B, T, H)."""
        out = apply_acts(self.store, list(rec.ids), rec.base_versions, groups[0], groups[1], rec.step + 1)
        if out is None:
            raise Violation("deltas that make a row non-finite")
        return out.float()


def link_status(sender: AQSender | None, receiver: AQReceiver | None) -> dict:
    """What the status record says about one link end's store."""
    side = sender or receiver
    if side is None:
        return {}
    return {"compression": "aqsgd", "digest": side.store.digest().hex(), "rows": len(side.store),
            "nacks": side.nacks}
