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

from typing import TYPE_CHECKING

import attrs

from slipstream.client._native import lib
from slipstream.client.counters import CounterType

#: How often the conductor samples while an episode is open (its end is seen within this).  An
#: IPC stream near its limit keeps the conductor's cycle at a millisecond anyway; for a
#: network stream these are the only cycles the episode costs (a publisher that meets its
#: limit wakes the conductor once per limit value, never per refused offer).
EPISODE_SAMPLE_INTERVAL_NS = 10_000_000

if TYPE_CHECKING:
    from slipstream.client.channel import Channel
    from slipstream.daemon.config import DriverSettings


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
        self._cells = cells or {}
        self.episodes = 0
        self.total_ns = 0  # the ended episodes'
        self.peak = 0
        self.depth = 0
        self.started_ns: int | None = None  # the open episode's start
        self._seen_hit_ns = 0

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
        a start first)."""
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
        cells = self._cells
        if not cells:
            return
        for kind, value in ((CounterType.BP_EPISODES, self.episodes),
                            (CounterType.BP_TIME, self.time_in_episodes_ns(now_ns)),
                            (CounterType.BP_DEPTH, self.depth),
                            (CounterType.BP_PEAK, self.peak)):
            cell = cells.get(kind)
            if cell is not None:
                lib.ss_store_release_i64(cell, value)
