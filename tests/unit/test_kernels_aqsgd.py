"""Property tests for the AQ-SGD activation-delta codec and its buffer stores (docs/pipeline.md, "AQ-SGD over a
link")."""

from __future__ import annotations

import hashlib

import pytest
import torch

from shoal.kernels.aqsgd import AQSGDCodec, DiskStore, MemoryStore, dequantize_backward, quantize_backward
from shoal.kernels.quant import dequantize_codes, quantize_codes

B, S, H = 4, 8, 32


def h(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def run_epochs(bits, acts_fn, epochs, sender, receiver, n=8):
    out = []
    for ep in range(epochs):
        a = acts_fn(ep)
        for mb in range(0, n, B):
            ids = list(range(mb, mb + B))
            msg, m_s = sender.encode(ids, a[mb : mb + B], ep)
            m_r = receiver.decode(ids, msg, ep)
            assert h(m_s) == h(m_r)
            out.append((ep, ids, a[mb : mb + B], m_r, msg))
    return out


def test_buffers_bit_identical_and_warmup_sends_full():
    torch.manual_seed(0)
    base = torch.randn(8, S, H)
    snd, rcv = AQSGDCodec(4), AQSGDCodec(4)
    log = run_epochs(4, lambda ep: base + 0.05 * ep, 3, snd, rcv)
    for ep, ids, a, m, msg in log:
        assert bool(msg.full.all()) == (ep == 0)
        if ep == 0:
            assert torch.equal(m, a.half())  # never quantized against zero
    for sid in range(8):
        assert h(snd.store.get(sid)) == h(rcv.store.get(sid))


def test_new_sample_after_warmup_is_sent_in_full():
    snd, rcv = AQSGDCodec(2), AQSGDCodec(2)
    a = torch.randn(B, S, H)
    msg, m = snd.encode([0, 1, 2, 3], a, epoch=5)
    assert bool(msg.full.all()) and torch.equal(m, a.half())
    msg, m = snd.encode([0, 1, 10, 11], a, epoch=6)
    assert msg.full.tolist() == [False, False, True, True]
    assert len(rcv.store) == 0


def test_frozen_activation_error_shrinks_per_visit():
    bits = 4
    torch.manual_seed(1)
    a = torch.randn(8, S, H)
    snd, rcv = AQSGDCodec(bits, warmup_epochs=0), AQSGDCodec(bits, warmup_epochs=0)
    snd.store.put(0, torch.zeros(S, H))  # start far away so several visits are needed
    for sid in range(8):
        snd.store.put(sid, a[sid] + 1.0)
        rcv.store.put(sid, a[sid] + 1.0)
    prev = None
    for ep in range(4):
        for ep_, ids, aa, m, msg in run_epochs(bits, lambda e: a, 1, snd, rcv):
            err = float((aa - m.float()).abs().max())
        if prev is not None and prev > 1e-2:
            assert err <= prev * (2.0 ** -(bits - 1) + 2.0**-10) * 1.05 + 2e-3  # fp16 storage floor
        prev = err


def test_drifting_activations_delta_beats_direct():
    torch.manual_seed(2)
    base = torch.randn(8, S, H)
    drift = torch.randn(8, S, H) * 0.01
    snd, rcv = AQSGDCodec(2), AQSGDCodec(2)
    log = run_epochs(2, lambda ep: base + ep * drift, 8, snd, rcv)
    delta_err, direct_err = [], []
    for ep, ids, a, m, msg in log:
        if ep < 3:
            continue
        delta_err.append(float((m.float() - a).norm() / a.norm()))
        c, s = quantize_codes(a, 2, (0, 1))
        direct_err.append(float((dequantize_codes(c, s, 2) - a).norm() / a.norm()))
    assert max(delta_err) < 0.05 < 0.3 < min(direct_err)


def test_wire_bytes_are_b_over_16_of_fp16():
    snd = AQSGDCodec(4)
    a = torch.randn(B, 64, 256)
    snd.encode([0, 1, 2, 3], a, 0)
    msg, _ = snd.encode([0, 1, 2, 3], a, 1)
    fp16 = a.numel() * 2
    assert msg.wire_nbytes == pytest.approx(fp16 * 4 / 16, rel=0.02)  # + one fp16 scale per channel
    c, s = quantize_backward(a, 8)
    assert c.numel() * 8 // 8 + 2 * s.numel() == pytest.approx(fp16 * 8 / 16, rel=0.01)
    g = dequantize_backward(c, s, 8)
    assert float((g - a).abs().max()) <= float(a.abs().max()) * (2.0**-7 + 2.0**-10)


def test_disk_store_matches_memory_store(tmp_path):
    torch.manual_seed(3)
    base = torch.randn(8, S, H)
    mem_s, mem_r = AQSGDCodec(3), AQSGDCodec(3)
    disk_s = AQSGDCodec(3, store=DiskStore(tmp_path / "s.bin", 8, (S, H)))
    disk_r = AQSGDCodec(3, store=DiskStore(tmp_path / "r.bin", 8, (S, H)))
    fn = lambda ep: base + 0.1 * ep  # noqa: E731
    a_log = run_epochs(3, fn, 3, mem_s, mem_r)
    b_log = run_epochs(3, fn, 3, disk_s, disk_r)
    for x, y in zip(a_log, b_log):
        assert torch.equal(x[3], y[3])
    assert len(disk_s.store) == 8
    with pytest.raises(ValueError):
        disk_s.store.put(99, torch.zeros(S, H))
    assert isinstance(mem_s.store, MemoryStore)
