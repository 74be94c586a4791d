"""Publication back-pressure policies (block, drop-newest, error, rate-limit) and the driver's
back-pressure episodes, on real drivers over IPC and UDP loopback."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import NETWORK_SETTINGS, Collector, counters_of, free_port, message, wait_for

from slipstream.client import (
    BACK_PRESSURED,
    CLOSED,
    NOT_CONNECTED,
    BackPressuredError,
    Client,
    policy,
)
from slipstream.client.channel import PolicySpec, parse_policy
from slipstream.client.counters import CountersFile, CounterType
from slipstream.client.errors import ChannelError
from slipstream.client.layout import META_PUBLISHER_WAITERS
from slipstream.client.policy import BackPressureEpisode

IPC = "aeron:ipc?term-length=64k"
WINDOW = 32 * 1024  # a 64 KiB term's publication window


class SlowReader:
    """A thread that polls a subscription into a Collector, ``per_poll`` messages at most
    every ``pause`` seconds, until it has ``count`` or is stopped."""

    def __init__(self, subscription, count: int, *, per_poll: int = 10,
                 pause: float = 0.0005, collector: Collector | None = None) -> None:
        self.collector = collector if collector is not None else Collector(subscription)
        self.count = count
        self.stop = threading.Event()
        self._per_poll = per_poll
        self._pause = pause
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        seen = self.collector.seen
        while len(seen) < self.count and not self.stop.is_set():
            self.collector.subscription.poll(self.collector.on_message, self._per_poll)
            time.sleep(self._pause)

    def join(self, timeout: float = 30.0) -> None:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"the reader has {len(self.collector.seen)}"


class ValueCollector(Collector):
    """A Collector that also keeps each message's reserved value, by sequence number."""

    def __init__(self, subscription) -> None:
        super().__init__(subscription)
        self.values: dict[int, int] = {}

    def on_message(self, data: memoryview, header) -> None:
        super().on_message(data, header)
        self.values[self.seen[-1]] = header.reserved_value


def reserved(i: int) -> int:
    """A reserved value for message ``i``, anywhere in the int64 range (negatives too)."""
    return (i * 0x9E3779B97F4A7C15) % 2**64 - 2**63


def counter_value(client: Client, type_id: int, stream_id: int) -> int:
    return next(info.value for info in client.counters
                if info.type_id == type_id and info.stream_id == stream_id)


@pytest.fixture
def network_client(driver_dir: Path) -> Iterator[Client]:
    from slipstream.daemon.driver import MediaDriver

    with MediaDriver.launch(directory=driver_dir, **NETWORK_SETTINGS) as driver, \
            Client.connect(driver.directory) as connected:
        yield connected


# -- block -----------------------------------------------------------------------------------

def test_block_waits_for_a_slow_subscriber_over_many_windows_and_loses_nothing(client) -> None:
    pub = client.add_publication(IPC, 11, policy="block,timeout:20s")
    sub = client.add_subscription(IPC, 11)
    wait_for(lambda: pub.is_connected, what="connected")
    count = 8_000  # 8,000 x 128 B: 31 windows, 15 term rotations
    reader = SlowReader(sub, count)
    results = [pub.offer(message(i, 96)) for i in range(count)]
    reader.join()
    assert min(results) > 0, "an offer under block returned a code"
    reader.collector.assert_exactly(count)
    assert counter_value(client, CounterType.BP_EPISODES, 11) >= 1


def test_block_raises_after_its_timeout_naming_the_stream(client) -> None:
    pub = client.add_publication(IPC, 12, policy="block,timeout:300ms")
    client.add_subscription(IPC, 12)  # never read: the window fills
    wait_for(lambda: pub.is_connected, what="connected")
    accepted = 0
    started = time.monotonic()
    with pytest.raises(BackPressuredError) as info:
        while True:
            assert pub.offer(message(accepted, 96)) > 0
            accepted += 1
    waited = time.monotonic() - started
    assert accepted * 128 >= WINDOW  # it took a window first
    error = info.value
    assert error.connected and error.stream_id == 12 and error.policy == "block,timeout:300ms"
    assert 0.3 <= error.waited_s <= waited
    assert "stream 12" in str(error) and "a window behind" in str(error)


