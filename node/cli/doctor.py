"""`shoal doctor`: a checklist of what a node needs (Python, torch, device, libp2p, addresses, disk, identity, and
with --join the swarm it would join and the clock against it), each line with a verdict and a fix."""

from __future__ import annotations

import argparse
from pathlib import Path

HELP = "check this machine (and a swarm to join) and say what to fix"
DESCRIPTION = """\
Print a checklist of everything a node needs, each line with a verdict
(ok, info, warn, fail) and, when it is not ok, what to do about it:
Python and shoal, torch and the device a node would train on (its free memory,
and which model sizes fit), whether libp2p imports, this machine's addresses
(loopback, private, public), free disk for checkpoints, the identity file's
permissions; with --join also whether that address answers (TCP, then libp2p
with its peer id: dial time, protocols) and the clock offset against the peers
it reaches. Exit status 1 when any line fails.

  shoal doctor
  shoal doctor --join /ip4/192.0.2.7/tcp/4001/p2p/12D3KooW...
  shoal doctor --json
"""
MARKS = {"ok": "[green]ok  [/green]", "info": "[blue]info[/blue]", "warn": "[yellow]warn[/yellow]",
         "fail": "[red]FAIL[/red]"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    from shoal.node.cli.node import add_common_network_arguments

    add_common_network_arguments(p)
    p.add_argument("--listen", default="/ip4/0.0.0.0/tcp/4001", metavar="MULTIADDR",
                   help="the address a node would listen on (default: /ip4/0.0.0.0/tcp/4001)")
    p.add_argument("--identity", type=Path, default=None, metavar="PATH",
                   help="the node's key file (default: $SHOAL_HOME/identity.key)")
    p.add_argument("--device", default="auto", help="the node's --device (default: auto)")
    p.add_argument("--timeout", type=float, default=5.0, metavar="SECONDS",
                   help="how long to wait for a join address to answer (default: 5)")
    p.add_argument("--json", action="store_true", help="print the checklist as JSON")


def collect(args: argparse.Namespace) -> list:
    import logging

    import trio

    from shoal.node.cli.errors import CliError
    from shoal.node.cli.joinfile import expand_join
    from shoal.node.cli.node import shoal_home
    from shoal.node.doctor import checks as c

    home = shoal_home()
    out = [c.check_python(), c.check_shoal(), *c.check_torch(args.device), c.check_libp2p(), c.check_listen(args.listen),
           c.check_disk(home), c.check_identity(args.identity or home / "identity.key")]
    if not args.join:
        return out
    try:
        join = expand_join(args.join, args.join_wait, check=False)  # each address is its own check line
    except CliError as e:
        return out + [c.Check(name="join", verdict="fail", summary=e.message, fix=e.hint)]
    if any(x.name == "libp2p" and x.verdict == "fail" for x in out):
        return out + [c.Check(name="join", verdict="fail", summary="not checked: libp2p does not import",
                              fix="fix libp2p first (above)")]
    from shoal.node.doctor.remote import check_join

    if getattr(args, "verbose", 0) < 2:  # importing libp2p reset its loggers to print routine dial failures
        logging.getLogger("libp2p").setLevel(logging.CRITICAL)
    parts = args.listen.strip("/").split("/")
    port = int(parts[3]) if len(parts) >= 4 and parts[2] == "tcp" and parts[3].isdigit() else 0
    return out + trio.run(lambda: check_join(join, timeout_s=args.timeout, listen_port=port))


def main(args: argparse.Namespace) -> int:
    import json

    from rich.console import Console
    from rich.table import Table

    checks = collect(args)
    failed = any(x.verdict == "fail" for x in checks)
    if args.json:
        print(json.dumps({"ok": not failed, "checks": [x.to_dict() for x in checks]}, indent=1))
        return 1 if failed else 0
    console = Console(soft_wrap=False)
    table = Table(title="shoal doctor", show_lines=False, expand=False)
    for col in ("", "check", "finding / fix"):
        table.add_column(col, overflow="fold")
    for x in checks:
        text = x.summary.replace("[", "\\[")
        if x.fix:
            text += f"\n[bold]→ {x.fix.replace('[', chr(92) + '[')}[/bold]"
        table.add_row(MARKS[x.verdict], x.name, text)
    console.print(table)
    console.print("[red]some checks failed[/red]" if failed else "[green]no check failed[/green]")
    return 1 if failed else 0
