"""What a lane link's tensor messages carry, encoded and decoded in the caller's own thread: tensors in, bytes out
on the way to the wire, bytes in, tensors out on the way back (as the collective's blocking exchange does for the
synchronizers). The event loop moves only bytes: a stage's trainer thread hands it finished frames and takes raw
frames from it, one call each way per message (docs/architecture.md, "The life of a micro-batch").

The AQ-SGD state these functions read and write (a sender's store and pending rows, a receiver's store and its
NACKs) belongs to the stage's sequence of link calls: the loop changes it only inside those calls (`LinkEnd`), while
the caller's thread waits for them, so the two never write it at once. One exception, harmless: a NACK's resend
records its micro-batch again under the key it already has (the set of pending micro-batches does not change).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from shoal.kernels.quant import NonFiniteError
from shoal.protocol.lane import AQ, TRAIN, Act
from shoal.swarm.lane.aq_codec import Encoding, decode_group, encode_group, on_codec_device
from shoal.swarm.lane.aq_link import AQReceiver, AQSender
from shoal.swarm.lane.spec import LaneSpec, LinkError, decode_tensor_frame, encode_tensor_frame


@dataclass(slots=True)
class Outgoing:
    """One message's tensor part, encoded: its frames (bytes) and their headers (for the byte counters)."""

    kind: str
    frames: list[bytes]
    headers: list = field(default_factory=list)
    ids: list[int] = field(default_factory=list)  # activations: the micro-batch's samples, in row order
    encoding: Encoding | None = None  # AQ-SGD activations: the encoding against the sender's store
    acts: torch.Tensor | None = None  # ... and what a NACKed row is resent from
    sig: bytes = b""  # a verified run's training tensors: the sender's signature (LinkEnd.seal)


def _local(fn, *args):
    """Values the wire cannot carry fail the step here (LinkError LOCAL), never reach a neighbour."""
    try:
        return fn(*args)
    except NonFiniteError as e:
        raise LinkError(LinkError.LOCAL, f"non-finite values: not sent ({e})") from e


def encode_acts(spec: LaneSpec, aq: AQSender | None, step: int, micro: int, ids: Sequence[int] | torch.Tensor,
                acts_BTD: torch.Tensor, phase: str = TRAIN) -> Outgoing:
    """Activations of one micro-batch: with AQ-SGD, encoded against the sender's store (first visits and deltas),
    else at the link's dense kind (training) or the eval kind."""
    kind = spec.kind if phase == TRAIN else spec.eval_kind
    ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
    if kind == AQ:
        assert aq is not None
        acts = on_codec_device(acts_BTD)  # kept on a CUDA device until committed: no copy to the host
        enc = _local(aq.encode, ids, acts, aq.busy(step, micro))
        return Outgoing(kind, enc.frames, enc.headers, ids, enc, acts)
    header, frame = encode_tensor_frame(kind, acts_BTD)
    return Outgoing(kind, [frame], [header], ids)


def resend_encoding(aq: AQSender, pending_ids: list[int], pending_acts: torch.Tensor, busy: set[int],
                    rows: Sequence[int]) -> Encoding:
    """A NACKed micro-batch again (`pending_*`: as it was first sent), its NACKed rows as first visits."""
    return _local(aq.encode, pending_ids, pending_acts, busy, set(rows))


def encode_grads(spec: LaneSpec, grad_BTD: torch.Tensor) -> Outgoing:
    """The gradient of one micro-batch's activations: Q_b at the backward bits with AQ-SGD, else the dense kind."""
    if spec.kind == AQ:
        assert spec.aq is not None
        header, frame, _ = _local(encode_group, grad_BTD, spec.aq.bwd_bits)
        return Outgoing(spec.kind, [frame], [header])
    header, frame = encode_tensor_frame(spec.kind, grad_BTD)
    return Outgoing(spec.kind, [frame], [header])


def decode_acts(spec: LaneSpec, aq: AQReceiver | None, rec: Act, frames: Sequence[bytes | None], step: int
                ) -> tuple[torch.Tensor, torch.Tensor] | list[int]:
    """(sample ids, float32 activations (B, T, H)) of a received micro-batch, or the rows to NACK (AQ-SGD deltas
    against versions this end does not hold). A dense frame is checked and decoded; AQ-SGD rows are checked against
    this end's store and committed to it. Raises ProtocolError (a Violation among them) for what no honest sender
    sends."""
    ids = torch.tensor(rec.ids, dtype=torch.long)
    if rec.kind != AQ:
        return ids, decode_tensor_frame(frames[0], rec.kind, spec.shape)  # type: ignore[arg-type]  # always sent
    assert aq is not None and spec.aq is not None
    nack = aq.check(rec, step)
    if nack:
        return nack
    seq, hidden = spec.seq_len, spec.d_model
    sizes = ((rec.n_first, spec.aq.first_bits), (rec.n_delta, spec.aq.fwd_bits))
    first, deltas = (None if f is None else decode_group(f, n, seq, hidden, bits)
                     for f, (n, bits) in zip(frames, sizes))
    return ids, aq.apply(rec, (first, deltas))


def decode_grads(spec: LaneSpec, frame: bytes) -> torch.Tensor:
    """A received gradient frame: checked and decoded to float32 (B, T, H). Raises ProtocolError."""
    if spec.kind == AQ:
        assert spec.aq is not None
        return decode_group(frame, spec.micro_batch, spec.seq_len, spec.d_model, spec.aq.bwd_bits)
    return decode_tensor_frame(frame, spec.kind, spec.shape)
