"""NAK-strength send-rate adaptation (``rc=nak-strength``, daemon/flow/rate_control.py): the
sender's limit and the receiver's signals as sans-I/O rules, the C data path's token bucket,
and a sender/receiver pair whose subscriber reads slowly."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_protocol_pair import MS, SENDER, URI, Pair

from slipstream.client.counters import SystemCounter
from slipstream.client.frames import RateAnnounce, RateSignal, StatusMessage, decode
from slipstream.client.layout import NO_DEADLINE, RATE_SIGNAL_MAX_RATE
from slipstream.daemon._network import ffi as network_ffi
from slipstream.daemon._network import lib as network
from slipstream.daemon.flow.rate_control import (
    LIFT_FACTOR,
    MAX_DEPTH,
    MIN_DATAGRAMS_PER_S,
    READ_GRACE_NS,
    NakStrengthRateControl,
    NakStrengthSignaller,
)
from slipstream.daemon.protocol.params import (
    DEFAULT_RATE_THRESHOLDS,
    DEFAULT_RATE_WINDOW_NS,
    RateControlParams,
)

WINDOW = DEFAULT_RATE_WINDOW_NS
PARAMS = RateControlParams("nak-strength", DEFAULT_RATE_THRESHOLDS, WINDOW)
MTU = 1408
MB = 1_000_000


def controller_sending_at(rate: int) -> tuple[NakStrengthRateControl, int, int]:
    """A controller whose sender has sent ``rate`` bytes/s for two windows: (it, now, snd-pos)."""
    control = NakStrengthRateControl(PARAMS, mtu=MTU, now_ns=0, sender_position=0)
    position = 0
    for now in (WINDOW, 2 * WINDOW):
        position = rate * now // 1_000_000_000
        control.on_tick(now, position)
    return control, 2 * WINDOW, position


# -- the sender's limit ------------------------------------------------------------------


def test_the_limit_starts_lifted_and_a_signal_cuts_the_rate_achieved_by_its_strength() -> None:
    control, now, position = controller_sending_at(100 * MB)
    assert control.rate_limit == 0 and control.sent_rate == 100 * MB
    assert control.on_signal(now, 50, position)
    assert control.rate_limit == 75 * MB  # 100 MB/s x (1 - 0.5 x 50 %)
    assert control.knee == 100 * MB and control.cuts == 1


def test_within_one_window_only_a_stronger_signal_cuts_again_and_from_the_same_base() -> None:
    control, now, position = controller_sending_at(100 * MB)
    control.on_signal(now, 75, position)
    assert control.rate_limit == 62_500_000
    # Receivers signalling the same episode: a weaker or equal signal does nothing ...
    assert not control.on_signal(now + WINDOW // 2, 50, position)
    assert not control.on_signal(now + WINDOW // 2, 75, position)
    assert control.rate_limit == 62_500_000
    # ... a stronger one cuts deeper, from the rate before the first cut, not compounded.
    assert control.on_signal(now + WINDOW // 2, 100, position)
    assert control.rate_limit == 50 * MB
    assert (control.signals, control.cuts) == (4, 2)


def climb_without_signals(offered: int) -> list[int]:
    """The limit at each tick after a cut from 100 MB/s to 50 MB/s, until it is lifted (at
    most 60 windows), for a publisher that offers ``offered`` bytes/s: the sender sends that
    or the limit, whichever is lower."""
    control, now, position = controller_sending_at(100 * MB)
    position += 100 * MB * (WINDOW // 2) // 1_000_000_000
    control.on_signal(now + WINDOW // 2, 100, position)  # mid-window: holds the next tick
    limits = []
    rate = 50 * MB
    for _ in range(60):
        now += WINDOW
        position += rate * WINDOW // 1_000_000_000
        control.on_tick(now, position)
        limits.append(control.rate_limit)
        if not control.rate_limit:
            break
        rate = min(offered, control.rate_limit)
    return limits


def test_without_signals_the_limit_climbs_to_the_knee_then_probes_past_it_and_is_lifted() -> None:
    limits = climb_without_signals(offered=150 * MB)
    assert limits[0] == 50 * MB  # the window of the cut holds it
    climb = limits[1:limits.index(100 * MB) + 1]
    assert climb == sorted(climb) and len(climb) >= 3  # concave: quick, then slower
    assert climb[0] - 50 * MB > climb[-1] - climb[-2]
    probe = limits[len(climb) + 1:-1]
    steps = [b - a for a, b in zip([100 * MB, *probe], probe, strict=False)]
    assert steps == sorted(steps) and steps[-1] > steps[0]  # convex past the knee
    assert limits[-1] == 0 and probe[-1] < LIFT_FACTOR * 100 * MB


def test_a_sender_with_a_backlog_is_not_lifted_while_the_limit_binds() -> None:
    """A publisher with more to send than any limit lets through (here up to 2 GB/s) sends
    at the limit: lifted at four times the knee, its backlog would go at line rate before a
    receiver could signal.  The limit goes on in doubling steps instead, and is lifted at the
    first window in which the sender used less than three quarters of it."""
    limits = climb_without_signals(offered=2000 * MB)
    probe = limits[limits.index(100 * MB) + 1:-1]
    assert probe[-1] >= 2000 * MB * 4 // 3  # past 4x the knee while it bound
    assert all(later <= 3 * earlier for earlier, later in itertools.pairwise(probe))
    assert limits[-1] == 0 and probe[-2] * 3 < 2000 * MB * 4  # lifted once it did not bind


def test_signals_that_recur_right_after_a_hold_make_the_cuts_deeper() -> None:
    control, now, position = controller_sending_at(100 * MB)
    depths = []
    for _ in range(8):
        control.on_signal(now, 100, position)
        depths.append(control.depth)
        now += WINDOW + WINDOW // 2  # the next signal half a window after the hold ends
        control.on_tick(now, position)
    assert depths == sorted(depths) and depths[-1] == MAX_DEPTH


def test_a_signal_after_a_long_calm_makes_the_next_cut_shallower() -> None:
    control, now, position = controller_sending_at(100 * MB)
    control.on_signal(now, 100, position)
    deep = control.depth
    control.on_signal(now + 100 * WINDOW, 100, position)
    assert control.depth < deep


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3 * WINDOW), st.sampled_from((0, 50, 75, 87, 100)),
                          st.integers(0, 10 * MB), st.integers(0, RATE_SIGNAL_MAX_RATE)),
                max_size=80))
def test_signals_only_lower_the_limit_ticks_only_raise_or_lift_it_and_it_stays_in_range(
        events: list[tuple[int, int, int, int]]) -> None:
    control = NakStrengthRateControl(PARAMS, mtu=MTU, now_ns=0, sender_position=0)
    now = position = 0
    for elapsed, threshold, sent, consumption_rate in events:
        now += elapsed
        position += sent
        if threshold:
            before, cuts = control.rate_limit, control.cuts
            cut = control.on_signal(now, threshold, position, consumption_rate)
            assert cut == (control.cuts == cuts + 1)
            if before:
                assert control.rate_limit <= before and cut == (control.rate_limit < before)
            else:
                assert cut and control.rate_limit
        before = control.rate_limit
        control.on_tick(now, position)
        if control.rate_limit:
            assert control.rate_limit >= before
        assert control.rate_limit == 0 or (
            MTU * MIN_DATAGRAMS_PER_S <= control.rate_limit < RATE_SIGNAL_MAX_RATE)


# -- the receiver's signals ------------------------------------------------------------------


def test_a_receiver_signals_each_threshold_crossed_and_repeats_a_held_one_while_it_grows() -> None:
    signaller = NakStrengthSignaller(RateAnnounce(1, 2, WINDOW // 1000, (50, 75, 87, 100)),
                                     read_grace_ns=0)
    window = 100_000

    def at(now: int, consumed: int, backlog: int) -> tuple[int, int] | None:
        signalled = signaller.signal(now, consumed, consumed + backlog, window)
        return None if signalled is None else signalled[:2]  # (threshold, fill)

    assert signaller.next_signal_position(0, window) == 50_000
    assert at(0, 0, 49_999) is None
    assert at(1, 10, 50_000) == (50, 500)
    assert signaller.next_signal_position(10, window) == 10 + 75_000
    assert at(2, 20, 70_000) is None  # still 50 %, within the window
    assert at(3, 30, 100_000) == (100, 1000)  # past 75 and 87 at once: the strongest
    assert signaller.next_signal_position(30, window) == NO_DEADLINE
    assert signaller.next_deadline_ns() == 3 + WINDOW
    assert at(4, 40, 100_000) is None
    assert at(3 + WINDOW, 50, 150_000) == (100, 1000)  # held a window, backlog grew: again
    # Held a window more but draining: nothing, and the next window is judged from here.
    assert at(3 + 2 * WINDOW, 60, 120_000) is None
    assert at(3 + 3 * WINDOW, 70, 120_000) == (100, 1000)  # it stopped draining: again
    assert at(4 + 3 * WINDOW, 80, 10_000) is None  # below every threshold: quiet
    assert signaller.next_deadline_ns() == NO_DEADLINE
    assert at(5 + 3 * WINDOW, 90, 76_000) == (75, 760)  # a new crossing goes at once


def test_a_receiver_whose_subscribers_took_nothing_for_a_window_is_silent_until_they_move() -> None:
    signaller = NakStrengthSignaller(RateAnnounce(1, 2, WINDOW // 1000, (50, 100)),
                                     read_grace_ns=0)
    window = 100_000
    assert signaller.signal(0, 0, 100_000, window) == (100, 1000, 0)
    # Nothing taken for a window: paused or dead, which no rate would help.
    assert signaller.signal(WINDOW + 1, 0, 100_000, window) is None
    assert signaller.stalled and signaller.next_signal_position(0, window) == NO_DEADLINE
    assert signaller.next_deadline_ns() == 2 * WINDOW + 1  # it looks again a window later
    assert signaller.signal(3 * WINDOW, 0, 100_000, window) is None
    assert signaller.signal(3 * WINDOW + 1, 1, 100_001, window)[:2] == (100, 1000)  # it moves
    assert not signaller.stalled


def test_a_signal_carries_what_the_subscribers_took_over_the_last_one_to_two_windows() -> None:
    signaller = NakStrengthSignaller(RateAnnounce(1, 2, WINDOW // 1000, (50,)), read_grace_ns=0)
    window = 100_000
    # 2 MB/s taken: 100 KB per 50 ms window; the image is at 60 % all along.
    rates = []
    for step in range(12):
        now = step * WINDOW // 2
        consumed = 2 * MB * now // 1_000_000_000
        signalled = signaller.signal(now, consumed, consumed + 60_000, window)
        rates.append(None if signalled is None else signalled[2])
    assert rates[0] == 0  # nothing measured yet
    assert [r for r in rates[1:] if r is not None] and all(
        r == 2 * MB for r in rates[1:] if r is not None)


def test_what_became_readable_counts_in_the_fill_only_once_it_was_readable_for_the_grace(
        ) -> None:
    """A repair makes a window's worth readable at once; a subscriber that keeps up has read
    it a moment later.  Only a top that stayed past a threshold for READ_GRACE_NS signals,
    and the image is told when to look again instead of being woken on every pass."""
    grace = READ_GRACE_NS
    signaller = NakStrengthSignaller(RateAnnounce(1, 2, WINDOW // 1000, (50, 100)))
    window = 100_000

    def look(now: int, consumed: int, top: int) -> tuple:
        """One pass of the image: (threshold or None, wake-up position, deadline)."""
        signalled = signaller.signal(now, consumed, top, window)
        position = signaller.next_signal_position(consumed, window)
        return (signalled and signalled[0], position, signaller.next_deadline_ns())

    assert look(0, 0, 10_000) == (None, 50_000, NO_DEADLINE)
    # A repair: 90 % readable at once.  No signal, no wake-up position: a deadline instead.
    assert look(10, 0, 90_000) == (None, NO_DEADLINE, 10 + grace)
    # The subscriber read it within the grace: nothing is ever signalled.
    assert look(10 + grace, 90_000, 90_000) == (None, 90_000 + 50_000, NO_DEADLINE)
    # A subscriber that does not read: the same top, a grace later, signals 50 %; 100 %
    # (reached meanwhile) counts once it too was there for the grace.
    assert look(20 + grace, 90_000, 150_000) == (None, NO_DEADLINE, 20 + 2 * grace)
    assert look(30 + grace, 90_000, 200_000) == (None, NO_DEADLINE, 20 + 2 * grace)
    assert look(20 + 2 * grace, 90_000, 200_000) == (50, NO_DEADLINE, 30 + 2 * grace)
    assert look(30 + 2 * grace, 90_000, 200_000)[0] == 100


def test_a_top_that_fell_back_below_a_threshold_is_watched_again_not_timed_in_the_past(
        ) -> None:
    """The top falls when an old gap is repaired and the next one is young.  A look past
    the threshold before the fall must not arm a deadline already gone (every pass would be
    due until the fall was a grace old: a spin)."""
    grace = READ_GRACE_NS
    signaller = NakStrengthSignaller(RateAnnounce(1, 2, WINDOW // 1000, (50, 100)))
    window = 100_000
    signaller.signal(0, 0, 0, window)
    signaller.signal(grace, 0, 90_000, window)
    assert signaller.next_signal_position(0, window) == NO_DEADLINE
    assert signaller.next_deadline_ns() == 2 * grace
    assert signaller.signal(2 * grace + 5, 0, 10_000, window) is None  # fell back to 10 %
    assert signaller.next_signal_position(0, window) == 50_000
    assert signaller.next_deadline_ns() == NO_DEADLINE
    # Past it again: it counts a grace from now, however long ago it first was.
    assert signaller.signal(2 * grace + 10, 0, 60_000, window) is None
    assert signaller.next_signal_position(0, window) == NO_DEADLINE
    assert signaller.next_deadline_ns() == 3 * grace + 10


def test_a_signal_from_subscribers_that_stopped_reading_carries_no_rate() -> None:
    """A subscriber that read 10 MB/s and then stopped (a pause beginning) crosses the
    thresholds as data keeps arriving.  What it took while stopping is no rate it can take:
    the signal carries none once it has taken nothing for a grace, and the sender cuts from
    its own rate (with the rate it had dwindled to, a paused host cut the sender far down,
    and the burst when the limit was lifted left a fast host behind).  One still reading
    carries its rate (the burst test below)."""
    signaller = NakStrengthSignaller(RateAnnounce(1, 2, WINDOW // 1000, (50, 75)))
    window = 100_000
    assert signaller.signal(0, 0, 0, window) is None
    consumed = 0
    for step in range(1, 40):  # reading 10 MB/s, 1 KB behind
        now = step * 100_000
        consumed = 10 * MB * now // 1_000_000_000
        assert signaller.signal(now, consumed, consumed + 1_000, window) is None
    stopped = 39 * 100_000
    # It stops; 80 KB arrive and wait there for a grace.
    assert signaller.signal(stopped + 100_000, consumed, consumed + 80_000, window) is None
    later = stopped + 100_000 + READ_GRACE_NS
    assert signaller.signal(later, consumed, consumed + 80_000, window) == (75, 800, 0)


def test_a_signal_after_a_burst_carries_what_the_subscriber_took_since_it_caught_up() -> None:
    """The rate a signal carries is measured from the last look at which the subscriber had
    nothing to read, not from the last at which nothing had been readable for the grace: a
    burst looked at within the grace must not leave the signal without a rate (the sender
    would then cut from its own rate only)."""
    signaller = NakStrengthSignaller(RateAnnounce(1, 2, WINDOW // 1000, (50, 75)))
    window = 100_000
    assert signaller.signal(0, 0, 0, window) is None  # caught up
    rates = []
    for step in range(1, 40):  # a look every 100 µs; 10 MB/s read from a 120 KB burst
        now = step * 100_000
        consumed = 10 * MB * now // 1_000_000_000
        signalled = signaller.signal(now, consumed, 120_000, window)
        if signalled is not None:
            rates.append(signalled[2])
    assert rates and all(9 * MB <= rate <= 11 * MB for rate in rates), rates


def test_data_above_a_gap_counts_in_the_fill_once_the_gap_outlived_two_repairs(
        shm: Path) -> None:
    """ss_image_rate_signal_top: a gap NAKed once or twice holds only what is below it;
    from its third NAK (two repairs did not come) what waits above it counts too."""
    pair = Pair(shm, uri=URI + "|rc=nak-strength", term_length=1 << 20)
    pair.auto_poll = False
    lost = []

    def drop(direction: str, dg) -> bool:
        frame = decode(dg.data)
        if direction == "p2r" and frame.__class__.__name__ == "Data" and frame.term_offset == 8192:
            lost.append(pair.now)
            return True  # the first copy and every retransmission
        return False

    pair.drop = drop
    pair.run_until(1 * MS)
    for _ in range(40):
        assert pair.offer(b"g" * 992) > 0
    image = pair.image
    tops = []
    for _ in range(400):
        pair.run_until(pair.now + 100_000)
        loss = image.loss_detector.c
        naks = loss.gaps[0].naks if loss.gap_count else 0
        tops.append((naks, network.ss_image_rate_signal_top(image.c), image.rcv_hwm))
        if naks >= network.SS_RATE_SIGNAL_GAP_NAKS + 1:
            break
    assert network.SS_RATE_SIGNAL_GAP_NAKS == 3
    assert len(lost) >= 3 and image.rcv_hwm == 40 * 1024
    young = [top for naks, top, _ in tops if 0 < naks < network.SS_RATE_SIGNAL_GAP_NAKS]
    old = [(top, hwm) for naks, top, hwm in tops if naks >= network.SS_RATE_SIGNAL_GAP_NAKS]
    assert young and all(top == 8192 for top in young)
    assert old and all(top == hwm for top, hwm in old)


def test_the_fill_is_the_slowest_subscribers_distance_to_the_hwm_per_mille_of_the_window() -> None:
    fill = NakStrengthSignaller.fill_permille
    assert fill(1000, 1000, 4096) == 0
    assert fill(1000, 3048, 4096) == 500
    assert fill(0, 10 * 4096, 4096) == 1000  # left behind under fc=max: capped
    assert fill(2000, 1000, 4096) == 0  # a subscriber can not be ahead; never negative


# -- the C data path's bucket ------------------------------------------------------------


def connected_rc_pair(shm: Path, *, committed: int) -> Pair:
    """An rc=nak-strength pair, connected, whose publisher committed ``committed`` KiB
    frames that nothing has read."""
    pair = Pair(shm, uri=URI + "|rc=nak-strength", term_length=1 << 20)
    pair.auto_poll = False
    pair.run_until(1 * MS)
    for _ in range(committed):
        assert pair.offer(b"r" * 992) > 0
    return pair


def test_the_data_path_sends_at_the_rate_limit_and_never_more_than_the_burst_at_once(
        shm: Path) -> None:
    pair = connected_rc_pair(shm, committed=400)  # more than the window lets out
    publication = pair.publication
    c = publication.c
    rate, burst = 2 * MB, 16 * 1024
    c.rate_limit, c.rate_burst, c.rate_credit, c.rate_time_ns = rate, burst, burst, 0
    publication.sender_limit = 1 << 40  # flow control out of the way: only the bucket holds
    spans = network_ffi.new("ss_span_t[]", 64 + network.SS_RETRANSMIT_MAX)
    start = publication.sender_position
    sent_at = []
    for now in range(0, 100 * MS, 50_000):  # a loop that looks every 50 us for 100 ms
        before = publication.sender_position
        network.ss_send_data(c, now, 64, spans)
        moved = publication.sender_position - before
        assert moved <= burst + 1024  # one datagram may overdraw the bucket
        if moved:
            sent_at.append(now)
    total = publication.sender_position - start
    # The burst, then 2 MB/s for 0.1 s, in batches of half a burst (one may be left over).
    assert rate // 10 + burst // 2 - 1024 <= total <= rate // 10 + burst + 1024, total
    assert len(sent_at) < 2 * (rate // 10) // burst + 4  # a batch per wake-up, not a datagram
    # Waiting data reports when the bucket lets it go, the same answer ss_rate_wait_ns gives.
    ready = network.ss_rate_ready_ns(c)
    assert ready > sent_at[-1]
    assert network.ss_rate_wait_ns(c, ready - 1) > 0 and network.ss_rate_wait_ns(c, ready) == 0


def test_retransmissions_go_while_the_bucket_is_empty_and_leave_it_at_most_a_burst_in_debt(
        shm: Path) -> None:
    pair = connected_rc_pair(shm, committed=200)
    publication = pair.publication
    c = publication.c
    publication.sender_limit = 1 << 40
    spans = network_ffi.new("ss_span_t[]", 64 + network.SS_RETRANSMIT_MAX)
    network.ss_send_data(c, 0, 64, spans)  # what the window lets out, before any limit
    sent_to = publication.sender_position
    burst = 8 * 1024
    c.rate_limit, c.rate_burst, c.rate_credit, c.rate_time_ns = 1 * MB, burst, 0, 10 * MS
    # A NAK's worth of repairs (64 KiB) with nothing in the bucket: they go, new data waits.
    taken = network.ss_resend(c, pair.log.initial_term_id, 0, 64 * 1024)
    assert taken == 64 * 1024 and c.retransmit_count > 0
    sent = network.ss_send_data(c, 10 * MS, 64, spans)
    assert sent == 64 * 1024 // 1024 and c.retransmit_count == 0
    assert publication.sender_position == sent_to  # no new data
    assert c.rate_credit == -burst  # in debt, a burst deep at most
    # New data goes once the bucket holds a batch (half a burst): 12 KiB at 1 MB/s, 12 ms.
    ready = network.ss_rate_ready_ns(c)
    assert ready == 10 * MS + (burst + burst // 2) * 1_000_000_000 // MB
    assert network.ss_send_data(c, ready - 1, 64, spans) == 0
    assert network.ss_send_data(c, ready, 64, spans) > 0
    assert publication.sender_position > sent_to


# -- a sender and a receiver whose subscriber reads slowly ----------------------------------


def numbered(index: int) -> bytes:
    """A 992-byte message that carries its index, so a loss, a repeat or a swap shows."""
    return index.to_bytes(8, "little") + b"s" * 984


def run_slow_subscriber(pair: Pair, *, messages_per_ms: int, ms: int) -> tuple[int, list]:
    """The publisher offers until back pressure every ms; the subscriber reads
    ``messages_per_ms`` 1 KiB frames each ms.  Returns (offered, limits each ms)."""
    pair.auto_poll = False
    pair.run_until(1 * MS)
    offered = 0
    limits = []
    for t in range(1, ms):
        while pair.offer(numbered(offered)) > 0:
            offered += 1
        if pair.subscriber is not None:
            pair.subscriber.poll(lambda data, header: pair.received.append(bytes(data)),
                                 messages_per_ms)
        pair.run_until((t + 1) * MS)
        control = pair.publication.rate_control
        limits.append(control.rate_limit if control is not None else 0)
    return offered, limits


def test_a_slow_subscriber_slows_the_sender_to_what_it_takes_and_loses_nothing(
        shm: Path) -> None:
    pair = Pair(shm, uri=URI + "|rc=nak-strength", term_length=1 << 20)
    offered, limits = run_slow_subscriber(pair, messages_per_ms=10, ms=1500)
    taken = 10 * 1024 * 1000  # bytes/s the subscriber reads
    control = pair.publication.rate_control
    assert control is not None and control.cuts >= 3
    # Every signal was sent by the image above a threshold and reached the sender.
    signals = pair.rcv_counters[SystemCounter.RATE_SIGNALS_SENT]
    assert signals == pair.pub_counters[SystemCounter.RATE_SIGNALS_RECEIVED] == control.signals
    assert pair.pub_counters[SystemCounter.RATE_CUTS] == control.cuts
    sent_signals = [f for _, f in pair.frames("r2p", RateSignal)]
    assert len(sent_signals) == signals and all(s.fill_permille >= 500 for s in sent_signals)
    # The limit settles around what the subscriber takes (the last second, once settled).
    settled = limits[500:]
    assert all(limit for limit in settled)
    mean = sum(settled) / len(settled)
    assert 0.6 * taken < mean < 1.4 * taken, (mean, taken)
    assert pair.publication.positions.sender_rate_limit[0] == control.rate_limit
    # Nothing lost, nothing twice: once the subscriber reads on, it gets every message offered,
    # in order.
    for _ in range(2000):
        pair.subscriber.poll(lambda data, header: pair.received.append(bytes(data)), 1 << 20)
        if len(pair.received) >= offered:
            break
        pair.run_until(pair.now + 1 * MS)
    assert pair.received == [numbered(i) for i in range(offered)]
    assert pair.image.rcv_pos >= pair.sub_position[0]


def test_a_sender_without_rc_announces_nothing_and_its_receiver_never_signals(
        shm: Path) -> None:
    pair = Pair(shm, term_length=1 << 20)
    run_slow_subscriber(pair, messages_per_ms=10, ms=300)
    assert not pair.frames("p2r", RateAnnounce)
    assert pair.image.rate_signaller is None
    assert not pair.frames("r2p", RateSignal)
    assert pair.publication.c.rate_limit == 0


def test_the_sender_announces_at_once_to_a_new_receiver_and_every_second(shm: Path) -> None:
    pair = Pair(shm, uri=URI + "|rc=nak-strength,thresholds:60/90,window:20ms",
                term_length=1 << 20)
    pair.run_until(2500 * MS)
    announces = pair.frames("p2r", RateAnnounce)
    first_sm = pair.frames("r2p", StatusMessage)[0][0]
    times = [t for t, _ in announces]
    assert times[0] == 0 and first_sm in times  # with the first SETUP, and to the receiver
    assert [b - a for a, b in itertools.pairwise(times[1:])] == [1000 * MS] * (len(times) - 2)
    assert announces[-1][1] == RateAnnounce(77, 1001, 20_000, (60, 90))
    assert decode(announces[-1][1].encode()) == announces[-1][1]
    signaller = pair.image.rate_signaller
    assert signaller is not None and signaller.thresholds == (60, 90)


def test_an_announcement_from_another_address_than_the_images_sender_is_ignored(
        shm: Path) -> None:
    pair = Pair(shm, term_length=1 << 20)
    pair.run_until(1 * MS)
    announce = RateAnnounce(77, 1001, 50_000, (50,)).encode()
    pair.receive.on_control(announce, ("10.9.9.9", 40001), pair.now)
    assert pair.image.rate_signaller is None
    pair.receive.on_control(announce, SENDER, pair.now)
    assert pair.image.rate_signaller is not None


@pytest.mark.parametrize("uri", [URI, URI + "|rc=nak-strength"])
def test_rate_control_changes_nothing_for_a_subscriber_that_keeps_up(shm: Path,
                                                                      uri: str) -> None:
    pair = Pair(shm, uri=uri, term_length=1 << 20)
    pair.run_until(1 * MS)
    payloads = [bytes([i % 251]) * 900 for i in range(3000)]
    for i in range(0, len(payloads), 100):
        for payload in payloads[i:i + 100]:
            assert pair.offer(payload) > 0
        pair.run_until(pair.now + 1 * MS)
    pair.run_until(pair.now + 10 * MS)
    assert pair.received == payloads
    assert not pair.frames("r2p", RateSignal)
    assert pair.publication.c.rate_limit == 0
