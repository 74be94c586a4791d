"""Reading: a streaming reader whose offsets are stream positions, with credit held until commit.

Two sides, two kinds of process:

* The **planning side** (:class:`SlipstreamStreamReader` in Spark's streaming-source runner, a
  Python process beside the Spark driver) holds a client and a subscription.  Offsets are JSON
  maps ``{"<session_id>": {"position": p, "log": [...], "holder": "..."}}``, one entry per
  image (publication session).
  ``latestOffset`` looks at :meth:`Image.available_position` (the position after the last
  whole ready message) and never consumes past its ``start``.  Moving the subscriber position
  is what returns credit to the publishers: until a batch is done, its data stays in the log
  and the publishers are held back by flow control (after one window: the receiver window of
  a network stream, half a term of an IPC one) instead of overwriting what the query has not
  processed yet.  A batch is done when Spark asks ``latestOffset(start)`` for the next one:
  Spark plans batch N+1 only after batch N ran and went into the commit log, and ``start`` is
  N's end.  So the subscriber position moves to ``start`` there, and to ``end`` in
  ``commit(end)``.  ``commit`` alone is not enough: Spark commits batch N to its sources only
  once it has planned batch N+1, and plans one only when there is new data, which would wait
  on that very credit (a stream stalled after one window).
* The **executor side** (:meth:`SlipstreamStreamReader.read` in a Python worker) reads its
  range ``[start, end)``: on the host whose driver holds the log it maps the log with
  :meth:`Image.detached` and peeks the range (never moving the subscriber, so a failed task
  simply reads it again); on any other host it asks the planning process, which is also the
  query's **holder** (the archive's control stream on a thread of its own, or an ingest
  host's archive), to replay the range to it through its own host's driver.  Rows leave as
  Arrow record batches.  See docs/SPARK.md, "Reading on a cluster".

Offsets name what they point into: per session, the position, the log (initial term id and
term length) and the holder; a checkpoint whose log is not the session's log now is refused
(``failOnDataLoss=true``) or read anew from the oldest held message.

A restarted query (same checkpointLocation) gets its committed offsets back from Spark; its new
subscription joins at the current producer position, and the executors read the range between
the checkpoint and that position from the log as long as the log still holds it.  When it does
not, ``failOnDataLoss=true`` fails the query with :class:`SlipstreamDataLossError` naming the
positions; ``false`` skips to the oldest position still held, logs a warning and adds one to the
driver's ``data loss skips`` counter (``slipstream stat``).  A checkpoint whose offset is no
position of its session's log (a publication with ``session-id`` set, added again: a new log,
shorter or framed otherwise) is refused the same way (``true``), or that log is read from its
oldest held message with a warning (``false``).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import struct
import threading
import time
from collections.abc import Iterator
from typing import Final

from pyspark.sql.datasource import DataSourceReader, DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxBytes,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)

from slipstream.archive.catalog import EndReason
from slipstream.archive.client import ListedRecording
from slipstream.client import SlipstreamError
from slipstream.client.counters import Counter, CounterType, fit_label
from slipstream.client.logview import LogView
from slipstream.spark_bridge.archived import Archives, Endpoint
from slipstream.spark_bridge.options import EARLIEST, LATEST, SourceOptions, describe_stream_ids
from slipstream.spark_bridge.planning import (
    GONE_GRACE_S,
    LossReports,
    _ArchivesOnly,
    _OwnHold,
    _StandingHold,
    archive_read_end,
    gone_message,
    key_parts,
    log_of,
    no_message_at_time,
    offset_key,
    plan_partitions,
    position_at_time,
    position_of,
    shares,
    time_of,
    why_not_held,
)
from slipstream.spark_bridge.read_task import (
    SCHEMA,
    SlipstreamDataLossError,
    SlipstreamPartition,
    loss_message,
    read_range,
)

__all__ = ["LAG", "SCHEMA", "SlipstreamBatchReader", "SlipstreamDataLossError",
           "SlipstreamPartition", "SlipstreamStreamReader"]

log = logging.getLogger("slipstream.spark_bridge")

#: How long a session of the offsets is missing with no recorded end before it is called gone
#: (its end is recorded on the client's conductor thread just after the image leaves).
_NO_RECORD_S = 1.0


#: The offsets' key (not a session's) of when the query began, epoch ms, with archives: a
#: session the archives began recording after it is read from its first recorded message.
ARCHIVED_SINCE: Final = "@archived-since"
#: The key in :meth:`SlipstreamStreamReader.reportLatestOffset` (so in the query's progress,
#: its source's ``latestOffset``) of the lag behind what is available, as Kafka's source
#: reports it in its ``metrics``.
LAG: Final = "@lag"
#: At most this many messages a session are counted for the lag, per trigger (one pass over
#: them in the planner); past it the count is estimated.
_LAG_COUNTED: Final = 16_384
#: An offsets entry's flag: the session was read to its end (or its loss reported); the entry
#: stays while an archive holds a recording of it, so that the recording never brings it back.
_FINISHED: Final = "finished"


def _is_finished(entry: object) -> bool:
    return isinstance(entry, dict) and bool(entry.get(_FINISHED))


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


#: How a recording that ended without the stream's end-of-stream mark ended, in a loss report.
_ENDED: dict[EndReason, str] = {
    EndReason.ENDED_ABRUPTLY: "its image went without the stream's end-of-stream mark: the "
                              "publisher's driver or host stopped, or the network went down",
    EndReason.RECOVERED: "the archive died while recording it",
    EndReason.STOPPED: "the archive was stopped",
    EndReason.WRITE_FAILED: "a write failed at the archive (its disk full?)",
}


def _resolved(endpoint: Endpoint) -> Endpoint:
    """``endpoint`` with its host name resolved (the archive option may name hosts)."""
    host, port, stream = endpoint
    try:
        return socket.gethostbyname(host), port, stream
    except OSError as e:
        raise SlipstreamError(f"slipstream: the archive {host!r} (option archive) does not "
                              f"resolve: {e}") from None


def _leave_the_driver_on_sigterm(reader: SlipstreamStreamReader) -> None:
    """Close ``reader``'s clients when this process gets SIGTERM, then end as SIGTERM would.

    Spark stops a query's streaming-source process with SIGTERM, so the reader's ``stop()``
    never runs there: without this, the subscription would hold the publishers' credit until
    the driver's client liveness timeout (10 s by default) and be reclaimed with a warning.
    Installed only from the main thread, and only over the default action (an application's
    own handler is left alone).
    """
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return
    leaving = []

    def leave(signum: int, _frame: object) -> None:
        # Spark sends it twice in a row: a second one, even one that interrupts this handler,
        # must not end the process mid-close.
        signal.signal(signum, signal.SIG_IGN)
        if leaving:
            return
        leaving.append(signum)
        try:
            reader.stop()
        finally:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    signal.signal(signal.SIGTERM, leave)


class SlipstreamStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """``spark.readStream.format("slipstream")``: see the module documentation.

    Constructed in several Spark processes (planner, source runner); only the source runner's
    instance connects, lazily, on its first offset call.  Pickles without its client.
    """

    def __init__(self, options: SourceOptions) -> None:
        self.options = options
        self._hold: _OwnHold | _StandingHold | None = None
        self._target: dict[str, int] | None = None
        self._target_ms = 0  # when Trigger.AvailableNow took its snapshot (epoch ms)
        #: When the last micro-batch that read was planned (monotonic ns): minMessagesPerTrigger
        #: waits at most maxTriggerDelay from there.
        self._last_read_ns: int | None = None
        self._lag: Counter | None = None
        #: The end of the last batch :meth:`latestOffset` planned: the lag is counted from it.
        self._planned_end: dict[str, object] | None = None
        self._losses = LossReports(options)
        #: Sessions of the offsets with no image and no recorded end, since when (monotonic s).
        self._missing_since: dict[str, float] = {}
        #: The archives of the ``archive`` option (made with the hold), or None.
        self._archives: Archives | None = None

    def __getstate__(self) -> dict[str, object]:
        state = dict(self.__dict__)
        state["_hold"] = state["_lag"] = state["_archives"] = state["_planned_end"] = None
        return state

    def _rekeyed(self, offsets: dict[str, object]) -> dict[str, object]:
        """``offsets`` (a checkpoint's) keyed as this query keys them: a query whose
        ``streamId`` list grew from one stream or shrank to one reads its checkpoint's
        sessions under their keys now (a bare session id is of the first stream), and the
        entries of streams it no longer reads are left out."""
        rekeyed: dict[str, object] = {}
        for key, entry in offsets.items():
            if key.startswith("@"):  # not a session: ARCHIVED_SINCE
                continue
            stream_id, session_id = key_parts(self.options, key)
            if stream_id in self.options.stream_ids:
                rekeyed[offset_key(self.options, stream_id, session_id)] = entry
        return rekeyed

    def _report_lag(self, images: dict[str, LogView], start: dict[str, object]) -> None:
        """Set the query's lag counter (made on first use, in this host's driver's counters
        file: ``slipstream stat``, ``slipstream_spark_read_lag`` in the metrics): the bytes
        the sessions hold past the committed offsets."""
        assert self._hold is not None
        if self._lag is None:
            streams = describe_stream_ids(self.options.stream_ids)
            name = self.options.query_name or f"stream {streams}"
            label = (f"spark-read-lag: {name} {self.options.channel} "
                     f"group {self.options.holder_group}")
            try:
                self._lag = self._hold.client.add_counter(
                    CounterType.SPARK_READ_LAG, fit_label(label),
                    struct.pack(f"<{min(len(self.options.stream_ids), 28)}i",
                                *self.options.stream_ids[:28]))
            except SlipstreamError as e:  # the query goes on without its gauge
                log.warning("slipstream: no lag counter for the query (%s)", e)
                return
        self._lag.set(sum(max(0, view.available_position() - position_of(start[sid]))
                          for sid, view in images.items() if sid in start))

    # -- offsets -------------------------------------------------------------------------------
    def _entry(self, view: LogView, position: int) -> dict[str, object]:
        """An offset's entry for ``view``'s log: the position, and what it is a position of
        (the log: initial term id and term length; the holder: host and driver run)."""
        assert self._hold is not None
        entry: dict[str, object] = {"position": int(position), "log": [*view.identity.framing],
                                    "holder": f"{self._hold.host}/{self._hold.driver}"}
        eos = view.end_of_stream
        if eos is not None:  # a restarted query that finds the session gone reads it here
            entry["end"] = eos
        return entry

    # -- planning side -------------------------------------------------------------------------
    def _images(self) -> dict[str, LogView]:
        """The held logs by session id (the hold is made on first use: a subscription here,
        or the standing holder's).  Raises the client's DriverNotRunningError once this
        host's driver stopped or died: a query that went on would see no stream, silently,
        and never the driver's successor."""
        if self._hold is None:
            self._hold = (_StandingHold(self.options) if self.options.holder is not None
                          else _OwnHold(self.options))
            _leave_the_driver_on_sigterm(self)
            if self.options.archives:
                self._archives = Archives(self._hold.client,
                                          [_resolved(endpoint)
                                           for endpoint in self.options.archives],
                                          self.options.replay_timeout_ms / 1000,
                                          self.options.call_key)
        return self._hold.views()

    def _ask_archives_again(self) -> None:
        """The archives are asked again by the next question (once per planning call)."""
        if self._archives is not None:
            self._archives.refresh()

    def _default_start(self, view: LogView, *, at_start: bool = False) -> int:
        """Where ``view``'s session starts: at its starting time (its own, or
        ``startingTimestamp``'s: in the archives too, when its log's oldest message is
        already at or after it; a session with no message there starts at its last whole
        message, or, ``at_start`` of a query, as ``startingOffsetsByTimestampStrategy``
        says), else at ``startingOffsets``' position for it (a JSON object's), else at
        ``startingOffsets``' word."""
        time_ns = time_of(self.options, view.stream_id, view.session_id)
        if time_ns is not None:
            found = position_at_time(view, self._archives, view.stream_id, view.session_id,
                                     view.identity.framing, time_ns)
            if found is None:
                if at_start:
                    no_message_at_time(self.options, view.stream_id, view.session_id,
                                       time_ns, f"its log at {self._hold.host}"  # type: ignore[union-attr]
                                       + (" or the archives" if self._archives else ""))
                return view.available_position()
            return found
        starting = self.options.starting_position
        if isinstance(starting, dict):  # startingOffsets' object: a session it names
            named = starting.get(offset_key(self.options, view.stream_id, view.session_id))
            if named is not None and named >= 0:
                if at_start and named > view.available_position():
                    # A session of the query's start: a position past its log is a mistake.
                    # One that appears later starts at it once its publisher gets there.
                    raise SlipstreamError(
                        f"slipstream stream {view.stream_id} session {view.session_id}: "
                        f"{self.options.name_of('startingPosition')} {named} is past the "
                        f"last whole message its log holds ({view.available_position()})")
                return named
            starting = "earliest" if named == EARLIEST else "latest"
        if starting == "earliest":
            return self._earliest(view)
        return view.position

    def _earliest(self, view: LogView) -> int:
        """The oldest position of ``view``'s session that the log, or the archives before it
        without a hole, hold."""
        earliest = view.earliest_position()
        if self._archives is None:
            return earliest
        archived = self._archives.earliest(view.stream_id, view.session_id,
                                           view.identity.framing, earliest)
        return earliest if archived is None else min(archived, earliest)

    def _recordings_of(self, sid: str, entry: object) -> list[ListedRecording]:
        """The archives' recordings of session ``sid`` of the log ``entry`` names."""
        assert self._archives is not None
        framing = log_of(entry)
        stream_id, session_id = key_parts(self.options, sid)
        return [r for r in self._archives.recorded_sessions(stream_id).get(session_id, [])
                if (r.descriptor.initial_term_id, r.descriptor.term_length) == framing]

    def _entering_at(self, view: LogView, since: int | None) -> int:
        """Where a session that appears in the hold enters the offsets: its starting
        position; or, when the archives began recording it after ``since`` (epoch ms: when
        the query began, :data:`ARCHIVED_SINCE`), the first position they hold of it without
        a hole up to the hold's position: a session that began while the query was down is
        read from its first message."""
        default = self._default_start(view)
        starting = self.options.starting_position
        if self._archives is None or since is None or \
                time_of(self.options, view.stream_id, view.session_id) is not None or \
                (isinstance(starting, dict) and offset_key(
                    self.options, view.stream_id, view.session_id) in starting):
            return default
        sid = offset_key(self.options, view.stream_id, view.session_id)
        recordings = self._recordings_of(sid, {"position": 0, "log": [*view.identity.framing]})
        if not recordings or min(r.descriptor.start_time_ms for r in recordings) < since:
            return default
        earliest = self._archives.earliest(view.stream_id, view.session_id,
                                           view.identity.framing, view.position)
        return default if earliest is None else min(earliest, default)

    def _enter_recorded(self, images: dict[str, LogView], start: dict[str, object],
                        finished: dict[str, object], end: dict[str, object],
                        since: int) -> None:
        """Sessions that only the archives hold (they began and went while the query was
        down), recorded after ``since``: they enter ``end`` at their first recorded
        position, unread, and are read from the archives from the next batch on."""
        assert self._archives is not None and self._hold is not None
        for stream_id in self.options.stream_ids:
            for session_id, recordings in self._archives.recorded_sessions(stream_id).items():
                sid = offset_key(self.options, stream_id, session_id)
                if sid in start or sid in finished or sid in images:
                    continue
                newest = max(recordings, key=lambda r: r.descriptor.start_time_ms).descriptor
                framing = (newest.initial_term_id, newest.term_length)
                of_log = [r.descriptor for r in recordings
                          if (r.descriptor.initial_term_id, r.descriptor.term_length) == framing]
                began = min(d.start_time_ms for d in of_log)
                if began < since or (self._target is not None and began > self._target_ms):
                    continue  # read before, or after Trigger.AvailableNow's snapshot
                end[sid] = {"position": min(d.start_position for d in of_log),
                            "log": [*framing], "holder": f"{self._hold.host}/{self._hold.driver}"}

    def _archived_session(self, sid: str, entry: object) -> dict[str, object] | bool | None:
        """What becomes of session ``sid`` (at ``entry`` in the offsets) whose image is gone,
        by what the archives recorded of its log: an entry to read on to (what they hold past
        it, or the entry itself while they still record it); False when it leaves the
        offsets (read to the end of its recording: in silence after an end-of-stream mark,
        else reported as loss past what was recorded); None when no archive has a recording
        of it (:func:`gone_message` decides)."""
        assert self._archives is not None and self._hold is not None
        framing = log_of(entry)
        if framing is None:
            return None
        stream_id, session_id = key_parts(self.options, sid)
        position = position_of(entry)
        recordings = self._recordings_of(sid, entry)
        kept: dict[str, object] = dict(entry) if isinstance(entry, dict) else \
            {"position": position, "log": [*framing]}
        if not self._archives.answered(stream_id):
            return kept  # an archive that did not answer may hold it: asked again next time
        if not recordings:
            return None
        if any(r.is_active for r in recordings):
            # Still recorded (the image lives on where an archive records it): read once
            # the recording stops, to its stop (a live recorded position may fall between a
            # message's fragments; a stop is where the stream, or the recording, ended).
            return kept
        pieces = self._archives.pieces(stream_id, session_id, framing, position, None)
        if pieces:
            kept["position"] = pieces[-1].end
            return kept
        if any(r.descriptor.end_reason == EndReason.END_OF_STREAM and
               r.recorded_position <= position for r in recordings):
            return False  # read to the end of the stream
        last = max(recordings, key=lambda r: r.recorded_position)
        how = _ENDED.get(last.descriptor.end_reason, last.descriptor.end_reason.name.lower())
        recorded = last.recorded_position
        unread = f"[{position}, {recorded}) and " if recorded > position else ""
        self._losses.report(
            ("unrecorded", sid, tuple(framing)),
            f"slipstream stream {stream_id} session {session_id}: the offsets are at position "
            f"{position}, and the messages {unread}whatever its publisher accepted after "
            f"position {recorded} will never be read: its log at {self._hold.host} is gone, "
            f"and the archives recorded it up to {recorded}, where its recording ended ({how}). "
            f" Set failOnDataLoss=false to go on without them (counted in the driver's 'data "
            f"loss skips' counter).", "The session leaves the offsets")
        return False

    def initialOffset(self) -> dict[str, object]:
        """Where a new query starts.  ``latest``: no session yet; each enters the offset log
        in the first batch that sees it, at its subscriber position, unread
        (:meth:`latestOffset`), and is read from the next batch on, so every batch that reads
        has its start in the checkpoint.  Spark asks for the initial offset again when it
        plans batch 0 anew (a query stopped before that batch committed): a start taken
        from the live subscription then would be where a new subscription joins, past what
        batch 0 read (its rows were lost).  ``earliest``: per image, the oldest position its
        log holds, read at once (that range is not held by this subscription's credit, so
        waiting a batch could lose it; planned anew, it is the oldest held then)."""
        images = self._images()  # connect: the subscription's position holds the stream
        self._ask_archives_again()
        offsets: dict[str, object] = {}
        options = self.options
        timed = options.starting_timestamp_ns is not None
        starting = options.starting_position
        if starting == "earliest" or timed:
            offsets = {sid: self._entry(view, self._default_start(view, at_start=True))
                       for sid, view in images.items()}
        else:  # the sessions startingOffsets' object or a time of their own name
            offsets = {sid: self._entry(view, self._default_start(view, at_start=True))
                       for sid, view in images.items()
                       if (view.stream_id, view.session_id) in options.starting_timestamps_ns
                       or (isinstance(starting, dict) and starting.get(sid, LATEST) != LATEST)}
        self._start_recorded_at_time(images, offsets)
        self._start_recorded_at_positions(images, offsets)
        if self._archives is not None:
            # Sessions recorded from now on are read from their first message; with
            # earliest, every session the archives hold is.
            offsets[ARCHIVED_SINCE] = 0 if self.options.starting_position == "earliest" \
                and self.options.starting_timestamp_ns is None else _now_ms()
        return offsets

    def _start_recorded_at_time(self, images: dict[str, LogView],
                                offsets: dict[str, object]) -> None:
        """At a query's start, the sessions a starting time names that the hold has no log
        of (they ended; with ``startingTimestamp``, every session the archives recorded)
        enter ``offsets`` where the archives hold their first message stamped at or after
        it; one named with none there is handled as ``startingOffsetsByTimestampStrategy``
        says (one that ``startingTimestamp`` alone reaches is not read)."""
        options = self.options
        assert self._hold is not None
        named = {offset_key(options, stream_id, session_id): (stream_id, session_id)
                 for stream_id, session_id in options.starting_timestamps_ns}
        if options.starting_timestamp_ns is not None and self._archives is not None:
            for stream_id in options.stream_ids:
                for session_id in self._archives.recorded_sessions(stream_id):
                    named.setdefault(offset_key(options, stream_id, session_id),
                                     (stream_id, session_id))
        for sid, (stream_id, session_id) in sorted(named.items()):
            if sid in images or sid in offsets:
                continue
            time_ns = time_of(options, stream_id, session_id)
            assert time_ns is not None
            recordings = [] if self._archives is None else \
                self._archives.recorded_sessions(stream_id).get(session_id, [])
            found = None
            if recordings:
                newest = max(recordings, key=lambda r: r.descriptor.start_time_ms).descriptor
                framing = (newest.initial_term_id, newest.term_length)
                found = position_at_time(None, self._archives, stream_id, session_id,
                                         framing, time_ns)
            if found is not None:
                offsets[sid] = {"position": found, "log": [*framing],
                                "holder": f"{self._hold.host}/{self._hold.driver}"}
            elif (stream_id, session_id) in options.starting_timestamps_ns:
                no_message_at_time(options, stream_id, session_id, time_ns,
                                   f"the hold at {self._hold.host}, which has no log of it, "
                                   f"or the archives")

    def _start_recorded_at_positions(self, images: dict[str, LogView],
                                     offsets: dict[str, object]) -> None:
        """At a query's start, the sessions ``startingOffsets``' JSON object names (at a
        position, or ``-2``) that the hold has no log of: one the archives recorded enters
        ``offsets`` at that position (``-2``: the oldest they hold of it without a hole; its
        log's framing from its newest recording) and is read from them from the first batch
        on; one named past what they recorded of it, when it is recorded no more, is
        refused naming it.  One that no archive has (or none answered about) is waited for:
        it starts at the named position when it appears, and a warning names it."""
        options = self.options
        starting = options.starting_position
        if not isinstance(starting, dict):
            return
        assert self._hold is not None
        for sid, named in sorted(starting.items()):
            stream_id, session_id = key_parts(options, sid)
            if named == LATEST or sid in images or sid in offsets or \
                    (stream_id, session_id) in options.starting_timestamps_ns:
                continue
            where = (f"slipstream stream {stream_id} session {session_id}: "
                     f"{options.name_of('startingPosition')} {named}")
            recordings = [] if self._archives is None else \
                self._archives.recorded_sessions(stream_id).get(session_id, [])
            if not recordings:
                held = "its hold" if self._archives is None else "its hold or the archives"
                log.warning("%s: no session %d of stream %d at %s now: it starts there if it "
                            "appears", where, session_id, stream_id, held)
                continue
            assert self._archives is not None
            newest = max(recordings, key=lambda r: r.descriptor.start_time_ms).descriptor
            framing = (newest.initial_term_id, newest.term_length)
            of_log = [r for r in recordings
                      if (r.descriptor.initial_term_id, r.descriptor.term_length) == framing]
            recorded = max(r.recorded_position for r in of_log)
            if named == EARLIEST:
                earliest = self._archives.earliest(stream_id, session_id, framing, recorded)
                position = min(r.descriptor.start_position for r in of_log) \
                    if earliest is None else earliest
            else:
                position = named
                if position > recorded and not any(r.is_active for r in of_log):
                    raise SlipstreamError(f"{where} is past what the archives recorded of "
                                          f"it ({recorded}; it ended)")
            offsets[sid] = {"position": position, "log": [*framing],
                            "holder": f"{self._hold.host}/{self._hold.driver}"}

    def getDefaultReadLimit(self) -> ReadLimit:
        """maxMessagesPerTrigger (also applies maxBytesPerTrigger if set), else
        maxBytesPerTrigger, else everything available."""
        if self.options.max_messages_per_trigger is not None:
            return ReadMaxRows(self.options.max_messages_per_trigger)
        if self.options.max_bytes_per_trigger is not None:
            return ReadMaxBytes(self.options.max_bytes_per_trigger)
        return ReadAllAvailable()

    def prepareForTriggerAvailableNow(self) -> None:
        """Trigger.AvailableNow: read up to what is available now, nothing later: neither the
        messages published after this call nor the sessions that appear after it."""
        self._target = {sid: image.available_position() for sid, image in self._images().items()}
        self._target_ms = _now_ms()

    def latestOffset(self, start: dict[str, object], limit: ReadLimit) -> dict[str, object]:
        """The end of the next micro-batch (:meth:`_next_end`), kept for the lag that
        :meth:`reportLatestOffset` reports after it."""
        end = self._next_end(start, limit)
        self._planned_end = end
        return end

    def _next_end(self, start: dict[str, object], limit: ReadLimit) -> dict[str, object]:
        """The end of the next micro-batch: per image, the last whole ready message, capped by
        the read limit (message and byte budgets are shared by the images in proportion to
        their backlogs: :func:`shares`).

        A session not in ``start`` enters at its starting position without being read in
        this batch, so that its start is recorded in the offset log and replays read the same
        range.  A session whose image is gone leaves the offsets: in silence when it was read
        to its end-of-stream mark, else as data loss naming how it ended (:meth:`_gone`).
        """
        since = start.get(ARCHIVED_SINCE)
        start = self._rekeyed(start)
        finished = {sid: entry for sid, entry in start.items() if _is_finished(entry)}
        start = {sid: entry for sid, entry in start.items() if sid not in finished}
        images = self._images()
        self._ask_archives_again()
        hold = self._hold
        assert hold is not None
        self._report_lag(images, start)
        end: dict[str, object] = {}
        if self._archives is not None:
            # A checkpoint of the query before it named archives: sessions from now on.
            since = int(since) if isinstance(since, int) else _now_ms()  # type: ignore[arg-type]
            end[ARCHIVED_SINCE] = since
            self._enter_recorded(images, start, finished, end, since)
            for sid, entry in finished.items():
                # Remembered while an archive holds it (or may: one did not answer), or its
                # image lingers: what is read is never read again.
                image = images.get(sid)
                if (image is not None and [*image.identity.framing] == entry["log"]) or \
                        self._recordings_of(sid, entry) or \
                        not self._archives.answered(key_parts(self.options, sid)[0]):
                    end[sid] = entry
        else:
            since = None
        # Sessions gone from the hold that the archives hold on: read from them, cut by the
        # budgets as the others are.
        gone: dict[str, tuple[int, int]] = {}
        missing = sorted(set(start) - set(images))
        ended = hold.ended(missing) if missing else {}
        now = time.monotonic()
        for sid in list(self._missing_since):
            if sid not in missing:
                del self._missing_since[sid]
        for sid in missing:
            missing_since = self._missing_since.setdefault(sid, now)
            if sid not in ended and (hold.age_s() < GONE_GRACE_S or
                                     now - missing_since < _NO_RECORD_S):
                # Its image may be on its way to a hold just made, or its end about to be
                # recorded (the subscription drops an image before its handler runs).
                end[sid] = start[sid]
                continue
            if self._archives is not None:
                archived = self._archived_session(sid, start[sid])
                if archived is not None:
                    # Read on; or finished, and remembered so that the archives' recordings
                    # of it never bring it back.
                    end[sid] = archived or {**dict(start[sid]),  # type: ignore[call-overload]
                                            _FINISHED: True}
                    if archived and position_of(archived) > position_of(start[sid]):
                        gone[sid] = (position_of(start[sid]), position_of(archived))
                    continue
            message = gone_message(self.options, hold, sid, start[sid], ended.get(sid))
            if message is not None:
                self._losses.report(("gone", sid, log_of(start[sid])), message,
                                    "The session leaves the offsets")
        # Batches before start ran and are in the commit log.
        foreign = self._consumed(images, start, self._named_starts())
        for sid, reason in foreign.items():
            image = images[sid]
            message = (f"the checkpoint's offset {position_of(start[sid])} for session {sid} "
                       f"of stream {image.stream_id} is not a position of that session's log "
                       f"({reason}): the offsets were taken from another log with this session "
                       f"id (its publisher was added again, with session-id set?)")
            if self.options.fail_on_data_loss:
                raise SlipstreamDataLossError(
                    f"{message}; start the query with a new checkpointLocation, or set "
                    f"failOnDataLoss=false to read this log from its oldest held message")
            log.warning("%s; reading this log from its oldest held message", message)
        if isinstance(limit, ReadAllAvailable):
            max_rows = max_bytes = None
        else:
            max_rows = self.options.max_messages_per_trigger
            max_bytes = self.options.max_bytes_per_trigger
            if isinstance(limit, ReadMaxRows):
                max_rows = limit.max_rows
            elif isinstance(limit, ReadMaxBytes):
                max_bytes = limit.max_bytes
        ranges: dict[str, tuple[int, int]] = {}  # sessions with something to read
        # Sessions whose range begins before what their log holds, read from the archives up
        # to where it does (the ranges above then begin there).
        archived: dict[str, int] = {}
        for sid, image in sorted(images.items()):
            if self._target is not None and sid not in self._target and sid in start and \
                    hold.age_s() < GONE_GRACE_S:
                # A checkpoint's session whose image came after AvailableNow's snapshot, at a
                # hold just made: what it had then is part of what the run reads.
                self._target[sid] = image.available_position()
            if self._target is not None and sid not in self._target:
                # Trigger.AvailableNow: a session that appeared after it started is not read
                # (one already in the offsets stays where it is).
                if sid in start:
                    end[sid] = start[sid]
                continue
            if sid in finished and end.get(sid) is finished[sid]:
                continue  # read to its end; its image lingers
            if sid not in start:
                end[sid] = self._entry(image, self._entering_at(image, since))
                continue
            if sid in foreign:  # enters afresh, read from the next batch on
                end[sid] = self._entry(image, image.earliest_position())
                continue
            begin = position_of(start[sid])
            available = image.available_position()
            if self._target is not None:
                available = min(available, self._target[sid])
            if available <= begin:
                end[sid] = self._entry(image, begin)
                continue
            if self._archives is not None and (begin < image.join_position or
                                               not image.is_retained(begin)):
                # plan_partitions reads it from the archives, reporting what none holds
                archived[sid] = begin
                ranges[sid] = (archive_read_end(image, begin, available), available)
                end[sid] = self._entry(image, available)
                continue
            if not image.is_retained(begin):
                held_from = image.first_retained(begin, available)
                if self.options.fail_on_data_loss:
                    raise SlipstreamDataLossError(loss_message(
                        image.stream_id, image.session_id, begin, held_from, None,
                        image.identity.term_length,
                        why=why_not_held(hold, image, begin, hold.ended([sid]).get(sid))))
                begin = held_from  # the executor or plan_partitions counts the skip
            ranges[sid] = (begin, available)
            end[sid] = self._entry(image, available)
        if ranges and not archived and self._too_few(images, ranges):
            for sid in ranges:  # the batch waits: nothing read, the offsets unchanged
                end[sid] = start[sid]
            return end
        if ranges or archived:
            self._last_read_ns = time.monotonic_ns()
        if max_rows is None and max_bytes is None:
            return end
        backlog = {sid: stop - archived.get(sid, begin) for sid, (begin, stop) in ranges.items()}
        backlog.update({sid: stop - begin for sid, (begin, stop) in gone.items()})
        row_shares = shares(max_rows, backlog) if max_rows is not None else {}
        byte_shares = shares(max_bytes, backlog) if max_bytes is not None else {}
        for sid, (begin, stop) in gone.items():
            assert self._archives is not None
            stream_id, session_id = key_parts(self.options, sid)
            reached, _, _ = self._archives.scan(
                stream_id, session_id, log_of(start[sid]), begin, stop,  # type: ignore[arg-type]
                row_shares.get(sid), byte_shares.get(sid))
            end[sid] = {**end[sid], "position": reached}  # type: ignore[dict-item]
        for sid, (begin, available) in ranges.items():
            if sid in archived:
                # What the archives hold comes first, cut as the log is; the log after it
                # with what is left of the budgets.
                assert self._archives is not None
                image = images[sid]
                rows, size = row_shares.get(sid), byte_shares.get(sid)
                reached, rows_left, bytes_left = self._archives.scan(
                    image.stream_id, image.session_id, image.identity.framing, archived[sid],
                    begin, rows, size)
                if reached >= begin and (rows is None or (rows_left or 0) > 0) and \
                        (size is None or (bytes_left or 0) > 0):
                    reached = image.scan(begin, available, rows_left, bytes_left)
                end[sid] = self._entry(image, reached)
                continue
            reached = images[sid].scan(begin, available, row_shares.get(sid),
                                       byte_shares.get(sid))
            end[sid] = self._entry(images[sid], reached)
        return end

    def _too_few(self, images: dict[str, LogView], ranges: dict[str, tuple[int, int]]) -> bool:
        """Whether the batch should wait for minMessagesPerTrigger: fewer messages than that
        in ``ranges``, and maxTriggerDelay not yet passed since the last batch that read (or
        since the first look).  Never under Trigger.AvailableNow, which would wait for good."""
        wanted = self.options.min_messages_per_trigger
        if wanted is None or self._target is not None:
            return False
        now = time.monotonic_ns()
        if self._last_read_ns is None:  # the first trigger (of a run) reads at once, as Kafka's
            return False
        if now - self._last_read_ns >= self.options.max_trigger_delay_ns:
            return False
        found = 0
        for sid, (begin, stop) in ranges.items():
            found += images[sid].count_messages(begin, stop, wanted - found)
            if found >= wanted:
                return False
        return True

    def reportLatestOffset(self) -> dict[str, object] | None:
        """What is available now, per session, and how far the last planned batch's end is
        behind it (:data:`LAG`): the query's progress shows it as its source's
        ``latestOffset`` (Spark's Python sources have no ``metrics`` of their own)."""
        if self._hold is None:
            return None
        images = self._images()
        latest: dict[str, object] = {sid: view.available_position()
                                     for sid, view in images.items()}
        archived = self._archived_latest(images, self._planned_end)
        latest.update({sid: reach for sid, reach in archived.items()})
        if latest and self._planned_end is not None:
            latest[LAG] = self._lag_behind(images, self._planned_end, archived)
        return latest

    def _archived_latest(self, images: dict[str, LogView], end: dict[str, object] | None
                         ) -> dict[str, int]:
        """The sessions of ``end`` read from the archives alone (their image is gone), and
        how far the archives hold each without a hole from its offset."""
        if self._archives is None or end is None:
            return {}
        found: dict[str, int] = {}
        for sid, entry in end.items():
            framing = None if sid == ARCHIVED_SINCE or sid in images or \
                _is_finished(entry) else log_of(entry)
            if framing is None:
                continue
            stream_id, session_id = key_parts(self.options, sid)
            pieces = self._archives.pieces(stream_id, session_id, framing,
                                           position_of(entry), None)
            if pieces:
                found[sid] = max(pieces[-1].end, position_of(entry))
        return found

    def _counted_archived(self, sid: str, framing: tuple[int, int], begin: int, end: int,
                          limit: int) -> tuple[int, int]:
        """:meth:`Archives.count_messages` of session ``sid`` (none without archives)."""
        if self._archives is None or end <= begin:
            return 0, begin
        stream_id, session_id = key_parts(self.options, sid)
        return self._archives.count_messages(stream_id, session_id, framing, begin, end, limit)

    def _lag_behind(self, images: dict[str, LogView], end: dict[str, object],
                    archived: dict[str, int] | None = None) -> dict[str, object]:
        """Per session, and over them all as Kafka's source reports its lag (min / max /
        avg offsets behind latest), what is available past ``end``: whole messages and
        stream bytes (frames with their headers).  A session with an image counts what its
        log holds and, before that, what the archives hold; one whose image is gone counts
        what the archives hold of it (``archived``: how far, per session).  Counting costs
        one pass over at most :data:`_LAG_COUNTED` messages a session; a session further
        behind, or behind what its log and the archives hold, has its count estimated from
        the messages' mean length, and ``estimated`` says so."""
        sessions: dict[str, dict[str, int]] = {}
        estimated = False
        for sid, view in sorted(images.items()):
            entry = end.get(sid)
            if entry is None or _is_finished(entry):
                continue
            position = position_of(entry)
            available = view.available_position()
            behind = max(0, available - position)
            messages = 0
            if behind:
                held = position if view.is_retained(position) else \
                    view.first_retained(position, available)
                # Before the log: what the archives hold, counted first.
                counted, reached = self._counted_archived(sid, view.identity.framing,
                                                          position, held, _LAG_COUNTED)
                spanned = reached - position
                if counted < _LAG_COUNTED:  # then what the log holds
                    live = view.count_messages(held, available, _LAG_COUNTED - counted)
                    counted += live
                    spanned += (available if counted < _LAG_COUNTED else
                                view.scan(held, available, live, None)) - held
                messages = counted
                if not counted:  # lapped meanwhile, or held by none
                    estimated = True
                elif spanned < behind:
                    messages = round(counted * behind / spanned)
                    estimated = True
            sessions[sid] = {"messages": messages, "bytes": behind}
        for sid, reach in sorted((archived or {}).items()):
            position = position_of(end[sid])
            behind = reach - position
            counted, reached = self._counted_archived(sid, log_of(end[sid]),  # type: ignore[arg-type]
                                                      position, reach, _LAG_COUNTED)
            messages = counted
            if reached < reach:
                estimated = True
                messages = round(counted * behind / (reached - position)) \
                    if reached > position else 0
            sessions[sid] = {"messages": messages, "bytes": behind}
        messages = [lag["messages"] for lag in sessions.values()] or [0]
        sizes = [lag["bytes"] for lag in sessions.values()] or [0]
        return {"minOffsetsBehindLatest": min(messages),
                "maxOffsetsBehindLatest": max(messages),
                "avgOffsetsBehindLatest": sum(messages) / len(messages),
                "offsetsBehindLatest": sum(messages),
                "minBytesBehindLatest": min(sizes), "maxBytesBehindLatest": max(sizes),
                "avgBytesBehindLatest": sum(sizes) / len(sizes),
                "bytesBehindLatest": sum(sizes),
                "estimated": estimated, "sessions": sessions}

    def partitions(self, start: dict[str, object], end: dict[str, object]
                   ) -> list[SlipstreamPartition]:
        """One partition per image with something in ``[start, end)``; with ``minPartitions``,
        long ranges are split at message boundaries so that there are about that many, each
        session's count in proportion to its share of the bytes
        (:meth:`LogView.split_points`)."""
        start, end = self._rekeyed(start), self._rekeyed(end)
        images = self._images()
        self._ask_archives_again()
        hold = self._hold
        assert hold is not None
        # A range whose session has no image yet, at a hold just made: its image may be on
        # its way (a restarted query plans its last batch again at once).
        while hold.age_s() < GONE_GRACE_S and any(
                sid not in images and position_of(end[sid]) >
                position_of(start.get(sid, end[sid])) for sid in end):
            time.sleep(0.05)
            images = self._images()
        return plan_partitions(self.options, hold, images, start, end, self._losses,
                               self._archives)

    def commit(self, end: dict[str, object]) -> None:
        """Spark processed everything before ``end``: return its credit (see the module
        documentation for why ``latestOffset`` does so too)."""
        for sid, reason in self._consumed(self._images(), self._rekeyed(end),
                                          self._named_starts()).items():
            # latestOffset(start=end) says what to do about it, in the next batch.
            log.warning("commit: the offset %s of session %s is not a position of its log "
                        "(%s): the subscriber position stays where it is", end[sid], sid, reason)

    def _named_starts(self) -> dict[str, int]:
        """The positions ``startingOffsets``' JSON object names, per session (none: {})."""
        starting = self.options.starting_position
        return {} if not isinstance(starting, dict) else \
            {sid: named for sid, named in starting.items() if named >= 0}

    @staticmethod
    def _consumed(images: dict[str, LogView], offsets: dict[str, object],
                  named_starts: dict[str, int] | None = None) -> dict[str, str]:
        """The query is done with everything before ``offsets``: move each image's subscriber
        position there (never backwards), returning the credit to the publishers.  A
        session's offset at the start ``named_starts`` names for it, past what its log holds yet,
        moves it only to what the log holds (the query waits there for its publisher).

        Returns, per session whose offset is no position of its image's log (the offset
        names another log, lies beyond what the log holds, or where no message begins), why;
        those images are left where they are.
        """
        foreign: dict[str, str] = {}
        for sid, entry in offsets.items():
            image = images.get(sid)
            if image is None:
                continue
            named = log_of(entry)
            if named is not None and named != image.identity.framing:
                foreign[sid] = (f"the offset is of the log with initial term id {named[0]} and "
                                f"term length {named[1]}; this session's log has "
                                f"{image.identity.describe()}")
                continue
            position = position_of(entry)
            if named_starts and named_starts.get(sid) == position:
                position = min(position, image.available_position())
            why = image.advance_to(position)
            if why is not None:
                foreign[sid] = why
        return foreign

    def stop(self) -> None:
        """The query ended: leave the driver (the subscription stops holding publishers, the
        holder stops replaying)."""
        hold, self._hold = self._hold, None
        lag, self._lag = self._lag, None
        archives, self._archives = self._archives, None
        if archives is not None:
            archives.close()
        if lag is not None and not lag.is_closed:
            lag.close()
        if hold is not None:
            hold.close()

    # -- executor side -------------------------------------------------------------------------
    def read(self, partition: InputPartition) -> Iterator[object]:  # type: ignore[override]
        """The partition's messages as Arrow record batches (see :func:`read_range`)."""
        assert isinstance(partition, SlipstreamPartition)
        partition.include_headers = self.options.include_headers
        return read_range(partition)


class SlipstreamBatchReader(DataSourceReader):
    """``spark.read.format("slipstream")``: per session of the stream, the messages from
    ``startingPosition`` / ``startingTimestamp`` / ``startingOffsetsByTimestamp`` (default
    ``earliest``) to ``endingPosition`` / ``endingTimestamp`` (default ``latest``) that the
    standing holder named by ``holder`` holds for ``holderGroup``, and the archives named by
    ``archive`` hold.

    With ``archive``, ``earliest`` and a starting time reach back as far as the archives hold
    each session without a hole, what the log no longer holds is read from them, and the
    sessions only they hold (ended ones) are read too; with ``archive`` and no ``holder``,
    only what the archives hold is read.

    A batch read moves no position: it reads what the holder's log holds, and the stream's
    query (if any) commits as before.  Its planner (a Python worker that ends before the tasks
    run) asks the holder and the archives once; the tasks read as a stream's do
    (:func:`read_range`).
    """

    def __init__(self, options: SourceOptions) -> None:
        self.options = options

    def _bounds(self, sid: str, view: LogView | None, archives: Archives | None,
                stream_id: int, session_id: int, framing: tuple[int, int], earliest: int,
                available: int) -> tuple[int, int]:
        """``[begin, stop)`` of one session whose log (``view``, None when only the archives
        hold it) or archives hold ``[earliest, available)``.  A session only the archives
        hold with no message at or after ``startingTimestamp`` (it ended before) is empty;
        one a starting time names, or the hold has a log of, with none there is handled as
        ``startingOffsetsByTimestampStrategy`` says."""
        options = self.options
        starting = options.starting_position if "startingPosition" in options.given \
            else "earliest"
        ending = options.ending_position
        stop = ending[sid] if isinstance(ending, dict) and \
            ending.get(sid, LATEST) != LATEST else available
        if stop > available:
            raise SlipstreamError(
                f"slipstream stream {stream_id} session {session_id}: "
                f"{options.name_of('endingPosition')} {stop} is past the last whole message "
                f"held ({available})")
        if options.ending_timestamp_ns is not None:
            found = position_at_time(view, archives, stream_id, session_id, framing,
                                     options.ending_timestamp_ns, stop)
            stop = stop if found is None else found
        time_ns = time_of(options, stream_id, session_id)
        if time_ns is not None:
            found = position_at_time(view, archives, stream_id, session_id, framing, time_ns,
                                     stop)
            if found is None and (view is not None or
                                  (stream_id, session_id) in options.starting_timestamps_ns):
                no_message_at_time(options, stream_id, session_id, time_ns,
                                   f"[{earliest}, {stop})")
            # One only the archives hold, reached by startingTimestamp alone, ended before
            # the time: left out (an empty range), as a stream started then leaves it out.
            begin = stop if found is None else found
        elif starting == "latest" or (isinstance(starting, dict) and
                                      starting.get(sid) == LATEST):
            begin = stop
        elif isinstance(starting, dict) and starting.get(sid, EARLIEST) != EARLIEST:
            begin = starting[sid]
        else:
            begin = earliest
        if begin > stop:
            raise SlipstreamError(
                f"slipstream stream {stream_id} session {session_id}: "
                f"{options.name_of('startingPosition')} {begin} is after "
                f"{options.name_of('endingPosition')} {stop}")
        return begin, stop

    def _ranges(self, hold: _StandingHold | _ArchivesOnly, views: dict[str, LogView],
                losses: LossReports, archives: Archives | None = None
                ) -> tuple[dict[str, object], dict[str, object]]:
        options = self.options
        recorded = {} if archives is None else {
            offset_key(options, stream_id, session_id): (stream_id, session_id, recordings)
            for stream_id in options.stream_ids
            for session_id, recordings in archives.recorded_sessions(stream_id).items()}
        named = {sid for positions in (options.starting_position, options.ending_position)
                 if isinstance(positions, dict) for sid in positions}
        named |= {offset_key(options, stream_id, session_id)
                  for stream_id, session_id in options.starting_timestamps_ns}
        absent = ", ".join(sorted(named - set(views) - set(recorded)))
        if absent:
            where = f"the holder {options.holder}" if options.holder is not None else \
                "the archives"
            held = sorted({*views, *recorded})
            raise SlipstreamError(
                f"slipstream stream {describe_stream_ids(options.stream_ids)} on "
                f"{options.channel}: no session {absent} at {where} (sessions there: "
                f"{', '.join(held) or 'none'})")
        start: dict[str, object] = {}
        end: dict[str, object] = {}
        for sid, view in sorted(views.items()):
            earliest = view.earliest_position()
            archived = None if archives is None else archives.earliest(
                view.stream_id, view.session_id, view.identity.framing, earliest)
            begin, stop = self._bounds(
                sid, view, archives, view.stream_id, view.session_id, view.identity.framing,
                earliest if archived is None else min(earliest, archived),
                view.available_position())
            if begin < stop and not view.is_retained(begin) and archives is None:
                held_from = view.first_retained(begin, stop)
                losses.report(("held", sid, held_from), loss_message(
                    view.stream_id, view.session_id, begin, held_from, None,
                    view.identity.term_length, why=why_not_held(hold, view, begin, None)),
                    f"Skipping to {held_from}")
                begin = held_from
            identity = [*view.identity.framing]
            start[sid] = {"position": begin, "log": identity}
            end[sid] = {"position": stop, "log": identity}
        for sid, (stream_id, session_id, recordings) in sorted(recorded.items()):
            if sid in views:
                continue
            assert archives is not None
            newest = max(recordings, key=lambda r: r.descriptor.start_time_ms).descriptor
            framing = (newest.initial_term_id, newest.term_length)
            of_log = [r for r in recordings
                      if (r.descriptor.initial_term_id, r.descriptor.term_length) == framing]
            last = max(of_log, key=lambda r: r.recorded_position)
            available = self._last_whole(archives, stream_id, last)
            earliest = archives.earliest(stream_id, session_id, framing, available)
            if earliest is None:
                earliest = min(r.descriptor.start_position for r in of_log)
            begin, stop = self._bounds(sid, None, archives, stream_id, session_id, framing,
                                       earliest, available)
            start[sid] = {"position": begin, "log": [*framing]}
            end[sid] = {"position": stop, "log": [*framing]}
        return start, end

    @staticmethod
    def _last_whole(archives: Archives, stream_id: int, recording: ListedRecording) -> int:
        """The end of the last whole message of ``recording``: its stop, or a live one's
        recorded position, or the message boundary before it (asked of its archive)."""
        d = recording.descriptor
        if not d.is_active:
            return recording.recorded_position
        recorded = recording.recorded_position
        term_base = max(d.start_position, recorded - recorded % d.term_length)
        if term_base >= recorded:
            return recorded
        pieces = archives.pieces(stream_id, d.session_id, (d.initial_term_id, d.term_length),
                                 term_base, recorded)
        found = archives.view(stream_id, pieces[0]) if pieces else None
        return recorded if found is None else found[0].scan(term_base, recorded, None, None)

    def partitions(self) -> list[SlipstreamPartition]:  # type: ignore[override]
        hold: _StandingHold | _ArchivesOnly = _StandingHold(self.options, hold=False) \
            if self.options.holder is not None else _ArchivesOnly(self.options)
        archives = None
        try:
            views = hold.views()
            losses = LossReports(self.options)
            if self.options.archives:
                archives = Archives(hold.client, [_resolved(endpoint)
                                                  for endpoint in self.options.archives],
                                    self.options.replay_timeout_ms / 1000,
                                    self.options.call_key)
                silent = [endpoint for stream_id in self.options.stream_ids
                          for endpoint in archives.silent(stream_id)]
                if silent:
                    # With a holder too: the sessions only it recorded (ended ones), and what
                    # the log no longer holds, would be left out of the read without a word.
                    missing = "what it recorded would be missing from the read" \
                        if self.options.holder is None else \
                        "the sessions only it recorded, and what the holder's log no longer " \
                        "holds, would be missing from the read"
                    raise SlipstreamError(
                        f"slipstream: the archive{'s' if len(silent) > 1 else ''} "
                        f"{', '.join(f'{a}:{p}' for a, p, _ in sorted(set(silent)))} did not "
                        f"answer within replayTimeoutMs ({missing}): is it running, and its "
                        f"control port open?")
            start, end = self._ranges(hold, views, losses, archives)
            return plan_partitions(self.options, hold, views, start, end, losses, archives)
        finally:
            if archives is not None:
                archives.close()
            hold.close()

    def read(self, partition: InputPartition) -> Iterator[object]:  # type: ignore[override]
        """The partition's messages as Arrow record batches (see :func:`read_range`)."""
        assert isinstance(partition, SlipstreamPartition)
        partition.include_headers = self.options.include_headers
        return read_range(partition)
