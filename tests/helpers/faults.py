"""Faults a test injects into a synchronizer's outgoing updates (`sync.fault`): poison, spikes, lost messages."""

from __future__ import annotations

import torch

from shoal.kernels.codec import Encoded


def poison(how: str):
    """A Fault: NaN or 1e4x values in every outgoing update (scales for quantized payloads, values for raw fp32)."""

    def fault(phase: str, peer: str, e: Encoded) -> Encoded:
        p = e.payload.clone()
        if e.codec == "none":
            v = p.view(torch.float32)
        else:
            nscales = -(-(e.count if e.codec == "topk" else e.numel) // e.bucket)
            v = p[p.numel() - 2 * nscales:].view(torch.float16)
        if how == "nan":
            v.fill_(float("nan"))
        else:
            v.mul_(1e4 if e.codec == "none" else 1.0).add_(1e3 if e.codec != "none" else 0.0)
        return Encoded(e.codec, e.dtype, e.shape, e.bits, e.bucket, e.count, p)

    return fault


def contribution(phase: str) -> bool:
    """Phases that carry a member's own contribution to an owner (not an owner's broadcast)."""
    return phase == "up" or phase.endswith("/rs")


def spike(factor: float):
    """A Fault: every contribution `factor` x larger (an honest gradient spike, not poison)."""

    def fault(phase: str, peer: str, e: Encoded) -> Encoded:
        if not contribution(phase):
            return e
        p = e.payload.clone()
        if e.codec == "none":
            p.view(torch.float32).mul_(factor)
        else:  # quantized: scale the fp16 bucket scales
            nscales = -(-(e.count if e.codec == "topk" else e.numel) // e.bucket)
            p[p.numel() - 2 * nscales:].view(torch.float16).mul_(factor)
        return Encoded(e.codec, e.dtype, e.shape, e.bits, e.bucket, e.count, p)

    return fault


def drop_first(phase_wanted):
    """A Fault: the first contribution of a matching phase to one peer is never sent (lost on one link only)."""
    dropped = []

    def fault(phase: str, peer: str, e: Encoded) -> Encoded | None:
        if not dropped and phase_wanted(phase):
            dropped.append(peer)
            return None
        return e

    fault.dropped = dropped
    return fault
