"""What the planning side of a read sees of a session's log, wherever the log is.

A read query plans its micro-batches from the logs of its stream's images: where each ends,
how far back it still holds messages, where a read limit or a split falls.  The log is in the
shared memory of the host that holds the stream: the planner's own host (:class:`ImageView`,
over the planner's subscription) or an ingest host whose standing holder the planner calls
(:class:`RemoteView`, answered by an :class:`ImageView` there: one implementation of every
question).
"""

from __future__ import annotations

import threading
from typing import Any, Final

import attrs

from slipstream.client import DataLossError, Image, InvalidArgumentError
from slipstream.client._native import lib
from slipstream.client.holding import HolderLink
from slipstream.client.layout import FRAME_ALIGNMENT, INT64_MAX, MAX_MESSAGE_LENGTH
from slipstream.client.logbuffer import LogIdentity, OfOneLog
from slipstream.client.retention import (
    NO_LIMIT,
    TermAt,
    earliest_position,
    first_retained,
    image_terms,
    is_retained,
    walk_term,
)

__all__ = ["MAX_SPLIT_PIECES", "VIEW_OPERATIONS", "ImageView", "LogView", "RemoteView",
           "SessionEnd", "SessionEnds", "Walk", "end_of_stream", "snapshot", "view_answer",
           "view_args", "walk_bound", "walk_log"]


def end_of_stream(image: Image) -> int | None:
    """Where ``image``'s stream ended with its end-of-stream mark (the publisher closed it, or
    the receiver was left behind there), once its log says so; else None."""
    position = image.log_buffer.end_of_stream_position
    return position if position < INT64_MAX else None


@attrs.frozen
class SessionEnd:
    """How a session's image went from the subscription that held it: what its log held
    (up to ``position``), whether the stream ended there with its end-of-stream mark, and the
    range its receiver lost when it was left behind (the sender moved past what it could
    resend)."""

    session_id: int
    #: (initial term id, term length) of the log that ended.
    framing: tuple[int, int]
    #: The end of what the log held when the image went: the end-of-stream position, or
    #: how far its producer (the receiver) had written, past any gap it had not repaired.
    position: int
    #: True when the stream ended with its mark (its publication closed, or its receiver
    #: was left behind: then :attr:`lost` says what it lost); False when the image went
    #: without it: nothing arrived for the image liveness timeout (the publisher's driver
    #: or host stopped, or the network between went down), so whatever its publisher had
    #: accepted past :attr:`position` never reached this host.
    end_of_stream: bool
    lost: tuple[int, int] | None = None

    @classmethod
    def of(cls, image: Image) -> SessionEnd:
        """The end of ``image``, which went (in an ``on_unavailable_image`` handler: the
        subscription noted where its log ended as it went)."""
        return cls(image.session_id, image.identity.framing,
                   image.final_position if image.final_position is not None
                   else image.join_position, image.ended_with_mark, image.lost_range)

    @property
    def complete(self) -> bool:
        """The stream ended with its mark and lost nothing: a reader at :attr:`position`
        read all of it."""
        return self.end_of_stream and self.lost is None

    def describe(self) -> str:
        """How it ended, in words, for a reader that had not read all of it."""
        if self.lost is not None and self.end_of_stream:
            return (f"its receiver was left behind: the sender moved past what it could "
                    f"resend, and the messages at [{self.lost[0]}, {self.lost[1]}) never "
                    f"arrived")
        if self.lost is not None:
            return (f"this subscription fell further behind the stream than its untethered "
                    f"window allows (tether=false) and was let go: the messages at "
                    f"[{self.lost[0]}, {self.lost[1]}) went past it")
        if self.end_of_stream:
            return f"its publication ended at position {self.position}"
        return (f"its image went at position {self.position} without the stream's "
                f"end-of-stream mark: nothing arrived for the image liveness timeout (the "
                f"publisher's driver or host stopped, or the network between went down), so "
                f"whatever its publisher accepted past {self.position} never arrived")

    def to_json(self) -> dict[str, Any]:
        return {"log": [*self.framing], "position": self.position,
                "end_of_stream": self.end_of_stream,
                "lost": None if self.lost is None else [*self.lost]}

    @classmethod
    def from_json(cls, session_id: int, fields: dict[str, Any]) -> SessionEnd:
        lost = fields.get("lost")
        return cls(session_id, (int(fields["log"][0]), int(fields["log"][1])),
                   int(fields["position"]), bool(fields["end_of_stream"]),
                   None if lost is None else (int(lost[0]), int(lost[1])))


