"""What a stage signs of the training tensors it sends to its lane neighbours, in a verified run: the digest of the
tensor as the receiver decodes it, with where and when it went (protocol/lane.py `tensor_signing_payload`). So the
neighbours hold evidence of what it sent that it cannot deny, and evidence of what they sent it that they cannot
change afterwards (docs/verified-stages.md). `SignatureRing` keeps the last steps' signatures of one link end."""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from shoal.protocol.errors import SignatureError
from shoal.protocol.lane import tensor_signing_payload
from shoal.protocol.signing import sign, verify_peer
from shoal.swarm.lane.spec import Link

SIG_STEPS_KEPT = 4


def tensor_digest(x: torch.Tensor) -> bytes:
    """32 bytes over a tensor's shape and float32 values (what both ends of a dense wire hold, bit for bit): sha256,
    the fastest of the standard hashes on CPUs with SHA instructions (0.7 ms for 512 KB here, blake2b 2.1 ms)."""
    x = x.detach().to("cpu", torch.float32).contiguous()
    h = hashlib.sha256()
    h.update(repr(tuple(x.shape)).encode())
    h.update(memoryview(x.reshape(-1).view(torch.uint8).numpy()))
    return h.digest()


def sign_tensor(key: Ed25519PrivateKey, x: torch.Tensor, **where) -> bytes:
    """The sender's signature of `x` (as the receiver decodes it) sent `where` (run, lane, boundary, direction,
    step, micro, ids)."""
    return sign(key, tensor_signing_payload(digest=tensor_digest(x), **where))


def tensor_signed_by(peer: str, sig: bytes, x: torch.Tensor, **where) -> bool:
    """Whether `sig` is `peer`'s signature of `x` sent `where`."""
    try:
        verify_peer(peer, tensor_signing_payload(digest=tensor_digest(x), **where), sig)
        return True
    except (SignatureError, ValueError):
        return False


class SignatureRing:
    """(what, step, micro) -> signature for the last SIG_STEPS_KEPT steps (`what`: act_in, act_out, grad_in,
    grad_out, as node/train/transcript.py names them). The trainer's thread puts (where tensors are coded), the
    event loop reads (evidence asked for): a lock keeps the two apart."""

    def __init__(self, keep_steps: int = SIG_STEPS_KEPT):
        self.keep_steps = keep_steps
        self._sigs: OrderedDict[tuple[str, int, int], bytes] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, what: str, step: int, micro: int, sig: bytes) -> None:
        with self._lock:
            self._sigs[what, step, micro] = sig
            while self._sigs and next(iter(self._sigs))[1] <= step - self.keep_steps:
                self._sigs.popitem(last=False)

    def of(self, step: int, micro: int) -> dict[str, bytes]:
        with self._lock:
            return {w: s for (w, st, mi), s in self._sigs.items() if (st, mi) == (step, micro)}


class LinkSeals:
    """One link end's part in a verified run: it signs the training tensors it sends and checks its neighbours'
    signatures of those it receives, keeping both in its ring as evidence. Called in the caller's thread, as the
    coding is; it reads only the links' fixed ends, and the ring takes its own lock."""

    def __init__(self, key: Ed25519PrivateKey, run_id: str, lane: int):
        self.key, self.run_id, self.lane = key, run_id, lane
        self.ring = SignatureRing()

    def _where(self, link: Link, step: int, micro: int, ids) -> dict:
        return dict(run=self.run_id, lane=self.lane, boundary=link.boundary, direction=link.direction, step=step,
                    micro=micro, ids=tuple(ids))

    def sign(self, what: str, link: Link, step: int, micro: int, ids, decoded: torch.Tensor) -> bytes:
        """This end's signature of `decoded` (what the receiver will decode) sent on `link`, kept as `what`."""
        sig = sign_tensor(self.key, decoded, **self._where(link, step, micro, ids))
        self.ring.put(what, step, micro, sig)
        return sig

    def check(self, what: str, link: Link, step: int, micro: int, ids, sig: bytes | None, x: torch.Tensor) -> bool:
        """Whether `sig` is `link`'s neighbour's signature of `x` as received here (kept as `what` when it is)."""
        if not sig or not tensor_signed_by(link.peer, sig, x, **self._where(link, step, micro, ids)):
            return False
        self.ring.put(what, step, micro, sig)
        return True
