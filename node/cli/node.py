"""`shoal node`: run a node daemon that joins a swarm and stays until Ctrl+C or SIGTERM."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from shoal.node import defaults
from shoal.swarm.run.batchsplit import SplitConfig as SplitDefaults

HELP = "run a node: join a swarm (or start one) and stay until Ctrl+C"
DESCRIPTION = """\
Run a shoal node. Without --join it starts a new swarm and prints the address
others use to join it; with --join it joins an existing swarm.

  shoal node                                   # first node of a new swarm
  shoal node --join /ip4/192.0.2.7/tcp/4001/p2p/12D3KooW...   # join it and train in its open run
  shoal node --join ADDR --run NAME            # the run of that name (or an id prefix: shoal runs --join ADDR)
  shoal node --join ADDR --no-train            # only join the swarm (a relay, a bootstrap)

The node keeps its identity (its peer id) in --identity (created on first run;
a second node on this machine gets identity-2.key, … unless given its own).
To be reachable from other machines, listen on all interfaces with a fixed port:
  shoal node --listen /ip4/0.0.0.0/tcp/4001
It prints what it is doing: start-up steps, then a status line every few seconds.
Libraries' messages go to the log file only (--log-file; -v shows them here too).
Ctrl+C, SIGTERM or SIGHUP leaves the swarm cleanly (a leave notice, then exit 0).
"""


def shoal_home() -> Path:
    return Path(os.environ.get("SHOAL_HOME", "~/.shoal")).expanduser()


def add_common_network_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--join", action="append", default=[], metavar="MULTIADDR|@FILE",
                   help="address of a node in the swarm, with its /p2p/ peer id (repeatable); @FILE reads them "
                        "from a file, one per line (another node's --address-file)")
    p.add_argument("--join-wait", type=float, default=60.0, metavar="SECONDS",
                   help="how long to wait for a --join @FILE to appear (default: %(default)g)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_common_network_arguments(p)
    p.add_argument("--listen", default="/ip4/0.0.0.0/tcp/0", metavar="MULTIADDR",
                   help="where to listen (default: all interfaces, a free port); a fixed port another process holds "
                        "is refused")
    p.add_argument("--identity", type=Path, default=None, metavar="PATH",
                   help="Ed25519 key file, created on first run (default: $SHOAL_HOME/identity.key, or "
                        "identity-2.key, … when another node here runs with it)")
    p.add_argument("--device", default="auto", metavar="DEVICE",
                   help="where to train: auto (CUDA, else MPS, else the CPU), cpu, cuda, cuda:N or mps "
                        "(default: %(default)s)")
    p.add_argument("--log-file", type=Path, default=None, metavar="PATH",
                   help="the node's log, libraries' messages included (default: $SHOAL_HOME/logs/node-PEERID.log; "
                        "printed at start)")
    p.add_argument("--print-every", type=float, default=5.0, metavar="SECONDS",
                   help="print a status line this often, 0 for never (default: %(default)g)")
    p.add_argument("--address-file", type=Path, default=None, metavar="PATH",
                   help="once ready, write the addresses others join this node with to PATH (for --join @PATH)")
    p.add_argument("--status-file", type=Path, default=None, metavar="PATH",
                   help="rewrite a JSON file with peer_id, addrs, peers and state every few seconds")
    p.add_argument("--metrics", default=None, metavar="ADDR:PORT",
                   help="serve Prometheus metrics at http://ADDR:PORT/metrics (step, loss, held-out loss, tokens/s, "
                        "bytes per channel, ...; PORT alone binds 127.0.0.1; default: off)")
    p.add_argument("--metrics-file", default=None, metavar="PATH",
                   help="append the same figures as JSON lines every status interval, rotated at 16 MB "
                        "(default: $SHOAL_HOME/metrics/node-PEERID.jsonl; 'none' for no file)")
    p.add_argument("--status-interval", type=float, default=2.0, metavar="SECONDS",
                   help="how often to publish status (default: %(default)g)")
    p.add_argument("--gone-after", type=float, default=12.0, metavar="SECONDS",
                   help="a peer silent this long is marked gone (default: %(default)g)")
    p.add_argument("--probe-every", type=float, default=10.0, metavar="SECONDS",
                   help="in a run: probe one peer whose link this node has not measured this often "
                        "(default: %(default)g)")
    p.add_argument("--link-report-every", type=float, default=30.0, metavar="SECONDS",
                   help="in a run: publish this node's link figures this often when one moved by 20 %% "
                        "(default: %(default)g)")
    p.add_argument("--parent", type=int, default=None, metavar="PID",
                   help="leave the swarm when process PID exits (how `shoal swarm up` keeps its nodes from "
                        "outliving it)")
    n = p.add_argument_group("behind a NAT")
    n.add_argument("--relay", default="auto", choices=("auto", "on", "off"),
                   help="relay for peers behind NATs: auto (when this node is publicly dialable), on, off "
                        "(default: %(default)s)")
    n.add_argument("--no-hole-punch", action="store_true",
                   help="do not try to upgrade relayed connections to direct ones (DCUtR)")
    n.add_argument("--no-nat", action="store_true",
                   help="no reachability checks, relays or hole punching at all (a plain host)")
    t = p.add_argument_group("training")
    t.add_argument("--run", default=None, metavar="RUN.toml|NAME|ID",
                   help="train in this run: a manifest file (the first node with it hosts the broker) or, with "
                        "--join, the name, id or a unique id prefix of a run the swarm advertises (shoal runs "
                        "--join ADDR lists them). Default with --join: the swarm's open run, when it has exactly one "
                        "(the node waits while it has none)")
    t.add_argument("--no-train", action="store_true",
                   help="with --join and no --run: only join the swarm, never train")
    t.add_argument("--secret", default=None, help="the run's join secret, for a private run "
                                                  "(or set SHOAL_JOIN_SECRET)")
    t.add_argument("--steps", type=int, default=None, metavar="N", help="stop training after N steps")
    t.add_argument("--data", default=None, metavar="PATH",
                   help="this machine's copy of the run's corpus (.txt/.jsonl file or folder), for a run whose "
                        "manifest names a local path: a run joined by id never reads a path its manifest names")
    t.add_argument("--threads", type=int, default=None, metavar="N", help="torch CPU threads (default: torch's)")
    t.add_argument("--round-timeout", type=float, default=defaults.ROUND_TIMEOUT_S, metavar="SECONDS",
                   help="a replica not heard within this long is dropped from a synchronization round "
                        "(default: %(default)g)")
    t.add_argument("--fail-after", type=float, default=defaults.FAIL_AFTER_S, metavar="SECONDS",
                   help="an active node (or the broker) silent this long is replaced (default: %(default)g)")
    t.add_argument("--dissolve-after", type=float, default=defaults.DISSOLVE_AFTER_S, metavar="SECONDS",
                   help="a pipeline lane whose empty slot no backup can fill for this long is dissolved and its "
                        "nodes return to the backup pool (default: %(default)g; the broker's setting)")
    t.add_argument("--replan-every", type=float, default=30.0, metavar="SECONDS",
                   help="a run placed by the network (the default): re-plan who sits where this often, and soon "
                        "after nodes join or leave (default: %(default)g; the broker's setting)")
    t.add_argument("--move-every", type=float, default=60.0, metavar="SECONDS",
                   help="... and move at most one lane towards a better plan this often; a node moved stays put "
                        "for 10 minutes (default: %(default)g; the broker's setting)")
    t.add_argument("--split-every", type=float, default=SplitDefaults().every_s, metavar="SECONDS",
                   help="the global batch's split across replicas follows a speed difference that has held this "
                        "long: a lastingly faster or slower replica gets a bigger or smaller share, one whose speed "
                        "only wanders does not (default: %(default)g; the broker's setting)")
    t.add_argument("--backup-refresh", type=float, default=defaults.BACKUP_REFRESH_S, metavar="SECONDS",
                   help="a backup refreshes its warm copy of the run's state this often, so a promotion pulls only "
                        "the group's synchronized state (default: %(default)g; raise it for big models)")
    t.add_argument("--checkpoint-dir", type=Path, default=None, metavar="DIR",
                   help="where this node writes its slot's checkpoints, as the run's [checkpoint] says (default: "
                        "$SHOAL_HOME/checkpoints; a folder per run, one per slot)")
    t.add_argument("--resume", type=Path, default=None, metavar="DIR",
                   help="go on with a stopped run from its last complete checkpoint in DIR (a --checkpoint-dir, or "
                        "one run's folder in it): the run's owner restarts the run there (without --run, the "
                        "manifest comes from DIR), and any node takes its slot back with its own checkpoint")
    t.add_argument("--min-step-time", type=float, default=0.0, metavar="SECONDS",
                   help="pace training: every step takes at least this long, as a slower model's would (for tests "
                        "and benchmarks on a fast machine; default: 0, no pacing)")


PARENT_POLL_S = 0.2  # a node started with --parent notices within this long that its parent is gone


def _say(text: str) -> None:
    """One line of the node's output; a closed stdout (`shoal node | head`) silences it, it does not stop the node."""
    try:
        print(text, flush=True)
    except (BrokenPipeError, ValueError):
        pass


