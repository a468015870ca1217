"""This node's replica of its stage: the trainer and its synchronizer, the step it is at, its run state (joining,
training...), and loading or taking its model state. Owned by the event loop; torch work runs in a worker thread."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import trio

from shoal.node.run.config import RunConfig
from shoal.node.run.status import Thinned, Throughput
from shoal.node.sync.interface import Synchronizer
from shoal.node.train.checkpoint import CheckpointError
from shoal.node.train.control import StepControl, StepResult
from shoal.protocol.manifest import RunManifest
from shoal.protocol.records import HISTORY_POINTS
from shoal.swarm.net.penalty import Penalties
from shoal.swarm.state.snapshot import Snapshot, StateTransferError, flatten_state

log = logging.getLogger(__name__)

Exchange = Callable[[str, dict[str, bytes], set[str], float], dict[str, bytes]]  # Collective.blocking's call


class _HalfLoaded(RuntimeError):
    """Loading a state failed after it began: the trainer holds part of it."""


class Replica:
    """`trainer` and `sync` are None until `build` (a backup, or a node waiting for its slot, has none)."""

    def __init__(self, config: RunConfig, penalties: Penalties):
        self.config, self.penalties = config, penalties
        self.trainer = None  # a node.train.trainer.Trainer (imported with torch, in the worker thread)
        self.sync: Synchronizer | None = None
        self.throughput: Throughput | None = None
        self.at_step = 0  # optimizer steps the trainer has done (updated between steps, on the loop)
        self.state = "joining"  # what the status record says the run is doing here
        self.last: StepResult | None = None  # the last step's result
        self.loss_history = Thinned(HISTORY_POINTS)  # for a dashboard that starts late (the status record's history)
        self.eval_history = Thinned(HISTORY_POINTS)

    @property
    def slot(self) -> tuple[int, int] | None:
        """(stage, replica) the trainer was built for."""
        return None if self.trainer is None else (self.trainer.stage, self.trainer.replica)

    async def build(self, manifest: RunManifest, data_source: str, stage: int, replica: int, exchange: Exchange, *,
                    tokenizer: Path | None = None, weights: Path | None = None) -> None:
        """A new trainer for (stage, replica), its synchronizer exchanging through `exchange`; `tokenizer` and
        `weights`: the run's files of them (node/run/files.py), when it names any."""
        from shoal.node.sync.base import SyncConfig
        from shoal.node.sync.factory import make_synchronizer
        from shoal.node.train.trainer import Trainer

        config, penalties = self.config, self.penalties

        def build():
            import torch

            from shoal.node.train.data import load_run_corpus
            from shoal.node.train.lane import Unconnected

            if config.threads:
                torch.set_num_threads(config.threads)
            sync = make_synchronizer(manifest, exchange=exchange, penalties=penalties,
                                     config=SyncConfig(round_timeout_s=config.round_timeout_s))
            boundary = Unconnected() if manifest.plan.stages > 1 else None  # links open before each step
            corpus = load_run_corpus(manifest, data_source, tokenizer)
            trainer = Trainer(manifest, device=config.device, stage=stage, replica=replica, boundary=boundary,
                              synchronizer=sync, corpus=corpus, weights=weights)
            return trainer, sync

        self.trainer, self.sync = await trio.to_thread.run_sync(build)
        self.throughput = Throughput()
        self.at_step = self.trainer.step_count

    def drop(self) -> None:
        """Forget the trainer (the slot moved: another stage holds other parameters, another lane other samples)."""
        self.trainer = None

    async def load(self, snap: Snapshot, *, step: int | None = None, enter: bool = True) -> None:
        """Load the group's entry state (pulled with the hash the group agrees on), then (`enter`) let the
        synchronizer restart local state from it; a slot's own whole state (a checkpoint, a rollback) is loaded as
        it is. `step`: the training step the state must be at (default: its revision; the run's final
        state, revision N + 1, is at step N). A state that does not fit this trainer is refused before any of it is
        loaded; one that fails while loading leaves a trainer of unknown state, which is dropped (rebuilt before the
        next entry). Either way StateTransferError: never an error that stops the node."""
        trainer, sync = self.trainer, self.sync

        def load() -> None:
            state = snap.state(copy=True)  # the snapshot may be served afterwards: training must not change it
            trainer.check_entry(state, snap.revision if step is None else step)  # CheckpointError: nothing loaded
            try:
                trainer.load_state_dict(state)
                if enter:
                    sync.enter(trainer.model)
            except Exception as e:  # noqa: BLE001 - a half-loaded trainer must not train on
                raise _HalfLoaded(f"{type(e).__name__}: {e}") from e

        try:
            await trio.to_thread.run_sync(load)
        except CheckpointError as e:
            raise StateTransferError(f"the agreed state does not fit this trainer: {e}") from e
        except _HalfLoaded as e:
            self.trainer = self.sync = None
            raise StateTransferError(f"loading the agreed state failed half way ({e}): the trainer is rebuilt") from e
        self.at_step = trainer.step_count

    def state_bytes(self) -> int:
        """Bytes of this replica's whole state (its tensors), as a checkpoint holds it."""
        return sum(t.numel() * t.element_size() for t in flatten_state(self.trainer.state_dict())[0].values())

    def snapshot(self, control: StepControl, revision: int | None = None) -> Snapshot:
        """Worker thread: the entry state at the round boundary of `control.step`, as a snapshot (taken as revision
        `revision`, by default that step)."""
        state = self.trainer.snapshot(control)
        return Snapshot.of(state, control.step if revision is None else revision, copy=False)

    async def take(self, control: StepControl, revision: int | None = None) -> Snapshot:
        """`snapshot` in a worker thread."""
        return await trio.to_thread.run_sync(self.snapshot, control, revision)

    async def take_whole(self, control: StepControl) -> Snapshot:
        """This slot's whole state at `control.step` (its checkpoint, its stage's shards), not hashed yet (disk and
        shards hash it off the step path), in a worker thread; it changes nothing of training."""
        def whole() -> Snapshot:
            return Snapshot.of(self.trainer.whole_state(control), control.step, copy=False, hashed=False)

        return await trio.to_thread.run_sync(whole)

    async def close(self, control: StepControl) -> None:
        """Apply the synchronizer's round still in flight (the end of training), in a worker thread."""
        await trio.to_thread.run_sync(self.trainer.close, control)

    async def step(self, control: StepControl, now: Callable[[], float]) -> StepResult:
        """Run `control`'s step in a worker thread; the step count and throughput follow it."""
        trainer = self.trainer
        self.last = await trio.to_thread.run_sync(trainer.step, control)
        self.at_step = trainer.step_count
        self.throughput.step_done(now(), self.last.tokens)
        return self.last

    async def evaluate(self) -> None:
        trainer = self.trainer
        trainer.last_eval_loss = await trio.to_thread.run_sync(trainer.evaluate)
        if trainer.last_eval_loss is not None:
            self.eval_history.add(self.at_step, trainer.last_eval_loss)

    def sample_history(self, loss: float | None) -> None:
        """Add the loss a status publishes (None: none at this stage) and the last step's held-out loss to the
        thinned histories."""
        if loss is not None:
            self.loss_history.add(self.at_step, loss)
        if self.last is not None and self.last.eval_loss is not None:
            self.eval_history.add(self.last.step, self.last.eval_loss)

    def history_fields(self) -> dict[str, tuple[int, ...]]:
        """The histories as the status record carries them (its history_* and eval_* fields)."""
        return {**self.loss_history.fields("history_steps", "history_mloss", upto=self.at_step),
                **self.eval_history.fields("eval_steps", "eval_mloss", upto=self.at_step)}
