"""A multi-destination-cast endpoint's destination table (daemon/media/destinations.py) and
how its dispatcher learns from status messages (daemon/media/send_channel.py), in process.

The table is checked against a model under any sequence of operations (hypothesis): what
it holds, what its C table holds (what ss_send_channel_send sends to), the mdc-destinations
cell, and when a dynamic destination expires.
"""

from __future__ import annotations

import socket
import tempfile
from pathlib import Path
from typing import Any

import attrs
import pytest
from helpers import network_publication
from hypothesis import given, settings
from hypothesis import strategies as st

from slipstream.client.channel import parse_join
from slipstream.client.counters import SystemCounter
from slipstream.client.frames import (
    ErrorFrame,
    Heartbeat,
    ResponseSetup,
    Rttm,
    Setup,
    StatusMessage,
    decode,
)
from slipstream.client.layout import (
    NO_DEADLINE,
    RTTM_REPLY_FLAG,
    SM_LENGTH,
    SM_SEND_SETUP_FLAG,
)
from slipstream.daemon._network import ffi as network_ffi
from slipstream.daemon.media import send_point
from slipstream.daemon.media.destinations import (
    ALL_DESTINATIONS,
    DESTINATION_TIMEOUT_NS,
    ControlMode,
    DestinationTable,
    Heard,
)
from slipstream.daemon.media.events import ResponseSetupArrived
from slipstream.daemon.media.send_channel import SendChannel
from slipstream.daemon.protocol.types import Address, Datagram, LocalCounters, address_of
from slipstream.daemon.streams.publication import NetworkPublication

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


operations = st.lists(st.tuples(st.sampled_from(["add", "remove", "sm", "echo", "expire",
                                                 "forged"]),
                                st.sampled_from(ADDRESSES + NOT_DESTINATIONS),
                                st.integers(min_value=0, max_value=3 * S)), max_size=40)


def _token(address: Address) -> int:
    """The token a test table gives ``address`` (a real one draws 32 random bits)."""
    return (hash(address) & 0x7FFF_FFFF) | 1


def _receiver(address: Address) -> int:
    """The receiver id of the receiver at ``address`` that asks to join."""
    return address[1] * 7 + 1


@settings(max_examples=200, deadline=None)
@given(mode=st.sampled_from([ControlMode.MANUAL, ControlMode.DYNAMIC]), ops=operations,
       max_candidates=st.integers(min_value=1, max_value=4))
