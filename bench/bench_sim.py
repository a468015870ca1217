"""A run of n peers for an hour of virtual time on shoal's own control-plane code (bench/lab/sim.py): decision
latency, table and delta sizes, failure-to-promotion times and each node's control traffic by kind, for n = 100,
1,000 and 10,000 by default (at most 1,000 providers join one run; the rest stay in the swarm and gossip status).

Run: python bench/bench_sim.py [--n 100 1000 10000] [--duration 3600] [--out bench/results] [--name sim]
Writes NAME.json and NAME.md (with this command) into --out.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import shlex
import sys
from pathlib import Path

from shoal.bench.sim import SimConfig, run, summary

TARGETS = "decision p99 <= 50 ms; control and status <= 20 KB/s per node; a table change <= 2 KB; failure -> " \
          "promotion <= fail_after_s + heartbeat_s; the 1,000-peer hour in <= 5 min of wall time (issue 27)"


def kb(x: float) -> str:
    return f"{x / 1000:.2f}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, nargs="+", default=[100, 1000, 10000], help="peers in the swarm")
    p.add_argument("--duration", type=float, default=3600.0, help="virtual seconds (default: an hour)")
    p.add_argument("--session-mean", type=float, default=3600.0, help="mean session length, virtual seconds")
    p.add_argument("--observed", type=int, default=16, help="members running the real RunClient")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    p.add_argument("--name", default="sim")
    args = p.parse_args()
    logging.basicConfig(level=logging.ERROR)  # the broker logs every failure and promotion: not what is measured
    command = " ".join(["python bench/bench_sim.py", *map(shlex.quote, sys.argv[1:])])
    rows = []
    for n in args.n:
        r = run(SimConfig(n=n, duration_s=args.duration, session_mean_s=args.session_mean, observed=args.observed,
                          seed=args.seed))
        print(summary(r), file=sys.stderr, flush=True)
        rows.append(r)
    args.out.mkdir(parents=True, exist_ok=True)
    doc = {"command": command, "machine": f"{platform.machine()}, Python {platform.python_version()}", "rows": rows}
    (args.out / f"{args.name}.json").write_text(json.dumps(doc, indent=1))
    lines = ["# A run of many peers in virtual time, on shoal's own control-plane code", "",
             f"Command: `{command}` on {doc['machine']} (wall times on this machine).", "",
             "bench/lab/sim.py: the real Broker, the real RunClient on what the broker gossips for "
             f"{args.observed} sampled members (the rest follow the table by the client's rule; a sampled client "
             "that ended elsewhere is counted as a mismatch), trio's MockClock. Weibull sessions (shape 0.6, mean "
             f"{args.session_mean:g} s), half ending in a crash; a replacement arrives ~60 s after each departure. "
             "Network model: each gossiped message reaches every live peer once (unique) and about 6 times on the "
             "wire (GossipSub degree 6); polls are RPCs to the broker every 3 s. Not modelled: " +
             rows[0]["not_modelled"] + ".", "", f"Targets: {TARGETS}.", "",
             "| n | virtual s / wall s | peers, run members (avg) | joined / refused | admit p50 / p99 ms | "
             "failure or leave p50 / p99 ms | failure -> promotion p50 / max s (bound) | table max B | "
             "deltas p50 / max B | per node KB/s unique: status / table+deltas / lease / polls | "
             "per node KB/s on the wire (without status) | broker KB/s: gossip sent / DHT puts | sampled clients "
             "(mismatches) |",
             "|---:|---|---|---|---|---|---|---:|---|---|---|---|---|"]
    for r in rows:
        d, f, u, b = r["decisions"], r["failure_to_promotion_s"], r["per_node_unique_bytes_per_s"], \
            r["broker_bytes_per_s"]
        a, fl = d.get("admit", {}), d.get("failure", {})

        def ms(x: dict, k: str) -> str:
            return f"{x[k]:.1f}" if x.get(k) is not None else "n/a"

        prom = (f"{f['p50']:.1f} / {f['max']:.1f} ({f['bound']:g})" if f["n"] else f"none ({f['bound']:g})")
        table = u.get("table", 0) + u.get("table_delta", 0)
        lines.append(
            f"| {r['config']['n']:,} | {r['config']['duration_s']:g} / {r['wall_s']:.0f} | {r['peers_avg']:,.0f}, "
            f"{r['run_members_avg']:,.0f} | {r['joined']:,} / {r['refused']:,} | {ms(a, 'p50_ms')} / "
            f"{ms(a, 'p99_ms')} | {ms(fl, 'p50_ms')} / {ms(fl, 'p99_ms')} | {prom} | {r['table_bytes']['max']:,} | "
            f"{r['delta_bytes']['p50'] or 0:,.0f} / {r['delta_bytes']['max'] or 0:,} | {kb(u['status'])} / "
            f"{kb(table)} / {kb(u.get('lease', 0))} / {kb(u['poll (both ways)'])} | "
            f"{kb(r['per_node_wire_bytes_per_s'])} ({kb(r['per_node_wire_without_status'])}) | "
            f"{kb(b.get('gossip sent', 0))} / {kb(b.get('dht puts (value x 20 replicas)', 0))} | "
            f"{r['sampled_clients']} ({r['sampled_client_mismatches']}) |")
    lines += ["", f"A status record here is {rows[0]['status_record_bytes']:,} bytes (a training member's, every field "
              "filled but lane links and shards)."]
    (args.out / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
