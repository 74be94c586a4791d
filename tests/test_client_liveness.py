"""A client and its driver watch each other: an idle client (or one whose thread holds the
GIL) stays alive; a client notices its driver die, hang or restart within a keepalive
interval, never spins, and is told to connect again when the driver timed it out."""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers import (
    counters_of,
    lacking,
    process_state,
    publisher_limits,
    runnable_s,
    wait_for,
)

from slipstream.client import Client, DriverError, DriverNotRunningError, DriverTimeoutError
from slipstream.client.counters import CountersFile, CounterType, SystemCounter
from slipstream.daemon.config import load_settings
from slipstream.daemon.driver import MediaDriver


def test_an_idle_client_stays_alive_through_its_heartbeat_counter(driver, client: Client) -> None:
    def heartbeat() -> int:
        [info] = [c for c in client.counters
                  if c.type_id == CounterType.CLIENT_HEARTBEAT and c.owner_id == client.client_id]
        return info.value

    first = heartbeat()
    time.sleep(2.5)  # 2.5 x the test driver's client liveness timeout, with no command sent
    assert heartbeat() > first
    assert client.add_publication("aeron:ipc", 79).stream_id == 79
    assert CountersFile(Path(driver.directory) / "counters.dat").get(
        SystemCounter.CLIENT_TIMEOUTS) == 0


