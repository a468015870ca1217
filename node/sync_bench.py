"""`shoal bench convergence`: D replicas on real loopback hosts under each synchronizer; held-out loss and bytes."""

from __future__ import annotations

import logging
import time
from contextlib import AsyncExitStack
from dataclasses import dataclass

import torch
import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from shoal.node.data import load_corpus
from shoal.node.sync_base import SyncConfig
from shoal.node.sync_factory import make_synchronizer
from shoal.node.trainer import Trainer
from shoal.protocol.manifest import (AllReduceSpec, BatchSpec, CocktailSpec, DilocoSpec, EvalSpec, ModelSpec,
                                     OptimSpec, ParallelPlan, RunManifest, SyncSpec)
from shoal.swarm.collective import Collective
from shoal.swarm.group import Group
from shoal.swarm.host import HostConfig, open_host
from shoal.swarm.penalty import Penalties

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class Variant:
    label: str
    sync: SyncSpec


def variants(h: int, h_e3m0: int, fragments: int) -> list[Variant]:
    return [
        Variant(label="allreduce fp32", sync=SyncSpec(method="allreduce", allreduce=AllReduceSpec(dtype="fp32"))),
        Variant(label="cocktail p=0.1 r=0.2 b=4 (no warm-up)",
                sync=SyncSpec(method="cocktail", cocktail=CocktailSpec(p=0.1, r=0.2, bits=4, warmup_steps=0))),
        Variant(label=f"diloco H={h} fp32", sync=SyncSpec(method="diloco", diloco=DilocoSpec(inner_steps=h))),
        Variant(label=f"diloco H={h_e3m0} E3M0",
                sync=SyncSpec(method="diloco", diloco=DilocoSpec(inner_steps=h_e3m0, e3m0=True))),
        Variant(label=f"streaming diloco H={h_e3m0} E3M0 P={fragments}",
                sync=SyncSpec(method="diloco", diloco=DilocoSpec(inner_steps=h_e3m0, e3m0=True, fragments=fragments))),
    ]


