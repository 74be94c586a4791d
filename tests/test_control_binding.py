"""Forged control changes nothing (docs/DRIVER.md §5.7, issue 59): a publication's status
messages, NAKs, ERRs and rate signals count only from the addresses its receivers' status
messages are bound to; NAKs have a budget; a new fc=min receiver holds the sender only once
admitted; text from the network reaches the log escaped, cut and rate-limited.

Each test drives a real publication through its send endpoint's C dispatch
(:class:`SendChannel` over ``ss_receiver_on_datagram``, as the socket path and the simulator
do) with frames made by the project's codec, and looks at the positions, the retransmissions
queued for the data path and the counters.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import network_publication
from hypothesis import given
from hypothesis import strategies as st

from slipstream.client._native import lib
from slipstream.client.counters import SystemCounter
from slipstream.client.frames import ErrorFrame, Nak, RateSignal, StatusMessage
from slipstream.client.logbuffer import new_appender
from slipstream.daemon._network import ffi as network_ffi
from slipstream.daemon._network import lib as network
from slipstream.daemon.config import DriverSettings
from slipstream.daemon.flow.min_multicast import (
    ADMISSION_CANDIDATES_MAX,
    ADMISSION_STATUS_MESSAGES,
    MinMulticastFlowControl,
)
from slipstream.daemon.media.send_channel import SendChannel
from slipstream.daemon.reports.error_log import RemoteTextLimiter, escape_remote_text
from slipstream.daemon.streams.refusals import REJECTIONS_PER_PASS_MAX

TERM = 64 * 1024
BITS = 16
INITIAL_TERM_ID = 10
SESSION, STREAM = 5, 6
RECEIVER = 99
WINDOW = 16 * 1024
MS = 1_000_000
RECEIVER_ADDRESS = ("10.0.0.2", 40123)
ATTACKER = ("10.0.0.66", 40123)  # another host, the same port
MOVED = ("10.0.9.2", 40123)  # the receiver's public address, after its NAT changed it
OTHER_PORT = ("10.0.0.2", 50999)  # the receiver's host, another port (its NAT's, an endpoint)


def sm(position: int, window: int = WINDOW, *, receiver_id: int = RECEIVER,
       flags: int = 0) -> StatusMessage:
    return StatusMessage(SESSION, STREAM, INITIAL_TERM_ID + (position >> BITS),
                         position & (TERM - 1), window, receiver_id, flags)


def nak(position: int, length: int) -> Nak:
    return Nak(SESSION, STREAM, INITIAL_TERM_ID + (position >> BITS), position & (TERM - 1),
               length)


FRAME = 1056  # a 1 KiB message and its header: Sender's frames


def recent(sender: Sender, back: int) -> int:
    """The position of the frame ``back`` frames (1 ..) before snd-pos, within the resend
    window (at most 16 frames back: a quarter of a term)."""
    frames = []
    position = sender.pub.sender_position
    for term_start in (position & ~(TERM - 1), (position & ~(TERM - 1)) - TERM):
        frames += [term_start + k * FRAME for k in range(TERM // FRAME)
                   if term_start + (k + 1) * FRAME <= position]
    return sorted(frames)[-back]


class Sender:
    """A publication (term 64 KiB) of ``uri`` on a send endpoint's C dispatch that has sent
    at least ``sent`` bytes to its receiver :data:`RECEIVER` at :data:`RECEIVER_ADDRESS`, whose
    last SM acknowledged ``acknowledged`` of them (all, by default)."""

    def __init__(self, shm: Path, uri: str = "aeron:udp?endpoint=10.0.0.2:40123", *,
                 sent: int = TERM, acknowledged: int | None = None, **settings: object) -> None:
        self.settings = DriverSettings(term_buffer_length=TERM, **settings)
        self.pub = pub = network_publication(
            shm, uri, RECEIVER_ADDRESS, term_length=TERM, initial_term_id=INITIAL_TERM_ID,
            session_id=SESSION, stream_id=STREAM, **settings)
        self.path, self.counters = pub.log.path, pub.counters
        self.channel = SendChannel(counters=pub.counters)
        self.channel.add_publication(pub)
        self.appender = new_appender(pub.log, pub.positions.publisher_limit)
        self.spans = network_ffi.new("ss_span_t[]", 64 + network.SS_RETRANSMIT_MAX)
        self.now_ns = 0
        self.deliver(sm(0), RECEIVER_ADDRESS)
        while pub.sender_position < sent:
            self.send()
            self.deliver(sm(pub.sender_position), RECEIVER_ADDRESS)
        if acknowledged is not None:
            self.deliver(sm(acknowledged), RECEIVER_ADDRESS)
        pub.datagrams_to_send(self.tick())
        pub.sync_c_half()

    def tick(self, ns: int = 1_000) -> int:
        self.now_ns += ns
        return self.now_ns

    def send(self) -> None:
        while lib.ss_offer(self.appender, b"x" * 1024, 1024) > 0:
            pass
        now_ns = self.tick()
        if network.ss_send_data(self.pub.c, now_ns, 64, self.spans) > 0:
            self.pub.on_data_sent(now_ns)
        self.pub.sync_c_half()

    def deliver(self, frame: object, source: tuple[str, int], ns: int = 1_000) -> None:
        self.channel.on_datagram(frame.encode(), source, self.tick(ns))

    def take_retransmits(self) -> int:
        """The bytes of the retransmissions queued for the data path since the last call
        (then dropped, as if sent)."""
        c = self.pub.c
        queued = sum(c.retransmits[i].length for i in range(c.retransmit_count))
        c.retransmit_count = 0
        return queued

    def __getitem__(self, counter: SystemCounter) -> int:
        return self.counters[counter]


# -- status messages ------------------------------------------------------------------------

@pytest.mark.parametrize("c_takes_sms", [True, False])
def test_an_sm_naming_the_live_receiver_from_another_address_moves_nothing(
        shm: Path, c_takes_sms: bool) -> None:
    """A forged SM naming the live receiver (a window as large as allowed, at snd-pos; or
    frozen behind it, with no window) from another host is dropped, through the C half's
    path or the Python half's, and counted SM_SOURCE_MISMATCH_DROPS: snd-lmt, what the
    receiver acknowledged and its liveness stay as they were."""
    sender = Sender(shm)
    pub = sender.pub
    if not c_takes_sms:
        pub.c.sm_in_c = 0
    assert bool(pub.c.sm_in_c) is c_takes_sms or not c_takes_sms
    limit, acknowledged = pub.sender_limit, pub._receivers.acknowledged()
    sender.deliver(sm(pub.sender_position, TERM // 2), ATTACKER)
    sender.deliver(sm(0, 0), ATTACKER)
    assert pub.sender_limit == limit and pub._receivers.acknowledged() == acknowledged
    assert sender[SystemCounter.SM_SOURCE_MISMATCH_DROPS] == 2
    assert pub.c.sm_count == 0 or pub.c.sm_position == acknowledged[RECEIVER]
    # The receiver's own SMs still count.
    sender.deliver(sm(pub.sender_position, WINDOW + 1024), RECEIVER_ADDRESS)
    assert pub.sender_limit == pub.sender_position + WINDOW + 1024


def test_a_receiver_that_moved_is_bound_anew_once_its_address_went_quiet(
        shm: Path) -> None:
    """A receiver's SMs from another host (its NAT changed its public address) are dropped
    while its bound host still speaks; once that host sent nothing for the rebind timeout,
    the new one takes the binding, and from then on the old host is the stranger."""
    sender = Sender(shm)
    pub = sender.pub
    quiet = min(sender.settings.receiver_rebind_timeout, pub.connection_timeout_ns // 2)
    sender.deliver(sm(pub.sender_position), MOVED)
    assert sender[SystemCounter.SM_SOURCE_MISMATCH_DROPS] == 1
    assert pub._receivers.bound_source(RECEIVER) == RECEIVER_ADDRESS
    sender.deliver(sm(pub.sender_position), MOVED, ns=quiet)
    assert pub._receivers.bound_source(RECEIVER) == MOVED
    sender.deliver(sm(pub.sender_position), RECEIVER_ADDRESS)
    assert sender[SystemCounter.SM_SOURCE_MISMATCH_DROPS] == 2
    # NAKs follow the binding.
    sender.deliver(nak(recent(sender, 4), 1024), RECEIVER_ADDRESS)
    assert sender[SystemCounter.NAK_UNKNOWN_SOURCE_DROPS] == 1
    sender.deliver(nak(recent(sender, 4), FRAME), MOVED)
    assert sender.take_retransmits() == FRAME


def test_a_receiver_id_counts_from_any_port_of_its_host(shm: Path) -> None:
    """Stock Aeron gives every endpoint of a driver the driver's one receiver id, and a NAT
    may give a receiver a new port: SMs naming the receiver from another port of its bound
    host count, and so do NAKs from each port its SMs came from; a port that sent none does
    not."""
    sender = Sender(shm)
    pub = sender.pub
    sender.deliver(sm(pub.sender_position, WINDOW + 1024), OTHER_PORT)
    assert sender[SystemCounter.SM_SOURCE_MISMATCH_DROPS] == 0
    assert pub.sender_limit == pub.sender_position + WINDOW + 1024
    for source in (RECEIVER_ADDRESS, OTHER_PORT):
        sender.deliver(nak(recent(sender, 3), FRAME), source, ns=1_000_000)
        assert sender.take_retransmits() == FRAME
    sender.deliver(nak(recent(sender, 3), FRAME), ("10.0.0.2", 7), ns=1_000_000)
    assert sender.take_retransmits() == 0
    assert sender[SystemCounter.NAK_UNKNOWN_SOURCE_DROPS] == 1


def test_an_sm_ahead_of_what_was_sent_is_dropped_and_counted_by_its_cause(
        shm: Path) -> None:
    sender = Sender(shm)
    limit = sender.pub.sender_limit
    sender.deliver(sm(sender.pub.sender_position + 32), RECEIVER_ADDRESS)
    assert sender[SystemCounter.SM_AHEAD_OF_SENDER_DROPS] == 1
    assert sender.pub.sender_limit == limit


# -- NAKs -----------------------------------------------------------------------------------

@pytest.mark.parametrize("delay", ["0ns", "1ms"])
def test_a_nak_counts_only_from_a_live_receivers_address(shm: Path, delay: str) -> None:
    """A NAK names no receiver: from another host it is dropped and counted
    NAK_UNKNOWN_SOURCE_DROPS (answered in C without a delay, in Python with one); from the
    receiver's address it is answered.  Once the receiver timed out, no NAK counts."""
    sender = Sender(shm, retransmit_unicast_delay=delay)
    pub = sender.pub
    sender.deliver(nak(recent(sender, 4), 2048), ATTACKER)
    pub.datagrams_to_send(sender.tick(2 * MS))
    assert sender.take_retransmits() == 0
    assert sender[SystemCounter.NAK_UNKNOWN_SOURCE_DROPS] == 1
    sender.deliver(nak(recent(sender, 4), 2 * FRAME), RECEIVER_ADDRESS)
    pub.datagrams_to_send(sender.tick(2 * MS))
    assert sender.take_retransmits() == 2 * FRAME
    pub.datagrams_to_send(sender.tick(pub.connection_timeout_ns + 1))
    assert not pub.has_receivers
    sender.deliver(nak(recent(sender, 8), 1024), RECEIVER_ADDRESS)
    pub.datagrams_to_send(sender.tick(2 * MS))
    assert sender.take_retransmits() == 0
    assert sender[SystemCounter.NAK_UNKNOWN_SOURCE_DROPS] == 2


