"""Public bucketed Q_b entry points: the Triton fast path on CUDA when available (chosen once, reason logged), else the reference."""

from __future__ import annotations

import logging

import torch

from shoal.kernels.bitpack import packed_nbytes
from shoal.kernels.quant import Bucketed, NonFiniteError, dequantize_bucketed_ref, quantize_bucketed_ref

log = logging.getLogger(__name__)


def _select():
    if not torch.cuda.is_available():
        return None, "no CUDA device: using the torch reference"
    try:
        from shoal.kernels import triton_quant
    except Exception as e:  # noqa: BLE001 - any import failure means no fast path
        return None, f"triton unavailable ({type(e).__name__}: {e}): using the torch reference"
    return triton_quant, "CUDA and triton present: using the Triton quantize/pack kernels"


_FAST, FAST_PATH_REASON = _select()
log.info("kernels fast path: %s", FAST_PATH_REASON)


def fast_path_active() -> bool:
    return _FAST is not None


def _fast_ok(x: torch.Tensor, bits: int, bucket: int, stochastic: bool) -> bool:
    return (
        _FAST is not None
        and x.is_cuda
        and not stochastic
        and bits in _FAST.FAST_BITS
        and bucket % (8 // bits) == 0  # whole bytes per bucket (AQ-SGD's per-channel buckets are rows x seq)
        and 8 // bits * 16 <= bucket <= _FAST.MAX_BUCKET
    )


def quantize_bucketed(
    x: torch.Tensor, bits: int, bucket: int = 128, *, stochastic: bool = False, generator: torch.Generator | None = None
) -> Bucketed:
    """Q_b over consecutive buckets of the flattened tensor (see quant.quantize_bucketed_ref for the definition)."""
    if _fast_ok(x, bits, bucket, stochastic):
        codes, scales = _FAST.quantize_pack(x.contiguous(), bits, bucket)
        if not bool(torch.isfinite(scales).all()):
            raise NonFiniteError("input holds NaN/Inf or values beyond the fp16 range")
        n = x.numel()
        codes = torch.nn.functional.pad(codes, (0, packed_nbytes(n, bits) - codes.numel()))
        return Bucketed(n, bits, bucket, codes, scales)
    return quantize_bucketed_ref(x, bits, bucket, stochastic=stochastic, generator=generator)


def dequantize_bucketed(q: Bucketed) -> torch.Tensor:
    """Inverse of quantize_bucketed as flat float32."""
    if _fast_ok(q.codes, q.bits, q.bucket, False):
        return _FAST.unpack_dequantize(q.codes, q.scales, q.bits, q.bucket, q.numel)
    return dequantize_bucketed_ref(q)
