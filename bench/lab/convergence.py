"""`shoal bench convergence`: D replicas on real loopback hosts under each synchronizer; held-out loss and bytes.

Two regimes, each with the same model, data order, seed and number of optimizer steps for every variant:
"scratch" trains from the seeded initialization; "continued" first trains one replica alone for `init_steps`
(the common starting point, as when a run fine-tunes or continues a pretrained model: the setting of CocktailSGD's
and DiLoCo's headline results) and every variant continues from those weights with a fresh schedule.
Two controls frame the compressed variants: "solo" (one replica, no communication: what data parallelism adds) and
per-step model averaging (CocktailSGD with p=1, r=1, 8 bits: the same local-optimizer family with no sparsification,
so the gap it leaves to gradient all-reduce is not the compressor's).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import threading
import time
from contextlib import AsyncExitStack
from dataclasses import dataclass

import torch
import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from shoal.node.train.data import load_corpus
from shoal.bench.poison import poisoner
from shoal.node.sync.base import SyncConfig
from shoal.node.sync.robust import RobustConfig
from shoal.node.sync.factory import make_synchronizer
from shoal.node.train.control import StepControl
from shoal.node.train.trainer import Trainer
from shoal.protocol.manifest import (AllReduceSpec, BatchSpec, CocktailSpec, DilocoSpec, EvalSpec, ModelSpec,
                                     OptimSpec, ParallelPlan, RunManifest, SyncSpec)
from shoal.swarm.run.collective import Collective
from shoal.swarm.run.group import Group
from shoal.swarm.net.host import HostConfig, open_host
from shoal.swarm.net.penalty import Penalties

log = logging.getLogger(__name__)
REGIMES = ("scratch", "continued")


@dataclass(frozen=True, kw_only=True, slots=True)
class BenchConfig:
    steps: int = 1000  # optimizer steps per variant
    init_steps: int = 2000  # the continued regime's pretraining, one replica alone
    regimes: tuple[str, ...] = REGIMES
    replicas: int = 4
    seed: int = 0
    d_model: int = 64
    layers: int = 2
    batch: int = 8  # sequences per replica per step
    seq_len: int = 64
    lr: float = 3e-3
    h: int = 50  # DiLoCo H, fp32 variant
    h_e3m0: int = 100  # DiLoCo H, E3M0 variants
    fragments: int = 2
    overlap: int = 5  # Streaming DiLoCo tau
    alpha: float = 0.5  # Streaming DiLoCo merge
    timeout_s: float = 60.0
    only: tuple[str, ...] = ()
    cocktail: tuple[tuple[float, float, int], ...] = ((0.1, 0.2, 4),)  # (p, r, bits) of each cocktail variant
    warmups: tuple[tuple[int, int], ...] = ()  # (steps, bits): each cocktail variant again after this warm-up
    compare_robust: bool = False  # every networked variant also with robust aggregation off
    poison: float | None = None  # also run each networked variant with replica 0 multiplying its updates by this

    def __post_init__(self) -> None:
        if self.steps < 1 or self.init_steps < 0 or self.replicas < 2:
            raise ValueError("need steps >= 1, init_steps >= 0 and at least 2 replicas")
        if self.poison is not None and self.replicas < 3:
            raise ValueError("a poisoner needs at least 3 replicas (an honest majority)")
        if not self.regimes or set(self.regimes) - set(REGIMES):
            raise ValueError(f"regimes are {', '.join(REGIMES)}")
        for sp, sr, sb in self.cocktail:
            CocktailSpec(p=sp, r=sr, bits=sb, warmup_steps=0)  # raises ValueError on a setting the manifest refuses
        for n, bits in self.warmups:
            CocktailSpec(warmup_steps=n, warmup_bits=bits)


@dataclass(frozen=True, kw_only=True, slots=True)
class Variant:
    label: str
    sync: SyncSpec
    solo: bool = False  # one replica and no synchronizer (a control)


def variants(c: BenchConfig) -> list[Variant]:
    return [
        Variant(label="allreduce fp32", sync=SyncSpec(method="allreduce", allreduce=AllReduceSpec(dtype="fp32"))),
        Variant(label="solo: 1 replica, no communication (control)", sync=SyncSpec(method="none"), solo=True),
        Variant(label="model averaging every step: cocktail p=1 r=1 b=8 (control)",
                sync=SyncSpec(method="cocktail", cocktail=CocktailSpec(p=1.0, r=1.0, bits=8, warmup_steps=0))),
        *(Variant(label=f"cocktail p={sp:g} r={sr:g} b={sb} (no warm-up)",
                  sync=SyncSpec(method="cocktail", cocktail=CocktailSpec(p=sp, r=sr, bits=sb, warmup_steps=0)))
          for sp, sr, sb in c.cocktail),
        *(Variant(label=f"cocktail p={sp:g} r={sr:g} b={sb} (warm-up {n} steps, "
                        f"{'fp32' if wb == 32 else f'{wb}-bit'})",
                  sync=SyncSpec(method="cocktail", cocktail=CocktailSpec(p=sp, r=sr, bits=sb, warmup_steps=n,
                                                                         warmup_bits=wb)))
          for sp, sr, sb in c.cocktail for n, wb in c.warmups),
        Variant(label=f"diloco H={c.h} fp32", sync=SyncSpec(method="diloco", diloco=DilocoSpec(inner_steps=c.h))),
        Variant(label=f"diloco H={c.h_e3m0} E3M0",
                sync=SyncSpec(method="diloco", diloco=DilocoSpec(inner_steps=c.h_e3m0, e3m0=True))),
        Variant(label=f"streaming diloco H={c.h_e3m0} E3M0 P={c.fragments} tau={c.overlap} alpha={c.alpha:g}",
                sync=SyncSpec(method="diloco", diloco=DilocoSpec(inner_steps=c.h_e3m0, e3m0=True, fragments=c.fragments,
                                                                 overlap_steps=c.overlap, merge_alpha=c.alpha))),
    ]


def bench_manifest(c: BenchConfig, sync: SyncSpec, *, steps: int, replicas: int) -> RunManifest:
    return RunManifest(
        seed=c.seed,
        model=ModelSpec(size="custom", n_layers=c.layers, d_model=c.d_model, n_heads=4),
        batch=BatchSpec(batch_size=c.batch, micro_batch_size=c.batch, seq_len=c.seq_len),
        optim=OptimSpec(lr=c.lr, warmup_steps=max(1, steps // 20), total_steps=steps),
        eval=EvalSpec(every_steps=0, batches=16),
        plan=ParallelPlan(replicas=replicas, sync=sync),
    )


def pretrain(c: BenchConfig, corpus) -> dict[str, torch.Tensor]:
    """The continued regime's common starting point: one replica alone for `init_steps` steps."""
    t = Trainer(bench_manifest(c, SyncSpec(method="none"), steps=c.init_steps, replicas=1), corpus=corpus)
    for i in range(c.init_steps):
        t.step()
        if (i + 1) % 500 == 0:
            log.info("pretraining: step %d of %d", i + 1, c.init_steps)
    return {k: v.clone() for k, v in t.model.state_dict().items()}


