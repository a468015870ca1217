"""NAT traversal numbers on the namespace NAT topology (needs root): reachability through a relay, hole punching,
and training with NATed replicas against the same training with none.

Run: python bench/bench_nat.py [--punch-tries 20] [--out bench/results]
Writes nat.json and nat.md (with this command) into --out.

- relayed: a `shoal node` behind NAT 0 joins the public bootstrap P; the time from the start of its process to a
  status saying "relayed" (dial-back verdict + reservation), and the node's own account from its start.
- punch: each try is a fresh natcheck host behind NAT 1 that reaches A (behind NAT 0) through P; success means a
  direct connection followed; the time runs from its first dial of A (through the relay) to the direct one.
  Tried with the routers dropping unsolicited packets (home routers) and with bare MASQUERADE.
- training: three replicas (the run of tests/swarm/test_run_swarm.py) with P public and two behind NATs, against three
  on the public segment; tokens/s over the steps both runs share, alternating the two setups.
"""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from shoal.bench.nat_topology import Topology, TopologyConfig, wait_status
from shoal.node.train.hardware import hardware_profile
from shoal.protocol import manifest as mf
from shoal.swarm.net.identity import load_or_create_identity

TOKENS_PER_STEP = 8 * 64  # batch_size x seq_len of the run below, per replica


def summarize(xs: list[float]) -> dict:
    if not xs:
        return {"n": 0}
    return {"median": round(statistics.median(xs), 3), "min": round(min(xs), 3), "max": round(max(xs), 3),
            "n": len(xs)}


def write_run(workdir: Path) -> Path:
    m = mf.RunManifest(
        seed=3, model=mf.ModelSpec(size="custom", n_layers=2, d_model=64, n_heads=4),
        batch=mf.BatchSpec(batch_size=8, micro_batch_size=8, seq_len=64),
        optim=mf.OptimSpec(lr=3e-3, warmup_steps=5, total_steps=1000), eval=mf.EvalSpec(every_steps=0, batches=4),
        plan=mf.ParallelPlan(replicas=3, sync=mf.SyncSpec(method="cocktail", cocktail=mf.CocktailSpec(warmup_steps=0))))
    path = workdir / "run.toml"
    path.write_text(m.signed(load_or_create_identity(workdir / "node0.key")).to_toml())
    return path


def stop(nodes) -> None:
    for n in nodes:
        if n.alive:
            n.proc.send_signal(signal.SIGTERM)
    for n in nodes:
        try:
            n.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            n.proc.kill()


def relayed(s: dict) -> bool:
    return s.get("nat", {}).get("reachability") == "relayed"


def reachability_and_punch(home: Path, firewall: bool, relay_trials: int, punch_tries: int) -> dict:
    out: dict = {"firewall": firewall}
    with tempfile.TemporaryDirectory() as d, Topology(TopologyConfig(homes=(1, 1), firewall=firewall)) as t:
        wd = Path(d)
        p = t.start_node(t.pub_ns(0), t.pub_ip(0), wd, "p", home=home)
        join = wait_status(p, lambda s: s.get("state") == "ready", 60, "P ready")["addrs"][0]
        wall, own = [], []
        a = None
        for i in range(relay_trials):
            t0 = time.monotonic()
            a = t.start_node(t.home_ns(0), t.home_ip(0), wd, f"a{i}", [join], home=home)
            st = wait_status(a, relayed, 60, "A relayed")
            wall.append(time.monotonic() - t0)
            own.append(st["nat"]["relayed_after_s"])
            if i < relay_trials - 1:
                stop([a])
        out["relayed_from_process_start_s"] = summarize(wall)
        out["relayed_from_node_start_s"] = summarize(own)
        target = a.status()["peer_id"]
        tries = []
        for _ in range(punch_tries):
            r = t.run_tool(t.home_ns(1), ["shoal.bench.natcheck", "reach", "--join", join, "--target",
                                          target, "--timeout", "10"], 120)
            r.pop("_stderr", None)
            tries.append({k: r.get(k) for k in ("direct", "direct_s", "relayed_rpc_s", "first_path", "error")})
        ok = [x for x in tries if x["direct"]]
        out["punch"] = {"tries": len(tries), "direct": len(ok), "time_to_direct_s": summarize(
            [x["direct_s"] for x in ok]), "relayed_rpc_s": summarize([x["relayed_rpc_s"] for x in tries
                                                                      if x["relayed_rpc_s"] is not None])}
        out["punch_tries"] = tries
        stop([a, p])
    return out


