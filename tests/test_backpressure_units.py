"""The sans-I/O parts of back pressure: the rate-limit token bucket and the watermark episodes,
under hypothesis."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from slipstream.client.policy import TokenBucket
from slipstream.daemon.pressure.episodes import BackPressureEpisodes

takes = st.lists(st.tuples(st.integers(0, 5_000_000),  # ns the caller idles before asking
                           st.integers(1, 300),  # messages
                           st.integers(1, 200_000)),  # bytes
                 min_size=1, max_size=60)


@given(rate=st.integers(1, 100_000), byte_rate=st.integers(1_000, 10**9),
       burst_ns=st.integers(1_000, 100_000_000), takes=takes)
@settings(max_examples=200, deadline=None)
def test_a_bucket_never_lets_more_out_than_its_rate_and_burst_allow(
        rate: int, byte_rate: int, burst_ns: int, takes: list[tuple[int, int, int]]) -> None:
    now = start = 10**12
    bucket = TokenBucket(rate, byte_rate, burst_ns, now)
    capacity, byte_capacity = max(1.0, rate * burst_ns / 1e9), max(1.0, byte_rate * burst_ns / 1e9)
    sent = sent_bytes = 0
    largest = largest_bytes = 0.0
    for idle, messages, length in takes:
        now += idle
        for _ in range(3):  # the delay it gives is enough: at most a rounding step more
            delay = bucket.delay_ns(now, messages, length)
            if not delay:
                break
            now += delay
        assert delay == 0
        bucket.take(messages, length)
        sent += messages
        sent_bytes += length
        largest, largest_bytes = max(largest, messages), max(largest_bytes, length)
        elapsed = (now - start) / 1e9
        # What went out is at most a full bucket, the rate since, and one batch's overdraft.
        assert sent <= capacity + rate * elapsed + max(0.0, largest - capacity) + 1e-6 * sent
        assert sent_bytes <= (byte_capacity + byte_rate * elapsed
                              + max(0.0, largest_bytes - byte_capacity) + 1e-6 * sent_bytes)


def test_a_saturated_bucket_keeps_its_rate_over_time() -> None:
    now = 0
    bucket = TokenBucket(1_000, None, 10_000_000, now)
    sent = 0
    while now < 2_000_000_000:
        now += bucket.delay_ns(now, 1, 100)
        bucket.take(1, 100)
        sent += 1
    assert 2_000 <= sent <= 2_011  # 2 s at 1,000/s, plus the 10 ms bucket it started with


samples = st.lists(st.tuples(st.integers(0, 3_000_000),  # ns since the last sample
                             st.integers(0, 40_000),  # bytes in use (clipped to the window)
                             st.booleans(),  # a publisher met the limit since
                             st.booleans()),  # connected
                   min_size=1, max_size=80)


@given(high=st.integers(1, 100), low_fraction=st.floats(0, 0.99), samples=samples)
@settings(max_examples=300, deadline=None)
def test_episodes_alternate_and_follow_the_watermarks(
        high: int, low_fraction: float, samples: list[tuple[int, int, bool, bool]]) -> None:
    low = int(high * low_fraction)
    window = 32_768
    episodes = BackPressureEpisodes(window, high, low)
    now = 1_000
    limit = window
    open_since = None
    starts = 0
    hit_position = hit_ns = 0  # what the appenders left in the log: the last limit met
    for elapsed, depth, met, connected in samples:
        now += elapsed + 1
        limit += 1_000
        producer = limit - window + depth
        if met:
            hit_position, hit_ns = limit, now - elapsed // 2
        events = episodes.sample(now, producer, limit, connected, hit_position, hit_ns)
        clipped = min(depth, window) if connected else 0
        for event in events:
            if event.started:
                assert open_since is None, "a start while one is open"
                starts += 1
                open_since = event.at_ns
                assert event.episodes == starts
            else:
                assert open_since is not None, "an end without a start"
                assert event.duration_ns == event.at_ns - open_since
                assert not connected or clipped <= episodes.low
                open_since = None
        # It is in an episode exactly when the watermarks say it must be.
        if connected and (clipped >= episodes.high or met):
            assert episodes.is_open
        if not connected or (clipped <= episodes.low and not met):
            assert not episodes.is_open
        assert episodes.depth == clipped and episodes.peak >= clipped
    assert episodes.episodes == starts




def test_a_drained_network_stream_ends_its_episode_below_a_low_watermark_of_an_eighth() -> None:
    # A network stream's pub-lmt moves in steps of an eighth of a window, so it may lag snd-pos
    # by almost that much: the depth is measured from snd-pos, and a drained stream is at 0.
    window = 32_768
    episodes = BackPressureEpisodes(window, 100, 5)  # low: 5 %, under an eighth
    assert episodes.sample(1_000, window, window, True, window, 900, window_start=0)[0].started
    sent = 10 * window
    lagging_limit = sent + window - window // 8 + 1024  # the last step was 7/8 of a window ago
    ended = episodes.sample(2_000, sent, lagging_limit, True, window, 900, window_start=sent)
    assert [event.started for event in ended] == [False] and not episodes.is_open
    assert episodes.depth == 0


# -- the pressure governor's ladder --------------------------------------------------------------

def test_the_ladder_climbs_one_step_a_sample_and_the_top_steps_need_sustained_pressure() -> None:
    from slipstream.daemon.pressure.governor import PressureGovernor

    governor = PressureGovernor()
    steps = []
    for _ in range(10):
        governor.sample(1.0)
        steps.append(governor.step)
    # 1, 2 at once; 3 after three samples above 0.8; 4 after three more above 0.95.
    assert steps == [1, 2, 2, 2, 3, 3, 3, 4, 4, 4]
    assert governor.climbs == 4 and governor.entries == [0, 1, 1, 1, 1]
    for pressure, step in ((0.85, 4), (0.79, 3), (0.7, 3), (0.59, 2), (0.35, 2), (0.29, 1),
                           (0.15, 1), (0.05, 0)):
        governor.sample(pressure)
        assert governor.step == step, (pressure, governor.step)
    assert governor.descents == 4


def test_step_2_widens_keepalives_to_a_fifth_of_the_shortest_sender_timeout() -> None:
    """Four times status_message_timeout at most, a fifth of the shortest of the receiving
    driver's sender timeouts at most, and never below status_message_timeout."""
    from slipstream.daemon.pressure.governor import widest_status_interval_ns

    ms, s = 1_000_000, 1_000_000_000
    assert widest_status_interval_ns(200 * ms, (5 * s, 5 * s)) == 1 * s  # x4 fits: 800 ms
    assert widest_status_interval_ns(200 * ms, (1 * s, 5 * s)) == 200 * ms
    assert widest_status_interval_ns(200 * ms, (5 * s, 2 * s)) == 400 * ms
    assert widest_status_interval_ns(500 * ms, (1 * s, 1 * s)) == 500 * ms


