"""A graceful stop: on SIGTERM the driver stops granting credit, sends and lets subscribers read
what the logs hold, sends end-of-stream, tells its clients and exits 0, so a stream stopped
mid-flight loses nothing that ``offer()`` accepted.  A second SIGTERM, or ``drain_timeout``,
stops at once."""

from __future__ import annotations

import contextlib
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from helpers import (
    FAST_DRIVER_SETTINGS,
    NETWORK_SETTINGS,
    catches,
    children_take,
    free_port,
    wait_for,
)

from slipstream.client import (
    BACK_PRESSURED,
    CLOSED,
    Client,
    DriverNotRunningError,
    Publication,
    RegistrationError,
    Subscription,
)
from slipstream.daemon.config import load_settings
from slipstream.daemon.driver import MediaDriver

SEQUENCE = struct.Struct("<Q")
TERM = 64 * 1024  # the term length of FAST_DRIVER_SETTINGS (IPC) and NETWORK_SETTINGS (UDP)
WINDOW = TERM // 2  # the publisher's window: half a term


class Publisher(threading.Thread):
    """Offers 0, 1, 2, ... as fast as it can until an offer returns CLOSED; counts what
    ``offer()`` accepted and the results it saw once the driver began to drain."""

    def __init__(self, publication: Publication) -> None:
        super().__init__(daemon=True)
        self.publication = publication
        self.accepted = 0
        self.results_after_signal: list[int] = []
        self.signalled = threading.Event()

    def run(self) -> None:
        payload = bytearray(64)
        while True:
            SEQUENCE.pack_into(payload, 0, self.accepted)
            result = self.publication.offer(payload)
            if result > 0:
                self.accepted += 1
                continue
            if self.signalled.is_set() and (not self.results_after_signal
                                            or self.results_after_signal[-1] != result):
                self.results_after_signal.append(result)
            if result == CLOSED:
                return
            time.sleep(0.0001)


class Subscriber(threading.Thread):
    """Polls (slowly, so the log holds data when the driver is told to stop) until the
    driver is gone; checks every message is the next in sequence."""

    def __init__(self, subscription: Subscription, pause_s: float = 0.0005,
                 hold_within: tuple[int, int] | None = None) -> None:
        """``hold_within=(low, high)``: stop reading once the position within its term is in
        ``[low, high)``, until :attr:`resume` is set (the position stays in :attr:`held_at`)."""
        super().__init__(daemon=True)
        self.subscription = subscription
        self.pause_s = pause_s
        self.hold_within = hold_within
        self.held_at: int | None = None
        self.held = threading.Event()
        self.resume = threading.Event()
        self.received = 0
        self.wrong: list[tuple[int, int]] = []
        self.stop_polling = threading.Event()
        self.ended_by: BaseException | None = None

    def on_message(self, data: memoryview, _header: object) -> None:
        (sequence,) = SEQUENCE.unpack_from(data)
        if sequence != self.received:
            self.wrong.append((self.received, sequence))
        self.received += 1

    def run(self) -> None:
        try:
            while not self.stop_polling.is_set():
                self.subscription.poll(self.on_message, 20)
                time.sleep(self.pause_s)
                if self.hold_within is not None and self.held_at is None:
                    position = self.subscription.images[0].position
                    low, high = self.hold_within
                    if low <= position % TERM < high:
                        self.held_at = position
                        self.held.set()
                        self.resume.wait()
        except DriverNotRunningError as e:
            self.ended_by = e


@pytest.fixture
def launch() -> Iterator[Callable[..., MediaDriver]]:
    stack = contextlib.ExitStack()
    directories: list[Path] = []

    def start(**settings: object) -> MediaDriver:
        directory = Path("/dev/shm") / f"slipstream-drain-{uuid.uuid4().hex[:12]}"
        directories.append(directory)
        return stack.enter_context(MediaDriver.launch(directory=directory, **settings))

    with stack:
        yield start
    for directory in directories:
        shutil.rmtree(directory, ignore_errors=True)


