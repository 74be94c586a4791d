"""Untethered subscriptions and ``rejoin=false`` on ``aeron:udp``, between real driver
processes on loopback (docs/DRIVER.md §4.7).

* ``tether=false``: a subscription that stops reading holds its image (and so the sender)
  for its window limit timeout, then is left behind (its image goes, with the range it
  skips), lingers as long again, and holds nothing more; after its resting timeout it
  rejoins with a new image.  The tethered subscription beside it gets every message.
* ``rejoin=false``: once a session's image went, that session does not come back to the
  endpoint while it has subscriptions of the stream; another session does.
"""

from __future__ import annotations

import time

import pytest
from helpers import Collector, connect, counters_of, free_port, stream, wait_for

from slipstream.client import Client

pytestmark = pytest.mark.timeout(120)

TERM = "term-length=256k"


def test_an_untethered_subscription_that_stops_reading_is_left_behind_and_rejoins(
        launch) -> None:
    a, b = launch(), launch()
    uri = f"aeron:udp?endpoint=127.0.0.1:{free_port()}"
    left: list = []
    with Client.connect(a.directory) as ca, Client.connect(b.directory) as cb:
        tethered = cb.add_subscription(uri, 10)
        untethered = cb.add_subscription(
            f"{uri}|tether=false|untethered-window-limit-timeout=300ms"
            f"|untethered-resting-timeout=500ms", 10, on_unavailable_image=left.append)
        publication = ca.add_publication(f"{uri}|{TERM}", 10)
        connect(publication, tethered, untethered)
        [image] = untethered.images
        received = Collector(tethered)
        # The untethered subscription never reads: the stream is held at its window (the
        # receiver's, 128 KiB) until it is left behind, then runs on, many windows past it.
        started = time.monotonic()
        stream(publication, [received], 3000, lambda _: 1000)
        received.assert_exactly(3000)
        assert time.monotonic() - started >= 0.5  # held for the window limit and the linger
        assert left == [image] and image.lost_range is not None
        assert image.lost_range[0] == 0 and image.lost_range[1] > 0
        wait_for(lambda: untethered.images, timeout=5, what="the untethered one rejoined")
        [again] = untethered.images
        assert again is not image and again.join_position >= image.lost_range[1]
        # Rejoined, it reads on from its join position, in order.
        rejoined = Collector(untethered)
        stream(publication, [received, rejoined], 500, lambda _: 1000, first=3000)
        received.assert_exactly(3500)
        assert rejoined.seen and rejoined.seen[-1] == 3499
        assert rejoined.seen == list(range(rejoined.seen[0], 3500))
    assert counters_of(b)["UNTETHERED_SKIPS"] >= 1


@pytest.mark.parametrize("rejoin", [True, False])
def test_rejoin_false_keeps_a_session_whose_image_went_from_coming_back(launch,
                                                                        rejoin: bool) -> None:
    a, b = launch(), launch()
    uri = f"aeron:udp?endpoint=127.0.0.1:{free_port()}"
    suffix = "" if rejoin else "|rejoin=false"
    with Client.connect(a.directory) as ca, Client.connect(b.directory) as cb:
        subscription = cb.add_subscription(f"{uri}{suffix}", 11)
        first = ca.add_publication(f"{uri}|session-id=77", 11)
        connect(first, subscription)
        first.close()  # end of stream: the image goes
        wait_for(lambda: not subscription.images, timeout=10, what="the image went")
        again = ca.add_publication(f"{uri}|session-id=77", 11)
        if rejoin:  # after the session's cool-down (1 s)
            wait_for(lambda: subscription.images, timeout=10, what="the session came back")
        else:
            time.sleep(2.5)
            assert not subscription.images and not again.is_connected
            other = ca.add_publication(f"{uri}|session-id=78", 11)
            wait_for(lambda: subscription.images, timeout=10, what="another session")
            assert [i.session_id for i in subscription.images] == [78]
            collector = Collector(subscription)
            stream(other, [collector], 100, lambda _: 64)
            collector.assert_exactly(100)
