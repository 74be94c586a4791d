"""Where a session's range is held, and the one reader of it across recordings and archives:
:func:`locate` asks one or more archives and stitches what their recordings hold into
pieces, in position order, preferring the archives in the order given (docs/ARCHIVE.md,
"Two archives"); :func:`read_session` reads the session's messages across them.

One session (stream id, session id and log framing: initial term id and term length) may be
held in several recordings of one archive (its own recording before a crash, a replica of
what it missed, its own recording after it rejoined) and in several archives.  Positions are
the stream's in all of them, so a piece of one recording and the next piece of another meet
at a position that means the same frame in both: a reader goes from one to the next with no
gap and no duplicate.  Pieces meet at frame boundaries, which may lie inside a fragmented
message (a recording that stopped, or joined, between its fragments).  At a seam that cuts
a message the reader goes on from the message's first fragment in a recording that holds it
whole across the seam (a replica that catch-up made holds whole
messages at its seams with its archive's own recordings, :mod:`.replication`); where none
does, the message is lost and the reader says so, naming its range (:class:`LostRange`).

:func:`read_session` makes that reader, a :class:`SessionReader`, driven two ways: the
Spark read task (in place from the archive directory on its host, else replayed) and the
command line iterate it, waiting while nothing is there;
:class:`~slipstream.archive.merge.ReplayMerge` polls it, never waiting for a replay.  The
Spark planner stitches with :func:`stitch`.
"""


from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from pathlib import Path
from typing import Final

import attrs

from slipstream.archive.catalog import (
    CATALOG_FILE,
    NULL_POSITION,
    Catalog,
    CatalogError,
    EndReason,
    RecordingDescriptor,
)
from slipstream.archive.client import ArchiveClient, ArchiveReplay, ListedRecording
from slipstream.archive.reading import (
    RecordingLostError,
    RecordingReader,
    first_recorded_message,
    indexed_position,
)
from slipstream.client.errors import SlipstreamError
from slipstream.client.image import Image
from slipstream.client.messages import GatheredMessages
from slipstream.client.retention import first_message, image_terms

__all__ = ["HeldRange", "LostRange", "SessionLostError", "SessionReader", "held_ranges",
           "locate", "read_session", "stitch"]

log = logging.getLogger("slipstream.archive")

#: An archive's control endpoint: address, port, control stream id (as
#: :attr:`ArchiveClient.archive`).
Endpoint = tuple[str, int, int]

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



def _going_on(pieces: Sequence[HeldRange], position: int, reached: int, end: int | None
              ) -> HeldRange | None:
    """Of one archive's ``pieces``, the one to read on from ``position`` (a message
    boundary) when frames were read up to ``reached`` (past ``position``: the last read
    ended inside the message at ``position``): one that holds ``position`` and reaches past
    ``reached``, so that it holds that message whole across the seam, the furthest reaching
    first (:func:`_reach`)."""
    holding = [p for p in pieces if p.start <= position and _reach(p, end) > reached]
    return max(holding, key=lambda p: _reach(p, end), default=None)


#: How far a live recording may be replayed by a read with an end: as far as it asks (the
#: archive's replay follows the recording).
_FOLLOWED: Final = 1 << 62


def _reach(piece: HeldRange, end: int | None) -> int:
    """How far a piece may be read: a stopped recording's end; a live one's recorded
    position when asked, or, for a read with an end, as far as it asks."""
    return piece.end if piece.stopped or end is None else _FOLLOWED


@attrs.frozen
class LostRange:
    """Messages of a session that no archive holds: positions ``[start, end)`` of stream
    ``stream_id`` session ``session_id``, and why (``why``: the recordings' seam or hole)."""

    stream_id: int
    session_id: int
    start: int
    end: int
    why: str

    def describe(self) -> str:
        return (f"session {self.session_id} stream {self.stream_id}: the messages at positions "
                f"[{self.start}, {self.end}) {self.why}")


class SessionLostError(RecordingLostError):
    """A range of a session that no archive holds (:attr:`lost`), where the reader was not
    told to go on past it."""

    def __init__(self, lost: LostRange) -> None:
        super().__init__(lost.describe(), (lost.start, lost.end))
        self.lost = lost


