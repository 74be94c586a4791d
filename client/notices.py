"""Notices about what a remote host did, at most one per source per interval (sans-I/O).

A SETUP the driver refuses is a line in its log and may be an ERR frame to its sender, a call
the archive refuses a line in its log; a host that sends thousands of them must not get
thousands of lines (or frames) for them.
:class:`SourceNotices` says, for each event and its source, whether to tell now: the first
event of a source in an interval is told, the others of that interval are only counted, and
the next told one carries how many were held back.  The table of sources is bounded: spoofed
addresses cannot grow it; a source that finds it full is held back like a repeat (its
events are still counted by the caller's counters).

Time is an argument (``now_ns``, monotonic ns); nothing here reads a clock.
"""

from __future__ import annotations

from collections.abc import Hashable

#: How long after telling of a source the next event of it is held back, ns.
NOTICE_INTERVAL_NS = 10_000_000_000
#: The most sources remembered at once.
NOTICE_SOURCES_MAX = 1024


class SourceNotices:
    """Which events to tell of, per source, at most one per ``interval_ns`` (see the module
    docstring)."""

    def __init__(self, interval_ns: int = NOTICE_INTERVAL_NS,
                 capacity: int = NOTICE_SOURCES_MAX) -> None:
        self.interval_ns = interval_ns
        self.capacity = capacity
        #: source -> (when its interval ends, ns; events held back since it was told of)
        self._sources: dict[Hashable, tuple[int, int]] = {}
        #: Events held back because the table was full (told with the next notice).
        self.overflow = 0

    def tell(self, source: Hashable, now_ns: int) -> int | None:
        """None: hold this event of ``source`` back (one was told within the interval);
        else tell it now, and the number of its events held back since the last told one
        (those of sources the full table turned away included)."""
        entry = self._sources.get(source)
        if entry is not None and now_ns < entry[0]:
            self._sources[source] = (entry[0], entry[1] + 1)
            return None
        if entry is None and len(self._sources) >= self.capacity:
            self._expire(now_ns)
            if len(self._sources) >= self.capacity:
                self.overflow += 1
                return None
        held = (entry[1] if entry is not None else 0) + self.overflow
        self.overflow = 0
        self._sources[source] = (now_ns + self.interval_ns, 0)
        return held

    def _expire(self, now_ns: int) -> None:
        """Forget the sources whose interval ended with nothing held back (a source with
        events held back is kept, so its count is told with its next notice)."""
        self._sources = {source: entry for source, entry in self._sources.items()
                         if now_ns < entry[0] or entry[1]}
        if len(self._sources) >= self.capacity:
            # All held something back: tell those counts with the next notice instead.
            for source in [s for s, e in self._sources.items() if now_ns >= e[0]]:
                self.overflow += self._sources.pop(source)[1]
