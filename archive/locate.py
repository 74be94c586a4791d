"""Where a session's range is held: :func:`locate` asks one or more archives and stitches what
their recordings hold into pieces, in position order, preferring the archives in the order
given (docs/ARCHIVE.md, "Two archives").

One session (stream id, session id and log framing: initial term id and term length) may be
held in several recordings of one archive (its own recording before a crash, a replica of
what it missed, its own recording after it rejoined) and in several archives.  Positions are
the stream's in all of them, so a piece of one recording and the next piece of another meet
at a position that means the same frame in both: a reader goes from one to the next with no
gap and no duplicate.  Pieces meet at frame boundaries, which may lie inside a fragmented
message (a recording that stopped, or joined, between its fragments).  A reader that
assembles messages across pieces either reads their frames (``Image.block_poll``), or, at a
seam that cuts a message, goes on from the message's first fragment in the next piece's
recording when that recording holds it (its start, from ``describe``, at or before it): a
replica that catch-up made holds whole messages at its seams with its archive's own
recordings (:mod:`.replication`), and :class:`~slipstream.archive.merge.ReplayMerge` reads
that way.

The Spark reader and :class:`~slipstream.archive.merge.ReplayMerge` both find their ranges
here.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import attrs

from slipstream.archive.catalog import NULL_POSITION, EndReason
from slipstream.archive.client import ArchiveClient, ListedRecording
from slipstream.archive.reading import RecordingLostError
from slipstream.client.errors import SlipstreamError
from slipstream.client.messages import FragmentHandler

__all__ = ["HeldRange", "held_ranges", "locate", "read_session", "stitch"]

#: How long a link never yet connected (one just made) is given to connect, seconds (at most
#: its call timeout): its archive's status messages come within milliseconds when it runs.
_FIRST_CONNECT_S = 1.0


def _reachable(archive: ArchiveClient) -> bool:
    """Whether ``archive``'s control stream has a subscriber; a link never connected gets
    :data:`_FIRST_CONNECT_S` for it, one that lost its archive none."""
    if archive.is_connected:
        return True
    if archive.was_connected:
        return False
    return archive.await_connected(min(archive.timeout_s, _FIRST_CONNECT_S))


@attrs.frozen
class HeldRange:
    """One piece of a session's range, held by one archive's recording: positions ``[start,
    end)`` of recording ``recording_id`` at ``archive`` (its control address, port and
    control stream id, as :attr:`ArchiveClient.archive`).  ``end`` is exclusive; for a live
    recording it is the recorded position when asked.  ``stopped`` and ``end_reason`` are the
    recording's (its stop is final; the catalog's :class:`EndReason`, 0 while active): a
    piece cut short of its recording's end (where a preferred archive takes over, or at the
    caller's end) still carries them."""

    archive: tuple[str, int, int]
    recording_id: int
    start: int
    end: int
    stopped: bool
    end_reason: int


def held_ranges(archive: ArchiveClient, stream_id: int, session_id: int,
                framing: tuple[int, int]) -> list[HeldRange]:
    """Every recording of the session at ``archive`` (``framing``: initial term id, term
    length), whole, as pieces in recording id order; empty ones left out.  Raises what the
    calls raise (:class:`~slipstream.client.holding.CallError` and the client's errors)."""
    pieces = (_piece(archive.archive, listed, framing)
              for listed in archive.list_all_recordings(stream_id=stream_id,
                                                        session_id=session_id))
    return [piece for piece in pieces if piece is not None]


def _piece(where: tuple[str, int, int], listed: ListedRecording,
           framing: tuple[int, int]) -> HeldRange | None:
    descriptor = listed.descriptor
    if (descriptor.initial_term_id, descriptor.term_length) != tuple(framing):
        return None  # another log with the same session id: not this stream's positions
    stopped = descriptor.stop_position != NULL_POSITION
    end = descriptor.stop_position if stopped else listed.recorded_position
    if end <= descriptor.start_position:
        return None
    return HeldRange(where, descriptor.recording_id, descriptor.start_position, end, stopped,
                     int(descriptor.end_reason if stopped else EndReason.ACTIVE))


def stitch(held: Sequence[Sequence[HeldRange]], start: int, end: int | None
           ) -> list[HeldRange]:
    """The pieces that hold as much of ``[start, end)`` (``end`` None: unbounded) as
    ``held`` does, ``held[i]`` being archive ``i``'s recordings, the first archive preferred.

    At each position the first archive that holds it serves it, from its recording that
    holds it furthest; a less preferred archive's piece is cut where a more preferred one
    holds again.  Adjacent pieces meet exactly; a hole none holds is left out."""
    out: list[HeldRange] = []
    position = start
    while end is None or position < end:
        chosen: HeldRange | None = None
        rank = len(held)
        for index, pieces in enumerate(held):
            holding = [p for p in pieces if p.start <= position < p.end]
            if holding:
                chosen, rank = max(holding, key=lambda p: p.end), index
                break
        if chosen is None:  # a hole: on at the next position anyone holds
            later = [p.start for pieces in held for p in pieces if p.start > position]
            if not later:
                break
            position = min(later)
            continue
        stop = chosen.end if end is None else min(chosen.end, end)
        # A more preferred archive that holds again before this piece ends takes over there.
        resumes = [p.start for pieces in held[:rank] for p in pieces
                   if position < p.start < stop]
        if resumes:
            stop = min(resumes)
        out.append(attrs.evolve(chosen, start=position, end=stop))
        position = stop
    return out