def bench_manifest(sync: SyncSpec, *, steps: int, replicas: int, seed: int, d_model: int, layers: int) -> RunManifest:
    return RunManifest(
        seed=seed,
        model=ModelSpec(size="custom", n_layers=layers, d_model=d_model, n_heads=4),
        batch=BatchSpec(batch_size=8, micro_batch_size=8, seq_len=64),
        optim=OptimSpec(lr=3e-3, warmup_steps=max(1, steps // 20), total_steps=steps),
        eval=EvalSpec(every_steps=0, batches=16),
        plan=ParallelPlan(replicas=replicas, sync=sync),
    )


async def run_variant(manifest: RunManifest, corpus, *, steps: int, replicas: int, timeout_s: float) -> dict:
    """One configuration: `replicas` hosts and trainer threads in this process, all traffic on 127.0.0.1."""
    async with AsyncExitStack() as stack:
        hosts = []
        for i in range(replicas):
            join = (hosts[0].addrs[0],) if hosts else ()
            sh = await stack.enter_async_context(open_host(Ed25519PrivateKey.generate(), HostConfig(join=join)))
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
            grp = Group(run_id=manifest.run_id, epoch=0, members=members, me=h.peer_id)
            s = make_synchronizer(manifest, collective=coll, group_fn=lambda g=grp: g, trio_token=token,
                                  penalties=pen, config=SyncConfig(round_timeout_s=timeout_s))
            colls.append(coll)
            syncs.append(s)
            trainers.append(Trainer(manifest, replica=i, synchronizer=s, corpus=corpus))
        start_eval = trainers[0].evaluate()
        losses: list[list[float]] = [[] for _ in range(replicas)]

        def train(i: int) -> None:
            for _ in range(steps):
                losses[i].append(trainers[i].step().loss)
            syncs[i].close(trainers[i].model)

        t0 = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for i in range(replicas):
                nursery.start_soon(trio.to_thread.run_sync, train, i)
        seconds = time.perf_counter() - t0
        evals = [t.evaluate() for t in trainers]
        hashes = {s.state_hash() for s in syncs}
        return {
            "params": sum(p.numel() for p in trainers[0].model.parameters()),
            "start_heldout_loss": start_eval,
            "heldout_loss": sum(evals) / len(evals),
            "heldout_loss_per_replica": evals,
            "final_train_loss": sum(sum(l[-10:]) / len(l[-10:]) for l in losses) / replicas,
            "bytes_sent_per_node": sum(c.bytes_sent for c in colls) / replicas,
            "tensor_bytes_sent_per_node": sum(s.bytes_sent for s in syncs) / replicas,
            "rounds": syncs[0].rounds,
            "state_hashes_equal": len(hashes) == 1,
            "seconds": seconds,
        }


def run_all(*, steps: int, replicas: int, seed: int, d_model: int, layers: int, h: int, h_e3m0: int,
            fragments: int, timeout_s: float, only: list[str] | None = None) -> list[dict]:
    torch.set_num_threads(1)
    corpus = load_corpus("stdlib", 20)
    rows = []
    for v in variants(h, h_e3m0, fragments):
        if only and not any(o in v.label for o in only):
            continue
        m = bench_manifest(v.sync, steps=steps, replicas=replicas, seed=seed, d_model=d_model, layers=layers)
        log.info("convergence: %s", v.label)
        r = trio.run(lambda: run_variant(m, corpus, steps=steps, replicas=replicas, timeout_s=timeout_s))
        rows.append({"variant": v.label, "method": v.sync.method, **r})
    base = rows[0] if rows and rows[0]["method"] == "allreduce" else None
    for r in rows:
        if base:
            r["x_fewer_bytes"] = base["bytes_sent_per_node"] / max(r["bytes_sent_per_node"], 1.0)
            r["loss_vs_allreduce_pct"] = 100 * (r["heldout_loss"] / base["heldout_loss"] - 1)
    return rows


def targets(rows: list[dict]) -> list[str]:
    by = {r["method"]: [] for r in rows}
    for r in rows:
        by[r["method"]].append(r)
    out = []
    if "x_fewer_bytes" not in rows[0]:
        return ["no all-reduce baseline in this run: targets not checked"]
    for r in by.get("cocktail", []):
        ok = r["x_fewer_bytes"] >= 100 and r["loss_vs_allreduce_pct"] <= 2
        out.append(f"{r['variant']}: {r['x_fewer_bytes']:.0f}x fewer bytes (target >= 100x), held-out loss "
                   f"{r['loss_vs_allreduce_pct']:+.2f}% vs all-reduce (target <= +2%): {'met' if ok else 'NOT met'}")
    dl = by.get("diloco", [])
    if dl:
        met = [r for r in dl if r["x_fewer_bytes"] >= 500 and r["loss_vs_allreduce_pct"] <= 3]
        for r in dl:
            out.append(f"{r['variant']}: {r['x_fewer_bytes']:.0f}x fewer bytes, held-out loss "
                       f"{r['loss_vs_allreduce_pct']:+.2f}% vs all-reduce")
        out.append(f"a DiLoCo variant with >= 500x fewer bytes and held-out loss <= +3%: "
                   f"{'met by ' + ', '.join(r['variant'] for r in met) if met else 'NOT met'}")
    return out


def markdown(result: dict) -> str:
    c = result["config"]
    lines = ["# shoal bench convergence", "", f"Command: `{result['command']}`", "",
             f"D={c['replicas']} replicas, each a real libp2p host on 127.0.0.1 in one process with its own training "
             f"thread; {c['steps']} optimizer steps, same model ({result['rows'][0]['params']:,} parameters: "
             f"{c['layers']} layer(s), d_model {c['d_model']}), data (stdlib corpus, 8 x 64 bytes per replica "
             f"per step), seed {c['seed']} for every variant. Held-out loss: mean over replicas of {16} held-out "
             f"batches after the last step. Bytes: everything a node wrote on collective streams (frames and "
             f"headers), mean over nodes. {result['machine']}.", "",
             "| variant | held-out loss | vs all-reduce | bytes sent / node | x fewer bytes | rounds | hashes equal | s |",
             "|---|---:|---:|---:|---:|---:|---|---:|"]
    for r in result["rows"]:
        lines.append(f"| {r['variant']} | {r['heldout_loss']:.4f} | {r.get('loss_vs_allreduce_pct', 0):+.2f}% | "
                     f"{r['bytes_sent_per_node']:,.0f} | {r.get('x_fewer_bytes', 1):.0f} | {r['rounds']} | "
                     f"{'yes' if r['state_hashes_equal'] else 'NO'} | {r['seconds']:.0f} |")
    lines += ["", f"Held-out loss before training: {result['rows'][0]['start_heldout_loss']:.4f}.", "",
              "## Targets", ""] + [f"- {t}" for t in result["targets"]]
    lines += ["", "Scale caveat: a few hundred steps of a tiny model on one 2-core machine; the issue's targets are "
              "stated for real runs, and DiLoCo with large H is expected to lag more over so few outer rounds."]
    return "\n".join(lines) + "\n"