def training_run(home: Path, nat: bool, steps: int, first: int) -> dict:
    with tempfile.TemporaryDirectory() as d, Topology(TopologyConfig(public_hosts=1 if nat else 3,
                                                                      homes=(1, 1) if nat else ())) as t:
        wd = Path(d)
        run = write_run(wd)
        args = ("--run", str(run), "--threads", "1", "--steps", str(steps), "--round-timeout", "10",
                "--fail-after", "8")
        p = t.start_node(t.pub_ns(0), t.pub_ip(0), wd, "node0", (), args, home=home)
        join = [wait_status(p, lambda s: s.get("state") not in (None, "starting"), 60, "node0 ready")["addrs"][0]]
        places = [(t.home_ns(0), t.home_ip(0)), (t.home_ns(1), t.home_ip(1))] if nat else \
            [(t.pub_ns(1), t.pub_ip(1)), (t.pub_ns(2), t.pub_ip(2))]
        nodes = [p] + [t.start_node(ns, ip, wd, f"node{i + 1}", join, args, home=home)
                       for i, (ns, ip) in enumerate(places)]
        t_first = t_last = None
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline:
            rows = [n.status() or {} for n in nodes]
            step = min(r.get("step", 0) for r in rows)
            if t_first is None and step >= first:
                t_first = time.monotonic()
            if step >= steps and all(r.get("state") == "done" for r in rows):
                t_last = time.monotonic()
                break
            if not all(n.alive for n in nodes):
                break
            time.sleep(0.25)
        rows = [n.status() or {} for n in nodes]
        stop(nodes)
    if t_first is None or t_last is None:
        raise RuntimeError(f"training ({'nat' if nat else 'flat'}) did not finish: {rows}")
    hashes = {r.get("state_hash") for r in rows}
    return {"nat": nat, "tokens_per_s": round(3 * TOKENS_PER_STEP * (steps - first) / (t_last - t_first), 1),
            "equal_hashes": len(hashes) == 1, "reachability": [r.get("nat", {}).get("reachability") for r in rows],
            "node_tokens_per_s": [r.get("tokens_per_s") for r in rows]}


def main() -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--relay-trials", type=int, default=5)
    p.add_argument("--punch-tries", type=int, default=20)
    p.add_argument("--bare-punch-tries", type=int, default=5)
    p.add_argument("--train-steps", type=int, default=60)
    p.add_argument("--train-pairs", type=int, default=2)
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    args = p.parse_args()
    command = "python " + " ".join(shlex.quote(a) for a in sys.argv)
    with tempfile.TemporaryDirectory() as h:
        home = Path(h)
        hardware_profile("cpu", home)
        home_router = reachability_and_punch(home, True, args.relay_trials, args.punch_tries)
        bare = reachability_and_punch(home, False, 1, args.bare_punch_tries)
        runs = []
        for _ in range(args.train_pairs):
            for nat in (False, True):
                runs.append(training_run(home, nat, args.train_steps, 10))
    flat = [r["tokens_per_s"] for r in runs if not r["nat"]]
    nat = [r["tokens_per_s"] for r in runs if r["nat"]]
    result = {"command": command, "home_router": home_router, "bare_masquerade": bare, "training": runs,
              "tokens_per_s_nat_over_flat": round(statistics.mean(nat) / statistics.mean(flat), 3)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "nat.json").write_text(json.dumps(result, indent=1) + "\n")
    hr, hp, bp = home_router, home_router["punch"], bare["punch"]
    md = ["# NAT traversal (network namespaces, 2-core machine)\n", f"Command: `{command}`\n",
          "Topology: a public segment (198.51.100.0/24) with the bootstrap/relay P; homes behind Linux MASQUERADE "
          "routers. \"home router\": the routers also drop unsolicited inbound packets (the usual default); "
          "\"bare\": MASQUERADE only, so the router's own TCP stack answers an unsolicited SYN with a reset.\n",
          "| measure | median | min | max | n |", "|---|---|---|---|---|"]
    for name, v in [("NATed node relayed, from process start (s), home router", hr["relayed_from_process_start_s"]),
                    ("NATed node relayed, from node start (s), home router", hr["relayed_from_node_start_s"]),
                    ("NATed node relayed, from node start (s), bare", bare["relayed_from_node_start_s"]),
                    ("first RPC through the relay (s), home router", hp["relayed_rpc_s"]),
                    ("first dial to direct connection (s), home router", hp["time_to_direct_s"])]:
        md.append(f"| {name} | {v.get('median', '-')} | {v.get('min', '-')} | {v.get('max', '-')} | {v['n']} |")
    md += ["", f"Hole punching (DCUtR over TCP simultaneous open): home router {hp['direct']}/{hp['tries']} tries "
           f"direct; bare MASQUERADE {bp['direct']}/{bp['tries']}.", "",
           "| training, 3 replicas, cocktail | tokens/s (all replicas) | equal hashes | reachability |",
           "|---|---|---|---|"]
    for r in runs:
        md.append(f"| {'2 of 3 behind NATs' if r['nat'] else 'no NAT'} | {r['tokens_per_s']} | {r['equal_hashes']} "
                  f"| {', '.join(map(str, r['reachability']))} |")
    md.append(f"\nNATed / no NAT tokens/s: {result['tokens_per_s_nat_over_flat']} (mean of {len(nat)} runs each, "
              f"alternated; steps 10..{args.train_steps}).")
    (args.out / "nat.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
