"""One training step as one object crossing the boundary between the run runtime and the trainer thread.

In the manner of hivemind's `StepControl`: the runtime (on the event loop) creates a `StepControl` for step t with
the round's group, hands it to the trainer in a worker thread, and reads it back when the thread returns. In
between, the trainer thread is its only writer; afterwards, only the runtime reads it. Nothing in it calls back
into the event loop: what the synchronizer learned about other members (who missed a deadline, whose update was
rejected) is recorded here and acted on by the runtime once the step is over.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from shoal.node.train.batch import StepBatch


class StepStage(enum.Enum):
    PLANNED = "planned"  # made by the runtime: the step number and the round's group
    SNAPSHOT = "snapshot"  # the in-flight round applied and the state at revision `step` copied (when asked)
    COMPUTE = "compute"  # forward and backward of the micro-batches
    SYNC = "sync"  # the synchronizer around the optimizer step
    DONE = "done"  # result, state hash and report are final


class StepResult:
    """What one step did. On a GPU its loss and gradient norm stay on the device when the step returns (so the next
    step is queued while this one still runs): the first read of `loss`, `grad_norm` or `applied` waits for them."""

    __slots__ = ("step", "lr", "tokens", "samples", "seconds", "tokens_per_s", "eval_loss", "wait_s", "aborted",
                 "failed_peer", "_wanted", "_values", "_resolve")

    def __init__(self, *, step: int, lr: float, tokens: int, seconds: float, tokens_per_s: float,
                 values: tuple[float | None, float] | Callable[[], tuple[float | None, float]], wanted: bool = True,
                 eval_loss: float | None = None, wait_s: float = 0.0, aborted: str | None = None,
                 failed_peer: str | None = None, samples: int = 0):
        self.step = step  # the number of optimizer steps done after this one
        self.lr = lr
        self.tokens = tokens  # tokens the lane trained on this step (its share of the global batch)
        self.samples = samples  # sequences of them
        self.seconds = seconds  # the step's wall time in the trainer thread (on a GPU: until its work was queued)
        self.tokens_per_s = tokens_per_s
        self.eval_loss = eval_loss
        self.wait_s = wait_s  # blocked on the lane's other stages: the pipeline bubble plus the links
        self.aborted = aborted  # why the lane's step was given up at this stage
        self.failed_peer = failed_peer  # the lane neighbour the failure concerns, when one does (for the broker)
        self._wanted = wanted  # the synchronizer and the lane let the update through
        self._values, self._resolve = (values, None) if isinstance(values, tuple) else (None, values)

    def _get(self) -> tuple[float | None, float]:
        if self._values is None:
            self._values, self._resolve = self._resolve(), None
        return self._values

    @property
    def loss(self) -> float | None:
        """The lane's training loss (the last stage knows it; None elsewhere and when the step was aborted)."""
        return self._get()[0]

    @property
    def grad_norm(self) -> float:
        """The lane's gradient norm (inf when a stage was not finite, nan when the step was aborted)."""
        return self._get()[1]

    @property
    def applied(self) -> bool:
        """False if the update was skipped (aborted, non-finite gradients, or the synchronizer said so)."""
        return self._wanted and self.aborted is None and math.isfinite(self.grad_norm)

    def __repr__(self) -> str:
        return (f"StepResult(step={self.step}, loss={self.loss}, grad_norm={self.grad_norm}, applied={self.applied}, "
                f"aborted={self.aborted!r})")


@dataclass(eq=False, slots=True)
class StepControl:
    """Step `step` of one replica. `group` is the round's group (a `shoal.swarm.run.group.Group`), opaque to the
    trainer and handed to the synchronizer as it is; None for a replica without one."""

    step: int
    group: Any = None
    # the step's split of the global batch as this lane sees it (node/train/batch.py); None: the run's starting
    # lanes, evenly
    batch: StepBatch | None = None
    stage: StepStage = StepStage.PLANNED
    # -- written by the trainer thread
    result: StepResult | None = None
    state_hash: str = ""  # the synchronized state's hash after the step ("" for a synchronizer that keeps none)
    missing: set[str] = field(default_factory=set)  # members that missed a round's deadline
    offenders: dict[str, str] = field(default_factory=dict)  # member -> why its update was rejected

    def advance(self, stage: StepStage) -> None:
        if list(StepStage).index(stage) < list(StepStage).index(self.stage):
            raise RuntimeError(f"step {self.step} cannot go back from {self.stage.value} to {stage.value}")
        self.stage = stage

    def absorb(self, missing: set[str], offenders: dict[str, str]) -> None:
        """Take over what a round learned (a round that ran in the background reports into the step joining it)."""
        self.missing |= missing
        for peer, why in offenders.items():
            self.offenders.setdefault(peer, why)

    @property
    def applied(self) -> bool:
        return self.result is not None and self.result.applied
