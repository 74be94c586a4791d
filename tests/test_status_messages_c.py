"""Status messages at a send endpoint's C dispatch (docs/DRIVER.md §3.3, §5.2): the C half
of a unicast publication (``on_status_message`` in daemon/network_receiver.c, on while
``NetworkPublication.sync_c_half`` sets ``sm_in_c``) against the rules the Python half runs
(``NetworkPublication._on_status_message`` and :class:`UnicastFlowControl`).

Each test drives the real C dispatch (:class:`SendChannel` over ``ss_receiver_on_datagram``)
with SM datagrams made by the project's frame codec, or bytes cut from them, and looks at
snd-lmt, at the state the C half keeps for the Python half (``sm_count``, ``sm_position``,
``sm_window``), at what it handed up to Python (:attr:`Sender.passed_up`) and at the counters.
"""

from __future__ import annotations

import shutil
import struct
import uuid
from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest
from helpers import network_publication
from hypothesis import given, settings
from hypothesis import strategies as st

from slipstream.client._native import lib
from slipstream.client.counters import SystemCounter
from slipstream.client.frames import StatusMessage
from slipstream.client.layout import INT32_MAX, INT32_MIN
from slipstream.client.logbuffer import new_appender
from slipstream.daemon._network import ffi as network_ffi
from slipstream.daemon._network import lib as network
from slipstream.daemon.flow.unicast import UnicastFlowControl
from slipstream.daemon.media.send_channel import SendChannel

TERM = 64 * 1024
HALF_TERM = TERM // 2
BITS = 16  # log2(TERM): a position's term count is position >> BITS
INITIAL_TERM_ID = 10
SESSION, STREAM = 5, 6
RECEIVER = 99  # the one live receiver's receiver_id
WINDOW = 16 * 1024  # the window of the SMs that set the publication up
US = 1_000
DEST = ("10.0.0.2", 40123)
URI = "aeron:udp?endpoint=10.0.0.2:40123"
SM_LENGTH = 36
COUNTED = (SystemCounter.INVALID_PACKETS, SystemCounter.STATUS_MESSAGES_RECEIVED,
           SystemCounter.BYTES_RECEIVED)


def sm(position: int, window: int, *, receiver_id: int = RECEIVER, session_id: int = SESSION,
       stream_id: int = STREAM, flags: int = 0, group_tag: int | None = None) -> StatusMessage:
    """An SM acknowledging ``position`` (term id and offset of the publication's terms)."""
    return StatusMessage(session_id, stream_id, INITIAL_TERM_ID + (position >> BITS),
                         position & (TERM - 1), window, receiver_id, flags, group_tag)


def with_frame_length(datagram: bytes, frame_length: int) -> bytes:
    return struct.pack("<i", frame_length) + datagram[4:]


