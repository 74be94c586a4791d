"""The wire and log layout, defined once: Aeron's frames, the log buffer, and the integer
ranges and sentinel that go with them.

The frame codecs (:mod:`~slipstream.client.frames`), the log buffer, the subscriber, the URI
and command checks and the driver import these values; nothing else spells them out.  The C
hot paths repeat the ones they use as ``#define SS_<NAME>`` in ``client/native.h`` and
``daemon/network.h`` (``SS_HEADER_LENGTH`` is :data:`HEADER_LENGTH`), and
``tests/test_layout.py`` checks that every one of those agrees with this module.

Wire facts: little-endian, C ``#pragma pack(4)`` layouts with no padding, which is what the
``"<"`` struct formats below give (so SM's 8-byte ``receiver_id`` sits unaligned at offset
28).  Every frame starts with the 8-byte header ``frame_length:i32 version:u8 flags:u8
type:u16``.  A frame's layout is its struct; the lengths and field offsets are read off it.
All lengths and offsets are in bytes.
"""

from __future__ import annotations

import struct
from typing import Final

# -- integer ranges ----------------------------------------------------------------------------
# Stream and session ids, term ids and offsets are int32 on the wire and in the log; positions,
# correlation ids and tags are int64.

INT32_MIN: Final = -(1 << 31)
INT32_MAX: Final = (1 << 31) - 1
INT64_MIN: Final = -(1 << 63)
INT64_MAX: Final = (1 << 63) - 1
#: "No timer armed" (INT64_MAX): larger than any real deadline, so ``min()`` just works.
NO_DEADLINE: Final = INT64_MAX


def _field_offsets(layout: struct.Struct) -> tuple[int, ...]:
    """The offset of each field of a ``"<"`` layout (no padding: each follows the last)."""
    offsets = []
    at = 0
    for code in layout.format[1:]:
        offsets.append(at)
        at += struct.calcsize("<" + code)
    return tuple(offsets)


# -- the frame header (every frame) ------------------------------------------------------------

FRAME_HEADER: Final = struct.Struct("<iBBH")  # frame_length version flags type
FRAME_HEADER_LENGTH: Final = FRAME_HEADER.size  # 8
FRAME_LENGTH_FIELD, VERSION_FIELD, FLAGS_FIELD, TYPE_FIELD = _field_offsets(FRAME_HEADER)  # 0 4 5 6
CURRENT_VERSION: Final = 0

# Frame types (C AERON_HDR_TYPE_*).
HDR_TYPE_PAD: Final = 0x00
HDR_TYPE_DATA: Final = 0x01
HDR_TYPE_NAK: Final = 0x02
HDR_TYPE_SM: Final = 0x03
HDR_TYPE_ERR: Final = 0x04
HDR_TYPE_SETUP: Final = 0x05
HDR_TYPE_RTTM: Final = 0x06
HDR_TYPE_RES: Final = 0x07
HDR_TYPE_ATS_DATA: Final = 0x08
HDR_TYPE_ATS_SETUP: Final = 0x09  # C numbering; Java swaps 0x09 and 0x0A (unused either way)
HDR_TYPE_ATS_SM: Final = 0x0A
HDR_TYPE_RSP_SETUP: Final = 0x0B
HDR_TYPE_EXT: Final = 0xFFFF  # int16 -1 read as unsigned

# -- DATA and PAD --------------------------------------------------------------------------------
# The 32-byte header of a DATA or PAD frame, in the log and on the wire (DataHeaderFlyweight).

DATA_HEADER: Final = struct.Struct("<iBBHiiiiq")  # + term_offset session stream term_id reserved
HEADER_LENGTH: Final = DATA_HEADER.size  # 32
(TERM_OFFSET_FIELD, SESSION_ID_FIELD, STREAM_ID_FIELD, TERM_ID_FIELD,
 RESERVED_VALUE_FIELD) = _field_offsets(DATA_HEADER)[4:]  # 8 12 16 20 24
#: Frames start at multiples of this in a term and in a datagram.
FRAME_ALIGNMENT: Final = 32

# DATA / PAD flags.
BEGIN_FLAG: Final = 0x80
END_FLAG: Final = 0x40
EOS_FLAG: Final = 0x20
UNFRAGMENTED: Final = BEGIN_FLAG | END_FLAG

# The reserved value's top (sign) bit marks a message whose payload is an envelope (a key and
# headers before the value; slipstream.spark_bridge.envelope); the other 63 bits are the
# publisher's time stamp, ns since the epoch (0: none).  docs/PROTOCOL.md §1.2.
RESERVED_VALUE_ENVELOPE_BIT: Final = -(1 << 63)  # as the int64 the frame carries
RESERVED_VALUE_TIME_MASK: Final = (1 << 63) - 1