def test_the_table_and_its_c_view_follow_every_operation(mode: ControlMode, ops,
                                                         max_candidates: int) -> None:
    """A dynamic table sends (its C view holds) only what was added or validated: a status
    message's source is a candidate, at most ``max_candidates`` at once (a new one takes the
    oldest's place), until it echoes its token naming the receiver id it joined with
    (``echo``; the same echo from another receiver, a bystander, validates nothing) or its
    validation time runs out; a destination is kept alive only by its receiver's status
    messages (``forged`` names another)."""
    cell = network_ffi.new("int64_t *")
    tokens = iter([])
    table = DestinationTable(mode, count_cell=cell, max_candidates=max_candidates,
                             token_source=lambda: next(tokens))
    model: dict[Address, int] = {}  # address -> last seen
    candidates: dict[Address, int] = {}  # address -> first seen
    proven: set[Address] = set()  # destinations that validated (have a receiver id)
    now = 0
    for op, address, step in ops:
        now += step
        if op == "add":
            assert table.add(address, now) == (address not in model)
            model.setdefault(address, now)
            candidates.pop(address, None)  # an added one is no longer validating
        elif op == "remove":
            assert table.remove(address) == (address in model)
            model.pop(address, None)
            proven.discard(address)
        elif op == "sm" and mode is ControlMode.DYNAMIC:
            tokens = iter([_token(address)])
            heard = table.on_status_message(address, now, SM_LENGTH,
                                            receiver_id=_receiver(address), joining=True)
            if address in model:
                assert heard is Heard.DESTINATION
                model[address] = now
            elif address in NOT_DESTINATIONS:
                assert heard is Heard.UNSENDABLE
            elif address in candidates or len(candidates) < max_candidates:
                assert heard is Heard.CANDIDATE
                candidates.setdefault(address, now)
            else:
                assert heard is Heard.REPLACED
                del candidates[next(iter(candidates))]
                candidates[address] = now
        elif op == "forged" and mode is ControlMode.DYNAMIC:
            if address in model and address in table.addresses:
                heard = table.on_status_message(address, now, SM_LENGTH,
                                                receiver_id=_receiver(address) + 1,
                                                joining=False)
                # Validated ones only: an added destination has no receiver to tell apart.
                if address in proven:
                    assert heard is Heard.UNKNOWN_RECEIVER
                else:
                    assert heard is Heard.DESTINATION
                    model[address] = now
        elif op == "echo":
            assert not table.on_token(address, _token(address) ^ 2, now,
                                      receiver_id=_receiver(address))
            assert not table.on_token(address, _token(address), now,  # a bystander's answer
                                      receiver_id=_receiver(address) + 1)
            validated = table.on_token(address, _token(address), now,
                                       receiver_id=_receiver(address))
            assert validated == (address in candidates and address not in model)
            if validated:
                del candidates[address]
                model[address] = now
                proven.add(address)
        elif op == "expire":
            unvalidated = table.expire_candidates(now)
            assert sorted(unvalidated) == sorted(
                a for a, since in candidates.items() if now - since >= table.validation_timeout_ns)
            for a in unvalidated:
                del candidates[a]
            gone = table.expire(now)
            expected = ([a for a, seen in model.items() if now - seen >= DESTINATION_TIMEOUT_NS]
                        if mode is ControlMode.DYNAMIC else [])
            assert sorted(gone) == sorted(expected)
            for a in expected:
                del model[a]
                proven.discard(a)
        assert table.addresses == list(model)
        assert c_addresses(table) == list(model)
        assert sorted(table.candidates) == sorted(a for a in candidates if a not in model)
        assert cell[0] == len(model)
        deadlines = ([seen + DESTINATION_TIMEOUT_NS for seen in model.values()]
                     + [since + table.validation_timeout_ns for a, since in candidates.items()
                        if a not in model])
        if mode is ControlMode.DYNAMIC and deadlines:
            assert table.next_expiry_ns() == min(deadlines)
        else:
            assert table.next_expiry_ns() == NO_DEADLINE


def _publication(shm: Path, counters: LocalCounters,
                 uri: str = "aeron:udp?control=127.0.0.1:40456|control-mode=dynamic",
                 session_id: int = 5, stream_id: int = 6) -> NetworkPublication:
    return network_publication(shm, uri, ALL_DESTINATIONS, session_id=session_id,
                               stream_id=stream_id, counters=counters)


def _validating_channel(shm: Path, counters: LocalCounters, **table: Any
                        ) -> tuple[SendChannel, DestinationTable, NetworkPublication]:
    destinations = DestinationTable(ControlMode.DYNAMIC, token_source=lambda: TOKEN, **table)
    channel = SendChannel(counters=counters, destinations=destinations)
    publication = _publication(shm, counters)
    channel.add_publication(publication)
    return channel, destinations, publication


TOKEN = -0x1234_5678
ELICIT = StatusMessage(0, 0, 0, 0, 0, 1, SM_SEND_SETUP_FLAG)  # a joining receiver's
PROBE = Heartbeat(0, TOKEN, 6, 0)  # the validation probe of stream 6
#: A receiver's answer to the probe (a heartbeat of session TOKEN): it asks for that SETUP.
ECHO = StatusMessage(TOKEN, 6, 0, 0, 0, 1, SM_SEND_SETUP_FLAG)
#: A receiver's reply to the RTTM probe (sent to one with an image): the token echoed.
RTTM_ECHO = Rttm(5, 6, TOKEN, 0, 1, 0)


