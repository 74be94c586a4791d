"""Counters: typed 64-bit positions and statistics in a shared file (docs/ARCHITECTURE.md).

Position counters are the protocol state between processes: the driver publishes the
publication limit, each subscriber publishes its position, and the driver reads those back.
The same file is what ``slipstream stat`` and the Prometheus exporter read.

Layout of ``counters.dat`` (all little-endian)::

    [header 4096 B][metadata: capacity x 256 B][values: capacity x 128 B]

Header: magic, version, capacity, driver pid, start time, the driver heartbeat (epoch ns of
its last duty cycle, which clients use to tell a live driver from a dead one) and the driver's
eventcount (signal + waiters) that a back-pressured IPC publisher uses to wake a parked driver.
Metadata per counter: state, type id, registration id, session id, stream id, owner client id
and a label.  Each value sits alone on its own 128-byte slot so that writers in different
processes never share a cache line (nor the adjacent line the prefetcher pairs with it).
"""

from __future__ import annotations

import enum
import errno
import os
import re
import struct
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, Final

import attrs

from slipstream.client import control
from slipstream.client._native import ffi, lib
from slipstream.client.mapping import map_shared, unmap

MAGIC = 0x53504C53  # "SLPS"
VERSION = 1
HEADER_LENGTH = 4096
METADATA_LENGTH = 256
VALUE_LENGTH = 128
LABEL_MAX_LENGTH = 200

# Header fields.
_MAGIC_OFFSET = 0
_VERSION_OFFSET = 4
_CAPACITY_OFFSET = 8
_PID_OFFSET = 16
_START_TIME_OFFSET = 24
HEARTBEAT_OFFSET = 128
DRIVER_SIGNAL_OFFSET = 256
DRIVER_WAITERS_OFFSET = 384

# Metadata fields.
_STATE_FREE = 0
_STATE_ALLOCATED = 1
_STATE_RECLAIMED = -1  # freed; reusable once the deadline in its registration field passes
# A process that has not yet learned its counter was freed may still write it once or twice
# (a heartbeat, a position): a freed slot waits this long before it is handed out again.
FREE_TO_REUSE_TIMEOUT_NS = 1_000_000_000
_META = struct.Struct("<iiqiiqi")  # state, type, registration, session, stream, owner, label len
_LABEL_OFFSET = _META.size
# The offsets of _META's first three fields (a client's keepalive thread reads them from C).
_STATE_OFFSET, _TYPE_OFFSET, _REGISTRATION_OFFSET = (
    struct.calcsize(_META.format[:n]) for n in (1, 2, 3))


class CounterType(enum.IntEnum):
    """What a counter measures (ids follow Aeron's where Aeron has one)."""

    SYSTEM = 0
    PUBLISHER_LIMIT = 1
    SENDER_POSITION = 2
    RECEIVER_HWM = 3
    SUBSCRIBER_POSITION = 4
    RECEIVER_POSITION = 5
    SENDER_LIMIT = 9
    PER_IMAGE_INDICATOR = 10  # an image's congestion control's state (rcv-cc-cubic-rtt, -wnd)
    CLIENT_HEARTBEAT = 11
    PUBLISHER_POSITION = 12
    FC_RECEIVERS = 17  # fc-receivers: receivers min / tagged flow control holds the sender to
    SENDER_RATE_LIMIT = 1001  # slipstream's: snd-rate, bytes/s (0: none), rc= publications
    # slipstream's, one each per publication: its back-pressure episodes (docs/BACKPRESSURE.md)
    BP_EPISODES = 1002  # bp-episodes: how many began
    BP_TIME = 1003  # bp-time: ns spent in them (the open one's time so far included)
    BP_DEPTH = 1004  # bp-depth: bytes of the publication's window in use now
    BP_PEAK = 1005  # bp-peak: the most bytes of its window ever in use
    PUBLISHER_DROPS = 1006  # pub-drops: offers policy=drop-newest dropped
    MDC_DESTINATIONS = 1007  # mdc-destinations: a multi-destination-cast endpoint's, now
    MDS_DESTINATIONS = 1008  # mds-destinations: a multi-destination subscription's, now
    # slipstream's, a durable= publication's (docs/PROTOCOL.md §7.7)
    PUBLISHER_DURABLE = 1009  # pub-durable: the position N tagged receivers consumed to
    DURABLE_RECEIVERS = 1010  # durable-rcv: tagged receivers heard within their timeout


