"""The Peers pane: a sortable, filterable table of peers and a detail panel for the selected one."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Container, Vertical
from textual.message import Message
from textual.widgets import DataTable, Input, Static

from shoal.tui import fmt
from shoal.tui.model import Liveness, PeerView, links_mark, short_id

ROLE_ORDER = {"broker": 0, "active": 1, "backup": 2, "idle": 3, "observer": 4}
LIVENESS_STYLE = {Liveness.LIVE: "", Liveness.STALE: "yellow", Liveness.GONE: "dim red", Liveness.LEFT: "dim"}


@dataclass(frozen=True, slots=True)
class Column:
    key: str
    label: str
    cell: Callable[[PeerView, float], str]  # (peer, now) -> text
    sort: Callable[[PeerView, float], Any]  # (peer, now) -> sort key
    numeric: bool = False


def _status(p: PeerView, name: str, default: Any = None) -> Any:
    return getattr(p.status, name) if p.status is not None else default


def _device(p: PeerView) -> str:
    """The device's name (its kind when unnamed); the full profile is in the detail panel."""
    if p.announcement is None:
        return "?"
    hw = p.announcement.hardware
    return hw.device_name or hw.device_kind


def _device_kind(p: PeerView) -> str:
    return p.announcement.hardware.device_kind if p.announcement else ""


def _state(p: PeerView) -> str:
    if p.liveness is not Liveness.LIVE:
        return p.liveness.value
    return _status(p, "state", "?")


def _present(p: PeerView) -> bool:
    """Still there (live or stale): a gone or departed peer's rates are no longer true, so they are not shown."""
    return p.liveness not in (Liveness.GONE, Liveness.LEFT)


def _live_figure(p: PeerView, name: str) -> float:
    return _status(p, name, 0.0) if _present(p) else 0.0


def _rate_cell(p: PeerView, name: str) -> str:
    return fmt.si(_status(p, name, 0.0), digits=2) if _present(p) else "-"


def _slot(p: PeerView) -> str:
    """The slot it holds; a backup, the stage it keeps warm ("warm s1")."""
    slot = _status(p, "slot")
    if slot:
        return slot
    stage = _status(p, "warm_stage")
    return f"warm s{stage}" if p.role == "backup" and stage is not None else "-"


def _loss(p: PeerView) -> float | None:
    """Its training loss (a pipeline's last stage; None at the others)."""
    return _status(p, "loss")


COLUMNS: tuple[Column, ...] = (
    Column("peer", "peer", lambda p, now: short_id(p.peer_id), lambda p, now: p.peer_id),
    Column("role", "role", lambda p, now: p.role, lambda p, now: (ROLE_ORDER.get(p.role, 9), _status(p, "slot") or "")),
    Column("slot", "slot", lambda p, now: " ".join(x for x in (_slot(p), links_mark(p)) if x),
           lambda p, now: _status(p, "slot") or _slot(p).replace("warm ", "~") or "~"),
    Column("device", "device", lambda p, now: _device(p)[:8], lambda p, now: _device(p)),
    Column("step", "step", lambda p, now: str(_status(p, "step", 0)), lambda p, now: _status(p, "step", 0), True),
    Column("loss", "loss", lambda p, now: "-" if _loss(p) is None else f"{_loss(p):.3f}",
           lambda p, now: (_loss(p) is None, _loss(p) or 0.0), True),
    Column("tps", "tok/s", lambda p, now: _rate_cell(p, "tokens_per_s"),
           lambda p, now: _live_figure(p, "tokens_per_s"), True),
    Column("up", "up/s", lambda p, now: _rate_cell(p, "up_bytes_per_s"),
           lambda p, now: _live_figure(p, "up_bytes_per_s"), True),
    Column("seen", "seen", lambda p, now: fmt.ago(now - p.last_seen), lambda p, now: now - p.last_seen, True),
    Column("state", "state", lambda p, now: _state(p), lambda p, now: _state(p)),
)
COLUMN_KEYS = tuple(c.key for c in COLUMNS)


def peer_matches(p: PeerView, needle: str) -> bool:
    """Case-insensitive substring match over the peer id, role, slot, state and device."""
    if not needle:
        return True
    hay = " ".join((p.peer_id, p.role, _status(p, "slot") or "", _state(p), _device_kind(p), _device(p))).lower()
    return all(word in hay for word in needle.lower().split())


