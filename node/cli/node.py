"""`shoal node`: run a node daemon that joins a swarm and stays until Ctrl+C or SIGTERM."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from shoal.node import defaults

HELP = "run a node: join a swarm (or start one) and stay until Ctrl+C"
DESCRIPTION = """\
Run a shoal node. Without --join it starts a new swarm and prints the address
others use to join it; with --join it joins an existing swarm.

  shoal node                                   # first node of a new swarm
  shoal node --join /ip4/192.0.2.7/tcp/4001/p2p/12D3KooW...

The node keeps its identity (its peer id) in --identity (created on first run).
To be reachable from other machines, listen on all interfaces with a fixed port:
  shoal node --listen /ip4/0.0.0.0/tcp/4001
Ctrl+C or SIGTERM leaves the swarm cleanly (a leave notice, then exit 0).
"""


def shoal_home() -> Path:
    return Path(os.environ.get("SHOAL_HOME", "~/.shoal")).expanduser()


def train_device(device_flag: str) -> str:
    """The device `shoal node --device device_flag` trains on: auto trains on the CPU (a GPU is used when asked)."""
    return "cpu" if device_flag == "auto" else device_flag


def add_common_network_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--join", action="append", default=[], metavar="MULTIADDR|@FILE",
                   help="address of a node in the swarm, with its /p2p/ peer id (repeatable); @FILE reads them "
                        "from a file, one per line (another node's --address-file)")
    p.add_argument("--join-wait", type=float, default=60.0, metavar="SECONDS",
                   help="how long to wait for a --join @FILE to appear (default: 60)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_common_network_arguments(p)
    p.add_argument("--listen", default="/ip4/0.0.0.0/tcp/0", metavar="MULTIADDR",
                   help="where to listen (default: all interfaces, a free port)")
    p.add_argument("--identity", type=Path, default=None, metavar="PATH",
                   help="Ed25519 key file, created on first run (default: $SHOAL_HOME/identity.key)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (default: auto)")
    p.add_argument("--address-file", type=Path, default=None, metavar="PATH",
                   help="once ready, write the addresses others join this node with to PATH (for --join @PATH)")
    p.add_argument("--status-file", type=Path, default=None, metavar="PATH",
                   help="rewrite a JSON file with peer_id, addrs, peers and state every few seconds")
    p.add_argument("--status-interval", type=float, default=2.0, metavar="SECONDS",
                   help="how often to publish status (default: 2)")
    p.add_argument("--gone-after", type=float, default=12.0, metavar="SECONDS",
                   help="a peer silent this long is marked gone (default: 12)")
    n = p.add_argument_group("behind a NAT")
    n.add_argument("--relay", default="auto", choices=("auto", "on", "off"),
                   help="relay for peers behind NATs: auto (when this node is publicly dialable), on, off "
                        "(default: auto)")
    n.add_argument("--no-hole-punch", action="store_true",
                   help="do not try to upgrade relayed connections to direct ones (DCUtR)")
    n.add_argument("--no-nat", action="store_true",
                   help="no reachability checks, relays or hole punching at all (a plain host)")
    t = p.add_argument_group("training (with --run)")
    t.add_argument("--run", default=None, metavar="RUN.toml|RUN_ID",
                   help="train in this run: a manifest file (the first node with it hosts the broker) or, with "
                        "--join, the run id of a run the swarm already trains")
    t.add_argument("--secret", default=None, help="the run's join secret, for a private run "
                                                  "(or set SHOAL_JOIN_SECRET)")
    t.add_argument("--steps", type=int, default=None, metavar="N", help="stop training after N steps")
    t.add_argument("--threads", type=int, default=None, metavar="N", help="torch CPU threads")
    t.add_argument("--round-timeout", type=float, default=defaults.ROUND_TIMEOUT_S, metavar="SECONDS",
                   help="a replica not heard within this long is dropped from a synchronization round "
                        "(default: %(default)g)")
    t.add_argument("--fail-after", type=float, default=defaults.FAIL_AFTER_S, metavar="SECONDS",
                   help="an active node (or the broker) silent this long is replaced (default: %(default)g)")
    t.add_argument("--dissolve-after", type=float, default=defaults.DISSOLVE_AFTER_S, metavar="SECONDS",
                   help="a pipeline lane whose empty slot no backup can fill for this long is dissolved and its "
                        "nodes return to the backup pool (default: %(default)g; the broker's setting)")
    t.add_argument("--backup-refresh", type=float, default=defaults.BACKUP_REFRESH_S, metavar="SECONDS",
                   help="a backup refreshes its warm copy of the run's state this often, so a promotion pulls only "
                        "the group's synchronized state (default: %(default)g; raise it for big models)")


def main(args: argparse.Namespace) -> int:
    import signal
    import sys

    import trio

    from shoal.node.cli.joinfile import expand_join, write_address_file
    from shoal.node.daemon import Node, NodeConfig, status_gossip_s
    from shoal.swarm.run.broker import AdmissionError
    from shoal.swarm.net.rpc import RpcError
    from shoal.node.train.hardware import hardware_profile
    from shoal.swarm.net.host import HostConfig
    from shoal.swarm.net.membership import MembershipConfig

    home = shoal_home()
    try:
        args.join = expand_join(args.join, args.join_wait)
        run = None
        if args.run is not None:
            run = run_config(args)
        config = NodeConfig(
            run=run,
            host=HostConfig(listen=args.listen, join=tuple(args.join), nat=nat_config(args)),
            identity=args.identity or home / "identity.key",
            device=args.device,
            home=home,
            status_file=args.status_file,
            status_interval_s=args.status_interval,
            membership=MembershipConfig(  # suspect once a gossiped status is overdue by half a period
                suspect_after_s=min(1.5 * status_gossip_s(args.status_interval, args.gone_after,
                                                          run.broker.fail_after_s if run else None), args.gone_after),
                gone_after_s=args.gone_after),
        )
        hardware = hardware_profile(args.device, home)
    except (ValueError, RuntimeError, OSError) as e:
        print(f"shoal node: {e}", file=sys.stderr)
        return 2

    async def run() -> int:
        node = Node(config, hardware)
        async with trio.open_nursery() as nursery:
            with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                try:
                    await nursery.start(node.run)
                except (ConnectionError, AdmissionError, RpcError) as e:
                    print(f"shoal node: {e}", file=sys.stderr)
                    return 1
                join_addr = next((a for a in node.sh.addrs if "/127.0.0.1/" not in a), node.sh.addrs[0])
                if node.sh.nat is not None and node.sh.nat.reachability in ("public", "relayed"):
                    join_addr = node.sh.nat.advertised_addrs()[0]  # where a peer dialed us, or our relay
                if args.address_file is not None:
                    write_address_file(args.address_file, node.sh.addrs)
                print(f"shoal node {node.peer_id} ready ({hardware.device_kind}: {hardware.device_name}); "
                      f"others join with: shoal node --join {join_addr}", flush=True)
                if node.sh.nat is not None:
                    print(f"reachability: {node.sh.nat.describe()}", flush=True)
                async for _ in signals:
                    print("leaving the swarm…", file=sys.stderr, flush=True)
                    if args.address_file is not None:
                        args.address_file.unlink(missing_ok=True)
                    node.stop()
                    break
        return 0

    return trio.run(run)


def nat_config(args: argparse.Namespace):
    """Reachability, relays and hole punching for --relay / --no-hole-punch (None with --no-nat)."""
    from shoal.swarm.net.nat import NatConfig
    from shoal.swarm.net.paths import PathConfig
    from shoal.swarm.net.relay import RelayConfig

    if args.no_nat:
        return None
    return NatConfig(relay=RelayConfig(service=args.relay), paths=PathConfig(hole_punch=not args.no_hole_punch))


def run_config(args: argparse.Namespace):
    """The RunConfig for --run: a manifest file (verified), or a run id whose manifest comes from the swarm."""
    from shoal.node.run.config import RunConfig
    from shoal.protocol.manifest import RunManifest
    from shoal.swarm.run.broker import BrokerConfig

    path = Path(args.run)
    manifest, run_id = None, None
    if path.exists():
        manifest = RunManifest.from_toml(path.read_text())
        manifest.verify()
    elif not args.join:
        raise ValueError(f"--run {args.run}: no such manifest file (a run id needs --join)")
    else:
        run_id = args.run
    broker = BrokerConfig.for_fail_after(args.fail_after, dissolve_after_s=args.dissolve_after)
    return RunConfig(manifest=manifest, run_id=run_id, secret=args.secret or os.environ.get("SHOAL_JOIN_SECRET"),
                     device=train_device(args.device), threads=args.threads,
                     max_steps=args.steps, round_timeout_s=args.round_timeout, broker=broker,
                     backup_refresh_s=args.backup_refresh)
