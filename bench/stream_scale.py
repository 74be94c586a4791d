"""How a driver's costs grow with its streams: one driver, one client adding K stream pairs (a
subscription, then a publication, on stream 1000 + i; the publications are a second client
process's, as each mapped log holds a file descriptor), 64 KiB terms, one message through
each, then idle.  For each K it prints:

* the time to add a pair, in ms: the mean of the first 100 pairs and of the last 100, their
  ratio (flat is 1.0), and the total; IPC at K = 100, 1,000, 10,000 and UDP on loopback (an
  endpoint of its own each) at K = 100, 500, 2,000 by default;
* where the adds' time went in the driver: each of its threads' CPU per pair over the adds
  and over the last 100 (utime + stime from ``/proc/PID/task/TID/stat``, by thread name: the
  conductor is the main thread), which the machine's other load does not inflate as it does
  the wall time; and the subscription's part of the last 100 adds (the client's command and
  the driver's answer; the rest is the publication's, in the publishing client);
* the time from the last add until one message went through every pair (UDP: every stream
  connected), and through how many within 120 s (a stream the receiver refuses never
  connects);
* with the K streams open and idle (UDP endpoints on consecutive ports below the kernel's
  ephemeral range; with ``--shared-endpoint`` the UDP pairs share one, as the streams of one
  channel do, and its keepalive instants): the driver process's CPU (% of one core, utime +
  stime from ``/proc/PID/stat`` over ``--idle-s`` seconds), the heartbeats and status messages
  it sent per stream per second (UDP: a publication's heartbeats and an image's status
  messages keep flowing while idle), and its memory per stream: the growth of its RSS and the
  ``/dev/shm`` its directory holds (the logs' allocated blocks and the counters file) over the
  K streams.

The peer is Aeron's C driver (``aeronmd``, SHARED threading, its default idle strategy,
``AERON_COUNTERS_BUFFER_LENGTH=16m``, the same 64 KiB terms) with Aeron's C client adding the
same pairs (bench/stream_scale_aeron.c, compiled here against the build): give the Aeron
source tree with its CMake build (``--aeron-c DIR``: ``DIR/build/binaries/aeronmd``,
``DIR/build/lib/libaeron_static.a``, ``DIR/aeron-client/src/main/c/aeronc.h``; or
``$SLIPSTREAM_AERON_C``).  It runs up to ``--aeron-max`` pairs (its adds take about 60 ms each
whatever K is: 10,000 would take 10 minutes); without a build it is reported as not run.

    .venv/bin/python -m bench.stream_scale [--ipc 100,1000,10000] [--udp 100,500,2000]
        [--idle-s 5] [--aeron-c DIR] [--aeron-max 1000] [--no-aeron] [--shared-endpoint]
        [--set KEY=VALUE ...]

Figures are of one run each; the machine is shared by whatever else runs.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.ipc_throughput import driver_setting, machine, positive_int, scratch_directory

#: The pairs whose adds make the "first" and "last" figures.
EDGE = 100
#: Seconds the streams stay idle before the idle figures are taken (settled).
SETTLE_S = 1.0
#: What a run may take to move its one message through every pair (s).
THROUGH_TIMEOUT_S = 120.0
#: What the reads may take after the offers (s).
READ_TIMEOUT_S = 10.0
#: The terms of every stream (bytes), for both drivers.
TERM_LENGTH = 64 * 1024
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass
class Curve:
    """One driver's figures at one K."""

    driver: str
    transport: str
    pairs: int
    add_ns: list[int]
    through_s: float
    through: int  # the pairs whose message arrived
    idle_cpu: float  # share of one core
    heartbeats: float | None  # per stream per second (slipstream's counters)
    status_messages: float | None
    rss_per_stream: float  # bytes
    shm_per_stream: float  # bytes
    add_cpu_ms: dict[str, float]  # each driver thread's CPU per pair over the adds, by name
    #: Each driver thread's CPU per pair over the last EDGE adds, by name (None: not taken).
    last_cpu_ms: dict[str, float] | None = None
    #: The subscription's part of each add (ns; None: not taken apart).
    subscribe_ns: list[int] | None = None

    def mean_ms(self, part: slice) -> float:
        chosen = self.add_ns[part]
        return sum(chosen) / len(chosen) / 1e6

    @property
    def first_ms(self) -> float:
        return self.mean_ms(slice(0, min(EDGE, self.pairs)))

    @property
    def last_ms(self) -> float:
        return self.mean_ms(slice(max(0, self.pairs - EDGE), self.pairs))


