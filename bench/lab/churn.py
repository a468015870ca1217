"""Overlapping churn on a local training swarm: the six faults of a volunteer crowd on a timeline, a few seconds
apart whether or not the swarm has recovered from the last one — a member killed and restarted, the broker killed
and restarted within a second and a half, the broker frozen past its lease, a member leaving (SIGTERM) and
rejoining, another member killed, a member frozen — with the node's default timeouts.

Measured per fault, from the fault: *training again* (every surviving replica a few steps further), *recovered*
(the run back to full strength — every slot held by a live node training past the fault's step — with exactly one
broker; slots hit by later faults that are still open do not count against it, so overlapping faults are each
timed on their own) and *back* (from the node's return until it is in the run again). Per run: every step done,
distinct final state hashes, brokers at the end, steps lost (a live replica's step count going backwards), exit
codes. bench/bench_churn.py runs it and writes the tables.
"""

from __future__ import annotations

import heapq
import json
import logging
import random
import signal
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from shoal.bench.chaos import write_run
from shoal.node.localswarm import LocalSwarm, LocalSwarmConfig

log = logging.getLogger(__name__)

#: the six faults of every run, in a seeded order
FAULTS = ("kill", "broker-kill", "broker-freeze", "leave", "kill", "freeze")
POLL_S = 0.1
PROGRESS_STEPS = 3  # "training again": every survivor this many steps past where it was at the fault
SURVIVORS_HIT = "every survivor was hit by a later fault before it trained on"
TRAINING = ("training", "done")


@dataclass(frozen=True, kw_only=True, slots=True)
class ChurnConfig:
    workdir: Path
    nodes: int = 5
    stages: int = 1
    replicas: int = 3  # lanes of `stages` stages; the other nodes are backups
    steps: int = 1500
    seed: int = 0
    faults: tuple[str, ...] = FAULTS
    spacing_s: tuple[float, float] = (6.0, 15.0)  # between one fault and the next
    freeze_s: tuple[float, float] = (6.0, 12.0)  # a member's SIGSTOP
    broker_freeze_extra_s: tuple[float, float] = (2.0, 4.0)  # the broker's SIGSTOP: its lease plus this
    restart_after_s: tuple[float, float] = (0.2, 1.0)  # a killed or leaving member restarts after this pause
    broker_restart_s: tuple[float, float] = (0.1, 1.5)  # the killed broker restarts within this
    fail_after_s: float = 8.0  # the node's defaults as `shoal swarm up` sets them
    round_timeout_s: float = 10.0
    min_step_s: float = 0.1  # every step takes at least this long (a slower model, so faults land mid-run)
    status_interval_s: float = 0.5
    warmup_steps: int = 20  # training before the first fault
    recovery_timeout_s: float = 90.0  # a fault not recovered from within this long is reported as such
    finish_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if not 1 <= self.stages * self.replicas <= self.nodes or self.steps < 50:
            raise ValueError("need stages x replicas <= nodes and steps >= 50")
        for lo, hi in (self.spacing_s, self.freeze_s, self.restart_after_s, self.broker_restart_s,
                       self.broker_freeze_extra_s):
            if not 0 <= lo <= hi:
                raise ValueError("ranges must be increasing and non-negative")
        if any(k not in FAULTS for k in self.faults):
            raise ValueError(f"fault kinds are {sorted(set(FAULTS))}")


@dataclass(slots=True)
class Fault:
    kind: str
    at_s: float  # planned, seconds after the first fault's time
    length_s: float  # SIGSTOP length, or the pause before the restart
    applied_s: float | None = None  # seconds since the run's first fault time
    node: int | None = None
    slot: str | None = None  # the slot its target held
    top_step: int = 0  # the furthest active step when it was applied
    training_again_s: float | None = None
    recovered_s: float | None = None
    back_s: float | None = None
    returned_at: float | None = None  # monotonic time the node came back (restart, SIGCONT)
    at_fault: dict[int, int] = field(default_factory=dict)  # survivor -> its step in its first status after the fault
    wall_s: float = 0.0  # unix time of the fault
    note: str = ""

    @property
    def open(self) -> bool:
        return self.applied_s is not None and self.recovered_s is None


