"""A recording as a read query's planner sees a log: :class:`RecordingView`, the
:class:`~slipstream.client.logview.LogView` questions (what it holds, where a read limit, a
split or a time falls) answered over the recording's segment files.

The questions are the live log's, so a planner cuts an archived range as it cuts a live one
(``maxMessagesPerTrigger``, ``minPartitions``, ``startingTimestamp``).  The answers come from
the segment files mapped read-only (:class:`~slipstream.archive.reading.Segments`), walked
message by message in C by the live log's walk (:func:`~slipstream.client.logview.walk_log`:
``ss_scan_messages`` once per term, at most ``walk_bound`` bytes per answer), never past the
recorded position.  A message never crosses a term (the appender pads a term
rather than split one across two), so every term start that the recording holds is a message
boundary, and a walk or a split begins there.

Where a time falls: the time index (``<recording id>.tix``,
:func:`~slipstream.archive.reading.position_at_time`) gives where the recording was at that
time (less :data:`STAMP_SKEW_MS`, for a publisher's clock ahead of the archive's); from there
the publishers' stamps (a frame's reserved value, ns since the epoch, as the slipstream writer
stamps it) find the first message stamped at or after it.  The index makes it a search of at
most a few index intervals, however long the recording.

The archive answers these questions for callers on other hosts (its ``view`` call,
:mod:`slipstream.archive.control`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Final

from slipstream.archive.catalog import EndReason, RecordingDescriptor
from slipstream.archive.reading import (
    RecordingLostError,
    Segments,
    frame_at,
    position_at_time,
)
from slipstream.client.closing import ClosedOnExit
from slipstream.client.layout import FRAME_ALIGNMENT
from slipstream.client.logview import LogView, Walk, walk_log

__all__ = ["STAMP_SKEW_MS", "RecordingView"]

#: How far ahead of the archive host's clock a publisher's may be, ms: a time's search starts
#: where the time index had the recording this much earlier, so that a message stamped by a
#: clock that far ahead is still found.
STAMP_SKEW_MS: Final = 1000

class RecordingView(LogView, ClosedOnExit):
    """Recording ``descriptor`` in the archive ``directory``, recorded up to
    ``recorded_position`` (a stopped recording's stop position, else its recorded position
    when the view was made), as a :class:`~slipstream.client.logview.LogView`.  A recording
    has no subscriber position of its own: :attr:`position` is the recorded position and
    :meth:`advance_to` moves nothing.  Positions are the recording's, which are the live
    log's.  :meth:`close` (or ``with``) unmaps the segment it mapped.  One thread."""

    def __init__(self, directory: str | Path, descriptor: RecordingDescriptor,
                 recorded_position: int) -> None:
        self.directory = Path(directory)
        self.descriptor = descriptor
        self.recording_id = descriptor.recording_id
        self.identity = descriptor.identity
        self.log_path = str(self.directory / f"recording {descriptor.recording_id}")
        self.join_position = descriptor.start_position
        self.recorded_position = max(recorded_position, descriptor.start_position)
        self.position = self.recorded_position
        self.end_of_stream = descriptor.stop_position \
            if descriptor.end_reason == EndReason.END_OF_STREAM and not descriptor.is_active \
            else None
        self._term_length = descriptor.term_length
        # A question reads a term or a few: the pages it touches, not whole segments.
        self._segments = Segments(self.directory, descriptor, populate=False)
        self._available: int | None = None

    # -- the walk ----------------------------------------------------------------------------
    def _term_at(self, position: int, scan_end: int) -> object:
        """The address of ``position``'s term, its segment mapped to ``scan_end``; raises
        :class:`RecordingLostError` when the segment is not there."""
        term_base = position - position % self._term_length
        return self._segments.at(position, scan_end).term(term_base)

    def walk(self, begin: int, end: int, max_messages: int | None, max_bytes: int | None,
             take_first: bool, time_ns: int | None) -> Walk:
        """As :meth:`LogView.walk`, over the segment files, never past the recorded
        position; a time's walk begins where the time index had the recording
        :data:`STAMP_SKEW_MS` before ``time_ns`` (when later than ``begin``): the messages
        recorded before then were stamped before it.  ``lost`` when a segment it needs is
        not there."""
        end = min(end, self.recorded_position)
        if time_ns is not None:
            indexed = position_at_time(self.directory, self.descriptor,
                                       time_ns // 1_000_000 - STAMP_SKEW_MS)
            begin = max(begin, min(indexed, end))
        try:
            return walk_log(self._term_at, self._term_length, begin, end, max_messages,
                            max_bytes, take_first, time_ns)
        except RecordingLostError:
            return Walk(begin, 0, 0, "lost")

    # -- LogView -------------------------------------------------------------------------------
    def available_position(self) -> int:
        """The end of the last whole message recorded: the stop position of a stopped
        recording; a live one's recorded position, or the message boundary before it when it
        falls between a message's fragments."""
        if self._available is None:
            recorded = self.recorded_position
            if not self.descriptor.is_active:
                self._available = recorded
            else:
                term_base = recorded - recorded % self._term_length
                begin = max(term_base, self.descriptor.start_position)
                walked = self.walk_all(begin, recorded)
                self._available = begin if walked.stop == "lost" else walked.position
        return self._available

    def earliest_position(self) -> int:
        return self.descriptor.start_position

    def is_retained(self, position: int) -> bool:
        if position & (FRAME_ALIGNMENT - 1) or \
                not self.descriptor.start_position <= position <= self.recorded_position:
            return False
        if position == self.recorded_position or position == self.descriptor.start_position:
            return True
        try:
            segment = self._segments.at(position, position + FRAME_ALIGNMENT)
        except RecordingLostError:
            return False
        return frame_at(segment, position, self.descriptor) is not None

    def first_retained(self, start: int, end: int) -> int:
        """``start`` when the recording holds it; else its start, when that is after
        ``start``; else ``end`` (a position past the recorded one, or inside a frame)."""
        if self.is_retained(start):
            return min(start, end)
        if start < self.descriptor.start_position:
            return min(end, self.descriptor.start_position)
        return end

    def split_points(self, begin: int, stop: int, pieces: int) -> list[int]:
        """Message boundaries strictly inside ``[begin, stop)`` at or before each of
        ``pieces - 1`` equally spaced targets: each found by a walk from its term's start
        (or ``begin``) to the target, so a split costs at most a term's walk per piece."""
        if pieces <= 1 or stop <= begin:
            return []
        step = (stop - begin) / pieces
        points: list[int] = []
        term_length = self._term_length
        for k in range(1, pieces):
            target = int(begin + k * step)
            target -= target & (FRAME_ALIGNMENT - 1)
            term_base = target - target % term_length
            walked = self.walk_all(max(term_base, begin, points[-1] if points else begin),
                                   target)
            if walked.stop == "lost":
                return []
            if begin < walked.position < stop and (not points or walked.position > points[-1]):
                points.append(walked.position)
        return points

    def advance_to(self, position: int) -> str | None:
        """Nothing to move: a recording holds what it recorded, whoever read it."""
        return None

    def close(self) -> None:
        self._segments.close()
