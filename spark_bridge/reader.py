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
  query's **holder** (a :class:`~slipstream.client.replay.ReplayServer` on a thread of its
  own), to replay the range to it through its own host's driver.  Rows leave as Arrow record
  batches.  See docs/SPARK.md, "Reading on a cluster".

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

import datetime
import ipaddress
import itertools
import logging
import os
import random
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from pyspark.sql.datasource import DataSourceReader, DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxBytes,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)

from slipstream.client import (
    Client,
    DataLossError,
    GatheredMessages,
    Image,
    SlipstreamError,
    Subscription,
    control,
)
from slipstream.client.counters import CountersFile
from slipstream.client.holder import (
    HOLDER_CONTROL_STREAM,
    MAX_SPLIT_PIECES,
    DetachedLogs,
    driver_instance,
)
from slipstream.client.holding import HolderLink
from slipstream.client.layout import INT32_MAX
from slipstream.client.logbuffer import LogIdentity
from slipstream.client.logview import ImageView, LogView, RemoteView
from slipstream.client.replay import ReplayLostError, ReplayServer, request_replay
from slipstream.client.retention import first_retained, message_start
from slipstream.spark_bridge.options import SourceOptions

__all__ = ["SCHEMA", "SlipstreamBatchReader", "SlipstreamDataLossError", "SlipstreamPartition",
           "SlipstreamStreamReader"]

log = logging.getLogger("slipstream.spark_bridge")

SCHEMA = "value binary, session_id int, stream_id int, position long, timestamp timestamp"
"""The columns of a slipstream stream read (the Kafka connector's conventions):

* ``value``: the message.
* ``session_id``, ``stream_id``: the publication session (image) and the stream.
* ``position``: the stream position just after the message (Aeron's ``Header.position``):
  unique and increasing within a session; the offset a query resumes from after it.
* ``timestamp``: the publisher's time, from the frame's reserved value (ns since the epoch:
  the slipstream writer sets it); for a reserved value of 0, when the executor read it.
"""

_ROWS_PER_BATCH = 4096  # rows per Arrow record batch leaving read(): one C scan's most
_IMAGE_WAIT_S = 0.5  # how long a new subscription waits for its images to show up


class SlipstreamDataLossError(SlipstreamError):
    """Positions a query must read are no longer in the log (failOnDataLoss=true)."""


class SlipstreamPartition(InputPartition):
    """One image's range ``[start, end)`` of one micro-batch, read by one task (picklable).

    It names what it reads: the log (``log``, its identity; None when the session's log was
    gone when the batch was planned), where it lives (``log_path`` on the host ``host``
    whose driver is ``driver``, ``pid@start_time_ns`` of that driver) and the holder that
    replays it to tasks on other hosts (``holder``: address, port, control stream id; None
    when the holder has no address other hosts reach).
    """

    def __init__(self, session_id: int, stream_id: int, log_path: str, start: int, end: int,
                 directory: str | None, fail_on_data_loss: bool, host: str, *,
                 log: LogIdentity | None, driver: str | None,
                 holder: tuple[str, int, int] | None, replay_timeout_ms: int) -> None:
        super().__init__(None)
        self.session_id = session_id
        self.stream_id = stream_id
        self.log_path = log_path
        self.start = start
        self.end = end
        self.directory = directory
        self.fail_on_data_loss = fail_on_data_loss
        self.host = host
        self.log = log
        self.driver = driver
        self.holder = holder
        self.replay_timeout_ms = replay_timeout_ms

    def __repr__(self) -> str:
        return (f"SlipstreamPartition(stream={self.stream_id}, session={self.session_id}, "
                f"[{self.start}, {self.end}))")


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


