"""The error that matters in a task tree: exception groups from trio nurseries unwrapped to one error.

A failure deep inside a node (the trainer's worker thread, the run's runtime, a stream handler) reaches the top
wrapped in one `ExceptionGroup` per nursery it crossed, often beside the cancellations it caused in its sibling
tasks. Whoever reports it (the command line's one line and exit status, the leave notice peers see) names the error
itself, never the group.
"""

from __future__ import annotations

from collections.abc import Callable

LEAVE_REASON_CHARS = 200  # a leave notice's reason field holds at most this much (protocol/records.py)


def leaves(exc: BaseException) -> list[BaseException]:
    """The exceptions inside (nested) exception groups, in order; `exc` itself when it is not a group."""
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for e in exc.exceptions for leaf in leaves(e)]
    return [exc]


def is_interruption(e: BaseException) -> bool:
    """A cancellation or an interrupt: what a failure (or Ctrl+C) does to the tasks beside it, not a cause."""
    cancelled = type(e).__name__ == "Cancelled" and type(e).__module__.startswith("trio")  # trio not imported
    return cancelled or isinstance(e, KeyboardInterrupt)


def cause(exc: BaseException, prefer: Callable[[BaseException], bool] | None = None) -> BaseException:
    """The error that matters in `exc`: the first leaf that `prefer` accepts, else the first that is not a
    cancellation or an interrupt, else the first interrupt, else `exc`'s first leaf (a cancellation)."""
    found = leaves(exc)
    real = [e for e in found if not is_interruption(e)]
    if prefer is not None:
        chosen = next((e for e in real if prefer(e)), None)
        if chosen is not None:
            return chosen
    interrupts = [e for e in found if isinstance(e, KeyboardInterrupt)]
    return (real or interrupts or found)[0]


def one_line(text: str) -> str:
    """`text` on one line, with nothing a terminal would act on (it may come from a peer)."""
    return " ".join("".join(c if c.isprintable() else " " for c in text).split())


def describe(exc: BaseException, limit: int = LEAVE_REASON_CHARS) -> str:
    """`Type: message` of the error that matters, on one line and at most `limit` characters; "interrupted" for
    a cancellation or an interrupt."""
    e = cause(exc)
    if is_interruption(e):
        return "interrupted"
    text = one_line(f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)
    return text if len(text) <= limit else text[: limit - 1] + "…"