def test_a_climb_is_the_lags_only_where_the_lag_is_the_largest_signal() -> None:
    """GOVERNOR_LAG_CLIMBS counts the climbs the machine's lateness led, not those of the
    driver's own send backlog or busy threads (a busy ratio counts half)."""
    from slipstream.daemon.pressure.governor import LAG_CEILING_NS, LAG_FLOOR_NS, is_lag_led

    half_lag_ns = (LAG_FLOOR_NS + LAG_CEILING_NS) / 2  # a lag signal of 0.5
    assert is_lag_led(0.0, half_lag_ns, 0.0)
    assert is_lag_led(0.5, half_lag_ns, 0.9)  # a tie is the lag's; busy 0.9 counts 0.45
    assert not is_lag_led(0.6, half_lag_ns, 0.0)
    assert not is_lag_led(0.0, half_lag_ns, 1.2)
    assert not is_lag_led(0.3, 0, 0.0)  # no lag at all


def test_a_calm_governor_samples_once_a_second_and_any_pressure_brings_back_100_ms() -> None:
    from slipstream.daemon.pressure.governor import (
        CALM_SAMPLE_INTERVAL_NS,
        LADDER,
        SAMPLE_INTERVAL_NS,
        PressureGovernor,
    )

    governor = PressureGovernor()
    assert governor.sample_interval_ns() == CALM_SAMPLE_INTERVAL_NS  # before any sample
    governor.sample(LADDER[0].leave)  # not below the first rung's leave mark: watched
    assert governor.step == 0 and governor.sample_interval_ns() == SAMPLE_INTERVAL_NS
    governor.sample(0.0)
    assert governor.sample_interval_ns() == CALM_SAMPLE_INTERVAL_NS
    governor.sample(1.0)
    governor.sample(1.0)  # two climbs
    governor.sample(0.0)  # one step down at a time: still on a step, still watched
    assert governor.step == 1 and governor.sample_interval_ns() == SAMPLE_INTERVAL_NS
    governor.sample(0.0)
    assert governor.step == 0 and governor.sample_interval_ns() == CALM_SAMPLE_INTERVAL_NS


@given(st.lists(st.floats(0, 1), max_size=200))
@settings(max_examples=300, deadline=None)
def test_the_ladder_moves_one_step_at_a_time_and_only_past_its_thresholds(
        pressures: list[float]) -> None:
    from slipstream.daemon.pressure.governor import LADDER, TOP_STEP, PressureGovernor

    governor = PressureGovernor()
    above = 0
    for pressure in pressures:
        before = governor.step
        change = governor.sample(pressure)
        assert governor.step == before + change and change in (-1, 0, 1)
        assert 0 <= governor.step <= TOP_STEP
        if change > 0:
            rung = LADDER[before]
            assert pressure > rung.enter
            if rung.samples > 1:
                assert above >= rung.samples - 1
        if change < 0:
            assert pressure < LADDER[governor.step].leave
        above = above + 1 if before < TOP_STEP and change == 0 and \
            pressure > LADDER[before].enter else 0
    assert governor.climbs - governor.descents == governor.step


def test_a_network_threads_lag_is_news_only_while_its_last_timed_wake_up_is_recent() -> None:
    """A thread that stopped parking on its timer (busy, or woken by its sockets) keeps its
    last smoothed lag; it must not hold the ladder up once that sample is old."""
    from slipstream.daemon.pressure.governor import (
        LAG_FLOOR_NS,
        LAG_MAX_AGE_NS,
        pressure_of,
        recent_lag_ns,
    )

    stalled = 25_900_000  # what a review saw stick after a few seconds of CPU hogs
    assert recent_lag_ns(stalled, 1_000, 1_000 + LAG_MAX_AGE_NS) == stalled
    assert pressure_of(0.0, recent_lag_ns(stalled, 1_000, 1_000 + LAG_MAX_AGE_NS), 0.0) == 1.0
    assert recent_lag_ns(stalled, 1_000, 1_001 + LAG_MAX_AGE_NS) == 0
    assert pressure_of(0.0, recent_lag_ns(stalled, 1_000, 1_001 + LAG_MAX_AGE_NS), 0.0) == 0.0
    assert recent_lag_ns(LAG_FLOOR_NS, 0, 10**12) == 0  # none since the start: no news
