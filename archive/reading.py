"""Reading recordings: segment files mapped read-only, the frames at a position, the time
index, and :class:`RecordingReader`, the local reader (Aeron Archive's ``RecordingReader``).

A segment holds whole terms laid out as in the log (:mod:`.segments`), so the term that holds
position ``p`` starts at segment offset ``p - p % term_length - base``, and the log's C scans
(``ss_term_read``, ``ss_gather_messages``, ``ss_append_block``) read it in place from the
mapping.  A mapping covers the file as long as it was when mapped (pages past a file's end
fault): a reader remaps a segment when the position it may read passes the mapping's end,
and never asks the C scans for more than it mapped.

**Never past the recorded position.**  What a reader may read is the recorded position: the
stop position of a stopped recording, else its ``RECORDING_POSITION`` counter in the
driver's counters file (docs/ARCHIVE.md, "Recording positions as counters"), which the
archive moves only past whole frames it wrote.  Bytes past it are not read, even where the
file already holds them.

**The time index.**  The service appends ``(epoch ms, recorded position)`` to
``<recording id>.tix`` (16 bytes, little-endian int64 pairs) as the position moves, at most
every :data:`TIME_INDEX_INTERVAL_MS`.  :func:`position_at_time` answers "from time T": the
last entry at or before T, so that no message recorded at or after T is left out and at most
one interval's earlier messages come too.  A recording's start is its first entry implicitly
(``start_time_ms``, ``start_position``).
"""

from __future__ import annotations

import array
import bisect
import hashlib
import mmap
import os
import struct
import sys
from pathlib import Path
from typing import Final

from slipstream.archive.catalog import (
    CATALOG_FILE,
    DESCRIPTOR_LENGTH,
    HEADER_LENGTH,
    NULL_POSITION,
    CatalogError,
    RecordingDescriptor,
    RecordingState,
)
from slipstream.archive.segments import segment_base, segment_file_name
from slipstream.client import _fastpath, retention
from slipstream.client._native import ffi, lib
from slipstream.client.closing import ClosedOnExit
from slipstream.client.control import COUNTERS_FILE
from slipstream.client.counters import CounterReader, CountersFile, CounterType
from slipstream.client.errors import SlipstreamError
from slipstream.client.image import gather_scanned
from slipstream.client.layout import (
    BEGIN_FLAG,
    DATA_HEADER,
    END_FLAG,
    FRAME_ALIGNMENT,
    HDR_TYPE_DATA,
    HDR_TYPE_PAD,
    UNFRAGMENTED,
)
from slipstream.client.layout import (
    HEADER_LENGTH as FRAME_HEADER_LENGTH,
)
from slipstream.client.logbuffer import OfOneLog
from slipstream.client.mapping import unmap
from slipstream.client.messages import FragmentHandler, GatheredMessages, Header
from slipstream.client.retention import TermAt

__all__ = [
    "TIME_INDEX_INTERVAL_MS",
    "RecordingLostError",
    "RecordingReader",
    "SegmentMap",
    "Segments",
    "TimeIndexWriter",
    "archive_identity",
    "first_message_start",
    "first_recorded_message",
    "frame_at",
    "indexed_position",
    "live_positions",
    "message_end",
    "position_at_time",
    "read_descriptor",
    "recording_position_key",
    "stop_message_start",
    "time_index_path",
]

#: How often at most the service adds a time index entry for a recording, ms: the resolution
#: of a replay "from time T" (at most this much earlier comes too).
TIME_INDEX_INTERVAL_MS: Final = 100
_TIME_ENTRY: Final = struct.Struct("<qq")  # epoch ms, recorded position
TIME_INDEX_SUFFIX: Final = ".tix"
_MAX_SCAN: Final = 4096  # frames per C scan (as the image's)


class RecordingLostError(SlipstreamError):
    """The archive does not hold (part of) a range: ``held`` is the ``(start, stop)`` it holds
    (stop -1 while the recording is live: up to its recorded position)."""

    def __init__(self, message: str, held: tuple[int, int]) -> None:
        super().__init__(message)
        self.held = held


def archive_identity(directory: str | os.PathLike[str]) -> bytes:
    """Which archive a counter is of: 8 bytes of the BLAKE2b digest of its directory's
    resolved path (two archives may be clients of one driver, each with a recording 0)."""
    path = str(Path(directory).resolve())
    return hashlib.blake2b(path.encode(), digest_size=8).digest()


