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


@needs_cuda
@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("bucket", [96, 384, 520, 4096])
def test_triton_matches_reference_for_buckets_of_any_whole_byte_size(bits, bucket):
    """AQ-SGD's per-channel buckets are rows x sequence long (rarely a power of two): the kernels mask a padded block."""
    from shoal.kernels import fastpath
    from shoal.kernels.quant import dequantize_bucketed_ref, quantize_bucketed_ref

    if not fastpath.fast_path_active():
        pytest.skip(fastpath.FAST_PATH_REASON)
    n = bucket * 37 + (bucket // 2)  # a partial last bucket too
    g = torch.Generator().manual_seed(bucket * bits)
    x = torch.randn(n, generator=g) / (torch.rand(n, generator=g) + 0.05)
    assert fastpath._fast_ok(x.cuda(), bits, bucket, False)
    ref = quantize_bucketed_ref(x, bits, bucket)
    fast = fastpath.quantize_bucketed(x.cuda(), bits, bucket)
    assert torch.equal(fast.scales.cpu(), ref.scales)
    assert torch.equal(fast.codes.cpu(), ref.codes)
    assert torch.equal(fastpath.dequantize_bucketed(fast).cpu(), dequantize_bucketed_ref(ref))


@needs_cuda
@pytest.mark.parametrize("n_rows, seq, hidden", [(6, 12, 40), (8, 128, 256)])
def test_aqsgd_link_puts_the_same_bytes_on_the_wire_from_a_gpu_and_a_cpu(n_rows, seq, hidden):
    """A stage on CUDA quantizes its activation deltas (and first visits, and gradients) on the GPU, and sends the
    bytes a CPU stage would send for the same activations and store: a GPU sender and a CPU receiver stay
    bit-identical."""
    from shoal.kernels import fastpath
    from shoal.swarm.lane.aq_codec import AQSpec, encode_acts, encode_group
    from shoal.swarm.lane.aq_store import LinkStore, StoreConfig

    if not fastpath.fast_path_active():
        pytest.skip(fastpath.FAST_PATH_REASON)
    g = torch.Generator().manual_seed(n_rows * seq)
    stores = [LinkStore(StoreConfig(row_shape=(seq, hidden), train_samples=100)) for _ in range(2)]
    for sid in range(0, 2 * n_rows, 2):  # every other sample has a committed row: deltas and first visits mix
        row = torch.randn(seq, hidden, generator=g).to(torch.float16)
        for st in stores:
            st.put(sid, 1, row)
    ids = list(range(n_rows))
    acts = torch.randn(n_rows, seq, hidden, generator=g) * 3
    spec = AQSpec()
    cpu = encode_acts(spec, stores[0], ids, acts, set(), set())
    gpu = encode_acts(spec, stores[1], ids, acts.cuda(), set(), set())
    assert cpu.base_versions == gpu.base_versions and 0 < cpu.n_first < n_rows
    assert cpu.frames == gpu.frames
    assert all(a == b and torch.equal(x, y) for (a, x), (b, y) in zip(cpu.rows, gpu.rows))
    grad = torch.randn(n_rows, seq, hidden, generator=g) * 1e-3
    assert encode_group(grad, 8)[1] == encode_group(grad.cuda(), 8)[1]
