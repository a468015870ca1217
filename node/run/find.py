"""Finding a run among the joined peers: its signed manifest by run id, and the assignment table a peer holds (a
node that finds no table and holds the manifest starts the run's broker)."""

from __future__ import annotations

import logging

import trio

from shoal.node.run.context import NodeServices
from shoal.node.run.preflight import UnknownRun
from shoal.protocol.envelope import Signed
from shoal.protocol.manifest import RunManifest
from shoal.swarm.net.rpc import RpcError, call
from shoal.swarm.run.authority import RunAuthority
from shoal.swarm.run.client import RunClientConfig, fetch_table

log = logging.getLogger(__name__)


async def fetch_manifest(services: NodeServices, run_id: str, peers: list[str], *, timeout_s: float) -> RunManifest:
    """The signed manifest of `run_id` from one of `peers`, verified and checked against the id."""
    for p in peers:
        try:
            raw = await call(services.sh, p, "run.manifest", run_id, timeout_s=timeout_s)
            m = RunManifest.from_bytes(raw)
            m.verify()
            if m.run_id != run_id:
                raise ValueError("the manifest does not hash to the run id")
            return m
        except (RpcError, ValueError, TypeError) as e:
            log.info("manifest from %s: %s", p, e)
    raise UnknownRun(f"no joined peer gave the manifest of run {run_id[:16]}…")


def serve_manifest(services: NodeServices, manifest: RunManifest) -> None:
    """Answer "run.manifest" for this run."""

    async def rpc_manifest(caller: str, body: object) -> bytes:
        if body != manifest.run_id:
            raise ValueError("this node trains another run")
        return manifest.to_bytes()

    services.register("run.manifest", rpc_manifest)


async def find_table(services: NodeServices, manifest: RunManifest, joined: list[str], cfg: RunClientConfig, *,
                     patient: bool) -> tuple[Signed, str] | None:
    """A table a joined peer holds (and that peer), asking again for `admit_timeout_s`. A node that is not `patient`
    (it holds the manifest, has no --join and reached peers only from its recent-peers file, none of which says it
    trains this run) asks once, and None means nobody knows the run: this node starts it."""
    clock = services.clock
    deadline = clock() + cfg.admit_timeout_s
    while True:
        for p in joined:
            try:
                return await fetch_table(services.sh, p, manifest.run_id, timeout_s=cfg.rpc_timeout_s,
                                         authority=RunAuthority(manifest), penalties=services.penalties), p
            except RpcError as e:
                log.info("no run table from %s: %s", p, e)
        if not patient:
            return None
        if clock() + cfg.retry_s > deadline:
            raise UnknownRun(f"none of the joined peers knows run {manifest.run_id[:16]}… "
                             f"(asked for {cfg.admit_timeout_s:.0f} s)")
        await trio.sleep(cfg.retry_s)
