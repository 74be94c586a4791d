"""Encrypted streams between real driver processes on loopback (docs/CHANNELS.md §7.8): a
stream with key= carried exactly once across term rotations and loss; a plain
peer, a peer with another key and a channel that mixes are refused, each with its counted,
named reason; tampered, truncated and replayed datagrams change nothing and are counted; a
key rotated mid-stream loses nothing.

Every stream is checked message by message (helpers.Collector), as in test_udp.py.
"""

from __future__ import annotations

import os
import random
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import (
    Collector,
    connect,
    connected_stream,
    counters_of,
    free_port,
    mdc_destinations,
    stream,
    stream_to_all,
    wait_for,
)
from sealed_wire import KEY_A, KEY_B

from slipstream.client import ChannelError, ChannelRejectedError, Client
from slipstream.client.frames import ErrorFrame, Nak, StatusMessage
from slipstream.client.layout import (
    EXT_TYPE_HANDSHAKE_ANSWER,
    EXT_TYPE_SEALED,
    FLAGS_FIELD,
    HDR_TYPE_EXT,
    HEADER_LENGTH,
    SEALED_HEADER_LENGTH,
    SEALED_OVERHEAD,
    TERM_OFFSET_FIELD,
)
from slipstream.daemon.media.sealing import Sealing

DROPS = ("CRYPTO_PLAIN_DROPS", "CRYPTO_UNKNOWN_KEY_DROPS", "CRYPTO_AUTH_DROPS",
         "CRYPTO_REPLAY_DROPS", "CRYPTO_SEAL_REFUSED", "CRYPTO_SEALED_AT_PLAIN_DROPS")


def write_keys(directory: Path, name: str, keys: list[tuple[int, bytes]]) -> None:
    """The key file, replaced whole (a new file renamed over the old: a reader never sees
    half of it), for the driver's user and group alone."""
    directory.mkdir(mode=0o750, exist_ok=True)
    temporary = directory / f".{name}.key.new"
    temporary.write_text("".join(f"{key_id} {key.hex()}\n" for key_id, key in keys))
    temporary.chmod(0o640)
    os.replace(temporary, directory / f"{name}.key")


def _keyed(port: int) -> str:
    """The unicast channel to 127.0.0.1:``port`` sealed under key ``k``, of 64 KiB terms."""
    return f"aeron:udp?endpoint=127.0.0.1:{port}|term-length=64k|key=k"


def drops(driver) -> dict[str, int]:
    counters = counters_of(driver)
    return {name: counters[name] for name in DROPS}


@pytest.fixture
def hosts(launch, tmp_path: Path):
    """Two drivers, each with its own keys_dir holding key ``k`` = KEY_A (id 1)."""
    def start(name: str, keys: list[tuple[int, bytes]] | None = None, **settings):
        directory = tmp_path / f"keys-{name}"
        write_keys(directory, "k", keys if keys is not None else [(1, KEY_A)])
        return launch(keys_dir=str(directory), **settings), directory
    return start


def test_an_encrypted_stream_is_carried_once_in_order_across_terms_and_loss(hosts) -> None:
    """20,000 messages (32 B to 5 KB: fragments too) over 64 KiB terms (many rotations), 5 %
    of the data lost on the way in: every message once, in order; retransmissions (new
    counters for the same frames) open, and nothing is dropped as a replay or a forgery."""
    uri = _keyed(free_port())
    a, _ = hosts("a")
    b, _ = hosts("b", debug_receive_data_loss=50_000, debug_receive_data_loss_seed=7)
    with connected_stream(a, b, uri, 10) as (publication, _, collector):
        stream(publication, [collector], 20_000, lambda i: (32, 1000, 5000, 200)[i % 4],
               timeout=90)
        collector.assert_exactly(20_000)
    sent, received = counters_of(a), counters_of(b)
    assert received["DEBUG_DATA_LOSS_DROPS"] > 0 and sent["RETRANSMITS_SENT"] > 0
    assert drops(a) == drops(b) == dict.fromkeys(DROPS, 0)


