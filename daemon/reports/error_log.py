"""The error log: the distinct errors a driver met, each with a count and its first and last
time (Aeron's distinct error log, read by ErrorStat).

A logging handler on the driver's logger keeps one entry per distinct error: its message with
every number taken out (so one refusal for stream 10 and for stream 11 is one error, seen
twice) plus, for an exception, its type.  The entries live in ``errors.json`` in the driver
directory, written atomically (a temporary file, then a rename) when a new distinct error
appears, and otherwise within a second of a change (a burst of one error is one write).  The
file survives the driver: after a crash ``slipstream stat`` still reads it, until the next
driver in that directory cleans up.  Warnings are not errors: they are not kept.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from pathlib import Path
from typing import Any

import attrs

from slipstream.client import control

FILE = "errors.json"
#: A dead driver's error log, kept by the next driver in the directory (systemd restarts a
#: crashed driver within a second: without it, the evidence would go with the restart).
PREVIOUS_FILE = "errors.previous.json"
#: Where the log is written before it replaces ``FILE`` (a reader never sees half of it).
TEMPORARY_FILE = "errors.json.tmp"
#: Distinct errors kept, the last of them "other errors", which counts the ones past the rest.
MAX_ENTRIES = 256
_WRITE_INTERVAL_NS = 1_000_000_000
_NUMBER = re.compile(r"\d+")
_ADDRESS = re.compile(r"0x[0-9a-fA-F]+")  # reprs of objects: one error, wherever they live


#: Text a remote host chose (an ERR frame's message) goes to the log at most this long, in
#: characters, escaped (:func:`escape_remote_text`).
REMOTE_TEXT_MAX = 200
#: Lines of such text per source host per interval (:class:`RemoteTextLimiter`).
REMOTE_LINES_PER_INTERVAL = 5
REMOTE_INTERVAL_NS = 10_000_000_000
#: Source hosts the limiter remembers at once: past it, those of past intervals go first.
REMOTE_SOURCES_MAX = 1024


def escape_remote_text(text: str, limit: int = REMOTE_TEXT_MAX) -> str:
    """``text`` as a log line may hold text another host chose: printable ASCII as it is
    (a backslash doubled), everything else escaped (``\\n``, ``\\xNN``, ``\\uNNNN``), cut
    to ``limit`` characters with ``...`` when longer.  No line break, terminal escape or
    look-alike character reaches the log."""
    out: list[str] = []
    length = 0
    for character in text:
        if character == "\\":
            piece = "\\\\"
        elif " " <= character <= "~":
            piece = character
        else:
            piece = character.encode("unicode_escape").decode("ascii")
        if length + len(piece) > limit:
            out.append("...")
            break
        out.append(piece)
        length += len(piece)
    return "".join(out)


class RemoteTextLimiter:
    """At most ``lines`` log lines of remote text per source host per ``interval_ns``
    (sans-I/O: the caller passes the time)."""

    def __init__(self, lines: int = REMOTE_LINES_PER_INTERVAL,
                 interval_ns: int = REMOTE_INTERVAL_NS,
                 sources_max: int = REMOTE_SOURCES_MAX) -> None:
        self.lines = lines
        self.interval_ns = interval_ns
        self.sources_max = sources_max
        self._windows: dict[str, tuple[int, int]] = {}  # host -> (interval start, lines)

    def allow(self, host: str, now_ns: int) -> bool:
        """Whether a line from ``host`` may go to the log at ``now_ns`` (counts it if so)."""
        start, lines = self._windows.get(host, (now_ns, 0))
        if now_ns - start >= self.interval_ns:
            start, lines = now_ns, 0
        if lines >= self.lines:
            return False
        if host not in self._windows and len(self._windows) >= self.sources_max:
            self._windows = {h: w for h, w in self._windows.items()
                             if now_ns - w[0] < self.interval_ns}
            if len(self._windows) >= self.sources_max:
                return False  # that many hosts at once: the rest wait for the interval
        self._windows[host] = (start, lines + 1)
        return True


@attrs.define
class ErrorEntry:
    """One distinct error: how often, first and last time (epoch ns), the last message."""

    key: str
    count: int
    first_ns: int
    last_ns: int
    message: str


class ErrorLogHandler(logging.Handler):
    """Keeps the distinct errors of the records it sees in ``directory/errors.json``."""

    def __init__(self, directory: str | os.PathLike[str], mode: int = 0o600) -> None:
        """``mode``: the file's (:func:`control.file_mode`)."""
        super().__init__(level=logging.ERROR)
        self.path = Path(directory) / FILE
        self.mode = mode
        self.entries: dict[str, ErrorEntry] = {}
        self._written_ns = 0
        self._dirty = False
        self._write_lock = threading.Lock()
        self._pending: threading.Timer | None = None

    def emit(self, record: logging.LogRecord) -> None:
        try:
            now = time.time_ns()
            message = record.getMessage()
            key = _NUMBER.sub("#", _ADDRESS.sub("0x#", message))[:500]
            if record.exc_info and record.exc_info[0] is not None:
                key += f" [{record.exc_info[0].__name__}]"
            if record.exc_info and record.exc_info[1] is not None:
                message += f": {record.exc_info[1]!r}"
            message = message[:1000]
            with self._write_lock:
                entry = self.entries.get(key)
                new = entry is None
                if entry is None:
                    if len(self.entries) >= MAX_ENTRIES - 1:
                        key = "other errors"
                        entry = self.entries.get(key)
                        new = entry is None  # else a repeat: written within the second
                    if entry is None:
                        entry = self.entries[key] = ErrorEntry(key, 0, now, now, message)
                entry.count += 1
                entry.last_ns = now
                entry.message = message
                self._dirty = True
                if new or now - self._written_ns >= _WRITE_INTERVAL_NS:
                    self._write(now)
                elif self._pending is None:
                    delay = (self._written_ns + _WRITE_INTERVAL_NS - now) / 1e9
                    self._pending = threading.Timer(delay, self.flush)
                    self._pending.daemon = True
                    self._pending.start()
        except Exception:  # a logging handler never raises into the code that logs
            self.handleError(record)

    def flush(self) -> None:
        with self._write_lock:
            self._pending = None
            if self._dirty:
                self._write(time.time_ns())

    def close(self) -> None:
        with self._write_lock:
            if self._pending is not None:
                self._pending.cancel()
        self.flush()
        super().close()

    def _write(self, now_ns: int) -> None:
        """Under the lock: replace the file with the entries."""
        temporary = self.path.with_name(TEMPORARY_FILE)
        data = json.dumps([attrs.asdict(e) for e in self.entries.values()], indent=1)
        fd = control.create_file(temporary, os.O_WRONLY | os.O_TRUNC, self.mode)
        with os.fdopen(fd, "w") as f:
            f.write(data)
        os.replace(temporary, self.path)
        self._written_ns = now_ns
        self._dirty = False


def read_error_log(directory: str | os.PathLike[str], file: str = FILE) -> list[ErrorEntry]:
    """The entries of the error log in a driver directory (``PREVIOUS_FILE``: the dead
    driver's before this one), most recent first (empty when there is none or it cannot be
    read)."""
    try:
        raw: Any = json.loads((Path(directory) / file).read_text())
        entries = [ErrorEntry(**item) for item in raw]
    except (OSError, ValueError, TypeError):
        return []
    return sorted(entries, key=lambda e: e.last_ns, reverse=True)