class SystemCounter(enum.IntEnum):
    """Driver-wide counters, allocated first so that their ids are fixed."""

    BYTES_SENT = 0
    BYTES_RECEIVED = 1
    ERRORS = 2
    CLIENT_TIMEOUTS = 3
    BACK_PRESSURE_EVENTS = 4
    UNBLOCKED_PUBLICATIONS = 5
    INVALID_PACKETS = 6
    NAK_MESSAGES_SENT = 7
    NAK_MESSAGES_RECEIVED = 8
    STATUS_MESSAGES_SENT = 9
    STATUS_MESSAGES_RECEIVED = 10
    HEARTBEATS_SENT = 11
    HEARTBEATS_RECEIVED = 12
    RETRANSMITS_SENT = 13
    RETRANSMIT_OVERFLOW = 14
    FLOW_CONTROL_UNDER_RUNS = 15
    FLOW_CONTROL_OVER_RUNS = 16
    LOSS_GAP_FILLS = 17
    CONDUCTOR_CYCLES = 18
    CONDUCTOR_MAX_CYCLE_TIME_NS = 19
    DATA_LOSS_SKIPS = 20
    SHORT_SENDS = 21  # sendmmsg sent fewer datagrams than asked (socket buffer full)
    SEND_ERRORS = 22
    RECEIVE_ERRORS = 23
    FOREIGN_SOURCE_DROPS = 24  # frames of an image from an address other than its SETUP's
    IMAGES_REJECTED = 25  # a SETUP whose image the driver could not create (space, counters)
    DEBUG_DATA_LOSS_DROPS = 26  # dropped on purpose by debug_receive_data_loss (a test hook)
    NOTIFY_DROPS = 27  # systemd notify states the notify socket did not take (full or gone)
    NETWORK_DUTY_CYCLES = 28  # duty cycles of the network threads' C loops
    NETWORK_PYTHON_PASSES = 29  # times those loops ran an agent's Python half
    RATE_SIGNALS_SENT = 30  # NAK-strength signals this driver's images sent (rc=)
    RATE_SIGNALS_RECEIVED = 31  # NAK-strength signals its publications received
    RATE_CUTS = 32  # times a signal cut a publication's send-rate limit
    IMAGES_LEFT_BEHIND = 33  # images whose missing data had left the sender's resend window
    UNTETHERED_SKIPS = 34  # untethered subscriptions left behind (drop-oldest)
    UNTETHERED_SKIPPED_BYTES = 35  # the stream bytes they skipped
    NETWORK_WORK_CYCLES = 36  # duty cycles of the network threads that did work
    # The pressure governor (daemon/pressure/governor.py, docs/BACKPRESSURE.md):
    GOVERNOR_PRESSURE = 37  # the last pressure sampled, per mille
    GOVERNOR_STEP = 38  # the ladder's step now (0: none)
    GOVERNOR_CLIMBS = 39  # steps up the ladder
    GOVERNOR_DESCENTS = 40  # steps down
    GOVERNOR_COALESCING = 41  # times step 1 (coalesce) was entered
    GOVERNOR_STATUS_WIDENED = 42  # times step 2 (status-message interval x 4) was entered
    GOVERNOR_LOWEST_DEFERRED = 43  # times step 3 (the lowest band deferred) was entered
    GOVERNOR_LOWEST_REFUSED = 44  # times step 4 (the lowest band's offers refused) was entered
    NETWORK_BUSY_NS = 45  # time the network threads spent in duty cycles that did work, ns
    RATE_SIGNALS_IGNORED = 46  # signals from receivers outside an fc=tagged sender's group
    # status messages naming no publication of the send endpoint they reached (dropped: no
    # multi-destination-cast destination is learned from one)
    UNMATCHED_STATUS_MESSAGES = 47

    @property
    def label(self) -> str:
        return self.name.lower().replace("_", " ")


@attrs.frozen
class CounterInfo:
    """A snapshot of one allocated counter, for tools."""

    counter_id: int
    type_id: int
    registration_id: int
    session_id: int
    stream_id: int
    owner_id: int
    label: str
    value: int


POSITION_TYPES = frozenset((CounterType.PUBLISHER_LIMIT, CounterType.PUBLISHER_POSITION,
                            CounterType.SENDER_POSITION, CounterType.SENDER_LIMIT,
                            CounterType.RECEIVER_HWM, CounterType.RECEIVER_POSITION,
                            CounterType.SUBSCRIBER_POSITION))
#: A publication's back-pressure counters, with their label kinds (as the position counters').
BACK_PRESSURE_TYPES: Final = ((CounterType.BP_EPISODES, "bp-episodes"),
                              (CounterType.BP_TIME, "bp-time"),
                              (CounterType.BP_DEPTH, "bp-depth"),
                              (CounterType.BP_PEAK, "bp-peak"),
                              (CounterType.PUBLISHER_DROPS, "pub-drops"))
