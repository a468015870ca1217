"""The one way tests wait for training to get somewhere: "N replicas train at step >= k", over a swarm of node
processes (`LocalSwarm`: each node's status file) or nodes running in the test's own loop (`Node`: its trainer)."""

from __future__ import annotations

from collections.abc import Sequence

import trio

from shoal.node.daemon import Node
from shoal.node.localswarm import LocalSwarm
from tests.helpers.timeline import note

Source = LocalSwarm | Sequence[Node]


def replica_steps(source: Source) -> list[int]:
    """The step of every replica training now: each live node process that holds a slot, or each given node whose
    trainer exists."""
    if isinstance(source, LocalSwarm):
        return [r.get("step") or 0 for r in source.summary() if r["alive"] and r.get("slot")]
    return [n.runtime.replica.trainer.step_count for n in source
            if n.runtime is not None and n.runtime.replica.trainer is not None]


def training(source: Source, replicas: int, step: int) -> bool:
    """Exactly `replicas` replicas train, every one of them at step `step` or later (for given nodes: all of them,
    `replicas` = how many were given)."""
    steps = replica_steps(source)
    return len(steps) == replicas and min(steps) >= step


def newest_step(source: Source) -> int:
    """The furthest step any replica has reached (0 before training)."""
    return max(replica_steps(source), default=0)


async def wait_training(source: Source, replicas: int, step: int, timeout_s: float, what: str = "",
                        poll_s: float = 0.2) -> float:
    """Wait (polling, in the test's trio loop) until `training(source, replicas, step)`; the seconds it took.
    AssertionError with the steps seen when `timeout_s` passes first."""
    t0 = trio.current_time()
    with trio.move_on_after(timeout_s):
        while not training(source, replicas, step):
            await trio.sleep(poll_s)
        note(f"{replicas} replicas at step {step}: {what}", trio.current_time() - t0)
        return trio.current_time() - t0
    raise AssertionError(f"timed out after {timeout_s} s waiting for {replicas} replicas at step >= {step}"
                         f"{': ' + what if what else ''}; replicas at steps {replica_steps(source)}")
