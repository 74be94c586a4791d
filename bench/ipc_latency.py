"""IPC ping-pong round-trip latency between two processes at a fixed rate: slipstream
(``receive()``: spin briefly, then park) vs pyzmq PAIR over ipc://, in the same run.

    .venv/bin/python -m bench.ipc_latency [--rate 10000] [--seconds 5]

The pinger sends a ping every 1/rate s (paced by the clock, not by the replies) and records
each round trip in an HDR histogram (1 µs .. 1 s, 3 significant digits).  Warm-up round trips
are not recorded.  Also reports the CPU time the ponger used while waiting with no traffic.
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing
import resource
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from hdrh.histogram import HdrHistogram

from bench.ipc_throughput import (
    bench_parser,
    pin,
    print_header,
    scratch_directory,
)

PING_STREAM, PONG_STREAM = 2001, 2002
WARMUP = 2000


def _pace(next_send: float) -> None:
    while time.perf_counter() < next_send:
        pass


def paced_round_trips(rounds: int, rate: int,
                      round_trip: Callable[[bytes], bytes]) -> HdrHistogram:
    """Every pinger's loop: a ping every 1/rate s (paced by the clock, not by the replies)
    carrying its send time; ``round_trip(ping)`` sends it and returns the echo.  Records every
    round trip after the warm-up, in µs."""
    histogram = HdrHistogram(1, 1_000_000_000, 3)
    interval = 1.0 / rate
    next_send = time.perf_counter()
    for i in range(rounds):
        _pace(next_send)
        next_send += interval
        sent = int.from_bytes(round_trip(time.perf_counter_ns().to_bytes(8, "little")),
                              "little")
        if i >= WARMUP:
            histogram.record_value(max(1, (time.perf_counter_ns() - sent) // 1000))
    return histogram


# -- slipstream ------------------------------------------------------------------------------
@contextlib.contextmanager
def _client(directory: str, embedded: bool) -> Iterator[Any]:
    """A client of the driver in ``directory``, or (``embedded``) of a driver made there in
    this process in invoker mode, which the client's waits run."""
    from slipstream.client import Client
    from slipstream.daemon.driver import MediaDriver

    with contextlib.ExitStack() as stack:
        invoker = None
        if embedded:
            invoker = stack.enter_context(MediaDriver.embedded(directory)).do_work
        yield stack.enter_context(Client.connect(directory, invoker=invoker))


def _wait_until(client: Any, condition: Callable[[], object]) -> None:
    while not condition():
        if not client.do_work():  # an embedded driver moves only when it is run
            time.sleep(0.001)


def _ss_ponger(directory: str, rounds: int, idle_cpu, ready, ping_channel: str = "aeron:ipc",
               pong_channel: str = "aeron:ipc", embedded: bool = False) -> None:
    with _client(directory, embedded) as client:
        pings = client.add_subscription(ping_channel, PING_STREAM)
        pongs = client.add_publication(pong_channel, PONG_STREAM)
        _wait_until(client, lambda: pings.images and pongs.is_connected)
        gc.freeze()  # latency hygiene for any Python process: no full collections of setup
        # Idle cost first: wait two seconds with no traffic.
        before = resource.getrusage(resource.RUSAGE_SELF)
        pings.receive(lambda data, header: None, 1, timeout=2.0)
        after = resource.getrusage(resource.RUSAGE_SELF)
        idle_cpu.value = (after.ru_utime + after.ru_stime - before.ru_utime
                          - before.ru_stime) / 2.0
        ready.set()
        echoed = [0]

        def echo(data: memoryview, header: object) -> None:
            while pongs.offer(data) < 0:
                client.do_work()  # an embedded driver moves only when it is run
            echoed[0] += 1

        while echoed[0] < rounds:
            pings.receive(echo, 1, timeout=5.0)


def _ss_pinger(directory: str, rounds: int, rate: int, ready, out,
               ping_channel: str = "aeron:ipc", pong_channel: str = "aeron:ipc",
               embedded: bool = False) -> None:
    pin(0)
    with _client(directory, embedded) as client:
        pings = client.add_publication(ping_channel, PING_STREAM)
        pongs = client.add_subscription(pong_channel, PONG_STREAM)
        _wait_until(client, lambda: pongs.images and pings.is_connected)
        gc.freeze()
        ready.wait()
        got = [b""]

        def on_pong(data: memoryview, header: object) -> None:
            got[0] = bytes(data)

        def round_trip(ping: bytes) -> bytes:
            while pings.offer(ping) < 0:
                client.do_work()
            while pongs.receive(on_pong, 1, timeout=1.0) == 0:
                pass
            return got[0]

        histogram = paced_round_trips(rounds, rate, round_trip)
    out.put(histogram.encode())


