"""Tensor frames: a strict msgpack header (codec, dtype, shape, bits, bucket, count, length, crc32) plus raw payload bytes."""

from __future__ import annotations

import math
import struct
import zlib
from dataclasses import dataclass

from shoal.protocol.dtypes import FLOAT_DTYPES, ITEMSIZE
from shoal.protocol.errors import DecodeError, FieldError, TooLargeError
from shoal.protocol.schema import Choice, Int
from shoal.protocol.wire import expect_map, get_field, pack, unpack

MAGIC = b"SHTF"
VERSION = 1
MAX_HEADER_BYTES = 4096
MAX_NDIM = 8
#: default ceilings: 2^32 elements and 4 GiB of payload per frame; callers pass tighter ones
MAX_NUMEL = 1 << 32
MAX_PAYLOAD_BYTES = 1 << 32

CODECS = ("none", "fp16", "bf16", "qb", "e3m0", "topk")
QUANT_BITS = (2, 3, 4, 8)
_PREFIX = struct.Struct(">4sI")


def packed_nbytes(n: int, bits: int) -> int:
    """Bytes of n codes packed at `bits` bits (n bytes at 8 bits, else groups of 8 values in `bits` bytes)."""
    return n if bits == 8 else -(-n // 8) * bits


def expected_payload_nbytes(codec: str, dtype: str, numel: int, bits: int, bucket: int, count: int) -> int:
    """The payload length a header implies; the kernels produce exactly this many bytes."""
    if codec == "none":
        return numel * ITEMSIZE[dtype]
    if codec in ("fp16", "bf16"):
        return 2 * numel
    if codec in ("qb", "e3m0"):
        return packed_nbytes(numel, bits) + 2 * -(-numel // bucket)
    if codec == "topk":
        return packed_nbytes(numel, 1) + packed_nbytes(count, bits) + 2 * -(-count // bucket)
    raise FieldError("codec", f"unknown codec {codec!r}")


@dataclass(frozen=True, slots=True)
class TensorHeader:
    codec: str
    dtype: str
    shape: tuple[int, ...]
    bits: int
    bucket: int
    count: int
    nbytes: int
    crc32: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def validate(self, *, max_numel: int = MAX_NUMEL, max_payload: int = MAX_PAYLOAD_BYTES) -> None:
        Choice(frozenset(CODECS)).check("codec", self.codec)
        Choice(frozenset(FLOAT_DTYPES)).check("dtype", self.dtype)
        if not isinstance(self.shape, tuple) or len(self.shape) > MAX_NDIM:
            raise FieldError("shape", f"at most {MAX_NDIM} dimensions")
        for d in self.shape:
            Int(0, 1 << 62).check("shape", d)
        n = self.numel
        if n > max_numel:
            raise TooLargeError(f"shape {self.shape} has more than {max_numel} elements")
        want_bits = {"none": (8 * ITEMSIZE[self.dtype],), "fp16": (16,), "bf16": (16,), "e3m0": (4,)}
        Int(1, 64).check("bits", self.bits)
        if self.bits not in want_bits.get(self.codec, QUANT_BITS):
            raise FieldError("bits", f"{self.bits} not valid for codec {self.codec!r}")
        quantized = self.codec in ("qb", "e3m0", "topk")
        Int(1 if quantized else 0, (1 << 20) if quantized else 0).check("bucket", self.bucket)
        if self.codec == "topk":
            if len(self.shape) != 1:
                raise FieldError("shape", "top-k frames are 1-D")
            Int(0, n).check("count", self.count)
        else:
            Int(0, 0).check("count", self.count)
        Int(0, 0xFFFFFFFF).check("crc32", self.crc32)
        want = expected_payload_nbytes(self.codec, self.dtype, n, self.bits, self.bucket, self.count)
        if want > max_payload:
            raise TooLargeError(f"payload of {want} bytes exceeds the limit of {max_payload}")
        if self.nbytes != want:
            raise FieldError("nbytes", f"{self.nbytes} disagrees with the {want} bytes the header implies")

    def to_map(self) -> dict:
        return {
            "v": VERSION, "codec": self.codec, "dtype": self.dtype, "shape": list(self.shape), "bits": self.bits,
            "bucket": self.bucket, "count": self.count, "nbytes": self.nbytes, "crc32": self.crc32,
        }

    @classmethod
    def from_map(cls, m: dict) -> TensorHeader:
        m = expect_map(m, "tensor header")
        v = get_field(m, "v", int)
        if v != VERSION:
            raise FieldError("v", f"unsupported frame version {v}")
        shape = get_field(m, "shape", list)
        if len(shape) > MAX_NDIM:
            raise FieldError("shape", f"at most {MAX_NDIM} dimensions")
        for d in shape:
            if isinstance(d, bool) or not isinstance(d, int):
                raise FieldError("shape", "dimensions must be integers")
        return cls(
            codec=get_field(m, "codec", str), dtype=get_field(m, "dtype", str), shape=tuple(shape),
            bits=get_field(m, "bits", int), bucket=get_field(m, "bucket", int), count=get_field(m, "count", int),
            nbytes=get_field(m, "nbytes", int), crc32=get_field(m, "crc32", int),
        )


def make_header(codec: str, dtype: str, shape, bits: int, bucket: int, count: int, payload) -> TensorHeader:
    """A validated header for a payload (computes length and crc32)."""
    mv = memoryview(payload).cast("B")
    h = TensorHeader(codec, dtype, tuple(shape), bits, bucket, count, mv.nbytes, zlib.crc32(mv))
    h.validate()
    return h


def encode_frame(header: TensorHeader, payload) -> list[bytes | memoryview]:
    """The frame as [prefix+header bytes, payload view] so a writer can send it without concatenating."""
    mv = memoryview(payload).cast("B")
    if mv.nbytes != header.nbytes:
        raise FieldError("nbytes", f"payload of {mv.nbytes} bytes, header says {header.nbytes}")
    hb = pack(header.to_map())
    return [_PREFIX.pack(MAGIC, len(hb)) + hb, mv]


def frame_nbytes(header: TensorHeader) -> int:
    """Bytes of the whole frame `encode_frame` writes for this header: prefix, encoded header, payload."""
    return _PREFIX.size + len(pack(header.to_map())) + header.nbytes


def decode_frame(
    buf, *, max_numel: int = MAX_NUMEL, max_payload: int = MAX_PAYLOAD_BYTES, verify_crc: bool = True
) -> tuple[TensorHeader, memoryview]:
    """Parse one complete frame; returns the header and a zero-copy view of the payload. Raises DecodeError."""
    mv = memoryview(buf).cast("B")
    if mv.nbytes < _PREFIX.size:
        raise DecodeError(f"frame of {mv.nbytes} bytes is shorter than its prefix")
    magic, hlen = _PREFIX.unpack_from(mv)
    if magic != MAGIC:
        raise DecodeError("not a tensor frame (bad magic)")
    if hlen > MAX_HEADER_BYTES:
        raise TooLargeError(f"frame header of {hlen} bytes exceeds {MAX_HEADER_BYTES}")
    if mv.nbytes < _PREFIX.size + hlen:
        raise DecodeError("frame truncated inside its header")
    header = TensorHeader.from_map(unpack(mv[_PREFIX.size : _PREFIX.size + hlen], max_bytes=MAX_HEADER_BYTES))
    header.validate(max_numel=max_numel, max_payload=max_payload)
    payload = mv[_PREFIX.size + hlen :]
    if payload.nbytes != header.nbytes:
        raise FieldError("nbytes", f"payload of {payload.nbytes} bytes, header says {header.nbytes}")
    if verify_crc and zlib.crc32(payload) != header.crc32:
        raise DecodeError("payload checksum mismatch")
    return header, payload
