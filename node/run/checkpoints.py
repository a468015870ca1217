"""A run's disk checkpoints: every slot holder writes its own slot's whole state (weights, optimizer, synchronizer
state, data position, RNG) every `[checkpoint] every_steps` and at the run's end, off the trainer thread and off the
event loop, atomically, keeping `keep_last`; where a stopped run resumes; reading one back, its hash checked.

Why every holder and not one per stage: replicas of a stage share only their synchronized part (CocktailSGD's g,
DiLoCo's theta); each keeps its own local parameters, error feedback, data position and RNG, and a resume that is
bit-identical to the run that did not stop needs each slot's own. Writing costs each holder only its disk.

Layout (docs/checkpoints.md): ROOT/<run id, 16 hex>/run.toml (the manifest), and per slot
ROOT/<run>/s<S>r<R>/ckpt-<step>.state (the state blob, swarm/state/blob.py) with ckpt-<step>.json beside it (run,
slot, step, writer, the whole state's hash, who sat where at that step). A checkpoint counts once its .json exists:
the .state is written first.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import trio

from shoal.node.train.checkpoint import write_atomic
from shoal.protocol.assignment import slot_name
from shoal.protocol.manifest import RunManifest
from shoal.swarm.state.blob import read_snapshot, snapshot_parts
from shoal.swarm.state.snapshot import Snapshot, StateTransferError
from shoal.swarm.state.transfer import StateTransferConfig

log = logging.getLogger(__name__)

STATE_NAME = re.compile(r"^ckpt-(\d{10})\.state$")
SLOT_DIR = re.compile(r"^s(\d{1,4})r(\d{1,5})$")
MANIFEST_FILE = "run.toml"
READ_LIMITS = StateTransferConfig(max_total_bytes=1 << 40, max_tensors=1 << 20)  # a file this node wrote


class CheckpointMissing(RuntimeError):
    """No usable checkpoint where one was asked for (the message says what was looked at)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointMeta:
    run_id: str
    stage: int
    replica: int
    step: int
    peer_id: str  # the node that wrote it (a resumed node takes the slot it wrote)
    state_hash: str  # swarm/state/snapshot.py state_hash of the whole state ("" until the writer computes it)
    seating: dict[str, str] = field(default_factory=dict)  # slot name -> peer id, in force at `step`
    time: float = 0.0

    @classmethod
    def from_json(cls, text: str) -> CheckpointMeta:
        d = json.loads(text)
        if not isinstance(d, dict):
            raise ValueError("not a map")
        m = cls(run_id=str(d["run_id"]), stage=int(d["stage"]), replica=int(d["replica"]), step=int(d["step"]),
                peer_id=str(d["peer_id"]), state_hash=str(d["state_hash"]),
                seating={str(k): str(v) for k, v in dict(d.get("seating", {})).items()}, time=float(d.get("time", 0)))
        if min(m.stage, m.replica, m.step) < 0 or len(m.state_hash) != 64:
            raise ValueError("bad slot, step or hash")
        return m


def run_dir(root: Path, run_id: str) -> Path:
    return Path(root) / run_id[:16]


def slot_dir(root: Path, run_id: str, stage: int, replica: int) -> Path:
    return run_dir(root, run_id) / slot_name(stage, replica)


def state_step(snap: Snapshot) -> int:
    """The trainer step a snapshot's state is at (its revision, except for the run's final state)."""
    sk = snap.skeleton
    return sk["step"] if isinstance(sk, dict) and isinstance(sk.get("step"), int) else snap.revision


def write_checkpoint(root: Path, manifest: RunManifest, snap: Snapshot, meta: CheckpointMeta, *,
                     keep_last: int) -> int:
    """Write one slot's checkpoint (state, then its .json with the state's hash, computed here when the snapshot
    has none yet), drop that slot's older ones beyond `keep_last`; the bytes written. Blocking: run it in a worker
    thread."""
    snap = snap.hashed()
    meta = replace(meta, state_hash=snap.hash)
    d = slot_dir(root, manifest.run_id, meta.stage, meta.replica)
    d.mkdir(parents=True, exist_ok=True)
    mf = run_dir(root, manifest.run_id) / MANIFEST_FILE
    if not mf.exists():
        write_atomic(mf, [manifest.to_toml().encode()])
    n = write_atomic(d / f"ckpt-{meta.step:010d}.state", snapshot_parts(snap))
    write_atomic(d / f"ckpt-{meta.step:010d}.json", [json.dumps(asdict(meta), indent=1).encode()])
    for step in slot_steps(d)[:-keep_last]:
        for ext in ("json", "state"):  # the .json first: a half-removed checkpoint no longer counts
            (d / f"ckpt-{step:010d}.{ext}").unlink(missing_ok=True)
    return n


def slot_steps(d: Path) -> list[int]:
    """The steps of the checkpoints in one slot's folder that count (state and .json both there), oldest first."""
    if not d.is_dir():
        return []
    names = set(os.listdir(d))
    return sorted(int(m.group(1)) for n in names if (m := STATE_NAME.match(n)) and f"ckpt-{m.group(1)}.json" in names)


def slots_on_disk(root: Path, run_id: str) -> dict[tuple[int, int], list[int]]:
    """(stage, replica) -> steps checkpointed, for one run under `root`."""
    d = run_dir(root, run_id)
    out: dict[tuple[int, int], list[int]] = {}
    if d.is_dir():
        for name in sorted(os.listdir(d)):
            m = SLOT_DIR.match(name)
            if m and (steps := slot_steps(d / name)):
                out[(int(m.group(1)), int(m.group(2)))] = steps
    return out


