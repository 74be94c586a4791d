"""A packet capture of the virtual network: every delivered or dropped datagram, decoded.

Attach to a network (``Capture.attach(network)``) and read :attr:`Capture.records`: one
:class:`Record` per datagram and outcome, with the first frame's type and fields.  The
timing tests compare these with Aeron's real captures (shared/aeron-captures/*.jsonl).
"""

from __future__ import annotations

from typing import Final

import attrs

from slipstream.client.frames import Nak, Setup, StatusMessage, decode
from slipstream.client.layout import (
    DATA_HEADER,
    FRAME_HEADER,
    FRAME_HEADER_LENGTH,
    HDR_TYPE_DATA,
    HDR_TYPE_ERR,
    HDR_TYPE_NAK,
    HDR_TYPE_PAD,
    HDR_TYPE_RSP_SETUP,
    HDR_TYPE_RTTM,
    HDR_TYPE_SETUP,
    HDR_TYPE_SM,
    HEADER_LENGTH,
)
from slipstream.sim.network import Address, Network

#: The types slipstream speaks; any other is recorded by its code ("0x7").
_TYPES: Final = {HDR_TYPE_PAD: "PAD", HDR_TYPE_DATA: "DATA", HDR_TYPE_NAK: "NAK",
                 HDR_TYPE_SM: "SM", HDR_TYPE_ERR: "ERR", HDR_TYPE_SETUP: "SETUP",
                 HDR_TYPE_RTTM: "RTTM", HDR_TYPE_RSP_SETUP: "RSP_SETUP"}


@attrs.frozen
class Record:
    """One datagram outcome.  ``kind`` is DATA, HB (heartbeat), PAD, SETUP, SM, NAK, ...;
    ``length`` is the DATA datagram length or the NAK's gap length (bytes); times in ns."""

    t_ns: int
    event: str  # "deliver" or a drop reason
    src: Address
    dst: Address
    kind: str
    flags: int
    session_id: int
    term_id: int
    term_offset: int
    length: int

    @property
    def delivered(self) -> bool:
        return self.event == "deliver"


class Capture:
    """Collects :class:`Record` values from a :class:`Network`'s trace events."""

    def __init__(self) -> None:
        self.records: list[Record] = []

    def attach(self, network: Network) -> Capture:
        network.observers.append(self.on_event)
        return self

    def on_event(self, t_ns: int, event: str, source: Address, destination: Address,
                 data: bytes) -> None:
        if len(data) < FRAME_HEADER_LENGTH:
            return
        frame_length, _version, flags, kind_code = FRAME_HEADER.unpack_from(data)
        kind = _TYPES.get(kind_code, f"0x{kind_code:x}")
        session = term_id = term_offset = 0
        length = len(data)
        if kind_code in (HDR_TYPE_PAD, HDR_TYPE_DATA) and len(data) >= HEADER_LENGTH:
            (_length, _version, _flags, _type, term_offset, session, _stream, term_id,
             _reserved) = DATA_HEADER.unpack_from(data)
            if kind_code == HDR_TYPE_DATA and frame_length == 0:
                kind = "HB"
        else:
            frame = decode(data)
            if isinstance(frame, Nak):
                session, term_id, term_offset = frame.session_id, frame.term_id, \
                    frame.term_offset
                length = frame.length
            elif isinstance(frame, StatusMessage):
                session, term_id, term_offset = (frame.session_id, frame.consumption_term_id,
                                                 frame.consumption_term_offset)
                length = frame.receiver_window
            elif isinstance(frame, Setup):
                session, term_id, term_offset = (frame.session_id, frame.active_term_id,
                                                 frame.term_offset)
        self.records.append(Record(t_ns, event, source, destination, kind, flags, session,
                                   term_id, term_offset, length))

    def select(self, kind: str | None = None, *, delivered: bool | None = True,
               src: str | None = None) -> list[Record]:
        """Records of ``kind`` (any if None), delivered or not, from host ``src`` (an IP)."""
        return [r for r in self.records
                if (kind is None or r.kind == kind)
                and (delivered is None or r.delivered == delivered)
                and (src is None or r.src[0] == src)]
