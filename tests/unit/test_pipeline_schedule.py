"""The GPipe schedule in one process: a 1-stage lane is today's trainer bit for bit, and so are 2- and 4-stage lanes of
a 4-layer model against the unsplit untied one; a non-finite stage skips the step lane-wide; a dead neighbour aborts."""

from __future__ import annotations

import functools
import math
import threading

import pytest
import torch

from shoal.node.train.lane import Boundary, LocalLane
from shoal.node.sync.interface import NoSync
from shoal.node.train.trainer import Trainer
from shoal.protocol.errors import FieldError
from shoal.protocol.manifest import BatchSpec, EvalSpec, ModelSpec, OptimSpec, ParallelPlan, RunManifest

pytestmark = pytest.mark.usefixtures("one_torch_thread")
STEPS = 50


def run_manifest(stages: int = 1, tie: bool | None = False, **kw) -> RunManifest:
    """4 layers of width 32; 8 sequences of 32 bytes per step in M = 4 micro-batches; eval twice."""
    return RunManifest(**{
        "seed": 3,
        "model": ModelSpec(size="custom", n_layers=4, d_model=32, n_heads=2, tie_embeddings=tie),
        "plan": ParallelPlan(stages=stages),
        "batch": BatchSpec(batch_size=8, micro_batch_size=2, seq_len=32),
        "optim": OptimSpec(lr=1e-2, warmup_steps=5, total_steps=STEPS, grad_clip=1.0),
        "eval": EvalSpec(every_steps=25, batches=2),
        **kw,
    })


def train_lane(m: RunManifest, steps: int, *, syncs=None, timeout_s: float = 60.0) -> list[Trainer]:
    """Every stage of lane 0 in its own thread, `steps` steps each."""
    lane = LocalLane(m.plan.stages, timeout_s=timeout_s)
    stages = [Trainer(m, stage=s, replica=0, boundary=lane.boundary(s), synchronizer=(syncs or {}).get(s))
              for s in range(m.plan.stages)]
    results: dict[int, list] = {s: [] for s in range(len(stages))}
    errors = []

    def work(s: int) -> None:
        try:
            results[s] = [stages[s].step() for _ in range(steps)]
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(len(stages))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    for s, st in enumerate(stages):
        st.results = results[s]
    return stages


def lane_params(stages: list[Trainer]) -> dict[str, torch.Tensor]:
    out = {}
    for st in stages:
        out.update(st.model.state_dict())
    return out


@functools.cache
def unsplit_reference() -> tuple[Trainer, list]:
    """The unsplit untied model trained STEPS steps (shared by the S=2 and S=4 cases; nobody mutates it)."""
    ref = Trainer(run_manifest(1, tie=False))
    return ref, [ref.step() for _ in range(STEPS)]


@pytest.mark.parametrize("stages", [2, 4])
def test_split_lane_is_the_unsplit_untied_model_bit_for_bit(stages):
    """Nothing differs: the boundary gradient is the same sum of two terms, and the lane's norm is combined from
    per-parameter norms in the whole model's order, as clip_grad_norm_ does (one squared norm per stage would
    change the summation order: measured, 1-ulp clip differences grew to 1e-4 in the parameters by step 50)."""
    ref, want = unsplit_reference()
    assert not ref.model.tied
    lane = train_lane(run_manifest(stages), STEPS)
    got = lane[-1].results
    assert all(r.applied and r.aborted is None for st in lane for r in st.results)
    for st in lane:  # every stage clipped with the lane's norm, which is the unsplit model's
        assert [r.grad_norm for r in st.results] == [w.grad_norm for w in want]
    assert sum(w.grad_norm > 1.0 for w in want) >= 5  # lane-wide clipping was exercised
    assert [r.loss for r in got] == [w.loss for w in want]
    assert [r.eval_loss for r in got] == [w.eval_loss for w in want]
    assert sum(w.eval_loss is not None for w in want) == 2
    assert all(r.loss is None and r.eval_loss is None for st in lane[:-1] for r in st.results)
    params = lane_params(lane)
    assert list(params) == list(ref.model.state_dict())  # same names, same order
    for k, v in ref.model.state_dict().items():
        assert torch.equal(params[k], v), k
    assert got[-1].loss < want[0].loss - 1.0  # it learned: the comparison is not between two untrained models


