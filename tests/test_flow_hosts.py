"""Each multicast strategy on namespace hosts: one publisher, three or four subscribers, a driver
on each host, the scenarios of tests/test_sim_flow.py played by ``slipstream sim --on-hosts``
(:mod:`slipstream.sim.real.on_hosts`) over veths, in real time.

Host 3's subscriber reads at a tenth of the publisher's rate, or pauses, or its driver dies:

* ``max`` lets the others set the pace; host 3 is left behind, told, and goes on;
* ``min`` holds everyone to host 3, stops everyone while it pauses, and waits for a dead one
  until its receiver timeout;
* ``tagged`` holds the publisher to its group only;
* ``rc=nak-strength`` never stops the others while host 3 pauses.

Needs root (CI runs as root): skips without it, fails under CI=true.
"""

from __future__ import annotations

import pytest

from slipstream.sim.network import LinkFaults
from slipstream.sim.real.on_hosts import check_applicable, run_on_hosts, share_one_link
from slipstream.sim.report import Report
from slipstream.sim.scenario import Event, Scenario, ScenarioError

pytestmark = pytest.mark.timeout(180)

MS = 1_000_000
S = 1_000_000_000
PUBLISH_RATE = 5000  # 1 KiB messages per second
SLOW_RATE = PUBLISH_RATE / 10
SLOW_HOST = 3
FRAME = 1056  # a 1 KiB message and its header


@pytest.fixture
def on_hosts(needs_hosts):  # -> Callable[..., Report]
    """Play a scenario on namespace hosts."""

    def play(channel: str, *, messages: int, hosts: int = 4, read_rates=(), events=(),
             subscriber_params=(), settings=None) -> Report:
        scenario = Scenario(hosts=hosts, messages=messages, size=1024, publish_rate=PUBLISH_RATE,
                            channel_params=f"term-length=1m|{channel}", max_virtual_ns=60 * S,
                            read_rates=tuple(read_rates), events=tuple(events),
                            subscriber_params=tuple(subscriber_params),
                            settings=settings or {})
        report = run_on_hosts(scenario, sample_interval_ns=10 * MS)
        assert report.completed, report.format_text()
        return report

    return play


def others(values: list) -> list:
    """The entries of the subscribers other than host 3."""
    return [v for i, v in enumerate(values) if i + 2 != SLOW_HOST]


def slow(values: list):
    return values[SLOW_HOST - 2]


def host_counters(report: Report, host: int) -> dict[str, int]:
    """Host ``host``'s system counters at the end (host 1 publishes; a host whose driver was
    killed has none)."""
    if host == 1:
        return next(iter(report.counters.values()))  # the publisher's come first
    return report.counters[report.subscribers[host - 2]]


SLOW = [(SLOW_HOST, SLOW_RATE)]


def test_under_max_a_slow_subscriber_host_is_left_behind_told_and_goes_on(on_hosts) -> None:
    report = on_hosts("", messages=15_000, read_rates=SLOW)
    # A host that keeps up gets everything.  On a loaded machine another may fall behind the
    # fastest too (its subscriber descheduled): under max it is then left behind as the slow
    # one is, and told, its loss reported, never silent.
    for host, missing, lost in zip((2, 4), others(report.missing), others(report.lost_ranges),
                                   strict=True):
        if missing:
            assert lost and host_counters(report, host)["IMAGES_LEFT_BEHIND"] >= 1, \
                report.format_text()
    assert min(others(report.missing)) == 0, report.format_text()
    assert slow(report.missing) > 0 and slow(report.joined_late) == 0
    assert slow(report.lost_ranges), report.format_text()
    assert host_counters(report, SLOW_HOST)["IMAGES_LEFT_BEHIND"] >= 1
    # It went on from where the stream was: it got well more than it had when first left.
    first_lost_at = slow(report.lost_ranges)[0][0]
    assert slow(report.delivered) > 1.5 * first_lost_at / FRAME, report.format_text()
    # Nobody waited for it: a run held to its pace takes at least all of its reading time.
    assert report.wall_seconds < 15_000 / SLOW_RATE


def test_under_min_every_subscriber_host_is_held_to_the_slow_one(on_hosts) -> None:
    report = on_hosts("fc=min", messages=2500, read_rates=SLOW)
    assert report.exactly_once_in_order, report.format_text()
    # No subscriber was ever more than a window (128 KiB) ahead of the slow one: everyone
    # went at its pace (under max the others finish while it has read a tenth).
    lead = max(max(p for p in others(positions) if p is not None) - slow(positions)
               for _, _, positions in report.samples
               if slow(positions) is not None and any(others(positions)))
    assert lead <= 2 * 128 * 1024, lead  # two windows: the samples are not one instant
    assert host_counters(report, SLOW_HOST)["IMAGES_LEFT_BEHIND"] == 0


