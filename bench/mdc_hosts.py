"""Multi-destination-cast (MDC) 1:3 on namespace hosts: what one publisher moves to three
receivers by slipstream's dynamic MDC, against the same publisher to a 1:3 multicast group and
against Aeron 1.15.1's Java driver over dynamic MDC, measured in the same run on the same
hosts.  Needs root.

    sudo .venv/bin/python -m bench.mdc_hosts [--messages N] [--size BYTES] [--repeat R]
        [--set KEY=VALUE ...] [--only mdc,multicast,mdc-batch,multicast-batch,aeron,aeron-min]
        [--no-batch] [--no-aeron] [--aeron-threading SHARED|SHARED_NETWORK|DEDICATED]

Four namespace hosts on one bridge (sim/real/hosts.py; plain veths, no loss, no netem), a driver
in each: host 1 publishes, hosts 2-4 subscribe.  Each run starts its four drivers afresh (the
other contender's drivers are not running) with their default settings, and stops them after.

* **slipstream MDC**: host 1's publication on ``aeron:udp?control=<host 1>:P|
  control-mode=dynamic``; each receiver subscribes with ``endpoint=<its address>:Q|
  control=<host 1>:P`` and joins by its setup-eliciting status messages (docs/CHANNELS.md §7.4).
* **slipstream multicast**: the same publisher process on ``aeron:udp?endpoint=224.0.1.1:Q|
  interface=<host 1>``, each receiver on the group from its own interface: the peer of the
  target "MDC moves at least 0.8x what the same publisher moves to a multicast group".
* **Aeron 1.15.1 MDC** (the Java driver, SHARED threading unless ``--aeron-threading``, its
  default settings): its StreamingPublisher on the dynamic MDC channel, a RateSubscriber on
  each receiver host; the target is slipstream MDC at least 2x it.  Its default flow control
  for MDC is max (the fastest receiver's pace): a receiver that loses datagrams while the
  sender runs ahead may never be repaired (Aeron resends only within a term of the sender's
  position, and a receiver drops what lies past its window, so it may never see the gap; its
  image then times out and joins again at the live end), and such a run is not whole.  Then an
  upper bound of what it moved to all three stands in for it in the ratios (its fastest
  receiver that got everything, else its publisher's offer rate: the comparison favours
  Aeron), and **Aeron MDC fc min** (the same with ``MinMulticastFlowControl``, the slowest
  receiver's pace) is measured beside it.

The slipstream loops are the ones a first program writes, with the drivers' defaults: the
publisher ``for each message: while publication.offer(m) < 0: pass`` (the client's default idle
strategy only, no pinning), each subscriber ``while received < n: subscription.poll(h, 1000)``.
``batch`` rows (skipped by ``--no-batch``) are the same loops with ``offer_batch`` of 256
messages and ``poll_batch(4096)``: the tuned API, labelled as such, not the target's loop.

Every contender is timed the same way, from the drivers' counters sampled every 5 ms by this
process: from the publisher's sender position leaving 0 to the moment every receiver's
subscriber position reached the end of the stream.  The rate is the messages (and payload MB)
delivered to all three in that time.  The stream starts only once all three receivers have an
image (so none joins late), and a run counts only if every receiver got every message
(slipstream: its count and final position equal to the publisher's; Aeron: RateSubscriber's
total and the subscriber position).  The publisher's own offer rate (slipstream: its loop's
time; Aeron: StreamingPublisher's mean of its per-second reports) is printed beside it, with
the NAKs, retransmissions and socket-buffer drops of the run, and /proc/loadavg before and
after.  Eight busy processes (4 drivers, a publisher, 3 subscribers) share the machine's
cores: on a small or shared machine one run moves by more than the difference between
contenders: ``--repeat`` rounds, each in another order, and medians.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import multiprocessing
import os
import shutil
import statistics
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from bench.ipc_throughput import (
    add_driver_settings,
    bench_parser,
    offer_count,
    print_header,
    scratch_directory,
)
from bench.netns_goodput import udp_receive_buffer_drops
from slipstream.daemon.config import DriverSettings, check_setting

HOSTS = 4  # host 1 publishes, 2..4 subscribe
RECEIVERS = range(2, HOSTS + 1)
#: Each run's ports: data/control ports move on by this much per run, so that nothing of an
#: earlier run (a lingering publication, a destination not yet timed out) meets a later one.
BASE_PORT = 41000
PORT_STEP = 10
MULTICAST_GROUP = "224.0.1.1"
SAMPLE_S = 0.005
#: A run whose positions have not moved for this long is stuck: it is stopped and reported.
STALL_S = 15.0
CONNECT_TIMEOUT_S = 30.0
FRAME_HEADER = 32
CLONE_NEWNET = 0x40000000
AERON_TERM_LENGTH = 16 << 20  # aeron.term.buffer.length's default
CONTENDERS = {"mdc": "slipstream MDC", "multicast": "slipstream multicast",
              "mdc-batch": "slipstream MDC batch", "multicast-batch": "slipstream multicast batch",
              "aeron": "Aeron 1.15.1 MDC", "aeron-min": "Aeron 1.15.1 MDC fc min"}


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def frame_length(size: int) -> int:
    """A message's frame in the log (one fragment: the MTU 1408 holds up to 1376 B)."""
    return (size + FRAME_HEADER + 31) // 32 * 32


