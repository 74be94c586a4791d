"""Multi-destination-cast (docs/CHANNELS.md §7.3) between slipstream and a stock Aeron 1.15.1
driver (Java), both ways, dynamic and manual.

* dynamic: the publication's channel names a control address (``aeron:udp?control=H:P|
  control-mode=dynamic``); each receiver subscribes with ``endpoint=H:Q|control=H:P`` and joins
  by the setup-eliciting status messages (flags 0x80, session 0, stream 0) it sends to H:P every
  second, as Aeron 1.15.1's receivers do.
* manual: the publisher adds each receiver's ``aeron:udp?endpoint=H:Q`` (Aeron 1.15.1 needs
  ``control=`` on a manual channel; slipstream takes one without).

The Aeron end is its driver with our MdcPublisher (tests/aeron_peer/mdc.py: add/remove
destinations and offer on command) or its BasicSubscriber sample.  Payloads carry the message
index first (little-endian i64, as in tests/test_interop.py); every receiver is checked to get
every message once and in order.  Terms of 64 KiB, so each stream rotates terms and crosses
many receiver windows.

The publications to two receivers run under min flow control (Aeron's driver with its
MinMulticastFlowControl, slipstream's ``fc=min``): under max, the default of both, a receiver
that falls far enough behind the fastest is past the sender's resend window, a loss no
protocol recovers.  Min flow control counts receivers by receiver id, one per driver (Aeron
gives every receive endpoint of a driver the same id), so the two receivers of a slipstream
publication are BasicSubscribers of two Aeron drivers (cheap: well under a second each to
start, side by side).

Needs ``scripts/ensure-aeron`` (the jar, Java 11 and the compiled MdcPublisher); under CI=true a
missing peer fails.
"""

from __future__ import annotations

import contextlib
import struct
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import aeron_peer
import pytest
from aeron_peer import AeronDriver, BasicSubscriber, MdcPublisher, basic_subscriber
from helpers import counters_of, free_port, lacking, mdc_destinations, wait_for

from slipstream.client import Client

pytestmark = pytest.mark.timeout(60)

INDEX = struct.Struct("<q")
HOST = "127.0.0.1"
#: The Aeron publications' terms; slipstream's drivers (the ``launch`` fixture) have 64 KiB
#: terms by default.
AERON_TERM = "|term-length=64k"
#: Messages per stream: 1,000 of 1 KiB (1,056 B frames, 62 a term and a padding frame) are
#: ~1 MiB, 16 terms of 64 KiB, each term two of the receivers' windows (half a term).
#: (Aeron's BasicSubscriber prints every message: fewer, longer ones take it less time.)
MESSAGES = 1_000
#: Messages Aeron's manual MDC publication sends at a time (21 KiB: under a receiver window).
BATCH = 20
PAYLOAD = 1024


def require_peer() -> None:
    reason = aeron_peer.peer_available("MdcPublisher")
    if reason is not None:
        lacking(f"the Aeron peer: {reason}")


@pytest.fixture
def aeron() -> Iterator[AeronDriver]:
    """An Aeron driver whose MDC publications hold to their slowest receiver."""
    require_peer()
    with AeronDriver(multicast_flow_control="min") as driver:
        yield driver


def assert_clean(driver) -> None:
    """Every frame the slipstream driver got was valid, and it sent and received without an
    error."""
    counters = counters_of(driver)
    for name in ("ERRORS", "INVALID_PACKETS", "SEND_ERRORS", "RECEIVE_ERRORS"):
        assert counters[name] == 0, (name, counters[name])


def launch_two(launch) -> list:
    """Two slipstream drivers (the ``launch`` fixture's), started side by side."""
    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(lambda _: launch(), range(2)))


class Indexes:
    """What a slipstream subscription reads: the message indexes, in arrival order."""

    def __init__(self, subscription) -> None:
        self.subscription = subscription
        self.seen: list[int] = []

    def _on_message(self, data: memoryview, _header: object) -> None:
        self.seen.append(INDEX.unpack_from(data)[0])

    def poll(self) -> int:
        return self.subscription.poll(self._on_message, 1000)