def main(args: argparse.Namespace) -> int:
    from shoal.node.cli.datasource import typed_data
    from shoal.node.cli.errors import CliError, Exit
    from shoal.node.cli.joinfile import expand_join

    if args.parent is not None and os.getppid() != args.parent:
        raise CliError(f"the process that started this node (pid {args.parent}) is gone", Exit.INTERRUPTED, hint="")
    import faulthandler
    import signal

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # kill -USR1 PID: every thread's stack, for a bug report
    home = shoal_home()
    if any(v.startswith("@") and not os.path.exists(v[1:]) for v in args.join):
        preload(train=not args.no_train)  # the node that writes the file is still starting: import meanwhile
    join = expand_join(args.join, args.join_wait)  # typed input is checked before anything runs
    if args.data is not None:
        args.data = typed_data(args.data)
    check_device(args.device)
    lock, key = identity(args, home)
    from shoal.protocol.display import short_id
    from shoal.swarm.net.identity import peer_id_of

    peer_id = peer_id_of(key)
    log_path = args.log_file or home / "logs" / f"node-{short_id(peer_id)}.log"
    try:
        args.log_file_handler.open(log_path)
        where = f"log: {log_path}"
    except OSError as e:
        if args.log_file is not None:
            raise CliError(f"--log-file {log_path}: {e.strerror or e}") from None
        where = f"no log file ({log_path}: {e.strerror or e}; --log-file chooses one)"
    _say(f"shoal node {peer_id} (identity {lock.key_path}); {where}")
    _say("probing hardware…")
    device, free = args.device, None
    run = None
    if (args.run is not None or args.resume is not None) and args.no_train:
        raise CliError("--run and --resume do not go together with --no-train")
    if args.resume is not None and args.run is None:
        args.run = str(resume_manifest(args.resume))
    if args.run is not None or (join and not args.no_train):
        device, free = resolve_training_device(args.device)
        run = run_config(args, join, device, free)
    from shoal.node.train.hardware import hardware_profile

    try:
        hardware = hardware_profile(device, home)
    except RuntimeError as e:
        raise CliError(str(e), Exit.FAILED, hint="shoal doctor checks this machine") from None
    from shoal.node.daemon import NodeConfig, status_gossip_s
    from shoal.node.links import LinksConfig
    from shoal.swarm.net.linkprobe import ProbeConfig
    from shoal.swarm.net.host import HostConfig
    from shoal.swarm.net.membership import MembershipConfig
    from shoal.swarm.net.recent_peers import recent_peers_path

    from shoal.node.metrics import parse_listen

    try:
        metrics_listen = parse_listen(args.metrics) if args.metrics else None
        metrics_file = None if args.metrics_file == "none" else \
            Path(args.metrics_file) if args.metrics_file else home / "metrics" / f"node-{short_id(peer_id)}.jsonl"
        config = NodeConfig(
            metrics_listen=metrics_listen,
            metrics_file=metrics_file,
            run=run,
            host=HostConfig(listen=args.listen, join=tuple(join), nat=nat_config(args)),
            identity=lock.key_path,
            peers_file=recent_peers_path(lock.key_path),
            device=args.device,
            home=home,
            status_file=args.status_file,
            status_interval_s=args.status_interval,
            links=LinksConfig(probe=ProbeConfig(interval_s=args.probe_every), report_s=args.link_report_every,
                              renew_s=max(120.0, args.link_report_every)),
            membership=MembershipConfig(  # suspect once a gossiped status is overdue by half a period
                suspect_after_s=min(1.5 * status_gossip_s(args.status_interval, args.gone_after,
                                                          run.broker.fail_after_s if run else None), args.gone_after),
                gone_after_s=args.gone_after),
        )
    except ValueError as e:
        raise CliError(str(e)) from None
    if metrics_listen is not None:
        _say(f"metrics: http://{metrics_listen[0]}:{metrics_listen[1]}/metrics (Prometheus)")
    if run is None:
        _say(f"device: {hardware.device_kind} ({hardware.device_name}); no run to train"
             + (" (--no-train)" if args.no_train else " (--run RUN.toml starts one)"))
    elif run.manifest is not None:
        from shoal.node.cli.progress import describe_run

        _say(describe_run(run.manifest, device, free))
    try:  # a run joined by id is described when its manifest arrives
        return serve(args, config, hardware, key, device if run is not None and run.manifest is None else None,
                     free)
    finally:
        lock.release()


