"""`shoal swarm up|down|status`: a whole local swarm on this machine that trains together, shown live, stopped
cleanly (never orphaned), and found again from another terminal."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

HELP = "run a whole local swarm on this machine that trains a model together (start here)"
DESCRIPTION = """\
A whole shoal swarm on this machine.

  shoal swarm up          start one and show it live (Ctrl+C stops it)
  shoal swarm status      show the one running here (from another terminal)
  shoal swarm down        stop the one running here (its terminal is gone, say)
"""
UP_DESCRIPTION = """\
Run a whole shoal swarm on this machine: N node processes on 127.0.0.1, the
first one the bootstrap and the run's broker. By default they train the
built-in tiny GPT on the built-in corpus (the Python standard library's source)
with CocktailSGD: N-1 active replicas and one warm backup. It shows step, loss,
tokens/s, bytes sent and roles live, and stops them all on Ctrl+C, SIGTERM or
SIGHUP (a closed terminal); a node whose supervisor is gone leaves by itself.

  shoal swarm up                               # 4 nodes training, until Ctrl+C
  shoal swarm up --dash                        # the same, watched in the dashboard (q stops it)
  shoal swarm up --steps 200 --json            # unattended: stop after 200 synchronized steps
  shoal swarm up --sync diloco --nodes 3       # another synchronizer (allreduce, cocktail, diloco)
  shoal swarm up --no-train --nodes 5 --duration 30 --json   # membership only
  shoal swarm up --stages 2                    # a pipeline: 2 stages x 2 lanes + a backup per stage (6 nodes)
  shoal swarm up --listen /ip4/0.0.0.0/tcp/4001   # joinable from other machines (it prints the command)
  shoal swarm up --resume DIR --steps 400      # go on with a stopped one from its last complete checkpoint

While it runs, other terminals can look at it:  shoal peers --local  ·  shoal dash --local
Kill one node's process (kill -9 PID from the table) and watch the backup take its slot.
Each node's output is in DIR/nodeN.out, its log in DIR/nodeN.log, its metrics (JSON lines) in
DIR/nodeN.metrics.jsonl (DIR: --dir); every active node writes its slot's checkpoints under DIR/checkpoints (the
run's [checkpoint] every_steps, and at the end): `shoal export DIR --out MODEL` takes the trained model away,
`shoal swarm up --resume DIR` goes on from them.
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="swarm_command", metavar="ACTION", required=True)
    up = sub.add_parser("up", help="start a local swarm and show it live", description=UP_DESCRIPTION,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    up.add_argument("--nodes", type=int, default=None,
                    help="how many nodes (default: 4, 3 active + 1 backup; with --stages S: 3 x S, two lanes and "
                         "a backup per stage)")
    up.add_argument("--backups", type=int, default=None,
                    help="how many of them wait in the backup pool (default: 1; with --stages S: S)")
    up.add_argument("--stages", type=int, default=1, metavar="S",
                    help="pipeline stages: the model is split into S stages across the nodes (default: %(default)s)")
    up.add_argument("--sync", default="cocktail", choices=("allreduce", "cocktail", "diloco", "none"),
                    help="how the replicas stay together (default: %(default)s)")
    up.add_argument("--steps", type=int, default=None, metavar="N",
                    help="stop once every active replica has done N synchronized steps")
    up.add_argument("--no-train", action="store_true", help="only form the swarm, do not train")
    up.add_argument("--duration", type=float, default=None, metavar="SECONDS",
                    help="stop after this long (default: run until Ctrl+C, or until --steps)")
    up.add_argument("--json", action="store_true",
                    help="print a final JSON summary on stdout: the run (steps, wall time, steps/s, whether the "
                         "replicas' hashes agree, held-out loss) and every node")
    up.add_argument("--dir", type=str, default=None, metavar="PATH",
                    help="where node keys, status files, output and logs go (default: a new folder under "
                         "$SHOAL_HOME/swarms)")
    up.add_argument("--keep-dirs", type=int, default=KEEP_DIRS, metavar="N",
                    help="keep the folders of the last N swarms under $SHOAL_HOME/swarms, removing older ones as a "
                         "new one starts (not with --dir; default: %(default)s)")
    up.add_argument("--dash", action="store_true", help="open the dashboard on the swarm (quitting it stops the swarm)")
    up.add_argument("--resume", type=str, default=None, metavar="DIR",
                    help="go on with the run a stopped `shoal swarm up` left in DIR, from its last complete "
                         "checkpoint: the same run, nodes (their keys) and step; --steps N is then the step to "
                         "reach, counted from the run's start")
    up.add_argument("--device", default="cpu", metavar="DEVICE",
                    help="device for every node: cpu, cuda, cuda:N, mps or auto (default: %(default)s; the nodes "
                         "share it)")
    up.add_argument("--listen", default=None, metavar="MULTIADDR",
                    help="let other machines join: node 0 listens here (e.g. /ip4/0.0.0.0/tcp/4001, a fixed port), "
                         "the others on the same interface (default: 127.0.0.1, this machine only)")
    up.add_argument("--converge-timeout", type=float, default=90.0, metavar="SECONDS",
                    help="give up if the nodes do not all see each other within this long (default: %(default)g)")
    down = sub.add_parser("down", help="stop the local swarm `shoal swarm up` runs on this machine",
                          description="Stop the local swarm started by `shoal swarm up` with this $SHOAL_HOME: its "
                                      "supervisor, then any of its nodes still running, by PID.")
    down.add_argument("--timeout", type=float, default=30.0, metavar="SECONDS",
                      help="how long the nodes get to leave cleanly before they are killed (default: %(default)g)")
    status = sub.add_parser("status", help="show the local swarm `shoal swarm up` runs on this machine",
                            description="Show the local swarm started by `shoal swarm up` with this $SHOAL_HOME: "
                                        "its supervisor and every node (pid, role, step, loss, …).")
    status.add_argument("--json", action="store_true", help="print it as JSON")


KEEP_DIRS = 10  # swarm folders kept under $SHOAL_HOME/swarms
DIR_NAME = re.compile(r"\d{8}-\d{6}(-\d+)?")  # the folders `swarm up` names (and so may remove)


def new_swarm_dir(root: Path, keep: int, now: float) -> tuple[Path, list[Path]]:
    """A new folder for a swarm under `root` (named by the time, never one that exists), and the older folders
    `swarm up` made there removed so that `keep` remain with the new one: (new folder, removed folders)."""
    import shutil
    import time

    root.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    path, n = root / stamp, 1
    while True:
        try:
            path.mkdir()
            break
        except FileExistsError:  # two swarms started within a second
            n += 1
            path = root / f"{stamp}-{n}"
    ours = sorted((p for p in root.iterdir() if p.is_dir() and DIR_NAME.fullmatch(p.name) and p != path),
                  key=lambda p: (p.stat().st_mtime, p.name))
    removed = ours[: max(0, len(ours) - (keep - 1))]
    for old in removed:
        shutil.rmtree(old, ignore_errors=True)
    return path, removed


def layout(args: argparse.Namespace) -> tuple[int, int, int]:
    """(nodes, backups, lanes) of the local swarm. With several stages the default is two lanes (so each stage has
    a data-parallel group to synchronize, the smallest that shows both kinds of parallelism) and one backup per
    stage (a killed node of any stage is replaced)."""
    s = args.stages
    backups = args.backups if args.backups is not None else (1 if s == 1 else s)
    nodes = args.nodes if args.nodes is not None else (4 if s == 1 else 3 * s)
    return nodes, backups, (nodes - backups) // s


MAX_LOCAL_LANES = 16  # a local swarm's run seats volunteers (from this machine or, with --listen, others) up to this


def write_manifest(args: argparse.Namespace, workdir, replicas: int, backups: int = 0):
    """The local swarm's run: the tiny model (with at least one layer per stage), `replicas` lanes of
    `args.stages` stages (micro-batches: 4 per stage), a global batch of 16 sequences per starting lane, room for
    volunteers up to MAX_LOCAL_LANES lanes once each stage keeps `backups` warm backups; signed by node 0's
    identity."""
    from shoal.protocol import manifest as mf
    from shoal.swarm.net.identity import load_or_create_identity

    steps = max(args.steps or 0, 2000)
    model = mf.ModelSpec.preset("tiny", n_layers=max(args.stages, mf.MODEL_PRESETS["tiny"][0]))
    mbs = 16 // (4 * args.stages) if args.stages > 1 else 16
    batch = mf.BatchSpec(batch_size=16, micro_batch_size=mbs, global_batch=16 * replicas)
    m = mf.RunManifest.default(
        "tiny", name="local swarm", model=model, batch=batch,
        plan=mf.ParallelPlan(stages=args.stages, replicas=replicas,
                             max_replicas=replicas if args.sync == "none" else mf.default_max_replicas(
                                 replicas, batch.global_batch, mf.lane_granule(args.stages, mbs), MAX_LOCAL_LANES),
                             backups=backups // args.stages,
                             pipeline=mf.PipelineSpec(compression="aqsgd" if args.stages > 1 else "none"),
                             sync=mf.SyncSpec(method=args.sync, cocktail=mf.CocktailSpec(warmup_steps=10),
                                              diloco=mf.DilocoSpec(inner_steps=20))),
        optim=mf.OptimSpec(total_steps=steps, warmup_steps=min(50, steps)),
        eval=mf.EvalSpec(every_steps=50, batches=8))
    m = m.signed(load_or_create_identity(workdir / "node0.key"))
    path = workdir / "run.toml"
    path.write_text(m.to_toml())
    return path, m


def resumed_layout(args: argparse.Namespace) -> tuple[int, int, int]:
    """(nodes, backups, lanes) of the stopped swarm in --resume DIR, read from its run.toml and node keys; checks
    that its checkpoints hold a step to go on from (CliError when not). Sets args.stages, args.resumed (the
    manifest) and args.resume_step."""
    from pathlib import Path

    from shoal.node.cli.errors import CliError
    from shoal.node.run.checkpoints import resume_point
    from shoal.protocol.errors import ProtocolError
    from shoal.protocol.manifest import RunManifest

    d = Path(args.resume)
    try:
        m = RunManifest.from_toml((d / "run.toml").read_text())
        m.verify()
    except (OSError, ProtocolError, ValueError) as e:
        raise CliError(f"--resume {d}: not a `shoal swarm up` folder with a signed run.toml ({e})") from None
    point = resume_point(d / "checkpoints", m.run_id, m.plan.stages)
    if point is None:
        raise CliError(f"--resume {d}: no checkpoint of every stage of run {m.run_id[:16]}… under {d}/checkpoints",
                       hint="checkpoints are written every [checkpoint] every_steps and at a run's end")
    keys = len(list(d.glob("node*.key")))
    nodes = args.nodes if args.nodes is not None else max(keys, m.plan.stages * m.plan.replicas)
    args.stages, args.resumed, args.resume_step = m.plan.stages, m, point.step
    lanes = m.plan.replicas
    return nodes, max(0, nodes - lanes * m.plan.stages), lanes


def table(rows: list[dict], nodes: int, title: str, training: bool):
    """The swarm as a table that fits 80 columns: one row per node (peer ids shortened as in the dashboard, sizes in
    MB as everywhere); a node whose process ended says it is gone and keeps only what it last reached. A pipeline
    shows the bytes its stages sent along their lanes (links) instead of the peer count."""
    from rich import box
    from rich.table import Table

    from shoal.protocol.display import nbytes, short_id, si

    pipeline = training and any(r.get("link_bytes_sent") for r in rows)
    caption = None
    if training:
        evals = [r["eval_loss"] for r in rows if r.get("eval_loss") is not None and r["alive"]]
        caption = ((f"held-out loss {min(evals):.3f} · " if evals else "")
                   + "ratio: raw/sent bytes since start, incl. warm-up")

    def cells(r: dict) -> dict[str, str]:
        gone = not r["alive"]
        state = str(r["state"] or "-") if not gone else "gone"
        if gone and not training and r.get("exit") not in (None, "gone"):
            state = f"gone ({r['exit']})"
        c = {"#": str(r["index"]), "peer": short_id(r["peer_id"]) if r["peer_id"] else "…", "pid": str(r["pid"]),
             "role": str(r["role"] or "-"), "state": state,
             "peers": "-" if gone else f"{r['peers_seen']}/{nodes - 1}"}
        if training:  # a gone node keeps what it last reached, but no slot: that is someone else's now
            loss, ratio = r.get("loss"), r.get("compression_ratio")
            c.update({"slot": "-" if gone else (r.get("slot") or "-"), "step": str(r.get("step", "-")),
                      "loss": f"{loss:.2f}" if loss is not None else "-",
                      "tok/s": "-" if gone else si(r.get("tokens_per_s") or 0, digits=2),
                      "sent": nbytes(r.get("bytes_sent") or 0), "ratio": f"{ratio:.1f}x" if ratio else "-",
                      "links": nbytes(r.get("link_bytes_sent") or 0)})
        return c

    cols = ["#", "peer", "pid", "role", "state"] + ([] if pipeline else ["peers"])
    if training:
        cols += ["slot", "step", "loss", "tok/s", "sent", "ratio"] + (["links"] if pipeline else [])
    t = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 0), show_edge=False, caption=caption)
    for col in cols:
        t.add_column(col, no_wrap=True, justify="right" if col in ("step", "tok/s", "sent", "ratio", "links")
                     else "left")
    for r in rows:
        c = cells(r)
        t.add_row(*(c[col] for col in cols), style="dim" if not r["alive"] else None)
    return t


