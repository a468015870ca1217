"""E3M0 4-bit floats for DiLoCo outer gradients: sign + 3-bit exponent, one fp16 max-abs scale per bucket."""

from __future__ import annotations

import torch

from shoal.kernels.bitpack import pack_bits, unpack_bits
from shoal.kernels.quant import Bucketed, NonFiniteError

#: magnitude code m: 0 -> 0, m in 1..7 -> s * 2^(m-7), i.e. {0, s/64, s/32, ..., s/2, s}
_MAX_CODE = 7


def quantize_e3m0(x: torch.Tensor, bucket: int = 128) -> Bucketed:
    """Round each value to the nearest of {0, ±s·2^-6, ..., ±s} (s = fp16 bucket max-abs), 4 bits each."""
    flat = x.reshape(-1).float()
    n = flat.numel()
    pad = (-n) % bucket
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    g = flat.view(-1, bucket)
    scales = g.abs().amax(dim=1, keepdim=True).to(torch.float16)
    if not bool(torch.isfinite(scales).all()):
        raise NonFiniteError("input holds NaN/Inf or values beyond the fp16 range")
    s = scales.float()
    r = g.abs() / torch.where(s > 0, s, torch.ones_like(s))  # in [0, 1] up to fp16 rounding of s
    # nearest power of two in linear space: between 2^e and 2^(e+1) the midpoint is 1.5 * 2^e
    e = torch.floor(torch.log2(r.clamp_min(2.0**-8) / 1.5)) + 1  # exponent of the nearest power of two
    m = (e + _MAX_CODE).clamp_(1, _MAX_CODE)
    m = torch.where(r < 2.0 ** -(_MAX_CODE) , torch.zeros_like(m), m)  # below half of s/64 -> 0
    codes = m.to(torch.uint8) | ((g < 0).to(torch.uint8) << 3)
    return Bucketed(n, 4, bucket, pack_bits(codes.reshape(-1)[:n], 4), scales.reshape(-1))


def dequantize_e3m0(q: Bucketed) -> torch.Tensor:
    """Inverse of quantize_e3m0 as float32."""
    n, bucket = q.numel, q.bucket
    nb = -(-n // bucket)
    if q.scales.numel() != nb:
        raise ValueError(f"{q.scales.numel()} scales, expected {nb}")
    codes = unpack_bits(q.codes, 4, n)
    if nb * bucket > n:
        codes = torch.cat([codes, codes.new_zeros(nb * bucket - n)])
    codes = codes.view(nb, bucket)
    m = (codes & 7).float()
    mag = torch.where(m > 0, torch.exp2(m - _MAX_CODE), torch.zeros_like(m))
    sign = 1.0 - 2.0 * (codes >> 3).float()
    return (sign * mag * q.scales.view(nb, 1).float()).reshape(-1)[:n]
