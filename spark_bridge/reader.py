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

from pyspark.sql.datasource import DataSourceStreamReader, InputPartition
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
    InvalidArgumentError,
    SlipstreamError,
    Subscription,
    control,
)
from slipstream.client.counters import CountersFile
from slipstream.client.layout import INT32_MAX
from slipstream.client.replay import (
    LogIdentity,
    ReplayLostError,
    ReplayServer,
    earliest_position,
    first_retained,
    is_retained,
    message_start,
    request_replay,
)
from slipstream.spark_bridge.options import SourceOptions

__all__ = ["SCHEMA", "SlipstreamDataLossError", "SlipstreamPartition", "SlipstreamStreamReader"]

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


class _Stop(Exception):
    """Raised from a peek handler to end a scan after a whole message."""


class SlipstreamPartition(InputPartition):
    """One image's range ``[start, end)`` of one micro-batch, read by one task (picklable).

    It names what it reads: the log (``session_id`` with ``initial_term_id`` and
    ``term_length``), where it lives (``log_path`` on the host ``host`` whose driver is
    ``driver``, ``pid@start_time_ns`` of that driver) and the holder that replays it to
    tasks on other hosts (``holder``: address, port, control stream id; None when the
    holder has no address other hosts reach).
    """

    def __init__(self, session_id: int, stream_id: int, log_path: str, start: int, end: int,
                 directory: str | None, fail_on_data_loss: bool, host: str, *,
                 initial_term_id: int, term_length: int, driver: str | None,
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
        self.initial_term_id = initial_term_id
        self.term_length = term_length
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


def driver_instance(counters: CountersFile) -> str:
    """What names one run of one driver: its pid and start time (``pid@start_time_ns``)."""
    return f"{counters.driver_pid}@{counters.start_time_ns}"


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
        self._images: dict[str, Image] = {}
        self._stopping = False
        self._client = Client.connect(directory)
        try:
            control_stream = random.randrange(1, INT32_MAX)
            self.server = ReplayServer(self._client, address, port, control_stream,
                                       self._lookup)
        except BaseException:
            self._client.close()
            raise
        self.address = (address, port, control_stream)
        self._thread = threading.Thread(target=self._run, name="slipstream-replay-holder",
                                        daemon=True)
        self._thread.start()

    def _lookup(self, stream_id: int, session_id: int) -> Image | None:
        logs = self.logs
        if not self.server.replaying:  # unmap the logs that left, none of them being read
            for gone in set(self._images) - {path for path, _ in logs.values()}:
                self._images.pop(gone)._log.close()
        if session_id not in logs:
            return None
        path, joined = logs[session_id]
        image = self._images.get(path)
        if image is None:
            try:
                image = Image.detached(path, joined)
            except OSError:
                return None
            self._images[path] = image
        return image if image.stream_id == stream_id else None

    def _run(self) -> None:
        try:
            self.server.run(lambda: self._stopping)
        except Exception:  # the tasks that need it fail naming it
            log.exception("slipstream: the replay holder stopped")
        finally:
            self.server.close()
            for image in self._images.values():
                image._log.close()
            self._images.clear()

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
                 schema: object) -> object:
    """One record batch from messages copied out of the log: the values column wraps the
    chunk's buffers, the others are computed for the whole batch at once (no Python per
    message).  ``timestamp`` is the reserved value (ns since the epoch: the slipstream writer
    stamps it), or the read time where that is 0."""
    import numpy as np
    import pyarrow as pa

    n = len(chunk)
    now = int(datetime.datetime.now(datetime.UTC).timestamp() * 1_000_000)
    published = np.frombuffer(chunk.reserved_values, dtype=np.int64) // 1000
    values = pa.Array.from_buffers(pa.binary(), n, [None, pa.py_buffer(chunk.offsets),
                                                    pa.py_buffer(chunk.data)])
    columns = [
        values,
        pa.array(np.full(n, session_id, dtype=np.int32)),
        pa.array(np.full(n, stream_id, dtype=np.int32)),
        pa.array(np.frombuffer(chunk.positions, dtype=np.int64)),
        pa.array(np.where(published > 0, published, now)).view(pa.timestamp("us", tz="UTC")),
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


def _read_local(p: SlipstreamPartition) -> Iterator[object]:
    """The range from the log in this host's shared memory, copied out batch by batch by the
    C scan.  Each batch is checked after it is copied (a publisher lapping the reader
    meanwhile would have torn it)."""
    schema = _schema()
    try:
        image = Image.detached(p.log_path, p.start)
    except FileNotFoundError:
        if p.fail_on_data_loss:
            raise SlipstreamDataLossError(
                loss_message(p.stream_id, p.session_id, p.start, p.end, None, None)
                + f" (the log file {p.log_path} is gone)") from None
        log.warning("slipstream: log %s is gone; skipping [%d, %d)", p.log_path, p.start, p.end)
        _record_skip(p.directory)
        return
    try:
        position = p.start
        while position < p.end:
            try:
                image._check_retained(position)
                chunk = image.poll_gathered(_ROWS_PER_BATCH, p.end)
                image._check_retained(position)  # still held after the copy: not torn
            except DataLossError as e:
                message = loss_message(p.stream_id, p.session_id, position, p.end,
                                       e.producer_position, image.term_length)
                if p.fail_on_data_loss:
                    raise SlipstreamDataLossError(message) from None
                skip_to = message_start(image, first_retained(image, position, p.end), p.end)
                log.warning("%s Skipping to %d (failOnDataLoss=false).", message, skip_to)
                _record_skip(p.directory)
                image._log.close()
                image = Image.detached(p.log_path, skip_to)
                position = skip_to
                continue
            if chunk is not None:
                yield _arrow_batch(chunk, p.session_id, p.stream_id, schema)
            elif image.position == position:
                raise SlipstreamError(
                    f"slipstream stream {p.stream_id} session {p.session_id}: no whole message "
                    f"at position {position} before {p.end}; the offsets do not match this log")
            position = image.position
    finally:
        image._log.close()


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
    if p.term_length == 0:  # the session's image was gone when the batch was planned
        message = (loss_message(p.stream_id, p.session_id, p.start, p.end, None, None)
                   + f" (no log of this session at the holder on {p.host})")
        if p.fail_on_data_loss:
            raise SlipstreamDataLossError(message)
        log.warning("%s Skipping [%d, %d).", message, p.start, p.end)
        _record_skip(p.directory)
        return
    address, port, control_stream = p.holder
    identity = LogIdentity(p.session_id, p.initial_term_id, p.term_length)
    timeout_s = p.replay_timeout_ms / 1000
    schema = _schema()
    client = runtime.client_for(p.directory)
    position = p.start

    def lost(e: ReplayLostError) -> SlipstreamDataLossError:
        return SlipstreamDataLossError(
            loss_message(p.stream_id, p.session_id, e.lost[0], e.lost[1], None, p.term_length)
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
                    p.stream_id, p.session_id, *replay.lost, None, p.term_length),
                    replay.start)
                _record_skip(p.directory)
            idle_since = time.monotonic()
            try:
                while not replay.done:
                    chunk = replay.poll_gathered(_ROWS_PER_BATCH)
                    if chunk is not None:
                        yield _arrow_batch(chunk, p.session_id, p.stream_id, schema)
                        idle_since = time.monotonic()
                    elif time.monotonic() - idle_since > timeout_s:
                        raise SlipstreamError(
                            f"{replay.describe()}: nothing arrived for {timeout_s:g} s, at "
                            f"position {replay.position} (this host's driver log says why "
                            f"when it refused the replay: a term length of {p.term_length} "
                            f"over its image_term_buffer_length_max, for one)")
                    else:
                        replay.wait(0.01)
            except ReplayLostError as e:
                if p.fail_on_data_loss:
                    raise lost(e) from None
                # Asked again from here with skip_lost, the holder skips what it lost.
            position = replay.position


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


