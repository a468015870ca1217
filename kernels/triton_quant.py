"""Triton fast path for bucketed Q_b: quantize+pack and unpack+dequantize on CUDA (nearest rounding, b in 2, 4, 8)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FAST_BITS = (2, 4, 8)
MAX_BUCKET = 1 << 15  # one program holds a whole bucket: larger ones take the torch reference on the device


def _div_rn():
    for mod in (tl, getattr(tl, "math", None)):
        f = getattr(mod, "div_rn", None) if mod is not None else None
        if f is not None:
            return f
    raise ImportError("triton has no div_rn (IEEE division is needed for bit parity)")


div_rn = _div_rn()


@triton.jit
def _quantize_pack_kernel(x_ptr, codes_ptr, scales_ptr, n, BUCKET: tl.constexpr, BLOCK: tl.constexpr,
                          BITS: tl.constexpr):
    """One program per bucket of BUCKET values (a multiple of 8 // BITS); BLOCK is BUCKET // PER rounded up to a
    power of two (tl.arange needs one): rows past the bucket are masked off."""
    PER: tl.constexpr = 8 // BITS
    L: tl.constexpr = 1 << (BITS - 1)
    ROWS: tl.constexpr = BUCKET // PER
    pid = tl.program_id(0).to(tl.int64)
    rows = tl.arange(0, BLOCK)
    cols = tl.arange(0, PER)
    offs = pid * BUCKET + rows[:, None] * PER + cols[None, :]
    inside = (rows[:, None] < ROWS) & (offs < n)
    x = tl.load(x_ptr + offs, mask=inside, other=0.0).to(tl.float32)
    s16 = tl.max(tl.max(tl.abs(x), axis=1), axis=0).to(tl.float16)
    tl.store(scales_ptr + pid, s16)
    v = div_rn(x * L, s16.to(tl.float32) + 1e-6)
    r = tl.floor(v + 0.5)  # round half to even, as torch.round does
    r = tl.where(((r - v) == 0.5) & ((r - 2.0 * tl.floor(r * 0.5)) != 0.0), r - 1.0, r)
    q = (tl.minimum(tl.maximum(r, -L), L - 1) + L).to(tl.int32)
    q = tl.where(inside, q, 0)  # padding past the end packs as zero bits, as the reference's bit packing does
    shifts = cols * BITS
    packed = tl.sum(q << shifts[None, :], axis=1).to(tl.uint8)
    out = pid * ROWS + rows
    tl.store(codes_ptr + out, packed, mask=(rows < ROWS) & (out < (n + PER - 1) // PER))


@triton.jit
def _unpack_dequantize_kernel(codes_ptr, scales_ptr, out_ptr, n, BUCKET: tl.constexpr, BLOCK: tl.constexpr,
                              BITS: tl.constexpr):
    PER: tl.constexpr = 8 // BITS
    L: tl.constexpr = 1 << (BITS - 1)
    ROWS: tl.constexpr = BUCKET // PER
    pid = tl.program_id(0).to(tl.int64)
    rows = tl.arange(0, BLOCK)
    cols = tl.arange(0, PER)
    idx = pid * ROWS + rows
    packed = tl.load(codes_ptr + idx, mask=(rows < ROWS) & (idx < (n + PER - 1) // PER), other=0).to(tl.int32)
    q = (packed[:, None] >> (cols[None, :] * BITS)) & ((1 << BITS) - 1)
    s = tl.load(scales_ptr + pid).to(tl.float32)
    y = (q.to(tl.float32) - L) * (s / L)
    offs = pid * BUCKET + rows[:, None] * PER + cols[None, :]
    tl.store(out_ptr + offs, y, mask=(rows[:, None] < ROWS) & (offs < n))


def block_for(bucket: int, bits: int) -> int:
    """The kernels' row block for a bucket: its packed bytes rounded up to a power of two."""
    return triton.next_power_of_2(bucket // (8 // bits))


def quantize_pack(x: torch.Tensor, bits: int, bucket: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed codes uint8, fp16 scales) for a contiguous CUDA tensor; the layout matches the reference."""
    flat = x.reshape(-1)
    n = flat.numel()
    nb = -(-n // bucket)
    per = 8 // bits
    codes = torch.empty(-(-n // per), dtype=torch.uint8, device=x.device)
    scales = torch.empty(nb, dtype=torch.float16, device=x.device)
    if n:
        _quantize_pack_kernel[(nb,)](flat, codes, scales, n, BUCKET=bucket, BLOCK=block_for(bucket, bits), BITS=bits)
    return codes, scales


def unpack_dequantize(codes: torch.Tensor, scales: torch.Tensor, bits: int, bucket: int, n: int) -> torch.Tensor:
    out = torch.empty(n, dtype=torch.float32, device=codes.device)
    if n:
        _unpack_dequantize_kernel[(scales.numel(),)](codes, scales, out, n, BUCKET=bucket,
                                                     BLOCK=block_for(bucket, bits), BITS=bits)
    return out