@dataclass(slots=True)
class ChurnResult:
    seed: int
    nodes: int
    stages: int
    replicas: int
    steps: int
    faults: list[Fault] = field(default_factory=list)
    completed: bool = False
    hashes: list[str] = field(default_factory=list)  # distinct final state hashes of the active replicas, per stage
    brokers_at_end: int = 0
    steps_lost: int = 0
    exit_codes: dict[int, int | None] = field(default_factory=dict)
    wall_s: float = 0.0
    error: str | None = None

    def to_json(self) -> dict:
        return asdict(self)


def plan(config: ChurnConfig) -> list[Fault]:
    """The seeded timeline: the faults in a shuffled order, `spacing_s` apart."""
    rng = random.Random(config.seed)
    kinds = list(config.faults)
    rng.shuffle(kinds)
    out, t = [], 0.0
    for kind in kinds:
        if kind == "freeze":
            length = rng.uniform(*config.freeze_s)
        elif kind == "broker-freeze":
            length = config.fail_after_s + rng.uniform(*config.broker_freeze_extra_s)
        elif kind == "broker-kill":
            length = rng.uniform(*config.broker_restart_s)
        else:
            length = rng.uniform(*config.restart_after_s)
        out.append(Fault(kind=kind, at_s=round(t, 2), length_s=round(length, 2)))
        t += rng.uniform(*config.spacing_s)
    return out


