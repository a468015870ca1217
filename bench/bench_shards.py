"""Rebuilding a stage from k erasure-coded shards in parallel vs pulling the whole state from one peer, on shaped
home links (network namespaces + tbf; needs root), plus a holder's memory and the encoder's cost off the event loop.

Run: python bench/bench_shards.py [--state-mb 20] [--k 4] [--m 2] [--up 20] [--down 100] [--trials 3]
Writes shards.json and shards.md (with this command) into --out (default bench/results).

- links: every peer has a home link of --up Mbit/s upload and --down Mbit/s download (tbf per direction); the k
  shards come from k holders at once (each upload carries state/k), the whole state from one holder (one upload
  carries it all). The puller skips --skip holders (as if lost with the stage). Trials alternate the two.
- encode: the encoder's work on this machine (blob, k + m shards, hashes) in a worker thread while the event loop
  ticks every millisecond: its time, and the longest the loop waited meanwhile.
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
    """The encoder's work in a worker thread (as node/run/shards.py runs it) while a trio task ticks every ms."""
    from shoal.bench.shard_peer import state
    from shoal.swarm.state import erasure
    from shoal.swarm.state.blob import snapshot_bytes
    from shoal.swarm.state.shards import sha256_hex

    snap = state(7, args.state_mb)

    def work() -> tuple[int, int]:
        blob = snapshot_bytes(snap)
        shards = erasure.encode(blob, args.k, args.m)
        [sha256_hex(s) for s in shards]
        return len(blob), len(shards[0])

    async def main() -> dict:
        gaps, done, out = [], False, {}

        async def tick() -> None:
            last = time.perf_counter()
            while not done:
                await trio.sleep(0.001)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        def waits(g: list[float]) -> tuple[float, float]:
            return round(1e3 * max(g), 2), round(1e3 * sorted(g)[int(0.99 * (len(g) - 1))], 2)

        async with trio.open_nursery() as n:
            n.start_soon(tick)
            await trio.sleep(0.05)
            runs = []
            t_all = time.perf_counter()
            for _ in range(3):
                t0 = time.perf_counter()
                blob_len, shard_len = await trio.to_thread.run_sync(work)
                runs.append(time.perf_counter() - t0)
            busy, gaps[:] = list(gaps), []
            # the same loop as long again with no encoding: what this (shared) machine does to a 1 ms tick anyway
            await trio.sleep(time.perf_counter() - t_all)
            done = True
        idle = list(gaps)
        out.update(state_bytes=blob_len, shard_bytes=shard_len, encode_s=round(min(runs), 4),
                   encode_s_max=round(max(runs), 4), encode_mb_s=round(blob_len / 1e6 / min(runs), 1))
        (out["loop_max_wait_ms"], out["loop_p99_wait_ms"]), (out["idle_max_wait_ms"], out["idle_p99_wait_ms"]) = \
            waits(busy), waits(idle)
        return out

    return trio.run(main)


def markdown(res: dict, cmd: str) -> str:
    a, e = res["args"], res["encode"]
    lines = [f"# Rebuilding a stage from shards vs one full pull\n", f"`{cmd}`\n",
             f"State {e['state_bytes'] / 1e6:.1f} MB, k = {a['k']}, m = {a['m']} (shards of {e['shard_bytes'] / 1e6:.2f} MB); "
             f"every link {a['up']} Mbit/s up, {a['down']} Mbit/s down (tbf); {a['skip']} holder(s) skipped.\n",
             "| trial | k shards in parallel (s) | whole state from one peer (s) | ratio |", "|---|---|---|---|"]
    for t in res["links"]["trials"]:
        lines.append(f"| {t['trial']} | {t['shards_s']} | {t['full_s']} | {t['ratio']} |")
    lines += [f"\nratio median {res['links']['ratio_median']:.3f}, worst {res['links']['ratio_worst']:.3f} "
              f"(target <= 0.5)\n",
              f"Holder memory: one shard, {e['shard_bytes'] / 1e6:.2f} MB = state / k + "
              f"{e['shard_bytes'] - e['state_bytes'] / a['k']:.0f} bytes of padding (plus its manifest, < 4 KB).\n",
              f"Encoding (blob, {a['k']}+{a['m']} shards, hashes) in a worker thread: {e['encode_s']} s "
              f"({e['encode_mb_s']} MB/s, slowest of 3 {e['encode_s_max']} s); the event loop meanwhile waited at most "
              f"{e['loop_max_wait_ms']} ms (p99 {e['loop_p99_wait_ms']} ms) for a 1 ms tick; as long again with no "
              f"encoding: at most {e['idle_max_wait_ms']} ms (p99 {e['idle_p99_wait_ms']} ms)."]
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
    args = p.parse_args()
    install_signal_teardown()
    cmd = "python bench/bench_shards.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    res = {"args": {k: v for k, v in vars(args).items() if k != "out"} | {"out": str(args.out)},
           "encode": encode_off_loop(args), "links": shaped_links(args), "command": cmd}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(res, indent=1))
    (args.out / f"{args.name}.md").write_text(markdown(res, cmd))
    print(markdown(res, cmd))


if __name__ == "__main__":
    main()
