"""Multi-destination subscriptions (docs/CHANNELS.md §7.5) between real driver processes on
loopback: one subscription of ``control-mode=manual`` that receives on several destinations
(``Subscription.add_destination``), fed by a multi-destination-cast publication that sends to
each of them, so every datagram arrives twice and the stream is one image.

Every stream is checked message by message (helpers.Collector): the subscriber sees each
message once, in order, none missing.
"""

from __future__ import annotations

import contextlib
import random
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import (
    NETWORK_SETTINGS,
    Collector,
    counters_of,
    free_port,
    message,
    stream,
    wait_for,
)

from slipstream.client import ChannelRejectedError, Client, control
from slipstream.client.channel import parse_channel
from slipstream.client.counters import CountersFile, CounterType
from slipstream.client.frames import Data, Heartbeat, Nak, Setup, StatusMessage, decode
from slipstream.client.layout import NAK_LENGTH, SM_LENGTH
from slipstream.daemon.driver import MediaDriver
from slipstream.daemon.ops.metrics import CountersCollector

pytestmark = pytest.mark.timeout(120)

STREAM = 1002
MDS = "aeron:udp?control-mode=manual"


def _counter(driver, type_id: int) -> list[int]:
    """The values of the driver's counters of ``type_id``."""
    counters = CountersFile(driver.directory / control.COUNTERS_FILE, writable=False)
    try:
        return [c.value for c in counters if c.type_id == type_id]
    finally:
        counters.close()


@contextlib.contextmanager
def _senders(count: int) -> Iterator[list[socket.socket]]:
    """``count`` hand-made senders: non-blocking UDP sockets bound to 127.0.0.1, closed at
    the end."""
    senders = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(count)]
    try:
        for sock in senders:
            sock.bind(("127.0.0.1", 0))
            sock.setblocking(False)
        yield senders
    finally:
        for sock in senders:
            sock.close()


def _two_paths(launch, subscription_channel: str = MDS, **settings):
    """A sender and a receiver driver; the receiver's MDS subscription (on
    ``subscription_channel``) on two ports, the sender's MDC publication (fc=min, 64 KiB
    terms) sending to both."""
    sender, receiver = launch(), launch(**settings)
    ports = [free_port(), free_port()]
    a, b = Client.connect(sender.directory), Client.connect(receiver.directory)
    subscription = b.add_subscription(subscription_channel, STREAM)
    for port in ports:
        subscription.add_destination(f"aeron:udp?endpoint=127.0.0.1:{port}")
    publication = a.add_publication("aeron:udp?control-mode=manual|term-length=64k|fc=min",
                                    STREAM)
    for port in ports:
        publication.add_destination(f"aeron:udp?endpoint=127.0.0.1:{port}")
    wait_for(lambda: subscription.images and publication.is_connected, timeout=10,
             what="an image of the stream")
    return sender, receiver, a, b, ports, subscription, publication


def test_two_paths_make_one_image_each_message_once(launch) -> None:
    """The publication sends every datagram to both destinations of one MDS subscription:
    one image, and 20,000 messages (terms of 64 KiB rotating many times) each delivered once,
    in order; the second copy of each is dropped as a duplicate.  mds-destinations counts
    the destinations, and is exported."""
    sender, receiver, a, b, _ports, subscription, publication = _two_paths(launch)
    try:
        collector = Collector(subscription)
        stream(publication, [collector], 20_000, lambda i: (32, 1376, 3000)[i % 3])
        collector.assert_exactly(20_000)
        time.sleep(0.2)  # the second path's copies of the last messages
        assert collector.poll() == 0
        assert len(subscription.images) == 1
        assert _counter(receiver, CounterType.MDS_DESTINATIONS) == [2]
        [family] = [f for f in CountersCollector(receiver.directory).collect()
                    if f.name == "slipstream_mds_destinations"]
        assert [(s.labels, s.value) for s in family.samples] == [({"channel": MDS}, 2)]
        # Both paths carried the stream: the receiver took (about) twice what was sent.
        sent = counters_of(sender)["BYTES_SENT"]
        assert counters_of(receiver)["BYTES_RECEIVED"] > 1.5 * sent / 2
        assert publication.position > 3 * 64 * 1024
    finally:
        a.close()
        b.close()


