"""`shoal swarm up`: start a whole local swarm on this machine, show it live, stop it cleanly."""

from __future__ import annotations

import argparse

HELP = "run a whole local swarm on this machine (start here)"
DESCRIPTION = """\
Run a whole shoal swarm on this machine: N node processes on 127.0.0.1, the
first one the bootstrap. It waits until every node sees every other, shows a
live summary, and stops them all on Ctrl+C.

  shoal swarm up                          # 3 nodes, until Ctrl+C
  shoal swarm up --dash                   # the same, watched in the dashboard (q stops it)
  shoal swarm up --nodes 5 --duration 30 --json   # unattended, for scripts and CI

While it runs, other terminals can look at it:
  shoal peers --local
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="swarm_command", metavar="ACTION", required=True)
    up = sub.add_parser("up", help="start a local swarm", description=DESCRIPTION,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    up.add_argument("--nodes", type=int, default=3, help="how many nodes (default: 3)")
    up.add_argument("--duration", type=float, default=None, metavar="SECONDS",
                    help="stop after this long (default: run until Ctrl+C)")
    up.add_argument("--json", action="store_true", help="print a final JSON summary on stdout")
    up.add_argument("--dir", type=str, default=None, metavar="PATH",
                    help="where node keys, status files and logs go (default: a new folder under $SHOAL_HOME/swarms)")
    up.add_argument("--dash", action="store_true", help="open the dashboard on the swarm (quitting it stops the swarm)")
    up.add_argument("--device", default="cpu", help="device for every node (default: cpu)")
    up.add_argument("--converge-timeout", type=float, default=90.0, metavar="SECONDS",
                    help="give up if the nodes do not all see each other within this long (default: 90)")


def _table(swarm, t0: float, converged_after: float | None):
    import time

    from rich.table import Table

    title = f"shoal local swarm: {sum(n.alive for n in swarm.nodes)}/{len(swarm.nodes)} nodes, up {time.monotonic() - t0:.0f} s"
    if converged_after is not None:
        title += f", converged in {converged_after:.1f} s"
    t = Table(title=title, caption="Ctrl+C stops the swarm · shoal peers --local")
    for col in ("#", "peer id", "pid", "state", "role", "peers seen"):
        t.add_column(col, no_wrap=True)
    for r in swarm.summary():
        t.add_row(str(r["index"]), (r["peer_id"] or "…")[-12:], str(r["pid"]), str(r["state"]), str(r["role"] or ""),
                  f"{r['peers_seen']}/{len(swarm.nodes) - 1}")
    return t


def main(args: argparse.Namespace) -> int:
    import json
    import os
    import sys
    import time
    from pathlib import Path

    from rich.console import Console
    from rich.live import Live

    from shoal.node.cmd_node import shoal_home
    from shoal.node.localswarm import LocalSwarm, LocalSwarmConfig
    from shoal.swarm.observer import LOCAL_SWARM_FILE

    import signal

    def on_sigterm(signum, frame):  # stop the nodes by PID, as on Ctrl+C, rather than orphaning them
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_sigterm)
    home = shoal_home()
    workdir = Path(args.dir) if args.dir else home / "swarms" / time.strftime("%Y%m%d-%H%M%S")
    try:
        swarm = LocalSwarm(LocalSwarmConfig(nodes=args.nodes, workdir=workdir, home=home, device=args.device))
    except ValueError as e:
        print(f"shoal swarm up: {e}", file=sys.stderr)
        return 2
    err = Console(stderr=True)
    interactive = sys.stdout.isatty() and not args.json
    local_file = home / LOCAL_SWARM_FILE
    t0 = time.monotonic()
    converged_after = None
    code = 0
    try:
        err.print(f"starting {args.nodes} nodes in {workdir} …")
        swarm.start()
        converged_after = swarm.wait_converged(args.converge_timeout)
        local_file.write_text(json.dumps({"pid": os.getpid(), "bootstrap": swarm.bootstrap_addrs(),
                                          "workdir": str(workdir)}))
        err.print(f"all {args.nodes} nodes see each other after {converged_after:.1f} s; "
                  f"bootstrap: {swarm.bootstrap_addrs()[0]}", soft_wrap=True)
        end = t0 + args.duration if args.duration is not None else float("inf")
        if args.dash:
            import subprocess

            dash = subprocess.Popen([sys.executable, "-m", "shoal.node.cli", "dash", "--local"])
            while dash.poll() is None and time.monotonic() < end:
                time.sleep(0.3)
            if dash.poll() is None:
                dash.terminate()
                dash.wait()
        elif interactive:
            with Live(_table(swarm, t0, converged_after), console=err, refresh_per_second=2) as live:
                while time.monotonic() < end:
                    time.sleep(0.5)
                    live.update(_table(swarm, t0, converged_after))
        else:
            while time.monotonic() < end:
                time.sleep(0.5)
    except KeyboardInterrupt:
        err.print("stopping the swarm …")
    except (RuntimeError, TimeoutError) as e:
        err.print(f"[red]shoal swarm up: {e}[/red]")
        code = 1
    finally:
        summary = swarm.summary()
        codes = swarm.stop()
        local_file.unlink(missing_ok=True)
    if args.json:
        for row in summary:
            row["exit_code"] = codes.get(row["index"])
        print(json.dumps({"converged_after_s": converged_after, "nodes": summary}, indent=1))
    else:
        err.print(f"stopped {len(codes)} nodes (exit codes {sorted(set(codes.values()))})")
    return code
