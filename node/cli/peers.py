"""`shoal peers`: join briefly as an observer, print every live peer of the swarm, exit."""

from __future__ import annotations

import argparse

HELP = "list the live peers of a swarm"
DESCRIPTION = """\
Join a swarm briefly as an observer (it takes no slot and is not listed) and
print every live peer: a table, or JSON with --json.

  shoal peers --join /ip4/127.0.0.1/tcp/4001/p2p/12D3KooW...
  shoal peers --local --json        # the swarm that `shoal swarm up` started here
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_observer_arguments(p, "how long to listen to gossip after the snapshot")


def add_observer_arguments(p: argparse.ArgumentParser, wait_help: str) -> None:
    """What a command that briefly observes a swarm takes: where the swarm is, JSON or a table, how long to listen."""
    from shoal.node.cli.node import add_common_network_arguments

    add_common_network_arguments(p)
    p.add_argument("--local", action="store_true", help="find the swarm started by `shoal swarm up` on this machine")
    p.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    p.add_argument("--wait", type=float, default=1.5, metavar="SECONDS", help=f"{wait_help} (default: %(default)g)")


def resolve_join(args: argparse.Namespace, prog: str) -> list[str] | None:
    """--join addresses, or with --local those of the swarm `shoal swarm up` runs here; None (said why) if none."""
    import sys

    from shoal.node.cli.joinfile import expand_join
    from shoal.node.cli.node import shoal_home
    from shoal.node.localswarm import find_local_swarm

    join = expand_join(args.join, args.join_wait)  # a bad address: one line with a hint, exit 2
    if getattr(args, "local", False):
        join += find_local_swarm(shoal_home())
        if not join:
            print(f"{prog}: no local swarm is running (start one with `shoal swarm up`)", file=sys.stderr)
            return None
    if not join:
        print(f"{prog}: say which swarm: --join MULTIADDR or --local", file=sys.stderr)
        return None
    return join


def peer_rows(obs) -> list[dict]:
    rows = []
    for e in obs.membership.live_peers():
        ann, st = e.announcement_record, e.status_record
        rows.append({
            "peer_id": e.peer_id,
            "addrs": list(ann.addrs) if ann else [],
            "state": st.state if st else "unknown",
            "role": st.role if st else "unknown",
            "last_seen_s": round(obs.membership.age_s(e), 2),
            "device": f"{ann.hardware.device_kind}: {ann.hardware.device_name}" if ann else "unknown",
            "matmul_tflops": ann.hardware.matmul_tflops if ann else None,
            "step": st.step if st else 0,
            "slot": st.slot if st else None,
            "run_id": st.run_id if st else None,  # the run it trains (shoal runs lists them)
        })
    return rows


def main(args: argparse.Namespace) -> int:
    import json
    import sys

    import trio

    from shoal.swarm.net.observer import Observer

    join = resolve_join(args, "shoal peers")
    if join is None:
        return 2
    try:
        obs = Observer(join)
    except ValueError as e:
        print(f"shoal peers: {e}", file=sys.stderr)
        return 2

    async def run() -> list[dict]:
        async with trio.open_nursery() as nursery:
            await nursery.start(obs.run)
            await trio.sleep(args.wait)
            nursery.cancel_scope.cancel()
        return peer_rows(obs)

    rows = trio.run(run)  # a join address that does not answer: JoinError, its own exit status (cli/errors.py)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    from rich.console import Console

    Console().print(peers_table(rows))
    return 0


def _host_port(addr: str) -> str:
    """/ip4/192.0.2.7/tcp/4001/p2p/… -> 192.0.2.7:4001 (the full address is in --json)."""
    parts = addr.strip("/").split("/")
    return f"{parts[1]}:{parts[3]}" if len(parts) >= 4 and parts[0] in ("ip4", "ip6", "dns4", "dns6") else addr


def peers_table(rows: list[dict]):
    """Every live peer in a table that fits 80 columns (peer ids shortened as in the dashboard)."""
    from rich import box
    from rich.table import Table

    from shoal.protocol.display import short_id

    t = Table(title=f"{len(rows)} live peers", box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 0), show_edge=False)
    for col in ("peer", "run", "role", "slot", "state", "step", "device", "address"):  # TFLOPs: in --json
        t.add_column(col, no_wrap=True, overflow="ellipsis", justify="right" if col == "step" else "left")
    for r in rows:
        t.add_row(short_id(r["peer_id"]), (r.get("run_id") or "-")[:6], r["role"], r.get("slot") or "-", r["state"],
                  str(r["step"]),
                  _device(r["device"]),
                  _host_port((r["addrs"] or ["?"])[0]))
    return t


def _device(text: str, width: int = 12) -> str:
    """'cuda: NVIDIA H100 80GB HBM3' -> 'H100 80GB HB', 'cpu: x86_64' -> 'cpu x86_64'."""
    kind, _, name = text.partition(": ")
    name = name.replace("NVIDIA ", "").replace("GeForce ", "")
    return (name if kind == "cuda" else f"{kind} {name}".strip())[:width]