def test_a_dynamic_endpoint_sends_a_new_source_only_the_validation_exchange_until_it_echoes(
        shm: Path) -> None:
    """A setup-eliciting SM (session 0, stream 0 or the stream's id) or an SM of one of its
    publications makes its source a candidate, never a destination: it is answered by a
    heartbeat of the stream whose session is the candidate's token, to its address only; the
    publication hears none of it (no receiver, no SETUP elicited).  The SM asking for that
    session's SETUP from that address, and only from there, makes it a destination, whose SMs
    then go on to the publication.  An SM of a session the endpoint does not have teaches
    nothing; a candidate that does not validate in time is dropped and counted."""
    counters = LocalCounters()
    channel, table, publication = _validating_channel(shm, counters)
    assert publication.learns_destinations
    joining, member, forger = ("127.0.0.1", 50001), ("127.0.0.1", 50002), ("127.0.0.1", 50003)

    channel.on_control(StatusMessage(999, 6, 10, 0, 65536, 3, 0).encode(), forger, 1)
    channel.on_control(StatusMessage(0, 7, 0, 0, 0, 3, SM_SEND_SETUP_FLAG).encode(), forger, 2)
    assert table.candidates == [] and counters[SystemCounter.UNMATCHED_STATUS_MESSAGES] == 2
    for bad_source in (("127.0.0.1", 0), ("224.0.1.1", 5000), ("::1", 5000)):
        channel.on_control(ELICIT.encode(), bad_source, 3)
    assert table.candidates == [] and counters[SystemCounter.INVALID_PACKETS] == 3
    assert channel.challenges == []

    channel.on_control(ELICIT.encode(), joining, 3)
    assert table.addresses == [] and table.candidates == [joining]
    assert [(p, d.address, decode(d.data)) for p, d in channel.challenges] == [
        (publication, joining, PROBE)]
    assert not publication.setups.elicited
    assert counters[SystemCounter.STATUS_MESSAGES_RECEIVED] == 0

    channel.on_control(attrs.evolve(ECHO, session_id=TOKEN + 1).encode(), joining, 4)
    channel.on_control(attrs.evolve(ECHO, flags=0).encode(), joining, 4)
    channel.on_control(ECHO.encode(), forger, 4)  # the token, from elsewhere
    assert table.addresses == [] and table.candidates == [joining]
    channel.on_control(ECHO.encode(), joining, 5)
    assert table.addresses == [joining] and table.candidates == []
    sm = StatusMessage(5, 6, 10, 0, 65536, 1, 0)
    channel.on_control(sm.encode(), joining, 6)
    assert counters[SystemCounter.STATUS_MESSAGES_RECEIVED] == 1  # now the publication's
    # From its address, naming another receiver: keeps nothing alive, reaches no one.
    channel.on_control(attrs.evolve(sm, receiver_id=2).encode(), joining, 6)
    assert counters[SystemCounter.STATUS_MESSAGES_RECEIVED] == 1
    assert counters[SystemCounter.MDC_UNKNOWN_RECEIVER_DROPS] == 1

    channel.challenges.clear()
    channel.on_control(sm.encode(), member, 7)  # has an image: an RTTM with the token
    assert [decode(d.data) for _, d in channel.challenges] == [
        Rttm(5, 6, TOKEN, 0, 0, RTTM_REPLY_FLAG)]
    channel.on_control(attrs.evolve(RTTM_ECHO, echo_timestamp=TOKEN + 1).encode(), member, 7)
    channel.on_control(attrs.evolve(RTTM_ECHO, flags=RTTM_REPLY_FLAG).encode(), member, 7)
    assert table.candidates == [member]
    assert counters[SystemCounter.MDC_AMPLIFICATION_DROPS] == 1  # the request's echo
    assert channel.expire_destinations(3 * S + 6) == []
    assert counters[SystemCounter.MDC_UNVALIDATED_DROPS] == 0
    assert channel.expire_destinations(3 * S + 7) == []  # the member never answered
    assert table.candidates == [] and counters[SystemCounter.MDC_UNVALIDATED_DROPS] == 1

    channel.on_control(sm.encode(), joining, 4 * S)
    assert channel.next_deadline_ns() == 9 * S
    assert channel.expire_destinations(9 * S - 1) == []
    assert channel.expire_destinations(9 * S) == [joining]
    publication.sync_c_half()
    assert not publication.c.sm_in_c


