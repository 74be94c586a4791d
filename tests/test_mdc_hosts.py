"""Dynamic multi-destination-cast on namespace hosts: one publisher
(``control=<host 1>:40124|control-mode=dynamic``) and four receiver hosts that join it by their
status messages, real drivers, the kernel's links, real time (``transport = "mdc"`` played by
:func:`~slipstream.sim.real.on_hosts.run_on_hosts`; tests/test_sim_mdc.py is the simulator's
version, tests/test_flow_hosts.py the multicast one).

Host 4's link to the publisher loses 5 % both ways (``iptables -m statistic``) and host 3's
application pauses for 2 s.  Under each flow-control answer every receiver gets every message
from its join once, in order (host 4 included: its repairs go to every destination); the
answers are multicast's (docs/FLOW.md): ``max`` and ``rc=nak-strength`` never stall the others,
and leave host 3 behind (and another clean host that falls as far behind) and tell it what it
lost;
``min`` holds everyone until it reads again.
A receiver whose driver dies is dropped from the publisher's destinations after the timeout
(5 s) and costs the others nothing.

Needs root (CI runs as root): skips without it, fails under CI=true.
"""

from __future__ import annotations

import pytest

from slipstream.sim.network import LinkFaults
from slipstream.sim.real.on_hosts import check_applicable, link_loss, run_on_hosts
from slipstream.sim.report import Report
from slipstream.sim.scenario import Event, LinkOverride, Scenario, ScenarioError

pytestmark = pytest.mark.timeout(120)

MS = 1_000_000
S = 1_000_000_000
PUBLISH_RATE = 5000  # 1 KiB messages per second
#: A receiver half a term (2 MiB, 0.4 s of the stream) behind is left behind under max and
#: nak-strength: the paused one is; the others lag only when the machine is busy (a 1 MiB
#: term's 0.1 s left the lossy host behind once, at a load of 12 on 2 cores; beside
#: stress-ng --cpu 2 a subscriber descheduled for 0.42 s was left behind at 4 MiB).
TERM = "term-length=4m"
FRAME = 1056  # a 1 KiB message and its header
PAUSED = 3
LOSSY = 4
LOSS = LinkFaults(loss=0.05)
PAUSE = Event(500 * MS, "pause", hosts=(PAUSED,), end_ns=2500 * MS)


def play(channel: str, *, messages: int, hosts: int = 5, events=(), links=(),
         publish_rate: float = PUBLISH_RATE) -> Report:
    scenario = Scenario(hosts=hosts, transport="mdc", messages=messages, size=1024,
                        publish_rate=publish_rate,
                        channel_params="|".join(p for p in (TERM, channel) if p),
                        max_virtual_ns=60 * S, events=tuple(events), links=tuple(links))
    report = run_on_hosts(scenario, sample_interval_ns=10 * MS)
    assert report.completed, report.format_text()
    return report


def at(values: list, host: int):
    return values[host - 2]


def others(values: list, *hosts: int) -> list:
    """The entries of the subscribers other than ``hosts``."""
    return [v for i, v in enumerate(values) if i + 2 not in hosts]


def counters(report: Report, host: int) -> dict[str, int]:
    """Host ``host``'s system counters at the end (the publisher's come first)."""
    if host == 1:
        return next(iter(report.counters.values()))
    return report.counters[report.subscribers[host - 2]]


def assert_exactly_once_from_each_join(report: Report) -> None:
    """Every receiver got its messages once, in order, intact, from its join: what it misses
    is what its driver told it it lost, left behind, and what the sender sent while it
    rejoined (its new image starts a little past the range's end, docs/FLOW.md: 4 to 25
    messages on a quiet machine, 65 seen under load, 501 once beside stress-ng --cpu 2; up
    to 0.25 s of the stream here)."""
    text = report.format_text()
    assert not any(report.duplicates) and not any(report.out_of_order), text
    assert not any(report.corrupt) and not any(report.joined_late), text
    for missing, lost in zip(report.missing, report.lost_ranges, strict=True):
        told = sum(end - start for start, end in lost) // FRAME
        assert told <= missing <= told + PUBLISH_RATE // 4 * len(lost), (missing, lost, text)


@pytest.mark.parametrize("channel", ["", "fc=min", "rc=nak-strength"],
                         ids=["max", "min", "nak-strength"])
