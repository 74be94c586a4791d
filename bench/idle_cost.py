"""What an idle driver costs (the target: under 2 % of a core with streams open and nothing
sent).  Three drivers run side by side in the same windows: a bare one (no client, no
stream), one with an IPC stream open (a publication and its subscriber, connected), and one
with a UDP stream open to itself (the sender's heartbeats and the receiver's status messages
go on).  Prints, for each, over R windows:

* its CPU share, % of a core (utime + stime of every thread, from ``/proc/<pid>/stat``);
* its wake-ups a second (``schedstat``'s run count, summed over its threads);
* the ratio of its CPU share to the bare driver's in the same window: what an idle stream
  adds, told apart from what the machine's load makes any wake-up cost.

    .venv/bin/python -m bench.idle_cost [--seconds S] [--repeat R] [--set KEY=VALUE ...]

Each figure is the median of R windows, with their spread (min-max); the ratios are the
median (and spread) of the R per-window ratios.  The tests (tests/test_driver_idle.py,
tests/test_udp_failures.py) bound the wake-ups by the timers that ring; this is the CPU.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import time
from pathlib import Path

from bench.ipc_throughput import (
    add_driver_settings,
    bench_parser,
    positive_int,
    print_header,
    scratch_directory,
)
from bench.udp_throughput import free_port

SETTLE_S = 1.0  # after the streams connect: the drivers reach their idle back-off


def cpu_s(pid: int) -> float:
    """CPU seconds process ``pid`` has used: utime + stime of all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def timeslices(pid: int) -> int:
    """How many times the threads of ``pid`` were put on a CPU (schedstat's run count)."""
    runs = 0
    for path in Path(f"/proc/{pid}/task").glob("*/schedstat"):
        with contextlib.suppress(OSError):  # a thread ended
            runs += int(path.read_text().split()[2])
    return runs


def _spread(values: list[float], spec: str) -> str:
    return (f"{statistics.median(values):{spec}} "
            f"({min(values):{spec}}-{max(values):{spec}})")


def main() -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--seconds", type=positive_int, default=5, help="seconds per window")
    parser.add_argument("--repeat", type=positive_int, default=3, help="windows")
    add_driver_settings(parser)
    args = parser.parse_args()

    from slipstream.client import Client
    from slipstream.daemon.driver import MediaDriver

    settings = dict(args.settings)
    print_header("an idle driver's cost", "bench.idle_cost", settings)
    scratch = scratch_directory()
    directory = Path(scratch.name)
    names = ("bare", "ipc stream", "udp stream")
    with contextlib.ExitStack() as stack:
        drivers = [stack.enter_context(MediaDriver.launch(directory=directory / name.split()[0],
                                                          **settings)) for name in names]
        publications = []
        for driver, uri in ((drivers[1], "aeron:ipc"),
                            (drivers[2], f"aeron:udp?endpoint=127.0.0.1:{free_port()}")):
            client = stack.enter_context(Client.connect(driver.directory))
            client.add_subscription(uri, 10)
            publications.append(client.add_publication(uri, 10))
        deadline = time.monotonic() + 30
        while not all(p.is_connected for p in publications):
            if time.monotonic() > deadline:
                print("# the streams did not connect within 30 s", flush=True)
                return 1
            time.sleep(0.01)
        time.sleep(SETTLE_S)
        shares: list[list[float]] = [[] for _ in names]
        wakeups: list[list[float]] = [[] for _ in names]
        for _ in range(args.repeat):
            cpu = [cpu_s(d.pid) for d in drivers]
            runs = [timeslices(d.pid) for d in drivers]
            started = time.monotonic()
            time.sleep(args.seconds)
            took = time.monotonic() - started
            for i, driver in enumerate(drivers):
                shares[i].append((cpu_s(driver.pid) - cpu[i]) / took * 100)
                wakeups[i].append((timeslices(driver.pid) - runs[i]) / took)
    for i, name in enumerate(names):
        line = (f"{name:>11}: cpu {_spread(shares[i], '.2f')} % of a core"
                f"   wake-ups {_spread(wakeups[i], '.1f')}/s")
        if i:
            # A bare driver that used no tick in a window: its ratio is left out.
            ratios = [s / b for s, b in zip(shares[i], shares[0], strict=True) if b]
            line += (f"   / bare: {_spread(ratios, '.2f')}x" if ratios
                     else "   / bare: (bare used no measurable CPU)")
        print(line, flush=True)
    scratch.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
