"""NetworkPublication on its own: frames in, datagrams out, limits and states.

The data goes out through the C data path (``ss_send_data`` with no socket), as the sender
agent runs it: :func:`send` is one data send, :func:`cycle` one duty cycle of this publication.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import FAST_DRIVER_SETTINGS, data_datagrams, network_publication

from slipstream.client._native import ffi, lib
from slipstream.client.counters import SystemCounter
from slipstream.client.errors import LocalProtocolError
from slipstream.client.frames import (
    SETUP_GROUP_FLAG,
    Data,
    Heartbeat,
    Nak,
    Pad,
    Rttm,
    Setup,
    StatusMessage,
    decode,
    decode_datagram,
)
from slipstream.client.logbuffer import new_appender
from slipstream.daemon._network import ffi as network_ffi
from slipstream.daemon._network import lib as network
from slipstream.daemon.media import send_point
from slipstream.daemon.media.destinations import ControlMode, DestinationTable
from slipstream.daemon.media.send_channel import SendChannel
from slipstream.daemon.protocol.types import Datagram, LocalCounters
from slipstream.daemon.streams.publication import (
    NetworkPublication,
    PublicationState,
)
from slipstream.daemon.streams.setups import SETUP_REFUSAL_WINDOW_NS, SETUP_REFUSED_INTERVAL_NS

MS = 1_000_000
US = 1_000
TERM = 64 * 1024
DEST = ("10.0.0.2", 40123)
RCV = ("10.0.0.2", 40123)


def make(shm: Path, uri: str = "aeron:udp?endpoint=10.0.0.2:40123", **settings):
    pub = network_publication(shm, uri, DEST, term_length=TERM, **settings)
    limit = pub.positions.publisher_limit
    return pub, pub.log, limit, new_appender(pub.log, limit), pub.counters


def send(pub: NetworkPublication, now_ns: int, budget: int = 64) -> list:
    """One C data send, then the publication hears of it (as the sender agent does)."""
    out = data_datagrams(pub, now_ns, budget)
    if out:
        pub.on_data_sent(now_ns)
    return out


class _Port:
    """A virtual port that keeps what the C half sends through it."""

    def __init__(self) -> None:
        self.datagrams: list[Datagram] = []
        self.binding_handle = network_ffi.new_handle(self)

    def put_datagram(self, address, data: bytes) -> None:
        self.datagrams.append(Datagram(data, address))


def heartbeats(pub: NetworkPublication, now_ns: int) -> list:
    """The C half's heartbeat rule for ``pub`` at ``now_ns``, as the sender agent's duty cycle
    runs it (the flags of its last pass first): what it sent, through a virtual port."""
    port = _Port()
    pub.sync_c_half()
    send_point.attach_publication(pub, fd=-1, virtual=port)
    try:
        network.ss_publication_heartbeat(pub.c, now_ns)
    finally:
        send_point.attach_publication(pub, fd=-1)
    return port.datagrams


def cycle(pub: NetworkPublication, now_ns: int) -> list:
    """One duty cycle of the sender agent for this publication: data, control, heartbeats."""
    return send(pub, now_ns) + pub.datagrams_to_send(now_ns) + heartbeats(pub, now_ns)


def sm(offset: int = 0, window: int = 32 * 1024, flags: int = 0, term_id: int = 10):
    return StatusMessage(5, 6, term_id, offset, window, 99, flags)


def frames(datagrams):
    return [decode(d.data) for d in datagrams]


def test_setup_until_first_sm(shm: Path) -> None:
    pub, log, limit, _, _ = make(shm)
    out = frames(pub.datagrams_to_send(0))
    assert out == [Setup(0, 5, 6, 10, 10, TERM, 1408, 0, 0)]
    assert pub.next_deadline_ns() == 100 * MS
    assert pub.datagrams_to_send(99 * MS) == []
    assert isinstance(frames(pub.datagrams_to_send(100 * MS))[0], Setup)
    assert limit[0] == 0 and not pub.is_connected
    pub.on_frame(sm(), DEST, 150 * MS)
    assert pub.is_connected and log.is_connected
    assert limit[0] == TERM // 2
    out = frames(cycle(pub, 150 * MS))
    assert out == [Heartbeat(0, 5, 6, 10)]  # the C half's, once the first SM came
    assert pub.c.time_of_last_send_ns + network.SS_HEARTBEAT_TIMEOUT_NS == 250 * MS


def test_multicast_setup_has_group_flag(shm: Path) -> None:
    pub, *_ = make(shm, "aeron:udp?endpoint=224.0.1.1:40456|ttl=4")
    setup = frames(pub.datagrams_to_send(0))[0]
    assert setup.flags == SETUP_GROUP_FLAG and setup.ttl == 4


def test_data_batched_to_mtu_and_budget(shm: Path) -> None:
    pub, _log, _limit, appender, counters = make(shm)
    pub.on_frame(sm(window=TERM // 2), DEST, 0)
    pub.datagrams_to_send(0)
    assert not pub.has_data_ready()
    for _ in range(40):
        assert lib.ss_offer(appender, b"m" * 100, 100) > 0  # 160 B frames
    assert pub.has_data_ready()
    out = send(pub, 1, budget=2)
    assert [len(d.data) for d in out] == [1280, 1280]  # 8 frames of 160 per 1408 MTU
    assert pub.sender_position == 2560
    out = send(pub, 2)
    assert sum(len(d.data) for d in out) == 40 * 160 - 2560
    decoded = decode_datagram(out[0].data)
    assert all(isinstance(f, Data) for f in decoded)
    assert counters[SystemCounter.BYTES_SENT] == 6400


class Port:
    """A virtual network's end (send_point.VirtualPort): what the virtual binding hands it."""

    def __init__(self) -> None:
        self.binding_handle = network_ffi.new_handle(self)
        self.taken: list[tuple[tuple[str, int], bytes]] = []

    def put_datagram(self, address: tuple[str, int], data: bytes) -> None:
        self.taken.append((address, data))


