"""The envelope codec (slipstream.spark_bridge.envelope): a message's key and headers before
its value, encoded and decoded a batch at a time."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slipstream.spark_bridge.envelope import (
    MalformedEnvelopeError,
    decode_batch,
    decode_message,
    encode_column,
    encode_message,
    headers_type,
)

keys = st.none() | st.binary(max_size=40)
header_lists = st.none() | st.lists(
    st.tuples(st.text(max_size=12), st.none() | st.binary(max_size=40)), max_size=5)
values = st.binary(max_size=200)
messages = st.tuples(values, keys, header_lists)


def batch_of(payloads: list[bytes]) -> tuple[bytes, np.ndarray]:
    offsets = np.zeros(len(payloads) + 1, dtype=np.int32)
    np.cumsum([len(p) for p in payloads], out=offsets[1:])
    return b"".join(payloads), offsets


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.booleans(), messages), min_size=1, max_size=12))
def test_a_batch_of_plain_and_enveloped_messages_decodes_to_what_was_encoded(
        rows: list[tuple[bool, tuple[bytes, bytes | None, list | None]]]) -> None:
    """Encoded a batch at a time, decoded a batch at a time, mixed with plain messages (whose
    value is the whole payload, key and headers null): every field back, null and empty kept
    apart."""
    wrapped = [enveloped for enveloped, _ in rows]
    column = encode_column(
        pa.array([value for _, (value, _, _) in rows], pa.binary()),
        pa.array([key for _, (_, key, _) in rows], pa.binary()),
        pa.array([None if h is None else [{"key": k, "value": v} for k, v in h]
                  for _, (_, _, h) in rows], headers_type()))
    payloads = [column[i].as_py() if enveloped else value
                for i, (enveloped, (value, _, _)) in enumerate(rows)]
    data, offsets = batch_of(payloads)
    decoded = decode_batch(data, offsets, np.array(wrapped), with_headers=True)
    assert decoded.malformed == []
    assert decoded.values.to_pylist() == [value for _, (value, _, _) in rows]
    assert decoded.keys.to_pylist() == [key if enveloped else None
                                        for enveloped, (_, key, _) in rows]
    assert decoded.headers.to_pylist() == [
        None if not enveloped or h is None else [{"key": k, "value": v} for k, v in h]
        for enveloped, (_, _, h) in rows]
    for i, (enveloped, (value, key, header_list)) in enumerate(rows):
        if enveloped:
            assert payloads[i] == encode_message(value, key, header_list)


@settings(max_examples=2000, deadline=None)
@given(st.lists(st.binary(max_size=64), min_size=1, max_size=6))
def test_arbitrary_bytes_never_crash_the_decoder_and_either_decode_or_are_named_malformed(
        payloads: list[bytes]) -> None:
    """Any bytes marked as envelopes: the batch either decodes, and then each message is the
    encoding of what it decoded to (one encoding per message), or says which messages do
    not and why; never an exception, never a read past a message's end (a message decoded
    alone decodes the same as in the batch)."""
    data, offsets = batch_of(payloads)
    decoded = decode_batch(data, offsets, np.ones(len(payloads), dtype=bool),
                           with_headers=True)
    without_headers = decode_batch(data, offsets, np.ones(len(payloads), dtype=bool),
                                   with_headers=False)
    # Without the headers column, only header keys go unchecked (UTF-8).
    assert {row for row, _ in without_headers.malformed} <= \
        {row for row, _ in decoded.malformed}
    alone = []
    for payload in payloads:
        try:
            alone.append(decode_message(payload))
        except MalformedEnvelopeError as e:
            alone.append(str(e))
    if decoded.malformed:
        assert decoded.values is None
        for row, why in decoded.malformed:
            assert isinstance(alone[row], str) and why in alone[row]
        return
    for i, envelope in enumerate(alone):
        assert not isinstance(envelope, str)
        assert decoded.values[i].as_py() == envelope.value
        assert encode_message(envelope.value, envelope.key, envelope.headers) == payloads[i]


@pytest.mark.parametrize(("payload", "why"), [
    (b"", "fewer than an envelope's version and key length"),
    (b"\x02\xff\xff\xff\xff\xff\xff\xff\xff", "envelope version is 2"),
    (b"\x01\x10\x00\x00\x00ab", "key length 16 does not fit"),
    (b"\x01\xff\xff\xff\xff\x00\x00", "ends before its header count"),
    (b"\x01\xff\xff\xff\xff\x02\x00\x00\x00" + b"\x00" * 15, "header count 2 does not fit"),
    (b"\x01\xff\xff\xff\xff\x01\x00\x00\x00\x09\x00\x00\x00abcd",
     "key length 9 of one of its headers"),
    (b"\x01\xff\xff\xff\xff\x01\x00\x00\x00\x00\x00\x00\x00\x05\x00\x00\x00ab",
     "value length 5 of one of its headers"),
    (b"\x01\xff\xff\xff\xff\x01\x00\x00\x00\x02\x00\x00\x00\xff\xfe\xff\xff\xff\xff",
     "the key of its header 0 is not UTF-8"),
])
def test_each_malformed_envelope_is_named_with_its_reason(payload: bytes, why: str) -> None:
    """Each length is checked before it is used: the message is named (its index in the
    batch, after a good one) with what is wrong with it."""
    good = encode_message(b"fine", b"k", [("h", b"v")])
    data, offsets = batch_of([good, payload])
    decoded = decode_batch(data, offsets, np.array([True, True]), with_headers=True)
    assert [row for row, _ in decoded.malformed] == [1]
    assert why in decoded.malformed[0][1]


def test_a_null_header_key_is_refused_naming_its_row() -> None:
    headers = pa.array([[{"key": "a", "value": b"1"}], [{"key": None, "value": b"2"}]],
                       headers_type())
    with pytest.raises(ValueError, match="row 1 has a header whose key is null"):
        encode_column(pa.array([b"x", b"y"]), None, headers)


def test_columns_with_64_bit_offsets_are_encoded_as_the_others() -> None:
    """Spark may hand a writer large_binary / large_string columns: the envelopes are the
    same bytes."""
    headers = pa.array([[{"key": "a", "value": b"b"}], None], headers_type())
    wide = encode_column(pa.array([b"v1", b"v2"], pa.large_binary()),
                         pa.array(["k", None], pa.large_string()), headers)
    narrow = encode_column(pa.array([b"v1", b"v2"]), pa.array([b"k", None]), headers)
    assert wide.to_pylist() == narrow.to_pylist()
    assert decode_message(wide[1].as_py()).value == b"v2"


def test_the_scan_for_a_publishers_time_reads_an_envelopes_stamp_without_its_mark() -> None:
    """ss_scan_messages (what a log view searches a time with) stops before the
    first message stamped at or after the time, an enveloped one too (its reserved value
    negative: the envelope bit above the stamp)."""
    from slipstream.client._native import ffi, lib
    from slipstream.client.layout import (
        DATA_HEADER,
        HDR_TYPE_DATA,
        RESERVED_VALUE_ENVELOPE_BIT,
        UNFRAGMENTED,
    )
    from slipstream.client.retention import walk_term

    term = bytearray(4096)
    stamps = [1_000, 2_000 + RESERVED_VALUE_ENVELOPE_BIT, 3_000]
    for i, reserved in enumerate(stamps):
        DATA_HEADER.pack_into(term, 64 * i, 40, 0, UNFRAGMENTED, HDR_TYPE_DATA, 64 * i, 1, 2, 0,
                              reserved)
    with ffi.from_buffer(term) as buffer:
        walked = walk_term(ffi.cast("uint8_t *", buffer), 0, 192, time_ns=1_500)
    assert (walked.boundary, walked.messages, walked.reason) == (64, 1, lib.SS_MESSAGES_TIME)
