"""A waiting receive's wake-up latency: the blocking ``receive`` against ``receive_async``
under trio and under asyncio, on one driver, in the same run.

    .venv/bin/python -m bench.aio_latency [--rate 500] [--seconds 4] [--repeat 3]

A publisher process offers one 16-byte IPC message every 1/rate s (paced by sleeping, so the
subscriber has parked between messages: what is measured is a parked wait woken), carrying
the monotonic time of its offer; a subscriber process waits for each with one of the three
forms and records, in an HDR histogram (1 µs .. 1 s), how long after the offer its handler
ran.  The forms run in turns (blocking, trio, asyncio, then again: ``--repeat`` rounds), each
with a new subscriber process; each form's histograms are merged.  Prints p50, p99 and p99.9
of each, and each async form's p50 and p99 over the blocking one's.
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hdrh.histogram import HdrHistogram

from bench.ipc_latency import percentile_line
from bench.ipc_throughput import (
    bench_parser,
    machine,
    pin,
    scratch_directory,
)

STREAM_ID = 2101
WARMUP = 100
#: The forms of a waiting receive, in the order they run in each round.
FORMS = ("blocking", "trio", "asyncio")


def _receive_all(form: str, subscription: Any, count: int,
                 handler: Callable[[memoryview, object], None], received: list[int]) -> None:
    """Wait for ``count`` messages with ``form``'s receive, one message a call."""
    if form == "blocking":
        while len(received) < count:
            subscription.receive(handler, 1, timeout=1.0)
        return

    async def loop() -> None:
        while len(received) < count:
            await subscription.receive_async(handler, 1, timeout=1.0)

    if form == "trio":
        import trio

        trio.run(loop)
    else:
        import asyncio

        asyncio.run(loop())


def _subscriber(directory: str, form: str, count: int, ready, out) -> None:
    from slipstream.client import Client

    pin(1)
    with Client.connect(directory) as client:
        subscription = client.add_subscription("aeron:ipc", STREAM_ID)
        while not subscription.images:
            time.sleep(0.001)
        histogram = HdrHistogram(1, 1_000_000_000, 3)
        received: list[int] = []

        def handler(data: memoryview, header: object) -> None:
            woken = time.monotonic_ns()
            if len(received) >= WARMUP:
                offered = int.from_bytes(data[:8], "little")
                histogram.record_value(max(1, (woken - offered) // 1000))
            received.append(1)

        gc.freeze()
        ready.set()
        _receive_all(form, subscription, count, handler, received)
    out.put(histogram.encode())


def _publisher(directory: str, count: int, rate: int, ready) -> None:
    from slipstream.client import Client

    pin(0)
    with Client.connect(directory) as client:
        publication = client.add_publication("aeron:ipc", STREAM_ID)
        ready.wait(60)
        interval = 1.0 / rate
        next_offer = time.monotonic()
        for _ in range(count):
            pause = next_offer - time.monotonic()
            if pause > 0:
                time.sleep(pause)
            next_offer += interval
            while publication.offer(time.monotonic_ns().to_bytes(8, "little") + bytes(8)) < 0:
                os.sched_yield()


def run_form(directory: str, form: str, count: int, rate: int) -> HdrHistogram:
    """One subscriber process waiting with ``form`` for ``count`` messages at ``rate``."""
    context = multiprocessing.get_context("spawn")
    ready, out = context.Event(), context.Queue()
    subscriber = context.Process(target=_subscriber, args=(directory, form, count, ready, out))
    publisher = context.Process(target=_publisher, args=(directory, count, rate, ready))
    subscriber.start()
    publisher.start()
    encoded = out.get(timeout=count / rate + 120)
    publisher.join(60)
    subscriber.join(60)
    return HdrHistogram.decode(encoded)


def _forms(text: str) -> tuple[str, ...]:
    """An argparse type: some of :data:`FORMS`, comma-separated."""
    forms = tuple(text.split(","))
    for form in forms:
        if form not in FORMS:
            raise argparse.ArgumentTypeError(f"{form!r} is not one of {', '.join(FORMS)}")
    return forms


def main() -> int:
    parser = bench_parser(__doc__,
                          rate=(500, "messages per second (the subscriber parks between them)"),
                          seconds=(4.0, "measured duration of each run"),
                          repeat=(3, "rounds, each running every form once"))
    parser.add_argument("--forms", type=_forms, default=FORMS,
                        help=f"which forms, comma-separated (default {','.join(FORMS)}); the "
                             f"ratios need blocking")
    args = parser.parse_args()
    count = WARMUP + int(args.rate * args.seconds)

    from slipstream.daemon.driver import MediaDriver

    print(f"# a waiting receive's wake-up at {args.rate:,} messages/s, {machine()}, "
          f"load {os.getloadavg()[0]:.1f}")
    print(f"# command: python -m bench.aio_latency {' '.join(sys.argv[1:])}")
    scratch = scratch_directory()
    merged = {form: HdrHistogram(1, 1_000_000_000, 3) for form in args.forms}
    with MediaDriver.launch(directory=Path(scratch.name) / "driver") as driver:
        for _ in range(args.repeat):
            for form in args.forms:
                merged[form].add(run_form(str(driver.directory), form, count, args.rate))
    for form in args.forms:
        print(percentile_line(form, merged[form], 9, "wake-ups"))
    blocking = merged.get("blocking")
    for form in args.forms if blocking is not None else ():
        if form == "blocking":
            continue
        ratios = [merged[form].get_value_at_percentile(p) / blocking.get_value_at_percentile(p)
                  for p in (50, 99)]
        print(f"{form} / blocking: p50 {ratios[0]:.2f}x, p99 {ratios[1]:.2f}x")
    print(f"# load {os.getloadavg()[0]:.1f} at the end")
    scratch.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
