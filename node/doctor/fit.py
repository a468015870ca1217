"""Which model presets fit in a device's free memory: parameter counts and a training-memory estimate per preset."""

from __future__ import annotations

from dataclasses import dataclass

from shoal.protocol.manifest import MODEL_PRESETS, MODEL_SIZES, ModelSpec

#: bytes per parameter while training in fp32: weights 4 + gradients 4 + AdamW's two moments 8 + the
#: synchronizer's buffers (error feedback, a reference copy) 8
STATE_BYTES_PER_PARAM = 24
MAX_MICRO_BATCH = 16  # the manifest's default batch
HEADROOM = 0.9  # leave 10% of the free memory to the allocator and everything else


def num_params(spec: ModelSpec, seq_len: int) -> int:
    """The parameters of node/train/model.py's GPT: tied embeddings, pre-norm blocks without biases."""
    d, L = spec.d_model, spec.n_layers
    per_block = 4 * d * d + 2 * spec.mlp_ratio * d * d + 2 * d  # qkv + proj, the MLP, two norms
    positions = seq_len * d if spec.positions == "learned" else 0
    return spec.vocab_size * d + positions + L * per_block + d  # + the final norm


def activation_bytes_per_sample(spec: ModelSpec, seq_len: int) -> int:
    """fp32 activations kept for the backward pass of one sequence (Korthikanti et al.'s per-layer count,
    s*h*(34 + 5*a*s/h) bytes at 16 bits, doubled for fp32), plus the logits and their gradient."""
    s, h, a = seq_len, spec.d_model, spec.n_heads
    per_layer = 2 * s * h * (34 + 5 * a * s / h)
    return int(spec.n_layers * per_layer + 3 * 4 * s * spec.vocab_size)


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


def fit(size: str, free_bytes: int) -> Fit:
    """How preset `size` fits in `free_bytes`: the largest micro-batch (at most MAX_MICRO_BATCH) whose training
    memory stays within the headroom."""
    _, _, _, seq_len = MODEL_PRESETS[size]
    spec = ModelSpec.preset(size)
    params = num_params(spec, seq_len)
    state = params * STATE_BYTES_PER_PARAM
    per_sample = activation_bytes_per_sample(spec, seq_len)
    room = free_bytes * HEADROOM - state
    mb = max(0, min(MAX_MICRO_BATCH, int(room // per_sample))) if room > 0 else 0
    return Fit(size=size, params=params, state_bytes=state, per_sample_bytes=per_sample, max_micro_batch=mb)


def fits(free_bytes: int) -> list[Fit]:
    return [fit(size, free_bytes) for size in MODEL_SIZES]