def first_port(pairs: int) -> int:
    """The first of ``pairs`` consecutive UDP ports on 127.0.0.1, all free now, below the
    kernel's ephemeral range (where no send socket's port lands), for the K endpoints of a
    UDP run."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    base = low - pairs - 100
    while base >= 1024:
        taken = next((port for port in range(base, base + pairs) if not _udp_port_free(port)),
                     None)
        if taken is None:
            return base
        base = taken - pairs - 1
    raise RuntimeError(f"no {pairs} free consecutive UDP ports below {low}")


def _udp_port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def cpu_ticks(pid: int) -> int:
    """utime + stime of a process, clock ticks."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def thread_ticks(pid: int) -> dict[str, int]:
    """utime + stime of each thread of a process, clock ticks, summed by thread name."""
    ticks: dict[str, int] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue  # a thread that ended meanwhile
        ticks[name] = ticks.get(name, 0) + int(fields[11]) + int(fields[12])
    return ticks


def cpu_per_pair(before: dict[str, int], after: dict[str, int], pairs: int
                 ) -> dict[str, float]:
    """Each thread's CPU between two :func:`thread_ticks`, ms per pair, the busiest first
    (threads that took none left out)."""
    spent = {name: (after[name] - before.get(name, 0)) / CLOCK_TICKS * 1e3 / pairs
             for name in after}
    return dict(sorted(((n, ms) for n, ms in spent.items() if ms > 0),
                       key=lambda item: -item[1]))


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def shm_bytes(directory: Path) -> int:
    """The blocks allocated to the files under ``directory`` (tmpfs: the memory they take)."""
    total = 0
    for root, _, files in os.walk(directory):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total


def idle_cpu(pid: int, seconds: float, during: Callable[[], None] | None = None) -> float:
    """The share of one core process ``pid`` used over ``seconds``."""
    began_ticks, began = cpu_ticks(pid), time.monotonic()
    time.sleep(seconds)
    if during is not None:
        during()
    return (cpu_ticks(pid) - began_ticks) / CLOCK_TICKS / (time.monotonic() - began)


def _publishing_client(directory: str, channels: list[str], conn) -> None:
    """The publications, in a client process of their own: each mapped log holds a file
    descriptor (Python's mmap keeps one), and 10,000 images and 10,000 publications in one
    process pass what a process may hold.  For each index received it adds that pair's
    publication and answers the ns it took; then ("offer", deadline) offers one message on
    each until the deadline and answers the stream ids that took it; then waits for "close"."""
    from slipstream.client import Client

    with Client.connect(directory, timeout=30.0) as client:
        publications = []
        while isinstance(request := conn.recv(), int):
            began = time.perf_counter_ns()
            publications.append(client.add_publication(channels[request], 1000 + request))
            conn.send(time.perf_counter_ns() - began)
        if request == "close":  # the run failed before its offers
            return
        _, deadline = request
        message = bytes(32)
        waiting = list(publications)
        while waiting and time.time() < deadline:  # a stream refused never connects
            waiting = [p for p in waiting if p.offer(message) < 0]
            if waiting:
                time.sleep(0.001)
        conn.send({p.stream_id for p in publications} - {p.stream_id for p in waiting})
        conn.recv()


