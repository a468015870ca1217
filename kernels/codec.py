"""The codec interface (tensor -> Encoded payload + header fields -> tensor) and the dense codecs: none, fp16, bf16, Q_b, E3M0."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch

from shoal.kernels.bitpack import packed_nbytes
from shoal.kernels.fastpath import dequantize_bucketed, quantize_bucketed
from shoal.kernels.fp4 import dequantize_e3m0, quantize_e3m0
from shoal.kernels.quant import Bucketed, NonFiniteError, check_bits



def dtype_name(dtype: torch.dtype) -> str:
    """torch's own name of a dtype ("float32"): the names the wire uses (protocol.dtypes holds the table)."""
    return str(dtype).removeprefix("torch.")


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a wire name (callers take names only from validated headers)."""
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dt


@dataclass(frozen=True, slots=True)
class Encoded:
    """A compressed tensor: the header fields a frame carries plus one flat uint8 payload."""

    codec: str
    dtype: str  # dtype of the original tensor, restored on decode
    shape: tuple[int, ...]
    bits: int
    bucket: int
    count: int  # codec-specific count (selected values for top-k), else 0
    payload: torch.Tensor  # uint8, 1-D, contiguous

    @property
    def nbytes(self) -> int:
        return self.payload.numel()

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def payload_bytes(self) -> memoryview:
        """The payload as a memoryview over the tensor's memory (no copy on CPU)."""
        return memoryview(self.payload.cpu().numpy()).cast("B")