def test_a_nak_flood_from_the_receivers_address_is_held_to_the_budget(
        shm: Path) -> None:
    """16,000 NAKs spoofed as the receiver, each for another frame of the resend window, over
    one second, ten budget intervals (the stream sends nothing meanwhile): what they make
    the publication resend is at most its term window to start plus a window per interval
    (about 0.35 MB here, against 16.9 MB without a budget); every NAK past that is dropped
    and counted NAK_BUDGET_DROPS; without a budget (percent 0, Aeron's) the
    same flood resends each one.  Once the flood stops, the credit comes back: the next NAK
    is answered."""
    def flood(sender: Sender) -> int:
        resent = 0
        for i in range(16_000):  # over one second: ten intervals of 100 ms
            sender.deliver(nak(recent(sender, 16 - i % 16), FRAME), RECEIVER_ADDRESS,
                           ns=62_500)
            resent += sender.take_retransmits()
        return resent

    budgeted = Sender(shm, sent=2 * TERM, retransmit_budget_interval="100ms")
    window = budgeted.pub.term_window_length
    interval = budgeted.settings.retransmit_budget_interval
    elapsed = budgeted.now_ns
    resent = flood(budgeted)
    elapsed = budgeted.now_ns - elapsed
    allowed = window + window * elapsed // interval + window  # start, refill, one NAK's debt
    assert window * elapsed // interval > 5 * window  # the flood crossed several intervals
    assert 0 < resent <= allowed, (resent, allowed)
    assert budgeted[SystemCounter.NAK_BUDGET_DROPS] > 10_000
    unbounded = Sender(shm, sent=2 * TERM, retransmit_budget_percent=0,
                       retransmit_budget_interval="100ms")
    assert flood(unbounded) == 16_000 * FRAME
    assert unbounded[SystemCounter.NAK_BUDGET_DROPS] == 0
    # The flood stops: within an interval the credit is back.
    budgeted.tick(interval)
    budgeted.deliver(nak(recent(budgeted, 2), FRAME), RECEIVER_ADDRESS)
    assert budgeted.take_retransmits() == FRAME


