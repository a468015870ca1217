"""Floods against a real node process (127.0.0.1): 1 MB values under arbitrary DHT keys and under shoal's own
namespace, and signed records from a swarm of fresh identities. The node stores none of the junk, stays within its
quotas, keeps its memory near its baseline during and after the flood, and penalizes the flooder."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from shoal.protocol import PROTOCOL_VERSION
from shoal.protocol.envelope import seal
from shoal.protocol.records import Announcement
from shoal.swarm.net.dht_records import announcement_key
from shoal.swarm.net.identity import peer_id_of
from shoal.swarm.net.rpc import call
from tests.adversarial.attacker import dht_flood, node_with, records_held, rss_bytes, rss_within
from tests.helpers.swarm import HW

pytestmark = pytest.mark.slow

SHOAL = [sys.executable, "-m", "shoal.node.cli"]
MB = 1 << 20


def signed_announcements(n: int) -> list[tuple[str, bytes]]:
    out = []
    for _ in range(n):
        key = Ed25519PrivateKey.generate()
        pid = peer_id_of(key)
        ann = Announcement(peer_id=pid, addrs=("/ip4/127.0.0.1/tcp/1",), software_version="0.1.0",
                           protocol_version=PROTOCOL_VERSION, hardware=HW, started_at=time.time())
        out.append((announcement_key(pid), seal(ann, key)))
    return out


async def test_a_dht_flood_is_refused_within_quotas_and_memory_stays_at_baseline(tmp_path):
    addr_file = tmp_path / "victim.addrs"
    with open(tmp_path / "victim.out", "w") as out:
        victim = subprocess.Popen([*SHOAL, "node", "--listen", "/ip4/127.0.0.1/tcp/0", "--address-file",
                                   str(addr_file)], stdout=out, stderr=subprocess.STDOUT,
                                  env={**os.environ, "SHOAL_HOME": str(tmp_path / "home"), "PYTHONUNBUFFERED": "1"})
    try:
        with trio.fail_after(90):
            while not addr_file.exists():
                assert victim.poll() is None, (tmp_path / "victim.out").read_text()
                await trio.sleep(0.2)
        target = addr_file.read_text().split()[0]
        victim_id = target.rsplit("/p2p/", 1)[1]
        async with node_with(join=[target]) as x, node_with(join=[target]) as x2, \
                node_with(join=[target]) as honest:
            joined = {x.peer_id, x2.peer_id, honest.peer_id}
            with trio.fail_after(30):  # the baseline once the victim holds all three (their joins are behind it)
                while not joined <= {r.peer_id for r in await records_held(honest.sh, victim_id)}:
                    await trio.sleep(0.2)
            base = rss_bytes(victim.pid)
            junk = os.urandom(MB - 4096)
            peak = base
            sent = stored = refused = 0
            for batch in range(8):  # 8 x 16 MB of 1 MB values under keys no shoal node uses, and under /shoal/
                recs = [(f"/evil/{batch}/{i}", junk) for i in range(8)] + \
                       [(f"/shoal/ann/{batch}x{i}", junk) for i in range(8)]
                s, r = await dht_flood(x, victim_id, recs)
                sent, stored, refused = sent + len(recs) * len(junk), stored + s, refused + r
                peak = max(peak, rss_bytes(victim.pid))
            # valid signed records of 200 fresh identities, put by another flooder: its quota stops them at 64
            sybil_stored, sybil_refused = await dht_flood(x2, victim_id, signed_announcements(200))
            peak = max(peak, rss_bytes(victim.pid))
            after = await rss_within(victim.pid, base + 32 * MB, 10)
            # the victim still serves an honest node; the flooder was penalized and banned
            assert isinstance(await call(honest.sh, victim_id, "members", timeout_s=5), list)
            flooders = (x.peer_id, x2.peer_id)
        log = "".join(p.read_text() for p in (tmp_path / "home" / "logs").glob("*.log"))
        assert all(f"peer {f} banned" in log for f in flooders) and f"peer {honest.peer_id} banned" not in log
        print(f"dht flood: {sent / MB:.0f} MB of junk sent, {stored} stored, {refused} refused; 200 signed records "
              f"from fresh identities: {sybil_stored} stored, {sybil_refused} refused; victim RSS {base / MB:.1f} MB "
              f"before, peak {peak / MB:.1f} MB during, {after / MB:.1f} MB after")
        assert stored == 0 and refused == 128
        assert 60 <= sybil_stored <= 64 and sybil_refused == 200 - sybil_stored  # (its own announcement counts too)
        assert peak - base < 48 * MB  # 128 MB sent: the junk is never kept (a few 1 MB reads in flight)
        assert after - base < 32 * MB
        assert victim.poll() is None
    finally:
        victim.terminate()
        try:
            victim.wait(timeout=20)
        except subprocess.TimeoutExpired:
            victim.kill()
            victim.wait()
