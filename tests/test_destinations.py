"""A multi-destination-cast endpoint's destination table (daemon/media/destinations.py) and
how its dispatcher learns from status messages (daemon/media/send_channel.py), in process.

The table is checked against a model under any sequence of operations (hypothesis): what
it holds, what its C table holds (what ss_send_channel_send sends to), the mdc-destinations
cell, and when a dynamic destination expires.
"""

from __future__ import annotations

import socket
import uuid
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slipstream.client.channel import parse_channel
from slipstream.client.counters import SystemCounter
from slipstream.client.frames import ResponseSetup, Setup, StatusMessage, decode
from slipstream.client.layout import NO_DEADLINE, SM_SEND_SETUP_FLAG
from slipstream.client.logbuffer import LogBuffer
from slipstream.daemon._network import ffi as network_ffi
from slipstream.daemon.config import DriverSettings
from slipstream.daemon.flow.registry import flow_control_for
from slipstream.daemon.media import send_point
from slipstream.daemon.media.destinations import (
    ALL_DESTINATIONS,
    DESTINATION_TIMEOUT_NS,
    ControlMode,
    DestinationTable,
)
from slipstream.daemon.media.events import ResponseSetupArrived
from slipstream.daemon.media.send_channel import SendChannel
from slipstream.daemon.protocol.params import PublicationParams
from slipstream.daemon.protocol.types import Address, Datagram, LocalCounters, address_of
from slipstream.daemon.streams.publication import NetworkPublication, SenderPositions

S = 1_000_000_000
ADDRESSES = [("127.0.0.1", 40000 + i) for i in range(4)] + [("::1", 40100), ("10.0.0.3", 9)]
#: Sources a dynamic table never learns: another IP version, port 0, a group, the broadcast
#: address, the wildcard.
NOT_DESTINATIONS = [("::1", 40100), ("127.0.0.1", 0), ("224.0.1.1", 40000),
                    ("255.255.255.255", 9), ("0.0.0.0", 9)]


def c_addresses(table: DestinationTable) -> list[Address]:
    """What the C half sends to, in its order."""
    c = table.c
    return [address_of(bytes(network_ffi.buffer(c.entries[i].address, c.entries[i].length)))
            for i in range(c.count)]


operations = st.lists(st.tuples(st.sampled_from(["add", "remove", "sm", "expire"]),
                                st.sampled_from(ADDRESSES + NOT_DESTINATIONS),
                                st.integers(min_value=0, max_value=3 * S)), max_size=40)


@settings(max_examples=200, deadline=None)
@given(mode=st.sampled_from(list(ControlMode)), ops=operations)
def test_the_table_and_its_c_view_follow_every_operation(mode: ControlMode, ops) -> None:
    cell = network_ffi.new("int64_t *")
    table = DestinationTable(mode, count_cell=cell)
    model: dict[Address, int] = {}  # address -> last seen
    now = 0
    for op, address, step in ops:
        now += step
        if op == "add":
            assert table.add(address, now) == (address not in model)
            model.setdefault(address, now)
        elif op == "remove":
            assert table.remove(address) == (address in model)
            model.pop(address, None)
        elif op == "sm":
            new = table.on_status_message(address, now)
            if mode is ControlMode.DYNAMIC and (address in model
                                                or address not in NOT_DESTINATIONS):
                assert new == (address not in model)
                model[address] = now
            else:  # a manual table learns nothing from status messages, nor from a bad source
                assert not new
        else:
            gone = table.expire(now)
            expected = ([a for a, seen in model.items() if now - seen >= DESTINATION_TIMEOUT_NS]
                        if mode is ControlMode.DYNAMIC else [])
            assert sorted(gone) == sorted(expected)
            for a in expected:
                del model[a]
        assert table.addresses == list(model)
        assert c_addresses(table) == list(model)
        assert cell[0] == len(model)
        if mode is ControlMode.DYNAMIC and model:
            assert table.next_expiry_ns() == min(model.values()) + DESTINATION_TIMEOUT_NS
        else:
            assert table.next_expiry_ns() == NO_DEADLINE


def _publication(shm: Path, counters: LocalCounters,
                 uri: str = "aeron:udp?control=127.0.0.1:40456|control-mode=dynamic",
                 session_id: int = 5) -> NetworkPublication:
    log = LogBuffer.create(shm / f"{uuid.uuid4().hex}.log", term_length=64 * 1024,
                           initial_term_id=10, session_id=session_id, stream_id=6, mtu=1408,
                           correlation_id=1)
    channel = parse_channel(uri)
    settings = DriverSettings(term_buffer_length=64 * 1024)
    params = PublicationParams.for_network(channel, settings)
    return NetworkPublication(log=log, params=params, settings=settings,
                              positions=SenderPositions.in_process(),
                              flow_control=flow_control_for(params), counters=counters,
                              now_ns=0, destination=ALL_DESTINATIONS)