class Sniffer:
    """A UDP relay between a publisher and its subscriber (the publisher's endpoint is the
    relay's port; the subscriber's status messages and NAKs go back through it), keeping a
    copy of every datagram towards the subscriber, and doing to each what ``mangle`` says:
    a list of datagrams to send in its place (the datagram itself, copies, changed ones)."""

    def __init__(self, target: int, mangle) -> None:
        self.front = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.front.bind(("127.0.0.1", 0))
        self.back = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.back.bind(("127.0.0.1", 0))
        self.port = self.front.getsockname()[1]
        self.target = ("127.0.0.1", target)
        self.mangle = mangle
        self.captured: list[bytes] = []
        self.publisher: tuple[str, int] | None = None
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import select
        while not self._stop:
            ready, _, _ = select.select([self.front, self.back], [], [], 0.05)
            for sock in ready:
                data, source = sock.recvfrom(70_000)
                if sock is self.front:
                    self.publisher = source
                    self.captured.append(data)
                    for out in self.mangle(data):
                        self.back.sendto(out, self.target)
                elif self.publisher is not None:
                    self.front.sendto(data, self.publisher)

    def replay(self, datagrams: list[bytes]) -> None:
        """``datagrams`` again from the relay, paced (a burst would overflow the receiving
        socket's buffer, and a datagram the kernel drops is counted by no one)."""
        for i, data in enumerate(datagrams):
            self.back.sendto(data, self.target)
            if i % 8 == 7:  # 8 a millisecond: a receiver on a loaded machine keeps up
                time.sleep(0.001)

    def close(self) -> None:
        self._stop = True
        self._thread.join()
        self.front.close()
        self.back.close()


@pytest.fixture
def sniffer() -> Iterator:
    made: list[Sniffer] = []

    def make(target: int, mangle) -> Sniffer:
        made.append(Sniffer(target, mangle))
        return made[-1]
    yield make
    for each in made:
        each.close()


def test_tampered_truncated_and_replayed_datagrams_change_nothing_and_are_counted(
        hosts, sniffer) -> None:
    """Between the drivers, every sealed datagram also arrives again at once (a replay),
    every 7th after a copy with a bit flipped in its ciphertext, its clear header or its tag,
    every 11th after a copy cut short; after the stream, everything captured arrives
    again.  The subscriber gets every message once, in order, and counts each forgery and
    each replay: a changed sender id names a sender it has no session with."""
    port = free_port()
    rng = random.Random(59)
    forged = {"auth": 0, "replays": 0, "no-session": 0}

    def mangle(data: bytes) -> list[bytes]:
        if int.from_bytes(data[12:14], "little") != EXT_TYPE_SEALED:
            return [data]  # the handshake: its own tests mangle it
        # Forgeries ahead of the datagram they copy: after it, its counter is one the window
        # saw, and the copy a replay before it is a forgery.
        out = []
        forged["replays"] += 1
        if rng.random() < 1 / 7:
            changed = bytearray(data)
            # The sender id's random half, the ciphertext or the tag (a changed counter may
            # name one the window saw, and a changed time half of the sender id an id past
            # its lifetime: replay drops, not a forgery's).
            at = rng.choice([rng.randrange(16, 20), rng.randrange(32, len(data)),
                             len(data) - 1])
            changed[at] ^= 1 << rng.randrange(8)
            out.append(bytes(changed))
            forged["no-session" if at < 20 else "auth"] += 1
        if rng.random() < 1 / 11:
            out.append(data[:rng.randrange(SEALED_OVERHEAD, len(data))])
            forged["auth"] += 1
        return [*out, data, data]

    relay = sniffer(port, mangle)
    a, _ = hosts("a")
    b, _ = hosts("b")
    publish = _keyed(relay.port)
    subscribe = _keyed(port)
    with connected_stream(a, b, subscribe, 11, publication_uri=publish) as (publication, _,
                                                                            collector):
        stream(publication, [collector], 5_000, lambda i: 100 + i % 1200, timeout=60)
        captured = list(relay.captured)
        assert all(int.from_bytes(d[6:8], "little") == HDR_TYPE_EXT for d in captured)
        captured = [d for d in captured if int.from_bytes(d[12:14], "little") == EXT_TYPE_SEALED]
        relay.replay(captured)
        # Each copy is a replay (one lost to a full socket buffer would have opened in its
        # original's place), and so is every captured datagram again.
        wait_for(lambda: drops(b)["CRYPTO_REPLAY_DROPS"]
                 >= 0.95 * (len(captured) + forged["replays"]),
                 what=f"the replays counted ({len(captured)} + {forged['replays']})",
                 timeout=30)
        collector.poll()
        collector.assert_exactly(5_000)
    counted = drops(b)
    assert 0.95 * forged["auth"] <= counted["CRYPTO_AUTH_DROPS"] <= forged["auth"]
    assert counters_of(b)["CRYPTO_AWAITING_HANDSHAKE_DROPS"] >= 0.95 * forged["no-session"]
    assert counted["CRYPTO_PLAIN_DROPS"] == counted["CRYPTO_UNKNOWN_KEY_DROPS"] == 0


