"""The broker's weighing of what members report against each other: a member missed a round, a member's update
was rejected (docs/broker.md, "Failure detection"). No lone accuser counts: a peer reported missing is pinged by the
broker itself; a miss counts on a strict majority of the other members' reports or the broker's own measure of the
member's lag; an update rejected by a majority of the others evicts its sender. Reporters whose reports keep going
unconfirmed are penalized (swarm/run/accusations.py keeps the reports)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

import trio

from shoal.protocol.assignment import AssignmentTable, MissingReport
from shoal.swarm.net.rpc import RpcError, call
from shoal.swarm.run.accusations import MISSED, OFFENCE, Accusations, Verdict
from shoal.swarm.run.brokerconfig import BrokerConfig
from shoal.swarm.run.context import RunContext

log = logging.getLogger(__name__)


class Acts(Protocol):
    """The broker as its reports see it: the run's groups, and what a verdict makes it do."""

    ctx: RunContext
    config: BrokerConfig
    clock: Callable[[], float]
    table: AssignmentTable | None
    epochs: list[int]
    stages: int

    def touch(self, peer_id: str) -> None: ...
    def mark_failed(self, peer_id: str, reason: str) -> bool: ...
    def missed_round(self, peer_id: str, stage: int, why: str) -> None: ...
    def reform(self, stage: int, reason: str) -> None: ...
    def evict(self, peer_id: str, why: str) -> None: ...


