"""A node pulling a group's state takes the state the majority holds: a source that claims the majority's hash
and serves a poisoned or malformed state is penalised and the next one tried; a source off the majority is never
used; with no majority nothing is loaded. Real hosts on 127.0.0.1 with shoal's state servers, one of them lying."""

from __future__ import annotations

from contextlib import AsyncExitStack

import pytest
import torch

from shoal.swarm.net.penalty import Penalties
from shoal.swarm.state.agreed import NobodyHolds, NoSourceLeft, pull_agreed
from shoal.swarm.state.snapshot import Snapshot, StateTransferError
from shoal.swarm.state.transfer import StateServer, StateTransferConfig
from tests.adversarial.poisoner import serve_lies
from tests.helpers.swarm import bare_host

CFG = StateTransferConfig(timeout_s=5.0)
REV = 7


class LiarFirst:
    """The draw among the majority's sources, rigged so the liars are tried first (the attack's best case)."""

    def __init__(self, liars: set[str]):
        self.liars = liars

    def shuffle(self, xs: list[str]) -> None:
        xs.sort(key=lambda p: p not in self.liars)


def replica_state(replica: int, *, model_shift: float = 0.0) -> Snapshot:
    """What a replica serves at REV: the group's entry state (Trainer.entry_state: every replica's the same, its own
    parts left out), here the parameters, the optimizer's moments, the synchronized copy and the metadata."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 64, generator=g) + model_shift
    return Snapshot.of({"format": 2, "step": REV, "model": {"w": w}, "optimizer": {"m": w * 0.1},
                        "sync": {"g": w.half()}, "data": {"position": 4 * REV}}, REV)


@pytest.mark.parametrize("malformed", [False, True], ids=["poisoned", "malformed"])
async def test_a_source_lying_about_its_state_is_penalised_and_the_majoritys_state_pulled(malformed):
    states = [replica_state(i) for i in range(3)]
    async with AsyncExitStack() as stack:
        servers = [await stack.enter_async_context(bare_host()) for _ in range(3)]
        client = await stack.enter_async_context(bare_host([s.addrs[0] for s in servers]))
        for sh, snap in zip(servers[:2], states):
            StateServer(sh, lambda: None, by_revision=lambda r, snap=snap: snap if r == REV else None)
        liar = servers[2]
        serve_lies(liar, lambda r: states[2] if r == REV else None, malformed=malformed)
        pen, refused = Penalties(), set()
        got = await pull_agreed(client, [s.peer_id for s in servers], revision=REV, penalties=pen, config=CFG,
                                rng=LiarFirst({liar.peer_id}), refused=refused)
        assert got.hash == states[0].hash  # the whole state: model, optimizer, synchronizer, metadata
        assert torch.equal(got.tensors["/model/w"], states[0].tensors["/model/w"])  # an honest replica's
        assert "claimed the agreed hash" in pen.reasons(liar.peer_id)[0]
        assert not any(pen.reasons(s.peer_id) for s in servers[:2])
        assert refused == {liar.peer_id}  # a retry of the same pull (a node's next round) does not ask it again
        again = await pull_agreed(client, [s.peer_id for s in servers], revision=REV, penalties=pen, config=CFG,
                                  rng=LiarFirst({liar.peer_id}), refused=refused)
        assert again.hash == states[0].hash and len(pen.reasons(liar.peer_id)) == 1
        with pytest.raises(NoSourceLeft):  # a re-fetch gives up: the next vote picks another revision
            await pull_agreed(client, [s.peer_id for s in servers], revision=REV, penalties=pen, config=CFG,
                              refused=refused | {s.peer_id for s in servers[:2]})


async def test_a_source_that_dropped_the_revision_since_it_told_its_hash_is_passed_over_unpenalised():
    """A member tells its hash at the revision, then drops that revision before the pull reaches it (it keeps a few):
    it answers that it no longer holds it, which is no lie. The pull goes on to the next holder, and does not ask it
    again in this pull."""
    held = replica_state(0)
    async with AsyncExitStack() as stack:
        servers = [await stack.enter_async_context(bare_host()) for _ in range(3)]
        client = await stack.enter_async_context(bare_host([s.addrs[0] for s in servers]))
        asked: list[int] = []

        def dropping(r: int) -> Snapshot | None:  # held when its hash is asked, gone when its state is
            asked.append(r)
            return held if len(asked) == 1 else None
        StateServer(servers[0], lambda: None, by_revision=dropping)
        for sh in servers[1:]:
            StateServer(sh, lambda: None, by_revision=lambda r: held)
        pen, refused = Penalties(), set()
        got = await pull_agreed(client, [s.peer_id for s in servers], revision=REV, penalties=pen, config=CFG,
                                rng=LiarFirst({servers[0].peer_id}), refused=refused)
        assert got.hash == held.hash and len(asked) == 2  # its hash, then the state it no longer held
        assert refused == {servers[0].peer_id} and not any(pen.reasons(s.peer_id) for s in servers)


async def test_a_source_off_the_majority_is_never_used_and_without_a_majority_nothing_loads():
    honest, other = replica_state(0), replica_state(1, model_shift=1.0)
    async with AsyncExitStack() as stack:
        servers = [await stack.enter_async_context(bare_host()) for _ in range(3)]
        client = await stack.enter_async_context(bare_host([s.addrs[0] for s in servers]))
        for sh, snap in zip(servers, [honest, honest, other]):
            StateServer(sh, lambda: None, by_revision=lambda r, snap=snap: snap)
        ids = [s.peer_id for s in servers]
        pen = Penalties()
        got = await pull_agreed(client, ids, revision=REV, penalties=pen, config=CFG, rng=LiarFirst({ids[2]}))
        assert torch.equal(got.tensors["/model/w"], honest.tensors["/model/w"])
        with pytest.raises(StateTransferError, match="no majority"):  # one of three members answers: no majority
            await pull_agreed(client, [ids[2]], revision=REV, voters=3, penalties=pen, config=CFG)


async def test_a_member_that_will_not_train_to_the_revision_has_no_say_one_still_training_holds_the_pull():
    """A member asked for a revision it does not hold: one that will not come to hold it by training (a backup, a
    restarted node, a member itself entering or re-fetching there) has no say, so the others decide (when none of
    those asked has one, the pull says so: NobodyHolds); one still training toward it counts against every hash
    until it gets there (nothing loads on one member's word)."""
    held = replica_state(0)
    async with AsyncExitStack() as stack:
        holder, pulling, training = [await stack.enter_async_context(bare_host()) for _ in range(3)]
        client = await stack.enter_async_context(bare_host([s.addrs[0] for s in (holder, pulling, training)]))
        StateServer(holder, lambda: None, by_revision=lambda r: held if r == REV else None)
        StateServer(pulling, lambda: None, by_revision=lambda r: None, may_hold=lambda r: False)
        StateServer(training, lambda: None, by_revision=lambda r: None, may_hold=lambda r: r >= REV)
        pen = Penalties()
        got = await pull_agreed(client, [holder.peer_id, pulling.peer_id], revision=REV, voters=2, penalties=pen,
                                config=CFG)
        assert got.hash == held.hash
        with pytest.raises(NobodyHolds):  # nobody asked holds it or trains toward it: a re-fetch stops waiting
            await pull_agreed(client, [pulling.peer_id], revision=REV, voters=1, penalties=pen, config=CFG)
        with pytest.raises(StateTransferError, match="no majority of 2 members"):
            await pull_agreed(client, [holder.peer_id, training.peer_id], revision=REV, voters=2, penalties=pen,
                              config=CFG)
        assert not any(pen.reasons(s.peer_id) for s in (holder, pulling, training))


@pytest.mark.parametrize("method", ["allreduce", "cocktail", "diloco-e3m0"])
async def test_every_replica_serves_the_same_whole_entry_state_and_a_joiner_loads_the_group_state(method):
    """What a group serves an entering replica is its whole state (model, optimizer, synchronizer state, metadata)
    as entering loads it, bit for bit the same on every replica, so one hash a strict majority reports vouches for
    all of it; loaded by a new replica of another index, it holds the group's synchronized state."""
    from shoal.node.sync.factory import make_synchronizer
    from shoal.node.train.checkpoint import CheckpointError
    from shoal.node.train.control import StepControl
    from shoal.node.train.trainer import Trainer
    from tests.adversarial.poisoner import attack_manifest, corpus, run_group

    steps = 6
    m = attack_manifest(method, steps)
    reps, _ = await run_group(m, steps, timeout_s=5.0)
    snaps = [Snapshot.of(r.trainer.snapshot(StepControl(step=steps)), steps) for r in reps]
    assert len({s.hash for s in snaps}) == 1  # the whole state, skeleton included
    state = snaps[0].state()
    assert "rng" not in state and "replica" not in state["data"]  # a replica's own is not passed on
    sync = make_synchronizer(m, exchange=lambda *a: {}, penalties=Penalties())  # never rounds here
    joiner = Trainer(m, replica=2, synchronizer=sync, corpus=corpus())
    joiner.check_entry(state, steps)
    joiner.load_state_dict(state)
    joiner.sync.enter(joiner.model)
    assert joiner.step_count == steps and joiner.sync.state_hash() == reps[0].sync.state_hash()
    with pytest.raises(CheckpointError, match="its step is not"):
        joiner.check_entry(state, steps + 1)
    with pytest.raises(CheckpointError, match="another format"):
        joiner.check_entry({**state, "format": 999}, steps)

