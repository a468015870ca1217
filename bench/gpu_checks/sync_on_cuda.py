"""Device check (not a test: run by hand on a GPU machine without libp2p): the synchronizers with trainers on CUDA,
over an in-memory exchange; replicas must agree bit for bit, learn, and a replica loaded from a CPU snapshot must
rejoin. The same code path over real hosts:
tests/swarm/test_sync_groups.py::test_replicas_on_a_gpu_learn_and_stay_identical.

    python bench/gpu_checks/sync_on_cuda.py [cuda|cpu]
"""

from __future__ import annotations

import sys

import torch
import trio

from shoal.node.train.data import load_corpus
from shoal.node.sync.base import SyncConfig
from shoal.node.sync.factory import make_synchronizer
from shoal.node.train.control import StepControl
from shoal.node.train.trainer import Trainer
from shoal.protocol.manifest import (BatchSpec, CocktailSpec, DilocoSpec, EvalSpec, ModelSpec, OptimSpec,
                                     ParallelPlan, RunManifest, SyncSpec)
from shoal.swarm.run.group import Group
from shoal.swarm.net.penalty import Penalties


class Hub:
    """Messages between in-process members by (recipient, tag)."""

    def __init__(self):
        self.boxes: dict = {}
        self.changed = trio.Event()


class MemoryExchange:
    def __init__(self, hub: Hub, me: str):
        self.hub, self.me = hub, me

    async def exchange(self, tag, sends, expect, timeout_s):
        for p, b in sends.items():
            if p != self.me:
                self.hub.boxes.setdefault((p, tag), {})[self.me] = b
        self.hub.changed.set()
        self.hub.changed = trio.Event()
        with trio.move_on_after(timeout_s):
            while not (expect - {self.me}) <= self.hub.boxes.get((self.me, tag), {}).keys():
                await self.hub.changed.wait()
        box = self.hub.boxes.pop((self.me, tag), {})
        if self.me in sends:
            box[self.me] = sends[self.me]
        return {p: b for p, b in box.items() if p in expect}


def blocking(exchange, token):
    """An async exchange as the synchronizers' blocking one (they run in trainer threads)."""
    return lambda tag, sends, expect, timeout_s: trio.from_thread.run(exchange, tag, sends, expect, timeout_s,
                                                                     trio_token=token)


def to_cpu(state):
    if isinstance(state, torch.Tensor):
        return state.detach().cpu().clone()  # fresh storage, as state off the network is
    if isinstance(state, dict):
        return {k: to_cpu(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(to_cpu(v) for v in state)
    return state


DEVICE = sys.argv[1] if len(sys.argv) > 1 else "cuda"


async def check(sync: SyncSpec, steps: int = 12, n: int = 3) -> str:
    m = RunManifest(seed=5, model=ModelSpec(size="custom", n_layers=1, d_model=64, n_heads=4),
                    batch=BatchSpec(batch_size=4, micro_batch_size=4, seq_len=32),
                    optim=OptimSpec(lr=1e-2, warmup_steps=3, total_steps=steps),
                    eval=EvalSpec(every_steps=0, batches=2),
                    plan=ParallelPlan(replicas=n, sync=sync))
    hub, ids, tok = Hub(), [f"p{i}" for i in range(n)], trio.lowlevel.current_trio_token()
    corpus = load_corpus("stdlib", 20)
    syncs, trainers, losses = [], [], [[] for _ in range(n)]
    groups = [Group(run_id=m.run_id, epoch=0, members=tuple(ids), me=pid) for pid in ids]
    for i, pid in enumerate(ids):
        s = make_synchronizer(m, exchange=blocking(MemoryExchange(hub, pid).exchange, tok), penalties=Penalties(),
                              config=SyncConfig(round_timeout_s=5))
        syncs.append(s)
        trainers.append(Trainer(m, device=DEVICE, replica=i, synchronizer=s, corpus=corpus))

    start = trainers[0].evaluate()

    def train(i: int, k: int) -> None:
        for _ in range(k):
            t = trainers[i]
            losses[i].append(t.step(StepControl(step=t.step_count, group=groups[i])).loss)

    async with trio.open_nursery() as nursery:
        for i in range(n):
            nursery.start_soon(trio.to_thread.run_sync, train, i, steps // 2)
    # replica 2 is replaced by a fresh one loaded from replica 0's state as the network would carry it (CPU)
    def close(i: int) -> None:  # in a worker thread: a round in flight needs the trio loop to finish
        trainers[i].close()

    for i in range(n):
        await trio.to_thread.run_sync(close, i)
    state = to_cpu(trainers[0].state_dict())
    fresh = make_synchronizer(m, exchange=blocking(MemoryExchange(hub, ids[2]).exchange, tok), penalties=Penalties(),
                              config=SyncConfig(round_timeout_s=5))
    syncs[2], trainers[2] = fresh, Trainer(m, device=DEVICE, replica=2, synchronizer=fresh, corpus=corpus)
    trainers[2].load_state_dict(state)
    fresh.enter(trainers[2].model)
    async with trio.open_nursery() as nursery:
        for i in range(n):
            nursery.start_soon(trio.to_thread.run_sync, train, i, steps - steps // 2)
    for i in range(n):
        await trio.to_thread.run_sync(close, i)
    hashes = {s.state_hash() for s in syncs}
    ends = [t.evaluate() for t in trainers]
    ok = len(hashes) == 1 and all(e < start - 0.3 for e in ends) and \
        all(torch.isfinite(torch.tensor(x)).all() for x in losses)
    return f"{'ok  ' if ok else 'FAIL'} {sync.method}: hashes equal={len(hashes) == 1}, held-out loss " \
           f"{start:.3f} -> {', '.join(f'{e:.3f}' for e in ends)}, device {next(trainers[0].model.parameters()).device}"


async def main() -> int:
    specs = [SyncSpec(method="allreduce"),
             SyncSpec(method="cocktail", cocktail=CocktailSpec(warmup_steps=1)),
             SyncSpec(method="diloco", diloco=DilocoSpec(inner_steps=3, e3m0=True)),
             SyncSpec(method="diloco", diloco=DilocoSpec(inner_steps=4, fragments=2, overlap_steps=1, merge_alpha=0.5))]
    lines = []
    for s in specs:
        try:
            lines.append(await check(s))
        except Exception as e:  # noqa: BLE001 - report and go on to the next synchronizer
            import traceback
            traceback.print_exc()
            lines.append(f"FAIL {s.method}: {type(e).__name__}: {e}")
        print(lines[-1], flush=True)
    return 0 if all(x.startswith("ok") for x in lines) else 1


if __name__ == "__main__":
    sys.exit(trio.run(main))
