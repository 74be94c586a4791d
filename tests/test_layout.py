"""The wire and log layout is defined once, in slipstream.client.layout: the C hot paths'
``#define``s (client/native.h, daemon/network.h) must agree with it, and the C sources must
read header fields through those names rather than at raw offsets."""

from __future__ import annotations

import re
from itertools import pairwise
from pathlib import Path

import pytest

from slipstream.client import layout, publication
from slipstream.client._native import lib as native
from slipstream.daemon._network import lib as network

ROOT = Path(__file__).resolve().parent.parent
#: Each header and the compiled module whose cffi ``lib`` holds its #defines' values.
HEADERS = {"client/native.h": native, "daemon/network.h": network}
#: An integer #define as the headers write them (the rule of client/_native_build.py).
_DEFINE = re.compile(r"^#define\s+SS_(\w+)\s+\(?-?(?:0[xX][0-9A-Fa-f]+|[0-9]+)\)?\s*(?:/\*.*)?$",
                     re.MULTILINE)
#: The offer() results are the publication's (slipstream.client.publication).
OFFER_RESULTS = ("NOT_CONNECTED", "BACK_PRESSURED", "ADMIN_ACTION", "CLOSED",
                 "MAX_POSITION_EXCEEDED")
#: Defines that are the C code's own (buffer and batch sizes, codes between C and Python that
#: the Python side reads from ``lib``): not layout.
C_ONLY = {
    "INVALID_LENGTH", "INVALID_BATCH",  # native.h: read as lib.SS_INVALID_* by publication.py
    "SEND_BATCH_MAX", "GSO_MAX_SEGMENTS", "GSO_MAX_BYTES", "RETRANSMIT_MAX", "SOCKADDR_MAX",
    "SIGNAL_PENDING_MAX", "RX_CONSUMED", "RX_TO_PYTHON", "RETRANSMIT_ACTIONS_MAX",
    "ACTION_INACTIVE", "ACTION_DELAYED", "ACTION_LINGERING", "LOSS_GAPS_MAX",
    "DUE_COMMANDS", "DUE_INPUT", "DUE_IMAGE", "DUE_PUBLICATION", "DUE_TIMER", "DUE_STOP",
    "MAX_RECEIVE_CALLS",  # network.h: the duty cycle's, read as lib.SS_DUE_* by daemon/agents
    "BANDS", "AGING_NS_PER_POINT", "AGING_MAX",  # network.h: the sender's bands
    "HEARTBEAT_TIMEOUT_NS",  # network.h: read as lib.SS_HEARTBEAT_TIMEOUT_NS by publication.py
    "KEEPER_DRIVER_EXITED", "KEEPER_DRIVER_STOPPED", "KEEPER_DRIVER_REPLACED",  # the keeper's
    "RATE_SIGNAL_GAP_NAKS",  # network.h: the NAK-strength fill's (ss_image_rate_signal_top)
    "RECEIVE_DESTINATIONS_MAX",  # network.h: read as lib.SS_RECEIVE_DESTINATIONS_MAX (MDS)
    "OPEN_PLAIN", "OPEN_UNKNOWN_KEY", "OPEN_FAILED", "OPEN_REPLAY",  # network.h: ss_crypto_open's
    "SCAN_END", "SCAN_TORN", "SCAN_INVALID",  # native.h: ss_scan_recorded's, for the archive
    "MESSAGES_END", "MESSAGES_LIMIT", "MESSAGES_TIME",  # native.h: ss_scan_messages' reasons
    # network.h: the addresses a publication's C half takes NAKs and SMs from (DRIVER.md §5.7)
    "CONTROL_SOURCES_MAX", "CONTROL_SOURCE_LENGTH", "CONTROL_SOURCES_UNKNOWN",
    # network.h: ss_crypto_open's verdict and its sender ids' lifetime (CHANNELS.md §7.8)
    "OPEN_SENDERS_FULL", "OPEN_AWAITING_HANDSHAKE", "OPEN_HANDSHAKE", "OPEN_HANDSHAKE_REFUSED",
    "CRYPTO_SENDER_ID_LIFETIME_S", "CRYPTO_CLOCK_SKEW_S",
    "CRYPTO_SENDER_ID_MAX_AGE_S", "CRYPTO_KEY_LENGTH", "CRYPTO_KEYS_MAX",  # sealing.py's
    "SM_INVALID", "SM_AHEAD_OF_SENDER",  # network.h: ss_publication_status_message's refusals
    "POLL_ENDPOINTS_MIN",  # network.h: from how many endpoints the loop polls its sockets
    "TIMER_SLACK_NS",  # network.h: the loop's keepalive slack (tests/test_driver_idle.py)
    "KEEPALIVE_GRAIN_NS",  # network.h: the loop's keepalive instants (tests/test_driver_idle.py)
    "KEEPALIVE_BURST_MAX",  # network.h: a cycle's keepalives a socket (test_driver_idle.py)
    "POPULATE_STEP",  # native.h: ss_populate's step, read as lib.SS_POPULATE_STEP (logbuffer.py)
}


def _defines(header: str) -> list[str]:
    """The names (without SS_) of the integer #defines of ``header``."""
    return _DEFINE.findall((ROOT / header).read_text())


