"""Back-pressure episodes of one publication (docs/BACKPRESSURE.md, Episodes): the high/low
watermark hysteresis.

The part of a publication's window in use, its *depth*, is how far the producer is beyond where
the window starts: ``producer - (pub-lmt - window)``, between 0 and the window (bytes).  For
an IPC stream that is the producer's lead over the slowest subscriber; for a network stream its
lead over the sender.

An episode starts when the depth reaches the high watermark or a publisher met its limit (the
appender records the limit it met and when, in the log's metadata, so an offer refused
between two samples is never missed; the default high watermark, 100 %, is that alone).  It
ends when the depth falls to the low watermark, or the stream loses its last subscriber (with
nobody to wait for, there is no pressure).  Each start and end is an :class:`EpisodeEvent`,
and the counters follow: ``bp-episodes``, ``bp-time`` (ns, the open episode's so far
included), ``bp-depth`` and ``bp-peak``.

Sans-I/O: :meth:`BackPressureEpisodes.sample` takes the positions and ``now``.
"""

from __future__ import annotations

import attrs

from slipstream.client._native import ffi, lib
from slipstream.client.channel import Channel
from slipstream.client.counters import CounterType
from slipstream.client.layout import (
    META_ACTIVE_TERM_COUNT,
    META_IS_CONNECTED,
    META_LIMIT_HIT_POSITION,
    META_LIMIT_HIT_TIME,
    META_TAIL_COUNTERS,
    PARTITION_COUNT,
)
from slipstream.client.logbuffer import LogBuffer, index_by_term_count, tail_term_offset
from slipstream.daemon.config import DriverSettings

#: How often the conductor samples while an episode is open (its end is seen within this).  An
#: IPC stream near its limit keeps the conductor's cycle at a millisecond anyway; for a
#: network stream these are the only cycles the episode costs (a publisher that meets its
#: limit wakes the conductor once per limit value, never per refused offer).
EPISODE_SAMPLE_INTERVAL_NS = 10_000_000


def watermarks_of(channel: Channel, settings: DriverSettings) -> tuple[int, int]:
    """(high, low) percent for a publication of ``channel``: its ``watermarks=``, else the
    driver's ``backpressure_*_watermark``."""
    if channel.watermarks is not None:
        return channel.watermarks
    return settings.backpressure_high_watermark, settings.backpressure_low_watermark


@attrs.frozen
class EpisodeEvent:
    """An episode began (``started``) or ended, at ``at_ns`` (CLOCK_MONOTONIC); ``depth`` is the
    bytes in use then, ``duration_ns`` how long an ended one lasted (0 for a start), and
    ``episodes`` how many began so far (this one included)."""

    started: bool
    at_ns: int
    depth: int
    duration_ns: int
    episodes: int


class LogReadings:
    """What :meth:`BackPressureEpisodes.sample` takes from one publication's log and its
    pub-lmt counter, the values :class:`~slipstream.client.logbuffer.LogBuffer`'s accessors
    give, each one acquire load through a pointer made once: those accessors make theirs on
    every call, and the conductor samples every duty cycle.  Valid while the log is mapped
    and the counter allocated."""

    __slots__ = ("_active_term_count", "_connected", "_hit_position", "_hit_time", "_limit",
                 "_position_bits", "_tails", "_term_length")

    def __init__(self, log: LogBuffer, publisher_limit: object) -> None:
        """``publisher_limit``: the cffi ``int64_t *`` of the publication's pub-lmt."""
        meta = log.meta
        self._active_term_count = ffi.cast("int32_t *", meta + META_ACTIVE_TERM_COUNT)
        self._tails = tuple(ffi.cast("int64_t *", meta + META_TAIL_COUNTERS + 8 * index)
                            for index in range(PARTITION_COUNT))
        self._connected = ffi.cast("int32_t *", meta + META_IS_CONNECTED)
        self._hit_position = ffi.cast("int64_t *", meta + META_LIMIT_HIT_POSITION)
        self._hit_time = ffi.cast("int64_t *", meta + META_LIMIT_HIT_TIME)
        self._limit = publisher_limit
        self._term_length = log.term_length
        self._position_bits = log.position_bits

    def words(self) -> tuple[object, ...]:
        """The 64-bit words :meth:`read` depends on (cffi ``int64_t *``): the tails, the word
        holding the active term count, the one holding the connected flag, the limit last met
        and when, and pub-lmt.  While none changes, :meth:`read` reads the
        same."""
        meta_word = ffi.cast("int64_t *", self._active_term_count)
        connected_word = ffi.cast("int64_t *", self._connected)
        return (*self._tails, meta_word, connected_word, self._hit_position, self._hit_time,
                self._limit)

    def read(self) -> tuple[int, int, bool, int, int]:
        """(producer position, pub-lmt, whether a subscriber is connected, the limit a
        publisher last met, when: ns), positions in bytes, as ``sample`` takes them."""
        load64 = lib.ss_load_acquire_i64
        term_count = lib.ss_load_acquire_i32(self._active_term_count)
        raw_tail = load64(self._tails[index_by_term_count(term_count)])
        producer = ((term_count << self._position_bits)
                    + tail_term_offset(raw_tail, self._term_length))
        return (producer, load64(self._limit), lib.ss_load_acquire_i32(self._connected) == 1,
                load64(self._hit_position), load64(self._hit_time))


