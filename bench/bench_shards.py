"""Rebuilding a stage from k erasure-coded shards in parallel vs pulling the whole state from one peer, on shaped
home links (network namespaces + tbf; needs root), plus a holder's memory and the encoder's cost off the event loop.

Run: python bench/bench_shards.py [--state-mb 20] [--k 4] [--m 2] [--up 20] [--down 100] [--trials 3]
Writes shards.json and shards.md (with this command) into --out (default bench/results).

- links: every peer has a home link of --up Mbit/s upload and --down Mbit/s download (tbf per direction); the k
  shards come from k holders at once (each upload carries state/k), the whole state from one holder (one upload
  carries it all). The puller skips --skip holders (as if lost with the stage). Trials alternate the two.
- encode: the encoder's work on this machine (k + m shards, hashes) in a worker thread while the event loop ticks
  every millisecond: its time and how long the loop waited meanwhile, as the node encodes (the state's parts copied
  once into the padded string) and from one joined blob, alternately, and the loop alone. --encode-only: just this
  (no root), e.g. --state-mb 200 to see what a bigger stage does to the loop.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import trio

from shoal.bench.topology import LinkShape, Topology, TopologyConfig, install_signal_teardown


def shaped_links(args) -> dict:
    n = args.k + args.m
    with tempfile.TemporaryDirectory() as d, Topology(TopologyConfig(prefix="ec24", nodes=n + 1,
                                                                     subnet="10.24.0")) as topo:
        topo.shape([LinkShape(up_mbit=args.up, down_mbit=args.down)] * (n + 1))
        common = ["--out", d, "--state-mb", str(args.state_mb), "--k", str(args.k), "--m", str(args.m)]
        procs = []
        try:
            for i in range(n):
                procs.append(subprocess.Popen(topo.exec_argv(i + 1) + [sys.executable, "-m", "shoal.bench.shard_peer",
                                              "holder", "--index", str(i), "--ip", topo.ip(i + 1), *common],
                                              stdout=subprocess.DEVNULL, stderr=open(Path(d, f"h{i}.log"), "w")))
            puller = subprocess.run(topo.exec_argv(0) + [sys.executable, "-m", "shoal.bench.shard_peer", "puller",
                                    "--ip", topo.ip(0), "--skip", str(args.skip), "--trials", str(args.trials),
                                    *common], capture_output=True, text=True, timeout=args.timeout)
            if puller.returncode != 0:
                raise RuntimeError(f"puller failed: {puller.stderr[-2000:]}")
            trials = json.loads(Path(d, "puller.json").read_text())
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
        qdiscs = topo.qdiscs()
    ratios = [t["ratio"] for t in trials]
    return {"trials": trials, "ratio_median": statistics.median(ratios), "ratio_worst": max(ratios),
            "qdiscs": qdiscs[:4]}


def encode_off_loop(args) -> dict:
    """The encoder's work in a worker thread while a trio task ticks every ms: as node/run/shards.py runs it (the
    state's parts copied once into the padded string), and from one joined blob (`snapshot_bytes`, a copy that holds
    the GIL), alternately; then the loop as long again with no encoding (what the machine does to the tick anyway)."""
    from shoal.bench.shard_peer import state
    from shoal.swarm.state import erasure
    from shoal.swarm.state.blob import snapshot_bytes, snapshot_parts
    from shoal.swarm.state.shards import sha256_hex

    snap = state(7, args.state_mb)

    def node_path() -> tuple[int, int]:
        parts = list(snapshot_parts(snap))  # as node/run/shards.py encodes
        size = sum(len(p) for p in parts)
        shards = erasure.encode_parts(parts, size, args.k, args.m)
        [sha256_hex(s) for s in shards]
        return size, len(shards[0])

    def joined() -> tuple[int, int]:
        blob = snapshot_bytes(snap)
        shards = erasure.encode(blob, args.k, args.m)
        [sha256_hex(s) for s in shards]
        return len(blob), len(shards[0])

    async def main() -> dict:
        gaps: list[float] = []
        done = False

        async def tick() -> None:
            last = time.perf_counter()
            while not done:
                await trio.sleep(0.001)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        def waits(g: list[float]) -> dict:
            return {"max_wait_ms": round(1e3 * max(g), 2),
                    "p99_wait_ms": round(1e3 * sorted(g)[int(0.99 * (len(g) - 1))], 2)}

        runs: dict[str, list[float]] = {"node": [], "joined": []}
        loop: dict[str, list[float]] = {"node": [], "joined": []}
        async with trio.open_nursery() as n:
            n.start_soon(tick)
            await trio.sleep(0.05)
            t_all = time.perf_counter()
            for _ in range(3):
                for name, work in (("node", node_path), ("joined", joined)):
                    gaps.clear()
                    t0 = time.perf_counter()
                    blob_len, shard_len = await trio.to_thread.run_sync(work)
                    runs[name].append(time.perf_counter() - t0)
                    loop[name] += gaps
            gaps.clear()
            await trio.sleep((time.perf_counter() - t_all) / 2)
            done = True
        best = min(runs["node"])
        return {"state_bytes": blob_len, "shard_bytes": shard_len, "encode_s": round(best, 4),
                "encode_s_max": round(max(runs["node"]), 4), "encode_mb_s": round(blob_len / 1e6 / best, 1),
                "joined_encode_s": round(min(runs["joined"]), 4), "loop": waits(loop["node"]),
                "joined_loop": waits(loop["joined"]), "idle_loop": waits(gaps)}

    return trio.run(main)


def markdown(res: dict, cmd: str) -> str:
    a, e = res["args"], res["encode"]
    lines = ["# Rebuilding a stage from shards vs one full pull\n", f"`{cmd}`\n"]
    if "links" in res:
        lines += [f"State {e['state_bytes'] / 1e6:.1f} MB, k = {a['k']}, m = {a['m']} (shards of "
                  f"{e['shard_bytes'] / 1e6:.2f} MB); every link {a['up']} Mbit/s up, {a['down']} Mbit/s down (tbf); "
                  f"{a['skip']} holder(s) skipped.\n",
                  "| trial | k shards in parallel (s) | whole state from one peer (s) | ratio |", "|---|---|---|---|"]
        for t in res["links"]["trials"]:
            lines.append(f"| {t['trial']} | {t['shards_s']} | {t['full_s']} | {t['ratio']} |")
        lines.append(f"\nratio median {res['links']['ratio_median']:.3f}, worst {res['links']['ratio_worst']:.3f} "
                     f"(target <= 0.5)\n")
    lp, jl, il = e["loop"], e["joined_loop"], e["idle_loop"]
    lines += [f"Holder memory: one shard, {e['shard_bytes'] / 1e6:.2f} MB = state / k + "
              f"{e['shard_bytes'] - e['state_bytes'] / a['k']:.0f} bytes of padding (plus its manifest, < 4 KB).\n",
              f"Encoding a {e['state_bytes'] / 1e6:.1f} MB state ({a['k']}+{a['m']} shards, hashes) in a worker thread, "
              "3 times each, alternately, while the event loop ticks every 1 ms:\n",
              "| encoding | time (s), best | loop wait, max (ms) | loop wait, p99 (ms) |", "|---|---|---|---|",
              f"| as the node encodes (parts copied once) | {e['encode_s']} ({e['encode_mb_s']} MB/s) | "
              f"{lp['max_wait_ms']} | {lp['p99_wait_ms']} |",
              f"| from one joined blob (`snapshot_bytes`) | {e['joined_encode_s']} | {jl['max_wait_ms']} | "
              f"{jl['p99_wait_ms']} |",
              f"| none (the loop alone, half as long) | - | {il['max_wait_ms']} | {il['p99_wait_ms']} |"]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--state-mb", type=float, default=20.0)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--m", type=int, default=2)
    p.add_argument("--up", type=float, default=20.0)
    p.add_argument("--down", type=float, default=100.0)
    p.add_argument("--skip", type=int, default=0)
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    p.add_argument("--name", default="shards")
    p.add_argument("--encode-only", action="store_true", help="only the encoding part (no namespaces, no root)")
    args = p.parse_args()
    install_signal_teardown()
    cmd = "python bench/bench_shards.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    res = {"args": {k: v for k, v in vars(args).items() if k != "out"} | {"out": str(args.out)},
           "encode": encode_off_loop(args), "command": cmd}
    if not args.encode_only:
        res["links"] = shaped_links(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(res, indent=1))
    (args.out / f"{args.name}.md").write_text(markdown(res, cmd))
    print(markdown(res, cmd))


if __name__ == "__main__":
    main()
