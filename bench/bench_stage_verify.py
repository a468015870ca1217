"""Verified pipeline stages (docs/verified-stages.md): detection rate and delay, compute overhead, false accusations.

Everything runs shoal's own code in one process on the CPU: a lane of S stages in threads (node.train.lane.LocalLane)
whose stages record their transcripts, a replica of each stage re-executing sampled micro-batches with the step's
weights (node.train.verify.recheck), the verifier's private draw (node.run.verify.StageVerifier.draw), and the
signatures a verified lane's links put on every tensor (swarm.lane.signing).

- Detection: a stage that flips the gradients of a fraction f of its micro-batches (chosen at random per
  micro-batch), M micro-batches per step, each re-executed with probability p. The draw and the tampering are
  simulated over many trials (the draw is the verifier's own function); a sample of real lanes confirms that every
  tampered micro-batch drawn is caught and no honest one is.
- Overhead: one lane's steps with verification on (weights kept each step, transcripts recorded, the sampled
  re-executions run serially after the step: no overlap with training, the worst case) against the same lane with
  it off, alternating, in the same process; plus the signing and checking of every tensor sent.
- False accusations: honest micro-batches re-executed at every stage until 10,000 checks.

    python bench/bench_stage_verify.py --out bench/results/stage_verify.md
    python bench/bench_stage_verify.py --part overhead   # one part at a time, the others' results kept
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from shoal.node.run.verify import StageVerifier
from shoal.node.train.lane import LocalLane
from shoal.node.train.trainer import Trainer
from shoal.node.train.transcript import RecordingBoundary, Transcript
from shoal.node.train.verify import Evidence, recheck, snapshot_params
from shoal.protocol import manifest as mf
from shoal.swarm.lane.signing import sign_tensor, tensor_signed_by
from shoal.swarm.net.identity import peer_id_of


def manifest(stages: int, m: int, d: int, layers: int, seq: int, micro: int) -> mf.RunManifest:
    return mf.RunManifest(
        seed=3, model=mf.ModelSpec(size="custom", n_layers=layers, d_model=d, n_heads=4),
        batch=mf.BatchSpec(batch_size=m * micro, micro_batch_size=micro, seq_len=seq),
        optim=mf.OptimSpec(lr=3e-3, warmup_steps=5, total_steps=100000), eval=mf.EvalSpec(every_steps=0, batches=2),
        plan=mf.ParallelPlan(stages=stages, pipeline=mf.PipelineSpec(compression="none")))


class Flip:
    """A stage's boundary that flips the gradients of the micro-batches `pick(step, micro)` chooses."""

    def __init__(self, inner, pick):
        self.inner, self.pick, self.flipped = inner, pick, set()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def send_grad(self, step, micro, g):
        if self.pick(step, micro):
            self.flipped.add((step, micro))
            g = -g
        self.inner.send_grad(step, micro, g)


class Lane:
    """One lane of S stages in threads with transcripts; `step()` runs one step of every stage."""

    def __init__(self, m: mf.RunManifest, tamper_stage: int | None = None, pick=None, record: bool = True):
        self.m, self.S = m, m.plan.stages
        lane = LocalLane(self.S, timeout_s=120)
        self.trs = [Transcript(keep_steps=3) for _ in range(self.S)]
        self.flip = None
        self.stages = []
        for s in range(self.S):
            b = lane.boundary(s)
            if s == tamper_stage:
                b = self.flip = Flip(b, pick)
            if record:
                b = RecordingBoundary(b, self.trs[s], "fp32")
            self.stages.append(Trainer(m, stage=s, replica=0, boundary=b))
        self.t = 0

    def step(self, keep: bool) -> list[dict]:
        """One step at every stage; with `keep`, each stage's weights at its start."""
        weights = [snapshot_params(st.model) if keep else None for st in self.stages]
        errors = []

        def work(st):
            try:
                st.step()
            except BaseException as e:  # noqa: BLE001
                errors.append(e)
        threads = [threading.Thread(target=work, args=(st,)) for st in self.stages]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        if errors:
            raise errors[0]
        self.t += 1
        return weights

    def evidence(self, stage: int, step: int, micro: int) -> Evidence:
        return Evidence(step=step, micro=micro, prev=self.trs[stage - 1].get(step, micro) if stage else None,
                        next=self.trs[stage + 1].get(step, micro) if stage + 1 < self.S else None,
                        own=self.trs[stage].get(step, micro))


