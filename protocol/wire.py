"""Strict msgpack encoding and field checks shared by every record and frame format."""

from __future__ import annotations

from typing import Any

import msgpack

from shoal.protocol.errors import DecodeError, FieldError, TooLargeError

#: the default ceiling for one encoded record; gossip keeps status records far below this
MAX_RECORD_BYTES = 64 * 1024


def pack(obj: Any) -> bytes:
    """Canonical msgpack: bin type for bytes, str for text, map keys in the order given."""
    return msgpack.packb(obj, use_bin_type=True)


def unpack(data: bytes | bytearray | memoryview, *, max_bytes: int = MAX_RECORD_BYTES) -> Any:
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
