"""A legitimate stream for the hostile-network tests, and the attacker's commands.

:class:`LegitStream` runs a publisher and a subscriber in processes of their own (forked,
so that the test's own process, running the attacker's commands, takes nothing from them):
1 KiB messages, each carrying its sequence number, offered at a steady rate with the first
program's loop; the subscriber checks every message exactly once and in order, counts what
was not the publisher's (forged), and samples the driver heartbeat's age as its client sees
it.  :func:`attack` runs one of sim/real/attacker.py's attacks inside a host and returns its
summary.
"""

from __future__ import annotations

import json
import multiprocessing
import struct
import sys
import time
from typing import Any

import attrs

SIZE = 1024
MAGIC = b"LEGIT"
_HEADER = struct.Struct("<5sq")


@attrs.frozen
class StreamReport:
    """What the subscriber saw: ``received`` in order, ``duplicates``, ``out_of_order``,
    ``forged`` (messages that were not the publisher's), the publisher's ``offered`` and
    ``not_connected`` offers, the highest driver heartbeat age seen by each side (s) and when
    (monotonic s), and the messages delivered per 100 ms."""

    offered: int
    not_connected: int
    #: When the first and the last of them came (monotonic s; 0.0 without any).
    not_connected_s: tuple[float, float]
    received: int
    duplicates: int
    out_of_order: int
    forged: int
    subscriber_heartbeat_age_s: float
    publisher_heartbeat_age_s: float
    subscriber_heartbeat_seen_s: float
    publisher_heartbeat_seen_s: float
    buckets: list[int]
    #: How long before the publisher began the subscriber began counting (s).
    lead_s: float

    def rate(self, start_s: float, end_s: float) -> float:
        """Messages a second delivered between ``start_s`` and ``end_s`` after the
        publisher began (whole 100 ms buckets)."""
        start_s, end_s = start_s + self.lead_s, end_s + self.lead_s
        i0, i1 = int(start_s * 10) + 1, int(end_s * 10) - 1
        return (self.buckets[i1] - self.buckets[i0]) / ((i1 - i0) / 10)

    def longest_stall_s(self, start_s: float, end_s: float) -> float:
        """The longest time between ``start_s`` and ``end_s`` after the publisher began in
        which no message was delivered (s, in whole 100 ms buckets; a stream that flows shows
        0.1).  A bucket the subscriber's loop did not reach counts as no delivery."""
        return self.longest_stall(start_s, end_s)[0]

    def heartbeat_ages_less_cpu_waits(self, waits: Any, publisher_conductor: Any,
                                      subscriber_conductor: Any) -> tuple[float, float]:
        """The highest heartbeat age each side saw (publisher, subscriber; s), less the time
        its driver's conductor (``*_conductor``: a helpers.CpuWaits thread) waited for a CPU
        while it grew (``waits``)."""
        return tuple(  # type: ignore[return-value]
            age - waits.within([conductor], seen - age, seen)
            for age, seen, conductor in (
                (self.publisher_heartbeat_age_s, self.publisher_heartbeat_seen_s,
                 publisher_conductor),
                (self.subscriber_heartbeat_age_s, self.subscriber_heartbeat_seen_s,
                 subscriber_conductor)))

    def longest_stall(self, start_s: float, end_s: float) -> tuple[float, float]:
        """:meth:`longest_stall_s`, and when it began (s after the publisher began)."""
        i0, i1 = int((start_s + self.lead_s) * 10), int((end_s + self.lead_s) * 10)
        longest, at, last_index, last_count = 0, i0, i0, self.buckets[i0]
        for index in range(i0 + 1, i1 + 1):
            if self.buckets[index] > last_count:
                if index - last_index > longest:
                    longest, at = index - last_index, last_index
                last_index, last_count = index, self.buckets[index]
        if i1 - last_index > longest:
            longest, at = i1 - last_index, last_index
        return longest / 10, at / 10 - self.lead_s


def _publisher(directory: str, channel: str, stream_id: int, rate: float, seconds: float,
               out: Any, ready: Any, go: Any) -> None:
    from slipstream.client import Client
    from slipstream.client.publication import NOT_CONNECTED

    with Client.connect(directory) as client:
        publication = client.add_publication(channel, stream_id)
        deadline = time.monotonic() + 30
        while not publication.is_connected and time.monotonic() < deadline:
            time.sleep(0.01)
        ready.set()
        go.wait(60)
        start = time.monotonic()
        sent = not_connected = 0
        worst, worst_at = 0.0, 0.0
        message = bytearray(SIZE)
        while (now := time.monotonic()) - start < seconds:
            due = start + sent / rate
            if due > now:
                time.sleep(min(due - now, 0.001))
                beat = client.counters.driver_heartbeat_ns
                age = (time.time_ns() - beat) / 1e9 if beat else 0.0
                if age > worst:
                    worst, worst_at = age, time.monotonic()
                continue
            _HEADER.pack_into(message, 0, MAGIC, sent)
            result = publication.offer(message)
            if result > 0:
                sent += 1
            elif result == NOT_CONNECTED:
                not_connected += 1
                out[5] = int(now * 1e6)
                if not out[4]:
                    out[4] = out[5]
                time.sleep(0.0005)
        out[0], out[1] = sent, not_connected
        out[2], out[3] = int(worst * 1e6), int(worst_at * 1e6)
        # Kept open a while: the receiver may still need retransmissions.
        time.sleep(2.0)