def tensor_from_buffer(buf: bytes | bytearray | memoryview) -> torch.Tensor:
    """A uint8 tensor viewing a received buffer without copying; decoders only read from it."""
    if len(buf) == 0:
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only buffers: we never write through the view
        return torch.frombuffer(buf, dtype=torch.uint8)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def view_as(payload: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reinterpret payload bytes as dtype; copies only when the bytes are misaligned for it."""
    try:
        return payload.view(dtype)
    except RuntimeError:
        return payload.clone().view(dtype)


def split(payload: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    if payload.numel() != sum(sizes):
        raise ValueError(f"payload of {payload.numel()} bytes, expected {sum(sizes)}")
    out, o = [], 0
    for s in sizes:
        out.append(payload[o : o + s])
        o += s
    return out


def check_finite(x: torch.Tensor) -> None:
    if x.is_floating_point() and x.numel() and not math.isfinite(float(x.sum(dtype=torch.float32))):  # one pass; NaN/Inf propagate
        raise NonFiniteError("input holds NaN or Inf")


class Codec:
    """encode(tensor) -> Encoded; decode(Encoded) -> tensor of the original dtype and shape."""

    name = "abstract"
    bits = 32

    def encode(self, x: torch.Tensor) -> Encoded:
        raise NotImplementedError

    def decode(self, e: Encoded) -> torch.Tensor:
        raise NotImplementedError

    def payload_nbytes(self, numel: int, itemsize: int = 4) -> int:
        raise NotImplementedError

    def bits_per_element(self, numel: int) -> float:
        return 8 * self.payload_nbytes(numel) / max(numel, 1)

    def _header(self, x: torch.Tensor, payload: torch.Tensor, *, bits: int, bucket: int = 0) -> Encoded:
        if not x.dtype.is_floating_point or x.element_size() < 2:  # the frames' float types
            raise TypeError(f"unsupported dtype {x.dtype}")
        return Encoded(self.name, dtype_name(x.dtype), tuple(x.shape), bits, bucket, 0, payload)


class NoCompression(Codec):
    """The raw tensor bytes (the no-op member)."""

    name = "none"

    def encode(self, x: torch.Tensor) -> Encoded:
        return self._header(x, as_bytes(x), bits=8 * x.element_size())

    def decode(self, e: Encoded) -> torch.Tensor:
        dt = torch_dtype(e.dtype)
        split(e.payload, [e.numel * dt.itemsize])
        return view_as(e.payload, dt).reshape(e.shape)

    def payload_nbytes(self, numel: int, itemsize: int = 4) -> int:
        return numel * itemsize


class CastCodec(Codec):
    """Cast to a 16-bit float (fp16 or bf16); non-finite values are rejected."""

    def __init__(self, wire: torch.dtype):
        self.wire = wire
        self.name = {torch.float16: "fp16", torch.bfloat16: "bf16"}[wire]
        self.bits = 16

    def encode(self, x: torch.Tensor) -> Encoded:
        y = x.to(self.wire)
        check_finite(y)
        return self._header(x, as_bytes(y), bits=16)

    def decode(self, e: Encoded) -> torch.Tensor:
        split(e.payload, [2 * e.numel])
        return view_as(e.payload, self.wire).to(torch_dtype(e.dtype)).reshape(e.shape)

    def payload_nbytes(self, numel: int, itemsize: int = 4) -> int:
        return 2 * numel


class QuantCodec(Codec):
    """Q_b in buckets with fp16 scales: packed codes then scales; optional unbiased stochastic rounding."""

    name = "qb"

    def __init__(self, bits: int, bucket: int = 128, *, stochastic: bool = False, seed: int = 0):
        check_bits(bits)
        self.bits, self.bucket, self.stochastic = bits, bucket, stochastic
        self.generator = torch.Generator().manual_seed(seed) if stochastic else None

    def encode(self, x: torch.Tensor) -> Encoded:
        q = quantize_bucketed(x, self.bits, self.bucket, stochastic=self.stochastic, generator=self.generator)
        return self._header(x, torch.cat([q.codes, as_bytes(q.scales)]), bits=self.bits, bucket=self.bucket)

    def decode(self, e: Encoded) -> torch.Tensor:
        codes, scales = split(e.payload, qb_sizes(e.numel, e.bits, e.bucket))
        q = Bucketed(e.numel, e.bits, e.bucket, codes, view_as(scales, torch.float16))
        return dequantize_bucketed(q).to(torch_dtype(e.dtype)).reshape(e.shape)

    def payload_nbytes(self, numel: int, itemsize: int = 4) -> int:
        return sum(qb_sizes(numel, self.bits, self.bucket))


def qb_sizes(numel: int, bits: int, bucket: int) -> list[int]:
    return [packed_nbytes(numel, bits), 2 * (-(-numel // bucket))]


class E3M0Codec(QuantCodec):
    """4-bit floats (sign + 3-bit exponent) with fp16 bucket scales, for DiLoCo outer gradients."""

    name = "e3m0"

    def __init__(self, bucket: int = 128):
        super().__init__(4, bucket)

    def encode(self, x: torch.Tensor) -> Encoded:
        q = quantize_e3m0(x, self.bucket)
        return self._header(x, torch.cat([q.codes, as_bytes(q.scales)]), bits=4, bucket=self.bucket)

    def decode(self, e: Encoded) -> torch.Tensor:
        codes, scales = split(e.payload, qb_sizes(e.numel, 4, e.bucket))
        q = Bucketed(e.numel, 4, e.bucket, codes, view_as(scales, torch.float16))
        return dequantize_e3m0(q).to(torch_dtype(e.dtype)).reshape(e.shape)


def codec_for(e: Encoded) -> Codec:
    """The codec that decodes a received Encoded (dense codecs only; top-k is decoded by topk.decode_topk)."""
    if e.codec == "none":
        return NoCompression()
    if e.codec == "fp16":
        return CastCodec(torch.float16)
    if e.codec == "bf16":
        return CastCodec(torch.bfloat16)
    if e.codec == "qb":
        return QuantCodec(e.bits, e.bucket)
    if e.codec == "e3m0":
        return E3M0Codec(e.bucket)
    raise ValueError(f"unknown codec {e.codec!r}")


DENSE_WIRES = {"fp32": torch.float32, "fp16": torch.float16}


def wire_roundtrip(kind: str, x: torch.Tensor) -> torch.Tensor | None:
    """What the other end of a dense wire of `kind` ("fp32", "fp16") decodes of `x`: float32 on the CPU, a private
    copy; None for any other kind (a compressed wire's decoding depends on more than `x`)."""
    dtype = DENSE_WIRES.get(kind)
    if dtype is None:
        return None
    return x.detach().to("cpu", torch.float32).to(dtype).to(torch.float32).clone()
