"""The log buffer: three terms and a metadata page in one mapped file (docs/PROTOCOL.md §2).

``[term 0][term 1][term 2][metadata 4096 B]``, file length ``align(3 * term_length + 4096,
page_size)``.  The driver creates log files; publishers append to them and subscribers read
them in place.  The hot paths (append, scan, rebuild) are in C (``native_*.c``, one file per
piece); this module holds the position arithmetic and the Python view that the driver, tests
and tools use.  The layout (offsets, lengths, limits) is :mod:`~slipstream.client.layout`'s.

Positions are byte offsets in the stream: ``position = term_count << bits | term_offset`` with
``term_count = term_id - initial_term_id`` (32-bit wrap-around) and ``bits = log2(term_length)``.
"""

from __future__ import annotations

import copy
import errno
import operator
import os
import struct
import threading
from pathlib import Path
from typing import Any

import attrs

from slipstream.client import control
from slipstream.client._native import ffi, lib
from slipstream.client.layout import (
    CURRENT_VERSION,
    DATA_HEADER,
    FRAME_ALIGNMENT,
    HDR_TYPE_DATA,
    HDR_TYPE_PAD,
    HEADER_LENGTH,
    INT64_MAX,
    LOG_META_DATA_LENGTH,
    MAX_UDP_PAYLOAD_LENGTH,
    META_ACTIVE_TERM_COUNT,
    META_CORRELATION_ID,
    META_DEFAULT_FRAME_HEADER,
    META_DRIVER_WAITERS,
    META_DRIVER_WAKE_POSITION,
    META_DURABLE_SIGNAL,
    META_DURABLE_WAITERS,
    META_END_OF_STREAM_POSITION,
    META_FLAGS,
    META_INITIAL_TERM_ID,
    META_IS_CONNECTED,
    META_LIMIT_HIT_POSITION,
    META_LIMIT_HIT_TIME,
    META_LIMIT_MOVED_TIME,
    META_LINGER_TIMEOUT_NS,
    META_MTU_LENGTH,
    META_PUBLISHER_SIGNAL,
    META_PUBLISHER_WAITERS,
    META_READER_SIGNAL,
    META_READER_WAITERS,
    META_TAIL_COUNTERS,
    META_TERM_LENGTH,
    PAGE_MIN_SIZE,
    PARTITION_COUNT,
    SESSION_ID_FIELD,
    STREAM_ID_FIELD,
    TERM_MAX_LENGTH,
    TERM_MIN_LENGTH,
    UNFRAGMENTED,
    VERSION_FIELD,
    align,
    max_message_length,
)
from slipstream.client.mapping import map_shared, unmap

#: Bytes :meth:`LogBuffer.populate_step` maps in place at most (the C half's step, 4 MiB:
#: 0.3-1.3 ms here), so that a thread that maps a log behind its hand-over soon sees other
#: work (its events, the next log to make), and a close waits at most that long.
POPULATE_STEP: int = lib.SS_POPULATE_STEP

#: A PAD header but its frame length, which goes last (version .. term_id).
_PAD_AFTER_LENGTH = struct.Struct("<" + DATA_HEADER.format[2:-1])


def check_term_length(term_length: int) -> None:
    """Raise ``ValueError`` unless 64 KiB ≤ term_length ≤ 1 GiB and a power of two."""
    if not (TERM_MIN_LENGTH <= term_length <= TERM_MAX_LENGTH) or term_length & (term_length - 1):
        raise ValueError(
            f"term length {term_length} is not a power of two between 64 KiB and 1 GiB"
        )


def check_page_size(page_size: int) -> None:
    """Raise ``ValueError`` unless 4 KiB ≤ page_size ≤ 1 GiB and a power of two."""
    if not (PAGE_MIN_SIZE <= page_size <= TERM_MAX_LENGTH) or page_size & (page_size - 1):
        raise ValueError(f"page size {page_size} is not a power of two between 4 KiB and 1 GiB")


def check_mtu(mtu: int) -> None:
    """Raise ``ValueError`` unless the MTU is a multiple of 32 in 64..65504 bytes."""
    if not (2 * HEADER_LENGTH <= mtu <= MAX_UDP_PAYLOAD_LENGTH) or mtu % FRAME_ALIGNMENT:
        raise ValueError(f"mtu {mtu} is not a multiple of 32 between 64 and 65504")


