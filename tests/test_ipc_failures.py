"""IPC streams when something goes: publications and subscriptions closed, processes killed
mid-stream or between a claim and its commit, claims the driver gave up, handlers that raise."""

from __future__ import annotations

import logging
import multiprocessing
import threading
import time
from array import array
from pathlib import Path

import pytest
from helpers import FAST_DRIVER_SETTINGS, IPC_CHANNEL, counters_of, offer_until, wait_for

from slipstream.client import (
    BACK_PRESSURED,
    CLOSED,
    BufferClaim,
    ChannelWarning,
    Client,
    RegistrationError,
)
from slipstream.client.counters import (
    CountersFile,
    CounterType,
    SystemCounter,
)
from slipstream.daemon.driver import MediaDriver


def test_closed_publication_returns_closed_and_never_touches_its_log(client: Client) -> None:
    publication = client.add_publication(IPC_CHANNEL, 1010)
    client.add_subscription(IPC_CHANNEL, 1010)
    wait_for(lambda: publication.is_connected)
    offer_until(publication, b"one")
    position = publication.position
    publication.close()
    assert publication.offer(b"late") == CLOSED
    assert publication.offer_batch(b"xx", [1, 1]) == CLOSED
    assert publication.try_claim(1, BufferClaim()) == CLOSED
    assert publication.is_closed and not publication.is_connected
    assert publication.position == position  # the log is unmapped: no read of it
    assert "position=" in repr(publication)


def test_the_image_goes_when_the_last_publisher_leaves(client: Client) -> None:
    gone: list[int] = []
    kept: list = []

    def went(image) -> None:
        gone.append(image.session_id)
        kept.append(image)

    subscription = client.add_subscription(IPC_CHANNEL, 1011, on_unavailable_image=went)
    publication = client.add_publication(IPC_CHANNEL, 1011)
    wait_for(lambda: publication.is_connected)
    offer_until(publication, b"last words")
    session_id = publication.session_id
    publication.close()
    got: list[bytes] = []
    subscription.receive(lambda d, h: got.append(bytes(d)), 10, timeout=2.0)
    assert got == [b"last words"]  # drained before the image went away
    wait_for(lambda: gone == [session_id])
    assert subscription.images == ()
    [image] = kept
    assert not image.is_closed  # a poll may still be inside it: the polling thread unmaps it
    subscription.poll(lambda d, h: None, 10)
    assert image.is_closed  # at its next poll, not when the subscription closes


@pytest.mark.parametrize("subscription_channel", [
    IPC_CHANNEL,
    # Untethered, and a window behind for longer than its window limit timeout: it was left
    # behind while the log drained, and lost it all the same.
    f"{IPC_CHANNEL}?tether=false|untethered-window-limit-timeout=1s",
])
def test_a_subscriber_that_reads_lingers_after_the_last_publisher_left_gets_it_all(
        driver, client: Client, subscription_channel: str) -> None:
    """The log of a stream whose last publisher closed stays until its subscribers read it,
    however long they take (here three linger timeouts: it was deleted at the first, and a
    subscriber that read 7 s after its publisher closed got none of 10,000 messages, told of
    nothing).  Then it goes."""
    subscription = client.add_subscription(subscription_channel, 1012)
    publication = client.add_publication("aeron:ipc?term-length=1m", 1012)
    wait_for(lambda: publication.is_connected)
    sent = 0
    while publication.offer(b"%07d" % sent) > 0:  # a term window: it does not read yet
        sent += 1
    assert sent > 5000
    publication.close()
    time.sleep(3 * 0.5)  # FAST_DRIVER_SETTINGS' publication_linger_timeout, thrice
    got: list[bytes] = []
    while len(got) < sent:
        assert subscription.poll(lambda d, h: got.append(bytes(d)), 1000) > 0, len(got)
    assert got == [b"%07d" % i for i in range(sent)]
    wait_for(lambda: subscription.images == ())  # read it all: the log went
    assert list((Path(driver.directory) / "publications").iterdir()) == []


def test_linger_on_an_ipc_publication_is_warned_of(client: Client) -> None:
    """Aeron's URIs may carry it; an IPC log has nothing to linger for (it goes once read)."""
    with pytest.warns(ChannelWarning, match="linger does nothing on aeron:ipc"):
        client.add_publication("aeron:ipc?linger=30s", 1013)


