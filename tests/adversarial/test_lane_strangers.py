"""Lane links open only to the lane neighbours the run's tables name (real node processes on 127.0.0.1: a 2-stage
lane, attacker nodes in the test): a stranger's plausible hellos are reset and penalized until it is banned, and a
backup of the run (a provider the tables do not put there) is refused unpunished only a few times; the lane trains
on through the dials and after them."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from shoal.protocol.lane import FWD, LANE_PROTOCOL, LinkHello, Refuse, decode_message, encode_message
from shoal.swarm.net.framing import read_frame
from shoal.swarm.lane.spec import LEN
from tests.adversarial.attacker import node_with, start
from tests.helpers.progress import wait_training
from tests.swarm.test_pipeline_swarm import write_run
from tests.swarm.test_run_swarm import active, make_swarm

pytestmark = pytest.mark.slow

STEPS = 1000  # the run outlasts the test: it must go on through both rounds of dials (up to 40 s each)
DIALS = 300
AFTER = 20  # steps the victim's lane must train once the dials are over


async def dial(sh, victim: str, run_id: str) -> str:
    """One plausible hello for the victim's link b0/fwd of lane 0, from this host: 'refused' (a Refuse record came
    back), 'reset' (the stream ended without one) or 'failed' (no stream: the victim resets us at once, banned)."""
    try:
        with trio.fail_after(5):
            stream = await sh.open_stream(victim, LANE_PROTOCOL)
            body = encode_message(LinkHello(run=run_id, boundary=0, lane=0, direction=FWD, peers=(sh.peer_id, victim)))
            await stream.write(LEN.pack(len(body)) + body)
            raw = await read_frame(stream, 1024)
    except Exception:  # noqa: BLE001 - a reset, a refused stream
        return "reset"
    return "refused" if isinstance(decode_message(raw, frozenset({Refuse.TYPE})), Refuse) else "other"


async def dials(sh, victim: str, run_id: str) -> dict[str, int]:
    out: dict[str, int] = {}
    with trio.move_on_after(40):
        for _ in range(DIALS):
            k = await dial(sh, victim, run_id)
            out[k] = out.get(k, 0) + 1
    return out


def victim_step(s, index: int) -> int:
    return next(r for r in s.summary() if r["index"] == index).get("step") or 0


async def test_strangers_and_unnamed_backups_dialing_a_lane_link_are_penalized(tmp_path):
    run, m = write_run(tmp_path / "w", lanes=1)
    s = make_swarm(tmp_path, 2, run, STEPS)
    try:
        await trio.to_thread.run_sync(s.start)
        await wait_training(s, 2, 5, 120, "training to get going")
        victim = next(r for r in active(s) if r["slot"] == "s1r0")
        t0, step0 = trio.current_time(), victim.get("step") or 0
        async with node_with(join=s.bootstrap_addrs()) as x:
            stranger = await dials(x.sh, victim["peer_id"], m.run_id)
            stranger_id = x.peer_id
        t1, step1 = trio.current_time(), victim_step(s, victim["index"])
        async with trio.open_nursery() as n:
            b = await start(n, m, s.bootstrap_addrs(), broker_id=s.nodes[0].status()["peer_id"])
            assert b.client.role() == "backup"
            backup = await dials(b.node.sh, victim["peer_id"], m.run_id)
            backup_id = b.peer_id
            b.kill()
        step2 = victim_step(s, victim["index"])
        with trio.fail_after(120):
            while victim_step(s, victim["index"]) < step2 + AFTER:
                await trio.sleep(0.5)
        assert all(r.get("error") is None for r in active(s)), active(s)
        log = Path(victim["log"]).read_text()
        print(f"lane link dials by a stranger: {stranger}, by an unnamed backup: {backup}; the victim stage went "
              f"from step {step0} to {step1} in {t1 - t0:.1f} s meanwhile, then from {step2} {AFTER} steps on")
        assert f"peer {stranger_id} banned" in log and "no table of the run names it" in log
        assert stranger.get("refused", 0) == 0  # never answered: reset and penalized from the first dial
        assert f"peer {backup_id} banned" in log
        assert 0 < backup.get("refused", 0) <= 50
    finally:
        await trio.to_thread.run_sync(s.stop)
