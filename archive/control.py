"""The archive's control stream: calls answered, replays run (Aeron Archive's control session
and its ``ArchiveConductor`` requests).

A call is :mod:`slipstream.client.holding`'s format, unchanged: one JSON message on the
archive's control stream (``control_address:control_port``, ``control_stream_id`` of the
settings), its answer one JSON message on the caller's response stream, matched by ``id``.
:class:`~slipstream.archive.client.ArchiveClient` is the caller's side.  The operations (their
arguments; the result):

``list`` (``channel``, ``stream_id``, ``session_id``, ``from_id``, ``count``, all optional)
    the recordings whose channel contains ``channel``, whose stream is ``stream_id`` and
    whose session is ``session_id``, from
    id ``from_id``, at most ``count`` (default :data:`LIST_COUNT`: an answer is one small
    message); each a descriptor's fields and ``recorded_position``.
``describe`` (``recording_id``)
    one recording, as ``list`` gives it.
``recording_position`` (``recording_id``)
    ``{"position", "active"}``: a live recording's recorded position, or a stopped one's stop.
``replay`` (``recording_id``, ``channel``, ``stream_id``; ``start``, ``end``, ``from_time_ms``)
    ``{"replay_id", "session_id", "start", "end"}``: the replay is published to ``channel``
    / ``stream_id`` from ``start`` (default the recording's start; or from the time index's
    position for ``from_time_ms``, epoch ms) to ``end`` (default none: follow the
    recording until it stops).
``stop_replay`` (``replay_id``)
    ``{"stopped": bool}``: whether it was still running.
``replays``
    the replays in progress: id, recording (None for a held stream's), position, state.
``view`` (``recording_id``, ``method``, ``args``)
    a planner's question about a recording, as a read query asks a live log
    (:class:`~slipstream.client.logview.LogView`: ``method`` one of
    :data:`~slipstream.client.logview.VIEW_OPERATIONS`, ``args`` its parameters, checked
    by :func:`~slipstream.client.logview.view_args` against the recorded position);
    answered by :class:`~slipstream.archive.view.RecordingView` over the segment files.

The calls about a stream the archive holds for a group (:mod:`slipstream.archive.holding`)
name it by ``channel``, ``stream_id`` and ``group``:

``state`` (the stream's key; ``hold``, default true)
    ``{"host", "driver", "sessions", "held_for"}``: each session's log (its framing, path,
    positions: :func:`~slipstream.client.logview.snapshot`); holds the stream for the group
    at once if it is not held (not with ``hold`` false: then an error names what is held).
``view`` (the stream's key, ``session_id``, ``log``: [initial term id, term length],
``method``, ``args``)
    the answer of one of :data:`~slipstream.client.logview.VIEW_OPERATIONS` about the
    session's live log; ``advance_to`` moves the group's position (its commit).
``ended`` (the stream's key, ``sessions``: at most 32 session ids)
    how those of them whose images went ended (:class:`~slipstream.client.logview.SessionEnd`).
``release`` (the stream's key)
    whether it was held: the group's subscription closes.
``replay`` with ``held`` (the stream's key), ``session_id``, ``log``, ``start``, ``end``,
``channel``, ``stream_id``
    ``[start, end)`` of the session's live log replayed as a recording's range is, answered
    alike, from the first message at or after ``start`` (padding inside a term, which a
    replay cannot reproduce, is stepped over: a replay that meets it ends there); replay id 0
    when no message begins before ``end``.  A start the log no longer holds is refused
    ``lost`` with ``held``, from the first message it holds.

An error answer has ``status`` ``error`` and a ``message``; a range the archive does not hold
has ``reason`` ``lost`` and ``held``, ``[start, stop]`` (stop -1 while live: up to
``recorded_position``), with it.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any, Final, Protocol

from slipstream.archive.catalog import (
    NULL_POSITION,
    Catalog,
    RecordingDescriptor,
    RecordingState,
)
from slipstream.archive.holding import (
    HELD_OPERATIONS,
    HeldStreams,
    NamedLogs,
    SessionGoneError,
    held_key,
)
from slipstream.archive.reading import (
    RecordingLostError,
    Segments,
    frame_at,
    position_at_time,
)
from slipstream.archive.recorder import Recording
from slipstream.archive.replayer import (
    POSITIONING_KEYS,
    LogSource,
    ReplaySession,
    ReplayState,
    SegmentSource,
)
from slipstream.archive.view import RecordingView
from slipstream.client.channel import keys_given, parse_channel
from slipstream.client.client import Client
from slipstream.client.errors import SlipstreamError
from slipstream.client.holding import Answers, decode_call
from slipstream.client.layout import FRAME_ALIGNMENT, INT32_MAX
from slipstream.client.logview import view_args
from slipstream.client.retention import message_start
from slipstream.client.subscription import Subscription

log = logging.getLogger("slipstream.archive")

#: Recordings a ``list`` answers at most by default (one answer is one message of a small
#: channel's log: about 8 KiB).
LIST_COUNT: Final = 12
#: The most a ``list`` call may ask for.
LIST_MAX: Final = 64
LOST: Final = "lost"


class CallRefused(ValueError):
    """A call answered with an error; ``fields`` go into the answer beside the message."""

    def __init__(self, message: str, **fields: Any) -> None:
        super().__init__(message)
        self.fields = fields


def _int_arg(args: dict[str, Any], name: str, low: int, high: int,
             default: int | None = None, *, optional: bool = False) -> int | None:
    value = args.get(name, default)
    if value is None and (optional or default is not None):
        return value
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise CallRefused(f"{name} {value!r} is not an integer in {low}..{high}")
    return value


def descriptor_fields(descriptor: RecordingDescriptor, recorded_position: int) -> dict[str, Any]:
    """A descriptor as a call's answer carries it."""
    return {"recording_id": descriptor.recording_id, "state": descriptor.state.name.lower(),
            "end_reason": descriptor.end_reason.name.lower(),
            "start_position": descriptor.start_position,
            "stop_position": descriptor.stop_position,
            "recorded_position": recorded_position,
            "start_time_ms": descriptor.start_time_ms, "stop_time_ms": descriptor.stop_time_ms,
            "initial_term_id": descriptor.initial_term_id,
            "term_length": descriptor.term_length, "segment_length": descriptor.segment_length,
            "mtu": descriptor.mtu, "session_id": descriptor.session_id,
            "stream_id": descriptor.stream_id, "channel": descriptor.channel,
            "source_identity": descriptor.source_identity}