# -- pyzmq -----------------------------------------------------------------------------------
def _zmq_ponger(endpoint: str, rounds: int, ready) -> None:
    import zmq

    pin(1)
    context = zmq.Context()
    socket = context.socket(zmq.PAIR)
    socket.bind(endpoint)
    gc.freeze()
    ready.set()
    for _ in range(rounds):
        socket.send(socket.recv())
    socket.close(0)
    context.term()


def _zmq_pinger(endpoint: str, rounds: int, rate: int, ready, out) -> None:
    import zmq

    pin(0)
    ready.wait()
    context = zmq.Context()
    socket = context.socket(zmq.PAIR)
    socket.connect(endpoint)
    gc.freeze()

    def round_trip(ping: bytes) -> bytes:
        socket.send(ping)
        return socket.recv()

    histogram = paced_round_trips(rounds, rate, round_trip)
    socket.close(0)
    context.term()
    out.put(histogram.encode())


def _run(target_ping, target_pong, ping_args, pong_args, extra_args=()) -> HdrHistogram:
    """Run a pinger and a ponger; ``extra_args`` go to both after their own arguments."""
    context = multiprocessing.get_context("spawn")
    ready, out = context.Event(), context.Queue()
    ponger = context.Process(target=target_pong, args=(*pong_args, ready, *extra_args))
    pinger = context.Process(target=target_ping, args=(*ping_args, ready, out, *extra_args))
    ponger.start()
    pinger.start()
    encoded = out.get(timeout=600)
    pinger.join(60)
    ponger.join(60)
    return HdrHistogram.decode(encoded)


def zmq_round_trips(endpoint: str, rounds: int, rate: int) -> HdrHistogram:
    """The pyzmq PAIR ping-pong over ``endpoint``: ``rounds`` round trips at ``rate`` a
    second, their latencies (µs) after the first WARMUP."""
    return _run(_zmq_pinger, _zmq_ponger, (endpoint, rounds, rate), (endpoint, rounds))


def percentile_line(name: str, histogram: HdrHistogram, width: int = 22,
                    events: str = "round trips") -> str:
    """A row of a latency table: ``name`` (padded to ``width``), the p50, p99, p99.9 and max of
    ``histogram`` (µs), and how many ``events`` it holds."""
    return (f"{name:<{width}} p50 {histogram.get_value_at_percentile(50):>6} µs   "
            f"p99 {histogram.get_value_at_percentile(99):>6} µs   "
            f"p99.9 {histogram.get_value_at_percentile(99.9):>6} µs   "
            f"max {histogram.get_max_value():>7} µs   ({histogram.get_total_count()} {events})")


def main() -> int:
    parser = bench_parser(__doc__,
                          rate=(10_000, "round trips per second"),
                          seconds=(5.0, "measured duration"))
    args = parser.parse_args()
    rounds = WARMUP + int(args.rate * args.seconds)

    from slipstream.daemon.driver import MediaDriver

    print_header(f"IPC ping-pong latency at {args.rate:,} round trips/s", "bench.ipc_latency")
    scratch = scratch_directory()
    directory = Path(scratch.name)
    context = multiprocessing.get_context("spawn")
    idle_cpu = context.Value("d", -1.0)
    zmq_histogram = zmq_round_trips(f"ipc://{directory}/pair.sock", rounds, args.rate)
    with MediaDriver.launch(directory=directory / "driver") as driver:
        ss_histogram = _run(_ss_pinger, _ss_ponger, (str(driver.directory), rounds, args.rate),
                            (str(driver.directory), rounds, idle_cpu))
    print(percentile_line("pyzmq PAIR ipc://", zmq_histogram))
    print(percentile_line("slipstream aeron:ipc", ss_histogram))
    p99_ratio = zmq_histogram.get_value_at_percentile(99) / ss_histogram.get_value_at_percentile(99)
    print(f"p99: slipstream {p99_ratio:.1f}x lower than pyzmq; a waiting subscriber used "
          f"{idle_cpu.value * 100:.2f} % of a core with no traffic")
    scratch.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