def test_a_receiver_of_one_session_validates_by_the_rttm_echo(shm: Path) -> None:
    """A receiver that takes one session only answers no heartbeat of another: from a
    candidate's second joining SM on, each publication's SETUP goes to it too (and only to it);
    an SM asking for that session's SETUP gets it; the image it makes sends SMs of the
    session, answered by an RTTM request with the token, whose echo validates it."""
    counters = LocalCounters()
    channel, table, publication = _validating_channel(shm, counters)
    one = ("127.0.0.1", 50004)
    channel.on_control(ELICIT.encode(), one, 1)
    assert [decode(d.data) for _, d in channel.challenges] == [PROBE]
    channel.challenges.clear()
    channel.on_control(ELICIT.encode(), one, 1 * S)  # no answer came: its second
    sent = [decode(d.data) for _, d in channel.challenges]
    assert sent[0] == PROBE and isinstance(sent[1], Setup) and len(sent) == 2
    assert (sent[1].session_id, sent[1].stream_id) == (5, 6)
    assert {d.address for _, d in channel.challenges} == {one}
    channel.challenges.clear()
    channel.on_control(StatusMessage(5, 6, 0, 0, 0, 1, SM_SEND_SETUP_FLAG).encode(), one, 2)
    [(_, setup)] = channel.challenges
    assert isinstance(decode(setup.data), Setup)
    channel.challenges.clear()
    channel.on_control(StatusMessage(5, 6, 10, 0, 65536, 1, 0).encode(), one, 3)
    [(_, request)] = channel.challenges
    assert decode(request.data) == Rttm(5, 6, TOKEN, 0, 0, RTTM_REPLY_FLAG)
    assert table.addresses == [] and counters[SystemCounter.STATUS_MESSAGES_RECEIVED] == 0
    channel.on_control(RTTM_ECHO.encode(), one, 4)
    assert table.addresses == [one] and table.candidates == []
    assert not publication.setups.elicited


def test_join_subnets_and_the_candidate_bound_refuse_by_cause(shm: Path) -> None:
    """``join=``: a source outside the subnets is dropped unanswered, whatever it sends; at
    most ``max_candidates`` sources validate at once, a new one beyond takes the oldest's
    place (so forged sources cannot hold the table against a receiver that answers)."""
    counters = LocalCounters()
    channel, table, _ = _validating_channel(
        shm, counters, join=parse_join("10.1.0.0/16,fd00::/8"), max_candidates=2)
    channel.on_control(ELICIT.encode(), ("10.2.0.1", 4000), 1)
    channel.on_control(ECHO.encode(), ("10.2.0.1", 4000), 1)
    assert counters[SystemCounter.MDC_JOIN_SUBNET_DROPS] == 2
    assert table.candidates == [] and channel.challenges == []
    for port in (4001, 4002, 4003):
        channel.on_control(ELICIT.encode(), ("10.1.7.7", port), 2)
    assert table.candidates == [("10.1.7.7", 4002), ("10.1.7.7", 4003)]
    assert counters[SystemCounter.MDC_CANDIDATES_REFUSED] == 1
    assert len(channel.challenges) == 3
    channel.on_control(ELICIT.encode(), ("10.1.7.7", 4002), 3)  # its second: + the SETUP
    assert len(channel.challenges) == 5 and counters[SystemCounter.MDC_CANDIDATES_REFUSED] == 1


def test_a_bystander_named_by_forged_joins_answers_the_probes_but_is_never_validated(
        shm: Path) -> None:
    """A forger sends joining SMs in the name of a subscriber that never asked to join (a
    plain subscription of the stream at that address): the subscriber answers the probes as
    any receiver does, but with its own receiver id, which the forger did not see; no answer
    of it validates, so the stream never goes there and the candidate times out."""
    counters = LocalCounters()
    channel, table, _ = _validating_channel(shm, counters)
    bystander, its_id = ("127.0.0.1", 50010), 0x0B57_A4DE
    for now in (1, 1 * S):  # the forger's two joins: a heartbeat probe, then the SETUP too
        channel.on_control(ELICIT.encode(), bystander, now)
    channel.on_control(attrs.evolve(ECHO, receiver_id=its_id).encode(), bystander, S + 1)
    channel.on_control(StatusMessage(5, 6, 10, 0, 65536, its_id, 0).encode(), bystander, S + 2)
    channel.on_control(attrs.evolve(RTTM_ECHO, receiver_id=its_id).encode(), bystander, S + 3)
    assert table.addresses == [] and table.candidates == [bystander]
    channel.expire_destinations(3 * S + 1)
    assert table.candidates == [] and counters[SystemCounter.MDC_UNVALIDATED_DROPS] == 1


