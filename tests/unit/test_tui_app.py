"""Pilot tests of the dashboard: navigation, sorting, filtering and selection over the recorded scenario.

Textual runs on asyncio while the test suite runs on trio, so each test drives its own asyncio loop.
"""

from __future__ import annotations

import asyncio
import io


from rich.console import Console
from textual.widgets import Static

from tests.helpers.tui_scenario import A1, A2, A3, BROKER, END, K1, K2, T0, Clock, play

from shoal.protocol.records import LeaveNotice, StatusRecord
from shoal.tui.app import DashApp
from shoal.tui.events import EventsTable
from shoal.tui.model import EventKind, Liveness, ViewConfig
from shoal.tui.peers import COLUMN_KEYS, PeersPane, PeerTable

SIZE = (80, 24)


def run(body, until: float = END, size=SIZE, config: ViewConfig | None = None) -> None:
    """Start the app headless at `size`, play the scenario up to `until`, then `await body(app, pilot, clock)`."""

    async def main():
        clock = Clock()
        app = DashApp(config, clock=clock, refresh_s=3600)  # time moves only when the test moves it
        async with app.run_test(size=size) as pilot:
            play(app.feed, clock, tick=lambda now: app.refresh_view(), until=until)
            app.refresh_view()
            await pilot.pause()
            await body(app, pilot, clock)

    asyncio.run(main())


def rows(app: DashApp) -> list[str]:
    return list(app.query_one(PeerTable)._order)


def static_text(app: DashApp, selector: str) -> str:
    console = Console(width=120, record=True, file=io.StringIO())
    console.print(app.query_one(selector, Static).content)
    return console.export_text()


def detail_text(app: DashApp) -> str:
    return static_text(app, "#peer-detail")


def test_tabs_by_key_and_quit():
    async def body(app, pilot, clock):
        from textual.widgets import TabbedContent

        tabs = app.query_one(TabbedContent)
        assert tabs.active == "overview"
        await pilot.press("2")
        assert tabs.active == "peers" and app.focused is app.query_one(PeerTable)
        await pilot.press("3")
        assert tabs.active == "events" and app.focused is app.query_one(EventsTable)
        await pilot.press("1")
        assert tabs.active == "overview"
        await pilot.press("q")
        assert app.return_code == 0

    run(body)


def test_all_peers_shown_with_liveness():
    async def body(app, pilot, clock):
        assert sorted(rows(app)) == sorted([BROKER, A1, A2, A3, K1, K2])
        assert app.view.peers[A2].liveness is Liveness.GONE
        assert app.view.peers[A3].liveness is Liveness.LEFT
        table = app.query_one(PeerTable)
        assert str(table.get_cell(A2, "state")) == "gone"
        assert str(table.get_cell(A3, "state")) == "left"
        assert str(table.get_cell(K1, "role")) == "active"  # promoted
        events = app.query_one(EventsTable)
        assert events.row_count == len(app.view.events)
        assert str(events.get_row_at(0)[1]) == EventKind.LEAVE.value  # newest first

    run(body)


def test_stale_then_gone_without_new_records():
    async def body(app, pilot, clock):
        table = app.query_one(PeerTable)
        assert str(table.get_cell(A2, "state")) == "training"
        clock.t = T0 + 27
        app.refresh_view()  # what the refresh timer does
        assert str(table.get_cell(A2, "state")) == "stale"
        clock.t = T0 + 40
        app.refresh_view()
        assert str(table.get_cell(A2, "state")) == "gone"

    run(body, until=T0 + 20)


def test_refresh_timer_runs_on_its_own():
    async def main():
        clock = Clock()
        app = DashApp(clock=clock, refresh_s=0.05)
        async with app.run_test(size=SIZE) as pilot:
            app.feed(StatusRecord(peer_id=A1, seq=1, time=T0, role="active"))
            await pilot.pause()
            clock.t = T0 + 100
            await pilot.pause(0.3)
            assert app.view.peers[A1].liveness is Liveness.GONE

    asyncio.run(main())