def test_a_dynamic_endpoint_learns_only_from_status_messages_that_name_its_streams(
        shm: Path) -> None:
    """A setup-eliciting SM (session 0, stream 0 or the stream's id) and an SM of one of its
    publications make their source a destination, unless it is no address to send to; an SM
    of a session it does not have (a forged one) is counted and teaches nothing, and its
    publications take the SMs C would otherwise take (``sm_in_c`` stays off: every SM keeps a
    destination alive)."""
    counters = LocalCounters()
    table = DestinationTable(ControlMode.DYNAMIC)
    channel = SendChannel(counters=counters, destinations=table)
    publication = _publication(shm, counters)
    channel.add_publication(publication)
    assert publication.learns_destinations
    joining, member, forger = ("127.0.0.1", 50001), ("127.0.0.1", 50002), ("127.0.0.1", 50003)

    forged = StatusMessage(999, 6, 10, 0, 65536, 3, 0)
    channel.on_control(forged.encode(), forger, 1)
    assert table.addresses == [] and counters[SystemCounter.UNMATCHED_STATUS_MESSAGES] == 1
    other_stream = StatusMessage(0, 7, 0, 0, 0, 3, SM_SEND_SETUP_FLAG)
    channel.on_control(other_stream.encode(), forger, 2)
    assert table.addresses == [] and counters[SystemCounter.UNMATCHED_STATUS_MESSAGES] == 2

    # A joining receiver is a destination; its session-0 SM elicits no SETUP (its data
    # will, per session it wants): a SETUP here would hold fc=min for streams it never takes.
    elicit = StatusMessage(0, 0, 0, 0, 0, 1, SM_SEND_SETUP_FLAG)
    for bad_source in (("127.0.0.1", 0), ("224.0.1.1", 5000), ("::1", 5000)):
        channel.on_control(elicit.encode(), bad_source, 3)
    assert table.addresses == [] and counters[SystemCounter.INVALID_PACKETS] == 3
    channel.on_control(elicit.encode(), joining, 3)
    assert table.addresses == [joining] and not publication.is_setup_elicited
    sm = StatusMessage(5, 6, 10, 0, 65536, 2, 0)
    channel.on_control(sm.encode(), member, 4)
    assert table.addresses == [joining, member]

    channel.on_control(sm.encode(), member, 4 * S)  # the member stays, the other goes quiet
    assert channel.expire_destinations(5 * S + 2) == []
    assert channel.expire_destinations(5 * S + 3) == [joining]
    assert channel.next_deadline_ns() == 9 * S
    publication.sync_c_half()
    assert not publication.c.sm_in_c


def _receive_all(sock: socket.socket) -> list[bytes]:
    sock.settimeout(0.5)
    out = []
    try:
        while True:
            out.append(sock.recv(2048))
            sock.settimeout(0.05)
    except TimeoutError:
        return out


def test_the_python_halfs_frames_go_to_each_destination_through_the_c_send(
        shm: Path) -> None:
    """The send channel endpoint's send in C fans the Python half's frames out
    (daemon/media/send_point.py): one to the publication's destination (SETUP,
    ALL_DESTINATIONS) reaches every destination of the table, one to its own address (an
    RTTM reply to its receiver) that address only; each is counted as sent; a table without
    destinations sends nothing (a response publication before its client asked)."""
    counters = LocalCounters()
    receivers = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(4)]
    sender = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        for sock in receivers:
            sock.bind(("127.0.0.1", 0))
        addresses = [sock.getsockname() for sock in receivers]
        table = DestinationTable(ControlMode.MANUAL)
        publication = _publication(shm, counters, "aeron:udp?control-mode=manual")
        send_point.attach_publication(publication, fd=sender.fileno(), table=table)
        send_point.send_publication_frames(publication, [Datagram(b"none", ALL_DESTINATIONS)])
        assert counters[SystemCounter.BYTES_SENT] == 0

        for address in addresses[:3]:
            table.add(address, 0)
        assert send_point.destinations_of(publication) == addresses[:3]
        send_point.send_publication_frames(publication, [
            Datagram(b"setup", ALL_DESTINATIONS), Datagram(b"rttm", addresses[3])])
        assert [_receive_all(sock) for sock in receivers] == [
            [b"setup"], [b"setup"], [b"setup"], [b"rttm"]]
        assert counters[SystemCounter.BYTES_SENT] == 3 * len(b"setup") + len(b"rttm")
        assert counters[SystemCounter.SEND_ERRORS] == 0
    finally:
        for sock in (*receivers, sender):
            sock.close()


