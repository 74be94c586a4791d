"""Reading: a streaming reader whose offsets are stream positions, with credit held until commit.

Two sides, two kinds of process:

* The **planning side** (:class:`SlipstreamStreamReader` in Spark's streaming-source runner, a
  Python process beside the Spark driver) holds a client and a subscription.  Offsets are JSON
  maps ``{"<session_id>": position}``, one entry per image (publication session).
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
* The **executor side** (:meth:`SlipstreamStreamReader.read` in a Python worker) maps the same
  log with :meth:`Image.detached` and reads its range ``[start, end)`` with
  :meth:`Image.peek`, which never moves the subscriber, so a failed task can simply read the
  range again.  Rows leave as Arrow record batches.

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
import logging
import os
import signal
import socket
import threading
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
    Image,
    InvalidArgumentError,
    SlipstreamError,
    Subscription,
)
from slipstream.client.layout import DATA_HEADER, FRAME_ALIGNMENT, PARTITION_COUNT
from slipstream.client.logbuffer import LogBuffer, compute_term_id, index_by_position
from slipstream.spark_bridge.options import SourceOptions

__all__ = ["SCHEMA", "SlipstreamDataLossError", "SlipstreamPartition", "SlipstreamStreamReader"]

log = logging.getLogger("slipstream.spark_bridge")

SCHEMA = "value binary, session_id int, stream_id int, position long, timestamp timestamp"
"""The columns of a slipstream stream read (the Kafka connector's conventions):

* ``value``: the message.
* ``session_id``, ``stream_id``: the publication session (image) and the stream.
* ``position``: the stream position just after the message (Aeron's ``Header.position``):
  unique and increasing within a session; the offset a query resumes from after it.
* ``timestamp``: when the executor read the message (logs carry no time of their own).
"""

_ROWS_PER_BATCH = 16384  # rows per Arrow record batch leaving read()
_IMAGE_WAIT_S = 0.5  # how long a new subscription waits for its images to show up


class SlipstreamDataLossError(SlipstreamError):
    """Positions a query must read are no longer in the log (failOnDataLoss=true)."""


class _Stop(Exception):
    """Raised from a peek handler to end a scan after a whole message."""


class SlipstreamPartition(InputPartition):
    """One image's range ``[start, end)`` of one micro-batch, read by one task (picklable)."""

    def __init__(self, session_id: int, stream_id: int, log_path: str, start: int, end: int,
                 directory: str | None, fail_on_data_loss: bool, host: str) -> None:
        super().__init__(None)
        self.session_id = session_id
        self.stream_id = stream_id
        self.log_path = log_path
        self.start = start
        self.end = end
        self.directory = directory
        self.fail_on_data_loss = fail_on_data_loss
        self.host = host

    def __repr__(self) -> str:
        return (f"SlipstreamPartition(stream={self.stream_id}, session={self.session_id}, "
                f"[{self.start}, {self.end}))")


def _noop(data: memoryview, header: object) -> None:
    """A peek handler for checks only."""


def _leave_the_driver_on_sigterm(reader: SlipstreamStreamReader) -> None:
    """Close ``reader``'s client when this process gets SIGTERM, then end as SIGTERM would.

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
            if reader._client is not None:
                reader._client.close()
        finally:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    signal.signal(signal.SIGTERM, leave)


def is_retained(image: Image, position: int) -> bool:
    """Whether the log still holds the message boundary ``position`` (a peek of nothing)."""
    try:
        image.peek(position, _noop, position)
    except DataLossError:
        return False
    return True


def _first_frame_in_term(image: Image, log: LogBuffer, start: int, end: int) -> int | None:
    """The first frame boundary in ``[start, end)`` within ``start``'s term that the log still
    holds, found by its header (length, term offset, session, stream and term id all match),
    or None.  The driver cleans one term behind the slowest subscriber from an arbitrary
    position, so what survives of a term begins anywhere, not at its start."""
    term = image.term_length
    term_start = start - start % term
    view = log.term_view(index_by_position(start, log.position_bits))
    term_id = compute_term_id(start, log.position_bits, log.initial_term_id)
    stop = min(term, end - term_start)
    for offset in range(start % term, stop, FRAME_ALIGNMENT):
        length, _, _, _, frame_offset, session, stream, frame_term, _ = \
            DATA_HEADER.unpack_from(view, offset)
        if (length > 0 and frame_offset == offset and frame_term == term_id
                and session == image.session_id and stream == image.stream_id
                and is_retained(image, term_start + offset)):
            return term_start + offset
    return None


def first_retained(image: Image, start: int, end: int) -> int:
    """The first message position after ``start``, at most ``end``, that the log still holds.

    Term starts are tried first (every term begins with a frame; a reader starting inside a
    fragmented message skips its remaining fragments); within the term where cleaning
    stopped, the first intact frame header; finally ``end`` itself.
    """
    term = image.term_length
    log = LogBuffer(image.log_path, writable=False, populate=False)
    try:
        position = start + FRAME_ALIGNMENT  # the first frame boundary that can follow start
        while position < end:
            term_start = position - position % term
            if term_start > start and is_retained(image, term_start):
                return term_start
            found = _first_frame_in_term(image, log, position, end)
            if found is not None:
                return found
            position = term_start + term
    finally:
        log.close()
    return end


def earliest_position(image: Image) -> int:
    """The oldest message position the log still holds (at most ~3 terms back), at most the
    image's position.  Messages before the join position are not protected by this query's
    credit: ``earliest`` takes what is there when the query starts."""
    term = image.term_length
    lowest = max(0, (image.available_position() // term - (PARTITION_COUNT - 1)) * term)
    return first_retained(image, lowest - FRAME_ALIGNMENT, image.position)


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


def _arrow_batch(values: list[bytes], positions: list[int], session_id: int, stream_id: int,
                 schema: object) -> object:
    import numpy as np
    import pyarrow as pa

    n = len(values)
    now = int(datetime.datetime.now(datetime.UTC).timestamp() * 1_000_000)
    columns = [
        pa.array(values, type=pa.binary()),
        pa.array(np.full(n, session_id, dtype=np.int32)),
        pa.array(np.full(n, stream_id, dtype=np.int32)),
        pa.array(positions, type=pa.int64()),
        pa.array(np.full(n, now, dtype=np.int64)).view(pa.timestamp("us", tz="UTC")),
    ]
    return pa.RecordBatch.from_arrays(columns, schema=schema)


def read_range(partition: SlipstreamPartition) -> Iterator[object]:
    """Executor side: the rows of ``partition`` as Arrow record batches, in stream order.

    Each chunk is checked after it is read (a publisher lapping the reader meanwhile would
    have torn it); loss follows ``fail_on_data_loss``.
    """
    import pyarrow as pa

    schema = pa.schema([("value", pa.binary()), ("session_id", pa.int32()),
                        ("stream_id", pa.int32()), ("position", pa.int64()),
                        ("timestamp", pa.timestamp("us", tz="UTC"))])  # SCHEMA, as Arrow
    p = partition
    try:
        image = Image.detached(p.log_path, p.start)
    except FileNotFoundError:
        here = socket.gethostname()
        where = ("" if here == p.host else
                 f"; this executor runs on {here} but the log is in the shared memory of {p.host}:"
                 f" read tasks must run on the host of the Spark driver (docs/SPARK.md)")
        if p.fail_on_data_loss or here != p.host:
            raise SlipstreamDataLossError(
                loss_message(p.stream_id, p.session_id, p.start, p.end, None, None)
                + f" (the log file {p.log_path} is gone{where})") from None
        log.warning("slipstream: log %s is gone; skipping [%d, %d)", p.log_path, p.start, p.end)
        _record_skip(p.directory)
        return
    position = p.start
    values: list[bytes] = []
    positions: list[int] = []

    def handler(data: memoryview, header: object) -> None:
        values.append(bytes(data))
        positions.append(header.position)  # type: ignore[attr-defined]
        if len(values) >= _ROWS_PER_BATCH:
            raise _Stop

    while position < p.end:
        values.clear()
        positions.clear()
        try:
            try:
                reached = image.peek(position, handler, p.end)
            except _Stop:
                reached = positions[-1]
                image.peek(position, _noop, position)  # still held after the read: not torn
        except DataLossError as e:
            message = loss_message(p.stream_id, p.session_id, position, p.end,
                                   e.producer_position, image.term_length)
            if p.fail_on_data_loss:
                raise SlipstreamDataLossError(message) from None
            skip_to = first_retained(image, position, p.end)
            log.warning("%s Skipping to %d (failOnDataLoss=false).", message, skip_to)
            _record_skip(p.directory)
            position = skip_to
            continue
        if values:
            yield _arrow_batch(values, positions, p.session_id, p.stream_id, schema)
        if reached <= position:
            raise SlipstreamError(
                f"slipstream stream {p.stream_id} session {p.session_id}: no whole message at "
                f"position {position} before {p.end}; the offsets do not match this log")
        position = reached


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

    def __getstate__(self) -> dict[str, object]:
        state = dict(self.__dict__)
        state["_client"] = state["_subscription"] = None
        return state

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
            deadline = time.monotonic() + _IMAGE_WAIT_S
            while not self._subscription.images and time.monotonic() < deadline:
                time.sleep(0.01)
        subscription = self._subscription
        if subscription._before_read_due:
            # The images of sessions that ended: this (planning) thread is the only one that
            # reads them, and it never polls, so unmap them here or they stay mapped (their
            # files already unlinked) for as long as the query runs.
            subscription._release_retired()
        return {str(image.session_id): image for image in subscription.images}

    def _default_start(self, image: Image) -> int:
        if self.options.starting_position == "earliest":
            return earliest_position(image)
        return image.position

    def initialOffset(self) -> dict[str, int]:
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
            return {sid: earliest_position(image) for sid, image in images.items()}
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
        """Trigger.AvailableNow: read up to what is available now, nothing later."""
        self._target = {sid: image.available_position() for sid, image in self._images().items()}

    def latestOffset(self, start: dict[str, int], limit: ReadLimit) -> dict[str, int]:
        """The end of the next micro-batch: per image, the last whole ready message, capped by
        the read limit (message and byte budgets are shared by all images, in order).

        A session not in ``start`` enters at its starting position without being read in
        this batch, so that its start is recorded in the offset log and replays read the same
        range.  Sessions whose image is gone are dropped.
        """
        images = self._images()
        # Batches before start ran and are in the commit log.
        foreign = self._consumed(images, start)
        for sid, reason in foreign.items():
            image = images[sid]
            message = (f"the checkpoint's offset {start[sid]} for session {sid} of stream "
                       f"{image.stream_id} is not a position of that session's log ({reason}): "
                       f"the offsets were taken from another log with this session id (its "
                       f"publisher was added again, with session-id set?)")
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
        end: dict[str, int] = {}
        for sid, image in sorted(images.items()):
            if sid not in start:
                end[sid] = self._default_start(image)
                continue
            if sid in foreign:  # enters afresh, read from the next batch on
                end[sid] = earliest_position(image)
                continue
            begin = int(start[sid])
            available = image.available_position()
            if self._target is not None and sid in self._target:
                available = min(available, self._target[sid])
            if available <= begin:
                end[sid] = begin
                continue
            if not is_retained(image, begin):
                if self.options.fail_on_data_loss:
                    raise SlipstreamDataLossError(loss_message(
                        image.stream_id, image.session_id, begin, available, None,
                        image.term_length))
                begin = first_retained(image, begin, available)  # the executor counts the skip
            if max_rows is None and max_bytes is None:
                end[sid] = available
                continue
            reached, rows, size = self._scan(image, begin, available, max_rows, max_bytes)
            end[sid] = reached
            if max_rows is not None:
                max_rows = max(0, max_rows - rows)
            if max_bytes is not None:
                max_bytes = max(0, max_bytes - size)
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

    def partitions(self, start: dict[str, int], end: dict[str, int]
                   ) -> list[SlipstreamPartition]:
        """One partition per image with something in ``[start, end)``."""
        images = self._images()
        partitions = []
        for sid, stop in sorted(end.items()):
            begin = int(start.get(sid, stop))
            if stop <= begin:
                continue
            image = images.get(sid)
            log_path = image.log_path if image is not None else ""
            partitions.append(SlipstreamPartition(
                int(sid), self.options.stream_id, log_path, begin, int(stop),
                self.options.directory, self.options.fail_on_data_loss, self._host))
        return partitions

    def commit(self, end: dict[str, int]) -> None:
        """Spark processed everything before ``end``: return its credit (see the module
        documentation for why ``latestOffset`` does so too)."""
        for sid, reason in self._consumed(self._images(), end).items():
            # latestOffset(start=end) says what to do about it, in the next batch.
            log.warning("commit: the offset %s of session %s is not a position of its log "
                        "(%s): the subscriber position stays where it is", end[sid], sid, reason)

    @staticmethod
    def _consumed(images: dict[str, Image], offsets: dict[str, int]) -> dict[str, str]:
        """The query is done with everything before ``offsets``: move each image's subscriber
        position there (never backwards), returning the credit to the publishers.

        Returns, per session whose offset is no position of its image's log (beyond what the
        log holds, or where no message begins), why; those images are left where they are.
        """
        foreign: dict[str, str] = {}
        for sid, position in offsets.items():
            image = images.get(sid)
            if image is not None and int(position) > image.position:
                try:
                    image.position = int(position)
                except InvalidArgumentError as error:
                    foreign[sid] = str(error)
        return foreign

    def stop(self) -> None:
        """The query ended: leave the driver (the subscription stops holding publishers)."""
        if self._client is not None:
            self._client.close()
        self._client = self._subscription = None

    # -- executor side -------------------------------------------------------------------------
    def read(self, partition: InputPartition) -> Iterator[object]:  # type: ignore[override]
        """The partition's messages as Arrow record batches (see :func:`read_range`)."""
        assert isinstance(partition, SlipstreamPartition)
        return read_range(partition)
