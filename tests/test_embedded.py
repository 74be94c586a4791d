"""An embedded driver in invoker mode (``MediaDriver.embedded``): a whole driver inside the
application's process, with no thread of its own, that works when the application calls
``do_work`` (or a client connected with ``invoker=driver.do_work`` waits)."""

from __future__ import annotations

import itertools
import multiprocessing
import os
import random
import shutil
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from helpers import NETWORK_SETTINGS, counters_of, free_port, lacking, message
from test_names import STUCK_S

from slipstream.client import Client, ClosedError, ConfigurationError, DriverNotRunningError
from slipstream.daemon.driver import MediaDriver
from slipstream.daemon.embedded import EmbeddedDriver

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def embedded() -> Iterator[Callable[..., EmbeddedDriver]]:
    """Embedded drivers (each in its own directory), closed after the test."""
    drivers: list[EmbeddedDriver] = []

    def make(**settings: object) -> EmbeddedDriver:
        directory = Path("/dev/shm") / f"slipstream-embedded-{uuid.uuid4().hex[:12]}"
        driver = MediaDriver.embedded(directory, **{**NETWORK_SETTINGS, **settings})
        drivers.append(driver)
        return driver

    yield make
    for driver in reversed(drivers):
        driver.close()


def offer_ten(publication: Any, driver: EmbeddedDriver) -> None:
    """Offer messages 0..9 of 128 B, running ``driver`` while one is refused."""
    for i in range(10):
        while publication.offer(message(i, 128)) <= 0:
            driver.do_work()


