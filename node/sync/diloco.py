"""DiLoCo and Streaming DiLoCo (docs/sync.md): H local steps, then an outer Nesterov step on the mean outer
gradient.

Every replica keeps theta, the global parameters after the last outer step (bitwise equal everywhere), and the outer
momentum. Every `inner_steps` steps the outer gradient delta = theta - x is averaged over the group by the sharded
all-reduce (fp32, or E3M0 4-bit with the chunk owner quantizing the mean once so every replica decodes the same
bits); then m = mu*m + mean, theta -= lr_out * (mean + mu*m) (Nesterov, as torch SGD), and the local parameters
are merged with it: x = alpha*x + (1 - alpha)*theta (alpha = 0: x = theta, plain DiLoCo).

Streaming: with P fragments, parameter tensor i belongs to fragment i mod P (strided over the model's layers),
and fragment p syncs at the steps s (counted from 1) with s mod H == floor(H*(p+1)/P) mod H, so each parameter
syncs once every H steps. With `overlap_steps` tau > 0 the fragment's all-reduce runs in the background while the
replica trains tau more steps, and its outer update is applied (and merged into the parameters that went on
training) after step t + tau; tau < H/P keeps at most one fragment on the wire. The inner optimizer state stays local.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from shoal.kernels.codec import E3M0Codec, NoCompression
from shoal.node.sync.base import GroupSync, RoundReport, flat_params, fresh_locals, write_flat_params
from shoal.node.train.control import StepControl
from shoal.swarm.state.snapshot import hash_tensor


@dataclass(slots=True)
class _InFlight:
    fragment: int
    apply_after: int  # the optimizer step after which the outer update is applied
    result: Future | tuple[torch.Tensor, torch.Tensor]  # (mean outer gradient, covered); a Future while on the wire
    report: RoundReport = field(default_factory=RoundReport)  # the round's, written by the thread running it

    def mean(self) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(self.result, Future):
            self.result = self.result.result()
        return self.result


class DilocoSync(GroupSync):
    name = "diloco"

    def __init__(self, *, inner_steps: int = 100, outer_lr: float = 0.7, outer_momentum: float = 0.9,
                 fragments: int = 1, e3m0: bool = False, overlap_steps: int = 0, merge_alpha: float = 0.0, **kw: Any):
        super().__init__(**kw)
        if inner_steps < 1 or fragments < 1:
            raise ValueError("inner_steps and fragments must be >= 1")
        if overlap_steps < 0 or (overlap_steps and overlap_steps * fragments >= inner_steps):
            raise ValueError("overlap_steps must be >= 0 and < inner_steps / fragments (one fragment on the wire)")
        if not 0.0 <= merge_alpha < 1.0:
            raise ValueError("merge_alpha must be in [0, 1)")
        self.inner_steps, self.outer_lr, self.outer_momentum = inner_steps, outer_lr, outer_momentum
        self.fragments, self.overlap_steps, self.merge_alpha = fragments, overlap_steps, merge_alpha
        self.codec = E3M0Codec() if e3m0 else NoCompression()
        self.theta: torch.Tensor | None = None
        self.momentum: torch.Tensor | None = None
        self._frag_idx: list[torch.Tensor] = []
        self._inflight: _InFlight | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="diloco-outer") if overlap_steps else None

    def _ensure(self, model: torch.nn.Module) -> None:
        self.device = next(model.parameters()).device
        if not self._frag_idx:
            idx: list[list[torch.Tensor]] = [[] for _ in range(self.fragments)]
            o = 0
            for i, p in enumerate(model.parameters()):
                idx[i % self.fragments].append(torch.arange(o, o + p.numel(), device=self.device))
                o += p.numel()
            self._frag_idx = [torch.cat(v) if v else torch.empty(0, dtype=torch.int64, device=self.device)
                              for v in idx]
        if self.theta is None:
            self.theta = flat_params(model)
            self.momentum = torch.zeros_like(self.theta)
            self.last_hash = hash_tensor(self.theta)
        elif self.theta.device != self.device:  # loaded from a snapshot (on the CPU)
            self.theta, self.momentum = self.theta.to(self.device), self.momentum.to(self.device)

    def fragment_due(self, step: int) -> list[int]:
        """Fragments whose outer gradient is taken after optimizer step `step` (0-based)."""
        s, h = step + 1, self.inner_steps
        return [p for p in range(self.fragments) if s % h == (h * (p + 1) // self.fragments) % h]

    def before_optimizer_step(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                              control: StepControl) -> bool:
        self._ensure(model)
        return True

    def after_optimizer_step(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                             control: StepControl) -> None:
        self._ensure(model)
        step = control.step
        if self._inflight is not None and step >= self._inflight.apply_after:
            self._apply(model, control)
        for p in self.fragment_due(step):
            self._start(model, p, control)

    def close(self, model: torch.nn.Module, control: StepControl | None = None) -> None:
        """Apply an outer update still in flight now (before a snapshot or at the end)."""
        if self._inflight is not None:
            self._apply(model, control)

    def _start(self, model: torch.nn.Module, frag: int, control: StepControl) -> None:
        if self._inflight is not None:  # cannot happen with tau < H/P, but never two fragments on the wire
            self._apply(model, control)
        idx = self._frag_idx[frag]
        if idx.numel() == 0:
            return
        step = control.step
        delta = self.theta[idx] - flat_params(model)[idx]
        group = self.group(control)  # membership is read at the round boundary, in the trainer thread
        report = RoundReport()
        args = (delta, self.codec, group, step, f"outer{frag}", report)
        if self._pool is None:
            self._inflight = _InFlight(frag, step, self.allreduce_mean(*args), report)
            self._apply(model, control)
        else:
            self._inflight = _InFlight(frag, step + self.overlap_steps, self._pool.submit(self.allreduce_mean, *args),
                                       report)

    def _apply(self, model: torch.nn.Module, control: StepControl | None) -> None:
        """The outer Nesterov step on theta's fragment, then the merge of the local parameters with it. Coordinates
        whose chunk owner was not heard keep theta, momentum and the local progress (it stays in theta - x)."""
        job, self._inflight = self._inflight, None
        mean, covered = job.mean()
        job.report.into(control)
        mean, covered = mean.to(self.device), covered.to(self.device)  # a loaded in-flight update is on the CPU
        idx = self._frag_idx[job.fragment]
        if not bool(covered.all()):
            mean, idx = mean[covered], idx[covered]
        m = self.momentum[idx].mul_(self.outer_momentum).add_(mean)
        self.momentum[idx] = m
        self.theta[idx] = self.theta[idx] - self.outer_lr * (mean + self.outer_momentum * m)
        x = flat_params(model)
        x[idx] = self.theta[idx] if self.merge_alpha == 0 else \
            self.merge_alpha * x[idx] + (1 - self.merge_alpha) * self.theta[idx]
        write_flat_params(model, x)
        self.rounds += 1
        self.last_hash = hash_tensor(self.theta)

    def state_dict(self) -> dict[str, Any]:
        job = self._inflight  # an outer update in flight travels as its result, applied at the same step
        return {"theta": None if self.theta is None else self.theta.clone(),
                "momentum": None if self.momentum is None else self.momentum.clone(), "rounds": self.rounds,
                "inflight": None if job is None else
                {"fragment": job.fragment, "apply_after": job.apply_after, "mean": job.mean()[0].clone(),
                 "covered": job.mean()[1].clone()}}

    def enter(self, model: torch.nn.Module) -> None:
        """x = theta: the inner steps start from the global parameters (another replica's x would count its
        local progress twice in the next outer gradient)."""
        if self.theta is not None:
            write_flat_params(model, self.theta)

    def entry_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """The outer state alone: an entering replica's inner steps start from theta (`enter`) with a fresh inner
        optimizer (another replica's moments follow that replica's own inner steps)."""
        return fresh_locals(state, {k: state["sync"][k] for k in ("theta", "momentum", "inflight")})

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.theta, self.momentum = state.get("theta"), state.get("momentum")
        self.rounds = int(state.get("rounds", 0))
        job = state.get("inflight")
        self._inflight = None if job is None else _InFlight(int(job["fragment"]), int(job["apply_after"]),
                                                            (job["mean"], job["covered"]))
        if self.theta is not None:
            self.last_hash = hash_tensor(self.theta)
