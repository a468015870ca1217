"""The run manifest: a signed, versioned description of one training run; its content hash is the run id."""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import os
import tomllib
from dataclasses import dataclass, field
from typing import Any, Self

import tomli_w

from shoal.protocol.errors import DecodeError, FieldError, SignatureError
from shoal.protocol.signing import peer_id_from_public_key, public_key_bytes, public_key_from_peer_id, sign, verify
from shoal.protocol.wire import check_bytes, check_choice, check_float, check_int, check_str, pack, unpack

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
JOIN_MODES = ("open", "secret", "allowlist")
SCRYPT_N, SCRYPT_R, SCRYPT_P = 2**14, 8, 1


class _Record:
    """Mixin: plain-dict conversion (canonical field order, nested records), unknown keys ignored on read."""

    __slots__ = ()

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.metadata.get("omit_if_default") and v == f.default:
                continue  # a field added later: absent at its default, so older manifests keep their run ids
            out[f.name] = v.to_dict() if isinstance(v, _Record) else list(v) if isinstance(v, tuple) else v
        return out

    @classmethod
    def from_dict(cls, m: Any, path: str = "") -> Self:
        if not isinstance(m, dict):
            raise FieldError(path.rstrip(".") or cls.__name__, f"expected a table, got {type(m).__name__}")
        kwargs = {}
        for f in dataclasses.fields(cls):
            if f.name not in m:
                continue
            nested = f.metadata.get("nested")
            kwargs[f.name] = nested.from_dict(m[f.name], f"{path}{f.name}.") if nested else m[f.name]
        try:
            return cls(**kwargs)
        except FieldError as e:
            if e.field.startswith(path):
                raise
            raise FieldError(f"{path}{e.field}", e.problem) from None
        except TypeError as e:
            raise DecodeError(f"{cls.__name__}: {e}") from None


def _nested(cls: type) -> Any:
    return field(default_factory=cls, metadata={"nested": cls})