def test_the_budget_grows_with_the_data_sent(shm: Path) -> None:
    """Credit is earned at retransmit_budget_percent of each byte sent: a publication that
    spent its credit and sends a term more may resend that share of it at once."""
    sender = Sender(shm, sent=TERM, retransmit_budget_percent=50)
    c = sender.pub.c
    now = sender.now_ns
    c.retransmit_credit = 0
    c.retransmit_credit_time_ns = now
    c.retransmit_credit_position = sender.pub.sender_position
    start = sender.pub.sender_position
    while sender.pub.sender_position < start + TERM // 4:
        sender.send()
        sender.deliver(sm(sender.pub.sender_position), RECEIVER_ADDRESS, ns=0)
    sent = sender.pub.sender_position - start
    assert network.ss_retransmit_credit(c, now) == sent // 2


# -- ERRs -----------------------------------------------------------------------------------

def test_an_err_naming_the_receiver_from_another_address_changes_nothing(
        shm: Path) -> None:
    """An ERR naming the live receiver from another host is dropped (not logged either) and
    counted ERR_SOURCE_MISMATCH_DROPS: the publication stays connected.  One naming no live
    receiver reaches the log and changes nothing."""
    sender = Sender(shm)
    pub = sender.pub
    sender.deliver(ErrorFrame(SESSION, STREAM, RECEIVER, 1, "forged\nERROR x"), ATTACKER)
    assert pub.is_connected and pub.has_live_receiver(RECEIVER) and not pub.refusals.rejections
    assert sender[SystemCounter.ERR_SOURCE_MISMATCH_DROPS] == 1
    sender.deliver(ErrorFrame(SESSION, STREAM, 12345, 1, "who?"), ATTACKER)
    assert pub.is_connected and pub.refusals.rejections == [(ATTACKER, "who?")]


