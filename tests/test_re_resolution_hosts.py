"""Names that follow a receiver that moves, on namespace hosts (docs/CHANNELS.md §7.2, §7.4).

The publisher's host has a hosts file of its own (``NamespaceHosts.set_names``: the
``/etc/netns/<namespace>/hosts`` that ``ip netns exec`` bind-mounts over /etc/hosts), so its
driver resolves the receiver's name through the system's resolver (getaddrinfo, nsswitch's
``files``), as a pod resolves a service's name.  The receiver leaves its host and subscribes
on another; the name's record is rewritten in place to the new host's address.  Within
``publication_connection_timeout`` (contact lost) plus the re-resolution interval (the name
resolved again) plus the connection cycle (data, the SETUP it elicits, the first status
message), the moved receiver gets the stream again: every message from where it rejoined, once
and in order, as a new receiver; a receiver that did not move loses nothing; the publisher's
driver counts one resolution change."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import pytest
from helpers import (
    NETWORK_SETTINGS,
    Collector,
    counters_of,
    message,
    readdress,
    run_stat,
    wait_for,
)

from slipstream.client import Client, control
from slipstream.client.counters import CountersFile, CounterType

PORT = 40141
#: Contact is lost after publication_connection_timeout (1 s here), and the name resolved
#: again at the next check (name_re_resolution_interval, 1 s, the default).
SETTINGS = {**NETWORK_SETTINGS}
CONNECTION_TIMEOUT_S = 1.0
INTERVAL_S = 1.0


class Feed:
    """A publisher offering numbered messages as fast as they are taken, polling its
    collectors between offers."""

    def __init__(self, publication: Any, collectors: list[Collector]) -> None:
        self.publication = publication
        self.collectors = collectors
        self.sent = 0

    def run_until(self, done: Callable[[], object], timeout: float = 20.0,
                  what: str = "condition", *, offer: bool = True) -> None:
        """Offer (unless not ``offer``) and poll until ``done()``."""
        deadline = time.monotonic() + timeout
        while not done():
            assert time.monotonic() < deadline, (
                f"{what}: sent {self.sent}, received {[len(c.seen) for c in self.collectors]}")
            for _ in range(32 if offer else 0):
                if self.publication.offer(message(self.sent, 64)) < 0:
                    break
                self.sent += 1
            if not sum(c.poll() for c in self.collectors):
                time.sleep(0.0005)


    def rejoin(self, move: Callable[[], None], new: Collector, where: str) -> float:
        """``move()`` (the name's record rewritten), then offer and poll until ``new`` got
        the stream and 2000 messages of it; the seconds from the move to its first."""
        move()
        moved = time.monotonic()
        self.run_until(lambda: new.seen, what=where)
        rejoined_s = time.monotonic() - moved
        self.run_until(lambda: len(new.seen) >= 2000, what=where)
        return rejoined_s


def _fc_receivers(driver: Any) -> int:
    """The receivers the driver's one fc=min publication holds its sender to."""
    counters = CountersFile(driver.directory / control.COUNTERS_FILE, writable=False)
    try:
        return sum(c.value for c in counters if c.type_id == CounterType.FC_RECEIVERS)
    finally:
        counters.close()


def _in_order(seen: list[int]) -> bool:
    return bool(seen) and seen == list(range(seen[0], seen[0] + len(seen)))


def _flowing_to_host_2(a: Client, b: Client, hosts: Any, name: str,
                       stream_id: int) -> tuple[Collector, Feed]:
    """A subscription of ``b`` on host 2 and a publication of ``a`` to it by ``name``: the
    stream flowing (2,000 messages read)."""
    old = Collector(b.add_subscription(f"aeron:udp?endpoint={hosts[2].address}:{PORT}",
                                       stream_id))
    feed = Feed(a.add_publication(f"aeron:udp?endpoint={name}:{PORT}", stream_id), [old])
    feed.run_until(lambda: len(old.seen) >= 2000, what="the stream to host 2")
    return old, feed


def test_a_unicast_receiver_named_by_host_name_is_followed_to_its_new_host(
        needs_hosts: None) -> None:
    from slipstream.sim.real.hosts import namespace_hosts

    with namespace_hosts(3) as hosts:
        name = f"receiver-{hosts.net}.test"
        hosts.set_names(1, {name: hosts[2].address})
        publisher, old_host, new_host = (hosts.start_driver(i, **SETTINGS) for i in (1, 2, 3))
        with Client.connect(publisher.directory) as a, \
                Client.connect(old_host.directory) as b, \
                Client.connect(new_host.directory) as c:
            old, feed = _flowing_to_host_2(a, b, hosts, name, 7)

            # The receiver moves: it leaves host 2, subscribes on host 3, and its name's
            # record follows it.
            old.subscription.close()
            new = Collector(c.add_subscription(f"aeron:udp?endpoint={hosts[3].address}:{PORT}",
                                               7))
            feed.collectors = [new]
            rejoined_s = feed.rejoin(lambda: hosts.set_names(1, {name: hosts[3].address}),
                                     new, "the stream at the new host")
        changes = counters_of(publisher)["RESOLUTION_CHANGES"]
        shown = run_stat(publisher).stdout
        snapshot = json.loads(run_stat(publisher, "--json").stdout)

    assert _in_order(old.seen) and old.seen[0] == 0
    # Every message from where it rejoined, once and in order; none it had before it moved.
    assert _in_order(new.seen), new.seen[:20]
    assert new.seen[0] > old.seen[-1]
    assert old.torn == new.torn == 0
    # Contact lost, the name resolved again at the next check, the connection cycle.
    assert rejoined_s < CONNECTION_TIMEOUT_S + 2 * INTERVAL_S + 1.0, rejoined_s
    assert changes == 1 and snapshot["driver"]["resolution_changes"] == 1
    assert "resolution changes" in shown
    print(f"\nunicast: the moved receiver got the stream again {rejoined_s:.2f} s after its "
          f"name changed (publication_connection_timeout {CONNECTION_TIMEOUT_S:g} s, "
          f"name_re_resolution_interval {INTERVAL_S:g} s)")


def test_a_move_that_found_no_route_is_made_once_a_route_is_there(
        needs_hosts: None, capfd: pytest.CaptureFixture[str]) -> None:
    """The receiver's host is re-addressed into a subnet the publisher's host has no address
    in yet, and the name's record follows it.  The publisher's driver resolves the name
    again, but its socket cannot connect there (no route: ENETUNREACH) and stays with the old
    address; it is told so, and asks again at every check.  Once the publisher's host has an
    address in that subnet, the next check connects: the receiver gets the stream, once and
    in order from where it joined, and the one change is counted once."""
    from slipstream.sim.real.hosts import namespace_hosts

    with namespace_hosts(2) as hosts:
        name = f"receiver-{hosts.net}.test"
        hosts.set_names(1, {name: hosts[2].address})
        publisher, receiver = (hosts.start_driver(i, **SETTINGS) for i in (1, 2))
        with Client.connect(publisher.directory) as a, Client.connect(receiver.directory) as b:
            old, feed = _flowing_to_host_2(a, b, hosts, name, 10)

            old.subscription.close()
            moved_to = readdress(hosts, 2, 1, keep=False)
            new = Collector(b.add_subscription(f"aeron:udp?endpoint={moved_to}:{PORT}", 10))
            feed.collectors = [new]
            hosts.set_names(1, {name: moved_to})
            # Contact lost, the name resolved again, the connect there refused (the driver's
            # log, passed through to this process's stderr, names the new address); then
            # two more checks, each asking again and refused again.
            refused = f"sending to {moved_to}:{PORT} failed: Network is unreachable"
            said: list[str] = []
            feed.run_until(lambda: said.append(capfd.readouterr().err) or refused in said[-1],
                           what="the move refused for want of a route")
            until = time.monotonic() + 2 * INTERVAL_S
            feed.run_until(lambda: time.monotonic() > until, what="two more checks")
            assert not new.seen
            rejoined_s = feed.rejoin(lambda: readdress(hosts, 1, 1, keep=True), new,
                                     "the stream at the new address")
        changes = counters_of(publisher)["RESOLUTION_CHANGES"]

    assert _in_order(new.seen) and new.torn == 0, new.seen[:20]
    assert new.seen[0] > old.seen[-1]
    # The route there, then the next check at most an interval on, the connection cycle.
    assert rejoined_s < INTERVAL_S + 1.0, rejoined_s
    assert changes == 1
    print(f"\nno route at first: the receiver got the stream {rejoined_s:.2f} s after the "
          f"route was there")


def test_a_manual_destination_named_by_host_name_is_followed_and_the_other_loses_nothing(
        needs_hosts: None) -> None:
    from slipstream.sim.real.hosts import namespace_hosts

    with namespace_hosts(4) as hosts:
        name = f"receiver-{hosts.net}.test"
        hosts.set_names(1, {name: hosts[2].address})
        # fc=min: the stream goes at its slowest receiver's pace, so that no receiver is
        # left behind by a faster one (max's rule), and a receiver that went silent stops
        # holding it after flow_control_receiver_timeout.
        publisher, old_host, new_host, other_host = (
            hosts.start_driver(i, **SETTINGS, flow_control_receiver_timeout="1s")
            for i in (1, 2, 3, 4))
        with Client.connect(publisher.directory) as a, \
                Client.connect(old_host.directory) as b, \
                Client.connect(new_host.directory) as c, \
                Client.connect(other_host.directory) as d:
            old = Collector(b.add_subscription(f"aeron:udp?endpoint={hosts[2].address}:{PORT}",
                                               8))
            other = Collector(d.add_subscription(
                f"aeron:udp?endpoint={hosts[4].address}:{PORT}", 8))
            publication = a.add_publication("aeron:udp?control-mode=manual|fc=min", 8)
            publication.add_destination(f"aeron:udp?endpoint={hosts[4].address}:{PORT}")
            publication.add_destination(f"aeron:udp?endpoint={name}:{PORT}")
            # Both receivers hold the sender before the stream starts (fc=min admits a
            # receiver once heard consistently: one that joined a moment after the first
            # would be over-run meanwhile, and left behind).
            wait_for(lambda: _fc_receivers(publisher) == 2, timeout=10,
                     what="both receivers admitted")
            feed = Feed(publication, [old, other])
            feed.run_until(lambda: len(old.seen) >= 2000 and len(other.seen) >= 2000,
                           what="the stream to hosts 2 and 4")

            old.subscription.close()
            new = Collector(c.add_subscription(f"aeron:udp?endpoint={hosts[3].address}:{PORT}",
                                               8))
            feed.collectors = [other, new]
            rejoined_s = feed.rejoin(lambda: hosts.set_names(1, {name: hosts[3].address}),
                                     new, "the stream at the new host")
            end = feed.sent
            feed.run_until(lambda: len(other.seen) >= end, what="the rest at host 4",
                           offer=False)
        changes = counters_of(publisher)["RESOLUTION_CHANGES"]

    # The destination that stayed lost nothing, across the move.
    assert other.seen == list(range(end)) and other.torn == 0
    assert _in_order(old.seen) and old.seen[0] == 0
    assert _in_order(new.seen), new.seen[:20]
    assert new.seen[0] > old.seen[-1] and new.torn == 0
    # Silent for the timeout, reported to the conductor at a check, resolved at the next.
    assert rejoined_s < CONNECTION_TIMEOUT_S + 3 * INTERVAL_S + 1.0, rejoined_s
    assert changes == 1
    print(f"\nmanual MDC: the moved destination got the stream again {rejoined_s:.2f} s after "
          f"its name changed; the other got all {end} messages")


def test_a_dynamic_receivers_control_name_follows_its_publisher_to_another_host(
        needs_hosts: None) -> None:
    """The publisher moves: its publication on host 1 ends and one starts on host 3, and the
    receiver's ``control=`` name (in host 2's own hosts file) is rewritten to host 3.  With no
    live image, the receiver resolves it again, joins there (validated as any dynamic
    receiver) and gets the new stream from where it joined, once and in order."""
    from slipstream.sim.real.hosts import namespace_hosts

    with namespace_hosts(3) as hosts:
        name = f"publisher-{hosts.net}.test"
        hosts.set_names(2, {name: hosts[1].address})
        first, receiver, second = (hosts.start_driver(i, **SETTINGS) for i in (1, 2, 3))
        control = PORT + 1
        with Client.connect(first.directory) as a, \
                Client.connect(receiver.directory) as b, \
                Client.connect(second.directory) as c:
            subscription = b.add_subscription(
                f"aeron:udp?endpoint={hosts[2].address}:{PORT}|control={name}:{control}", 9)
            old = Collector(subscription)
            publication = a.add_publication(
                f"aeron:udp?control-mode=dynamic|control={hosts[1].address}:{control}", 9)
            feed = Feed(publication, [old])
            feed.run_until(lambda: len(old.seen) >= 2000, what="the stream from host 1")
            publication.close()  # its end of stream: the receiver reads all, and the image ends
            feed.run_until(lambda: not subscription.images, what="the old image's end",
                           offer=False)
            sent = feed.sent

            moved_publication = c.add_publication(
                f"aeron:udp?control-mode=dynamic|control={hosts[3].address}:{control}", 9)
            new = Collector(subscription)
            feed = Feed(moved_publication, [new])
            rejoined_s = feed.rejoin(lambda: hosts.set_names(2, {name: hosts[3].address}),
                                     new, "the stream from host 3")
        changes = counters_of(receiver)["RESOLUTION_CHANGES"]

    assert old.seen == list(range(sent))  # all of the first stream: it ended, it did not move
    assert _in_order(new.seen) and new.torn == 0, new.seen[:20]
    # The old image ends (its publication's end of stream), the name is resolved again at
    # the next check, the join SM goes at once, validation and the SETUP follow.
    assert rejoined_s < 2 * INTERVAL_S + 2.0, rejoined_s
    assert changes == 1
    print(f"\ndynamic MDC: the receiver joined its publisher at the name's new host "
          f"{rejoined_s:.2f} s after the name changed")
