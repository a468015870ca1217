"""Join a swarm as an observer (never announced, never in a slot) and follow every peer's signed records (with how
old each was when it came: a members snapshot's rows are), and, for the dashboard, the manifest of every run the
peers report (asked of a peer that trains it, checked against the run id)."""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable

import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from shoal.protocol.envelope import Signed
from shoal.protocol.manifest import RunManifest
from shoal.protocol.records import StatusRecord
from shoal.protocol.schema import WireRecord
from shoal.swarm.net.gossip import RecordGossip
from shoal.swarm.net.host import HostConfig, SwarmHost, open_host
from shoal.swarm.net.membership import Membership, MembershipConfig, verified_members
from shoal.swarm.net.penalty import Penalties
from shoal.swarm.net.rpc import RpcError, call

log = logging.getLogger(__name__)
MANIFEST_RETRY_S = 10.0  # a run whose manifest no peer gave yet is asked for again after this long


class Observer:
    """Follows the swarm: a members snapshot from the joined peers, then gossip, into a Membership view."""

    def __init__(self, join: list[str], *, membership: MembershipConfig = MembershipConfig(),
                 on_signed: Callable[[Signed, float], None] | None = None, rpc_timeout_s: float = 5.0,
                 on_manifest: Callable[[RunManifest], None] | None = None):
        self.config = HostConfig(join=tuple(join), dht_mode_server=False)
        self.key = Ed25519PrivateKey.generate()
        self.penalties = Penalties()
        self.membership_config = membership
        self.membership: Membership | None = None
        self.on_signed = on_signed
        self.on_manifest = on_manifest  # None: no manifests fetched
        self.rpc_timeout_s = rpc_timeout_s
        self.sh: SwarmHost | None = None
        self._nursery: trio.Nursery | None = None
        self._manifests: dict[str, float | None] = {}  # run id -> when last asked (None: got it)

    def _ingest(self, signed: Signed, age_s: float = 0.0) -> None:
        assert self.membership is not None  # records come in once `run` started
        self.membership.observe(signed, age_s=age_s)
        if self.on_signed is not None:
            self.on_signed(signed, age_s)
        rec = signed.record
        if self.on_manifest is not None and isinstance(rec, StatusRecord) and rec.run_id and self._nursery:
            asked = self._manifests.get(rec.run_id, -math.inf)
            if asked is not None and trio.current_time() - asked >= MANIFEST_RETRY_S:
                self._manifests[rec.run_id] = trio.current_time()
                self._nursery.start_soon(self._fetch_manifest, rec.peer_id, rec.run_id)

    async def _fetch_manifest(self, peer_id: str, run_id: str) -> None:
        """The run's manifest from a peer that reports the run: signed, and hashing to the run id."""
        assert self.sh is not None and self.on_manifest is not None  # asked only while running, for a dashboard
        on_manifest = self.on_manifest
        try:
            m = RunManifest.from_bytes(await call(self.sh, peer_id, "run.manifest", run_id,
                                                  timeout_s=self.rpc_timeout_s))
            m.verify()
            if m.run_id != run_id:
                raise ValueError("the manifest does not hash to the run id")
        except (RpcError, ValueError, TypeError) as e:  # asked again later, maybe of another peer
            log.info("manifest of run %s from %s: %s", run_id[:16], peer_id, e)
            return
        self._manifests[run_id] = None
        on_manifest(m)

    async def refresh(self) -> int:
        """Pull a members snapshot from every peer we are connected to; returns the records accepted."""
        n, sh = 0, self.sh
        assert sh is not None, "refresh runs once `run` opened the host"
        for pid in sh.connected_peers():
            try:
                rows = await call(sh, pid, "members", timeout_s=self.rpc_timeout_s)
            except RpcError as e:
                log.info("members from %s: %s", pid, e)
                continue

            def penalize(why: str, pid: str = pid) -> None:
                self.penalties.penalize(pid, why)

            for signed, age in verified_members(rows, penalize):
                self._ingest(signed, age_s=age)
                n += 1
        return n

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED, refresh_every_s: float = 10.0) -> None:
        async with open_host(self.key, self.config) as sh:
            self.sh = sh
            self.membership = Membership(sh.peer_id, self.membership_config)
            gossip = RecordGossip(sh, self.penalties, self._ingest)
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                await nursery.start(gossip.run)
                joined = await sh.bootstrap()
                if not joined:
                    raise sh.join_error()
                await self.refresh()
                task_status.started(self)
                while True:  # periodic snapshots cover gossip gaps; the sweep marks silent peers
                    await trio.sleep(refresh_every_s)
                    await self.refresh()
                    self.membership.sweep()


def run_observer(join: list[str], on_record: Callable[[WireRecord, float], None], stop: threading.Event,
                 *, membership: MembershipConfig = MembershipConfig(), manifests: bool = False) -> None:
    """Blocking: follow the swarm, calling on_record(record, its age in seconds) for every verified record (and with
    `manifests`, every run's checked manifest), until `stop` is set."""

    async def main() -> None:
        obs = Observer(join, membership=membership, on_signed=lambda s, age: on_record(s.record, age),
                       on_manifest=(lambda m: on_record(m, 0.0)) if manifests else None)
        async with trio.open_nursery() as nursery:
            await nursery.start(obs.run)
            while not stop.is_set():
                await trio.sleep(0.2)
            nursery.cancel_scope.cancel()

    trio.run(main)
