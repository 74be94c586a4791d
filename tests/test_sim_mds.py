"""Multi-destination subscriptions (docs/CHANNELS.md §7.5) in the simulator
(``transport = "mds"``): host 1's manual multi-destination-cast publication sends every datagram
to two ports of host 2 (sim/scenario.py's ``MDS_PORTS``), and host 2's ``control-mode=manual``
subscription receives on both as its two destinations, as tests/test_mds.py runs it between
driver processes.  The simulated drivers run the driver's own multi-destination receive
endpoint; only each destination's transport is virtual.

A datagram to either port crosses the same link (1 -> 2), so the loss of one path alone is a
network filter that drops a share of what goes to its port, with its own seeded generator;
link loss draws for each copy on its own, so it is loss on both paths.
"""

from __future__ import annotations

import random

import pytest

from slipstream.client import control
from slipstream.client.counters import CounterType
from slipstream.sim.capture import Capture
from slipstream.sim.host import SubscriberHost
from slipstream.sim.network import Address, LinkFaults
from slipstream.sim.runner import Simulation
from slipstream.sim.scenario import (
    MDS_PORTS,
    UNICAST_PORT,
    LinkOverride,
    Scenario,
    ScenarioError,
    mds_destination,
    scenario_from_mapping,
)

MS = 1_000_000
S = 1_000_000_000
SUBSCRIBER = "10.0.0.2"
DELAY = LinkFaults(delay_ms=1.0)
CLEAN, LOSSY = MDS_PORTS  # the path that loses nothing, and the one a filter takes from


def scenario(messages: int, **fields) -> Scenario:
    # 64 KiB terms: the stream rotates its terms many times.
    fields.setdefault("faults", DELAY)
    return Scenario(hosts=2, transport="mds", messages=messages, seed=11,
                    channel_params="term-length=64k", max_virtual_ns=60 * S, **fields)


def lose_on_path(sim: Simulation, port: int, share: float) -> list[int]:
    """Drop ``share`` of the datagrams host 1 sends to ``port`` of the subscriber, from now
    on; the returned list counts them (its one entry)."""
    rng = random.Random(f"path-loss/{port}")
    dropped = [0]

    def drop(_t: int, _source: Address, destination: Address, _data: bytes) -> bool:
        if destination != (SUBSCRIBER, port) or rng.random() >= share:
            return False
        dropped[0] += 1
        return True

    sim.network.filters.append(drop)
    return dropped


def subscriber(sim: Simulation) -> SubscriberHost:
    host = sim.host(2)
    assert isinstance(host, SubscriberHost)
    return host


def mds_destinations(sim: Simulation) -> list[int]:
    """The subscriber's mds-destinations counters."""
    driver = subscriber(sim).driver
    assert driver is not None
    return [c.value for c in driver.counters if c.type_id == CounterType.MDS_DESTINATIONS]


def test_the_scenario_gives_both_sides_manual_channels_and_every_path() -> None:
    mds = Scenario(hosts=3, transport="mds", messages=1, channel_params="term-length=64k")
    assert mds.channel_uri(1) == "aeron:udp?control-mode=manual|term-length=64k"
    assert mds.channel_uri(3) == "aeron:udp?control-mode=manual|term-length=64k"
    assert mds.destinations(1) == [f"aeron:udp?endpoint=10.0.0.{host}:{port}"
                                   for host in (2, 3) for port in MDS_PORTS]
    assert mds.destinations(3) == [mds_destination(3, port) for port in MDS_PORTS]
    assert not mds.is_multicast and mds.data_port == UNICAST_PORT
    assert Scenario(hosts=3).destinations(1) == []
    assert scenario_from_mapping({"scenario": {"hosts": 2, "transport": "mds"}}).is_mds
    from slipstream.sim.real.on_hosts import check_applicable

    with pytest.raises(ScenarioError, match=r"^scenario\.transport: .*mds"):
        check_applicable(mds)


def test_two_paths_one_losing_a_fifth_make_one_image_each_message_once() -> None:
    """A fifth of what goes along one path is lost: the other path brings every datagram,
    so the subscriber gets each of 20,000 messages once, in order, in one image, with no NAK
    (no gap is ever seen); both paths take the image's status messages, each from its
    destination's port."""
    with Simulation(scenario(20_000)) as sim:
        dropped = lose_on_path(sim, LOSSY, 0.2)
        capture = Capture().attach(sim.network)
        report = sim.run()
        assert report.exactly_once_in_order, report.format_text()
        host = subscriber(sim)
        assert (host.images_seen, host.images_lost) == (1, 0)
        assert dropped[0] > 1_000
        assert report.naks == 0 and report.retransmits == 0
        sm_sources = {r.src for r in capture.select("SM", src=SUBSCRIBER)}
        assert sm_sources == {(SUBSCRIBER, port) for port in MDS_PORTS}
        assert mds_destinations(sim) == [2]
        # Both paths carried the stream: the subscriber took about twice what one needs.
        received = host.counters()["BYTES_RECEIVED"]
        assert received > 1.5 * report.sent * 1024


