"""A flood of a training node's collective by a peer that is no member of its group (real node processes on
127.0.0.1, one attacker node in the test): 1 MB messages under the round's own tags. The node drops them unread
and penalizes the sender; its memory stays near its baseline, training goes on, the replicas end identical."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from shoal.swarm.net.rpc import call
from shoal.swarm.run.collective import Collective
from tests.adversarial.attacker import node_with, rss_bytes, rss_within, table_of
from tests.helpers.progress import wait_training
from tests.swarm.test_run_swarm import active, done, make_swarm, write_run

pytestmark = pytest.mark.slow

MB = 1 << 20
STEPS = 300  # the flood lands while it trains, however fast


async def test_a_non_member_flooding_the_collective_is_dropped_and_memory_stays_bounded(tmp_path):
    s = make_swarm(tmp_path, 2, write_run(tmp_path / "w", replicas=2, sync="allreduce"), STEPS)
    try:
        await trio.to_thread.run_sync(s.start)
        await wait_training(s, 2, 5, 120, "training to get going")
        victim = next(r for r in active(s) if r["index"] == 1)
        async with node_with(join=s.bootstrap_addrs()) as x:
            ans = await call(x.sh, victim["peer_id"], "run.table", {"run_id": s.nodes[0].status()["run_id"]})
            t = table_of(ans["table"])
            coll = Collective(x.sh, x.penalties, send_timeout_s=5.0)
            base = peak = rss_bytes(victim["pid"])
            step_before = victim.get("step") or 0
            junk = b"\x7f" * MB
            offered = 0
            with trio.move_on_after(30):
                for i in range(120):  # 120 MB under plausible tags of the victim's group and the next rounds
                    tag = f"{t.run_id[:16]}/0/{t.epochs[0]}/{step_before + 2 + i}/up/rs"
                    await coll.exchange(tag, {victim["peer_id"]: junk}, set(), timeout_s=2.0)
                    offered += 1
                    if i % 10 == 0:
                        peak = max(peak, rss_bytes(victim["pid"]))
            peak = max(peak, rss_bytes(victim["pid"]))
            step_after = next(r for r in s.summary() if r["index"] == 1).get("step") or 0
            after = await rss_within(victim["pid"], base + 48 * MB, 10)
            flooder = x.peer_id
        with trio.fail_after(240):
            while not done(s, STEPS, 2):
                await trio.sleep(0.5)
        rows = active(s)
        log = Path(victim["log"]).read_text()
        print(f"collective flood: {offered} x 1 MB offered by a non-member, {coll.messages_sent} taken whole; victim RSS {base / MB:.1f} MB before, peak "
              f"{peak / MB:.1f} MB during, {after / MB:.1f} MB after; it trained from step {step_before} to {step_after} during the flood; the run finished {STEPS} steps, state hashes "
              f"{sorted({r['state_hash'][:12] for r in rows})}")
        assert len({r["state_hash"] for r in rows}) == 1, rows
        assert step_after > step_before  # training went on while it was flooded
        assert f"peer {flooder} banned" in log and "collective: not a member of stage 0's group" in log
        assert peak - base < 64 * MB and after - base < 48 * MB
    finally:
        await trio.to_thread.run_sync(s.stop)
