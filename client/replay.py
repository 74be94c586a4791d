"""Replay: a range of a log sent again as a stream of its own, to a reader on another host.

A log lives in the shared memory of the host whose driver holds it.  A reader elsewhere gets a
position range of it as Aeron's archive replays a recording: it asks the **holder** (a process
on the log's host that serves replays, :class:`ReplayServer`) through its own host's driver, and
the holder publishes the range to a channel the reader names.  Everything travels over
slipstream's own protocol, so the replay has flow control and NAK repair like any stream.

The exchange (all of it UDP unicast between the two hosts' drivers):

1. The reader subscribes, on its own host, at ``endpoint=<its address>:<port>`` to a fresh
   **data** stream id, and to a **response** stream.
2. It publishes a :class:`ReplayRequest` (one JSON message) on the holder's **control** stream,
   ``endpoint=<holder address>:<port>``.
3. The holder answers one JSON message on the response stream: ``replaying`` from a position
   (the start, or with ``skip_lost`` the first position the log still holds) naming the data
   stream's session, or ``lost`` / ``refused`` with the reason.
4. It publishes the range on the data stream with a publication that starts at the range's
   start position and has the source log's initial term id, term length and MTU
   (``init-term-id``, ``term-id``, ``term-offset``, ``term-length``, ``mtu`` on its URI): every
   message is framed as it was, so it has the same position in the replay as in the log.  The
   reserved values go with the messages.  Then it closes the publication (the driver drains it
   to the reader and lingers for repairs).  A range the log stops holding mid-replay ends the
   data stream early and is answered ``lost`` on the response stream.

The control publication and the response subscription are the reader's **link** to the
holder, kept from one replay to the next (as a caller keeps its link for calls,
:mod:`slipstream.client.holding`), and the holder keeps its answer publication to such a
reader: a request carries an id, which every answer repeats, so that a late answer to an
earlier replay is told apart.  A replay then sets up only its data stream.

The reader reads the data stream until the range's end position and checks that it got there
(:class:`Replay`).  A replay is read once; a reader that failed asks again.  Requests are not
authenticated, like the streams themselves: keep the port inside the cluster's network.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any, Final

import attrs

from slipstream.client._native import ffi, lib
from slipstream.client.client import Client
from slipstream.client.errors import DataLossError, SlipstreamError
from slipstream.client.holding import (
    Answers,
    CallHandler,
    decode_call,
    reply_subscription_channel,
    small_channel,
)
from slipstream.client.layout import (
    BEGIN_FLAG,
    FRAME_ALIGNMENT,
    HDR_TYPE_PAD,
    HEADER_LENGTH,
    INT32_MAX,
    PARTITION_COUNT,
    SESSION_ID_FIELD,
)
from slipstream.client.logbuffer import LogIdentity, compute_term_id, index_by_position
from slipstream.client.messages import FragmentHandler, GatheredMessages
from slipstream.client.publication import ADMIN_ACTION, CLOSED, Publication
from slipstream.client.subscription import Image, Subscription

__all__ = [
    "REPLAY_VERSION",
    "LogIdentity",
    "Replay",
    "ReplayError",
    "ReplayLostError",
    "ReplayRequest",
    "ReplayServer",
    "earliest_position",
    "first_retained",
    "is_retained",
    "local_address_towards",
    "request_replay",
    "skip_message",
]

log = logging.getLogger("slipstream.client.replay")

#: The request format's version; a holder refuses requests of another.
REPLAY_VERSION: Final = 1
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
_ANSWER_AFTER_END_S: Final = 1.0  # how long a reader waits for the answer to an early end
#: How long a holder keeps the answer publication of a reader that keeps its streams, after
#: its last replay, and a reader keeps an idle link (:class:`_Link`).
_RESPONSE_IDLE_S: Final = 60.0
_LINK_IDLE_S: Final = 50.0
_IDLE_LINKS: Final = 4  # idle links a process keeps per holder and reply endpoint
#: How often a server runs its owner's housekeeping (unmapping the logs of ended sessions),
#: s: whether or not requests come.
_HOUSEKEEPING_S: Final = 1.0
#: How long the exchange's waits spin before they park (``spin_ns`` of ``wait_for_data``): not
#: at all.  What they wait for takes milliseconds (another host's driver making a stream, an
#: answer, the next stretch of a replay through two drivers), and the threads that bring it
#: need the cores a spinner holds: on a 2-core host, with the client's default 1 ms spin, a
#: replay of 100 messages took medians of 15-25 ms a run, parked 13-18 ms (five runs each,
#: alternating, load 2.5-4).
_WAIT_SPIN_NS: Final = 0
#: A DATA header's session id, stream id and term id, in a row from SESSION_ID_FIELD.
_HEADER_IDS: Final = struct.Struct("<iii")


class ReplayError(SlipstreamError):
    """A replay could not be had: the holder did not answer, refused, or the stream ended
    before the range did.  The message names the holder and the range."""


class ReplayLostError(ReplayError):
    """The holder's log no longer holds (part of) the range: ``lost`` is ``(from, to)``."""

    def __init__(self, message: str, lost: tuple[int, int]) -> None:
        self.lost = lost
        super().__init__(message)


