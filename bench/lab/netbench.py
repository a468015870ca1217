"""`shoal bench network`: the workloads on each scenario's shaped links, the same unshaped, and hivemind beside them.

One topology serves the whole run; it is reshaped (and each shaping checked by the TCP probe) between segments,
so every ratio compares segments of one run on one machine: a workload shaped vs the same workload unshaped, and
shoal vs hivemind on the same links. Segments run one at a time; a run stops starting new ones once its time
budget is spent, and reports what it measured.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from shoal.bench import probe, scenarios
from shoal.bench.hivemind_swarm import HivemindSettings, baseline_python
from shoal.bench.segment import SegmentConfig, hivemind_segment, shoal_segment
from shoal.bench.topology import Topology, TopologyConfig, install_signal_teardown
from shoal.bench.workloads import workload

log = logging.getLogger(__name__)
HIVEMIND_VARIANTS = {"hivemind": ("none", "8bit")}  # its default averaging, and its best compression


@dataclass(frozen=True, kw_only=True, slots=True)
class NetBenchConfig:
    scenarios: tuple[str, ...] = ("home-100",)
    workloads: tuple[str, ...] = ("cocktail", "allreduce")
    baselines: tuple[str, ...] = ()  # "hivemind"
    segment: SegmentConfig = field(default_factory=SegmentConfig)
    workdir: Path = Path("/tmp/shoal-bench-network")
    prefix: str = "shnet"
    subnet: str = "10.15.0"
    limit: bool = True  # also run every workload unshaped (the ratio's denominator)
    hivemind_python: str | None = None
    hivemind_compressions: tuple[str, ...] = HIVEMIND_VARIANTS["hivemind"]
    budget_s: float = 1680.0  # no segment starts after this much of the run (28 min)
    probe: probe.ProbeConfig = field(default_factory=probe.ProbeConfig)

    def __post_init__(self) -> None:
        for name in self.scenarios:
            scenarios.load(name)
        for name in self.workloads:
            workload(name)
        unknown = set(self.baselines) - set(HIVEMIND_VARIANTS)
        if unknown:
            raise ValueError(f"unknown baseline(s) {sorted(unknown)} (known: {', '.join(HIVEMIND_VARIANTS)})")
        if not self.scenarios and not self.limit:
            raise ValueError("nothing to run: no scenario and no unshaped limit")
        if self.budget_s <= 0:
            raise ValueError("budget_s must be positive")
        if not set(self.hivemind_compressions) <= {"none", "fp16", "8bit"} or not self.hivemind_compressions:
            raise ValueError("hivemind compressions: none, fp16, 8bit")


def run(config: NetBenchConfig, progress: Callable[[str], None] = log.info) -> dict:
    """Every segment of the run; returns the result document (see netreport for its tables)."""
    install_signal_teardown()
    seg = config.segment
    t0 = time.monotonic()
    python = None
    notes: list[str] = []
    if config.baselines:
        python, how = baseline_python(config.hivemind_python)
        if python is None:
            notes.append(f"hivemind baseline not run: {how}")
            progress(notes[-1])
    plan = [name for name in config.scenarios if name != "unshaped"]
    if config.limit or "unshaped" in config.scenarios:
        plan.insert(0, "unshaped")  # the limit first: a run cut short by its budget still has every ratio's base
    rows: list[dict] = []
    probes: dict[str, list[dict]] = {}
    shaped_by: dict[str, list[dict]] = {}
    home = config.workdir / "home"
    with Topology(TopologyConfig(prefix=config.prefix, nodes=seg.nodes, subnet=config.subnet)) as topo:
        for sc_name in plan:
            sc = scenarios.load(sc_name)
            shapes = sc.shapes(seg.nodes)
            topo.shape(shapes)
            checked = probe.verify(topo, config.probe)
            probes[sc_name] = [r.to_dict() for r in checked]
            shaped_by[sc_name] = [{"up_mbit": s.up_mbit, "down_mbit": s.down_mbit} for s in shapes]
            bad = [r for r in checked if not r.ok]
            progress(f"{sc_name}: links {_links_text(shapes)}; probe "
                     + ", ".join(f"n{r.node} {r.direction} {r.measured_mbit:.1f}" for r in checked)
                     + (" (OFF: segments skipped)" if bad else ""))
            if bad:
                notes.append(f"{sc_name}: probe outside tolerance {[r.to_dict() for r in bad]}; not run")
                continue
            jobs: list[tuple[str, object]] = [("shoal", w) for w in config.workloads]
            if python is not None and sc.shaped:
                jobs += [("hivemind", c) for b in config.baselines for c in config.hivemind_compressions]
            for kind, what in jobs:
                if time.monotonic() - t0 > config.budget_s:
                    notes.append(f"time budget of {config.budget_s:.0f} s spent: {sc_name} {kind} {what} not run")
                    progress(notes[-1])
                    continue
                label = what if kind == "shoal" else HivemindSettings(compression=what).label
                progress(f"{sc_name} / {label}: starting")
                wd = config.workdir / f"{sc_name}-{label.replace(' ', '-')}"
                if kind == "shoal":
                    res = shoal_segment(topo, workload(what), seg, wd, home, progress)
                else:
                    res = hivemind_segment(topo, python, HivemindSettings(compression=what),
                                           workload(config.workloads[0] if config.workloads else "allreduce"),
                                           seg, wd, progress)
                res.update(scenario=sc_name, links=shaped_by[sc_name], label=label)
                rows.append(res)
                progress(f"{sc_name} / {label}: {_summary(res)}")
    return {"config": _config_dict(config), "probes": probes, "links": shaped_by, "rows": rows, "notes": notes,
            "wall_s": round(time.monotonic() - t0, 1)}


def _links_text(shapes) -> str:
    distinct = sorted({(s.up_mbit, s.down_mbit) for s in shapes}, key=str)
    return "; ".join(f"{u or 'unshaped'}/{d or 'unshaped'} Mbit/s up/down" for u, d in distinct)


def _summary(res: dict) -> str:
    parts = []
    if res.get("tokens_per_s"):
        parts.append(f"{res['tokens_per_s']:.0f} tokens/s")
    if res.get("wire_over_payload"):
        parts.append(f"wire {res['wire_over_payload']:.2f}x payload")
    if res.get("time_to_target_s") is not None:
        parts.append(f"target loss after {res['time_to_target_s']:.0f} s")
    if res.get("errors"):
        parts.append("errors: " + "; ".join(res["errors"])[:300])
    return ", ".join(parts) or "no measurement"


def _config_dict(c: NetBenchConfig) -> dict:
    s = c.segment
    return {"scenarios": list(c.scenarios), "workloads": list(c.workloads), "baselines": list(c.baselines),
            "hivemind_compressions": list(c.hivemind_compressions), "limit": c.limit, "prefix": c.prefix,
            "budget_s": c.budget_s,
            "segment": {"size": s.size, "layers": s.layers, "nodes": s.nodes, "max_steps": s.max_steps, "window_steps": list(s.window_steps),
                        "target_loss": s.target_loss, "eval_every": s.eval_every, "lr": s.lr,
                        "time_limit_s": s.time_limit_s, "status_interval_s": s.status_interval_s,
                        "gone_after_s": s.gone_after_s, "round_timeout_s": s.round_timeout_s}}
