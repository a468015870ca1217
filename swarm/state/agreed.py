"""Pulling the state most of a group holds: ask every source for its hash, then pull from a random one of the
majority with that hash expected; a source whose state is not it (or malformed) is penalised and the next tried.

A node must not load whatever one peer serves: a malicious member could serve a self-consistent state of its own
(right checksum, wrong numbers). What members serve is their whole entry state (model, optimizer, synchronizer
state and metadata, the same bytes on every replica at a revision: Trainer.entry_state), and the expected hash is
the one the group's rule (swarm/state/vote.py) agrees on among the `voters` members entitled to state it: a strict
majority of them, so one liar cannot set it (a group of two that splits is settled by the rule alone, one word
against one). The source is drawn at random among the members holding it, so a liar cannot make itself the one
every joiner asks first; the pulled state is checked against the expected hash before it is returned.
"""

from __future__ import annotations

import logging
import random

import trio

from shoal.protocol.wire import pack, unpack
from shoal.swarm.net.framing import close_quietly, exchange_failures, read_frame, write_frame
from shoal.swarm.net.host import SwarmHost
from shoal.swarm.net.penalty import Penalties
from shoal.swarm.state.snapshot import Snapshot, StateTransferError
from shoal.swarm.state.transfer import STATE_PROTOCOL, NotServed, StateTransferConfig, pull_state
from shoal.swarm.state.vote import agreed

log = logging.getLogger(__name__)
HASH_REPLY_BYTES = 1024


class NobodyHolds(StateTransferError):
    """None of the members asked holds the revision or is training toward it (every one answered NeverHeld): waiting
    for their answers cannot help while that lasts. `asked`: how many answered so (0: nobody was asked)."""

    def __init__(self, message: str, asked: int):
        super().__init__(message)
        self.asked = asked


class NoSourceLeft(StateTransferError):
    """Every member holding the agreed state failed to serve it earlier in this pull (served another state, or said
    it no longer holds it): asking them again cannot help."""


class NeverHeld(StateTransferError):
    """The member does not hold that revision and will not come to by its own training (it passed it without keeping
    it, or it is not training toward it: a backup, a restarted node, a member that is itself entering or re-fetching
    the group's state, which it would only echo): it has no say about it."""


async def ask_hash(sh: SwarmHost, peer: str, *, revision: int, only: tuple[str, ...] | None = None,
                   config: StateTransferConfig) -> str:
    """The hash of `peer`'s whole state at `revision` (with `only`: `part_hash` over those prefixes); raises
    StateTransferError (NeverHeld: the peer does not hold that revision and will not train to it)."""
    with exchange_failures(StateTransferError, f"hash from {peer[:16]}…", config.timeout_s):
        stream = await sh.open_stream(peer, STATE_PROTOCOL)
        try:
            req = {"want": "hash", "revision": revision, **({"only": list(only)} if only else {})}
            await write_frame(stream, pack(req))
            h = unpack(await read_frame(stream, HASH_REPLY_BYTES), max_bytes=HASH_REPLY_BYTES)
        finally:
            await close_quietly(stream)
    if isinstance(h, dict) and h.get("ok") is False and h.get("never") is True:
        raise NeverHeld(f"{peer[:16]}… does not hold revision {revision} and will not train to it")
    if not isinstance(h, dict) or h.get("ok") is not True:
        raise StateTransferError(f"{peer[:16]}… has no hash for revision {revision}")
    hsh = h.get("hash")
    if h.get("revision") != revision or not isinstance(hsh, str) or len(hsh) != 64 \
            or any(c not in "0123456789abcdef" for c in hsh):
        raise StateTransferError(f"{peer[:16]}… answered a malformed hash")
    return hsh


async def majority_hash(sh: SwarmHost, peers: list[str], *, revision: int, voters: int | None = None,
                        config: StateTransferConfig) -> tuple[str, list[str]]:
    """(the hash the group agrees on at `revision`, the peers reporting it): the rule of swarm/state/vote.py over
    the hashes of `peers`, counted against `voters` members (default: every peer asked; a peer that has not reached
    the revision, or is gone, answers nothing and counts against every hash; one that will never hold it by its own
    training (NeverHeld: passed it without keeping it, or is not training toward it) has no say, as in a vote).
    StateTransferError when none is."""
    answers: dict[str, str] = {}
    never: set[str] = set()

    async def ask(p: str) -> None:
        try:
            answers[p] = await ask_hash(sh, p, revision=revision, config=config)
        except NeverHeld:
            never.add(p)
        except StateTransferError as e:
            log.debug("state hash from %s: %s", p, e)

    async with trio.open_nursery() as n:
        for p in peers:
            n.start_soon(ask, p)
    if len(never) == len(peers):
        raise NobodyHolds(f"none of the {len(peers)} members asked holds revision {revision} or trains toward it",
                          len(peers))
    top = agreed(answers, max((voters or len(peers)) - len(never), len(answers)))
    if top is None:
        raise StateTransferError(f"no majority of {voters or len(peers)} members holds one state at revision "
                                 f"{revision} ({len(answers)} answered, {len(set(answers.values()))} distinct hashes)")
    return top, [p for p in peers if answers.get(p) == top]


async def pull_agreed(sh: SwarmHost, peers: list[str], *, revision: int, penalties: Penalties | None,
                      voters: int | None = None, config: StateTransferConfig = StateTransferConfig(),
                      rng: random.Random | None = None, refused: set[str] | None = None) -> Snapshot:
    """The whole state of `revision` the group agrees on (`majority_hash` over `peers`, counted against `voters`),
    from a random one of those holding it, checked before it is returned. A source that claimed the agreed hash and
    served something else (another state, malformed bytes, a broken stream) is penalised, added to `refused` and
    the next one tried; one that answers it no longer holds the revision (it dropped it since it told its hash) is
    added to `refused` unpenalised. Sources already in `refused` (an earlier attempt's) still vote but are not pulled
    from again. Raises StateTransferError (NoSourceLeft: every holder of the agreed state is in `refused`)."""
    expected, holders = await majority_hash(sh, peers, revision=revision, voters=voters, config=config)
    refused = set() if refused is None else refused
    sources = [p for p in holders if p not in refused]
    (rng or random.SystemRandom()).shuffle(sources)
    last: StateTransferError | None = None
    for p in sources:
        try:
            return await pull_state(sh, p, revision=revision, expect_hash=expected, config=config)
        except NotServed as e:
            last = e
            refused.add(p)
            log.info("state from %s: %s", p[-8:], e)
        except StateTransferError as e:
            last = e
            refused.add(p)
            log.warning("state from %s rejected: %s", p[-8:], e)
            if penalties is not None:
                penalties.penalize(p, f"state: claimed the agreed hash, served otherwise: {e}"[:300])
    if not sources:
        raise NoSourceLeft(f"every holder of the agreed state at revision {revision} failed to serve it before "
                           f"({len(holders)} refused)")
    raise StateTransferError(f"every source of the agreed state at revision {revision} failed: {last}")
