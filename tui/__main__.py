"""`python -m shoal.tui`: the dashboard process; verified records arrive on a pipe from `shoal dash`."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading


def main(argv: list[str] | None = None) -> int:
    from shoal.protocol.errors import ProtocolError
    from shoal.protocol.pipe import read_record
    from shoal.tui.app import DashApp
    from shoal.tui.model import ViewConfig

    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m shoal.tui",
                                description="The shoal dashboard's UI process (started by `shoal dash`).")
    p.add_argument("--records-fd", type=int, required=True, help="file descriptor to read records from")
    p.add_argument("--source", default="")
    p.add_argument("--run", default=None)
    p.add_argument("--stale-after", type=float, default=6.0)
    p.add_argument("--gone-after", type=float, default=15.0)
    args = p.parse_args(argv)
    try:
        config = ViewConfig(stale_after_s=args.stale_after, gone_after_s=args.gone_after, run_id=args.run)
    except ValueError as e:
        print(f"shoal dash: {e}", file=sys.stderr)
        return 2
    app = DashApp(config, source=args.source)

    def pump() -> None:
        with os.fdopen(args.records_fd, "rb", buffering=1 << 16) as f:
            while True:
                try:
                    item = read_record(f)
                except ProtocolError as e:
                    app.feed_threadsafe_problem(f"bad record from the observer: {e}")
                    return
                if item is None:
                    app.feed_threadsafe_problem("the observer stopped")
                    return
                app.feed_threadsafe(*item)

    threading.Thread(target=pump, name="shoal-dash-records", daemon=True).start()
    quit_on_signals(app)
    app.run()
    return 0


def quit_on_signals(app) -> None:
    """SIGTERM and SIGHUP (the dashboard's owner is gone, or the terminal closed) quit the app the way `q` does, so it
    leaves its full screen and restores the terminal instead of dying in it (which leaves a terminal needing
    `reset`). The signal handler runs on the app's own thread: the exit is asked for from another one."""
    def ask_exit() -> None:
        try:
            app.call_from_thread(app.exit)
        except RuntimeError:  # not running (yet, or any more)
            pass

    def on_signal(signum, frame) -> None:
        threading.Thread(target=ask_exit, daemon=True).start()

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_signal)


if __name__ == "__main__":
    sys.exit(main())
