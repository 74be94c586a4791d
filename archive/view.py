"""A recording as a read query's planner sees a log: :class:`RecordingView`, the
:class:`~slipstream.client.logview.LogView` questions (what it holds, where a read limit, a
split or a time falls) answered over the recording's segment files.

The questions are the live log's, so a planner cuts an archived range as it cuts a live one
(``maxMessagesPerTrigger``, ``minPartitions``, ``startingTimestamp``).  The answers come from
the segment files mapped read-only (:class:`~slipstream.archive.reading.Segments`), walked
message by message in C (``ss_scan_messages``: one call per term, the Python loop per term),
never past the recorded position.  A message never crosses a term (the appender pads a term
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
from slipstream.client._native import ffi, lib
from slipstream.client.layout import FRAME_ALIGNMENT
from slipstream.client.logbuffer import LogIdentity
from slipstream.client.logview import LogView

__all__ = ["STAMP_SKEW_MS", "RecordingView"]

#: How far ahead of the archive host's clock a publisher's may be, ms: a time's search starts
#: where the time index had the recording this much earlier, so that a message stamped by a
#: clock that far ahead is still found.
STAMP_SKEW_MS: Final = 1000

_NO_LIMIT: Final = 2**63 - 1


class _Walk:
    """What one walk over whole messages reached: the message boundary, the messages and
    payload bytes stepped over, and whether it stopped at a limit or a stamp (else at the
    range's end or the first frame that is not there)."""

    __slots__ = ("bytes", "messages", "position", "reason")

    def __init__(self, position: int) -> None:
        self.position = position
        self.messages = 0
        self.bytes = 0
        self.reason = lib.SS_MESSAGES_END


class RecordingView(LogView):
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
        self.session_id = descriptor.session_id
        self.stream_id = descriptor.stream_id
        self.identity = LogIdentity(descriptor.session_id, descriptor.initial_term_id,
                                    descriptor.term_length)
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
        self._messages = ffi.new("int64_t *")
        self._bytes = ffi.new("int64_t *")
        self._reason = ffi.new("int32_t *")
        self._available: int | None = None

    # -- the walk ----------------------------------------------------------------------------
    def _walk(self, begin: int, end: int, max_messages: int | None = None,
              max_bytes: int | None = None, *, take_first: bool = False,
              time_ns: int | None = None) -> _Walk:
        """Whole messages from ``begin`` (a frame boundary the recording holds) towards
        ``end`` (at most the recorded position), term by term in C: see ``ss_scan_messages``
        for where it stops.  Raises :class:`RecordingLostError` when a segment it needs is
        not there."""
        walk = _Walk(begin)
        end = min(end, self.recorded_position)
        term_length = self._term_length
        while walk.position < end:
            position = walk.position
            term_base = position - position % term_length
            scan_end = min(end, term_base + term_length)
            segment = self._segments.at(position, scan_end)
            rows = _NO_LIMIT if max_messages is None else max_messages - walk.messages
            size = _NO_LIMIT if max_bytes is None else max_bytes - walk.bytes
            reached = lib.ss_scan_messages(
                segment.term(term_base), position - term_base, scan_end - term_base, rows,
                size, take_first and walk.messages == 0, time_ns is not None,
                time_ns if time_ns is not None else 0, self._messages, self._bytes,
                self._reason)
            walk.position = term_base + reached
            walk.messages += self._messages[0]
            walk.bytes += self._bytes[0]
            walk.reason = self._reason[0]
            if walk.reason != lib.SS_MESSAGES_END or walk.position < scan_end:
                break  # a limit, a stamp, or a frame not there (or a message cut by end)
        return walk

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
                try:
                    self._available = self._walk(begin, recorded).position
                except RecordingLostError:
                    self._available = begin
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

    def scan(self, begin: int, available: int, max_rows: int | None,
             max_bytes: int | None) -> int:
        if max_rows == 0 or max_bytes == 0:
            return begin
        try:
            return self._walk(begin, available, max_rows, max_bytes, take_first=True).position
        except RecordingLostError:
            return available

    def count_messages(self, begin: int, end: int, limit: int) -> int:
        try:
            return self._walk(begin, end, limit).messages
        except RecordingLostError:
            return 0

    def position_at_time(self, begin: int, end: int, time_ns: int) -> int:
        """As the live log's, from where the time index had the recording
        :data:`STAMP_SKEW_MS` before ``time_ns`` (or ``begin``, when later): the messages
        recorded before then were stamped before ``time_ns``."""
        indexed = position_at_time(self.directory, self.descriptor,
                                   time_ns // 1_000_000 - STAMP_SKEW_MS)
        start = max(begin, min(indexed, end))
        try:
            walk = self._walk(start, end, time_ns=time_ns)
        except RecordingLostError:
            return end
        return walk.position if walk.reason == lib.SS_MESSAGES_TIME else end

    def split_points(self, begin: int, stop: int, pieces: int) -> list[int]:
        """Message boundaries strictly inside ``[begin, stop)`` at or before each of
        ``pieces - 1`` equally spaced targets: each found by a walk from its term's start
        (or ``begin``) to the target, so a split costs at most a term's walk per piece."""
        if pieces <= 1 or stop <= begin:
            return []
        step = (stop - begin) / pieces
        points: list[int] = []
        term_length = self._term_length
        try:
            for k in range(1, pieces):
                target = int(begin + k * step)
                target -= target & (FRAME_ALIGNMENT - 1)
                term_base = target - target % term_length
                point = self._walk(max(term_base, begin, points[-1] if points else begin),
                                   target).position
                if begin < point < stop and (not points or point > points[-1]):
                    points.append(point)
        except RecordingLostError:
            return []
        return points

    def advance_to(self, position: int) -> str | None:
        """Nothing to move: a recording holds what it recorded, whoever read it."""
        return None

    def close(self) -> None:
        self._segments.close()

    def __enter__(self) -> RecordingView:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()