def run_slipstream(directory: Path, transport: str, pairs: int, idle_s: float,
                   settings: dict[str, str], *, shared_endpoint: bool = False) -> Curve:
    import multiprocessing

    from slipstream.client import Client
    from slipstream.daemon.driver import MediaDriver

    driver_directory = directory / f"slipstream-{transport}-{pairs}"
    overrides = {"term_buffer_length": str(TERM_LENGTH), "ipc_term_buffer_length": str(TERM_LENGTH),
                 **settings}
    base = first_port(pairs) if transport == "udp" else 0
    channels = ([f"aeron:udp?endpoint=127.0.0.1:{base + (0 if shared_endpoint else i)}"
                 for i in range(pairs)]
                if transport == "udp" else ["aeron:ipc"] * pairs)
    context = multiprocessing.get_context("spawn")
    conn, theirs = context.Pipe()
    with MediaDriver.launch(directory=driver_directory, **overrides) as driver, \
            Client.connect(driver_directory, timeout=30.0) as client:
        pid = driver.pid
        rss_before, shm_before = rss_bytes(pid), shm_bytes(driver_directory)
        publisher = context.Process(target=_publishing_client,
                                    args=(str(driver_directory), channels, theirs))
        publisher.start()
        try:
            return _measure(driver_directory, client, _Publisher(conn, publisher), pid,
                            channels, idle_s, (rss_before, shm_before), transport)
        finally:
            conn.send("close")
            publisher.join(60)


class _Publisher:
    """The publishing client's end of the pipe: an answer, or the error that it died."""

    def __init__(self, conn, process) -> None:
        self._conn, self._process = conn, process

    def send(self, request: object) -> None:
        self._conn.send(request)

    def recv(self) -> Any:
        while not self._conn.poll(1.0):
            if not self._process.is_alive():
                raise RuntimeError(f"the publishing client ended (exit code "
                                   f"{self._process.exitcode}): its error is above")
        return self._conn.recv()


def _measure(driver_directory: Path, client, conn, pid: int,
             channels: list[str], idle_s: float, before: tuple[int, int],
             transport: str) -> Curve:
    """Add the pairs (the subscription here, the publication in the publishing client), one
    message through each, then the idle figures."""
    from slipstream.client import control
    from slipstream.client.counters import CountersFile, SystemCounter

    pairs = len(channels)
    subscriptions, add_ns, subscribe_ns = [], [], []
    ticks_before = ticks_last = thread_ticks(pid)
    for i, channel in enumerate(channels):
        if i == pairs - EDGE:
            ticks_last = thread_ticks(pid)
        began = time.perf_counter_ns()
        subscriptions.append(client.add_subscription(channel, 1000 + i))
        subscribed_ns = time.perf_counter_ns() - began
        conn.send(i)
        add_ns.append(subscribed_ns + conn.recv())
        subscribe_ns.append(subscribed_ns)
    ticks_after = thread_ticks(pid)
    add_cpu_ms = cpu_per_pair(ticks_before, ticks_after, pairs)
    last_cpu_ms = cpu_per_pair(ticks_last, ticks_after, min(EDGE, pairs))
    began = time.monotonic()
    conn.send(("offer", time.time() + THROUGH_TIMEOUT_S))
    sent = conn.recv()
    # The messages offered arrive in a moment: a read past the offers' deadline still counts.
    deadline = max(began + THROUGH_TIMEOUT_S, time.monotonic() + READ_TIMEOUT_S)
    unread = [s for s in subscriptions if s.stream_id in sent]
    while unread and time.monotonic() < deadline:
        unread = [s for s in unread if s.poll(lambda *_: None, 1) == 0]
        if unread:
            time.sleep(0.001)
    through = len(sent) - len(unread)
    through_s = time.monotonic() - began
    time.sleep(SETTLE_S)
    counters = CountersFile(driver_directory / control.COUNTERS_FILE, writable=False)
    try:
        sent_before = (counters.get(SystemCounter.HEARTBEATS_SENT),
                       counters.get(SystemCounter.STATUS_MESSAGES_SENT))
        sent_after: list[int] = []
        began = time.monotonic()
        cpu = idle_cpu(pid, idle_s, lambda: sent_after.extend(
            (counters.get(SystemCounter.HEARTBEATS_SENT),
             counters.get(SystemCounter.STATUS_MESSAGES_SENT))))
        elapsed = time.monotonic() - began
    finally:
        counters.close()
    per_stream = pairs * elapsed
    rss_before, shm_before = before
    return Curve("slipstream", transport, pairs, add_ns, through_s, through, cpu,
                 (sent_after[0] - sent_before[0]) / per_stream,
                 (sent_after[1] - sent_before[1]) / per_stream,
                 (rss_bytes(pid) - rss_before) / pairs,
                 (shm_bytes(driver_directory) - shm_before) / pairs, add_cpu_ms, last_cpu_ms,
                 subscribe_ns)


