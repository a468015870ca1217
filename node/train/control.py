"""One training step as one object crossing the boundary between the run runtime and the trainer thread.

In the manner of hivemind's `StepControl`: the runtime (on the event loop) creates a `StepControl` for step t with
the round's group, hands it to the trainer in a worker thread, and reads it back when the thread returns. In
between, the trainer thread is its only writer; afterwards, only the runtime reads it. Nothing in it calls back
into the event loop: what the synchronizer learned about other members (who missed a deadline, whose update was
rejected) is recorded here and acted on by the runtime once the step is over.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class StepStage(enum.Enum):
    PLANNED = "planned"  # made by the runtime: the step number and the round's group
    SNAPSHOT = "snapshot"  # the in-flight round applied and the state at revision `step` copied (when asked)
    COMPUTE = "compute"  # forward and backward of the micro-batches
    SYNC = "sync"  # the synchronizer around the optimizer step
    DONE = "done"  # result, state hash and report are final


@dataclass(frozen=True, kw_only=True, slots=True)
class StepResult:
    step: int  # the number of optimizer steps done after this one
    loss: float | None  # the lane's training loss (the last stage knows it; None elsewhere and when aborted)
    lr: float
    grad_norm: float  # the lane's (inf when a stage was not finite, nan when the step was aborted)
    tokens: int  # tokens the lane trained on this step
    seconds: float
    tokens_per_s: float
    applied: bool  # False if the update was skipped (aborted, non-finite gradients, or the synchronizer said so)
    eval_loss: float | None = None
    wait_s: float = 0.0  # blocked on the lane's other stages: the pipeline bubble plus the links
    aborted: str | None = None  # why the lane's step was given up at this stage
    failed_peer: str | None = None  # the lane neighbour the failure concerns, when one does (for the broker)


@dataclass(eq=False, slots=True)
class StepControl:
    """Step `step` of one replica. `group` is the round's group (a `shoal.swarm.run.group.Group`), opaque to the
    trainer and handed to the synchronizer as it is; None for a replica without one."""

    step: int
    group: Any = None
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
