"""A member serving states it does not hold (real in-process nodes on 127.0.0.1, a real broker, all-reduce): it
reports the group's hash when asked, then serves a state of its own, self-consistent (its checksum matches)
but poisoned in the model, or in the optimizer's moments alone, or one that this version cannot read. Whatever a
node loads (a re-fetch after a lost vote, an entry into the group) is the whole state the members agree on: the
liar's is refused before it is loaded, the liar penalized, the node keeps running and ends with the group's state.
The liar's peer id is ground to be the lowest (the old re-fetch took the vote's lowest holder), and every draw of
a source is rigged to try it first (the attack's best case)."""

from __future__ import annotations

import logging
import random

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from shoal.swarm.net.identity import peer_id_of
from tests.adversarial.poisoner import serve_lies
from tests.helpers.progress import wait_training
from tests.helpers.swarm import running_node, wait_for
from tests.swarm.test_run_runtime import finished, hashes, manifest, node_config

pytestmark = [pytest.mark.slow, pytest.mark.own_process, pytest.mark.usefixtures("one_torch_thread")]


def lowest_key(than: list[str]) -> Ed25519PrivateKey:
    """An identity whose peer id sorts below every one of `than` (identities are free: a few tries)."""
    while True:
        k = Ed25519PrivateKey.generate()
        if all(peer_id_of(k) < p for p in than):
            return k


def rig_draws(liar: str, monkeypatch) -> None:
    """Every shuffle of sources puts the liar first."""
    monkeypatch.setattr(random.SystemRandom, "shuffle", lambda self, xs: xs.sort(key=lambda p: p != liar))


@pytest.mark.parametrize("attack", ["refetch-model", "entry-optimizer", "entry-malformed"])
async def test_a_member_serving_another_state_than_the_group_holds_is_never_loaded(attack, monkeypatch, caplog):
    for name in ("shoal.node.run.entry", "shoal.node.run.pulls", "shoal.swarm.state.agreed", "shoal.node.run.votes"):
        caplog.set_level(logging.DEBUG, name)  # a failure shows whom each pull asked and what each source answered
    steps = 80
    joiner_enters = attack.startswith("entry")
    owner = Ed25519PrivateKey.generate()
    m = manifest("allreduce", replicas=4 if joiner_enters else 3).signed(owner)
    cfg = node_config(m, steps, start_wait_s=1.0)
    async with running_node((), cfg, key=owner) as first, running_node(first.sh.addrs, cfg) as second:
        key = lowest_key([first.peer_id, second.peer_id])
        async with running_node(first.sh.addrs, cfg, key=key) as liar:
            group = [first, second, liar]
            await wait_training(group, 3, 5, 60, "three members to train")
            served = serve_lies(liar.sh, liar.runtime.snapshots.at, malformed=attack == "entry-malformed",
                                poison="/optimizer/" if attack == "entry-optimizer" else "/model/")
            rig_draws(liar.peer_id, monkeypatch)
            if joiner_enters:
                async with running_node(first.sh.addrs, cfg) as victim:
                    await wait_for(lambda: victim.runtime.entry is not None and victim.runtime.entry.entries, 90, "the joiner to enter")
                    await wait_for(lambda: finished([*group, victim]), 120, "the run to finish")
                    honest = [first, second, victim]
            else:
                victim = second
                corrupted: list[int] = []

                def corrupt(trainer) -> None:  # the victim drifts: it must re-fetch the group's state
                    if not corrupted:
                        victim.runtime.replica.sync.close(trainer.model)
                        with torch.no_grad():
                            next(trainer.model.parameters()).add_(1e-3)
                        corrupted.append(trainer.step_count)
                victim.runtime.replica.trainer.before_step_hooks.append(corrupt)
                await wait_for(lambda: victim.runtime.consistency.refetches >= 1, 60, "the victim to re-fetch")
                await wait_for(lambda: finished(group), 120, "the run to finish")
                honest = [first, second]
            print(f"{attack}: the liar served its state to {len(served)} pull(s), was penalized by the victim: "
                  f"{bool(victim.penalties.reasons(liar.peer_id))}; final hashes of the honest replicas: "
                  f"{sorted({h[:12] for h in hashes(honest)})}; victim re-fetches {victim.runtime.consistency.refetches}")
            assert victim.peer_id in served  # the liar was asked first (and only then the others)
            assert "claimed the agreed hash" in victim.penalties.reasons(liar.peer_id)[0]
            assert len(hashes(honest)) == 1 and all(n.runtime.replica.trainer.step_count == steps for n in honest)
