"""The dashboard's data layer: liveness from a clock, aggregates, loss history and derived events."""

from __future__ import annotations

import pytest
from tests.helpers.tui_scenario import A1, A2, A3, BROKER, END, K1, K2, RUN, SCENARIO, T0, Clock, announcement, play

from shoal.protocol.records import LeaveNotice, StatusRecord
from shoal.tui import fmt
from shoal.tui.model import EventKind, Liveness, SwarmView, ViewConfig, short_id


def played(until: float = END, config: ViewConfig | None = None) -> SwarmView:
    view, clock = SwarmView(config), Clock()
    play(lambda r: view.feed(r, clock()), clock, tick=view.tick, until=until)
    return view


def st(pid: str, seq: int, t: float, **kw) -> StatusRecord:
    return StatusRecord(peer_id=pid, seq=seq, time=t, **kw)


def test_scenario_events_in_order():
    view = played()
    kinds = [(e.kind, e.peer_id) for e in view.events]
    assert kinds == [
        *[(EventKind.JOIN, p) for p in (BROKER, A1, A2, A3, K1, K2)],
        (EventKind.BROKER, BROKER),
        (EventKind.ERROR, K2),
        (EventKind.ERROR, A2),
        (EventKind.STALE, A2),
        (EventKind.PROMOTION, K1),
        (EventKind.GONE, A2),
        (EventKind.LEAVE, A3),
    ]
    promo = next(e for e in view.events if e.kind is EventKind.PROMOTION)
    assert "s0r1" in promo.text
    assert [e.time for e in view.events] == sorted(e.time for e in view.events)


def test_scenario_summary():
    view = played()
    s = view.summary(END)
    assert (s.active, s.backup, s.idle, s.stale, s.gone) == (3, 1, 0, 0, 2)  # broker counts as active
    assert s.run_id == RUN and s.broker == BROKER
    assert s.global_step == 200
    assert s.tokens_per_s == pytest.approx(5200 + 2400)  # A1 + promoted K1; gone/left peers not counted
    assert s.wire_bytes_per_s == pytest.approx(2 * 1.25e6 + 2_000)
    assert s.uncompressed_bytes_per_s == pytest.approx(2 * 1.25e6 * 17 + 2_000)  # the ratio over the recent window
    assert s.compression == pytest.approx(s.uncompressed_bytes_per_s / s.wire_bytes_per_s)
    assert s.last_loss is not None and s.last_eval_loss is not None
    assert s.model.startswith("tiny GPT · ") and s.plan == "3 replicas · cocktail"


def test_liveness_thresholds_from_the_clock():
    cfg = ViewConfig(stale_after_s=6, gone_after_s=15)
    view = SwarmView(cfg)
    view.feed(st(A1, 1, T0), T0)
    assert view.tick(T0 + 5.9) == []
    assert [e.kind for e in view.tick(T0 + 6.0)] == [EventKind.STALE]
    assert view.peers[A1].liveness is Liveness.STALE
    assert view.tick(T0 + 10) == []  # no repeated events
    assert [e.kind for e in view.tick(T0 + 15.0)] == [EventKind.GONE]
    assert view.summary(T0 + 15).gone == 1
    back = view.feed(st(A1, 2, T0 + 20), T0 + 20)
    assert [e.kind for e in back] == [EventKind.BACK]
    assert view.peers[A1].liveness is Liveness.LIVE


def test_straight_to_gone_without_a_tick_in_between():
    view = SwarmView()
    view.feed(st(A1, 1, T0), T0)
    assert [e.kind for e in view.tick(T0 + 100)] == [EventKind.GONE]


def test_configurable_thresholds():
    view = played(config=ViewConfig(stale_after_s=2.5, gone_after_s=4.0))
    assert view.peers[A2].liveness is Liveness.GONE
    gone = next(e for e in view.events if e.kind is EventKind.GONE)
    assert gone.time - T0 < 25
    with pytest.raises(ValueError):
        ViewConfig(stale_after_s=10, gone_after_s=5)


def test_old_and_repeated_status_ignored():
    view = SwarmView()
    view.feed(st(A1, 5, T0, step=50), T0)
    view.feed(st(A1, 4, T0 + 1, step=40), T0 + 1)
    view.feed(st(A1, 5, T0 + 1, step=45), T0 + 1)
    assert view.peers[A1].status.step == 50


