"""The standing holder: an ingest host's process that holds streams for read queries.

A read query's planner normally holds its stream itself, on the Spark driver's host.  That host
is not fixed in cluster deploy mode (the Spark driver starts on any worker, and ``--supervise``
restarts it on another), so publishers would not know where to send.  An **ingest host** fixes
it: publishers send there, and ``slipstream-holder`` runs there beside its slipstream driver.

The holder subscribes to each stream a query asks for (or that ``--hold`` names at start) and
keeps the subscription for as long as it runs: its position, moved only when a query commits,
holds every message the query has not committed, so a query may be down (stopped, restarting,
its driver moving to another host) for as long as the publishers may wait (they are held back
one receiver window past it, as by any slow subscriber).  A query finds the holder by its
``holder`` option and asks it, through its own host's driver (calls,
:mod:`slipstream.client.holding`), what the logs hold and to move the position on commit; read
tasks on the ingest host read the log in shared memory, tasks elsewhere get replays
(:mod:`slipstream.client.replay`) from it.

Each held stream is named by ``(channel, stream id, group)``: queries of different groups
(``holderGroup``) on one stream have a subscription, a position and a hold each.  A group
whose queries stopped calling for ``--release-after`` seconds is released (never, by
default): its subscription closes and stops holding publishers.

It needs only the base install (no Spark): an ingest host need not have Spark.
"""

from __future__ import annotations

import argparse
import logging
import signal
import socket
import sys
import time
from collections.abc import Sequence
from typing import Any, Final

import attrs

from slipstream.client import Client, Image, SlipstreamError, Subscription
from slipstream.client.channel import parse_channel
from slipstream.client.counters import CountersFile
from slipstream.client.errors import ChannelError
from slipstream.client.layout import INT32_MAX, INT32_MIN
from slipstream.client.logview import (
    MAX_SPLIT_PIECES,
    ImageView,
    SessionEnds,
    snapshot,
    view_answer,
    view_args,
)
from slipstream.client.replay import ReplayServer

__all__ = ["DEFAULT_GROUP", "HOLDER_CONTROL_STREAM", "HOLDER_PORT", "MAX_ENDED_ASKED",
           "MAX_SPLIT_PIECES", "DetachedLogs", "StreamHolder", "driver_instance", "main"]

log = logging.getLogger("slipstream.client.holder")

#: The UDP port a standing holder listens on by default (the readers' ``replayPort``).
HOLDER_PORT: Final = 40190
#: The stream id of a standing holder's control stream: fixed, so that a query finds the
#: holder by address and port alone (a query's own holder draws one at random).
HOLDER_CONTROL_STREAM: Final = 0x51_1DE0
#: The group of a query that names none (``holderGroup``).
DEFAULT_GROUP: Final = "spark"


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


def _key(args: dict[str, Any]) -> tuple[str, int, str]:
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

    def get(self, path: str, join_position: int) -> Image | None:
        """The mapping of the log at ``path`` (made at ``join_position``, before which it
        holds nothing), or None when the file is gone."""
        image = self._images.get(path)
        if image is None:
            try:
                image = Image.detached(path, join_position)
            except OSError:
                return None
            self._images[path] = image
        return image

    def prune(self, live: set[str], in_use: set[str]) -> None:
        """Unmap the logs neither in ``live`` (still a subscription's) nor ``in_use``."""
        for gone in set(self._images) - live - in_use:
            self._images.pop(gone).close()

    def close(self) -> None:
        for image in self._images.values():
            image.close()
        self._images.clear()


