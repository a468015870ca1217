"""Verified pipeline stages in a real swarm (127.0.0.1; 2 stages x 3 lanes, all-reduce, fp32 wires): each stage
re-executes a sampled fraction of the micro-batches of the same stage in the lane before its own, from its
neighbours' signed records. Six node processes train an honest run: nothing is found. Then five node processes
and one attacker node in the test (shoal's own node, its links made to flip the gradients it sends back, x -1:
the issue's measured attack) train the same run: the attacker is caught, confirmed by the stage's other replica,
evicted by the broker at an agreed step, and the run ends with a held-out loss within 0.3 nats of the honest one."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import trio

from shoal.node.run.config import RunConfig
from shoal.node.daemon import NodeConfig
from shoal.protocol import manifest as mf
from shoal.protocol.assignment import GONE
from shoal.swarm.net.identity import load_or_create_identity
from shoal.swarm.net.rpc import call
from tests.adversarial.attacker import table_of
from tests.helpers.swarm import FAST, running_node, wait_for
from tests.swarm.test_run_swarm import active, make_swarm

pytestmark = pytest.mark.slow

STEPS = 40
TAMPER_FROM = 5
FRACTION = 0.25  # the test's sampling (a run would pick ~0.06: docs/verified-stages.md)


def write_run(workdir: Path) -> tuple[Path, mf.RunManifest]:
    workdir.mkdir(parents=True, exist_ok=True)
    m = mf.RunManifest(
        seed=3, model=mf.ModelSpec(size="custom", n_layers=2, d_model=32, n_heads=4),
        batch=mf.BatchSpec(batch_size=8, micro_batch_size=2, seq_len=32),
        optim=mf.OptimSpec(lr=3e-3, warmup_steps=5, total_steps=1000), eval=mf.EvalSpec(every_steps=0, batches=4),
        plan=mf.ParallelPlan(stages=2, replicas=3, sync=mf.SyncSpec(method="allreduce"),
                             pipeline=mf.PipelineSpec(compression="none", verify_fraction=FRACTION)))
    m = m.signed(load_or_create_identity(workdir / "node0.key"))
    path = workdir / "run.toml"
    path.write_text(m.to_toml())
    return path, m


class FlipGradients:
    """The attacker's boundary below its recorder (what its links sign and send): gradients x -1 from a step on."""

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


def stage_rows(s) -> list[dict]:
    return [dict(r, **{k: v for k, v in s.nodes[r["index"]].status().items() if k in ("verified", "eval_loss")})
            for r in active(s)]


async def run(tmp_path: Path, attack: bool) -> dict:
    run_path, m = write_run(tmp_path / "w")
    s = make_swarm(tmp_path, 5 if attack else 6, run_path, STEPS, "--fail-after", "20", "--round-timeout", "10")
    try:
        await trio.to_thread.run_sync(s.start)
        out: dict = {"flipped": 0}
        if not attack:
            with trio.fail_after(300):
                while not (len(active(s)) == 6 and all(r.get("state") == "done" for r in active(s))):
                    await trio.sleep(0.5)
        else:
            cfg = replace(FAST, run=RunConfig(manifest=m, threads=1, max_steps=STEPS, round_timeout_s=10.0))
            with trio.fail_after(60):
                while len(active(s)) < 5:
                    await trio.sleep(0.3)
            async with running_node(s.bootstrap_addrs(), cfg) as x:
                await wait_for(lambda: x.runtime is not None and x.runtime.links is not None, 60, "the attacker's run")
                flippers = tamper(x)
                await wait_for(lambda: x.runtime.client is not None and x.runtime.client.slot() is not None, 60,
                               "the attacker's slot")
                out["slot"] = x.runtime.client.slot()
                broker = s.nodes[0].status()["peer_id"]

                async def evicted() -> bool:
                    ans = await call(x.sh, broker, "run.table", {"run_id": m.run_id})
                    return table_of(ans["table"]).provider_state(x.peer_id) == GONE
                with trio.fail_after(240):
                    while not await evicted():
                        await trio.sleep(1.0)
                out["flipped"] = sum(f.flipped for f in flippers)
                out["attacker"] = x.peer_id
            lane = f"r{out['slot'][1]}"  # the attacker's lane is incomplete once it is evicted: the others finish

            def others_done() -> bool:
                rows = [r for r in active(s) if not r["slot"].endswith(lane)]
                return len(rows) == 4 and all(r.get("state") == "done" for r in rows)
            with trio.fail_after(300):
                while not others_done():
                    await trio.sleep(0.5)
        rows = [r for r in stage_rows(s) if not attack or not r["slot"].endswith(f"r{out['slot'][1]}")]
        out["eval"] = min(r["eval_loss"] for r in rows if r.get("eval_loss") is not None)
        out["checked"] = sum(r.get("verified", {}).get("checked", 0) for r in rows)
        out["findings"] = [f for r in rows for f in r.get("verified", {}).get("findings", [])]
        return out
    finally:
        await trio.to_thread.run_sync(s.stop)


async def test_an_honest_run_is_never_accused_and_a_stage_flipping_gradients_is_caught_and_evicted(tmp_path):
    honest = await run(tmp_path / "honest", attack=False)
    poisoned = await run(tmp_path / "poisoned", attack=True)
    print(f"honest run: {honest['checked']} micro-batches re-executed, {len(honest['findings'])} findings, held-out "
          f"loss {honest['eval']:.4f}. Poisoned run: the attacker (slot {poisoned['slot']}) flipped "
          f"{poisoned['flipped']} gradients from step {TAMPER_FROM}; findings {poisoned['findings'][:3]}; evicted; "
          f"held-out loss {poisoned['eval']:.4f} ({poisoned['eval'] - honest['eval']:+.4f} nats)")
    assert honest["checked"] > 0 and not honest["findings"]
    assert poisoned["slot"][0] == 1  # the last stage: it sends gradients back
    assert poisoned["findings"] and all(f[4] == poisoned["attacker"] for f in poisoned["findings"])
    assert abs(poisoned["eval"] - honest["eval"]) <= 0.3