#: How many ended sessions a :class:`SessionEnds` remembers (the oldest are forgotten).
SESSION_ENDS_KEPT: Final = 4096


class SessionEnds:
    """The sessions whose images left a subscription, as they left (pass :meth:`record` as
    the subscription's ``on_unavailable_image``), the latest :data:`SESSION_ENDS_KEPT`:
    what tells a reader whose offsets name a session that is gone whether it read all of
    it.  Recorded on the client's conductor thread, read from any."""

    def __init__(self) -> None:
        self._ends: dict[int, SessionEnd] = {}
        self._lock = threading.Lock()

    def record(self, image: Image) -> None:
        end = SessionEnd.of(image)
        with self._lock:
            self._ends.pop(end.session_id, None)
            self._ends[end.session_id] = end
            while len(self._ends) > SESSION_ENDS_KEPT:
                del self._ends[next(iter(self._ends))]

    def get(self, session_id: int) -> SessionEnd | None:
        with self._lock:
            return self._ends.get(session_id)

    def snapshot(self) -> dict[str, SessionEnd]:
        """By session id as offsets name them (decimal strings)."""
        with self._lock:
            return {str(sid): end for sid, end in self._ends.items()}


#: Why a :class:`Walk` stopped: at the range's end (or the first frame not there), before a
#: message past a limit, before the first message stamped at or after the time, at the
#: walk's bound for one answer (ask again from its position), or where the log no longer held
#: the range (lapped, or a recording's segment gone).
WALK_STOPS: Final = ("end", "limit", "time", "more", "lost")

_STOP_OF_REASON: Final = {lib.SS_MESSAGES_END: "end", lib.SS_MESSAGES_LIMIT: "limit",
                          lib.SS_MESSAGES_TIME: "time"}


@attrs.frozen
class Walk:
    """One answer of a walk over whole messages: the message boundary it reached, the
    messages and payload bytes it stepped over, and why it stopped (:data:`WALK_STOPS`)."""

    position: int
    messages: int
    bytes: int
    stop: str

    def to_json(self) -> dict[str, Any]:
        return {"position": self.position, "messages": self.messages, "bytes": self.bytes,
                "stop": self.stop}

    @classmethod
    def from_json(cls, fields: dict[str, Any]) -> Walk:
        stop = str(fields["stop"])
        if stop not in WALK_STOPS:
            raise ValueError(f"a walk stopped {stop!r}, not one of {', '.join(WALK_STOPS)}")
        return cls(int(fields["position"]), int(fields["messages"]), int(fields["bytes"]),
                   stop)


def walk_bound(term_length: int) -> int:
    """How many bytes of log one walk answer covers at most: four terms, at most twice the
    longest message (so that an answer always holds a whole message after any boundary: a
    walk that stops at its bound has moved on).  It bounds what one question costs the
    process that answers it (the archive's or a holder's one service thread)."""
    return min(4 * term_length, 2 * MAX_MESSAGE_LENGTH)


def walk_log(term_at: TermAt, term_length: int, begin: int, end: int,
             max_messages: int | None, max_bytes: int | None, take_first: bool,
             time_ns: int | None) -> Walk:
    """Walk a log's whole messages from ``begin`` (a message boundary) towards ``end``,
    term by term in C (:func:`~slipstream.client.retention.walk_term`), at most
    :func:`walk_bound` bytes: stopped there, the answer says ``more``.  ``term_at`` gives
    the terms (it may raise for a log that no longer holds one: the caller's to catch).
    A message never crosses a term, so every term start is a boundary a walk resumes at."""
    bound = begin + walk_bound(term_length)
    stop_at = min(end, bound)
    position, messages, size = begin, 0, 0
    reason = lib.SS_MESSAGES_END
    while position < stop_at:
        term_base = position - position % term_length
        scan_end = min(stop_at, term_base + term_length)
        walked = walk_term(term_at(position, scan_end), position - term_base,
                           scan_end - term_base,
                           NO_LIMIT if max_messages is None else max_messages - messages,
                           NO_LIMIT if max_bytes is None else max_bytes - size,
                           take_first=take_first and messages == 0, time_ns=time_ns)
        position = term_base + walked.boundary
        messages += walked.messages
        size += walked.bytes
        reason = walked.reason
        if reason != lib.SS_MESSAGES_END or position < scan_end:
            break  # a limit, a stamp, or a frame not there (or a message cut by the bound)
    stop = _STOP_OF_REASON[reason]
    if stop == "end" and stop_at < end and position > begin:
        stop = "more"  # at the bound: a frame not there says so to the next question
    return Walk(position, messages, size, stop)


