"""`shoal bench placement-live`: placement by the network on a live swarm in network namespaces, two sites with fast
links inside and a slow link between (bench/lab/sites_topology.py).

Scenarios (each one bounded; run them one at a time, results merged with --keep):
- `gain`: N nodes (S = 2) started one by one, alternating between the sites, so that first-fit seating strings every
  lane across the slow link; the same run once with placement = first-fit and once with placement = network, and
  tokens/s over a window of steps after the network run has settled (its lanes inside the sites).
- `throttle`: the network run with one more node (a backup); once settled, one active node's own link is throttled:
  seconds until the broker moves it out of its slot, tokens/s before and after.
- `noise`: the network run, settled; then every `noise_every_s` each node's link and the link between the sites get
  a new rate within +-`noise` of their own, for `noise_s`: the moves the broker makes meanwhile.

The broker's own predictions (its log: "placement: X s per step predicted now") are set beside the step times
measured, as the check of the cost model against real runs.
"""

from __future__ import annotations

import dataclasses
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shoal.bench.nsswarm import NamespaceSwarm
from shoal.bench.sites_topology import SitesTopology
from shoal.bench.topology import LinkShape, TopologyConfig
from shoal.bench.workloads import Workload
from shoal.node.localswarm import LocalSwarmConfig
from shoal.protocol import manifest as mf

SCENARIOS = ("gain", "throttle", "noise")
PREDICTED = re.compile(r"^(\S+ \S+).*placement: ([0-9.e+-]+) s per step predicted now, ([0-9.e+-]+) s planned")
MOVED = re.compile(r"^(\S+ \S+).*re-planned: (.*)$")


@dataclass(frozen=True, kw_only=True, slots=True)
class LiveConfig:
    nodes: int = 8
    stages: int = 2
    between_mbit: float = 10.0  # the link between the two sites
    window_steps: int = 30  # tokens/s measured over this many steps
    warmup_steps: int = 15  # cocktail's fp32 warm-up (10) and the first AQ-SGD epoch's start
    settle_timeout_s: float = 420.0  # the network run must settle (no lane crossing the sites) within this
    replan_every_s: float = 10.0
    move_every_s: float = 20.0
    throttle_mbit: float = 2.0
    noise: float = 0.2
    noise_s: float = 600.0
    noise_every_s: float = 20.0
    probe_every_s: float = 5.0  # the nodes' --probe-every
    report_every_s: float = 10.0  # ... and --link-report-every
    max_steps: int | None = None  # the nodes' --steps (None: they train until stopped)
    status_interval_s: float = 1.0
    prefix: str = "i26pl"
    subnet: str = "10.26.9"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.nodes < 2 * self.stages or self.nodes % self.stages:
            raise ValueError(f"{self.nodes} nodes do not make at least two lanes of {self.stages} stages")
        if min(self.between_mbit, self.throttle_mbit, self.noise_s, self.noise_every_s) <= 0 or not 0 <= self.noise < 1:
            raise ValueError("positive rates and times, 0 <= noise < 1")


def workload(cfg: LiveConfig) -> Workload:
    return Workload(name="placement-live", stages=cfg.stages,
                    sync=mf.SyncSpec(method="cocktail", cocktail=mf.CocktailSpec(warmup_steps=10)),
                    pipeline=mf.PipelineSpec(compression="aqsgd"), train_subset=256,
                    description="tiny GPT, S = 2, CocktailSGD between replicas, AQ-SGD between stages")


def manifest(cfg: LiveConfig, placement: str, key) -> mf.RunManifest:
    m = workload(cfg).manifest(size="tiny", nodes=cfg.nodes, steps=5000, lr=3e-3, eval_every=1000, seed=cfg.seed)
    m = dataclasses.replace(m, plan=dataclasses.replace(m.plan, placement=placement))
    return m.signed(key)


