"""A send channel endpoint's dispatcher (sans-I/O): the status messages, NAKs, RTTMs, ERRs and
NAK-strength signals arriving at a send endpoint go to its publications (Aeron's
``aeron_send_channel_endpoint`` dispatch); an RSP_SETUP for a request publication becomes a
:class:`ResponseSetupArrived` for the conductor (an event of :mod:`.events`, defined here,
where it is made); a response publication learns its one destination here (docs/CHANNELS.md
§7.6); a dynamic multi-destination-cast endpoint's new sources validate here before they are
destinations (§7.4.1).

Units: times in ns.
"""

from __future__ import annotations

import logging

import attrs

from slipstream.client.counters import SystemCounter
from slipstream.client.frames import (
    ErrorFrame,
    Heartbeat,
    Nak,
    RateSignal,
    Rejected,
    ResponseSetup,
    Rttm,
    Sealed,
    StatusMessage,
    decode,
)
from slipstream.client.layout import NO_DEADLINE, RTTM_REPLY_FLAG
from slipstream.daemon._network import ffi as network_ffi
from slipstream.daemon._network import lib as network
from slipstream.daemon.media.destinations import ControlMode, DestinationTable, Heard
from slipstream.daemon.media.slot_table import SlotTable
from slipstream.daemon.protocol.types import (
    Address,
    Datagram,
    ProtocolCounters,
    sockaddr,
)
from slipstream.daemon.streams.publication import NetworkPublication

log = logging.getLogger("slipstream.driver")


@attrs.frozen
class ResponseSetupArrived:
    """The conductor's event (:mod:`.events`) for an RSP_SETUP for a request publication of
    this endpoint: the server made response publication session ``response_session_id`` for
    it, and the response subscription whose registration id is ``response_correlation_id``
    is to take that session (Aeron's DriverConductor.responseSetup)."""

    response_correlation_id: int
    response_session_id: int


