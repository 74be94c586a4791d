"""Reads of ranges the live log no longer holds, from archives (the reader's ``archive`` option).

The planning side asks the archives named by ``archive`` (their control endpoints, the first
preferred) what they recorded of a stream, once per trigger (:class:`Archives`), and cuts
what a session must read into pieces (:func:`stitch`), each held by one recording of one
archive.  A piece becomes a partition that names its archive and recording
(:class:`ArchivedSource`); the task reads it with the archives' one failover reader,
:func:`slipstream.archive.locate.read_session`: in place when this host's archive directory
(``archiveDir``) holds it, else replayed to this host's driver, from the next archive when
one stops answering, through this process's links to the archives
(:func:`archive_client_for`).  Positions are
the recording's, so a range read from an archive is the same messages, positions and
timestamps as the live log had.  docs/SPARK.md, "Reading older ranges from an archive".
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from slipstream.archive.catalog import RecordingState
from slipstream.archive.client import ArchiveClient, ListedRecording
from slipstream.archive.locate import Endpoint, HeldRange
from slipstream.archive.locate import stitch as stitch_held
from slipstream.archive.view import STAMP_SKEW_MS
from slipstream.client import Client, SlipstreamError
from slipstream.client.logview import LogView
from slipstream.spark_bridge.runtime import ProcessCache

__all__ = ["ArchivedSource", "Archives", "archive_client_for", "forget_archive_client",
           "stitch"]

log = logging.getLogger("slipstream.spark_bridge")

_SILENT_S = 30.0  # how long an archive that did not answer is not asked again


def stitch(listed: Sequence[tuple[Endpoint, Sequence[ListedRecording]]], session_id: int,
           framing: tuple[int, int], start: int, end: int | None) -> list[HeldRange]:
    """The pieces, in position order, that hold as much of ``[start, end)`` (``end`` None: as
    far as anything is recorded) of the session ``session_id`` whose log is ``framing``
    (initial term id, term length) as the recordings ``listed`` (per archive, the preferred
    first) hold: :func:`slipstream.archive.locate.stitch` over them, where a live
    recording holds a bounded range to its ``end`` (it will be recorded, and the task
    follows it there: its recorded position now may fall between a message's fragments).
    Adjacent pieces meet exactly; a range none holds is absent between them (a hole the
    caller reports as loss)."""
    held = []
    for archive, recordings in listed:
        ranges = []
        for recording in recordings:
            d = recording.descriptor
            if d.session_id != session_id or d.state != RecordingState.VALID or \
                    (d.initial_term_id, d.term_length) != tuple(framing):
                continue
            reach = d.stop_position if not d.is_active else \
                recording.recorded_position if end is None else \
                max(recording.recorded_position, end)
            if reach > d.start_position:
                ranges.append(HeldRange(archive, d.recording_id, d.start_position, reach,
                                        not d.is_active, int(d.end_reason)))
        held.append(ranges)
    return stitch_held(held, start, end)


class Archives:
    """The planning side's link to the archives of the ``archive`` option, through ``client``
    (its host's driver): what they recorded of each stream, asked once per trigger
    (:meth:`refresh`).  An archive that does not answer in ``timeout_s`` is left out of that
    trigger's answers (logged); the others still serve."""

    def __init__(self, client: Client, endpoints: Sequence[Endpoint], timeout_s: float,
                 key: str | None = None) -> None:
        self.client = client
        self.endpoints = tuple(endpoints)
        self.timeout_s = timeout_s
        self.key = key  # the archives' control endpoints are of this key (None: plain)
        self._links: dict[Endpoint, ArchiveClient] = {}
        self._listed: dict[int, list[tuple[Endpoint, list[ListedRecording]]]] = {}
        #: Archives that did not answer, and until when (monotonic s) they are not asked.
        self._silent: dict[Endpoint, float] = {}

    def refresh(self) -> None:
        """Forget what the archives said: the next questions ask them again."""
        self._listed.clear()

    def _link(self, endpoint: Endpoint) -> ArchiveClient:
        link = self._links.get(endpoint)
        if link is None:
            link = ArchiveClient(self.client, *endpoint, timeout_s=self.timeout_s,
                                 key=self.key)
            self._links[endpoint] = link
        return link

    def recordings(self, stream_id: int) -> list[tuple[Endpoint, list[ListedRecording]]]:
        """Per archive that answered (in the option's order), its recordings of
        ``stream_id``."""
        listed = self._listed.get(stream_id)
        if listed is not None:
            return listed
        listed = []
        for endpoint in self.endpoints:
            if self._silent.get(endpoint, 0.0) > time.monotonic():
                continue  # not asked again for a while: each try costs timeout_s
            try:
                recordings = self._link(endpoint).list_all_recordings(stream_id=stream_id)
            except SlipstreamError as e:
                link = self._links.pop(endpoint, None)
                if link is not None:
                    link.close()
                if endpoint not in self._silent:
                    log.warning("slipstream: the archive at %s:%d (control stream %d) did not "
                                "answer (%s): reading older ranges from the other archives "
                                "named by the archive option, if any", *endpoint, e)
                self._silent[endpoint] = time.monotonic() + _SILENT_S
                continue
            self._silent.pop(endpoint, None)
            listed.append((endpoint, recordings))
        self._listed[stream_id] = listed
        return listed

    def answered(self, stream_id: int) -> bool:
        """Whether every archive answered what it recorded of ``stream_id``: when one did
        not, what the others lack is not known to be lost (the caller waits, or fails naming
        it, rather than report loss)."""
        return len(self.recordings(stream_id)) == len(self.endpoints)

    def silent(self, stream_id: int) -> list[Endpoint]:
        """The archives that did not answer what they recorded of ``stream_id``."""
        answered = {endpoint for endpoint, _ in self.recordings(stream_id)}
        return [endpoint for endpoint in self.endpoints if endpoint not in answered]

    def pieces(self, stream_id: int, session_id: int, framing: tuple[int, int], start: int,
               end: int | None) -> list[HeldRange]:
        """:func:`stitch` over what the archives recorded of ``stream_id``."""
        return stitch(self.recordings(stream_id), session_id, framing, start, end)

    def earliest(self, stream_id: int, session_id: int, framing: tuple[int, int],
                 reaching: int) -> int | None:
        """The earliest position from which the archives hold the session without a hole up
        to ``reaching`` (a position the live log holds), or None when they do not reach it."""
        starts = [recording.descriptor.start_position
                  for _, recordings in self.recordings(stream_id)
                  for recording in recordings
                  if recording.descriptor.session_id == session_id and
                  (recording.descriptor.initial_term_id,
                   recording.descriptor.term_length) == tuple(framing)]
        for start in sorted(starts):
            pieces = self.pieces(stream_id, session_id, framing, start, reaching)
            if pieces and pieces[0].start == start and pieces[-1].end >= reaching and all(
                    a.end == b.start for a, b in itertools.pairwise(pieces)):
                return start
        return None

    def _recording_of(self, stream_id: int, piece: HeldRange) -> ListedRecording | None:
        for endpoint, recordings in self.recordings(stream_id):
            if endpoint == piece.archive:
                for recording in recordings:
                    if recording.recording_id == piece.recording_id:
                        return recording
        return None

    def view(self, stream_id: int, piece: HeldRange) -> tuple[LogView, int] | None:
        """The recording that holds ``piece`` as a :class:`~slipstream.client.logview.LogView`
        whose questions its archive answers (its ``view`` call), and how far it may be asked
        (the piece's end, at most what is recorded now); None when its archive no longer
        lists it."""
        listed = self._recording_of(stream_id, piece)
        if listed is None:
            return None
        view = self._link(piece.archive).recording_view(listed)
        return view, min(piece.end, listed.recorded_position)

    def scan(self, stream_id: int, session_id: int, framing: tuple[int, int], begin: int,
             stop: int, max_rows: int | None, max_bytes: int | None
             ) -> tuple[int, int | None, int | None]:
        """Where a batch of at most ``max_rows`` messages / ``max_bytes`` payload bytes (at
        least one message) from ``begin`` ends in ``[begin, stop)`` of what the archives
        hold of the session, as :meth:`LogView.scan` on the live log, each recording's part
        asked of its archive, on from one recording to the next while the budgets last; and
        what is left of them when it reaches ``stop`` (None: no such budget; the bytes a
        recording's part used are counted as its length, at least its payload, so the
        budget is never passed by what follows).  A range none holds ends the batch where
        it begins, or at its end when the batch begins there (the loss is reported when it
        is planned); a live recording not yet recorded past where the batch is, or an
        archive that does not answer, ends it at its piece's end (not cut: as planned
        before)."""
        position = begin
        rows, size = max_rows, max_bytes
        for piece in self.pieces(stream_id, session_id, framing, begin, stop):
            if piece.start > position:
                return (piece.start if position == begin else position), None, None
            end = min(stop, piece.end)
            try:
                found = self.view(stream_id, piece)
                if found is None or found[1] <= position:
                    return end, None, None
                view, reach = found
                high = min(end, reach)
                reached = view.scan(position, high, rows, size)
                if reached < end:
                    return reached, None, None
                if rows is not None:
                    rows -= view.count_messages(position, reached, rows)
                if size is not None:
                    size -= reached - position
            except SlipstreamError:
                return end, None, None
            position = reached
            if (rows is not None and rows <= 0) or (size is not None and size <= 0):
                return position, 0, 0
        if position < stop:  # a hole at the end: the batch covers it when it begins there
            return (stop if position == begin else position), None, None
        return position, rows, size

    def count_messages(self, stream_id: int, session_id: int, framing: tuple[int, int],
                       begin: int, end: int, limit: int) -> tuple[int, int]:
        """How many whole messages of the session begin in ``[begin, end)`` of what the
        archives hold, counting up to ``limit`` (each recording's part asked of its
        archive, as :meth:`LogView.count_messages` on the live log); and how far the count
        reached: ``end`` when it counted them all, less where it stopped at ``limit``, at a
        hole, or at an archive that does not answer."""
        counted, position = 0, begin
        for piece in self.pieces(stream_id, session_id, framing, begin, end):
            if piece.start > position:
                break  # a hole
            try:
                found = self.view(stream_id, piece)
                if found is None:
                    break
                view, reach = found
                high = min(end, reach)
                if high <= position:
                    break
                left = limit - counted
                found_here = view.count_messages(position, high, left)
                if found_here >= left:
                    return limit, view.scan(position, high, left, None)
                counted += found_here
                position = high
            except SlipstreamError:
                break
            if position >= end:
                break
        return counted, position

    def position_at_time(self, stream_id: int, session_id: int, framing: tuple[int, int],
                         time_ns: int, begin: int, end: int | None) -> int | None:
        """Where the first message of the session in ``[begin, end)`` (``end`` None: as far
        as they hold) stamped at or after
        ``time_ns`` begins, in what the archives hold of it, or None when they hold none
        there.  A recording that stopped more than
        :data:`~slipstream.archive.view.STAMP_SKEW_MS` before the time is passed over
        unread; in the first one that may hold it, the archive searches its time index
        and then the stamps (:class:`~slipstream.archive.view.RecordingView`)."""
        time_ms = time_ns // 1_000_000
        for piece in self.pieces(stream_id, session_id, framing, begin, end):
            listed = self._recording_of(stream_id, piece)
            if listed is None:
                continue
            d = listed.descriptor
            if not d.is_active and d.stop_time_ms != -1 and \
                    d.stop_time_ms < time_ms - STAMP_SKEW_MS:
                continue
            found_view = self.view(stream_id, piece)
            if found_view is None or found_view[1] <= piece.start:
                continue
            view, reach = found_view
            found = view.position_at_time(piece.start, reach, time_ns)
            if found < reach:
                return found
        return None

    def split_points(self, stream_id: int, piece: HeldRange, pieces: int) -> list[int]:
        """Message boundaries that cut ``piece`` into about ``pieces`` ranges of equal length
        (:meth:`LogView.split_points` of its recording); none when its archive cannot say."""
        try:
            found = self.view(stream_id, piece)
            if found is None or found[1] <= piece.start:
                return []
            view, reach = found
            return [p for p in view.split_points(piece.start, reach, pieces) if p < piece.end]
        except SlipstreamError:
            return []

    def recorded_sessions(self, stream_id: int) -> dict[int, list[ListedRecording]]:
        """The recordings of ``stream_id`` by session id, of every archive that answered."""
        sessions: dict[int, list[ListedRecording]] = {}
        for _, recordings in self.recordings(stream_id):
            for recording in recordings:
                if recording.descriptor.state == RecordingState.VALID:
                    sessions.setdefault(recording.descriptor.session_id, []).append(recording)
        return sessions

    def close(self) -> None:
        for link in self._links.values():
            link.close()
        self._links.clear()


@dataclass(frozen=True)
class ArchivedSource:
    """Where a partition's range is read from: a recording (``recording_id``) of the archive
    at ``archive``, of the log ``framing`` (initial term id, term length); ``archives`` every
    archive of the query's option (the others are tried, in order, when that one stops
    answering); ``directory`` the archive directory on its host (``archiveDir``: a task
    there reads the segment files in place), or None."""

    archive: Endpoint
    recording_id: int
    framing: tuple[int, int]
    archives: tuple[Endpoint, ...]
    directory: str | None


#: This process's links to archives, by (driver directory, endpoint, call key).
_archive_clients: ProcessCache[tuple[str, Endpoint, str | None], ArchiveClient] = ProcessCache()


def archive_client_for(client: Client, directory: str | None, endpoint: Endpoint,
                       timeout_s: float, call_key: str | None = None) -> ArchiveClient:
    """This process's link to the archive at ``endpoint`` through ``client`` (the driver in
    ``directory``), its calls sealed under ``call_key`` (the endpoint is of that key; None:
    plain), made once and kept while the worker lives and the link works."""
    key = (directory or "", endpoint, call_key)
    with _archive_clients.entries() as links:
        link = links.get(key)
        if link is not None and link.client is client and not client.is_closed:
            return link
    link = ArchiveClient(client, *endpoint, timeout_s=timeout_s, key=call_key)
    with _archive_clients.entries() as links:
        links[key] = link
    return link


def forget_archive_client(directory: str | None, endpoint: Endpoint,
                          call_key: str | None = None) -> None:
    """Close and drop this process's link to the archive at ``endpoint`` (it stopped
    answering: the next task makes a new one)."""
    with _archive_clients.entries() as links:
        link = links.pop((directory or "", endpoint, call_key), None)
    if link is not None:
        try:
            link.close()
        except SlipstreamError:
            pass