def _subscribe_and_hang(directory: str, stream_id: int, ready) -> None:
    client = Client.connect(directory)
    subscription = client.add_subscription(IPC_CHANNEL, stream_id)
    while not subscription.images:
        time.sleep(0.01)
    ready.set()
    time.sleep(3600)  # never polls; killed by the test


def test_a_killed_subscriber_stops_holding_back_the_publisher(driver) -> None:
    context = multiprocessing.get_context("spawn")
    ready = context.Event()
    with Client.connect(driver.directory) as client:
        publication = client.add_publication(IPC_CHANNEL, 1012)
        live = client.add_subscription(IPC_CHANNEL, 1012)
        victim = context.Process(target=_subscribe_and_hang,
                                 args=(str(driver.directory), 1012, ready))
        victim.start()
        assert ready.wait(30)
        message = b"k" * 992
        while publication.offer(message) > 0:
            live.poll(lambda d, h: None, 100)
        assert publication.offer(message) == BACK_PRESSURED  # the silent subscriber holds it
        victim.kill()
        victim.join()
        # After the client liveness timeout (1 s here) its position no longer counts.
        deadline = time.monotonic() + 5
        while publication.offer(message) < 0:
            live.poll(lambda d, h: None, 100)
            assert time.monotonic() < deadline, "the dead subscriber still holds the publisher"
            time.sleep(0.01)
        counters = CountersFile(driver.directory / "counters.dat", writable=False)
        positions = [c for c in counters if c.type_id == CounterType.SUBSCRIBER_POSITION]
        assert len(positions) == 1  # only the live subscriber's counter is left
        assert counters.get(3) == 1  # client timeouts
        counters.close()


def _claim_and_die(directory: str, stream_id: int, ready) -> None:
    client = Client.connect(directory)
    publication = client.add_publication(IPC_CHANNEL, stream_id)
    while not publication.is_connected:
        time.sleep(0.01)
    claim = BufferClaim()
    assert publication.try_claim(100, claim) > 0
    ready.set()
    time.sleep(3600)  # killed between claim and commit


def _offer_behind_a_dead_claim(driver, publication, stream_id: int, message: bytes) -> None:
    """Another process's publication of ``stream_id`` claims and is killed before it commits;
    ``message`` is offered by ``publication`` behind that claim, before the kill."""
    context = multiprocessing.get_context("spawn")
    ready = context.Event()
    victim = context.Process(target=_claim_and_die,
                             args=(str(driver.directory), stream_id, ready))
    victim.start()
    assert ready.wait(30)
    offer_until(publication, message)
    victim.kill()
    victim.join()


def test_a_publisher_killed_between_claim_and_commit_is_unblocked(driver) -> None:
    with Client.connect(driver.directory) as client:
        subscription = client.add_subscription(IPC_CHANNEL, 1013)
        publication = client.add_publication(IPC_CHANNEL, 1013)
        _offer_behind_a_dead_claim(driver, publication, 1013, b"behind the claim")
        got: list[bytes] = []
        assert subscription.poll(lambda d, h: got.append(bytes(d)), 10) == 0  # blocked
        # The unblock timeout is 1.5 s in the test driver.
        subscription.receive(lambda d, h: got.append(bytes(d)), 10, timeout=5.0)
        assert got == [b"behind the claim"]
        counters = CountersFile(Path(driver.directory) / "counters.dat", writable=False)
        assert counters.get(5) == 1  # unblocked publications
        counters.close()


def test_a_blocked_claim_is_unblocked_while_a_slow_subscriber_lags_behind_it(driver) -> None:
    """The fastest subscriber is the one held at the dead claim; a slow one that has not read
    what came before it must not stop the unblock (Aeron unblocks at the fastest)."""
    with Client.connect(driver.directory) as client:
        fast = client.add_subscription(IPC_CHANNEL, 1014)
        slow = client.add_subscription(IPC_CHANNEL, 1014)  # never polled until the end
        publication = client.add_publication(IPC_CHANNEL, 1014)
        for i in range(10):
            offer_until(publication, f"before {i}".encode())
        _offer_behind_a_dead_claim(driver, publication, 1014, b"behind the claim")
        got: list[bytes] = []
        deadline = time.monotonic() + 10  # the unblock timeout is 1.5 s in the test driver
        while b"behind the claim" not in got and time.monotonic() < deadline:
            fast.receive(lambda d, h: got.append(bytes(d)), 10, timeout=0.2)
        assert got == [f"before {i}".encode() for i in range(10)] + [b"behind the claim"]
        lagging: list[bytes] = []
        slow.poll(lambda d, h: lagging.append(bytes(d)), 100)
        assert lagging == got  # the padded claim is skipped by every subscriber


