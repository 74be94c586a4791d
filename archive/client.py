"""The caller's side of the archive's control stream: :class:`ArchiveClient` (Aeron Archive's
``AeronArchive``), through this host's driver, and :class:`ArchiveReplay`, a replay read
where the caller is.

The calls are :mod:`slipstream.client.holding`'s (a :class:`HolderLink` to the archive's
control stream): one JSON message each way, the answers at this host's reply endpoint
(:func:`~slipstream.client.holding.reply_channel_towards`).  The operations are
:mod:`slipstream.archive.control`'s.
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

from slipstream.archive.catalog import NULL_POSITION, EndReason, RecordingDescriptor, RecordingState
from slipstream.archive.control import LIST_MAX, LOST
from slipstream.archive.reading import RecordingLostError
from slipstream.archive.settings import DEFAULT_CONTROL_PORT, DEFAULT_CONTROL_STREAM_ID
from slipstream.client.channel import channel_with_key
from slipstream.client.client import Client
from slipstream.client.errors import SlipstreamError
from slipstream.client.holding import CallError, HolderLink, reply_subscription_channel
from slipstream.client.image import Image
from slipstream.client.layout import INT32_MAX
from slipstream.client.logview import RemoteView
from slipstream.client.messages import FragmentHandler, GatheredMessages
from slipstream.client.subscription import Subscription

__all__ = ["ArchiveClient", "ArchiveReplay", "ListedRecording", "ReplayStarted"]


@dataclass(frozen=True)
class ListedRecording:
    """A recording as the archive lists it: its descriptor and how far it is recorded now
    (a live one's recorded position; a stopped one's stop)."""

    descriptor: RecordingDescriptor
    recorded_position: int

    @property
    def recording_id(self) -> int:
        return self.descriptor.recording_id

    @property
    def is_active(self) -> bool:
        return self.descriptor.is_active


@dataclass(frozen=True)
class ReplayStarted:
    """The archive's answer to a replay: its id (for ``stop_replay``), the session id of its
    stream on the channel named, and its range (``end`` None: it follows the recording);
    ``recording_id`` None for a range of a held stream's live log."""

    replay_id: int
    session_id: int
    start: int
    end: int | None
    recording_id: int | None

    @classmethod
    def of(cls, answer: dict[str, Any]) -> ReplayStarted:
        """The answer of a ``replay`` call."""
        recording_id = answer.get("recording_id")
        return cls(int(answer["replay_id"]), int(answer["session_id"]), int(answer["start"]),
                   None if answer.get("end") is None else int(answer["end"]),
                   None if recording_id is None else int(recording_id))


def _given(**args: Any) -> dict[str, Any]:
    """A call's ``args``: those not None."""
    return {name: value for name, value in args.items() if value is not None}


def _position(answer: dict[str, Any]) -> tuple[int, bool]:
    """``(position, active)`` of a ``recording_position`` answer."""
    return int(answer["position"]), bool(answer["active"])


def _lost_or(error: CallError) -> CallError | RecordingLostError:
    """A call's error: :class:`RecordingLostError` when the archive answered that it does not
    hold the range asked for, else ``error``."""
    answer = error.answer or {}
    if answer.get("reason") != LOST:
        return error
    held = answer.get("held") or [NULL_POSITION, NULL_POSITION]
    return RecordingLostError(str(error), (int(held[0]), int(held[1])))


def _listed(fields: dict[str, Any]) -> ListedRecording:
    descriptor = RecordingDescriptor(
        fields["recording_id"], RecordingState[fields["state"].upper()],
        EndReason[fields["end_reason"].upper()], fields["start_position"],
        fields["stop_position"], fields["start_time_ms"], fields["stop_time_ms"],
        fields["initial_term_id"], fields["term_length"], fields["segment_length"],
        fields["mtu"], fields["session_id"], fields["stream_id"], fields["channel"],
        fields["source_identity"])
    return ListedRecording(descriptor, fields["recorded_position"])


