"""What a log still holds, and from where: its earliest position, the first position it
holds after one it lost, where a message begins.

The driver cleans a log one term behind its slowest subscriber, from wherever that one stands,
and a publisher writes over the oldest of the three partitions as it rotates, so what a log
holds of its past is a moving window of at most three terms whose start may lie in the middle
of a term, or of a fragmented message.  These functions read the log through an
:class:`~slipstream.client.image.Image` (its subscriber's, or a detached one) and never
move its position; a replay's holder and a read's planner ask them alike.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any, Final, NamedTuple

from slipstream.client._native import ffi, lib
from slipstream.client.errors import DataLossError
from slipstream.client.image import Image
from slipstream.client.layout import (
    FRAME_ALIGNMENT,
    PARTITION_COUNT,
    SESSION_ID_FIELD,
)
from slipstream.client.logbuffer import compute_term_id, index_by_position

__all__ = ["NO_LIMIT", "TermAt", "TermWalk", "cut_message_start", "earliest_position",
           "first_message", "first_retained", "image_terms", "is_retained", "message_start",
           "skip_message", "walk_term"]

#: A DATA header's session id, stream id and term id, in a row from SESSION_ID_FIELD.
_HEADER_IDS: Final = struct.Struct("<iii")


#: No bound on a walk's messages or bytes.
NO_LIMIT: Final = 2**63 - 1


class TermWalk(NamedTuple):
    """What one walk over a term's whole messages reached (``ss_scan_messages``)."""

    #: The term offset after the last message stepped over: a message boundary.
    boundary: int
    #: The messages stepped over, and their payload bytes.
    messages: int
    bytes: int
    #: Why it stopped: ``lib.SS_MESSAGES_END`` (the scan's end, or the first frame not
    #: there), ``SS_MESSAGES_LIMIT`` or ``SS_MESSAGES_TIME``.
    reason: int
    #: The term offset of the first DATA frame (not padding) it came to, or -1.
    first_data: int


#: ``term_at(position, scan_end)``: a cffi pointer to the first byte of ``position``'s term,
#: mapped up to ``scan_end`` (it may raise where the log does not hold it).
TermAt = Callable[[int, int], Any]


def walk_term(term: Any, offset: int, scan_end: int, max_messages: int = NO_LIMIT,
              max_bytes: int = NO_LIMIT, *, take_first: bool = False,
              time_ns: int | None = None) -> TermWalk:
    """Walk the whole messages of one term (``term``: a cffi pointer to its first byte, mapped
    up to ``scan_end``) from the term offset ``offset`` towards ``scan_end`` in C: the one
    message walk (``ss_scan_messages``, native.h, says where it stops: before the message
    past ``max_messages`` / ``max_bytes`` unless it is the first and ``take_first``; before
    the first stamped at or after ``time_ns``, when given).  With ``max_messages=0`` it stops
    (``SS_MESSAGES_LIMIT``) where the first message that begins at or after ``offset`` does;
    from a term's start with no limit, where the message a cut at ``scan_end`` lies in
    begins."""
    counts = ffi.new("int64_t[2]")
    out = ffi.new("int32_t[2]")
    boundary = lib.ss_scan_messages(term, offset, scan_end, max_messages, max_bytes,
                                    take_first, time_ns is not None,
                                    0 if time_ns is None else time_ns, counts, counts + 1,
                                    out, out + 1)
    return TermWalk(boundary, counts[0], counts[1], out[0], out[1])


def image_terms(image: Image) -> TermAt:
    """``image``'s log as a :data:`TermAt`: its partitions as mapped (the caller checks
    :meth:`~slipstream.client.image.Image.check_retained` around what it reads)."""
    log = image.log_buffer
    return lambda position, _: log.term_address(index_by_position(position, log.position_bits))


def first_message(term_at: TermAt, term_length: int, position: int, end: int
                  ) -> tuple[int | None, int | None]:
    """``(begins, data)``: where the first message that begins at or after the frame boundary
    ``position`` and before ``end`` does (None: none does among the frames there), and where
    the first DATA frame (not padding) from ``position`` on is, at most ``begins`` (None:
    only padding before it; a frame before ``begins`` is a fragment of a message begun
    before ``position``).  A C walk a term at a time (:func:`walk_term`), at most two: a
    message never crosses a term, so the next term starts with one."""
    data: int | None = None
    while position < end:
        term_base = position - position % term_length
        scan_end = min(end, term_base + term_length)
        walked = walk_term(term_at(position, scan_end), position - term_base,
                           scan_end - term_base, 0)
        if data is None and walked.first_data >= 0:
            data = term_base + walked.first_data
        if walked.reason == lib.SS_MESSAGES_LIMIT:
            return term_base + walked.boundary, data
        if walked.boundary < term_length:  # a frame not there, or the end: none begins
            return None, data
        position = term_base + term_length
    return None, data


