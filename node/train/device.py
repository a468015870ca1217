"""The device a node trains on: `auto` picks CUDA, then Apple's MPS, then the CPU; a named device must exist. And
what a trainer needs of it: host-to-device copies through reused pinned buffers, its passes timed without holding
it back."""

from __future__ import annotations

import os
from collections import deque
from typing import Any

import torch

SPEED_STEPS = 16  # a lane's compute speed is the median over this many recent steps


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


class PinnedRing:
    """Page-locked host buffers reused round-robin for asynchronous copies (allocating pinned memory each step
    costs more than the copy): a buffer is reused only once the copy that last used it has finished."""

    SLOTS = 8

    def __init__(self) -> None:
        self._bufs: dict[tuple, list[list]] = {}  # (shape, dtype) -> [buffer, event or None] per slot
        self._next: dict[tuple, int] = {}

    def take(self, like: torch.Tensor) -> torch.Tensor:
        key = (tuple(like.shape), like.dtype)
        ring = self._bufs.setdefault(key, [])
        if len(ring) < self.SLOTS:
            ring.append([torch.empty(like.shape, dtype=like.dtype, pin_memory=True), None])
            return ring[-1][0]
        i = self._next[key] = (self._next.get(key, -1) + 1) % self.SLOTS
        buf, event = ring[i]
        if event is not None:
            event.synchronize()  # long done in practice: the slot was used SLOTS copies ago
        return buf

    def used(self, buf: torch.Tensor, event) -> None:
        for slot in self._bufs.get((tuple(buf.shape), buf.dtype), ()):
            if slot[0] is buf:
                slot[1] = event

    def to_device(self, x: torch.Tensor, device: torch.device) -> torch.Tensor:
        """`x` copied to `device` asynchronously, through a pinned buffer."""
        buf = self.take(x)
        buf.copy_(x)
        out = buf.to(device, non_blocking=True)
        event = torch.cuda.Event()
        event.record()  # after the copy: once it has happened, the buffer may be written again
        self.used(buf, event)
        return out


class SpeedMeter:
    """This stage's own compute speed: sequences per second of its forward and backward passes (waits for lane
    neighbours left out), the median of the last SPEED_STEPS steps. On a GPU a step's time is read from CUDA events
    once they have passed (the next step), so measuring never holds the device back."""

    def __init__(self) -> None:
        self._rates: deque[float] = deque(maxlen=SPEED_STEPS)
        self._pending: deque[tuple[int, float, Any, Any]] = deque()  # (sequences, waits in s, start event, end event)

    def add(self, samples: int, seconds: float) -> None:
        if samples > 0 and seconds > 0:
            self._rates.append(samples / seconds)

    def add_events(self, samples: int, waits_s: float, start, end) -> None:
        self._pending.append((samples, waits_s, start, end))
        while self._pending and self._pending[0][3].query():
            n, w, a, b = self._pending.popleft()
            self.add(n, a.elapsed_time(b) / 1000.0 - w)

    def rate(self) -> float:
        """Sequences per second (0 before the first step)."""
        if not self._rates:
            return 0.0
        s = sorted(self._rates)
        return s[len(s) // 2]
