"""The async API under trio and asyncio (each test runs under both: tests/loops.py):
offer_async, receive_async and ``async for`` over messages, on a real driver; waiting never
blocks the event loop, cancellation frees the parked worker thread, and a driver that dies
wakes the tasks that wait on it.  Cancelling is each loop's own: the tests cancel by anyio's
scopes (trio's own under trio), and asyncio's ``Task.cancel()`` has tests of its own here."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio
import pytest
from helpers import FAST_DRIVER_SETTINGS, Collector, message, wait_for
from loops import another_task

from slipstream.client import Client, Publication, Subscription, aio
from slipstream.client.aio import SCHEDULE_EVERY
from slipstream.client.errors import (
    BackPressuredError,
    ClosedError,
    DriverNotRunningError,
    InvalidArgumentError,
    UsageError,
)
from slipstream.client.layout import META_PUBLISHER_WAITERS, META_READER_WAITERS

pytestmark = pytest.mark.anyio

IPC = "aeron:ipc?term-length=64k"
WINDOW = 32 * 1024
#: The park slice the cancellation tests set, s: far longer than their bounds (a quarter of
#: it), so only the wake at a cancellation ends a wait in time, not the end of its slice.
LONG_SLICE_S = 30


def fill_window(pub) -> None:
    while pub.position < WINDOW:
        assert pub.offer(b"w" * 96) > 0


def a_full_window(client, stream_id: int) -> Publication:
    """A publication of IPC stream ``stream_id``, connected to a subscription that reads
    nothing, its window full: its next offer would wait."""
    pub = client.add_publication(IPC, stream_id)
    client.add_subscription(IPC, stream_id)
    wait_for(lambda: pub.is_connected, what="connected")
    fill_window(pub)
    return pub


async def test_offer_async_waits_for_a_slow_reader_in_the_same_event_loop(client) -> None:
    pub = client.add_publication(IPC, 61)
    sub = client.add_subscription(IPC, 61)
    wait_for(lambda: pub.is_connected, what="connected")
    count = 6_000  # 23 windows
    collector = Collector(sub)

    async def read() -> None:
        while len(collector.seen) < count:
            await sub.receive_async(collector.on_message, 20)
            await anyio.sleep(0.0005)  # slower than the publisher

    async with anyio.create_task_group() as nursery:
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
            await anyio.sleep(0.0005)  # slower than the publisher

    async with anyio.create_task_group() as nursery:
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
    async with another_task() as turns:
        for _ in range(1_000):  # 128 KiB
            assert await pub.offer_async(b"c" * 96, timeout=5) > 0
        turns_during_offers = turns.count
    assert turns_during_offers >= 1_000 // SCHEDULE_EVERY - 1


async def test_offer_async_raises_after_its_timeout(client) -> None:
    pub = a_full_window(client, 62)
    started = time.monotonic()
    with pytest.raises(BackPressuredError) as info:
        await pub.offer_async(b"late", timeout=0.3)
    assert time.monotonic() - started >= 0.3 and info.value.connected


async def cancel_once_parked(wait: Callable[[], Awaitable[object]],
                             waiters: Callable[[], int]) -> float:
    """Run ``wait()`` until its worker thread is parked (``waiters()`` > 0), cancel it, and
    return how long the cancelled task took to end and its thread to leave the futex."""
    async with anyio.create_task_group() as nursery:
        nursery.start_soon(wait)
        deadline = time.monotonic() + 5
        while waiters() == 0:
            assert time.monotonic() < deadline, "the wait never parked its worker thread"
            await anyio.sleep(0.001)
        started = time.monotonic()
        nursery.cancel_scope.cancel()
    while waiters() != 0:
        # Not woken, it would leave the futex only at its slice's end.
        assert time.monotonic() - started < LONG_SLICE_S / 4, "the worker thread is still parked"
        await anyio.sleep(0.001)
    return time.monotonic() - started


async def test_cancelling_a_parked_offer_returns_at_once_and_frees_its_thread(
        client, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(aio, "PARK_SLICE_NS", LONG_SLICE_S * 1_000_000_000)
    pub = a_full_window(client, 63)
    position = pub.position
    took = await cancel_once_parked(lambda: pub.offer_async(b"never", timeout=60),
                                    lambda: pub._log.meta_i32(META_PUBLISHER_WAITERS))
    assert took < LONG_SLICE_S / 4, f"the parked offer took {took:.3f} s to end"
    await anyio.sleep(0.05)
    assert pub.position == position  # the cancelled offer appended nothing


async def test_cancelling_a_parked_receive_frees_its_thread(
        client, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(aio, "PARK_SLICE_NS", LONG_SLICE_S * 1_000_000_000)
    pub = client.add_publication(IPC, 64)
    sub = client.add_subscription(IPC, 64)
    wait_for(lambda: pub.is_connected and sub.is_connected, what="connected")
    image = sub.images[0]
    took = await cancel_once_parked(lambda: sub.receive_async(lambda *_: None, 10),
                                    lambda: image._log.meta_i32(META_READER_WAITERS))
    assert took < LONG_SLICE_S / 4, f"the parked receive took {took:.3f} s to end"


async def test_the_event_loops_polls_never_park_whatever_the_idle_count(
        driver_dir: Path) -> None:
    """The client's idle strategy waits parked past its spins; an event loop's thread must
    not: receive_async's polls that find nothing, many in a row with spins_before_yield=0,
    never wait on the loop's thread (its parks are in worker threads)."""
    from slipstream.daemon.driver import MediaDriver

    with MediaDriver.launch(directory=driver_dir, **FAST_DRIVER_SETTINGS) as driver, \
            Client.connect(driver.directory, spins_before_yield=0) as client:
        pub = client.add_publication(IPC, 69)
        sub = client.add_subscription(IPC, 69)
        wait_for(lambda: pub.is_connected and sub.is_connected, what="connected")
        for _ in range(50):
            assert await sub.receive_async(lambda *_: None, 10, timeout=0.001) == 0
        assert sub._idle.waits == 0
        sub.poll(lambda *_: None, 10)  # the same poll, called as the API, does wait
        assert sub._idle.waits == 1


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
    with anyio.fail_after(30):
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
    with anyio.CancelScope() as scope:
        scope.cancel()
        for _ in range(2 * SCHEDULE_EVERY):  # within the window: none of them waits
            await pub.offer_async(b"o" * 96, timeout=5)
            returned += 1
    assert scope.cancelled_caught
    assert 0 < returned < 2 * SCHEDULE_EVERY
    assert pub.position == returned * 128  # every append returned; the raise appended nothing


