"""Counters: typed 64-bit positions and statistics in a shared file (docs/ARCHITECTURE.md).

Position counters are the protocol state between processes: the driver publishes the
publication limit, each subscriber publishes its position, and the driver reads those back.
The same file is what ``slipstream stat`` and the Prometheus exporter read.

Layout of ``counters.dat`` (all little-endian)::

    [header 4096 B][metadata: capacity x 512 B][values: capacity x 128 B]

Header: magic, version, capacity, driver pid, start time, the driver heartbeat (epoch ns of
its last duty cycle, which clients use to tell a live driver from a dead one) and the driver's
eventcount (signal + waiters) that a back-pressured IPC publisher uses to wake a parked driver.
Metadata per counter (512 B, Aeron's record size): state, type id, registration id, session
id, stream id, owner client id, label length, key length (40 B), then a key of up to
:data:`KEY_MAX_LENGTH` bytes (Aeron's 112) that a reader in another process finds the counter
by, then a label of up to :data:`LABEL_MAX_LENGTH` bytes.  Each value sits alone on its own
128-byte slot so that writers in different processes never share a cache line (nor the
adjacent line the prefetcher pairs with it).

The driver allocates and frees every counter, its own and those clients add
(``Client.add_counter``, Aeron's addCounter): a client's counter is freed when the client
closes it, closes, or is timed out, so a killed client leaks none.
"""

from __future__ import annotations

import enum
import errno
import heapq
import os
import re
import struct
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Final

import attrs

from slipstream.client import control
from slipstream.client._native import ffi, lib
from slipstream.client.closing import ClosedOnExit
from slipstream.client.counter_record import (
    KEY_MAX_LENGTH,
    KEY_OFFSET,
    LABEL_MAX_LENGTH,
    LABEL_OFFSET,
    METADATA_LENGTH,
    RECORD,
    check_counter_key,
    fit_label,
)
from slipstream.client.counter_record import is_driver_type as is_driver_type  # its readers'
from slipstream.client.errors import ClosedError
from slipstream.client.mapping import map_shared, unmap

MAGIC = 0x53504C53  # "SLPS"
VERSION = 2  # 2: 512-byte metadata records with a key
HEADER_LENGTH = 4096
VALUE_LENGTH = 128

# Header fields.
_MAGIC_OFFSET = 0
_VERSION_OFFSET = 4
_CAPACITY_OFFSET = 8
_PID_OFFSET = 16
_START_TIME_OFFSET = 24
#: int32: every id below it has been allocated at some time (0: a file that does not keep it;
#: read all the capacity).  Readers iterate up to it, so that a large capacity costs them
#: neither the time nor the pages of the slots never used.
_HIGH_WATER_OFFSET = 32
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
# state, type, registration, session, stream, owner, label length, key length
# The offsets of RECORD's first three fields (a client's keepalive thread reads them from C).
_STATE_OFFSET, _TYPE_OFFSET, _REGISTRATION_OFFSET = (
    struct.calcsize(RECORD.format[:n]) for n in (1, 2, 3))


