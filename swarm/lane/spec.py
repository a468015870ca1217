"""What a lane link is made of: its config and spec, one end's state of it, what may cross it, its errors, byte
counters and tensor frames."""

from __future__ import annotations

import os
import struct
import tempfile
from dataclasses import dataclass
from typing import Any

import torch
import trio

from shoal.kernels.codec import CastCodec, Encoded, NoCompression, tensor_from_buffer
from shoal.kernels.quant import NonFiniteError
from shoal.protocol.errors import FieldError, ProtocolError
from shoal.protocol.frames import decode_frame, encode_frame, make_header
from shoal.protocol.lane import AQ, DENSE_KINDS, FWD, TRAIN, Abort, Act, Grad, LaneAborted, LaneNorm, Nack, StepMessage
from shoal.protocol.manifest import RunManifest
from shoal.swarm.lane.aq_codec import AQSpec

LEN = struct.Struct(">I")  # swarm/net/framing.py's length prefix
MAX_CONTROL_BYTES = 1024
_CODECS = {"fp32": NoCompression(), "fp16": CastCodec(torch.float16)}


class LinkError(LaneAborted):
    """A link could not carry a step. `cause` is one of the class constants; `peer` the neighbour concerned."""

    DIAL, DEADLINE, VIOLATION, CLOSED, ABORTED, LOCAL = "dial", "deadline", "violation", "closed", "aborted", "local"

    def __init__(self, cause: str, reason: str, peer: str | None = None):
        super().__init__(f"{cause}: {reason}" + (f" (peer {peer})" if peer else ""), peer)
        self.cause, self.reason = cause, reason


