"""Catch-up from peer archives: what another archive recorded of this archive's streams and
this one does not hold is fetched and recorded here, as a recording of its own (a replica;
docs/ARCHIVE.md, "Two archives").

Every ``replication_interval`` the service's :class:`Replicator` lists each peer's
recordings of the stream ids its ``[[record]]`` tables name, and for each one works out what
of its range this archive does not hold: the ranges of its own recordings of the same session
(same stream id, session id, initial term id and term length) taken away, an active one
counting as held from its start on (it records what comes).  The first range missing that
is not waiting after a failed fetch (:data:`RETRY_BASE_S`), ``[a, b)``, is fetched: the
peer replays it (the ``replay`` call, positioned, from ``a`` to ``b``) to this host's reply
endpoint for that peer, on the stream's own stream id and with the recording's own session
id, so that the frames come as they were recorded, byte for byte; a
:class:`~slipstream.archive.recorder.Recording` of that replay image writes them into a new
recording here, at the same positions.  Its catalog descriptor names the peer and
its recording in ``source_identity`` (``replica of recording N at address:port/stream``).

**Whole messages at the seams.**  A recording that stopped (a crash: at the last whole
frame) or joined the live stream (at the image's join position) may hold only some
fragments of a message there.  A fetch that meets such a recording of this archive takes the
whole message: it starts at the first fragment of the message its start falls in, and ends
after the message its end falls in, so the replica overlaps the recording by the fragments it
has.  A reader that goes from piece to piece then finds every message whole in one
recording (:class:`~slipstream.archive.merge.ReplayMerge` relies on it when it fails over).

One fetch runs at a time (two replays of one session to one endpoint would collide); a fetch
that completes lets the next look happen as soon as its replay's image has gone (at most
:data:`DRAIN_S`: the same session id to the same endpoint must not meet the last one's
image), so holes are filled back to back.  A fetch
ends with the replay's end of stream or its image going:

* at ``b`` where ``b`` is the peer recording's stop: the replica stops with the peer's end
  reason when that is *end of stream* or *ended abruptly* (the session's end, carried over),
  else *stopped*;
* at ``b`` short of the peer's stop (a hole before this archive's own later recording):
  *stopped*;
* short of ``b`` (the peer died or stopped mid-fetch): *stopped* at the last whole frame
  recorded, which stays valid (a replica is a recording like any: recovered at start if this
  archive died while writing it); the rest is missing still, and fetched at a later look.

**Two threads, nothing shared.**  The planning, the replicas and the replays' images are the
service's thread's (:class:`Replicator`); the calls to the peers, which wait for answers, are
made on a thread of their own (:class:`_Caller`), which owns the links to the peers and the
replays it opens.  The service's thread asks it with frozen requests (:class:`ListRecordings`,
:class:`OpenReplay`, :class:`CloseReplay`) and takes its frozen results from a queue
(:class:`Listed`, :class:`ReplayOpened`, :class:`ReplayRefused`, :class:`ReplayClosed`,
:class:`CallFailed`); of a replay it is handed only its subscription, to read, which it hands
back with :class:`CloseReplay`.

A range is never written twice into one recording (a replica is a new recording; its frames
come in order from the replay), and a hole is only ever filled with the peer's frames at
their positions (the replay is positioned; the image's identity is checked against the
peer's recording before anything is written).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Protocol

from slipstream.archive.catalog import NULL_POSITION, Catalog, EndReason, RecordingDescriptor
from slipstream.archive.client import ArchiveClient, ArchiveReplay, ListedRecording
from slipstream.archive.control import channel_key
from slipstream.archive.reading import first_message_start, stop_message_start
from slipstream.archive.recorder import Recording
from slipstream.archive.settings import (
    ArchiveSettings,
    Peer,
    RecordSpec,
    replication_reply_ports,
    spec_of,
)
from slipstream.client import Client
from slipstream.client.errors import SlipstreamError
from slipstream.client.image import Image
from slipstream.client.subscription import Subscription


class ReplicatingArchive(Protocol):
    """What the replicator uses of the archive it fills, the service that makes it
    (:class:`~slipstream.archive.service.ArchiveService`): its settings (the peers, the
    records), its directory, catalog and client, the recordings it is making, and how a
    replica joins them."""

    settings: ArchiveSettings
    directory: Path
    catalog: Catalog
    client: Client
    recordings: dict[int, Recording]

    def adopt(self, recording: Recording) -> None: ...

    def position_moved(self, recording: Recording, position: int) -> None: ...


log = logging.getLogger("slipstream.archive")

#: How long a fetch waits for its replay's image, and for its position to move, before it is
#: given up (and tried again at a later look).
FETCH_STALL_S: Final = 10.0
#: How long a completed fetch's replay subscription is kept at most for its image to go (its
#: peer's publication ended) before the next fetch begins.
DRAIN_S: Final = 15.0
#: A range whose fetch failed (nothing fetched) is not asked for again before
#: ``RETRY_BASE_S * 2 ** (failures - 1)`` seconds (at most :data:`RETRY_MAX_S`); other
#: missing ranges are fetched meanwhile.  After :data:`MAX_FAILURES` it is given up until the
#: archive restarts (an error logged): a peer that keeps refusing, or a truncated segment of
#: its, never holds the catch-up of the rest.
RETRY_BASE_S: Final = 5.0
RETRY_MAX_S: Final = 300.0
MAX_FAILURES: Final = 6
#: A peer's end reasons that are the session's end, carried over to the replica's stop.
_SESSION_ENDS: Final = (EndReason.END_OF_STREAM, EndReason.ENDED_ABRUPTLY)

SessionKey = tuple[int, int, int, int]  # stream id, session id, initial term id, term length


def session_key(descriptor: RecordingDescriptor) -> SessionKey:
    """What makes two recordings the same session's, at the same positions."""
    return (descriptor.stream_id, descriptor.session_id, descriptor.initial_term_id,
            descriptor.term_length)


