"""An open crowd, measured on one machine with real node processes on 127.0.0.1.

  join     a volunteer's `shoal node --join ADDR` (fresh identity, nothing else) to its first applied step, 5 times,
           in a run below its maximum (median and worst)
  elastic  a run of 2 lanes grows to 4 as volunteers join and shrinks to 2 as they leave: per step the lanes, the
           sequences each computed, the global batch (constant) and whether the state hashes agree; per shape the
           step time and sequences per second (every node under its own CPU quota, needs root)
  hetero   two replicas throttled to a 2:1 speed ratio (CPU quotas, cgroup v1 cpu controller): step time with the
           even split the run starts with vs the speed-proportional split it moves to, in the same run
  curve    the held-out loss at a fixed global batch computed by 2 and by 4 replicas (same steps)

Run: python bench/bench_crowd.py PART [--out bench/results]   (hetero needs root)
Writes crowd_PART.json and crowd_PART.md (with this command) into --out.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from shoal.bench.command import write_results
from shoal.node.localswarm import LocalSwarm, LocalSwarmConfig
from shoal.protocol import manifest as mf
from shoal.swarm.net.identity import load_or_create_identity

SHOAL = [sys.executable, "-m", "shoal.node.cli"]
CGROUP = Path("/sys/fs/cgroup/cpu")


def write_run(workdir: Path, *, replicas: int, max_replicas: int, global_batch: int, min_replicas: int = 1,
              seq_len: int = 64, eval_every: int = 0, steps: int = 100000) -> Path:
    workdir.mkdir(parents=True, exist_ok=True)
    m = mf.RunManifest(
        name="crowd bench", seed=7, model=mf.ModelSpec.preset("tiny"),
        batch=mf.BatchSpec(batch_size=max(4, global_batch // replicas), micro_batch_size=4, seq_len=seq_len,
                           global_batch=global_batch),
        optim=mf.OptimSpec(lr=3e-3, warmup_steps=20, total_steps=steps),
        eval=mf.EvalSpec(every_steps=eval_every, batches=8),
        plan=mf.ParallelPlan(replicas=replicas, min_replicas=min_replicas, max_replicas=max_replicas,
                             sync=mf.SyncSpec(method="allreduce")))
    path = workdir / "run.toml"
    path.write_text(m.signed(load_or_create_identity(workdir / "node0.key")).to_toml())
    return path


def swarm(workdir: Path, nodes: int, run: Path, *extra: str) -> LocalSwarm:
    args = ("--run", str(run), "--threads", "1", "--round-timeout", "10", "--fail-after", "8", *extra)
    return LocalSwarm(LocalSwarmConfig(nodes=nodes, workdir=workdir, home=workdir / "home", status_interval_s=0.25,
                                       gone_after_s=6.0, extra_node_args=args))


class Volunteer:
    """`shoal node --join ADDR` with a fresh identity and nothing else (a status file and its output aside)."""

    def __init__(self, workdir: Path, name: str, join: str, *extra: str):
        self.status_file, self.out = workdir / f"{name}.json", workdir / f"{name}.out"
        self.status_file.unlink(missing_ok=True)
        self.t0 = time.monotonic()
        with open(self.out, "w") as f:
            self.proc = subprocess.Popen(
                [*SHOAL, "node", "--join", join, "--identity", str(workdir / f"{name}.key"), "--listen",
                 "/ip4/127.0.0.1/tcp/0", "--status-file", str(self.status_file), "--status-interval", "0.25",
                 "--threads", "1", *extra],
                stdout=f, stderr=subprocess.STDOUT, env={**os.environ, "SHOAL_HOME": str(workdir / "home")})

    def status(self) -> dict:
        try:
            return json.loads(self.status_file.read_text())
        except (OSError, ValueError):
            return {}

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def wait(pred, timeout_s: float, what: str, poll_s: float = 0.1):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        got = pred()
        if got:
            return got
        time.sleep(poll_s)
    raise TimeoutError(f"{what}: not within {timeout_s} s")


def training(s: LocalSwarm, n: int, steps: int) -> bool:
    rows = [r for r in s.summary() if r["alive"] and r.get("slot")]
    return len(rows) >= n and min(r.get("step") or 0 for r in rows) >= steps


class StepLog:
    """Per step, what each node's status file says it computed (its share) and the state hash after it."""

    def __init__(self) -> None:
        self.samples: dict[int, dict[str, int]] = {}
        self.hashes: dict[int, dict[str, str]] = {}
        self.times: dict[str, list[tuple[float, int]]] = {}

    def poll(self, docs: dict[str, dict]) -> None:
        now = time.monotonic()
        for name, d in docs.items():
            for k, v in (d.get("recent_samples") or {}).items():
                self.samples.setdefault(int(k), {})[name] = v
            for k, v in (d.get("recent_hashes") or {}).items():
                self.hashes.setdefault(int(k) - 1, {})[name] = v  # the hash after step k - 1
            if d.get("step") is not None:
                self.times.setdefault(name, []).append((now, d["step"]))

    def rows(self) -> list[dict]:
        out = []
        for step in sorted(self.samples):
            got = self.samples[step]
            hs = {h for n, h in self.hashes.get(step, {}).items() if n in got}
            out.append({"step": step, "lanes": len(got), "samples": dict(sorted(got.items())),
                        "global_batch": sum(got.values()), "hashes_agree": len(hs) == 1 if hs else None})
        return out