# -- control frames ------------------------------------------------------------------------------
# Each struct is the whole fixed frame, header included; its fields after the header are named
# in the comment above it.

# term_offset session_id stream_id initial_term_id active_term_id term_length mtu ttl
SETUP_FRAME: Final = struct.Struct("<iBBHiiiiiiii")
SETUP_LENGTH: Final = SETUP_FRAME.size  # 40
SETUP_SEND_RESPONSE_FLAG: Final = 0x80
SETUP_GROUP_FLAG: Final = 0x40

# session_id stream_id consumption_term_id consumption_term_offset receiver_window receiver_id
# (and group_tag when tagged)
SM_FRAME: Final = struct.Struct("<iBBHiiiiiq")
SM_LENGTH: Final = SM_FRAME.size  # 36
SM_TAGGED_FRAME: Final = struct.Struct("<iBBHiiiiiqq")
SM_GROUP_TAG_LENGTH: Final = SM_TAGGED_FRAME.size - SM_LENGTH  # 8
(SM_SESSION_ID_FIELD, SM_STREAM_ID_FIELD, SM_CONSUMPTION_TERM_ID_FIELD,
 SM_CONSUMPTION_TERM_OFFSET_FIELD, SM_RECEIVER_WINDOW_FIELD,
 SM_RECEIVER_ID_FIELD) = _field_offsets(SM_FRAME)[4:]  # 8 12 16 20 24 28
SM_SEND_SETUP_FLAG: Final = 0x80
SM_EOS_FLAG: Final = 0x40

# session_id stream_id term_id term_offset length
NAK_FRAME: Final = struct.Struct("<iBBHiiiii")
NAK_LENGTH: Final = NAK_FRAME.size  # 28
(NAK_SESSION_ID_FIELD, NAK_STREAM_ID_FIELD, NAK_TERM_ID_FIELD, NAK_TERM_OFFSET_FIELD,
 NAK_LENGTH_FIELD) = _field_offsets(NAK_FRAME)[4:]  # 8 12 16 20 24

# session_id stream_id echo_timestamp reception_delta receiver_id
RTTM_FRAME: Final = struct.Struct("<iBBHiiqqq")
RTTM_LENGTH: Final = RTTM_FRAME.size  # 40
RTTM_REPLY_FLAG: Final = 0x80

# session_id stream_id receiver_id group_tag error_code text_length, then the UTF-8 text
ERR_HEADER: Final = struct.Struct("<iBBHiiqqii")
ERR_HEADER_LENGTH: Final = ERR_HEADER.size  # 40
ERR_MAX_TEXT_LENGTH: Final = 1023
ERR_HAS_GROUP_TAG_FLAG: Final = 0x08
#: ERR frame error codes (Aeron's ErrorCode): a refusal that passes as the receiver's load
#: does (logs in the making, images not yet heard), no room for the image, the image refused.
ERR_CODE_RESOURCE_TEMPORARILY_UNAVAILABLE: Final = 10
ERR_CODE_STORAGE_SPACE: Final = 12
ERR_CODE_IMAGE_REJECTED: Final = 13

# session_id stream_id response_session_id
RSP_SETUP_FRAME: Final = struct.Struct("<iBBHiii")
RSP_SETUP_LENGTH: Final = RSP_SETUP_FRAME.size  # 20

# -- slipstream's extension frames (docs/PROTOCOL.md §1.11) ---------------------------------------
# Aeron's EXT type with a sub-header a stock driver never reads (it drops EXT frames unread):
# frame_length version flags type=EXT magic ext_type ext_version, then the extension's body.

EXT_HEADER: Final = struct.Struct("<iBBHiHH")
EXT_HEADER_LENGTH: Final = EXT_HEADER.size  # 16
EXT_MAGIC: Final = 0x534C5053  # "SLPS" read as a little-endian int32
EXT_VERSION: Final = 1
EXT_TYPE_RATE_SIGNAL: Final = 1  # receiver -> sender: how full the receiver's image is
EXT_TYPE_RATE_ANNOUNCE: Final = 2  # sender -> receivers: signal me, at these thresholds
EXT_MAGIC_FIELD, EXT_TYPE_FIELD, EXT_VERSION_FIELD = _field_offsets(EXT_HEADER)[4:]  # 8 12 14
EXT_TYPE_SEALED: Final = 3  # either way, on an encrypted channel: one datagram sealed whole

