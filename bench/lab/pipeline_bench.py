"""`shoal bench pipeline`: one lane of S stages (S = 1, 2, 4) over real libp2p links on 127.0.0.1, fp32 and fp16
on the wire or AQ-SGD (`--compression`): tokens/s and held-out loss at equal steps, bytes per micro-batch per link
against the formula (with AQ-SGD: over the whole run, first visits included, and in the steady state after the first
epoch of a `train_subset`), and the measured pipeline bubble against GPipe's (S-1)/(M+S-1).

Each stage is a real host with its own link hub and a trainer in its own worker thread (one torch thread), all in
one process, so the stages share this machine's cores: with more stages than cores, compute slows down too, and the
comparison between S values shows the schedule's and the links' cost on one machine, not a speed-up.
"""

from __future__ import annotations

import functools
import json
import logging
import platform
import time
from contextlib import AsyncExitStack
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from shoal.node.train.data import load_corpus
from shoal.node.train.trainer import Trainer
from shoal.protocol import manifest as mf
from shoal.swarm.net.host import HostConfig, open_host
from shoal.swarm.net.penalty import Penalties
from shoal.swarm.lane.aq_codec import group_nbytes
from shoal.swarm.lane.blocking import BlockingLinkEnd
from shoal.swarm.lane.hub import open_link_hub
from shoal.swarm.lane.spec import LaneSpec, LinkConfig

log = logging.getLogger(__name__)
BYTES = {"fp32": 4, "fp16": 2}
#: --compression variants: (fwd bits, bwd bits, first-visit bits, deltas); "direct2" quantizes every visit directly
#: at 2 bits (no buffer: the control AQ-SGD's deltas must beat)
AQ_VARIANTS = {"aqsgd": (4, 8, 8, True), "aqsgd-fv16": (4, 8, 16, True), "aqsgd-fw2bw4": (2, 4, 8, True),
               "direct2": (2, 4, 2, False)}
COMPRESSIONS = ("none", *AQ_VARIANTS)


@dataclass(frozen=True, kw_only=True, slots=True)
class PipelineBenchConfig:
    stages: tuple[int, ...] = (1, 2, 4)
    wire: tuple[str, ...] = ("fp32", "fp16")
    steps: int = 60
    layers: int = 4
    d_model: int = 128
    batch: int = 16
    seq_len: int = 128
    micro_per_stage: int = 4  # M = this x the largest S, for every S: equal micro-batches, so equal losses
    eval_batches: int = 4
    seed: int = 0
    compression: tuple[str, ...] = ("none",)  # with S > 1: "none" (at each --wire dtype) and AQ-SGD variants
    train_subset: int = 0  # samples trained on, epoch after epoch (0: all); AQ-SGD's deltas need samples to return

    def __post_init__(self) -> None:
        if not self.stages or any(s < 1 or s > self.layers for s in self.stages):
            raise ValueError(f"stages must be within 1..{self.layers} (one layer at least per stage)")
        if any(w not in BYTES for w in self.wire) or self.steps < 2:
            raise ValueError("wire dtypes are fp32/fp16 and at least 2 steps are needed")
        if not self.compression or any(x not in COMPRESSIONS for x in self.compression):
            raise ValueError(f"compression: some of {', '.join(COMPRESSIONS)}")
        if self.train_subset and (self.train_subset < self.batch or self.train_subset % self.batch):
            raise ValueError("train_subset must be a multiple of the batch (epochs end on step boundaries)")
        if self.batch % (self.micro_per_stage * max(self.stages)):
            raise ValueError("the batch must split into micro_per_stage x (largest S) micro-batches")