def _relayed_stream(hosts, sniffer, port: int, mangle, mtu: str = "",
                    size=lambda i: 100 + i % 1200):  # -> (publishing, subscribing driver)
    """3,000 messages of ``size(i)`` bytes on a keyed stream from driver "a" to driver "b"
    (port ``port``, ``mtu`` its channel's |mtu= or none), every datagram through a relay that
    sends what ``mangle`` makes of it; each message checked to have arrived once, in order."""
    relay = sniffer(port, mangle)
    a, _ = hosts("a")
    b, _ = hosts("b")
    with connected_stream(a, b, _keyed(port) + mtu, 12,
                          publication_uri=_keyed(relay.port) + mtu) as (
            publication, _, collector):
        stream(publication, [collector], 3_000, size, timeout=60)
        collector.assert_exactly(3_000)
    return a, b


def test_forged_frames_decrypted_into_the_term_ahead_of_the_stream_are_wiped(
        hosts, sniffer) -> None:
    """Every sealed datagram (one 4-8 KiB frame: long enough to be decrypted where it goes)
    arrives after a forged copy whose frame names the term offset 32 bytes on (a bit of its
    encrypted header flipped; where that bit is set, 32 back, behind what arrived): the
    receiver decrypts such a copy straight into the term there, beyond what arrived, before
    its tag fails.  Each is wiped from the term: the genuine frame lands over all but its
    last 32 bytes, whose first word (the message's sequence number: sizes of 4 mod 32 put it
    there) is where the next frame goes, and left behind would be taken for that frame.
    The subscriber gets every message once, in order, each forgery counted."""
    port = free_port()
    forged = {"auth": 0}
    flipped = SEALED_HEADER_LENGTH + TERM_OFFSET_FIELD  # the offset's low byte: bit 5, 32

    def mangle(data: bytes) -> list[bytes]:
        if int.from_bytes(data[12:14], "little") != EXT_TYPE_SEALED or \
                len(data) <= SEALED_OVERHEAD + HEADER_LENGTH:
            return [data]
        changed = bytearray(data)
        changed[flipped] ^= 0x20
        forged["auth"] += 1
        return [bytes(changed), data]

    counted = drops(_relayed_stream(hosts, sniffer, port, mangle, "|mtu=8192",
                                    lambda i: 4_100 + 32 * (i % 125))[1])
    assert 0.95 * forged["auth"] <= counted["CRYPTO_AUTH_DROPS"] <= forged["auth"]
    assert counted["CRYPTO_REPLAY_DROPS"] == 0


