"""Members and backups lying to the broker (real nodes on 127.0.0.1 in the test's trio loop, a real broker): a
backup inflating its hardware does not jump the promotion queue."""

from __future__ import annotations

import pytest
import trio

from shoal.protocol.records import HardwareProfile
from tests.adversarial.attacker import signed_manifest, start
from tests.helpers.swarm import HW, wait_for

pytestmark = pytest.mark.slow

BIG = HardwareProfile(device_kind="cuda", device_name="H100 (says who)", memory_bytes=2**49, matmul_tflops=9e4,
                      free_disk_bytes=2**59, cpu_count=4096)


async def test_a_backup_inflating_its_hardware_does_not_jump_the_promotion_queue():
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    owner = Ed25519PrivateKey.generate()
    m = signed_manifest(owner, replicas=2)
    async with trio.open_nursery() as n:
        b = await start(n, m, key=owner, broker=True)
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