def local_driver_instance(directory: str | None) -> str | None:
    """:func:`driver_instance` of the driver in this host's ``directory`` (None: the client
    default), or None when there is none."""
    from slipstream.client import default_directory

    path = (Path(directory) if directory else default_directory()) / control.COUNTERS_FILE
    try:
        counters = CountersFile(path)
    except (OSError, ValueError):
        return None
    try:
        return driver_instance(counters)
    finally:
        counters.close()


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
    """The query's replay server (:class:`~slipstream.client.replay.ReplayServer`) on a
    thread of the planning process, with a client of its own: it replays the ranges the
    query's subscription holds to read tasks on other hosts.  ``logs`` maps session ids to
    log paths (the planning thread replaces it as images come and go)."""

    def __init__(self, directory: str | None, address: str, port: int) -> None:
        #: session id -> (log path, the subscription's join position: the log holds nothing
        #: before it, whatever its frames there say).
        self.logs: dict[int, tuple[str, int]] = {}
        self._images = DetachedLogs()
        self._stopping = False
        self._client = Client.connect(directory)
        try:
            control_stream = random.randrange(1, INT32_MAX)
            self.server = ReplayServer(self._client, address, port, control_stream,
                                       self._lookup, housekeeping=self._prune)
        except BaseException:
            self._client.close()
            raise
        self.address = (address, port, control_stream)
        self._thread = threading.Thread(target=self._run, name="slipstream-replay-holder",
                                        daemon=True)
        self._thread.start()

    def _prune(self) -> dict[int, tuple[str, int]]:
        """Unmap the logs of sessions no longer in :attr:`logs` that no replay reads (their
        files are gone: the mapping is all that keeps their memory); returns :attr:`logs`."""
        logs = self.logs
        self._images.prune({path for path, _ in logs.values()}, self.server.logs_in_use)
        return logs

    def _lookup(self, stream_id: int, session_id: int) -> Image | None:
        logs = self._prune()
        if session_id not in logs:
            return None
        image = self._images.get(*logs[session_id])
        return image if image is not None and image.stream_id == stream_id else None

    def _run(self) -> None:
        try:
            self.server.run(lambda: self._stopping)
        except Exception:  # the tasks that need it fail naming it
            log.exception("slipstream: the replay holder stopped")
        finally:
            self.server.close()
            self._images.close()

    def close(self) -> None:
        self._stopping = True
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self._client.close()


def _record_skip(directory: str | None) -> None:
    """Add one to the driver's ``data loss skips`` counter (best effort)."""
    try:
        from slipstream.client import control, default_directory
        from slipstream.client.counters import CountersFile, SystemCounter

        path = Path(directory) if directory else default_directory()
        counters = CountersFile(path / control.COUNTERS_FILE)
        try:
            counters.add(SystemCounter.DATA_LOSS_SKIPS)
        finally:
            counters.close()
    except (OSError, ValueError, ImportError) as e:  # the warning is logged anyway
        log.warning("could not count a data loss skip in %s: %s", directory, e)


def loss_message(stream_id: int, session_id: int, start: int, end: int,
                 producer: int | None, term_length: int | None) -> str:
    """The text of a data loss error: which stream, session and positions, why, and what to
    do.  ``term_length`` None: the log itself is gone."""
    at = f" (the publisher is at {producer})" if producer is not None else ""
    why = (f"a log holds one term ({term_length} bytes) behind its slowest reading "
           f"subscriber, and this query fell further behind (or was stopped that long)"
           if term_length is not None else
           "the log is gone: its stream ended and the subscribers it had read it all, or its "
           "driver stopped, while this query was stopped")
    return (f"slipstream stream {stream_id} session {session_id}: the messages at positions "
            f"[{start}, {end}) are no longer in the log{at}; {why}.  Set failOnDataLoss=false "
            f"to skip to the oldest position still held (counted in the driver's 'data loss "
            f"skips' counter).")


