"""Poisoning replicas for the training attack tests: a real member whose synchronizer lies about the numbers.

The attacker is a replica like the others (its own libp2p host on 127.0.0.1, its own trainer thread, shoal's own
synchronizer and collective); only its outgoing updates are rewritten by a `Fault` from
`shoal.node.experiments.poison`: its contributions to the chunk owners scaled or sign-flipped, or, as the owner of
a chunk, its broadcast of that chunk's aggregate. The group harness is the synchronizer tests' (`run_group`).
"""

from __future__ import annotations

import math

from shoal.node.experiments.poison import broadcast, contribution, poisoner
from shoal.node.train.trainer import Trainer
from shoal.protocol.manifest import CocktailSpec, DilocoSpec
from tests.test_sync_groups import corpus, flat, run_group, run_manifest

__all__ = ["ATTACK_METHODS", "attack_manifest", "broadcast", "contribution", "corpus", "flat", "heldout_drop", "honest_agree",
           "poisoner", "run_group"]

#: every synchronizer with a round each step, so a few steps give an owner enough rounds to judge a member
ATTACK_METHODS = {
    "allreduce": {},
    "cocktail": {"cocktail": CocktailSpec(p=0.1, r=0.2, bits=4, warmup_steps=0)},
    "diloco-e3m0": {"diloco": DilocoSpec(inner_steps=2, e3m0=True, outer_lr=1.0, outer_momentum=0.5)},
}


def attack_manifest(method: str, steps: int, replicas: int = 3):
    return run_manifest(method.split("-")[0], steps, replicas, **ATTACK_METHODS[method])


def honest_agree(reps, steps: int) -> None:
    """Every honest replica trained every step with finite losses, and their synchronized states hash equal after
    every round."""
    for r in reps:
        assert len(r.losses) == steps and all(math.isfinite(x) for x in r.losses), r.losses
    for k in range(steps):
        assert len({r.hashes[k] for r in reps}) == 1, f"honest replicas' state hashes differ after step {k}"


def heldout_drop(reps, manifest) -> list[float]:
    """How far each replica's held-out loss fell below that of the common initialization (same seed)."""
    start = Trainer(manifest, corpus=corpus()).evaluate()
    return [start - r.trainer.evaluate() for r in reps]
