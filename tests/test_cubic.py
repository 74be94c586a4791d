"""CUBIC congestion control (``cc=cubic``, daemon/flow/cubic.py): the window function against
values worked by hand from Aeron's rules (docs/DRIVER.md §4.5), and a receiver that uses it
over a lossy link in the protocol pair."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import attrs
import pytest
from test_protocol_pair import MS, URI, US, Pair

from slipstream.client.channel import parse_channel
from slipstream.client.frames import Data, Rttm, StatusMessage, decode
from slipstream.daemon.config import DriverSettings
from slipstream.daemon.flow.cubic import B, C, CubicCongestionControl
from slipstream.daemon.flow.registry import congestion_control_for
from slipstream.daemon.protocol.params import SubscriptionParams
from slipstream.sim.network import LinkFaults
from slipstream.sim.runner import Simulation
from slipstream.sim.scenario import Scenario

MTU = 1408
WINDOW = 128 * 1024  # max_cwnd = 93 datagrams


def cubic(**overrides: object) -> CubicCongestionControl:
    settings = dict(max_window_length=WINDOW, mtu=MTU, initial_rtt_ns=100 * US,
                    measure_rtt=False, tcp_mode=False, now_ns=0)
    return CubicCongestionControl(**{**settings, **overrides})  # type: ignore[arg-type]


def rebuild(cc: CubicCongestionControl, now_ns: int, *, loss: bool = False,
            consumed: int = 0, last_sm: int = 0) -> tuple[bool, int]:
    return cc.on_track_rebuild(now_ns, consumption_position=consumed, last_sm_position=last_sm,
                               hwm_position=0, rebuild_start_position=0,
                               rebuild_end_position=0, loss_found=loss)


def test_cc_cubic_is_chosen_by_the_uri_with_the_settings_and_the_senders_mtu() -> None:
    settings = DriverSettings.from_mapping({"cubic_measure_rtt": True, "cubic_tcp_mode": True,
                                            "cubic_initial_rtt": "200us"})
    params = SubscriptionParams.resolve(
        parse_channel("aeron:udp?endpoint=10.0.0.1:4000|cc=cubic|rcv-wnd=64k"), settings)
    cc = congestion_control_for(params, 1 << 20, 1024, now_ns=5)
    assert isinstance(cc, CubicCongestionControl)
    assert (cc.max_cwnd, cc.cwnd, cc.mtu) == (64, 10, 1024)
    assert (cc.measure_rtt, cc.tcp_mode, cc.initial_rtt_ns, cc.last_loss_ns) == (
        True, True, 200 * US, 5)
    assert cc.max_window_length() == 64 * 1024 and cc.initial_window_length() == 10 * 1024


def test_the_window_starts_at_ten_datagrams_and_follows_the_cubic_of_the_time_since_loss(
        ) -> None:
    cc = cubic()
    assert (cc.max_cwnd, cc.cwnd, cc.w_max) == (93, 10, 93)
    assert rebuild(cc, 100 * US) == (False, 10 * MTU)  # within the first update interval
    # K = cbrt(93 x 0.2 / 0.4) = 3.596 s; past 100 us: 93 + trunc(0.4 x (0.0001 - 3.596)^3)
    k = math.cbrt(93 * B / C)
    expected = 93 + int(C * (101e-6 - k) ** 3)
    assert expected == 75
    assert rebuild(cc, 101 * US) == (False, 75 * MTU)
    assert rebuild(cc, 150 * US) == (False, 75 * MTU)  # one update per interval


def test_a_loss_cuts_the_window_by_b_and_forces_a_status_message_then_it_grows_back_past_it(
        ) -> None:
    cc = cubic()
    rebuild(cc, 101 * US)
    assert rebuild(cc, 1 * MS, loss=True) == (True, 60 * MTU)  # 75 x (1 - 0.2)
    assert (cc.w_max, cc.losses) == (75, 1)
    k = math.cbrt(75 * B / C)  # 3.347 s to get back to w_max
    windows = {}
    for t in (0.5, 1.0, 2.0, k, 4.0, 6.0, 8.0):
        now = 1 * MS + int(t * 1e9)
        rebuild(cc, now)
        windows[t] = cc.cwnd
    values = list(windows.values())
    assert values == sorted(values)
    assert windows[0.5] == 75 + int(C * (0.5 - k) ** 3) and windows[0.5] < 75
    assert windows[k] == 75  # the plateau at the last maximum
    assert windows[6.0] == 75 + int(C * (6.0 - k) ** 3) > 75  # convex past it ...
    assert windows[8.0] == 93  # ... up to max_cwnd


def test_a_window_of_one_datagram_forces_a_status_message_once_the_subscriber_moves() -> None:
    cc = cubic(max_window_length=MTU)
    assert cc.cwnd == 1
    assert rebuild(cc, 1 * MS, consumed=4096, last_sm=4096) == (False, MTU)
    assert rebuild(cc, 2 * MS, consumed=8192, last_sm=4096) == (True, MTU)


def test_tcp_mode_grows_below_the_last_maximum_at_least_as_fast_as_reno() -> None:
    plain, tcp = cubic(), cubic(tcp_mode=True)
    for cc in (plain, tcp):
        rebuild(cc, 101 * US)
        rebuild(cc, 1 * MS, loss=True)
        rebuild(cc, 1 * MS + 10 * MS)
    # Reno: 75 x 0.8 + (3 x 0.2 / 1.8) x 0.01 s / 100 us = 60 + 33.3
    assert plain.cwnd == 75 + int(C * (0.01 - math.cbrt(75 * B / C)) ** 3)
    assert tcp.cwnd == min(93, int(75 * (1 - B) + (3 * B / (2 - B)) * 0.01 / 100e-6))
    assert tcp.cwnd > plain.cwnd


def test_tcp_mode_grows_a_window_cut_to_one_datagram_while_losses_keep_coming() -> None:
    """Cut to one datagram, w_max is 1 and the cubic alone stays there for seconds; losses
    every 100 ms would hold it there for good.  Reno's floor applies above w_max too (RFC
    8312 §4.2; Aeron applies it below w_max only), so the window grows between the losses."""
    cc = cubic(tcp_mode=True, initial_rtt_ns=5 * MS)
    now = 0
    for _ in range(40):  # cut to one datagram
        now += 6 * MS
        rebuild(cc, now, loss=True)
    assert cc.cwnd == 1 and cc.w_max <= 2
    grown = []
    for _ in range(5):  # a loss every 100 ms, updates in between
        for _ in range(16):
            now += 6 * MS
            rebuild(cc, now)
        grown.append(cc.cwnd)
        rebuild(cc, now, loss=True)
    # Reno's floor after 96 ms at a 5 ms round trip: 0.8 w_max + 0.333 x 19 = about 7.
    assert min(grown) >= 6, grown


def test_round_trips_are_measured_every_four_round_trips_when_asked() -> None:
    quiet = cubic()
    assert not quiet.should_measure_rtt(0) and quiet.next_deadline_ns() > 10**18
    cc = cubic(measure_rtt=True)
    assert cc.should_measure_rtt(0)
    cc.on_rtt_measurement_sent(0)
    assert cc.next_deadline_ns() == 400 * US + 1 and not cc.should_measure_rtt(400 * US)
    cc.on_rtt_measurement(300 * US, 250 * US, ("10.0.0.1", 1))
    assert (cc.rtt_ns, cc.rtt_timeout_ns) == (250 * US, 1000 * US)
    assert cc.next_deadline_ns() == 1300 * US + 1  # timed from the answer, as Aeron's
    cc.on_rtt_measurement(1 * MS, 20 * US, ("10.0.0.1", 1))
    assert cc.rtt_timeout_ns == 400 * US  # never below 4 x the initial round trip


@pytest.mark.parametrize("measure_rtt", [False, True])
def test_a_cubic_receiver_over_a_lossy_link_cuts_its_window_and_gets_every_message(
        shm: Path, measure_rtt: bool) -> None:
    settings = DriverSettings.from_mapping({"cubic_measure_rtt": measure_rtt})
    pair = Pair(shm, receiver_uri=URI + "|cc=cubic", term_length=1 << 20, settings_=settings)
    pair.delay_ns = 200 * US
    dropped = []

    def drop(direction: str, dg) -> bool:
        frame = decode(dg.data)
        if direction == "p2r" and isinstance(frame, Data) and len(dropped) < 40 and (
                frame.term_offset // 1024) % 97 == 13 and frame.term_offset not in dropped:
            dropped.append(frame.term_offset)
            return True
        return False

    pair.drop = drop
    pair.run_until(1 * MS)
    cc = pair.image.congestion_control
    assert isinstance(cc, CubicCongestionControl)
    payloads = [bytes([i % 251]) * 992 for i in range(4000)]
    sent = 0
    while len(pair.received) < len(payloads):
        assert pair.now < 20_000 * MS, len(pair.received)
        while sent < len(payloads) and pair.offer(payloads[sent]) > 0:
            sent += 1
        pair.run_until(pair.now + 1 * MS)
    assert pair.received == payloads
    assert dropped and cc.losses > 0
    windows = {sm.receiver_window for _, sm in pair.frames("r2p", StatusMessage)}
    assert 10 * MTU in windows and any(w < 93 * MTU for w in windows if w != 10 * MTU)
    assert all(w % MTU == 0 for w in windows)
    rttms = [f for _, f in pair.frames("r2p", Rttm) if f.is_reply]
    assert bool(rttms) == measure_rtt
    if measure_rtt:
        assert cc.rtt_ns == 400 * US  # the link's two delays


def test_a_shorter_round_trip_moves_the_images_deadline_with_the_next_measurement(
        shm: Path) -> None:
    """An answer to an RTTM that measures a shorter round trip brings the next measurement
    forward.  The image's cheap check (``due``) had kept the deadline of its last pass, so
    the agent found a deadline due that no pass met: a network thread spun until the old
    deadline came, and the simulator stopped with SimulationStuck (here the pair's step raised
    "livelock").  The link's one-way delay falls from 1 ms to 100 µs: the first RTTM after
    that (asked 8 ms after the last answer) measures 200 µs, and the next goes 4 x 200 µs
    after its answer, not 8 ms after the last question."""
    settings = DriverSettings.from_mapping({"cubic_measure_rtt": True})
    pair = Pair(shm, receiver_uri=URI + "|cc=cubic", settings_=settings)
    pair.delay_ns = 1 * MS
    pair.run_until(20 * MS)  # the image joins (SETUP) and measures the long round trip
    cc = pair.image.congestion_control
    assert isinstance(cc, CubicCongestionControl)
    assert (cc.rtt_ns, cc.rtt_timeout_ns) == (2 * MS, 8 * MS)
    pair.delay_ns = 100 * US
    pair.run_until(40 * MS)
    assert (cc.rtt_ns, cc.rtt_timeout_ns) == (200 * US, 800 * US)
    asked = [t for t, f in pair.frames("r2p", Rttm) if t > 20 * MS]
    gaps = {later - earlier for earlier, later in itertools.pairwise(asked)}
    assert len(asked) > 10 and gaps == {200 * US + 800 * US + 1}, asked


def test_the_static_window_stays_the_default(shm: Path) -> None:
    pair = Pair(shm)
    pair.run_until(1 * MS)
    assert pair.image.congestion_control.name == "static"
    assert attrs.fields(SubscriptionParams).congestion_control.default is attrs.NOTHING


def test_multicast_receivers_measure_their_round_trip_too() -> None:
    """A multicast receiver's socket is bound to the group: the sender's echo of its RTTM goes
    to the group (each receiver takes its own receiver_id's), not to the receiver's source
    address, where nothing listens.  Each measures the link's 2 x 5 ms; before, the echoes
    were dropped and the window ran on the initial 100 µs."""
    scenario = Scenario(hosts=3, messages=3000, faults=LinkFaults(delay_ms=5),
                        channel_params="cc=cubic|fc=min,g:/2")
    assert "endpoint=224." in scenario.channel_uri(1)  # a multicast group
    with Simulation(scenario) as sim:
        report = sim.run()
        rtts = []
        for subscriber in sim.subscribers:
            [entry] = subscriber.driver.network._receive_endpoints.values()
            for image_entry in entry.images.values():
                cc = image_entry.image.congestion_control
                assert isinstance(cc, CubicCongestionControl)
                rtts.append(cc.rtt_ns)
    assert report.exactly_once_in_order and report.network.get("drop-unbound", 0) == 0
    assert len(rtts) == 2 and all(10 * MS <= rtt < 12 * MS for rtt in rtts), rtts
