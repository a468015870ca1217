"""`shoal swarm up`: start a whole local swarm on this machine that trains together, show it live, stop it cleanly."""

from __future__ import annotations

import argparse

HELP = "run a whole local swarm on this machine that trains a model together (start here)"
DESCRIPTION = """\
Run a whole shoal swarm on this machine: N node processes on 127.0.0.1, the
first one the bootstrap and the run's broker. By default they train the
built-in tiny GPT on the built-in corpus (the Python standard library's source)
with CocktailSGD: N-1 active replicas and one warm backup. It shows step, loss,
tokens/s, bytes sent and roles live, and stops them all on Ctrl+C.

  shoal swarm up                               # 4 nodes training, until Ctrl+C
  shoal swarm up --dash                        # the same, watched in the dashboard (q stops it)
  shoal swarm up --steps 200 --json            # unattended: stop after 200 synchronized steps
  shoal swarm up --sync diloco --nodes 3       # another synchronizer (allreduce, cocktail, diloco)
  shoal swarm up --no-train --nodes 5 --duration 30 --json   # membership only
  shoal swarm up --stages 2                    # a pipeline: 2 stages x 2 lanes + a backup per stage (6 nodes)

While it runs, other terminals can look at it:  shoal peers --local  ·  shoal dash --local
Kill one node's process (kill -9 PID from the table) and watch the backup take its slot.
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="swarm_command", metavar="ACTION", required=True)
    up = sub.add_parser("up", help="start a local swarm", description=DESCRIPTION,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    up.add_argument("--nodes", type=int, default=None,
                    help="how many nodes (default: 4, 3 active + 1 backup; with --stages S: 3 x S, two lanes and "
                         "a backup per stage)")
    up.add_argument("--backups", type=int, default=None,
                    help="how many of them wait in the backup pool (default: 1; with --stages S: S)")
    up.add_argument("--stages", type=int, default=1, metavar="S",
                    help="pipeline stages: the model is split into S stages across the nodes (default: 1)")
    up.add_argument("--sync", default="cocktail", choices=("allreduce", "cocktail", "diloco", "none"),
                    help="how the replicas stay together (default: cocktail)")
    up.add_argument("--steps", type=int, default=None, metavar="N",
                    help="stop once every active replica has done N synchronized steps")
    up.add_argument("--no-train", action="store_true", help="only form the swarm, do not train")
    up.add_argument("--duration", type=float, default=None, metavar="SECONDS",
                    help="stop after this long (default: run until Ctrl+C, or until --steps)")
    up.add_argument("--json", action="store_true", help="print a final JSON summary on stdout")
    up.add_argument("--dir", type=str, default=None, metavar="PATH",
                    help="where node keys, status files and logs go (default: a new folder under $SHOAL_HOME/swarms)")
    up.add_argument("--dash", action="store_true", help="open the dashboard on the swarm (quitting it stops the swarm)")
    up.add_argument("--device", default="cpu", help="device for every node (default: cpu)")
    up.add_argument("--converge-timeout", type=float, default=90.0, metavar="SECONDS",
                    help="give up if the nodes do not all see each other within this long (default: 90)")


def layout(args: argparse.Namespace) -> tuple[int, int, int]:
    """(nodes, backups, lanes) of the local swarm. With several stages the default is two lanes (so each stage has
    a data-parallel group to synchronize, the smallest that shows both kinds of parallelism) and one backup per
    stage (a killed node of any stage is replaced)."""
    s = args.stages
    backups = args.backups if args.backups is not None else (1 if s == 1 else s)
    nodes = args.nodes if args.nodes is not None else (4 if s == 1 else 3 * s)
    return nodes, backups, (nodes - backups) // s


def write_manifest(args: argparse.Namespace, workdir, replicas: int):
    """The local swarm's run: the tiny model (with at least one layer per stage), `replicas` lanes of
    `args.stages` stages (micro-batches: 4 per stage), signed by node 0's identity."""
    from shoal.protocol import manifest as mf
    from shoal.swarm.net.identity import load_or_create_identity

    steps = max(args.steps or 0, 2000)
    model = mf.ModelSpec.preset("tiny", n_layers=max(args.stages, mf.MODEL_PRESETS["tiny"][0]))
    batch = mf.BatchSpec(batch_size=16, micro_batch_size=16 // (4 * args.stages) if args.stages > 1 else 16)
    m = mf.RunManifest.default(
        "tiny", name="local swarm", model=model, batch=batch,
        plan=mf.ParallelPlan(stages=args.stages, replicas=replicas, pipeline=mf.PipelineSpec(compression="aqsgd" if args.stages > 1 else "none"),
                             sync=mf.SyncSpec(method=args.sync, cocktail=mf.CocktailSpec(warmup_steps=10),
                                              diloco=mf.DilocoSpec(inner_steps=20))),
        optim=mf.OptimSpec(total_steps=steps, warmup_steps=min(50, steps)),
        eval=mf.EvalSpec(every_steps=50, batches=8))
    m = m.signed(load_or_create_identity(workdir / "node0.key"))
    path = workdir / "run.toml"
    path.write_text(m.to_toml())
    return path, m


def _fmt_bytes(n) -> str:
    n = float(n or 0)
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000:
            return f"{n:.0f}{unit}"
        n /= 1000
    return f"{n:.0f}TB"


def _table(swarm, t0: float, converged_after: float | None, training: bool):
    import time

    from rich.table import Table

    title = f"shoal local swarm: {sum(n.alive for n in swarm.nodes)}/{len(swarm.nodes)} nodes, up {time.monotonic() - t0:.0f} s"
    if converged_after is not None:
        title += f", converged in {converged_after:.1f} s"
    t = Table(title=title, caption="Ctrl+C stops the swarm · shoal dash --local")
    cols = ["#", "peer id", "pid", "role", "state", "peers"]
    if training:
        cols += ["slot", "step", "loss", "eval", "tok/s", "sent", "ratio", "links", "hash"]
    for col in cols:
        t.add_column(col, no_wrap=True)
    for r in swarm.summary():
        row = [str(r["index"]), (r["peer_id"] or "…")[-10:], str(r["pid"]), str(r["role"] or ""), str(r["state"]),
               f"{r['peers_seen']}/{len(swarm.nodes) - 1}"]
        if training:
            loss, ev = r.get("loss"), r.get("eval_loss")
            row += [r.get("slot") or "-", str(r.get("step", "-")), f"{loss:.3f}" if loss is not None else "-",
                    f"{ev:.3f}" if ev is not None else "-", f"{r.get('tokens_per_s') or 0:.0f}",
                    _fmt_bytes(r.get("bytes_sent")), f"{r.get('compression_ratio') or 0:.0f}x",
                    _fmt_bytes(r.get("link_bytes_sent")) if r.get("link_bytes_sent") else "-",
                    (r.get("state_hash") or "-")[:8]]
        t.add_row(*row)
    return t


def _all_done(swarm, steps: int) -> bool:
    rows = [r for r in swarm.summary() if r["alive"] and r.get("role") in ("active", "broker") and r.get("slot")]
    return bool(rows) and all(r.get("step", 0) >= steps and r.get("state") == "done" for r in rows)


def main(args: argparse.Namespace) -> int:
    import json
    import os
    import signal
    import sys
    import time
    from pathlib import Path

    from rich.console import Console
    from rich.live import Live

    from shoal.node.cli.node import shoal_home
    from shoal.node.cli.localswarm import LocalSwarm, LocalSwarmConfig
    from shoal.swarm.net.observer import LOCAL_SWARM_FILE

    def on_sigterm(signum, frame):  # stop the nodes by PID, as on Ctrl+C, rather than orphaning them
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_sigterm)
    err = Console(stderr=True)
    training = not args.no_train and args.sync is not None
    nodes, backups, lanes = layout(args)
    if training and lanes < 1:
        err.print(f"shoal swarm up: need at least one lane of {args.stages} active node(s) "
                  f"(--nodes minus --backups at least --stages)")
        return 2
    home = shoal_home()
    workdir = Path(args.dir) if args.dir else home / "swarms" / time.strftime("%Y%m%d-%H%M%S")
    extra: tuple[str, ...] = ()
    try:
        workdir.mkdir(parents=True, exist_ok=True)
        if training:
            run_file, manifest = write_manifest(args, workdir, replicas=lanes)
            extra = ("--run", str(run_file), "--threads", "1", "--round-timeout", "10", "--fail-after", "8")
            if args.steps is not None:
                extra += ("--steps", str(args.steps))
            shape = f"{lanes} replicas" if args.stages == 1 else f"{args.stages} stages x {lanes} lanes"
            err.print(f"run {manifest.run_id[:16]}…: tiny GPT, {shape} with {args.sync}, {backups} backup(s)")
        swarm = LocalSwarm(LocalSwarmConfig(nodes=nodes, workdir=workdir, home=home, device=args.device,
                                            extra_node_args=extra))
    except (ValueError, OSError) as e:
        err.print(f"shoal swarm up: {e}")
        return 2
    interactive = sys.stderr.isatty() and not args.json
    local_file = home / LOCAL_SWARM_FILE
    t0 = time.monotonic()
    converged_after = None
    code = 0
    try:
        err.print(f"starting {nodes} nodes in {workdir} …")
        swarm.start()
        converged_after = swarm.wait_converged(args.converge_timeout)
        local_file.write_text(json.dumps({"pid": os.getpid(), "bootstrap": swarm.bootstrap_addrs(),
                                          "workdir": str(workdir)}))
        err.print(f"all {nodes} nodes see each other after {converged_after:.1f} s; "
                  f"bootstrap: {swarm.bootstrap_addrs()[0]}", soft_wrap=True)
        end = t0 + args.duration if args.duration is not None else float("inf")

        def running() -> bool:
            if time.monotonic() >= end:
                return False
            return not (training and args.steps is not None and _all_done(swarm, args.steps))

        if args.dash:
            import subprocess

            dash = subprocess.Popen([sys.executable, "-m", "shoal.node.cli", "dash", "--local"])
            while dash.poll() is None and running():
                time.sleep(0.3)
            if dash.poll() is None:
                dash.terminate()
                dash.wait()
        elif interactive:
            with Live(_table(swarm, t0, converged_after, training), console=err, refresh_per_second=2) as live:
                while running():
                    time.sleep(0.5)
                    live.update(_table(swarm, t0, converged_after, training))
        else:
            last = 0.0
            while running():
                time.sleep(0.5)
                if training and time.monotonic() - last > 10:
                    last = time.monotonic()
                    steps = [r.get("step", 0) for r in swarm.summary() if r.get("slot")]
                    err.print(f"{time.monotonic() - t0:.0f} s: steps {steps}")
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
        print(json.dumps({"converged_after_s": converged_after, "workdir": str(workdir), "nodes": summary}, indent=1))
    else:
        err.print(_table(swarm, t0, converged_after, training) if training else "")
        err.print(f"stopped {len(codes)} nodes (exit codes {sorted(set(codes.values()))}); logs in {workdir}")
    return code
