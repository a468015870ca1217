"""A run's model out of shoal: the stages' states (checkpoints, one per stage) joined into the whole model and
written where other tools read it. A Hugging Face model becomes a folder `AutoModelForCausalLM.from_pretrained`
loads (config.json tied or untied as the run trained it, model.safetensors, the run's tokenizer.json). Each kind of
model has its writer in `WRITERS`; the built-in GPT's is left to the swarm-checkpoint work."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from shoal.protocol.hfconfig import parse_config
from shoal.protocol.manifest import RunManifest


class ExportError(ValueError):
    """The states given do not make the run's whole model; the message says what is missing or wrong."""


def whole_state(manifest: RunManifest, states: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """The whole model's tensors from one trainer state per stage (any order), each checked to be of this run."""
    S = manifest.plan.stages
    by_stage: dict[int, dict[str, Any]] = {}
    for st in states:
        if st.get("run_id") != manifest.run_id:
            raise ExportError(f"a checkpoint of run {str(st.get('run_id'))[:16]}…, not of {manifest.run_id[:16]}…")
        s = st.get("stage", 0)
        if s in by_stage:
            raise ExportError(f"two checkpoints of stage {s}")
        by_stage[s] = st
    missing = sorted(set(range(S)) - set(by_stage))
    if missing:
        raise ExportError(f"the run has {S} stages; no checkpoint of stage {', '.join(map(str, missing))}")
    steps = {by_stage[s]["step"] for s in range(S)}
    if len(steps) != 1:
        raise ExportError(f"the stages' checkpoints are of different steps ({sorted(steps)}): give one step's")
    out: dict[str, torch.Tensor] = {}
    for s in range(S):
        for k, v in by_stage[s]["model"].items():
            if k in out:
                raise ExportError(f"two stages hold {k}")
            out[k] = v.detach().cpu().contiguous()
    return out


def write_hf(manifest: RunManifest, state: dict[str, torch.Tensor], out: Path, tokenizer: Path | None) -> list[str]:
    """A Hugging Face model folder; returns the files written."""
    from safetensors.torch import save_file

    hf = manifest.model.hf
    tied = manifest.model.tied(manifest.plan.stages)
    config = parse_config(hf.config)
    config["tie_word_embeddings"] = tied
    config["dtype"] = "float32"
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    tmp = out / f".model.safetensors.{os.getpid()}.tmp"
    save_file(state, str(tmp), metadata={"format": "pt", "shoal_run": manifest.run_id})
    os.replace(tmp, out / "model.safetensors")
    files = ["config.json", "model.safetensors"]
    if tokenizer is not None:
        shutil.copyfile(tokenizer, out / "tokenizer.json")
        files.append("tokenizer.json")
    return files


def write_model(manifest: RunManifest, states: list[dict[str, Any]], out: Path, *,
                tokenizer: Path | None = None) -> list[str]:
    kind = "hf" if manifest.model.hf is not None else "gpt"
    writer = WRITERS.get(kind)
    if writer is None:
        raise ExportError(f"exporting the built-in GPT ({manifest.model.describe()}) is not supported yet; "
                          f"Hugging Face models (--model hf:PATH, --arch) export to a transformers folder")
    return writer(manifest, whole_state(manifest, states), out, tokenizer)


WRITERS: dict[str, Callable[[RunManifest, dict[str, torch.Tensor], Path, Path | None], list[str]]] = {"hf": write_hf}
