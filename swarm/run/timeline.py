"""Which group holds at which training step: the recent assignment tables of a run and their switch steps.

A table's group for stage s takes effect at `table.switch_step(s)`, the round boundary every member of that stage
changes at; until then the previous table's group holds. This is the one place that rule lives.
"""

from __future__ import annotations

from dataclasses import replace

from shoal.protocol.assignment import AssignmentTable
from shoal.swarm.run.group import Group

MAX_TABLES = 64  # tables kept: enough to answer for every step a member can still be at


def group_of(table: AssignmentTable, me: str) -> Group | None:
    """`me`'s group under `table` (its stage's members in complete lanes, and the epoch), or None when the table
    gives it no slot or its lane is not complete (a lane trains only with every stage filled)."""
    slot = table.slot_of(me)
    if slot is None or slot[1] not in table.complete_lanes():
        return None
    stage = slot[0]
    members = table.group_members(stage)
    shares = table.lane_shares()
    lanes = [s[1] for m in members if (s := table.slot_of(m)) is not None]
    weights = tuple(shares[r] for r in lanes) if all(r in shares for r in lanes) else ()
    return Group(run_id=table.run_id, stage=stage, epoch=table.epochs[stage], members=members, me=me,
                 weights=weights)


def lane_peers(table: AssignmentTable, me: str) -> tuple[str | None, str | None]:
    """(previous, next) stage's peer in `me`'s lane under `table` (None at the lane's ends or for an empty slot)."""
    slot = table.slot_of(me)
    if slot is None:
        return None, None
    stage, lane = slot
    prev = table.slot_peer(stage - 1, lane) if stage > 0 else None
    nxt = table.slot_peer(stage + 1, lane) if stage + 1 < table.stages else None
    return prev, nxt


def live_tables(tables: list[AssignmentTable], stage: int, step: int) -> list[AssignmentTable]:
    """Of `tables` (oldest first), those whose group of `stage` can still act at or after `step`: the newest in
    force at `step` and those announced for later steps."""
    tables = [t for t in tables if stage < t.stages]
    in_force = [t for t in tables if t.switch_step(stage) <= step][-1:]
    return in_force + [t for t in tables if t.switch_step(stage) > step]


class GroupTimeline:
    """The tables one node has accepted, newest last (owned by the event loop)."""

    def __init__(self, me: str, *, keep: int = MAX_TABLES):
        self.me = me
        self.keep = keep
        self.tables: list[AssignmentTable] = []

    def add(self, table: AssignmentTable) -> bool:
        """Keep `table` if it is newer than the last one; True if it was kept."""
        if self.tables and not table.newer_than(self.tables[-1]):
            return False
        self.tables = (self.tables + [table])[-self.keep:]
        return True

    @property
    def latest(self) -> AssignmentTable | None:
        return self.tables[-1] if self.tables else None

    def stage(self) -> int | None:
        """The stage this node holds (or held last): the stage of its slot in the newest table that gives it one."""
        for t in reversed(self.tables):
            slot = t.slot_of(self.me)
            if slot is not None:
                return slot[0]
        return None

    def table_at(self, step: int, stage: int) -> AssignmentTable | None:
        """The newest table whose group for `stage` has taken effect by `step`."""
        for t in reversed(self.tables):
            if t.switch_step(stage) <= step:
                return t
        return None

    def group_at(self, step: int, stage: int | None = None) -> Group | None:
        """This node's group of `stage` (default: the stage of its newest slot) for the round of `step`, or None
        when it holds no slot of that stage then."""
        stage = self.stage() if stage is None else stage
        t = self.table_at(step, stage) if stage is not None else None
        g = group_of(t, self.me) if t is not None else None
        if t is None or g is None or g.stage != stage:
            return None
        switch = t.switch_step(stage)
        before = self.table_at(switch - 1, stage) if switch > 0 else None
        if before is None:  # the run's first group, or one whose predecessor this node never saw
            return g
        was = set(before.group_members(stage))
        return replace(g, entering=frozenset(m for m in g.members if m not in was))

    def epoch_start(self, stage: int, epoch: int) -> int | None:
        """The step at which `stage`'s group epoch `epoch` took effect (the first switch step of the tables this node
        holds with that epoch; a later table of the same epoch moves no one), or None when none holds it."""
        steps = [t.switch_step(stage) for t in self.tables if stage < t.stages and t.epochs[stage] == epoch]
        return min(steps) if steps else None

    def entry(self) -> tuple[int, int, int] | None:
        """(step, stage, replica) of this node's slot in the newest table, or None when it has none: the switch step
        at which its stage's group took effect with this node in this slot (a later table of the same group epoch,
        a new split of the batch, moves no one's entry)."""
        t = self.latest
        slot = t.slot_of(self.me) if t is not None else None
        if t is None or slot is None:
            return None
        stage, step = slot[0], t.switch_step(slot[0])
        for older in reversed(self.tables[:-1]):
            if older.epochs[stage] != t.epochs[stage] or older.slot_of(self.me) != slot:
                break
            step = older.switch_step(stage)
        return step, stage, slot[1]

    def names_on_lane(self, peer: str, stage: int, lane: int, other_stage: int, step: int) -> bool:
        """Whether a table whose groups can still act at or after `step` puts `peer` in slot (stage, lane) and this
        node in slot (other_stage, lane): a lane neighbour this node may link with."""
        return any(t.slot_peer(stage, lane) == peer and t.slot_peer(other_stage, lane) == self.me
                   for t in live_tables(self.tables, min(stage, other_stage), step))

    def switch_steps(self, table: AssignmentTable) -> set[int]:
        """The steps at which `table`'s groups take effect (members snapshot their state there for joiners)."""
        return {table.switch_step(s) for s in range(table.stages) if table.switch_step(s) > 0}