class LogView(OfOneLog):
    """One session's log as the planner sees it.  The attributes describe the log (its
    identity, where it is) and the subscriber position that holds it, as of when the view was
    taken; the methods ask the log itself."""

    #: Which log of the session it is (a session's log made anew is another); its fields
    #: (``session_id``, ``stream_id``, ...) are the view's attributes too.
    identity: LogIdentity
    log_path: str
    #: Where the holding subscription joined: the log holds nothing before it.
    join_position: int
    #: The holding subscriber's position: publishers are held back one window past it.
    position: int
    #: Where the stream ended with its end-of-stream mark, once the log says so, else None.
    end_of_stream: int | None

    def available_position(self) -> int:
        """The end of the last whole ready message."""
        raise NotImplementedError

    def earliest_position(self) -> int:
        """The oldest message position the log still holds, at most :attr:`position`."""
        raise NotImplementedError

    def is_retained(self, position: int) -> bool:
        """Whether the log still holds the message boundary ``position``."""
        raise NotImplementedError

    def first_retained(self, start: int, end: int) -> int:
        """The first message position after ``start``, at most ``end``, the log still holds."""
        raise NotImplementedError

    def walk(self, begin: int, end: int, max_messages: int | None, max_bytes: int | None,
             take_first: bool, time_ns: int | None) -> Walk:
        """One answer of a walk over the whole messages of ``[begin, end)`` (``begin`` a
        message boundary), covering at most :func:`walk_bound` bytes (then it stops
        ``more``: the caller asks again from its position, as :meth:`scan`,
        :meth:`count_messages` and :meth:`position_at_time` do): it stops before the message
        past ``max_messages`` / ``max_bytes`` payload bytes (None: no limit) unless that is
        the first and ``take_first``; before the first message stamped at or after
        ``time_ns`` (its reserved value, ns since the epoch, as the slipstream writer stamps
        it; a message without a stamp counts as older than any time), when given; ``lost``
        where the log no longer holds ``begin``.  With ``time_ns`` the walk may begin after
        ``begin``, where the log knows every message before was stamped earlier (a
        recording's time index)."""
        raise NotImplementedError

    def walk_all(self, begin: int, end: int, max_messages: int | None = None,
                 max_bytes: int | None = None, *, take_first: bool = False,
                 time_ns: int | None = None) -> Walk:
        """A whole walk (as :meth:`walk`, never ``more``): :meth:`walk` asked again from
        where each answer stopped, the one loop over bounded answers."""
        position, messages, size = begin, 0, 0
        while True:
            walked = self.walk(
                position, end,
                None if max_messages is None else max(0, max_messages - messages),
                None if max_bytes is None else max(0, max_bytes - size),
                take_first and messages == 0, time_ns)
            messages += walked.messages
            size += walked.bytes
            if walked.stop != "more" or walked.position <= position:
                return Walk(walked.position, messages, size,
                            "end" if walked.stop == "more" else walked.stop)
            position = walked.position

    def scan(self, begin: int, available: int, max_rows: int | None,
             max_bytes: int | None) -> int:
        """The message boundary after at most ``max_rows`` messages / ``max_bytes`` payload
        bytes from ``begin`` (at least one message, so a query always progresses), at most
        ``available``; ``available`` when the log was lapped meanwhile (the task reports it)."""
        if max_rows == 0 or max_bytes == 0:
            return begin
        walked = self.walk_all(begin, available, max_rows, max_bytes, take_first=True)
        return available if walked.stop == "lost" else walked.position

    def count_messages(self, begin: int, end: int, limit: int) -> int:
        """How many whole messages ``[begin, end)`` holds, counting up to ``limit`` (at most
        that is returned); 0 when the log was lapped meanwhile."""
        walked = self.walk_all(begin, end, limit)
        return 0 if walked.stop == "lost" else walked.messages

    def position_at_time(self, begin: int, end: int, time_ns: int) -> int:
        """Where the first message of ``[begin, end)`` stamped at or after ``time_ns`` begins
        (its reserved value, ns since the epoch, as the slipstream writer stamps it; a message
        without a stamp counts as older than any time), else ``end``; ``end`` too when the
        log was lapped meanwhile."""
        for _ in range(3):  # a start the cleaner passed meanwhile: again from what is held
            walked = self.walk_all(begin, end, time_ns=time_ns)
            if walked.stop != "lost":
                return walked.position if walked.stop == "time" else end
            begin = self.first_retained(begin, end)
        return end

    def split_points(self, begin: int, stop: int, pieces: int) -> list[int]:
        """Message boundaries strictly inside ``[begin, stop)`` that cut it into about
        ``pieces`` ranges of equal length (64 messages per step, so a piece is at least that
        long); fewer when the range is too short or the log no longer holds it."""
        raise NotImplementedError

    def advance_to(self, position: int) -> str | None:
        """Move the holding subscriber position to ``position`` (never backwards), returning
        the credit before it to the publishers; why not, when ``position`` is no position of
        this log (beyond what it holds, or where no message begins), else None."""
        raise NotImplementedError


