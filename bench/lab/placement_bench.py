"""`shoal bench placement`: shoal's planner against random placement, a greedy one and DT-FM's GCMA on DT-FM's five
64-device scenarios, all priced by one cost model (swarm/run/placement_cost.py).

The scenarios and the model's sizes come from dtfm_sites.json (the paper's matrices, reduced to site pairs without
loss; the model block is the scenarios' data: 0.65 GB of gradients per stage, 0.47 GB of activations per tasklet,
both ways). DT-FM's own scheduler code uses per-case sizes that differ; this bench follows the data file.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from shoal.bench.placement_gcma import gcma, groups_of, random_partition
from shoal.bench.scenarios import DTFM_FILE
from shoal.swarm.run.placement_cost import CostModel, Network, Workload
from shoal.swarm.run.placement_plan import Planner, PlannerConfig

TARGET_LOWER = 0.05  # at least this much below GCMA's best ...
TARGET_LOWER_CASES = 2  # ... on at least this many cases
TARGET_SECONDS = 2.0
TARGET_RANDOM_RATIO = 0.55  # on the worldwide case
WORLDWIDE = "5_worldwide"


@dataclass(frozen=True, kw_only=True, slots=True)
class PlacementBenchConfig:
    cases: tuple[str, ...] = ()  # empty: all five
    gcma_seeds: tuple[int, ...] = (0, 1, 2)
    population: int = 100
    offspring: int = 4900
    random_samples: int = 100
    budget_s: float = 1.5  # the planner's time budget

    def __post_init__(self) -> None:
        if self.population < 2 or self.offspring < 0 or self.random_samples < 1 or self.budget_s <= 0:
            raise ValueError("need population >= 2, offspring >= 0, random samples >= 1 and a positive budget")


@dataclass(frozen=True, slots=True)
class Case:
    name: str
    description: str
    model: CostModel
    sites: list[str]
    weights: np.ndarray  # the reference's own pipeline weight arithmetic (ms, GB, Gbit/s), for GCMA's ties


def load_cases(names: tuple[str, ...] = ()) -> list[Case]:
    doc = json.loads(DTFM_FILE.read_text())
    m = doc["model"]
    S = int(m["layers"] // m["layers_per_stage"])
    out = []
    for name, c in doc["cases"].items():
        if names and name not in names:
            continue
        dev = c["devices"]
        n = len(dev)
        lat = np.array([[0.0 if i == j else c["site_ms"][dev[i]][dev[j]] for j in range(n)] for i in range(n)])
        bw = np.array([[0.0 if i == j else c["site_gbps"][dev[i]][dev[j]] for j in range(n)] for i in range(n)])
        act, grad = float(m["activation_bytes_per_tasklet"]), float(m["grad_bytes_per_stage_fp32"])
        wl = Workload(stages=S, lanes=n // S, grad_bytes=(grad,) * S, fwd_bytes=(act,) * (S - 1),
                      bwd_bytes=(act,) * (S - 1))
        with np.errstate(divide="ignore"):
            weights = lat / 1e3 + (act / 1e9) * 8 / bw
        out.append(Case(name, c["description"], CostModel(Network.from_ms_gbps(lat, bw), wl), dev, weights))
    unknown = set(names) - {c.name for c in out}
    if unknown:
        raise ValueError(f"unknown cases {sorted(unknown)} (known: {', '.join(doc['cases'])})")
    return out


def greedy_lanes(model: CostModel) -> np.ndarray:
    """Nearest-neighbour lanes: each lane starts at the lowest-numbered free device and takes, stage after stage,
    the free device with the cheapest pipeline edge from its last one."""
    S, D = model.workload.stages, model.workload.lanes
    w = model.pp_pair[0]
    free = np.ones(model.n, dtype=bool)
    grid = np.empty((S, D), dtype=np.intp)
    for lane in range(D):
        cur = int(np.flatnonzero(free)[0])
        free[cur] = False
        grid[0, lane] = cur
        for s in range(1, S):
            cand = np.flatnonzero(free)
            cur = int(cand[np.argmin(w[cur, cand])])
            free[cur] = False
            grid[s, lane] = cur
    return grid


def _cost_dict(model: CostModel, grid: np.ndarray) -> dict:
    c = model.evaluate(grid)
    return {"dp": c.dp, "pp": c.pp, "total": c.total}


def _lanes_by_site(case: Case, grid: np.ndarray) -> list[str]:
    """Each lane as its sites from stage 0, a run of one site written once with its length (VA x8)."""
    out = []
    for lane in range(grid.shape[1]):
        runs: list[list] = []
        for d in grid[:, lane]:
            if runs and runs[-1][0] == case.sites[d]:
                runs[-1][1] += 1
            else:
                runs.append([case.sites[d], 1])
        out.append(" ".join(f"{site} x{k}" if k > 1 else site for site, k in runs))
    return out


def run_case(case: Case, config: PlacementBenchConfig, progress: Callable[[str], None],
             kept: dict | None = None) -> dict:
    """One case. `kept`: this case's row from an earlier run with the same baseline settings, whose random and
    GCMA results are taken over (the planner and greedy always run again)."""
    model = case.model
    S = model.workload.stages
    if kept is not None:
        rand_row, runs = kept["random"], list(kept["gcma"])
        progress(f"{case.name}: random and GCMA kept from the earlier results")
    else:
        rng = np.random.default_rng(0)
        t0 = time.perf_counter()
        cache: dict = {}
        rand = [model.partition_cost(groups_of(random_partition(model.n, S, rng), S), cache).total
                for _ in range(config.random_samples)]
        rand_row = {"mean": float(np.mean(rand)), "best": float(np.min(rand)), "samples": len(rand)}
        progress(f"{case.name}: random mean {np.mean(rand):.2f} s ({time.perf_counter() - t0:.1f} s)")
        runs = []
        for seed in config.gcma_seeds:
            r = gcma(model, seed, population=config.population, offspring=config.offspring, weights=case.weights)
            runs.append({"seed": seed, **_cost_dict(model, r.grid), "seconds": r.seconds,
                         "curve": [round(float(x), 4) for x in r.curve[::100]] + [round(float(r.curve[-1]), 4)]})
            progress(f"{case.name}: GCMA seed {seed}: {r.total:.3f} s per step ({r.seconds:.0f} s)")
    greedy = greedy_lanes(model)
    planner = Planner(model, PlannerConfig(time_budget_s=config.budget_s))
    p = planner.plan()
    # the same network with the devices numbered at random: the plan must not depend on the numbering
    perm = np.random.default_rng(1).permutation(model.n)
    net = model.network
    shuffled = CostModel(Network(net.latency_s[np.ix_(perm, perm)], net.bandwidth_bps[np.ix_(perm, perm)]),
                         model.workload)
    ps = Planner(shuffled, PlannerConfig(time_budget_s=config.budget_s)).plan()
    progress(f"{case.name}: shoal {p.cost.total:.3f} s per step ({p.seconds:.2f} s; devices renumbered: "
             f"{ps.cost.total:.3f})")
    best = min(runs, key=lambda r: r["total"]) if runs else None
    return {
        "case": case.name, "description": case.description, "devices": model.n, "stages": S,
        "lanes": model.workload.lanes,
        "random": rand_row,
        "greedy": _cost_dict(model, greedy),
        "gcma": runs, "gcma_best": best,
        "shoal": {**_cost_dict(model, p.grid), "seconds": p.seconds, "how": p.how,
                  "lanes": _lanes_by_site(case, p.grid), "renumbered_total": ps.cost.total,
                  "renumbered_seconds": ps.seconds},
    }


def targets(rows: list[dict]) -> list[str]:
    out = []
    with_gcma = [r for r in rows if r["gcma_best"]]
    if with_gcma:
        not_worse = [r["case"] for r in with_gcma if r["shoal"]["total"] <= r["gcma_best"]["total"] * (1 + 1e-9)]
        lower = [r["case"] for r in with_gcma if r["shoal"]["total"] <= (1 - TARGET_LOWER) * r["gcma_best"]["total"]]
        verdict = "met" if len(not_worse) == len(with_gcma) == 5 else \
            f"NOT met: {len(with_gcma)} of 5 cases run" if len(not_worse) == len(with_gcma) else "NOT met"
        out.append(f"cost <= GCMA's best of {len(with_gcma[0]['gcma'])} seeds on every case: "
                   f"{len(not_worse)} of {len(with_gcma)} ({verdict})")
        out.append(f">= {TARGET_LOWER:.0%} lower than GCMA's best on >= {TARGET_LOWER_CASES} cases: {len(lower)} "
                   f"({', '.join(lower) or 'none'}) ({'met' if len(lower) >= TARGET_LOWER_CASES else 'NOT met'})")
    slowest = max(rows, key=lambda r: r["shoal"]["seconds"])
    out.append(f"planning <= {TARGET_SECONDS:g} s per 64-device case: the slowest took "
               f"{slowest['shoal']['seconds']:.2f} s ({slowest['case']}) "
               f"({'met' if slowest['shoal']['seconds'] <= TARGET_SECONDS else 'NOT met'})")
    ww = [r for r in rows if r["case"] == WORLDWIDE]
    if ww:
        ratio = ww[0]["shoal"]["total"] / ww[0]["random"]["mean"]
        out.append(f"<= {TARGET_RANDOM_RATIO}x the random mean on the worldwide case: {ratio:.3f}x "
                   f"({'met' if ratio <= TARGET_RANDOM_RATIO else 'NOT met'})")
    same = all(abs(r["shoal"]["renumbered_total"] - r["shoal"]["total"]) <= 1e-9 * r["shoal"]["total"] for r in rows)
    out.append(f"the plan's cost does not depend on how the devices are numbered: {'yes' if same else 'NO'}")
    return out


def _baseline_settings(config: PlacementBenchConfig) -> dict:
    return {"gcma_seeds": list(config.gcma_seeds), "population": config.population, "offspring": config.offspring,
            "random_samples": config.random_samples}


def run(config: PlacementBenchConfig, progress: Callable[[str], None], earlier: dict | None = None) -> dict:
    """Every case of `config`. `earlier` (a previous result document): rows of cases it holds, made with the same
    baseline settings, keep their random and GCMA results, and its other cases are carried over as they are, so a
    long run can be made one case at a time (`--keep`)."""
    same = earlier is not None and all(earlier["config"].get(k) == v for k, v in _baseline_settings(config).items())
    before = {r["case"]: r for r in earlier["rows"]} if same else {}
    rows = {}
    for c in load_cases(config.cases):
        rows[c.name] = run_case(c, config, progress, before.get(c.name))
    for name, r in before.items():
        rows.setdefault(name, r)
    order = [c.name for c in load_cases()]
    out = [rows[n] for n in order if n in rows]
    commands = list(earlier.get("commands", [earlier.get("command")])) if same else []
    return {"config": {"cases": [r["case"] for r in out], **_baseline_settings(config), "budget_s": config.budget_s},
            "rows": out, "targets": targets(out), "earlier_commands": [c for c in commands if c]}


def _c(x: dict | None) -> str:
    return "n/a" if x is None else f"{x['dp']:.2f} / {x['pp']:.2f} / **{x['total']:.2f}**"


def markdown(doc: dict) -> str:
    cfg = doc["config"]
    lines = [
        "# shoal bench placement", "",
        *(["Commands (a case's row comes from the last command that named it; --keep carries the others):", "",
            *[f"    {c}" for c in doc["commands"]]] if len(doc.get("commands", ())) > 1
          else [f"Command: `{doc['command']}`"]),
        "", f"Machine: {doc['machine']}", "",
        "Seconds per optimizer step predicted by one cost model (swarm/run/placement_cost.py; DT-FM's terms: data "
        "parallel + pipeline forward and backward) on DT-FM's five 64-device scenarios (8 stages x 8 lanes), with "
        "the sizes of the scenarios' data file (0.65 GB of gradients per stage, 0.47 GB of activations per tasklet; "
        "DT-FM's code uses other, per-case sizes). Costs are DP / PP / **total**. Random: "
        f"{cfg['random_samples']} random balanced partitions, each wired by DT-FM's own step (bottleneck matchings, "
        f"best stage order), as GCMA's first population. Greedy: nearest-neighbour lanes. GCMA: a faithful "
        f"re-implementation of DT-FM's (population {cfg['population']}, {cfg['offspring']:,} offspring, seeds "
        f"{', '.join(map(str, cfg['gcma_seeds']))}). shoal: swarm/run/placement_plan.py, time budget "
        f"{cfg['budget_s']:g} s.", "",
        "| case | random mean (best) | greedy | GCMA best of seeds (each seed's total) | shoal | shoal / GCMA | "
        "shoal / random mean | shoal planning s | GCMA s per run |",
        "|---|---|---|---|---|---:|---:|---:|---:|"]
    for r in doc["rows"]:
        g = r["gcma_best"]
        seeds = ", ".join(f"{x['total']:.2f}" for x in r["gcma"])
        gs = np.mean([x["seconds"] for x in r["gcma"]]) if r["gcma"] else float("nan")
        ratio = f"{r['shoal']['total'] / g['total']:.3f}" if g else "n/a"
        lines.append(
            f"| {r['case']} | {r['random']['mean']:.2f} ({r['random']['best']:.2f}) | {_c(r['greedy'])} | "
            f"{_c(g)} ({seeds}) | {_c(r['shoal'])} | {ratio} | "
            f"{r['shoal']['total'] / r['random']['mean']:.3f} | {r['shoal']['seconds']:.2f} | {gs:.0f} |")
    lines += ["", "## Targets", ""] + [f"- {t}" for t in doc["targets"]]
    lines += ["", "## shoal's plans (each lane's sites, stage 0 first)", ""]
    for r in doc["rows"]:
        lanes = r["shoal"]["lanes"]
        lines.append(f"- {r['case']} ({r['shoal']['how']}): " + "; ".join(lanes))
    return "\n".join(lines) + "\n"
