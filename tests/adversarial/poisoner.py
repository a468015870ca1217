"""Poisoning replicas for the training attack tests: a real member whose synchronizer lies about the numbers.

The attacker is a replica like the others (its own libp2p host on 127.0.0.1, its own trainer thread, shoal's own
synchronizer and collective); only its outgoing updates are rewritten by a `Fault` from
`shoal.bench.poison`: its contributions to the chunk owners scaled or sign-flipped, or, as the owner of
a chunk, its broadcast of that chunk's aggregate. The group harness is the synchronizer tests' (`run_group`).
`serve_lies` turns a member's state server into one that lies about the state it serves.
"""

from __future__ import annotations

import math
from dataclasses import replace

import trio

from shoal.kernels.codec import dtype_name
from shoal.bench.poison import broadcast, contribution, poisoner
from shoal.node.train.trainer import Trainer
from shoal.protocol.manifest import BatchSpec, CocktailSpec, DilocoSpec
from shoal.protocol.wire import pack, unpack
from shoal.swarm.net.framing import read_frame, write_frame
from shoal.swarm.state.snapshot import raw_bytes, state_hash
from shoal.swarm.state.transfer import STATE_PROTOCOL, part_hash
from tests.swarm.test_sync_groups import corpus, flat, run_group, run_manifest

__all__ = ["ATTACK_METHODS", "attack_manifest", "broadcast", "contribution", "corpus", "flat", "heldout_drop", "honest_agree",
           "poisoner", "run_group", "serve_lies"]

HASH_WAIT_S = 3.0  # serve_lies: how long the liar waits for a revision it is asked the hash of (under the
# hash exchange's timeout)

#: every synchronizer with a round each step, so a few steps give an owner enough rounds to judge a member
ATTACK_METHODS = {
    "allreduce": {},
    "cocktail": {"cocktail": CocktailSpec(p=0.1, r=0.2, bits=4, warmup_steps=0)},
    "diloco-e3m0": {"diloco": DilocoSpec(inner_steps=2, e3m0=True, outer_lr=1.0, outer_momentum=0.5)},
}


#: each lane's sequences per step in the attack tests. The direction check leaves out a member opposed to the
#: members' coordinate-wise median, which presumes that honest members' updates agree in direction; 4 sequences of
#: this 1-layer model are too few for that on every owner's third of the parameters: with the global batch's
#: stream split into home lanes, one honest owner's check never found the attacker opposed in 5 of 8 rounds in
#: about 1 run of 4 (which third it owned follows the random peer ids), where 8 sequences gave 21 runs of 21.
ATTACK_BATCH = BatchSpec(batch_size=8, micro_batch_size=8, seq_len=32)


def attack_manifest(method: str, steps: int, replicas: int = 3):
    m = run_manifest(method.split("-")[0], steps, replicas, **ATTACK_METHODS[method])
    return replace(m, batch=ATTACK_BATCH)


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


def serve_lies(sh, real_at, *, malformed: bool = False, poison: str = "/model/") -> list[str]:
    """Replace a member's state server by a liar: asked for its hash, it reports the real state's (so it counts among
    the majority); asked for the state, it serves another one: the model's weights shifted, with a checksum that
    matches them (a self-consistent poisoned state), or with `malformed`, a state its own checksum vouches for whose
    metadata this version cannot read (format 999). `poison`: the tensors shifted (by name prefix: "/optimizer/"
    poisons the moments alone). Returns the list of peers it served a state to (it grows).
    The liar's best case: asked for the hash of a revision it has not reached yet, it answers once it has (within
    `HASH_WAIT_S`) rather than "not yet", so that it is among the holders of every revision it reaches; an honest
    member answering at once let a pull that came a moment early agree without it, and the liar was never asked."""
    served: list[str] = []

    async def handler(stream) -> None:
        try:
            req = unpack(await read_frame(stream, 4096), max_bytes=4096)
            snap, only = real_at(req["revision"]), req.get("only")
            waited = trio.current_time() + HASH_WAIT_S
            while snap is None and req["want"] == "hash" and trio.current_time() < waited:
                await trio.sleep(0.05)
                snap = real_at(req["revision"])
            if snap is None:
                await write_frame(stream, pack({"ok": False, "e": "not yet"}))
            elif req["want"] == "hash":
                await write_frame(stream, pack({"ok": True, "revision": snap.revision,
                                                "hash": snap.hash if only is None else part_hash(snap, tuple(only))}))
            else:
                tensors = {k: v.clone() for k, v in snap.tensors.items() if not only or k.startswith(tuple(only))}
                for k, v in tensors.items():
                    if k.startswith(poison) and v.is_floating_point():
                        v.add_(1.0)
                skeleton = {**snap.skeleton, "format": 999} if malformed and isinstance(snap.skeleton, dict) \
                    else snap.skeleton
                hsh = state_hash(tensors, skeleton)
                names = sorted(tensors)
                entries = [[n, dtype_name(tensors[n].dtype), list(tensors[n].shape),
                            tensors[n].numel() * tensors[n].element_size()] for n in names]
                await write_frame(stream, pack({"ok": True, "revision": snap.revision, "hash": hsh,
                                                "skeleton": pack(skeleton), "tensors": entries}))
                served.append(stream.muxed_conn.peer_id.to_base58())
                for n in names:
                    if tensors[n].numel():
                        await stream.write(bytes(raw_bytes(tensors[n])))
            await stream.close()
        except Exception:  # noqa: BLE001 - a handler must not kill the host
            await stream.reset()

    sh.set_handler(STATE_PROTOCOL, handler)
    return served
