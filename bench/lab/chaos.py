"""A seeded chaos run: a local training swarm under faults (SIGKILL, SIGSTOP, SIGTERM leaves, restarts with the same
identity, a broker frozen past its lease, a broker killed and restarted within a second), then the verdict: every
step done, one state hash, one broker, every node exits 0. The suite's chaos tests and bench/bench_chaos.py use it."""

from __future__ import annotations

import json
import logging
import random
import signal
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from shoal.node.localswarm import LocalSwarm, LocalSwarmConfig
from shoal.protocol import manifest as mf
from shoal.swarm.net.identity import load_or_create_identity

log = logging.getLogger(__name__)

RANDOM_KINDS = ("kill", "stop", "leave")  # drawn for the random faults; the target is a random non-broker node
POLL_S = 0.2
PROGRESS_STEPS = 3  # "training again": every survivor this many steps past where it was at the fault


@dataclass(frozen=True, kw_only=True, slots=True)
class ChaosConfig:
    workdir: Path
    nodes: int = 5
    replicas: int = 3
    steps: int = 300
    seed: int = 0
    random_faults: int = 3
    broker_freeze: bool = True  # SIGSTOP the broker for longer than its lease, then SIGCONT
    broker_restart: bool = True  # SIGKILL the broker and restart it with its identity within a second
    kill_near_end: bool = True  # SIGKILL a member a few steps before the end, restart it
    stop_s: tuple[float, float] = (20.0, 40.0)  # how long a SIGSTOP lasts (drawn in this range)
    restart_after_s: tuple[float, float] = (0.2, 1.0)  # the pause before a killed or leaving node restarts
    fail_after_s: float = 4.0  # the nodes' --fail-after (the broker's lease lasts as long)
    round_timeout_s: float = 4.0
    # every step takes at least this long (--min-step-time): a group that lost members trains alone at this pace,
    # not at the tiny model's 15 ms, so the faults land where the plan puts them whatever the machine's speed
    min_step_s: float = 0.1
    recovery_timeout_s: float = 90.0  # a fault not recovered from within this long fails the run
    finish_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if not 1 <= self.replicas <= self.nodes or self.steps < 20 or self.random_faults < 0:
            raise ValueError("need 1 <= replicas <= nodes, steps >= 20 and random_faults >= 0")
        if not 0 < self.stop_s[0] <= self.stop_s[1] or not 0 <= self.restart_after_s[0] <= self.restart_after_s[1]:
            raise ValueError("stop_s and restart_after_s must be increasing ranges")


@dataclass(slots=True)
class Fault:
    kind: str
    at_step: int  # applied once the furthest active replica reaches this step
    target: int | None  # node index; None: whoever is the broker then, or a random non-broker node
    length_s: float  # SIGSTOP length, or the pause before the restart
    applied_s: float | None = None  # seconds since the start of the run
    node: int | None = None
    training_again_s: float | None = None  # from the fault: every surviving replica PROGRESS_STEPS further
    recovered_s: float | None = None  # from the fault: the group full again, every member past the fault's step,
    #                                   exactly one broker (or the run ended, every step done)
    back_s: float | None = None  # from the node's return (SIGCONT, restart): it is in the run again (admitted,
    #                              a fresh status) and the swarm is recovered as above
    note: str = ""


@dataclass(slots=True)
class ChaosResult:
    seed: int
    nodes: int
    replicas: int
    steps: int
    faults: list[Fault] = field(default_factory=list)
    completed: bool = False
    steps_done: list[int | None] = field(default_factory=list)
    hashes: list[str] = field(default_factory=list)  # distinct final state hashes of the active replicas
    brokers_at_end: int = 0
    exit_codes: dict[int, int | None] = field(default_factory=dict)
    wall_s: float = 0.0
    error: str | None = None

    @property
    def worst_recovery_s(self) -> float | None:
        times = [f.recovered_s for f in self.faults if f.recovered_s is not None]
        return max(times) if times else None

    @property
    def worst_back_s(self) -> float | None:
        times = [f.back_s for f in self.faults if f.back_s is not None]
        return max(times) if times else None

    @property
    def ok(self) -> bool:
        return (self.completed and len(self.hashes) == 1 and self.brokers_at_end == 1 and self.error is None
                and all(c == 0 for c in self.exit_codes.values()))

    def to_json(self) -> dict:
        d = asdict(self)
        d.update(worst_recovery_s=self.worst_recovery_s, worst_back_s=self.worst_back_s, ok=self.ok)
        return d


