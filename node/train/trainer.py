"""The step loop of one stage of one lane: micro-batches, AdamW or SGD, warm-up + cosine, clipping, eval, hooks, a
synchronizer slot. The order of a step's micro-batches is the lane's pipeline schedule, an object the trainer holds
(node/train/pipeline.py): a one-stage plan is a lane of one stage, the whole model, each micro-batch's backward right
after its forward (gradient accumulation); a stage of a split model runs GPipe with a flush per step through its
lane's `Boundary`: M micro-batches forward through every stage, then backward in micro-batch order 0..M-1, so a
one-stage lane and the unsplit model agree bit for bit. The last stage computes the loss (divided by M); clipping is
lane-wide (every stage's parameter norms, combined as `clip_grad_norm_` combines the whole model's); a lane with a
non-finite stage skips the update on every stage. Stage 0 picks the sample ids; they travel with the activations.

`Trainer.step(control)` is synchronous and self-contained so the runtime can run it in a worker thread; the
`StepControl` is the one object that crosses between them (node/train/control.py).
"""

from __future__ import annotations

import contextlib
import logging
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shoal.node.sync.interface import NoSync, Synchronizer
from shoal.node.train import checkpoint
from shoal.node.train.batch import GlobalOrder, StepBatch, micro_loss
from shoal.node.train.control import StepControl, StepResult, StepStage
from shoal.node.train.data import Corpus, Samples, heldout_batches, load_corpus
from shoal.node.train.device import PinnedRing, SpeedMeter, resolve_device
from shoal.node.train.lane import Boundary, SoloLane
from shoal.node.train.pipeline import PipelineSchedule, schedule_for
from shoal.node.train.stages import build_stage_model, lm_loss
from shoal.protocol.lane import EVAL, TRAIN, LaneAborted
from shoal.protocol.manifest import OptimSpec, RunManifest

log = logging.getLogger(__name__)
CHECKPOINT_FORMAT = 2  # 2: the state names its stage
READABLE_FORMATS = (1, 2)  # a format-1 checkpoint is of the whole model: stage 0 of one
LOCAL_STATE = ("rng", "scaler", "last_eval_loss")  # a replica's own, never passed to one entering the group
DEVICE_OPTIONS = ("fused", "foreach", "capturable", "differentiable")  # optimizer options of the device, not the run


