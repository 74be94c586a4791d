"""LossDetectorTest: gap scanning on a real term, NAK timing, delay generators."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from slipstream.client._native import ffi
from slipstream.client.layout import (
    CURRENT_VERSION,
    FRAME_HEADER,
    HDR_TYPE_DATA,
    NO_DEADLINE,
    UNFRAGMENTED,
)
from slipstream.daemon.protocol.loss_detector import (
    MAX_GAPS,
    LossDetector,
    OptimalMulticastDelayGenerator,
    StaticDelayGenerator,
)

TERM = 64 * 1024
BITS = 16
INITIAL = 7
US = 1000
MS = 1_000_000


def make_term():
    buf = ffi.new("uint8_t[]", TERM)
    return buf


def put_frame(term, offset: int, length: int = 64) -> None:
    header = FRAME_HEADER.pack(length, CURRENT_VERSION, UNFRAGMENTED, HDR_TYPE_DATA)
    ffi.memmove(term + offset, header, len(header))


def detector():
    losses: list[tuple[int, int, int]] = []
    d = LossDetector(StaticDelayGenerator(100 * US, 10 * MS),
                     lambda *a: losses.append(a))
    return d, losses


def test_no_gap_advances_to_hwm() -> None:
    term = make_term()
    for off in range(0, 640, 64):
        put_frame(term, off)
    d, losses = detector()
    assert d.scan(term, 0, 640, 0, TERM, BITS, INITIAL) == (640, False)
    assert not losses and d.next_deadline_ns() == NO_DEADLINE


def test_gap_naked_after_delay_then_retried() -> None:
    term = make_term()
    put_frame(term, 0)
    put_frame(term, 192)
    d, losses = detector()
    assert d.scan(term, 0, 256, 0, TERM, BITS, INITIAL) == (64, True)
    assert not losses
    assert d.next_deadline_ns() == 100 * US
    d.scan(term, 0, 256, 100 * US - 1, TERM, BITS, INITIAL)
    assert not losses
    d.scan(term, 0, 256, 100 * US, TERM, BITS, INITIAL)
    assert losses == [(INITIAL, 64, 128)]
    assert d.next_deadline_ns() == 100 * US + 10 * MS
    d.scan(term, 0, 256, 100 * US + 10 * MS, TERM, BITS, INITIAL)
    assert len(losses) == 2
    # Filled: no more NAKs, timer off.
    put_frame(term, 64, 128)
    assert d.scan(term, 0, 256, 20 * MS, TERM, BITS, INITIAL) == (256, False)
    assert d.next_deadline_ns() == NO_DEADLINE


def test_every_gap_of_the_window_is_naked_on_its_own_timer() -> None:
    term = make_term()
    put_frame(term, 0)
    put_frame(term, 128)
    put_frame(term, 256)
    d, losses = detector()
    assert d.scan(term, 0, 320, 0, TERM, BITS, INITIAL) == (64, True)
    assert d.next_deadline_ns() == 100 * US  # both gaps (64 and 192) seen at once
    d.scan(term, 0, 320, 100 * US, TERM, BITS, INITIAL)
    assert losses == [(INITIAL, 64, 64), (INITIAL, 192, 64)]
    put_frame(term, 64)  # the first is filled: the second keeps its timer
    assert d.scan(term, 0, 320, 150 * US, TERM, BITS, INITIAL) == (192, True)
    assert d.next_deadline_ns() == 100 * US + 10 * MS
    put_frame(term, 384)
    put_frame(term, 512)  # a new gap at 448 starts its own timer
    d.scan(term, 0, 576, 200 * US, TERM, BITS, INITIAL)
    assert d.gaps[(INITIAL, 448)][0] == 300 * US
    assert d.next_deadline_ns() == 300 * US


def test_at_most_max_gaps_are_tracked_at_once() -> None:
    term = make_term()
    for off in range(0, 64 * 2 * (MAX_GAPS + 5), 128):
        put_frame(term, off)  # a frame, a gap, a frame, a gap, ...
    d, losses = detector()
    d.scan(term, 0, 64 * 2 * (MAX_GAPS + 5), 0, TERM, BITS, INITIAL)
    d.scan(term, 0, 64 * 2 * (MAX_GAPS + 5), 100 * US, TERM, BITS, INITIAL)
    assert len(d.gaps) == MAX_GAPS and len(losses) == MAX_GAPS


def test_gap_in_term_beyond_hwm_term_scans_to_term_end() -> None:
    term = make_term()
    put_frame(term, 0)
    d, losses = detector()
    offset, found = d.scan(term, 0, TERM + 64, 0, TERM, BITS, INITIAL)
    assert (offset, found) == (64, True)
    d.scan(term, 0, TERM + 64, 100 * US, TERM, BITS, INITIAL)
    assert losses == [(INITIAL, 64, TERM - 64)]


def naked_once(frames: tuple[int, ...], limit: int, *, adapt: bool = True):
    """A term holding 64-byte frames at ``frames`` and a detector (100 µs first delay, 10 ms
    retry ceiling) whose scans up to ``limit`` at 0 and 100 µs found its gaps and NAKed each
    once, at 100 µs; and the losses it reported."""
    term = make_term()
    for offset in frames:
        put_frame(term, offset)
    losses: list[tuple[int, int, int]] = []
    d = LossDetector(StaticDelayGenerator(100 * US, 10 * MS), lambda *a: losses.append(a),
                     adapt_retry=adapt)
    d.scan(term, 0, limit, 0, TERM, BITS, INITIAL)
    d.scan(term, 0, limit, 100 * US, TERM, BITS, INITIAL)
    return term, d, losses


def test_a_unicast_gap_is_naked_again_after_the_measured_repair_time() -> None:
    """The repair of a gap NAKed once (NAK at 100 µs, filled by the scan at 400 µs) is a
    300 µs sample: srtt 300, rttvar 150, so the next gap's retry comes 300 + 4 x 150 = 900 µs
    after its NAK, not after the 10 ms ceiling."""
    term, d, losses = naked_once((0, 128), 192)
    assert losses == [(INITIAL, 64, 64)] and d.repair_time_ns is None
    assert d.next_deadline_ns() == 100 * US + 10 * MS  # nothing measured yet: the ceiling
    put_frame(term, 64)
    assert d.scan(term, 0, 192, 400 * US, TERM, BITS, INITIAL) == (192, False)
    assert d.repair_time_ns == (300 * US, 150 * US)
    put_frame(term, 256)  # a new gap at 192
    d.scan(term, 0, 320, 1 * MS, TERM, BITS, INITIAL)
    d.scan(term, 0, 320, 1 * MS + 100 * US, TERM, BITS, INITIAL)
    assert losses[-1] == (INITIAL, 192, 64)
    assert d.next_deadline_ns() == 1 * MS + 100 * US + 900 * US
    d.scan(term, 0, 320, 2 * MS, TERM, BITS, INITIAL)
    assert len(losses) == 3  # NAKed again at 2 ms
    # Karn: this gap, NAKed twice, says nothing when it is filled.
    put_frame(term, 192)
    d.scan(term, 0, 320, 2 * MS + 50 * US, TERM, BITS, INITIAL)
    assert d.repair_time_ns == (300 * US, 150 * US)


def test_a_gap_naked_before_any_repair_was_measured_is_due_again_once_one_is() -> None:
    """The first losses of a stream are armed with the ceiling (nothing measured yet); the
    first repair measured brings the others' next NAK forward."""
    term, d, losses = naked_once((0, 128, 256), 320)  # gaps at 64 and 192
    assert len(losses) == 2 and d.next_deadline_ns() == 100 * US + 10 * MS
    put_frame(term, 64)
    d.scan(term, 0, 320, 400 * US, TERM, BITS, INITIAL)  # 300 µs: retry 900 µs
    assert d.next_deadline_ns() == 100 * US + 900 * US
    d.scan(term, 0, 320, 1 * MS, TERM, BITS, INITIAL)
    assert losses[-1] == (INITIAL, 192, 64) and len(losses) == 3


