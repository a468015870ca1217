"""The pipeline schedule a stage runs each step: in which order its micro-batches go forward and backward.

The trainer holds one schedule object and hands it the step's micro-batches as two calls, `forward(m)` and
`backward(m, ...)` (torchtitan's `pp_schedule.step`): the schedule owns the order, the trainer owns what a forward and
a backward do (the model, the lane's boundary, the loss). `GPipe` runs every forward, then every backward in
micro-batch order 0..M-1, with a flush per step (docs/pipeline.md, "Schedule"); a one-stage lane uses `Accumulate`,
each backward right after its forward (plain gradient accumulation: the same gradients, one graph alive at a time).
Another schedule (1F1B, interleaved) is one more class beside them, chosen by `schedule_for`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Generic, Protocol, TypeVar

Kept = TypeVar("Kept")  # what a forward leaves for its backward (the input leaf and the output)


class MicroBatches(Protocol[Kept]):
    """One step's micro-batches at one stage, as the trainer runs them."""

    def forward(self, micro: int) -> Kept:
        """Micro-batch `micro` forward through this stage (receiving and sending activations on a lane)."""

    def backward(self, micro: int, kept: Kept) -> None:
        """Micro-batch `micro` backward through this stage, from what its forward left."""


class PipelineSchedule(ABC, Generic[Kept]):
    """The order of one step's forwards and backwards at one stage; every stage of a lane runs the same one."""

    name: str = ""

    @abstractmethod
    def run(self, step: MicroBatches[Kept], micro_batches: int) -> None:
        """Run `micro_batches` micro-batches (0..M-1) through `step`, each forward before its backward."""


class Accumulate(PipelineSchedule[Kept]):
    """A lane of one stage: each micro-batch's backward right after its forward (gradient accumulation)."""

    name = "accumulate"

    def run(self, step: MicroBatches[Kept], micro_batches: int) -> None:
        for m in range(micro_batches):
            step.backward(m, step.forward(m))


class GPipe(PipelineSchedule[Kept]):
    """Every forward, then every backward in micro-batch order 0..M-1, then the step ends (a flush): the bubble is
    (S-1)/(M+S-1) of the step. Gradients accumulate in the same order as `Accumulate`'s, so a lane of one stage
    would agree with it bit for bit (it only keeps every micro-batch's graph until the backwards)."""

    name = "gpipe"

    def run(self, step: MicroBatches[Kept], micro_batches: int) -> None:
        kept: list[Kept | None] = [step.forward(m) for m in range(micro_batches)]
        for m in range(micro_batches):
            k, kept[m] = kept[m], None  # frees the micro-batch's graph as soon as it is done
            step.backward(m, k)  # type: ignore[arg-type]  # set just above


def schedule_for(stages: int) -> PipelineSchedule:
    """The schedule of a lane of `stages` stages."""
    return Accumulate() if stages == 1 else GPipe()