class CounterType(enum.IntEnum):
    """What a counter measures (ids follow Aeron's where Aeron has one).

    Type ids are the driver's or its clients': the driver keeps
    :data:`~slipstream.client.counter_record.DRIVER_TYPE_IDS`
    (Aeron's 0..99 and slipstream's own 1000..1099) for its own counters and refuses them to
    ``Client.add_counter``, which takes any other id in 0..2**31-1.  Aeron's archive
    (100..199) and cluster (200..299) are clients of the driver and number theirs there, as
    :attr:`RECORDING_POSITION` does; an application's own are best from 1100 up."""

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
    # slipstream's, a durable= publication's (docs/CHANNELS.md §7.7)
    PUBLISHER_DURABLE = 1009  # pub-durable: the position N tagged receivers consumed to
    DURABLE_RECEIVERS = 1010  # durable-rcv: tagged receivers heard within their timeout
    # slipstream's, one per capacity a user can reach (:func:`capacities`): its label is the
    # setting that bounds it, its value the use now, its key the setting's value (int64)
    CAPACITY = 1011
    # A client's (the archive's), not the driver's: a recording's position, bytes (Aeron's
    # RecordingPos, type 100); its key: recording id, session id, stream id, the archive's
    # identity (slipstream.archive.reading.recording_position_key).
    RECORDING_POSITION = 100
    # A call server's (an archive's control stream): the calls it refused for one cause
    # (docs/ARCHIVE.md, "Protected calls"); its key: the cause and the server's identity.
    CALLS_REFUSED = 101
    # A client's (a Spark read query's planner): the bytes its sessions hold past what the
    # query committed, summed over the sessions (its label names the query).
    SPARK_READ_LAG = 1100


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
    IMAGES_REJECTED = 25  # a SETUP whose image could not be made: log memory, counters, file, mtu
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
    GOVERNOR_STATUS_WIDENED = 42  # times step 2 (status-message interval widened) was entered
    GOVERNOR_LOWEST_DEFERRED = 43  # times step 3 (the lowest band deferred) was entered
    GOVERNOR_LOWEST_REFUSED = 44  # times step 4 (the lowest band's offers refused) was entered
    NETWORK_BUSY_NS = 45  # time the network threads spent in duty cycles that did work, ns
    RATE_SIGNALS_IGNORED = 46  # signals from receivers outside an fc=tagged sender's group
    # status messages naming no publication of the send endpoint they reached (dropped: no
    # multi-destination-cast destination is learned from one)
    UNMATCHED_STATUS_MESSAGES = 47
    # a dynamic multi-destination-cast endpoint's address validation (docs/CHANNELS.md §7.4.1):
    # control frames from a source outside the endpoint's join= subnets that reach the
    # Python half (SMs, RTTMs, ERRs, rate signals), dropped unread
    MDC_JOIN_SUBNET_DROPS = 48
    # candidate destinations (learned from a status message) dropped because they did not
    # prove within mdc_validation_timeout that they receive what is sent to their address
    MDC_UNVALIDATED_DROPS = 49
    # candidates dropped unvalidated to make room for a new source: the endpoint had
    # mdc_candidates_max waiting (the oldest goes)
    MDC_CANDIDATES_REFUSED = 50
    # datagrams not sent to an unvalidated address because they would take what was sent to
    # it past 3x what arrived from it (RFC 9000 section 8's anti-amplification limit)
    MDC_AMPLIFICATION_DROPS = 51
    # datagrams an encrypted channel's endpoint drops, by cause
    # (docs/CHANNELS.md §7.8):
    CRYPTO_PLAIN_DROPS = 52  # a datagram without a seal at an encrypted endpoint: a plain peer
    CRYPTO_UNKNOWN_KEY_DROPS = 53  # sealed under a key id the endpoint's key file does not hold
    CRYPTO_AUTH_DROPS = 54  # failed to open: tampered, truncated, or sealed under another key
    CRYPTO_REPLAY_DROPS = 55  # a counter already opened, below the window, or a stale sender id
    CRYPTO_SEAL_REFUSED = 56  # not sealed (too long, libcrypto), or a sender id due not drawn
    CRYPTO_SEALED_AT_PLAIN_DROPS = 57  # a sealed datagram at a plain endpoint (a key it lacks)
    # control from the network (docs/DRIVER.md §5.7):
    # status messages naming a live receiver from another host than the one its status
    # messages are bound to (dropped: a forged or stray one moves nothing)
    SM_SOURCE_MISMATCH_DROPS = 58
    # status messages claiming a position beyond what the publication sent (dropped)
    SM_AHEAD_OF_SENDER_DROPS = 59
    # NAKs from an address no live receiver of the publication sends its status messages from
    NAK_UNKNOWN_SOURCE_DROPS = 60
    # NAKs beyond the publication's retransmit budget (retransmit_budget per interval)
    NAK_BUDGET_DROPS = 61
    # ERR frames naming a live receiver from another host than its bound one (dropped: they
    # change nothing and are not logged)
    ERR_SOURCE_MISMATCH_DROPS = 62
    # NAK-strength rate signals from an address no live receiver sends its status messages from
    RATE_SIGNAL_UNKNOWN_SOURCE_DROPS = 63
    # NAK-strength rate signals claiming a backlog that the receiver's own status messages do
    # not show (snd-pos minus its acknowledged position below the claimed fill)
    RATE_SIGNAL_UNBACKED_DROPS = 64
    # log lines of text from the network (an ERR frame's message) not written: their source
    # had its lines for the interval already
    REMOTE_TEXT_SUPPRESSED_DROPS = 65
    # ERR frames naming a live receiver from its address that its status messages went on
    # to contradict within the grace (dropped: they change nothing)
    ERR_CONTRADICTED_DROPS = 66
    # SETUPs that made no image, by cause (docs/DRIVER.md §4.2.1)
    IMAGE_TERM_LENGTH_REFUSED = 67  # SETUPs whose term is longer than the subscription allows
    IMAGE_SOURCE_IMAGES_REFUSED = 68  # SETUPs from a source at image_source_max_images
    IMAGE_SOURCE_MEMORY_REFUSED = 69  # SETUPs whose log would pass image_source_memory_limit
    IMAGE_PENDING_REFUSED = 70  # SETUPs while image_pending_max logs were being made
    # logs made for an image no longer wanted when done (its subscription or endpoint went,
    # or its source stopped asking): freed, never attached
    IMAGE_LOGS_ABANDONED = 71
    # status messages from a dynamic multi-destination-cast destination's address naming
    # another receiver id than the one it validated with (dropped: they keep no one alive)
    MDC_UNKNOWN_RECEIVER_DROPS = 72
    # sealed datagrams of a new sender at an encrypted endpoint whose every sender slot holds
    # a sender still fresh (whose window must stay: docs/CHANNELS.md §7.8)
    CRYPTO_SENDERS_FULL_DROPS = 73
    # host names in channels that resolved again to another address, which the endpoint
    # then sends to (Aeron's "Resolution changes"; docs/CHANNELS.md §7.2)
    RESOLUTION_CHANGES = 74
    # sealed datagrams of a sender the encrypted endpoint has no handshake with yet, or sent
    # before it (a recording replayed to an endpoint since restarted): docs/CHANNELS.md §7.8
    CRYPTO_AWAITING_HANDSHAKE_DROPS = 75
    # handshake datagrams malformed, or not made with the key (another key's, forged)
    CRYPTO_HANDSHAKE_FAILED_DROPS = 76
    # handshake datagrams of no exchange of this endpoint (another receiver's on a multicast
    # group, repeated, replayed; an INIT outside the clock skew or answered before)
    CRYPTO_HANDSHAKE_UNMATCHED_DROPS = 77
    # INITs past the per-source answer rate or while every answer slot is in use; exchanges
    # started with every exchange slot waiting (the oldest evicted) or past 64 a second
    CRYPTO_HANDSHAKE_LIMITED_DROPS = 78
    # handshakes an encrypted endpoint completed, as initiator or responder
    CRYPTO_HANDSHAKES = 79
    # logs made from a released log's file the driver kept (log_reuse_bytes), whose pages
    # exist already
    LOGS_REUSED = 80
    # memory the driver's kept released logs hold now, bytes (a gauge, at most
    # log_reuse_bytes)
    RELEASED_LOG_BYTES = 81
    # endpoints the network threads' duty cycles read (one or more recvmmsg calls each): with
    # many endpoints a cycle reads those epoll finds readable, not every one
    NETWORK_ENDPOINT_READS = 82
    # of GOVERNOR_CLIMBS, those the network threads' duty-cycle lag led: the machine too busy
    # to run them when their timers rang, not the driver's own send backlog or busy threads
    GOVERNOR_LAG_CLIMBS = 83
    # of the driver's kept released logs, those zeroed and ready for a new log of their
    # length now (a gauge); the others wait for a process's mapping of them to end
    RELEASED_LOGS_READY = 84

    @property
    def label(self) -> str:
        return self.name.lower().replace("_", " ")