def _set(obj: Any, name: str, v: Any) -> None:
    object.__setattr__(obj, name, v)


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelSpec(_Record):
    """GPT decoder shape; `size` names a preset, the numbers are what is trained (presets fill them)."""

    size: str = "tiny"
    n_layers: int = MODEL_PRESETS["tiny"][0]
    d_model: int = MODEL_PRESETS["tiny"][1]
    n_heads: int = MODEL_PRESETS["tiny"][2]
    vocab_size: int = 256
    positions: str = "rope"  # "rope" (rotary) or "learned"
    mlp_ratio: int = 4
    #: the head shares the embedding matrix; None: tied when the plan has one stage, untied when it is split
    #: (a split model's last stage keeps its own head); an explicit value is written into the run id
    tie_embeddings: bool | None = field(default=None, metadata={"omit_if_default": True})

    def __post_init__(self) -> None:
        check_choice("size", self.size, MODEL_SIZES + ("custom",))
        check_int("n_layers", self.n_layers, 1, 1024)
        check_int("d_model", self.d_model, 8, 65536)
        check_int("n_heads", self.n_heads, 1, 1024)
        if self.d_model % self.n_heads or (self.d_model // self.n_heads) % 2:
            raise FieldError("n_heads", f"d_model {self.d_model} must split into an even head size")
        check_int("vocab_size", self.vocab_size, 256, 1 << 20)
        check_choice("positions", self.positions, ("rope", "learned"))
        check_int("mlp_ratio", self.mlp_ratio, 1, 16)
        if self.tie_embeddings is not None and not isinstance(self.tie_embeddings, bool):
            raise FieldError("tie_embeddings", f"expected bool, got {type(self.tie_embeddings).__name__}")

    def tied(self, stages: int) -> bool:
        """Whether the head shares the embedding matrix in a plan of `stages` stages."""
        return self.tie_embeddings if self.tie_embeddings is not None else stages == 1

    @classmethod
    def preset(cls, size: str, **overrides: Any) -> ModelSpec:
        check_choice("size", size, MODEL_SIZES)
        n_layers, d_model, n_heads, _ = MODEL_PRESETS[size]
        return cls(**{"size": size, "n_layers": n_layers, "d_model": d_model, "n_heads": n_heads, **overrides})


@dataclass(frozen=True, kw_only=True, slots=True)
class DataSpec(_Record):
    """Where tokens come from: "stdlib" (the interpreter's own source), a local .txt/.jsonl path, or "hf:NAME"."""

    source: str = "stdlib"
    tokenizer: str = "bytes"
    heldout_every: int = 20  # every Nth 64 KiB block of the corpus is held out for evaluation (5%)

    def __post_init__(self) -> None:
        check_str("source", self.source, 1024, allow_empty=False)
        check_choice("tokenizer", self.tokenizer, ("bytes",))
        check_int("heldout_every", self.heldout_every, 2, 1000)


@dataclass(frozen=True, kw_only=True, slots=True)
class CocktailSpec(_Record):
    """CocktailSGD: random fraction p, top-k ratio r of it, b-bit quantization; uncompressed all-reduce first."""

    p: float = 0.1
    r: float = 0.2
    bits: int = 4
    warmup_steps: int = 100

    def __post_init__(self) -> None:
        _set(self, "p", check_float("p", self.p, 1e-6, 1.0))
        _set(self, "r", check_float("r", self.r, 1e-6, 1.0))
        check_int("bits", self.bits, 1, 16)
        check_int("warmup_steps", self.warmup_steps, 0, 1 << 40)


@dataclass(frozen=True, kw_only=True, slots=True)
class DilocoSpec(_Record):
    """DiLoCo / Streaming DiLoCo: an outer Nesterov step every `inner_steps`, optionally by fragments."""

    inner_steps: int = 100
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    fragments: int = 1
    e3m0: bool = False  # 4-bit (e3m0) outer gradients
    overlap_steps: int = 0  # tau: inner steps trained while a fragment's all-reduce is on the wire
    merge_alpha: float = 0.0  # after an outer step: x = alpha*x + (1 - alpha)*theta (0: take theta)

    def __post_init__(self) -> None:
        check_int("inner_steps", self.inner_steps, 1, 1 << 30)
        _set(self, "outer_lr", check_float("outer_lr", self.outer_lr, 0.0, 100.0))
        _set(self, "outer_momentum", check_float("outer_momentum", self.outer_momentum, 0.0, 1.0))
        check_int("fragments", self.fragments, 1, 1024)
        check_int("overlap_steps", self.overlap_steps, 0, 1 << 30)
        if self.overlap_steps and self.overlap_steps * self.fragments >= self.inner_steps:
            raise FieldError("overlap_steps", f"must be < inner_steps / fragments "
                                              f"({self.inner_steps} / {self.fragments}): one fragment on the wire")
        _set(self, "merge_alpha", check_float("merge_alpha", self.merge_alpha, 0.0, 0.999))
        if not isinstance(self.e3m0, bool):
            raise FieldError("e3m0", f"expected bool, got {type(self.e3m0).__name__}")


@dataclass(frozen=True, kw_only=True, slots=True)
class AllReduceSpec(_Record):
    dtype: str = "fp32"

    def __post_init__(self) -> None:
        check_choice("dtype", self.dtype, ("fp32", "bf16", "fp16"))


@dataclass(frozen=True, kw_only=True, slots=True)
class SyncSpec(_Record):
    """How the D replicas of a stage stay together; only the settings of `method` are used."""

    method: str = "none"
    allreduce: AllReduceSpec = _nested(AllReduceSpec)
    cocktail: CocktailSpec = _nested(CocktailSpec)
    diloco: DilocoSpec = _nested(DilocoSpec)

    def __post_init__(self) -> None:
        check_choice("method", self.method, SYNC_METHODS)


@dataclass(frozen=True, kw_only=True, slots=True)
class PipelineSpec(_Record):
    """What crosses a stage boundary: AQ-SGD activation deltas forward, quantized gradients backward."""

    compression: str = "aqsgd"
    fwd_bits: int = 4
    bwd_bits: int = 8
    warmup_epochs: int = 1

    def __post_init__(self) -> None:
        check_choice("compression", self.compression, PIPELINE_COMPRESSION)
        check_int("fwd_bits", self.fwd_bits, 1, 16)
        check_int("bwd_bits", self.bwd_bits, 1, 16)
        check_int("warmup_epochs", self.warmup_epochs, 0, 1 << 20)


@dataclass(frozen=True, kw_only=True, slots=True)
class ParallelPlan(_Record):
    """S pipeline stages x D data-parallel replicas per stage."""

    stages: int = 1
    replicas: int = 1
    sync: SyncSpec = _nested(SyncSpec)
    pipeline: PipelineSpec = _nested(PipelineSpec)

    def __post_init__(self) -> None:
        check_int("stages", self.stages, 1, 1024)
        check_int("replicas", self.replicas, 1, 65536)
        if self.replicas > 1 and self.sync.method == "none":
            raise FieldError("sync.method", "D > 1 replicas need a synchronizer other than 'none'")


@dataclass(frozen=True, kw_only=True, slots=True)
class OptimSpec(_Record):
    """AdamW (or plain SGD) with linear warm-up then cosine decay to min_lr_ratio * lr at total_steps."""

    optimizer: str = "adamw"  # "adamw", or "sgd" (no momentum; weight decay as L2)
    lr: float = 3e-3
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    warmup_steps: int = 50
    total_steps: int = 2000
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping

    def __post_init__(self) -> None:
        check_choice("optimizer", self.optimizer, ("adamw", "sgd"))
        _set(self, "lr", check_float("lr", self.lr, 0.0, 10.0))
        _set(self, "beta1", check_float("beta1", self.beta1, 0.0, 0.999999))
        _set(self, "beta2", check_float("beta2", self.beta2, 0.0, 0.999999))
        _set(self, "eps", check_float("eps", self.eps, 0.0, 1.0))
        _set(self, "weight_decay", check_float("weight_decay", self.weight_decay, 0.0, 10.0))
        check_int("total_steps", self.total_steps, 1, 1 << 40)
        check_int("warmup_steps", self.warmup_steps, 0, self.total_steps)
        _set(self, "min_lr_ratio", check_float("min_lr_ratio", self.min_lr_ratio, 0.0, 1.0))
        _set(self, "grad_clip", check_float("grad_clip", self.grad_clip, 0.0, 1e6))


@dataclass(frozen=True, kw_only=True, slots=True)
class BatchSpec(_Record):
    """Sequences per optimizer step per replica, split into micro-batches; tokens per sequence."""

    batch_size: int = 16
    micro_batch_size: int = 16
    seq_len: int = MODEL_PRESETS["tiny"][3]

    def __post_init__(self) -> None:
        check_int("batch_size", self.batch_size, 1, 1 << 20)
        check_int("micro_batch_size", self.micro_batch_size, 1, self.batch_size)
        if self.batch_size % self.micro_batch_size:
            raise FieldError("micro_batch_size", f"must divide batch_size {self.batch_size}")
        check_int("seq_len", self.seq_len, 2, 1 << 20)


@dataclass(frozen=True, kw_only=True, slots=True)
class EvalSpec(_Record):
    every_steps: int = 100  # 0: never
    batches: int = 4

    def __post_init__(self) -> None:
        check_int("every_steps", self.every_steps, 0, 1 << 40)
        check_int("batches", self.batches, 1, 1 << 20)


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointSpec(_Record):
    every_steps: int = 100  # 0: only at the end
    keep_last: int = 3

    def __post_init__(self) -> None:
        check_int("every_steps", self.every_steps, 0, 1 << 40)
        check_int("keep_last", self.keep_last, 1, 1000)


@dataclass(frozen=True, kw_only=True, slots=True)
class JoinPolicy(_Record):
    """Who may join: anyone, holders of a secret (only its salted scrypt hash is stored), or listed peer ids."""

    mode: str = "open"
    secret_salt: str = ""  # hex
    secret_hash: str = ""  # hex scrypt(secret, salt)
    allowlist: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        check_choice("mode", self.mode, JOIN_MODES)
        for name in ("secret_salt", "secret_hash"):
            v = check_str(name, getattr(self, name), 128)
            if any(c not in "0123456789abcdef" for c in v):
                raise FieldError(name, "expected lowercase hex")
        if self.mode == "secret" and (len(self.secret_salt) != 32 or len(self.secret_hash) != 64):
            raise FieldError("secret_hash", "mode 'secret' needs a 16-byte salt and a 32-byte hash")
        if not isinstance(self.allowlist, (list, tuple)) or len(self.allowlist) > 4096:
            raise FieldError("allowlist", "expected a list of at most 4096 peer ids")
        for i, pid in enumerate(self.allowlist):
            try:
                public_key_from_peer_id(check_str(f"allowlist[{i}]", pid, 64))
            except SignatureError as e:
                raise FieldError(f"allowlist[{i}]", str(e)) from None
        _set(self, "allowlist", tuple(self.allowlist))
        if self.mode == "allowlist" and not self.allowlist:
            raise FieldError("allowlist", "mode 'allowlist' needs at least one peer id")

    @classmethod
    def with_secret(cls, secret: str, *, salt: bytes | None = None) -> JoinPolicy:
        salt = os.urandom(16) if salt is None else salt
        return cls(mode="secret", secret_salt=salt.hex(), secret_hash=_secret_hash(secret, salt).hex())

    def admits_secret(self, secret: str) -> bool:
        if self.mode != "secret":
            return self.mode == "open"
        got = _secret_hash(secret, bytes.fromhex(self.secret_salt))
        return hmac.compare_digest(got, bytes.fromhex(self.secret_hash))

    def admits_peer(self, peer_id: str) -> bool:
        return self.mode == "open" or (self.mode == "allowlist" and peer_id in self.allowlist)


def _secret_hash(secret: str, salt: bytes) -> bytes:
    return hashlib.scrypt(secret.encode(), salt=salt, n=SCRYPT_N, r=SCRYPT_R, p=SCRYPT_P, dklen=32)


@dataclass(frozen=True, kw_only=True, slots=True)
class RunManifest(_Record):
    """Everything a node needs to take part in a run. `run_id` hashes all fields but `signature`."""

    version: int = MANIFEST_VERSION
    name: str = "shoal-run"
    created_at: int = 0  # unix seconds
    seed: int = 0
    model: ModelSpec = _nested(ModelSpec)
    data: DataSpec = _nested(DataSpec)
    plan: ParallelPlan = _nested(ParallelPlan)
    optim: OptimSpec = _nested(OptimSpec)
    batch: BatchSpec = _nested(BatchSpec)
    eval: EvalSpec = _nested(EvalSpec)
    checkpoint: CheckpointSpec = _nested(CheckpointSpec)
    join: JoinPolicy = _nested(JoinPolicy)
    owner: str = ""  # peer id of the signer; empty for an unsigned local run
    signature: bytes = b""

    def __post_init__(self) -> None:
        check_int("version", self.version, 1, 1 << 16)
        if self.version != MANIFEST_VERSION:
            raise FieldError("version", f"this build reads manifest version {MANIFEST_VERSION}, got {self.version}")
        check_str("name", self.name, 128, allow_empty=False)
        check_int("created_at", self.created_at, 0, 1 << 40)
        check_int("seed", self.seed, 0, 2**63 - 1)
        if self.plan.stages > self.model.n_layers:
            raise FieldError("plan.stages", f"{self.plan.stages} stages for {self.model.n_layers} layers")
        if self.plan.stages > 1 and self.model.tie_embeddings:
            raise FieldError("model.tie_embeddings", "a model split into stages has its head untied from the "
                                                     "embedding (the ends live on different nodes)")
        if self.owner:
            try:
                public_key_from_peer_id(check_str("owner", self.owner, 64))
            except SignatureError as e:
                raise FieldError("owner", str(e)) from None
        _set(self, "signature", check_bytes("signature", self.signature, 64))
        if self.signature and len(self.signature) != 64:
            raise FieldError("signature", "expected 64 bytes (or none)")

    # -- identity, signing

    def signing_payload(self) -> bytes:
        body = self.to_dict()
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

    # -- encodings

    def to_bytes(self) -> bytes:
        return pack(self.to_dict())

    @classmethod
    def from_bytes(cls, data: bytes) -> RunManifest:
        return cls.from_dict(unpack(data, max_bytes=MAX_MANIFEST_BYTES))

    def to_toml(self) -> str:
        d = self.to_dict()
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
        return cls.from_dict(d)

    @classmethod
    def default(cls, size: str = "tiny", **overrides: Any) -> RunManifest:
        """The built-in run: a `size` GPT on the stdlib corpus, one stage, one replica."""
        seq = MODEL_PRESETS[size][3]
        return cls(**{"model": ModelSpec.preset(size), "batch": BatchSpec(seq_len=seq), **overrides})
