"""How much memory training one stage of a model takes: weights, gradients, optimizer and synchronizer state, and
the activations of one micro-batch (an estimate from the model spec; `shoal doctor` and a node's start use it)."""

from __future__ import annotations

from dataclasses import dataclass

from shoal.protocol.manifest import ModelSpec, RunManifest

#: bytes per parameter while training in fp32: weights 4 + gradients 4 + AdamW's two moments 8 + the
#: synchronizer's buffers (error feedback, a reference copy) 8
STATE_BYTES_PER_PARAM = 24
AUTOCAST_BYTES_PER_PARAM = 2  # under autocast: the 16-bit copies of the weights, cached for the step
WORKSPACE_BYTES = 64 << 20  # on a GPU: cuBLAS and attention workspaces, allocator rounding
HEADROOM = 0.9  # leave 10% of the free memory to the allocator and everything else


def _stage_layers(n_layers: int, stage: int, stages: int) -> int:
    base, extra = divmod(n_layers, stages)  # node/train/model.py's even split: earlier stages take the remainder
    return base + (1 if stage < extra else 0)


def num_params(spec: ModelSpec, seq_len: int, stage: int = 0, stages: int = 1) -> int:
    """The parameters of node/train/model.py's GPT stage: pre-norm blocks without biases; the first stage holds the
    embeddings, the last the final norm and the head (unless tied to the embedding)."""
    d = spec.d_model
    per_block = 4 * d * d + 2 * spec.mlp_ratio * d * d + 2 * d  # qkv + proj, the MLP, two norms
    n = _stage_layers(spec.n_layers, stage, stages) * per_block
    first, last = stage == 0, stage == stages - 1
    if first:
        n += spec.vocab_size * d + (seq_len * d if spec.positions == "learned" else 0)
    if last:
        n += d + (0 if spec.tied(stages) else spec.vocab_size * d)
    return n


def activation_bytes_per_sample(spec: ModelSpec, seq_len: int, stage: int = 0, stages: int = 1, *,
                                half: bool = False) -> int:
    """Activations kept for the backward pass of one sequence: Korthikanti et al.'s 34*s*h bytes per layer at 16
    bits (`half`: under autocast, as on CUDA; doubled for fp32), without their 5*a*s^2 term for the attention
    scores, which scaled_dot_product_attention does not keep; plus the fp32 logits, their softmax and their
    gradient on the last stage."""
    s, h = seq_len, spec.d_model
    per_layer = (1 if half else 2) * 34 * s * h
    logits = 3 * 4 * s * spec.vocab_size if stage == stages - 1 else 0
    return int(_stage_layers(spec.n_layers, stage, stages) * per_layer + logits)


@dataclass(frozen=True, kw_only=True, slots=True)
class StageMemory:
    params: int
    state_bytes: int  # weights, gradients, optimizer and synchronizer state (and on a GPU, autocast and workspaces)
    activation_bytes: int  # one micro-batch's activations

    @property
    def total_bytes(self) -> int:
        return self.state_bytes + self.activation_bytes

    def fits(self, free_bytes: int) -> bool:
        return self.total_bytes <= free_bytes * HEADROOM


def stage_memory(manifest: RunManifest, stage: int = 0, *, half: bool = False) -> StageMemory:
    """The estimate for training `stage` of the run's model with the run's micro-batch (`half`: 16-bit activations
    under autocast, as the trainer does on CUDA)."""
    spec, batch, stages = manifest.model, manifest.batch, manifest.plan.stages
    params = num_params(spec, batch.seq_len, stage, stages)
    per_sample = activation_bytes_per_sample(spec, batch.seq_len, stage, stages, half=half)
    state = params * (STATE_BYTES_PER_PARAM + (AUTOCAST_BYTES_PER_PARAM if half else 0)) + (WORKSPACE_BYTES if half else 0)
    return StageMemory(params=params, state_bytes=state, activation_bytes=per_sample * batch.micro_batch_size)