def plan(config: ChaosConfig) -> list[Fault]:
    """The seeded fault plan: the broker faults and the random ones in a shuffled order, spread over 15-75% of the
    run's steps, then the kill near the end."""
    rng = random.Random(config.seed)
    kinds = ["broker-freeze"] * config.broker_freeze + ["broker-restart"] * config.broker_restart
    kinds += [rng.choice(RANDOM_KINDS) for _ in range(config.random_faults)]
    rng.shuffle(kinds)
    faults = []
    for i, kind in enumerate(kinds):
        at = int(config.steps * (0.15 + 0.6 * i / max(1, len(kinds))))
        if kind in ("stop", "broker-freeze"):
            length = rng.uniform(*config.stop_s)
            if kind == "broker-freeze":
                length = max(length, config.fail_after_s + 2.0)  # past the lease, whatever the range
        elif kind == "broker-restart":
            length = rng.uniform(0.1, 0.9)  # restarted within a second
        else:
            length = rng.uniform(*config.restart_after_s)
        faults.append(Fault(kind=kind, at_step=at, target=None, length_s=round(length, 2)))
    if config.kill_near_end:
        faults.append(Fault(kind="kill", at_step=config.steps - 8, target=None,
                            length_s=round(rng.uniform(*config.restart_after_s), 2), note="near the end"))
    for f in faults:
        f.target = rng.randrange(1 << 30)  # resolved against the live non-broker nodes when applied
        if f.kind.startswith("broker"):
            f.target = None
    return faults


def write_run(workdir: Path, *, replicas: int, total_steps: int, seed: int = 3, stages: int = 1) -> Path:
    """The tiny test model's run manifest, signed with node 0's identity (node 0 starts the run): `stages` pipeline
    stages (AQ-SGD across them, the default) of `replicas` lanes, CocktailSGD within each stage."""
    workdir.mkdir(parents=True, exist_ok=True)
    m = mf.RunManifest(
        seed=seed, model=mf.ModelSpec(size="custom", n_layers=max(2, stages), d_model=64, n_heads=4),
        batch=mf.BatchSpec(batch_size=8, micro_batch_size=8, seq_len=64),
        optim=mf.OptimSpec(lr=3e-3, warmup_steps=5, total_steps=max(1000, total_steps)),
        eval=mf.EvalSpec(every_steps=0, batches=4),
        plan=mf.ParallelPlan(stages=stages, replicas=replicas,
                             sync=mf.SyncSpec(method="cocktail", cocktail=mf.CocktailSpec(warmup_steps=0))))
    path = workdir / "run.toml"
    path.write_text(m.signed(load_or_create_identity(workdir / "node0.key")).to_toml())
    return path