def _destination_of(publication: NetworkPublication) -> Address | None:
    """Where a response publication's C half sends (None: nowhere yet)."""
    destinations = send_point.destinations_of(publication)
    assert len(destinations) <= 1
    return destinations[0] if destinations else None


RESPONSE_URI = "aeron:udp?control-mode=response|control=127.0.0.1:40456|response-correlation-id=77"


def test_each_response_publication_sends_to_the_one_client_that_asked(shm: Path) -> None:
    """docs/PROTOCOL.md §7.6: at a response endpoint each publication has a table of its own
    (its C half sends there); a setup-eliciting SM naming its session makes the SM's source
    its one destination (a later one replaces it) and elicits SETUP; plain SMs teach nothing
    until their receiver is the destination's; a source no send reaches is counted and
    teaches nothing; its C half (and so its Python half's frames, which leave through the
    same send) sends to that destination only, or nowhere before it has one.  Its SMs all
    come to Python (learns_destinations: their sources)."""
    counters = LocalCounters()
    channel = SendChannel(counters=counters, response_ip_version=4)
    first, second = (_publication(shm, counters, RESPONSE_URI, session_id=s) for s in (5, 8))
    for publication in (first, second):
        channel.add_publication(publication)
        assert publication.c.destinations != network_ffi.NULL
        assert publication.learns_destinations
    assert _destination_of(first) is None
    client_a, client_b = ("127.0.0.1", 50001), ("127.0.0.1", 50002)

    channel.on_control(StatusMessage(5, 6, 0, 0, 0, 1, SM_SEND_SETUP_FLAG).encode(), client_a, 1)
    assert _destination_of(first) == client_a and first.is_setup_elicited
    assert _destination_of(second) is None
    channel.on_control(StatusMessage(8, 6, 0, 0, 0, 2, SM_SEND_SETUP_FLAG).encode(), client_b, 2)
    assert _destination_of(second) == client_b

    # (Of another receiver: one of receiver 1 would bind it to its host, §5.7.)
    channel.on_control(StatusMessage(5, 6, 10, 0, 65536, 7, 0).encode(), client_b, 3)
    assert _destination_of(first) == client_a  # a plain SM teaches nothing
    channel.on_control(StatusMessage(5, 6, 0, 0, 0, 1, SM_SEND_SETUP_FLAG).encode(),
                       ("224.0.1.1", 9), 4)
    assert counters[SystemCounter.INVALID_PACKETS] == 1
    assert _destination_of(first) == client_a
    moved = ("127.0.0.1", 50003)  # the client's NAT gave it another port
    channel.on_control(StatusMessage(5, 6, 0, 0, 0, 1, SM_SEND_SETUP_FLAG).encode(), moved, 5)
    assert _destination_of(first) == moved
    channel.remove_publication(first)
    assert _destination_of(first) is None


def test_a_response_publication_keeps_its_live_client_against_other_receivers(
        shm: Path) -> None:
    """docs/PROTOCOL.md §7.6: once the destination's receiver is live (its SMs within the
    connection timeout), a setup-eliciting SM of another receiver from elsewhere (stray or
    forged) is dropped (UNMATCHED_STATUS_MESSAGES) and moves nothing, nor does a plain SM of
    another receiver reach the publication; any SM of the live receiver from a new source
    moves the destination there (a NAT rebind).  Once that receiver has gone silent past the
    connection timeout, another receiver's setup request is the client again."""
    counters = LocalCounters()
    channel = SendChannel(counters=counters, response_ip_version=4)
    publication = _publication(shm, counters, RESPONSE_URI)
    channel.add_publication(publication)
    client, forger = ("127.0.0.1", 50001), ("127.0.0.1", 60000)
    channel.on_control(StatusMessage(5, 6, 0, 0, 0, 1, SM_SEND_SETUP_FLAG).encode(), client, 1)
    channel.on_control(StatusMessage(5, 6, 10, 0, 65536, 1, 0).encode(), client, 2)
    assert publication.has_live_receiver(1) and publication.is_connected

    channel.on_control(StatusMessage(5, 6, 0, 0, 0, 9, SM_SEND_SETUP_FLAG).encode(), forger, 3)
    channel.on_control(StatusMessage(5, 6, 10, 0, 65536, 9, 0).encode(), forger, 4)
    assert _destination_of(publication) == client
    assert counters[SystemCounter.UNMATCHED_STATUS_MESSAGES] == 2
    assert not publication.has_live_receiver(9)

    rebound = ("127.0.0.1", 50002)  # the client's NAT gave it another port
    channel.on_control(StatusMessage(5, 6, 10, 0, 65536, 1, 0).encode(), rebound, 5)
    assert _destination_of(publication) == rebound

    later = 6 + publication.connection_timeout_ns + 1
    publication._update_has_receivers(later)
    assert not publication.has_live_receiver(1)
    channel.on_control(StatusMessage(5, 6, 0, 0, 0, 9, SM_SEND_SETUP_FLAG).encode(), forger,
                       later)
    assert _destination_of(publication) == forger
    channel.remove_publication(publication)


