"""One pipeline stage of one lane: its layers, optimizer and data, and one GPipe step (flush per step) through a Boundary.

Each optimizer step the lane runs M micro-batches forward through every stage, then backward in micro-batch order
0..M-1 (today's `Trainer` accumulation order, so a one-stage lane is that trainer bit for bit). The last stage
computes the loss (divided by M); gradient clipping is lane-wide (every stage's squared norm, combined); a lane with
a non-finite stage skips the update on every stage. Stage 0 picks the sample ids; they travel with the
activations, and the last stage reads the targets itself.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from dataclasses import dataclass
from typing import Any

import torch

from shoal.node.train import checkpoint
from shoal.node.train.data import Corpus, Samples, ShardedSampler, heldout_batches, load_corpus
from shoal.node.train.lane import Boundary
from shoal.node.train.model import GPTConfig, GPTStage, build_stage, lm_loss
from shoal.node.sync.interface import NoSync, Synchronizer
from shoal.node.train.control import StepControl, StepStage
from shoal.node.train.trainer import lr_at, resolve_device
from shoal.protocol.lane import EVAL, TRAIN, LaneAborted
from shoal.protocol.manifest import OptimSpec, RunManifest

log = logging.getLogger(__name__)
STAGE_STATE_FORMAT = 1


def build_optimizer(model: torch.nn.Module, o: OptimSpec) -> torch.optim.Optimizer:
    """AdamW or SGD with the trainer's param groups: weight decay on matrices, none on vectors."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if o.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=lr_at(o, 0))
    return torch.optim.AdamW(groups, lr=lr_at(o, 0), betas=(o.beta1, o.beta2), eps=o.eps)


def lane_norm(norms: list[tuple[list[float], bool]]) -> torch.Tensor:
    """The lane's gradient norm from every stage's (per-parameter norms, finite), computed as `clip_grad_norm_`
    computes the whole model's: the 2-norm of all parameter norms in the model's order, in float32 on the CPU
    (so every stage gets the same bits, and the unsplit model's on a CPU). inf when a stage is not finite."""
    if not all(f for _, f in norms):
        return torch.tensor(math.inf)
    return torch.linalg.vector_norm(torch.tensor([x for n, _ in norms for x in n], dtype=torch.float32))


@dataclass(frozen=True, kw_only=True, slots=True)
class StageStepResult:
    step: int  # optimizer steps done after this one
    loss: float | None  # the lane's training loss (the last stage knows it)
    lr: float
    grad_norm: float  # the lane's (inf when a stage was not finite, nan when the step was aborted)
    tokens: int  # tokens the lane trained on this step
    seconds: float
    wait_s: float  # blocked on the neighbours: the pipeline bubble plus the links
    applied: bool  # False: skipped (aborted, non-finite lane, or the synchronizer said so)
    aborted: str | None = None  # why the lane's step was given up at this stage
    failed_peer: str | None = None  # the neighbour the failure concerns, when one does (for the broker)
    eval_loss: float | None = None  # the last stage, when eval was due and went through