# A sealed datagram (docs/CHANNELS.md §7.8): the EXT header, whose flags byte
# is the key id, then the sender id and the sender's datagram counter (the clear header, the
# AEAD's associated data), then the datagram's frames encrypted, then the AEAD tag.
SEALED_HEADER: Final = struct.Struct("<iBBHiHHQQ")
SEALED_HEADER_LENGTH: Final = SEALED_HEADER.size  # 32
SEALED_SENDER_ID_FIELD, SEALED_COUNTER_FIELD = _field_offsets(SEALED_HEADER)[7:]  # 16 24
SEALED_TAG_LENGTH: Final = 16  # AES-256-GCM's
#: What sealing adds to a datagram, bytes.
SEALED_OVERHEAD: Final = SEALED_HEADER_LENGTH + SEALED_TAG_LENGTH  # 48
#: A sender derives a fresh AEAD key every 2^SEALED_EPOCH_BITS datagrams (RFC 9001 section
#: 6.6: AES-GCM's confidentiality limit, 2^23 packets per key).
SEALED_EPOCH_BITS: Final = 23
#: The largest datagram an encrypted endpoint seals (a plain one's largest, sealed).
SEALED_FRAME_MAX: Final = 65536 + SEALED_OVERHEAD

# The handshake of encrypted channels (docs/CHANNELS.md §7.8): Noise_NNpsk0 with the key as
# the pre-shared key, three EXT datagrams whose flags byte is the key id.  INIT: the exchange
# id, the sender id asked for, the initiator's ephemeral public key, its wall clock's
# milliseconds sealed (u64, 8 bytes) and their tag; ANSWER: the
# exchange id, the responder's ephemeral public key, its sender ids sealed; CONFIRM: the
# exchange id, the initiator's sender ids sealed.
EXT_TYPE_HANDSHAKE_INIT: Final = 4  # an endpoint to a peer whose datagrams it cannot open yet
EXT_TYPE_HANDSHAKE_ANSWER: Final = 5  # the peer's answer: its traffic secrets
EXT_TYPE_HANDSHAKE_CONFIRM: Final = 6  # the initiator's traffic secrets
HANDSHAKE_INIT: Final = struct.Struct("<iBBHiHHQQ32s8s16s")
HANDSHAKE_ANSWER: Final = struct.Struct("<iBBHiHHQ32s96s16s")
HANDSHAKE_CONFIRM: Final = struct.Struct("<iBBHiHHQ96s16s")
HANDSHAKE_INIT_LENGTH: Final = HANDSHAKE_INIT.size  # 88
HANDSHAKE_ANSWER_LENGTH: Final = HANDSHAKE_ANSWER.size  # 168
HANDSHAKE_CONFIRM_LENGTH: Final = HANDSHAKE_CONFIRM.size  # 136
HANDSHAKE_EXCHANGE_ID_FIELD: Final = EXT_HEADER_LENGTH  # 16
HANDSHAKE_ASKED_FIELD: Final = HANDSHAKE_EXCHANGE_ID_FIELD + 8  # 24
HANDSHAKE_INIT_EPHEMERAL_FIELD: Final = HANDSHAKE_ASKED_FIELD + 8  # 32
HANDSHAKE_INIT_TIMESTAMP_FIELD: Final = HANDSHAKE_INIT_EPHEMERAL_FIELD + 32  # 64
HANDSHAKE_ANSWER_EPHEMERAL_FIELD: Final = HANDSHAKE_EXCHANGE_ID_FIELD + 8  # 24
HANDSHAKE_CONFIRM_PAYLOAD_FIELD: Final = HANDSHAKE_EXCHANGE_ID_FIELD + 8  # 24

# header, then session_id stream_id fill_permille threshold_percent consumption_rate (bytes/s)
# (and the receiver's group tag when it has one, as an SM's)
RATE_SIGNAL_FRAME: Final = struct.Struct("<iBBHiHHiiiiq")
RATE_SIGNAL_LENGTH: Final = RATE_SIGNAL_FRAME.size  # 40
RATE_SIGNAL_TAGGED_FRAME: Final = struct.Struct("<iBBHiHHiiiiqq")
RATE_SIGNAL_GROUP_TAG_LENGTH: Final = RATE_SIGNAL_TAGGED_FRAME.size - RATE_SIGNAL_LENGTH  # 8
# header, then session_id stream_id window_us thresholds (4 x percent, ascending, 0 = unused)
RATE_ANNOUNCE_FRAME: Final = struct.Struct("<iBBHiHHiiiBBBB")
RATE_ANNOUNCE_LENGTH: Final = RATE_ANNOUNCE_FRAME.size  # 32
RATE_ANNOUNCE_MAX_THRESHOLDS: Final = 4
#: The window an announcement may carry (and ``rc=...,window:`` may ask for), µs: 1 ms to 10 s.
RATE_WINDOW_MIN_US: Final = 1_000
RATE_WINDOW_MAX_US: Final = 10_000_000
#: The largest consumption rate a signal may carry, bytes/s (1 TB/s): anything above is no
#: rate a receiver measured, and would overflow the sender's arithmetic.
RATE_SIGNAL_MAX_RATE: Final = 1 << 40

