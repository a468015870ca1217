"""Strict msgpack encoding and field checks shared by every record and frame format."""

from __future__ import annotations

import math
from typing import Any

import msgpack

from shoal.protocol.errors import DecodeError, FieldError, TooLargeError

#: the default ceiling for one encoded record; gossip keeps status records far below this
MAX_RECORD_BYTES = 64 * 1024


def pack(obj: Any) -> bytes:
    """Canonical msgpack: bin type for bytes, str for text, map keys in the order given."""
    return msgpack.packb(obj, use_bin_type=True)


def unpack(data: bytes, *, max_bytes: int = MAX_RECORD_BYTES) -> Any:
    """Decode msgpack from an untrusted peer with size limits on the whole and on every container."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise DecodeError(f"expected bytes, got {type(data).__name__}")
    if len(data) > max_bytes:
        raise TooLargeError(f"message of {len(data)} bytes exceeds the limit of {max_bytes}")
    try:
        return msgpack.unpackb(
            bytes(data),
            raw=False,
            strict_map_key=True,
            use_list=True,
            max_str_len=max_bytes,
            max_bin_len=max_bytes,
            max_array_len=4096,
            max_map_len=256,
            max_ext_len=0,
        )
    except (msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, ValueError, TypeError) as e:
        raise DecodeError(f"not valid msgpack: {e}") from e
    except Exception as e:  # msgpack raises a few others (e.g. UnicodeDecodeError subclasses ValueError)
        raise DecodeError(f"not valid msgpack: {type(e).__name__}: {e}") from e


def expect_map(obj: Any, what: str) -> dict:
    if not isinstance(obj, dict):
        raise DecodeError(f"{what}: expected a map, got {type(obj).__name__}")
    return obj


def get_field(m: dict, name: str, kind: type | tuple[type, ...], *, default: Any = ..., what: str = "") -> Any:
    """Read one field with an exact type check (bool is never accepted as int, int is accepted as float)."""
    if name not in m:
        if default is ...:
            raise FieldError(name, "missing")
        return default
    v = m[name]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if float in kinds and isinstance(v, int) and not isinstance(v, bool):
        v = float(v)
    if isinstance(v, bool) and bool not in kinds:
        raise FieldError(name, f"expected {_names(kinds)}, got bool")
    if not isinstance(v, kinds):
        raise FieldError(name, f"expected {_names(kinds)}, got {type(v).__name__}")
    return v


def _names(kinds: tuple[type, ...]) -> str:
    return " or ".join(k.__name__ for k in kinds)


def check_int(name: str, v: int, lo: int, hi: int) -> int:
    if not isinstance(v, int) or isinstance(v, bool):
        raise FieldError(name, f"expected int, got {type(v).__name__}")
    if not lo <= v <= hi:
        raise FieldError(name, f"{v} outside [{lo}, {hi}]")
    return v


def check_float(name: str, v: float, lo: float, hi: float) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise FieldError(name, f"expected float, got {type(v).__name__}")
    v = float(v)
    if not math.isfinite(v) or not lo <= v <= hi:
        raise FieldError(name, f"{v} outside [{lo}, {hi}] or not finite")
    return v


def check_str(name: str, v: str, max_len: int, *, allow_empty: bool = True) -> str:
    if not isinstance(v, str):
        raise FieldError(name, f"expected str, got {type(v).__name__}")
    if len(v) > max_len:
        raise FieldError(name, f"longer than {max_len} characters")
    if not allow_empty and not v:
        raise FieldError(name, "empty")
    return v


def check_bytes(name: str, v: bytes, max_len: int, *, exact: int | None = None) -> bytes:
    if not isinstance(v, (bytes, bytearray)):
        raise FieldError(name, f"expected bytes, got {type(v).__name__}")
    if exact is not None and len(v) != exact:
        raise FieldError(name, f"expected exactly {exact} bytes, got {len(v)}")
    if len(v) > max_len:
        raise FieldError(name, f"longer than {max_len} bytes")
    return bytes(v)


def check_choice(name: str, v: str, choices: frozenset[str] | tuple[str, ...]) -> str:
    if v not in choices:
        raise FieldError(name, f"{v!r} is not one of {sorted(choices)}")
    return v
