"""Small helpers shared by the test modules (import as ``from helpers import ...``)."""

from __future__ import annotations

import collections
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn

import pytest

# Short timers so liveness, unblocking and linger show within a test's patience.
FAST_DRIVER_SETTINGS = {
    "client_liveness_timeout": "1s",
    "client_keepalive_interval": "100ms",
    "publication_unblock_timeout": "1500ms",
    "publication_linger_timeout": "500ms",
    "timer_interval": "100ms",
    "ipc_term_buffer_length": "64k",
    "drain_timeout": "2s",
}
#: Drivers of network tests: small logs (and many term rotations in a short stream), and
#: connections and images that time out within a test's patience.
NETWORK_SETTINGS = {
    **FAST_DRIVER_SETTINGS,
    "term_buffer_length": "64k",
    "publication_connection_timeout": "1s",
    "image_liveness_timeout": "1s",
}
#: How long the fixtures wait for a driver to accept clients (s).  No test here times the
#: start; beside the niced groups' builds and installs a start that takes 0.3 s alone was
#: seen to take over 20 s (two fixtures in a row failed so).  A start still being scheduled
#: is given up to STARTUP_PATIENCE times this: 250 s, under the suite's default pytest
#: timeout (300 s) for one start, so that one that never ends fails there with the
#: driver's error, its stacks and the machine's state (a module with a shorter timeout, or
#: a test that starts several, ends in pytest's timeout first).
DRIVER_START_TIMEOUT_S = 50.0
SEQUENCE = struct.Struct("<I")
#: The IPC channel of the tests' streams that take the driver's IPC settings.
IPC_CHANNEL = "aeron:ipc"


