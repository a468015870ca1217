"""Records on a lane's links (pipeline stage s <-> s+1): hello, activations, gradients, NACKs, norms, aborts, credits.

A link is one persistent stream per direction of a stage boundary. The dialer writes `LinkHello`, the receiver
answers `Credit` (its window) or `Refuse`; then data messages flow one way (`Act`, `LaneNorm`, `Abort` forward;
`Grad`, `Nack`, `LaneNorm`, `Abort` backward) and `Credit` flows back as the receiver consumes them. Every message
is one length-prefixed frame holding msgpack `{"t": type, "r": record}`; `Act` and `Grad` are followed by one
length-prefixed tensor frame (protocol/frames.py). `lane_message_nbytes` is the exact wire size of a message.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, TypeVar

from shoal.protocol.assignment import MAX_REPLICAS, MAX_STAGES, RUN_ID
from shoal.protocol.errors import DecodeError, FieldError
from shoal.protocol.frames import TensorHeader, frame_nbytes
from shoal.protocol.records import PEER_ID
from shoal.protocol.schema import Bool, Bytes, Choice, Float, Int, Seq, Str, WireRecord, spec
from shoal.protocol.wire import expect_map, pack, unpack

LANE_PROTOCOL = "/shoal/lane/1.0.0"
FWD, BWD = "fwd", "bwd"  # activations s -> s+1; gradients s+1 -> s
TRAIN, EVAL = "train", "eval"
#: activation/gradient widths on the wire without compression
DENSE_KINDS: dict[str, int] = {"fp32": 32, "fp16": 16}
#: AQ-SGD (docs/pipeline.md, "AQ-SGD over a link"): first visits and deltas against the buffers both ends keep
AQ = "aqsgd"
ACT_KINDS = frozenset(DENSE_KINDS) | {AQ}
AQ_DELTA_BITS = (2, 3, 4, 8)
MAX_MICRO = 4096  # micro-batches per step, eval batches per evaluation
MAX_ROWS = 4096  # samples per micro-batch
MAX_PARAMS = 4096  # parameter tensors per stage
MAX_SAMPLE_ID = 2**40
MAX_RECORD_BYTES = 64 * 1024  # a record frame (4096 ids of <= 9 bytes fit)
STEP = Int(0, 2**62)
LENGTH_PREFIX_BYTES = 4  # swarm/net/framing.py: every frame is a 4-byte length + body


class LaneAborted(Exception):
    """A lane's step cannot finish at this stage: a link failed, a deadline passed, a neighbour misbehaved or
    aborted. The stage gives the step up (no update) and the lane goes on at the next step. `peer`: the neighbour
    concerned, when one is (what the runtime reports to the broker)."""

    def __init__(self, reason: str, peer: str | None = None):
        super().__init__(reason)
        self.peer = peer


class LaneMessage(WireRecord):
    """A record on a lane link, by its `TYPE` (the "t" of its frame)."""

    __slots__ = ()
    TYPE: ClassVar[str]


class StepMessage(LaneMessage):
    """A data message: it belongs to one step of the lane (`step`)."""

    __slots__ = ()
    step: int


@dataclass(frozen=True, kw_only=True, slots=True)
class LinkHello(LaneMessage):
    """The dialer's first message: which link this stream is. `peers` is (sender, receiver) of the data."""

    TYPE: ClassVar[str] = "hello"
    run: str = spec(RUN_ID)
    boundary: int = spec(Int(0, MAX_STAGES - 2))  # between stage `boundary` and `boundary + 1`
    lane: int = spec(Int(0, MAX_REPLICAS - 1))
    direction: str = spec(Choice(frozenset({FWD, BWD})))
    peers: tuple[str, ...] = spec(Seq(PEER_ID, 2))
    digest: bytes = spec(Bytes(32), default=b"")  # AQ-SGD: the sender's store digest (empty: no store)
    revision: int = spec(STEP, default=0)  # AQ-SGD: the revision the store is at

    def __post_init__(self) -> None:
        WireRecord.__post_init__(self)
        if len(self.peers) != 2 or self.peers[0] == self.peers[1]:
            raise FieldError("peers", "expected two different peer ids (sender, receiver)")


