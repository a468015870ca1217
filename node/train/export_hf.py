"""A Hugging Face model taken out of shoal: a pipeline's stages (their model state dicts, in stage order) merged
into the whole model and written as a folder `AutoModelForCausalLM.from_pretrained` loads: config.json (its head
tied or untied as the run trained it), model.safetensors (fp32) and the run's tokenizer.json. The exporter for
`size = "hf"` manifests, with the interface of the built-in GPT's (`export(manifest, stages, out, step=, source=)`)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from shoal.protocol.hfconfig import parse_config
from shoal.protocol.manifest import RunManifest

ARCHITECTURE = "hf"
CONFIG_FILE, WEIGHTS_FILE, TOKENIZER_FILE = "config.json", "model.safetensors", "tokenizer.json"


class ExportError(ValueError):
    """The states given do not make the run's whole model; the message says what is missing or wrong."""


def merge_stages(manifest: RunManifest, stages: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The whole model's tensors from each stage's model state dict (in stage order), checked against the modules
    the manifest describes."""
    from shoal.node.train.stages import build_stage_model

    if len(stages) != manifest.plan.stages:
        raise ExportError(f"{len(stages)} stages given, the run has {manifest.plan.stages}")
    out: dict[str, torch.Tensor] = {}
    for i, sd in enumerate(stages):
        want = build_stage_model(manifest, i, initial=False).state_dict()
        missing, extra = set(want) - set(sd), set(sd) - set(want)
        if missing or extra:
            raise ExportError(f"stage {i}'s state is not the run's stage {i}: missing {sorted(missing)[:3]}, extra "
                              f"{sorted(extra)[:3]}")
        for k, v in sd.items():
            if tuple(v.shape) != tuple(want[k].shape):
                raise ExportError(f"{k}: shape {tuple(v.shape)}, the model has {tuple(want[k].shape)}")
            out[k] = v.detach().to("cpu", torch.float32).contiguous()
    return out


def export(manifest: RunManifest, stages: list[dict[str, torch.Tensor]], out: Path, *, step: int, source: str = "",
           tokenizer: Path | None = None) -> list[Path]:
    """Write the merged model to `out` (created); `tokenizer`: the run's tokenizer.json (from the blob store)."""
    from safetensors.torch import save_file

    if manifest.model.hf is None:
        raise ExportError("not a Hugging Face model (the built-in GPT has its own exporter)")
    weights = merge_stages(manifest, stages)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = parse_config(manifest.model.hf.config)
    config["tie_word_embeddings"] = manifest.model.tied(manifest.plan.stages)
    config["dtype"] = "float32"
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    tmp = out / f".{WEIGHTS_FILE}.{os.getpid()}.tmp"
    meta = {"format": "pt", "shoal_run": manifest.run_id, "step": str(step), "source": source[:200]}
    save_file(weights, str(tmp), metadata=meta)
    os.replace(tmp, out / WEIGHTS_FILE)
    files = [out / CONFIG_FILE, out / WEIGHTS_FILE]
    if tokenizer is not None:
        shutil.copyfile(tokenizer, out / TOKENIZER_FILE)
        files.append(out / TOKENIZER_FILE)
    return files
