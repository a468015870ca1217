"""One segment of a network benchmark: a swarm trains on the topology as shaped now, sampled until it has its answer.

What a segment measures, over a window of steps past the start-up (from `window_steps[0]` until every node has
done `window_steps[1]` steps, or the time limit): tokens/s of the whole swarm; per node and step the
synchronizer's payload bytes, all bytes on its veth, and CPU seconds by thread; how busy each link was. Over the
whole segment: the held-out loss by time, and the time until node 0's held-out loss reached the target.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from shoal.node.localswarm import LocalSwarmConfig
from shoal.bench.hivemind_swarm import HivemindSettings, HivemindSwarm
from shoal.bench.nsswarm import NamespaceSwarm, Sample, StepClock, sample
from shoal.bench.topology import Topology
from shoal.bench.workloads import Workload

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class SegmentConfig:
    size: str = "tiny"
    layers: int | None = None  # the preset's own layer count unless set
    nodes: int = 4
    max_steps: int = 150  # synchronized steps (hivemind: epochs) at most
    window_steps: tuple[int, int] = (20, 80)
    target_loss: float | None = None
    eval_every: int = 10
    lr: float = 3e-3
    time_limit_s: float = 240.0  # training time of one segment, start-up not counted
    start_timeout_s: float = 120.0
    status_interval_s: float = 2.0  # the node's default
    gone_after_s: float = 12.0
    round_timeout_s: float = 20.0
    poll_s: float = 0.5
    seed: int = 0

    def __post_init__(self) -> None:
        w0, w1 = self.window_steps
        if not 0 < w0 < w1 <= self.max_steps:
            raise ValueError("need 0 < window start < window end <= max_steps")
        if self.time_limit_s <= 0 or self.eval_every < 1 or self.nodes < 2:
            raise ValueError("time_limit_s > 0, eval_every >= 1 and at least 2 nodes are required")


def shoal_segment(topo: Topology, workload: Workload, cfg: SegmentConfig, workdir: Path, home: Path,
                  progress: Callable[[str], None]) -> dict:
    from shoal.swarm.net.identity import load_or_create_identity

    workdir.mkdir(parents=True, exist_ok=True)
    m = workload.manifest(size=cfg.size, nodes=cfg.nodes, steps=cfg.max_steps, lr=cfg.lr, eval_every=cfg.eval_every,
                          seed=cfg.seed, layers=cfg.layers).signed(load_or_create_identity(workdir / "node0.key"))
    (workdir / "run.toml").write_text(m.to_toml())
    extra = ("--run", str(workdir / "run.toml"), "--threads", "1", "--round-timeout", str(cfg.round_timeout_s),
             "--steps", str(cfg.max_steps))
    swarm = NamespaceSwarm(LocalSwarmConfig(nodes=cfg.nodes, workdir=workdir, home=home,
                                            status_interval_s=cfg.status_interval_s, gone_after_s=cfg.gone_after_s,
                                            start_timeout_s=cfg.start_timeout_s, extra_node_args=extra), topo)
    tokens_per_step = m.batch.batch_size * m.batch.seq_len
    res = _run(swarm, cfg, progress, tokens_per_step=tokens_per_step, local_key="step")
    numel = _param_count(m)
    res.update(kind="shoal", workload=workload.name, run_id=m.run_id, params=numel,
               payload_formula_bytes=workload.payload_formula(numel, cfg.nodes))
    if workload.stages > 1 and not any(s and not s.startswith("s0") for s in res["slots"]):
        res["errors"].append(f"no node held a slot past stage 0: this build's runtime does not run {workload.stages}"
                             "-stage pipelines yet, so nothing was measured")
        res.update(tokens_per_s=None, s_per_step=None, time_to_target_s=None)
    return res


def hivemind_segment(topo: Topology, python: str, settings: HivemindSettings, workload: Workload,
                     cfg: SegmentConfig, workdir: Path, progress: Callable[[str], None]) -> dict:
    """hivemind peers on the same topology, training the manifest `workload` would train (model, data, batch,
    optimizer, evaluation); its own averaging replaces the synchronizer."""
    workdir.mkdir(parents=True, exist_ok=True)
    m = workload.manifest(size=cfg.size, nodes=cfg.nodes, steps=cfg.max_steps, lr=cfg.lr, eval_every=cfg.eval_every,
                          seed=cfg.seed, layers=cfg.layers)
    (workdir / "run.toml").write_text(m.to_toml())
    swarm = HivemindSwarm(python=python, topo=topo, nodes=cfg.nodes, workdir=workdir, manifest=workdir / "run.toml",
                          steps=cfg.max_steps, settings=settings, time_limit_s=cfg.time_limit_s + 60,
                          start_timeout_s=cfg.start_timeout_s)
    res = _run(swarm, cfg, progress, tokens_per_step=m.batch.batch_size * m.batch.seq_len, local_key="local_steps")
    numel = _param_count(m)
    res.update(kind="hivemind", workload=settings.label, params=numel, payload_formula_bytes=None,
               hivemind=dict(compression=settings.compression, matchmaking_time_s=settings.matchmaking_time_s,
                             averaging_timeout_s=settings.averaging_timeout_s,
                             target_batch_size=cfg.nodes * m.batch.batch_size))
    return res


def _param_count(m) -> int:
    from shoal.node.train.model import GPTConfig, build_model

    return build_model(GPTConfig.from_spec(m.model, m.batch.seq_len), seed=m.seed).num_params()


def _run(swarm, cfg: SegmentConfig, progress, *, tokens_per_step: int, local_key: str) -> dict:
    """Start the swarm, sample it until the window is measured and the target is reached (or time is up), stop it."""
    clock = StepClock()
    w0, w1 = cfg.window_steps
    a = b = last = None
    evals: list[tuple[float, int, float]] = []  # node 0: (unix time of the evaluated state, step, loss)
    errors: list[str] = []
    t_wall = time.monotonic()
    try:
        swarm.start()
        progress(f"  {len(swarm.nodes)} processes started")
        t_train_end = None
        next_note = 0.0
        while True:
            time.sleep(cfg.poll_s)
            s = sample(swarm)
            clock.add(s)
            last = s
            steps = [st.get("step") or 0 for st in s.status]
            if t_train_end is None and min(steps) >= 1:
                t_train_end = time.monotonic() + cfg.time_limit_s
            _note_eval(s.status[0], evals, clock, cfg.eval_every)
            if a is None and min(steps) >= w0:
                a = s
            if b is None and min(steps) >= w1:
                b = s
            reached = cfg.target_loss is None or any(loss <= cfg.target_loss for _, _, loss in evals)
            done = all(st.get("state") == "done" for st in s.status) or (
                any(st.get("state") == "done" for st in s.status) and not all(n.alive for n in swarm.nodes))
            dead = [n.index for n, st in zip(swarm.nodes, s.status)
                    if not n.alive and not (n.proc.returncode == 0 and st.get("state") == "done")]
            errs = [f"node {i}: {st['error']}" for i, st in enumerate(s.status) if st.get("error")]
            if time.monotonic() >= next_note:
                next_note = time.monotonic() + 15
                progress(f"  steps {steps}, held-out loss {evals[-1][2] if evals else '-'}")
            if dead:
                errors.append(f"nodes {dead} exited")
                break
            if errs and not any(st.get("step") for st in s.status):
                errors += errs
                break
            if done or (b is not None and reached):
                break
            if t_train_end is not None and time.monotonic() >= t_train_end:
                errors.append(f"time limit of {cfg.time_limit_s:.0f} s reached at steps {steps}")
                break
            if t_train_end is None and time.monotonic() - t_wall > cfg.start_timeout_s:
                errors.append(f"no training within {cfg.start_timeout_s:.0f} s")
                break
    except (RuntimeError, TimeoutError, OSError) as e:
        errors.append(f"{type(e).__name__}: {e}")
    finally:
        codes = swarm.stop()
    res = _measure(a, b or last, clock, tokens_per_step=tokens_per_step, local_key=local_key, topo=swarm.topo)
    t0 = clock.time_at(0, 1) if clock.points and clock.points[0] else None
    target = next(((t, k, loss) for t, k, loss in evals if cfg.target_loss is not None and loss <= cfg.target_loss),
                  None)
    res.update(
        window_complete=b is not None,
        time_to_target_s=round(target[0] - t0, 2) if target and t0 else None, target_step=target[1] if target else None,
        eval_curve=[[round(t - t0, 2) if t0 else None, k, round(loss, 4)] for t, k, loss in evals],
        final_eval_loss=evals[-1][2] if evals else None,
        steps_done=[st.get("step") for st in (last.status if last else [])],
        slots=[st.get("slot") for st in (last.status if last else [])],
        training_s=round(last.time - t0, 2) if last and t0 else None,
        errors=errors + [f"node {i}: {st['error']}" for i, st in enumerate(last.status if last else [])
                         if st.get("error")],
        exit_codes=codes, wall_s=round(time.monotonic() - t_wall, 1))
    return res


def _note_eval(st: dict, evals: list, clock: StepClock, every: int) -> None:
    """Record node 0's newest held-out loss with the step and time of the state it evaluated."""
    loss = st.get("eval_loss")
    if loss is None:
        return
    step = st.get("eval_step")  # hivemind peers say which step they evaluated and when
    when = st.get("eval_at")
    if step is None:  # a shoal node evaluates at every eval_every-th step; its status shows the latest result
        step = st.get("step") or 0
        step -= step % every
        when = clock.time_at(0, step)
    if evals and (evals[-1][1] == step or loss == evals[-1][2]):
        return
    evals.append((when if when is not None else st.get("time", time.time()), step, float(loss)))


