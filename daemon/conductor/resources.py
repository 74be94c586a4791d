"""What the conductor makes from host resources (log files), and the error it answers with when
the host cannot give them."""

from __future__ import annotations

import contextlib
import errno
import os
import random
from pathlib import Path
from typing import Any

from slipstream.client import control
from slipstream.client.channel import Channel
from slipstream.client.layout import INT32_MAX, INT32_MIN, PAGE_MIN_SIZE
from slipstream.client.logbuffer import LogBuffer, compute_log_length
from slipstream.daemon.conductor.log_pool import LogPool
from slipstream.daemon.protocol.params import PublicationParams


class ResourceError(Exception):
    """A command needs a resource the host cannot give (memory, file space, an address): its
    message is the answer to the client."""


def no_room_for_log(path: Path, stream_id: int, term_length: int,
                    error: OSError) -> ResourceError:
    """The answer when the log of ``stream_id`` cannot be created at ``path``."""
    return ResourceError(
        f"cannot create the log of stream {stream_id} ({3 * term_length / 2**20:g} MiB in "
        f"{path.parent}): {error.strerror}; free space there, or use smaller terms "
        f"(term-length= in the URI, or the driver's term length setting)")


class LogBudget:
    """The memory all of the driver's logs may take together (``log_buffer_memory_limit``):
    a log that would go past it is refused with an answer that says what to do, so neither a
    client nor a SETUP from the network can take the host's memory.  The released logs'
    files a :class:`LogPool` keeps share it: the pool holds at most what the logs in use
    leave (:meth:`LogPool.set_room`), and gives files up when a new log needs the room."""

    def __init__(self, limit: int) -> None:
        self.limit = limit  # bytes
        self.used = 0  # bytes of the logs that exist
        self.pool: LogPool | None = None  # the released logs kept (set by their owner)

    def reserve(self, term_length: int, what: str) -> int:
        """Count a log of ``term_length`` terms for ``what`` (a stream, an image); returns
        its length in bytes, to :meth:`release` when the log goes."""
        length = compute_log_length(term_length)
        if self.used + length > self.limit:
            raise ResourceError(
                f"{what}: its log of {length / 2**20:g} MiB would take the driver's logs to "
                f"{(self.used + length) / 2**20:g} MiB, past log_buffer_memory_limit "
                f"({self.limit / 2**20:g} MiB): close streams, use smaller terms "
                f"(term-length=), or raise log_buffer_memory_limit")
        self.used += length
        self._tell_pool()
        return length

    def release(self, length: int) -> None:
        self.used -= length
        self._tell_pool()

    def share_with(self, pool: LogPool) -> None:
        """The kept released logs of ``pool`` share this budget from now on."""
        self.pool = pool
        self._tell_pool()

    def _tell_pool(self) -> None:
        if self.pool is not None:
            self.pool.set_room(self.limit - self.used)


def check_room_for_log(path: Path, length: int, *, logs_length: int | None = None) -> None:
    """Raise OSError(ENOSPC) unless the filesystem of ``path`` (a log file in a driver's
    ``publications/`` or ``images/``) has room for ``length`` bytes beyond what the driver's
    sparse logs have not written yet, for a log of either kind: a sparse log takes its pages
    as it is written, and a write to a page the filesystem cannot give kills the writer with
    SIGBUS (a driver, with every stream of the host), so neither a sparse log nor a dense one
    may take the room another sparse log will need.  Room taken later by others is not
    foreseen; a filesystem that reports no size (tmpfs size=0: unlimited) is not checked.
    ``logs_length``: the length of all the driver's logs (:attr:`LogBudget.used`), a bound
    of what they may still take: with that much free, the logs are not looked at one by one
    (a look that costs in proportion to the streams)."""
    usage = os.statvfs(path.parent)
    if usage.f_blocks == 0:
        return
    free = usage.f_bavail * usage.f_frsize
    if logs_length is not None and free >= length + logs_length:
        return
    promised = 0
    for folder in (control.PUBLICATIONS_DIR, control.IMAGES_DIR):
        with contextlib.suppress(FileNotFoundError), os.scandir(path.parent.parent / folder) \
                as entries:
            for entry in entries:
                if entry.name.endswith(".logbuffer"):
                    with contextlib.suppress(FileNotFoundError):
                        status = entry.stat(follow_symlinks=False)
                        promised += max(0, status.st_size - status.st_blocks * 512)
    if free < length + promised:
        raise OSError(errno.ENOSPC, f"{free / 2**20:g} MiB free for a log of "
                                    f"{length / 2**20:g} MiB, and the driver's sparse logs "
                                    f"may still take {promised / 2**20:g} MiB (a sparse log "
                                    f"takes its pages as it is written, and a full filesystem "
                                    f"then kills the writer)")