def _subscriber(directory: str, channel: str, stream_id: int, out: Any, buckets: Any,
                ready: Any, stop: Any) -> None:
    from slipstream.client import Client

    with Client.connect(directory) as client:
        subscription = client.add_subscription(channel, stream_id)
        state = {"next": 0, "received": 0, "duplicates": 0, "out_of_order": 0, "forged": 0}
        seen: set[int] = set()

        def handler(data: memoryview, header: object) -> None:
            if len(data) != SIZE or bytes(data[:5]) != MAGIC:
                state["forged"] += 1
                return
            sequence = _HEADER.unpack_from(data)[1]
            if sequence in seen:
                state["duplicates"] += 1
                return
            seen.add(sequence)
            if sequence != state["next"]:
                state["out_of_order"] += 1
            state["next"] = sequence + 1
            state["received"] += 1

        ready.set()
        start = time.monotonic()
        out[5] = time.monotonic_ns()
        worst, worst_at = 0.0, 0.0
        while not stop.is_set():
            subscription.poll(handler, 256)
            now = time.monotonic()
            index = int((now - start) * 10)
            if index < len(buckets):
                buckets[index] = state["received"]
            out[0] = state["received"]
            beat = client.counters.driver_heartbeat_ns
            age = (time.time_ns() - beat) / 1e9 if beat else 0.0
            if age > worst:
                worst, worst_at = age, time.monotonic()
            time.sleep(0.0002)
        out[0], out[1], out[2], out[3] = (state["received"], state["duplicates"],
                                          state["out_of_order"], state["forged"])
        out[4], out[6] = int(worst * 1e6), int(worst_at * 1e6)


class LegitStream:
    """A stream of ``rate`` 1 KiB messages a second for ``seconds`` from the driver in
    ``publisher_dir`` (``channel``) to the one in ``subscriber_dir`` (``subscription``),
    started by :meth:`start` and read by :meth:`report`; the subscriber keeps reading
    ``drain_s`` after the publisher's last offer."""

    def __init__(self, publisher_dir: str, channel: str, subscriber_dir: str,
                 subscription: str, stream_id: int, *, rate: float = 2000,
                 seconds: float = 10.0, drain_s: float = 4.0) -> None:
        ctx = multiprocessing.get_context("fork")
        self._pub_out = ctx.Array("q", 6)
        self._sub_out = ctx.Array("q", 7)
        self._buckets = ctx.Array("q", int((seconds + drain_s + 30) * 10))
        sub_ready, self._pub_ready, self._go = ctx.Event(), ctx.Event(), ctx.Event()
        self._stop = ctx.Event()
        self._subscriber = ctx.Process(target=_subscriber, args=(
            subscriber_dir, subscription, stream_id, self._sub_out, self._buckets, sub_ready,
            self._stop), daemon=True)
        self._publisher = ctx.Process(target=_publisher, args=(
            publisher_dir, channel, stream_id, rate, seconds, self._pub_out, self._pub_ready,
            self._go), daemon=True)
        self._subscriber.start()
        if not sub_ready.wait(30):
            raise AssertionError("the subscriber did not start")
        self._publisher.start()
        if not self._pub_ready.wait(40):
            raise AssertionError("the publisher did not start")
        self.seconds = seconds
        self.drain_s = drain_s
        self._began_ns = 0

    def start(self) -> float:
        """The publisher (connected, or given up on after 30 s) begins; returns when, on the
    monotonic clock."""
        self._began_ns = time.monotonic_ns()
        self._go.set()
        return self._began_ns / 1e9

    def report(self, timeout: float = 120.0) -> StreamReport:
        """Once the publisher is done, the subscriber reads until it has every message offered
        or ``drain_s`` passed; what both saw."""
        self._publisher.join(timeout)
        deadline = time.monotonic() + self.drain_s
        while self._sub_out[0] < self._pub_out[0] and time.monotonic() < deadline:
            time.sleep(0.05)
        self._stop.set()
        self._subscriber.join(timeout)
        for process in (self._publisher, self._subscriber):
            if process.is_alive():
                process.kill()
                raise AssertionError("a client of the legitimate stream hung")
            if process.exitcode != 0:
                raise AssertionError(f"a client of the legitimate stream failed with "
                                     f"{process.exitcode} (its driver lost?)")
        return StreamReport(
            offered=self._pub_out[0], not_connected=self._pub_out[1],
            not_connected_s=(self._pub_out[4] / 1e6, self._pub_out[5] / 1e6),
            received=self._sub_out[0], duplicates=self._sub_out[1],
            out_of_order=self._sub_out[2], forged=self._sub_out[3],
            subscriber_heartbeat_age_s=self._sub_out[4] / 1e6,
            publisher_heartbeat_age_s=self._pub_out[2] / 1e6,
            subscriber_heartbeat_seen_s=self._sub_out[6] / 1e6,
            publisher_heartbeat_seen_s=self._pub_out[3] / 1e6,
            buckets=list(self._buckets), lead_s=(self._began_ns - self._sub_out[5]) / 1e9)


def attack(host: Any, name: str, timeout: float = 120.0, **args: Any) -> dict[str, Any]:
    """Run attack ``name`` of sim/real/attacker.py inside ``host``; its summary."""
    result = host.run(sys.executable, "-m", "slipstream.sim.real.attacker", name,
                      json.dumps(args), timeout=timeout)
    return json.loads(result.stdout.strip().splitlines()[-1])


def start_attack(host: Any, name: str, **args: Any) -> Any:
    """Start attack ``name`` inside ``host`` and return its process (``communicate()`` for
    its summary)."""
    import subprocess

    return host.popen(sys.executable, "-m", "slipstream.sim.real.attacker", name,
                      json.dumps(args), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
