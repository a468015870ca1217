"""Which run a node joins when it is not handed a manifest: `--run NAME|ID-PREFIX`, or the swarm's only open run.

The node asks the peers it joined for the runs they know (the `runs` RPC: verified adverts, swarm/run/directory.py)
and listens to the adverts gossiped meanwhile. A name or prefix that names one run is joined; one that names several,
or none, is refused as soon as the swarm's runs are known, with the candidates listed. Without `--run` the node
joins the one run it may join (open, or private with its secret at hand), waits while there is none, and refuses
when there are several. A full run id that no advert names is fetched the old way (its manifest from the peers).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import trio

from shoal.node.run.preflight import RunError, UnknownRun
from shoal.protocol.manifest import is_sha256
from shoal.swarm.net.rpc import RpcError, call
from shoal.swarm.run.directory import ListedRun, RunDirectory, matching

log = logging.getLogger(__name__)

ASK_EVERY_S = 5.0  # while waiting, the joined peers are asked again this often
SETTLE_S = 1.0  # after the first answers, this long for adverts still on their way
QUIET_S = 12.0  # a swarm whose peers know no run at all: how long to wait for an advert before refusing a --run
MAX_LISTED = 8  # candidates named in a refusal


Chooser = Callable[[list[ListedRun]], Awaitable[ListedRun | None]]


class AmbiguousRun(RunError):
    """`--run NAME|ID-PREFIX` names several runs of the swarm, or no `--run` was given and several runs are open."""


def candidates_text(runs: list[ListedRun]) -> str:
    shown = "; ".join(r.describe() for r in runs[:MAX_LISTED])
    more = f"; and {len(runs) - MAX_LISTED} more" if len(runs) > MAX_LISTED else ""
    return shown + more


class RunFinder:
    """Finds the run a node joins, from the swarm's adverts (`directory`, fed by gossip) and the peers' `runs`."""

    def __init__(self, sh, directory: RunDirectory, *, clock: Callable[[], float] = trio.current_time,
                 rpc_timeout_s: float = 5.0, quiet_s: float = QUIET_S):
        self.sh = sh
        self.directory = directory
        self.clock = clock
        self.rpc_timeout_s = rpc_timeout_s
        self.quiet_s = quiet_s
        self.waiting = False  # no run to join yet (without --run): the node waits for one
        self.reason = ""  # why the run found was chosen, for the node's output
        self.answers = 0  # answers to `runs` so far: a refusal is decided from them, not from a timeout

    async def ask(self, peers: list[str]) -> int:
        """Ask `peers` for the runs they know (concurrently); how many answered."""
        answered = 0

        async def one(pid: str) -> None:
            nonlocal answered
            try:
                envs = await call(self.sh, pid, "runs", timeout_s=self.rpc_timeout_s)
            except RpcError as e:
                log.info("runs from %s: %s", pid[:16], e)
                return
            answered += 1
            self.answers += 1
            if isinstance(envs, list):
                for env in envs[:256]:
                    self.directory.offer(env, pid)

        async with trio.open_nursery() as n:
            for pid in peers:
                n.start_soon(one, pid)
        return answered

    async def find(self, query: str | None, peers: Callable[[], list[str]], *, me: str, has_secret: bool,
                   on_wait: Callable[[], None] = lambda: None, choose: Chooser | None = None) -> ListedRun | str:
        """The run `query` names (None: the one run this node may join), or a full run id no advert names (its
        manifest is then fetched from the peers). Raises UnknownRun or AmbiguousRun with the candidates.
        `on_wait` is called when it starts waiting for a run to appear (without a query); `choose` asks the person
        at the terminal which of several open runs to join (None there, or no `choose`: refused)."""
        t0 = self.clock()
        asked_at = -ASK_EVERY_S
        heard = False
        while True:
            if self.clock() - asked_at >= ASK_EVERY_S:
                asked_at = self.clock()
                heard |= await self.ask(peers()) > 0
                await trio.sleep(SETTLE_S)  # adverts gossiped meanwhile
            runs = self.directory.runs()
            if query is not None:
                found = self._named(query, runs, settled=bool(runs) or self.clock() - t0 >= self.quiet_s)
                if found is not None:
                    return found
            else:
                open_runs = [r for r in runs if r.admits(me, has_secret)]
                if len(open_runs) == 1:
                    r = open_runs[0]
                    self.waiting = False
                    self.reason = "the swarm's only open run" if len(runs) == 1 else \
                        f"the only one of the swarm's {len(runs)} runs this node may join"
                    return r
                if len(open_runs) > 1:
                    chosen = await choose(open_runs) if choose is not None else None
                    if chosen is not None:
                        self.reason = "chosen at the prompt"
                        return chosen
                    raise AmbiguousRun(f"the swarm has {len(open_runs)} open runs: {candidates_text(open_runs)}; "
                                       f"say which with --run NAME or --run ID-PREFIX")
                if not self.waiting:
                    log.info("no run to join yet (%d runs known, %s); waiting for one", len(runs),
                             "peers answered" if heard else "no peer answered")
                    self.waiting = True
                    on_wait()
            await trio.sleep(0.25)

    def _named(self, query: str, runs: list[ListedRun], *, settled: bool) -> ListedRun | str | None:
        found = matching(runs, query)
        if len(found) == 1:
            self.reason = f"named by --run {query}"
            return found[0]
        if len(found) > 1:
            raise AmbiguousRun(f"--run {query} names {len(found)} runs of the swarm: {candidates_text(found)}; "
                               f"give more of the id")
        if not settled:
            return None
        q = query.lower()
        if is_sha256(q):
            return q  # not advertised (an older node, or a manifest too large to advertise): fetched by its id
        listed = f"its runs: {candidates_text(runs)}" if runs else "no run is advertised in it"
        raise UnknownRun(f"--run {query}: no run of the swarm has this name or id prefix ({listed})")
