"""Codecs for Aeron's UDP frames (docs/PROTOCOL.md §1): one frozen class per frame type, no I/O.

The layouts, types, flags and lengths are :mod:`~slipstream.client.layout`'s (little-endian,
no padding; every frame starts with ``frame_length:i32 version:u8 flags:u8 type:u16``).  All
lengths and offsets are in bytes.

Decoding (the receive path, once per datagram):

* :func:`decode` reads the frame at an offset, :func:`decode_datagram` every frame of a
  datagram.  Malformed input never raises: both return :class:`Rejected` with a reason, which
  the caller counts (Aeron's ``invalid_frames``) and drops.  An exception out of either is a bug.
* :class:`Data` keeps its payload as a ``memoryview`` slice of the datagram (zero copy).  The
  view is only valid while the caller does not reuse that buffer (e.g. ``recv_into`` the same
  ``bytearray``); copy it with ``bytes(frame.payload)`` to keep it longer.
* Control frames (SETUP, SM, NAK, RTTM, ERR, RSP_SETUP, EXT) need ``fixed size <= frame_length
  <= datagram bytes``; bytes past the fixed layout are ignored, as in Aeron, except for an SM
  and a NAK-strength signal, whose length says whether a group tag follows (exactly 8 bytes
  more, or none).  The C driver checks
  ``frame_length`` only for SM and ERR; checking it for all costs nothing and no real sender
  writes it wrong.
* RES (0x07) and ATS (0x08-0x0A) are known types slipstream does not speak: they decode to
  ``Rejected("unsupported frame type ...")``, like unknown types.  EXT (0xFFFF) carries
  slipstream's own frames (docs/PROTOCOL.md §1.11: :class:`RateSignal`, :class:`RateAnnounce`)
  behind a magic number; an EXT frame without it, or of an extension this version does not
  know, is rejected.

Encoding: every frame class has ``encode() -> bytes``, exactly what goes on the wire;
:func:`heartbeat` is the sender's heartbeat datagram.  Field values out of their wire range
raise ``struct.error``: that is a caller bug, not a remote error.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import ClassVar, Final, TypeAlias

import attrs

from slipstream.client.layout import (
    CURRENT_VERSION,
    DATA_HEADER,
    EOS_FLAG,
    ERR_HAS_GROUP_TAG_FLAG,
    ERR_HEADER,
    ERR_HEADER_LENGTH,
    ERR_MAX_TEXT_LENGTH,
    EXT_HEADER,
    EXT_HEADER_LENGTH,
    EXT_MAGIC,
    EXT_TYPE_HANDSHAKE_ANSWER,
    EXT_TYPE_HANDSHAKE_CONFIRM,
    EXT_TYPE_HANDSHAKE_INIT,
    EXT_TYPE_RATE_ANNOUNCE,
    EXT_TYPE_RATE_SIGNAL,
    EXT_TYPE_SEALED,
    EXT_VERSION,
    FRAME_ALIGNMENT,
    FRAME_HEADER,
    FRAME_HEADER_LENGTH,
    HANDSHAKE_ANSWER_LENGTH,
    HANDSHAKE_CONFIRM_LENGTH,
    HANDSHAKE_INIT_LENGTH,
    HDR_TYPE_ATS_DATA,
    HDR_TYPE_ATS_SETUP,
    HDR_TYPE_ATS_SM,
    HDR_TYPE_DATA,
    HDR_TYPE_ERR,
    HDR_TYPE_EXT,
    HDR_TYPE_NAK,
    HDR_TYPE_PAD,
    HDR_TYPE_RES,
    HDR_TYPE_RSP_SETUP,
    HDR_TYPE_RTTM,
    HDR_TYPE_SETUP,
    HDR_TYPE_SM,
    HEADER_LENGTH,
    NAK_FRAME,
    NAK_LENGTH,
    RATE_ANNOUNCE_FRAME,
    RATE_ANNOUNCE_LENGTH,
    RATE_ANNOUNCE_MAX_THRESHOLDS,
    RATE_SIGNAL_FRAME,
    RATE_SIGNAL_GROUP_TAG_LENGTH,
    RATE_SIGNAL_LENGTH,
    RATE_SIGNAL_MAX_RATE,
    RATE_SIGNAL_TAGGED_FRAME,
    RATE_WINDOW_MAX_US,
    RATE_WINDOW_MIN_US,
    RSP_SETUP_FRAME,
    RSP_SETUP_LENGTH,
    RTTM_FRAME,
    RTTM_LENGTH,
    RTTM_REPLY_FLAG,
    SEALED_OVERHEAD,
    SETUP_FRAME,
    SETUP_GROUP_FLAG,
    SETUP_LENGTH,
    SETUP_SEND_RESPONSE_FLAG,
    SM_EOS_FLAG,
    SM_FRAME,
    SM_GROUP_TAG_LENGTH,
    SM_LENGTH,
    SM_SEND_SETUP_FLAG,
    SM_TAGGED_FRAME,
    UNFRAGMENTED,
    align,
)


def _body(frame: struct.Struct, header: struct.Struct = FRAME_HEADER) -> struct.Struct:
    """The fields of ``frame`` after ``header`` (the common one), for the decoders."""
    return struct.Struct("<" + frame.format[len(header.format):])


_DATA_BODY = _body(DATA_HEADER)
_SETUP_BODY = _body(SETUP_FRAME)
_SM_BODY = _body(SM_FRAME)
_I64 = struct.Struct("<q")
_NAK_BODY = _body(NAK_FRAME)
_RTTM_BODY = _body(RTTM_FRAME)
_ERR_BODY = _body(ERR_HEADER)
_RSP_SETUP_BODY = _body(RSP_SETUP_FRAME)
_EXT_BODY = _body(EXT_HEADER)
_RATE_SIGNAL_BODY = _body(RATE_SIGNAL_FRAME, EXT_HEADER)
_RATE_ANNOUNCE_BODY = _body(RATE_ANNOUNCE_FRAME, EXT_HEADER)

_ZEROS = bytes(FRAME_ALIGNMENT)


# -- frames ----------------------------------------------------------------------------------


@attrs.frozen
class Rejected:
    """A datagram or frame that is not valid Aeron; ``reason`` says why, for counters and logs."""

    reason: str


@attrs.frozen
class Data:
    """A DATA frame carrying ``payload`` (frame_length = 32 + len(payload)).

    ``term_offset`` is the frame's offset in its term (bytes, a multiple of 32).  Decoded frames
    hold ``payload`` as a memoryview into the datagram (see the module docstring); ``payload``
    takes no part in hashing because a view of a writable buffer is unhashable.
    """

    term_offset: int
    session_id: int
    stream_id: int
    term_id: int
    payload: bytes | memoryview = attrs.field(default=b"", hash=False)
    flags: int = UNFRAGMENTED
    reserved_value: int = 0

    @property
    def frame_length(self) -> int:
        return HEADER_LENGTH + len(self.payload)

    def encode(self) -> bytes:
        """Header, payload and zero padding up to a multiple of 32 bytes, as the sender sends."""
        length = HEADER_LENGTH + len(self.payload)
        header = DATA_HEADER.pack(length, CURRENT_VERSION, self.flags, HDR_TYPE_DATA,
                                  self.term_offset, self.session_id, self.stream_id, self.term_id,
                                  self.reserved_value)
        return b"".join((header, self.payload, _ZEROS[: -length & (FRAME_ALIGNMENT - 1)]))


@attrs.frozen
class Heartbeat:
    """A DATA frame with frame_length 0, sent alone in a 32-byte datagram at the sender's position.

    With the EOS flag (flags 0xE0) it signals end of stream.
    """

    term_offset: int
    session_id: int
    stream_id: int
    term_id: int
    flags: int = UNFRAGMENTED
    reserved_value: int = 0

    frame_length: ClassVar[int] = 0

    @property
    def is_eos(self) -> bool:
        return bool(self.flags & EOS_FLAG)

    def encode(self) -> bytes:
        return DATA_HEADER.pack(0, CURRENT_VERSION, self.flags, HDR_TYPE_DATA, self.term_offset,
                                self.session_id, self.stream_id, self.term_id,
                                self.reserved_value)


@attrs.frozen
class Pad:
    """A PAD frame: ``align(frame_length)`` bytes of padding in the term, at least its header.

    Padding that ends a term has an aligned length; an aborted claim's keeps the claim's frame
    length (32 + payload bytes), as Aeron's does.  Only the 32-byte header goes on the wire, so
    ``frame_length`` usually exceeds the datagram.
    """

    term_offset: int
    session_id: int
    stream_id: int
    term_id: int
    frame_length: int
    flags: int = UNFRAGMENTED
    reserved_value: int = 0

    def encode(self) -> bytes:
        return DATA_HEADER.pack(self.frame_length, CURRENT_VERSION, self.flags, HDR_TYPE_PAD,
                                self.term_offset, self.session_id, self.stream_id, self.term_id,
                                self.reserved_value)


@attrs.frozen
class Setup:
    """SETUP (40 bytes): the sender announces a stream; ``term_length`` and ``mtu`` in bytes."""

    term_offset: int
    session_id: int
    stream_id: int
    initial_term_id: int
    active_term_id: int
    term_length: int
    mtu: int
    ttl: int = 0
    flags: int = 0

    frame_length: ClassVar[int] = SETUP_LENGTH

    @property
    def is_group(self) -> bool:
        return bool(self.flags & SETUP_GROUP_FLAG)

    @property
    def wants_response(self) -> bool:
        return bool(self.flags & SETUP_SEND_RESPONSE_FLAG)

    def encode(self) -> bytes:
        return SETUP_FRAME.pack(SETUP_LENGTH, CURRENT_VERSION, self.flags, HDR_TYPE_SETUP,
                                self.term_offset, self.session_id, self.stream_id,
                                self.initial_term_id, self.active_term_id, self.term_length,
                                self.mtu, self.ttl)


@attrs.frozen
class StatusMessage:
    """SM: the receiver's consumption position and window (bytes); 36 bytes, 44 with a group tag."""

    session_id: int
    stream_id: int
    consumption_term_id: int
    consumption_term_offset: int
    receiver_window: int
    receiver_id: int
    flags: int = 0
    group_tag: int | None = None

    @property
    def frame_length(self) -> int:
        return SM_LENGTH if self.group_tag is None else SM_LENGTH + SM_GROUP_TAG_LENGTH

    @property
    def is_setup_request(self) -> bool:
        return bool(self.flags & SM_SEND_SETUP_FLAG)

    @property
    def is_eos(self) -> bool:
        return bool(self.flags & SM_EOS_FLAG)

    def encode(self) -> bytes:
        if self.group_tag is None:
            return SM_FRAME.pack(SM_LENGTH, CURRENT_VERSION, self.flags, HDR_TYPE_SM,
                                 self.session_id, self.stream_id, self.consumption_term_id,
                                 self.consumption_term_offset, self.receiver_window,
                                 self.receiver_id)
        return SM_TAGGED_FRAME.pack(SM_LENGTH + SM_GROUP_TAG_LENGTH, CURRENT_VERSION, self.flags,
                                    HDR_TYPE_SM, self.session_id, self.stream_id,
                                    self.consumption_term_id, self.consumption_term_offset,
                                    self.receiver_window, self.receiver_id, self.group_tag)


