"""The global batch of one optimizer step: which sequences each lane computes (docs/crowd.md, "The global batch").

Every training sequence comes once per epoch in an order fixed by (seed, epoch), and step t takes the positions
[t * B, (t + 1) * B) of that stream, B the run's global batch: so the samples of a step are the same whatever the
lanes, and the step number alone says where the data is. The broker's table says how many of them each lane takes
(`StepBatch.shares`, in force from the table's switch step). Which ones: every sequence has a home lane, fixed by a
hash of its id and the lanes' shares (consistent hashing on [0, 2^64): lane j owns a slice as wide as its share), so a
sequence keeps coming back to the same lane epoch after epoch (AQ-SGD keeps a buffer per sequence on each link:
docs/pipeline.md, "AQ-SGD over a link") and a change of shares or lanes moves only the sequences near a slice's edge. A
step's sequences go to their home lanes in stream order until a lane's share is full; the few left over (a step's
count per home varies around its share) fill the lanes with room, in lane order, as first visits. Every sequence of
the step goes to exactly one lane; all of it is integer arithmetic, the same on every machine.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from shoal.protocol.assignment import AssignmentTable
from shoal.protocol.manifest import RunManifest
from shoal.protocol.split import even_shares

_M1, _M2, _GOLD = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB), np.uint64(0x9E3779B97F4A7C15)


@dataclass(frozen=True, slots=True)
class StepBatch:
    """One step's split of the global batch: (lane, sequences) for every lane that trains, and this node's lane."""

    global_batch: int
    shares: tuple[tuple[int, int], ...]
    lane: int

    def __post_init__(self) -> None:
        lanes = [r for r, _ in self.shares]
        if lanes != sorted(set(lanes)) or self.lane not in lanes:
            raise ValueError(f"shares {self.shares} must list lanes once, in order, lane {self.lane} among them")
        if sum(n for _, n in self.shares) != self.global_batch or min(n for _, n in self.shares) < 1:
            raise ValueError(f"shares {self.shares} do not split a global batch of {self.global_batch}")

    @property
    def samples(self) -> int:
        """This lane's sequences this step."""
        return dict(self.shares)[self.lane]

    @classmethod
    def of(cls, manifest: RunManifest, lane: int, shares: dict[int, int] | None = None,
           lanes: list[int] | None = None) -> StepBatch:
        """The split `shares` (lane -> sequences, the broker's) as lane `lane` sees it. Without one that splits the
        global batch over `lane` and others (a table of an older broker), `lanes` (default: the run's starting
        lanes) evenly: every member derives the same from the same table."""
        B = manifest.global_batch
        if not shares or lane not in shares or sum(shares.values()) != B or min(shares.values()) < 1:
            lanes = sorted(set(lanes if lanes is not None else range(manifest.plan.replicas)) | {lane})
            shares = even_shares(B, manifest.batch_granule, lanes)
        return cls(B, tuple(sorted(shares.items())), lane)

    @classmethod
    def in_table(cls, manifest: RunManifest, lane: int, table: AssignmentTable | None) -> StepBatch:
        """Lane `lane`'s split under `table`: its shares over its complete lanes (None: the starting lanes, evenly)."""
        if table is None:
            return cls.of(manifest, lane)
        return cls.of(manifest, lane, table.lane_shares(), lanes=list(table.complete_lanes()))


def micro_loss(loss: torch.Tensor, share: int, size: int) -> torch.Tensor:
    """A micro-batch's mean loss (`size` sequences) as its part of a lane's `share` of the step: divided by the
    micro-batch count when the share is whole micro-batches of that size (as a full batch has it, bit for bit),
    else weighted by size / share. The trainer and a re-execution of the micro-batch (verified stages) both use it."""
    if share == size:  # the whole share in one micro-batch: divided by 1 (no kernel spent on it)
        return loss
    return loss / (share // size) if share % size == 0 else loss * (size / share)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 (wrapping arithmetic: the same bits everywhere)."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * _M1
        x = (x ^ (x >> np.uint64(27))) * _M2
        return x ^ (x >> np.uint64(31))


def home_lanes(ids: np.ndarray, shares: tuple[tuple[int, int], ...], seed: int) -> np.ndarray:
    """Index (into `shares`) of each sequence id's home lane: its hash's slice of [0, 2^64), slices as wide as the
    shares, in lane order."""
    total = sum(n for _, n in shares)
    bounds, cum = [], 0
    for _, n in shares[:-1]:
        cum += n
        bounds.append((cum << 64) // total)
    with np.errstate(over="ignore"):
        h = _mix(ids.astype(np.uint64) * _GOLD + np.uint64(seed % 2**64))
    return np.searchsorted(np.array(bounds, dtype=np.uint64), h, side="right")


def assign(ids: np.ndarray, shares: tuple[tuple[int, int], ...], seed: int) -> np.ndarray:
    """Index (into `shares`) of the lane each of a step's sequences goes to: its home lane while that lane has room
    (in stream order), else the first lane with room. Exactly shares[j][1] go to lane j."""
    home = home_lanes(ids, shares, seed)
    out = np.full(len(ids), -1, dtype=np.int64)
    room = []
    for j, (_, n) in enumerate(shares):
        mine = np.flatnonzero(home == j)[:n]
        out[mine] = j
        room.append(n - len(mine))
    left = np.flatnonzero(out < 0)
    at = 0
    for j, r in enumerate(room):
        out[left[at:at + r]] = j
        at += r
    return out


class GlobalOrder:
    """The run's sample stream: every sequence id once per epoch, shuffled by (seed, epoch)."""

    def __init__(self, num_samples: int, *, seed: int):
        if num_samples < 1:
            raise ValueError("no samples to train on")
        self.num_samples, self.seed = num_samples, seed
        self._epoch, self._perm = -1, torch.empty(0, dtype=torch.long)

    def _order(self, epoch: int) -> torch.Tensor:
        if epoch != self._epoch:
            g = torch.Generator().manual_seed((self.seed * 1_000_003 + epoch) % 2**63)
            self._epoch, self._perm = epoch, torch.randperm(self.num_samples, generator=g)
        return self._perm

    def at(self, positions: torch.Tensor) -> torch.Tensor:
        """The sequence ids at these stream positions (int64)."""
        epochs, idx = positions // self.num_samples, positions % self.num_samples
        out = torch.empty(len(positions), dtype=torch.long)
        for epoch in torch.unique(epochs).tolist():  # one or two epochs in a step
            sel = epochs == epoch
            out[sel] = self._order(epoch)[idx[sel]]
        return out

    def ids(self, first: int, n: int) -> torch.Tensor:
        """The sequence ids at stream positions first .. first + n - 1."""
        return self.at(torch.arange(first, first + n, dtype=torch.long))

    def epoch_at(self, step: int, global_batch: int) -> int:
        return step * global_batch // self.num_samples

    def step_ids(self, step: int, batch: StepBatch) -> torch.Tensor:
        """This lane's sequence ids of step `step`, in stream order."""
        ids = self.ids(step * batch.global_batch, batch.global_batch)
        if len(batch.shares) == 1:
            return ids
        lanes = assign(ids.numpy(), batch.shares, self.seed)
        j = [r for r, _ in batch.shares].index(batch.lane)
        return ids[torch.from_numpy(lanes == j)]
