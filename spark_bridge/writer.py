"""Writing: each executor task publishes its rows' ``value`` through its host's driver.

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
again when they are offered again.  A reader can turn it into a ``timestamp`` column
(``reserved_value // 1000`` microseconds, UTC); a message from a publisher that sets no
reserved value carries 0.

With ``durable=TAG/N`` on the channel (docs/PROTOCOL.md §7.7), a task returns its commit
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
from slipstream.spark_bridge.options import SourceOptions
from slipstream.spark_bridge.runtime import publication_for

if TYPE_CHECKING:
    import numpy as np
    import pyarrow as pa
    from pyspark.sql.types import StructType

__all__ = ["DurableTimeoutError", "OfferTimeoutError", "SlipstreamStreamWriter",
           "SlipstreamWriter", "ValueColumnError", "check_schema", "publish_batches",
           "wait_until_durable"]

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
    session_id: int
    last_position: int


class ValueColumnError(UsageError, ValueError):
    """The DataFrame written has no ``value`` column, or one that is not binary or string:
    raised by ``save()`` / ``start()``, before any task runs."""

    @classmethod
    def missing(cls, columns: list[str]) -> ValueColumnError:
        return cls(f"slipstream writer: the DataFrame has no 'value' column (columns: "
                   f"{', '.join(columns)}); select or alias one")

    @classmethod
    def of_type(cls, kind: object) -> ValueColumnError:
        return cls(f"slipstream writer: the 'value' column is {kind}; it must be binary or "
                   f"string (cast it: col('value').cast('binary'))")


def check_schema(schema: StructType) -> None:
    """Raise :class:`ValueColumnError` unless ``schema`` has a binary or string ``value``."""
    from pyspark.sql.types import BinaryType, StringType

    if "value" not in schema.names:
        raise ValueColumnError.missing(schema.names)
    kind = schema["value"].dataType
    if not isinstance(kind, BinaryType | StringType):
        raise ValueColumnError.of_type(kind.simpleString())


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


def publish_batches(publication: Publication, batches: Iterator[pa.RecordBatch],
                    timeout_ms: int) -> tuple[int, int, int]:
    """Offer every row's value, in order, each stamped with its publish time (module doc);
    returns (rows, payload bytes, last position).

    Waits while back-pressured or not connected; raises :class:`OfferTimeoutError` when no
    message could be appended for ``timeout_ms`` milliseconds.
    """
    import numpy as np

    stamps = np.empty(_CHUNK, dtype=np.int64)  # the reserved values of one offer_batch call
    rows = total = 0
    last_position = publication.position
    timeout_ns = timeout_ms * 1_000_000
    for batch in batches:
        if batch.num_rows == 0:
            continue
        data, lengths, starts = _messages(_value_column(batch))
        n = len(lengths)
        done = 0
        stalled_since = 0
        pause = 0.0
        while done < n:
            end = min(n, done + _CHUNK)
            stamped = stamps[:end - done]
            stamped.fill(time.time_ns())  # the publish time, once per call
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
                    f"{rows + done} rows")
                if result == CLOSED:
                    cut_off = publication._client.cut_off_error()
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
                    f"was {why} for more than offerTimeoutMs={timeout_ms} ms; {rows + done} "
                    f"rows of this task were published, the rest were not (the task fails so "
                    f"that Spark retries it; nothing is dropped silently)")
            # Spin briefly, then sleep in growing slices up to 1 ms.
            pause = min(0.001, pause * 2 or 0.00002)
            time.sleep(pause)
        rows += n
        total += len(data)
        last_position = publication.position
    return rows, total, last_position


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
        options = self.options
        publication = publication_for(options.directory, options.channel, options.stream_id)
        rows, total, last = publish_batches(publication, iterator, options.offer_timeout_ms)
        if publication.durable_required is not None and options.durable_timeout_ms > 0:
            wait_until_durable(publication, last, options.durable_timeout_ms)
        return PublishedMessage(rows, total, publication.session_id, last)


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