def _measure(a: Sample | None, b: Sample | None, clock: StepClock, *, tokens_per_step: int, local_key: str,
             topo: Topology) -> dict:
    if a is None or b is None or b.time <= a.time:
        return {"window": None}
    n = len(a.status)
    dt = b.time - a.time
    gsteps = [clock.step_at(i, b.time) - clock.step_at(i, a.time) for i in range(n)]
    mean_steps = statistics.fmean(gsteps)
    if mean_steps <= 0:
        return {"window": None}
    local = [(b.status[i].get(local_key) or 0) - (a.status[i].get(local_key) or 0) for i in range(n)]
    if local_key == "step":
        local = gsteps
    per_node = []
    for i in range(n):
        sa, sb = a.status[i], b.status[i]
        ds = (sb.get("step") or 0) - (sa.get("step") or 0)
        payload = ((sb.get("bytes_sent") or 0) - (sa.get("bytes_sent") or 0)) / ds if ds > 0 and "bytes_sent" in sb \
            else None
        tx = b.links[i]["tx_bytes"] - a.links[i]["tx_bytes"]
        rx = b.links[i]["rx_bytes"] - a.links[i]["rx_bytes"]
        shape = topo.shapes[i]
        per_node.append({
            "steps": round(gsteps[i], 2),
            "payload_bytes_per_step": round(payload, 1) if payload is not None else None,
            "wire_tx_bytes_per_step": round(tx / mean_steps, 1), "wire_rx_bytes_per_step": round(rx / mean_steps, 1),
            "tx_packets_per_step": round((b.links[i]["tx_packets"] - a.links[i]["tx_packets"]) / mean_steps, 1),
            "uplink_busy": round(8 * tx / dt / (shape.up_mbit * 1e6), 3) if shape.up_mbit else None,
            "downlink_busy": round(8 * rx / dt / (shape.down_mbit * 1e6), 3) if shape.down_mbit else None,
            "cpu_s_per_step": {k: round((b.cpu[i].get(k, 0.0) - a.cpu[i].get(k, 0.0)) / mean_steps, 4)
                               for k in b.cpu[i]},
        })
    payloads = [p["payload_bytes_per_step"] for p in per_node if p["payload_bytes_per_step"]]
    wire = statistics.fmean(p["wire_tx_bytes_per_step"] for p in per_node)
    return {
        "window": {"from_step": round(statistics.fmean(clock.step_at(i, a.time) for i in range(n)), 1),
                   "to_step": round(statistics.fmean(clock.step_at(i, b.time) for i in range(n)), 1),
                   "seconds": round(dt, 2), "steps": round(mean_steps, 2)},
        "tokens_per_s": round(sum(local) * tokens_per_step / dt, 1),
        "s_per_step": round(dt / mean_steps, 4),
        "payload_bytes_per_step": round(statistics.fmean(payloads), 1) if payloads else None,
        "wire_tx_bytes_per_step": round(wire, 1),
        "wire_over_payload": round(wire / statistics.fmean(payloads), 3) if payloads else None,
        "cpu_s_per_step": round(statistics.fmean(p["cpu_s_per_step"]["total"] for p in per_node), 4),
        "nodes": per_node,
    }
