"""Wire codecs (docs/PROTOCOL.md §1): captured aeronmd traffic, round trips, and hostile input."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slipstream.client.frames import (
    Data,
    ErrorFrame,
    Frame,
    Heartbeat,
    Nak,
    Pad,
    RateAnnounce,
    RateSignal,
    Rejected,
    ResponseSetup,
    Rttm,
    Setup,
    StatusMessage,
    decode,
    decode_datagram,
    heartbeat,
)
from slipstream.client.layout import (
    CURRENT_VERSION,
    ERR_HAS_GROUP_TAG_FLAG,
    FRAME_ALIGNMENT,
    HDR_TYPE_RSP_SETUP,
    HEADER_LENGTH,
    INT32_MAX,
    INT32_MIN,
    INT64_MAX,
    INT64_MIN,
    RATE_SIGNAL_MAX_RATE,
    RATE_WINDOW_MAX_US,
    RATE_WINDOW_MIN_US,
    RSP_SETUP_FRAME,
    RSP_SETUP_LENGTH,
    UNFRAGMENTED,
    align,
)

CAPTURES = Path(__file__).resolve().parent / "data" / "aeron-captures"


def _capture_files() -> list[Path]:
    """The captures (copied from shared/aeron-captures into the repository)."""
    return sorted(CAPTURES.glob("*.jsonl")) or [CAPTURES / "missing.jsonl"]


def _load(path: Path) -> list[dict[str, Any]]:
    lines = path.read_text().splitlines()  # a missing capture fails: they ship with the tests
    header, *datagrams = (json.loads(line) for line in lines if line.strip())
    assert "hex" not in header
    return datagrams


def _encode(frame: Frame) -> bytes:
    """``frame`` as it goes on the wire."""
    return frame.encode()


_WIRE_TYPES = {Data: "DATA", Heartbeat: "DATA", Pad: "PAD", Setup: "SETUP", StatusMessage: "SM",
               Nak: "NAK", Rttm: "RTTM", ErrorFrame: "ERR", ResponseSetup: "RSP_SETUP",
               RateSignal: "EXT", RateAnnounce: "EXT"}


def _as_captured(frame: Frame, offset: int) -> dict[str, Any]:
    """The frame in the captures' vocabulary (see aeron-captures/*.jsonl)."""
    fields: dict[str, Any] = {"off": offset, "len": frame.frame_length, "ver": 0,
                              "flags": f"0x{frame.flags:02x}", "type": _WIRE_TYPES[type(frame)]}
    if isinstance(frame, (Data, Heartbeat, Pad)):
        fields.update(term_offset=frame.term_offset, session=frame.session_id,
                      stream=frame.stream_id, term_id=frame.term_id,
                      reserved=frame.reserved_value)
        if not isinstance(frame, Pad):
            fields["heartbeat"] = isinstance(frame, Heartbeat)
    elif isinstance(frame, Setup):
        fields.update(term_offset=frame.term_offset, session=frame.session_id,
                      stream=frame.stream_id, initial_term_id=frame.initial_term_id,
                      active_term_id=frame.active_term_id, term_length=frame.term_length,
                      mtu=frame.mtu, ttl=frame.ttl)
    elif isinstance(frame, StatusMessage):
        fields.update(session=frame.session_id, stream=frame.stream_id,
                      consumption_term_id=frame.consumption_term_id,
                      consumption_term_offset=frame.consumption_term_offset,
                      receiver_window=frame.receiver_window, receiver_id=frame.receiver_id)
        if frame.group_tag is not None:
            fields["group_tag"] = frame.group_tag
    elif isinstance(frame, Nak):
        fields.update(session=frame.session_id, stream=frame.stream_id, term_id=frame.term_id,
                      term_offset=frame.term_offset, length=frame.length)
    else:  # no RTTM, ERR or RSP_SETUP in the captures so far
        raise AssertionError(f"no capture vocabulary for {frame!r}")
    return fields