def _arrow_batch(chunk: GatheredMessages, session_id: int, stream_id: int,
                 schema: object, ids: dict[int, tuple[object, object]] | None = None) -> object:
    """One record batch from messages copied out of the log: the values and position columns
    wrap the chunk's buffers, the others are computed for the whole batch at once (no Python
    per message).  ``timestamp`` is the reserved value (ns since the epoch: the slipstream writer
    stamps it), or the read time where that is 0.  ``ids``: the session and stream id columns
    of a full batch (a shorter one takes slices of them), kept by the caller across the
    batches of one range."""
    import numpy as np
    import pyarrow as pa

    n = len(chunk)
    size = max(n, _ROWS_PER_BATCH) if ids is not None else n
    id_columns = ids.get(size) if ids is not None else None
    if id_columns is None:
        id_columns = (pa.array(np.full(size, session_id, dtype=np.int32)),
                      pa.array(np.full(size, stream_id, dtype=np.int32)))
        if ids is not None:
            ids[size] = id_columns
    if n < size:  # a shorter batch: zero-copy slices of the full batch's columns
        id_columns = (id_columns[0].slice(0, n), id_columns[1].slice(0, n))
    reserved = np.frombuffer(chunk.reserved_values, dtype=np.int64)
    if reserved.min() >= 1000:  # every message stamped (ns): its time in us
        published = reserved // 1000
    else:  # some not stamped (not the slipstream writer's): the read time for those
        now = int(datetime.datetime.now(datetime.UTC).timestamp() * 1_000_000)
        if reserved.max() < 1000:  # none: no division to make
            published = np.full(n, now, dtype=np.int64)
        else:
            published = reserved // 1000
            published = np.where(published > 0, published, now)
    values = pa.Array.from_buffers(pa.binary(), n, [None, pa.py_buffer(chunk.offsets),
                                                    pa.py_buffer(chunk.data)])
    columns = [
        values,
        *id_columns,
        pa.Array.from_buffers(pa.int64(), n, [None, pa.py_buffer(chunk.positions)]),
        pa.Array.from_buffers(schema.field(4).type, n,  # type: ignore[attr-defined]
                              [None, pa.py_buffer(published)]),
    ]
    return pa.RecordBatch.from_arrays(columns, schema=schema)


def _schema() -> object:
    import pyarrow as pa

    return pa.schema([("value", pa.binary()), ("session_id", pa.int32()),
                      ("stream_id", pa.int32()), ("position", pa.int64()),
                      ("timestamp", pa.timestamp("us", tz="UTC"))])  # SCHEMA, as Arrow


def read_range(partition: SlipstreamPartition) -> Iterator[object]:
    """Executor side: the rows of ``partition`` as Arrow record batches, in stream order.

    On the host whose driver holds the log (the same driver run as the planner's), the task
    maps the log and peeks the range; anywhere else it asks the holder for a replay through
    its own host's driver (:func:`_read_replayed`).  Loss follows ``fail_on_data_loss``.
    """
    p = partition
    if p.driver is not None and local_driver_instance(p.directory) == p.driver:
        return _read_local(p)
    return _read_replayed(p)


def _no_log(p: SlipstreamPartition, why: str) -> None:
    """The range of ``p`` is in no log (``why``): data loss, raised or (failOnDataLoss=false)
    logged, counted and skipped."""
    message = loss_message(p.stream_id, p.session_id, p.start, p.end, None, None) + f" ({why})"
    if p.fail_on_data_loss:
        raise SlipstreamDataLossError(message)
    log.warning("%s Skipping [%d, %d).", message, p.start, p.end)
    _record_skip(p.directory)


def _read_local(p: SlipstreamPartition) -> Iterator[object]:
    """The range from the log in this host's shared memory, copied out batch by batch by the
    C scan.  Each batch is checked after it is copied (a publisher lapping the reader
    meanwhile would have torn it)."""
    schema = _schema()
    ids: dict[int, tuple[object, object]] = {}
    if not p.log_path:  # the session's image was gone when the batch was planned
        _no_log(p, f"no log of this session on {p.host} when the batch was planned")
        return
    try:
        image = Image.detached(p.log_path, p.start)
    except FileNotFoundError:
        _no_log(p, f"the log file {p.log_path} is gone")
        return
    try:
        position = p.start
        while position < p.end:
            try:
                image.check_retained(position)
                chunk = image.poll_gathered(_ROWS_PER_BATCH, p.end)
                image.check_retained(position)  # still held after the copy: not torn
            except DataLossError as e:
                message = loss_message(p.stream_id, p.session_id, position, p.end,
                                       e.producer_position, image.term_length)
                if p.fail_on_data_loss:
                    raise SlipstreamDataLossError(message) from None
                skip_to = message_start(image, first_retained(image, position, p.end), p.end)
                log.warning("%s Skipping to %d (failOnDataLoss=false).", message, skip_to)
                _record_skip(p.directory)
                image.close()
                image = Image.detached(p.log_path, skip_to)
                position = skip_to
                continue
            if chunk is not None:
                yield _arrow_batch(chunk, p.session_id, p.stream_id, schema, ids)
            elif image.position == position:
                raise SlipstreamError(
                    f"slipstream stream {p.stream_id} session {p.session_id}: no whole message "
                    f"at position {position} before {p.end}; the offsets do not match this log")
            position = image.position
    finally:
        image.close()


