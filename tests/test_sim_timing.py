"""Protocol timings in the simulator against docs/DRIVER.md §3-§4 and Aeron's packet captures.

The captures (tests/data/aeron-captures/*.jsonl, ``t_ms`` per datagram) come from the C media
driver on loopback; its agents run duty cycles, so its intervals carry ~1 ms of scheduling
noise.  The simulator runs the timers exactly, so it must match the nominal value exactly and
the captures' median within that noise.
"""

from __future__ import annotations

import itertools
import json
import statistics
from pathlib import Path

import pytest

from slipstream.client.layout import DATA_HEADER, HDR_TYPE_DATA, HEADER_LENGTH
from slipstream.sim.capture import Capture
from slipstream.sim.network import LinkFaults
from slipstream.sim.runner import Simulation
from slipstream.sim.scenario import Event, Scenario

MS = 1_000_000
US = 1_000
FRAME = 1056
PUB, SUB1, SUB2 = "10.0.0.1", "10.0.0.2", "10.0.0.3"
CAPTURES = Path(__file__).resolve().parent / "data" / "aeron-captures"
CAPTURE_NOISE_MS = 2.0


def load_capture(name: str) -> list[dict]:
    path = CAPTURES / f"{name}.jsonl"
    with path.open() as f:
        return [json.loads(line) for line in f][1:]  # the first line describes the capture


def capture_times(rows: list[dict], kind: str) -> list[float]:
    """t_ms of datagrams whose first frame is ``kind`` (HB = heartbeat)."""
    times = []
    for row in rows:
        frame = row["frames"][0]
        name = "HB" if frame.get("heartbeat") else frame["type"]
        if name == kind:
            times.append(row["t_ms"])
    return times


def deltas(times: list[float]) -> list[float]:
    return [b - a for a, b in itertools.pairwise(times)]


def idle_run(hosts: int = 2, until_ns: int = 2_050 * MS, messages: int = 1) -> Capture:
    """``messages`` messages, then an idle stream; no link delay (loopback-like)."""
    scenario = Scenario(hosts=hosts, messages=messages, faults=LinkFaults())
    with Simulation(scenario) as sim:
        capture = Capture().attach(sim.network)
        sim.run_until(until_ns, stop_when_complete=False)
    return capture


def drop_frame(index: int, times: int, *, to: str | None = None):
    counts: dict[int, int] = {}

    def drop(_now: int, source, destination, data: bytes) -> bool:
        if source[0] != PUB or len(data) < HEADER_LENGTH:
            return False
        length, _version, _flags, kind, offset, *_ = DATA_HEADER.unpack_from(data)
        if kind != HDR_TYPE_DATA or length == 0:  # not DATA, or a heartbeat
            return False
        if to is not None and destination[0] != to:
            return False
        if offset != index * FRAME:
            return False
        counts[offset] = counts.get(offset, 0) + 1
        return counts[offset] <= times

    return drop


@pytest.mark.parametrize("name", ["unicast", "loss", "mcast_lo_default"])
def test_idle_heartbeat_interval_is_100_ms(name):
    sim = deltas([r.t_ns / MS for r in idle_run().select("HB", src=PUB)])
    assert len(sim) >= 15 and set(sim) == {100.0}
    captured = statistics.median(deltas(capture_times(load_capture(name), "HB")))
    assert abs(captured - 100.0) <= CAPTURE_NOISE_MS


@pytest.mark.parametrize("name", ["unicast", "loss", "mcast_lo_default"])
def test_status_message_timeout_is_200_ms(name):
    capture = idle_run()
    sms = [r.t_ns / MS for r in capture.select("SM", src=SUB1)]
    assert set(deltas(sms[1:])) == {200.0}  # the first one answers SETUP, then every 200 ms
    captured = statistics.median(deltas(capture_times(load_capture(name), "SM")))
    assert abs(captured - 200.0) <= CAPTURE_NOISE_MS


