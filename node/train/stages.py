"""The model a trainer trains, whatever its architecture: one stage of the run's model, built from the manifest.

The trainer, the memory estimate and export see only `StageModel`: the built-in GPT (node/train/model.py) and a
Hugging Face causal LM (node/train/hf.py) both are one. A stage maps token ids (first stage) or hidden states to
hidden states or logits (last stage); its parameter names are the whole model's, so stages' states are slices of
one state.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, runtime_checkable

import torch

from shoal.node.train.model import GPTConfig, build_stage, lm_loss
from shoal.protocol.manifest import RunManifest, even_split

__all__ = ["StageModel", "build_stage_model", "lm_loss", "stage_layers", "trained_weights"]


@runtime_checkable
class StageModel(Protocol):
    """One stage of a run's model: a torch module (parameters, state_dict, train/eval) with these too."""

    has_embedding: bool  # takes token ids
    has_head: bool  # returns logits
    first_layer: int
    last_layer: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...

    def num_params(self) -> int: ...


def stage_layers(manifest: RunManifest, stage: int) -> tuple[int, int]:
    """The [first, last) decoder layers of `stage` in the run's plan."""
    return even_split(manifest.model.n_layers, manifest.plan.stages)[stage]


def build_stage_model(manifest: RunManifest, stage: int, *, weights: Path | None = None,
                      initial: bool = True) -> torch.nn.Module:
    """Stage `stage` of the run's model on the CPU: initialized from the run's seed, or, for a model with initial
    weights, loaded from `weights` (the file whose sha256 the manifest names, already checked against it).
    `initial=False`: a trained state is loaded next, so the initial weights are not needed."""
    m, stages = manifest.model, manifest.plan.stages
    if m.hf is None:
        return build_stage(GPTConfig.from_spec(m, manifest.batch.seq_len), stage, stages, seed=manifest.seed)
    from shoal.node.train.hf import HFStage

    first, last = stage_layers(manifest, stage)
    model = HFStage(m.hf, first, last, stage == 0, stage == stages - 1, tied=m.tied(stages), seed=manifest.seed)
    if m.hf.weights and initial:
        if weights is None:
            raise ValueError(f"the run starts from weights {m.hf.weights[:16]}…, and none were given")
        model.load_weights(weights)
    return model


def trained_weights(manifest: RunManifest, stage: int, state: dict) -> dict[str, torch.Tensor]:
    """Stage `stage`'s weights from its checkpointed training state, with a synchronizer round that was still in
    flight applied (a checkpoint carries it pending: CocktailSGD's `pending_x`, the stage's parameters after that
    round, flat in the stage model's parameter order)."""
    weights = dict(state["model"])
    sync = state.get("sync")
    pending = sync.get("pending_x") if isinstance(sync, dict) else None
    if isinstance(pending, torch.Tensor):
        names = [n for n, _ in build_stage_model(manifest, stage, initial=False).named_parameters()]
        sizes = [weights[n].numel() for n in names]
        if pending.numel() == sum(sizes):
            for n, flat in zip(names, pending.reshape(-1).split(sizes)):
                weights[n] = flat.reshape(weights[n].shape).to(weights[n].dtype)
    return weights
