"""What a node checks before it asks for a place in a run: data it may read, a stage that fits its device."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from shoal.protocol.manifest import RunManifest

if TYPE_CHECKING:
    from shoal.node.run.config import RunConfig
    from shoal.node.train.memory import StageMemory


class RunError(RuntimeError):
    """The run cannot go on on this node (e.g. no stage fits its device); the message says why."""


class UnknownRun(RunError, ConnectionError):
    """No joined peer knows the run (its manifest or its broker)."""


class NotTheOwner(UnknownRun):
    """Nobody knows the run, and this node may not start it: only the identity that signed its manifest may."""


class DoesNotFit(RunError):
    """The run's stage needs more memory than the device has free."""


class UntrustedData(RunError):
    """A manifest from the network names data this node may not read on its word (a local path, a path as a name)."""


#: a dataset by name, as a hub names it ("owner/name"): never a path on this machine
DATASET_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,95}(/[A-Za-z0-9][A-Za-z0-9_.-]{0,95})?")


def data_source(manifest: RunManifest, config: RunConfig) -> str:
    """Where this node reads the run's tokens. A manifest from the network (a run joined by id) may name the built-in
    corpus or a dataset by name only: a local path would make this node read (and train on, and so leak into the
    model) whatever file the run's owner chose. Such a run needs the volunteer's own `--data PATH`, which then
    replaces the manifest's path; a manifest file the volunteer passed itself may name a path."""
    src = manifest.data.source
    if src == "stdlib":
        return src
    from_network = config.manifest is None
    if src.startswith("hf:"):
        name = src[3:]
        if from_network and (not DATASET_NAME.fullmatch(name) or ".." in name):
            raise UntrustedData(f"run {manifest.run_id[:16]}… names dataset {name!r}, which is not a dataset name "
                                f"(owner/name)")
        return src
    if config.data is not None:
        return config.data
    if from_network:
        raise UntrustedData(f"run {manifest.run_id[:16]}… reads its data from a local path ({src!r}); a node that "
                            f"joins a run by id reads only the files it is told to: shoal node --data PATH")
    return src


def check_inputs(manifest: RunManifest, source: str) -> None:
    """Before asking for a place: the packages the run's model and tokenizer need, and its data source (a Hugging
    Face dataset: the package, the Hub, the dataset, its split and column). Raises DataUnavailable (one line with
    the fix)."""
    from shoal.node.train.datacheck import INSTALL_HINT, DataUnavailable, check_source

    needs = []
    if manifest.model.hf is not None:
        needs += ["transformers", "safetensors"]
    if manifest.data.tokenizer != "bytes":
        needs.append("tokenizers")
    import importlib.util

    missing = [n for n in needs if importlib.util.find_spec(n) is None]
    if missing:
        raise DataUnavailable(f"run {manifest.run_id[:16]}… ({manifest.model.describe()}) needs "
                              f"{', '.join(missing)}: {INSTALL_HINT}")
    d = manifest.data
    check_source(source, hf_config=d.hf_config, hf_split=d.hf_split, text_field=d.text_field)


def stage_need(manifest: RunManifest, device: str, stage: int = 0) -> StageMemory:
    """The memory estimate for training `stage` of the run on `device` (16-bit activations on CUDA)."""
    from shoal.node.train.memory import stage_memory

    return stage_memory(manifest, stage, half=device.startswith("cuda"))


def check_fits(manifest: RunManifest, device: str, free_bytes: int | None, stage: int = 0) -> StageMemory:
    need = stage_need(manifest, device, stage)
    if free_bytes is not None and not need.fits(free_bytes):
        what = f"stage {stage} of the" if manifest.plan.stages > 1 else "the"
        raise DoesNotFit(f"run {manifest.run_id[:16]}…: {what} {manifest.model.describe()} model "
                         f"({need.params / 1e6:.1f}M params, micro-batch {manifest.batch.micro_batch_size}) needs "
                         f"~{need.total_bytes / 1e9:.2f} GB on {device}, which has {free_bytes / 1e9:.2f} GB free")
    return need


def preflight(manifest: RunManifest, config: RunConfig) -> StageMemory:
    """Raise DoesNotFit when no stage of the run fits this node's device (the broker places a
    node only in a stage it has the memory for); else the estimate for the smallest stage."""
    needs = [stage_need(manifest, config.device, s) for s in range(manifest.plan.stages)]
    smallest = min(range(len(needs)), key=lambda s: needs[s].total_bytes)
    return check_fits(manifest, config.device, config.device_free_bytes, stage=smallest)
