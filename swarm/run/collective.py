"""Tagged point-to-point exchange for data-parallel rounds: one long-lived stream per peer, bounded inbox, deadlines.

A stream carries messages one after another, each `[len][header][len][payload]` written at once; opening a
libp2p stream per message cost more bytes and packets than a compressed round's payload (protocol negotiation,
yamux open and close, each its own TCP segment and acknowledgement).
"""

from __future__ import annotations

import logging
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Any

import trio

from shoal.protocol.errors import DecodeError, ProtocolError
from shoal.protocol.wire import expect_map, get_field, pack, unpack
from shoal.swarm.net.framing import PREFIX_BYTES, BufferedReader, StreamClosed, close_quietly, frame, read_length
from shoal.swarm.net.host import RECONNECT_GRACE_S, SwarmHost
from shoal.swarm.net.linkmeter import DOWN, UP
from shoal.swarm.net.penalty import Penalties

log = logging.getLogger(__name__)

COLLECTIVE_PROTOCOL = "/shoal/coll/1.1.0"
MAX_HEADER_BYTES = 1024
MAX_TAG_CHARS = 200
DONE_TAGS_KEPT = 4096  # finished tags remembered, so late messages for them are dropped
MAX_PEER_TAGS = 64  # tags one peer may have waiting in the inbox at once
GIVEN_UP_KEPT = 16  # group epochs whose rounds this node gave up (`give_up`), the newest
COUNTED_OUT_KEPT = 16  # group epochs with members counted out (`count_out`), the newest
ABSENT = "absent"  # the last part of a tag that says its sender takes no part in that group epoch (`abstain`)


