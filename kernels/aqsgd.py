"""AQ-SGD activation compression: per-sample fp16 buffers on both sides, Q_b of the change after warm-up; direct Q_b backward."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from shoal.kernels.quant import check_bits, dequantize_codes, quantize_codes


class MemoryStore:
    """Per-sample buffers m(sample) in a dict of fp16 tensors."""

    def __init__(self) -> None:
        self._m: dict[int, torch.Tensor] = {}

    def get(self, sid: int) -> torch.Tensor | None:
        return self._m.get(sid)

    def put(self, sid: int, value: torch.Tensor) -> None:
        self._m[sid] = value.to(torch.float16).clone()

    def __len__(self) -> int:
        return len(self._m)


class DiskStore:
    """Per-sample buffers in one fp16 file mapped into memory (torch.from_file), `capacity` slots of `sample_shape`."""

    def __init__(self, path: str | os.PathLike, capacity: int, sample_shape: tuple[int, ...]):
        self.sample_shape = tuple(sample_shape)
        per = 1
        for d in self.sample_shape:
            per *= d
        self.capacity, self._per = capacity, per
        self._data = torch.from_file(os.fspath(path), shared=True, size=capacity * per, dtype=torch.float16)
        self._slot: dict[int, int] = {}

    def get(self, sid: int) -> torch.Tensor | None:
        i = self._slot.get(sid)
        return None if i is None else self._data[i * self._per : (i + 1) * self._per].view(self.sample_shape)

    def put(self, sid: int, value: torch.Tensor) -> None:
        if tuple(value.shape) != self.sample_shape:
            raise ValueError(f"sample of shape {tuple(value.shape)}, store holds {self.sample_shape}")
        i = self._slot.get(sid)
        if i is None:
            if len(self._slot) >= self.capacity:
                raise ValueError(f"disk store full ({self.capacity} samples)")
            i = self._slot[sid] = len(self._slot)
        self._data[i * self._per : (i + 1) * self._per].copy_(value.reshape(-1).to(torch.float16))

    def __len__(self) -> int:
        return len(self._slot)


@dataclass(frozen=True, slots=True)
class AQMessage:
    """One micro-batch crossing a boundary: full fp16 rows for samples without a buffer, Q_b codes for the rest."""

    full: torch.Tensor  # bool (B,): sample sent in full
    full_values: torch.Tensor  # fp16 (n_full, *sample_shape)
    codes: torch.Tensor  # uint8 (n_delta, *sample_shape) codes q+L (packing belongs to the frame layer)
    scales: torch.Tensor  # fp16, keepdim over the scale axes of the delta tensor
    bits: int

    @property
    def wire_nbytes(self) -> int:
        """Bytes when sent: fp16 full rows, b-bit packed codes, fp16 scales, the flag bitmap."""
        return 2 * self.full_values.numel() + -(-self.codes.numel() * self.bits // 8) + 2 * self.scales.numel() + -(-self.full.numel() // 8)


class AQSGDCodec:
    """One side of one pipeline boundary (sender or receiver: both run the same buffer updates).

    scale_dims: axes of the (micro-batch, seq, hidden) tensor reduced for one scale; (0, 1) gives one scale per
    hidden channel per micro-batch (the reference default), (2,) per token.
    """

    def __init__(self, bits: int = 4, *, warmup_epochs: int = 1, scale_dims: tuple[int, ...] = (0, 1), store=None):
        check_bits(bits)
        self.bits, self.warmup_epochs, self.scale_dims = bits, warmup_epochs, scale_dims
        self.store = store if store is not None else MemoryStore()

    def _buffers(self, ids: list[int], epoch: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        bufs = [self.store.get(i) if epoch >= self.warmup_epochs else None for i in ids]
        full = torch.tensor([b is None for b in bufs], dtype=torch.bool)
        return full, [b for b in bufs if b is not None]

    def encode(self, ids: list[int], acts: torch.Tensor, epoch: int) -> tuple[AQMessage, torch.Tensor]:
        """Sender: the message for this micro-batch and m, the reconstruction the receiver will feed forward."""
        if len(ids) != acts.shape[0]:
            raise ValueError("one sample id per row")
        full, bufs = self._buffers(ids, epoch)
        full_values = acts[full].to(torch.float16)
        if not bool(torch.isfinite(full_values).all()):
            raise ValueError("activations hold NaN/Inf")
        if bufs:
            m_old = torch.stack(bufs).float()
            codes, scales = quantize_codes(acts[~full].float() - m_old, self.bits, self.scale_dims)
        else:
            codes = torch.empty((0, *acts.shape[1:]), dtype=torch.uint8)
            scales = torch.empty(0, dtype=torch.float16)
        msg = AQMessage(full, full_values, codes, scales, self.bits)
        return msg, self._apply(ids, msg, bufs)

    def decode(self, ids: list[int], msg: AQMessage, epoch: int) -> torch.Tensor:
        """Receiver: update the buffers exactly as the sender did and return m (fp16) to feed forward."""
        full, bufs = self._buffers(ids, epoch)
        if not torch.equal(full, msg.full):
            raise ValueError("sender and receiver disagree on which samples have a buffer")
        return self._apply(ids, msg, bufs)

    def _apply(self, ids: list[int], msg: AQMessage, bufs: list[torch.Tensor]) -> torch.Tensor:
        shape = (len(ids), *(msg.full_values.shape[1:] if msg.full_values.numel() else msg.codes.shape[1:]))
        out = torch.empty(shape, dtype=torch.float16)
        out[msg.full] = msg.full_values
        if bufs:
            m_new = (torch.stack(bufs).float() + dequantize_codes(msg.codes, msg.scales, msg.bits)).to(torch.float16)
            out[~msg.full] = m_new
        for i, sid in enumerate(ids):  # one store write per sample (not per element)
            self.store.put(sid, out[i])
        return out


def quantize_backward(grad: torch.Tensor, bits: int = 8, scale_dims: tuple[int, ...] = (0, 1)):
    """Backward activation gradients: direct Q_b (no delta, no error feedback). Returns (codes, fp16 scales)."""
    return quantize_codes(grad, bits, scale_dims)


def dequantize_backward(codes: torch.Tensor, scales: torch.Tensor, bits: int) -> torch.Tensor:
    return dequantize_codes(codes, scales, bits)
