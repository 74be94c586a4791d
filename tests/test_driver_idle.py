"""An idle driver sleeps: wake-ups only for its timers (its CPU cost is bench/idle_cost.py's
figure)."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from pathlib import Path

from helpers import (
    counters_of,
    free_port,
    process_udp_drops,
    runnable_s,
    timeslices,
    voluntary_switches,
    wait_for,
)

from slipstream.client import Client
from slipstream.daemon.config import load_settings
from slipstream.daemon.driver import MediaDriver
from slipstream.daemon.pressure.governor import STATUS_INTERVAL_FACTOR


def test_an_idle_driver_sleeps_between_its_timers(driver_dir: Path) -> None:
    """Idle, with a stream open, a driver's threads sleep until a timer of theirs rings: the
    conductor's (every timer_interval) and the network thread's park (as long).  So its
    wake-ups are counted by those timers, and none of its threads is runnable for long: a
    thread that spins is runnable the whole window however loaded the machine (waiting for a
    CPU counts), and a loop that parks for a millisecond wakes a thousand times a second.
    What it costs in CPU is bench/idle_cost.py's figure."""
    timer_interval_s = load_settings(env={}).timer_interval / 1e9
    window_s = 4.0
    with MediaDriver.launch(directory=driver_dir) as driver, Client.connect(driver_dir) as client:
        publication = client.add_publication("aeron:ipc", 10)
        client.add_subscription("aeron:ipc", 10)
        wait_for(lambda: publication.is_connected, what="the IPC publication connected")
        time.sleep(1.0)  # let it settle into its idle back-off
        runnable, woken = runnable_s(pid=driver.pid), timeslices(driver.pid)
        before = counters_of(driver)
        time.sleep(window_s)
        runnable = runnable_s(pid=driver.pid) - runnable
        woken = timeslices(driver.pid) - woken
        after = counters_of(driver)
    # The pressure governor's steps (a loaded machine's wake-up lag moves them): each is a
    # command the network thread wakes for, and a conductor cycle.
    steps = sum(after[name] - before[name] for name in ("GOVERNOR_CLIMBS", "GOVERNOR_DESCENTS"))
    # Two timers; twice their rings for a wake-up preempted midway on a loaded machine (or
    # the pressure governor's samples, which are cycles too), and a few for the GIL.
    timer_rings = 2 * window_s / timer_interval_s
    assert woken <= 2 * timer_rings + 4 + 2 * steps, (
        f"an idle driver woke {woken} times in {window_s} s ({steps} governor steps)")
    assert runnable < window_s / 2, f"an idle driver was runnable {runnable:.2f} s of {window_s}"


def _thread_named(pid: int, name: str) -> int:
    """The one thread of ``pid`` called ``name`` (threads that end meanwhile are skipped)."""
    found = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):
            if Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip() == name:
                found.append(int(tid))
    [tid] = found
    return tid


#: How long the calm driver is watched (s): long enough that a once-a-second timer of the
#: client's thread (8 wake-ups) stands apart from its safety net's (at most 6 switches).
WINDOW_S = 8.0


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
        before = [voluntary_switches(*thread) for thread in watched]
        cycles_before = counters_of(driver)["CONDUCTOR_CYCLES"]
        time.sleep(WINDOW_S)
        main, watcher, client_thread = (voluntary_switches(*thread) - then
                                        for thread, then in zip(watched, before, strict=True))
        cycles = counters_of(driver)["CONDUCTOR_CYCLES"] - cycles_before
    # Calm, about 8 cycles (timer_interval 1 s); a loaded machine may move the pressure
    # governor, whose samples are cycles too.  Before, a command-loop timer added one wake-up
    # a second of its own: 16 for 8 cycles.  The margin: a wait for the GIL of a network
    # thread's Python pass.
    assert cycles >= WINDOW_S - 1, f"{cycles} conductor cycles in {WINDOW_S:g} s"
    assert main <= cycles + 2, f"the main thread woke {main} times for {cycles} cycles"
    assert watcher == 0, f"the futex watcher woke {watcher} times"
    # The client's thread: its safety net at most twice in the window, and each wake-up may
    # count twice (a wait for the GIL as it wakes is a switch too), and one wake-up more for
    # whatever the driver tells it; a timer of its own even once a second would wake it at
    # least 8 times, each at least once.
    assert client_thread <= 2 * (WINDOW_S // EVENTS_SAFETY_NET_S + 1) + 2, (
        f"the client's thread woke {client_thread} times in {WINDOW_S:g} s")



