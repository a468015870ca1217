"""The run manifest: a signed, versioned description of one training run; its content hash is the run id."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import tomllib
from dataclasses import dataclass
from typing import Any

import tomli_w

from shoal.protocol.errors import DecodeError, FieldError, SignatureError
from shoal.protocol.hfconfig import HFShape, parse_config
from shoal.protocol.signing import peer_id_from_public_key, public_key_bytes, public_key_from_peer_id, sign, verify
from shoal.protocol.schema import Bool, Bytes, Choice, Float, Int, Nested, Optional, Seq, Str, WireRecord, spec
from shoal.protocol.wire import pack, unpack

MANIFEST_VERSION = 1
#: signatures cover this prefix + the canonical encoding, so a manifest signature is never valid for another record
SIGNING_DOMAIN = b"shoal/run-manifest/v1\0"
MAX_MANIFEST_BYTES = 64 * 1024

MODEL_SIZES = ("tiny", "small", "base")
#: size name -> (layers, d_model, heads, seq_len); vocab is 256 byte tokens for every size
MODEL_PRESETS: dict[str, tuple[int, int, int, int]] = {
    "tiny": (2, 128, 4, 128),  # ~0.4M parameters: fast on a CPU, for tests and the built-in demo
    "small": (8, 512, 8, 512),  # ~25M parameters
    "base": (16, 1024, 16, 1024),  # ~200M parameters: a home GPU
}
SYNC_METHODS = ("none", "allreduce", "cocktail", "diloco")
PIPELINE_COMPRESSION = ("none", "aqsgd")
WIRE_DTYPES = ("fp32", "fp16")
AQ_BITS = (2, 3, 4, 8)  # Q_b widths of activation deltas (docs/pipeline.md, "The quantizer Q_b")
AQ_DIRECT_BITS = AQ_BITS + (16,)  # first visits and gradients: Q_b, or 16 = fp16 in full
AQ_BUFFERS = ("memory", "disk")
JOIN_MODES = ("open", "secret", "allowlist")
MAX_LANES = 256  # replicas (lanes) of a run at most: the assignment table's bound
SNAPSHOT_EVERY_STEPS = 50  # erasure-coded snapshots (docs/snapshots.md, "Encoding and placement")
#: who sits where: by the measured links and the step-time cost model (docs/placement.md), or first come first seated
PLACEMENTS = ("network", "first-fit")


def even_split(n: int, parts: int) -> list[tuple[int, int]]:
    """[0, n) cut into `parts` contiguous [start, end) ranges whose sizes differ by at most one, earlier ones larger
    (how layers are cut into stages, and parameters into chunks)."""
    base, extra = divmod(n, parts)
    out, start = [], 0
    for i in range(parts):
        end = start + base + (1 if i < extra else 0)
        out.append((start, end))
        start = end
    return out


def _nested(cls: type) -> Any:
    return spec(Nested(cls), default_factory=cls)


SHA256_HEX = 64


def is_sha256(s: str) -> bool:
    return len(s) == SHA256_HEX and all(c in "0123456789abcdef" for c in s)


@dataclass(frozen=True, kw_only=True, slots=True)
class HFModelSpec(WireRecord):
    """A Hugging Face causal LM: its config.json (canonical JSON, protocol/hfconfig.py) and, to fine-tune from, the
    sha256 of its initial weights (one safetensors file, fetched from peers by that hash and checked against it,
    never read from a path the manifest names)."""

    config: str = spec(Str(32 * 1024, allow_empty=False), default="{}")
    weights: str = spec(Str(SHA256_HEX), default="")  # "" : initialized from the run's seed
    weights_bytes: int = spec(Int(0, 1 << 50), default=0)

    def __post_init__(self) -> None:
        WireRecord.__post_init__(self)
        if self.weights and not is_sha256(self.weights):
            raise FieldError("weights", "expected a sha256 in lowercase hex")
        if bool(self.weights) != bool(self.weights_bytes):
            raise FieldError("weights_bytes", "the weights' size goes with their hash")

    @property
    def shape(self) -> HFShape:
        return HFShape.from_config(parse_config(self.config))


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelSpec(WireRecord):
    """GPT decoder shape; `size` names a preset, the numbers are what is trained (presets fill them). A Hugging Face
    model (`size` "hf") is described by its config in `hf`; the numbers repeat its shape for the code that needs
    only those (layers to split, the width of the activations between stages, the vocabulary)."""

    size: str = spec(Choice(frozenset(MODEL_SIZES + ("custom", "hf"))), default="tiny")
    n_layers: int = spec(Int(1, 1024), default=MODEL_PRESETS["tiny"][0])
    d_model: int = spec(Int(8, 65536), default=MODEL_PRESETS["tiny"][1])
    n_heads: int = spec(Int(1, 1024), default=MODEL_PRESETS["tiny"][2])
    vocab_size: int = spec(Int(2, 1 << 22), default=256)  # 256: byte tokens
    positions: str = spec(Choice(frozenset({"rope", "learned"})), default="rope")  # rotary or learned
    mlp_ratio: int = spec(Int(1, 16), default=4)
    #: the head shares the embedding matrix; None: tied when the plan has one stage, untied when it is split
    #: (a split model's last stage keeps its own head); an explicit value is written into the run id
    tie_embeddings: bool | None = spec(Optional(Bool()), default=None, omit_if_default=True)
    hf: HFModelSpec | None = spec(Optional(Nested(HFModelSpec)), default=None, omit_if_default=True)

    def __post_init__(self) -> None:
        WireRecord.__post_init__(self)
        if self.hf is not None:
            sh = self.hf.shape
            want = {"size": "hf", "n_layers": sh.layers, "d_model": sh.d_model, "n_heads": sh.heads,
                    "vocab_size": sh.vocab, "tie_embeddings": None}
            for name, v in want.items():
                if getattr(self, name) != v:
                    raise FieldError(name, f"{getattr(self, name)!r} does not match the Hugging Face config ({v!r})")
            return
        if self.size == "hf":
            raise FieldError("hf", "size 'hf' needs the model's config")
        if self.d_model % self.n_heads or (self.d_model // self.n_heads) % 2:
            raise FieldError("n_heads", f"d_model {self.d_model} must split into an even head size")

    @classmethod
    def from_hf(cls, hf: HFModelSpec) -> ModelSpec:
        sh = hf.shape
        return cls(size="hf", n_layers=sh.layers, d_model=sh.d_model, n_heads=sh.heads, vocab_size=sh.vocab,
                   hf=hf)

    def tied(self, stages: int) -> bool:
        """Whether the head shares the embedding matrix in a plan of `stages` stages (a Hugging Face model: as its
        config says when one stage holds it; a split one always has its own head, initialized as the embedding)."""
        if self.hf is not None:
            return self.hf.shape.tied and stages == 1
        return self.tie_embeddings if self.tie_embeddings is not None else stages == 1

    @property
    def ffn_dim(self) -> int:
        return self.hf.shape.ffn if self.hf is not None else self.mlp_ratio * self.d_model

    def describe(self) -> str:
        """How people read the model's name: "tiny GPT", "llama 4x256" (layers x width)."""
        return self.hf.shape.describe() if self.hf is not None else f"{self.size} GPT"

    @classmethod
    def preset(cls, size: str, **overrides: Any) -> ModelSpec:
        Choice(frozenset(MODEL_SIZES)).check("size", size)
        n_layers, d_model, n_heads, _ = MODEL_PRESETS[size]
        return cls(**{"size": size, "n_layers": n_layers, "d_model": d_model, "n_heads": n_heads, **overrides})


