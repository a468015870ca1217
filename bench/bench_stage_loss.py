"""A stage that loses its only node, rebuilt from erasure-coded shards: S = 2 stages, D = 1 lane, m = 2 parity
shards, node processes on 127.0.0.1; SIGKILL of the stage's only node, then the time until its lane trains again.

Run: python bench/bench_stage_loss.py [--trials 5] [--fail-after 8] [--snapshot-every 20]
Writes stage_loss.json and stage_loss.md (with this command) into --out (default bench/results).

Five node processes: the two stages of the lane and three backups (two keep the victim's stage warm, one the
other's), so the victim's stage has 4 shard holders outside it: k = 2, m = 2. Each trial starts a fresh swarm,
waits until the victim's stage has shards placed, SIGKILLs the victim (the stage node that is not the broker's),
and records from the status files: the seconds until both stages of the lane report a step past the revision they
rolled back to, the rebuilt state's hash against the one the victim placed, each holder's shard bytes against
state / k, and the encoder's time against the training time between two snapshots.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

from shoal.node.localswarm import LocalSwarm, LocalSwarmConfig
from shoal.protocol import manifest as mf
from shoal.swarm.net.identity import load_or_create_identity


def wait(pred, timeout_s: float, what: str):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        got = pred()
        if got:
            return got
        time.sleep(0.05)
    raise TimeoutError(what)


def statuses(s: LocalSwarm) -> dict[int, dict]:
    return {n.index: (n.status() or {}) for n in s.nodes if n.alive}


class Held:
    """What the status files said while the swarm trained before the kill: per stage, the most shard bytes one holder
    kept (peak: with a revision being written beside the committed one; steady: one revision), and each node's
    (time, step) at first and last sight."""

    def __init__(self) -> None:
        self.peak: dict[str, int] = {}
        self.steady: dict[str, int] = {}
        self.peak_revs: dict[str, int] = {}
        self.steps: dict[int, list[tuple[float, int]]] = {}
        self.samples = 0

    def sample(self, sts: dict[int, dict]) -> None:
        self.samples += 1
        now = time.monotonic()
        for i, st in sts.items():
            rec = st.get("recovery") or {}
            for stage, nbytes in (rec.get("shards_held_bytes_by_stage") or {}).items():
                revs = sum(1 for h in rec.get("shards_held") or [] if str(h[0]) == stage)
                self.peak[stage] = max(self.peak.get(stage, 0), nbytes)
                self.peak_revs[stage] = max(self.peak_revs.get(stage, 0), revs)
                if revs == 1:
                    self.steady[stage] = max(self.steady.get(stage, 0), nbytes)
            if st.get("step"):
                first_last = self.steps.setdefault(i, [(now, st["step"])] * 2)
                if st["step"] != first_last[1][1]:
                    first_last[1] = (now, st["step"])

    def step_s(self, i: int) -> float:
        (t0, s0), (t1, s1) = self.steps[i][0], self.steps[i][-1]
        return (t1 - t0) / (s1 - s0)


def trial(args, n: int) -> dict:
    with tempfile.TemporaryDirectory() as d:
        wd = Path(d) / "w"
        wd.mkdir()
        m = mf.RunManifest(
            seed=n, model=mf.ModelSpec(size="custom", n_layers=2, d_model=64, n_heads=4),
            batch=mf.BatchSpec(batch_size=8, micro_batch_size=4, seq_len=64),
            optim=mf.OptimSpec(lr=3e-3, warmup_steps=5, total_steps=100_000), eval=mf.EvalSpec(every_steps=0, batches=2),
            plan=mf.ParallelPlan(stages=2, replicas=1),
            checkpoint=mf.CheckpointSpec(every_steps=100, snapshot_every_steps=args.snapshot_every, parity=2))
        (wd / "run.toml").write_text(m.signed(load_or_create_identity(wd / "node0.key")).to_toml())
        extra = ("--run", str(wd / "run.toml"), "--threads", "1", "--round-timeout", "10", "--fail-after",
                 str(args.fail_after), "--checkpoint-dir", str(wd / "ckpt"), "--min-step-time", str(args.step_s))
        s = LocalSwarm(LocalSwarmConfig(nodes=5, workdir=wd, home=Path(d) / "h", extra_node_args=extra))
        try:
            s.start()
            wait(lambda: sum(1 for st in statuses(s).values() if st.get("slot")) == 2, 120, "two stages seated")
            seen = Held()

            def placed_twice():
                sts = statuses(s)
                seen.sample(sts)
                return next((i for i, st in sts.items() if st.get("slot") and i != 0
                             and ((st.get("recovery") or {}).get("shards_placed") or 0) >= 2 * args.snapshot_every),
                            None)

            victim = wait(placed_twice, 240, "the victim's shards placed")
            vst = s.nodes[victim].status()
            slot, placed = vst["slot"], vst["recovery"]["shards_placed"]
            encodes = vst["recovery"]["encodes"]
            placed_hash = next(e["hash"] for e in encodes if e["revision"] == placed)
            state_bytes, k, shard_bytes = encodes[-1]["state_bytes"], encodes[-1]["k"], encodes[-1]["shard_bytes"]
            stage = slot.split("r")[0][1:]
            step_s = seen.step_s(victim)  # measured between the first steps seen and now (paced to >= --step-s)
            t_kill, kill_wall = time.monotonic(), time.time()
            s.nodes[victim].proc.send_signal(signal.SIGKILL)

            def trained_again():
                sts = statuses(s)
                lane = [st for st in sts.values() if st.get("slot") in ("s0r0", "s1r0")]
                if len(lane) != 2:
                    return None
                rolled = [e for st in lane for e in st.get("entries", []) if "rollback" in str(e.get("source"))]
                if len(rolled) < 2:
                    return None
                rev = rolled[-1]["step"]
                return (time.monotonic() - t_kill, rev) if all((st.get("step") or 0) > rev + 1 for st in lane) \
                    else None

            took, rev = wait(trained_again, args.timeout, "the lane to train again")
            rep = next(st for st in statuses(s).values() if st.get("slot") == slot)
            rb = rep["recovery"]["rebuilds"][-1]
            return {"trial": n, "seconds": round(took, 2), "killed_at": round(kill_wall, 3), "victim": victim, "victim_slot": slot, "placed": placed,
                    "rolled_back_to": rev, "source": rb["source"], "hash_equal": rb["hash"] == placed_hash,
                    "rebuild_s": rb.get("seconds"), "state_bytes": state_bytes, "k": k, "shard_bytes": shard_bytes,
                    "per_holder_limit": state_bytes / k, "status_samples": seen.samples,
                    "holder_steady_bytes_max": seen.steady.get(stage, 0), "holder_peak_bytes_max": seen.peak.get(stage, 0),
                    "holder_peak_revisions": seen.peak_revs.get(stage, 0),
                    "step_s": round(step_s, 4), "encodes": [[e["revision"], e["encode_s"], e["push_s"]] for e in encodes],
                    "encodes_skipped": vst["recovery"].get("encodes_skipped"),
                    "encode_s": max(e["encode_s"] for e in encodes), "push_s": max(e["push_s"] for e in encodes),
                    "encode_share": round(max(e["encode_s"] for e in encodes) / (args.snapshot_every * step_s), 5)}
        finally:
            s.stop()
            if args.keep is not None:  # the nodes' logs and last status files, to read a trial afterwards
                keep = args.keep / f"trial-{n}"
                keep.mkdir(parents=True, exist_ok=True)
                for f in [*wd.glob("node*.log"), *wd.glob("node*.out"), *wd.glob("node*.json")]:
                    shutil.copy2(f, keep / f.name)


def markdown(res: dict, cmd: str) -> str:
    rows = res["trials"]
    lines = ["# A stage that lost its only node, rebuilt from shards (S=2, D=1, m=2)\n", f"`{cmd}`\n",
             "| trial | kill -> lane trains again (s) | rebuilt revision | source | hash = placed | rebuild (s) | "
             "holder bytes / (state/k): one revision, peak | step (s) | encode (s), worst | worst encode / training "
             "between snapshots | all encodes / training up to the placed revision | revisions skipped |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lim = r["per_holder_limit"]
        lines.append(f"| {r['trial']} | {r['seconds']} | {r['rolled_back_to']} | {r['source']} | {r['hash_equal']} | "
                     f"{r['rebuild_s']} | {r['holder_steady_bytes_max'] / lim:.4f}, {r['holder_peak_bytes_max'] / lim:.4f}"
                     f" | {r['step_s']} | {r['encode_s']} | {100 * r['encode_share']:.3f} % | "
                     f"{100 * amortized(r):.3f} % | {r['encodes_skipped']} |")
    worst = max(r["seconds"] for r in rows)
    lines.append(f"\nworst of {len(rows)}: {worst} s (target <= 60 s); every rebuilt state hash-identical to the placed "
                 f"revision: {all(r['hash_equal'] for r in rows)}")
    return "\n".join(lines) + "\n"


def amortized(r: dict) -> float:
    """Every encoding the victim's status lists, against the training up to the newest of them (step time measured)."""
    return sum(e[1] for e in r["encodes"]) / (max(e[0] for e in r["encodes"]) * r["step_s"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--fail-after", type=float, default=8.0)
    p.add_argument("--snapshot-every", type=int, default=20)
    p.add_argument("--step-s", type=float, default=0.2, help="pace: every step takes at least this long")
    p.add_argument("--timeout", type=float, default=180.0)
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    p.add_argument("--keep", type=Path, default=None, help="copy every trial's node logs and status files here")
    args = p.parse_args()
    cmd = "python bench/bench_stage_loss.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    rows = []
    for n in range(args.trials):
        rows.append(trial(args, n))
        print(json.dumps(rows[-1]), flush=True)
    res = {"command": cmd, "trials": rows, "worst_s": max(r["seconds"] for r in rows),
           "median_s": statistics.median(r["seconds"] for r in rows)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "stage_loss.json").write_text(json.dumps(res, indent=1))
    (args.out / "stage_loss.md").write_text(markdown(res, cmd))
    print(markdown(res, cmd))


if __name__ == "__main__":
    main()