def test_block_short_of_a_min_group_says_the_group_is_not_complete(network_client) -> None:
    """One receiver of the two fc=min,g:/2 waits for: it is not 'no subscriber'."""
    channel = f"aeron:udp?endpoint=224.0.1.9:{free_port()}|interface=127.0.0.1"
    pub = network_client.add_publication(channel + "|fc=min,g:/2", 15,
                                         policy="block,timeout:200ms")
    sub = network_client.add_subscription(channel, 15)
    wait_for(lambda: sub.images, what="the receiver's image")
    with pytest.raises(BackPressuredError) as info:
        pub.offer(b"one of two")
    assert not info.value.connected
    assert "fewer receivers than min or tagged flow control waits for" in str(info.value)

def test_block_waits_for_a_subscriber_to_connect(client) -> None:
    pub = client.add_publication(IPC, 13, policy="block,timeout:5s")
    joined = threading.Timer(0.3, lambda: client.add_subscription(IPC, 13))
    joined.start()
    started = time.monotonic()
    assert pub.offer(b"first") > 0
    assert time.monotonic() - started >= 0.25
    joined.join()


def test_block_without_a_subscriber_says_none_is_connected(client) -> None:
    pub = client.add_publication(IPC, 14, policy="block,timeout:100ms")
    with pytest.raises(BackPressuredError) as info:
        pub.offer(b"nobody")
    assert not info.value.connected and "no subscriber is connected" in str(info.value)


def test_a_parked_block_offer_returns_closed_when_another_thread_closes(
        client, monkeypatch: pytest.MonkeyPatch) -> None:
    # A park slice far longer than the bound below: only close's wake frees the offer in time.
    slice_s = 60
    monkeypatch.setattr(policy, "_PARK_SLICE_NS", slice_s * 1_000_000_000)
    pub = client.add_publication(IPC, 15, policy="block,timeout:30s")
    client.add_subscription(IPC, 15)
    wait_for(lambda: pub.is_connected, what="connected")
    while pub.offer(b"x" * 96) > 0 and pub.position < WINDOW:
        pass
    results: list[int] = []
    offerer = threading.Thread(target=lambda: results.append(pub.offer(b"x" * 96)))
    offerer.start()
    wait_for(lambda: pub._log.meta_i32(META_PUBLISHER_WAITERS) > 0, what="the offer parked")
    assert offerer.is_alive() and not results
    started = time.monotonic()
    pub.close()
    offerer.join(slice_s / 4)
    assert results == [CLOSED] and time.monotonic() - started < slice_s / 4


def test_block_offer_batch_puts_the_whole_batch_in_across_windows(client) -> None:
    pub = client.add_publication(IPC, 16, policy="block,timeout:20s")
    sub = client.add_subscription(IPC, 16)
    wait_for(lambda: pub.is_connected, what="connected")
    count = 3_000
    reader = SlowReader(sub, count, per_poll=50)
    batch = b"".join(message(i, 96) for i in range(count))
    assert pub.offer_batch(batch, [96] * count) == count  # 12 windows in one call
    reader.join()
    reader.collector.assert_exactly(count)


@pytest.mark.parametrize("spec", ["block,timeout:20s", "rate-limit,messages:100000,burst:10ms"])
def test_offers_a_policy_retries_keep_their_reserved_values(client, spec: str) -> None:
    """Under a policy that waits, an offer (and a batch) refused for credit is retried with
    the reserved value (values) it was given: a slow reader makes most of them wait."""
    stream_id = 18 if spec.startswith("block") else 19
    pub = client.add_publication(IPC, stream_id, policy=spec)
    sub = client.add_subscription(IPC, stream_id)
    wait_for(lambda: pub.is_connected, what="connected")
    singles, batched = 1_500, 1_500  # 6 windows each
    reader = SlowReader(sub, singles + batched, per_poll=20, collector=ValueCollector(sub))
    for i in range(singles):
        if i % 2:
            assert pub.offer(message(i, 96), reserved(i)) > 0
        else:
            assert pub.offer(message(i, 96), reserved_value=reserved(i)) > 0
    batch = b"".join(message(i, 96) for i in range(singles, singles + batched))
    values = [reserved(i) for i in range(singles, singles + batched)]
    assert pub.offer_batch(batch, [96] * batched, values) == batched  # across windows
    reader.join()
    reader.collector.assert_exactly(singles + batched)
    assert reader.collector.values == {i: reserved(i) for i in range(singles + batched)}