def build_aeron_client(aeron: Path, directory: Path) -> Path:
    """bench/stream_scale_aeron.c compiled against the Aeron build under ``aeron``."""
    program = directory / "stream_scale_aeron"
    subprocess.run(
        [os.environ.get("CC", "cc"), "-O2", "-o", str(program),
         str(Path(__file__).with_name("stream_scale_aeron.c")),
         f"-I{aeron / 'aeron-client/src/main/c'}", str(aeron / "build/lib/libaeron_static.a"),
         "-lpthread", "-ldl", "-lm", "-lrt"], check=True)
    return program


def run_aeron(aeron: Path, program: Path, directory: Path, transport: str, pairs: int,
              idle_s: float) -> Curve:
    aeron_directory = directory / f"aeron-{transport}-{pairs}"
    environment = {**os.environ, "AERON_DIR": str(aeron_directory),
                   "AERON_THREADING_MODE": "SHARED", "AERON_COUNTERS_BUFFER_LENGTH": "16m",
                   "AERON_TERM_BUFFER_LENGTH": str(TERM_LENGTH),
                   "AERON_IPC_TERM_BUFFER_LENGTH": str(TERM_LENGTH),
                   "AERON_DIR_DELETE_ON_START": "1", "AERON_DIR_DELETE_ON_SHUTDOWN": "1"}
    driver = subprocess.Popen([str(aeron / "build/binaries/aeronmd")], env=environment,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 10
        while not (aeron_directory / "cnc.dat").exists():
            if driver.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"aeronmd did not start: {driver.stderr.read().decode()}")
            time.sleep(0.05)
        time.sleep(0.2)
        rss_before, shm_before = rss_bytes(driver.pid), shm_bytes(aeron_directory)
        ticks_before = thread_ticks(driver.pid)
        client = subprocess.Popen(
            [str(program), str(aeron_directory), transport, str(pairs),
             str(first_port(pairs) if transport == "udp" else 0),
             str(int(idle_s + SETTLE_S + 2))], stdout=subprocess.PIPE, text=True)
        assert client.stdout is not None
        add_ns = [int(client.stdout.readline()) for _ in range(pairs)]
        add_cpu_ms = cpu_per_pair(ticks_before, thread_ticks(driver.pid), pairs)
        through_s = float(client.stdout.readline().split()[1])
        if client.stdout.readline().strip() != "idle":
            raise RuntimeError("the Aeron client did not reach its idle phase")
        time.sleep(SETTLE_S)
        cpu = idle_cpu(driver.pid, idle_s)
        curve = Curve("aeron C", transport, pairs, add_ns, through_s, pairs, cpu, None, None,
                      (rss_bytes(driver.pid) - rss_before) / pairs,
                      (shm_bytes(aeron_directory) - shm_before) / pairs, add_cpu_ms)
        client.wait(timeout=60)
        return curve
    finally:
        driver.terminate()
        driver.wait(timeout=30)


