"""A counter's metadata record in the counters file (``counters.dat``, :mod:`.counters`): its
layout, and the rules for what a client may put in one (a type id, a label, a key).  The
control messages check ADD_COUNTER's fields by these rules, and the counters file writes and
reads its records by this layout."""

from __future__ import annotations

import struct
from typing import Final

from slipstream.client.errors import InvalidArgumentError
from slipstream.client.layout import INT32_MAX

#: A counter's metadata record, bytes (Aeron's record size).
METADATA_LENGTH: Final = 512
#: The record's fixed fields: state, type id, registration id, session id, stream id, owner
#: client id, label length, key length; then the key and the label.
RECORD = struct.Struct("<iiqiiqii")
KEY_OFFSET = RECORD.size
#: The longest key a counter carries, bytes (Aeron's MAX_KEY_LENGTH).
KEY_MAX_LENGTH: Final = 112
LABEL_OFFSET = KEY_OFFSET + KEY_MAX_LENGTH
#: The longest label a counter carries, bytes of UTF-8: what the record leaves after the key.
LABEL_MAX_LENGTH: Final = METADATA_LENGTH - LABEL_OFFSET  # 360
#: The type ids of the driver's own counters (:class:`CounterType`): a client may not add one.
DRIVER_TYPE_IDS: Final = (range(0, 100), range(1000, 1100))


def is_driver_type(type_id: int) -> bool:
    """Whether ``type_id`` is one of the driver's own (:data:`DRIVER_TYPE_IDS`), not a
    client's counter."""
    return any(type_id in ids for ids in DRIVER_TYPE_IDS)


def check_client_type_id(field: str, value: object) -> int:
    """``value`` if it is a type id a client may add a counter of (an int in 0..2**31-1
    outside :data:`DRIVER_TYPE_IDS`), else :class:`InvalidArgumentError` naming ``field``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgumentError(field, f"{value!r} is not an integer")
    if not 0 <= value <= INT32_MAX:
        raise InvalidArgumentError(field, f"{value} is outside 0..{INT32_MAX}")
    if is_driver_type(value):
        reserved = " and ".join(f"{r.start}..{r.stop - 1}" for r in DRIVER_TYPE_IDS)
        raise InvalidArgumentError(field, f"{value} is reserved for the driver's own counters "
                                          f"({reserved}); use another, e.g. from 1100 up")
    return value


def fit_label(text: str) -> str:
    """``text`` cut to a counter label's :data:`LABEL_MAX_LENGTH` bytes of UTF-8, at a
    character's start (for labels that repeat a channel URI, which may be longer)."""
    encoded = text.encode("utf-8", "replace")
    if len(encoded) <= LABEL_MAX_LENGTH:
        return text
    return encoded[:LABEL_MAX_LENGTH].decode("utf-8", "ignore")


def encode_counter_label(field: str, value: object) -> bytes:
    """A client counter's label as stored: its UTF-8, at most :data:`LABEL_MAX_LENGTH` bytes,
    else :class:`InvalidArgumentError` naming ``field`` (a driver's own labels are cut
    instead: they repeat a channel URI of up to 4095 characters)."""
    if not isinstance(value, str):
        raise InvalidArgumentError(field, f"{value!r} is not a string")
    try:
        encoded = value.encode("utf-8")
    except UnicodeEncodeError as e:  # a lone surrogate, which JSON can carry
        raise InvalidArgumentError(field, f"not valid Unicode text: {e.reason}") from None
    if len(encoded) > LABEL_MAX_LENGTH:
        raise InvalidArgumentError(field, f"{len(encoded)} bytes of UTF-8 exceed the counters "
                                          f"file's {LABEL_MAX_LENGTH}-byte label")
    return encoded


def check_counter_key(field: str, value: object) -> bytes:
    """A counter's key: bytes of at most :data:`KEY_MAX_LENGTH`, else
    :class:`InvalidArgumentError` naming ``field``."""
    if not isinstance(value, bytes | bytearray | memoryview):
        raise InvalidArgumentError(field, f"{type(value).__name__} is not bytes")
    key = bytes(value)
    if len(key) > KEY_MAX_LENGTH:
        raise InvalidArgumentError(field, f"{len(key)} bytes exceed the counters file's "
                                          f"{KEY_MAX_LENGTH}-byte key")
    return key


def decode_counter_key(field: str, value: object) -> bytes:
    """A key as a control message carries it (hex, messages being JSON), checked as
    :func:`check_counter_key`."""
    if not isinstance(value, str):
        raise InvalidArgumentError(field, f"{value!r} is not a hex string")
    if len(value) > 2 * KEY_MAX_LENGTH:  # before decoding: a long one costs nothing
        raise InvalidArgumentError(field, f"{len(value) // 2} bytes exceed the counters "
                                          f"file's {KEY_MAX_LENGTH}-byte key")
    try:
        return check_counter_key(field, bytes.fromhex(value))
    except ValueError as e:
        if isinstance(e, InvalidArgumentError):
            raise
        raise InvalidArgumentError(field, f"not hex: {e}") from None