class StageTrainer:
    """Stage `stage` of lane `lane` (the replica index) of a run; `step()` runs in the trainer's worker thread."""

    def __init__(self, manifest: RunManifest, *, stage: int, lane: int, boundary: Boundary,
                 device: str | torch.device = "cpu", synchronizer: Synchronizer | None = None,
                 corpus: Corpus | None = None):
        plan, b = manifest.plan, manifest.batch
        if not 0 <= stage < plan.stages or not 0 <= lane < plan.replicas:
            raise ValueError(f"slot (stage {stage}, lane {lane}) outside the plan {plan.stages}x{plan.replicas}")
        self.manifest, self.stage, self.lane, self.boundary = manifest, stage, lane, boundary
        self.num_stages = plan.stages
        self.is_first, self.is_last = stage == 0, stage == plan.stages - 1
        self.device = resolve_device(device) if isinstance(device, str) else device
        self.sync = synchronizer or NoSync()
        self.corpus = corpus or load_corpus(manifest.data.source, manifest.data.heldout_every)
        self.train_samples = Samples(self.corpus.train, b.seq_len)
        self.heldout_samples = Samples(self.corpus.heldout, b.seq_len)
        self.sampler = ShardedSampler(self.train_samples.num_samples, seed=manifest.seed, replica=lane,
                                      replicas=plan.replicas)
        self.eval_ids = heldout_batches(self.heldout_samples, b.micro_batch_size, manifest.eval.batches)
        self.micro_batches = b.batch_size // b.micro_batch_size
        self.model_config = GPTConfig.from_spec(manifest.model, b.seq_len)
        self.model: GPTStage = build_stage(self.model_config, stage, plan.stages, seed=manifest.seed).to(self.device)
        self.optimizer = build_optimizer(self.model, manifest.optim)
        # bf16 autocast on a GPU that has it; no fp16 GradScaler: one scale would have to be shared by the lane
        self.autocast_dtype = (torch.bfloat16 if self.device.type == "cuda" and torch.cuda.is_bf16_supported()
                               else None)
        self.step_count = 0
        self.last_result: StageStepResult | None = None
        self.last_eval_loss: float | None = None
        self._wait_s = 0.0

    def _autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)

    def _waiting(self, fn, *args, **kw):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kw)
        finally:
            self._wait_s += time.perf_counter() - t0

    # -- one micro-batch through this stage

    def _forward(self, step: int, micro: int, ids: torch.Tensor | None, samples: Samples, phase: str):
        """(input leaf or None, output) of this stage for one micro-batch; sends the output on unless last."""
        if self.is_first:
            inp = samples.get(ids)[0].to(self.device)
        else:
            ids, acts = self._waiting(self.boundary.recv_act, step, micro, phase=phase)
            inp = acts.to(self.device).requires_grad_(phase == TRAIN)
        with self._autocast():
            out = self.model(inp)
            if self.is_last:
                out = lm_loss(out, samples.get(ids)[1].to(self.device))
        if not self.is_last:
            self._waiting(self.boundary.send_act, step, micro, ids, out.detach().float(), phase=phase)
        return (None if self.is_first else inp), out

    def _pipeline_pass(self, step: int) -> torch.Tensor | None:
        """Forward all M micro-batches, then backward in order 0..M-1; the summed loss at the last stage."""
        b, M = self.manifest.batch, self.micro_batches
        ids = self.sampler.ids_at(step * b.batch_size, b.batch_size).split(b.micro_batch_size) if self.is_first else None
        kept = []
        loss_sum = torch.zeros((), device=self.device) if self.is_last else None
        for m in range(M):
            inp, out = self._forward(step, m, ids[m] if ids else None, self.train_samples, TRAIN)
            if self.is_last:
                out = out / M
                loss_sum += out.detach()
            kept.append((inp, out))
        for m in range(M):
            inp, out = kept[m]
            kept[m] = None  # frees the micro-batch's graph as soon as it is done
            if self.is_last:
                out.backward()
            else:
                out.backward(self._waiting(self.boundary.recv_grad, step, m).to(self.device, out.dtype))
            if inp is not None:
                self._waiting(self.boundary.send_grad, step, m, inp.grad)
        return loss_sum

    def _lane_clip(self, step: int, params: list[torch.nn.Parameter]) -> float:
        """Exchange gradient norms with the lane, clip to the lane's norm; returns it (inf: a stage not finite)."""
        norms = torch.stack([torch.linalg.vector_norm(p.grad) for p in params]).cpu().tolist() if params else []
        finite = all(math.isfinite(x) for x in norms)
        got = self._waiting(self.boundary.exchange_norms, step, norms if finite else [], finite)
        if len(got) != self.num_stages:
            raise LaneAborted(f"norms from {len(got)} stages, the lane has {self.num_stages}")
        total = lane_norm(got)
        clip = self.manifest.optim.grad_clip
        if clip > 0 and bool(torch.isfinite(total)):
            torch.nn.utils.clip_grads_with_norm_(params, clip, total.to(self.device))
        return float(total)

    # -- the step

    def step(self, control: StepControl | None = None) -> StageStepResult:
        """One optimizer step of the lane at this stage, then eval if due. A failure of the lane (LaneAborted)
        skips the update here and is reported in the result; the stage group's synchronizer still runs."""
        control = control if control is not None else StepControl(step=self.step_count)
        if control.step != self.step_count:
            raise ValueError(f"asked for step {control.step}, but the stage is at step {self.step_count}")
        control.advance(StepStage.COMPUTE)
        t0 = time.perf_counter()
        self._wait_s = 0.0
        step = self.step_count
        self.model.train()
        aborted: str | None = None
        failed_peer: str | None = None
        loss_sum = None
        try:
            loss_sum = self._pipeline_pass(step)
        except LaneAborted as e:
            aborted, failed_peer = str(e), e.peer
            self.optimizer.zero_grad(set_to_none=True)
        control.advance(StepStage.SYNC)
        apply = self.sync.before_optimizer_step(self.model, self.optimizer, control)
        grad_norm = math.nan
        if aborted is None:
            try:
                grad_norm = self._lane_clip(step, [p for p in self.model.parameters() if p.grad is not None])
            except LaneAborted as e:
                aborted, failed_peer = str(e), e.peer
        if aborted is not None:
            log.warning("stage %d lane %d step %d aborted: %s", self.stage, self.lane, step, aborted)
            self.boundary.abort(step, aborted)
        elif not math.isfinite(grad_norm):
            log.warning("step %d: non-finite gradient norm in the lane, update skipped", step)
        apply = apply and aborted is None and math.isfinite(grad_norm)
        lr = lr_at(self.manifest.optim, step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        if apply:
            self.optimizer.step()
        self.sync.after_optimizer_step(self.model, self.optimizer, control)
        self.optimizer.zero_grad(set_to_none=True)
        self.step_count = step + 1
        self.sampler.position = self.step_count * self.manifest.batch.batch_size
        seconds = time.perf_counter() - t0
        eval_loss = None
        every = self.manifest.eval.every_steps
        if every and self.step_count % every == 0:
            eval_loss = self.evaluate()
        b = self.manifest.batch
        self.last_result = StageStepResult(
            step=self.step_count, loss=None if loss_sum is None or aborted else float(loss_sum), lr=lr,
            grad_norm=grad_norm, tokens=b.batch_size * b.seq_len, seconds=seconds, wait_s=self._wait_s,
            applied=apply, aborted=aborted, failed_peer=failed_peer, eval_loss=eval_loss)
        control.state_hash = self.sync.state_hash()
        control.advance(StepStage.DONE)
        return self.last_result

    @torch.no_grad()
    def evaluate(self) -> float | None:
        """The fixed held-out batches through the lane: their mean loss at the last stage, None elsewhere (and when
        the lane fails on the way: then every stage gives this evaluation up)."""
        self.model.eval()
        step = self.step_count
        total = 0.0
        try:
            for i, ids in enumerate(self.eval_ids):
                _, out = self._forward(step, i, ids if self.is_first else None, self.heldout_samples, EVAL)
                if self.is_last:
                    total += float(out)
        except LaneAborted as e:
            log.warning("stage %d lane %d eval at step %d aborted: %s", self.stage, self.lane, step, e)
            self.boundary.abort(step, str(e), phase=EVAL)
            return None
        if not self.is_last:
            return None
        self.last_eval_loss = total / len(self.eval_ids)
        return self.last_eval_loss

    # -- state (checkpoints, hand-over)

    def state_dict(self) -> dict[str, Any]:
        """This stage's training state: weights, optimizer, step, synchronizer (the lane's data position is the
        step: stage 0 reads ids_at(step x batch_size))."""
        return {
            "format": STAGE_STATE_FORMAT,
            "run_id": self.manifest.run_id,
            "stage": self.stage,
            "step": self.step_count,
            "model": {k: v.detach().cpu() for k, v in self.model.state_dict().items()},
            "optimizer": self.optimizer.state_dict(),
            "sync": self.sync.state_dict(),
            "last_eval_loss": self.last_eval_loss,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("format") != STAGE_STATE_FORMAT:
            raise checkpoint.CheckpointError(f"stage state format {state.get('format')!r}, "
                                             f"expected {STAGE_STATE_FORMAT}")
        if state["run_id"] != self.manifest.run_id or state["stage"] != self.stage:
            raise checkpoint.CheckpointError(f"state of run {state['run_id'][:16]} stage {state['stage']}, not "
                                             f"{self.manifest.run_id[:16]} stage {self.stage}")
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step_count = state["step"]
        self.sampler.position = self.step_count * self.manifest.batch.batch_size
        self.sync.load_state_dict(state["sync"])
        self.last_eval_loss = state.get("last_eval_loss")