def test_a_gap_whose_front_alone_arrived_is_still_the_same_loss() -> None:
    """A resend of several frames whose first arrived before the scan: no repair time is
    measured (the rest is still coming), and the rest keeps the gap's timer, not a fresh
    first delay and NAK."""
    term, d, losses = naked_once((0, 256), 320)  # a gap at 64..256
    put_frame(term, 64)
    d.scan(term, 0, 320, 150 * US, TERM, BITS, INITIAL)
    assert d.repair_time_ns is None and d.new_gaps == 0
    assert d.gaps == {(INITIAL, 128): (100 * US + 10 * MS, 128)}
    d.scan(term, 0, 320, 300 * US, TERM, BITS, INITIAL)
    assert losses == [(INITIAL, 64, 192)]  # not NAKed again as a new gap


def test_the_adapted_retry_stays_between_the_first_delay_and_the_ceiling() -> None:
    for repair_ns, retry_ns in ((10 * US, 100 * US), (5 * MS, 10 * MS)):
        term, d, _ = naked_once((0, 128), 192)
        put_frame(term, 64)
        # The rebuild position reached the high-water mark: every gap was filled.
        d.scan(term, 192, 192, 100 * US + repair_ns, TERM, BITS, INITIAL)
        assert d.repair_time_ns == (repair_ns, repair_ns // 2)
        assert d.retry_delay_ns() == retry_ns


def test_a_gap_left_in_a_finished_term_is_a_repair_and_multicast_keeps_its_backoff() -> None:
    """A gap of the last term, filled as the rebuild position moves on to the next, is
    measured; a detector without adapt_retry (a multicast image's) measures too, but keeps
    its generator's retry delay."""
    for adapt in (True, False):
        _, d, _ = naked_once((0, 128), 192, adapt=adapt)
        following = make_term()
        put_frame(following, 64)  # the next term: a gap at 0
        d.scan(following, TERM, TERM + 128, 300 * US, TERM, BITS, INITIAL)
        assert d.repair_time_ns == (200 * US, 100 * US)
        assert d.retry_delay_ns() == (600 * US if adapt else 10 * MS)
        assert list(d.gaps) == [(INITIAL + 1, 0)]


def test_optimal_multicast_delay_in_range_and_reproducible() -> None:
    g1 = OptimalMulticastDelayGenerator(10 * MS, 10, random.Random(5))
    g2 = OptimalMulticastDelayGenerator(10 * MS, 10, random.Random(5))
    values = [g1.first_delay() for _ in range(2000)]
    assert values == [g2.first_delay() for _ in range(2000)]
    assert all(0 <= v < 10 * MS for v in values)
    # Truncated exponential skewed late: most receivers wait, a few answer early.
    assert sum(values) / len(values) > 5 * MS
    assert min(values) < 1 * MS


def test_each_gap_reaches_the_loss_report_once_when_first_seen() -> None:
    term = make_term()
    for off in (0, 128, 320):
        put_frame(term, off)  # gaps at 64 (64 bytes) and 192 (128 bytes)
    seen: list[tuple[int, int]] = []
    d = LossDetector(StaticDelayGenerator(100 * US, 10 * MS), lambda *a: None,
                     lambda length, count: seen.append((length, count)))
    d.scan(term, 0, 384, 0, TERM, BITS, INITIAL)
    d.scan(term, 0, 384, 200 * US, TERM, BITS, INITIAL)
    assert seen == [(192, 2)]
    put_frame(term, 384)
    put_frame(term, 512)  # a third gap, at 448
    d.scan(term, 0, 576, 300 * US, TERM, BITS, INITIAL)
    assert seen == [(192, 2), (64, 1)]


def test_delays_are_drawn_only_once_a_scan_used_them() -> None:
    """The multicast generator's draws (a random number and a logarithm each) cost the
    receiver's thread: a scan that finds no new gap and NAKs none draws nothing."""
    draws: list[str] = []

    class Counting(StaticDelayGenerator):
        def first_delay(self) -> int:
            draws.append("first")
            return super().first_delay()

        def retry_delay(self) -> int:
            draws.append("retry")
            return super().retry_delay()

    term = make_term()
    put_frame(term, 0)
    put_frame(term, 128)  # a gap at 64
    d = LossDetector(Counting(100 * US, 10 * MS), lambda *a: None)
    assert draws == ["first", "retry"]  # one of each, ready for the first scan
    d.scan(term, 0, 192, 0, TERM, BITS, INITIAL)  # the gap is new: a first delay is used
    assert draws == ["first", "retry", "first"]
    d.scan(term, 0, 192, 50 * US, TERM, BITS, INITIAL)  # nothing new, nothing due
    assert draws == ["first", "retry", "first"]
    d.scan(term, 0, 192, 100 * US, TERM, BITS, INITIAL)  # NAKed: a retry delay is used
    assert draws == ["first", "retry", "first", "retry"]


def reference_gaps(present: set[int], rebuild: int, limit: int) -> list[tuple[int, int]]:
    """The gaps of a term of 64-byte frames (``present``: their offsets) between ``rebuild``
    and ``limit``, in stream order, as (offset, length)."""
    gaps: list[tuple[int, int]] = []
    offset = rebuild
    while offset < limit:
        if offset in present:
            offset += 64
            continue
        start = offset
        while offset < limit and offset not in present:
            offset += 64
        gaps.append((start, offset - start))
    return gaps


def c_div(a: int, b: int) -> int:
    """C's integer division (toward zero)."""
    return abs(a) // b * (1 if a >= 0 else -1)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sets(st.integers(0, 63)), st.integers(0, 300)),
                min_size=1, max_size=12), st.booleans())