def test_block_over_udp_holds_to_the_receiver_and_loses_nothing(network_client) -> None:
    channel = f"aeron:udp?endpoint=127.0.0.1:{free_port()}|term-length=64k"
    pub = network_client.add_publication(channel + "|policy=block,timeout:20s", 17)
    sub = network_client.add_subscription(channel, 17)
    wait_for(lambda: pub.is_connected, what="connected")
    count = 6_000  # 768 KB through a 32 KiB window
    reader = SlowReader(sub, count, pause=0.001)
    results = [pub.offer(message(i, 96)) for i in range(count)]
    reader.join()
    assert min(results) > 0
    reader.collector.assert_exactly(count)


# -- drop-newest and error ----------------------------------------------------------------------

def test_drop_newest_returns_at_once_counts_the_drops_and_keeps_what_it_took(client) -> None:
    pub = client.add_publication(IPC + "|policy=drop-newest", 21)
    sub = client.add_subscription(IPC, 21)
    wait_for(lambda: pub.is_connected, what="connected")
    results = [pub.offer(message(i, 96)) for i in range(1_000)]  # 128 KB into 32 KiB
    accepted = sum(r > 0 for r in results)
    assert set(results[accepted:]) == {BACK_PRESSURED}, "drops come after what fitted"
    assert pub.dropped == 1_000 - accepted > 0
    assert counter_value(client, CounterType.PUBLISHER_DROPS, 21) == pub.dropped
    collector = Collector(sub)
    wait_for(lambda: collector.poll() == 0 and len(collector.seen) >= accepted, what="read")
    collector.assert_exactly(accepted)
    # Once read, credit comes back and offers go in again.
    wait_for(lambda: pub.offer(message(accepted, 96)) > 0, what="credit back")


def test_drop_newest_batch_returns_what_went_in_and_counts_the_rest(client) -> None:
    pub = client.add_publication(IPC, 22, policy="drop-newest")
    client.add_subscription(IPC, 22)
    wait_for(lambda: pub.is_connected, what="connected")
    done = pub.offer_batch(b"z" * 96 * 1_000, [96] * 1_000)
    assert 0 < done < 1_000 and pub.dropped == 1_000 - done
    assert counter_value(client, CounterType.PUBLISHER_DROPS, 22) == 1_000 - done


def test_drop_newest_without_a_subscriber_drops_with_not_connected(client) -> None:
    pub = client.add_publication(IPC, 23, policy="drop-newest")
    assert pub.offer(b"lost") == NOT_CONNECTED and pub.dropped == 1


def test_error_raises_at_once_when_the_window_is_full(client) -> None:
    pub = client.add_publication(IPC, 24, policy="error")
    client.add_subscription(IPC, 24)
    wait_for(lambda: pub.is_connected, what="connected")
    accepted = 0
    with pytest.raises(BackPressuredError) as info:
        while True:
            pub.offer(message(accepted, 96))
            accepted += 1
    assert info.value.waited_s == 0 and info.value.connected
    assert "at once" in str(info.value) and accepted * 128 >= WINDOW
    with pytest.raises(BackPressuredError) as batch:
        pub.offer_batch(b"b" * 96 * 4, [96] * 4)
    assert batch.value.appended == 0


# -- rate-limit -------------------------------------------------------------------------------

def assert_never_faster(starts: list[float], ends: list[float], amounts: list[int],
                        rate: float, capacity: float) -> None:
    """Offer k took its tokens at some time within [starts[k], ends[k]] (monotonic s).  A
    bucket of ``capacity`` refilled at ``rate`` per second, which lets an offer go only while
    it holds tokens, lets offers i..j-1 take at most capacity + rate × (grant j - grant i),
    so at most capacity + rate × (ends[j] - starts[i]) for every i < j: a bound that holds
    however late this thread ran, and that a burst beyond the bucket breaks.  O(n): the
    worst i for each j is the lowest prefix - rate × start before it."""
    taken = [0, *itertools.accumulate(amounts)]  # taken[k]: amounts[:k]
    lowest = float("inf")
    worst = float("-inf")
    for j in range(1, len(amounts)):
        lowest = min(lowest, taken[j - 1] - rate * starts[j - 1])
        worst = max(worst, taken[j] - rate * ends[j] - lowest)
    assert worst <= capacity * (1 + 1e-9) + 1e-6, (worst, capacity)


