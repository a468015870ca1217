"""Top-k by magnitude, sent as a packed bitmap over the candidate subset plus the Q_b of the selected values."""

from __future__ import annotations

import math

import torch

from shoal.kernels.bitpack import pack_bits, packed_nbytes, unpack_bits
from shoal.kernels.codec import Encoded, as_bytes, dtype_name, split, view_as
from shoal.kernels.fastpath import dequantize_bucketed, quantize_bucketed
from shoal.kernels.quant import Bucketed, NonFiniteError, check_bits


def topk_count(n: int, ratio: float, multiple: int = 128) -> int:
    """k = floor(ratio * n) rounded down to a multiple of `multiple`."""
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"ratio must be in [0, 1], got {ratio}")
    return int(ratio * n + 1e-9) // multiple * multiple


def topk_mask(a: torch.Tensor, k: int) -> torch.Tensor:
    """The k largest of `a` as a bool mask, ties at the k-th value broken by the lower index: the same selection on
    every device (torch.topk breaks ties one way on a CPU and another on CUDA)."""
    sel = torch.zeros(a.numel(), dtype=torch.bool, device=a.device)
    if k == 0:
        return sel
    kth = torch.topk(a, k, sorted=False).values.min()
    sel = a > kth
    ties = (a == kth).nonzero().flatten()[: k - int(sel.sum())]
    sel[ties] = True
    return sel


def topk_sizes(n: int, k: int, bits: int, bucket: int) -> list[int]:
    """Payload layout: bitmap, packed value codes, fp16 value scales."""
    return [packed_nbytes(n, 1), packed_nbytes(k, bits), 2 * (-(-k // bucket))]


def encode_topk(delta: torch.Tensor, ratio: float, bits: int = 4, bucket: int = 128) -> Encoded:
    """C(delta) = Q_b(TopK_ratio(delta)) for a 1-D tensor; NaN/Inf anywhere in delta are rejected."""
    check_bits(bits)
    if delta.dim() != 1:
        raise ValueError("top-k encodes a 1-D tensor")
    n = delta.numel()
    k = topk_count(n, ratio, bucket)
    x = delta if delta.dtype == torch.float32 else delta.float()
    if n and not math.isfinite(float(x.sum())):  # one pass: NaN/Inf (or overflow) anywhere propagate
        raise NonFiniteError("delta holds NaN or Inf")
    sel = topk_mask(x.abs(), k)
    values = x[sel]  # selected values in ascending index order: what the bitmap tells the receiver
    q = quantize_bucketed(values, bits, bucket)
    payload = torch.cat([pack_bits(sel.view(torch.uint8), 1), q.codes, as_bytes(q.scales)])
    return Encoded("topk", dtype_name(delta.dtype), (n,), bits, bucket, k, payload)


def decode_topk_parts(e: Encoded) -> tuple[torch.Tensor, torch.Tensor]:
    """(selection bool mask of n, dequantized selected values float32 of k) from a top-k payload."""
    if e.codec != "topk" or len(e.shape) != 1:
        raise ValueError("not a 1-D top-k payload")
    n, k = e.shape[0], e.count
    bitmap, codes, scales = split(e.payload, topk_sizes(n, k, e.bits, e.bucket))
    sel = unpack_bits(bitmap, 1, n).view(torch.bool)
    if int(sel.sum()) != k:
        raise ValueError(f"bitmap selects {int(sel.sum())} values, header says {k}")
    values = dequantize_bucketed(Bucketed(k, e.bits, e.bucket, codes, view_as(scales, torch.float16)))
    return sel, values


def decode_topk(e: Encoded) -> torch.Tensor:
    """Dense float32 reconstruction (zeros where not selected)."""
    sel, values = decode_topk_parts(e)
    out = torch.zeros(e.shape[0], dtype=torch.float32, device=values.device)
    out[sel] = values
    return out
