"""Released log files kept for the driver's next log of the same length.

A new log's pages cost their first writer a page fault each (the filesystem allocates and
zeroes the page): a replay that writes 64 MB into a fresh log takes about 15.6k faults, 30-37
ms on a shared VM, against about 7 ms to write pages that exist.  So when the driver frees a
log (a network publication's, an image's) it may keep the file in :class:`LogPool` instead of
deleting it, and a later log of the same file length takes it (:meth:`LogPool.take`), pages
and all.

What a kept file guarantees, so that every reader and writer finds it as a fresh one:

* Every byte of its terms reads zero when it is handed out, and :meth:`LogBuffer.create`
  then writes its metadata page whole (tails, term counts, flags, the default header, the
  end of stream), as in a new file.  Only the ranges the filesystem holds pages for
  (``SEEK_DATA``) are written with zeros, at :meth:`LogPool.keep` and the
  :meth:`LogPool.settle` calls after it, :attr:`LogPool.ZERO_STEP` bytes per call, so that
  the thread that calls them makes new logs between the pieces of a large file; holes read
  zero already and stay holes (a sparse log stays sparse).
* **No process can read it under its new name but those the new log is given to.**  A
  file is kept only when no process has it open or mapped, the driver included: the kernel
  grants a write lease (``F_SETLEASE``) only on a file without another open description, and
  a mapping holds one for as long as it lives.  The file is first renamed into the pool's
  folder, so no new open can find it by its old name, then checked; a file still mapped
  (a client keeps a closed image's or publication's mapping for its resource linger, 3 s)
  waits in the pool, neither zeroed nor handed out, until no process maps it
  (:meth:`LogPool.settle`, every 100 ms); the mapping keeps the data of its own stream.  The
  lease is held while the file is zeroed, and again while it is taken (linked under the new
  log's name, its pool name unlinked): a process that opens it meanwhile begins a break of
  the lease, which the pool sees, and the file is deleted instead of handed out
  (:func:`write_lease`).  A process that opens a pool file by its name in the driver's
  directory could open every log there already.
* The pool holds at most ``log_reuse_bytes`` of memory (the pages its files hold, not
  their lengths), and within ``log_buffer_memory_limit`` no more than the logs in use leave
  of it (:meth:`LogPool.set_room`: a new log that needs the room has the oldest kept files
  deleted), so the limit bounds the logs and the kept files together; on the filesystem
  too, a new log that lacks room there has the oldest deleted (:meth:`LogPool.give_way`);
  a file kept ``log_reuse_timeout`` without being taken is deleted, so an idle driver
  gives the memory back.  ``log_reuse_bytes = 0`` keeps nothing.

Its files keep their names, ``<registration id>.logbuffer``, in the driver directory's
``released/`` folder, and a zeroed one's metadata is all zero but that id (as the
correlation id), its term length and page size, so that the directory's clean-up knows them
for the driver's (:mod:`..directory`) whether they were zeroed or still mapped.  Any thread:
the image log worker keeps and takes files (:mod:`.image_logs`), the conductor takes them
for publications.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import signal
import struct
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import attrs

from slipstream.client.layout import (
    LOG_META_DATA_LENGTH,
    META_CORRELATION_ID,
    META_TERM_LENGTH,
    PAGE_MIN_SIZE,
    PARTITION_COUNT,
)
from slipstream.client.logbuffer import compute_log_length, resident_ranges, term_length_of_file

log = logging.getLogger("slipstream.driver")

#: ``fcntl`` command that names the signal a lease break sends (Linux; not in every
#: Python's fcntl module).
_F_SETSIG = getattr(fcntl, "F_SETSIG", 10)
#: Bytes written per ``pwrite`` of zeros.
_ZERO_CHUNK = bytes(1 << 20)


@attrs.define
class _Kept:
    path: Path
    registration_id: int  # its log's, and its name
    length: int  # bytes: the file's length
    resident: int  # bytes of memory its pages take
    kept_ns: int  # the clock's ns
    #: Zeroed and checked unshared: it may be taken.  Until then a process still maps it,
    #: or it is being zeroed.
    ready: bool = False
    #: While it is zeroed, a step at a time: its descriptor, which holds the pool's write
    #: lease, and the offset zeroed up to.
    fd: int = -1
    zeroed: int = 0
    #: Deleted from the pool (its descriptor closed, its lease dropped).
    deleted: bool = False


class FileInUse(Exception):
    """A released log file that a process still has open or mapped."""


class FileOpened(FileInUse):
    """A released log file that a process opened while the pool held its write lease (a
    lease break began): the process may keep it, so the pool deletes it."""


def take_lease(fd: int, path: Path) -> None:
    """Take a write lease on ``fd``'s file (at ``path``): FileInUse if another open
    description of it exists (a process, this one included, has it open or mapped: the
    kernel grants the lease only when none does).  OSError where the kernel cannot tell
    (leases off: ``fs.leases-enable = 0``, a filesystem without them, a file the driver does
    not own).  A process that opens the file while the lease is held begins a break, which
    signals SIGURG (ignored unless a handler is set) and holds that open until the lease is
    dropped."""
    fcntl.fcntl(fd, _F_SETSIG, signal.SIGURG)
    try:
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)
    except OSError as e:
        if e.errno in (errno.EAGAIN, errno.EBUSY):
            raise FileInUse(path) from None
        raise


def drop_lease(fd: int, path: Path, *, check: bool = True) -> None:
    """Drop the write lease :func:`take_lease` took; ``check``: FileOpened if a process
    opened the file while it was held (a break began)."""
    try:
        # A break in progress shows the lease's type it will end at, not F_WRLCK.
        opened = check and fcntl.fcntl(fd, fcntl.F_GETLEASE) != fcntl.F_WRLCK
    finally:
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
    if opened:
        raise FileOpened(path)


@contextlib.contextmanager
def write_lease(fd: int, path: Path) -> Iterator[None]:
    """Hold a write lease on ``fd``'s file (at ``path``) for the block
    (:func:`take_lease`): FileInUse at once if another open description of it exists,
    FileOpened at the block's end if a process opened it meanwhile."""
    take_lease(fd, path)
    try:
        yield
    except BaseException:
        drop_lease(fd, path, check=False)
        raise
    drop_lease(fd, path)


