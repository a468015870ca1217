"""Where a run's providers sit, as its broker decides: (stage, replica) slots and the backup pool; a newcomer's
place, the backup that fills a failed slot, lanes filled whole, and lanes dissolved when no backup can fill them.

Slots are (stage, replica); replica r of every stage is lane r, and a lane trains only with every stage filled.
A provider is placed into the first free slot of the lowest of the run's starting lanes (the stage with the most
parameters first, among the stages whose memory need it fits), or joins the backup pool keeping one stage warm (the
stage with the fewest backups); a failed slot is filled by a backup of its stage (the most reachable first, then
the fastest). With several stages, a lane is filled whole or not at all, and a lane whose empty slot no backup can
fill for `dissolve_after_s` is dissolved: its members return to the pool, each keeping its stage warm.

An elastic run (its plan's maximum above its starting lanes) grows: while below the maximum, whenever every stage
has a backup beyond the `backups` it keeps warm, those backups form a new lane (`grow`: a newcomer of a one-stage run
is seated at once). It shrinks when lanes leave; below its minimum its members wait (the runtime's rule).

The broker owns the providers (`providers`, shared) and the group epochs: every change of seats is returned to it
as the stages whose group changed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from shoal.protocol.assignment import ACTIVE, BACKUP, AssignmentTable, slot_name
from shoal.protocol.records import HardwareProfile
from shoal.swarm.run.context import RunContext
from shoal.swarm.run.placement import Reach, direct_possible, rank_for_dialed_roles
from shoal.swarm.run.placer import Change, Placer

log = logging.getLogger(__name__)

Slot = tuple[int, int]  # (stage, replica)


@dataclass(slots=True)
class Provider:
    peer_id: str
    state: str
    order: int  # admission order; breaks ties, and picks the standby
    last_contact: float  # clock seconds
    admitted_unix: float  # wall seconds (compared with leave notices' times)
    score: tuple = ()  # smaller is better: the backup promoted first
    hardware: HardwareProfile | None = None
    stage: int = 0  # the stage it holds or, as a backup, keeps warm
    suspect: bool = False
    gone_at: float = 0.0
    hold_until: float = 0.0  # clock seconds: not promoted before (a straggler moved to the pool)
    misses: list[float] = field(default_factory=list)  # clock seconds at which it missed rounds while answering


class Seating:
    """The slots of one run and the rules that fill them (see the module)."""

    def __init__(self, ctx: RunContext, providers: dict[str, Provider], *, dissolve_after_s: float,
                 placer: Placer | None = None):
        self.ctx = ctx
        self.providers = providers  # the broker's, by peer id
        self.dissolve_after_s = dissolve_after_s
        self.placer = placer if placer is not None else Placer()  # which slot, which backup, when to move
        self.placer.bind(self._speed)
        plan = ctx.manifest.plan
        self.stages, self.replicas = plan.stages, plan.lanes_max  # lane indices 0 .. lanes_max - 1
        self.starting = plan.replicas  # the lanes filled directly, and re-formed from any backup
        self.reserve = plan.backups  # warm backups each stage keeps before a new lane forms
        self.slots: dict[Slot, str] = {}
        self.empty_since: dict[Slot, float] = {}  # slots of partly filled lanes: empty since (clock)
        self.promotions: list[tuple[float, str, str, str]] = []  # (unix time, slot, failed peer, promoted peer)
        # a resumed run: slots kept for the peers that wrote their checkpoints, until training begins
        self.reserved: dict[Slot, str] = {}
        self.dissolved = 0  # lanes dissolved for want of a backup

    def slot_of(self, peer_id: str) -> Slot | None:
        return next((k for k, v in self.slots.items() if v == peer_id), None)

    def backups(self) -> list[Provider]:
        """The backup pool, the one promoted first first."""
        return sorted((p for p in self.providers.values() if p.state == BACKUP), key=lambda p: (p.score, p.order))

    def promotable(self, stage: int) -> list[Provider]:
        """The backups that may take a slot of `stage` now: those keeping it warm, not suspect, not held back after a
        demotion, and with the memory it needs (a backup that fits no stage, such as a small machine hosting the
        broker, keeps one warm and is never seated)."""
        now = self.ctx.clock()
        return [b for b in self.backups() if b.stage == stage and not b.suspect and b.hold_until <= now
                and self._fits(b.hardware, stage)]

    def _fits(self, hw: HardwareProfile | None, stage: int) -> bool:
        return hw is None or hw.memory_bytes <= 0 or self.ctx.manifest.stage_memory_bytes(stage) <= hw.memory_bytes

    def _training(self) -> bool:
        """Whether the run has begun training (a group change then takes effect at a step past 0)."""
        return self.ctx.switch_step is not None and self.ctx.switch_step(0) > 0

    # -- a newcomer ------------------------------------------------------------------------------------------
    def _speed(self, peer_id: str) -> float:
        """A provider's measured compute (flop/s, from its hardware profile; 0: not known)."""
        p = self.providers.get(peer_id)
        return p.hardware.matmul_tflops * 1e12 if p is not None and p.hardware is not None else 0.0

    def seat(self, p: Provider, *, backup_only: bool) -> Slot | None:
        """Place the newcomer `p`: in a free slot (made ACTIVE; returned), else in the backup pool keeping the
        stage with the fewest backups warm (None)."""
        mine = next((k for k, v in self._reservations().items() if v == p.peer_id), None)
        free = None if backup_only else mine if mine is not None else self._placement(p.hardware, p.peer_id)
        if free is None:
            p.state, p.stage = BACKUP, self._warm_stage(p.hardware)
            return None
        self.slots[free] = p.peer_id
        p.state, p.stage = ACTIVE, free[0]
        self.empty_since.pop(free, None)
        return free

    def lanes(self) -> set[int]:
        """The lanes with at least one slot filled."""
        return {r for _, r in self.slots}

    def complete_lanes(self) -> list[int]:
        """The lanes with every stage's slot filled (only those train), in order."""
        return sorted(r for r in self.lanes() if all((st, r) in self.slots for st in range(self.stages)))

    def _placement(self, hw: HardwareProfile | None, peer_id: str = "") -> Slot | None:
        """Where a newcomer goes: a free slot of the lowest lane, the busiest stage (most parameters) first unless
        the placer finds another of that lane's free slots cheaper, among the stages it has the memory for (None: no
        such slot): a slot of a part-filled lane, or of one of the run's starting lanes (with several stages, only
        before training begins: an empty lane is re-formed from the pool, whole, by `fill_free_slots`; and new lanes
        beyond the starting ones by `grow`)."""
        m = self.ctx.manifest
        lanes_in_use = self.lanes()
        kept = self._reservations()
        free = sorted((r, -m.stage_params(st), st) for st in range(self.stages) if self._fits(hw, st)
                      for r in range(self.replicas) if (st, r) not in self.slots and (st, r) not in kept
                      if r in lanes_in_use or (r < self.starting and (self.stages == 1 or not self._training())))
        if not free:
            return None
        lane = free[0][0]
        return self.placer.choose_slot(peer_id, [(st, r) for r, _, st in free if r == lane], self.slots)

    def _reservations(self) -> dict[Slot, str]:
        """The kept slots still empty (none once training has begun: then anyone may fill them)."""
        if not self.reserved or self._training():
            return {}
        return {k: v for k, v in self.reserved.items() if k not in self.slots}

    def _warm_stage(self, hw: HardwareProfile | None) -> int:
        """The stage a new backup keeps warm: the one with the fewest backups among those it fits (the lowest on
        ties)."""
        counts = [0] * self.stages
        for b in self.backups():
            counts[b.stage] += 1
        fitting = [s for s in range(self.stages) if self._fits(hw, s)] or list(range(self.stages))
        return min(fitting, key=lambda s: (counts[s], s))

    # -- a provider gone -------------------------------------------------------------------------------------
    def vacate(self, peer_id: str, table: AssignmentTable | None) -> list[int]:
        """Take `peer_id` out of its slots, each filled by the best backup of its stage at once (or left empty,
        counting towards its lane's dissolution); returns the stages whose group changed."""
        changed = []
        for key, pid in list(self.slots.items()):
            if pid == peer_id:
                del self.slots[key]
                changed.append(key[0])
                if not self._promote_into(key, peer_id, table):
                    log.warning("no backup of stage %d can fill %s; the group shrinks", key[0], slot_name(*key))
                    self.empty_since.setdefault(key, self.ctx.clock())
        return changed

    def _reach(self) -> dict[str, Reach]:
        """What each provider announced about its reachability (a provider not heard of yet: unknown)."""
        m = self.ctx.membership
        out: dict[str, Reach] = {}
        for pid in self.providers:
            a = m.peers[pid].announcement_record if m is not None and pid in m.peers else None
            if a is not None:
                out[pid] = Reach(reachability=a.reachability)
        return out

    def _best_backup(self, key: Slot, table: AssignmentTable | None) -> Provider | None:
        """The backup to fill slot `key`: of its stage, the most reachable first (a member others dial), and one
        that can get a direct connection to every member it will exchange with (its stage group in `table`, the
        one in force, and lane neighbours; bulk traffic never rides a relay); None when no backup fits."""
        ready = self.promotable(key[0])
        if not ready:
            return None
        reach = self._reach()
        stage, lane = key
        peers = [pid for pid in (table.group_members(stage) if table else ())]
        peers += [pid for (st, r), pid in self.slots.items() if r == lane and abs(st - stage) == 1]
        by_id = {b.peer_id: b for b in ready}
        unknown = Reach()
        # whether a backup fits depends only on the members' distinct reachabilities (a handful), not on each member:
        # one check per kind keeps a promotion linear in the backups at crowd size (bench/bench_table.py)
        kinds, others = {reach.get(q, unknown) for q in peers}, set(peers)
        fitting = [pid for pid in rank_for_dialed_roles([b.peer_id for b in ready], reach)
                   if all(direct_possible(reach.get(pid, unknown), r)
                          for r in (kinds if pid not in others else {reach.get(q, unknown) for q in others - {pid}}))]
        chosen = self.placer.choose_backup(key, fitting, self.slots)  # the first unless another is cheaper
        return by_id[chosen] if chosen is not None else None

    def _promote_into(self, key: Slot, failed: str, table: AssignmentTable | None) -> bool:
        b = self._best_backup(key, table)
        if b is None:
            return False
        self.slots[key] = b.peer_id
        b.state = ACTIVE
        self.promotions.append((self.ctx.wall(), slot_name(*key), failed, b.peer_id))
        log.info("promoted backup %s into %s (was %s)", b.peer_id, slot_name(*key), failed)
        return True

    # -- a move to a better placement ------------------------------------------------------------------------
    def apply(self, change: Change, expected: dict[Slot, str]) -> list[int]:
        """Apply a placer's move, planned on the seats `expected`: slots take their new holders (a backup taking
        one becomes active, keeping that stage warm from now on), displaced providers go to the backup pool
        keeping their old stage warm. Refused (nothing changes, [] returned) when the seats changed meanwhile or
        a provider it names is no longer live. Returns the stages whose group changed."""
        live = {p for p, q in self.providers.items() if q.state in (ACTIVE, BACKUP) and not q.suspect}
        if any(self.slots.get(k) != v for k, v in expected.items()) or not set(change.assign.values()) <= live:
            log.info("re-plan dropped: the seats changed while it was planned")
            return []
        old = {k: self.slots.get(k) for k in change.assign}
        for key, pid in change.assign.items():
            self.slots[key] = pid
            seated = self.providers[pid]
            seated.state, seated.stage = ACTIVE, key[0]
            self.empty_since.pop(key, None)
        for pid in change.to_pool:
            p = self.providers.get(pid)
            if p is not None and self.slot_of(pid) is None:
                was = next((k for k, v in old.items() if v == pid), None)
                p.state, p.stage = BACKUP, was[0] if was is not None else p.stage
        log.info("re-planned: %s; %s", ", ".join(f"{slot_name(*k)} {(old[k] or '-')[-8:]} -> {v[-8:]}"
                                                   for k, v in sorted(change.assign.items())), change.why)
        return sorted({k[0] for k in change.assign})

    # -- each liveness check ---------------------------------------------------------------------------------
    def fill_free_slots(self, table: AssignmentTable | None) -> list[int]:
        """Backups into free slots of part-filled lanes and of the starting lanes: with one stage, any such slot;
        with several, a lane only when every free slot of it can be filled at once (a part-filled lane cannot
        train). Returns the stages whose group changed."""
        changed, kept = [], self._reservations()
        in_use = self.lanes()
        for r in range(self.replicas):
            free = [(st, r) for st in range(self.stages) if (st, r) not in self.slots and (st, r) not in kept]
            if not free or (r not in in_use and r >= self.starting):
                continue
            if self.stages > 1 and any(self._best_backup(k, table) is None for k in free):
                continue  # not every free slot of the lane can be filled now
            for key in free:
                if self._promote_into(key, "", table):
                    self.empty_since.pop(key, None)
                    changed.append(key[0])
        return changed

    def grow(self, table: AssignmentTable | None) -> list[int]:
        """New lanes from the pool while the run is below its maximum: whenever every stage has a promotable backup
        beyond the `reserve` it keeps warm, the best of each forms a lane at the lowest free lane index (one that
        can reach the lane's neighbours and its stage group directly). Returns the stages whose group changed."""
        changed: list[int] = []
        while len(self.lanes()) < self.replicas:
            if any(len(self.promotable(st)) <= self.reserve for st in range(self.stages)):
                break
            open_lanes = set(range(self.replicas)) - self.lanes() - {r for _, r in self._reservations()}
            if not open_lanes:
                break  # the rest are kept for a resumed run's peers
            r = min(open_lanes)
            keys = [(st, r) for st in range(self.stages)]
            if any(self._best_backup(k, table) is None for k in keys):
                break  # no backup of some stage can take a place there now (reachability): the next check retries
            for key in keys:
                self._promote_into(key, "", table)
                self.empty_since.pop(key, None)
                changed.append(key[0])
            log.info("lane %d formed from the pool: the run has %d of at most %d lanes", r, len(self.lanes()),
                     self.replicas)
        return changed

    def dissolve_stale_lanes(self) -> list[int]:
        """Dissolve every lane with a slot empty for `dissolve_after_s` that no backup can fill: its members go back
        to the pool, keeping their stage warm. Returns the stages whose group changed."""
        now, changed = self.ctx.clock(), []
        for key, since in list(self.empty_since.items()):
            if key not in self.empty_since:
                continue  # its lane was dissolved for another of its empty slots
            if key in self.slots:
                del self.empty_since[key]
                continue
            if now - since < self.dissolve_after_s or self.promotable(key[0]):
                continue
            lane = key[1]
            members = [(k, pid) for k, pid in self.slots.items() if k[1] == lane]
            for k, pid in members:
                del self.slots[k]
                p = self.providers.get(pid)
                if p is not None:
                    p.state, p.stage = BACKUP, k[0]
            for k in [k for k in self.empty_since if k[1] == lane]:
                del self.empty_since[k]
            changed.append(key[0])
            self.dissolved += 1
            log.warning("dissolved lane %d: slot %s empty for %.0f s with no backup of stage %d; its %d members "
                        "return to the pool", lane, slot_name(*key), now - since, key[0], len(members))
        return changed