def test_rate_limit_never_exceeds_its_rate_and_delivers_everything(client) -> None:
    pub = client.add_publication(IPC, 31, policy="rate-limit,messages:4000,burst:10ms")
    sub = client.add_subscription(IPC, 31)
    wait_for(lambda: pub.is_connected, what="connected")
    count = 1_200
    reader = SlowReader(sub, count, per_poll=1000, pause=0.001)
    starts: list[float] = []
    ends: list[float] = []
    for i in range(count):
        starts.append(time.monotonic())
        assert pub.offer(message(i, 64)) > 0
        ends.append(time.monotonic())
    reader.join()
    reader.collector.assert_exactly(count)
    # The bucket holds 40 messages (10 ms of 4,000/s): no stretch of offers beats that.
    assert_never_faster(starts, ends, [1] * count, 4000, 40)
    assert ends[-1] - starts[0] >= (count - 40) / 4000 * 0.98


def test_rate_limit_by_bytes_paces_batches(client) -> None:
    pub = client.add_publication(IPC, 32, policy="rate-limit,bytes:200k,burst:10ms")
    sub = client.add_subscription(IPC, 32)
    wait_for(lambda: pub.is_connected, what="connected")
    reader = SlowReader(sub, 2_000, per_poll=1000, pause=0.001)
    starts: list[float] = []
    ends: list[float] = []
    for first in range(0, 2_000, 100):
        batch = b"".join(message(i, 100) for i in range(first, first + 100))
        starts.append(time.monotonic())
        assert pub.offer_batch(batch, [100] * 100) == 100
        ends.append(time.monotonic())
    reader.join()
    reader.collector.assert_exactly(2_000)
    # 200 KiB/s with 10 ms (2,048 bytes) of burst; a batch larger than that takes a full bucket
    # into debt, so the bound holds with the bucket's capacity as for single messages.
    assert_never_faster(starts, ends, [10_000] * 20, 204_800, 2_048)
    assert ends[-1] - starts[0] >= (200_000 - 2_048 - 10_000) / 204_800 * 0.98


def test_rate_limit_that_refuses_returns_back_pressured_when_the_bucket_is_empty(client) -> None:
    pub = client.add_publication(IPC, 33,
                                 policy="rate-limit,messages:100,burst:50ms,when-empty:refuse")
    client.add_subscription(IPC, 33)
    wait_for(lambda: pub.is_connected, what="connected")
    results = [pub.offer(b"m") for _ in range(20)]
    assert results[:5] == [r for r in results[:5] if r > 0]  # the bucket's 5 went
    assert BACK_PRESSURED in results and sum(r > 0 for r in results) <= 6
    time.sleep(0.06)
    assert pub.offer(b"m") > 0  # refilled


def test_a_rate_limit_offer_waiting_on_its_bucket_returns_closed_when_the_publication_closes(
        client) -> None:
    """A batch leaves the bucket in debt for seconds; an offer then waits on the bucket, and a
    close from another thread ends that wait (it had slept the whole debt out)."""
    pub = client.add_publication(IPC, 34, policy="rate-limit,messages:1")
    client.add_subscription(IPC, 34)
    wait_for(lambda: pub.is_connected, what="connected")
    debt_s = 6
    assert pub.offer_batch(b"x" * 60, [10] * debt_s) == debt_s  # at 1 message a second
    result: list[int] = []
    waiting = threading.Thread(target=lambda: result.append(pub.offer(b"next")))
    waiting.start()
    time.sleep(0.3)
    closed_at = time.monotonic()
    pub.close()
    waiting.join(timeout=10)
    # Ended by the close, not by sleeping the rest of the debt out.
    assert result == [CLOSED] and time.monotonic() - closed_at < (debt_s - 0.3) / 4


