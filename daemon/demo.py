"""``slipstream demo`` (what ``make run`` starts): a driver with the default configuration, a
publisher and a subscriber in their own processes over ``aeron:ipc``, and live rates."""

from __future__ import annotations

import multiprocessing
import signal
import time
from pathlib import Path
from typing import Any

from slipstream.client import (
    BACK_PRESSURED,
    CLOSED,
    NOT_CONNECTED,
    Client,
    DriverNotRunningError,
    default_directory,
)
from slipstream.client.counters import CounterType, SystemCounter
from slipstream.daemon.driver import MediaDriver

CHANNEL = "aeron:ipc"
STREAM_ID = 1001


def _publisher(directory: str, rate: int, size: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops us
    with Client.connect(directory) as client:
        publication = client.add_publication(CHANNEL, STREAM_ID)
        message = bytearray(size)
        sequence = 0
        start = time.monotonic()
        while True:
            if rate:
                # Pace in bursts: sleep until the schedule says the next message is due.
                due = start + sequence / rate
                delay = due - time.monotonic()
                if delay > 0.001:
                    time.sleep(delay)
            message[:8] = sequence.to_bytes(8, "little")
            result = publication.offer(bytes(message))
            if result > 0:
                sequence += 1
            elif result in (BACK_PRESSURED, NOT_CONNECTED):
                time.sleep(0.0001)
            elif result == CLOSED:  # the driver is gone: so is the demo
                return


def _subscriber(directory: str) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    expected = [None]

    def handler(data: memoryview, header: object) -> None:
        sequence = int.from_bytes(data[:8], "little")
        if expected[0] is not None and sequence != expected[0]:
            print(f"subscriber: expected message {expected[0]}, got {sequence}", flush=True)
        expected[0] = sequence + 1

    with Client.connect(directory) as client:
        subscription = client.add_subscription(CHANNEL, STREAM_ID)
        try:
            while True:
                subscription.receive(handler, 256, timeout=1.0)
        except DriverNotRunningError:
            return  # the driver is gone: so is the demo


def run_demo(directory: str | None = None, rate: int = 100_000, size: int = 64,
             duration: float = 0.0) -> int:
    """Run the demo until Ctrl-C (or ``duration`` s); everything stops cleanly."""
    size = max(size, 8)
    path = Path(directory) if directory else default_directory()
    context = multiprocessing.get_context("spawn")
    print(f"slipstream demo: driver in {path}; {size} B messages at "
          f"{'full speed' if not rate else f'{rate:,}/s'}; Ctrl-C stops", flush=True)
    # SIGTERM (systemctl stop, kill) stops the demo as cleanly as Ctrl-C: driver included.
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        return _run(path, context, rate, size, duration)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _run(path: Path, context: Any, rate: int, size: int, duration: float) -> int:
    with MediaDriver.launch(directory=path) as driver:
        subscriber = context.Process(target=_subscriber, args=(str(path),), daemon=True)
        publisher = context.Process(target=_publisher, args=(str(path), rate, size), daemon=True)
        subscriber.start()
        time.sleep(0.5)
        publisher.start()
        try:
            _report(driver, duration, size)
        except KeyboardInterrupt:
            pass
        finally:
            for process in (publisher, subscriber):
                process.terminate()
                process.join(5)
        print("slipstream demo: stopped", flush=True)
    return 0


def _report(driver: MediaDriver, duration: float, size: int) -> None:
    from slipstream.client.counters import CountersFile

    counters = CountersFile(driver.directory / "counters.dat", writable=False)
    frame = (size + 32 + 31) & ~31  # bytes of log per message: header + payload, aligned
    start = last_time = time.monotonic()
    last: float | None = None
    try:
        while not duration or time.monotonic() - start < duration:
            time.sleep(1.0)
            now = time.monotonic()
            # The subscriber's position is exact (the publisher's counter is the driver's
            # periodic view of it), so the rate shown is what arrived.
            received = sum(info.value for info in counters
                           if info.type_id == CounterType.SUBSCRIBER_POSITION) / frame
            back_pressure = counters.get(SystemCounter.BACK_PRESSURE_EVENTS)
            rate = (received - last) / (now - last_time) if last is not None else 0.0
            print(f"[{now - start:6.1f} s] received {received:>12,.0f} msgs "
                  f"({rate:>10,.0f}/s)   back-pressure events {back_pressure:,}", flush=True)
            last, last_time = received, now
    finally:
        counters.close()
