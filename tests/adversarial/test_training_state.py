"""A node pulling a group's state takes the state the majority holds: a source that claims the majority's hash
and serves a poisoned or malformed state is penalised and the next one tried; a source off the majority is never
used; with no majority nothing is loaded. Real hosts on 127.0.0.1 with shoal's state servers, one of them lying."""

from __future__ import annotations

from contextlib import AsyncExitStack

import pytest
import torch

from shoal.swarm.net.penalty import Penalties
from shoal.swarm.state.agreed import pull_agreed
from shoal.swarm.state.snapshot import Snapshot, StateTransferError
from shoal.swarm.state.transfer import StateServer, StateTransferConfig, part_hash
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
    """A replica's state at REV: the group's parameters and synchronized copy, its own data position and RNG."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 64, generator=g) + model_shift
    return Snapshot.of({"model": {"w": w}, "sync": {"g": w.half()}, "data": {"replica": replica},
                        "rng": torch.randn(8) * replica}, REV)


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
        pen = Penalties()
        got = await pull_agreed(client, [s.peer_id for s in servers], revision=REV, agree_on=("/model/", "/sync/"),
                                penalties=pen, config=CFG, rng=LiarFirst({liar.peer_id}))
        assert part_hash(got, ("/model/", "/sync/")) == part_hash(states[0], ("/model/", "/sync/"))
        assert torch.equal(got.tensors["/model/w"], states[0].tensors["/model/w"])  # an honest replica's
        assert "claimed the majority's hash" in pen.reasons(liar.peer_id)[0]
        assert not any(pen.reasons(s.peer_id) for s in servers[:2])


async def test_a_source_off_the_majority_is_never_used_and_without_a_majority_nothing_loads():
    honest, other = replica_state(0), replica_state(1, model_shift=1.0)
    async with AsyncExitStack() as stack:
        servers = [await stack.enter_async_context(bare_host()) for _ in range(3)]
        client = await stack.enter_async_context(bare_host([s.addrs[0] for s in servers]))
        for sh, snap in zip(servers, [honest, honest, other]):
            StateServer(sh, lambda: None, by_revision=lambda r, snap=snap: snap)
        ids = [s.peer_id for s in servers]
        pen = Penalties()
        got = await pull_agreed(client, ids, revision=REV, agree_on=("/model/",), penalties=pen, config=CFG,
                                rng=LiarFirst({ids[2]}))
        assert torch.equal(got.tensors["/model/w"], honest.tensors["/model/w"])
        with pytest.raises(StateTransferError, match="no majority"):  # one of each: no state is the group's
            await pull_agreed(client, [ids[0], ids[2]], revision=REV, agree_on=("/model/",), penalties=pen,
                              config=CFG)