def ten_unread(client, stream_id: int) -> tuple[Publication, Subscription]:
    """A publication and a subscription of IPC stream ``stream_id``, connected, and messages
    0 .. 9 (64 bytes) offered and not read yet."""
    pub = client.add_publication(IPC, stream_id)
    sub = client.add_subscription(IPC, stream_id)
    wait_for(lambda: pub.is_connected, what="connected")
    for i in range(10):
        assert pub.offer(message(i, 64)) > 0
    return pub, sub


async def test_an_async_for_left_early_leaves_the_rest_to_the_next_loop(client) -> None:
    pub, sub = ten_unread(client, 72)
    seen = []
    with anyio.fail_after(5):
        async for data in sub.messages():  # one poll takes all ten
            seen.append(int.from_bytes(data[:4], "little"))
            break
        assert pub.offer(message(10, 64)) > 0
        with anyio.CancelScope() as scope:
            scope.cancel()  # it yields what it has and can poll, and stops where it would wait
            async for data in sub.messages():
                seen.append(int.from_bytes(data[:4], "little"))
        assert scope.cancelled_caught
    assert seen == list(range(11))


async def test_a_read_past_what_an_async_for_left_pending_is_refused(client) -> None:
    """Messages a messages() loop polled and did not yield come first: poll and receive
    raise rather than skip them (they would come out of order, or never)."""
    _pub, sub = ten_unread(client, 73)  # (kept open while it reads)
    seen = []
    with anyio.fail_after(5):
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
    with anyio.move_on_after(0.5):
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
        await anyio.sleep(0.2)
        sub.close()

    async with anyio.create_task_group() as nursery:
        nursery.start_soon(close_soon)
        with anyio.fail_after(5):
            assert [m async for m in sub.messages()] == []