class ChurnRun:
    """One seeded run; `run()` returns its ChurnResult (it never raises for what the swarm did not survive)."""

    def __init__(self, config: ChurnConfig):
        self.config = c = config
        run = write_run(c.workdir / "w", replicas=c.replicas, stages=c.stages, total_steps=c.steps)
        args = ("--run", str(run), "--threads", "1", "--steps", str(c.steps), "--round-timeout",
                str(c.round_timeout_s), "--fail-after", str(c.fail_after_s), "--min-step-time", str(c.min_step_s))
        self.swarm = LocalSwarm(LocalSwarmConfig(nodes=c.nodes, workdir=run.parent, home=c.workdir / "home",
                                                 status_interval_s=c.status_interval_s, extra_node_args=args))
        self.rng = random.Random(c.seed + 1)
        self.joins: dict[int, list[str]] = {}
        self.down: set[int] = set()  # killed or leaving, not restarted yet
        self.frozen: set[int] = set()
        self.actions: list[tuple[float, int, Callable[[], None]]] = []  # (monotonic due, seq, action)
        self._seq = 0
        self.t0 = 0.0
        self.rows: list[dict] = []
        self._steps: dict[int, tuple[int, int]] = {}  # node -> (pid, last step seen)
        # fault -> the active nodes other than its target when applied, less those a later fault hit since
        self._survivors: dict[int, set[int]] = {}
        self.steps_lost = 0

    # -- reading the swarm -----------------------------------------------------------------------------------
    def _read(self) -> None:
        self.rows = []
        for n in self.swarm.nodes:
            if n.alive and n.index not in self.frozen:
                st = n.status() or {}  # one read: the fields of one status write
                self.rows.append({"index": n.index, "pid": n.proc.pid, "alive": True,
                                  **{k: st.get(k) for k in ("role", "slot", "step", "state", "state_hash", "time")}})
        for r in self.rows:
            step = r.get("step")
            if step is None or r.get("state") not in TRAINING:  # a node entering a group shows step 0 meanwhile
                continue
            pid, last = self._steps.get(r["index"], (r["pid"], step))
            if pid == r["pid"] and step < last:
                self.steps_lost += last - step
                log.warning("node %d went back from step %d to %d", r["index"], last, step)
            self._steps[r["index"]] = (r["pid"], step)

    def active(self) -> list[dict]:
        return [r for r in self.rows if r.get("slot") and r.get("role") in ("active", "broker")]

    def brokers(self) -> list[int]:
        return [r["index"] for r in self.rows if r.get("role") == "broker"]

    def top_step(self) -> int:
        return max((r.get("step") or 0 for r in self.active()), default=0)

    def finished(self) -> bool:
        a = self.active()
        c = self.config
        return len(a) == c.stages * c.replicas and all(r.get("state") == "done" and r.get("step") == c.steps
                                                       for r in a)

    def _healthy_slots(self, past_step: int, faults: list[Fault]) -> set[str]:
        """Slots held by a live node training past `past_step` (a node hit by a fault counts again once back)."""
        hit = {f.node for f in faults if f.applied_s is not None and f.returned_at is None}
        return {r["slot"] for r in self.active() if r["index"] not in hit
                and r.get("state") in TRAINING and ((r.get("step") or 0) > past_step or r.get("state") == "done")}

    # -- the timeline ----------------------------------------------------------------------------------------
    def _at(self, due: float, action: Callable[[], None]) -> None:
        self._seq += 1
        heapq.heappush(self.actions, (due, self._seq, action))

    def _now(self) -> float:
        return time.monotonic() - self.t0

    def _pick(self, f: Fault) -> int | None:
        if f.kind.startswith("broker"):
            b = self.brokers()
            return b[0] if len(b) == 1 and b[0] not in self.down | self.frozen else None
        members = sorted(r["index"] for r in self.active() if r.get("role") == "active"
                         and r["index"] not in self.down | self.frozen)
        return self.rng.choice(members) if members else None

    def _apply(self, f: Fault) -> None:
        i = self._pick(f)
        if i is None:
            f.note = "skipped: no node to pick"
            return
        row = next(r for r in self.rows if r["index"] == i)
        node = self.swarm.nodes[i]
        f.node, f.slot, f.top_step = i, row.get("slot"), self.top_step()
        for survivors in self._survivors.values():  # hit now, it no longer survives an earlier fault: it may come
            survivors.discard(i)  # back as a backup and never train again (a measured fault's set is read no more)
        f.at_fault = {}  # filled from each survivor's first status written after the fault (statuses lag)
        # survivors: the other active nodes, outside the target's lane (a pipeline lane cannot train without it)
        lane = f.slot.partition("r")[2] if f.slot else None
        self._survivors[id(f)] = {r["index"] for r in self.active() if r["index"] != i
                                  and (self.config.stages == 1 or r["slot"].partition("r")[2] != lane)}
        f.wall_s = time.time()
        f.applied_s = round(self._now(), 2)
        log.info("fault %s on node %d (%s) at step %d", f.kind, i, f.slot, f.top_step)
        now = time.monotonic()
        if f.kind in ("freeze", "broker-freeze"):
            self.frozen.add(i)
            node.proc.send_signal(signal.SIGSTOP)

            def thaw(i=i, node=node, f=f) -> None:
                node.proc.send_signal(signal.SIGCONT)
                self.frozen.discard(i)
                f.returned_at = time.monotonic()

            self._at(now + f.length_s, thaw)
            return
        self.down.add(i)
        node.proc.send_signal(signal.SIGTERM if f.kind == "leave" else signal.SIGKILL)

        def restart(i=i, node=node, f=f) -> None:
            if node.proc.poll() is None:  # a leave still draining: look again shortly
                self._at(time.monotonic() + 0.1, restart)
                return
            if f.kind == "leave" and node.proc.returncode != 0:
                f.note = f"left with exit code {node.proc.returncode}"
            self.swarm.start_node(i, self.joins[i])
            self.down.discard(i)
            f.returned_at = time.monotonic()

        self._at(now + f.length_s, restart)

    def _track(self, faults: list[Fault]) -> None:
        """Update every applied fault's times from the swarm as it is now."""
        c = self.config
        full = c.stages * c.replicas
        now = self._now()
        one_broker = len(self.brokers()) == 1
        for k, f in enumerate(faults):
            if f.applied_s is None:
                continue
            since = round(now - f.applied_s, 2)
            if self.finished():
                if f.training_again_s is None and self._survivors.get(id(f)):
                    f.training_again_s = since
                elif f.training_again_s is None and SURVIVORS_HIT not in f.note:
                    f.note = (f.note + "; " if f.note else "") + SURVIVORS_HIT  # no time to give
                f.recovered_s = f.recovered_s if f.recovered_s is not None else since
            if f.training_again_s is None:
                steps = {r["index"]: r for r in self.active()}
                survivors = [i for i in self._survivors.get(id(f), ()) if i not in self.down | self.frozen]
                for i in survivors:  # its step as of the fault: in its first status written after it
                    if i not in f.at_fault and i in steps and (steps[i].get("time") or 0) > f.wall_s:
                        f.at_fault[i] = steps[i].get("step") or 0
                if survivors and all(i in steps and (steps[i].get("state") == "done" or (
                        i in f.at_fault and (steps[i].get("step") or 0) >= f.at_fault[i] + PROGRESS_STEPS))
                        for i in survivors):
                    f.training_again_s = since
            if f.recovered_s is None:
                later = [g for g in faults[k + 1:] if g.open]
                blocked = {g.slot for g in later if g.slot is not None}
                broker_fault_open = any(g.kind.startswith("broker") for g in later)
                healthy = self._healthy_slots(f.top_step, faults) - blocked
                if len(healthy) >= full - len(blocked) and (one_broker or broker_fault_open):
                    f.recovered_s = since
                    if f.slot in blocked:
                        f.note = (f.note + "; " if f.note else "") + "its slot was hit again before it recovered"
            if f.back_s is None and f.returned_at is not None and f.recovered_s is not None \
                    and self._back_in_run(f.node, f.returned_at):
                f.back_s = round(time.monotonic() - f.returned_at, 2)

    def _back_in_run(self, i: int, since_mono: float) -> bool:
        node = self.swarm.nodes[i]
        st = node.status() or {}
        wall_since = time.time() - (time.monotonic() - since_mono)
        return node.alive and i not in self.frozen and (st.get("time") or 0) > wall_since \
            and st.get("role") in ("active", "backup", "broker") and st.get("state") in ("training", "ready", "done")

    def _loop_until(self, faults: list[Fault], done: Callable[[], bool], timeout_s: float) -> bool:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            while self.actions and self.actions[0][0] <= time.monotonic():
                heapq.heappop(self.actions)[2]()
            self._read()
            self._track(faults)
            if done():
                return True
            time.sleep(POLL_S)
        return False

    def run(self) -> ChurnResult:
        c = self.config
        res = ChurnResult(seed=c.seed, nodes=c.nodes, stages=c.stages, replicas=c.replicas, steps=c.steps,
                          faults=plan(c))
        t_start = time.monotonic()
        try:
            self.swarm.start()
            self.joins = {0: [], **{i: self.swarm.bootstrap_addrs() for i in range(1, c.nodes)}}
            self.t0 = time.monotonic()
            if not self._loop_until([], lambda: len(self.active()) == c.stages * c.replicas
                                    and self.top_step() >= c.warmup_steps, 240):
                raise RuntimeError("the run did not start")
            self.t0 = time.monotonic()
            for f in res.faults:
                self._at(self.t0 + f.at_s, lambda f=f: self._apply(f))
            last_due = self.t0 + res.faults[-1].at_s if res.faults else self.t0
            self._loop_until(res.faults, lambda: time.monotonic() >= last_due and not self.actions
                             and all(f.applied_s is None or (f.recovered_s is not None
                                                              and (f.returned_at is None or f.back_s is not None))
                                     for f in res.faults), last_due - time.monotonic() + c.recovery_timeout_s)
            for f in res.faults:
                if f.applied_s is not None and f.recovered_s is None:
                    f.note = (f.note + "; " if f.note else "") + f"not recovered within {c.recovery_timeout_s:g} s"
            if not self._loop_until(res.faults, self.finished, c.finish_timeout_s):
                raise RuntimeError("the run did not finish")
            res.completed = True
        except RuntimeError as e:
            res.error = str(e)
        finally:
            while self.actions:  # a thaw or a restart still due: do it, so every node can be stopped cleanly
                heapq.heappop(self.actions)[2]()
            rows = self.swarm.summary()
            act = [r for r in rows if r["alive"] and r.get("slot") and r.get("role") in ("active", "broker")]
            res.hashes = sorted({f"{r['slot'][:2]}:{r.get('state_hash') or ''}" for r in act})
            res.brokers_at_end = sum(1 for r in rows if r["alive"] and r.get("role") == "broker")
            res.steps_lost = self.steps_lost
            res.exit_codes = self.swarm.stop()
            res.wall_s = round(time.monotonic() - t_start, 1)
            if res.error:
                res.error += "\n" + json.dumps([{k: r.get(k) for k in ("index", "role", "slot", "step", "state",
                                                                       "state_hash", "error", "log")} for r in rows])
        return res
