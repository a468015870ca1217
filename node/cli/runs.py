"""`shoal runs`: join briefly as an observer, list the runs the swarm advertises (verified), exit."""

from __future__ import annotations

import argparse

HELP = "list the runs a swarm trains: id, name, model, lanes, synchronizer, free lanes, private or open"
DESCRIPTION = """\
Join a swarm briefly as an observer and list the runs its brokers advertise.
Each advert carries the run's signed manifest: the list shows only runs whose
owner signed them and whose broker the owner authorised.

  shoal runs --join /ip4/192.0.2.7/tcp/4001/p2p/12D3KooW...
  shoal runs --local --json           # the swarm `shoal swarm up` runs here

Join one with: shoal node --join ADDR --run NAME (or a unique id prefix); with
no --run a node joins the swarm's open run when there is exactly one.
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    from shoal.node.cli.peers import add_observer_arguments

    add_observer_arguments(p, "how long to listen for adverts after asking the joined peers")


def run_rows(runs) -> list[dict]:
    rows = []
    for r in runs:
        m, a = r.manifest, r.advert
        plan = m.plan
        rows.append({
            "run_id": r.run_id, "name": m.name, "model": m.model.size,
            "params": sum(m.stage_params(s) for s in range(plan.stages)), "stages": plan.stages,
            "lanes": a.lanes, "min_lanes": plan.lanes_min, "max_lanes": plan.lanes_max, "free_lanes": a.free_lanes,
            "backups": a.backups, "providers": a.providers, "sync": plan.sync.method,
            "global_batch": m.global_batch, "step": a.step, "total_steps": m.optim.total_steps,
            "private": r.private, "join": m.join.mode, "owner": m.owner, "broker": a.peer_id, "data": m.data.source,
        })
    return rows


def main(args: argparse.Namespace) -> int:
    import json
    import sys

    import trio

    from shoal.node.cli.peers import resolve_join
    from shoal.swarm.net.observer import Observer
    from shoal.swarm.run.directory import RunDirectory

    join = resolve_join(args, "shoal runs")
    if join is None:
        return 2
    directory = RunDirectory()
    try:
        obs = Observer(join, on_signed=directory.observe)
    except ValueError as e:
        print(f"shoal runs: {e}", file=sys.stderr)
        return 2

    async def run() -> None:
        from shoal.node.run.resolve import RunFinder

        async with trio.open_nursery() as nursery:
            await nursery.start(obs.run)
            await RunFinder(obs.sh, directory).ask(obs.sh.connected_peers())
            await trio.sleep(args.wait)
            nursery.cancel_scope.cancel()

    trio.run(run)  # a join address that does not answer: JoinError, its own exit status (cli/errors.py)
    rows = run_rows(directory.runs())
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    from rich.console import Console

    console = Console()
    if not rows:
        console.print("no run is advertised in this swarm (yet): `shoal run create` makes one")
        return 0
    console.print(runs_table(rows))
    console.print("join one: shoal node --join ADDR --run NAME (or an id prefix); with one open run, no --run",
                  soft_wrap=True)
    return 0


def runs_table(rows: list[dict]):
    """The runs in a table that fits 80 columns (the full ids are in --json)."""
    from rich import box
    from rich.table import Table

    from shoal.protocol.display import si

    t = Table(title=f"{len(rows)} run{'s' if len(rows) != 1 else ''}", box=box.SIMPLE_HEAD, pad_edge=False,
              padding=(0, 0), show_edge=False)
    for col in ("id", "name", "model", "lanes", "free", "sync", "step", "join"):
        t.add_column(col, no_wrap=True, overflow="ellipsis",
                     justify="right" if col in ("lanes", "free", "step") else "left")
    for r in rows:
        shape = f"{r['lanes']}" + (f"x{r['stages']}" if r["stages"] > 1 else "")
        t.add_row(r["run_id"][:8], r["name"][:16], f"{r['model']} {si(r['params'])}", shape, str(r["free_lanes"]),
                  r["sync"], f"{r['step']}/{si(r['total_steps'])}", r["join"])
    return t