@pytest.mark.parametrize(("second", "part"), [
    ("aeron:ipc?term-length=128k", "term-length"),
    ("aeron:ipc?mtu=4096", "mtu"),
    ("aeron:ipc?session-id=77", "session-id"),
])
def test_a_second_publisher_asking_for_another_log_or_session_is_refused_by_name(
        client: Client, second: str, part: str) -> None:
    first = client.add_publication("aeron:ipc?term-length=64k|mtu=1408|session-id=76", 1015)
    with pytest.raises(RegistrationError,
                       match=f"{part}: .* differs from the existing publication's .* stream 1015"):
        client.add_publication(second, 1015)
    same = client.add_publication("aeron:ipc?term-length=64k", 1015)  # a match shares it
    assert same.session_id == first.session_id == 76
    first.close()
    same.close()


def test_a_commit_after_the_driver_gave_the_claim_up_says_so_and_does_not_block(
        client: Client) -> None:
    subscription = client.add_subscription(IPC_CHANNEL, 1016)
    publication = client.add_publication(IPC_CHANNEL, 1016)
    # The driver links the subscriber on its own cycle: a claim before that is NOT_CONNECTED.
    wait_for(lambda: publication.is_connected, what="the subscriber linked")
    claim = BufferClaim()
    assert publication.try_claim(64, claim) > 0
    claim.buffer[:] = b"c" * 64
    offer_until(publication, b"after the claim")
    got: list[bytes] = []
    deadline = time.monotonic() + 10  # the unblock timeout is 1.5 s in the test driver
    while not got and time.monotonic() < deadline:
        subscription.receive(lambda d, h: got.append(bytes(d)), 10, timeout=0.2)
    assert got == [b"after the claim"]  # the claim became padding
    assert claim.commit() is False  # too late: not published, and it says so
    offer_until(publication, b"still flowing")
    subscription.receive(lambda d, h: got.append(bytes(d)), 10, timeout=5)
    assert got == [b"after the claim", b"still flowing"]
    on_time = BufferClaim()
    assert publication.try_claim(8, on_time) > 0
    on_time.buffer[:] = b"in time!"
    assert on_time.commit() is True


def test_an_image_handler_that_raises_is_logged_and_the_client_lives_on(
        client: Client, caplog: pytest.LogCaptureFixture) -> None:
    def broken(image: object) -> None:
        raise ValueError("a bug in the application")

    subscription = client.add_subscription(IPC_CHANNEL, 1017, on_available_image=broken,
                                           on_unavailable_image=broken)
    publication = client.add_publication(IPC_CHANNEL, 1017)
    wait_for(lambda: subscription.images, what="the image")
    time.sleep(2.5)  # past the test driver's 1 s client liveness timeout: keepalives went on
    offer_until(publication, b"alive")
    got: list[bytes] = []
    subscription.receive(lambda d, h: got.append(bytes(d)), 10, timeout=5)
    assert got == [b"alive"]
    publication.close()
    wait_for(lambda: not subscription.images, what="the image went")

    def raised() -> list[logging.LogRecord]:
        return [r for r in caplog.records if "image handler" in r.getMessage()]

    # The handler runs just after the image leaves subscription.images (outside the lock
    # that a reader of images takes): the CI once read the log between the two.
    wait_for(lambda: len(raised()) >= 2, what="the unavailable image's handler ran")
    assert len(raised()) == 2 and "a bug in the application" in caplog.text
    assert client.counters.get(SystemCounter.CLIENT_TIMEOUTS) == 0


def _close_while_offering(directory: str, rounds: int) -> None:

    with Client.connect(directory) as client:
        subscription = client.add_subscription(IPC_CHANNEL, 1018)
        lengths = array("i", [1000] * 8192)  # 8 MiB per call: milliseconds inside C
        data = bytes(1000 * 8192)
        for _ in range(rounds):
            publication = client.add_publication(f"{IPC_CHANNEL}?term-length=16m", 1018)
            results: list[int] = []

            def offer_batches(publication=publication, results=results) -> None:
                while True:
                    result = publication.offer_batch(data, lengths)
                    subscription.poll_batch(100_000)
                    if result == CLOSED:
                        results.append(result)
                        return

            offering = threading.Thread(target=offer_batches)
            offering.start()
            time.sleep(0.02)
            publication.close()  # while the other thread is inside offer_batch, GIL released
            offering.join(10)
            assert results == [CLOSED]


