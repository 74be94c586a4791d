"""Held streams: the archive holds a window of a stream's live log for a group of readers.

A Spark read query's planner normally holds its stream itself, on the Spark driver's host.
That host is not fixed in cluster deploy mode (the Spark driver starts on any worker, and
``--supervise`` restarts it on another), so publishers would not know where to send.  An
**ingest host** fixes it: publishers send there, and its archive holds the streams its
queries read (docs/SPARK.md, "Cluster deploy mode").

The archive subscribes to each stream a query asks for (or that a ``[[hold]]`` of its settings
names) and keeps the subscription for as long as it runs: its position, moved only when a
query commits (the ``view`` call's ``advance_to``), holds every message the query has not
committed, so a query may be down (stopped, restarting, its driver moving to another host)
for as long as the publishers may wait (they are held back one receiver window past it, as by
any slow subscriber).  A query asks, through its own host's driver and the archive's control
stream (:mod:`slipstream.archive.control`), what the logs hold and to move the position on
commit; read tasks on the ingest host read the log in shared memory, tasks elsewhere get
replays of it (the ``replay`` call with ``held``: :class:`~slipstream.archive.replayer.
ReplaySession` over the live log).

Each held stream is named by ``(channel, stream id, group)``: queries of different groups
(``holderGroup``) on one stream have a subscription, a position and a hold each.  A group
whose queries stopped calling for ``release_after`` is released (never, by default): its
subscription closes and stops holding publishers.
"""

from __future__ import annotations

import logging
import socket
import time
from typing import Any, Final

import attrs

from slipstream.client import Client, Image, Subscription
from slipstream.client.channel import parse_channel
from slipstream.client.counters import CountersFile
from slipstream.client.errors import ChannelError
from slipstream.client.holder import DEFAULT_GROUP
from slipstream.client.layout import INT32_MAX, INT32_MIN
from slipstream.client.logview import ImageView, SessionEnds, snapshot, view_answer, view_args

__all__ = ["HELD_OPERATIONS", "MAX_ENDED_ASKED", "DetachedLogs",
           "HeldStreams", "NamedLogs", "SessionGoneError", "driver_instance", "held_key"]

log = logging.getLogger("slipstream.archive")

#: How often the held streams' housekeeping runs (releases, unmapping the logs of ended
#: sessions), seconds.
HOUSEKEEPING_S: Final = 1.0
#: The calls about a held stream (their ``args`` name it: ``channel``, ``stream_id``,
#: ``group``).
HELD_OPERATIONS: Final = ("state", "view", "ended", "release")


@attrs.define
class _Held:
    """One held stream: the subscription that holds it, how its sessions that went ended,
    and when a query last called."""

    channel: str
    stream_id: int
    group: str
    subscription: Subscription
    ends: SessionEnds
    last_call: float
    since: float = attrs.field(factory=time.monotonic)  # when the hold was made


def held_key(args: dict[str, Any]) -> tuple[str, int, str]:
    """``(channel, stream id, group)`` of a call's ``args``; raises ValueError naming the one
    that is wrong."""
    channel, stream_id, group = args.get("channel"), args.get("stream_id"), args.get("group")
    if not isinstance(channel, str):
        raise ValueError(f"channel {channel!r} is not a channel URI")
    if isinstance(stream_id, bool) or not isinstance(stream_id, int) \
            or not INT32_MIN <= stream_id <= INT32_MAX:
        raise ValueError(f"stream_id {stream_id!r} is not a 32-bit integer")
    if not isinstance(group, str) or not group:
        raise ValueError(f"group {group!r} is not a name")
    return channel, stream_id, group


#: The most sessions an ``ended`` question may ask about (its answer, about 110 bytes a
#: session, fits an answer stream's message).
MAX_ENDED_ASKED: Final = 32


def driver_instance(counters: CountersFile) -> str:
    """What names one run of one driver: its pid and start time (``pid@start_time_ns``)."""
    return f"{counters.driver_pid}@{counters.start_time_ns}"


class DetachedLogs:
    """A replay server's own mappings of the logs it replays (:meth:`Image.detached`), by
    path: an image of a live subscription is unmapped when its session ends, under a replay
    that may still read it.  A mapping is dropped once its log left the subscriptions and no
    replay in progress reads it."""

    def __init__(self) -> None:
        self._images: dict[str, Image] = {}

    def get(self, path: str, join_position: int, channel_key: str | None) -> Image | None:
        """The mapping of the log at ``path`` (made at ``join_position``, before which it
        holds nothing) of a stream sealed under ``channel_key`` on the network (its
        :attr:`~slipstream.client.image.Image.channel_key`), or None when the file is gone."""
        image = self._images.get(path)
        if image is None:
            try:
                image = Image.detached(path, join_position, channel_key)
            except OSError:
                return None
            self._images[path] = image
        return image

    @property
    def paths(self) -> list[str]:
        """The logs mapped now."""
        return list(self._images)

    def prune(self, live: set[str], in_use: set[str]) -> None:
        """Unmap the logs neither in ``live`` (still a subscription's) nor ``in_use``."""
        for gone in set(self._images) - live - in_use:
            self._images.pop(gone).close()

    def close(self) -> None:
        for image in self._images.values():
            image.close()
        self._images.clear()