def test_an_rsp_setup_reaches_the_conductor_for_a_request_publication_only(
        shm: Path) -> None:
    """A request publication (response-correlation-id= without control-mode=response) sets
    SEND_RESPONSE in its SETUP.  An RSP_SETUP naming one of the endpoint, from one of its
    receivers (a source that sent it an SM), becomes a ResponseSetupArrived naming its
    response subscription; one for another session, or for
    a publication that asked for nothing, is dropped; a malformed one (short, or a
    frame_length past the datagram) counts INVALID_PACKETS and is dropped."""
    counters = LocalCounters()
    channel = SendChannel(counters=counters)
    request = _publication(shm, counters, "aeron:udp?endpoint=127.0.0.1:40123"
                           "|response-correlation-id=77", session_id=5)
    plain = _publication(shm, counters, "aeron:udp?endpoint=127.0.0.1:40123", session_id=8)
    for publication in (request, plain):
        channel.add_publication(publication)
    # Only the request publication's SETUP asks for a response (SEND_RESPONSE, 0x80).
    [request_setup] = [decode(d.data) for d in request.datagrams_to_send(0)]
    [plain_setup] = [decode(d.data) for d in plain.datagrams_to_send(0)]
    assert isinstance(request_setup, Setup) and request_setup.wants_response
    assert isinstance(plain_setup, Setup) and not plain_setup.wants_response
    server = ("127.0.0.1", 40123)
    channel.on_datagram(ResponseSetup(5, 6, 4242).encode(), server, 1)
    assert channel.response_setups == []  # from no receiver of the publication (no SM yet)
    for publication in (request, plain):
        channel.on_datagram(StatusMessage(publication.session_id, 6, 10, 0, 65536, 3).encode(),
                            server, 1)
    channel.on_datagram(ResponseSetup(5, 6, 4242).encode(), ("127.0.0.1", 40999), 1)
    assert channel.response_setups == []  # from another source than its receiver's
    channel.on_datagram(ResponseSetup(5, 6, 4242).encode(), server, 1)
    assert channel.response_setups == [ResponseSetupArrived(77, 4242)]
    channel.response_setups.clear()
    for other in (ResponseSetup(8, 6, 1), ResponseSetup(5, 7, 1), ResponseSetup(9, 6, 1)):
        channel.on_datagram(other.encode(), server, 2)
    assert channel.response_setups == []
    assert counters[SystemCounter.INVALID_PACKETS] == 0
    wire = ResponseSetup(5, 6, 4242).encode()
    channel.on_datagram(wire[:16], server, 3)
    channel.on_datagram((24).to_bytes(4, "little") + wire[4:], server, 3)
    assert counters[SystemCounter.INVALID_PACKETS] == 2
    assert channel.response_setups == []


class _BrokenPort:
    """A virtual network end that raises on every datagram."""

    def __init__(self) -> None:
        self.binding_handle = network_ffi.new_handle(self)
        self.calls = 0

    def put_datagram(self, address: Address, data: bytes) -> None:
        self.calls += 1
        raise RuntimeError("the virtual network broke")


def test_what_a_virtual_port_raises_reaches_the_caller_and_nothing_counts_as_sent(
        shm: Path) -> None:
    counters = LocalCounters()
    table = DestinationTable(ControlMode.MANUAL)
    table.add(("10.0.0.2", 4000), 0)
    publication = _publication(shm, counters, "aeron:udp?control-mode=manual")
    port = _BrokenPort()
    send_point.attach_publication(publication, fd=-1, table=table, virtual=port)
    with pytest.raises(RuntimeError, match="the virtual network broke"):
        send_point.send_publication_frames(publication, [Datagram(b"setup", ALL_DESTINATIONS)])
    assert port.calls == 1
    assert counters[SystemCounter.BYTES_SENT] == 0
    send_point.raise_port_errors()  # raised once: nothing is left to raise


def test_each_destination_a_frame_fails_to_reach_counts_one_send_error(shm: Path) -> None:
    counters = LocalCounters()
    sender = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)  # no SO_BROADCAST: EACCES
    try:
        table = DestinationTable(ControlMode.MANUAL)
        for port in (4000, 4001, 4002):
            table.add(("255.255.255.255", port), 0)
        publication = _publication(shm, counters, "aeron:udp?control-mode=manual")
        send_point.attach_publication(publication, fd=sender.fileno(), table=table)
        send_point.send_publication_frames(publication, [Datagram(b"setup", ALL_DESTINATIONS)])
        assert counters[SystemCounter.SEND_ERRORS] == 3
    finally:
        sender.close()
