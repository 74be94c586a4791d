"""The holder's side of replays: :class:`ReplayServer` takes requests on its control stream,
answers them and publishes each range, block by block where it can, message by message where
it must (see :mod:`slipstream.client.replay` for the exchange).  Calls about held streams are
the archive's (:mod:`slipstream.archive.holding`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Final

from slipstream.client._native import lib
from slipstream.client.client import Client
from slipstream.client.errors import DataLossError, SlipstreamError
from slipstream.client.holding import small_channel
from slipstream.client.image import Image
from slipstream.client.layout import FRAME_ALIGNMENT, HDR_TYPE_PAD, HEADER_LENGTH, PARTITION_COUNT
from slipstream.client.logbuffer import LogIdentity, compute_term_id
from slipstream.client.messages import GatheredMessages
from slipstream.client.publication import (
    ADMIN_ACTION,
    CLOSED,
    ExclusivePublication,
    Publication,
)
from slipstream.client.replay.protocol import (
    COMPLETE,
    LOST,
    REFUSED,
    REPLAYING,
    WAIT_SPIN_NS,
    ReplayError,
    ReplayRequest,
)
from slipstream.client.retention import first_retained, is_retained, message_start
from slipstream.client.subscription import Subscription

__all__ = ["ReplayServer", "positioned_channel"]

log = logging.getLogger("slipstream.client.replay")

_CHUNK_MESSAGES: Final = 4096  # messages per offer_batch of a replay (at most one term's)
#: The most a replay's log takes of the source's per block copy (``ss_append_block``), and
#: per turn of the holder's loop: a block is published (the sender may send it) before the
#: next is copied, and other replays get their turn.
_BLOCK_BYTES: Final = 1 << 20
_ADVANCE_BYTES: Final = 8 << 20
#: A replay's first block: the sender may start on it while the next (twice as long, up to
#: :data:`_BLOCK_BYTES`) is copied, and the reader gets its first messages the sooner.
_FIRST_BLOCK_BYTES: Final = 64 << 10
_CONNECT_TIMEOUT_S: Final = 10.0  # how long a holder waits for a reader's subscriptions
#: How long a holder keeps the answer publication of a reader that keeps its streams, after
#: its last replay.
_RESPONSE_IDLE_S: Final = 60.0
#: How often a server runs its owner's housekeeping (unmapping the logs of ended sessions),
#: s: whether or not requests come.
_HOUSEKEEPING_S: Final = 1.0


def positioned_channel(channel: str, log: LogIdentity, mtu: int, position: int) -> str:
    """``channel`` with the URI keys that start a publication at ``position`` of a log
    framed like ``log`` (same initial term id, term length and MTU: the same positions)."""
    bits = log.term_length.bit_length() - 1
    term_id = compute_term_id(position, bits, log.initial_term_id)
    # Sparse: the log is as long as the source's (the positions need its term length), but a
    # replay writes only its range; a dense one would be zeroed whole first.
    joint = "|" if "?" in channel else "?"  # aeron:ipc has no parameters yet
    return (f"{channel}{joint}init-term-id={log.initial_term_id}|term-id={term_id}"
            f"|term-offset={position % log.term_length}|term-length={log.term_length}"
            f"|mtu={mtu}|sparse=true")


class _BlockError(ReplayError):
    """The replay's log is not where the source's position is: the replay is refused."""


def _padding_inside(position: int, where: str) -> str:
    """Why a range with padding inside a term is refused."""
    return (f"the range holds padding inside a term {where} position {position}, which a "
            f"replay does not reproduce: read it on the holder's host")


def _padding_end(image: Image, position: int, end: int) -> int | None:
    """Where the padding from the frame boundary ``position`` ends, within its term and at most
    ``end``; None when no padding is there.  Each length is checked against the term before it
    is stepped over (another process wrote it)."""
    term = image.term_length
    at = position
    while at < end:
        offset = at % term
        length, _, _, frame_type = image.frame_header(at)[:4]
        if frame_type != HDR_TYPE_PAD or not HEADER_LENGTH <= length <= term - offset:
            break
        at += (length + FRAME_ALIGNMENT - 1) & -FRAME_ALIGNMENT
        if at % term == 0:
            break
    return None if at == position else min(at, end)


class _Session:
    """One replay in progress at the holder: connect, answer, send, close."""

    def __init__(self, request: ReplayRequest, image: Image, mtu: int, begin: int,
                 response: Publication, deadline: float) -> None:
        self.request = request
        self.image = image
        self.response = response
        self.answer: bytes | None = self.request.answer(REPLAYING, start=begin)
        self.data: ExclusivePublication | None = None
        self.mtu = mtu
        self.begin = begin
        self.position = begin  # the next position to copy or offer from
        self.deadline = deadline
        # Where a block cannot go, the log read message by message from ``position``, with a
        # position of its own (made when needed: blocks move ``position`` without it).
        self.probe: Image | None = None
        self.pending: GatheredMessages | None = None  # a chunk not yet wholly offered
        self.pending_from = 0  # how many messages of it went
        self.last_end = begin  # the end of the last message offered
        self.completed = False  # every message went; the answer says where the last ends
        self.refused = False  # counted in the server's ``refused`` (once per session)

    def close(self) -> None:
        """Close the replay's publication (the answer publication is the server's)."""
        if self.data is not None:
            self.data.close()


class _Responses:
    """The holder's answer publications, by reply channel and response stream.  A reader
    that keeps its streams (its requests carry an id) keeps its response stream too: its
    publication stays here while replays use it and up to :data:`_RESPONSE_IDLE_S` after,
    so that the next replay's answer goes at once, on a connected stream.  One for a request
    without an id goes when its replay does, as before."""

    def __init__(self, client: Client) -> None:
        self._client = client
        # key -> [publication, replays using it, when the last of them ended, kept]
        self._entries: dict[tuple[str, int], list[Any]] = {}

    def take(self, request: ReplayRequest) -> Publication:
        """The answer publication of ``request`` (made when there is none); raises
        SlipstreamError as ``add_publication`` does."""
        key = (request.reply_channel, request.response_stream_id)
        entry = self._entries.get(key)
        if entry is not None and entry[0].is_closed:
            del self._entries[key]
            entry = None
        if entry is None:
            publication = self._client.add_publication(small_channel(request.reply_channel),
                                                       request.response_stream_id)
            entry = self._entries[key] = [publication, 0, 0.0, False]
        entry[1] += 1
        entry[3] = entry[3] or request.request_id is not None
        return entry[0]

    def give_back(self, request: ReplayRequest, publication: Publication) -> None:
        """A replay that took ``publication`` for ``request`` ended (an entry made anew since,
        for a publication that had closed, is not that replay's)."""
        key = (request.reply_channel, request.response_stream_id)
        entry = self._entries.get(key)
        if entry is None or entry[0] is not publication:
            return
        entry[1] -= 1
        entry[2] = time.monotonic()
        if entry[1] <= 0 and not entry[3]:
            entry[0].close()
            del self._entries[key]

    def do_work(self) -> None:
        """Close what no replay used for :data:`_RESPONSE_IDLE_S`, or sooner once idle with
        nobody at the other end (the reader closed its link: a failed replay does, and the
        next asks on a new response stream)."""
        if not self._entries:
            return
        now = time.monotonic()
        for key, entry in list(self._entries.items()):
            if entry[1] <= 0 and (now - entry[2] > _RESPONSE_IDLE_S
                                  or (now - entry[2] > 1.0 and not entry[0].is_connected)):
                entry[0].close()
                del self._entries[key]

    def close(self) -> None:
        for entry in self._entries.values():
            entry[0].close()
        self._entries.clear()


class ReplayServer:
    """The holder's side: serves replays of the logs ``lookup`` names, requested on the
    control stream ``control_stream_id`` at ``endpoint=address:port``.

    ``lookup(stream_id, session_id)`` returns the image whose log to replay (an image of a
    subscription that holds the range, or :meth:`Image.detached` on its log), or None.
    :meth:`do_work` runs the exchange without blocking; call it from one thread, with a
    client used by no other thread (:meth:`run` loops it); it calls ``housekeeping()``, the
    owner's (drop what ``lookup`` mapped for sessions that ended), about once a second.
    ``served`` counts replays sent whole, ``refused`` requests answered ``lost`` or
    ``refused`` or dropped as malformed.
    """

    def __init__(self, client: Client, address: str, port: int, control_stream_id: int,
                 lookup: Callable[[int, int], Image | None],
                 housekeeping: Callable[[], object] | None = None) -> None:
        self.client = client
        self.address = address
        self.port = port
        self.control_stream_id = control_stream_id
        self.control_channel = f"aeron:udp?endpoint={address}:{port}"
        self._lookup = lookup
        self._housekeeping = housekeeping
        self._next_housekeeping = 0.0
        self._responses = _Responses(client)
        self._control: Subscription = client.add_subscription(self.control_channel,
                                                              control_stream_id)
        self._sessions: list[_Session] = []
        self._requests: list[bytes] = []
        self.served = 0
        self.refused = 0

    @property
    def replaying(self) -> int:
        """How many replays are in progress (their images are being read)."""
        return len(self._sessions)

    @property
    def logs_in_use(self) -> set[str]:
        """The paths of the logs replays in progress read: a lookup's mapping of one of these
        must stay mapped until they end."""
        return {session.image.log_path for session in self._sessions
                if session.image is not None}

    def close(self) -> None:
        """Stop serving: replays in progress end (their readers see the stream end early)."""
        for session in self._sessions:
            session.close()
        self._sessions.clear()
        self._responses.close()
        self._control.close()

    def run(self, stopping: Callable[[], bool], idle_s: float = 0.001,
            parked_s: float = 0.5) -> None:
        """Serve until ``stopping()`` is true.  With nothing to do, it waits for a request up to
        ``idle_s`` while replays are in progress (their credit comes back unannounced), and
        up to ``parked_s`` otherwise (a request wakes it at once), parked, never spinning
        (:data:`WAIT_SPIN_NS`): an idle holder costs no CPU worth counting."""
        while not stopping():
            if self.do_work() == 0:
                self.wait_for_request(idle_s, parked_s)

    def wait_for_request(self, idle_s: float, parked_s: float,
                         spin_ns: int | None = WAIT_SPIN_NS) -> None:
        """Wait for a request on the control stream up to ``idle_s`` while replays or answers
        are in progress (their credit comes back unannounced), else up to ``parked_s`` (a
        request wakes it at once); ``spin_ns`` as :meth:`Subscription.wait_for_data` takes it
        (None: the client's), by default none."""
        wait = idle_s if self._sessions else parked_s
        self._control.wait_for_data(int(wait * 1e9), spin_ns)

    def do_work(self) -> int:
        """Take new requests, move every replay on; returns how much was done."""
        work = self._control.poll(lambda data, _header: self._requests.append(bytes(data)), 16)
        for data in self._requests:
            request: ReplayRequest | None = None
            try:
                try:
                    request = ReplayRequest.decode(data)
                except ValueError as e:
                    self._refuse(f"malformed request ({e})", None)
                    continue
                self._start(request)
            except Exception as e:  # answered, so that the reader fails at once with it
                log.exception("slipstream replay: a request could not be served")
                self._refuse(f"the request could not be served ({type(e).__name__}: {e}); "
                             f"the holder's log says more", request)
        self._requests.clear()
        self._responses.do_work()
        if self._housekeeping is not None and time.monotonic() >= self._next_housekeeping:
            self._next_housekeeping = time.monotonic() + _HOUSEKEEPING_S
            self._housekeeping()
        for session in list(self._sessions):
            try:
                work += self._advance(session)
            except Exception as e:
                log.warning("slipstream replay: %s [%d, %d) ended: %s",
                            session.request.reply_channel, session.request.start,
                            session.request.end, e)
                if session.data is None:  # failed answering, or finishing: nothing to say
                    if not session.refused:
                        self.refused += 1
                    self._finish(session, served=False)
                else:  # the reader is told why its data stream ends
                    work += self._stop_refused(
                        session, f"the replay failed at the holder ({type(e).__name__}: {e}); "
                                 f"the holder's log says more")
        return work

    def _refuse(self, why: str, request: ReplayRequest | None, status: str = REFUSED,
                **fields: object) -> None:
        self.refused += 1
        log.warning("slipstream replay: request refused: %s", why)
        if request is None:
            return
        try:  # an answer, so that the reader fails at once with the reason
            response = self._responses.take(request)
        except SlipstreamError as e:
            log.warning("slipstream replay: cannot answer %s: %s", request.reply_channel, e)
            return
        session = _Session(request, None, 0, 0, response,  # type: ignore[arg-type]
                           time.monotonic() + _CONNECT_TIMEOUT_S)
        session.answer = session.request.answer(status, message=why, **fields)
        session.position = request.end  # nothing to send
        session.refused = True
        self._sessions.append(session)

    def _start(self, r: ReplayRequest) -> None:
        where = (f"stream {r.stream_id} session {r.log.session_id} [{r.start}, {r.end})")
        image = self._lookup(r.stream_id, r.log.session_id)
        if image is None:
            why = (f"{where}: this holder holds no log of that session (its stream ended and "
                   f"the log went)")
            if r.skip_lost:
                self._refuse(why, r, status=REPLAYING, start=r.end, lost=[r.start, r.end])
            else:
                self._refuse(why, r, status=LOST, lost=[r.start, r.end])
            return
        if image.identity != r.log:
            self._refuse(f"{where}: this holder's log of that session is another one "
                         f"({image.identity}, asked for {r.log})", r)
            return
        producer = image.producer_position()
        if r.end > producer:
            self._refuse(f"{where}: the log reaches only {producer}", r)
            return
        lost_to = r.start  # the first position the log still holds
        while True:
            if lost_to < r.end and not is_retained(image, lost_to):
                if not r.skip_lost:
                    self._refuse(f"{where}: the log no longer holds position {lost_to} (the "
                                 f"publisher is at {producer})", r, status=LOST,
                                 lost=[r.start, r.end], producer=producer)
                    return
                lost_to = first_retained(image, lost_to, r.end)
            # The replay must begin where a message does: its first frame takes the position
            # the publication starts at (what a peek skips, the rest of a cut message, it
            # never sends).
            begin = message_start(image, lost_to, r.end)
            # message_start read the frames from lost_to on; they were whole if the log still
            # holds lost_to after it (the cleaner zeroes forward, and a frame it zeroed reads
            # as not written yet, which would end the range there with nothing sent).
            if lost_to >= r.end or is_retained(image, lost_to):
                break
        try:
            response = self._responses.take(r)
        except SlipstreamError as e:
            self._refuse(f"{where}: cannot publish to {r.reply_channel}: {e}", None)
            return
        session = _Session(r, image, image.mtu, begin, response,
                           time.monotonic() + _CONNECT_TIMEOUT_S)
        try:
            replaying: dict[str, object] = {"start": begin}
            if lost_to != r.start:
                replaying["lost"] = [r.start, lost_to]
            if begin < r.end:
                try:
                    # Exclusive: a block copy claims the tail after writing past it.
                    session.data = self.client.add_exclusive_publication(
                        positioned_channel(r.reply_channel, r.log, session.mtu, begin),
                        r.data_stream_id)
                except SlipstreamError as e:
                    session.answer = session.request.answer(
                        REFUSED, message=f"{where}: cannot publish the replay to "
                                         f"{r.reply_channel}: {e}")
                    session.position = r.end
                    session.refused = True
                    self.refused += 1
                    self._sessions.append(session)
                    return
                replaying["session_id"] = session.data.session_id  # its image at the reader
            session.answer = session.request.answer(REPLAYING, **replaying)
        except BaseException:  # the caller answers why: what this replay took goes back
            session.close()
            self._responses.give_back(r, response)
            raise
        self._sessions.append(session)

    def _finish(self, session: _Session, *, served: bool) -> None:
        session.close()
        self._responses.give_back(session.request, session.response)
        self._sessions.remove(session)
        if served:
            self.served += 1

    def _advance(self, session: _Session) -> int:
        """Answer once the reader listens, then copy the range into the replay block by block
        (:meth:`_blocks`), and offer it chunk by chunk (:meth:`_chunk`) where a block cannot
        go."""
        if session.answer is not None:
            if not session.response.is_connected:
                if time.monotonic() > session.deadline:
                    log.warning("slipstream replay: the reader at %s never subscribed; "
                                "dropped", session.request.reply_channel)
                    self._finish(session, served=False)
                return 0
            if session.response.offer(session.answer) < 0:
                return 0
            session.answer = None
        request = session.request
        if session.data is None or session.completed:
            self._finish(session, served=session.completed)
            return 1
        if not session.data.is_connected:
            if time.monotonic() > session.deadline:
                self._finish(session, served=False)
            return 0
        if session.pending is None:
            try:
                moved = self._blocks(session, request.end)
                if moved is None:
                    after = _padding_end(session.image, session.position, request.end)
                    if after is None:  # not padding: message by message from here
                        session.pending = self._chunk(session, request.end)
                    elif after < request.end:
                        return self._stop_refused(session,
                                                  _padding_inside(session.position, "at"))
                    else:  # the range ends with padding: it is sent, up to its last message
                        session.position = request.end
                elif session.position < request.end:
                    return 1 if moved else 0
            except _BlockError as e:
                return self._stop_refused(session, str(e))
            except DataLossError as e:
                return self._stop(session, session.request.answer(
                    LOST, message=f"the log no longer holds position {session.position} "
                                  f"(the publisher is at {e.producer_position})",
                    lost=[session.position, request.end], producer=e.producer_position))
            if session.pending is None:  # the range is sent: say where its last message ends
                session.answer = session.request.answer(COMPLETE, end=session.last_end)
                session.completed = True
                return 1
            session.pending_from = 0
        chunk, first = session.pending, session.pending_from
        if first == 0:
            done = session.data.offer_batch(chunk.data, chunk.lengths,
                                            reserved_values=chunk.reserved_values)
        else:  # the rest of a chunk the window cut
            done = session.data.offer_batch(memoryview(chunk.data)[chunk.offsets[first]:],
                                            chunk.lengths[first:],
                                            reserved_values=chunk.reserved_values[first:])
        if done <= 0:
            return 0
        session.pending_from += done
        if session.pending_from == len(chunk):
            session.last_end = chunk.positions[-1]
            assert session.probe is not None  # _chunk read the pending chunk through it
            session.position = session.probe.position
            session.pending = None
            if session.data.position != session.last_end:
                return self._stop_refused(session, _padding_inside(session.last_end, "before"))
        return 1

    def _stop_refused(self, session: _Session, why: str) -> int:
        """Stop sending the replay and tell the reader ``why``."""
        return self._stop(session, session.request.answer(REFUSED, message=why))

    def _stop(self, session: _Session, answer: bytes) -> int:
        """Stop sending the replay (its data stream ends) and send the reader ``answer``, which
        says why; the session ends once the answer went (:meth:`_advance` offers it until it
        goes, as every answer)."""
        session.answer = answer
        session.completed = False
        if session.data is not None:
            session.data.close()
            session.data = None
        if not session.refused:
            session.refused = True
            self.refused += 1
        return 1

    @staticmethod
    def _blocks(session: _Session, end: int) -> int | None:
        """Copy the range from the session's position into the replay's log as it is, frames
        and padding at a term's end alike, a block (:data:`_BLOCK_BYTES`) per C call
        (``ss_append_block``: Aeron's ``offerBlock``) and up to :data:`_ADVANCE_BYTES` per
        call of this; returns the bytes copied (0: no credit now).  None when the frame at the
        position is not one a block copies (padding inside a term, a frame not written): the
        caller offers message by message from there.  Raises DataLossError when the log no
        longer holds the position, _BlockError when the replay is not at the log's position
        (each block checks it first), ReplayError when its publication is closed."""
        data = session.data
        assert data is not None
        source = session.image.log_buffer
        moved = 0
        for _ in range(_ADVANCE_BYTES // _BLOCK_BYTES + PARTITION_COUNT):
            position = session.position
            if position >= end or moved >= _ADVANCE_BYTES:
                break
            block = min(_BLOCK_BYTES, max(_FIRST_BLOCK_BYTES, position - session.begin))
            copied, code = data.append_block_from(source, position, end, block)
            if copied > 0:
                # Whole only if the log still held it all after the copy (the C half checks
                # the first frame; a cleaner zeroes the rest first): else the range is lost.
                session.image.check_retained(position)
                session.position = session.last_end = code  # copied: the position after
                moved += copied
                continue
            if code == ADMIN_ACTION:  # it rotated the replay's log into the next term
                continue
            if code == 0:  # not a frame a block copies, or the log changed under the copy
                if moved:
                    break
                session.image.check_retained(position)
                return None
            if code == lib.SS_INVALID_BATCH:
                raise _BlockError(f"the replay's log is at position {data.position}, not at "
                                  f"the log's {position}: the replay is framed otherwise than "
                                  f"the log")
            if code == CLOSED:
                raise ReplayError("the replay's publication was closed")
            break  # no credit (back pressure, the reader not connected): later
        return moved

    @staticmethod
    def _chunk(session: _Session, end: int) -> GatheredMessages | None:
        """The next messages from the session's position (up to a chunk's worth), whole, in
        one C pass; None once the range is sent (padding at its end is stepped over).  Raises
        DataLossError when the log no longer holds them (checked after the copy: a lapping
        writer would have torn it)."""
        probe = session.probe
        if probe is None or probe.position != session.position:
            probe = session.probe = session.image.reader_at(session.position)
        chunk = probe.poll_gathered(_CHUNK_MESSAGES, end)
        session.image.check_retained(session.position)
        if chunk is None and probe.position < end:
            raise ReplayError(f"no whole message at position {probe.position} before {end}")
        return chunk
