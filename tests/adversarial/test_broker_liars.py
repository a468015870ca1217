"""Members and backups lying to the broker (real nodes on 127.0.0.1 in the test's trio loop, a real broker): a
backup inflating its hardware does not jump the promotion queue."""

from __future__ import annotations

import pytest
import trio

from shoal.protocol.records import HardwareProfile
from tests.adversarial.attacker import owner_broker, start
from tests.helpers.swarm import HW, wait_for

pytestmark = pytest.mark.slow

BIG = HardwareProfile(device_kind="cuda", device_name="H100 (says who)", memory_bytes=2**49, matmul_tflops=9e4,
                      free_disk_bytes=2**59, cpu_count=4096)


async def test_a_backup_inflating_its_hardware_does_not_jump_the_promotion_queue():
    async with trio.open_nursery() as n:
        m, b = await owner_broker(n, 2)
        addrs, bid = b.addrs, b.peer_id
        a = await start(n, m, addrs, broker_id=bid)
        honest = await start(n, m, addrs, broker_id=bid, hardware=HW)  # the first backup
        liar = await start(n, m, addrs, broker_id=bid, hardware=BIG)  # the second, claiming a data-centre GPU
        assert honest.client.role() == liar.client.role() == "backup"
        assert b.broker.table.backups == (honest.peer_id, liar.peer_id)
        a.kill()
        await wait_for(lambda: b.broker.seating.promotions, 15, "a promotion")
        promoted = b.broker.seating.promotions[-1][3]
        print(f"slot of a killed member filled by the {'honest first backup' if promoted == honest.peer_id else 'liar'}")
        assert promoted == honest.peer_id
        n.cancel_scope.cancel()


async def test_one_members_word_neither_demotes_nor_evicts_another_and_a_false_accuser_is_penalized():
    """Three members and a backup: a member that keeps reporting an honest one as missing rounds (it answers its
    pings, and nobody else reports it) gets it no miss counted, and after three unconfirmed reports is penalized and
    no longer re-forms the group. Two members: one's offence report against the other evicts nobody."""
    from shoal.protocol.assignment import ACTIVE
    from tests.adversarial.attacker import BCFG

    async with trio.open_nursery() as n:
        m, b = await owner_broker(n, 3)
        addrs, bid = b.addrs, b.peer_id
        honest = await start(n, m, addrs, broker_id=bid)
        liar = await start(n, m, addrs, broker_id=bid)
        spare = await start(n, m, addrs, broker_id=bid)  # a backup: a demotion would have a taker
        assert spare.client.role() == "backup"
        reforms = []
        for _ in range(BCFG.straggler_misses + 2):
            await liar.client.report_missing([honest.peer_id], epoch=b.broker.epochs[0], stage=0)
            reforms.append(b.broker.reforms)
        t = b.broker.table
        print(f"{BCFG.straggler_misses + 2} lone reports that a member missed a round: it is "
              f"{t.provider_state(honest.peer_id)} in its slot; groups re-formed after each: {reforms}; the "
              f"reporter's penalties: {b.node.penalties.reasons(liar.peer_id)}")
        assert t.slot_of(honest.peer_id) is not None and t.provider_state(honest.peer_id) == ACTIVE
        assert "unconfirmed" in b.node.penalties.reasons(liar.peer_id)[-1]
        assert reforms[-1] == reforms[BCFG.straggler_misses - 1]  # a false accuser re-forms nothing more
        n.cancel_scope.cancel()
    async with trio.open_nursery() as n:
        m, b = await owner_broker(n, 2, admit=False)  # the broker holds no slot here
        honest = await start(n, m, b.addrs, broker_id=b.peer_id)
        liar = await start(n, m, b.addrs, broker_id=b.peer_id)
        assert set(b.broker.table.members(0)) == {honest.peer_id, liar.peer_id}
        for _ in range(3):
            await liar.client.report_missing([], epoch=b.broker.epochs[0], stage=0, offenders=[honest.peer_id])
        t = b.broker.table
        print(f"two members, three offence reports by one against the other: it is {t.provider_state(honest.peer_id)}")
        assert t.provider_state(honest.peer_id) == ACTIVE and not b.node.penalties.is_banned(honest.peer_id)
        n.cancel_scope.cancel()
