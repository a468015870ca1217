"""`--data` as typed (`shoal run create`, `shoal node`, `shoal train`): checked where it is typed, a local path
stored absolute, so a mistake is one line at once rather than a failure deep in a node's start-up."""

from __future__ import annotations

from pathlib import Path

from shoal.node.cli.errors import CliError

DATA_FORMS = "'stdlib', a .txt/.jsonl/.parquet file, a folder of them, or hf:NAME"
DATA_SUFFIXES = (".txt", ".jsonl", ".parquet")


def typed_data(value: str, flag: str = "--data") -> str:
    """`value` checked: 'stdlib' and hf:NAME as they are (a dataset's own checks are the loader's), a local file, or
    a folder that holds .txt/.jsonl documents, returned as an absolute path (a manifest names it for every
    node, and a relative path would mean another folder to each). CliError (exit 2) otherwise."""
    if value == "stdlib" or value.startswith("hf:"):
        return value
    path = Path(value).expanduser()
    try:
        path = path.resolve(strict=True)
    except (OSError, RuntimeError) as e:
        why = "no such file or folder" if isinstance(e, FileNotFoundError) else getattr(e, "strerror", None) or e
        raise CliError(f"{flag} {value}: {why}", hint=f"{flag} takes {DATA_FORMS}") from None
    if path.is_dir() and not any(p.suffix in DATA_SUFFIXES and p.is_file() for p in path.rglob("*")):
        raise CliError(f"{flag} {value}: the folder holds no .txt, .jsonl or .parquet file", hint=f"{flag} takes {DATA_FORMS}")
    return str(path)  # a file of another suffix is read as one text document