@dataclass(frozen=True, kw_only=True, slots=True)
class DataSpec(WireRecord):
    """Where tokens come from: "stdlib" (the interpreter's own source), a local .txt/.jsonl path, or "hf:NAME"."""

    source: str = spec(Str(1024, allow_empty=False), default="stdlib")
    #: "bytes" (256 byte tokens) or the sha256 of a tokenizer.json (the `tokenizers` library's format), fetched from
    #: peers by that hash like the model's weights
    tokenizer: str = spec(Str(SHA256_HEX, allow_empty=False), default="bytes")
    # every Nth 64 KiB block of the corpus is held out for evaluation (5%)
    heldout_every: int = spec(Int(2, 1000), default=20)
    # train on the first N samples only (0: all of them), so samples come back every epoch (fine-tuning's regime,
    # where AQ-SGD's buffers pay off)
    train_subset: int = spec(Int(0, 1 << 40), default=0, omit_if_default=True)
    #: an hf: dataset's configuration (subset) and split, and the column that holds the text
    hf_config: str = spec(Str(128), default="", omit_if_default=True)
    hf_split: str = spec(Str(128, allow_empty=False), default="train", omit_if_default=True)
    text_field: str = spec(Str(128, allow_empty=False), default="text", omit_if_default=True)

    def __post_init__(self) -> None:
        WireRecord.__post_init__(self)
        if self.tokenizer != "bytes" and not is_sha256(self.tokenizer):
            raise FieldError("tokenizer", "'bytes' or the sha256 of a tokenizer.json (lowercase hex)")