def in_time_namespace(offset_s: int) -> list[str]:
    """The command prefix that runs a process with its CLOCK_MONOTONIC ``offset_s`` seconds
    from this one's (a time namespace, as containers and checkpoint restores make).  Without
    root or unshare the test skips, and under CI=true (which runs as root) it fails."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        lacking("needs root and unshare, to run a process in a time namespace")
    prefix = ["unshare", "--fork", "--kill-child", "--time", "--monotonic", str(offset_s)]
    probe = subprocess.run([*prefix, "true"], capture_output=True, text=True)
    if probe.returncode != 0:  # no time namespaces in this kernel, or a clock left below 0
        lacking(f"cannot make a time namespace: {probe.stderr.strip()}")
    return prefix


@pytest.mark.parametrize("offset_s", [86_400, -30], ids=["a day ahead", "30 s behind"])
def test_a_client_on_another_monotonic_clock_is_kept_while_it_beats_and_timed_out_after(
        driver, offset_s: int) -> None:
    """A client whose monotonic clock is not the driver's writes its heartbeat on its own
    clock: the driver counts each change of it as a beat, on the driver's clock.  Alive, it is
    kept through three liveness timeouts (30 s behind, it was timed out after one); killed,
    it is timed out and its publication released (a day ahead, it was kept for a day)."""
    code = (f"import sys, time\n"
            f"from slipstream.client import Client\n"
            f"client = Client.connect({str(driver.directory)!r})\n"
            f"client.add_publication('aeron:ipc', 83)\n"
            f"print(time.monotonic(), flush=True)\n"
            f"time.sleep(600)\n")
    child = subprocess.Popen([*in_time_namespace(offset_s), sys.executable, "-c", code],
                             stdout=subprocess.PIPE, text=True)
    try:
        its_clock = float(child.stdout.readline())
        assert abs(its_clock - time.monotonic() - offset_s) < 10  # in the namespace
        time.sleep(3.0)  # three of the test driver's 1 s liveness timeouts
        assert counters_of(driver)["CLIENT_TIMEOUTS"] == 0
        assert publisher_limits(driver) == 1
    finally:
        child.kill()  # unshare --kill-child: the client goes with it, without closing
        child.wait()
    wait_for(lambda: counters_of(driver)["CLIENT_TIMEOUTS"] == 1, timeout=10,
             what="the killed client timed out")
    wait_for(lambda: publisher_limits(driver) == 0, timeout=10, what="its publication freed")


def test_a_client_stays_alive_while_its_application_thread_holds_the_gil(
        driver, client: Client) -> None:
    """The keepalives do not wait for the GIL: a C call that keeps it 2.5 s (2.5 x the test
    driver's client liveness timeout) does not get the client timed out."""
    ctypes.PyDLL(None).usleep(2_500_000)  # PyDLL: the GIL stays held through the call
    assert client.add_publication("aeron:ipc", 80).stream_id == 80
    assert CountersFile(Path(driver.directory) / "counters.dat").get(
        SystemCounter.CLIENT_TIMEOUTS) == 0


def test_a_client_notices_when_its_driver_dies(driver_dir: Path) -> None:
    with MediaDriver.launch(directory=driver_dir, driver_timeout="500ms",
                            client_keepalive_interval="100ms") as driver:
        client = Client.connect(driver_dir)
        publication = client.add_publication("aeron:ipc", 12)
        driver.kill()
        deadline = time.monotonic() + 5
        while not client.is_closed:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert publication.offer(b"x") == -4  # CLOSED
        with pytest.raises(DriverError):
            client.add_publication("aeron:ipc", 13)
        client.close()


def test_a_publication_cut_off_by_its_drivers_death_is_still_unmapped_on_close(
        driver_dir: Path) -> None:
    """Losing the driver makes offers say CLOSED at once, but the log stays mapped (a thread
    may be inside an offer): close(), of the publication or of the client, still unmaps it
    after the resource linger, or an application that reconnects after each restart of its
    driver leaks a log (192 MiB for IPC) per publication per restart."""
    from slipstream.client.client import RESOURCE_LINGER_S

    with MediaDriver.launch(directory=driver_dir, driver_timeout="500ms",
                            client_keepalive_interval="100ms") as driver:
        client = Client.connect(driver_dir)
        closed_alone = client.add_publication("aeron:ipc", 16)
        closed_with_the_client = client.add_publication("aeron:ipc", 17)
        driver.kill()
        wait_for(lambda: client.is_closed, timeout=5, what="the client noticed")
        assert closed_alone.is_closed and not closed_alone._log.closed
        closed_alone.close()
        client.close()
        time.sleep(RESOURCE_LINGER_S + 0.5)
        assert closed_alone._log.closed and closed_with_the_client._log.closed


_TIMED_OUT_CLIENT = """
import os, signal, sys, time
from slipstream.client import Client, DriverNotRunningError
client = Client.connect(sys.argv[1])
os.kill(os.getpid(), signal.SIGSTOP)  # the test continues it after client_liveness_timeout
deadline = time.monotonic() + 10
while not client.is_closed and time.monotonic() < deadline:
    time.sleep(0.01)
try:
    client.add_publication("aeron:ipc", 5)
except DriverNotRunningError as e:
    print(e)
"""


def test_a_client_the_driver_timed_out_is_told_to_connect_again_not_to_start_a_driver(
        driver) -> None:
    """A client stopped for longer than client_liveness_timeout (SIGSTOP) comes back to a
    driver that still runs and has timed it out: the error says so, and that a new client
    is the fix (it told the user to start a driver, which then refused: one was running)."""
    child = subprocess.Popen([sys.executable, "-c", _TIMED_OUT_CLIENT, str(driver.directory)],
                             stdout=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: process_state(child.pid) == "T", what="the client stopped itself")
        wait_for(lambda: counters_of(driver)["CLIENT_TIMEOUTS"] == 1, timeout=10,
                 what="the driver timed the client out")
        os.kill(child.pid, signal.SIGCONT)
        output, _ = child.communicate(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert "no longer serves this client" in output and "timed this client out" in output
    assert "connect again" in output and "start one" not in output


@pytest.mark.unit
def test_the_process_token_is_one_per_process_and_new_in_a_forked_child() -> None:
    """What CONNECT carries to tell an application's clients from another process's."""
    from slipstream.client import control

    tokens: list[int] = []
    threads = [threading.Thread(target=lambda: tokens.append(control.process_token()))
               for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert set(tokens) == {control.process_token()}
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:
        try:
            os.write(write_end, control.process_token().to_bytes(8, "little"))
        finally:
            os._exit(0)
    os.close(write_end)
    try:
        wait_for(lambda: os.waitpid(child, os.WNOHANG)[0] == child, timeout=10,
                 what="the forked child exited")
        assert int.from_bytes(os.read(read_end, 8), "little") != control.process_token()
    finally:
        os.close(read_end)
        with contextlib.suppress(ChildProcessError, ProcessLookupError):
            os.kill(child, signal.SIGKILL)
            os.waitpid(child, 0)


def test_a_client_notices_when_its_driver_hangs(driver_dir: Path) -> None:
    """A driver that stops (SIGSTOP) keeps its lock: its clients notice its heartbeat stopped,
    after driver_timeout and within a keepalive interval of it."""
    with MediaDriver.launch(directory=driver_dir, driver_timeout="500ms",
                            client_keepalive_interval="100ms") as driver:
        client = Client.connect(driver_dir)
        publication = client.add_publication("aeron:ipc", 15)
        os.kill(driver.pid, signal.SIGSTOP)
        try:
            stopped = time.monotonic()
            deadline = stopped + 5
            while not client.is_closed:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            # Never before driver_timeout: the last beat, frozen since, is older than that.
            assert time.time_ns() - client.counters.driver_heartbeat_ns > 500_000_000
            assert publication.offer(b"x") == -4  # CLOSED
            with pytest.raises(DriverNotRunningError, match="no heartbeat for"):
                client.add_publication("aeron:ipc", 16)
            # A new client is not told that no driver runs: one holds the lock, and starting
            # another would be refused.
            with pytest.raises(DriverTimeoutError, match="holds its lock but did not answer"):
                Client.connect(driver_dir, timeout=0.5)
        finally:
            os.kill(driver.pid, signal.SIGCONT)
        client.close()


def test_a_client_notices_when_its_driver_is_restarted_between_two_keepalives(
        driver_dir: Path) -> None:
    """systemd restarts a crashed driver at once: the new one may hold the lock again before
    the client next looks. The client still notices within a keepalive interval (its
    counters file is no longer the driver's), not after driver_timeout (10 s)."""
    keepalive_s = 3
    driver_timeout_s = load_settings(env={}).driver_timeout / 1e9
    settings = {"client_keepalive_interval": f"{keepalive_s}s", "client_liveness_timeout": "10s"}
    with MediaDriver.launch(directory=driver_dir, **settings) as driver:
        client = Client.connect(driver_dir)  # its keepalive thread looks now, then every 3 s
        driver.kill()
    with MediaDriver.launch(directory=driver_dir, **settings):
        restarted = time.monotonic()
        deadline = restarted + driver_timeout_s
        while not client.is_closed:
            assert time.monotonic() < deadline, "not noticed before the driver timeout"
            time.sleep(0.05)
        # Half the way from the keepalive interval to the driver timeout: a loaded machine's.
        assert time.monotonic() - restarted < (keepalive_s + driver_timeout_s) / 2
        # Either reason ("the driver exited", and "..., and a new one took its directory"
        # when it was restarted before the client's next look): in time either way.
        with pytest.raises(DriverNotRunningError, match="the driver exited"):
            client.add_publication("aeron:ipc", 17)
        client.close()


def test_a_request_to_a_driver_that_hangs_ends_when_the_client_notices(
        driver_dir: Path) -> None:
    """The request does not wait for its own timeout (30 s here): the driver's heartbeat
    stopped, and the client says so within driver_timeout and a keepalive interval."""
    with MediaDriver.launch(directory=driver_dir, driver_timeout="500ms",
                            client_keepalive_interval="100ms") as driver:
        request_timeout_s = 30
        client = Client.connect(driver_dir, timeout=request_timeout_s)
        os.kill(driver.pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            with pytest.raises(DriverNotRunningError, match="no heartbeat for"):
                client.add_publication("aeron:ipc", 18)
            assert time.monotonic() - started < request_timeout_s / 2  # not its own timeout
        finally:
            os.kill(driver.pid, signal.SIGCONT)
        client.close()


def test_a_client_whose_driver_exited_raises_at_once_and_never_spins(driver_dir: Path) -> None:
    with MediaDriver.launch(directory=driver_dir) as driver:  # default timers: a 10 s timeout
        client = Client.connect(driver_dir)
        subscription = client.add_subscription("aeron:ipc", 14)
        publication = client.add_publication("aeron:ipc", 14)
        while not publication.is_connected:
            time.sleep(0.01)
        woke: list[BaseException] = []

        def wait() -> None:
            try:
                subscription.receive(lambda d, h: None, 10, timeout=30)
            except BaseException as e:
                woke.append(e)

        waiter = threading.Thread(target=wait)
        waiter.start()
        started = time.monotonic()
        driver.stop()
        driver_timeout_s = load_settings(env={}).driver_timeout / 1e9
        waiter.join(driver_timeout_s)
        # The driver let go of its lock: noticed within a keepalive interval, not after the
        # driver timeout (half of it: a loaded machine's room), and the parked receive was
        # woken to say so.
        assert time.monotonic() - started < driver_timeout_s / 2
        assert [type(e) for e in woke] == [DriverNotRunningError]
        with pytest.raises(DriverNotRunningError):
            subscription.poll(lambda d, h: None)
        assert publication.offer(b"x") == -4  # CLOSED, as Aeron's
        # No thread of this process spins: one that did would be runnable (on a CPU or
        # waiting for one) all of the second, however loaded the machine.
        before = runnable_s(all_threads=True)
        time.sleep(1.0)
        runnable = runnable_s(all_threads=True) - before
        assert runnable < 1.0 / 4, f"the orphaned client's threads ran {runnable:.2f} s of 1 s"
        client.close()