class ImageView(LogView):
    """A log in this host's shared memory, through an image of the holding subscription.

    Its :meth:`available_position` is the log's as of the first time this view is asked, as
    a :class:`RemoteView`'s is as of its holder's answer: the planner takes a view per call
    (a batch's end and its lag, or the latest offsets and their lag, agree), and asks a new
    view for news."""

    def __init__(self, image: Image) -> None:
        self.image = image
        self.identity = image.identity
        self.log_path = image.log_path
        self.join_position = image.join_position
        self._available: int | None = None

    @property
    def position(self) -> int:  # type: ignore[override]
        return self.image.position

    @property
    def end_of_stream(self) -> int | None:  # type: ignore[override]
        return end_of_stream(self.image)

    def available_position(self) -> int:
        if self._available is None:
            self._available = self.image.available_position()
        return self._available

    def earliest_position(self) -> int:
        return earliest_position(self.image)

    def is_retained(self, position: int) -> bool:
        return is_retained(self.image, position)

    def first_retained(self, start: int, end: int) -> int:
        return first_retained(self.image, start, end)

    def walk(self, begin: int, end: int, max_messages: int | None, max_bytes: int | None,
             take_first: bool, time_ns: int | None) -> Walk:
        """As :meth:`LogView.walk`, over the terms of the log as mapped, never past its
        producer; ``lost`` when the log no longer held ``begin`` before or after (a writer
        lapping the walk cleans and rewrites the term first)."""
        image = self.image
        try:
            image.check_retained(begin)
            walked = walk_log(image_terms(image), image.term_length, begin,
                              min(end, image.producer_position()), max_messages, max_bytes,
                              take_first, time_ns)
            image.check_retained(begin)
        except DataLossError:
            return Walk(begin, 0, 0, "lost")
        return walked

    def split_points(self, begin: int, stop: int, pieces: int) -> list[int]:
        if pieces <= 1:
            return []
        step = (stop - begin) / pieces
        probe = Image.detached(self.log_path, begin)
        points: list[int] = []
        try:
            target = begin + step
            while probe.position < stop and len(points) < pieces - 1:
                before = probe.position
                probe.poll_batch(64)
                if probe.position == before or probe.position >= stop:
                    break
                if probe.position >= target and probe.at_message_boundary:
                    points.append(probe.position)
                    target = probe.position + step
        finally:
            probe.close()
        if not self.is_retained(begin):  # lapped while scanning: the tasks report the loss
            return []
        return points

    def advance_to(self, position: int) -> str | None:
        if position > self.image.position:
            try:
                self.image.position = position
            except InvalidArgumentError as error:
                return str(error)
        return None


#: The questions a :class:`RemoteView` puts to the holder: the name of the :class:`LogView`
#: method and its parameters, all integers (or None for a limit or a time; a bool for
#: ``take_first``).  A message walk is asked as :meth:`LogView.walk`, whose answer covers at
#: most :func:`walk_bound` bytes: the caller's loop (:meth:`LogView.walk_all`) asks again.
VIEW_OPERATIONS: dict[str, tuple[str, ...]] = {
    "is_retained": ("position",),
    "first_retained": ("start", "end"),
    "walk": ("begin", "end", "max_messages", "max_bytes", "take_first", "time_ns"),
    "split_points": ("begin", "stop", "pieces"),
    "advance_to": ("position",),
}


#: The most pieces a ``split_points`` question may ask for (its answer lists them).
MAX_SPLIT_PIECES: Final = 256


