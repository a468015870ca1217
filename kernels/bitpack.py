"""Dense bit packing of small unsigned codes (1, 2, 3, 4 or 8 bits each) into uint8 bytes."""

from __future__ import annotations

import torch

SUPPORTED_BITS = (1, 2, 3, 4, 8)


def packed_nbytes(n: int, bits: int) -> int:
    """Bytes for n codes of `bits` bits: n bytes at 8 bits, else groups of 8 values in `bits` bytes."""
    if bits == 8:
        return n
    return -(-n // 8) * bits


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack a 1-D uint8 tensor of codes < 2**bits into ceil(n/8)*bits bytes, first value in the low bits."""
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits}")
    codes = codes.reshape(-1)
    if codes.dtype != torch.uint8:
        codes = codes.to(torch.uint8)
    n = codes.numel()
    if bits == 8:
        return codes.contiguous()
    pad = (-n) % 8
    if pad:
        codes = torch.cat([codes, codes.new_zeros(pad)])
    if bits == 3:
        g = codes.view(-1, 8).to(torch.int32)
        word = g[:, 0] | (g[:, 1] << 3) | (g[:, 2] << 6) | (g[:, 3] << 9)
        word |= (g[:, 4] << 12) | (g[:, 5] << 15) | (g[:, 6] << 18) | (g[:, 7] << 21)
        out = torch.stack([word & 0xFF, (word >> 8) & 0xFF, word >> 16], dim=1)
        return out.to(torch.uint8).reshape(-1)
    per = 8 // bits
    g = codes.view(-1, per)
    out = g[:, 0].clone()
    for i in range(1, per):  # loop over bit positions within a byte, never over elements
        out |= g[:, i] << (bits * i)
    return out


def unpack_bits(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of pack_bits: the first n codes as a 1-D uint8 tensor."""
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits}")
    need = packed_nbytes(n, bits)
    packed = packed.reshape(-1)
    if packed.numel() < need:
        raise ValueError(f"{packed.numel()} packed bytes, need {need} for {n} codes at {bits} bits")
    packed = packed[:need]
    if bits == 8:
        return packed[:n]
    if bits == 3:
        b = packed.view(-1, 3).to(torch.int32)
        word = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)
        shifts = torch.arange(0, 24, 3, dtype=torch.int32, device=packed.device)
        out = (word[:, None] >> shifts) & 7
        return out.to(torch.uint8).reshape(-1)[:n]
    per = 8 // bits
    mask = (1 << bits) - 1
    out = torch.empty(packed.numel(), per, dtype=torch.uint8, device=packed.device)
    for i in range(per):
        torch.bitwise_and(packed >> (bits * i), mask, out=out[:, i])
    return out.reshape(-1)[:n]
