"""What the group synchronizers share: the round's group, tensor frames on the collective, validation, chunked all-reduce."""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from shoal.kernels.codec import Codec, Encoded, tensor_from_buffer
from shoal.kernels.topk import decode_topk
from shoal.node.defaults import ROUND_TIMEOUT_S
from shoal.node.sync.interface import Synchronizer
from shoal.node.sync.robust import Disagreements, RobustConfig, robust_filter
from shoal.node.train.control import StepControl
from shoal.protocol.manifest import even_split
from shoal.protocol.errors import ProtocolError
from shoal.protocol.frames import decode_frame, encode_frame, make_header
from shoal.swarm.net.penalty import Penalties
from shoal.swarm.run.group import Group

log = logging.getLogger(__name__)

#: a blocking exchange from the trainer's worker thread: (tag, {peer: bytes to send}, peers to wait for, timeout_s)
#: -> {peer: bytes received} (`Collective.blocking`); the synchronizers need no event loop and no libp2p themselves
Exchange = Callable[[str, dict[str, bytes], set[str], float], dict[str, bytes]]

#: a hook for fault-injection tests: (phase, recipient peer id, outgoing Encoded) -> what is really sent to that
#: member, or None to send it nothing
Fault = Callable[[str, str, Encoded], Encoded | None]
MIN_PHASE_SHARE = 0.1  # a phase that starts late still waits at least this share of the round timeout
BROADCAST_RMS_FLOOR = 1e-12  # an all-zero median admits broadcasts up to this RMS


@dataclass(frozen=True, kw_only=True, slots=True)
class SyncConfig:
    round_timeout_s: float = ROUND_TIMEOUT_S  # one exchange phase; a member not heard by the round's second
    # phase is skipped for the rest of the epoch
    # the first round of an epoch waits this many round timeouts more for members entering the group: they pull
    # the group's state before they can take part (docs/architecture.md, "Entering a group")
    entry_grace_rounds: float = 2.0
    # A contribution is compared, by RMS, with the larger of the group's (low) median and this replica's own:
    clip_factor: float = 4.0  # above this multiple it is scaled down to it (an honest spike; no penalty)
    reject_factor: float = 1000.0  # above this multiple it is rejected and its sender penalized
    broadcast_norm_factor: float = 1000.0  # owners' broadcasts: RMS against the median over chunks, reject above
    robust: RobustConfig = RobustConfig()  # the owner's aggregation: norm equalisation and a direction check

    def __post_init__(self) -> None:
        if (self.round_timeout_s <= 0 or not 1 < self.clip_factor <= self.reject_factor
                or self.broadcast_norm_factor <= 1 or self.entry_grace_rounds < 0):
            raise ValueError("round_timeout_s must be positive, 1 < clip_factor <= reject_factor, "
                             "broadcast_norm_factor > 1, entry_grace_rounds >= 0")


class Rejected(ProtocolError):
    """A member's update failed validation: it is excluded from the aggregation and penalized."""


def chunk_bounds(n: int, parts: int) -> list[tuple[int, int]]:
    """Cut [0, n) into `parts` near-equal contiguous chunks; member i of the group owns chunk i."""
    return even_split(n, parts)


def allreduce_sent(v: torch.Tensor, codec: Codec, members: int) -> torch.Tensor:
    """What the chunk owners receive of `v` from this replica in `GroupSync.allreduce_mean` over a group of
    `members`: each owner's chunk encoded on its own, decoded (for error feedback on a lossy codec)."""
    return torch.cat([codec.decode(codec.encode(v[lo:hi].contiguous())).float().reshape(-1)
                      for lo, hi in chunk_bounds(v.numel(), members)])


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


def fresh_locals(state: dict[str, Any], sync: dict[str, Any]) -> dict[str, Any]:
    """An entry state (Synchronizer.entry_state) for a synchronizer whose replicas keep local parameters: no model
    (entering writes it from the synchronized state), an optimizer with no moments (its hyperparameters are the
    run's), and `sync`, the synchronized part alone."""
    groups = state["optimizer"]["param_groups"]
    return {**state, "model": None, "optimizer": {"state": {}, "param_groups": groups}, "sync": sync}


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


@dataclass(slots=True)
class RoundReport:
    """What one round learned about other members; written only by the thread running the round, then absorbed
    into the StepControl of the step that applies the round."""

    missing: set[str] = field(default_factory=set)
    offenders: dict[str, str] = field(default_factory=dict)

    def into(self, control: StepControl | None) -> None:
        if control is not None:
            control.absorb(self.missing, self.offenders)


