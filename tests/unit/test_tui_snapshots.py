"""SVG snapshots of each dashboard screen at 80x24 and 160x48, from the recorded scenario and a fixed clock.

Update with `pytest tests/unit/test_tui_snapshots.py --snapshot-update` after a deliberate visual change.
"""

from __future__ import annotations

import pytest
from tests.helpers.tui_scenario import A2, Clock, play

from shoal.tui.app import DashApp
from shoal.tui.peers import PeerTable

SIZES = {"narrow": (80, 24), "wide": (160, 48)}


def scenario_app() -> DashApp:
    clock = Clock()
    app = DashApp(clock=clock, refresh_s=3600)
    app._scenario_clock = clock
    return app


async def _played(pilot) -> None:
    app = pilot.app
    play(app.feed, app._scenario_clock, tick=lambda now: app.refresh_view())
    app.refresh_view()
    await pilot.pause()


@pytest.mark.parametrize("size", SIZES)
def test_overview(snap_compare, size):
    assert snap_compare(scenario_app(), terminal_size=SIZES[size], run_before=_played)


@pytest.mark.parametrize("size", SIZES)
def test_peers(snap_compare, size):
    async def before(pilot):
        await _played(pilot)
        await pilot.press("2")

    assert snap_compare(scenario_app(), terminal_size=SIZES[size], run_before=before)


@pytest.mark.parametrize("size", SIZES)
def test_peer_detail(snap_compare, size):
    async def before(pilot):
        await _played(pilot)
        await pilot.press("2")
        table = pilot.app.query_one(PeerTable)
        table.move_cursor(row=table._order.index(A2), animate=False)
        await pilot.press("enter")

    assert snap_compare(scenario_app(), terminal_size=SIZES[size], run_before=before)


@pytest.mark.parametrize("size", SIZES)
def test_events(snap_compare, size):
    async def before(pilot):
        await _played(pilot)
        await pilot.press("3")

    assert snap_compare(scenario_app(), terminal_size=SIZES[size], run_before=before)