class HeldStreams:
    """The streams the archive holds in its host's driver (through ``client``), and the
    answers to the calls about them (:meth:`call`).  Used from the archive's one thread."""

    def __init__(self, client: Client, release_after_s: float | None = None) -> None:
        self.client = client
        self.release_after_s = release_after_s
        self.host = socket.gethostname()
        self.driver = driver_instance(client.counters)
        self._held: dict[tuple[str, int, str], _Held] = {}
        self._detached = DetachedLogs()
        self._next_housekeeping = 0.0

    def hold(self, channel: str, stream_id: int, group: str = DEFAULT_GROUP) -> _Held:
        """Hold ``stream_id`` on ``channel`` for ``group`` (at once, if not already held)."""
        key = (channel, stream_id, group)
        held = self._held.get(key)
        if held is None:
            try:
                parse_channel(channel)
            except ChannelError as e:
                raise ValueError(f"channel {channel!r}: {e}") from None
            ends = SessionEnds()
            subscription = self.client.add_subscription(channel, stream_id,
                                                        on_unavailable_image=ends.record)
            held = _Held(channel, stream_id, group, subscription, ends, time.monotonic())
            self._held[key] = held
            log.info("holding stream %d on %s for group %r", stream_id, channel, group)
        return held

    @property
    def held(self) -> list[tuple[str, int, str]]:
        """The streams held: ``(channel, stream id, group)``."""
        return list(self._held)

    def _image(self, held: _Held, session_id: int) -> Image | None:
        return held.subscription.image_by_session_id(session_id)

    def _found(self, key: tuple[str, int, str]) -> _Held:
        """The hold of ``key``; raises ValueError naming what is held when there is none."""
        held = self._held.get(key)
        if held is None:
            held_here = ", ".join(f"{s} on {c} ({g})" for c, s, g in self._held)
            if len(held_here) > 1000:
                held_here = f"{len(self._held)} streams"
            raise ValueError(f"stream {key[1]} on {key[0]} is not held here for group "
                             f"{key[2]!r} (held: {held_here or 'none'})")
        return held

    def call(self, op: str, args: dict[str, Any]) -> Any:
        """The answer to the call ``op`` (one of :data:`HELD_OPERATIONS`) about the held stream
        its ``args`` name: ``state`` (and holds it, unless ``hold`` is false), ``view``
        (a :data:`~slipstream.client.logview.VIEW_OPERATIONS` question about one session's
        log), ``ended`` (how sessions that went ended), ``release``.  Raises ValueError, whose
        message the caller gets."""
        key = held_key(args)
        if op == "release":
            held = self._held.pop(key, None)
            if held is not None:
                held.subscription.close()
                log.info("released stream %d on %s for group %r", key[1], key[0], key[2])
            return held is not None
        if op not in HELD_OPERATIONS:
            raise ValueError(f"op {op!r} is not one of {', '.join(HELD_OPERATIONS)}")
        if key not in self._held and (op in ("view", "ended") or args.get("hold") is False):
            self._found(key)  # only a query's state call holds a stream, never a question
        held = self.hold(*key)
        held.last_call = time.monotonic()
        if op == "state":
            held.subscription.release_gone_images()
            sessions = {str(image.session_id): snapshot(ImageView(image))
                        for image in held.subscription.images}
            return {"host": self.host, "driver": self.driver, "sessions": sessions,
                    "held_for": time.monotonic() - held.since}
        if op == "ended":
            asked = args.get("sessions")
            if not isinstance(asked, list) or len(asked) > MAX_ENDED_ASKED or not all(
                    isinstance(sid, int) and not isinstance(sid, bool) for sid in asked):
                raise ValueError(f"ended: sessions {asked!r} is not a list of at most "
                                 f"{MAX_ENDED_ASKED} session ids")
            ends = {str(sid): held.ends.get(sid) for sid in asked}
            return {sid: end.to_json() for sid, end in ends.items() if end is not None}
        session_id = args.get("session_id")
        if isinstance(session_id, bool) or not isinstance(session_id, int):
            raise ValueError(f"session_id {session_id!r} is not an integer")
        named = args.get("log")
        image = self._image(held, session_id)
        if image is None:
            end = held.ends.get(session_id)
            position = args.get("args", {}).get("position") \
                if isinstance(args.get("args"), dict) else None
            if end is not None and named == [*end.framing] and \
                    args.get("method") == "advance_to" and isinstance(position, int) and \
                    not isinstance(position, bool) and position <= end.position:
                # The session went after the caller's last state (it read to its end, or
                # the image went without it): there is no position left to move.
                return None
            raise ValueError(self._no_session(held, session_id))
        if named != [*image.identity.framing]:
            raise ValueError(f"session {session_id}'s log here has "
                             f"{image.identity.describe()}, not {named!r}")
        method = str(args.get("method"))
        checked = view_args(method, args.get("args"), image.producer_position())
        return view_answer(ImageView(image), method, checked)

    def replay_source(self, key: tuple[str, int, str], session_id: int,
                      framing: tuple[int, int]) -> Image:
        """The log of session ``session_id`` of the held stream ``key``, for a replay: a
        mapping of its own (an image of the held subscription is unmapped when its session
        ends, under a replay that may still read it; :meth:`prune` lets go of it).  Raises
        ValueError when the stream is not held or the session's log here is framed otherwise
        than ``framing`` (initial term id, term length), and :class:`SessionGoneError` (what
        the replay asks for is lost) when the session has no log here any more."""
        held = self._found(key)
        image = self._image(held, session_id)
        if image is None:
            raise SessionGoneError(self._no_session(held, session_id))
        if image.identity.framing != framing:
            raise ValueError(f"session {session_id}'s log here has "
                             f"{image.identity.describe()}, not {[*framing]!r}")
        mapped = self._detached.get(image.log_path, image.join_position, image.channel_key)
        if mapped is None:
            raise SessionGoneError(f"session {session_id}'s log {image.log_path} is gone")
        return mapped

    @staticmethod
    def _no_session(held: _Held, session_id: int) -> str:
        """Why ``held`` has no session ``session_id`` here: how it ended, when known."""
        end = held.ends.get(session_id)
        return (f"stream {held.stream_id} on {held.channel} has no session {session_id} here"
                + (f": {end.describe()}" if end is not None else ""))

    def do_work(self, logs_in_use: set[str]) -> None:
        """Release the groups idle longer than ``release_after_s``; unmap the logs of sessions
        no held subscription has and no replay reads (``logs_in_use``: their files are gone,
        the mapping is all that keeps their memory); at most every :data:`HOUSEKEEPING_S`."""
        now = time.monotonic()
        if now < self._next_housekeeping:
            return
        self._next_housekeeping = now + HOUSEKEEPING_S
        if self.release_after_s is not None:
            for key, held in list(self._held.items()):
                if now - held.last_call > self.release_after_s:
                    self.call("release", {"channel": key[0], "stream_id": key[1],
                                          "group": key[2]})
        for held in self._held.values():
            # The logs of sessions that ended stay mapped (their files unlinked) until
            # released: a stream no query calls for would keep them for as long as it is held.
            held.subscription.release_gone_images()
        live = {image.log_path for held in self._held.values()
                for image in held.subscription.images}
        self._detached.prune(live, logs_in_use)

    def close(self) -> None:
        for held in self._held.values():
            held.subscription.close()
        self._held.clear()
        self._detached.close()