def test_a_lost_and_a_repeated_handshake_answer_still_connect_and_lose_nothing(
        hosts, sniffer) -> None:
    """Between the drivers, the publisher's first two answers to the subscriber's INITs are
    lost and every later one arrives twice: the subscriber asks again until one arrives (the
    same answer), the second copy matches nothing (counted), and the stream carries every
    message once with no datagram refused but those before its session."""
    port = free_port()
    answers = {"seen": 0}

    def mangle(data: bytes) -> list[bytes]:
        if int.from_bytes(data[12:14], "little") != EXT_TYPE_HANDSHAKE_ANSWER:
            return [data]
        answers["seen"] += 1
        return [] if answers["seen"] <= 2 else [data, data]

    a, b = _relayed_stream(hosts, sniffer, port, mangle)
    assert answers["seen"] >= 3
    counted = counters_of(b)
    assert counted["CRYPTO_HANDSHAKES"] >= 1
    assert counted["CRYPTO_HANDSHAKE_UNMATCHED_DROPS"] >= 1
    assert drops(a) == drops(b) == dict.fromkeys(DROPS, 0)


def test_a_restarted_subscriber_driver_gets_a_new_session_and_the_stream_goes_on(
        hosts) -> None:
    """The subscriber's driver stops mid-stream and another starts on its port: it hears the
    live publication, asks for a session (its own exchange, which begins past everything
    sent before), joins, and gets every message offered from then on, once, in order."""
    port = free_port()
    uri = _keyed(port)
    a, _ = hosts("a")
    b, _ = hosts("b")
    with Client.connect(a.directory) as ca:
        publication = ca.add_publication(uri, 13)
        with Client.connect(b.directory) as cb:
            subscription = cb.add_subscription(uri, 13)
            connect(publication, subscription)
            collector = Collector(subscription)
            stream(publication, [collector], 2_000, lambda i: 300)
            collector.assert_exactly(2_000)
        b.stop()
        wait_for(lambda: not publication.is_connected, timeout=10, what="the subscriber gone")
        restarted, _ = hosts("b2")
        with Client.connect(restarted.directory) as cb:
            subscription = cb.add_subscription(uri, 13)
            connect(publication, subscription)
            collector = Collector(subscription)
            stream(publication, [collector], 2_000, lambda i: 300, first=2_000)
            collector.assert_exactly(2_000, first=2_000)
        assert counters_of(a)["CRYPTO_HANDSHAKES"] >= 2  # one exchange with each driver
        assert drops(restarted) == dict.fromkeys(DROPS, 0)


def test_a_plain_peer_is_refused_both_ways_with_named_counted_reasons(hosts, launch) -> None:
    """A plain publisher to an encrypted subscription: its datagrams are plain drops, no
    image.  An encrypted publisher to a plain subscription: its sealed datagrams are counted
    at the plain endpoint, no image, and the publication never connects."""
    a, _ = hosts("a")
    plain = launch()
    port = free_port()
    with Client.connect(a.directory) as ca, Client.connect(plain.directory) as cp:
        subscription = ca.add_subscription(f"aeron:udp?endpoint=127.0.0.1:{port}|key=k", 12)
        publication = cp.add_publication(f"aeron:udp?endpoint=127.0.0.1:{port}", 12)
        wait_for(lambda: drops(a)["CRYPTO_PLAIN_DROPS"] >= 3, what="plain datagrams dropped")
        assert not subscription.images and not publication.is_connected
        other = free_port()
        subscription = cp.add_subscription(f"aeron:udp?endpoint=127.0.0.1:{other}", 13)
        publication = ca.add_publication(f"aeron:udp?endpoint=127.0.0.1:{other}|key=k", 13)
        wait_for(lambda: drops(plain)["CRYPTO_SEALED_AT_PLAIN_DROPS"] >= 3,
                 what="sealed datagrams counted at the plain endpoint")
        assert not subscription.images and not publication.is_connected