def _connected_idle_pairs(client: Client, pairs: int, spaced_s: float = 0.0) -> None:
    """Add ``pairs`` UDP stream pairs on loopback (an endpoint each, 64 KiB terms, streams 100
    on), ``spaced_s`` apart, and return once every one is connected and idle."""
    streams = []
    for i in range(pairs):
        uri = f"aeron:udp?endpoint=127.0.0.1:{free_port()}|term-length=64k"
        streams.append((client.add_subscription(uri, 100 + i),
                        client.add_publication(uri, 100 + i)))
        time.sleep(spaced_s)
    wait_for(lambda: all(p.is_connected and s.images for s, p in streams), timeout=30,
             what="every stream connected")
    time.sleep(0.5)  # the SETUPs answered, idle


def test_an_idle_drivers_duty_cycles_read_only_the_sockets_with_input(driver_dir: Path) -> None:
    """With many UDP streams open and idle, a network thread's duty cycle reads only the
    endpoints whose sockets have input (epoll says which, one system call a cycle), not every
    endpoint: its endpoint reads follow the datagrams that arrive (each stream's heartbeats
    and status messages, which this driver sends itself over loopback), not its cycles times
    its endpoints, which reading each socket every cycle costs.  The heartbeats and status
    messages still go at their intervals."""
    from slipstream.daemon._network import lib as network

    pairs = 16  # 32 endpoints (a send and a receive endpoint each)
    assert 2 * pairs >= 4 * network.SS_POLL_ENDPOINTS_MIN
    window_s = 2.0
    with MediaDriver.launch(directory=driver_dir) as driver, Client.connect(driver_dir) as client:
        _connected_idle_pairs(client, pairs)
        before = counters_of(driver)
        time.sleep(window_s)
        after = counters_of(driver)
    moved = {name: after[name] - before[name] for name in (
        "NETWORK_DUTY_CYCLES", "NETWORK_ENDPOINT_READS", "HEARTBEATS_SENT",
        "STATUS_MESSAGES_SENT")}
    cycles, reads = moved["NETWORK_DUTY_CYCLES"], moved["NETWORK_ENDPOINT_READS"]
    datagrams = moved["HEARTBEATS_SENT"] + moved["STATUS_MESSAGES_SENT"]
    # A heartbeat every 100 ms and a status message every status_message_timeout per stream,
    # at least half of them on a loaded machine, whose pressure governor may widen the status
    # messages' interval.
    sm_interval_s = load_settings(env={}).status_message_timeout / 1e9 * STATUS_INTERVAL_FACTOR
    assert moved["HEARTBEATS_SENT"] >= pairs * window_s / 0.1 / 2, moved
    assert moved["STATUS_MESSAGES_SENT"] >= pairs * window_s / sm_interval_s / 2, moved
    # Each read takes at least one datagram, but for a socket whose readiness outlived its
    # datagram (a margin of one per endpoint).  Reading every socket each cycle made at least
    # `pairs` reads a cycle (the receive endpoints).
    assert reads <= datagrams + 2 * pairs, f"{reads} endpoint reads for {datagrams} datagrams"
    assert cycles * pairs > datagrams + 2 * pairs, (
        f"{cycles} cycles: too few to tell reading each socket a cycle from this")


