"""Baseline: one hivemind peer training shoal's model on shoal's data with hivemind.Optimizer; run in the hivemind venv.

Same run as the shoal nodes beside it: the manifest file gives the model, corpus, batch, optimizer, learning-rate
schedule, gradient clipping, seed and evaluation set; peer i of N reads shard i of N of the training samples (as
shoal's replica i does). hivemind's global step ("epoch") happens once the peers together have processed
target_batch_size samples, set to N x batch: the same samples per update as one synchronized shoal step.
The status file (JSON, rewritten every step) carries step (hivemind epoch), local steps, losses and time, like a
shoal node's status file, so the benchmark samples both alike.

    python hivemind_train.py --manifest run.toml --index 0 --nodes 4 --listen 10.15.0.1 --status-file s0.json
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import tempfile
import time
from pathlib import Path

def import_shoal() -> None:
    """Make `shoal.protocol`, `shoal.kernels` and `shoal.node` importable from the shoal installation that started
    this script (they need torch, numpy, msgpack, cryptography and tomli-w, never libp2p, which cannot share a process
    with hivemind): the parent names their folders in SHOAL_PACKAGE_DIRS (bench/lab/hivemind_swarm.py)."""
    dirs = json.loads(os.environ["SHOAL_PACKAGE_DIRS"])
    root = Path(tempfile.mkdtemp(prefix="shoal-import-"))
    (root / "shoal").mkdir()
    for sub in ("protocol", "node", "kernels"):
        (root / "shoal" / sub).symlink_to(dirs[sub])
    sys.path.insert(0, str(root))


def write_status(path: Path, doc: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, path)


def main() -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False)
    ap.add_argument("--manifest", required=True, type=Path)
    ap.add_argument("--index", type=int, required=True)
    ap.add_argument("--nodes", type=int, required=True)
    ap.add_argument("--listen", required=True, help="IPv4 address to listen on")
    ap.add_argument("--initial-peers", nargs="*", default=[])
    ap.add_argument("--status-file", required=True, type=Path)
    ap.add_argument("--steps", type=int, required=True, help="stop after this many hivemind epochs")
    ap.add_argument("--compression", choices=("none", "fp16", "8bit"), default="none")
    ap.add_argument("--matchmaking-time", type=float, default=3.0)
    ap.add_argument("--averaging-timeout", type=float, default=30.0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--time-limit", type=float, default=600.0)
    a = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)

    import torch

    torch.set_num_threads(a.threads)
    import_shoal()
    import hivemind
    from hivemind.compression import Float16Compression, NoCompression, Uniform8BitQuantization

    from shoal.node.train.data import Samples, ShardedSampler, heldout_batches, load_corpus
    from shoal.node.train.model import GPTConfig, build_model, lm_loss
    from shoal.node.train.trainer import lr_at
    from shoal.protocol.manifest import RunManifest

    m = RunManifest.from_toml(a.manifest.read_text())
    b, o = m.batch, m.optim
    corpus = load_corpus(m.data.source, m.data.heldout_every)
    train, held = Samples(corpus.train, b.seq_len), Samples(corpus.heldout, b.seq_len)
    sampler = ShardedSampler(train.num_samples, seed=m.seed, replica=a.index, replicas=a.nodes)
    eval_ids = heldout_batches(held, b.micro_batch_size, m.eval.batches)
    model = build_model(GPTConfig.from_spec(m.model, b.seq_len), seed=m.seed)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    params = [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]

    class ClippedAdamW(torch.optim.AdamW):
        """shoal's update: the (averaged) gradient clipped to grad_clip, then AdamW."""

        def step(self, closure=None):
            if o.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_([p for g in self.param_groups for p in g["params"]], o.grad_clip)
            return super().step(closure)

    codec = {"none": NoCompression(), "fp16": Float16Compression(), "8bit": Uniform8BitQuantization()}[a.compression]
    status: dict = {"index": a.index, "state": "starting", "pid": os.getpid(), "time": time.time(), "step": 0}
    write_status(a.status_file, status)
    dht = hivemind.DHT(host_maddrs=[f"/ip4/{a.listen}/tcp/0"], initial_peers=a.initial_peers, start=True)
    status["addrs"] = [str(x) for x in dht.get_visible_maddrs()]
    write_status(a.status_file, status)
    opt = hivemind.Optimizer(
        dht=dht, run_id="shoal-bench", params=params,
        optimizer=lambda ps: ClippedAdamW(ps, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps),
        scheduler=lambda opt_: torch.optim.lr_scheduler.LambdaLR(opt_, lambda step: lr_at(o, step) / o.lr),
        target_batch_size=a.nodes * b.batch_size, batch_size_per_step=b.batch_size,
        matchmaking_time=a.matchmaking_time, averaging_timeout=a.averaging_timeout,
        grad_compression=codec, state_averaging_compression=codec, verbose=False)

    @torch.no_grad()
    def evaluate() -> float:
        model.eval()
        total = sum(float(lm_loss(model(held.get(ids)[0]), held.get(ids)[1])) for ids in eval_ids)
        model.train()
        return total / len(eval_ids)

    status.update(state="training", started=time.time())
    local_steps, evaluated_at, t_end = 0, -1, time.monotonic() + a.time_limit
    n_micro = b.batch_size // b.micro_batch_size
    while opt.local_epoch < a.steps and time.monotonic() < t_end:
        ids = sampler.next_ids(b.batch_size)
        loss_sum = 0.0
        for micro in ids.split(b.micro_batch_size):
            x, y = train.get(micro)
            loss = lm_loss(model(x), y) / n_micro
            loss.backward()
            loss_sum += float(loss)
        opt.step()
        opt.zero_grad()
        local_steps += 1
        epoch = opt.local_epoch
        if m.eval.every_steps and epoch // m.eval.every_steps > evaluated_at:
            evaluated_at = epoch // m.eval.every_steps
            if epoch:
                status["eval_at"] = time.time()  # the state after the update (shoal's clock stops there too)
                status["eval_loss"] = evaluate()
                status["eval_step"] = epoch
        status.update(step=epoch, local_steps=local_steps, time=time.time(),
                      loss=loss_sum if math.isfinite(loss_sum) else None, samples=local_steps * b.batch_size)
        write_status(a.status_file, status)
    status.update(state="done", time=time.time(), eval_loss=evaluate(), eval_step=opt.local_epoch)
    write_status(a.status_file, status)
    opt.shutdown()
    dht.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