def run_solo(manifest: RunManifest, corpus, init: dict | None, steps: int) -> dict:
    t = Trainer(manifest, corpus=corpus)
    if init is not None:
        t.model.load_state_dict(init)
    start = t.evaluate()
    t0 = time.perf_counter()
    for _ in range(steps):
        t.step()
    return {"params": sum(p.numel() for p in t.model.parameters()), "start_heldout_loss": start,
            "heldout_loss": t.evaluate(), "bytes_sent_per_node": 0.0, "tensor_bytes_sent_per_node": 0.0,
            "rounds": 0, "state_hashes_equal": True, "seconds": time.perf_counter() - t0}


def bench_key(seed: int, replica: int) -> Ed25519PrivateKey:
    """A replica's identity derived from the seed: the same peer ids every run, so chunk ownership (and with it each
    owner's summation order and outlier-clip reference) and hence the numbers repeat for the same seed."""
    return Ed25519PrivateKey.from_private_bytes(hashlib.sha256(f"shoal-bench/{seed}/{replica}".encode()).digest())


async def run_variant(manifest: RunManifest, corpus, init: dict | None, *, steps: int, replicas: int,
                      timeout_s: float, robust: bool = True, poison: float | None = None) -> dict:
    """One configuration: `replicas` hosts and trainer threads in this process, all traffic on 127.0.0.1. With
    `poison`, replica 0 multiplies every contribution it sends by it, and the losses are the honest replicas'."""
    async with AsyncExitStack() as stack:
        hosts = []
        for i in range(replicas):
            join = (hosts[0].addrs[0],) if hosts else ()
            sh = await stack.enter_async_context(open_host(bench_key(manifest.seed, i), HostConfig(join=join)))
            await sh.bootstrap()
            hosts.append(sh)
        for i, h in enumerate(hosts):
            for o in hosts[i + 1:]:
                if o.peer_id not in h.connected_peers():
                    await h.connect(o.addrs[0])
        members = tuple(sorted(h.peer_id for h in hosts))
        token = trio.lowlevel.current_trio_token()
        colls, syncs, trainers = [], [], []
        for i, h in enumerate(hosts):
            pen = Penalties()
            coll = Collective(h, pen)
            s = make_synchronizer(manifest, exchange=coll.blocking(token), penalties=pen,
                                  config=SyncConfig(round_timeout_s=timeout_s, robust=RobustConfig(enabled=robust)))
            if poison is not None and i == 0:
                s.fault = poisoner(poison)
            t = Trainer(manifest, replica=i, synchronizer=s, corpus=corpus)
            if init is not None:
                t.model.load_state_dict(init)
            colls.append(coll)
            syncs.append(s)
            trainers.append(t)
        start_eval = trainers[0].evaluate()

        groups = Groups(manifest.run_id, members)

        def train(i: int) -> None:
            t, me = trainers[i], hosts[i].peer_id
            for _ in range(steps):
                control = StepControl(step=t.step_count, group=groups.group(me, t.step_count))
                t.step(control)
                groups.report(me, control.offenders)
            control = StepControl(step=t.step_count, group=groups.group(me, t.step_count))
            t.close(control)
            groups.report(me, control.offenders)

        t0 = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for i in range(replicas):
                nursery.start_soon(trio.to_thread.run_sync, train, i)
        seconds = time.perf_counter() - t0
        honest = range(1 if poison is not None else 0, replicas)
        evals = [trainers[i].evaluate() for i in honest]
        return {
            "robust": robust, "poison": poison,
            "left_out_share": sum(syncs[i].robust_left_out for i in honest) /
            max(1, sum(syncs[i].robust_checked for i in honest)),
            "params": sum(p.numel() for p in trainers[0].model.parameters()),
            "start_heldout_loss": start_eval,
            "heldout_loss": sum(evals) / len(evals),
            "heldout_loss_per_replica": evals,
            "bytes_sent_per_node": sum(c.bytes_sent for c in colls) / replicas,
            "tensor_bytes_sent_per_node": sum(s.bytes_sent for s in syncs) / replicas,
            "rounds": syncs[-1].rounds,
            "evicted_at_step": groups.evicted_at,
            "state_hashes_equal": len({syncs[i].state_hash() for i in honest}) == 1,
            "seconds": seconds,
        }


