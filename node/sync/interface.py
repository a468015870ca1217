"""The synchronizer contract: what keeps the D replicas of a stage together, as the trainer and the runtime use it.

The trainer calls `before_optimizer_step` once the local gradients of the whole batch are accumulated (an
all-reduce averages them here; False skips the update) and `after_optimizer_step` after the update (CocktailSGD and
DiLoCo exchange parameter differences here), each with the step's `StepControl`, into which the synchronizer
records the members that missed a deadline or sent updates it rejected. Everything else the runtime needs is named
here too, so nothing probes a synchronizer with `hasattr`. `NoSync` is the member for a single replica.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch

from shoal.node.train.control import StepControl


class Synchronizer(ABC):
    name: ClassVar[str] = "?"

    def __init__(self) -> None:
        self.bytes_sent = 0  # tensor-frame bytes sent to other members (read by the status, any thread)
        self.bytes_recv = 0  # tensor-frame bytes accepted from other members
        self.fp32_bytes = 0  # what fp32 all-reduce messages for the same coordinates would have carried
        self.rounds = 0

    @abstractmethod
    def before_optimizer_step(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                              control: StepControl) -> bool: ...

    @abstractmethod
    def after_optimizer_step(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                             control: StepControl) -> None: ...

    def close(self, model: torch.nn.Module, control: StepControl | None = None) -> None:
        """Finish whatever round is still in flight and apply it (before a snapshot, at the end); what the round
        learned about members goes into `control`."""

    def enter(self, model: torch.nn.Module) -> None:
        """After a replica loads the group's state to enter it: restart local state from the synchronized one."""

    def distrust(self, peer: str) -> None:
        """Leave `peer`'s updates out of what this replica aggregates until the group changes (other evidence shows
        it poisons the group: a verified stage's re-execution, docs/verified-stages.md)."""

    def take_outliers(self) -> set[str]:
        """The members whose updates this replica left out or clipped since the last call (evidence against their
        lanes, for verified stages)."""
        return set()

    def state_hash(self) -> str:
        """Hash of the synchronized state after the last round, equal on every replica ("": none kept)."""
        return ""

    @property
    def compression_ratio(self) -> float:
        """fp32 all-reduce bytes over bytes really sent, since the start (warm-up steps included)."""
        return self.fp32_bytes / self.bytes_sent if self.bytes_sent else 1.0

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def entry_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """`state` (a trainer's, this synchronizer's under "sync") as a replica entering the group at this revision
        loads it: the same on every replica of the group, so that a strict majority's hash vouches for all of it.
        What is a replica's own is left out or reset, never passed on: here the round counter; a synchronizer whose
        replicas keep local parameters (CocktailSGD's x, DiLoCo's inner steps) also leaves out the model and the
        optimizer's moments, which entering derives from the synchronized state (`enter`) or starts afresh."""
        return {**state, "sync": {k: v for k, v in state["sync"].items() if k != "rounds"}}


class NoSync(Synchronizer):
    """One replica: nothing to synchronize."""

    name = "none"

    def before_optimizer_step(self, model, optimizer, control):
        return True

    def after_optimizer_step(self, model, optimizer, control):
        return None
