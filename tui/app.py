"""`DashApp`: the Textual dashboard over a `SwarmView`; records come in through `feed`, time through `clock`."""

from __future__ import annotations

import queue
import time
from collections.abc import Callable
from typing import Any

from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.css.query import NoMatches
from textual.widgets import Footer, Header, TabbedContent, TabPane

from shoal.tui.events import EventsTable
from shoal.tui.model import SwarmView, ViewConfig
from shoal.tui.overview import OverviewPane
from shoal.tui.peers import PeersPane, PeerTable

INBOX_POLL_S = 0.1  # how often records queued by another thread are taken in


class _Problem:
    __slots__ = ("text",)

    def __init__(self, text: str):
        self.text = text


class DashApp(App):
    """The swarm dashboard. Feed it records with `feed(record)` on the app's own loop, or from any thread
    (before or while it runs) with `feed_threadsafe(record)`, which never blocks the caller.

    `clock` gives the local time (unix s) used for last-seen ages and stale/gone; tests pass a fixed one.
    A timer re-derives liveness every `refresh_s`, so silent peers turn stale, then gone, on their own.
    """

    TITLE = "shoal dash"
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (120, "-wide")]
    CSS = """
    TabbedContent { height: 1fr; }
    TabPane { padding: 0; }
    """
    BINDINGS = [
        Binding("1", "show_tab('overview')", "Overview"),
        Binding("2", "show_tab('peers')", "Peers"),
        Binding("3", "show_tab('events')", "Events"),
        Binding("q", "quit", "Quit"),
    ]

    def __init__(
        self,
        config: ViewConfig | None = None,
        *,
        clock: Callable[[], float] = time.time,
        refresh_s: float = 1.0,
        source: str = "",
    ) -> None:
        super().__init__()
        self.view = SwarmView(config)
        self.clock = clock
        self.refresh_s = refresh_s
        self.source = source
        self._refresh_pending = False
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.problem: str | None = None

    def compose(self) -> ComposeResult:
        yield Header()
        with TabbedContent(initial="overview"):
            with TabPane("Overview", id="overview"):
                yield OverviewPane()
            with TabPane("Peers", id="peers"):
                yield PeersPane()
            with TabPane("Events", id="events"):
                yield EventsTable(id="events-table")
        yield Footer()

    def on_mount(self) -> None:
        self.set_interval(self.refresh_s, self.refresh_view)
        self.set_interval(INBOX_POLL_S, self._drain_inbox)
        self._drain_inbox()
        self.refresh_view()

    # --- records in ----------------------------------------------------------------------------

    def feed(self, record: Any, age_s: float = 0.0) -> None:
        """Fold one protocol record (`age_s` old when the observer got it) into the view; the screen catches up on
        the next idle moment."""
        self.view.feed(record, self.clock(), age_s=age_s)
        if not self._refresh_pending:
            self._refresh_pending = True
            self.call_later(self.refresh_view)

    def feed_threadsafe(self, record: Any, age_s: float = 0.0) -> None:
        """Queue a record from another thread (the observer's); the app takes it within INBOX_POLL_S."""
        self._inbox.put((record, age_s))

    def feed_threadsafe_problem(self, text: str) -> None:
        """Queue a problem report from another thread; shown like `report_problem`."""
        self._inbox.put(_Problem(text))

    def _drain_inbox(self) -> None:
        for _ in range(10_000):  # bounded per poll, so a flood cannot freeze the screen
            try:
                record = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(record, _Problem):
                self.report_problem(record.text)
            else:
                self.feed(*record)

    def report_problem(self, text: str) -> None:
        """Shown in the header and as a notification (e.g. the observer lost the swarm)."""
        self.problem = text
        self.notify(text, severity="error", timeout=10)
        self.refresh_view()

    # --- state down ----------------------------------------------------------------------------

    def refresh_view(self) -> None:
        self._refresh_pending = False
        now = self.clock()
        view = self.view
        view.tick(now)
        summary = view.summary(now)
        peers = len(view.present_peers(now))
        where = f"{self.source} · " if self.source else ""
        if not view.records_seen and not self.problem:
            self.sub_title = f"{where}joining the swarm as an observer…"
        else:
            self.sub_title = self.problem or (f"{where}{peers} peer{'s' if peers != 1 else ''} · "
                                              f"{view.records_seen} records")
        try:
            overview, peers_pane, events = (self.query_one(OverviewPane), self.query_one(PeersPane),
                                            self.query_one(EventsTable))
        except NoMatches:  # a timer firing while the app shuts down
            return
        overview.show(summary, view.loss_history())
        peers_pane.show(view.peers, now)
        events.show(list(view.events))

    # --- navigation ----------------------------------------------------------------------------

    def action_show_tab(self, tab: str) -> None:
        self.query_one(TabbedContent).active = tab
        target = {"peers": PeerTable, "events": EventsTable}.get(tab)
        if target is not None:
            self.query_one(target).focus()

    def on_tabbed_content_tab_activated(self, event: TabbedContent.TabActivated) -> None:
        pane = event.pane.id
        if pane == "peers":
            self.query_one(PeerTable).focus()
        elif pane == "events":
            self.query_one(EventsTable).focus()