def test_a_lossy_link_and_a_paused_receiver_under_each_answer(needs_hosts, channel) -> None:
    report = play(channel, messages=14_000, events=[PAUSE],
                  links=[LinkOverride(1, LOSSY, LOSS), LinkOverride(LOSSY, 1, LOSS)])
    text = report.format_text()
    assert_exactly_once_from_each_join(report)
    # The lossy receiver got everything, by repairs: it asked, and nobody else needed to.
    assert at(report.missing, LOSSY) == 0 and not at(report.lost_ranges, LOSSY), text
    naks = [counters(report, host).get("NAK_MESSAGES_SENT", 0) for host in (2, 3, 4, 5)]
    assert at(naks, LOSSY) > 10 and max(others(naks, LOSSY)) < at(naks, LOSSY) / 10, naks
    assert counters(report, 1)["RETRANSMITS_SENT"] > 10
    if channel == "fc=min":
        assert others(report.missing, PAUSED) == [0, 0, 0], text
    else:
        # The others keep up and get everything (the lossy one did, above).  On a loaded
        # machine host 2 or 5 may fall half a term behind too (its subscriber descheduled:
        # 0.42 s beside stress-ng): it is then left behind as host 3 is, and told, never
        # silently (each host's loss is what it was told, above); the other gets everything.
        clean = (2, 5)
        for host in clean:
            if at(report.missing, host):
                assert at(report.lost_ranges, host), text
                assert counters(report, host)["IMAGES_LEFT_BEHIND"] >= 1, text
        assert min(at(report.missing, host) for host in clean) == 0, text
    # Every receiver stayed a destination throughout: the paused one's driver, and the
    # lossy one's surviving status messages, kept them in the table.
    assert report.destinations and {n for _, n in report.destinations} == {4}
    gaps = others(report.longest_gaps_ns, PAUSED)
    if channel == "fc=min":  # everyone held until host 3 reads again, and nothing lost
        assert report.exactly_once_in_order, text
        assert min(gaps) > 1000 * MS, report.longest_gaps_ns
    else:  # the others never stop; host 3 is left behind, told, and goes on
        assert max(gaps) < 500 * MS, report.longest_gaps_ns
        assert at(report.lost_ranges, PAUSED), text
        assert counters(report, PAUSED)["IMAGES_LEFT_BEHIND"] >= 1
    if channel == "rc=nak-strength":
        assert counters(report, PAUSED)["RATE_SIGNALS_SENT"] > 0
        assert counters(report, 1)["RATE_CUTS"] > 0


def test_a_receiver_whose_driver_dies_is_timed_out_and_costs_the_others_nothing(
        needs_hosts) -> None:
    """Host 3's driver is killed 1 s into a 7 s stream: the publisher keeps it as a
    destination for the timeout (5 s after its last status message), sending to an address
    where nothing listens, then drops it; the others never notice."""
    crash = Event(1 * S, "crash", hosts=(3,))
    report = play("", hosts=4, messages=7000, publish_rate=1000, events=[crash])
    text = report.format_text()
    assert others(report.missing, 3) == [0, 0], text
    # What a dead destination could cost is seconds (its timeout); a busy machine's pauses
    # are tenths (106 ms at all three hosts once, before the crash, at a load of 15).
    assert max(others(report.longest_gaps_ns, 3)) < 500 * MS, report.longest_gaps_ns
    counts = report.destinations
    assert {n for t, n in counts if t < 1 * S} == {3}, counts[:10]
    dropped_at = next(t for t, n in counts if n == 2)
    assert 5.5 * S < dropped_at < 6.5 * S, dropped_at / S
    assert {n for t, n in counts if t >= dropped_at} == {2}


def test_a_host_run_gives_a_publisher_link_its_own_loss_and_refuses_the_rest_by_name() -> None:
    lossy = Scenario(hosts=5, transport="mdc", faults=LinkFaults(loss=0.01),
                     links=(LinkOverride(1, 4, LinkFaults(loss=0.05)),
                            LinkOverride(4, 1, LinkFaults(loss=0.2))))
    assert check_applicable(lossy) == []
    assert [link_loss(lossy, 1, 4), link_loss(lossy, 4, 1), link_loss(lossy, 1, 2)] == [
        0.05, 0.2, 0.01]
    for links, key in (((LinkOverride(2, 3, LinkFaults(loss=0.05)),), "link: "),
                       ((LinkOverride(1, 3, LinkFaults(loss=0.05, duplicate=0.1)),),
                        "link.duplicate"),
                       ((LinkOverride(3, 1, LinkFaults(rate_mbit=10)),), "link.rate_mbit")):
        with pytest.raises(ScenarioError, match=key):
            check_applicable(Scenario(hosts=4, transport="mdc", links=links))