def _twin(name: str) -> object:
    """The Python value a C define must equal, or None for the C code's own."""
    if name in OFFER_RESULTS:
        return getattr(publication, name)
    return getattr(layout, name, None)


@pytest.mark.parametrize("header", HEADERS)
def test_every_define_of_the_c_headers_agrees_with_the_layout_module(header: str) -> None:
    lib = HEADERS[header]
    names = _defines(header)
    assert names, f"no #define found in {header}"
    wrong, unknown = [], []
    for name in names:
        compiled = getattr(lib, f"SS_{name}")  # the value the C code was compiled with
        expected = _twin(name)
        if expected is None:
            if name not in C_ONLY:
                unknown.append(name)
        elif compiled != expected:
            wrong.append(f"SS_{name} = {compiled}, slipstream.client.layout.{name} = {expected}")
    assert not wrong, f"{header} disagrees with the layout module:\n" + "\n".join(wrong)
    assert not unknown, (f"{header} defines SS_{', SS_'.join(unknown)}: name it after the layout "
                         f"module's constant (SS_<NAME>) or list it in C_ONLY")


def test_the_c_sources_read_header_fields_by_name() -> None:
    """``frame + 12`` or ``data[5]`` would be a layout the test above cannot see."""
    pointer = r"(?:frame|data|datagram|packet|dst|src|base|header|buffer)"
    raw = re.compile(rf"\b{pointer}\s*(?:\+\s*\d+\b|\[\s*\d+\s*\])"
                     r"|\[\s*offset\s*\+\s*\d+\s*\]")
    found = [f"{path}:{number}: {line.strip()}"
             for path in ["client/fastpath.c",
                          *(f"client/{c.name}" for c in sorted((ROOT / "client").glob("native*"))),
                          *(f"daemon/{c.name}" for c in sorted((ROOT / "daemon").glob("*.c")))]
             for number, line in enumerate((ROOT / path).read_text().splitlines(), start=1)
             if raw.search(line)]
    assert not found, "raw header offsets in C (use the SS_*_FIELD names):\n" + "\n".join(found)


def test_the_frame_sizes_are_aerons() -> None:
    assert (layout.FRAME_HEADER_LENGTH, layout.HEADER_LENGTH, layout.SETUP_LENGTH,
            layout.SM_LENGTH, layout.SM_GROUP_TAG_LENGTH, layout.NAK_LENGTH, layout.RTTM_LENGTH,
            layout.ERR_HEADER_LENGTH, layout.RSP_SETUP_LENGTH) == (8, 32, 40, 36, 8, 28, 40, 40, 20)
    assert (layout.FRAME_LENGTH_FIELD, layout.VERSION_FIELD, layout.FLAGS_FIELD,
            layout.TYPE_FIELD, layout.TERM_OFFSET_FIELD, layout.SESSION_ID_FIELD,
            layout.STREAM_ID_FIELD, layout.TERM_ID_FIELD,
            layout.RESERVED_VALUE_FIELD) == (0, 4, 5, 6, 8, 12, 16, 20, 24)
    assert (layout.NAK_SESSION_ID_FIELD, layout.NAK_STREAM_ID_FIELD, layout.NAK_TERM_ID_FIELD,
            layout.NAK_TERM_OFFSET_FIELD, layout.NAK_LENGTH_FIELD) == (8, 12, 16, 20, 24)
    assert layout.HEADER_LENGTH % layout.FRAME_ALIGNMENT == 0


def test_the_metadata_fields_fit_their_page() -> None:
    # LogBuffer.create writes the seven int32s from the initial term id with one pack.
    row = (layout.META_INITIAL_TERM_ID, layout.META_DEFAULT_FRAME_HEADER_LENGTH,
           layout.META_MTU_LENGTH, layout.META_TERM_LENGTH, layout.META_PAGE_SIZE,
           layout.META_PUBLICATION_WINDOW_LENGTH, layout.META_RECEIVER_WINDOW_LENGTH)
    assert list(row) == list(range(row[0], row[0] + 4 * len(row), 4))
    assert layout.META_TAIL_COUNTERS + 8 * layout.PARTITION_COUNT <= layout.META_ACTIVE_TERM_COUNT
    assert layout.META_DEFAULT_FRAME_HEADER + layout.HEADER_LENGTH <= layout.META_LINGER_TIMEOUT_NS
    # The slipstream-local words each have a cache line of their own, inside the page.
    local = (layout.META_READER_SIGNAL, layout.META_READER_WAITERS, layout.META_DRIVER_WAITERS,
             layout.META_DRIVER_WAKE_POSITION, layout.META_PUBLISHER_SIGNAL,
             layout.META_PUBLISHER_WAITERS, layout.META_LIMIT_HIT_POSITION,
             layout.META_LIMIT_HIT_TIME, layout.META_LIMIT_MOVED_TIME,
             layout.META_DURABLE_SIGNAL, layout.META_DURABLE_WAITERS)
    assert layout.META_FLAGS + 8 <= local[0]
    assert all(a % 64 == 0 for a in local) and all(b - a >= 64 for a, b in pairwise(local))
    assert local[-1] + 8 <= layout.LOG_META_DATA_LENGTH