class Live:
    """One swarm on the sites topology, started node by node in a given order, sampled from its status files."""

    def __init__(self, topo: SitesTopology, cfg: LiveConfig, workdir: Path, home: Path, placement: str,
                 count: int, progress: Callable[[str], None]):
        from shoal.swarm.net.identity import load_or_create_identity

        workdir.mkdir(parents=True, exist_ok=True)
        self.cfg, self.topo, self.workdir, self.progress = cfg, topo, workdir, progress
        self.m = manifest(cfg, placement, load_or_create_identity(workdir / "node0.key"))
        (workdir / "run.toml").write_text(self.m.to_toml())
        extra = ("--run", str(workdir / "run.toml"), "--threads", "1", "--round-timeout", "30",
                 "--replan-every", str(cfg.replan_every_s), "--move-every", str(cfg.move_every_s),
                 "--probe-every", str(cfg.probe_every_s), "--link-report-every", str(cfg.report_every_s),
                 *(("--steps", str(cfg.max_steps)) if cfg.max_steps is not None else ()))
        self.swarm = NamespaceSwarm(LocalSwarmConfig(nodes=count, workdir=workdir, home=home,
                                                     status_interval_s=cfg.status_interval_s, gone_after_s=15.0,
                                                     start_timeout_s=120.0, extra_node_args=extra), topo)
        self.count = count
        self.samples: list[tuple[float, list[dict]]] = []

    def start(self) -> None:
        """Node 0 (the broker), then each next node once the one before has its place."""
        sw = self.swarm
        sw.warm_hardware_cache()
        first = sw.start_node(0, [])
        sw.wait_ready(first)
        join = sw.bootstrap_addrs()
        self._wait_placed(0)
        for i in range(1, self.count):
            sw.start_node(i, join)
            self._wait_placed(i)
        self.progress(f"  {self.count} nodes placed: {self.slots()}")

    def _wait_placed(self, i: int, timeout_s: float = 180.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            st = self.swarm.nodes[i].status() or {}
            if st.get("slot") or st.get("warm_stage") is not None:
                return
            if not self.swarm.nodes[i].alive:
                raise RuntimeError(f"node {i} exited: {self.swarm.nodes[i].exit_text()}")
            time.sleep(0.3)
        raise TimeoutError(f"node {i} got no place within {timeout_s:.0f} s")

    def statuses(self) -> list[dict]:
        return [n.status() or {} for n in self.swarm.nodes]

    def sample(self) -> list[dict]:
        s = self.statuses()
        self.samples.append((time.time(), s))
        return s

    def slots(self) -> dict[int, str | None]:
        return {i: st.get("slot") for i, st in enumerate(self.statuses())}

    def crossing(self, status: list[dict] | None = None) -> int:
        """Lanes whose stages sit in different sites."""
        lanes: dict[str, set[int]] = {}
        for i, st in enumerate(status or self.statuses()):
            slot = st.get("slot")
            if slot:
                lanes.setdefault(slot.split("r")[1], set()).add(self.topo.sites[i])
        return sum(len(s) > 1 for s in lanes.values())

    def steps(self, status: list[dict]) -> list[int]:
        return [st.get("step") or 0 for i, st in enumerate(status) if st.get("slot")]

    def wait(self, pred: Callable[[list[dict]], bool], timeout_s: float, what: str) -> float:
        t0 = time.monotonic()
        note = 0.0
        while time.monotonic() - t0 < timeout_s:
            s = self.sample()
            dead = [n for n in self.swarm.nodes if not n.alive]
            if dead:
                raise RuntimeError(f"nodes exited while waiting for {what}: " + "; ".join(
                    f"node {n.index} ({n.exit_text()}): {self._last_words(n)}" for n in dead))
            if pred(s):
                return time.monotonic() - t0
            if time.monotonic() >= note:
                note = time.monotonic() + 20
                self.progress(f"  waiting for {what}: steps {self.steps(s)}, crossing lanes {self.crossing(s)}")
            time.sleep(1.0)
        raise TimeoutError(f"{what}: not within {timeout_s:.0f} s")

    @staticmethod
    def _last_words(node) -> str:
        """The end of a node's output and its last error or warning lines."""
        from shoal.node.localswarm import tail

        text = tail(node.out_file, 3) if node.out_file is not None else ""
        try:
            worst = [ln for ln in node.log_file.read_text(errors="replace").splitlines()
                     if " ERROR " in ln or " WARNING " in ln][-3:]
        except OSError:
            worst = []
        return " | ".join([text.strip().replace("\n", " / ")] + worst)[-1500:]

    def window(self, steps: int) -> dict:
        """Tokens/s over the next `steps` steps of the slowest active node (the run's pace)."""
        s0 = self.sample()
        t0, a = time.time(), min(self.steps(s0))
        self.wait(lambda s: min(self.steps(s)) >= a + steps, 60 + 30 * steps, f"{steps} steps")
        s1 = self.samples[-1][1]
        dt = time.time() - t0
        done = statistics.fmean(self.steps(s1)) - statistics.fmean(self.steps(s0))
        lanes = len({st["slot"].split("r")[1] for st in s1 if st.get("slot")})
        tokens = lanes * self.m.batch.batch_size * self.m.seq_len
        return {"seconds": round(dt, 2), "steps": round(done, 2), "s_per_step": round(dt / done, 4),
                "tokens_per_s": round(done * tokens / dt, 1), "lanes": lanes, "crossing": self.crossing(s1),
                "slots": {i: st.get("slot") for i, st in enumerate(s1)}}

    def broker_log(self) -> tuple[list[tuple[str, float, float]], list[tuple[str, str]]]:
        """(time, predicted now, planned) of every re-plan and (time, what) of every move, from node 0's log."""
        preds, moves = [], []
        try:
            lines = self.swarm.nodes[0].log_file.read_text(errors="replace").splitlines()
        except OSError:
            return preds, moves
        for line in lines:
            if (m := PREDICTED.match(line)) is not None:
                preds.append((m.group(1), float(m.group(2)), float(m.group(3))))
            elif (m := MOVED.match(line)) is not None:
                moves.append((m.group(1), m.group(2)))
        return preds, moves

    def stop(self) -> None:
        self.swarm.stop()


def _topology(cfg: LiveConfig, count: int) -> SitesTopology:
    sites = [i % 2 for i in range(count)]
    return SitesTopology(TopologyConfig(prefix=cfg.prefix, nodes=count, subnet=cfg.subnet), sites)


def _run_variant(topo: SitesTopology, cfg: LiveConfig, workdir: Path, home: Path, placement: str, count: int,
                 progress: Callable[[str], None]) -> tuple[Live, dict]:
    live = Live(topo, cfg, workdir / placement, home, placement, count, progress)
    out: dict = {"placement": placement, "nodes": count}
    t0 = time.monotonic()
    live.start()
    started = time.monotonic()
    out["start_s"] = round(started - t0, 1)
    out["placed"] = live.slots()
    out["crossing_at_start"] = live.crossing()
    live.wait(lambda s: min(live.steps(s)) >= cfg.warmup_steps, 600, f"step {cfg.warmup_steps}")
    if placement == "network":
        live.wait(lambda s: live.crossing(s) == 0, cfg.settle_timeout_s, "lanes inside the sites")
        out["settled_after_start_s"] = round(time.monotonic() - started, 1)  # from the last node's start
        # a few steps in the settled placement before the window (new lane links, first visits)
        a = min(live.steps(live.sample()))
        live.wait(lambda s: min(live.steps(s)) >= a + 5, 300, "5 steps after settling")
    out["window"] = live.window(cfg.window_steps)
    preds, moves = live.broker_log()
    out["predicted_s_per_step"] = preds[-1][1] if preds else None
    # the broker's prediction for the placement it started with (first fit's), just before its first move
    before = [p for p in preds if not moves or p[0] < moves[0][0]]
    out["predicted_at_start_s_per_step"] = before[-1][1] if before else None
    out["moves"] = [{"at": t, "what": w} for t, w in moves]
    return live, out


def gain(cfg: LiveConfig, workdir: Path, home: Path, progress: Callable[[str], None]) -> dict:
    doc: dict = {"scenario": "gain", "variants": []}
    with _topology(cfg, cfg.nodes) as topo:
        topo.shape_between(0, 1, cfg.between_mbit)
        for placement in ("first-fit", "network"):
            progress(f"gain: placement = {placement}")
            live = None
            try:
                live, out = _run_variant(topo, cfg, workdir, home, placement, cfg.nodes, progress)
            finally:
                if live is not None:
                    live.stop()
            doc["variants"].append(out)
            progress(f"  {placement}: {out['window']['tokens_per_s']} tokens/s, {out['window']['s_per_step']} s/step")
    ff, nw = doc["variants"]
    doc["ratio"] = round(nw["window"]["tokens_per_s"] / ff["window"]["tokens_per_s"], 3)
    return doc


def throttle(cfg: LiveConfig, workdir: Path, home: Path, progress: Callable[[str], None]) -> dict:
    count = cfg.nodes + 1  # one backup
    with _topology(cfg, count) as topo:
        topo.shape_between(0, 1, cfg.between_mbit)
        live = None
        try:
            live, out = _run_variant(topo, cfg, workdir, home, "network", count, progress)
            slots = live.slots()
            # an active node the settling did not move (a moved one stays put for its dwell time), not the broker
            victim = next(i for i in range(1, count) if slots[i] and slots[i] == out["placed"][i])
            shapes = [LinkShape()] * count
            shapes[victim] = LinkShape(up_mbit=cfg.throttle_mbit, down_mbit=cfg.throttle_mbit)
            before = out["window"]
            progress(f"throttle: node {victim} ({slots[victim]}) to {cfg.throttle_mbit} Mbit/s")
            t0 = time.monotonic()
            topo.shape(shapes)
            moved_s = live.wait(lambda s: not s[victim].get("slot"), cfg.settle_timeout_s,
                                f"node {victim} moved off its slot")
            a = min(live.steps(live.sample()))
            live.wait(lambda s: min(live.steps(s)) >= a + 5, 300, "5 steps after the move")
            after = live.window(cfg.window_steps)
            preds, moves = live.broker_log()
        finally:
            if live is not None:
                live.stop()
    return {"scenario": "throttle", "throttled_node": victim, "throttle_mbit": cfg.throttle_mbit,
            "before": before, "moved_after_s": round(moved_s, 1), "after": after,
            "moves": [{"at": t, "what": w} for t, w in moves], "predicted_s_per_step": preds[-1][1] if preds else None,
            "total_s": round(time.monotonic() - t0, 1)}


def noise(cfg: LiveConfig, workdir: Path, home: Path, progress: Callable[[str], None]) -> dict:
    rng = np.random.default_rng(cfg.seed)
    with _topology(cfg, cfg.nodes) as topo:
        topo.shape_between(0, 1, cfg.between_mbit)
        live = None
        try:
            live, out = _run_variant(topo, cfg, workdir, home, "network", cfg.nodes, progress)
            _, moves_before = live.broker_log()
            progress(f"noise: +-{cfg.noise:.0%} on every link for {cfg.noise_s:.0f} s")
            t_end = time.monotonic() + cfg.noise_s
            base_node = 200.0  # each node's own link, Mbit/s (the sites' insides stay far faster than between)
            changes = 0
            while time.monotonic() < t_end:
                f = 1 + cfg.noise * rng.uniform(-1, 1, cfg.nodes + 1)
                topo.shape([LinkShape(up_mbit=round(base_node * x, 2), down_mbit=round(base_node * x, 2))
                            for x in f[:-1]])
                topo.shape_between(0, 1, round(cfg.between_mbit * f[-1], 3))
                changes += 1
                live.wait(lambda s: True, 1, "")
                time.sleep(max(0.0, min(cfg.noise_every_s, t_end - time.monotonic())))
                if not all(n.alive for n in live.swarm.nodes):
                    raise RuntimeError("a node exited during the noise")
            final = live.window(min(cfg.window_steps, 10))
            _, moves = live.broker_log()
        finally:
            if live is not None:
                live.stop()
    during = moves[len(moves_before):]
    return {"scenario": "noise", "noise": cfg.noise, "seconds": cfg.noise_s, "rate_changes": changes,
            "settled": out, "moves_during_noise": [{"at": t, "what": w} for t, w in during],
            "migrations": len(during), "final": final}


RUNNERS = {"gain": gain, "throttle": throttle, "noise": noise}


def markdown(doc: dict) -> str:
    lines = ["# shoal bench placement-live", "",
             "Commands (a scenario's section comes from the last command that ran it):", "",
             *[f"    {c}" for c in doc.get("commands", [])], "", f"Machine: {doc.get('machine', '')}", "",
             "Two sites in network namespaces (bench/lab/sites_topology.py): nodes on a bridge per site (unshaped "
             "veths inside a site), one tbf-shaped link between the sites. Nodes start one by one, alternating "
             "between the sites (node 0, the broker, in site 0), so that first-fit seating strings every lane "
             "across the slow link. Tiny GPT, S = 2, CocktailSGD between replicas (10 fp32 warm-up steps), AQ-SGD "
             "between stages (256 samples epoch after epoch). The broker re-plans every --replan-every and moves at "
             "most one lane every --move-every (see the config). Tokens/s over a window of steps of the slowest node, "
             "in the same run for both placements; 'predicted' is the broker's own cost-model prediction from its "
             "measured links (its last re-plan before the window).", ""]
    sc = doc.get("scenarios", {})
    if "gain" in sc:
        g = sc["gain"]
        lines += ["## Gain: first fit vs the network planner (same run, same start order)", "",
                  f"Config: {g.get('config')}", "",
                  "| placement | lanes crossing the slow link at start | settled (lanes inside sites) after s | "
                  "s/step | tokens/s | predicted s/step (broker) | prediction error |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for v in g["variants"]:
            w, pred = v["window"], v.get("predicted_s_per_step")
            err = f"{(pred - w['s_per_step']) / w['s_per_step']:+.0%}" if pred else "n/a"
            lines.append(f"| {v['placement']} | {v['crossing_at_start']} | {v.get('settled_after_start_s', '-')} | "
                         f"{w['s_per_step']} | {w['tokens_per_s']} | {pred if pred else 'n/a'} | {err} |")
        nw = g["variants"][1]
        start_pred, ff_step = nw.get("predicted_at_start_s_per_step"), g["variants"][0]["window"]["s_per_step"]
        if start_pred:
            lines += ["", f"The network broker's prediction for the first-fit placement it started from (before "
                          f"its first move): {start_pred:.4g} s/step; first fit measured {ff_step} s/step "
                          f"({(start_pred - ff_step) / ff_step:+.0%})."]
        lines += ["", f"**tokens/s, network / first fit: {g['ratio']}x** (target >= 1.5x: "
                      f"{'met' if g['ratio'] >= 1.5 else 'NOT met'}); moves by the network broker: "
                      f"{len(g['variants'][1]['moves'])}", ""]
    if "throttle" in sc:
        t = sc["throttle"]
        lines += ["## Throttle: one active node's link drops mid-run", "",
                  f"Config: {t.get('config')}", "",
                  "| throttled node | to Mbit/s | tokens/s before | moved off its slot after s | tokens/s after |",
                  "|---|---:|---:|---:|---:|",
                  f"| {t['throttled_node']} | {t['throttle_mbit']} | {t['before']['tokens_per_s']} | "
                  f"{t['moved_after_s']} | {t['after']['tokens_per_s']} |", "",
                  "Moves: " + "; ".join(m["what"] for m in t["moves"]), ""]
    if "noise" in sc:
        n = sc["noise"]
        lines += ["## Noise: +-20 % on every link, rates redrawn every 20 s", "",
                  f"Config: {n.get('config')}", "",
                  "| seconds | rate changes | moves during the noise | target |", "|---:|---:|---:|---|",
                  f"| {n['seconds']:.0f} | {n['rate_changes']} | {n['migrations']} | <= 1: "
                  f"{'met' if n['migrations'] <= 1 else 'NOT met'} |", ""]
    return "\n".join(lines) + "\n"