def print_curve(curve: Curve, peer: Curve | None) -> None:
    rates = ("" if curve.heartbeats is None or curve.transport != "udp" else
             f"; idle sends {curve.heartbeats:.1f} heartbeats and {curve.status_messages:.1f} "
             f"SMs per stream per s")
    versus = ("" if peer is None else
              f" [vs aeron C: first {curve.first_ms / peer.first_ms:.2f}x, "
              f"last {curve.last_ms / peer.last_ms:.2f}x]")
    edge = min(EDGE, curve.pairs)
    subscribing = ("" if curve.subscribe_ns is None else
                   f" (the subscription {sum(curve.subscribe_ns[-edge:]) / edge / 1e6:.2f} ms "
                   f"of the last's)")
    last_cpu = curve.last_cpu_ms or {}
    cpu = ", ".join(f"{name} {ms:.2f} ms" + (f" (last {edge} {last_cpu[name]:.2f} ms)"
                                             if name in last_cpu else "")
                    for name, ms in curve.add_cpu_ms.items())
    print(f"  {curve.driver:10s} {curve.transport} K={curve.pairs:6d}: add a pair "
          f"{curve.first_ms:7.2f} ms first {edge} -> {curve.last_ms:7.2f} ms "
          f"last {edge} ({curve.last_ms / curve.first_ms:.2f}x){subscribing}, "
          f"{sum(curve.add_ns) / 1e9:.1f} s in all; driver CPU per pair {cpu}; "
          f"one message through "
          f"{curve.through} of {curve.pairs} in {curve.through_s:.2f} s; idle "
          f"{100 * curve.idle_cpu:.1f} % of a core{rates}; "
          f"per stream RSS {curve.rss_per_stream / 1024:.0f} KiB, /dev/shm "
          f"{curve.shm_per_stream / 1024:.0f} KiB{versus}", flush=True)


def counts(text: str) -> list[int]:
    return [positive_int(part) for part in text.split(",") if part]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ipc", type=counts, default=[100, 1000, 10000],
                        help="the IPC pair counts (comma-separated; empty: none)")
    parser.add_argument("--udp", type=counts, default=[100, 500, 2000],
                        help="the UDP loopback pair counts (comma-separated; empty: none)")
    parser.add_argument("--idle-s", type=float, default=5.0,
                        help="seconds the idle figures are measured over")
    parser.add_argument("--aeron-c", type=Path, default=os.environ.get("SLIPSTREAM_AERON_C"),
                        help="the Aeron source tree with its CMake build in build/")
    parser.add_argument("--aeron-max", type=positive_int, default=1000,
                        help="the most pairs Aeron's C driver is run with")
    parser.add_argument("--no-aeron", action="store_true", help="leave the Aeron peer out")
    parser.add_argument("--shared-endpoint", action="store_true",
                        help="the UDP pairs on one endpoint (Aeron's peer left out there)")
    parser.add_argument("--set", type=driver_setting, action="append", default=[],
                        metavar="KEY=VALUE", help="a slipstream driver setting")
    args = parser.parse_args()
    settings = dict(args.set)
    endpoints = "one UDP endpoint" if args.shared_endpoint else "a UDP endpoint a pair"
    print(f"stream scale on {machine()}; {TERM_LENGTH // 1024} KiB terms, two clients, "
          f"{endpoints}, "
          f"slipstream settings: defaults{''.join(f', {k}={v}' for k, v in settings.items())}")
    aeron: Path | None = None if args.no_aeron else args.aeron_c
    why_not = ("left out (--no-aeron)" if args.no_aeron
               else "not run: no Aeron build given (--aeron-c or $SLIPSTREAM_AERON_C)")
    if aeron is not None and not (aeron / "build/binaries/aeronmd").exists():
        why_not, aeron = f"not run: no {aeron / 'build/binaries/aeronmd'}", None
    with scratch_directory() as scratch:
        directory = Path(scratch)
        program = build_aeron_client(aeron, directory) if aeron is not None else None
        if aeron is None:
            print(f"  aeron C driver: {why_not}")
        for transport, ks in (("ipc", args.ipc), ("udp", args.udp)):
            for pairs in ks:
                peer = None
                if aeron is not None and program is not None:
                    if args.shared_endpoint and transport == "udp":
                        print(f"  aeron C    udp K={pairs:6d}: not run (--shared-endpoint)")
                    elif pairs <= args.aeron_max:
                        peer = run_aeron(aeron, program, directory, transport, pairs, args.idle_s)
                        print_curve(peer, None)
                        shutil.rmtree(directory / f"aeron-{transport}-{pairs}",
                                      ignore_errors=True)
                    else:
                        print(f"  aeron C    {transport} K={pairs:6d}: not run (over "
                              f"--aeron-max {args.aeron_max})")
                curve = run_slipstream(directory, transport, pairs, args.idle_s, settings,
                                       shared_endpoint=args.shared_endpoint)
                print_curve(curve, peer)
                shutil.rmtree(directory / f"slipstream-{transport}-{pairs}", ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
