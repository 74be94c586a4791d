"""The protocol core (daemon/) in the simulator: reliability and lifecycle scenarios.

Every test runs the real NetworkPublication / ReceiveChannel / PublicationImage with real log
buffers, the C appender and the client Image reader, over the virtual network (sim/).
"""

from __future__ import annotations

import attrs
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from slipstream.client.layout import DATA_HEADER, HDR_TYPE_DATA, HEADER_LENGTH
from slipstream.client.publication import BACK_PRESSURED, NOT_CONNECTED
from slipstream.sim.capture import Capture
from slipstream.sim.network import LinkFaults
from slipstream.sim.report import Report
from slipstream.sim.runner import Simulation, run_scenario
from slipstream.sim.scenario import Event, Scenario

MS = 1_000_000
S = 1_000_000_000
FRAME = 1056  # a 1 KiB message: 32-byte header + 1024, already 32-aligned: one per datagram
PUB, SUB1, SUB2 = "10.0.0.1", "10.0.0.2", "10.0.0.3"


def assert_exactly_once(report) -> None:
    assert report.completed, report.format_text()
    assert report.delivered == [report.sent] * len(report.delivered), report.format_text()
    assert not any(report.duplicates), report.duplicates
    assert not any(report.out_of_order), report.out_of_order
    assert not any(report.missing), report.missing
    assert not any(report.corrupt), report.corrupt
    assert report.exactly_once_in_order


def drop_frames_once(first: int, end: int, *, frame: int = FRAME, times: int = 1):
    """A network filter: drop DATA frames ``first..end-1`` (by index, bytes // frame) sent by
    the publisher, the first ``times`` times each is sent."""
    counts: dict[tuple[int, int], int] = {}

    def drop(_now: int, source, _destination, data: bytes) -> bool:
        if source[0] != PUB or len(data) < HEADER_LENGTH:
            return False
        (length, _version, _flags, kind, offset, _session, _stream, term_id,
         _reserved) = DATA_HEADER.unpack_from(data)
        if kind != HDR_TYPE_DATA or length == 0:  # not DATA, or a heartbeat
            return False
        if not first <= offset // frame < end:
            return False
        key = (term_id, offset)
        counts[key] = counts.get(key, 0) + 1
        return counts[key] <= times

    return drop


def run_captured(scenario: Scenario, *filters) -> tuple[Simulation, Report, Capture]:
    """``scenario`` run to its end with ``filters`` on its network and every datagram
    captured: (the simulation, its report, the capture)."""
    with Simulation(scenario) as sim:
        sim.network.filters.extend(filters)
        capture = Capture().attach(sim.network)
        report = sim.run()
    return sim, report, capture


# -- exactly once, in order ----------------------------------------------------------------

def test_the_samples_end_where_the_run_ended() -> None:
    """The last sample is taken as the run ends (between two timed ones): every subscriber
    at the publisher's position.  A plot's lines stopped short of it."""
    scenario = Scenario(hosts=3, messages=3000, size=512, seed=7,
                        faults=LinkFaults(loss=0.05, delay_ms=0.5))
    with Simulation(scenario, sample_interval_ns=100 * MS) as sim:
        report = sim.run()
    assert report.exactly_once_in_order
    end_ns, sender, subscribers = report.samples[-1]
    assert abs(end_ns - report.virtual_seconds * S) < 1000
    assert subscribers == [sender, sender]


def test_exactly_once_unicast_at_20_percent_loss():
    report = run_scenario(Scenario(hosts=2, messages=2000, seed=3,
                                   faults=LinkFaults(loss=0.2, delay_ms=1)))
    assert_exactly_once(report)
    assert report.naks > 100 and report.retransmits > 100


def test_exactly_once_multicast_at_20_percent_loss():
    # fc=min with a group of 2: the publisher waits for both receivers.  With the default max
    # flow control a receiver whose SETUP is lost joins later, where the stream then is.
    report = run_scenario(Scenario(hosts=3, messages=1000, seed=4, channel_params="fc=min,g:/2",
                                   faults=LinkFaults(loss=0.2, delay_ms=1)))
    assert_exactly_once(report)


def test_max_flow_control_receiver_that_lost_the_setup_joins_late_and_says_so():
    report = run_scenario(Scenario(hosts=3, messages=2000, seed=1,
                                   faults=LinkFaults(loss=0.2, delay_ms=1)))
    assert report.completed and not any(report.duplicates) and not any(report.out_of_order)
    late = [i for i, d in enumerate(report.delivered) if d < report.sent]
    assert late, "seed 1 loses a SETUP to one receiver"
    assert all(report.missing[i] == report.sent - report.delivered[i] for i in late)