def missing_ranges(want: tuple[int, int], held: list[tuple[int, int | None]]
                   ) -> list[tuple[int, int]]:
    """``want`` less every range of ``held`` (``(start, end)``, ``end`` None: from ``start``
    on), in position order."""
    out = []
    position, end = want
    for start, stop in sorted(held, key=lambda r: r[0]):
        if position >= end:
            break
        if stop is not None and stop <= position:
            continue
        if start > position:
            out.append((position, min(start, end)))
        if stop is None:
            position = end
            break
        position = max(position, stop)
    if position < end:
        out.append((position, end))
    return out


@dataclass
class _Fetch:
    """One range being fetched from a peer (``replay`` None until the peer answered);
    ``fetch_id`` tags its replay request, so that a late answer to an earlier one is told
    apart; ``key`` names the missing range (peer, peer's recording, start) for the retry
    schedule."""

    fetch_id: int
    key: tuple[int, int, int]
    peer: Peer
    source: ListedRecording
    spec: RecordSpec
    start: int
    end: int
    since: float
    replay: ReplayOpened | None = None
    recording: Recording | None = None
    moved_at: float = 0.0
    last_position: int = -1


# -- what the service's thread asks of the caller's thread ----------------------------------
@dataclass(frozen=True)
class ListRecordings:
    """List peer ``peer``'s recordings of this archive's stream ids: answered by
    :class:`Listed`."""

    peer: int


@dataclass(frozen=True)
class OpenReplay:
    """Have peer ``peer`` replay ``[start, end)`` of its recording ``recording_id`` to this
    host, on ``stream_id`` with ``session_id``: answered by :class:`ReplayOpened` or
    :class:`ReplayRefused`, tagged ``fetch_id``."""

    peer: int
    fetch_id: int
    recording_id: int
    start: int
    end: int
    stream_id: int
    session_id: int


@dataclass(frozen=True)
class CloseReplay:
    """The service's thread is done with the replay of ``fetch_id`` (its subscription is
    handed back): stop it at the peer if ``stop`` (and the link is up), then close its
    subscription.  Answered by :class:`ReplayClosed`."""

    peer: int
    fetch_id: int
    stop: bool


_Request = ListRecordings | OpenReplay | CloseReplay


# -- what the caller's thread answers ---------------------------------------------------------
@dataclass(frozen=True)
class Listed:
    """Peer ``peer``'s recordings of this archive's stream ids (None: not connected, or it
    did not answer)."""

    peer: int
    recordings: list[ListedRecording] | None


