"""A pipeline stage's verified-stage duties in the run's loop (docs/verified-stages.md): before each step, keep the
stage's weights and draw the micro-batches of the monitored lane to re-execute; after it, check them
(node/run/verify.py) and act on a finding: distrust the stage in this replica's aggregation, report it to the
broker, and ask the stage's other replicas to re-execute the same micro-batch (`run.accuse`), so that most of them
report it and the broker evicts it. Between samples, a member the stage group's aggregation left out or clipped
points at its lane: that lane is checked more often here and at this stage's lane neighbours (`run.lane_hint`)."""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from shoal.node.run.context import NodeServices
from shoal.node.run.lanes import StageLinks
from shoal.node.run.replica import Replica
from shoal.node.run.verify import Finding, StageVerifier
from shoal.node.train.batch import StepBatch
from shoal.protocol.assignment import AssignmentTable
from shoal.swarm.net.rpc import RpcError
from shoal.swarm.run.client import RunClient
from shoal.swarm.run.group import Group
from shoal.swarm.run.timeline import GroupTimeline

log = logging.getLogger(__name__)

Checks = tuple[AssignmentTable, int, int, list[int]]  # (table, step, lane, micro-batches) to re-execute
Call = Callable[[str, str, Any], Awaitable[Any]]  # (peer, method, body) -> answer; raises RpcError
Spawn = Callable[[Callable[[], Awaitable[Any]]], None]  # start a task in the run's nursery


class VerifiedStage:
    """Owned by the event loop, for a run of several stages (`verifier.enabled`: a verified run)."""

    def __init__(self, *, services: NodeServices, verifier: StageVerifier, replica: Replica, timeline: GroupTimeline,
                 links: StageLinks, client: Callable[[], RunClient | None], call: Call, spawn: Spawn,
                 member: Callable[[str], bool]):
        self.services, self.verifier, self.replica, self.timeline = services, verifier, replica, timeline
        self.links, self.client, self.call, self.spawn = links, client, call, spawn
        verifier.signatures = links.signatures
        services.register("run.evidence", functools.partial(verifier.rpc_evidence, member=member))
        services.register("run.accuse", self._rpc_accuse)
        services.register("run.lane_hint", self._rpc_lane_hint)

    async def before(self, step: int) -> Checks | None:
        """Before step `step`: keep the stage's weights (any replica of the stage may ask for a re-execution of this
        step), and draw the micro-batches of the monitored lane to check; None: none."""
        v, t = self.verifier, self.replica.trainer
        if not v.enabled or t is None:
            return None
        await trio.to_thread.run_sync(v.keep_weights, t, step)
        table = self.timeline.table_at(step, t.stage)
        lane = v.monitored_lane(table, t.replica) if table is not None else None
        if table is not None and self.replica.sync is not None:
            await self._lane_statistics(table, t.replica)
        share = StepBatch.in_table(t.manifest, lane, table).samples if table is not None and lane is not None else 0
        micros = v.draw(-(-share // t.manifest.batch.micro_batch_size), lane) if lane is not None else []
        return (table, step, lane, micros) if table is not None and lane is not None and micros else None

    def after(self, group: Group, checks: Checks | None) -> None:
        """After the step: check what `before` drew, in the background."""
        t = self.replica.trainer
        if checks is not None and t is not None:
            self.spawn(functools.partial(self._verify, t, group, *checks))

    async def _lane_statistics(self, table: AssignmentTable, my_lane: int) -> None:
        """Cheap evidence between samples: a member this replica's aggregation left out or clipped points at its
        lane (a stage of that lane may have fed it tampered values). Its lane is checked more often here, and the
        lane neighbours of this stage (whose replicas check the stages it borders) are told."""
        sync = self.replica.sync
        assert sync is not None
        lanes = {slot[1] for m in sync.take_outliers() if (slot := table.slot_of(m)) is not None}
        neighbours = [p for p in (self.links.peers or ()) if p is not None]
        for lane in lanes - {my_lane}:
            self._lane_hint(lane)
            for peer in neighbours:
                self.spawn(functools.partial(self._send_hint, peer, lane))

    def _lane_hint(self, lane: int) -> None:
        t = self.replica.trainer
        table = self.timeline.table_at(self.replica.at_step, t.stage) if t is not None else None
        if table is not None and t is not None and self.verifier.monitored_lane(table, t.replica) == lane:
            self.verifier.boost(lane)

    async def _send_hint(self, peer: str, lane: int) -> None:
        try:
            await self.call(peer, "run.lane_hint", {"lane": lane})
        except RpcError as e:
            log.debug("lane hint to %s: %s", peer[-8:], e)

    async def _rpc_lane_hint(self, caller: str, body: Any) -> Any:
        """A lane neighbour's statistics point at `lane`: check it more often if this replica checks it."""
        if caller not in (self.links.peers or ()):
            raise PermissionError("lane hints come from this stage's lane neighbours only")
        if not isinstance(body, dict) or not isinstance(body.get("lane"), int) or isinstance(body.get("lane"), bool):
            raise ValueError("a lane hint names a lane")
        self._lane_hint(body["lane"])
        return {"ok": True}

    async def _verify(self, t, group: Group, table: AssignmentTable, step: int, lane: int, micros: list[int], *,
                      confirming: bool = False) -> None:
        """Check the sampled micro-batches; act on a finding (see node/run/verify.py)."""
        for micro in micros:
            f = await self.verifier.check(t, table, step, micro, lane, confirming=confirming)
            if f is None or f.why == "equivocation":
                continue  # (a neighbour that signed two things is penalized here; its stage is not ours to report)
            if self.replica.sync is not None:
                self.replica.sync.distrust(f.suspect)
            client = self.client()
            if client is not None:
                await client.report_missing([], epoch=group.epoch, stage=group.stage, offenders=[f.suspect])
            if not confirming:  # the other replicas of the stage re-execute it too: most of them evict it
                for peer in group.members:
                    if peer not in (self.services.peer_id, f.suspect):
                        self.spawn(functools.partial(self._ask_confirmation, peer, f))
            return

    async def _ask_confirmation(self, peer: str, f: Finding) -> None:
        try:
            await self.call(peer, "run.accuse", {"step": f.step, "micro": f.micro, "lane": f.lane})
        except RpcError as e:
            log.info("asking %s to re-check step %d #%d of lane %d: %s", peer[-8:], f.step, f.micro, f.lane, e)

    async def _rpc_accuse(self, caller: str, body: Any) -> Any:
        """Another replica of this stage found lane `lane`'s stage tampering at (step, micro): re-execute it here
        with the weights this replica held at that step, and report it too when it agrees."""
        t, g = self.replica.trainer, self.timeline.group_at(self.replica.at_step)
        if t is None or g is None or caller not in g.members:
            raise PermissionError("only a replica of this stage may ask for a re-check")
        if not isinstance(body, dict) or not all(isinstance(body.get(k), int) and not isinstance(body.get(k), bool)
                                                 for k in ("step", "micro", "lane")):
            raise ValueError("a re-check is asked as {step, micro, lane}")
        table = self.timeline.table_at(body["step"], t.stage)
        if table is None or body["lane"] not in table.complete_lanes() or body["lane"] == t.replica:
            raise ValueError("no such lane to re-check")
        self.spawn(functools.partial(self._verify, t, g, table, body["step"], body["lane"], [body["micro"]],
                                     confirming=True))
        return {"ok": True}