@attrs.frozen
class Nak:
    """NAK (28 bytes): the receiver asks for ``length`` bytes from ``term_offset`` again."""

    session_id: int
    stream_id: int
    term_id: int
    term_offset: int
    length: int
    flags: int = 0

    frame_length: ClassVar[int] = NAK_LENGTH

    def encode(self) -> bytes:
        return NAK_FRAME.pack(NAK_LENGTH, CURRENT_VERSION, self.flags, HDR_TYPE_NAK,
                              self.session_id, self.stream_id, self.term_id, self.term_offset,
                              self.length)


@attrs.frozen
class Rttm:
    """RTTM (40 bytes): RTT measurement; timestamps in ns of the originator's clock."""

    session_id: int
    stream_id: int
    echo_timestamp: int
    reception_delta: int
    receiver_id: int
    flags: int = 0

    frame_length: ClassVar[int] = RTTM_LENGTH

    @property
    def is_reply(self) -> bool:
        """True when the peer must echo this RTTM back (the REPLY flag)."""
        return bool(self.flags & RTTM_REPLY_FLAG)

    def encode(self) -> bytes:
        return RTTM_FRAME.pack(RTTM_LENGTH, CURRENT_VERSION, self.flags, HDR_TYPE_RTTM,
                               self.session_id, self.stream_id, self.echo_timestamp,
                               self.reception_delta, self.receiver_id)


