"""AQ-SGD on a lane link: its settings, the tensor frames of a row group (Q_b with one scale per hidden channel per
micro-batch, or fp16), and the encoding of a micro-batch's activations against the sender's store.

A group of n rows of (seq T, hidden H) travels as one tensor frame: at 16 bits, codec "fp16" of shape (n, T, H); at
b < 16 bits, codec "qb" of the (H, n·T) transpose with buckets of n·T, i.e. one fp16 scale per hidden channel over
the group (docs/pipeline.md, "The quantizer Q_b": scale axes (0, 1) of the micro-batch). An activation message has
up to two groups: its first visits (at first_bits) and its deltas (at fwd_bits); a gradient message has one (at
bwd_bits). Both ends reconstruct from the same bytes with the same functions, so their stores stay bit-identical.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shoal.kernels.codec import CastCodec, Encoded, QuantCodec, tensor_from_buffer
from shoal.kernels.quant import NonFiniteError
from shoal.protocol.errors import FieldError
from shoal.protocol.frames import decode_frame, encode_frame, make_header, packed_nbytes
from shoal.protocol.manifest import AQ_BITS, AQ_BUFFERS, AQ_DIRECT_BITS, PipelineSpec
from shoal.swarm.lane.aq_store import LinkStore

_FP16 = CastCodec(torch.float16)


@dataclass(frozen=True, kw_only=True, slots=True)
class AQSpec:
    """A run's AQ-SGD settings on every link (from the manifest's pipeline section)."""

    fwd_bits: int = 4  # activation deltas
    bwd_bits: int = 8  # activation gradients, quantized directly (16: fp16)
    first_bits: int = 8  # first visits and NACKed rows (16: fp16)
    buffer: str = "memory"  # or "disk": one file per link end under buffer_dir
    cap_mb: int = 4096  # per link end
    buffer_dir: str | None = None
    deltas: bool = True  # False: every row as a first visit (direct quantization: the benchmarks' control)

    def __post_init__(self) -> None:
        if self.fwd_bits not in AQ_BITS or self.bwd_bits not in AQ_DIRECT_BITS or self.first_bits not in AQ_DIRECT_BITS:
            raise ValueError(f"AQ-SGD bits: deltas {AQ_BITS}, gradients and first visits {AQ_DIRECT_BITS}")
        if self.buffer not in AQ_BUFFERS or self.cap_mb < 1:
            raise ValueError(f"buffer one of {AQ_BUFFERS}, cap_mb >= 1")
        if self.buffer == "disk" and not self.buffer_dir:
            raise ValueError("a disk buffer needs buffer_dir")

    @classmethod
    def from_pipeline(cls, p: PipelineSpec, buffer_dir: str | None = None) -> AQSpec:
        return cls(fwd_bits=p.fwd_bits, bwd_bits=p.bwd_bits, first_bits=p.first_visit_bits, buffer=p.buffer,
                   cap_mb=p.buffer_cap_mb, buffer_dir=buffer_dir)


def group_nbytes(n: int, seq: int, hidden: int, bits: int) -> int:
    """Payload bytes of n rows at `bits`: n·T·H·b/8 (packed) plus H fp16 scales below 16 bits; 0 for no rows."""
    if n == 0:
        return 0
    if bits == 16:
        return 2 * n * seq * hidden
    return packed_nbytes(n * seq * hidden, bits) + 2 * hidden


def _codec(n: int, seq: int, bits: int):
    return _FP16 if bits == 16 else QuantCodec(bits, n * seq)


def _expected(n: int, seq: int, hidden: int, bits: int) -> tuple:
    if bits == 16:
        return ("fp16", "float32", (n, seq, hidden), 16, 0)
    return ("qb", "float32", (hidden, n * seq), bits, n * seq)


def on_codec_device(x: torch.Tensor) -> torch.Tensor:
    """float32 on CUDA when x is there (Q_b runs on the GPU, bit-identical to the CPU reference), else on the CPU."""
    x = x.detach()
    return x.float() if x.is_cuda else x.to("cpu", torch.float32)


def encode_group(x: torch.Tensor, bits: int) -> tuple[object, bytes, torch.Tensor]:
    """(tensor header, frame bytes, what the receiver decodes as float32 (n, T, H)) of rows x (n, T, H).
    Raises NonFiniteError for values it cannot carry."""
    n, seq, hidden = x.shape
    x = on_codec_device(x)  # a CUDA tensor is quantized and packed where it is (the Triton kernels); only bytes move
    if not bool(torch.isfinite(x).all()):
        raise NonFiniteError("NaN or Inf")
    wire = x if bits == 16 else x.permute(2, 0, 1).reshape(hidden, n * seq)
    e = _codec(n, seq, bits).encode(wire.contiguous())
    mv = e.payload_bytes()
    header = make_header(e.codec, e.dtype, e.shape, e.bits, e.bucket, e.count, mv)
    head, body = encode_frame(header, mv)
    # decoded from what was just encoded, where it was encoded: the frame carries these very bytes, and the CUDA
    # kernels' arithmetic is the CPU reference's bit for bit, so this is what the receiver's decode_group gives
    dec = _codec(n, seq, bits).decode(e)
    dec = dec if bits == 16 else dec.view(hidden, n, seq).permute(1, 2, 0)
    return header, bytes(head) + bytes(body), dec.contiguous()


def decode_group(buf: bytes, n: int, seq: int, hidden: int, bits: int) -> torch.Tensor:
    """A received group: exactly the frame this link expects for n rows at `bits`, finite; float32 (n, T, H).
    Raises ProtocolError."""
    h, payload = decode_frame(buf, max_numel=n * seq * hidden, max_payload=len(buf))
    want = _expected(n, seq, hidden, bits)
    if (h.codec, h.dtype, h.shape, h.bits, h.bucket) != want:
        raise FieldError("tensor", f"{h.codec} {h.bits} bits {list(h.shape)} bucket {h.bucket}, expected "
                                   f"{want[0]} {want[3]} bits {list(want[2])} bucket {want[4]}")
    e = Encoded(h.codec, h.dtype, h.shape, h.bits, h.bucket, h.count, tensor_from_buffer(payload))
    x = _codec(n, seq, bits).decode(e)
    if not bool(torch.isfinite(x).all()):
        raise FieldError("tensor", "non-finite values")
    if bits != 16:
        x = x.view(hidden, n, seq).permute(1, 2, 0)
    return x.contiguous()


@dataclass(slots=True)
class Encoding:
    """One micro-batch's activations encoded against the sender's store (computed off the event loop)."""

    base_versions: tuple[int, ...]  # per row; 0: a first visit
    frames: list[bytes]  # the first visits' group, then the deltas' group (each present when it has rows)
    headers: list[object]
    rows: list[tuple[int, torch.Tensor]]  # (sample, new m) to commit on the ACK, in row order (stored samples only)

    @property
    def n_first(self) -> int:
        return sum(1 for v in self.base_versions if v == 0)


def encode_acts(spec: AQSpec, store: LinkStore, ids: list[int], acts: torch.Tensor, force_first: set[int],
                busy: set[int]) -> Encoding:
    """Rows whose sample has a committed row here and is not `busy` (written earlier in this step, not yet
    committed) nor repeated earlier in this micro-batch nor in `force_first` go as Q_fwd(a - m); the rest as first
    visits. A delta whose new m would not be finite in fp16 goes as a first visit instead."""
    acts = on_codec_device(acts)
    while True:
        seen: set[int] = set()
        base = []
        for i, sid in enumerate(ids):
            v = store.version(sid)
            delta = spec.deltas and v > 0 and sid not in busy and sid not in seen and i not in force_first
            base.append(v if delta else 0)
            seen.add(sid)
        first = [i for i, v in enumerate(base) if v == 0]
        deltas = [i for i, v in enumerate(base) if v != 0]
        _, seq, hidden = acts.shape
        out = torch.empty(acts.shape, dtype=torch.float16)
        frames, headers = [], []
        if first:
            h, f, dec = encode_group(acts[first], spec.first_bits)
            frames.append(f)
            headers.append(h)
            out[first] = dec.to("cpu", torch.float16)
        if deltas:
            m_old = torch.stack([store.get(ids[i]) for i in deltas]).to(acts.device).float()
            h, f, dec = encode_group(acts[deltas] - m_old, spec.fwd_bits)
            m_new = (m_old + dec).to("cpu", torch.float16)
            bad = [deltas[k] for k in range(len(deltas)) if not bool(torch.isfinite(m_new[k]).all())]
            if bad:
                force_first = force_first | set(bad)
                continue
            frames.append(f)
            headers.append(h)
            out[deltas] = m_new
        rows = [(sid, out[i]) for i, sid in enumerate(ids) if store.holds(sid)]
        return Encoding(tuple(base), frames, headers, rows)


def apply_acts(store: LinkStore, ids: list[int], base_versions: tuple[int, ...], first: torch.Tensor | None,
               delta: torch.Tensor | None, version: int) -> torch.Tensor | None:
    """Receiver: m for every row (fp16 (B, T, H)), committed to the store at `version` in row order; None when a
    reconstructed row is not finite (the sender's fault: an honest sender sends such a row in full)."""
    fi = [i for i, v in enumerate(base_versions) if v == 0]
    di = [i for i, v in enumerate(base_versions) if v != 0]
    ref = first if first is not None else delta
    assert ref is not None and (first is not None or not fi) and (delta is not None or not di)  # checked on receipt
    out = torch.empty((len(ids), *ref.shape[1:]), dtype=torch.float16)
    if fi and first is not None:
        out[fi] = first.to(torch.float16)
    if di and delta is not None:
        m_old = torch.stack([store.get(ids[i]) for i in di]).float()
        out[di] = (m_old + delta).to(torch.float16)
        if not bool(torch.isfinite(out[di]).all()):
            return None
    for i, sid in enumerate(ids):
        if store.holds(sid):
            store.put(sid, version, out[i])
    return out