class Groups:
    """The broker's part of a bench run: the group by step, and a member evicted once most of the others reported
    it an offender, from two steps past the furthest replica (the broker's rule and switch step). Trainer threads
    call it between their steps."""

    def __init__(self, run_id: str, members: tuple[str, ...]):
        self.run_id = run_id
        self.epochs = [(0, members)]  # (first step, members); the epoch number is the index
        self.reports: dict[str, set[str]] = {}
        self.steps: dict[str, int] = {}
        self.evicted_at: int | None = None
        self._lock = threading.Lock()

    def group(self, me: str, step: int) -> Group:
        with self._lock:
            self.steps[me] = step
            epoch = max(e for e, (start, _) in enumerate(self.epochs) if start <= step)
            members = self.epochs[epoch][1]
            return Group(run_id=self.run_id, epoch=epoch, members=members if me in members else (me,), me=me)

    def report(self, reporter: str, offenders) -> None:
        with self._lock:
            members = self.epochs[-1][1]
            for p in sorted(offenders):
                who = self.reports.setdefault(p, set())
                who.add(reporter)
                if p in members and len(who) > (len(members) - 1) // 2:
                    self.evicted_at = max(self.steps.values()) + 2
                    members = tuple(m for m in members if m != p)
                    self.epochs.append((self.evicted_at, members))