def read_while(sending: Callable[[], object], readers: list[Indexes], count: int,
               timeout: float = 30.0) -> None:
    """Run ``sending`` in a thread while polling ``readers`` until each has ``count`` messages
    (and the sender is done); then check none came twice (a short quiet look)."""
    failure: list[BaseException] = []

    def send() -> None:
        try:
            sending()
        except BaseException as e:  # reported by the test's thread
            failure.append(e)

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    deadline = time.monotonic() + timeout
    while sender.is_alive() or any(len(r.seen) < count for r in readers):
        assert not failure, failure
        assert time.monotonic() < deadline, (
            f"{[len(r.seen) for r in readers]} of {count} arrived "
            f"(sending {'done' if not sender.is_alive() else 'still going'})")
        if not sum(r.poll() for r in readers):
            time.sleep(0.0005)
    sender.join()
    assert not failure, failure
    time.sleep(0.2)
    for reader in readers:
        reader.poll()


def send_paced(publisher: MdcPublisher, readers: list[Indexes], count: int) -> None:
    """Send ``count`` messages from an Aeron ``publisher`` in batches of :data:`BATCH` (less
    than a receiver window), each once every reader has read the last.  Aeron 1.15.1 runs MDC
    under max flow control, which lets the faster receiver pull the sender past the slower
    one's window; pacing keeps a loaded machine from over-running the slower.  The readers
    are polled by the caller's thread (:func:`read_while`)."""
    for sent in range(BATCH, count + 1, BATCH):
        publisher.send(BATCH)
        deadline = time.monotonic() + 30
        while min(len(r.seen) for r in readers) < sent:
            assert time.monotonic() < deadline, [len(r.seen) for r in readers]
            time.sleep(0.001)


def publish_indexes(publication, count: int, first: int = 0) -> None:
    """Offer messages ``first .. first + count - 1`` (index, then zeros) to a slipstream
    publication, waiting out back pressure."""
    deadline = time.monotonic() + 30
    for index in range(first, first + count):
        payload = INDEX.pack(index) + bytes(PAYLOAD - INDEX.size)
        while publication.offer(payload) < 0:
            assert time.monotonic() < deadline, f"message {index} not taken within 30 s"
            time.sleep(0.0001)


def stream_indexes(publication, readers: list[Indexes], count: int, first: int = 0,
                   timeout: float = 30.0) -> None:
    """Offer messages ``first .. first + count - 1`` to a slipstream publication as fast as it
    takes them, polling ``readers`` (spies that hold it back) in between, until each has read
    ``count`` more."""
    sent = first
    targets = [len(r.seen) + count for r in readers]
    deadline = time.monotonic() + timeout
    while any(len(r.seen) < t for r, t in zip(readers, targets, strict=True)):
        assert time.monotonic() < deadline, (
            f"sent {sent - first}, read {[len(r.seen) for r in readers]} of {targets}")
        while sent < first + count and publication.offer(
                INDEX.pack(sent) + bytes(PAYLOAD - INDEX.size)) > 0:
            sent += 1
        if not sum(r.poll() for r in readers):
            time.sleep(0.0001)


def check_slipstream_received(publisher: MdcPublisher, subscriptions: list,
                              source: str) -> None:
    """``publisher`` (Aeron's) sends MESSAGES paced to ``subscriptions`` (slipstream's):
    each reads every one once, in order, on one image of the publisher's session, from
    ``source``, of 64 KiB terms."""
    readers = [Indexes(s) for s in subscriptions]
    read_while(lambda: send_paced(publisher, readers, MESSAGES), readers, MESSAGES)
    for reader in readers:
        assert reader.seen == list(range(MESSAGES))
        [image] = reader.subscription.images
        assert image.session_id == publisher.session_id
        assert image.source_identity == source
        assert image.term_length == 64 * 1024


def check_aeron_received(subscribers: list[BasicSubscriber], count: int,
                         session_id: int) -> None:
    for subscriber in subscribers:
        subscriber.wait_for_messages(count, timeout=30)
    for subscriber in subscribers:
        received = subscriber.wait_quiet(0.3)  # a duplicate would show up here
        assert subscriber.sequence_numbers() == list(range(count)), subscriber.name
        assert {m.session_id for m in received} == {session_id}


