"""GPU parity: the Triton quantize/pack and unpack/dequantize kernels equal the torch reference bit for bit."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@needs_cuda
@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("n", [1, 127, 128, 1000, 1 << 20])
def test_triton_matches_reference_bit_for_bit(bits, n):
    from shoal.kernels import fastpath
    from shoal.kernels.quant import dequantize_bucketed_ref, quantize_bucketed_ref

    if not fastpath.fast_path_active():
        pytest.skip(fastpath.FAST_PATH_REASON)
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g) / (torch.rand(n, generator=g) + 0.05)
    ref = quantize_bucketed_ref(x, bits, 128)
    fast = fastpath.quantize_bucketed(x.cuda(), bits, 128)
    assert torch.equal(fast.scales.cpu(), ref.scales)
    assert torch.equal(fast.codes.cpu(), ref.codes)
    y_fast = fastpath.dequantize_bucketed(fast).cpu()
    assert torch.equal(y_fast, dequantize_bucketed_ref(ref))


def test_fast_path_reason_is_reported():
    from shoal.kernels import fastpath

    assert fastpath.FAST_PATH_REASON
    assert fastpath.fast_path_active() == (fastpath._FAST is not None)


@needs_cuda
@pytest.mark.parametrize("n", [1000, (1 << 16) + 3])
def test_cocktail_payload_is_the_same_bytes_on_gpu_and_cpu(n):
    """A GPU node and a CPU node put the same bytes on the wire for the same delta (top-k bitmap, Q4, scales)."""
    from shoal.kernels.topk import encode_topk

    g = torch.Generator().manual_seed(n)
    delta = (torch.randn(n, generator=g) * 1e-3).to(torch.float16)
    cpu = encode_topk(delta, 0.2, 4, 128)
    gpu = encode_topk(delta.cuda(), 0.2, 4, 128)
    assert gpu.count == cpu.count
    assert torch.equal(gpu.payload.cpu(), cpu.payload)
