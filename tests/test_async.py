"""The async API for trio (pytest-trio): offer_async, receive_async and ``async for`` over
messages, on a real driver; waiting never blocks the event loop, cancellation frees the parked
worker thread, and a driver that dies wakes the tasks that wait on it."""

from __future__ import annotations

import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import trio
from helpers import FAST_DRIVER_SETTINGS, Collector, message, wait_for

from slipstream.client import Client, aio
from slipstream.client.aio import SCHEDULE_EVERY
from slipstream.client.errors import (
    BackPressuredError,
    ClosedError,
    DriverNotRunningError,
    InvalidArgumentError,
    UsageError,
)
from slipstream.client.layout import META_PUBLISHER_WAITERS, META_READER_WAITERS

IPC = "aeron:ipc?term-length=64k"
WINDOW = 32 * 1024


def fill_window(pub) -> None:
    while pub.position < WINDOW:
        assert pub.offer(b"w" * 96) > 0


async def test_offer_async_waits_for_a_slow_reader_in_the_same_event_loop(client) -> None:
    pub = client.add_publication(IPC, 61)
    sub = client.add_subscription(IPC, 61)
    wait_for(lambda: pub.is_connected, what="connected")
    count = 6_000  # 23 windows
    collector = Collector(sub)

    async def read() -> None:
        while len(collector.seen) < count:
            await sub.receive_async(collector.on_message, 20)
            await trio.sleep(0.0005)  # slower than the publisher

    async with trio.open_nursery() as nursery:
        nursery.start_soon(read)
        for i in range(count):
            # Were the event loop blocked while this waits, read() could never run.
            assert await pub.offer_async(message(i, 96), timeout=20) > 0
    collector.assert_exactly(count)


def reserved(i: int) -> int:
    """A reserved value for message ``i``, anywhere in the int64 range (negatives too)."""
    return (i * 0x9E3779B97F4A7C15) % 2**64 - 2**63


@pytest.mark.parametrize("policy", [None, "rate-limit,messages:20000,burst:10ms"])
async def test_offer_async_carries_its_reserved_value_through_its_waits(
        client, policy: str | None) -> None:
    """offer_async's reserved_value (by keyword or position) is what the subscriber's header
    shows, also for the offers that waited for credit (a reader slower than the publisher)
    or for a rate-limit bucket; a bad one is refused before any wait."""
    stream_id = 75 if policy is None else 76
    pub = client.add_publication(IPC, stream_id, policy=policy)
    sub = client.add_subscription(IPC, stream_id)
    wait_for(lambda: pub.is_connected, what="connected")
    count = 1_500  # 6 windows
    values: dict[int, int] = {}
    collector = Collector(sub)

    def on_message(data: memoryview, header) -> None:
        collector.on_message(data, header)
        values[collector.seen[-1]] = header.reserved_value

    async def read() -> None:
        while len(collector.seen) < count:
            await sub.receive_async(on_message, 20)
            await trio.sleep(0.0005)  # slower than the publisher

    async with trio.open_nursery() as nursery:
        nursery.start_soon(read)
        for i in range(count):
            if i % 2:
                assert await pub.offer_async(message(i, 96), reserved(i), timeout=20) > 0
            else:
                assert await pub.offer_async(message(i, 96), reserved_value=reserved(i),
                                             timeout=20) > 0
    collector.assert_exactly(count)
    assert values == {i: reserved(i) for i in range(count)}
    for bad in (1.5, 2**63, None):
        with pytest.raises(InvalidArgumentError, match=r"^reserved_value: "):
            await pub.offer_async(b"x", reserved_value=bad)


async def test_offer_async_that_finds_credit_still_lets_other_tasks_run(client) -> None:
    roomy = "aeron:ipc?term-length=1m"  # a 512 KiB window: none of the offers below waits
    pub = client.add_publication(roomy, 70)
    client.add_subscription(roomy, 70)
    wait_for(lambda: pub.is_connected, what="connected")
    turns = 0

    async def other_task() -> None:
        nonlocal turns
        while True:
            turns += 1
            await trio.sleep(0)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(other_task)
        for _ in range(1_000):  # 128 KiB
            assert await pub.offer_async(b"c" * 96, timeout=5) > 0
        turns_during_offers = turns
        nursery.cancel_scope.cancel()
    assert turns_during_offers >= 1_000 // SCHEDULE_EVERY - 1


