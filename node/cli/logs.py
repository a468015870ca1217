"""Where the `shoal` command's log records go: shoal's warnings to the terminal, everything to a log file.

Libraries' records (py-libp2p's gossip rate limits, kad protocol errors, `FIND_NODE key is not a valid PeerId`,
`Failed to read DHT message`) reach the terminal only with -v. py-libp2p resets its logger when it is imported
(no handlers, `propagate = False`), so its records end up in `logging.lastResort`, which prints bare messages to
stderr; shoal replaces that last resort with a handler that hands them to the root logger's handlers, so they are
routed like every other record, whenever libp2p is imported. Python warnings are logged too (`py.warnings`).
"""

from __future__ import annotations

import collections
import logging
import sys
from pathlib import Path

FILE_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
BUFFERED_RECORDS = 2000  # kept until the log file is opened


def ours(record: logging.LogRecord) -> bool:
    return record.name == "shoal" or record.name.startswith("shoal.")


class _Terminal(logging.Handler):
    """stderr (looked up at each record, so a redirected stderr is honoured): shoal's errors as 'error: …' lines
    (routine warnings, such as the broker's about peers leaving, are for the log file: what a node does is in its
    progress and status lines); with -v shoal's info and warnings and libraries' warnings, with -vv everything,
    with tracebacks."""

    def __init__(self, verbosity: int):
        super().__init__(logging.DEBUG)
        self.verbosity = verbosity
        self.full = logging.Formatter(FILE_FORMAT)

    def filter(self, record: logging.LogRecord) -> bool:
        if self.verbosity >= 2:
            return True
        if self.verbosity == 1:
            return record.levelno >= (logging.INFO if ours(record) else logging.WARNING)
        return ours(record) and record.levelno >= logging.ERROR

    def format(self, record: logging.LogRecord) -> str:
        if self.verbosity >= 1:
            return self.full.format(record)
        return f"{record.levelname.lower()}: {record.getMessage()}"  # no traceback: that is what -v is for

    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stderr.write(self.format(record) + "\n")
            sys.stderr.flush()
        except Exception:  # noqa: BLE001 - a closed terminal must not stop the program
            self.handleError(record)


class LogFile(logging.Handler):
    """The log file: shoal's records from INFO, libraries' from WARNING (everything with -vv), with tracebacks.
    Records are kept in memory until `open(path)` says where the file is (a node learns it after its identity), or
    with a `lazy_path` the file is opened there at the first record (no file for a command that logs nothing)."""

    def __init__(self, verbosity: int):
        super().__init__(logging.DEBUG)
        self.verbosity = verbosity
        self.setFormatter(logging.Formatter(FILE_FORMAT))
        self.path: Path | None = None
        self.lazy_path: Path | None = None
        self._stream = None
        self._buffer: collections.deque[logging.LogRecord] = collections.deque(maxlen=BUFFERED_RECORDS)

    def filter(self, record: logging.LogRecord) -> bool:
        if self.verbosity >= 2:
            return True
        return record.levelno >= (logging.INFO if ours(record) else logging.WARNING)

    def open(self, path: Path) -> None:
        path = Path(path).expanduser()
        path.parent.mkdir(parents=True, exist_ok=True)
        self.acquire()
        try:
            self._stream = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115 - closed in close()
            self.path = path
            while self._buffer:
                self._write(self._buffer.popleft())
        finally:
            self.release()

    def _write(self, record: logging.LogRecord) -> None:
        self._stream.write(self.format(record) + "\n")

    def emit(self, record: logging.LogRecord) -> None:
        try:
            if self._stream is None and self.lazy_path is not None:
                path, self.lazy_path = self.lazy_path, None
                try:
                    self.open(path)
                except OSError:  # no log file then (records stay in memory); the command goes on
                    pass
            if self._stream is None:
                self._buffer.append(record)
            else:
                self._write(record)
        except Exception:  # noqa: BLE001
            self.handleError(record)

    def close(self) -> None:
        self.acquire()
        try:
            if self._stream is not None:
                self._stream.close()
                self._stream = None
        finally:
            self.release()
        super().close()


class _ToRoot(logging.Handler):
    """The last resort for loggers without handlers that do not propagate (py-libp2p's): the root's handlers."""

    def __init__(self):
        super().__init__(logging.DEBUG)

    def emit(self, record: logging.LogRecord) -> None:
        for h in logging.getLogger().handlers:
            if record.levelno >= h.level:
                h.handle(record)


_installed: list[logging.Handler] = []


def setup_logging(verbosity: int) -> LogFile:
    """Route every record (see the module docstring). Returns the log file handler (open it once its path is known; records wait in memory until then)."""
    root = logging.getLogger()
    for h in _installed:
        root.removeHandler(h)
        h.close()
    _installed.clear()
    root.setLevel(logging.DEBUG if verbosity >= 2 else logging.INFO)
    log_file = LogFile(verbosity)
    for h in (_Terminal(verbosity), log_file):
        root.addHandler(h)
        _installed.append(h)
    logging.lastResort = _ToRoot()
    logging.captureWarnings(True)
    return log_file