def test_the_stream_goes_on_when_one_path_is_lost(launch) -> None:
    """Mid-stream the publisher stops sending to one destination (that path is lost): the
    stream goes on through the other without a message lost or repeated.  Then the publisher
    sends to the first again and the subscriber drops the second destination: the stream
    goes on through the first."""
    _sender, receiver, a, b, ports, subscription, publication = _two_paths(launch)
    try:
        collector = Collector(subscription)
        stream(publication, [collector], 3_000, lambda i: 500)
        publication.remove_destination(f"aeron:udp?endpoint=127.0.0.1:{ports[0]}")
        stream(publication, [collector], 3_000, lambda i: 500, first=3_000)
        publication.add_destination(f"aeron:udp?endpoint=127.0.0.1:{ports[0]}")
        subscription.remove_destination(f"aeron:udp?endpoint=127.0.0.1:{ports[1]}")
        wait_for(lambda: _counter(receiver, CounterType.MDS_DESTINATIONS) == [1], timeout=5,
                 what="mds-destinations at 1")
        stream(publication, [collector], 3_000, lambda i: 500, first=6_000)
        collector.assert_exactly(9_000)
        assert len(subscription.images) == 1
    finally:
        a.close()
        b.close()


def test_a_removed_destination_leaves_the_stream_connected(launch) -> None:
    """Once the subscriber removes one destination of two the sender keeps its receiver
    through the other (status messages go on): the stream stays connected, and the removed
    destination's port is free.  (That the removed path itself gets nothing more:
    test_a_removed_path_gets_nothing_when_its_slot_is_reused.)"""
    _sender, receiver, a, b, ports, subscription, publication = _two_paths(launch)
    try:
        collector = Collector(subscription)
        stream(publication, [collector], 1_000, lambda i: 200)
        before = counters_of(receiver)["STATUS_MESSAGES_SENT"]
        subscription.remove_destination(f"aeron:udp?endpoint=127.0.0.1:{ports[0]}")
        time.sleep(0.5)  # SMs repeat every 200 ms
        assert counters_of(receiver)["STATUS_MESSAGES_SENT"] > before
        assert publication.is_connected
        stream(publication, [collector], 1_000, lambda i: 200, first=1_000)
        collector.assert_exactly(2_000)
        # The port is free again: the destination's socket closed with it.
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.bind(("127.0.0.1", ports[0]))
    finally:
        a.close()
        b.close()


def test_destination_refusals_name_their_cause(launch) -> None:
    """A duplicate add, the removal of a destination never added, a destination with keys of
    its own, a host that does not resolve, an IPv6 destination beside IPv4 ones, interface=
    on a unicast destination, destinations on a subscription that is not control-mode=manual,
    and a control-mode=manual subscription with endpoint= or control=: each refused by name;
    the subscription keeps working."""
    sender, receiver = launch(), launch()
    port = free_port()
    with Client.connect(sender.directory) as a, Client.connect(receiver.directory) as b:
        subscription = b.add_subscription(MDS, STREAM)
        destination = f"aeron:udp?endpoint=127.0.0.1:{port}"
        subscription.add_destination(destination)
        refusals = {
            "endpoint": [lambda: subscription.add_destination(destination),
                         lambda: subscription.remove_destination(
                             f"aeron:udp?endpoint=127.0.0.1:{free_port()}"),
                         lambda: subscription.add_destination(
                             "aeron:udp?endpoint=no-such-host.invalid:4000"),
                         lambda: subscription.add_destination(
                             f"aeron:udp?endpoint=[::1]:{free_port()}"),
                         lambda: b.add_subscription(f"{MDS}|endpoint=127.0.0.1:{free_port()}",
                                                    STREAM)],
            "control": [lambda: b.add_subscription(f"{MDS}|control=127.0.0.1:{free_port()}",
                                                   STREAM)],
            "rcv-wnd": [lambda: subscription.add_destination(f"{destination}|rcv-wnd=64k")],
            "fc": [lambda: subscription.add_destination(
                f"aeron:udp?endpoint=127.0.0.1:{free_port()}|fc=min")],
            "interface": [lambda: subscription.add_destination(
                f"aeron:udp?endpoint=127.0.0.1:{free_port()}|interface=127.0.0.1")],
        }
        for part, calls in refusals.items():
            for call in calls:
                with pytest.raises(ChannelRejectedError) as refused:
                    call()
                assert refused.value.part == part, refused.value
        unicast = b.add_subscription(f"aeron:udp?endpoint=127.0.0.1:{free_port()}", STREAM)
        with pytest.raises(ChannelRejectedError) as mode:
            unicast.add_destination(f"aeron:udp?endpoint=127.0.0.1:{free_port()}")
        assert mode.value.part == "control-mode"
        unicast.close()
        assert _counter(receiver, CounterType.MDS_DESTINATIONS) == [1]

        publication = a.add_publication(f"aeron:udp?endpoint=127.0.0.1:{port}", STREAM)
        wait_for(lambda: subscription.images, timeout=10, what="an image")
        collector = Collector(subscription)
        stream(publication, [collector], 500, lambda i: 100)
        collector.assert_exactly(500)


