"""The device a node trains on: `auto` picks CUDA, then Apple's MPS, then the CPU; a named device must exist."""

from __future__ import annotations

import os

import torch


class DeviceUnavailable(ValueError):
    """The device asked for is not on this machine (the message says why)."""


def _mps_available() -> bool:
    mps = getattr(torch.backends, "mps", None)
    return bool(mps is not None and mps.is_available())


def _why_no_cuda() -> str:
    if torch.version.cuda is None:
        return "this torch build has no CUDA support (a CPU-only wheel)"
    if os.environ.get("CUDA_VISIBLE_DEVICES") is not None:
        return f"no CUDA device is visible (CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']!r})"
    return "torch sees no CUDA device (is the NVIDIA driver loaded?)"


def resolve_device(name: str = "auto") -> torch.device:
    """`auto` -> cuda, else mps, else cpu; `cpu`, `cuda`, `cuda:N`, `mps` -> that device if this machine has it.
    Raises DeviceUnavailable for a device that is not here, ValueError for a name torch does not know."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if _mps_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        dev = torch.device(name)
    except (RuntimeError, ValueError) as e:
        raise ValueError(f"--device {name!r} is not a device (auto, cpu, cuda, cuda:N or mps)") from e
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceUnavailable(f"--device {name}: CUDA is not available: {_why_no_cuda()}")
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise DeviceUnavailable(f"--device {name}: this machine has {count} CUDA device(s) (cuda:0 to "
                                    f"cuda:{count - 1})")
    elif dev.type == "mps":
        if not _mps_available():
            raise DeviceUnavailable(f"--device {name}: Apple's MPS is not available on this machine")
    elif dev.type != "cpu":
        raise DeviceUnavailable(f"--device {name}: shoal trains on cpu, cuda or mps")
    return dev


def _available_system_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def free_memory_bytes(dev: torch.device) -> int:
    """Memory free for training on `dev` now: the GPU's free memory, or the system's available memory."""
    if dev.type == "cuda":
        free, _total = torch.cuda.mem_get_info(dev)
        return int(free)
    if dev.type == "mps":  # unified memory: what the system has available, within Metal's recommended limit
        limit = torch.mps.recommended_max_memory() - torch.mps.driver_allocated_memory()
        return int(min(limit, _available_system_memory()))
    return _available_system_memory()


def device_name(dev: torch.device) -> str:
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    if dev.type == "mps":
        return "Apple GPU (MPS)"
    import platform

    return platform.processor() or platform.machine() or "cpu"


def half_activations(dev: torch.device) -> bool:
    """Whether the trainer keeps activations in 16 bits there (autocast on CUDA), for the memory estimate."""
    return dev.type == "cuda"