WARMUP_BITS = (2, 4, 8, 32)  # CocktailSpec.warmup_bits: quantized (kernels/quant.py) or 32, uncompressed
WARMUP_BITS_DEFAULT = 2  # bench/results/cocktail_warmup.md: ~94 % of the fp32 warm-up's gain at 1/15 of its bytes


@dataclass(frozen=True, kw_only=True, slots=True)
class CocktailSpec(WireRecord):
    """CocktailSGD: random fraction p, top-k ratio r of it, b-bit quantization; a warm-up of all-reduced gradients
    first, quantized to `warmup_bits` with error feedback (32: uncompressed, in the run's all-reduce dtype)."""

    p: float = spec(Float(1e-6, 1.0), default=0.1)
    r: float = spec(Float(1e-6, 1.0), default=0.2)
    bits: int = spec(Int(1, 16), default=4)
    warmup_steps: int = spec(Int(0, 1 << 40), default=100)
    warmup_bits: int = spec(Int(2, 32), default=WARMUP_BITS_DEFAULT, omit_if_default=True)

    def __post_init__(self) -> None:
        WireRecord.__post_init__(self)
        if self.warmup_bits not in WARMUP_BITS:
            raise FieldError("warmup_bits", f"{self.warmup_bits} is not one of {WARMUP_BITS}")


@dataclass(frozen=True, kw_only=True, slots=True)
class DilocoSpec(WireRecord):
    """DiLoCo / Streaming DiLoCo: an outer Nesterov step every `inner_steps`, optionally by fragments."""

    inner_steps: int = spec(Int(1, 1 << 30), default=100)
    outer_lr: float = spec(Float(0.0, 100.0), default=0.7)
    outer_momentum: float = spec(Float(0.0, 1.0), default=0.9)
    fragments: int = spec(Int(1, 1024), default=1)
    e3m0: bool = spec(Bool(), default=False)  # 4-bit (e3m0) outer gradients
    overlap_steps: int = spec(Int(0, 1 << 30), default=0)  # tau: inner steps trained while a fragment is on the wire
    merge_alpha: float = spec(Float(0.0, 0.999), default=0.0)  # after an outer step: x = alpha*x + (1-alpha)*theta

    def __post_init__(self) -> None:
        WireRecord.__post_init__(self)
        if self.overlap_steps and self.overlap_steps * self.fragments >= self.inner_steps:
            raise FieldError("overlap_steps", f"must be < inner_steps / fragments "
                                              f"({self.inner_steps} / {self.fragments}): one fragment on the wire")


@dataclass(frozen=True, kw_only=True, slots=True)
class AllReduceSpec(WireRecord):
    dtype: str = spec(Choice(frozenset({"fp32", "bf16", "fp16"})), default="fp32")