@pytest.mark.parametrize("keys, reasons", [
    ([(1, KEY_B)], {"a": "CRYPTO_HANDSHAKE_FAILED_DROPS", "b": "CRYPTO_AWAITING_HANDSHAKE_DROPS"}),
    ([(2, KEY_A)], {"b": "CRYPTO_UNKNOWN_KEY_DROPS"})])
def test_a_peer_with_another_key_is_refused_with_a_named_counted_reason(
        hosts, keys, reasons) -> None:
    """The same key id with other key bytes: the subscriber's handshake fails at the
    publisher (its INIT is not made with the publisher's key), and the subscriber opens
    nothing without one; another id is a key the endpoint does not hold (UNKNOWN_KEY).
    Either way no image and no connection."""
    a, _ = hosts("a")
    b, _ = hosts("b", keys)
    uri = f"aeron:udp?endpoint=127.0.0.1:{free_port()}|key=k"
    drivers = {"a": a, "b": b}
    with Client.connect(a.directory) as ca, Client.connect(b.directory) as cb:
        subscription = cb.add_subscription(uri, 14)
        publication = ca.add_publication(uri, 14)
        for name, reason in reasons.items():
            wait_for(lambda: counters_of(drivers[name])[reason] >= 3,  # noqa: B023
                     what=f"{reason} at {name}")
        time.sleep(0.3)
        assert not subscription.images and not publication.is_connected
        assert drops(a)["CRYPTO_PLAIN_DROPS"] == 0
        assert counters_of(a)["CRYPTO_HANDSHAKES"] == counters_of(b)["CRYPTO_HANDSHAKES"] == 0


def test_a_channel_that_mixes_plain_and_encrypted_on_one_endpoint_is_refused(
        hosts, tmp_path: Path) -> None:
    a, directory = hosts("a")
    write_keys(directory, "other", [(1, KEY_B)])
    port = free_port()
    with Client.connect(a.directory) as ca:
        ca.add_subscription(f"aeron:udp?endpoint=127.0.0.1:{port}|key=k", 15)
        for uri in (f"aeron:udp?endpoint=127.0.0.1:{port}",
                    f"aeron:udp?endpoint=127.0.0.1:{port}|key=other"):
            with pytest.raises(ChannelRejectedError, match="key") as raised:
                ca.add_subscription(uri, 16)
            assert "encrypted on every endpoint" in str(raised.value)
        with pytest.raises(ChannelRejectedError, match=r"no-such-key\.key cannot be read"):
            ca.add_publication(f"aeron:udp?endpoint=127.0.0.1:{free_port()}|key=no-such-key",
                               17)


def test_a_world_readable_key_file_is_refused_naming_it(hosts) -> None:
    a, directory = hosts("a")
    (directory / "k.key").chmod(0o644)
    with Client.connect(a.directory) as ca, pytest.raises(ChannelRejectedError,
                                                          match="may be read by others"):
        ca.add_publication(f"aeron:udp?endpoint=127.0.0.1:{free_port()}|key=k", 18)


def test_a_key_rotated_mid_stream_loses_nothing(hosts, sniffer) -> None:
    """While messages flow, the key files of both hosts go through the three steps: the new
    key added (accepted), swapped to the front (sealing), the old one removed.  Every message
    arrives once, in order, and no datagram is dropped on the way; the wire (through a relay)
    shows the publisher sealing with the old key id first and the new one at the end."""
    fast = {"keys_reload_interval": "50ms", "timer_interval": "50ms"}
    a, dir_a = hosts("a", **fast)
    b, dir_b = hosts("b", **fast)
    port = free_port()
    relay = sniffer(port, lambda data: [data])
    steps = [[(1, KEY_A), (2, KEY_B)], [(2, KEY_B), (1, KEY_A)], [(2, KEY_B)]]
    with connected_stream(a, b, _keyed(port), 19, publication_uri=_keyed(relay.port)) as (
            publication, _, collector):
        first = 0
        for keys in [None, *steps]:
            if keys is not None:
                # One host, then the other, as an operator's rollout would.
                write_keys(dir_b, "k", keys)
                stream(publication, [collector], 1_000, lambda i: 300, first=first)
                first += 1_000
                write_keys(dir_a, "k", keys)
            stream(publication, [collector], 3_000, lambda i: 300, first=first)
            first += 3_000
            time.sleep(0.3)  # a few reloads
        stream(publication, [collector], 3_000, lambda i: 300, first=first)
        first += 3_000
        collector.assert_exactly(first)
    key_ids = [data[FLAGS_FIELD] for data in relay.captured]
    assert key_ids[0] == 1 and key_ids[-100:] == [2] * 100
    assert drops(a) == drops(b) == dict.fromkeys(DROPS, 0)


