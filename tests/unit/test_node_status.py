"""What a training node says of itself in its status: byte rates with the lane links counted, the compression ratio
over the same window for every node, and the thinned loss history a late dashboard draws the run from."""

from __future__ import annotations

import pytest

from shoal.node.run.status import Thinned, Throughput


def test_the_ratio_is_measured_over_the_recent_window_so_a_late_backup_compares():
    """A node that sent the uncompressed warm-up and a backup promoted after it: the cumulative ratios differ ~10x
    (17x beside 171x in the field); over the recent window both are the codec's 10x."""
    first, late = Throughput(), Throughput()
    sent = fp32 = 0
    for t in range(1, 41):
        warm = t <= 20
        sent += 1_000_000 if warm else 100_000  # 1 MB a second of fp32 tensors; 10x compressed after warm-up
        fp32 += 1_000_000
        up, _, ratio = first.rates(float(t), sent, 0, fp32)
    late_sent = late_fp32 = 0
    for t in range(21, 41):
        late_sent, late_fp32 = late_sent + 100_000, late_fp32 + 1_000_000
        late_up, _, late_ratio = late.rates(float(t), late_sent, 0, late_fp32)
    assert fp32 / sent == pytest.approx(1.82, abs=0.01) and late_fp32 / late_sent == pytest.approx(10.0)
    assert ratio == pytest.approx(10.0, rel=0.01) and late_ratio == pytest.approx(10.0, rel=0.01)
    assert up == pytest.approx(100_000, rel=0.01) and late_up == pytest.approx(100_000, rel=0.01)
    idle = Throughput()
    assert idle.rates(1.0, 0, 0, 0)[2] is None and idle.rates(2.0, 0, 5, 0) == (0.0, 2.5, None)


def test_a_thinned_history_spans_the_whole_run_in_a_bounded_number_of_points():
    h = Thinned(16)
    for step in range(10_000):
        h.add(step, 5.0 - step / 10_000)
    steps = [s for s, _ in h.points]
    assert len(steps) <= 16 and steps[0] == 0 and steps[-1] > 9_000
    gaps = {b - a for a, b in zip(steps, steps[1:])}
    assert max(gaps) <= 2 * min(gaps)  # spread evenly, not bunched at the end
    h.add(9_999, float("nan"))  # non-finite values are never recorded
    fields = h.fields("s", "v", upto=5_000)
    assert max(fields["s"]) <= 5_000 and fields["v"][0] == 5_000  # thousandths
    with pytest.raises(ValueError):
        Thinned(1)


def test_no_status_line_is_printed_before_the_node_has_said_how_others_join_it():
    """`shoal node` prints its ready line (with the join address) once the node is up; the status printer sees the
    node "ready" a moment earlier (while it starts its links and run) and, on a loaded machine, printed a status
    line first: a script that waits for the first status line then read an address file not yet written."""
    import types

    import trio
    import trio.testing

    from shoal.node.cli.progress import print_progress

    node = types.SimpleNamespace(state="ready", phase="ready", runtime=None, membership=None, role="peer", events=[])
    said: list[str] = []

    async def main():
        announced = trio.Event()
        async with trio.open_nursery() as n:
            n.start_soon(lambda: print_progress(node, 1.0, said.append, announced=announced))
            await trio.sleep(5)
            assert said == []  # up, but not yet announced: nothing
            said.append("ready; others join with: …")
            announced.set()
            await trio.sleep(1.5)
            n.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert said[0].startswith("ready;") and len(said) == 2 and " · peer · 0 peers" in said[1], said