async def test_a_closed_publication_raises_in_a_waiting_offer(client) -> None:
    pub = a_full_window(client, 67)

    async def close_soon() -> None:
        await anyio.sleep(0.2)
        pub.close()

    async with anyio.create_task_group() as nursery:
        nursery.start_soon(close_soon)
        with anyio.fail_after(5), pytest.raises(ClosedError):
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

        async with anyio.create_task_group() as nursery:
            nursery.start_soon(expect_loss, lambda: pub.offer_async(b"x", timeout=60))
            nursery.start_soon(expect_loss, lambda: other.receive_async(lambda *_: None))
            await anyio.sleep(0.3)
            driver.kill()
            with anyio.fail_after(10):
                while len(failures) < 2:
                    await anyio.sleep(0.01)
        assert len(failures) == 2
        del sub


def test_the_async_calls_outside_trio_and_asyncio_say_so_at_the_first_call(client) -> None:
    """A coroutine driven by hand (no event loop) is refused at its first call, not at the
    64th (the first scheduling point), and again at the next."""
    publication = client.add_publication(IPC, 77)
    for _ in range(2):  # and again: a caller that caught it is told again, not let through
        offer = publication.offer_async(b"x")
        with pytest.raises(UsageError, match="under trio or asyncio, not under no event loop"):
            offer.send(None)
    assert publication.position == 0
    publication.close()


def _parked_threads_and_fds() -> tuple[int, int]:
    return threading.active_count(), len(os.listdir("/proc/self/fd"))


async def test_cancelled_waits_leave_no_thread_fd_or_waiter_behind(
        client, monkeypatch: pytest.MonkeyPatch) -> None:
    """Twenty receives and twenty offers, each parked and then cancelled: every worker thread
    leaves its futex (the waiters go back to 0), the loop's pool reuses them (the threads do
    not grow with the waits) and no file descriptor is left registered."""
    monkeypatch.setattr(aio, "PARK_SLICE_NS", LONG_SLICE_S * 1_000_000_000)
    pub = client.add_publication(IPC, 78)
    sub = client.add_subscription(IPC, 78)
    other = client.add_subscription(IPC, 79)  # nothing is published on it
    other_pub = client.add_publication(IPC, 79)
    wait_for(lambda: pub.is_connected and other_pub.is_connected and other.images,
             what="connected")
    fill_window(pub)
    image = other.images[0]
    # One of each first: the pool makes its threads, and anyio and trio their own state.
    await cancel_once_parked(lambda: other.receive_async(lambda *_: None),
                             lambda: image._log.meta_i32(META_READER_WAITERS))
    await cancel_once_parked(lambda: pub.offer_async(b"never", timeout=60),
                             lambda: pub._log.meta_i32(META_PUBLISHER_WAITERS))
    threads, fds = _parked_threads_and_fds()
    for _ in range(20):
        await cancel_once_parked(lambda: other.receive_async(lambda *_: None),
                                 lambda: image._log.meta_i32(META_READER_WAITERS))
        await cancel_once_parked(lambda: pub.offer_async(b"never", timeout=60),
                                 lambda: pub._log.meta_i32(META_PUBLISHER_WAITERS))
    after_threads, after_fds = _parked_threads_and_fds()
    assert after_threads <= threads + 1, f"{after_threads - threads} threads more"
    # Fewer is fine: a log released before the loop may be unmapped (its fd closed) meanwhile.
    assert after_fds <= fds, f"{after_fds - fds} file descriptors more"
    del sub


#: asyncio's own ``Task.cancel()`` (trio has no such thing: the tests above cancel under both).
asyncio_only = pytest.mark.parametrize("anyio_backend", ["asyncio"])