def compute_log_length(term_length: int, page_size: int = PAGE_MIN_SIZE) -> int:
    """File length of a log with three terms of ``term_length`` bytes."""
    return align(PARTITION_COUNT * term_length + LOG_META_DATA_LENGTH, page_size)


def term_length_of_file(file_length: int) -> int:
    """The term length of a log file ``file_length`` bytes long (at least a log of the
    shortest terms): ``file_length = align(3T + 4096, page)`` with page <= T, so T is the power
    of two at or below (L - 4096) / 3."""
    return 1 << (((file_length - LOG_META_DATA_LENGTH) // PARTITION_COUNT).bit_length() - 1)


def resident_ranges(fd: int, length: int) -> list[tuple[int, int]]:
    """``[start, end)`` of every range of the first ``length`` bytes of ``fd``'s file that
    holds pages (``SEEK_DATA``/``SEEK_HOLE``: page-aligned on tmpfs), in order; the whole
    file where the filesystem cannot tell."""
    ranges = []
    position = 0
    while position < length:
        try:
            start = os.lseek(fd, position, os.SEEK_DATA)
        except OSError as e:
            if e.errno == errno.ENXIO:  # only a hole is left
                break
            return [(0, length)]
        end = min(os.lseek(fd, start, os.SEEK_HOLE), length)
        if start >= end:
            break
        ranges.append((start, end))
        position = end
    return ranges


def position_bits_to_shift(term_length: int) -> int:
    """log2(term_length)."""
    return term_length.bit_length() - 1


def max_possible_position(term_length: int) -> int:
    """Positions stop at term_length * 2^31; offers beyond return MAX_POSITION_EXCEEDED."""
    return term_length << 31


def _i32(value: int) -> int:
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value & 0x80000000 else value


def term_count(term_id: int, initial_term_id: int) -> int:
    """Terms from ``initial_term_id`` to ``term_id`` (32-bit wrap-around; negative: before)."""
    return _i32(term_id - initial_term_id)


def compute_position(term_id: int, term_offset: int, bits: int, initial_term_id: int) -> int:
    """Stream position of ``term_offset`` in ``term_id``."""
    return (term_count(term_id, initial_term_id) << bits) + term_offset


def compute_term_id(position: int, bits: int, initial_term_id: int) -> int:
    """Term id holding ``position``."""
    return _i32((position >> bits) + initial_term_id)


def compute_term_offset(position: int, term_length: int) -> int:
    """Offset of ``position`` within its term."""
    return position & (term_length - 1)


def index_by_position(position: int, bits: int) -> int:
    """Partition index (0..2) of the term holding ``position``."""
    return (position >> bits) % PARTITION_COUNT


def index_by_term_count(term_count: int) -> int:
    """Partition index (0..2) of the term_count-th term."""
    return term_count % PARTITION_COUNT


def pack_tail(term_id: int, term_offset: int) -> int:
    """The raw tail value: term id in the high 32 bits, the offset in the low 32."""
    raw = ((term_id & 0xFFFFFFFF) << 32) | (term_offset & 0xFFFFFFFF)
    return raw - (1 << 64) if raw & (1 << 63) else raw


def tail_term_offset(raw_tail: int, term_length: int) -> int:
    """Offset from a raw tail, capped at the term length (writers may overshoot)."""
    return min(raw_tail & 0xFFFFFFFF, term_length)


@attrs.frozen
class LogIdentity:
    """What names one log and frames its positions, as its metadata fixes them when it is
    made: the publication's session and stream (its frames' default header), its initial
    term id, term length and MTU.  A log made anew (a publication added again, even with the
    same ``session-id``) has another initial term id, unless ``init-term-id`` pins it."""

    session_id: int
    initial_term_id: int
    term_length: int
    stream_id: int = attrs.field(kw_only=True)
    #: The most bytes of one frame (header included) its publisher sends.
    mtu: int = attrs.field(kw_only=True)

    @property
    def framing(self) -> tuple[int, int]:
        """``(initial term id, term length)``: what tells one log of a session from another.
        Offsets and calls that name the session already carry it as the JSON list ``"log":
        [initial_term_id, term_length]``."""
        return self.initial_term_id, self.term_length

    @property
    def position_bits(self) -> int:
        """The shift of a term id in a position: log2 of the term length."""
        return position_bits_to_shift(self.term_length)

    def describe(self) -> str:
        """The framing in words, for messages that compare two logs."""
        return f"initial term id {self.initial_term_id} and term length {self.term_length}"

    def copy_into(self, c: Any) -> None:
        """Set the fields of it that ``c``, a C hot path's struct of the log, carries (cffi:
        an ``ss_appender_t``, ``ss_image_t`` or ``ss_send_publication_t *``)."""
        c.session_id = self.session_id
        c.stream_id = self.stream_id
        c.initial_term_id = self.initial_term_id
        c.term_length = self.term_length
        c.position_bits = self.position_bits


class _IdentityField:
    """A read-only attribute of an :class:`OfOneLog`: the field of the same name of its
    ``identity``."""

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name
        self._read = operator.attrgetter(f"identity.{name}")

    def __get__(self, instance: object, owner: type | None = None) -> int:
        if instance is None:
            return self  # type: ignore[return-value]  # the class's: the descriptor itself
        return self._read(instance)

    def __set__(self, instance: object, value: int) -> None:
        raise AttributeError(f"{self._name} is the log identity's: read-only")


class OfOneLog:
    """An object of one log, whose :class:`LogIdentity` is ``identity``: its fields are the
    object's own read-only attributes."""

    identity: LogIdentity
    session_id = _IdentityField()
    stream_id = _IdentityField()
    initial_term_id = _IdentityField()
    term_length = _IdentityField()
    mtu = _IdentityField()


class LogBuffer(OfOneLog):
    """A mapped log file: term views, metadata access and atomic operations on it.

    The mapping stays valid until :meth:`close`; ``address`` is a cffi ``uint8_t *`` to the
    start of term 0 that the C hot paths use.  Closing fails softly while views are exported
    (a handler that kept a message view); the mapping is then released with the last view.
    """

    def __init__(self, path: str | os.PathLike[str], *, writable: bool = True,
                 populate: bool | None = None, behind: bool = False) -> None:
        """Map the log at ``path``.  ``populate`` maps every page in place up front (default:
        when the log is not sparse), so the hot paths never take a page fault.  A view of a
        sparse log (``populate`` None: a publisher's, a subscriber's image, the driver's of
        an image) still has the pages the file holds already mapped in place (none in a new
        file; those of a released log's file the driver reused for it, or of a live log
        written so far), on the thread that maps it, where its writer or reader would
        otherwise take a fault for each 4 KiB written or 64 KiB read.

        ``behind``: those pages are not mapped now but by :meth:`populate_step`, which a
        thread of the process calls after the log is handed out (the active term first):
        the log's first message need not wait for the 5-15 ms that mapping 48 MiB in place
        takes, and a reader or writer ahead of that thread takes the faults itself."""
        self.path = Path(path)
        self._borrowed = False  # a handle on another LogBuffer's mapping (see borrowed())
        #: What is left to map in place (``behind``): ``(start, end, writable)`` byte ranges
        #: of the mapping, in the order they are mapped; guarded by ``_populating``, which
        #: :meth:`close` takes too, so that no step maps a range once the log is unmapped.
        self._unpopulated: list[tuple[int, int, int]] = []
        self._populating = threading.Lock()
        fd = os.open(self.path, os.O_RDWR if writable else os.O_RDONLY)
        try:
            length = os.fstat(fd).st_size
            self._map = map_shared(fd, length, writable=writable)
            resident = resident_ranges(fd, length) if populate is None else []
        finally:
            os.close(fd)
        self.length = length
        self._cdata = ffi.from_buffer("uint8_t[]", self._map, require_writable=writable)
        self.address = ffi.cast("uint8_t *", self._cdata)
        self.view = memoryview(self._map)
        term_length = term_length_of_file(length)
        recorded = struct.unpack_from("<i", self._map, PARTITION_COUNT * term_length
                                      + META_TERM_LENGTH)[0]
        if recorded != term_length:
            raise ValueError(f"{self.path} is not an initialised log buffer "
                             f"(term length {recorded}, file length {length})")
        self.meta_offset = PARTITION_COUNT * term_length
        self.meta = self.address + self.meta_offset
        self.identity = LogIdentity(
            self.default_header_field("<i", SESSION_ID_FIELD),
            self._get_i32(META_INITIAL_TERM_ID), term_length,
            stream_id=self.default_header_field("<i", STREAM_ID_FIELD),
            mtu=self._get_i32(META_MTU_LENGTH))
        self.position_bits = position_bits_to_shift(term_length)
        self.max_message_length = max_message_length(term_length)
        self.max_payload = self.mtu - HEADER_LENGTH
        if populate if populate is not None else not self.is_sparse:
            ranges = [(0, self.length, int(writable))]
        else:
            # Mapped for reading: the file's own pages, written before, are mapped 16 to a
            # fault (fault-around) where a write populate takes a fault a page (64 MB: 1k
            # faults, 2 ms, against 16k, 5-10 ms).  The entries are writable on tmpfs (a
            # shared mapping of it needs no write notice), so the writes take no fault.
            ranges = [(start, end, 0) for start, end in resident]
        if behind:
            # The active term is where the log is written and read first.
            first = index_by_term_count(self.active_term_count) * term_length
            self._unpopulated = ([(max(start, first), end, w) for start, end, w in ranges
                                  if end > first]
                                 + [(start, min(end, first), w) for start, end, w in ranges
                                    if start < first])
        else:
            for start, end, w in ranges:
                lib.ss_populate(self.address + start, end - start, w)

    # -- creation -------------------------------------------------------------------------
    @classmethod
    def create(
        cls,
        path: str | os.PathLike[str],
        *,
        term_length: int,
        initial_term_id: int,
        session_id: int,
        stream_id: int,
        mtu: int,
        correlation_id: int,
        page_size: int = PAGE_MIN_SIZE,
        term_window_length: int = 0,
        receiver_window_length: int = 0,
        initial_term_count: int = 0,
        initial_term_offset: int = 0,
        linger_timeout_ns: int = 0,
        group: bool = False,
        reliable: bool = True,
        signal_eos: bool = True,
        tether: bool = True,
        sparse: bool = True,
        populate: bool | None = None,
        mode: int = 0o600,
        reused: bool = False,
        behind: bool = False,
    ) -> LogBuffer:
        """Create and initialise a log file (the driver's job, with ``mode``:
        :func:`control.file_mode`) and map it (``populate`` and ``behind``: as for the
        constructor).  A failure leaves no file behind.

        ``reused``: the file exists at ``path`` already, of this log's length and every byte
        zero (a released log the driver's pool handed out): it is initialised in place.

        ``initial_term_count``/``initial_term_offset`` start the stream at a non-zero position
        (URI ``init-term-id``/``term-id``/``term-offset``, or a receiver's join position).
        """
        check_term_length(term_length)
        check_page_size(page_size)
        check_mtu(mtu)
        path = Path(path)
        length = compute_log_length(term_length, page_size)
        meta = bytearray(LOG_META_DATA_LENGTH)
        active_term_id = _i32(initial_term_id + initial_term_count)
        active_index = index_by_term_count(initial_term_count)
        for i in range(PARTITION_COUNT):
            # The active partition holds the active term; the others hold the terms that the
            # rotation expects to find there (term_id - 3 .. so the next CAS succeeds).
            if i == active_index:
                tail = pack_tail(active_term_id, initial_term_offset)
            else:
                delta = (i - active_index) % PARTITION_COUNT
                tail = pack_tail(active_term_id + delta - PARTITION_COUNT, 0)
            struct.pack_into("<q", meta, META_TAIL_COUNTERS + 8 * i, tail)
        struct.pack_into("<i", meta, META_ACTIVE_TERM_COUNT, initial_term_count)
        struct.pack_into("<q", meta, META_END_OF_STREAM_POSITION, INT64_MAX)
        struct.pack_into("<q", meta, META_CORRELATION_ID, correlation_id)
        # Seven int32s in a row: initial term id, default frame header length, mtu, term
        # length, page size, publication window, receiver window.
        struct.pack_into("<iiiiiii", meta, META_INITIAL_TERM_ID, initial_term_id, HEADER_LENGTH,
                         mtu, term_length, page_size, term_window_length, receiver_window_length)
        DATA_HEADER.pack_into(meta, META_DEFAULT_FRAME_HEADER, 0, CURRENT_VERSION, UNFRAGMENTED,
                              HDR_TYPE_DATA, 0, session_id, stream_id, initial_term_id, 0)
        struct.pack_into("<q", meta, META_LINGER_TIMEOUT_NS, linger_timeout_ns)
        struct.pack_into("8B", meta, META_FLAGS, group, False, True, reliable, sparse,
                         signal_eos, False, tether)
        if reused:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        else:
            fd = control.create_file(path, os.O_RDWR | os.O_EXCL, mode)
        try:
            if reused:
                os.fchmod(fd, mode)
                if os.fstat(fd).st_size != length:
                    raise ValueError(f"{path} is no log of {length} bytes to reuse")
            else:
                os.ftruncate(fd, length)
            # The metadata first: a driver that finds this file after a crash knows it for
            # one of its logs by it (and removes it), however far its pages were reserved.
            os.pwrite(fd, meta, PARTITION_COUNT * term_length)
            if not sparse:
                # Fails now (ENOSPC) rather than with SIGBUS on some later page.
                os.posix_fallocate(fd, 0, length)
            return cls(path, populate=populate, behind=behind)
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)

    def populate_step(self) -> bool:
        """Map up to :data:`POPULATE_STEP` bytes more of what a log mapped ``behind`` left, in
        place (Linux >= 5.14; older kernels fault lazily), in C with the GIL released;
        whether more is left.  Any thread: once the log is closed nothing is left."""
        with self._populating:
            if not self._unpopulated:
                return False
            start, end, writable = self._unpopulated[0]
            stop = min(end, start + POPULATE_STEP)
            lib.ss_populate(self.address + start, stop - start, writable)
            if stop < end:
                self._unpopulated[0] = (stop, end, writable)
            else:
                del self._unpopulated[0]
            return bool(self._unpopulated)

    @property
    def unpopulated(self) -> int:
        """Bytes a log mapped ``behind`` has still to map in place (:meth:`populate_step`)."""
        with self._populating:
            return sum(end - start for start, end, _ in self._unpopulated)

    # -- metadata --------------------------------------------------------------------------
    @property
    def is_sparse(self) -> bool:
        """Whether the log's pages are allocated on first touch (else up front)."""
        return bool(self._map[self.meta_offset + META_FLAGS + 4])

    def _get_i32(self, field: int) -> int:
        return struct.unpack_from("<i", self._map, self.meta_offset + field)[0]

    def default_header_field(self, fmt: str, field: int) -> int:
        """A field of the default frame header in the metadata."""
        return struct.unpack_from(fmt, self._map, self.meta_offset + META_DEFAULT_FRAME_HEADER
                                  + field)[0]

    def meta_i32(self, field: int) -> int:
        """Acquire-load of a 32-bit metadata field."""
        return lib.ss_load_acquire_i32(ffi.cast("int32_t *", self.meta + field))

    def meta_i64(self, field: int) -> int:
        """Acquire-load of a 64-bit metadata field."""
        return lib.ss_load_acquire_i64(ffi.cast("int64_t *", self.meta + field))

    def set_meta_i32(self, field: int, value: int) -> None:
        """Release-store of a 32-bit metadata field."""
        lib.ss_store_release_i32(ffi.cast("int32_t *", self.meta + field), value)

    def set_meta_i64(self, field: int, value: int) -> None:
        """Release-store of a 64-bit metadata field."""
        lib.ss_store_release_i64(ffi.cast("int64_t *", self.meta + field), value)

    def raw_tail(self, index: int) -> int:
        """The raw tail counter of partition ``index``."""
        return self.meta_i64(META_TAIL_COUNTERS + 8 * index)

    @property
    def active_term_count(self) -> int:
        return self.meta_i32(META_ACTIVE_TERM_COUNT)

    @property
    def is_connected(self) -> bool:
        return self.meta_i32(META_IS_CONNECTED) == 1

    @is_connected.setter
    def is_connected(self, value: bool) -> None:
        self.set_meta_i32(META_IS_CONNECTED, 1 if value else 0)

    @property
    def end_of_stream_position(self) -> int:
        return self.meta_i64(META_END_OF_STREAM_POSITION)

    @end_of_stream_position.setter
    def end_of_stream_position(self, position: int) -> None:
        self.set_meta_i64(META_END_OF_STREAM_POSITION, position)

    @property
    def reliable(self) -> bool:
        return bool(self._map[self.meta_offset + META_FLAGS + 3])

    def producer_position(self) -> int:
        """Position of the next byte a publisher would append (from the active tail)."""
        term_count = self.active_term_count
        raw = self.raw_tail(index_by_term_count(term_count))
        offset = tail_term_offset(raw, self.term_length)
        return (term_count << self.position_bits) + offset

    # -- terms and frames -------------------------------------------------------------------
    def term_address(self, index: int):  # -> cffi uint8_t *
        """cffi pointer to the start of partition ``index``."""
        return self.address + index * self.term_length

    def find_in_term(self, index: int, data: bytes, start: int, end: int) -> int:
        """The lowest offset in partition ``index``, in ``[start, end)``, where ``data`` lies
        whole, or -1: a C search of the mapping (``memmem``), not a Python step per byte.
        ``end`` past the term is taken as the term's end."""
        base = index * self.term_length
        found = self._map.find(data, base + start, base + min(end, self.term_length))
        return found - base if found >= 0 else -1

    def term_view(self, index: int) -> memoryview:
        """A writable view of partition ``index``."""
        start = index * self.term_length
        return self.view[start:start + self.term_length]

    def frame_length_volatile(self, index: int, term_offset: int) -> int:
        """Acquire-load of the frame_length at ``term_offset`` in partition ``index``."""
        ptr = self.address + index * self.term_length + term_offset
        return lib.ss_load_acquire_i32(ffi.cast("int32_t *", ptr))

    def frame_header(self, index: int, term_offset: int) -> tuple[int, ...]:
        """(frame_length, version, flags, type, term_offset, session, stream, term_id, reserved)."""
        return DATA_HEADER.unpack_from(self._map, index * self.term_length + term_offset)

    def reader_signal(self):  # -> cffi int32_t *
        """The eventcount word parked readers wait on."""
        return ffi.cast("int32_t *", self.meta + META_READER_SIGNAL)

    def reader_waiters(self):  # -> cffi int32_t *
        """The count of parked readers (writers signal only when it is non-zero)."""
        return ffi.cast("int32_t *", self.meta + META_READER_WAITERS)

    def driver_waiters(self):  # -> cffi int32_t *
        """How many of the driver's network threads are parked waiting on this log (clients
        ring the driver's doorbell only then; see native.h)."""
        return ffi.cast("int32_t *", self.meta + META_DRIVER_WAITERS)

    def set_driver_wake_position(self, position: int) -> None:
        """The subscriber position from which a parked receiver wants its doorbell rung."""
        self.set_meta_i64(META_DRIVER_WAKE_POSITION, position)

    def signal_readers(self) -> None:
        """Wake readers parked on this log (after the driver changed something they wait for)."""
        lib.ss_signal(self.reader_signal(), self.reader_waiters())

    def publisher_signal(self):  # -> cffi int32_t *
        """The eventcount word publishers waiting for credit park on."""
        return ffi.cast("int32_t *", self.meta + META_PUBLISHER_SIGNAL)

    def publisher_waiters(self):  # -> cffi int32_t *
        return ffi.cast("int32_t *", self.meta + META_PUBLISHER_WAITERS)

    def signal_durable_waiters(self) -> None:
        """Wake publishers parked for a durable position (after the driver moved
        pub-durable, or the publication closed; one load when none is parked)."""
        lib.ss_signal(ffi.cast("int32_t *", self.meta + META_DURABLE_SIGNAL),
                      ffi.cast("int32_t *", self.meta + META_DURABLE_WAITERS))

    def signal_publishers(self) -> None:
        """Wake publishers parked for credit (after the driver moved pub-lmt or
        is_connected; one load when none is parked)."""
        lib.ss_signal(self.publisher_signal(), self.publisher_waiters())

    def publish_limit(self, limit_cell, value: int) -> None:  # limit_cell: cffi int64_t *
        """Move pub-lmt (the cell) to ``value``, stamp when in the log and wake the publishers
        parked for credit."""
        lib.ss_publish_limit(limit_cell, value, self.meta)

    def limit_moved_ns(self) -> int:
        """When the driver last moved pub-lmt (CLOCK_MONOTONIC ns; 0: never)."""
        return self.meta_i64(META_LIMIT_MOVED_TIME)

    def limit_hit(self) -> tuple[int, int]:
        """(the pub-lmt a publisher last found no credit at, when: CLOCK_MONOTONIC ns); (0, 0)
        before any."""
        position = self.meta_i64(META_LIMIT_HIT_POSITION)
        return position, self.meta_i64(META_LIMIT_HIT_TIME)

    def clean(self, position: int, length: int) -> None:
        """Zero ``length`` bytes of the term holding ``position`` from its offset (one term max)."""
        index = index_by_position(position, self.position_bits)
        offset = compute_term_offset(position, self.term_length)
        length = min(length, self.term_length - offset)
        lib.ss_clean(self.address + index * self.term_length + offset, length)

    def borrowed(self) -> LogBuffer:
        """Another handle on this mapping, for a reader in the process that mapped the log
        already (the simulator's subscribers read their driver's): its :meth:`close` leaves
        the mapping to this one, which must outlive the handle's use."""
        handle = copy.copy(self)
        handle._borrowed = True
        handle._unpopulated = []  # the owner's to map
        return handle

    def close(self) -> None:
        """Unmap (softly: if a view is still exported the map goes with the last view); a
        :meth:`borrowed` handle only lets go."""
        if self._map is None:
            return
        if self._borrowed:
            self._map = None  # type: ignore[assignment]
            return
        with self._populating:  # a step under way ends first; none comes after
            self._unpopulated.clear()
            self.view.release()
            unmap(self._map, self._cdata)
            self._map = None  # type: ignore[assignment]

    @property
    def closed(self) -> bool:
        return self._map is None



def new_appender(log: LogBuffer, publication_limit):  # -> cffi ss_appender_t *
    """The C appender for ``log``, checking offers against the int64 at ``publication_limit``."""
    appender = ffi.new("ss_appender_t *")
    appender.log = log.address
    appender.meta = log.meta
    appender.publication_limit = publication_limit
    log.identity.copy_into(appender)
    appender.max_payload = log.max_payload
    appender.max_message_length = log.max_message_length
    appender.max_position = max_possible_position(log.term_length)
    appender.doorbell_fd = -1
    return appender


def write_padding(log: LogBuffer, position: int, length: int) -> None:
    """Turn ``length`` bytes at ``position`` into one PAD frame of that term.

    The header fields go first and the frame length last (release), so a reader sees either
    nothing or a complete PAD frame.
    """
    index = index_by_position(position, log.position_bits)
    term_offset = compute_term_offset(position, log.term_length)
    term_id = compute_term_id(position, log.position_bits, log.initial_term_id)
    base = index * log.term_length + term_offset
    _PAD_AFTER_LENGTH.pack_into(log.view, base + VERSION_FIELD, CURRENT_VERSION, UNFRAGMENTED,
                                HDR_TYPE_PAD, term_offset, log.session_id, log.stream_id, term_id)
    lib.ss_store_release_i32(ffi.cast("int32_t *", log.address + base), length)


def unblock(log: LogBuffer, blocked_position: int, producer_position: int) -> bool:
    """Pad over a frame that a dead publisher claimed but never committed (TermUnblocker).

    ``blocked_position`` is where consumers are stuck.  A negative frame length there is a
    claimed frame: it becomes padding of its own length.  A zero length means the claimer died
    before writing the header: the hole up to the next written frame (or the end of the term)
    becomes padding.  Returns True when something was unblocked.
    """
    if producer_position <= blocked_position:
        return False
    index = index_by_position(blocked_position, log.position_bits)
    offset = compute_term_offset(blocked_position, log.term_length)
    frame_length = log.frame_length_volatile(index, offset)
    if frame_length < 0:
        # Take the claim from its publisher first (claimed -> 0, which readers wait at), so
        # that a late commit (ss_commit: claimed -> committed) cannot land half-way through
        # the padding and publish a PAD frame: it fails, and commit() says so.
        cell = ffi.cast("int32_t *", log.address + index * log.term_length + offset)
        if not lib.ss_cas_i32(cell, frame_length, 0):
            return False  # committed (or aborted) at the last moment: nothing is blocked
        # The claim took its aligned length of the term; a PAD of that length keeps every
        # frame after it aligned for readers and for the wire (a receiver refuses a PAD whose
        # length is not).
        write_padding(log, blocked_position, align(-frame_length, FRAME_ALIGNMENT))
        return True
    if frame_length > 0:
        return False
    term_start = blocked_position - offset
    limit = min(log.term_length, producer_position - term_start)
    current = offset + FRAME_ALIGNMENT
    while current < limit:
        if log.frame_length_volatile(index, current) != 0:
            write_padding(log, blocked_position, current - offset)
            return True
        current += FRAME_ALIGNMENT
    if producer_position - term_start >= log.term_length:
        # The hole runs to the end of the term: pad it so consumers step into the next term.
        write_padding(log, blocked_position, log.term_length - offset)
        return True
    return False
