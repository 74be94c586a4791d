"""The flow-control answers of docs/FLOW.md over dynamic multi-destination-cast, in the simulator:
one publisher (``control=10.0.0.1:40124|control-mode=dynamic``) and four subscriber hosts that
join it by their status messages (``endpoint=10.0.0.N:40123|control=10.0.0.1:40124``), no
multicast anywhere (``transport = "mdc"``).  An MDC channel has group semantics, so the answers
are multicast's (tests/test_sim_flow.py):

* ``max`` (the default) lets the fastest set the pace: the slow subscriber is left behind, and
  told;
* ``fc=min`` holds everyone to the slowest, and everyone gets everything, over a lossy link too;
* ``rc=nak-strength`` slows the sender to what the slow one takes and loses nothing, and while
  one pauses the others never see the stream stop.

And what only MDC has: a destination table that the receivers' status messages keep.  A host
that crashes is dropped from it after the timeout (5 s) while the others go on; one that comes
up late joins it, and the stream, where the stream is.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from test_sim_flow import (
    FRAME,
    PUBLISH_RATE,
    SLOW_HOST,
    SLOW_RATE,
    assert_paced_by_the_slow_one,
    send_rate,
)

from slipstream.client.counters import SystemCounter
from slipstream.sim.cli import build_scenario
from slipstream.sim.network import LinkFaults
from slipstream.sim.report import Report
from slipstream.sim.runner import Simulation
from slipstream.sim.scenario import (
    MDC_CONTROL_PORT,
    UNICAST_PORT,
    Event,
    LinkOverride,
    Scenario,
    ScenarioError,
    scenario_from_mapping,
)

MS = 1_000_000
S = 1_000_000_000
SUBSCRIBERS = (2, 3, 4, 5)
DELAY = LinkFaults(delay_ms=0.5)


def scenario(channel: str = "", *, messages: int, publish_rate: float = PUBLISH_RATE,
             **fields) -> Scenario:
    # 1 MiB terms: a receiver half a term (512 KiB) behind the sender drops what comes.
    params = "|".join(p for p in (channel, "term-length=1m") if p)
    return Scenario(hosts=5, transport="mdc", messages=messages, seed=7,
                    channel_params=params, publish_rate=publish_rate,
                    max_virtual_ns=30 * S, faults=DELAY, **fields)


def run(channel: str = "", **kwargs) -> tuple[Report, Simulation]:
    with Simulation(scenario(channel, **kwargs), sample_interval_ns=10 * MS) as sim:
        report = sim.run()
    return report, sim


def others(values: list, host: int = SLOW_HOST) -> list:
    """The entries of the subscribers other than ``host``."""
    return [v for i, v in enumerate(values) if i + 2 != host]


def at(values: list, host: int):
    return values[host - 2]


SLOW = ((SLOW_HOST, SLOW_RATE),)


def test_every_host_uses_its_own_address_and_host_1s_control_address() -> None:
    mdc = scenario("fc=min|gtag=7", messages=1, subscriber_params=((4, "rcv-wnd=256k"),))
    assert mdc.channel_uri(1) == (f"aeron:udp?control=10.0.0.1:{MDC_CONTROL_PORT}"
                                  f"|control-mode=dynamic|fc=min|term-length=1m")
    # A subscriber: its own endpoint, host 1's control, no publication key (fc=).
    assert mdc.channel_uri(4) == (f"aeron:udp?endpoint=10.0.0.4:{UNICAST_PORT}"
                                  f"|control=10.0.0.1:{MDC_CONTROL_PORT}"
                                  f"|gtag=7|term-length=1m|rcv-wnd=256k")
    # On namespace hosts (sim/real/on_hosts.py): the addresses it is given.
    assert mdc.channel_uri(3, "10.7.0.3", "10.7.0.2", publisher="10.7.0.1").startswith(
        f"aeron:udp?endpoint=10.7.0.3:{UNICAST_PORT}|control=10.7.0.1:{MDC_CONTROL_PORT}|")
    assert mdc.channel_uri(1, "10.7.0.1", "10.7.0.2", publisher="10.7.0.1").startswith(
        f"aeron:udp?control=10.7.0.1:{MDC_CONTROL_PORT}|control-mode=dynamic|")
    assert not mdc.is_multicast and mdc.data_port == UNICAST_PORT
    # The default is as before: multicast above two hosts, unicast with two.
    assert "endpoint=224.0.1.1:40456|interface=10.0.0.3" in Scenario(hosts=5).channel_uri(3)
    assert Scenario(hosts=2).channel_uri(1).startswith("aeron:udp?endpoint=10.0.0.2:40123")


def test_the_transport_comes_from_toml_and_the_command_line_and_a_bad_one_is_named() -> None:
    assert scenario_from_mapping({"scenario": {"hosts": 4, "transport": "mdc"}}).is_mdc
    assert scenario_from_mapping({"scenario": {"hosts": 4}}).transport == "multicast"
    for bad in ("unicast", 7, ""):
        with pytest.raises(ScenarioError, match=r"^scenario\.transport: "):
            scenario_from_mapping({"scenario": {"hosts": 4, "transport": bad}})
    with pytest.raises(ScenarioError, match=r"^transport: "):
        Scenario(hosts=3, transport="broadcast")
    import argparse

    from slipstream.sim.cli import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert build_scenario(parser.parse_args(["--hosts", "4", "--transport", "mdc"])).is_mdc
    assert not build_scenario(parser.parse_args(["--hosts", "4"])).is_mdc
    with pytest.raises(SystemExit):
        parser.parse_args(["--transport", "broadcast"])


def test_under_max_a_subscriber_slower_than_the_stream_is_left_behind_and_told() -> None:
    report, sim = run(messages=4000, read_rates=SLOW)
    assert others(report.missing) == [0, 0, 0], report.format_text()
    assert at(report.missing, SLOW_HOST) > 0 and at(report.joined_late, SLOW_HOST) == 0
    host = sim.host(SLOW_HOST)
    assert host.counter(SystemCounter.IMAGES_LEFT_BEHIND) >= 1
    lost = at(report.lost_ranges, SLOW_HOST)
    assert lost and host.images_seen == len(lost) + 1
    assert not any(others(report.lost_ranges))
    assert "left behind" in report.verdict()
    assert {count for _, count in report.destinations} == {4}  # every one joined, and stayed
    assert report.virtual_seconds < 0.5 * 4000 / SLOW_RATE  # nobody waited for it


def test_min_holds_everyone_to_the_slow_subscriber_and_all_get_everything() -> None:
    report, _ = run("fc=min", messages=4000, read_rates=SLOW)
    assert report.exactly_once_in_order, report.format_text()
    assert send_rate(report, 1.0) < 1.2 * SLOW_RATE * FRAME
    assert report.virtual_seconds > 0.9 * 4000 / SLOW_RATE


def test_nak_strength_slows_the_sender_to_what_the_slow_subscriber_takes_and_loses_nothing(
        ) -> None:
    report, _ = run("rc=nak-strength", messages=4000, read_rates=SLOW)
    # Every signal came to the sender's control address, and counted there.
    assert_paced_by_the_slow_one(report)
    assert at([report.counters[ip].get("RATE_SIGNALS_SENT", 0) for ip in report.subscribers],
              SLOW_HOST) > 0
    assert max(others(report.longest_gaps_ns)) < 50 * MS, report.longest_gaps_ns


PAUSE = Event(500 * MS, "pause", hosts=(SLOW_HOST,), end_ns=2500 * MS)


def test_under_nak_strength_the_others_never_see_the_stream_stop_while_one_pauses() -> None:
    report, sim = run("rc=nak-strength", messages=3000, publish_rate=1000, events=[PAUSE])
    assert others(report.missing) == [0, 0, 0], report.format_text()
    assert max(others(report.longest_gaps_ns)) < 100 * MS, report.longest_gaps_ns
    assert sim.publisher.counter(SystemCounter.RATE_CUTS) > 0
    # The paused one was left behind, and told: once it read again it got what its driver
    # had, and the rest of the stream from a new image, to its end.
    [(start, end)] = at(report.lost_ranges, SLOW_HOST)
    paused = sim.host(SLOW_HOST)
    assert paused.counter(SystemCounter.IMAGES_LEFT_BEHIND) == 1 and paused.images_seen == 2
    assert abs((end - start) - at(report.missing, SLOW_HOST) * FRAME) <= 16 * FRAME
    assert max(paused.stats.highest.values()) == 3000 - 1


def test_under_min_a_lossy_link_to_one_subscriber_costs_nothing_of_the_stream() -> None:
    """5 % loss both ways between the publisher and host 4 only: the repairs it asks for go
    to every destination (a retransmission is sent as data is), and everyone gets every
    message once, in order.  (A status message of host 4's that is lost holds everyone until
    its next, up to the 200 ms status message timeout, as under multicast: min waits for
    the slowest receiver's word.)"""
    lossy = LinkFaults(delay_ms=0.5, loss=0.05)
    report, _ = run("fc=min", messages=4000,
                    links=(LinkOverride(1, 4, lossy), LinkOverride(4, 1, lossy)))
    assert report.exactly_once_in_order, report.format_text()
    assert report.network.get("drop-loss", 0) > 100
    assert at([report.counters[ip].get("NAK_MESSAGES_SENT", 0) for ip in report.subscribers],
              4) > 20
    assert others([report.counters[ip].get("NAK_MESSAGES_SENT", 0)
                   for ip in report.subscribers], 4) == [0, 0, 0]
    assert report.retransmits > 0


def test_a_crashed_subscriber_host_is_timed_out_as_a_destination_and_the_others_go_on() -> None:
    """Host 4 crashes at 1 s of a 7 s stream: its status messages stop, the publisher sends
    to it until the destination timeout (5 s after the last one: the receiver sends them at
    least every 200 ms) and then no more; the others never notice, nor when the table
    changes."""
    crash = Event(1 * S, "crash", hosts=(4,))
    sent_to_4: list[int] = []
    with Simulation(scenario(messages=1750, publish_rate=250, events=(crash,)),
                    sample_interval_ns=10 * MS) as sim:
        sim.network.observers.append(
            lambda now, _event, source, target, _data: sent_to_4.append(now)
            if source == sim.publisher.source and target[0] == "10.0.0.4" else None)
        report = sim.run()
        assert sim.destination_count() == 3
    assert others(report.missing, 4) == [0, 0, 0], report.format_text()
    assert max(others(report.longest_gaps_ns, 4)) < 10 * MS, report.longest_gaps_ns
    assert report.virtual_seconds > 6.5
    counts = report.destinations
    assert {n for t, n in counts if t < 1 * S} == {4}
    dropped_at = next(t for t, n in counts if n == 3)
    assert 5.7 * S <= dropped_at <= 6.1 * S, dropped_at / S
    assert {n for t, n in counts if t >= dropped_at} == {3}
    # It was sent the stream until then (its host down, nothing arrived), and nothing after.
    assert dropped_at - 50 * MS <= max(sent_to_4) <= dropped_at


def test_a_subscriber_host_that_comes_up_late_joins_where_the_stream_is_and_gets_the_rest(
        ) -> None:
    """Host 5 starts down and comes up at 1 s of a 2 s stream: its first status message makes
    it a destination, the first data it then gets elicits the SETUP that starts its image
    where the sender is then, two round trips (1 ms each: a message) and the image's making
    after it came up, and it gets every message from there."""
    restart = Event(1 * S, "restart", hosts=(5,))
    report, sim = run(messages=2000, publish_rate=1000, initially_down=(5,), events=(restart,))
    assert others(report.missing, 5) == [0, 0, 0], report.format_text()
    stats = sim.host(5).stats
    assert 995 <= stats.expected_from <= 1001  # what had been appended by 1 s
    [first] = stats.first_seq.values()
    assert first - stats.expected_from <= 4, (first, stats.expected_from)
    # Everything from its join, once, in order: what it missed is what came before it.
    assert at(report.missing, 5) == at(report.joined_late, 5) == first - stats.expected_from
    assert at(report.delivered, 5) == 2000 - first
    assert report.completed and not any(report.duplicates) and not any(report.out_of_order)
    assert [n for t, n in report.destinations if t < 1 * S] and \
        {n for t, n in report.destinations if t < 1 * S} == {3}
    assert {n for t, n in report.destinations if t > 1010 * MS} == {4}


def test_the_same_seed_gives_the_same_trace_in_processes_with_other_string_hashes() -> None:
    """Each subscriber joins by being sent a heartbeat (or RTTM) carrying a random token that
    it must answer; the token is drawn from the seeded generator, so one seed gives one
    trace, byte for byte, in two processes whose str hashes (PYTHONHASHSEED) differ.  5 %
    loss makes joins retry and NAKs repair; 2 MB over 64 KiB terms rotates them 30 times."""
    argv = [sys.executable, "-m", "slipstream", "sim", "--hosts", "4", "--transport", "mdc",
            "--loss", "0.05", "--messages", "2000", "--channel", "fc=min,g:/3|term-length=64k",
            "--seed", "13"]
    runs = [subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONHASHSEED": hash_seed})
            for hash_seed in ("0", "1")]
    digests = []
    for run in runs:
        out, err = run.communicate(timeout=120)
        # exit status 0: every subscriber was validated and got every message once, in order
        assert run.returncode == 0, out + err
        digests += [line.split()[-1] for line in out.splitlines()
                    if line.startswith("trace sha256")]
    assert len(digests) == 2 and digests[0] == digests[1], digests
