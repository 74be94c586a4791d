"""``slipstream stat``: the driver's counters as a live table (Aeron's AeronStat)."""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

from slipstream.client import control
from slipstream.client.client import _driver_holds_lock, default_directory
from slipstream.client.counters import CounterInfo, CountersFile, CounterType
from slipstream.client.errors import DriverNotRunningError


def _type_name(type_id: int) -> str:
    try:
        return CounterType(type_id).name.lower()
    except ValueError:
        return str(type_id)


def render(counters: list[CounterInfo], previous: dict[int, int], elapsed_s: float,
           header: str, now_ns: int | None = None) -> str:
    """The table: id, type, value, rate per second since the last frame, label.  A client
    heartbeat (a monotonic timestamp) shows as its age at ``now_ns`` (default: now)."""
    now_ns = time.monotonic_ns() if now_ns is None else now_ns
    lines = [header, f"{'id':>5} {'type':<20} {'value':>20} {'per second':>14}  label"]
    for info in counters:
        if info.type_id == CounterType.CLIENT_HEARTBEAT:
            value, rate = f"{(now_ns - info.value) // 1_000_000:,} ms ago", ""
        else:
            before = previous.get(info.counter_id)
            value = f"{info.value:,}"
            rate = ("" if before is None or elapsed_s <= 0
                    else f"{(info.value - before) / elapsed_s:,.0f}")
        lines.append(f"{info.counter_id:>5} {_type_name(info.type_id):<20} {value:>20} "
                     f"{rate:>14}  {info.label}")
    return "\n".join(lines)


def run_stat(directory: str | None, *, interval: float = 1.0, once: bool = False,
             match: str = "") -> int:
    """Print the counters of the driver in ``directory`` every ``interval`` s (or once)."""
    path = Path(directory) if directory else default_directory()
    counters_path = path / control.COUNTERS_FILE
    if not counters_path.exists() or not _driver_holds_lock(path):
        raise DriverNotRunningError(str(path), "no counters to show")
    counters = CountersFile(counters_path, writable=False)
    previous: dict[int, int] = {}
    last = time.monotonic()
    interactive = sys.stdout.isatty() and not once
    try:
        while True:
            now = time.monotonic()
            snapshot = [c for c in counters if match in c.label]
            age = (time.time_ns() - counters.driver_heartbeat_ns) / 1e9
            header = (f"slipstream driver pid {counters.driver_pid} in {path}  "
                      f"heartbeat {age:.1f} s ago  {time.strftime('%H:%M:%S')}")
            table = render(snapshot, previous, now - last, header)
            if interactive:
                rows = shutil.get_terminal_size().lines - 1
                table = "\n".join(table.splitlines()[:rows])
                sys.stdout.write("\x1b[H\x1b[2J" + table + "\n")
            else:
                sys.stdout.write(table + "\n\n")
            sys.stdout.flush()
            if once:
                return 0
            previous = {c.counter_id: c.value for c in snapshot}
            last = now
            time.sleep(interval)
            if not os.path.exists(counters_path):
                print("the driver stopped", file=sys.stderr)
                return 0
    except KeyboardInterrupt:
        return 0
    finally:
        counters.close()
