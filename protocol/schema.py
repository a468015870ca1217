"""Declarative field checks for wire records: one spec per dataclass field, used on both encode and decode."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, ClassVar, Self

from shoal.protocol.errors import DecodeError, FieldError


class Spec:
    """Checks and normalizes one field value; raises FieldError naming the field."""

    def check(self, name: str, v: Any) -> Any:  # pragma: no cover - interface
        raise NotImplementedError

    def to_wire(self, v: Any) -> Any:
        return v


@dataclass(frozen=True, slots=True)
class Str(Spec):
    max_len: int = 256
    allow_empty: bool = True

    def check(self, name, v):
        if not isinstance(v, str):
            raise FieldError(name, f"expected str, got {type(v).__name__}")
        if len(v) > self.max_len:
            raise FieldError(name, f"longer than {self.max_len} characters")
        if not self.allow_empty and not v:
            raise FieldError(name, "empty")
        return v


@dataclass(frozen=True, slots=True)
class Int(Spec):
    lo: int = 0
    hi: int = 2**63 - 1

    def check(self, name, v):
        if isinstance(v, bool) or not isinstance(v, int):
            raise FieldError(name, f"expected int, got {type(v).__name__}")
        if not self.lo <= v <= self.hi:
            raise FieldError(name, f"{v} outside [{self.lo}, {self.hi}]")
        return v


@dataclass(frozen=True, slots=True)
class Float(Spec):
    lo: float = 0.0
    hi: float = 1e30

    def check(self, name, v):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise FieldError(name, f"expected a number, got {type(v).__name__}")
        v = float(v)
        if not math.isfinite(v):
            raise FieldError(name, "not finite")
        if not self.lo <= v <= self.hi:
            raise FieldError(name, f"{v} outside [{self.lo}, {self.hi}]")
        return v


@dataclass(frozen=True, slots=True)
class Bool(Spec):
    def check(self, name, v):
        if not isinstance(v, bool):
            raise FieldError(name, f"expected bool, got {type(v).__name__}")
        return v


@dataclass(frozen=True, slots=True)
class Bytes(Spec):
    max_len: int = 1024
    exact: int | None = None

    def check(self, name, v):
        if not isinstance(v, (bytes, bytearray)):
            raise FieldError(name, f"expected bytes, got {type(v).__name__}")
        if self.exact is not None and len(v) != self.exact:
            raise FieldError(name, f"expected {self.exact} bytes, got {len(v)}")
        if len(v) > self.max_len:
            raise FieldError(name, f"longer than {self.max_len} bytes")
        return bytes(v)


@dataclass(frozen=True, slots=True)
class Choice(Spec):
    choices: frozenset[str]

    def check(self, name, v):
        if not isinstance(v, str) or v not in self.choices:
            raise FieldError(name, f"{v!r} is not one of {sorted(self.choices)}")
        return v


@dataclass(frozen=True, slots=True)
class Optional(Spec):
    inner: Spec

    def check(self, name, v):
        return None if v is None else self.inner.check(name, v)

    def to_wire(self, v):
        return None if v is None else self.inner.to_wire(v)


@dataclass(frozen=True, slots=True)
class Seq(Spec):
    inner: Spec
    max_items: int = 64

    def check(self, name, v):
        if not isinstance(v, (list, tuple)):
            raise FieldError(name, f"expected a list, got {type(v).__name__}")
        if len(v) > self.max_items:
            raise FieldError(name, f"more than {self.max_items} items")
        return tuple(self.inner.check(f"{name}[{i}]", x) for i, x in enumerate(v))

    def to_wire(self, v):
        return [self.inner.to_wire(x) for x in v]


@dataclass(frozen=True, slots=True)
class Nested(Spec):
    cls: type

    def check(self, name, v):
        if isinstance(v, self.cls):
            return v
        if not isinstance(v, dict):
            raise FieldError(name, f"expected a map, got {type(v).__name__}")
        try:
            return self.cls.from_wire(v)
        except FieldError as e:
            raise FieldError(f"{name}.{e.field}", e.problem) from e

    def to_wire(self, v):
        return v.to_wire()


_FIELDS: dict[type, tuple[dataclasses.Field, ...]] = {}


def _fields(cls: type) -> tuple[dataclasses.Field, ...]:
    """A record class's fields (dataclasses.fields builds the tuple anew on every call: ~3 us, per record decoded)."""
    got = _FIELDS.get(cls)
    if got is None:
        got = _FIELDS[cls] = dataclasses.fields(cls)
    return got


def spec(s: Spec, *, omit_if_default: bool = False, **kw) -> Any:
    """A dataclass field carrying its wire spec: `name: int = spec(Int(0, 10), default=0)`. `omit_if_default`: a
    field added later is left out of the encoding at its default, so records hashed before it keep their hash."""
    return dataclasses.field(metadata={"spec": s, "omit_if_default": omit_if_default}, **kw)


class WireRecord:
    """Mixin for frozen dataclasses whose fields all carry a `spec`: validated on construction and on read.

    Unknown fields are ignored on read (forward compatibility); missing fields take their defaults.
    """

    __slots__ = ()
    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]  # every WireRecord is a dataclass
    MAX_FIELDS: ClassVar[int] = 64

    def __post_init__(self) -> None:
        for f in _fields(type(self)):
            v = getattr(self, f.name)
            checked = f.metadata["spec"].check(f.name, v)
            if checked is not v:
                object.__setattr__(self, f.name, checked)

    def to_wire(self) -> dict:
        out = {}
        for f in _fields(type(self)):
            v = getattr(self, f.name)
            if f.metadata["omit_if_default"] and v == f.default:
                continue
            out[f.name] = f.metadata["spec"].to_wire(v)
        return out

    @classmethod
    def from_wire(cls, m: Any) -> Self:
        if not isinstance(m, dict):
            raise DecodeError(f"{cls.__name__}: expected a map, got {type(m).__name__}")
        kwargs = {}
        for f in _fields(cls):
            if f.name in m:
                kwargs[f.name] = f.metadata["spec"].check(f.name, m[f.name])
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise FieldError(f.name, "missing")
        try:
            return cls(**kwargs)
        except TypeError as e:  # a check we did not foresee; never let it escape as anything but DecodeError
            raise DecodeError(f"{cls.__name__}: {e}") from e


class SignedRecord(WireRecord):
    """A record a peer signs (protocol/envelope.py): it names its signer, `peer_id`, and its kind, `KIND`."""

    __slots__ = ()
    KIND: ClassVar[str]
    peer_id: str