def is_unshared(fd: int) -> bool:
    """Whether no open description of ``fd``'s file exists but ``fd``'s own (no other
    process, nor this one, has it open or mapped), as :func:`write_lease` tells, which
    holds the lease only for this call."""
    try:
        with write_lease(fd, Path(f"/proc/self/fd/{fd}")):
            pass
    except FileInUse:
        return False
    return True


def zero_pages(fd: int, length: int, start: int = 0, most: int | None = None) -> int:
    """Write zeros over every range of ``fd``'s file (``length`` bytes) from ``start`` on
    that has pages, ``most`` bytes of them at most (None: all); holes stay holes.  Returns
    the offset it reached: ``length`` once every range is done.  ``pwrite`` releases the
    GIL, and writes into the pages where they are, without mapping them."""
    budget = length if most is None else most
    for begin, end in resident_ranges(fd, length):
        begin = max(begin, start)
        while begin < end:
            if budget <= 0:
                return begin
            count = min(end - begin, len(_ZERO_CHUNK), budget)
            written = os.pwrite(fd, memoryview(_ZERO_CHUNK)[:count], begin)
            begin += written
            budget -= written
    return length


class LogPool:
    """Released log files, kept in ``folder`` for a new log of the same length (see the
    module docstring).  ``limit``: bytes of memory the kept files may hold (0: keep none);
    ``max_age_ns``: how long one is kept untaken.  Thread-safe; :meth:`keep` and
    :meth:`settle` write a file's pages (the image log worker's calls), :meth:`take` does
    not."""

    #: How often a kept file that a process still maps is checked again, ns.
    SETTLE_INTERVAL_NS = 100_000_000
    #: Bytes of zeros a :meth:`keep` or :meth:`settle` writes at most (a larger file is
    #: zeroed over several calls), so that the thread that calls them (the image log
    #: worker) makes a new log between two such pieces: 16 MiB, a few ms.
    ZERO_STEP = 16 << 20

    def __init__(self, folder: Path, limit: int, max_age_ns: int,
                 clock: Callable[[], int] = time.monotonic_ns) -> None:
        self.folder = folder
        self.limit = limit
        self.max_age_ns = max_age_ns
        self._clock = clock
        self._lock = threading.Lock()
        #: Held while a file is zeroed, and to close a kept file's descriptor.
        self._zeroing = threading.Lock()
        #: Bytes zeroed per :meth:`keep` or :meth:`settle` (None: a whole file at once).
        self.zero_step: int | None = self.ZERO_STEP
        self._kept: list[_Kept] = []  # oldest first
        self._closed = False
        self._bytes = 0
        self._warned = False  # a failure to keep a file was logged
        #: When the kept files still mapped are checked again (the clock's ns).
        self._check_ns = 0
        #: Bytes the logs in use leave of log_buffer_memory_limit (:meth:`set_room`).
        self._room: int | None = None
        #: Called (any thread) when the pool holds more than it may and :meth:`settle` should
        #: run soon: its owner's way to wake the thread that settles.
        self.wake: Callable[[], None] = lambda: None
        #: Bumped at every change of what is kept or of :attr:`reused` (to show them when
        #: they change).
        self.changes = 0
        #: Logs made from a kept file.
        self.reused = 0

    @property
    def bytes(self) -> int:
        """Memory the kept files hold, bytes (those still mapped by a process included)."""
        return self._bytes

    @property
    def count(self) -> int:
        """Files kept, ready or not."""
        with self._lock:
            return len(self._kept)

    @property
    def ready_count(self) -> int:
        """Files kept zeroed, which a new log of their length may take now."""
        with self._lock:
            return sum(k.ready for k in self._kept)

    @property
    def cap(self) -> int:
        """The most the kept files may hold now, bytes: ``limit``, and no more than the logs
        in use leave of their limit."""
        room = self._room
        return self.limit if room is None else max(0, min(self.limit, room))

    def set_room(self, room: int) -> None:
        """What the logs in use leave of their memory limit, bytes (the conductor's budget,
        at each change): past it, the oldest kept files are deleted at the next
        :meth:`settle`, which :attr:`wake` asks for."""
        self._room = room
        if self._bytes > self.cap:
            self.wake()

    def keep(self, path: Path) -> bool:
        """Take the released log file at ``path`` (unmapped by the driver already): renamed
        into the pool, and zeroed now if no process has it open or mapped, else once none
        has (:meth:`settle`); deleted when it cannot be.  True: the file is no longer at
        ``path``; False: the pool wants none (off, closed, or the file alone holds more than
        the limit) and left it there for the caller to delete."""
        if self.limit <= 0 or self._closed:
            return False
        try:
            registration_id = int(path.name.removesuffix(".logbuffer"))
            if os.stat(path).st_blocks * 512 > self.cap:
                return False
        except (OSError, ValueError):
            return False
        kept = _Kept(self.folder / path.name, registration_id, 0, 0, self._clock())
        try:
            os.rename(path, kept.path)
            info = os.stat(kept.path)
        except OSError:
            return False
        kept.length, kept.resident = info.st_size, info.st_blocks * 512
        with self._lock:
            self._kept.append(kept)
            self._changed_locked()
        self._ready(kept)
        return True

    def shed(self) -> None:
        """Delete the kept files past :attr:`cap` (the oldest) and those kept too long, now,
        on this thread: before a new log's room on the filesystem is checked."""
        with self._lock:
            victims = self._evict_locked()
            if victims:
                self._changed_locked()
        self._delete(victims)

    def give_way(self) -> bool:
        """Delete the oldest kept file (ready or not), now, on this thread: a new log needs
        the room it takes on the filesystem.  False: none is kept."""
        with self._lock:
            if not self._kept:
                return False
            oldest = self._kept.pop(0)
            self._changed_locked()
        self._delete([oldest])
        return True

    def settle(self) -> None:
        """Zero the kept files that no process maps any more (they may be taken from now
        on), :attr:`zero_step` bytes at most, and delete those kept too long, and the oldest
        past :attr:`cap`."""
        self.shed()
        with self._lock:
            pending = [k for k in self._kept if not k.ready]
            # One being zeroed goes on first.
            pending.sort(key=lambda k: k.fd < 0)
            self._check_ns = self._clock() + self.SETTLE_INTERVAL_NS
        for kept in pending:
            if self._ready(kept):
                break  # zeros written: the caller's other work comes before more

    def take(self, path: Path, length: int) -> bool:
        """Put a kept file of ``length`` bytes, every byte zero, at ``path`` (which must not
        exist): True, else False (none ready of that length, or each one found in use or
        opened by a process as it was taken, and deleted)."""
        while True:
            with self._lock:
                kept = next((k for k in reversed(self._kept)
                             if k.ready and k.length == length), None)
                if kept is None:
                    return False
                self._kept.remove(kept)
                self._changed_locked()
            linked = False
            try:
                fd = os.open(kept.path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
                try:
                    # Under the lease: a process that opens the file by its pool name before
                    # the name is gone shows as a break, and the file is not handed out.
                    with write_lease(fd, kept.path):
                        os.link(kept.path, path)  # never over an existing file
                        linked = True
                        os.unlink(kept.path)
                finally:
                    os.close(fd)
            except (OSError, FileInUse):
                if linked:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(path)
                self._delete([kept])
                continue
            with self._lock:
                self.reused += 1
                self.changes += 1
            return True

    def next_due_ns(self) -> int | None:
        """When :meth:`settle` has work next (the clock's ns): a kept file due for deletion,
        or one still mapped to check again; None: no file kept."""
        with self._lock:
            if not self._kept:
                return None
            due = self._kept[0].kept_ns + self.max_age_ns
            if any(k.fd >= 0 for k in self._kept):
                return min(due, self._clock())  # one is being zeroed
            if any(not k.ready for k in self._kept):
                due = min(due, self._check_ns)
            return due

    def is_due(self) -> bool:
        """Whether :meth:`settle` has work now."""
        if self._bytes > self.cap:
            return True
        due = self.next_due_ns()
        return due is not None and self._clock() >= due

    def expire(self) -> None:
        """Delete the files kept ``max_age_ns`` or longer."""
        now = self._clock()
        with self._lock:
            victims = [k for k in self._kept if now - k.kept_ns >= self.max_age_ns]
            if victims:
                self._kept = [k for k in self._kept if now - k.kept_ns < self.max_age_ns]
                self._changed_locked()
        self._delete(victims)

    def close(self) -> None:
        """Delete every kept file and keep no more."""
        with self._lock:
            self._closed = True
            victims, self._kept = self._kept, []
            self._changed_locked()
        self._delete(victims)

    def _ready(self, kept: _Kept) -> bool:
        """Zero :attr:`zero_step` bytes more of ``kept`` if no process maps it (it is ready
        once all are); deleted if it cannot be, or a process opened it meanwhile; then the
        pool is brought within its bounds.  True: zeros were written."""
        resident = None
        drop = False
        with self._zeroing:
            if kept.deleted:
                return False
            try:
                resident = _zero_step(kept, self.zero_step)
            except FileOpened:
                drop = True
            except FileInUse:
                pass
            except OSError as e:
                if not self._warned:  # once: it fails alike for every file (leases off)
                    self._warned = True
                    log.warning("keeping the released log %s for reuse failed (deleted, and "
                                "so may others be): %s", kept.path, e)
                drop = True
            zeroing = kept.fd >= 0
        wrote = zeroing or resident is not None
        with self._lock:
            if drop:
                if kept in self._kept:
                    self._kept.remove(kept)
            elif resident is not None and kept in self._kept:
                kept.ready, kept.resident = True, resident
            elif not zeroing:  # still mapped: checked again later
                self._check_ns = self._clock() + self.SETTLE_INTERVAL_NS
            victims = self._evict_locked()
            self._changed_locked()
        if drop:
            victims.append(kept)
        self._delete(victims)
        if zeroing:
            self.wake()  # the rest of it at the next settle
        return wrote

    def _delete(self, kept: list[_Kept]) -> None:
        """Delete ``kept``'s files, out of the pool already; one being zeroed has its
        descriptor closed (and lease dropped) first, between two steps."""
        for k in kept:
            with self._zeroing:
                k.deleted = True
                if k.fd >= 0:
                    with contextlib.suppress(OSError):
                        drop_lease(k.fd, k.path, check=False)
                    os.close(k.fd)
                    k.fd = -1
        _delete(kept)

    def _changed_locked(self) -> None:
        """(Holding the lock.)  What is kept changed."""
        self._bytes = sum(k.resident for k in self._kept)
        self.changes += 1

    def _evict_locked(self) -> list[_Kept]:
        """(Holding the lock.)  Those past their age, and the oldest kept files, out of the
        pool until it is within its limit again."""
        now = self._clock()
        victims = [k for k in self._kept if now - k.kept_ns >= self.max_age_ns]
        self._kept = [k for k in self._kept if now - k.kept_ns < self.max_age_ns]
        total = sum(k.resident for k in self._kept)
        cap = self.cap
        while self._kept and total > cap:
            oldest = self._kept.pop(0)
            total -= oldest.resident
            victims.append(oldest)
        return victims


def _zero_step(kept: _Kept, most: int | None) -> int | None:
    """(Holding the pool's zeroing lock.)  Zero ``most`` bytes more (None: all) of
    ``kept``'s file under the pool's write lease, taken at the first step and held until
    the last, which writes its pool metadata (its registration id as its correlation id)
    and drops the lease: returns the bytes its pages hold, None while some remain to zero.
    FileInUse at the first step when another open description of it exists (a process maps
    it), FileOpened at the last when a process opened it meanwhile."""
    if kept.fd < 0:
        fd = os.open(kept.path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            take_lease(fd, kept.path)
        except BaseException:
            os.close(fd)
            raise
        kept.fd, kept.zeroed = fd, 0
    fd = kept.fd
    done = False
    try:
        length = os.fstat(fd).st_size
        kept.zeroed = zero_pages(fd, length, kept.zeroed, most)
        if kept.zeroed < length:
            return None
        done = True
        term_length = term_length_of_file(length)
        meta = bytearray(LOG_META_DATA_LENGTH)
        struct.pack_into("<q", meta, META_CORRELATION_ID, kept.registration_id)
        struct.pack_into("<ii", meta, META_TERM_LENGTH, term_length,
                         _page_size_of(length, term_length))
        os.pwrite(fd, meta, PARTITION_COUNT * term_length)
        resident = os.fstat(fd).st_blocks * 512
        drop_lease(fd, kept.path)
        return resident
    except BaseException:
        done = True
        with contextlib.suppress(OSError):
            drop_lease(fd, kept.path, check=False)
        raise
    finally:
        if done:
            os.close(fd)
            kept.fd = -1


def _page_size_of(length: int, term_length: int) -> int:
    """The page size a log of ``term_length`` terms and ``length`` bytes was aligned to."""
    page = PAGE_MIN_SIZE
    while compute_log_length(term_length, page) != length:
        page <<= 1
        if page > length:
            raise OSError(errno.EINVAL, f"{length} bytes is no log of {term_length}-byte terms")
    return page


def _delete(kept: list[_Kept]) -> None:
    for k in kept:
        try:
            os.unlink(k.path)
        except FileNotFoundError:
            pass
        except OSError as e:  # left for the directory's clean-up at the driver's stop
            log.warning("deleting the kept log %s failed: %s", k.path, e)
