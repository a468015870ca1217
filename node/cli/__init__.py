"""The `shoal` command line: one argparse tree, each subcommand defined in its own module of this package."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from shoal.node.version import shoal_version

#: subcommand name -> module defining HELP, add_arguments(parser) and main(args) -> int.
#: Command modules import only argparse-level things at top level; heavy imports go inside main().
COMMANDS: dict[str, str] = {
    "node": "shoal.node.cli.node",
    "peers": "shoal.node.cli.peers",
    "swarm": "shoal.node.cli.swarm",
    "run": "shoal.node.cli.run",
    "train": "shoal.node.cli.train",
    "bench": "shoal.node.cli.bench",
    "dash": "shoal.node.cli.dash",
    "doctor": "shoal.node.cli.doctor",
    "health": "shoal.node.cli.health",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shoal",
        description=(
            "shoal: train large models together on volunteers' GPUs over slow home links.\n\n"
            "Start here:  shoal swarm up            (a whole local swarm on this machine)\n"
            "Join one:    shoal node --join ADDR    (ADDR is printed by the node you join)\n"
            "Look at one: shoal peers --join ADDR"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"shoal {shoal_version()}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-v info, -vv debug)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, modname in COMMANDS.items():
        mod = importlib.import_module(modname)
        p = sub.add_parser(
            name,
            help=mod.HELP,
            description=getattr(mod, "DESCRIPTION", mod.HELP),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        mod.add_arguments(p)
        p.set_defaults(_main=mod.main)
    return parser


def setup_logging(verbosity: int) -> None:
    level = logging.WARNING if verbosity <= 0 else logging.INFO if verbosity == 1 else logging.DEBUG
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    if verbosity < 2:  # py-libp2p logs routine peer churn as warnings
        for noisy in ("libp2p", "multiaddr", "async_service"):
            logging.getLogger(noisy).setLevel(logging.CRITICAL)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_main", None):
        parser.print_help()
        return 2
    setup_logging(args.verbose)
    try:
        return int(args._main(args) or 0)
    except KeyboardInterrupt:
        return 130