def test_closing_a_publication_while_another_thread_offers_never_faults(driver) -> None:
    """The log stays mapped for the resource linger after close: a thread still inside the C
    offer sees CLOSED at its next call, and never an unmapped page (a fault would kill the
    process: it runs in a child)."""
    context = multiprocessing.get_context("spawn")
    child = context.Process(target=_close_while_offering, args=(str(driver.directory), 30))
    child.start()
    child.join(120)
    assert child.exitcode == 0


def _publish_sequence(directory: str, stream_id: int, count: int) -> None:
    with Client.connect(directory) as client:
        publication = client.add_publication(IPC_CHANNEL, stream_id)
        for i in range(count):
            message = i.to_bytes(8, "little") * 4
            while publication.offer(message) < 0:
                pass


def test_a_stream_between_two_processes_loses_and_reorders_nothing(driver) -> None:
    count = 200_000
    context = multiprocessing.get_context("spawn")
    with Client.connect(driver.directory) as client:
        subscription = client.add_subscription(IPC_CHANNEL, 1014)
        publisher = context.Process(target=_publish_sequence,
                                    args=(str(driver.directory), 1014, count))
        publisher.start()
        expected = [0]

        def handler(data: memoryview, header) -> None:
            assert int.from_bytes(data[:8], "little") == expected[0]
            expected[0] += 1

        deadline = time.monotonic() + 60
        while expected[0] < count and time.monotonic() < deadline:
            subscription.receive(handler, 1000, timeout=1.0)
        publisher.join(30)
        assert expected[0] == count


def test_an_untethered_subscriber_rejoining_with_the_counters_full_waits_and_rejoins_later(
        driver_dir: Path) -> None:
    """An untethered subscriber left behind rests, and its rest ends while the counters file
    is full: the driver goes on (it crashed there), counts the error, and the subscriber
    tries again after another resting timeout, rejoining once a counter is free."""
    settings = {**FAST_DRIVER_SETTINGS, "counters_capacity": 256, "timer_interval": "100ms",
                "ipc_term_buffer_length": "64k", "untethered_window_limit_timeout": "200ms",
                "untethered_resting_timeout": "6s"}  # longer than filling the counters takes
    with MediaDriver.launch(directory=driver_dir, **settings) as driver, \
            Client.connect(driver_dir) as client:
        publication = client.add_publication("aeron:ipc", 1)
        tethered = client.add_subscription("aeron:ipc", 1)
        untethered = client.add_subscription("aeron:ipc?tether=false", 1)
        wait_for(lambda: tethered.images and untethered.images, what="both images")
        deadline = time.monotonic() + 10
        while untethered.images:  # it never reads: left behind, then unlinked
            assert time.monotonic() < deadline, "the untethered subscriber was not left behind"
            publication.offer(b"x" * 500)
            tethered.poll(lambda data, header: None, 100)
        filler_publication = client.add_publication("aeron:ipc", 2)

        def its_position_counter() -> list[object]:
            return [c for c in client.counters if c.type_id == CounterType.SUBSCRIBER_POSITION
                    and c.registration_id == untethered.registration_id]

        wait_for(lambda: not its_position_counter(), timeout=5, what="it rests (unlinked)")
        time.sleep(1.2)  # the counter it let go is free again (after 1 s): fill that one too
        fillers = []
        with pytest.raises(RegistrationError):
            while True:  # every counter taken
                fillers.append(client.add_subscription("aeron:ipc", 2))
        errors = counters_of(driver)["ERRORS"]  # the refused subscription's among them
        wait_for(lambda: driver.process.poll() is not None
                 or counters_of(driver)["ERRORS"] > errors, timeout=15,
                 what="the rest's end, with no counter for the subscriber")
        assert driver.process.poll() is None, "the driver exited"
        assert not untethered.images
        for filler in fillers:
            filler.close()
        filler_publication.close()
        wait_for(lambda: untethered.images, timeout=20, what="the subscriber rejoined")