def test_subscriptions_of_one_manual_channel_share_its_destinations(launch) -> None:
    """Two subscriptions of the same control-mode=manual channel share one endpoint (as in
    Aeron): a destination one adds feeds both, and the endpoint's destinations go with its
    last subscription."""
    sender, receiver = launch(), launch()
    port = free_port()
    with Client.connect(sender.directory) as a, Client.connect(receiver.directory) as b:
        first = b.add_subscription(MDS, STREAM)
        second = b.add_subscription(MDS, STREAM)
        first.add_destination(f"aeron:udp?endpoint=127.0.0.1:{port}")
        with pytest.raises(ChannelRejectedError):  # the endpoint's, whoever added it
            second.add_destination(f"aeron:udp?endpoint=127.0.0.1:{port}")
        publication = a.add_publication(f"aeron:udp?endpoint=127.0.0.1:{port}", STREAM)
        wait_for(lambda: first.images and second.images, timeout=10, what="images")
        collectors = [Collector(first), Collector(second)]
        stream(publication, collectors, 500, lambda i: 100)
        for collector in collectors:
            collector.assert_exactly(500)
        first.close()
        second.close()
        wait_for(lambda: not _counter(receiver, CounterType.MDS_DESTINATIONS), timeout=10,
                 what="the endpoint and its counter gone")
        again = b.add_subscription(MDS, STREAM)
        again.add_destination(f"aeron:udp?endpoint=127.0.0.1:{port}")  # its port is free


def _waiting(sock) -> list[tuple[object, tuple[str, int]]]:
    """What waits at ``sock`` (non-blocking), decoded, with its sources."""
    found = []
    while True:
        try:
            data, source = sock.recvfrom(2048)
        except BlockingIOError:
            return found
        found.append((decode(data), source))


def _status_messages(sock) -> list[tuple[StatusMessage, tuple[str, int]]]:
    """The status messages waiting at ``sock`` (non-blocking), with their sources."""
    return [(frame, source) for frame, source in _waiting(sock)
            if isinstance(frame, StatusMessage)]


def test_status_messages_and_naks_go_to_every_live_path(launch) -> None:
    """A hand-made sender reaches one MDS subscription on two paths, from two sockets: the
    image takes the SETUP from one and data from both (a duplicate once), and its status
    messages and NAKs go back along each path heard from within the liveness timeout (1 s),
    each through its destination's socket (Aeron's ImageConnections).  A path silent longer
    than that, and one whose destination is removed, get nothing more."""
    receiver = launch()
    ports = [free_port(), free_port()]
    with Client.connect(receiver.directory) as b, _senders(len(ports)) as senders:
        subscription = b.add_subscription(MDS, STREAM)
        for port in ports:
            subscription.add_destination(f"aeron:udp?endpoint=127.0.0.1:{port}")
        session, term_id = 77, 5
        setup = Setup(0, session, STREAM, term_id, term_id, 64 * 1024, 1408).encode()

        def data(offset: int, payload: bytes = b"x" * 32) -> bytes:
            return Data(offset, session, STREAM, term_id, payload).encode()

        senders[0].sendto(setup, ("127.0.0.1", ports[0]))
        wait_for(lambda: subscription.images, timeout=5, what="the image")
        for sock, port in zip(senders, ports, strict=True):  # both paths carry offset 0
            sock.sendto(data(0), ("127.0.0.1", port))
        # A gap at 64: data at 128 on the second path only; the NAK goes both ways.
        senders[1].sendto(data(128), ("127.0.0.1", ports[1]))
        time.sleep(0.5)
        got = []
        for sock in senders:
            answers = []
            while True:
                try:
                    answers.append(sock.recvfrom(2048))
                except BlockingIOError:
                    break
            got.append(answers)
        for answers, port in zip(got, ports, strict=True):
            frames = [decode(d) for d, _ in answers]
            assert any(isinstance(f, StatusMessage) for f in frames), port
            assert any(isinstance(f, Nak) and f.term_offset == 64 for f in frames), port
            assert {source for _, source in answers} == {("127.0.0.1", port)}
        assert len(subscription.images) == 1

        # The first path goes silent (heartbeats on the second keep the image): after the
        # liveness timeout its status messages stop.
        deadline = time.monotonic() + 1.6
        while time.monotonic() < deadline:
            senders[1].sendto(Heartbeat(160, session, STREAM, term_id).encode(),
                              ("127.0.0.1", ports[1]))
            time.sleep(0.05)
        for sock in senders:  # what went before the timeout
            _status_messages(sock)
        time.sleep(0.5)
        senders[1].sendto(Heartbeat(160, session, STREAM, term_id).encode(),
                          ("127.0.0.1", ports[1]))
        time.sleep(0.3)
        assert not _status_messages(senders[0])
        assert _status_messages(senders[1])

        # Both paths live again; then the second destination is removed: SMs only along
        # the first.
        for sock, port in zip(senders, ports, strict=True):
            sock.sendto(Heartbeat(160, session, STREAM, term_id).encode(),
                        ("127.0.0.1", port))
        time.sleep(0.3)
        assert _status_messages(senders[0]) and _status_messages(senders[1])
        subscription.remove_destination(f"aeron:udp?endpoint=127.0.0.1:{ports[1]}")
        # What went before the receiver's thread ran the removal (it counts it then).
        wait_for(lambda: _counter(receiver, CounterType.MDS_DESTINATIONS) == [1],
                 timeout=5, what="the removal run")
        _status_messages(senders[1])
        for _ in range(8):
            senders[0].sendto(Heartbeat(160, session, STREAM, term_id).encode(),
                              ("127.0.0.1", ports[0]))
            time.sleep(0.05)
        assert _status_messages(senders[0])
        assert not _status_messages(senders[1])


