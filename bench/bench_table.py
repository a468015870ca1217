"""The broker's table at crowd size: a real Broker (swarm/run/broker.py) admitting n providers on a virtual clock, no
network. Per decision (an admission, a failure with its promotion) its time on this machine, and the signed table it
publishes: bytes, bytes per provider, against the gossip cap (swarm/net/gossip.py). A one-stage elastic run of up to
MAX_REPLICAS lanes: the first providers are seated as lanes, the rest wait as backups.

Run: python bench/bench_table.py [--n 100 384 1000] [--fails 50] [--out bench/results] [--name table_scale]
Writes NAME.json and NAME.md (with this command) into --out. `--label L --append` adds this run's rows, tagged L, to
the files a previous run wrote: to compare trees, run it alternately on each (another tree's packages first on
PYTHONPATH as `shoal`), the same machine, back to back.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from shoal.protocol import manifest as mf
from shoal.protocol.assignment import MAX_PROVIDERS, MAX_REPLICAS, AdmitRequest
from shoal.protocol.records import HardwareProfile
from shoal.protocol.wire import pack
from shoal.swarm.net.gossip import MAX_GOSSIP_BYTES
from shoal.swarm.net.identity import peer_id_of
from shoal.swarm.net.membership import Membership
from shoal.swarm.run.broker import Broker, BrokerConfig
from shoal.swarm.run.context import RunContext
from shoal.protocol.tabledelta import make_delta, table_digest

HW = HardwareProfile(device_kind="cpu", device_name="bench", memory_bytes=8 << 30, matmul_tflops=0.1,
                     free_disk_bytes=1 << 36)


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


async def one(n: int, fails: int, lanes: int) -> dict:
    t = [1000.0]
    me = SimpleNamespace(key=Ed25519PrivateKey.generate())
    me.peer_id = peer_id_of(me.key)
    m = mf.RunManifest.default(
        model=mf.ModelSpec(size="custom", n_layers=2),
        batch=mf.BatchSpec(batch_size=4, micro_batch_size=4, global_batch=4 * lanes),
        plan=mf.ParallelPlan(stages=1, replicas=1, min_replicas=1, max_replicas=lanes, backups=0,
                             sync=mf.SyncSpec(method="allreduce")))

    async def publish(env: bytes) -> None:
        pass

    ctx = RunContext(sh=me, manifest=m, register=lambda *a: None, publish=publish, clock=lambda: t[0],
                     wall=time.time, membership=Membership(me.peer_id), switch_step=lambda stage: 3)
    b = Broker(ctx, BrokerConfig(heartbeat_s=1.0, fail_after_s=10.0, lease_renew_s=1.0, lease_timeout_s=6.0))
    peers = [peer_id_of(Ed25519PrivateKey.generate()) for _ in range(n - 1)]  # the broker is a provider too
    admit_ms = []
    for pid in peers:
        t0 = time.perf_counter()
        r = await b.admit(pid, AdmitRequest(run_id=ctx.run_id, hardware=HW))
        admit_ms.append((time.perf_counter() - t0) * 1e3)
        if not r.admitted:
            return {"n": n, "refused_at": len(admit_ms), "error": r.error}
        t[0] += 0.01
        b.renew_lease()
    full, lanes_seated, backups = len(b.table_env), len(b.table.slots), len(b.table.backups)
    # a member's poll (run.table), packed as it travels: without `have`, and naming the table it holds
    ask = {"run_id": ctx.run_id}
    poll = {"first": len(pack(await b.handle("run.table", peers[0], ask))),
            "unchanged": len(pack(await b.handle("run.table", peers[0], {**ask, "have": table_digest(b.table_env)})))}
    fail_ms = []
    seated = [s.peer_id for s in b.table.slots if s.peer_id != me.peer_id]
    delta_bytes = []  # each change as the broker gossips it: a delta from the table before (protocol/tabledelta.py)
    for pid in seated[:fails]:  # each failure promotes the first backup into the slot
        before = b.table_env
        t0 = time.perf_counter()
        b.mark_failed(pid, "bench")
        fail_ms.append((time.perf_counter() - t0) * 1e3)
        b.renew_lease()
        d = make_delta(before, b.table_env, me.key)
        delta_bytes.append(len(d) if d is not None else len(b.table_env))
    return {"n": n, "lanes": lanes_seated, "backups": backups,
            "table_bytes": full, "bytes_per_provider": full / n, "gossip_cap": MAX_GOSSIP_BYTES,
            "table_bytes_after_fails": len(b.table_env), "poll_answer_bytes": poll,
            "promotion_gossip_bytes": {"p50": statistics.median(delta_bytes), "max": max(delta_bytes)}
            if delta_bytes else None,
            "admit_ms": {"p50": statistics.median(admit_ms), "p99": pct(admit_ms, 0.99), "max": max(admit_ms)},
            "fail_ms": {"p50": statistics.median(fail_ms), "p99": pct(fail_ms, 0.99), "max": max(fail_ms)}
            if fail_ms else None}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, nargs="+", default=[100, 384, 1000], help="providers in the run (the broker too)")
    p.add_argument("--lanes", type=int, default=64, help="lanes seated (the rest are backups; default 64)")
    p.add_argument("--fails", type=int, default=50, help="seated providers failed one by one after admission")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    p.add_argument("--name", default="table_scale")
    p.add_argument("--label", default="", help="a tag for this run's rows (e.g. the tree it ran)")
    p.add_argument("--append", action="store_true", help="add to NAME.json / NAME.md instead of replacing them")
    args = p.parse_args()
    logging.basicConfig(level=logging.ERROR)  # the broker's per-decision log lines are not what is timed
    if not 1 <= args.lanes <= MAX_REPLICAS:
        p.error(f"--lanes: 1 to {MAX_REPLICAS}")
    env = f"PYTHONPATH={shlex.quote(os.environ['PYTHONPATH'])} " if os.environ.get("PYTHONPATH") else ""
    command = env + " ".join(["python bench/bench_table.py", *map(shlex.quote, sys.argv[1:])])
    rows = []
    for n in args.n:
        row = {"label": args.label, "max_providers": MAX_PROVIDERS, **trio.run(one, n, args.fails, args.lanes)}
        print(json.dumps(row), file=sys.stderr)
        rows.append(row)
    machine = f"{platform.machine()}, {platform.python_version()}"
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{args.name}.json"
    doc = json.loads(path.read_text()) if args.append and path.exists() else {"machine": machine, "runs": []}
    doc["runs"].append({"command": command, "rows": rows})
    path.write_text(json.dumps(doc, indent=1))
    lines = ["# The broker's table at crowd size\n",
             f"A real Broker on a virtual clock, no network; one stage, up to {args.lanes} lanes, the rest backups; "
             f"gossip cap {MAX_GOSSIP_BYTES:,} bytes. Times on this machine ({doc['machine']}) include sealing "
             f"(signing) the new table. Commands, in the order they ran:\n",
             *[f"{i + 1}. `{run['command']}`" for i, run in enumerate(doc["runs"])], "",
             "| run | tree | providers | MAX_PROVIDERS | lanes | backups | table bytes | bytes / provider "
             "| admit p50 / p99 / max ms | failure + promotion p50 / p99 / max ms |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---|---|"]
    for i, run in enumerate(doc["runs"]):
        for r in run["rows"]:
            head = f"| {i + 1} | {r['label']} | {r['n']} | {r['max_providers']} |"
            if "error" in r:
                lines.append(f"{head} refused at provider {r['refused_at']}: {r['error']} | | | | | |")
                continue
            a, f = r["admit_ms"], r["fail_ms"] or {"p50": 0, "p99": 0, "max": 0}
            lines.append(f"{head} {r['lanes']} | {r['backups']} | {r['table_bytes']:,} | "
                         f"{r['bytes_per_provider']:.1f} | {a['p50']:.2f} / {a['p99']:.2f} / {a['max']:.2f} | "
                         f"{f['p50']:.2f} / {f['p99']:.2f} / {f['max']:.2f} |")
    polls = [(i + 1, r) for i, run in enumerate(doc["runs"]) for r in run["rows"] if "poll_answer_bytes" in r]
    if polls:
        lines += ["", "A member's table poll (run.table, every poll_s from every member; the answer as it travels, "
                  "with the lease): the first, and one naming the table the member holds by its digest.", "",
                  "A failure with its promotion as the broker gossips it: a delta from the table before "
                  "(protocol/tabledelta.py), or the whole table where a delta would not be much shorter.", "",
                  "| run | tree | providers | first poll answer, bytes | unchanged table's poll answer, bytes "
                  "| promotion gossiped, bytes p50 / max |",
                  "|---:|---|---:|---:|---:|---|",
                  *[f"| {i} | {r['label']} | {r['n']} | {r['poll_answer_bytes']['first']:,} | "
                    f"{r['poll_answer_bytes']['unchanged']:,} | " + (
                        f"{r['promotion_gossip_bytes']['p50']:,.0f} / {r['promotion_gossip_bytes']['max']:,} |"
                        if r.get("promotion_gossip_bytes") else "n/a |") for i, r in polls]]
    (args.out / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