def _read_replayed(p: SlipstreamPartition) -> Iterator[object]:
    """The range replayed by the query's holder to this host's driver
    (:mod:`slipstream.client.replay`): the same messages, positions and reserved values."""
    from slipstream.spark_bridge import runtime

    here = socket.gethostname()
    if p.holder is None:
        raise SlipstreamError(
            f"slipstream stream {p.stream_id} session {p.session_id}: this read task runs on "
            f"{here}, whose slipstream driver does not hold the log (it is on {p.host}), and "
            f"the query's holder has no address other hosts reach (its host name resolves to "
            f"a loopback address): set the reader's holderAddress option to the address of "
            f"{p.host} that the executors reach (docs/SPARK.md)")
    if p.log is None:  # the session's image was gone when the batch was planned
        _no_log(p, f"no log of this session at the holder on {p.host}")
        return
    identity = p.log
    term_length = identity.term_length
    address, port, control_stream = p.holder
    timeout_s = p.replay_timeout_ms / 1000
    schema = _schema()
    ids: dict[int, tuple[object, object]] = {}
    client = runtime.client_for(p.directory)
    position = p.start

    def lost(e: ReplayLostError) -> SlipstreamDataLossError:
        return SlipstreamDataLossError(
            loss_message(p.stream_id, p.session_id, e.lost[0], e.lost[1], None, term_length)
            + f" (at the holder on {p.host}: {e})")

    while position < p.end:
        try:
            replay = request_replay(client, address, port, control_stream, p.stream_id,
                                    identity, position, p.end,
                                    skip_lost=not p.fail_on_data_loss, timeout_s=timeout_s)
        except ReplayLostError as e:
            raise lost(e) from None
        with replay:
            if replay.lost is not None:
                log.warning("%s Skipping to %d (failOnDataLoss=false).", loss_message(
                    p.stream_id, p.session_id, *replay.lost, None, term_length),
                    replay.start)
                _record_skip(p.directory)
            idle_since = time.monotonic()
            try:
                while not replay.done:
                    chunk = replay.poll_gathered(_ROWS_PER_BATCH)
                    if chunk is not None:
                        yield _arrow_batch(chunk, p.session_id, p.stream_id, schema, ids)
                        idle_since = time.monotonic()
                    elif time.monotonic() - idle_since > timeout_s:
                        raise SlipstreamError(
                            f"{replay.describe()}: nothing arrived for {timeout_s:g} s, at "
                            f"position {replay.position} (this host's driver log says why "
                            f"when it refused the replay: a term length of {term_length} "
                            f"over its image_term_buffer_length_max, for one)")
                    else:
                        replay.wait(0.01)
            except ReplayLostError as e:
                if p.fail_on_data_loss:
                    raise lost(e) from None
                # Asked again from here with skip_lost, the holder skips what it lost.
            position = replay.position
            if replay.complete_at is not None and position >= replay.complete_at:
                break  # the holder sent every message: padding, never sent, ends the range


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


