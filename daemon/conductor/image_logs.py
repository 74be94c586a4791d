"""Image logs made off the conductor's thread.

A SETUP from the network asks for an image, and an image needs a log: a file of three terms
in the driver directory, allocated and mapped in place (up to 3 GiB, seconds of work for
large terms).  Made on the conductor's thread, a flood of SETUPs held it for as long as the
files took, and its clients saw no heartbeat and deemed the driver dead.  So the conductor
hands each log to :class:`ImageLogMaker`, whose one worker thread makes the files in turn
(``ftruncate``, ``posix_fallocate`` and the populating map release the GIL), and takes the
finished ones back in a later duty cycle (:meth:`ImageLogMaker.take_done`), where it attaches
the image, or frees a log nobody wants any more.  Unmapping and deleting a log costs as much
(about 0.1 s for 3 x 128 MiB): the worker does that too (:meth:`ImageLogMaker.discard`), and
hands back the caller's ``gone`` callback to run on its thread once the file is deleted (so
that memory counts as used for as long as its file exists).

The conductor reserves a log's memory in its budget before it submits it and gives it back
for every log that fails or is still queued at :meth:`ImageLogMaker.close`, and for every
log discarded once it is gone; the maker never touches the budget.  The simulator's drivers
make their logs inline (``threaded=False``): the same calls, done at submit, so a run stays
deterministic.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

from slipstream.client.logbuffer import LogBuffer
from slipstream.daemon.conductor.resources import discard_file, make_log_file

log = logging.getLogger("slipstream.driver")


@attrs.define(eq=False)
class LogJob:
    """One log to make: its file, its length in bytes (reserved in the budget) and the
    keyword arguments of LogBuffer.create; ``request`` is the caller's (what the log is
    for).  The maker fills ``result``: the log, or the exception that stopped it."""

    path: Path
    length: int
    kwargs: dict[str, Any]
    request: Any
    result: LogBuffer | BaseException | None = None


class ImageLogMaker:
    """Makes :class:`LogJob` logs on one worker thread (``threaded``) or at once; see the
    module docstring.  ``wake`` is called (from the worker) when a log is done."""

    def __init__(self, *, threaded: bool, wake: Callable[[], None] = lambda: None) -> None:
        self.threaded = threaded
        self._wake = wake
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._queued: deque[LogJob] = deque()
        self._discards: deque[tuple[LogBuffer, Callable[[], None]]] = deque()
        self._gone: list[Callable[[], None]] = []
        self._done: list[LogJob] = []
        self._closing = False
        self._thread: threading.Thread | None = None

    @property
    def has_done(self) -> bool:
        """Whether a log is done (made or failed, or discarded) and not taken yet."""
        return bool(self._done or self._gone)

    def submit(self, job: LogJob) -> None:
        """Make ``job``'s log: now (inline), else queued for the worker."""
        if not self.threaded:
            _make(job)
            self._done.append(job)
            return
        with self._lock:
            if self._closing:
                raise RuntimeError("the image log maker is closed")
            self._queued.append(job)
            self._start()
            self._work.notify()

    def discard(self, log_buffer: LogBuffer, gone: Callable[[], None]) -> None:
        """Unmap ``log_buffer`` and delete its file, then ``gone`` (on the caller's thread:
        at once inline or after a close, else from :meth:`take_gone`); on the worker before
        the logs queued."""
        if not self.threaded:
            _discard(log_buffer)
            gone()
            return
        with self._lock:
            closing = self._closing
            if not closing:
                self._discards.append((log_buffer, gone))
                self._start()
                self._work.notify()
        if closing:
            _discard(log_buffer)
            gone()

    def take_gone(self) -> list[Callable[[], None]]:
        """The ``gone`` callbacks of the logs the worker deleted since the last call."""
        with self._lock:
            gone, self._gone = self._gone, []
        return gone

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="ss-image-logs",
                                            daemon=True)
            self._thread.start()

    def take_done(self) -> list[LogJob]:
        """The jobs done since the last call, in the order they finished."""
        with self._lock:
            done, self._done = self._done, []
        return done

    def close(self) -> list[LogJob]:
        """Stop: the queued jobs are not made (their ``result`` stays None), the one being
        made is waited for, and every log to discard is discarded (their ``gone`` callbacks
        wait in :meth:`take_gone`).  Returns every job not taken: done ones (their logs to
        free) and the unmade ones (their budget to give back)."""
        with self._lock:
            self._closing = True
            unmade = list(self._queued)
            self._queued.clear()
            self._work.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join()
        while self._discards:
            log_buffer, gone = self._discards.popleft()
            _discard(log_buffer)
            self._gone.append(gone)
        return self.take_done() + unmade

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._queued and not self._discards and not self._closing:
                    self._work.wait()
                if self._discards:
                    discarded: tuple[LogBuffer, Callable[[], None]] | None = (
                        self._discards.popleft())
                elif self._queued:
                    discarded, job = None, self._queued.popleft()
                else:
                    return  # closing: close() discards what is left
            if discarded is not None:
                _discard(discarded[0])
                with self._lock:
                    self._gone.append(discarded[1])
                self._wake_conductor()
                continue
            _make(job)
            with self._lock:
                self._done.append(job)
            self._wake_conductor()

    def _wake_conductor(self) -> None:
        try:
            self._wake()
        except Exception:  # the conductor still finds it at its next cycle
            log.exception("waking the conductor for an image log failed")


def _discard(log_buffer: LogBuffer) -> None:
    try:
        discard_file(log_buffer)
    except Exception:  # a log left behind is found by the directory's next owner
        log.exception("deleting the image log %s failed", log_buffer.path)


def _make(job: LogJob) -> None:
    try:
        job.result = make_log_file(job.path, job.length, **job.kwargs)
    except Exception as e:  # handed to the conductor, which says what failed
        job.result = e
