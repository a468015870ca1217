"""A replica's state as named tensors plus a plain skeleton (no pickle), its hash, and frozen snapshots of it."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch

from shoal.kernels.codec import dtype_name
from shoal.protocol.dtypes import ITEMSIZE
from shoal.protocol.wire import pack

#: the element types a state may hold (protocol.dtypes' table) as torch dtypes
DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in ITEMSIZE}
HASH_CHARS = 32  # a tensor digest's length (hex characters): what status records and votes carry


class StateTransferError(RuntimeError):
    """A pull failed: the peer refused, vanished, was too slow, or sent something invalid (nothing was loaded)."""


def flatten_state(state: Any) -> tuple[dict[str, torch.Tensor], Any]:
    """Split a nested state (e.g. Trainer.state_dict()) into named tensors and a msgpack-able skeleton.

    Tensors become {"__t": name}; tuples {"__tuple": [...]}; maps with non-str (or "__") keys {"__map": [[k, v]]}.
    """
    tensors: dict[str, torch.Tensor] = {}

    def walk(v: Any, path: str) -> Any:
        if isinstance(v, torch.Tensor):
            if dtype_name(v.dtype) not in DTYPES:
                raise TypeError(f"{path}: dtype {v.dtype} cannot be transferred")
            tensors[path] = v.detach().cpu()
            return {"__t": path}
        if v is None or isinstance(v, (bool, int, float, str, bytes)):
            return v
        if isinstance(v, tuple):
            return {"__tuple": [walk(x, f"{path}/{i}") for i, x in enumerate(v)]}
        if isinstance(v, list):
            return [walk(x, f"{path}/{i}") for i, x in enumerate(v)]
        if isinstance(v, dict):
            if all(isinstance(k, str) and not k.startswith("__") for k in v):
                return {k: walk(x, f"{path}/{k}") for k, x in v.items()}
            return {"__map": [[k, walk(x, f"{path}/{k}")] for k, x in v.items()]}
        raise TypeError(f"{path}: {type(v).__name__} cannot be transferred")

    return tensors, walk(state, "")


def unflatten_state(tensors: dict[str, torch.Tensor], skeleton: Any) -> Any:
    def walk(v: Any) -> Any:
        if isinstance(v, list):
            return [walk(x) for x in v]
        if isinstance(v, dict):
            if set(v) == {"__t"}:
                if v["__t"] not in tensors:
                    raise StateTransferError(f"state names a tensor it did not send: {str(v['__t'])[:80]!r}")
                return tensors[v["__t"]]
            if set(v) == {"__tuple"} and isinstance(v["__tuple"], list):
                return tuple(walk(x) for x in v["__tuple"])
            if set(v) == {"__map"} and isinstance(v["__map"], list):
                out = {}
                for kv in v["__map"]:
                    if not isinstance(kv, list) or len(kv) != 2 or isinstance(kv[0], (list, dict)):
                        raise StateTransferError("malformed map entry in the state")
                    out[kv[0]] = walk(kv[1])
                return out
            return {k: walk(x) for k, x in v.items()}
        return v

    try:
        return walk(skeleton)
    except RecursionError:
        raise StateTransferError("state nested too deeply") from None


def tensor_refs(skeleton: Any) -> set[str]:
    """The names of the tensors a skeleton refers to."""
    out: set[str] = set()

    def walk(v: Any) -> None:
        if isinstance(v, list):
            for x in v:
                walk(x)
        elif isinstance(v, dict):
            if set(v) == {"__t"} and isinstance(v["__t"], str):
                out.add(v["__t"])
            else:
                for x in v.values():
                    walk(x)

    walk(skeleton)
    return out


def raw_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def state_hash(tensors: dict[str, torch.Tensor], skeleton: Any = None) -> str:
    """sha256 over every tensor's name, dtype, shape and bytes (sorted by name), then the plain values."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name]
        h.update(pack([name, dtype_name(t.dtype), list(t.shape)]))
        if t.numel():
            h.update(raw_bytes(t))
    h.update(pack(skeleton))
    return h.hexdigest()


def hash_tensor(x: torch.Tensor, name: str = "") -> str:
    """A short digest of one tensor (a synchronizer's shared state): `state_hash` of it alone, truncated."""
    return state_hash({name: x.detach().cpu()})[:HASH_CHARS]


@dataclass(frozen=True, kw_only=True, slots=True)
class Snapshot:
    """A frozen copy of a replica's state at `revision` (its synchronized step), with its hash."""

    tensors: dict[str, torch.Tensor]
    skeleton: Any
    revision: int
    hash: str

    @classmethod
    def of(cls, state: Any, revision: int, *, copy: bool = True, hashed: bool = True) -> Snapshot:
        """A snapshot of `state`; its tensors are cloned (training goes on while this is served) unless `copy` is
        False, for a state that is already a private copy. Unless `hashed`, its hash is left for later ("": see
        `hashed()`), so that a snapshot taken between steps for disk or shards is hashed off the step path."""
        tensors, skeleton = flatten_state(state)
        if copy:
            tensors = {k: v.clone() for k, v in tensors.items()}
        return cls(tensors=tensors, skeleton=skeleton, revision=revision,
                   hash=state_hash(tensors, skeleton) if hashed else "")

    def hashed(self) -> Snapshot:
        """This snapshot with its hash (itself when it has one already); hashing a big state takes a while: call it
        from a worker thread."""
        if self.hash:
            return self
        return Snapshot(tensors=self.tensors, skeleton=self.skeleton, revision=self.revision,
                        hash=state_hash(self.tensors, self.skeleton))

    def state(self, *, copy: bool = False) -> Any:
        """The state; with `copy`, on tensors of its own, for a state something will go on changing (a loaded
        optimizer keeps the tensors it is given, a synchronizer too): the snapshot stays as its hash names it, for
        it may be served by that hash afterwards."""
        tensors = {k: v.clone() for k, v in self.tensors.items()} if copy else self.tensors
        return unflatten_state(tensors, self.skeleton)

    def only(self, prefixes: tuple[str, ...]) -> Snapshot:
        """The tensors whose names start with one of `prefixes`, with the whole skeleton (a partial snapshot)."""
        tensors = {k: v for k, v in self.tensors.items() if k.startswith(prefixes)}
        return Snapshot(tensors=tensors, skeleton=self.skeleton, revision=self.revision,
                        hash=state_hash(tensors, self.skeleton))

    def missing(self, *bases: Snapshot) -> set[str]:
        """Tensors the skeleton names that neither this partial snapshot nor `bases` hold."""
        have = set(self.tensors).union(*(b.tensors for b in bases))
        return tensor_refs(self.skeleton) - have

    def merged(self, *bases: Snapshot) -> Snapshot:
        """This partial snapshot completed with `bases`' other tensors (later bases win; a backup's warm copy
        first); raises StateTransferError when the skeleton names a tensor none of them holds."""
        tensors: dict[str, torch.Tensor] = {}
        for b in bases:
            tensors.update(b.tensors)
        tensors.update(self.tensors)
        unflatten_state(tensors, self.skeleton)
        return Snapshot(tensors=tensors, skeleton=self.skeleton, revision=self.revision,
                        hash=state_hash(tensors, self.skeleton))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())