class Sender:
    """A unicast publication (term 64 KiB, initial term id 10) that has sent at least
    ``sent`` bytes to its one receiver (:data:`RECEIVER`), on a send endpoint's C dispatch.
    The SMs that got it there went to its Python half; the last, at snd-pos with window
    :data:`WINDOW`, leaves snd-lmt at ``snd-pos + WINDOW``.  Then, as the sender agent does
    after a pass, :meth:`NetworkPublication.sync_c_half`: its C half takes the SMs, unless
    ``c_takes_sms`` is false (then every SM goes to its Python half, as before the C half
    took any)."""

    def __init__(self, directory: Path, *, sent: int = TERM + HALF_TERM,
                 c_takes_sms: bool = True) -> None:
        self.pub = pub = network_publication(
            directory, URI, DEST, term_length=TERM, initial_term_id=INITIAL_TERM_ID,
            session_id=SESSION, stream_id=STREAM)
        self.path, self.positions, self.counters = pub.log.path, pub.positions, pub.counters
        assert isinstance(pub.flow_control, UnicastFlowControl)
        self.channel = channel = SendChannel(counters=pub.counters)
        channel.add_publication(pub)
        #: The datagrams the C dispatch handed up to Python (which then ran them).
        self.passed_up: list[bytes] = []
        to_python = channel.on_control

        def on_control(data, source, now_ns: int) -> None:
            self.passed_up.append(bytes(data))
            to_python(data, source, now_ns)

        channel.on_control = on_control
        self.c_takes_sms = c_takes_sms
        self.appender = new_appender(pub.log, pub.positions.publisher_limit)
        self.spans = network_ffi.new("ss_span_t[]", 64 + network.SS_RETRANSMIT_MAX)
        self.now_ns = 0
        pub.on_frame(sm(0, WINDOW), DEST, self.now_ns)
        while self.pub.sender_position < sent:
            self.send()
            pub.on_frame(sm(pub.sender_position, WINDOW), DEST, self.tick())
        self.sync()
        assert pub.is_connected and pub.sender_limit == pub.sender_position + WINDOW
        assert bool(pub.c.sm_in_c) is c_takes_sms
        self.passed_up.clear()

    def tick(self) -> int:
        self.now_ns += US
        return self.now_ns

    def sync(self) -> None:
        """The end of a sender pass: the C half's share set again."""
        self.pub.sync_c_half()
        if not self.c_takes_sms:
            self.pub.c.sm_in_c = 0

    def send(self) -> None:
        """Offer 1 KiB messages until refused, then one data send of the C data path and the
        publication's pass after it, as the sender agent runs them."""
        while lib.ss_offer(self.appender, b"x" * 1024, 1024) > 0:
            pass
        now_ns = self.tick()
        if network.ss_send_data(self.pub.c, now_ns, 64, self.spans) > 0:
            self.pub.on_data_sent(now_ns)
        self.sync()

    def deliver(self, datagram: bytes | StatusMessage) -> None:
        """One datagram arriving at the send endpoint."""
        if isinstance(datagram, StatusMessage):
            datagram = datagram.encode()
        self.channel.on_datagram(datagram, DEST, self.tick())

    #: The publication's sender position and limit, by their counters' names (bytes).
    snd_pos = property(lambda self: self.pub.sender_position)
    snd_lmt = property(lambda self: self.pub.sender_limit)

    @property
    def c_took(self) -> int:
        """How many SMs the C half took (``sm_count``)."""
        return self.pub.c.sm_count

    def counted(self) -> tuple[int, ...]:
        return tuple(self.counters[counter] for counter in COUNTED)


@pytest.fixture
def sender(shm: Path) -> Sender:
    return Sender(shm)


def test_the_c_half_takes_a_plain_sm_of_its_receiver_raising_the_limit_to_position_plus_window(
        sender: Sender) -> None:
    """The baseline the other tests stand on: a plain SM of the one live receiver, at or
    below snd-pos with a window of 0..term/2, is taken in C (nothing handed up): snd-lmt
    becomes position + window when that is higher, the SM counts in STATUS_MESSAGES_RECEIVED
    and BYTES_RECEIVED, and its time, position and window are kept for the Python half, which
    records them at its next look (acknowledged position, liveness, resend cap)."""
    invalid, received, bytes_received = sender.counted()
    position = sender.snd_pos  # at snd-pos itself: the highest position an SM may have
    sender.deliver(sm(position, WINDOW + 4096))
    assert sender.passed_up == []
    assert sender.snd_lmt == position + WINDOW + 4096
    c = sender.pub.c
    assert (sender.c_took, c.sm_position, c.sm_window, c.sm_time_ns) == (
        1, position, WINDOW + 4096, sender.now_ns)
    assert sender.counted() == (invalid, received + 1, bytes_received + SM_LENGTH)
    sender.pub.take_c_status_messages()
    assert sender.pub._receivers.acknowledged() == {RECEIVER: position}
    assert sender.pub._receivers.last_status_message_ns() == {RECEIVER: sender.now_ns}
    assert sender.pub.flow_control.receiver_window == WINDOW + 4096
    assert sender.pub.c.resend_lookahead == (WINDOW + 4096) * 16