@dataclass(frozen=True, kw_only=True, slots=True)
class SyncSpec(WireRecord):
    """How the D replicas of a stage stay together; only the settings of `method` are used."""

    method: str = spec(Choice(frozenset(SYNC_METHODS)), default="none")
    allreduce: AllReduceSpec = _nested(AllReduceSpec)
    cocktail: CocktailSpec = _nested(CocktailSpec)
    diloco: DilocoSpec = _nested(DilocoSpec)


@dataclass(frozen=True, kw_only=True, slots=True)
class PipelineSpec(WireRecord):
    """What crosses a stage boundary: with compression "none", activations and gradients at `wire_dtype`; with
    "aqsgd", activation deltas forward and quantized gradients backward (AQ-SGD, docs/pipeline.md "AQ-SGD over a link"):
    a sample's first visit on a link goes at `first_visit_bits` and both ends keep what was decoded; later visits
    send Q_fwd_bits(a - m); gradients go at `bwd_bits` (16: fp16). `warmup_epochs`: visits of a sample sent at
    first_visit_bits before deltas start (only 1, the first visit, is implemented). Each end keeps its buffer in
    memory or in a disk file, at most `buffer_cap_mb` per link end: samples whose id is below the rows that fit are
    kept, the others always go at first_visit_bits."""

    compression: str = spec(Choice(frozenset(PIPELINE_COMPRESSION)), default="aqsgd")
    fwd_bits: int = spec(Int(1, 16), default=4)
    bwd_bits: int = spec(Int(1, 16), default=8)
    warmup_epochs: int = spec(Int(0, 1 << 20), default=1)
    # what training activations and gradients travel as without compression (fields added later are left out of
    # the encoding at their default, so manifests written before them keep their run ids)
    wire_dtype: str = spec(Choice(frozenset(WIRE_DTYPES)), default="fp32", omit_if_default=True)
    first_visit_bits: int = spec(Int(1, 16), default=8, omit_if_default=True)
    buffer: str = spec(Choice(frozenset(AQ_BUFFERS)), default="memory", omit_if_default=True)
    buffer_cap_mb: int = spec(Int(1, 1 << 30), default=4096, omit_if_default=True)
    # verified stages (docs/verified-stages.md): the fraction of each lane's training micro-batches that a replica
    # of the same stage in another lane re-executes and compares; 0: no verification, and no signatures on the wire
    verify_fraction: float = spec(Float(0.0, 1.0), default=0.0, omit_if_default=True)

    def __post_init__(self) -> None:
        WireRecord.__post_init__(self)
        if self.compression == "aqsgd":
            if self.fwd_bits not in AQ_BITS:
                raise FieldError("fwd_bits", f"AQ-SGD deltas go at one of {AQ_BITS} bits, not {self.fwd_bits}")
            for name in ("bwd_bits", "first_visit_bits"):
                if getattr(self, name) not in AQ_DIRECT_BITS:
                    raise FieldError(name, f"one of {AQ_DIRECT_BITS} bits (16: fp16), not {getattr(self, name)}")
            if self.warmup_epochs != 1:
                raise FieldError("warmup_epochs", "only 1 (deltas from the second visit on) is implemented")


