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
import os
import sys
from pathlib import Path

from shoal.node.cli.logquota import Quota

FILE_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
BUFFERED_RECORDS = 2000  # kept until the log file is opened
TRACEBACK_HEAD = "Traceback (most recent call last)"
MAX_LOG_BYTES = 10 * 1000 * 1000  # a log file past this size is rotated: FILE -> FILE.1 -> … -> FILE.KEEP
KEEP_LOGS = 3  # rotated files kept beside the current one


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
    with a `lazy_path` the file is opened there at the first record (no file for a command that logs nothing).
    Rotated by size: past `max_bytes` the file becomes FILE.1 (FILE.1 becomes FILE.2, …, `keep` of them kept) and a
    new FILE starts, so a node that runs for months holds at most (keep + 1) x max_bytes of logs. Below -vv, records
    that repeat are kept to a quota (node/cli/logquota.py): the first few of a kind, then one an hour with a count."""

    def __init__(self, verbosity: int, *, max_bytes: int = MAX_LOG_BYTES, keep: int = KEEP_LOGS,
                 quota: Quota | None = None):
        super().__init__(logging.DEBUG)
        if max_bytes < 1 or keep < 1:
            raise ValueError("max_bytes and keep must be positive")
        self.verbosity = verbosity
        self.max_bytes, self.keep = max_bytes, keep
        self.quota = quota if quota is not None else Quota() if verbosity < 2 else None
        self.setFormatter(logging.Formatter(FILE_FORMAT))
        self.path: Path | None = None
        self.lazy_path: Path | None = None
        self._stream = None
        self._size = 0
        self._buffer: collections.deque[logging.LogRecord] = collections.deque(maxlen=BUFFERED_RECORDS)

    def filter(self, record: logging.LogRecord) -> bool:
        if self.verbosity >= 2:
            return True
        if record.levelno < (logging.INFO if ours(record) else logging.WARNING):
            return False
        return self.quota is None or self.quota.admit(record)

    def open(self, path: Path) -> None:
        path = Path(path).expanduser()
        path.parent.mkdir(parents=True, exist_ok=True)
        self.acquire()
        try:
            self._stream = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115 - closed in close()
            self._size = self._stream.tell()
            self.path = path
            while self._buffer:
                self._write(self._buffer.popleft())
        finally:
            self.release()

    def format(self, record: logging.LogRecord) -> str:
        """shoal's records in full (tracebacks included); a library's on one line below -vv: py-libp2p logs routine
        failures with multi-line dumps and tracebacks (a connection arriving while the host shuts down: a
        LifecycleError traceback, attached or written into the message), which say nothing a user acts on; -vv
        writes them whole."""
        if self.verbosity >= 2 or ours(record):
            return super().format(record)
        message = record.getMessage()
        cut = message.find(TRACEBACK_HEAD)  # one written into the message itself (py-libp2p's add_conn does)
        if cut >= 0:
            message = message[:cut].rstrip() + " [its traceback left out: -vv writes it]"
        text = " · ".join(line.strip() for line in message.splitlines() if line.strip())
        if record.exc_info and record.exc_info[1] is not None:
            exc = record.exc_info[1]
            text += f" [{type(exc).__name__}: {exc}]" if str(exc) else f" [{type(exc).__name__}]"
        return f"{self.formatter.formatTime(record)} {record.levelname} {record.name}: {text}"

    def _write(self, record: logging.LogRecord) -> None:
        line = self.format(record) + "\n"
        left_out = getattr(record, "shoal_left_out", 0)
        if left_out:
            line = line.replace("\n", f" [{left_out} more like this left out since the last one written]\n", 1)
        if self._size and self._size + len(line) > self.max_bytes:
            self._rotate()
        self._stream.write(line)
        self._size += len(line) if line.isascii() else len(line.encode("utf-8", "replace"))

    def _rotate(self) -> None:
        """FILE.(keep-1) -> FILE.keep, …, FILE -> FILE.1, then a new FILE (another process that appends to the same
        file, a second `shoal peers`, say, keeps writing to the renamed one until its next rotation)."""
        self._stream.close()
        path = self.path
        for i in range(self.keep - 1, 0, -1):
            older = path.with_name(f"{path.name}.{i}")
            if older.exists():
                os.replace(older, path.with_name(f"{path.name}.{i + 1}"))
        try:
            os.replace(path, path.with_name(f"{path.name}.1"))
        except FileNotFoundError:  # another process rotated it just now
            pass
        self._stream = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115 - closed in close()
        self._size = self._stream.tell()

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
            if self._stream is not None and self.quota is not None:
                for text in self.quota.summary():
                    self._write(logging.LogRecord("shoal.logs", logging.INFO, __file__, 0, text, None, None))
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
