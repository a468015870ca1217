"""Hugging Face causal LMs (Llama, Mistral, Qwen2, Qwen3, GPT-2) cut into layer-range stages, built from
`transformers`' own modules: the decoder layers, embeddings, norms and rotary tables are the library's, so a stage
computes what the library's model computes; shoal adds only the cut. Parameter names are the library's
(`model.layers.5.self_attn.q_proj.weight` in every stage), so a stage's state_dict is a slice of the whole model's
and the whole model loads with `AutoModelForCausalLM.from_pretrained` after export.

Ends as in the built-in GPT (node/train/model.py): the first stage holds the embeddings, the last the final norm
and the head; the head is the embedding matrix only when one stage holds both and the config ties them, else its
own `lm_head.weight`, initialized (or loaded) equal to the embedding. Attention is always PyTorch's SDPA with the
causal mask `transformers` builds; the manifest refuses sequences longer than a sliding window.

Needs the optional `transformers` and `safetensors` packages (`pip install 'shoal[hf]'`).
"""

from __future__ import annotations

import math
import zlib
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from shoal.node.train.optional import require_transformers
from shoal.protocol.hfconfig import HFShape, parse_config
from shoal.protocol.manifest import HFModelSpec


def hf_config(spec: HFModelSpec):
    """The `transformers` config of the spec, set to SDPA attention and no key/value cache."""
    transformers = require_transformers()
    d = parse_config(spec.config)
    mt = d.pop("model_type")
    for k in ("architectures", "attn_implementation", "_attn_implementation"):
        d.pop(k, None)
    cfg = transformers.AutoConfig.for_model(mt, **d)
    cfg._attn_implementation = "sdpa"
    cfg.use_cache = False
    return cfg


def _skeleton(cfg) -> nn.Module:
    """The whole model on the meta device: its modules, no memory."""
    transformers = require_transformers()
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(cfg)


