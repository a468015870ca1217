"""Verified pipeline stages on real in-process nodes (127.0.0.1, a real broker; 2 stages x 3 lanes, all-reduce,
fp32 wires): each stage re-executes a sampled fraction of the micro-batches of the same stage in the lane before
its own, from its neighbours' signed records. An honest run finds nothing. A last stage that sends flipped
gradients back (x -1, the issue's measured attack) is caught, confirmed by the stage's other replica, evicted by
the broker at an agreed step, and the run ends with a held-out loss within 0.3 nats of the honest run's."""

from __future__ import annotations

from dataclasses import replace

import pytest
import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from shoal.protocol import manifest as mf
from shoal.protocol.assignment import GONE
from tests.helpers.swarm import running_node, wait_for
from tests.swarm.test_run_runtime import node_config

pytestmark = [pytest.mark.slow, pytest.mark.own_process, pytest.mark.usefixtures("one_torch_thread")]

STEPS = 60
TAMPER_FROM = 8
FRACTION = 0.25  # the test's sampling (the run default a user would pick is ~0.06: docs/verified-stages.md)


def manifest(owner: Ed25519PrivateKey) -> mf.RunManifest:
    return mf.RunManifest(
        seed=3, model=mf.ModelSpec(size="custom", n_layers=2, d_model=32, n_heads=4),
        batch=mf.BatchSpec(batch_size=8, micro_batch_size=2, seq_len=32),
        optim=mf.OptimSpec(lr=3e-3, warmup_steps=5, total_steps=1000), eval=mf.EvalSpec(every_steps=0, batches=4),
        plan=mf.ParallelPlan(stages=2, replicas=3, sync=mf.SyncSpec(method="allreduce"),
                             pipeline=mf.PipelineSpec(compression="none", verify_fraction=FRACTION))).signed(owner)


class FlipGradients:
    """The attacker's boundary below its recorder (what its link signs and sends): gradients x -1 from a step on."""

    def __init__(self, inner, from_step: int):
        self.inner, self.from_step, self.flipped = inner, from_step, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def send_grad(self, step, micro, g):
        if step >= self.from_step:
            g, self.flipped = -g, self.flipped + 1
        self.inner.send_grad(step, micro, g)


def tamper(node) -> list[FlipGradients]:
    """From now on the node's links (each time they are opened) flip what it sends back."""
    links, flippers = node.runtime.links, []
    connect = links.connect

    async def connect_and_tamper(trainer, table, step):
        await connect(trainer, table, step)
        b = trainer.boundary  # the recorder: it keeps what the trainer computed, as an honest stage's would
        if not isinstance(b.inner, FlipGradients):
            flippers.append(FlipGradients(b.inner, TAMPER_FROM))
            b.inner = flippers[-1]
    links.connect = connect_and_tamper
    return flippers


async def run(attack: bool) -> dict:
    owner = Ed25519PrivateKey.generate()
    m = manifest(owner)
    cfg = node_config(m, STEPS, start_wait_s=30.0)
    # six trainers share one process: failure detection slack enough that only the attacker's eviction changes seats
    cfg = replace(cfg, run=replace(cfg.run, round_timeout_s=15.0,
                                   broker=replace(cfg.run.broker, fail_after_s=30.0, ping_timeout_s=5.0)))
    async with running_node((), cfg, key=owner) as first:
        nodes = [first]
        async with trio.open_nursery() as n:
            async def more(task_status=trio.TASK_STATUS_IGNORED):
                async with running_node(first.sh.addrs, cfg) as x:
                    task_status.started(x)
                    await trio.sleep_forever()
            for _ in range(5):
                nodes.append(await n.start(more))
            await wait_for(lambda: all(x.runtime.trainer is not None for x in nodes), 90, "six stage trainers")
            attacker, flippers = None, []
            if attack:
                attacker = next(x for x in nodes if (x.runtime.trainer.stage, x.runtime.trainer.replica) == (1, 2))
                flippers = tamper(attacker)
            broker = first.runtime.broker

            def finished() -> bool:
                alive = [x for x in nodes if x is not attacker and x.runtime.finished.is_set()]
                return len(alive) >= (4 if attack else 6)
            await wait_for(finished, 420, "the run to finish")
            evicted_at = None
            if attack:
                t = broker.table
                assert t.provider_state(attacker.peer_id) == GONE, "the tampering stage was not evicted"
                evicted_at = t.switch_step(1)
            last = [x for x in nodes if x is not attacker and x.runtime.finished.is_set()
                    and x.runtime.trainer.stage == 1]
            out = {"eval": min(x.runtime.trainer.last_eval_loss for x in last),
                   "findings": [f for x in nodes if x is not attacker for f in x.runtime.verifier.stats.findings],
                   "checked": sum(x.runtime.verifier.stats.checked for x in nodes if x is not attacker),
                   "evicted_at": evicted_at, "flipped": sum(f.flipped for f in flippers)}
            n.cancel_scope.cancel()
            return out


async def test_an_honest_run_is_never_accused_and_a_stage_flipping_gradients_is_caught_and_evicted():
    honest = await run(attack=False)
    poisoned = await run(attack=True)
    print(f"honest: {honest['checked']} micro-batches re-executed, {len(honest['findings'])} findings, held-out loss "
          f"{honest['eval']:.4f}; poisoned from step {TAMPER_FROM}: {poisoned['flipped']} gradients flipped, "
          f"first finding {poisoned['findings'][0] if poisoned['findings'] else None}, evicted from step "
          f"{poisoned['evicted_at']}, held-out loss {poisoned['eval']:.4f} "
          f"({poisoned['eval'] - honest['eval']:+.4f} nats)")
    assert honest["checked"] > 0 and not honest["findings"]
    assert poisoned["findings"] and all(f.why in ("backward", "forward") for f in poisoned["findings"])
    assert poisoned["evicted_at"] is not None and poisoned["evicted_at"] < STEPS
    assert abs(poisoned["eval"] - honest["eval"]) <= 0.3
