"""What a spy costs its publication (the target: a spy adds at most 5 % to its publication's
send cost).  A UDP publication on driver A streams to a subscriber on driver B
(every message crosses loopback UDP), alone and with a spy (``aeron-spy:``) on driver A
reading the same log in place; the runs alternate, in the same drivers.  Prints, per message
size, for each case:

* the send cost per message, in ns: the CPU time of the publisher's thread inside the offers
  that took messages (``time.thread_time``, so neither waiting for credit nor being preempted
  counts), plus all the CPU time of driver A's network thread (``ss-network``, found by name
  under ``/proc/<pid>/task``) over the run: its duty cycles, its Python passes, its parks and
  the doorbell wake-ups a spy rings, where a spy's cost shows (``schedstat``'s run time in ns
  where the kernel has it, else utime + stime from ``stat``, in clock ticks); and the ratio
  with a spy / alone, the figure the target is about;
* the stream's rate at the subscriber (messages/s, MB/s), and its ratio: a tethered spy holds
  the publisher to what it has read, and where the busy threads outnumber the cores the spy's
  reading takes CPU the stream would have had, so this ratio counts the spy's own cost too.

    .venv/bin/python -m bench.spy_cost [--messages N] [--sizes 32,1024] [--repeat R]
        [--set KEY=VALUE ...]

Loops as bench/udp_throughput.py's (yielding when nothing moved); the spy polls like the
subscriber (``poll_batch``).  Each figure is the median of R runs, with their spread
(min-max); the ratios are the median (and spread) of the R pairs of alternating runs.  A run
counts only if the stream arrived whole at the subscriber and at the spy (every message, and
both at the publisher's final position).
"""

from __future__ import annotations

import multiprocessing
import os
import statistics
import sys
import time
from array import array
from pathlib import Path
from typing import TYPE_CHECKING

from bench.ipc_throughput import (
    BATCH,
    add_driver_settings,
    bench_parser,
    print_header,
    scratch_directory,
)
from bench.udp_throughput import DEFAULT_SETTINGS, free_port

if TYPE_CHECKING:
    from slipstream.daemon.driver import MediaDriver

RUN_TIMEOUT_S = 120.0


def _publisher(directory: str, channel: str, stream_id: int, size: int, count: int, start,
               out) -> None:
    """Offer ``count`` messages in batches; ``out``: [final position, the thread's CPU
    seconds inside the offers that took messages]."""
    from slipstream.client import Client

    with Client.connect(directory, spins_before_yield=None) as client:
        publication = client.add_publication(channel, stream_id)
        while not publication.is_connected:
            time.sleep(0.001)
        start.wait()
        data, lengths = bytes(size) * BATCH, array("i", [size] * BATCH)
        offer_batch, thread_time = publication.offer_batch, time.thread_time
        sent, busy = 0, 0.0
        while sent < count:
            if count - sent < BATCH:
                data, lengths = data[:(count - sent) * size], lengths[:count - sent]
            began = thread_time()
            n = offer_batch(data, lengths)
            if n > 0:
                busy += thread_time() - began
                sent += n
            else:
                os.sched_yield()
        out[1] = busy
        out[0] = publication.position


def _reader(directory: str, channel: str, stream_id: int, count: int, ready, out) -> None:
    """Read ``count`` messages (a subscriber, or a spy); ``out``: [final position, rate]."""
    from slipstream.client import Client

    with Client.connect(directory, spins_before_yield=None) as client:
        subscription = client.add_subscription(channel, stream_id)
        ready.set()
        while not subscription.images:
            time.sleep(0.0001)
        image = subscription.images[0]
        received, first = 0, 0.0
        while received < count:
            got = subscription.poll_batch(4096)
            if got is not None:
                if not first:
                    first = time.perf_counter()
                received += len(got)
            else:
                os.sched_yield()
        out[1] = received / (time.perf_counter() - first)
        out[0] = image.position


NETWORK_THREAD = "ss-network"  # the driver's network thread (sender and receiver), by name


def network_task(driver: MediaDriver) -> Path:
    """``/proc/<pid>/task/<tid>`` of ``driver``'s network thread."""
    for task in Path(f"/proc/{driver.pid}/task").iterdir():
        if (task / "comm").read_text().strip() == NETWORK_THREAD:
            return task
    raise RuntimeError(f"driver {driver.pid} has no {NETWORK_THREAD} thread")


