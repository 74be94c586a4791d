"""The driver as a systemd service: the unit passes systemd's own checks, and the driver speaks
the notify protocol to a real ``$NOTIFY_SOCKET`` (READY once it accepts clients, STATUS,
STOPPING, watchdog pings at half the interval, and none while a loop is stuck)."""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
from helpers import FAST_DRIVER_SETTINGS, counters_of, lacking, wait_for

from slipstream.client import Client
from slipstream.daemon.agents.commands import SetPressureStep
from slipstream.daemon.agents.sender import Sender
from slipstream.daemon.config import load_settings
from slipstream.daemon.driver import MediaDriver
from slipstream.daemon.ops.systemd import Notifier, Watchdog, watchdog_interval_ns
from slipstream.daemon.shell import _DriverShell

UNIT = Path(__file__).parent.parent / "systemd" / "slipstream-driver.service"
INSTALLED_BINARY = "/opt/slipstream/.venv/bin/slipstream"


def _systemd_analyze() -> str:
    path = shutil.which("systemd-analyze")
    if path is None:
        lacking("systemd-analyze is missing (Debian package systemd; make test installs it: "
                "scripts/ensure-tools)")
    return path


def _analyze(*args: str) -> subprocess.CompletedProcess[str]:
    """``systemd-analyze ARGS``.  Its offline manager touches /run/systemd/systemd-units-load,
    which is on disk where /run is (this machine): as root it runs in a mount namespace of its
    own, with a tmpfs there."""
    command = [_systemd_analyze(), *args]
    if os.geteuid() == 0 and shutil.which("unshare") and Path("/run/systemd").is_dir():
        command = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                   'mount -t tmpfs slipstream-test /run/systemd && exec "$@"', "sh", *command]
    return subprocess.run(command, capture_output=True, text=True, timeout=60)


@pytest.fixture
def installed_unit(tmp_path: Path) -> Path:
    """The unit as the README installs it, with ExecStart at this checkout's venv (verify
    checks that the binary exists)."""
    binary = Path(sys.executable).parent / "slipstream"
    assert binary.exists()
    unit = tmp_path / UNIT.name
    unit.write_text(UNIT.read_text().replace(INSTALLED_BINARY, str(binary)))
    return unit


def test_the_unit_passes_systemd_analyze_verify(installed_unit: Path) -> None:
    assert INSTALLED_BINARY in UNIT.read_text()
    result = _analyze("verify", str(installed_unit))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "slipstream-driver.service" not in result.stderr  # no warning about the unit


def test_the_units_exposure_is_under_three(installed_unit: Path) -> None:
    result = _analyze("security", "--offline=true", "--no-pager", str(installed_unit))
    match = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", result.stdout)
    assert match, result.stdout + result.stderr
    assert float(match.group(1)) < 3.0, result.stdout


def _unit_lines(key: str) -> list[str]:
    return [line.split("=", 1)[1] for line in UNIT.read_text().splitlines()
            if line.startswith(f"{key}=")]


def test_the_units_settings_are_the_drivers_and_its_sandbox_lets_it_serve_its_group() -> None:
    """Offline, what a booted systemd showed (tests/test_systemd_boot.py runs it): a
    ``SLIPSTREAM_`` variable the driver does not know would be passed over in silence; the
    lines that had to change to let the driver start and serve other users stay changed."""
    from slipstream.daemon.config import ENV_PREFIX, SETTINGS

    variables = dict(value.split("=", 1) for value in _unit_lines("Environment"))
    for name in variables:
        assert name.startswith(ENV_PREFIX) and name[len(ENV_PREFIX):].lower() in SETTINGS, name
    # The clients are the group's: the driver's own group, so its user is a member.
    assert variables["SLIPSTREAM_CLIENT_GROUP"] == _unit_lines("Group")[0]
    # Another user's uid is nobody inside a user namespace: SO_PEERCRED could not admit it.
    assert _unit_lines("PrivateUsers") in ([], ["no"])
    # The client group is the driver's own: its directory needs no setgid bit and its files
    # no change of group, so both stay refused.
    assert _unit_lines("RestrictSUIDSGID") == ["yes"]
    # libzmq's I/O thread calls sched_setscheduler at start and aborts if refused: allowed
    # after the line that refuses its group, and nothing else of @privileged or @resources.
    filters = _unit_lines("SystemCallFilter")
    refusing = filters.index("~@privileged @resources")
    allowed = " ".join(f for f in filters[refusing + 1:] if not f.startswith("~")).split()
    assert allowed == ["sched_setscheduler"], filters
    assert _unit_lines("RestrictRealtime") == ["yes"]  # still no realtime policy