@contextlib.contextmanager
def aeron_subscribers(channels: list[str], stream_id: int) -> Iterator[list[BasicSubscriber]]:
    """One BasicSubscriber per channel, each of its own Aeron driver (see the module
    docstring on receiver ids)."""
    with contextlib.ExitStack() as stack:
        drivers = [AeronDriver() for _ in channels]
        for driver in drivers:  # their JVMs start side by side
            stack.callback(driver.stop)
            driver.start(wait=False)
        for driver in drivers:
            driver.wait_ready()
        yield [stack.enter_context(basic_subscriber(d, uri, stream_id))
               for d, uri in zip(drivers, channels, strict=True)]


# -- Aeron publishes, slipstream receives --------------------------------------------------------
def test_an_aeron_dynamic_mdc_publication_reaches_two_slipstream_drivers_whole(
        aeron: AeronDriver, launch) -> None:
    """Aeron's publication on ``control=H:P|control-mode=dynamic``; two slipstream drivers
    subscribe with ``endpoint=H:Qi|control=H:P``: Aeron learns each from its setup-eliciting
    SMs, sends each the SETUP, and each gets every message once, in order, from the control
    address."""
    control_port = free_port()
    drivers = launch_two(launch)
    with contextlib.ExitStack() as stack:
        clients = [stack.enter_context(Client.connect(d.directory)) for d in drivers]
        subscriptions = [c.add_subscription(
            f"aeron:udp?endpoint={HOST}:{free_port()}|control={HOST}:{control_port}", 2001)
            for c in clients]
        publisher = stack.enter_context(MdcPublisher(
            aeron, f"aeron:udp?control={HOST}:{control_port}|control-mode=dynamic{AERON_TERM}",
            2001, message_length=PAYLOAD))
        # Each joins on its next eliciting SM (within a second of the publication's socket).
        wait_for(lambda: all(s.images for s in subscriptions) and publisher.is_connected(),
                 timeout=10, what="both slipstream receivers joined Aeron's publication")
        check_slipstream_received(publisher, subscriptions, f"{HOST}:{control_port}")
    for driver in drivers:
        assert_clean(driver)


def test_an_aeron_manual_mdc_publication_reaches_the_two_slipstream_drivers_it_adds(
        aeron: AeronDriver, launch) -> None:
    """Aeron's publication on ``control-mode=manual|control=H:P`` adds two slipstream
    drivers' plain unicast endpoints as destinations: each gets the SETUP, answers to the
    control address, and gets every message once, in order.  Aeron 1.15.1 runs it under max
    flow control (its default, and no ``fc=`` key yet), which lets the faster receiver pull
    the sender past the slower one's window: on a loaded machine the slower was over-run
    and left behind (a new image at the next term).  So the messages go in batches of less
    than a receiver window (half the 64 KiB term), each once both have read the last."""
    control_port = free_port()
    drivers = launch_two(launch)
    ports = [free_port() for _ in drivers]
    with contextlib.ExitStack() as stack:
        clients = [stack.enter_context(Client.connect(d.directory)) for d in drivers]
        subscriptions = [c.add_subscription(f"aeron:udp?endpoint={HOST}:{port}", 2002)
                         for c, port in zip(clients, ports, strict=True)]
        publisher = stack.enter_context(MdcPublisher(
            aeron, f"aeron:udp?control-mode=manual|control={HOST}:{control_port}{AERON_TERM}",
            2002, message_length=PAYLOAD))
        for port in ports:
            publisher.add(f"aeron:udp?endpoint={HOST}:{port}")
        wait_for(lambda: all(s.images for s in subscriptions) and publisher.is_connected(),
                 timeout=10, what="both destinations have an image")
        check_slipstream_received(publisher, subscriptions, f"{HOST}:{control_port}")
    for driver in drivers:
        assert_clean(driver)


# -- slipstream publishes, Aeron receives --------------------------------------------------------
def test_a_slipstream_dynamic_mdc_publication_reaches_two_aeron_subscribers_whole(
        launch) -> None:
    """slipstream's publication on ``control=H:P|control-mode=dynamic``; two Aeron
    BasicSubscribers on ``endpoint=H:Qi|control=H:P``: slipstream learns each from the 0/0
    setup-eliciting SMs Aeron 1.15.1's receivers send every second, and each gets every
    message once, in order."""
    require_peer()
    control_port = free_port()
    channels = [f"aeron:udp?endpoint={HOST}:{free_port()}|control={HOST}:{control_port}"
                for _ in range(2)]
    driver = launch()
    with aeron_subscribers(channels, 2003) as subscribers, \
            Client.connect(driver.directory) as client:
        publication = client.add_publication(
            f"aeron:udp?control={HOST}:{control_port}|control-mode=dynamic|fc=min", 2003)
        wait_for(lambda: mdc_destinations(driver) == 2 and publication.is_connected,
                 timeout=10, what="both Aeron receivers joined")
        for subscriber in subscribers:
            subscriber.wait_for_image(timeout=10)
        publish_indexes(publication, MESSAGES)
        check_aeron_received(subscribers, MESSAGES, publication.session_id)
        for subscriber in subscribers:
            [event] = subscriber.images
            assert event.source == f"{HOST}:{control_port}"
    assert_clean(driver)