def split_points(image: Image, begin: int, stop: int, pieces: int) -> list[int]:
    """Message boundaries strictly inside ``[begin, stop)`` that cut it into about ``pieces``
    ranges of equal length, found by the C scan (64 messages per step, so a piece is at
    least that long); fewer when the range is too short or the log no longer holds it."""
    if pieces <= 1:
        return []
    step = (stop - begin) / pieces
    probe = Image.detached(image.log_path, begin)
    points: list[int] = []
    try:
        target = begin + step
        while probe.position < stop and len(points) < pieces - 1:
            before = probe.position
            probe.poll_batch(64)
            if probe.position == before or probe.position >= stop:
                break
            if probe.position >= target and not probe._assembling:
                points.append(probe.position)
                target = probe.position + step
    finally:
        probe._log.close()
    if not is_retained(image, begin):  # lapped while scanning: the tasks report the loss
        return []
    return points


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


class SlipstreamStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """``spark.readStream.format("slipstream")``: see the module documentation.

    Constructed in several Spark processes (planner, source runner); only the source runner's
    instance connects, lazily, on its first offset call.  Pickles without its client.
    """

    def __init__(self, options: SourceOptions) -> None:
        self.options = options
        self._client: Client | None = None
        self._subscription: Subscription | None = None
        self._target: dict[str, int] | None = None
        self._host = socket.gethostname()
        self._driver: str | None = None  # driver_instance() of the planner's driver
        self._holder: _Holder | None = None

    def __getstate__(self) -> dict[str, object]:
        state = dict(self.__dict__)
        state["_client"] = state["_subscription"] = state["_holder"] = None
        return state

    # -- offsets -------------------------------------------------------------------------------
    def _entry(self, image: Image, position: int) -> dict[str, object]:
        """An offset's entry for ``image``: the position, and what it is a position of (the
        log: initial term id and term length; the holder: host and driver run)."""
        return {"position": int(position), "log": [image.initial_term_id, image.term_length],
                "holder": f"{self._host}/{self._driver}"}

    # -- planning side -------------------------------------------------------------------------
    def _images(self) -> dict[str, Image]:
        """The subscription's images by session id (the subscription is made on first use).
        Raises the client's DriverNotRunningError once the driver stopped or died: a query
        that went on would see no stream, silently, and never the driver's successor."""
        if self._client is not None and self._client.is_closed:
            raise self._client.driver_lost_error()
        if self._subscription is None:
            import time

            self._client = Client.connect(self.options.directory)
            _leave_the_driver_on_sigterm(self)
            try:
                self._subscription = self._client.add_subscription(self.options.channel,
                                                                   self.options.stream_id)
            except BaseException:
                self._client.close()
                self._client = None
                raise
            self._driver = driver_instance(self._client.counters)
            address = holder_address(self.options)
            if address is not None:
                try:
                    self._holder = _Holder(self.options.directory, address,
                                           self.options.replay_port)
                except SlipstreamError as e:  # tasks on other hosts fail, saying so
                    log.warning("slipstream: the query's replay holder cannot listen at %s:%d "
                                "(%s): read tasks on other hosts will fail; set replayPort to "
                                "a free UDP port, or holderAddress to this host's address",
                                address, self.options.replay_port, e)
            deadline = time.monotonic() + _IMAGE_WAIT_S
            while not self._subscription.images and time.monotonic() < deadline:
                time.sleep(0.01)
        subscription = self._subscription
        if subscription._before_read_due:
            # The images of sessions that ended: this (planning) thread is the only one that
            # reads them, and it never polls, so unmap them here or they stay mapped (their
            # files already unlinked) for as long as the query runs.
            subscription._release_retired()
        images = {str(image.session_id): image for image in subscription.images}
        if self._holder is not None:
            self._holder.logs = {image.session_id: (image.log_path, image.join_position)
                                 for image in images.values()}
        return images

    def _default_start(self, image: Image) -> int:
        if self.options.starting_position == "earliest":
            return earliest_position(image)
        return image.position

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
            return {sid: self._entry(image, earliest_position(image))
                    for sid, image in images.items()}
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
                end[sid] = self._entry(image, earliest_position(image))
                continue
            begin = position_of(start[sid])
            available = image.available_position()
            if self._target is not None:
                available = min(available, self._target[sid])
            if available <= begin:
                end[sid] = self._entry(image, begin)
                continue
            if not is_retained(image, begin):
                if self.options.fail_on_data_loss:
                    raise SlipstreamDataLossError(loss_message(
                        image.stream_id, image.session_id, begin, available, None,
                        image.term_length))
                begin = first_retained(image, begin, available)  # the executor counts the skip
            ranges[sid] = (begin, available)
            end[sid] = self._entry(image, available)
        if max_rows is None and max_bytes is None:
            return end
        backlog = {sid: stop - begin for sid, (begin, stop) in ranges.items()}
        row_shares = shares(max_rows, backlog) if max_rows is not None else {}
        byte_shares = shares(max_bytes, backlog) if max_bytes is not None else {}
        for sid, (begin, available) in ranges.items():
            reached, _, _ = self._scan(images[sid], begin, available, row_shares.get(sid),
                                       byte_shares.get(sid))
            end[sid] = self._entry(images[sid], reached)
        return end

    @staticmethod
    def _scan(image: Image, begin: int, available: int, max_rows: int | None,
              max_bytes: int | None) -> tuple[int, int, int]:
        """Find the boundary after at most ``max_rows`` messages / ``max_bytes`` payload bytes
        (at least one message, so a query always progresses); returns (end, rows, bytes)."""
        if max_rows == 0 or max_bytes == 0:
            return begin, 0, 0
        count = size = 0
        last = begin

        def handler(data: memoryview, header: object) -> None:
            nonlocal count, size, last
            if count and ((max_rows is not None and count >= max_rows)
                          or (max_bytes is not None and size + len(data) > max_bytes)):
                raise _Stop
            count += 1
            size += len(data)
            last = header.position  # type: ignore[attr-defined]

        try:
            last = image.peek(begin, handler, available)
        except _Stop:
            pass
        except DataLossError:
            return available, 0, 0  # lapped while scanning: the executor reports it
        return last, count, size

    def reportLatestOffset(self) -> dict[str, int] | None:
        """What is available now (shown in the query's progress)."""
        if self._subscription is None:
            return None
        return {str(image.session_id): image.available_position()
                for image in self._subscription.images}

    def partitions(self, start: dict[str, object], end: dict[str, object]
                   ) -> list[SlipstreamPartition]:
        """One partition per image with something in ``[start, end)``; with ``minPartitions``,
        long ranges are split at message boundaries so that there are about that many, each
        session's count in proportion to its share of the bytes (:func:`split_points`)."""
        images = self._images()
        holder = self._holder.address if self._holder is not None else None
        ranges = {}
        for sid, entry in sorted(end.items()):
            stop = position_of(entry)
            begin = position_of(start.get(sid, entry))
            if stop > begin:
                ranges[sid] = (begin, stop)
        wanted = self.options.min_partitions
        total = sum(stop - begin for begin, stop in ranges.values())
        partitions = []
        for sid, (begin, stop) in ranges.items():
            image = images.get(sid)
            named = log_of(end[sid])
            if image is not None and named is not None and \
                    named != (image.initial_term_id, image.term_length):
                message = (f"slipstream stream {self.options.stream_id} session {sid}: the "
                           f"batch's range [{begin}, {stop}) is of the log with initial term "
                           f"id {named[0]} and term length {named[1]}; this session's log now "
                           f"has {image.initial_term_id} and {image.term_length} (its "
                           f"publisher was added again, with session-id set?)")
                if self.options.fail_on_data_loss:
                    raise SlipstreamDataLossError(message)
                log.warning("%s: skipping the range (failOnDataLoss=false)", message)
                _record_skip(self.options.directory)
                continue
            initial_term_id, term_length = (
                (image.initial_term_id, image.term_length) if image is not None
                else named or (0, 0))
            bounds = [begin, stop]
            if wanted is not None and image is not None and wanted > len(ranges):
                pieces = max(1, round(wanted * (stop - begin) / total))
                bounds = [begin, *split_points(image, begin, stop, pieces), stop]
            for low, high in itertools.pairwise(bounds):
                partitions.append(SlipstreamPartition(
                    int(sid), self.options.stream_id,
                    image.log_path if image is not None else "", low, high,
                    self.options.directory, self.options.fail_on_data_loss, self._host,
                    initial_term_id=initial_term_id, term_length=term_length,
                    driver=self._driver, holder=holder,
                    replay_timeout_ms=self.options.replay_timeout_ms))
        return partitions

    def commit(self, end: dict[str, object]) -> None:
        """Spark processed everything before ``end``: return its credit (see the module
        documentation for why ``latestOffset`` does so too)."""
        for sid, reason in self._consumed(self._images(), end).items():
            # latestOffset(start=end) says what to do about it, in the next batch.
            log.warning("commit: the offset %s of session %s is not a position of its log "
                        "(%s): the subscriber position stays where it is", end[sid], sid, reason)

    @staticmethod
    def _consumed(images: dict[str, Image], offsets: dict[str, object]) -> dict[str, str]:
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
            if named is not None and named != (image.initial_term_id, image.term_length):
                foreign[sid] = (f"the offset is of the log with initial term id {named[0]} and "
                                f"term length {named[1]}; this session's log has "
                                f"{image.initial_term_id} and {image.term_length}")
                continue
            position = position_of(entry)
            if position > image.position:
                try:
                    image.position = position
                except InvalidArgumentError as error:
                    foreign[sid] = str(error)
        return foreign

    def stop(self) -> None:
        """The query ended: leave the driver (the subscription stops holding publishers, the
        holder stops replaying)."""
        holder, self._holder = self._holder, None
        if holder is not None:
            holder.close()
        if self._client is not None:
            self._client.close()
        self._client = self._subscription = None

    # -- executor side -------------------------------------------------------------------------
    def read(self, partition: InputPartition) -> Iterator[object]:  # type: ignore[override]
        """The partition's messages as Arrow record batches (see :func:`read_range`)."""
        assert isinstance(partition, SlipstreamPartition)
        return read_range(partition)
