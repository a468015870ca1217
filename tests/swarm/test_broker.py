"""The broker on real nodes (127.0.0.1, one trio loop): admission, private runs, promotion, leave, failover."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import pytest
import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from shoal.protocol.assignment import ACTIVE, BACKUP, DRAINING, GONE, AdmitRequest
from shoal.protocol.manifest import JoinPolicy, ParallelPlan, RunManifest, SyncSpec
from shoal.swarm.run.broker import AdmissionError, Broker, BrokerConfig
from shoal.swarm.run.context import RunContext
from shoal.swarm.net.identity import peer_id_of
from shoal.swarm.net.rpc import RpcError, RpcServer, call
from shoal.swarm.run.client import RunClient, RunClientConfig
from shoal.protocol.tabledelta import table_digest
from shoal.swarm.run.tablerpc import fetch_table
from tests.helpers.swarm import HW, running_node, wait_for

pytestmark = pytest.mark.slow

BCFG = BrokerConfig(heartbeat_s=0.25, fail_after_s=2.0, lease_renew_s=0.5, lease_timeout_s=2.5, republish_s=1.0,
                    ping_timeout_s=1.0, dht_timeout_s=1.0)
CCFG = RunClientConfig(poll_s=0.4, rpc_timeout_s=5.0, retry_s=0.3)  # the default timeout: a loaded CI machine
#: failure by silence out of the way: what these tests check must come from reports and pings
REPORTS_ONLY = BrokerConfig(heartbeat_s=0.25, fail_after_s=60.0, lease_renew_s=0.5, lease_timeout_s=2.5,
                            ping_timeout_s=1.0, dht_timeout_s=1.0)


def manifest(replicas: int = 2, join: JoinPolicy | None = None) -> RunManifest:
    return RunManifest.default(plan=ParallelPlan(replicas=replicas, sync=SyncSpec(method="allreduce")),
                               **({"join": join} if join else {}))


@dataclass
class Member:
    node: object
    client: RunClient | None
    broker: Broker | None
    scope: trio.CancelScope
    ctx: RunContext

    def kill(self) -> None:
        """Stop without a leave notice: the peer just goes silent."""
        self.scope.cancel()


def context(node, m: RunManifest, watch: bool = False) -> RunContext:
    """`watch`: the broker also watches its connections close (as a node's does); without it these tests see
    failure by silence, reports and pings alone."""
    rpc = RpcServer(node.sh, node.penalties)  # the test's server replaces the daemon's; keep its methods
    rpc.register("members", node._rpc_members)
    rpc.register("announce", node._rpc_announce)
    return RunContext(sh=node.sh, manifest=m, register=rpc.register, publish=node.publish,
                      membership=node.membership, penalties=node.penalties,
                      watch_closes=node.sh.watch_closes if watch else None)


async def _member(m: RunManifest, join, broker: bool, broker_id, secret, admit: bool, bcfg, watch, key, table,
                  task_status):
    with trio.CancelScope() as scope:
        async with running_node(join, key=key) as node:
            ctx = context(node, m, watch)
            async with trio.open_nursery() as n:
                b = None
                if broker:
                    b = Broker(ctx, bcfg, secret=secret)
                    await n.start(b.run)
                client = None
                if admit:
                    client = RunClient(ctx, HW, broker_id=broker_id or node.peer_id, secret=secret, config=CCFG,
                                       broker_config=bcfg, local_broker=b)
                    orig = node.gossip.on_record
                    node.gossip.on_record = lambda s, c=client, o=orig: (o(s), c.on_record(s))
                    if table is not None:  # as a node that found the run (node/run/find.py) starts from its table
                        client.accept_envelope(table, broker_id)
                    await n.start(client.run)
                task_status.started(Member(node, client, b, scope, ctx))
                await trio.sleep_forever()


async def start(nursery, m, join=(), *, broker=False, broker_id=None, secret=None, admit=True, bcfg=BCFG,
                watch=False, key=None, table=None) -> Member:
    """`key`: the node's identity (default: a fresh one); `table`: a run table (envelope) it starts from."""
    return await nursery.start(_member, m, list(join), broker, broker_id, secret, admit, bcfg, watch, key, table)


async def test_admission_fills_slots_then_the_backup_pool():
    m = manifest(replicas=2)
    async with trio.open_nursery() as n:
        b = await start(n, m, broker=True)
        addrs, bid = b.node.sh.addrs, b.node.peer_id
        a = await start(n, m, addrs, broker_id=bid)
        c = await start(n, m, addrs, broker_id=bid)
        assert b.client.role() == "active" and b.client.slot_name() == "s0r0" and b.client.is_broker()
        assert a.client.slot_name() == "s0r1" and a.client.role() == "active"
        assert c.client.role() == "backup" and c.client.slot() is None and c.client.group() is None
        t = b.broker.table
        assert t.backups == (c.node.peer_id,) and t.standby == a.node.peer_id
        assert t.provider_states() == {bid: ACTIVE, a.node.peer_id: ACTIVE, c.node.peer_id: BACKUP}
        assert t.providers == ()  # each listed once: in its slot or among the backups
        assert t.epochs == (2,)  # one bump per member that joined stage 0
        for mem in (a, b, c):  # everyone converges on the same signed table
            await wait_for(lambda mem=mem: mem.client.table.version == b.broker.table.version, 5, "convergence")
            assert mem.client.table_env == b.broker.table_env  # whole or rebuilt from a delta: the same bytes
        print("table deltas applied / not, per member:", [(mem.client.deltas_applied, mem.client.deltas_missed) for mem in (a, b, c)])
        g = a.client.group()
        assert g.members == tuple(sorted([bid, a.node.peer_id])) and g.epoch == 2 and g.me == a.node.peer_id
        # a joining node can find the broker through any member
        signed = await fetch_table(c.node.sh, a.node.peer_id, m.run_id)
        assert signed.record.peer_id == bid
        # the table and the lease are in the DHT, signed by the broker
        from shoal.swarm.net.dht_records import lease_key
        await wait_for(lambda: b.broker.lease_env != b"", 5, "a lease")
        with trio.fail_after(5):
            raw = await c.node.sh.dht.get_value(lease_key(bid))
        assert raw is not None
        # a poll names the table the member holds by its digest: the answer then carries the lease, not the table
        ask = {"run_id": m.run_id}
        full = await call(c.node.sh, bid, "run.table", ask)
        same = await call(c.node.sh, bid, "run.table", {**ask, "have": table_digest(full["table"])})
        assert isinstance(full["table"], bytes) and same["table"] is None and same["lease"] is not None
        other = await call(a.node.sh, c.node.peer_id, "run.table", {**ask, "have": bytes(16)})  # any member: the same
        assert other["table"] == c.client.table_env
        with pytest.raises(RpcError, match="16 bytes"):
            await call(c.node.sh, bid, "run.table", {**ask, "have": b"short"})
        n.cancel_scope.cancel()


@pytest.mark.parametrize("mode", ["no_secret", "wrong_secret", "not_allowlisted"])
async def test_private_run_refuses_outsiders(mode):
    if mode == "not_allowlisted":
        m = manifest(join=JoinPolicy(mode="allowlist", allowlist=(peer_id_of(Ed25519PrivateKey.generate()),)))
    else:
        m = manifest(join=JoinPolicy.private())
    async with trio.open_nursery() as n:
        b = await start(n, m, broker=True, admit=False, secret="open sesame")
        outsider = await start(n, m, b.node.sh.addrs, admit=False)
        client = RunClient(outsider.ctx, HW, broker_id=b.node.peer_id, config=CCFG,
                           secret={"wrong_secret": "guess", "no_secret": None}.get(mode))
        with pytest.raises(AdmissionError) as err:
            await client.admit()
        expect = {"no_secret": "join secret is required", "wrong_secret": "wrong join secret",
                  "not_allowlisted": "not on the run's allowlist"}[mode]
        assert expect in str(err.value)
        assert not b.broker.providers
        if mode != "not_allowlisted":  # the right secret gets in
            ok = await start(n, m, b.node.sh.addrs, broker_id=b.node.peer_id, secret="open sesame")
            assert ok.client.slot_name() == "s0r0"
        n.cancel_scope.cancel()


async def test_killed_active_node_is_replaced_by_a_backup():
    m = manifest(replicas=2)
    async with trio.open_nursery() as n:
        b = await start(n, m, broker=True)
        addrs, bid = b.node.sh.addrs, b.node.peer_id
        a = await start(n, m, addrs, broker_id=bid)
        c = await start(n, m, addrs, broker_id=bid)
        epoch0 = b.broker.table.epochs[0]
        a.kill()
        t0 = time.monotonic()
        took = await wait_for(lambda: c.client.slot_name() == "s0r1", 10, "the backup's promotion")
        t = b.broker.table
        assert t.provider_state(a.node.peer_id) == GONE and a.node.peer_id not in t.members(0)
        assert t.epochs[0] == epoch0 + 1 and t.backups == ()
        assert t.standby == c.node.peer_id
        await wait_for(lambda: b.client.table.version == t.version, 5, "the broker's client")
        assert c.client.group().members == tuple(sorted([bid, c.node.peer_id]))
        assert b.broker.seating.promotions[-1][1:] == ("s0r1", a.node.peer_id, c.node.peer_id)
        print(f"promotion after kill: {took:.2f} s (fail_after_s={BCFG.fail_after_s})")
        assert time.monotonic() - t0 < BCFG.fail_after_s + 3
        n.cancel_scope.cancel()


async def test_missing_report_and_graceful_leave_replace_quickly():
    m = manifest(replicas=2)
    async with trio.open_nursery() as n:
        b = await start(n, m, broker=True, bcfg=REPORTS_ONLY)
        addrs, bid = b.node.sh.addrs, b.node.peer_id
        a = await start(n, m, addrs, broker_id=bid)
        c = await start(n, m, addrs, broker_id=bid)
        d = await start(n, m, addrs, broker_id=bid)
        # a graceful leave: draining at once, the best backup takes the slot
        await a.client.leave()
        assert b.broker.table.provider_state(a.node.peer_id) == DRAINING
        assert b.broker.table.slot_of(c.node.peer_id) == (0, 1)
        # a member reported missing that does not answer a ping is failed long before fail_after_s
        await wait_for(lambda: c.client.slot() == (0, 1), 5, "c sees its slot")
        epoch = c.client.epoch(0)
        c.kill()
        await wait_for(lambda: c.node.peer_id not in b.node.sh.connected_peers(), 5, "c's connections to close")
        assert await b.client.report_missing([c.node.peer_id], epoch=epoch, stage=0)
        took = await wait_for(lambda: d.client.slot() == (0, 1), 5, "d promoted")
        assert took < 5
        # a stale report (old epoch) and one from a non-member are not acted on
        assert not await b.client.report_missing([d.node.peer_id], epoch=epoch, stage=0)
        assert not await a.client.report_missing([d.node.peer_id], epoch=b.broker.epochs[0], stage=0)
        assert b.broker.table.slot_of(d.node.peer_id) == (0, 1)
        n.cancel_scope.cancel()


async def test_a_provider_whose_process_died_is_failed_from_its_closed_connections_within_seconds():
    """Failure by silence is out of the way (fail_after_s 60 s): a provider whose connections to the broker closed
    and that does not answer the broker's ping is failed about a second after it died, its slot going to the
    backup; one whose connection was only dropped (its process lives) keeps its slot."""
    m = manifest(replicas=2)
    async with trio.open_nursery() as n:
        b = await start(n, m, broker=True, bcfg=REPORTS_ONLY, watch=True)
        addrs, bid = b.node.sh.addrs, b.node.peer_id
        a = await start(n, m, addrs, broker_id=bid)
        c = await start(n, m, addrs, broker_id=bid)
        await wait_for(lambda: c.client.role() == "backup", 10, "c in the backup pool")
        await b.node.sh.disconnect(a.node.peer_id)  # alive: pinged (or back by itself), keeps its slot
        await trio.sleep(REPORTS_ONLY.reconnect_grace_s + REPORTS_ONLY.ping_timeout_s + 0.5)
        assert b.broker.table.slot_of(a.node.peer_id) == (0, 1) and b.broker.closes.failed == 0
        a.kill()  # its host closes: every connection to it closes, nothing answers on its port
        t0 = time.monotonic()
        took = await wait_for(lambda: b.broker.table.slot_of(c.node.peer_id) == (0, 1), 10, "the backup's promotion")
        print(f"dead provider failed from its closed connections after {took:.2f} s "
              f"(silence would take {REPORTS_ONLY.fail_after_s:g} s)")
        assert b.broker.table.provider_state(a.node.peer_id) == GONE and b.broker.closes.failed == 1
        assert time.monotonic() - t0 < 3.0
        n.cancel_scope.cancel()


async def test_standby_takes_over_when_the_broker_dies():
    m = manifest(replicas=2)
    async with trio.open_nursery() as n:
        b = await start(n, m, broker=True)
        addrs, bid = b.node.sh.addrs, b.node.peer_id
        a = await start(n, m, addrs, broker_id=bid)
        c = await start(n, m, addrs, broker_id=bid)
        # c must know a's address to follow it; in a swarm gossip connects them, here we make sure
        await c.node.sh.connect(a.node.sh.addrs[0])
        for mem in (a, c):
            await wait_for(lambda mem=mem: mem.client.table.standby == a.node.peer_id, 5, "the standby is known")
        old = b.broker.table
        b.kill()
        took = await wait_for(lambda: a.client.is_broker(), 15, "the standby's takeover")
        t = a.client.local_broker.table
        assert t.peer_id == a.node.peer_id and t.lease_epoch == old.lease_epoch + 1 and t.version > old.version
        # c takes the dead broker's slot (in the takeover's table or the next one, as the new broker's first pass)
        await wait_for(lambda: a.client.local_broker.table.slot_of(c.node.peer_id) == (0, 0), 5, "c in s0r0")
        t = a.client.local_broker.table
        assert t.provider_state(bid) == GONE and t.lease_epoch == old.lease_epoch + 1
        assert t.standby == c.node.peer_id
        follow = await wait_for(lambda: c.client.table.peer_id == a.node.peer_id and c.client.slot() == (0, 0),
                                10, "c follows the new broker")
        print(f"broker takeover: {took:.2f} s after the kill (lease_timeout_s={BCFG.lease_timeout_s}); "
              f"c followed {follow:.2f} s later")
        assert took < BCFG.lease_timeout_s + 5
        # the new broker keeps working: a newcomer is admitted by it
        e = await start(n, m, a.node.sh.addrs, broker_id=a.node.peer_id)
        assert e.client.role() == "backup" and e.client.table.peer_id == a.node.peer_id
        n.cancel_scope.cancel()


async def test_a_broker_restarted_with_its_identity_releases_its_lease_and_the_standby_takes_over_at_once():
    """Killed and restarted within a second or two (a crash and a supervisor's restart), the broker's node finds
    itself named broker with no lease. It releases the lease of its previous life, so the standby takes over at
    once instead of when the lease would have run out, and it follows the standby: one hand-over."""
    m = manifest(replicas=2)
    slow = replace(BCFG, lease_timeout_s=30.0)  # the lease would keep everyone waiting half a minute
    key = Ed25519PrivateKey.generate()
    async with trio.open_nursery() as n:
        b = await start(n, m, broker=True, bcfg=slow, key=key)
        addrs, bid = b.node.sh.addrs, b.node.peer_id
        a = await start(n, m, addrs, broker_id=bid, bcfg=slow)
        c = await start(n, m, addrs, broker_id=bid, bcfg=slow)
        await c.node.sh.connect(a.node.sh.addrs[0])
        for mem in (a, c):
            await wait_for(lambda mem=mem: mem.client.table.standby == a.node.peer_id, 5, "the standby is known")
        old = b.broker.table
        t0 = trio.current_time()
        b.kill()
        await trio.sleep(0.5)
        again = await start(n, m, a.node.sh.addrs, broker_id=bid, bcfg=slow, key=key, table=a.client.table_env)
        await wait_for(lambda: a.client.is_broker(), 20, "the standby's takeover")
        took = trio.current_time() - t0
        assert a.client.local_broker.lease_epoch == old.lease_epoch + 1
        await wait_for(lambda: again.client.table.peer_id == a.node.peer_id and not again.client.is_broker(), 10,
                       "the restarted broker follows the standby")
        await wait_for(lambda: c.client.table.peer_id == a.node.peer_id, 10, "c follows the standby")
        print(f"restarted broker: the standby took over {took:.2f} s after the kill "
              f"(lease_timeout_s={slow.lease_timeout_s})")
        assert took < 15.0 and a.client.takeovers and not again.client.takeovers
        n.cancel_scope.cancel()


async def test_a_majority_of_offence_reports_evicts_and_a_live_missing_member_reforms_the_group():
    m = manifest(replicas=3)
    async with trio.open_nursery() as n:
        b = await start(n, m, broker=True, bcfg=REPORTS_ONLY)
        addrs, bid = b.node.sh.addrs, b.node.peer_id
        a = await start(n, m, addrs, broker_id=bid)
        c = await start(n, m, addrs, broker_id=bid)
        d = await start(n, m, addrs, broker_id=bid)  # the backup
        for mem in (a, c):
            await wait_for(lambda mem=mem: mem.client.table.version == b.broker.table.version, 5, "convergence")
        # a member that missed a round but answers its ping: same members, next epoch (everyone's skips reset)
        epoch = b.broker.epochs[0]
        members = b.broker.table.members(0)
        assert await a.client.report_missing([c.node.peer_id], epoch=epoch, stage=0)
        assert b.broker.epochs[0] == epoch + 1 and b.broker.table.members(0) == members
        assert b.broker.reforms == 1 and b.broker.table.switch_step(0) >= 0
        assert not await c.client.report_missing([a.node.peer_id], epoch=epoch, stage=0)  # stale: already re-formed
        assert b.broker.reforms == 1
        # one member's offence report is not enough (it could be the liar); most of the others' is
        epoch += 1
        assert await a.client.report_missing([], epoch=epoch, offenders=[c.node.peer_id], stage=0)
        assert b.broker.table.slot_of(c.node.peer_id) is not None
        assert await b.client.report_missing([], epoch=epoch, offenders=[c.node.peer_id], stage=0)
        t = b.broker.table
        assert t.provider_state(c.node.peer_id) == GONE and t.slot_of(d.node.peer_id) is not None
        assert b.node.penalties.is_banned(c.node.peer_id)  # and it cannot come straight back
        # nor once its ban lapses: evicted for the rest of the run, by this broker and by a standby taking over
        assert t.evicted == (c.node.peer_id,)
        ans = await b.broker.admit(c.node.peer_id, AdmitRequest(run_id=m.run_id, hardware=HW))
        assert not ans.admitted and "evicted" in ans.error and t.provider_state(c.node.peer_id) == GONE
        assert list(Broker.from_table(b.ctx, REPORTS_ONLY, t).evicted) == [c.node.peer_id]
        await wait_for(lambda: c.client.evicted() and not c.client.admitted, 10, "the evicted node to stop asking")
        n.cancel_scope.cancel()


def publishes_step(mem: Member, run_id: str, step: int) -> None:
    """The member's status records now say it trains `run_id` at `step` (as a training node's do)."""
    from types import SimpleNamespace

    from shoal.protocol.records import RunStatus

    mem.node.runtime = SimpleNamespace(client=None, status=lambda: RunStatus(
        run_id=run_id, role="active", state="training", step=step))


async def test_a_member_that_keeps_missing_rounds_is_moved_to_the_backup_pool():
    """Two members: reports alone do not count (one member's word against the other's); the broker's own
    measurement does: the slow member's signed steps lag the other's."""
    cfg = replace(REPORTS_ONLY, straggler_misses=3, straggler_window_s=60.0, demote_hold_s=60.0, corroborate_s=0.0)
    m = manifest(replicas=2)
    async with trio.open_nursery() as n:
        b = await start(n, m, broker=True, bcfg=cfg)
        addrs, bid = b.node.sh.addrs, b.node.peer_id
        slow = await start(n, m, addrs, broker_id=bid)
        spare = await start(n, m, addrs, broker_id=bid)  # the backup
        b.ctx.step = lambda: 40  # the broker's node trains at step 40 ...
        publishes_step(slow, m.run_id, 30)  # ... and the slow member signs that it is at step 30
        await wait_for(lambda: all(e.status_record is not None and e.status_record.step == 30
                                   for e in b.node.membership.live_peers() if e.peer_id == slow.node.peer_id)
                       and any(e.peer_id == slow.node.peer_id for e in b.node.membership.live_peers()), 10,
                       "the slow member's status")
        for _ in range(2):  # it answers its ping: the first misses re-form the group around it
            assert await b.client.report_missing([slow.node.peer_id], epoch=b.broker.epochs[0], stage=0)
            assert b.broker.table.slot_of(slow.node.peer_id) is not None
        assert b.broker.reforms == 2
        assert await b.client.report_missing([slow.node.peer_id], epoch=b.broker.epochs[0], stage=0)
        t = b.broker.table
        assert t.slot_of(slow.node.peer_id) is None and t.provider_state(slow.node.peer_id) == BACKUP
        assert t.slot_of(spare.node.peer_id) == (0, 1) and b.broker.reforms == 2
        b.broker.mark_failed(spare.node.peer_id, "test: the slot frees again")  # held: not promoted straight back
        assert b.broker.table.slot_of(slow.node.peer_id) is None
        n.cancel_scope.cancel()