@attrs.frozen
class ErrorFrame:
    """ERR (40 bytes + text): the receiver rejected the image; ``message`` is at most 1023 bytes
    as UTF-8.

    The HAS_GROUP_TAG flag is derived from ``group_tag is not None``; other flag bits are not
    defined and are dropped on decode.  Invalid UTF-8 decodes with U+FFFD replacements.
    """

    session_id: int
    stream_id: int
    receiver_id: int
    error_code: int
    message: str
    group_tag: int | None = None

    @property
    def flags(self) -> int:
        return 0 if self.group_tag is None else ERR_HAS_GROUP_TAG_FLAG

    @property
    def frame_length(self) -> int:
        return ERR_HEADER_LENGTH + len(self.message.encode())

    def encode(self) -> bytes:
        """Raises ``ValueError`` when the message is longer than 1023 bytes as UTF-8."""
        text = self.message.encode()
        if len(text) > ERR_MAX_TEXT_LENGTH:
            raise ValueError(f"ERR message is {len(text)} bytes; the limit is "
                             f"{ERR_MAX_TEXT_LENGTH}")
        header = ERR_HEADER.pack(ERR_HEADER_LENGTH + len(text), CURRENT_VERSION, self.flags,
                                 HDR_TYPE_ERR, self.session_id, self.stream_id, self.receiver_id,
                                 0 if self.group_tag is None else self.group_tag,
                                 self.error_code, len(text))
        return header + text


