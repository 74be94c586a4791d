"""Multi-destination subscriptions (docs/CHANNELS.md §7.5) with a stock Aeron 1.15.1 driver,
both ways: one side's manual multi-destination-cast publication sends every datagram to both
destinations of the other side's ``control-mode=manual`` subscription, and the subscriber reads
each message once, in order, from one image.

The Aeron end is its driver with our MdcPublisher or MdsSubscriber (tests/aeron_peer/mdc.py:
destinations added and removed, messages offered or counted on command).  Payloads carry the
message index first, as in tests/test_interop_mdc.py, whose helpers these tests use.  Terms of
64 KiB, so each stream rotates terms.

Needs ``scripts/ensure-aeron`` (the jar, Java 11 and the compiled peers); under CI=true a
missing peer fails.
"""

from __future__ import annotations

import time

import aeron_peer
import pytest
from aeron_peer import AeronDriver, MdcPublisher, MdsSubscriber
from helpers import free_port, lacking, wait_for
from test_interop_mdc import (
    AERON_TERM,
    HOST,
    MESSAGES,
    Indexes,
    assert_clean,
    publish_indexes,
    read_while,
)

from slipstream.client import Client

pytestmark = pytest.mark.timeout(60)

STREAM = 2101


@pytest.fixture
def aeron() -> AeronDriver:
    for peer in ("MdcPublisher", "MdsSubscriber"):
        reason = aeron_peer.peer_available(peer)
        if reason is not None:
            lacking(f"the Aeron peer: {reason}")
    with AeronDriver() as driver:
        yield driver


def test_an_aeron_mdc_publication_to_both_destinations_reads_once(aeron: AeronDriver,
                                                                  launch) -> None:
    """Aeron's manual MDC publication adds both destinations of one slipstream MDS
    subscription: one image, every message once and in order.  Aeron then drops one
    destination (a path lost) and the stream goes on through the other, whole."""
    receiver = launch()
    ports = [free_port(), free_port()]
    with Client.connect(receiver.directory) as client:
        subscription = client.add_subscription("aeron:udp?control-mode=manual", STREAM)
        for port in ports:
            subscription.add_destination(f"aeron:udp?endpoint={HOST}:{port}")
        with MdcPublisher(aeron, f"aeron:udp?control-mode=manual|control={HOST}:{free_port()}"
                          f"{AERON_TERM}", STREAM, message_length=1024) as publisher:
            for port in ports:
                publisher.add(f"aeron:udp?endpoint={HOST}:{port}")
            wait_for(lambda: subscription.images and publisher.is_connected(), timeout=10,
                     what="slipstream's image of Aeron's stream")
            reader = Indexes(subscription)
            read_while(lambda: publisher.send(MESSAGES), [reader], MESSAGES)
            publisher.remove(f"aeron:udp?endpoint={HOST}:{ports[0]}")
            read_while(lambda: publisher.send(MESSAGES), [reader], 2 * MESSAGES)
            assert reader.seen == list(range(2 * MESSAGES))
            [image] = subscription.images
            assert image.session_id == publisher.session_id
    assert_clean(receiver)


def test_a_slipstream_mdc_publication_to_an_aeron_mds_subscription(aeron: AeronDriver,
                                                                  launch) -> None:
    """slipstream's manual MDC publication sends to both destinations of Aeron's MDS
    subscription (``Subscription.addDestination``): Aeron makes one image and reads every
    message once, in order."""
    sender = launch()
    ports = [free_port(), free_port()]
    with MdsSubscriber(aeron, "aeron:udp?control-mode=manual", STREAM) as subscriber, \
            Client.connect(sender.directory) as client:
        for port in ports:
            subscriber.add(f"aeron:udp?endpoint={HOST}:{port}")
        publication = client.add_publication("aeron:udp?control-mode=manual", STREAM)
        for port in ports:
            publication.add_destination(f"aeron:udp?endpoint={HOST}:{port}")
        wait_for(lambda: publication.is_connected, timeout=10, what="Aeron's image")
        publish_indexes(publication, MESSAGES)
        wait_for(lambda: subscriber.status().received >= MESSAGES, timeout=30,
                 what="Aeron read every message")
        time.sleep(0.3)  # a duplicate would show up here
        status = subscriber.status()
        assert status == (MESSAGES, 0, MESSAGES - 1, 0, 1), status
    assert_clean(sender)