class Violation(ProtocolError):
    """A well-formed message that this link must not carry (wrong step, lane, shape, micro-batch, credit...)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LinkConfig:
    credit_window: int = 4  # data messages a sender may have sent that this receiver has not consumed
    dial_timeout_s: float = 5.0  # one dial: open a stream, say hello, get an answer (a credit or a refusal)
    #: how long a dialer retries a neighbour that answers but refuses (its end of the link is not open yet: it is
    #: still entering its slot at the switch step, pulling its group's state and its AQ-SGD stores, which can take
    #: longer than one dial; the receiving side waits up to recv_timeout_s for the same first message)
    open_timeout_s: float = 30.0
    send_timeout_s: float = 30.0  # wait for credit and write one message; also: finish a message once begun
    recv_timeout_s: float = 60.0  # wait for one message (the pipeline bubble is part of it)
    abort_timeout_s: float = 2.0  # tell the neighbours a step is given up (best effort)
    retry_interval_s: float = 0.1  # between dials the peer refused, doubling up to max_retry_interval_s
    max_retry_interval_s: float = 1.0

    def __post_init__(self) -> None:
        if not 1 <= self.credit_window <= 1024:
            raise ValueError("credit_window must be in 1..1024")
        if min(self.dial_timeout_s, self.open_timeout_s, self.send_timeout_s, self.recv_timeout_s,
               self.abort_timeout_s, self.retry_interval_s, self.max_retry_interval_s) <= 0:
            raise ValueError("timeouts must be positive")


@dataclass(frozen=True, kw_only=True, slots=True)
class LaneSpec:
    """What one stage's links must know: its slot, its neighbours, and what may cross (from the manifest)."""

    run_id: str
    lane: int
    stage: int
    num_stages: int
    replicas: int
    prev_peer: str | None  # stage - 1 of this lane (None at stage 0)
    next_peer: str | None  # stage + 1 (None at the last stage)
    micro_batch: int  # rows of every micro-batch (training and eval)
    seq_len: int
    d_model: int
    micro_batches: int  # M per step at most (a lane's share of the global batch, in micro-batches)
    eval_batches: int
    train_samples: int  # sample ids of training micro-batches are below this
    eval_samples: int  # and of eval micro-batches below this
    kind: str = "fp32"  # activations and gradients of training micro-batches ("aqsgd": `aq` says how)
    eval_kind: str = "fp16"
    aq: AQSpec | None = None
    signed: bool = False  # a verified run: training activations and gradients carry the sender's signature

    def __post_init__(self) -> None:
        if not (0 <= self.stage < self.num_stages and 0 <= self.lane < self.replicas):
            raise ValueError(f"slot (stage {self.stage}, lane {self.lane}) outside {self.num_stages}x{self.replicas}")
        if (self.prev_peer is None) != (self.stage == 0) or (self.next_peer is None) != (
                self.stage == self.num_stages - 1):
            raise ValueError("a stage has a previous peer unless it is the first, a next peer unless it is the last")
        if min(self.micro_batch, self.seq_len, self.d_model, self.micro_batches, self.eval_batches,
               self.train_samples, self.eval_samples) < 1:
            raise ValueError("shapes, counts and sample ranges must be positive")
        if self.kind not in (*DENSE_KINDS, AQ) or self.eval_kind not in DENSE_KINDS:
            raise ValueError(f"kinds must be among {sorted(DENSE_KINDS)} (training also {AQ})")
        if (self.kind == AQ) != (self.aq is not None):
            raise ValueError(f"kind {AQ} goes with its settings (aq), and only it")
        if self.signed and self.kind not in DENSE_KINDS:
            raise ValueError("signed tensors need a dense wire (what the receiver decodes is the sender's to sign)")

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.micro_batch, self.seq_len, self.d_model

    @classmethod
    def from_manifest(cls, m: RunManifest, *, stage: int, lane: int, prev_peer: str | None, next_peer: str | None,
                      train_samples: int, eval_samples: int, kind: str | None = None, eval_kind: str = "fp16",
                      buffer_dir: str | None = None) -> LaneSpec:
        """The spec of slot (stage, lane) of a run; the sample counts are the corpus's (node.train.data.Samples).
        `kind`: the manifest's by default (AQ-SGD, or its wire dtype); `buffer_dir`: where disk buffers go."""
        b, p = m.batch, m.plan.pipeline
        if kind is None:
            kind = AQ if p.compression == AQ else p.wire_dtype
        aq = None
        if kind == AQ:
            aq = AQSpec.from_pipeline(p, buffer_dir or os.path.join(tempfile.gettempdir(), f"shoal-aq-{m.run_id[:16]}"))
        return cls(run_id=m.run_id, lane=lane, stage=stage, num_stages=m.plan.stages, replicas=m.plan.lanes_max,
                   prev_peer=prev_peer, next_peer=next_peer, micro_batch=b.micro_batch_size, seq_len=b.seq_len,
                   d_model=m.model.d_model, micro_batches=m.global_batch // b.micro_batch_size,
                   eval_batches=m.eval.batches, train_samples=train_samples, eval_samples=eval_samples, kind=kind,
                   eval_kind=eval_kind, aq=aq, signed=p.verify_fraction > 0 and kind in DENSE_KINDS)


@dataclass(slots=True)
class LinkCounters:
    """Bytes one way on one link, as this end saw them (owned by the event loop)."""

    messages: int = 0  # data messages (activations, gradients, norms)
    wire_bytes: int = 0  # their bytes: record and tensor frames with their length prefixes
    payload_bytes: int = 0  # of which tensor payload
    fp32_bytes: int = 0  # the same tensors at 4 bytes a value: what the uncompressed (fp32) wire would carry
    nacks: int = 0  # AQ-SGD NACK messages (part of the data messages)
    control_bytes: int = 0  # hello, credits, refusals, aborts (with length prefixes)


