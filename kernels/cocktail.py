"""CocktailSGD: C(d) = Q_b(TopK_r(d[mask_p])) with worker and server error feedback, the parts a sync round calls."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shoal.kernels.codec import Encoded
from shoal.kernels.mask import RollingMask
from shoal.kernels.quant import check_bits
from shoal.kernels.topk import decode_topk, encode_topk, topk_count


@dataclass(frozen=True, kw_only=True, slots=True)
class CocktailConfig:
    """p: mask fraction; r: top-k fraction of the masked subset; bits: Q_b width; bucket: scale group and multiple."""

    p: float = 0.1
    r: float = 0.2
    bits: int = 4
    bucket: int = 128

    def __post_init__(self) -> None:
        if not 0.0 < self.p <= 1.0 or not 0.0 < self.r <= 1.0:
            raise ValueError("p and r must be in (0, 1]")
        check_bits(self.bits)
        if self.bucket < 8 or self.bucket % 8:
            raise ValueError("bucket must be a positive multiple of 8")

    def bits_per_param(self) -> float:
        """The formula p(1 + r*b + 16r/B) in bits per parameter (exact up to the multiple-of-B truncation)."""
        return self.p * (1 + self.r * self.bits + 16 * self.r / self.bucket)

    def payload_nbytes(self, size: int) -> int:
        n = RollingMask(size, self.p, 0, self.bucket).count
        k = topk_count(n, self.r, self.bucket)
        return n // 8 + k * self.bits // 8 + 2 * (k // self.bucket)


class CocktailCompressor:
    """Stateless compressor of a chunk of `size` parameters; state (x, g, server error) stays with the caller."""

    def __init__(self, size: int, config: CocktailConfig = CocktailConfig()):
        self.size, self.config = size, config

    def mask(self, step: int) -> RollingMask:
        return RollingMask(self.size, self.config.p, step, self.config.bucket)

    def compress(self, delta: torch.Tensor) -> Encoded:
        """C(delta) for an already masked 1-D delta."""
        return encode_topk(delta, self.config.r, self.config.bits, self.config.bucket)

    def decompress(self, e: Encoded) -> torch.Tensor:
        return decode_topk(e)

    # --- worker side -------------------------------------------------------------------------------
    def worker_compress(self, x: torch.Tensor, g: torch.Tensor, step: int) -> Encoded:
        """delta = (x - g)[mask] in fp16; returns C(delta) and applies worker error feedback x[mask] -= C^(delta)."""
        m = self.mask(step)
        delta = (m.gather(x) - m.gather(g).float()).to(torch.float16)
        e = self.compress(delta)
        m.add_(x, self.decompress(e), alpha=-1.0)
        return e

    def worker_apply(self, x: torch.Tensor, g: torch.Tensor, step: int, server: Encoded) -> None:
        """x[mask] += s_hat and g[mask] += s_hat (g is fp16 and stays bitwise equal on every worker)."""
        m = self.mask(step)
        s_hat = self.decompress(server).to(x.device)  # received on the CPU; the replica's state may be on a GPU
        m.add_(x, s_hat)
        m.copy_(g, (m.gather(g).float() + s_hat).to(g.dtype))

    # --- server side (the worker serving this chunk) ------------------------------------------------
    def server_aggregate(self, payloads: list[Encoded], server_error: torch.Tensor, step: int) -> Encoded:
        """s = mean_i C^(delta_i) + e[mask]; s_hat = C(s); e[mask] = s - s_hat. Returns s_hat to broadcast."""
        return self.server_aggregate_values([self.decompress(p) for p in payloads], server_error, step)

    def server_aggregate_values(self, values: list[torch.Tensor], server_error: torch.Tensor, step: int,
                                weights: list[float] | None = None) -> Encoded:
        """`server_aggregate` on already decoded C^(delta_i) (dense over the mask; the caller may have clipped them);
        `weights`: each worker's share of the mean (summing to 1; None: equal)."""
        if not values:
            raise ValueError("no payloads to aggregate")
        if weights is not None and len(weights) != len(values):
            raise ValueError("one weight per payload")
        m = self.mask(step)
        s = m.gather(server_error).float()
        alphas = weights if weights is not None else [1.0 / len(values)] * len(values)
        for v, a in zip(values, alphas):  # one loop per worker, not per element
            s.add_(v.to(s.device), alpha=a)
        e = self.compress(s)
        m.copy_(server_error, (s - self.decompress(e)).to(server_error.dtype))
        return e
