"""Re-executing another lane's micro-batch at this stage: the check behind verified pipeline stages.

Replicas of a stage that synchronize by all-reduce hold bit-identical weights at every step, so the replica of
stage s in one lane can redo what stage s of another lane did for a micro-batch of step t: from the activations it
received (its previous neighbour's record), its output activations, and from the gradient it received (its next
neighbour's record), the gradient it sent back. On the CPU the result is bit-exact; across devices it is compared
within `Tolerance`. A difference beyond it means the stage sent something else than its computation gave
(docs/verified-stages.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.func import functional_call

from shoal.node.train.batch import micro_loss
from shoal.node.train.model import lm_loss
from shoal.node.train.transcript import MicroRecord, as_received


@dataclass(frozen=True, kw_only=True, slots=True)
class Tolerance:
    """How far a re-executed tensor may be from the one a neighbour received: 0 (exact, one device kind with
    deterministic kernels: the CPU) or a fraction of the received tensor's largest magnitude (across devices)."""

    relative: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.relative < 1.0:
            raise ValueError("relative tolerance must be in [0, 1)")


@dataclass(frozen=True, kw_only=True, slots=True)
class Evidence:
    """The records of one micro-batch around the checked stage (None where its position has no such neighbour, or
    the record is missing): `prev` is the record of the stage before it in its lane, `own` its own, `next` that of
    the stage after. What the stage received comes from its own record (each tensor signed by the neighbour that
    sent it) or, without one, from the sender's; what it sent, from the receivers' records (signed by the stage)."""

    step: int
    micro: int
    prev: MicroRecord | None
    next: MicroRecord | None
    own: MicroRecord | None = None

    def received_act(self) -> torch.Tensor | None:
        if self.own is not None and self.own.act_in is not None:
            return self.own.act_in
        return self.prev.act_out if self.prev is not None else None

    def received_grad(self) -> torch.Tensor | None:
        if self.own is not None and self.own.grad_in is not None:
            return self.own.grad_in
        return self.next.grad_out if self.next is not None else None

    def ids(self) -> torch.Tensor | None:
        for r in (self.own, self.prev, self.next):
            if r is not None and r.ids is not None:
                return r.ids
        return None


@dataclass(frozen=True, kw_only=True, slots=True)
class Check:
    """The outcome of re-executing one micro-batch: None for a part that could not be checked."""

    forward_ok: bool | None  # the output activations the next stage received
    backward_ok: bool | None  # the gradient the previous stage received
    forward_err: float = 0.0  # the largest difference (relative to the received tensor's largest magnitude)
    backward_err: float = 0.0

    @property
    def tampered(self) -> bool:
        return self.forward_ok is False or self.backward_ok is False

    @property
    def checked(self) -> bool:
        return self.forward_ok is not None or self.backward_ok is not None


def snapshot_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A private copy of a stage's parameters and buffers (the weights of the step about to run)."""
    return {k: v.detach().clone() for k, v in {**dict(model.named_parameters()), **dict(model.named_buffers())}.items()}


def _agrees(got: torch.Tensor | None, received: torch.Tensor, tol: Tolerance) -> tuple[bool | None, float]:
    if got is None:
        return None, 0.0  # a wire whose decoding only the link can reproduce
    if got.shape != received.shape:
        return False, float("inf")
    got, received = got.detach().float().cpu(), received.float()
    diff = (got - received).abs().max().item() if got.numel() else 0.0
    scale = max(received.abs().max().item() if received.numel() else 0.0, 1e-30)
    if tol.relative == 0.0:
        return bool(torch.equal(got, received)), diff / scale
    return diff <= tol.relative * scale, diff / scale


def recheck(trainer, params: dict[str, torch.Tensor], ev: Evidence, kind: str, tol: Tolerance = Tolerance(),
            share: int | None = None) -> Check:
    """Re-execute micro-batch `ev.micro` of step `ev.step` at `trainer`'s stage with `params` (that step's weights)
    from the neighbours' records, and compare what the wire (`kind`) would have delivered with what they received.
    `trainer` is a replica of the same stage (any lane); `share`: the checked lane's sequences that step (its part of
    the global batch: the last stage's loss is scaled by it; default: the run's starting lanes' even share)."""
    first, last = trainer.is_first, trainer.is_last
    ids = ev.ids()
    if ids is None:
        return Check(forward_ok=None, backward_ok=None)
    dev = trainer.device
    if first:
        inp = trainer.train_samples.get(ids)[0].to(dev)
    elif ev.received_act() is not None:
        inp = ev.received_act().to(dev).requires_grad_(True)
    else:
        return Check(forward_ok=None, backward_ok=None)
    with trainer._autocast():
        out = functional_call(trainer.model, params, (inp,))
        if last:
            n = share if share is not None else trainer.default_batch().samples
            out = micro_loss(lm_loss(out, trainer.train_samples.get(ids)[1].to(dev)), n, len(ids))
    fwd_ok = fwd_err = None
    if not last and ev.next is not None and ev.next.act_in is not None:
        fwd_ok, fwd_err = _agrees(as_received(out, kind), ev.next.act_in, tol)
    bwd_ok = bwd_err = None
    if not first and ev.prev is not None and ev.prev.grad_in is not None:
        if last:
            (g,) = torch.autograd.grad(out, inp)
        elif ev.received_grad() is not None:
            (g,) = torch.autograd.grad(out, inp, ev.received_grad().to(dev, out.dtype))
        else:
            g = None
        if g is not None:
            bwd_ok, bwd_err = _agrees(as_received(g, kind), ev.prev.grad_in, tol)
    return Check(forward_ok=fwd_ok, backward_ok=bwd_ok, forward_err=fwd_err or 0.0, backward_err=bwd_err or 0.0)
