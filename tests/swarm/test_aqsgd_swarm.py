"""AQ-SGD through churn across real node processes on 127.0.0.1: 3 stages x 2 lanes over a small train subset;
a middle-stage node is SIGKILLed; the backup of that stage takes the slot (its state from the other lane's stage 1),
pulls both links' stores from the surviving lane neighbours (digests checked), and the lane goes on with the two ends
of each link agreeing again."""

from __future__ import annotations

import re
import signal
from contextlib import contextmanager
from pathlib import Path

import pytest

from shoal.protocol import manifest as mf
from shoal.swarm.net.identity import load_or_create_identity
from tests.swarm.test_pipeline_swarm import stage_of
from tests.helpers.progress import newest_step, training
from tests.swarm.test_run_swarm import active, make_swarm, wait

pytestmark = pytest.mark.slow
B, M, T, H = 8, 4, 32, 32


def write_run(workdir: Path) -> Path:
    workdir.mkdir(parents=True, exist_ok=True)
    m = mf.RunManifest(
        seed=3, model=mf.ModelSpec(size="custom", n_layers=3, d_model=H, n_heads=4),
        data=mf.DataSpec(train_subset=32),
        batch=mf.BatchSpec(batch_size=B, micro_batch_size=B // M, seq_len=T),
        optim=mf.OptimSpec(lr=3e-3, warmup_steps=5, total_steps=1000), eval=mf.EvalSpec(every_steps=0, batches=2),
        plan=mf.ParallelPlan(stages=3, replicas=2, pipeline=mf.PipelineSpec(compression="aqsgd"),
                             sync=mf.SyncSpec(method="allreduce")))
    m = m.signed(load_or_create_identity(workdir / "node0.key"))
    path = workdir / "run.toml"
    path.write_text(m.to_toml())
    return path


def link_ends(s, lane: str) -> dict[tuple[str, str], dict]:
    """(link, side) -> what its node's status says, for the live nodes holding a slot of `lane` ("r0")."""
    out = {}
    for r in active(s):
        if r["slot"].endswith(lane):
            for x in r.get("lane_links") or []:
                out[x["link"], x["side"]] = {**x, "node": r["index"]}
    return out


def recent_digests(s, lane: str) -> dict[str, dict[int, str]]:
    """"link/side" -> {step: digest} over the last steps, from the status files of the live nodes holding a slot of
    `lane` (each end keeps its last steps' digests there, so two ends sampled at different moments share steps)."""
    out = {}
    for r in active(s):
        if r["slot"].endswith(lane):
            st = s.nodes[r["index"]].status() or {}
            for key, hist in (st.get("recent_link_digests") or {}).items():
                out[key] = {int(step): d for step, d in hist.items()}
    return out


def ends_agree(s, lane: str, after: int, seen: list | None = None) -> bool:
    """Both ends of both links of `lane` hold digests for a common step past `after`, and at the newest such step
    they are equal. `seen` collects the mismatches met on the way: docs/pipeline.md "AQ-SGD over a link",
    rule 4 lets a step aborted after the receiver decoded leave the two ends apart until rule 3 (NACK, resend in
    full) repairs the rows at their next visit."""
    digests = recent_digests(s, lane)
    for link in ("b0/fwd", "b1/fwd"):
        a, b = digests.get(f"{link}/sender", {}), digests.get(f"{link}/receiver", {})
        common = [step for step in set(a) & set(b) if step > after]
        if not common:
            return False
        step = max(common)
        if a[step] != b[step]:
            if seen is not None:
                seen.append((link, step, a[step], b[step]))
            return False
    return True


STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


def churn_after(s, stamp: str) -> list[str]:
    """Log lines of any node, later than `stamp`, that tell of a step given up or a lane link lost."""
    out = []
    for n in s.nodes:
        for ln in Path(n.log_file).read_text().splitlines():
            m = STAMP.match(ln)
            if m and m.group(1) > stamp and re.search(r"aborted|given up| lost: ", ln):
                out.append(ln)
    return out


@contextmanager
def training_swarm(tmp_path: Path):
    """8 node processes: 3 stages x 2 lanes and backups of stages 0 and 1, trained past 4 epochs of each lane's 16
    samples; stopped on the way out."""
    s = make_swarm(tmp_path, 8, write_run(tmp_path / "w"), 400)
    try:
        s.start()
        wait(lambda: training(s, 6, 8), 240,
             "training to get going (4 epochs of each lane's 16 samples)", s)
        yield s
    finally:
        s.stop()


def test_a_killed_middle_stage_is_replaced_by_a_backup_that_pulls_both_stores(tmp_path):
    with training_swarm(tmp_path) as s:
        victim = next(r for r in active(s) if stage_of(r) == 1 and r["index"] != 0)
        lane = victim["slot"][-2:]
        before: list = []
        wait(lambda: ends_agree(s, lane, 6, before), 30, "both links' ends to publish equal digests", s)
        assert before == []  # no churn yet: the two ends agree after every step
        backups = [r for r in s.summary() if r.get("role") == "backup" and r.get("warm_stage") == 1]
        assert backups, [(r["index"], r.get("role"), r.get("slot"), r.get("warm_stage")) for r in s.summary()]
        backup = backups[0]
        s.nodes[victim["index"]].proc.send_signal(signal.SIGKILL)
        wait(lambda: any(r["index"] == backup["index"] and r.get("slot") == victim["slot"] for r in active(s)), 60,
             "the stage-1 backup to take the slot", s)
        at = newest_step(s)
        wait(lambda: training(s, 6, at + 5), 120,
             "both lanes training again", s)
        wait(lambda: ends_agree(s, lane, at + 2), 60, "both links' ends to agree after the hand-over", s)
        log = Path(s.nodes[backup["index"]].log_file).read_text()
        pulled = re.findall(r"AQ-SGD store \S+-b(\d)-(\w+): (\d+) rows pulled from \S+ at revision (\d+)", log)
        assert {(b, side) for b, side, _, _ in pulled} == {("0", "receiver"), ("1", "sender")}, log[-3000:]
        assert all(int(n) > 0 for _, _, n, _ in pulled)
        ends = link_ends(s, lane)
        assert ends["b0/fwd", "receiver"]["node"] == ends["b1/fwd", "sender"]["node"] == backup["index"]
        # the pulled stores matched: no row was NACKed, unless a step was given up after the hand-over (rule 4)
        pulled_at = STAMP.match([ln for ln in log.splitlines() if "rows pulled from" in ln][-1]).group(1)
        assert all(e["nacks"] == 0 for e in ends.values()) or churn_after(s, pulled_at), ends
        last = next(r for r in active(s) if stage_of(r) == 2 and r["slot"].endswith(lane))
        assert last["loss"] is not None and last["loss"] < 5.0


def test_both_ends_of_a_link_killed_restart_it_empty_and_it_converges(tmp_path):
    """SIGKILL of the stage-0 and stage-1 nodes of one lane at once: the backups of stages 0 and 1 take both slots;
    link b0 of that lane has two new ends, so it starts empty (nobody holds its store) and fills again with first
    visits; link b1's store is pulled from the surviving stage 2; both links' ends agree again and the lane trains."""
    with training_swarm(tmp_path) as s:
        # the lane whose stage 0 is not node 0 (the run owner's node hosts the broker)
        lane = next(r["slot"][-2:] for r in active(s) if stage_of(r) == 0 and r["index"] != 0)
        victims = [r for r in active(s) if r["slot"].endswith(lane) and stage_of(r) in (0, 1)]
        assert len(victims) == 2 and all(v["index"] != 0 for v in victims), victims
        wait(lambda: ends_agree(s, lane, 6), 30, "both links' ends to publish equal digests", s)
        backups = {r.get("warm_stage"): r for r in s.summary() if r.get("role") == "backup"}
        assert {0, 1} <= set(backups), [(r["index"], r.get("role"), r.get("warm_stage")) for r in s.summary()]
        for v in victims:
            s.nodes[v["index"]].proc.send_signal(signal.SIGKILL)
        want = {f"s{st}{lane}": backups[st]["index"] for st in (0, 1)}
        wait(lambda: all(any(r["index"] == i and r.get("slot") == slot for r in active(s)) for slot, i in want.items()),
             90, "the backups of stages 0 and 1 to take both slots", s)
        at = newest_step(s)
        wait(lambda: training(s, 6, at + 5), 120,
             "both lanes training again", s)
        wait(lambda: ends_agree(s, lane, at + 2), 60, "both links' ends to agree after the restart", s)
        logs = {st: Path(s.nodes[backups[st]["index"]].log_file).read_text() for st in (0, 1)}
        empty_b0 = [ln for txt in logs.values() for ln in txt.splitlines()
                    if re.search(r"AQ-SGD store \S+-b0-\w+.*the link starts empty", ln)]
        assert empty_b0, logs[0][-2000:] + logs[1][-2000:]
        pulled = re.findall(r"AQ-SGD store \S+-b(\d)-(\w+): (\d+) rows pulled from", logs[1])
        assert ("1", "sender") in {(b, side) for b, side, _ in pulled}, logs[1][-3000:]
        ends = link_ends(s, lane)
        assert ends["b0/fwd", "sender"]["node"] == backups[0]["index"]
        assert ends["b0/fwd", "receiver"]["node"] == ends["b1/fwd", "sender"]["node"] == backups[1]["index"]
        assert ends["b0/fwd", "sender"]["rows"] > 0  # refilled by first visits since the restart
        last = next(r for r in active(s) if stage_of(r) == 2 and r["slot"].endswith(lane))
        assert last["loss"] is not None and last["loss"] < 5.0