class ArchiveClient:
    """A standing link to the archive whose control stream is ``control_stream_id`` at
    ``address:port`` (its settings' ``control_*``), through ``client``'s driver; answers
    come back at ``reply_address`` (this host's address towards the archive when None), at
    the archive's port, or ``reply_port``.  ``address`` may be a host name (a headless
    Service's): the link follows it when the archive moves (:class:`HolderLink`).
    ``key``: the archive's control endpoint at ``port`` is keyed so (its ``control_keys``):
    the calls, their answers and replays to this host's reply endpoint are sealed under it,
    and the archive answers about its recordings of that key (docs/ARCHIVE.md, "Protected
    calls").  Use from one thread.  Raises :class:`~slipstream.client.holding.CallError` for
    a call the archive refuses or does not answer in ``timeout_s``,
    :class:`RecordingLostError` for a range it does not hold.

    Each call has an async form of the same name with ``_async`` (``describe_async``,
    ``replay_async``, ...) for a trio or asyncio task: it waits for the answer without
    blocking the event loop (:meth:`HolderLink.call_async`), and a cancelled one ends at once,
    its answer dropped when it comes.  One call at a time: a second waits for the first."""

    def __init__(self, client: Client, address: str = "127.0.0.1",
                 port: int = DEFAULT_CONTROL_PORT,
                 control_stream_id: int = DEFAULT_CONTROL_STREAM_ID, *, timeout_s: float = 30.0,
                 reply_address: str | None = None, reply_port: int | None = None,
                 key: str | None = None) -> None:
        self.client = client
        #: Which archive this is: its control address, port and control stream id.
        self.archive: tuple[str, int, int] = (address, port, control_stream_id)
        #: Whether :attr:`is_connected` was ever seen true (a link that was connected and is
        #: not lost its archive; one never connected may be one just made).
        self.was_connected = False
        #: The key the calls, their answers and replays to this host's reply endpoint are
        #: sealed under (None: plain): the archive's control endpoint at ``port`` is of it.
        self.key = key
        self._link = HolderLink(client, address, port, control_stream_id,
                                timeout_s=timeout_s, reply_address=reply_address,
                                reply_port=reply_port, key=key)

    @property
    def timeout_s(self) -> float:
        """How long a call waits for the archive's answer, seconds."""
        return self._link.timeout_s

    @timeout_s.setter
    def timeout_s(self, value: float) -> None:
        self._link.timeout_s = value

    @property
    def is_connected(self) -> bool:
        """Whether the archive's control stream has a subscriber now (its driver says so):
        False when the archive is not running, or not yet known to be (a link just made),
        and a call would wait for its timeout."""
        connected = self._link.is_connected
        if connected:
            self.was_connected = True
        return connected

    def await_connected(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for :attr:`is_connected`; whether it is."""
        deadline = time.monotonic() + timeout_s
        while not self.is_connected:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.001)
        return True

    @property
    def reply_channel(self) -> str:
        """This host's endpoint where the archive's answers (and replays, by default) come."""
        return self._link.reply_channel

    async def await_connected_async(self, timeout_s: float) -> bool:
        """:meth:`await_connected` from a trio or asyncio task (it sleeps on the loop)."""
        import anyio

        deadline = time.monotonic() + timeout_s
        while not self.is_connected:
            if time.monotonic() > deadline:
                return False
            await anyio.sleep(0.001)
        return True

    def _call(self, op: str, **args: Any) -> Any:
        try:
            return self._link.call(op, **args)
        except CallError as e:
            raise _lost_or(e) from None

    async def _call_async(self, op: str, **args: Any) -> Any:
        try:
            return await self._link.call_async(op, **args)
        except CallError as e:
            raise _lost_or(e) from None

    def list_recordings(self, *, channel: str | None = None, stream_id: int | None = None,
                        session_id: int | None = None, from_id: int = 0,
                        count: int | None = None) -> list[ListedRecording]:
        """The recordings whose channel contains ``channel``, whose stream is ``stream_id``
        and whose session is ``session_id`` (each optional), from id ``from_id``, at most
        ``count`` (the archive's default when None)."""
        return [_listed(fields) for fields in self._call(
            "list", **_given(from_id=from_id, channel=channel, stream_id=stream_id,
                             session_id=session_id, count=count))]

    async def list_recordings_async(self, *, channel: str | None = None,
                                    stream_id: int | None = None,
                                    session_id: int | None = None, from_id: int = 0,
                                    count: int | None = None) -> list[ListedRecording]:
        """:meth:`list_recordings` from a trio or asyncio task."""
        return [_listed(fields) for fields in await self._call_async(
            "list", **_given(from_id=from_id, channel=channel, stream_id=stream_id,
                             session_id=session_id, count=count))]

    def list_all_recordings(self, *, stream_id: int | None = None,
                            session_id: int | None = None) -> list[ListedRecording]:
        """Every recording of ``stream_id`` and ``session_id`` (each optional), in id order:
        :meth:`list_recordings` page after page."""
        out: list[ListedRecording] = []
        from_id = 0
        while True:
            page = self.list_recordings(stream_id=stream_id, session_id=session_id,
                                        from_id=from_id, count=LIST_MAX)
            out += page
            if len(page) < LIST_MAX:
                return out
            from_id = page[-1].recording_id + 1

    async def list_all_recordings_async(self, *, stream_id: int | None = None,
                                        session_id: int | None = None
                                        ) -> list[ListedRecording]:
        """:meth:`list_all_recordings` from a trio or asyncio task."""
        out: list[ListedRecording] = []
        from_id = 0
        while True:
            page = await self.list_recordings_async(stream_id=stream_id, session_id=session_id,
                                                    from_id=from_id, count=LIST_MAX)
            out += page
            if len(page) < LIST_MAX:
                return out
            from_id = page[-1].recording_id + 1

    def describe(self, recording_id: int) -> ListedRecording:
        return _listed(self._call("describe", recording_id=recording_id))

    async def describe_async(self, recording_id: int) -> ListedRecording:
        """:meth:`describe` from a trio or asyncio task."""
        return _listed(await self._call_async("describe", recording_id=recording_id))

    def recording_position(self, recording_id: int) -> tuple[int, bool]:
        """``(position, active)``: a live recording's recorded position, or a stopped one's
        stop position."""
        return _position(self._call("recording_position", recording_id=recording_id))

    async def recording_position_async(self, recording_id: int) -> tuple[int, bool]:
        """:meth:`recording_position` from a trio or asyncio task."""
        return _position(await self._call_async("recording_position",
                                                recording_id=recording_id))

    def view(self, recording_id: int, method: str, args: dict[str, Any]) -> Any:
        """Ask the archive a planner's question about a recording (``method``, one of
        :data:`~slipstream.client.logview.VIEW_OPERATIONS`, with its ``args``): the answer
        of its :class:`~slipstream.archive.view.RecordingView`."""
        return self._call("view", recording_id=recording_id, method=method, args=args)

    async def view_async(self, recording_id: int, method: str, args: dict[str, Any]) -> Any:
        """:meth:`view` from a trio or asyncio task."""
        return await self._call_async("view", recording_id=recording_id, method=method,
                                      args=args)

    def recording_view(self, recording: ListedRecording) -> RemoteView:
        """A :class:`~slipstream.client.logview.RemoteView` of ``recording`` (as listed: its
        attributes are the listing's) whose questions this link asks the archive."""
        d = recording.descriptor
        state = {"stream_id": d.stream_id, "initial_term_id": d.initial_term_id,
                 "term_length": d.term_length, "mtu": d.mtu,
                 "log_path": f"recording {d.recording_id}",
                 "join_position": d.start_position, "position": recording.recorded_position,
                 "available": recording.recorded_position, "earliest": d.start_position,
                 "end_of_stream": d.stop_position if d.end_reason == EndReason.END_OF_STREAM
                 and not d.is_active else None}
        return RemoteView(self._link, {"recording_id": d.recording_id}, d.session_id, state)

    def start_replay(self, recording_id: int, channel: str, stream_id: int, *,
                     start: int | None = None, end: int | None = None,
                     from_time_ms: int | None = None) -> ReplayStarted:
        """Have the archive replay ``[start, end)`` of the recording (``start`` None: its
        start, or where the time index puts ``from_time_ms``, epoch ms; ``end`` None: follow
        it until it stops) to ``channel`` / ``stream_id``, whose subscriber it waits for up
        to 10 s.  Messages keep their recorded positions."""
        return ReplayStarted.of(self._call("replay", **_given(
            recording_id=recording_id, channel=channel, stream_id=stream_id, start=start,
            end=end, from_time_ms=from_time_ms)))

    async def start_replay_async(self, recording_id: int, channel: str, stream_id: int, *,
                                 start: int | None = None, end: int | None = None,
                                 from_time_ms: int | None = None) -> ReplayStarted:
        """:meth:`start_replay` from a trio or asyncio task."""
        return ReplayStarted.of(await self._call_async("replay", **_given(
            recording_id=recording_id, channel=channel, stream_id=stream_id, start=start,
            end=end, from_time_ms=from_time_ms)))

    def stop_replay(self, replay_id: int) -> bool:
        """Stop a replay; whether it was still running."""
        return bool(self._call("stop_replay", replay_id=replay_id)["stopped"])

    async def stop_replay_async(self, replay_id: int) -> bool:
        """:meth:`stop_replay` from a trio or asyncio task."""
        return bool((await self._call_async("stop_replay", replay_id=replay_id))["stopped"])

    def replay(self, recording_id: int, *, start: int | None = None, end: int | None = None,
               from_time_ms: int | None = None, channel: str | None = None,
               stream_id: int | None = None, session_id: int | None = None) -> ArchiveReplay:
        """A replay read here: a subscription at ``channel`` (default this host's reply
        endpoint) on ``stream_id`` (default a fresh one), then :meth:`start_replay` to it.
        ``session_id``: the replay's stream has that session id (the recording's own, so that
        its frames are the recorded ones byte for byte; default one the archive's driver
        draws).  Read it with :meth:`ArchiveReplay.poll` until :attr:`ArchiveReplay.done`."""
        return self._replay_here(
            lambda to, stream: self.start_replay(recording_id, to, stream, start=start,
                                                 end=end, from_time_ms=from_time_ms),
            channel, stream_id, session_id)

    async def replay_async(self, recording_id: int, *, start: int | None = None,
                           end: int | None = None, from_time_ms: int | None = None,
                           channel: str | None = None, stream_id: int | None = None,
                           session_id: int | None = None) -> ArchiveReplay:
        """:meth:`replay` from a trio or asyncio task (read it with
        :meth:`ArchiveReplay.read_all_async`, close it with ``async with``).  A cancellation
        leaves no subscription open."""
        return await self._replay_here_async(
            lambda to, stream: self.start_replay_async(recording_id, to, stream, start=start,
                                                       end=end, from_time_ms=from_time_ms),
            channel, stream_id, session_id)

    def replay_held(self, held: dict[str, Any], session_id: int, framing: tuple[int, int],
                    start: int, end: int) -> ArchiveReplay:
        """A replay read here (as :meth:`replay`'s) of ``[start, end)`` of session
        ``session_id``'s live log, framed ``framing`` (initial term id, term length), of the
        stream the archive holds for a group (``held``: its ``channel``, ``stream_id`` and
        ``group``: :mod:`slipstream.archive.holding`).  It begins at the first message at or
        after ``start`` (``ArchiveReplay.start``; done at once, replay id 0, when none begins
        before ``end``) and ends early, before padding inside a term (an aborted claim's),
        where a replay from there goes on.  Raises :class:`RecordingLostError` when the log
        no longer holds ``start`` (its ``held`` begins at the first message it holds)."""
        return self._replay_here(
            lambda to, stream: ReplayStarted.of(self._call(
                "replay", held=held, session_id=session_id, log=[*framing], start=start,
                end=end, channel=to, stream_id=stream)),
            None, None, None)

    async def replay_held_async(self, held: dict[str, Any], session_id: int,
                                framing: tuple[int, int], start: int, end: int
                                ) -> ArchiveReplay:
        """:meth:`replay_held` from a trio or asyncio task."""
        async def start_replay(to: str, stream: int) -> ReplayStarted:
            return ReplayStarted.of(await self._call_async(
                "replay", held=held, session_id=session_id, log=[*framing], start=start,
                end=end, channel=to, stream_id=stream))

        return await self._replay_here_async(start_replay, None, None, None)

    def _replay_here(self, start_replay: Callable[[str, int], ReplayStarted],
                     channel: str | None, stream_id: int | None, session_id: int | None
                     ) -> ArchiveReplay:
        """A subscription at ``channel`` (default this host's reply endpoint) on
        ``stream_id`` (default a fresh one), then ``start_replay(channel, stream_id)``."""
        if channel is None:
            # The reply channel worked out again (the archive may have moved: this host's
            # address towards it may be another).
            self._link.wait_for_contact(time.monotonic() + self.timeout_s)
        subscription_channel, channel, stream_id = self._replay_target(channel, stream_id,
                                                                       session_id)
        subscription = self.client.add_subscription(subscription_channel, stream_id)
        try:
            started = start_replay(channel, stream_id)
        except BaseException:
            subscription.close()
            raise
        return ArchiveReplay(self, subscription, started)

    async def _replay_here_async(
            self, start_replay: Callable[[str, int], Awaitable[ReplayStarted]],
            channel: str | None, stream_id: int | None, session_id: int | None
    ) -> ArchiveReplay:
        """:meth:`_replay_here` from a trio or asyncio task."""
        import anyio
        import anyio.to_thread

        if channel is None:
            await self._link.wait_for_contact_async(time.monotonic() + self.timeout_s)
        subscription_channel, channel, stream_id = self._replay_target(channel, stream_id,
                                                                       session_id)
        # The registration (a round trip to the driver) in a worker thread, finished even
        # when the task is cancelled meanwhile, so that the subscription it made is closed
        # below, not left open.
        with anyio.CancelScope(shield=True):
            subscription = await anyio.to_thread.run_sync(self.client.add_subscription,
                                                          subscription_channel, stream_id)
        try:
            started = await start_replay(channel, stream_id)
        except BaseException:
            subscription.close()
            raise
        return ArchiveReplay(self, subscription, started)

    def _replay_target(self, channel: str | None, stream_id: int | None,
                       session_id: int | None) -> tuple[str, str, int]:
        """``(subscription channel, channel the replay is asked to, stream id)`` of a replay
        read here: ``channel`` (None: this host's reply endpoint, sealed under the key),
        ``stream_id`` (None: a fresh one), the replay's stream of ``session_id`` if given."""
        if stream_id is None:
            stream_id = random.randrange(1, INT32_MAX)
            while stream_id == self._link.response_stream_id:
                stream_id = random.randrange(1, INT32_MAX)
        if channel is None:
            channel = channel_with_key(self.reply_channel, self.key)
            subscription_channel = reply_subscription_channel(channel)
        else:
            subscription_channel = channel
        if session_id is not None:
            channel = f"{channel}{'|' if '?' in channel else '?'}session-id={session_id}"
        return subscription_channel, channel, stream_id

    def close(self) -> None:
        self._link.close()

    def __enter__(self) -> ArchiveClient:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


class ArchiveReplay:
    """A replay being read where it was asked for (:meth:`ArchiveClient.replay`): ``poll``
    and ``poll_gathered`` as an image's, positions the recording's, until :attr:`done`.
    A stream that ends before the range does (the replay failed or was stopped) raises
    :class:`~slipstream.client.errors.SlipstreamError` naming where."""

    def __init__(self, archive: ArchiveClient, subscription: Subscription,
                 started: ReplayStarted) -> None:
        self.archive = archive
        self.subscription = subscription
        self.started = started
        self.replay_id = started.replay_id
        self.start = started.start
        self.end = started.end
        self.position = started.start
        self._stop_position: int | None = None  # a followed recording's, once it stopped
        self._closed = False

    def image(self) -> Image | None:
        return self.subscription.image_by_session_id(self.started.session_id)

    @property
    def done(self) -> bool:
        if self.end is not None:
            return self.position >= self.end
        return self._stop_position is not None and self.position >= self._stop_position

    def poll(self, handler: FragmentHandler, fragment_limit: int = 256) -> int:
        count = self._poll(handler, fragment_limit)
        image = self.image()
        if count == 0 and image is not None:
            self._check_end(image)
        return count

    def _poll(self, handler: FragmentHandler, fragment_limit: int) -> int:
        """:meth:`poll` without the end's check (which may call the archive)."""
        image = self.image()
        if image is None:
            return 0
        count = image.poll(handler, fragment_limit)
        self.position = image.position
        return count

    def poll_gathered(self, max_messages: int = 4096) -> GatheredMessages | None:
        image = self.image()
        if image is None:
            return None
        chunk = image.poll_gathered(max_messages)
        self.position = image.position
        if chunk is None:
            self._check_end(image)
        return chunk

    def _check_end(self, image: Image) -> None:
        """At the end of the replay's stream: raise unless the range was read whole.  The
        image's end of stream is read once: the driver may set it meanwhile, and an end seen
        only by the second look would be taken as short without asking the archive."""
        ended = image.is_end_of_stream
        if self._end_asks_stop(ended):
            self._stopped_at(*self.archive.recording_position(self._followed_id()))
        self._raise_if_short(ended)

    async def _check_end_async(self, image: Image) -> None:
        """:meth:`_check_end` from a trio or asyncio task."""
        ended = image.is_end_of_stream
        if self._end_asks_stop(ended):
            self._stopped_at(*await self.archive.recording_position_async(
                self._followed_id()))
        self._raise_if_short(ended)

    def _end_asks_stop(self, ended: bool) -> bool:
        """Whether the stream ended (``ended``: its image's end of stream) short of a
        followed recording's stop not known yet: whole if the recording stopped where it
        ended (the archive is asked)."""
        return (ended and not self.done and self.end is None
                and self.started.recording_id is not None)

    def _followed_id(self) -> int:
        assert self.started.recording_id is not None
        return self.started.recording_id

    def _stopped_at(self, position: int, active: bool) -> None:
        if not active:
            self._stop_position = position

    def _raise_if_short(self, ended: bool) -> None:
        if not ended or self.done:
            return
        source = "a held stream's live log" if self.started.recording_id is None else \
            f"recording {self.started.recording_id}"
        raise SlipstreamError(f"the replay {self.replay_id} of {source} "
                              f"ended at position {self.position}, "
                              f"before {self.end if self.end is not None else 'its stop'}: "
                              f"stopped, or failed (the archive's log says why)")

    def wait(self, timeout_s: float) -> bool:
        return self.subscription.wait_for_data(int(timeout_s * 1e9), 0)

    def read_all(self, handler: FragmentHandler, timeout_s: float = 60.0) -> None:
        """Poll until :attr:`done`; raises TimeoutError when it is not within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while not self.done:
            if self.poll(handler, 4096) == 0:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the replay {self.replay_id} is at {self.position} "
                                       f"after {timeout_s:g} s")
                self.wait(0.01)

    async def read_all_async(self, handler: FragmentHandler, timeout_s: float = 60.0) -> None:
        """:meth:`read_all` from a trio or asyncio task, without blocking the event loop: each
        poll is a checkpoint, each wait parks in a worker thread until data comes
        (:mod:`slipstream.client.aio`), and the check of a followed recording's stop at the
        stream's end is :meth:`ArchiveClient.recording_position_async`.  A cancellation ends
        it at once, taken before a poll, never after one (:attr:`position` is what was
        handled)."""
        from slipstream.client import aio

        deadline = time.monotonic() + timeout_s
        while not self.done:
            if await aio.poll_async(lambda: self._poll(handler, 4096)):
                continue
            image = self.image()
            if image is not None and image.is_end_of_stream:
                await self._check_end_async(image)
                continue
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"the replay {self.replay_id} is at {self.position} "
                                   f"after {timeout_s:g} s")
            await aio.wait_for_data(self.subscription, int(remaining * 1e9))

    @contextlib.contextmanager
    def _closing(self, stop_at_archive: bool) -> Iterator[bool]:
        """What both closes do around their stop: yields whether the replay is to be stopped at
        the archive (False once closed already), passes over a :class:`SlipstreamError` of
        that stop (the archive ends a replay whose requester went, in time), and closes the
        subscription whatever the stop raised."""
        if self._closed:
            yield False
            return
        self._closed = True
        try:
            with contextlib.suppress(SlipstreamError):
                yield stop_at_archive and not self.done
        finally:
            self.subscription.close()

    def close(self, *, stop_at_archive: bool = True) -> None:
        """Stop the replay at the archive if it is not done (unless not ``stop_at_archive``:
        an archive that stopped answering is not called, its replay ends when its requester
        goes), and close the subscription."""
        with self._closing(stop_at_archive) as stop:
            if stop:
                self.archive.stop_replay(self.replay_id)

    async def aclose(self, *, stop_at_archive: bool = True) -> None:
        """:meth:`close` from a trio or asyncio task (``async with``): the stop is
        :meth:`ArchiveClient.stop_replay_async`.  Cancelled, it still closes the subscription
        (the archive ends a replay whose requester went, in time)."""
        with self._closing(stop_at_archive) as stop:
            if stop:
                await self.archive.stop_replay_async(self.replay_id)

    def __enter__(self) -> ArchiveReplay:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    async def __aenter__(self) -> ArchiveReplay:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.aclose()