def test_exactly_once_with_bursty_loss():
    faults = LinkFaults(burst=(0.05, 0.25), delay_ms=1)  # ~17 % lost, in bursts of ~4
    for hosts, seed in ((2, 5), (3, 6)):
        report = run_scenario(Scenario(hosts=hosts, messages=1500, seed=seed, faults=faults,
                                       channel_params="fc=min,g:/2" if hosts == 3 else ""))
        assert_exactly_once(report)
        assert report.network["drop-burst"] > 100


def test_exactly_once_with_fragmented_messages_duplicates_and_reordering():
    faults = LinkFaults(loss=0.05, delay_ms=1, jitter_ms=0.5, reorder=0.05, duplicate=0.05)
    report = run_scenario(Scenario(hosts=3, messages=500, size=5000, seed=8, faults=faults,
                                   channel_params="fc=min,g:/2"))
    assert_exactly_once(report)


_SIZES = st.sampled_from([16, 200, 1024, 3000])


@st.composite
def healed_fault_schedules(draw) -> Scenario:
    hosts = draw(st.sampled_from([2, 3]))
    burst = draw(st.one_of(st.none(), st.tuples(st.floats(0.0, 0.1), st.floats(0.1, 1.0))))
    faults = LinkFaults(
        loss=draw(st.floats(0.0, 0.4)), burst=burst,
        delay_ms=draw(st.floats(0.0, 5.0)), jitter_ms=draw(st.floats(0.0, 2.0)),
        reorder=draw(st.floats(0.0, 0.3)), duplicate=draw(st.floats(0.0, 0.3)),
        rate_mbit=draw(st.sampled_from([0.0, 10.0, 100.0])))
    heal_ms = draw(st.integers(0, 1500))
    events = [Event(heal_ms * MS, "faults", faults={
        "loss": 0.0, "burst": None, "reorder": 0.0, "duplicate": 0.0, "jitter_ms": 0.0})]
    if draw(st.booleans()):
        start = draw(st.integers(0, 800))
        side = draw(st.integers(1, hosts))
        events.append(Event(start * MS, "partition", hosts=(side,),
                            end_ns=(start + draw(st.integers(1, 1500))) * MS))
    # Multicast: fc=min with a group of 2, so the publisher waits for both receivers (with the
    # default max flow control a receiver whose SETUP was lost joins late, where the stream is).
    # Terms of 64 KiB: a stream of 150 messages of 1 KiB or more crosses term ends (padding,
    # NAKs and repairs across them) and several 32 KiB windows.
    params = "term-length=64k" + ("|fc=min,g:/2" if hosts == 3 else "")
    return Scenario(hosts=hosts, messages=draw(st.integers(1, 300)), size=draw(_SIZES),
                    seed=draw(st.integers(0, 2**32)), faults=faults, events=tuple(events),
                    channel_params=params, max_virtual_ns=120 * S)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(healed_fault_schedules())
@example(Scenario(  # always run: 900 KB, 14 terms, with loss, reordering and a partition
    hosts=3, messages=300, size=3000, seed=3, faults=LinkFaults(
        loss=0.1, delay_ms=1.0, jitter_ms=0.5, reorder=0.1, duplicate=0.05),
    events=(Event(400 * MS, "faults", faults={"loss": 0.0, "reorder": 0.0, "duplicate": 0.0,
                                              "jitter_ms": 0.0}),
            Event(100 * MS, "partition", hosts=(2,), end_ns=300 * MS)),
    channel_params="term-length=64k|fc=min,g:/2", max_virtual_ns=120 * S))
@example(Scenario(  # the partition drops a term's last half and its PAD, the stream's end:
    # the sender's heartbeats then stand at the next term's start, past the receivers'
    # over-run threshold, and must still show them the gap
    hosts=3, messages=274, size=3000, seed=4_294_967_296, faults=LinkFaults(
        burst=(0.0002, 1.0), delay_ms=4.125, jitter_ms=2.1384067375754764e-164,
        reorder=0.19921875, reorder_delay_ms=5.0, duplicate=0.05),
    events=(Event(267 * MS, "faults", faults={"loss": 0.0, "burst": None, "reorder": 0.0,
                                              "duplicate": 0.0, "jitter_ms": 0.0}),
            Event(329 * MS, "partition", hosts=(1,), end_ns=330 * MS)),
    channel_params="term-length=64k|fc=min,g:/2", max_virtual_ns=120 * S))