def cut_message_start(term_at: TermAt, term_length: int, begin: int, cut: int) -> int:
    """Where the message that the frame boundary ``cut`` lies in begins: ``cut`` itself when
    it is a message boundary, or when that message's first fragment is not among the frames
    from ``begin`` (a message boundary, the cut's term's start or later) to ``cut``.  A C
    walk from the term's start (:func:`walk_term`): a message never crosses a term."""
    term_base = cut - cut % term_length
    begin = max(begin, term_base)
    if begin >= cut:
        return cut
    term = term_at(begin, cut)
    boundary = walk_term(term, begin - term_base, cut - term_base).boundary
    if term_base + boundary == cut:
        return cut
    # There: the cut message's first fragment, or what a walk could not step over.
    begins = walk_term(term, boundary, cut - term_base, 0)
    return term_base + boundary if begins.reason == lib.SS_MESSAGES_LIMIT and \
        begins.boundary == boundary else cut


def skip_message(data: memoryview, header: object) -> None:
    """A peek handler for checks only."""


def is_retained(image: Image, position: int) -> bool:
    """Whether the log still holds the message boundary ``position`` (a peek of nothing)."""
    try:
        image.peek(position, skip_message, position)
    except DataLossError:
        return False
    return True


def _first_frame_in_term(image: Image, start: int, end: int) -> int | None:
    """The first frame boundary in ``[start, end)`` within ``start``'s term that the log still
    holds, found by its header (length, term offset, session, stream and term id all match),
    or None.  The driver cleans one term behind the slowest subscriber from an arbitrary
    position, so what survives of a term begins anywhere, not at its start.  Candidates are
    found by searching the mapping for the header's session, stream and term id (a C
    ``memmem``, not a Python step per 32 bytes: a term is up to 1 GiB), then checked whole."""
    log_buffer = image.log_buffer
    term = image.term_length
    term_start = start - start % term
    index = index_by_position(start, log_buffer.position_bits)
    term_id = compute_term_id(start, log_buffer.position_bits, log_buffer.initial_term_id)
    ids = _HEADER_IDS.pack(image.session_id, image.stream_id, term_id)
    # The ids of a header at offset o lie at o + SESSION_ID_FIELD: search for headers at
    # start's offset up to (not at) the range's end, within the term.
    search_end = min(term, end - term_start) + SESSION_ID_FIELD
    found = log_buffer.find_in_term(index, ids, start % term + SESSION_ID_FIELD, search_end)
    while found >= 0:
        offset = found - SESSION_ID_FIELD
        if offset % FRAME_ALIGNMENT == 0:
            length, _, _, _, frame_offset = image.frame_header(term_start + offset)[:5]
            if (length > 0 and frame_offset == offset
                    and is_retained(image, term_start + offset)):
                return term_start + offset
        found = log_buffer.find_in_term(index, ids, found + 1, search_end)
    return None


def _oldest_term_held(producer: int, term_length: int) -> int:
    """Where the oldest term a log's partitions can still hold begins, its producer at
    ``producer``: the producer's term and the :data:`PARTITION_COUNT` - 1 before it (at a
    term's end the log may not have rotated yet, so that term counts as the producer's)."""
    producer_term = (max(producer, 1) - 1) // term_length
    return max(0, (producer_term - (PARTITION_COUNT - 1)) * term_length)


def first_retained(image: Image, start: int, end: int) -> int:
    """The first message position after ``start``, at most ``end``, that the log still holds.

    Only the terms the log's three partitions can still hold are looked at (the producer's
    and the two before it: whatever lies before was written over); there, term starts are
    tried first (every term begins with a frame; a reader starting inside a fragmented
    message skips its remaining fragments); within the term where cleaning stopped, the
    first intact frame header; finally ``end`` itself.
    """
    term = image.term_length
    producer = image.producer_position()
    end = min(end, producer)  # nothing is held past the producer
    # The first frame boundary that can follow start, in a term the log can still hold.
    position = max(start + FRAME_ALIGNMENT, _oldest_term_held(producer, term))
    while position < end:
        term_start = position - position % term
        if term_start > start and is_retained(image, term_start):
            return term_start
        found = _first_frame_in_term(image, position, end)
        if found is not None:
            return found
        position = term_start + term
    return end


def message_start(image: Image, position: int, end: int) -> int:
    """The first position at or after the frame boundary ``position``, before ``end``, where a
    message begins (a DATA frame with the BEGIN flag), else ``end``: a range that starts inside
    a fragmented message (where the cleaner stopped) is read from the next whole one
    (:func:`first_message` over the log)."""
    begins, _ = first_message(image_terms(image), image.term_length, position, end)
    return end if begins is None else begins


def earliest_position(image: Image) -> int:
    """The oldest message position the log still holds (at most ~3 terms back), at most the
    image's position."""
    return first_retained(image, -FRAME_ALIGNMENT, image.position)
