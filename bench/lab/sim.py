"""A run of many peers in virtual time, on shoal's own control-plane code: the real Broker (admission, seating,
failure detection, promotion, the table and its deltas, the lease) and, for a sample of members, the real RunClient's
handling of what the broker gossips; the rest follow the table by the same rule without the cost of rebuilding it
(checked against the sampled clients). Time is trio's MockClock: an hour of a 1,000-peer run takes minutes.

The network is a model: every message the broker gossips reaches every live member once (unique bytes), and a
GossipSub mesh of degree `fanout` sends each node about that many copies (wire bytes); a member's table poll is an RPC
to the broker every poll_s (request and answer, packed as they travel); every peer's status record (a real sealed
StatusRecord of a training member) is gossiped every status_s. Not modelled (said in every report): latency and
bandwidth limits, the DHT (the broker's puts are counted at the broker, hops are not simulated), status aggregation.

Churn: each peer's session lasts a Weibull-distributed time (shape `weibull_k`, mean `session_mean_s`); a share
`crash_share` of sessions end silently (the broker must notice), the rest with a leave; a new peer arrives after an
exponential delay (mean `arrival_s`) for every one that went, so the swarm stays near n. At most MAX_PROVIDERS join
the run; the others are refused and stay in the swarm (they still gossip status)."""

from __future__ import annotations

import math
import random
import time
from collections import defaultdict
from dataclasses import dataclass, field, replace
from types import SimpleNamespace
from typing import Any

import trio
import trio.testing
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from shoal.protocol import manifest as mf
from shoal.protocol.assignment import AdmitRequest, AdmitResponse
from shoal.protocol.envelope import open_envelope, seal
from shoal.protocol.kinds import RECORD_TYPES
from shoal.protocol.records import HardwareProfile, StatusRecord
from shoal.protocol.tabledelta import TableDelta, table_digest
from shoal.protocol.wire import pack, unpack
from shoal.swarm.net.identity import peer_id_of
from shoal.swarm.net.membership import Membership
from shoal.swarm.run.broker import Broker, BrokerConfig
from shoal.swarm.run.client import RunClient, RunClientConfig
from shoal.swarm.run.context import RunContext

HW = HardwareProfile(device_kind="cpu", device_name="sim", memory_bytes=8 << 30, matmul_tflops=0.1,
                     free_disk_bytes=1 << 36)
EPOCH = 1.8e9  # the virtual wall clock's origin (unix seconds)


@dataclass(frozen=True, kw_only=True)
class SimConfig:
    n: int = 100  # peers in the swarm at a time (about)
    lanes: int = 64  # the run's most lanes (one stage): the rest of its providers wait as backups
    duration_s: float = 3600.0
    session_mean_s: float = 3600.0
    weibull_k: float = 0.6  # < 1: many short sessions and a long tail, as volunteers come and go
    crash_share: float = 0.5
    arrival_s: float = 60.0  # a replacement arrives this long (mean, exponential) after a peer went
    join_over_s: float = 60.0  # the first n arrive spread over this long
    poll_s: float = RunClientConfig().poll_s
    status_s: float = 4.0  # status gossip period (node/daemon.py status_gossip_s with the defaults)
    fanout: int = 6  # GossipSub mesh degree: copies of each gossiped message a node receives, about
    observed: int = 16  # members running the real RunClient on what the broker gossips
    seed: int = 1
    broker: BrokerConfig = field(default_factory=BrokerConfig)


def weibull_scale(mean: float, k: float) -> float:
    return mean / math.gamma(1 + 1 / k)


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def status_bytes() -> int:
    """A training member's sealed status record, every field a real one fills."""
    key = Ed25519PrivateKey.generate()
    rec = StatusRecord(peer_id=peer_id_of(key), seq=1 << 40, time=EPOCH, role="active", state="training",
                       run_id="r" * 64, slot="s0r12", step=123456, loss=2.345678, eval_loss=2.456789,
                       tokens_per_s=12345.6, up_bytes_per_s=123456.7, down_bytes_per_s=123456.7, bytes_sent=1 << 33,
                       bytes_recv=1 << 33, compression_ratio=117.3, state_hash="h" * 64, peers_seen=1000,
                       samples_per_s=12.34, samples_done=1 << 20, tokens_done=1 << 30)
    return len(seal(rec, key))


