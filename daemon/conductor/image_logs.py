"""Image logs made off the conductor's thread.

A SETUP from the network asks for an image, and an image needs a log: a file of three terms
in the driver directory, allocated and mapped in place (up to 3 GiB, seconds of work for
large terms).  Made on the conductor's thread, a flood of SETUPs held it for as long as the
files took, and its clients saw no heartbeat and deemed the driver dead.  So the conductor
hands each log to :class:`ImageLogMaker`, whose one worker thread makes the files in turn
(``ftruncate``, ``posix_fallocate`` and the populating map release the GIL), the sources'
in rotation (a host with many logs queued delays another's by the log being made and one
more at most, not by all of them: a flood of SETUPs for large terms does not hold a
legitimate stream back), and takes the
finished ones back in a later duty cycle (:meth:`ImageLogMaker.take_done`), where it attaches
the image, or frees a log nobody wants any more.  An embedded driver, which has no thread of
its own, makes them on its conductor's thread one per cycle instead (:class:`LogMaking`), so
that each of its application's calls makes at most one.  Unmapping and deleting a log costs
as much (about 0.1 s for 3 x 128 MiB): the worker does that too (:meth:`ImageLogMaker.discard`), and
hands back the caller's ``gone`` callback to run on its thread once the file is deleted (so
that memory counts as used for as long as its file exists).  With a :class:`LogPool`, a
discarded log's file is kept for a later log of the same length instead of deleted (zeroed
there, on the worker, in pieces of :attr:`LogPool.ZERO_STEP` between which the worker
makes the logs queued), a new log takes one kept, and the worker deletes those kept too long;
the network publications' logs are discarded here too, so that no log is zeroed or deleted
on the conductor's thread.  The worker also maps a log's pages in place after the log is
handed out (:meth:`ImageLogMaker.populate_behind`: an image's, and a network publication's
that the conductor made), a step of :data:`~slipstream.client.logbuffer.POPULATE_STEP` at a
time when no log waits to be made or deleted, so that an image is attached, and its first
status message sent, without waiting for that.

The conductor reserves a log's memory in its budget before it submits it and gives it back
for every log that fails or is still queued at :meth:`ImageLogMaker.close`, and for every
log discarded once it is gone; the maker never touches the budget.  The simulator's drivers
make their logs inline (:attr:`LogMaking.INLINE`): the same calls, done at submit, so a run
stays deterministic.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any

import attrs

from slipstream.client._native import lib as native
from slipstream.client.logbuffer import LogBuffer
from slipstream.daemon.conductor.log_pool import LogPool
from slipstream.daemon.conductor.resources import discard_file, make_log_file

log = logging.getLogger("slipstream.driver")


@attrs.define(eq=False)
class LogJob:
    """One log to make: its file, its length in bytes (reserved in the budget) and the
    keyword arguments of LogBuffer.create; ``request`` is the caller's (what the log is
    for); ``logs_length``, the driver's other logs' length as its budget counted them when
    the job was made (:func:`make_log_file`'s); ``source``, whose log it is (the sender's
    host): the maker takes the sources' jobs in turn.  The maker fills ``result``: the log,
    or the exception that stopped it."""

    path: Path
    length: int
    kwargs: dict[str, Any]
    request: Any
    logs_length: int | None = None
    source: Hashable = None
    result: LogBuffer | BaseException | None = None


class LogMaking(enum.Enum):
    """Where an :class:`ImageLogMaker` makes and deletes logs."""

    #: On the caller's thread, at once: the simulator's (a run stays deterministic).
    INLINE = "inline"
    #: On the caller's thread, one log (made or deleted) per :meth:`ImageLogMaker.step`, a
    #: call per conductor cycle: an embedded driver's, which has no thread of its own, so
    #: that its application's each call to do_work() makes at most one.
    DEFERRED = "deferred"
    #: On one worker thread: a driver process's.
    THREADED = "threaded"


class ImageLogMaker:
    """Makes :class:`LogJob` logs and deletes discarded ones, as ``making`` says; see the
    module docstring.  ``wake`` is called (from the worker) when a log is done or gone;
    ``pool`` keeps discarded logs' files for new logs (None: every one is deleted)."""

    def __init__(self, *, making: LogMaking, wake: Callable[[], None] = lambda: None,
                 pool: LogPool | None = None) -> None:
        self.making = making
        self.pool = pool
        if pool is not None:
            pool.wake = self._wake_for_pool
            if making is LogMaking.INLINE:
                pool.zero_step = None  # nothing settles between calls: whole files at once
        self._wake = wake
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        #: The jobs to make, by source, the source whose turn is next first.
        self._queued: dict[Hashable, deque[LogJob]] = {}
        self._discards: deque[tuple[LogBuffer, Callable[[], None]]] = deque()
        self._done: list[LogJob] = []
        self._gone: list[Callable[[], None]] = []
        #: Logs handed out before their pages were mapped in place, the first being mapped.
        self._populating: deque[LogBuffer] = deque()
        self._closing = False
        self._thread: threading.Thread | None = None

    @property
    def has_done(self) -> bool:
        """Whether a log is done (made or failed, or deleted) and not taken yet, or, when
        deferred, one waits for a :meth:`step`."""
        return bool(self._done or self._gone or (
            self.making is LogMaking.DEFERRED and (
                self._queued or self._discards
                or (self.pool is not None and self.pool.is_due()))))

    def submit(self, job: LogJob) -> None:
        """Make ``job``'s log: now (inline), else queued for the worker or the next steps."""
        if self.making is LogMaking.INLINE:
            _make(job, self.pool)
            self._done.append(job)
            return
        with self._lock:
            if self._closing:
                raise RuntimeError("the image log maker is closed")
            self._queued.setdefault(job.source, deque()).append(job)
            self._start()

    @property
    def populates_behind(self) -> bool:
        """Whether logs are mapped in place after they are handed out (on the worker), so
        that their makers map them ``behind``."""
        return self.making is LogMaking.THREADED

    def populate_behind(self, log_buffer: LogBuffer) -> None:
        """Map in place (on the worker, when it has no log to make or delete) the pages of
        ``log_buffer``, which was mapped ``behind`` (:attr:`populates_behind`); a log
        closed meanwhile is left."""
        with self._lock:
            if self.making is LogMaking.THREADED and not self._closing:
                self._populating.append(log_buffer)
                self._start()

    def discard(self, log_buffer: LogBuffer, gone: Callable[[], None]) -> None:
        """Unmap ``log_buffer`` and delete its file, then ``gone`` (on the caller's thread:
        at once inline or after a close, else from :meth:`take_gone`); before the logs
        queued."""
        with self._lock:
            now = self.making is LogMaking.INLINE or self._closing
            if not now:
                self._discards.append((log_buffer, gone))
                self._start()
        if now:
            _discard(log_buffer, self.pool)
            gone()

    def step(self) -> None:
        """Deferred: make or delete one log (a deletion first), else delete the pool's
        files kept too long, on this thread."""
        if self.making is LogMaking.DEFERRED:
            with self._lock:
                unit = self._next_unit()
            if unit is not None:
                self._do(unit)
            elif self.pool is not None:
                self.pool.settle()

    def take_done(self) -> list[LogJob]:
        """The jobs done since the last call, in the order they finished."""
        with self._lock:
            done, self._done = self._done, []
        return done

    def take_gone(self) -> list[Callable[[], None]]:
        """The ``gone`` callbacks of the logs deleted since the last call."""
        with self._lock:
            gone, self._gone = self._gone, []
        return gone

    def close(self) -> list[LogJob]:
        """Stop: the queued jobs are not made (their ``result`` stays None), the one being
        made is waited for, and every log to discard is discarded (their ``gone`` callbacks
        wait in :meth:`take_gone`).  Returns every job not taken: done ones (their logs to
        free) and the unmade ones (their budget to give back)."""
        with self._lock:
            self._closing = True
            unmade = [job for jobs in self._queued.values() for job in jobs]
            self._queued.clear()
            self._populating.clear()
            self._work.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join()
        if self.pool is not None:
            self.pool.close()
        while self._discards:
            log_buffer, gone = self._discards.popleft()
            _discard(log_buffer, self.pool)
            self._gone.append(gone)
        return self.take_done() + unmade

    def _start(self) -> None:
        """(Holding the lock.)  The worker has work: started at the first, woken after."""
        if self.making is not LogMaking.THREADED:
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="ss-image-logs",
                                            daemon=True)
            self._thread.start()
        self._work.notify()

    def _next_unit(self) -> tuple[LogBuffer, Callable[[], None]] | LogJob | None:
        """(Holding the lock.)  The next deletion, else the next log to make (of the source
        whose turn it is, which then goes last), else None."""
        if self._discards:
            return self._discards.popleft()
        queued = self._queued
        if queued:
            source = next(iter(queued))
            jobs = queued.pop(source)
            job = jobs.popleft()
            if jobs:
                queued[source] = jobs
            return job
        return None

    def _do(self, unit: tuple[LogBuffer, Callable[[], None]] | LogJob) -> None:
        if isinstance(unit, LogJob):
            behind = self.populates_behind
            _make(unit, self.pool, behind=behind)
            with self._lock:
                self._done.append(unit)
                if (behind and isinstance(unit.result, LogBuffer) and unit.result.unpopulated
                        and not self._closing):  # a new sparse log has none to map
                    self._populating.append(unit.result)
        else:
            _discard(unit[0], self.pool)
            with self._lock:
                self._gone.append(unit[1])
        if self.making is LogMaking.THREADED:
            try:
                self._wake()
            except Exception:  # the conductor still finds it at its next cycle
                log.exception("waking the conductor for an image log failed")

    def _run(self) -> None:
        native.ss_name_thread(b"ss-image-logs")  # for ps -T, top -H, perf
        while True:
            with self._lock:
                while (not self._queued and not self._discards and not self._populating
                       and not self._closing):
                    if self.pool is not None and self.pool.is_due():
                        self._lock.release()  # the pool deletes without holding the queue
                        try:
                            self._settle_pool()
                        finally:
                            self._lock.acquire()
                        continue
                    self._work.wait(self._pool_wait_s())
                unit = self._next_unit()
                if unit is None and (self._closing or not self._populating):
                    return  # closing: close() discards what is left
                populating = self._populating[0] if unit is None else None
            if unit is not None:
                self._do(unit)
                continue
            # The pool's upkeep between the steps: a flood of large logs to map must not
            # keep it past its cap, or its files past their time, until all are mapped.
            if self.pool is not None and self.pool.is_due():
                self._settle_pool()
            if populating is not None and not populating.populate_step():
                with self._lock:
                    if self._populating and self._populating[0] is populating:
                        self._populating.popleft()

    def _wake_for_pool(self) -> None:
        """The pool holds more than it may (:meth:`LogPool.set_room`): it settles on the
        worker (threaded), at the next step (deferred), or now (inline)."""
        assert self.pool is not None
        if self.making is LogMaking.INLINE:
            self.pool.settle()
            return
        with self._lock:
            if self.making is LogMaking.THREADED and not self._closing:
                self._start()

    def _settle_pool(self) -> None:
        """(The worker, idle or between the steps of mapping a log.)  :meth:`LogPool.settle`,
        and the conductor woken when it changed what the pool holds (it shows that in the
        system counters)."""
        assert self.pool is not None
        changes = self.pool.changes
        try:
            self.pool.settle()
        except Exception:  # a bug: the worker goes on making and deleting logs
            log.exception("settling the released logs kept for reuse failed")
        if self.pool.changes != changes:
            try:
                self._wake()
            except Exception:  # the conductor still finds it at its next cycle
                log.exception("waking the conductor for the log pool failed")

    def _pool_wait_s(self) -> float | None:
        """How long the idle worker may wait before the pool's oldest file is due (None:
        for work)."""
        due = self.pool.next_due_ns() if self.pool is not None else None
        return None if due is None else max(0.0, (due - time.monotonic_ns()) / 1e9)


def _discard(log_buffer: LogBuffer, pool: LogPool | None) -> None:
    try:
        discard_file(log_buffer, pool)
    except Exception:  # a log left behind is found by the directory's next owner
        log.exception("deleting the image log %s failed", log_buffer.path)


def _make(job: LogJob, pool: LogPool | None, *, behind: bool = False) -> None:
    try:
        job.result = make_log_file(job.path, job.length, pool, logs_length=job.logs_length,
                                   behind=behind, **job.kwargs)
    except Exception as e:  # handed to the conductor, which says what failed
        job.result = e
