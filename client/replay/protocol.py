"""The replay exchange's messages and the reader's side of it as a state machine, with no I/O.

A reader sends one :class:`ReplayRequest` on the holder's control stream; the holder answers on
the reader's response stream with JSON messages whose ``status`` is one of

* ``replaying``: the range comes on the data stream from ``start`` (``lost``: the part before
  it the log no longer held, with ``skip_lost``; ``session_id``: the data stream's session);
* ``lost``: the log no longer holds ``lost`` (``from``, ``to``) of the range;
* ``refused``: the request cannot be served (``message`` says why);
* ``complete``: every message of the range went; the last ends at ``end`` (a range may end
  with padding, which a replay does not send).

Every answer to a request with a ``request_id`` repeats it.  :class:`ReplayExchange` is what the
reader makes of the answers (h11's way: the bytes that go out, the bytes that came in, the
time as an argument); :mod:`~slipstream.client.replay.reader` moves them through the streams,
:mod:`~slipstream.client.replay.server` writes the holder's answers with
:meth:`ReplayRequest.answer`.
"""

from __future__ import annotations

import enum
import json
from typing import Any, Final

import attrs

from slipstream.client.errors import SlipstreamError
from slipstream.client.layout import FRAME_ALIGNMENT, INT32_MAX
from slipstream.client.logbuffer import LogIdentity

__all__ = ["COMPLETE", "LOST", "REFUSED", "REPLAYING", "REPLAY_VERSION", "WAIT_SPIN_NS",
           "ReaderState", "ReplayError", "ReplayExchange", "ReplayLostError", "ReplayRequest"]

#: The request format's version; a holder refuses requests of another.
REPLAY_VERSION: Final = 1
#: An answer's ``status``.
REPLAYING: Final = "replaying"
LOST: Final = "lost"
REFUSED: Final = "refused"
COMPLETE: Final = "complete"
#: How long the exchange's waits spin before they park (``spin_ns`` of ``wait_for_data``): not
#: at all.  What they wait for takes milliseconds (another host's driver making a stream, an
#: answer, the next stretch of a replay through two drivers), and the threads that bring it
#: need the cores a spinner holds: on a 2-core host, with the client's default 1 ms spin, a
#: replay of 100 messages took medians of 15-25 ms a run, parked 13-18 ms (five runs each,
#: alternating, load 2.5-4).
WAIT_SPIN_NS: Final = 0


class ReplayError(SlipstreamError):
    """A replay could not be had: the holder did not answer, refused, or the stream ended
    before the range did.  The message names the holder and the range."""


class ReplayLostError(ReplayError):
    """The holder's log no longer holds (part of) the range: ``lost`` is ``(from, to)``."""

    def __init__(self, message: str, lost: tuple[int, int]) -> None:
        self.lost = lost
        super().__init__(message)


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
    #: Set by a reader that keeps its response stream from one replay to the next (its
    #: link to the holder): the holder puts it in every answer, so that a late answer to an
    #: earlier replay on that stream is told apart, and keeps its answer publication for
    #: the next.  None: a response stream of this replay's own.
    request_id: int | None = None

    def encode(self) -> bytes:
        """The request as the control stream carries it (one JSON message)."""
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


    def answer(self, status: str, **fields: object) -> bytes:
        """The holder's answer to this request, ``status`` with ``fields`` (one JSON message
        on the response stream), naming the request when it has an id."""
        if self.request_id is not None:
            fields["request_id"] = self.request_id
        return json.dumps({"status": status, **fields}).encode()


class ReaderState(enum.Enum):
    """Where a reader's exchange stands."""

    ASKING = enum.auto()  #: the request goes, or went; no answer to it yet
    REPLAYING = enum.auto()  #: answered ``replaying``: the data stream carries the range
    FAILED = enum.auto()  #: answered ``lost`` or ``refused``, or the reader found the data wrong


