"""Writing: each executor task publishes its rows through its host's driver, one message a row.

The columns (:func:`check_schema`, docs/SPARK.md): ``value`` (binary or string) is the
message; ``key`` (binary or string) and ``headers`` (``array<struct<key: string, value:
binary>>``, Kafka's): a row with either (not null) travels as an envelope
(:mod:`~slipstream.spark_bridge.envelope`), marked in the reserved value; a row with neither
is a plain message, as any Aeron publisher writes.  ``stream_id`` (int), when the frame has
it and the ``streamId`` option is not set, routes each row to that stream on the channel
(the option, when set, sends every row to its stream, as Kafka's ``topic`` option
overrides its column).  The read schema's other columns, which a query that passes rows through
carries, are assigned by the stream and ignored; any other column is refused by name.

Rows reach the writer as Arrow record batches.  The ``value`` column's data buffer already
holds the messages back to back and its offsets give their lengths, so a batch goes to
:meth:`Publication.offer_batch` without a copy per row.  ``offer_batch`` appends a prefix of
the batch when the publication limit is reached; the rest is offered again after a short
wait.  Back pressure (the slowest subscriber a window behind) and "no subscriber yet" make the
task wait; when no message could be appended for ``offerTimeoutMs`` the task fails with
:class:`OfferTimeoutError`.  Nothing is ever dropped.

Each message's reserved value (``header.reserved_value`` to a subscriber) is its publish time:
wall-clock nanoseconds since the Unix epoch (``time.time_ns()`` on the executor's host), read
once per ``offer_batch`` call just before it, so never later than the moment the message
became visible in the log.  The rows one call appends (up to 8,192 consecutive rows of one
Arrow record batch) share that time; rows a back-pressured call did not append are stamped
again when they are offered again.  An enveloped message's reserved value also has its top
bit set (:data:`~slipstream.client.layout.RESERVED_VALUE_ENVELOPE_BIT`).  A reader turns
the time into a ``timestamp`` column (``(reserved_value & RESERVED_VALUE_TIME_MASK) //
1000`` microseconds, UTC); a message from a publisher that sets no reserved value carries 0.

With ``durable=TAG/N`` on the channel (docs/CHANNELS.md §7.7), a task returns its commit
message only once its last message is durable: held by N receivers subscribed with
``gtag=TAG`` (archives on other hosts), as their status messages report.  It waits up to
``durableTimeoutMs`` (30 s; 0: it does not wait) after its last offer, then fails with
:class:`DurableTimeoutError`, saying whether tagged receivers were missing or behind, so that
Spark retries it; ``durableTimeoutMs`` without ``durable=`` is refused by name.

Guarantee: at least once.  A task that fails and is retried, or a streaming batch replayed after
a restart, publishes its rows again (as Spark's Kafka sink does), stamped with the new time.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from pyspark.sql.datasource import (
    DataSourceArrowWriter,
    DataSourceStreamArrowWriter,
    WriterCommitMessage,
)
from pyspark.sql.types import ArrayType, BinaryType, IntegerType, StringType, StructType

from slipstream.client import (
    ADMIN_ACTION,
    BACK_PRESSURED,
    CLOSED,
    NOT_CONNECTED,
    Publication,
    SlipstreamError,
    result_name,
)
from slipstream.client.errors import UsageError
from slipstream.client.layout import RESERVED_VALUE_ENVELOPE_BIT
from slipstream.spark_bridge.envelope import encode_column
from slipstream.spark_bridge.options import OptionError, SourceOptions
from slipstream.spark_bridge.runtime import publication_for

if TYPE_CHECKING:  # pyarrow (and numpy) cost half a second: imported where a batch is written
    import numpy as np
    import pyarrow as pa

__all__ = ["IGNORED_COLUMNS", "WRITTEN_COLUMNS", "ColumnError", "DurableTimeoutError",
           "OfferTimeoutError", "SlipstreamStreamWriter", "SlipstreamWriter", "ValueColumnError",
           "check_schema", "wait_until_durable"]

#: The columns a writer writes.
WRITTEN_COLUMNS = ("value", "key", "headers", "stream_id")
#: Columns of the read schema that the stream assigns each message itself (its session,
#: position, publish time): a query that passes read rows through carries them, and the
#: writer ignores them.
IGNORED_COLUMNS = ("session_id", "position", "timestamp", "timestampType")
# Kafka's writer columns that slipstream names otherwise: the refusal says what to use.
_KAFKA_COLUMNS = {
    "topic": "slipstream routes rows by an int 'stream_id' column (or the streamId option)",
    "partition": "a slipstream publication is one session; route by 'stream_id' instead",
}

_CHUNK = 8192  # messages per offer_batch call


class OfferTimeoutError(SlipstreamError):
    """No message could be appended for ``offerTimeoutMs``: back pressure or no subscriber."""


class DurableTimeoutError(SlipstreamError):
    """A task's last message was not durable within ``durableTimeoutMs``."""


