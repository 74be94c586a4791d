"""What an executor's read task runs: a partition's range of a log, as Arrow record batches.

A :class:`SlipstreamPartition` names one image's range ``[start, end)`` and where its log
lives; :func:`read_range` reads it on the host whose driver holds the log (mapping the log
and peeking the range, never moving the subscriber) or asks the query's holder to replay it
to this host's driver.  Loss (a range the log no longer holds) fails the task with
:class:`SlipstreamDataLossError` or is skipped and counted, as ``failOnDataLoss`` says.  The
planner's side is :mod:`slipstream.spark_bridge.planning`; the whole read:
:mod:`slipstream.spark_bridge.reader`.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import socket
import time
from collections.abc import Iterator
from pathlib import Path

from pyspark.sql.datasource import InputPartition

from slipstream.archive.client import ArchiveClient
from slipstream.archive.holding import driver_instance
from slipstream.archive.locate import Endpoint, LostRange, read_session
from slipstream.archive.reading import RecordingLostError
from slipstream.client import (
    DataLossError,
    GatheredMessages,
    Image,
    SlipstreamError,
    control,
    default_directory,
)
from slipstream.client.counters import CountersFile, SystemCounter
from slipstream.client.layout import RESERVED_VALUE_TIME_MASK
from slipstream.client.logbuffer import LogIdentity
from slipstream.client.retention import first_retained, message_start
from slipstream.spark_bridge.archived import (
    ArchivedSource,
    archive_client_for,
    forget_archive_client,
)
from slipstream.spark_bridge.envelope import MalformedEnvelopeError, decode_batch, headers_type
from slipstream.spark_bridge.runtime import client_for

__all__ = ["HEADERS_COLUMN", "SCHEMA", "SlipstreamDataLossError", "SlipstreamPartition",
           "loss_message", "read_range", "schema_text"]

log = logging.getLogger("slipstream.spark_bridge")

SCHEMA = ("value binary, session_id int, stream_id int, position long, timestamp timestamp, "
          "timestampType int, key binary")
"""The columns of a slipstream stream read (the Kafka connector's conventions):

* ``value``: the message (an enveloped message's value, after its key and headers).
* ``session_id``, ``stream_id``: the publication session (image) and the stream.
* ``position``: the stream position just after the message (Aeron's ``Header.position``):
  unique and increasing within a session; the offset a query resumes from after it.
* ``timestamp``: the publisher's time, from the frame's reserved value (ns since the epoch:
  the slipstream writer sets it); for a reserved value of 0, when the executor read it.
* ``timestampType``: 0 (Kafka's CreateTime) where ``timestamp`` is the publisher's stamp, -1
  (Kafka's NO_TIMESTAMP_TYPE) where it is the read time.
* ``key``: an enveloped message's key (:mod:`~slipstream.spark_bridge.envelope`), else null.

With ``includeHeaders=true``, :data:`HEADERS_COLUMN` follows.
"""

HEADERS_COLUMN = "headers array<struct<key: string, value: binary>>"
"""An enveloped message's headers (Kafka's type and name); null for a message without."""

_HEADERS_INDEX = 7  # the headers column's index in the read schema, when it has one

#: ``timestampType`` values (Kafka's TimestampType ids).
CREATE_TIME = 0
NO_TIMESTAMP_TYPE = -1


def schema_text(include_headers: bool) -> str:
    """The read schema, with the ``headers`` column or without."""
    return f"{SCHEMA}, {HEADERS_COLUMN}" if include_headers else SCHEMA

_ROWS_PER_BATCH = 4096  # rows per Arrow record batch leaving read(): one C scan's most


class SlipstreamDataLossError(SlipstreamError):
    """Positions a query must read are no longer in the log (failOnDataLoss=true)."""


class SlipstreamPartition(InputPartition):
    """One image's range ``[start, end)`` of one micro-batch, read by one task (picklable).

    It names what it reads: the log (``log``, its identity; None when the session's log was
    gone when the batch was planned), where it lives (``log_path`` on the host ``host``
    whose driver is ``driver``, ``pid@start_time_ns`` of that driver) and the holder that
    replays it to tasks on other hosts (``holder``: address, port, control stream id; None
    when the holder has no address other hosts reach); ``held``, when the holder is an
    archive that holds the stream for the query's group, the key it holds it by (channel,
    stream id, group: its replay call names it).  A range read from an archive's recording
    names it instead (``archived``, :class:`~slipstream.spark_bridge.archived.
    ArchivedSource`), and ``log_path`` is empty.
    """

    def __init__(self, session_id: int, stream_id: int, log_path: str, start: int, end: int,
                 directory: str | None, fail_on_data_loss: bool, host: str, *,
                 log: LogIdentity | None, driver: str | None,
                 holder: tuple[str, int, int] | None, replay_timeout_ms: int,
                 archived: ArchivedSource | None = None,
                 held: dict[str, object] | None = None,
                 include_headers: bool = False, call_key: str | None = None) -> None:
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
        self.archived = archived
        self.held = held
        self.include_headers = include_headers  # the reader's includeHeaders
        #: The key the calls to the holder or archives are sealed under (None: plain).
        self.call_key = call_key

    def __repr__(self) -> str:
        source = "" if self.archived is None else \
            f", archived recording {self.archived.recording_id}"
        return (f"SlipstreamPartition(stream={self.stream_id}, session={self.session_id}, "
                f"[{self.start}, {self.end}){source})")


def local_driver_instance(directory: str | None) -> str | None:
    """:func:`driver_instance` of the driver in this host's ``directory`` (None: the client
    default), or None when there is none."""
    path = (Path(directory) if directory else default_directory()) / control.COUNTERS_FILE
    try:
        counters = CountersFile(path)
    except (OSError, ValueError):
        return None
    try:
        return driver_instance(counters)
    finally:
        counters.close()


def _record_skip(directory: str | None) -> None:
    """Add one to the driver's ``data loss skips`` counter (best effort)."""
    try:
        path = Path(directory) if directory else default_directory()
        counters = CountersFile(path / control.COUNTERS_FILE)
        try:
            counters.add(SystemCounter.DATA_LOSS_SKIPS)
        finally:
            counters.close()
    except (OSError, ValueError, ImportError) as e:  # the warning is logged anyway
        log.warning("could not count a data loss skip in %s: %s", directory, e)


def loss_message(stream_id: int, session_id: int, start: int, end: int,
                 producer: int | None, term_length: int | None, *, why: str | None = None
                 ) -> str:
    """The text of a data loss error: which stream, session and positions, why, and what to
    do.  ``why`` None: the log was cleaned past ``start`` (``term_length``: the log's), or
    (``term_length`` None too) the log itself is gone."""
    at = f" (the publisher is at {producer})" if producer is not None else ""
    if why is None:
        why = (f"a log holds one term ({term_length} bytes) behind its slowest reading "
               f"subscriber, and this query fell further behind"
               if term_length is not None else
               "the log is gone: its stream ended and the subscribers it had read it all, or "
               "its driver stopped, while this query was stopped")
    return (f"slipstream stream {stream_id} session {session_id}: the messages at positions "
            f"[{start}, {end}) are no longer in the log{at}; {why}.  Set failOnDataLoss=false "
            f"to skip to the oldest position still held (counted in the driver's 'data loss "
            f"skips' counter).")


def _arrow_batch(chunk: GatheredMessages, session_id: int, stream_id: int,
                 schema: object, ids: dict[int, tuple[object, ...]] | None = None) -> object:
    """One record batch of ``schema`` (:func:`_schema`) from messages copied out of the log:
    the values and position columns wrap the chunk's buffers, the others are computed for the
    whole batch at once (no Python per message).  ``timestamp`` is the reserved value's time
    stamp (ns since the epoch: the slipstream writer stamps it), or the read time where that
    is 0, as ``timestampType`` says.  Messages whose reserved value marks an envelope are
    decoded together (:func:`~slipstream.spark_bridge.envelope.decode_batch`) into their key,
    headers and value; one that does not decode fails the batch with
    :class:`MalformedEnvelopeError`.  ``ids``: the columns that are the same for every row of
    a full batch (a shorter one takes slices of them), kept by the caller across the batches
    of one range."""
    import numpy as np
    import pyarrow as pa

    headers = len(schema) > _HEADERS_INDEX  # type: ignore[arg-type]
    n = len(chunk)
    size = max(n, _ROWS_PER_BATCH) if ids is not None else n
    constant = ids.get(size) if ids is not None else None
    if constant is None:
        constant = (pa.array(np.full(size, session_id, dtype=np.int32)),
                    pa.array(np.full(size, stream_id, dtype=np.int32)),
                    pa.array(np.full(size, CREATE_TIME, dtype=np.int32)),
                    pa.array(np.full(size, NO_TIMESTAMP_TYPE, dtype=np.int32)),
                    pa.nulls(size, pa.binary()),
                    pa.nulls(size, schema.field(_HEADERS_INDEX).type)  # type: ignore[attr-defined]
                    if headers else None)
        if ids is not None:
            ids[size] = constant
    if n < size:  # a shorter batch: zero-copy slices of the full batch's columns
        constant = tuple(c.slice(0, n) if c is not None else None  # type: ignore[attr-defined]
                         for c in constant)
    session_ids, stream_ids, created, unstamped, keys, no_headers = constant
    reserved = np.frombuffer(chunk.reserved_values, dtype=np.int64)
    values = pa.Array.from_buffers(pa.binary(), n, [None, pa.py_buffer(chunk.offsets),
                                                    pa.py_buffer(chunk.data)])
    header_column = no_headers
    lowest = reserved.min()
    if lowest >= 1000:  # every message stamped (ns) and none enveloped: its time in us
        published = reserved // 1000
        kinds = created
    elif lowest >= 0 and reserved.max() < 1000:  # none stamped, none enveloped
        now = int(datetime.datetime.now(datetime.UTC).timestamp() * 1_000_000)
        published = np.full(n, now, dtype=np.int64)
        kinds = unstamped
    else:
        if lowest < 0:  # envelopes among them
            enveloped = reserved < 0
            decoded = decode_batch(chunk.data, np.frombuffer(chunk.offsets, dtype=np.int32),
                                   enveloped, with_headers=headers)
            if decoded.malformed:
                row, why = decoded.malformed[0]
                raise MalformedEnvelopeError(
                    f"slipstream stream {stream_id} session {session_id}: the message ending "
                    f"at position {chunk.positions[row]} is marked as enveloped (its reserved "
                    f"value's top bit) but {why}; {len(decoded.malformed)} of the "
                    f"{n} messages read with it do not decode (docs/SPARK.md, Keys and "
                    f"headers)")
            values, keys = decoded.values, decoded.keys
            if headers:
                header_column = decoded.headers
            reserved = reserved & RESERVED_VALUE_TIME_MASK
        stamped = reserved >= 1000
        now = int(datetime.datetime.now(datetime.UTC).timestamp() * 1_000_000)
        published = np.where(stamped, reserved // 1000, now)
        kinds = pa.array(np.where(stamped, CREATE_TIME, NO_TIMESTAMP_TYPE).astype(np.int32))
    columns = [
        values,
        session_ids,
        stream_ids,
        pa.Array.from_buffers(pa.int64(), n, [None, pa.py_buffer(chunk.positions)]),
        pa.Array.from_buffers(schema.field(4).type, n,  # type: ignore[attr-defined]
                              [None, pa.py_buffer(published)]),
        kinds,
        keys,
    ]
    if headers:
        columns.append(header_column)
    return pa.RecordBatch.from_arrays(columns, schema=schema)


def _schema(include_headers: bool = False) -> object:
    """:data:`SCHEMA` as Arrow (with :data:`HEADERS_COLUMN` when ``include_headers``)."""
    import pyarrow as pa

    fields = [("value", pa.binary()), ("session_id", pa.int32()),
              ("stream_id", pa.int32()), ("position", pa.int64()),
              ("timestamp", pa.timestamp("us", tz="UTC")), ("timestampType", pa.int32()),
              ("key", pa.binary())]
    if include_headers:
        fields.append(("headers", headers_type()))
    return pa.schema(fields)


def read_range(partition: SlipstreamPartition) -> Iterator[object]:
    """Executor side: the rows of ``partition`` as Arrow record batches, in stream order.

    On the host whose driver holds the log (the same driver run as the planner's), the task
    maps the log and peeks the range; anywhere else it asks the holder for a replay through
    its own host's driver (:func:`_read_replayed`).  Loss follows ``fail_on_data_loss``.
    """
    p = partition
    if p.archived is not None:
        return _read_archived(p)
    if p.driver is not None and local_driver_instance(p.directory) == p.driver:
        return _read_local(p)
    return _read_replayed(p)


def _read_archived(p: SlipstreamPartition) -> Iterator[object]:
    """The range from the archives (:func:`~slipstream.archive.locate.read_session`): in
    place where this host's ``archiveDir`` holds it, else replayed here by the partition's
    archive, then by the next ones for what is left.  What no archive holds (retention
    removed it after planning; a message across the seam of two recordings that none holds
    whole) is loss, as ``failOnDataLoss`` says, naming its range."""
    assert p.archived is not None
    source = p.archived
    timeout_s = p.replay_timeout_ms / 1000
    schema = _schema(p.include_headers)
    ids: dict[int, tuple[object, object]] = {}

    def link(endpoint: Endpoint) -> ArchiveClient:
        return archive_client_for(client_for(p.directory), p.directory, endpoint,
                                  timeout_s, p.call_key)

    def lost(gone: LostRange) -> None:
        message = loss_message(p.stream_id, p.session_id, gone.start, gone.end, None, None,
                               why=f"they {gone.why}")
        if p.fail_on_data_loss:
            raise SlipstreamDataLossError(message)
        log.warning("%s Skipping to %d (failOnDataLoss=false).", message, gone.end)
        _record_skip(p.directory)

    # Closed with the task's iterator (a cancelled task): the replay stops then, not when
    # the garbage collector finds the reader.
    with contextlib.closing(read_session(
            source.archives, p.stream_id, p.session_id, source.framing, p.start, p.end,
            link=link, forget=lambda endpoint: forget_archive_client(p.directory, endpoint,
                                                                   p.call_key),
            directory=source.directory, prefer=(source.archive, source.recording_id),
            on_loss=lost, timeout_s=timeout_s, max_messages=_ROWS_PER_BATCH)) as chunks:
        for chunk in chunks:
            yield _arrow_batch(chunk, p.session_id, p.stream_id, schema, ids)


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
    schema = _schema(p.include_headers)
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
    """The range replayed to this host's driver by the holder: an ingest host's archive,
    or the query's own replay server (:func:`_read_held`)."""
    here = socket.gethostname()
    if p.holder is None or p.held is None:
        raise SlipstreamError(
            f"slipstream stream {p.stream_id} session {p.session_id}: this read task runs on "
            f"{here}, whose slipstream driver does not hold the log (it is on {p.host}), and "
            f"the query's holder has no address other hosts reach (its host name resolves to "
            f"a loopback address): set the reader's holderAddress option to the address of "
            f"{p.host} that the executors reach (docs/SPARK.md)")
    if p.log is None:  # the session's image was gone when the batch was planned
        _no_log(p, f"no log of this session at the holder on {p.host}")
        return
    yield from _read_held(p)


def _read_held(p: SlipstreamPartition) -> Iterator[object]:
    """The range replayed from the live log by the holder (the ``replay`` call with
    ``held`` on its control stream: :mod:`slipstream.archive.control`), to this host's
    driver: the same messages, positions and reserved values.  What the log no longer holds
    is loss, as ``failOnDataLoss`` says; a replay that ends early is asked again from where
    it ended (the holder then says whether the log lost the rest)."""
    assert p.log is not None and p.holder is not None and p.held is not None
    timeout_s = p.replay_timeout_ms / 1000
    term_length = p.log.term_length
    link = archive_client_for(client_for(p.directory), p.directory, p.holder,
                              timeout_s, p.call_key)
    schema = _schema(p.include_headers)
    ids: dict[int, tuple[object, object]] = {}
    position = p.start
    early_ends = 0
    while position < p.end:
        try:
            replay = link.replay_held(p.held, p.session_id, p.log.framing, position, p.end)
        except RecordingLostError as e:
            skip_to = max(position, e.held[0])
            message = loss_message(p.stream_id, p.session_id, position, skip_to, None,
                                   term_length) + f" (at the holder on {p.host}: {e})"
            if p.fail_on_data_loss or skip_to <= position:
                raise SlipstreamDataLossError(message) from None
            log.warning("%s Skipping to %d (failOnDataLoss=false).", message, skip_to)
            _record_skip(p.directory)
            position = skip_to
            continue
        with replay:
            idle_since = time.monotonic()
            while not replay.done:
                try:
                    chunk = replay.poll_gathered(_ROWS_PER_BATCH)
                except SlipstreamError:
                    # Ended early: asked again from there, the archive says why (lost, or
                    # refused); twice with no progress is the error.
                    early_ends = 0 if replay.position > position else early_ends + 1
                    if early_ends > 1:
                        raise
                    break
                if chunk is not None:
                    yield _arrow_batch(chunk, p.session_id, p.stream_id, schema, ids)
                    idle_since = time.monotonic()
                elif time.monotonic() - idle_since > timeout_s:
                    raise SlipstreamError(
                        f"slipstream stream {p.stream_id} session {p.session_id}: the "
                        f"replay of [{position}, {p.end}) from the holder on {p.host} sent "
                        f"nothing for {timeout_s:g} s, at position {replay.position} (this "
                        f"host's driver log says why when it refused the replay: a term "
                        f"length of {term_length} over its image_term_buffer_length_max, "
                        f"for one)")
                else:
                    replay.wait(0.01)
            position = max(position, replay.position)
