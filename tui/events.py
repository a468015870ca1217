"""The Events pane: joins, leaves, stale/gone peers, promotions, broker changes, recoveries of lost stages and
errors, newest first."""

from __future__ import annotations

from collections.abc import Sequence

from rich.text import Text
from textual.widgets import DataTable

from shoal.tui import fmt
from shoal.tui.model import Event, EventKind, short_id

KIND_STYLE = {
    EventKind.JOIN: "green",
    EventKind.BACK: "green",
    EventKind.LEAVE: "magenta",
    EventKind.STALE: "yellow",
    EventKind.GONE: "red",
    EventKind.PROMOTION: "bold blue",
    EventKind.BROKER: "bold cyan",
    EventKind.ERROR: "bold red",
    EventKind.RECOVERY: "bold yellow",
    EventKind.BAN: "bold red",
}


class EventsTable(DataTable):
    """A read-only log table; `show(events)` redraws it when the events changed."""

    DEFAULT_CSS = """
    EventsTable { height: 1fr; }
    """

    def __init__(self, **kw) -> None:
        super().__init__(cursor_type="row", zebra_stripes=True, **kw)
        self._shown: tuple[int, Event | None] = (0, None)

    def on_mount(self) -> None:
        self.add_column("time", key="time")
        self.add_column("event", key="kind")
        self.add_column("peer", key="peer")
        self.add_column("what", key="text")

    def show(self, events: Sequence[Event]) -> None:
        mark = (len(events), events[-1] if events else None)
        if mark == self._shown:
            return
        self._shown = mark
        self.clear()
        for ev in reversed(events):
            self.add_row(
                fmt.clock(ev.time),
                Text(ev.kind.value, KIND_STYLE.get(ev.kind, "")),
                short_id(ev.peer_id) if ev.peer_id else "",
                Text(ev.text),  # a peer's words (an error, a leave reason): plain text, never markup
            )