@attrs.frozen
class ResponseSetup:
    """RSP_SETUP (20 bytes, docs/PROTOCOL.md §1.9), receiver to sender: the image of
    (``session_id``, ``stream_id``), whose SETUP asked for responses, tells the request
    publication's driver that ``response_session_id`` is the session of the response
    publication made for it, so that the client's response subscription takes that session."""

    session_id: int
    stream_id: int
    response_session_id: int
    flags: int = 0

    frame_length: ClassVar[int] = RSP_SETUP_LENGTH

    def encode(self) -> bytes:
        return RSP_SETUP_FRAME.pack(RSP_SETUP_LENGTH, CURRENT_VERSION, self.flags,
                                    HDR_TYPE_RSP_SETUP, self.session_id, self.stream_id,
                                    self.response_session_id)


@attrs.frozen
class RateSignal:
    """slipstream's NAK-strength signal (EXT, 40 bytes, 48 with a group tag; docs/PROTOCOL.md
    §1.11), receiver to sender: the receiver's image of (session, stream) is
    ``fill_permille`` full (the bytes between its slowest subscriber and its high-water mark,
    per mille of its window, at most 1000) and crossed ``threshold`` percent, one of those
    the sender announced; its slowest subscriber took ``consumption_rate`` bytes/s lately
    (0: not measured yet).  ``group_tag``: the receiver's ``gtag=``, as its SMs carry it (a
    sender under ``fc=tagged`` heeds the signals of its group only)."""

    session_id: int
    stream_id: int
    fill_permille: int
    threshold: int
    consumption_rate: int = 0
    group_tag: int | None = None

    @property
    def frame_length(self) -> int:
        return RATE_SIGNAL_LENGTH + (0 if self.group_tag is None
                                     else RATE_SIGNAL_GROUP_TAG_LENGTH)

    def encode(self) -> bytes:
        fields = (EXT_MAGIC, EXT_TYPE_RATE_SIGNAL, EXT_VERSION, self.session_id, self.stream_id,
                  self.fill_permille, self.threshold, self.consumption_rate)
        if self.group_tag is None:
            return RATE_SIGNAL_FRAME.pack(RATE_SIGNAL_LENGTH, CURRENT_VERSION, 0, HDR_TYPE_EXT,
                                          *fields)
        return RATE_SIGNAL_TAGGED_FRAME.pack(self.frame_length, CURRENT_VERSION, 0,
                                             HDR_TYPE_EXT, *fields, self.group_tag)