async def test_offer_async_raises_after_its_timeout(client) -> None:
    pub = client.add_publication(IPC, 62)
    client.add_subscription(IPC, 62)
    wait_for(lambda: pub.is_connected, what="connected")
    fill_window(pub)
    started = time.monotonic()
    with pytest.raises(BackPressuredError) as info:
        await pub.offer_async(b"late", timeout=0.3)
    assert time.monotonic() - started >= 0.3 and info.value.connected


async def cancel_once_parked(wait: Callable[[], Awaitable[object]],
                             waiters: Callable[[], int]) -> float:
    """Run ``wait()`` until its worker thread is parked (``waiters()`` > 0), cancel it, and
    return how long the cancelled task took to end and its thread to leave the futex."""
    async with trio.open_nursery() as nursery:
        nursery.start_soon(wait)
        deadline = time.monotonic() + 5
        while waiters() == 0:
            assert time.monotonic() < deadline, "the wait never parked its worker thread"
            await trio.sleep(0.001)
        started = time.monotonic()
        nursery.cancel_scope.cancel()
    while waiters() != 0:
        assert time.monotonic() - started < 5, "the worker thread is still parked"
        await trio.sleep(0.001)
    return time.monotonic() - started


async def test_cancelling_a_parked_offer_returns_at_once_and_frees_its_thread(
        client, monkeypatch: pytest.MonkeyPatch) -> None:
    # Slices far longer than the bound below: only the wake on cancellation frees the thread
    # in time, not the end of its slice.
    monkeypatch.setattr(aio, "PARK_SLICE_NS", 30_000_000_000)
    pub = client.add_publication(IPC, 63)
    client.add_subscription(IPC, 63)
    wait_for(lambda: pub.is_connected, what="connected")
    fill_window(pub)
    position = pub.position
    took = await cancel_once_parked(lambda: pub.offer_async(b"never", timeout=60),
                                    lambda: pub._log.meta_i32(META_PUBLISHER_WAITERS))
    assert took < 1.0, f"the parked offer took {took:.3f} s to end"
    await trio.sleep(0.05)
    assert pub.position == position  # the cancelled offer appended nothing