# The channel may hold spaces (alias=my feed): it runs up to the " stream=S session=S" that
# the rest of the label follows.
_POSITION_LABEL = re.compile(r"(?P<kind>[a-z-]+): (?P<channel>.+?) stream=(?P<stream>-?\d+) "
                             r"session=(?P<session>-?\d+)"
                             r"(?: (?:sub=(?P<sub>\d+)|source=(?P<source>\S+)))*")


@attrs.frozen
class PositionLabel:
    """What the driver writes in a position counter's label: ``kind: channel stream=S
    session=S [source=HOST:PORT] [sub=REGISTRATION]``."""

    kind: str  # pub-lmt, pub-pos, snd-pos, snd-lmt, rcv-hwm, rcv-pos, sub-pos
    channel: str
    stream_id: int
    session_id: int
    source: str | None  # an image's sender
    subscription_id: int | None  # a subscriber position's subscription


def parse_position_label(label: str) -> PositionLabel | None:
    """The parts of a position counter's label, or None for any other label."""
    match = _POSITION_LABEL.fullmatch(label)
    if match is None:
        return None
    sub = match["sub"]
    return PositionLabel(match["kind"], match["channel"], int(match["stream"]),
                         int(match["session"]), match["source"],
                         None if sub is None else int(sub))


class CountersFullError(OSError):
    """No counter slot is free: the driver answers the command that needed one with an error."""


def _stop_keeper(keeper: Any, pid: int) -> None:
    """Stop a keepalive thread of this process (``ss_keeper_stop``: wake, join, free)."""
    if os.getpid() == pid:
        lib.ss_keeper_stop(keeper)


