"""What the planning side decides: the query's hold on its stream and each batch's partitions.

The hold is either the query's own (:class:`_OwnHold`: a subscription through this host's
driver and a replay holder for read tasks on other hosts) or an ingest host's archive, which
holds the stream for the query's group (:class:`_StandingHold`).  From the logs it holds,
:func:`plan_partitions` cuts a batch's offsets into partitions
(:class:`~slipstream.spark_bridge.read_task.SlipstreamPartition`), and :func:`shares` splits
a per-trigger budget over sessions.  Offsets' entries are read with :func:`position_of` and
:func:`log_of`.  The whole read: :mod:`slipstream.spark_bridge.reader`.
"""

from __future__ import annotations

import ipaddress
import itertools
import logging
import os
import random
import socket
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Final

from slipstream.archive.catalog import Catalog
from slipstream.archive.control import REPLAY_WAIT_NS, ArchiveControl
from slipstream.archive.holding import MAX_ENDED_ASKED, NamedLogs, driver_instance
from slipstream.archive.recorder import Recording
from slipstream.archive.settings import DEFAULT_CONTROL_STREAM_ID
from slipstream.client import ChannelError, Client, SlipstreamError, Subscription
from slipstream.client.holding import HolderLink
from slipstream.client.layout import INT32_MAX
from slipstream.client.logview import (
    MAX_SPLIT_PIECES,
    ImageView,
    LogView,
    RemoteView,
    SessionEnd,
    SessionEnds,
)
from slipstream.spark_bridge.archived import ArchivedSource, Archives
from slipstream.spark_bridge.options import OptionError, SourceOptions
from slipstream.spark_bridge.read_task import (
    SlipstreamDataLossError,
    SlipstreamPartition,
    _record_skip,
    loss_message,
)

__all__ = ["archived_partitions", "holder_address", "log_of", "plan_partitions", "position_of",
           "shares"]

log = logging.getLogger("slipstream.spark_bridge")

_IMAGE_WAIT_S = 0.5  # how long a new subscription waits for its images to show up
#: The query's replay server waits for a request at most this long while no replay is in
#: progress (one wakes it at once), ns.
_CALL_WAIT_NS = 100_000_000


def holder_address(options: SourceOptions) -> str | None:
    """The address executors on other hosts reach this host at: ``holderAddress``, else
    ``SPARK_LOCAL_IP``, else what the host name resolves to; None when that is a loopback
    address (tasks on other hosts then fail, saying to set ``holderAddress``)."""
    candidates = [options.holder_address, os.environ.get("SPARK_LOCAL_IP")]
    try:
        candidates.append(socket.gethostbyname(socket.gethostname()))
    except OSError:
        pass
    for candidate in candidates:
        if not candidate:
            continue
        try:
            address = ipaddress.IPv4Address(candidate.strip())
        except ValueError:
            continue
        if not address.is_loopback and not address.is_unspecified:
            return str(address)
    return None