def test_control_frames_to_every_path_count_every_paths_bytes(launch) -> None:
    """An SM or a NAK that goes along two live paths is two datagrams on the wire: the
    receiving driver counts it once (``STATUS_MESSAGES_SENT``, ``NAK_MESSAGES_SENT``, as
    Aeron counts an image's) and its ``BYTES_SENT`` counts both datagrams' bytes.  A stream
    of 20,000 messages over both paths.  Both halves send them, each counting: ``group=``
    decides which (a manual channel's images have group semantics, whose SMs and NAKs are
    the Python half's; ``group=false`` gives them to the C half).  A datagram a full socket
    refused on one path (a loaded host) left no bytes, and counts as a short send."""
    for group in ("", "|group=false"):
        _check_control_bytes_on_two_paths(launch, MDS + group)


def _check_control_bytes_on_two_paths(launch, subscription_channel: str) -> None:
    _sender, receiver, a, b, _ports, subscription, publication = _two_paths(
        launch, subscription_channel)
    try:
        time.sleep(0.2)  # both paths heard from: the setup's heartbeats went to both
        before = counters_of(receiver)
        collector = Collector(subscription)
        stream(publication, [collector], 20_000, lambda i: (32, 1376, 3000)[i % 3])
        collector.assert_exactly(20_000)

        def since_before() -> tuple[int, int, int, int]:
            """The SMs, NAKs and short sends counted since ``before``, and the bytes those
            SMs and NAKs on both paths lack of BYTES_SENT."""
            after = counters_of(receiver)
            status_messages = after["STATUS_MESSAGES_SENT"] - before["STATUS_MESSAGES_SENT"]
            naks = after["NAK_MESSAGES_SENT"] - before["NAK_MESSAGES_SENT"]
            refused = after["SHORT_SENDS"] - before["SHORT_SENDS"]
            missing = (2 * (status_messages * SM_LENGTH + naks * NAK_LENGTH)
                       - (after["BYTES_SENT"] - before["BYTES_SENT"]))
            return status_messages, naks, refused, missing

        # The idle SMs go on: the Python half counts one as it makes it and its bytes as it
        # goes, the C half the other way round, so a read between the two is off by one
        # SM.  The counts are taken where they agree; one that never does fails here.
        deadline = time.monotonic() + 5.0
        status_messages, naks, refused, missing = since_before()
        while (not refused * NAK_LENGTH <= missing <= refused * SM_LENGTH
               and time.monotonic() < deadline):
            time.sleep(0.01)
            status_messages, naks, refused, missing = since_before()
        assert status_messages > 10, status_messages
        # Each refused datagram an SM's or a NAK's; none missing without one.
        assert refused * NAK_LENGTH <= missing <= refused * SM_LENGTH, (missing, refused)
        if naks == 0:
            assert missing == refused * SM_LENGTH, (missing, refused)
    finally:
        a.close()
        b.close()


