"""What the group synchronizers share: the round's group, tensor frames on the collective, validation, chunked all-reduce."""

from __future__ import annotations

import hashlib
import logging
import math
import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING
from dataclasses import dataclass

import torch
import trio

from shoal.kernels.codec import Codec, Encoded, tensor_from_buffer
from shoal.kernels.topk import decode_topk
from shoal.node.train.model import even_split
from shoal.node.train.trainer import Synchronizer
from shoal.protocol.errors import ProtocolError
from shoal.protocol.frames import decode_frame, encode_frame, make_header
from shoal.swarm.run.group import Group
from shoal.swarm.net.penalty import Penalties

if TYPE_CHECKING:  # the synchronizers need no libp2p at import: only a collective's exchange
    from shoal.swarm.run.collective import Collective

log = logging.getLogger(__name__)

#: a hook for fault-injection tests: (phase, recipient peer id, outgoing Encoded) -> what is really sent to that
#: member, or None to send it nothing
Fault = Callable[[str, str, Encoded], Encoded | None]


@dataclass(frozen=True, kw_only=True, slots=True)
class SyncConfig:
    round_timeout_s: float = 30.0  # one exchange phase; a member not heard by then is skipped for the rest of the epoch
    # A contribution is compared, by RMS, with the larger of the group's (low) median and this replica's own:
    clip_factor: float = 4.0  # above this multiple it is scaled down to it (an honest spike; no penalty)
    reject_factor: float = 1000.0  # above this multiple it is rejected and its sender penalized
    broadcast_norm_factor: float = 1000.0  # owners' broadcasts: RMS against the median over chunks, reject above

    def __post_init__(self) -> None:
        if (self.round_timeout_s <= 0 or not 1 < self.clip_factor <= self.reject_factor
                or self.broadcast_norm_factor <= 1):
            raise ValueError("round_timeout_s must be positive, 1 < clip_factor <= reject_factor, "
                             "broadcast_norm_factor > 1")


class Rejected(ProtocolError):
    """A member's update failed validation: it is excluded from the aggregation and penalized."""


def chunk_bounds(n: int, parts: int) -> list[tuple[int, int]]:
    """Cut [0, n) into `parts` near-equal contiguous chunks; member i of the group owns chunk i."""
    return even_split(n, parts)


def encode_tensor(e: Encoded) -> bytes:
    """An Encoded as one tensor frame (header + payload) ready for the collective."""
    mv = e.payload_bytes()
    h = make_header(e.codec, e.dtype, e.shape, e.bits, e.bucket, e.count, mv)
    head, body = encode_frame(h, mv)
    return bytes(head) + bytes(body)


def decode_tensor(buf: bytes, *, codec: str, dtype: str, numel: int, bits: int | None = None,
                  bucket: int | None = None, count: int | None = None) -> Encoded:
    """Parse a tensor frame and check it is exactly the kind expected; raises ProtocolError."""
    h, payload = decode_frame(buf, max_numel=numel, max_payload=len(buf))
    want = {"codec": codec, "dtype": dtype, "shape": (numel,), "bits": bits, "bucket": bucket, "count": count}
    for k, v in want.items():
        if v is not None and getattr(h, k) != v:
            raise Rejected(f"frame field {k}={getattr(h, k)!r}, expected {v!r}")
    return Encoded(h.codec, h.dtype, h.shape, h.bits, h.bucket, h.count, tensor_from_buffer(payload))


def decode_values(e: Encoded, codec: Codec | None) -> torch.Tensor:
    """Dense float32 values of a received Encoded, checked finite."""
    try:
        x = decode_topk(e) if e.codec == "topk" else codec.decode(e).float()
    except ValueError as err:
        raise Rejected(f"undecodable {e.codec} payload: {err}") from err
    if not bool(torch.isfinite(x).all()):
        raise Rejected("non-finite values")
    return x


def hash_tensor(x: torch.Tensor) -> str:
    return hashlib.sha256(x.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:32]


def flat_params(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])


@torch.no_grad()
def write_flat_params(model: torch.nn.Module, flat: torch.Tensor) -> None:
    o = 0
    for p in model.parameters():
        n = p.numel()
        p.copy_(flat[o : o + n].view_as(p))
        o += n


def flat_grads(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float()
                      for p in model.parameters()])


@torch.no_grad()
def write_flat_grads(model: torch.nn.Module, flat: torch.Tensor) -> None:
    o = 0
    for p in model.parameters():
        n = p.numel()
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        p.grad.copy_(flat[o : o + n].view_as(p))
        o += n


