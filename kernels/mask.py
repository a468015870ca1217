"""CocktailSGD's rolling random mask: every floor(1/p)-th coordinate, rolled by one each step; equal on every replica."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class RollingMask:
    """The mask for one step: indices (step + stride*j) mod size for j < count, count a multiple of `multiple`.

    It depends only on (size, p, step), so replicas agree without exchanging indices or seeds.
    """

    size: int
    p: float
    step: int
    multiple: int = 128

    def __post_init__(self) -> None:
        if not 0.0 < self.p <= 1.0:
            raise ValueError(f"p must be in (0, 1], got {self.p}")
        if self.size < 0 or self.step < 0 or self.multiple < 1:
            raise ValueError("size and step must be >= 0, multiple >= 1")

    @property
    def stride(self) -> int:
        return max(1, int(1.0 / self.p + 1e-9))

    @property
    def count(self) -> int:
        return (self.size // self.stride) // self.multiple * self.multiple

    @property
    def offset(self) -> int:
        return self.step % self.size if self.size else 0

    def _pieces(self) -> list[tuple[int, int]]:
        """(start, length) of at most two strided runs that together cover the mask in index order of j."""
        c, s, o, n = self.count, self.stride, self.offset, self.size
        if c == 0:
            return []
        first = min(c, (n - o + s - 1) // s)  # j with o + s*j < n
        runs = [(o, first)]
        if first < c:
            runs.append((o + s * first - n, c - first))
        return runs

    def indices(self) -> torch.Tensor:
        """The selected coordinates as int64 (for tests and debugging; gather/scatter avoid building it)."""
        j = torch.arange(self.count, dtype=torch.int64)
        return (self.offset + self.stride * j) % max(self.size, 1)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """x[mask] as a new contiguous 1-D tensor, read with strided slices."""
        flat = x.reshape(-1)
        self._check(flat)
        parts = [flat[a : a + self.stride * (m - 1) + 1 : self.stride] for a, m in self._pieces()]
        if not parts:
            return flat.new_empty(0)
        return parts[0].clone() if len(parts) == 1 else torch.cat(parts)

    def add_(self, x: torch.Tensor, values: torch.Tensor, alpha: float = 1.0) -> None:
        """x[mask] += alpha * values, in place on a contiguous tensor."""
        flat = x.view(-1)
        self._check(flat)
        if values.numel() != self.count:
            raise ValueError(f"{values.numel()} values for a mask of {self.count}")
        o = 0
        for a, m in self._pieces():
            flat[a : a + self.stride * (m - 1) + 1 : self.stride].add_(values[o : o + m].to(flat.dtype), alpha=alpha)
            o += m

    def copy_(self, x: torch.Tensor, values: torch.Tensor) -> None:
        """x[mask] = values, in place on a contiguous tensor."""
        flat = x.view(-1)
        self._check(flat)
        if values.numel() != self.count:
            raise ValueError(f"{values.numel()} values for a mask of {self.count}")
        o = 0
        for a, m in self._pieces():
            flat[a : a + self.stride * (m - 1) + 1 : self.stride].copy_(values[o : o + m])
            o += m

    def _check(self, flat: torch.Tensor) -> None:
        if flat.numel() != self.size:
            raise ValueError(f"tensor of {flat.numel()} elements for a mask over {self.size}")
