"""Benchmark (not a test): what metrics cost a training node. A one-node run of the built-in tiny GPT is trained
by a real `shoal node` process twice per pair, alternately: with metrics off (no endpoint, `--metrics-file none`)
and on (`--metrics` scraped by an HTTP client every 0.5 s — ten times Prometheus's usual 5 s — plus the metrics
file). Steps per second come from the node's status file (the step it reached, timed from step FROM to step TO);
the ratio on/off per pair, and its median, are the result. Writes JSON and Markdown.

    python bench/bench_metrics_cost.py [--pairs 3] [--steps 150] [--out bench/results]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_run(run: Path, home: Path, steps: int, start_step: int, metrics: bool) -> dict:
    status = home / f"status-{metrics}.json"
    status.unlink(missing_ok=True)
    port = free_port()
    args = [sys.executable, "-m", "shoal.node.cli", "node", "--listen", "/ip4/127.0.0.1/tcp/0", "--run", str(run),
            "--steps", str(steps), "--threads", "1", "--status-file", str(status), "--status-interval", "0.5",
            "--print-every", "0"]
    args += ["--metrics", f"127.0.0.1:{port}", "--metrics-file", str(home / "m.jsonl")] if metrics else \
        ["--metrics-file", "none"]
    env = {**os.environ, "SHOAL_HOME": str(home)}
    proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    scrapes, stop = [0], threading.Event()

    def scraper() -> None:
        while not stop.wait(0.5):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read()
                scrapes[0] += 1
            except OSError:
                pass

    th = threading.Thread(target=scraper, daemon=True)
    if metrics:
        th.start()
    marks: dict[str, float] = {}
    try:
        deadline = time.monotonic() + 900
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                step = json.loads(status.read_text()).get("step") or 0
            except (OSError, ValueError):
                step = 0
            now = time.monotonic()
            if step >= start_step and "from" not in marks:
                marks["from"], marks["from_step"] = now, step
            if step >= steps:
                marks["to"], marks["to_step"] = now, step
                break
            time.sleep(0.05)
    finally:
        stop.set()
        proc.terminate()
        proc.wait(timeout=30)
    if "to" not in marks:
        raise RuntimeError(f"the node did not reach step {steps}")
    sps = (marks["to_step"] - marks["from_step"]) / (marks["to"] - marks["from"])
    return {"metrics": metrics, "steps_per_s": round(sps, 3), "scrapes": scrapes[0]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--from-step", type=int, default=20, help="timing starts here (start-up and warm-up before)")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    p.add_argument("--name", default="metrics_cost")
    args = p.parse_args()
    rows, ratios = [], []
    with tempfile.TemporaryDirectory(prefix="shoal-metrics-bench-") as d:
        home = Path(d)
        run = home / "run.toml"
        subprocess.run([sys.executable, "-m", "shoal.node.cli", "run", "create", "--steps", "2000", "--eval-every",
                        "0", "--ckpt-every", "0", "-o", str(run)], check=True, capture_output=True,
                       env={**os.environ, "SHOAL_HOME": str(home)})
        for pair in range(args.pairs):
            off = one_run(run, home, args.steps, args.from_step, metrics=False)
            on = one_run(run, home, args.steps, args.from_step, metrics=True)
            ratios.append(on["steps_per_s"] / off["steps_per_s"])
            rows += [{**off, "pair": pair}, {**on, "pair": pair}]
            print(json.dumps(rows[-2]), json.dumps(rows[-1]), flush=True)
    command = " ".join(["python", "bench/bench_metrics_cost.py", *map(shlex.quote, sys.argv[1:])])
    doc = {"command": command, "python": platform.python_version(), "time": time.strftime("%Y-%m-%d"),
           "on_vs_off_median": round(statistics.median(ratios), 3), "ratios": [round(r, 3) for r in ratios],
           "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(doc, indent=1))
    lines = ["# What metrics cost a training node", "", f"Command: `{command}` ({doc['time']}, Python "
             f"{doc['python']}). One `shoal node` training the built-in tiny GPT alone, steps {args.from_step} to "
             f"{args.steps} timed from its status file; off: no endpoint, no metrics file; on: `--metrics` scraped "
             f"every 0.5 s and the metrics file.", "",
             "| pair | off steps/s | on steps/s | on / off | scrapes |", "|---:|---:|---:|---:|---:|"]
    for i in range(args.pairs):
        off, on = rows[2 * i], rows[2 * i + 1]
        lines.append(f"| {i} | {off['steps_per_s']:.2f} | {on['steps_per_s']:.2f} | {ratios[i]:.3f} | {on['scrapes']} |")
    spread = max(ratios) - min(ratios) if len(ratios) > 1 else 0
    lines += ["", f"Median on / off: **{doc['on_vs_off_median']:.3f}** (pairs spread {spread:.3f}); target: within "
              "noise.", ""]
    (args.out / f"{args.name}.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