@pytest.mark.parametrize("name", ["unicast", "mcast_lo_default"])
def test_first_status_message_answers_the_first_setup(name):
    capture = idle_run(hosts=3 if name.startswith("mcast") else 2, messages=0)
    setup = capture.select("SETUP", src=PUB)[0]
    first_sm = capture.select("SM", src=SUB1)[0]
    first_heartbeat = capture.select("HB", src=PUB)[0]
    # docs/DRIVER.md §4.2 and §3.1: the image sends its first SM at once; the sender's
    # first heartbeat follows the first SM at once.  (Aeron creates the image on its
    # conductor thread: 38-92 ms in the captures, still before the next SETUP would be due
    # at 100 ms.)
    assert first_sm.t_ns == setup.t_ns
    assert first_heartbeat.t_ns == first_sm.t_ns
    rows = load_capture(name)
    captured_setup = capture_times(rows, "SETUP")[0]
    captured_sm = capture_times(rows, "SM")[0]
    captured_heartbeat = capture_times(rows, "HB")[0]
    assert 0 < captured_sm - captured_setup < 100
    assert 0 <= captured_heartbeat - captured_sm < CAPTURE_NOISE_MS


def test_setup_repeats_every_100_ms_until_a_receiver_answers():
    scenario = Scenario(hosts=2, messages=1, initially_down=(2,),
                        events=(Event(350 * MS, "restart", hosts=(2,)),))
    with Simulation(scenario) as sim:
        capture = Capture().attach(sim.network)
        sim.run_until(1000 * MS, stop_when_complete=False)
    setups = [r.t_ns for r in capture.select("SETUP", delivered=None, src=PUB)]
    assert setups == [0, 100 * MS, 200 * MS, 300 * MS, 400 * MS]
    assert capture.select("SETUP")[0].t_ns == 400 * MS  # the first one the receiver hears
    assert capture.select("SM", src=SUB1)[0].t_ns == 400 * MS


def test_unicast_nak_delay_retry_and_immediate_retransmit():
    rows = load_capture("loss")
    with Simulation(Scenario(hosts=2, messages=10)) as sim:
        sim.network.filters.append(drop_frame(3, times=2))  # lose it and its first resend
        capture = Capture().attach(sim.network)
        report = sim.run()
    assert report.exactly_once_in_order
    exposed = min(r.t_ns for r in capture.select("DATA", src=PUB)
                  if r.term_offset > 3 * FRAME)
    naks = capture.select("NAK")
    resends = [r for r in capture.select("DATA", delivered=None, src=PUB)
               if r.term_offset == 3 * FRAME][1:]
    # nak_unicast_delay 100 µs after the gap shows, retries every 100 µs x 100 = 10 ms, and
    # the sender resends at once (retransmit_unicast_delay 0).
    assert naks[0].t_ns - exposed == 100 * US
    assert naks[1].t_ns - naks[0].t_ns == 10 * MS
    assert [r.t_ns for r in resends] == [n.t_ns for n in naks]
    assert len(naks) == 2 and (naks[0].term_offset, naks[0].length) == (3 * FRAME, FRAME)
    # Aeron: the NAK follows the exposing heartbeat well inside the first delay + one duty
    # cycle (not the 10 ms retry), and the retransmit follows the NAK at once.
    for i, row in enumerate(rows):
        if row["frames"][0]["type"] == "NAK":
            before = rows[i - 1]
            after = rows[i + 1]
            assert 0 < row["t_ms"] - before["t_ms"] < 5
            assert after["frames"][0]["type"] == "DATA"
            assert after["frames"][0]["term_offset"] == row["frames"][0]["term_offset"]
            assert 0 < after["t_ms"] - row["t_ms"] < CAPTURE_NOISE_MS