def peer_detail(p: PeerView, now: float) -> Table:
    """Hardware profile, addresses, recent errors and state hash of one peer."""
    t = Table.grid(padding=(0, 1))
    t.add_column(style="bold cyan", no_wrap=True)
    t.add_column(overflow="fold")
    t.add_row("Peer", p.peer_id)
    t.add_row("Status", Text(f"{p.role} · {_state(p)} · seen {fmt.ago(now - p.last_seen)} ago", LIVENESS_STYLE[p.liveness]))
    if p.errors:
        t.add_row("Errors", Text("\n".join(f"{fmt.clock(at)} {text}" for at, text in reversed(p.errors)), "red"))
    if p.left is not None:
        t.add_row("Left", Text(f"{fmt.clock(p.left.time)} {p.left.reason}"))
    s = p.status
    if s is not None:
        t.add_row("Run", Text(f"{s.run_id or '-'}  slot {_slot(p)}  step {s.step}"))
        losses = [f"loss {s.loss:.4f}" if s.loss is not None else "",
                  f"held-out {s.eval_loss:.4f}" if s.eval_loss is not None else ""]
        if any(losses):
            t.add_row("Loss", " · ".join(x for x in losses if x))
        if s.samples_done or s.samples_per_s:
            t.add_row("Contributed", f"{fmt.si(s.samples_done, digits=3)} sequences · "
                      f"{fmt.si(s.tokens_done, digits=3)} tokens into applied steps · computes "
                      f"{s.samples_per_s:.3g} seq/s")
        links = f" (links {fmt.nbytes(s.link_bytes_sent)})" if s.link_bytes_sent else ""
        rates = (f"up {fmt.rate(s.up_bytes_per_s)} · down {fmt.rate(s.down_bytes_per_s)} · " if _present(p)
                 else "")
        t.add_row("Traffic", f"{rates}sent {fmt.nbytes(s.bytes_sent)}{links} · recv {fmt.nbytes(s.bytes_recv)}")
        now_ratio = f"{s.ratio_now:.1f}x now" if s.ratio_now is not None and _present(p) else ""
        since = f"{s.compression_ratio:.1f}x sync since start" if s.compression_ratio is not None else ""
        t.add_row("Compress.", " · ".join(x for x in (now_ratio, since) if x) or "-")
        t.add_row("State hash", Text(s.state_hash or "-"))
        if s.lane_links:
            t.add_row("Links", Text("\n".join(_link_line(p, x) for x in s.lane_links)))
    a = p.announcement
    if a is not None:
        hw = a.hardware
        t.add_row("Device", Text(f"{hw.device_kind} {hw.device_name}".strip()))
        t.add_row("Hardware", f"{fmt.nbytes(hw.memory_bytes)} mem · {hw.matmul_tflops:.1f} TFLOP/s · "
                  f"{hw.cpu_count} cpus · {fmt.nbytes(hw.free_disk_bytes)} free disk")
        t.add_row("Software", Text(f"shoal {a.software_version} (protocol {a.protocol_version})"))
        t.add_row("Addresses", Text("\n".join(a.addrs) if a.addrs else "-"))
    else:
        t.add_row("Hardware", Text("no announcement seen yet", "dim"))
    return t


def _link_line(p: PeerView, x) -> str:
    """One lane link end: its compression and, with AQ-SGD, its store and whether the other end agrees."""
    arrow = "→" if x.side == "sender" else "←"
    line = f"{x.link} {arrow} {short_id(x.peer)} {x.compression}"
    if x.compression == "aqsgd" and x.step is not None:
        verdict = p.link_verdicts.get((x.link, x.side), "pending")
        line += f" · {x.rows} rows · digest {x.digest[:8]} @{x.step} · {verdict}"
        if x.nacks:
            line += f" · {x.nacks} NACKs"
    return line


