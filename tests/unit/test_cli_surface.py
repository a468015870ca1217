"""The command line's surface is frozen: every `shoal` command and subcommand, each of its options with its default
and choices, and its positional arguments, compared with tests/unit/cli_surface.json. A change to the surface is a
deliberate one: write the new expectation with `python -m tests.unit.test_cli_surface` and commit it with the change.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

EXPECTED = Path(__file__).with_name("cli_surface.json")
HIDDEN_DESTS = ("help", "_verbose_")  # argparse's own --help, and -v repeated at every level


def _value(v: Any) -> Any:
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (list, tuple)):
        return [_value(x) for x in v]
    return repr(v)


def _option(a: argparse.Action) -> dict[str, Any]:
    out: dict[str, Any] = {"dest": a.dest, "default": _value(a.default)}
    if a.type is not None:
        out["type"] = getattr(a.type, "__name__", repr(a.type))
    if a.choices is not None:
        out["choices"] = sorted(str(c) for c in a.choices)
    if a.required:
        out["required"] = True
    if a.nargs is not None:
        out["nargs"] = str(a.nargs)
    kind = type(a).__name__.lstrip("_").replace("Action", "").lower()
    if kind not in ("store", ""):
        out["action"] = kind
    return out


def surface(parser: argparse.ArgumentParser, path: str = "shoal") -> dict[str, Any]:
    """{command path: {"options": {flags: ...}, "positionals": [...]}} for `parser` and every subcommand under it."""
    out: dict[str, Any] = {}
    options, positionals = {}, []
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            positionals.append(f"{a.dest}: {' | '.join(sorted(a.choices))}")
            for name, child in sorted(a.choices.items()):
                out.update(surface(child, f"{path} {name}"))
        elif a.option_strings:
            if not a.dest.startswith(HIDDEN_DESTS) and a.dest != "version":
                options[" ".join(sorted(a.option_strings))] = _option(a)
        else:
            positionals.append(a.dest)
    out[path] = {"options": dict(sorted(options.items())), "positionals": positionals}
    return out


def current() -> dict[str, Any]:
    from shoal.node.cli import build_parser

    return dict(sorted(surface(build_parser()).items()))


def test_the_command_line_surface_is_the_one_checked_in():
    got, want = current(), json.loads(EXPECTED.read_text())
    assert sorted(got) == sorted(want), "commands added or removed"
    for path in want:
        assert got[path] == want[path], f"{path} changed (python -m tests.unit.test_cli_surface writes the new one)"


if __name__ == "__main__":
    EXPECTED.write_text(json.dumps(current(), indent=1, sort_keys=True) + "\n")
    print(f"wrote {EXPECTED}", file=sys.stderr)


def test_run_create_takes_its_defaults_from_the_manifests_specs():
    """One source of defaults: a manifest made from no flags holds the spec's default in every field a flag sets."""
    from shoal.node.cli import build_parser
    from shoal.node.cli.run import SPEC_FLAGS, build_manifest
    from shoal.node.cli.specflags import field_default, spec_field
    from shoal.protocol.manifest import RunManifest

    m = build_manifest(build_parser().parse_args(["run", "create", "-o", "run.toml"]))
    for sf in SPEC_FLAGS:
        value: Any = m
        for part in sf.field.split("."):
            value = getattr(value, part)
        assert value == field_default(spec_field(RunManifest, sf.field)), sf.flag