def docs_of(s: LocalSwarm, volunteers: dict[str, Volunteer]) -> dict[str, dict]:
    docs = {f"node{n.index}": n.status() or {} for n in s.nodes if n.alive}
    docs.update({k: v.status() for k, v in volunteers.items() if v.proc.poll() is None})
    return docs


# -- join latency ------------------------------------------------------------------------------------------------
def part_join(args, workdir: Path) -> dict:
    run = write_run(workdir, replicas=2, max_replicas=8, global_batch=32)
    s = swarm(workdir, 2, run)
    trials = []
    try:
        s.start()
        wait(lambda: training(s, 2, 5), 180, "two lanes training")
        join = s.bootstrap_addrs()[0]
        for i in range(args.trials):
            v = Volunteer(workdir, f"v{i}", join)
            done = wait(lambda: (v.status().get("samples_done") or 0) > 0 and time.monotonic(), 180,
                        f"volunteer {i}'s first applied step")
            st = v.status()
            trials.append({"trial": i, "seconds": round(done - v.t0, 2), "slot": st.get("slot"),
                           "entered_at_step": (st.get("entries") or [{}])[0].get("step"),
                           "pull_s": (st.get("entries") or [{}])[0].get("seconds")})
            print(f"join {i}: {trials[-1]}", flush=True)
            v.stop()
            time.sleep(args.settle)  # the run shrinks back: the next volunteer again joins below the maximum
    finally:
        s.stop()
    secs = [t["seconds"] for t in trials]
    return {"trials": trials, "median_s": statistics.median(secs), "worst_s": max(secs),
            "setup": "2 replicas (max 8) training the tiny GPT, global batch 32, allreduce; each volunteer a fresh "
                     "identity typing `shoal node --join ADDR`; timed from its process start to its status file "
                     "showing a sequence of an applied step (polled every 0.1 s, written every 0.25 s)"}


def md_join(r: dict) -> list[str]:
    lines = [f"Join latency: median **{r['median_s']:.1f} s**, worst **{r['worst_s']:.1f} s** of "
             f"{len(r['trials'])} ({r['setup']}).", "", "| trial | seconds | slot | entered at step | state pull s |",
             "|---:|---:|---|---:|---:|"]
    lines += [f"| {t['trial']} | {t['seconds']:.1f} | {t['slot']} | {t['entered_at_step']} | {t['pull_s']} |"
              for t in r["trials"]]
    return lines