def test_loss_on_both_paths_is_repaired_along_them_and_each_message_comes_once() -> None:
    """Each copy of a datagram is lost with 10 % on its own path: what both lost (about
    1 %) is asked for again by NAK along the paths and retransmitted to both, and every
    message arrives once, in order, in one image."""
    lossy = LinkFaults(delay_ms=1.0, loss=0.1)
    with Simulation(scenario(20_000, links=(LinkOverride(1, 2, lossy),))) as sim:
        capture = Capture().attach(sim.network)
        report = sim.run()
        assert report.exactly_once_in_order, report.format_text()
        host = subscriber(sim)
        assert (host.images_seen, host.images_lost) == (1, 0)
        assert report.naks > 0 and report.retransmits > 0
        nak_sources = {r.src for r in capture.select("NAK", src=SUBSCRIBER)}
        assert nak_sources == {(SUBSCRIBER, port) for port in MDS_PORTS}
        # Far fewer NAKs than one path's loss would take: the other path fills most gaps.
        data = len(capture.select("DATA", delivered=None, src="10.0.0.1")) // 2
        assert report.naks < 0.05 * data


@pytest.mark.parametrize("removed", [CLEAN, LOSSY])
def test_removing_a_destination_mid_stream_keeps_the_stream_on_the_other(removed: int
                                                                         ) -> None:
    """At 300 ms the subscriber removes one destination of two while one path loses a tenth
    of its datagrams.  The stream goes on over the other path, one image, every message
    once and in order (over the lossy path what it lost is repaired by NAKs that leave
    through it); the removed path sends nothing more and takes nothing more, and
    mds-destinations follows."""
    kept = LOSSY if removed == CLEAN else CLEAN
    with Simulation(scenario(6_000, publish_rate=10_000)) as sim:
        lose_on_path(sim, LOSSY, 0.1)
        capture = Capture().attach(sim.network)
        host = subscriber(sim)
        sim.run_until(300 * MS)
        assert mds_destinations(sim) == [2]
        delivered_before = host.stats.delivered
        assert 0 < delivered_before < 6_000
        host.destination(control.REMOVE_RCV_DESTINATION, mds_destination(2, removed))
        report = sim.run()
        assert report.exactly_once_in_order, report.format_text()
        assert (host.images_seen, host.images_lost) == (1, 0)
        assert mds_destinations(sim) == [1]
        # The receiver's thread detached it at its next duty cycle: nothing from it after.
        after = 301 * MS
        from_removed = [r for r in capture.select(None, src=SUBSCRIBER)
                        if r.t_ns > after and r.src == (SUBSCRIBER, removed)]
        assert from_removed == []
        to_removed = [r for r in capture.select("DATA", delivered=None)
                      if r.t_ns > after and r.dst == (SUBSCRIBER, removed)]
        # The publisher still sends there; nothing is bound to it any more.
        assert {r.event for r in to_removed} - {"drop-filter"} == {"drop-unbound"}
        assert [r for r in capture.select("SM", src=SUBSCRIBER)
                if r.t_ns > after and r.src == (SUBSCRIBER, kept)]
        if kept == LOSSY:
            assert [r for r in capture.select("NAK", src=SUBSCRIBER) if r.t_ns > after]


def test_the_publisher_dropping_one_path_mid_stream_leaves_the_other_to_carry_it() -> None:
    """At 300 ms the publisher stops sending to the clean path's destination (its manual
    multi-destination-cast table loses it) while the other path loses a tenth: the stream
    goes on over the lossy path, its losses repaired by NAKs along it, one image, every
    message once and in order.  The subscriber keeps both destinations."""
    with Simulation(scenario(6_000, publish_rate=10_000)) as sim:
        lose_on_path(sim, LOSSY, 0.1)
        capture = Capture().attach(sim.network)
        sim.run_until(300 * MS)
        naks_before = len(capture.select("NAK", src=SUBSCRIBER))
        sim.publisher.destination(control.REMOVE_DESTINATION, mds_destination(2, CLEAN))
        report = sim.run()
        assert report.exactly_once_in_order, report.format_text()
        host = subscriber(sim)
        assert (host.images_seen, host.images_lost) == (1, 0)
        assert naks_before == 0
        assert [r for r in capture.select("NAK", src=SUBSCRIBER) if r.t_ns > 300 * MS]
        # Past what was in flight (the link's 1 ms) as the sender's thread took the removal.
        assert not [r for r in capture.select("DATA", delivered=None, src="10.0.0.1")
                    if r.t_ns > 302 * MS and r.dst == (SUBSCRIBER, CLEAN)]
        assert mds_destinations(sim) == [2]


def test_the_same_seed_gives_the_same_run() -> None:
    """Two paths with loss on both, twice with one seed: the same trace, byte for byte."""
    lossy = LinkFaults(delay_ms=1.0, loss=0.1)
    digests = []
    for _ in range(2):
        with Simulation(scenario(2_000, links=(LinkOverride(1, 2, lossy),))) as sim:
            report = sim.run()
        assert report.exactly_once_in_order, report.format_text()
        digests.append(report.trace_digest)
    assert digests[0] == digests[1] != ""