def read_meta(root: Path, run_id: str, stage: int, replica: int, step: int) -> CheckpointMeta:
    path = slot_dir(root, run_id, stage, replica) / f"ckpt-{step:010d}.json"
    try:
        meta = CheckpointMeta.from_json(path.read_text())
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointMissing(f"{path}: {e}") from None
    if (meta.run_id, meta.stage, meta.replica, meta.step) != (run_id, stage, replica, step):
        raise CheckpointMissing(f"{path} describes another run, slot or step")
    return meta


def read_checkpoint(root: Path, run_id: str, stage: int, replica: int, step: int) -> tuple[Snapshot, CheckpointMeta]:
    """One slot's checkpoint at `step`, its whole-state hash checked against the one recorded when it was written
    (CheckpointMissing when it is absent, damaged or not that hash)."""
    meta = read_meta(root, run_id, stage, replica, step)
    path = slot_dir(root, run_id, stage, replica) / f"ckpt-{step:010d}.state"
    try:
        snap = read_snapshot(path.read_bytes(), config=READ_LIMITS, expect_hash=meta.state_hash)
    except (OSError, StateTransferError) as e:
        raise CheckpointMissing(f"{path}: {e}") from None
    return snap, meta


@dataclass(frozen=True, kw_only=True, slots=True)
class ResumePoint:
    """Where a stopped run goes on: `step`, and who sat where then (slot name -> peer id). `complete`: every
    slot of that seating has its checkpoint here (else every stage has at least one)."""

    step: int
    seating: dict[str, str]
    slots: tuple[tuple[int, int], ...]  # the slots checkpointed at `step` under this root
    complete: bool


def resume_point(root: Path, run_id: str, stages: int) -> ResumePoint | None:
    """The newest step at which every slot then seated has a checkpoint under `root`; failing that, the newest at
    which every stage has one (the other slots then enter from their stage's); None when no step has even that."""
    on_disk = slots_on_disk(root, run_id)
    steps = sorted({s for v in on_disk.values() for s in v}, reverse=True)
    partial = None
    for step in steps:
        slots = tuple(sorted(k for k, v in on_disk.items() if step in v))
        if {st for st, _ in slots} != set(range(stages)):
            continue
        seating: dict[str, str] = {}
        for st, r in slots:
            try:
                seating.update(read_meta(root, run_id, st, r, step).seating)
            except CheckpointMissing as e:
                log.info("resume: %s", e)
        complete = all(name in {slot_name(*k) for k in slots} for name in seating)
        point = ResumePoint(step=step, seating=seating, slots=slots, complete=complete)
        if complete:
            return point
        partial = partial or point
    return partial


def find_run_dirs(root: Path) -> list[Path]:
    """Run folders under `root` (those holding a run.toml), newest first."""
    root = Path(root)
    if (root / MANIFEST_FILE).is_file():
        return [root]
    found = [d for d in root.iterdir() if (d / MANIFEST_FILE).is_file()] if root.is_dir() else []
    return sorted(found, key=lambda d: d.stat().st_mtime, reverse=True)


class CheckpointWriter:
    """Writes the slot checkpoints this node offers, one at a time in a worker thread: `offer` never waits (a
    checkpoint offered while one is being written waits in its place, a newer one replacing it), `flush` waits
    until every offered one is on disk. Start `run` in a nursery."""

    def __init__(self, root: Path, manifest: RunManifest, *, clock: Callable[[], float] = time.monotonic):
        self.root, self.manifest, self.clock = Path(root), manifest, clock
        c = manifest.checkpoint
        self.every_steps, self.keep_last = c.every_steps, c.keep_last
        self._pending: tuple[Snapshot, CheckpointMeta] | None = None
        self._wake = trio.Event()
        self._idle = trio.Event()
        self._idle.set()
        self.written: list[dict] = []  # step, seconds, bytes of each write (the last few)
        self.skipped = 0  # offers replaced by a newer one before they were written
        self.last_step: int | None = None
        self.error: str | None = None
        log.info("checkpoints every %d steps (and at the end) under %s", self.every_steps, self.root)

    def due(self, step: int) -> bool:
        """Whether the state at `step` is one the run's policy checkpoints (the end is always written)."""
        return self.every_steps > 0 and step > 0 and step % self.every_steps == 0

    def offer(self, snap: Snapshot, meta: CheckpointMeta) -> None:
        if self._pending is not None:
            self.skipped += 1
        self._pending = (snap, meta)
        self._idle = trio.Event() if self._idle.is_set() else self._idle
        self._wake.set()

    async def flush(self) -> None:
        await self._idle.wait()

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            await self._wake.wait()
            self._wake = trio.Event()
            while self._pending is not None:
                (snap, meta), self._pending = self._pending, None
                t0 = self.clock()
                try:
                    n = await trio.to_thread.run_sync(lambda: write_checkpoint(self.root, self.manifest, snap, meta,
                                                                               keep_last=self.keep_last))
                except OSError as e:  # a full or read-only disk: say so, keep training
                    self.error = f"checkpoint of step {meta.step} not written: {e}"
                    log.error("%s", self.error)
                    continue
                took = self.clock() - t0
                self.last_step = meta.step
                self.written = (self.written + [{"step": meta.step, "seconds": round(took, 3), "bytes": n}])[-8:]
                # routine: DEBUG (a steady run's log stays flat; the writer says where at INFO when it starts, the
                # status file carries every write)
                log.debug("checkpoint of %s at step %d written (%.1f MB, %.2f s)", slot_name(meta.stage, meta.replica),
                          meta.step, n / 1e6, took)
            self._idle.set()


def checkpoint_every_default(step_s: float, write_s: float, *, budget: float = 0.01) -> int:
    """The smallest checkpoint interval (steps) whose write takes at most `budget` of the training time between two
    checkpoints; a sizing helper for the manifest's every_steps."""
    return max(1, math.ceil(write_s / max(step_s * budget, 1e-9)))
