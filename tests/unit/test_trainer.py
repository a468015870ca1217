"""The trainer: loss goes down, eval is deterministic, resume is bit-exact, hooks and the synchronizer slot work."""

from __future__ import annotations

import math

import pytest
import torch
import trio

from shoal.node.sync.interface import NoSync, Synchronizer
from shoal.node.train.control import StepControl, StepStage
from shoal.node.train.trainer import Trainer, lr_at
from shoal.protocol.manifest import BatchSpec, CheckpointSpec, EvalSpec, ModelSpec, OptimSpec, RunManifest

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def small_run(**kw) -> RunManifest:
    """A model small enough for CI: 2 layers of width 64, 8 sequences of 64 bytes per step."""
    return RunManifest(
        **{
            "seed": 3,
            "model": ModelSpec(size="custom", n_layers=2, d_model=64, n_heads=4),
            "batch": BatchSpec(batch_size=8, micro_batch_size=4, seq_len=64),
            "optim": OptimSpec(lr=1e-2, warmup_steps=5, total_steps=80),
            "eval": EvalSpec(every_steps=0, batches=2),
            "checkpoint": CheckpointSpec(keep_last=2),
            **kw,
        }
    )


@pytest.mark.slow
def test_tiny_model_loss_drops_well_below_its_start():
    trainer = Trainer(small_run())
    start_eval = trainer.evaluate()
    losses = [trainer.step().loss for _ in range(80)]
    assert math.isclose(start_eval, math.log(256), abs_tol=0.3)
    assert sum(losses[-5:]) / 5 < losses[0] - 2.0, losses
    assert trainer.evaluate() < start_eval - 1.5


def test_eval_is_deterministic():
    a, b = Trainer(small_run()), Trainer(small_run())
    a.step()
    b.step()
    assert a.evaluate() == a.evaluate() == b.evaluate()


def test_resume_is_bit_exact(tmp_path):
    straight = Trainer(small_run())
    expected = [straight.step().loss for _ in range(6)]
    first = Trainer(small_run())
    got = [first.step().loss for _ in range(3)]
    first.save(tmp_path)
    first.step()  # progress after the checkpoint is lost when the process dies
    del first
    resumed = Trainer(small_run())
    assert resumed.resume(tmp_path) == 3
    got += [resumed.step().loss for _ in range(3)]
    assert got == expected
    for (name, p), q in zip(straight.model.named_parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(p, q), name


def test_checkpoint_of_another_run_is_refused(tmp_path):
    from shoal.node.train.checkpoint import CheckpointError

    t = Trainer(small_run())
    t.save(tmp_path)
    with pytest.raises(CheckpointError, match="belongs to run"):
        Trainer(small_run(seed=4)).resume(tmp_path)


class Recording(Synchronizer):
    name = "recording"

    def __init__(self, apply: bool):
        super().__init__()
        self.apply, self.calls = apply, []

    def before_optimizer_step(self, model, optimizer, control):
        assert all(p.grad is not None for p in model.parameters())
        assert control.stage is StepStage.SYNC
        self.calls.append(("before", control.step))
        return self.apply

    def after_optimizer_step(self, model, optimizer, control):
        self.calls.append(("after", control.step))
        if control.step == 1:
            control.absorb({"peer-a"}, {"peer-b": "non-finite values"})

    def state_hash(self):
        return f"h{len(self.calls)}"

    def state_dict(self):
        return {"calls": len(self.calls)}


def test_synchronizer_and_hooks_are_called_around_each_step():
    sync = Recording(apply=True)
    t = Trainer(small_run(), synchronizer=sync)
    seen = []
    t.before_step_hooks.append(lambda tr: seen.append(("pre", tr.step_count)))
    t.after_step_hooks.append(lambda tr, r: seen.append(("post", r.step)))
    t.step()
    t.step()
    assert sync.calls == [("before", 0), ("after", 0), ("before", 1), ("after", 1)]
    assert seen == [("pre", 0), ("post", 1), ("pre", 1), ("post", 2)]
    assert t.state_dict()["sync"] == {"calls": 4}


def test_a_step_crosses_as_one_control_object_with_its_outcome():
    t = Trainer(small_run(), synchronizer=Recording(apply=True))
    c0 = StepControl(step=0)
    r0 = t.step(c0)
    assert c0.stage is StepStage.DONE and c0.result is r0 and c0.applied and c0.state_hash == "h2"
    assert not c0.missing and not c0.offenders
    c1 = StepControl(step=1)
    state = t.snapshot(c1)  # the state at revision 1, a private copy: the step below does not change it
    assert c1.stage is StepStage.SNAPSHOT and state["step"] == 1
    before = {k: v.clone() for k, v in state["model"].items()}
    t.step(c1)
    assert c1.missing == {"peer-a"} and c1.offenders == {"peer-b": "non-finite values"}
    assert all(torch.equal(before[k], v) for k, v in state["model"].items())
    assert any(not torch.equal(before[k], v) for k, v in t.state_dict()["model"].items())
    with pytest.raises(ValueError, match="step 5"):
        t.step(StepControl(step=5))  # a control for another step is refused, nothing runs
    with pytest.raises(RuntimeError, match="cannot go back"):
        c1.advance(StepStage.COMPUTE)


def test_synchronizer_can_skip_the_update():
    t = Trainer(small_run(), synchronizer=Recording(apply=False))
    before = [p.detach().clone() for p in t.model.parameters()]
    r = t.step()
    assert not r.applied and r.step == 1
    assert all(torch.equal(a, b) for a, b in zip(before, t.model.parameters(), strict=True))
    assert isinstance(Trainer(small_run()).sync, NoSync)


def test_status_and_eval_every_k():
    t = Trainer(small_run(eval=EvalSpec(every_steps=2, batches=1)))
    r1, r2 = t.step(), t.step()
    assert r1.eval_loss is None and r2.eval_loss is not None
    st = t.status()
    assert st["step"] == 2 and st["eval_loss"] == r2.eval_loss and st["tokens_per_s"] > 0
    assert r2.tokens == 8 * 64


def test_lr_schedule_warms_up_then_decays_to_the_floor():
    o = OptimSpec(lr=1.0, warmup_steps=10, total_steps=110, min_lr_ratio=0.1)
    assert lr_at(o, 0) == pytest.approx(0.1) and lr_at(o, 9) == pytest.approx(1.0)
    assert lr_at(o, 10) == pytest.approx(1.0) and lr_at(o, 60) == pytest.approx(0.55)
    assert lr_at(o, 110) == pytest.approx(0.1) and lr_at(o, 500) == pytest.approx(0.1)
    values = [lr_at(o, s) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(values, values[1:]))


async def test_step_runs_in_a_worker_thread():
    t = Trainer(small_run())
    ticks = 0

    async def ticker():
        nonlocal ticks
        while True:
            ticks += 1
            await trio.sleep(0.001)  # not a busy loop: spinning on sleep(0) starves the step of the GIL

    def step_watching_the_loop():
        before = ticks
        result = t.step()
        return result, ticks - before

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ticker)
        result, ticked_during_step = await trio.to_thread.run_sync(step_watching_the_loop)
        nursery.cancel_scope.cancel()
    assert result.step == 1
    assert ticked_during_step > 0, "the event loop stood still while the step ran"