def create_log(path: Path, budget: LogBudget, what: str, pool: LogPool | None = None,
               **kwargs: Any) -> LogBuffer:
    """``LogBuffer.create(path, **kwargs)`` within ``budget`` (from a file of ``pool`` when it
    keeps one of the log's length); a log past the budget, or an OSError (no space, a file
    size limit), is a :class:`ResourceError` that says what to do, and leaves no file
    behind."""
    length = budget.reserve(kwargs["term_length"], what)
    try:
        # The budget counts this log already: what the others may take is the rest.
        return make_log_file(path, length, pool, logs_length=budget.used - length, **kwargs)
    except OSError as e:
        budget.release(length)
        raise no_room_for_log(path, kwargs["stream_id"], kwargs["term_length"], e) from None


def make_room_for_log(path: Path, length: int, pool: LogPool | None, *,
                      logs_length: int | None = None) -> None:
    """:func:`check_room_for_log`, with the files ``pool`` keeps deleted, the oldest first,
    for as long as the filesystem lacks the room and the pool has one: a kept file takes
    room on the filesystem of the logs (``released/`` is in the driver directory), which a
    new log comes first for.  OSError(ENOSPC) when the room is not there with none kept."""
    while True:
        try:
            check_room_for_log(path, length, logs_length=logs_length)
            return
        except OSError as e:
            if e.errno != errno.ENOSPC or pool is None or not pool.give_way():
                raise


def make_log_file(path: Path, length: int, pool: LogPool | None = None, *,
                  logs_length: int | None = None, **kwargs: Any) -> LogBuffer:
    """The file of a log of ``length`` bytes (reserved in the budget already), if its
    filesystem has room (:func:`make_room_for_log`): ``LogBuffer.create(path, **kwargs)``,
    in a file ``pool`` kept when it has one of the file's length (its pages there already,
    so the room it needs is only the pages it lacks), else a new one.  OSError when it
    cannot be made, leaving no file behind.  ``logs_length``: the length of the driver's
    other logs as the budget counted them (:attr:`LogBudget.used` less this one's), with
    which a filesystem that has that much free is not looked at log by log.  Any thread: it
    touches nothing but the file and the pool (an image's log is made on a worker:
    :mod:`.image_logs`)."""
    file_length = compute_log_length(kwargs["term_length"],
                                     kwargs.get("page_size", PAGE_MIN_SIZE))
    if pool is not None:
        pool.shed()  # past its memory cap, the kept files give way to this log first
        if pool.take(path, file_length):
            try:
                # At ``path`` already, the file's holes count among what the driver's sparse
                # logs may still take: no more room is needed than for those.
                make_room_for_log(path, 0, pool, logs_length=None if logs_length is None
                                  else logs_length + file_length)
                return LogBuffer.create(path, reused=True, **kwargs)
            except BaseException:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                raise
    make_room_for_log(path, length, pool, logs_length=logs_length)
    return LogBuffer.create(path, **kwargs)


def discard_log(log_buffer: LogBuffer, budget: LogBudget, pool: LogPool | None = None) -> None:
    """Unmap the driver's view of a log, hand its file to ``pool`` or delete it (clients
    keep their mappings) and give its memory back to ``budget``."""
    budget.release(log_buffer.length)
    discard_file(log_buffer, pool)


def discard_file(log_buffer: LogBuffer, pool: LogPool | None = None) -> None:
    """Unmap the driver's view of a log and hand its file to ``pool`` (:meth:`LogPool.keep`:
    kept for a later log only when no process maps it any more) or delete it (clients keep
    their mappings); its memory is the caller's to give back.  Any thread."""
    path = log_buffer.path
    log_buffer.close()
    if pool is not None and pool.keep(path):
        return
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def log_start(params: PublicationParams, rng: random.Random) -> dict[str, int]:
    """Where a new publication's log starts: ``initial_term_id`` (random unless the URI sets
    ``init-term-id``), ``initial_term_count`` and ``initial_term_offset``; keyword arguments
    of LogBuffer.create."""
    initial_term_id = params.initial_term_id
    if initial_term_id is None:
        initial_term_id = rng.randrange(INT32_MIN, INT32_MAX + 1)
    return {"initial_term_id": initial_term_id,
            "initial_term_count": params.initial_term_count,
            "initial_term_offset": params.initial_term_offset}


class StreamInterest:
    """What a subscription takes: one stream of its channel, and of that stream every session
    or the one its URI names (``session-id=``).  A base of the IPC and UDP subscriptions."""

    __slots__ = ()  # they are slotted attrs classes

    channel: Channel
    stream_id: int

    def wants(self, session_id: int, stream_id: int) -> bool:
        """Whether this subscription takes ``session_id`` of ``stream_id`` (the argument order
        of the images' keys, and of :meth:`ReceiveChannel.wants`)."""
        return stream_id == self.stream_id and (
            self.channel.session_id is None or self.channel.session_id == session_id)