# -- what a log still holds ---------------------------------------------------------------------
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
    a fragmented message (where the cleaner stopped) is read from the next whole one."""
    while position < end:
        length, _, flags, frame_type = image.frame_header(position)[:4]
        if length <= 0:
            return end  # not written yet: nothing begins before end
        if frame_type != HDR_TYPE_PAD and flags & BEGIN_FLAG:
            return position
        position += (length + FRAME_ALIGNMENT - 1) & -FRAME_ALIGNMENT
    return end


def earliest_position(image: Image) -> int:
    """The oldest message position the log still holds (at most ~3 terms back), at most the
    image's position."""
    return first_retained(image, -FRAME_ALIGNMENT, image.position)


# -- the request ----------------------------------------------------------------------------------
def _int_field(fields: dict[str, Any], name: str, low: int, high: int) -> int:
    value = fields.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{name!r} is {value!r}, not an integer in {low}..{high}")
    return value


@attrs.frozen
class ReplayRequest:
    """A reader's request: replay ``[start, end)`` of the log ``log`` of ``stream_id`` to
    ``reply_channel``, data on ``data_stream_id`` and the answer on ``response_stream_id``.
    ``skip_lost``: start at the first position still held when ``start`` is not (else the
    answer is ``lost``)."""

    stream_id: int
    log: LogIdentity
    start: int
    end: int
    reply_channel: str
    data_stream_id: int
    response_stream_id: int
    skip_lost: bool = False
    #: Set by a reader that keeps its response stream from one replay to the next
    #: (:class:`_Link`): the holder puts it in every answer, so that a late answer to an
    #: earlier replay on that stream is told apart, and keeps its answer publication for
    #: the next.  None: a response stream of this replay's own.
    request_id: int | None = None

    def encode(self) -> bytes:
        fields = {
            "version": REPLAY_VERSION, "stream_id": self.stream_id,
            "session_id": self.log.session_id, "initial_term_id": self.log.initial_term_id,
            "term_length": self.log.term_length, "start": self.start, "end": self.end,
            "reply_channel": self.reply_channel, "data_stream_id": self.data_stream_id,
            "response_stream_id": self.response_stream_id, "skip_lost": self.skip_lost,
        }
        if self.request_id is not None:
            fields["request_id"] = self.request_id
        return json.dumps(fields).encode()

    @classmethod
    def decode(cls, data: bytes) -> ReplayRequest:
        """Parse and check a request; raises ValueError saying what is wrong with it."""
        try:
            fields = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"not a JSON request: {e}") from None
        if not isinstance(fields, dict):
            raise ValueError("not a JSON object")
        if fields.get("version") != REPLAY_VERSION:
            raise ValueError(f"version {fields.get('version')!r} (this holder speaks "
                             f"{REPLAY_VERSION})")
        int32 = (-INT32_MAX - 1, INT32_MAX)
        start = _int_field(fields, "start", 0, 2**62)
        end = _int_field(fields, "end", 0, 2**62)
        term_length = _int_field(fields, "term_length", 1, 1 << 30)
        if end < start or start % FRAME_ALIGNMENT or end % FRAME_ALIGNMENT:
            raise ValueError(f"[{start}, {end}) is not a range of frame boundaries")
        reply = fields.get("reply_channel")
        if not isinstance(reply, str) or not reply.startswith("aeron:udp?"):
            raise ValueError(f"reply_channel {reply!r} is not a UDP channel URI")
        skip = fields.get("skip_lost", False)
        if not isinstance(skip, bool):
            raise ValueError(f"skip_lost {skip!r} is not a boolean")
        request_id = (None if fields.get("request_id") is None
                      else _int_field(fields, "request_id", 0, 2**63 - 1))
        return cls(_int_field(fields, "stream_id", *int32),
                   LogIdentity(_int_field(fields, "session_id", *int32),
                               _int_field(fields, "initial_term_id", *int32), term_length),
                   start, end, reply, _int_field(fields, "data_stream_id", *int32),
                   _int_field(fields, "response_stream_id", *int32), skip, request_id)