class PoisonAt(NoSync):
    """A synchronizer slot that turns one gradient into NaN at one step (before clipping)."""

    def __init__(self, step: int):
        super().__init__()
        self.step = step

    def before_optimizer_step(self, model, optimizer, control):
        if control.step == self.step:
            next(model.parameters()).grad.fill_(float("nan"))
        return True


def test_a_non_finite_stage_skips_the_step_on_every_stage():
    lane = train_lane(run_manifest(2), 3, syncs={1: PoisonAt(1)})
    for st in lane:
        assert [r.applied for r in st.results] == [True, False, True]
        assert math.isinf(st.results[1].grad_norm)
    ref = Trainer(run_manifest(1), synchronizer=PoisonAt(1))  # the unsplit model skipping the same step
    assert [ref.step().applied for _ in range(3)] == [True, False, True]
    params = lane_params(lane)
    for k, v in ref.model.state_dict().items():
        assert torch.equal(params[k], v), k


def test_a_lane_resumed_from_its_stages_states_goes_on_bit_for_bit():
    m = run_manifest(2)
    straight = train_lane(m, 6)
    first = train_lane(m, 3)
    states = [st.state_dict() for st in first]
    lane = LocalLane(2)
    resumed = [Trainer(m, stage=s, replica=0, boundary=lane.boundary(s)) for s in range(2)]
    for st, state in zip(resumed, states):
        st.load_state_dict(state)
    assert [st.step_count for st in resumed] == [3, 3]
    threads = [threading.Thread(target=lambda st=st: st.__dict__.update(results=[st.step() for _ in range(3)]))
               for st in resumed]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert [r.loss for r in resumed[1].results] == [r.loss for r in straight[1].results[3:]]
    for k, v in lane_params(straight).items():
        assert torch.equal(lane_params(resumed)[k], v), k
    with pytest.raises(Exception, match="stage"):
        resumed[0].load_state_dict(states[1])


def test_a_silent_neighbour_aborts_the_step_without_an_update():
    m = run_manifest(2)
    lane = LocalLane(2, timeout_s=0.3)
    st = Trainer(m, stage=1, replica=0, boundary=lane.boundary(1))  # stage 0 never runs
    before = {k: v.clone() for k, v in st.model.state_dict().items()}
    r = st.step()
    assert not r.applied and "within 0.3 s" in r.aborted and r.loss is None and r.step == 1
    assert all(torch.equal(before[k], v) for k, v in st.model.state_dict().items())


def test_local_boundary_is_a_boundary_and_split_models_must_be_untied():
    assert isinstance(LocalLane(2).boundary(0), Boundary)
    with pytest.raises(FieldError, match="tie_embeddings"):
        run_manifest(2, tie=True)
    assert run_manifest(1, tie=None).model.tied(1) and not run_manifest(2, tie=None).model.tied(2)
    # the default is not written: a manifest that does not say keeps the run id it had before the field existed
    assert "tie_embeddings" not in RunManifest.default().to_wire()["model"]
    assert run_manifest(1, tie=False).run_id != run_manifest(1, tie=None).run_id


class Recorder:
    """Micro-batches that only record the order the schedule runs them in."""

    def __init__(self):
        self.calls: list[str] = []

    def forward(self, micro: int) -> int:
        self.calls.append(f"F{micro}")
        return micro

    def backward(self, micro: int, kept: int) -> None:
        assert kept == micro  # each backward gets what its own forward left
        self.calls.append(f"B{micro}")


def test_the_trainer_holds_its_lanes_schedule_gpipe_flushes_each_step_one_stage_accumulates():
    from shoal.node.train.pipeline import Accumulate, GPipe

    assert isinstance(Trainer(run_manifest(1)).schedule, Accumulate)
    assert isinstance(Trainer(run_manifest(2), stage=1, boundary=LocalLane(2).boundary(1)).schedule, GPipe)
    gpipe, acc = Recorder(), Recorder()
    GPipe().run(gpipe, 3)
    Accumulate().run(acc, 3)
    assert gpipe.calls == ["F0", "F1", "F2", "B0", "B1", "B2"]
    assert acc.calls == ["F0", "B0", "F1", "B1", "F2", "B2"]