# -- elasticity --------------------------------------------------------------------------------------------------
def part_elastic(args, workdir: Path) -> dict:
    quotas = args.elastic_cpu > 0
    if quotas and (os.geteuid() != 0 or not CGROUP.exists()):
        raise SystemExit("elastic --elastic-cpu needs root and the cgroup v1 cpu controller (or --elastic-cpu 0)")
    gb = args.elastic_batch
    run = write_run(workdir, replicas=2, min_replicas=2, max_replicas=4, global_batch=gb)
    pace = () if quotas else ("--min-step-time", "0.15")
    s = swarm(workdir, 2, run, *pace)
    log, vols, groups = StepLog(), {}, []
    events: list[tuple[int, str]] = []
    phases: list[dict] = []  # each shape of the run: its lanes and the wall-clock window it held

    def limit(name: str, pid: int) -> None:
        if quotas:  # every node its own slice of a core: a volunteer brings its own compute, as on its own machine
            groups.append(quota(f"shoal-crowd-{name}-{os.getpid()}", args.elastic_cpu, pid))

    def watch(seconds: float, lanes: int) -> None:
        t0 = time.monotonic()
        end = t0 + seconds
        while time.monotonic() < end:
            log.poll(docs_of(s, vols))
            time.sleep(0.2)
        phases.append({"lanes": lanes, "t0": t0, "t1": time.monotonic()})

    def top() -> int:
        return max((d.get("step") or 0) for d in docs_of(s, vols).values())

    try:
        s.start()
        for n in s.nodes:
            limit(f"node{n.index}", n.proc.pid)
        wait(lambda: training(s, 2, 5), 300, "two lanes training")
        join = s.bootstrap_addrs()[0]
        watch(args.phase_s, 2)
        for k, name in enumerate(("v1", "v2")):
            events.append((top(), f"{name} joins"))
            vols[name] = Volunteer(workdir, name, join, *pace)
            limit(name, vols[name].proc.pid)
            wait(lambda: (vols[name].status().get("samples_done") or 0) > 0, 300, f"{name} training")
            watch(args.phase_s, 3 + k)
        for k, name in enumerate(("v2", "v1")):
            events.append((top(), f"{name} leaves"))
            vols.pop(name).stop()
            watch(args.phase_s, 3 - k)
    finally:
        for v in vols.values():
            v.stop()
        s.stop()
        release(groups)
    rows = [r for r in log.rows() if r["lanes"] > 0]
    times = log.times["node0"]
    for ph in phases:  # steps per second at node 0 in the window's second half (the change settled)
        mid = (ph["t0"] + ph["t1"]) / 2
        pts = [(t, st) for t, st in times if mid <= t <= ph["t1"]]
        ph["step_s"] = (pts[-1][0] - pts[0][0]) / (pts[-1][1] - pts[0][1]) \
            if len(pts) >= 2 and pts[-1][1] > pts[0][1] else None
        ph["sequences_per_s"] = gb / ph["step_s"] if ph["step_s"] else None
        del ph["t0"], ph["t1"]
    return {"rows": rows, "events": events, "phases": phases, "global_batch": gb,
            "setup": f"min 2, max 4 lanes of the tiny GPT, global batch {gb} sequences of 64 tokens, allreduce, "
                     + (f"every node process under a CPU quota of {args.elastic_cpu:g} core (cgroup v1 cfs "
                        f"quota: each volunteer brings its own compute, as on its own machine)" if quotas else
                        "steps paced to >= 0.15 s")
                     + "; volunteers v1, v2 join with `shoal node --join ADDR` and leave with SIGTERM, "
                       f"{args.phase_s:g} s in each shape"}


def md_elastic(r: dict) -> list[str]:
    rows, gb = r["rows"], r["global_batch"]
    complete = [x for x in rows if x["global_batch"] == gb]
    lines = [r["setup"] + ".", "",
             "| shape (in order) | lanes | seconds per step | sequences per second |", "|---|---:|---:|---:|"]
    for i, ph in enumerate(r["phases"]):
        st, sps = ph["step_s"], ph["sequences_per_s"]
        lines.append(f"| {i + 1} | {ph['lanes']} | {st:.3f} | {sps:.1f} |" if st else
                     f"| {i + 1} | {ph['lanes']} | n/a | n/a |")
    lines += ["", "(node 0's steps over the second half of each shape's window.)", "",
              f"{len(rows)} steps seen; every step's shares summed to {sorted({x['global_batch'] for x in rows})} "
              f"(a step whose lanes' files were not all caught shows less); hashes agreed at "
              f"{sum(x['hashes_agree'] is True for x in rows)} of {sum(x['hashes_agree'] is not None for x in rows)} "
              f"steps with a hash from every lane; {len(complete)} steps with all lanes seen.", "",
              "Events: " + "; ".join(f"step ~{s}: {e}" for s, e in r["events"]), "",
              "| steps | lanes | sequences per lane (node: n) | global batch | hashes agree |", "|---|---:|---|---:|---|"]
    run: list[dict] = []

    def flush() -> None:
        if run:
            a, b = run[0], run[-1]
            agree = all(x["hashes_agree"] is not False for x in run)
            lines.append(f"| {a['step']}–{b['step']} | {a['lanes']} | "
                         f"{', '.join(f'{k}: {v}' for k, v in a['samples'].items())} | {a['global_batch']} | "
                         f"{'yes' if agree else 'NO'} |")

    for x in complete:
        if run and (x["samples"] != run[-1]["samples"] or x["step"] != run[-1]["step"] + 1):
            flush()
            run = []
        run.append(x)
    flush()
    return lines