class ControlHost(Protocol):
    """What a control stream serves: an archive service's recordings (``catalog`` None: none)
    and the logs it holds (``holds``), through its ``client``."""

    client: Client
    directory: Path | None
    catalog: Catalog | None
    recordings: dict[int, Recording]
    holds: HeldStreams | NamedLogs


class ArchiveControl:
    """The control stream of ``service`` (an :class:`~slipstream.archive.service.
    ArchiveService`, or a :class:`ControlHost` with no recordings that serves replays of a
    process's own logs) and its replays, on the service's one thread."""

    def __init__(self, service: ControlHost, address: str, port: int,
                 stream_id: int) -> None:
        self._service = service
        self.directory = service.directory
        self.channel = f"aeron:udp?endpoint={address}:{port}"
        self.stream_id = stream_id
        self._subscription: Subscription = service.client.add_subscription(self.channel,
                                                                            stream_id)
        self._answers = Answers(service.client)
        self.replays: dict[int, ReplaySession] = {}
        self._next_replay_id = 1
        self._calls: list[bytes] = []
        self.malformed = 0  # calls dropped: not JSON, or not a call
        self.served = 0  # replays sent whole
        log.info("control stream %s stream %d", self.channel, stream_id)

    def do_work(self) -> int:
        """Answer the calls that came, move every replay on; returns the work done."""
        work = self._subscription.poll(lambda data, _h: self._calls.append(bytes(data)), 16)
        for data in self._calls:
            self._call(data)
        self._calls.clear()
        now = time.monotonic()
        for replay_id, session in list(self.replays.items()):
            if session.recording_id is None:  # a live log's range: it holds all of it
                assert session.end is not None
                recorded, stopped = session.end, True
            else:
                recorded, stopped = self._recorded(session.recording_id)
            try:
                work += session.do_work(recorded, stopped, now)
            except Exception as e:  # that replay fails; the others and the calls go on
                log.exception("replay %d of %s failed", replay_id, session.source.name)
                session.fail(f"{type(e).__name__}: {e}")
            if session.is_over:
                self.served += session.state is ReplayState.DONE
                del self.replays[replay_id]
        work += self._answers.do_work()
        return work

    def wait_for_call(self, timeout_ns: int) -> None:
        """Wait up to ``timeout_ns`` for a call (parked: a call wakes it at once)."""
        self._subscription.wait_for_data(timeout_ns, 0)

    @property
    def logs_in_use(self) -> set[str]:
        """The live logs the replays in progress read (their mappings must stay)."""
        return {session.source.image.log_path for session in self.replays.values()
                if isinstance(session.source, LogSource)}

    def _recorded(self, recording_id: int) -> tuple[int, bool]:
        """How far a recording is recorded, and whether that is its stop."""
        recording = self._service.recordings.get(recording_id)
        if recording is not None and recording.is_active:
            return recording.recorded_position, False
        descriptor = self._catalog().get(recording_id)
        assert descriptor is not None
        if descriptor.stop_position == NULL_POSITION:  # recovery runs before any call
            return descriptor.start_position, True
        return descriptor.stop_position, True

    def _call(self, data: bytes) -> None:
        try:
            fields = json.loads(data)
            if not isinstance(fields, dict):
                raise ValueError("not a JSON object")
            call_id, op, args, reply, response_stream = decode_call(fields)
        except (UnicodeDecodeError, ValueError) as e:
            self.malformed += 1
            log.warning("control: a malformed call dropped (%s)", e)
            return
        try:
            answer = {"id": call_id, "status": "ok", "result": self._answer(op, args)}
        except CallRefused as e:
            answer = {"id": call_id, "status": "error", "message": str(e), **e.fields}
        except (ValueError, SlipstreamError) as e:
            answer = {"id": call_id, "status": "error", "message": str(e)}
        except Exception as e:  # the caller is told at once, not left to time out
            log.exception("control: the call %r failed", op)
            answer = {"id": call_id, "status": "error",
                      "message": f"the call {op!r} failed at the archive ({type(e).__name__}: "
                                 f"{e}); its log says more"}
        try:
            self._answers.send(reply, response_stream, answer)
        except SlipstreamError as e:
            log.warning("control: cannot answer %s: %s", reply, e)

    def _answer(self, op: str, args: dict[str, Any]) -> Any:
        if op in HELD_OPERATIONS and "recording_id" not in args:  # a held stream's call
            return self._service.holds.call(op, args)
        if op == "list":
            return self._list(args)
        if op == "describe":
            return self._listed(self._descriptor(args))
        if op == "recording_position":
            descriptor = self._descriptor(args)
            position, stopped = self._recorded(descriptor.recording_id)
            return {"position": position, "active": not stopped}
        if op == "replay":
            return self._replay(args)
        if op == "stop_replay":
            replay_id = _int_arg(args, "replay_id", 0, 2**63 - 1)
            session = self.replays.get(replay_id)  # type: ignore[arg-type]
            if session is None:
                return {"stopped": False}
            session.stop("stop_replay")
            return {"stopped": True}
        if op == "view" and "recording_id" in args:
            return self._view(args)
        if op == "replays":
            return [{"replay_id": s.replay_id, "recording_id": s.recording_id,
                     "source": s.source.name, "position": s.position,
                     "state": s.state.value, "channel": s.channel,
                     "stream_id": s.stream_id} for s in self.replays.values()]
        raise CallRefused(f"no operation {op!r} (the archive's: list, describe, "
                          f"recording_position, replay, stop_replay, replays, view, "
                          f"{', '.join(op for op in HELD_OPERATIONS if op != 'view')})")

    def _view(self, args: dict[str, Any]) -> Any:
        """A ``view`` question about a recording: its answer (JSON values)."""
        descriptor = self._descriptor(args)
        recorded, _ = self._recorded(descriptor.recording_id)
        method = args.get("method")
        checked = view_args(method if isinstance(method, str) else repr(method),
                            args.get("args"), recorded)
        with RecordingView(self._catalog_directory(), descriptor, recorded) as view:
            return getattr(view, str(method))(**checked)

    def _listed(self, descriptor: RecordingDescriptor) -> dict[str, Any]:
        return descriptor_fields(descriptor, self._recorded(descriptor.recording_id)[0])

    def _catalog(self) -> Catalog:
        catalog = self._service.catalog
        if catalog is None:
            raise CallRefused("this control stream has no recordings: it replays a query's "
                              "own logs")
        return catalog

    def _catalog_directory(self) -> Path:
        """The directory of the recordings (there are some: :meth:`_catalog` was asked)."""
        assert self.directory is not None
        return self.directory

    def _descriptor(self, args: dict[str, Any]) -> RecordingDescriptor:
        recording_id = _int_arg(args, "recording_id", 0, 2**63 - 1)
        descriptor = self._catalog().get(recording_id)  # type: ignore[arg-type]
        if descriptor is None or descriptor.state != RecordingState.VALID:
            raise CallRefused(f"no recording {recording_id} in the archive at "
                              f"{self.directory}")
        return descriptor

    def _list(self, args: dict[str, Any]) -> list[dict[str, Any]]:
        channel = args.get("channel")
        if channel is not None and not isinstance(channel, str):
            raise CallRefused(f"channel {channel!r} is not a string")
        stream_id = _int_arg(args, "stream_id", -INT32_MAX - 1, INT32_MAX, optional=True)
        session_id = _int_arg(args, "session_id", -INT32_MAX - 1, INT32_MAX, optional=True)
        from_id = _int_arg(args, "from_id", 0, 2**63 - 1, 0)
        count = _int_arg(args, "count", 1, LIST_MAX, LIST_COUNT)
        out = []
        for descriptor in self._catalog().recordings():
            if descriptor.recording_id < from_id:  # type: ignore[operator]
                continue
            if (channel is not None and channel not in descriptor.channel) or \
                    (stream_id is not None and descriptor.stream_id != stream_id) or \
                    (session_id is not None and descriptor.session_id != session_id):
                continue
            out.append(self._listed(descriptor))
            if len(out) >= count:  # type: ignore[operator]
                break
        return out

    def _replay_destination(self, args: dict[str, Any]) -> tuple[str, int]:
        """The ``channel`` and ``stream_id`` a replay goes to, checked."""
        channel = args.get("channel")
        if not isinstance(channel, str) or not channel.startswith(("aeron:udp", "aeron:ipc")):
            raise CallRefused(f"channel {channel!r} is not an aeron:udp or aeron:ipc URI")
        try:
            given = keys_given(parse_channel(channel))
        except (SlipstreamError, ValueError) as e:
            raise CallRefused(f"channel {channel!r}: {e}") from None
        set_here = sorted(given & set(POSITIONING_KEYS))
        if set_here:
            raise CallRefused(f"channel {channel!r} sets {', '.join(set_here)}: a replay's "
                              f"framing is its source's, which the archive sets")
        stream_id = _int_arg(args, "stream_id", -INT32_MAX - 1, INT32_MAX)
        assert stream_id is not None
        return channel, stream_id

    def _start_replay(self, source: SegmentSource | LogSource, start: int, end: int | None,
                      channel: str, stream_id: int, recording_id: int | None
                      ) -> dict[str, Any]:
        replay_id = self._next_replay_id
        self._next_replay_id += 1
        try:
            session = ReplaySession(replay_id, self._service.client, source, start, end,
                                    channel, stream_id, time.monotonic(),
                                    recording_id=recording_id)
        except BaseException:
            source.close()
            raise
        self.replays[replay_id] = session
        log.info("replay %d of %s [%d, %s) to %s stream %s, session %d", replay_id,
                 source.name, start, "-" if end is None else end, channel, stream_id,
                 session.session_id)
        return {"replay_id": replay_id, "session_id": session.session_id, "start": start,
                "end": end, "recording_id": recording_id}

    def _replay_held(self, args: dict[str, Any]) -> dict[str, Any]:
        """A replay of ``[start, end)`` of a held stream's session's live log."""
        held = args.get("held")
        if not isinstance(held, dict):
            raise CallRefused(f"held {held!r} is not a held stream's key (channel, stream_id, "
                              f"group)")
        key = held_key(held)
        session_id = _int_arg(args, "session_id", -INT32_MAX - 1, INT32_MAX)
        framing = args.get("log")
        if not isinstance(framing, list) or len(framing) != 2 or not all(
                isinstance(v, int) and not isinstance(v, bool) for v in framing):
            raise CallRefused(f"log {framing!r} is not [initial term id, term length]")
        channel, stream_id = self._replay_destination(args)
        start = _int_arg(args, "start", 0, 2**62)
        end = _int_arg(args, "end", 0, 2**62)
        assert start is not None and end is not None and session_id is not None
        try:
            image = self._service.holds.replay_source(key, session_id,
                                                      (framing[0], framing[1]))
        except SessionGoneError as e:
            raise CallRefused(f"{LOST}: {e}", reason=LOST, held=[end, end]) from None
        source = LogSource(image, f"stream {key[1]} session {session_id} held for group "
                                  f"{key[2]!r}")
        available = image.producer_position()
        if start % FRAME_ALIGNMENT or end % FRAME_ALIGNMENT or end < start:
            raise CallRefused(f"[{start}, {end}) is not a range of frame boundaries")
        if end > available:
            raise CallRefused(f"[{start}, {end}): {source.name}'s log reaches only "
                              f"{available}")
        # Padding inside a term (an aborted claim's), which a replay cannot reproduce, is
        # stepped over: the replay starts at the next message (a replay that meets such
        # padding ends there, and its reader asks again from there).  Start is checked held
        # after the walk: the cleaner may zero it meanwhile, and a zeroed frame reads as not
        # written yet (the range would look empty).
        begin = message_start(image, start, end)
        held_range = source.held(start, end)
        if held_range[0] != start:
            raise CallRefused(f"{LOST}: [{start}, {end}) of {source.name}: the live log no "
                              f"longer holds position {start} (it holds [{held_range[0]}, "
                              f"{available}))", reason=LOST, held=[*held_range])
        if begin >= end:
            return {"replay_id": 0, "session_id": 0, "start": end, "end": end,
                    "recording_id": None}
        return self._start_replay(source, begin, end, channel, stream_id, None)

    def _replay(self, args: dict[str, Any]) -> dict[str, Any]:
        if "held" in args:
            return self._replay_held(args)
        channel, stream_id = self._replay_destination(args)
        descriptor = self._descriptor(args)
        recorded, stopped = self._recorded(descriptor.recording_id)
        held = [descriptor.start_position, descriptor.stop_position]
        from_time = _int_arg(args, "from_time_ms", 0, 2**62, optional=True)
        if from_time is not None:
            if args.get("start") is not None:
                raise CallRefused("give start or from_time_ms, not both")
            start = min(position_at_time(self._catalog_directory(), descriptor, from_time),
                        recorded)
        else:
            start = _int_arg(args, "start", 0, 2**62, descriptor.start_position)
        end = _int_arg(args, "end", 0, 2**62, optional=True)
        assert start is not None
        where = (f"recording {descriptor.recording_id} holds [{descriptor.start_position}, "
                 f"{recorded}){'' if stopped else ' and is recording'}")
        if start < descriptor.start_position or start > recorded or \
                (end is not None and (end < start or (stopped and end > recorded))):
            raise CallRefused(f"{LOST}: [{start}, {'-' if end is None else end}) is not held: "
                              f"{where}", reason=LOST, held=held)
        if start % FRAME_ALIGNMENT or (end is not None and end % FRAME_ALIGNMENT):
            raise CallRefused(f"[{start}, {end}) is not a range of frame boundaries")
        for name, position in (("start", start), ("end", end)):
            # A bound inside a frame would copy nothing from there: refused naming it.
            if position is None or position >= recorded or \
                    position == descriptor.start_position:
                continue
            segments_check = _FrameCheck(self._catalog_directory(), descriptor, position)
            if not segments_check.ok:
                raise CallRefused(f"{name}: no frame of recording {descriptor.recording_id} "
                                  f"begins at {position}: {segments_check.why}",
                                  **({"reason": LOST, "held": held} if segments_check.lost
                                     else {}))
        return self._start_replay(SegmentSource(self._catalog_directory(), descriptor), start, end,
                                  channel, stream_id, descriptor.recording_id)

    def close(self) -> None:
        for session in self.replays.values():
            session.stop("the archive stopped")
        self.replays.clear()
        self._answers.close()
        self._subscription.close()


class _FrameCheck:
    """Whether a frame of the recording begins at ``position`` (its segment mapped just for
    the look)."""

    def __init__(self, directory: Path, descriptor: RecordingDescriptor, position: int) -> None:
        self.ok = False
        self.lost = False
        self.why = ""
        segments = Segments(directory, descriptor)
        try:
            segment = segments.at(position, position + 32)
            if frame_at(segment, position, descriptor) is None:
                self.why = "the position lies inside a frame (or the segment is not as recorded)"
            else:
                self.ok = True
        except RecordingLostError as e:
            self.lost = True
            self.why = str(e)
        finally:
            segments.close()
