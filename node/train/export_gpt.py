"""The built-in GPT taken out of shoal: a pipeline's stages merged into the whole model (parameter names are global,
so the stages' state dicts are slices of it) and written as model.safetensors with a config.json and a README that
loads it; `load` reads such a folder back. `shoal export` picks this module for the built-in architecture."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from shoal.node.train.model import GPTConfig, GPTStage, build_model
from shoal.node.train.stages import trained_weights
from shoal.protocol.manifest import RunManifest

ARCHITECTURE = "shoal-gpt"
CONFIG_FILE, WEIGHTS_FILE, README_FILE = "config.json", "model.safetensors", "README.md"

LOADING = '''\
```python
import json, torch
from safetensors.torch import load_file
from shoal.node.train.model import GPTConfig, build_model

cfg = json.load(open("{out}/config.json"))
model = build_model(GPTConfig(**cfg["model"]))
model.load_state_dict(load_file("{out}/model.safetensors"))
tokens = torch.tensor([list("def hello():".encode())])      # byte tokens: ids 0-255
logits = model.eval()(tokens)                                # (batch, tokens, 256)
```
'''


def model_config(manifest: RunManifest) -> GPTConfig:
    """The whole model's shape as the run trained it (tied head only when one stage held both ends)."""
    base = GPTConfig.from_spec(manifest.model, manifest.batch.seq_len)
    return GPTConfig(**{**{f: getattr(base, f) for f in GPTConfig.__dataclass_fields__},
                        "tie_embeddings": manifest.model.tied(manifest.plan.stages)})


def stage_weights(manifest: RunManifest, stage: int, state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """One stage's weights from its checkpointed state, a round still in flight applied (node/train/stages.py)."""
    return trained_weights(manifest, stage, state)


def merge_stages(manifest: RunManifest, stages: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The whole model's state dict from each stage's (in stage order); ValueError when they do not make exactly
    the model the manifest describes."""
    if len(stages) != manifest.plan.stages:
        raise ValueError(f"{len(stages)} stages given, the run has {manifest.plan.stages}")
    merged: dict[str, torch.Tensor] = {}
    for i, sd in enumerate(stages):
        for k, v in sd.items():
            if k in merged:
                raise ValueError(f"stage {i} holds {k!r}, which an earlier stage holds too")
            merged[k] = v.detach().to("cpu").contiguous()
    want = build_model(model_config(manifest)).state_dict()
    missing, extra = set(want) - set(merged), set(merged) - set(want)
    if missing or extra:
        raise ValueError(f"the stages do not make the model: missing {sorted(missing)[:4]}, extra {sorted(extra)[:4]}")
    for k, v in want.items():
        if merged[k].shape != v.shape:
            raise ValueError(f"{k}: shape {tuple(merged[k].shape)}, the model has {tuple(v.shape)}")
    return merged


def export(manifest: RunManifest, stages: list[dict[str, torch.Tensor]], out: Path, *, step: int,
           source: str = "") -> list[Path]:
    """Write the merged model to `out` (created): weights, config and a README with the loading snippet."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    weights = merge_stages(manifest, stages)
    cfg = model_config(manifest)
    meta = {"architecture": ARCHITECTURE, "run_id": manifest.run_id, "run_name": manifest.name, "step": step,
            "tokenizer": manifest.data.tokenizer, "dtype": "float32"}
    save_file(weights, str(out / WEIGHTS_FILE), metadata={k: str(v) for k, v in meta.items()})
    doc: dict[str, Any] = {**meta, "model": {f: getattr(cfg, f) for f in GPTConfig.__dataclass_fields__},
                           "parameters": sum(v.numel() for k, v in weights.items()), "source": source}
    (out / CONFIG_FILE).write_text(json.dumps(doc, indent=1) + "\n")
    (out / README_FILE).write_text(
        f"# {manifest.name}: shoal's built-in GPT, step {step}\n\n"
        f"Run {manifest.run_id}; {doc['parameters']:,} parameters; byte tokens (ids 0-255, no tokenizer file "
        f"needed).\n`config.json` holds the model's shape under `model`; `model.safetensors` its weights (float32).\n\n"
        f"Load it (needs `pip install shoal safetensors`):\n\n" + LOADING.format(out=out.resolve()))
    return [out / WEIGHTS_FILE, out / CONFIG_FILE, out / README_FILE]


def load(folder: Path) -> GPTStage:
    """The model an export folder holds (what the README's snippet does)."""
    folder = Path(folder)
    cfg = json.loads((folder / CONFIG_FILE).read_text())
    if cfg.get("architecture") != ARCHITECTURE:
        raise ValueError(f"{folder} holds a {cfg.get('architecture')!r} model, not {ARCHITECTURE}")
    model = build_model(GPTConfig(**cfg["model"]))
    model.load_state_dict(load_file(str(folder / WEIGHTS_FILE)))
    return model.eval()