@dataclass(frozen=True, kw_only=True, slots=True)
class Act(StepMessage):
    """Activations of one micro-batch (followed by its tensor frame); `ids` are its samples, in row order."""

    TYPE: ClassVar[str] = "act"
    step: int = spec(STEP)
    micro: int = spec(Int(0, MAX_MICRO - 1))
    kind: str = spec(Choice(ACT_KINDS))
    ids: tuple[int, ...] = spec(Seq(Int(0, MAX_SAMPLE_ID), MAX_ROWS))
    phase: str = spec(Choice(frozenset({TRAIN, EVAL})), default=TRAIN)
    # AQ-SGD: each row's base version (the version of the sender's row the delta is against; 0: a first visit),
    # how many rows are first visits, the delta bits. The first visits' tensor frame follows (when n_first > 0),
    # then the deltas' (when rows are left)
    base_versions: tuple[int, ...] = spec(Seq(STEP, MAX_ROWS), default=())
    n_first: int = spec(Int(0, MAX_ROWS), default=0)
    bits: int = spec(Int(0, 16), default=0)
    # a verified run's training activations: the sender's signature of what the receiver decodes
    # (`tensor_signing_payload`), the evidence its neighbours hold against it (docs/verified-stages.md)
    sig: bytes = spec(Bytes(64), default=b"", omit_if_default=True)

    def __post_init__(self) -> None:
        WireRecord.__post_init__(self)
        if not self.ids:
            raise FieldError("ids", "a micro-batch holds at least one sample")
        if self.kind in DENSE_KINDS and (self.base_versions or self.n_first or self.bits):
            raise FieldError("kind", f"{self.kind} activations carry no base versions, first visits or bits")
        if self.kind == AQ:
            if len(self.base_versions) != len(self.ids):
                raise FieldError("base_versions", f"{len(self.base_versions)} for {len(self.ids)} rows")
            if self.n_first != sum(1 for v in self.base_versions if v == 0):
                raise FieldError("n_first", f"{self.n_first}, but {self.base_versions.count(0)} rows have base 0")
            if self.bits not in AQ_DELTA_BITS:
                raise FieldError("bits", f"AQ-SGD deltas go at one of {AQ_DELTA_BITS} bits, not {self.bits}")

    @property
    def n_delta(self) -> int:
        return len(self.ids) - self.n_first


@dataclass(frozen=True, kw_only=True, slots=True)
class Grad(StepMessage):
    """The gradient of one micro-batch's activations (followed by its tensor frame)."""

    TYPE: ClassVar[str] = "grad"
    step: int = spec(STEP)
    micro: int = spec(Int(0, MAX_MICRO - 1))
    ack: bool = spec(Bool(), default=False)  # AQ-SGD: the sender may commit the micro-batch's buffer rows
    sig: bytes = spec(Bytes(64), default=b"", omit_if_default=True)  # a verified run's: as Act's


@dataclass(frozen=True, kw_only=True, slots=True)
class Nack(StepMessage):
    """AQ-SGD: rows of a micro-batch whose base version the receiver does not hold; resent as first visits."""

    TYPE: ClassVar[str] = "nack"
    step: int = spec(STEP)
    micro: int = spec(Int(0, MAX_MICRO - 1))
    rows: tuple[int, ...] = spec(Seq(Int(0, MAX_ROWS - 1), MAX_ROWS))


@dataclass(frozen=True, kw_only=True, slots=True)
class LaneNorm(StepMessage):
    """Stage `stage`'s gradient norms after its backward, one per parameter tensor in the stage's (global) order;
    relayed along the lane to every stage. Every stage combines all of them exactly as the unsplit model's
    `clip_grad_norm_` does, so the lane clips bit for bit like the whole model (one squared norm per stage would
    change the summation order). A stage whose norms are not all finite sends `finite=False` and no norms."""

    TYPE: ClassVar[str] = "norm"
    step: int = spec(STEP)
    stage: int = spec(Int(0, MAX_STAGES - 1))
    norms: tuple[float, ...] = spec(Seq(Float(0.0, 3.5e38), MAX_PARAMS))  # float32 values
    finite: bool = spec(Bool())

    def __post_init__(self) -> None:
        WireRecord.__post_init__(self)
        if not self.finite and self.norms:
            raise FieldError("norms", "a non-finite stage sends none")


@dataclass(frozen=True, kw_only=True, slots=True)
class Abort(StepMessage):
    """The sender gave up on `step` (its neighbours stop waiting for it). Needs no credit."""

    TYPE: ClassVar[str] = "abort"
    step: int = spec(STEP)
    phase: str = spec(Choice(frozenset({TRAIN, EVAL})), default=TRAIN)
    reason: str = spec(Str(200), default="")


