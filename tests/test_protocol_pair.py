"""A sender host and a receiver host joined by an in-memory link (h11 tests/helpers.py style).

Each side runs the driver's own network agent (:class:`Sender`, :class:`Receiver`) and C data
path; the link between them is the test's: it owns the clock and can drop, delay or reorder
any datagram.  Logs are real log buffers under /dev/shm, written with the real C appender and
read with the real subscriber ``Image``; the test plays the conductor's part (image logs).
"""

from __future__ import annotations

import itertools
import random
import shutil
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import attrs
import pytest
from helpers import data_datagrams
from hypothesis import given, settings
from hypothesis import strategies as st

from slipstream.client._native import ffi, lib
from slipstream.client.channel import parse_channel
from slipstream.client.counters import SystemCounter
from slipstream.client.frames import (
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
from slipstream.client.image import Image
from slipstream.client.layout import (
    CURRENT_VERSION,
    DATA_HEADER,
    HDR_TYPE_DATA,
    HDR_TYPE_PAD,
    INT32_MAX,
    INT32_MIN,
    INT64_MAX,
    NO_DEADLINE,
)
from slipstream.client.logbuffer import LogBuffer, new_appender
from slipstream.daemon._network import ffi as network_ffi
from slipstream.daemon._network import lib as network_lib
from slipstream.daemon.agents.commands import ClosePublication
from slipstream.daemon.agents.endpoints import ReceiveEndpoint, SendEndpoint
from slipstream.daemon.agents.receiver import Receiver
from slipstream.daemon.agents.sender import Sender
from slipstream.daemon.config import DriverSettings
from slipstream.daemon.flow.congestion_control import CongestionControl
from slipstream.daemon.flow.registry import CONGESTION_CONTROLS, flow_control_for
from slipstream.daemon.media import send_point
from slipstream.daemon.media.events import ImageRequested, ImageUnavailable
from slipstream.daemon.media.receive_channel import ReceiveChannel
from slipstream.daemon.media.send_channel import SendChannel
from slipstream.daemon.protocol.params import PublicationParams
from slipstream.daemon.protocol.types import Address, Datagram, LocalCounters
from slipstream.daemon.streams.image import ImagePositions, ImageState
from slipstream.daemon.streams.publication import (
    NetworkPublication,
    PublicationState,
    SenderPositions,
)

MS = 1_000_000
US = 1_000
SENDER = ("10.0.0.1", 40001)
RECEIVER = ("10.0.0.2", 40123)
URI = "aeron:udp?endpoint=10.0.0.2:40123"
SESSION = 77
STREAM = 1001


class LinkTransport:
    """One end of the test's link, as both transport protocols see it."""

    def __init__(self, pair: Pair, direction: str, peer: Address) -> None:
        self.pair = pair
        self.direction = direction
        self.peer = peer
        self.inbox: list[bytes] = []
        self.binding_handle = network_ffi.new_handle(self)  # a send_point.VirtualPort

    def attach(self, publication: NetworkPublication) -> None:
        send_point.attach_publication(publication, fd=-1, virtual=self)

    def room(self, publication: NetworkPublication, now_ns: int) -> int:
        return -1  # the test's link takes every datagram

    def room_ready_ns(self, publication: NetworkPublication, now_ns: int) -> int:
        return now_ns

    def put_datagram(self, address: Address, data: bytes) -> None:
        self.pair._emit(self.direction, [Datagram(data, address)])

    def send(self, datagrams: list[Datagram]) -> None:
        self.pair._emit(self.direction, [Datagram(bytes(d.data), d.address) for d in datagrams])

    def receive(self, channel: SendChannel | ReceiveChannel, now_ns: int) -> int:
        inbox, self.inbox = self.inbox, []
        for data in inbox:
            channel.on_datagram(data, self.peer, now_ns)
        return len(inbox)

    def attach_channel(self, channel: SendChannel | ReceiveChannel) -> None:
        pass  # no socket: arrivals come through receive()

    def dispatch(self, channel: SendChannel | ReceiveChannel, now_ns: int) -> int:
        return 0

    def on_notice(self, publication: NetworkPublication) -> None:
        pass

    def close(self) -> None:
        pass


class Pair:
    """Publisher host + receiver host + a link the test controls.

    ``sent`` records every datagram as (t_ns, direction, frame(s)); ``drop`` is a predicate
    on (direction, datagram) deciding loss; ``delay_ns`` is the one-way latency.
    """

    def __init__(self, directory: Path, *, uri: str = URI, term_length: int = 64 * 1024,
                 settings_: DriverSettings | None = None, initial_term_id: int = 1000,
                 receiver_uri: str | None = None) -> None:
        self.dir = directory
        self.now = 0
        self.settings = settings_ or DriverSettings()
        self.channel = parse_channel(uri)
        self.pub_counters = LocalCounters()
        self.rcv_counters = LocalCounters()
        self.log = LogBuffer.create(directory / "pub.log", term_length=term_length,
                                    initial_term_id=initial_term_id, session_id=SESSION,
                                    stream_id=STREAM, mtu=self.channel.mtu or 1408,
                                    correlation_id=1)
        positions = SenderPositions.in_process()
        self.pub_limit = positions.publisher_limit
        self.appender = new_appender(self.log, self.pub_limit)
        params = PublicationParams.for_network(
            attrs.evolve(self.channel, term_length=term_length), self.settings)
        self.publication = NetworkPublication(
            log=self.log, params=params, settings=self.settings, positions=positions,
            flow_control=flow_control_for(params), counters=self.pub_counters, now_ns=0,
            destination=RECEIVER)
        self.send_channel = SendChannel(counters=self.pub_counters)
        self.sender = Sender(on_event=lambda event: None)
        self.sender_link = LinkTransport(self, "p2r", RECEIVER)
        self.sender.add_endpoint(SendEndpoint(self.send_channel, self.sender_link))
        self.sender.add_publication(self.sender.endpoints[0], self.publication)
        self.receive = ReceiveChannel(
            channel=parse_channel(receiver_uri or uri), settings=self.settings,
            receiver_id=4242, counters=self.rcv_counters, now_ns=0, rng=random.Random(7))
        self.receive.add_subscription(STREAM)
        self.receiver = Receiver(on_event=self._on_receiver_event)
        self.receiver_link = LinkTransport(self, "r2p", SENDER)
        self.receiver.add_endpoint(ReceiveEndpoint(self.receive, self.receiver_link))
        self.sub_position = ffi.new("int64_t *", 0)
        self.subscriber: Image | None = None
        self.unavailable = None
        self.received: list[bytes] = []
        self.in_flight: list[tuple[int, int, str, Datagram]] = []  # (arrival, seq, dir, dg)
        self._seq = 0
        self.sent: list[tuple[int, str, object]] = []
        self.drop: Callable[[str, Datagram], bool] = lambda direction, dg: False
        self.delay_ns = 0
        self.auto_poll = True

    def _on_receiver_event(self, event: object) -> None:
        """The conductor's part: a log for each image, and the subscriber on it."""
        if isinstance(event, ImageRequested):
            setup = event.setup
            log = LogBuffer.create(
                self.dir / f"image-{setup.session_id}-{uuid.uuid4().hex[:6]}.log",
                term_length=setup.term_length, initial_term_id=setup.initial_term_id,
                session_id=setup.session_id, stream_id=setup.stream_id, mtu=setup.mtu,
                correlation_id=2, initial_term_count=setup.active_term_id - setup.initial_term_id,
                initial_term_offset=setup.term_offset)
            image = event.channel.new_image(event, log, ImagePositions.in_process(), self.now)
            if event.channel is self.receive:
                self.sub_position[0] = image.join_position
                self.subscriber = Image(image.log, self.sub_position,
                                        join_position=image.join_position)
                image.add_subscriber_position(self.sub_position)
            event.channel.add_image(image)
        elif isinstance(event, ImageUnavailable):
            self.unavailable = event.image

    # -- the publisher and subscriber apps ------------------------------------------------
    def offer(self, payload: bytes) -> int:
        for _ in range(10):
            result = lib.ss_offer(self.appender, payload, len(payload))
            if result != -3:  # ADMIN_ACTION: the term rotated, retry
                return result
        return result

    def poll(self) -> int:
        if self.subscriber is None:
            return 0
        return self.subscriber.poll(lambda data, header: self.received.append(bytes(data)), 100)

    # -- the network ----------------------------------------------------------------------
    def _emit(self, direction: str, datagrams: list[Datagram]) -> None:
        for dg in datagrams:
            frames = decode_datagram(dg.data)
            self.sent.append((self.now, direction, frames))
            if self.drop(direction, dg):
                continue
            self._seq += 1
            self.in_flight.append((self.now + self.delay_ns, self._seq, direction, dg))

    def step(self) -> None:
        """Deliver everything due, then let both agents work; repeat until quiet at now."""
        for _ in range(10_000):
            self.in_flight.sort()
            due = [f for f in self.in_flight if f[0] <= self.now]
            self.in_flight = [f for f in self.in_flight if f[0] > self.now]
            for _, _, direction, dg in due:
                link = self.receiver_link if direction == "p2r" else self.sender_link
                link.inbox.append(dg.data)
            if self.auto_poll:
                self.poll()
            work = self.sender.do_work(self.now) + self.receiver.do_work(self.now)
            if self.auto_poll:
                work += self.poll()
            if not due and not work and self.next_event() > self.now:
                return
        raise AssertionError("livelock")

    def next_event(self) -> int:
        candidates = [self.sender.next_deadline_ns(), self.receiver.next_deadline_ns()]
        candidates += [f[0] for f in self.in_flight]
        return min(candidates)

    def run_until(self, t_ns: int) -> None:
        """Advance the clock event by event (exact deadlines, no polling) up to ``t_ns``."""
        self.step()
        while True:
            nxt = max(self.next_event(), self.now)
            if nxt > t_ns or nxt == NO_DEADLINE:
                self.now = t_ns
                self.step()
                return
            self.now = nxt
            self.step()

    def frames(self, direction: str, kind: type) -> list[tuple[int, object]]:
        out = []
        for t, d, frames in self.sent:
            if d == direction and isinstance(frames, list):
                out.extend((t, f) for f in frames if type(f) is kind)
        return out

    @property
    def image(self):
        return next(iter(self.receive.images.values()))


@pytest.fixture
def pair(shm: Path) -> Pair:
    return Pair(shm)


def test_handshake_timing_matches_aeron(pair: Pair) -> None:
    # No SM yet: SETUP at t=0 and every 100 ms (capture: SETUP t=0, SM 92 ms later).
    pair.receive.remove_subscription(STREAM)
    pair.run_until(350 * MS)
    setups = [t for t, _ in pair.frames("p2r", Setup)]
    assert setups == [0, 100 * MS, 200 * MS, 300 * MS]
    assert not pair.frames("p2r", Heartbeat)
    assert not pair.publication.is_connected
    # The receiver subscribes: the next SETUP creates the image, which SMs at once.
    pair.receive.add_subscription(STREAM)
    pair.run_until(1000 * MS)
    sms = [t for t, _ in pair.frames("r2p", StatusMessage)]
    assert sms[0] == 400 * MS  # first SM at once
    assert [b - a for a, b in itertools.pairwise(sms)] == [200 * MS] * (len(sms) - 1)
    # Heartbeat right after the first SM, then every 100 ms while idle; SETUP stops.
    hbs = [t for t, _ in pair.frames("p2r", Heartbeat)]
    assert hbs[0] == 400 * MS
    assert [b - a for a, b in itertools.pairwise(hbs)] == [100 * MS] * (len(hbs) - 1)
    assert [t for t, _ in pair.frames("p2r", Setup)][-1] == 400 * MS
    assert pair.publication.is_connected and pair.publication.has_initial_connection
    assert pair.pub_limit[0] == 32 * 1024  # snd_pos 0 + term_length/2
    sm = pair.frames("r2p", StatusMessage)[0][1]
    assert (sm.receiver_window, sm.consumption_term_id, sm.consumption_term_offset) == (
        32 * 1024, 1000, 0)


def connect(pair: Pair) -> None:
    pair.run_until(1 * MS)
    assert pair.publication.is_connected


def test_messages_flow_and_are_read(pair: Pair) -> None:
    connect(pair)
    payloads = [bytes([i]) * (100 + i) for i in range(50)]
    for p in payloads:
        assert pair.offer(p) > 0
    pair.run_until(2 * MS)
    assert pair.received == payloads
    # Batched up to an MTU per datagram.
    datas = [f for t, d, f in pair.sent if d == "p2r" and isinstance(f, list)
             and isinstance(f[0], Data)]
    assert len(datas) < 50 and any(len(f) > 1 for f in datas)


def test_dropped_frame_nak_after_100us_and_retransmit_at_once(pair: Pair) -> None:
    connect(pair)
    dropped = []

    def drop(direction: str, dg: Datagram) -> bool:
        frame = decode(dg.data)
        if direction == "p2r" and isinstance(frame, Data) and frame.term_offset == 0 \
                and not dropped:
            dropped.append(pair.now)
            return True
        return False

    pair.drop = drop
    pair.delay_ns = 10 * US
    assert pair.offer(b"a" * 1300) > 0  # one frame per datagram
    pair.run_until(2 * MS)
    assert pair.offer(b"b" * 1300) > 0
    pair.run_until(4 * MS)
    naks = pair.frames("r2p", Nak)
    assert len(naks) == 1
    t_nak, nak = naks[0]
    gap_seen = 2 * MS + 10 * US  # the second frame arrives and exposes the gap
    assert t_nak == gap_seen + 100 * US
    assert (nak.term_offset, nak.length) == (0, 1344)
    retransmits = [t for t, f in pair.frames("p2r", Data) if f.term_offset == 0]
    assert retransmits == [dropped[0], t_nak + 10 * US]
    assert pair.received == [b"a" * 1300, b"b" * 1300]
    assert pair.pub_counters[SystemCounter.RETRANSMITS_SENT] == 1
    assert pair.rcv_counters[SystemCounter.NAK_MESSAGES_SENT] == 1


def test_duplicate_naks_within_linger_are_ignored(pair: Pair) -> None:
    connect(pair)
    pair.offer(b"x" * 500)
    pair.run_until(2 * MS)
    nak = Nak(SESSION, STREAM, 1000, 0, 544).encode()
    before = len(pair.frames("p2r", Data))
    for i in range(5):
        pair.send_channel.on_datagram(nak, RECEIVER, pair.now + i * 40 * US)
    out = data_datagrams(pair.publication, pair.now + 190 * US)  # the data path sends them
    assert len([d for d in out if isinstance(decode(d.data), Data)]) == 1
    assert before == 1
    # After the linger (200 µs) the same NAK is served again.
    pair.send_channel.on_datagram(nak, RECEIVER, pair.now + 210 * US)
    out = data_datagrams(pair.publication, pair.now + 210 * US)
    assert len([d for d in out if isinstance(decode(d.data), Data)]) == 1


def test_large_gap_recovered_with_a_single_nak(pair: Pair) -> None:
    connect(pair)
    lost = set(range(5, 25))
    counter = {"n": 0}

    def drop(direction: str, dg: Datagram) -> bool:
        frame = decode(dg.data)
        if direction == "p2r" and isinstance(frame, Data):
            counter["n"] += 1
            return counter["n"] - 1 in lost
        return False

    pair.drop = drop
    payloads = [bytes([i]) * 1000 for i in range(30)]  # 1056 B frames: 1 per datagram
    for p in payloads:
        pair.offer(p)
    pair.run_until(5 * MS)
    naks = pair.frames("r2p", Nak)
    assert len(naks) == 1
    assert naks[0][1].length == 20 * 1056
    assert pair.received == payloads


def test_tail_gap_found_via_heartbeat(pair: Pair) -> None:
    connect(pair)

    def drop(direction: str, dg: Datagram) -> bool:
        frame = decode(dg.data)
        return direction == "p2r" and isinstance(frame, Data) and frame.term_offset == 1056

    pair.drop = drop
    pair.offer(b"1" * 1000)
    pair.offer(b"2" * 1000)
    pair.run_until(50 * MS)
    assert pair.received == [b"1" * 1000]
    assert not pair.frames("r2p", Nak)
    pair.drop = lambda direction, dg: False
    pair.run_until(200 * MS)
    hb_times = [t for t, f in pair.frames("p2r", Heartbeat) if f.term_offset == 2112]
    naks = pair.frames("r2p", Nak)
    assert naks[0][0] == hb_times[0] + 100 * US
    assert pair.received == [b"1" * 1000, b"2" * 1000]


def test_many_term_rotations_with_loss(pair: Pair) -> None:
    connect(pair)
    rng = random.Random(3)
    pair.drop = lambda direction, dg: rng.random() < 0.05
    pair.delay_ns = 50 * US
    payloads = [i.to_bytes(4, "little") * 100 for i in range(2000)]  # 400 B, ~850 KB
    sent = 0
    t = pair.now
    while len(pair.received) < len(payloads) and t < 20_000 * MS:
        while sent < len(payloads) and pair.offer(payloads[sent]) > 0:
            sent += 1
        t += 1 * MS
        pair.run_until(t)
    assert pair.received == payloads
    assert pair.publication.sender_position > 10 * 64 * 1024  # > 10 term rotations
    assert pair.rcv_counters[SystemCounter.NAK_MESSAGES_SENT] > 0


def test_flow_control_sender_stops_at_window_and_25_percent_rule(pair: Pair) -> None:
    connect(pair)
    pair.auto_poll = False
    pair.poll()  # attach the subscriber, then stop consuming
    window = 32 * 1024
    n = 0
    while pair.offer(b"z" * 992) > 0:  # 1024 B frames
        n += 1
    assert n == 32  # pub-lmt = term/2 = 32 KiB
    pair.run_until(10 * MS)
    assert pair.publication.sender_position == window  # sm position 0 + window
    assert pair.publication.sender_limit == window
    sms_before = len(pair.frames("r2p", StatusMessage))
    # Consume 8 KiB: exactly 25 %, not more: no new SM.
    pair.subscriber.poll(lambda d, h: None, 8)
    pair.run_until(11 * MS)
    assert len(pair.frames("r2p", StatusMessage)) == sms_before
    pair.subscriber.poll(lambda d, h: None, 1)  # 9 KiB > 25 %: SM at once
    pair.run_until(12 * MS)
    sms = pair.frames("r2p", StatusMessage)
    assert len(sms) == sms_before + 1
    assert sms[-1][1].consumption_term_offset == 9 * 1024
    assert pair.publication.sender_limit == 9 * 1024 + window


class HalveOnLoss(CongestionControl):
    """A congestion control the way CUBIC will use the interface: it measures the round trip
    once, and halves its window (forcing an SM) on the first pass that finds loss."""

    name = "cubic"  # the URI grammar's other name; registered only for this test

    def __init__(self, window: int) -> None:
        self.window, self.initial, self.rtts, self.measured_at = window, window, [], None

    @classmethod
    def from_params(cls, params, term_length, sender_mtu, now_ns=0):
        return cls(min(params.receiver_window_length, term_length // 2))

    def initial_window_length(self) -> int:
        return self.window

    def max_window_length(self) -> int:
        return self.window

    def on_track_rebuild(self, now_ns, *, consumption_position, last_sm_position, hwm_position,
                         rebuild_start_position, rebuild_end_position, loss_found):
        halve = loss_found and self.window == self.initial
        if halve:
            self.window //= 2
        return halve, self.window

    def should_measure_rtt(self, now_ns: int) -> bool:
        return self.measured_at is None

    def on_rtt_measurement_sent(self, now_ns: int) -> None:
        self.measured_at = now_ns

    def on_rtt_measurement(self, now_ns, rtt_ns, source) -> None:
        self.rtts.append((rtt_ns, source))


def congestion_controlled(shm: Path, monkeypatch: pytest.MonkeyPatch,
                          strategy: type[HalveOnLoss]) -> tuple[Pair, HalveOnLoss]:
    """A pair (50 µs each way), connected, whose image runs ``strategy`` as ``cc=cubic`` with
    a 16 KiB receiver window: (the pair, the image's strategy)."""
    monkeypatch.setitem(CONGESTION_CONTROLS, "cubic", strategy)
    pair = Pair(shm, receiver_uri=URI + "|cc=cubic|rcv-wnd=16k")
    pair.delay_ns = 50 * US
    connect(pair)
    return pair, pair.image.congestion_control


def drop_the_first_data_frame(direction: str, dg: Datagram) -> bool:
    """A Pair's drop rule: the DATA frames at term offset 0 the publisher sends."""
    frame = decode(dg.data)
    return direction == "p2r" and isinstance(frame, Data) and frame.term_offset == 0


def test_a_congestion_control_strategy_measures_the_round_trip_and_sets_the_window(
        shm: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pair, cc = congestion_controlled(shm, monkeypatch, HalveOnLoss)
    assert isinstance(cc, HalveOnLoss)
    # The receiver asked (a REPLY-flagged RTTM), the sender echoed, the strategy heard.
    [(_, ask)] = pair.frames("r2p", Rttm)
    assert ask.is_reply and ask.receiver_id == 4242
    assert cc.rtts == [(100 * US, SENDER)]
    assert pair.frames("r2p", StatusMessage)[-1][1].receiver_window == 16 * 1024
    # A gap halves the window, and an SM says so at once.
    pair.drop = drop_the_first_data_frame
    pair.offer(b"a" * 1300)
    pair.offer(b"b" * 1300)
    pair.run_until(pair.now + 1 * MS)
    assert cc.window == 8 * 1024
    assert pair.frames("r2p", StatusMessage)[-1][1].receiver_window == 8 * 1024


class ForceOnLoss(HalveOnLoss):
    """Keeps its window, but wants an SM at once on loss and one round trip 7 ms after the
    image is made (a deadline of its own, not a poll)."""

    def __init__(self, window: int) -> None:
        super().__init__(window)
        self.due_ns: int | None = None

    def on_track_rebuild(self, now_ns, *, consumption_position, last_sm_position, hwm_position,
                         rebuild_start_position, rebuild_end_position, loss_found):
        if self.due_ns is None:
            self.due_ns = now_ns + 7 * MS
        return loss_found, self.window

    def should_measure_rtt(self, now_ns: int) -> bool:
        return self.measured_at is None and self.due_ns is not None and now_ns >= self.due_ns

    def next_deadline_ns(self) -> int:
        return self.due_ns if self.measured_at is None and self.due_ns else NO_DEADLINE


def test_a_congestion_control_strategy_forces_status_messages_and_sets_its_own_deadline(
        shm: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pair, cc = congestion_controlled(shm, monkeypatch, ForceOnLoss)
    pair.run_until(20 * MS)
    [(asked_at, _)] = pair.frames("r2p", Rttm)
    assert asked_at == cc.due_ns  # woken for it, not found on some later pass
    sms_before = len(pair.frames("r2p", StatusMessage))
    pair.drop = drop_the_first_data_frame
    pair.offer(b"a" * 1300)
    pair.run_until(pair.now + 1 * MS)
    assert len(pair.frames("r2p", StatusMessage)) == sms_before  # nothing seen, nothing said
    pair.offer(b"b" * 1300)  # exposes the gap: far below the 25 % rule and the SM timer
    pair.run_until(pair.now + 1 * MS)
    forced = [t for t, _ in pair.frames("r2p", StatusMessage)[sms_before:]]
    [(nak_at, _)] = pair.frames("r2p", Nak)
    # An SM on each pass that found the gap (as it appeared, and as its NAK went), with no
    # subscriber progress and long before the SM timer (the last SM was ~20 ms ago).
    assert forced and forced[0] < nak_at and forced[-1] <= nak_at < 30 * MS


def test_unreliable_stream_fills_gap_with_padding(shm: Path) -> None:
    pair = Pair(shm, receiver_uri=URI + "|reliable=false")
    connect(pair)

    def drop(direction: str, dg: Datagram) -> bool:
        frame = decode(dg.data)
        return direction == "p2r" and isinstance(frame, Data) and frame.term_offset == 1056

    pair.drop = drop
    for i in range(3):
        pair.offer(bytes([i]) * 1000)
    pair.run_until(5 * MS)
    assert not pair.frames("r2p", Nak)
    assert pair.rcv_counters[SystemCounter.LOSS_GAP_FILLS] == 1
    assert pair.received == [bytes([0]) * 1000, bytes([2]) * 1000]


def test_eos_on_close_and_linger(pair: Pair) -> None:
    connect(pair)
    pair.offer(b"last")
    pair.sender.enqueue(ClosePublication(pair.publication))  # as the conductor closes it
    pair.run_until(300 * MS)
    assert pair.received == [b"last"]
    eos = [t for t, f in pair.frames("p2r", Heartbeat) if f.is_eos]
    assert eos and all(b - a == 100 * MS for a, b in itertools.pairwise(eos))
    image = pair.image
    assert image.is_end_of_stream
    assert pair.subscriber.is_end_of_stream
    # The image drains: SMs with EOS; the unicast sender stops lingering on it.
    pair.run_until(2000 * MS)
    assert any(f.is_eos for _, f in pair.frames("r2p", StatusMessage))
    assert pair.publication.state is PublicationState.DONE
    assert isinstance(getattr(pair, "unavailable", None), type(image))


def test_linger_timeout_without_eos_sm(pair: Pair) -> None:
    connect(pair)
    pair.drop = lambda direction, dg: direction == "r2p"  # the receiver can't answer now
    pair.sender.enqueue(ClosePublication(pair.publication))
    pair.run_until(100 * MS)
    assert pair.publication.state is PublicationState.LINGER
    pair.run_until(5200 * MS)
    assert pair.publication.state is PublicationState.DONE
    assert pair.publication.next_deadline_ns() == NO_DEADLINE


def test_publication_not_connected_after_connection_timeout(pair: Pair) -> None:
    connect(pair)
    pair.offer(b"x" * 100)
    pair.run_until(10 * MS)
    assert pair.log.is_connected
    pair.drop = lambda direction, dg: direction == "r2p"
    pair.run_until(5100 * MS)
    assert not pair.publication.is_connected
    assert not pair.log.is_connected
    assert pair.pub_limit[0] == pair.publication.sender_position
    assert pair.offer(b"y") == -2 or pair.offer(b"y") == -1


def test_image_drains_after_liveness_timeout(pair: Pair) -> None:
    connect(pair)
    pair.drop = lambda direction, dg: direction == "p2r"
    pair.run_until(9000 * MS)
    assert pair.image.state is ImageState.ACTIVE
    pair.run_until(10_200 * MS)
    assert pair.image.state is ImageState.DRAINING
    last_sm = pair.frames("r2p", StatusMessage)[-1][1]
    assert last_sm.is_eos


def test_elicited_setup_for_late_receiver(pair: Pair) -> None:
    connect(pair)
    # A second receiver that knows nothing of the stream sees a heartbeat.
    receive2 = ReceiveChannel(channel=parse_channel(URI), settings=pair.settings,
                              receiver_id=99, counters=LocalCounters(), now_ns=pair.now,
                              rng=random.Random(1))
    receive2.add_subscription(STREAM)
    hb = Heartbeat(0, SESSION, STREAM, 1000).encode()
    receive2.on_datagram(hb, SENDER, pair.now)
    out = receive2.datagrams_to_send(pair.now)
    sm = decode(out[0].data)
    assert isinstance(sm, StatusMessage) and sm.is_setup_request and out[0].address == SENDER
    receive2.on_datagram(hb, SENDER, pair.now + 1)
    assert receive2.datagrams_to_send(pair.now + 1) == []  # pending setup: 1 s
    pair.send_channel.on_datagram(out[0].data, RECEIVER, pair.now)
    assert pair.publication.setups.elicited
    setups = [d for d in pair.publication.datagrams_to_send(pair.now + 100 * MS)
              if isinstance(decode(d.data), Setup)]
    assert setups


def test_pad_at_term_end_is_sent_as_header(pair: Pair) -> None:
    connect(pair)
    n = 0
    while n < 70:
        assert pair.offer(b"q" * 1000) > 0
        n += 1
        pair.run_until(pair.now + 1 * MS)
    pads = pair.frames("p2r", Pad)
    assert pads and all(isinstance(p, Pad) for _, p in pads)
    assert len(pair.received) == 70


@settings(max_examples=300, deadline=None)
@given(st.binary(min_size=0, max_size=120))
def test_random_bytes_never_raise(shm_static: Path, data: bytes) -> None:
    receive, send = shm_static
    receive.on_datagram(data, SENDER, 0)
    receive.datagrams_to_send(0)
    send.on_datagram(data, RECEIVER, 0)


def test_positions_a_client_overwrites_in_the_counters_file_do_not_move_the_driver(
        pair: Pair) -> None:
    """Every client maps the counters file writable: the driver works from its own copies of
    snd-pos, snd-lmt, rcv-hwm and rcv-pos and writes the counters again as they move.  A
    snd-pos of minus a term read back would send the memory before the log."""
    connect(pair)
    first = [bytes([i]) * 500 for i in range(20)]
    for message in first:
        assert pair.offer(message) > 0
    pair.run_until(2 * MS)
    assert pair.received == first
    publication, image = pair.publication.c, pair.image.c
    term_length = pair.log.term_length
    publication.sender_position_counter[0] = -term_length
    publication.sender_limit_counter[0] = 1 << 62
    image.receiver_hwm_counter[0] = 1 << 62
    image.receiver_position_counter[0] = -term_length
    sent_before = len(pair.sent)
    second = [bytes([100 + i]) * 500 for i in range(20)]
    for message in second:
        assert pair.offer(message) > 0
    pair.run_until(4 * MS)
    assert pair.received == first + second
    data = [frame for _, direction, frames in pair.sent[sent_before:]
            if direction == "p2r" and isinstance(frames, list)
            for frame in frames if isinstance(frame, Data)]
    assert len(data) == len(second)
    assert all(frame.term_id == 1000 and 0 < frame.term_offset < term_length // 2
               for frame in data)
    assert publication.sender_position_counter[0] == pair.publication.sender_position > 0
    assert publication.sender_limit_counter[0] == pair.publication.sender_limit
    assert image.receiver_hwm_counter[0] == pair.image.rcv_hwm
    assert image.receiver_position_counter[0] == pair.image.rcv_pos == pair.image.rcv_hwm


def test_one_datagram_far_past_the_window_does_not_leave_the_image_behind(shm: Path) -> None:
    """An over-run tells a receiver left behind where the sender is, but one stray or forged
    datagram (here 2^31 - 1 and 2^30 terms ahead) is no sender: only an over-run within a term
    of the one before counts, as a sender's next datagrams land."""

    def far_ahead(terms: int) -> bytes:
        term_id = (1000 + terms + 2**31) % 2**32 - 2**31
        return DATA_HEADER.pack(64, CURRENT_VERSION, 0xC0, HDR_TYPE_DATA, 0, SESSION, STREAM,
                                term_id, 0) + bytes(32)

    pair = Pair(shm, receiver_uri=URI + "|cc=cubic")  # Python looks at every arrival
    connect(pair)
    pair.receiver_link.inbox.append(far_ahead(INT32_MAX))
    messages = [bytes([i]) * 500 for i in range(40)]
    for message in messages[:20]:
        assert pair.offer(message) > 0
    pair.run_until(300 * MS)
    pair.receiver_link.inbox.append(far_ahead(2**30))  # far from the one before, too
    for message in messages[20:]:
        assert pair.offer(message) > 0
    pair.run_until(600 * MS)
    assert pair.rcv_counters[SystemCounter.FLOW_CONTROL_OVER_RUNS] == 2
    assert pair.rcv_counters[SystemCounter.IMAGES_LEFT_BEHIND] == 0
    assert pair.image.left_behind is None and pair.image.state is ImageState.ACTIVE
    assert pair.received == messages


def test_a_subscriber_position_off_the_frame_alignment_is_rounded_down_to_it(
        pair: Pair) -> None:
    """A client writes its subscriber position: one off the frame alignment would be a
    status message's consumption offset, and a scan's and a clean's start (misaligned
    atomic loads and stores)."""
    bounded = network_lib.ss_subscriber_position_bounded
    assert [bounded(p, 4096) for p in (-5, 0, 1001, 4096, 5000, INT64_MAX)] == [
        0, 0, 992, 4096, 4096, 4096]
    connect(pair)
    pair.auto_poll = False
    for i in range(5):
        assert pair.offer(bytes([i]) * 500) > 0
    pair.run_until(2 * MS)
    pair.sub_position[0] = 1001
    sms_before = len(pair.frames("r2p", StatusMessage))
    pair.run_until(500 * MS)
    sms = [sm for _, sm in pair.frames("r2p", StatusMessage)[sms_before:]]
    assert sms and {sm.consumption_term_offset for sm in sms} == {992}


@settings(max_examples=200, deadline=None)
@given(st.integers(0, INT32_MAX), st.integers(INT32_MIN, INT32_MAX), st.binary(max_size=64),
       st.sampled_from([HDR_TYPE_PAD, HDR_TYPE_DATA]), st.integers(0, 255))
def test_data_header_fuzz_into_live_image(shm_static: Path, offset: int, frame_length: int,
                                          body: bytes, kind: int, flags: int) -> None:
    receive, _send = shm_static
    header = DATA_HEADER.pack(frame_length, CURRENT_VERSION, flags, kind, offset, SESSION, STREAM,
                              1000, 0)
    receive.on_datagram(header + body, SENDER, 0)
    receive.datagrams_to_send(0)


@pytest.fixture(scope="module")
def shm_static() -> Iterator[tuple[ReceiveChannel, SendChannel]]:
    path = Path("/dev/shm") / f"slipstream-fuzz-{uuid.uuid4().hex[:12]}"
    path.mkdir()
    try:
        pair = Pair(path)
        pair.run_until(1 * MS)
        yield pair.receive, pair.send_channel
    finally:
        shutil.rmtree(path, ignore_errors=True)