def locate(archives: Sequence[ArchiveClient], stream_id: int, session_id: int,
           framing: tuple[int, int], start: int, end: int | None) -> list[HeldRange]:
    """Pieces, in position order, that together hold as much of [start, end) (end None:
    as far as recorded) as the archives hold, preferring the first archive given and
    failing over to the next for what it lacks or when it does not answer (an
    ArchiveClient call that times out or errors is skipped, not raised). Adjacent pieces
    meet exactly; a hole none holds is simply absent between pieces.

    ``framing`` is the session's log's ``(initial_term_id, term_length)``: recordings of
    another log are not the session's.  An archive whose control stream has no subscriber
    (:attr:`ArchiveClient.is_connected`) is skipped without a call (a link just made gets up
    to a second to connect); one that does not answer costs its client's ``timeout_s``.
    Pieces meet at frame boundaries (see the module)."""
    held: list[list[HeldRange]] = []
    for archive in archives:
        if not _reachable(archive):
            held.append([])
            continue
        try:
            held.append(held_ranges(archive, stream_id, session_id, framing))
        except (SlipstreamError, TimeoutError, OSError, KeyError, ValueError):
            held.append([])  # it does not answer (CallError is a SlipstreamError): the next
    return stitch(held, start, end)


def _holding_across(archives: Sequence[ArchiveClient], stream_id: int, session_id: int,
                    framing: tuple[int, int], position: int, seam: int) -> HeldRange | None:
    """A recording, of any of ``archives`` that answers, that holds ``position`` and reaches
    past ``seam`` (the message at ``position`` whole across it), the first archive's first."""
    for archive in archives:
        try:
            held = held_ranges(archive, stream_id, session_id, framing)
        except SlipstreamError:
            continue
        for piece in held:
            if piece.start <= position and piece.end > seam:
                return piece
    return None


def read_session(archives: Sequence[ArchiveClient], stream_id: int, session_id: int,
                 framing: tuple[int, int], start: int, end: int | None,
                 handler: FragmentHandler, *, timeout_s: float = 60.0) -> int:
    """Hand ``handler(data, header)`` every whole message of the session in ``[start, end)``
    (``start`` a message boundary; ``end`` None: as far as the archives hold when asked), in
    order, each once, replaying the pieces :func:`locate` names one after the other; returns
    the position after the last message.  At a seam that cuts a message the next piece's
    recording is replayed from the message's first fragment (it must hold it: a replica does
    at its seams).  Raises :class:`RecordingLostError` for a range no archive holds (naming
    it), :class:`TimeoutError` when a piece does not come within ``timeout_s``."""
    by_archive = {archive.archive: archive for archive in archives}
    position = reached = start  # the last whole message's end; the frames' end
    header_position = [start]

    def deliver(data: memoryview, header) -> None:  # header: slipstream.client.messages.Header
        header_position[0] = header.position
        handler(data, header)

    def replay(archive: ArchiveClient, recording_id: int, begin: int, stop: int) -> int:
        """Replay ``[begin, stop)`` of the recording to ``deliver``; the frames' end."""
        with archive.replay(recording_id, start=begin, end=stop) as replay:
            deadline = time.monotonic() + timeout_s
            while not replay.done:
                if replay.poll(deliver, 256) == 0:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"the replay of recording {recording_id} at "
                                           f"{archive.archive} is at {replay.position} after "
                                           f"{timeout_s:g} s")
                    replay.wait(0.01)
            return replay.position

    for piece in locate(archives, stream_id, session_id, framing, start, end):
        if piece.start > reached:
            raise RecordingLostError(
                f"session {session_id} stream {stream_id}: [{reached}, {piece.start}) is held "
                f"by none of the archives", (piece.start, piece.end))
        archive = by_archive[piece.archive]
        if position < piece.start:  # the last piece ended inside the message at position
            held_from = archive.describe(piece.recording_id).descriptor.start_position
            if held_from > position:
                # Another recording that holds the message whole reads it across the seam
                # (the stitching may have cut where a preferred archive holds again).
                across = _holding_across(archives, stream_id, session_id, framing, position,
                                         piece.start)
                if across is None:
                    raise RecordingLostError(
                        f"session {session_id} stream {stream_id}: the message at {position} "
                        f"lies across two recordings and none holds it whole",
                        (piece.start, piece.end))
                reached = replay(by_archive[across.archive], across.recording_id, position,
                                 min(across.end, piece.end))
                position = reached if reached % framing[1] == 0 else header_position[0]
                if reached >= piece.end:
                    continue
                if position < reached:  # it ended inside a message again: as at a seam
                    raise RecordingLostError(
                        f"session {session_id} stream {stream_id}: the message at {position} "
                        f"lies across two recordings and none holds it whole",
                        (piece.start, piece.end))
        reached = replay(archive, piece.recording_id, position, piece.end)
        position = header_position[0]  # the last whole message's end: reached, or its start
        if reached % framing[1] == 0:
            # A message never crosses a term: frames past the last message up to a term's
            # end are its padding, not a message cut.
            position = reached
    if end is not None and reached < end:
        raise RecordingLostError(f"session {session_id} stream {stream_id}: [{reached}, {end}) "
                                 f"is held by none of the archives", (start, reached))
    return position
