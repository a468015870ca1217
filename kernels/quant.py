"""The shared quantizer Q_b: max-abs scales in fp16, b-bit codes, nearest or stochastic rounding (reference path)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shoal.kernels.bitpack import pack_bits, packed_nbytes, unpack_bits

QUANT_BITS = (2, 3, 4, 8)
EPS = 1e-6


class NonFiniteError(ValueError):
    """The input holds NaN or Inf (or a magnitude beyond fp16's range): it is rejected, never quantized."""


def check_bits(bits: int) -> None:
    if bits not in QUANT_BITS:
        raise ValueError(f"bits must be one of {QUANT_BITS}, got {bits}")


def quantize_codes(
    x: torch.Tensor,
    bits: int,
    dims: tuple[int, ...],
    *,
    stochastic: bool = False,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Q_b with one scale per slice reduced over `dims`: (codes q+L as uint8, same shape; scales fp16, keepdim).

    s = fp16(max|x|), L = 2^(b-1), q = clip(round(x*L/(s+1e-6)), -L, L-1). Stochastic rounding adds
    U[0,1) before floor, unbiased except where the top code clips.
    """
    check_bits(bits)
    if x.dtype != torch.float32:
        x = x.float()
    L = 1 << (bits - 1)
    if x.numel() == 0:
        shape = [1 if d in [dd % max(x.dim(), 1) for dd in dims] else n for d, n in enumerate(x.shape)]
        return torch.empty(x.shape, dtype=torch.uint8, device=x.device), torch.zeros(shape, dtype=torch.float16)
    scales = x.abs().amax(dim=dims, keepdim=True).to(torch.float16)
    if not bool(torch.isfinite(scales).all()):
        raise NonFiniteError("input holds NaN/Inf or values beyond the fp16 range")
    v = x * L / (scales.float() + EPS)
    if stochastic:
        u = torch.rand(v.shape, generator=generator, device=v.device, dtype=v.dtype)
        v = torch.floor_(v.add_(u))
    else:
        v = torch.round_(v)
    v.clamp_(-L, L - 1).add_(L)
    return v.to(torch.uint8), scales


def dequantize_codes(codes: torch.Tensor, scales: torch.Tensor, bits: int) -> torch.Tensor:
    """x_hat = (codes - L) * s / L in float32, scales broadcast against codes."""
    L = 1 << (bits - 1)
    q = codes.to(torch.float32).sub_(L)
    return q.mul_(scales.float() / L)


@dataclass(frozen=True, slots=True)
class Bucketed:
    """A 1-D tensor quantized in buckets: packed codes (uint8) and one fp16 scale per bucket."""

    numel: int
    bits: int
    bucket: int
    codes: torch.Tensor  # uint8, packed_nbytes(numel, bits)
    scales: torch.Tensor  # fp16, ceil(numel / bucket)

    @property
    def nbytes(self) -> int:
        return self.codes.numel() + 2 * self.scales.numel()


def bucketed_nbytes(numel: int, bits: int, bucket: int) -> int:
    return packed_nbytes(numel, bits) + 2 * (-(-numel // bucket))


def quantize_bucketed_ref(
    x: torch.Tensor, bits: int, bucket: int = 128, *, stochastic: bool = False, generator: torch.Generator | None = None
) -> Bucketed:
    """Reference Q_b over consecutive buckets of a flattened tensor (the tail bucket is zero-padded)."""
    check_bits(bits)
    if bucket < 1:
        raise ValueError("bucket must be >= 1")
    flat = x.reshape(-1)
    n = flat.numel()
    if flat.dtype != torch.float32:
        flat = flat.float()
    pad = (-n) % bucket
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    codes, scales = quantize_codes(flat.view(-1, bucket), bits, (1,), stochastic=stochastic, generator=generator)
    return Bucketed(n, bits, bucket, pack_bits(codes.reshape(-1)[:n], bits), scales.reshape(-1))


def dequantize_bucketed_ref(q: Bucketed) -> torch.Tensor:
    """Reference inverse of quantize_bucketed_ref as a flat float32 tensor of q.numel values."""
    n, bucket = q.numel, q.bucket
    nb = -(-n // bucket)
    if q.scales.numel() != nb:
        raise ValueError(f"{q.scales.numel()} scales, expected {nb}")
    codes = unpack_bits(q.codes, q.bits, n)
    pad = nb * bucket - n
    if pad:
        codes = torch.cat([codes, codes.new_full((pad,), 1 << (q.bits - 1))])
    out = dequantize_codes(codes.view(nb, bucket), q.scales.view(nb, 1), q.bits)
    return out.reshape(-1)[:n]
