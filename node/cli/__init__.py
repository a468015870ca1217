"""The `shoal` command line: one argparse tree, each subcommand defined in its own module of this package."""

from __future__ import annotations

import argparse
import atexit
import contextlib
import importlib
import logging
import os
import signal
import sys
import threading

#: subcommand name -> module defining HELP, add_arguments(parser) and main(args) -> int.
#: Command modules import only argparse-level things at top level; heavy imports go inside main().
COMMANDS: dict[str, str] = {
    "node": "shoal.node.cli.node",
    "peers": "shoal.node.cli.peers",
    "runs": "shoal.node.cli.runs",
    "swarm": "shoal.node.cli.swarm",
    "run": "shoal.node.cli.run",
    "train": "shoal.node.cli.train",
    "export": "shoal.node.cli.export",
    "bench": "shoal.bench.command",
    "dash": "shoal.node.cli.dash",
    "doctor": "shoal.node.cli.doctor",
    "health": "shoal.node.cli.health",
}


class Parser(argparse.ArgumentParser):
    """Every parser of the tree (sub-commands inherit the class): no abbreviated options (`--step` is not
    `--steps`: a typo is an error, not another flag), and an unknown argument is reported by the sub-command that
    was given it, with that sub-command's usage (argparse leaves it to the top level, whose usage says nothing of
    the sub-command's options)."""

    def __init__(self, *args, **kwargs):
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        ns, extras = super().parse_known_args(args, namespace)
        if extras and self.prog != ROOT_PROG:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return ns, extras


ROOT_PROG = "shoal"


def build_parser() -> argparse.ArgumentParser:
    from shoal.node.cli.errors import exit_codes_text
    from shoal.node.version import shoal_version

    parser = Parser(
        prog=ROOT_PROG,
        description=(
            "shoal: train large models together on volunteers' GPUs over slow home links.\n\n"
            "Start here:  shoal swarm up            (a whole local swarm on this machine)\n"
            "Join one:    shoal node --join ADDR    (ADDR is printed by the node you join)\n"
            "Look at one: shoal peers --join ADDR    (shoal runs --join ADDR: the runs it trains)"
        ),
        epilog=exit_codes_text() + "\n\nstate and logs live under $SHOAL_HOME (default: ~/.shoal)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"shoal {shoal_version()}")
    add_verbose(parser, "verbose")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, modname in COMMANDS.items():
        mod = importlib.import_module(modname)
        p = sub.add_parser(
            name,
            help=mod.HELP,
            description=getattr(mod, "DESCRIPTION", mod.HELP),
            epilog=getattr(mod, "EPILOG", None),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        mod.add_arguments(p)
        p.set_defaults(_main=mod.main)
        _verbose_everywhere(p, depth=1)
        _name_every_level(p)
    return parser


def add_verbose(parser: argparse.ArgumentParser, dest: str) -> None:
    parser.add_argument("-v", "--verbose", dest=dest, action="count", default=0,
                        help="more output: -v shows info and libraries' warnings on the terminal and tracebacks of "
                             "errors, -vv debug")


def _verbose_everywhere(parser: argparse.ArgumentParser, depth: int) -> None:
    """-v after a subcommand too (`shoal node -v`, `shoal swarm up -v`): its own dest per level, summed in main
    (a subparser's defaults would overwrite the parent's value)."""
    add_verbose(parser, f"_verbose_{depth}")
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                _verbose_everywhere(child, depth + 1)


def _name_every_level(parser: argparse.ArgumentParser) -> None:
    """`args._prog`: the deepest sub-command given ("shoal run create"), the prefix of its error lines."""
    parser.set_defaults(_prog=parser.prog)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                _name_every_level(child)


def verbosity(args: argparse.Namespace) -> int:
    return args.verbose + sum(v for k, v in vars(args).items() if k.startswith("_verbose_"))


def _interrupt(signum, frame):
    raise KeyboardInterrupt  # SIGTERM and SIGHUP stop a command like Ctrl+C (commands that stay up handle them)


def main(argv: list[str] | None = None) -> int:
    """Run one command; an expected error is one line with a hint and its exit status (errors.Exit), a bug one
    line too unless -v asks for the traceback. Ctrl+C, SIGTERM and SIGHUP at any moment: one line, exit 130."""
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, _interrupt)
    try:
        return _main(argv)
    except KeyboardInterrupt:  # before the command's own handling took over (imports, argument parsing)
        command = next((a for a in (sys.argv[1:] if argv is None else argv) if not a.startswith("-")), "")
        print(f"shoal {command}".strip() + ": interrupted", file=sys.stderr, flush=True)
        _ignore_further_signals()
        return 130


def entry() -> None:
    """The `shoal` process: `main`, then exit with its status. An interrupted command leaves at once with 130
    after the interpreter's exit handlers (logs flushed, network namespaces torn down): a full interpreter
    shutdown after an interrupt could still end as a death by SIGINT (-2) on a loaded machine, which tells a
    script that calls shoal something else than "interrupted"."""
    code = main()
    if code == 130:  # main already ignores further signals on this path
        try:
            atexit._run_exitfuncs()
        finally:
            for f in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    f.flush()
            os._exit(code)
    sys.exit(code)


def _ignore_further_signals() -> None:
    """An interrupted command is on its way out with exit 130: a signal still in flight (one the event loop queued
    and hands back as it closes, or a second Ctrl+C) must not turn that exit into a death by signal while the
    interpreter shuts down (it restores the default disposition, which kills)."""
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)


def _main(argv: list[str] | None) -> int:
    from shoal.node.cli.errors import CliError, Exit, classify
    from shoal.node.cli.logs import setup_logging

    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_main", None):
        parser.print_help()
        return Exit.USAGE
    verbose = verbosity(args)
    args.verbose = verbose
    args.log_file_handler = setup_logging(verbose)
    if args.command != "node":  # a node names its own log file once it knows its identity
        from shoal.node.cli.node import shoal_home

        args.log_file_handler.lazy_path = shoal_home() / "logs" / f"{args.command}.log"
    prog = getattr(args, "_prog", f"shoal {args.command}")
    try:
        return int(args._main(args) or 0)
    except BaseException as e:  # noqa: BLE001 - the one place that turns errors into exit statuses
        if isinstance(e, SystemExit):
            raise
        from shoal.node.failure import describe, is_interruption

        err = classify(e)
        if err is None:
            if verbose:
                raise
            path = args.log_file_handler.path or args.log_file_handler.lazy_path
            where = f"; log: {path}" if path else ""
            err = CliError(f"unexpected error: {describe(e, limit=1000)}", Exit.FAILED,
                           hint=f"run again with -v for the traceback and report it{where}")
        elif verbose and err.code is not Exit.INTERRUPTED:
            import traceback

            traceback.print_exception(e, file=sys.stderr)
        if not verbose and not is_interruption(e):  # the whole tree, side effects included, for a bug report
            logging.getLogger("shoal.cli").info("%s failed", prog, exc_info=e)
        logging.getLogger("shoal.cli").info("%s (exit %d)", err.message, err.code)
        print(err.line(prog), file=sys.stderr, flush=True)
        if err.code is Exit.INTERRUPTED:
            _ignore_further_signals()
        return int(err.code)