def test_idle_streams_keepalives_share_the_network_threads_wake_ups(driver_dir: Path) -> None:
    """Idle UDP streams made one after another have their heartbeat and status-message timers
    spread over the interval: woken at each, the network thread would wake about
    ``pairs x (10 + 5)`` times a second, each wake-up a duty cycle over every stream, and
    with the keepalives due within SS_TIMER_SLACK_NS sent together, still 1 s / slack times.
    Its loop sends each keepalive at the last multiple of half its interval before its time
    (SS_KEEPALIVE_GRAIN_NS at most), so that those of idle streams fall on the same
    instants: the timers go at most one wake-up a grain (the SMs' instants are among the
    heartbeats'), each woken once more by the datagrams it sent, which this
    driver reads itself over loopback.  A heartbeat goes at most a slack early but for the
    first of an idle stream: at most 100 ms / (100 ms - slack) a stream a second, and at
    least half of 10 (the loaded machine's margin)."""
    from slipstream.daemon._network import lib as network

    pairs = 64
    slack_s = network.SS_TIMER_SLACK_NS / 1e9
    heartbeat_s = network.SS_HEARTBEAT_TIMEOUT_NS / 1e9
    window_s = 2.0
    with MediaDriver.launch(directory=driver_dir) as driver, Client.connect(driver_dir) as client:
        # The streams' timers spread over the interval:
        _connected_idle_pairs(client, pairs, spaced_s=heartbeat_s / pairs)
        network_thread = _thread_named(driver.pid, "ss-network")
        before, woken = counters_of(driver), voluntary_switches(driver.pid, network_thread)
        began = time.monotonic()
        time.sleep(window_s)
        woken = voluntary_switches(driver.pid, network_thread) - woken
        after = counters_of(driver)
        elapsed_s = time.monotonic() - began
    moved = {name: after[name] - before[name] for name in (
        "HEARTBEATS_SENT", "STATUS_MESSAGES_SENT", "NETWORK_PYTHON_PASSES", "GOVERNOR_CLIMBS",
        "GOVERNOR_DESCENTS")}
    # Each timers' wake-up, and one for the datagrams it sent; a wait for the GIL at each
    # Python pass and governor step (a command); then timers spread one a stream would pass
    # this several times over (the old loop: about 900 a second).
    commands = moved["GOVERNOR_CLIMBS"] + moved["GOVERNOR_DESCENTS"]
    instants = elapsed_s / (network.SS_KEEPALIVE_GRAIN_NS / 1e9) + 1
    bound = 2 * instants + moved["NETWORK_PYTHON_PASSES"] + commands + 10
    assert 2 * instants < elapsed_s / slack_s  # the slack alone allowed twice this
    assert woken <= bound, (woken, bound, moved)
    # The counters are read after the window's end: up to one heartbeat more a stream.
    heartbeats = moved["HEARTBEATS_SENT"] / pairs / elapsed_s
    assert heartbeats <= 1 / (heartbeat_s - slack_s) + 1 / elapsed_s, moved
    assert heartbeats >= 1 / heartbeat_s / 2, moved  # the loaded machine's margin