def test_a_rate_limit_timeout_bounds_the_wait_for_credit_not_the_pacing(client) -> None:
    """The bucket's wait is the rate asked for: two messages a second go one every 0.5 s
    under a 100 ms timeout (which bounds the wait for credit only)."""
    pub = client.add_publication(IPC, 35, policy="rate-limit,messages:2,burst:1ms,timeout:100ms")
    client.add_subscription(IPC, 35)
    wait_for(lambda: pub.is_connected, what="connected")
    started = time.monotonic()
    assert all(pub.offer(b"m") > 0 for _ in range(3))
    assert time.monotonic() - started >= 0.9  # paced: 0.5 s between messages
    # The wait for credit is what it bounds: a subscriber that reads nothing fills the window.
    fast = client.add_publication(IPC, 36, policy="rate-limit,messages:100000,timeout:100ms")
    client.add_subscription(IPC, 36)
    wait_for(lambda: fast.is_connected, what="connected")
    with pytest.raises(BackPressuredError):
        while True:
            fast.offer(bytes(1000))


# -- choosing a policy ---------------------------------------------------------------------------

def test_a_policy_given_in_the_uri_and_as_an_argument_must_agree(client) -> None:
    with pytest.raises(ChannelError) as info:
        client.add_publication(IPC + "|policy=error", 41, policy="drop-newest")
    assert info.value.part == "policy"
    pub = client.add_publication(IPC + "|policy=error", 41, policy="error")
    assert pub.policy == parse_policy("error")


@pytest.mark.parametrize("spec", [PolicySpec("bogus"), PolicySpec("block", timeout_ns=0),
                                  PolicySpec("block", timeout_ns=-5), PolicySpec("rate-limit")])
def test_a_policy_spec_made_by_hand_is_checked_as_its_uri_form_before_the_driver_is_asked(
        client, spec: PolicySpec) -> None:
    """A bad spec raised only as the publication was made (rate-limit without a rate, after
    the driver had made it: a publisher left behind) or not at all (an unknown name ran as
    no policy, a timeout of 0 or below was taken)."""
    with pytest.raises(ChannelError) as info:
        client.add_publication(IPC, 42, policy=spec)
    assert info.value.part == "policy"
    # No publisher of stream 42 was made: it would hold a pub-lmt counter.
    assert not [c for c in client.counters
                if c.type_id == CounterType.PUBLISHER_LIMIT and c.stream_id == 42]


@pytest.mark.parametrize(("text", "problem"), [
    ("wait", "is not block, drop-newest, error or rate-limit"),
    ("rate-limit", "needs messages"),
    ("drop-newest,timeout:1s", "takes no options"),
    ("block,timeout:soon", "timeout"),
    ("rate-limit,messages:10,when-empty:later", "is not wait or refuse"),
    ("rate-limit,messages:10,burst:0ms", "between 1us and 10s"),
    ("block,timeout:0", "that is policy=error"),  # (rate-limit's paces, then fails at once)
    ("rate-limit,messages:10,when-empty:refuse,timeout:1s", "never waits"),
])
def test_a_bad_policy_names_the_part_and_the_problem(text: str, problem: str) -> None:
    with pytest.raises(ChannelError) as info:
        parse_policy(text)
    assert info.value.part == "policy" and problem in str(info.value)


def test_the_uri_form_of_a_policy_prints_back_the_same() -> None:
    for text in ("block", "block,timeout:2s", "drop-newest", "error",
                 "rate-limit,messages:10,bytes:1024,burst:5ms,when-empty:refuse",
                 "rate-limit,messages:10,timeout:0ns"):  # paced, then at once under pressure
        assert str(parse_policy(text)) == text


# -- episodes -----------------------------------------------------------------------------------

