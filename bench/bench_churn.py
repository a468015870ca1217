"""Overlapping churn with the node's default timeouts (bench/lab/churn.py): per run, six faults a few seconds apart
whether or not the swarm recovered from the last one — a member killed and restarted, the broker killed and
restarted within 1.5 s, the broker frozen past its lease, a member leaving and rejoining, another member killed, a
member frozen.

Run (each run is its own file, so a long benchmark goes in pieces; --report writes the table from what is there):
  python bench/bench_churn.py --runs 5                                  # 1 stage x 3 replicas + 2 backups
  python bench/bench_churn.py --runs 5 --stages 2 --replicas 2 --nodes 6 --name churn_pipeline
  python bench/bench_churn.py --report [--name churn]
Writes bench/results/churn/<name>/seed<N>.json and bench/results/<name>.md. Per fault kind: *training again* (from
the fault until every surviving replica is 3 steps further; a survivor hit by a later fault before that no longer
counts, and a fault whose survivors were all hit has no time: it came back as a backup, or to another slot), *recovered* (until every slot is held by a live node
training past the fault's step, with one broker; slots hit by later, still open faults excepted) and *back* (from
the node's return until it is in the run again); per run: every step done, distinct final hashes per stage, brokers
at the end, steps lost (a live replica's step count going backwards), exit codes.
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

from shoal.bench.churn import FAULTS, ChurnConfig, ChurnRun

KIND_ORDER = ("kill", "broker-kill", "broker-freeze", "leave", "freeze")


def fmt(v) -> str:
    return "-" if v is None else f"{v:.1f}"


def stats(vals: list[float]) -> str:
    if not vals:
        return "-"
    return f"{statistics.median(vals):.1f} / {max(vals):.1f} (n={len(vals)})"


def hashes_per_stage(run: dict) -> int:
    by_stage: dict[str, set[str]] = {}
    for h in run["hashes"]:
        stage, _, digest = h.partition(":")
        by_stage.setdefault(stage, set()).add(digest)
    return max((len(v) for v in by_stage.values()), default=0)


def markdown(name: str, docs: list[dict]) -> str:
    runs = [d["result"] for d in docs]
    a = docs[0]["args"]
    shape = f"{a['replicas']} replicas" if a["stages"] == 1 else f"{a['stages']} stages x {a['replicas']} lanes"
    md = [f"# churn: {a['nodes']} node processes on 127.0.0.1 ({shape} + {a['nodes'] - a['stages'] * a['replicas']} "
          f"backups), CocktailSGD{' + AQ-SGD' if a['stages'] > 1 else ''}, default timeouts "
          f"(`--fail-after {a['fail_after']:g} --round-timeout {a['round_timeout']:g}`)\n",
          "Commands (one per piece):\n", *sorted({f"- `{d['command']}`" for d in docs}), "",
          f"Every run: the faults {', '.join(FAULTS)} in a seeded order, {a['spacing'][0]:g}-{a['spacing'][1]:g} s apart "
          "(overlapping: the next fault does not wait for recovery). Member SIGSTOP "
          f"{a['freeze'][0]:g}-{a['freeze'][1]:g} s; broker SIGSTOP its lease + 2-4 s; killed/leaving members restart "
          "after 0.2-1 s, the killed broker within 1.5 s. Steps paced to at least "
          f"{a['min_step']:g} s. Times in seconds from the fault. *Training again*: until every survivor is "
          "3 steps further (a survivor hit by a later fault before that no longer counts; with none left, no time). "
          "The machine is shared: absolute times depend on its load; compare within one table.\n",
          "## Per fault kind (median / worst over all runs)\n",
          "| fault | training again | recovered | back in the run |", "|---|---|---|---|"]
    faults = [f for r in runs for f in r["faults"] if f["applied_s"] is not None]
    for kind in KIND_ORDER:
        fs = [f for f in faults if f["kind"] == kind]
        if fs:
            md.append(f"| {kind} | {stats([f['training_again_s'] for f in fs if f['training_again_s'] is not None])}"
                      f" | {stats([f['recovered_s'] for f in fs if f['recovered_s'] is not None])}"
                      f" | {stats([f['back_s'] for f in fs if f['back_s'] is not None])} |")
    rec = [f["recovered_s"] for f in faults if f["recovered_s"] is not None]
    kills = [f["training_again_s"] for f in faults if f["kind"] in ("kill", "broker-kill", "leave")
             and f["training_again_s"] is not None]
    unrec = sum(1 for f in faults if f["recovered_s"] is None)
    md += ["", f"**All faults**: recovered median {fmt(statistics.median(rec) if rec else None)} s, worst "
               f"{fmt(max(rec) if rec else None)} s ({len(rec)} faults, {unrec} not recovered); training again after "
               f"a kill, leave or broker kill: worst {fmt(max(kills) if kills else None)} s (median "
               f"{fmt(statistics.median(kills) if kills else None)} s).", "",
           "## Per run\n",
           "| seed | completed | distinct final hashes (per stage) | brokers at end | steps lost | exit codes | faults "
           "(kind: training again / recovered / back) | wall (s) |", "|---|---|---|---|---|---|---|---|"]
    for r in sorted(runs, key=lambda r: r["seed"]):
        fl = "; ".join(f"{f['kind']}: {fmt(f['training_again_s'])} / {fmt(f['recovered_s'])} / {fmt(f['back_s'])}"
                       + (f" ({f['note']})" if f["note"] else "") for f in r["faults"])
        codes = sorted(set(r["exit_codes"].values()), key=str)
        md.append(f"| {r['seed']} | {'yes' if r['completed'] else 'NO'} | {hashes_per_stage(r)} | "
                  f"{r['brokers_at_end']} | {r['steps_lost']} | {codes} | {fl} | {r['wall_s']:.0f} |")
    errors = [f"- seed {r['seed']}: {r['error'].splitlines()[0]}" for r in runs if r.get("error")]
    if errors:
        md += ["", "Errors:", *errors]
    return "\n".join(md) + "\n"


def report(out: Path, name: str) -> str:
    docs = [json.loads(p.read_text()) for p in sorted((out / "churn" / name).glob("seed*.json"))]
    if not docs:
        raise SystemExit(f"no runs in {out / 'churn' / name}")
    md = markdown(name, docs)
    (out / f"{name}.md").write_text(md)
    return md


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--first-seed", type=int, default=1)
    p.add_argument("--nodes", type=int, default=5)
    p.add_argument("--stages", type=int, default=1)
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--fail-after", type=float, default=8.0, help="the node's --fail-after (default: as swarm up)")
    p.add_argument("--round-timeout", type=float, default=10.0, help="the node's --round-timeout (as swarm up)")
    p.add_argument("--min-step", type=float, default=0.1, help="every step takes at least this long")
    p.add_argument("--name", default="churn")
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    p.add_argument("--report", action="store_true", help="only write the table from the runs already there")
    p.add_argument("--keep", type=Path, default=None, metavar="DIR",
                   help="keep each run's node logs and status files under DIR/seed<N> (default: removed)")
    args = p.parse_args()
    if args.report:
        print(report(args.out, args.name))
        return 0
    command = "python " + " ".join(shlex.quote(a) for a in sys.argv)
    folder = args.out / "churn" / args.name
    folder.mkdir(parents=True, exist_ok=True)
    ok = True
    for seed in range(args.first_seed, args.first_seed + args.runs):
        with tempfile.TemporaryDirectory(prefix="shoal-churn-") as d:
            work = Path(d) if args.keep is None else args.keep / f"seed{seed}"
            cfg = ChurnConfig(workdir=work, nodes=args.nodes, stages=args.stages, replicas=args.replicas,
                              steps=args.steps, seed=seed, fail_after_s=args.fail_after,
                              round_timeout_s=args.round_timeout, min_step_s=args.min_step)
            t0 = time.monotonic()
            res = ChurnRun(cfg).run().to_json()
        ok &= res["completed"]
        doc = {"command": command, "args": {"nodes": cfg.nodes, "stages": cfg.stages, "replicas": cfg.replicas,
                                            "steps": cfg.steps, "fail_after": cfg.fail_after_s,
                                            "round_timeout": cfg.round_timeout_s, "min_step": cfg.min_step_s,
                                            "spacing": cfg.spacing_s, "freeze": cfg.freeze_s},
               "result": res}
        (folder / f"seed{seed}.json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
        print(f"seed {seed}: completed={res['completed']} hashes={res['hashes']} brokers={res['brokers_at_end']} "
              f"lost={res['steps_lost']} faults=" + "; ".join(
                  f"{f['kind']}:{fmt(f['training_again_s'])}/{fmt(f['recovered_s'])}/{fmt(f['back_s'])}"
                  for f in res["faults"]) + f" ({time.monotonic() - t0:.0f} s)", flush=True)
    print(report(args.out, args.name))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