def test_an_encrypted_multicast_stream_reaches_each_subscriber_driver_once(hosts) -> None:
    """Multicast on loopback: the data group and the control group carry sealed datagrams;
    two subscriber drivers (fc=min: both hold the sender) get every message once, in
    order; nothing is dropped."""
    uri = (f"aeron:udp?endpoint=224.0.1.{random.randrange(1, 250, 2)}:{free_port()}"
           f"|interface=127.0.0.1|term-length=64k|key=k")
    publisher, _ = hosts("p")
    subscribers = [hosts(f"s{i}")[0] for i in range(2)]
    clients = [Client.connect(d.directory) for d in (publisher, *subscribers)]
    try:
        subscriptions = [c.add_subscription(uri, 20) for c in clients[1:]]
        publication = clients[0].add_publication(uri + "|fc=min,g:/2", 20)
        connect(publication, *subscriptions)
        stream_to_all(publication, subscriptions, 10_000, lambda i: 100 + i % 1300, timeout=60)
    finally:
        for client in clients:
            client.close()
    for driver in (publisher, *subscribers):
        assert drops(driver) == dict.fromkeys(DROPS, 0)


def test_only_receivers_with_the_key_join_an_encrypted_dynamic_mdc_stream(
        hosts, launch) -> None:
    """Dynamic multi-destination-cast: two receivers with the key join by their status
    messages and get every message once; a plain receiver naming the same control address
    is no destination (its SMs are plain drops at the sender), gets no image, and costs the
    stream nothing."""
    sender, _ = hosts("sender")
    receivers = [hosts(f"r{i}")[0] for i in range(2)]
    outsider = launch()
    control = f"127.0.0.1:{free_port()}"
    clients = [Client.connect(d.directory) for d in (sender, *receivers, outsider)]
    try:
        publication = clients[0].add_publication(
            f"aeron:udp?control={control}|control-mode=dynamic|fc=min|term-length=64k|key=k",
            21)
        subscriptions = [c.add_subscription(
            f"aeron:udp?endpoint=127.0.0.1:{free_port()}|control={control}|key=k", 21)
            for c in clients[1:3]]
        plain = clients[3].add_subscription(
            f"aeron:udp?endpoint=127.0.0.1:{free_port()}|control={control}", 21)
        wait_for(lambda: all(s.images for s in subscriptions) and publication.is_connected,
                 timeout=10, what="both receivers joined")
        stream_to_all(publication, subscriptions, 10_000, lambda i: (32, 1376, 5000)[i % 3])
        wait_for(lambda: drops(sender)["CRYPTO_PLAIN_DROPS"] >= 3,
                 what="the outsider's status messages dropped")
        assert not plain.images
        assert mdc_destinations(sender) == 2
    finally:
        for client in clients:
            client.close()