SOURCES = [("127.0.0.1", 50001 + i) for i in range(3)]
#: What any host may send a dynamic endpoint: SMs of every kind (a joiner's, its session's
#: with and without S, a forged session's, tagged), RTTM echoes with the token or not, RTTM
#: requests, and others' control frames.
INPUTS = [ELICIT, StatusMessage(0, 0, 0, 0, 0, 1, SM_SEND_SETUP_FLAG, group_tag=7),
          StatusMessage(5, 6, 10, 0, 65536, 1, 0),
          StatusMessage(5, 6, 10, 0, 65536, 1, SM_SEND_SETUP_FLAG),
          StatusMessage(9, 6, 10, 0, 65536, 1, 0),
          ECHO, attrs.evolve(ECHO, session_id=1), Rttm(5, 6, 77, 0, 1, RTTM_REPLY_FLAG),
          RTTM_ECHO, attrs.evolve(RTTM_ECHO, echo_timestamp=2),
          Rttm(5, 6, 77, 0, 1, 0),
          ErrorFrame(5, 6, 1, 0, "no")]


@settings(max_examples=300, deadline=None)
@given(steps=st.lists(st.tuples(st.sampled_from(SOURCES), st.sampled_from(INPUTS),
                                st.integers(min_value=0, max_value=S)), max_size=60),
       echoes=st.booleans())
def test_a_never_validated_address_is_sent_at_most_three_times_what_came_from_it(
        steps, echoes: bool) -> None:
    """For any sequence of control frames from any sources, the bytes the endpoint sends an
    address that never validated stay within 3x the bytes that arrived from it (RFC 9000
    8.1), and nothing goes to any address through the data path's table before it echoed
    its token.  (``echoes`` off: the token frames are left out, so nothing validates.)"""
    with tempfile.TemporaryDirectory(dir="/dev/shm", prefix="slipstream-test-") as shm:
        _never_more_than_three_times(Path(shm), steps, echoes)


def _never_more_than_three_times(shm: Path, steps, echoes: bool) -> None:
    counters = LocalCounters()
    channel, table, publication = _validating_channel(shm, counters)
    for session_id in (7, 8, 9):  # a joiner's SM (stream 0) asks more than 3x allows
        channel.add_publication(_publication(shm, counters, session_id=session_id,
                                             stream_id=session_id))
    arrived = dict.fromkeys(SOURCES, 0)
    sent = dict.fromkeys(SOURCES, 0)
    validated: set[Address] = set()
    now = 0
    for source, frame, step in steps:
        if not echoes and frame in (ECHO, RTTM_ECHO):
            continue
        now += step
        data = frame.encode()
        arrived[source] += len(data)
        echoed = source in table.candidates and frame in (ECHO, RTTM_ECHO)
        channel.on_control(data, source, now)
        channel.expire_destinations(now)
        for _, datagram in channel.challenges:
            sent[datagram.address] += len(datagram.data)
        channel.challenges.clear()
        if echoed:
            validated.add(source)
        assert set(table.addresses) <= validated
        assert set(send_point.destinations_of(publication) if publication.c.destinations
                   else []) <= validated
        for address in SOURCES:
            if address not in validated:
                assert sent[address] <= 3 * arrived[address]


def test_what_does_not_fit_in_three_times_what_arrived_is_withheld_and_counted(
        shm: Path) -> None:
    """A joining receiver's SM (36 bytes, stream 0: every stream) at an endpoint of four
    streams would be answered by four probes (128 bytes): the three that fit in 108 go, the
    fourth is withheld and counted; so again for the next (192 of 216 sent), and its four
    SETUPs (for a receiver of one session) do not fit either."""
    counters = LocalCounters()
    channel, _, _ = _validating_channel(shm, counters)
    for session_id, stream_id in ((7, 7), (8, 8), (9, 9)):
        channel.add_publication(_publication(shm, counters, session_id=session_id,
                                             stream_id=stream_id))
    joining = ("127.0.0.1", 50001)
    channel.on_control(ELICIT.encode(), joining, 1)
    assert [len(d.data) for _, d in channel.challenges] == [32, 32, 32]  # 96 of 108
    assert counters[SystemCounter.MDC_AMPLIFICATION_DROPS] == 1
    channel.on_control(ELICIT.encode(), joining, 2)
    assert sum(len(d.data) for _, d in channel.challenges) == 192
    assert counters[SystemCounter.MDC_AMPLIFICATION_DROPS] == 1 + 1 + 4


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
    """docs/CHANNELS.md §7.6: at a response endpoint each publication has a table of its own
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
    assert _destination_of(first) == client_a and first.setups.elicited
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
    """docs/CHANNELS.md §7.6: once the destination's receiver is live (its SMs within the
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
