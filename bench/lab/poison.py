"""A poisoning replica for benchmarks and attack tests: its synchronizer's outgoing updates, scaled or sign-flipped.

A `Fault` (see `shoal.node.sync.base`) that multiplies what a member sends: its own contributions to chunk owners
(`contribution`), or, as a chunk owner, the broadcast of its chunk's aggregate (`broadcast`). A negative factor
flips the sign; a factor under the loose RMS clip (4x) passes the checks every synchronizer had before robust
aggregation. Quantized payloads are scaled through their fp16 bucket scales, raw fp32 payloads value by value, so
the frame stays well formed: only the numbers lie.
"""

from __future__ import annotations

import torch

from shoal.kernels.codec import Encoded
from shoal.node.sync.base import Fault


def contribution(phase: str) -> bool:
    """Phases that carry a member's own contribution to an owner (not an owner's broadcast)."""
    return phase == "up" or phase.endswith("/rs")


def broadcast(phase: str) -> bool:
    """Phases that carry an owner's aggregate of its chunk to every member."""
    return phase == "down" or phase.endswith("/ag")


def scaled(e: Encoded, factor: float) -> Encoded:
    """`e` with every value multiplied by `factor` (negative: sign-flipped)."""
    p = e.payload.clone()
    if e.codec == "none":
        p.view(torch.float32).mul_(factor)
    elif e.codec in ("fp16", "bf16"):
        p.view(torch.float16 if e.codec == "fp16" else torch.bfloat16).mul_(factor)
    else:  # quantized: the fp16 bucket scales sit at the end of the payload
        nscales = -(-(e.count if e.codec == "topk" else e.numel) // e.bucket)
        p[p.numel() - 2 * nscales:].view(torch.float16).mul_(factor)
    return Encoded(e.codec, e.dtype, e.shape, e.bits, e.bucket, e.count, p)


def poisoner(factor: float, *, phases=contribution) -> Fault:
    """A Fault multiplying every update of the matching phases by `factor`; `fault.sent` counts them."""

    def fault(phase: str, peer: str, e: Encoded) -> Encoded:
        if not phases(phase):
            return e
        fault.sent += 1
        return scaled(e, factor)

    fault.sent = 0
    return fault