class SendChannel:
    """A send endpoint's dispatcher: routes SM/NAK/RTTM/ERR datagrams to publications by
    (session_id, stream_id); malformed ones count ``INVALID_PACKETS``, and a status message
    that names no publication of the endpoint counts ``UNMATCHED_STATUS_MESSAGES``.  At a
    dynamic multi-destination-cast endpoint an S-flagged SM of session 0 (a receiver that joins
    before it knows a session) names a stream it publishes (any, for stream 0): its source is
    a candidate, a destination once validated.  NAKs are answered by its C dispatch
    (:attr:`c`); only those that need a timer (a retransmit delay), are malformed or name no
    publication of the endpoint come to :meth:`on_control`.

    ``destinations``: a multi-destination-cast endpoint's table; in dynamic mode every status
    message that names a stream of the endpoint keeps its source a destination, or makes it a
    candidate, which must validate first (:mod:`slipstream.daemon.media.destinations`): until
    then what comes from it goes no further than this object, and it is sent the validation
    probes only (:attr:`challenges`)."""

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
        #: The validation probes for the dynamic table's candidates since the sender last
        #: looked: each frame to one candidate, sent through its publication's send (past the
        #: endpoint's destinations), already charged to the candidate's 3x allowance.
        self.challenges: list[tuple[NetworkPublication, Datagram]] = []
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
        self._publication_table = SlotTable("ss_send_publication_t", "publications",
                                            "publication_mask",
                                            network.ss_receiver_set_publications)
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
        self._publication_table.load(self.c, [p.c for p in self.publications.values()])

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
        if isinstance(frame, Sealed):  # an encrypted channel's, at this plain endpoint
            self.counters.add(SystemCounter.CRYPTO_SEALED_AT_PLAIN_DROPS)
            return
        if isinstance(frame, Rejected):
            self.counters.add(SystemCounter.INVALID_PACKETS)
            return
        if not isinstance(frame, (StatusMessage, Nak, Rttm, ErrorFrame, RateSignal,
                                  ResponseSetup)):
            return  # not for a sender (e.g. our own multicast data looped back)
        self.counters.add(SystemCounter.BYTES_RECEIVED, len(data))
        table = self.destinations
        if (table is not None and table.mode is ControlMode.MANUAL
                and isinstance(frame, StatusMessage)):
            table.heard(source, now_ns)
        if table is not None and table.mode is ControlMode.DYNAMIC:
            if source not in table:
                self._from_unvalidated(table, frame, len(data), source, now_ns)
                return
            if table.is_candidate(source) and self._validates(table, frame, source, now_ns):
                log.info("dynamic destination %s:%d validated for the receiver that joined "
                         "there anew", source[0], source[1])
                return
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
            if (isinstance(frame, StatusMessage) and table is not None
                    and table.mode is ControlMode.DYNAMIC
                    and not self._keeps_destination(table, frame, source, now_ns, len(data))):
                return
            if isinstance(frame, StatusMessage) and not publication.admits_status_message(
                    frame, source, now_ns):
                return  # a live receiver's id from another address: forged or stray, counted
            response_table = self._response_tables.get(publication)
            if (response_table is not None and isinstance(frame, StatusMessage)
                    and not self._learn_response_destination(publication, response_table,
                                                             frame, source)):
                return
            publication.on_frame(frame, source, now_ns)
        elif isinstance(frame, StatusMessage):
            # A validated receiver of a dynamic endpoint that joins another stream (session
            # 0): it stays a destination, whose data then elicits each SETUP it wants (its
            # session's own S-flagged SM): a SETUP here for every publication would hold min
            # flow control for streams the receiver never takes.
            if not self._joined_publications(frame):
                self.counters.add(SystemCounter.UNMATCHED_STATUS_MESSAGES)
                return
            assert table is not None
            self._keeps_destination(table, frame, source, now_ns, len(data))

    def _keeps_destination(self, table: DestinationTable, sm: StatusMessage, source: Address,
                           now_ns: int, length: int) -> bool:
        """A validated destination's status message keeps it alive, if it names the receiver
        the destination validated with; one naming another (a forger keeping a receiver
        that left) is dropped and counted.  Returns whether it goes on."""
        heard = table.on_status_message(source, now_ns, length, receiver_id=sm.receiver_id,
                                        joining=sm.is_setup_request and sm.session_id == 0)
        if heard is Heard.UNKNOWN_RECEIVER:
            self.counters.add(SystemCounter.MDC_UNKNOWN_RECEIVER_DROPS)
            return False
        if heard is Heard.REJOINING:  # another receiver at its address: validate it first
            publications = self._joined_publications(sm)
            if publications:
                self._probe(table, sm, publications, source, now_ns)
            return False
        return True

    @staticmethod
    def _validates(table: DestinationTable, frame: object, source: Address,
                   now_ns: int) -> bool:
        """Whether ``frame``, from a destination's address where another receiver is
        validating, is that receiver's answer to a probe, which validated it."""
        if isinstance(frame, StatusMessage) and frame.is_setup_request:
            return table.on_token(source, frame.session_id, now_ns,
                                  receiver_id=frame.receiver_id)
        if isinstance(frame, Rttm) and not frame.is_reply:
            return table.on_token(source, frame.echo_timestamp, now_ns,
                                  receiver_id=frame.receiver_id)
        return False

    def _joined_publications(self, sm: StatusMessage) -> list[NetworkPublication]:
        """The publications a dynamic endpoint's status message names: its session's, or for
        a joining receiver's (S-flagged, session 0) each of its stream (any, for stream
        0)."""
        if self.destinations is None or self.destinations.mode is not ControlMode.DYNAMIC:
            return []
        named = self.publications.get((sm.session_id, sm.stream_id))
        if named is not None:
            return [named]
        if not (sm.is_setup_request and sm.session_id == 0):
            return []
        return [each for each in self.publications.values()
                if sm.stream_id in (0, each.stream_id)]

    def _from_unvalidated(self, table: DestinationTable, frame: object, length: int,
                          source: Address, now_ns: int) -> None:
        """A control frame at a dynamic endpoint from ``source``, no validated destination
        (docs/CHANNELS.md §7.4.1).  Outside the ``join=`` subnets it is dropped.  A status
        message naming a stream of the endpoint makes its source a candidate (or adds to one's
        allowance) and is answered, within the 3x allowance, by a probe carrying the
        candidate's token: a joining receiver's (session 0) by a heartbeat of each stream it
        names whose session is the token, and from its second on also by each publication's
        SETUP (a receiver that takes one session only answers no heartbeat of another); an
        SM of a session asking for its SETUP by that SETUP; any other SM of a session (its
        receiver has an image) by an RTTM request echoing the token.  The SM asking for the
        token's SETUP, or the RTTM echo of the token, from the candidate's address validates
        it.  Nothing of a candidate's reaches a publication (its flow control would count a
        receiver the data does not reach).  An RTTM request is not answered (the echo would
        go to an unvalidated address); NAKs, ERRs and rate signals go on as from anyone."""
        if not table.admits(source):
            self.counters.add(SystemCounter.MDC_JOIN_SUBNET_DROPS)
            return
        if isinstance(frame, StatusMessage):
            if frame.is_setup_request and table.on_token(source, frame.session_id, now_ns,
                                                         receiver_id=frame.receiver_id):
                log.info("dynamic destination %s:%d validated", source[0], source[1])
                return
            publications = self._joined_publications(frame)
            if not publications:
                self.counters.add(SystemCounter.UNMATCHED_STATUS_MESSAGES)
                return
            heard = table.on_status_message(
                source, now_ns, length, receiver_id=frame.receiver_id,
                joining=frame.is_setup_request and frame.session_id == 0)
            if heard is Heard.UNSENDABLE:
                self.counters.add(SystemCounter.INVALID_PACKETS)  # not an address to send to
                return
            if heard is Heard.REPLACED:  # the oldest candidate made room for this one
                self.counters.add(SystemCounter.MDC_CANDIDATES_REFUSED)
            self._probe(table, frame, publications, source, now_ns)
        elif isinstance(frame, Rttm):
            if (not frame.is_reply and (frame.session_id, frame.stream_id) in self.publications
                    and table.on_token(source, frame.echo_timestamp, now_ns,
                                       receiver_id=frame.receiver_id)):
                log.info("dynamic destination %s:%d validated", source[0], source[1])
            elif frame.is_reply:
                self.counters.add(SystemCounter.MDC_AMPLIFICATION_DROPS)  # its echo, withheld
        elif not isinstance(frame, ResponseSetup):
            publication = self.publications.get((frame.session_id, frame.stream_id))
            if publication is not None:
                publication.on_frame(frame, source, now_ns)

    def _probe(self, table: DestinationTable, sm: StatusMessage,
               publications: list[NetworkPublication], candidate: Address,
               now_ns: int) -> None:
        """Answer candidate ``candidate``'s status message ``sm`` (naming ``publications``)
        with the probes :meth:`_from_unvalidated` describes."""
        token = table.token_of(candidate)
        if sm.session_id == 0:
            probed = set()
            for publication in publications:
                if publication.stream_id not in probed:
                    probed.add(publication.stream_id)
                    probe = Heartbeat(0, token, publication.stream_id, 0)
                    self._challenge(table, publication, probe.encode(), candidate)
            if table.status_messages_of(candidate) < 2:
                return  # a receiver of any session answers the heartbeat at once
            for publication in publications:
                self._challenge(table, publication, publication.setups.frame(), candidate,
                                setup_at_ns=now_ns)
        elif sm.is_setup_request:
            [publication] = publications
            self._challenge(table, publication, publication.setups.frame(), candidate,
                            setup_at_ns=now_ns)
        else:
            [publication] = publications
            request = Rttm(publication.session_id, publication.stream_id, token, 0, 0,
                           RTTM_REPLY_FLAG)
            self._challenge(table, publication, request.encode(), candidate)

    def _challenge(self, table: DestinationTable, publication: NetworkPublication,
                   frame: bytes, candidate: Address, setup_at_ns: int | None = None) -> None:
        """Send ``frame`` to ``candidate`` if its 3x allowance has room, else count it.
        ``setup_at_ns``: the frame is the publication's SETUP, sent at that time."""
        if table.may_send(candidate, len(frame)):
            self.challenges.append((publication, Datagram(frame, candidate)))
            if setup_at_ns is not None:
                publication.setups.sent(setup_at_ns)
        else:
            self.counters.add(SystemCounter.MDC_AMPLIFICATION_DROPS)

    def _learn_response_destination(self, publication: NetworkPublication,
                                    table: DestinationTable, sm: StatusMessage,
                                    source: Address) -> bool:
        """A status message for response publication ``publication`` (docs/CHANNELS.md §7.6):
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
        """Dynamic multi-destination-cast: drop the destinations gone silent, and the
        candidates that did not validate in time (counted); returns the destinations."""
        table = self.destinations
        if table is None:
            return []
        unvalidated = table.expire_candidates(now_ns)
        if unvalidated:
            self.counters.add(SystemCounter.MDC_UNVALIDATED_DROPS, len(unvalidated))
        return table.expire(now_ns)

    def next_deadline_ns(self) -> int:
        """When :meth:`expire_destinations` is next due (NO_DEADLINE: never)."""
        return NO_DEADLINE if self.destinations is None else self.destinations.next_expiry_ns()