def test_a_slipstream_manual_mdc_publication_reaches_the_two_aeron_subscribers_it_adds(
        launch) -> None:
    """slipstream's ``control-mode=manual`` publication (no control=, which Aeron 1.15.1
    would need) adds two Aeron BasicSubscribers' endpoints: each gets every message once, in
    order."""
    require_peer()
    ports = [free_port() for _ in range(2)]
    driver = launch()
    with aeron_subscribers([f"aeron:udp?endpoint={HOST}:{p}" for p in ports],
                           2004) as subscribers, \
            Client.connect(driver.directory) as client:
        publication = client.add_publication("aeron:udp?control-mode=manual|fc=min", 2004)
        for port in ports:
            publication.add_destination(f"aeron:udp?endpoint={HOST}:{port}")
        for subscriber in subscribers:
            subscriber.wait_for_image(timeout=10)
        wait_for(lambda: publication.is_connected, timeout=10, what="the publication connected")
        assert mdc_destinations(driver) == 2
        publish_indexes(publication, MESSAGES)
        check_aeron_received(subscribers, MESSAGES, publication.session_id)
    assert_clean(driver)


def test_a_slipstream_spy_reads_what_an_mdc_publication_sends_to_aeron_receivers(
        aeron: AeronDriver, launch) -> None:
    """A spy on slipstream's dynamic MDC publication (its exact channel: control address and
    mode) reads, message for message, what the publication sends to the Aeron receiver that
    joined it.  Then a second Aeron receiver of the same driver joins late: Aeron gives both
    the driver's one receiver id, and slipstream's table keys a destination by its address, so
    it is a second destination, whose image starts at the stream's position then; the next
    messages reach all three.  (The driver's two subscribers, one receiver id, are one
    receiver to flow control: the one that lags may overrun its window and NAK, and the
    retransmission goes to both.  The messages are fewer than a term, so the log still holds
    what it NAKs.)"""
    control_port = free_port()
    uri = f"aeron:udp?control={HOST}:{control_port}|control-mode=dynamic"
    receiver = f"aeron:udp?endpoint={HOST}:{{}}|control={HOST}:{control_port}"
    driver = launch()
    with basic_subscriber(aeron, receiver.format(free_port()), 2005) as subscriber, \
            Client.connect(driver.directory) as client:
        spy = client.add_subscription(f"aeron-spy:{uri}", 2005)
        publication = client.add_publication(uri, 2005)
        wait_for(lambda: spy.images and publication.is_connected, timeout=10,
                 what="the spy linked and the Aeron receiver joined")
        [image] = spy.images
        assert image.session_id == publication.session_id and image.join_position == 0
        assert image.term_length == 64 * 1024
        subscriber.wait_for_image(timeout=10)
        spied = Indexes(spy)
        stream_indexes(publication, [spied], MESSAGES)
        assert spied.seen == list(range(MESSAGES))
        check_aeron_received([subscriber], MESSAGES, publication.session_id)
        assert mdc_destinations(driver) == 1

        more = 40  # 41 KiB of frames
        with basic_subscriber(aeron, receiver.format(free_port()), 2005) as late:
            late.wait_for_image(timeout=10)
            assert mdc_destinations(driver) == 2
            stream_indexes(publication, [spied], more, first=MESSAGES)
            total = MESSAGES + more
            assert spied.seen == list(range(total))
            subscriber.wait_for_messages(total, timeout=30)
            late.wait_for_messages(more, timeout=30)
            assert subscriber.sequence_numbers() == list(range(total))
            assert late.sequence_numbers() == list(range(MESSAGES, total))
    assert_clean(driver)