def test_any_fault_schedule_that_heals_delivers_exactly_once_in_order(scenario):
    assert_exactly_once(run_scenario(scenario))


def test_same_seed_same_run():
    scenario = Scenario(hosts=3, messages=300, seed=11, faults=LinkFaults(
        loss=0.1, burst=(0.02, 0.3), delay_ms=1, jitter_ms=0.5, reorder=0.05, duplicate=0.05))
    a = run_scenario(scenario)
    b = run_scenario(scenario)
    assert a.trace_digest == b.trace_digest
    assert (a.naks, a.retransmits, a.virtual_seconds, a.network) == (
        b.naks, b.retransmits, b.virtual_seconds, b.network)
    c = run_scenario(attrs.evolve(scenario, seed=12))
    assert c.trace_digest != a.trace_digest


# -- loss recovery -------------------------------------------------------------------------

def test_one_large_gap_is_recovered_with_a_single_nak():
    _, report, capture = run_captured(
        Scenario(hosts=2, messages=300, faults=LinkFaults(delay_ms=1)), drop_frames_once(60, 90))
    assert_exactly_once(report)
    naks = capture.select("NAK")
    assert len(naks) == 1 and report.naks == 1 and report.retransmits == 1
    assert (naks[0].term_offset, naks[0].length) == (60 * FRAME, 30 * FRAME)
    assert report.network["drop-filter"] == 30


def test_gap_at_the_tail_is_filled_after_the_publisher_stops():
    _, report, capture = run_captured(Scenario(hosts=2, messages=200, faults=LinkFaults(
        delay_ms=1)), drop_frames_once(195, 200))
    assert_exactly_once(report)
    last_data = max(r.t_ns for r in capture.records if r.event == "drop-filter")
    nak = capture.select("NAK")[0]
    heartbeat = next(r for r in capture.select("HB", src=PUB) if r.t_ns > last_data)
    # Nothing reveals the lost tail until the idle sender's heartbeat (100 ms later) carries
    # its position; the NAK follows 100 µs after, and arrives 1 ms later.
    assert heartbeat.t_ns - last_data == 100 * MS + 1 * MS  # sent 100 ms later, 1 ms delay
    assert nak.t_ns - heartbeat.t_ns == 100_000 + 1 * MS
    assert (nak.term_offset, nak.length) == (195 * FRAME, 5 * FRAME)
    assert report.naks == 1


def test_many_term_rotations_with_64k_terms():
    report = run_scenario(Scenario(hosts=2, messages=4000, seed=21, channel_params=
                                   "term-length=64k", faults=LinkFaults(loss=0.05,
                                                                        delay_ms=1)))
    assert_exactly_once(report)
    assert report.sent * FRAME // (64 * 1024) >= 60  # terms crossed
    # Multicast with fc=min: with the default max flow control a receiver that falls more
    # than the resend window (term/2 + max message = 40 KiB here) behind the fastest one is
    # left behind for good (its NAKs are outside the window; docs/DRIVER.md §3.5).
    report = run_scenario(Scenario(hosts=3, messages=1500, seed=22, channel_params=
                                   "term-length=64k|fc=min", faults=LinkFaults(loss=0.05,
                                                                               delay_ms=1)))
    assert_exactly_once(report)


# -- joins, crashes, liveness ----------------------------------------------------------------

def test_late_receiver_joins_mid_stream_through_an_elicited_setup():
    scenario = Scenario(hosts=3, messages=3000, publish_rate=5000, initially_down=(3,),
                        faults=LinkFaults(delay_ms=1),
                        events=(Event(200 * MS, "restart", hosts=(3,)),))
    sim, report, capture = run_captured(scenario)
    assert report.completed
    assert report.delivered[0] == report.sent and report.missing[0] == 0
    late = sim.subscribers[1].stats
    assert 900 < late.first_seq[1] < 1100  # joined at ~200 ms of a 5000 msg/s stream
    assert report.delivered[1] == report.sent - late.first_seq[1]
    # Missing: only what was published between its start and its join (a few ms).
    assert report.missing[1] == late.first_seq[1] - late.expected_from <= 15
    elicit = [r for r in capture.select("SM", src=SUB2) if r.flags & 0x80]
    assert elicit and elicit[0].t_ns >= 200 * MS
    setups = [r for r in capture.select("SETUP", src=PUB)
              if r.t_ns > elicit[0].t_ns and r.dst[0] == SUB2]
    assert setups
    assert setups[0].t_ns - elicit[0].t_ns <= 2 * MS  # the sender answers within one RTT