@attrs.frozen
class RateAnnounce:
    """slipstream's rate-control announcement (EXT, 32 bytes; docs/PROTOCOL.md §1.11), sender to
    receivers: the sender of (session, stream) adapts its rate to :class:`RateSignal` frames;
    signal when the image crosses each of ``thresholds`` (percent, ascending, at most four)
    and again every ``window_us`` while it stays above one."""

    session_id: int
    stream_id: int
    window_us: int
    thresholds: tuple[int, ...]

    frame_length: ClassVar[int] = RATE_ANNOUNCE_LENGTH

    def encode(self) -> bytes:
        padded = (*self.thresholds, 0, 0, 0, 0)[:RATE_ANNOUNCE_MAX_THRESHOLDS]
        return RATE_ANNOUNCE_FRAME.pack(RATE_ANNOUNCE_LENGTH, CURRENT_VERSION, 0, HDR_TYPE_EXT,
                                        EXT_MAGIC, EXT_TYPE_RATE_ANNOUNCE, EXT_VERSION,
                                        self.session_id, self.stream_id, self.window_us,
                                        *padded)


@attrs.frozen
class Sealed:
    """A sealed datagram of an encrypted channel (docs/CHANNELS.md §7.8), or one of its
    handshake datagrams, as a plain endpoint sees it: ciphertext, opened only by an endpoint
    that holds the key (``key_id``, the header's flags byte)."""

    key_id: int


Frame: TypeAlias = (Data | Heartbeat | Pad | Setup | StatusMessage | Nak | Rttm | ErrorFrame
                    | ResponseSetup | RateSignal | RateAnnounce | Sealed)


def heartbeat(session_id: int, stream_id: int, term_id: int, term_offset: int,
              eos: bool = False) -> bytes:
    """The 32-byte heartbeat datagram for the sender's position; ``eos`` sets flags 0xE0."""
    flags = UNFRAGMENTED | EOS_FLAG if eos else UNFRAGMENTED
    return Heartbeat(term_offset, session_id, stream_id, term_id, flags).encode()


# -- decoding --------------------------------------------------------------------------------

Buffer: TypeAlias = bytes | bytearray | memoryview
#: A frame type's decoder: (data, offset, remaining, frame_length, flags) → frame.
_Decoder: TypeAlias = Callable[[Buffer, int, int, int, int], Frame | Rejected]

_TYPE_NAMES: Final = {
    HDR_TYPE_PAD: "PAD", HDR_TYPE_DATA: "DATA", HDR_TYPE_NAK: "NAK", HDR_TYPE_SM: "SM",
    HDR_TYPE_ERR: "ERR", HDR_TYPE_SETUP: "SETUP", HDR_TYPE_RTTM: "RTTM", HDR_TYPE_RES: "RES",
    HDR_TYPE_ATS_DATA: "ATS_DATA", HDR_TYPE_ATS_SETUP: "ATS_SETUP", HDR_TYPE_ATS_SM: "ATS_SM",
    HDR_TYPE_RSP_SETUP: "RSP_SETUP", HDR_TYPE_EXT: "EXT",
}