@asyncio_only
async def test_an_asyncio_task_cancel_ends_a_parked_offer_at_once_and_frees_its_thread(
        client, monkeypatch: pytest.MonkeyPatch) -> None:
    """``Task.cancel()`` and ``asyncio.timeout`` (built on it) end a parked offer_async
    within a fraction of its park slice, append nothing, and leave no thread on the futex;
    the timeout is the TimeoutError asyncio promises (the task's cancel count is kept)."""
    import asyncio

    monkeypatch.setattr(aio, "PARK_SLICE_NS", LONG_SLICE_S * 1_000_000_000)
    pub = a_full_window(client, 80)
    position = pub.position
    waiters = lambda: pub._log.meta_i32(META_PUBLISHER_WAITERS)  # noqa: E731
    task = asyncio.create_task(pub.offer_async(b"never", timeout=60))
    while waiters() == 0:
        await asyncio.sleep(0.001)
    started = time.monotonic()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    took = time.monotonic() - started
    assert took < LONG_SLICE_S / 4, f"the cancelled offer took {took:.3f} s to end"
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.2):
            await pub.offer_async(b"never", timeout=60)
    assert 0.2 <= time.monotonic() - started < LONG_SLICE_S / 4
    assert asyncio.current_task().cancelling() == 0
    while waiters() != 0:
        # Not woken, it would leave the futex only at its slice's end.
        assert time.monotonic() - started < LONG_SLICE_S / 4, "the worker thread is still parked"
        await asyncio.sleep(0.001)
    assert pub.position == position


@asyncio_only
async def test_an_asyncio_cancel_after_the_append_is_raised_at_the_next_await(
        client) -> None:
    """A ``Task.cancel()`` that arrives while a call that appended (or polled) is at its
    schedule point does not undo what the call did: the call returns its position, and the
    cancellation is raised at the task's next suspension, once."""
    import asyncio

    pub = client.add_publication(IPC, 81)
    sub = client.add_subscription(IPC, 81)
    wait_for(lambda: pub.is_connected, what="connected")
    task = asyncio.current_task()
    returned: list[int] = []
    # Every SCHEDULE_EVERY-th call schedules after its append; the cancel is asked just
    # before that one, as a task elsewhere would while this one runs.
    for _ in range(SCHEDULE_EVERY - 1):
        returned.append(await pub.offer_async(b"a" * 96, timeout=5))
    task.cancel()
    returned.append(await pub.offer_async(b"a" * 96, timeout=5))
    assert returned[-1] == pub.position == SCHEDULE_EVERY * 128
    with pytest.raises(asyncio.CancelledError):
        await asyncio.sleep(0)
    assert task.uncancel() == 0  # asked once, as the caller did
    await asyncio.sleep(0)  # and raised once
    got: list[int] = []
    for _ in range(SCHEDULE_EVERY - 1):
        assert await sub.receive_async(lambda data, _h: got.append(len(data)), 1, timeout=5)
    task.cancel()
    assert await sub.receive_async(lambda data, _h: got.append(len(data)), 1, timeout=5) == 1
    assert got == [96] * SCHEDULE_EVERY
    with pytest.raises(asyncio.CancelledError):
        await asyncio.sleep(0)
    assert task.uncancel() == 0


def test_an_asyncio_run_whose_waits_were_cancelled_leaves_no_thread_behind(
        client, monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker threads of asyncio's waits (anyio's) end with the loop's run: after an
    ``asyncio.run`` whose parked receives were cancelled, the process has the threads it had
    before (under trio they are trio's thread cache's, shared by the process)."""
    import asyncio

    monkeypatch.setattr(aio, "PARK_SLICE_NS", LONG_SLICE_S * 1_000_000_000)
    pub = client.add_publication(IPC, 82)
    sub = client.add_subscription(IPC, 82)
    wait_for(lambda: pub.is_connected and sub.images, what="connected")
    image = sub.images[0]
    before = threading.active_count()

    async def cancel_parked_receives() -> None:
        for _ in range(5):
            task = asyncio.create_task(sub.receive_async(lambda *_: None))
            while image._log.meta_i32(META_READER_WAITERS) == 0:
                await asyncio.sleep(0.001)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        assert threading.active_count() > before  # the pool's thread, idle

    asyncio.run(cancel_parked_receives())
    wait_for(lambda: threading.active_count() == before, timeout=5,
             what="the loop's worker threads ended")
    assert image._log.meta_i32(META_READER_WAITERS) == 0