@dataclass(frozen=True, kw_only=True, slots=True)
class Credit(LaneMessage):
    """Receiver -> sender: `n` more data messages may be sent (the first one, after the hello, is the window)."""

    TYPE: ClassVar[str] = "credit"
    n: int = spec(Int(1, 1024))


@dataclass(frozen=True, kw_only=True, slots=True)
class Refuse(LaneMessage):
    """Receiver -> dialer, instead of the first credit: this link is not open here (yet)."""

    TYPE: ClassVar[str] = "refuse"
    reason: str = spec(Str(200))


LANE_RECORDS: dict[str, type[LaneMessage]] = {
    c.TYPE: c for c in (LinkHello, Act, Grad, Nack, LaneNorm, Abort, Credit, Refuse)}
#: data messages each direction may carry (anything else on a link is a violation)
DATA_TYPES = {FWD: frozenset({"act", "norm", "abort"}), BWD: frozenset({"grad", "nack", "norm", "abort"})}
TENSOR_TYPES = frozenset({"act", "grad"})  # followed by one tensor frame
M = TypeVar("M", bound=LaneMessage)


def encode_message(rec: LaneMessage) -> bytes:
    """The body of one frame (the framing adds its 4-byte length)."""
    return pack({"t": type(rec).TYPE, "r": rec.to_wire()})


def decode_message(raw: bytes, allowed: frozenset[str]) -> LaneMessage:
    """One frame body from the network: a known record type the link allows, strictly validated."""
    m = expect_map(unpack(raw, max_bytes=MAX_RECORD_BYTES), "lane message")
    t = m.get("t")
    if t not in allowed or not isinstance(t, str):
        raise DecodeError(f"lane message of type {t!r} where only {sorted(allowed)} may come")
    return LANE_RECORDS[t].from_wire(m.get("r"))


def decode_data(raw: bytes, direction: str) -> StepMessage:
    """One data message from the network (DATA_TYPES of the link's direction), strictly validated."""
    rec = decode_message(raw, DATA_TYPES[direction])
    assert isinstance(rec, StepMessage)  # every data type is
    return rec


def decode_one(raw: bytes, cls: type[M]) -> M:
    """One frame body from the network that must be a `cls` record, strictly validated."""
    rec = decode_message(raw, frozenset({cls.TYPE}))
    assert isinstance(rec, cls)  # the only type allowed
    return rec


def payload_nbytes(kind: str, batch: int, seq: int, hidden: int) -> int:
    """Tensor payload of one micro-batch at a dense kind: B·T·H·fb/8 (docs/pipeline.md, "The link protocol")."""
    return batch * seq * hidden * DENSE_KINDS[kind] // 8


TENSOR_SIGNING_DOMAIN = b"shoal/lane-tensor/v1\0"


def tensor_signing_payload(*, run: str, lane: int, boundary: int, direction: str, step: int, micro: int,
                           ids: tuple[int, ...], digest: bytes) -> bytes:
    """What a stage signs of a training tensor it sends across `boundary` of `lane`: where it went, which step and
    micro-batch (and samples) it belongs to, and the digest of the tensor as the receiver decodes it."""
    return TENSOR_SIGNING_DOMAIN + pack([run, lane, boundary, direction, step, micro, list(ids), digest])


def lane_message_nbytes(rec: LaneMessage, *tensors: TensorHeader | None) -> int:
    """Exact wire bytes of one message: the record's frame (h), plus its tensor frames (headers and payloads).

    forward = h + B·T·H·fb/8 and backward = h + B·T·H·bb/8 for the dense kinds, where h is this record's and its
    tensor header's encoding with their length prefixes (a few dozen bytes; it grows with the ids). With AQ-SGD,
    forward = h + n_first·T·H·fb/8 + n_delta·T·H·b/8 + scales and backward = h + B·T·H·bb/8 + scales
    (swarm/lane/aq_codec.py `group_nbytes`), h now counting each group's frame header."""
    n = LENGTH_PREFIX_BYTES + len(encode_message(rec))
    for tensor in tensors:
        if tensor is not None:
            n += LENGTH_PREFIX_BYTES + frame_nbytes(tensor)
    return n
