"""PublicationImage and ReceiveChannel on their own: raw datagrams in (through the C data
path, as the socket path does), SMs/NAKs out.  The test plays the conductor's part: it makes
the log of each image the channel asks for (:func:`attach`)."""

from __future__ import annotations

import random
import struct
import uuid
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slipstream.client._native import ffi
from slipstream.client.channel import parse_channel
from slipstream.client.counters import SystemCounter
from slipstream.client.frames import (
    Data,
    ErrorFrame,
    Heartbeat,
    Nak,
    Pad,
    Rejected,
    ResponseSetup,
    Rttm,
    Setup,
    StatusMessage,
    decode,
    decode_datagram,
)
from slipstream.client.logbuffer import LogBuffer
from slipstream.daemon.config import DriverSettings
from slipstream.daemon.media.events import (
    ImageDone,
    ImageRejected,
    ImageRequested,
    ImageUnavailable,
)
from slipstream.daemon.media.receive_channel import (
    ERR_ANSWER_TEXT_MAX,
    RESPONSE_REQUEST_ROUNDS,
    ReceiveChannel,
)
from slipstream.daemon.protocol.loss_detector import (
    OptimalMulticastDelayGenerator,
    StaticDelayGenerator,
)
from slipstream.daemon.protocol.types import LocalCounters
from slipstream.daemon.streams.image import ImagePositions, ImageState

MS = 1_000_000
US = 1_000
TERM = 64 * 1024
SRC = ("10.0.0.1", 5555)


class ChannelWithLogs(ReceiveChannel):
    """A receive channel that knows where the test keeps its image logs."""

    log_directory: Path


def receive_channel(shm: Path, uri: str = "aeron:udp?endpoint=10.0.0.2:40123", **settings):
    counters = LocalCounters()
    rc = ChannelWithLogs(channel=parse_channel(uri), settings=DriverSettings(**settings),
                            receiver_id=7, counters=counters, now_ns=0, rng=random.Random(1))
    rc.log_directory = shm
    rc.add_subscription(2)
    return rc, counters


def joined(shm: Path):
    """A receive channel of one subscription with the image of ``setup()`` attached (one
    subscriber) and its first SM sent, at time 0: (channel, counters, image, the
    subscriber's position cell)."""
    rc, counters = receive_channel(shm)
    rc.on_datagram(setup(), SRC, 0)
    image, cell = attach(rc)
    rc.datagrams_to_send(0)
    return rc, counters, image, cell


def setup(active: int = 100, offset: int = 0, flags: int = 0) -> bytes:
    return Setup(offset, 1, 2, 100, active, TERM, 1408, 0, flags).encode()


def data(offset: int, payload: bytes = b"x" * 32, term_id: int = 100) -> bytes:
    return Data(offset, 1, 2, term_id, payload).encode()


def attach(rc: ChannelWithLogs, now_ns: int = 0):
    """The conductor's answer to the channel's one image request, with one subscriber."""
    [event] = rc.poll_events()
    assert isinstance(event, ImageRequested)
    setup = event.setup
    log = LogBuffer.create(
        rc.log_directory / f"{uuid.uuid4().hex}.log", term_length=setup.term_length,
        initial_term_id=setup.initial_term_id, session_id=setup.session_id,
        stream_id=setup.stream_id, mtu=setup.mtu, correlation_id=1,
        initial_term_count=setup.active_term_id - setup.initial_term_id,
        initial_term_offset=setup.term_offset)
    image = rc.new_image(event, log, ImagePositions.in_process(), now_ns)
    cell = ffi.new("int64_t *", image.join_position)
    image.add_subscriber_position(cell)
    rc.add_image(image)
    return image, cell


