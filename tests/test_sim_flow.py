"""One publisher, several subscribers, one of them slow or paused: what each answer to it does
(the scenarios of docs/FLOW.md), in the simulator with the driver's own agents.

* ``max`` (the multicast default) lets the fastest set the pace: the slow subscriber is left
  behind;
* ``fc=min`` holds everyone to the slowest, and stops everyone while one pauses;
* ``rc=nak-strength`` slows the sender to what the slow one takes, loses nothing, and while one
  pauses the others never see the stream stop.
"""

from __future__ import annotations

import pytest

from slipstream.client.counters import SystemCounter
from slipstream.daemon.pressure.governor import STATUS_INTERVAL_FACTOR
from slipstream.daemon.reports.loss_report import read_loss_report
from slipstream.sim.network import LinkFaults
from slipstream.sim.report import Report
from slipstream.sim.runner import Simulation
from slipstream.sim.scenario import (
    Event,
    LinkOverride,
    Scenario,
    ScenarioError,
    scenario_from_mapping,
)

MS = 1_000_000
S = 1_000_000_000
PUBLISH_RATE = 20_000  # 1 KiB messages per virtual second: 20.5 MiB/s
SLOW_RATE = PUBLISH_RATE / 10
SLOW_HOST = 3
FRAME = 1056  # a 1 KiB message and its header


def run(channel: str, *, messages: int, read_rates=(), events=(),
        publish_rate: float = PUBLISH_RATE, subscriber_params=()) -> tuple[Report, Simulation]:
    # 1 MiB terms: a receiver half a term (512 KiB) behind the sender drops what comes.
    params = "|".join(p for p in (channel, "term-length=1m") if p)
    scenario = Scenario(hosts=5, messages=messages, seed=7, channel_params=params,
                        publish_rate=publish_rate, max_virtual_ns=30 * S,
                        faults=LinkFaults(delay_ms=0.5), read_rates=tuple(read_rates),
                        events=tuple(events), subscriber_params=tuple(subscriber_params))
    with Simulation(scenario, sample_interval_ns=10 * MS) as sim:
        report = sim.run()
    return report, sim


def fast(values: list) -> list:
    """The entries of the subscribers other than the slow one (hosts 2, 4, 5)."""
    return [v for i, v in enumerate(values) if i + 2 != SLOW_HOST]


def send_rate(report: Report, start_s: float) -> float:
    """Bytes/s the publisher sent from ``start_s`` (virtual) to the end of the samples."""
    samples = [(t, p) for t, p, _ in report.samples if p is not None and t >= start_s * S]
    (t0, p0), (t1, p1) = samples[0], samples[-1]
    return (p1 - p0) * S / (t1 - t0)


def assert_paced_by_the_slow_one(report: Report) -> None:
    """Every subscriber got the whole stream, which went at the pace of the one reading
    :data:`SLOW_RATE` through the sender's rate limit, cut by rate signals; the publisher
    counted every signal its subscribers sent."""
    assert report.exactly_once_in_order, report.format_text()
    taken = SLOW_RATE * FRAME
    rate = send_rate(report, 1.0)
    assert 0.8 * taken < rate < 1.2 * taken, (rate, taken)
    publisher = report.counters["10.0.0.1"]
    assert publisher["RATE_CUTS"] >= 3
    assert publisher["RATE_SIGNALS_RECEIVED"] == sum(
        report.counters[ip].get("RATE_SIGNALS_SENT", 0) for ip in report.subscribers)


def test_under_max_a_subscriber_slower_than_the_stream_is_left_behind_and_told() -> None:
    report, sim = run("", messages=8000, read_rates=[(SLOW_HOST, SLOW_RATE)])
    assert fast(report.missing) == [0, 0, 0]
    slow = SLOW_HOST - 2
    assert report.missing[slow] > 0 and report.joined_late[slow] == 0
    # Its driver saw that what it lacked had left the sender's resend window: it stopped
    # asking, said which range it lost, and joined the stream again where the sender was.
    host = sim.host(SLOW_HOST)
    assert host.counter(SystemCounter.IMAGES_LEFT_BEHIND) >= 1
    assert report.lost_ranges[slow] and host.images_seen == len(report.lost_ranges[slow]) + 1
    assert all(start < end for start, end in report.lost_ranges[slow])
    assert not any(report.lost_ranges[i] for i in range(4) if i != slow)
    assert "left behind" in report.verdict()
    assert report.counters[f"10.0.0.{SLOW_HOST}"].get("NAK_MESSAGES_SENT", 0) < 50