class ChaosRun:
    """One seeded chaos run; `run()` returns its ChaosResult (never raises for a fault the swarm did not survive:
    the result says so)."""

    def __init__(self, config: ChaosConfig):
        self.config = config
        c = config
        run = write_run(c.workdir / "w", replicas=c.replicas, total_steps=c.steps)
        args = ("--run", str(run), "--threads", "1", "--steps", str(c.steps), "--round-timeout",
                str(c.round_timeout_s), "--fail-after", str(c.fail_after_s), "--backup-refresh", "2",
                "--min-step-time", str(c.min_step_s))
        self.swarm = LocalSwarm(LocalSwarmConfig(nodes=c.nodes, workdir=run.parent, home=c.workdir / "home",
                                                 status_interval_s=0.5, gone_after_s=4.0, extra_node_args=args))
        self.rng = random.Random(c.seed + 1)
        self.joins: dict[int, list[str]] = {}  # each node's original --join (a restart uses the same command)
        self.stopped: set[int] = set()  # nodes under SIGSTOP now (their status files are stale)
        self.t0 = 0.0
        self._at_fault: dict[int, int] = {}  # active node -> its step when the current fault was applied
        self._fault_step = 0  # the furthest active step then
        self._returned: tuple[float, float] | None = None  # (monotonic, wall) time the faulted node came back
        self.problems: list[str] = []

    # -- reading the swarm ---------------------------------------------------------------------------------
    def rows(self) -> list[dict]:
        return [r for r in self.swarm.summary() if r["alive"] and r["index"] not in self.stopped]

    def active(self) -> list[dict]:
        return [r for r in self.rows() if r.get("slot") and r.get("role") in ("active", "broker")]

    def brokers(self) -> list[int]:
        return [r["index"] for r in self.rows() if r.get("role") == "broker"]

    def top_step(self) -> int:
        return max((r.get("step") or 0 for r in self.active()), default=0)

    def finished(self) -> bool:
        a = self.active()
        return len(a) == self.config.replicas and all(r.get("state") == "done" and r.get("step") == self.config.steps
                                                       for r in a)

    def _wait(self, pred, timeout_s: float) -> bool:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if pred():
                return True
            time.sleep(POLL_S)
        return False

    # -- faults --------------------------------------------------------------------------------------------
    def _restart(self, i: int) -> None:
        self.swarm.start_node(i, self.joins[i])

    def _pick(self, f: Fault) -> int | None:
        if f.target is None:
            b = self.brokers()
            return b[0] if len(b) == 1 else None
        others = sorted(r["index"] for r in self.rows() if r.get("role") in ("active", "backup")
                        and r["index"] not in self.brokers())
        if f.note == "near the end":  # a member holding a slot, so the run's end depends on it
            others = sorted(r["index"] for r in self.active() if r.get("role") == "active") or others
        return others[f.target % len(others)] if others else None

    def _apply(self, f: Fault, i: int) -> None:
        node = self.swarm.nodes[i]
        if f.kind in ("stop", "broker-freeze"):
            self.stopped.add(i)
            node.proc.send_signal(signal.SIGSTOP)
            self._track(f, i, f.length_s)
            node.proc.send_signal(signal.SIGCONT)
            self.stopped.discard(i)
        else:
            node.proc.send_signal(signal.SIGTERM if f.kind == "leave" else signal.SIGKILL)
            code = node.proc.wait(timeout=30)
            if f.kind == "leave" and code != 0:
                self.problems.append(f"node {i} left with exit code {code}")
            time.sleep(f.length_s)
            self._restart(i)
        self._returned = (time.monotonic(), time.time())

    def _track(self, f: Fault, target: int, during_s: float) -> None:
        """Watch recovery while the fault lasts (a SIGSTOP) or after it, until recovered or the timeout."""
        end = time.monotonic() + during_s
        while time.monotonic() < end:
            self._check_recovery(f, target)
            time.sleep(POLL_S)

    def _check_recovery(self, f: Fault, target: int) -> bool:
        now = time.monotonic() - self.t0
        if self.finished():  # the run ended meanwhile, with every step done: that is recovery too
            if f.recovered_s is None:
                f.recovered_s = round(now - f.applied_s, 2)
            return True
        a = [r for r in self.active() if r["index"] != target or target not in self.stopped]
        progressed = [r for r in a if r.get("state") == "done"
                      or (r.get("step") or 0) >= self._at_fault.get(r["index"], 0) + PROGRESS_STEPS]
        survivors = [i for i in self._at_fault if i != target]
        if f.training_again_s is None and survivors and all(
                any(r["index"] == i for r in progressed) for i in survivors if self._alive_unfaulted(i)):
            f.training_again_s = round(now - f.applied_s, 2)
        whole = len(progressed) == self.config.replicas and len(self.brokers()) == 1 \
            and all((r.get("step") or 0) > self._fault_step or r.get("state") == "done" for r in progressed)
        if f.recovered_s is None and whole:
            f.recovered_s = round(now - f.applied_s, 2)
        if f.back_s is None and whole and self._returned is not None and self._back_in_run(target):
            f.back_s = round(time.monotonic() - self._returned[0], 2)
        return f.back_s is not None

    def _back_in_run(self, i: int) -> bool:
        """Node `i` came back and is in the run again: admitted (a slot, or the backup pool), with a status written
        after its return."""
        st = self.swarm.nodes[i].status() or {}
        return self.swarm.nodes[i].alive and (st.get("time") or 0) > self._returned[1] \
            and st.get("role") in ("active", "backup", "broker") and st.get("state") in ("training", "ready", "done")

    def _alive_unfaulted(self, i: int) -> bool:
        return self.swarm.nodes[i].alive and i not in self.stopped

    def run(self) -> ChaosResult:
        c = self.config
        res = ChaosResult(seed=c.seed, nodes=c.nodes, replicas=c.replicas, steps=c.steps, faults=plan(c))
        t_start = time.monotonic()
        try:
            self.swarm.start()
            self.t0 = time.monotonic()
            self.joins = {0: [], **{i: self.swarm.bootstrap_addrs() for i in range(1, c.nodes)}}
            if not self._wait(lambda: len(self.active()) == c.replicas and self.top_step() >= 5, 180):
                raise RuntimeError("the run did not start")
            for f in res.faults:
                if not self._wait(lambda: self.top_step() >= f.at_step or self.finished(), c.finish_timeout_s):
                    raise RuntimeError(f"the run stalled before step {f.at_step}")
                if self.finished():
                    f.note = "skipped: the run had ended"
                    continue
                i = self._pick(f)
                if i is None:
                    f.note = "skipped: no node to pick"
                    continue
                f.node = i
                self._at_fault = {r["index"]: r.get("step") or 0 for r in self.active()}
                self._returned = None
                self._fault_step = self.top_step()
                f.applied_s = round(time.monotonic() - self.t0, 2)
                log.info("fault %s on node %d at step %d (%.1f s)", f.kind, i, self._fault_step, f.length_s)
                self._apply(f, i)
                if not self._wait(lambda: self._check_recovery(f, i), c.recovery_timeout_s):
                    raise RuntimeError(f"no recovery from {f.kind} of node {i} within {c.recovery_timeout_s} s")
            if not self._wait(self.finished, c.finish_timeout_s):
                raise RuntimeError("the run did not finish")
            res.completed = True
            # a node that returned (restarted, SIGCONT) as the run ended comes back into the finished run (taking
            # its final state) before the swarm is stopped: stopped while still starting, it would exit 130
            last = next((f for f in reversed(res.faults) if f.applied_s is not None), None)
            if last is not None and last.back_s is None and self._returned is not None:
                if self._wait(lambda: self._back_in_run(last.node), c.recovery_timeout_s):
                    last.back_s = round(time.monotonic() - self._returned[0], 2)
            if self.problems:
                raise RuntimeError("; ".join(self.problems))
        except RuntimeError as e:
            res.error = str(e)
        finally:
            rows = self.swarm.summary()
            act = [r for r in rows if r["alive"] and r.get("slot") and r.get("role") in ("active", "broker")]
            res.steps_done = [r.get("step") for r in act]
            res.hashes = sorted({r.get("state_hash") or "" for r in act})
            res.brokers_at_end = sum(1 for r in rows if r["alive"] and r.get("role") == "broker")
            for i in list(self.stopped):
                self.swarm.nodes[i].proc.send_signal(signal.SIGCONT)
            res.exit_codes = self.swarm.stop()
            res.wall_s = round(time.monotonic() - t_start, 1)
            if res.error:
                res.error += "\n" + json.dumps([{k: r.get(k) for k in ("index", "role", "slot", "step", "state",
                                                                       "state_hash", "error", "log")} for r in rows])
        return res
