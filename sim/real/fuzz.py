"""Hostile input for a running driver: malformed and mutated datagrams, and control commands.

:class:`DatagramFuzzer` makes datagrams aimed at one stream (its session and stream id, so
they reach the image and the publication, not just the frame checks): well-formed frames of
every type with hostile values (positions far outside the window, NAKs for a gigabyte, SETUPs
asking for huge terms or tiny MTUs), frame lengths that lie at any frame of a batched
datagram, wrong versions, unknown types, truncations and random bit flips.
:class:`CommandFuzzer` makes control-socket frames: commands with each field of the wrong
type or out of range, missing or extra fields, unknown types, JSON too deep or too large,
invalid UTF-8 and several frames at once.

Both count what they made by kind (``counts``), and both are deterministic for a seed.  The
tests (``tests/test_udp.py``, ``tests/test_control_plane.py``) run a few thousand;
``bench/fuzz.py`` runs a million datagrams and figures for docs/RELIABILITY.md.
"""

from __future__ import annotations

import collections
import json
import random
import struct
from collections.abc import Callable
from typing import Any, Final

from slipstream.client import control
from slipstream.client.frames import (
    Data,
    ErrorFrame,
    Heartbeat,
    Nak,
    Pad,
    Rttm,
    Setup,
    StatusMessage,
)
from slipstream.client.layout import (
    BEGIN_FLAG,
    EOS_FLAG,
    FRAME_ALIGNMENT,
    FRAME_LENGTH_FIELD,
    HDR_TYPE_ATS_DATA,
    HDR_TYPE_EXT,
    HDR_TYPE_RES,
    HEADER_LENGTH,
    INT32_MAX,
    INT32_MIN,
    MAX_UDP_PAYLOAD_LENGTH,
    RTTM_REPLY_FLAG,
    SM_SEND_SETUP_FLAG,
    TERM_MAX_LENGTH,
    TERM_MIN_LENGTH,
    TYPE_FIELD,
    UNFRAGMENTED,
    VERSION_FIELD,
    align,
)

#: Values that break naive arithmetic: zero, negatives, alignment edges, int32 extremes.
HOSTILE_INT32: Final = (0, -1, 1, 31, 32, 33, 1408, 65536, 1 << 30, INT32_MAX, INT32_MIN)


class DatagramFuzzer:
    """Hostile datagrams for the stream (``session_id``, ``stream_id``); see the module.
    Given the stream's ``initial_term_id``, term ids also fall just before, at and after it
    (a term before the first has a negative position)."""

    def __init__(self, session_id: int, stream_id: int, seed: int = 1,
                 initial_term_id: int | None = None) -> None:
        self.session_id = session_id
        self.stream_id = stream_id
        self._near_terms: tuple[int, ...] = () if initial_term_id is None else tuple(
            (initial_term_id + k + (1 << 31)) % (1 << 32) - (1 << 31) for k in (-1, 0, 1))
        self.rng = random.Random(seed)
        self.counts: collections.Counter[str] = collections.Counter()
        self._kinds: list[tuple[str, Callable[[], bytes]]] = [
            ("hostile field values", self._hostile_frame),
            ("lying frame length", self._lying_length),
            ("wrong version", self._wrong_version),
            ("unknown type", self._unknown_type),
            ("truncated", self._truncated),
            ("bit flips", self._bit_flips),
            ("random bytes", self._random_bytes),
        ]

    def next(self) -> bytes:
        kind, make = self.rng.choice(self._kinds)
        self.counts[kind] += 1
        return make()

    # -- the kinds -----------------------------------------------------------------------------
    def _term_id(self) -> int:
        return self.rng.choice((0, 1, 2, -1, 1 << 20, INT32_MAX, INT32_MIN,
                                self.rng.randrange(INT32_MIN, INT32_MAX + 1), *self._near_terms))

    def _value(self) -> int:
        return self.rng.choice(HOSTILE_INT32)

    def _well_formed(self) -> bytes:
        """A valid frame of a random type with hostile field values."""
        rng, session, stream = self.rng, self.session_id, self.stream_id
        offset = rng.choice((0, FRAME_ALIGNMENT, 1 << 16, TERM_MAX_LENGTH - FRAME_ALIGNMENT,
                             rng.randrange(0, 1 << 20, FRAME_ALIGNMENT)))
        choice = rng.randrange(8)
        if choice == 0:
            return Data(offset, session, stream, self._term_id(),
                        bytes(rng.randrange(0, 1400))).encode()
        if choice == 1:
            term_id = self._term_id()
            flags = rng.choice((BEGIN_FLAG, UNFRAGMENTED, UNFRAGMENTED | EOS_FLAG))
            return Heartbeat(offset, session, stream, term_id, flags).encode()
        if choice == 2:
            return Pad(offset, session, stream, self._term_id(),
                       rng.choice((32, 64, 1 << 20, INT32_MAX))).encode()
        if choice == 3:
            return Setup(offset, session + rng.randrange(2), stream, self._term_id(),
                         self._term_id(),
                         rng.choice((0, TERM_MIN_LENGTH, TERM_MAX_LENGTH, INT32_MAX, 100)),
                         rng.choice((0, 31, 32, 1408, MAX_UDP_PAYLOAD_LENGTH, 1 << 20)),
                         0, 0).encode()
        if choice == 4:
            return StatusMessage(session, stream, self._term_id(), offset, self._value(),
                                 rng.randrange(1 << 62),
                                 rng.choice((0, SM_SEND_SETUP_FLAG))).encode()
        if choice == 5:
            return Nak(session, stream, self._term_id(), offset,
                       rng.choice((1, 32, 1 << 20, 1 << 30, INT32_MAX, -1))).encode()
        if choice == 6:
            return Rttm(session, stream, rng.randrange(1 << 62), rng.randrange(1 << 62),
                        rng.randrange(1 << 62), rng.choice((0, RTTM_REPLY_FLAG))).encode()
        return ErrorFrame(session, stream, rng.randrange(1 << 62), self._value(),
                          "x" * rng.randrange(0, 200)).encode()

    def _hostile_frame(self) -> bytes:
        return self._well_formed()

    def _batch(self) -> bytearray:
        """Up to four DATA frames that tile a datagram, as a sender batches them."""
        rng = self.rng
        out = bytearray()
        offset = rng.randrange(0, 1 << 16, FRAME_ALIGNMENT)
        for _ in range(rng.randrange(1, 5)):
            frame = Data(offset + len(out), self.session_id, self.stream_id, 0,
                         bytes(rng.randrange(0, 300))).encode()
            out += frame + bytes(align(len(frame), FRAME_ALIGNMENT) - len(frame))
        return out

    def _lying_length(self) -> bytes:
        data = self._batch()
        starts = []
        at = 0
        while at + 4 <= len(data):
            starts.append(at)
            length = struct.unpack_from("<i", data, at + FRAME_LENGTH_FIELD)[0]
            at += max(HEADER_LENGTH, align(length, FRAME_ALIGNMENT))
        struct.pack_into("<i", data, self.rng.choice(starts) + FRAME_LENGTH_FIELD, self._value())
        return bytes(data)

    def _wrong_version(self) -> bytes:
        data = bytearray(self._well_formed())
        data[VERSION_FIELD] = self.rng.randrange(1, 256)
        return bytes(data)

    def _unknown_type(self) -> bytes:
        data = bytearray(self._well_formed())
        struct.pack_into("<H", data, TYPE_FIELD, self.rng.choice(
            (HDR_TYPE_RES, HDR_TYPE_ATS_DATA, 0x0C, 0x7FFF, HDR_TYPE_EXT)))
        return bytes(data)

    def _truncated(self) -> bytes:
        data = self._well_formed() if self.rng.random() < 0.5 else bytes(self._batch())
        return data[:self.rng.randrange(len(data))]

    def _bit_flips(self) -> bytes:
        data = bytearray(self._well_formed())
        for _ in range(self.rng.randrange(1, 5)):
            at = self.rng.randrange(len(data))
            data[at] ^= 1 << self.rng.randrange(8)
        return bytes(data)

    def _random_bytes(self) -> bytes:
        return self.rng.randbytes(self.rng.choice((0, 1, 7, 8, 31, 32, 33, 64, 1408, 4000)))


