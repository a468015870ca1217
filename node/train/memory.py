"""How much memory training one stage of a run takes on a node: weights, gradients, optimizer and synchronizer state,
and the activations in flight (an estimate from the manifest, within 1% of what a trainer allocates on an H100:
bench/results/gpu_node_check.md). A node checks it against its device before it asks for a place; `shoal doctor`
uses it for the presets."""

from __future__ import annotations

from dataclasses import dataclass

from shoal.protocol.manifest import RunManifest, even_split

#: bytes per parameter while training in fp32: weights 4 + gradients 4 + AdamW's two moments 8 + the
#: synchronizer's buffers (error feedback, a reference copy) 8
STATE_BYTES_PER_PARAM = 24
AUTOCAST_BYTES_PER_PARAM = 2  # under autocast: the 16-bit copies of the weights, cached for the step
WORKSPACE_BYTES = 64 << 20  # on a GPU: cuBLAS and attention workspaces, allocator rounding
HEADROOM = 0.9  # leave 10% of the free memory to the allocator and everything else


def activation_bytes_per_sample(manifest: RunManifest, stage: int = 0, *, half: bool = False) -> int:
    """Activations one sequence keeps for the backward pass of `stage`: Korthikanti et al.'s 34*s*h bytes per layer
    at 16 bits (`half`: under autocast, as on CUDA; doubled for fp32), without their 5*a*s^2 term for the attention
    scores, which scaled_dot_product_attention does not keep; plus the fp32 logits, their softmax and their
    gradient on the last stage."""
    m, s, stages = manifest.model, manifest.batch.seq_len, manifest.plan.stages
    first, last = even_split(m.n_layers, stages)[stage]
    per_layer = (1 if half else 2) * s * per_layer_units(manifest)
    logits = 3 * 4 * s * m.vocab_size if stage == stages - 1 else 0
    return int((last - first) * per_layer + logits)


def per_layer_units(manifest: RunManifest) -> int:
    """Korthikanti et al.'s bytes per token of one layer at 16 bits (34 h for the built-in GPT: attention 11 h,
    norms 4 h, a GELU MLP of width 4h 19 h). A Hugging Face model's MLP of width f: 2 h + 8 f when gated (SwiGLU:
    gate, up, the activation and their product kept); GPT-2's 3 h + 7 f (its tanh GELU, composed of elementwise
    ops, keeps three more f-wide tensors than a fused GELU). On the CPU in fp32 the saved-for-backward bytes of a
    4-layer d=256 model are 1.47x this estimate for the built-in GPT, 1.39x for a Llama and 1.48x for GPT-2: the
    families are counted alike (the built-in's factor is calibrated on a GPU, bench/results/gpu_node_check.md)."""
    m = manifest.model
    if m.hf is None:
        return 34 * m.d_model
    sh = m.hf.shape
    mlp = 3 * sh.d_model + 7 * sh.ffn if sh.family == "gpt2" else 2 * sh.d_model + 8 * sh.ffn
    return 15 * sh.d_model + mlp


@dataclass(frozen=True, kw_only=True, slots=True)
class StageMemory:
    params: int
    state_bytes: int  # weights, gradients, optimizer and synchronizer state (and on a GPU, autocast and workspaces)
    activation_bytes: int  # the sequences in flight

    @property
    def total_bytes(self) -> int:
        return self.state_bytes + self.activation_bytes

    def fits(self, free_bytes: int) -> bool:
        return self.total_bytes <= free_bytes * HEADROOM


def state_bytes(params: int, *, half: bool = False) -> int:
    return params * (STATE_BYTES_PER_PARAM + (AUTOCAST_BYTES_PER_PARAM if half else 0)) + (WORKSPACE_BYTES if half
                                                                                           else 0)


def stage_memory(manifest: RunManifest, stage: int = 0, *, half: bool = False) -> StageMemory:
    """The estimate for training `stage` of the run (`half`: 16-bit activations under autocast, as the trainer does
    on CUDA). One stage keeps a micro-batch's activations at a time; a pipeline stage keeps every micro-batch of
    the step until its backward (GPipe)."""
    params = manifest.stage_params(stage)
    b = manifest.batch
    in_flight = b.batch_size if manifest.plan.stages > 1 else b.micro_batch_size
    return StageMemory(params=params, state_bytes=state_bytes(params, half=half),
                       activation_bytes=in_flight * activation_bytes_per_sample(manifest, stage, half=half))