def stream_end(count: int, size: int, term_length: int) -> int:
    """The position after ``count`` messages of ``size`` from position 0: a term's end that
    the next frame does not fit is padding."""
    frame = frame_length(size)
    per_term = term_length // frame
    full, rest = divmod(count, per_term)
    if rest == 0:
        return (full - 1) * term_length + per_term * frame
    return full * term_length + rest * frame


@contextlib.contextmanager
def in_netns(namespace: str) -> Iterator[None]:
    """This thread inside network namespace ``namespace`` (what it forks starts there), back
    in its own after."""
    libc = ctypes.CDLL(None, use_errno=True)
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    target = os.open(f"/run/netns/{namespace}", os.O_RDONLY)
    try:
        if libc.setns(target, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {namespace} failed")
        try:
            yield
        finally:
            if libc.setns(own, CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "setns back failed")
    finally:
        os.close(own)
        os.close(target)


# -- slipstream's processes --------------------------------------------------------------------
def _ss_subscriber(directory: str, channel: str, stream_id: int, count: int, batch: bool,
                   joined: Any, done: Any, out: Any) -> None:
    """The first program's subscriber: poll until ``count`` messages arrived.  ``out``:
    received, its image's final position, how many images it had.  It keeps its subscription
    (and its position counter, which this process samples) until ``done``."""
    from slipstream.client import Client

    with Client.connect(directory) as client:
        subscription = client.add_subscription(channel, stream_id)
        while not subscription.images:
            time.sleep(0.0001)
        image = subscription.images[0]
        joined.set()
        received = [0]
        if batch:
            while received[0] < count:
                got = subscription.poll_batch(4096)
                if got is not None:
                    received[0] += len(got)
        else:
            def handler(data: memoryview, header: object) -> None:
                received[0] += 1

            while received[0] < count:
                subscription.poll(handler, 1000)
        out[0], out[1], out[2] = received[0], image.position, len(subscription.images)
        done.wait(300)


def _ss_publisher(directory: str, channel: str, stream_id: int, size: int, count: int,
                  batch: bool, connected: Any, start: Any, done: Any, times: Any,
                  out: Any) -> None:
    """The first program's publisher: ``while publication.offer(m) < 0: pass`` per message
    (or ``offer_batch`` of BATCH).  It keeps its publication open until ``done`` (the
    receivers may still need retransmissions)."""
    from slipstream.client import Client

    with Client.connect(directory) as client:
        publication = client.add_publication(channel, stream_id)
        while not publication.is_connected:
            time.sleep(0.001)
        connected.set()
        start.wait()
        message = bytes(size)
        times[0] = time.perf_counter()
        offer_count(publication, message, count, batch, busy=True)
        times[1] = time.perf_counter()
        out[0] = publication.position
        done.wait(300)


# -- positions from the drivers' counters ------------------------------------------------------
class Positions:
    """Reads a sender position and the receivers' subscriber positions from the drivers'
    counters (a slipstream driver's counters file, an Aeron driver's cnc.dat), ids found
    once."""

    def __init__(self, sender: Callable[[], int], receivers: list[Callable[[], int]]) -> None:
        self.sender = sender
        self.receivers = receivers

    def sample(self) -> tuple[int, list[int]]:
        return self.sender(), [read() for read in self.receivers]


def ss_counter(counters: Any, kind: str, stream_id: int) -> Callable[[], int]:
    """The reader of slipstream counter ``kind`` (``snd-pos``, ``sub-pos``) of ``stream_id``."""
    from slipstream.client.counters import parse_position_label

    for info in counters:
        label = parse_position_label(info.label)
        if label is not None and label.kind == kind and label.stream_id == stream_id:
            counter_id = info.counter_id
            return lambda: counters.get(counter_id)
    raise LookupError(f"no {kind} counter of stream {stream_id}")


class AeronValues:
    """An Aeron 1.15.1 driver's counter values, read from its mapped cnc.dat (the layout of
    tests/aeron_peer/cnc.py: values every 128 bytes after the counters' metadata)."""

    def __init__(self, directory: Path) -> None:
        with open(directory / "cnc.dat", "rb") as file:
            self._map = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
        _, to_driver, to_clients, meta, _ = struct.unpack_from("<5i", self._map, 0)
        self._values_at = 128 + to_driver + to_clients + meta

    def reader(self, counter_id: int) -> Callable[[], int]:
        at = self._values_at + counter_id * 128
        return lambda: struct.unpack_from("<q", self._map, at)[0]

    def close(self) -> None:
        self._map.close()


def aeron_counter_id(directory: Path, type_id: int, stream_id: int) -> int | None:
    """The id of an Aeron stream counter (``name: reg session stream channel ...``) of
    ``type_id`` (2 snd-pos, 4 sub-pos) and ``stream_id``, or None."""
    from tests.aeron_peer import read_counters

    for counter in read_counters(directory):
        parts = counter.label.split()
        if counter.type_id == type_id and len(parts) > 3 and parts[3] == str(stream_id):
            return counter.id
    return None


def time_stream(positions: Positions, final: int, alive: Callable[[], bool],
                timeout_s: float) -> tuple[list[float | None], str]:
    """Sample until every receiver is at ``final``: for each receiver, the seconds from the
    sender position leaving 0 to its subscriber position at ``final`` (each end the midpoint
    between the samples around it), None for one that never got there; and why not (stuck:
    nothing moved for STALL_S; timed out; a process gone)."""
    before = time.perf_counter()
    sent_at: float | None = None
    done: list[float | None] = [None] * len(positions.receivers)
    last_move = before
    last: tuple[int, list[int]] = (-1, [])
    deadline = before + timeout_s
    while True:
        now = time.perf_counter()
        sender, receivers = positions.sample()
        if sent_at is None and sender > 0:
            sent_at = (before + now) / 2
        if sent_at is not None:
            for k, position in enumerate(receivers):
                if done[k] is None and position >= final:
                    done[k] = (before + now) / 2 - sent_at
        if all(d is not None for d in done):
            return done, ""
        if (sender, receivers) != last:
            last, last_move = (sender, receivers), now
        elif now - last_move > STALL_S:
            return done, (f"stuck: no position moved for {STALL_S:.0f} s, sender at "
                          f"{sender:,}, receivers at {[f'{r:,}' for r in receivers]}, "
                          f"the end {final:,}")
        if now > deadline:
            return done, (f"not done in {timeout_s:.0f} s: receivers at "
                          f"{[f'{r:,}' for r in receivers]} of {final:,}")
        if not alive():
            return done, (f"a process ended early: receivers at "
                          f"{[f'{r:,}' for r in receivers]} of {final:,}")
        before = now
        time.sleep(SAMPLE_S)


# -- one run of each contender -----------------------------------------------------------------
class Result:
    def __init__(self, name: str) -> None:
        self.name = name
        self.rate = 0.0  # messages/s delivered to all receivers; 0: the run does not count
        self.offer_rate = 0.0  # the publisher's own
        self.whole = False
        self.notes: list[str] = []
        self.load_before = loadavg()
        self.load_after = ""
        self.receiver_rates: list[float] = []  # each receiver's, 0 for one that never got all

    def given_up(self, why: str) -> Result:
        """The run stopped before its stream (``why`` noted, with the load then): it does not
        count."""
        self.notes.append(why)
        self.load_after = loadavg()
        return self

    def timed(self, count: int, seconds: list[float | None], got_all: list[bool]) -> None:
        """The rates from :func:`time_stream`'s times, once ``whole`` is known; ``got_all``:
        which receivers got every message (the position of one that did not may have reached
        the end anyway: an Aeron image that times out and joins again at the live end)."""
        self.receiver_rates = [count / s if s and ok else 0.0
                               for s, ok in zip(seconds, got_all, strict=True)]
        if self.whole and all(self.receiver_rates):
            self.rate = min(self.receiver_rates)

    @property
    def fastest(self) -> float:
        """An upper bound of what a run that was not whole moved to all: the rate of its
        fastest receiver that got everything, else the publisher's own offer rate."""
        return max(self.receiver_rates, default=0.0) or self.offer_rate


def run_slipstream(hosts: Any, scratch: Path, run: int, transport: str, batch: bool,
                   size: int, count: int, settings: dict[str, str]) -> Result:
    from slipstream.client import control
    from slipstream.client.counters import (
        CountersFile,
        CounterType,
        SystemCounter,
        read_system_counters,
    )

    name = f"slipstream {transport}{' batch' if batch else ''}"
    result = Result(name)
    port = BASE_PORT + run * PORT_STEP
    publisher_host = hosts[1].address
    if transport == "MDC":
        pub_uri = f"aeron:udp?control={publisher_host}:{port}|control-mode=dynamic"
        sub_uris = {i: f"aeron:udp?endpoint={hosts[i].address}:{port + 1}"
                       f"|control={publisher_host}:{port}" for i in RECEIVERS}
    else:
        pub_uri = f"aeron:udp?endpoint={MULTICAST_GROUP}:{port + 1}|interface={publisher_host}"
        sub_uris = {i: f"aeron:udp?endpoint={MULTICAST_GROUP}:{port + 1}"
                       f"|interface={hosts[i].address}" for i in RECEIVERS}
    stream_id = 5000 + run
    directories = {i: scratch / f"run{run}-host{i}" for i in range(1, HOSTS + 1)}
    context = multiprocessing.get_context("spawn")
    with contextlib.ExitStack() as stack:
        drivers = {}
        for i in range(1, HOSTS + 1):
            drivers[i] = hosts.start_driver(i, directories[i], **settings)
            stack.callback(shutil.rmtree, directories[i], ignore_errors=True)
            stack.callback(drivers[i].stop)
        drops = {i: udp_receive_buffer_drops(hosts[i]) for i in RECEIVERS}
        joined = {i: context.Event() for i in RECEIVERS}
        outs = {i: context.Array("q", 3) for i in RECEIVERS}
        connected, start, done = context.Event(), context.Event(), context.Event()
        subscribers = {i: context.Process(target=_ss_subscriber, args=(
            str(directories[i]), sub_uris[i], stream_id, count, batch, joined[i], done,
            outs[i])) for i in RECEIVERS}
        times, pub_out = context.Array("d", 2), context.Array("q", 1)
        publisher = context.Process(target=_ss_publisher, args=(
            str(directories[1]), pub_uri, stream_id, size, count, batch, connected, start,
            done, times, pub_out))
        processes = [*subscribers.values(), publisher]

        def stop_processes() -> None:
            done.set()
            for process in processes:
                if process.pid is None:  # not started: the run failed before
                    continue
                process.join(10)
                if process.is_alive():
                    process.terminate()
                    process.join(5)

        stack.callback(stop_processes)
        for process in processes:
            process.start()
        deadline = time.monotonic() + CONNECT_TIMEOUT_S
        while not (connected.is_set() and all(e.is_set() for e in joined.values())):
            if time.monotonic() > deadline:
                return result.given_up(f"did not connect in {CONNECT_TIMEOUT_S:.0f} s (joined: "
                                       f"{[i for i in RECEIVERS if joined[i].is_set()]})")
            time.sleep(0.01)
        counters = {i: stack.enter_context(contextlib.closing(CountersFile(
            Path(directories[i]) / control.COUNTERS_FILE, writable=False)))
            for i in range(1, HOSTS + 1)}
        if transport == "MDC":
            destinations = [info.value for info in counters[1]
                            if info.type_id == CounterType.MDC_DESTINATIONS]
            if destinations != [len(RECEIVERS)]:
                result.notes.append(f"mdc-destinations {destinations} at the start")
        positions = Positions(ss_counter(counters[1], "snd-pos", stream_id),
                              [ss_counter(counters[i], "sub-pos", stream_id) for i in RECEIVERS])
        final = stream_end(count, size, check_setting("term_buffer_length", settings.get(
            "term_buffer_length", DriverSettings().term_buffer_length)))
        start.set()
        seconds, why = time_stream(positions, final, lambda: all(
            p.is_alive() for p in processes), timeout_s=600)
        if not why:  # every receiver is at the end: each subscriber's count follows
            deadline = time.monotonic() + 30
            while (any(outs[i][2] == 0 for i in RECEIVERS) and time.monotonic() < deadline
                   and all(p.is_alive() for p in subscribers.values())):
                time.sleep(0.01)
        done.set()
        for process in processes:
            process.join(30)
        system = {i: read_system_counters(directories[i]) for i in range(1, HOSTS + 1)}
        drops = {i: udp_receive_buffer_drops(hosts[i]) - drops[i] for i in RECEIVERS}
        published = pub_out[0]
        whole = [outs[i][0] == count and outs[i][1] == published == final and outs[i][2] == 1
                 for i in RECEIVERS]
        result.whole = all(whole) and publisher.exitcode == 0
        if why:
            result.notes.append(why)
        if not result.whole:
            result.notes.append(
                "NOT whole: " + ", ".join(f"host {i} got {outs[i][0]:,} to {outs[i][1]:,} in "
                                          f"{outs[i][2]} image(s)" for i in RECEIVERS)
                + f"; published to {published:,} (exit {publisher.exitcode})")
        result.timed(count, seconds, [outs[i][0] == count for i in RECEIVERS])
        if times[1] > times[0]:
            result.offer_rate = count / (times[1] - times[0])
        naks = sum(system[i][SystemCounter.NAK_MESSAGES_SENT] for i in RECEIVERS)
        result.notes.append(
            f"{naks:,} NAKs, {system[1][SystemCounter.RETRANSMITS_SENT]:,} retransmits, "
            f"{system[1][SystemCounter.SHORT_SENDS]:,} short sends, "
            f"{system[1][SystemCounter.SEND_ERRORS]:,} send errors, "
            f"{sum(system[i][SystemCounter.LOSS_GAP_FILLS] for i in RECEIVERS):,} gap fills, "
            f"{sum(drops.values()):,} dropped by full socket buffers "
            f"({', '.join(f'{drops[i]:,}' for i in RECEIVERS)}); sending driver: network "
            f"threads busy {system[1][SystemCounter.NETWORK_BUSY_NS] / 1e9:.2f} s, "
            f"{system[1][SystemCounter.NETWORK_PYTHON_PASSES]:,} Python passes, "
            f"{system[1][SystemCounter.STATUS_MESSAGES_RECEIVED]:,} SMs received, "
            f"{system[1][SystemCounter.UNMATCHED_STATUS_MESSAGES]:,} unmatched")
    result.load_after = loadavg()
    return result


def run_aeron(hosts: Any, run: int, size: int, count: int, threading_mode: str,
              min_flow_control: bool) -> Result:
    """StreamingPublisher on host 1, a RateSubscriber on each receiver host; the drivers'
    defaults (max multicast flow control, which MDC uses), or ``min_flow_control``."""
    from tests import aeron_peer

    result = Result("Aeron 1.15.1 MDC fc min" if min_flow_control else "Aeron 1.15.1 MDC")
    port = BASE_PORT + run * PORT_STEP
    publisher_host = hosts[1].address
    pub_uri = f"aeron:udp?control={publisher_host}:{port}|control-mode=dynamic"
    sub_uris = {i: f"aeron:udp?endpoint={hosts[i].address}:{port + 1}"
                   f"|control={publisher_host}:{port}" for i in RECEIVERS}
    stream_id = 5000 + run
    with contextlib.ExitStack() as stack:
        drivers = {}
        for i in range(1, HOSTS + 1):
            driver = aeron_peer.AeronDriver(
                threading_mode=threading_mode, fast_timeouts=False,
                multicast_flow_control="min" if min_flow_control else None)
            with in_netns(hosts[i].namespace):
                driver.start()
            stack.callback(driver.stop)
            drivers[i] = driver
        drops = {i: udp_receive_buffer_drops(hosts[i]) for i in RECEIVERS}
        subscribers = {i: stack.enter_context(aeron_peer.rate_subscriber(
            drivers[i], sub_uris[i], stream_id)) for i in RECEIVERS}
        # A shared publication held open (and connected) before StreamingPublisher joins it,
        # so that every receiver has its image before the first message.
        stack.enter_context(aeron_peer.hold_connected_publication(
            drivers[1], pub_uri, stream_id, timeout=CONNECT_TIMEOUT_S))
        deadline = time.monotonic() + CONNECT_TIMEOUT_S
        ids: dict[int, int | None] = {}
        while True:
            ids = {i: aeron_counter_id(drivers[i].directory, 4, stream_id) for i in RECEIVERS}
            images = {i: aeron_counter_id(drivers[i].directory, 5, stream_id)  # rcv-pos
                      for i in RECEIVERS}
            if all(ids[i] is not None and images[i] is not None for i in RECEIVERS):
                break
            if time.monotonic() > deadline:
                return result.given_up(f"not every receiver joined in {CONNECT_TIMEOUT_S:.0f} s "
                                       f"(sub-pos ids {ids}, rcv-pos ids {images})")
            time.sleep(0.05)
        sender_id = aeron_counter_id(drivers[1].directory, 2, stream_id)
        assert sender_id is not None, "no snd-pos counter"
        values = {i: AeronValues(drivers[i].directory) for i in range(1, HOSTS + 1)}
        for v in values.values():
            stack.callback(v.close)
        positions = Positions(values[1].reader(sender_id),
                              [values[i].reader(ids[i]) for i in RECEIVERS])  # type: ignore[arg-type]
        streamed: dict[str, Any] = {}

        def stream() -> None:
            try:
                streamed["result"] = aeron_peer.streaming_publisher(
                    drivers[1], pub_uri, stream_id, message_length=size, messages=count,
                    timeout=600)
            except Exception as e:  # reported with the run
                streamed["error"] = e

        publisher = threading.Thread(target=stream, daemon=True)
        publisher.start()
        final = stream_end(count, size, AERON_TERM_LENGTH)
        seconds, why = time_stream(positions, final, lambda: publisher.is_alive() or (
            "result" in streamed), timeout_s=600)
        publisher.join(60)
        totals = {}
        for i, subscriber in subscribers.items():
            with contextlib.suppress(Exception):
                subscriber.wait_for_total(count, timeout=5)
            totals[i] = subscriber.total_messages
        ends = {i: positions.receivers[k]() for k, i in enumerate(RECEIVERS)}
        result.whole = all(totals[i] == count and ends[i] == final for i in RECEIVERS)
        if why:
            result.notes.append(why)
        if "error" in streamed:
            result.notes.append(f"StreamingPublisher failed: {str(streamed['error'])[:300]}")
        if not result.whole:
            result.notes.append("NOT whole: " + ", ".join(
                f"host {i} got {totals[i]:,} to {ends[i]:,}" for i in RECEIVERS))
        joins = {i: sum(line.startswith("Available image") for line in subscribers[i].lines)
                 for i in RECEIVERS}
        if any(n != 1 for n in joins.values()):
            result.notes.append("images: " + ", ".join(
                f"host {i} {n}" for i, n in joins.items()) + " (an image that timed out "
                "joined again at the live end: what it missed is lost to that subscriber)")
        if "result" in streamed:
            result.offer_rate = streamed["result"].msgs_per_sec
        result.timed(count, seconds, [totals[i] == count for i in RECEIVERS])

        def system(i: int, label: str) -> int:
            try:
                return drivers[i].counter(label)
            except KeyError:
                return -1

        drops = {i: udp_receive_buffer_drops(hosts[i]) - drops[i] for i in RECEIVERS}
        result.notes.append(
            f"{sum(system(i, 'NAKs sent') for i in RECEIVERS):,} NAKs, "
            f"{system(1, 'Retransmits sent'):,} retransmits, "
            f"{system(1, 'Short sends'):,} short sends, "
            f"{sum(system(i, 'Loss gap fills') for i in RECEIVERS):,} gap fills, "
            f"{sum(drops.values()):,} dropped by full socket buffers "
            f"({', '.join(f'{drops[i]:,}' for i in RECEIVERS)})")
    result.load_after = loadavg()
    return result


def mb(rate: float, size: int) -> str:
    return f"{rate / 1e3:7.1f} k msg/s {rate * size / 1e6:6.1f} MB/s"


def line(result: Result, size: int) -> str:
    rate = mb(result.rate, size) if result.rate else f"{'- (not whole)':>27}"
    offer = f"(offers {result.offer_rate / 1e3:.1f} k/s)" if result.offer_rate else ""
    notes = list(result.notes)
    if result.receiver_rates:
        own = ", ".join(f"{r / 1e3:.1f}" for r in result.receiver_rates)
        notes.insert(0, f"each receiver's own rate {own} k msg/s" + (
            "" if result.rate else f" (0: did not get all); upper bound of the run: "
                                   f"{mb(result.fastest, size)}"))
    return (f"  {result.name:<27} {rate}  {offer:<21} whole: {'yes' if result.whole else 'NO'}"
            f"  load {result.load_before} -> {result.load_after}\n"
            + "".join(f"      {note}\n" for note in notes)).rstrip("\n")


def main() -> int:
    parser = bench_parser(__doc__,
                          messages=(500_000, "messages per run (default: %(default)s)"),
                          size=(1024, "message size, bytes, up to 1376 (one datagram each)"),
                          repeat=(1, "rounds of every contender, each round in another order "
                                     "(medians reported)"))
    add_driver_settings(parser, "a slipstream driver setting (repeatable; default: none)")
    parser.add_argument("--no-batch", action="store_true",
                        help="leave out the offer_batch / poll_batch rows")
    parser.add_argument("--no-aeron", action="store_true", help="leave the Aeron peer out")
    parser.add_argument("--only", default=",".join(CONTENDERS),
                        help="which contenders, of %(default)s")
    parser.add_argument("--aeron-threading", default="SHARED",
                        choices=("SHARED", "SHARED_NETWORK", "DEDICATED"),
                        help="the Aeron drivers' threading mode (default: %(default)s)")
    args = parser.parse_args()
    unknown = set(args.only.split(",")) - set(CONTENDERS)
    if unknown:
        parser.error(f"--only: {', '.join(sorted(unknown))}: not of {', '.join(CONTENDERS)}")
    if args.size < 8 or args.size > 1376:
        parser.error("--size: 8 to 1376 bytes (StreamingPublisher's least; one datagram)")
    if os.geteuid() != 0:
        print("bench.mdc_hosts: namespace hosts need root", file=sys.stderr)
        return 2
    from slipstream.sim.real.hosts import namespace_hosts

    settings = dict(args.settings)
    contenders = [name for key, name in CONTENDERS.items() if key in args.only.split(",")
                  and not (args.no_batch and key.endswith("batch"))
                  and not (args.no_aeron and key.startswith("aeron"))]
    if any(name.startswith("Aeron") for name in contenders):
        from tests import aeron_peer

        missing = aeron_peer.aeron_available()
        if missing:
            print(f"bench.mdc_hosts: {missing} (or run with --no-aeron)", file=sys.stderr)
            return 2
    print_header("MDC 1:3 on namespace hosts (1 publisher, 3 receivers, plain veths)",
                 "bench.mdc_hosts")
    print(f"# {args.messages:,} messages of {args.size} B per run; slipstream settings "
          f"{settings} (else the defaults), the first program's loops; Aeron 1.15.1 defaults, "
          f"{args.aeron_threading} threading, StreamingPublisher -> 3 RateSubscribers")
    print("# rate = messages delivered to all 3 receivers / (sender position leaving 0 .. "
          "the last receiver at the end); load = /proc/loadavg 1/5/15 min")
    scratch = scratch_directory()
    results: dict[str, list[Result]] = {c: [] for c in contenders}
    run = 0
    with namespace_hosts(HOSTS) as hosts:
        for round_ in range(args.repeat):
            shift = round_ % len(contenders)
            print(f"round {round_ + 1}", flush=True)
            for name in contenders[shift:] + contenders[:shift]:
                run += 1
                if name.startswith("Aeron"):
                    result = run_aeron(hosts, run, args.size, args.messages,
                                       args.aeron_threading, name.endswith("fc min"))
                else:
                    result = run_slipstream(hosts, Path(scratch.name), run,
                                            "MDC" if "MDC" in name else "multicast",
                                            name.endswith("batch"), args.size, args.messages,
                                            settings)
                results[name].append(result)
                print(line(result, args.size), flush=True)
    scratch.cleanup()
    medians = {name: statistics.median(r.rate for r in runs) for name, runs in results.items()}
    print("summary" + (" (medians of the rounds; a run that was not whole counts 0)"
                       if args.repeat > 1 else ""))
    for name, runs in results.items():
        print(f"  {name:<27} {mb(medians[name], args.size)}"
              + (f"   runs {', '.join(f'{r.rate / 1e3:.1f}' for r in runs)} k"
                 if args.repeat > 1 else ""))
    # A peer that was not whole is compared by an upper bound of what it moved to all three
    # (Result.fastest): the comparison favours the peer.
    peers = {}
    for name, runs in results.items():
        if name.startswith("Aeron") and not medians[name]:
            peers[name] = statistics.median(r.fastest for r in runs)
            print(f"  {name}: no whole run; the median of its runs' upper bounds (the "
                  f"fastest receiver that got all, else the publisher's offer rate) "
                  f"{mb(peers[name], args.size)} stands in below")
        else:
            peers[name] = medians[name]
    for a, b, target, note in (
            ("slipstream MDC", "slipstream multicast", 0.8, ""),
            ("slipstream MDC", "Aeron 1.15.1 MDC", 2.0, ""),
            ("slipstream MDC", "Aeron 1.15.1 MDC fc min", 2.0, " (Aeron with min flow control)"),
            ("slipstream MDC batch", "slipstream multicast batch", 0.8, " (the batch API)"),
            ("slipstream MDC batch", "Aeron 1.15.1 MDC", 2.0,
             " (the batch API, not the target's loop)")):
        if a not in medians or b not in medians:
            continue
        if not medians[a] or not peers[b]:
            print(f"  {a} / {b}: - (no whole run of {a if not medians[a] else b})")
            continue
        value = medians[a] / peers[b]
        print(f"  {a} / {b} {value:.2f}x (target {target:g}x: "
              f"{'met' if value >= target else 'NOT met'}){note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
