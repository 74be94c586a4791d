"""The retransmit handler (docs/DRIVER.md §3.5): delay, linger, repeats, pool and overflow, on a
real publication's log, and the send endpoint's C dispatch that answers NAKs without Python.

What a NAK resends is queued on the publication (``c.retransmits``) for the data path;
:func:`take` reads and empties that queue as a send would.
"""

from __future__ import annotations

from pathlib import Path

from helpers import network_publication

from slipstream.client._native import lib
from slipstream.client.counters import SystemCounter
from slipstream.client.frames import Nak, StatusMessage
from slipstream.client.layout import NO_DEADLINE
from slipstream.client.logbuffer import new_appender
from slipstream.daemon._network import lib as network
from slipstream.daemon.media.send_channel import SendChannel
from slipstream.daemon.protocol.retransmit import ActionState
from slipstream.daemon.protocol.types import LocalCounters
from slipstream.daemon.streams.publication import NetworkPublication

TERM = 64 * 1024
MS = 1_000_000
FRAME = 1056  # a 1024-byte message: one datagram each
DEST = ("10.0.0.2", 40123)
UNICAST = "aeron:udp?endpoint=10.0.0.2:40123"
MULTICAST = "aeron:udp?endpoint=224.0.1.1:40456"


def publication(shm: Path, uri: str = UNICAST, frames: int = 8, size: int = 1024,
                window: int = 32 * 1024, **settings):
    """A publication that sent ``frames`` messages of ``size`` bytes (term 10, from 0)."""
    pub = network_publication(shm, uri, DEST, term_length=TERM, **settings)
    pub.on_frame(StatusMessage(5, 6, 10, 0, window, 99), DEST, 0)
    appender = new_appender(pub.log, pub.positions.publisher_limit)
    for _ in range(frames):
        assert lib.ss_offer(appender, b"x" * size, size) > 0
    while network.ss_send_data(pub.c, 0, 64, _spans()) > 0:
        pass
    pub._appender = appender  # kept alive with the publication
    return pub, pub.counters


def _spans():
    from slipstream.daemon._network import ffi

    return ffi.new("ss_span_t[]", 64 + network.SS_RETRANSMIT_MAX)


def take(pub: NetworkPublication) -> list[tuple[int, int]]:
    """The queued retransmissions as (term offset, length), emptying the queue."""
    c = pub.c
    out = [(c.retransmits[i].log_offset % TERM, c.retransmits[i].length)
           for i in range(c.retransmit_count)]
    c.retransmit_count = 0
    return out


def nak(pub: NetworkPublication, offset: int, length: int, now_ns: int,
        term_id: int = 10) -> None:
    pub.on_frame(Nak(5, 6, term_id, offset, length), DEST, now_ns)


def test_immediate_retransmit_then_linger_ignores_repeats(shm: Path) -> None:
    pub, counters = publication(shm, retransmit_unicast_linger=10 * MS)
    nak(pub, FRAME, 2 * FRAME, 0)
    assert take(pub) == [(FRAME, FRAME), (2 * FRAME, FRAME)]
    nak(pub, FRAME, 2 * FRAME, 5 * MS)
    nak(pub, 2 * FRAME, FRAME, 5 * MS)  # inside the action's range
    assert take(pub) == []
    assert pub.retransmit_handler.next_deadline_ns() == 10 * MS
    pub.retransmit_handler.process_timeouts(10 * MS)
    assert pub.retransmit_handler.next_deadline_ns() == NO_DEADLINE
    nak(pub, FRAME, FRAME, 11 * MS)
    assert take(pub) == [(FRAME, FRAME)]
    assert counters[SystemCounter.RETRANSMITS_SENT] == 2
    assert counters[SystemCounter.NAK_MESSAGES_RECEIVED] == 4


