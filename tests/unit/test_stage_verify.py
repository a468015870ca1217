"""Verified pipeline stages, the check itself (in one process, no network): a lane's transcripts, a replica of the
same stage re-executing sampled micro-batches from its neighbours' records, bit-exact on the CPU; a stage that
sends anything else (flipped or scaled gradients, noisy activations) is caught on exactly the micro-batches it
touched, and honest stages are never accused."""

from __future__ import annotations

import threading

import pytest
import torch

from shoal.node.train.lane import LocalLane
from shoal.node.train.trainer import Trainer
from shoal.node.train.transcript import RecordingBoundary, Transcript
from shoal.node.train.verify import Evidence, Tolerance, recheck, snapshot_params
from tests.unit.test_pipeline_schedule import run_manifest

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class Tamper:
    """A boundary that changes what it sends for the micro-batches in `micros` (gradients and/or activations)."""

    def __init__(self, inner, micros: set[int], *, grad: float | None = None, act_noise: float | None = None):
        self.inner, self.micros, self.grad, self.act_noise = inner, micros, grad, act_noise

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def send_grad(self, step, micro, g):
        self.inner.send_grad(step, micro, g * self.grad if self.grad is not None and micro in self.micros else g)

    def send_act(self, step, micro, ids, a, **kw):
        if self.act_noise is not None and micro in self.micros:
            a = a + self.act_noise * torch.randn_like(a)
        self.inner.send_act(step, micro, ids, a, **kw)


def lane_with_transcripts(m, steps: int, tamper=None):
    """One lane of m's stages in threads, each recording its transcript; `tamper`: (stage, factory) wrapping that
    stage's boundary inside the recorder (the recorder sees what the lane received, as a neighbour records it).
    Returns the stages, their transcripts and the weights each stage held at the start of every step."""
    lane = LocalLane(m.plan.stages, timeout_s=60)
    trs = [Transcript(keep_steps=steps) for _ in range(m.plan.stages)]
    stages, weights = [], [dict() for _ in range(m.plan.stages)]
    for s in range(m.plan.stages):
        inner = lane.boundary(s)
        if tamper is not None and tamper[0] == s:
            inner = tamper[1](inner)
        stages.append(Trainer(m, stage=s, replica=0, boundary=RecordingBoundary(inner, trs[s], m.plan.pipeline.wire_dtype)))
    errors = []

    def work(s: int) -> None:
        try:
            for t in range(steps):
                weights[s][t] = snapshot_params(stages[s].model)
                stages[s].step()
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(m.plan.stages)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    assert not errors, errors
    return stages, trs, weights


def evidence(trs, stage: int, step: int, micro: int) -> Evidence:
    return Evidence(step=step, micro=micro, prev=trs[stage - 1].get(step, micro) if stage > 0 else None,
                    next=trs[stage + 1].get(step, micro) if stage + 1 < len(trs) else None,
                    own=trs[stage].get(step, micro))


def verifier(m, stage: int) -> Trainer:
    """A replica of `stage` in another lane (its own weights are never used: the checked step's are passed in)."""
    return Trainer(m, stage=stage, replica=0, boundary=LocalLane(m.plan.stages).boundary(stage))


def test_an_honest_lane_rechecks_bit_exact_at_every_stage():
    wire = "fp32"  # an in-process lane hands tensors over as they are (the fp16 wire is the link's)
    m = _manifest(3, wire)
    steps = 3
    _, trs, weights = lane_with_transcripts(m, steps)
    for s in range(3):
        v = verifier(m, s)
        for t in range(steps):
            for mi in range(4):
                c = recheck(v, weights[s][t], evidence(trs, s, t, mi), wire)
                assert c.checked and not c.tampered, (s, t, mi, c)
                assert c.forward_ok is (None if s == 2 else True) and c.backward_ok is (None if s == 0 else True)


@pytest.mark.parametrize("how", ["flipped gradients", "scaled gradients", "noisy activations"])
def test_a_stage_tampering_with_what_it_sends_is_caught_on_exactly_those_micro_batches(how):
    m = _manifest(3, "fp32")
    touched = {1, 3}
    kw = {"flipped gradients": {"grad": -1.0}, "scaled gradients": {"grad": 1.01},
          "noisy activations": {"act_noise": 1e-3}}[how]
    _, trs, weights = lane_with_transcripts(m, 2, tamper=(1, lambda b: Tamper(b, touched, **kw)))
    v = verifier(m, 1)
    for t in range(2):
        caught = {mi for mi in range(4) if recheck(v, weights[1][t], evidence(trs, 1, t, mi), "fp32").tampered}
        assert caught == touched, (how, t, caught)
    for s in (0, 2):  # its honest neighbours are not accused (they computed from what they received)
        vs = verifier(m, s)
        assert not any(recheck(vs, weights[s][t], evidence(trs, s, t, mi), "fp32").tampered
                       for t in range(2) for mi in range(4))


def _manifest(stages: int, wire: str):
    from dataclasses import replace

    m = run_manifest(stages)
    return replace(m, plan=replace(m.plan, pipeline=replace(m.plan.pipeline, wire_dtype=wire)))


def test_the_draw_is_private_and_a_lane_the_statistics_point_at_is_checked_more_often():
    import random

    from shoal.node.run.verify import BOOST_FACTOR, BOOST_STEPS, StageVerifier

    v = StageVerifier(me="v", run_id="r", fraction=0.05, kind="fp32", call=None, penalize=lambda *a: None,
                      rng=random.Random(1))
    base = sum(len(v.draw(8, lane=1)) for _ in range(2000)) / (2000 * 8)
    v.boost(1)
    boosted = sum(len(v.draw(8, lane=1)) for _ in range(BOOST_STEPS)) / (BOOST_STEPS * 8)
    after = sum(len(v.draw(8, lane=1)) for _ in range(2000)) / (2000 * 8)
    assert abs(base - 0.05) < 0.01 and abs(after - 0.05) < 0.01 and v.boosts == 1
    assert boosted > 4 * 0.05 and BOOST_FACTOR * 0.05 <= 1.0