class ReplayExchange:
    """The reader's side of one replay request, without I/O: :meth:`request_data` is what goes
    on the control stream, :meth:`receive` takes each answer that comes on the response stream
    (raising :class:`ReplayLostError` or :class:`ReplayError` for ``lost`` and ``refused``), and
    :meth:`expired` says, given ``now`` (``time.monotonic()`` s), whether the holder took too
    long to take or answer the request (:meth:`timed_out` is the error then).

    The transitions: ASKING --``replaying``--> REPLAYING; ASKING --``lost``, anything else-->
    FAILED; REPLAYING --``lost``, ``refused``--> FAILED; REPLAYING --``complete``--> REPLAYING
    with :attr:`complete_at`; any other answer while REPLAYING, and every answer to another
    request (what is left of an earlier replay on a kept response stream), changes nothing.
    :meth:`fail` is the reader's own verdict on the data (FAILED); a failed replay's later
    answers still raise as they would while REPLAYING (the reader may poll on).
    """

    def __init__(self, request: ReplayRequest, holder_address: str, port: int,
                 control_stream_id: int, deadline: float) -> None:
        self.request = request
        self.holder_address = holder_address
        self.port = port
        #: Who the holder is, for messages.
        self.holder = f"{holder_address}:{port} (control stream {control_stream_id})"
        #: When the holder must have answered (``time.monotonic()`` s).
        self.deadline = deadline
        self.state = ReaderState.ASKING
        #: The control stream took the request (the rest of the wait is the holder's answer).
        self.request_taken = False
        #: Where the replay begins (the request's start, or past a loss the holder skipped:
        #: :attr:`lost` is then that ``(from, to)``), and its session on the data stream when
        #: the holder named it: set by the ``replaying`` answer.
        self.start = request.start
        self.lost: tuple[int, int] | None = None
        self.session_id: int | None = None
        #: Where the last message ends, once the holder said it sent them all.
        self.complete_at: int | None = None
        #: The holder's answers name the request: what is left of this replay on the
        #: response stream is told apart from the next's, so the stream may be kept.
        self.names_request = False

    def request_data(self) -> bytes:
        """The request, as the control stream carries it."""
        return self.request.encode()

    def request_sent(self) -> None:
        """The control stream took :meth:`request_data`."""
        self.request_taken = True

    def expired(self, now: float) -> bool:
        """Whether the holder has not answered by ``now`` past the deadline."""
        return self.state is ReaderState.ASKING and now > self.deadline

    def timed_out(self, timeout_s: float) -> ReplayError:
        """The error for a request that went unanswered for ``timeout_s``: not even taken by
        the control stream (no holder there, or a port closed), or taken and not answered."""
        r = self.request
        if not self.request_taken:
            return ReplayError(
                f"the replay holder at {self.holder} did not answer within {timeout_s:g} s: "
                f"is the process that holds the stream running, and UDP port {self.port} "
                f"open between this host and {self.holder_address}?")
        return ReplayError(f"the replay holder at {self.holder} took the request for "
                           f"[{r.start}, {r.end}) but did not answer within {timeout_s:g} s")

    def describe(self) -> str:
        """The replay in words, for messages."""
        r = self.request
        return (f"the replay of stream {r.stream_id} session {r.log.session_id} "
                f"[{r.start}, {r.end}) from the holder at {self.holder}")

    def fail(self) -> None:
        """The reader found the replay wrong (framed otherwise, ended early)."""
        self.state = ReaderState.FAILED

    def receive(self, data: bytes, position: int) -> None:
        """One answer from the response stream, the reader having read up to ``position``.
        Raises :class:`ReplayLostError` for ``lost`` (naming the holder's range, else from
        ``position`` to the end), :class:`ReplayError` for ``refused`` and, before the replay
        began, for any answer but ``replaying``."""
        answer = json.loads(data)
        named = answer.get("request_id")
        if named is not None and named != self.request.request_id:
            return  # what is left of an earlier replay on the response stream
        status = answer.get("status")
        if self.state is ReaderState.ASKING:
            self.names_request = named == self.request.request_id
            r = self.request
            where = f"the holder at {self.holder}, stream {r.stream_id} session {r.log.session_id}"
            if status == LOST:
                self.state = ReaderState.FAILED
                lost = answer.get("lost") or [position, r.end]
                raise ReplayLostError(f"{where}: {answer.get('message')}",
                                      (int(lost[0]), int(lost[1])))
            if status != REPLAYING:
                self.state = ReaderState.FAILED
                raise ReplayError(f"{where}: {answer.get('message', answer)}")
            self.state = ReaderState.REPLAYING
            self.start = int(answer["start"])
            lost_range = answer.get("lost")
            self.lost = (int(lost_range[0]), int(lost_range[1])) if lost_range else None
            session_id = answer.get("session_id")
            self.session_id = session_id if isinstance(session_id, int) else None
            return
        if status == LOST:
            self.state = ReaderState.FAILED
            lost = answer.get("lost") or [position, self.request.end]
            raise ReplayLostError(f"{self.describe()}: {answer.get('message')}",
                                  (int(lost[0]), int(lost[1])))
        if status == COMPLETE:
            self.complete_at = int(answer["end"])
        elif status == REFUSED:
            self.state = ReaderState.FAILED
            raise ReplayError(f"{self.describe()}: {answer.get('message')}")