class NotifySocket:
    """A real notify socket, as systemd's: records each datagram with its arrival time."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.05)
        self.messages: list[tuple[float, str]] = []
        self._stop = False
        self._thread = threading.Thread(target=self._receive, daemon=True)
        self._thread.start()

    def _receive(self) -> None:
        while not self._stop:
            try:
                data = self.sock.recv(4096)
            except TimeoutError:
                continue
            self.messages.append((time.monotonic(), data.decode()))

    def wait_for(self, state: str, timeout: float = 20.0) -> float:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for at, message in list(self.messages):
                if message == state or message.startswith(state):
                    return at
            time.sleep(0.005)
        raise AssertionError(f"no {state!r} within {timeout} s: {self.messages}")

    def times_of(self, state: str, since: float = 0.0, until: float = float("inf")) -> list[float]:
        return [at for at, message in list(self.messages)
                if message == state and since <= at <= until]

    def close(self) -> None:
        self._stop = True
        self._thread.join()
        self.sock.close()


@pytest.fixture
def notify_socket(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[NotifySocket]:
    receiver = NotifySocket(tmp_path / "notify")
    monkeypatch.setenv("NOTIFY_SOCKET", str(receiver.path))
    yield receiver
    receiver.close()


def test_ready_comes_once_the_driver_accepts_clients_then_status_and_stopping(
        driver_dir: Path, notify_socket: NotifySocket) -> None:
    with MediaDriver.launch(directory=driver_dir, **FAST_DRIVER_SETTINGS) as driver:
        notify_socket.wait_for("READY=1")
        with Client.connect(driver_dir, timeout=2.0) as client:  # at once: it serves
            client.add_publication("aeron:ipc", 10)
            client.add_subscription("aeron:ipc", 10)
            notify_socket.wait_for("STATUS=1 clients, 1 publications, 1 subscriptions")
        driver.stop()
    stopping = notify_socket.wait_for("STOPPING=1")
    [ready] = notify_socket.times_of("READY=1")
    assert ready < stopping
    assert not notify_socket.times_of("WATCHDOG=1")  # no WatchdogSec=, no pings


def test_the_watchdog_pings_at_half_the_interval_also_when_idle(
        driver_dir: Path, notify_socket: NotifySocket,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WATCHDOG_USEC", "600000")  # 600 ms: a ping every 300 ms
    with MediaDriver.launch(directory=driver_dir, **FAST_DRIVER_SETTINGS):
        started = notify_socket.wait_for("READY=1")
        time.sleep(3.0)  # idle: the loops park, and still cycle
        pings = notify_socket.times_of("WATCHDOG=1", since=started)
    gaps = [b - a for a, b in itertools.pairwise(pings)]
    assert 8 <= len(pings) <= 12, pings
    assert min(gaps) >= 0.25 and max(gaps) < 0.6, gaps


def test_watchdog_variables_meant_for_another_process_are_ignored() -> None:
    assert watchdog_interval_ns({"WATCHDOG_USEC": "5000000"}) == 5_000_000_000
    assert watchdog_interval_ns({"WATCHDOG_USEC": "5000000",
                                 "WATCHDOG_PID": str(os.getpid())}) == 5_000_000_000
    assert watchdog_interval_ns({"WATCHDOG_USEC": "5000000", "WATCHDOG_PID": "1"}) is None
    assert watchdog_interval_ns({"WATCHDOG_USEC": "0"}) is None
    assert watchdog_interval_ns({"WATCHDOG_USEC": "soon"}) is None
    assert watchdog_interval_ns({}) is None


def test_a_stale_network_thread_stops_the_pings(notify_socket: NotifySocket) -> None:
    last_cycle_ns = [0]
    watchdog = Watchdog(Notifier(), 1_000_000_000, [lambda: last_cycle_ns[0]])
    watchdog.on_duty_cycle(400_000_000)  # the thread cycled 0.4 s ago: a ping
    watchdog.on_duty_cycle(800_000_000)  # not yet due
    watchdog.on_duty_cycle(1_000_000_000)  # due, but the thread is 1 s stale
    last_cycle_ns[0] = 1_100_000_000
    watchdog.on_duty_cycle(1_200_000_000)  # due and alive: a ping
    notify_socket.wait_for("WATCHDOG=1")
    time.sleep(0.1)
    assert watchdog.pings == 2 and len(notify_socket.times_of("WATCHDOG=1")) == 2


async def test_no_watchdog_ping_while_the_network_loop_is_stuck(
        notify_socket: NotifySocket, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real driver shell in this process, its sender's duty cycle blocked for 2 s: the pings
    stop within the interval and resume after."""
    monkeypatch.setenv("WATCHDOG_USEC", "500000")
    stuck = threading.Event()
    stalled_at: list[float] = []
    senders: list[Sender] = []
    do_python_work = Sender.do_python_work

    def blocking_do_python_work(self: Sender, now_ns: int) -> int:
        senders.append(self)
        if stuck.is_set():
            stuck.clear()
            stalled_at.append(time.monotonic())
            time.sleep(2.0)  # a loop stuck in a call that never returns, for a while
        return do_python_work(self, now_ns)

    monkeypatch.setattr(Sender, "do_python_work", blocking_do_python_work)
    directory = Path("/dev/shm") / f"slipstream-test-{uuid.uuid4().hex[:12]}"
    settings = load_settings(env={}, overrides={**FAST_DRIVER_SETTINGS, "dir": str(directory)})
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(_DriverShell(settings).run)
            await trio.sleep(1.0)
            stuck.set()
            # A command that changes nothing: the sender's Python half runs next.
            senders[0].enqueue(SetPressureStep(senders[0].pressure_step))
            await trio.sleep(3.5)
            nursery.cancel_scope.cancel()
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    [stalled] = stalled_at
    before = notify_socket.times_of("WATCHDOG=1", until=stalled)
    # Once the thread's last cycle is older than half the interval (0.25 s) no ping goes,
    # until the thread is back (2 s after the stall began).
    during = notify_socket.times_of("WATCHDOG=1", since=stalled + 0.3, until=stalled + 1.95)
    after = notify_socket.times_of("WATCHDOG=1", since=stalled + 2.05)
    assert len(before) >= 3 and not during and len(after) >= 2, notify_socket.messages