def test_a_manual_mdc_publication_seals_once_for_each_destination_it_was_given(
        hosts) -> None:
    """Manual multi-destination-cast (fc=min: both receivers hold the sender): each
    receiver with the key that the publication was given as a destination gets every message
    once and in order; the sender's endpoint seals each datagram once and sends it to both,
    and nothing is dropped anywhere."""
    sender, _ = hosts("sender")
    receivers = [hosts(f"m{i}")[0] for i in range(2)]
    ports = [free_port() for _ in receivers]
    clients = [Client.connect(d.directory) for d in (sender, *receivers)]
    try:
        publication = clients[0].add_publication(
            "aeron:udp?control-mode=manual|fc=min|term-length=64k|key=k", 22)
        subscriptions = [c.add_subscription(f"aeron:udp?endpoint=127.0.0.1:{port}|key=k", 22)
                         for c, port in zip(clients[1:], ports, strict=True)]
        for port in ports:
            publication.add_destination(f"aeron:udp?endpoint=127.0.0.1:{port}")
        connect(publication, *subscriptions)
        stream_to_all(publication, subscriptions, 5_000, lambda i: 100 + i % 1300)
        assert mdc_destinations(sender) == 2
    finally:
        for client in clients:
            client.close()
    for driver in (sender, *receivers):
        assert drops(driver) == dict.fromkeys(DROPS, 0)


def test_a_spy_reads_an_encrypted_publication_in_plain_text(hosts) -> None:
    """A spy on the publisher's host reads the publication's log, which holds the stream
    in plain text: it names no key (a spy with key= is refused by name)."""
    a, _ = hosts("a")
    b, _ = hosts("b")
    endpoint = f"127.0.0.1:{free_port()}"
    with Client.connect(a.directory) as ca, Client.connect(b.directory) as cb:
        subscription = cb.add_subscription(f"aeron:udp?endpoint={endpoint}|key=k", 22)
        publication = ca.add_publication(f"aeron:udp?endpoint={endpoint}|key=k", 22)
        spy = ca.add_subscription(f"aeron-spy:aeron:udp?endpoint={endpoint}", 22)
        connect(publication, subscription, spy)
        stream_to_all(publication, [subscription, spy], 5_000, lambda i: 500)
        # The spy's URI names no key; its driver says the stream's, as the receiver's does.
        assert [image.channel_key for image in (*spy.images, *subscription.images)] == \
            ["k", "k"]
        with pytest.raises(ChannelError, match="key"):
            ca.add_subscription(f"aeron-spy:aeron:udp?endpoint={endpoint}|key=k", 22)


def test_forged_control_from_the_receivers_address_changes_nothing_at_the_publisher(
        hosts, sniffer) -> None:
    """From the relay's port (the address the publisher's socket is connected to: the
    receiver's, as the publisher sees it), every few ms a plain NAK of the whole window, a
    plain ERR naming the stream, a plain SM of a zero window, and the same SM sealed under
    another key.  The publisher drops and counts each (plain, unknown key), answers no NAK
    (no retransmission on a lossless loopback), stays connected, and the subscriber gets
    every message once."""
    port = free_port()
    relay = sniffer(port, lambda data: [data])
    a, _ = hosts("a")
    b, _ = hosts("b")
    outsider = Sealing("k", None)
    outsider.set_keys([(9, KEY_B)])
    with connected_stream(a, b, _keyed(port), 23, publication_uri=_keyed(relay.port)) as (
            publication, subscription, _):
        session, term_id = publication.session_id, publication.initial_term_id
        forged = [Nak(session, 23, term_id, 0, 32 * 1024).encode(),
                  ErrorFrame(session, 23, 1, 1, "forged: go away").encode(),
                  StatusMessage(session, 23, term_id, 0, 0, 1).encode()]
        forged.append(outsider.seal(forged[-1]))
        stop = threading.Event()
        sent = [0]

        def forge() -> None:
            while not stop.is_set():
                assert relay.publisher is not None
                for data in forged:
                    relay.front.sendto(data, relay.publisher)
                sent[0] += 1
                time.sleep(0.002)

        before = counters_of(a)
        forger = threading.Thread(target=forge, daemon=True)
        forger.start()
        try:
            collector = Collector(subscription)
            stream(publication, [collector], 20_000, lambda i: 300, timeout=60)
            collector.assert_exactly(20_000)
            assert publication.is_connected
        finally:
            stop.set()
            forger.join()
        # While the publication's endpoint is still there to take them: a loaded host's
        # driver may still have the last forgeries in its socket when the stream ends.
        dropped = lambda name: counters_of(a)[name] - before[name]  # noqa: E731
        wait_for(lambda: dropped("CRYPTO_PLAIN_DROPS") >= 0.9 * 3 * sent[0]
                 and dropped("CRYPTO_UNKNOWN_KEY_DROPS") >= 0.9 * sent[0], timeout=10,
                 what="the forgeries sent counted as dropped")
    after = counters_of(a)
    assert sent[0] > 50
    assert after["NAK_MESSAGES_RECEIVED"] == before["NAK_MESSAGES_RECEIVED"]
    assert after["RETRANSMITS_SENT"] == before["RETRANSMITS_SENT"]
    assert after["ERRORS"] == before["ERRORS"]


