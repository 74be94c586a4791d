"""How often a client stops the application's own thread: a thread that spins in slipstream's
calls, waiting for the GIL while the client's other threads run Python, on a machine with
more busy threads than cores.

    .venv/bin/python -m bench.client_stalls [--seconds 10] [--repeat 3] [--set key=value ...]

One driver (its default settings unless ``--set``), one client and an IPC subscription with
nothing to read. The application's thread spins on ``poll()`` (``spins_before_yield=None``:
no yield of its own) beside two processes that spin on ``sched_yield``, so both vCPUs stay
busy. Reported for each run:
- the thread's voluntary context switches. It makes no blocking call of its own, so each one
  is a wait for the GIL;
- its gaps over 300 µs between two polls, and how many of them had such a switch in them.

The peer is the same loop, with the same counting, over a non-blocking ``recv`` of a UDP
socket, and no client. Its gaps are what the busy machine alone costs.
"""

from __future__ import annotations

import multiprocessing
import os
import resource
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path

from bench.ipc_throughput import (
    add_driver_settings,
    bench_parser,
    print_header,
    scratch_directory,
)

GAP_NS = 300_000


def _spin() -> None:
    while True:
        os.sched_yield()


def _stalls(step: Callable[[], object], seconds: float) -> tuple[int, int, int, int]:
    """Run ``step`` in a loop for ``seconds``: (voluntary context switches, gaps over
    GAP_NS, those with a voluntary switch in them, the total µs of those)."""
    switches = resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw
    first_switches = switches
    gaps = blocked = blocked_ns = 0
    last = time.monotonic_ns()
    end = last + int(seconds * 1e9)
    while last < end:
        step()
        now = time.monotonic_ns()
        seen = resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw
        if now - last > GAP_NS:
            gaps += 1
            if seen != switches:
                blocked += 1
                blocked_ns += now - last
        switches = seen
        last = now
    return switches - first_switches, gaps, blocked, blocked_ns // 1000


def main() -> int:
    parser = bench_parser(__doc__,
                          seconds=(10.0, "each loop's duration"),
                          repeat=(3, "runs of each loop, in turns"))
    add_driver_settings(parser, "a driver setting")
    args = parser.parse_args()
    settings = dict(args.settings)

    from slipstream.client import Client
    from slipstream.daemon.driver import MediaDriver

    print_header("an application thread spinning beside two busy processes", "bench.client_stalls")
    scratch = scratch_directory()
    context = multiprocessing.get_context("spawn")
    spinners = [context.Process(target=_spin, daemon=True) for _ in range(2)]
    for spinner in spinners:
        spinner.start()
    try:
        with MediaDriver.launch(directory=Path(scratch.name) / "driver", **settings) as driver:
            for _ in range(max(1, args.repeat)):
                with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
                    udp.bind(("127.0.0.1", 0))
                    udp.setblocking(False)

                    def recv(udp: socket.socket = udp) -> None:
                        try:
                            udp.recv(64)
                        except BlockingIOError:
                            pass

                    print(_line("UDP recv, no client", _stalls(recv, args.seconds)))
                with Client.connect(driver.directory, spins_before_yield=None) as client:
                    subscription = client.add_subscription("aeron:ipc", 5)

                    def poll(subscription=subscription) -> None:
                        subscription.poll(lambda data, header: None, 10)

                    print(_line("slipstream poll()", _stalls(poll, args.seconds)))
    finally:
        for spinner in spinners:
            spinner.terminate()
        scratch.cleanup()
    return 0


def _line(name: str, stalls: tuple[int, int, int, int]) -> str:
    switches, gaps, blocked, blocked_us = stalls
    return (f"{name:<20} {switches:>5} waits for the GIL   {gaps:>5} gaps > {GAP_NS // 1000} µs, "
            f"{blocked:>4} of them in such a wait ({blocked_us:,} µs in all)")


if __name__ == "__main__":
    sys.exit(main())