def run_regime(c: BenchConfig, regime: str, corpus, init: dict | None) -> list[dict]:
    rows = []
    for v in variants(c):
        if c.only and v.label != "allreduce fp32" and not any(o in v.label for o in c.only):
            continue
        log.info("convergence (%s): %s", regime, v.label)
        if v.solo:
            r = run_solo(bench_manifest(c, v.sync, steps=c.steps, replicas=1), corpus, init, c.steps)
            rows.append({"regime": regime, "variant": v.label, "method": v.sync.method, "control": True, **r})
            continue
        m = bench_manifest(c, v.sync, steps=c.steps, replicas=c.replicas)
        for robust, poison in arms(c):
            log.info("convergence (%s): %s, robust %s, poison %s", regime, v.label, robust, poison)
            r = trio.run(lambda: run_variant(m, corpus, init, steps=c.steps, replicas=c.replicas,
                                             timeout_s=c.timeout_s, robust=robust, poison=poison))
            label = v.label + ("" if robust else " [robust off]") + \
                (f" [poisoner x{poison:g}]" if poison is not None else "")
            rows.append({"regime": regime, "variant": label, "method": v.sync.method,
                         "control": "control" in v.label or poison is not None or not robust, **r})
    base = rows[0]
    gain = base["start_heldout_loss"] - base["heldout_loss"]
    for r in rows:
        r["x_fewer_bytes"] = base["bytes_sent_per_node"] / r["bytes_sent_per_node"] if r["bytes_sent_per_node"] \
            else None
        r["loss_vs_allreduce_pct"] = 100 * (r["heldout_loss"] / base["heldout_loss"] - 1)
        r["share_of_allreduce_gain"] = (r["start_heldout_loss"] - r["heldout_loss"]) / gain if gain > 0 else None
    return rows


def arms(c: BenchConfig) -> list[tuple[bool, float | None]]:
    """(robust aggregation on, poison factor) of each run of a networked variant; the first is the baseline."""
    robust = (True, False) if c.compare_robust else (True,)
    return [(r, None) for r in robust] + ([(r, c.poison) for r in robust] if c.poison is not None else [])


def run_all(c: BenchConfig) -> list[dict]:
    torch.set_num_threads(1)
    corpus = load_corpus("stdlib", 20)
    rows = []
    for regime in c.regimes:
        init = pretrain(c, corpus) if regime == "continued" and c.init_steps else None
        rows += run_regime(c, regime, corpus, init)
    return rows


def targets(rows: list[dict]) -> list[str]:
    """The issue's targets, checked per regime on the non-control variants."""
    out = []
    for regime in REGIMES:  # a variant that never synchronized in this run (rounds 0) has nothing to judge
        rs = [r for r in rows if r["regime"] == regime and not r["control"] and r["x_fewer_bytes"] is not None]
        if not rs:
            continue
        for r in rs:
            if r["method"] == "cocktail":
                ok = r["x_fewer_bytes"] >= 100 and r["loss_vs_allreduce_pct"] <= 2
                out.append(f"{regime}: {r['variant']}: {r['x_fewer_bytes']:.0f}x fewer bytes (target >= 100x), "
                           f"held-out loss {r['loss_vs_allreduce_pct']:+.2f}% vs all-reduce (target <= +2%): "
                           f"{'met' if ok else 'NOT met'}")
        dl = [r for r in rs if r["method"] == "diloco"]
        if dl:
            met = [r for r in dl if r["x_fewer_bytes"] >= 500 and r["loss_vs_allreduce_pct"] <= 3]
            out.append(f"{regime}: a DiLoCo variant with >= 500x fewer bytes and held-out loss <= +3%: "
                       f"{'met by ' + ', '.join(r['variant'] for r in met) if met else 'NOT met'}")
    return out