class GroupSync(Synchronizer):
    """Base of the network synchronizers; rounds reach the network through a blocking `exchange`.

    Chunk ownership comes from the broker's group (the StepControl's) and never changes within a group epoch, so
    every member derives the same owners without talking, and every member applies an owner's one broadcast of
    its chunk. A member late for the first phase only loses its contribution to the owners that did not wait for
    it; it still gets every broadcast and is waited for in the second, so a late member (a loaded machine, a slow
    link) ends the round with the same state as everyone else. What a replica decides alone only narrows whom it
    exchanges with: a member not heard by the second phase's deadline, or whose update was rejected, is skipped
    (not waited for, not sent to, not used) for the rest of the epoch, and a chunk whose owner is skipped stays as
    it is on this replica. A member gone without a trace so costs its first round two deadlines; a killed process
    none (its connections close: the collective stops waiting for it, swarm/run/collective.py). The round records
    it in its `RoundReport`, the step's StepControl carries it to the runtime, and the runtime tells the broker,
    which re-forms the group at an agreed step (where chunks change owners); replicas that saw a round differently
    meet again through the state-hash vote.

    Threads: at most one round is in flight, and the state it uses (`_skipped`, the synchronized tensors) belongs
    to it; the trainer thread touches that state only after joining the round.
    """

    def __init__(self, *, exchange: Exchange, penalties: Penalties, config: SyncConfig = SyncConfig(),
                 clock: Callable[[], float] = time.monotonic):
        super().__init__()
        self._exchange = exchange
        self.penalties = penalties
        self.config = config
        self.clock = clock
        self.last_hash = ""
        self.device = torch.device("cpu")  # the model's: state lives there, what arrives is moved there
        self.fault: Fault | None = None
        self._epoch: tuple[str, int] | None = None
        self._skipped: set[str] = set()
        self._entering: set[str] = set()  # members entering the group, waited for longer in this (first) round
        self._disagreements = Disagreements(config.robust)  # members' contributions, as this owner saw them
        self._owner_checks = Disagreements(config.robust)  # owners' broadcasts against this member's contributions
        self._distrusted: set[str] = set()  # reported by this owner's direction check: left out until the epoch ends
        self.robust_checked = 0  # other members' contributions put to the direction check (as an owner)
        self.robust_left_out = 0  # of those, left out of a round's mean
        # members whose contributions this owner left out or clipped since the runtime last took them (per-lane
        # statistics: a member opposed to the others' median is evidence against its lane, docs/verified-stages.md)
        self.outliers: set[str] = set()

    def state_hash(self) -> str:
        return self.last_hash

    # -- group and faults
    def group(self, control: StepControl) -> Group:
        """This round's group: the broker's (carried by the StepControl), unchanged within its epoch; skips reset
        when the epoch changes, and the epoch's first round waits longer for the members entering it."""
        g = control.group
        if not isinstance(g, Group):
            raise RuntimeError(f"step {control.step} has no group to synchronize with")
        self._entering = set()
        if self._epoch != (g.run_id, g.epoch):
            self._epoch, self._skipped, self._distrusted = (g.run_id, g.epoch), set(), set()
            self._entering = set(g.entering) - {g.me}
        return g

    def live(self, g: Group) -> set[str]:
        """The members this replica exchanges with this round: itself and those neither skipped nor banned."""
        return {m for m in g.members
                if m == g.me or (m not in self._skipped and not self.penalties.is_banned(m))}

    def _late(self, live: set[str], got: dict[str, bytes], report: RoundReport) -> set[str]:
        """After a round's first phase: the live members not heard in it. Their contributions are left out of
        this owner's chunk, which keeps replicas identical (every member applies the owner's one broadcast), and
        each still gets this owner's broadcast and is waited for in the second phase: a member that was late, not
        gone, applies the same chunks as everyone else. Reported to the broker (it judges lag) with those missing at
        the end (`_missing`)."""
        late = live - got.keys() - report.offenders.keys()
        report.missing |= late
        return late

    def _missing(self, peers: set[str], report: RoundReport, late: set[str] = frozenset()) -> None:
        """Members not heard in a round's second phase (its last) are skipped for the rest of the epoch; those only
        `late` in the first are reported, not skipped."""
        peers = peers - report.offenders.keys()  # skipped because we rejected their update: offenders, not silent
        if peers:
            self._skipped |= peers
            report.missing |= peers
            log.warning("members missed the round deadline, skipped for this epoch: %s", sorted(peers))
        if late - peers:
            log.info("members late for a round's first phase (their contributions to this owner's chunk left out, "
                     "the round's result the same as everyone's): %s", sorted(late - peers))

    def _offend(self, peer: str, reason: str, report: RoundReport) -> None:
        self._skipped.add(peer)
        self.penalties.penalize(peer, f"sync: {reason}")
        report.offenders.setdefault(peer, reason)
        log.warning("update from %s rejected: %s", peer, reason)

    # -- network
    def exchange(self, group: Group, tag: str, sends: dict[str, Encoded], expect: set[str], phase: str, *,
                 round_start: float, phase_no: int, dense_numel: int | None = None) -> dict[str, bytes]:
        """Frame and send `sends`, wait for `expect` (from the trainer's worker thread); counts bytes.

        Phase `phase_no` (1, 2) of a round that began at `round_start` (on `clock`) waits until round_start +
        phase_no x round_timeout_s: a member held up by a full deadline in an earlier phase (someone else's lost
        message) still arrives in time, so one failure costs every member one deadline and is seen by one member.
        `dense_numel`: the coordinates one message stands for, if not its own size (fp32-equivalent accounting)."""
        timeout = self.config.round_timeout_s
        grace = self.config.entry_grace_rounds * timeout if expect & self._entering else 0.0
        timeout_s = max(round_start + phase_no * timeout + grace - self.clock(), MIN_PHASE_SHARE * timeout)
        me = group.me
        wire: dict[str, bytes] = {}
        for p, e in sends.items():
            if p != me and self.fault is not None:
                e = self.fault(phase, p, e)
                if e is None:
                    continue
            wire[p] = encode_tensor(e)
            if p != me:
                self.bytes_sent += len(wire[p])
                self.fp32_bytes += 4 * (dense_numel if dense_numel is not None else e.numel)
        got = self._exchange(tag, wire, expect, timeout_s)
        self.bytes_recv += sum(len(b) for p, b in got.items() if p != me)
        return got

    def accept(self, me: str, got: dict[str, bytes], decode: Callable[[bytes], torch.Tensor],
               report: RoundReport) -> dict[str, torch.Tensor]:
        """Decode and validate contributions: bad frames and non-finite values are rejected; by RMS against the
        larger of the (low) median and this replica's own, a spike is scaled down to `clip_factor` times it and
        anything past `reject_factor` times it is rejected. Rejections penalize the sender."""
        out: dict[str, torch.Tensor] = {}
        for p, b in got.items():
            try:
                out[p] = decode(b).to(self.device)
            except ProtocolError as e:
                if p == me:
                    raise
                self._offend(p, str(e), report)
        if len(out) < 2:
            return out
        rms = {p: _rms(x) for p, x in out.items()}
        ref = max(statistics.median_low(sorted(rms.values())), rms.get(me, 0.0))
        if ref <= 0.0:
            return out  # nothing to measure against (an all-zero majority): only the frame and finiteness checks
        for p, v in rms.items():
            if p == me:
                continue
            if v > self.config.reject_factor * ref:
                self._offend(p, f"update RMS {v:.3g} > {self.config.reject_factor:g} x reference {ref:.3g}", report)
                del out[p]
            elif v > self.config.clip_factor * ref:
                log.info("update from %s clipped: RMS %.3g > %g x reference %.3g", p, v, self.config.clip_factor, ref)
                self.outliers.add(p)
                out[p] = out[p] * (self.config.clip_factor * ref / v)
        return out

    def distrust(self, peer: str) -> None:
        self._distrusted.add(peer)  # read by this replica's rounds (a set's add is atomic in the worker thread)

    def take_outliers(self) -> set[str]:
        taken, self.outliers = self.outliers, set()
        return taken

    def robust_parts(self, group: Group, parts: dict[str, torch.Tensor],
                     report: RoundReport) -> dict[str, torch.Tensor]:
        """What goes into the owner's mean of one chunk, by member in member order: `robust_filter` (norm
        equalisation, a minority opposed to the coordinate-wise median left out); a member left out too often is an
        offender."""
        parts = {m: x for m, x in parts.items() if m not in self._distrusted}
        v = robust_filter(parts, group.members, self.config.robust)
        others = [m for m in v.cosines if m != group.me]
        self.robust_checked += len(others)
        self.robust_left_out += sum(m in v.left_out for m in others)
        self.outliers.update(m for m in v.left_out if m != group.me)
        for m, c in v.left_out.items():
            log.info("update from %s left out of the mean: cosine %.3f with the members' median", m[-8:], c)
        r = self.config.robust
        for m in self._disagreements.record(v, group.me):
            # reported (the broker evicts it at an agreed step once most members have), not skipped: every member
            # keeps applying the same chunks, so replicas stay identical; this owner alone stops using its updates
            self._distrusted.add(m)
            why = f"update opposed the members' median in {r.offend_after} of its last {r.window_rounds} rounds"
            report.offenders.setdefault(m, why)
            log.warning("member %s reported: %s", m, why)
        return {m: v.kept[m] for m in group.members if m in v.kept}

    def allreduce_mean(self, flat: torch.Tensor, codec: Codec, group: Group, round_: int, phase: str,
                       report: RoundReport) -> tuple[torch.Tensor, torch.Tensor]:
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
        t0 = self.clock()
        got = self.exchange(group, group.tag(round_, f"{phase}/rs"), sends, live, f"{phase}/rs", round_start=t0,
                            phase_no=1)

        def dec(n):
            return lambda buf: decode_values(decode_tensor(buf, codec=codec.name, dtype="float32", numel=n), codec)

        parts = self.robust_parts(group, self.accept(group.me, got, dec(b - a), report), report)
        mean = codec.encode(weighted_mean(group, parts))
        late = self._late(live, got, report)
        targets = self.live(group)  # all but the members rejected in the first phase (`_late`)
        got = self.exchange(group, group.tag(round_, f"{phase}/ag"), {m: mean for m in targets}, targets,
                            f"{phase}/ag", round_start=t0, phase_no=2)
        out = torch.zeros_like(flat, dtype=torch.float32)
        chunks = {}
        for m, (lo, hi) in zip(group.members, bounds):
            if m in got:
                try:
                    chunks[m] = dec(hi - lo)(got[m])
                except ProtocolError as e:
                    self._offend(m, str(e), report)
        chunks = self.accept_broadcasts(group.me, chunks, report)
        self.cross_check(group, {m: flat[lo:hi] for m, (lo, hi) in zip(group.members, bounds)}, chunks, report)
        covered = torch.zeros(flat.numel(), dtype=torch.bool, device=flat.device)
        for m, (lo, hi) in zip(group.members, bounds):
            if m in chunks:
                out[lo:hi] = chunks[m]
                covered[lo:hi] = True
        self._missing(live - got.keys(), report, late)
        return out, covered

    def cross_check(self, group: Group, own: dict[str, torch.Tensor], chunks: dict[str, torch.Tensor],
                    report: RoundReport) -> None:
        """Every owner's broadcast against this member's own contribution to that chunk: an honest owner's mean
        holds it, so the two point the same way. An owner whose broadcasts keep pointing against it (a sign-flipped
        or forged chunk) is reported (the broker evicts it once most members have). Nothing is dropped here: every
        member applies the same chunks until then, so replicas stay identical."""
        r = self.config.robust
        if not r.enabled or group.size < r.min_members:
            return
        for m, x in chunks.items():
            c = own.get(m)
            if m == group.me or c is None or m in self._distrusted:
                continue
            norms = float(c.norm()) * float(x.norm())
            if norms == 0.0:
                continue
            cos = float(torch.dot(c.to(x.device), x)) / norms
            if self._owner_checks.note(m, cos < r.min_cosine):
                self._distrusted.add(m)
                why = f"its broadcasts opposed our contribution in {r.offend_after} of its last {r.window_rounds} rounds"
                report.offenders.setdefault(m, why)
                log.warning("owner %s reported: %s", m, why)

    def accept_broadcasts(self, me: str, chunks: dict[str, torch.Tensor],
                          report: RoundReport) -> dict[str, torch.Tensor]:
        """Owners' broadcasts are compared by RMS with the median over chunks (a loose bound: chunks differ)."""
        if len(chunks) < 2:
            return chunks
        rms = {p: _rms(x) for p, x in chunks.items()}
        ref = statistics.median_low(sorted(rms.values()))
        for p, v in rms.items():
            if p != me and v > self.config.broadcast_norm_factor * ref + BROADCAST_RMS_FLOOR:
                self._offend(p, f"broadcast RMS {v:.3g} > {self.config.broadcast_norm_factor:g} x median {ref:.3g}",
                             report)
                del chunks[p]
        return chunks


def weights_of(group: Group, members) -> list[float] | None:
    """The aggregation weights of `members` (a group's, in its order): each one's share of the sequences they
    computed together this step; None when they weigh the same (the plain mean keeps today's bits)."""
    if group.even:
        return None
    w = [group.weight(m) for m in members]
    total = sum(w)
    return [x / total for x in w]


def weighted_mean(group: Group, parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """The owner's mean of one chunk: the members' contributions weighted by the sequences each one's lane computed
    (`Group.weights`: its share of the global batch), in member order so that the sum is deterministic; the plain
    mean when they weigh the same. The weights are the table's, never what a member says in its message."""
    w = weights_of(group, parts)
    total = torch.zeros_like(next(iter(parts.values())))
    if w is None:
        for v in parts.values():
            total += v
        return total / len(parts)
    for wi, v in zip(w, parts.values()):
        total.add_(v, alpha=wi)
    return total


def _rms(x: torch.Tensor) -> float:
    return float(x.norm()) / math.sqrt(max(x.numel(), 1))