def _json_object(data: bytes) -> dict[str, Any] | None:
    """``data`` as a JSON object, or None when it is none."""
    try:
        fields = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    return fields if isinstance(fields, dict) else None


def _response(status: str, **fields: object) -> bytes:
    return json.dumps({"status": status, **fields}).encode()


def _positioned_channel(channel: str, log: LogIdentity, mtu: int, position: int) -> str:
    """``channel`` with the URI keys that start a publication at ``position`` of a log
    framed like ``log`` (same initial term id, term length and MTU: the same positions)."""
    bits = log.term_length.bit_length() - 1
    term_id = compute_term_id(position, bits, log.initial_term_id)
    # Sparse: the log is as long as the source's (the positions need its term length), but a
    # replay writes only its range; a dense one would be zeroed whole first.
    return (f"{channel}|init-term-id={log.initial_term_id}|term-id={term_id}"
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


# -- the holder -----------------------------------------------------------------------------------
class _Session:
    """One replay in progress at the holder: connect, answer, send, close."""

    def __init__(self, request: ReplayRequest, image: Image, mtu: int, begin: int,
                 response: Publication, deadline: float) -> None:
        self.request = request
        self.image = image
        self.response = response
        self.answer: bytes | None = self.respond("replaying", start=begin)
        self.data: Publication | None = None
        self.mtu = mtu
        self.begin = begin
        self.position = begin  # the next position to copy or offer from
        self.deadline = deadline
        # Where a block cannot go, the log read message by message from ``position``, with a
        # position of its own (made when needed: blocks move ``position`` without it).
        self.probe: Image | None = None
        self.result = ffi.new("int64_t *")  # ss_append_block's
        self.pending: GatheredMessages | None = None  # a chunk not yet wholly offered
        self.pending_from = 0  # how many messages of it went
        self.last_end = begin  # the end of the last message offered
        self.completed = False  # every message went; the answer says where the last ends
        self.refused = False  # counted in the server's ``refused`` (once per session)

    def respond(self, status: str, **fields: object) -> bytes:
        """An answer to this session's request (naming the request when it has an id)."""
        if self.request.request_id is not None:
            fields["request_id"] = self.request.request_id
        return _response(status, **fields)

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
                 calls: CallHandler | None = None,
                 housekeeping: Callable[[], None] | None = None) -> None:
        self.client = client
        self.address = address
        self.port = port
        self.control_stream_id = control_stream_id
        self.control_channel = f"aeron:udp?endpoint={address}:{port}"
        self._lookup = lookup
        self._calls = calls
        self._housekeeping = housekeeping
        self._next_housekeeping = 0.0
        self._answers = Answers(client)
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
        self._answers.close()
        self._responses.close()
        self._control.close()

    def run(self, stopping: Callable[[], bool], idle_s: float = 0.001,
            parked_s: float = 0.5) -> None:
        """Serve until ``stopping()`` is true.  With nothing to do, it waits for a request up to
        ``idle_s`` while replays are in progress (their credit comes back unannounced), and
        up to ``parked_s`` otherwise (a request wakes it at once), parked, never spinning
        (:data:`_WAIT_SPIN_NS`): an idle holder costs no CPU worth counting."""
        while not stopping():
            if self.do_work() == 0:
                wait = idle_s if self._sessions or self._answers.pending else parked_s
                self._control.wait_for_data(int(wait * 1e9), _WAIT_SPIN_NS)

    def do_work(self) -> int:
        """Take new requests, move every replay on; returns how much was done."""
        work = self._control.poll(lambda data, _header: self._requests.append(bytes(data)), 16)
        for data in self._requests:
            request: ReplayRequest | None = None
            try:
                fields = _json_object(data)
                if fields is not None and fields.get("kind") == "call":
                    self._call(fields)
                    continue
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
        work += self._answers.do_work()
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

    def _call(self, fields: dict[str, Any]) -> None:
        """Answer a call (:mod:`slipstream.client.holding`): a malformed one is counted and
        dropped, one this holder takes no calls of or that fails is answered with the error."""
        try:
            call_id, op, args, reply, stream = decode_call(fields)
        except ValueError as e:
            self._refuse(f"malformed call ({e})", None)
            return
        try:
            if self._calls is None:
                raise ValueError("this holder takes no calls, only replay requests")
            answer = {"id": call_id, "status": "ok", "result": self._calls(op, args)}
        except (ValueError, SlipstreamError) as e:
            answer = {"id": call_id, "status": "error", "message": str(e)}
        except Exception as e:  # the caller is told at once, not left to time out
            log.exception("slipstream holder: the call %r failed", op)
            answer = {"id": call_id, "status": "error",
                      "message": f"the call {op!r} failed at the holder ({type(e).__name__}: "
                                 f"{e}); its log says more"}
        try:
            self._answers.send(reply, stream, answer)
        except SlipstreamError as e:
            self._refuse(f"cannot answer {reply}: {e}", None)

    def _refuse(self, why: str, request: ReplayRequest | None, status: str = "refused",
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
        session.answer = session.respond(status, message=why, **fields)
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
                self._refuse(why, r, status="replaying", start=r.end, lost=[r.start, r.end])
            else:
                self._refuse(why, r, status="lost", lost=[r.start, r.end])
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
                                 f"publisher is at {producer})", r, status="lost",
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
                        _positioned_channel(r.reply_channel, r.log, session.mtu, begin),
                        r.data_stream_id)
                except SlipstreamError as e:
                    session.answer = session.respond(
                        "refused", message=f"{where}: cannot publish the replay to "
                                           f"{r.reply_channel}: {e}")
                    session.position = r.end
                    session.refused = True
                    self.refused += 1
                    self._sessions.append(session)
                    return
                replaying["session_id"] = session.data.session_id  # its image at the reader
            session.answer = session.respond("replaying", **replaying)
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
                return self._stop(session, session.respond(
                    "lost", message=f"the log no longer holds position {session.position} "
                                    f"(the publisher is at {e.producer_position})",
                    lost=[session.position, request.end], producer=e.producer_position))
            if session.pending is None:  # the range is sent: say where its last message ends
                session.answer = session.respond("complete", end=session.last_end)
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
            session.position = session.probe.position
            session.pending = None
            if session.data.position != session.last_end:
                return self._stop_refused(session, _padding_inside(session.last_end, "before"))
        return 1

    def _stop_refused(self, session: _Session, why: str) -> int:
        """Stop sending the replay and tell the reader ``why``."""
        return self._stop(session, session.respond("refused", message=why))

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
        result = session.result
        moved = 0
        for _ in range(_ADVANCE_BYTES // _BLOCK_BYTES + PARTITION_COUNT):
            position = session.position
            if position >= end or moved >= _ADVANCE_BYTES:
                break
            term = source.term_address(index_by_position(position, source.position_bits))
            block = min(_BLOCK_BYTES, max(_FIRST_BLOCK_BYTES, position - session.begin))
            copied = lib.ss_append_block(data._appender, term, source.term_length, position,
                                         end, block, result)
            if copied > 0:
                # Whole only if the log still held it all after the copy (the C half checks
                # the first frame; a cleaner zeroes the rest first): else the range is lost.
                session.image.check_retained(position)
                session.position = session.last_end = result[0]
                moved += copied
                continue
            code = result[0]
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


# -- the reader -----------------------------------------------------------------------------------
def local_address_towards(address: str, port: int) -> str:
    """The address of this host that the kernel would send from to reach ``address``: the
    one a holder there can answer to.  Sends nothing."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect((address, port))
        return probe.getsockname()[0]
    finally:
        probe.close()


class _Link:
    """A reader's streams to one holder, kept from one replay to the next as a
    :class:`~slipstream.client.holding.HolderLink` keeps its call streams: the control
    publication to the holder (connected: a request goes at once) and the response
    subscription at this host's reply endpoint.  Each replay has a data subscription of its
    own, closed when it ends: an ended image goes only once no subscription holds it, and a
    kept one would hold its log (the range's pages, and a share of the driver's log memory
    limit) for the image liveness timeout.

    One replay uses a link at a time.  A link goes back to its pool (:func:`_take_link`) only
    after a replay read to its end through a holder that names the request in its answers
    (:attr:`ReplayRequest.request_id`): what is left of that replay on the link (its
    ``complete`` answer) is then told apart from the next's answers.  Any other end closes
    it."""

    def __init__(self, client: Client, holder_address: str, port: int,
                 control_stream_id: int, reply_channel: str) -> None:
        self.client = client
        self.key = (holder_address, port, control_stream_id, reply_channel)
        self.reply_channel = reply_channel
        self.response_stream_id = random.randrange(1, INT32_MAX)
        self.idle_since = 0.0
        # Every subscription at the reply endpoint asks for the same window (its first one
        # makes it), as a HolderLink's does.
        self.response = client.add_subscription(reply_subscription_channel(reply_channel),
                                                self.response_stream_id)
        try:
            self.control = client.add_publication(
                small_channel(f"aeron:udp?endpoint={holder_address}:{port}"),
                control_stream_id)
        except BaseException:
            self.response.close()
            raise

    def data_subscription(self) -> tuple[Subscription, int]:
        """A new subscription for one replay's data, and its stream id (not the response
        stream's)."""
        stream_id = random.randrange(1, INT32_MAX)
        while stream_id == self.response_stream_id:
            stream_id = random.randrange(1, INT32_MAX)
        return (self.client.add_subscription(reply_subscription_channel(self.reply_channel),
                                             stream_id), stream_id)

    @property
    def usable(self) -> bool:
        return not (self.client.is_closed or self.response.is_closed or self.control.is_closed)

    def close(self) -> None:
        for resource in (self.response, self.control):
            resource.close()


_links: dict[tuple[int, str, int, int, str], list[_Link]] = {}
_links_lock = threading.Lock()
_reaper: threading.Thread | None = None  # closes idle links while the pool holds any


def _reset_links_after_fork() -> None:
    """A forked child (a Spark Python worker) starts with no links: the parent's streams are
    its client's, and a lock held at the fork would never be released in the child."""
    global _links_lock, _reaper
    _links.clear()
    _links_lock = threading.Lock()
    _reaper = None


os.register_at_fork(after_in_child=_reset_links_after_fork)


def _stale_links(now: float) -> list[_Link]:
    """Take out of the pool (under ``_links_lock``) the links idle longer than
    :data:`_LINK_IDLE_S` or no longer usable, for the caller to close."""
    stale: list[_Link] = []
    for key, idle in list(_links.items()):
        keep = [link for link in idle if link.usable and now - link.idle_since <= _LINK_IDLE_S]
        stale += [link for link in idle if link not in keep]
        if keep:
            _links[key] = keep
        else:
            del _links[key]
    return stale


def _close_links(links: list[_Link]) -> None:
    for link in links:
        with contextlib.suppress(SlipstreamError):
            link.close()


def _reap_idle_links() -> None:
    """The reaper's loop: idle links are closed within :data:`_LINK_IDLE_S` plus a tenth of
    it even when no replay comes to take one; it ends once the pool is empty."""
    global _reaper
    while True:
        time.sleep(_LINK_IDLE_S / 10)
        with _links_lock:
            stale = _stale_links(time.monotonic())
            if not _links:
                _reaper = None
        _close_links(stale)
        if _reaper is not threading.current_thread():
            return


def _take_link(client: Client, holder_address: str, port: int, control_stream_id: int,
               reply_channel: str) -> _Link:
    """An idle link of ``client`` to the holder, else a new one."""
    found: _Link | None = None
    with _links_lock:
        stale = _stale_links(time.monotonic())
        idle = _links.get((id(client), holder_address, port, control_stream_id, reply_channel))
        while idle and found is None:
            link = idle.pop()
            if link.client is client:
                found = link
            else:
                stale.append(link)
    _close_links(stale)
    if found is not None:
        return found
    return _Link(client, holder_address, port, control_stream_id, reply_channel)


def _give_back(link: _Link) -> None:
    """Keep ``link`` for the next replay (up to :data:`_IDLE_LINKS` per holder; closed by the
    reaper after :data:`_LINK_IDLE_S` idle), else close it."""
    global _reaper
    if link.usable:
        link.idle_since = time.monotonic()
        with _links_lock:
            idle = _links.setdefault((id(link.client), *link.key), [])
            if len(idle) < _IDLE_LINKS:
                idle.append(link)
                if _reaper is None:
                    _reaper = threading.Thread(target=_reap_idle_links,
                                               name="slipstream-replay-links", daemon=True)
                    _reaper.start()
                return
    with contextlib.suppress(SlipstreamError):
        link.close()


class Replay:
    """A replay being received: read it with :meth:`poll` until :attr:`done`.

    ``start`` is where it begins (the request's start, or past a loss the holder skipped:
    ``lost`` is then that ``(from, to)``); messages carry their positions in the source log.
    ``session_id``: the replay's session on the data stream, when the holder named it.
    """

    def __init__(self, request: ReplayRequest, holder: str, link: _Link, data: Subscription,
                 start: int, lost: tuple[int, int] | None, session_id: int | None = None,
                 reusable: bool = False) -> None:
        self.request = request
        self.holder = holder
        self.start = start
        self.lost = lost
        self.position = start
        self.session_id = session_id
        #: Where the last message ends, once the holder said it sent them all (a range may
        #: end with padding, which a replay does not send).
        self.complete_at: int | None = None
        self._link = link
        self._data = data
        self._response = link.response
        self._control = link.control
        self._reusable = reusable  # the holder names the request in its answers: keep the link
        self._failed = False
        self._closed = False

    @property
    def done(self) -> bool:
        return self.position >= self.request.end or (
            self.complete_at is not None and self.position >= self.complete_at)

    def describe(self) -> str:
        r = self.request
        return (f"the replay of stream {r.stream_id} session {r.log.session_id} "
                f"[{r.start}, {r.end}) from the holder at {self.holder}")

    def poll(self, handler: FragmentHandler, fragment_limit: int = 256) -> int:
        """Deliver the next messages (``handler(data, header)``; ``header.position`` is the
        source log's); returns how many fragments were read.  Raises :class:`ReplayLostError`
        when the holder lost the range meanwhile, :class:`ReplayError` when the stream ended
        before the range did or went past it."""
        end = self.request.end
        image = self._image()
        if image is None:
            return 0
        count = image.poll(handler, fragment_limit)
        self.position = image.position
        if self.position > end:
            self._failed = True
            raise ReplayError(f"{self.describe()} went past its end, to {self.position}: the "
                              f"replay is framed otherwise than the log")
        if count == 0 and not self.done:
            self._check_response()
            if image.is_end_of_stream and not self.done:
                self._ended_early()
        return count

    def poll_gathered(self, max_messages: int = 4096) -> GatheredMessages | None:
        """The next messages, copied out in one C pass (:meth:`Image.poll_gathered`), or None;
        raises as :meth:`poll` does."""
        end = self.request.end
        image = self._image()
        if image is None:
            return None
        chunk = image.poll_gathered(max_messages, end)
        self.position = image.position
        if chunk is None and not self.done:
            self._check_response()
            if image.is_end_of_stream and not self.done:
                self._ended_early()
        return chunk

    def _image(self) -> Image | None:
        """The replay's image once it is there (checking where it began), else None."""
        images = self._data.images
        image = None
        if self.session_id is None:
            image = images[0] if images else None
        else:  # the one the holder named (the only publication of the stream, but for a stray)
            for candidate in images:
                if candidate.session_id == self.session_id:
                    image = candidate
                    break
        if image is None:
            self._check_response()
            return None
        if image.join_position != self.start and self.position == self.start:
            self._failed = True
            raise ReplayError(f"{self.describe()} began at position {image.join_position}, "
                              f"not {self.start}: the replay is framed otherwise than the log")
        return image

    def _ended_early(self) -> None:
        """The data stream ended before the range did.  The holder answers why (``lost``, or
        ``complete`` where padding ends the range) on the response stream, which may arrive
        after the end of the data stream: wait for it a moment, so that a loss is reported as
        a loss.  Raises unless the answer says the replay is whole."""
        deadline = time.monotonic() + _ANSWER_AFTER_END_S
        while not self.done and time.monotonic() < deadline:
            self._check_response()  # raises ReplayLostError / ReplayError on those answers
            if not self.done:
                self._response.wait_for_data(10_000_000, _WAIT_SPIN_NS)
        if not self.done:
            self._failed = True
            raise ReplayError(f"{self.describe()} ended at position {self.position}")

    def _check_response(self) -> None:
        answers: list[dict[str, Any]] = []
        self._response.poll(lambda data, _h: answers.append(json.loads(bytes(data))), 4)
        for answer in answers:
            if not _answers_request(answer, self.request):
                continue  # what is left of an earlier replay on the link
            status = answer.get("status")
            if status == "lost":
                self._failed = True
                lost = answer.get("lost") or [self.position, self.request.end]
                raise ReplayLostError(f"{self.describe()}: {answer.get('message')}",
                                      (int(lost[0]), int(lost[1])))
            if status == "complete":
                self.complete_at = int(answer["end"])
            elif status == "refused":
                self._failed = True
                raise ReplayError(f"{self.describe()}: {answer.get('message')}")

    def wait(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for data, parked at once (:data:`_WAIT_SPIN_NS`); whether
        some came."""
        return self._data.wait_for_data(int(timeout_s * 1e9), _WAIT_SPIN_NS)

    def close(self) -> None:
        """Done with the replay: its data subscription is closed; the link's streams are kept
        for the next replay when this one was read to its end (and the holder names its
        answers), else closed."""
        if self._closed:
            return
        self._closed = True
        try:
            self._data.close()
        finally:
            if self._reusable and self.done and not self._failed:
                _give_back(self._link)
            else:
                self._link.close()

    def __enter__(self) -> Replay:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def _answers_request(answer: dict[str, Any], request: ReplayRequest) -> bool:
    """Whether ``answer`` is to ``request``: it names it, or names none (a holder that does
    not name requests answers on fresh streams only)."""
    named = answer.get("request_id")
    return named is None or named == request.request_id


def request_replay(client: Client, holder_address: str, port: int, control_stream_id: int,
                   stream_id: int, log_identity: LogIdentity, start: int, end: int, *,
                   skip_lost: bool = False, timeout_s: float = 30.0,
                   reply_address: str | None = None) -> Replay:
    """Ask the holder at ``holder_address:port`` (control stream ``control_stream_id``) for
    ``[start, end)`` of the log ``log_identity`` of ``stream_id``, to be received through
    ``client``'s driver at ``reply_address`` (None: this host's address towards the holder,
    :func:`local_address_towards`), same ``port``.

    The control and response streams are kept from one replay to the next (:class:`_Link`):
    a replay after the first to the same holder sets up only its data stream.

    Returns the :class:`Replay` once the holder answered ``replaying``.  Raises
    :class:`ReplayLostError` when it answers ``lost`` (and ``skip_lost`` is false or nothing
    is left), :class:`ReplayError` when it refuses or does not answer within ``timeout_s``.
    """
    holder = f"{holder_address}:{port} (control stream {control_stream_id})"
    if reply_address is None:
        reply_address = local_address_towards(holder_address, port)
    reply_channel = f"aeron:udp?endpoint={reply_address}:{port}"
    deadline = time.monotonic() + timeout_s
    link = _take_link(client, holder_address, port, control_stream_id, reply_channel)
    try:
        data, data_stream_id = link.data_subscription()
    except BaseException:
        link.close()
        raise
    request = ReplayRequest(stream_id, log_identity, start, end, reply_channel,
                            data_stream_id, link.response_stream_id, skip_lost,
                            random.randrange(1, 2**63))
    keep_link = False  # an answer that names the request leaves nothing of it on the link
    try:
        while link.control.offer(request.encode()) < 0:
            if time.monotonic() > deadline:
                raise ReplayError(
                    f"the replay holder at {holder} did not answer within {timeout_s:g} s: is "
                    f"the process that holds the stream running, and UDP port {port} open "
                    f"between this host and {holder_address}?")
            time.sleep(0.001)
        answers: list[dict[str, Any]] = []
        answer: dict[str, Any] | None = None
        while answer is None:
            link.response.poll(lambda payload, _h: answers.append(json.loads(bytes(payload))),
                               1)
            while answers and answer is None:
                candidate = answers.pop(0)
                if _answers_request(candidate, request):
                    answer = candidate
            if answer is not None:
                break
            if time.monotonic() > deadline:
                raise ReplayError(f"the replay holder at {holder} took the request for "
                                  f"[{start}, {end}) but did not answer within {timeout_s:g} s")
            link.response.wait_for_data(10_000_000, _WAIT_SPIN_NS)
        status = answer.get("status")
        keep_link = answer.get("request_id") == request.request_id
        where = f"the holder at {holder}, stream {stream_id} session {log_identity.session_id}"
        if status == "lost":
            lost = answer.get("lost") or [start, end]
            raise ReplayLostError(f"{where}: {answer.get('message')}",
                                  (int(lost[0]), int(lost[1])))
        if status != "replaying":
            raise ReplayError(f"{where}: {answer.get('message', answer)}")
        begin = int(answer["start"])
        lost_range = answer.get("lost")
        session_id = answer.get("session_id")
        return Replay(request, holder, link, data, begin,
                      (int(lost_range[0]), int(lost_range[1])) if lost_range else None,
                      session_id if isinstance(session_id, int) else None,
                      reusable=keep_link)
    except BaseException:
        data.close()
        if keep_link:
            _give_back(link)
        else:
            link.close()
        raise
