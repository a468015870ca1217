"""Floods of a training node's collective (real node processes on 127.0.0.1, attacker nodes in the test): 1 MB
messages under the round's own tags, by a peer that is no member of the run and by a backup of the run under the
group epochs to come. The node drops them unread and penalizes the sender; its memory stays near its baseline,
training goes on, the replicas end identical. And a member's own flood is capped and given back when it expires."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest
import trio

from shoal.protocol.manifest import RunManifest
from shoal.swarm.net.rpc import call
from shoal.swarm.run.collective import Collective
from tests.adversarial.attacker import node_with, rss_bytes, rss_within, start, table_of
from tests.helpers.progress import wait_training
from tests.swarm.test_run_swarm import active, done, make_swarm, write_run

pytestmark = pytest.mark.slow

MB = 1 << 20
STEPS = 300  # the floods land while it trains, however fast


async def flood(coll: Collective, victim: dict, tags: list[str]) -> tuple[int, int, int]:
    """1 MB under each of `tags` to the victim, for 30 s at most: (offered, victim's RSS before, peak)."""
    base = peak = rss_bytes(victim["pid"])
    junk = b"\x7f" * MB
    offered = 0
    with trio.move_on_after(30):
        for i, tag in enumerate(tags):
            await coll.exchange(tag, {victim["peer_id"]: junk}, set(), timeout_s=2.0)
            offered += 1
            if i % 10 == 0:
                peak = max(peak, rss_bytes(victim["pid"]))
    return offered, base, max(peak, rss_bytes(victim["pid"]))


async def test_non_members_and_backups_flooding_the_collective_are_dropped_and_memory_stays_bounded(tmp_path):
    run = write_run(tmp_path / "w", replicas=2, sync="allreduce")
    s = make_swarm(tmp_path, 2, run, STEPS)
    try:
        await trio.to_thread.run_sync(s.start)
        await wait_training(s, 2, 5, 120, "training to get going")
        victim = next(r for r in active(s) if r["index"] == 1)
        run_id = s.nodes[0].status()["run_id"]
        async with node_with(join=s.bootstrap_addrs()) as x:
            t = table_of((await call(x.sh, victim["peer_id"], "run.table", {"run_id": run_id}))["table"])
            coll = Collective(x.sh, x.penalties, send_timeout_s=5.0)
            step_before = victim.get("step") or 0
            # 120 MB under plausible tags of the victim's group and the next rounds
            offered, base, peak = await flood(coll, victim, [f"{t.run_id[:16]}/0/{t.epochs[0]}/{step_before + 2 + i}"
                                                             f"/up/rs" for i in range(120)])
            step_after = next(r for r in s.summary() if r["index"] == 1).get("step") or 0
            after = await rss_within(victim["pid"], base + 48 * MB, 10)
            flooder = x.peer_id
        async with trio.open_nursery() as n:  # a backup of the run: a provider, no member of any group
            b = await start(n, RunManifest.from_toml(run.read_text()), s.bootstrap_addrs(),
                            broker_id=s.nodes[0].status()["peer_id"])
            assert b.client.role() == "backup"
            coll_b = Collective(b.node.sh, b.node.penalties, send_timeout_s=5.0)
            e, r0 = t.epochs[0], step_before + 200
            offered_b, base_b, peak_b = await flood(coll_b, victim, [f"{t.run_id[:16]}/0/{e + 1 + i % 4}/{r0 + i}/up/rs"
                                                                     for i in range(120)])
            after_b = await rss_within(victim["pid"], base_b + 48 * MB, 10)
            backup = b.peer_id
            b.kill()
        with trio.fail_after(240):
            while not done(s, STEPS, 2):
                await trio.sleep(0.5)
        rows = active(s)
        log = Path(victim["log"]).read_text()
        print(f"collective flood: {offered} x 1 MB offered by a non-member, {coll.messages_sent} taken whole; victim "
              f"RSS {base / MB:.1f} MB before, peak {peak / MB:.1f} MB during, {after / MB:.1f} MB after; it "
              f"trained from step {step_before} to {step_after} during the flood. A backup's flood under the next "
              f"4 epochs: {offered_b} x 1 MB offered, {coll_b.messages_sent} taken whole; RSS {base_b / MB:.1f} MB "
              f"before, peak {peak_b / MB:.1f}, {after_b / MB:.1f} after. The run finished {STEPS} steps, state "
              f"hashes {sorted({r['state_hash'][:12] for r in rows})}")
        assert len({r["state_hash"] for r in rows}) == 1, rows
        assert step_after > step_before  # training went on while it was flooded
        assert f"peer {flooder} banned" in log and "collective: not a member of stage 0's group" in log
        assert peak - base < 64 * MB and after - base < 48 * MB
        assert f"peer {backup} banned" in log and f"collective: stage 0 epoch {e + 1} is unknown here" in log
        assert peak_b - base_b < 64 * MB and after_b - base_b < 48 * MB
    finally:
        await trio.to_thread.run_sync(s.stop)


async def test_a_members_flood_is_capped_and_given_back_when_it_expires():
    """A member may put messages in another member's inbox (its rounds' messages may come early), so its flood is
    bounded by the caps sized from the run, and what waits is dropped once its sender no longer waits for this node
    (two round deadlines, two more for an entering node): 200 x 1 MB under tags of rounds to come, on real hosts in
    this process."""
    import tempfile

    from shoal.swarm.run.collective_gate import inbox_limits
    from shoal.swarm.net.penalty import Penalties
    from tests.helpers.swarm import bare_host

    m = RunManifest.from_toml(write_run(Path(tempfile.mkdtemp()), replicas=2, sync="allreduce").read_text())
    lim = inbox_limits(m, round_timeout_s=4.0, entry_grace_rounds=2.0)
    now = [0.0]
    pen = Penalties()
    async with bare_host() as victim_sh, bare_host([victim_sh.addrs[0]]) as member_sh:
        victim = Collective(victim_sh, pen, max_frame_bytes=lim.max_frame_bytes,
                            max_peer_buffer_bytes=lim.max_peer_buffer_bytes, max_buffer_bytes=lim.max_buffer_bytes,
                            max_wait_s=lim.max_wait_s, clock=lambda: now[0])
        flooder = Collective(member_sh, Penalties(), send_timeout_s=5.0)
        base = peak = rss_bytes(os.getpid())
        junk = b"\x7f" * MB
        offered = 0
        for i in range(200):  # until the victim bans it for going over its cap again and again
            if pen.is_banned(member_sh.peer_id):
                break
            await flooder.exchange(f"{m.run_id[:16]}/0/1/{100 + i}/grad/rs", {victim_sh.peer_id: junk}, set(),
                                   timeout_s=2.0)
            offered += 1
            if i % 10 == 0:
                peak = max(peak, rss_bytes(os.getpid()))
        await trio.sleep(0.5)
        held, taken = victim.waiting_bytes, victim.messages_recv
        peak = max(peak, rss_bytes(os.getpid()))
        now[0] += lim.max_wait_s + 1  # the time their sender waits for this node passes
        assert await victim.exchange("other/0/1/0/x", {}, set(), timeout_s=0.1) == {}
        left, expired = victim.waiting_bytes, victim.expired
    gc.collect()
    after = rss_bytes(os.getpid())
    print(f"member flood: {offered} x 1 MB offered, {taken} taken; {held / MB:.1f} MB held (cap "
          f"{lim.max_peer_buffer_bytes / MB:.1f} MB per member); RSS {base / MB:.1f} MB before, peak {peak / MB:.1f}, "
          f"{after / MB:.1f} after expiry; {expired} expired; flooder banned: {pen.is_banned(member_sh.peer_id)}")
    assert held <= lim.max_peer_buffer_bytes and taken <= lim.max_peer_buffer_bytes // MB
    assert left == 0 and expired == taken
    assert "per-peer buffer cap" in pen.reasons(member_sh.peer_id)[-1]
    assert peak - base < 64 * MB and after - base < 16 * MB