def _stage(slot: str) -> str:
    """'s1r0' -> 's1' (replicas of one stage hold the same state; stages hold different layers)."""
    return slot.split("r", 1)[0]


def run_summary(rows: list[dict], wall_s: float, train_s: float | None, stages: int = 1) -> dict:
    """The run as a whole: the data-parallel replicas (lanes) and stages its active nodes hold, steps every one of
    them reached, times, steps/s, whether the state hashes of each stage's replicas agree at a step they all hold
    (None when there is none: nothing to compare yet, e.g. stopped during start-up), and the held-out loss: the mean
    of the replicas' (the last stage's) figures and their spread. Replicas evaluate the same fixed held-out batches,
    each on its own parameters: with CocktailSGD or DiLoCo those also hold the replica's not yet synchronized part
    (x - g, or the inner steps since the last outer step), which the state hash does not cover, so equal hashes can
    come with held-out losses a few hundredths apart."""
    active = [r for r in rows if r.get("slot") and r["alive"]]
    steps = min((r.get("step") or 0 for r in active), default=0)
    by_stage: dict[str, list[dict]] = {}
    for r in active:
        by_stage.setdefault(_stage(r["slot"]), []).append(r)
    verdicts = [_hashes_agree(stage) for stage in by_stage.values()]
    evals = [r["eval_loss"] for r in active if r.get("eval_loss") is not None]
    return {
        "replicas": len({r["slot"].split("r", 1)[1] for r in active}), "stages": stages, "active_nodes": len(active),
        "steps": steps, "wall_s": round(wall_s, 2),
        "train_s": round(train_s, 2) if train_s is not None else None,
        "steps_per_s": round(steps / train_s, 3) if train_s and steps else None,
        "hashes_agree": False if False in verdicts else None if None in verdicts or not verdicts else True,
        "eval_loss": round(sum(evals) / len(evals), 4) if evals else None,
        "eval_loss_spread": round(max(evals) - min(evals), 4) if evals else None,
    }