class CountersFile:
    """A mapped ``counters.dat``.  The driver creates it; clients and tools map it."""

    def __init__(self, path: str | os.PathLike[str], *, writable: bool = True) -> None:
        self.path = Path(path)
        fd = os.open(self.path, os.O_RDWR if writable else os.O_RDONLY)
        try:
            stat = os.fstat(fd)
            size = stat.st_size
            # Which file this is: a driver restarted in the same directory makes a new one.
            self._file_identity = (stat.st_dev, stat.st_ino)
            if size < HEADER_LENGTH:
                raise ValueError(f"{self.path} is not a counters file ({size} bytes)")
            self._map = map_shared(fd, size, writable=writable)
        finally:
            os.close(fd)
        magic, version, capacity = struct.unpack_from("<iii", self._map, 0)
        if magic != MAGIC or version != VERSION:
            self._map.close()
            raise ValueError(f"{self.path} is not a slipstream counters file (v{VERSION})")
        self.capacity = capacity
        self._cdata = ffi.from_buffer("uint8_t[]", self._map, require_writable=writable)
        self._base = ffi.cast("uint8_t *", self._cdata)
        self._values_offset = HEADER_LENGTH + capacity * METADATA_LENGTH
        self._next_free_hint = 0
        # Each counter's cffi pointer, made on first use: the driver's hot paths count into
        # the same few cells thousands of times a second.
        self._addresses: dict[int, Any] = {}
        self._keeper_stops: list[weakref.finalize] = []

    @classmethod
    def create(cls, path: str | os.PathLike[str], capacity: int,
               mode: int = 0o600) -> CountersFile:
        """Create the file (driver only, with ``mode``: :func:`control.file_mode`) with the
        system counters allocated."""
        size = HEADER_LENGTH + capacity * (METADATA_LENGTH + VALUE_LENGTH)
        fd = control.create_file(path, os.O_RDWR | os.O_EXCL, mode)
        try:
            os.ftruncate(fd, size)
            header = struct.pack("<iii4xqq", MAGIC, VERSION, capacity, os.getpid(),
                                 time.time_ns())
            os.pwrite(fd, header, 0)
        finally:
            os.close(fd)
        counters = cls(path)
        for counter in SystemCounter:
            counter_id = counters.allocate(CounterType.SYSTEM, counter.label)
            assert counter_id == counter.value
        return counters

    # -- header ------------------------------------------------------------------------------
    @property
    def driver_pid(self) -> int:
        return struct.unpack_from("<q", self._map, _PID_OFFSET)[0]

    @property
    def start_time_ns(self) -> int:
        return struct.unpack_from("<q", self._map, _START_TIME_OFFSET)[0]

    def _header_i64(self, offset: int):  # -> cffi int64_t *
        return ffi.cast("int64_t *", self._base + offset)

    def _header_i32(self, offset: int):  # -> cffi int32_t *
        return ffi.cast("int32_t *", self._base + offset)

    @property
    def driver_heartbeat_ns(self) -> int:
        """Wall-clock ns of the driver's last duty cycle (0 before the first)."""
        return lib.ss_load_acquire_i64(self._header_i64(HEARTBEAT_OFFSET))

    def beat(self, epoch_ns: int) -> None:
        """Record that the driver is alive at ``epoch_ns`` (driver only)."""
        lib.ss_store_release_i64(self._header_i64(HEARTBEAT_OFFSET), epoch_ns)

    def start_heartbeat_keeper(self, counter_id: int, registration_id: int, *,
                               interval_ns: int, driver_timeout_ns: int, lock_path: Path,
                               notify_fd: int) -> Callable[[], None]:
        """Start a client's keepalive thread (C, no GIL: ``ss_keeper_start``): every
        ``interval_ns`` it writes the monotonic ns into counter ``counter_id`` while that slot
        is still the CLIENT_HEARTBEAT of ``registration_id``, and checks the driver (its lock
        at ``lock_path``; that this file is still the driver's; its heartbeat here when
        ``driver_timeout_ns`` > 0).  What it finds
        wrong goes to ``notify_fd`` as one byte, ``SS_KEEPER_DRIVER_*``.  Returns the call
        that stops it (once; later calls do nothing).  The thread reads and writes this
        mapping, so it is stopped at the latest when the file is closed or collected."""
        if not 0 <= counter_id < self.capacity:
            raise IndexError(f"counter id {counter_id} outside 0..{self.capacity - 1}")
        record = self._base + self._meta_offset(counter_id)
        lock_path_c = ffi.new("char[]", os.fsencode(os.path.abspath(lock_path)))
        counters_path_c = ffi.new("char[]", os.fsencode(self.path.absolute()))
        keeper = lib.ss_keeper_start(ffi.new("ss_keeper_params_t *", {
            "heartbeat": self.address(counter_id),
            "state": ffi.cast("int32_t *", record + _STATE_OFFSET),
            "type": ffi.cast("int32_t *", record + _TYPE_OFFSET),
            "registration": ffi.cast("int64_t *", record + _REGISTRATION_OFFSET),
            "allocated_state": _STATE_ALLOCATED,
            "heartbeat_type": CounterType.CLIENT_HEARTBEAT,
            "registration_id": registration_id,
            "driver_heartbeat": self._header_i64(HEARTBEAT_OFFSET),
            "driver_timeout_ns": driver_timeout_ns,
            "lock_path": lock_path_c,
            "counters_path": counters_path_c,
            "counters_device": self._file_identity[0],
            "counters_inode": self._file_identity[1],
            "interval_ns": interval_ns,
            "notify_fd": notify_fd,
        }))
        if keeper == ffi.NULL:
            error = ffi.errno
            raise OSError(error, f"cannot start the client's keepalive thread: "
                                 f"{os.strerror(error)}")
        # Before the mapping goes (a finalizer runs before the object's attributes are
        # released), and only in the process that started it: a forked child has no such
        # thread to stop.
        stop = weakref.finalize(self, _stop_keeper, keeper, os.getpid())
        self._keeper_stops.append(stop)
        return stop

    @property
    def driver_signal(self):  # -> cffi int32_t *
        return self._header_i32(DRIVER_SIGNAL_OFFSET)

    @property
    def driver_waiters(self):  # -> cffi int32_t *
        return self._header_i32(DRIVER_WAITERS_OFFSET)

    def wake_driver(self) -> None:
        """Wake the driver if it is parked (clients call this when they need it to act)."""
        lib.ss_signal(self.driver_signal, self.driver_waiters)

    # -- counters ----------------------------------------------------------------------------
    def _meta_offset(self, counter_id: int) -> int:
        return HEADER_LENGTH + counter_id * METADATA_LENGTH

    def value_offset(self, counter_id: int) -> int:
        """Byte offset of a counter's value in the file."""
        return self._values_offset + counter_id * VALUE_LENGTH

    def address(self, counter_id: int):  # -> cffi int64_t *
        """cffi pointer to the counter's value, for C hot paths and atomics."""
        address = self._addresses.get(counter_id)
        if address is None:
            if not 0 <= counter_id < self.capacity:
                raise IndexError(f"counter id {counter_id} outside 0..{self.capacity - 1}")
            address = self._addresses[counter_id] = ffi.cast(
                "int64_t *", self._base + self.value_offset(counter_id))
        return address

    def allocate(
        self,
        type_id: int,
        label: str,
        *,
        registration_id: int = -1,
        session_id: int = 0,
        stream_id: int = 0,
        owner_id: int = -1,
        initial_value: int = 0,
    ) -> int:
        """Allocate a counter (driver only, single-threaded) and return its id."""
        now_ns = time.monotonic_ns()
        for i in range(self.capacity):
            counter_id = (self._next_free_hint + i) % self.capacity
            offset = self._meta_offset(counter_id)
            state, _, reusable_at_ns = struct.unpack_from("<iiq", self._map, offset)
            if not (state == _STATE_FREE
                    or (state == _STATE_RECLAIMED and now_ns >= reusable_at_ns)):
                continue
            encoded = label.encode("utf-8", "replace")[:LABEL_MAX_LENGTH]
            lib.ss_store_release_i64(self.address(counter_id), initial_value)
            struct.pack_into(_META.format, self._map, offset, _STATE_FREE, type_id,
                             registration_id, session_id, stream_id, owner_id, len(encoded))
            self._map[offset + _LABEL_OFFSET:offset + _LABEL_OFFSET + len(encoded)] = encoded
            # Publish the slot last so readers never see a half-written record.
            lib.ss_store_release_i32(ffi.cast("int32_t *", self._base + offset), _STATE_ALLOCATED)
            self._next_free_hint = counter_id + 1
            return counter_id
        raise CountersFullError(errno.ENOSPC, f"all {self.capacity} counters are in use or "
                                              f"freed less than 1 s ago (raise counters_capacity)")

    def allocate_all(self, kinds: Iterable[tuple[Any, ...]], label: str, *,
                     registration_id: int, session_id: int, stream_id: int) -> list[int]:
        """One counter of each ``(type_id, label kind[, initial value])``, labelled ``"kind:
        label"``, in order; all of them or none (:class:`CountersFullError`, nothing left
        allocated).  Driver only, as :meth:`allocate`."""
        allocated: list[int] = []
        try:
            for type_id, name, *initial in kinds:
                allocated.append(self.allocate(
                    type_id, f"{name}: {label}", registration_id=registration_id,
                    session_id=session_id, stream_id=stream_id,
                    initial_value=initial[0] if initial else 0))
        except CountersFullError:
            for counter_id in allocated:
                self.free(counter_id)
            raise
        return allocated

    def free(self, counter_id: int) -> None:
        """Release a counter (driver only); the slot is reused after FREE_TO_REUSE_TIMEOUT_NS."""
        offset = self._meta_offset(counter_id)
        struct.pack_into("<q", self._map, offset + 8,
                         time.monotonic_ns() + FREE_TO_REUSE_TIMEOUT_NS)
        lib.ss_store_release_i32(ffi.cast("int32_t *", self._base + offset), _STATE_RECLAIMED)

    def get(self, counter_id: int) -> int:
        """Acquire-load of a counter's value."""
        return lib.ss_load_acquire_i64(self.address(counter_id))

    def set(self, counter_id: int, value: int) -> None:
        """Release-store of a counter's value."""
        lib.ss_store_release_i64(self.address(counter_id), value)

    def add(self, counter_id: int, delta: int = 1) -> int:
        """Atomic add (any process); returns the previous value."""
        return lib.ss_get_and_add_i64(self.address(counter_id), delta)

    def info(self, counter_id: int) -> CounterInfo | None:
        """Snapshot of one counter, or None when the slot is free."""
        offset = self._meta_offset(counter_id)
        state, type_id, registration, session, stream, owner, label_length = _META.unpack_from(
            self._map, offset)
        if state != _STATE_ALLOCATED:
            return None
        label = bytes(self._map[offset + _LABEL_OFFSET:offset + _LABEL_OFFSET + label_length])
        return CounterInfo(counter_id, type_id, registration, session, stream, owner,
                           label.decode("utf-8", "replace"), self.get(counter_id))

    def __iter__(self) -> Iterator[CounterInfo]:
        """Every allocated counter, in id order."""
        for counter_id in range(self.capacity):
            info = self.info(counter_id)
            if info is not None:
                yield info

    def close(self) -> None:
        if self._map is None:
            return
        for stop in self._keeper_stops:
            stop()
        unmap(self._map, self._cdata)
        self._map = None  # type: ignore[assignment]


def read_system_counters(directory: str | os.PathLike[str]) -> dict[SystemCounter, int]:
    """A snapshot of the system counters of the driver in ``directory`` (read-only; the
    driver need not be alive, its file must exist)."""
    counters = CountersFile(Path(directory) / control.COUNTERS_FILE, writable=False)
    try:
        return {counter: counters.get(counter) for counter in SystemCounter}
    finally:
        counters.close()