class Reports:
    """Owned by the broker (`broker.reports`); acts through it (ping, re-form, demote, evict, fail)."""

    def __init__(self, broker: Acts):
        self.b = broker
        self.ctx, self.config = broker.ctx, broker.config
        # reports against members, weighed so that no lone accuser counts
        self.accusations = Accusations(broker.clock, window_s=self.config.straggler_window_s,
                                       false_to_penalize=self.config.straggler_misses)
        self._checking: set[tuple[int, int, str]] = set()  # (stage, epoch, peer) reported missing, being pinged

    async def weigh(self, caller: str, rep: MissingReport, table: AssignmentTable) -> dict:
        """A member's report (run.report_missing) of the members it missed and the updates it rejected in a round of
        `rep.epoch`: offences are counted within the current epoch; every peer named missing is checked."""
        b = self.b
        if rep.run_id != b.ctx.run_id or rep.stage >= b.stages or caller not in table.members(rep.stage):
            return {"accepted": False}
        if rep.epoch > b.epochs[rep.stage]:
            return {"accepted": False, "epoch": b.epochs[rep.stage]}
        members = table.members(rep.stage)
        current = rep.epoch == b.epochs[rep.stage]
        if current:  # offences count within one epoch; a silent peer is checked anyway
            for pid in set(rep.offenders):
                if pid in members and pid != caller:
                    self.offence(rep.stage, rep.epoch, pid, caller, members)
        missing = [(pid, rep.stage, rep.epoch) for pid in set(rep.missing) if pid in members and pid != caller]
        for pid in set(rep.neighbours):  # only the caller's own lane neighbours, at their stage's current epoch
            slot = table.slot_of(pid)
            mine = table.slot_of(caller)
            if slot is not None and mine is not None and slot[1] == mine[1] and abs(slot[0] - mine[0]) == 1:
                missing.append((pid, slot[0], b.epochs[slot[0]]))
        async with trio.open_nursery() as n:
            for pid, stage, epoch in missing:
                n.start_soon(self.check_missing, pid, caller, stage, epoch)
        return {"accepted": current, "epoch": b.epochs[rep.stage]}

    def _false_accusers(self, verdict: Verdict, what: str) -> None:
        for r in verdict.false_accusers:
            if self.ctx.penalties is not None and r != self.ctx.me:
                self.ctx.penalties.penalize(r, f"{what}: its reports went unconfirmed {self.config.straggler_misses} "
                                               f"times within {self.config.straggler_window_s:.0f} s")

    def offence(self, stage: int, epoch: int, offender: str, reporter: str, members: tuple[str, ...]) -> None:
        """A member rejected `offender`'s update. Once a strict majority of the other members have, it leaves the
        group and is banned (one report could be a lie; most of the group saw it). A group of two never evicts on
        a report: each member's word is one against the other's."""
        stale = self.accusations.report(OFFENCE, stage, epoch, offender, reporter, members)
        self._false_accusers(Verdict(counts=False, false_accusers=stale), "offence reports")
        verdict = self.accusations.judge(OFFENCE, stage, epoch, offender, members, measured=None, final=False)
        if verdict.counts and offender != self.ctx.me:
            reporters = len(self.accusations.reporters(OFFENCE, stage, epoch, offender)) or "most"
            self.b.evict(offender, f"updates rejected by a majority ({reporters}) of the {len(members) - 1} other "
                                   f"members")

    def lags(self, peer_id: str, members: tuple[str, ...]) -> bool | None:
        """The broker's own measurement of whether `peer_id` lags its group: the step it signs in its status
        against the others' (None: no status of it or of the others)."""
        m = self.ctx.membership
        if m is None:
            return None
        steps = {e.peer_id: e.status_record.step for e in m.live_peers()
                 if e.peer_id in members and e.status_record is not None
                 and e.status_record.run_id == self.ctx.run_id}
        if self.ctx.me in members and self.ctx.step is not None:
            steps[self.ctx.me] = self.ctx.step()
        if peer_id not in steps or len(steps) < 2:
            return None
        others = sorted(s for p, s in steps.items() if p != peer_id)
        return steps[peer_id] < others[len(others) // 2] - self.config.straggler_lag_steps

    async def check_missing(self, peer_id: str, reporter: str, stage: int, epoch: int) -> None:
        """Ping a member reported missing: a silent one is replaced (the broker's own probe). One that answers
        missed a round only when a strict majority of the other members of its group reported it, or the broker
        sees it lag (with two members, the latter alone); the group is re-formed (same members, next epoch) so
        every member stops skipping it at the same step, unless only distrusted reporters asked for it."""
        members = self.b.table.members(stage) if self.b.table is not None else ()
        self.accusations.report(MISSED, stage, epoch, peer_id, reporter, members)
        key = (stage, epoch, peer_id)
        if key in self._checking:
            return  # another member's report of the same miss is being checked
        self._checking.add(key)
        try:
            if peer_id != self.ctx.me:
                await call(self.ctx.sh, peer_id, "run.ping", {"run_id": self.ctx.run_id},
                           timeout_s=self.config.ping_timeout_s)
                self.b.touch(peer_id)
            await trio.sleep(self.config.corroborate_s)  # the other members' reports of the same round arrive
        except RpcError as e:
            self.b.mark_failed(peer_id, f"reported missing by {reporter[:16]}… and did not answer: {e}")
            return
        finally:
            self._checking.discard(key)
        if self.b.epochs[stage] != epoch:
            return  # the group changed meanwhile: every member's skips are reset already
        reporters = self.accusations.reporters(MISSED, stage, epoch, peer_id)
        verdict = self.accusations.judge(MISSED, stage, epoch, peer_id, members, measured=self.lags(peer_id, members))
        self._false_accusers(verdict, "missed-round reports")
        by = ", ".join(r[:16] + "…" for r in sorted(reporters))
        if verdict.counts:
            self.b.missed_round(peer_id, stage, f"{peer_id[:16]}… missed a round (reported by {by}) but answers")
        elif all(self.accusations.distrusted(r) for r in reporters):
            log.info("reports that %s missed a round (by %s) are not acted on: its reporters accuse falsely",
                     peer_id[:16], by)
        else:
            self.b.reform(stage, f"{peer_id[:16]}… reported missing by {by} alone, answers: no miss counted")
