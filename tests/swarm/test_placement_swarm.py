"""Placement by the network in a live swarm: four node processes in two sites (network namespaces, a slow link
between), started alternately so that first-fit seating strings both lanes across the slow link. The broker
measures, re-plans and moves the lanes inside the sites through the ordinary switch-step machinery: no step is lost
(every node ends at the run's last step) and each stage's replicas end bit-identical."""

from __future__ import annotations

import re

import pytest

from shoal.bench.placement_live import Live, LiveConfig, _topology

pytestmark = pytest.mark.slow


def test_lanes_across_a_slow_link_move_inside_the_sites_without_losing_a_step(tmp_path):
    steps = 120
    cfg = LiveConfig(nodes=4, between_mbit=4.0, max_steps=steps, replan_every_s=5, move_every_s=10,
                     probe_every_s=2, report_every_s=4, prefix="i26ts", subnet="10.26.11")
    with _topology(cfg, 4) as topo:
        topo.shape_between(0, 1, cfg.between_mbit)
        live = Live(topo, cfg, tmp_path / "w", tmp_path / "home", "network", 4, print)
        try:
            live.start()
            assert live.crossing() == 2  # first come, first seated: both lanes cross the slow link
            live.wait(lambda s: all(st.get("state") == "done" for st in s), 400, f"{steps} steps done")
            final = live.statuses()
        finally:
            live.stop()
    assert live.crossing(final) == 0
    assert [st["step"] for st in final] == [steps] * 4  # no node lost a step
    for stage in ("s0", "s1"):
        hashes = {st["state_hash"] for st in final if st["slot"].startswith(stage)}
        assert len(hashes) == 1, final  # each stage's replicas bit-identical
    _, moves = live.broker_log()
    assert 1 <= len(moves) <= 2, moves  # one lane at a time (a second only if the first left one crossing)
    log = live.swarm.nodes[0].log_file.read_text(errors="replace")
    assert re.search(r"placement: .* s per step predicted now", log)