class _OwnHold:
    """The query holds its stream itself: a subscription through this host's driver, and a
    replay holder (:class:`_Holder`) on a thread for read tasks on other hosts."""

    def __init__(self, options: SourceOptions) -> None:
        self.client = Client.connect(options.directory)
        self.holder: _Holder | None = None
        try:  # whatever fails, what was made so far goes (not at the driver's timeout)
            self.subscription: Subscription = self.client.add_subscription(options.channel,
                                                                            options.stream_id)
            self.host = socket.gethostname()
            self.driver = driver_instance(self.client.counters)
            address = holder_address(options)
            if address is not None:
                try:
                    self.holder = _Holder(options.directory, address, options.replay_port)
                except SlipstreamError as e:  # tasks on other hosts fail, saying so
                    log.warning("slipstream: the query's replay holder cannot listen at "
                                "%s:%d (%s): read tasks on other hosts will fail; set "
                                "replayPort to a free UDP port, or holderAddress to this "
                                "host's address", address, options.replay_port, e)
            deadline = time.monotonic() + _IMAGE_WAIT_S
            while not self.subscription.images and time.monotonic() < deadline:
                time.sleep(0.01)
        except BaseException:
            self.close()
            raise

    @property
    def holder_address(self) -> tuple[str, int, int] | None:
        """Where tasks on other hosts ask for replays (address, port, control stream)."""
        return self.holder.address if self.holder is not None else None

    def views(self) -> dict[str, LogView]:
        if self.client.is_closed:
            raise self.client.driver_lost_error()
        subscription = self.subscription
        # The images of sessions that ended: this (planning) thread is the only one that
        # reads them, and it never polls.
        subscription.release_gone_images()
        images = subscription.images
        if self.holder is not None:
            self.holder.logs = {image.session_id: (image.log_path, image.join_position)
                                for image in images}
        return {str(image.session_id): ImageView(image) for image in images}

    def close(self) -> None:
        if self.holder is not None:
            self.holder.close()
        self.client.close()


class _StandingHold:
    """An ingest host's standing holder (``slipstream-holder``, the ``holder`` option) holds
    the stream: the planner asks it, through this host's driver, what the logs hold and to
    move the position on commit (:class:`~slipstream.client.logview.RemoteView`)."""

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
            self.link = HolderLink(self.client, address, port, HOLDER_CONTROL_STREAM,
                                   timeout_s=options.replay_timeout_ms / 1000)
        except BaseException:
            self.client.close()
            raise
        self.key = {"channel": options.channel, "stream_id": options.stream_id,
                    "group": options.holder_group, "hold": hold}
        self.holder_address: tuple[str, int, int] | None = (address, port,
                                                              HOLDER_CONTROL_STREAM)
        self.host = name
        self.driver: str | None = None

    def views(self) -> dict[str, LogView]:
        if self.client.is_closed:
            raise self.client.driver_lost_error()
        state = self.link.call("state", **self.key)
        self.host, self.driver = str(state["host"]), str(state["driver"])
        key = {k: v for k, v in self.key.items() if k != "hold"}
        return {sid: RemoteView(self.link, key, int(sid), fields)
                for sid, fields in state["sessions"].items()}

    def close(self) -> None:
        self.link.close()
        self.client.close()


def plan_partitions(options: SourceOptions, hold: _OwnHold | _StandingHold,
                    images: dict[str, LogView], start: dict[str, object],
                    end: dict[str, object]) -> list[SlipstreamPartition]:
    """The partitions of ``[start, end)`` (offsets: session id -> entry): one per session
    with something to read, or with ``minPartitions`` long ranges split at message
    boundaries so that there are about that many, each session's count in proportion to its
    share of the bytes (:meth:`LogView.split_points`).  A range of a log that is not the
    session's log now fails (or is skipped, ``failOnDataLoss=false``), naming both."""
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
        image = images.get(sid)
        named = log_of(end[sid])
        if image is not None and named is not None and named != image.identity.framing:
            message = (f"slipstream stream {options.stream_id} session {sid}: the "
                       f"batch's range [{begin}, {stop}) is of the log with initial term "
                       f"id {named[0]} and term length {named[1]}; this session's log now "
                       f"has {image.identity.describe()} (its publisher was added again, "
                       f"with session-id set?)")
            if options.fail_on_data_loss:
                raise SlipstreamDataLossError(message)
            log.warning("%s: skipping the range (failOnDataLoss=false)", message)
            _record_skip(options.directory)
            continue
        identity = (image.identity if image is not None
                    else LogIdentity(int(sid), *named) if named is not None else None)
        bounds = [begin, stop]
        if wanted is not None and image is not None and wanted > len(ranges):
            # At most what a standing holder splits a range into (and plenty for a session).
            pieces = min(MAX_SPLIT_PIECES, max(1, round(wanted * (stop - begin) / total)))
            bounds = [begin, *image.split_points(begin, stop, pieces), stop]
        for low, high in itertools.pairwise(bounds):
            partitions.append(SlipstreamPartition(
                int(sid), options.stream_id,
                image.log_path if image is not None else "", low, high,
                options.directory, options.fail_on_data_loss, hold.host,
                log=identity, driver=hold.driver, holder=hold.holder_address,
                replay_timeout_ms=options.replay_timeout_ms))
    return partitions


class SlipstreamStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """``spark.readStream.format("slipstream")``: see the module documentation.

    Constructed in several Spark processes (planner, source runner); only the source runner's
    instance connects, lazily, on its first offset call.  Pickles without its client.
    """

    def __init__(self, options: SourceOptions) -> None:
        self.options = options
        self._hold: _OwnHold | _StandingHold | None = None
        self._target: dict[str, int] | None = None

    def __getstate__(self) -> dict[str, object]:
        state = dict(self.__dict__)
        state["_hold"] = None
        return state

    # -- offsets -------------------------------------------------------------------------------
    def _entry(self, view: LogView, position: int) -> dict[str, object]:
        """An offset's entry for ``view``'s log: the position, and what it is a position of
        (the log: initial term id and term length; the holder: host and driver run)."""
        assert self._hold is not None
        return {"position": int(position), "log": [*view.identity.framing],
                "holder": f"{self._hold.host}/{self._hold.driver}"}

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
        return self._hold.views()

    def _default_start(self, view: LogView) -> int:
        if self.options.starting_position == "earliest":
            return view.earliest_position()
        return view.position

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
        if self.options.starting_position == "earliest":
            return {sid: self._entry(view, view.earliest_position())
                    for sid, view in images.items()}
        return {}

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

    def latestOffset(self, start: dict[str, object], limit: ReadLimit) -> dict[str, object]:
        """The end of the next micro-batch: per image, the last whole ready message, capped by
        the read limit (message and byte budgets are shared by the images in proportion to
        their backlogs: :func:`shares`).

        A session not in ``start`` enters at its starting position without being read in
        this batch, so that its start is recorded in the offset log and replays read the same
        range.  Sessions whose image is gone are dropped.
        """
        images = self._images()
        # Batches before start ran and are in the commit log.
        foreign = self._consumed(images, start)
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
        end: dict[str, object] = {}
        ranges: dict[str, tuple[int, int]] = {}  # sessions with something to read
        for sid, image in sorted(images.items()):
            if self._target is not None and sid not in self._target:
                # Trigger.AvailableNow: a session that appeared after it started is not read
                # (one already in the offsets stays where it is).
                if sid in start:
                    end[sid] = start[sid]
                continue
            if sid not in start:
                end[sid] = self._entry(image, self._default_start(image))
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
            if not image.is_retained(begin):
                if self.options.fail_on_data_loss:
                    raise SlipstreamDataLossError(loss_message(
                        image.stream_id, image.session_id, begin, available, None,
                        image.identity.term_length))
                begin = image.first_retained(begin, available)  # the executor counts the skip
            ranges[sid] = (begin, available)
            end[sid] = self._entry(image, available)
        if max_rows is None and max_bytes is None:
            return end
        backlog = {sid: stop - begin for sid, (begin, stop) in ranges.items()}
        row_shares = shares(max_rows, backlog) if max_rows is not None else {}
        byte_shares = shares(max_bytes, backlog) if max_bytes is not None else {}
        for sid, (begin, available) in ranges.items():
            reached = images[sid].scan(begin, available, row_shares.get(sid),
                                       byte_shares.get(sid))
            end[sid] = self._entry(images[sid], reached)
        return end

    def reportLatestOffset(self) -> dict[str, int] | None:
        """What is available now (shown in the query's progress)."""
        if self._hold is None:
            return None
        return {sid: view.available_position() for sid, view in self._images().items()}

    def partitions(self, start: dict[str, object], end: dict[str, object]
                   ) -> list[SlipstreamPartition]:
        """One partition per image with something in ``[start, end)``; with ``minPartitions``,
        long ranges are split at message boundaries so that there are about that many, each
        session's count in proportion to its share of the bytes
        (:meth:`LogView.split_points`)."""
        images = self._images()
        assert self._hold is not None
        return plan_partitions(self.options, self._hold, images, start, end)

    def commit(self, end: dict[str, object]) -> None:
        """Spark processed everything before ``end``: return its credit (see the module
        documentation for why ``latestOffset`` does so too)."""
        for sid, reason in self._consumed(self._images(), end).items():
            # latestOffset(start=end) says what to do about it, in the next batch.
            log.warning("commit: the offset %s of session %s is not a position of its log "
                        "(%s): the subscriber position stays where it is", end[sid], sid, reason)

    @staticmethod
    def _consumed(images: dict[str, LogView], offsets: dict[str, object]) -> dict[str, str]:
        """The query is done with everything before ``offsets``: move each image's subscriber
        position there (never backwards), returning the credit to the publishers.

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
            why = image.advance_to(position_of(entry))
            if why is not None:
                foreign[sid] = why
        return foreign

    def stop(self) -> None:
        """The query ended: leave the driver (the subscription stops holding publishers, the
        holder stops replaying)."""
        hold, self._hold = self._hold, None
        if hold is not None:
            hold.close()

    # -- executor side -------------------------------------------------------------------------
    def read(self, partition: InputPartition) -> Iterator[object]:  # type: ignore[override]
        """The partition's messages as Arrow record batches (see :func:`read_range`)."""
        assert isinstance(partition, SlipstreamPartition)
        return read_range(partition)