def test_a_lingering_action_is_no_timer_and_the_next_nak_frees_it(shm: Path) -> None:
    """With no retransmit delay, the answer to a NAK needs no Python pass at the end of its
    linger (the C half answers NAKs: a timer each made a lossy stream's sender run Python
    twice as often); the next NAK after the linger is answered as if the timer had run."""
    pub, counters = publication(shm, retransmit_unicast_linger=10 * MS)
    nak(pub, FRAME, FRAME, 0)
    assert take(pub) == [(FRAME, FRAME)]
    assert pub.retransmit_handler.next_deadline_ns() == 10 * MS  # it lingers
    assert pub.retransmit_handler.next_resend_ns() == NO_DEADLINE
    assert pub.next_deadline_ns() != 10 * MS
    nak(pub, FRAME, FRAME, 5 * MS)  # a repeat while it lingers
    assert take(pub) == []
    nak(pub, FRAME, FRAME, 11 * MS)  # no timer ran: this NAK frees it first
    assert take(pub) == [(FRAME, FRAME)]
    assert counters[SystemCounter.RETRANSMITS_SENT] == 2


def test_delayed_retransmit(shm: Path) -> None:
    pub, _ = publication(shm, retransmit_unicast_delay=2 * MS,
                         retransmit_unicast_linger=10 * MS)
    nak(pub, 0, FRAME, 0)
    assert take(pub) == [] and pub.retransmit_handler.next_deadline_ns() == 2 * MS
    nak(pub, 0, FRAME, 1 * MS)  # a repeat while delayed
    pub.retransmit_handler.process_timeouts(2 * MS)
    assert take(pub) == [(0, FRAME)]
    assert pub.retransmit_handler.next_deadline_ns() == 12 * MS


def test_unicast_reuses_its_single_action(shm: Path) -> None:
    pub, counters = publication(shm)
    nak(pub, 0, FRAME, 0)
    nak(pub, 3 * FRAME, FRAME, 1 * MS)
    assert take(pub) == [(0, FRAME), (3 * FRAME, FRAME)]
    assert counters[SystemCounter.RETRANSMIT_OVERFLOW] == 0
    assert len(pub.retransmit_handler.actions) == 1


def test_group_pool_overflow_is_counted(shm: Path) -> None:
    pub, counters = publication(shm, MULTICAST, max_resend=2)
    for i in range(3):
        nak(pub, i * FRAME, FRAME, 0)
    assert take(pub) == [(0, FRAME), (FRAME, FRAME)]
    assert counters[SystemCounter.RETRANSMIT_OVERFLOW] == 1


def test_resend_length_is_capped_by_the_window_multiple_and_the_term_end(shm: Path) -> None:
    pub, _ = publication(shm, frames=64, size=32)  # 64-byte frames
    pub.on_frame(StatusMessage(5, 6, 10, 0, 32, 99), DEST, 0)  # lookahead 16 x 32 bytes
    nak(pub, 0, 4096, 0)
    assert sum(length for _, length in take(pub)) == 512
    # Out of the window (not sent yet): nothing goes, the action lingers over what the NAK
    # covers up to the term's end.
    nak(pub, TERM - 64, 4096, 1 * MS)
    assert take(pub) == []
    [(state, _, offset, length, _)] = pub.retransmit_handler.actions
    assert (state, offset, length) == (ActionState.LINGERING, TERM - 64, 64)


def test_naks_at_misaligned_or_out_of_range_offsets_are_counted_and_dropped(shm: Path) -> None:
    pub, counters = publication(shm)
    for offset, length in ((7, 64), (-32, 64), (TERM - 16, 64), (TERM, 64), (64, 0),
                           (64, -5)):
        nak(pub, offset, length, 0)
    assert take(pub) == []
    assert counters[SystemCounter.INVALID_PACKETS] == 6
    assert pub.retransmit_handler.active_count == 0


def test_a_nak_for_a_term_before_the_first_resends_nothing(shm: Path) -> None:
    """Its position is negative: below a young stream's resend window, whose bottom is
    negative too, and it must not index the memory before the log."""
    pub, counters = publication(shm)
    for term_id, offset in ((9, TERM - 1024), (9, 0), (10 - (1 << 31), 0), (10, TERM - 32)):
        nak(pub, offset, 1024, 0, term_id=term_id)
        assert take(pub) == []
    assert counters[SystemCounter.RETRANSMITS_SENT] == 0