def test_retransmit_linger_ignores_repeated_naks_for_10_ms():
    # NAK retries every 3 ms (ratio 30) while the resend is lost twice: the sender answers
    # the first NAK, ignores the repeats for retransmit_unicast_linger (10 ms), then resends.
    scenario = Scenario(hosts=2, messages=10, faults=LinkFaults(delay_ms=1),
                        settings={"nak_unicast_retry_delay_ratio": 30,
                                  "retransmit_unicast_linger": "10ms"})
    with Simulation(scenario) as sim:
        sim.network.filters.append(drop_frame(3, times=2))
        capture = Capture().attach(sim.network)
        report = sim.run()
    assert report.exactly_once_in_order
    sends = [r.t_ns for r in capture.select("DATA", delivered=None, src=PUB)
             if r.term_offset == 3 * FRAME]
    naks = [r.t_ns for r in capture.select("NAK")]
    first_resend, second_resend = sends[1], sends[2]
    assert second_resend - first_resend >= 10 * MS
    ignored = [t for t in naks if first_resend < t < first_resend + 10 * MS]
    assert len(ignored) >= 2
    counters = report.counters[PUB]
    assert counters["NAK_MESSAGES_RECEIVED"] > counters["RETRANSMITS_SENT"]


def test_a_lost_retransmission_is_naked_again_after_the_measured_repair_time():
    """Over a 2 ms round trip, frames 3 and 6 are lost once (each repaired after one NAK:
    the receiver measures the repair time), then frame 20 is lost with its first resend.
    The second NAK for it comes after srtt + 4 rttvar of those repairs: after the round
    trip (the resend in flight is not outrun) and well before Aeron's fixed 10 ms."""
    scenario = Scenario(hosts=2, messages=30, faults=LinkFaults(delay_ms=1))
    with Simulation(scenario) as sim:
        for index, times in ((3, 1), (6, 1), (20, 2)):
            sim.network.filters.append(drop_frame(index, times=times))
        capture = Capture().attach(sim.network)
        report = sim.run()
    assert report.exactly_once_in_order
    naks = [r.t_ns for r in capture.select("NAK") if r.term_offset == 20 * FRAME]
    assert len(naks) == 2, naks
    assert 2 * MS < naks[1] - naks[0] < 10 * MS, naks
    assert report.counters[PUB]["RETRANSMITS_SENT"] == 4


def test_multicast_nak_delay_is_random_below_the_max_backoff():
    delays = []
    for seed in range(8):
        with Simulation(Scenario(hosts=3, messages=10, seed=seed)) as sim:
            sim.network.filters.append(drop_frame(3, times=1, to=SUB1))
            capture = Capture().attach(sim.network)
            report = sim.run()
        assert report.exactly_once_in_order
        exposed = min(r.t_ns for r in capture.select("DATA", src=PUB)
                      if r.dst[0] == SUB1 and r.term_offset > 3 * FRAME)
        nak = capture.select("NAK", src=SUB1)[0]
        delays.append(nak.t_ns - exposed)
    # nak_multicast_max_backoff 10 ms: the optimal-multicast-feedback delay lies in [0, 10 ms)
    assert all(0 <= d < 10 * MS for d in delays)
    assert len(set(delays)) == len(delays)


@pytest.mark.parametrize("rate", [3000, 7000])
def test_a_publish_rate_that_does_not_divide_a_second_paces_evenly(rate):
    # 1e9/rate is no whole number of ns: the publisher's timer must still let the next
    # message out on time (it fired a fraction of a ns early, found nothing due, and waited
    # for the 100 ms heartbeat: 7 messages, then nothing until ~102 ms, then a burst).
    scenario = Scenario(hosts=2, messages=3000, size=256, publish_rate=rate,
                        faults=LinkFaults(delay_ms=1.0))
    with Simulation(scenario) as sim:
        # From 10 ms: the first 2 ms (SETUP and SM over 1 ms links) are NOT_CONNECTED.
        for t_ms in (10, 33.3, 50, 100, 150, 250, 333.3):
            sim.run_until(int(t_ms * MS), stop_when_complete=False)
            offered = sim.publisher.next_seq  # one at t = 0, then one every 1e9/rate ns
            assert abs(offered - (1 + rate * t_ms / 1e3)) <= 1, (t_ms, offered)
        report = sim.run()
    assert report.exactly_once_in_order
    # The last message is offered at (messages - 1)/rate s and arrives 1 ms later.
    assert report.virtual_seconds == pytest.approx(2999 / rate + 0.001, abs=1e-4)
