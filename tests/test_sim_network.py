"""Properties of the simulator's virtual network (sim/network.py, sim/events.py).

Each test fixes a seed, so the numbers are reproducible; the tolerances say what the model
promises statistically (they would hold for most seeds too).
"""

from __future__ import annotations

import itertools
import random

import pytest

from slipstream.sim.events import EventLoop
from slipstream.sim.network import LinkFaults, Network, Partition

A, B, C, D = "10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.4"
PORT = 40123
MS = 1_000_000


def make_network(seed: int = 1, faults: LinkFaults | None = None, hosts=(A, B),
                 keep_trace: bool = False):
    loop = EventLoop()
    net = Network(loop, random.Random(seed), default_faults=faults, keep_trace=keep_trace)
    arrivals: dict[str, list[tuple[int, bytes]]] = {}
    for ip in hosts:
        net.add_host(ip)
        got = arrivals.setdefault(ip, [])
        net.bind((ip, PORT), lambda data, src, now, got=got: got.append((now, data)))
    return loop, net, arrivals


def send_many(loop: EventLoop, net: Network, count: int, *, interval_ns: int = 0,
              size: int = 100, dst: str = B, src: str = A) -> None:
    for i in range(count):
        payload = i.to_bytes(4, "little") + bytes(size - 4)
        loop.call_at(i * interval_ns,
                     lambda p=payload: net.send((src, 5000), (dst, PORT), p))
    loop.run(until_ns=10**12)


def seqs(arrivals: list[tuple[int, bytes]]) -> list[int]:
    return [int.from_bytes(data[:4], "little") for _, data in arrivals]


def test_random_loss_rate_within_tolerance():
    loop, net, got = make_network(faults=LinkFaults(loss=0.1))
    send_many(loop, net, 20_000)
    rate = 1 - len(got[B]) / 20_000
    assert 0.09 < rate < 0.11
    assert net.link(A, B).stats.lost == 20_000 - len(got[B])
    assert net.counts["drop-loss"] == net.link(A, B).stats.lost


def test_gilbert_elliott_loss_is_bursty():
    p, r = 0.02, 0.25
    loop, net, got = make_network(faults=LinkFaults(burst=(p, r)))
    send_many(loop, net, 40_000)
    received = set(seqs(got[B]))
    lost = [i not in received for i in range(40_000)]
    rate = sum(lost) / len(lost)
    assert rate == pytest.approx(p / (p + r), rel=0.15)
    bursts, run = [], 0
    for x in lost:
        if x:
            run += 1
        elif run:
            bursts.append(run)
            run = 0
    mean_burst = sum(bursts) / len(bursts)
    assert mean_burst == pytest.approx(1 / r, rel=0.15)  # independent loss would give ~1.08

    # The same average rate as independent loss has far shorter runs.
    loop2, net2, got2 = make_network(faults=LinkFaults(loss=rate))
    send_many(loop2, net2, 40_000)
    received2 = set(seqs(got2[B]))
    runs2, run = [], 0
    for i in range(40_000):
        if i not in received2:
            run += 1
        elif run:
            runs2.append(run)
            run = 0
    assert sum(runs2) / len(runs2) < 1.2 < mean_burst


def test_bandwidth_serialises_and_tail_drops():
    # 8 Mbit/s = 1 byte per µs: a 1000-byte datagram takes 1 ms on the wire.
    loop, net, got = make_network(faults=LinkFaults(rate_mbit=8, queue_bytes=20_000))
    send_many(loop, net, 100, size=1000)
    times = [t for t, _ in got[B]]
    assert len(times) == 20  # 20 fit the queue (incl. the one on the wire), 80 tail-dropped
    assert net.link(A, B).stats.queue_dropped == 80
    assert times == [(i + 1) * MS for i in range(20)]
    assert net.link(A, B).stats.max_queue_bytes <= 20_000


def test_bandwidth_without_overload_only_delays():
    loop, net, got = make_network(faults=LinkFaults(rate_mbit=8, delay_ms=2,
                                                    queue_bytes=4_000))
    send_many(loop, net, 50, size=1000, interval_ns=2 * MS)  # half the link rate
    assert [t for t, _ in got[B]] == [i * 2 * MS + 3 * MS for i in range(50)]


def test_partition_drops_both_ways_then_heals():
    loop, net, got = make_network(hosts=(A, B, C))
    net.add_partition(Partition(10 * MS, 20 * MS, frozenset({A})))
    for t in range(0, 30, 1):
        loop.call_at(t * MS, lambda t=t: net.send((A, 1), (B, PORT), bytes([t])))
        loop.call_at(t * MS, lambda t=t: net.send((B, 1), (A, PORT), bytes([t])))
        loop.call_at(t * MS, lambda t=t: net.send((B, 1), (C, PORT), bytes([t])))
    loop.run(until_ns=10**10)
    assert [d[0] for _, d in got[B]] == [*range(10), *range(20, 30)]
    assert [d[0] for _, d in got[A]] == [*range(10), *range(20, 30)]
    assert [d[0] for _, d in got[C]] == list(range(30))  # B-C is on the same side
    assert net.counts["drop-partition"] == 20


