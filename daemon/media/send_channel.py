"""A send channel endpoint's dispatcher (sans-I/O): the status messages, NAKs, RTTMs, ERRs and
NAK-strength signals arriving at a send endpoint go to its publications (Aeron's
``aeron_send_channel_endpoint`` dispatch); an RSP_SETUP for a request publication becomes a
:class:`ResponseSetupArrived` for the conductor; a response publication learns its one
destination here (docs/PROTOCOL.md §7.6).

Units: times in ns.
"""

from __future__ import annotations

from slipstream.client.counters import SystemCounter
from slipstream.client.frames import (
    ErrorFrame,
    Nak,
    RateSignal,
    Rejected,
    ResponseSetup,
    Rttm,
    StatusMessage,
    decode,
)
from slipstream.client.layout import NO_DEADLINE
from slipstream.daemon._network import ffi as network_ffi
from slipstream.daemon._network import lib as network
from slipstream.daemon.media.destinations import ControlMode, DestinationTable
from slipstream.daemon.media.events import ResponseSetupArrived
from slipstream.daemon.protocol.types import (
    Address,
    ProtocolCounters,
    hash_table_slots,
    sockaddr,
)
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
                 destinations: DestinationTable | None = None,
                 response_ip_version: int | None = None) -> None:
        """``response_ip_version``: a response endpoint's (``control-mode=response``) socket's
        IP version; each of its publications gets a table of its own, of one destination of
        that version (None: not a response endpoint)."""
        self.counters = counters
        self.destinations = destinations
        self.response_ip_version = response_ip_version
        self.publications: dict[tuple[int, int], NetworkPublication] = {}
        #: A response endpoint's publications' own tables (each one's C half sends to it).
        self._response_tables: dict[NetworkPublication, DestinationTable] = {}
        #: The receiver id a response publication's destination was learned from.
        self._response_receivers: dict[NetworkPublication, int] = {}
        #: RSP_SETUPs for request publications since the sender last looked.
        self.response_setups: list[ResponseSetupArrived] = []
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
        # A response publication reads its SMs in Python too: each one's source may move its
        # destination (_learn_response_destination).
        publication.learns_destinations = (
            (destinations is not None and destinations.mode is ControlMode.DYNAMIC)
            or self.response_ip_version is not None)
        self.publications[publication.session_id, publication.stream_id] = publication
        if self.response_ip_version is not None:
            table = DestinationTable(ControlMode.RESPONSE, ip_version=self.response_ip_version)
            self._response_tables[publication] = table
            publication.c.destinations = table.c
        self._sync_publications()

    def remove_publication(self, publication: NetworkPublication) -> None:
        """Forget ``publication``; from now on no NAK reaches its log (which may go next).
        A newer publication of the same (session, stream) that took its place stays."""
        key = (publication.session_id, publication.stream_id)
        if self.publications.get(key) is publication:
            del self.publications[key]
            self._sync_publications()
        self._response_receivers.pop(publication, None)
        table = self._response_tables.pop(publication, None)
        if table is not None:
            publication.c.destinations = network_ffi.NULL  # the table goes with it

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
        does) and, unless it answered it there (a NAK), :meth:`on_control`.  The dispatch
        reads the source address: a NAK counts only from a receiver's."""
        raw = sockaddr(source)
        with network_ffi.from_buffer(data) as buffer:
            verdict = network.ss_receiver_on_datagram(self.c, buffer, len(buffer), raw,
                                                      len(raw), now_ns)
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
        if not isinstance(frame, (StatusMessage, Nak, Rttm, ErrorFrame, RateSignal,
                                  ResponseSetup)):
            return  # not for a sender (e.g. our own multicast data looped back)
        self.counters.add(SystemCounter.BYTES_RECEIVED, len(data))
        publication = self.publications.get((frame.session_id, frame.stream_id))
        if isinstance(frame, ResponseSetup):
            # Aeron's onResponseSetup: only a request publication's has a use; another
            # (stale, or for a publication without response-correlation-id) is dropped, and
            # so is one from a source that is none of its receivers (that sent it no SM: a
            # multicast or multi-destination-cast socket takes datagrams from anyone).
            if (publication is not None and publication.params.sends_response_setup
                    and publication.has_receiver_at(source)):
                correlation_id = publication.response_correlation_id
                assert correlation_id is not None
                self.response_setups.append(
                    ResponseSetupArrived(correlation_id, frame.response_session_id))
            return
        if publication is not None:
            if isinstance(frame, StatusMessage) and not publication.admits_status_message(
                    frame, source, now_ns):
                return  # a live receiver's id from another address: forged or stray, counted
            if isinstance(frame, StatusMessage) and self.destinations is not None:
                self.destinations.on_status_message(source, now_ns)
            table = self._response_tables.get(publication)
            if (table is not None and isinstance(frame, StatusMessage)
                    and not self._learn_response_destination(publication, table, frame,
                                                             source)):
                return
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

    def _learn_response_destination(self, publication: NetworkPublication,
                                    table: DestinationTable, sm: StatusMessage,
                                    source: Address) -> bool:
        """A status message for response publication ``publication`` (docs/PROTOCOL.md §7.6):
        whether it goes on to the publication.  A setup-eliciting one makes its source the one
        destination, unless the destination has a live receiver and the SM is another
        receiver's (a stray or forged one would take the stream from its client for good);
        any SM of that live receiver from a new source moves the destination there (the
        client's NAT gave it a new port)."""
        receiver_id = self._response_receivers.get(publication)
        live = receiver_id is not None and publication.has_live_receiver(receiver_id)
        if live and sm.receiver_id != receiver_id:
            # Another receiver's, while the stream has its client: a stray or forged one.
            self.counters.add(SystemCounter.UNMATCHED_STATUS_MESSAGES)
            return False
        if not sm.is_setup_request and not live:
            return True  # only a setup request names a new client
        if not table.learn_response_destination(source):
            self.counters.add(SystemCounter.INVALID_PACKETS)  # not an address to send to
            return False
        self._response_receivers[publication] = sm.receiver_id
        return True

    def expire_destinations(self, now_ns: int) -> list[Address]:
        """Dynamic multi-destination-cast: drop the destinations gone silent; returns them."""
        return [] if self.destinations is None else self.destinations.expire(now_ns)

    def next_deadline_ns(self) -> int:
        """When :meth:`expire_destinations` is next due (NO_DEADLINE: never)."""
        return NO_DEADLINE if self.destinations is None else self.destinations.next_expiry_ns()