#: The system counters that count what the driver received and dropped, by cause: the name
#: ``slipstream stat`` shows in its "drops by cause" section and the Prometheus exporter gives
#: as the ``cause`` label of ``slipstream_drops_total`` (docs/SECURITY.md lists what each
#: means and which host can cause it).  A counter of a drop is in this table, so that one
#: scrape sees every reason the driver turned input away.
DROP_CAUSES: Final[dict[SystemCounter, str]] = {
    SystemCounter.INVALID_PACKETS: "malformed",
    SystemCounter.FOREIGN_SOURCE_DROPS: "foreign-source",
    SystemCounter.IMAGES_REJECTED: "image-rejected",
    SystemCounter.UNMATCHED_STATUS_MESSAGES: "unmatched-status-message",
    SystemCounter.RATE_SIGNALS_IGNORED: "rate-signal-outside-group",
    SystemCounter.RETRANSMIT_OVERFLOW: "nak-resend-queue-full",
    SystemCounter.DEBUG_DATA_LOSS_DROPS: "debug-loss",
    SystemCounter.MDC_JOIN_SUBNET_DROPS: "mdc-outside-join-subnets",
    SystemCounter.MDC_UNVALIDATED_DROPS: "mdc-unvalidated",
    SystemCounter.MDC_CANDIDATES_REFUSED: "mdc-candidates-full",
    SystemCounter.MDC_AMPLIFICATION_DROPS: "mdc-amplification-limit",
    SystemCounter.CRYPTO_PLAIN_DROPS: "crypto-plain-at-encrypted",
    SystemCounter.CRYPTO_UNKNOWN_KEY_DROPS: "crypto-unknown-key",
    SystemCounter.CRYPTO_AUTH_DROPS: "crypto-authentication-failed",
    SystemCounter.CRYPTO_REPLAY_DROPS: "crypto-replay",
    SystemCounter.CRYPTO_SEALED_AT_PLAIN_DROPS: "crypto-sealed-at-plain",
    SystemCounter.SM_SOURCE_MISMATCH_DROPS: "status-message-from-another-host",
    SystemCounter.SM_AHEAD_OF_SENDER_DROPS: "status-message-ahead-of-sender",
    SystemCounter.NAK_UNKNOWN_SOURCE_DROPS: "nak-from-no-receiver",
    SystemCounter.NAK_BUDGET_DROPS: "nak-over-retransmit-budget",
    SystemCounter.ERR_SOURCE_MISMATCH_DROPS: "err-from-another-host",
    SystemCounter.ERR_CONTRADICTED_DROPS: "err-contradicted",
    SystemCounter.RATE_SIGNAL_UNKNOWN_SOURCE_DROPS: "rate-signal-from-no-receiver",
    SystemCounter.RATE_SIGNAL_UNBACKED_DROPS: "rate-signal-unbacked",
    SystemCounter.REMOTE_TEXT_SUPPRESSED_DROPS: "remote-text-suppressed",
    SystemCounter.IMAGE_TERM_LENGTH_REFUSED: "setup-term-length-not-allowed",
    SystemCounter.IMAGE_SOURCE_IMAGES_REFUSED: "setup-source-images-full",
    SystemCounter.IMAGE_SOURCE_MEMORY_REFUSED: "setup-source-memory-full",
    SystemCounter.IMAGE_PENDING_REFUSED: "setup-pending-logs-full",
    SystemCounter.MDC_UNKNOWN_RECEIVER_DROPS: "mdc-unknown-receiver",
    SystemCounter.CRYPTO_SENDERS_FULL_DROPS: "crypto-senders-full",
    SystemCounter.CRYPTO_AWAITING_HANDSHAKE_DROPS: "crypto-awaiting-handshake",
    SystemCounter.CRYPTO_HANDSHAKE_FAILED_DROPS: "crypto-handshake-failed",
    SystemCounter.CRYPTO_HANDSHAKE_UNMATCHED_DROPS: "crypto-handshake-unmatched",
    SystemCounter.CRYPTO_HANDSHAKE_LIMITED_DROPS: "crypto-handshake-limited",
}


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
    key: bytes = b""


