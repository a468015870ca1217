"""Swarm membership numbers: 5-node convergence, time to notice a killed node, idle RSS, DHT put/get latency.

Run: python bench/bench_swarm.py [--dht-nodes 20] [--out bench/results]
Writes swarm.json and swarm.md (with this command) into --out.
"""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from shoal.node.localswarm import LocalSwarm, LocalSwarmConfig
from shoal.protocol.envelope import seal
from shoal.protocol.records import LeaveNotice
from shoal.swarm.net.dht_records import announcement_key
from shoal.swarm.net.host import HostConfig, open_host


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return -1


def swarm_numbers(trials: int, idle_s: float) -> dict:
    conv, notice, leave, rss = [], [], [], []
    for t in range(trials):
        with tempfile.TemporaryDirectory() as d:
            s = LocalSwarm(LocalSwarmConfig(nodes=5, workdir=Path(d) / "w", home=Path(d) / "h"))
            try:
                t0 = time.monotonic()
                s.start()
                s.wait_converged(120)
                conv.append(time.monotonic() - t0)  # from the first process start to full mutual view
                if t == 0:
                    time.sleep(idle_s)
                    rss += [rss_kib(n.proc.pid) for n in s.nodes]
                ids = s.peer_ids()
                s.nodes[4].proc.send_signal(signal.SIGKILL)
                t0 = time.monotonic()
                while any(ids[4] in set((s.nodes[i].status() or {}).get("peers", [])) for i in range(4)):
                    time.sleep(0.05)
                notice.append(time.monotonic() - t0)
                s.nodes[3].proc.send_signal(signal.SIGTERM)
                t0 = time.monotonic()
                while any(ids[3] in set((s.nodes[i].status() or {}).get("peers", [])) for i in range(3)):
                    time.sleep(0.05)
                leave.append(time.monotonic() - t0)
            finally:
                s.stop()
    cfg = LocalSwarmConfig(workdir=Path("."), home=Path("."))
    return {
        "status_interval_s": cfg.status_interval_s, "gone_after_s": cfg.gone_after_s, "trials": trials,
        "converge_5_nodes_s": summarize(conv), "notice_sigkill_s": summarize(notice),
        "notice_graceful_leave_s": summarize(leave), "idle_rss_mib": summarize([r / 1024 for r in rss]),
        "idle_s_before_rss": idle_s,
    }


def summarize(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {"median": round(statistics.median(xs), 3), "min": round(xs[0], 3), "max": round(xs[-1], 3), "n": len(xs)}


async def dht_numbers(n_nodes: int, trials: int) -> dict:
    from contextlib import AsyncExitStack

    async with AsyncExitStack() as stack:
        hosts = []
        first = await stack.enter_async_context(open_host(Ed25519PrivateKey.generate(), HostConfig()))
        hosts.append(first)
        for _ in range(n_nodes - 1):
            h = await stack.enter_async_context(open_host(Ed25519PrivateKey.generate(),
                                                          HostConfig(join=(first.addrs[0],))))
            await h.bootstrap()
            hosts.append(h)
        for h in hosts:  # a second refresh once everyone is in
            with trio.move_on_after(5):
                await h.dht.refresh_routing_table()
        puts, gets, ok = [], [], 0
        for i in range(trials):
            writer, reader = hosts[(3 * i) % n_nodes], hosts[(3 * i + 1 + n_nodes // 2) % n_nodes]
            value = seal(LeaveNotice(peer_id=writer.peer_id, time=1e9 + i, reason=f"bench {i}"), writer.key)
            key = announcement_key(writer.peer_id)
            t0 = time.perf_counter()
            await writer.dht.put_value(key, value)
            puts.append((time.perf_counter() - t0) * 1000)
            t0 = time.perf_counter()
            got = await reader.dht.get_value(key)
            gets.append((time.perf_counter() - t0) * 1000)
            ok += got == value
        return {"nodes": n_nodes, "trials": trials, "get_returned_the_value": ok,
                "put_ms": summarize(puts), "get_ms": summarize(gets)}


def main() -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--idle", type=float, default=20.0, help="seconds idle before reading RSS")
    p.add_argument("--dht-nodes", type=int, default=20)
    p.add_argument("--dht-trials", type=int, default=20)
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    args = p.parse_args()
    command = "python " + " ".join(shlex.quote(a) for a in sys.argv)
    result = {"command": command, "swarm": swarm_numbers(args.trials, args.idle),
              "dht": trio.run(dht_numbers, args.dht_nodes, args.dht_trials)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "swarm.json").write_text(json.dumps(result, indent=1) + "\n")
    s, d = result["swarm"], result["dht"]
    md = ["# swarm membership (loopback, 2-core machine)\n", f"Command: `{command}`\n",
          "| measure | median | min | max | n |", "|---|---|---|---|---|"]
    for name, key in [("5 nodes converge (s, first start to full view)", "converge_5_nodes_s"),
                      ("SIGKILLed node marked gone by all (s)", "notice_sigkill_s"),
                      ("gracefully leaving node gone from all (s)", "notice_graceful_leave_s"),
                      (f"idle RSS per node (MiB, after {s['idle_s_before_rss']:.0f} s)", "idle_rss_mib")]:
        v = s[key]
        md.append(f"| {name} | {v['median']} | {v['min']} | {v['max']} | {v['n']} |")
    for name, key in [(f"DHT put, {d['nodes']} nodes (ms)", "put_ms"), (f"DHT get, {d['nodes']} nodes (ms)", "get_ms")]:
        v = d[key]
        md.append(f"| {name} | {v['median']} | {v['min']} | {v['max']} | {v['n']} |")
    md.append(f"\nStatus every {s['status_interval_s']} s, gone after {s['gone_after_s']} s of silence "
              f"(the `shoal swarm up` settings). DHT gets that returned the stored value: "
              f"{d['get_returned_the_value']}/{d['trials']}.")
    (args.out / "swarm.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