class _Holder:
    """The query's replay server: the archive's control stream
    (:class:`~slipstream.archive.control.ArchiveControl`) on a thread of the planning
    process, with a client of its own, serving replays of the logs the query's
    subscriptions hold (:class:`~slipstream.archive.holding.NamedLogs`) to read tasks on
    other hosts, as an ingest host's archive serves its held streams'.  The planning thread
    publishes the logs it holds (``holds.publish``: (stream id, session id) -> log path,
    join position, the stream's key) as images come and go; the holder's thread reads them.
    With ``key`` (the query's calls' key, a keyed stream's) its one control endpoint is of
    that key: only holders of it call, and its replays leave sealed under the key of the log
    they replay, whatever channel a call names the stream by (docs/ARCHIVE.md, "Protected
    calls")."""

    def __init__(self, directory: str | None, address: str, port: int,
                 key: str | None = None) -> None:
        # The ArchiveControl's host (its ControlHost), with no recordings.
        self.holds = NamedLogs()
        self.directory: Path | None = None
        self.catalog: Catalog | None = None
        self.recordings: dict[int, Recording] = {}
        self._stopping = False
        # Its thread alone replays and closes its replays' publications: their logs go as
        # a replay ends, for the driver to give their files to the next (log_reuse_bytes).
        self.client = Client.connect(directory, resource_linger_s=0)
        try:
            control_stream = random.randrange(1, INT32_MAX)
            self.control = ArchiveControl(self, address, 0 if key is not None else port,
                                          control_stream,
                                          keys={key: port} if key is not None else None)
        except ChannelError as e:
            self.client.close()
            if e.part != "key":
                raise
            # Another query's holder of this driver listens there under another key (or
            # none): an endpoint has one key.
            raise OptionError("replayPort", f"{port} is taken on this host by the holder of a "
                              f"query of another key (or of none): one UDP endpoint has one "
                              f"key, so a plain query and a keyed one (or two keys) on one "
                              f"host need replayPorts of their own: set another replayPort "
                              f"for this query ({e.problem})") from None
        except BaseException:
            self.client.close()
            raise
        self.address = (address, port, control_stream)
        self._thread = threading.Thread(target=self._run, name="slipstream-replay-holder",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stopping:
                work = self.control.do_work()
                self.holds.do_work(self.control.logs_in_use)
                if work:
                    continue
                if self.control.replays:
                    self.control.await_replay_credit(REPLAY_WAIT_NS)
                else:
                    self.control.wait_for_call(_CALL_WAIT_NS)
        except Exception:  # the tasks that need it fail naming it
            log.exception("slipstream: the replay holder stopped")
        finally:
            self.control.close()
            self.holds.close()

    def close(self) -> None:
        self._stopping = True
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self.client.close()


def shares(budget: int, backlogs: dict[str, int]) -> dict[str, int]:
    """Split a per-trigger ``budget`` (messages or bytes) over sessions in proportion to their
    ``backlogs`` (bytes of log not yet read), by largest remainders: the shares add up to at
    most ``budget``, a session with a backlog gets at least 1 while the budget lasts (largest
    backlog first), so no session starves behind the others."""
    total = sum(backlogs.values())
    if total <= 0:
        return {sid: 0 for sid in backlogs}
    exact = {sid: budget * size / total for sid, size in backlogs.items()}
    result = {sid: int(share) for sid, share in exact.items()}
    left = budget - sum(result.values())
    by_remainder = sorted(backlogs, key=lambda sid: (exact[sid] - result[sid], backlogs[sid]),
                          reverse=True)
    for sid in by_remainder:
        if left <= 0:
            break
        result[sid] += 1
        left -= 1
    for sid in sorted(backlogs, key=lambda sid: backlogs[sid], reverse=True):
        if result[sid] == 0 and backlogs[sid] > 0:  # at least one, taken from the largest
            donor = max(result, key=lambda other: result[other])
            if result[donor] <= 1:
                break
            result[donor] -= 1
            result[sid] = 1
    return result


def position_of(entry: object) -> int:
    """The position of an offset's entry: ``{"position": p, ...}``, or a bare position (the
    offsets of checkpoints written before entries named their log)."""
    if isinstance(entry, dict):
        return int(entry["position"])
    return int(entry)  # type: ignore[call-overload]


def log_of(entry: object) -> tuple[int, int] | None:
    """(initial term id, term length) of the log an offset's entry names, or None."""
    if isinstance(entry, dict) and isinstance(entry.get("log"), list) and len(entry["log"]) == 2:
        return int(entry["log"][0]), int(entry["log"][1])
    return None


def offset_key(options: SourceOptions, stream_id: int, session_id: int) -> str:
    """The key of a session in the offsets: its session id, or ``"<stream>:<session>"`` in
    a query of several streams (a session id names a publication of one stream only)."""
    if len(options.stream_ids) > 1:
        return f"{stream_id}:{session_id}"
    return str(session_id)


def key_parts(options: SourceOptions, key: str) -> tuple[int, int]:
    """(stream id, session id) of an offsets key (:func:`offset_key`)."""
    stream, _, session = key.rpartition(":")
    return (int(stream) if stream else options.stream_id), int(session)


class _OwnHold:
    """The query holds its streams itself: a subscription each through this host's driver,
    and a replay holder (:class:`_Holder`) on a thread for read tasks on other hosts."""

    def __init__(self, options: SourceOptions) -> None:
        self.options = options
        self.client = Client.connect(options.directory)
        self.holder: _Holder | None = None
        self.ends = {stream_id: SessionEnds() for stream_id in options.stream_ids}
        self.since = time.monotonic()
        self.subscriptions: dict[int, Subscription] = {}
        try:  # whatever fails, what was made so far goes (not at the driver's timeout)
            for stream_id in options.stream_ids:
                self.subscriptions[stream_id] = self.client.add_subscription(
                    options.channel, stream_id, on_unavailable_image=self.ends[stream_id].record)
            self.host = socket.gethostname()
            self.driver = driver_instance(self.client.counters)
            address = holder_address(options)
            if address is not None:
                try:
                    self.holder = _Holder(options.directory, address, options.replay_port,
                                          options.call_key)
                except SlipstreamError as e:  # tasks on other hosts fail, saying so
                    log.warning("slipstream: the query's replay holder cannot listen at "
                                "%s:%d (%s): read tasks on other hosts will fail; set "
                                "replayPort to a free UDP port, or holderAddress to this "
                                "host's address", address, options.replay_port, e)
            deadline = time.monotonic() + _IMAGE_WAIT_S
            while not all(sub.images for sub in self.subscriptions.values()) and \
                    time.monotonic() < deadline:
                time.sleep(0.01)
        except BaseException:
            self.close()
            raise

    @property
    def holder_address(self) -> tuple[str, int, int] | None:
        """Where tasks on other hosts ask for replays (address, port, control stream)."""
        return self.holder.address if self.holder is not None else None

    def held(self, stream_id: int) -> dict[str, object] | None:
        """The key a read task's replay names ``stream_id`` by at the query's replay server
        (its stream id; the channel and group are the query's)."""
        return {"channel": self.options.channel, "stream_id": stream_id, "group": "query"}

    def views(self) -> dict[str, LogView]:
        if self.client.is_closed:
            raise self.client.driver_lost_error()
        images = []
        for subscription in self.subscriptions.values():
            # The images of sessions that ended: this (planning) thread is the only one that
            # reads them, and it never polls.
            subscription.release_gone_images()
            images += subscription.images
        if self.holder is not None:
            self.holder.holds.publish({(image.stream_id, image.session_id):
                                       (image.log_path, image.join_position, image.channel_key)
                                       for image in images})
        return {offset_key(self.options, image.stream_id, image.session_id): ImageView(image)
                for image in images}

    def ended(self, keys: Iterable[str]) -> dict[str, SessionEnd]:
        """How those of the sessions ``keys`` (offsets keys) whose images left the
        subscriptions ended."""
        ends = {}
        for key in keys:
            stream_id, session_id = key_parts(self.options, key)
            end = self.ends[stream_id].get(session_id) if stream_id in self.ends else None
            if end is not None:
                ends[key] = end
        return ends

    def age_s(self) -> float:
        """How long the subscription has held the stream, seconds."""
        return time.monotonic() - self.since

    def made_anew(self, join_position: int) -> str:
        """Why this host's log of a session holds nothing before ``join_position``."""
        return (f"its image on {self.host} was made anew at position {join_position}: the "
                f"one that held the earlier positions went while nothing subscribed to it (the "
                f"query was down, and no other subscriber or standing holder kept it), and "
                f"what it held went with it")

    def no_record(self) -> str:
        """Why a session may be gone with no record of its end."""
        return (f"it went while the query was down and nothing held it (without a standing "
                f"holder, a query's subscription on {self.host} is what holds its streams)")

    def close(self) -> None:
        if self.holder is not None:
            self.holder.close()
        self.client.close()


class _StandingHold:
    """An ingest host's archive (the ``holder`` option: its control endpoint) holds the
    stream for the query's group (:mod:`slipstream.archive.holding`): the planner asks it,
    through this host's driver, what the logs hold and to move the position on commit
    (:class:`~slipstream.client.logview.RemoteView`); read tasks on other hosts get replays
    of the live log from it."""

    def __init__(self, options: SourceOptions, *, hold: bool = True) -> None:
        assert options.holder is not None
        name, port = options.holder
        try:
            address = socket.gethostbyname(name)
        except OSError as e:
            raise SlipstreamError(f"slipstream: the holder {name!r} (option holder) does not "
                                  f"resolve: {e}") from None
        self.client = Client.connect(options.directory)
        try:
            self.link = HolderLink(self.client, address, port, DEFAULT_CONTROL_STREAM_ID,
                                   timeout_s=options.replay_timeout_ms / 1000,
                                   key=options.call_key)
        except BaseException:
            self.client.close()
            raise
        self.options = options
        self.keys = {stream_id: {"channel": options.channel, "stream_id": stream_id,
                                 "group": options.holder_group, "hold": hold}
                     for stream_id in options.stream_ids}
        self.holder_address: tuple[str, int, int] | None = (address, port,
                                                              DEFAULT_CONTROL_STREAM_ID)
        self.host = name
        self.driver: str | None = None
        self._since = time.monotonic()

    def held(self, stream_id: int) -> dict[str, object] | None:
        """The key the archive holds ``stream_id`` by (channel, stream id, group): a read
        task's replay of the live log names it."""
        return {k: v for k, v in self.keys[stream_id].items() if k != "hold"}

    def views(self) -> dict[str, LogView]:
        if self.client.is_closed:
            raise self.client.driver_lost_error()
        views: dict[str, LogView] = {}
        held_for = float("inf")
        for stream_id, key in self.keys.items():
            state = self.link.call("state", **key)
            self.host, self.driver = str(state["host"]), str(state["driver"])
            # A holder of an earlier version says nothing: as if it had held it for ever.
            held_for = min(held_for, float(state.get("held_for", float("inf"))))
            asked = {k: v for k, v in key.items() if k != "hold"}
            views.update({offset_key(self.options, stream_id, int(sid)):
                          RemoteView(self.link, asked, int(sid), fields)
                          for sid, fields in state["sessions"].items()})
        self._since = time.monotonic() - held_for
        return views

    def ended(self, keys: Iterable[str]) -> dict[str, SessionEnd]:
        """How those of the sessions ``keys`` (offsets keys) whose images left the holder's
        subscriptions ended, as far as the holder remembers (asked :data:`MAX_ENDED_ASKED` at
        a time)."""
        by_stream: dict[int, list[int]] = {}
        for key in keys:
            stream_id, session_id = key_parts(self.options, key)
            by_stream.setdefault(stream_id, []).append(session_id)
        ends: dict[str, SessionEnd] = {}
        for stream_id, asked in by_stream.items():
            if stream_id not in self.keys:
                continue
            key = {k: v for k, v in self.keys[stream_id].items() if k != "hold"}
            asked.sort()
            for i in range(0, len(asked), MAX_ENDED_ASKED):
                answer = self.link.call("ended", **key, sessions=asked[i:i + MAX_ENDED_ASKED])
                ends.update({offset_key(self.options, stream_id, int(sid)):
                             SessionEnd.from_json(int(sid), fields)
                             for sid, fields in answer.items()})
        return ends

    def age_s(self) -> float:
        """How long the holder has held the stream for the group, seconds (as of the last
        :meth:`views`)."""
        return time.monotonic() - self._since

    def no_record(self) -> str:
        """Why a session may be gone with no record of its end."""
        return (f"the archive holding the stream on {self.host} has no record of how it "
                f"ended (the archive restarted, or released its group, since the query last "
                f"read it)")

    def made_anew(self, join_position: int) -> str:
        """Why the holder's log of a session holds nothing before ``join_position``."""
        return (f"the archive holding the stream on {self.host} holds it only from "
                f"position {join_position} on: its subscription joined there (the archive "
                f"or its host's driver restarted, or its group was released, after the "
                f"query's last commit), and nothing held the earlier positions meanwhile")

    def close(self) -> None:
        self.link.close()
        self.client.close()


class _ArchivesOnly:
    """No hold: a batch read with ``archive`` and no ``holder`` reads only what the archives
    hold, through this host's driver (``client``); it has no log of any session."""

    def __init__(self, options: SourceOptions) -> None:
        self.client = Client.connect(options.directory)
        self.host = socket.gethostname()
        self.driver: str | None = None
        self.holder_address: tuple[str, int, int] | None = None

    def views(self) -> dict[str, LogView]:
        return {}

    def ended(self, keys: Iterable[str]) -> dict[str, SessionEnd]:
        return {}

    def age_s(self) -> float:
        return float("inf")

    def no_record(self) -> str:
        return "the read names no holder, and no archive holds it"

    def made_anew(self, join_position: int) -> str:
        return self.no_record()

    def close(self) -> None:
        self.client.close()


#: What holds a read's logs: the query's own subscription, a standing holder, or (a batch
#: read with archives alone) nothing.
Hold = _OwnHold | _StandingHold | _ArchivesOnly


#: How long a hold may have existed before a session of the offsets that it has no image of,
#: and no record of how it ended, is reported gone: its image may still be on its way.
GONE_GRACE_S: Final = 5.0


class LossReports:
    """What a query will never read, reported by the planning side: ``failOnDataLoss=true``
    raises :class:`SlipstreamDataLossError`; ``false`` logs a warning and counts a skip in
    the driver's ``data loss skips`` counter, once per loss however many batches meet it."""

    def __init__(self, options: SourceOptions) -> None:
        self.options = options
        self._reported: set[tuple[object, ...]] = set()

    def report(self, key: tuple[object, ...], message: str, skip: str) -> None:
        """Report the loss ``key`` (what names it: a session and where it begins), whose text
        is ``message``; ``skip`` says what a query that goes on does instead."""
        if self.options.fail_on_data_loss:
            raise SlipstreamDataLossError(message)
        if key in self._reported:
            return
        self._reported.add(key)
        log.warning("%s %s (failOnDataLoss=false).", message, skip)
        _record_skip(self.options.directory)


def why_not_held(hold: Hold, view: LogView, begin: int,
                 end: SessionEnd | None) -> str | None:
    """Why ``view``'s log does not hold ``begin``: its previous image was left behind (``end``,
    how the session's last image ended), or the log was made anew after it; None when it was
    cleaned (:func:`loss_message`'s own words)."""
    if end is not None and end.framing == view.identity.framing and end.lost is not None \
            and begin < end.lost[1]:
        return (f"its image at {hold.host} went ({end.describe()}), and the next one began at "
                f"position {view.join_position}")
    if begin < view.join_position and view.earliest_position() >= view.join_position:
        return hold.made_anew(view.join_position)
    return None


def gone_message(options: SourceOptions, hold: Hold, sid: str,
                 entry: object, end: SessionEnd | None) -> str | None:
    """What a query loses of session ``sid``, at ``entry`` in its offsets, whose image the
    hold no longer has (``end``: how it ended, if the hold remembers); None when it was read
    to its end-of-stream mark (``end`` says so, or the entry recorded the mark)."""
    position = position_of(entry)
    named = log_of(entry)
    if end is not None and named is not None and named != end.framing:
        end = None  # the end of another log of this session id
    if end is not None and end.complete and position >= end.position:
        return None
    marked = entry.get("end") if isinstance(entry, dict) else None
    if end is None and isinstance(marked, int) and position >= marked:
        return None
    if end is None:
        why = (f"it has no log at {hold.host} any more: {hold.no_record()}; whatever it held "
               f"past {position} is gone, and how much that was is not known here")
        lost = f"from position {position} on"
    else:
        why = f"its log at {hold.host} went: {end.describe()}"
        unread = f"[{position}, {end.position})" if position < end.position else None
        if end.lost is not None:
            lost = f"[{max(position, end.lost[0])}, {end.lost[1]})"
        elif end.end_of_stream:
            lost = unread or f"from position {position} on"
        else:
            lost = (f"{unread} and " if unread else "") + \
                f"whatever its publisher accepted after position {end.position}"
    stream_id, session_id = key_parts(options, sid)
    return (f"slipstream stream {stream_id} session {session_id}: the offsets are at position "
            f"{position}, and the messages {lost} will never be read; {why}.  Set "
            f"failOnDataLoss=false to go on without them (counted in the driver's 'data loss "
            f"skips' counter).")


def time_of(options: SourceOptions, stream_id: int, session_id: int) -> int | None:
    """The time (ns since the epoch) a session starts at: its own
    (``startingOffsetsByTimestamp``), else ``startingTimestamp``'s, else None."""
    return options.starting_timestamps_ns.get((stream_id, session_id),
                                              options.starting_timestamp_ns)


def position_at_time(view: LogView | None, archives: Archives | None, stream_id: int,
                     session_id: int, framing: tuple[int, int], time_ns: int,
                     end: int | None = None) -> int | None:
    """Where the first message of a session stamped at or after ``time_ns`` (before ``end``,
    if given) begins, as far back as its log (``view``, or None when the hold has none) and
    the archives before it without a hole (``archives``) hold it; None when neither holds
    one.  The log is asked first: only when its oldest message is already at or after the
    time (or it holds none) are the archives searched, each by its time index
    (:meth:`Archives.position_at_time`)."""
    live: int | None = None
    archived_from: int | None = None
    archived_to = end
    if view is not None:
        earliest = view.earliest_position()
        stop = view.available_position() if end is None else min(end, view.available_position())
        found = view.position_at_time(earliest, stop, time_ns) if stop > earliest else stop
        live = found if found < stop else None
        if found > earliest or archives is None:
            return live
        archived_from = archives.earliest(stream_id, session_id, framing, earliest)
        archived_to = earliest if end is None else min(earliest, end)
    elif archives is not None:
        starts = [r.descriptor.start_position
                  for r in archives.recorded_sessions(stream_id).get(session_id, [])
                  if (r.descriptor.initial_term_id, r.descriptor.term_length) == framing]
        archived_from = min(starts, default=None)
    if archives is None or archived_from is None or \
            (archived_to is not None and archived_from >= archived_to):
        return live
    archived = archives.position_at_time(stream_id, session_id, framing, time_ns,
                                         archived_from, archived_to)
    return archived if archived is not None else live


def no_message_at_time(options: SourceOptions, stream_id: int, session_id: int,
                       time_ns: int, where: str) -> None:
    """A session a starting time names has no message stamped at or after it: with
    ``startingOffsetsByTimestampStrategy=error`` the read fails naming it (Kafka's default);
    with ``latest`` it starts at its last whole message (this returns)."""
    if options.timestamp_strategy == "error":
        option = "startingOffsetsByTimestamp" \
            if (stream_id, session_id) in options.starting_timestamps_ns else "startingTimestamp"
        raise SlipstreamError(
            f"slipstream stream {stream_id} session {session_id}: no message stamped at or "
            f"after {time_ns // 1_000_000} ms since the epoch ({option}) in {where}.  Set "
            f"startingOffsetsByTimestampStrategy=latest to start such a session at its "
            f"last message instead")


def archive_read_end(view: LogView, begin: int, stop: int) -> int:
    """Where a range ``[begin, stop)`` of ``view``'s session that begins before what the
    hold's position protects (its join position) or before what the log holds stops being
    read from the archives: the first message the log holds at or after the join position
    (which may fall between a message's fragments) and ``begin``, at most ``stop``."""
    return min(stop, view.first_retained(max(begin, view.join_position),
                                         max(stop, view.available_position())))


def archived_partitions(options: SourceOptions, archives: Archives, stream_id: int,
                        session_id: int, framing: tuple[int, int], begin: int, stop: int,
                        losses: LossReports, why: str,
                        live: Callable[[int, int], list[SlipstreamPartition]] | None = None,
                        split: int = 1) -> list[SlipstreamPartition]:
    """Partitions reading ``[begin, stop)`` of a session from the archives: per piece a
    recording holds (:meth:`Archives.pieces`), one, or with ``split`` > 1 (the pieces the
    whole range is to be cut into, ``minPartitions``' share of this session) that many in
    proportion to its length, cut at message boundaries by its recording
    (:meth:`Archives.split_points`), as a live range is.  What none holds is read from the
    live log where ``live`` (partitions of a range the log still holds, or None) has it, and
    is otherwise reported as loss (``losses``), saying ``why`` the live log lacks it."""
    pieces = archives.pieces(stream_id, session_id, framing, begin, stop)
    partitions = []
    position = begin
    for piece in [*pieces, None]:
        hole_end = stop if piece is None else piece.start
        from_log = live(position, hole_end) if live is not None and hole_end > position \
            else None
        if from_log is not None:
            partitions += from_log
        elif hole_end > position:
            silent = archives.silent(stream_id)
            if silent:  # not known to be lost: the archive that did not answer may hold it
                raise SlipstreamError(
                    f"slipstream stream {stream_id} session {session_id}: the messages at "
                    f"positions [{position}, {hole_end}) are not in the log ({why}), and the "
                    f"archive{'s' if len(silent) > 1 else ''} "
                    f"{', '.join(f'{a}:{p}' for a, p, _ in silent)} that may hold them did "
                    f"not answer within replayTimeoutMs: is it running, and its control "
                    f"port open?  The query can be restarted from its checkpoint once it "
                    f"answers")
            held = ", ".join(f"{a}:{p}" for a, p, _ in archives.endpoints)
            losses.report(("archived", stream_id, session_id, position),
                          loss_message(stream_id, session_id, position, hole_end, None, None,
                                       why=f"{why}; and the archives ({held}) hold none "
                                           f"of them"),
                          f"Skipping to {hole_end}")
        if piece is None:
            break
        bounds = [piece.start, piece.end]
        if split > 1 and stop > begin:
            count = min(MAX_SPLIT_PIECES,
                        max(1, round(split * (piece.end - piece.start) / (stop - begin))))
            if count > 1:
                bounds = [piece.start, *archives.split_points(stream_id, piece, count),
                          piece.end]
        for low, high in itertools.pairwise(bounds):
            partitions.append(SlipstreamPartition(
                session_id, stream_id, "", low, high, options.directory,
                options.fail_on_data_loss,
                f"the archive at {piece.archive[0]}:{piece.archive[1]}",
                log=None, driver=None, holder=None, replay_timeout_ms=options.replay_timeout_ms,
                archived=ArchivedSource(piece.archive, piece.recording_id, framing,
                                        archives.endpoints, options.archive_dir),
                call_key=options.call_key))
        position = piece.end
    return partitions


def plan_partitions(options: SourceOptions, hold: Hold,
                    images: dict[str, LogView], start: dict[str, object],
                    end: dict[str, object], losses: LossReports,
                    archives: Archives | None = None) -> list[SlipstreamPartition]:
    """The partitions of ``[start, end)`` (offsets: session id -> entry): one per session
    with something to read, or with ``minPartitions`` long ranges split at message
    boundaries so that there are about that many, each session's count in proportion to its
    share of the bytes (:meth:`LogView.split_points`).  A range of a log that is not the
    session's log now fails (or is skipped, ``failOnDataLoss=false``), naming both; so does
    a range the hold's log cannot have (its image went, or was made anew after the range's
    start: a batch planned before, which Spark runs again), naming why (``losses``), unless
    ``archives`` hold it: that part is read from them (:func:`archived_partitions`)."""
    ranges = {}
    for sid, entry in sorted(end.items()):
        stop = position_of(entry)
        begin = position_of(start.get(sid, entry))
        if stop > begin:
            ranges[sid] = (begin, stop)
    wanted = options.min_partitions
    total = sum(stop - begin for begin, stop in ranges.values())
    partitions = []
    for sid, (begin, stop) in ranges.items():
        split = 1  # the pieces minPartitions cuts this session's range into
        if wanted is not None and wanted > len(ranges):
            # At most what a standing holder splits a range into (and plenty for a session).
            split = min(MAX_SPLIT_PIECES, max(1, round(wanted * (stop - begin) / total)))
        image = images.get(sid)
        named = log_of(end[sid])
        if image is not None and named is not None and named != image.identity.framing:
            message = (f"slipstream stream {image.stream_id} session {image.session_id}: the "
                       f"batch's range [{begin}, {stop}) is of the log with initial term "
                       f"id {named[0]} and term length {named[1]}; this session's log now "
                       f"has {image.identity.describe()} (its publisher was added again, "
                       f"with session-id set?)")
            if options.fail_on_data_loss:
                raise SlipstreamDataLossError(message)
            log.warning("%s: skipping the range (failOnDataLoss=false)", message)
            _record_skip(options.directory)
            continue
        if image is None:
            # Its image went after the batch was planned: decided here, not in the tasks.
            entry = start.get(sid, end[sid])
            stream_id, session_id = key_parts(options, sid)
            if archives is not None and named is not None:
                partitions += archived_partitions(
                    options, archives, stream_id, session_id, named, begin, stop, losses,
                    f"its log at {hold.host} is gone", split=split)
                continue
            message = gone_message(options, hold, sid, entry,
                                   hold.ended([sid]).get(sid))
            if message is not None:
                losses.report(("gone", sid, log_of(entry)), message,
                              "The session leaves the offsets")
            continue
        if archives is not None and (begin < image.join_position or
                                     not image.is_retained(begin)):
            # Before the join position the log holds a range only while another subscriber
            # does (this hold's position does not): the archives are read up to there.
            live_from = archive_read_end(image, begin, stop)
            why = why_not_held(hold, image, begin, hold.ended([sid]).get(sid)) or \
                f"its log at {hold.host} holds it from position {live_from} on"

            def from_log(low: int, high: int, view: LogView = image
                         ) -> list[SlipstreamPartition] | None:
                if not view.is_retained(low):
                    return None
                return [SlipstreamPartition(
                    view.session_id, view.stream_id, view.log_path, low, high,
                    options.directory, options.fail_on_data_loss, hold.host,
                    log=view.identity, driver=hold.driver, holder=hold.holder_address,
                    replay_timeout_ms=options.replay_timeout_ms,
                    held=hold.held(view.stream_id), call_key=options.call_key)]

            partitions += archived_partitions(
                options, archives, image.stream_id, image.session_id, image.identity.framing,
                begin, live_from, losses, why, from_log,
                split=max(1, round(split * (live_from - begin) / (stop - begin))))
            if live_from >= stop:
                continue
            split = max(1, round(split * (stop - live_from) / (stop - begin)))
            begin = live_from
        elif begin < image.join_position and not image.is_retained(begin):
            # A batch planned before this log was made (a restart re-runs it): the tasks
            # would find the range's start missing, and could not tell why.  The whole
            # loss, which may reach past this batch, is named.
            held_from = image.first_retained(begin, max(stop, image.available_position()))
            why = why_not_held(hold, image, begin, hold.ended([sid]).get(sid))
            losses.report(("held", sid, held_from),
                          loss_message(image.stream_id, image.session_id, begin, held_from,
                                       None,
                                       image.identity.term_length, why=why),
                          f"Skipping to {held_from}")
            if held_from >= stop:
                continue
            begin = held_from
        identity = image.identity
        bounds = [begin, stop]
        if split > 1:
            bounds = [begin, *image.split_points(begin, stop, split), stop]
        for low, high in itertools.pairwise(bounds):
            partitions.append(SlipstreamPartition(
                image.session_id, image.stream_id, image.log_path, low, high,
                options.directory, options.fail_on_data_loss, hold.host,
                log=identity, driver=hold.driver, holder=hold.holder_address,
                replay_timeout_ms=options.replay_timeout_ms, held=hold.held(image.stream_id),
                call_key=options.call_key))
    return partitions