def test_an_sm_that_goes_backwards_never_lowers_the_sender_limit(sender: Sender) -> None:
    """snd-lmt = max(snd-lmt, position + window) (§5.2): an SM behind the last one, within
    its term or in the term before, with the same or a smaller window, is still taken (its
    position is what the receiver acknowledged, recorded as it is) but leaves snd-lmt where
    it was, a window over half a term too (clamped before the maximum)."""
    top = sender.snd_pos
    sender.deliver(sm(top, HALF_TERM))
    limit = top + HALF_TERM
    assert sender.snd_lmt == limit
    for position, window in ((top - 4096, HALF_TERM), (top - 64, 0),
                             (TERM - 32, HALF_TERM), (0, HALF_TERM), (top - 32, HALF_TERM - 1)):
        assert position >> BITS in (0, 1)  # this term and the one before
        sender.deliver(sm(position, window))
        assert sender.snd_lmt == limit, (position, window)
        assert sender.pub.c.sm_position == position  # taken: the receiver did say it
    assert sender.passed_up == [] and sender.c_took == 5 + 1
    assert sender.counters[SystemCounter.INVALID_PACKETS] == 0
    sender.pub.take_c_status_messages()
    assert sender.pub._receivers.acknowledged()[RECEIVER] == top - 32

    sender.deliver(sm(top - 32, HALF_TERM + 64))  # clamped to half a term: top - 32 + 32K
    assert sender.snd_lmt == limit
    sender.deliver(sm(sender.snd_pos, HALF_TERM))
    assert sender.snd_lmt == limit


def test_a_backwards_sm_whose_window_reaches_further_still_raises_the_limit(
        sender: Sender) -> None:
    """The maximum is of position + window, not of the position: a receiver that reports an
    older position with a window reaching past the limit raises it."""
    top = sender.snd_pos
    limit = sender.snd_lmt  # top + WINDOW
    sender.deliver(sm(top - 4096, WINDOW + 8192))
    assert sender.passed_up == []
    assert sender.snd_lmt == limit + 4096 == top - 4096 + WINDOW + 8192


@pytest.mark.parametrize("beyond", [1, 32, 4096, TERM, 3 * TERM])
def test_an_sm_past_the_sender_position_is_handed_to_python_which_counts_and_drops_it(
        sender: Sender, beyond: int) -> None:
    """No honest receiver acknowledges what was never sent (§3.3): an SM whose position is
    beyond snd-pos (in this term, the next or a later one) is not taken in C but handed up,
    and the Python half counts it in SM_AHEAD_OF_SENDER_DROPS and drops it; snd-lmt, the
    acknowledged position and the state kept for the Python half stay as they were."""
    limit, taken, acknowledged = sender.snd_lmt, sender.c_took, sender.pub._receivers.acknowledged()
    ahead = sender.counters[SystemCounter.SM_AHEAD_OF_SENDER_DROPS]
    frame = sm(sender.snd_pos + beyond, WINDOW)
    sender.deliver(frame)
    assert sender.passed_up == [frame.encode()]
    assert sender.c_took == taken and sender.snd_lmt == limit
    assert sender.counters[SystemCounter.SM_AHEAD_OF_SENDER_DROPS] == ahead + 1
    assert sender.pub._receivers.acknowledged() == acknowledged
    assert sender.pub.c.sm_in_c  # nothing of it changed who takes the next one


@pytest.mark.parametrize("window", [HALF_TERM + 1, HALF_TERM + 32, TERM, INT32_MAX])
def test_a_receiver_window_over_half_a_term_is_clamped_to_half_a_term(
        sender: Sender, window: int) -> None:
    """A window above term_length / 2 is reduced to term_length / 2 (§3.3; no receiver may
    advertise more, §4.5): snd-lmt = position + term/2, and term/2 is the window kept for the
    Python half (the resend cap, §3.5).  The Python half, given the same SM, does the same."""
    position = sender.snd_pos - 1024
    sender.deliver(sm(position, window))
    assert sender.passed_up == []
    assert sender.snd_lmt == position + HALF_TERM
    assert sender.pub.c.sm_window == HALF_TERM
    sender.pub.take_c_status_messages()
    assert sender.pub.flow_control.receiver_window == HALF_TERM
    assert sender.pub.c.resend_lookahead == HALF_TERM * 16

    python = Sender(sender.path.parent, c_takes_sms=False)
    python.deliver(sm(position, window))
    assert python.passed_up != [] and python.snd_lmt == position + HALF_TERM
    assert python.pub.flow_control.receiver_window == HALF_TERM


def test_a_window_of_exactly_half_a_term_is_not_clamped(sender: Sender) -> None:
    """The clamp's boundary: term/2 itself is a legal window and stands."""
    sender.deliver(sm(sender.snd_pos, HALF_TERM))
    assert sender.snd_lmt == sender.snd_pos + HALF_TERM and sender.pub.c.sm_window == HALF_TERM