def test_tagged_holds_the_publisher_to_its_group_only(on_hosts) -> None:
    tagged = [(host, "gtag=7") for host in (2, 4)]
    report = on_hosts("fc=tagged,g:7/2", messages=5000, read_rates=SLOW,
                      subscriber_params=tagged)
    assert others(report.missing) == [0, 0]
    assert slow(report.lost_ranges), report.format_text()
    assert report.wall_seconds < 5000 / SLOW_RATE  # less than host 3 alone would take


def test_under_min_a_dead_subscriber_host_stops_the_others_until_its_timeout(on_hosts) -> None:
    crash = Event(1 * S, "crash", hosts=(SLOW_HOST,))
    report = on_hosts("fc=min", messages=10_000, events=[crash],
                      settings={"flow_control_receiver_timeout": "2s"})
    assert others(report.missing) == [0, 0], report.format_text()
    assert min(others(report.longest_gaps_ns)) > 1500 * MS, report.longest_gaps_ns


PAUSE = Event(1 * S, "pause", hosts=(SLOW_HOST,), end_ns=3 * S)


def test_a_paused_subscriber_host_stops_everyone_under_min_until_it_reads(on_hosts) -> None:
    report = on_hosts("fc=min", messages=15_000, events=[PAUSE])
    assert report.exactly_once_in_order, report.format_text()
    assert min(others(report.longest_gaps_ns)) > 1000 * MS, report.longest_gaps_ns


def test_under_nak_strength_the_others_never_stop_while_one_host_pauses(on_hosts) -> None:
    report = on_hosts("rc=nak-strength", messages=15_000, hosts=5, events=[PAUSE])
    # The others get everything.  On a loaded machine one may fall half a term behind too
    # (its subscriber descheduled: a 0.52 s gap beside a CPU hog, 2,736 messages): it is then
    # left behind as host 3 is, and told, never silently; another gets everything.
    for host, missing, lost in zip((2, 4, 5), others(report.missing),
                                   others(report.lost_ranges), strict=True):
        if missing:
            assert lost and host_counters(report, host)["IMAGES_LEFT_BEHIND"] >= 1, \
                report.format_text()
    assert min(others(report.missing)) == 0, report.format_text()
    # Under half the pause: nobody waited for host 3 (how far under is bench/flow_hosts.py's
    # figure; under min each gap is the pause's length, as the test above shows).
    assert max(others(report.longest_gaps_ns)) < (PAUSE.end_ns - PAUSE.at_ns) / 2, (
        report.longest_gaps_ns)
    assert host_counters(report, SLOW_HOST)["RATE_SIGNALS_SENT"] > 0
    assert host_counters(report, 1)["RATE_CUTS"] > 0


def test_cubic_streams_through_one_tbf_lose_nothing_and_leave_a_static_one_its_share(
        needs_hosts) -> None:
    """Two streams from one host to another through a tbf of 100 Mbit/s whose 5 ms queue
    overflows: two CUBIC receivers, then CUBIC beside the static window.  Every message
    arrives once, in order (share_one_link checks), and CUBIC, which backs off on loss, does
    not starve the static stream once the start-up race is over.  How evenly two CUBIC
    streams share once settled is a benchmark's figure (bench/flow_hosts.py: they converge
    over tens of seconds)."""
    both = share_one_link(("cc=cubic", "cc=cubic"), 4, mbit=100, queue_ms=5)
    # Neither was left with a trickle (before RFC 8312's Reno floor one could sit at one
    # datagram, 1 % of the other; the settled share is the benchmark's figure).
    last = [sum(series[-15:]) for series in both["bins"]]
    assert min(last) > 0.2 * max(last), both["bins"]
    mixed = share_one_link(("cc=cubic", ""), 5, mbit=100, queue_ms=5)
    assert both["naks"] + mixed["naks"] > 0  # the queue overflowed: there was loss to answer
    # The first second is a race either stream may win (the one the queue's first overflows hit
    # less sits at a tenth of the link until its repairs catch up: over the whole 3 s the
    # static stream had 0.33-2.2x CUBIC's bytes in 16 trials, CI failed at 0.44).  After it
    # the static stream's share is where CUBIC could starve it.  Over 1.5 s a few bins in which
    # either stream stalls (bins of 0-250 KB among ~600) move the share: 0.73-1.68x
    # in 22 trials, CI failed at 0.45; over the 4 s after the first second, 0.88-1.34x in 12.
    cubic, static = (sum(series[10:]) for series in mixed["bins"])
    assert static > cubic / 2, mixed["bins"]


def test_band_4_takes_eight_ninths_of_a_tbf_bottleneck_and_band_1_never_starves(
        needs_hosts) -> None:
    """Two streams on one send socket through a 100 Mbit/s tbf whose queue is longer than the
    socket's buffer, so the socket fills (the sender's bands decide what goes) before the
    queue drops anything: priority=800 (band 4) against priority=0 (band 1).  How much of
    the link the two use is bench/flow_hosts.py's figure (``--only bands``)."""
    result = share_one_link(("", ""), 5, mbit=100, queue_ms=50,
                            publication_params=("priority=0", "priority=800"),
                            sender_settings={"socket_so_sndbuf": "64k"},
                            receiver_settings={"rcv_initial_window_length": "2m",
                                               "socket_so_rcvbuf": "4m"})
    low, high = (series[10:] for series in result["bins"])  # after the first second
    share = sum(high) / (sum(high) + sum(low))
    assert abs(share - 8 / 9) < 8 / 9 * 0.10, (share, result["bins"])
    # Band 1 gets its ninth every second: a sender that served band 4 first while it had
    # anything to send would starve it for the whole run.
    assert all(sum(low[i:i + 10]) > 0 for i in range(0, len(low), 10)), result["bins"]