def wait_for(predicate: Callable[[], object], timeout: float = 5.0,
             what: str = "condition") -> None:
    """Poll ``predicate`` every 10 ms until it is true; AssertionError after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not met within {timeout} s")
        time.sleep(0.01)


def data_datagrams(publication, now_ns: int, budget: int = 64) -> list:
    """What the C data path sends of ``publication`` now (``ss_send_data`` with no socket),
    as Datagrams copied out of its log (a publication with no binding only fills the spans;
    the simulator's binding would put each on its network).  The caller tells
    the publication (``on_data_sent``), as the sender agent does."""
    from slipstream.daemon._network import ffi as network_ffi
    from slipstream.daemon._network import lib as network
    from slipstream.daemon.protocol.types import Datagram

    spans = network_ffi.new("ss_span_t[]", budget + network.SS_RETRANSMIT_MAX)
    sent = network.ss_send_data(publication.c, now_ns, budget, spans)
    view = publication.log.view
    out = []
    for i in range(max(sent, 0)):
        offset = spans[i].log_offset
        out.append(Datagram(bytes(view[offset:offset + spans[i].length]),
                            publication.destination))
    return out


def network_publication(directory: Path, uri: str, destination: tuple[str, int], *,
                        term_length: int = 64 * 1024, initial_term_id: int = 10,
                        session_id: int = 5, stream_id: int = 6, counters: Any = None,
                        **settings: Any) -> Any:
    """A NetworkPublication of ``uri`` on its own (no conductor, no sender agent), made as the
    conductor makes one: a new log in ``directory`` (``term_length`` bytes a term, mtu 1408),
    in-process sender positions (its ``positions``), the flow control ``uri`` names,
    ``counters`` (new LocalCounters if None) and DriverSettings of ``term_length`` terms and
    ``settings``, sending to ``destination``."""
    import uuid

    from slipstream.client.channel import parse_channel
    from slipstream.client.logbuffer import LogBuffer
    from slipstream.daemon.config import DriverSettings
    from slipstream.daemon.flow.registry import flow_control_for
    from slipstream.daemon.protocol.params import PublicationParams
    from slipstream.daemon.protocol.types import LocalCounters
    from slipstream.daemon.streams.publication import NetworkPublication, SenderPositions

    log = LogBuffer.create(directory / f"{uuid.uuid4().hex}.log", term_length=term_length,
                           initial_term_id=initial_term_id, session_id=session_id,
                           stream_id=stream_id, mtu=1408, correlation_id=1)
    driver_settings = DriverSettings(**{"term_buffer_length": term_length, **settings})
    params = PublicationParams.for_network(parse_channel(uri), driver_settings)
    return NetworkPublication(
        log=log, params=params, settings=driver_settings, positions=SenderPositions.in_process(),
        flow_control=flow_control_for(params),
        counters=LocalCounters() if counters is None else counters, now_ns=0,
        destination=destination)


def _ephemeral_port_count() -> int:
    """How many ports the kernel picks from for a bind to port 0."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        return 16384
    return high - low + 1


#: The ports :func:`free_port` handed out lately, oldest first: the kernel may pick a port
#: it picked a moment ago, once the socket that held it is closed.  At most a quarter of the
#: ports it picks from, so that a fresh one is always there to find.
_PORTS_HANDED_OUT: collections.deque[int] = collections.deque(
    maxlen=min(1000, _ephemeral_port_count() // 4))


def free_port() -> int:
    """A UDP port on 127.0.0.1 that nothing is bound to right now, and none of the last
    ones (up to a thousand) this process was handed: ports taken one after another are
    distinct."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _PORTS_HANDED_OUT:
            _PORTS_HANDED_OUT.append(port)
            return port


# -- streams checked message by message -----------------------------------------------------


def message(seq: int, size: int) -> bytes:
    """A test message: its sequence number at the start and again at the end."""
    body = bytearray(max(size, 8))
    SEQUENCE.pack_into(body, 0, seq)
    SEQUENCE.pack_into(body, len(body) - 4, seq)
    return bytes(body)


class Collector:
    """A subscriber's view: the sequence numbers in arrival order, and anything torn."""

    def __init__(self, subscription: Any) -> None:
        self.subscription = subscription
        self.seen: list[int] = []
        self.torn = 0

    def on_message(self, data: memoryview, _header: object) -> None:
        seq = SEQUENCE.unpack_from(data)[0]
        if SEQUENCE.unpack_from(data, len(data) - 4)[0] != seq:
            self.torn += 1
        self.seen.append(seq)

    def poll(self) -> int:
        return self.subscription.poll(self.on_message, 1000)

    def assert_exactly(self, count: int, first: int = 0) -> None:
        """Exactly ``first .. first + count - 1``: nothing missing, duplicated, reordered."""
        assert self.torn == 0
        expected = list(range(first, first + count))
        wrong = next((i for i, (s, e) in enumerate(zip(self.seen, expected, strict=False))
                      if s != e), min(len(self.seen), count))
        assert self.seen == expected, f"{len(self.seen)} messages, first wrong at {wrong}"


def stream(publication: Any, collectors: list[Collector], count: int,
           size: Callable[[int], int], timeout: float = 30.0, first: int = 0) -> None:
    """Offer messages ``first .. first + count - 1`` as fast as the publication takes them
    while polling, until every collector has ``count`` more messages than it had.  Fails when
    ``timeout`` seconds pass with no message offered or received: a stream that moves slowly
    (a loaded machine) is waited for, one that stopped is not."""
    sent = first
    deadline = time.monotonic() + timeout
    targets = [len(c.seen) + count for c in collectors]
    while any(len(c.seen) < target for c, target in zip(collectors, targets, strict=True)):
        assert time.monotonic() < deadline, (
            f"nothing moved for {timeout} s: sent {sent - first}, "
            f"received {[len(c.seen) for c in collectors]} of {targets}")
        offered = sent
        while sent < first + count:
            if publication.offer(message(sent, size(sent))) < 0:
                break
            sent += 1
        if sum(c.poll() for c in collectors) or sent > offered:
            deadline = time.monotonic() + timeout
        else:
            time.sleep(0)


def stream_to_all(publication: Any, subscriptions: Any, count: int,
                  size: Callable[[int], int], timeout: float = 30.0) -> list[Collector]:
    """:func:`stream` ``count`` messages to a collector of each of ``subscriptions``, then
    check every one took them exactly once, in order; returns the collectors."""
    collectors = [Collector(s) for s in subscriptions]
    stream(publication, collectors, count, size, timeout)
    for collector in collectors:
        collector.assert_exactly(count)
    return collectors


def counters_of(driver: Any) -> dict[str, int]:
    """The system counters of a driver, by name."""
    from slipstream.client.counters import read_system_counters

    return {c.name: v for c, v in read_system_counters(driver.directory).items()}


def counters_labelled(driver: Any, prefix: str) -> list[Any]:
    """The counters (CounterInfo) of ``driver`` whose labels start with ``prefix``."""
    from slipstream.client import control
    from slipstream.client.counters import CountersFile

    counters = CountersFile(driver.directory / control.COUNTERS_FILE, writable=False)
    try:
        return [info for info in counters if info.label.startswith(prefix)]
    finally:
        counters.close()


def publisher_limits(driver: Any) -> int:
    """How many pub-lmt counters ``driver`` has: its publications that are not freed yet."""
    from slipstream.client import control
    from slipstream.client.counters import CountersFile, CounterType

    counters = CountersFile(driver.directory / control.COUNTERS_FILE, writable=False)
    try:
        return sum(1 for info in counters if info.type_id == CounterType.PUBLISHER_LIMIT)
    finally:
        counters.close()


def lacking(reason: str) -> NoReturn:
    """A test's need this machine does not meet: a skip, or under CI=true (which runs as
    root with everything ``make test`` installs) a failure, never a skip."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"under CI=true: {reason}")
    pytest.skip(reason)


@contextlib.contextmanager
def small_tmpfs(mount_point: Path, size: int) -> Iterator[Path]:
    """A tmpfs of ``size`` bytes mounted at ``mount_point`` (made if missing) for the block,
    unmounted after (:func:`resize_tmpfs` changes its size).  Needs root and mount: without
    them the test skips, and under CI=true it fails."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        lacking("needs root and mount, for a small tmpfs")
    mount_point.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs",
                           str(mount_point)], capture_output=True, text=True)
    if done.returncode != 0:
        lacking(f"mount -t tmpfs failed: {done.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


def resize_tmpfs(mount_point: Path, size: int) -> None:
    """Make the tmpfs at ``mount_point`` ``size`` bytes (rounded up to pages; no less than
    it holds)."""
    subprocess.run(["mount", "-o", f"remount,size={size}", str(mount_point)], check=True,
                   capture_output=True)


def as_another_user(uid: int) -> list[str]:
    """The command prefix that runs a process as ``uid`` (``setpriv``, as root).  Without root
    or setpriv the test skips, and under CI=true (which runs as root) it fails."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        lacking("needs root and setpriv, to run a process as another user")
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]


def process_state(pid: int) -> str:
    """The state letter in /proc/<pid>/stat (T: stopped, Z: a zombie; "": no such process)."""
    try:
        with open(f"/proc/{pid}/stat") as stat_file:
            return stat_file.read().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        return ""


@contextlib.contextmanager
def children_take(*signums: signal.Signals) -> Iterator[None]:
    """Processes started in the block begin with ``signums`` at their default action, even
    when this one ignores them (a background job of a non-interactive shell ignores SIGINT,
    ``nohup`` SIGHUP, and a child inherits what is ignored): each ignored one gets a handler
    that does nothing for the block, and a handler is reset at ``exec``.  This process still
    takes nothing of them meanwhile.  Main thread only."""
    ignored = [signum for signum in signums if signal.getsignal(signum) == signal.SIG_IGN]
    for signum in ignored:
        signal.signal(signum, lambda *_: None)
    try:
        yield
    finally:
        for signum in ignored:
            signal.signal(signum, signal.SIG_IGN)


def catches(pid: int, signum: signal.Signals) -> bool:
    """Whether process ``pid`` has a handler for ``signum`` (SigCgt in /proc/<pid>/status)."""
    with open(f"/proc/{pid}/status") as status:
        caught = next(line for line in status if line.startswith("SigCgt:"))
    return bool(int(caught.split()[1], 16) >> (signum - 1) & 1)


def runnable_s(*, all_threads: bool = False, pid: int | None = None) -> float:
    """Seconds the calling thread (``all_threads``: every thread of this process, summed;
    ``pid``: every thread of that process, summed) has been runnable: on a CPU, or waiting
    for one (``schedstat`` in /proc).  A thread that spins is runnable all the time however
    loaded the machine (it waits for a CPU instead), one that sleeps is not: what a wait
    costs, told apart from the load."""
    return sum(on_cpu + waiting for on_cpu, waiting, _ in _schedstats(all_threads, pid))


def cpu_wait_s(pid: int, thread: str | None = None) -> float:
    """Seconds a thread of process ``pid`` has waited for a CPU while runnable
    (``schedstat``'s second field): the one named ``thread`` (its ``comm``), or with None
    the main thread.  What a loaded machine made it wait, told apart from what it waited on
    itself.  LookupError when there is no such thread."""
    if thread is None:
        return int(Path(f"/proc/{pid}/task/{pid}/schedstat").read_text().split()[1]) / 1e9
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            if (task / "comm").read_text().strip() == thread:
                return int((task / "schedstat").read_text().split()[1]) / 1e9
    raise LookupError(f"process {pid} has no thread named {thread}")


#: A thread to watch for waits for a CPU: (process id, thread name, or None: the main thread).
WatchedThread = tuple[int, "str | None"]


class CpuWaits:
    """How long ``threads`` waited for a CPU, sampled every ``interval`` s on a thread of its
    own while the block runs (``with CpuWaits(...) as waits``).  On a loaded machine a
    stalled stream or an old heartbeat may be the scheduler's: :meth:`within` says how much
    of a span it was, so that a bound holds the drivers to the rest.  A thread that is not
    there (yet: a driver starts its log maker's at its first image log) counts from when it
    is."""

    def __init__(self, threads: list[WatchedThread], interval: float = 0.01) -> None:
        self.threads = list(dict.fromkeys(threads))
        self.interval = interval
        self._samples: list[tuple[float, dict[WatchedThread, float | None]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-waits", daemon=True)

    def start(self) -> CpuWaits:
        """Sample from now on (what ``with`` does first)."""
        self._sample()
        self._thread.start()
        return self

    def stop(self) -> None:
        """Sample once more, then no more (what ``with`` does last)."""
        self._stop.set()
        self._thread.join(5)
        self._sample()

    def __enter__(self) -> CpuWaits:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _sample(self) -> None:
        waits: dict[WatchedThread, float | None] = {}
        for thread in self.threads:
            try:
                waits[thread] = cpu_wait_s(*thread)
            except (LookupError, OSError):  # not there (yet), or its process ended
                waits[thread] = None
        self._samples.append((time.monotonic(), waits))

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def within(self, threads: list[WatchedThread], start: float, end: float) -> float:
        """The longest any of ``threads`` waited for a CPU between ``start`` and ``end``
        (monotonic s), as far as the samples in that span tell (0.0 with fewer than two)."""
        inside = [waits for t, waits in list(self._samples) if start <= t <= end]
        longest = 0.0
        for thread in threads:
            seen = [waits[thread] for waits in inside if waits[thread] is not None]
            if len(seen) >= 2:
                longest = max(longest, seen[-1] - seen[0])
        return longest


_LAG_WITNESS = """
import sys, time
tick, floor = float(sys.argv[1]), float(sys.argv[2])
while True:
    due = time.monotonic() + tick
    time.sleep(tick)
    late = time.monotonic() - due
    if late >= floor:
        print(due, late, flush=True)
"""


class LagWitness:
    """A process of its own, of ordinary priority, that sleeps ``tick_s`` at a time and notes
    each wake-up that came ``floor_s`` or more late, while the block runs (``with
    LagWitness() as witness``): the machine's timer lateness as any thread sees it, beside
    the drivers' network threads, whose timed wake-ups the pressure governor's lag signal
    reads.  A climb that lag led is the machine's where the witness was late too."""

    def __init__(self, tick_s: float = 0.001, floor_s: float = 0.0005) -> None:
        self.tick_s, self.floor_s = tick_s, floor_s
        #: (when the wake-up was due, how late it came), monotonic s, once the block ended.
        self.late: list[tuple[float, float]] = []
        self._output: Any = None
        self._process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> LagWitness:
        import tempfile

        self._output = tempfile.TemporaryFile()
        self._process = subprocess.Popen(
            [sys.executable, "-c", _LAG_WITNESS, str(self.tick_s), str(self.floor_s)],
            stdout=self._output)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._process is not None
        self._process.kill()
        self._process.wait(10)
        self._output.seek(0)
        lines = self._output.read().decode().split("\n")
        self._output.close()
        self.late = [(float(due), float(late)) for due, late in
                     (line.split() for line in lines if line.count(" ") == 1)]

    def late_windows(self, start: float, end: float, window_s: float,
                     threshold_s: float) -> int:
        """How many ``window_s``-long windows of ``[start, end)`` (monotonic s) saw a
        wake-up at least ``threshold_s`` late."""
        return len({int((due - start) // window_s) for due, late in self.late
                    if start <= due < end and late >= threshold_s})


def timeslices(pid: int) -> int:
    """How many times the threads of process ``pid`` (summed) were put on a CPU (the run
    count of ``schedstat``): a sleeping thread's wake-ups, and a runnable one's returns after
    it was preempted.  A count of wake-ups, which a loaded machine does not stretch."""
    return sum(runs for _, _, runs in _schedstats(True, pid))


def voluntary_switches(pid: int | None = None, tid: int | None = None) -> int:
    """How many times thread ``tid`` of process ``pid`` (by default the calling thread) went
    to sleep: its ``voluntary_ctxt_switches``.  A thread that waits by spinning or yielding
    adds none, one that sleeps adds one a sleep, however loaded the machine."""
    path = (Path("/proc/thread-self/status") if pid is None
            else Path(f"/proc/{pid}/task/{tid}/status"))
    return int(path.read_text().split("\nvoluntary_ctxt_switches:")[1].split()[0])


def udp_receive_drops(host: Any, port: int) -> int:
    """Datagrams the kernel of namespace host ``host`` dropped unread (a full receive buffer)
    at its UDP sockets bound to ``port``: the ``drops`` column of /proc/net/udp and udp6,
    so a flood at another socket of the host is not counted as this one's."""
    # udp6 is absent where IPv6 is off: what cat read of udp is all there is.
    text = host.run("cat", "/proc/net/udp", "/proc/net/udp6", check=False).stdout
    return _udp_drops(text, lambda fields: int(fields[1].rsplit(":", 1)[1], 16) == port)


def _udp_drops(text: str, chosen: Callable[[list[str]], bool]) -> int:
    """The ``drops`` column summed over the sockets of /proc/net/udp (or udp6) text whose
    fields ``chosen`` picks (local address at 1, inode at 9, drops last)."""
    drops = 0
    for line in text.splitlines():
        fields = line.split()
        if len(fields) >= 13 and ":" in fields[1] and fields[0] != "sl" and chosen(fields):
            drops += int(fields[-1])
    return drops


def process_udp_drops(pid: int) -> int:
    """Datagrams the kernel dropped unread (a full receive buffer) at the UDP sockets process
    ``pid`` holds: the ``drops`` column of /proc/net/udp and udp6 for its sockets' inodes, so
    that what other processes' sockets drop is not counted."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):  # an fd closed meanwhile
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[len("socket:["):-1])
    drops = 0
    for table in ("/proc/net/udp", "/proc/net/udp6"):
        with contextlib.suppress(FileNotFoundError):  # udp6 is absent where IPv6 is off
            drops += _udp_drops(Path(table).read_text(), lambda fields: fields[9] in inodes)
    return drops


def keepalive_threads() -> set[str]:
    """The thread ids of this process's keepalive threads (``ss-keepalive``, the client's C
    keeper of its heartbeat)."""
    found = set()
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            if (task / "comm").read_text().strip() == "ss-keepalive":
                found.add(task.name)
    return found


def _schedstats(all_threads: bool, pid: int | None) -> list[tuple[float, float, int]]:
    """(s on a CPU, s waiting for one, timeslices) of each thread chosen as ``runnable_s``."""
    if pid is not None:
        paths = list(Path(f"/proc/{pid}/task").glob("*/schedstat"))
    elif all_threads:
        paths = list(Path("/proc/self/task").glob("*/schedstat"))
    else:
        paths = [Path("/proc/thread-self/schedstat")]
    stats = []
    for path in paths:
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):  # a thread ended
            on_cpu, waiting, runs = path.read_text().split()
            stats.append((int(on_cpu) / 1e9, int(waiting) / 1e9, int(runs)))
    return stats


def offer_until(publication: Any, message: bytes, timeout: float = 5.0) -> int:
    """Offer ``message`` until it is taken (its position), failing after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = publication.offer(message)
        if result > 0:
            return result
        time.sleep(0.0005)
    raise AssertionError(f"offer did not succeed within {timeout} s (last result {result})")


def offer_with_aborted_claims(publication: Any, count: int, every: int,
                              message_at: Callable[[int], bytes], *,
                              poll: Callable[[], object] = lambda: 0,
                              timeout: float = 30.0) -> int:
    """Offer ``message_at(i)`` for i in 0 .. count - 1, aborting a claim before every
    ``every``-th message and two in a row before every fifth of those; ``poll`` runs while the
    publication is back pressured.  Each claim is of 1 to 700 bytes, mostly a frame length that
    is not a multiple of 32, and filled with 0xFF before the abort.  Returns how many claims
    were aborted."""
    from slipstream.client import BufferClaim

    claim = BufferClaim()
    aborted = 0
    deadline = time.monotonic() + timeout
    for index in range(count):
        claims = 0 if index % every else 2 if index % (5 * every) == 0 else 1
        for _ in range(claims):
            while publication.try_claim(1 + (index * 37 + aborted) % 700, claim) < 0:
                assert time.monotonic() < deadline, f"claim before message {index} refused"
                poll()
            claim.buffer[:] = b"\xff" * len(claim.buffer)
            claim.abort()
            aborted += 1
        while publication.offer(message_at(index)) < 0:
            assert time.monotonic() < deadline, f"message {index} not taken"
            poll()
    return aborted


def mdc_destinations(driver: Any) -> int:
    """The value of the driver's one mdc-destinations counter (a multi-destination-cast
    endpoint's destinations)."""
    from slipstream.client import control
    from slipstream.client.counters import CountersFile, CounterType

    counters = CountersFile(driver.directory / control.COUNTERS_FILE, writable=False)
    try:
        values = [c.value for c in counters if c.type_id == CounterType.MDC_DESTINATIONS]
    finally:
        counters.close()
    assert len(values) == 1, values
    return values[0]


def connect(publication: Any, *subscriptions: Any) -> None:
    """Wait until ``publication`` is connected and every subscription has an image."""
    wait_for(lambda: publication.is_connected
             and all(s.images for s in subscriptions), what="the stream connected")


def connected_ipc(client: Any, stream_id: int, channel: str = IPC_CHANNEL, *,
                  publication_channel: str | None = None) -> tuple[Any, Any]:
    """A subscription of ``channel``/``stream_id`` at ``client``, then a publication (of
    ``publication_channel`` if given, else ``channel``), connected: (publication,
    subscription)."""
    subscription = client.add_subscription(channel, stream_id)
    publication = client.add_publication(publication_channel or channel, stream_id)
    connect(publication, subscription)
    return publication, subscription


@contextlib.contextmanager
def connected_stream(a: Any, b: Any, uri: str, stream_id: int, *,
                     publication_uri: str | None = None,
                     ) -> Iterator[tuple[Any, Any, Collector]]:
    """A subscription of ``uri``/``stream_id`` at a client of driver ``b`` and a publication
    at a client of driver ``a`` (of ``publication_uri`` if given, else ``uri``: its own
    parameters, or a relay's address), connected: yields the publication, the subscription
    and a Collector of it.  Both clients close at the end."""
    from slipstream.client import Client

    with Client.connect(a.directory) as ca, Client.connect(b.directory) as cb:
        subscription = cb.add_subscription(uri, stream_id)
        publication = ca.add_publication(publication_uri or uri, stream_id)
        connect(publication, subscription)
        yield publication, subscription, Collector(subscription)


Counters = dict[str, int]


def stream_counted(a: Any, b: Any, uri: str, stream_id: int,
                   count: int = 20_000) -> tuple[tuple[Counters, Counters],
                                                 tuple[Counters, Counters], float]:
    """``count`` MTU-sized messages (1376 B, a datagram each) from a client of ``a`` to one
    of ``b``, checked exactly once and in order; returns both drivers' counters before and
    after the stream, ``(a's, b's)`` each, and the seconds it took."""
    with connected_stream(a, b, uri, stream_id) as (publication, _, collector):
        before, started = (counters_of(a), counters_of(b)), time.monotonic()
        stream(publication, [collector], count, lambda i: 1376)
        collector.assert_exactly(count)
        elapsed = time.monotonic() - started
        # The sender counts a batch's bytes after its sendmmsg returns: on a slow host the
        # subscriber may read the last datagrams before then (CI once saw 19,996 of 20,000).
        wait_for(lambda: counters_of(a)["BYTES_SENT"] - before[0]["BYTES_SENT"]
                 >= count * 1408, what="the sender's byte count of the whole stream")
        return before, (counters_of(a), counters_of(b)), elapsed


def run_stat(driver: Any, *args: str) -> subprocess.CompletedProcess[str]:
    """``slipstream stat --once`` of ``driver``'s directory (and ``args``), which must succeed."""
    result = subprocess.run([sys.executable, "-m", "slipstream.daemon.cli", "stat", "--dir",
                             str(driver.directory), "--once", *args],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    return result


def free_tcp_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> str:
    """A metrics exporter's page at ``port``, as Prometheus scrapes it."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return response.read().decode()


def value(text: str, series: str) -> float:
    """The value of ``series`` (its name and labels) in a scrape."""
    match = re.search(rf"^{re.escape(series)} (\S+)$", text, re.MULTILINE)
    assert match, f"{series} not in the scrape"
    return float(match[1])


class RawClient:
    """A client that speaks the control protocol by hand (zmq DEALER, JSON frames)."""

    def __init__(self, directory: Path) -> None:
        import zmq

        from slipstream.client import control

        self._zmq, self._control = zmq, control
        self.socket = zmq.Context.instance().socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(control.conductor_endpoint(directory))

    def send_raw(self, *frames: bytes) -> None:
        self.socket.send_multipart(list(frames))

    def request(self, message: dict) -> dict:
        self.send_raw(json.dumps(message).encode())
        return self.reply()

    def reply(self, timeout_ms: int = 5000) -> dict:
        assert self.socket.poll(timeout_ms, self._zmq.POLLIN), "the driver did not answer"
        return self._control.decode(self.socket.recv())

    def silent(self, timeout_ms: int = 300) -> bool:
        return not self.socket.poll(timeout_ms, self._zmq.POLLIN)

    def close(self) -> None:
        self.socket.close(0)


def readdress(hosts: Any, index: int, subnet: int, *, keep: bool) -> str:
    """Give namespace host ``index`` the address ``10.<net>.<subnet>.<index>/24``, beside its
    first one when ``keep``, else instead of it (a host re-addressed: what it reaches changes
    with it); returns the new address."""
    host = hosts[index]
    address = f"10.{hosts.net}.{subnet}.{index}"
    if not keep:
        host.run("ip", "addr", "del", f"{host.address}/24", "dev", host.veth)
    host.run("ip", "addr", "add", f"{address}/24", "dev", host.veth)
    return address


@contextlib.contextmanager
def running_archive(settings: Any) -> Iterator[Any]:
    """An ArchiveService of ``settings`` (ArchiveSettings) run on a thread of its own: yields
    the service; when the block ends it is stopped, its thread joined, and it is closed."""
    from slipstream.archive.service import ArchiveService

    stopping = threading.Event()
    with ArchiveService(settings) as service:
        runner = threading.Thread(target=service.run, args=(stopping.is_set,))
        runner.start()
        try:
            yield service
        finally:
            stopping.set()
            runner.join(10)


def start_holding_archive(driver_dir: Path | None, address: str, port: int, archive_dir: Path, *,
                          holds: tuple[tuple[str, int], ...] = (),
                          release_after_s: float | None = None,
                          popen: Callable[..., Any] | None = None) -> Any:
    """``slipstream-archive run`` beside the driver in ``driver_dir`` (None: the default),
    holding streams for
    read queries at ``address:port`` (its control stream: where a Spark ``holder`` option
    points), its directory ``archive_dir``: the ingest host's archive of docs/SPARK.md.
    ``holds``: (channel, stream id) held from the start; ``popen`` runs the command (a
    namespace host's), by default :class:`subprocess.Popen` here.  Its output is piped."""
    archive_dir.mkdir(parents=True, exist_ok=True)
    lines = [f"dir = {json.dumps(str(archive_dir))}",
             f"driver_dir = {json.dumps(str(driver_dir or ''))}",
             f"control_address = {json.dumps(address)}", f"control_port = {port}"]
    if release_after_s is not None:
        lines.append(f'release_after = "{release_after_s:g}s"')
    for channel, stream_id in holds:
        lines += ["[[hold]]", f"channel = {json.dumps(channel)}", f"stream_id = {stream_id}"]
    config = archive_dir / "holding.toml"
    config.write_text("\n".join(lines) + "\n")
    command = [str(Path(sys.executable).parent / "slipstream-archive"), "run", "--config",
               str(config)]
    if popen is not None:
        return popen(*command)
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def hold_populate_steps(monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event,
                                                                     threading.Event]:
    """Hold every ``LogBuffer.populate_step`` of this process until the second event is set
    (the test sets it, in a ``finally`` too); the first is set when a step is held."""
    from slipstream.client.logbuffer import LogBuffer

    stepping, go_on = threading.Event(), threading.Event()
    step = LogBuffer.populate_step

    def held_step(log: LogBuffer) -> bool:
        stepping.set()
        assert go_on.wait(30)
        return step(log)

    monkeypatch.setattr(LogBuffer, "populate_step", held_step)
    return stepping, go_on