def test_under_max_the_loss_report_counts_every_byte_a_left_behind_subscriber_missed() -> None:
    """What the slow subscriber misses is each lost range and, after it, what the sender sent
    until the next image joined: its driver's loss report counts both (no link loses
    anything here, so nothing else), to the byte."""
    scenario = Scenario(hosts=5, messages=8000, seed=7, channel_params="term-length=1m",
                        publish_rate=PUBLISH_RATE, max_virtual_ns=30 * S,
                        faults=LinkFaults(delay_ms=0.5), read_rates=((SLOW_HOST, SLOW_RATE),))
    with Simulation(scenario) as sim:
        report = sim.run()
        observed = read_loss_report(sim.host(SLOW_HOST).driver.directory)
    slow = SLOW_HOST - 2
    lost, rejoins = report.lost_ranges[slow], report.rejoins[slow]
    assert lost and all(rejoins), (lost, rejoins)
    # The sender went on while the image went and the next one joined.
    assert any(join > end for (_, end), (join, _) in zip(lost, rejoins, strict=True))
    missed = sum(join - start for (start, _), (join, _) in zip(lost, rejoins, strict=True))
    assert sum(entry.bytes_lost for entry in observed) == missed, (observed, lost, rejoins)


def test_nak_strength_slows_the_sender_to_what_the_slow_subscriber_takes_and_loses_nothing(
        ) -> None:
    report, _ = run("rc=nak-strength", messages=8000, read_rates=[(SLOW_HOST, SLOW_RATE)])
    # The stream went at the slow subscriber's pace (it read 10 %), through the sender's rate
    # limit, which signals from that subscriber cut ...
    assert_paced_by_the_slow_one(report)
    assert report.counters[f"10.0.0.{SLOW_HOST}"]["RATE_SIGNALS_SENT"] > 0
    limits = [rate for t, _, rate in report.limits if t > 1 * S]
    assert limits and all(limits)
    # ... without stopping the others for longer than one window (50 ms).
    assert max(fast(report.longest_gaps_ns)) < 50 * MS, report.longest_gaps_ns


def test_min_holds_everyone_to_the_slow_subscriber() -> None:
    report, _ = run("fc=min", messages=8000, read_rates=[(SLOW_HOST, SLOW_RATE)])
    assert report.exactly_once_in_order, report.format_text()
    taken = SLOW_RATE * FRAME
    assert send_rate(report, 1.0) < 1.2 * taken


def test_tagged_holds_the_sender_to_its_group_only() -> None:
    """Hosts 2, 4 and 5 subscribe with gtag=7; the slow host 3 without: the group sets the
    pace, and the slow one is left behind (and told) as under max."""
    tagged = [(host, "gtag=7") for host in (2, 4, 5)]
    report, _ = run("fc=tagged,g:7/3", messages=8000, read_rates=[(SLOW_HOST, SLOW_RATE)],
                    subscriber_params=tagged)
    assert fast(report.missing) == [0, 0, 0]
    slow = SLOW_HOST - 2
    assert report.missing[slow] > 0 and report.lost_ranges[slow]
    assert send_rate(report, 0.1) > 5 * SLOW_RATE * FRAME
    # With the slow one in the group, it holds everyone, as min does.
    report, _ = run("fc=tagged,g:7", messages=4000, read_rates=[(SLOW_HOST, SLOW_RATE)],
                    subscriber_params=[(SLOW_HOST, "gtag=7")])
    assert report.exactly_once_in_order, report.format_text()
    assert send_rate(report, 1.0) < 1.2 * SLOW_RATE * FRAME