def _hashes_agree(replicas: list[dict]) -> bool | None:
    """Whether the replicas of one stage held the same state at the newest step they all report a hash for (their
    status files keep the last steps' hashes: replicas stopped mid-run are a step or two apart); None when they
    share no such step (nobody trained yet)."""
    held = [{int(k): v for k, v in (r.get("recent_hashes") or {}).items()} for r in replicas]
    common = set.intersection(*(set(h) for h in held)) if held else set()
    if not common:
        return None
    step = max(common)
    return len({h[step] for h in held}) == 1


def exits_line(codes: dict[int, int | None]) -> str:
    """How the nodes ended, one entry per distinct way: 'stopped 4 nodes: 3 exit 0, 1 SIGKILL (node 2)'."""
    from shoal.node.localswarm import exit_text

    by: dict[str, list[int]] = {}
    for index, code in sorted(codes.items()):
        by.setdefault(exit_text(code), []).append(index)
    parts = []
    for text, nodes in sorted(by.items(), key=lambda kv: (kv[0] != "exit 0", kv[0])):
        which = "" if text == "exit 0" else f" (node{'s' if len(nodes) > 1 else ''} {', '.join(map(str, nodes))})"
        parts.append(f"{len(nodes)} {text}{which}")
    return f"stopped {len(codes)} node{'s' if len(codes) != 1 else ''}: {', '.join(parts)}"


