"""The step loop of one replica: micro-batches, AdamW or SGD, warm-up + cosine, clipping, eval, hooks, a synchronizer slot.

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
from pathlib import Path
from typing import Any

import torch

from shoal.node.train import checkpoint
from shoal.node.train.data import Corpus, Samples, ShardedSampler, heldout_batches, load_corpus
from shoal.node.train.device import resolve_device
from shoal.node.train.control import StepControl, StepResult, StepStage
from shoal.node.train.model import GPTConfig, GPTStage, build_stage, lm_loss
from shoal.node.sync.interface import NoSync, Synchronizer
from shoal.protocol.manifest import OptimSpec, RunManifest

log = logging.getLogger(__name__)
CHECKPOINT_FORMAT = 1


def lr_at(opt: OptimSpec, step: int) -> float:
    """Linear warm-up over warmup_steps, then cosine from lr down to min_lr_ratio * lr at total_steps."""
    if step < opt.warmup_steps:
        return opt.lr * (step + 1) / opt.warmup_steps
    span = max(opt.total_steps - opt.warmup_steps, 1)
    progress = min((step - opt.warmup_steps) / span, 1.0)
    return opt.lr * (opt.min_lr_ratio + (1 - opt.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


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
    """Trains one replica of one stage of a run (stage 0 of 1 is the whole model) from a run manifest."""

    def __init__(
        self,
        manifest: RunManifest,
        *,
        device: str | torch.device = "cpu",
        stage: int = 0,
        replica: int = 0,
        synchronizer: Synchronizer | None = None,
        corpus: Corpus | None = None,
    ):
        if manifest.plan.stages != 1:
            raise ValueError(f"this trainer runs one-stage plans; the run has {manifest.plan.stages} stages")
        self.manifest = manifest
        self.device = resolve_device(device) if isinstance(device, str) else device
        self.sync = synchronizer or NoSync()
        self.corpus = corpus or load_corpus(manifest.data.source, manifest.data.heldout_every)
        seq = manifest.batch.seq_len
        self.train_samples = Samples(self.corpus.train, seq)
        self.heldout_samples = Samples(self.corpus.heldout, seq)
        self.sampler = ShardedSampler(
            self.train_samples.num_samples, seed=manifest.seed, replica=replica, replicas=manifest.plan.replicas
        )
        self.eval_ids = heldout_batches(self.heldout_samples, manifest.batch.micro_batch_size, manifest.eval.batches)
        self.model_config = GPTConfig.from_spec(manifest.model, seq)
        self.stage = stage
        self.model: GPTStage = build_stage(self.model_config, stage, manifest.plan.stages,
                                           seed=manifest.seed).to(self.device)
        decay = [p for p in self.model.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.model.parameters() if p.dim() < 2]
        o = manifest.optim
        groups = [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        if o.optimizer == "sgd":
            self.optimizer: torch.optim.Optimizer = torch.optim.SGD(groups, lr=lr_at(o, 0))
        else:
            self.optimizer = torch.optim.AdamW(groups, lr=lr_at(o, 0), betas=(o.beta1, o.beta2), eps=o.eps)
        self.autocast_dtype: torch.dtype | None = None
        self.scaler: torch.amp.GradScaler | None = None
        if self.device.type == "cuda":
            self.autocast_dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
            if self.autocast_dtype == torch.float16:
                self.scaler = torch.amp.GradScaler("cuda")
        self.step_count = 0
        self.before_step_hooks: list[Callable[[Trainer], None]] = []
        self.after_step_hooks: list[Callable[[Trainer, StepResult], None]] = []
        self.last: StepResult | None = None
        self.last_eval_loss: float | None = None

    @property
    def tokens_per_step(self) -> int:
        return self.manifest.batch.batch_size * self.manifest.batch.seq_len

    def _autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)

    def snapshot(self, control: StepControl) -> dict[str, Any]:
        """The state at revision `control.step` (the round boundary before that step): the synchronizer's in-flight
        round applied first, then a private copy of everything (training may go on while it is served)."""
        if control.step != self.step_count:
            raise ValueError(f"snapshot for step {control.step}, but the trainer is at step {self.step_count}")
        control.advance(StepStage.SNAPSHOT)
        self.sync.close(self.model, control)
        return copy_state(self.state_dict())

    def close(self, control: StepControl | None = None) -> None:
        """Apply the synchronizer's in-flight round (the end of training)."""
        self.sync.close(self.model, control)

    def step(self, control: StepControl | None = None) -> StepResult:
        """One optimizer step over batch_size sequences (micro-batched), then eval if due. `control` carries the
        step's group to the synchronizer and brings back its result, state hash and what the round learned."""
        control = control if control is not None else StepControl(step=self.step_count)
        if control.step != self.step_count:
            raise ValueError(f"asked for step {control.step}, but the trainer is at step {self.step_count}")
        for hook in self.before_step_hooks:
            hook(self)
        control.advance(StepStage.COMPUTE)
        t0 = time.perf_counter()
        b = self.manifest.batch
        step = self.step_count
        self.model.train()
        ids = self.sampler.next_ids(b.batch_size)
        n_micro = b.batch_size // b.micro_batch_size
        loss_sum = torch.zeros((), device=self.device)
        for micro_ids in ids.split(b.micro_batch_size):
            x, y = self.train_samples.get(micro_ids)
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            with self._autocast():
                loss = lm_loss(self.model(x), y) / n_micro
            (self.scaler.scale(loss) if self.scaler else loss).backward()
            loss_sum += loss.detach()
        if self.scaler:
            self.scaler.unscale_(self.optimizer)
        control.advance(StepStage.SYNC)
        apply = self.sync.before_optimizer_step(self.model, self.optimizer, control)
        params = [p for p in self.model.parameters() if p.grad is not None]
        clip = self.manifest.optim.grad_clip
        if clip > 0:
            grad_norm = torch.nn.utils.clip_grad_norm_(params, clip)
        else:
            grad_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params]))
        grad_norm_f = float(grad_norm)
        apply = apply and math.isfinite(grad_norm_f)
        lr = lr_at(self.manifest.optim, step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        if apply:
            if self.scaler:
                self.scaler.step(self.optimizer)
            else:
                self.optimizer.step()
        elif not math.isfinite(grad_norm_f):
            log.warning("step %d: non-finite gradient norm, update skipped", step)
        if self.scaler:
            self.scaler.update()
        self.sync.after_optimizer_step(self.model, self.optimizer, control)
        self.optimizer.zero_grad(set_to_none=True)
        self.step_count = step + 1
        loss_f = float(loss_sum)
        seconds = time.perf_counter() - t0
        eval_loss = None
        every = self.manifest.eval.every_steps
        if every and self.step_count % every == 0:
            eval_loss = self.evaluate()
        result = StepResult(
            step=self.step_count,
            loss=loss_f,
            lr=lr,
            grad_norm=grad_norm_f,
            tokens=self.tokens_per_step,
            seconds=seconds,
            tokens_per_s=self.tokens_per_step / max(seconds, 1e-9),
            applied=apply,
            eval_loss=eval_loss,
        )
        self.last = result
        control.result, control.state_hash = result, self.sync.state_hash()
        control.advance(StepStage.DONE)
        for after in self.after_step_hooks:
            after(self, result)
        return result

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss over the fixed held-out batches (deterministic for given weights)."""
        self.model.eval()
        total = 0.0
        for ids in self.eval_ids:
            x, y = self.heldout_samples.get(ids)
            with self._autocast():
                total += float(lm_loss(self.model(x.to(self.device)), y.to(self.device)))
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
            "epoch": self.sampler.epoch(),
        }

    # -- checkpoints

    def state_dict(self) -> dict[str, Any]:
        rng: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
        if self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        return {
            "format": CHECKPOINT_FORMAT,
            "run_id": self.manifest.run_id,
            "step": self.step_count,
            "model": {k: v.detach().cpu() for k, v in self.model.state_dict().items()},
            "optimizer": self.optimizer.state_dict(),
            "scheduler": {"step": self.step_count},
            "scaler": self.scaler.state_dict() if self.scaler else {},
            "data": {"position": self.sampler.position, "replica": self.sampler.replica, "replicas": self.sampler.replicas},
            "rng": rng,
            "sync": self.sync.state_dict(),
            "last_eval_loss": self.last_eval_loss,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("format") != CHECKPOINT_FORMAT:
            raise checkpoint.CheckpointError(f"checkpoint format {state.get('format')!r}, expected {CHECKPOINT_FORMAT}")
        if state["run_id"] != self.manifest.run_id:
            raise checkpoint.CheckpointError(f"checkpoint belongs to run {state['run_id'][:16]}, not {self.manifest.run_id[:16]}")
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scaler and state["scaler"]:
            self.scaler.load_state_dict(state["scaler"])
        self.step_count = state["step"]
        self.sampler.position = state["data"]["position"]
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        if "cuda" in state["rng"] and self.device.type == "cuda":
            torch.cuda.set_rng_state(state["rng"]["cuda"], self.device)
        self.sync.load_state_dict(state["sync"])
        self.last_eval_loss = state.get("last_eval_loss")

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