def test_restarted_unicast_receiver_rejoins():
    scenario = Scenario(hosts=2, messages=4000, publish_rate=4000, faults=LinkFaults(
        delay_ms=1), events=(Event(300 * MS, "crash", hosts=(2,)),
                             Event(600 * MS, "restart", hosts=(2,))))
    report = run_scenario(scenario)
    assert report.completed and report.duplicates == [0] and report.out_of_order == [0]
    # Without SMs the sender stops one receiver window (128 KiB = 124 frames) past the last
    # SM; the restarted receiver joins where the sender stopped and gets the backlog.
    assert 0 < report.missing[0] <= 124


def test_crashed_publisher_image_becomes_unavailable_after_liveness_timeout():
    scenario = Scenario(hosts=2, messages=100_000, publish_rate=1000,
                        faults=LinkFaults(delay_ms=1),
                        events=(Event(300 * MS, "crash", hosts=(1,)),))
    sim, report, capture = run_captured(scenario)
    assert report.completed
    last_packet = max(r.t_ns for r in capture.select(src=PUB))
    sub = sim.subscribers[0]
    assert len(sub.unavailable_at_ns) == 1 and not sub.readers
    waited = sub.unavailable_at_ns[0] - last_packet
    # image_liveness_timeout (10 s) starts DRAINING; unavailable once drained + 5 SM timeouts.
    assert 10 * S <= waited <= 10 * S + 1500 * MS
    assert report.delivered[0] >= 250 and report.duplicates == [0]


def test_crashed_receiver_does_not_stall_a_min_flow_control_publisher_past_its_timeout():
    scenario = Scenario(hosts=3, messages=3000, channel_params="fc=min",
                        faults=LinkFaults(delay_ms=1),
                        events=(Event(10 * MS, "crash", hosts=(3,)),))
    with Simulation(scenario) as sim:
        sim.run_until(4 * S)
        stalled_at = sim.publisher.publication.sender_position
        assert stalled_at < 3000 * FRAME  # min flow control waits for the silent receiver
        report = sim.run()
    assert report.completed and report.delivered[0] == report.sent
    assert report.missing[0] == 0 and report.duplicates == [0, 0]
    # It moves on after flow_control_receiver_timeout (5 s), not later.
    assert 5.0 <= report.virtual_seconds <= 5.5


def test_crashed_receiver_does_not_stall_a_max_flow_control_publisher():
    scenario = Scenario(hosts=3, messages=3000, faults=LinkFaults(delay_ms=1),
                        events=(Event(10 * MS, "crash", hosts=(3,)),))
    report = run_scenario(scenario)
    assert report.completed and report.delivered[0] == report.sent
    assert report.virtual_seconds < 1.0


def test_unicast_publisher_disconnects_after_the_connection_timeout():
    scenario = Scenario(hosts=2, messages=100_000, publish_rate=1000,
                        faults=LinkFaults(delay_ms=1),
                        events=(Event(500 * MS, "crash", hosts=(2,)),))
    with Simulation(scenario) as sim:
        capture = Capture().attach(sim.network)
        sim.run_until(5400 * MS)
        publication = sim.publisher.publication
        assert publication.is_connected
        sim.run_until(5600 * MS)
        last_sm = max(r.t_ns for r in capture.select("SM", src=SUB1))
        assert last_sm <= 500 * MS
        assert not publication.is_connected  # publication_connection_timeout = 5 s
        # No credit without a receiver: pub-lmt = snd-pos, offers are refused, not hung.
        assert sim.publisher.publisher_limit == publication.sender_position
        assert sim.publisher.offer_once() in (NOT_CONNECTED, BACK_PRESSURED)


# -- graceful drain (the driver's DriverConductor.begin_drain, as on SIGTERM) --------------