def outcome_line(s: dict) -> str:
    """The run's end in one line; no verdict on hashes where no replica trained (a stop during start-up)."""
    if not s["steps"] and s["hashes_agree"] is None:
        return "stopped before any replica trained a step"
    shape = f"{s['replicas']} replica{'s' if s['replicas'] != 1 else ''}" + (
        f" of {s['stages']} stages" if s["stages"] > 1 else "")
    agree = {True: ", state hashes agree", False: ", state hashes differ", None: ""}[s["hashes_agree"]]
    return (f"{shape} reached step {s['steps']} in {s['wall_s']:.0f} s"
            + (f" ({s['steps_per_s']:.2f} steps/s)" if s["steps_per_s"] else "")
            + (f", held-out loss {s['eval_loss']:.3f}" if s["eval_loss"] is not None else "") + agree)


def _all_done(rows: list[dict], steps: int) -> bool:
    rows = [r for r in rows if r["alive"] and r.get("role") in ("active", "broker") and r.get("slot")]
    return bool(rows) and all(r.get("step", 0) >= steps and r.get("state") == "done" for r in rows)


def main(args: argparse.Namespace) -> int:
    if args.swarm_command == "down":
        return down(args)
    if args.swarm_command == "status":
        return status(args)
    return up(args)


def up(args: argparse.Namespace) -> int:
    import json
    import time

    from rich.console import Console

    from shoal.node.cli.errors import CliError, Exit
    from shoal.node.cli.node import check_device, shoal_home
    from shoal.node.localswarm import LOCAL_SWARM_FILE, LocalSwarm, LocalSwarmConfig, SignalGuard, exit_text

    check_device(args.device)  # before any node starts: exit 9 once, not a failed start per node
    guard = SignalGuard()
    guard.install()  # SIGINT, SIGTERM, SIGHUP: stop every node by PID, never orphan them
    err = Console(stderr=True, soft_wrap=True)
    training = not args.no_train and args.sync is not None
    nodes, backups, lanes = layout(args)
    if training and lanes < 1:
        raise CliError(f"need at least one lane of {args.stages} active node(s) (--nodes minus --backups at least "
                       f"--stages)")
    home = shoal_home()
    local_file = home / LOCAL_SWARM_FILE
    running = read_swarm_file(local_file)
    if running is not None and running_supervisor(running):
        raise CliError(f"a local swarm is already running here (pid {running['pid']}, {running['workdir']})",
                       hint="shoal swarm down stops it, shoal swarm status shows it; or use another SHOAL_HOME")
    if args.resume is not None:
        nodes, backups, lanes = resumed_layout(args)
    if args.keep_dirs < 1:
        raise CliError("--keep-dirs must be at least 1 (the new swarm's folder)")
    extra: tuple[str, ...] = () if training else ("--no-train",)  # membership only: nobody looks for a run
    t0 = time.monotonic()
    try:
        if args.resume or args.dir:  # a resumed swarm goes on in its own folder
            workdir = Path(args.resume or args.dir)
            workdir.mkdir(parents=True, exist_ok=True)
        else:
            workdir, removed = new_swarm_dir(home / "swarms", args.keep_dirs, time.time())
            if removed:
                err.print(f"removed {len(removed)} old swarm folder{'s' if len(removed) > 1 else ''} from "
                          f"{workdir.parent} (keeping the last {args.keep_dirs}: --keep-dirs)")
        if training:
            run_file, manifest = (workdir / "run.toml", args.resumed) if args.resume else \
                write_manifest(args, workdir, replicas=lanes, backups=backups)
            extra = ("--run", str(run_file), "--threads", "1", "--round-timeout", "10", "--fail-after", "8",
                     "--checkpoint-dir", str(workdir / "checkpoints"))
            if args.resume:
                extra += ("--resume", str(workdir / "checkpoints"))
            if args.steps is not None:
                extra += ("--steps", str(args.steps))
            shape = f"{lanes} replicas" if args.stages == 1 else f"{args.stages} stages x {lanes} lanes"
            err.print(f"run {manifest.run_id[:8]}…: tiny GPT, {shape} with {manifest.plan.sync.method}, {backups} "
                      f"backup(s); nodes' output and logs in {workdir}"
                      + (f"; resuming at step {args.resume_step}" if args.resume else ""))
        swarm = LocalSwarm(LocalSwarmConfig(nodes=nodes, workdir=workdir, home=home, device=args.device,
                                            extra_node_args=extra, swarm_file=local_file, listen=args.listen), guard)
    except (ValueError, OSError) as e:
        raise CliError(str(e)) from None
    interactive = err.is_terminal and not args.json
    converged_after = train_from = None
    code = Exit.OK
    try:
        with err.status("starting…", spinner="dots") if interactive else _nothing() as spinner:
            def progress(text: str) -> None:
                if spinner is not None:
                    spinner.update(text)
                else:
                    err.print(text)

            swarm.start(progress)
            converged_after = swarm.wait_converged(args.converge_timeout, progress)
        err.print(f"all {nodes} nodes see each other after {time.monotonic() - t0:.1f} s")
        err.print(join_command(swarm.bootstrap_addrs()), soft_wrap=True, markup=False)
        end = t0 + args.duration if args.duration is not None else float("inf")
        train_from = time.monotonic()

        def going() -> bool:
            if time.monotonic() >= end:
                return False
            return not (training and args.steps is not None and _all_done(swarm.summary(), args.steps))

        watch(args, swarm, err, going, interactive, training, t0)
    except KeyboardInterrupt:
        err.print("stopping the swarm …")
    except (RuntimeError, TimeoutError) as e:
        err.print(f"[red]shoal swarm up: {e}[/red]")
        code = Exit.FAILED
    finally:
        guard.stopping = True  # from here on, signals cannot interrupt the stop
        rows = swarm.summary()
        wall_s = time.monotonic() - t0
        codes = swarm.stop()
        local_file.unlink(missing_ok=True)
    train_s = time.monotonic() - train_from if train_from is not None else None
    summary = run_summary(rows, wall_s, train_s, stages=args.stages) if training else None
    for row in rows:  # how each node ended, now that it has (the rows were read while they ran)
        row["exit_code"] = codes.get(row["index"])
        row["exit"] = exit_text(row["exit_code"])
    if args.json:
        print(json.dumps({"converged_after_s": converged_after, "workdir": str(workdir), "run": summary,
                          "nodes": rows}, indent=1))
    else:
        if training and summary["steps"]:
            err.print(table(rows, len(swarm.nodes), "the swarm at its end (before it was stopped)", training))
        if training:
            err.print(outcome_line(summary))
        err.print(f"{exits_line(codes)}; output and logs in {workdir}")
    return int(code)


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc) -> None:
        return None