def test_sort_by_key_and_header():
    async def body(app, pilot, clock):
        await pilot.press("2")
        table = app.query_one(PeerTable)
        assert table.sort_column == "role" and rows(app)[0] == BROKER
        await pilot.press("s")  # role -> slot
        assert table.sort_column == COLUMN_KEYS[COLUMN_KEYS.index("role") + 1]
        while table.sort_column != "step":
            await pilot.press("s")
        steps = [app.view.peers[p].status.step for p in rows(app)]
        assert steps == sorted(steps)
        await pilot.press("r")
        steps = [app.view.peers[p].status.step for p in rows(app)]
        assert steps == sorted(steps, reverse=True) and table.sort_reverse
        await pilot.click(PeerTable, offset=(3, 0))  # the "peer" header
        assert table.sort_column == "peer" and rows(app) == sorted(rows(app))

    run(body)


def test_filter_by_typing():
    async def body(app, pilot, clock):
        await pilot.press("2", "slash", *"syncing")
        assert rows(app) == [K2]  # K1 was promoted; only K2 is still a backup
        await pilot.press("escape")  # back to the table, filter kept
        assert app.focused is app.query_one(PeerTable) and rows(app) == [K2]
        await pilot.press("slash", *"cuda active")  # focusing selects the old text; typing replaces it
        assert sorted(rows(app)) == sorted([A1, A2, K1])
        await pilot.press("enter", "escape")
        assert app.query_one(PeersPane).filter_text == ""  # escape in the table clears the filter
        assert len(rows(app)) == 6

    run(body)


def test_select_row_shows_detail_and_follows_updates():
    async def body(app, pilot, clock):
        await pilot.press("2")
        pane = app.query_one(PeersPane)
        table = app.query_one(PeerTable)
        assert not pane.has_class("-detail")
        table.move_cursor(row=rows(app).index(A2))
        await pilot.press("enter")
        assert pane.selected == A2 and pane.has_class("-detail")
        detail = detail_text(app)
        assert "RTX 3090" in detail and "sync with s0r0 timed out" in detail and "/ip4/127.0.0.1/tcp/4003" in detail
        # the highlighted row stays on the same peer when the order changes
        app.feed(StatusRecord(peer_id=A2, seq=99, time=END, role="backup", state="ready", step=200))
        await pilot.pause()
        assert table.highlighted_peer == A2
        assert "backup" in detail_text(app)
        await pilot.press("escape")
        assert pane.selected is None and not pane.has_class("-detail")

    run(body)


def test_detail_beside_the_table_when_wide():
    async def body(app, pilot, clock):
        await pilot.press("2", "enter")
        detail = app.query_one("#peer-detail")
        table = app.query_one(PeerTable)
        assert detail.region.x > table.region.x and detail.region.y == table.region.y
        await pilot.resize_terminal(80, 24)
        await pilot.pause()
        assert detail.region.y > table.region.y  # below the table on a narrow terminal

    run(body, size=(160, 48))


def test_late_dashboard_fills_from_a_snapshot():
    async def body(app, pilot, clock):
        assert rows(app) == []
        await pilot.press("2")
        play(app.feed, clock, until=T0 + 3)  # a burst, as the observer's membership snapshot arrives
        await pilot.pause()
        assert len(rows(app)) == 6

    run(body, until=T0 - 1)


def test_records_from_another_thread_before_and_while_running():
    import threading

    async def main():
        clock = Clock(END)
        app = DashApp(clock=clock, refresh_s=3600)
        app.feed_threadsafe(StatusRecord(peer_id=A1, seq=1, time=T0, role="active"))  # before the app runs
        async with app.run_test(size=SIZE) as pilot:
            t = threading.Thread(target=app.feed_threadsafe,
                                 args=(StatusRecord(peer_id=A2, seq=1, time=T0, role="backup"),))
            t.start()
            t.join()
            for _ in range(50):  # the inbox is drained every 0.1 s; a loaded machine may need a few polls
                await pilot.pause(0.1)
                if set(rows(app)) == {A1, A2}:
                    break
            assert set(rows(app)) == {A1, A2}

    asyncio.run(main())