def test_an_episode_begins_at_the_limit_and_ends_below_the_low_watermark(client) -> None:
    events: list[BackPressureEpisode] = []
    pub = client.add_publication(IPC, 51, policy="block,timeout:20s",
                                 on_back_pressure=events.append)
    sub = client.add_subscription(IPC, 51)
    wait_for(lambda: pub.is_connected, what="connected")
    while pub.position < WINDOW:  # fill the window: the next offer would wait
        assert pub.offer(b"f" * 96) > 0
    collector = Collector(sub)
    # One more offer parks: the episode starts when it meets the limit.
    parked = threading.Thread(target=lambda: pub.offer(message(0, 96)))
    parked.start()
    wait_for(lambda: events, what="the episode's start")
    assert events[0].started and events[0].depth == WINDOW and events[0].episodes == 1
    time.sleep(0.1)
    sub.poll(collector.on_message, 10_000)  # read it all: the depth falls below 50 %
    parked.join(5)
    wait_for(lambda: len(events) >= 2, what="the episode's end")
    end = events[1]
    assert not end.started and end.depth <= WINDOW // 2
    assert end.duration_ns >= 100_000_000 and end.at_ns - end.duration_ns == events[0].at_ns
    assert pub.last_episode == end
    counters = {t: counter_value(client, t, 51)
                for t in (CounterType.BP_EPISODES, CounterType.BP_TIME, CounterType.BP_PEAK)}
    assert counters[CounterType.BP_EPISODES] == 1
    assert counters[CounterType.BP_TIME] == end.duration_ns
    assert counters[CounterType.BP_PEAK] == WINDOW


def test_episodes_over_udp_are_told_to_the_publisher(network_client) -> None:
    events: list[BackPressureEpisode] = []
    channel = f"aeron:udp?endpoint=127.0.0.1:{free_port()}|term-length=64k"
    pub = network_client.add_publication(channel, 52, policy="block,timeout:20s",
                                         on_back_pressure=events.append)
    sub = network_client.add_subscription(channel, 52)
    wait_for(lambda: pub.is_connected, what="connected")
    reader = SlowReader(sub, 2_000, pause=0.002)
    for i in range(2_000):
        assert pub.offer(message(i, 96)) > 0
    reader.join()
    reader.collector.assert_exactly(2_000)
    wait_for(lambda: events and not events[-1].started, what="the last episode's end")
    starts = [e for e in events if e.started]
    assert starts and [e.started for e in events] == [True, False] * len(starts)
    assert counter_value(network_client, CounterType.BP_EPISODES, 52) == len(starts)


def test_a_second_publisher_cannot_ask_for_other_watermarks(client) -> None:
    client.add_publication(IPC + "|watermarks=90/40", 53)
    client.add_publication(IPC + "|watermarks=90/40", 53)
    with pytest.raises(ChannelError) as info:
        client.add_publication(IPC + "|watermarks=80/40", 53)
    assert info.value.part == "watermarks" and "90/40" in str(info.value)


@pytest.mark.parametrize(("first", "second", "part"), [
    ("|fc=max", "|fc=min,g:/2", "fc"),
    ("", "|fc=min", "fc"),  # the default (max for a group) against min
    ("", "|rc=nak-strength,window:10ms", "rc"),
    ("|rc=nak-strength,window:10ms", "|rc=nak-strength,window:20ms", "rc"),
])
def test_a_second_publisher_cannot_ask_for_another_flow_or_rate_control(
        network_client, first: str, second: str, part: str) -> None:
    """The sender runs one flow control and one rate control per publication: a publisher
    that asks for others is refused by name (it got the first's, silently); one that asks
    for the same, or for nothing, shares the publication."""
    channel = f"aeron:udp?endpoint=224.0.1.1:{free_port()}|interface=127.0.0.1"
    network_client.add_publication(channel + first, 55)
    network_client.add_publication(channel + first, 55)
    network_client.add_publication(channel, 55)
    with pytest.raises(ChannelError) as info:
        network_client.add_publication(channel + second, 55)
    assert info.value.part == part and "differs from the existing publication's" in str(
        info.value)


def test_stat_shows_each_publications_episodes_and_drops(client) -> None:
    from slipstream.daemon.ops.stat import back_pressure_rows

    pub = client.add_publication(IPC, 54, policy="drop-newest")
    client.add_subscription(IPC, 54)
    wait_for(lambda: pub.is_connected, what="connected")
    for _ in range(1_000):
        pub.offer(b"d" * 96)
    counters = CountersFile(client.directory / "counters.dat", writable=False)
    try:
        wait_for(lambda: any(r.stream_id == 54 and r.counters.get("bp-episodes")
                             for r in back_pressure_rows(list(counters))), what="episode")
        row = next(r for r in back_pressure_rows(list(counters)) if r.stream_id == 54)
    finally:
        counters.close()
    assert row.counters["pub-drops"] == pub.dropped > 0
    assert row.counters["bp-peak"] == WINDOW