@dataclass(frozen=True, kw_only=True, slots=True)
class ParallelPlan(WireRecord):
    """S pipeline stages x D data-parallel replicas (lanes) per stage. D is elastic between `min_replicas` and
    `max_replicas`: the run starts when `replicas` lanes are filled (or after a wait, with at least the minimum),
    seats newcomers as new lanes while below the maximum (once every stage keeps `backups` warm backups), shrinks
    when lanes leave, and waits while below the minimum. Left at 0, the minimum is 1 and the maximum is `replicas`
    (a fixed count: newcomers wait in the backup pool)."""

    stages: int = spec(Int(1, 1024), default=1)
    replicas: int = spec(Int(1, MAX_LANES), default=1)  # lanes the run starts with
    sync: SyncSpec = _nested(SyncSpec)
    pipeline: PipelineSpec = _nested(PipelineSpec)
    min_replicas: int = spec(Int(0, MAX_LANES), default=0, omit_if_default=True)  # 0: 1
    max_replicas: int = spec(Int(0, MAX_LANES), default=0, omit_if_default=True)  # 0: `replicas`
    backups: int = spec(Int(0, 1024), default=0, omit_if_default=True)  # warm backups per stage before new lanes
    placement: str = spec(Choice(frozenset(PLACEMENTS)), default="first-fit", omit_if_default=True)

    def __post_init__(self) -> None:
        WireRecord.__post_init__(self)
        if self.lanes_max > 1 and self.sync.method == "none":
            raise FieldError("sync.method", "D > 1 replicas need a synchronizer other than 'none'")
        if not self.lanes_min <= self.replicas <= self.lanes_max:
            raise FieldError("replicas", f"need min_replicas {self.lanes_min} <= replicas {self.replicas} <= "
                                         f"max_replicas {self.lanes_max}")
        if self.pipeline.verify_fraction > 0:  # re-execution needs bit-identical replicas and exact wires
            if self.stages < 2 or self.replicas < 2:
                raise FieldError("pipeline.verify_fraction", "verified stages need S >= 2 stages and D >= 2 lanes")
            if self.sync.method != "allreduce" or self.pipeline.compression != "none":
                raise FieldError("pipeline.verify_fraction", "verified stages need all-reduce (replicas of a stage "
                                 "then hold bit-identical weights) and compression 'none' (fp32 or fp16 wires)")

    @property
    def lanes_min(self) -> int:
        """Below this many complete lanes the run waits."""
        return self.min_replicas or 1

    @property
    def lanes_max(self) -> int:
        """The most lanes the run seats (lane indices are 0 .. lanes_max - 1)."""
        return self.max_replicas or self.replicas

    @property
    def elastic(self) -> bool:
        return self.lanes_max > self.replicas


@dataclass(frozen=True, kw_only=True, slots=True)
class OptimSpec(WireRecord):
    """AdamW (or plain SGD) with linear warm-up then cosine decay to min_lr_ratio * lr at total_steps."""

    optimizer: str = spec(Choice(frozenset({"adamw", "sgd"})), default="adamw")  # sgd: no momentum, decay as L2
    lr: float = spec(Float(0.0, 10.0), default=3e-3)
    beta1: float = spec(Float(0.0, 0.999999), default=0.9)
    beta2: float = spec(Float(0.0, 0.999999), default=0.95)
    eps: float = spec(Float(0.0, 1.0), default=1e-8)
    weight_decay: float = spec(Float(0.0, 10.0), default=0.1)
    warmup_steps: int = spec(Int(0, 1 << 40), default=50)
    total_steps: int = spec(Int(1, 1 << 40), default=2000)
    min_lr_ratio: float = spec(Float(0.0, 1.0), default=0.1)
    grad_clip: float = spec(Float(0.0, 1e6), default=1.0)  # max global grad norm; 0 disables clipping

    def __post_init__(self) -> None:
        WireRecord.__post_init__(self)
        Int(0, self.total_steps).check("warmup_steps", self.warmup_steps)


@dataclass(frozen=True, kw_only=True, slots=True)
class BatchSpec(WireRecord):
    """The global batch: sequences per optimizer step for the whole run, split across its lanes in proportion to
    their measured speed (0: `batch_size` per starting replica). `batch_size`: a lane's nominal batch (a pipeline
    lane keeps at most this many sequences in flight: a bigger share runs in several waves); micro-batches of
    `micro_batch_size`; tokens per sequence."""

    batch_size: int = spec(Int(1, 1 << 20), default=16)
    micro_batch_size: int = spec(Int(1, 1 << 20), default=16)
    seq_len: int = spec(Int(2, 1 << 20), default=MODEL_PRESETS["tiny"][3])
    global_batch: int = spec(Int(0, 1 << 24), default=0, omit_if_default=True)

    def __post_init__(self) -> None:
        WireRecord.__post_init__(self)
        Int(1, self.batch_size).check("micro_batch_size", self.micro_batch_size)
        if self.batch_size % self.micro_batch_size:
            raise FieldError("micro_batch_size", f"must divide batch_size {self.batch_size}")


