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

**Protected calls.**  The control stream may have several endpoints: a plain one and one per
key name (``key=NAME``, docs/CHANNELS.md §7.8).  An endpoint keyed ``NAME`` opens only what a
holder of ``NAME`` sealed, so a call that arrived there is a call from a holder of that key:
its *caller key*.  Its answer goes back sealed under that key (the caller's ``reply_channel``
gets ``key=NAME``; a plain call's answer is plain).  A recording is of the key its recorded
channel names, a held stream of the key of its channel; a call that names one (every
operation above: by ``recording_id`` or a held stream's key) is answered only under that
key.  Otherwise the call is counted by cause (:data:`REFUSAL_CAUSES`, each a
:attr:`~slipstream.client.counters.CounterType.CALLS_REFUSED` counter), the key named only in
the archive's log, and answered as for a recording that is not there (a held stream's call,
whose channel names the key itself, is refused with ``reason`` ``unauthorized``).  A replay
is its caller's: ``replays`` lists, and ``stop_replay`` stops, only a caller key's own
(another's is answered as not running).  ``list`` leaves out another key's recordings.  A
replay of a keyed recording or held stream is published sealed under its key: the archive
puts ``key=`` on the caller's ``channel`` itself and refuses one naming another key, or
``aeron:ipc``.
With subnets set, a call whose image's source address (its SETUP's), reply channel or
replay channel is outside them is refused and counted; one from outside is not answered.

An error answer has ``status`` ``error`` and a ``message``; a range the archive does not hold
has ``reason`` ``lost`` and ``held``, ``[start, stop]`` (stop -1 while live: up to
``recorded_position``), with it.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import threading
import time
from collections.abc import Mapping
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
    archive_identity,
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
from slipstream.client.channel import (
    SPY_PREFIX,
    Subnet,
    channel_with_key,
    keys_given,
    parse_channel,
)
from slipstream.client.client import Client
from slipstream.client.counters import Counter, CountersFile, CounterType, fit_label
from slipstream.client.errors import SlipstreamError
from slipstream.client.holding import Answers, decode_call
from slipstream.client.image import Image, await_frames
from slipstream.client.layout import FRAME_ALIGNMENT, INT32_MAX
from slipstream.client.logview import view_answer, view_args
from slipstream.client.notices import SourceNotices
from slipstream.client.retention import message_start
from slipstream.client.subscription import Subscription

log = logging.getLogger("slipstream.archive")

#: Recordings a ``list`` answers at most by default (one answer is one message of a small
#: channel's log: about 8 KiB).
LIST_COUNT: Final = 12
#: The most a ``list`` call may ask for.
LIST_MAX: Final = 64
LOST: Final = "lost"
#: The ``reason`` of an answer that refuses a call about another key's recording or stream.
UNAUTHORIZED: Final = "unauthorized"
#: Why a call is refused, each counted (:attr:`ArchiveControl.refused`, and a
#: ``CALLS_REFUSED`` counter each): a plain call about a keyed recording or stream; a call
#: under another key; a call from, or answered or replayed to, an address outside the
#: control subnets; a keyed replay asked to a channel of another key (or to ``aeron:ipc``).
REFUSAL_CAUSES: Final = ("call-without-key", "call-with-other-key", "call-outside-subnets",
                         "replay-to-other-key")


def channel_key(channel: str) -> str | None:
    """The key a channel URI names (``key=``), None for a plain one (or one that does not
    parse: no stream of it is sealed)."""
    try:
        return parse_channel(channel).key
    except (SlipstreamError, ValueError):
        return None


def calls_refused_key(cause: str, identity: str) -> bytes:
    """The key of a ``CALLS_REFUSED`` counter: the cause, then the server's
    :func:`~slipstream.archive.reading.archive_identity` (of its directory, or of its control
    address for a server of no recordings)."""
    return cause.encode() + b"\0" + archive_identity(identity)


def read_calls_refused(counters: CountersFile, identity: str) -> dict[str, int]:
    """The calls the server of ``identity`` (its archive directory) refused, by cause, from
    its ``CALLS_REFUSED`` counters in its driver's counters file (0 for a cause not found:
    the server is not running)."""
    out = {}
    for cause in REFUSAL_CAUSES:
        info = counters.find(CounterType.CALLS_REFUSED, calls_refused_key(cause, identity))
        out[cause] = 0 if info is None else info.value
    return out


def _host_of(channel: str) -> str | None:
    """The host of a UDP channel's ``endpoint=`` (None: no endpoint, or not UDP)."""
    try:
        endpoint = parse_channel(channel).endpoint
    except (SlipstreamError, ValueError):
        return None
    return None if endpoint is None else endpoint.host


def _escaped(text: str) -> str:
    """``text`` (a caller's, in part) as one printable ASCII line for the log."""
    return text.encode("unicode_escape").decode("ascii")


def _cause(caller_key: str | None) -> str:
    """The refusal cause of a call under ``caller_key`` about another key's."""
    return "call-without-key" if caller_key is None else "call-with-other-key"


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
                 stream_id: int, *, keys: Mapping[str, int] | None = None,
                 subnets: tuple[Subnet, ...] = (),
                 configured_holds: frozenset[str] = frozenset()) -> None:
        """Calls at ``address:port`` (plain; port 0: none) and at ``address:keys[NAME]``
        sealed under each key ``NAME``, on ``stream_id``; answered only from ``subnets``
        (none: any source).  ``configured_holds``: the channels of the streams the settings
        hold (``[[hold]]``), which a call may name whatever hosts they send to."""
        self._service = service
        self.directory = service.directory
        self.stream_id = stream_id
        self.subnets = subnets
        self.configured_holds = configured_holds
        endpoints = ([(None, port)] if port else []) + sorted((keys or {}).items())
        #: The control channels: the caller key of each (None: plain) and its subscription.
        self.endpoints: list[tuple[str | None, Subscription]] = []
        self._counters: dict[str, Counter] = {}
        #: Set as a caller's image comes on any endpoint (:meth:`wait_for_call`).
        self._image_came = threading.Event()
        try:
            for key, key_port in endpoints:
                channel = channel_with_key(f"aeron:udp?endpoint={address}:{key_port}", key)
                self.endpoints.append((key, service.client.add_subscription(
                    channel, stream_id, on_available_image=self._call_image_came)))
                log.info("control stream %s stream %d", channel, stream_id)
            identity = str(self.directory) if self.directory is not None else \
                f"replays at {address}:{endpoints[0][1] if endpoints else 0}/{stream_id}"
            for cause in REFUSAL_CAUSES:
                self._counters[cause] = service.client.add_counter(
                    CounterType.CALLS_REFUSED, fit_label(f"calls-refused: {cause} {identity}"),
                    calls_refused_key(cause, identity))
        except BaseException:
            self._close_endpoints()
            raise
        #: The first control channel (the plain one when there is one).
        self.channel = channel_with_key(f"aeron:udp?endpoint={address}:{endpoints[0][1]}",
                                        endpoints[0][0]) if endpoints else ""
        self._answers = Answers(service.client)
        self.replays: dict[int, ReplaySession] = {}
        #: The caller key of each replay's caller: only a caller of that key sees or stops it.
        self._replay_keys: dict[int, str | None] = {}
        self._next_replay_id = 1
        self._calls: list[tuple[str | None, str, bytes]] = []
        self.malformed = 0  # calls dropped: not JSON, or not a call
        self.served = 0  # replays sent whole
        #: Calls refused, by cause (:data:`REFUSAL_CAUSES`).
        self.refused: dict[str, int] = dict.fromkeys(REFUSAL_CAUSES, 0)
        self._notices = SourceNotices()
        self._source = ""  # the source address of the call being answered

    def call_images(self) -> tuple[Image, ...]:
        """The images the calls arrive on (the control subscriptions'): what an idle
        service waits on beside its recordings."""
        return tuple(image for _, subscription in self.endpoints
                     for image in subscription.images)

    def _count_refusal(self, cause: str, message: str) -> None:
        """Count a refusal of ``cause``, and log ``message`` (the archive's log may name
        what the answer does not): at most once per caller and cause an interval
        (:class:`~slipstream.client.notices.SourceNotices`), the caller's text escaped."""
        self.refused[cause] += 1
        counter = self._counters.get(cause)
        if counter is not None:
            counter.set(self.refused[cause])
        self._notice(cause, message)

    def _notice(self, what: str, message: str) -> None:
        """Log ``message`` about the current call's source, unless one about ``what`` from
        it was logged within the interval (then it is counted, and told with the next)."""
        held = self._notices.tell((self._source, what), time.monotonic_ns())
        if held is None:
            return
        log.warning("control: a call from %s %s: %s%s", self._source, what,
                    _escaped(message), f" ({held} more held back)" if held else "")

    def _refuse(self, cause: str, message: str) -> CallRefused:
        """Count a refusal of ``cause``; the error that answers it."""
        self._count_refusal(cause, message)
        return CallRefused(message, reason=UNAUTHORIZED, cause=cause)

    def _within_subnets(self, host: str | None) -> bool:
        if not self.subnets:
            return True
        try:
            address = ipaddress.ip_address(host) if host is not None else None
        except ValueError:
            return False  # a name: what it resolves to is not the caller's to say
        return address is not None and any(address in subnet for subnet in self.subnets)

    def authorize(self, what: str, key: str | None, caller_key: str | None) -> None:
        """Raise (counted) unless a call under ``caller_key`` may learn of ``what``, which
        is of ``key`` (None: plain, anyone's): for what the caller named by its key itself
        (a held stream's channel), so the answer tells it nothing it did not say."""
        if not self._may_learn(what, key, caller_key):
            raise CallRefused(f"{what} is of key={key}; call on a control channel keyed {key}",
                              reason=UNAUTHORIZED, cause=_cause(caller_key))

    def _may_learn(self, what: str, key: str | None, caller_key: str | None) -> bool:
        """Whether a call under ``caller_key`` may learn of ``what``, which is of ``key``
        (None: plain, anyone's); a refusal is counted and logged (naming the key: only the
        archive's log does)."""
        if key is None or key == caller_key:
            return True
        self._count_refusal(_cause(caller_key), f"{what} is of key={key}; the call came "
                            f"{'plain' if caller_key is None else 'keyed ' + caller_key}")
        return False

    def do_work(self) -> int:
        """Answer the calls that came, move every replay on; returns the work done."""
        work = 0
        for key, subscription in self.endpoints:
            subscription.release_gone_images()
            for image in subscription.images:
                # Per image, so each call is known with its source (the image's SETUP's).
                source = image.source_identity
                work += image.poll(lambda data, _h, k=key, s=source:
                                   self._calls.append((k, s, bytes(data))), 16)
        for key, source, data in self._calls:
            self._call(data, key, source)
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
                self._replay_keys.pop(replay_id, None)
        work += self._answers.do_work()
        return work

    def _call_image_came(self, _image: Image) -> None:
        """A caller's image came on an endpoint (the client's conductor thread): wake a wait
        on any endpoint's images (:meth:`wait_for_call`, the service's idle park), which
        would not see it otherwise."""
        self._image_came.set()
        for _, subscription in list(self.endpoints):
            subscription._wake_waiters()

    def wait_for_call(self, timeout_ns: int) -> None:
        """Wait up to ``timeout_ns`` for a call on any endpoint (parked: a call wakes it at
        once, and so does a caller's first, whose image is new)."""
        self._image_came.clear()
        images = [image for image in self.call_images() if not image.is_closed]
        if images:
            await_frames(images, timeout_ns, 0)
        elif self.endpoints:
            self._image_came.wait(timeout_ns / 1e9)
        else:
            time.sleep(timeout_ns / 1e9)

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

    def _call(self, data: bytes, caller_key: str | None, source: str) -> None:
        self._source = source
        try:
            fields = json.loads(data)
            if not isinstance(fields, dict):
                raise ValueError("not a JSON object")
            call_id, op, args, reply, response_stream = decode_call(fields)
        except (UnicodeDecodeError, ValueError) as e:
            self.malformed += 1
            self._notice("malformed, dropped", str(e))
            return
        source_host = source.rpartition(":")[0].strip("[]")
        if not self._within_subnets(source_host) or not self._within_subnets(_host_of(reply)):
            # Not answered: the answer would go where a host outside the subnets said.
            self._refuse("call-outside-subnets", f"the call {op!r} (answers to {reply}) is "
                                                 f"outside the control subnets")
            return
        # Answers go back sealed under the key the call came with, whatever it named.
        reply = channel_with_key(reply, caller_key)
        try:
            answer = {"id": call_id, "status": "ok",
                      "result": self._answer(op, args, caller_key)}
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

    def _held_key(self, args: dict[str, Any], caller_key: str | None
                  ) -> tuple[str, int, str]:
        """The held stream a call names (``args`` themselves, or ``held`` of a replay),
        authorized for ``caller_key``."""
        key = held_key(args)
        if key[0].startswith(SPY_PREFIX):
            # A spy takes no key= and reads its publication's log in plain text, keyed or
            # not, and which it is the spy's URI does not say.
            raise CallRefused(f"channel {key[0]!r}: a spy is not held for callers (it would "
                              f"read a keyed publication in plain text): name the stream's "
                              f"own channel")
        self._check_held_channel(key[0])
        self.authorize(f"stream {key[1]} on {key[0]}", channel_key(key[0]), caller_key)
        return key

    def _check_held_channel(self, channel: str) -> None:
        """Refuse a held stream's ``channel`` that a call may not make the archive's driver
        subscribe to (unless the settings hold it): one naming a host (``endpoint=``,
        ``control=``) outside the control subnets, or a control address or mode
        (``control=``, ``control-mode=``), with which the subscription would send to a host
        the caller chose (status messages to ``control=``: a reflector at a third host)."""
        if not isinstance(self._service.holds, HeldStreams) or \
                channel in self.configured_holds or not channel.startswith("aeron:udp"):
            return  # a query's own logs are found, not subscribed to
        try:
            parsed = parse_channel(channel)
        except (SlipstreamError, ValueError) as e:
            raise CallRefused(f"channel {channel!r}: {e}") from None
        for part, host_port in (("endpoint", parsed.endpoint), ("control", parsed.control)):
            if host_port is not None and not self._within_subnets(host_port.host):
                raise self._refuse("call-outside-subnets", f"channel {channel!r}: {part}= "
                                   f"{host_port.host} is outside the control subnets")
        if parsed.control is not None or parsed.control_mode is not None:
            raise CallRefused(f"channel {channel!r}: a held stream named by a call takes no "
                              f"control= or control-mode= (its subscription would send to "
                              f"the host they name); hold it with a [[hold]] entry of the "
                              f"archive's settings")

    def _answer(self, op: str, args: dict[str, Any], caller_key: str | None = None) -> Any:
        if op in HELD_OPERATIONS and "recording_id" not in args:  # a held stream's call
            self._held_key(args, caller_key)
            return self._service.holds.call(op, args)
        if op == "list":
            return self._list(args, caller_key)
        if op == "describe":
            return self._listed(self._descriptor(args, caller_key))
        if op == "recording_position":
            descriptor = self._descriptor(args, caller_key)
            position, stopped = self._recorded(descriptor.recording_id)
            return {"position": position, "active": not stopped}
        if op == "replay":
            return self._replay(args, caller_key)
        if op == "stop_replay":
            replay_id = _int_arg(args, "replay_id", 0, 2**63 - 1)
            session = self.replays.get(replay_id)  # type: ignore[arg-type]
            # A replay is its caller key's: another's is answered as one that is not
            # running (not even that it exists is told); a keyed one's asked is counted.
            owner = None if session is None else self._replay_keys.get(session.replay_id)
            if session is None or owner != caller_key:
                if session is not None:
                    self._may_learn(f"replay {replay_id}", owner, caller_key)
                return {"stopped": False}
            session.stop("stop_replay")
            return {"stopped": True}
        if op == "view" and "recording_id" in args:
            return self._view(args, caller_key)
        if op == "replays":
            return [{"replay_id": s.replay_id, "recording_id": s.recording_id,
                     "source": s.source.name, "position": s.position,
                     "state": s.state.value, "channel": s.channel,
                     "stream_id": s.stream_id} for s in self.replays.values()
                    if self._replay_keys.get(s.replay_id) == caller_key]
        raise CallRefused(f"no operation {op!r} (the archive's: list, describe, "
                          f"recording_position, replay, stop_replay, replays, view, "
                          f"{', '.join(op for op in HELD_OPERATIONS if op != 'view')})")

    def _view(self, args: dict[str, Any], caller_key: str | None) -> Any:
        """A ``view`` question about a recording: its answer (JSON values)."""
        descriptor = self._descriptor(args, caller_key)
        recorded, _ = self._recorded(descriptor.recording_id)
        method = args.get("method")
        checked = view_args(method if isinstance(method, str) else repr(method),
                            args.get("args"), recorded)
        with RecordingView(self._catalog_directory(), descriptor, recorded) as view:
            return view_answer(view, str(method), checked)

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

    def _descriptor(self, args: dict[str, Any], caller_key: str | None
                    ) -> RecordingDescriptor:
        """The recording a call names, authorized for ``caller_key``."""
        recording_id = _int_arg(args, "recording_id", 0, 2**63 - 1)
        descriptor = self._catalog().get(recording_id)  # type: ignore[arg-type]
        # Another key's recording is answered as one that is not there: not even that it
        # exists is told.
        if descriptor is None or descriptor.state != RecordingState.VALID or \
                not self._may_learn(f"recording {recording_id}",
                                    channel_key(descriptor.channel), caller_key):
            raise CallRefused(f"no recording {recording_id} in the archive at "
                              f"{self.directory}")
        return descriptor

    def _list(self, args: dict[str, Any], caller_key: str | None) -> list[dict[str, Any]]:
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
                    (session_id is not None and descriptor.session_id != session_id) or \
                    channel_key(descriptor.channel) not in (None, caller_key):
                continue  # another key's recording is not listed: not even that it exists
            out.append(self._listed(descriptor))
            if len(out) >= count:  # type: ignore[operator]
                break
        return out

    def _replay_destination(self, args: dict[str, Any], key: str | None) -> tuple[str, int]:
        """The ``channel`` and ``stream_id`` a replay of a source of ``key`` goes to,
        checked: sealed under ``key`` (added here), within the subnets."""
        channel = args.get("channel")
        if not isinstance(channel, str) or not channel.startswith(("aeron:udp", "aeron:ipc")):
            raise CallRefused(f"channel {channel!r} is not an aeron:udp or aeron:ipc URI")
        try:
            parsed = parse_channel(channel)
            given = keys_given(parsed)
        except (SlipstreamError, ValueError) as e:
            raise CallRefused(f"channel {channel!r}: {e}") from None
        if key is not None:
            if parsed.media != "udp" or parsed.key not in (None, key):
                raise self._refuse("replay-to-other-key", f"channel {channel!r}: a replay of "
                                   f"key={key} leaves sealed under key={key}, on aeron:udp "
                                   f"only (name key={key} or no key)")
            channel = channel_with_key(channel, key)
        if parsed.media == "udp" and not self._within_subnets(_host_of(channel)):
            raise self._refuse("call-outside-subnets", f"channel {channel!r}: a replay to "
                                                       f"outside the control subnets")
        set_here = sorted(given & set(POSITIONING_KEYS))
        if set_here:
            raise CallRefused(f"channel {channel!r} sets {', '.join(set_here)}: a replay's "
                              f"framing is its source's, which the archive sets")
        stream_id = _int_arg(args, "stream_id", -INT32_MAX - 1, INT32_MAX)
        assert stream_id is not None
        return channel, stream_id

    def _start_replay(self, source: SegmentSource | LogSource, start: int, end: int | None,
                      channel: str, stream_id: int, recording_id: int | None,
                      caller_key: str | None) -> dict[str, Any]:
        """Start a replay for a caller under ``caller_key``: only such a caller sees it in
        ``replays`` or may stop it."""
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
        self._replay_keys[replay_id] = caller_key
        log.info("replay %d of %s [%d, %s) to %s stream %s, session %d", replay_id,
                 source.name, start, "-" if end is None else end, channel, stream_id,
                 session.session_id)
        return {"replay_id": replay_id, "session_id": session.session_id, "start": start,
                "end": end, "recording_id": recording_id}

    def _replay_held(self, args: dict[str, Any], caller_key: str | None) -> dict[str, Any]:
        """A replay of ``[start, end)`` of a held stream's session's live log."""
        held = args.get("held")
        if not isinstance(held, dict):
            raise CallRefused(f"held {held!r} is not a held stream's key (channel, stream_id, "
                              f"group)")
        key = self._held_key(held, caller_key)
        session_id = _int_arg(args, "session_id", -INT32_MAX - 1, INT32_MAX)
        framing = args.get("log")
        if not isinstance(framing, list) or len(framing) != 2 or not all(
                isinstance(v, int) and not isinstance(v, bool) for v in framing):
            raise CallRefused(f"log {framing!r} is not [initial term id, term length]")
        self._replay_destination(args, None)  # a channel no replay can take: told first
        start = _int_arg(args, "start", 0, 2**62)
        end = _int_arg(args, "end", 0, 2**62)
        assert start is not None and end is not None and session_id is not None
        try:
            image = self._service.holds.replay_source(key, session_id,
                                                      (framing[0], framing[1]))
        except SessionGoneError as e:
            raise CallRefused(f"{LOST}: {e}", reason=LOST, held=[end, end]) from None
        # The log's own key, as its driver said, whatever channel the call named it by (a
        # query's holder finds a log by its stream and session alone).
        self.authorize(f"stream {key[1]} session {session_id}", image.channel_key,
                       caller_key)
        channel, stream_id = self._replay_destination(args, image.channel_key)
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
        return self._start_replay(source, begin, end, channel, stream_id, None, caller_key)

    def _replay(self, args: dict[str, Any], caller_key: str | None) -> dict[str, Any]:
        if "held" in args:
            return self._replay_held(args, caller_key)
        self._replay_destination(args, None)  # a channel no replay can take: told first
        descriptor = self._descriptor(args, caller_key)
        recording_key = channel_key(descriptor.channel)
        channel, stream_id = self._replay_destination(args, recording_key)
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
                                  channel, stream_id, descriptor.recording_id, caller_key)

    def close(self) -> None:
        for session in self.replays.values():
            session.stop("the archive stopped")
        self.replays.clear()
        self._answers.close()
        self._close_endpoints()

    def _close_endpoints(self) -> None:
        for _, subscription in self.endpoints:
            subscription.close()
        self.endpoints.clear()
        for counter in self._counters.values():
            counter.close()
        self._counters.clear()


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