class BackPressureEpisodes:
    """One publication's episodes (module doc).  ``cells``: the counter cells by type (the
    types of :data:`~slipstream.client.counters.BACK_PRESSURE_TYPES`), or None (tests)."""

    def __init__(self, window: int, high_percent: int, low_percent: int,
                 cells: dict[CounterType, object] | None = None) -> None:
        if not 0 <= low_percent < high_percent <= 100:
            raise ValueError(f"watermarks {high_percent}/{low_percent}: need 0 <= low < high "
                             f"<= 100")
        self.window = window
        self.watermarks = (high_percent, low_percent)
        self.high = window * high_percent // 100
        self.low = window * low_percent // 100
        cells = cells or {}
        self._episodes_cell = cells.get(CounterType.BP_EPISODES)
        self._time_cell = cells.get(CounterType.BP_TIME)
        self._depth_cell = cells.get(CounterType.BP_DEPTH)
        self._peak_cell = cells.get(CounterType.BP_PEAK)
        self.episodes = 0
        self.total_ns = 0  # the ended episodes'
        self.peak = 0
        self.depth = 0
        self.started_ns: int | None = None  # the open episode's start
        self._seen_hit_ns = 0
        #: The positions of the last sample (None: none yet); see :meth:`sample`.
        self._last_inputs: tuple[int, int, bool, int, int, int | None] | None = None

    @property
    def is_open(self) -> bool:
        return self.started_ns is not None

    def sample(self, now_ns: int, producer: int, limit: int, connected: bool,
               hit_position: int, hit_ns: int, *, window_start: int | None = None
               ) -> list[EpisodeEvent]:
        """Positions (bytes) at ``now_ns``: the producer's, pub-lmt, whether a subscriber is
        connected, and the limit a publisher last met with its time (0, 0: none yet);
        ``window_start``: where the window in use starts, when pub-lmt lags it (a network
        stream's limit moves in steps of an eighth of a window: its depth is the lead over
        snd-pos, or a drained stream could sit above a low watermark under 12.5 % for good).
        Returns the episodes that began or ended since the last sample (at most one of each,
        a start first).

        The conductor samples every duty cycle, mostly to find the same positions again:
        then no episode can begin (the met limit, if any, was seen already, and the depth
        was under the high watermark or an episode is open) and one can end only at the
        low watermark, so all that moves is the open episode's time."""
        inputs = (producer, limit, connected, hit_position, hit_ns, window_start)
        if inputs == self._last_inputs and (self.started_ns is None or self.depth > self.low):
            if self.started_ns is not None and self._time_cell is not None:
                lib.ss_store_release_i64(self._time_cell, self.time_in_episodes_ns(now_ns))
            return []
        self._last_inputs = inputs
        start = limit - self.window if window_start is None else window_start
        depth = min(max(producer - start, 0), self.window) if connected else 0
        met = hit_ns > self._seen_hit_ns and hit_position > 0
        if met:
            self._seen_hit_ns = hit_ns
        events: list[EpisodeEvent] = []
        if self.started_ns is None and connected and (met or depth >= self.high):
            self.episodes += 1
            # A publisher that met its limit was at capacity then, whatever the depth is now.
            self.started_ns = min(hit_ns, now_ns) if met else now_ns
            self.peak = max(self.peak, self.window if met else depth)
            events.append(EpisodeEvent(True, self.started_ns,
                                       self.window if met else depth, 0, self.episodes))
        elif met:
            self.peak = self.window
        still_at_limit = met and hit_position >= limit
        if self.started_ns is not None and (
                not connected or (depth <= self.low and not still_at_limit)):
            duration = max(0, now_ns - self.started_ns)
            self.total_ns += duration
            self.started_ns = None
            events.append(EpisodeEvent(False, now_ns, depth, duration, self.episodes))
        self.depth = depth
        self.peak = max(self.peak, depth)
        self._publish(now_ns)
        return events

    def time_in_episodes_ns(self, now_ns: int) -> int:
        """Time spent in episodes up to ``now_ns``, the open one's included."""
        if self.started_ns is None:
            return self.total_ns
        return self.total_ns + max(0, now_ns - self.started_ns)

    def _publish(self, now_ns: int) -> None:
        store = lib.ss_store_release_i64
        if self._episodes_cell is not None:
            store(self._episodes_cell, self.episodes)
        if self._time_cell is not None:
            store(self._time_cell, self.time_in_episodes_ns(now_ns))
        if self._depth_cell is not None:
            store(self._depth_cell, self.depth)
        if self._peak_cell is not None:
            store(self._peak_cell, self.peak)