def test_a_notify_socket_nobody_reads_never_blocks_the_driver(
        driver_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """systemd busy (or any reader that falls behind): the socket is full before the driver
    starts and never read.  The driver still serves, keeps its heartbeat, counts what the
    socket refused, and stops at SIGINT."""
    path = tmp_path / "notify-never-read"
    reader = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    reader.bind(str(path))
    filler = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK)
    with contextlib.suppress(BlockingIOError):
        while True:
            filler.sendto(b"X" * 64, str(path))
    monkeypatch.setenv("NOTIFY_SOCKET", str(path))
    monkeypatch.setenv("WATCHDOG_USEC", "100000")  # a ping every 50 ms, each refused
    try:
        with MediaDriver.launch(directory=driver_dir, **FAST_DRIVER_SETTINGS) as driver:
            with Client.connect(driver_dir, timeout=2.0) as client:
                publication = client.add_publication("aeron:ipc", 11)
                subscription = client.add_subscription("aeron:ipc", 11)
                beat = client.counters.driver_heartbeat_ns
                time.sleep(2.5)  # past the client liveness timeout of FAST_DRIVER_SETTINGS
                assert client.counters.driver_heartbeat_ns > beat
                wait_for(lambda: publication.offer(b"served") > 0, what="an offer")
                got: list[bytes] = []
                subscription.receive(lambda data, _h: got.append(bytes(data)), timeout=5)
                assert got == [b"served"]
            assert counters_of(driver)["NOTIFY_DROPS"] >= 20  # READY, STATUS and pings
            # systemd catches up: READY=1, refused at the start, is sent again until taken.
            reader.settimeout(0.1)
            deadline, states = time.monotonic() + 5, []
            while b"READY=1" not in states and time.monotonic() < deadline:
                with contextlib.suppress(TimeoutError):
                    states.append(reader.recv(4096))
            assert b"READY=1" in states
            driver.process.send_signal(signal.SIGINT)
            assert driver.process.wait(10) == 0
    finally:
        filler.close()
        reader.close()