def _backlog(publisher: Publisher, subscriber: Subscriber, window: int) -> int:
    """Once ``subscriber`` holds, wait until ``publisher`` has written ``window`` bytes (less
    a message) beyond it and stopped there, back-pressured; returns the publication's
    position."""
    assert subscriber.held.wait(20), "the subscriber never reached its hold"
    position = subscriber.held_at
    assert position is not None
    wait_for(lambda: publisher.publication.position >= position + window - 1024, timeout=10,
             what=f"a window of backlog beyond {position} (at {publisher.publication.position})")

    def stopped() -> bool:
        before = publisher.publication.position
        time.sleep(0.05)
        return publisher.publication.position == before

    wait_for(stopped, timeout=10, what="the publisher back-pressured")
    end = publisher.publication.position
    assert end // TERM > position // TERM, "the backlog should cross a term's end"
    return end


#: The drain timeout of the streams stopped mid-flight, s: a drain that finishes takes
#: less, one that times out takes all of it.
DRAIN_S = 10


def _sigterm_and_wait(driver: MediaDriver, timeout: float = 20.0,
                      then: Callable[[], object] | None = None) -> tuple[int, float]:
    """SIGTERM, then ``then()`` (a held reader resumes), then wait for the exit."""
    started = time.monotonic()
    driver.process.send_signal(signal.SIGTERM)
    if then is not None:
        time.sleep(0.2)  # the driver begins its drain with the backlog in place
        then()
    code = driver.process.wait(timeout)
    return code, time.monotonic() - started


def _stop_with_a_window_to_drain(driver, publisher: Publisher, subscriber: Subscriber,
                                 flowing_timeout: float) -> tuple[int, float]:
    """Start the stream; once it flows, leave a full window to drain, across a term's end
    (the reader held where a window beyond it is in the next term, until the publisher is
    back-pressured), then SIGTERM ``driver`` and let the reader go on: its exit code and
    the seconds it took."""
    subscriber.start()
    publisher.start()
    wait_for(lambda: publisher.accepted > 20_000, timeout=flowing_timeout,
             what="the stream flowing")
    subscriber.hold_within = (TERM - WINDOW + 1024, TERM - 1024)
    _backlog(publisher, subscriber, WINDOW)
    publisher.signalled.set()
    return _sigterm_and_wait(driver, then=subscriber.resume.set)


def _assert_drained_all_accepted(code: int, took: float, publisher: Publisher,
                                 subscriber: Subscriber) -> None:
    """The driver exited cleanly within its drain timeout, and the subscriber read every
    message an offer accepted, once and intact."""
    assert code == 0
    assert took < DRAIN_S, f"the drain took {took:.1f} s: it should finish, not time out"
    assert subscriber.wrong == []
    assert subscriber.received == publisher.accepted  # every accepted message, once


def test_an_ipc_stream_stopped_mid_flight_loses_nothing_offer_accepted(launch) -> None:
    driver = launch(**{**FAST_DRIVER_SETTINGS, "drain_timeout": f"{DRAIN_S}s"})
    with Client.connect(driver.directory) as client:
        subscriber = Subscriber(client.add_subscription("aeron:ipc", 10))
        publisher = Publisher(client.add_publication("aeron:ipc", 10))
        code, took = _stop_with_a_window_to_drain(driver, publisher, subscriber, 20)
        publisher.join(5)
        subscriber.join(5)
    _assert_drained_all_accepted(code, took, publisher, subscriber)
    assert publisher.results_after_signal == [BACK_PRESSURED, CLOSED]
    assert isinstance(subscriber.ended_by, DriverNotRunningError)
    assert "draining" in str(subscriber.ended_by)


