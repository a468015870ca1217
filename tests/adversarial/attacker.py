"""Honest members and a malicious peer for the adversarial tests: real shoal nodes on 127.0.0.1 in the test's trio
loop. The attacker is shoal's own node (its host, RPC server, gossip and broker code) with its own identity,
driven to lie: it signs tables it has no authority for, replays what it captured, and floods."""

from __future__ import annotations

from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from shoal.node.daemon import Node
from shoal.protocol.assignment import RUN_RECORD_TYPES, AssignmentTable, BrokerLease
from shoal.protocol.envelope import open_envelope
from shoal.protocol.manifest import JoinPolicy, ParallelPlan, RunManifest, SyncSpec
from shoal.protocol.records import HardwareProfile
from shoal.protocol.schema import SignedRecord
from shoal.swarm.net.membership import verified_members
from shoal.swarm.net.rpc import call
from shoal.swarm.run.broker import Broker, BrokerConfig
from shoal.swarm.run.client import RunClient, RunClientConfig
from shoal.swarm.run.context import RunContext
from tests.helpers.swarm import HW, running_node

BCFG = BrokerConfig(heartbeat_s=0.25, fail_after_s=2.0, lease_renew_s=0.5, lease_timeout_s=2.5, republish_s=1.0,
                    ping_timeout_s=1.0, dht_timeout_s=1.0)
CCFG = RunClientConfig(poll_s=0.4, rpc_timeout_s=5.0, retry_s=0.3)


def signed_manifest(owner: Ed25519PrivateKey, *, replicas: int = 2, join: JoinPolicy | None = None) -> RunManifest:
    """A run signed by `owner` (so its authority is the owner's, as every run taken from the network is)."""
    m = RunManifest.default(plan=ParallelPlan(replicas=replicas, sync=SyncSpec(method="allreduce")),
                            **({"join": join} if join else {}))
    return m.signed(owner)


@asynccontextmanager
async def node_with(key: Ed25519PrivateKey | None = None, join: list[str] = ()):
    async with running_node(list(join), key=key or Ed25519PrivateKey.generate()) as node:
        yield node


def run_context(node: Node, m: RunManifest) -> RunContext:
    return RunContext(sh=node.sh, manifest=m, register=node.rpc.register, publish=node.publish,
                      membership=node.membership, penalties=node.penalties, pulse=node.pulse)


@dataclass
class Member:
    node: Node
    ctx: RunContext
    client: RunClient | None
    broker: Broker | None
    scope: trio.CancelScope
    captured: list[Any] = field(default_factory=list)  # verified records this node received by gossip

    @property
    def peer_id(self) -> str:
        return self.node.peer_id

    @property
    def addrs(self) -> list[str]:
        return self.node.sh.addrs

    def kill(self) -> None:
        """Stop without a leave notice: the peer just goes silent."""
        self.scope.cancel()


async def _member(m, join, key, broker, broker_id, secret, admit, hardware, task_status) -> None:
    with trio.CancelScope() as scope:
        async with node_with(key, join) as node:
            ctx = run_context(node, m)
            async with trio.open_nursery() as n:
                b = None
                if broker:
                    b = Broker(ctx, BCFG, secret=secret)
                    await n.start(b.run)
                mem = Member(node, ctx, None, b, scope)
                node.extra_ingest.append(mem.captured.append)
                if admit:
                    mem.client = RunClient(ctx, hardware, broker_id=broker_id or node.peer_id, secret=secret, config=CCFG,
                                           broker_config=BCFG, local_broker=b)
                    node.extra_ingest.append(mem.client.on_record)
                    await n.start(mem.client.run)
                task_status.started(mem)
                await trio.sleep_forever()


async def start(nursery: trio.Nursery, m: RunManifest, join: list[str] = (), *, key: Ed25519PrivateKey | None = None,
                broker: bool = False, broker_id: str | None = None, secret: str | None = None,
                admit: bool = True, hardware: HardwareProfile = HW) -> Member:
    """An honest member (with `broker`: the run's broker, its own client admitted through it); `hardware`: what it
    reports at admission."""
    return await nursery.start(_member, m, list(join), key, broker, broker_id, secret, admit, hardware)