# -- a heterogeneous split ---------------------------------------------------------------------------------------
def quota(name: str, cpus: float, pid: int) -> Path:
    d = CGROUP / name
    d.mkdir(exist_ok=True)
    (d / "cpu.cfs_period_us").write_text("100000")
    (d / "cpu.cfs_quota_us").write_text(str(int(cpus * 100000)))
    (d / "cgroup.procs").write_text(str(pid))
    return d


def release(groups: list[Path]) -> None:
    """Remove the CPU-quota cgroups (each empties once its processes have exited)."""
    for g in groups:
        for _ in range(50):
            try:
                g.rmdir()
                break
            except OSError:
                time.sleep(0.1)


def step_time(times: list[tuple[float, int]], lo: int, hi: int) -> float | None:
    pts = [(t, s) for t, s in times if lo <= s <= hi]
    if len(pts) < 2 or pts[-1][1] == pts[0][1]:
        return None
    return (pts[-1][0] - pts[0][0]) / (pts[-1][1] - pts[0][1])


def part_hetero(args, workdir: Path) -> dict:
    if os.geteuid() != 0 or not CGROUP.exists():
        raise SystemExit("hetero needs root and the cgroup v1 cpu controller at /sys/fs/cgroup/cpu")
    run = write_run(workdir, replicas=2, min_replicas=2, max_replicas=2, global_batch=48, seq_len=128)
    s = swarm(workdir, 2, run, "--split-every", str(args.even_s))
    log, groups = StepLog(), []
    try:
        s.start()
        groups = [quota(f"shoal-crowd-fast-{os.getpid()}", args.cpu, s.nodes[0].proc.pid),
                  quota(f"shoal-crowd-slow-{os.getpid()}", args.cpu / 2, s.nodes[1].proc.pid)]
        wait(lambda: training(s, 2, 3), 300, "two lanes training")
        resplit_at = None
        end = time.monotonic() + args.even_s + args.split_s + 60
        while time.monotonic() < end:
            log.poll(docs_of(s, {}))
            shares = {tuple(sorted(x["samples"].values())) for x in log.rows()[-3:] if x["lanes"] == 2}
            if resplit_at is None and any(a != b for a, b in shares):
                resplit_at = min(x["step"] for x in log.rows() if x["lanes"] == 2
                                 and len(set(x["samples"].values())) > 1)
                end = time.monotonic() + args.split_s
            time.sleep(0.2)
        speeds = {f"node{n.index}": (n.status() or {}).get("samples_per_s") for n in s.nodes}
    finally:
        s.stop()
        release(groups)
    if resplit_at is None:
        raise SystemExit("the split never changed: see the nodes' logs in " + str(workdir))
    rows = log.rows()
    even = [x for x in rows if x["lanes"] == 2 and x["step"] < resplit_at]
    split = [x for x in rows if x["lanes"] == 2 and x["step"] >= resplit_at + 3]
    times = log.times["node0"]
    t_even = step_time(times, even[len(even) // 4]["step"], even[-1]["step"])
    t_split = step_time(times, split[0]["step"], split[-1]["step"])
    return {"cpu_quota": {"node0": args.cpu, "node1": args.cpu / 2}, "speeds_reported": speeds,
            "even": {"steps": [even[0]["step"], even[-1]["step"]], "shares": even[-1]["samples"],
                     "step_s": t_even},
            "split": {"steps": [split[0]["step"], split[-1]["step"]], "shares": split[-1]["samples"],
                      "step_s": t_split},
            "speedup": t_even / t_split if t_even and t_split else None,
            "setup": f"2 replicas of the tiny GPT (seq 128), global batch 48, allreduce, --threads 1, CPU quotas "
                     f"{args.cpu:g} and {args.cpu / 2:g} of a core (cgroup v1 cfs quota); the run starts with the "
                     f"even split and re-splits by measured speed after --split-every {args.even_s:g} s; step time "
                     f"from node 0's status file (its step over time), the first quarter of the even window left "
                     f"out (warm-up)"}


def md_hetero(r: dict) -> list[str]:
    sp = r["speedup"]
    return [r["setup"] + ".", "",
            "| split | steps | sequences per replica | seconds per step |", "|---|---|---|---:|",
            f"| even | {r['even']['steps'][0]}–{r['even']['steps'][1]} | {r['even']['shares']} | "
            f"{r['even']['step_s']:.3f} |",
            f"| by speed | {r['split']['steps'][0]}–{r['split']['steps'][1]} | {r['split']['shares']} | "
            f"{r['split']['step_s']:.3f} |", "",
            f"Speeds the nodes reported (sequences/s of their own compute): {r['speeds_reported']}.", "",
            f"Steps are **{sp:.2f}x** shorter with the speed-proportional split (target >= 1.3x at 2:1): "
            f"{'met' if sp >= 1.3 else 'NOT met'}."]


# -- the loss curve at a fixed global batch ------------------------------------------------------------------------
def part_curve(args, workdir: Path) -> dict:
    out = {}
    for n in (2, 4):
        wd = workdir / f"d{n}"
        run = write_run(wd, replicas=n, max_replicas=n, global_batch=32, eval_every=args.steps // 4,
                        steps=args.steps)
        s = swarm(wd, n, run, "--steps", str(args.steps))
        try:
            s.start()
            wait(lambda: sum(r.get("state") == "done" for r in s.summary()) == n, 3600,
                 f"{n} replicas to finish", poll_s=1.0)
            rows = [r for r in s.summary() if r.get("slot")]
            out[n] = {"eval_loss": [r.get("eval_loss") for r in rows], "loss": [r.get("loss") for r in rows],
                      "hashes": sorted({r.get("state_hash") for r in rows})}
        finally:
            s.stop()
        print(f"{n} replicas: {out[n]}", flush=True)
    a, b = out[2]["eval_loss"][0], out[4]["eval_loss"][0]
    return {"steps": args.steps, "replicas": out, "relative_difference": abs(a - b) / a,
            "setup": f"the tiny GPT, global batch 32 sequences of 64 tokens, allreduce, {args.steps} steps, "
                     f"held-out loss over 8 batches at the last step"}


def md_curve(r: dict) -> list[str]:
    d = r["relative_difference"]
    return [r["setup"] + ".", "", "| replicas | held-out loss at the end | replicas' hashes |", "|---:|---:|---:|",
            *(f"| {n} | {v['eval_loss'][0]:.4f} | {len(v['hashes'])} |" for n, v in r["replicas"].items()), "",
            f"Relative difference **{100 * d:.3f} %** (target within 1 %): {'met' if d <= 0.01 else 'NOT met'}."]


PARTS = {"join": (part_join, md_join), "elastic": (part_elastic, md_elastic), "hetero": (part_hetero, md_hetero),
         "curve": (part_curve, md_curve)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("part", choices=sorted(PARTS))
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    p.add_argument("--trials", type=int, default=5, help="join: volunteers, one after the other")
    p.add_argument("--settle", type=float, default=10.0, help="join: seconds after a volunteer leaves")
    p.add_argument("--phase-s", type=float, default=25.0, help="elastic: seconds in each shape")
    p.add_argument("--elastic-cpu", type=float, default=0.45,
                   help="elastic: each node's share of a core (0: no quotas, steps paced instead)")
    p.add_argument("--elastic-batch", type=int, default=48, help="elastic: the global batch")
    p.add_argument("--cpu", type=float, default=0.5, help="hetero: the fast replica's share of a core")
    p.add_argument("--even-s", type=float, default=90.0, help="hetero: seconds of the even split first")
    p.add_argument("--split-s", type=float, default=90.0, help="hetero: seconds measured after the re-split")
    p.add_argument("--steps", type=int, default=200, help="curve: steps per run")
    args = p.parse_args()
    run, md = PARTS[args.part]
    with tempfile.TemporaryDirectory(prefix="shoal-crowd-") as d:
        t0 = time.monotonic()
        result = run(args, Path(d))
    result["command"] = " ".join(["python", "bench/bench_crowd.py", *map(shlex.quote, sys.argv[1:])])
    result["wall_s"] = round(time.monotonic() - t0, 1)
    result["machine"] = f"{os.cpu_count()} CPUs (shared)"
    text = "\n".join([f"# bench_crowd: {args.part}", "", f"Command: `{result['command']}` "
                      f"({result['wall_s']:.0f} s on {result['machine']})", "", *md(result)]) + "\n"
    write_results(args.out, f"crowd_{args.part}", result, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
