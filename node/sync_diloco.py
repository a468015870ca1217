"""DiLoCo and Streaming DiLoCo (algorithms.md §5): H local steps, then an outer Nesterov step on the mean outer gradient.

Every replica keeps theta, the global parameters after the last outer step (bitwise equal everywhere), and the outer
momentum. Every `inner_steps` steps the outer gradient delta = theta - x is averaged over the group by the sharded
all-reduce (fp32, or E3M0 4-bit with the chunk owner quantizing the mean once so every replica decodes the same
bits); then m = mu*m + mean, theta -= lr_out * (mean + mu*m) (Nesterov, as torch SGD), and x = theta.

Streaming: with P fragments, parameter tensor i belongs to fragment i mod P (strided over the model's layers),
and fragment p syncs at the steps s (counted from 1) with s mod H == floor(H*(p+1)/P) mod H, so each parameter
syncs once every H steps and at most one fragment is on the wire at a time. This build applies each outer
update at once (tau = 0) and replaces the fragment by it (alpha = 0); the inner AdamW state stays local.
"""

from __future__ import annotations

from typing import Any

import torch

from shoal.kernels.codec import E3M0Codec, NoCompression
from shoal.node.sync_base import GroupSync, flat_params, hash_tensor, write_flat_params


class DilocoSync(GroupSync):
    name = "diloco"

    def __init__(self, *, inner_steps: int = 100, outer_lr: float = 0.7, outer_momentum: float = 0.9,
                 fragments: int = 1, e3m0: bool = False, **kw: Any):
        super().__init__(**kw)
        if inner_steps < 1 or fragments < 1:
            raise ValueError("inner_steps and fragments must be >= 1")
        self.inner_steps, self.outer_lr, self.outer_momentum = inner_steps, outer_lr, outer_momentum
        self.fragments = fragments
        self.codec = E3M0Codec() if e3m0 else NoCompression()
        self.theta: torch.Tensor | None = None
        self.momentum: torch.Tensor | None = None
        self._frag_idx: list[torch.Tensor] = []

    def _ensure(self, model: torch.nn.Module) -> None:
        if not self._frag_idx:
            idx: list[list[torch.Tensor]] = [[] for _ in range(self.fragments)]
            o = 0
            for i, p in enumerate(model.parameters()):
                idx[i % self.fragments].append(torch.arange(o, o + p.numel()))
                o += p.numel()
            self._frag_idx = [torch.cat(v) if v else torch.empty(0, dtype=torch.int64) for v in idx]
        if self.theta is None:
            self.theta = flat_params(model)
            self.momentum = torch.zeros_like(self.theta)
            self.last_hash = hash_tensor(self.theta)

    def fragment_due(self, step: int) -> list[int]:
        """Fragments that sync after optimizer step `step` (0-based)."""
        s, h = step + 1, self.inner_steps
        return [p for p in range(self.fragments) if s % h == (h * (p + 1) // self.fragments) % h]

    def before_optimizer_step(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> bool:
        self._ensure(model)
        return True

    def after_optimizer_step(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
        self._ensure(model)
        for p in self.fragment_due(step):
            self._outer_step(model, p, step)

    def _outer_step(self, model: torch.nn.Module, frag: int, step: int) -> None:
        idx = self._frag_idx[frag]
        if idx.numel() == 0:
            return
        x = flat_params(model)
        delta = self.theta[idx] - x[idx]
        mean = self.allreduce_mean(delta, self.codec, self.group(), step, f"outer{frag}")
        m = self.momentum[idx].mul_(self.outer_momentum).add_(mean)
        self.momentum[idx] = m
        self.theta[idx] = self.theta[idx] - self.outer_lr * (mean + self.outer_momentum * m)
        x[idx] = self.theta[idx]
        write_flat_params(model, x)
        self.rounds += 1
        self.last_hash = hash_tensor(self.theta)

    def state_dict(self) -> dict[str, Any]:
        return {"theta": None if self.theta is None else self.theta.clone(),
                "momentum": None if self.momentum is None else self.momentum.clone(), "rounds": self.rounds}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.theta, self.momentum = state.get("theta"), state.get("momentum")
        self.rounds = int(state.get("rounds", 0))
        if self.theta is not None:
            self.last_hash = hash_tensor(self.theta)