class CommandFuzzer:
    """Hostile control-socket frames (see the module docstring).  ``next()`` returns the
    frames of one zmq message and whether the driver owes an answer (a frame it can parse
    as a JSON object with an integer ``correlation_id``)."""

    _TEMPLATES: Final = (
        {"type": control.ADD_PUBLICATION, "channel": "aeron:ipc", "stream_id": 7},
        {"type": control.ADD_SUBSCRIPTION, "channel": "aeron:ipc", "stream_id": 7},
        {"type": control.REMOVE_PUBLICATION, "registration_id": 1},
        {"type": control.REMOVE_SUBSCRIPTION, "registration_id": 1},
        {"type": control.ADD_COUNTER, "type_id": 1100, "label": "fuzz", "key": "07"},
        {"type": control.REMOVE_COUNTER, "registration_id": 1},
        {"type": control.CONNECT, "version": control.PROTOCOL_VERSION, "pid": 1,
         "process": 1},
    )
    _HOSTILE_VALUES: Final = (None, True, 1.5, "7", [], {}, -1, INT32_MAX + 1, INT32_MIN - 1,
                              2**64,
                              "aeron:udp?endpoint=", "aeron:ipc?term-length=3",
                              "aeron:ipc?" + "x" * 5000, "\u0000", 10**400)

    def __init__(self, seed: int = 1) -> None:
        self.rng = random.Random(seed)
        self.counts: collections.Counter[str] = collections.Counter()
        self._correlation = 1 << 40

    def next(self) -> tuple[list[bytes], bool]:
        rng = self.rng
        choice = rng.randrange(10)
        if choice < 5:
            return self._mutated_command(), True
        kind, frames = [
            ("not JSON", lambda: [rng.randbytes(rng.randrange(1, 64))]),
            ("invalid UTF-8", lambda: [b'{"type": "\xff\xfe"}']),
            ("too deep", lambda: [b"[" * 5000 + b"]" * 5000]),
            ("too large", lambda: [b'{"type": "' + b"x" * 200_000 + b'"}']),
            ("several frames", lambda: [b"{}", b"{}"]),
        ][choice - 5]
        self.counts[kind] += 1
        return frames(), False

    def _mutated_command(self) -> list[bytes]:
        rng = self.rng
        command: dict[str, Any] = dict(rng.choice(self._TEMPLATES))
        self._correlation += 1
        command["correlation_id"] = self._correlation
        how = rng.randrange(4)
        fields = [k for k in command if k != "correlation_id"]
        if how == 0:
            field = rng.choice(fields)
            command[field] = rng.choice(self._HOSTILE_VALUES)
            self.counts["hostile field value"] += 1
        elif how == 1:
            del command[rng.choice(fields)]
            self.counts["missing field"] += 1
        elif how == 2:
            command["type"] = rng.choice(("FORMAT_DISK", "", "add_publication", "x" * 300))
            self.counts["unknown type"] += 1
        else:
            command[rng.choice(("extra", "x" * 100, ""))] = rng.choice(self._HOSTILE_VALUES)
            self.counts["extra field"] += 1
        return [json.dumps(command).encode()]