class SessionGoneError(ValueError):
    """A replay asked for a session whose log is no longer here (its stream ended and the log
    went): what it asked for is lost."""


class NamedLogs:
    """Logs that another thread of this process holds (a Spark query's own subscriptions),
    named by (stream id, session id), for the replays a control stream serves of them
    (:class:`~slipstream.archive.control.ArchiveControl`); it answers no calls about held
    streams (the holder's own thread asks its images itself).  :attr:`logs` is replaced whole
    by the holding thread as images come and go: (stream id, session id) -> (log path, the
    subscription's join position: the log holds nothing before it, and the key its stream is
    sealed under on the network: the image's
    :attr:`~slipstream.client.image.Image.channel_key`)."""

    def __init__(self) -> None:
        self.logs: dict[tuple[int, int], tuple[str, int, str | None]] = {}
        self._detached = DetachedLogs()

    def call(self, op: str, args: dict[str, Any]) -> Any:
        raise ValueError(f"op {op!r}: this control stream replays a query's own logs only "
                         f"(no call about held streams)")

    def replay_source(self, key: tuple[str, int, str], session_id: int,
                      framing: tuple[int, int]) -> Image:
        """A mapping of the log of ``session_id`` of stream ``key[1]`` (as
        :meth:`HeldStreams.replay_source`); raises :class:`SessionGoneError` when this
        process holds no log of it, ValueError when its log is framed otherwise."""
        found = self.logs.get((key[1], session_id))
        image = self._detached.get(*found) if found is not None else None
        if image is None:
            raise SessionGoneError(f"stream {key[1]} session {session_id}: this holder holds "
                                   f"no log of that session (its stream ended and the log "
                                   f"went)")
        if image.identity.framing != framing:
            raise ValueError(f"session {session_id}'s log here has "
                             f"{image.identity.describe()}, not {[*framing]!r}")
        return image

    def do_work(self, logs_in_use: set[str]) -> None:
        """Unmap the logs no longer in :attr:`logs` that no replay reads (``logs_in_use``)."""
        self._detached.prune({path for path, _, _ in self.logs.values()}, logs_in_use)

    @property
    def mapped(self) -> list[str]:
        """The paths of the logs mapped for replays now."""
        return self._detached.paths

    def close(self) -> None:
        self._detached.close()
