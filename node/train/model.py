"""The built-in GPT decoder (pre-norm, rotary or learned positions, tied embeddings), cut into layer-range stages."""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from shoal.protocol.manifest import ModelSpec, even_split


@dataclass(frozen=True, kw_only=True, slots=True)
class GPTConfig:
    n_layers: int
    d_model: int
    n_heads: int
    vocab_size: int = 256
    seq_len: int = 128  # the longest sequence the position tables cover
    positions: str = "rope"
    mlp_ratio: int = 4
    tie_embeddings: bool = True  # when one stage holds both ends, the head reuses the embedding matrix

    @classmethod
    def from_spec(cls, spec: ModelSpec, seq_len: int) -> GPTConfig:
        return cls(
            n_layers=spec.n_layers,
            d_model=spec.d_model,
            n_heads=spec.n_heads,
            vocab_size=spec.vocab_size,
            seq_len=seq_len,
            positions=spec.positions,
            mlp_ratio=spec.mlp_ratio,
            tie_embeddings=spec.tie_embeddings is not False,  # None: the whole model in one piece is tied
        )

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


def rotary_tables(seq_len: int, head_dim: int, base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles_TH = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
    return angles_TH.cos(), angles_TH.sin()


def apply_rotary(x_BHTD: torch.Tensor, cos_TH: torch.Tensor, sin_TH: torch.Tensor) -> torch.Tensor:
    T = x_BHTD.shape[-2]
    cos, sin = cos_TH[:T].to(x_BHTD.dtype), sin_TH[:T].to(x_BHTD.dtype)
    x1, x2 = x_BHTD[..., 0::2], x_BHTD[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x_BTD: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        B, T, D = x_BTD.shape
        q, k, v = self.qkv(x_BTD).view(B, T, 3, self.n_heads, D // self.n_heads).permute(2, 0, 3, 1, 4)
        if rope is not None:
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        y_BHTd = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y_BHTd.transpose(1, 2).reshape(B, T, D))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.norm1 = nn.RMSNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.norm2 = nn.RMSNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model, bias=False)
        self.out = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x_BTD: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        x_BTD = x_BTD + self.attn(self.norm1(x_BTD), rope)
        return x_BTD + self.out(F.gelu(self.fc(self.norm2(x_BTD))))


class GPTStage(nn.Module):
    """Layers [first_layer, last_layer) of the GPT, with the embedding and/or the head when it holds the ends.

    The whole model is the stage (0, n_layers, embedding, head). Parameter names are global
    (`blocks.5.attn.qkv.weight` is layer 5 in every stage), so a stage's state_dict is a slice of the
    whole model's. When one stage holds both ends and `cfg.tie_embeddings`, the head reuses the embedding
    matrix (tied); otherwise the head is its own `lm_head.weight`, initialized equal to the embedding
    (a separate last stage always is: the untied whole model is the reference for a split one).
    Input: token ids (B, T) if `has_embedding`, else hidden states (B, T, D).
    Output: logits (B, T, vocab) if `has_head`, else hidden states (B, T, D).
    """

    def __init__(self, cfg: GPTConfig, first_layer: int, last_layer: int, has_embedding: bool, has_head: bool, *, seed: int = 0):
        super().__init__()
        if not 0 <= first_layer <= last_layer <= cfg.n_layers:
            raise ValueError(f"bad layer range [{first_layer}, {last_layer}) for {cfg.n_layers} layers")
        self.cfg, self.first_layer, self.last_layer = cfg, first_layer, last_layer
        self.has_embedding, self.has_head = has_embedding, has_head
        self.tied = has_embedding and has_head and cfg.tie_embeddings
        if has_embedding:
            self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
            if cfg.positions == "learned":
                self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleDict({str(i): Block(cfg) for i in range(first_layer, last_layer)})
        if has_head:
            self.norm_f = nn.RMSNorm(cfg.d_model)
            if not self.tied:
                # a module registered last, so parameters come in the same order split or whole
                self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.positions == "rope":
            cos, sin = rotary_tables(cfg.seq_len, cfg.head_dim)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        init_weights(self, seed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.has_embedding:
            T = x.shape[1]
            if T > self.cfg.seq_len:
                raise ValueError(f"sequence of {T} tokens, the model covers {self.cfg.seq_len}")
            x = self.tok_emb(x)
            if self.cfg.positions == "learned":
                x = x + self.pos_emb(torch.arange(T, device=x.device))
        rope = (self.rope_cos, self.rope_sin) if self.cfg.positions == "rope" else None
        for block in self.blocks.values():
            x = block(x, rope)
        if self.has_head:
            w = self.tok_emb.weight if self.tied else self.lm_head.weight
            x = F.linear(self.norm_f(x), w)
        return x

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


def init_weights(module: nn.Module, seed: int) -> None:
    """Initialize every parameter from its global name, so a stage gets exactly its slice of the whole model."""
    n_layers = getattr(module, "cfg").n_layers
    with torch.no_grad():
        for name, p in module.named_parameters():
            key = "tok_emb.weight" if name == "lm_head.weight" else name
            g = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(key.encode())) % 2**63)
            if "norm" in name:
                p.fill_(1.0)
            elif name.endswith(("attn.proj.weight", ".out.weight")):  # residual branches: scaled down with depth
                p.copy_(torch.randn(p.shape, generator=g) * (0.02 / math.sqrt(2 * n_layers)))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)


def build_model(cfg: GPTConfig, *, seed: int = 0) -> GPTStage:
    """The whole model as one stage."""
    return GPTStage(cfg, 0, cfg.n_layers, True, True, seed=seed)


def stage_ranges(n_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """Contiguous, balanced [first, last) layer ranges, earlier stages taking the remainder."""
    if not 1 <= num_stages <= n_layers:
        raise ValueError(f"cannot cut {n_layers} layers into {num_stages} stages")
    return even_split(n_layers, num_stages)


def build_stage(cfg: GPTConfig, stage: int, num_stages: int, *, seed: int = 0) -> GPTStage:
    """Stage `stage` of `num_stages`: the first holds the embedding, the last the head."""
    first, last = stage_ranges(cfg.n_layers, num_stages)[stage]
    return GPTStage(cfg, first, last, stage == 0, stage == num_stages - 1, seed=seed)


def lm_loss(logits_BTV: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits_BTV.float().flatten(0, 1), targets_BT.flatten())
