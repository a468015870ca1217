"""Which model presets fit in a device's free memory, from the training-memory estimate (node/train/memory.py)."""

from __future__ import annotations

from dataclasses import dataclass

from shoal.node.train.memory import HEADROOM, activation_bytes_per_sample, state_bytes
from shoal.protocol.manifest import MODEL_SIZES, RunManifest

MAX_MICRO_BATCH = 16  # the manifest's default batch


@dataclass(frozen=True, kw_only=True, slots=True)
class Fit:
    size: str
    params: int
    state_bytes: int  # weights, gradients, optimizer and synchronizer state
    per_sample_bytes: int  # activations of one sequence
    max_micro_batch: int  # 0: does not fit at all

    @property
    def fits(self) -> bool:
        return self.max_micro_batch >= 1

    def describe(self) -> str:
        if self.fits:
            return f"{self.size} ({self.params / 1e6:.1f}M params): fits, micro-batch up to {self.max_micro_batch}"
        need = (self.state_bytes + self.per_sample_bytes) / HEADROOM
        return f"{self.size} ({self.params / 1e6:.1f}M params): does not fit (needs ~{need / 1e9:.1f} GB)"


def num_params(size: str) -> int:
    return RunManifest.default(size).stage_params(0)


def fit(size: str, free_bytes: int, *, half: bool = False) -> Fit:
    """How preset `size` fits in `free_bytes`: the largest micro-batch (at most MAX_MICRO_BATCH) whose training
    memory stays within the headroom (`half`: on CUDA, under autocast)."""
    m = RunManifest.default(size)
    params = m.stage_params(0)
    state = state_bytes(params, half=half)
    per_sample = activation_bytes_per_sample(m, half=half)
    room = free_bytes * HEADROOM - state
    mb = max(0, min(MAX_MICRO_BATCH, int(room // per_sample))) if room > 0 else 0
    return Fit(size=size, params=params, state_bytes=state, per_sample_bytes=per_sample, max_micro_batch=mb)


def fits(free_bytes: int, *, half: bool = False) -> list[Fit]:
    return [fit(size, free_bytes, half=half) for size in MODEL_SIZES]