@dataclasses.dataclass
class PublishedMessage(WriterCommitMessage):
    """What one task published (picklable, reaches the Spark driver's commit)."""

    rows: int
    bytes: int
    session_id: int  # of the first stream published to (the streamId option's, unrouted)
    last_position: int
    #: Per stream published to: (session id, last position).
    streams: dict[int, tuple[int, int]] = dataclasses.field(default_factory=dict)


class ColumnError(UsageError, ValueError):
    """A column of the DataFrame written is one the writer does not write, or of a type it
    does not take: raised by ``save()`` / ``start()``, before any task runs, naming it."""


class ValueColumnError(ColumnError):
    """The DataFrame written has no ``value`` column, or one that is not binary or string."""

    @classmethod
    def missing(cls, columns: list[str]) -> ValueColumnError:
        return cls(f"slipstream writer: the DataFrame has no 'value' column (columns: "
                   f"{', '.join(columns)}); select or alias one")

    @classmethod
    def of_type(cls, kind: object) -> ValueColumnError:
        return cls(f"slipstream writer: the 'value' column is {kind}; it must be binary or "
                   f"string (cast it: col('value').cast('binary'))")


def check_schema(schema: StructType, options: SourceOptions | None = None) -> None:
    """Raise :class:`ColumnError` naming the first column the writer would not write
    (module doc), or whose type it does not take; :class:`ValueColumnError` unless there is
    a binary or string ``value``; :class:`OptionError` for a frame without ``stream_id``
    when ``options`` has no ``streamId``."""
    if "value" not in schema.names:
        raise ValueColumnError.missing(schema.names)
    kind = schema["value"].dataType
    if not isinstance(kind, BinaryType | StringType):
        raise ValueColumnError.of_type(kind.simpleString())
    for field in schema.fields:
        name, kind = field.name, field.dataType
        if name in ("value", *IGNORED_COLUMNS):
            continue
        if name == "key":
            if not isinstance(kind, BinaryType | StringType):
                raise ColumnError(f"slipstream writer: the 'key' column is "
                                  f"{kind.simpleString()}; it must be binary or string")
        elif name == "headers":
            entry = kind.elementType if isinstance(kind, ArrayType) else None
            if not (isinstance(entry, StructType) and entry.names == ["key", "value"]
                    and isinstance(entry["key"].dataType, StringType)
                    and isinstance(entry["value"].dataType, BinaryType)):
                raise ColumnError(f"slipstream writer: the 'headers' column is "
                                  f"{kind.simpleString()}; it must be "
                                  f"array<struct<key:string,value:binary>> (Kafka's)")
        elif name == "stream_id":
            if not isinstance(kind, IntegerType):
                raise ColumnError(f"slipstream writer: the 'stream_id' column is "
                                  f"{kind.simpleString()}; it must be int (cast it: "
                                  f"col('stream_id').cast('int'))")
        else:
            hint = _KAFKA_COLUMNS.get(name.lower(), "drop it or select the columns to write")
            raise ColumnError(f"slipstream writer: the DataFrame's column {name!r} would not "
                              f"be written ({hint}); the writer writes "
                              f"{', '.join(WRITTEN_COLUMNS)} and ignores "
                              f"{', '.join(IGNORED_COLUMNS)}")
    if options is not None and "streamId" not in options.given and \
            "stream_id" not in schema.names:
        raise OptionError("streamId", "is required unless the DataFrame has a 'stream_id' "
                                      "column that routes every row (a 32-bit integer, "
                                      "e.g. 1001)")


def _value_column(batch: pa.RecordBatch) -> pa.Array:
    import pyarrow as pa

    index = batch.schema.get_field_index("value")
    if index < 0:
        raise ValueColumnError.missing(batch.schema.names)
    column = batch.column(index)
    kind = column.type
    if pa.types.is_string(kind):
        column = column.view(pa.binary())
    elif pa.types.is_large_string(kind):
        column = column.view(pa.large_binary())
    elif not (pa.types.is_binary(kind) or pa.types.is_large_binary(kind)):
        raise ValueColumnError.of_type(kind)
    if column.null_count:
        raise ValueError(f"slipstream writer: {column.null_count} row(s) have a null 'value'; a "
                         f"message cannot be null (filter them out or use an empty value)")
    return column