class TimedBroker(Broker):
    """The real broker, its decisions timed on this machine (wall time: the code's own cost)."""

    def __init__(self, *a: Any, decisions: dict[str, list[float]], **kw: Any):
        self.decisions = decisions
        super().__init__(*a, **kw)

    async def admit(self, peer_id, req):  # type: ignore[override]
        t0 = time.perf_counter()
        try:
            return await super().admit(peer_id, req)
        finally:
            self.decisions["admit"].append((time.perf_counter() - t0) * 1e3)

    def mark_failed(self, peer_id, reason, **kw):  # type: ignore[override]
        t0 = time.perf_counter()
        try:
            return super().mark_failed(peer_id, reason, **kw)
        finally:
            self.decisions["failure"].append((time.perf_counter() - t0) * 1e3)


class Sim:
    def __init__(self, cfg: SimConfig):
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.bytes: dict[str, int] = defaultdict(int)  # gossip kind -> unique bytes every member received
        self.broker_bytes: dict[str, int] = defaultdict(int)  # what the broker sent and received on its own
        self.poll_bytes = 0  # all members' polls, both ways
        self.member_seconds = 0.0  # live members x seconds (run members: polls are per member)
        self.peer_seconds = 0.0  # live peers x seconds (status)
        self.decisions: dict[str, list[float]] = defaultdict(list)
        self.promotions: list[float] = []  # crash of a seated member -> its slot held by another (virtual s)
        self.vacated: list[float] = []  # ... or its lane gone (no backup to take it)
        self.table_sizes: list[int] = []
        self.delta_sizes: list[int] = []
        self.refused = 0
        self.joined = 0
        self.left = {"crash": 0, "leave": 0}
        self.live: dict[str, dict] = {}  # peer -> {"held": envelope, "client": RunClient | None, "member": bool}
        self.crashed: dict[str, tuple[tuple[int, int], float]] = {}  # seated peer -> (slot, crash time)
        self.mismatches = 0  # sampled clients whose table differs from the model's after a publication
        self.observed = 0

    # -- the broker's side
    async def publish(self, env: bytes) -> None:
        kind = unpack(env)["kind"]
        self.bytes[kind] += len(env)
        self.broker_bytes["gossip sent"] += len(env) * self.cfg.fanout
        if kind == "table":
            self.table_sizes.append(len(env))
        elif kind == "table_delta":
            self.delta_sizes.append(len(env))
        if kind not in ("table", "table_delta"):
            return
        signed = open_envelope(env, RECORD_TYPES)
        current = self.broker.table_env
        for pid, m in self.live.items():
            if not m["member"]:
                continue
            # the client's rule: a whole table, or a delta made from the very table held
            if kind == "table" or (isinstance(signed.record, TableDelta) and m["held"]
                                   and table_digest(m["held"]) == signed.record.base_digest):
                m["held"] = current
            c = m["client"]
            if c is not None:  # the real client on the same message: it must end where the rule does
                c.on_record(signed, source=self.broker.ctx.me)
                self.mismatches += c.table_env != m["held"]
        self._check_promotions()

    def _check_promotions(self) -> None:
        t = self.broker.table
        now = trio.current_time()
        for pid, (slot, at) in list(self.crashed.items()):
            if t.slot_of(pid) == slot:
                continue
            holder = next((s.peer_id for s in t.slots if (s.stage, s.replica) == slot), None)
            (self.promotions if holder is not None else self.vacated).append(now - at)
            del self.crashed[pid]

    # -- a peer
    async def peer(self, key: Ed25519PrivateKey, session_s: float, crash: bool, observe: bool) -> None:
        pid = peer_id_of(key)
        end = trio.current_time() + session_s
        b = self.broker
        ans: AdmitResponse = await b.admit(pid, AdmitRequest(run_id=b.ctx.run_id, hardware=HW))
        member = ans.admitted
        if not member:
            self.refused += 1
        else:
            self.joined += 1
        client = None
        if member and observe:
            ctx = replace(b.ctx, sh=SimpleNamespace(key=key, peer_id=pid), publish=self._drop)
            client = RunClient(ctx, HW, broker_id=b.ctx.me, broker_config=self.cfg.broker)
            client.accept_envelope(ans.table, b.ctx.me)
            self.observed += 1
        self.live[pid] = {"held": ans.table or b"", "client": client, "member": member}
        started = trio.current_time()
        try:
            await trio.sleep(self.rng.uniform(0, self.cfg.poll_s))
            while member and trio.current_time() < end:
                ask = {"run_id": b.ctx.run_id}
                held = self.live[pid]["held"]
                if held:
                    ask["have"] = table_digest(held)
                got = await b.handle("run.table", pid, ask)
                self.poll_bytes += len(pack(ask)) + len(pack(got))
                if got.get("table"):
                    self.live[pid]["held"] = got["table"]
                    if client is not None:
                        client.accept_envelope(got["table"], b.ctx.me)
                await trio.sleep(min(self.cfg.poll_s, max(end - trio.current_time(), 0.0)))
            if not member:
                await trio.sleep(max(end - trio.current_time(), 0.0))
        finally:
            gone = self.live.pop(pid)
            span = trio.current_time() - started
            self.peer_seconds += span
            if gone["member"]:
                self.member_seconds += span
        if not member:
            return
        if crash:
            self.left["crash"] += 1
            slot = b.table.slot_of(pid)
            if slot is not None:
                self.crashed[pid] = (slot, trio.current_time())
        else:
            self.left["leave"] += 1
            await b.handle("run.leave", pid, None)

    async def _drop(self, env: bytes) -> None:
        pass

    def session(self) -> float:
        c = self.cfg
        return self.rng.weibullvariate(weibull_scale(c.session_mean_s, c.weibull_k), c.weibull_k)

    async def arrivals(self, nursery: trio.Nursery) -> None:
        c = self.cfg
        observe_left = c.observed
        starts = sorted(self.rng.uniform(0, c.join_over_s) for _ in range(c.n - 1))  # the broker is the first
        t0 = trio.current_time()
        for s in starts:
            await trio.sleep(max(0.0, t0 + s - trio.current_time()))
            nursery.start_soon(self.lifetime, nursery, observe_left > 0)
            observe_left -= 1

    async def lifetime(self, nursery: trio.Nursery, observe: bool) -> None:
        """One place in the swarm: a peer, then after it goes a new one, until the run ends."""
        c = self.cfg
        while trio.current_time() < c.duration_s:
            s = min(self.session(), c.duration_s - trio.current_time())
            await self.peer(Ed25519PrivateKey.generate(), s, self.rng.random() < c.crash_share, observe)
            await trio.sleep(self.rng.expovariate(1 / c.arrival_s))

    async def main(self) -> None:
        c = self.cfg
        me = SimpleNamespace(key=Ed25519PrivateKey.generate())
        me.peer_id = peer_id_of(me.key)
        dht = SimpleNamespace(put_value=self._dht_put)
        me.dht = dht
        m = mf.RunManifest.default(
            model=mf.ModelSpec(size="custom", n_layers=2),
            batch=mf.BatchSpec(batch_size=4, micro_batch_size=4, global_batch=4 * c.lanes),
            plan=mf.ParallelPlan(stages=1, replicas=1, min_replicas=1, max_replicas=c.lanes, backups=0,
                                 sync=mf.SyncSpec(method="allreduce")))
        ctx = RunContext(sh=me, manifest=m, register=lambda *a: None, publish=self.publish, clock=trio.current_time,
                         wall=lambda: EPOCH + trio.current_time(), membership=Membership(me.peer_id),
                         switch_step=lambda stage: 3)
        self.broker = TimedBroker(ctx, c.broker, decisions=self.decisions)
        async with trio.open_nursery() as n:
            await n.start(self.broker.run)
            async with trio.open_nursery() as peers:
                await self.arrivals(peers)
            n.cancel_scope.cancel()

    async def _dht_put(self, key: str, value: bytes) -> None:
        self.broker_bytes["dht puts (value x 20 replicas)"] += len(value) * 20


