"""The sender's priority bands (docs/BACKPRESSURE.md): deficit weighted round robin over five
bands with aging, in the C duty cycle (``ss_agent_do_work``), against a real socket that fills.

Publications share one AF_UNIX datagram socket, whose queue holds a few datagrams and stays
full until the test reads (a unix datagram socket pushes back on its sender, as a UDP socket's
send buffer does behind a bottleneck qdisc): what each band gets is the share of what the
socket takes.  The simulator runs the same sends behind a bandwidth-limited virtual link."""

from __future__ import annotations

import socket
import struct
from collections import Counter
from itertools import pairwise
from pathlib import Path

import pytest
from helpers import network_publication

from slipstream.client import control
from slipstream.client._native import lib as client_lib
from slipstream.client.channel import parse_channel
from slipstream.client.errors import ChannelError
from slipstream.client.logbuffer import LogBuffer, new_appender
from slipstream.daemon._network import ffi as network_ffi
from slipstream.daemon._network import lib as network
from slipstream.daemon.streams.publication import NetworkPublication
from slipstream.sim.network import LinkFaults
from slipstream.sim.runner import Simulation
from slipstream.sim.scenario import Scenario

TERM = 16 << 20  # half a term of data each: 8,128 datagrams
MESSAGE = 1_000
SESSION = struct.Struct("<i")