@pytest.mark.parametrize("path", _capture_files(), ids=lambda p: p.name)
def test_captured_datagrams_decode_to_the_captured_fields_and_encode_back(path: Path) -> None:
    datagrams = _load(path)
    assert datagrams
    for number, datagram in enumerate(datagrams, start=2):  # line numbers in the file
        wire = bytes.fromhex(datagram["hex"])
        frames = decode_datagram(wire)
        assert isinstance(frames, list), f"line {number}: {frames}"
        expected = [dict(f, heartbeat=f.get("heartbeat", False)) if f["type"] == "DATA" else f
                    for f in datagram["frames"]]
        offsets = [f["off"] for f in datagram["frames"]]
        assert [_as_captured(f, o) for f, o in zip(frames, offsets, strict=True)] == expected, \
            f"line {number}"
        assert b"".join(_encode(f) for f in frames) == wire, f"line {number}"


def test_captured_data_payload_is_a_zero_copy_view() -> None:
    wire = bytes.fromhex("2e00000000c001000000000027265706e9030000f28f46f2000000000000000048656c6c"
                         "6f20576f726c64212031000000000000000000000000000000000000")
    frames = decode_datagram(wire)
    assert isinstance(frames, list)
    (frame,) = frames
    assert isinstance(frame, Data)
    assert isinstance(frame.payload, memoryview)
    assert frame.payload.obj is wire
    assert bytes(frame.payload) == b"Hello World! 1"
    assert frame.frame_length == 46 and len(wire) == 64


# -- round trips --------------------------------------------------------------------------