def test_an_mtu_setting_too_large_to_seal_is_refused_naming_mtu(hosts) -> None:
    a, _ = hosts("a", mtu_length="65504", term_buffer_length="1m")
    with Client.connect(a.directory) as ca, pytest.raises(ChannelRejectedError,
                                                          match="mtu_length"):
        ca.add_publication(f"aeron:udp?endpoint=127.0.0.1:{free_port()}|key=k", 24)


def test_the_archive_records_an_encrypted_stream_from_its_plain_log(hosts, tmp_path) -> None:
    """An archive beside the publisher records the encrypted publication through a spy on
    its log (the archive drops key= from the spy's URI), while a receiver on another driver
    reads it over the encrypted network: both have every message, the recording at the
    publisher's positions."""
    from test_archive import (
        archive_process,
        check_recording,
        publish_to_the_end,
        wait_for_recording,
        write_config,
    )

    a, _ = hosts("a")
    b, _ = hosts("b")
    channel = f"aeron:udp?endpoint=127.0.0.1:{free_port()}|key=k"  # 64 KiB terms: hosts'
    archive_dir = tmp_path / "archive"
    config = write_config(tmp_path / "archive.toml", archive_dir, a.directory, [(channel, 25)])
    with Client.connect(a.directory) as ca, Client.connect(b.directory) as cb, \
            archive_process(config, tmp_path / "archive.log"):
        receiver = Collector(cb.add_subscription(channel, 25))
        publication = ca.add_publication(channel, 25)
        wait_for(lambda: publication.is_connected, what="the receiver connected")
        wait_for_recording(archive_dir)
        positions, descriptor = publish_to_the_end(publication, receiver, archive_dir, 1500)
    receiver.assert_exactly(1500)
    check_recording(descriptor, archive_dir, positions)
    assert drops(a) == drops(b) == dict.fromkeys(DROPS, 0)


def test_a_plain_and_a_keyed_publication_to_one_address_each_have_an_endpoint(hosts) -> None:
    """A plain publication to an address, opened first, does not hold that address against
    a keyed one: each sends from a send endpoint of its own key, so the keyed subscriber
    there gets every keyed message and the plain datagrams are dropped at its endpoint."""
    a, _ = hosts("a")
    b, _ = hosts("b")
    endpoint = f"127.0.0.1:{free_port()}"
    with Client.connect(a.directory) as ca, Client.connect(b.directory) as cb:
        plain = ca.add_publication(f"aeron:udp?endpoint={endpoint}", 25)
        subscription = cb.add_subscription(f"aeron:udp?endpoint={endpoint}|key=k", 25)
        keyed = ca.add_publication(f"aeron:udp?endpoint={endpoint}|key=k", 25)
        connect(keyed, subscription)
        collector = Collector(subscription)
        stream(keyed, [collector], 2_000, lambda i: 200)
        collector.assert_exactly(2_000)
        assert not plain.is_connected
        wait_for(lambda: drops(b)["CRYPTO_PLAIN_DROPS"] > 0, what="the plain SETUPs dropped")