class Sender:
    """Publications with full logs and open windows, an ss_agent_t sending them, and the
    reading end of their shared socket."""

    def __init__(self, shm: Path, priorities: list[int], max_datagrams: int = 8) -> None:
        self.reader, writer = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
        writer.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        self._writer = writer
        self.publications = [self._publication(shm, 100 + i, priority, writer.fileno())
                             for i, priority in enumerate(priorities)]
        self.agent = agent = network_ffi.new("ss_agent_t *")
        agent.is_sender = 1
        agent.max_datagrams = max_datagrams
        agent.status_poll_ratio = 1 << 20
        self._spans = network_ffi.new("ss_span_t[]", max_datagrams + network.SS_RETRANSMIT_MAX)
        agent.spans = self._spans
        agent.python_deadline_ns = 1 << 62
        self._array = network_ffi.new("ss_send_publication_t *[]",
                                      [p.c for p in self.publications])
        agent.publications = self._array
        agent.publication_count = len(self.publications)

    @staticmethod
    def _publication(shm: Path, session_id: int, priority: int, fd: int) -> NetworkPublication:
        publication = network_publication(
            shm, f"aeron:udp?endpoint=10.0.0.2:40123|priority={priority}", ("10.0.0.2", 40123),
            term_length=TERM, initial_term_id=0, session_id=session_id, stream_id=1)
        network_ffi.cast("int64_t *", publication.c.sender_limit)[0] = 1 << 40
        positions = publication.positions
        appender = new_appender(publication.log, positions.publisher_limit)
        positions.publisher_limit[0] = 1 << 40
        from slipstream.client._native import lib

        for _ in range(TERM // 2 // (MESSAGE + 32)):  # half a term: plenty to send
            assert lib.ss_offer(appender, b"m" * MESSAGE, MESSAGE) > 0
        publication.c.fd = fd
        publication.c.gso = 0
        publication.c.destination_length = 0  # connected
        return publication

    def run(self, reads: int, now_ns: int = 1_000_000_000, step_ns: int = 0) -> list[int]:
        """Read ``reads`` datagrams, one at a time, running a duty cycle whenever the socket
        has room; returns their session ids in order."""
        sessions = []
        self.reader.setblocking(False)
        while len(sessions) < reads:
            network.ss_agent_do_work(self.agent, now_ns)
            now_ns += step_ns
            try:
                datagram = self.reader.recv(2048)
            except BlockingIOError:
                assert any(network.ss_has_data_ready(p.c) for p in self.publications), \
                    "nothing left to send"
                continue
            sessions.append(SESSION.unpack_from(datagram, 12)[0])
        return sessions

    def close(self) -> None:
        self.reader.close()
        self._writer.close()
        for publication in self.publications:
            publication.log.close()


@pytest.fixture
def sender_of(shm: Path):
    made: list[Sender] = []

    def make(priorities: list[int], **kwargs) -> Sender:
        made.append(Sender(shm, priorities, **kwargs))
        return made[-1]

    yield make
    for sender in made:
        sender.close()


def test_band_4_gets_eight_ninths_of_a_full_socket_against_band_1(sender_of) -> None:
    sender = sender_of([0, 800])  # band 1 first in the array: order gives it no edge
    sessions = Counter(sender.run(7_000)[1_000:])  # past the first rounds
    share = sessions[101] / (sessions[100] + sessions[101])
    assert abs(share - 8 / 9) < 8 / 9 * 0.10, sessions


def test_two_publications_of_one_band_share_a_full_socket_evenly(sender_of) -> None:
    # Served in array order instead, the first would take all the socket gives.
    sender = sender_of([100, 100])
    sessions = Counter(sender.run(4_000)[500:])
    assert abs(sessions[100] - sessions[101]) < 0.1 * sum(sessions.values()), sessions


@pytest.mark.parametrize(("priorities", "weights", "reads"), [
    ([800, 600, 300, 100, -100], [8, 4, 2, 1, 1], 12_000),
    ([-1000, 1000], [1, 8], 8_000),  # within what the top band's log holds
])
def test_every_band_gets_its_weight_and_the_lowest_is_served_every_round(
        sender_of, priorities: list[int], weights: list[int], reads: int) -> None:
    sender = sender_of(priorities)
    sessions = sender.run(reads)[2_000:]
    counts = Counter(sessions)
    total = sum(weights)
    for i, weight in enumerate(weights):
        share = counts[100 + i] / len(sessions)
        assert abs(share - weight / total) < weight / total * 0.15, (i, counts)
    # A round grants the lowest band 8 datagrams: it never waits longer than one round.
    lowest_session = 100 + len(weights) - 1  # the last publication: the lowest band
    lowest = [i for i, s in enumerate(sessions) if s == lowest_session]
    round_length = total * 8
    assert max(b - a for a, b in pairwise(lowest)) <= round_length + 8


def test_a_full_socket_does_not_hold_back_a_publication_on_another_socket(
        sender_of, shm: Path) -> None:
    # Two publications share a bottlenecked socket (drained one datagram per cycle); a third,
    # in band 1, has a socket of its own with room.  The bands divide a socket's capacity:
    # the third sends at its own socket's pace, not at its band's share of the other's.
    sender = sender_of([800, 0])
    reader, writer = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    writer.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
    reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
    roomy = sender._publication(shm, 200, 0, writer.fileno())
    try:
        publications = [p.c for p in sender.publications] + [roomy.c]
        array = network_ffi.new("ss_send_publication_t *[]", publications)
        sender.agent.publications = array
        sender.agent.publication_count = len(publications)
        reader.setblocking(False)
        cycles, roomy_datagrams = 200, 0
        shared = sender.run(cycles)  # one datagram read from the shared socket per cycle
        while True:
            try:
                reader.recv(2048)
            except BlockingIOError:
                break
            roomy_datagrams += 1
        # A round of the shared socket lasts (8 + 1) x 8 of its datagrams: held to it, the
        # third would have sent 8 per round, about 24 here.  On its own it gets its band's
        # grant every cycle.
        assert roomy_datagrams >= 8 * cycles // 2, (roomy_datagrams, Counter(shared))
        share = Counter(shared[50:])[100] / len(shared[50:])  # session 100: priority 800
        assert abs(share - 8 / 9) < 8 / 9 * 0.15, Counter(shared)  # the bands still hold there
    finally:
        reader.close()
        writer.close()
        roomy.log.close()


def test_publications_of_one_band_share_its_turns_evenly_among_other_bands(sender_of) -> None:
    # Two band-1 publications among eight of band 4: a band's next turn starts after the
    # publication it served last (counting from where its last turn began, the first of the
    # two took 9 turns in 10).
    # A socket with room, emptied after each cycle: every visit ends with room to spare.
    sender = sender_of([100, 100] + [800] * 8)
    sender._writer.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
    sender.reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
    sender.reader.setblocking(False)
    counts: Counter[int] = Counter()
    for cycle in range(60):
        network.ss_agent_do_work(sender.agent, 1_000_000_000 + cycle)
        while True:
            try:
                counts[SESSION.unpack_from(sender.reader.recv(2048), 12)[0]] += 1
            except BlockingIOError:
                break
    assert counts[100] + counts[101] >= 60 * 8
    assert abs(counts[100] - counts[101]) < 0.2 * (counts[100] + counts[101]), counts
    band_4 = [counts[s] for s in range(102, 110)]
    assert max(band_4) - min(band_4) < 0.2 * max(band_4), counts


def test_a_publication_that_sends_nothing_does_not_stop_the_round(sender_of) -> None:
    # Band 4's publication waits for its rate bucket and sent into a full socket before: the
    # round must go on to band 1, whose socket (the same, now with room) takes its data.
    sender = sender_of([800, 0])
    sender._writer.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
    paced = sender.publications[0].c
    now_ns = 1_000_000_000
    paced.rate_limit, paced.rate_burst = 1_000, 1_000_000  # an empty bucket that fills slowly
    paced.rate_credit, paced.rate_time_ns = 0, now_ns
    paced.socket_full = 1  # what its last send found
    for cycle in range(3):
        network.ss_agent_do_work(sender.agent, now_ns + cycle)
    assert sender.publications[1].c.sender_position[0] > 0
    assert paced.sender_position[0] == 0


def test_aging_lifts_a_publication_that_waits_into_a_higher_band(sender_of) -> None:
    sender = sender_of([-1000, 800])
    low = sender.publications[0].c
    assert network.ss_band_of(low, 0) == 0
    low.waiting_since_ns = 1_000_000_000
    # +100 a second waited, at most +1000: after 10 s a -1000 publication is at 0 (band 1),
    # and a 0 one would be at the top band.
    assert network.ss_band_of(low, 1_000_000_000 + 5_000_000_000) == 0
    assert network.ss_band_of(low, 1_000_000_000 + 10_000_000_000) == 1
    assert network.ss_band_of(low, 1_000_000_000 + 60_000_000_000) == 1
    low.priority = 0
    assert network.ss_band_of(low, 1_000_000_000 + 7_500_000_000) == 4


def test_an_uncontended_socket_sends_every_band_all_it_has(sender_of) -> None:
    sender = sender_of([-500, 0, 900])
    sender._writer.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
    network.ss_agent_do_work(sender.agent, 1_000_000_000)
    # One cycle: each band's grant is at least max_datagrams, so nobody waits for a round.
    sent = [p.c.sender_position[0] for p in sender.publications]
    assert all(position >= 8 * (MESSAGE + 32) for position in sent), sent


def test_priority_is_a_network_publications_and_in_range() -> None:
    assert parse_channel("aeron:udp?endpoint=h:1|priority=-1000").priority == -1000
    with pytest.raises(ChannelError) as info:
        parse_channel("aeron:udp?endpoint=h:1|priority=1001")
    assert info.value.part == "priority"
    with pytest.raises(ChannelError) as info:
        parse_channel("aeron:ipc?priority=5")
    assert info.value.part == "priority" and "aeron:udp only" in str(info.value)


# -- in the simulator ----------------------------------------------------------------------------

def test_in_the_simulator_band_4_takes_eight_ninths_of_a_bottleneck_link() -> None:
    """The simulator runs the same C sends (``ss_send_virtual``): two publications of host 1
    share its send "socket", whose room is a send buffer that a 100 Mbit/s link drains; host 2's
    subscriber host reads both streams as fast as it can.  Band 4 (priority=800) gets 8/9 of
    the link against band 1 (priority=0), with nothing lost."""
    scenario = Scenario(hosts=2, messages=0, faults=LinkFaults(rate_mbit=100),
                        settings={"socket_so_sndbuf": "64k", "rcv_initial_window_length": "2m",
                                  "socket_so_rcvbuf": "4m"})
    with Simulation(scenario) as sim:
        sim.run_until(1_000_000, stop_when_complete=False)  # both hosts up
        uri = scenario.channel_uri(1)
        receiver = sim.subscribers[0]
        appenders = []
        sessions = []
        for stream_id in (2001, 2002):  # subscribed before the publications' SETUPs come
            receiver.driver.command({"type": control.ADD_SUBSCRIPTION, "channel": uri,
                                     "stream_id": stream_id})
        receiver.wake()
        sim.run_until(2_000_000, stop_when_complete=False)
        for stream_id, priority in ((2001, 0), (2002, 800)):
            reply = sim.publisher.driver.command({
                "type": control.ADD_PUBLICATION, "channel": f"{uri}|priority={priority}",
                "stream_id": stream_id})
            log = LogBuffer(reply["log_file"])
            limit = sim.publisher.driver.counters.address(reply["publication_limit_counter_id"])
            appenders.append((log, new_appender(log, limit)))
            sessions.append(reply["session_id"])
        message = b"s" * 1000
        now = sim.loop.now_ns
        step = 1_000_000
        consumed: dict[int, list[int]] = {s: [] for s in sessions}
        for _ in range(3_000):  # 3 s of virtual time, offering all they can every 1 ms
            for _log, appender in appenders:
                while client_lib.ss_offer(appender, message, len(message)) > 0:
                    pass
            sim.publisher.wake()
            now += step
            sim.run_until(now, stop_when_complete=False)
            for session in sessions:
                entry = receiver.readers.get(session)
                consumed[session].append(entry[1].position if entry is not None else 0)
        for log, _appender in appenders:
            log.close()
        # The last two virtual seconds: what each stream's subscriber took.
        low, high = (consumed[s][-1] - consumed[s][1_000] for s in sessions)
        assert low > 0 and abs(high / (low + high) - 8 / 9) < 8 / 9 * 0.10, (low, high)
        assert (low + high) / 2 > 0.8 * 100e6 / 8  # the link was used
        # Band 1 was served every round: it never went 100 ms without progress.
        positions = consumed[sessions[0]][1_000:]
        assert all(b > a for a, b in zip(positions[::100], positions[100::100], strict=False))


def _two_bands(sim: Simulation, scenario: Scenario) -> list[tuple[LogBuffer, object, int]]:
    """Streams 2001 (priority -500, the lowest band) and 2002 (800, band 4) from the
    simulation's publisher to its subscriber, connected: (log, appender, session id) each."""
    sim.run_until(1_000_000, stop_when_complete=False)
    uri = scenario.channel_uri(1)
    receiver = sim.subscribers[0]
    for stream_id in (2001, 2002):
        receiver.driver.command({"type": control.ADD_SUBSCRIPTION, "channel": uri,
                                 "stream_id": stream_id})
    receiver.wake()
    sim.run_until(2_000_000, stop_when_complete=False)
    streams = []
    for stream_id, priority in ((2001, -500), (2002, 800)):
        reply = sim.publisher.driver.command({
            "type": control.ADD_PUBLICATION, "channel": f"{uri}|priority={priority}",
            "stream_id": stream_id})
        log = LogBuffer(reply["log_file"])
        limit = sim.publisher.driver.counters.address(reply["publication_limit_counter_id"])
        streams.append((log, new_appender(log, limit), reply["session_id"]))
    sim.run_until(300_000_000, stop_when_complete=False)  # both connected
    return streams


def test_in_the_simulator_a_deferred_band_waits_without_stalling_the_clock() -> None:
    """At the governor's step 3 the lowest band's new data waits in its log: the simulator's
    clock moves on past it (it is not due at any time), and the other bands go on."""
    scenario = Scenario(hosts=2, messages=0, faults=LinkFaults(rate_mbit=100),
                        settings={"rcv_initial_window_length": "2m", "socket_so_rcvbuf": "4m"})
    with Simulation(scenario) as sim:
        streams = _two_bands(sim, scenario)
        appenders = [(log, appender) for log, appender, _ in streams]
        sessions = [session for _, _, session in streams]
        receiver = sim.subscribers[0]
        sim.publisher.driver.network.sender.set_pressure_step(3)
        message = b"d" * 1000
        for _log, appender in appenders:
            for _ in range(100):
                assert client_lib.ss_offer(appender, message, len(message)) > 0
        sim.publisher.wake()
        sim.run_until(350_000_000, stop_when_complete=False)  # raised SimulationStuck before
        positions = [receiver.readers[s][1].position if s in receiver.readers else 0
                     for s in sessions]
        for log, _appender in appenders:
            log.close()
        assert positions[1] >= 100 * 1032 and positions[0] == 0, positions


def test_in_the_simulator_the_lowest_band_refuses_offers_at_step_4_and_takes_them_after() -> None:
    """At the governor's top step a publication of the lowest band takes no new offers: its
    pub-lmt stays where its producer is, though the sender's C half moves pub-lmt for a
    connected publication (not for one that refuses), while the other band's offers go on.
    Back at step 0 it takes offers again."""
    scenario = Scenario(hosts=2, messages=0, faults=LinkFaults(rate_mbit=100))
    with Simulation(scenario) as sim:
        streams = _two_bands(sim, scenario)
        logs = [log for log, _, _ in streams]
        appenders = [appender for _, appender, _ in streams]
        message = b"d" * 1000
        sender = sim.publisher.driver.network.sender
        try:
            sender.set_pressure_step(4)
            accepted = [0, 0]
            for step_ms in range(300, 400, 5):  # 100 ms of offers while the sender runs
                for i, appender in enumerate(appenders):
                    for _ in range(20):
                        accepted[i] += client_lib.ss_offer(appender, message, len(message)) > 0
                sim.publisher.wake()
                sim.run_until((step_ms + 5) * 1_000_000, stop_when_complete=False)
            assert accepted[0] == 0 and accepted[1] > 100, accepted
            sender.set_pressure_step(0)
            sim.publisher.wake()
            sim.run_until(410_000_000, stop_when_complete=False)
            assert client_lib.ss_offer(appenders[0], message, len(message)) > 0
        finally:
            for log in logs:
                log.close()
