"""Tensor frames: every codec round-trips through a frame; bad headers and payloads raise DecodeError, never over-read."""

from __future__ import annotations

import struct

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from shoal.kernels.codec import CastCodec, E3M0Codec, Encoded, NoCompression, QuantCodec, codec_for, tensor_from_buffer
from shoal.kernels.topk import decode_topk, encode_topk
from shoal.protocol.errors import DecodeError, TooLargeError
from shoal.protocol.frames import MAGIC, TensorHeader, decode_frame, encode_frame, expected_payload_nbytes, make_header
from shoal.protocol.wire import pack

CODECS = [NoCompression(), CastCodec(torch.float16), CastCodec(torch.bfloat16), QuantCodec(2), QuantCodec(3), QuantCodec(8), E3M0Codec()]


def to_frame(e: Encoded) -> bytes:
    h = make_header(e.codec, e.dtype, e.shape, e.bits, e.bucket, e.count, e.payload_bytes())
    return b"".join(bytes(p) for p in encode_frame(h, e.payload_bytes()))


def from_frame(buf: bytes) -> Encoded:
    h, payload = decode_frame(buf)
    return Encoded(h.codec, h.dtype, h.shape, h.bits, h.bucket, h.count, tensor_from_buffer(payload))


@given(
    codec=st.sampled_from(CODECS),
    shape=st.lists(st.integers(0, 9), min_size=0, max_size=3).map(tuple),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
)
def test_every_codec_roundtrips_through_a_frame(codec, shape, dtype):
    x = torch.randn(shape).to(dtype)
    e = codec.encode(x)
    assert e.nbytes == expected_payload_nbytes(e.codec, e.dtype, e.numel, e.bits, e.bucket, e.count)
    e2 = from_frame(to_frame(e))
    assert torch.equal(codec_for(e2).decode(e2), codec_for(e).decode(e))


@given(n=st.integers(0, 2000), bits=st.sampled_from([2, 4, 8]))
def test_topk_roundtrips_through_a_frame(n, bits):
    e = encode_topk(torch.randn(n).half(), 0.2, bits)
    assert torch.equal(decode_topk(from_frame(to_frame(e))), decode_topk(e))


def good_frame() -> bytes:
    return to_frame(QuantCodec(4).encode(torch.randn(300)))


def raw_frame(header: dict, payload: bytes) -> bytes:
    hb = pack(header)
    return struct.pack(">4sI", MAGIC, len(hb)) + hb + payload


def header_map(**over) -> dict:
    m = {"v": 1, "codec": "qb", "dtype": "float32", "shape": [300], "bits": 4, "bucket": 128, "count": 0, "nbytes": 156, "crc32": 0}
    m.update(over)
    return m


def test_payload_length_mismatch():
    f = good_frame()
    with pytest.raises(DecodeError, match="nbytes"):
        decode_frame(f[:-1])
    with pytest.raises(DecodeError, match="nbytes"):
        decode_frame(f + b"\0")


def test_header_length_disagreeing_with_formula():
    with pytest.raises(DecodeError, match="implies"):
        decode_frame(raw_frame(header_map(nbytes=157), bytes(157)))


def test_unknown_codec_and_dtype_and_bits():
    for bad in (header_map(codec="zstd"), header_map(dtype="int8"), header_map(bits=5), header_map(bits=True)):
        with pytest.raises(DecodeError):
            decode_frame(raw_frame(bad, bytes(156)))


def test_absurd_shapes_fail_before_any_allocation():
    for shape in ([1 << 40], [1 << 20, 1 << 20, 1 << 20], [-1], [1] * 9, ["3"]):
        with pytest.raises(DecodeError):
            decode_frame(raw_frame(header_map(shape=shape), bytes(156)))
    with pytest.raises(TooLargeError):
        decode_frame(raw_frame(header_map(shape=[10**6], nbytes=expected_payload_nbytes("qb", "float32", 10**6, 4, 128, 0)), b""), max_numel=1000)


def test_checksum_and_magic():
    f = bytearray(good_frame())
    f[-1] ^= 1
    with pytest.raises(DecodeError, match="checksum"):
        decode_frame(bytes(f))
    with pytest.raises(DecodeError, match="magic"):
        decode_frame(b"XXXX" + bytes(f[4:]))


def test_topk_count_bounds():
    with pytest.raises(DecodeError):
        decode_frame(raw_frame(header_map(codec="topk", shape=[128], count=129), b""))


def test_payload_is_a_view_not_a_copy():
    f = bytearray(good_frame())
    h, payload = decode_frame(f)
    assert isinstance(payload, memoryview) and payload.obj is f and payload.nbytes == h.nbytes


@given(data=st.binary(max_size=300))
def test_garbage_never_escapes_as_another_error(data):
    for buf in (data, MAGIC + data, good_frame()[:8] + data):
        try:
            decode_frame(buf)
        except DecodeError:
            pass


def test_header_dataclass_roundtrip():
    h = make_header("fp16", "float32", (2, 3), 16, 0, 0, bytes(12))
    assert TensorHeader.from_map(h.to_map()) == h