def bench_manifest(c: PipelineBenchConfig, stages: int, wire: str, compression: str = "none") -> mf.RunManifest:
    micro = c.micro_per_stage * max(c.stages)
    if compression == "none":
        pipe = mf.PipelineSpec(compression="none", wire_dtype=wire)
    else:
        fw, bw, fb, _ = AQ_VARIANTS[compression]
        pipe = mf.PipelineSpec(compression="aqsgd", fwd_bits=fw, bwd_bits=bw, first_visit_bits=fb)
    return mf.RunManifest(
        seed=c.seed, model=mf.ModelSpec(size="custom", n_layers=c.layers, d_model=c.d_model, n_heads=4,
                                        tie_embeddings=False),
        batch=mf.BatchSpec(batch_size=c.batch, micro_batch_size=c.batch // micro, seq_len=c.seq_len),
        optim=mf.OptimSpec(lr=3e-3, warmup_steps=min(10, c.steps), total_steps=c.steps),
        eval=mf.EvalSpec(every_steps=0, batches=c.eval_batches), data=mf.DataSpec(train_subset=c.train_subset),
        plan=mf.ParallelPlan(stages=stages, replicas=1, pipeline=pipe))


async def run_lane(m: mf.RunManifest, corpus, steps: int, *, label: str = "", deltas: bool = True,
                   first_steps: int = 1) -> dict:
    """One lane of m.plan.stages stages, `steps` steps and a final evaluation; its measurements."""
    S = m.plan.stages
    async with AsyncExitStack() as stack:
        hosts = []
        for _ in range(S):
            h = await stack.enter_async_context(open_host(Ed25519PrivateKey.generate(), HostConfig()))
            if hosts:
                await h.connect(hosts[-1].addrs[0])
            hosts.append(h)
        peers = [h.peer_id for h in hosts]
        token = trio.lowlevel.current_trio_token()
        trainers, ends = [], []
        for s, h in enumerate(hosts):
            boundary = None
            if S > 1:
                hub = await stack.enter_async_context(open_link_hub(h, Penalties(), LinkConfig()))
                spec = LaneSpec.from_manifest(m, stage=s, lane=0, prev_peer=peers[s - 1] if s else None,
                                              next_peer=peers[s + 1] if s + 1 < S else None,
                                              train_samples=1 << 40, eval_samples=1 << 40)
                if spec.aq is not None and not deltas:
                    spec = replace(spec, aq=replace(spec.aq, deltas=False))
                ends.append(hub.open(spec))
                boundary = BlockingLinkEnd(ends[-1], token)
            trainers.append(Trainer(m, stage=s, replica=0, boundary=boundary, corpus=corpus))
        results: dict[int, list] = {}
        evals: dict[int, float | None] = {}

        def train(s: int, n: int) -> None:
            torch.set_num_threads(1)
            results.setdefault(s, []).extend(trainers[s].step() for _ in range(n))

        def evaluate(s: int) -> None:
            evals[s] = trainers[s].evaluate()

        t0 = time.perf_counter()
        async with trio.open_nursery() as n:  # the first epoch (first visits), then the rest (the steady state)
            for s in range(S):
                n.start_soon(trio.to_thread.run_sync, train, s, first_steps)
        t1 = time.perf_counter()
        early = [e.counters() for e in ends]
        async with trio.open_nursery() as n:
            for s in range(S):
                n.start_soon(trio.to_thread.run_sync, train, s, steps - first_steps)
        wall = time.perf_counter() - t0
        steady_wall = time.perf_counter() - t1
        counters = [e.counters() for e in ends]  # training traffic only: the evaluation comes after
        async with trio.open_nursery() as n:
            for s in range(S):
                n.start_soon(trio.to_thread.run_sync, evaluate, s)
    b = m.batch
    M = b.batch_size // b.micro_batch_size
    steady = [r for s in range(S) for r in results[s][1:]]  # the first step warms up (and dials the links)
    busy = [sum(r.seconds for r in results[s][1:]) for s in range(S)]
    waited = [sum(r.wait_s for r in results[s][1:]) for s in range(S)]
    mb_payload = b.micro_batch_size * b.seq_len * m.model.d_model * BYTES[m.plan.pipeline.wire_dtype]
    p = m.plan.pipeline
    # docs/pipeline.md, "The link protocol": n_first·T·H·fb/8 + n_delta·T·H·b/8 + H fp16 scales per group
    if p.compression == "aqsgd":
        mb_payload = group_nbytes(b.micro_batch_size, b.seq_len, m.model.d_model, p.fwd_bits if deltas
                                  else p.first_visit_bits)
    per_link = []
    for s, c in enumerate(counters):
        fwd = c.get(f"b{s}/fwd")
        if fwd is not None and fwd["sent"]["messages"]:
            bwd, fwd0, bwd0 = c[f"b{s}/bwd"], early[s][f"b{s}/fwd"], early[s][f"b{s}/bwd"]
            late = (steps - first_steps) * M
            per_link.append({"boundary": s, "fwd_wire_bytes_per_micro": fwd["sent"]["wire_bytes"] / (steps * M),
                             "fwd_payload_bytes_per_micro": fwd["sent"]["payload_bytes"] / (steps * M),
                             "bwd_wire_bytes_per_micro": bwd["recv"]["wire_bytes"] / (steps * M),
                             "bwd_payload_bytes_per_micro": bwd["recv"]["payload_bytes"] / (steps * M),
                             "steady_fwd_wire_bytes_per_micro": (fwd["sent"]["wire_bytes"]
                                                                 - fwd0["sent"]["wire_bytes"]) / late,
                             "steady_fwd_payload_bytes_per_micro": (fwd["sent"]["payload_bytes"]
                                                                    - fwd0["sent"]["payload_bytes"]) / late,
                             "steady_bwd_wire_bytes_per_micro": (bwd["recv"]["wire_bytes"]
                                                                 - bwd0["recv"]["wire_bytes"]) / late,
                             "nacks": fwd["recv"]["nacks"]})
    return {
        "stages": S, "micro_batches": M, "wire": label or m.plan.pipeline.wire_dtype, "steps": steps,
        "seconds": round(wall, 2),
        "tokens_per_s": round(steps * b.batch_size * b.seq_len / wall, 1),
        "steady_tokens_per_s": round((steps - first_steps) * b.batch_size * b.seq_len / steady_wall, 1),
        "first_steps": first_steps,
        "heldout_loss": evals[S - 1],
        "final_train_loss": results[S - 1][-1].loss,
        "applied_all": all(r.applied for r in steady),
        "bubble_measured": round(sum(waited) / sum(busy), 4) if S > 1 else 0.0,
        "bubble_gpipe": round((S - 1) / (M + S - 1), 4),
        "payload_bytes_per_micro_formula": mb_payload if S > 1 else 0,
        "links": per_link,
    }


def run(c: PipelineBenchConfig, out: Path, name: str, command: str) -> list[dict]:
    corpus = load_corpus("stdlib", mf.DataSpec().heldout_every)
    rows = []
    first = c.train_subset // c.batch if c.train_subset else 1  # steps of the first epoch (first visits)
    variants = [(w, "none") for w in c.wire if "none" in c.compression] + [
        (c.wire[0], x) for x in c.compression if x != "none"]
    for wire, comp in variants:
        for S in c.stages:
            if S == 1 and (wire, comp) != variants[0]:
                continue  # one stage sends nothing: measured once
            label = wire if comp == "none" else comp
            log.info("pipeline bench: S=%d, %s on the wire", S, label)
            deltas = AQ_VARIANTS[comp][3] if comp != "none" else True
            rows.append(trio.run(functools.partial(run_lane, bench_manifest(c, S, wire, comp), corpus, c.steps,
                                                   label=label, deltas=deltas, first_steps=min(first, c.steps - 1))))
    out.mkdir(parents=True, exist_ok=True)
    doc = {"command": command, "config": {k: getattr(c, k) for k in c.__slots__},
           "machine": f"{platform.machine()} {torch.get_num_threads()} threads, torch {torch.__version__}",
           "rows": rows}
    (out / f"{name}.json").write_text(json.dumps(doc, indent=1))
    (out / f"{name}.md").write_text(markdown(doc))
    return rows


def markdown(doc: dict) -> str:
    c = doc["config"]
    base = next((r for r in doc["rows"] if r["stages"] == 1), None)  # None: no S=1 run (--stages without 1)
    lines = [
        "# shoal bench pipeline", "", f"Command: `{doc['command']}`", "",
        f"One lane of S stages, each a real libp2p host on 127.0.0.1 with its own trainer thread (1 torch thread), all "
        f"in one process on {doc['machine']}: {c['layers']}-layer GPT, d_model {c['d_model']}, untied head, "
        f"{c['batch']} sequences x {c['seq_len']} tokens per step in M = {c['micro_per_stage']} x {max(c['stages'])} "
        f"micro-batches for every S (the same micro-batches in the same order: the held-out loss is the same for every "
        f"S and fp32 wire, the check that splitting changes nothing), "
        f"{c['steps']} steps, seed {c['seed']}. The stages share the machine's cores, so tokens/s compares the "
        f"schedule's and the links' cost on one machine, not a speed-up. Held-out loss: the last stage's over "
        f"{c['eval_batches']} fixed batches after the last step (fp16 on the wire for evaluation).", "",
        "| S | wire | M | tokens/s | vs S=1 | held-out loss | bubble measured | GPipe (S-1)/(M+S-1) | "
        "payload B/micro (formula) | fwd wire B/micro | bwd wire B/micro |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in doc["rows"]:
        link = r["links"][0] if r["links"] else None
        vs_one = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}" if base else "-"
        lines.append(
            f"| {r['stages']} | {r['wire'] if r['stages'] > 1 else '-'} | {r['micro_batches']} | {r['tokens_per_s']:,.0f} "
            f"| {vs_one} | {r['heldout_loss']:.4f} | {r['bubble_measured']:.3f} | {r['bubble_gpipe']:.3f} | "
            + (f"{link['fwd_payload_bytes_per_micro']:,.0f} ({r['payload_bytes_per_micro_formula']:,}) | "
               f"{link['fwd_wire_bytes_per_micro']:,.0f} | {link['bwd_wire_bytes_per_micro']:,.0f} |" if link else
               "- | - | - |"))
    aq = [r for r in doc["rows"] if r["stages"] > 1 and r["links"]]
    if any(r["wire"] in AQ_VARIANTS for r in aq):
        ref = next((r for r in aq if r["wire"] == "fp32"), aq[0])
        lines += ["", "## Bytes per micro-batch and what they would cost on slow links", "",
                  "Whole run (first visits included) and steady state (after the first epoch of the train subset). "
                  "Link time per step = (forward + backward wire bytes of its M micro-batches) x 8 / rate, the links "
                  "not overlapping compute (GPipe sends in its forward and backward phases); the tokens/s at 10 and "
                  "25 Mbit/s are COMPUTED from the loopback step time plus that link time, not measured on shaped "
                  "links.", "",
                  "| S | wire | held-out loss | vs fp32 | fwd wire B/micro (run / steady) | bwd wire B/micro | "
                  "fwd+bwd vs fp32 (steady) | loopback tok/s (run / steady) | CPU vs fp32 (steady tok/s) | "
                  "10 Mbit/s tok/s (x fp32) | 25 Mbit/s tok/s (x fp32) | NACKs |",
                  "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]

        def at(r: dict, mbit: float) -> float:
            link = r["links"][0]
            tokens = c["batch"] * c["seq_len"]
            step_s = tokens / r["steady_tokens_per_s"]
            wire = (link["steady_fwd_wire_bytes_per_micro"] + link["steady_bwd_wire_bytes_per_micro"]) * \
                r["micro_batches"]
            return tokens / (step_s + wire * 8 / (mbit * 1e6))

        for r in aq:
            link, rl = r["links"][0], ref["links"][0]
            both = link["steady_fwd_wire_bytes_per_micro"] + link["steady_bwd_wire_bytes_per_micro"]
            both_ref = rl["steady_fwd_wire_bytes_per_micro"] + rl["steady_bwd_wire_bytes_per_micro"]
            lines.append(
                f"| {r['stages']} | {r['wire']} | {r['heldout_loss']:.4f} | "
                f"{(r['heldout_loss'] / ref['heldout_loss'] - 1) * 100:+.2f} % | "
                f"{link['fwd_wire_bytes_per_micro']:,.0f} / {link['steady_fwd_wire_bytes_per_micro']:,.0f} | "
                f"{link['bwd_wire_bytes_per_micro']:,.0f} | {both / both_ref:.3f} | "
                f"{r['tokens_per_s']:,.0f} / {r['steady_tokens_per_s']:,.0f} | "
                f"{r['steady_tokens_per_s'] / ref['steady_tokens_per_s']:.2f} | "
                f"{at(r, 10):,.0f} ({at(r, 10) / at(ref, 10):.2f}x) | {at(r, 25):,.0f} ({at(r, 25) / at(ref, 25):.2f}x) "
                f"| {link['nacks']} |")
    lines += ["", "Bubble measured: the stages' time blocked on their neighbours over their step time (the "
              "pipeline's idle share plus the links' cost), steps after the first.",
              "Wire bytes per micro-batch include the record, the tensor frame's header and the length prefixes; "
              "forward carries the activations, backward the gradients.", ""]
    return "\n".join(lines)