class PeerTable(DataTable):
    """The peers, one row each, keyed by peer id; rows are updated in place while their order holds."""

    BINDINGS = [
        Binding("s", "cycle_sort", "Sort"),
        Binding("r", "reverse_sort", "Reverse"),
    ]

    class SortChanged(Message):
        def __init__(self, column: str, reverse: bool) -> None:
            super().__init__()
            self.column = column
            self.reverse = reverse

    def __init__(self, **kw) -> None:
        super().__init__(cursor_type="row", zebra_stripes=True, **kw)
        self.sort_column = "role"
        self.sort_reverse = False
        self._order: list[str] = []

    def on_mount(self) -> None:
        self._add_columns()

    def _add_columns(self) -> None:
        for c in COLUMNS:
            mark = ("▼" if self.sort_reverse else "▲") if c.key == self.sort_column else ""
            self.add_column(Text(c.label + mark, justify="right" if c.numeric else "left"), key=c.key)

    def set_sort(self, column: str, reverse: bool) -> None:
        if column not in COLUMN_KEYS:
            raise ValueError(f"no column {column!r}")
        self.sort_column, self.sort_reverse = column, reverse
        self.clear(columns=True)
        self._order = []
        self._add_columns()
        self.post_message(self.SortChanged(column, reverse))

    def action_cycle_sort(self) -> None:
        i = COLUMN_KEYS.index(self.sort_column)
        self.set_sort(COLUMN_KEYS[(i + 1) % len(COLUMN_KEYS)], False)

    def action_reverse_sort(self) -> None:
        self.set_sort(self.sort_column, not self.sort_reverse)

    def on_data_table_header_selected(self, event: DataTable.HeaderSelected) -> None:
        key = event.column_key.value
        self.set_sort(key, not self.sort_reverse if key == self.sort_column else False)

    @property
    def highlighted_peer(self) -> str | None:
        if not self._order or not 0 <= self.cursor_row < len(self._order):
            return None
        return self._order[self.cursor_row]

    def show(self, peers: list[PeerView], now: float) -> None:
        col = next(c for c in COLUMNS if c.key == self.sort_column)
        peers = sorted(peers, key=lambda p: p.peer_id)
        peers.sort(key=lambda p: col.sort(p, now), reverse=self.sort_reverse)
        order = [p.peer_id for p in peers]
        rows = {p.peer_id: self._cells(p, now) for p in peers}
        if order == self._order:
            for pid, cells in rows.items():
                for c, value in zip(COLUMNS, cells):
                    self.update_cell(pid, c.key, value)
            return
        keep = self.highlighted_peer
        self.clear()
        for pid in order:
            self.add_row(*rows[pid], key=pid)
        self._order = order
        if keep in order:
            self.move_cursor(row=order.index(keep), animate=False)

    @staticmethod
    def _cells(p: PeerView, now: float) -> list[Text]:
        style = LIVENESS_STYLE[p.liveness]
        return [Text(c.cell(p, now), style, justify="right" if c.numeric else "left") for c in COLUMNS]


class PeersPane(Vertical):
    """Filter input, peers table and (once a row is selected) the detail panel: below the table on a
    narrow terminal, beside it on a wide one (the app's `-wide` breakpoint class on the screen)."""

    SCOPED_CSS = False  # the layout rules look at the screen's breakpoint class
    DEFAULT_CSS = """
    PeersPane { height: 1fr; }
    PeersPane #peer-filter { height: 1; margin: 0 1; }
    PeersPane #peer-body { height: 1fr; }
    PeersPane PeerTable { height: 1fr; }
    PeersPane #peer-detail { display: none; border-top: solid $primary; height: 11; padding: 0 1;
                             overflow-y: auto; }
    PeersPane.-detail #peer-detail { display: block; }
    .-wide PeersPane #peer-body { layout: horizontal; }
    .-wide PeersPane #peer-detail { border-top: none; border-left: solid $primary; height: 1fr; width: 64; }
    """

    BINDINGS = [
        Binding("slash", "focus_filter", "Filter"),
        Binding("escape", "close", "Close", show=False),
    ]

    class PeerSelected(Message):
        def __init__(self, peer_id: str | None) -> None:
            super().__init__()
            self.peer_id = peer_id

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.selected: str | None = None
        self.filter_text = ""
        self._peers: dict[str, PeerView] = {}
        self._now = 0.0

    def compose(self) -> ComposeResult:
        yield Input(placeholder="/ filter: id, role, slot, state, device", id="peer-filter", compact=True)
        with Container(id="peer-body"):
            yield PeerTable(id="peer-table")
            yield Static(id="peer-detail")

    @property
    def table(self) -> PeerTable:
        return self.query_one(PeerTable)

    def show(self, peers: dict[str, PeerView], now: float) -> None:
        self._peers, self._now = peers, now
        self.table.show([p for p in peers.values() if peer_matches(p, self.filter_text)], now)
        self._show_detail()

    def _show_detail(self) -> None:
        p = self._peers.get(self.selected) if self.selected else None
        self.set_class(p is not None, "-detail")
        if p is not None:
            self.query_one("#peer-detail", Static).update(peer_detail(p, self._now))

    def select(self, peer_id: str | None) -> None:
        self.selected = peer_id
        self._show_detail()
        self.post_message(self.PeerSelected(peer_id))

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        event.stop()
        self.select(event.row_key.value)

    def on_input_changed(self, event: Input.Changed) -> None:
        self.filter_text = event.value.strip()
        self.table.show([p for p in self._peers.values() if peer_matches(p, self.filter_text)], self._now)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self.table.focus()

    def action_focus_filter(self) -> None:
        self.query_one("#peer-filter", Input).focus()

    def action_close(self) -> None:
        flt = self.query_one("#peer-filter", Input)
        if flt.has_focus:
            self.table.focus()
        elif self.selected is not None:
            self.select(None)
        elif self.filter_text:
            flt.value = ""