def test_a_udp_stream_stopped_mid_flight_with_loss_loses_nothing_offer_accepted(
        launch) -> None:
    """A receiver window of 8 KiB: the 32-40 KiB left to drain take four or five windows,
    each sent only once a status message gave its credit, and cross a term's end."""
    uri = f"aeron:udp?endpoint=127.0.0.1:{free_port()}"
    receiver_window = 8 * 1024
    sender = launch(**{**NETWORK_SETTINGS, "drain_timeout": f"{DRAIN_S}s"})
    receiver = launch(**NETWORK_SETTINGS, debug_receive_data_loss=50_000,  # 5 %
                      debug_receive_data_loss_seed=11)
    with Client.connect(sender.directory) as ca, Client.connect(receiver.directory) as cb:
        subscription = cb.add_subscription(f"{uri}|rcv-wnd={receiver_window}", 20)
        publication = ca.add_publication(uri, 20)
        wait_for(lambda: publication.is_connected and subscription.images,
                 what="the stream connected")
        subscriber = Subscriber(subscription)
        publisher = Publisher(publication)
        # The publisher's window beyond the sender, itself up to a receiver window ahead.
        code, took = _stop_with_a_window_to_drain(sender, publisher, subscriber, 30)
        publisher.join(5)
        # The receiving side took everything before the sender went, and saw its EOS: the
        # image goes at once, not after the image liveness timeout.
        wait_for(lambda: not subscription.images, timeout=3, what="the image ended by EOS")
        subscriber.stop_polling.set()
        subscriber.join(5)
    _assert_drained_all_accepted(code, took, publisher, subscriber)
    # NOT_CONNECTED between the two: the receiver answered the EOS and left.
    assert publisher.results_after_signal[0] == BACK_PRESSURED
    assert publisher.results_after_signal[-1] == CLOSED


def test_a_subscriber_that_never_reads_holds_the_drain_only_until_drain_timeout(
        launch) -> None:
    """The drain waits out its own drain_timeout, then ends: not sooner, and not at the
    default one's (nor never, for the subscriber that never reads)."""
    drain_timeout_s = 1.5
    default_drain_timeout_s = load_settings(env={}).drain_timeout / 1e9
    driver = launch(**{**FAST_DRIVER_SETTINGS, "drain_timeout": f"{drain_timeout_s:g}s"})
    with Client.connect(driver.directory) as client:
        client.add_subscription("aeron:ipc", 30)  # never polled
        publication = client.add_publication("aeron:ipc", 30)
        wait_for(lambda: publication.is_connected, what="connected")
        while publication.offer(b"x" * 100) > 0:  # fill the window
            pass
        started = time.monotonic()
        driver.process.send_signal(signal.SIGTERM)
        # Draining: no new streams, and the publication has no credit.
        with pytest.raises(RegistrationError, match="draining"):
            wait_for(lambda: client.add_publication("aeron:ipc", 31) and False, timeout=1)
        assert publication.offer(b"x") == BACK_PRESSURED
        code = driver.process.wait(default_drain_timeout_s)
        took = time.monotonic() - started
        wait_for(lambda: publication.offer(b"x") == CLOSED, what="CLOSED")
    assert code == 0
    # Its clock starts at the signal, after ``started``; the room above it, half the way to
    # the default's, is a loaded machine's for the end-of-stream and the exit.
    assert drain_timeout_s <= took < (drain_timeout_s + default_drain_timeout_s) / 2, took


def test_an_untethered_subscriber_is_owed_the_log_through_the_drivers_drain(launch) -> None:
    """Credit stopped, nothing is held back any more: an untethered subscriber a window
    behind for longer than its window limit timeout is not left behind while the driver
    drains (it was, and the drain then said every log was read: a review's find)."""
    driver = launch(**{**FAST_DRIVER_SETTINGS, "drain_timeout": "5s"})
    with Client.connect(driver.directory) as client:
        subscription = client.add_subscription(
            "aeron:ipc?tether=false|untethered-window-limit-timeout=1s", 12)
        publication = client.add_publication("aeron:ipc", 12)
        wait_for(lambda: publication.is_connected)
        sent = 0
        while publication.offer(SEQUENCE.pack(sent)) > 0:  # a window: it does not read yet
            sent += 1
        driver.process.send_signal(signal.SIGTERM)  # well within the 1 s
        time.sleep(2.5)  # past the window limit timeout, twice, into the drain
        got: list[int] = []
        while len(got) < sent:
            assert subscription.poll(
                lambda data, _h: got.append(SEQUENCE.unpack_from(data)[0]), 100) > 0, len(got)
        assert got == list(range(sent))
        assert driver.process.wait(10) == 0


