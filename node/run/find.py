"""Finding a run among the joined peers and the live peers that say they train it: its signed manifest by run id,
and the newest assignment table they hold (a node that finds no table and holds the manifest starts the run's
broker). One --join peer that denies the run must not keep a joiner from the others."""

from __future__ import annotations

import logging

import trio

from shoal.node.run.context import NodeServices
from shoal.node.run.preflight import UnknownRun
from shoal.protocol.envelope import Signed
from shoal.protocol.manifest import RunManifest
from shoal.swarm.net.rpc import RpcError, call
from shoal.swarm.run.authority import RunAuthority
from shoal.swarm.run.client import RunClientConfig
from shoal.swarm.run.tablerpc import fetch_table

log = logging.getLogger(__name__)

RUN_CLAIM_WAIT_S = 10.0  # a joiner asks about its run this long even when no live peer says it trains it


def training(services: NodeServices, run_id: str) -> list[str]:
    """The live peers whose status says they train run `run_id`."""
    return [peer for peer, st in services.statuses() if st.run_id == run_id]


def run_peers(services: NodeServices, run_id: str, joined: list[str]) -> list[str]:
    """Whom to ask about run `run_id`: the peers this node joined through, then the live peers training it."""
    return list(dict.fromkeys([*joined, *training(services, run_id)]))


def ask_again(services: NodeServices, run_id: str, since: float, cfg: RunClientConfig) -> bool:
    """Whether to ask about run `run_id` once more: within `admit_timeout_s`, and past RUN_CLAIM_WAIT_S only while a
    live peer says it trains the run (status records come by gossip within a few seconds: a run id nobody trains is
    given up on then)."""
    waited = services.clock() - since
    return waited + cfg.retry_s <= cfg.admit_timeout_s and (waited < RUN_CLAIM_WAIT_S or
                                                           bool(training(services, run_id)))


async def fetch_manifest(services: NodeServices, run_id: str, joined: list[str], cfg: RunClientConfig
                         ) -> RunManifest:
    """The signed manifest of `run_id`, verified and checked against the id, from one of the joined peers or the live
    peers training the run, asking again for `admit_timeout_s` (the others' status records come by gossip a little
    after the join)."""
    t0 = services.clock()
    while True:
        for p in run_peers(services, run_id, joined):
            try:
                raw = await call(services.sh, p, "run.manifest", run_id, timeout_s=cfg.rpc_timeout_s)
                m = RunManifest.from_bytes(raw)
                m.verify()
                if m.run_id != run_id:
                    raise ValueError("the manifest does not hash to the run id")
                return m
            except (RpcError, ValueError, TypeError) as e:
                log.info("manifest from %s: %s", p, e)
        if not ask_again(services, run_id, t0, cfg):
            raise UnknownRun(f"no joined peer gave the manifest of run {run_id[:16]}…, nor any of the "
                             f"{len(training(services, run_id))} live peers that say they train it")
        await trio.sleep(cfg.retry_s)


def serve_manifest(services: NodeServices, manifest: RunManifest) -> None:
    """Answer "run.manifest" for this run."""

    async def rpc_manifest(caller: str, body: object) -> bytes:
        if body != manifest.run_id:
            raise ValueError("this node trains another run")
        return manifest.to_bytes()

    services.register("run.manifest", rpc_manifest)


async def find_table(services: NodeServices, manifest: RunManifest, joined: list[str], cfg: RunClientConfig, *,
                     patient: bool) -> tuple[Signed, str] | None:
    """The newest table the joined peers and the live peers training the run hold (and a peer that served it),
    asking again for `admit_timeout_s`. A node that is not `patient` (it holds the manifest, has no --join and
    reached peers only from its recent-peers file, none of which says it trains this run) asks once, and None means
    nobody knows the run: this node starts it."""
    run_id, t0 = manifest.run_id, services.clock()
    while True:
        best: tuple[Signed, str] | None = None
        for p in run_peers(services, run_id, joined):
            try:
                got = await fetch_table(services.sh, p, run_id, timeout_s=cfg.rpc_timeout_s,
                                        authority=RunAuthority(manifest), penalties=services.penalties)
            except RpcError as e:
                log.info("no run table from %s: %s", p, e)
                continue
            if best is None or got.record.newer_than(best[0].record):
                best = got, p
        if best is not None or not patient:
            return best
        if not ask_again(services, run_id, t0, cfg):
            raise UnknownRun(f"none of the joined peers knows run {run_id[:16]}…, nor any of the "
                             f"{len(training(services, run_id))} live peers that say they train it")
        await trio.sleep(cfg.retry_s)
