"""Aeron 1.15.1's sample programs (Java), run against an ``AeronDriver`` (``driver.py``),
and what they print parsed: BasicPublisher, BasicSubscriber, StreamingPublisher, RateSubscriber,
Ping and Pong, and a holder of a connected publication.

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
- The samples that subscribe (BasicSubscriber, RateSubscriber, Pong) and StreamingPublisher and
  Ping busy-spin a CPU each.

Properties of the samples (names checked with ``javap -constants`` against the 1.15.1 jar)
-----------------------------------------------------------------------------------------
- samples: ``aeron.sample.channel``, ``.streamId``, ``.messages``, ``.messageLength``,
  ``.ping.channel``, ``.pong.channel``, ``.ping.streamId``, ``.pong.streamId``,
  ``.warmup.iterations``, ``.warmup.messages``, ``.exclusive.publications``; clients:
  ``aeron.driver.timeout`` (ms).
"""

from __future__ import annotations

import contextlib
import re
import signal
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .cnc import has_connected_publication
from .driver import AeronDriver
from .process import START_TIMEOUT_S, JavaProcess, Properties, PropertyValue

DEFAULT_STREAM_ID = 10


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

    def describe(self) -> str:
        """The process and its output, with how many messages were parsed and every image
        event (a stream cut short by an image that went shows there, not in the tail)."""
        events = "".join(f"\n  {'available' if e.available else 'unavailable'} session "
                         f"{e.session_id}" for e in self.images)
        return (f"{super().describe()}\n--- {len(self.messages)} messages parsed; image "
                f"events:{events or ' none'}")

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
        # The JVM's start is not the subscriber's: ``timeout`` is for the connection.
        holder.wait_until(lambda: "Waiting for new image from Pong..." in holder.lines,
                          max(timeout, START_TIMEOUT_S), "publication")
        deadline = time.monotonic() + timeout
        # Prefer the log buffer the holder created; an already existing publication of the
        # same channel and stream is shared, so then any connected one of that stream counts.
        while True:
            new = {p.name for p in (driver_dir / "publications").glob("*.logbuffer")} - before
            if has_connected_publication(driver_dir, stream_id, before if new else set()):
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