# -- drop-oldest: untethered subscriptions --------------------------------------------------------

def test_an_untethered_subscriber_that_stops_reading_is_left_behind_and_rejoins(client) -> None:
    from slipstream.client.counters import SystemCounter

    gone: list = []
    block_s = 10
    pub = client.add_publication(IPC, 71, policy=f"block,timeout:{block_s}s")
    fast = client.add_subscription(IPC, 71)
    slow = client.add_subscription(
        IPC + "|tether=false|untethered-window-limit-timeout=50ms|untethered-resting-timeout=0",
        71, on_unavailable_image=gone.append)
    wait_for(lambda: pub.is_connected and fast.images and slow.images, what="connected")
    count = 3_000  # 11 windows: the slow one never reads, the publisher never waits for it
    reader = SlowReader(fast, count, per_poll=100)
    started = time.monotonic()
    for i in range(count):
        assert pub.offer(message(i, 96)) > 0
    reader.join()
    reader.collector.assert_exactly(count)
    # Held for a window, the publisher would wait out its block (and fail that offer);
    # eleven windows' skips at 50 ms each take a fraction of one.
    assert time.monotonic() - started < block_s, "the untethered subscriber held the publisher"
    wait_for(lambda: gone, what="the slow image's end")
    lost_from, lost_to = gone[0].lost_range
    assert lost_from == 0 and lost_to >= WINDOW * 3 // 4, gone[0].lost_range
    counters = counters_of(client)  # it reads the client's directory
    assert counters[SystemCounter.UNTETHERED_SKIPS.name] >= 1
    assert counters[SystemCounter.UNTETHERED_SKIPPED_BYTES.name] >= lost_to - lost_from
    # It rejoined at the newest position: what comes next, it reads.
    wait_for(lambda: slow.images and slow.images[0].position >= lost_to, what="rejoined")
    collector = Collector(slow)
    pub.offer(message(count, 96))
    wait_for(lambda: collector.poll() or collector.seen, what="the next message")
    assert collector.seen[-1] == count


def test_a_tethered_slow_subscriber_still_holds_the_publisher(client) -> None:
    pub = client.add_publication(IPC, 72, policy="drop-newest")
    client.add_subscription(IPC, 72)  # tethered, never reads
    client.add_subscription(IPC + "|tether=false|untethered-window-limit-timeout=10ms", 72)
    wait_for(lambda: pub.is_connected, what="connected")
    for _ in range(2_000):
        pub.offer(b"t" * 96)
        time.sleep(0.0001)
    assert pub.dropped > 0 and pub.position <= WINDOW + 128


def test_rejoin_false_is_refused_by_name_where_no_session_comes_back(network_client) -> None:
    """Untethered subscriptions work on aeron:udp too (tests/test_udp_untethered.py), and so
    does rejoin=false; on aeron:ipc, whose sessions never come back over a network, rejoin=false
    is refused naming the key."""
    from slipstream.client.errors import ChannelRejectedError

    network_client.add_subscription(
        f"aeron:udp?endpoint=127.0.0.1:{free_port()}|tether=false|rejoin=false", 73)
    with pytest.raises(ChannelRejectedError) as info:
        network_client.add_subscription("aeron:ipc?rejoin=false", 73)
    assert info.value.part == "rejoin" and "network subscription" in str(info.value)


def test_every_error_an_application_can_meet_is_importable_from_slipstream_client() -> None:
    """The tutorial names them from ``slipstream.client`` (BackPressuredError was missing)."""
    import slipstream.client
    from slipstream.client import errors

    public = {name for name, value in vars(errors).items()
              if isinstance(value, type) and issubclass(value, errors.SlipstreamError)}
    # A bug in slipstream's own state tables, never an application's to catch.
    public.discard("LocalProtocolError")
    assert public <= set(slipstream.client.__all__), public - set(slipstream.client.__all__)