@dataclass(frozen=True, kw_only=True, slots=True)
class EvalSpec(WireRecord):
    every_steps: int = spec(Int(0, 1 << 40), default=100)  # 0: never
    batches: int = spec(Int(1, 1 << 20), default=4)


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointSpec(WireRecord):
    """Disk checkpoints (every slot holder writes its own, docs/checkpoints.md) and erasure-coded in-memory
    snapshots (each stage's state at every `snapshot_every_steps`-th revision split into k data + `parity` shards
    held by peers outside the stage, k at most `max_data_shards`; docs/snapshots.md). The snapshot fields are left
    out of the encoding at their defaults, so manifests written before them keep their run ids."""

    every_steps: int = spec(Int(0, 1 << 40), default=100)  # 0: only at the end
    keep_last: int = spec(Int(1, 1000), default=3)
    snapshot_every_steps: int = spec(Int(0, 1 << 40), default=SNAPSHOT_EVERY_STEPS, omit_if_default=True)  # 0: none
    parity: int = spec(Int(1, 16), default=2, omit_if_default=True)
    max_data_shards: int = spec(Int(1, 16), default=8, omit_if_default=True)


HEX = Str(128)


@dataclass(frozen=True, kw_only=True, slots=True)
class JoinPolicy(WireRecord):
    """Who may join: anyone, holders of a secret, or listed peer ids. A private run's manifest holds only the salt
    of the admission key (protocol/admission.py), no verifier of the secret: the manifest is public (any peer
    fetches it before admission), so anything derived from the secret in it could be guessed at offline. The
    brokers (the owner's node, and members it delegates) know the secret; joiners prove they know it too."""

    mode: str = spec(Choice(frozenset(JOIN_MODES)), default="open")
    secret_salt: str = spec(HEX, default="")  # hex: the admission key's scrypt salt
    # never set (manifests of earlier builds stored a scrypt verifier here; they are refused with this field named)
    secret_hash: str = spec(HEX, default="")
    allowlist: tuple[str, ...] = spec(Seq(Str(64), 4096), default=())

    def __post_init__(self) -> None:
        WireRecord.__post_init__(self)
        for name in ("secret_salt", "secret_hash"):
            if any(c not in "0123456789abcdef" for c in getattr(self, name)):
                raise FieldError(name, "expected lowercase hex")
        if self.secret_hash:
            raise FieldError("secret_hash", "a manifest must not carry a verifier of the join secret (anyone could "
                                            "guess at it offline): create the run again")
        if self.mode == "secret" and len(self.secret_salt) != 32:
            raise FieldError("secret_salt", "mode 'secret' needs a 16-byte salt")
        for i, pid in enumerate(self.allowlist):
            try:
                public_key_from_peer_id(pid)
            except SignatureError as e:
                raise FieldError(f"allowlist[{i}]", str(e)) from None
        if self.mode == "allowlist" and not self.allowlist:
            raise FieldError("allowlist", "mode 'allowlist' needs at least one peer id")

    @classmethod
    def private(cls, *, salt: bytes | None = None) -> JoinPolicy:
        """A run that holders of its join secret may join (the secret stays with its holders)."""
        return cls(mode="secret", secret_salt=(os.urandom(16) if salt is None else salt).hex())

    def admits_peer(self, peer_id: str) -> bool:
        return self.mode == "open" or (self.mode == "allowlist" and peer_id in self.allowlist)


def lane_granule(stages: int, micro_batch: int) -> int:
    """The unit a lane's share of the global batch comes in: one sequence, or one micro-batch for a pipeline lane
    (its stages pass whole micro-batches along)."""
    return micro_batch if stages > 1 else 1


