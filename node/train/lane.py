"""A stage's view of its lane (the `Boundary` the GPipe schedule talks through) and an in-process lane of threads.

The runtime plugs in the network implementation (swarm/lane/blocking.py `BlockingLinkEnd`, which has these methods);
`LocalLane` joins S stages in one process through mailboxes (parity tests, one-machine pipelines).
"""

from __future__ import annotations

import threading
import time
from typing import Protocol, runtime_checkable

import torch

from shoal.protocol.lane import TRAIN, LaneAborted

__all__ = ["Boundary", "LaneAborted", "LocalLane", "LocalBoundary", "SoloLane", "Unconnected"]


@runtime_checkable
class Boundary(Protocol):
    """What one stage needs from the rest of its lane. Calls block (the trainer's worker thread) and raise
    `LaneAborted` when the step cannot finish; `abort` tells the neighbours so they stop waiting.

    Activations go to the next stage and come from the previous one, gradients the other way; `ids` are the
    micro-batch's sample ids (int64, one per row). A stage never calls what its position lacks (the first stage
    receives no activations, the last sends none)."""

    def send_act(self, step: int, micro: int, ids: torch.Tensor, acts_BTD: torch.Tensor, *,
                 phase: str = TRAIN) -> None: ...

    def recv_act(self, step: int, micro: int, *, phase: str = TRAIN) -> tuple[torch.Tensor, torch.Tensor]: ...

    def send_grad(self, step: int, micro: int, grad_BTD: torch.Tensor) -> None: ...

    def recv_grad(self, step: int, micro: int) -> torch.Tensor: ...

    def exchange_norms(self, step: int, norms: list[float], finite: bool) -> list[tuple[list[float], bool]]:
        """Every stage's (per-parameter gradient norms, finite) for `step`, in stage order (this stage's included;
        a stage that is not finite sends no norms)."""
        ...

    def abort(self, step: int, reason: str, *, phase: str = TRAIN) -> None:
        """Give `step` up (best effort, never raises): the lane's other stages stop waiting for it."""
        ...


class SoloLane(Boundary):
    """The lane of a one-stage plan: no neighbours; the lane's norms are this stage's own."""

    def _none(self, *args, **kw):
        raise LaneAborted("a one-stage lane has no neighbours")

    send_act = recv_act = send_grad = recv_grad = _none

    def exchange_norms(self, step, norms, finite):
        return [([float(x) for x in norms], bool(finite))]

    def abort(self, step, reason, *, phase=TRAIN):
        pass


class Unconnected(Boundary):
    """A stage whose links are not open (yet): every exchange with the lane aborts the step."""

    def _none(self, *args, **kw):
        raise LaneAborted("this stage's lane links are not open")

    send_act = recv_act = send_grad = recv_grad = exchange_norms = _none

    def abort(self, step, reason, *, phase=TRAIN):
        pass


class LocalLane:
    """S stages of one lane in one process (one thread each), joined by mailboxes under one condition."""

    def __init__(self, num_stages: int, *, timeout_s: float = 60.0):
        if num_stages < 1 or timeout_s <= 0:
            raise ValueError("need num_stages >= 1 and timeout_s > 0")
        self.num_stages = num_stages
        self.timeout_s = timeout_s
        self._cond = threading.Condition()
        self._box: dict[tuple, object] = {}
        self._aborted: dict[tuple[int, str], str] = {}

    def boundary(self, stage: int) -> LocalBoundary:
        if not 0 <= stage < self.num_stages:
            raise ValueError(f"stage {stage} of {self.num_stages}")
        return LocalBoundary(self, stage)

    def _put(self, key: tuple, value: object) -> None:
        with self._cond:
            self._box[key] = value
            self._cond.notify_all()

    def _take(self, key: tuple, step: int, phase: str) -> object:
        deadline = time.monotonic() + self.timeout_s
        with self._cond:
            while key not in self._box:
                if (step, phase) in self._aborted:
                    raise LaneAborted(f"a stage gave step {step} up: {self._aborted[step, phase]}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise LaneAborted(f"no {key[0]} for step {step} within {self.timeout_s:g} s")
                self._cond.wait(left)
            return self._box.pop(key)

    def _abort(self, step: int, phase: str, reason: str) -> None:
        with self._cond:
            self._aborted.setdefault((step, phase), reason)
            self._cond.notify_all()


class LocalBoundary(Boundary):
    """Stage `stage`'s side of a `LocalLane`; tensors are copied across, as a wire would."""

    def __init__(self, lane: LocalLane, stage: int):
        self.lane, self.stage = lane, stage

    def send_act(self, step, micro, ids, acts_BTD, *, phase=TRAIN):
        self.lane._put(("act", self.stage, step, micro, phase), (ids.clone(), acts_BTD.detach().cpu().clone()))

    def recv_act(self, step, micro, *, phase=TRAIN):
        return self.lane._take(("act", self.stage - 1, step, micro, phase), step, phase)

    def send_grad(self, step, micro, grad_BTD):
        self.lane._put(("grad", self.stage, step, micro), grad_BTD.detach().cpu().clone())

    def recv_grad(self, step, micro):
        return self.lane._take(("grad", self.stage + 1, step, micro), step, TRAIN)

    def exchange_norms(self, step, norms, finite):
        mine = ([float(x) for x in norms], bool(finite))
        for other in range(self.lane.num_stages):
            if other != self.stage:
                self.lane._put(("norm", other, step, self.stage), mine)
        return [mine if s == self.stage else
                self.lane._take(("norm", self.stage, step, s), step, TRAIN) for s in range(self.lane.num_stages)]

    def abort(self, step, reason, *, phase=TRAIN):
        self.lane._abort(step, phase, reason)