def recording_position_key(recording_id: int, session_id: int, stream_id: int,
                           directory: str | os.PathLike[str]) -> bytes:
    """The key of a recording's position counter (type ``RECORDING_POSITION``): recording
    id (int64), session id and stream id (int32), little-endian, then the archive's
    :func:`archive_identity` (``directory``: its archive directory), as a reader finds it
    with ``CountersFile.find(CounterType.RECORDING_POSITION, key)``."""
    return struct.pack("<qii", recording_id, session_id, stream_id) + \
        archive_identity(directory)


def read_descriptor(directory: Path, recording_id: int) -> RecordingDescriptor | None:
    """Recording ``recording_id``'s descriptor as the catalog in ``directory`` holds it now
    (one ``pread``: the service updates it in place), or None when there is none whole."""
    fd = os.open(Path(directory) / CATALOG_FILE, os.O_RDONLY | os.O_CLOEXEC)
    try:
        data = os.pread(fd, DESCRIPTOR_LENGTH, HEADER_LENGTH + recording_id * DESCRIPTOR_LENGTH)
    finally:
        os.close(fd)
    if recording_id < 0 or len(data) < DESCRIPTOR_LENGTH:
        return None
    descriptor = RecordingDescriptor.decode(data)
    if descriptor is None or descriptor.recording_id != recording_id:
        return None
    return descriptor


def live_positions(driver_dir: Path, directory: str | os.PathLike[str]) -> dict[int, int]:
    """The recorded positions of the live recordings of the archive at ``directory`` whose
    counters are in the counters file of the driver at ``driver_dir``, by recording id (for
    ``list`` and ``describe``); empty when there is no driver there."""
    try:
        counters = CountersFile(Path(driver_dir) / COUNTERS_FILE, writable=False)
    except (OSError, ValueError):
        return {}
    identity = archive_identity(directory)
    try:
        return {struct.unpack_from("<q", info.key)[0]: info.value for info in counters
                if info.type_id == CounterType.RECORDING_POSITION and len(info.key) == 24
                and info.key[16:] == identity}
    finally:
        counters.close()


# -- the time index --------------------------------------------------------------------------
def time_index_path(directory: Path, recording_id: int) -> Path:
    return Path(directory) / f"{recording_id}{TIME_INDEX_SUFFIX}"