# -- sizes -----------------------------------------------------------------------------------------

#: The largest UDP payload, so the largest MTU (65535 - 8 UDP - 20 IP, aligned down to 32).
MAX_UDP_PAYLOAD_LENGTH: Final = 65504
#: The largest MTU of an encrypted channel: its sealed datagrams within the largest UDP payload.
SEALED_MTU_MAX: Final = ((MAX_UDP_PAYLOAD_LENGTH - SEALED_OVERHEAD)
                          // FRAME_ALIGNMENT * FRAME_ALIGNMENT)  # 65440
#: A message is at most min(term_length / 8, this).
MAX_MESSAGE_LENGTH: Final = 16 * 1024 * 1024

# -- the log buffer ------------------------------------------------------------------------------
# [term 0][term 1][term 2][metadata], file length align(3 * term_length + 4096, page_size).

PARTITION_COUNT: Final = 3
TERM_MIN_LENGTH: Final = 64 * 1024
TERM_MAX_LENGTH: Final = 1024 * 1024 * 1024
PAGE_MIN_SIZE: Final = 4096
LOG_META_DATA_LENGTH: Final = 4096

# Offsets in the metadata page (aeron_logbuffer_metadata_t; C SS_META_*).
META_TAIL_COUNTERS: Final = 0  # int64 x 3, one raw tail per partition
META_ACTIVE_TERM_COUNT: Final = 24
META_END_OF_STREAM_POSITION: Final = 128
META_IS_CONNECTED: Final = 136
META_ACTIVE_TRANSPORT_COUNT: Final = 140
META_CORRELATION_ID: Final = 256
META_INITIAL_TERM_ID: Final = 264
META_DEFAULT_FRAME_HEADER_LENGTH: Final = 268
META_MTU_LENGTH: Final = 272
META_TERM_LENGTH: Final = 276
META_PAGE_SIZE: Final = 280
META_PUBLICATION_WINDOW_LENGTH: Final = 284
META_RECEIVER_WINDOW_LENGTH: Final = 288
META_MAX_RESEND: Final = 316
META_DEFAULT_FRAME_HEADER: Final = 320
META_LINGER_TIMEOUT_NS: Final = 464
#: One byte each: group, is_response, rejoin, reliable, sparse, signal_eos, spies_simulate_
#: connection, tether.
META_FLAGS: Final = 488
# slipstream-local, in the unused tail of the page (not part of Aeron's wire contract, which is
# only about frames): the eventcount parked readers wait on, and how many of the driver's
# network threads are parked on the log and from which subscriber position they want their
# doorbell rung (see native.h); the eventcount publishers that wait for credit park on, and the
# limit a publisher last met, with when (CLOCK_MONOTONIC ns), for the driver's episodes, and
# when the driver last moved pub-lmt.
META_READER_SIGNAL: Final = 1024
META_READER_WAITERS: Final = 1088
META_DRIVER_WAITERS: Final = 1152
META_DRIVER_WAKE_POSITION: Final = 1216
META_PUBLISHER_SIGNAL: Final = 1280
META_PUBLISHER_WAITERS: Final = 1344
META_LIMIT_HIT_POSITION: Final = 1408
META_LIMIT_HIT_TIME: Final = 1472
META_LIMIT_MOVED_TIME: Final = 1536  # when the driver last moved pub-lmt
#: The eventcount publishers waiting for a durable position park on (durable=; the driver bumps
#: it as it moves pub-durable), and how many are parked.
META_DURABLE_SIGNAL: Final = 1600
META_DURABLE_WAITERS: Final = 1664


#: A publication's ``priority=`` (its band in the sender, docs/BACKPRESSURE.md; C SS_PRIORITY_*).
PRIORITY_MIN: Final = -1000
PRIORITY_MAX: Final = 1000


def align(value: int, alignment: int) -> int:
    """``value`` rounded up to a multiple of ``alignment`` (a power of two)."""
    return (value + alignment - 1) & -alignment


def max_message_length(term_length: int) -> int:
    """Largest message a publication with this term length accepts: min(term/8, 16 MiB)."""
    return min(term_length // 8, MAX_MESSAGE_LENGTH)


def resend_reach(term_length: int) -> int:
    """How far behind its position a sender still resends (bytes): half a term and one
    message (docs/DRIVER.md §3.5; the C data path's ``ss_resend`` window)."""
    return (term_length >> 1) + max_message_length(term_length)