def test_leave_then_late_status_from_before_the_leave():
    view = SwarmView()
    view.feed(st(A1, 1, T0), T0)
    view.feed(LeaveNotice(peer_id=A1, time=T0 + 2, reason="bye"), T0 + 2)
    assert view.feed(st(A1, 2, T0 + 1.5), T0 + 3) == []  # overtaken by its leave notice
    assert view.peers[A1].liveness is Liveness.LEFT
    assert [e.kind for e in view.feed(st(A1, 3, T0 + 10), T0 + 10)] == [EventKind.BACK]


def test_broker_changes_and_loss():
    view = SwarmView()
    view.feed(st(A1, 1, T0, role="broker"), T0)
    ev = view.feed(st(A2, 1, T0 + 1, role="broker"), T0 + 1)
    assert [e.kind for e in ev] == [EventKind.JOIN, EventKind.BROKER]
    assert view.broker == A2 and short_id(A1) in ev[-1].text
    ev = view.feed(LeaveNotice(peer_id=A2, time=T0 + 2), T0 + 2)
    assert [e.kind for e in ev] == [EventKind.LEAVE, EventKind.BROKER] and view.broker is None


def test_error_event_only_when_it_appears_or_changes():
    view = SwarmView()
    view.feed(st(A1, 1, T0, error="boom"), T0)
    assert view.feed(st(A1, 2, T0 + 1, error="boom"), T0 + 1) == []
    assert [e.kind for e in view.feed(st(A1, 3, T0 + 2, error="bang"), T0 + 2)] == [EventKind.ERROR]
    assert [text for _, text in view.peers[A1].errors] == ["boom", "bang"]


def test_run_filter_ignores_other_runs():
    view = SwarmView(ViewConfig(run_id="other"))
    view.feed(st(A1, 1, T0, run_id=RUN, role="active", step=7), T0)
    view.feed(st(A2, 1, T0, run_id="other", role="active", step=3), T0)
    assert set(view.peers) == {A2} and view.summary(T0).global_step == 3


def test_observers_not_counted_and_unknown_kinds_ignored():
    view = SwarmView()
    view.feed(st(A1, 1, T0, role="observer"), T0)
    view.feed(announcement(A2, T0), T0)
    assert view.feed(object(), T0) == [] and view.records_ignored == 1
    s = view.summary(T0)
    assert (s.active, s.idle) == (0, 1)


def test_loss_history_is_mean_per_step_and_bounded():
    view = SwarmView(ViewConfig(loss_points=3))
    for i, pid in enumerate((A1, A2)):
        for step in range(5):
            view.feed(st(pid, step + 1, T0, role="active", step=step, loss=1.0 + i), T0)
    hist = view.loss_history()
    assert [p.step for p in hist] == [2, 3, 4]
    assert all(p.loss == pytest.approx(1.5) for p in hist)


def test_new_record_kind_plugs_in():
    class Assignment:  # stands in for a later record kind
        def __init__(self, plan):
            self.plan = plan

    @SwarmView.register(Assignment)
    def _on_assignment(view, rec, now):
        view.plan = rec.plan

    try:
        view = SwarmView()
        view.feed(Assignment("4 replicas"), T0)
        assert view.summary(T0).plan == "4 replicas"
    finally:
        del SwarmView.HANDLERS[Assignment]


def test_scenario_is_time_ordered():
    assert [t for t, _ in SCENARIO] == sorted(t for t, _ in SCENARIO)


@pytest.mark.parametrize(("value", "text"), [(0, "0"), (999, "999"), (1234, "1.23k"), (1.25e6, "1.25M"), (12.5, "12.5")])
def test_si(value, text):
    assert fmt.si(value) == text


def test_ago_and_sizes():
    assert [fmt.ago(s) for s in (0.4, 42, 125, 7300, 90000)] == ["0s", "42s", "2m", "2h", "1d"]
    assert fmt.nbytes(24 << 30) == "25.8 GB" and fmt.nbytes(12) == "12 B"


