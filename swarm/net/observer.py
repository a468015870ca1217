"""Join a swarm as an observer (never announced, never in a slot) and follow every peer's signed records."""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path

import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from shoal.protocol.envelope import Signed
from shoal.protocol.schema import WireRecord
from shoal.swarm.net.gossip import RecordGossip
from shoal.swarm.net.host import HostConfig, SwarmHost, open_host
from shoal.swarm.net.membership import Membership, MembershipConfig, verified_members
from shoal.swarm.net.penalty import Penalties
from shoal.swarm.net.rpc import RpcError, call

log = logging.getLogger(__name__)
LOCAL_SWARM_FILE = "local-swarm.json"


class Observer:
    """Follows the swarm: a members snapshot from the joined peers, then gossip, into a Membership view."""

    def __init__(self, join: list[str], *, membership: MembershipConfig = MembershipConfig(),
                 on_signed: Callable[[Signed], None] | None = None, rpc_timeout_s: float = 5.0):
        self.config = HostConfig(join=tuple(join), dht_mode_server=False)
        self.key = Ed25519PrivateKey.generate()
        self.penalties = Penalties()
        self.membership_config = membership
        self.membership: Membership | None = None
        self.on_signed = on_signed
        self.rpc_timeout_s = rpc_timeout_s
        self.sh: SwarmHost | None = None

    def _ingest(self, signed: Signed, age_s: float = 0.0) -> None:
        assert self.membership is not None  # records come in once `run` started
        self.membership.observe(signed, age_s=age_s)
        if self.on_signed is not None:
            self.on_signed(signed)

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


def run_observer(join: list[str], on_record: Callable[[WireRecord], None], stop: threading.Event,
                 *, membership: MembershipConfig = MembershipConfig()) -> None:
    """Blocking: follow the swarm, calling on_record for every verified record, until `stop` is set."""

    async def main() -> None:
        obs = Observer(join, membership=membership, on_signed=lambda s: on_record(s.record))
        async with trio.open_nursery() as nursery:
            await nursery.start(obs.run)
            while not stop.is_set():
                await trio.sleep(0.2)
            nursery.cancel_scope.cancel()

    trio.run(main)


def find_local_swarm(home: Path) -> list[str]:
    """Multiaddrs of a swarm started by `shoal swarm up` with this shoal home ([] if none is running)."""
    path = Path(home) / LOCAL_SWARM_FILE
    try:
        doc = json.loads(path.read_text())
        os.kill(int(doc["pid"]), 0)  # is the supervisor still alive?
        return [str(a) for a in doc["bootstrap"]]
    except (OSError, ValueError, KeyError, TypeError):
        return []