def run(cfg: SimConfig) -> dict:
    """Simulate and report (virtual time; the wall time it took is in the report)."""
    sim = Sim(cfg)
    t0 = time.perf_counter()
    trio.run(sim.main, clock=trio.testing.MockClock(autojump_threshold=0))
    wall = time.perf_counter() - t0
    d = cfg.duration_s
    avg_members = sim.member_seconds / d
    avg_peers = sim.peer_seconds / d + 1
    status = status_bytes()
    per_node = {kind: v / d for kind, v in sim.bytes.items()}  # unique bytes per second every member receives
    per_node["poll (both ways)"] = sim.poll_bytes / max(sim.member_seconds, 1e-9)
    per_node["status"] = avg_peers * status / cfg.status_s
    gossip_kinds = [k for k in per_node if k not in ("poll (both ways)",)]
    wire = sum(per_node[k] for k in gossip_kinds) * cfg.fanout + per_node["poll (both ways)"]
    dec = {k: {"n": len(v), "p50_ms": pct(v, 0.5), "p99_ms": pct(v, 0.99), "max_ms": max(v)}
           for k, v in sim.decisions.items() if v}
    return {
        "config": {k: v for k, v in cfg.__dict__.items() if k != "broker"},
        "wall_s": round(wall, 1),
        "peers_avg": round(avg_peers, 1), "run_members_avg": round(avg_members, 1), "joined": sim.joined,
        "refused": sim.refused, "left": sim.left,
        "decisions": dec,
        "failure_to_promotion_s": {"n": len(sim.promotions), "p50": pct(sim.promotions, 0.5),
                                   "max": max(sim.promotions, default=None),
                                   "bound": cfg.broker.fail_after_s + cfg.broker.heartbeat_s},
        "vacated_lanes": {"n": len(sim.vacated), "max_s": max(sim.vacated, default=None)},
        "table_bytes": {"max": max(sim.table_sizes, default=0), "p50": pct(sim.table_sizes, 0.5)},
        "delta_bytes": {"n": len(sim.delta_sizes), "p50": pct(sim.delta_sizes, 0.5),
                        "max": max(sim.delta_sizes, default=None)},
        "per_node_unique_bytes_per_s": {k: round(v, 1) for k, v in per_node.items()},
        "per_node_wire_bytes_per_s": round(wire, 1),
        "per_node_wire_without_status": round(wire - per_node["status"] * cfg.fanout, 1),
        "broker_bytes_per_s": {k: round(v / d, 1) for k, v in sim.broker_bytes.items()},
        "status_record_bytes": status,
        "sampled_clients": sim.observed, "sampled_client_mismatches": sim.mismatches,
        "not_modelled": "latency and bandwidth limits, the DHT's hops (the broker's puts are counted, x20 replicas), "
                        "status aggregation, broker failover",
    }


def summary(r: dict) -> str:
    c = r["config"]
    dec = "; ".join(f"{k} p50 {v['p50_ms']:.2f} / p99 {v['p99_ms']:.2f} / max {v['max_ms']:.2f} ms (n {v['n']})"
                    for k, v in r["decisions"].items())
    f = r["failure_to_promotion_s"]
    return (f"n={c['n']}: {c['duration_s']:g} s virtual in {r['wall_s']} s wall; peers {r['peers_avg']}, run members "
            f"{r['run_members_avg']} (joined {r['joined']}, refused {r['refused']}, left {r['left']}); {dec}; "
            f"failure->promotion n {f['n']} p50 {f['p50']} max {f['max']} (bound {f['bound']}); table max "
            f"{r['table_bytes']['max']} B, deltas p50 {r['delta_bytes']['p50']} max {r['delta_bytes']['max']} B; "
            f"per node {r['per_node_unique_bytes_per_s']} B/s unique, {r['per_node_wire_bytes_per_s']} B/s on the "
            f"wire ({r['per_node_wire_without_status']} without status)")

