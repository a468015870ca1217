"""A run's step workload for the placement cost model: the bytes its compression really sends."""

from __future__ import annotations

import dataclasses

import pytest

from shoal.bench.workloads import WORKLOADS
from shoal.protocol import manifest as mf
from shoal.node.run.workload import boundary_nbytes, shard_nbytes, stage_flops, step_workload


@pytest.mark.parametrize("name", ["allreduce", "allreduce-fp16", "cocktail", "diloco-e3m0"])
def test_data_parallel_bytes_agree_with_the_synchronizers_payload_formula(name):
    """A member sends D-1 shards and gets D-1 aggregated ones back: 2 (D-1) shard payloads per step, the payload
    formula the network benchmark checks against measured bytes."""
    w = WORKLOADS[name]
    m = w.manifest(size="tiny", nodes=4, steps=100, lr=3e-3, eval_every=10)
    params = m.stage_params(0)
    per_node = w.payload_formula(params, 4)
    assert 2 * 3 * shard_nbytes(m.plan.sync, params, 4) == pytest.approx(per_node)
    wl = step_workload(m)
    assert wl.grad_bytes == (4 * shard_nbytes(m.plan.sync, params, 4),)


def test_one_lane_has_nothing_to_synchronize():
    m = WORKLOADS["allreduce"].manifest(size="tiny", nodes=4, steps=100, lr=3e-3, eval_every=10)
    assert step_workload(m, lanes=1).grad_bytes == (0.0,)


def test_pipeline_bytes_follow_the_wire():
    base = WORKLOADS["pipeline-fp32"].manifest(size="tiny", nodes=4, steps=100, lr=3e-3, eval_every=10)
    b, d = base.batch, base.model.d_model
    assert boundary_nbytes(base) == (b.batch_size * b.seq_len * d * 4,) * 2
    aq = WORKLOADS["pipeline-aqsgd"].manifest(size="tiny", nodes=4, steps=100, lr=3e-3, eval_every=10)
    fwd, bwd = boundary_nbytes(aq)
    micro = b.batch_size // aq.batch.micro_batch_size
    # 4-bit deltas forward (samples come back: train_subset), 8-bit gradients back, an fp16 scale per channel
    assert fwd == b.batch_size * b.seq_len * d // 2 + micro * 2 * d
    assert bwd == b.batch_size * b.seq_len * d + micro * 2 * d
    fresh = dataclasses.replace(aq, data=mf.DataSpec(train_subset=0))
    assert boundary_nbytes(fresh)[0] == bwd  # every visit a first visit: 8 bits
    wl = step_workload(aq)
    assert wl.stages == 2 and wl.fwd_bytes == (fwd,) and wl.micro_batches == micro


def test_compute_counts_the_blocks_and_the_head():
    m = WORKLOADS["pipeline-fp32"].manifest(size="tiny", nodes=4, steps=100, lr=3e-3, eval_every=10)
    f0, f1 = stage_flops(m, 0), stage_flops(m, 1)
    assert f1 - f0 == 6 * m.model.vocab_size * m.model.d_model * m.batch.batch_size * m.batch.seq_len