def preload(*, train: bool) -> None:
    """Import the modules a node needs (torch and py-libp2p: about 3.5 s of a core) before it waits for a --join
    @FILE, so that a swarm's nodes started together with its first one are ready when its address is written."""
    import shoal.node.daemon  # noqa: F401

    if train:
        import torch  # noqa: F401


def identity(args: argparse.Namespace, home: Path):
    """The locked identity file and its key: --identity, or the first free default one."""
    from shoal.node.cli.errors import CliError, Exit
    from shoal.node.identity_lock import default_identity, lock_identity
    from shoal.swarm.net.identity import IdentityError, load_or_create_identity

    try:
        lock = lock_identity(args.identity, home) if args.identity is not None else default_identity(home)
    except OSError as e:
        raise CliError(f"identity {args.identity or home}: {e.strerror or e}", Exit.IDENTITY_UNUSABLE) from None
    try:
        return lock, load_or_create_identity(lock.key_path)
    except IdentityError as e:
        lock.release()
        raise CliError(str(e), Exit.IDENTITY_UNUSABLE) from None
    except OSError as e:
        lock.release()
        raise CliError(f"identity {lock.key_path}: cannot read it: {e.strerror or e}", Exit.IDENTITY_UNUSABLE) from None


def check_device(flag: str) -> None:
    """A named device (cuda, cuda:N, mps) must be on this machine before anything else runs (DeviceUnavailable:
    exit 9); `auto` and `cpu` always are, and need no torch import here."""
    if flag not in ("auto", "cpu"):
        resolve_training_device(flag)