def test_under_tagged_nak_strength_heeds_the_signals_of_the_group_only() -> None:
    """The slow host 3 outside the group signals (its signals carry no tag): the sender,
    which it never holds back under fc=tagged, does not slow down for them either, and counts
    them ignored.  Before signals carried the tag, a run of this kind cut the rate 11 times.
    Inside the group its signals (tagged 7) cut the rate; and while no receiver of the group
    is known and none is required (g:7, no /N), fc=tagged follows everyone as max does, and
    so heeds every signal."""
    tagged = [(host, "gtag=7") for host in (2, 4, 5)]
    report, _ = run("fc=tagged,g:7/3|rc=nak-strength", messages=8000,
                    read_rates=[(SLOW_HOST, SLOW_RATE)], subscriber_params=tagged)
    assert fast(report.missing) == [0, 0, 0]
    signals = {host: report.counters[f"10.0.0.{host}"].get("RATE_SIGNALS_SENT", 0)
               for host in (2, 3, 4, 5)}
    assert signals[SLOW_HOST] > 0 and fast([signals[h] for h in (2, 3, 4, 5)]) == [0, 0, 0]
    publisher = report.counters["10.0.0.1"]
    # Ignored, or (left behind, beyond repair) not backed by its SMs (§5.7): none counted.
    assert publisher["RATE_SIGNALS_IGNORED"] + publisher.get(
        "RATE_SIGNAL_UNBACKED_DROPS", 0) == publisher["RATE_SIGNALS_RECEIVED"] > 0
    assert publisher["RATE_SIGNALS_IGNORED"] > 0
    assert publisher.get("RATE_CUTS", 0) == 0
    assert send_rate(report, 0.1) > 5 * SLOW_RATE * FRAME
    # The slow host in the group: its signals cut (fc=tagged alone would hold the sender to
    # it too, so the cuts are what show its signals count).
    report, _ = run("fc=tagged,g:7|rc=nak-strength", messages=4000,
                    read_rates=[(SLOW_HOST, SLOW_RATE)],
                    subscriber_params=[(host, "gtag=7") for host in (2, 3, 4, 5)])
    assert report.exactly_once_in_order, report.format_text()
    assert report.counters["10.0.0.1"]["RATE_CUTS"] >= 3
    assert report.counters["10.0.0.1"].get("RATE_SIGNALS_IGNORED", 0) == 0
    # No receiver of group 7 at all: as under max with rc=, the slow host's signals slow the
    # sender to its pace.
    report, _ = run("fc=tagged,g:7|rc=nak-strength", messages=8000,
                    read_rates=[(SLOW_HOST, SLOW_RATE)])
    assert report.exactly_once_in_order, report.format_text()
    publisher = report.counters["10.0.0.1"]
    assert publisher["RATE_CUTS"] >= 3 and publisher.get("RATE_SIGNALS_IGNORED", 0) == 0
    taken = SLOW_RATE * FRAME
    assert 0.8 * taken < send_rate(report, 1.0) < 1.2 * taken


PAUSE = Event(1 * S, "pause", hosts=(SLOW_HOST,), end_ns=3 * S)


def test_a_subscriber_paused_for_two_seconds_stops_everyone_under_min() -> None:
    # 10,000 messages a second: about half of them before the pause, the rest after it.
    report, _ = run("fc=min", messages=20_000, events=[PAUSE], publish_rate=10_000)
    assert report.exactly_once_in_order, report.format_text()
    assert min(fast(report.longest_gaps_ns)) > 1500 * MS  # until it reads again


def test_under_min_a_paused_subscriber_at_the_governors_step_2_still_holds_the_sender() -> None:
    """The governor's step 2 widens a receiver's keepalive status messages, but no further
    than a fifth of the shortest sender timeout its driver knows of: here every driver's
    publication connection and min flow-control receiver timeouts are 1 s, so a paused
    subscriber's driver at step 2 (for the whole run) still says where it is every 200 ms,
    and a fifth of them lost on the way changes nothing: the sender waits for it, and it
    loses nothing.  Widened four times (800 ms), one keepalive lost let min flow control
    forget it: the sender ran on and left it behind."""
    scenario = Scenario(hosts=3, messages=20_000, seed=7, channel_params="fc=min|term-length=1m",
                        publish_rate=10_000, max_virtual_ns=30 * S,
                        faults=LinkFaults(delay_ms=0.5),
                        links=(LinkOverride(SLOW_HOST, 1, LinkFaults(delay_ms=0.5, loss=0.2)),),
                        events=(PAUSE,),
                        settings={"publication_connection_timeout": "1s",
                                  "flow_control_receiver_timeout": "1s"})
    with Simulation(scenario) as sim:
        sim.run_until(1_000_000, stop_when_complete=False)  # the drivers started
        paused = sim.host(SLOW_HOST)
        paused.driver.network.receiver.set_pressure_step(2)
        report = sim.run()
        channels = [e.channel for e in paused.driver.network.receiver.endpoints]
        images = [image for c in channels for image in c.images.values()]
        # At step 2, its keepalives no further apart than step 0's: a fifth of 1 s.
        assert images and all(image.status_interval_factor == STATUS_INTERVAL_FACTOR
                              and image.c.sm_interval_ns == 200 * MS for image in images)
    assert report.exactly_once_in_order, report.format_text()
    assert not any(report.lost_ranges), report.lost_ranges
    assert report.counters[f"10.0.0.{SLOW_HOST}"].get("IMAGES_LEFT_BEHIND", 0) == 0
    assert min(report.longest_gaps_ns) > 1500 * MS  # everyone waited for it