def test_setup_creates_image_and_first_sm_at_once(shm: Path) -> None:
    rc, _counters = receive_channel(shm)
    rc.on_datagram(setup(active=101, offset=1024), SRC, 5)
    image, _ = attach(rc, now_ns=5)
    assert image.state is ImageState.ACTIVE
    assert image.join_position == TERM + 1024
    assert rc.next_deadline_ns() == 5
    [dg] = rc.datagrams_to_send(5)
    assert dg.address == SRC
    assert decode(dg.data) == StatusMessage(1, 2, 101, 1024, TERM // 2, 7, 0)
    assert rc.next_deadline_ns() == 5 + 200 * MS
    rc.on_datagram(setup(), SRC, 6)  # a known session: ignored
    assert rc.poll_events() == []


def test_a_subscriber_position_past_the_hwm_is_held_there(shm: Path) -> None:
    """A client writes its subscriber position cell; one that says more than arrived (here
    near the int64 limit) neither moves the SM past the data nor cleans unread terms."""
    rc, _counters, image, cell = joined(shm)
    for i in range(4):
        rc.on_datagram(data(i * 64), SRC, 1)
    cell[0] = (1 << 63) - 16
    out = [decode(d.data) for d in rc.datagrams_to_send(300 * MS)]
    sms = [f for f in out if isinstance(f, StatusMessage)]
    assert sms and all(sm.consumption_term_id == 100 and sm.consumption_term_offset <= 256
                       for sm in sms)
    assert image.min_subscriber_position() == image.rcv_hwm == 256
    assert image.cleaner.position <= 0


def test_window_is_rcv_wnd_capped_at_half_term(shm: Path) -> None:
    rc, _ = receive_channel(shm, "aeron:udp?endpoint=10.0.0.2:40123|rcv-wnd=4096")
    rc.on_datagram(setup(), SRC, 0)
    attach(rc)
    assert decode(rc.datagrams_to_send(0)[0].data).receiver_window == 4096


def test_the_periodic_status_message_reports_what_subscribers_consumed_by_then(
        shm: Path) -> None:
    rc, _, _image, cell = joined(shm)
    rc.on_datagram(data(0), SRC, 1)
    cell[0] = 64  # consumed: far less than a quarter window, so no SM is scheduled
    assert rc.datagrams_to_send(2) == []
    [sm] = [decode(d.data) for d in rc.datagrams_to_send(200 * MS)]
    assert sm.consumption_term_offset == 64  # a sender that drains sees the end taken


def test_overrun_and_underrun_dropped(shm: Path) -> None:
    rc, counters, image, cell = joined(shm)
    rc.on_datagram(data(TERM // 2), SRC, 1)  # position + length > last SM + term/2
    assert counters[SystemCounter.FLOW_CONTROL_OVER_RUNS] == 1
    rc.on_datagram(data(0), SRC, 2)
    assert image.rcv_hwm == 64
    # Consume and SM past 64: a retransmit of 0 is now an under-run.
    for off in range(64, 20000, 64):
        rc.on_datagram(data(off), SRC, 3)
    cell[0] = 19968
    rc.datagrams_to_send(3)
    assert image.last_sm_position == 19968
    rc.on_datagram(data(0), SRC, 4)
    assert counters[SystemCounter.FLOW_CONTROL_UNDER_RUNS] == 1


def test_a_heartbeat_past_the_window_is_an_over_run_and_raises_nothing(shm: Path) -> None:
    rc, counters, image, _cell = joined(shm)
    # A forged heartbeat two terms ahead: it must not move the hwm (or the log's tail).
    rc.on_datagram(Heartbeat(0, 1, 2, 102, 0x00).encode(), SRC, 1)
    assert counters[SystemCounter.FLOW_CONTROL_OVER_RUNS] == 1
    assert image.rcv_hwm == 0 and not image.is_end_of_stream
    rc.on_datagram(Heartbeat(0, 1, 2, 100, 0x00).encode(), SRC, 2)  # in the window: taken
    assert counters[SystemCounter.FLOW_CONTROL_OVER_RUNS] == 1


def test_unicast_and_group_nak_delays(shm: Path) -> None:
    rc, _ = receive_channel(shm)
    rc.on_datagram(setup(), SRC, 0)
    image, _ = attach(rc)
    assert isinstance(image.loss_detector.delay_generator, StaticDelayGenerator)
    rc.datagrams_to_send(0)
    rc.on_datagram(data(64), SRC, 1 * MS)
    rc.datagrams_to_send(1 * MS)
    assert rc.next_deadline_ns() == 1 * MS + 100 * US
    [nak] = [decode(d.data) for d in rc.datagrams_to_send(1 * MS + 100 * US)]
    assert nak == Nak(1, 2, 100, 0, 64)
    assert rc.next_deadline_ns() == 1 * MS + 100 * US + 10 * MS
    rc2, _ = receive_channel(shm)
    rc2.on_datagram(setup(flags=0x40), SRC, 0)
    image2, _ = attach(rc2)
    assert isinstance(image2.loss_detector.delay_generator, OptimalMulticastDelayGenerator)


def test_group_false_in_the_uri_keeps_unicast_nak_timing_for_a_group_sender(shm: Path) -> None:
    # group=false decides, whatever the SETUP's GROUP flag or a multicast endpoint infer.
    for uri in ("aeron:udp?endpoint=10.0.0.2:40123|group=false",
                "aeron:udp?endpoint=224.0.1.1:40456|group=false"):
        rc, _ = receive_channel(shm, uri)
        rc.on_datagram(setup(flags=0x40), SRC, 0)
        image, _ = attach(rc)
        assert not image.is_group
        assert isinstance(image.loss_detector.delay_generator, StaticDelayGenerator)
    rc, _ = receive_channel(shm, "aeron:udp?endpoint=10.0.0.2:40123|group=true")
    rc.on_datagram(setup(), SRC, 0)
    image, _ = attach(rc)
    assert image.is_group


def test_multicast_control_goes_to_control_group(shm: Path) -> None:
    rc, _ = receive_channel(shm, "aeron:udp?endpoint=224.0.1.1:40456")
    rc.on_datagram(setup(flags=0x40), SRC, 0)
    attach(rc)
    assert rc.datagrams_to_send(0)[0].address == ("224.0.1.2", 40456)


def test_heartbeat_eos_then_draining_with_eos_sm_then_unavailable(shm: Path) -> None:
    rc, _ = receive_channel(shm)
    rc.on_datagram(setup(), SRC, 0)
    image, cell = attach(rc)
    rc.on_datagram(data(0), SRC, 0)
    rc.on_datagram(Heartbeat(64, 1, 2, 100, 0xE0).encode(), SRC, 1)
    sms = [decode(d.data) for d in rc.datagrams_to_send(1)]
    assert image.is_end_of_stream and image.log.end_of_stream_position == 64
    assert image.state is ImageState.DRAINING
    assert sms and sms[-1].is_eos
    cell[0] = 64
    t = 1
    while image.state is ImageState.DRAINING:
        t = rc.next_deadline_ns()
        rc.datagrams_to_send(t)
    assert t == 1 + 5 * 200 * MS
    assert isinstance(rc.poll_events()[0], ImageUnavailable)
    image.remove_subscriber_position(cell)
    rc.datagrams_to_send(t + 1)
    assert image.state is ImageState.DONE and not rc.images
    assert [type(e) for e in rc.poll_events()] == [ImageDone]
    rc.on_datagram(setup(), SRC, t + 2)  # cooling down
    assert rc.poll_events() == []


def test_an_ended_stream_whose_last_subscriber_went_is_done_at_once(shm: Path) -> None:
    """The sender ended the stream (EOS, rebuilt up to it) and the subscriber read it and
    went: nobody is left to tell with EOS-flagged SMs, so the image goes (and frees its log)
    at its next pass, not 5 status-message timeouts after DRAINING began, as it does while a
    subscriber stays (above)."""
    rc, _ = receive_channel(shm)
    rc.on_datagram(setup(), SRC, 0)
    image, cell = attach(rc)
    rc.on_datagram(data(0), SRC, 0)
    rc.on_datagram(Heartbeat(64, 1, 2, 100, 0xE0).encode(), SRC, 1)
    rc.datagrams_to_send(1)
    assert image.state is ImageState.DRAINING
    cell[0] = 64
    image.remove_subscriber_position(cell)
    assert image.due(2)  # the agent runs its pass at once
    rc.datagrams_to_send(2)
    assert image.state is ImageState.LINGER
    assert rc.next_deadline_ns() == 2  # no subscriber: the linger ends at once
    rc.datagrams_to_send(2)
    assert image.state is ImageState.DONE and not rc.images
    assert [type(e) for e in rc.poll_events()] == [ImageUnavailable, ImageDone]


def test_an_ended_image_tells_its_sender_with_an_eos_sm_before_it_goes(shm: Path) -> None:
    """The sender's EOS and the last subscriber's going both come before the image's next
    pass: the image still sends one EOS-flagged SM before it lingers, so the sender ends
    its own linger at once (not after publication_linger_timeout)."""
    rc, _ = receive_channel(shm)
    rc.on_datagram(setup(), SRC, 0)
    image, cell = attach(rc)
    rc.on_datagram(data(0), SRC, 0)
    rc.on_datagram(Heartbeat(64, 1, 2, 100, 0xE0).encode(), SRC, 1)
    cell[0] = 64
    image.remove_subscriber_position(cell)
    sent = []
    t = 1
    while image.state is not ImageState.DONE:
        assert t < 5 * 200 * MS, "the ended image waited out the drain"
        sent += [decode(d.data) for d in rc.datagrams_to_send(t)]
        t = max(t + 1, rc.next_deadline_ns())
    assert any(isinstance(sm, StatusMessage) and sm.is_eos for sm in sent)


def test_a_stream_still_sending_when_its_last_subscriber_went_drains_the_full_wait(
        shm: Path) -> None:
    """Without the sender's EOS the image tells the sender with EOS-flagged SMs for 5
    status-message timeouts before it lingers."""
    rc, _ = receive_channel(shm)
    rc.on_datagram(setup(), SRC, 0)
    image, cell = attach(rc)
    rc.on_datagram(data(0), SRC, 0)
    rc.datagrams_to_send(1)
    image.remove_subscriber_position(cell)
    rc.datagrams_to_send(2)
    assert image.state is ImageState.DRAINING
    t = 2
    while image.state is ImageState.DRAINING:
        t = rc.next_deadline_ns()
        rc.datagrams_to_send(t)
    assert t >= 1 + 5 * 200 * MS


def test_elicit_setup_for_unknown_session_and_session_filter(shm: Path) -> None:
    rc, _ = receive_channel(shm)
    rc.on_datagram(data(0), SRC, 0)
    [sm] = [decode(d.data) for d in rc.datagrams_to_send(0)]
    assert sm == StatusMessage(1, 2, 0, 0, 0, 7, 0x80)
    rc.on_datagram(Heartbeat(0, 1, 2, 100, 0xE0).encode(), SRC, 2 * 10**9)  # EOS: no elicit
    assert rc.datagrams_to_send(2 * 10**9) == []
    rc2, _ = receive_channel(shm)
    rc2.remove_subscription(2)
    rc2.add_subscription(2, session_id=9)
    rc2.on_datagram(setup(), SRC, 0)
    assert rc2.poll_events() == []


def test_a_request_image_sends_rsp_setup_until_its_response_publication_connects(
        shm: Path) -> None:
    """docs/CHANNELS.md §7.6: an image whose SETUP carried SEND_RESPONSE (0x80) asked for a
    response; once the conductor names the response publication's session, the image sends
    RSP_SETUP (its own session and stream, and that session) to the SETUP's source at once
    and every status-message timeout, until the conductor says it is connected."""
    rc, _ = receive_channel(shm)
    rc.on_datagram(setup(flags=0x80), SRC, 0)
    image, _cell = attach(rc)
    assert image.wants_response
    rc.datagrams_to_send(0)
    image.set_response_session(4242, 10)
    assert rc.next_deadline_ns() == 10
    frames = [(decode(d.data), d.address) for d in rc.datagrams_to_send(10)]
    assert (ResponseSetup(1, 2, 4242), SRC) in frames
    assert rc.next_deadline_ns() <= 10 + 200 * MS
    frames = [decode(d.data) for d in rc.datagrams_to_send(10 + 200 * MS)]
    assert ResponseSetup(1, 2, 4242) in frames
    image.set_response_session(None, 300 * MS)
    frames = [decode(d.data) for t in (400 * MS, 600 * MS) for d in rc.datagrams_to_send(t)]
    assert frames and not any(isinstance(f, ResponseSetup) for f in frames)

    rc2, _ = receive_channel(shm)
    rc2.on_datagram(setup(), SRC, 0)
    plain, _ = attach(rc2)
    assert not plain.wants_response


def test_a_response_endpoint_elicits_each_session_it_was_told_of(shm: Path) -> None:
    """A response subscription's endpoint (control-mode=response) asks the control address
    for SETUP of each session it wants and has no image of (session 0 would teach a
    response publication nothing), at once and every second; none before it wants one.
    While it has the image it asks every RESPONSE_REQUEST_ROUNDS seconds only (a response
    publication that lost its address learns it again); once the image has gone, every
    second again."""
    control = ("10.0.0.9", 7000)
    counters = LocalCounters()
    rc = ChannelWithLogs(channel=parse_channel("aeron:udp?control-mode=response"
                                               "|control=10.0.0.9:7000"),
                         settings=DriverSettings(), receiver_id=7, counters=counters,
                         now_ns=0, rng=random.Random(1))
    rc.log_directory = shm
    assert rc.datagrams_to_send(0) == []
    rc.set_interest(2, {1})
    sent = [(decode(d.data), d.address) for d in rc.datagrams_to_send(0)]
    assert sent == [(StatusMessage(1, 2, 0, 0, 0, 7, 0x80), control)]
    assert rc.datagrams_to_send(500 * MS) == []
    assert [decode(d.data) for d in rc.datagrams_to_send(10**9)] == [
        StatusMessage(1, 2, 0, 0, 0, 7, 0x80)]
    rc.on_datagram(setup(), control, 10**9 + 1)
    attach(rc, now_ns=10**9 + 1)

    def asked(now_ns: int) -> bool:
        return any(isinstance(f, StatusMessage) and f.is_setup_request
                   for f in (decode(d.data) for d in rc.datagrams_to_send(now_ns)))

    rounds = [asked(s * 10**9 + 1) for s in range(2, 2 + 2 * RESPONSE_REQUEST_ROUNDS)]
    assert rounds.count(True) == 2 and rounds.index(True) == RESPONSE_REQUEST_ROUNDS - 3
    second = 2 + 2 * RESPONSE_REQUEST_ROUNDS
    while rc.images:  # no data: the image times out, lingers and goes
        rounds.append(asked(second * 10**9 + 1))
        second += 1
    assert all(asked(s * 10**9 + 1) for s in range(second, second + 3))


def test_rttm_reply_echoed(shm: Path) -> None:
    rc, _, _, _ = joined(shm)
    rc.on_datagram(Rttm(1, 2, 555, 0, 0, 0x80).encode(), SRC, 1)
    out = [decode(d.data) for d in rc.datagrams_to_send(1)]
    assert Rttm(1, 2, 555, 0, 7, 0) in out


@pytest.mark.parametrize("bad", [
    b"",
    b"\x00" * 7,
    Data(16, 1, 2, 100, b"x").encode(),  # misaligned offset
    Data(TERM - 32, 1, 2, 100, b"x" * 64).encode(),  # past the term end
    Heartbeat(0, 1, 2, 100).encode() + b"\x00" * 32,  # heartbeat longer than 32
    Pad(0, 1, 2, 100, 16).encode(),  # pad shorter than its header
    Pad(TERM - 32, 1, 2, 100, 40).encode(),  # pad whose aligned length runs past the term
    Pad(0, 1, 2, 100, 2**31 - 1).encode(),  # pad whose aligned length is past int32
    b"\x20\x00\x00\x00\x01\xc0\x01\x00" + b"\x00" * 24,  # version 1
    b"\x28\x00\x00\x00\x00\x00\x05\x00" + b"\x00" * 8,  # short SETUP
    b"\x10\x00\x00\x00\x00\x00\x99\x00" + b"\x00" * 24,  # unknown type
])
def test_malformed_datagrams_counted(shm: Path, bad: bytes) -> None:
    rc, counters = receive_channel(shm)
    rc.on_datagram(setup(), SRC, 0)
    attach(rc)
    rc.on_datagram(bad, SRC, 1)
    rc.datagrams_to_send(1)
    assert counters[SystemCounter.INVALID_PACKETS] == 1


def test_large_pad_is_not_an_overrun_and_completes_the_term(shm: Path) -> None:
    rc, counters, image, _ = joined(shm)
    rc.on_datagram(data(0), SRC, 1)
    rc.on_datagram(Pad(64, 1, 2, 100, TERM - 64).encode(), SRC, 1)
    rc.datagrams_to_send(1)
    assert counters[SystemCounter.FLOW_CONTROL_OVER_RUNS] == 0
    assert image.rcv_hwm == image.rcv_pos == TERM
    assert image.loss_detector.next_deadline_ns() > 1 * 10**18  # no gap


def test_an_aborted_claims_pad_mid_term_stands_for_its_aligned_length(shm: Path) -> None:
    """An aborted claim of 100 bytes is a PAD of frame_length 132 (not a multiple of 32): the
    receiver inserts its header, which stands for 160 bytes of the term, and the data after
    it follows in order; nothing is NAKed, nothing is invalid."""
    rc, counters, image, _ = joined(shm)
    rc.on_datagram(data(0), SRC, 1)
    rc.on_datagram(Pad(64, 1, 2, 100, 132).encode(), SRC, 1)
    rc.on_datagram(data(64 + 160), SRC, 1)
    rc.datagrams_to_send(1)
    assert counters[SystemCounter.INVALID_PACKETS] == 0
    assert image.rcv_hwm == image.rcv_pos == 64 + 160 + 64
    assert image.loss_detector.next_deadline_ns() > 1 * 10**18  # no gap


def test_data_frames_ending_in_a_pad_header_complete_the_term(shm: Path) -> None:
    """Aeron's scanner sends the PAD that ends a term after the frames before it, in one
    datagram: taken whole (the codec agrees), the term complete, the next term's data in
    order, nothing NAKed."""
    rc, counters = receive_channel(shm)
    rc.on_datagram(setup(offset=TERM - 256), SRC, 0)  # joins 256 bytes before the term's end
    image, _ = attach(rc)
    rc.datagrams_to_send(0)
    datagram = (data(TERM - 192) + data(TERM - 128)
                + Pad(TERM - 64, 1, 2, 100, 64).encode())
    assert [type(f).__name__ for f in decode_datagram(datagram)] == ["Data", "Data", "Pad"]
    rc.on_datagram(data(TERM - 256), SRC, 1)
    rc.on_datagram(datagram, SRC, 1)
    rc.on_datagram(data(0, term_id=101), SRC, 1)
    rc.datagrams_to_send(1)
    assert counters[SystemCounter.INVALID_PACKETS] == 0
    assert image.rcv_hwm == image.rcv_pos == TERM + 64
    assert image.loss_detector.next_deadline_ns() > 1 * 10**18  # no gap


@pytest.mark.parametrize("bad", [
    data(TERM - 128) + Pad(TERM - 64, 1, 2, 100, 64).encode() + bytes(32),  # bytes after PAD
    data(TERM - 128) + Pad(TERM - 64, 1, 2, 100, 16).encode(),  # PAD shorter than its header
    data(TERM - 128) + Pad(TERM - 32, 1, 2, 100, 32).encode(),  # PAD at the wrong offset
    data(TERM - 128) + Pad(TERM - 64, 9, 2, 100, 64).encode(),  # another session's PAD
])
def test_a_malformed_pad_after_data_rejects_the_datagram(shm: Path, bad: bytes) -> None:
    rc, counters = receive_channel(shm)
    rc.on_datagram(setup(offset=TERM - 256), SRC, 0)
    image, _ = attach(rc)
    rc.on_datagram(bad, SRC, 1)
    rc.datagrams_to_send(1)
    assert counters[SystemCounter.INVALID_PACKETS] == 1
    assert isinstance(decode_datagram(bad), Rejected)
    assert image.rcv_hwm == TERM - 256


def test_a_pad_after_data_that_runs_past_the_term_rejects_the_datagram(shm: Path) -> None:
    """The codec cannot tell (it knows no term length); the receive path can."""
    rc, counters = receive_channel(shm)
    rc.on_datagram(setup(offset=TERM - 256), SRC, 0)
    image, _ = attach(rc)
    rc.on_datagram(data(TERM - 128) + Pad(TERM - 64, 1, 2, 100, 128).encode(), SRC, 1)
    rc.datagrams_to_send(1)
    assert counters[SystemCounter.INVALID_PACKETS] == 1
    assert image.rcv_hwm == TERM - 256


@pytest.mark.parametrize("bad", [
    Setup(16, 1, 2, 100, 100, TERM, 1408, 0, 0),  # misaligned join offset
    Setup(TERM, 1, 2, 100, 100, TERM, 1408, 0, 0),  # past the term
    Setup(0, 1, 2, 100, 99, TERM, 1408, 0, 0),  # active term before the initial term
    Setup(0, 1, 2, 100, 100, TERM + 1, 1408, 0, 0),  # term length not a power of two
    Setup(0, 1, 2, 100, 100, TERM, 1000, 0, 0),  # MTU not a multiple of 32
])
def test_setups_that_name_an_impossible_log_are_counted_and_dropped(shm: Path,
                                                                     bad: Setup) -> None:
    rc, counters = receive_channel(shm)
    rc.on_datagram(bad.encode(), SRC, 0)
    assert rc.poll_events() == []
    assert counters[SystemCounter.INVALID_PACKETS] == 1


def test_a_setup_asking_for_terms_past_the_limit_is_rejected_and_told(shm: Path) -> None:
    rc, counters = receive_channel(shm, image_term_buffer_length_max="1m")
    rc.on_datagram(Setup(0, 1, 2, 100, 100, 2 * 1024 * 1024, 1408, 0, 0).encode(), SRC, 0)
    # No image is asked for; the conductor hears why, to log it (the sender hears it too).
    [rejected] = rc.poll_events()
    assert isinstance(rejected, ImageRejected)
    assert rejected.reason == ("term length 2097152 is over this receiver's "
                               "image_term_buffer_length_max of 1048576")
    [err] = [decode(d.data) for d in rc.datagrams_to_send(0)]
    assert isinstance(err, ErrorFrame) and "image_term_buffer_length_max" in err.message
    # One cause each (DROP_CAUSES): the term length's, not the catch-all.
    assert counters[SystemCounter.IMAGE_TERM_LENGTH_REFUSED] == 1
    assert counters[SystemCounter.IMAGES_REJECTED] == 0


@pytest.mark.parametrize(("uri", "mtu", "window"), [
    ("aeron:udp?endpoint=10.0.0.2:40123|rcv-wnd=4k", 8192, 4096),
    # 64k terms: the window is at most half a term.
    ("aeron:udp?endpoint=10.0.0.2:40123|rcv-wnd=64k|so-rcvbuf=64k", 65504, 32768),
])
def test_a_sender_whose_datagrams_the_window_cannot_hold_is_refused_as_aeron_does(
        shm: Path, uri: str, mtu: int, window: int) -> None:
    """A window smaller than one of the sender's datagrams would never let one go (the stream
    stalled, connected): the image is refused, and the sender and the conductor hear why."""
    rc, counters = receive_channel(shm, uri)
    rc.on_datagram(Setup(0, 1, 2, 100, 100, 64 * 1024, mtu, 0, 0).encode(), SRC, 0)
    [rejected] = rc.poll_events()
    assert isinstance(rejected, ImageRejected)
    assert rejected.reason.startswith(f"the sender's mtu {mtu} is more than this receiver's "
                                      f"window {window}")
    [err] = [decode(d.data) for d in rc.datagrams_to_send(0)]
    assert isinstance(err, ErrorFrame) and err.message == rejected.reason
    assert err.error_code == 13  # Aeron's IMAGE_REJECTED
    assert counters[SystemCounter.IMAGES_REJECTED] == 1


def test_a_long_rejection_reason_in_any_script_is_cut_to_at_most_3x_the_setup(
        shm: Path) -> None:
    """The ERR answering a SETUP carries at most ERR_ANSWER_TEXT_MAX bytes of its reason, cut
    at a character boundary: at most 3x the SETUP on the wire (an address a SETUP is spoofed
    from gets no more)."""
    rc, _ = receive_channel(shm)
    rc.on_datagram(setup(), SRC, 0)
    [request] = rc.poll_events()
    reason = "no room for the log: " + "é" * 1100  # 2 bytes each: well past the limit
    rc.reject_image(request, 0, reason)
    [datagram] = rc.datagrams_to_send(0)
    err = decode(datagram.data)
    assert isinstance(err, ErrorFrame)
    assert len(err.message.encode()) <= ERR_ANSWER_TEXT_MAX and reason.startswith(err.message)
    assert len(err.message.encode()) >= ERR_ANSWER_TEXT_MAX - 1
    udp_ip = 28
    assert len(datagram.data) + udp_ip <= 3 * (len(setup()) + udp_ip)


@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(frames=st.integers(1, 6), liar=st.data(),
       lie=st.sampled_from([-(2**31), -1, 0, 1, 31, 96, 2**31 - 1, 2**31 - 31, 2**30, 4096]))
def test_a_lying_length_at_any_frame_of_a_datagram_is_counted_and_nothing_lands(
        shm: Path, frames: int, liar: st.DataObject, lie: int) -> None:
    """Every frame of a DATA datagram is checked (with 64-bit arithmetic, so a length near
    2^31 cannot wrap), not only the first: one bad frame drops the whole datagram."""
    rc, counters = receive_channel(shm)
    rc.on_datagram(setup(), SRC, 0)
    image, _ = attach(rc)
    datagram = bytearray(b"".join(data(64 * i) for i in range(frames)))  # 64 B frames
    at = liar.draw(st.integers(0, frames - 1)) * 64
    struct.pack_into("<i", datagram, at, lie)
    rc.on_datagram(bytes(datagram), SRC, 1)
    rc.datagrams_to_send(1)
    assert counters[SystemCounter.INVALID_PACKETS] == 1
    assert image.rcv_hwm == image.join_position
    assert image.log.frame_length_volatile(0, 0) == 0


def test_a_datagram_over_a_shorter_one_already_there_does_not_carry_rcv_pos_over_a_hole(
        shm: Path) -> None:
    """Multicast: another receiver's retransmission [256, 1344) lands where this receiver
    already holds the one-frame datagram [256, 320).  The insert copies nothing (the first
    frame is there), so [320, 1344) is still missing: rcv-pos must stop at 320 and the hole be
    NAKed, though the datagram began where in-order data ended."""
    rc, _ = receive_channel(shm, "aeron:udp?endpoint=224.0.1.1:40456")
    rc.on_datagram(setup(flags=0x40), SRC, 0)
    image, _ = attach(rc)
    rc.datagrams_to_send(0)

    def datagram(offset: int, frames: int) -> bytes:  # 64-byte frames from offset
        return b"".join(data(offset + 64 * k) for k in range(frames))

    rc.on_datagram(datagram(0, 2), SRC, 1)
    rc.on_datagram(datagram(256, 1), SRC, 1)  # [128, 256) and [320, 1408) lost
    rc.on_datagram(datagram(1408, 1), SRC, 1)
    rc.datagrams_to_send(1)
    assert image.rcv_pos == 128
    rc.on_datagram(datagram(128, 2), SRC, 2)  # the repair of [128, 256)
    rc.on_datagram(datagram(256, 17), SRC, 2)  # another receiver's repair: found [256, 320)
    rc.datagrams_to_send(2)
    assert image.rcv_pos == 320
    naks = [decode(d.data) for t in range(3, 300)
            for d in rc.datagrams_to_send(t * MS)]
    assert any(isinstance(n, Nak) and n.term_offset == 320 for n in naks)


# -- a multi-destination subscription's image (docs/CHANNELS.md §7.5) --------------------------
def _via(receiver, frame: bytes, source: tuple[str, int], now_ns: int) -> int:
    """``frame`` arriving through a destination's C receiver from ``source``."""
    from slipstream.daemon._network import lib as network
    from slipstream.daemon.protocol.types import sockaddr

    raw = sockaddr(source)
    return network.ss_receiver_on_datagram(receiver, frame, len(frame), raw, len(raw), now_ns)


def _two_destinations(shm: Path):
    """A control-mode=manual channel (image liveness 1 s) with two destinations whose C
    receivers have no socket: (channel, its counters, the first's receiver, the second's, the
    second's control group).  The first is unicast, the second a multicast group's."""
    from slipstream.daemon._network import ffi as network_ffi

    rc, counters = receive_channel(shm, "aeron:udp?control-mode=manual",
                                   image_liveness_timeout=1_000 * MS)
    first, second = (network_ffi.new("ss_receiver_t *") for _ in range(2))
    for receiver in (first, second):
        receiver.fd = -1
    control_group = ("224.0.1.3", 4000)
    rc.attach_destination(0, first, None)
    rc.attach_destination(1, second, control_group)
    return rc, counters, first, second, control_group


def _joined_through_first(rc: ChannelWithLogs):
    """The image of ``setup()`` from SRC, come through ``rc``'s first destination at time
    0, attached; its first SM goes back along that path alone.  Returns the image."""
    rc.arrival_destination = 0
    rc.on_control(setup(), SRC, 0)
    rc.arrival_destination = -1
    image, _cell = attach(rc)
    [sm] = rc.datagrams_to_send(0)
    assert (sm.address, sm.via) == (SRC, 0)
    return image


def test_a_multi_destination_image_takes_every_path_and_answers_the_live_ones(
        shm: Path) -> None:
    """Two destinations of one control-mode=manual channel feed one image: the SETUP through
    the first makes it, data through the second from another address is taken (not a
    foreign source), a copy of a frame already there changes nothing, and the status
    messages go along each path heard from within the liveness timeout, the multicast one to
    its control group, each through its destination; a path silent for longer, or whose
    destination is removed, gets none."""
    rc, counters, first, second, control_group = _two_destinations(shm)
    with pytest.raises(ValueError):
        rc.attach_destination(1, second, None)  # a slot taken
    other = ("10.0.0.9", 6000)
    image = _joined_through_first(rc)

    assert _via(second, data(0), other, 10) == 0
    assert _via(first, data(0), SRC, 11) == 0  # the same frame again: a duplicate
    assert counters[SystemCounter.FOREIGN_SOURCE_DROPS] == 0
    assert image.rcv_hwm == 64
    rc.datagrams_to_send(12)
    sms = rc.datagrams_to_send(200 * MS + 20)
    assert sorted((d.address, d.via) for d in sms) == [(SRC, 0), (control_group, 1)]

    # Only the second path brings data for longer than the liveness timeout.
    for t in range(1, 8):
        _via(second, Heartbeat(64, 1, 2, 100).encode(), other, t * 200 * MS)
        rc.datagrams_to_send(t * 200 * MS + 30)
    sms = rc.datagrams_to_send(8 * 200 * MS + 40)
    assert [(d.address, d.via) for d in sms] == [(control_group, 1)]
    assert image.state is ImageState.ACTIVE

    rc.detach_destination(1)
    assert rc.datagrams_to_send(9 * 200 * MS + 50) == []
    assert rc.socket_receivers == []  # neither destination has a socket here



def test_a_datagram_from_elsewhere_does_not_redirect_a_live_path(shm: Path) -> None:
    """A path's control address is set by the first frame (or SETUP) that comes its way and
    only kept live after (Aeron's trackConnection): data from another address, inside the
    window or not, and a SETUP from another address leave a live path where it is; a forged
    frame outside the window does not even keep it live.  Once the path went quiet past the
    liveness timeout, the next data in the window sets it anew."""
    rc, counters, first, second, control_group = _two_destinations(shm)
    forger = ("10.0.0.66", 6666)
    image = _joined_through_first(rc)

    def sm_paths(now_ns: int) -> list:
        return sorted((d.address, d.via) for d in rc.datagrams_to_send(now_ns)
                      if isinstance(decode(d.data), StatusMessage))

    # Over-runs from the forger (past the window, a term far ahead, a heartbeat past it).
    over_runs = counters[SystemCounter.FLOW_CONTROL_OVER_RUNS]
    assert _via(first, data(TERM // 2 + 1024), forger, 10) == 0
    assert _via(first, data(0, term_id=140), forger, 11) == 0
    assert _via(first, Heartbeat(TERM - 64, 1, 2, 100).encode(), forger, 12) == 0
    assert counters[SystemCounter.FLOW_CONTROL_OVER_RUNS] == over_runs + 3
    assert sm_paths(200 * MS + 20) == [(SRC, 0)]
    # In the window, from the forger: taken, the path kept live, its address not moved.
    assert _via(first, data(0), forger, 300 * MS) == 0
    assert image.rcv_hwm == 64
    assert sm_paths(400 * MS + 30) == [(SRC, 0)]
    # A SETUP from the forger through the same destination: the live path stays.
    rc.arrival_destination = 0
    rc.on_control(setup(), forger, 500 * MS)
    rc.arrival_destination = -1
    assert sm_paths(600 * MS + 40) == [(SRC, 0)]
    # Forged frames outside the window do not keep the path live (the sender's heartbeats
    # on the second path keep the image live): past the timeout the first path gets none.
    late = set()
    for t in range(7, 16):
        _via(first, data(TERM // 2 + 1024), forger, t * 100 * MS)
        _via(second, Heartbeat(64, 1, 2, 100).encode(), SRC, t * 100 * MS)
        paths = sm_paths(t * 100 * MS + 1)
        if t >= 14:  # the first path last heard from in the window at 300 ms
            late.update(paths)
    assert late == {(control_group, 1)}
    assert image.state is ImageState.ACTIVE
    # Quiet past the timeout: the next data in the window sets where the path goes.
    other = ("10.0.0.7", 7000)
    assert _via(first, data(64), other, 1_600 * MS) == 0
    _via(second, Heartbeat(128, 1, 2, 100).encode(), SRC, 1_700 * MS)
    assert sm_paths(1_800 * MS + 50) == [(other, 0), (control_group, 1)]


def test_a_path_seeded_by_its_setup_has_its_destinations_socket(shm: Path) -> None:
    """The C half sends a path's control frames through its destination's socket: a path
    that has had its SETUP and no data yet has that socket once its image is added (before,
    the C half found no path to send on, and counted its status messages sent); one whose
    destination went before the image was added is dropped."""
    import socket

    from slipstream.daemon._network import ffi as network_ffi

    rc, _counters = receive_channel(shm, "aeron:udp?control-mode=manual")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        first, second = (network_ffi.new("ss_receiver_t *") for _ in range(2))
        first.fd = sock.fileno()
        second.fd = -1
        rc.attach_destination(0, first, None)
        rc.attach_destination(1, second, None)
        rc.arrival_destination = 1
        rc.on_control(setup(), ("10.0.0.8", 8000), 0)
        rc.arrival_destination = -1
        rc.detach_destination(1)  # after the SETUP, before the conductor's image comes
        image, _cell = attach(rc)
        connections = image.c.connections
        assert (connections[1].fd, connections[1].address_length) == (-1, 0)
        assert rc.datagrams_to_send(0) == []  # no path left
        rc.arrival_destination = 0
        rc.on_control(setup(), SRC, 1)
        rc.arrival_destination = -1
        assert connections[0].fd == sock.fileno()
        assert connections[0].address_length > 0


def test_a_session_refused_again_cools_down_twice_as_long_up_to_8_cool_downs(
        shm: Path) -> None:
    """Each refusal of a session that comes within two cool-downs of the end of its last
    doubles its cool-down (1, 2, 4, 8, 8 s: a SETUP sooner asks for nothing), each answered
    with an ERR; a session refused after a longer quiet starts again at 1 s."""
    rc, _ = receive_channel(shm)
    second = 1_000_000_000
    now = 0

    def refused_at(t: int) -> int:
        """Send the SETUP at ``t``, refuse the request it makes; its ERR's session."""
        rc.on_datagram(setup(), SRC, t)
        [request] = rc.poll_events()
        rc.reject_image(request, t, "image_source_memory_limit (1 MiB) reached")
        [err] = [decode(d.data) for d in rc.datagrams_to_send(t)]
        assert isinstance(err, ErrorFrame)
        return err.session_id

    for cool_down in (1, 2, 4, 8, 8):
        assert refused_at(now) == 1
        rc.on_datagram(setup(), SRC, now + cool_down * second - 1)
        assert rc.poll_events() == [], f"asked within a cool-down of {cool_down} s"
        now += cool_down * second
    now += 3 * 8 * second  # quiet past two cool-downs after the last one's end
    assert refused_at(now) == 1
    rc.on_datagram(setup(), SRC, now + second)
    assert len(rc.poll_events()) == 1, "cools down 1 s again"


def test_a_session_refused_again_for_a_passing_cause_cools_down_1_s_each_time(
        shm: Path) -> None:
    """A refusal whose cause passes as logs are made or images are heard (not ``lasting``:
    image_pending_max, image_source_max_images) cools the session down 1 s however often it
    comes, so a peer's many streams refused together are not pushed 8 s apart."""
    rc, _ = receive_channel(shm)
    second = 1_000_000_000
    for attempt in range(5):
        now = attempt * second
        rc.on_datagram(setup(), SRC, now)
        [request] = rc.poll_events()
        rc.reject_image(request, now, "image_pending_max (1) reached", lasting=False)
        rc.datagrams_to_send(now)
        rc.on_datagram(setup(), SRC, now + second - 1)
        assert rc.poll_events() == [], "asked within the cool-down"
    rc.on_datagram(setup(), SRC, 5 * second)
    assert len(rc.poll_events()) == 1, "a refusal again still cools down 1 s"