def watch(args, swarm, err, going, interactive: bool, training: bool, t0: float) -> None:
    """Show the swarm until `going()` says stop: the dashboard, a live table, or a line every 10 s."""
    import subprocess
    import sys
    import time

    from rich.live import Live

    def title() -> str:
        alive = sum(n.alive for n in swarm.nodes)
        return f"shoal local swarm: {alive}/{len(swarm.nodes)} nodes, up {time.monotonic() - t0:.0f} s"

    if args.dash:
        import os

        dash = subprocess.Popen([sys.executable, "-m", "shoal.node.cli", "dash", "--local", "--parent",
                                 str(os.getpid())])
        try:
            while dash.poll() is None and going():
                time.sleep(0.3)
        finally:
            if dash.poll() is None:
                dash.terminate()
                dash.wait()
    elif interactive:
        def view():
            return table(swarm.summary(), len(swarm.nodes), title(), training)

        with Live(view(), console=err, refresh_per_second=2) as live:
            while going():
                time.sleep(0.5)
                live.update(view())
        err.print("Ctrl+C stops the swarm · shoal dash --local watches it")
    else:
        last = 0.0
        while going():
            time.sleep(0.5)
            if training and time.monotonic() - last > 10:
                last = time.monotonic()
                steps = [r.get("step", 0) for r in swarm.summary() if r.get("slot")]
                err.print(f"{time.monotonic() - t0:.0f} s: steps {steps}")