def test_a_second_sigterm_stops_at_once(launch) -> None:
    """Well before the drain_timeout (a minute) that a first SIGTERM alone would wait."""
    drain_timeout_s = 60
    driver = launch(**{**FAST_DRIVER_SETTINGS, "drain_timeout": f"{drain_timeout_s}s"})
    with Client.connect(driver.directory) as client:
        client.add_subscription("aeron:ipc", 40)  # never polled
        publication = client.add_publication("aeron:ipc", 40)
        wait_for(lambda: publication.is_connected, what="connected")
        while publication.offer(b"x" * 100) > 0:
            pass
        started = time.monotonic()
        driver.process.send_signal(signal.SIGTERM)
        with pytest.raises(RegistrationError, match="draining"):
            wait_for(lambda: client.add_publication("aeron:ipc", 41) and False,
                     timeout=drain_timeout_s / 4)
        driver.process.send_signal(signal.SIGTERM)
        code = driver.process.wait(drain_timeout_s / 2)
    assert code == 0
    assert time.monotonic() - started < drain_timeout_s / 2


def test_a_hangup_drains_and_cleans_up_as_sigterm_does(launch) -> None:
    """A driver run in the foreground of a terminal that hangs up (an SSH session that drops)
    gets SIGHUP: it drains what its logs hold, exits 0 and removes its directory (Python's
    default killed it, leaving its logs in /dev/shm).  Its SIGHUP starts at the default
    whatever this process ignores (a driver started ignoring it keeps it ignored: below)."""
    drain_timeout_s = 10.0
    with children_take(signal.SIGHUP):
        driver = launch(**{**FAST_DRIVER_SETTINGS, "drain_timeout": f"{drain_timeout_s:g}s"})
    with Client.connect(driver.directory) as client:
        subscription = client.add_subscription("aeron:ipc", 50)
        publication = client.add_publication("aeron:ipc", 50)
        wait_for(lambda: publication.is_connected, what="connected")
        sent: list[bytes] = []
        while publication.offer(payload := struct.pack("<q", len(sent)) + bytes(92)) > 0:
            sent.append(payload)  # a window, unread
        assert catches(driver.pid, signal.SIGHUP), "the driver does not watch SIGHUP"
        driver.process.send_signal(signal.SIGHUP)
        # The drain shows (new registrations refused) well within its timeout, after which
        # the driver would stop and nothing could be refused any more.
        with pytest.raises(RegistrationError, match="draining"):
            wait_for(lambda: client.add_publication("aeron:ipc", 51) and False,
                     timeout=drain_timeout_s / 2)
        received: list[bytes] = []
        deadline = time.monotonic() + 10
        while driver.process.poll() is None:
            assert time.monotonic() < deadline, "the driver did not stop after its drain"
            with contextlib.suppress(DriverNotRunningError):
                subscription.poll(lambda data, _h: received.append(bytes(data)), 100)
    assert driver.process.wait(5) == 0
    assert received == sent and len(sent) >= WINDOW // 160  # 100-byte messages take 160
    assert not driver.directory.exists()


def test_a_driver_started_ignoring_hangups_keeps_running_through_one() -> None:
    """``nohup slipstream driver &`` (or tmux, or a parent that ignores SIGHUP): the hangup
    it was started ignoring stays ignored, and the driver serves on."""
    directory = Path("/dev/shm") / f"slipstream-drain-{uuid.uuid4().hex[:12]}"
    process = subprocess.Popen(
        [sys.executable, "-m", "slipstream.daemon.cli", "driver", "--dir", str(directory)],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    try:
        def serving() -> bool:
            with contextlib.suppress(DriverNotRunningError):
                Client.connect(directory).close()
                return True
            return False

        wait_for(serving, timeout=20, what="the driver serving")
        process.send_signal(signal.SIGHUP)
        time.sleep(1.0)
        assert process.poll() is None and serving()
        process.send_signal(signal.SIGTERM)
        assert process.wait(10) == 0
        assert not directory.exists()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(5)
        shutil.rmtree(directory, ignore_errors=True)