def _decode_data_or_pad(data: Buffer, offset: int, remaining: int, frame_length: int,
                        flags: int, is_pad: bool) -> Frame | Rejected:
    name = "PAD" if is_pad else "DATA"
    if remaining < HEADER_LENGTH:
        return Rejected(f"short {name} frame: {remaining} bytes < {HEADER_LENGTH}")
    term_offset, session_id, stream_id, term_id, reserved = _DATA_BODY.unpack_from(
        data, offset + FRAME_HEADER_LENGTH)
    # The receiver copies frames into the term at term_offset: a misaligned or negative offset
    # can only come from a broken sender and would corrupt the term.
    if term_offset < 0 or term_offset & (FRAME_ALIGNMENT - 1):
        return Rejected(f"{name} term_offset {term_offset} is not a non-negative multiple of 32")
    if is_pad:
        if frame_length < HEADER_LENGTH:
            return Rejected(f"PAD frame_length {frame_length} is less than the {HEADER_LENGTH}-"
                            f"byte header")
        return Pad(term_offset, session_id, stream_id, term_id, frame_length, flags, reserved)
    if frame_length == 0:
        if remaining != HEADER_LENGTH:
            return Rejected(f"DATA frame_length 0 with {remaining} bytes: a heartbeat is a "
                            f"datagram of exactly {HEADER_LENGTH} bytes")
        return Heartbeat(term_offset, session_id, stream_id, term_id, flags, reserved)
    if frame_length < HEADER_LENGTH:
        return Rejected(f"DATA frame_length {frame_length} is less than the {HEADER_LENGTH}-byte "
                        f"header")
    if frame_length > remaining:
        if offset == 0:
            return Rejected(f"frame_length {frame_length} exceeds datagram length {remaining}")
        return Rejected(f"frame_length {frame_length} exceeds the {remaining} bytes left at "
                        f"offset {offset}")
    payload = memoryview(data)[offset + HEADER_LENGTH : offset + frame_length]
    return Data(term_offset, session_id, stream_id, term_id, payload, flags, reserved)


def _decode_data(data: Buffer, offset: int, remaining: int, frame_length: int,
                 flags: int) -> Frame | Rejected:
    return _decode_data_or_pad(data, offset, remaining, frame_length, flags, False)


def _decode_pad(data: Buffer, offset: int, remaining: int, frame_length: int,
                flags: int) -> Frame | Rejected:
    return _decode_data_or_pad(data, offset, remaining, frame_length, flags, True)


def _check_control(name: str, size: int, remaining: int, frame_length: int) -> Rejected | None:
    if remaining < size:
        return Rejected(f"short {name}: {remaining} bytes < {size}")
    if frame_length < size:
        return Rejected(f"{name} frame_length {frame_length} is less than {size}")
    if frame_length > remaining:
        return Rejected(f"{name} frame_length {frame_length} exceeds datagram length {remaining}")
    return None


# The decoders below pass a body's fields and the flags as one tuple (``*(*fields, flags)``):
# a type checker cannot count the fields of an unpacked struct, and would refuse a positional
# argument after them.
def _fixed_control(name: str, length: int, body: struct.Struct,
                   frame_class: Callable[..., Frame]) -> _Decoder:
    """The decoder of a control frame of one length whose body's fields, then its flags,
    make ``frame_class``."""
    def decode_fixed(data: Buffer, offset: int, remaining: int, frame_length: int,
                     flags: int) -> Frame | Rejected:
        bad = _check_control(name, length, remaining, frame_length)
        if bad is not None:
            return bad
        return frame_class(*(*body.unpack_from(data, offset + FRAME_HEADER_LENGTH), flags))
    return decode_fixed


def _decode_sm(data: Buffer, offset: int, remaining: int, frame_length: int,
               flags: int) -> Frame | Rejected:
    bad = _check_control("SM", SM_LENGTH, remaining, frame_length)
    if bad is not None:
        return bad
    fields = _SM_BODY.unpack_from(data, offset + FRAME_HEADER_LENGTH)
    extra = frame_length - SM_LENGTH
    if extra == 0:
        return StatusMessage(*(*fields, flags))
    if extra == SM_GROUP_TAG_LENGTH:
        (group_tag,) = _I64.unpack_from(data, offset + SM_LENGTH)
        return StatusMessage(*(*fields, flags, group_tag))
    return Rejected(f"SM group tag length {extra} is not 0 or 8")


def _decode_err(data: Buffer, offset: int, remaining: int, frame_length: int,
                flags: int) -> Frame | Rejected:
    bad = _check_control("ERR", ERR_HEADER_LENGTH, remaining, frame_length)
    if bad is not None:
        return bad
    session_id, stream_id, receiver_id, group_tag, code, text_length = _ERR_BODY.unpack_from(
        data, offset + FRAME_HEADER_LENGTH)
    if not 0 <= text_length <= min(ERR_MAX_TEXT_LENGTH, frame_length - ERR_HEADER_LENGTH):
        return Rejected(f"ERR error_length {text_length} does not fit frame_length "
                        f"{frame_length} (at most {ERR_MAX_TEXT_LENGTH})")
    start = offset + ERR_HEADER_LENGTH
    text = bytes(data[start : start + text_length]).decode("utf-8", "replace")
    tag = group_tag if flags & ERR_HAS_GROUP_TAG_FLAG else None
    return ErrorFrame(session_id, stream_id, receiver_id, code, text, tag)