class HFStage(nn.Module):
    """Layers [first_layer, last_layer) of a Hugging Face causal LM, with its embeddings and/or its head.

    Input: token ids (B, T) at the first stage, else hidden states (B, T, D); output: logits (B, T, vocab) at
    the last stage, else hidden states."""

    def __init__(self, spec: HFModelSpec, first_layer: int, last_layer: int, has_embedding: bool, has_head: bool,
                 *, tied: bool, seed: int = 0):
        super().__init__()
        self.shape: HFShape = spec.shape
        if not 0 <= first_layer <= last_layer <= self.shape.layers:
            raise ValueError(f"bad layer range [{first_layer}, {last_layer}) for {self.shape.layers} layers")
        self.config = hf_config(spec)
        self.first_layer, self.last_layer = first_layer, last_layer
        self.has_embedding, self.has_head = has_embedding, has_head
        self.tied = tied and has_embedding and has_head
        whole = _skeleton(self.config)
        gpt2 = self.shape.family == "gpt2"
        src = whole.transformer if gpt2 else whole.model
        body = nn.Module()  # `model` or `transformer`: the names the library's checkpoints use, in its order
        if has_embedding:
            body.add_module("wte" if gpt2 else "embed_tokens", src.wte if gpt2 else src.embed_tokens)
            if gpt2:
                body.wpe, body.drop = src.wpe, src.drop
        layers = src.h if gpt2 else src.layers
        body.add_module("h" if gpt2 else "layers",
                        nn.ModuleDict({str(i): layers[i] for i in range(first_layer, last_layer)}))
        if has_head:
            body.add_module("ln_f" if gpt2 else "norm", src.ln_f if gpt2 else src.norm)
        self.add_module("transformer" if gpt2 else "model", body)
        if has_head and not self.tied:
            self.lm_head = nn.Linear(self.shape.d_model, self.shape.vocab, bias=False, device="meta")
        if any(True for _ in self.buffers()):
            raise NotImplementedError(f"{self.shape.model_type}: a layer holds buffers shoal does not rebuild")
        self.to_empty(device="cpu")
        # the rotary tables are buffers computed from the config, not state: built for real (the skeleton's are meta)
        self.rotary_emb = None if gpt2 else type(src.rotary_emb)(config=self.config)
        init_hf_weights(self, self.shape, self.config, seed)

    # -- the parts, whatever the family calls them
    @property
    def body(self) -> nn.Module:
        return self.transformer if self.shape.family == "gpt2" else self.model

    @property
    def layers(self) -> nn.ModuleDict:
        return self.body.h if self.shape.family == "gpt2" else self.body.layers

    @property
    def embedding(self) -> nn.Embedding:
        return self.body.wte if self.shape.family == "gpt2" else self.body.embed_tokens

    @property
    def final_norm(self) -> nn.Module:
        return self.body.ln_f if self.shape.family == "gpt2" else self.body.norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask

        T = x.shape[1]
        if T > self.shape.max_positions:
            raise ValueError(f"sequence of {T} tokens, the model covers {self.shape.max_positions}")
        pos = torch.arange(T, device=x.device).unsqueeze(0)
        if self.has_embedding:
            h = self.embedding(x)
            if self.shape.family == "gpt2":
                h = self.body.drop(h + self.body.wpe(pos))
        else:
            h = x
        mask = create_causal_mask(config=self.config, inputs_embeds=h, attention_mask=None, cache=None,
                                  position_ids=pos)
        rope = self.rotary_emb(h, pos) if self.rotary_emb is not None else None
        for layer in self.layers.values():
            out = layer(h, attention_mask=mask) if rope is None else \
                layer(h, attention_mask=mask, position_ids=pos, position_embeddings=rope)
            h = out[0] if isinstance(out, tuple) else out
        if self.has_head:
            w = self.embedding.weight if self.tied else self.lm_head.weight
            h = F.linear(self.final_norm(h), w)
        return h

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    @property
    def embedding_name(self) -> str:
        return "transformer.wte.weight" if self.shape.family == "gpt2" else "model.embed_tokens.weight"

    def load_weights(self, path: Path) -> None:
        """This stage's tensors from a safetensors file of the whole model (checked by hash before this), as fp32.
        A file of a tied model has no `lm_head.weight`: an untied head starts as the embedding."""
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            keys = set(f.keys())
            missing = []
            with torch.no_grad():
                for name, p in self.named_parameters():
                    key = name if name in keys else (self.embedding_name if name == "lm_head.weight" else None)
                    if key not in keys:
                        missing.append(name)
                        continue
                    t = f.get_tensor(key)
                    if tuple(t.shape) != tuple(p.shape):
                        raise ValueError(f"weights: {key} has shape {tuple(t.shape)}, the model's is {tuple(p.shape)}")
                    p.copy_(t.to(p.dtype))
        if missing:
            raise ValueError(f"weights: {len(missing)} tensors of this stage are missing, e.g. {missing[:3]}")


def init_hf_weights(stage: HFStage, shape: HFShape, config, seed: int) -> None:
    """Initialize every parameter from its global name and the run's seed (as the library does: normal with the
    config's initializer_range for matrices and embeddings, zero biases, unit norms; GPT-2's residual projections
    scaled by 1/sqrt(2 layers)), so a stage gets exactly its slice of the whole model."""
    std = float(getattr(config, "initializer_range", 0.02))
    matrices = {id(m.weight) for m in stage.modules() if isinstance(m, (nn.Linear, nn.Embedding))
                or type(m).__name__ == "Conv1D"}
    with torch.no_grad():
        for name, p in stage.named_parameters():
            key = stage.embedding_name if name == "lm_head.weight" else name
            g = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(key.encode())) % 2**63)
            if id(p) in matrices:
                s = std / math.sqrt(2 * shape.layers) if shape.family == "gpt2" and name.endswith("c_proj.weight") else std
                p.copy_(torch.randn(p.shape, generator=g) * s)
            elif name.endswith("bias"):
                p.zero_()
            else:  # a norm's scale
                p.fill_(1.0)
        pad = getattr(config, "pad_token_id", None)
        if stage.has_embedding and isinstance(pad, int) and 0 <= pad < shape.vocab:
            stage.embedding.weight[pad].zero_()
            if stage.has_head and not stage.tied:
                stage.lm_head.weight[pad].zero_()