def markdown(result: dict) -> str:
    c = result["config"]
    rows = result["rows"]
    lines = ["# shoal bench convergence", "", f"Command: `{result['command']}`", "",
             f"D={c['replicas']} replicas, each a real libp2p host on 127.0.0.1 in one process with its own training "
             f"thread; {c['steps']} optimizer steps per variant; same model ({rows[0]['params']:,} parameters: "
             f"{c['layers']} layer(s), d_model {c['d_model']}), data (stdlib corpus, {c['batch']} x {c['seq_len']} "
             f"bytes per replica per step), AdamW lr {c['lr']:g} with warm-up and cosine decay, seed {c['seed']} "
             f"for every variant. Held-out loss: mean over replicas of 16 held-out batches after the last step. "
             f"Bytes: everything a node wrote on collective streams (frames and headers), mean over nodes. "
             f"Share of gain: (held-out loss before - after) / the same for all-reduce. Robust aggregation (norm "
             f"equalisation and direction check at each chunk owner, node/sync/robust.py) is on unless a row says "
             f"[robust off]; left out: the share of other members' contributions its direction check left out; "
             f"a member most others report is evicted (the broker's rule) from two steps past the furthest replica. "
             f"[poisoner xF]: replica 0 multiplies every contribution it sends by F; losses and hashes are then the "
             f"honest replicas'. {result['machine']}.", ""]
    for regime in REGIMES:
        rs = [r for r in rows if r["regime"] == regime]
        if not rs:
            continue
        what = ("from the seeded initialization" if regime == "scratch" else
                f"continuing from one replica trained alone for {c['init_steps']} steps (fresh schedule)")
        lines += [f"## {regime}: {what}", "",
                  f"Held-out loss before: {rs[0]['start_heldout_loss']:.4f}.", "",
                  "| variant | held-out loss | vs all-reduce | share of gain | bytes sent / node | x fewer bytes | "
                  "rounds | hashes equal | left out | attacker evicted at step | s |",
                  "|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|"]
        for r in rs:
            share = f"{r['share_of_allreduce_gain']:.2f}" if r["share_of_allreduce_gain"] is not None else "-"
            fewer = f"{r['x_fewer_bytes']:.0f}" if r["x_fewer_bytes"] is not None else "-"
            lines.append(f"| {r['variant']} | {r['heldout_loss']:.4f} | {r['loss_vs_allreduce_pct']:+.2f}% | {share} | "
                         f"{r['bytes_sent_per_node']:,.0f} | {fewer} | {r['rounds']} | "
                         f"{'yes' if r['state_hashes_equal'] else 'NO'} | {_left_out(r)} | "
                         f"{_evicted(r)} | {r['seconds']:.0f} |")
        lines.append("")
    lines += ["## Targets", ""] + [f"- {t}" for t in result["targets"]]
    return "\n".join(lines) + "\n"


def _left_out(r: dict) -> str:
    return f"{100 * r['left_out_share']:.1f}%" if r.get("robust") else "-"


def _evicted(r: dict) -> str:
    """The step from which the group went on without the attacker (most members reported it); "never" if not."""
    if r.get("poison") is None:
        return "-" if r.get("evicted_at_step") is None else f"{r['evicted_at_step']} (an honest member!)"
    return "never" if r.get("evicted_at_step") is None else str(r["evicted_at_step"])


def config_dict(c: BenchConfig) -> dict:
    return {f.name: getattr(c, f.name) for f in dataclasses.fields(c)}