def _raise_lost(lost: LostRange) -> None:
    raise SessionLostError(lost)


class _Stalled(SlipstreamError):
    """A replay from which nothing came for the read's timeout."""


class _LossRaised(Exception):
    """What the caller's loss handler raised, carried past the reader's own handlers."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


class _Archive:
    """One archive of a read: its link, made when first needed, and its recordings of the
    session, listed when first needed (again after a replay of it failed)."""

    def __init__(self, endpoint: Endpoint, link: Callable[[], ArchiveClient]) -> None:
        self.endpoint = endpoint
        self._make_link = link
        self._link: ArchiveClient | None = None
        self.held: list[HeldRange] | None = None
        #: Why it did not answer (then it is not asked again in this read), or None.
        self.silent: str | None = None

    @property
    def link(self) -> ArchiveClient:
        if self._link is None:
            self._link = self._make_link()
        return self._link

    def pieces(self, stream_id: int, session_id: int, framing: tuple[int, int]
               ) -> list[HeldRange]:
        if self.silent is not None:
            return []
        if self.held is None:
            try:
                if not _reachable(self.link):
                    raise SlipstreamError("its control stream has no subscriber")
                self.held = held_ranges(self.link, stream_id, session_id, framing)
            except (SlipstreamError, OSError, KeyError, ValueError) as e:
                self.silent = str(e)
                return []
        return self.held


def read_session(archives: Sequence[ArchiveClient | Endpoint], stream_id: int,
                 session_id: int, framing: tuple[int, int], start: int, end: int | None, *,
                 link: Callable[[Endpoint], ArchiveClient] | None = None,
                 forget: Callable[[Endpoint], None] | None = None,
                 directory: str | Path | None = None,
                 prefer: tuple[Endpoint, int] | None = None,
                 on_loss: Callable[[LostRange], None] | None = None,
                 timeout_s: float = 60.0, max_messages: int = 4096,
                 replay_channel: str | None = None) -> SessionReader:
    """A read of every message of the session that begins in ``[start, end)`` (``end``
    None: as far as the archives hold when asked), whole, in position order, each once, as
    :class:`~slipstream.client.GatheredMessages` chunks (``Image.poll_gathered``'s form):
    the one failover reader of the archives, a :class:`SessionReader`.  Iterating it gives
    the chunks, waiting while none is there; a caller with its own loop polls it instead
    (:meth:`SessionReader.poll`, never waiting for a replay).  A message belongs to the
    read in which it begins: a ``start`` inside a message skips its rest (an earlier
    read's), an ``end`` inside one reads on to finish it (a planner's pieces may meet
    inside a message).

    Where it reads each position, in this order: in place, from a recording in the archive
    directory ``directory`` on this host (found in its catalog, read once, read-only; a live
    one up to where its time index says it is recorded: no counters file, no network);
    else the recording ``prefer`` (an archive's endpoint and a recording id: the one a
    planner chose) replayed to this host's driver; else the first of ``archives`` (the
    first preferred: :class:`ArchiveClient` links, or endpoints that ``link`` makes links
    to when first needed) whose recordings hold it, replayed.  A read that fails goes on
    from where it got to with the next that holds it; an archive that does not answer is
    left for the rest of the read (``forget`` is told its endpoint).

    **Seams.**  Where a recording ends inside a message (an archive stopped between its
    fragments), the message is read whole from its first fragment in another recording
    that holds it across the seam.  Where none does, or no recording holds a range at all,
    the range is lost: ``on_loss`` is told it (:class:`LostRange`: from the lost message's
    first fragment to where the next message begins) before the messages after it, and
    the read goes on from there; by default :class:`SessionLostError` is raised.  A message
    lost before a hole past ``end`` is reported up to ``end`` (the hole is the caller's),
    and a read whose ``start`` lies inside a message whose start no recording holds reports
    that message's rest: the reports of one seam meet and never overlap.  A range is taken
    for lost only when every archive answered: otherwise
    :class:`~slipstream.client.SlipstreamError` is raised naming those that did not (they
    may hold it).  A replay from which no frame arrives for ``timeout_s`` before its frames
    reach ``end`` (past it, a replay waits for the publisher to finish the message ``end``
    cuts), or whose stream goes before it is done, counts as its archive not answering.
    Replays come to ``replay_channel`` (default each archive link's reply endpoint)."""
    by_endpoint: dict[Endpoint, ArchiveClient] = {}
    endpoints: list[Endpoint] = []
    for archive in archives:
        if isinstance(archive, ArchiveClient):
            by_endpoint[archive.archive] = archive
            endpoints.append(archive.archive)
        else:
            endpoints.append(tuple(archive))  # type: ignore[arg-type]
    if prefer is not None and prefer[0] not in endpoints:
        endpoints.insert(0, prefer[0])

    def make_link(endpoint: Endpoint) -> Callable[[], ArchiveClient]:
        def made() -> ArchiveClient:
            if endpoint in by_endpoint:
                return by_endpoint[endpoint]
            if link is None:
                raise SlipstreamError(f"no link to the archive at {endpoint[0]}:{endpoint[1]}")
            return link(endpoint)
        return made

    return SessionReader([_Archive(e, make_link(e)) for e in endpoints], stream_id,
                         session_id, (framing[0], framing[1]), start, end, directory, prefer,
                         on_loss or _raise_lost, forget, timeout_s, max_messages,
                         replay_channel)


#: How long a reader that read a whole replay waits for its stream's end before it closes
#: the subscription, s: a publication drained sends its EOS at once (docs/DRIVER.md §3.6);
#: a replaying driver that sends it by the heartbeat timer (100 ms after the last data, as
#: Aeron's does) is waited for too, with a margin.
END_OF_STREAM_WAIT_S = 0.25
#: How often that wait looks, s: an end of stream commits no frame, so nothing wakes it.
END_OF_STREAM_LOOK_S = 0.0005


def _first(chunk: GatheredMessages, count: int) -> GatheredMessages:
    """The first ``count`` messages of ``chunk``."""
    return GatheredMessages(chunk.data[:chunk.offsets[count]], chunk.offsets[:count + 1],
                            chunk.lengths[:count], chunk.positions[:count],
                            chunk.reserved_values[:count], chunk.session_id)


class SessionReader:
    """One read of a session's messages across recordings and archives, the one failover
    reader, made by :func:`read_session` (which says what it reads, and where), driven in
    either of two ways: as an iterator, it gives every chunk to the end of the read,
    waiting while none is there; :meth:`poll` never waits for a replay: it returns the next chunk,
    or None when none is there now (then :attr:`done` says whether the read is over, and
    :meth:`wait` waits for more).  Either way, calls to the archives (a listing, a replay's
    start) are made as it needs them and cost up to their links' ``timeout_s``.
    :meth:`close` stops a replay it was reading.

    A message belongs to the read in which it begins: a read that starts inside a message
    skips its rest, one whose end falls inside a message reads on to finish it.  One
    thread."""

    def __init__(self, archives: list[_Archive], stream_id: int, session_id: int,
                 framing: tuple[int, int], start: int, end: int | None,
                 directory: str | Path | None, prefer: tuple[Endpoint, int] | None,
                 on_loss: Callable[[LostRange], None],
                 forget: Callable[[Endpoint], None] | None, timeout_s: float,
                 max_messages: int, replay_channel: str | None) -> None:
        self.archives = archives
        self.stream_id = stream_id
        self.session_id = session_id
        self.framing = framing
        self.term_length = framing[1]
        self.end = end
        self.directory = None if directory is None else Path(directory)
        self.prefer = prefer
        self.on_loss = on_loss
        self.forget = forget
        self.timeout_s = timeout_s
        self.max_messages = max_messages
        self.replay_channel = replay_channel
        #: The archive whose replay is being read (its link), or None.
        self.replaying: ArchiveClient | None = None
        #: How many sources were read from after one that failed (see :attr:`failures`).
        self.failovers = 0
        self._replay: ArchiveReplay | None = None
        #: Waiting for the replay's stream to end before its subscription closes.
        self._awaiting_end = False
        self._steps: Generator[GatheredMessages | None, None, None] | None = None
        self._done = False
        #: Every message that began before it was delivered (or is another read's).
        self.position = start
        #: How far frames were read: past ``position`` when the last read ended inside the
        #: message at ``position``.
        self.reached = start
        #: While the read looks for where the next message begins: where what it passes over
        #: begins, and whether that is lost (a seam none holds whole, a hole) or the rest of
        #: a message another read began (the start, which may lie inside one).
        self.skip_from: int | None = start
        self.lost = False
        self.lost_why = ""
        self._local: list[tuple[RecordingDescriptor, int]] | None = None
        #: (source, position, reached) read from without moving either: not tried again.
        self._tried: set[tuple[object, int, int]] = set()
        self.failures: list[str] = []

    # -- where the recordings are --------------------------------------------------------
    def local(self) -> list[tuple[RecordingDescriptor, int]]:
        """The session's recordings in this host's archive directory with how far each may
        be read in place: one read of its catalog (read-only)."""
        if self._local is None:
            self._local = []
            if self.directory is not None and (self.directory / CATALOG_FILE).exists():
                try:
                    with Catalog.open(self.directory, writable=False) as catalog:
                        found = catalog.recordings_of(self.stream_id, self.session_id,
                                                      self.framing)
                    self._local = [(d, indexed_position(self.directory, d)) for d in found]
                except (CatalogError, OSError) as e:
                    self.failures.append(f"the catalog in {self.directory}: {e}")
        return self._local

    def _held(self) -> Iterator[tuple[int, int]]:
        """``(start, reach)`` of every recording known to hold some of the session."""
        for d, reach in self.local():
            yield d.start_position, reach
        for archive in self.archives:
            for piece in archive.pieces(self.stream_id, self.session_id, self.framing):
                yield piece.start, _reach(piece, self.end)

    def _begin(self) -> int:
        """Where the next read begins: the message at ``position``, or, while looking for
        the next message, where frames were read to."""
        return self.reached if self.skip_from is not None else self.position

    def _fresh(self, key: object) -> bool:
        return (key, self.position, self.reached) not in self._tried

    def _source(self) -> tuple[str, object, int, object] | None:
        """The next place to read from: ("local", descriptor, reach, key) or ("replay",
        (archive, recording id), reach, key); ``key`` names it among those tried.  It holds
        where the read begins and reaches past what was read."""
        begin, reached, end = self._begin(), self.reached, self.end
        local = [(d, reach) for d, reach in self.local()
                 if d.start_position <= begin and reach > reached
                 and self._fresh(("local", d.recording_id))]
        if local:
            d, reach = max(local, key=lambda held: held[1])
            return "local", d, reach, ("local", d.recording_id)
        if self.prefer is not None:
            endpoint, recording_id = self.prefer
            archive = next(a for a in self.archives if a.endpoint == endpoint)
            if archive.silent is None and self._fresh(("prefer", endpoint, recording_id)):
                return ("replay", (archive, recording_id), _FOLLOWED,
                        ("prefer", endpoint, recording_id))
        for archive in self.archives:
            pieces = [p for p in archive.pieces(self.stream_id, self.session_id, self.framing)
                      if self._fresh((archive.endpoint, p.recording_id))]
            piece = _going_on(pieces, begin, reached, end)
            if piece is not None:
                return ("replay", (archive, piece.recording_id), _reach(piece, end),
                        (archive.endpoint, piece.recording_id))
        return None

    def _silent(self) -> list[_Archive]:
        return [a for a in self.archives if a.silent is not None]

    # -- reading -------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        """The read is over: every message it was to deliver was (or a loss was reported)."""
        return self._done

    def poll(self) -> GatheredMessages | None:
        """The next messages, or None when none is there now (see :attr:`done`).  Raises what
        :func:`read_session` raises; the read is over then."""
        if self._done:
            return None
        if self._steps is None:
            self._steps = self._run()
        try:
            chunk = next(self._steps)
        except StopIteration:
            self._done = True
            return None
        except _LossRaised as e:
            self._done = True
            raise e.error from None
        except BaseException:
            self._done = True
            raise
        return chunk

    def wait(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for the replay being read to receive more (or, once it
        was read to its end, for its stream's end: at most END_OF_STREAM_LOOK_S)."""
        if self._replay is not None:
            self._replay.wait(min(timeout_s, END_OF_STREAM_LOOK_S) if self._awaiting_end
                              else timeout_s)

    def __iter__(self) -> SessionReader:
        return self

    def __next__(self) -> GatheredMessages:
        """The next chunk, waiting while none is there; StopIteration at the end of the
        read."""
        while True:
            chunk = self.poll()
            if chunk is not None:
                return chunk
            if self._done:
                raise StopIteration
            self.wait(0.01)

    def close(self) -> None:
        """End the read: a replay being read is stopped at its archive (when it answers)."""
        self._done = True
        steps, self._steps = self._steps, None
        if steps is not None:
            steps.close()  # its replay closes

    def _wanted(self) -> bool:
        assert self.end is not None
        if self.skip_from is not None:
            return self.lost or self.reached < self.end
        return self.position < self.end

    def _run(self) -> Generator[GatheredMessages | None, None, None]:
        if self.end is None:
            self.end = max((reach for _, reach in self._held()), default=None)
            if self.end is None:
                return
        failed = False  # the last source read failed: the next one is a failover
        while self._wanted():
            source = self._source()
            if source is None:
                if not self._skip_lost():
                    break
                continue
            kind, what, reach, key = source
            self._tried.add((key, self.position, self.reached))
            if failed:
                self.failovers += 1
            failures = len(self.failures)
            if kind == "local":
                yield from self._read_local(what, reach)  # type: ignore[arg-type]
            else:
                archive, recording_id = what  # type: ignore[misc]
                yield from self._read_replayed(archive, recording_id, reach)
            failed = len(self.failures) > failures

    def _skip_lost(self) -> bool:
        """Nothing holds where the read must begin past what it read: what follows is lost
        up to where a message begins in a recording that holds more, when every archive
        answered (else raises, naming those that did not).  Whether there is more."""
        assert self.end is not None
        silent = self._silent()
        if silent:
            where = ", ".join(f"{a.endpoint[0]}:{a.endpoint[1]} ({a.silent})" for a in silent)
            raise SlipstreamError(
                f"slipstream stream {self.stream_id} session {self.session_id}: no archive gave "
                f"[{self._begin()}, {self.end}), and {where} did not answer: it may hold it"
                + ("; " + "; ".join(self.failures) if self.failures else ""))
        begin = self._begin()
        resume = min((max(start, self.reached) for start, reach in self._held()
                      if start > begin and reach > max(start, self.reached)), default=None)
        if not self.lost:
            if self.skip_from is None:
                self.lost_why = (
                    f"lie across the seam of two recordings (one ended at {self.reached}, "
                    f"inside the message at {self.position}), and no archive holds them whole"
                    if self.position < self.reached else "are held by no archive")
                self.skip_from = self.position
            else:
                self.lost_why = "are held by no archive"
            self.lost = True
        if resume is None:  # nothing held past here: lost up to the end
            self._found(max(self.end, self.reached))
            return False
        if resume > self.end:
            # A hole past the end (the caller's to report): the message that began before
            # the end is lost up to it, and the read that begins after the hole reports the
            # message's rest (nothing holds what precedes it).
            self._found(self.end)
            return False
        self.position = self.reached = resume
        return True

    def _found(self, begins: int, data_from: int | None = None) -> None:
        """The next message begins at ``begins``: what was passed over is reported when
        lost.  ``data_from``: where the first data frame passed over is (None: none, only
        padding), when the read began inside a message."""
        assert self.skip_from is not None
        skipped, self.skip_from = self.skip_from, None
        if not self.lost and data_from is not None and data_from < begins and not any(
                start < skipped <= reach for start, reach in self._held()):
            # The read began inside a message whose start no recording holds (a hole before
            # it): no read before this one delivered it.
            self.lost = True
            self.lost_why = "are the rest of a message whose start no archive holds"
            skipped = data_from
        if self.lost and begins > skipped:
            self.lost = False
            try:
                self.on_loss(LostRange(self.stream_id, self.session_id, skipped, begins,
                                       self.lost_why))
            except Exception as e:  # the caller's: not a failure of this read's sources
                raise _LossRaised(e) from e
        self.lost = False
        self.position = begins
        self.reached = max(self.reached, begins)

    def _stop(self, reach: int) -> int:
        """Where a read from a recording that reaches ``reach`` stops: the end, or, past it,
        the end of the term that holds the message cut at ``reached`` (finishing it), or of
        the term at ``reached`` (looking for where the next message begins after a loss): a
        message never crosses a term."""
        assert self.end is not None
        if self.reached < self.end:
            return min(reach, self.end)
        cut = self.reached if self.skip_from is not None else self.reached - 1
        return min(reach, cut - cut % self.term_length + self.term_length)

    def _keep(self, chunk: GatheredMessages) -> tuple[GatheredMessages | None, bool]:
        """The messages of ``chunk`` that begin before the end, and whether the read goes
        on (none of them began at or past the end)."""
        assert self.end is not None
        count = len(chunk)
        positions = chunk.positions  # message i begins where i - 1 ends (the first: here)
        if (self.position if count == 1 else positions[count - 2]) < self.end:
            self.position = positions[-1]
            return chunk, True  # the usual case, decided without a pass over the messages
        count = 0 if self.position >= self.end else \
            1 + bisect.bisect_left(positions, self.end, 0, count - 1)
        if count == 0:
            return None, False
        self.position = chunk.positions[count - 1]
        return _first(chunk, count), False

    def _moved(self, frames_end: int, at_boundary: bool) -> None:
        """A read ended with its frames at ``frames_end``, at a message boundary or not
        (inside a message whose first fragments it read)."""
        self.reached = max(self.reached, frames_end)
        if self.skip_from is None and (at_boundary or frames_end % self.term_length == 0):
            # Frames past the last message were padding, not a message cut (a message never
            # crosses a term's end).
            self.position = max(self.position, frames_end)

    def _await_end(self, image: Image) -> Iterator[None]:
        """Yield None (the caller's wait runs: :meth:`wait`, an embedded driver's duty
        cycle with it) until ``image``, a replay read to its end, shows its publication's end
        of stream, at most :data:`END_OF_STREAM_WAIT_S`.  Its driver frees an image that
        ended and that no subscription reads at once; one whose subscription went first waits
        for its sender for five status-message timeouts (the image's drain), holding its log,
        which counts against the replaying host's ``image_source_memory_limit``: replays read
        back to back were refused there."""
        deadline = time.monotonic() + END_OF_STREAM_WAIT_S
        self._awaiting_end = True
        try:
            while (not image.is_closed and image.end_of_stream_position is None
                   and time.monotonic() < deadline):
                yield None
        finally:
            self._awaiting_end = False

    def _read_local(self, descriptor: RecordingDescriptor, reach: int
                    ) -> Iterator[GatheredMessages | None]:
        assert self.directory is not None and self.end is not None
        stop = self._stop(reach)
        where = f"recording {descriptor.recording_id} in {self.directory}"
        try:
            if self.skip_from is not None:
                found, data = first_recorded_message(self.directory, descriptor, self.reached,
                                                     stop)
                if found is None:  # none begins before the stop
                    self._moved(stop, False)
                    return
                self._found(found, data)
            with RecordingReader(self.directory, descriptor, start=self.position, end=stop,
                                 recorded=reach) as reader:
                while not reader.done:
                    before = reader.position
                    chunk = reader.poll_gathered(self.max_messages)
                    if chunk is None:
                        if reader.position == before:
                            raise RecordingLostError(
                                f"{where}: nothing whole to read at {before}, which its "
                                f"catalog says was recorded", (descriptor.start_position,
                                                              descriptor.stop_position))
                        continue
                    kept, more = self._keep(chunk)
                    if kept is not None:
                        yield kept
                    if not more or self.position >= self.end:
                        return
                self._moved(reader.position, reader.at_message_boundary)
        except (SlipstreamError, OSError, KeyError) as e:
            self.failures.append(f"{where}: {e}")
            log.warning("slipstream: reading stream %d session %d in place from %s failed at "
                        "%d (%s); asking the archives for the rest", self.stream_id,
                        self.session_id, where, self.position, e)
            self._local = []  # the directory's files fail: the archives serve the rest

    def _read_replayed(self, archive: _Archive, recording_id: int, reach: int
                       ) -> Iterator[GatheredMessages | None]:
        """Read from a replay, yielding None while nothing is there (the driver waits or
        comes back).  It fails (:class:`_Stalled`: its archive is taken for not answering)
        when no frame arrives for ``timeout_s`` before its frames reach the read's end, or
        when its stream goes before it is done without ending (its archive went)."""
        assert self.end is not None
        stop = self._stop(reach)
        endpoint = archive.endpoint
        where = f"recording {recording_id} replayed by the archive at {endpoint[0]}:{endpoint[1]}"
        begin = self._begin()
        frames_end = begin
        at_boundary = False
        try:
            with archive.link.replay(recording_id, start=begin, end=stop,
                                     channel=self.replay_channel) as replay:
                self._replay, self.replaying = replay, archive.link
                idle_since = time.monotonic()
                arrived = -1  # the replay image's producer position when last looked
                last: Image | None = None  # its stream's image, once it came
                while not replay.done:
                    chunk = replay.poll_gathered(self.max_messages)
                    frames_end = replay.position
                    image = replay.image()
                    if image is not None:
                        at_boundary = image.at_message_boundary
                        if not image.is_closed:
                            last = image
                    if chunk is None:
                        now = time.monotonic()
                        if image is None or image.is_closed:
                            if last is not None and last.ended_with_mark:
                                raise SlipstreamError(f"{where}: its stream ended at "
                                                      f"{replay.position}, before {stop}")
                            if last is not None:
                                replay.close(stop_at_archive=False)  # its archive went
                                raise _Stalled(f"{where}: its stream went at position "
                                               f"{replay.position}")
                        else:
                            producer = image.producer_position()
                            if producer != arrived:  # frames arrive: not stalled
                                arrived, idle_since = producer, now
                        # A replay that sent up to the end waits, as a live image does, for
                        # the publisher to finish the message the end cuts: not stalled.
                        if now - idle_since > self.timeout_s and arrived < self.end:
                            # Not asked to stop: an archive that sends nothing may not answer.
                            replay.close(stop_at_archive=False)
                            raise _Stalled(f"{where}: nothing arrived for {self.timeout_s:g} s, "
                                           f"at position {replay.position}")
                        yield None
                        continue
                    idle_since = time.monotonic()
                    if self.skip_from is not None:
                        assert image is not None
                        begins, data = first_message(image_terms(image), image.term_length,
                                                     begin, image.position)
                        self._found(image.position if begins is None else begins, data)
                    kept, more = self._keep(chunk)
                    if kept is not None:
                        yield kept
                    if not more or self.position >= self.end:
                        if replay.done and last is not None:
                            yield from self._await_end(last)
                        return
                frames_end = replay.position
                if last is not None:  # the replay reached its stop: it ends there
                    yield from self._await_end(last)
            self._moved(frames_end, at_boundary)
        except RecordingLostError as e:  # it does not hold what was asked: another may
            self._moved(frames_end, False)
            self.failures.append(f"{where}: {e}")
            archive.held = None
        except SlipstreamError as e:
            self._moved(frames_end, False)
            self.failures.append(f"{where}: {e}")
            if isinstance(e, _Stalled) or not archive.link.is_connected:
                archive.silent = str(e)
                if self.forget is not None:
                    self.forget(endpoint)
                log.warning("slipstream: reading stream %d session %d from %s failed at %d "
                            "(%s); trying the next archive", self.stream_id, self.session_id,
                            where, self.position, e)
            else:
                archive.held = None  # its replay ended early: what does it hold now?
        finally:
            self._replay = self.replaying = None
