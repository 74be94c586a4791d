"""Spy subscriptions (``aeron-spy:aeron:udp?...``, docs/DRIVER.md §3.7): a subscription of the
publishing host that reads a network publication's own log in place.

Aeron's semantics, as its driver has them (DriverConductor.onAddSpySubscription, linkSpy;
NetworkPublication's spy positions): a spy links to every publication of its driver on its
channel's endpoint and stream, present and future; it joins at the sender position; a spy
holds pub-lmt (and cleaning) within a term window of its position, never the sender; a closed
publication lingers only once its spies read it all, and then their images end.  The stream
tests check the data message by message, as tests/test_udp.py does.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from helpers import (
    FAST_DRIVER_SETTINGS,
    NETWORK_SETTINGS,
    Collector,
    connect,
    connected_stream,
    counters_of,
    data_datagrams,
    free_port,
    lacking,
    message,
    network_publication,
    offer_until,
    process_state,
    publisher_limits,
    stream,
    wait_for,
)

from slipstream.client import (
    BACK_PRESSURED,
    ChannelError,
    Client,
    RegistrationError,
    control,
)
from slipstream.client._native import ffi, lib
from slipstream.client.counters import CountersFile, CounterType
from slipstream.client.frames import StatusMessage
from slipstream.client.layout import NO_DEADLINE
from slipstream.client.logbuffer import LogBuffer, new_appender
from slipstream.daemon._network import lib as network
from slipstream.daemon.streams.publication import (
    NetworkPublication,
    PublicationState,
)

TERM = 64 * 1024  # the network test drivers' term length (helpers.NETWORK_SETTINGS)
WINDOW = TERM // 2  # their publications' term window


def _uri() -> str:
    return f"aeron:udp?endpoint=127.0.0.1:{free_port()}"


def _catch_up(collector: Collector, count: int) -> None:
    """Poll until ``collector`` has ``count`` messages."""
    wait_for(lambda: collector.poll() >= 0 and len(collector.seen) >= count,
             what=f"{count} messages read")


def _sub_positions(driver, registration_id: int) -> list[int]:
    """The values of the sub-pos counters of subscription ``registration_id`` at ``driver``."""
    counters = CountersFile(driver.directory / control.COUNTERS_FILE, writable=False)
    try:
        return [info.value for info in counters
                if info.type_id == CounterType.SUBSCRIBER_POSITION
                and info.registration_id == registration_id]
    finally:
        counters.close()


def _sender_position(driver, session_id: int, stream_id: int) -> int:
    """The value of the snd-pos counter of publication ``session_id``/``stream_id`` at
    ``driver``."""
    counters = CountersFile(driver.directory / control.COUNTERS_FILE, writable=False)
    try:
        [value] = [info.value for info in counters
                   if info.type_id == CounterType.SENDER_POSITION
                   and info.session_id == session_id and info.stream_id == stream_id]
        return value
    finally:
        counters.close()


def _offer_until_held(publication, received: Collector) -> int:
    """Offer 1000-byte messages, polling ``received``, until the publisher is held (an offer
    not taken after at least one that was); returns how many were taken."""
    sent = 0
    while publication.offer(message(sent, 1000)) > 0 or not sent:
        sent += 1
        received.poll()
    return sent


@contextmanager
def _spied_stream(a, b, stream_id: int, spy_params: str = "",
                  ) -> Iterator[tuple[object, object, Collector, list]]:
    """A stream from driver ``a`` to driver ``b``, connected, with a spy at ``a`` on its own
    client (``spy_params`` added to its channel): yields the publication, the spy, a
    Collector of ``b``'s subscription and the list of the spy's images made unavailable."""
    uri = _uri()
    left: list = []
    with Client.connect(a.directory) as ca, Client.connect(b.directory) as cb, \
            Client.connect(a.directory) as spying:
        subscription = cb.add_subscription(uri, stream_id)
        publication = ca.add_publication(uri, stream_id)
        spy = spying.add_subscription(f"aeron-spy:{uri}{spy_params}", stream_id,
                                      on_unavailable_image=left.append)
        connect(publication, subscription, spy)
        yield publication, spy, Collector(subscription), left


def _untethered(window_limit_timeout: str, resting_timeout: str) -> str:
    """The channel parameters of an untethered spy with these timeouts."""
    return (f"|tether=false|untethered-window-limit-timeout={window_limit_timeout}"
            f"|untethered-resting-timeout={resting_timeout}")


# -- the stream -------------------------------------------------------------------------------
def test_a_spy_reads_what_the_publication_sends_in_order_across_term_rotations(launch) -> None:
    """A spy and a real UDP subscriber (another driver) see the same stream, message for
    message: small, MTU-sized and fragmented messages, the 64 KiB terms rotating many times
    (the spy holds the publisher back while it polls, as Aeron's does)."""
    a, b = launch(), launch()
    with _spied_stream(a, b, 1001) as (publication, spy, received, _):
        [image] = spy.images
        assert image.session_id == publication.session_id
        assert image.source_identity == "aeron:ipc"  # as Aeron names a spy's source
        assert image.join_position == 0
        spied = Collector(spy)
        stream(publication, [received, spied], 20_000, lambda i: (32, 1376, 5000, 200)[i % 4])
        received.assert_exactly(20_000)
        spied.assert_exactly(20_000)
        assert publication.position > 10 * TERM


def test_a_spy_added_before_the_publication_links_when_it_appears(launch) -> None:
    """A spy waits for its publications: each one made later on its endpoint and stream
    (another session too) gets it an image; another stream or endpoint does not, and a spy
    that names a session takes that session only."""
    uri, other_uri = _uri(), _uri()
    a = launch()
    with Client.connect(a.directory) as publishing, Client.connect(a.directory) as spying:
        spy = spying.add_subscription(f"aeron-spy:{uri}", 7)
        one_session = spying.add_subscription(f"aeron-spy:{uri}|session-id=4242", 7)
        assert not spy.images
        publication = publishing.add_publication(uri, 7)
        wait_for(lambda: spy.images, what="the spy linked to the new publication")
        assert spy.images[0].session_id == publication.session_id
        publishing.add_publication(f"{uri}|session-id=4242", 7)
        publishing.add_publication(uri, 8)
        publishing.add_publication(other_uri, 7)
        wait_for(lambda: len(spy.images) == 2, what="the spy linked to the second session")
        time.sleep(0.2)  # the other stream and endpoint do not come
        assert sorted(i.session_id for i in spy.images) == sorted(
            [publication.session_id, 4242])
        assert [i.session_id for i in one_session.images] == [4242]


def test_with_ssc_its_spies_connect_a_publication_no_receiver_takes(launch) -> None:
    """``ssc=true`` (Aeron's spies-simulate-connection): a publication nobody receives is
    connected by its spy, which then sets its pace and reads every message, over many term
    rotations; without ``ssc`` a spy alone does not connect its publication; once the spy
    goes, the publication is not connected any more."""
    uri = _uri()
    a = launch()
    with Client.connect(a.directory) as ca, Client.connect(a.directory) as spying:
        simulated = ca.add_publication(f"{uri}|spies-simulate-connection=true|term-length=64k",
                                       21)
        plain = ca.add_publication(f"{uri}|term-length=64k", 22)
        spy = spying.add_subscription(f"aeron-spy:{uri}", 21)
        other_spy = spying.add_subscription(f"aeron-spy:{uri}", 22)
        wait_for(lambda: simulated.is_connected and spy.images, what="the spy connected it")
        time.sleep(0.3)
        assert other_spy.images and not plain.is_connected
        spied = Collector(spy)
        stream(simulated, [spied], 5000, lambda _: 200)  # 64 KiB terms: ~16 rotations
        spied.assert_exactly(5000)
        spy.close()
        wait_for(lambda: not simulated.is_connected, what="no spy: not connected")


def test_a_spy_that_comes_late_joins_at_the_sender_position(launch) -> None:
    """A spy added to a publication that has sent joins where the sender is (Aeron's
    linkSpy: the publication's consumer position) and reads on from there."""
    uri = _uri()
    a, b = launch(), launch()
    with Client.connect(a.directory) as ca, Client.connect(b.directory) as cb:
        subscription = cb.add_subscription(uri, 3)
        publication = ca.add_publication(uri, 3)
        connect(publication, subscription)
        received = Collector(subscription)
        stream(publication, [received], 500, lambda _: 100)
        # The sender publishes snd-pos after its sendmmsg returns: the subscriber may have
        # read the last batch before then (a sender thread descheduled for a few ms on a
        # busy host), and the spy would join at the batch's start.
        wait_for(lambda: _sender_position(a, publication.session_id, 3)
                 == publication.position, what="snd-pos at the end of all of it sent")
        spy = ca.add_subscription(f"aeron-spy:{uri}", 3)
        [image] = spy.images  # linked in the subscription's answer
        assert image.join_position == publication.position  # all of it sent
        spied = Collector(spy)
        stream(publication, [received, spied], 500, lambda _: 100, first=500)
        spied.assert_exactly(500, first=500)


def test_spies_that_join_a_running_stream_read_on_in_order_from_their_join(launch) -> None:
    """Spies added while a publisher in another thread streams as fast as it can (the 64 KiB
    terms rotate every few ms, and the sender cleans behind what it sent) each read from
    their join position on, message after message: the log is kept for a spy from the
    moment the driver picks its join position, before the sender has taken its position."""
    uri = _uri()
    a, b = launch(), launch()
    with Client.connect(a.directory) as ca, Client.connect(b.directory) as cb, \
            Client.connect(a.directory) as spying:
        subscription = cb.add_subscription(uri, 4)
        publication = ca.add_publication(uri, 4)
        connect(publication, subscription)
        stop = threading.Event()
        received = Collector(subscription)

        def publish() -> None:
            sent = 0
            while not stop.is_set():
                if publication.offer(message(sent, 1000)) > 0:
                    sent += 1
                received.poll()

        publisher = threading.Thread(target=publish, daemon=True)
        publisher.start()
        try:
            for _ in range(10):
                spy = spying.add_subscription(f"aeron-spy:{uri}", 4)
                wait_for(lambda s=spy: s.images, what="the spy linked")
                [image] = spy.images
                spied = Collector(spy)
                _catch_up(spied, 300)
                first = spied.seen[0]
                spied.assert_exactly(len(spied.seen), first=first)
                # It joined where the sender was, and read from there: a term is 62 frames
                # of 1056 B and a PAD, which a join at the PAD steps over.
                per_term = TERM // 1056
                at = first // per_term * TERM + first % per_term * 1056
                pad = TERM - per_term * 1056
                assert image.join_position in (at, at - pad if first % per_term == 0 else at)
                spy.close()
        finally:
            stop.set()
            publisher.join(10)
        received.assert_exactly(len(received.seen))


def test_the_publication_closing_ends_the_spys_image(launch) -> None:
    """The last publisher closes: the spy reads what is left to the end of the stream (the
    publication lingers only then), then its image goes."""
    uri = _uri()
    a = launch()
    gone: list[object] = []
    with Client.connect(a.directory) as publishing, Client.connect(a.directory) as spying:
        subscription = publishing.add_subscription(uri, 5)  # the same driver receives it
        spy = spying.add_subscription(f"aeron-spy:{uri}", 5,
                                      on_unavailable_image=gone.append)
        publication = publishing.add_publication(uri, 5)
        connect(publication, subscription, spy)
        for i in range(100):
            offer_until(publication, message(i, 200))
        [image] = spy.images
        publication.close()
        time.sleep(0.3)
        assert spy.images == (image,)  # not read yet: the spy is owed the log
        spied = Collector(spy)
        wait_for(lambda: spied.poll() >= 0 and image.is_end_of_stream, what="read to the end")
        spied.assert_exactly(100)
        assert image.is_end_of_stream
        wait_for(lambda: not spy.images, timeout=5, what="the spy's image went")
        assert gone == [image]


def test_a_draining_driver_waits_for_its_spies_as_for_ipc_subscribers(launch) -> None:
    """A driver that is stopped (SIGTERM: the graceful drain) waits, while it flushes, for a
    spy of another client to read its publication to the end, as it waits for IPC
    subscribers; then the spy's image ends and the driver stops, well within its drain
    timeout."""
    uri = _uri()
    drain_timeout_s = 10
    a, b = launch(drain_timeout=f"{drain_timeout_s}s"), launch()
    with Client.connect(b.directory) as cb:
        subscription = cb.add_subscription(uri, 6)
        with Client.connect(a.directory) as publishing, \
                Client.connect(a.directory) as spying:
            spy = spying.add_subscription(f"aeron-spy:{uri}", 6)
            publication = publishing.add_publication(uri, 6)
            connect(publication, subscription, spy)
            [image] = spy.images
            for i in range(100):
                offer_until(publication, message(i, 200))
            received = Collector(subscription)
            _catch_up(received, 100)
            stopped = time.monotonic()
            os.kill(a.pid, signal.SIGTERM)
            time.sleep(0.5)  # the drain waits for the spy, which has read nothing yet
            assert spy.images == (image,)
            spied = Collector(spy)
            wait_for(lambda: spied.poll() >= 0 and len(spied.seen) >= 100, timeout=5,
                     what="the spy read the log to its end")
            spied.assert_exactly(100)
            a.process.wait(drain_timeout_s + 10)
            # It stopped as the spy's image ended, not at the end of its drain timeout.
            assert time.monotonic() - stopped < drain_timeout_s


# -- flow -------------------------------------------------------------------------------------
def test_a_slow_spy_holds_the_publisher_not_the_sender(launch) -> None:
    """As Aeron's (tethered) spy: one that does not read holds pub-lmt within a term window
    of its position, so the publisher is back-pressured, while the sender sends all the log
    holds to the UDP subscriber; once the spy reads, the publisher goes on."""
    a, b = launch(), launch()
    with _spied_stream(a, b, 9) as (publication, spy, received, _):
        spied = Collector(spy)
        sent = 0
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            result = publication.offer(message(sent, 1000))
            if result > 0:
                sent += 1
            elif result == BACK_PRESSURED and received.seen and len(received.seen) == sent:
                break  # the subscriber has it all, the publisher is still held
            received.poll()
        assert publication.position <= WINDOW + 1056  # one message may end past the limit
        assert publication.publication_limit <= WINDOW
        received.assert_exactly(sent)
        time.sleep(0.2)
        assert publication.offer(message(sent, 1000)) == BACK_PRESSURED
        # The spy reads: the publisher goes on, each step of pub-lmt behind it.
        _catch_up(spied, sent)
        stream(publication, [received, spied], 2000, lambda _: 1000, first=sent)
        spied.assert_exactly(sent + 2000)
        received.assert_exactly(sent + 2000)


def test_an_untethered_spy_that_falls_behind_is_left_and_rejoins(launch) -> None:
    """``tether=false`` (Aeron's untethered spy): a spy that does not read holds the publisher
    for its window limit timeout, then is left behind (its image goes, with the range it
    skips), lingers as long again, and holds nothing more; after its resting timeout it
    rejoins where the sender is, with a new image."""
    a = launch()
    with _spied_stream(a, launch(), 10, _untethered("300ms", "500ms")) as (
            publication, spy, received, left):
        [image] = spy.images
        sent = _offer_until_held(publication, received)
        held = time.monotonic()
        assert publication.position <= WINDOW + 1056  # held while the spy is tethered
        _catch_up(received, sent)
        # The publisher goes on once the spy is left behind and its linger is over (300 ms
        # each, counted from the timer's last look before the spy fell behind).
        stream(publication, [received], 2000, lambda _: 1000, first=sent)
        assert time.monotonic() - held >= 0.4
        received.assert_exactly(sent + 2000)
        assert left == [image] and image.lost_range is not None
        assert image.lost_range[0] == 0 and image.lost_range[1] > 0
        wait_for(lambda: spy.images, timeout=5, what="the spy rejoined")
        [again] = spy.images
        assert again is not image and again.join_position >= image.lost_range[1]
        assert counters_of(a)["UNTETHERED_SKIPS"] == 1


def test_a_publication_closed_after_its_untethered_spy_was_left_behind_ends(launch) -> None:
    """A publication closed while its untethered spy, just left behind, still lingers (its
    position held for its window limit timeout, 1 s here): the spy's client was told, so the
    close drops it at once; the publication drains, lingers (500 ms) and goes, its log file
    and its counters with it.  The untethered timer leaves a closing publication alone, so a
    lingering spy the close kept would hold its drain for good: the log is never freed."""
    a = launch()
    with _spied_stream(a, launch(), 13, _untethered("1s", "10s")) as (
            publication, spy, received, left):
        sent = _offer_until_held(publication, received)
        _catch_up(received, sent)
        assert len(_logs(a)) == 1 and publisher_limits(a) == 1
        wait_for(lambda: left, timeout=5, what="the spy left behind")
        time.sleep(0.1)
        publication.close()
        wait_for(lambda: not _logs(a) and not publisher_limits(a), timeout=5,
                 what="the closed publication's log and pub-lmt freed")
        assert not _sub_positions(a, spy.registration_id)  # its counter went with it
        assert not spy.images


def _logs(driver) -> list[Path]:
    """The publication log files of ``driver``."""
    return list((driver.directory / control.PUBLICATIONS_DIR).iterdir())


def test_a_spy_the_counters_had_no_room_for_links_once_they_have(launch) -> None:
    """A publication made while the counters have room for it but not for its spy's
    position: the spy is linked on the conductor's timer once a counter is free."""
    uri = _uri()
    a = launch(counters_capacity=256)
    with Client.connect(a.directory) as client:
        spy = client.add_subscription(f"aeron-spy:{uri}", 14)
        client.add_publication("aeron:ipc", 99)
        fillers = []
        with pytest.raises(RegistrationError):  # each takes one counter, its sub-pos
            while True:
                fillers.append(client.add_subscription("aeron:ipc", 99))
        for filler in fillers[:8]:  # a UDP publication's 8: pub-lmt, snd-pos, snd-lmt, bp-*
            filler.close()
        time.sleep(1.1)  # a freed counter is reused after 1 s
        client.add_publication(uri, 14)
        time.sleep(0.2)
        assert not spy.images  # no room for its sub-pos
        fillers[8].close()
        wait_for(lambda: spy.images, timeout=3, what="the spy linked on the timer")
        assert counters_of(a)["ERRORS"] >= 1  # the miss was logged and counted once


_SPY_CLIENT = """
import os, signal, sys
from slipstream.client import Client
client = Client.connect(sys.argv[1])
spy = client.add_subscription(sys.argv[2], 11)
print(spy.registration_id, flush=True)
os.kill(os.getpid(), signal.SIGSTOP)
"""


def test_a_dead_spy_client_leaks_nothing(launch) -> None:
    """A spy whose client stops (SIGSTOP, then SIGKILL) holds its publisher back until the
    client's liveness timeout; then its counter is freed and the publisher goes on."""
    uri = _uri()
    a, b = launch(), launch()
    with connected_stream(a, b, uri, 11) as (publication, subscription, _):
        child = subprocess.Popen([sys.executable, "-c", _SPY_CLIENT, str(a.directory),
                                  f"aeron-spy:{uri}"], stdout=subprocess.PIPE, text=True)
        try:
            assert child.stdout is not None
            spy_id = int(child.stdout.readline())
            wait_for(lambda: process_state(child.pid) == "T", what="the spy client stopped")
            assert len(_sub_positions(a, spy_id)) == 1
            received = Collector(subscription)
            sent = _offer_until_held(publication, received)
            assert publication.position <= WINDOW + 1056  # held by the stopped spy
            _catch_up(received, sent)
            os.kill(child.pid, signal.SIGKILL)
        finally:
            if child.poll() is None:
                child.kill()
            child.wait()
        # client_liveness_timeout is 1 s in the test drivers.
        wait_for(lambda: not _sub_positions(a, spy_id), timeout=5,
                 what="the dead spy's counter was freed")
        stream(publication, [received], 2000, lambda _: 1000, first=sent)
        received.assert_exactly(sent + 2000)


def test_closing_a_spy_frees_its_counter_and_the_publisher(launch) -> None:
    """A spy subscription closed while it holds its publisher back: its counter goes and
    the publisher is held no more."""
    uri = _uri()
    a, b = launch(), launch()
    with Client.connect(a.directory) as ca, Client.connect(b.directory) as cb:
        subscription = cb.add_subscription(uri, 12)
        publication = ca.add_publication(uri, 12)
        spy = ca.add_subscription(f"aeron-spy:{uri}", 12)
        connect(publication, subscription, spy)
        received = Collector(subscription)
        sent = _offer_until_held(publication, received)
        assert publication.position <= WINDOW + 1056
        _catch_up(received, sent)
        spy_id = spy.registration_id
        spy.close()
        # Freed once the sender dropped it (SpyUnlinked): a cycle of the network thread.
        wait_for(lambda: not _sub_positions(a, spy_id), timeout=2, what="the counter freed")
        stream(publication, [received], 2000, lambda _: 1000, first=sent)
        received.assert_exactly(sent + 2000)


@pytest.mark.interop
@pytest.mark.timeout(120)
@pytest.mark.parametrize("loss", [0.0, 0.05], ids=["lossless", "5%-loss-at-aeron"])
def test_a_spy_reads_what_its_publication_sends_to_a_stock_aeron_receiver(
        driver_dir: Path, loss: float) -> None:
    """A slipstream publication streams to Aeron 1.15.1's BasicSubscriber (with loss at the
    Aeron driver, repaired by slipstream's retransmissions) while a spy on the publishing
    driver reads the same log: both see every message once, in order."""
    import aeron_peer
    from aeron_peer import AeronDriver, basic_subscriber

    from slipstream.daemon.driver import MediaDriver

    reason = aeron_peer.aeron_available()
    if reason is not None:
        lacking(f"the Aeron peer: {reason}")
    uri, messages = _uri(), 20_000
    with MediaDriver.launch(directory=driver_dir, **FAST_DRIVER_SETTINGS) as driver, \
            AeronDriver(receive_data_loss_rate=loss, receive_data_loss_seed=5) as aeron, \
            basic_subscriber(aeron, uri, 1003) as subscriber, \
            Client.connect(driver.directory) as client:
        spy = client.add_subscription(f"aeron-spy:{uri}", 1003)
        publication = client.add_publication(f"{uri}|term-length=256k", 1003)
        wait_for(lambda: publication.is_connected and spy.images, timeout=20,
                 what="Aeron's status messages connected the publication")
        spied: list[int] = []

        def on_message(data: memoryview, _header: object) -> None:
            spied.append(int.from_bytes(data[:8], "little", signed=True))

        index, deadline = 0, time.monotonic() + 60
        while len(spied) < messages:  # the spy is tethered: it reads as the stream goes
            assert time.monotonic() < deadline, (index, len(spied))
            if index < messages and publication.offer(
                    index.to_bytes(8, "little") + bytes(56)) > 0:
                index += 1
            elif not spy.poll(on_message, 100):
                time.sleep(0.0001)
        subscriber.wait_for_messages(messages, timeout=60)
        subscriber.wait_quiet(0.3)  # a duplicate would show up here
        assert subscriber.sequence_numbers() == list(range(messages))
        assert spied == list(range(messages))
        if loss:
            assert aeron.counter("NAKs sent") > 0


# -- what is refused --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def refusing_driver():  # -> Iterator[MediaDriver]
    """One network test driver for the tests that add only what it refuses (each with a
    client of its own): a refusal adds nothing to the driver, so each is refused as by a fresh
    one, and the driver goes on refusing after the others."""
    from slipstream.daemon.driver import MediaDriver

    directory = Path("/dev/shm") / f"slipstream-udp-{uuid.uuid4().hex[:12]}"
    try:
        with MediaDriver.launch(directory=directory, **NETWORK_SETTINGS) as driver:
            yield driver
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def test_what_spies_refuse_names_the_part(refusing_driver) -> None:
    """A spy of aeron:ipc (Aeron's driver refuses it: UDP media only) and a publication on a
    spy channel are refused, naming the part."""
    uri = _uri()
    with Client.connect(refusing_driver.directory) as client:
        with pytest.raises(ChannelError, match="media"):
            client.add_subscription("aeron-spy:aeron:ipc", 1)
        with pytest.raises(RegistrationError, match="spy"):
            client.add_publication(f"aeron-spy:{uri}", 1)


_NOT_ON_A_SPY = ("reliable=true", "rcv-wnd=64k", "cc=cubic", "nak-delay=1ms", "gtag=5",
                 "group=true", "rejoin=true", "so-rcvbuf=1m", "so-sndbuf=1m", "ttl=4",
                 "term-length=128k", "mtu=4k", "sparse=true")


@pytest.mark.parametrize("key", _NOT_ON_A_SPY, ids=lambda k: k.split("=")[0])
def test_a_key_that_does_nothing_on_a_spy_is_refused_by_name(refusing_driver, key: str) -> None:
    """The receiver's keys (a spy has no socket, image log or status messages of its own) and
    the log's (it reads its publication's as that was made) do nothing on a spy: refused,
    naming the key, as the house rule has it for a key slipstream parses and does not act
    on."""
    uri = _uri()
    with Client.connect(refusing_driver.directory) as client:
        part = key.split("=")[0]
        with pytest.raises(RegistrationError, match=f"{part}: does nothing on a spy"):
            client.add_subscription(f"aeron-spy:{uri}|{key}", 1)


def test_what_a_spy_acts_on_is_accepted(launch) -> None:
    """What a spy does act on: the send endpoint (endpoint=, interface=), session-id=,
    tether= and the untethered timeouts; and control= (its publication's, not compared)."""
    uri = _uri()
    a = launch()
    with Client.connect(a.directory) as client:
        spy = client.add_subscription(
            f"aeron-spy:{uri}|interface=127.0.0.1|control=127.0.0.1:0|session-id=77"
            f"|tether=false|untethered-window-limit-timeout=1s"
            f"|untethered-resting-timeout=1s|alias=watch", 1)
        publication = client.add_publication(f"{uri}|interface=127.0.0.1|session-id=77", 1)
        wait_for(lambda: spy.images, what="the spy linked")
        assert spy.images[0].session_id == publication.session_id == 77


# -- the publication's rules on their own (no driver) ---------------------------------------------
def _publication(shm: Path) -> tuple[NetworkPublication, LogBuffer, object]:
    publication = network_publication(shm, "aeron:udp?endpoint=10.0.0.2:1", ("10.0.0.2", 1),
                                      term_length=TERM)
    publication.on_frame(StatusMessage(5, 6, 10, 0, TERM // 2, 99, 0), ("10.0.0.2", 1), 0)
    return publication, publication.log, new_appender(publication.log,
                                                      publication.positions.publisher_limit)


def _send_all(publication: NetworkPublication, now_ns: int) -> None:
    """The C data path sends what the log holds (no socket), the receiver acknowledges it."""
    while data_datagrams(publication, now_ns):
        pass
    term_id = 10 + (publication.sender_position >> 16)
    publication.on_frame(StatusMessage(5, 6, term_id, publication.sender_position & (TERM - 1),
                                       TERM // 2, 99, 0), ("10.0.0.2", 1), now_ns)
    publication.on_data_sent(now_ns)


def _fill(publication: NetworkPublication, appender: object, now_ns: int) -> None:
    """Offer 992 B messages (1024 B frames, 64 a term: no PAD) while the limit lets, then
    send them all."""
    while lib.ss_offer(appender, b"m" * 992, 992) > 0:
        pass
    _send_all(publication, now_ns)


def _frames_intact(log: LogBuffer, start: int, end: int) -> bool:
    """Every 1024 B frame of ``log`` from ``start`` to ``end`` is still there (not zeroed by
    cleaning)."""
    for position in range(start, end, 1024):
        term = log.term_view((position // TERM) % 3)
        if int.from_bytes(term[position % TERM:position % TERM + 4], "little") != 1024:
            return False
    return True


@pytest.mark.unit
def test_pub_lmt_and_cleaning_follow_the_slowest_of_the_sender_and_its_spies(
        shm: Path) -> None:
    """pub-lmt and cleaning follow the consumer position, the slowest of snd-pos and the
    spies: a spy that lags two terms into the stream holds pub-lmt a window ahead of it, and
    cleaning a term behind it (the sender alone would have cleaned past it)."""
    publication, log, appender = _publication(shm)
    spy = ffi.new("int64_t *", 0)
    publication.add_spy(spy)
    _fill(publication, appender, 1)
    assert publication.sender_position == WINDOW  # all the limit let in was sent
    assert lib.ss_load_acquire_i64(publication.publisher_limit) == WINDOW  # spy at 0
    assert publication.consumer_position() == 0
    spy[0] = WINDOW
    publication.datagrams_to_send(2)
    assert lib.ss_load_acquire_i64(publication.publisher_limit) == 2 * WINDOW
    # The spy keeps up across two terms, then lags: the sender goes a window past it.
    now = 3
    while publication.sender_position < 2 * TERM + WINDOW // 2:
        spy[0] = publication.sender_position
        publication.datagrams_to_send(now)
        _fill(publication, appender, now)
        now += 1
    lagging = spy[0] = publication.sender_position
    for _ in range(4):
        publication.datagrams_to_send(now)
        _fill(publication, appender, now)
        now += 1
    assert publication.sender_position == lagging + WINDOW  # held a window past the spy
    assert publication.consumer_position() == lagging
    # Cleaning ran (term 0 went), and stays a term behind the spy, not the sender.
    assert 0 < publication.cleaner.position <= lagging - TERM
    assert publication.cleaner.position < publication.sender_position - TERM
    assert _frames_intact(log, lagging, publication.sender_position)
    # The spy reads on: cleaning follows it.
    spy[0] = publication.sender_position
    publication.datagrams_to_send(now)
    assert publication.cleaner.position == publication.sender_position - TERM
    # A spy past snd-pos (it reads what is not sent yet) counts as snd-pos.
    spy[0] = 10 * TERM
    assert publication.consumer_position() == publication.sender_position
    # The conductor's hold, while it links a spy, holds as a spy does.
    publication.spy_hold[0] = 1024
    assert publication.consumer_position() == 1024
    publication.spy_hold[0] = NO_DEADLINE
    publication.remove_spy(spy)
    assert publication.spy_count == 0
    assert publication.consumer_position() == publication.sender_position
    log.close()


@pytest.mark.unit
def test_a_closed_publication_lingers_once_its_spies_read_it_all(shm: Path) -> None:
    publication, log, appender = _publication(shm)
    spy = ffi.new("int64_t *", 0)
    publication.add_spy(spy)
    for _ in range(8):
        assert lib.ss_offer(appender, b"m" * 992, 992) > 0
    _send_all(publication, 1)
    end = publication.sender_position
    publication.close(2)
    assert log.end_of_stream_position == end  # where the spy's image ends
    publication.datagrams_to_send(3)
    publication.sync_c_half()
    assert publication.state is PublicationState.DRAINING
    assert publication.c.spy_python_position == end  # the C half wakes the Python half there
    assert not publication.spies_released
    spy[0] = end
    assert network.ss_publication_slowest_spy(publication.c, end) == end
    publication.datagrams_to_send(4)
    assert publication.state is PublicationState.LINGER
    assert publication.spies_released
    publication.sync_c_half()
    assert publication.c.spy_python_position == NO_DEADLINE
    log.close()
