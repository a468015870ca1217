"""The Overview pane: run, global step, loss plot, throughput, peer counts and live compression."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Horizontal
from textual.widgets import Static
from textual_plotext import PlotextPlot

from shoal.tui import fmt
from shoal.tui.model import LossPoint, Summary, short_id


def summary_table(s: Summary) -> Table:
    """The key/value block on the left of the Overview."""
    t = Table.grid(padding=(0, 1))
    t.add_column(style="bold cyan", no_wrap=True)
    t.add_column(no_wrap=True, overflow="ellipsis")
    run = s.run_id if s.run_id else "-"
    t.add_row("Run", Text(run[:24] + ("…" if len(run) > 24 else "")))
    t.add_row("Model", s.model or "-")
    t.add_row("Plan", s.plan or "-")
    t.add_row("Step", f"{s.global_step:,}")
    t.add_row("Loss", Text.assemble(fmt.loss(s.last_loss), ("  eval ", "dim"), fmt.loss(s.last_eval_loss)))
    t.add_row("Tokens/s", fmt.si(s.tokens_per_s))
    t.add_row(
        "Peers",
        Text.assemble((f"{s.active} active", "green"), " · ", (f"{s.backup} backup", "blue"), " · ", f"{s.idle} idle"),
    )
    t.add_row("", Text.assemble((f"{s.stale} stale", "yellow"), " · ", (f"{s.gone} gone", "red")))
    t.add_row("Broker", short_id(s.broker) if s.broker else Text("none", "yellow"))
    t.add_row("Wire", fmt.rate(s.wire_bytes_per_s))
    t.add_row("Uncompr.", fmt.rate(s.uncompressed_bytes_per_s))
    ratio = s.compression
    t.add_row("Ratio", "-" if ratio is None else f"{ratio:.1f}x")
    return t


class LossPlot(PlotextPlot):
    """Training loss and held-out loss against the global step."""

    DEFAULT_CSS = """
    LossPlot { height: 1fr; min-height: 8; }
    """

    def on_mount(self) -> None:
        self.plt.title("loss")
        self.plt.xlabel("step")

    def show(self, history: list[LossPoint]) -> None:
        plt = self.plt
        plt.clear_data()
        plt.title("loss")
        train = [(p.step, p.loss) for p in history if p.loss is not None]
        held = [(p.step, p.eval_loss) for p in history if p.eval_loss is not None]
        if train:
            plt.plot([x for x, _ in train], [y for _, y in train], label="train", marker="braille")
        if held:  # evaluations are sparse points in time: drawn as points, never joined into flat lines
            plt.scatter([x for x, _ in held], [y for _, y in held], label="eval", marker="dot", color="orange")
        self.refresh()


class OverviewPane(Horizontal):
    """Summary on the left, loss plot on the right; `show(summary, history)` pushes a new state down."""

    DEFAULT_CSS = """
    OverviewPane { height: 1fr; }
    OverviewPane #summary { width: 40; padding: 0 1; }
    """

    def compose(self) -> ComposeResult:
        yield Static(id="summary")
        yield LossPlot(id="loss-plot")

    def show(self, summary: Summary, history: list[LossPoint]) -> None:
        self.query_one("#summary", Static).update(summary_table(summary))
        self.query_one(LossPlot).show(history)