@pytest.mark.parametrize("window", [-1, -4096, INT32_MIN])
def test_a_negative_window_is_handed_to_python_which_counts_and_drops_it(
        sender: Sender, window: int) -> None:
    """A negative window is invalid (§3.3): handed up, counted in INVALID_PACKETS, dropped,
    even though position + window is below snd-lmt and could not have lowered it."""
    limit, taken = sender.snd_lmt, sender.c_took
    invalid = sender.counters[SystemCounter.INVALID_PACKETS]
    frame = sm(sender.snd_pos, window)
    sender.deliver(frame)
    assert sender.passed_up == [frame.encode()]
    assert sender.c_took == taken and sender.snd_lmt == limit
    assert sender.counters[SystemCounter.INVALID_PACKETS] == invalid + 1


@pytest.mark.parametrize("other", ["session", "stream", "both"])
def test_an_sm_for_another_session_or_stream_is_handed_up_and_ignored(
        sender: Sender, other: str) -> None:
    """The C dispatch finds no publication of that (session, stream): it hands the SM up;
    the Python dispatch finds none either and ignores it (counted in BYTES_RECEIVED only, not
    as invalid, as Aeron's endpoint ignores it).  This publication's snd-lmt and state do not
    move, though the SM's position and window would raise snd-lmt were it this one's.  Many
    other ids, so that some land on this publication's slot of the endpoint's table (16
    slots) and the lookup must compare both ids there."""
    limit, taken = sender.snd_lmt, sender.c_took
    invalid, received, bytes_received = sender.counted()
    frames = []
    for k in range(1, 65):
        session_id = SESSION + k if other in ("session", "both") else SESSION
        stream_id = STREAM + k if other in ("stream", "both") else STREAM
        frames.append(sm(sender.snd_pos, HALF_TERM, session_id=session_id,
                         stream_id=stream_id).encode())
    for frame in frames:
        sender.deliver(frame)
    assert sender.passed_up == frames
    assert sender.snd_lmt == limit and sender.c_took == taken
    assert sender.counted() == (invalid, received, bytes_received + len(frames) * SM_LENGTH)
    assert sender.pub._receivers.acknowledged() == {RECEIVER: sender.snd_pos}


def test_an_sm_of_another_receiver_goes_to_python_and_takes_the_sms_from_the_c_half(
        sender: Sender) -> None:
    """The C half takes only its one live receiver's SMs (``sm_receiver_id``); another
    receiver's SM for the same session and stream goes to Python, which records that receiver
    and runs flow control on it; with two receivers the next sync leaves every SM to Python
    (§3.3: one live receiver)."""
    limit, taken = sender.snd_lmt, sender.c_took
    frame = sm(sender.snd_pos - 64, HALF_TERM, receiver_id=RECEIVER + 1)
    sender.deliver(frame)
    assert sender.passed_up == [frame.encode()] and sender.c_took == taken
    assert sender.snd_lmt == max(limit, sender.snd_pos - 64 + HALF_TERM)
    assert set(sender.pub._receivers.last_status_message_ns()) == {RECEIVER, RECEIVER + 1}
    sender.sync()
    assert not sender.pub.c.sm_in_c
    mine = sm(sender.snd_pos, HALF_TERM)
    sender.deliver(mine)
    assert sender.passed_up[-1] == mine.encode() and sender.c_took == taken


@pytest.mark.parametrize("frame", [
    sm(1024, WINDOW, flags=0x40),  # EOS: the receiver leaves
    sm(1024, WINDOW, flags=0x80),  # S: the receiver wants a SETUP
    sm(1024, WINDOW, group_tag=7),  # 44 bytes: a group tag
], ids=["eos", "setup-request", "group-tag"])
def test_a_flagged_or_tagged_sm_goes_to_python(sender: Sender, frame: StatusMessage) -> None:
    """The C half takes plain SMs only (no flags, no group tag, §3.3); the others need the
    Python half's rules (EOS ends a receiver, S elicits SETUP)."""
    taken = sender.c_took
    sender.deliver(frame)
    assert sender.passed_up == [frame.encode()] and sender.c_took == taken


_PLAIN = sm(4096, HALF_TERM).encode()  # position 4096 < snd-pos: a valid SM