@attrs.frozen
class Capacity:
    """A bound a user can reach: ``setting`` (the driver setting to raise), ``used`` now and
    its ``limit`` (the setting's value), in ``unit`` (``bytes`` or ``count``)."""

    setting: str
    used: int
    limit: int
    unit: str


#: The unit of each capacity the driver reports, by its setting: a ``*_limit`` of memory in
#: bytes, the others counts.
CAPACITY_UNITS: Final[dict[str, str]] = {
    "counters_capacity": "count",
    "log_buffer_memory_limit": "bytes",
    "image_pending_max": "count",
    "image_source_max_images": "count",
    "image_source_memory_limit": "bytes",
}
_CAPACITY_KEY = struct.Struct("<q")


def capacity_key(limit: int) -> bytes:
    """The key of a :attr:`CounterType.CAPACITY` counter: its setting's value."""
    return _CAPACITY_KEY.pack(limit)


def capacities(counters: CountersFile, allocated: Sequence[CounterInfo]) -> list[Capacity]:
    """Every capacity the driver of ``counters`` reports, with its use now: the counters
    file's own (``allocated``, every counter allocated in it, of ``counters_capacity``), then
    one per :attr:`CounterType.CAPACITY` counter."""
    found = [Capacity("counters_capacity", len(allocated), counters.capacity,
                      CAPACITY_UNITS["counters_capacity"])]
    for info in allocated:
        if info.type_id == CounterType.CAPACITY and len(info.key) >= _CAPACITY_KEY.size:
            (limit,) = _CAPACITY_KEY.unpack_from(info.key)
            found.append(Capacity(info.label, info.value, limit,
                                  CAPACITY_UNITS.get(info.label, "count")))
    return found


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
        #: The driver's free list (:meth:`allocate`): ids below the high water that were
        #: freed, with when each may be handed out again, a heap by that time; None until the
        #: first allocation, which reads them from the file.
        self._freed: list[tuple[int, int]] | None = None
        self._high_water = 0
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
    @property
    def high_water(self) -> int:
        """Slots ever allocated (every allocated counter's id is below it): the capacity for a
        file that does not say."""
        high_water = lib.ss_load_acquire_i32(self._header_i32(_HIGH_WATER_OFFSET))
        return min(high_water, self.capacity) if high_water > 0 else self.capacity

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
        key: bytes = b"",
    ) -> int:
        """Allocate a counter (driver only, single-threaded) and return its id.  ``label`` is
        cut to :data:`LABEL_MAX_LENGTH` bytes; a ``key`` longer than :data:`KEY_MAX_LENGTH`
        is :class:`InvalidArgumentError`."""
        key = check_counter_key("key", key)
        now_ns = time.monotonic_ns()
        counter_id = self._take_free_id(now_ns)
        if counter_id is not None:
            offset = self._meta_offset(counter_id)
            # Cut at a character's start: a label read back never ends in half of one.
            encoded = fit_label(label).encode("utf-8", "replace")
            lib.ss_store_release_i64(self.address(counter_id), initial_value)
            struct.pack_into(RECORD.format, self._map, offset, _STATE_FREE, type_id,
                             registration_id, session_id, stream_id, owner_id, len(encoded),
                             len(key))
            self._map[offset + KEY_OFFSET:offset + KEY_OFFSET + len(key)] = key
            self._map[offset + LABEL_OFFSET:offset + LABEL_OFFSET + len(encoded)] = encoded
            # Publish the slot last so readers never see a half-written record.
            lib.ss_store_release_i32(ffi.cast("int32_t *", self._base + offset), _STATE_ALLOCATED)
            return counter_id
        raise CountersFullError(errno.ENOSPC, f"all {self.capacity} counters are in use or "
                                              f"freed less than 1 s ago (counters_capacity = "
                                              f"{self.capacity}: raise counters_capacity)")

    def _take_free_id(self, now_ns: int) -> int | None:
        """The id to allocate: the oldest freed one whose reuse deadline passed, else the
        next never used (the high water rises), else None.  O(log freed): a free list, no scan."""
        freed = self._freed
        if freed is None:
            freed = self._freed = self._read_free_list()
        if freed and freed[0][0] <= now_ns:
            return heapq.heappop(freed)[1]
        if self._high_water < self.capacity:
            counter_id = self._high_water
            self._high_water += 1
            lib.ss_store_release_i32(self._header_i32(_HIGH_WATER_OFFSET), self._high_water)
            return counter_id
        return None

    def _read_free_list(self) -> list[tuple[int, int]]:
        """The free slots of the file as it is (once, at the first allocation): the high
        water past the last slot ever used, the free and freed ones below it by deadline.
        Only the slots below the header's high water are read: reading a slot of a sparse
        file on tmpfs takes its page, and a scan of every slot would take the whole file
        (61 MiB at 100000 slots, past a container's /dev/shm: SIGBUS)."""
        slots = []
        last_used = -1
        stored = min(max(self._header_i32(_HIGH_WATER_OFFSET)[0], 0), self.capacity)
        for counter_id in range(stored):
            state, _, reusable_at_ns = struct.unpack_from("<iiq", self._map,
                                                          self._meta_offset(counter_id))
            if state == _STATE_FREE:
                slots.append((0, counter_id))
            else:
                last_used = counter_id
                if state == _STATE_RECLAIMED:
                    slots.append((reusable_at_ns, counter_id))
        self._high_water = last_used + 1
        lib.ss_store_release_i32(self._header_i32(_HIGH_WATER_OFFSET), self._high_water)
        return sorted(s for s in slots if s[1] < self._high_water)  # sorted: a heap

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
        reusable_at_ns = time.monotonic_ns() + FREE_TO_REUSE_TIMEOUT_NS
        struct.pack_into("<q", self._map, offset + 8, reusable_at_ns)
        if self._freed is not None:
            heapq.heappush(self._freed, (reusable_at_ns, counter_id))
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
        """Snapshot of one counter, or None when the slot is free (or being changed)."""
        if not 0 <= counter_id < self.capacity:
            raise IndexError(f"counter id {counter_id} outside 0..{self.capacity - 1}")
        offset = self._meta_offset(counter_id)
        state, type_id, registration, session, stream, owner, label_length, key_length = (
            RECORD.unpack_from(self._map, offset))
        if state != _STATE_ALLOCATED:
            return None
        # The lengths come from a file every client of the driver may write: kept to the
        # record, so that a damaged one never reads into the next.
        label_length = min(max(label_length, 0), LABEL_MAX_LENGTH)
        key_length = min(max(key_length, 0), KEY_MAX_LENGTH)
        label = bytes(self._map[offset + LABEL_OFFSET:offset + LABEL_OFFSET + label_length])
        key = bytes(self._map[offset + KEY_OFFSET:offset + KEY_OFFSET + key_length])
        info = CounterInfo(counter_id, type_id, registration, session, stream, owner,
                           label.decode("utf-8", "replace"), self.get(counter_id), key)
        # Freed (and maybe handed out again) while it was read: no snapshot of a mix.
        return info if self.holds(counter_id, registration) else None

    def holds(self, counter_id: int, registration_id: int) -> bool:
        """Whether slot ``counter_id`` is allocated to the counter registered as
        ``registration_id`` now: False once that counter was freed, also when the slot went
        to another counter since (Aeron's ``getCounterRegistrationId`` compared)."""
        if not 0 <= counter_id < self.capacity:
            return False
        record = self._base + self._meta_offset(counter_id)
        state = ffi.cast("int32_t *", record + _STATE_OFFSET)
        if lib.ss_load_acquire_i32(state) != _STATE_ALLOCATED:
            return False
        registration = lib.ss_load_acquire_i64(
            ffi.cast("int64_t *", record + _REGISTRATION_OFFSET))
        # The driver writes the registration field before it publishes a slot, and (with the
        # reuse deadline) before it frees one: a second look at the state closes the race.
        return registration == registration_id and (
            lib.ss_load_acquire_i32(state) == _STATE_ALLOCATED)

    def __iter__(self) -> Iterator[CounterInfo]:
        """Every allocated counter, in id order (Aeron's CountersReader.forEach), up to the
        high water (the slots never used hold none)."""
        for counter_id in range(self.high_water):
            info = self.info(counter_id)
            if info is not None:
                yield info

    def find(self, type_id: int, key: bytes | None = None, *,
             registration_id: int | None = None) -> CounterInfo | None:
        """The first allocated counter of ``type_id`` whose key is ``key`` and whose
        registration is ``registration_id`` (either None: any), or None (Aeron's
        findByTypeIdAndRegistrationId, and a lookup by key, which a recording's counter is
        found by).  A reader keeps what it found with :meth:`reader`."""
        for info in self:
            if (info.type_id == type_id and (key is None or info.key == key)
                    and (registration_id is None or info.registration_id == registration_id)):
                return info
        return None

    def reader(self, counter_id: int, registration_id: int) -> CounterReader:
        """Read counter ``counter_id`` while it is the one registered as ``registration_id``
        (:attr:`CounterReader.is_allocated` says when it no longer is)."""
        if not 0 <= counter_id < self.capacity:
            raise IndexError(f"counter id {counter_id} outside 0..{self.capacity - 1}")
        return CounterReader(self, counter_id, registration_id)

    def close(self) -> None:
        if self._map is None:
            return
        for stop in self._keeper_stops:
            stop()
        unmap(self._map, self._cdata)
        self._map = None  # type: ignore[assignment]