def test_multicast_fans_out_over_independent_links():
    group = ("224.0.1.1", 40456)
    loop = EventLoop()
    net = Network(loop, random.Random(3))
    got: dict[str, list[bytes]] = {}
    for ip in (A, B, C, D):
        net.add_host(ip)
        got[ip] = []
        net.join(group, ip, lambda data, src, now, ip=ip: got[ip].append(data))
    net.set_faults(A, C, LinkFaults(loss=0.5))
    net.set_faults(A, D, LinkFaults(delay_ms=5))
    for i in range(1000):
        loop.call_at(i * MS, lambda i=i: net.send((A, 7), group, i.to_bytes(2, "little")))
    loop.run(until_ns=10**12)
    assert got[A] == []  # the sender does not hear itself
    assert len(got[B]) == 1000 and len(got[D]) == 1000
    assert 420 < len(got[C]) < 580
    net.leave(group, B)
    net.send((A, 7), group, b"x")
    loop.run(until_ns=10**12)
    assert len(got[B]) == 1000


def test_crashed_host_drops_in_and_out():
    loop, net, got = make_network()
    net.set_up(B, False)
    net.send((A, 1), (B, PORT), b"to-b")
    net.send((B, 1), (A, PORT), b"from-b")
    loop.run(until_ns=10**9)
    assert got[A] == [] and got[B] == []
    assert net.counts["drop-down"] == 2
    net.set_up(B, True)
    net.send((A, 1), (B, PORT), b"to-b")
    loop.run(until_ns=10**9)
    assert [d for _, d in got[B]] == [b"to-b"]


def test_in_flight_datagram_to_a_host_that_crashes_is_dropped():
    loop, net, got = make_network(faults=LinkFaults(delay_ms=10))
    net.send((A, 1), (B, PORT), b"x")
    loop.call_at(5 * MS, lambda: net.set_up(B, False))
    loop.run(until_ns=10**9)
    assert got[B] == [] and net.counts["drop-down"] == 1


def test_duplication_reordering_and_jitter():
    loop, net, got = make_network(faults=LinkFaults(duplicate=0.1, reorder=0.1, delay_ms=1,
                                                    jitter_ms=0.2))
    send_many(loop, net, 5000, interval_ns=MS)
    received = seqs(got[B])
    assert 5300 < len(received) < 5700  # ~10% duplicates
    assert len(set(received)) == 5000
    inversions = sum(1 for x, y in itertools.pairwise(received) if y < x)
    assert inversions > 100  # a 0-5 ms extra delay overtakes the next few datagrams
    delays = [t - seq * MS for (t, _), seq in zip(got[B], received, strict=True)]
    assert min(delays) >= int(0.8 * MS)


def _random_traffic_digest(seed: int, keep_trace: bool = False) -> tuple[str, Network]:
    faults = LinkFaults(loss=0.05, burst=(0.01, 0.3), delay_ms=1, jitter_ms=0.5, reorder=0.05,
                        duplicate=0.02, rate_mbit=100, queue_bytes=30_000)
    loop, net, _ = make_network(seed=seed, faults=faults, hosts=(A, B, C),
                                keep_trace=keep_trace)
    traffic = random.Random(99)  # the traffic is the same for all seeds
    for i in range(3000):
        src, dst = traffic.sample([A, B, C], 2)
        size = traffic.randrange(32, 1400)
        loop.call_at(traffic.randrange(0, 500 * MS),
                     lambda s=src, d=dst, i=i, n=size: net.send((s, 1), (d, PORT),
                                                                i.to_bytes(4, "little")
                                                                + bytes(n)))
    loop.run(until_ns=10**12)
    return net.trace_digest(), net


def test_same_seed_same_trace_byte_for_byte():
    d1, n1 = _random_traffic_digest(42, keep_trace=True)
    d2, n2 = _random_traffic_digest(42, keep_trace=True)
    assert d1 == d2
    assert n1.trace_text() == n2.trace_text()
    assert {"deliver", "drop-loss", "drop-burst"} <= set(n1.counts)
    d3, _ = _random_traffic_digest(43)
    assert d3 != d1


def test_bad_faults_are_rejected_with_the_name():
    with pytest.raises(ValueError, match="loss"):
        LinkFaults(loss=1.5)
    with pytest.raises(ValueError, match="burst"):
        LinkFaults(burst=(0.1, 0.0))
    with pytest.raises(ValueError, match="delay_ms"):
        LinkFaults(delay_ms=-1)


@pytest.mark.parametrize("queue_bytes", [1.5, 1048576.0, True, -1])
def test_queue_bytes_must_be_a_whole_number_of_bytes(queue_bytes):
    with pytest.raises(ValueError, match="queue_bytes must be an integer"):
        LinkFaults(queue_bytes=queue_bytes)
    assert LinkFaults(queue_bytes=0).queue_bytes == 0


def test_event_loop_orders_by_time_phase_and_sequence():
    loop = EventLoop()
    out = []
    loop.call_at(5, lambda: out.append("b"), phase=1)
    loop.call_at(5, lambda: out.append("a"), phase=0)
    loop.call_at(5, lambda: out.append("c"), phase=1)
    t = loop.call_at(3, lambda: out.append("never"))
    loop.call_at(1, lambda: out.append("first"))
    t.cancel()
    assert not loop.run(until_ns=4)
    assert out == ["first"] and loop.now_ns == 4
    loop.run(until_ns=100)
    assert out == ["first", "a", "b", "c"]