def test_streams_sharing_an_endpoint_send_their_keepalives_without_overflowing_it(
        driver_dir: Path) -> None:
    """Streams on one channel share its sockets and their keepalive instants: each instant,
    half of them send a heartbeat through the one send socket to the one receive socket,
    and a quarter of the images an SM back.  With more of either than the receiver's socket
    buffer holds small datagrams, sent at once, the kernel dropped those past it
    (heartbeats, SMs, and at 1,000 streams the answers some SETUPs waited for).  A duty
    cycle sends at most SS_KEEPALIVE_BURST_MAX keepalives through a socket, the rest in the
    cycles after: not one is dropped, and they keep their intervals."""
    import socket

    from slipstream.daemon._network import lib as network

    rcvbuf = 32 * 1024
    # What such a buffer holds of 40-byte datagrams (the kernel charges each its sk_buff).
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sink, \
            socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as source:
        sink.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sink.bind(("127.0.0.1", 0))
        sink.setblocking(False)
        for _ in range(400):
            source.sendto(bytes(40), sink.getsockname())
        held = 0
        with contextlib.suppress(BlockingIOError):
            while sink.recv(64):
                held += 1
    pairs = 400
    # An instant's heartbeats (half the streams) and SMs (a quarter) would each overflow it,
    # a cycle's may not.
    assert network.SS_KEEPALIVE_BURST_MAX < held < pairs // 4, held
    window_s = 3.0
    uri = f"aeron:udp?endpoint=127.0.0.1:{free_port()}|term-length=64k"
    settings = {"socket_so_rcvbuf": str(rcvbuf), "rcv_initial_window_length": str(rcvbuf)}
    with MediaDriver.launch(directory=driver_dir, **settings) as driver, \
            Client.connect(driver_dir) as client:
        streams = [(client.add_subscription(uri, 100 + i), client.add_publication(uri, 100 + i))
                   for i in range(pairs)]
        wait_for(lambda: all(p.is_connected and s.images for s, p in streams), timeout=90,
                 what="every stream connected")
        time.sleep(0.5)  # the SETUPs answered, idle
        before, drops = counters_of(driver), process_udp_drops(driver.pid)
        began = time.monotonic()
        time.sleep(window_s)
        after, drops = counters_of(driver), process_udp_drops(driver.pid) - drops
        elapsed_s = time.monotonic() - began
    moved = {name: after[name] - before[name] for name in (
        "HEARTBEATS_SENT", "HEARTBEATS_RECEIVED", "STATUS_MESSAGES_SENT",
        "STATUS_MESSAGES_RECEIVED")}
    assert drops == 0, (drops, moved)
    # At least half of each on time (the loaded machine's margin), the governor's widening of
    # the SMs' interval included.
    heartbeats = moved["HEARTBEATS_SENT"] / pairs / elapsed_s
    assert heartbeats >= 1 / (network.SS_HEARTBEAT_TIMEOUT_NS / 1e9) / 2, moved
    sm_interval_s = load_settings(env={}).status_message_timeout / 1e9 * STATUS_INTERVAL_FACTOR
    assert moved["STATUS_MESSAGES_SENT"] >= pairs * elapsed_s / sm_interval_s / 2, moved


def test_idle_streams_keep_their_interval_beside_a_busy_one(driver_dir: Path) -> None:
    """While one stream carries data the network thread runs a cycle every millisecond or
    so, and takes each idle stream's keepalive up to SS_TIMER_SLACK_NS early: the next is
    timed from the instant the early one was due at, not from its send, so an idle stream's
    heartbeats keep their interval (timed from the early send and taken back to the
    instants, they would go twice as often)."""
    from slipstream.daemon._network import lib as network

    pairs = 32
    slack_s = network.SS_TIMER_SLACK_NS / 1e9
    heartbeat_s = network.SS_HEARTBEAT_TIMEOUT_NS / 1e9
    window_s = 2.0
    with MediaDriver.launch(directory=driver_dir) as driver, Client.connect(driver_dir) as client:
        _connected_idle_pairs(client, pairs, spaced_s=heartbeat_s / pairs)
        uri = f"aeron:udp?endpoint=127.0.0.1:{free_port()}|term-length=64k"
        subscription = client.add_subscription(uri, 99)
        publication = client.add_publication(uri, 99)
        wait_for(lambda: publication.is_connected and subscription.images,
                 what="the busy stream connected")
        stop = threading.Event()
        sent = []

        def busy() -> None:
            while not stop.is_set():
                if publication.offer(b"x" * 64) > 0:
                    sent.append(time.monotonic())
                subscription.poll(lambda data, header: None, 100)
                time.sleep(0.001)

        thread = threading.Thread(target=busy)
        thread.start()
        try:
            time.sleep(0.3)  # the idle streams' keepalives taken early a few times already
            before, began = counters_of(driver), time.monotonic()
            time.sleep(window_s)
            after, ended = counters_of(driver), time.monotonic()
        finally:
            stop.set()
            thread.join(5)
    elapsed_s = ended - began
    # Busy: a message every slack or more often, on average.
    during = [t for t in sent if began <= t <= ended]
    assert len(during) >= elapsed_s / slack_s, len(during)
    # The busy stream's publication sends data, not heartbeats: these are the idle ones'.
    heartbeats = (after["HEARTBEATS_SENT"] - before["HEARTBEATS_SENT"]) / pairs / elapsed_s
    assert heartbeats <= 1 / (heartbeat_s - slack_s) + 1 / elapsed_s, heartbeats
    assert heartbeats >= 1 / heartbeat_s / 2, heartbeats  # the loaded machine's margin
    # The idle images' timer SMs likewise, with the busy image's (its 25 % rule's: a quarter
    # of its window, 8 KiB, in well over 100 ms of these messages, and its timer's) on top.
    sm_interval_s = load_settings(env={}).status_message_timeout / 1e9
    busy_sms = elapsed_s * (10 + 1 / sm_interval_s)
    sms = (after["STATUS_MESSAGES_SENT"] - before["STATUS_MESSAGES_SENT"] - busy_sms) / pairs
    assert sms / elapsed_s <= 1 / (sm_interval_s - slack_s) + 1 / elapsed_s, sms