def view_args(method: str, args: object, high: int) -> dict[str, int | None]:
    """The arguments of a view question from a caller, checked before the log is asked (the
    standing holder's and the archive's ``view`` calls): the method's parameters, integers
    (None only for a limit or the time of ``walk``, whose ``take_first`` is a bool);
    positions frame-aligned, at most ``high`` (the highest position the log holds: its
    producer position, or a recording's recorded one; the log is scanned with them); at most
    :data:`MAX_SPLIT_PIECES` pieces.  A position before what the log holds is a question like
    any other: the view says it does not hold it.  Raises ValueError naming the argument."""
    if method not in VIEW_OPERATIONS:
        raise ValueError(f"method {method!r} is not one of {', '.join(VIEW_OPERATIONS)}")
    names = VIEW_OPERATIONS[method]
    if not isinstance(args, dict) or set(args) != set(names):
        raise ValueError(f"{method} takes {', '.join(names)}, not {args!r}")
    for name, value in args.items():
        if name == "take_first":
            if not isinstance(value, bool):
                raise ValueError(f"{method}: take_first {value!r} is not true or false")
            continue
        nullable = method == "walk" and name in ("max_messages", "max_bytes", "time_ns")
        if value is None and nullable:
            continue
        top = NO_LIMIT if name in ("max_messages", "max_bytes") else 2**62 - 1  # int64 limits
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= top:
            raise ValueError(f"{method}: {name} {value!r} is not a position or count")
        if name in ("max_messages", "max_bytes", "time_ns"):
            continue
        if name == "pieces":
            if value > MAX_SPLIT_PIECES:
                raise ValueError(f"split_points: {value} pieces, over {MAX_SPLIT_PIECES}")
            continue
        if value % FRAME_ALIGNMENT or value > high:
            raise ValueError(f"{method}: {name} {value} is not a frame boundary of this log "
                             f"held here, [0, {high}]")
    return args


def view_answer(view: LogView, method: str, args: dict[str, Any]) -> Any:
    """The answer to a view question (``method`` with ``args`` checked by
    :func:`view_args`), as JSON values: what every server of view calls answers."""
    answer = getattr(view, method)(**args)
    return answer.to_json() if isinstance(answer, Walk) else answer


def snapshot(view: LogView) -> dict[str, Any]:
    """What a holder tells a remote planner about one of its logs, as JSON values."""
    return {"stream_id": view.stream_id, "initial_term_id": view.identity.initial_term_id,
            "term_length": view.identity.term_length, "mtu": view.mtu, "log_path": view.log_path,
            "join_position": view.join_position, "position": view.position,
            "available": view.available_position(), "earliest": view.earliest_position(),
            "end_of_stream": view.end_of_stream}


class RemoteView(LogView):
    """A log another process answers for: a standing holder's (on another host, or this one)
    or a recording of an archive.  The attributes as of the last answer that described it
    (``state``: :func:`snapshot`'s fields), the questions asked of that process's own view
    (:class:`ImageView`, or the archive's recording view) by a ``view`` call naming the log
    by ``key``: a held stream's key with this session and its log, or ``{"recording_id":
    N}``."""

    def __init__(self, link: HolderLink, key: dict[str, Any], session_id: int,
                 state: dict[str, Any]) -> None:
        self._link = link
        # mtu 0: a holder of an earlier version does not say (nothing here reads it).
        self.identity = LogIdentity(session_id, int(state["initial_term_id"]),
                                    int(state["term_length"]), stream_id=int(state["stream_id"]),
                                    mtu=int(state.get("mtu", 0)))
        self._key = key if "recording_id" in key else \
            {**key, "session_id": session_id, "log": [*self.identity.framing]}
        self.log_path = str(state["log_path"])
        self.join_position = int(state["join_position"])
        self.position = int(state["position"])
        self._available = int(state["available"])
        self._earliest = int(state["earliest"])
        eos = state.get("end_of_stream")  # a holder of an earlier version says nothing
        self.end_of_stream = None if eos is None else int(eos)

    def _ask(self, method: str, **args: Any) -> Any:
        return self._link.call("view", **self._key, method=method, args=args)

    def available_position(self) -> int:
        return self._available

    def earliest_position(self) -> int:
        return self._earliest

    def is_retained(self, position: int) -> bool:
        return bool(self._ask("is_retained", position=position))

    def first_retained(self, start: int, end: int) -> int:
        return int(self._ask("first_retained", start=start, end=end))

    def walk(self, begin: int, end: int, max_messages: int | None, max_bytes: int | None,
             take_first: bool, time_ns: int | None) -> Walk:
        return Walk.from_json(self._ask("walk", begin=begin, end=end,
                                        max_messages=max_messages, max_bytes=max_bytes,
                                        take_first=take_first, time_ns=time_ns))

    def split_points(self, begin: int, stop: int, pieces: int) -> list[int]:
        return [int(p) for p in self._ask("split_points", begin=begin, stop=stop,
                                          pieces=pieces)]

    def advance_to(self, position: int) -> str | None:
        why = self._ask("advance_to", position=position)
        if why is None:
            self.position = max(self.position, position)
        return None if why is None else str(why)