def test_scans_track_every_gap_with_its_own_timer_as_frames_arrive(
        passes: list[tuple[set[int], int]], adapt: bool) -> None:
    """Frames land anywhere below a rising high-water mark between scans: each scan reports
    exactly the gaps below it (up to MAX_GAPS), a gap at an offset seen before keeps its timer,
    a new one starts it, and a gap is NAKed when its timer expires, then re-armed; with
    ``adapt``, re-armed after the repair time measured from the gaps NAKed once and filled."""
    term = make_term()
    present: set[int] = set()
    losses: list[tuple[int, int, int]] = []
    d = LossDetector(StaticDelayGenerator(100 * US, 10 * MS), lambda *a: losses.append(a),
                     adapt_retry=adapt)
    expiry: dict[int, int] = {}
    naked: dict[int, tuple[int, int]] = {}  # offset -> (NAKs, last NAK)
    lengths: dict[int, int] = {}  # offset -> length, of the gaps tracked
    srtt = rttvar = samples = 0

    def retry(naks: int) -> int:
        """The wait after a gap's ``naks``-th NAK."""
        if not adapt or not samples:
            return 10 * MS
        return min(min(max(srtt + 4 * rttvar, 100 * US), 10 * MS) << (naks - 1), 10 * MS)

    now = 0
    limit = 0
    for arrivals, step_us in passes:
        now += step_us * US
        for slot in arrivals:
            if slot * 64 not in present:
                put_frame(term, slot * 64)
                present.add(slot * 64)
        limit = max([limit, *(slot * 64 + 64 for slot in arrivals)])
        losses.clear()
        offset, found = d.scan(term, 0, limit, now, TERM, BITS, INITIAL)
        expected = reference_gaps(present, 0, limit)[:MAX_GAPS]
        assert found == bool(expected)
        assert offset == (expected[0][0] if expected else limit)
        # Walk the gaps tracked before against this scan's (C's rule): one walked past was
        # filled (a repair, if NAKed once), unless this gap lies inside it (its front alone
        # arrived: adapting, this gap inherits its timer and NAK count).
        previous = sorted(expiry)
        inherited: dict[int, int] = {}  # new gap -> the tracked gap it carries on
        j = 0

        def sample(start: int, now: int = now, naked: dict = naked) -> None:
            nonlocal srtt, rttvar, samples
            count, at = naked.get(start, (0, 0))
            if count == 1 and now > at:
                value = now - at
                if samples == 0:
                    srtt, rttvar = value, value // 2
                else:
                    rttvar += c_div(abs(srtt - value) - rttvar, 4)
                    srtt += c_div(value - srtt, 8)
                samples += 1

        for start, _ in expected:
            front = None
            while j < len(previous) and previous[j] < start:
                old = previous[j]
                j += 1
                if start < old + lengths[old]:
                    front = old
                else:
                    sample(old)
            if j < len(previous) and previous[j] == start:
                j += 1
            elif front is not None and adapt:
                inherited[start] = front
        for old in previous[j:]:
            sample(old)
        due = []
        next_expiry = {}
        next_naked = {}
        for start, length in expected:
            if start in expiry:
                deadline, state = expiry[start], naked.get(start)
            elif start in inherited:
                deadline, state = expiry[inherited[start]], naked.get(inherited[start])
            else:
                deadline, state = now + 100 * US, None
            if state is not None and adapt:  # due again after the current retry delay
                deadline = min(deadline, state[1] + retry(state[0]))
            if now >= deadline:
                due.append((INITIAL, start, length))
                count = (state or (0, 0))[0] + 1
                state = (count, now)
                deadline = now + retry(count)
            next_expiry[start] = deadline
            if state is not None:
                next_naked[start] = state
        expiry = next_expiry
        naked = next_naked
        lengths = dict(expected)
        assert losses == due
        assert d.gaps == {(INITIAL, s): (expiry[s], n) for s, n in expected}
        assert d.next_deadline_ns() == min(expiry.values(), default=NO_DEADLINE)
        assert d.repair_time_ns == ((srtt, rttvar) if samples else None)
