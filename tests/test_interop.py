"""A stock Aeron driver (Java 1.15.1) and slipstream exchange streams in both directions.

Aeron's own samples are the other end (tests/aeron_peer/): StreamingPublisher puts the
message index first in each payload (little-endian i64), BasicSubscriber prints every message
it gets.  Every test checks every message arrived once and in order; with loss injected on the
receiving side, the NAKs and retransmissions cross between the two implementations.

Needs ``scripts/ensure-aeron`` (``make test`` runs it); under CI=true a missing peer fails.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import random
import signal
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import aeron_peer
import pytest
from aeron_peer import (
    DEFAULT_LIVENESS_NS,
    AeronDriver,
    MdcPublisher,
    basic_subscriber,
    streaming_publisher,
)
from helpers import (
    FAST_DRIVER_SETTINGS,
    counters_labelled,
    free_port,
    lacking,
    offer_with_aborted_claims,
    wait_for,
)

from slipstream.client import Client, control
from slipstream.client.counters import (
    CountersFile,
    CounterType,
    SystemCounter,
    read_system_counters,
)
from slipstream.daemon.driver import MediaDriver

pytestmark = pytest.mark.timeout(120)

INDEX = struct.Struct("<q")


def require_aeron() -> None:
    reason = aeron_peer.aeron_available()
    if reason is not None:
        lacking(f"the Aeron peer: {reason}")



#: Publications use terms of 256 KiB: the receiver window stays the default 128 KiB (half a
#: term), and a stream of 20,000 messages of 64 B rotates terms seven times.
TERM = "|term-length=256k"


def channel(kind: str) -> str:
    if kind == "unicast":
        return f"aeron:udp?endpoint=127.0.0.1:{free_port()}"
    return (f"aeron:udp?endpoint=224.0.3.{random.randrange(1, 250, 2)}:{free_port()}"
            f"|interface=127.0.0.1")


def publish_indices(publication, messages: int) -> None:
    """Once Aeron's status messages connect ``publication``, offer messages 0 .. messages - 1
    (each its index, little-endian i64, then 56 zero bytes), waiting out back pressure."""
    wait_for(lambda: publication.is_connected, timeout=20,
             what="Aeron's status messages connected the publication")
    for index in range(messages):
        payload = INDEX.pack(index) + bytes(56)
        while publication.offer(payload) < 0:
            time.sleep(0.0001)


def read_indices(subscription, messages: int, *, failure: list[BaseException] | None = None,
                 between: Callable[[list[int]], object] = lambda _seen: None) -> list[int]:
    """Poll ``subscription`` until ``messages`` messages of publish_indices' form arrived,
    within 60 s and while ``failure`` (the publishing thread's) stays empty: their indices
    in arrival order.  ``between`` runs after each poll, given the indices so far."""
    seen: list[int] = []
    deadline = time.monotonic() + 60
    while len(seen) < messages:
        assert not failure, failure
        assert time.monotonic() < deadline, f"{len(seen)} of {messages} arrived"
        if not subscription.poll(lambda data, _h: seen.append(INDEX.unpack_from(data)[0]),
                                 1000):
            time.sleep(0.0005)
        between(seen)
    return seen


@pytest.fixture
def slipstream_driver(driver_dir: Path) -> Iterator[MediaDriver]:
    with MediaDriver.launch(directory=driver_dir, **FAST_DRIVER_SETTINGS) as driver:
        yield driver


def counter(driver: MediaDriver, which: SystemCounter) -> int:
    return read_system_counters(driver.directory)[which]


@pytest.mark.parametrize("loss", [0, 50_000], ids=["lossless", "5%-loss-at-slipstream"])
@pytest.mark.parametrize("kind", ["unicast", "multicast"])
def test_aeron_publishes_and_slipstream_receives_every_message_once_in_order(
        driver_dir: Path, kind: str, loss: int) -> None:
    require_aeron()
    uri, messages = channel(kind), 20_000
    with AeronDriver() as aeron, MediaDriver.launch(
            directory=driver_dir, debug_receive_data_loss=loss, debug_receive_data_loss_seed=11,
            **FAST_DRIVER_SETTINGS) as slipstream_driver, \
            Client.connect(slipstream_driver.directory) as client:
        subscription = client.add_subscription(uri, 1001)
        failure: list[BaseException] = []

        def publish() -> None:
            try:
                streaming_publisher(aeron, uri + TERM, 1001, message_length=64,
                                    messages=messages)
            except BaseException as e:  # reported by the test thread
                failure.append(e)

        publisher = threading.Thread(target=publish, daemon=True)
        publisher.start()
        # The image is taken while it delivers: once Aeron's publisher closes, its end of
        # stream removes the image, which can happen before the last poll returns.
        images: list = []

        def take_image(seen: list[int]) -> None:
            if seen and not images:
                images.extend(subscription.images)

        seen = read_indices(subscription, messages, failure=failure, between=take_image)
        publisher.join(30)
        assert seen == list(range(messages))
        [image] = images
        assert image.source_identity.startswith("127.0.0.1:")
        if loss:
            assert counter(slipstream_driver, SystemCounter.DEBUG_DATA_LOSS_DROPS) > 0
            assert counter(slipstream_driver, SystemCounter.NAK_MESSAGES_SENT) > 0
            assert aeron.counter("Retransmits sent") > 0


@pytest.mark.parametrize("loss", [0.0, 0.05], ids=["lossless", "5%-loss-at-aeron"])
@pytest.mark.parametrize("kind", ["unicast", "multicast"])
def test_slipstream_publishes_and_aeron_receives_every_message_once_in_order(
        slipstream_driver: MediaDriver, kind: str, loss: float) -> None:
    require_aeron()
    uri, messages = channel(kind), 20_000
    with AeronDriver(receive_data_loss_rate=loss, receive_data_loss_seed=5) as aeron, \
            basic_subscriber(aeron, uri, 1002) as subscriber, \
            Client.connect(slipstream_driver.directory) as client:
        publication = client.add_publication(uri + TERM, 1002)
        publish_indices(publication, messages)
        subscriber.wait_for_messages(messages, timeout=60)
        received = subscriber.wait_quiet(0.3)  # a duplicate would show up here
        assert subscriber.sequence_numbers() == list(range(messages))
        assert {m.session_id for m in received} == {publication.session_id}
        if loss:
            assert aeron.counter("NAKs sent") > 0
            wait_for(lambda: counter(slipstream_driver, SystemCounter.RETRANSMITS_SENT) > 0)
        publication.close()
        # slipstream's end of stream reaches Aeron: its image goes away.
        subscriber.wait_for_image(timeout=15, available=False)


@pytest.mark.parametrize("loss", [0.0, 0.05], ids=["lossless", "5%-loss-at-aeron"])
def test_aeron_reads_past_the_aborted_claims_of_a_slipstream_publication(
        slipstream_driver: MediaDriver, loss: float) -> None:
    """slipstream's aborted claims are PADs of the claims' frame lengths, mostly not multiples
    of 32, as Aeron's own: a stock Aeron subscriber steps over every one (with loss, Aeron NAKs
    the lost ones and slipstream resends their headers) and gets every message offered after
    them once and in order, through four 256 KiB terms."""
    require_aeron()
    uri, messages = channel("unicast"), 5_000
    with AeronDriver(receive_data_loss_rate=loss, receive_data_loss_seed=5) as aeron, \
            basic_subscriber(aeron, uri, 1003) as subscriber, \
            Client.connect(slipstream_driver.directory) as client:
        publication = client.add_publication(uri + TERM, 1003)
        wait_for(lambda: publication.is_connected, timeout=20,
                 what="Aeron's status messages connected the publication")
        aborted = offer_with_aborted_claims(publication, messages, 7,
                                            lambda i: INDEX.pack(i) + bytes(56))
        subscriber.wait_for_messages(messages, timeout=60)
        subscriber.wait_quiet(0.3)  # a duplicate would show up here
        assert subscriber.sequence_numbers() == list(range(messages))
        assert aborted > messages // 7
        assert publication.position > 3 * 256 * 1024
        if loss:
            assert aeron.counter("NAKs sent") > 0
            wait_for(lambda: counter(slipstream_driver, SystemCounter.RETRANSMITS_SENT) > 0)


@pytest.mark.parametrize("loss", [0, 50_000], ids=["lossless", "5%-loss-at-slipstream"])
def test_slipstream_reads_past_the_aborted_claims_of_an_aeron_publication(
        driver_dir: Path, loss: int) -> None:
    """Aeron's BufferClaim.abort leaves a PAD of the claim's frame length (32 + payload) and
    its sender sends that header as it is: the slipstream receiver inserts it (with loss,
    NAKs it and takes Aeron's resend) and its subscriber gets every message after each
    aborted claim, through six 64 KiB terms, no datagram refused."""
    reason = aeron_peer.peer_available("MdcPublisher")
    if reason is not None:
        lacking(f"the Aeron peer: {reason}")
    uri, messages = channel("unicast"), 3_000
    with AeronDriver() as aeron, MediaDriver.launch(
            directory=driver_dir, debug_receive_data_loss=loss, debug_receive_data_loss_seed=3,
            **FAST_DRIVER_SETTINGS) as slipstream_driver, \
            Client.connect(slipstream_driver.directory) as client, \
            MdcPublisher(aeron, uri + "|term-length=64k", 1004, message_length=64) as publisher:
        subscription = client.add_subscription(uri, 1004)
        wait_for(publisher.is_connected, timeout=20, what="the Aeron publication connected")
        failure: list[BaseException] = []

        def publish() -> None:
            try:
                publisher.send(messages, abort_every=7)
            except BaseException as e:  # reported by the test thread
                failure.append(e)

        sender = threading.Thread(target=publish, daemon=True)
        sender.start()
        seen = read_indices(subscription, messages, failure=failure)
        sender.join(30)
        assert not failure, failure
        assert seen == list(range(messages))
        assert publisher.position() > 5 * 64 * 1024
        assert counter(slipstream_driver, SystemCounter.INVALID_PACKETS) == 0
        if loss:
            assert counter(slipstream_driver, SystemCounter.DEBUG_DATA_LOSS_DROPS) > 0
            assert aeron.counter("Retransmits sent") > 0


@pytest.mark.parametrize("loss", [0, 50_000], ids=["lossless", "5%-loss-at-slipstream"])
def test_aeron_publishes_to_an_embedded_driver_in_invoker_mode(driver_dir: Path,
                                                                 loss: int) -> None:
    """The embedded driver (no threads: the test's loop runs it) speaks the same protocol."""
    require_aeron()
    uri, messages = channel("unicast"), 20_000
    with AeronDriver() as aeron, MediaDriver.embedded(
            driver_dir, debug_receive_data_loss=loss, debug_receive_data_loss_seed=11,
            **FAST_DRIVER_SETTINGS) as driver, \
            Client.connect(driver.directory, invoker=driver.do_work) as client:
        subscription = client.add_subscription(uri, 1003)
        publisher = threading.Thread(target=streaming_publisher, daemon=True, args=(
            aeron, uri + TERM, 1003), kwargs={"message_length": 64, "messages": messages})
        publisher.start()
        seen: list[int] = []
        deadline = time.monotonic() + 60
        while len(seen) < messages:
            assert time.monotonic() < deadline, f"{len(seen)} of {messages} arrived"
            client.do_work()
            subscription.poll(lambda data, _h: seen.append(INDEX.unpack_from(data)[0]), 1000)
        publisher.join(30)
        assert seen == list(range(messages))
        if loss:
            counters = read_system_counters(driver.directory)
            assert counters[SystemCounter.NAK_MESSAGES_SENT] > 0
            assert aeron.counter("Retransmits sent") > 0


def test_an_embedded_driver_in_invoker_mode_publishes_to_aeron(driver_dir: Path) -> None:
    require_aeron()
    uri, messages = channel("unicast"), 20_000
    with AeronDriver(receive_data_loss_rate=0.05, receive_data_loss_seed=5) as aeron, \
            basic_subscriber(aeron, uri, 1004) as subscriber, \
            MediaDriver.embedded(driver_dir, **FAST_DRIVER_SETTINGS) as driver, \
            Client.connect(driver.directory, invoker=driver.do_work) as client:
        publication = client.add_publication(uri + TERM, 1004)
        deadline = time.monotonic() + 20
        while not publication.is_connected:
            assert time.monotonic() < deadline, "Aeron's status messages never came"
            client.do_work()
        for index in range(messages):
            payload = INDEX.pack(index) + bytes(56)
            while publication.offer(payload) < 0:
                client.do_work()
        deadline = time.monotonic() + 60
        while len(subscriber.messages) < messages:  # the repairs need the driver running
            assert time.monotonic() < deadline
            client.do_work()
        end = time.monotonic() + 0.3  # a duplicate would show up here
        while time.monotonic() < end:
            client.do_work()
        assert subscriber.sequence_numbers() == list(range(messages))
        assert aeron.counter("NAKs sent") > 0
        assert read_system_counters(driver.directory)[SystemCounter.RETRANSMITS_SENT] > 0


def test_a_slipstream_driver_stopped_mid_stream_drains_into_aeron_losing_nothing(
        driver_dir: Path) -> None:
    """SIGTERM while publishing to Aeron's subscriber (5 % loss at Aeron): the drain waits
    for Aeron's status messages to reach the end, sends EOS, and Aeron has every message
    offer() accepted, once, in order."""
    from test_drain import Publisher

    require_aeron()
    uri = channel("unicast")
    with MediaDriver.launch(directory=driver_dir, **{**FAST_DRIVER_SETTINGS,
                                                      "drain_timeout": "10s"}) as driver, \
            AeronDriver(receive_data_loss_rate=0.05, receive_data_loss_seed=9) as aeron, \
            basic_subscriber(aeron, uri, 1004) as subscriber, \
            Client.connect(driver_dir) as client:
        publication = client.add_publication(uri + TERM, 1004)
        wait_for(lambda: publication.is_connected, timeout=20,
                 what="Aeron's status messages connected the publication")
        publisher = Publisher(publication)
        publisher.start()
        wait_for(lambda: publisher.accepted > 20_000, timeout=60, what="the stream flowing")
        publisher.signalled.set()
        started = time.monotonic()
        driver.process.send_signal(signal.SIGTERM)
        code = driver.process.wait(30)
        took = time.monotonic() - started
        publisher.join(5)
        subscriber.wait_for_messages(publisher.accepted, timeout=30)
        subscriber.wait_quiet(0.3)
        assert subscriber.sequence_numbers() == list(range(publisher.accepted))
        subscriber.wait_for_image(timeout=15, available=False)
    assert code == 0
    assert took < 8, f"the drain took {took:.1f} s: Aeron's SMs never reached the end"


@pytest.mark.parametrize("kind", ["unicast", "multicast"])
def test_a_nak_strength_sender_streams_to_aeron_exactly_as_without_it(
        slipstream_driver: MediaDriver, kind: str) -> None:
    """rc=nak-strength facing a stock receiver: Aeron gets the announcements (with the first
    SETUP, to the new receiver, then every second) and drops them unread; it never signals,
    so the sender never cuts its rate and the stream goes as without rc=."""
    from slipstream.client.frames import RateAnnounce, decode

    require_aeron()
    uri, messages = channel(kind), 20_000
    announces: list[RateAnnounce] = []
    tapping, listening = threading.Event(), threading.Event()
    tapping.set()

    def tap(group: str, port: int) -> None:
        """A listener on the group (multicast: what the Aeron receiver gets, it gets too)."""
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((group, port))
            sock.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP,
                            socket.inet_aton(group) + socket.inet_aton("127.0.0.1"))
            sock.settimeout(0.1)
            listening.set()
            while tapping.is_set():
                with contextlib.suppress(TimeoutError):
                    frame = decode(sock.recv(65536))
                    if isinstance(frame, RateAnnounce):
                        announces.append(frame)

    with AeronDriver() as aeron, basic_subscriber(aeron, uri, 1005) as subscriber, \
            Client.connect(slipstream_driver.directory) as client:
        tapper = None
        if kind == "multicast":
            group, port = uri.split("endpoint=")[1].split("|")[0].rsplit(":", 1)
            tapper = threading.Thread(target=tap, args=(group, int(port)), daemon=True)
            tapper.start()
            assert listening.wait(5), "the tap did not join the group"  # before the first
        errors = aeron.counter("Errors")
        publication = client.add_publication(uri + TERM + "|rc=nak-strength", 1005)
        wait_for(lambda: publication.is_connected, timeout=20,
                 what="Aeron's status messages connected the publication")
        started = time.monotonic()
        publish_indices(publication, messages)
        subscriber.wait_for_messages(messages, timeout=60)
        time.sleep(max(0.0, 1.2 - (time.monotonic() - started)))  # a periodic one as well
        subscriber.wait_quiet(0.3)
        tapping.clear()
        if tapper is not None:
            tapper.join(5)
        assert subscriber.sequence_numbers() == list(range(messages))
        assert aeron.counter("Errors") == errors
        for which in (SystemCounter.RATE_SIGNALS_RECEIVED, SystemCounter.RATE_CUTS,
                      SystemCounter.INVALID_PACKETS):
            assert counter(slipstream_driver, which) == 0, which
        if kind == "multicast":  # on the group, the Aeron receiver had them as well
            ours = [a for a in announces if a.session_id == publication.session_id]
            assert len(ours) >= 2, announces  # the first with the SETUP, then every second


@pytest.mark.parametrize("kind", ["unicast", "multicast"])
def test_a_stock_aeron_cubic_receiver_measures_its_round_trip_through_a_slipstream_sender(
        slipstream_driver: MediaDriver, kind: str) -> None:
    """Aeron 1.15.1's CubicCongestionControl measuring round trips: its image sends a
    REPLY-flagged RTTM to slipstream's sender, which echoes it with its receiver id (to the
    group, for multicast, where the receiver's socket listens).  Aeron's ``rcv-cc-cubic-rtt``
    counter, 0 until an echo comes back, then holds the round trip; every message arrives
    under its CUBIC window.  (Aeron 1.15.1 sends its later RTTMs as empty datagrams, which
    slipstream counts as invalid packets: docs/DRIVER.md §4.5.)

    Aeron 1.15.1's image drops data past its last SM's window, so a cut after a loss (a
    datagram its socket had no room for, on a busy machine) strands what was in flight until
    the window grows back, seconds later (§4.5): its socket is asked for 2 MiB (at least the
    128 KiB window with room to spare, even where the kernel caps it lower), and its image
    gets Aeron's default liveness timeout rather than the tests' 2 s, which ended the image
    and the subscriber missed the stranded messages."""
    require_aeron()
    uri, messages = channel(kind), 20_000
    with AeronDriver(cubic=True,
                     properties={"aeron.CubicCongestionControl.measureRtt": True,
                                 "aeron.socket.so_rcvbuf": 2 * 1024 * 1024,
                                 "aeron.image.liveness.timeout": DEFAULT_LIVENESS_NS}) as aeron, \
            basic_subscriber(aeron, uri, 1007) as subscriber, \
            Client.connect(slipstream_driver.directory) as client:
        publication = client.add_publication(uri + TERM, 1007)
        publish_indices(publication, messages)
        subscriber.wait_for_messages(messages, timeout=60)
        assert subscriber.sequence_numbers() == list(range(messages))
        aeron.wait_for_counter("rcv-cc-cubic-rtt")

        def round_trips() -> list[int]:
            return [c.value for c in aeron.counters() if c.label.startswith("rcv-cc-cubic-rtt")]

        def measured() -> bool:
            rtts = round_trips()
            return bool(rtts) and all(0 < rtt < 100_000_000 for rtt in rtts)

        wait_for(measured, timeout=10, what="Aeron's image measured a round trip")


@pytest.mark.parametrize("kind", ["unicast", "multicast"])
def test_a_slipstream_cubic_receiver_measures_its_round_trip_through_a_stock_aeron_sender(
        driver_dir: Path, kind: str) -> None:
    """The other way: slipstream's image under ``cc=cubic`` (round trips measured) sends
    REPLY-flagged RTTMs to a stock Aeron sender, whose echoes give it a round trip.  Its
    ``rcv-cc-cubic-rtt`` counter (type 10, Aeron's PerImageIndicator), 0 until an echo came
    back, holds it while the stream runs; ``rcv-cc-cubic-wnd`` its window (bytes, whole
    datagrams of the sender's MTU)."""
    require_aeron()
    uri, messages = channel(kind), 20_000
    with AeronDriver() as aeron, MediaDriver.launch(
            directory=driver_dir, cubic_measure_rtt=True,
            **FAST_DRIVER_SETTINGS) as slipstream_driver, \
            Client.connect(slipstream_driver.directory) as client, \
            contextlib.closing(CountersFile(slipstream_driver.directory / control.COUNTERS_FILE,
                                            writable=False)) as counters:
        subscription = client.add_subscription(uri + "|cc=cubic", 1008)
        publisher = threading.Thread(target=streaming_publisher, daemon=True, args=(
            aeron, uri + TERM, 1008), kwargs={"message_length": 64, "messages": messages})
        publisher.start()
        indicators: dict[str, set[int]] = {"rcv-cc-cubic-rtt": set(), "rcv-cc-cubic-wnd": set()}
        look = [0.0]

        def read_indicators(_seen: list[int]) -> None:
            if time.monotonic() > look[0]:  # while the image (and its counters) is there
                look[0] = time.monotonic() + 0.005
                for info in counters:
                    if info.type_id == CounterType.PER_IMAGE_INDICATOR:
                        indicators[info.label.split(":")[0]].add(info.value)

        seen = read_indices(subscription, messages, between=read_indicators)
        publisher.join(30)
        assert seen == list(range(messages))
        mtu = 1408  # Aeron's sender's default
        assert any(0 < rtt < 100_000_000 for rtt in indicators["rcv-cc-cubic-rtt"]), indicators
        windows = indicators["rcv-cc-cubic-wnd"]  # never 0: the counter starts at the window
        assert windows and all(w > 0 and w % mtu == 0 for w in windows), (windows, mtu)
        assert aeron.counter("Errors") == 0


def test_aeron_drops_a_nak_strength_signal_without_effect(driver_dir: Path) -> None:
    """Signals sent to a stock sender's control address (where a slipstream receiver's would
    go) change nothing: its stream to slipstream arrives whole, and a slipstream receiver of
    a stock sender, which never announces itself, sends none."""
    from slipstream.client.frames import RateSignal

    require_aeron()
    uri, messages = channel("unicast"), 20_000
    with AeronDriver() as aeron, MediaDriver.launch(
            directory=driver_dir, **FAST_DRIVER_SETTINGS) as slipstream_driver, \
            Client.connect(slipstream_driver.directory) as client:
        subscription = client.add_subscription(uri, 1006)
        publisher = threading.Thread(target=streaming_publisher, daemon=True, args=(
            aeron, uri + TERM, 1006), kwargs={"message_length": 64, "messages": messages})
        publisher.start()
        wait_for(lambda: subscription.images, timeout=20, what="Aeron's image")
        [image] = subscription.images
        host, port = image.source_identity.rsplit(":", 1)
        nak_signal = RateSignal(image.session_id, 1006, 1000, 100, 1000).encode()
        errors = aeron.counter("Errors")
        seen: list[int] = []
        deadline = time.monotonic() + 60
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as raw:
            while len(seen) < messages:
                assert time.monotonic() < deadline, f"{len(seen)} of {messages} arrived"
                if len(seen) % 10 == 0 and len(seen) < messages // 2:
                    raw.sendto(nak_signal, (host, int(port)))
                if not subscription.poll(
                        lambda data, _h: seen.append(INDEX.unpack_from(data)[0]), 100):
                    time.sleep(0.0005)
        publisher.join(30)
        assert seen == list(range(messages))
        assert aeron.counter("Errors") == errors
        assert counter(slipstream_driver, SystemCounter.RATE_SIGNALS_SENT) == 0


#: A group tag, and the same 8 bytes (little-endian, as slipstream's SM carries ``gtag=``) in
#: hex, as Aeron 1.15.1 takes application-specific feedback: its PreferredMulticastFlowControl
#: compares the first 4 bytes after the SM header with its ``asf`` property's, and its
#: receivers append ``aeron.flow.control.sm.applicationSpecificFeedback`` there.
GROUP_TAG = 0x5EED_0007
GROUP_TAG_ASF = GROUP_TAG.to_bytes(8, "little", signed=True).hex()


#: How long the slow-receiver test waits for a message before giving up, s: its stream
#: (12,000 messages at 4,000 a second) takes 3 s, its publisher a JVM's start first; a loaded
#: machine stretches both, and the wait starts again with each message that arrives.
PROGRESS_WAIT_S = 60.0


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", ["min", "preferred"])
def test_a_stock_aeron_sender_under_min_or_preferred_holds_to_a_slow_slipstream_receiver(
        driver_dir: Path, strategy: str) -> None:
    """Aeron 1.15.1's MinMulticastFlowControl, or its PreferredMulticastFlowControl with the
    slow receiver tagged (chosen per driver there), reads slipstream's status messages as its
    own receivers': two slipstream drivers receive, one whose subscriber takes 4,000 messages a
    second (under preferred the only one with ``gtag=``), and both get all 12,000 from where
    they joined, once, in order.  (Under Aeron's default max the slow one falls half a 256 KiB
    term behind within 0.1 s.)"""
    require_aeron()
    uri, messages = channel("multicast"), 12_000
    other_dir = driver_dir.parent / (driver_dir.name + "-b")
    # Aeron's default liveness (10 s), not the fast 2 s: Aeron 1.15.1's client takes the
    # driver's client liveness timeout as its own conductor's limit too, and a JVM starved
    # of the cores for 2 s (a loaded machine's) ends its StreamingPublisher with a
    # ConductorServiceTimeoutException before it sends anything.  Likewise the flow controls
    # forget a receiver silent for their receiver timeout (2 s): slipstream's status
    # messages go every 200 ms or sooner, so only a starved machine is silent that long.
    properties: dict[str, int | str] = {
        "aeron.client.liveness.timeout": DEFAULT_LIVENESS_NS,
        "aeron.MinMulticastFlowControl.receiverTimeout": DEFAULT_LIVENESS_NS,
        "aeron.PreferredMulticastFlowControl.receiverTimeout": DEFAULT_LIVENESS_NS}
    if strategy == "preferred":
        properties["aeron.PreferredMulticastFlowControl.asf"] = GROUP_TAG_ASF
    slow_uri = f"{uri}|gtag={GROUP_TAG}" if strategy == "preferred" else uri
    with AeronDriver(multicast_flow_control=strategy, properties=properties) as aeron, \
            MediaDriver.launch(
            directory=driver_dir, **FAST_DRIVER_SETTINGS) as fast_driver, MediaDriver.launch(
            directory=other_dir, **FAST_DRIVER_SETTINGS) as slow_driver, \
            Client.connect(fast_driver.directory) as fast_client, \
            Client.connect(slow_driver.directory) as slow_client:
        fast = fast_client.add_subscription(uri, 1007)
        slow = slow_client.add_subscription(slow_uri, 1007)
        failure: list[BaseException] = []

        def publish() -> None:
            try:
                streaming_publisher(aeron, uri + TERM, 1007, message_length=64,
                                    messages=messages, timeout=240)
            except BaseException as e:
                failure.append(e)

        publisher = threading.Thread(target=publish, daemon=True)
        publisher.start()
        seen: tuple[list[int], list[int]] = ([], [])
        # Waits while the stream moves: a stream that stops (a sender that no longer holds
        # to the slow receiver leaves it a gap it never fills) fails PROGRESS_WAIT_S after
        # its last message, and every wait ends within the cap.
        cap = time.monotonic() + 240
        deadline, arrived = time.monotonic() + PROGRESS_WAIT_S, 0
        start: float | None = None
        while not all(s and s[-1] == messages - 1 for s in seen):
            now = time.monotonic()
            if len(seen[0]) + len(seen[1]) > arrived:
                arrived = len(seen[0]) + len(seen[1])
                deadline = now + PROGRESS_WAIT_S
            assert not failure, failure  # StreamingPublisher failed: nothing more comes
            assert now < min(deadline, cap), (
                f"{[len(s) for s in seen]} of {messages}, from {[s[:1] for s in seen]}")
            fast.poll(lambda data, _h: seen[0].append(INDEX.unpack_from(data)[0]), 1000)
            if slow.images and start is None:
                start = time.monotonic()
            allowed = 0 if start is None else int((time.monotonic() - start) * 4000) + 1
            if allowed > len(seen[1]):
                slow.poll(lambda data, _h: seen[1].append(INDEX.unpack_from(data)[0]),
                          min(100, allowed - len(seen[1])))
            time.sleep(0.0002)
        publisher.join(30)
        assert not failure, failure
        # Aeron's sender sends once one receiver has connected: the other joins where the
        # stream is when its image is made, the start on a quiet host, later on a loaded one.
        # From there each gets every message, once, in order: the sender held to both.
        assert min(s[0] for s in seen) == 0
        # The slow subscriber read at least a second at its pace: the sender waited for it.
        assert len(seen[1]) >= 4000, (seen[1][0], len(seen[1]))
        for got in seen:
            assert got == list(range(got[0], messages)), (got[0], len(got))
        assert counter(slow_driver, SystemCounter.IMAGES_LEFT_BEHIND) == 0


@pytest.mark.parametrize("strategy", ["min", "tagged"])
def test_a_slipstream_sender_under_min_or_tagged_holds_to_a_stock_aeron_receiver(
        driver_dir: Path, strategy: str) -> None:
    """slipstream publishes on a multicast channel with ``fc=min,g:/2`` (or
    ``fc=tagged,g:TAG/2``, both receivers tagging their status messages with the group's
    8 bytes: Aeron's driver by its application-specific feedback, slipstream's by ``gtag=``);
    one slipstream and one stock Aeron receiver.  The sender counts Aeron's receiver (it
    connects only with both), and when Aeron's subscriber stops reading for 1.5 s (SIGSTOP:
    its driver goes on sending status messages that do not move), slipstream's subscriber
    stops too: the sender holds to Aeron's.  Then both get every message, once, in order.
    (An untagged receiver is not held for: on a busy machine one that fell out of the
    sender's resend window was left behind, as it may be; test_flow_hosts shows that.)"""
    require_aeron()
    uri, messages = channel("multicast"), 8000
    # The stopped subscriber sends Aeron's driver no keepalives: its client liveness timeout
    # (2 s in the fast timeouts, keepalives every 500 ms) must outlast the 1.5 s stop with room
    # for a loaded machine, or the driver drops the client and its image, and the sender holds
    # to a receiver that is gone.
    aeron_properties: dict[str, int | str] = {"aeron.client.liveness.timeout": DEFAULT_LIVENESS_NS}
    if strategy == "tagged":
        aeron_properties["aeron.flow.control.sm.applicationSpecificFeedback"] = GROUP_TAG_ASF
        params, our_params = f"|fc=tagged,g:{GROUP_TAG}/2", f"|gtag={GROUP_TAG}"
    else:
        params, our_params = "|fc=min,g:/2", ""
    with AeronDriver(properties=aeron_properties) as aeron, \
            basic_subscriber(aeron, uri, 1010) as subscriber, \
            MediaDriver.launch(directory=driver_dir, **FAST_DRIVER_SETTINGS) as driver, \
            Client.connect(driver.directory) as client:
        ours = client.add_subscription(uri + our_params, 1010)
        publication = client.add_publication(uri + TERM + params, 1010)
        wait_for(lambda: publication.is_connected and bool(ours.images), timeout=20,
                 what="the publication connected with Aeron's receiver counted")
        seen: list[int] = []
        times: list[float] = []

        def on_message(data: memoryview, _header: object) -> None:
            seen.append(INDEX.unpack_from(data)[0])
            times.append(time.monotonic())

        sent = 0
        stopped_at: float | None = None
        deadline = time.monotonic() + 60
        try:
            while len(seen) < messages or len(subscriber.messages) < messages:
                assert time.monotonic() < deadline, (
                    f"{len(seen)}, {len(subscriber.messages)}; Aeron's client liveness "
                    f"timeouts: {aeron.counter('Client liveness timeouts')}")
                offered = sent < messages and publication.offer(INDEX.pack(sent) + bytes(56)) > 0
                if offered:
                    sent += 1
                if sent == messages // 4 and stopped_at is None:
                    os.kill(subscriber.pid, signal.SIGSTOP)
                    stopped_at = time.monotonic()
                if stopped_at is not None and time.monotonic() - stopped_at > 1.5:
                    os.kill(subscriber.pid, signal.SIGCONT)
                    stopped_at = float("inf")
                if not ours.poll(on_message, 100) and not offered:
                    # Held back: leave the cores to the drivers and to the thread that reads
                    # what Aeron's subscriber prints (a full pipe would stop it consuming).
                    time.sleep(0.0005)
        finally:  # a stopped process would not stop at the end
            os.kill(subscriber.pid, signal.SIGCONT)
        assert seen == list(range(messages))
        assert subscriber.sequence_numbers() == list(range(messages))
        longest_gap = max(b - a for a, b in itertools.pairwise(times))
        assert longest_gap > 1.0, f"slipstream's subscriber never waited ({longest_gap:.3f} s)"
        receivers = [c.value for c in counters_labelled(driver, "fc-receivers: ")]
        assert receivers == [2]
