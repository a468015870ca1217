"""A change of the run table gossiped as a delta (protocol/tabledelta.py): rebuilt bit for bit and verified as the
whole table, a promotion at 1,000 providers under 2 KB, no way to make a member take a table its broker did not sign,
and a member that missed or got deltas out of order recovers by its poll."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from shoal.protocol.assignment import AdmitRequest
from shoal.protocol.envelope import Signed, open_envelope
from shoal.protocol.errors import DecodeError
from shoal.protocol.kinds import RECORD_TYPES
from shoal.protocol.tabledelta import TableDelta, make_delta, rebuild, table_digest
from shoal.protocol.wire import pack, unpack
from shoal.swarm.run.broker import Broker
from tests.helpers.swarm import HW
from tests.unit.test_run_timing import CFG, FakeClock, admitted, context, signer, standby_client


def opened(env: bytes) -> TableDelta:
    rec = open_envelope(env, RECORD_TYPES).record
    assert isinstance(rec, TableDelta)
    return rec


async def test_a_promotion_at_1000_providers_travels_in_under_2_kb_and_rebuilds_the_signed_table_bit_for_bit():
    b = Broker(context(FakeClock()), CFG)
    for p in await admitted(b, 999):  # 2 slots and 997 backups: a ~36 KB table
        assert b.providers[p]
    full = b.table_env
    seated = [s.peer_id for s in b.table.slots if s.peer_id != b.ctx.me]
    b.mark_failed(seated[0], "silent")  # the first backup takes the slot
    promoted = b.table_env
    d = make_delta(full, promoted, b.ctx.sh.key)
    assert d is not None and len(d) < 2048 < len(full) // 16, (len(d), len(full))
    assert rebuild(full, opened(d)) == promoted  # the very envelope the broker sealed: its signature holds
    assert open_envelope(rebuild(full, opened(d)), RECORD_TYPES).record == b.table
    (newcomer,) = await admitted(b, 1)  # and an admission into the pool
    d2 = make_delta(promoted, b.table_env, b.ctx.sh.key)
    assert d2 is not None and len(d2) < 2048 and rebuild(promoted, opened(d2)) == b.table_env
    print(f"table {len(full):,} B; promotion as a delta {len(d):,} B; admission {len(d2):,} B")


async def test_a_delta_fits_only_the_table_it_was_made_from_and_cannot_carry_a_table_the_broker_did_not_sign():
    b = Broker(context(FakeClock()), CFG)
    await admitted(b, 3)
    v1 = b.table_env
    await admitted(b, 1)
    v2 = b.table_env
    d = opened(make_delta(v1, v2, b.ctx.sh.key))
    with pytest.raises(DecodeError):  # applied to another table than its base
        rebuild(v2, d)
    changes = unpack(d.changes)
    changes["standby"] = ["=", None]  # the same delta saying something else: the broker's signature no longer fits
    forged = dataclasses.replace(d, changes=pack(changes))
    _, client, _ = await standby_client(FakeClock())
    env = rebuild(v1, forged)
    assert not client.accept_envelope(env, "someone")
    with pytest.raises(DecodeError):  # a splice that does not fit the list held
        rebuild(v1, dataclasses.replace(d, changes=pack({"backups": ["~", 5, 5, []]})))
    with pytest.raises(DecodeError):
        rebuild(v1, dataclasses.replace(d, changes=pack({"backups": ["?"]})))


async def test_a_member_that_missed_a_delta_or_got_them_out_of_order_ignores_them_and_its_poll_brings_the_table():
    clock = FakeClock()
    b, client, me = await standby_client(clock)
    held = b.table_env
    await admitted(b, 1)
    v1 = b.table_env
    await admitted(b, 1)
    v2 = b.table_env
    first, second = make_delta(held, v1, b.ctx.sh.key), make_delta(v1, v2, b.ctx.sh.key)
    assert first is not None and second is not None

    def gossip(env: bytes) -> None:
        assert client.on_record(Signed(opened(env), env), source=b.ctx.me)

    gossip(second)  # out of order: made from a table this member does not hold
    assert client.table_env == held
    gossip(first)
    assert client.table_env == v1
    gossip(second)
    assert client.table_env == v2
    await admitted(b, 1)
    v3 = b.table_env
    await admitted(b, 1)  # v3 -> v4 gossiped, v2 -> v3 lost
    gossip(make_delta(v3, b.table_env, b.ctx.sh.key))
    assert client.table_env == v2
    ans = await b.handle("run.table", me.peer_id, {"run_id": b.ctx.run_id, "have": table_digest(client.table_env)})
    assert ans["table"] == b.table_env and client.accept_envelope(ans["table"], b.ctx.me)
    assert client.table.version == b.table.version


async def test_the_broker_gossips_a_change_as_a_delta_the_unchanged_table_whole_and_puts_it_in_the_dht_seldom():
    import trio

    clock = FakeClock()
    sent: list[bytes] = []
    put: list[tuple[str, bytes]] = []
    ctx = context(clock)

    async def publish(env: bytes) -> None:
        sent.append(env)

    async def put_value(key: str, value: bytes) -> None:
        put.append((key, value))

    ctx.sh.dht = SimpleNamespace(put_value=put_value)
    ctx = dataclasses.replace(ctx, publish=publish)
    b = Broker(ctx, dataclasses.replace(CFG, republish_s=0.05))
    async with trio.open_nursery() as n:
        n.start_soon(b._publish_loop)
        await trio.sleep(0.02)
        assert (await b.admit(signer().peer_id, AdmitRequest(run_id=b.ctx.run_id, hardware=HW))).admitted
        await trio.sleep(0.2)
        n.cancel_scope.cancel()
    kinds = [unpack(e)["kind"] for e in sent]
    assert kinds[0] == "table" and "table_delta" in kinds  # the first whole, the change as a delta
    i = kinds.index("table_delta")
    assert kinds[i + 1] == "table"  # and re-gossiped whole once nothing changed
    assert rebuild(sent[i - 1], opened(sent[i])) == sent[i + 1]
    assert [v for _, v in put] == [sent[0]]  # the DHT copy: the first table, then not again within dht_table_s