def _decode_ext(data: Buffer, offset: int, remaining: int, frame_length: int,
                flags: int) -> Frame | Rejected:
    bad = _check_control("EXT", EXT_HEADER_LENGTH, remaining, frame_length)
    if bad is not None:
        return bad
    magic, ext_type, ext_version = _EXT_BODY.unpack_from(data, offset + FRAME_HEADER_LENGTH)
    if magic != EXT_MAGIC:
        return Rejected(f"unsupported frame type 0x{HDR_TYPE_EXT:04x} (EXT) without "
                        f"slipstream's magic")
    if ext_version != EXT_VERSION:
        return Rejected(f"unsupported slipstream extension version {ext_version}")
    body = offset + EXT_HEADER_LENGTH
    if ext_type == EXT_TYPE_RATE_SIGNAL:
        bad = _check_control("rate signal", RATE_SIGNAL_LENGTH, remaining, frame_length)
        if bad is not None:
            return bad
        session_id, stream_id, fill, threshold, rate = _RATE_SIGNAL_BODY.unpack_from(data, body)
        if not 0 <= fill <= 1000 or not 0 < threshold <= 100 or not (
                0 <= rate <= RATE_SIGNAL_MAX_RATE):
            return Rejected(f"rate signal fill {fill} permille, threshold {threshold} % or "
                            f"consumption rate {rate} out of range")
        extra = frame_length - RATE_SIGNAL_LENGTH
        if extra == 0:
            return RateSignal(session_id, stream_id, fill, threshold, rate)
        if extra == RATE_SIGNAL_GROUP_TAG_LENGTH:
            (group_tag,) = _I64.unpack_from(data, offset + RATE_SIGNAL_LENGTH)
            return RateSignal(session_id, stream_id, fill, threshold, rate, group_tag)
        return Rejected(f"rate signal group tag length {extra} is not 0 or 8")
    if ext_type == EXT_TYPE_RATE_ANNOUNCE:
        bad = _check_control("rate announce", RATE_ANNOUNCE_LENGTH, remaining, frame_length)
        if bad is not None:
            return bad
        session_id, stream_id, window_us, *raw = _RATE_ANNOUNCE_BODY.unpack_from(data, body)
        thresholds = tuple(t for t in raw if t)
        if (not RATE_WINDOW_MIN_US <= window_us <= RATE_WINDOW_MAX_US or not thresholds
                or raw[len(thresholds):] != [0] * (len(raw) - len(thresholds))
                or list(thresholds) != sorted(set(thresholds)) or thresholds[-1] > 100):
            return Rejected(f"rate announce window {window_us} us or thresholds {raw} "
                            f"out of range")
        return RateAnnounce(session_id, stream_id, window_us, thresholds)
    if ext_type == EXT_TYPE_SEALED:
        if remaining < SEALED_OVERHEAD or frame_length != remaining:
            return Rejected(f"sealed datagram of {remaining} bytes, frame length {frame_length}")
        return Sealed(flags)
    if ext_type in _HANDSHAKE_LENGTHS:
        if remaining != _HANDSHAKE_LENGTHS[ext_type] or frame_length != remaining:
            return Rejected(f"handshake datagram (type {ext_type}) of {remaining} bytes, frame "
                            f"length {frame_length}")
        return Sealed(flags)
    return Rejected(f"unknown slipstream extension type {ext_type}")


#: An encrypted channel's handshake datagrams (docs/CHANNELS.md §7.8), by extension type:
#: their one length each.
_HANDSHAKE_LENGTHS: Final = {EXT_TYPE_HANDSHAKE_INIT: HANDSHAKE_INIT_LENGTH,
                             EXT_TYPE_HANDSHAKE_ANSWER: HANDSHAKE_ANSWER_LENGTH,
                             EXT_TYPE_HANDSHAKE_CONFIRM: HANDSHAKE_CONFIRM_LENGTH}