def resolve_training_device(flag: str) -> tuple[str, int]:
    """The device a run trains on (auto: CUDA, MPS, else the CPU) and its free memory now."""
    from shoal.node.cli.errors import CliError
    from shoal.node.train.device import DeviceUnavailable, free_memory_bytes, resolve_device

    try:
        dev = resolve_device(flag)
    except DeviceUnavailable:
        raise
    except ValueError as e:
        raise CliError(str(e)) from None
    return str(dev), free_memory_bytes(dev)


def serve(args: argparse.Namespace, config, hardware, key, device: str | None, free: int | None) -> int:
    """Run the node until a signal (a clean leave, exit 0) or a failure (raised). A signal before the node is up
    stops the start-up at once (KeyboardInterrupt: exit 130)."""
    import functools
    import signal
    import sys

    import trio

    from shoal.node.cli.joinfile import write_address_file
    from shoal.node.cli.progress import print_progress
    from shoal.node.daemon import Node

    async def run() -> bool:
        node = Node(config, hardware, key=key)
        if sys.stdin.isatty() and sys.stdout.isatty():
            node.choose_run = ask_which_run
        up, interrupted, announced = False, False, trio.Event()
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM, signal.SIGHUP) as signals:
            async with trio.open_nursery() as nursery:
                async def on_signals() -> None:
                    nonlocal interrupted
                    async for _ in signals:
                        if not up or node.state == "leaving":  # not up yet, or a second Ctrl+C: stop now
                            interrupted = True
                            nursery.cancel_scope.cancel()
                            return
                        print("leaving the swarm…", file=sys.stderr, flush=True)
                        if args.address_file is not None:
                            args.address_file.unlink(missing_ok=True)
                        node.stop()

                async def watch_parent() -> None:
                    while os.getppid() == args.parent:
                        await trio.sleep(PARENT_POLL_S)
                    _say(f"the process that started this node (pid {args.parent}) is gone; leaving the swarm…")
                    node.stop(hurry=True)  # its swarm is going too

                async def run_node(task_status=trio.TASK_STATUS_IGNORED) -> None:
                    await node.run(task_status=task_status)
                    nursery.cancel_scope.cancel()  # left: stop the helpers

                nursery.start_soon(on_signals)
                if args.parent is not None:
                    nursery.start_soon(watch_parent)
                nursery.start_soon(functools.partial(print_progress, node, args.print_every, _say, device=device,
                                                     free_bytes=free, announced=announced))
                await nursery.start(run_node)
                up = True
                if args.address_file is not None:
                    write_address_file(args.address_file, node.sh.addrs)
                _say(ready_line(node))
                announced.set()
        return interrupted

    if trio.run(run):
        raise KeyboardInterrupt
    return 0