def _sockets(pid: int) -> dict[int, str]:
    """The descriptors of process ``pid`` that are sockets, each with its socket's inode
    (``socket:[N]``): a number that comes back holds another inode."""
    found = {}
    for name in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(FileNotFoundError):
            target = os.readlink(f"/proc/{pid}/fd/{name}")
            if target.startswith("socket:"):
                found[int(name)] = target
    return found


def test_endpoints_that_come_and_go_keep_their_sockets_polled(driver_dir: Path) -> None:
    """Above SS_POLL_ENDPOINTS_MIN endpoints a duty cycle reads only the sockets epoll says
    are readable, so each endpoint's socket must be registered as it comes and unregistered
    as it goes, and a number that comes back as another endpoint's socket must be polled as
    that one: with half the streams closed, their endpoints gone (their sockets closed) and
    as many new ones added (which the kernel gives those numbers again), every stream open
    carries its message."""
    from slipstream.daemon._network import lib as network

    pairs = 2 * network.SS_POLL_ENDPOINTS_MIN
    with MediaDriver.launch(directory=driver_dir) as driver, \
            Client.connect(driver_dir) as client:
        def add(i: int) -> tuple:
            uri = f"aeron:udp?endpoint=127.0.0.1:{free_port()}"
            return client.add_subscription(uri, 100 + i), client.add_publication(uri, 100 + i)

        streams = [add(i) for i in range(pairs)]
        wait_for(lambda: all(p.is_connected and s.images for s, p in streams), timeout=30,
                 what="every stream connected")
        before = _sockets(driver.pid)

        def gone() -> dict[int, str]:
            """The sockets of ``before`` the driver has closed (by inode)."""
            now = set(_sockets(driver.pid).values())
            return {fd: inode for fd, inode in before.items() if inode not in now}

        for subscription, publication in streams[::2]:
            publication.close()
            subscription.close()
        # Each closed pair had a send and a receive endpoint, a socket each.
        wait_for(lambda: len(gone()) >= pairs, timeout=60,
                 what="the closed streams' endpoints gone")
        closed = gone()
        streams = streams[1::2] + [add(pairs + i) for i in range(pairs // 2)]
        wait_for(lambda: all(p.is_connected and s.images for s, p in streams), timeout=30,
                 what="every stream open connected")
        now = _sockets(driver.pid)
        reused = [fd for fd, inode in closed.items() if fd in now and now[fd] != inode]
        assert reused, f"no closed endpoint's descriptor came back ({sorted(closed)})"
        unread = list(streams)
        for _, publication in streams:
            wait_for(lambda p=publication: p.offer(b"m") >= 0, timeout=10, what="an offer")
        deadline = time.monotonic() + 30
        while unread and time.monotonic() < deadline:
            unread = [(s, p) for s, p in unread if s.poll(lambda *_: None, 1) == 0]
            time.sleep(0.001)
        assert not unread, f"{len(unread)} of {len(streams)} streams carried nothing"
