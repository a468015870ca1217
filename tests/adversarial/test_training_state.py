"""A node entering a group pulls the state the majority holds: a member that claims the majority's hash and serves
a poisoned or malformed state is penalised, the next source is tried, and the joiner enters with the group's state."""

from __future__ import annotations

import pytest

import shoal.swarm.state.agreed as agreed
from tests.adversarial.poisoner import serve_lies
from tests.swarm_helpers import running_node, wait_for
from tests.test_run_runtime import finished, hashes, manifest, node_config

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]


class LiarFirst:
    """The draw among the majority's sources, rigged so the liar is tried first (the attack's best case)."""

    liar = ""

    def shuffle(self, xs: list[str]) -> None:
        xs.sort(key=lambda p: p != self.liar)


@pytest.mark.parametrize("malformed", [False, True], ids=["poisoned", "malformed"])
async def test_a_joiner_rejects_a_lying_state_source_and_enters_with_the_majoritys_state(monkeypatch, malformed):
    steps = 40
    cfg = node_config(manifest("cocktail", replicas=4), steps, start_wait_s=1.0)
    monkeypatch.setattr(agreed.random, "SystemRandom", LiarFirst)
    async with running_node((), cfg) as first:
        addrs = first.sh.addrs
        async with running_node(addrs, cfg) as second, running_node(addrs, cfg) as liar:
            group = [first, second, liar]
            await wait_for(lambda: all(n.runtime.trainer is not None and n.runtime.trainer.step_count >= 5
                                       for n in group), 60, "three replicas to train")
            serve_lies(liar.sh, liar.runtime.snapshots.at, malformed=malformed)
            LiarFirst.liar = liar.peer_id
            async with running_node(addrs, cfg) as late:
                await wait_for(lambda: late.runtime.entries, 60, "the joiner to enter the group")
                reasons = late.penalties.reasons(liar.peer_id)
                assert reasons and "claimed the majority's hash" in reasons[0]  # tried first, caught, penalised
                await wait_for(lambda: finished(group + [late]), 120, "the run to finish with four")
                assert len(hashes(group + [late])) == 1  # it entered with the group's state, not the liar's
                assert late.runtime.trainer.step_count == steps