def run_until(condition: Callable[[], object], *drivers: EmbeddedDriver,
              timeout: float = 10.0, what: str = "the condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not come within {timeout} s"
        if not sum(driver.do_work() for driver in drivers):
            time.sleep(0.0001)


def test_two_embedded_drivers_carry_a_udp_stream_exactly_once_in_order(embedded) -> None:
    """20,000 messages of mixed sizes (fragmented ones too) through 64 KiB terms that rotate
    many times, each driver run only by its application's calls."""
    a, b = embedded(), embedded()
    uri = f"aeron:udp?endpoint=127.0.0.1:{free_port()}"
    with Client.connect(a.directory, invoker=a.do_work) as ca, \
            Client.connect(b.directory, invoker=b.do_work) as cb:
        subscription = cb.add_subscription(uri, 1001)
        publication = ca.add_publication(uri, 1001)
        run_until(lambda: publication.is_connected and subscription.images, a, b,
                  what="the stream connected")
        seen: list[bytes] = []
        sent = 0
        count = 20_000

        def size(i: int) -> int:
            return (32, 1376, 5000, 200)[i % 4]

        deadline = time.monotonic() + 60
        while len(seen) < count:
            assert time.monotonic() < deadline, f"{len(seen)} of {count} arrived"
            while sent < count and publication.offer(message(sent, size(sent))) > 0:
                sent += 1
            ca.do_work()
            cb.do_work()
            subscription.poll(lambda data, _h: seen.append(bytes(data)), 100)
        assert seen == [message(i, size(i)) for i in range(count)]
        publication.close()
        run_until(lambda: not subscription.images, a, b, what="the image went away")
    sent_counters, received = counters_of(a), counters_of(b)
    # It counts what a daemon counts.
    assert sent_counters["BYTES_SENT"] >= received["BYTES_RECEIVED"] > count * 1600
    assert received["STATUS_MESSAGES_SENT"] > 0 and sent_counters["CONDUCTOR_CYCLES"] > 0
    # Its duty cycles, as the daemon's C loop counts them, and the Python halves they ran
    # (fewer: only when one was due).
    for counters in (sent_counters, received):
        assert counters["NETWORK_DUTY_CYCLES"] > counters["NETWORK_PYTHON_PASSES"] > 0


def test_an_idle_embedded_conductor_runs_at_the_next_call_after_a_refused_offer(
        embedded) -> None:
    """Idle, the conductor runs less and less often (up to once a second, as the daemon's);
    an IPC publisher refused for want of credit is news that brings the next cycle at once,
    and the limit moves."""
    # The default timer interval (1 s), so that only the idle pacing spaces the cycles.
    driver = embedded(timer_interval="1s", client_liveness_timeout="5s",
                      publication_unblock_timeout="10s")
    with Client.connect(driver.directory, invoker=driver.do_work) as client:
        subscription = client.add_subscription("aeron:ipc", 3)
        publication = client.add_publication("aeron:ipc", 3)
        run_until(lambda: publication.is_connected, driver, what="the stream connected")
        # Idle for a while: the conductor's cycles are a second apart by the end.
        idle_until = time.monotonic() + 1.5
        while time.monotonic() < idle_until:
            driver.do_work()
            time.sleep(0.0005)
        # Right after an idle cycle, the next is far off: calls without news do not run it.
        # The conductor's own timer (1 s) is a clock of its own that the idle pacing does
        # not move: take a cycle after which neither is due within the window below.
        for _ in range(10):
            before = counters_of(driver)["CONDUCTOR_CYCLES"]
            run_until(lambda before=before: counters_of(driver)["CONDUCTOR_CYCLES"] > before,
                      driver, what="an idle conductor cycle")
            cycles = counters_of(driver)["CONDUCTOR_CYCLES"]
            next_due_ns = min(driver._next_conductor_ns, driver._conductor_deadline_ns)
            if next_due_ns - time.monotonic_ns() > 300_000_000:
                break
        else:
            raise AssertionError("no idle conductor cycle was followed by 300 ms without one")
        for _ in range(50):
            driver.do_work()
            time.sleep(0.001)
        assert counters_of(driver)["CONDUCTOR_CYCLES"] == cycles
        sent = 0
        while publication.offer(message(sent, 1000)) > 0:  # up to the window's end
            sent += 1
        seen: list[bytes] = []
        while subscription.poll(lambda data, _h: seen.append(bytes(data)), 100):
            pass
        assert seen == [message(i, 1000) for i in range(sent)]
        assert publication.offer(message(sent, 1000)) < 0  # the limit has not moved yet
        assert counters_of(driver)["CONDUCTOR_CYCLES"] == cycles
        driver.do_work()
        assert counters_of(driver)["CONDUCTOR_CYCLES"] == cycles + 1
        assert publication.offer(message(sent, 1000)) > 0


def _echo(directory: str, ping: str, pong: str, rounds: int) -> None:
    """Another process with its own embedded driver: echo each ping, with receive() alone
    running the driver (and do_work while an offer finds no credit)."""
    with MediaDriver.embedded(directory, **NETWORK_SETTINGS) as driver, \
            Client.connect(driver.directory, invoker=driver.do_work) as client:
        pings, pongs = client.add_subscription(ping, 1), client.add_publication(pong, 2)

        def echo(data: memoryview, _header: object) -> None:
            while pongs.offer(bytes(data)) < 0:
                client.do_work()

        echoed = 0
        deadline = time.monotonic() + 90
        while echoed < rounds and time.monotonic() < deadline:
            echoed += pings.receive(echo, 1, timeout=1.0)
        # Until the other side has every pong: the last one may still be in this log.
        end = time.monotonic() + 2
        while time.monotonic() < end:
            client.do_work()


def test_a_receive_runs_the_embedded_driver_while_it_waits(embedded) -> None:
    """A ping-pong between two processes, each with its own embedded driver, whose waiting
    is receive() alone."""
    driver = embedded()
    ping, pong = (f"aeron:udp?endpoint=127.0.0.1:{free_port()}" for _ in range(2))
    rounds = 2000
    other = Path("/dev/shm") / f"slipstream-embedded-{uuid.uuid4().hex[:12]}"
    echoer = multiprocessing.get_context("spawn").Process(
        target=_echo, args=(str(other), ping, pong, rounds))
    echoer.start()
    try:
        with Client.connect(driver.directory, invoker=driver.do_work) as client:
            pings, pongs = client.add_publication(ping, 1), client.add_subscription(pong, 2)
            run_until(lambda: pings.is_connected and pongs.images, driver, timeout=30,
                      what="both streams connected")
            answers: list[int] = []
            for i in range(rounds):
                while pings.offer(i.to_bytes(4, "little")) < 0:
                    client.do_work()
                assert pongs.receive(
                    lambda data, _h: answers.append(int.from_bytes(data, "little")), 1,
                    timeout=10), f"no pong {i}"
            assert answers == list(range(rounds))
    finally:
        echoer.join(30)
    assert echoer.exitcode == 0


@pytest.mark.parametrize("params", ["", "|reliable=false"])  # SMs sent by C, by Python
def test_a_call_that_shows_an_image_has_sent_its_first_status_message(
        embedded, params: str) -> None:
    """What the conductor hands the agents in a call is done in that call: an application
    that stops calling once its client sees the image has answered the peer, which then
    connects on its own calls alone (the benchmark's pinger waited so, and its ponger hung
    1 run in 2).  Two ping-pong streams set up with the two drivers' calls interleaved at
    random, five times."""
    interleaving = random.Random(23)
    for _ in range(5):
        a, b = embedded(term_buffer_length="64k"), embedded(term_buffer_length="64k")
        ping, pong = (f"aeron:udp?endpoint=127.0.0.1:{free_port()}{params}"
                      for _ in range(2))
        with Client.connect(a.directory, invoker=a.do_work) as ca, \
                Client.connect(b.directory, invoker=b.do_work) as cb:
            pings_b, pongs_b = cb.add_subscription(ping, 1), cb.add_publication(pong, 2)
            pings_a, pongs_a = ca.add_publication(ping, 1), ca.add_subscription(pong, 2)
            deadline = time.monotonic() + 10
            while not (pongs_a.images and pings_a.is_connected):
                assert time.monotonic() < deadline, "the pinger's streams did not connect"
                interleaving.choice((a, b)).do_work()
                time.sleep(0.0002)
            # a is not called again: b's streams connect on b's calls alone (well within
            # the default liveness and connection timeouts).
            run_until(lambda s=pings_b, p=pongs_b: s.images and p.is_connected, b, timeout=3,
                      what="the ponger's streams connected")
        a.close()
        b.close()


def _attach_and_publish(directory: str, count: int) -> None:
    """Another process: a plain client of the embedded driver's directory."""
    with Client.connect(directory) as client:
        publication = client.add_publication("aeron:ipc", 77)
        deadline = time.monotonic() + 30
        while not publication.is_connected:
            assert time.monotonic() < deadline
            time.sleep(0.001)
        for i in range(count):
            while publication.offer(i.to_bytes(4, "little")) < 0:
                assert time.monotonic() < deadline
                time.sleep(0.0001)


def test_another_process_attaches_to_an_embedded_drivers_directory(embedded) -> None:
    driver = embedded()
    count = 50_000  # past the 64 KiB IPC terms many times
    with Client.connect(driver.directory, invoker=driver.do_work) as client:
        subscription = client.add_subscription("aeron:ipc", 77)
        process = multiprocessing.get_context("spawn").Process(
            target=_attach_and_publish, args=(str(driver.directory), count))
        process.start()
        seen: list[int] = []

        def received_all() -> bool:
            subscription.poll(lambda data, _h: seen.append(int.from_bytes(data, "little")), 100)
            return len(seen) >= count

        run_until(received_all, driver, timeout=60, what="every message")
        # The other process closes its publication and its client: its driver answers.
        run_until(lambda: not process.is_alive(), driver, timeout=30, what="a clean exit")
        assert process.exitcode == 0
        assert seen == list(range(count))


def test_closing_an_embedded_driver_tells_its_clients_and_removes_what_it_made(
        embedded) -> None:
    driver = embedded()
    directory = driver.directory
    client = Client.connect(directory, invoker=driver.do_work)
    client.add_publication(f"aeron:udp?endpoint=127.0.0.1:{free_port()}", 5)
    assert sorted(os.listdir(directory))  # its files are there while it runs
    driver.close()
    assert not directory.exists()
    assert driver.do_work() == 0  # a client's wait may still run it
    with pytest.raises(ClosedError, match="is closed"), driver:
        pass
    with pytest.raises(DriverNotRunningError, match=r"the driver stopped|shut"):
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            client.add_subscription("aeron:ipc", 6)
            time.sleep(0.05)
    client.close()


def _run_embedded_program(body: str, directory: Path) -> str:
    """Run ``body`` in a new interpreter after ``driver = MediaDriver.embedded(directory)``
    (no close()); returns what it printed."""
    import subprocess
    import sys

    program = ("import os, sys\n"
               "from slipstream.daemon.driver import MediaDriver\n"
               "driver = MediaDriver.embedded(sys.argv[1])\n" + body)
    result = subprocess.run([sys.executable, "-c", program, str(directory)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_an_embedded_driver_its_application_forgot_to_close_is_removed_at_exit(
        driver_dir: Path) -> None:
    printed = _run_embedded_program(
        "print(sorted(p.name for p in driver.directory.iterdir()), flush=True)\n", driver_dir)
    assert "conductor.sock" in printed  # it ran, and exited without close()
    assert not driver_dir.exists()
    # A forked child that exits normally runs the atexit hooks it inherited: not this one,
    # or it would tear down its parent's running driver.
    printed = _run_embedded_program(
        "child = os.fork()\n"
        "if child == 0:\n"
        "    sys.exit(0)\n"
        "os.waitpid(child, 0)\n"
        "print((driver.directory / 'driver.lock').exists(), flush=True)\n", driver_dir)
    assert printed.strip() == "True"
    assert not driver_dir.exists()  # the parent's own exit closed it


def test_an_embedded_driver_refuses_a_directory_a_running_driver_holds(embedded) -> None:
    driver = embedded()
    with pytest.raises(Exception, match="already running"):
        MediaDriver.embedded(driver.directory)


def test_closing_an_embedded_driver_first_sends_what_offer_accepted(embedded,
                                                                      driver_dir: Path) -> None:
    """Close drains as the daemon's SIGTERM does: 20,000 messages offered (the driver run
    only when an offer is refused) and the client and driver closed at once still all reach
    a subscriber on another driver (a few hundred did before, the rest were dropped)."""
    count = 20_000
    uri = f"aeron:udp?endpoint=127.0.0.1:{free_port()}"
    with MediaDriver.launch(directory=driver_dir, **NETWORK_SETTINGS), \
            Client.connect(driver_dir) as cb:
        subscription = cb.add_subscription(uri, 2901)
        received: list[bytes] = []
        stop = threading.Event()

        def read() -> None:
            while len(received) < count and not stop.is_set():
                if not subscription.poll(lambda data, _h: received.append(bytes(data)), 100):
                    time.sleep(0.0005)

        # The default 16 MiB terms: the offers are never refused, so the driver has sent
        # almost nothing when the application closes.
        a = embedded(drain_timeout="10s", term_buffer_length="16m")
        ca = Client.connect(a.directory, invoker=a.do_work)
        publication = ca.add_publication(uri, 2901)
        run_until(lambda: publication.is_connected, a, what="the stream connected")
        reader = threading.Thread(target=read)
        reader.start()
        try:
            for i in range(count):
                while publication.offer(message(i, 100)) <= 0:
                    ca.do_work()
            ca.close()
            a.close()
            reader.join(30)
        finally:
            stop.set()
            reader.join()
    assert received == [message(i, 100) for i in range(count)]


def test_two_embedded_drivers_of_one_process_keep_their_own_error_logs(embedded) -> None:
    """The error one driver logs goes to its errors.json only (both share the process's
    logger: the other used to record it too, and stat then reported it for that one)."""
    import socket

    from slipstream.client import RegistrationError
    from slipstream.daemon.reports.error_log import read_error_log

    a, b = embedded(), embedded()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as taken:
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        with Client.connect(a.directory, invoker=a.do_work) as ca, \
                pytest.raises(RegistrationError, match="Address already in use"):
            ca.add_subscription(f"aeron:udp?endpoint=127.0.0.1:{port}", 1)
    run_until(lambda: read_error_log(a.directory), a, b, what="A's error written")
    assert any("cannot receive on" in e.message for e in read_error_log(a.directory))
    for _ in range(100):
        b.do_work()
    assert read_error_log(b.directory) == []
    assert counters_of(b)["ERRORS"] == 0 < counters_of(a)["ERRORS"]


def test_an_embedded_driver_meets_its_client_at_slipstream_dir_and_serves_its_metrics(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a directory it takes the one Client.connect() looks in ($SLIPSTREAM_DIR: it
    took /dev/shm/slipstream-<user>, and the client found nothing), and metrics_address is
    served (it was ignored) until it closes."""
    import socket
    import urllib.request

    directory = Path("/dev/shm") / f"slipstream-embedded-{uuid.uuid4().hex[:12]}"
    monkeypatch.setenv("SLIPSTREAM_DIR", str(directory))
    with MediaDriver.embedded(metrics_address="127.0.0.1:0", **NETWORK_SETTINGS) as driver:
        assert driver.directory == directory
        with Client.connect(invoker=driver.do_work) as client:
            assert client.directory == directory
        port = driver._exporter.server_address[1]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
            assert b"slipstream_clients" in reply.read()
    assert not directory.exists()
    with socket.socket() as probe:  # nothing listens there any more (the scrape's
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT stays)
        probe.bind(("127.0.0.1", port))
        probe.listen()


@pytest.mark.parametrize("client_closed_first", [False, True])
def test_closing_an_embedded_driver_does_not_wait_for_its_own_applications_subscribers(
        embedded, client_closed_first: bool) -> None:
    """The drain waits for other processes' subscribers, not for this application's (it is
    the one closing, and will read no more): a UDP stream to itself and an IPC one, each a
    window or more unread, close at once, whether the client is still open or closed before (as
    ``with driver, client:`` does), not after drain_timeout or the sender's receiver
    timeout."""
    receiver_timeout_s = 10  # the drain's is longer: it is the one to beat
    driver = embedded(drain_timeout=f"{2 * receiver_timeout_s}s",
                      publication_connection_timeout=f"{receiver_timeout_s}s")
    uri = f"aeron:udp?endpoint=127.0.0.1:{free_port()}"
    client = Client.connect(driver.directory, invoker=driver.do_work)
    subscription = client.add_subscription(uri, 3)
    publication = client.add_publication(uri, 3)
    ipc = client.add_subscription("aeron:ipc?term-length=64k", 4)
    ipc_publication = client.add_publication("aeron:ipc?term-length=64k", 4)
    run_until(lambda: publication.is_connected and subscription.images
              and ipc_publication.is_connected and ipc.images, driver,
              what="both streams connected")
    # 64 KiB terms: a receiver window is 32 KiB, and the sender stops at its end; offers
    # then run up to the publication window beyond (half a term) and are refused.
    for stream in (publication, ipc_publication):
        refused, deadline = 0, time.monotonic() + 10
        while refused < 500 and time.monotonic() < deadline:
            if stream.offer(message(0, 128)) > 0:
                refused = 0
            else:
                refused += 1
                driver.do_work()
    assert publication.position > 48 * 1024  # more than the receiver took: a window
    if client_closed_first:
        client.close()
    started = time.monotonic()
    driver.close()
    assert time.monotonic() - started < receiver_timeout_s / 2
    client.close()


def _attached_subscriber(directory: str, uri: str, ready: Any, done: Any,
                         stream_id: int = 5) -> None:
    """Another process's subscriber on an embedded driver's stream, which never reads."""
    with Client.connect(directory) as client:
        client.add_subscription(uri, stream_id)
        ready.set()
        done.wait(30)


def test_closing_an_embedded_driver_waits_for_another_processs_subscriber(embedded) -> None:
    """A process that attached to the embedded driver's directory is owed what was sent: the
    drain waits for its UDP subscriber (here, one that never reads: until drain_timeout)."""
    driver = embedded(drain_timeout="2s")
    uri = f"aeron:udp?endpoint=127.0.0.1:{free_port()}"
    context = multiprocessing.get_context("spawn")
    ready, done = context.Event(), context.Event()
    child = context.Process(target=_attached_subscriber,
                            args=(str(driver.directory), uri, ready, done))
    child.start()
    try:
        run_until(ready.is_set, driver, timeout=30, what="the other process subscribed")
        with Client.connect(driver.directory, invoker=driver.do_work) as client:
            publication = client.add_publication(uri, 5)
            run_until(lambda: publication.is_connected, driver, what="connected")
            offer_ten(publication, driver)
            started = time.monotonic()
            driver.close()
            waited = time.monotonic() - started
        assert waited >= 1.5, f"closed after {waited:.2f} s, not waiting for the subscriber"
    finally:
        done.set()
        child.join(30)


def test_another_processs_subscriber_of_another_stream_on_the_endpoint_is_not_waited_for(
        embedded) -> None:
    """Receivers are per endpoint: another process reading stream 6 there does not make the
    closing application's own unread subscriber of stream 5 one to wait for."""
    drain_timeout_s = 10
    driver = embedded(drain_timeout=f"{drain_timeout_s}s")
    uri = f"aeron:udp?endpoint=127.0.0.1:{free_port()}"
    context = multiprocessing.get_context("spawn")
    ready, done = context.Event(), context.Event()
    child = context.Process(target=_attached_subscriber,
                            args=(str(driver.directory), uri, ready, done, 6))
    child.start()
    try:
        run_until(ready.is_set, driver, timeout=30, what="the other process subscribed")
        with Client.connect(driver.directory, invoker=driver.do_work) as client:
            own = client.add_subscription(uri, 5)
            publication = client.add_publication(uri, 5)
            run_until(lambda: publication.is_connected and own.images, driver,
                      what="connected")
            offer_ten(publication, driver)
            started = time.monotonic()
            driver.close()
            assert time.monotonic() - started < drain_timeout_s / 2
    finally:
        done.set()
        child.join(30)


def _publish_and_close_in_pid_namespace(directory: str, uri: str) -> None:
    """An application with an embedded driver, run as pid 1 of a pid namespace: it publishes
    ten messages once a subscriber connects, closes, and prints how long the close took."""
    assert os.getpid() == 1
    driver = MediaDriver.embedded(directory, **{**NETWORK_SETTINGS, "drain_timeout": "2s"})
    with Client.connect(directory, invoker=driver.do_work) as client:
        publication = client.add_publication(uri, 5)
        run_until(lambda: publication.is_connected, driver, timeout=30,
                  what="the other process's subscriber")
        offer_ten(publication, driver)
        started = time.monotonic()
        driver.close()
        print(f"closed in {time.monotonic() - started:.3f} s", flush=True)


def _subscribe_in_pid_namespace(directory: str, uri: str) -> None:
    """Another process, pid 1 of another pid namespace: a subscriber that never reads, until
    its standard input closes."""
    assert os.getpid() == 1
    deadline = time.monotonic() + 30
    while True:
        try:
            client = Client.connect(directory)
            break
        except DriverNotRunningError:
            assert time.monotonic() < deadline, "the embedded driver did not start"
            time.sleep(0.01)
    with client:
        client.add_subscription(uri, 5)
        sys.stdin.read()


@pytest.fixture
def in_pid_namespace() -> Callable[[str, str, str], subprocess.Popen]:
    """Start ``function(directory, uri)`` of this module as pid 1 of a new pid namespace
    (``unshare --pid``: root) that shares /dev/shm; skips without, fails under CI=true."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        lacking("pid namespaces need root and unshare(1)")
    started: list[subprocess.Popen] = []

    def start(function: str, directory: str, uri: str) -> subprocess.Popen:
        code = f"import test_embedded; test_embedded.{function}({directory!r}, {uri!r})"
        process = subprocess.Popen(
            ["unshare", "--pid", "--fork", "--kill-child", sys.executable, "-c", code],
            cwd=Path(__file__).parent, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True)
        started.append(process)
        return process

    yield start
    for process in started:
        if process.poll() is None:
            process.kill()
        process.wait(10)


def test_closing_waits_for_a_subscriber_whose_process_has_the_applications_pid_elsewhere(
        in_pid_namespace) -> None:
    """Two processes in two pid namespaces that share /dev/shm, both pid 1: the application's
    close still waits for the other's subscriber (until drain_timeout: it never reads).  The
    driver told its application's clients by pid before, and closed at once."""
    directory = f"/dev/shm/slipstream-embedded-{uuid.uuid4().hex[:12]}"
    uri = f"aeron:udp?endpoint=127.0.0.1:{free_port()}"
    try:
        subscriber = in_pid_namespace("_subscribe_in_pid_namespace", directory, uri)
        application = in_pid_namespace("_publish_and_close_in_pid_namespace", directory, uri)
        output, _ = application.communicate(timeout=60)
        assert application.returncode == 0, output
        waited = float(output.split("closed in ")[1].split()[0])
        assert waited >= 1.5, f"closed after {waited:.3f} s, not waiting for the subscriber"
        subscriber.communicate("", timeout=30)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


class _InterruptedRightAfterTheAcquire:
    """``_working`` as a Ctrl-C meets it once in a few presses: the signal handler's
    KeyboardInterrupt raised just after a non-blocking acquire took the hold (at the call's
    eval-breaker check), before do_work()'s ``try``."""

    def __init__(self, hold: Any) -> None:
        self.hold, self.armed = hold, True

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        taken = self.hold.acquire(blocking, timeout)
        if taken and self.armed and not blocking:
            self.armed = False
            raise KeyboardInterrupt
        return taken

    def release(self) -> None:
        self.hold.release()

    def _is_owned(self) -> bool:
        return self.hold._is_owned()


def test_a_ctrl_c_that_interrupts_do_work_leaves_the_driver_running_and_closable(
        embedded) -> None:
    driver = embedded()
    with Client.connect(driver.directory, invoker=driver.do_work, timeout=5) as client:
        driver._working = _InterruptedRightAfterTheAcquire(driver._working)
        with pytest.raises(KeyboardInterrupt):
            client.do_work()
        # The next calls run the driver: a command gets its answer, a stream flows.
        pub = client.add_publication("aeron:ipc", 31)
        sub = client.add_subscription("aeron:ipc", 31)
        run_until(lambda: pub.offer(b"after") > 0, driver, what="an offer")
        got: list[bytes] = []
        run_until(lambda: sub.poll(lambda data, _h: got.append(bytes(data)), 1), driver,
                  what="the message")
        assert got == [b"after"]
    closer = threading.Thread(target=driver.close, daemon=True)
    closer.start()
    closer.join(10)
    assert not closer.is_alive() and not driver.directory.exists()


def test_an_idle_embedded_driver_beats_four_times_within_driver_timeout(embedded) -> None:
    """Its clients (and processes attached to its directory) judge it by its heartbeat, as
    a daemon's: however idle, a conductor run as often as the application calls must beat
    within a quarter of driver_timeout (its pacing alone spaced the beats up to 1 s)."""
    # The default timer interval (1 s): the tests' 100 ms one would run it often anyway.
    driver = embedded(driver_timeout="800ms", timer_interval="1s",
                      client_liveness_timeout="5s", publication_unblock_timeout="10s")
    with Client.connect(driver.directory, invoker=driver.do_work) as client:
        beats: list[int] = []
        calls: list[tuple[int, int]] = []  # (start, end) of each call
        ends = time.monotonic() + 3.0
        while time.monotonic() < ends:
            started = time.monotonic_ns()
            driver.do_work()
            calls.append((started, time.monotonic_ns()))
            beat = client.counters.driver_heartbeat_ns
            if not beats or beat != beats[-1]:
                beats.append(beat)
            time.sleep(0.001)
    gaps = [b - a for a, b in itertools.pairwise(beats)]
    # A beat can come no sooner than the call after it fell due: the longest wait from one
    # call's end to the next's start (a loaded host deschedules this loop) is the
    # application's, not the driver's; a driver slow inside its calls gets no room from it.
    longest_call_gap = max(b[0] - a[1] for a, b in itertools.pairwise(calls))
    bound = 200_000_000 + longest_call_gap + 20_000_000
    assert len(gaps) >= 10 and max(gaps) <= bound, (max(gaps), longest_call_gap)


def test_a_rate_limited_offer_runs_the_embedded_driver_while_it_paces(embedded) -> None:
    """An offer waiting on its rate-limit bucket is the application's call: it runs the
    driver, so the heartbeat attached processes watch keeps beating through the pacing (it
    slept, and a paced loop over UDP sent nothing)."""
    driver = embedded(driver_timeout="800ms", timer_interval="1s",
                      client_liveness_timeout="5s", publication_unblock_timeout="10s")
    with Client.connect(driver.directory, invoker=driver.do_work) as client:
        pub = client.add_publication("aeron:ipc", 32, policy="rate-limit,messages:1")
        sub = client.add_subscription("aeron:ipc", 32)
        run_until(lambda: pub.is_connected, driver, what="connected")
        beats: list[int] = []
        done = threading.Event()

        def watch() -> None:  # as an attached process would, from outside the call
            while not done.is_set():
                beat = client.counters.driver_heartbeat_ns
                if not beats or beat != beats[-1]:
                    beats.append(beat)
                time.sleep(0.005)

        assert pub.offer(b"first") > 0
        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        started = time.monotonic()
        try:
            assert pub.offer(b"second") > 0  # a second's pacing
        finally:
            done.set()
            watcher.join(5)
        assert time.monotonic() - started > 0.5
        gaps = [b - a for a, b in itertools.pairwise(beats)]
        # A driver that did not run while the offer waited would show one gap of the whole
        # second's pacing; half of it, and under the 800 ms driver_timeout its clients judge
        # it by, leaves room for a loaded machine's late wake-ups.
        assert len(beats) >= 4 and max(gaps) <= 500_000_000, (len(beats), max(gaps, default=0))
        got: list[bytes] = []
        run_until(lambda: sub.poll(lambda data, _h: got.append(bytes(data)), 10) and
                  len(got) == 2, driver, what="both messages")


@pytest.mark.anyio  # under trio and asyncio (tests/loops.py)
async def test_offer_async_under_rate_limit_runs_the_embedded_driver_while_it_paces(
        embedded) -> None:
    driver = embedded(driver_timeout="800ms", timer_interval="1s",
                      client_liveness_timeout="5s", publication_unblock_timeout="10s")
    with Client.connect(driver.directory, invoker=driver.do_work) as client:
        pub = client.add_publication("aeron:ipc", 33, policy="rate-limit,messages:1")
        client.add_subscription("aeron:ipc", 33)
        run_until(lambda: pub.is_connected, driver, what="connected")
        beats: list[int] = []

        async def watch() -> None:
            while True:
                beat = client.counters.driver_heartbeat_ns
                if not beats or beat != beats[-1]:
                    beats.append(beat)
                await anyio.sleep(0.005)

        assert await pub.offer_async(b"first") > 0
        async with anyio.create_task_group() as nursery:
            nursery.start_soon(watch)
            assert await pub.offer_async(b"second") > 0  # a second's pacing
            nursery.cancel_scope.cancel()
        gaps = [b - a for a, b in itertools.pairwise(beats)]
        # A driver that did not run while the offer waited would show one gap of the whole
        # second's pacing; half of it, and under the 800 ms driver_timeout its clients judge
        # it by, leaves room for a loaded machine's late wake-ups.
        assert len(beats) >= 4 and max(gaps) <= 500_000_000, (len(beats), max(gaps, default=0))


def test_wait_for_data_runs_the_embedded_driver_while_it_waits(embedded) -> None:
    """A UDP message between two embedded drivers of one process arrives during one
    ``wait_for_data`` of the subscriber's client: the wait runs that client's driver (it
    parked on the futex, and the message waited for the next call)."""
    port = free_port()
    sender, receiver = embedded(), embedded()
    uri = f"aeron:udp?endpoint=127.0.0.1:{port}"
    with Client.connect(sender.directory, invoker=sender.do_work) as publishing, \
            Client.connect(receiver.directory, invoker=receiver.do_work) as subscribing:
        pub = publishing.add_publication(uri, 34)
        sub = subscribing.add_subscription(uri, 34)
        run_until(lambda: pub.is_connected and sub.images, sender, receiver, what="connected")
        deadline = time.monotonic() + 5
        while pub.offer(b"one") < 0:
            assert time.monotonic() < deadline, "the offer never went in"
            sender.do_work()
        for _ in range(100):  # the sender's driver sends it (nothing here runs the receiver's)
            sender.do_work()
        assert sub.wait_for_data(2_000_000_000)
        got: list[bytes] = []
        sub.poll(lambda data, _h: got.append(bytes(data)), 10)
        assert got == [b"one"]


@pytest.mark.parametrize("setting", [{"threading_mode": "dedicated"},
                                     {"network_idle_spin": "1s"}])
def test_an_embedded_driver_refuses_the_settings_of_threads_it_does_not_have(
        driver_dir: Path, setting: dict[str, str]) -> None:
    with pytest.raises(ConfigurationError, match=f"{next(iter(setting))}.*embedded") as error:
        MediaDriver.embedded(driver_dir, **setting)
    assert error.value.key == next(iter(setting))
    assert not driver_dir.exists()


def test_wait_for_data_raises_once_the_embedded_driver_is_gone(embedded) -> None:
    driver = embedded()
    with Client.connect(driver.directory, invoker=driver.do_work) as client:
        subscription = client.add_subscription("aeron:ipc", 35)
        driver.close()
        wait_s = 5
        started = time.monotonic()
        with pytest.raises(DriverNotRunningError):
            subscription.wait_for_data(wait_s * 1_000_000_000)
        assert time.monotonic() - started < wait_s / 2  # at once, not at the wait's end


def test_a_subscription_its_client_stopped_waiting_for_is_released_when_it_comes(
        embedded, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A command whose channel names a host waits for the resolver (2 s here); a client whose
    request timeout (1 s) passes first gets DriverTimeoutError, and when the driver's answer
    comes, the client releases the subscription it made: nobody would ever poll it, and it
    would hold the stream's publishers back until the client closed."""
    from slipstream.client import DriverTimeoutError
    from slipstream.daemon.media import names

    driver = embedded()
    resolve_host = names.resolve_host

    def slow(host: str) -> str | None:
        time.sleep(2.0)
        return resolve_host(host)

    monkeypatch.setattr(names, "resolve_host", slow)
    stop = threading.Event()

    def pump() -> None:  # the driver's duty cycle on a thread of its own
        while not stop.is_set():
            if not driver.do_work():
                time.sleep(0.0005)

    pumping = threading.Thread(target=pump)
    pumping.start()
    try:
        with Client.connect(driver.directory, timeout=1.0) as client:
            with pytest.raises(DriverTimeoutError):
                client.add_subscription(f"aeron:udp?endpoint=localhost:{free_port()}", 7)
            deadline = time.monotonic() + 15
            while "releasing what it made" not in caplog.text:  # the late answer came
                assert time.monotonic() < deadline, "no late answer was released"
                time.sleep(0.05)
            deadline = time.monotonic() + 5
            while driver.conductor.network.subscriptions:
                assert time.monotonic() < deadline, "the late subscription was not released"
                time.sleep(0.05)
    finally:
        stop.set()
        pumping.join(10)


def test_an_embedded_driver_follows_a_silent_endpoints_name_without_blocking_its_caller(
        embedded, monkeypatch: pytest.MonkeyPatch) -> None:
    """The name is resolved again on a thread the driver starts (its caller's loop goes on,
    though the resolver takes 1 s), and the answer moves the endpoint at a later call."""
    from slipstream.daemon.media import names

    record = {"address": "127.0.0.1", "delay": 0.0}
    resolve_host = names.resolve_host

    def moving(host: str) -> str | None:
        if host == "moving.test":
            time.sleep(record["delay"])
            return record["address"]
        return resolve_host(host)

    monkeypatch.setattr(names, "resolve_host", moving)
    driver = embedded(name_re_resolution_interval="200ms")
    port = free_port()
    with Client.connect(driver.directory, invoker=driver.do_work) as client:
        subscription = client.add_subscription(f"aeron:udp?endpoint=127.0.0.2:{port}", 36)
        publication = client.add_publication(f"aeron:udp?endpoint=moving.test:{port}", 36)
        record.update(address="127.0.0.2", delay=1.0)
        longest = 0.0
        deadline = time.monotonic() + 8
        while not (publication.is_connected and subscription.images):
            assert time.monotonic() < deadline, "the endpoint did not follow its name"
            started = time.monotonic()
            driver.do_work()
            longest = max(longest, time.monotonic() - started)
            time.sleep(0.001)
        offer_ten(publication, driver)
    assert counters_of(driver)["RESOLUTION_CHANGES"] == 1
    assert longest < 0.5  # no call waited for the resolver


def test_an_embedded_drivers_names_due_together_answer_each_on_its_own(
        embedded, monkeypatch: pytest.MonkeyPatch) -> None:
    """``stuck.test`` and ``moving.test`` are due at the same checks, and the first's
    resolver then takes 6 s for each answer: the second's answer is handed over as it
    comes, and its endpoint follows it within a few intervals."""
    from slipstream.daemon.media import names

    record = {"moving.test": "127.0.0.1", "stuck.test": "127.0.0.1", "delay": 0.0}
    resolve_host = names.resolve_host

    def lookup(host: str) -> str | None:
        if host == "stuck.test":
            time.sleep(record["delay"])
        if host in ("moving.test", "stuck.test"):
            return record[host]
        return resolve_host(host)

    monkeypatch.setattr(names, "resolve_host", lookup)
    driver = embedded(name_re_resolution_interval="200ms", publication_connection_timeout="1s")
    port, stuck_port = free_port(), free_port()
    with Client.connect(driver.directory, invoker=driver.do_work) as client:
        subscription = client.add_subscription(f"aeron:udp?endpoint=127.0.0.2:{port}", 37)
        client.add_publication(f"aeron:udp?endpoint=stuck.test:{stuck_port}", 37)
        publication = client.add_publication(f"aeron:udp?endpoint=moving.test:{port}", 37)
        record["delay"] = STUCK_S
        settle = time.monotonic() + 1.5  # past the connection timeout: both silent, both due
        while time.monotonic() < settle:
            driver.do_work()
            time.sleep(0.001)
        record["moving.test"] = "127.0.0.2"
        moved = time.monotonic()
        while not (publication.is_connected and subscription.images):
            assert time.monotonic() - moved < STUCK_S / 2, (
                "the moving name waited for the stuck one")
            driver.do_work()
            time.sleep(0.001)
        followed_s = time.monotonic() - moved
        offer_ten(publication, driver)
    assert followed_s < STUCK_S / 2, followed_s
    assert counters_of(driver)["RESOLUTION_CHANGES"] == 1
