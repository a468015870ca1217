"""Recovery times of a training swarm: SIGKILL an active node, then the broker; measure until training resumes.

Run: python bench/bench_recovery.py [--fail-after 8] [--round-timeout 10] [--repeats 3]
(writes bench/results/recovery.{json,md}). Four node processes on 127.0.0.1 (3 active replicas with CocktailSGD +
1 backup), the tiny test model; the kill comes once the backup holds a warm copy, as in any swarm that has run a
while, and the promoted backup's pull (bytes of the run's state it fetched) is recorded.
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

from shoal.node.localswarm import LocalSwarm, LocalSwarmConfig
from shoal.protocol import manifest as mf
from shoal.swarm.net.identity import load_or_create_identity


def active(s):
    return [r for r in s.summary() if r["alive"] and r.get("slot")]


def wait(pred, timeout_s):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if pred():
            return time.monotonic() - t0
        time.sleep(0.05)
    raise TimeoutError


def trial(victim_is_broker: bool, args) -> dict:
    with tempfile.TemporaryDirectory() as d:
        wd = Path(d) / "w"
        wd.mkdir()
        m = mf.RunManifest(seed=3, model=mf.ModelSpec(size="custom", n_layers=2, d_model=64, n_heads=4),
                           batch=mf.BatchSpec(batch_size=8, micro_batch_size=8, seq_len=64),
                           optim=mf.OptimSpec(lr=3e-3, warmup_steps=5, total_steps=100_000),
                           eval=mf.EvalSpec(every_steps=0, batches=4),
                           plan=mf.ParallelPlan(replicas=3, sync=mf.SyncSpec(method="cocktail",
                                                                             cocktail=mf.CocktailSpec(warmup_steps=0))))
        (wd / "run.toml").write_text(m.signed(load_or_create_identity(wd / "node0.key")).to_toml())
        extra = ("--run", str(wd / "run.toml"), "--threads", "1", "--round-timeout", str(args.round_timeout),
                 "--fail-after", str(args.fail_after), "--backup-refresh", str(args.backup_refresh))
        s = LocalSwarm(LocalSwarmConfig(nodes=4, workdir=wd, home=Path(d) / "h", extra_node_args=extra))
        try:
            s.start()
            wait(lambda: len(active(s)) == 3 and min(r.get("step") or 0 for r in active(s)) >= 20, 180)
            backup = next(r["index"] for r in s.summary() if r.get("role") == "backup")
            wait(lambda: (s.nodes[backup].status() or {}).get("warm_revision") is not None, 180)
            victim = 0 if victim_is_broker else next(r["index"] for r in active(s) if r["index"] != 0)
            survivors = [r["index"] for r in active(s) if r["index"] != victim]
            steps = {r["index"]: r.get("step") or 0 for r in s.summary()}
            s.nodes[victim].proc.send_signal(signal.SIGKILL)
            t0 = time.monotonic()

            def step(i):
                return (s.nodes[i].status() or {}).get("step") or 0

            wait(lambda: all(step(i) >= steps[i] + 10 for i in survivors), 300)  # past any buffered round
            resumed = time.monotonic() - t0
            wait(lambda: any(r["index"] == backup for r in active(s)), 300)
            promoted = time.monotonic() - t0
            wait(lambda: (st := s.nodes[backup].status() or {}).get("state") == "training"
                 and (st.get("step") or 0) > 0, 300)
            full = time.monotonic() - t0
            entry = ((s.nodes[backup].status() or {}).get("entries") or [{}])[-1]
            return {"killed": "broker (also active in s0r0)" if victim_is_broker else "active replica",
                    "survivors_training_again_s": round(resumed, 2), "backup_in_the_slot_s": round(promoted, 2),
                    "group_full_again_s": round(full, 2), "entry_step": entry.get("step"),
                    "bytes_pulled": entry.get("bytes_pulled"), "state_bytes": entry.get("state_bytes"),
                    "pull_s": entry.get("seconds")}
        finally:
            s.stop()


def summary(vals: list[float]) -> str:
    return f"{statistics.median(vals):.2f} ({min(vals):.2f}-{max(vals):.2f})"


def main() -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fail-after", type=float, default=8.0)
    p.add_argument("--round-timeout", type=float, default=10.0)
    p.add_argument("--backup-refresh", type=float, default=5.0, help="how often the backup refreshes its warm copy")
    p.add_argument("--repeats", type=int, default=3, help="trials of each kill")
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    args = p.parse_args()
    command = "python " + " ".join(shlex.quote(a) for a in sys.argv)
    rows = [trial(broker, args) for broker in (False, True) for _ in range(args.repeats)]
    res = {"command": command, "fail_after_s": args.fail_after, "round_timeout_s": args.round_timeout,
           "backup_refresh_s": args.backup_refresh, "trials": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "recovery.json").write_text(json.dumps(res, indent=1) + "\n")
    md = ["# recovery of a training swarm (4 processes on 127.0.0.1, 3 active + 1 backup, CocktailSGD)\n",
          f"Command: `{command}`\n",
          f"Failure detection: `--fail-after {args.fail_after}` (broker liveness and lease), "
          f"`--round-timeout {args.round_timeout}` (a synchronization phase); the backup refreshes its warm copy "
          f"every {args.backup_refresh} s. Times from SIGKILL, median (min-max) of {args.repeats} trials each. "
          "Pulled: bytes of the run's state the promoted backup fetched at its entry step, of the whole state.\n",
          "| killed | survivors 10 steps further (s) | backup in the slot (s) | group full again (s) | pulled |",
          "|---|---|---|---|---|"]
    for killed in sorted({r["killed"] for r in rows}, reverse=True):
        rs = [r for r in rows if r["killed"] == killed]
        shares = [r["bytes_pulled"] / r["state_bytes"] for r in rs if r.get("state_bytes")]
        pulled = (f"{statistics.median(r['bytes_pulled'] for r in rs if r.get('state_bytes')):,.0f} of "
                  f"{rs[0]['state_bytes']:,} bytes ({100 * statistics.median(shares):.0f}%)") if shares else "-"
        md.append(f"| {killed} | {summary([r['survivors_training_again_s'] for r in rs])} | "
                  f"{summary([r['backup_in_the_slot_s'] for r in rs])} | "
                  f"{summary([r['group_full_again_s'] for r in rs])} | {pulled} |")
    (args.out / "recovery.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
