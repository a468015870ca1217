"""What crossed a pipeline stage's lane boundaries in its last steps, kept as evidence for stage verification.

A stage records, per training micro-batch, the sample ids, the activations it received and the gradient it received
(as decoded), and what its neighbours decoded of the activations and the gradient it sent. The replica of a stage in
another lane re-executes a sampled micro-batch from the inputs its neighbours recorded and compares the outputs
with what they received (docs/verified-stages.md): the honest neighbours' records are the evidence against a stage
that tampers with what it sends. Only wires whose decoding the sender can reproduce exactly are recorded (fp32,
fp16); an AQ-SGD link's activations are not (its deltas decode against the link's store).

`RecordingBoundary` wraps the lane `Boundary` the trainer talks through; `Transcript` is read by the node's evidence
server on the event loop while the trainer thread writes it, under its lock.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field, replace

import torch

from shoal.kernels.codec import wire_roundtrip
from shoal.node.train.lane import Boundary
from shoal.protocol.lane import TRAIN

FIELDS = ("ids", "act_in", "act_out", "grad_in", "grad_out")


def as_received(x: torch.Tensor, kind: str) -> torch.Tensor | None:
    """What the other end of a `kind` wire decodes of `x` (float32 on the CPU), or None when only the link can say
    (AQ-SGD)."""
    return wire_roundtrip(kind, x)


@dataclass(frozen=True, slots=True)
class MicroRecord:
    """One training micro-batch at one stage (None: not at this stage's position, or not recorded)."""

    ids: torch.Tensor | None = None  # int64 sample ids
    act_in: torch.Tensor | None = None  # activations received from the previous stage
    act_out: torch.Tensor | None = None  # what the next stage decoded of our activations
    grad_in: torch.Tensor | None = None  # the gradient received from the next stage
    grad_out: torch.Tensor | None = None  # what the previous stage decoded of our gradient

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f: getattr(self, f) for f in FIELDS if getattr(self, f) is not None}


@dataclass
class Transcript:
    """The last `keep_steps` steps' micro-batch records of one stage (thread-safe)."""

    keep_steps: int = 3
    _records: OrderedDict[tuple[int, int], MicroRecord] = field(default_factory=OrderedDict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def put(self, step: int, micro: int, **values: torch.Tensor | None) -> None:
        with self._lock:
            rec = self._records.get((step, micro), MicroRecord())
            self._records[step, micro] = replace(rec, **{k: v for k, v in values.items() if v is not None})
            while self._records and next(iter(self._records))[0] <= step - self.keep_steps:
                self._records.popitem(last=False)

    def get(self, step: int, micro: int) -> MicroRecord | None:
        with self._lock:
            return self._records.get((step, micro))

    def steps(self) -> list[int]:
        with self._lock:
            return sorted({s for s, _ in self._records})


class RecordingBoundary(Boundary):
    """A lane Boundary that records what crosses it in training steps into a Transcript (`kind`: the wire's)."""

    def __init__(self, inner: Boundary, transcript: Transcript, kind: str):
        self.inner, self.transcript, self.kind = inner, transcript, kind

    def send_act(self, step, micro, ids, acts_BTD, *, phase=TRAIN):
        self.inner.send_act(step, micro, ids, acts_BTD, phase=phase)
        if phase == TRAIN:
            self.transcript.put(step, micro, ids=torch.as_tensor(ids).clone(), act_out=as_received(acts_BTD, self.kind))

    def recv_act(self, step, micro, *, phase=TRAIN):
        ids, acts = self.inner.recv_act(step, micro, phase=phase)
        if phase == TRAIN:
            self.transcript.put(step, micro, ids=ids.clone(), act_in=acts.detach().float().cpu().clone())
        return ids, acts

    def send_grad(self, step, micro, grad_BTD):
        self.inner.send_grad(step, micro, grad_BTD)
        self.transcript.put(step, micro, grad_out=as_received(grad_BTD, self.kind))

    def recv_grad(self, step, micro):
        g = self.inner.recv_grad(step, micro)
        self.transcript.put(step, micro, grad_in=g.detach().float().cpu().clone())
        return g

    def exchange_norms(self, step, norms, finite):
        return self.inner.exchange_norms(step, norms, finite)

    def abort(self, step, reason, *, phase=TRAIN):
        self.inner.abort(step, reason, phase=phase)