def lr_at(opt: OptimSpec, step: int) -> float:
    """Linear warm-up over warmup_steps, then cosine from lr down to min_lr_ratio * lr at total_steps."""
    if step < opt.warmup_steps:
        return opt.lr * (step + 1) / opt.warmup_steps
    span = max(opt.total_steps - opt.warmup_steps, 1)
    progress = min((step - opt.warmup_steps) / span, 1.0)
    return opt.lr * (opt.min_lr_ratio + (1 - opt.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


@dataclass(frozen=True, kw_only=True, slots=True)
class ExecOptions:
    """How the trainer runs on its device (not what it computes: the results are the same up to kernel rounding).
    auto: compile the model and fuse AdamW on CUDA, plain eager torch elsewhere."""

    compile: str = "auto"  # auto | on | off: torch.compile the model (a failure falls back to eager, logged)
    fused: str = "auto"  # auto | on | off: the fused AdamW kernel (CUDA)

    def __post_init__(self) -> None:
        if self.compile not in ("auto", "on", "off") or self.fused not in ("auto", "on", "off"):
            raise ValueError("compile and fused are auto, on or off")


def build_optimizer(model: torch.nn.Module, o: OptimSpec, *, fused: bool = False) -> torch.optim.Optimizer:
    """AdamW or SGD: weight decay on matrices, none on vectors; `fused`: AdamW's fused kernel."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if o.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=lr_at(o, 0))
    return torch.optim.AdamW(groups, lr=lr_at(o, 0), betas=(o.beta1, o.beta2), eps=o.eps, fused=fused or None)


def lane_norm(norms: list[tuple[list[float], bool]]) -> torch.Tensor:
    """The lane's gradient norm from every stage's (per-parameter norms, finite), computed as `clip_grad_norm_`
    computes the whole model's: the 2-norm of all parameter norms in the model's order, in float32 on the CPU (so
    every stage gets the same bits). inf when a stage is not finite."""
    if not all(f for _, f in norms):
        return torch.tensor(math.inf)
    return torch.linalg.vector_norm(torch.tensor([x for n, _ in norms for x in n], dtype=torch.float32))


def copy_state(state: Any) -> Any:
    """A private copy of a nested state: every tensor cloned (the live ones keep changing as training goes on)."""
    if isinstance(state, torch.Tensor):
        return state.detach().clone()
    if isinstance(state, dict):
        return {k: copy_state(v) for k, v in state.items()}
    if isinstance(state, list):
        return [copy_state(v) for v in state]
    if isinstance(state, tuple):
        return tuple(copy_state(v) for v in state)
    return state


class Trainer:
    """Trains stage `stage` of lane `replica` of a run (stage 0 of a one-stage plan is the whole model)."""

    def __init__(
        self,
        manifest: RunManifest,
        *,
        device: str | torch.device = "cpu",
        stage: int = 0,
        replica: int = 0,
        boundary: Boundary | None = None,
        synchronizer: Synchronizer | None = None,
        corpus: Corpus | None = None,
        options: ExecOptions = ExecOptions(),
        weights: Path | None = None,
    ):
        plan, b = manifest.plan, manifest.batch
        if not 0 <= stage < plan.stages or not 0 <= replica < plan.lanes_max:
            raise ValueError(f"slot (stage {stage}, replica {replica}) outside the plan {plan.stages}x{plan.lanes_max}")
        if boundary is None and plan.stages > 1:
            raise ValueError(f"stage {stage} of a {plan.stages}-stage plan needs its lane's boundary")
        self.manifest, self.stage, self.replica = manifest, stage, replica
        self.num_stages = plan.stages
        self.is_first, self.is_last = stage == 0, stage == plan.stages - 1
        self.boundary: Boundary = boundary if boundary is not None else SoloLane()
        self.device = resolve_device(device) if isinstance(device, str) else device
        self.sync = synchronizer or NoSync()
        src = manifest.data.source
        if corpus is None and src != "stdlib" and not src.startswith("hf:"):
            # a manifest may come from the network: its path names a file of this machine the owner chose. The
            # caller that trusts it (its own manifest file, or a volunteer's --data) loads it and passes it in
            raise ValueError(f"the manifest reads its data from a local path ({src!r}): pass the corpus in "
                             f"(load_corpus(path)); a trainer never opens a path a manifest names by itself")
        self.corpus = corpus or load_corpus(src, manifest.data.heldout_every)
        self.train_samples = Samples(self.corpus.train, b.seq_len)
        self.heldout_samples = Samples(self.corpus.heldout, b.seq_len)
        subset = manifest.data.train_subset  # the first N samples only (0: all): samples come back every epoch
        self.order = GlobalOrder(min(subset or self.train_samples.num_samples, self.train_samples.num_samples),
                                 seed=manifest.seed)
        self.eval_ids = heldout_batches(self.heldout_samples, b.micro_batch_size, manifest.eval.batches)
        self.wave = max(1, b.batch_size // b.micro_batch_size)  # micro-batches a pipeline stage keeps in flight
        self.speed = SpeedMeter()
        self.schedule: PipelineSchedule = schedule_for(plan.stages)  # the order of each step's micro-batches
        # the built-in GPT or a Hugging Face model (node/train/stages.py); `weights`: the run's initial weights file
        self.model = build_stage_model(manifest, stage, weights=weights).to(self.device)
        cuda = self.device.type == "cuda"
        self.fused = manifest.optim.optimizer == "adamw" and (options.fused == "on" or (options.fused == "auto" and cuda))
        self.optimizer = build_optimizer(self.model, manifest.optim, fused=self.fused)
        # the trainable parameters, in the model's order (clipping's list: walking the modules each step costs ~0.3 ms
        # of host time, a few percent of a small model's GPU step)
        self._trainable = [p for p in self.model.parameters() if p.requires_grad]
        # the forward: the compiled model when asked (checked at the first call; a failure falls back to eager)
        self._forward_model: torch.nn.Module = self.model
        self.compiled = options.compile == "on" or (options.compile == "auto" and cuda)
        if self.compiled:
            self._forward_model = torch.compile(self.model)
        self.autocast_dtype: torch.dtype | None = None
        self.scaler: torch.amp.GradScaler | None = None
        if self.device.type == "cuda":
            self.autocast_dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
            if self.autocast_dtype == torch.float16:
                if plan.stages > 1:  # one loss scale would have to be shared by the whole lane
                    raise ValueError("pipeline stages need bf16 on CUDA (this GPU has only fp16)")
                self.scaler = torch.amp.GradScaler("cuda")
        self.step_count = 0
        self.before_step_hooks: list[Callable[[Trainer], None]] = []
        self.after_step_hooks: list[Callable[[Trainer, StepResult], None]] = []
        self.last: StepResult | None = None
        self.last_eval_loss: float | None = None
        self._wait_s = 0.0
        self._staged: tuple[int, StepBatch, list] | None = None  # (step, split, micro-batches on the device)
        self._pinned = PinnedRing() if self.device.type == "cuda" else None
        # the process's RNGs (saved with the state, restored with it) start from the run's seed and the slot, so a
        # run that stopped and resumed ends with the very state of one that did not stop
        slot_seed = (manifest.seed * 1_000_003 + stage * 1009 + replica) % 2**63
        torch.manual_seed(slot_seed)
        random.seed(slot_seed)

    @property
    def tokens_per_step(self) -> int:
        """Tokens of a nominal step of this lane (its real share is in each StepResult)."""
        return self.manifest.batch.batch_size * self.manifest.batch.seq_len

    def default_batch(self) -> StepBatch:
        """The split of a step run without one: the run's starting lanes, evenly."""
        return StepBatch.of(self.manifest, self.replica)

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

    def _micro_batches(self, ids: torch.Tensor, samples: Samples) -> list[tuple[torch.Tensor, torch.Tensor,
                                                                             torch.Tensor]]:
        """(ids, inputs, targets) of each micro-batch of `ids`, on the device (from pinned memory, asynchronously,
        on a GPU)."""
        x, y = samples.get(ids)
        if self._pinned is not None:
            x, y = self._pinned.to_device(x, self.device), self._pinned.to_device(y, self.device)
        else:
            x, y = x.to(self.device), y.to(self.device)
        mb = self.manifest.batch.micro_batch_size
        return list(zip(ids.split(mb), x.split(mb), y.split(mb)))

    def _stage_next(self, batch: StepBatch) -> None:
        """A GPU first stage: load the next step's sequences now (if its split stays this one), while the device
        still runs this step."""
        if self.is_first and self.device.type == "cuda":
            step = self.step_count
            self._staged = (step, batch, self._micro_batches(self.order.step_ids(step, batch), self.train_samples))

    def _forward(self, step: int, micro: int, batch: tuple | None, samples: Samples, phase: str):
        """(input leaf or None, output) of this stage for one micro-batch: the loss at the last stage, else the
        activations, sent on to the next stage. `batch`: (ids, inputs, targets) at the first stage."""
        if self.is_first:
            ids, inp, targets = batch
        else:
            ids, acts = self._waiting(self.boundary.recv_act, step, micro, phase=phase)
            inp = acts.to(self.device).requires_grad_(phase == TRAIN)
            targets = samples.get(ids)[1].to(self.device, non_blocking=True) if self.is_last else None
        with self._autocast():
            out = self._run_model(inp)
            if self.is_last:
                out = lm_loss(out, targets)
        if not self.is_last:
            self._waiting(self.boundary.send_act, step, micro, ids, out.detach().float(), phase=phase)
        return (None if self.is_first else inp), out

    def _run_model(self, inp: torch.Tensor) -> torch.Tensor:
        if self._forward_model is self.model:
            return self.model(inp)
        try:
            return self._forward_model(inp)
        except Exception as e:  # noqa: BLE001 - torch.compile cannot handle this setup: train eagerly
            log.warning("torch.compile failed (%s: %s); training without it", type(e).__name__, str(e)[:300])
            self._forward_model, self.compiled = self.model, False
            return self.model(inp)

    def _backward(self, step: int, micro: int, inp: torch.Tensor | None, out: torch.Tensor) -> None:
        if self.is_last:
            (self.scaler.scale(out) if self.scaler else out).backward()
        else:
            out.backward(self._waiting(self.boundary.recv_grad, step, micro).to(self.device, out.dtype))
        if inp is not None:
            self._waiting(self.boundary.send_grad, step, micro, inp.grad)

    def _pass(self, step: int, batch: StepBatch) -> torch.Tensor | None:
        """This lane's share of the step through this stage, in micro-batches of `micro_batch_size` (the last one
        smaller when the share is not a whole number of them), in the order of the lane's pipeline schedule
        (node/train/pipeline.py), a wave (at most `wave` micro-batches, the nominal batch) at a time: a share larger
        than the nominal batch keeps no more graphs alive than the nominal one would. The loss at the last stage: the
        share's mean (each micro-batch's mean weighted by its size), summed."""
        n, mbs = batch.samples, self.manifest.batch.micro_batch_size
        sizes = [min(mbs, n - i) for i in range(0, n, mbs)]
        batches = None
        if self.is_first:
            staged, self._staged = self._staged, None
            batches = staged[2] if staged is not None and staged[:2] == (step, batch) else \
                self._micro_batches(self.order.step_ids(step, batch), self.train_samples)
        micro = _StagePass(self, step, batches, sizes)
        for first in range(0, len(sizes), self.wave):
            micro.offset = first
            self.schedule.run(micro, min(self.wave, len(sizes) - first))
        if self.is_last and micro.loss_sum is None:  # an empty share
            return torch.zeros((), device=self.device)
        return micro.loss_sum

    def _clip(self, step: int) -> torch.Tensor:
        """Clip to the lane's gradient norm (exchanged with the lane's other stages); returns it as a 0-d tensor
        (inf: a stage of the lane is not finite), on the device for a one-stage lane (no host sync)."""
        params = [p for p in self._trainable if p.grad is not None]
        clip = self.manifest.optim.grad_clip
        if self.num_stages == 1:
            if clip > 0:
                return torch.nn.utils.clip_grad_norm_(params, clip)
            return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params]))
        norms = torch.stack([torch.linalg.vector_norm(p.grad) for p in params]).cpu().tolist() if params else []
        finite = all(math.isfinite(x) for x in norms)
        got = self._waiting(self.boundary.exchange_norms, step, norms if finite else [], finite)
        if len(got) != self.num_stages:
            raise LaneAborted(f"norms from {len(got)} stages, the lane has {self.num_stages}")
        total = lane_norm(got)
        if clip > 0 and bool(torch.isfinite(total)):
            torch.nn.utils.clip_grads_with_norm_(params, clip, total.to(self.device))
        return total

    # -- the step

    def snapshot(self, control: StepControl) -> dict[str, Any]:
        """The entry state at revision `control.step` (the round boundary before that step), what the group serves
        a replica entering it: the synchronizer's in-flight round applied first, then a private copy (training may
        go on while it is served) of `entry_state`."""
        if control.step != self.step_count:
            raise ValueError(f"snapshot for step {control.step}, but the trainer is at step {self.step_count}")
        control.advance(StepStage.SNAPSHOT)
        self.sync.close(self.model, control)
        return self.entry_state(copy_state(self.state_dict()))

    def entry_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """`state` as a replica entering the group loads it, the same on every replica at a revision (a strict
        majority's hash vouches for all of it): this replica's own parts are left out (its RNG, its loss scaler,
        its last eval loss, its data shard; the device-bound optimizer options), and the synchronizer's local parts
        reset (Synchronizer.entry_state). `load_state_dict` keeps the loader's own for whatever is left out."""
        out = {k: v for k, v in state.items() if k not in LOCAL_STATE}
        out["data"] = {"position": state["data"]["position"]}  # the global stream's: the same on every replica
        opt = state["optimizer"]
        out["optimizer"] = {**opt, "param_groups": [{k: v for k, v in g.items() if k not in DEVICE_OPTIONS}
                                                    for g in opt["param_groups"]]}
        return self.sync.entry_state(out)

    def check_entry(self, state: dict[str, Any], revision: int) -> None:
        """Whether `state` (from the network, its hash agreed) fits this trainer at step `revision` (a revision's
        step; the run's final state, revision N + 1, is at step N), before anything of it is loaded: CheckpointError
        says why not (the state is not loaded, nothing of this trainer changes)."""
        def bad(why: str):
            return checkpoint.CheckpointError(f"entry state: {why}")
        try:
            if state.get("format") not in READABLE_FORMATS or state.get("run_id") != self.manifest.run_id \
                    or state.get("stage", 0) != self.stage:
                raise bad("another format, run or stage")
            if state.get("step") != revision or state.get("scheduler", {}).get("step") != revision:
                raise bad(f"its step is not {revision}")
            if not isinstance(state["data"]["position"], int):
                raise bad("no data position")
            model = state.get("model")
            if model is not None:
                own = self.model.state_dict()
                if set(model) != set(own) or any(not isinstance(model[k], torch.Tensor) or model[k].shape != v.shape
                                                 or model[k].dtype != v.dtype for k, v in own.items()):
                    raise bad("its model's tensors are not this stage's")
            groups = state["optimizer"]["param_groups"]
            if len(groups) != len(self.optimizer.param_groups):
                raise bad("its optimizer has other parameter groups")
        except (KeyError, TypeError, AttributeError) as e:
            raise bad(f"malformed ({type(e).__name__}: {e})") from None

    def whole_state(self, control: StepControl) -> dict[str, Any]:
        """The whole state at revision `control.step`, for this slot's checkpoint and its stage's shards: everything
        of this replica (its RNG, its data position, the synchronizer's state with a round still in flight carried
        pending, not applied), a private copy. Taking it never changes what training computes, so a run that
        checkpoints at any steps trains exactly as one that does not, and a checkpoint resumes exactly where it was
        taken (docs/checkpoints.md)."""
        if control.step != self.step_count:
            raise ValueError(f"snapshot for step {control.step}, but the trainer is at step {self.step_count}")
        control.advance(StepStage.SNAPSHOT)
        return copy_state(self.state_dict())

    def close(self, control: StepControl | None = None) -> None:
        """Apply the synchronizer's in-flight round (the end of training)."""
        self.sync.close(self.model, control)

    def step(self, control: StepControl | None = None) -> StepResult:
        """One optimizer step of the lane at this stage, then eval if due. `control` carries the step's group to the
        synchronizer and brings back the result, the state hash and what the round learned. A failure of the lane
        (LaneAborted) skips the update and is reported in the result; the stage group's synchronizer still runs
        (with zero gradients), so the group's rounds stay aligned."""
        control = control if control is not None else StepControl(step=self.step_count)
        if control.step != self.step_count:
            raise ValueError(f"asked for step {control.step}, but the trainer is at step {self.step_count}")
        batch = control.batch if control.batch is not None else self.default_batch()
        if batch.lane != self.replica or batch.global_batch != self.manifest.global_batch:
            raise ValueError(f"step {control.step}: a split for lane {batch.lane} of a global batch of "
                             f"{batch.global_batch}, this trainer is lane {self.replica} of a run of "
                             f"{self.manifest.global_batch}")
        for hook in self.before_step_hooks:
            hook(self)
        control.advance(StepStage.COMPUTE)
        t0, self._wait_s = time.perf_counter(), 0.0
        step = self.step_count
        if not self.model.training:  # after evaluate() (train() walks every module: ~3 % of a small GPU step)
            self.model.train()
        aborted: str | None = None
        failed_peer: str | None = None
        loss_sum = None
        cuda = self.device.type == "cuda"
        t_pass = time.perf_counter()
        started = torch.cuda.Event(enable_timing=True) if cuda else None
        if started is not None:
            started.record()
        try:
            loss_sum = self._pass(step, batch)
        except LaneAborted as e:
            aborted, failed_peer = str(e), e.peer
            self.optimizer.zero_grad(set_to_none=True)
        else:
            if started is not None:
                ended = torch.cuda.Event(enable_timing=True)
                ended.record()
                self.speed.add_events(batch.samples, self._wait_s, started, ended)
            else:
                self.speed.add(batch.samples, time.perf_counter() - t_pass - self._wait_s)
        if self.scaler:
            self.scaler.unscale_(self.optimizer)
        control.advance(StepStage.SYNC)
        wanted = self.sync.before_optimizer_step(self.model, self.optimizer, control)
        norm_t: torch.Tensor | None = None
        if aborted is None:
            try:
                norm_t = self._clip(step)
            except LaneAborted as e:
                aborted, failed_peer = str(e), e.peer
        if aborted is not None:
            log.warning("stage %d lane %d step %d aborted: %s", self.stage, self.replica, step, aborted)
            self.boundary.abort(step, aborted)
        # on the device, the fused optimizer skips a non-finite step itself (found_inf): no host sync before it
        on_device = self.fused and self.scaler is None and norm_t is not None and norm_t.device.type != "cpu"
        finite = True if on_device or norm_t is None else math.isfinite(float(norm_t))
        lr = lr_at(self.manifest.optim, step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        if wanted and aborted is None and finite:
            if on_device:
                self.optimizer.found_inf = (~torch.isfinite(norm_t)).float()
            if self.scaler:
                self.scaler.step(self.optimizer)
            else:
                self.optimizer.step()
            self.optimizer.found_inf = None
        if self.scaler:
            self.scaler.update()
        self.sync.after_optimizer_step(self.model, self.optimizer, control)
        self.optimizer.zero_grad(set_to_none=True)
        self.step_count = step + 1
        values = self._read_back(step, None if aborted else loss_sum, norm_t)
        self._stage_next(batch)
        seconds = time.perf_counter() - t0
        eval_loss = None
        every = self.manifest.eval.every_steps
        if every and self.step_count % every == 0:
            eval_loss = self.evaluate()
        tokens = batch.samples * self.manifest.batch.seq_len
        result = StepResult(
            step=self.step_count, lr=lr, tokens=tokens, seconds=seconds, samples=batch.samples,
            tokens_per_s=tokens / max(seconds, 1e-9), values=values, wanted=wanted,
            eval_loss=eval_loss, wait_s=self._wait_s, aborted=aborted, failed_peer=failed_peer)
        self.last = result
        control.result, control.state_hash = result, self.sync.state_hash()
        control.advance(StepStage.DONE)
        for after in self.after_step_hooks:
            after(self, result)
        return result

    def _read_back(self, step: int, loss: torch.Tensor | None, norm: torch.Tensor | None):
        """The step's (loss, gradient norm) as floats: on a GPU, a copy queued after the step's work, read when
        first wanted (so no host sync holds the next step back); elsewhere at once."""
        if loss is None and norm is None:
            return None, math.nan
        vals = torch.stack([(x if x is not None else torch.zeros(())).detach().float().to(self.device)
                            for x in (loss, norm)])

        def resolve(host: torch.Tensor) -> tuple[float | None, float]:
            lv, nv = host.tolist()
            if norm is not None and not math.isfinite(nv):
                log.warning("step %d: non-finite gradient norm, update skipped", step)
            return (lv if loss is not None else None), (nv if norm is not None else math.nan)

        if self.device.type != "cuda":
            return resolve(vals)
        host = self._pinned.take(vals)
        host.copy_(vals, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        self._pinned.used(host, done)

        def wait() -> tuple[float | None, float]:
            done.synchronize()
            return resolve(host)

        return wait

    @torch.no_grad()
    def evaluate(self) -> float | None:
        """Mean loss over the fixed held-out batches, through the lane (deterministic for given weights): the last
        stage's figure, None at the other stages and when the lane fails on the way."""
        self.model.eval()
        step = self.step_count
        total = 0.0
        try:
            for i, ids in enumerate(self.eval_ids):
                batch = self._micro_batches(ids, self.heldout_samples)[0] if self.is_first else None
                _, out = self._forward(step, i, batch, self.heldout_samples, EVAL)
                if self.is_last:
                    total += float(out)
        except LaneAborted as e:
            log.warning("stage %d lane %d eval at step %d aborted: %s", self.stage, self.replica, step, e)
            self.boundary.abort(step, str(e), phase=EVAL)
            return None
        if not self.is_last:
            return None
        self.last_eval_loss = total / len(self.eval_ids)
        return self.last_eval_loss

    def status(self) -> dict[str, Any]:
        """What the node's status record shows about training."""
        last = self.last
        return {
            "step": self.step_count,
            "loss": last.loss if last else None,
            "eval_loss": self.last_eval_loss,
            "tokens_per_s": last.tokens_per_s if last else None,
            "lr": last.lr if last else None,
            "epoch": self.order.epoch_at(self.step_count, self.manifest.global_batch),
        }

    # -- checkpoints and hand-over

    def state_dict(self) -> dict[str, Any]:
        rng: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
        if self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        return {
            "format": CHECKPOINT_FORMAT,
            "run_id": self.manifest.run_id,
            "stage": self.stage,
            "step": self.step_count,
            "model": {k: v.detach().cpu() for k, v in self.model.state_dict().items()},
            "optimizer": self.optimizer.state_dict(),
            "scheduler": {"step": self.step_count},
            "scaler": self.scaler.state_dict() if self.scaler else {},
            # where the data stream is: the step says it (step x global batch), kept for readers of the checkpoint;
            # and whose lane this state is (a rollback tells its own state from another lane's rebuilt one)
            "data": {"position": self.step_count * self.manifest.global_batch, "replica": self.replica},
            "rng": rng,
            "sync": self.sync.state_dict(),
            "last_eval_loss": self.last_eval_loss,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load a checkpoint, or an entry state (`entry_state`: the parts it leaves out stay this trainer's own)."""
        if state.get("format") not in READABLE_FORMATS:
            raise checkpoint.CheckpointError(f"checkpoint format {state.get('format')!r}, this version reads "
                                             f"{', '.join(map(str, READABLE_FORMATS))}")
        if state["run_id"] != self.manifest.run_id:
            raise checkpoint.CheckpointError(f"checkpoint belongs to run {state['run_id'][:16]}, not {self.manifest.run_id[:16]}")
        if state.get("stage", 0) != self.stage:
            raise checkpoint.CheckpointError(f"checkpoint of stage {state.get('stage')}, this trainer is stage {self.stage}")
        if state["model"] is not None:
            self.model.load_state_dict(state["model"])
        own = self.optimizer.param_groups  # this device's options (fused, foreach...) where the state has none
        opt = state["optimizer"]
        self.optimizer.load_state_dict({**opt, "param_groups": [
            {**{k: v for k, v in g.items() if k != "params"}, **ng} for g, ng in zip(own, opt["param_groups"])]})
        if self.scaler and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        self.step_count = state["step"]  # the data stream's position follows from it
        if "rng" in state:
            torch.set_rng_state(state["rng"]["torch"])
            random.setstate(state["rng"]["python"])
            if "cuda" in state["rng"] and self.device.type == "cuda":
                torch.cuda.set_rng_state(state["rng"]["cuda"], self.device)
        self.sync.load_state_dict(state["sync"])
        if "last_eval_loss" in state:
            self.last_eval_loss = state["last_eval_loss"]

    def save(self, directory: Path) -> Path:
        return checkpoint.save_checkpoint(
            directory, self.step_count, self.state_dict(), keep_last=self.manifest.checkpoint.keep_last
        )

    def resume(self, directory: Path) -> int | None:
        """Load the newest good checkpoint in `directory`; its step, or None if there was none."""
        found = checkpoint.load_latest(directory)
        if found is None:
            return None
        self.load_state_dict(found[1])
        return found[0]


class _StagePass:
    """One step's micro-batches at one stage, as its pipeline schedule runs them, a wave at a time (the schedule's
    micro-batch m is `offset + m` of the share): a forward leaves (input leaf or None, output) for its backward; the
    last stage's output is the micro-batch's mean loss weighted by its part of the share, summed here."""

    def __init__(self, trainer: Trainer, step: int, batches: list | None, sizes: list[int]):
        self.trainer, self.step, self.batches, self.sizes = trainer, step, batches, sizes
        self.samples = sum(sizes)
        self.offset = 0
        self.loss_sum: torch.Tensor | None = None  # the first micro-batch's loss, then sums (0 + a is a, bit for bit)

    def forward(self, micro: int) -> tuple[torch.Tensor | None, torch.Tensor]:
        t, m = self.trainer, self.offset + micro
        inp, out = t._forward(self.step, m, self.batches[m] if self.batches else None, t.train_samples, TRAIN)
        if t.is_last:  # n / size is the micro-batch count when all are equal: out / M, as a full batch has it
            out = micro_loss(out, self.samples, self.sizes[m])
            part = out.detach().float()
            self.loss_sum = part if self.loss_sum is None else self.loss_sum + part
        return inp, out

    def backward(self, micro: int, kept: tuple[torch.Tensor | None, torch.Tensor]) -> None:
        self.trainer._backward(self.step, self.offset + micro, *kept)