class Link:
    """One directed link as this end sees it: outbound (we send data, read credits) or inbound (the reverse)."""

    def __init__(self, boundary: int, direction: str, peer: str, outbound: bool):
        self.boundary, self.direction, self.peer, self.outbound = boundary, direction, peer, outbound
        self.name = f"b{boundary}/{direction}"
        self.sent, self.recv = LinkCounters(), LinkCounters()
        self.stream = None
        self.write_lock = trio.Lock()
        self.credits = 0  # outbound: messages we may still send
        self.window = 0  # outbound: the receiver's window (its first credit)
        #: inbound: arrived, not consumed: each record with its raw tensor frames (the consumer decodes them)
        self.inbox: dict[tuple, tuple[StepMessage, Any]] = {}
        # broke: every step up to this one fails here (None: the next step a call is made for)
        self.failed: tuple[int | None, LinkError] | None = None


def check_record(sp: LaneSpec, direction: str, rec: StepMessage) -> str | None:
    """What may cross a link of `direction` (FWD, BWD) into stage `sp.stage`, beyond the record's own validation:
    its kind, bits, micro-batch, sample ids, which side norms come from. Returns the tensor kind that follows (None:
    no tensor); raises Violation."""
    if isinstance(rec, Act):
        train = rec.phase == TRAIN
        kind, count, n_ids = (sp.kind, sp.micro_batches, sp.train_samples) if train else (
            sp.eval_kind, sp.eval_batches, sp.eval_samples)
        if rec.kind != kind:
            raise Violation(f"{rec.phase} activations at {rec.kind}, this run sends {kind}")
        if kind == AQ and sp.aq is not None and rec.bits != sp.aq.fwd_bits:
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
        ok = rec.stage < sp.stage if direction == FWD else sp.stage < rec.stage < sp.num_stages
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



def aq_groups(sp: LaneSpec, rec: StepMessage) -> list[tuple[int, int]]:
    """The AQ-SGD row groups (rows, bits) whose tensor frames follow a record on an AQ-SGD link (0 rows: no frame)."""
    aq = sp.aq
    if aq is None:
        raise ValueError("AQ-SGD row groups come on AQ-SGD links only")
    if isinstance(rec, Act):
        return [(rec.n_first, aq.first_bits), (rec.n_delta, aq.fwd_bits)]
    return [(sp.micro_batch, aq.bwd_bits)]


def encode_tensor_frame(kind: str, x: torch.Tensor) -> tuple[Any, bytes]:
    """(header, frame bytes) of activations or gradients at a dense kind; non-finite values are never sent."""
    x = x.detach().to("cpu", torch.float32).contiguous()
    try:
        if not bool(torch.isfinite(x).all()):
            raise NonFiniteError("NaN or Inf")
        e = _CODECS[kind].encode(x)  # fp16 rejects values it cannot hold
    except NonFiniteError as err:
        raise LinkError(LinkError.LOCAL, f"non-finite {kind} values: not sent ({err})") from err
    mv = e.payload_bytes()
    header = make_header(e.codec, e.dtype, e.shape, e.bits, e.bucket, e.count, mv)
    head, body = encode_frame(header, mv)
    return header, bytes(head) + bytes(body)


def decode_tensor_frame(buf: bytes, kind: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A received tensor frame: exactly this kind and shape, finite; float32. Raises ProtocolError."""
    numel = shape[0] * shape[1] * shape[2]
    h, payload = decode_frame(buf, max_numel=numel, max_payload=len(buf))
    codec = _CODECS[kind]
    if (h.codec, h.dtype, h.shape) != (codec.name, "float32", shape):
        raise FieldError("tensor", f"{h.codec} {h.dtype} {list(h.shape)}, expected {codec.name} float32 {list(shape)}")
    x = codec.decode(Encoded(h.codec, h.dtype, h.shape, h.bits, h.bucket, h.count, tensor_from_buffer(payload)))
    if not bool(torch.isfinite(x).all()):
        raise FieldError("tensor", "non-finite values")
    return x.clone() if kind == "fp32" else x  # fp32 views the received bytes; fp16 was already converted


async def reset_quietly(stream) -> None:
    """Reset a stream that may already be gone (or None)."""
    if stream is None:
        return
    try:
        await stream.reset()
    except Exception:  # noqa: BLE001
        pass
