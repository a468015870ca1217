"""One stage's side of its lane's links: dialing, credits, the inbox of what arrived, waits with deadlines, checks."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import trio

from shoal.kernels.codec import wire_roundtrip
from shoal.protocol.errors import DecodeError, ProtocolError, TooLargeError
from shoal.protocol.frames import MAX_HEADER_BYTES
from shoal.kernels.quant import NonFiniteError
from shoal.protocol.records import checkpoint_steps
from shoal.protocol.lane import (AQ, BWD, DATA_TYPES, FWD, LANE_PROTOCOL, MAX_RECORD_BYTES, TENSOR_TYPES, TRAIN, Abort,
                                 Act, Credit, Grad, LaneNorm, LinkHello, Nack, Refuse, decode_message, encode_message,
                                 payload_nbytes)
from shoal.protocol.schema import WireRecord
from shoal.swarm.net.framing import close_quietly, read_exactly, read_frame
from shoal.swarm.lane.aq_codec import decode_group, encode_group, group_nbytes, on_codec_device
from shoal.swarm.lane.aq_handover import AQStores, StoreKey
from shoal.swarm.lane.aq_link import AQReceiver, AQSender, link_status, store_config
from shoal.swarm.lane.signing import SignatureRing, sign_tensor, tensor_signed_by
from shoal.swarm.lane.spec import (LEN, MAX_CONTROL_BYTES, LaneSpec, LinkConfig, LinkCounters, LinkError, Violation,
                                   decode_tensor_frame, encode_tensor_frame, reset_quietly)
from shoal.swarm.net.host import SwarmHost
from shoal.swarm.net.penalty import Penalties

log = logging.getLogger(__name__)

DIGEST_HISTORY = 16  # steps of store digests each AQ-SGD link end keeps for its status file


class _Link:
    """One directed link as this end sees it: outbound (we send data, read credits) or inbound (the reverse)."""

    def __init__(self, boundary: int, direction: str, peer: str, outbound: bool):
        self.boundary, self.direction, self.peer, self.outbound = boundary, direction, peer, outbound
        self.name = f"b{boundary}/{direction}"
        self.sent, self.recv = LinkCounters(), LinkCounters()
        self.stream = None
        self.write_lock = trio.Lock()
        self.credits = 0  # outbound: messages we may still send
        self.window = 0  # outbound: the receiver's window (its first credit)
        self.inbox: dict[tuple, tuple[WireRecord, torch.Tensor | None]] = {}  # inbound: arrived, not consumed
        # broke: every step up to this one fails here (None: the next step a call is made for)
        self.failed: tuple[int | None, LinkError] | None = None


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
        s, prev, nxt = spec.stage, spec.prev_peer, spec.next_peer
        self.act_in = _Link(s - 1, FWD, prev, False) if prev else None
        self.grad_out = _Link(s - 1, BWD, prev, True) if prev else None
        self.act_out = _Link(s, FWD, nxt, True) if nxt else None
        self.grad_in = _Link(s, BWD, nxt, False) if nxt else None
        self.links = [x for x in (self.act_in, self.grad_out, self.act_out, self.grad_in) if x is not None]
        self.aq_out: AQSender | None = None  # AQ-SGD: this end's store of each activation link
        self.aq_in: AQReceiver | None = None
        self.settled: tuple[int, dict[str, dict[str, Any]]] | None = None  # (step, stores()) after the last step
        #: (link, side) -> (step, digest) after each of the last DIGEST_HISTORY steps: observers that sample two
        #: ends at different moments compare them at a step both hold
        self.recent: dict[tuple[str, str], deque[tuple[int, str]]] = {}
        self.checks: dict[tuple[str, str], dict[int, str]] = {}  # (link, side) -> digests at checkpoint steps
        self._fresh: list[tuple[StoreKey, Any, str]] = []  # stores new here: pulled from the other end (adopt)
        self.sigs = SignatureRing()  # a verified run's signatures of the last steps' tensors (evidence)
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

    def _where(self, link: _Link, step: int, micro: int, ids) -> dict[str, Any]:
        return dict(run=self.spec.run_id, lane=self.spec.lane, boundary=link.boundary, direction=link.direction,
                    step=step, micro=micro, ids=tuple(ids))

    def _sign(self, decoded: torch.Tensor, link: _Link, step: int, micro: int, ids) -> bytes:
        return sign_tensor(self.services.sh.key, decoded, **self._where(link, step, micro, ids))

    async def _check_signed(self, link: _Link, rec: WireRecord, x: torch.Tensor, what: str, ids) -> None:
        """A verified run's tensor must carry its sender's signature of what was decoded here: one that does not
        is a violation (penalized, the step aborted); one that does is kept as evidence."""
        ok = bool(rec.sig) and await trio.to_thread.run_sync(
            lambda: tensor_signed_by(link.peer, rec.sig, x, **self._where(link, rec.step, rec.micro, ids)))
        if not ok:
            await self._reject(link, f"{what} of step {rec.step} #{rec.micro} without a valid signature", rec.step)
            raise link.failed[1]
        self.sigs.put(what, rec.step, rec.micro, rec.sig)

    def signatures(self, step: int, micro: int) -> dict[str, bytes]:
        """The signatures this end holds for a training micro-batch (a verified run): of what it sent (act_out,
        grad_out, its own) and of what it received (act_in, grad_in, its neighbours')."""
        return self.sigs.of(step, micro)

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

    def link_statuses(self) -> list[dict[str, Any]]:
        """What the status record says about this stage's activation links (protocol.records.LinkStatus fields):
        the compression, and with AQ-SGD the store digest after the last finished step."""
        out = []
        stores = self.settled[1] if self.settled is not None else {}
        for link, side in ((self.act_in, "receiver"), (self.act_out, "sender")):
            if link is None:
                continue
            st = stores.get(link.name)
            checks = sorted(self.checks.get((link.name, side), {}).items())
            out.append({"link": link.name, "peer": link.peer, "side": side, "compression": self.spec.kind,
                        **({"step": self.settled[0], "digest": st["digest"][:16], "rows": st["rows"],
                            "nacks": st["nacks"], "check_steps": [s for s, _ in checks],
                            "check_digests": [d for _, d in checks]} if st else {})})
        return out

    def recent_digests(self) -> dict[str, dict[str, str]]:
        """"link/side" -> {step: digest} of this end's stores after each of the last steps (AQ-SGD)."""
        return {f"{link}/{side}": {str(step): d for step, d in hist} for (link, side), hist in self.recent.items()}

    def stores(self) -> dict[str, dict[str, Any]]:
        """Per activation link ("b0/fwd"...) with AQ-SGD: this end's store (compression, digest, rows, NACKs)."""
        out = {}
        if self.aq_in is not None:
            out[self.act_in.name] = {"peer": self.act_in.peer, "side": "receiver", **link_status(None, self.aq_in)}
        if self.aq_out is not None:
            out[self.act_out.name] = {"peer": self.act_out.peer, "side": "sender", **link_status(self.aq_out, None)}
        return out

    # -- the calls -----------------------------------------------------------------------------------------

    async def send_act(self, step: int, micro: int, ids: Sequence[int] | torch.Tensor, acts_BTD: torch.Tensor, *,
                       phase: str = TRAIN) -> None:
        link = _need(self.act_out, "the last stage sends no activations")
        await self._enter(step)
        kind = self.spec.kind if phase == TRAIN else self.spec.eval_kind
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        if kind == AQ:
            aq = self.aq_out
            acts = on_codec_device(acts_BTD)  # kept on a CUDA device until committed: no copy to the host
            enc = await self._local(trio.to_thread.run_sync, aq.encode, ids, acts, aq.busy(step, micro))
            await self._send(link, aq.record(step, micro, ids, acts, enc), step, phase, headers=enc.headers,
                             frames=enc.frames)
            return
        header, frame = await trio.to_thread.run_sync(encode_tensor_frame, kind, acts_BTD)
        sig = b""
        if self.spec.signed and phase == TRAIN:  # what the next stage decodes, signed: evidence against us
            sig = await trio.to_thread.run_sync(self._sign, wire_roundtrip(kind, acts_BTD), link, step, micro, ids)
            self.sigs.put("act_out", step, micro, sig)
        await self._send(link, Act(step=step, micro=micro, kind=kind, ids=tuple(ids), phase=phase, sig=sig), step,
                         phase, headers=[header], frames=[frame])

    async def recv_act(self, step: int, micro: int, *, phase: str = TRAIN) -> tuple[torch.Tensor, torch.Tensor]:
        link = _need(self.act_in, "the first stage receives no activations")
        await self._enter(step)
        while True:
            rec, x = await self._take(link, ("act", step, micro, phase), step, phase, f"activations {micro}")
            if rec.kind != AQ:
                if self.spec.signed and phase == TRAIN:
                    await self._check_signed(link, rec, x, "act_in", rec.ids)
                return torch.tensor(rec.ids, dtype=torch.long), x
            try:
                nack = self.aq_in.check(rec, step)
                if not nack:
                    x = await trio.to_thread.run_sync(self.aq_in.apply, rec, x)
                    return torch.tensor(rec.ids, dtype=torch.long), x
            except Violation as e:
                await self._reject(link, str(e), step)
                raise link.failed[1] from None
            self.aq_in.note_nack(rec)  # the sender resends these rows as first visits
            log.info("%s: step %d micro-batch %d: %d rows NACKed (base versions this end lacks)", link.name, step,
                     micro, len(nack))
            out = _need(self.grad_out, "a receiving stage sends gradients")
            await self._send(out, Nack(step=step, micro=micro, rows=tuple(nack)), step, phase)
            out.sent.nacks += 1

    async def send_grad(self, step: int, micro: int, grad_BTD: torch.Tensor) -> None:
        link = _need(self.grad_out, "the first stage sends no gradients")
        await self._enter(step)
        if self.spec.kind == AQ:
            header, frame, _ = await self._local(trio.to_thread.run_sync, encode_group, grad_BTD,
                                                 self.spec.aq.bwd_bits)
            await self._send(link, Grad(step=step, micro=micro, ack=True), step, TRAIN, headers=[header],
                             frames=[frame])
            return
        header, frame = await trio.to_thread.run_sync(encode_tensor_frame, self.spec.kind, grad_BTD)
        sig = b""
        if self.spec.signed:
            sig = await trio.to_thread.run_sync(self._sign, wire_roundtrip(self.spec.kind, grad_BTD), link, step,
                                                micro, ())
            self.sigs.put("grad_out", step, micro, sig)
        await self._send(link, Grad(step=step, micro=micro, sig=sig), step, TRAIN, headers=[header], frames=[frame])

    async def recv_grad(self, step: int, micro: int) -> torch.Tensor:
        link = _need(self.grad_in, "the last stage receives no gradients")
        await self._enter(step)
        rec, g = await self._take(link, ("grad", step, micro, TRAIN), step, TRAIN, f"gradients {micro}")
        if rec.ack and self.aq_out is not None:
            self.aq_out.commit(step, micro)
        if self.spec.signed:
            await self._check_signed(link, rec, g, "grad_in", ())
        return g

    async def exchange_norms(self, step: int, norms: Sequence[float], finite: bool) -> list[tuple[list[float], bool]]:
        """Send this stage's norms both ways, relay what arrives from one side to the other, return all stages'."""
        await self._enter(step)
        mine = LaneNorm(step=step, stage=self.spec.stage, norms=tuple(float(x) for x in norms), finite=finite)
        got: dict[int, LaneNorm] = {mine.stage: mine}
        for out in (self.act_out, self.grad_out):
            if out is not None:
                await self._send(out, mine, step, TRAIN)
        inbound = [x for x in (self.act_in, self.grad_in) if x is not None]

        def arrived() -> tuple[_Link, LaneNorm] | None:
            for link in inbound:
                for key in link.inbox:
                    if key[0] == "norm" and key[1] == step:
                        return link, link.inbox.pop(key)[0]
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
        for link in self.links:
            if not link.outbound:
                stale = [k for k in link.inbox if k[1] == step and k[3] == phase]
                for k in stale:
                    del link.inbox[k]
                await self._grant(link, len(stale))
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

    async def aclose(self) -> None:
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
            self.settled = (self.step, self.stores())  # nothing of `step` has touched the stores yet
            for name, st in self.settled[1].items():
                key, digest = (name, st["side"]), st["digest"][:16]
                self.recent.setdefault(key, deque(maxlen=DIGEST_HISTORY)).append((self.step, digest))
                checks = self.checks.setdefault(key, {})
                checks[self.step] = digest
                for old in set(checks) - set(checkpoint_steps(checks)):
                    del checks[old]
        self.step = step
        self._aborted = {k: v for k, v in self._aborted.items() if k[0] >= step - 1}
        if self.aq_out is not None:
            self.aq_out.drop(step - 1)
        for link in self.links:
            if not link.outbound:
                stale = [k for k in link.inbox if k[1] < step]
                for k in stale:
                    del link.inbox[k]
                await self._grant(link, len(stale))
                far = [k for k in link.inbox if k[1] > step + 1]
                if far:  # arrived before this end knew its step
                    await self._reject(link, f"message for step {far[0][1]} while the lane is at step {step}", step)

    def _check(self, step: int, phase: str, links: list[_Link]) -> None:
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

    async def _wait(self, what: str, step: int, phase: str, links: list[_Link], ready: Callable[[], Any],
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

    async def _take(self, link: _Link, key: tuple, step: int, phase: str, what: str):
        item = await self._wait(what, step, phase, [link], lambda: link.inbox.pop(key, None),
                                self.config.recv_timeout_s)
        await self._grant(link, 1)
        return item

    # -- sending --------------------------------------------------------------------------------------------

    async def _open(self, link: _Link) -> None:
        """Dial the neighbour, say hello, get the first credit; retried while it refuses, until the dial deadline."""
        if link.stream is not None:
            return
        if self.services.penalties.is_banned(link.peer):
            raise LinkError(LinkError.DIAL, "the neighbour is banned", link.peer)
        hello = LinkHello(run=self.spec.run_id, boundary=link.boundary, lane=self.spec.lane,
                          direction=link.direction, peers=(self.me, link.peer))
        deadline = trio.current_time() + self.config.dial_timeout_s
        refused = ""
        while True:
            stream = None
            try:
                with trio.fail_at(deadline):
                    stream = await self.services.sh.open_stream(link.peer, LANE_PROTOCOL)
                    body = encode_message(hello)
                    await stream.write(LEN.pack(len(body)) + body)
                    raw = await read_frame(stream, MAX_CONTROL_BYTES)
                    reply = decode_message(raw, frozenset({Credit.TYPE, Refuse.TYPE}))
            except trio.TooSlowError:
                await reset_quietly(stream)
                why = f"refused: {refused}" if refused else f"no answer within {self.config.dial_timeout_s:g} s"
                raise LinkError(LinkError.DIAL, why, link.peer) from None
            except ProtocolError as e:
                await reset_quietly(stream)
                self.services.penalties.penalize(link.peer, f"lane link: bad answer to hello: {e}")
                raise LinkError(LinkError.VIOLATION, f"bad answer to hello: {e}", link.peer) from e
            except Exception as e:  # noqa: BLE001 - dial errors come as many types from py-libp2p
                await reset_quietly(stream)
                raise LinkError(LinkError.DIAL, f"{type(e).__name__}: {e}", link.peer) from e
            link.sent.control_bytes += 4 + len(body)
            link.recv.control_bytes += 4 + len(raw)
            if isinstance(reply, Credit):
                link.stream, link.credits, link.window, link.failed = stream, reply.n, reply.n, None
                self.services.nursery.start_soon(self._read_credits, link, stream)
                return
            await close_quietly(stream)
            refused = reply.reason
            if trio.current_time() + self.config.retry_interval_s >= deadline:
                raise LinkError(LinkError.DIAL, f"refused: {refused}", link.peer)
            await trio.sleep(self.config.retry_interval_s)

    async def _read_credits(self, link: _Link, stream) -> None:
        try:
            while link.stream is stream:
                raw = await read_frame(stream, MAX_CONTROL_BYTES)
                rec = decode_message(raw, frozenset({Credit.TYPE}))
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

    async def _send(self, link: _Link, rec: WireRecord, step: int, phase: str, *, headers=(),
                    frames: list[bytes] = ()) -> None:
        await self._open(link)
        await self._wait(f"credit on {link.name}", step, phase, [link], lambda: link.credits > 0 or None,
                         self.config.send_timeout_s)
        link.credits -= 1
        parts = [encode_message(rec), *frames]
        await self._write(link, parts)
        link.sent.messages += 1
        link.sent.wire_bytes += sum(4 + len(p) for p in parts)
        link.sent.payload_bytes += sum(h.nbytes for h in headers)

    @staticmethod
    async def _local(run, *args):
        """Encode on a worker thread; values the wire cannot carry fail the step here (LinkError LOCAL)."""
        try:
            return await run(*args)
        except NonFiniteError as e:
            raise LinkError(LinkError.LOCAL, f"non-finite values: not sent ({e})") from e

    async def _resend(self, rec: Nack, pending) -> None:
        """Answer a NACK: the micro-batch again, the NACKed rows as first visits (a task of the hub's nursery)."""
        aq, link = self.aq_out, self.act_out
        try:
            enc = await self._local(trio.to_thread.run_sync, aq.encode, pending.ids, pending.acts,
                                    aq.busy(rec.step, rec.micro), set(rec.rows))
            act = aq.record(rec.step, rec.micro, pending.ids, pending.acts, enc)
            await self._send(link, act, rec.step, TRAIN, headers=enc.headers, frames=enc.frames)
        except Exception as e:  # noqa: BLE001 - the step fails at the receiver's deadline or by an abort
            log.info("%s: resend of step %d micro-batch %d failed: %s", link.name, rec.step, rec.micro, e)

    async def _write(self, link: _Link, parts: list[bytes], *, control: bool = False) -> None:
        stream = link.stream
        if stream is None:
            raise LinkError(LinkError.CLOSED, f"{link.name} is closed", link.peer)
        data = b"".join(LEN.pack(len(p)) + p for p in parts)
        try:
            with trio.fail_after(self.config.send_timeout_s):
                async with link.write_lock:
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

    async def _grant(self, link: _Link, n: int) -> None:
        """Give `n` credits back on an inbound link (consumed or dropped messages); a dead stream is left alone."""
        if n <= 0 or link.stream is None:
            return
        try:
            await self._write(link, [encode_message(Credit(n=n))], control=True)
        except LinkError as e:
            log.debug("credit on %s not sent: %s", link.name, e)

    # -- receiving ------------------------------------------------------------------------------------------

    async def attach(self, link: _Link, stream, hello_nbytes: int) -> None:
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
                    rec = decode_message(raw, DATA_TYPES[link.direction])
                    kind = self._check_record(link, rec)
                    tensor, wire, payload = None, 4 + n, 0
                    if rec.TYPE in TENSOR_TYPES and kind != AQ:
                        expected = payload_nbytes(kind, *self.spec.shape)
                        buf = await read_frame(stream, 8 + MAX_HEADER_BYTES + expected)
                        tensor = await trio.to_thread.run_sync(decode_tensor_frame, buf, kind, self.spec.shape)
                        wire, payload = wire + 4 + len(buf), expected
                    elif rec.TYPE in TENSOR_TYPES:
                        groups = []
                        for rows, bits in self._aq_groups(rec):
                            if not rows:
                                groups.append(None)
                                continue
                            expected = group_nbytes(rows, self.spec.seq_len, self.spec.d_model, bits)
                            buf = await read_frame(stream, 8 + MAX_HEADER_BYTES + expected)
                            groups.append(await trio.to_thread.run_sync(
                                decode_group, buf, rows, self.spec.seq_len, self.spec.d_model, bits))
                            wire, payload = wire + 4 + len(buf), payload + expected
                        tensor = tuple(groups) if isinstance(rec, Act) else groups[0]
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
            try:
                await self._admit(link, rec, tensor)
            except Violation as e:
                await self._reject(link, str(e), rec.step)
                return

    def _check_record(self, link: _Link, rec: WireRecord) -> str | None:
        """Checks that need this lane's spec; returns the tensor kind that follows (None: no tensor)."""
        sp = self.spec
        if isinstance(rec, Act):
            train = rec.phase == TRAIN
            kind, count, n_ids = (sp.kind, sp.micro_batches, sp.train_samples) if train else (
                sp.eval_kind, sp.eval_batches, sp.eval_samples)
            if rec.kind != kind:
                raise Violation(f"{rec.phase} activations at {rec.kind}, this run sends {kind}")
            if kind == AQ and rec.bits != sp.aq.fwd_bits:
                raise Violation(f"deltas at {rec.bits} bits, this run sends {sp.aq.fwd_bits}")
            if rec.micro >= count:
                raise Violation(f"{rec.phase} micro-batch {rec.micro} of {count}")
            if len(rec.ids) != sp.micro_batch or max(rec.ids) >= n_ids:
                raise Violation(f"sample ids: {len(rec.ids)} of them (expected {sp.micro_batch}), "
                                f"largest {max(rec.ids)} (the {rec.phase} set has {n_ids})")
            return kind
        if isinstance(rec, Grad):
            if rec.micro >= sp.micro_batches:
                raise Violation(f"gradients of micro-batch {rec.micro} of {sp.micro_batches}")
            return sp.kind
        if isinstance(rec, LaneNorm):
            ok = rec.stage < sp.stage if link.direction == FWD else sp.stage < rec.stage < sp.num_stages
            if not ok:
                raise Violation(f"norms of stage {rec.stage} cannot come from this side of stage {sp.stage}")
            return None
        if isinstance(rec, Abort):
            return None
        if isinstance(rec, Nack) and sp.kind == AQ:
            if rec.micro >= sp.micro_batches:
                raise Violation(f"NACK of micro-batch {rec.micro} of {sp.micro_batches}")
            return None
        raise Violation(f"{rec.TYPE} is not used on a {sp.kind} link")

    def _aq_groups(self, rec: WireRecord) -> list[tuple[int, int]]:
        """The AQ-SGD row groups (rows, bits) whose tensor frames follow a record (0 rows: no frame)."""
        aq = self.spec.aq
        if isinstance(rec, Act):
            return [(rec.n_first, aq.first_bits), (rec.n_delta, aq.fwd_bits)]
        return [(self.spec.micro_batch, aq.bwd_bits)]

    async def _admit(self, link: _Link, rec: WireRecord, tensor: torch.Tensor | None) -> None:
        phase = rec.phase if isinstance(rec, Act) else TRAIN
        if (self.step is not None and rec.step < self.step) or (rec.step, phase) in self._aborted:
            await self._grant(link, 1)  # a step already over or given up: dropped, its credit returned
            return
        if isinstance(rec, Nack):
            pending = self.aq_out.nacked(rec)  # raises Violation
            link.recv.nacks += 1
            await self._grant(link, 1)
            self.services.nursery.start_soon(self._resend, rec, pending)
            return
        if self.step is not None and rec.step > self.step + 1:
            raise Violation(f"message for step {rec.step} while the lane is at step {self.step}")
        key = ((rec.TYPE, rec.step, rec.stage, TRAIN) if isinstance(rec, LaneNorm)
               else (rec.TYPE, rec.step, rec.micro, phase))
        if key in link.inbox:
            raise Violation(f"{rec.TYPE} for step {rec.step} #{key[2]} sent twice")
        if len(link.inbox) >= self.config.credit_window:
            raise Violation(f"more than its credit of {self.config.credit_window} unconsumed messages")
        link.inbox[key] = (rec, tensor)
        self._wake()

    async def _reject(self, link: _Link, reason: str, claimed_step: int | None) -> None:
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

    async def _lost(self, link: _Link, reason: str) -> None:
        """The stream broke (closed, reset, timed out): the step in progress cannot use it."""
        log.info("lane %d stage %d: %s to/from %s lost: %s", self.spec.lane, self.spec.stage, link.name, link.peer,
                 reason)
        link.failed = (self.step, LinkError(LinkError.CLOSED, f"{link.name} lost: {reason}", link.peer))
        stream, link.stream = link.stream, None
        await reset_quietly(stream)
        self._wake()


def _need(link: _Link | None, why: str) -> _Link:
    if link is None:
        raise ValueError(why)
    return link