async def ask_which_run(runs):
    """The person at the terminal picks one of several open runs (None: none, and the node is refused)."""
    import trio

    _say(f"this swarm has {len(runs)} open runs:")
    for i, r in enumerate(runs, 1):
        _say(f"  {i}) {r.describe()}")

    def ask() -> str:
        try:
            return input(f"join which one? [1-{len(runs)}, Enter for none] ")
        except EOFError:
            return ""

    answer = (await trio.to_thread.run_sync(ask, abandon_on_cancel=True)).strip()
    return runs[int(answer) - 1] if answer.isdigit() and 1 <= int(answer) <= len(runs) else None


def ready_line(node) -> str:
    """The node's join addresses: dialable ones first (a wildcard listen address listed per interface; behind a
    NAT, where a peer dialed us or our relay), and what the NAT traversal found."""
    addrs = node.sh.addrs
    public = [a for a in addrs if "/127.0.0.1/" not in a] or addrs
    nat = node.sh.nat
    if nat is not None and nat.reachability in ("public", "relayed"):
        public = nat.advertised_addrs()[:1] + public
    more = [a for a in addrs if a != public[0]]
    also = f"\n  also reachable at: {', '.join(more[:4])}" if more else ""
    reach = f"\nreachability: {nat.describe()}" if nat is not None else ""
    return f"ready; others join with: shoal node --join {public[0]}{also}{reach}"


def nat_config(args: argparse.Namespace):
    """Reachability, relays and hole punching for --relay / --no-hole-punch (None with --no-nat)."""
    from shoal.swarm.net.nat import NatConfig
    from shoal.swarm.net.paths import PathConfig
    from shoal.swarm.net.relay import RelayConfig

    if args.no_nat:
        return None
    return NatConfig(relay=RelayConfig(service=args.relay), paths=PathConfig(hole_punch=not args.no_hole_punch))


