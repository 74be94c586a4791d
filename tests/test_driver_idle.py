"""An idle driver's cost: under 2 % of a core, and wake-ups only for its conductor
cycles."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

from helpers import counters_of, wait_for

from slipstream.client import Client
from slipstream.daemon.driver import MediaDriver


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_an_idle_driver_uses_under_two_percent_of_a_core(driver_dir: Path) -> None:
    with MediaDriver.launch(directory=driver_dir) as driver, Client.connect(driver_dir) as client:
        publication = client.add_publication("aeron:ipc", 10)
        client.add_subscription("aeron:ipc", 10)
        while not publication.is_connected:
            time.sleep(0.01)
        time.sleep(1.0)  # let it settle into its idle back-off
        before, started = _cpu_seconds(driver.pid), time.monotonic()
        time.sleep(3.0)
        used = (_cpu_seconds(driver.pid) - before) / (time.monotonic() - started)
    assert used < 0.02, f"an idle driver used {used:.1%} of a core"


def _thread_named(pid: int, name: str) -> int:
    """The one thread of ``pid`` called ``name`` (threads that end meanwhile are skipped)."""
    found = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):
            if Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip() == name:
                found.append(int(tid))
    [tid] = found
    return tid


def _voluntary_switches(pid: int, tid: int) -> int:
    status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
    return int(status.split("\nvoluntary_ctxt_switches:")[1].split()[0])


def test_a_calm_driver_wakes_only_for_its_conductor_cycles(driver_dir: Path) -> None:
    """A wake-up of the driver's main thread costs ~0.5 ms of Python (trio's loop and the
    cycle), which a busy data path on a small machine feels: calm, it wakes for its conductor
    cycles only (the command loop keeps no timer of its own), the thread that watches the
    clients' futex sleeps until one rings, and the client's conductor thread until the driver
    tells it something (or its safety net, every EVENTS_SAFETY_NET_S)."""
    from slipstream.client.conductor import EVENTS_SAFETY_NET_S

    with MediaDriver.launch(directory=driver_dir) as driver, Client.connect(driver_dir) as client:
        publication = client.add_publication("aeron:ipc", 12)
        client.add_subscription("aeron:ipc", 12)
        wait_for(lambda: publication.is_connected, what="the IPC publication connected")
        time.sleep(1.0)
        watched = [(driver.pid, driver.pid),
                   (driver.pid, _thread_named(driver.pid, "ss-driver-futex")),
                   (os.getpid(), client._conductor._thread.native_id)]
        before = [_voluntary_switches(*thread) for thread in watched]
        cycles_before = counters_of(driver)["CONDUCTOR_CYCLES"]
        time.sleep(4.0)
        main, watcher, client_thread = (_voluntary_switches(*thread) - then
                                        for thread, then in zip(watched, before, strict=True))
        cycles = counters_of(driver)["CONDUCTOR_CYCLES"] - cycles_before
    # Calm, about 4 cycles (timer_interval 1 s); a loaded machine may move the pressure
    # governor, whose samples are cycles too.  Before, a command-loop timer added one wake-up
    # a second of its own: 8 for 4 cycles.  The margin: a wait for the GIL of a network
    # thread's Python pass.
    assert cycles >= 3, f"{cycles} conductor cycles in 4 s"
    assert main <= cycles + 2, f"the main thread woke {main} times for {cycles} cycles"
    assert watcher == 0, f"the futex watcher woke {watcher} times"
    assert client_thread <= 4.0 // EVENTS_SAFETY_NET_S + 1, (
        f"the client's thread woke {client_thread} times")

