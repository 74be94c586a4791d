"""The envelope: a message's key and headers, carried in its payload before its value.

A message is *enveloped* when its frame's reserved value has its top (sign) bit set
(:data:`~slipstream.client.layout.RESERVED_VALUE_ENVELOPE_BIT`); the other 63 bits stay the
publisher's time stamp (ns since the epoch).  So a reader tells an enveloped message from a
plain one by its frame, never by guessing from its bytes, and a writer whose rows have no key
and no headers writes plain messages that any Aeron subscriber reads as they are
(docs/PROTOCOL.md §1.2, docs/SPARK.md).  The payload of an enveloped message, every integer
a little-endian int32:

=========  ==========================================================================
bytes      field
=========  ==========================================================================
1          version: :data:`ENVELOPE_VERSION`
4          key length; -1: no key (null)
k          the key
4          header count; -1: no headers (null)
per header key length (>= 0), the key (UTF-8), value length (-1: a null value), the value
the rest   the value
=========  ==========================================================================

Each field has one encoding, so a payload that decodes encodes back to the same bytes.  Both
directions work on a whole batch at once, in Arrow's and numpy's C loops: the writer joins
each row's parts with Arrow's element-wise kernels, the reader walks the lengths of every
message of a batch together (one numpy pass per field, and per header slot) and cuts the
keys, headers and values out with Arrow's ``take``.  Every length is checked against the end
of its message before it indexes the data; a message that does not decode is reported by
index and reason, never read past.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

from slipstream.client.errors import SlipstreamError

if TYPE_CHECKING:  # pyarrow (and numpy) cost half a second: imported where a batch is coded
    import numpy as np
    import pyarrow as pa

__all__ = ["ENVELOPE_VERSION", "DecodedBatch", "Envelope", "MalformedEnvelopeError",
           "decode_batch", "decode_message", "encode_column", "encode_message",
           "headers_type"]

ENVELOPE_VERSION = 1
_FIXED = 9  # version, key length and header count: the shortest envelope
_HEADER_FIXED = 8  # a header's two lengths: the shortest header

# Why a message does not decode (codes of DecodedBatch.reasons' text).
_REASONS = {
    1: "it has {detail} bytes, fewer than an envelope's version and key length (5)",
    2: "its envelope version is {detail}; this reader knows version 1",
    3: "its key length {detail} does not fit in the message",
    4: "it ends before its header count",
    5: "its header count {detail} does not fit in the message (a header takes 8 bytes "
       "at least)",
    6: "the key length {detail} of one of its headers does not fit in the message",
    7: "the value length {detail} of one of its headers does not fit in the message",
    8: "the key of its header {detail} is not UTF-8",
}


class MalformedEnvelopeError(SlipstreamError, ValueError):
    """A message marked as enveloped does not decode (its reason is in the text)."""


def headers_type() -> pa.DataType:
    """``array<struct<key: string, value: binary>>`` (Kafka's headers column) as Arrow."""
    import pyarrow as pa

    return pa.list_(pa.struct([("key", pa.string()), ("value", pa.binary())]))


@dataclasses.dataclass
class Envelope:
    """One decoded message: its key (None: none), headers (None: none) and value."""

    key: bytes | None
    headers: list[tuple[str, bytes | None]] | None
    value: bytes


@dataclasses.dataclass
class DecodedBatch:
    """What :func:`decode_batch` made of a batch: the ``values``, ``keys`` and (when asked)
    ``headers`` columns, one row per message (a plain message's value whole, its key and
    headers null); or, when any message did not decode, ``malformed``: (index in the batch,
    why) of each such message, and no columns."""

    values: pa.Array | None
    keys: pa.Array | None
    headers: pa.Array | None
    malformed: list[tuple[int, str]]


def _int32_column(numbers: np.ndarray) -> pa.Array:
    """A binary column of each number's 4 little-endian bytes."""
    import numpy as np
    import pyarrow as pa

    n = len(numbers)
    data = np.ascontiguousarray(numbers, dtype="<i4")
    offsets = np.arange(0, 4 * n + 1, 4, dtype=np.int32)
    return pa.Array.from_buffers(pa.binary(), n, [None, pa.py_buffer(offsets),
                                                  pa.py_buffer(data)])


def _as_binary(column: pa.Array) -> pa.Array:
    """A string or binary column as binary (a view: no copy)."""
    import pyarrow as pa

    if pa.types.is_string(column.type):
        return column.view(pa.binary())
    if pa.types.is_large_string(column.type):
        return column.view(pa.large_binary())
    return column


def _lengths(column: pa.Array) -> np.ndarray:
    """Each element's byte length as int32 (0 for a null)."""
    import numpy as np
    import pyarrow.compute as pc

    return np.array(pc.fill_null(pc.binary_length(column), 0), dtype=np.int32)


def encode_column(values: pa.Array, keys: pa.Array | None, headers: pa.Array | None
                  ) -> pa.Array:
    """Each row's envelope (module doc): ``values`` (binary or string, no nulls), ``keys``
    (binary or string; null or None: no key), ``headers`` (``array<struct<key: string,
    value: binary>>``; null or None: no headers).  Raises :class:`ValueError` naming the
    first row (index in the column) whose header or header key is null."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    n = len(values)
    values = _as_binary(values)
    nothing = pa.array([b""], pa.binary())
    if keys is None:
        key_lengths = np.full(n, -1, dtype=np.int32)
        key_part = pa.repeat(nothing[0], n) if n else pa.array([], pa.binary())
    else:
        keys = _as_binary(keys)
        key_lengths = _lengths(keys)
        if keys.null_count:
            key_lengths[np.asarray(keys.is_null())] = -1
        key_part = pc.fill_null(keys, b"")
    prefix = np.empty((n, 5), dtype=np.uint8)
    prefix[:, 0] = ENVELOPE_VERSION
    prefix[:, 1:] = key_lengths.astype("<i4").view(np.uint8).reshape(n, 4)
    prefix_column = pa.Array.from_buffers(
        pa.binary(), n, [None, pa.py_buffer(np.arange(0, 5 * n + 1, 5, dtype=np.int32)),
                         pa.py_buffer(prefix)])
    if headers is None:
        counts = np.full(n, -1, dtype=np.int32)
        header_part = pa.repeat(nothing[0], n) if n else pa.array([], pa.binary())
    else:
        counts = np.array(pc.fill_null(pc.list_value_length(headers), -1), dtype=np.int32)
        entries = headers.flatten()  # the headers of the non-null rows, in row order
        owners = np.asarray(pc.list_parent_indices(headers))  # each entry's row
        if entries.null_count:
            row = int(owners[np.asarray(entries.is_null())][0])
            raise ValueError(f"row {row} has a null header (a header is a struct of key "
                             f"and value)")
        header_keys = _as_binary(entries.field("key"))
        if header_keys.null_count:
            row = int(owners[np.asarray(header_keys.is_null())][0])
            raise ValueError(f"row {row} has a header whose key is null (a header key is "
                             f"a string)")
        header_values = _as_binary(entries.field("value"))
        value_lengths = _lengths(header_values)
        if header_values.null_count:
            value_lengths[np.asarray(header_values.is_null())] = -1
        joined = _joined(_int32_column(_lengths(header_keys)), header_keys,
                         _int32_column(value_lengths), pc.fill_null(header_values, b""))
        per_row = np.zeros(n + 1, dtype=np.int32)
        np.cumsum(np.maximum(counts, 0), out=per_row[1:])
        header_part = pc.binary_join(pa.ListArray.from_arrays(pa.array(per_row), joined), b"")
    return _joined(prefix_column, key_part, _int32_column(counts), header_part, values)


def _joined(*parts: pa.Array) -> pa.Array:
    """Each row's parts, one after the other (64-bit offsets when any part has them)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    kind = pa.binary()
    if any(pa.types.is_large_binary(part.type) for part in parts):
        kind = pa.large_binary()
        parts = tuple(part.cast(kind) for part in parts)
    return pc.binary_join_element_wise(*parts, pa.scalar(b"", kind))


def encode_message(value: bytes, key: bytes | None = None,
                   headers: Sequence[tuple[str, bytes | None]] | None = None) -> bytes:
    """One message's envelope (a publisher then offers it with a reserved value that has
    :data:`~slipstream.client.layout.RESERVED_VALUE_ENVELOPE_BIT` set)."""
    import pyarrow as pa

    header_column = None
    if headers is not None:
        header_column = pa.array([[{"key": k, "value": v} for k, v in headers]],
                                 headers_type())
    return encode_column(pa.array([value], pa.binary()),
                         pa.array([key], pa.binary()), header_column)[0].as_py()


def _slices(buffer: pa.Buffer, starts: np.ndarray, ends: np.ndarray) -> pa.Array:
    """A binary column of ``buffer[starts[i]:ends[i]]``, the ranges in order and apart
    (``starts[i] <= ends[i] <= starts[i + 1]``), copied by Arrow's ``take``."""
    import numpy as np
    import pyarrow as pa

    m = len(starts)
    if m == 0:
        return pa.array([], pa.binary())
    cuts = np.empty(2 * m, dtype=np.int32)
    cuts[0::2] = starts
    cuts[1::2] = ends
    pieces = pa.Array.from_buffers(pa.binary(), 2 * m - 1, [None, pa.py_buffer(cuts), buffer])
    return pieces.take(pa.array(np.arange(0, 2 * m - 1, 2, dtype=np.int32)))


def _with_validity(column: pa.Array, valid: np.ndarray) -> pa.Array:
    """``column`` (no nulls, offset 0) with the rows where ``valid`` is False null."""
    import numpy as np
    import pyarrow as pa

    if valid.all():
        return column
    bitmap = pa.py_buffer(np.packbits(valid, bitorder="little"))
    return pa.Array.from_buffers(column.type, len(column), [bitmap, *column.buffers()[1:]])


def decode_batch(data: bytes | bytearray | memoryview, offsets: np.ndarray,
                 enveloped: np.ndarray, *, with_headers: bool) -> DecodedBatch:
    """Decode a batch of messages laid back to back in ``data`` (message i is
    ``data[offsets[i]:offsets[i + 1]]``; ``offsets`` int32 or int64, n + 1 entries, rising,
    within ``data``) of which those where ``enveloped`` (bool, n) is true are envelopes.

    Returns the value and key columns (and the headers column with ``with_headers``), or,
    if any envelope does not decode, which and why (:class:`DecodedBatch`).  Every length
    is checked against the end of its message before it is used."""
    import numpy as np
    import pyarrow as pa

    n = len(enveloped)
    buffer = pa.py_buffer(data)
    raw = np.frombuffer(buffer, dtype=np.uint8)
    if raw.size < 8:  # the reads below take 4 bytes at a clamped position
        raw = np.concatenate([raw, np.zeros(8, dtype=np.uint8)])
    # The little-endian int32 at every byte offset (a view, unaligned: one gather a field).
    at_every_byte = np.ndarray((raw.size - 3,), dtype="<i4", buffer=raw, strides=(1,))

    def int32_at(at: np.ndarray) -> np.ndarray:
        return at_every_byte[at].astype(np.int64)

    bounds = np.asarray(offsets, dtype=np.int64)
    rows = np.flatnonzero(enveloped)
    start = bounds[rows]
    end = bounds[rows + 1]
    m = len(rows)
    error = np.zeros(m, dtype=np.uint8)
    detail = np.zeros(m, dtype=np.int64)

    def fail(where: np.ndarray, code: int, value: np.ndarray) -> None:
        new = where & (error == 0)
        error[new] = code
        detail[new] = value[new] if value.shape else value

    fail(end - start < 5, 1, end - start)
    ok = error == 0
    version = raw[np.where(ok, start, 0)].astype(np.int64)
    fail(ok & (version != ENVELOPE_VERSION), 2, version)
    ok = error == 0
    key_length = np.where(ok, int32_at(np.where(ok, start + 1, 0)), 0)
    key_start = start + 5
    fail(ok & ((key_length < -1) | (key_length > end - key_start)), 3, key_length)
    ok = error == 0
    key_end = key_start + np.where(ok, np.maximum(key_length, 0), 0)
    fail(ok & (end - key_end < 4), 4, end - key_end)
    ok = error == 0
    count = np.where(ok, int32_at(np.where(ok, key_end, 0)), 0)
    at = key_end + 4
    fail(ok & ((count < -1) | (count > (end - at) // _HEADER_FIXED)), 5, count)
    ok = error == 0
    counts = np.where(ok, np.maximum(count, 0), 0)
    first = np.zeros(m + 1, dtype=np.int64)  # each row's first header among all of them
    np.cumsum(counts, out=first[1:])
    total = int(first[-1])
    header_key_start = np.zeros(total, dtype=np.int64)
    header_key_end = np.zeros(total, dtype=np.int64)
    header_value_start = np.zeros(total, dtype=np.int64)
    header_value_end = np.zeros(total, dtype=np.int64)
    header_value_null = np.zeros(total, dtype=bool)
    slot = 0
    while True:  # header slot by slot, each a pass over the rows that have one there
        active = np.flatnonzero((error == 0) & (counts > slot))
        if not len(active):
            break
        here, stop = at[active], end[active]
        fits = stop - here >= 4
        length = np.where(fits, int32_at(np.where(fits, here, 0)), -1)
        bad = (length < 0) | (length > stop - here - 4)
        fail(np.isin(np.arange(m), active[bad]), 6, _scatter(m, active, length))
        keep = ~bad
        active, here, stop, length = active[keep], here[keep], stop[keep], length[keep]
        value_at = here + 4 + length
        fits = stop - value_at >= 4
        value_length = np.where(fits, int32_at(np.where(fits, value_at, 0)), -2)
        bad = (value_length < -1) | (value_length > stop - value_at - 4)
        fail(np.isin(np.arange(m), active[bad]), 7, _scatter(m, active, value_length))
        keep = ~bad
        active, here, value_at, value_length = (active[keep], here[keep], value_at[keep],
                                                value_length[keep])
        index = first[active] + slot
        header_key_start[index] = here + 4
        header_key_end[index] = value_at
        header_value_start[index] = value_at + 4
        header_value_end[index] = value_at + 4 + np.maximum(value_length, 0)
        header_value_null[index] = value_length == -1
        at[active] = header_value_end[index]
        slot += 1

    header_keys = None
    if with_headers and total and not error.any():
        try:
            header_keys = _slices(buffer, header_key_start, header_key_end).cast(pa.string())
        except pa.ArrowInvalid:  # which one: the cold path of a bad batch
            for index in range(total):
                try:
                    bytes(raw[header_key_start[index]:header_key_end[index]]).decode()
                except UnicodeDecodeError:
                    row = int(np.searchsorted(first, index, side="right") - 1)
                    fail(np.arange(m) == row, 8, np.asarray(index - first[row]))
                    break
    if error.any():
        bad_rows = np.flatnonzero(error)
        return DecodedBatch(None, None, None, [
            (int(rows[i]), _REASONS[int(error[i])].format(detail=int(detail[i])))
            for i in bad_rows])

    message_start = bounds[:-1]
    value_start = message_start.copy()
    value_start[rows] = at
    values = _slices(buffer, value_start, bounds[1:])
    key_starts = message_start.copy()
    key_starts[rows] = key_start
    key_ends = message_start.copy()
    key_ends[rows] = key_end
    has_key = np.zeros(n, dtype=bool)
    has_key[rows] = key_length >= 0
    keys = _with_validity(_slices(buffer, key_starts, key_ends), has_key)
    headers = None
    if with_headers:
        entry_counts = np.zeros(n, dtype=np.int32)
        entry_counts[rows] = counts
        list_offsets = np.zeros(n + 1, dtype=np.int32)
        np.cumsum(entry_counts, out=list_offsets[1:])
        has_headers = np.zeros(n, dtype=bool)
        has_headers[rows] = count >= 0
        if header_keys is None:
            header_keys = pa.array([], pa.string())
        header_values = _with_validity(
            _slices(buffer, header_value_start, header_value_end), ~header_value_null)
        entries = pa.StructArray.from_arrays([header_keys, header_values],
                                             names=["key", "value"])
        headers = pa.ListArray.from_arrays(pa.array(list_offsets), entries,
                                           type=headers_type(),
                                           mask=pa.array(~has_headers))
    return DecodedBatch(values, keys, headers, [])


def _scatter(m: int, active: np.ndarray, values: np.ndarray) -> np.ndarray:
    """An array of ``m`` zeros with ``values`` at the indices ``active``."""
    import numpy as np

    out = np.zeros(m, dtype=np.int64)
    out[active] = values
    return out


def decode_message(message: bytes | bytearray | memoryview) -> Envelope:
    """One enveloped message's key, headers and value; :class:`MalformedEnvelopeError`
    saying why when it does not decode."""
    import numpy as np

    decoded = decode_batch(message, np.array([0, len(message)]), np.ones(1, dtype=bool),
                           with_headers=True)
    if decoded.malformed:
        raise MalformedEnvelopeError(f"the message does not decode as an envelope: "
                                     f"{decoded.malformed[0][1]}")
    assert decoded.values is not None and decoded.keys is not None
    assert decoded.headers is not None
    headers = decoded.headers[0].as_py()
    return Envelope(decoded.keys[0].as_py(),
                    None if headers is None else [(h["key"], h["value"]) for h in headers],
                    decoded.values[0].as_py())