class StreamHolder:
    """Holds streams in this host's driver (through ``client``) and answers their queries on
    the control stream :data:`HOLDER_CONTROL_STREAM` at ``endpoint=address:port``: calls
    (``state``, ``view``, ``release``) and replays.  :meth:`run` serves until stopped; use it
    from one thread, with a client used by no other."""

    def __init__(self, client: Client, address: str = "0.0.0.0", port: int = HOLDER_PORT, *,
                 control_stream_id: int = HOLDER_CONTROL_STREAM,
                 release_after_s: float | None = None) -> None:
        self.client = client
        self.release_after_s = release_after_s
        self.host = socket.gethostname()
        self.driver = driver_instance(client.counters)
        self._held: dict[tuple[str, int, str], _Held] = {}
        self._detached = DetachedLogs()
        self.server = ReplayServer(client, address, port, control_stream_id, self._lookup,
                                   calls=self._call, housekeeping=self._prune_detached)

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
        for image in held.subscription.images:
            if image.session_id == session_id:
                return image
        return None

    def _call(self, op: str, args: dict[str, Any]) -> Any:
        key = _key(args)
        if op == "release":
            held = self._held.pop(key, None)
            if held is not None:
                held.subscription.close()
                log.info("released stream %d on %s for group %r", key[1], key[0], key[2])
            return held is not None
        if op not in ("state", "view", "ended"):
            raise ValueError(f"op {op!r} is not one of state, view, ended, release")
        if key not in self._held and (op in ("view", "ended") or args.get("hold") is False):
            # Only a query's state call holds a stream: a question never makes a hold.
            held_here = ", ".join(f"{s} on {c} ({g})" for c, s, g in self._held)
            if len(held_here) > 1000:
                held_here = f"{len(self._held)} streams"
            raise ValueError(f"stream {key[1]} on {key[0]} is not held here for group "
                             f"{key[2]!r} (held: {held_here or 'none'})")
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
            raise ValueError(f"stream {held.stream_id} on {held.channel} has no session "
                             f"{session_id} here" + (f": {end.describe()}" if end is not None
                                                     else ""))
        if named != [*image.identity.framing]:
            raise ValueError(f"session {session_id}'s log here has "
                             f"{image.identity.describe()}, not {named!r}")
        method = str(args.get("method"))
        checked = view_args(method, args.get("args"), image.producer_position())
        return view_answer(ImageView(image), method, checked)

    def _lookup(self, stream_id: int, session_id: int) -> Image | None:
        """The log a replay reads: a mapping of its own (an image of a held subscription is
        unmapped when its session ends, under a replay that may still read it)."""
        paths = self._prune_detached()
        for path, image in paths.items():
            if image.stream_id == stream_id and image.session_id == session_id:
                return self._detached.get(path, image.join_position)
        return None

    def _prune_detached(self) -> dict[str, Image]:
        """Unmap the logs of sessions no held subscription has and no replay reads (their
        files are gone: the mapping is all that keeps their memory); returns the held images
        by log path."""
        paths = {image.log_path: image for held in self._held.values()
                 for image in held.subscription.images}
        self._detached.prune(set(paths), self.server.logs_in_use)
        return paths

    def do_work(self) -> int:
        """Serve what came; release groups idle longer than ``release_after_s``."""
        work = self.server.do_work()
        if self.release_after_s is not None:
            now = time.monotonic()
            for key, held in list(self._held.items()):
                if now - held.last_call > self.release_after_s:
                    self._call("release", {"channel": key[0], "stream_id": key[1],
                                           "group": key[2]})
        return work

    def run(self, stopping: Any) -> None:
        """Serve until ``stopping()`` is true (see :meth:`ReplayServer.run` for the waits)."""
        while not stopping():
            if self.do_work() == 0:
                self.server.wait_for_request(0.001, 0.1, spin_ns=None)

    def close(self) -> None:
        self.server.close()
        for held in self._held.values():
            held.subscription.close()
        self._held.clear()
        self._detached.close()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="slipstream-holder",
        description="Hold streams for Spark read queries on this (ingest) host and serve their "
                    "planning calls and replays (docs/SPARK.md, 'Cluster deploy mode').")
    parser.add_argument("--dir", help="the driver directory (default: $SLIPSTREAM_DIR, else "
                                      "/dev/shm/slipstream-<user>)")
    parser.add_argument("--address", default="0.0.0.0",
                        help="the address to listen on (default: every address)")
    parser.add_argument("--port", type=int, default=HOLDER_PORT,
                        help=f"the UDP port of the control stream (default {HOLDER_PORT})")
    parser.add_argument("--hold", nargs=2, action="append", default=[],
                        metavar=("CHANNEL", "STREAM_ID"),
                        help=f"hold this stream from the start, for group {DEFAULT_GROUP!r} "
                             f"(repeatable); others are held when a query first asks")
    parser.add_argument("--release-after", type=float, default=None, metavar="SECONDS",
                        help="release a group no query called for this long (default: never)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """``slipstream-holder``: serve until SIGTERM or SIGINT; 1 when the driver goes away."""
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if not 1 <= args.port <= 65535:
        _parser().error(f"--port {args.port} is not a UDP port (1..65535)")
    stopping = False

    def stop(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    client = Client.connect(args.dir)
    try:
        holder = StreamHolder(client, args.address, args.port,
                              release_after_s=args.release_after)
        try:
            for channel, stream in args.hold:
                holder.hold(channel, int(stream))
            log.info("serving at %s:%d, control stream %d", args.address, args.port,
                     HOLDER_CONTROL_STREAM)
            holder.run(lambda: stopping)
        finally:
            holder.close()
    except (SlipstreamError, ValueError) as e:
        print(f"slipstream-holder: {e}", file=sys.stderr)
        return 1
    finally:
        client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