def test_errs_past_what_a_pass_keeps_are_counted_as_refusals_all_the_same(
        shm: Path) -> None:
    """More ERRs in one pass than their texts are kept for (REJECTIONS_PER_PASS_MAX): the
    rest count REMOTE_TEXT_SUPPRESSED_DROPS and are kept as a count,
    ``rejections_unkept``, which the sender hands on with the kept ones
    (``PublicationRejected.unkept``) for the publication's refusals to count."""
    sender = Sender(shm)
    pub = sender.pub
    more = 5
    for receiver_id in range(REJECTIONS_PER_PASS_MAX + more):
        sender.deliver(ErrorFrame(SESSION, STREAM, 1000 + receiver_id, 1, "refused"),
                       ATTACKER)
    assert len(pub.refusals.rejections) == REJECTIONS_PER_PASS_MAX
    assert pub.refusals.rejections_unkept == more
    assert sender[SystemCounter.REMOTE_TEXT_SUPPRESSED_DROPS] == more


@pytest.mark.parametrize("c_takes_sms", [True, False])
def test_an_err_from_the_receivers_address_counts_only_if_its_sms_stop(
        shm: Path, c_takes_sms: bool) -> None:
    """An ERR naming the live receiver from its own address (a spoofed one, or its own)
    disconnects nothing at once: if an SM of that receiver follows within the grace (two
    status message timeouts), taken by either half, the ERR is dropped and counted
    ERR_CONTRADICTED_DROPS; if none does, the receiver rejected the image and is gone then."""
    sender = Sender(shm)
    pub = sender.pub
    if not c_takes_sms:
        pub.c.sm_in_c = 0
    grace = 2 * sender.settings.status_message_timeout
    sender.deliver(ErrorFrame(SESSION, STREAM, RECEIVER, 1, "spoofed"), RECEIVER_ADDRESS)
    sender.deliver(sm(pub.sender_position), RECEIVER_ADDRESS)
    pub.datagrams_to_send(sender.tick(grace + 1))
    assert pub.is_connected and pub.has_live_receiver(RECEIVER)
    assert sender[SystemCounter.ERR_CONTRADICTED_DROPS] == 1
    sender.deliver(ErrorFrame(SESSION, STREAM, RECEIVER, 1, "no"), RECEIVER_ADDRESS)
    pub.datagrams_to_send(sender.tick(grace // 2))
    assert pub.is_connected
    assert pub.next_deadline_ns() <= sender.now_ns + grace // 2 + 1
    pub.datagrams_to_send(sender.tick(grace // 2 + 1))
    assert not pub.is_connected and not pub.has_live_receiver(RECEIVER)


# -- rate signals ---------------------------------------------------------------------------

def test_a_rate_signal_counts_only_from_a_receiver_whose_sms_show_the_backlog(
        shm: Path) -> None:
    """Under rc=nak-strength a signal from another host is dropped
    (RATE_SIGNAL_UNKNOWN_SOURCE_DROPS); one from the receiver's address claiming a 75 %
    backlog while its SMs acknowledge all that was sent is dropped
    (RATE_SIGNAL_UNBACKED_DROPS); neither cuts the rate.  Once its SMs show the backlog,
    the signal cuts."""
    sender = Sender(shm, "aeron:udp?endpoint=10.0.0.2:40123|rc=nak-strength")
    pub = sender.pub
    signal = RateSignal(SESSION, STREAM, 800, 75, 1_000_000)
    sender.deliver(signal, ATTACKER)
    sender.deliver(signal, RECEIVER_ADDRESS)
    assert pub.c.rate_limit == 0 and sender[SystemCounter.RATE_CUTS] == 0
    assert sender[SystemCounter.RATE_SIGNAL_UNKNOWN_SOURCE_DROPS] == 1
    assert sender[SystemCounter.RATE_SIGNAL_UNBACKED_DROPS] == 1
    behind = pub.sender_position - WINDOW * 3 // 4
    sender.deliver(sm(behind), RECEIVER_ADDRESS)
    sender.deliver(signal, RECEIVER_ADDRESS)
    assert sender[SystemCounter.RATE_CUTS] == 1 and pub.c.rate_limit > 0


# -- fc=min admission -----------------------------------------------------------------------

def admission(**kwargs: int) -> MinMulticastFlowControl:
    fc = MinMulticastFlowControl(receiver_timeout_ns=5_000 * MS, admission_interval_ns=100 * MS,
                                 **kwargs)
    fc.sender_position = 0
    return fc


def feed(fc: MinMulticastFlowControl, position: int, now_ns: int, *,
         receiver_id: int = RECEIVER, sender_limit: int = 0) -> int:
    return fc.on_status_message(sm(position, receiver_id=receiver_id), RECEIVER_ADDRESS,
                                sender_limit, INITIAL_TERM_ID, BITS, now_ns)


def test_receivers_of_the_streams_start_are_admitted_at_once() -> None:
    """Before the stream sent its first window, a receiver that has all of it holds the
    sender at its first SM (the receivers of a new stream join together)."""
    fc = admission()
    assert feed(fc, 0, 0) == WINDOW
    assert RECEIVER in fc.receivers and fc.has_required_receivers()


def test_a_frozen_newcomer_never_holds_the_sender() -> None:
    """On a running stream, a new receiver id whose SMs stay at one position behind snd-pos
    (a forger that froze, or never tracked) is never admitted, however long and often it
    sends: the sender limit follows the admitted receiver alone."""
    fc = admission()
    feed(fc, 0, 0, receiver_id=1)  # the real receiver, of the stream's start
    position = 0
    for i in range(1, 200):
        position += 4096
        fc.sender_position = position
        now = i * 10 * MS
        limit = feed(fc, position, now, receiver_id=1)
        limit = feed(fc, 2048, now, receiver_id=2, sender_limit=limit)  # frozen
        assert limit == position + WINDOW
        assert fc.on_idle(now, limit, position, False) == position + WINDOW
    assert set(fc.receivers) == {1}


def test_a_newcomer_frozen_where_a_recent_setup_put_it_is_admitted_and_holds_the_sender(
        ) -> None:
    """A receiver whose subscriber has not read yet (a replay merge catching up) sits where
    the SETUP it joined from put it while the stream moves on: it is admitted once heard
    three times over the interval and holds the sender from there, as under Aeron.  One
    frozen behind every SETUP sent within the receiver timeout is not."""
    fc = admission()
    feed(fc, 0, 0, receiver_id=1)
    fc.sender_position = 10 * WINDOW
    feed(fc, 10 * WINDOW, 0, receiver_id=1)
    fc.on_setup_frame(10 * WINDOW, 0)  # the newcomer joins at the SETUP's position
    for i, now in enumerate([10 * MS, 60 * MS, 120 * MS]):
        fc.sender_position = 10 * WINDOW + (i + 1) * 4096  # the stream moves on
        limit = feed(fc, fc.sender_position, now, receiver_id=1)
        limit = feed(fc, 10 * WINDOW, now, receiver_id=2, sender_limit=limit)
        assert (2 in fc.receivers) is (i + 1 == ADMISSION_STATUS_MESSAGES)
    assert fc.on_idle(120 * MS, limit, fc.sender_position, False) == 11 * WINDOW
    # Frozen anywhere else, within that timeout still, it is not admitted: no receiver
    # joined there.
    for i in range(10):
        feed(fc, 10 * WINDOW + 1024, 130 * MS + i * 50 * MS, receiver_id=4,
             sender_limit=limit)
    assert 4 not in fc.receivers
    # A receiver timeout after that SETUP, one frozen at its position is a forger's.
    later = 120 * MS + fc.receiver_timeout_ns
    for i in range(10):
        feed(fc, 10 * WINDOW, later + i * 50 * MS, receiver_id=3, sender_limit=limit)
    assert 3 not in fc.receivers


def test_a_newcomer_heard_consistently_is_admitted_after_the_interval() -> None:
    """A new receiver that moves on with the stream is admitted at its third SM at least
    the admission interval after its first, and holds the sender from then on; until then
    the sender limit ignores it.  One that goes more than a window backwards starts over."""
    fc = admission()
    feed(fc, 0, 0, receiver_id=1)
    fc.sender_position = 10 * WINDOW
    feed(fc, 10 * WINDOW, 0, receiver_id=1)
    times = [0, 40 * MS, 100 * MS]
    for i, now in enumerate(times):
        limit = feed(fc, 9 * WINDOW + i * 1024, now, receiver_id=2,
                     sender_limit=11 * WINDOW)
        assert (2 in fc.receivers) is (i + 1 == ADMISSION_STATUS_MESSAGES)
    assert limit == 11 * WINDOW  # max(limit, min): it was already there
    assert fc.on_idle(100 * MS, 11 * WINDOW, 10 * WINDOW, False) == 9 * WINDOW + 2048 + WINDOW
    # Backwards by more than a window: a third receiver starts over.
    feed(fc, 10 * WINDOW, 0, receiver_id=3, sender_limit=11 * WINDOW)
    feed(fc, 8 * WINDOW, 50 * MS, receiver_id=3, sender_limit=11 * WINDOW)
    assert 3 not in fc.candidates
    feed(fc, 10 * WINDOW, 200 * MS, receiver_id=3, sender_limit=11 * WINDOW)
    assert fc.candidates[3].count == 1


def test_newcomers_waiting_for_admission_are_bounded() -> None:
    fc = admission()
    feed(fc, 0, 0, receiver_id=1)
    fc.sender_position = 10 * WINDOW
    for receiver_id in range(2, ADMISSION_CANDIDATES_MAX + 100):
        feed(fc, 9 * WINDOW, MS, receiver_id=receiver_id, sender_limit=11 * WINDOW)
    assert len(fc.candidates) == ADMISSION_CANDIDATES_MAX
    fc.on_idle(MS + fc.receiver_timeout_ns + 1, 11 * WINDOW, 10 * WINDOW, False)
    assert not fc.candidates


# -- text from the network ------------------------------------------------------------------

@given(st.text(max_size=2000), st.integers(min_value=8, max_value=400))
def test_remote_text_reaches_the_log_as_printable_ascii_within_its_limit(
        text: str, limit: int) -> None:
    escaped = escape_remote_text(text, limit)
    assert all(" " <= ch <= "~" for ch in escaped)
    assert len(escaped) <= limit + 3
    if len(text) <= limit and all(" " <= ch <= "~" and ch != "\\" for ch in text):
        assert escaped == text


def test_remote_text_lines_are_limited_per_host_and_interval() -> None:
    limiter = RemoteTextLimiter(lines=3, interval_ns=10 * MS, sources_max=4)
    assert [limiter.allow("10.0.0.66", i) for i in range(5)] == [True] * 3 + [False] * 2
    assert limiter.allow("10.0.0.2", 5)  # another host has its own
    assert limiter.allow("10.0.0.66", 10 * MS)  # a new interval
    for host in range(10):  # a flood of hosts is bounded, and loses only lines
        limiter.allow(f"10.1.0.{host}", 10 * MS)
    assert len(limiter._windows) <= 4
