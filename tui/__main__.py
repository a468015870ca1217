"""`python -m shoal.tui`: the dashboard process; verified records arrive on a pipe from `shoal dash`."""

from __future__ import annotations

import argparse
import os
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
                    record = read_record(f)
                except ProtocolError as e:
                    app.feed_threadsafe_problem(f"bad record from the observer: {e}")
                    return
                if record is None:
                    app.feed_threadsafe_problem("the observer stopped")
                    return
                app.feed_threadsafe(record)

    threading.Thread(target=pump, name="shoal-dash-records", daemon=True).start()
    app.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