class GroupSync(Synchronizer):
    """Base of the network synchronizers; the trainer thread reaches the trio loop through `trio_token`.

    Chunk ownership comes from the broker's group and never changes within a group epoch, so every member derives
    the same owners without talking. What a replica decides alone only narrows whom it exchanges with: a member
    that missed a deadline or whose update was rejected is skipped (not waited for, not sent to, not used) for the
    rest of the epoch, and a chunk whose owner is skipped stays as it is on this replica. The broker hears of it
    (`on_missing(peer_ids)`, `on_offender(peer_id, reason)`) and re-forms the group at an agreed step, which is
    where chunks change owners; replicas that saw a round differently meet again through the state-hash vote.
    """

    def __init__(self, *, collective: Collective, group_fn: Callable[[], Group], trio_token: trio.lowlevel.TrioToken,
                 penalties: Penalties, config: SyncConfig = SyncConfig(),
                 on_missing: Callable[[list[str]], None] | None = None,
                 on_offender: Callable[[str, str], None] | None = None):
        self.collective = collective
        self.group_fn = group_fn
        self.trio_token = trio_token
        self.penalties = penalties
        self.config = config
        self.on_missing = on_missing
        self.on_offender = on_offender
        self.bytes_sent = 0  # tensor-frame bytes this replica sent to other members
        self.bytes_recv = 0  # tensor-frame bytes accepted from other members
        self.fp32_bytes = 0  # what fp32 all-reduce messages for the same coordinates would have carried
        self.rounds = 0
        self.last_hash = ""
        self.device = torch.device("cpu")  # the model's: state lives there, what arrives is moved there
        self.fault: Fault | None = None
        self._epoch: tuple[str, int] | None = None
        self._skipped: set[str] = set()

    # -- what the daemon reads
    def state_hash(self) -> str:
        """Hash of the synchronized state after the last round: equal on every replica of the group."""
        return self.last_hash

    @property
    def compression_ratio(self) -> float:
        return self.fp32_bytes / self.bytes_sent if self.bytes_sent else 1.0

    # -- group and faults
    def group(self) -> Group:
        """This round's group: the broker's, unchanged within its epoch (skips reset when the epoch changes)."""
        g = self.group_fn()
        if self._epoch != (g.run_id, g.epoch):
            self._epoch, self._skipped = (g.run_id, g.epoch), set()
        return g

    def live(self, g: Group) -> set[str]:
        """The members this replica exchanges with this round: itself and those neither skipped nor banned."""
        return {m for m in g.members
                if m == g.me or (m not in self._skipped and not self.penalties.is_banned(m))}

    def _missing(self, peers: set[str]) -> None:
        if peers:
            self._skipped |= peers
            log.warning("members missed the round deadline, skipped for this epoch: %s", sorted(peers))
            if self.on_missing:
                self.on_missing(sorted(peers))

    def _offend(self, peer: str, reason: str) -> None:
        self._skipped.add(peer)
        self.penalties.penalize(peer, f"sync: {reason}")
        log.warning("update from %s rejected: %s", peer, reason)
        if self.on_offender:
            self.on_offender(peer, reason)

    # -- network
    def close(self, model: torch.nn.Module) -> None:
        """Finish whatever round is still in flight and apply it (call before a checkpoint or at the end)."""

    def exchange(self, tag: str, sends: dict[str, Encoded], expect: set[str], phase: str, *, round_start: float,
                 phase_no: int, dense_numel: int | None = None) -> dict[str, bytes]:
        """Frame and send `sends`, wait for `expect` (from the trainer's worker thread); counts bytes.

        Phase `phase_no` (1, 2) of a round that began at `round_start` (time.monotonic) waits until round_start +
        phase_no x round_timeout_s: a member held up by a full deadline in an earlier phase (someone else's lost
        message) still arrives in time, so one failure costs every member one deadline and is seen by one member.
        `dense_numel`: the coordinates one message stands for, if not its own size (fp32-equivalent accounting)."""
        timeout = self.config.round_timeout_s
        timeout_s = max(round_start + phase_no * timeout - time.monotonic(), 0.1 * timeout)
        wire: dict[str, bytes] = {}
        for p, e in sends.items():
            if p != self.collective.me and self.fault is not None:
                e = self.fault(phase, p, e)
                if e is None:
                    continue
            wire[p] = encode_tensor(e)
            if p != self.collective.me:
                self.bytes_sent += len(wire[p])
                self.fp32_bytes += 4 * (dense_numel if dense_numel is not None else e.numel)
        got = trio.from_thread.run(self.collective.exchange, tag, wire, expect, timeout_s, trio_token=self.trio_token)
        self.bytes_recv += sum(len(b) for p, b in got.items() if p != self.collective.me)
        return got

    def accept(self, got: dict[str, bytes], decode: Callable[[bytes], torch.Tensor]) -> dict[str, torch.Tensor]:
        """Decode and validate contributions: bad frames and non-finite values are rejected; by RMS against the
        larger of the (low) median and this replica's own, a spike is scaled down to `clip_factor` times it and
        anything past `reject_factor` times it is rejected. Rejections penalize the sender."""
        out: dict[str, torch.Tensor] = {}
        for p, b in got.items():
            try:
                out[p] = decode(b).to(self.device)
            except ProtocolError as e:
                if p == self.collective.me:
                    raise
                self._offend(p, str(e))
        me = self.collective.me
        if len(out) < 2:
            return out
        rms = {p: float(x.norm()) / math.sqrt(max(x.numel(), 1)) for p, x in out.items()}
        ref = max(statistics.median_low(sorted(rms.values())), rms.get(me, 0.0))
        if ref <= 0.0:
            return out  # nothing to measure against (an all-zero majority): only the frame and finiteness checks
        for p, v in rms.items():
            if p == me:
                continue
            if v > self.config.reject_factor * ref:
                self._offend(p, f"update RMS {v:.3g} > {self.config.reject_factor:g} x reference {ref:.3g}")
                del out[p]
            elif v > self.config.clip_factor * ref:
                log.info("update from %s clipped: RMS %.3g > %g x reference %.3g", p, v, self.config.clip_factor, ref)
                out[p] = out[p] * (self.config.clip_factor * ref / v)
        return out

    def allreduce_mean(self, flat: torch.Tensor, codec: Codec, group: Group, round_: int,
                       phase: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean of `flat` over the group: reduce-scatter to chunk owners, the owner encodes once (and keeps the
        decoded value itself, so all replicas hold identical bits), all-gather. Returns (mean, covered): a chunk
        whose owner is skipped or not heard from is zero in the mean and False in `covered`."""
        if group.size == 1:
            return codec.decode(codec.encode(flat)).float().to(flat.device), \
                torch.ones(flat.numel(), dtype=torch.bool, device=flat.device)
        bounds = chunk_bounds(flat.numel(), group.size)
        a, b = bounds[group.rank]
        live = self.live(group)
        sends = {m: codec.encode(flat[lo:hi].contiguous()) for m, (lo, hi) in zip(group.members, bounds) if m in live}
        t0 = time.monotonic()
        got = self.exchange(group.tag(round_, f"{phase}/rs"), sends, live, f"{phase}/rs", round_start=t0, phase_no=1)

        def dec(n):
            return lambda buf: decode_values(decode_tensor(buf, codec=codec.name, dtype="float32", numel=n), codec)

        parts = self.accept(got, dec(b - a))
        total = torch.zeros(b - a, device=flat.device)
        for m in group.members:  # a fixed order: the owner's sum is deterministic
            if m in parts:
                total += parts[m]
        mean = codec.encode(total / len(parts))
        # a member not heard (or rejected) in the first phase is not waited for again: a dead member costs one
        # deadline, not two
        heard = set(got) & self.live(group)
        got = self.exchange(group.tag(round_, f"{phase}/ag"), {m: mean for m in heard}, heard, f"{phase}/ag",
                            round_start=t0, phase_no=2)
        out = torch.zeros_like(flat, dtype=torch.float32)
        chunks = {}
        for m, (lo, hi) in zip(group.members, bounds):
            if m in got:
                try:
                    chunks[m] = dec(hi - lo)(got[m])
                except ProtocolError as e:
                    self._offend(m, str(e))
        chunks = self.accept_broadcasts(chunks)
        covered = torch.zeros(flat.numel(), dtype=torch.bool, device=flat.device)
        for m, (lo, hi) in zip(group.members, bounds):
            if m in chunks:
                out[lo:hi] = chunks[m]
                covered[lo:hi] = True
        self._missing(live - got.keys())
        return out, covered

    def accept_broadcasts(self, chunks: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Owners' broadcasts are compared by RMS with the median over chunks (a loose bound: chunks differ)."""
        if len(chunks) < 2:
            return chunks
        rms = {p: float(x.norm()) / math.sqrt(max(x.numel(), 1)) for p, x in chunks.items()}
        ref = statistics.median_low(sorted(rms.values()))
        for p, v in rms.items():
            if p != self.collective.me and v > self.config.broadcast_norm_factor * ref + 1e-12:
                self._offend(p, f"broadcast RMS {v:.3g} > {self.config.broadcast_norm_factor:g} x median {ref:.3g}")
                del chunks[p]
        return chunks