def _message_column(batch: pa.RecordBatch) -> tuple[pa.Array, np.ndarray | None]:
    """The batch's messages as one binary column, and which are envelopes (None: none).  A
    row with a key or headers (not null) is its envelope; any other row is its value, a
    plain message, so that passing a plain stream's rows through (their key and headers
    null) writes plain messages."""
    import numpy as np
    import pyarrow.compute as pc

    names = batch.schema.names
    values = _value_column(batch)
    keys = batch.column("key") if "key" in names else None
    headers = batch.column("headers") if "headers" in names else None
    enveloped = np.zeros(batch.num_rows, dtype=bool)
    for column in (keys, headers):
        if column is not None and column.null_count < len(column):
            enveloped |= np.asarray(column.is_valid())
    if not enveloped.any():
        return values, None
    try:
        envelopes = encode_column(values, keys, headers)
    except ValueError as e:
        raise ValueError(f"slipstream writer: the 'headers' column: {e}") from None
    if enveloped.all():
        return envelopes, enveloped
    return pc.if_else(enveloped, envelopes, values.cast(envelopes.type)), enveloped


def _routed(batch: pa.RecordBatch, stream_option: int | None
            ) -> Iterator[tuple[int, pa.RecordBatch]]:
    """The batch's rows by the stream they go to, in order within each: all of them to the
    ``streamId`` option's stream when it is set (``stream_option``; it overrides the column,
    as Kafka's ``topic`` option does); else each to its ``stream_id`` column's, a null
    refused naming the row."""
    import numpy as np

    index = batch.schema.get_field_index("stream_id")
    if stream_option is not None or index < 0:
        assert stream_option is not None  # check_schema: a stream_id column or the option
        yield stream_option, batch
        return
    column = batch.column(index)
    if column.null_count:
        row = int(np.flatnonzero(np.asarray(column.is_null()))[0])
        raise ValueError(f"slipstream writer: row {row} of a batch has a null 'stream_id' "
                         f"column, and the writer has no streamId option (give every row a "
                         f"stream_id, e.g. coalesce(stream_id, 10), or set streamId, which "
                         f"sends every row to its stream)")
    streams = np.asarray(column)
    first = streams[0]
    if (streams == first).all():
        yield int(first), batch
        return
    for stream_id in np.unique(streams):
        yield int(stream_id), batch.filter(streams == stream_id)


def _messages(column: pa.Array) -> tuple[memoryview, np.ndarray, list[int]]:
    """(data back to back, lengths as int32s, start offsets of each message in data + the
    end) for a binary column, without copying the data."""
    import numpy as np
    import pyarrow as pa

    n = len(column)
    buffers = column.buffers()
    wide = pa.types.is_large_binary(column.type)  # 64-bit offsets
    offsets = np.frombuffer(buffers[1], dtype=np.int64 if wide else np.int32)
    offsets = offsets[column.offset:column.offset + n + 1]
    base, top = int(offsets[0]), int(offsets[-1])
    data = memoryview(buffers[2])[base:top] if buffers[2] is not None else memoryview(b"")
    lengths = np.diff(offsets).astype(np.int32)
    starts = (offsets - base).tolist()
    return data, lengths, starts


def _offer_column(publication: Publication, column: pa.Array, enveloped: np.ndarray | None,
                  timeout_ms: int, rows_before: int) -> tuple[int, int]:
    """Offer the messages of a binary ``column`` in order (reserved values: the publish
    time, with the envelope bit where ``enveloped``, None: nowhere); returns (messages,
    payload bytes).
    ``rows_before``: what this task published before, for the errors' text."""
    import numpy as np

    stamps = np.empty(_CHUNK, dtype=np.int64)  # the reserved values of one offer_batch call
    marks = None if enveloped is None else \
        np.where(enveloped, RESERVED_VALUE_ENVELOPE_BIT, 0).astype(np.int64)
    timeout_ns = timeout_ms * 1_000_000
    data, lengths, starts = _messages(column)
    n = len(lengths)
    done = 0
    stalled_since = 0
    pause = 0.0
    while done < n:
        end = min(n, done + _CHUNK)
        stamped = stamps[:end - done]
        stamped.fill(time.time_ns())  # the publish time, once per call
        if marks is not None:
            stamped += marks[done:end]
        result = publication.offer_batch(data[starts[done]:starts[end]], lengths[done:end],
                                         stamped)
        if result > 0:
            done += result
            stalled_since = 0
            pause = 0.0
            continue
        if result == ADMIN_ACTION:
            continue
        if result not in (BACK_PRESSURED, NOT_CONNECTED):
            failed = SlipstreamError(
                f"slipstream writer: offer to {publication.channel} stream "
                f"{publication.stream_id} failed with {result_name(result)} after "
                f"{rows_before + done} rows")
            if result == CLOSED:
                cut_off = publication.cut_off_error()
                if cut_off is not None:  # the driver went: say so
                    raise cut_off from failed
            raise failed
        now = time.monotonic_ns()
        if not stalled_since:
            stalled_since = now
        elif now - stalled_since > timeout_ns:
            why = ("back pressured: the slowest subscriber is a window behind"
                   if result == BACK_PRESSURED else "not connected: no subscriber")
            raise OfferTimeoutError(
                f"slipstream writer: {publication.channel} stream {publication.stream_id} "
                f"was {why} for more than offerTimeoutMs={timeout_ms} ms; "
                f"{rows_before + done} rows of this task were published, the rest were not "
                f"(the task fails so that Spark retries it; nothing is dropped silently)")
        # Spin briefly, then sleep in growing slices up to 1 ms.
        pause = min(0.001, pause * 2 or 0.00002)
        time.sleep(pause)
    return n, len(data)


