"""Segment files: their names, where a position lies in them, and the checked scan of their
frames.

A recording's bytes are kept in segment files named ``<recording id>-<segment base
position>.rec`` in the archive directory.  A segment's length is a power-of-two multiple of
the stream's term length, and the frame at stream position ``p`` lies at offset ``p - base``
of the segment whose base is ``p`` rounded down to the segment length on the grid of the
recording's first term (Aeron's ``segmentFileBasePosition``): a segment holds whole terms laid
out exactly as in the log, headers, alignment and padding included, so a reader maps it and
scans it as a term.  The first segment of a recording that joined its stream mid-term begins
at the recording's start position: the bytes before it are a hole (zeros), never data.

A segment is written front to back and never rewritten, so its size is how far it was
written; :func:`scan_segment` trusts nothing it reads (docs/ARCHIVE.md, "Recovery").  Its
blocks may be reserved ahead of the writes (:func:`reserve`: ``fallocate`` keeping the size,
which spares the file system an allocation per page written) and the reservation past the
size is given back when the segment is closed or recovered (:func:`release_reserved`); what
was written may be sent to the disk and dropped from the page cache as the writes go on
(:class:`WriteBehind`).
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import cffi

from slipstream.client._native import ffi, lib
from slipstream.client.layout import FRAME_ALIGNMENT, TERM_MAX_LENGTH, TERM_MIN_LENGTH

SEGMENT_SUFFIX: Final = ".rec"
#: A segment file's name: the recording id and the segment's base position, both decimal.
_SEGMENT_NAME: Final = re.compile(r"^(0|[1-9][0-9]*)-(0|[1-9][0-9]*)\.rec$")
#: Aeron Archive's default segment file length.
DEFAULT_SEGMENT_LENGTH: Final = 128 * 1024 * 1024
#: A segment holds one term at least, and at most 1 GiB (the longest term).
MIN_SEGMENT_LENGTH: Final = TERM_MIN_LENGTH
MAX_SEGMENT_LENGTH: Final = TERM_MAX_LENGTH

#: Why a scan stopped (ss_scan_recorded's reasons).
SCAN_END: Final = "end"  # a zero length where the next frame would be, or the file's end
SCAN_TORN: Final = "torn"  # a frame (or its header) reaching past the file's end
SCAN_INVALID: Final = "invalid"  # a header that is no frame of this recording at this place
_REASONS: Final = {lib.SS_SCAN_END: SCAN_END, lib.SS_SCAN_TORN: SCAN_TORN,
                   lib.SS_SCAN_INVALID: SCAN_INVALID}


# fallocate(2) and sync_file_range(2), which Python's os module lacks (os.posix_fallocate
# changes the size); ABI mode: one call per segment or per chunk, nothing to build.
_libc_ffi = cffi.FFI()
_libc_ffi.cdef("int fallocate(int fd, int mode, int64_t offset, int64_t len);\n"
               "int sync_file_range(int fd, int64_t offset, int64_t nbytes, unsigned int flags);")
_libc = _libc_ffi.dlopen(None)
_FALLOC_FL_KEEP_SIZE: Final = 0x01


def reserve(fd: int, length: int) -> bool:
    """Reserve the blocks of a segment's first ``length`` bytes without changing its size
    (``fallocate`` with ``FALLOC_FL_KEEP_SIZE``); returns whether it did.  A file system that
    cannot, or a disk without the room (the writes then fail where the disk is full, as
    without a reservation), leaves the file as it was."""
    if _libc.fallocate(fd, _FALLOC_FL_KEEP_SIZE, 0, length) == 0:
        return True
    code = _libc_ffi.errno
    if code in (errno.ENOSPC, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL, errno.EDQUOT):
        return False
    raise OSError(code, os.strerror(code))


_SYNC_FILE_RANGE_WAIT_BEFORE: Final = 1
_SYNC_FILE_RANGE_WRITE: Final = 2
_SYNC_FILE_RANGE_WAIT_AFTER: Final = 4


#: Chunks of write-behind under way before the oldest is waited for: with one the archive
#: waited on the disk at nearly every chunk and recorded at 545 MB/s where four gave 1,003
#: (twelve: 1,008), 8 MiB chunks, 2026-11-28 (docs/ARCHIVE.md, "Figures").
WRITE_BEHIND_DEPTH: Final = 4


class WriteBehind:
    """Write-behind for one file written front to back (PostgreSQL's ``*_flush_after``,
    RocksDB's ``bytes_per_sync``): each time ``chunk`` more bytes were written the kernel is
    asked to start writing them to the disk (``sync_file_range``, not waiting); once more
    than ``depth`` chunks are under way the oldest is waited for and dropped from the page
    cache (``POSIX_FADV_DONTNEED``).  So the cache a recording holds stays about ``depth +
    1`` chunks, the next writes reuse its pages instead of taking new ones (which the kernel
    must find, and a VM's host must back, at a fraction of the rate: docs/ARCHIVE.md,
    "Figures"), and a writer that outruns the disk waits for it a chunk at a time, not for
    seconds when the dirty pages reach the kernel's limit; one that does not outrun it finds
    the oldest chunk written by then and does not wait.  Not durability: the disk's cache and
    the file's metadata are not flushed (the sync policy's fdatasync does that).  On a file
    system without writeback (tmpfs) both calls do nothing."""

    def __init__(self, chunk: int, depth: int = WRITE_BEHIND_DEPTH) -> None:
        self.chunk = chunk
        self.depth = depth
        self._fd = -1
        self._started: list[int] = []  # the end offsets of the chunks under way, oldest first
        self._dropped = 0  # offsets before it are written and dropped (or not this file's)

    @property
    def confirmed(self) -> int:
        """The file offset up to which the disk reported the writes done without an error
        (waited for; or where the file's writes began)."""
        return self._dropped

    def restart(self, fd: int, offset: int) -> None:
        """A new file ``fd`` whose writes begin at ``offset``."""
        self._fd = fd
        self._started.clear()
        self._dropped = offset

    @property
    def active(self) -> bool:
        """False once the file system refused ``sync_file_range`` (the page cache then keeps
        everything, as without write-behind)."""
        return self.chunk > 0

    def written(self, end: int) -> None:
        """The file holds what was written up to ``end``; raises :class:`OSError` when the
        disk reported an error writing back an earlier chunk (a write-back error: the
        kernel has cleared the file's error mark by then, so a later fdatasync may succeed
        without those bytes on the disk).  A file that cannot be synced
        by range (EINVAL, ESPIPE: some file systems, a pipe) turns write-behind off."""
        begin = self._started[-1] if self._started else self._dropped
        if not self.active or end - begin < self.chunk:
            return
        if not self._sync_range(begin, end - begin, _SYNC_FILE_RANGE_WRITE):
            return
        self._started.append(end)
        if len(self._started) > self.depth:
            oldest = self._started.pop(0)
            if not self._sync_range(self._dropped, oldest - self._dropped,
                                    _SYNC_FILE_RANGE_WAIT_BEFORE | _SYNC_FILE_RANGE_WRITE
                                    | _SYNC_FILE_RANGE_WAIT_AFTER):
                return
            os.posix_fadvise(self._fd, self._dropped, oldest - self._dropped,
                             os.POSIX_FADV_DONTNEED)
            self._dropped = oldest

    def finish(self, end: int) -> None:
        """The file is closed with ``end`` bytes written: what is still under way (up to
        ``depth`` chunks, and the tail short of a chunk) is waited for and dropped from the
        page cache, so that a closed segment keeps none of it.  Under the sync policies'
        fdatasync just before, the wait is for nothing.  Raises :class:`OSError` as
        :meth:`written` does."""
        if not self.active or end <= self._dropped:
            return
        if not self._sync_range(self._dropped, end - self._dropped,
                                _SYNC_FILE_RANGE_WAIT_BEFORE | _SYNC_FILE_RANGE_WRITE
                                | _SYNC_FILE_RANGE_WAIT_AFTER):
            return
        os.posix_fadvise(self._fd, self._dropped, end - self._dropped, os.POSIX_FADV_DONTNEED)
        self._started.clear()
        self._dropped = end

    def _sync_range(self, offset: int, length: int, flags: int) -> bool:
        if _libc.sync_file_range(self._fd, offset, length, flags) == 0:
            return True
        code = _libc_ffi.errno
        if code in (errno.EINVAL, errno.ESPIPE, errno.EOPNOTSUPP, errno.ENOSYS):
            logging.getLogger("slipstream.archive").warning(
                "write-behind off for this recording: its file system refuses sync_file_range "
                "(%s); the page cache keeps what is written", os.strerror(code))
            self.chunk = 0
            return False
        raise OSError(code, os.strerror(code))


def release_reserved(fd: int) -> None:
    """Give back the blocks reserved past the segment's size: a truncation to the size it
    has (which file systems take as the cue to drop blocks past the end; a hole punched there
    is not, on ext4)."""
    os.ftruncate(fd, os.fstat(fd).st_size)


def segment_file_name(recording_id: int, base_position: int) -> str:
    """``<recording id>-<segment base position>.rec``."""
    return f"{recording_id}-{base_position}{SEGMENT_SUFFIX}"


def parse_segment_file_name(name: str) -> tuple[int, int] | None:
    """``(recording id, base position)`` of a segment file's name, or None for any other name
    (the archive never touches a file whose name is not one of its segments')."""
    match = _SEGMENT_NAME.match(name)
    if match is None:
        return None
    return int(match.group(1)), int(match.group(2))


def segment_base(start_position: int, position: int, term_length: int,
                 segment_length: int) -> int:
    """The base position of the segment that holds stream ``position`` of a recording that
    started at ``start_position``: segments follow each other from the start of the
    recording's first term, ``segment_length`` bytes each (Aeron's
    ``segmentFileBasePosition``)."""
    start_term_base = start_position - (start_position & (term_length - 1))
    from_base = position - start_term_base
    return start_term_base + from_base - (from_base & (segment_length - 1))


def segment_files(directory: Path, recording_id: int) -> list[tuple[int, Path]]:
    """The segment files of ``recording_id`` in ``directory``, as ``(base position, path)``
    in the order of their positions."""
    found = []
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    for name in names:
        parsed = parse_segment_file_name(name)
        if parsed is not None and parsed[0] == recording_id:
            found.append((parsed[1], directory / name))
    found.sort()
    return found


@dataclass(frozen=True)
class ScanResult:
    """What :func:`scan_segment` found: the segment offset after the last whole valid frame
    (``end``), why it stopped there (:data:`SCAN_END`, :data:`SCAN_TORN`,
    :data:`SCAN_INVALID`), how many frames it stepped over and the file's size."""

    end: int
    reason: str
    frames: int
    size: int

    @property
    def clean(self) -> bool:
        """Nothing but zeros or the file's end after the last whole frame."""
        return self.reason == SCAN_END


def scan_segment(path: Path, from_offset: int, base_position: int, *, term_length: int,
                 initial_term_id: int, session_id: int, stream_id: int) -> ScanResult:
    """Scan the segment file at ``path`` (base position ``base_position``) frame by frame, in
    C, from segment offset ``from_offset`` (a frame boundary): stop at the first frame whose
    header is not a frame of this recording at its place (length below the header, crossing
    its term's end, an unknown type, a term offset, term id, session or stream id not its
    place's) or whose aligned end lies past the file's size (torn).  Changes nothing."""
    if from_offset < 0 or from_offset & (FRAME_ALIGNMENT - 1):
        raise ValueError(f"segment offset {from_offset} is not a frame boundary")
    if term_length & (term_length - 1) or not TERM_MIN_LENGTH <= term_length <= TERM_MAX_LENGTH:
        raise ValueError(f"term length {term_length} is not a power of two in "
                         f"[{TERM_MIN_LENGTH}, {TERM_MAX_LENGTH}]")
    with open(path, "rb") as file:
        size = os.fstat(file.fileno()).st_size
        if size <= from_offset:  # nothing written from there
            return ScanResult(from_offset, SCAN_END, 0, size)
        reason = ffi.new("int32_t *")
        frames = ffi.new("int64_t *")
        with mmap.mmap(file.fileno(), size, prot=mmap.PROT_READ) as mapped:
            view = ffi.from_buffer(mapped)
            try:
                end = lib.ss_scan_recorded(view, from_offset, size, base_position, term_length,
                                           term_length.bit_length() - 1, initial_term_id,
                                           session_id, stream_id, reason, frames)
            finally:
                ffi.release(view)
    return ScanResult(end, _REASONS[reason[0]], frames[0], size)


def sync_directory(directory: Path) -> None:
    """fsync ``directory``: the names made or removed in it are durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