def cpu_ns(task: Path) -> int:
    """The CPU time a thread has used, ns: ``schedstat``'s run time, else utime + stime."""
    try:
        return int((task / "schedstat").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        ticks = int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15)
        return ticks * 1_000_000_000 // os.sysconf("SC_CLK_TCK")


def run(a, b, size: int, count: int, stream_id: int, *, spy: bool) -> tuple[float, float]:
    """One run: (send cost in ns per message, the subscriber's messages/s); (0, 0) when the
    stream did not arrive whole."""
    channel = f"aeron:udp?endpoint=127.0.0.1:{free_port()}"
    context = multiprocessing.get_context("spawn")
    start = context.Event()
    published = context.Array("d", 2)
    readers = []
    for directory, uri in ((b.directory, channel),
                           *(((a.directory, f"aeron-spy:{channel}"),) if spy else ())):
        ready, out = context.Event(), context.Array("d", 2)
        process = context.Process(target=_reader, args=(str(directory), uri, stream_id, count,
                                                        ready, out))
        process.start()
        assert ready.wait(60), "a reader did not start"
        readers.append((process, out))
    publisher = context.Process(target=_publisher, args=(str(a.directory), channel, stream_id,
                                                         size, count, start, published))
    publisher.start()
    time.sleep(0.3)
    task = network_task(a)
    busy_ns = cpu_ns(task)
    start.set()
    deadline = time.monotonic() + RUN_TIMEOUT_S
    publisher.join(RUN_TIMEOUT_S)
    for process, _ in readers:
        process.join(max(0.0, deadline - time.monotonic()))
    busy_ns = cpu_ns(task) - busy_ns
    processes = [publisher, *(p for p, _ in readers)]
    stuck = [p for p in processes if p.is_alive()]
    for process in stuck:
        process.terminate()
        process.join(5)
    whole = all(out[0] == published[0] for _, out in readers)
    if stuck or any(p.exitcode for p in processes) or not whole:
        print(f"# run did not finish whole: exits {[p.exitcode for p in processes]}, "
              f"positions {published[0]} -> {[out[0] for _, out in readers]}", flush=True)
        return 0.0, 0.0
    return (published[1] * 1e9 + busy_ns) / count, readers[0][1][1]


def main() -> int:
    parser = bench_parser(__doc__,
                          messages=(2_000_000, "messages per run"),
                          sizes=("32,1024", "message sizes in bytes"),
                          repeat=(3, "runs per case, alternating; median and spread shown"))
    add_driver_settings(parser)
    args = parser.parse_args()

    from slipstream.daemon.driver import MediaDriver

    settings = {**DEFAULT_SETTINGS, **dict(args.settings)}
    print_header("a spy's cost to its UDP publication, loopback", "bench.spy_cost", settings)
    scratch = scratch_directory()
    directory = Path(scratch.name)
    stream_id = 2000
    with MediaDriver.launch(directory=directory / "a", **settings) as a, \
            MediaDriver.launch(directory=directory / "b", **settings) as b:
        for size in args.sizes:
            pairs = []  # (alone, with a spy), each (cost, rate), runs that arrived whole
            for _ in range(args.repeat):
                pair = []
                for spy in (False, True):
                    stream_id += 1
                    pair.append(run(a, b, size, args.messages, stream_id, spy=spy))
                if all(rate for _, rate in pair):
                    pairs.append(pair)
            lines = [f"{size:>6} B  ({args.messages:,} messages, {len(pairs)} pairs of runs)"]
            if pairs:
                for case, name in ((0, "alone"), (1, "with a spy")):
                    costs = [p[case][0] for p in pairs]
                    rates = [p[case][1] for p in pairs]
                    lines.append(f"    {name:<11} send cost {_spread(costs, '7.1f')} ns/msg   "
                                 f"subscriber {_spread([r / 1e6 for r in rates], '.3f')} "
                                 f"M msg/s")
                cost_ratios = [p[1][0] / p[0][0] for p in pairs]
                rate_ratios = [p[1][1] / p[0][1] for p in pairs]
                lines.append(f"    with a spy / alone: send cost {_spread(cost_ratios, '.3f')}x"
                             f"   rate {_spread(rate_ratios, '.3f')}x")
            print("\n".join(lines), flush=True)
    scratch.cleanup()
    return 0


def _spread(values: list[float], spec: str) -> str:
    """The median of ``values`` and their range: ``m [lo-hi]``."""
    return (f"{statistics.median(values):{spec}} "
            f"[{min(values):{spec.lstrip('0123456789')}}-{max(values):{spec.lstrip('0123456789')}}]")


if __name__ == "__main__":
    sys.exit(main())