# The dispatch table: a type missing here is rejected.
_DECODERS: Final = {
    HDR_TYPE_PAD: _decode_pad,
    HDR_TYPE_DATA: _decode_data,
    HDR_TYPE_NAK: _fixed_control("NAK", NAK_LENGTH, _NAK_BODY, Nak),
    HDR_TYPE_SM: _decode_sm,
    HDR_TYPE_ERR: _decode_err,
    HDR_TYPE_SETUP: _fixed_control("SETUP", SETUP_LENGTH, _SETUP_BODY, Setup),
    HDR_TYPE_RTTM: _fixed_control("RTTM", RTTM_LENGTH, _RTTM_BODY, Rttm),
    HDR_TYPE_RSP_SETUP: _fixed_control("RSP_SETUP", RSP_SETUP_LENGTH, _RSP_SETUP_BODY,
                                       ResponseSetup),
    HDR_TYPE_EXT: _decode_ext,
}


def decode(data: Buffer, offset: int = 0) -> Frame | Rejected:
    """Decode the frame at ``offset``; ``data[offset:]`` is taken as the rest of the datagram.

    Never raises on malformed input; returns :class:`Rejected` instead.  A DATA frame with
    frame_length 0 is a :class:`Heartbeat` only when exactly 32 bytes remain.
    """
    remaining = len(data) - offset
    if offset < 0 or remaining < FRAME_HEADER_LENGTH:
        return Rejected(f"short datagram: {max(remaining, 0)} bytes at offset {offset} < "
                        f"{FRAME_HEADER_LENGTH}-byte frame header")
    frame_length, version, flags, frame_type = FRAME_HEADER.unpack_from(data, offset)
    if version != CURRENT_VERSION:
        return Rejected(f"unsupported version {version}")
    decoder = _DECODERS.get(frame_type)
    if decoder is None:
        name = _TYPE_NAMES.get(frame_type)
        if name is None:
            return Rejected(f"unknown frame type 0x{frame_type:04x}")
        return Rejected(f"unsupported frame type 0x{frame_type:04x} ({name})")
    return decoder(data, offset, remaining, frame_length, flags)


def decode_datagram(data: Buffer) -> list[Frame] | Rejected:
    """Decode a whole datagram: a list of one control frame or heartbeat, or of DATA/PAD frames.

    A DATA datagram holds consecutive frames, each at the previous one's offset plus
    align(frame_length, 32).  They must share session, stream and term id and their
    term_offsets must advance with their offsets in the datagram, because the receiver copies
    the datagram into the term as one block at the first frame's term_offset.  A PAD, whose
    header alone is sent, must end the datagram.  Any bad frame rejects the whole datagram.
    """
    first = decode(data, 0)
    if not isinstance(first, (Data, Pad)):
        return first if isinstance(first, Rejected) else [first]
    frames: list[Frame] = [first]
    total = len(data)
    frame: Data | Pad = first
    position = 0
    while True:
        if isinstance(frame, Pad):
            if position + HEADER_LENGTH < total:
                return Rejected(f"PAD frame at offset {position} is followed by "
                                f"{total - position - HEADER_LENGTH} more bytes")
            return frames
        position += align(frame.frame_length, FRAME_ALIGNMENT)
        if position >= total:
            return frames
        following = decode(data, position)
        if isinstance(following, Rejected):
            return Rejected(f"frame at offset {position}: {following.reason}")
        if not isinstance(following, (Data, Pad)):
            kind = "heartbeat" if isinstance(following, Heartbeat) else type(following).__name__
            return Rejected(f"{kind} frame at offset {position} of a DATA datagram")
        if (following.session_id != first.session_id or following.stream_id != first.stream_id
                or following.term_id != first.term_id):
            return Rejected(f"frame at offset {position} has another session, stream or term id "
                            f"than the first frame")
        if following.term_offset != first.term_offset + position:
            return Rejected(f"frame at offset {position} has term_offset "
                            f"{following.term_offset}, expected {first.term_offset + position}")
        frames.append(following)
        frame = following