def test_aqsgd_link_ends_sampled_at_different_steps_are_judged_at_a_checkpoint_both_carry():
    """Each end's record is taken at its own moment (a fast lane's two ends never publish the same step), but both
    carry their digests at the last multiples of 4, 16 and 64: the verdict is taken at the newest one both hold."""
    from shoal.protocol.records import LinkStatus, checkpoint_steps

    def link(side: str, peer: str, step: int, digest_at) -> LinkStatus:
        checks = checkpoint_steps(range(step + 1))
        return LinkStatus(link="b0/fwd", peer=peer, side=side, compression="aqsgd", step=step,
                          digest=digest_at(step), rows=16, check_steps=tuple(checks),
                          check_digests=tuple(digest_at(s) for s in checks))

    same = lambda s: f"{s:016x}"  # noqa: E731 - the digest after step s, equal at both ends
    view = SwarmView()
    view.feed(st(A1, 1, T0, slot="s0r0", lane_links=(link("sender", A2, 37, same),)), T0)
    view.feed(st(A2, 1, T0, slot="s1r0", lane_links=(link("receiver", A1, 43, same),)), T0)
    assert view.peers[A1].link_verdicts == {("b0/fwd", "sender"): "agrees"}  # at step 36, a checkpoint of both
    assert view.peers[A2].link_verdicts == {("b0/fwd", "receiver"): "agrees"}
    apart = lambda s: same(s) if s < 44 else "ff" * 8  # noqa: E731 - the receiver's rows went their own way
    view.feed(st(A1, 2, T0 + 4, slot="s0r0", lane_links=(link("sender", A2, 50, same),)), T0 + 4)
    view.feed(st(A2, 2, T0 + 4, slot="s1r0", lane_links=(link("receiver", A1, 53, apart),)), T0 + 4)
    assert view.peers[A1].link_verdicts == {("b0/fwd", "sender"): "differs"}  # at step 48
    assert view.peers[A2].link_verdicts == {("b0/fwd", "receiver"): "differs"}


def test_aqsgd_link_digests_are_judged_against_the_other_end_at_a_common_step():
    from shoal.protocol.records import LinkStatus
    from shoal.tui.peers import peer_detail

    def link(side: str, peer: str, step: int, digest: str) -> LinkStatus:
        return LinkStatus(link="b0/fwd", peer=peer, side=side, compression="aqsgd", step=step, digest=digest, rows=16)

    view = SwarmView()
    rec = st(A1, 1, T0, slot="s0r0", lane_links=(link("sender", A2, 4, "aa" * 8),))
    assert StatusRecord.from_wire(rec.to_wire()) == rec
    view.feed(rec, T0)
    assert view.peers[A1].link_verdicts == {("b0/fwd", "sender"): "pending"}  # the other end not heard yet
    view.feed(st(A2, 1, T0, slot="s1r0", lane_links=(link("receiver", A1, 5, "bb" * 8),)), T0)
    assert view.peers[A2].link_verdicts == {("b0/fwd", "receiver"): "pending"}  # no step both published
    view.feed(st(A1, 2, T0 + 1, slot="s0r0", lane_links=(link("sender", A2, 5, "bb" * 8),)), T0 + 1)
    assert view.peers[A1].link_verdicts == {("b0/fwd", "sender"): "agrees"}
    assert view.peers[A2].link_verdicts == {("b0/fwd", "receiver"): "agrees"}
    view.feed(st(A2, 2, T0 + 2, slot="s1r0", lane_links=(link("receiver", A1, 6, "cc" * 8),)), T0 + 2)
    view.feed(st(A1, 3, T0 + 2, slot="s0r0", lane_links=(link("sender", A2, 6, "dd" * 8),)), T0 + 2)
    assert view.peers[A1].link_verdicts == {("b0/fwd", "sender"): "differs"}
    assert view.peers[A2].link_verdicts == {("b0/fwd", "receiver"): "differs"}
    from rich.console import Console
    console = Console(width=120, record=True)
    console.print(peer_detail(view.peers[A1], T0 + 2))
    text = console.export_text()
    assert "b0/fwd → " in text and "16 rows" in text and "differs" in text


# -- issue: a dashboard that tells the truth ----------------------------------------------------------------------
def test_the_model_row_comes_from_the_runs_manifest():
    from shoal.protocol import manifest as mf

    m = mf.RunManifest.default("tiny", model=mf.ModelSpec.preset("tiny", tie_embeddings=False),
                               plan=mf.ParallelPlan(stages=2, replicas=3, sync=mf.SyncSpec(method="diloco")))
    view = SwarmView()
    view.feed(st(A1, 1, T0, run_id=m.run_id, role="active", step=1), T0)
    assert view.summary(T0).model is None
    view.feed(m, T0)
    s = view.summary(T0)
    assert s.model == f"tiny GPT · {fmt.si(m.stage_params(0) + m.stage_params(1))} params"
    assert s.plan == "2 stages × 3 lanes · diloco"
    other = mf.RunManifest.default("small")
    view.feed(other, T0)  # another run's manifest: not this view's run
    assert view.summary(T0).model.startswith("tiny GPT") and view.records_ignored == 1


