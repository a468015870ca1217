"""Join addresses as typed (checked before anything else runs) or handed between processes through a file:
`shoal node --address-file` writes, `--join @FILE` reads."""

from __future__ import annotations

import os
import time
from pathlib import Path

MAX_JOIN_FILE_BYTES = 16 * 1024


def write_address_file(path: Path, addrs: list[str]) -> None:
    """Write the addresses others join this node with, one per line (loopback ones only if there is nothing else)."""
    dialable = [a for a in addrs if not a.startswith("/ip4/127.")] or list(addrs)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text("".join(f"{a}\n" for a in dialable))
    os.replace(tmp, path)


def read_join_file(path: Path, wait_s: float, poll_s: float = 0.2) -> list[str]:
    """The multiaddrs in `path` (one per line, # comments), waiting up to `wait_s` for it to exist and be non-empty."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            if path.stat().st_size > MAX_JOIN_FILE_BYTES:
                raise ValueError(f"{path}: larger than {MAX_JOIN_FILE_BYTES} bytes, not a join address file")
            lines = [ln.split("#", 1)[0].strip() for ln in path.read_text().splitlines()]
            addrs = [ln for ln in lines if ln]
            if addrs:
                return addrs
        except FileNotFoundError:
            pass
        if time.monotonic() >= deadline:
            raise ValueError(f"--join @{path}: no addresses there after {wait_s:g} s (is the node that writes it "
                             f"with --address-file running?)")
        time.sleep(poll_s)


JOIN_HINT = "copy the whole address a node prints once it is up (ready; others join with: …)"


def expand_join(values: list[str], wait_s: float, *, check: bool = True) -> list[str]:
    """--join values with every @FILE replaced by the addresses in that file, each checked (`check_join_address`;
    not with `check=False`: a caller that reports each one); CliError (exit 2, with a hint) for a bad address or an
    unreadable file."""
    from shoal.node.cli.errors import CliError
    from shoal.swarm.net.addresses import check_join_address

    out: list[str] = []
    for v in values:
        try:
            out += read_join_file(Path(v[1:]), wait_s) if v.startswith("@") else [v]
        except (ValueError, OSError) as e:
            raise CliError(str(e), hint="give the file another node writes with --address-file") from None
    try:
        return [check_join_address(a) for a in out] if check else out
    except ValueError as e:
        raise CliError(str(e), hint=JOIN_HINT) from None