def simulate(p: float, f: float, M: int, steps: int, trials: int, seed: int) -> dict:
    """Trials of a stage tampering each micro-batch with probability f, checked with probability p each (the
    verifier's draw): the share caught within `steps`, and the step of the first catch."""
    rng_t = random.Random(seed)
    v = StageVerifier(me="v", run_id="r", fraction=p, kind="fp32", call=None, penalize=lambda *a: None,
                      rng=random.Random(seed + 1))
    delays = []
    for _ in range(trials):
        for step in range(steps):
            drawn = v.draw(M)
            if any(rng_t.random() < f for _ in drawn):  # a drawn micro-batch was tampered with: caught
                delays.append(step + 1)
                break
    caught = len(delays)
    delays.sort()
    return {"p": p, "f": f, "M": M, "steps": steps, "trials": trials, "caught": caught, "rate": caught / trials,
            "median_steps": delays[len(delays) // 2] if delays else None,
            "p99_steps": delays[min(len(delays) - 1, int(0.99 * trials))] if len(delays) > 0.99 * trials else None,
            "formula_miss": (1 - p * f) ** (M * steps)}


def real_lanes(m: mf.RunManifest, p: float, f: float, steps: int, trials: int, seed: int) -> dict:
    """Real lanes with a stage flipping gradients at rate f, its micro-batches re-executed at rate p by a replica
    of the stage: steps to the first catch, and that every check is right (tampered iff caught)."""
    rng = random.Random(seed)
    delays, wrong, checks = [], 0, 0
    for _ in range(trials):
        lane = Lane(m, tamper_stage=m.plan.stages - 1, pick=lambda step, micro: rng.random() < f)
        ver = Trainer(m, stage=m.plan.stages - 1, replica=0, boundary=LocalLane(m.plan.stages).boundary(m.plan.stages - 1))
        v = StageVerifier(me="v", run_id="r", fraction=p, kind="fp32", call=None, penalize=lambda *a: None,
                          rng=random.Random(rng.random()))
        found = None
        for step in range(steps):
            w = lane.step(keep=True)
            for micro in v.draw(m.batch.batch_size // m.batch.micro_batch_size):
                c = recheck(ver, w[-1], lane.evidence(m.plan.stages - 1, step, micro), "fp32")
                checks += 1
                if c.tampered != ((step, micro) in lane.flip.flipped):
                    wrong += 1
                if c.tampered and found is None:
                    found = step + 1
            if found is not None:
                break
        delays.append(found)
    got = sorted(d for d in delays if d is not None)
    return {"p": p, "f": f, "trials": trials, "steps": steps, "caught": len(got), "checks": checks,
            "wrong_verdicts": wrong, "median_steps": got[len(got) // 2] if got else None, "delays": delays}


def overhead(m: mf.RunManifest, p: float, steps: int, rounds: int) -> dict:
    """Seconds per step of one lane with verification off and on (alternating, same process), and of signing and
    checking the M activations and M gradients each stage boundary carries per step."""
    from concurrent.futures import ThreadPoolExecutor

    M = m.batch.batch_size // m.batch.micro_batch_size
    off, on, bg = Lane(m, record=False), Lane(m, record=True), Lane(m, record=True)
    pool = ThreadPoolExecutor(max_workers=1)  # the runtime's way: checks in a worker beside the next step
    ver = [Trainer(m, stage=s, replica=0, boundary=LocalLane(m.plan.stages).boundary(s)) for s in range(m.plan.stages)]
    v = StageVerifier(me="v", run_id="r", fraction=p, kind="fp32", call=None, penalize=lambda *a: None,
                      rng=random.Random(7))
    t_off, t_on, t_bg, rechecks = [], [], [], 0
    for lane in (off, on, bg):  # warm-up
        lane.step(keep=lane is not off)
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(steps):
            off.step(keep=False)
        t_off.append((time.perf_counter() - t0) / steps)
        t0 = time.perf_counter()
        for _ in range(steps):
            w = on.step(keep=True)
            step = on.t - 1
            for s in range(m.plan.stages):  # each stage's replica checks its draw, serially (no overlap)
                for micro in v.draw(M):
                    recheck(ver[s], w[s], on.evidence(s, step, micro), "fp32")
                    rechecks += 1
        t_on.append((time.perf_counter() - t0) / steps)
        t0, pending = time.perf_counter(), []
        for _ in range(steps):
            w = bg.step(keep=True)
            step = bg.t - 1
            for s in range(m.plan.stages):
                for micro in v.draw(M):
                    pending.append(pool.submit(recheck, ver[s], w[s], bg.evidence(s, step, micro), "fp32"))
        for f in pending:
            f.result()
        t_bg.append((time.perf_counter() - t0) / steps)
    pool.shutdown()
    key = Ed25519PrivateKey.generate()
    peer = peer_id_of(key)
    x = torch.randn(m.batch.micro_batch_size, m.batch.seq_len, m.model.d_model)
    where = dict(run="r" * 64, lane=0, boundary=0, direction="fwd", step=1, micro=0, ids=tuple(range(x.shape[0])))
    t0 = time.perf_counter()
    n = 200
    for _ in range(n):
        sig = sign_tensor(key, x, **where)
        assert tensor_signed_by(peer, sig, x, **where)
    sign_check_s = (time.perf_counter() - t0) / n
    per_step_sign = 2 * M * sign_check_s  # each boundary: M activations and M gradients, signed and checked
    best_off, best_on = min(t_off), min(t_on)
    return {"p": p, "M": M, "stages": m.plan.stages, "steps": steps, "rounds": rounds,
            "step_s_off": t_off, "step_s_on": t_on, "median_off": statistics.median(t_off),
            "median_on": statistics.median(t_on), "best_off": best_off, "best_on": best_on,
            "step_s_overlapped": t_bg, "median_overlapped": statistics.median(t_bg),
            "rechecks": rechecks, "sign_and_check_s_per_tensor": sign_check_s,
            "sign_s_per_step": per_step_sign,
            "overhead": (statistics.median(t_on) + per_step_sign) / statistics.median(t_off) - 1,
            "overhead_overlapped": (statistics.median(t_bg) + per_step_sign) / statistics.median(t_off) - 1}


def false_accusations(m: mf.RunManifest, target: int) -> dict:
    """Honest micro-batches re-executed at every stage of a lane (each stage's forward and backward where it has
    them) until `target` checks; findings counted."""
    lane = Lane(m)
    ver = [Trainer(m, stage=s, replica=0, boundary=LocalLane(m.plan.stages).boundary(s)) for s in range(m.plan.stages)]
    M = m.batch.batch_size // m.batch.micro_batch_size
    checks = findings = 0
    largest = 0.0
    while checks < target:
        w = lane.step(keep=True)
        step = lane.t - 1
        for s in range(m.plan.stages):
            for micro in range(M):
                c = recheck(ver[s], w[s], lane.evidence(s, step, micro), "fp32")
                if c.checked:
                    checks += 1
                    findings += c.tampered
                    largest = max(largest, c.forward_err, c.backward_err)
    return {"checks": checks, "findings": findings, "steps": lane.t, "largest_error": largest}


PARTS = ("detection", "real", "overhead", "false_accusations")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench/results/stage_verify.md")
    ap.add_argument("--p", type=float, default=0.06)
    ap.add_argument("--trials", type=int, default=20000)
    ap.add_argument("--real-trials", type=int, default=5)
    ap.add_argument("--overhead-steps", type=int, default=10)
    ap.add_argument("--overhead-rounds", type=int, default=5)
    ap.add_argument("--checks", type=int, default=10000)
    ap.add_argument("--part", action="append", choices=PARTS,
                    help="run only this part (repeat; default: all), keeping the other parts' results already in "
                         "--out's .json: a long measurement in pieces")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    cmd = "python bench/bench_stage_verify.py " + " ".join(sys.argv[1:] if argv is None else argv)
    small = manifest(2, 8, 32, 2, 32, 2)  # the tests' shape: fast enough for many real lanes
    big = manifest(2, 8, 256, 4, 128, 4)  # a wider stage, for the compute overhead
    runs = {"detection": lambda: [simulate(args.p, 0.10, 8, 100, args.trials, 1),
                                  simulate(args.p, 0.01, 8, 1000, args.trials, 2)],
            "real": lambda: real_lanes(small, args.p, 0.10, 100, args.real_trials, 3),
            "overhead": lambda: overhead(big, args.p, args.overhead_steps, args.overhead_rounds),
            "false_accusations": lambda: false_accusations(replace(small), args.checks)}
    out = Path(args.out)
    kept = json.loads(out.with_suffix(".json").read_text()) if args.part and out.with_suffix(".json").exists() else {}
    res = {"torch_threads": 1, "commands": kept.get("commands", {})}
    for part in PARTS:
        if args.part and part not in args.part:
            res[part] = kept.get(part)
            continue
        t0 = time.perf_counter()
        res[part] = runs[part]()
        res["commands"][part] = f"{cmd} ({time.perf_counter() - t0:.0f} s)"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(res, indent=1))
    missing = [p for p in PARTS if res[p] is None]
    if missing:
        print(f"kept in {out.with_suffix('.json')}; no results yet for {', '.join(missing)}: run --part for each")
        return 0
    cmd = "; ".join(f"{part}: `{c}`" for part, c in res["commands"].items())
    d10, d1 = res["detection"]
    real, ov, fa = res["real"], res["overhead"], res["false_accusations"]
    lines = [
        "# Verified pipeline stages: detection, overhead, false accusations", "", f"Commands: {cmd} (CPU, one torch thread; results also in "
        f"{out.with_suffix('.json').name})", "",
        "## Detection (M = 8 micro-batches per step, each re-executed with probability p)", "",
        "| tampered fraction f | window | p | caught within the window | formula 1-(1-pf)^(M·steps) | median steps to the first catch | p99 |",
        "|---:|---:|---:|---:|---:|---:|---:|"]
    for d in (d10, d1):
        lines.append(f"| {d['f']:.0%} | {d['steps']} steps | {d['p']:.0%} | {d['rate']:.2%} ({d['caught']}/{d['trials']}) | "
                     f"{1 - d['formula_miss']:.2%} | {d['median_steps']} | {d['p99_steps']} |")
    lines += ["", f"Real lanes (S = 2, the tests' model; the last stage flips f = {real['f']:.0%} of its gradients; "
              f"{real['trials']} runs): caught in {real['caught']} of {real['trials']} within {real['steps']} steps, "
              f"steps to the first catch {real['delays']}; {real['checks']} re-executions, {real['wrong_verdicts']} "
              f"wrong verdicts (a tampered micro-batch passed or an honest one failed).", "",
              "## Compute overhead (one lane, S = 2, d = 256, 4 layers, 128 tokens, M = 8 micro-batches of 4)", "",
              f"Seconds per step, median of {ov['rounds']} rounds of {ov['steps']} steps: verification off "
              f"{ov['median_off']:.4f}, on {ov['median_on']:.4f} (weights kept every step, transcripts recorded, "
              f"{ov['rechecks']} re-executions run serially after the steps: the worst case, no overlap with "
              f"training or the pipeline bubble); signing and checking one tensor {ov['sign_and_check_s_per_tensor'] * 1e3:.3f} ms, "
              f"{ov['sign_s_per_step'] * 1e3:.2f} ms per step per boundary. Overhead: **{ov['overhead']:+.1%}** of a step. "
              f"With the re-executions in a worker beside the next step (as the runtime runs them): "
              f"{ov['median_overlapped']:.4f} s per step, **{ov['overhead_overlapped']:+.1%}**.", "",
              "## False accusations (honest lanes, every stage's every micro-batch re-executed)", "",
              f"{fa['checks']} checked micro-batches over {fa['steps']} steps: **{fa['findings']} findings**; the "
              f"largest difference seen was {fa['largest_error']:.3g} of the received tensor's magnitude "
              f"(bit-exact on the CPU).", ""]
    out.write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