def test_lane_link_traffic_and_the_ratio_over_the_same_window():
    """up/s counts a stage's lane links (the node sums them in); the ratio is each node's over its recent window,
    so a promoted backup's (no warm-up in it) weighs like everyone else's."""
    view = SwarmView()
    view.feed(st(A1, 1, T0, role="active", up_bytes_per_s=600_000.0, ratio_now=4.0, compression_ratio=9.8), T0)
    view.feed(st(K1, 1, T0, role="active", up_bytes_per_s=200_000.0, ratio_now=4.0, compression_ratio=171.3), T0)
    view.feed(st(A2, 1, T0, role="active", up_bytes_per_s=100.0, compression_ratio=2.0), T0)  # an older node
    s = view.summary(T0)
    assert s.wire_bytes_per_s == pytest.approx(800_100.0)
    assert s.uncompressed_bytes_per_s == pytest.approx(4.0 * 800_000 + 200.0)


def test_history_from_before_the_dashboard_and_evals_at_their_steps():
    """A dashboard that starts at step 300 draws the run from the records' thinned history; each step of each peer
    counts once however many records repeat it; held-out points sit at the steps they were taken, not at every
    later step (which drew long flat lines)."""
    view = SwarmView()
    hist = dict(history_steps=(0, 100, 200), history_mloss=(5000, 3000, 2500), eval_steps=(100, 200),
                eval_mloss=(3100, 2600))
    for seq in (1, 2, 3):  # three records at the same step
        view.feed(st(A1, seq, T0 + seq, role="active", step=300, loss=2.2, eval_loss=2.6, **hist), T0 + seq)
    view.feed(st(A2, 1, T0, role="active", step=300, loss=2.4, eval_loss=2.6, **hist), T0)
    pts = {p.step: p for p in view.loss_history()}
    assert sorted(pts) == [0, 100, 200, 300]
    assert pts[0].loss == pytest.approx(5.0) and pts[300].loss == pytest.approx(2.3)  # A1 once, A2 once
    assert [s for s, p in sorted(pts.items()) if p.eval_loss is not None] == [100, 200]
    assert pts[200].eval_loss == pytest.approx(2.6)
    older = SwarmView()  # a node without an eval history: its held-out loss counts when it changes
    for seq, step, ev in ((1, 10, 3.0), (2, 20, 3.0), (3, 30, 2.9)):
        older.feed(st(A1, seq, T0, role="active", step=step, loss=3.5, eval_loss=ev), T0)
    assert [p.step for p in older.loss_history() if p.eval_loss is not None] == [10, 30]


def test_status_history_is_checked_on_read():
    with pytest.raises(ValueError, match="2 values for 3 steps"):
        st(A1, 1, T0, step=10, history_steps=(1, 2, 3), history_mloss=(1, 2))
    with pytest.raises(ValueError, match="increase"):
        st(A1, 1, T0, step=10, eval_steps=(5, 5), eval_mloss=(1, 2))
    with pytest.raises(ValueError, match="ahead"):
        st(A1, 1, T0, step=10, eval_steps=(11,), eval_mloss=(1,))


def test_a_gone_peer_leaves_the_count():
    view = played()
    assert {p.peer_id for p in view.present_peers(END)} == {BROKER, A1, K1, K2}  # A2 gone, A3 left


def test_an_old_record_from_a_snapshot_does_not_bring_a_silent_peer_back():
    """A broker killed: its gossip stops, it turns stale; the observer's next members snapshot carries its last
    record (newer than any the dashboard got, some of which gossip lost) with that record's age. That is old news,
    not the peer reporting again; a fresh record is."""
    view = SwarmView(ViewConfig(stale_after_s=6, gone_after_s=15))
    view.feed(st(BROKER, 1, T0, role="broker"), T0)
    view.tick(T0 + 7)
    assert view.peers[BROKER].liveness is Liveness.STALE
    events = view.feed(st(BROKER, 2, T0 + 2, role="broker"), T0 + 8, age_s=6.5)  # signed at T0+1.5 by the clock of its arrival
    assert [e.kind for e in events] == [] and view.peers[BROKER].liveness is Liveness.STALE
    assert [e.kind for e in view.tick(T0 + 16.6)] == [EventKind.GONE, EventKind.BROKER]  # by its last record's time
    events = view.feed(st(BROKER, 3, T0 + 17, role="broker"), T0 + 17)  # it really is back (a restart)
    assert [e.kind for e in events] == [EventKind.BACK, EventKind.BROKER]