def test_under_nak_strength_the_others_never_see_the_stream_stop_while_one_pauses() -> None:
    report, sim = run("rc=nak-strength", messages=40_000, events=[PAUSE], publish_rate=10_000)
    assert fast(report.missing) == [0, 0, 0]
    assert max(fast(report.longest_gaps_ns)) < 100 * MS, report.longest_gaps_ns
    # A paused subscriber signals only until it has taken nothing for a window (it crossed
    # each threshold once as it stopped): no rate would help it, and it is left behind ...
    paused = report.counters[f"10.0.0.{SLOW_HOST}"]
    assert 0 < paused["RATE_SIGNALS_SENT"] <= 4
    assert sim.publisher.counter(SystemCounter.RATE_CUTS) > 0
    assert report.limits[-1][2] == 0  # the limit was lifted again
    # ... and told: once it reads again, it gets what its driver had, learns the range it
    # lost, and goes on with the stream from where the sender is, to its end.
    slow = SLOW_HOST - 2
    [(start, end)] = report.lost_ranges[slow]
    assert paused["IMAGES_LEFT_BEHIND"] == 1 and sim.host(SLOW_HOST).images_seen == 2
    lost_messages = report.missing[slow]
    assert abs((end - start) - lost_messages * FRAME) <= 16 * FRAME
    stats = sim.host(SLOW_HOST).stats
    assert max(stats.highest.values()) == 40_000 - 1


def two_hosts(channel: str, faults: LinkFaults) -> Report:
    """20,000 messages as fast as flow control lets them, to one subscriber that keeps up."""
    scenario = Scenario(hosts=2, messages=20_000, seed=7, channel_params=channel,
                        faults=faults, max_virtual_ns=30 * S)
    with Simulation(scenario) as sim:
        report = sim.run()
    assert report.exactly_once_in_order, report.format_text()
    return report


def test_nak_strength_leaves_a_subscriber_that_keeps_up_over_a_lossy_link_at_full_speed(
        ) -> None:
    """1 % random loss on a 100 Mbit/s link: a gap holds data above it until its repair
    comes, and the repair makes it all readable at once.  Neither is a subscriber that
    cannot keep up, and no rate would have prevented either: no cut.  (Counting them cut
    the rate 8 times, for 8.5 MB/s against 10.2 without rc=.)"""
    faults = LinkFaults(loss=0.01, rate_mbit=100, delay_ms=0.5)
    plain = two_hosts("", faults)
    adapting = two_hosts("rc=nak-strength", faults)
    assert adapting.counters["10.0.0.1"].get("RATE_CUTS", 0) == 0, adapting.counters
    assert adapting.counters["10.0.0.2"]["NAK_MESSAGES_SENT"] > 100  # the loss was there
    assert adapting.goodput >= 0.95 * plain.goodput, (adapting.goodput, plain.goodput)


def test_nak_strength_slows_a_sender_whose_repairs_a_narrow_link_keeps_dropping() -> None:
    """A 20 Mbit/s link with a 32 KiB queue that the stream overruns: its queue drops
    the repairs too, and data waiting above a gap that outlived two repairs counts."""
    report = two_hosts("rc=nak-strength",
                       LinkFaults(rate_mbit=20, delay_ms=0.5, queue_bytes=32 * 1024))
    assert report.counters["10.0.0.1"]["RATE_CUTS"] > 5
    assert report.counters["10.0.0.2"]["RATE_SIGNALS_SENT"] > 5


def test_a_scenario_reads_slow_subscribers_and_pauses_from_toml() -> None:
    scenario = scenario_from_mapping({
        "scenario": {"hosts": 4},
        "subscriber": [{"host": 3, "read_rate": 500}, {"host": 2, "channel": "gtag=7"}],
        "event": [{"at_ms": 100, "action": "pause", "hosts": [2], "end_ms": 300}]})
    assert scenario.read_rate(3) == 500 and scenario.read_rate(2) == 0
    assert scenario.channel_uri(2).endswith("|gtag=7") and "gtag" not in scenario.channel_uri(3)
    assert scenario.events == (Event(100 * MS, "pause", hosts=(2,), end_ns=300 * MS),)
    for bad, key in (({"subscriber": [{"host": 1, "read_rate": 5}]}, "host 1 publishes"),
                     ({"subscriber": [{"read_rate": 5}]}, "needs host"),
                     ({"subscriber": [{"host": 2, "read_rate": -1}]}, "read_rate"),
                     ({"subscriber": [{"host": 2, "rate": 1}]}, r"subscriber\[0\]\.rate"),
                     ({"subscriber": [{"host": 2, "channel": 7}]}, "channel"),
                     ({"event": [{"at_ms": 1, "action": "pause", "hosts": [2]}]}, "end_ms")):
        with pytest.raises(ScenarioError, match=key):
            scenario_from_mapping({"scenario": {"hosts": 3}, **bad})