@pytest.mark.parametrize("datagram", [
    _PLAIN[:SM_LENGTH - 1],  # truncated by one byte
    _PLAIN[:20],  # truncated inside the body
    with_frame_length(_PLAIN, SM_LENGTH - 4),  # frame_length under an SM's 36 bytes
    with_frame_length(_PLAIN, 0),
    with_frame_length(_PLAIN, -1),
    with_frame_length(_PLAIN, SM_LENGTH + 8),  # says 44 bytes, has 36
    with_frame_length(_PLAIN + b"\0" * 4, SM_LENGTH + 4),  # 40: neither 36 nor 44
], ids=["35-bytes", "20-bytes", "frame-length-32", "frame-length-0", "frame-length-negative",
        "frame-length-past-datagram", "frame-length-40"])
def test_a_truncated_or_malformed_sm_is_handed_to_python_which_counts_and_drops_it(
        sender: Sender, datagram: bytes) -> None:
    """An SM the C half cannot read as a 36-byte frame (too short, or a frame_length other
    than 36) is not taken in C; the Python decoder rejects it (§1.5: an SM is 36 or 44 bytes
    and fits its datagram; §1.10: a control frame's frame_length at least its fixed size, at
    most the datagram) and counts it in INVALID_PACKETS.  Nothing of it reaches snd-lmt,
    even though its fields, read as an SM, would raise it."""
    limit, taken = sender.snd_lmt, sender.c_took
    invalid, received, bytes_received = sender.counted()
    sender.deliver(datagram)
    assert sender.passed_up == [datagram]
    assert sender.snd_lmt == limit and sender.c_took == taken
    assert sender.counted() == (invalid + 1, received, bytes_received)


def test_a_datagram_too_short_for_a_frame_header_is_counted_and_dropped_in_c(
        sender: Sender) -> None:
    """Under 8 bytes (no frame header) the C dispatch counts INVALID_PACKETS and drops the
    datagram itself (§1.10): nothing goes to Python."""
    limit = sender.snd_lmt
    sender.deliver(_PLAIN[:7])
    assert sender.passed_up == [] and sender.snd_lmt == limit
    assert sender.counters[SystemCounter.INVALID_PACKETS] == 1


def test_bytes_after_the_sm_fields_are_ignored(sender: Sender) -> None:
    """§1.10: bytes after a control frame's fixed fields are ignored: a 36-byte SM in a longer
    datagram is an SM, taken in C."""
    sender.deliver(_PLAIN + b"\xff" * 12)
    assert sender.passed_up == [] and sender.c_took == 1
    assert sender.snd_lmt == max(sender.snd_pos + WINDOW, 4096 + HALF_TERM)


@pytest.mark.parametrize(("term_id", "term_offset"), [
    (INITIAL_TERM_ID - 1, 0),  # a term before the initial one
    (INITIAL_TERM_ID + 1, -32),  # a negative offset
    (INITIAL_TERM_ID, TERM + 32),  # an offset past the term's end
], ids=["term-before-initial", "negative-offset", "offset-past-term"])
def test_an_sm_whose_term_fields_no_term_holds_is_counted_invalid_and_dropped(
        sender: Sender, term_id: int, term_offset: int) -> None:
    """The C half takes only a consumption term id at or after the initial one and an offset
    within the term (0..term_length); anything else it hands up, and the Python half counts it
    in INVALID_PACKETS and drops it (§3.3): no receiver reports a position outside the stream,
    and one taken would be a receiver a drain waits on."""
    limit, acknowledged = sender.snd_lmt, sender.pub._receivers.acknowledged()
    invalid = sender.counters[SystemCounter.INVALID_PACKETS]
    frame = StatusMessage(SESSION, STREAM, term_id, term_offset, WINDOW, RECEIVER)
    sender.deliver(frame)
    assert sender.passed_up == [frame.encode()] and sender.c_took == 0
    assert sender.counters[SystemCounter.INVALID_PACKETS] == invalid + 1
    assert sender.pub._receivers.acknowledged() == acknowledged and sender.snd_lmt == limit


# -- the C half against the Python half ------------------------------------------------------

@pytest.fixture(scope="module")
def shm_module() -> Iterator[Path]:
    path = Path("/dev/shm") / f"slipstream-test-{uuid.uuid4().hex[:12]}"
    path.mkdir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