def test_a_unicast_and_a_multicast_path_make_one_image(launch) -> None:
    """A hand-made sender sends one stream on a unicast path and to a multicast group, each
    datagram on both: an MDS subscription with a unicast and a multicast destination reads
    it as one image, each message once, and answers each path along it: the unicast one to
    its source, the multicast one to its control group (data group + 1, same port)."""
    receiver = launch()
    port, group_port = free_port(), free_port()
    last = random.randrange(1, 250, 2)
    group, control_group = f"224.0.4.{last}", f"224.0.4.{last + 1}"
    unicast = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    multicast = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    control = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        unicast.bind(("127.0.0.1", 0))
        multicast.bind(("127.0.0.1", 0))
        multicast.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF,
                             socket.inet_aton("127.0.0.1"))
        control.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        control.bind((control_group, group_port))
        control.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP,
                           socket.inet_aton(control_group) + socket.inet_aton("127.0.0.1"))
        for sock in (unicast, control):
            sock.setblocking(False)
        with Client.connect(receiver.directory) as b:
            subscription = b.add_subscription(MDS, STREAM)
            subscription.add_destination(f"aeron:udp?endpoint=127.0.0.1:{port}")
            subscription.add_destination(
                f"aeron:udp?endpoint={group}:{group_port}|interface=127.0.0.1")
            session, term_id = 91, 3
            paths = ((unicast, ("127.0.0.1", port)), (multicast, (group, group_port)))
            multicast.sendto(Setup(0, session, STREAM, term_id, term_id, 64 * 1024,
                                   1408).encode(), (group, group_port))
            wait_for(lambda: subscription.images, timeout=5, what="the image")
            collector = Collector(subscription)
            for i in range(200):  # 200 messages of 288 B frames: most of a 64 KiB term
                frame = Data(i * 288, session, STREAM, term_id, message(i, 256)).encode()
                for sock, address in (paths if i % 2 else paths[::-1]):
                    sock.sendto(frame, address)
                if i % 16 == 15:
                    collector.poll()
                    time.sleep(0.002)  # within the window: the image's SMs keep up
            wait_for(lambda: collector.poll() or len(collector.seen) >= 200, timeout=5,
                     what="every message")
            time.sleep(0.3)
            collector.poll()
            collector.assert_exactly(200)
            assert len(subscription.images) == 1
            for sock in (unicast, control):
                assert _status_messages(sock), sock
    finally:
        for sock in (unicast, multicast, control):
            sock.close()


def test_a_removed_path_gets_nothing_when_its_slot_is_reused(launch) -> None:
    """A hand-made sender reaches one MDS subscription on two paths.  The subscriber removes
    the second destination and adds a third at once, which takes the removed one's slot
    (and likely its socket's number): the image's path through the removed destination is
    gone, so its source gets no status message or NAK, neither through the new socket;
    the new path gets them once its data comes."""
    receiver = launch()
    ports = [free_port(), free_port(), free_port()]
    with Client.connect(receiver.directory) as b, _senders(len(ports)) as senders:
        subscription = b.add_subscription(MDS, STREAM)
        for port in ports[:2]:
            subscription.add_destination(f"aeron:udp?endpoint=127.0.0.1:{port}")
        session, term_id = 78, 5
        senders[0].sendto(Setup(0, session, STREAM, term_id, term_id, 64 * 1024,
                                1408).encode(), ("127.0.0.1", ports[0]))
        wait_for(lambda: subscription.images, timeout=5, what="the image")

        def heartbeat(i: int) -> None:
            senders[i].sendto(Heartbeat(0, session, STREAM, term_id).encode(),
                              ("127.0.0.1", ports[i]))

        heartbeat(0)
        heartbeat(1)
        time.sleep(0.3)
        assert _status_messages(senders[1])  # the second path is live
        subscription.remove_destination(f"aeron:udp?endpoint=127.0.0.1:{ports[1]}")
        subscription.add_destination(f"aeron:udp?endpoint=127.0.0.1:{ports[2]}")
        wait_for(lambda: _counter(receiver, CounterType.MDS_DESTINATIONS) == [2],
                 timeout=5, what="the removal and the add run")
        time.sleep(0.05)
        _waiting(senders[1])  # what went before the removal ran
        # Data past a gap on the first path (a NAK) and heartbeats on the third, for
        # longer than the SM interval: nothing for the removed path's source.
        senders[0].sendto(Data(128, session, STREAM, term_id, b"x" * 32).encode(),
                          ("127.0.0.1", ports[0]))
        for _ in range(10):
            heartbeat(0)
            heartbeat(2)
            time.sleep(0.05)
        assert _waiting(senders[1]) == []
        assert _status_messages(senders[0])
        assert _status_messages(senders[2])