def test_cmd_dash_argument_errors(tmp_path, monkeypatch, capsys):
    from shoal.node.cli import main as shoal_main

    monkeypatch.setenv("SHOAL_HOME", str(tmp_path))
    assert shoal_main(["dash", "--local"]) == 2
    assert "no local swarm" in capsys.readouterr().err
    assert shoal_main(["dash"]) == 2
    assert shoal_main(["dash", "--join", "/ip4/127.0.0.1/tcp/1", "--stale-after", "9", "--gone-after", "3"]) == 2


# -- a dashboard that tells the truth ------------------------------------------------------------------------------
def overview_text(app: DashApp) -> str:
    return static_text(app, "#summary")


def test_the_overview_names_the_model_and_plan():
    async def body(app, pilot, clock):
        text = overview_text(app)
        assert "Model    tiny GPT · " in text and "params" in text, text
        assert "Plan     3 replicas · cocktail" in text, text

    run(body)


def test_peers_show_their_loss_the_stage_a_backup_keeps_warm_and_no_figures_once_gone():
    async def body(app, pilot, clock):
        table = app.query_one(PeerTable)
        assert str(table.get_cell(K2, "slot")) == "warm s0"  # a backup: the stage it keeps warm
        assert str(table.get_cell(A1, "loss")) == f"{app.view.peers[A1].status.loss:.3f}"
        assert str(table.get_cell(BROKER, "loss")) == "-"
        for gone in (A2, A3):  # gone and left: no live figures
            assert str(table.get_cell(gone, "tps")) == "-" and str(table.get_cell(gone, "up")) == "-"
        assert str(table.get_cell(A1, "tps")) != "-"
        assert app.sub_title.startswith("4 peers")  # the gone and the departed peer are not counted
        table.move_cursor(row=rows(app).index(A1), animate=False)
        await pilot.press("2", "enter")
        detail = detail_text(app)
        assert "Loss" in detail and "held-out" in detail and "17.0x now" in detail and "117.0x sync since" in detail

    run(body)


def test_the_screen_says_it_is_joining_before_the_first_record():
    async def body(app, pilot, clock):
        assert app.sub_title == "joining the swarm as an observer…"
        app.feed(StatusRecord(peer_id=A1, seq=1, time=T0, role="active"))
        await pilot.pause()
        assert app.sub_title.startswith("1 peer · ")

    run(body, until=T0 - 1)


def test_a_peers_words_are_shown_as_plain_text_never_as_markup():
    """An error or a leave reason is a peer's text: markup in it ("[/]" would crash the renderer, "[@click=…]"
    would run an action) is shown as it is."""
    async def body(app, pilot, clock):
        app.feed(StatusRecord(peer_id=A1, seq=10_000, time=END, role="active", error="[/] [@click=app.quit]x[/]"))
        app.feed(LeaveNotice(peer_id=A1, time=END + 1, reason="[bold]bye[/bold] [/]"))
        await pilot.press("3")
        await pilot.pause()
        events = app.query_one(EventsTable)
        texts = [str(events.get_row_at(i)[3]) for i in range(2)]
        assert texts == ["left: [bold]bye[/bold] [/]", "[/] [@click=app.quit]x[/]"], texts
        await pilot.press("2")
        table = app.query_one(PeerTable)
        table.move_cursor(row=rows(app).index(A1), animate=False)
        await pilot.press("enter")
        await pilot.pause()
        assert "[bold]bye[/bold] [/]" in detail_text(app)

    run(body)
