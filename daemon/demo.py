"""``slipstream demo`` (what ``make run`` starts): a driver with the default configuration and
two streams, each with a publisher and a subscriber in processes of their own: one over shared
memory (``aeron:ipc``) and one over UDP multicast on loopback (every datagram leaves the
driver's socket and comes back through the kernel; no root needed).  The UDP stream loses 1 %
of its datagrams on purpose (``debug_receive_data_loss``), so NAKs and retransmits show.  Every
second it prints each stream's rate and the network's counters."""

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
from slipstream.client.layout import FRAME_ALIGNMENT, HEADER_LENGTH, align
from slipstream.daemon.driver import MediaDriver

IPC_CHANNEL = "aeron:ipc"
UDP_CHANNEL = "aeron:udp?endpoint=224.0.1.1:40456|interface=127.0.0.1"
STREAM_ID = 1001
#: Per million UDP datagrams the demo's driver drops on receipt, so recovery shows.
DEMO_LOSS = 10_000


def _publisher(directory: str, channel: str, rate: int, size: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops us
    with Client.connect(directory) as client:
        publication = client.add_publication(channel, STREAM_ID)
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


def _subscriber(directory: str, channel: str) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    expected = [None]

    def handler(data: memoryview, header: object) -> None:
        sequence = int.from_bytes(data[:8], "little")
        if expected[0] is not None and sequence != expected[0]:
            print(f"subscriber on {channel}: expected message {expected[0]}, got {sequence}",
                  flush=True)
        expected[0] = sequence + 1

    with Client.connect(directory) as client:
        subscription = client.add_subscription(channel, STREAM_ID)
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
          f"{'full speed' if not rate else f'{rate:,}/s'} on {IPC_CHANNEL} and on "
          f"{UDP_CHANNEL} (1 % of its datagrams dropped on purpose); Ctrl-C stops", flush=True)
    # SIGTERM (systemctl stop, kill) stops the demo as cleanly as Ctrl-C: driver included.
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        return _run(path, context, rate, size, duration)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _run(path: Path, context: Any, rate: int, size: int, duration: float) -> int:
    with MediaDriver.launch(directory=path, debug_receive_data_loss=DEMO_LOSS) as driver:
        subscribers = [context.Process(target=_subscriber, args=(str(path), channel),
                                       daemon=True) for channel in (IPC_CHANNEL, UDP_CHANNEL)]
        publishers = [context.Process(target=_publisher, args=(str(path), channel, rate, size),
                                      daemon=True) for channel in (IPC_CHANNEL, UDP_CHANNEL)]
        for process in subscribers:
            process.start()
        time.sleep(0.5)
        for process in publishers:
            process.start()
        try:
            _report(driver, duration, size)
        except KeyboardInterrupt:
            pass
        finally:
            for process in (*publishers, *subscribers):
                process.terminate()
                process.join(5)
        print("slipstream demo: stopped", flush=True)
    return 0


def _report(driver: MediaDriver, duration: float, size: int) -> None:
    from slipstream.client.counters import CountersFile

    counters = CountersFile(driver.directory / "counters.dat", writable=False)
    frame = align(HEADER_LENGTH + size, FRAME_ALIGNMENT)  # bytes of log per message
    start = last_time = time.monotonic()
    last: dict[str, float] = {}
    try:
        while not duration or time.monotonic() - start < duration:
            time.sleep(1.0)
            now = time.monotonic()
            # The subscribers' positions are exact, so the rates shown are what arrived.
            received = {"ipc": 0.0, "udp": 0.0}
            send_position = send_limit = 0
            for info in counters:
                kind = "udp" if "aeron:udp" in info.label else "ipc"
                if info.type_id == CounterType.SUBSCRIBER_POSITION:
                    received[kind] += info.value / frame
                elif info.type_id == CounterType.SENDER_POSITION:
                    send_position = info.value
                elif info.type_id == CounterType.SENDER_LIMIT:
                    send_limit = info.value
            elapsed = now - last_time
            rates = {k: (v - last[k]) / elapsed if k in last else 0.0 for k, v in received.items()}
            print(f"[{now - start:6.1f} s] ipc {received['ipc']:>12,.0f} msgs "
                  f"({rates['ipc']:>9,.0f}/s)   udp {received['udp']:>12,.0f} msgs "
                  f"({rates['udp']:>9,.0f}/s)"
                  f"   NAKs {counters.get(SystemCounter.NAK_MESSAGES_SENT):,}"
                  f"  retransmits {counters.get(SystemCounter.RETRANSMITS_SENT):,}"
                  f"  flow-control window {(send_limit - send_position) / 1024:,.0f} KiB"
                  f"  back-pressure {counters.get(SystemCounter.BACK_PRESSURE_EVENTS):,}",
                  flush=True)
            last, last_time = received, now
    finally:
        counters.close()
