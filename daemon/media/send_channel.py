"""A send channel endpoint's dispatcher (sans-I/O): the status messages, NAKs, RTTMs, ERRs and
NAK-strength signals arriving at a send endpoint go to its publications (Aeron's
``aeron_send_channel_endpoint`` dispatch).

Units: times in ns.
"""

from __future__ import annotations

from slipstream.client.counters import SystemCounter
from slipstream.client.frames import (
    ErrorFrame,
    Nak,
    RateSignal,
    Rejected,
    Rttm,
    StatusMessage,
    decode,
)
from slipstream.client.layout import NO_DEADLINE
from slipstream.daemon._network import ffi as network_ffi
from slipstream.daemon._network import lib as network
from slipstream.daemon.media.destinations import ControlMode, DestinationTable
from slipstream.daemon.protocol.types import Address, ProtocolCounters, hash_table_slots
from slipstream.daemon.streams.publication import NetworkPublication


class SendChannel:
    """A send endpoint's dispatcher: routes SM/NAK/RTTM/ERR datagrams to publications by
    (session_id, stream_id); malformed ones count ``INVALID_PACKETS``, and a status message
    that names no publication of the endpoint counts ``UNMATCHED_STATUS_MESSAGES``.  At a
    dynamic multi-destination-cast endpoint an S-flagged SM of session 0 (a receiver that joins
    before it knows a session) names a stream it publishes (any, for stream 0): its source is
    a destination from then on.  NAKs are answered by its C dispatch (:attr:`c`); only those
    that need a timer (a retransmit delay), are malformed or name no publication of the
    endpoint come to :meth:`on_control`.

    ``destinations``: a multi-destination-cast endpoint's table; in dynamic mode every status
    message that names a stream of the endpoint keeps its source a destination
    (:mod:`slipstream.daemon.media.destinations`)."""

    def __init__(self, *, counters: ProtocolCounters,
                 destinations: DestinationTable | None = None) -> None:
        self.counters = counters
        self.destinations = destinations
        self.publications: dict[tuple[int, int], NetworkPublication] = {}
        #: The C dispatch of datagrams arriving at the endpoint (an ``ss_receiver_t`` without
        #: images): it answers NAKs for the publications of its table (:meth:`on_datagram`,
        #: and the socket's receive path).
        self.c = c = network_ffi.new("ss_receiver_t *")
        self._image_slots = network_ffi.new("ss_image_t *[]", 1)
        c.slots = self._image_slots
        c.slot_mask = 0
        c.counters.invalid_packets = counters.address(SystemCounter.INVALID_PACKETS)
        c.counters.receive_errors = counters.address(SystemCounter.RECEIVE_ERRORS)
        c.counters.bytes_received = counters.address(SystemCounter.BYTES_RECEIVED)
        c.fd = -1  # until a transport with a socket attaches
        #: A datagram went to Python (on_control) since the sender's last Python pass: the
        #: simulator's agent then runs that pass.
        self.has_python_work = False
        self._publication_slots = network_ffi.NULL
        self._sync_publications()

    def add_publication(self, publication: NetworkPublication) -> None:
        destinations = self.destinations
        publication.learns_destinations = (destinations is not None
                                           and destinations.mode is ControlMode.DYNAMIC)
        self.publications[publication.session_id, publication.stream_id] = publication
        self._sync_publications()

    def remove_publication(self, publication: NetworkPublication) -> None:
        """Forget ``publication``; from now on no NAK reaches its log (which may go next).
        A newer publication of the same (session, stream) that took its place stays."""
        key = (publication.session_id, publication.stream_id)
        if self.publications.get(key) is publication:
            del self.publications[key]
            self._sync_publications()

    def _sync_publications(self) -> None:
        publications = list(self.publications.values())
        slots = hash_table_slots(len(publications))
        if slots != self.c.publication_mask + 1:
            self._publication_slots = network_ffi.new("ss_send_publication_t *[]", slots)
            self.c.publications = self._publication_slots
            self.c.publication_mask = slots - 1
        table = network_ffi.new("ss_send_publication_t *[]",
                                [p.c for p in publications] or 1)
        if network.ss_receiver_set_publications(self.c, table, len(publications)) != 0:
            raise AssertionError("two publications of one (session, stream)")

    def on_datagram(self, data: bytes | bytearray | memoryview, source: Address,
                    now_ns: int) -> None:
        """One datagram arriving at the endpoint, through the C dispatch (as the socket path
        does) and, unless it answered it there (a NAK), :meth:`on_control`.  The dispatch has
        no images, so it never reads the source address."""
        with network_ffi.from_buffer(data) as buffer:
            verdict = network.ss_receiver_on_datagram(self.c, buffer, len(buffer),
                                                      network_ffi.NULL, 0, now_ns)
        if verdict == network.SS_RX_TO_PYTHON:
            self.on_control(data, source, now_ns)

    def on_control(self, data: bytes | bytearray | memoryview, source: Address,
                   now_ns: int) -> None:
        """A control datagram the C dispatch passed up: an SM, an RTTM, an ERR, a NAK-strength
        signal, or a NAK that needs a timer or is malformed."""
        self.has_python_work = True
        frame = decode(data)
        if isinstance(frame, Rejected):
            self.counters.add(SystemCounter.INVALID_PACKETS)
            return
        if not isinstance(frame, (StatusMessage, Nak, Rttm, ErrorFrame, RateSignal)):
            return  # not for a sender (e.g. our own multicast data looped back)
        self.counters.add(SystemCounter.BYTES_RECEIVED, len(data))
        publication = self.publications.get((frame.session_id, frame.stream_id))
        if publication is not None:
            if isinstance(frame, StatusMessage) and self.destinations is not None:
                self.destinations.on_status_message(source, now_ns)
            publication.on_frame(frame, source, now_ns)
        elif isinstance(frame, StatusMessage):
            # A receiver that joins a dynamic multi-destination-cast endpoint (session 0):
            # a destination from now on, whose first data then elicits each SETUP it wants
            # (its session's own S-flagged SM): a SETUP here for every publication would hold
            # min flow control for streams the receiver never takes.
            joining = (frame.is_setup_request and frame.session_id == 0
                       and self.destinations is not None
                       and any(frame.stream_id in (0, each.stream_id)
                               for each in self.publications.values()))
            if not joining:
                self.counters.add(SystemCounter.UNMATCHED_STATUS_MESSAGES)
                return
            assert self.destinations is not None
            if not self.destinations.on_status_message(source, now_ns) \
                    and source not in self.destinations:
                self.counters.add(SystemCounter.INVALID_PACKETS)  # not an address to send to

    def expire_destinations(self, now_ns: int) -> list[Address]:
        """Dynamic multi-destination-cast: drop the destinations gone silent; returns them."""
        return [] if self.destinations is None else self.destinations.expire(now_ns)

    def next_deadline_ns(self) -> int:
        """When :meth:`expire_destinations` is next due (NO_DEADLINE: never)."""
        return NO_DEADLINE if self.destinations is None else self.destinations.next_expiry_ns()
