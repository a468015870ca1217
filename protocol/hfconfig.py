"""A Hugging Face causal-LM config as a run manifest carries it: canonical JSON, the families shoal splits into
stages (Llama, Mistral, Qwen2, Qwen3, GPT-2), their shapes and exact parameter counts per stage. No torch, no
`transformers`: every node (and the broker, which seats nodes by memory) reads a config with this module alone."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from shoal.protocol.errors import FieldError

MAX_CONFIG_CHARS = 32 * 1024
#: model_type -> the layout shoal knows how to cut: "llama" (model.embed_tokens, model.layers.N, model.norm,
#: model.rotary_emb, lm_head) or "gpt2" (transformer.wte/wpe, transformer.h.N, transformer.ln_f, lm_head)
FAMILIES: dict[str, str] = {"llama": "llama", "mistral": "llama", "qwen2": "llama", "qwen3": "llama", "gpt2": "gpt2"}
#: keys that say where or with what a config was written, not what the model is (left out of the run id)
VOLATILE_KEYS = frozenset({"transformers_version", "_name_or_path", "_commit_hash"})


def canonical_config(config: dict[str, Any]) -> str:
    """The config's canonical JSON (sorted keys, no spaces, volatile keys dropped), as the manifest stores it."""
    if not isinstance(config, dict):
        raise FieldError("model.hf.config", "a config.json holds a JSON object")
    text = json.dumps({k: v for k, v in config.items() if k not in VOLATILE_KEYS}, sort_keys=True,
                      separators=(",", ":"), allow_nan=False)
    if len(text) > MAX_CONFIG_CHARS:
        raise FieldError("model.hf.config", f"longer than {MAX_CONFIG_CHARS} characters")
    return text


def parse_config(text: str) -> dict[str, Any]:
    try:
        config = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise FieldError("model.hf.config", f"not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise FieldError("model.hf.config", "a config.json holds a JSON object")
    return config


def _int(config: dict[str, Any], key: str, lo: int, hi: int, default: int | None = None) -> int:
    v = config.get(key)
    v = default if v is None else v  # HF writes unset fields as null
    if v is None or isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise FieldError(f"model.hf.config.{key}", f"expected an integer in [{lo}, {hi}], got {v!r}")
    return v


def _bool(config: dict[str, Any], key: str, default: bool) -> bool:
    v = config.get(key)
    v = default if v is None else v
    if not isinstance(v, bool):
        raise FieldError(f"model.hf.config.{key}", f"expected true or false, got {v!r}")
    return v


@dataclass(frozen=True, kw_only=True, slots=True)
class HFShape:
    """What shoal needs to know about a config: its family and the sizes that fix parameters and activations."""

    model_type: str
    family: str  # "llama" or "gpt2"
    layers: int
    d_model: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    max_positions: int
    tied: bool  # tie_word_embeddings: the head is the embedding matrix
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    sliding_window: int | None  # None: full causal attention at every length

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> HFShape:
        mt = config.get("model_type")
        if mt not in FAMILIES:
            raise FieldError("model.hf.config.model_type", f"{mt!r} is not a family shoal splits into stages "
                                                           f"(one of {', '.join(sorted(FAMILIES))})")
        fam = FAMILIES[mt]
        if fam == "gpt2":
            d = _int(config, "n_embd", 8, 1 << 16)
            heads = _int(config, "n_head", 1, 1024)
            if d % heads:
                raise FieldError("model.hf.config.n_head", f"n_embd {d} does not split into {heads} heads")
            inner = config.get("n_inner")
            return cls(model_type=mt, family=fam, layers=_int(config, "n_layer", 1, 1024), d_model=d, heads=heads,
                       kv_heads=heads, head_dim=d // heads,
                       ffn=4 * d if inner is None else _int(config, "n_inner", 1, 1 << 20),
                       vocab=_int(config, "vocab_size", 1, 1 << 22), max_positions=_int(config, "n_positions", 1, 1 << 24),
                       tied=_bool(config, "tie_word_embeddings", True), qkv_bias=True, o_bias=True, mlp_bias=True,
                       qk_norm=False, sliding_window=None)
        d = _int(config, "hidden_size", 8, 1 << 16)
        heads = _int(config, "num_attention_heads", 1, 1024)
        kv = _int(config, "num_key_value_heads", 1, heads, default=heads)
        if heads % kv:
            raise FieldError("model.hf.config.num_key_value_heads", f"{kv} does not divide {heads} heads")
        head_dim = _int(config, "head_dim", 2, 4096, default=d // heads)
        window = None
        if config.get("sliding_window") is not None and (mt != "qwen2" and mt != "qwen3"
                                                         or config.get("use_sliding_window") is True):
            window = _int(config, "sliding_window", 1, 1 << 24)
        attn_bias = _bool(config, "attention_bias", False) if mt in ("llama", "qwen3") else False
        return cls(model_type=mt, family=fam, layers=_int(config, "num_hidden_layers", 1, 1024), d_model=d,
                   heads=heads, kv_heads=kv, head_dim=head_dim, ffn=_int(config, "intermediate_size", 1, 1 << 20),
                   vocab=_int(config, "vocab_size", 1, 1 << 22),
                   max_positions=_int(config, "max_position_embeddings", 1, 1 << 24, default=1 << 24),
                   tied=_bool(config, "tie_word_embeddings", False),
                   qkv_bias=attn_bias or mt == "qwen2", o_bias=attn_bias,
                   mlp_bias=_bool(config, "mlp_bias", False) if mt == "llama" else False,
                   qk_norm=mt == "qwen3", sliding_window=window)

    def layer_params(self) -> int:
        d, q, kv, f = self.d_model, self.heads * self.head_dim, self.kv_heads * self.head_dim, self.ffn
        if self.family == "gpt2":  # ln_1, c_attn, c_proj, ln_2, c_fc, mlp.c_proj (all with biases)
            return 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + 2 * d + (d * f + f) + (f * d + d)
        n = d * q + 2 * d * kv + q * d + 3 * d * f + 2 * d  # q, k, v, o; gate, up, down; two norms
        n += (q + 2 * kv) if self.qkv_bias else 0
        n += d if self.o_bias else 0
        n += (2 * f + d) if self.mlp_bias else 0
        n += 2 * self.head_dim if self.qk_norm else 0
        return n

    def embedding_params(self) -> int:
        return self.vocab * self.d_model + (self.max_positions * self.d_model if self.family == "gpt2" else 0)

    def final_norm_params(self) -> int:
        return 2 * self.d_model if self.family == "gpt2" else self.d_model

    def stage_params(self, first: int, last: int, *, embedding: bool, head: bool, tied: bool) -> int:
        """Parameters of layers [first, last), with the embedding and/or the final norm and head."""
        n = (last - first) * self.layer_params()
        if embedding:
            n += self.embedding_params()
        if head:
            n += self.final_norm_params() + (0 if tied else self.vocab * self.d_model)
        return n

    def describe(self) -> str:
        return f"{self.model_type} {self.layers}x{self.d_model}"