@dataclass(frozen=True)
class ReplayOpened:
    """The replay :class:`OpenReplay` ``fetch_id`` asked for runs: ``subscription`` is handed
    to the service's thread, which alone reads it (its image of ``session_id``) until
    :class:`CloseReplay` hands it back."""

    peer: int
    fetch_id: int
    subscription: Subscription
    session_id: int

    def image(self) -> Image | None:
        """The replay's image, once it came (the service's thread)."""
        return self.subscription.image_by_session_id(self.session_id)


@dataclass(frozen=True)
class ReplayRefused:
    """The peer refused :class:`OpenReplay` ``fetch_id`` (or there is no link to it)."""

    peer: int
    fetch_id: int
    error: SlipstreamError


@dataclass(frozen=True)
class ReplayClosed:
    """:class:`CloseReplay` ran; ``error`` says why stopping or closing the replay failed
    (None: it did not), which the service's thread logs and counts."""

    peer: int
    fetch_id: int
    error: str | None


@dataclass(frozen=True)
class CallFailed:
    """``request`` raised ``error`` (a bug: logged on the caller's thread)."""

    request: _Request
    error: Exception


_Result = Listed | ReplayOpened | ReplayRefused | ReplayClosed | CallFailed


class _Caller:
    """The thread that makes the calls to the peers (each waits for an answer, up to
    ``timeout_s``), so that a peer that stops answering never holds the service's thread and
    its recordings.  It takes typed requests (:class:`ListRecordings`, :class:`OpenReplay`,
    :class:`CloseReplay`) and hands back typed results through queues.  It owns the links
    (an :class:`~slipstream.archive.client.ArchiveClient` each, used from one thread: this
    one) and the replays it opened; of a replay, the service's thread gets only its
    subscription, to read from :class:`ReplayOpened` until :class:`CloseReplay`."""

    def __init__(self, client: Client, peers: list[Peer], stream_ids: list[int], *,
                 timeout_s: float, reply_address: str | None,
                 reply_ports: dict[str | None, int | None]) -> None:
        self._client = client
        self._peers = peers
        self._stream_ids = stream_ids
        self._timeout_s = timeout_s
        self._reply_address = reply_address
        self._reply_ports = reply_ports
        # -- the caller thread's --
        self._links: dict[int, ArchiveClient] = {}
        self._replays: dict[int, ArchiveReplay] = {}  # by fetch id
        # -- the queues, both threads' --
        self.requests: queue.SimpleQueue[_Request | None] = queue.SimpleQueue()
        self.results: queue.SimpleQueue[_Result] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="archive-replication",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            request = self.requests.get()
            if request is None:
                break
            try:
                self.results.put(self._call(request))
            except Exception as e:  # told to the service's thread, never lost here
                log.exception("replication: a call failed")
                self.results.put(CallFailed(request, e))
        self._close_all()

    def stop(self, timeout_s: float) -> None:
        """No more requests: the thread ends once it made those queued, closing its replays
        and links (waited for at most ``timeout_s``)."""
        self.requests.put(None)
        self._thread.join(timeout_s)

    # -- the caller thread's ----------------------------------------------------------------
    def _call(self, request: _Request) -> _Result:
        peer = self._peers[request.peer]
        if isinstance(request, CloseReplay):
            link = self._links.get(request.peer)
            replay = self._replays.pop(request.fetch_id)
            try:
                replay.close(stop_at_archive=request.stop and link is not None
                             and link.is_connected)
            except SlipstreamError as e:
                return ReplayClosed(request.peer, request.fetch_id, str(e))
            return ReplayClosed(request.peer, request.fetch_id, None)
        link = self._link(request.peer)
        if isinstance(request, ListRecordings):
            if link is None or not link.is_connected:
                return Listed(request.peer, None)
            try:
                return Listed(request.peer, [r for stream_id in self._stream_ids
                                             for r in link.list_all_recordings(
                                                 stream_id=stream_id)])
            except SlipstreamError as e:  # CallError: not answering; a later look
                log.warning("replication: the peer %s: %s", peer, e)
            except (KeyError, ValueError, TypeError) as e:
                log.warning("replication: the peer %s answered what this archive cannot read "
                            "(%s: %s)", peer, type(e).__name__, e)
            return Listed(request.peer, None)
        if link is None:
            return ReplayRefused(request.peer, request.fetch_id, SlipstreamError("no link"))
        try:
            replay = link.replay(request.recording_id, start=request.start, end=request.end,
                                 stream_id=request.stream_id, session_id=request.session_id)
        except SlipstreamError as e:
            return ReplayRefused(request.peer, request.fetch_id, e)
        self._replays[request.fetch_id] = replay
        return ReplayOpened(request.peer, request.fetch_id, replay.subscription,
                            replay.started.session_id)

    def _link(self, index: int) -> ArchiveClient | None:
        link = self._links.get(index)
        if link is None:
            peer = self._peers[index]
            try:
                link = self._links[index] = ArchiveClient(
                    self._client, peer.address, peer.port, peer.control_stream_id,
                    timeout_s=self._timeout_s, reply_address=self._reply_address,
                    reply_port=self._reply_ports[peer.key], key=peer.key)
            except (SlipstreamError, OSError) as e:
                log.warning("replication: no link to the peer %s: %s", peer, e)
                return None
        return link

    def _close_all(self) -> None:
        """As the thread ends: the replays still open (their subscriptions handed back by
        then, or the service gone), then the links."""
        for replay in self._replays.values():
            with contextlib.suppress(SlipstreamError):
                replay.close(stop_at_archive=False)
        self._replays.clear()
        for link in self._links.values():
            link.close()
        self._links.clear()