class SlipstreamBatchReader(DataSourceReader):
    """``spark.read.format("slipstream")``: per session of the stream, the messages from
    ``startingPosition`` (default ``earliest``) to ``endingPosition`` (default ``latest``)
    that the standing holder named by ``holder`` holds for ``holderGroup``.

    A batch read moves no position: it reads what the holder's log holds, and the stream's
    query (if any) commits as before.  Its planner (a Python worker that ends before the tasks
    run) asks the holder once; the tasks read as a stream's do (:func:`read_range`).
    """

    def __init__(self, options: SourceOptions) -> None:
        self.options = options

    def _ranges(self, views: dict[str, LogView]) -> tuple[dict[str, object], dict[str, object]]:
        options = self.options
        starting = options.starting_position if "startingPosition" in options.given \
            else "earliest"
        ending = options.ending_position
        named = {sid for positions in (starting, ending) if isinstance(positions, dict)
                 for sid in positions}
        absent = ", ".join(sorted(named - set(views)))
        if absent:
            raise SlipstreamError(
                f"slipstream stream {options.stream_id}: no session {absent} at the holder "
                f"{options.holder} (sessions there: {', '.join(sorted(views)) or 'none'})")
        start: dict[str, object] = {}
        end: dict[str, object] = {}
        for sid, view in sorted(views.items()):
            available = view.available_position()
            stop = ending[sid] if isinstance(ending, dict) and sid in ending else available
            if stop > available:
                raise SlipstreamError(
                    f"slipstream stream {options.stream_id} session {sid}: endingPosition "
                    f"{stop} is past the last whole message its log holds ({available})")
            if starting == "latest":
                begin = stop
            elif isinstance(starting, dict) and sid in starting:
                begin = starting[sid]
            else:
                begin = view.earliest_position()
            if begin > stop:
                raise SlipstreamError(
                    f"slipstream stream {options.stream_id} session {sid}: startingPosition "
                    f"{begin} is after endingPosition {stop}")
            if begin < stop and not view.is_retained(begin):
                message = loss_message(options.stream_id, view.session_id, begin, stop, None,
                                       view.identity.term_length)
                if options.fail_on_data_loss:
                    raise SlipstreamDataLossError(message)
                begin = view.first_retained(begin, stop)
                log.warning("%s Skipping to %d (failOnDataLoss=false).", message, begin)
                _record_skip(options.directory)
            identity = [*view.identity.framing]
            start[sid] = {"position": begin, "log": identity}
            end[sid] = {"position": stop, "log": identity}
        return start, end

    def partitions(self) -> list[SlipstreamPartition]:  # type: ignore[override]
        hold = _StandingHold(self.options, hold=False)
        try:
            views = hold.views()
            start, end = self._ranges(views)
            return plan_partitions(self.options, hold, views, start, end)
        finally:
            hold.close()

    def read(self, partition: InputPartition) -> Iterator[object]:  # type: ignore[override]
        """The partition's messages as Arrow record batches (see :func:`read_range`)."""
        assert isinstance(partition, SlipstreamPartition)
        return read_range(partition)