int32 = st.integers(INT32_MIN, INT32_MAX)
int64 = st.integers(INT64_MIN, INT64_MAX)
uint8 = st.integers(0, 255)
aligned_offset = st.integers(0, INT32_MAX // FRAME_ALIGNMENT).map(lambda n: n * FRAME_ALIGNMENT)

frames_strategy = st.one_of(
    st.builds(Data, aligned_offset, int32, int32, int32, st.binary(max_size=300), uint8, int64),
    st.builds(Heartbeat, aligned_offset, int32, int32, int32, uint8, int64),
    st.builds(Pad, aligned_offset, int32, int32, int32,
              st.integers(1, INT32_MAX // FRAME_ALIGNMENT).map(lambda n: n * FRAME_ALIGNMENT),
              uint8, int64),
    st.builds(Setup, int32, int32, int32, int32, int32, int32, int32, int32, uint8),
    st.builds(StatusMessage, int32, int32, int32, int32, int32, int64, uint8,
              st.none() | int64),
    st.builds(Nak, int32, int32, int32, int32, int32, uint8),
    st.builds(Rttm, int32, int32, int64, int64, int64, uint8),
    st.builds(ErrorFrame, int32, int32, int64, int32,
              st.text(max_size=200).filter(lambda t: len(t.encode()) <= 1023),
              st.none() | int64),
    st.builds(ResponseSetup, int32, int32, int32, uint8),
    st.builds(RateSignal, int32, int32, st.integers(0, 1000), st.integers(1, 100),
              st.integers(0, RATE_SIGNAL_MAX_RATE), st.none() | int64),
    st.builds(RateAnnounce, int32, int32, st.integers(RATE_WINDOW_MIN_US, RATE_WINDOW_MAX_US),
              st.lists(st.integers(1, 100), min_size=1, max_size=4, unique=True).map(
                  lambda t: tuple(sorted(t)))),
)


@settings(max_examples=400, deadline=None)
@given(frames_strategy)
def test_every_frame_type_round_trips(frame: Frame) -> None:
    wire = _encode(frame)
    assert decode(wire) == frame
    assert decode_datagram(wire) == [frame]
    assert decode(b"\xff" * 8 + wire, 8) == frame


@settings(max_examples=100, deadline=None)
@given(aligned_offset.filter(lambda n: n < 2**30), int32, int32, int32,
       st.lists(st.binary(max_size=100), min_size=1, max_size=5), st.booleans())
def test_a_data_datagram_with_several_frames_round_trips(
        term_offset: int, session: int, stream: int, term_id: int, payloads: list[bytes],
        end_with_pad: bool) -> None:
    frames: list[Frame] = []
    position = 0
    for payload in payloads:
        frames.append(Data(term_offset + position, session, stream, term_id, payload))
        position += align(HEADER_LENGTH + len(payload), FRAME_ALIGNMENT)
    if end_with_pad:
        frames.append(Pad(term_offset + position, session, stream, term_id, 4096))
    wire = b"".join(f.encode() for f in frames)
    assert decode_datagram(wire) == frames


def test_heartbeat_helper_and_eos() -> None:
    wire = heartbeat(7, 1001, -5, 576)
    assert len(wire) == HEADER_LENGTH
    assert decode(wire) == Heartbeat(576, 7, 1001, -5, UNFRAGMENTED)
    eos = decode(heartbeat(7, 1001, -5, 576, eos=True))
    assert isinstance(eos, Heartbeat) and eos.is_eos and eos.flags == 0xE0
    assert not Heartbeat(0, 0, 0, 0).is_eos


def test_flag_properties() -> None:
    assert Setup(0, 1, 2, 3, 3, 65536, 1408, 0, 0x40).is_group
    assert Setup(0, 1, 2, 3, 3, 65536, 1408, 0, 0x80).wants_response
    assert StatusMessage(1, 2, 3, 0, 0, 9, 0x80).is_setup_request
    assert StatusMessage(1, 2, 3, 0, 0, 9, 0x40).is_eos
    assert Rttm(1, 2, 3, 0, 9, 0x80).is_reply
    assert StatusMessage(1, 2, 3, 0, 0, 9, group_tag=5).frame_length == 44
    assert ErrorFrame(1, 2, 3, 13, "rejected", group_tag=1).flags == ERR_HAS_GROUP_TAG_FLAG
    assert ErrorFrame(1, 2, 3, 13, "rejected").flags == 0


def test_rsp_setup_is_aerons_twenty_bytes() -> None:
    # ResponseSetupFlyweight: session at 8, stream at 12, response session at 16.
    wire = ResponseSetup(-7, 1002, 123456).encode()
    assert len(wire) == RSP_SETUP_LENGTH == 20
    assert RSP_SETUP_FRAME.unpack(wire) == (20, CURRENT_VERSION, 0, HDR_TYPE_RSP_SETUP, -7,
                                            1002, 123456)
    assert wire[6:8] == b"\x0b\x00"
    assert decode(wire) == ResponseSetup(-7, 1002, 123456)


def test_error_frame_text_limit_is_enforced_on_encode() -> None:
    with pytest.raises(ValueError, match="1023"):
        ErrorFrame(1, 2, 3, 13, "x" * 1024).encode()


# -- hostile input ---------------------------------------------------------------------------

_VALID = [Data(64, 1, 2, 3, b"hello").encode(), heartbeat(1, 2, 3, 0),
          Pad(64, 1, 2, 3, 1024).encode(), Setup(0, 1, 2, 3, 3, 65536, 1408).encode(),
          StatusMessage(1, 2, 3, 0, 131072, 9, group_tag=4).encode(), Nak(1, 2, 3, 64, 64).encode(),
          Rttm(1, 2, 3, 4, 5, 0x80).encode(), ErrorFrame(1, 2, 3, 13, "no").encode(),
          _encode(ResponseSetup(1, 2, 3))]


@st.composite
def _mutated(draw: st.DrawFn) -> bytes:
    data = bytearray(draw(st.sampled_from(_VALID)))
    for _ in range(draw(st.integers(1, 4))):
        data[draw(st.integers(0, len(data) - 1))] = draw(uint8)
    cut = draw(st.integers(0, len(data) + 8))
    return bytes(data[:cut]) + draw(st.binary(max_size=8))


@settings(max_examples=600, deadline=None)
@given(st.one_of(st.binary(max_size=200), _mutated()))
def test_decode_datagram_never_raises(data: bytes) -> None:
    result = decode_datagram(data)
    if isinstance(result, Rejected):
        assert result.reason
    else:
        assert result and all(type(f) in _WIRE_TYPES for f in result)
    for offset in (0, 8, 32, len(data), len(data) + 5, -1):
        assert isinstance(decode(data, offset), (Rejected, *_WIRE_TYPES))


def _header(frame_length: int, frame_type: int, flags: int = 0, version: int = 0) -> bytes:
    return struct.pack("<iBBH", frame_length, version, flags, frame_type)


def _with(wire: bytes, offset: int, fmt: str, value: int) -> bytes:
    data = bytearray(wire)
    struct.pack_into(fmt, data, offset, value)
    return bytes(data)


DATA_46 = Data(0, 1, 2, 3, b"x" * 14).encode()  # 46-byte frame in a 64-byte datagram

MALFORMED = {
    "empty": (b"", "short datagram: 0 bytes"),
    "short": (b"\x00" * 5, "short datagram: 5 bytes"),
    "version": (_with(heartbeat(1, 2, 3, 0), 4, "<B", 3), "unsupported version 3"),
    "unknown type": (_header(8, 0x42), "unknown frame type 0x0042"),
    "RES": (_header(8, 0x07), "unsupported frame type 0x0007 (RES)"),
    "ATS": (_header(8, 0x09), "unsupported frame type 0x0009"),
    "short EXT": (_header(8, 0xFFFF), "short EXT: 8 bytes < 16"),
    "EXT of another kind": (_with(RateSignal(1, 2, 3, 50).encode(), 8, "<i", 7),
                            "0xffff (EXT) without slipstream's magic"),
    "EXT of an unknown extension": (_with(RateSignal(1, 2, 3, 50).encode(), 12, "<H", 9),
                                    "unknown slipstream extension type 9"),
    "EXT of a later version": (_with(RateSignal(1, 2, 3, 50).encode(), 14, "<H", 2),
                               "extension version 2"),
    "short rate signal": (_with(RateSignal(1, 2, 3, 50).encode()[:36], 0, "<i", 36),
                          "short rate signal: 36 bytes < 40"),
    "rate signal rate": (_with(RateSignal(1, 2, 3, 50).encode(), 32, "<q", -1),
                         "consumption rate -1"),
    "rate signal fill": (_with(RateSignal(1, 2, 3, 50).encode(), 24, "<i", 1001),
                         "fill 1001 permille"),
    "rate signal threshold": (_with(RateSignal(1, 2, 3, 50).encode(), 28, "<i", 0),
                              "threshold 0 %"),
    "rate signal half a group tag": (_with(RateSignal(1, 2, 3, 50, 0, 7).encode()[:44], 0,
                                           "<i", 44),
                                     "rate signal group tag length 4 is not 0 or 8"),
    "rate announce window": (_with(RateAnnounce(1, 2, 50, (50,)).encode(), 24, "<i", 999),
                             "rate announce window 999 us"),
    "rate announce long window": (_with(RateAnnounce(1, 2, 50, (50,)).encode(), 24, "<i",
                                        10_000_001), "window 10000001 us"),
    "rate signal huge rate": (_with(RateSignal(1, 2, 3, 50).encode(), 32, "<q", (1 << 40) + 1),
                              "consumption rate 1099511627777"),
    "rate announce thresholds": (_with(RateAnnounce(1, 2, 5000, (50, 75)).encode(), 28, "<B",
                                       80), "out of range"),
    "rate announce hole": (_with(RateAnnounce(1, 2, 5000, (50,)).encode(), 30, "<B", 80),
                           "out of range"),
    "short DATA": (_header(20, 1) + bytes(12), "short DATA frame: 20 bytes < 32"),
    "lying DATA length": (_with(DATA_46, 0, "<i", 900),
                          "frame_length 900 exceeds datagram length 64"),
    "DATA length inside header": (_with(DATA_46, 0, "<i", 12), "DATA frame_length 12"),
    "negative DATA length": (_with(DATA_46, 0, "<i", -46), "DATA frame_length -46"),
    "misaligned term offset": (_with(DATA_46, 8, "<i", 33), "term_offset 33"),
    "long heartbeat": (heartbeat(1, 2, 3, 0) + bytes(32), "heartbeat is a datagram of exactly"),
    "PAD length": (_with(Pad(0, 1, 2, 3, 64).encode(), 0, "<i", 16), "PAD frame_length 16"),
    "short SETUP": (Setup(0, 1, 2, 3, 3, 65536, 1408).encode()[:36], "short SETUP: 36 bytes < 40"),
    "short SM": (StatusMessage(1, 2, 3, 0, 0, 9).encode()[:30], "short SM: 30 bytes < 36"),
    "SM tag length": (_with(StatusMessage(1, 2, 3, 0, 0, 9).encode() + bytes(4), 0, "<i", 40),
                      "SM group tag length 4 is not 0 or 8"),
    "SM lying length": (_with(StatusMessage(1, 2, 3, 0, 0, 9).encode(), 0, "<i", 44),
                        "SM frame_length 44 exceeds datagram length 36"),
    "SM length too small": (_with(StatusMessage(1, 2, 3, 0, 0, 9).encode(), 0, "<i", 20),
                            "SM frame_length 20 is less than 36"),
    "short NAK": (Nak(1, 2, 3, 0, 64).encode()[:27], "short NAK: 27 bytes < 28"),
    "short RTTM": (Rttm(1, 2, 3, 4, 5).encode()[:39], "short RTTM"),
    "short RSP_SETUP": (_encode(ResponseSetup(1, 2, 3))[:16], "short RSP_SETUP"),
    "ERR text overruns": (_with(ErrorFrame(1, 2, 3, 13, "abc").encode(), 36, "<i", 50),
                          "ERR error_length 50"),
    "ERR negative text": (_with(ErrorFrame(1, 2, 3, 13, "abc").encode(), 36, "<i", -1),
                          "ERR error_length -1"),
    "trailing garbage after DATA": (DATA_46 + b"\x01\x02", "frame at offset 64: short datagram"),
    "zero frame after DATA": (DATA_46 + bytes(32), "frame at offset 64: PAD frame_length 0"),
    "heartbeat after DATA": (DATA_46 + heartbeat(1, 2, 3, 64), "heartbeat frame at offset 64"),
    "SM after DATA": (DATA_46 + StatusMessage(1, 2, 3, 0, 0, 9).encode(),
                      "StatusMessage frame at offset 64"),
    "other session after DATA": (DATA_46 + Data(64, 9, 2, 3, b"y").encode(),
                                 "another session, stream or term id"),
    "gap in term offsets": (DATA_46 + Data(128, 1, 2, 3, b"y").encode(),
                            "has term_offset 128, expected 64"),
    "bytes after PAD": (Pad(0, 1, 2, 3, 64).encode() + bytes(32), "PAD frame at offset 0 is "
                                                                  "followed by 32 more bytes"),
}


@pytest.mark.parametrize("name", MALFORMED)
def test_malformed_datagrams_are_rejected_with_a_reason(name: str) -> None:
    data, reason = MALFORMED[name]
    result = decode_datagram(data)
    assert isinstance(result, Rejected), result
    assert reason in result.reason


def test_decode_at_offset_reports_the_bytes_left() -> None:
    wire = bytes(16) + _with(DATA_46, 0, "<i", 900)
    result = decode(wire, 16)
    assert result == Rejected("frame_length 900 exceeds the 64 bytes left at offset 16")


def test_trailing_bytes_after_a_control_frame_are_ignored() -> None:
    sm = StatusMessage(1, 2, 3, 0, 131072, 9)
    assert decode_datagram(sm.encode() + b"\x00" * 8) == [sm]


def test_invalid_utf8_in_error_text_does_not_raise() -> None:
    wire = bytearray(ErrorFrame(1, 2, 3, 13, "ab").encode())
    wire[40] = 0xFF
    frame = decode(bytes(wire))
    assert isinstance(frame, ErrorFrame) and frame.message == "\ufffdb"
