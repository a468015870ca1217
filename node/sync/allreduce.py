"""Uncompressed data parallelism: gradients averaged every step by a sharded reduce-scatter + all-gather (fp32 or fp16)."""

from __future__ import annotations

from typing import Any

import torch

from shoal.kernels.codec import CastCodec, Codec, NoCompression
from shoal.node.sync.base import GroupSync, RoundReport, flat_grads, flat_params, write_flat_grads
from shoal.node.train.control import StepControl
from shoal.swarm.state.snapshot import hash_tensor


def wire_codec(dtype: str) -> Codec:
    """The manifest's all-reduce dtype as a codec: fp32 raw, fp16/bf16 cast."""
    return {"fp32": NoCompression(), "fp16": CastCodec(torch.float16), "bf16": CastCodec(torch.bfloat16)}[dtype]


class AllReduceSync(GroupSync):
    """The baseline every comparison needs: mean gradient over the group before every optimizer step.

    Replicas start from the same weights (same seed) and apply the same averaged gradient with the same optimizer,
    so their parameters stay bit-identical; `state_hash` hashes them after each step.
    """

    name = "allreduce"

    def __init__(self, *, dtype: str = "fp32", **kw: Any):
        super().__init__(**kw)
        self.codec = wire_codec(dtype)

    def before_optimizer_step(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                              control: StepControl) -> bool:
        self.device = next(model.parameters()).device
        report = RoundReport()
        mean, _ = self.allreduce_mean(flat_grads(model), self.codec, self.group(control), control.step, "grad", report)
        report.into(control)
        write_flat_grads(model, mean)
        self.rounds += 1
        return True

    def after_optimizer_step(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                             control: StepControl) -> None:
        self.last_hash = hash_tensor(flat_params(model))

    def enter(self, model: torch.nn.Module) -> None:
        """The loaded parameters are the group's: they are what the next vote compares."""
        self.last_hash = hash_tensor(flat_params(model))

    def state_dict(self) -> dict[str, Any]:
        return {"rounds": self.rounds}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rounds = int(state.get("rounds", 0))
