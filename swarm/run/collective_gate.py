"""Which messages a node's collective takes: from members of a group epoch it knows, under that group's tags."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import trio

from shoal.protocol.assignment import GONE, AssignmentTable
from shoal.protocol.manifest import RunManifest
from shoal.swarm.net.penalty import Allowance
from shoal.swarm.run.timeline import live_tables

EPOCHS_AHEAD = 4  # a provider's messages under an epoch this far past the newest known are dropped unpunished ...
EARLY_FREE = 8  # ... this many times per peer within EARLY_WINDOW_S (a table still on its way); then an offence
EARLY_WINDOW_S = 60.0


@dataclass(frozen=True, kw_only=True, slots=True)
class Refusal:
    why: str
    penalize: bool  # False: maybe an honest race (a group epoch this node has not heard of yet): dropped only
    # True: an epoch this node has not heard of yet, from a provider of the run: the message is kept like an early
    # one, and the gate asked again when this node's own round under that tag begins (its table has come by then)
    hold: bool = False


class CollectiveGate:
    """`gate(peer, tag)`: None to take the message, else a Refusal. A round's tag names the run, the stage and the
    group epoch (Group.tag); the sender must be a member of that stage's group at that epoch in one of the tables
    this node follows (the one in force and those announced for later steps; tables are signed by the run's
    authorised broker). Nothing else reaches the inbox: a tag of another run, or from a peer that is no member of
    a known epoch, is an offence; an epoch newer than any this node knows is held, a few times, when a provider of
    the run sends it (the table re-forming the group is still on its way here: the message counts if the table
    says so once it has come, Collective's `hold`), an offence beyond that or from anyone else."""

    def __init__(self, run_id: str, tables: Callable[[], Sequence[AssignmentTable]],
                 step: Callable[[], int] | None = None, clock: Callable[[], float] = trio.current_time):
        self.prefix = run_id[:16]
        self.tables = tables
        # the oldest step whose round may still send (this node's step, less the steps a round may overlap): an
        # epoch that ended before it is over (None: no epoch ends)
        self.step = step
        self.clock = clock
        self._early = Allowance(EARLY_FREE, EARLY_WINDOW_S, clock)  # unknown epochs refused unpunished

    def __call__(self, peer: str, tag: str) -> Refusal | None:
        parts = tag.split("/")
        if len(parts) < 5 or parts[0] != self.prefix:
            return Refusal(why=f"tag {tag[:60]!r} is not one of this run's rounds", penalize=True)
        try:
            stage, epoch, round_ = int(parts[1]), int(parts[2]), int(parts[3])
        except ValueError:
            return Refusal(why=f"malformed round tag {tag[:60]!r}", penalize=True)
        if min(stage, epoch, round_) < 0:
            return Refusal(why=f"malformed round tag {tag[:60]!r}", penalize=True)
        known, newest, tables = False, -1, list(self.tables())
        live = self._live_epochs(tables, stage)
        for t in tables:
            if stage < t.stages:
                newest = max(newest, t.epochs[stage])
                if t.epochs[stage] == epoch:
                    known = True
                    if peer in t.group_members(stage):  # a group epoch has one membership, in every table
                        if epoch in live:
                            return None
                        return Refusal(why=f"stage {stage}'s epoch {epoch} is over here", penalize=False)
        if known:
            return Refusal(why=f"not a member of stage {stage}'s group at epoch {epoch}", penalize=True)
        # a group this node does not know: nobody's messages wait for it. A provider of the run may be honest (a
        # table naming it has not reached this node yet, or one this node no longer keeps): dropped, unpunished a
        # few times
        latest = tables[-1] if tables else None
        why = f"stage {stage} epoch {epoch} is unknown here"
        if latest is not None and epoch <= newest + EPOCHS_AHEAD and \
                latest.provider_state(peer) not in (None, GONE) and self._early.take(peer):
            return Refusal(why=why, penalize=False, hold=True)
        return Refusal(why=why, penalize=True)

    def _live_epochs(self, tables: list[AssignmentTable], stage: int) -> set[int]:
        """The epochs of `stage` whose rounds can still come: the one in force at `step()` and those of tables
        announced for later steps (every known epoch when there is no `step`)."""
        live = [t for t in tables if stage < t.stages] if self.step is None else live_tables(tables, stage, self.step())
        return {t.epochs[stage] for t in live}


@dataclass(frozen=True, kw_only=True, slots=True)
class InboxLimits:
    """What a training node's collective lets its group's members put in its inbox (Collective's keywords)."""

    max_frame_bytes: int  # one message
    max_peer_buffer_bytes: int  # one member's messages waiting for their exchange
    max_buffer_bytes: int  # everyone's
    max_wait_s: float  # how long a message may wait for its exchange


def inbox_limits(manifest: RunManifest, round_timeout_s: float, entry_grace_rounds: float) -> InboxLimits:
    """Caps sized by the run: no honest message is larger than 8 bytes per parameter of the largest stage (an fp32
    chunk, or a compressed one with its indices) plus framing, no member has more than two waiting (the next
    round's first phase, sent by a member a step ahead), no group has more than the run's most lanes as members
    (`lanes_max`: an elastic run grows to it), and none waits longer than its sender waits for this node: two round
    deadlines, and `entry_grace_rounds` more in an epoch's first round for a node entering the group (which pulls the
    group's state first: the members' messages must outlast that wait, else a member that waited for the entering
    node finds it answering without the part the member sent, dropped meanwhile). So a member's flood costs at most
    two messages' memory, given back when they expire."""
    frame = 8 * max(manifest.stage_params(s) for s in range(manifest.plan.stages)) + (1 << 20)
    peer = 2 * frame
    return InboxLimits(max_frame_bytes=frame, max_peer_buffer_bytes=peer,
                       max_buffer_bytes=peer * max(2, manifest.plan.lanes_max),
                       max_wait_s=(2 + entry_grace_rounds) * round_timeout_s + 10.0)