def read_swarm_file(path) -> dict | None:
    import json

    try:
        doc = json.loads(path.read_text())
        return doc if isinstance(doc, dict) and isinstance(doc.get("pid"), int) else None
    except (OSError, ValueError):
        return None


def running_supervisor(doc: dict) -> bool:
    from shoal.node.localswarm import same_process

    return same_process(doc["pid"], doc.get("start_time"))


def live_nodes(doc: dict) -> list[dict]:
    from shoal.node.localswarm import same_process

    return [n for n in doc.get("nodes", []) if isinstance(n, dict) and isinstance(n.get("pid"), int)
            and same_process(n["pid"], n.get("start_time"))]


def down(args: argparse.Namespace) -> int:
    """Stop the supervisor (it stops its nodes), then whatever node of it still runs: SIGTERM, then SIGKILL."""
    import os
    import signal
    import time

    from shoal.node.cli.node import shoal_home
    from shoal.node.localswarm import LOCAL_SWARM_FILE

    path = shoal_home() / LOCAL_SWARM_FILE
    doc = read_swarm_file(path)
    if doc is None:
        print("no local swarm is running here")
        return 0
    deadline = time.monotonic() + args.timeout
    supervisor = running_supervisor(doc)
    if supervisor:
        os.kill(doc["pid"], signal.SIGTERM)
        while running_supervisor(doc) and time.monotonic() < deadline:
            time.sleep(0.2)
    nodes = live_nodes(doc)
    for n in nodes:
        os.kill(n["pid"], signal.SIGTERM)
    while live_nodes(doc) and time.monotonic() < deadline:
        time.sleep(0.2)
    killed = live_nodes(doc)
    for n in killed:
        os.kill(n["pid"], signal.SIGKILL)
    if running_supervisor(doc):
        os.kill(doc["pid"], signal.SIGKILL)
    path.unlink(missing_ok=True)
    print(f"stopped the local swarm in {doc.get('workdir')}: "
          + (f"its supervisor (pid {doc['pid']})" if supervisor else "its supervisor was gone already")
          + f", {len(doc.get('nodes', []))} nodes" + (f" ({len(killed)} killed after {args.timeout:g} s)"
                                                     if killed else ""))
    return 0


