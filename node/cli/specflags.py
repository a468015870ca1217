"""Command-line flags made from a record's field specs: each flag names the field it sets (`optim.lr`), and takes
its type, choices and default from that field, so the manifest's spec is the one source of every default."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from shoal.protocol.schema import Bool, Choice, Float, Int, Nested, Str, WireRecord


@dataclass(frozen=True, slots=True)
class SpecFlag:
    """`--flag` sets `field` (dotted through nested records: "plan.sync.cocktail.p") of the root record."""

    flag: str
    field: str
    help: str
    metavar: str | None = None


def spec_field(root: type[WireRecord], path: str) -> dataclasses.Field:
    """The dataclass field at dotted `path` under `root`, following nested records."""
    cls: type = root
    *parents, name = path.split(".")
    for part in parents:
        spec = _fields(cls)[part].metadata["spec"]
        if not isinstance(spec, Nested):
            raise ValueError(f"{path}: {part} is not a nested record")
        cls = spec.cls
    return _fields(cls)[name]


def _fields(cls: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


def field_default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    raise ValueError(f"{f.name} has no default")


def add_spec_flags(group: argparse._ActionsContainer, root: type[WireRecord], flags: Iterable[SpecFlag]) -> None:
    """One argparse option per flag, typed, restricted and defaulted by its field's spec."""
    for sf in flags:
        f = spec_field(root, sf.field)
        spec, default = f.metadata["spec"], field_default(f)
        dest = sf.flag.lstrip("-").replace("-", "_")
        if isinstance(spec, Bool):
            group.add_argument(sf.flag, dest=dest, action="store_true", default=default, help=sf.help)
            continue
        kw: dict[str, Any] = {"dest": dest, "default": default, "help": f"{sf.help} (default: %(default)s)"}
        if isinstance(spec, Choice):
            kw["choices"] = sorted(spec.choices)
        elif isinstance(spec, Int):
            kw["type"] = int
        elif isinstance(spec, Float):
            kw["type"] = float
        elif not isinstance(spec, Str):
            raise ValueError(f"{sf.field}: no flag for a {type(spec).__name__} field")
        if sf.metavar is not None:
            kw["metavar"] = sf.metavar
        group.add_argument(sf.flag, **kw)


def spec_values(args: argparse.Namespace, flags: Iterable[SpecFlag], record: str) -> dict[str, Any]:
    """{field name: value given or defaulted} for the flags that set fields of the record at dotted `record`."""
    out = {}
    for sf in flags:
        parent, _, name = sf.field.rpartition(".")
        if parent == record:
            out[name] = getattr(args, sf.flag.lstrip("-").replace("-", "_"))
    return out