class Attacker:
    """A malicious peer: a member's node (or a stranger's) used to lie with shoal's own code."""

    def __init__(self, mem: Member):
        self.mem = mem
        self.heard: list[tuple[str, str, Any]] = []  # (method, caller, body) of RPCs it was sent

    @property
    def peer_id(self) -> str:
        return self.mem.peer_id

    def listen(self, *methods: str, answer: Any = None) -> None:
        """Answer `methods` itself (recording what callers send): how a fake broker harvests requests."""
        for method in methods:
            async def handler(caller: str, body: Any, method: str = method) -> Any:
                self.heard.append((method, caller, body))
                return answer(method) if callable(answer) else answer
            self.mem.node.rpc.register(method, handler)

    def forged_table(self, m: RunManifest, *, standby: str | None = None) -> bytes:
        """A table of run `m` signed by the attacker, naming itself broker (no authority from the owner)."""
        b = Broker(run_context(self.mem.node, m), BCFG)
        b.standby = standby
        b._rebuild()
        return b.table_env

    def takeover_table(self, table: AssignmentTable, *, epochs_ahead: int = 1) -> bytes:
        """The attacker's own takeover of `table` (what a standby signs when it takes over), made at once."""
        b = Broker.from_table(self.mem.ctx, BCFG, table)
        if epochs_ahead != 1:
            b.lease_epoch = table.lease_epoch + epochs_ahead
            b._rebuild()
        return b.table_env

    def serve_table(self, env: bytes) -> None:
        self.listen("run.table", answer={"table": env, "lease": None})

    async def gossip(self, env: bytes) -> None:
        await self.mem.node.publish(env)

    def captured_leases(self, broker: str) -> list[bytes]:
        return [s.raw for s in self.mem.captured
                if isinstance(s.record, BrokerLease) and s.record.peer_id == broker]

    async def call(self, peer: str, method: str, body: Any, timeout_s: float = 5.0) -> Any:
        return await call(self.mem.node.sh, peer, method, body, timeout_s=timeout_s)


async def dht_flood(node: Node, target: str, records: list[tuple[str, bytes]]) -> tuple[int, int]:
    """Put `records` straight into `target`'s DHT store with libp2p's own DHT code, this node's validator switched
    off (so it sends what an honest node would refuse to). Returns (stored, refused) as the target answered."""
    from libp2p.peer.id import ID
    from libp2p.records.validator import NamespacedValidator

    dht = node.sh.dht
    dht.validator = NamespacedValidator({}, strict_validation=False)
    peer = ID.from_base58(target)
    stored = refused = 0
    for key, value in records:
        ok = False
        with trio.move_on_after(5.0):
            try:
                ok = await dht.value_store._store_at_peer(peer, key.encode(), value)
            except Exception:  # noqa: BLE001 - a refused put resets the stream
                ok = False
        stored, refused = stored + ok, refused + (not ok)
    return stored, refused


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


async def rss_within(pid: int, limit: int, timeout_s: float) -> int:
    """`pid`'s resident memory as soon as it is below `limit` bytes, or its last reading once `timeout_s` passed
    (memory a process frees after a load shows up in its RSS a moment later)."""
    rss = rss_bytes(pid)
    with trio.move_on_after(timeout_s):
        while rss >= limit:
            await trio.sleep(0.2)
            rss = rss_bytes(pid)
    return rss


async def records_held(sh, peer: str) -> list[SignedRecord]:
    """The signed records `peer` holds of the swarm's live peers (its `members` answer), verified."""
    rows = await call(sh, peer, "members", timeout_s=5.0)
    return [signed.record for signed, _ in verified_members(rows, lambda why: None)]


def table_of(env: bytes) -> AssignmentTable:
    return open_envelope(env, RUN_RECORD_TYPES).record


async def owner_broker(nursery: trio.Nursery, replicas: int, **kw) -> tuple[RunManifest, Member]:
    """A run signed by a fresh owner, and the owner's node hosting its broker (`kw`: start's)."""
    owner = Ed25519PrivateKey.generate()
    m = signed_manifest(owner, replicas=replicas)
    return m, await start(nursery, m, key=owner, broker=True, **kw)