async def test_cancelling_a_parked_receive_frees_its_thread(
        client, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(aio, "PARK_SLICE_NS", 30_000_000_000)
    pub = client.add_publication(IPC, 64)
    sub = client.add_subscription(IPC, 64)
    wait_for(lambda: pub.is_connected and sub.is_connected, what="connected")
    image = sub.images[0]
    took = await cancel_once_parked(lambda: sub.receive_async(lambda *_: None, 10),
                                    lambda: image._log.meta_i32(META_READER_WAITERS))
    assert took < 1.0, f"the parked receive took {took:.3f} s to end"


async def test_async_for_yields_every_message_in_order(client) -> None:
    pub = client.add_publication(IPC, 65)
    sub = client.add_subscription(IPC, 65)
    wait_for(lambda: pub.is_connected, what="connected")
    count = 5_000

    def publish() -> None:
        for i in range(count):
            while pub.offer(message(i, 64)) < 0:
                time.sleep(0.0001)

    publisher = threading.Thread(target=publish)
    publisher.start()
    seen = []
    with trio.fail_after(30):
        async for data in sub.messages():
            seen.append(int.from_bytes(data[:4], "little"))
            if len(seen) == count:
                break
    publisher.join()
    assert seen == list(range(count))


async def test_an_offer_async_cancelled_before_it_waits_raises_only_if_nothing_went(
        client) -> None:
    pub = client.add_publication(IPC, 71)
    client.add_subscription(IPC, 71)
    wait_for(lambda: pub.is_connected, what="connected")
    returned = 0
    with trio.CancelScope() as scope:
        scope.cancel()
        for _ in range(2 * SCHEDULE_EVERY):  # within the window: none of them waits
            await pub.offer_async(b"o" * 96, timeout=5)
            returned += 1
    assert scope.cancelled_caught
    assert 0 < returned < 2 * SCHEDULE_EVERY
    assert pub.position == returned * 128  # every append returned; the raise appended nothing


async def test_an_async_for_left_early_leaves_the_rest_to_the_next_loop(client) -> None:
    pub = client.add_publication(IPC, 72)
    sub = client.add_subscription(IPC, 72)
    wait_for(lambda: pub.is_connected, what="connected")
    for i in range(10):
        assert pub.offer(message(i, 64)) > 0
    seen = []
    with trio.fail_after(5):
        async for data in sub.messages():  # one poll takes all ten
            seen.append(int.from_bytes(data[:4], "little"))
            break
        assert pub.offer(message(10, 64)) > 0
        with trio.CancelScope() as scope:
            scope.cancel()  # it yields what it has and can poll, and stops where it would wait
            async for data in sub.messages():
                seen.append(int.from_bytes(data[:4], "little"))
        assert scope.cancelled_caught
    assert seen == list(range(11))


async def test_a_read_past_what_an_async_for_left_pending_is_refused(client) -> None:
    """Messages a messages() loop polled and did not yield come first: poll and receive
    raise rather than skip them (they would come out of order, or never)."""
    pub = client.add_publication(IPC, 73)
    sub = client.add_subscription(IPC, 73)
    wait_for(lambda: pub.is_connected, what="connected")
    for i in range(10):
        assert pub.offer(message(i, 64)) > 0
    seen = []
    with trio.fail_after(5):
        async for data in sub.messages():
            seen.append(int.from_bytes(data[:4], "little"))
            break
        for read in (lambda: sub.poll(lambda data, header: None, 10),
                     lambda: sub.poll_batch(),
                     lambda: sub.receive(lambda data, header: None, timeout=0.1)):
            with pytest.raises(UsageError, match="9 messages"):
                read()
        with pytest.raises(UsageError):
            await sub.receive_async(lambda data, header: None, timeout=0.1)
        async for data in sub.messages():
            seen.append(int.from_bytes(data[:4], "little"))
            if len(seen) == 10:
                break
    assert seen == list(range(10))
    assert sub.poll(lambda data, header: None, 10) == 0  # nothing pending now


async def test_offer_async_is_paced_by_a_rate_limit_policy(client) -> None:
    """offer_async draws on the publication's token bucket as offer does (it had appended
    ~150,000 a second under messages:2000)."""
    pub = client.add_publication(IPC, 74, policy="rate-limit,messages:200,burst:50ms")
    sub = client.add_subscription(IPC, 74)
    wait_for(lambda: pub.is_connected, what="connected")
    sent = 0
    started = time.monotonic()
    with trio.move_on_after(0.5):
        while True:
            assert await pub.offer_async(message(sent, 16)) > 0
            sent += 1
            if sent % 50 == 0:
                sub.poll(lambda data, header: None, 100)
    elapsed = time.monotonic() - started
    assert sent <= 200 * elapsed + 10 + 2  # the rate, the 10-message burst, rounding


async def test_async_for_ends_when_the_subscription_closes(client) -> None:
    sub = client.add_subscription(IPC, 66)

    async def close_soon() -> None:
        await trio.sleep(0.2)
        sub.close()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(close_soon)
        with trio.fail_after(5):
            assert [m async for m in sub.messages()] == []


async def test_a_closed_publication_raises_in_a_waiting_offer(client) -> None:
    pub = client.add_publication(IPC, 67)
    client.add_subscription(IPC, 67)
    wait_for(lambda: pub.is_connected, what="connected")
    fill_window(pub)

    async def close_soon() -> None:
        await trio.sleep(0.2)
        pub.close()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(close_soon)
        with trio.fail_after(5), pytest.raises(ClosedError):
            await pub.offer_async(b"closed", timeout=30)


async def test_tasks_waiting_on_a_driver_that_dies_raise(driver_dir: Path) -> None:
    from slipstream.daemon.driver import MediaDriver

    with MediaDriver.launch(directory=driver_dir, **FAST_DRIVER_SETTINGS) as driver, \
            Client.connect(driver.directory) as client:
        pub = client.add_publication(IPC, 68)
        sub = client.add_subscription(IPC, 68)
        wait_for(lambda: pub.is_connected, what="connected")
        fill_window(pub)
        other = client.add_subscription(IPC, 69)  # nothing is ever published on it
        failures: list[BaseException] = []

        async def expect_loss(wait) -> None:
            try:
                await wait()
            except DriverNotRunningError as e:
                failures.append(e)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(expect_loss, lambda: pub.offer_async(b"x", timeout=60))
            nursery.start_soon(expect_loss, lambda: other.receive_async(lambda *_: None))
            await trio.sleep(0.3)
            driver.kill()
            with trio.fail_after(10):
                while len(failures) < 2:
                    await trio.sleep(0.01)
        assert len(failures) == 2
        del sub


def test_the_async_calls_under_asyncio_say_they_need_trio_at_the_first_call(client) -> None:
    """Not at the 64th (the first scheduling point), as they did."""
    import asyncio

    from slipstream.client.errors import UsageError

    publication = client.add_publication(IPC, 77)

    async def first() -> None:
        await publication.offer_async(b"x")

    for _ in range(2):  # and again: a caller that caught it is told again, not let through
        with pytest.raises(UsageError, match="run under trio"):
            asyncio.run(first())
    publication.close()