class TimeIndexWriter:
    """Appends a recording's ``(epoch ms, recorded position)`` entries, at most one every
    :data:`TIME_INDEX_INTERVAL_MS` (the service's thread).  The service tells it the
    position as it moves and on every pass of its loop: a burst that ends between two
    entries gets one at the next interval, so a time after it finds its end."""

    def __init__(self, directory: Path, recording_id: int) -> None:
        self.path = time_index_path(directory, recording_id)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC,
                           0o640)
        self._last_ms = -TIME_INDEX_INTERVAL_MS
        self._last_position = -1

    def moved(self, now_ms: int, position: int, *, force: bool = False) -> None:
        """The recorded position is ``position`` at ``now_ms``; written when it moved since
        the last entry and the interval passed (or ``force``: the last one, at the
        recording's end)."""
        if position == self._last_position or \
                (not force and now_ms - self._last_ms < TIME_INDEX_INTERVAL_MS):
            return
        self._last_ms = now_ms
        self._last_position = position
        os.write(self._fd, _TIME_ENTRY.pack(now_ms, position))

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def indexed_position(directory: Path, descriptor: RecordingDescriptor) -> int:
    """How far ``descriptor``'s recording is recorded, as its directory alone says: a
    stopped one's stop position, a live one's last time index entry (the service writes it
    after the bytes it counts), or its start while it has none.  A frame boundary; behind a
    live recording's recorded position by at most :data:`TIME_INDEX_INTERVAL_MS` of
    recording.  One open and one ``pread`` of the index's last entry: no counters file."""
    if not descriptor.is_active:
        return descriptor.stop_position
    start = descriptor.start_position
    try:
        fd = os.open(time_index_path(directory, descriptor.recording_id),
                     os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return start
    try:
        whole = os.fstat(fd).st_size // _TIME_ENTRY.size
        if whole == 0:
            return start
        data = os.pread(fd, _TIME_ENTRY.size, (whole - 1) * _TIME_ENTRY.size)
    finally:
        os.close(fd)
    if len(data) < _TIME_ENTRY.size:
        return start
    _, position = _TIME_ENTRY.unpack(data)
    if position & (FRAME_ALIGNMENT - 1) or position < start:
        return start  # not the service's entry (a disk returns what it returns)
    return position


def position_at_time(directory: Path, descriptor: RecordingDescriptor, time_ms: int) -> int:
    """Where a replay "from ``time_ms``" (epoch ms) of ``descriptor`` begins: the recorded
    position of the last time index entry at or before ``time_ms`` (never before the
    recording's start, which retention may have moved), so that every message recorded at or
    after ``time_ms`` is there.  A frame boundary.  A time at or before the start: the start;
    after the stop: the stop.  A binary search over the entries, however many there are;
    when the entries about its answer are not in time and position order, every entry is
    looked at, and those that are not whole, go backwards, or lie outside the recording are
    ignored (the file is the archive's, but a disk returns what it returns)."""
    start = descriptor.start_position
    if time_ms <= descriptor.start_time_ms:
        return start
    if descriptor.stop_position != NULL_POSITION and descriptor.stop_time_ms != -1 and \
            time_ms >= descriptor.stop_time_ms:
        return descriptor.stop_position
    try:
        data = time_index_path(directory, descriptor.recording_id).read_bytes()
    except FileNotFoundError:
        return start
    # The entries as the service writes them (in time and position order): a binary search,
    # its answer checked against its neighbours; any doubt, and every entry is looked at.
    entries = array.array("q")
    entries.frombytes(data[:len(data) - len(data) % _TIME_ENTRY.size])
    if sys.byteorder != "little":
        entries.byteswap()
    raw_times, raw_positions = entries[0::2], entries[1::2]
    found = bisect.bisect_right(raw_times, time_ms) - 1
    if found < 0:
        return start
    near = range(max(0, found - 1), min(len(raw_times), found + 2))
    if all(raw_positions[i] >= 0 and not raw_positions[i] & (FRAME_ALIGNMENT - 1) and
           (descriptor.stop_position == NULL_POSITION or
            raw_positions[i] <= descriptor.stop_position) for i in near) and \
            all(raw_times[i] <= raw_times[i + 1] and raw_positions[i] <= raw_positions[i + 1]
                for i in near if i + 1 in near):
        return max(start, raw_positions[found])
    times: list[int] = []
    positions: list[int] = []
    for at in range(0, len(data) - _TIME_ENTRY.size + 1, _TIME_ENTRY.size):
        entry_ms, position = _TIME_ENTRY.unpack_from(data, at)
        if (times and (entry_ms < times[-1] or position < positions[-1])) or \
                position & (FRAME_ALIGNMENT - 1) or position < 0 or \
                (descriptor.stop_position != NULL_POSITION
                 and position > descriptor.stop_position):
            continue
        times.append(entry_ms)
        positions.append(position)
    found = bisect.bisect_right(times, time_ms) - 1
    if found < 0:
        return start
    return max(start, positions[found])


# -- segments --------------------------------------------------------------------------------
class SegmentMap:
    """One segment file of a recording, mapped read-only: the bytes from its base position up
    to how long the file was at :meth:`cover` (remapped as a live recording's file grows).
    ``populate``: a whole segment's pages are mapped in one go (a reader that goes through
    it); not for one that looks at a few places (a planner's question)."""

    def __init__(self, path: Path, base: int, length: int, *, populate: bool = True) -> None:
        self.path = path
        self.base = base
        self.length = length  # the segment length: a file this long is whole
        self.populate = populate
        self._fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        self._map: mmap.mmap | None = None
        self._cdata = None
        self.address = ffi.NULL
        self.view = memoryview(b"")
        #: The stream position the mapping reaches.
        self.end = base

    def cover(self, position: int) -> bool:
        """Make the mapping reach ``position`` (remapping at the file's size now); whether it
        does."""
        if position <= self.end:
            return True
        size = os.fstat(self._fd).st_size
        if self.base + size < position:
            return False
        self._release()
        flags = mmap.MAP_SHARED
        if size >= self.length and self.populate:
            # A whole segment, which no longer grows: its pages mapped in one go (a fault per
            # page otherwise, which costs a replay from the page cache a quarter of its time).
            flags |= mmap.MAP_POPULATE
        self._map = mmap.mmap(self._fd, size, flags, mmap.PROT_READ)
        # Read ahead: a replay and a reader go front to back.
        self._map.madvise(mmap.MADV_SEQUENTIAL)
        self._cdata = ffi.from_buffer("uint8_t[]", self._map)
        self.address = ffi.cast("uint8_t *", self._cdata)
        self.view = memoryview(self._map)
        self.end = self.base + size
        return True

    def term(self, term_base: int):  # -> a cffi uint8_t * at the term's first byte
        """The address of the term that starts at stream position ``term_base`` (mapped: the
        caller covered what it reads)."""
        return self.address + (term_base - self.base)

    def _release(self) -> None:
        if self._map is not None:
            self.view.release()
            unmap(self._map, self._cdata)
            self._map = None
            self._cdata = None
            self.address = ffi.NULL
            self.view = memoryview(b"")
            self.end = self.base

    def close(self) -> None:
        self._release()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class Segments:
    """The segment maps of one recording as a reader moves through it: the one that holds a
    position, opened when first needed, the one before let go (``populate``: as
    :class:`SegmentMap`'s)."""

    def __init__(self, directory: Path, descriptor: RecordingDescriptor, *,
                 populate: bool = True) -> None:
        self.directory = Path(directory)
        self.descriptor = descriptor
        self.populate = populate
        self._current: SegmentMap | None = None

    def at(self, position: int, reach: int) -> SegmentMap:
        """The mapped segment that holds ``position``, covering up to ``reach`` (within the
        segment).  Raises :class:`RecordingLostError` when its file is not there (retention
        removed it, or it was never written)."""
        d = self.descriptor
        base = segment_base(d.start_position, position, d.term_length, d.segment_length)
        segment = self._current
        if segment is None or segment.base != base:
            if segment is not None:
                segment.close()
                self._current = None
            path = self.directory / segment_file_name(d.recording_id, base)
            try:
                segment = SegmentMap(path, base, d.segment_length, populate=self.populate)
            except FileNotFoundError:
                raise RecordingLostError(
                    f"recording {d.recording_id}: no segment file {path.name} for position "
                    f"{position} (retention removed it, or it was never written)",
                    (d.start_position, d.stop_position)) from None
            self._current = segment
        if not segment.cover(min(reach, base + d.segment_length)):
            raise RecordingLostError(
                f"recording {d.recording_id}: segment {segment.path.name} ends before "
                f"position {reach}, which the catalog says was recorded",
                (d.start_position, d.stop_position))
        return segment

    def close(self) -> None:
        if self._current is not None:
            self._current.close()
            self._current = None


def frame_at(segment: SegmentMap, position: int, descriptor: RecordingDescriptor
             ) -> tuple[int, int, int] | None:
    """``(frame length, flags, type)`` of the frame that begins at ``position`` (mapped), or
    None when none of this recording begins there (checked: term offset, term id, session,
    stream, a length within the term)."""
    term_length = descriptor.term_length
    at = position - segment.base
    if position & (FRAME_ALIGNMENT - 1) or at < 0 or at + FRAME_HEADER_LENGTH > len(segment.view):
        return None
    (length, _, flags, frame_type, term_offset, session, stream, term_id,
     _) = DATA_HEADER.unpack_from(segment.view, at)
    expected_term = descriptor.initial_term_id + (position - position % term_length) \
        // term_length
    expected_term = (expected_term + 2**31) % 2**32 - 2**31  # int32 wrap, as term ids do
    offset = position % term_length
    if length < FRAME_HEADER_LENGTH or length > term_length - offset or \
            term_offset != offset or term_id != expected_term or \
            session != descriptor.session_id or stream != descriptor.stream_id or \
            frame_type not in (HDR_TYPE_DATA, HDR_TYPE_PAD):
        return None
    return length, flags, frame_type


def _recording_terms(segments: Segments, term_length: int) -> TermAt:
    """A recording's terms as a :data:`~slipstream.client.retention.TermAt`, through its
    mapped ``segments`` (raises :class:`RecordingLostError` where a segment is not there)."""
    return lambda position, scan_end: segments.at(position, scan_end).term(
        position - position % term_length)


def stop_message_start(directory: Path, descriptor: RecordingDescriptor, position: int) -> int:
    """Where the message that the recording's stop ``position`` cuts begins (``position``
    itself when it is a message boundary, or when the recording does not hold the
    message's first fragment): :func:`~slipstream.client.retention.cut_message_start` over
    the segment files."""
    segments = Segments(directory, descriptor, populate=False)
    try:
        return retention.cut_message_start(
            _recording_terms(segments, descriptor.term_length), descriptor.term_length,
            descriptor.start_position, position)
    except RecordingLostError:
        return position
    finally:
        segments.close()


def first_recorded_message(directory: Path, descriptor: RecordingDescriptor, position: int,
                  recorded: int) -> tuple[int | None, int | None]:
    """``(begins, data)`` of :func:`~slipstream.client.retention.first_message` over the
    frames the recording holds from the frame boundary ``position`` up to ``recorded``: where
    the first message that begins there does and where the first data frame is (None: none
    held, yet)."""
    segments = Segments(directory, descriptor, populate=False)
    try:
        return retention.first_message(_recording_terms(segments, descriptor.term_length),
                                       descriptor.term_length, position, recorded)
    except RecordingLostError:
        return None, None
    finally:
        segments.close()


def first_message_start(directory: Path, descriptor: RecordingDescriptor, position: int,
                        recorded: int) -> int | None:
    """Where the first message that begins at or after ``position`` does, among the frames
    the recording holds up to ``recorded``; None when it holds no such frame (yet)."""
    return first_recorded_message(directory, descriptor, position, recorded)[0]


def message_end(directory: Path, descriptor: RecordingDescriptor, position: int,
                recorded: int) -> int:
    """Where the first message that begins at or after ``position`` does (``position``
    itself when it is a boundary, or when the recording does not yet hold such a frame, up
    to ``recorded``)."""
    found = first_message_start(directory, descriptor, position, recorded)
    return position if found is None else found


# -- the local reader ------------------------------------------------------------------------
class RecordingReader(ClosedOnExit, OfOneLog):
    """Reads a recording's messages from its segment files on the archive's own host, mapped
    read-only, with the log's C scan: :meth:`poll` and :meth:`poll_gathered` as a replay's
    image has them (messages with their stream positions, fragments assembled), no network.

    ``recording``: its id (its descriptor read from the catalog), or its descriptor as the
    caller read the catalog.  ``[start, end)``: ``start`` a frame boundary (default the
    recording's start), ``end`` None to follow a live recording until it stops (or a
    position).  It never reads past the recorded position: a stopped recording's stop
    position; for a live one, ``recorded`` (a position the caller knows was recorded:
    :func:`indexed_position`, or what the archive answered) when given, else the
    ``RECORDING_POSITION`` counter of the archive's driver at ``driver_dir``.  Raises
    :class:`RecordingLostError` when ``start`` is not held (before the start retention
    moved, or past what was recorded).  One thread; :meth:`close` when done.
    """

    def __init__(self, directory: str | os.PathLike[str],
                 recording: int | RecordingDescriptor, *,
                 start: int | None = None, end: int | None = None,
                 driver_dir: str | os.PathLike[str] | None = None,
                 recorded: int | None = None) -> None:
        self.directory = Path(directory)
        if isinstance(recording, RecordingDescriptor):
            descriptor: RecordingDescriptor | None = recording
            recording_id = recording.recording_id
        else:
            recording_id = recording
            if not (self.directory / CATALOG_FILE).exists():
                raise CatalogError(f"no archive catalog in {self.directory} ({CATALOG_FILE})")
            descriptor = read_descriptor(self.directory, recording_id)
        if descriptor is None or descriptor.state != RecordingState.VALID:
            raise KeyError(f"no recording {recording_id} in {self.directory / CATALOG_FILE}")
        self.descriptor = descriptor
        self.recording_id = recording_id
        self.identity = descriptor.identity  # its fields are this reader's attributes too
        self._counters: CountersFile | None = None
        self._counter: CounterReader | None = None
        self._known = descriptor.start_position if recorded is None else recorded
        if descriptor.is_active and recorded is None:
            if driver_dir is None:
                raise ValueError(f"recording {recording_id} is live: a reader needs the "
                                 f"archive's driver directory (driver_dir) to follow its "
                                 f"recorded position, or a position known recorded")
            self._counters = CountersFile(Path(driver_dir) / COUNTERS_FILE, writable=False)
        self.start = descriptor.start_position if start is None else start
        self.end = end
        self._limit = descriptor.start_position  # how far it may read, as last known
        self._limit = self._recorded()
        held_to = descriptor.stop_position
        if self.start < descriptor.start_position or self.start > self._limit or \
                (end is not None and end < self.start) or self.start & (FRAME_ALIGNMENT - 1):
            self.close()
            raise RecordingLostError(
                f"recording {recording_id} holds [{descriptor.start_position}, "
                f"{held_to if held_to != NULL_POSITION else self._limit}): no frame boundary "
                f"{self.start} there to read from", (descriptor.start_position, held_to))
        self.position = self.start
        self._segments = Segments(self.directory, descriptor)
        if self.start < self._limit and self.start != descriptor.start_position:
            try:  # a start inside a frame would read payload bytes as headers
                segment = self._segments.at(self.start, self.start + FRAME_ALIGNMENT)
                inside = frame_at(segment, self.start, descriptor) is None
            except RecordingLostError:
                self.close()
                raise
            if inside:
                self.close()
                raise RecordingLostError(
                    f"recording {recording_id}: no frame begins at {self.start} (it lies "
                    f"inside a frame): start at a message's position",
                    (descriptor.start_position, held_to))
        self._starts = ffi.new("int32_t[]", _MAX_SCAN)
        self._ends = ffi.new("int32_t[]", _MAX_SCAN)
        self._starts_address = int(ffi.cast("uintptr_t", self._starts))
        self._ends_address = int(ffi.cast("uintptr_t", self._ends))
        self._next_offset = ffi.new("int32_t *")
        self._header = Header(self)  # type: ignore[arg-type]  # reads session and stream ids
        self._assembly: bytearray | None = None

    # -- how far it may read ---------------------------------------------------------------
    def _recorded(self) -> int:
        """The recorded position now: the stop position once stopped, else the counter's
        (or the last known, while the counter is not found yet)."""
        d = self.descriptor
        if not d.is_active:
            return d.stop_position
        if self._counters is None:  # a live recording read up to a position known recorded
            return max(self._limit, self._known)
        if self._counter is None or not self._counter.is_allocated:
            fresh = read_descriptor(self.directory, self.recording_id)
            if fresh is not None:
                self.descriptor = d = fresh
            if not d.is_active:
                self._release_counters()
                return d.stop_position
            assert self._counters is not None
            info = self._counters.find(CounterType.RECORDING_POSITION, recording_position_key(
                d.recording_id, d.session_id, d.stream_id, self.directory))
            if info is None:  # not added yet (or the archive is not running): as known
                return self._limit
            self._counter = self._counters.reader(info.counter_id, info.registration_id)
        value = self._counter.get()
        if not self._counter.is_allocated:  # freed under the read: the catalog says more
            self._counter = None
            return self._recorded()
        return max(value, self._limit)

    def _release_counters(self) -> None:
        self._counter = None
        if self._counters is not None:
            self._counters.close()
            self._counters = None

    @property
    def recorded_position(self) -> int:
        """How far the recording is recorded (what this reader may read up to)."""
        self._limit = self._recorded()
        return self._limit

    @property
    def at_message_boundary(self) -> bool:
        """Whether the position is a message boundary: not inside a fragmented message whose
        first fragments it read (as :attr:`Image.at_message_boundary`)."""
        return self._assembly is None

    @property
    def done(self) -> bool:
        """Read to ``end``, or to the stop of a recording that stopped."""
        if self.end is not None and self.position >= self.end:
            return True
        return not self.descriptor.is_active and self.position >= self.descriptor.stop_position

    def _bound(self) -> int:
        """How far this read may go: ``end``, the recorded position, the term's end."""
        if self.position >= self._limit:
            self._limit = self._recorded()
        limit = self._limit if self.end is None else min(self._limit, self.end)
        term_end = self.position - self.position % self.term_length + self.term_length
        return min(limit, term_end)

    # -- reading ---------------------------------------------------------------------------
    def poll(self, handler: FragmentHandler, fragment_limit: int = 256) -> int:
        """Deliver up to ``fragment_limit`` fragments' messages to ``handler(data, header)``
        (``header.position``: the stream position after the message, as the image's); returns
        how many messages were delivered.  The views are valid during the call only."""
        bound = self._bound()
        position = self.position
        if position >= bound:
            return 0
        term_base = position - position % self.term_length
        segment = self._segments.at(position, bound)
        offset = position - term_base
        count = lib.ss_term_read(segment.term(term_base), offset, bound - term_base,
                                 min(fragment_limit, _MAX_SCAN), self._starts, self._ends,
                                 self._next_offset)
        if count < 0 or (count == 0 and self._assembly is not None):
            return self._fragments(segment, handler, fragment_limit, bound)
        next_offset = self._next_offset[0]
        if count:
            if self._assembly is not None:  # a message left unfinished: never whole
                self._assembly = None
            header = self._header
            term = segment.view[term_base - segment.base:]
            header._term = term
            header._term_base = term_base
            try:
                _fastpath.dispatch(handler, header, term, self._starts_address,
                                   self._ends_address, count)
            except BaseException:
                failed = self._ends[_fastpath.failed_index()]
                self.position = term_base + ((failed + FRAME_ALIGNMENT - 1) & -FRAME_ALIGNMENT)
                raise
        self.position = term_base + next_offset
        return count

    def _fragments(self, segment: SegmentMap, handler: FragmentHandler | None, limit: int,
                   bound: int, gathered: list[tuple[bytes, int, int]] | None = None) -> int:
        """The cold path: fragments assembled into whole messages (at most one delivered per
        call when ``gathered`` collects them); stops at an unfragmented frame."""
        delivered = 0
        header = self._header
        for _ in range(limit):
            position = self.position
            if position >= bound:
                break
            frame = frame_at(segment, position, self.descriptor)
            if frame is None:
                break
            length, flags, frame_type = frame
            if frame_type == HDR_TYPE_DATA and flags == UNFRAGMENTED:
                self._assembly = None
                break
            self.position = position + ((length + FRAME_ALIGNMENT - 1) & -FRAME_ALIGNMENT)
            if frame_type == HDR_TYPE_PAD:
                self._assembly = None
                continue
            at = position - segment.base
            payload = segment.view[at + FRAME_HEADER_LENGTH:at + length]
            if flags & BEGIN_FLAG:
                self._assembly = bytearray(payload)
            elif self._assembly is not None:
                self._assembly += payload
            else:
                continue  # a middle fragment of a message begun before the start: dropped
            if flags & END_FLAG:
                message, self._assembly = self._assembly, None
                delivered += 1
                if gathered is not None:
                    reserved = DATA_HEADER.unpack_from(segment.view, at)[8]
                    gathered.append((bytes(message), self.position, reserved))
                    break
                term_base = position - position % self.term_length
                header._term = segment.view[term_base - segment.base:]
                header._term_base = term_base
                header._payload = position - term_base + FRAME_HEADER_LENGTH
                view = memoryview(message)
                try:
                    assert handler is not None
                    handler(view, header)
                finally:
                    view.release()
        return delivered

    def poll_gathered(self, max_messages: int = 4096) -> GatheredMessages | None:
        """Up to ``max_messages`` whole messages copied out in one C pass
        (:class:`~slipstream.client.messages.GatheredMessages`: payloads, positions, reserved
        values), or None when none is there now.  A fragmented message comes alone."""
        bound = self._bound()
        position = self.position
        if position >= bound:
            return None
        term_base = position - position % self.term_length
        segment = self._segments.at(position, bound)
        offset = position - term_base
        term = segment.term(term_base)
        count = lib.ss_term_read(term, offset, bound - term_base, min(max_messages, _MAX_SCAN),
                                 self._starts, self._ends, self._next_offset)
        if count < 0 or (count == 0 and self._assembly is not None):
            got: list[tuple[bytes, int, int]] = []
            self._fragments(segment, None, 1 << 30, bound, got)
            if not got:
                return None
            return GatheredMessages.one(*got[0], self.session_id)
        next_offset = self._next_offset[0]
        if count == 0:
            if next_offset == offset:
                return None
            self.position = term_base + next_offset  # padding: on into the next term
            return self.poll_gathered(max_messages)
        self._assembly = None
        gathered = gather_scanned(term, bound - term_base, term_base, self._starts, self._ends,
                                  count, self.session_id)
        if gathered is None:
            raise SlipstreamError(f"recording {self.recording_id}: a scan of segment "
                                  f"{segment.path.name} gave frame bounds outside its term")
        self.position = term_base + next_offset
        return gathered

    def close(self) -> None:
        segments = getattr(self, "_segments", None)
        if segments is not None:
            segments.close()
        self._release_counters()