def test_a_host_run_refuses_what_real_links_cannot_do_by_name() -> None:
    assert check_applicable(Scenario(hosts=3, faults=LinkFaults(delay_ms=0.5))) == [
        "faults.delay_ms = 0.5 not applied: real links have their own (no netem here)"]
    for scenario, key in ((Scenario(hosts=3, faults=LinkFaults(duplicate=0.1)),
                           "faults.duplicate"),
                          (Scenario(hosts=3, events=(Event(0, "restart", hosts=(2,)),)),
                           "restart"),
                          (Scenario(hosts=3, initially_down=(2,)), "initially_down")):
        with pytest.raises(ScenarioError, match=key):
            check_applicable(scenario)


def test_the_governor_climbs_its_ladder_under_a_bottleneck_and_descends_after(
        needs_hosts) -> None:
    """Two streams on one send socket through a 100 Mbit/s tbf, offering all they can: the
    send backlog drives the pressure up, and the governor climbs to its top step, where the
    lowest band's offers (priority=-500) are refused while band 4's go on.  Then the offers
    stop, the backlog drains and the ladder descends to 0.  Nothing accepted is lost: both
    streams arrive whole, in order."""
    import time

    from slipstream.client import BACK_PRESSURED, Client
    from slipstream.client.counters import SystemCounter, read_system_counters
    from slipstream.sim.real.hosts import NamespaceHosts
    from slipstream.sim.scenario import UNICAST_PORT

    with NamespaceHosts(2) as hosts:
        hosts.rate_limit(1, 100, latency_ms=50)
        sender = hosts.start_driver(1, log_level="info", socket_so_sndbuf="64k")
        receiver = hosts.start_driver(2, log_level="warning", rcv_initial_window_length="2m",
                                      socket_so_rcvbuf="4m")
        uri = f"aeron:udp?endpoint={hosts[2].address}:{UNICAST_PORT}"
        with Client.connect(sender.directory) as a, Client.connect(receiver.directory) as b:
            subscriptions = [b.add_subscription(uri, k) for k in (1, 2)]
            low = a.add_publication(f"{uri}|priority=-500", 1)
            high = a.add_publication(f"{uri}|priority=800", 2)
            deadline = time.monotonic() + 20
            while not (low.is_connected and high.is_connected
                       and all(s.images for s in subscriptions)):
                assert time.monotonic() < deadline, "the streams did not connect"
                time.sleep(0.01)
            sent, got = [0, 0], [0, 0]

            def handler(k: int):
                def on_message(data: memoryview, _header: object) -> None:
                    assert int.from_bytes(data[:8], "little") == got[k], f"stream {k}"
                    got[k] += 1
                return on_message

            handlers = [handler(0), handler(1)]
            message = bytearray(1024)
            steps: list[int] = []
            pressures: list[int] = []
            refused_at_top = [0, 0]
            started = time.monotonic()
            while time.monotonic() - started < 6:  # the load: both offer all they can
                step = read_system_counters(sender.directory)[SystemCounter.GOVERNOR_STEP]
                steps.append(step)
                for k, publication in enumerate((low, high)):
                    for _ in range(32):
                        message[:8] = sent[k].to_bytes(8, "little")
                        result = publication.offer(message)
                        if result < 0:
                            if step == 4 and result == BACK_PRESSURED:
                                refused_at_top[k] += 1
                            break
                        sent[k] += 1
                    subscriptions[k].poll(handlers[k], 256)
            at_top = sent[:]
            while time.monotonic() - started < 14:  # the load gone: it drains
                for k in (0, 1):
                    subscriptions[k].poll(handlers[k], 256)
                now = read_system_counters(sender.directory)
                steps.append(now[SystemCounter.GOVERNOR_STEP])
                pressures.append(now[SystemCounter.GOVERNOR_PRESSURE])
                if got == sent and steps[-1] == 0:
                    break
                time.sleep(0.001)
        counters = read_system_counters(sender.directory)
    assert max(steps) == 4, steps[::50]
    assert steps[-1] == 0, ("the ladder did not come down", pressures[::100], got, sent)
    assert counters[SystemCounter.GOVERNOR_LOWEST_REFUSED] >= 1
    assert counters[SystemCounter.GOVERNOR_CLIMBS] >= 4
    assert counters[SystemCounter.GOVERNOR_DESCENTS] >= 4
    assert got == sent, (got, sent)  # everything accepted arrived, once, in order
    assert refused_at_top[0] > 0 and sent[1] > 4 * sent[0] > 0, (refused_at_top, at_top)