_positions = st.one_of(
    st.integers(-(TERM + HALF_TERM), 4096),  # relative to snd-pos: mostly behind, some past
    st.sampled_from([0, 1, 32, -1, -32, TERM, -TERM]))
_windows = st.one_of(
    st.integers(-64, TERM + 64),
    st.sampled_from([0, HALF_TERM - 1, HALF_TERM, HALF_TERM + 1, INT32_MAX, INT32_MIN, -1]))
_steps = st.lists(st.one_of(st.tuples(_positions, _windows), st.just("send")),
                  min_size=1, max_size=30)


@settings(max_examples=200, deadline=None, database=None)
@given(steps=_steps)
def test_the_c_half_and_the_python_half_agree_on_any_sequence_of_sms(
        shm_module: Path, steps: list) -> None:
    """Over any sequence of SMs of the one receiver (positions behind, at and past snd-pos,
    windows negative, legal and over half a term) and data sends between them, the C half
    (with what it hands up) leaves the publication exactly as the Python half alone does:
    snd-lmt, the counters, the acknowledged position, the receiver's liveness and the window
    (resend cap) alike; and snd-lmt follows :class:`UnicastFlowControl` fed the SMs §3.3
    accepts (position <= snd-pos, window >= 0, clamped to term/2)."""
    c_half = Sender(shm_module)
    python = Sender(shm_module, c_takes_sms=False)
    model = UnicastFlowControl()
    model_limit = c_half.snd_lmt
    try:
        for step in steps:
            if step == "send":
                c_half.send()
                python.send()
            else:
                relative, window = step
                position = max(c_half.snd_pos + relative, 0)
                frame = sm(position, window)
                if position <= c_half.snd_pos and window >= 0:
                    frame_seen = attrs.evolve(frame, receiver_window=min(window, HALF_TERM))
                    model_limit = model.on_status_message(frame_seen, DEST, model_limit,
                                                          INITIAL_TERM_ID, BITS, c_half.now_ns)
                c_half.deliver(frame)
                python.deliver(frame)
            c_half.pub.take_c_status_messages()
            assert c_half.snd_pos == python.snd_pos
            assert c_half.snd_lmt == python.snd_lmt == model_limit, step
            assert c_half.counted() == python.counted(), step
            a, b = c_half.pub, python.pub
            assert a._receivers.acknowledged() == b._receivers.acknowledged(), step
            assert (a._receivers.last_status_message_ns()
                    == b._receivers.last_status_message_ns()), step
            assert a._status_message_deadline_ns == b._status_message_deadline_ns, step
            assert a.flow_control.receiver_window == b.flow_control.receiver_window, step
            assert a.c.resend_lookahead == b.c.resend_lookahead, step
            assert a.is_connected == b.is_connected, step
        assert python.c_took == 0  # the reference ran without the C half
        if any(step != "send" and step[0] <= 0 and step[1] >= 0 for step in steps):
            assert c_half.c_took > 0  # and the C half took some
    finally:
        for each in (c_half, python):
            each.path.unlink(missing_ok=True)


def test_both_halves_count_every_sm_once_over_a_mixed_sequence(shm: Path) -> None:
    """An SM is counted in STATUS_MESSAGES_RECEIVED once, whichever half takes it: the C half
    for those it takes, the Python half for those handed up (counted before its checks)."""
    sender = Sender(shm)
    before = sender.counters[SystemCounter.STATUS_MESSAGES_RECEIVED]
    frames = [sm(sender.snd_pos, WINDOW), sm(sender.snd_pos + 64, WINDOW),
              sm(sender.snd_pos, -1), sm(sender.snd_pos - 64, TERM)]
    for frame in frames:
        sender.deliver(frame)
    assert sender.c_took == 2 and len(sender.passed_up) == 2
    assert sender.counters[SystemCounter.STATUS_MESSAGES_RECEIVED] == before + len(frames)


def test_sm_encodes_a_position_as_term_id_and_offset() -> None:
    """The helper's arithmetic the tests rest on: a position is (term id, offset) (§2.3)."""
    assert [(f.consumption_term_id, f.consumption_term_offset)
            for f in (sm(p, 0) for p in (0, TERM - 32, TERM, TERM + HALF_TERM))] == [
        (10, 0), (10, TERM - 32), (11, 0), (11, HALF_TERM)]
