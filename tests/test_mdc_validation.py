"""Dynamic multi-destination-cast's address validation and ``join=`` through real drivers on
loopback (docs/CHANNELS.md §7.4.1; tests/test_destinations.py has the rules in process,
tests/test_mdc_validation_hosts.py the attacks on namespace hosts).

A slipstream receiver validates by answering the probe and joins where the stream is; one
outside the publication's ``join=`` subnets (or the driver's ``mdc_join``) is never a
destination, its status messages counted as dropped by that cause; a ``join=`` that is no
subnet list, or that differs from the one of its control address, is refused naming ``join``.
"""

from __future__ import annotations

import pytest
from helpers import Collector, counters_of, free_port, stream, wait_for

from slipstream.client import ChannelError, ChannelRejectedError, Client

STREAM = 1003


def test_a_slipstream_receiver_validates_and_joins_where_the_stream_is(launch) -> None:
    """Two receivers join an idle stream one after the other; each is a destination only
    after it answered its probe (the counter never counts a candidate) and its image starts at
    the stream's position then; every message after reaches both, once, in order; no drop is
    counted."""
    sender, first, second = launch(), launch(), launch()
    control_address = f"127.0.0.1:{free_port()}"
    clients = [Client.connect(d.directory) for d in (sender, first, second)]
    try:
        publication = clients[0].add_publication(
            f"aeron:udp?control={control_address}|control-mode=dynamic|fc=min"
            "|join=127.0.0.0/8", STREAM)
        early = clients[1].add_subscription(
            f"aeron:udp?endpoint=127.0.0.1:{free_port()}|control={control_address}", STREAM)
        wait_for(lambda: early.images and publication.is_connected, timeout=10,
                 what="the first receiver joined")
        collectors = [Collector(early)]
        stream(publication, collectors, 2_000, lambda i: 100)
        late = clients[2].add_subscription(
            f"aeron:udp?endpoint=127.0.0.1:{free_port()}|control={control_address}", STREAM)
        wait_for(lambda: late.images, timeout=10, what="the second receiver joined")
        assert late.images[0].join_position == publication.position
        collectors.append(Collector(late))
        stream(publication, collectors, 5_000, lambda i: 500, first=2_000)
        collectors[0].assert_exactly(7_000)
        collectors[1].assert_exactly(5_000, first=2_000)
        counters = counters_of(sender)
        for cause in ("MDC_JOIN_SUBNET_DROPS", "MDC_CANDIDATES_REFUSED",
                      "MDC_AMPLIFICATION_DROPS"):
            assert counters.get(cause, 0) == 0, (cause, counters)
    finally:
        for client in clients:
            client.close()


def test_a_receiver_of_one_session_validates_by_its_image_and_loses_nothing(launch) -> None:
    """A subscription with ``session-id=`` answers no heartbeat of another session: it is sent
    the SETUP once it asked twice, and validates by echoing the token in an RTTM from the
    image that SETUP made; it then gets the stream from that image's position, once and in
    order, while the publication was idle or not."""
    sender, receiver = launch(), launch()
    control_address = f"127.0.0.1:{free_port()}"
    with Client.connect(sender.directory) as a, Client.connect(receiver.directory) as b:
        publication = a.add_publication(
            f"aeron:udp?control={control_address}|control-mode=dynamic", STREAM)
        subscription = b.add_subscription(
            f"aeron:udp?endpoint=127.0.0.1:{free_port()}|control={control_address}"
            f"|session-id={publication.session_id}", STREAM)
        wait_for(lambda: subscription.images and publication.is_connected, timeout=10,
                 what="the one-session receiver joined")
        collector = Collector(subscription)
        stream(publication, [collector], 3_000, lambda i: 300)
        collector.assert_exactly(3_000)
        assert counters_of(sender).get("MDC_UNVALIDATED_DROPS", 0) == 0


@pytest.mark.parametrize("where", ["channel", "setting"])
def test_a_receiver_outside_the_join_subnets_never_joins_and_is_counted(launch, where) -> None:
    """``join=10.9.0.0/16`` on the channel, or ``mdc_join`` in the driver's settings: a
    loopback receiver's status messages are dropped unanswered, counted by their cause; it gets
    no image and the publication no destination, while they keep coming."""
    sender = launch(**({"mdc_join": "10.9.0.0/16"} if where == "setting" else {}))
    receiver = launch()
    control_address = f"127.0.0.1:{free_port()}"
    join = "|join=10.9.0.0/16" if where == "channel" else ""
    with Client.connect(sender.directory) as a, Client.connect(receiver.directory) as b:
        publication = a.add_publication(
            f"aeron:udp?control={control_address}|control-mode=dynamic{join}", STREAM)
        subscription = b.add_subscription(
            f"aeron:udp?endpoint=127.0.0.1:{free_port()}|control={control_address}", STREAM)
        # Its SMs come a second apart: three of them dropped, and still nothing.
        wait_for(lambda: counters_of(sender).get("MDC_JOIN_SUBNET_DROPS", 0) >= 3, timeout=10,
                 what="the receiver's status messages were dropped")
        assert not subscription.images and not publication.is_connected
        assert counters_of(sender).get("STATUS_MESSAGES_RECEIVED", 0) == 0


def test_a_bad_or_conflicting_join_is_refused_naming_the_key(launch) -> None:
    """Host bits set, no subnet, ``join=`` without ``control-mode=dynamic`` (the client
    refuses these), and a ``join=`` other than the one of publications at the same control
    address (the driver refuses it): each names ``join``."""
    driver = launch()
    control_address = f"127.0.0.1:{free_port()}"
    base = f"aeron:udp?control={control_address}|control-mode=dynamic"
    with Client.connect(driver.directory) as client:
        for bad in (f"{base}|join=10.1.0.1/16", f"{base}|join=10.1.0.0/16,somewhere",
                    f"aeron:udp?endpoint={control_address}|join=10.1.0.0/16"):
            with pytest.raises(ChannelError) as refused:
                client.add_publication(bad, STREAM)
            assert refused.value.part == "join", bad
        client.add_publication(f"{base}|join=127.0.0.0/8", STREAM)
        for other in (f"{base}|join=127.0.0.0/16", base):
            with pytest.raises(ChannelRejectedError, match="join") as rejected:
                client.add_publication(other, STREAM + 1)
            assert rejected.value.part == "join", other
        client.add_publication(f"{base}|join=127.0.0.0/8", STREAM + 1)  # the same: shared