def wait_until_durable(publication: Publication, position: int, timeout_ms: int) -> None:
    """Return once ``position`` (a task's last) is durable on ``publication`` (its channel's
    durable=); :class:`DurableTimeoutError` saying why not after ``timeout_ms``."""
    if publication.wait_durable(position, timeout_ms / 1000):
        return
    why = publication.why_not_durable(position)
    if why is None:  # reached as the wait gave up
        return
    raise DurableTimeoutError(
        f"slipstream writer: {publication.channel} stream {publication.stream_id}: position "
        f"{position} was not durable within durableTimeoutMs={timeout_ms} ms: {why.value} "
        f"(durable position {publication.durable_position}, tagged receivers "
        f"{publication.durable_receivers} of {publication.durable_required} required); the "
        f"task fails so that Spark retries it")


class _PublishingWriter:
    """The shared part of the batch and streaming writers (pickled to the executors)."""

    def __init__(self, options: SourceOptions) -> None:
        self.options = options

    def _publish(self, iterator: Iterator[pa.RecordBatch]) -> PublishedMessage:
        """Publish every row to its stream (:func:`_routed`); wait until each stream's last
        message is durable where the channel asks for it."""
        options = self.options
        stream_option = options.stream_id if "streamId" in options.given else None
        used: dict[int, Publication] = {}
        rows = total = 0
        for batch in iterator:
            if batch.num_rows == 0:
                continue
            for stream_id, part in _routed(batch, stream_option):
                publication = used.get(stream_id)
                if publication is None:
                    publication = publication_for(options.directory, options.channel,
                                                  stream_id)
                    used[stream_id] = publication
                column, enveloped = _message_column(part)
                n, size = _offer_column(publication, column, enveloped,
                                        options.offer_timeout_ms, rows)
                rows += n
                total += size
        if not used and stream_option is not None:  # no rows: the option's stream, as before
            used[stream_option] = publication_for(options.directory, options.channel,
                                                  stream_option)
        streams = {stream_id: (publication.session_id, publication.position)
                   for stream_id, publication in used.items()}
        for publication in used.values():
            if publication.durable_required is not None and options.durable_timeout_ms > 0:
                wait_until_durable(publication, streams[publication.stream_id][1],
                                   options.durable_timeout_ms)
        session_id, last = next(iter(streams.values()), (0, 0))
        return PublishedMessage(rows, total, session_id, last, streams)


class SlipstreamWriter(_PublishingWriter, DataSourceArrowWriter):
    """``df.write.format("slipstream")``: every row's value becomes one message."""

    def write(self, iterator: Iterator[pa.RecordBatch]) -> PublishedMessage:
        return self._publish(iterator)

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        """Nothing to do: messages are visible as soon as they are offered."""

    def abort(self, messages: list[WriterCommitMessage | None]) -> None:
        """Nothing to undo: what was offered stays in the stream (at least once)."""


class SlipstreamStreamWriter(_PublishingWriter, DataSourceStreamArrowWriter):
    """``df.writeStream.format("slipstream")``: every micro-batch's rows are published."""

    def write(self, iterator: Iterator[pa.RecordBatch]) -> PublishedMessage:
        return self._publish(iterator)

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        """Nothing to do: messages are visible as soon as they are offered."""

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        """Nothing to undo: what was offered stays in the stream (at least once)."""
