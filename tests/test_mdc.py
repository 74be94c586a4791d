"""Multi-destination-cast (docs/CHANNELS.md §7.4) between real driver processes on loopback:
one publication's stream to several receive endpoints without multicast, manual
(``add_destination``) and dynamic (receivers that join at the publication's control address).

Every stream is checked message by message (helpers.Collector): each subscriber sees its
messages in order, none missing or twice, from the one it joined at.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import (
    Collector,
    counters_of,
    free_port,
    lacking,
    mdc_destinations,
    stream,
    stream_to_all,
    wait_for,
)

from slipstream.client import ChannelRejectedError, Client
from slipstream.daemon.ops.metrics import CountersCollector

pytestmark = pytest.mark.timeout(120)

STREAM = 1001


def test_manual_destinations_each_get_the_whole_stream_in_order(launch) -> None:
    """Three receiving drivers, each its own port; the publication adds each as a
    destination and streams 20,000 messages (terms of 64 KiB rotate many times): each
    receiver gets all of them, once, in order.  A removed destination gets nothing more
    while the others go on.  fc=min: with the default (max, as for multicast and in Aeron)
    a receiver that falls half a term behind the fastest is past the resend window."""
    sender = launch()
    receivers = [launch() for _ in range(3)]
    ports = [free_port() for _ in receivers]
    clients = [Client.connect(d.directory) for d in (sender, *receivers)]
    try:
        subscriptions = [c.add_subscription(f"aeron:udp?endpoint=127.0.0.1:{port}", STREAM)
                         for c, port in zip(clients[1:], ports, strict=True)]
        publication = clients[0].add_publication(
            "aeron:udp?control-mode=manual|term-length=64k|fc=min", STREAM)
        for port in ports:
            publication.add_destination(f"aeron:udp?endpoint=127.0.0.1:{port}")
        wait_for(lambda: all(s.images for s in subscriptions) and publication.is_connected,
                 timeout=10, what="every destination has an image")
        assert mdc_destinations(sender) == 3
        [family] = [f for f in CountersCollector(sender.directory).collect()
                    if f.name == "slipstream_mdc_destinations"]
        assert [(s.labels, s.value) for s in family.samples] == [
            ({"channel": "aeron:udp?control-mode=manual|term-length=64k|fc=min"}, 3)]
        collectors = stream_to_all(publication, subscriptions, 20_000,
                                   lambda i: (32, 1376, 5000)[i % 3])

        publication.remove_destination(f"aeron:udp?endpoint=127.0.0.1:{ports[2]}")
        # The sender's duty cycle sets the gauge after the conductor took the removal.
        wait_for(lambda: mdc_destinations(sender) == 2, timeout=10,
                 what="the destinations gauge at 2")
        stream(publication, collectors[:2], 2_000, lambda i: 100, first=20_000)
        for collector in collectors[:2]:
            collector.assert_exactly(22_000)
        collectors[2].poll()
        assert len(collectors[2].seen) == 20_000

        # A destination added to the running stream joins where the sender is: its first
        # data elicits the SETUP.
        late_port = free_port()
        late = clients[1].add_subscription(f"aeron:udp?endpoint=127.0.0.1:{late_port}", STREAM)
        publication.add_destination(f"aeron:udp?endpoint=127.0.0.1:{late_port}")
        wait_for(lambda: late.images, timeout=10, what="the late destination joined")
        assert late.images[0].join_position == publication.position
        collectors.append(Collector(late))
        kept = [collectors[0], collectors[1], collectors[3]]
        stream(publication, kept, 2_000, lambda i: 100, first=22_000)
        kept[2].assert_exactly(2_000, first=22_000)
        assert mdc_destinations(sender) == 3
    finally:
        for client in clients:
            client.close()
    assert counters_of(sender)["SEND_ERRORS"] == 0


def test_destination_errors_name_their_cause(launch) -> None:
    """A duplicate add, the removal of a destination never added, a destination with keys
    of its own, a host that does not resolve, one on a publication that is not
    control-mode=manual: each refused by name; a destination the kernel refuses is counted;
    and the stream to the real destination goes on."""
    sender, receiver = launch(), launch()
    port = free_port()
    with Client.connect(sender.directory) as a, Client.connect(receiver.directory) as b:
        subscription = b.add_subscription(f"aeron:udp?endpoint=127.0.0.1:{port}", STREAM)
        publication = a.add_publication("aeron:udp?control-mode=manual", STREAM)
        destination = f"aeron:udp?endpoint=127.0.0.1:{port}"
        publication.add_destination(destination)
        with pytest.raises(ChannelRejectedError, match="already") as duplicate:
            publication.add_destination(destination)
        assert duplicate.value.part == "endpoint"
        with pytest.raises(ChannelRejectedError, match="not a destination") as unknown:
            publication.remove_destination(f"aeron:udp?endpoint=127.0.0.1:{free_port()}")
        assert unknown.value.part == "endpoint"
        with pytest.raises(ChannelRejectedError) as extra:
            publication.add_destination(f"aeron:udp?endpoint=127.0.0.1:{port}|ttl=4")
        assert extra.value.part == "ttl"
        with pytest.raises(ChannelRejectedError) as unresolved:
            publication.add_destination("aeron:udp?endpoint=no-such-host.invalid:4000")
        assert unresolved.value.part == "endpoint"
        unicast = a.add_publication(f"aeron:udp?endpoint=127.0.0.1:{free_port()}", STREAM)
        with pytest.raises(ChannelRejectedError) as not_manual:
            unicast.add_destination(destination)
        assert not_manual.value.part == "control-mode"
        # One the kernel refuses outright (a broadcast address, on a socket without
        # SO_BROADCAST: EACCES, nothing leaves): counted, and the others do not stall.
        publication.add_destination("aeron:udp?endpoint=255.255.255.255:9")
        wait_for(lambda: subscription.images and publication.is_connected, timeout=10,
                 what="the destination has an image")
        # A spy names the publication's channel, control-mode=manual and all.
        spy = a.add_subscription("aeron-spy:aeron:udp?control-mode=manual", STREAM)
        collector, spied = Collector(subscription), Collector(spy)
        stream(publication, [collector, spied], 2_000, lambda i: 64)
        collector.assert_exactly(2_000)
        spied.assert_exactly(2_000)
    assert counters_of(sender)["SEND_ERRORS"] > 0


def test_dynamic_receivers_join_at_the_control_address_and_time_out_when_gone(launch) -> None:
    """Receivers name the publication's control address (``control=``) and join by their
    status messages alone: each gets the stream in order from its join; one that joins late
    starts at the stream's position then; one whose driver stops is dropped as a destination
    after the timeout (5 s), and the others go on meanwhile."""
    sender = launch()
    receivers = [launch() for _ in range(3)]
    control_address = f"127.0.0.1:{free_port()}"
    clients = [Client.connect(d.directory) for d in (sender, *receivers)]
    try:
        publication = clients[0].add_publication(
            f"aeron:udp?control={control_address}|control-mode=dynamic|term-length=64k|fc=min",
            STREAM)
        subscriptions = [c.add_subscription(
            f"aeron:udp?endpoint=127.0.0.1:{free_port()}|control={control_address}", STREAM)
            for c in clients[1:3]]
        wait_for(lambda: all(s.images for s in subscriptions) and publication.is_connected,
                 timeout=10, what="both receivers joined")
        collectors = stream_to_all(publication, subscriptions, 10_000,
                                   lambda i: (32, 1376, 5000)[i % 3])
        assert mdc_destinations(sender) == 2

        late = clients[3].add_subscription(
            f"aeron:udp?endpoint=127.0.0.1:{free_port()}|control={control_address}", STREAM)
        wait_for(lambda: late.images, timeout=10, what="the late receiver joined")
        [image] = late.images
        assert image.join_position == publication.position
        collectors.append(Collector(late))
        stream(publication, collectors, 10_000, lambda i: 200, first=10_000)
        for collector in collectors[:2]:
            collector.assert_exactly(20_000)
        collectors[2].assert_exactly(10_000, first=10_000)
        assert mdc_destinations(sender) == 3

        clients[2].close()
        receivers[1].stop()
        wait_for(lambda: mdc_destinations(sender) == 2, timeout=10,
                 what="the receiver that went was timed out")
        kept = [collectors[0], collectors[2]]
        stream(publication, kept, 2_000, lambda i: 64, first=20_000)
        kept[0].assert_exactly(22_000)
        kept[1].assert_exactly(12_000, first=10_000)
    finally:
        for client in clients:
            client.close()


def test_a_dynamic_receiver_of_one_stream_does_not_hold_another_under_min(launch) -> None:
    """Two streams on one control address under fc=min: a receiver that joins for one of
    them becomes a destination of both (the endpoint's), yet never holds the other, which it
    does not take (its session-0 joins elicit no SETUP of that stream)."""
    sender, first, second = launch(), launch(), launch()
    control_address = f"127.0.0.1:{free_port()}"
    clients = [Client.connect(d.directory) for d in (sender, first, second)]
    try:
        uri = f"aeron:udp?control={control_address}|control-mode=dynamic|fc=min|term-length=64k"
        taken = clients[0].add_publication(uri, 2)
        other = clients[0].add_publication(uri, 1)
        reader = clients[1].add_subscription(
            f"aeron:udp?endpoint=127.0.0.1:{free_port()}|control={control_address}", 2)
        wait_for(lambda: reader.images and taken.is_connected, timeout=10,
                 what="the first receiver joined stream 2")
        collector = Collector(reader)
        stream(taken, [collector], 3000, lambda _: 500)
        joining = clients[2].add_subscription(
            f"aeron:udp?endpoint=127.0.0.1:{free_port()}|control={control_address}", 1)
        wait_for(lambda: joining.images and other.is_connected
                 and mdc_destinations(sender) == 2, timeout=10,
                 what="the second receiver joined stream 1")
        time.sleep(1.5)  # past a join SM of the second receiver's
        stream(taken, [collector], 3000, lambda _: 500, first=3000, timeout=10)
        collector.assert_exactly(6000)
    finally:
        for client in clients:
            client.close()


def test_a_send_socket_that_fills_slows_the_stream_to_every_destination_never_stops_it(
        ) -> None:
    """Eight destinations through a loopback rate-limited to 200 Mbit/s (in a network
    namespace of the test's own: tests/mdc_full_socket.py): the socket fills again and again
    (short sends), each destination's share of a full socket is lost and asked for again, and
    every destination gets the whole stream in order.  A send that waited for the slowest
    destination to take everything would resend to all and never move on."""
    if os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("tc") is None:
        lacking("a network namespace of the test's own (unshare -n) and tc: root")
    script = Path(__file__).with_name("mdc_full_socket.py")
    done = subprocess.run(["unshare", "-n", sys.executable, str(script), "8", "5000"],
                          capture_output=True, text=True, timeout=150,
                          env={**os.environ, "PYTHONPATH": str(script.parent)})
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["received"] == [5000] * 8 and all(result["in_order"]), result
    assert result["counters"]["SHORT_SENDS"] > 0, result  # the socket filled
    assert result["counters"]["SEND_ERRORS"] == 0, result