class Replicator:
    """The service's catch-up from ``service.settings.peers`` (see the module): planning and
    the replica on the service's thread (:meth:`do_work`), the calls to the peers on a
    thread of its own (:class:`_Caller`, which owns the links and the replays), asked by
    typed requests and answering with typed results."""

    def __init__(self, service: ReplicatingArchive) -> None:
        settings = service.settings
        self._service = service
        self._peers = list(settings.peers)
        self._interval_ns = settings.replication_interval
        self._timeout_s = settings.replication_timeout / 1e9
        self._reply_address = settings.replication_address
        # Not the peer's port, as a caller elsewhere would: that is this archive's own
        # control port too when both use the same (the usual case).  A keyed peer's answers
        # come sealed, to an endpoint of that key: a port of its own.
        self._reply_ports = replication_reply_ports(settings.replication_port,
                                                    settings.control_port, settings.peers)
        self._key_mismatches: set[tuple[int, str]] = set()  # peers' recordings not taken
        self._next_look_ns = time.monotonic_ns() + self._interval_ns
        self._looking = 0  # peers asked for their recordings, answers not yet in
        self._fetch: _Fetch | None = None
        self._fetch_ids = 0  # the last fetch's id
        # Ranges whose fetch failed: (peer, peer's recording, start) -> (failures, the
        # monotonic time before which it is not asked for again).
        self._failures: dict[tuple[int, int, int], tuple[int, float]] = {}
        # A fetch's replay kept until its image goes: (peer, replay, deadline, stop it).
        self._draining: tuple[ReplayOpened, float, bool] | None = None
        self.looked = 0  # the peers' lists of recordings taken (a look at a peer each)
        self.fetched = 0  # fetches that completed their range
        self.cut_short = 0  # fetches that ended before their range's end
        self.closes_failed = 0  # replays whose stop at the peer or close failed
        self._caller = _Caller(
            service.client, settings.peers,
            sorted({spec.stream_id for spec in settings.records}),
            timeout_s=self._timeout_s, reply_address=self._reply_address,
            reply_ports=self._reply_ports)

    @property
    def fetching(self) -> bool:
        return self._fetch is not None

    def do_work(self, now_ns: int) -> int:
        """Take the peers' answers, move the fetch in progress, or ask the peers for their
        recordings when it is time; returns the work done (0: none)."""
        work = self._take_results()
        if self._draining is not None:
            replay, deadline, stop = self._draining
            image = replay.image()
            if image is not None and not image.is_closed and time.monotonic() < deadline:
                return work
            self._draining = None
            self._caller.requests.put(CloseReplay(replay.peer, replay.fetch_id, stop))
        if self._fetch is not None:
            return work + self._move(self._fetch, time.monotonic())
        if now_ns < self._next_look_ns or self._looking:
            return work
        self._next_look_ns = now_ns + self._interval_ns
        for index in range(len(self._peers)):
            self._looking += 1
            self._caller.requests.put(ListRecordings(index))
        return work + 1

    # -- planning (the service's thread) ----------------------------------------------------
    def _take_results(self) -> int:
        work = 0
        while True:
            try:
                result = self._caller.results.get_nowait()
            except queue.Empty:
                return work
            work += 1
            if isinstance(result, Listed):
                self._looking -= 1
                self.looked += result.recordings is not None
                # Not while a replay drains: the next fetch might be the same session's, to
                # the same endpoint (a later look plans it).
                if (result.recordings is not None and self._fetch is None
                        and self._draining is None):
                    self._plan(result.peer, result.recordings)
            elif isinstance(result, ReplayOpened | ReplayRefused):
                fetch = self._fetch
                if fetch is None or fetch.fetch_id != result.fetch_id or fetch.replay is not None:
                    # The answer to a fetch given up meanwhile: its replay is nobody's.
                    if isinstance(result, ReplayOpened):
                        self._caller.requests.put(CloseReplay(result.peer, result.fetch_id,
                                                              True))
                    continue
                if isinstance(result, ReplayRefused):
                    self._end(fetch, f"the peer refused the replay: {result.error}")
                else:
                    fetch.replay = result
                    fetch.since = fetch.moved_at = time.monotonic()
            elif isinstance(result, ReplayClosed):
                if result.error is not None:
                    self.closes_failed += 1
                    log.warning("replication: closing fetch %d's replay from the peer %s "
                                "failed: %s", result.fetch_id, self._peers[result.peer],
                                result.error)
            elif isinstance(result, CallFailed):
                request = result.request
                if isinstance(request, ListRecordings):
                    self._looking -= 1
                elif isinstance(request, OpenReplay) and self._fetch is not None and \
                        self._fetch.fetch_id == request.fetch_id:
                    self._end(self._fetch, f"the call failed: {result.error}")

    def _spec_for(self, descriptor: RecordingDescriptor) -> RecordSpec | None:
        """The ``[[record]]`` a peer's recording is one of this archive's streams by: the
        same stream id (the channels may differ: with MDC or multicast each host subscribes
        at its own endpoint), the same channel where several tables share the stream id."""
        spec = spec_of(self._service.settings.records, descriptor.stream_id,
                       descriptor.channel)
        if spec is not None and channel_key(spec.channel) != channel_key(descriptor.channel):
            # A replica is answered as its [[record]]'s channel says: a keyed recording
            # under a plain (or another key's) table would be served to callers without
            # its key.
            if (descriptor.recording_id, descriptor.channel) in self._key_mismatches:
                return None
            self._key_mismatches.add((descriptor.recording_id, descriptor.channel))
            log.warning("replication: recording %d at a peer is of key=%s, this archive's "
                        "[[record]] of stream %d of key=%s: not replicated",
                        descriptor.recording_id, channel_key(descriptor.channel),
                        descriptor.stream_id, channel_key(spec.channel))
            return None
        return spec

    def _held_here(self, key: SessionKey) -> list[tuple[int, int | None]]:
        held: list[tuple[int, int | None]] = []
        for descriptor in self._service.catalog.recordings():
            if session_key(descriptor) != key:
                continue
            if descriptor.stop_position == NULL_POSITION:
                held.append((descriptor.start_position, None))  # it records what comes
            elif descriptor.stop_position > descriptor.start_position:
                held.append((descriptor.start_position, descriptor.stop_position))
        return held

    def _plan(self, index: int, listed: list[ListedRecording]) -> None:
        """Ask the peer for the first range it holds and this archive lacks, if any, leaving
        out the ranges waiting to be tried again after a failure and those given up."""
        now = time.monotonic()
        for source in listed:
            descriptor = source.descriptor
            spec = self._spec_for(descriptor)
            if spec is None:
                continue
            end = descriptor.stop_position if not descriptor.is_active \
                else source.recorded_position
            missing = missing_ranges((descriptor.start_position, end),
                                     self._held_here(session_key(descriptor)))
            for missing_start, missing_end in missing:
                key = (index, descriptor.recording_id, missing_start)
                failures, retry_at = self._failures.get(key, (0, 0.0))
                if failures >= MAX_FAILURES or now < retry_at:
                    continue
                try:
                    widened = self._whole_messages(descriptor, missing_start, missing_end)
                except (OSError, ValueError) as e:  # this archive's own segments unreadable
                    self._failed(key, f"its seams could not be read here: {e}")
                    continue
                if widened is None:
                    continue  # postponed: see _whole_messages
                self._start(index, key, source, spec, *widened)
                return

    def _start(self, index: int, key: tuple[int, int, int], source: ListedRecording,
               spec: RecordSpec, start: int, end: int) -> None:
        descriptor = source.descriptor
        peer = self._peers[index]
        self._fetch_ids += 1
        self._fetch = _Fetch(self._fetch_ids, key, peer, source, spec, start, end,
                             time.monotonic())
        self._caller.requests.put(OpenReplay(index, self._fetch_ids, descriptor.recording_id,
                                             start, end, descriptor.stream_id,
                                             descriptor.session_id))
        log.info("replication: fetching [%d, %d) of session %d stream %d from recording %d "
                 "at the peer %s", start, end, descriptor.session_id, descriptor.stream_id,
                 descriptor.recording_id, peer)

    def _failed(self, key: tuple[int, int, int], why: str) -> None:
        """A fetch of the range ``key`` names brought nothing: it waits before it is asked
        for again, longer each time, and is given up after :data:`MAX_FAILURES`."""
        failures = self._failures.get(key, (0, 0.0))[0] + 1
        delay = min(RETRY_BASE_S * 2 ** (failures - 1), RETRY_MAX_S)
        self._failures[key] = (failures, time.monotonic() + delay)
        peer = self._peers[key[0]]
        if failures >= MAX_FAILURES:
            log.error("replication: gave up fetching from position %d of recording %d at the "
                      "peer %s after %d failures (the last: %s); the rest is fetched, this "
                      "range not until the archive restarts", key[2], key[1], peer, failures,
                      why)
        else:
            log.warning("replication: the fetch from position %d of recording %d at the peer "
                        "%s failed (%s); tried again in %g s", key[2], key[1], peer, why, delay)

    def _whole_messages(self, source: RecordingDescriptor, start: int, end: int
                        ) -> tuple[int, int] | None:
        """``[start, end)`` widened to whole messages where a recording of this archive
        stops at ``start`` or begins at ``end`` inside one (see the module), within the
        peer's recording ``source``; None (fetch it later) while a live recording of this
        archive beginning at ``end`` holds frames from there but no message's first
        fragment yet: the replica would otherwise stop inside a message for good."""
        service = self._service
        key = session_key(source)
        for descriptor in service.catalog.recordings():
            if session_key(descriptor) != key:
                continue
            if descriptor.stop_position == start and start > source.start_position:
                start = max(stop_message_start(service.directory, descriptor, start),
                            source.start_position)
            if descriptor.start_position == end:
                recording = service.recordings.get(descriptor.recording_id)
                live = recording is not None and recording.is_active
                recorded = recording.recorded_position if recording is not None else \
                    descriptor.stop_position
                found = first_message_start(service.directory, descriptor, end, recorded)
                if found is None and live and recorded > end:
                    # Frames past J and none begins a message: J lies inside one whose
                    # rest is recorded, and the next message is still to come.  (Nothing
                    # past J: the publisher has sent nothing since J, which it offered
                    # whole, so J is taken as the boundary it almost always is.)
                    return None
                end = end if found is None else found
        peer_end = source.stop_position if not source.is_active else None
        if peer_end is not None:
            end = min(end, peer_end)
        return start, end

    # -- the fetch (the service's thread) ---------------------------------------------------
    def _move(self, fetch: _Fetch, now: float) -> int:
        if fetch.replay is None:  # the peer's answer not in yet (the caller's timeout)
            if now - fetch.since > FETCH_STALL_S + self._timeout_s:
                self._end(fetch, "the peer did not answer")
            return 0
        image = fetch.replay.image()
        if fetch.recording is None:
            if image is not None and not image.is_closed:
                try:
                    holds = image.producer_position() > fetch.start
                except SlipstreamError:  # ClosedError: it went meanwhile
                    holds = False
                if holds:  # the replica is made (in the catalog) once there is data for it
                    return self._begin(fetch, image)
                if image.is_end_of_stream:
                    self._end(fetch, "its replay ended with nothing")
                    return 0
            if now - fetch.since > FETCH_STALL_S:
                self._end(fetch, f"its replay brought nothing within {FETCH_STALL_S:g} s")
            return 0
        recording = fetch.recording
        if not recording.is_active:  # a write failed: the service logged why
            self._end(fetch, recording.error or "the replica stopped")
            return 0
        position = recording.writer.position
        if position != fetch.last_position:
            fetch.last_position = position
            fetch.moved_at = now
        if image is None or image.is_closed:
            self._end(fetch, "its replay's image went (the peer stopped answering)")
        elif image.is_end_of_stream:
            self._end(fetch, None if position >= fetch.end else
                      "its replay ended early (the peer stopped it, or went)")
        elif now - fetch.moved_at > FETCH_STALL_S:
            self._end(fetch, f"its replay did not move for {FETCH_STALL_S:g} s")
        return 0

    def _begin(self, fetch: _Fetch, image: Image) -> int:
        descriptor = fetch.source.descriptor
        found = (image.stream_id, image.session_id, image.initial_term_id, image.term_length,
                 image.position)
        wanted = (*session_key(descriptor), fetch.start)
        if found != wanted:
            # Not the recording's frames at its positions: nothing of it is written.
            self._end(fetch, f"its replay is stream, session, initial term id, term length "
                             f"and position {found}, not the recording's {wanted}")
            return 0
        service = self._service
        settings = service.settings
        peer = fetch.peer
        try:
            recording = Recording(
                service.catalog, service.directory, image, fetch.spec.channel,
                segment_length=settings.segment_length, sync=settings.sync,
                sync_interval_ns=settings.sync_interval,
                block_length=settings.block_length, on_position=service.position_moved,
                write_behind=settings.write_behind,
                source_identity=f"replica of recording {descriptor.recording_id} at {peer}",
                stops_at_end_of_stream=False)
        except (OSError, ValueError, SlipstreamError) as e:
            # The catalog full or failing (a full disk): this fetch ends, the archive and its
            # live recordings go on; the range is tried again later.
            self._end(fetch, f"its replica could not be made here: {e}")
            return 0
        fetch.recording = recording
        service.adopt(recording)
        return 1

    def _end(self, fetch: _Fetch, failure: str | None) -> None:
        """End ``fetch``: its replica stopped with the reason its end gives, its replay's
        subscription closed; ``failure`` says why it ended short (None: it is whole)."""
        self._fetch = None
        recording = fetch.recording
        source = fetch.source.descriptor
        if recording is not None and recording.is_active:
            recording.poll()  # whatever the image still holds
            position = recording.writer.position
            reason = EndReason.STOPPED
            if position == source.stop_position and source.end_reason in _SESSION_ENDS:
                reason = source.end_reason
            recording.stop(reason)
        reached = recording.writer.position if recording is not None else fetch.start
        if failure is not None and reached <= fetch.start:
            self._failed(fetch.key, failure)
        if fetch.replay is not None:
            # Kept until its image goes: the receiver tells the peer the stream ended (so its
            # publication goes at once), and the next fetch of the session, with the same
            # session id to the same endpoint, meets no image of this one.  A fetch that
            # failed has its replay stopped at the peer then, if it still runs.
            self._draining = (fetch.replay, time.monotonic() + DRAIN_S, failure is not None)
        if failure is None:
            self.fetched += 1
            self._next_look_ns = 0  # the next hole at once
            log.info("replication: fetched [%d, %d) of session %d from the peer %s into "
                     "recording %d", fetch.start, fetch.end, source.session_id,
                     fetch.peer, recording.recording_id if recording else -1)
        else:
            self.cut_short += 1
            log.warning("replication: the fetch of [%d, %d) of session %d from the peer %s "
                        "ended at %d: %s; the rest at a later look", fetch.start, fetch.end,
                        source.session_id, fetch.peer, reached, failure)

    def close(self) -> None:
        """Stop a fetch in progress (its replica stopped where it is), then the caller's
        thread and its links (waiting at most a call's timeout for it)."""
        if self._fetch is not None:
            self._end(self._fetch, "the archive stopped")
        if self._draining is not None:
            replay, _, stop = self._draining
            self._draining = None
            self._caller.requests.put(CloseReplay(replay.peer, replay.fetch_id, stop))
        self._caller.stop(self._timeout_s + 1.0)