def test_removing_and_adding_a_destination_again_at_once() -> None:
    """A destination removed and added again at once, before the receiver's thread closed
    its socket, is no port in use: the driver takes the same socket back.  An embedded
    driver answers both before its receiver runs the removal (as a busy driver may), and
    the stream then arrives through the destination."""
    directory = Path("/dev/shm") / f"slipstream-mds-{uuid.uuid4().hex[:12]}"
    destination = f"aeron:udp?endpoint=127.0.0.1:{free_port()}"
    with MediaDriver.embedded(directory, **NETWORK_SETTINGS) as driver, \
            Client.connect(driver.directory, invoker=driver.do_work) as client:
        subscription = client.add_subscription(MDS, STREAM)
        for _ in range(5):
            subscription.add_destination(destination)
            subscription.remove_destination(destination)
        subscription.add_destination(destination)
        # The conductor's side alone, the receiver's thread not run between: the removal
        # has not closed the socket when the same destination comes again.
        network = driver.conductor.network
        channel = parse_channel(destination)
        for _ in range(3):
            network.remove_receive_destination(subscription.registration_id, channel)
            network.add_receive_destination(subscription.registration_id, channel)
        publication = client.add_publication(destination, STREAM)
        deadline = time.monotonic() + 10
        while not (subscription.images and publication.is_connected):
            assert time.monotonic() < deadline, "no image"
            driver.do_work()
        assert _counter(driver, CounterType.MDS_DESTINATIONS) == [1]


def test_a_seventeenth_destination_is_refused_by_name(launch) -> None:
    """A multi-destination subscription has at most 16 destinations: the 17th is refused
    (ChannelRejectedError naming endpoint=), and one of the 16 removed makes room again."""
    receiver = launch()
    with Client.connect(receiver.directory) as b:
        subscription = b.add_subscription(MDS, STREAM)
        destinations = [f"aeron:udp?endpoint=127.0.0.1:{free_port()}" for _ in range(17)]
        for destination in destinations[:16]:
            subscription.add_destination(destination)
        with pytest.raises(ChannelRejectedError) as refused:
            subscription.add_destination(destinations[16])
        assert refused.value.part == "endpoint"
        assert "at most 16" in str(refused.value)
        subscription.remove_destination(destinations[0])
        subscription.add_destination(destinations[16])
        wait_for(lambda: _counter(receiver, CounterType.MDS_DESTINATIONS) == [16], timeout=5,
                 what="16 destinations")


def test_destination_sockets_take_the_subscriptions_socket_options() -> None:
    """so-rcvbuf= on the control-mode=manual subscription is each destination's socket's
    (a destination URI cannot name it)."""
    directory = Path("/dev/shm") / f"slipstream-mds-{uuid.uuid4().hex[:12]}"
    with MediaDriver.embedded(directory, **NETWORK_SETTINGS) as driver, \
            Client.connect(driver.directory, invoker=driver.do_work) as client:
        rcvbuf = 48 * 1024
        subscription = client.add_subscription(f"{MDS}|so-rcvbuf={rcvbuf}|rcv-wnd=16k", STREAM)
        subscription.add_destination(f"aeron:udp?endpoint=127.0.0.1:{free_port()}")
        [entry] = driver.conductor.network._receive_endpoints.values()
        [(transport, _)] = entry.sockets.values()
        # Linux reports twice what was set.
        assert transport.sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) == 2 * rcvbuf


def test_a_datagram_for_a_removed_destination_is_dropped() -> None:
    """What the Python half queued for a destination removed since (or for none) is dropped
    and counted, never sent through another destination's socket."""
    from slipstream.daemon.media.receive_destinations import MultiDestinationReceiveTransport
    from slipstream.daemon.protocol.types import Datagram

    sent = []

    class _Destination:
        def send(self, datagrams):
            sent.extend(datagrams)

    transport = MultiDestinationReceiveTransport()
    transport._destinations[0] = (_Destination(), None)
    transport.send([Datagram(b"a", ("127.0.0.1", 9), 0), Datagram(b"b", ("127.0.0.1", 9), 1),
                    Datagram(b"c", ("127.0.0.1", 9))])
    assert [d.data for d in sent] == [b"a"]
    assert transport.dropped == 2