def default_max_replicas(replicas: int, global_batch: int, granule: int, cap: int) -> int:
    """An elastic run's lane limit when its owner names none: as many lanes as the global batch can give a granule
    each, at most `cap`, never fewer than the `replicas` it starts with."""
    return max(replicas, min(cap, global_batch // granule))


@dataclass(frozen=True, kw_only=True, slots=True)
class RunManifest(WireRecord):
    """Everything a node needs to take part in a run. `run_id` hashes all fields but `signature`."""

    version: int = spec(Int(1, 1 << 16), default=MANIFEST_VERSION)
    name: str = spec(Str(128, allow_empty=False), default="shoal-run")
    created_at: int = spec(Int(0, 1 << 40), default=0)  # unix seconds
    seed: int = spec(Int(0, 2**63 - 1), default=0)
    model: ModelSpec = _nested(ModelSpec)
    data: DataSpec = _nested(DataSpec)
    plan: ParallelPlan = _nested(ParallelPlan)
    optim: OptimSpec = _nested(OptimSpec)
    batch: BatchSpec = _nested(BatchSpec)
    eval: EvalSpec = _nested(EvalSpec)
    checkpoint: CheckpointSpec = _nested(CheckpointSpec)
    join: JoinPolicy = _nested(JoinPolicy)
    owner: str = spec(Str(64), default="")  # peer id of the signer; empty for an unsigned local run
    signature: bytes = spec(Bytes(64), default=b"")

    def __post_init__(self) -> None:
        WireRecord.__post_init__(self)
        if self.version != MANIFEST_VERSION:
            raise FieldError("version", f"this build reads manifest version {MANIFEST_VERSION}, got {self.version}")
        if self.plan.stages > self.model.n_layers:
            raise FieldError("plan.stages", f"{self.plan.stages} stages for {self.model.n_layers} layers")
        if self.plan.stages > 1 and self.model.tie_embeddings:
            raise FieldError("model.tie_embeddings", "a model split into stages has its head untied from the "
                                                     "embedding (the ends live on different nodes)")
        if self.model.hf is not None:
            sh = self.model.hf.shape
            if self.batch.seq_len > sh.max_positions:
                raise FieldError("batch.seq_len", f"{self.batch.seq_len} tokens, the model's positions cover "
                                                  f"{sh.max_positions}")
            if sh.sliding_window is not None and self.batch.seq_len > sh.sliding_window:
                raise FieldError("batch.seq_len", f"{self.batch.seq_len} tokens exceed the model's sliding window "
                                                  f"({sh.sliding_window}); shoal trains full causal attention")
        elif self.data.tokenizer == "bytes" and self.model.vocab_size < 256:
            raise FieldError("model.vocab_size", "byte tokens need a vocabulary of 256")
        g = self.batch_granule
        if self.global_batch % g:
            raise FieldError("batch.global_batch", f"{self.global_batch} sequences do not split into micro-batches "
                                                   f"of {g} (a pipeline lane takes whole micro-batches)")
        if self.plan.lanes_max > self.global_batch // g:
            raise FieldError("plan.max_replicas", f"{self.plan.lanes_max} lanes cannot each take a share of a global "
                                                  f"batch of {self.global_batch} (in units of {g})")
        if self.owner:
            try:
                public_key_from_peer_id(self.owner)
            except SignatureError as e:
                raise FieldError("owner", str(e)) from None
        if self.signature and len(self.signature) != 64:
            raise FieldError("signature", "expected 64 bytes (or none)")

    # -- identity, signing

    def signing_payload(self) -> bytes:
        body = self.to_wire()
        del body["signature"]
        return pack(body)

    @property
    def run_id(self) -> str:
        """sha256 hex of the canonical msgpack of every field but the signature (owner included)."""
        return hashlib.sha256(self.signing_payload()).hexdigest()

    def signed(self, private_key: Any) -> RunManifest:
        owner = peer_id_from_public_key(public_key_bytes(private_key))
        unsigned = dataclasses.replace(self, owner=owner, signature=b"")
        return dataclasses.replace(unsigned, signature=sign(private_key, SIGNING_DOMAIN + unsigned.signing_payload()))

    def verify(self) -> None:
        """Raise SignatureError unless the manifest carries a valid signature by `owner`."""
        if not self.owner or not self.signature:
            raise SignatureError("manifest is not signed")
        verify(public_key_from_peer_id(self.owner), SIGNING_DOMAIN + self.signing_payload(), self.signature)

    @property
    def seq_len(self) -> int:
        return self.batch.seq_len

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step, for the whole run (whatever its lanes now)."""
        return self.batch.global_batch or self.batch.batch_size * self.plan.replicas

    @property
    def batch_granule(self) -> int:
        """The unit a lane's share comes in (`lane_granule`)."""
        return lane_granule(self.plan.stages, self.batch.micro_batch_size)

    def stage_params(self, stage: int) -> int:
        """Parameters of stage `stage` of this run's plan (the built-in GPT: blocks of 4+2*mlp_ratio d^2 weights and
        two norms, the embedding on the first stage, the final norm and, when untied, the head on the last; a
        Hugging Face model: its family's count, protocol/hfconfig.py)."""
        m, stages = self.model, self.plan.stages
        first, last = even_split(m.n_layers, stages)[stage]
        if m.hf is not None:
            return m.hf.shape.stage_params(first, last, embedding=stage == 0, head=stage == stages - 1,
                                           tied=m.tied(stages))
        d = m.d_model
        n = (last - first) * ((4 + 2 * m.mlp_ratio) * d * d + 2 * d)
        if stage == 0:
            n += m.vocab_size * d + (self.batch.seq_len * d if m.positions == "learned" else 0)
        if stage == stages - 1:
            n += d + (0 if m.tied(stages) else m.vocab_size * d)
        return n

    def stage_memory_bytes(self, stage: int) -> int:
        """A rough need for training stage `stage`: fp32 weights, gradients and AdamW's two moments (16 bytes per
        parameter), plus the activations of the micro-batches in flight (GPipe keeps all M until the backward)."""
        m, b = self.model, self.batch
        first, last = even_split(m.n_layers, self.plan.stages)[stage]
        in_flight = b.batch_size if self.plan.stages > 1 else b.micro_batch_size
        per_layer = in_flight * b.seq_len * (10 * m.d_model + 2 * m.ffn_dim) * 4
        logits = in_flight * b.seq_len * m.vocab_size * 8 if stage == self.plan.stages - 1 else 0
        return 16 * self.stage_params(stage) + (last - first) * per_layer + logits

    def blobs(self) -> list[tuple[str, int | None]]:
        """The files this run names by sha256, with their sizes where the manifest fixes them: the model's initial
        weights, the tokenizer.json."""
        out: list[tuple[str, int | None]] = []
        if self.model.hf is not None and self.model.hf.weights:
            out.append((self.model.hf.weights, self.model.hf.weights_bytes))
        if self.data.tokenizer != "bytes":
            out.append((self.data.tokenizer, None))
        return out

    # -- encodings

    def to_bytes(self) -> bytes:
        return pack(self.to_wire())

    @classmethod
    def from_bytes(cls, data: bytes) -> RunManifest:
        return cls.from_wire(unpack(data, max_bytes=MAX_MANIFEST_BYTES))

    def to_toml(self) -> str:
        d = self.to_wire()
        d["signature"] = self.signature.hex()
        return tomli_w.dumps(d)

    @classmethod
    def from_toml(cls, text: str) -> RunManifest:
        try:
            d = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise DecodeError(f"run manifest is not valid TOML: {e}") from None
        sig = d.get("signature", "")
        if isinstance(sig, str):
            try:
                d["signature"] = bytes.fromhex(sig)
            except ValueError:
                raise FieldError("signature", "expected hex") from None
        return cls.from_wire(d)

    @classmethod
    def default(cls, size: str = "tiny", **overrides: Any) -> RunManifest:
        """The built-in run: a `size` GPT on the stdlib corpus, one stage, one replica."""
        seq = MODEL_PRESETS[size][3]
        return cls(**{"model": ModelSpec.preset(size), "batch": BatchSpec(seq_len=seq), **overrides})