class Collective:
    """`exchange(tag, sends, expect, timeout_s)`: send bytes to peers, collect what peers sent under the same tag.

    Messages that arrive before the local `exchange` for their tag starts wait in a bounded inbox (per-peer and
    total byte caps, the oldest tags evicted first) for at most `max_wait_s`: an honest early message waits less
    than a round, so anything older is dropped (and its memory given back). Tags already finished are remembered
    briefly, and late messages for them are dropped. Malformed messages penalize their sender and never reach the caller.
    Messages to a peer go one after another on one stream kept open for it; a send that fails on a kept stream
    (the peer restarted, the connection was replaced) is tried once more on a new one.

    A peer that departed is not waited for: its last connection to this node closed (a process that dies has its
    connections closed at once) and none is back `departed_grace_s` later. A frozen or partitioned peer keeps its
    connections and is waited for until the deadline.
    """

    def __init__(
        self,
        sh: SwarmHost,
        penalties: Penalties,
        *,
        max_frame_bytes: int = 64 * 1024 * 1024,
        max_peer_buffer_bytes: int = 256 * 1024 * 1024,
        max_buffer_bytes: int = 512 * 1024 * 1024,
        read_timeout_s: float = 60.0,
        send_timeout_s: float = 60.0,
        open_timeout_s: float = 3.0,
        max_wait_s: float = 120.0,
        departed_grace_s: float = RECONNECT_GRACE_S,
        gate: Callable[[str, str], object | None] | None = None,
        clock: Callable[[], float] = trio.current_time,
    ):
        self.sh = sh
        self.me = sh.peer_id
        self.penalties = penalties
        self.max_frame_bytes = max_frame_bytes
        self.max_peer_buffer_bytes = max_peer_buffer_bytes
        self.max_buffer_bytes = max_buffer_bytes
        self.read_timeout_s = read_timeout_s
        self.send_timeout_s = send_timeout_s
        self.open_timeout_s = open_timeout_s  # opening a stream takes milliseconds unless the peer is gone
        self.max_wait_s = max_wait_s  # a message waiting for its exchange longer than this is dropped
        self.departed_grace_s = departed_grace_s
        self.clock = clock
        # (peer, tag) -> None to take a message, else a refusal (.why, .penalize): checked on the header, before
        # the payload is read (swarm/run/collective_gate.py); None: every message is taken
        self.gate = gate
        self.refused = 0  # messages refused by the gate or the per-peer tag cap
        self.bytes_sent = 0  # wire bytes of messages written completely (length prefixes and headers included)
        self.bytes_recv = 0  # wire bytes of messages accepted into the inbox
        self.messages_sent = 0
        self.messages_recv = 0
        self.late_dropped = 0  # messages for tags that had already finished
        self.expired = 0  # waiting messages dropped after max_wait_s
        self._inbox: OrderedDict[str, dict[str, bytes]] = OrderedDict()
        self._arrived: dict[str, float] = {}  # tag -> when its first waiting message arrived (clock seconds)
        self._active: set[str] = set()  # tags whose exchange runs now
        self._peer_bytes: dict[str, int] = {}
        self._total_bytes = 0
        self._done: deque[str] = deque(maxlen=DONE_TAGS_KEPT)
        self._done_set: set[str] = set()
        self._changed = trio.Event()
        self._out: dict[str, Any] = {}  # peer -> the (libp2p) stream our messages to it go on
        self._out_locks: dict[str, trio.Lock] = {}  # one message at a time on a stream
        self._waiting: dict[trio.CancelScope, str] = {}  # the deadlines of the exchanges in progress -> their tags
        self._given_up: deque[str] = deque(maxlen=GIVEN_UP_KEPT)  # tag prefixes whose exchanges end at once
        self._counted_out: OrderedDict[str, set[str]] = OrderedDict()  # tag prefix -> peers not waited for there
        self._held: set[tuple[str, str]] = set()  # (tag, peer) of waiting messages the gate is to judge again
        self.closed = False
        self.departed_skipped = 0  # peers an exchange stopped waiting for because they had departed
        sh.set_handler(COLLECTIVE_PROTOCOL, self._serve)
        self._unwatch = sh.watch_closes(lambda peer: self._wake())  # a waiting exchange looks again

    def close(self) -> None:
        """This node is leaving: every exchange in progress returns now with what it has (the round counts the rest
        missing, so a trainer thread waiting in it is free at once, not at the round's deadline), and later ones at
        once. Its peers notice its leave notice, not a missed deadline."""
        self.closed = True
        self._unwatch()
        for scope in self._waiting:
            scope.cancel()

    def _departed(self, peers: set[str]) -> tuple[set[str], float]:
        """Of `peers`: those that departed (their last connection closed, not back after the grace), and the
        seconds until the next of the others whose connections closed will have departed (inf: none pending)."""
        gone, wait = set(), float("inf")
        for p in peers:
            closed = self.sh.closed_for(p)
            if closed is None:
                continue
            if closed >= self.departed_grace_s:
                gone.add(p)
            else:
                wait = min(wait, self.departed_grace_s - closed)
        return gone, wait

    def give_up(self, prefix: str) -> None:
        """Exchanges under tags starting with `prefix` (a group epoch's rounds: Group.tag) end now with what they
        have, and later ones at once: that group was re-formed at a step this node had already begun (the table
        reached it late), so nobody will answer them."""
        if prefix not in self._given_up:
            self._given_up.append(prefix)
        for scope, tag in self._waiting.items():
            if tag.startswith(prefix):
                scope.cancel()

    def count_out(self, prefix: str, peers: set[str]) -> None:
        """`peers` are not waited for in exchanges under tags starting with `prefix` (a group epoch's rounds: the
        one in progress and the later ones), as if they had departed: the run's broker counts them failed, and a
        member counted failed leaves that group for good (a frozen one too, once it wakes). Every member holds the
        same table, so each stops waiting for the same peers, now rather than at the round's deadline."""
        known = self._counted_out.setdefault(prefix, set())
        if peers <= known:
            return
        known |= peers
        self._counted_out.move_to_end(prefix)
        while len(self._counted_out) > COUNTED_OUT_KEPT:
            self._counted_out.popitem(last=False)
        self._wake()

    async def abstain(self, prefix: str, round_: int, peers: set[str]) -> None:
        """Tell `peers` that this node takes no part in the group epoch whose round tags start with `prefix` (it was
        to enter it at round `round_` and its slot moved on before it could): each counts it out there
        (`count_out`), rather than wait in the epoch's first round for it until the entry's grace runs out. One
        message each, under that round's tag, so the receivers' gate checks that the sender is a member of that
        epoch; a peer can only count itself out."""
        tag = f"{prefix}{round_}/{ABSENT}"
        sent: set[str] = set()
        failed: set[str] = set()
        async with trio.open_nursery() as nursery:
            for p in peers - {self.me}:
                nursery.start_soon(self._send, p, tag, b"\x01", sent, failed)

    def _out_of(self, tag: str) -> set[str]:
        return set().union(*(p for prefix, p in self._counted_out.items() if tag.startswith(prefix)))

    # -- receiving ----------------------------------------------------------------------------------

    async def _serve(self, stream) -> None:
        """Messages from one peer, one after another, until it closes the stream; a malformed one ends it."""
        peer = stream.muxed_conn.peer_id.to_base58()
        reader = BufferedReader(stream)
        while True:
            if self.penalties.is_banned(peer):
                await _reset(stream)
                return
            try:
                try:
                    n_head = await read_length(stream, MAX_HEADER_BYTES, reader)  # idle between messages: no deadline
                except StreamClosed:
                    await close_quietly(stream)  # the peer closed its end: done
                    return
                with trio.fail_after(self.read_timeout_s):
                    raw = await reader.read(n_head)
                    header = expect_map(unpack(raw, max_bytes=MAX_HEADER_BYTES), "collective header")
                    tag = get_field(header, "tag", str)
                    n = get_field(header, "n", int)
                    if not tag or len(tag) > MAX_TAG_CHARS:
                        raise DecodeError(f"tag must be 1..{MAX_TAG_CHARS} characters")
                    if not 0 < n <= self.max_frame_bytes:
                        raise DecodeError(f"announced payload of {n} bytes is outside 1..{self.max_frame_bytes}")
                    refusal = self._refusal(peer, tag)
                    if refusal is not None and getattr(refusal, "hold", False) and not self._holds(peer):
                        log.info("collective message %s from %s held: %s", tag, peer, refusal.why)
                    elif refusal is not None:  # dropped unread: the stream is reset (an honest sender reopens one)
                        self.refused += 1
                        if refusal.penalize:
                            self.penalties.penalize(peer, f"collective: {refusal.why}")
                        else:
                            log.info("collective message %s from %s dropped: %s", tag, peer, refusal.why)
                        await _reset(stream)
                        return
                    size = await read_length(stream, n, reader)
                    with self.sh.links.timing(peer, DOWN, size):
                        payload = await reader.read(size)
                    if len(payload) != n:
                        raise DecodeError(f"payload of {len(payload)} bytes, header announced {n}")
            except (ProtocolError, trio.TooSlowError) as e:
                self.penalties.penalize(peer, f"collective: {type(e).__name__}: {e}")
                await _reset(stream)
                return
            except StreamClosed as e:
                log.debug("collective stream from %s closed early: %s", peer, e)
                return
            self._deliver(tag, peer, payload, wire=2 * PREFIX_BYTES + len(raw) + n, held=refusal is not None)

    def _refusal(self, peer: str, tag: str):
        if tag not in self._inbox and tag not in self._done_set:
            waiting = sum(1 for box in self._inbox.values() if peer in box)
            if waiting >= MAX_PEER_TAGS:
                return _Refused(f"{waiting} tags of this peer wait in the inbox already")
        return self.gate(peer, tag) if self.gate is not None else None

    def _deliver(self, tag: str, peer: str, payload: bytes, wire: int, held: bool = False) -> None:
        self._expire()
        if tag.endswith("/" + ABSENT):  # (the gate took it: the sender is a member of that epoch)
            if not held:  # an epoch not known here yet: the deadline stands
                self.count_out("/".join(tag.split("/")[:3]) + "/", {peer})
            self.bytes_recv += wire
            self.messages_recv += 1
            return
        if tag in self._done_set:
            log.debug("late message for finished %s from %s dropped", tag, peer)
            self.late_dropped += 1
            return
        box = self._inbox.setdefault(tag, {})
        self._arrived.setdefault(tag, self.clock())
        if peer in box:
            self.penalties.penalize(peer, f"collective: second message for tag {tag}")
            return
        if self._peer_bytes.get(peer, 0) + len(payload) > self.max_peer_buffer_bytes:
            self.penalties.penalize(peer, "collective: per-peer buffer cap exceeded")
            if not box:
                self._drop(tag)
            return
        box[peer] = payload
        if held:
            self._held.add((tag, peer))
        self._peer_bytes[peer] = self._peer_bytes.get(peer, 0) + len(payload)
        self._total_bytes += len(payload)
        self.bytes_recv += wire
        self.messages_recv += 1
        self._evict(keep=tag)
        self._wake()

    def _wake(self) -> None:
        """Wake whoever waits for the inbox or the sends to change."""
        self._changed.set()
        self._changed = trio.Event()

    def _evict(self, keep: str) -> None:
        while self._total_bytes > self.max_buffer_bytes and len(self._inbox) > 1:
            oldest = next(t for t in self._inbox if t != keep)
            log.warning("collective inbox over %d bytes: dropping tag %s", self.max_buffer_bytes, oldest)
            self._drop(oldest)

    def _expire(self) -> None:
        """Drop the waiting messages of tags whose first message came more than `max_wait_s` ago (the inbox is in
        arrival order, so the oldest come first)."""
        cutoff = self.clock() - self.max_wait_s
        for tag in list(self._inbox):
            if self._arrived.get(tag, cutoff) > cutoff:
                return
            if tag in self._active:
                continue  # its exchange is collecting it now
            box = self._drop(tag)
            self.expired += len(box)
            log.info("collective: %d message(s) for %s waited over %.0f s: dropped", len(box), tag, self.max_wait_s)

    @property
    def waiting_bytes(self) -> int:
        """Payload bytes of messages waiting in the inbox for their exchange."""
        return self._total_bytes

    def _drop(self, tag: str) -> dict[str, bytes]:
        self._arrived.pop(tag, None)
        box = self._inbox.pop(tag, {})
        for peer, payload in box.items():
            self._release(tag, peer, payload)
        return box

    def _release(self, tag: str, peer: str, payload: bytes) -> None:
        self._held.discard((tag, peer))
        left = self._peer_bytes[peer] - len(payload)
        if left:
            self._peer_bytes[peer] = left
        else:
            del self._peer_bytes[peer]
        self._total_bytes -= len(payload)

    def _holds(self, peer: str) -> bool:
        """Whether a message of `peer`'s is held already: one is all an honest member sends before the table that
        names its epoch comes (its next waits for this node's answer), so any more are dropped."""
        return any(p == peer for _, p in self._held)

    def _judge_held(self, tag: str) -> None:
        """This node's round under `tag` begins: the messages held for it (their group epoch was unknown here when
        they came) are put to the gate again, now that this node knows the epoch, and kept or dropped by it."""
        box = self._inbox.get(tag, {})
        for peer in [p for p in box if (tag, p) in self._held]:
            refusal = self._refusal(peer, tag)
            self._held.discard((tag, peer))
            if refusal is None:
                continue
            self._release(tag, peer, box.pop(peer))
            self.refused += 1
            if refusal.penalize:
                self.penalties.penalize(peer, f"collective: {refusal.why}")
            else:
                log.info("held collective message %s from %s dropped: %s", tag, peer, refusal.why)

    def _finish(self, tag: str) -> None:
        if len(self._done) == self._done.maxlen:
            self._done_set.discard(self._done[0])
        self._done.append(tag)
        self._done_set.add(tag)

    # -- sending ------------------------------------------------------------------------------------

    async def _send(self, peer: str, tag: str, payload: bytes, sent: set[str], failed: set[str]) -> None:
        header = pack({"tag": tag, "n": len(payload)})
        message = frame(header) + frame(payload)
        lock = self._out_locks.setdefault(peer, trio.Lock())
        try:
            with trio.fail_after(self.send_timeout_s):
                async with lock:
                    await self._write(peer, message)
        except Exception as e:  # a peer's failure (trio.TooSlowError too) is data: the round goes on without it
            log.info("collective send %s to %s failed: %s: %s", tag, peer, type(e).__name__, e)
            failed.add(peer)  # unreachable (a killed process's connections are reset): not waited for either
            self._wake()
            return
        self.bytes_sent += len(message)
        self.messages_sent += 1
        sent.add(peer)

    async def _write(self, peer: str, message: bytes) -> None:
        """Write one message on the peer's kept stream; on failure, once more on a new stream. A write that did not
        finish (an error, or a deadline that cancelled it) leaves part of a message on the stream: that stream is
        reset, so the peer sees it end instead of reading the next message as the rest of this one."""
        stream = self._out.get(peer)
        if stream is not None:
            try:
                with self.sh.links.timing(peer, UP, len(message)):
                    await stream.write(message)
                return
            except Exception as e:  # noqa: BLE001 - a stale stream: try a fresh one
                log.debug("collective stream to %s failed (%s): opening a new one", peer, e)
                await self._discard(peer, stream)
            except BaseException:
                await self._discard(peer, stream)
                raise
        await self.sh.prepare_path(peer)  # through a relay and a hole punch, for a NATed peer: not "opening"
        with trio.fail_after(self.open_timeout_s):  # a dead peer's stale connection hangs here
            stream = await self.sh.open_stream(peer, COLLECTIVE_PROTOCOL, bulk=True)
        self._out[peer] = stream
        try:
            await stream.write(message)
        except BaseException:
            await self._discard(peer, stream)
            raise

    async def _discard(self, peer: str, stream) -> None:
        if self._out.get(peer) is stream:
            del self._out[peer]
        with trio.CancelScope(shield=True), trio.move_on_after(1.0):
            await _reset(stream)

    async def exchange(
        self, tag: str, sends: dict[str, bytes], expect: set[str], timeout_s: float
    ) -> dict[str, bytes]:
        """Send `sends[p]` to each p and return {peer: payload} for the peers of `expect` heard by the deadline.

        Returns as soon as every expected message has arrived and every send finished (or the deadline passed);
        missing peers are simply absent. A peer our own send failed to reach is not waited for (a killed process
        costs a failed dial, not a deadline), nor one that departed (its connections closed: a process killed after
        our send reached it), nor one counted out (`count_out`). A message to self is handed over without the
        network.
        """
        if not tag or len(tag) > MAX_TAG_CHARS:
            raise ValueError(f"tag must be 1..{MAX_TAG_CHARS} characters")
        for p, b in sends.items():
            if not 0 < len(b) <= self.max_frame_bytes:
                raise ValueError(f"message of {len(b)} bytes for {p} is outside 1..{self.max_frame_bytes}")
        self._expire()
        others = expect - {self.me}
        sent: set[str] = set()
        failed: set[str] = set()
        box: dict[str, bytes] = {}
        self._active.add(tag)
        self._judge_held(tag)
        try:
            given_up = any(tag.startswith(p) for p in self._given_up)
            with trio.move_on_after(0 if self.closed or given_up else timeout_s) as deadline:
                self._waiting[deadline] = tag
                async with trio.open_nursery() as nursery:
                    for p, b in sends.items():
                        if p != self.me:
                            nursery.start_soon(self._send, p, tag, b, sent, failed)
                    while True:
                        waiting = others - failed - self._inbox.get(tag, {}).keys()
                        gone, wait = self._departed(waiting)
                        gone |= waiting & self._out_of(tag)
                        if waiting <= gone:
                            self.departed_skipped += len(gone)
                            break
                        changed = self._changed
                        with trio.move_on_after(wait):
                            await changed.wait()
        finally:
            self._active.discard(tag)
            self._waiting.pop(deadline, None)
            box = self._drop(tag)
            self._finish(tag)
        if self.me in sends:
            box[self.me] = sends[self.me]  # short-circuited: never counted as network bytes
        return {p: b for p, b in box.items() if p in expect}


    def blocking(self, trio_token: trio.lowlevel.TrioToken) -> Callable[[str, dict[str, bytes], set[str], float],
                                                                        dict[str, bytes]]:
        """`exchange` for a worker thread (a synchronizer's round): the call blocks that thread, runs the exchange on
        the event loop of `trio_token`, and returns its result."""

        def exchange(tag: str, sends: dict[str, bytes], expect: set[str], timeout_s: float) -> dict[str, bytes]:
            return trio.from_thread.run(self.exchange, tag, sends, expect, timeout_s, trio_token=trio_token)

        return exchange


class _Refused:
    __slots__ = ("why",)
    penalize = True

    def __init__(self, why: str):
        self.why = why


async def _reset(stream) -> None:
    try:
        await stream.reset()
    except Exception:  # noqa: BLE001
        pass