def test_a_drain_at_20_percent_loss_delivers_everything_appended_then_ends_the_stream():
    # g:/3: publishing waits for all three receivers, so each must get every message.
    scenario = Scenario(hosts=4, messages=1_000_000,
                        channel_params="fc=min,g:/3|term-length=64k",
                        faults=LinkFaults(delay_ms=2, loss=0.2), seed=5)
    with Simulation(scenario) as sim:
        now = 0
        while sim.publisher.next_seq < 2000:  # mid-flight, the log's window full
            assert now < 20 * S
            now += 100 * MS
            sim.run_until(now, stop_when_complete=False)
        conductor = sim.publisher.driver.conductor
        conductor.begin_drain(now)
        appended_at_drain = sim.publisher.next_seq
        drain_started = now
        while not conductor.drain(now):
            assert now - drain_started < 10 * S, "the drain did not finish"
            now += MS
            sim.run_until(now, stop_when_complete=False)
        drained_in = now - drain_started
        # The driver would exit here: by now every subscriber must have everything.
        report = sim.report()
        sim.run_until(now + 1500 * MS, stop_when_complete=False)
        readers_left = [len(sub.readers) for sub in sim.subscribers]
    # No credit after the drain began: at most one offer in flight past its limit check.
    assert report.sent - appended_at_drain <= 1
    assert report.delivered == [report.sent] * 3, report.format_text()
    assert not any(report.duplicates) and not any(report.missing)
    assert not any(report.out_of_order)
    assert report.naks > 0
    # End-of-stream reached every subscriber: their images are gone after the 5 status
    # message timeouts of an image's drain (1 s), not after the image liveness timeout (10 s).
    assert readers_left == [0, 0, 0]
    assert drained_in < 3 * S


def test_a_repeated_image_request_for_a_session_already_served_makes_no_second_image():
    """The receiver asks again when the conductor took longer than its pending-setup timeout:
    the conductor must not make (and leak) a second image of the same session."""
    from slipstream.client.frames import Setup
    from slipstream.daemon.media.events import ImageRequested

    scenario = Scenario(hosts=2, messages=100, faults=LinkFaults(delay_ms=1))
    with Simulation(scenario) as sim:
        assert sim.run_until(2 * S)
        driver = sim.subscribers[0].driver
        network = driver.network
        [entry] = network._receive_endpoints.values()
        [image_entry] = entry.images.values()
        image = image_entry.image
        setup = Setup(0, image.session_id, image.stream_id, image.initial_term_id,
                      image.initial_term_id, image.term_length, 1408)
        network._post(ImageRequested(entry.endpoint.channel, setup, image.source))
        driver.do_work(sim.loop.now_ns)
        assert list(entry.images.values()) == [image_entry]
        assert len(list((driver.directory / "images").iterdir())) == 1


def test_a_subscription_that_cannot_link_every_image_is_not_left_half_added():
    from slipstream.client import control
    from slipstream.client.counters import CountersFullError, CounterType

    scenario = Scenario(hosts=2, messages=100, faults=LinkFaults(delay_ms=1))
    with Simulation(scenario) as sim:
        assert sim.run_until(2 * S)
        host = sim.subscribers[0]
        driver = host.driver
        network = driver.network
        [entry] = network._receive_endpoints.values()
        subscriptions_before = list(entry.subscriptions)
        with pytest.raises(CountersFullError):
            while True:  # fill the counters: the new subscription's sub-pos has no room
                driver.counters.allocate(CounterType.SUBSCRIBER_POSITION, "filler")
        with pytest.raises(RuntimeError, match="refused"):
            driver.command({"type": control.ADD_SUBSCRIPTION, "channel": host.uri,
                            "stream_id": scenario.stream_id, "correlation_id": 77})
        assert entry.subscriptions == subscriptions_before
        assert len(network.subscriptions) == len(subscriptions_before)


def test_a_subscription_added_as_the_last_one_leaves_does_not_take_the_leaving_image():
    """Aeron's isAcceptingSubscriptions: an image whose last subscriber left no longer takes
    data; a subscription added at that moment waits for the session's new image instead of
    sitting on the old one for ever."""
    from slipstream.client import control

    scenario = Scenario(hosts=2, messages=100, faults=LinkFaults(delay_ms=1))
    with Simulation(scenario) as sim:
        assert sim.run_until(2 * S)
        host = sim.subscribers[0]
        driver = host.driver
        [subscription_id] = list(driver.network.subscriptions)
        events: list[dict] = []
        host_on_message, driver._on_message = driver._on_message, events.append
        driver.command({"type": control.REMOVE_SUBSCRIPTION,
                        "registration_id": subscription_id, "correlation_id": 80})
        driver.command({"type": control.ADD_SUBSCRIPTION, "channel": host.uri,
                        "stream_id": scenario.stream_id, "correlation_id": 81})
        driver._on_message = host_on_message
    assert [e for e in events if e["type"] == control.AVAILABLE_IMAGE] == []
