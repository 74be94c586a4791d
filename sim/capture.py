"""A packet capture of the virtual network: every delivered or dropped datagram, decoded.

Attach to a network (``Capture.attach(network)``) and read :attr:`Capture.records`: one
:class:`Record` per datagram and outcome, with the first frame's type and fields.  The
timing tests compare these with Aeron's real captures (shared/aeron-captures/*.jsonl).
"""

from __future__ import annotations

import struct
from typing import Final

import attrs

from slipstream.client.frames import Nak, Setup, StatusMessage, decode
from slipstream.sim.network import Address, Network

_HEADER: Final = struct.Struct("<iBBHiiii")
_TYPES: Final = {0x00: "PAD", 0x01: "DATA", 0x02: "NAK", 0x03: "SM", 0x04: "ERR",
                 0x05: "SETUP", 0x06: "RTTM", 0x0B: "RSP_SETUP"}


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
        if len(data) < 8:
            return
        kind_code = data[6] | data[7] << 8
        kind = _TYPES.get(kind_code, f"0x{kind_code:x}")
        flags = data[5]
        session = term_id = term_offset = 0
        length = len(data)
        if kind_code in (0x00, 0x01) and len(data) >= 32:
            frame_length, _v, flags, _t, term_offset, session, _stream, term_id = (
                _HEADER.unpack_from(data))
            if kind_code == 0x01 and frame_length == 0:
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