def run_config(args: argparse.Namespace, join: list[str], device: str, free: int):
    """The RunConfig for --run: a manifest file (verified, checked against this node's device), or a run id whose
    manifest comes from the swarm (checked when it arrives)."""
    from shoal.node.cli.errors import CliError
    from shoal.node.run.config import RunConfig
    from shoal.node.run.preflight import check_inputs, preflight
    from shoal.protocol.errors import ProtocolError
    from shoal.protocol.manifest import RunManifest
    from shoal.swarm.run.broker import BrokerConfig
    from shoal.swarm.run.replan import ReplanConfig

    manifest, run_id, select = None, None, ""  # no --run: the swarm's open run
    if args.run is not None:
        path = Path(args.run)
        if path.exists():
            try:
                manifest = RunManifest.from_toml(path.read_text())
                manifest.verify()
            except (OSError, ProtocolError, ValueError) as e:
                raise CliError(f"--run {args.run}: not a valid signed manifest: {e}") from None
            select = None
        elif not join or path.suffix == ".toml" or "/" in args.run:
            raise CliError(f"--run {args.run}: no such manifest file"
                           + ("" if join else " (a run's name or id needs --join)"))
        elif args.resume is not None:
            run_id, select = args.run, None  # resuming: the run's full id (its checkpoints are filed under it)
        else:
            select = args.run
    resume = None
    if args.resume is not None:
        resume = resume_root(args.resume, manifest.run_id if manifest is not None else args.run)
    try:
        config = RunConfig(manifest=manifest, run_id=run_id, select=select,
                           secret=args.secret or os.environ.get("SHOAL_JOIN_SECRET"), device=device,
                           device_free_bytes=free, threads=args.threads, max_steps=args.steps, data=args.data,
                           round_timeout_s=args.round_timeout,
                           broker=BrokerConfig.for_fail_after(args.fail_after, dissolve_after_s=args.dissolve_after,
                                                              split=SplitDefaults(every_s=args.split_every)),
                           backup_refresh_s=args.backup_refresh, min_step_s=args.min_step_time,
                           aq_buffer_dir=str(shoal_home() / "aq"), blob_dir=str(shoal_home() / "blobs"),
                           checkpoint_dir=str(args.checkpoint_dir or shoal_home() / "checkpoints"),
                           resume_dir=None if resume is None else str(resume),
                           replan=ReplanConfig(check_s=args.replan_every, period_s=args.move_every))
    except ValueError as e:
        raise CliError(str(e)) from None
    if manifest is not None:
        preflight(manifest, config)
        check_inputs(manifest, config.data or manifest.data.source)  # packages, the Hub: before the node starts
    return config


def resume_manifest(path: Path) -> Path:
    """The manifest file of the one run whose checkpoints --resume names (CliError when there is not exactly one)."""
    from shoal.node.cli.errors import CliError
    from shoal.node.run.checkpoints import MANIFEST_FILE, find_run_dirs

    found = find_run_dirs(path)
    if len(found) != 1:
        raise CliError(f"--resume {path}: " + (f"holds the checkpoints of {len(found)} runs" if found else
                                               "holds no run's checkpoints (no run.toml in it or under it)"),
                       hint="name one run's folder, or say which run with --run")
    return found[0] / MANIFEST_FILE


def resume_root(path: Path, run_id: str) -> Path:
    """The checkpoint folder (the one holding run folders) of --resume for `run_id`."""
    from shoal.node.cli.errors import CliError
    from shoal.node.run.checkpoints import run_dir

    path = path.expanduser()
    for root in (path.parent, path):
        if run_dir(root, run_id).is_dir():
            return root
    raise CliError(f"--resume {path}: no checkpoints of run {run_id[:16]}… there")