def test_the_virtual_binding_takes_each_datagram_of_a_gso_run_to_each_destination(
        shm: Path) -> None:
    """Below the send channel endpoint's send (its fan-out to a table's destinations), the
    virtual binding hands each datagram with its destination to its port, as the kernel
    would cut a UDP GSO run: the simulator sees what a socket would put on the wire.  Each
    destination's bytes are counted."""
    pub, _log, _limit, appender, counters = make(shm)
    port = Port()
    table = DestinationTable(ControlMode.MANUAL)
    others = [("10.0.0.3", 40123), ("10.0.0.4", 40123)]
    for address in others:
        table.add(address, 0)
    send_point.attach_publication(pub, fd=-1, table=table, virtual=port)
    pub.c.gso = 1  # runs of equal datagrams as one message
    pub.c.virtual_room = -1
    pub.on_frame(sm(window=TERM // 2), DEST, 0)
    pub.datagrams_to_send(0)
    port.taken.clear()  # the SETUP
    for _ in range(40):
        assert lib.ss_offer(appender, b"m" * 100, 100) > 0  # 160 B frames, 8 per datagram
    before = counters[SystemCounter.BYTES_SENT]
    out = send(pub, 1)
    assert [len(d.data) for d in out] == [1280] * 5
    assert port.taken == [(address, d.data) for address in others for d in out]
    assert counters[SystemCounter.BYTES_SENT] - before == 2 * 5 * 1280


def test_sender_stops_at_limit(shm: Path) -> None:
    pub, _log, _limit, appender, _ = make(shm)
    pub.on_frame(sm(window=1000), DEST, 0)
    for _ in range(20):
        lib.ss_offer(appender, b"m" * 100, 100)
    send(pub, 0)
    assert pub.sender_position == 960  # 6 frames: the 7th would pass 1000
    assert not pub.has_data_ready()
    pub.on_frame(sm(offset=960, window=1000), DEST, 1)
    send(pub, 1)
    assert pub.sender_position == 1920


def test_pad_sent_as_header_and_position_jumps(shm: Path) -> None:
    pub, _log, _limit, appender, _ = make(shm)
    pub.on_frame(sm(window=TERM // 2), DEST, 0)
    sent = 0
    t = 0
    while pub.sender_position < TERM + 1024:
        if lib.ss_offer(appender, b"p" * 1000, 1000) > 0:
            sent += 1
        t += 1
        for f in cycle(pub, t):
            if isinstance(decode(f.data), Pad):
                assert len(f.data) == 32
        pub.on_frame(sm(offset=pub.sender_position % TERM,
                        term_id=10 + pub.sender_position // TERM, window=TERM // 2), DEST, t)
    assert pub.active_term_id == 11


def test_nak_resend_and_rttm_reply(shm: Path) -> None:
    pub, _log, _limit, appender, counters = make(shm)
    pub.on_frame(sm(), DEST, 0)
    lib.ss_offer(appender, b"a" * 100, 100)
    cycle(pub, 0)
    pub.on_frame(Nak(5, 6, 10, 0, 160), DEST, 1)
    # Queued for the data path: data to send, not a timer of the publication (nor is the
    # action's linger: the next NAK frees it).
    assert pub.has_data_ready() and pub.retransmit_handler.next_deadline_ns() == 1 + 200 * US
    assert pub.next_deadline_ns() > 1 + 200 * US
    # The retransmission goes with the data path's next send, though no new data waits.
    [resent] = frames(cycle(pub, 1))
    assert isinstance(resent, Data) and resent.term_offset == 0 and not pub.has_data_ready()
    pub.on_frame(Nak(5, 6, 10, 320, 160), DEST, 2)  # beyond snd-pos: nothing
    assert [f for f in frames(cycle(pub, 2)) if isinstance(f, Data)] == []
    pub.on_frame(Rttm(5, 6, 12345, 0, 99, 0x80), DEST, 3)
    reply = frames(pub.datagrams_to_send(3))[0]
    assert reply == Rttm(5, 6, 12345, 0, 99, 0)
    assert counters[SystemCounter.RETRANSMITS_SENT] == 1


def test_a_nak_past_a_full_retransmit_queue_leaves_the_rest_to_the_next_nak(shm: Path) -> None:
    """The queue the data path sends retransmissions from holds SS_RETRANSMIT_MAX spans: what
    a NAK could not queue is counted (RETRANSMIT_OVERFLOW), and the linger covers only what
    went, so the receiver's next NAK for the rest is served at once, not ignored as a repeat
    for the linger's 10 ms."""
    pub, _log, _limit, appender, counters = make(shm)
    pub.on_frame(sm(), DEST, 0)
    for _ in range(280):
        assert lib.ss_offer(appender, b"a" * 32, 32) > 0  # 64-byte frames from 0
    for _ in range(5):
        assert lib.ss_offer(appender, b"b" * 1024, 1024) > 0  # a datagram each, from 17920
    while cycle(pub, 0):
        pass
    capacity = network.SS_RETRANSMIT_MAX
    for i in range(capacity - 2):  # single-frame NAKs: one span each
        pub.on_frame(Nak(5, 6, 10, 64 * i, 64), DEST, 1)
    pub.on_frame(Nak(5, 6, 10, 17920, 5 * 1056), DEST, 1)  # two of its five datagrams fit
    assert pub.c.retransmit_count == capacity
    assert counters[SystemCounter.RETRANSMIT_OVERFLOW] == 1
    resent = frames(cycle(pub, 1))
    assert len(resent) == capacity and resent[-1].term_offset == 17920 + 1056
    pub.on_frame(Nak(5, 6, 10, 17920 + 2 * 1056, 3 * 1056), DEST, 2)  # the rest, in the linger
    again = [f.term_offset for f in frames(cycle(pub, 2))]
    assert again == [17920 + k * 1056 for k in (2, 3, 4)]


def test_connection_timeout_makes_not_connected(shm: Path) -> None:
    pub, log, limit, appender, _ = make(shm)
    pub.on_frame(sm(), DEST, 0)
    lib.ss_offer(appender, b"a" * 100, 100)
    cycle(pub, 0)
    assert limit[0] == TERM // 2
    deadline = pub.next_deadline_ns()
    assert deadline <= 5000 * MS + 1
    for t in range(100 * MS, 5200 * MS, 100 * MS):
        pub.datagrams_to_send(t)
    assert not pub.is_connected and not log.is_connected
    assert limit[0] == pub.sender_position == 160


def test_close_drain_eos_linger_done(shm: Path) -> None:
    pub, _log, _limit, appender, _ = make(shm, publication_linger_timeout="1s")
    pub.on_frame(sm(), DEST, 0)
    assert lib.ss_offer(appender, b"a" * 100, 100) > 0
    pub.close(0)
    assert pub.state is PublicationState.DRAINING
    cycle(pub, 0)
    assert pub.state is PublicationState.LINGER
    out = frames(cycle(pub, 100 * MS))
    assert out == [Heartbeat(160, 5, 6, 10, 0xE0)]
    pub.datagrams_to_send(1000 * MS)
    assert pub.state is PublicationState.DONE
    with pytest.raises(LocalProtocolError):
        pub._transition("close", 0)


#: publication_unblock_timeout in FAST_DRIVER_SETTINGS (it must exceed the client liveness).
UNBLOCK_NS = 1500 * MS


def test_a_claim_its_publisher_never_commits_is_padded_after_the_unblock_timeout(
        shm: Path) -> None:
    pub, _log, _limit, appender, counters = make(shm, **FAST_DRIVER_SETTINGS)
    pub.on_frame(sm(window=TERM // 2), DEST, 0)
    assert lib.ss_offer(appender, b"a" * 100, 100) > 0  # 0..160, sent
    assert lib.ss_try_claim(appender, 100, ffi.new("int64_t *")) > 0  # 160..320: never committed
    assert lib.ss_offer(appender, b"b" * 100, 100) > 0  # 320..480, behind the claim
    cycle(pub, 0)
    assert pub.sender_position == 160
    for t in range(100 * MS, UNBLOCK_NS, 100 * MS):  # heartbeats, the log held at the claim
        assert frames(cycle(pub, t)) and pub.sender_position == 160
    assert counters[SystemCounter.UNBLOCKED_PUBLICATIONS] == 0  # not until the timeout passed
    t = pub.next_deadline_ns()
    assert t == UNBLOCK_NS + 1  # the blocked-publisher check's timer
    cycle(pub, t)
    out = frames(send(pub, t + 1))
    assert counters[SystemCounter.UNBLOCKED_PUBLICATIONS] == 1
    assert [type(f) for f in out] == [Pad, Data] and out[1].payload == b"b" * 100
    assert pub.sender_position == 480


def test_a_claim_made_after_an_idle_spell_gets_the_whole_unblock_timeout(shm: Path) -> None:
    """An idle publication is looked at every half timeout (nothing else need visit it); a
    claim made after it has been idle far longer than the timeout is padded one to 1.5
    timeouts after the first look that saw it, never at once (its publisher may be writing)."""
    pub, _log, _limit, appender, counters = make(shm, **FAST_DRIVER_SETTINGS)
    pub.on_frame(sm(window=TERM // 2), DEST, 0)
    assert lib.ss_offer(appender, b"a" * 100, 100) > 0
    cycle(pub, 0)
    assert pub.sender_position == 160
    t = 0
    for _ in range(6):  # idle for 3 timeouts: a look each half timeout
        due = pub.next_deadline_ns()
        assert t < due <= t + UNBLOCK_NS // 2
        t = due
        cycle(pub, t)
    assert lib.ss_try_claim(appender, 100, ffi.new("int64_t *")) > 0  # held from here
    seen = pub.next_deadline_ns()  # the next look sees it
    cycle(pub, seen)
    for now in range(seen, seen + UNBLOCK_NS, 100 * MS):
        cycle(pub, now)
    assert counters[SystemCounter.UNBLOCKED_PUBLICATIONS] == 0
    assert pub.next_deadline_ns() == seen + UNBLOCK_NS + 1
    cycle(pub, seen + UNBLOCK_NS + 1)
    assert counters[SystemCounter.UNBLOCKED_PUBLICATIONS] == 1


def test_a_sender_held_by_flow_control_is_not_unblocked(shm: Path) -> None:
    pub, _log, _limit, appender, counters = make(shm, **FAST_DRIVER_SETTINGS)
    pub.on_frame(sm(window=320), DEST, 0)
    for _ in range(4):
        assert lib.ss_offer(appender, b"m" * 100, 100) > 0  # 4 x 160: two past the window
    cycle(pub, 0)
    assert pub.sender_position == 320
    for t in range(1, 8):
        pub.on_frame(sm(window=320), DEST, t * 500 * MS)  # the receiver reads nothing more
        cycle(pub, t * 500 * MS)
    assert pub.sender_position == 320
    assert counters[SystemCounter.UNBLOCKED_PUBLICATIONS] == 0


def test_unicast_eos_sm_ends_linger(shm: Path) -> None:
    pub, *_ = make(shm)
    pub.on_frame(sm(), DEST, 0)
    pub.close(0)
    pub.datagrams_to_send(0)
    assert pub.state is PublicationState.LINGER
    pub.on_frame(sm(flags=0x40), DEST, 1)
    pub.datagrams_to_send(1)
    assert pub.state is PublicationState.DONE


def test_a_drain_stops_credit_and_is_flushed_only_once_receivers_acknowledge_the_end(
        shm: Path) -> None:
    pub, _log, limit, appender, _ = make(shm)
    pub.on_frame(sm(), DEST, 0)
    assert lib.ss_offer(appender, b"a" * 100, 100) > 0  # one frame: 160 bytes
    pub.stop_credit()
    assert limit[0] == 160  # no credit past what the log holds
    assert lib.ss_offer(appender, b"b" * 100, 100) == -2  # BACK_PRESSURED
    assert not pub.is_flushed  # not sent yet
    cycle(pub, 1 * MS)
    assert pub.sender_position == 160 and not pub.is_flushed  # sent, not acknowledged
    pub.on_frame(sm(offset=64), DEST, 2 * MS)
    assert not pub.is_flushed
    pub.on_frame(sm(offset=160), DEST, 3 * MS)  # the receiver took it all
    assert pub.is_flushed
    cycle(pub, 4 * MS)
    assert limit[0] == 160  # status messages grant nothing more
    assert pub.eos_heartbeats_sent == 0
    pub.close(5 * MS)
    out = frames(cycle(pub, 200 * MS))
    assert Heartbeat(160, 5, 6, 10, 0xE0) in out and pub.eos_heartbeats_sent == 1


def test_the_heartbeats_are_the_c_halfs_from_the_first_sm_to_done(shm: Path) -> None:
    """One copy of the rule: the C half sends every heartbeat, through a socket or the
    simulator's virtual send, the EOS-flagged ones of the end of stream too; the Python half
    sets the flags after its pass and keeps no heartbeat timer."""
    pub, _log, _limit, appender, _ = make(shm, publication_linger_timeout="1s")
    assert frames(cycle(pub, 0)) == [Setup(0, 5, 6, 10, 10, TERM, 1408, 0, 0)]
    assert not pub.c.heartbeat_in_c  # no SM yet: SETUPs
    pub.on_frame(sm(), DEST, 1 * MS)
    assert lib.ss_offer(appender, b"a" * 100, 100) > 0
    cycle(pub, 1 * MS)
    assert pub.c.heartbeat_in_c and not pub.c.end_of_stream
    assert pub.next_deadline_ns() > 101 * MS  # no heartbeat timer of its own
    assert frames(cycle(pub, 101 * MS)) == [Heartbeat(160, 5, 6, 10)]
    pub.on_frame(sm(offset=160), DEST, 102 * MS)
    pub.close(102 * MS)
    # All sent and acknowledged: LINGER, EOS from here on, the first at once.
    assert frames(cycle(pub, 102 * MS)) == [Heartbeat(160, 5, 6, 10, 0xE0)]
    assert pub.state is PublicationState.LINGER and pub.c.end_of_stream
    assert frames(cycle(pub, 201 * MS)) == []
    assert frames(cycle(pub, 202 * MS)) == [Heartbeat(160, 5, 6, 10, 0xE0)]
    assert pub.eos_heartbeats_sent == 2
    cycle(pub, 1200 * MS)
    assert pub.state is PublicationState.DONE and not pub.c.heartbeat_in_c
    assert heartbeats(pub, 1400 * MS) == []


def test_a_drained_publication_sends_its_end_of_stream_at_once_not_a_timeout_after_its_data(
        shm: Path) -> None:
    """The heartbeat that tells the receivers the stream ended goes in the cycle that finds
    the closed publication drained, however recently data went: a receiver that has it all
    learns at once that nothing follows.  Its later heartbeats keep the timeout."""
    pub, _log, _limit, appender, _ = make(shm, publication_linger_timeout="1s")
    pub.on_frame(sm(), DEST, 0)
    assert lib.ss_offer(appender, b"a" * 100, 100) > 0
    pub.close(10 * MS)
    sent = frames(cycle(pub, 10 * MS))  # the data, then the drain finds it all sent
    assert sent[-1] == Heartbeat(160, 5, 6, 10, 0xE0) and pub.eos_heartbeats_sent == 1
    assert pub.state is PublicationState.LINGER
    assert frames(cycle(pub, 60 * MS)) == []
    assert frames(cycle(pub, 110 * MS)) == [Heartbeat(160, 5, 6, 10, 0xE0)]


def test_a_publication_without_receivers_has_nothing_to_flush(shm: Path) -> None:
    pub, _log, _limit, appender, _ = make(shm)
    assert lib.ss_offer(appender, b"a" * 100, 100) < 0  # not connected: nothing accepted
    pub.stop_credit()
    assert pub.is_flushed


def test_send_channel_routes_and_counts_malformed(shm: Path) -> None:
    pub, *_ = make(shm)
    counters = LocalCounters()
    channel = SendChannel(counters=counters)
    channel.add_publication(pub)
    channel.on_datagram(sm().encode(), RCV, 0)
    assert pub.has_initial_connection
    channel.on_datagram(b"\x00" * 5, RCV, 0)
    channel.on_datagram(b"\x24\x00\x00\x00\x00\x00\x03\x00" + b"\x00" * 10, RCV, 0)
    assert counters[SystemCounter.INVALID_PACKETS] == 2
    channel.on_datagram(StatusMessage(5, 6, 0, 0, 0, 1, 0x80).encode(), RCV, 1)
    assert pub.setups.elicited


def test_a_rule_that_leaves_the_c_half_makes_the_publication_due_by_the_agents_deadline(
        shm: Path) -> None:
    """The sender agent parks until the earliest ``python_deadline_ns`` of its publications
    (their timers without those the C half keeps); a publication must then be due, or every
    duty cycle would be a Python pass that finds nothing to do.  The case: the governor's
    step 4 refuses a lowest-band publication's offers while its cleaning is behind (the C
    half stopped at a term's end), so cleaning is the Python half's again, at once."""
    pub, _log, _limit, appender, _ = make(shm, "aeron:udp?endpoint=10.0.0.2:40123|priority=-500")
    pub.on_frame(sm(), DEST, 0)
    assert lib.ss_offer(appender, b"a" * 100, 100) > 0
    cycle(pub, 1 * MS)
    pub.sync_c_half()
    assert pub.c.limit_in_c and pub.due(1 * MS) is False
    pub.cleaner.c.target = pub.cleaner.position + 4096  # as the C half left it
    pub.apply_pressure_step(4)
    pub.sync_c_half()
    assert not pub.c.limit_in_c
    deadline = pub.python_deadline_ns()
    assert deadline <= 1 * MS and pub.due(deadline)
    cycle(pub, 2 * MS)  # the Python half cleans
    assert not pub.cleaner.is_behind


def test_a_publication_closed_while_its_cleaning_is_behind_is_not_due_every_cycle(
        shm: Path) -> None:
    """Cleaning stops when the publication closes (its log takes no more data); a deadline
    of "now" for it made a Python pass of every duty cycle through the drain and the
    linger."""
    pub, _log, _limit, appender, _ = make(shm)
    pub.on_frame(sm(), DEST, 0)
    assert lib.ss_offer(appender, b"a" * 100, 100) > 0
    cycle(pub, 1 * MS)
    pub.cleaner.c.target = pub.cleaner.position + 4096  # as the C half left it
    pub.close(2 * MS)
    cycle(pub, 3 * MS)
    pub.sync_c_half()
    assert pub.state is not PublicationState.ACTIVE and pub.cleaner.is_behind
    assert pub.python_deadline_ns() > 3 * MS


def test_setups_back_off_once_per_setup_refused_from_its_err_within_a_window(
        shm: Path) -> None:
    """The SETUPs of a publication whose receivers refuse it (PublicationSetups.back_off): an
    ERR before any SETUP changes nothing; the ERRs of one SETUP move the interval once (a
    lasting cause's doubling over a passing cause's 1 s), from the last ERR; an ERR that
    comes past the window counts from the window's end; a passing cause's refusal gives
    1 s whatever came before; once a receiver asked for the next at once, ERRs leave it."""
    pub, *_ = make(shm)
    setups = pub.setups
    second, window = SETUP_REFUSED_INTERVAL_NS, SETUP_REFUSAL_WINDOW_NS

    def sends(now_ns: int) -> bool:
        out: list = []
        setups.check(now_ns, out, has_receivers=False)
        return bool(out)

    assert setups.next_deadline_ns() == 0  # the first at once
    setups.back_off(0)
    assert setups.next_deadline_ns() == 0
    assert sends(0)
    setups.back_off(10 * MS, lasting=False)  # two receivers refuse it, one for its load
    assert setups.next_deadline_ns() == 10 * MS + second
    setups.back_off(20 * MS)  # ... one for a lasting cause: 1 s (twice 100 ms, at least 1 s)
    assert setups.next_deadline_ns() == 20 * MS + second
    setups.back_off(30 * MS)  # a third receiver: no further doubling for this SETUP
    assert setups.next_deadline_ns() == 30 * MS + second
    t = 30 * MS + second
    assert not sends(t - 1) and sends(t)
    setups.back_off(t + 3 * second)  # refused again, its ERR late (or forged): 2 s
    assert setups.next_deadline_ns() == t + window + 2 * second
    t += window + 2 * second
    assert sends(t)
    setups.back_off(t + 5 * MS, lasting=False)  # for its load: 1 s again
    assert setups.next_deadline_ns() == t + 5 * MS + second
    t += 5 * MS + second
    assert sends(t)
    setups.back_off(t + 5 * MS)  # lasting: twice the 1 s
    asked = t + 100 * MS
    setups.on_request(sm(flags=0x80), RCV, asked)  # the receiver has room: at once
    setups.back_off(asked + MS)
    assert setups.next_deadline_ns() <= asked and sends(asked)