def test_a_resend_the_sender_could_not_take_frees_its_action(shm: Path) -> None:
    """A resend that found the data path's queue full leaves no lingering action: it would
    hold a slot of the pool, and hide the receiver's next NAK, for nothing sent."""
    pub, counters = publication(shm, MULTICAST, max_resend=2)
    pub.c.retransmit_count = network.SS_RETRANSMIT_MAX
    for i in range(5):
        nak(pub, i * FRAME, FRAME, 0)
    assert pub.retransmit_handler.active_count == 0
    assert pub.retransmit_handler.next_deadline_ns() == NO_DEADLINE
    assert counters[SystemCounter.RETRANSMIT_OVERFLOW] == 5
    pub.c.retransmit_count = 0
    nak(pub, 0, FRAME, 1)  # the same NAK again: served
    assert take(pub) == [(0, FRAME)]


def test_a_partly_taken_resend_lingers_over_the_part_taken(shm: Path) -> None:
    pub, _ = publication(shm)
    pub.c.retransmit_count = network.SS_RETRANSMIT_MAX - 1  # room for one datagram
    nak(pub, 0, 4 * FRAME, 0)
    assert take(pub)[-1] == (0, FRAME)
    nak(pub, 512, 64, 1)  # inside what went: a repeat
    nak(pub, FRAME, 3 * FRAME, 2)  # the rest: served
    assert take(pub) == [(FRAME, FRAME), (2 * FRAME, FRAME), (3 * FRAME, FRAME)]


def channel_with(pub: NetworkPublication, counters: LocalCounters):
    channel = SendChannel(counters=counters)
    channel.add_publication(pub)
    passed_up: list[bytes] = []
    channel.on_control = lambda data, source, now_ns: passed_up.append(bytes(data))
    return channel, passed_up


def test_the_send_endpoint_answers_a_nak_in_c_without_python(shm: Path) -> None:
    pub, counters = publication(shm)
    channel, passed_up = channel_with(pub, counters)
    before = counters[SystemCounter.BYTES_RECEIVED]
    channel.on_datagram(Nak(5, 6, 10, FRAME, FRAME).encode(), DEST, 0)
    assert passed_up == []
    assert take(pub) == [(FRAME, FRAME)]
    assert counters[SystemCounter.NAK_MESSAGES_RECEIVED] == 1
    assert counters[SystemCounter.BYTES_RECEIVED] == before + 28


def test_naks_the_c_dispatch_cannot_answer_go_up_to_python(shm: Path) -> None:
    """A NAK that needs a timer (a retransmit delay), a malformed one, one for another
    session, or one for a publication removed from the endpoint (its log may be gone)."""
    pub, counters = publication(shm, retransmit_unicast_delay=2 * MS)
    channel, passed_up = channel_with(pub, counters)
    short = bytearray(Nak(5, 6, 10, 0, FRAME).encode())
    short[0] = 20  # frame_length under a NAK's 28 bytes
    for datagram in (Nak(5, 6, 10, 0, FRAME).encode(), bytes(short),
                     Nak(7, 6, 10, 0, FRAME).encode()):
        channel.on_datagram(datagram, DEST, 0)
    assert len(passed_up) == 3 and take(pub) == []

    pub, counters = publication(shm)
    channel, passed_up = channel_with(pub, counters)
    channel.remove_publication(pub)
    channel.on_datagram(Nak(5, 6, 10, 0, FRAME).encode(), DEST, 0)
    assert len(passed_up) == 1 and take(pub) == []
    assert counters[SystemCounter.NAK_MESSAGES_RECEIVED] == 0


def test_a_done_publication_answers_no_nak(shm: Path) -> None:
    pub, counters = publication(shm)
    pub.retransmit_handler.stop()
    channel, passed_up = channel_with(pub, counters)
    channel.on_datagram(Nak(5, 6, 10, 0, FRAME).encode(), DEST, 0)
    assert len(passed_up) == 1 and take(pub) == []


def test_removing_a_replaced_publication_keeps_its_successor_answering(shm: Path) -> None:
    """A lingering publication and a new one of the same session and stream on one endpoint:
    the old one leaving must not take the new one's NAKs (and SMs) with it."""
    old, counters = publication(shm)
    new, _ = publication(shm)
    channel, passed_up = channel_with(old, counters)
    channel.add_publication(new)
    channel.remove_publication(old)
    channel.on_datagram(Nak(5, 6, 10, 0, FRAME).encode(), DEST, 0)
    assert passed_up == [] and take(new) == [(0, FRAME)] and take(old) == []
