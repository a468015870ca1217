"""What one optimizer step of a run moves and computes, per stage and stage boundary: the placement cost model's
`Workload`, from the run's manifest with the bytes its compression really sends (docs/placement.md, "The run's
bytes"); and the run's placer.

- Data parallel (DT-FM's c_grad): a member sends every other member that member's shard of the stage and gets the
  aggregated shard back, so c = D x one shard's payload: fp32/fp16 for all-reduce, CocktailSGD's masked top-k
  quantized payload, DiLoCo's outer gradient (fp32 or E3M0) once every H inner steps.
- Pipeline: a lane sends each boundary every micro-batch's activations forward and their gradients back: at the
  wire dtype, or with AQ-SGD at `fwd_bits` deltas when samples come back (`train_subset`) and at
  `first_visit_bits` when every visit is a first one, gradients at `bwd_bits`, plus one fp16 scale per hidden
  channel and micro-batch.
- Compute: 6 flops per parameter and token (forward and backward) for the blocks and the head, plus attention's
  12 T d per token and layer; the embedding lookup is free.
"""

from __future__ import annotations

from shoal.kernels.cocktail import CocktailConfig
from shoal.kernels.codec import E3M0Codec
from shoal.protocol.lane import payload_nbytes
from shoal.protocol.manifest import RunManifest, SyncSpec, even_split
from shoal.swarm.lane.aq_codec import group_nbytes
from shoal.swarm.run.linkbook import LinkBook
from shoal.swarm.run.placement_cost import Workload
from shoal.swarm.run.placer import NetworkPlacer, Placer, PlacerConfig, RunBytes
from shoal.swarm.run.replan import ReplanConfig

STATE_BYTES_PER_PARAM = 16  # what a provider entering a stage pulls: fp32 weights, AdamW's two moments, sync state


def shard_nbytes(sync: SyncSpec, params: int, lanes: int) -> float:
    """Bytes one member sends one other member per step for a stage of `params` parameters (its shard's payload;
    the same comes back)."""
    if lanes < 2 or sync.method == "none":
        return 0.0
    shard = -(-params // lanes)
    if sync.method == "allreduce":
        return float(shard * {"fp32": 4, "fp16": 2, "bf16": 2}[sync.allreduce.dtype])
    if sync.method == "cocktail":
        c = sync.cocktail
        return float(CocktailConfig(p=c.p, r=c.r, bits=c.bits).payload_nbytes(shard))
    if sync.method == "diloco":
        d = sync.diloco
        per = E3M0Codec().payload_nbytes(shard) if d.e3m0 else 4 * shard
        return per / d.inner_steps
    raise ValueError(f"no byte formula for synchronizer {sync.method!r}")


def stage_flops(m: RunManifest, stage: int) -> float:
    """Floating-point operations of one lane's stage per step (forward and backward)."""
    model, b = m.model, m.batch
    first, last = even_split(model.n_layers, m.plan.stages)[stage]
    d, layers = model.d_model, last - first
    tokens = b.batch_size * b.seq_len
    per_token = layers * (6 * (4 + 2 * model.mlp_ratio) * d * d + 12 * b.seq_len * d)
    if stage == m.plan.stages - 1:
        per_token += 6 * model.vocab_size * d
    return float(tokens * per_token)


def boundary_nbytes(m: RunManifest) -> tuple[float, float]:
    """(forward, backward) bytes one lane sends across one stage boundary per step."""
    p, b, d = m.plan.pipeline, m.batch, m.model.d_model
    micro = max(1, b.batch_size // b.micro_batch_size)
    rows = b.micro_batch_size
    if p.compression == "aqsgd":
        fwd_bits = p.fwd_bits if m.data.train_subset else p.first_visit_bits
        return (float(micro * group_nbytes(rows, b.seq_len, d, fwd_bits)),
                float(micro * group_nbytes(rows, b.seq_len, d, p.bwd_bits)))
    dense = float(payload_nbytes(p.wire_dtype, b.batch_size, b.seq_len, d))
    return dense, dense


def step_workload(m: RunManifest, lanes: int | None = None) -> Workload:
    """The cost model's workload of run `m` with `lanes` lanes (default: the manifest's replicas)."""
    S = m.plan.stages
    D = lanes if lanes is not None else m.plan.replicas
    fwd, bwd = boundary_nbytes(m) if S > 1 else (0.0, 0.0)
    return Workload(stages=S, lanes=D,
                    grad_bytes=tuple(D * shard_nbytes(m.plan.sync, m.stage_params(s), D) for s in range(S)),
                    fwd_bytes=(fwd,) * (S - 1), bwd_bytes=(bwd,) * (S - 1),
                    flops=tuple(stage_flops(m, s) for s in range(S)),
                    micro_batches=max(1, m.batch.batch_size // m.batch.micro_batch_size))


def run_bytes(m: RunManifest) -> RunBytes:
    """What the placer needs of run `m`: its workload by lane count, each stage's state, a re-formed lane link's
    extra first visits (AQ-SGD with samples that come back: each buffered sample once at first_visit_bits instead
    of fwd_bits)."""
    p, b, d = m.plan.pipeline, m.batch, m.model.d_model
    extra = 0.0
    if m.plan.stages > 1 and p.compression == "aqsgd" and m.data.train_subset:
        extra = m.data.train_subset * b.seq_len * d * max(0, p.first_visit_bits - p.fwd_bits) / 8
    return RunBytes(workload=lambda lanes: step_workload(m, lanes),
                    state_bytes=tuple(float(STATE_BYTES_PER_PARAM * m.stage_params(s)) for s in range(m.plan.stages)),
                    first_visit_bytes=extra)


def make_placer(m: RunManifest, book: LinkBook, replan: ReplanConfig = ReplanConfig()) -> Placer:
    """The run's placer, as its manifest asks: by the network (from `book`), or first fit."""
    if m.plan.placement == "first-fit":
        return Placer()
    return NetworkPlacer(book, run_bytes(m), config=PlacerConfig(replan=replan))