class CounterReader:
    """One counter as another process reads it: its slot and the registration it holds.  A
    reader that keeps an id across time asks :attr:`is_allocated` before it trusts a value:
    the driver frees a counter when its owner closes it or goes, and hands the slot to
    another counter later."""

    def __init__(self, counters: CountersFile, counter_id: int, registration_id: int) -> None:
        self._counters = counters
        self.counter_id = counter_id
        self.registration_id = registration_id

    @property
    def is_allocated(self) -> bool:
        """Whether the slot still holds this registration's counter."""
        return self._counters.holds(self.counter_id, self.registration_id)

    def get(self) -> int:
        """The value (an acquire load); meaningful while :attr:`is_allocated`."""
        return self._counters.get(self.counter_id)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(counter_id={self.counter_id}, "
                f"registration_id={self.registration_id})")


class Counter(CounterReader, ClosedOnExit):
    """A counter this client added (``Client.add_counter``, Aeron's Counter): the driver
    allocated it and frees it when it is closed, when its client closes, or when the driver
    times the client out.  ``set`` is an ordered (release) store and ``add`` an atomic add,
    safe from any thread and any process that maps the file; once closed, every call but
    :meth:`close` raises :class:`ClosedError`."""

    def __init__(self, counters: CountersFile, counter_id: int, registration_id: int, *,
                 type_id: int, label: str, key: bytes,
                 release: Callable[[Counter], None]) -> None:
        super().__init__(counters, counter_id, registration_id)
        self.type_id = type_id
        self.label = label
        self.key = key
        self._release = release
        self._closed = False

    @property
    def is_closed(self) -> bool:
        """Closed by :meth:`close`, or with its client (or the client cut off)."""
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"counter {self.counter_id} (registration "
                              f"{self.registration_id}) is closed")

    def get(self) -> int:
        self._check_open()
        return super().get()

    def set(self, value: int) -> None:
        """Store ``value`` (an int64), ordered after every write before it."""
        self._check_open()
        self._counters.set(self.counter_id, value)

    def add(self, delta: int = 1) -> int:
        """Add ``delta`` atomically; returns the value before."""
        self._check_open()
        return self._counters.add(self.counter_id, delta)

    def close(self) -> None:
        """Ask the driver to free it (once; later calls do nothing)."""
        if self._closed:
            return
        self._closed = True
        self._release(self)

    def _mark_closed(self) -> None:
        """Closed with its client: the driver frees it with the client's other resources."""
        self._closed = True


def read_system_counters(directory: str | os.PathLike[str]) -> dict[SystemCounter, int]:
    """A snapshot of the system counters of the driver in ``directory`` (read-only; the
    driver need not be alive, its file must exist)."""
    counters = CountersFile(Path(directory) / control.COUNTERS_FILE, writable=False)
    try:
        return {counter: counters.get(counter) for counter in SystemCounter}
    finally:
        counters.close()