def status(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from rich.console import Console

    from shoal.node.cli.node import shoal_home
    from shoal.node.localswarm import LOCAL_SWARM_FILE

    doc = read_swarm_file(shoal_home() / LOCAL_SWARM_FILE)
    if doc is None:
        if args.json:
            print(json.dumps({"running": False}))
        else:
            print("no local swarm is running here (start one with `shoal swarm up`)")
        return 0
    alive = {n["index"] for n in live_nodes(doc)}
    rows = []
    for n in doc.get("nodes", []):
        try:
            st = json.loads((Path(doc["workdir"]) / f"node{n['index']}.json").read_text())
        except (OSError, ValueError, KeyError):
            st = {}
        rows.append({**st, "index": n["index"], "pid": n["pid"], "alive": n["index"] in alive,
                     "peer_id": st.get("peer_id"), "state": st.get("state"), "role": st.get("role"),
                     "peers_seen": len(st.get("peers", [])), "exit": "gone"})
    sup = running_supervisor(doc)
    if args.json:
        print(json.dumps({"running": sup, "supervisor_pid": doc["pid"], "state": doc.get("state"),
                          "workdir": doc.get("workdir"), "bootstrap": doc.get("bootstrap"), "nodes": rows}, indent=1))
        return 0
    training = any(r.get("slot") for r in rows)
    title = (f"local swarm ({doc.get('state')}), supervisor pid {doc['pid']}"
             + ("" if sup else " (gone: `shoal swarm down` stops what is left)"))
    console = Console()
    console.print(table(rows, len(rows), title, training))
    console.print(f"workdir {doc.get('workdir')}", soft_wrap=True)
    if doc.get("bootstrap"):
        console.print(join_command(doc["bootstrap"]), soft_wrap=True, markup=False)
    return 0


def join_command(addrs: list[str]) -> str:
    """The exact command a volunteer types to join the swarm at `addrs` (node 0's): from another machine when one of
    them is not a loopback address, else from this machine only (and how to open it up)."""
    remote = [a for a in addrs if not a.startswith(("/ip4/127.", "/ip6/::1/"))]
    if remote:
        return f"volunteers join from another machine with: shoal node --join {remote[0]}"
    return (f"join from this machine with: shoal node --join {addrs[0]}\n(it listens on 127.0.0.1 only: "
            f"shoal swarm up --listen /ip4/0.0.0.0/tcp/4001 lets other machines join)")
