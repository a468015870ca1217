"""Seeded chaos runs of a local training swarm (bench/lab/chaos.py): in every run a broker frozen (SIGSTOP)
past its lease and a broker killed and restarted with its identity within a second, plus random faults (SIGKILL and
SIGTERM with restarts, SIGSTOP) and a member killed a few steps before the end.

Run: python bench/bench_chaos.py [--runs 5] [--nodes 5] [--replicas 3] [--steps 2000] [--stop 20,40]
(writes bench/results/chaos.{json,md}). Per run: completed (every step done), distinct final state hashes of the
active replicas (goal 1), brokers at the end (goal 1), every node's exit code, and per fault: training again
(every surviving replica 3 steps further), recovered (the group full, past the fault's step, one broker) and back
(from the node's return, SIGCONT or restart, until it is in the run again and the swarm recovered).
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

from shoal.bench.chaos import ChaosConfig, ChaosRun

STOPS = ("stop", "broker-freeze")


def pair(text: str) -> tuple[float, float]:
    lo, hi = (float(x) for x in text.split(","))
    return lo, hi


def fmt(v) -> str:
    return "-" if v is None else f"{v:.1f}"


def worst(rows: list[dict], key: str, kinds=None) -> float | None:
    vals = [f[key] for r in rows for f in r["faults"] if f[key] is not None and (kinds is None or f["kind"] in kinds)]
    return max(vals) if vals else None


def markdown(doc: dict) -> str:
    runs = doc["runs"]
    a = doc["args"]
    md = [f"# chaos: {a['nodes']} node processes on 127.0.0.1 ({a['replicas']} active + "
          f"{a['nodes'] - a['replicas']} backups), CocktailSGD, {a['steps']} steps\n",
          f"Command: `{doc['command']}`\n",
          f"Every run: a broker frozen past its lease (SIGSTOP {a['stop'][0]:g}-{a['stop'][1]:g} s, at least the lease "
          f"+ 2 s), a broker killed and restarted with its identity within a second, {a['random_faults']} random "
          f"faults (SIGKILL or SIGTERM, restart after 0.2-1 s; SIGSTOP {a['stop'][0]:g}-{a['stop'][1]:g} s) and a "
          f"member killed 8 steps before the end. `--fail-after {a['fail_after']:g}` (the broker's lease), "
          f"`--round-timeout {a['round_timeout']:g}`, steps paced to at least {a['min_step']:g} s. Times in seconds: "
          "*training again*: from the fault until every surviving replica is 3 steps further; *recovered*: from the "
          "fault until the group is full again past the fault's step with exactly one broker; *back*: from the "
          "node's return (SIGCONT, restart) until it is in the run again (admitted, fresh status) and the swarm has "
          "recovered — for a SIGSTOP this is the recovery after the hang.\n",
          "| seed | completed | distinct final hashes | brokers at end | exit codes | faults (kind: training again / "
          "recovered / back) | wall (s) |", "|---|---|---|---|---|---|---|"]
    for r in runs:
        faults = "; ".join(f"{f['kind']}{' (end)' if f['note'] == 'near the end' else ''}: "
                           f"{fmt(f['training_again_s'])} / {fmt(f['recovered_s'])} / {fmt(f['back_s'])}"
                           for f in r["faults"] if f["applied_s"] is not None)
        codes = sorted(set(r["exit_codes"].values()), key=str)
        md.append(f"| {r['seed']} | {'yes' if r['completed'] else 'NO'} | {len(r['hashes'])} | {r['brokers_at_end']} "
                  f"| {codes} | {faults} | {r['wall_s']:.0f} |")
    s = doc["summary"]
    md += ["", f"**Summary**: {s['completed']} of {s['runs']} runs completed with every step done; distinct final "
               f"hashes per run: {s['hashes_per_run']}; brokers at the end: {s['brokers_per_run']}; every node exited 0 "
               f"in {s['clean_exits']} runs. Worst training-again {fmt(s['worst_training_again_s'])} s, worst "
               f"recovered {fmt(s['worst_recovered_s'])} s (median {fmt(s['median_recovered_s'])} s), worst back "
               f"{fmt(s['worst_back_s'])} s; after a hang (SIGSTOP, from SIGCONT) worst back "
               f"{fmt(s['worst_back_after_hang_s'])} s; broker faults: worst recovered "
               f"{fmt(s['worst_broker_recovered_s'])} s."]
    errors = [f"- seed {r['seed']}: {r['error'].splitlines()[0]}" for r in runs if r.get("error")]
    if errors:
        md += ["", "Errors:", *errors]
    return "\n".join(md) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--first-seed", type=int, default=1)
    p.add_argument("--nodes", type=int, default=5)
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--random-faults", type=int, default=2)
    p.add_argument("--stop", type=pair, default=(20.0, 40.0), help="SIGSTOP length range, seconds: LO,HI")
    p.add_argument("--fail-after", type=float, default=4.0)
    p.add_argument("--round-timeout", type=float, default=4.0)
    p.add_argument("--min-step", type=float, default=0.1, help="every step takes at least this long")
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    args = p.parse_args()
    command = "python " + " ".join(shlex.quote(a) for a in sys.argv)
    runs = []
    for seed in range(args.first_seed, args.first_seed + args.runs):
        with tempfile.TemporaryDirectory(prefix="shoal-chaos-") as d:
            cfg = ChaosConfig(workdir=Path(d), nodes=args.nodes, replicas=args.replicas, steps=args.steps, seed=seed,
                              random_faults=args.random_faults, stop_s=args.stop, fail_after_s=args.fail_after,
                              round_timeout_s=args.round_timeout, min_step_s=args.min_step,
                              recovery_timeout_s=max(90.0, 3 * args.stop[1]), finish_timeout_s=600.0)
            t0 = time.monotonic()
            res = ChaosRun(cfg).run().to_json()
            print(f"seed {seed}: ok={res['ok']} hashes={len(res['hashes'])} brokers={res['brokers_at_end']} "
                  f"worst recovered={res['worst_recovery_s']} ({time.monotonic() - t0:.0f} s)", flush=True)
            runs.append(res)
    recovered = [f["recovered_s"] for r in runs for f in r["faults"] if f["recovered_s"] is not None]
    summary = {
        "runs": len(runs), "completed": sum(r["completed"] for r in runs),
        "hashes_per_run": [len(r["hashes"]) for r in runs], "brokers_per_run": [r["brokers_at_end"] for r in runs],
        "clean_exits": sum(all(c == 0 for c in r["exit_codes"].values()) for r in runs),
        "worst_training_again_s": worst(runs, "training_again_s"), "worst_recovered_s": worst(runs, "recovered_s"),
        "median_recovered_s": statistics.median(recovered) if recovered else None,
        "worst_back_s": worst(runs, "back_s"), "worst_back_after_hang_s": worst(runs, "back_s", STOPS),
        "worst_broker_recovered_s": worst(runs, "recovered_s", ("broker-freeze", "broker-restart")),
    }
    doc = {"command": command, "args": {k: v for k, v in vars(args).items() if k != "out"}, "summary": summary,
           "runs": runs}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "chaos.json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
    (args.out / "chaos.md").write_text(markdown(doc))
    print(markdown(doc))
    return 0 if summary["completed"] == len(runs) else 1


if __name__ == "__main__":
    sys.exit(main())
