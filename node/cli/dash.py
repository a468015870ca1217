"""`shoal dash`: follow a swarm as an observer here and show it in the dashboard process (`python -m shoal.tui`)."""

from __future__ import annotations

import argparse

HELP = "watch a swarm live in the terminal: peers, loss, throughput, events"
DESCRIPTION = """\
Open the swarm dashboard. It joins the swarm as an observer (it never trains
and never takes a slot) and shows every peer's status live.

  shoal dash --join /ip4/192.0.2.7/tcp/4001/p2p/12D3KooW...
  shoal dash --local                 # the swarm `shoal swarm up` started here

Keys: 1 overview, 2 peers, 3 events; in the peers table s sorts, r reverses,
/ filters, Enter shows a peer's details; q quits.
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    from shoal.node.cli.node import add_common_network_arguments

    add_common_network_arguments(p)
    p.add_argument("--local", action="store_true", help="follow the swarm `shoal swarm up` started on this machine")
    p.add_argument("--run", default=None, metavar="RUN_ID", help="show only peers of this run")
    p.add_argument("--stale-after", type=float, default=6.0, metavar="SECONDS",
                   help="a peer silent this long is shown as stale (default: 6)")
    p.add_argument("--gone-after", type=float, default=15.0, metavar="SECONDS",
                   help="a peer silent this long is shown as gone (default: 15)")
    p.add_argument("--parent", type=int, default=None, help=argparse.SUPPRESS)  # `swarm up --dash`: close with it


def main(args: argparse.Namespace) -> int:
    """The observer runs in this process; the UI is a child process fed verified records through a pipe
    (the dashboard imports only `shoal.protocol`, so it never shares memory with the network stack)."""
    import logging
    import os
    import subprocess
    import sys
    import threading

    from shoal.node.cli.peers import resolve_join
    from shoal.protocol.pipe import encode_record

    log = logging.getLogger(__name__)
    join = resolve_join(args, "shoal dash")
    if join is None:
        return 2
    if not 0 < args.stale_after <= args.gone_after:
        print("shoal dash: need 0 < --stale-after <= --gone-after", file=sys.stderr)
        return 2
    # the UI owns the terminal (Textual draws on stderr): this process logs to a file instead
    from shoal.node.cli.node import shoal_home

    root = logging.getLogger()
    for h in list(root.handlers):
        if h is not args.log_file_handler:
            root.removeHandler(h)
    args.log_file_handler.open(shoal_home() / "logs" / "dash.log")
    source = join[0].rsplit("/p2p/", 1)[0] + (f" (+{len(join) - 1})" if len(join) > 1 else "")
    read_fd, write_fd = os.pipe()
    cmd = [sys.executable, "-m", "shoal.tui", "--records-fd", str(read_fd), "--source", source,
           "--stale-after", str(args.stale_after), "--gone-after", str(args.gone_after)]
    if args.run:
        cmd += ["--run", args.run]
    ui = subprocess.Popen(cmd, pass_fds=(read_fd,))  # first: the screen says it is joining while libp2p loads
    os.close(read_fd)
    from shoal.swarm.net.observer import run_observer

    out = os.fdopen(write_fd, "wb", buffering=0)
    stop = threading.Event()
    lock = threading.Lock()

    def on_record(record, age_s: float = 0.0) -> None:
        try:
            data = encode_record(record, age_s)
        except ValueError as e:  # a manifest too big for the pipe: the dashboard goes on without it
            log.warning("not shown: %s", e)
            return
        try:
            with lock:
                out.write(data)
        except (BrokenPipeError, ValueError):  # the UI quit (a closed pipe)
            stop.set()

    def observe() -> None:
        try:
            run_observer(join, on_record, stop, manifests=True)
        except Exception as e:  # the dashboard stays up and says the feed stopped
            log.warning("observer stopped: %s: %s", type(e).__name__, e)
        finally:
            with lock:
                out.close()

    thread = threading.Thread(target=observe, name="shoal-dash-observer", daemon=True)
    thread.start()
    orphaned = threading.Event()
    if args.parent is not None:
        threading.Thread(target=watch_parent, args=(args.parent, ui, orphaned), name="shoal-dash-parent",
                         daemon=True).start()
    try:
        code = ui.wait()
    except KeyboardInterrupt:
        ui.terminate()  # the UI leaves its full screen and gives the terminal back as it exits
        code = ui.wait()
    stop.set()
    thread.join(timeout=5.0)
    if orphaned.is_set():
        print(f"shoal dash: the swarm it showed is gone (its supervisor, pid {args.parent}, ended)", file=sys.stderr)
        return 0
    return code


def watch_parent(parent: int, ui, orphaned) -> None:
    """`swarm up --dash`: once the supervisor is gone (killed outright, it could not stop us), close the UI at once,
    cleanly (SIGTERM: it restores the terminal as it exits), before the shell takes the terminal back from under it."""
    import os
    import time

    while os.getppid() == parent and ui.poll() is None:
        time.sleep(PARENT_POLL_S)
    if ui.poll() is None:
        orphaned.set()
        ui.terminate()


PARENT_POLL_S = 0.1
