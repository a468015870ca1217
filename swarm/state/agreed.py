"""Pulling the state most of a group holds: ask every source for its hash, then pull from a random one of the
majority with that hash expected; a source whose state is not it (or malformed) is penalised and the next tried.

A replica entering a group, or re-fetching, must not load whatever one peer serves: a malicious member could serve
a self-consistent state of its own (right checksum, wrong numbers). The expected hash is the one a strict majority
of the asked sources report for the same revision over the part replicas keep bit-identical (`agree_on`, hashed
by `part_hash`), so one liar cannot set it; the source is drawn at random among them, so a liar cannot make itself
the one every joiner asks first; the pulled state is checked against the expected hash before it is returned.
"""

from __future__ import annotations

import logging
import random
from collections import Counter

import trio

from shoal.protocol.wire import pack, unpack
from shoal.swarm.net.framing import close_quietly, exchange_failures, read_frame, write_frame
from shoal.swarm.net.host import SwarmHost
from shoal.swarm.net.penalty import Penalties
from shoal.swarm.state.snapshot import Snapshot, StateTransferError
from shoal.swarm.state.transfer import STATE_PROTOCOL, StateTransferConfig, part_hash, pull_state

log = logging.getLogger(__name__)
HASH_REPLY_BYTES = 1024


async def ask_hash(sh: SwarmHost, peer: str, *, revision: int, only: tuple[str, ...],
                   config: StateTransferConfig) -> str:
    """`part_hash` of `peer`'s state at `revision` over the `only` prefixes; raises StateTransferError."""
    with exchange_failures(StateTransferError, f"hash from {peer[:16]}…", config.timeout_s):
        stream = await sh.open_stream(peer, STATE_PROTOCOL)
        try:
            req = {"want": "hash", "revision": revision, "only": list(only)}
            await write_frame(stream, pack(req))
            h = unpack(await read_frame(stream, HASH_REPLY_BYTES), max_bytes=HASH_REPLY_BYTES)
        finally:
            await close_quietly(stream)
    if not isinstance(h, dict) or h.get("ok") is not True:
        raise StateTransferError(f"{peer[:16]}… has no hash for revision {revision}")
    hsh = h.get("hash")
    if h.get("revision") != revision or not isinstance(hsh, str) or len(hsh) != 64 \
            or any(c not in "0123456789abcdef" for c in hsh):
        raise StateTransferError(f"{peer[:16]}… answered a malformed hash")
    return hsh


async def majority_hash(sh: SwarmHost, peers: list[str], *, revision: int, only: tuple[str, ...],
                        config: StateTransferConfig) -> tuple[str, list[str]]:
    """(the hash a strict majority of the `peers` that answer report, those reporting it); StateTransferError when
    none has one."""
    answers: dict[str, str] = {}

    async def ask(p: str) -> None:
        try:
            answers[p] = await ask_hash(sh, p, revision=revision, only=only, config=config)
        except StateTransferError as e:
            log.debug("state hash from %s: %s", p, e)

    async with trio.open_nursery() as n:
        for p in peers:
            n.start_soon(ask, p)
    if answers:  # a strict majority of the sources that hold the revision (a peer that has not reached it, or is
        # gone, has no say; a liar among them is outvoted, and a split loads nothing)
        hsh, count = Counter(answers.values()).most_common(1)[0]
        if 2 * count > len(answers):
            return hsh, [p for p in peers if answers.get(p) == hsh]
    raise StateTransferError(f"no majority of {len(peers)} sources holds one state at revision {revision} "
                             f"({len(answers)} answered, {len(set(answers.values()))} distinct hashes)")


async def pull_agreed(sh: SwarmHost, peers: list[str], *, revision: int, agree_on: tuple[str, ...],
                      penalties: Penalties | None, only: tuple[str, ...] | None = None,
                      config: StateTransferConfig = StateTransferConfig(),
                      rng: random.Random | None = None) -> Snapshot:
    """The state of `revision` (the `only` part, or all of it) whose `agree_on` part a strict majority of `peers`
    hold, from a random one of them, checked before it is returned. A source that claimed the majority's hash and
    served something else (another state, malformed bytes, a broken stream) is penalised and the next one tried.
    Raises StateTransferError."""
    expected, holders = await majority_hash(sh, peers, revision=revision, only=agree_on, config=config)
    (rng or random.SystemRandom()).shuffle(holders)
    last: StateTransferError | None = None
    for p in holders:
        try:
            snap = await pull_state(sh, p, revision=revision, only=only, config=config)
            got = await trio.to_thread.run_sync(part_hash, snap, agree_on)
            if got != expected:
                raise StateTransferError(f"its state hashes {got[:12]}…, the majority's {expected[:12]}…")
            return snap
        except StateTransferError as e:
            last = e
            log.warning("state from %s rejected: %s", p[-8:], e)
            if penalties is not None:
                penalties.penalize(p, f"state: claimed the majority's hash, served otherwise: {e}"[:300])
    raise StateTransferError(f"every source of the majority's state at revision {revision} failed: {last}")
