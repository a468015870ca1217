"""One stage's side of its lane's links: dialing, credits, the inbox of what arrived, waits with deadlines, checks."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

import torch
import trio

from shoal.kernels.codec import wire_roundtrip
from shoal.protocol.errors import DecodeError, ProtocolError, TooLargeError
from shoal.protocol.frames import MAX_HEADER_BYTES
from shoal.protocol.records import LinkStatus
from shoal.protocol.lane import (AQ, BWD, FWD, MAX_RECORD_BYTES, TENSOR_TYPES, TRAIN, Abort, Act, Credit, Grad,
                                 LaneMessage, LaneNorm, LinkHello, Nack, StepMessage, decode_data, decode_one,
                                 encode_message, payload_nbytes)
from shoal.swarm.net.framing import read_exactly, read_frame
from shoal.swarm.net.linkmeter import DOWN, UP
from shoal.swarm.lane.aq_codec import group_nbytes
from shoal.swarm.lane.aq_handover import AQStores, StoreKey
from shoal.swarm.lane.aq_ledger import StoreLedger
from shoal.swarm.lane.aq_link import AQReceiver, AQSender, link_status, store_config
from shoal.swarm.lane.dial import dial
from shoal.swarm.lane.payload import Outgoing, decode_acts, decode_grads, encode_acts, encode_grads, resend_encoding
from shoal.swarm.lane.signing import LinkSeals
from shoal.swarm.lane.spec import (LEN, MAX_CONTROL_BYTES, LaneSpec, Link, LinkConfig, LinkError, Violation, aq_groups,
                                   check_record, reset_quietly)
from shoal.swarm.net.host import SwarmHost
from shoal.swarm.net.penalty import Penalties

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True, kw_only=True, slots=True)
class LinkServices:
    """What an end uses of the node's lane-link service (hub.py builds one and hands it to every end it opens): the
    host, penalties, config, the nursery its background tasks run in, the AQ-SGD stores, and `forget`, called once
    when the end closes. The end never sees the hub itself, so the two modules import one way only."""

    sh: SwarmHost
    penalties: Penalties
    config: LinkConfig
    nursery: trio.Nursery
    aq_stores: AQStores
    forget: Callable[[LinkEnd], None]


class LinkEnd:
    """Stage `spec.stage`'s side of its lane's links. Every call takes the step it belongs to; a call raises
    LinkError (a LaneAborted) when that step cannot finish here. Calls come one at a time (the stage's worker)."""

    def __init__(self, services: LinkServices, spec: LaneSpec):
        self.services, self.spec, self.config = services, spec, services.config
        self.me = services.sh.peer_id
        self.step: int | None = None  # the newest step a call was made for
        self._changed = trio.Event()
        self._aborted: dict[tuple[int, str], LinkError] = {}  # (step, phase) given up, by us or a neighbour
        self._halted: LinkError | None = None  # this node is leaving: every wait fails with it
        s, prev, nxt = spec.stage, spec.prev_peer, spec.next_peer
        self.act_in = Link(s - 1, FWD, prev, False) if prev else None
        self.grad_out = Link(s - 1, BWD, prev, True) if prev else None
        self.act_out = Link(s, FWD, nxt, True) if nxt else None
        self.grad_in = Link(s, BWD, nxt, False) if nxt else None
        self.links = [x for x in (self.act_in, self.grad_out, self.act_out, self.grad_in) if x is not None]
        self.aq_out: AQSender | None = None  # AQ-SGD: this end's store of each activation link
        self.aq_in: AQReceiver | None = None
        self.ledger = StoreLedger()  # what the AQ-SGD stores held after each finished step (status, checks)
        self._fresh: list[tuple[StoreKey, Any, str]] = []  # stores new here: pulled from the other end (adopt)
        self.seals = LinkSeals(services.sh.key, spec.run_id, spec.lane)  # a verified run's signatures (evidence)
        if spec.aq is not None:
            for boundary, side, peer in ((s, "sender", nxt), (s - 1, "receiver", prev)):
                if peer is None:
                    continue
                key = StoreKey(spec.run_id, spec.lane, boundary, side)
                cfg = store_config(spec.aq, (spec.seq_len, spec.d_model), spec.train_samples,
                                   f"{self.me[-12:]}-{key.name}")
                store, kept = services.aq_stores.open(key, cfg)
                if not kept:
                    self._fresh.append((key, store, peer))
                if side == "sender":
                    self.aq_out = AQSender(spec.aq, store)
                else:
                    self.aq_in = AQReceiver(spec.aq, store)

    # -- a verified run's signatures (swarm/lane/signing.py): made and checked in the caller's thread, as the coding is

    def seal(self, direction: str, step: int, micro: int, out: Outgoing, x: torch.Tensor, *,
             phase: str = TRAIN) -> Outgoing:
        """`out` (the encoding of `x`, activations for FWD or gradients for BWD) signed by this stage, a verified
        run's training tensors only: the signature covers what the receiver decodes, and is evidence against us."""
        if not self.spec.signed or phase != TRAIN:
            return out
        link = _need(self.act_out if direction == FWD else self.grad_out, f"no outbound {direction} link here")
        ids = out.ids if direction == FWD else ()
        decoded = wire_roundtrip(out.kind, x)
        assert decoded is not None  # a signed spec has a dense wire (LaneSpec checks it)
        out.sig = self.seals.sign("act_out" if direction == FWD else "grad_out", link, step, micro, ids, decoded)
        return out

    def unseal(self, direction: str, rec: Act | Grad, x: torch.Tensor) -> str | None:
        """A verified run's training tensor must carry its sender's signature of what was decoded here (`x`): None
        when it does (kept as evidence), else why not (the caller refuses it: penalized, the step aborted)."""
        if not self.spec.signed or (isinstance(rec, Act) and rec.phase != TRAIN):
            return None
        link = _need(self.act_in if direction == FWD else self.grad_in, f"no inbound {direction} link here")
        what = "act_in" if direction == FWD else "grad_in"
        ids = rec.ids if isinstance(rec, Act) else ()
        if not self.seals.check(what, link, rec.step, rec.micro, ids, rec.sig, x):
            return f"{what} of step {rec.step} #{rec.micro} without a valid signature"
        return None

    def signatures(self, step: int, micro: int) -> dict[str, bytes]:
        """The signatures this end holds for a training micro-batch (a verified run): of what it sent (act_out,
        grad_out, its own) and of what it received (act_in, grad_in, its neighbours')."""
        return self.seals.ring.of(step, micro)

    def counters(self) -> dict[str, dict[str, Any]]:
        """Per link ("b0/fwd"...): the neighbour and what was sent and received on it, for status and benchmarks."""
        return {x.name: {"peer": x.peer, "sent": asdict(x.sent), "recv": asdict(x.recv)} for x in self.links}

    async def adopt(self, revision: int) -> int:
        """A replacement's hand-over: fill each store that is new here from the other end of its link, at the switch
        revision (a neighbour that is new too has none: that link starts empty). Returns the stores filled."""
        fresh, self._fresh = self._fresh, []
        filled = 0
        for key, store, peer in fresh:
            filled += await self.services.aq_stores.pull(peer, key, store, revision)
        return filled

    def link_statuses(self) -> tuple[LinkStatus, ...]:
        """What the status record says about this stage's activation links: the compression, and with AQ-SGD the
        store digest after the last finished step."""
        return self.ledger.link_statuses([(link.name, link.peer, side) for link, side in
                                          ((self.act_in, "receiver"), (self.act_out, "sender")) if link is not None],
                                         self.spec.kind)

    def recent_digests(self) -> dict[str, dict[str, str]]:
        """"link/side" -> {step: digest} of this end's stores after each of the last steps (AQ-SGD)."""
        return self.ledger.recent_digests()

    def stores(self) -> dict[str, dict[str, Any]]:
        """Per activation link ("b0/fwd"...) with AQ-SGD: this end's store (compression, digest, rows, NACKs)."""
        out = {}
        if self.aq_in is not None and self.act_in is not None:
            out[self.act_in.name] = {"peer": self.act_in.peer, "side": "receiver", **link_status(None, self.aq_in)}
        if self.aq_out is not None and self.act_out is not None:
            out[self.act_out.name] = {"peer": self.act_out.peer, "side": "sender", **link_status(self.aq_out, None)}
        return out

    # -- the calls -----------------------------------------------------------------------------------------
    # Each tensor message is two halves: encoding or decoding (swarm/lane/payload.py, in the caller's thread: a
    # BlockingLinkEnd's is the trainer's) and moving its bytes (`post_*`, `take_*`, here on the loop). The async
    # calls below do both, the coding in a worker thread, for callers on the loop.

    async def send_act(self, step: int, micro: int, ids: Sequence[int] | torch.Tensor, acts_BTD: torch.Tensor, *,
                       phase: str = TRAIN) -> None:
        _need(self.act_out, "the last stage sends no activations")
        out = await trio.to_thread.run_sync(encode_acts, self.spec, self.aq_out, step, micro, ids, acts_BTD, phase)
        out = await trio.to_thread.run_sync(functools.partial(self.seal, FWD, step, micro, out, acts_BTD, phase=phase))
        await self.post_act(step, micro, out, phase=phase)

    async def post_act(self, step: int, micro: int, out: Outgoing, *, phase: str = TRAIN) -> None:
        """Send one micro-batch's encoded activations (`payload.encode_acts`)."""
        link = _need(self.act_out, "the last stage sends no activations")
        await self._enter(step)
        if out.encoding is not None:
            rec = _need(self.aq_out, "activations encoded by AQ-SGD").record(step, micro, out.ids, out.acts,
                                                                              out.encoding)
        else:
            rec = Act(step=step, micro=micro, kind=out.kind, ids=tuple(out.ids), phase=phase, sig=out.sig)
        await self._send(link, rec, step, phase, headers=out.headers, frames=out.frames)

    async def recv_act(self, step: int, micro: int, *, phase: str = TRAIN) -> tuple[torch.Tensor, torch.Tensor]:
        while True:
            rec, frames = await self.take_act(step, micro, phase=phase)
            try:
                got = await trio.to_thread.run_sync(decode_acts, self.spec, self.aq_in, rec, frames, step)
            except ProtocolError as e:
                raise await self.refuse(FWD, str(e), step) from None
            if isinstance(got, tuple):
                why = await trio.to_thread.run_sync(self.unseal, FWD, rec, got[1])
                if why is not None:
                    raise await self.refuse(FWD, why, step)
                return got
            await self.nack(rec, got)

    async def take_act(self, step: int, micro: int, *, phase: str = TRAIN) -> tuple[Act, list[bytes | None]]:
        """The record and raw tensor frames of one micro-batch's activations, as they arrived (decode them with
        `payload.decode_acts`)."""
        link = _need(self.act_in, "the first stage receives no activations")
        await self._enter(step)
        return await self._take(link, ("act", step, micro, phase), step, phase, f"activations {micro}")

    async def nack(self, rec: Act, rows: list[int]) -> None:
        """Answer a micro-batch's deltas against versions this end lacks: the sender resends those rows as first
        visits (docs/pipeline.md, "AQ-SGD over a link", rule 3)."""
        _need(self.aq_in, "only AQ-SGD NACKs").note_nack(rec)
        log.info("%s: step %d micro-batch %d: %d rows NACKed (base versions this end lacks)",
                 _need(self.act_in, "a receiving stage").name, rec.step, rec.micro, len(rows))
        out = _need(self.grad_out, "a receiving stage sends gradients")
        await self._send(out, Nack(step=rec.step, micro=rec.micro, rows=tuple(rows)), rec.step, rec.phase)
        out.sent.nacks += 1

    async def refuse(self, direction: str, reason: str, step: int) -> LinkError:
        """What arrived on the inbound link of `direction` (FWD: activations, BWD: gradients) breaks the protocol
        (found when it was decoded): the sender is penalized and its stream dropped; returns the error the step
        fails with."""
        link = _need(self.act_in if direction == FWD else self.grad_in, f"no inbound {direction} link here")
        await self._reject(link, reason, step)
        assert link.failed is not None  # _reject records it
        return link.failed[1]

    async def send_grad(self, step: int, micro: int, grad_BTD: torch.Tensor) -> None:
        _need(self.grad_out, "the first stage sends no gradients")
        out = await trio.to_thread.run_sync(encode_grads, self.spec, grad_BTD)
        await self.post_grad(step, micro, await trio.to_thread.run_sync(self.seal, BWD, step, micro, out, grad_BTD))

    async def post_grad(self, step: int, micro: int, out: Outgoing) -> None:
        """Send the encoded gradient of one micro-batch's activations (`payload.encode_grads`); with AQ-SGD it is the
        ACK of the micro-batch's rows."""
        link = _need(self.grad_out, "the first stage sends no gradients")
        await self._enter(step)
        await self._send(link, Grad(step=step, micro=micro, ack=self.spec.kind == AQ, sig=out.sig), step, TRAIN,
                         headers=out.headers, frames=out.frames)

    async def recv_grad(self, step: int, micro: int) -> torch.Tensor:
        rec, frame = await self.take_grad(step, micro)
        try:
            g = await trio.to_thread.run_sync(decode_grads, self.spec, frame)
        except ProtocolError as e:
            raise await self.refuse(BWD, str(e), step) from None
        why = await trio.to_thread.run_sync(self.unseal, BWD, rec, g)
        if why is not None:
            raise await self.refuse(BWD, why, step)
        return g

    async def take_grad(self, step: int, micro: int) -> tuple[Grad, bytes]:
        """The record and raw tensor frame of one micro-batch's gradient, as they arrived (decode it with
        `payload.decode_grads`). Its arrival is the ACK: the micro-batch's rows become this end's store."""
        link = _need(self.grad_in, "the last stage receives no gradients")
        await self._enter(step)
        rec, frame = await self._take(link, ("grad", step, micro, TRAIN), step, TRAIN, f"gradients {micro}")
        if isinstance(rec, Grad) and rec.ack and self.aq_out is not None:
            self.aq_out.commit(step, micro)
        return rec, frame

    async def exchange_norms(self, step: int, norms: Sequence[float], finite: bool) -> list[tuple[list[float], bool]]:
        """Send this stage's norms both ways, relay what arrives from one side to the other, return all stages'."""
        await self._enter(step)
        mine = LaneNorm(step=step, stage=self.spec.stage, norms=tuple(float(x) for x in norms), finite=finite)
        got: dict[int, LaneNorm] = {mine.stage: mine}
        for out in (self.act_out, self.grad_out):
            if out is not None:
                await self._send(out, mine, step, TRAIN)
        inbound = [x for x in (self.act_in, self.grad_in) if x is not None]

        def arrived() -> tuple[Link, LaneNorm] | None:
            for link in inbound:
                for key in link.inbox:
                    if key[0] == "norm" and key[1] == step:
                        rec = link.inbox.pop(key)[0]
                        assert isinstance(rec, LaneNorm)  # the inbox key names its type
                        return link, rec
            return None

        while len(got) < self.spec.num_stages:
            missing = sorted(set(range(self.spec.num_stages)) - set(got))
            link, rec = await self._wait(f"gradient norms of stages {missing}", step, TRAIN, inbound, arrived,
                                         self.config.recv_timeout_s)
            await self._grant(link, 1)
            got[rec.stage] = rec
            onward = self.act_out if link is self.act_in else self.grad_out
            if onward is not None:
                await self._send(onward, rec, step, TRAIN)
        return [(list(got[k].norms), got[k].finite) for k in range(self.spec.num_stages)]

    async def abort(self, step: int, reason: str, *, phase: str = TRAIN) -> None:
        """Give (step, phase) up here and tell both neighbours (best effort; never raises)."""
        self._aborted.setdefault((step, phase), LinkError(LinkError.ABORTED, f"step {step} given up: {reason}"))
        if self.aq_out is not None and phase == TRAIN:
            self.aq_out.drop(step)  # no ACK will come: the receiver's rows are repaired by NACKs (rule 3)
        await self._drop(lambda k: k[1] == step and k[3] == phase)
        self._wake()
        rec = Abort(step=step, phase=phase, reason=reason[:200])
        for link in self.links:
            if link.outbound:
                with trio.move_on_after(self.config.abort_timeout_s):
                    try:
                        await self._open(link)
                        await self._write(link, [encode_message(rec)], control=True)
                    except Exception as e:  # noqa: BLE001 - best effort: the neighbour times out instead
                        log.debug("abort of step %d to %s not sent: %s", step, link.peer, e)

    def halt(self, why: str) -> None:
        """This node is leaving: every wait of this end, in progress or to come, fails now (LinkError ABORTED), so a
        trainer thread waiting on a neighbour that is leaving too is free at once, not at the link's deadline."""
        self._halted = LinkError(LinkError.ABORTED, why)
        self._wake()

    async def aclose(self) -> None:
        """Close this end for good (the links are re-formed, the run rolled back, the node stops): a wait in progress
        fails at once, as after `halt`. Without that, a step waiting on an inbound link whose stream broke in the
        step before (so the wait expects the neighbour to dial again) sat out its whole receive deadline (60 s) after
        a rollback, although the rollback closed the links to free it (bench/results/stage_loss.md)."""
        if self._halted is None:  # a leaving node's own reason stays
            self.halt("the lane's links were closed here")
        self.services.forget(self)
        for link in self.links:
            stream, link.stream = link.stream, None
            if stream is not None:
                await reset_quietly(stream)
        self._wake()

    # -- waiting --------------------------------------------------------------------------------------------

    def _wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def _enter(self, step: int) -> None:
        """A call for `step`: messages of older steps are dropped (their credit returned)."""
        if self.step is not None and step <= self.step:
            return
        if self.step is not None and self.spec.aq is not None:
            self.ledger.settle(self.step, self.stores())  # nothing of `step` has touched the stores yet
        self.step = step
        self._aborted = {k: v for k, v in self._aborted.items() if k[0] >= step - 1}
        if self.aq_out is not None:
            self.aq_out.drop(step - 1)
        await self._drop(lambda k: k[1] < step)
        for link in self.links:
            if not link.outbound:
                far = [k for k in link.inbox if k[1] > step + 1]
                if far:  # arrived before this end knew its step
                    await self._reject(link, f"message for step {far[0][1]} while the lane is at step {step}", step)

    async def _drop(self, stale: Callable[[tuple], bool]) -> None:
        """Drop what arrived on the inbound links under a `stale` key, and give its credit back."""
        for link in self.links:
            if not link.outbound:
                keys = [k for k in link.inbox if stale(k)]
                for k in keys:
                    del link.inbox[k]
                await self._grant(link, len(keys))

    def _check(self, step: int, phase: str, links: list[Link]) -> None:
        if self._halted is not None:
            raise self._halted
        if (step, phase) in self._aborted:
            raise self._aborted[step, phase]
        for link in links:
            if link.failed is None:
                continue
            at, err = link.failed
            if at is None:
                link.failed = (step, err)
            elif at < step:
                link.failed = None  # broke in an older step; a new stream serves this one
                continue
            raise err

    async def _wait(self, what: str, step: int, phase: str, links: list[Link], ready: Callable[[], Any],
                    timeout_s: float) -> Any:
        deadline = trio.current_time() + timeout_s
        while True:
            got = ready()
            if got is not None:
                return got
            self._check(step, phase, links)
            if trio.current_time() >= deadline:
                peers = ",".join(sorted({x.peer for x in links}))
                raise LinkError(LinkError.DEADLINE, f"no {what} for step {step} within {timeout_s:g} s", peers)
            with trio.move_on_at(deadline):
                await self._changed.wait()

    async def _take(self, link: Link, key: tuple, step: int, phase: str, what: str):
        item = await self._wait(what, step, phase, [link], lambda: link.inbox.pop(key, None),
                                self.config.recv_timeout_s)
        await self._grant(link, 1)
        return item

    # -- sending --------------------------------------------------------------------------------------------

    async def _open(self, link: Link, step: int | None = None, phase: str = TRAIN) -> None:
        """Dial the neighbour (swarm/lane/dial.py) unless the link is open; while a refusing neighbour is dialed
        again, this end halting or `step` being given up (by a neighbour, or by this node) ends the wait."""
        if link.stream is not None:
            return
        if self.services.penalties.is_banned(link.peer):
            raise LinkError(LinkError.DIAL, "the neighbour is banned", link.peer)

        def still_wanted() -> None:
            if self._halted is not None:
                raise self._halted
            if step is not None:
                self._check(step, phase, [])

        hello = LinkHello(run=self.spec.run_id, boundary=link.boundary, lane=self.spec.lane,
                          direction=link.direction, peers=(self.me, link.peer))
        stream, credit = await dial(self.services.sh, self.services.penalties, self.config, link, hello, still_wanted)
        link.stream, link.credits, link.window, link.failed = stream, credit, credit, None
        self.services.nursery.start_soon(self._read_credits, link, stream)

    async def _read_credits(self, link: Link, stream) -> None:
        try:
            while link.stream is stream:
                raw = await read_frame(stream, MAX_CONTROL_BYTES)
                rec = decode_one(raw, Credit)
                if link.credits + rec.n > link.window:
                    raise Violation(f"credit {link.credits} + {rec.n} beyond its window {link.window}")
                link.credits += rec.n
                link.recv.control_bytes += 4 + len(raw)
                self._wake()
        except ProtocolError as e:
            if link.stream is stream:
                await self._reject(link, str(e), None)
        except Exception as e:  # noqa: BLE001 - closed or reset: the link is gone
            if link.stream is stream:
                await self._lost(link, f"{type(e).__name__}: {e}")

    async def _send(self, link: Link, rec: LaneMessage, step: int, phase: str, *, headers: Sequence[Any] = (),
                    frames: Sequence[bytes] = ()) -> None:
        await self._open(link, step, phase)
        await self._wait(f"credit on {link.name}", step, phase, [link], lambda: link.credits > 0 or None,
                         self.config.send_timeout_s)
        link.credits -= 1
        parts = [encode_message(rec), *frames]
        await self._write(link, parts)
        link.sent.messages += 1
        link.sent.wire_bytes += sum(4 + len(p) for p in parts)
        link.sent.payload_bytes += sum(h.nbytes for h in headers)
        link.sent.fp32_bytes += sum(4 * h.numel for h in headers)

    async def _resend(self, rec: Nack, pending) -> None:
        """Answer a NACK: the micro-batch again, the NACKed rows as first visits (a task of the hub's nursery)."""
        aq, link = _need(self.aq_out, "a NACK answers AQ-SGD deltas"), _need(self.act_out, "a sending stage")
        try:
            enc = await trio.to_thread.run_sync(resend_encoding, aq, pending.ids, pending.acts,
                                                aq.busy(rec.step, rec.micro), rec.rows)
            act = aq.record(rec.step, rec.micro, pending.ids, pending.acts, enc)
            await self._send(link, act, rec.step, TRAIN, headers=enc.headers, frames=enc.frames)
        except Exception as e:  # noqa: BLE001 - the step fails at the receiver's deadline or by an abort
            log.info("%s: resend of step %d micro-batch %d failed: %s", link.name, rec.step, rec.micro, e)

    async def _write(self, link: Link, parts: list[bytes], *, control: bool = False) -> None:
        stream = link.stream
        if stream is None:
            raise LinkError(LinkError.CLOSED, f"{link.name} is closed", link.peer)
        data = b"".join(LEN.pack(len(p)) + p for p in parts)
        try:
            with trio.fail_after(self.config.send_timeout_s):
                async with link.write_lock:
                    with self.services.sh.links.timing(link.peer, UP, len(data)):
                        await stream.write(data)
        except trio.TooSlowError:
            await self._lost(link, f"write not done within {self.config.send_timeout_s:g} s")
            raise LinkError(LinkError.DEADLINE, f"write on {link.name} not done within "
                                                f"{self.config.send_timeout_s:g} s", link.peer) from None
        except Exception as e:  # noqa: BLE001 - a reset or closed stream
            await self._lost(link, f"{type(e).__name__}: {e}")
            raise LinkError(LinkError.CLOSED, f"write on {link.name} failed: {type(e).__name__}", link.peer) from e
        if control:
            link.sent.control_bytes += len(data)

    async def _grant(self, link: Link, n: int) -> None:
        """Give `n` credits back on an inbound link (consumed or dropped messages); a dead stream is left alone."""
        if n <= 0 or link.stream is None:
            return
        try:
            await self._write(link, [encode_message(Credit(n=n))], control=True)
        except LinkError as e:
            log.debug("credit on %s not sent: %s", link.name, e)

    # -- receiving ------------------------------------------------------------------------------------------

    async def attach(self, link: Link, stream, hello_nbytes: int) -> None:
        """Serve one inbound stream (in its handler's task) until it ends or misbehaves."""
        old, link.stream, link.failed = link.stream, stream, None
        if old is not None:  # the neighbour dialed again: its old stream failed on its side, and what came on it
            link.inbox.clear()  # belongs to a step it gave up
            await reset_quietly(old)
        link.recv.control_bytes += hello_nbytes
        await self._grant(link, self.config.credit_window)
        while link.stream is stream:
            rec = None
            try:
                head = await read_exactly(stream, 4)  # an idle link waits here between steps: no deadline
                with trio.fail_after(self.config.send_timeout_s):  # a message once begun must finish
                    (n,) = LEN.unpack(head)
                    if n > MAX_RECORD_BYTES:
                        raise TooLargeError(f"record frame of {n} bytes exceeds {MAX_RECORD_BYTES}")
                    if n == 0:
                        raise DecodeError("empty frame")
                    raw = await read_exactly(stream, n)
                    rec = decode_data(raw, link.direction)
                    kind = check_record(self.spec, link.direction, rec)
                    # tensor frames stay bytes (the consumer decodes them); an Act's are a list (AQ-SGD: two)
                    frames: list[bytes | None] | bytes | None = None
                    wire, payload, fp32 = 4 + n, 0, 0  # fp32: the same values at 4 bytes each (shapes are checked)
                    if rec.TYPE in TENSOR_TYPES and kind != AQ:
                        assert kind is not None  # a tensor message's kind
                        expected = payload_nbytes(kind, *self.spec.shape)
                        with self.services.sh.links.timing(link.peer, DOWN, expected):
                            buf = await read_frame(stream, 8 + MAX_HEADER_BYTES + expected)
                        frames = [buf] if isinstance(rec, Act) else buf
                        wire, payload = wire + 4 + len(buf), expected
                        fp32 = 4 * self.spec.shape[0] * self.spec.shape[1] * self.spec.shape[2]
                    elif rec.TYPE in TENSOR_TYPES:
                        groups: list[bytes | None] = []
                        for rows, bits in aq_groups(self.spec, rec):
                            if not rows:
                                groups.append(None)
                                continue
                            expected = group_nbytes(rows, self.spec.seq_len, self.spec.d_model, bits)
                            with self.services.sh.links.timing(link.peer, DOWN, expected):
                                buf = await read_frame(stream, 8 + MAX_HEADER_BYTES + expected)
                            groups.append(buf)
                            wire, payload = wire + 4 + len(buf), payload + expected
                            fp32 += 4 * rows * self.spec.seq_len * self.spec.d_model
                        frames = groups if isinstance(rec, Act) else groups[0]
            except (ProtocolError, trio.TooSlowError) as e:
                if link.stream is stream:
                    await self._reject(link, f"{type(e).__name__}: {e}", None if rec is None else rec.step)
                return
            except Exception as e:  # noqa: BLE001 - closed or reset by the neighbour (or replaced by us)
                if link.stream is stream:
                    await self._lost(link, f"{type(e).__name__}: {e}")
                return
            if isinstance(rec, Abort):
                link.recv.control_bytes += wire
                log.info("%s from %s: step %d (%s) aborted: %r", link.name, link.peer, rec.step, rec.phase, rec.reason)
                self._aborted.setdefault((rec.step, rec.phase), LinkError(
                    LinkError.ABORTED, f"a neighbour gave step {rec.step} up: {rec.reason}", link.peer))
                self._wake()
                continue
            link.recv.messages += 1
            link.recv.wire_bytes += wire
            link.recv.payload_bytes += payload
            link.recv.fp32_bytes += fp32
            try:
                await self._admit(link, rec, frames)
            except Violation as e:
                await self._reject(link, str(e), rec.step)
                return

    async def _admit(self, link: Link, rec: StepMessage, frames: list[bytes | None] | bytes | None) -> None:
        phase = rec.phase if isinstance(rec, Act) else TRAIN
        if (self.step is not None and rec.step < self.step) or (rec.step, phase) in self._aborted:
            await self._grant(link, 1)  # a step already over or given up: dropped, its credit returned
            return
        if isinstance(rec, Nack):
            pending = _need(self.aq_out, "NACKs come on AQ-SGD links only").nacked(rec)  # raises Violation
            link.recv.nacks += 1
            await self._grant(link, 1)
            self.services.nursery.start_soon(self._resend, rec, pending)
            return
        if self.step is not None and rec.step > self.step + 1:
            raise Violation(f"message for step {rec.step} while the lane is at step {self.step}")
        if isinstance(rec, LaneNorm):
            key: tuple = (rec.TYPE, rec.step, rec.stage, TRAIN)
        elif isinstance(rec, (Act, Grad)):
            key = (rec.TYPE, rec.step, rec.micro, phase)
        else:  # (aborts and NACKs are taken above)
            raise Violation(f"{rec.TYPE} is not queued")
        if key in link.inbox:
            raise Violation(f"{rec.TYPE} for step {rec.step} #{key[2]} sent twice")
        if len(link.inbox) >= self.config.credit_window:
            raise Violation(f"more than its credit of {self.config.credit_window} unconsumed messages")
        link.inbox[key] = (rec, frames)
        self._wake()

    async def _reject(self, link: Link, reason: str, claimed_step: int | None) -> None:
        """A neighbour broke the protocol: penalize it, drop its stream, abort the step the message belongs to."""
        cur = self.step  # the stream is gone: the step in progress fails, and the next one if the message was for it
        plausible = claimed_step is not None and (cur is None or cur <= claimed_step <= cur + 1)
        step = claimed_step if plausible else cur
        log.warning("lane %d stage %d: %s from %s rejected: %s; step %s of this lane aborted", self.spec.lane,
                    self.spec.stage, link.name, link.peer, reason, step)
        self.services.penalties.penalize(link.peer, f"lane link {link.name}: {reason}")
        link.failed = (step, LinkError(LinkError.VIOLATION, f"{link.name}: {reason}", link.peer))
        link.inbox.clear()
        stream, link.stream = link.stream, None
        await reset_quietly(stream)
        self._wake()

    async def _lost(self, link: Link, reason: str) -> None:
        """The stream broke (closed, reset, timed out): the step in progress cannot use it."""
        log.info("lane %d stage %d: %s to/from %s lost: %s", self.spec.lane, self.spec.stage, link.name, link.peer,
                 reason)
        link.failed = (self.step, LinkError(LinkError.CLOSED, f"{link.name} lost: {reason}", link.peer))
        stream, link.stream = link.stream, None
        await reset_quietly(stream)
        self._wake()


def _need(x: T | None, why: str) -> T:
    """`x`, which this end must have for the call (a link, a store): a caller's error (ValueError) without it."""
    if x is None:
        raise ValueError(why)
    return x
