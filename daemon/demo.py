"""``slipstream demo`` (what ``make run`` starts): a driver with the default configuration and
two streams, each with a publisher and a subscriber in processes of their own: one over shared
memory (``aeron:ipc``) and one over UDP multicast on loopback (every datagram leaves the
driver's socket and comes back through the kernel; no root needed).  The UDP stream loses 1 %
of its datagrams on purpose (``debug_receive_data_loss``), so NAKs and retransmits show.  Every
second it prints each stream's rate and the network's counters, once every stream carries
messages (until then, how many do).

``--slow-consumer`` adds a third stream (IPC, 1 MiB terms) whose subscriber reads at full
speed for 2 s, then 1,000 messages a second for 2 s, and so on: its publisher offers at the
demo's rate under a back-pressure policy (``--policy``, default ``block``), and prints each
back-pressure episode as its ``on_back_pressure`` callback hears of it; the report lines add
the stream's episodes, the time spent in them and what the policy dropped (as ``slipstream
stat`` shows them).  Every report line gives the pressure governor's step and pressure
(daemon/pressure/governor.py)."""

from __future__ import annotations

import contextlib
import multiprocessing
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from slipstream.client import (
    BACK_PRESSURED,
    CLOSED,
    NOT_CONNECTED,
    Client,
    DriverNotRunningError,
    default_directory,
)
from slipstream.client.channel import parse_channel, parse_policy
from slipstream.client.counters import (
    BACK_PRESSURE_TYPES,
    CountersFile,
    CounterType,
    SystemCounter,
)
from slipstream.client.errors import (
    BackPressuredError,
    ChannelError,
    DriverError,
    InvalidArgumentError,
    SlipstreamError,
)
from slipstream.client.layout import FRAME_ALIGNMENT, HEADER_LENGTH, align, max_message_length
from slipstream.client.policy import BackPressureEpisode
from slipstream.daemon.config import DriverSettings
from slipstream.daemon.driver import MediaDriver

IPC_CHANNEL = "aeron:ipc"
UDP_CHANNEL = "aeron:udp?endpoint=224.0.1.1:40456|interface=127.0.0.1"
STREAM_ID = 1001
SLOW_CHANNEL = "aeron:ipc?term-length=1m"
SLOW_STREAM_ID = 1002
_PRESSURE_KINDS = dict(BACK_PRESSURE_TYPES)
#: Per million UDP datagrams the demo's driver drops on receipt, so recovery shows.
DEMO_LOSS = 10_000
#: The shortest message, bytes: each carries its 8-byte sequence number.
MIN_MESSAGE_SIZE = 8
#: How long the report waits, s, for the driver to end once a child did: a driver stopping
#: tells its clients first, so their ends come before its own (and before its drain, when
#: the children ended as its clients: that is waited for too).
_DRIVER_END_GRACE_S = 2.0
#: How long the demo waits for every stream to carry its first message, seconds: its
#: processes each import the client and connect, which takes seconds on a loaded host.
START_TIMEOUT_S = 60.0


def max_message_size(slow_consumer: bool = False) -> int:
    """The longest message, bytes, that every stream of the demo takes: term length / 8 of
    the shortest term among them (the demo's driver runs with the default settings; the slow
    stream has 1 MiB terms).  A longer one would make each publisher fail with
    MessageTooLongError."""
    defaults = DriverSettings()
    terms = [defaults.ipc_term_buffer_length, defaults.term_buffer_length]
    if slow_consumer:
        terms.append(parse_channel(SLOW_CHANNEL).term_length or defaults.ipc_term_buffer_length)
    return max_message_length(min(terms))


def check_message_size(size: int, slow_consumer: bool = False) -> None:
    """Raise :class:`InvalidArgumentError` (field ``size``) unless ``size`` (bytes) lies in
    :data:`MIN_MESSAGE_SIZE`..:func:`max_message_size`."""
    limit = max_message_size(slow_consumer)
    streams = "the slow stream takes" if slow_consumer else "the streams take"
    if isinstance(size, bool) or not isinstance(size, int) or not (
            MIN_MESSAGE_SIZE <= size <= limit):
        raise InvalidArgumentError("size", f"{size!r} is not a message size in "
                                           f"{MIN_MESSAGE_SIZE}..{limit:,} bytes (a "
                                           f"message carries an 8-byte sequence number; the "
                                           f"longest {streams} is term length / 8)")


def check_arguments(rate: int, size: int, duration: float, slow_consumer: bool) -> None:
    """Raise :class:`InvalidArgumentError` naming the first argument out of range: ``rate``
    (messages/s) >= 0, ``size`` (bytes) in :data:`MIN_MESSAGE_SIZE`..:func:`max_message_size`,
    ``duration`` (s) finite and >= 0."""
    if isinstance(rate, bool) or not isinstance(rate, int) or rate < 0:
        raise InvalidArgumentError("rate", f"{rate!r} is not a number of messages per second "
                                           f">= 0 (0: as fast as possible)")
    check_message_size(size, slow_consumer)
    if not 0 <= duration < float("inf"):
        raise InvalidArgumentError("duration", f"{duration!r} is not a number of seconds >= 0 "
                                               f"(0: until Ctrl-C)")


def _publisher(directory: str, channel: str, rate: int, size: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops us
    with Client.connect(directory) as client:
        publication = client.add_publication(channel, STREAM_ID)
        message = bytearray(size)
        sequence = 0
        start = time.monotonic()
        while True:
            if rate:
                # Pace in bursts: sleep until the schedule says the next message is due.
                due = start + sequence / rate
                delay = due - time.monotonic()
                if delay > 0.001:
                    time.sleep(delay)
            message[:8] = sequence.to_bytes(8, "little")
            result = publication.offer(bytes(message))
            if result > 0:
                sequence += 1
            elif result in (BACK_PRESSURED, NOT_CONNECTED):
                time.sleep(0.0001)
            elif result == CLOSED:  # the driver is gone: so is the demo
                return


def _slow_publisher(directory: str, policy: str, rate: int, size: int,
                    started_ns: int) -> None:
    """Offers ``rate`` messages a second (0: as fast as it can) under ``policy``, never
    catching up on what a wait cost it; prints each episode it is told of (times from
    ``started_ns``, the demo's start)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    def episode(event: BackPressureEpisode) -> None:
        at = (event.at_ns - started_ns) / 1e9
        if event.started:
            print(f"[{at:6.1f} s] slow stream: back-pressure episode {event.episodes} began "
                  f"(depth {event.depth:,} bytes of the window)", flush=True)
        else:
            print(f"[{at:6.1f} s] slow stream: episode {event.episodes} ended after "
                  f"{event.duration_ns / 1e9:.2f} s (depth {event.depth:,} bytes)", flush=True)

    with Client.connect(directory) as client:
        publication = client.add_publication(SLOW_CHANNEL, SLOW_STREAM_ID, policy=policy,
                                             on_back_pressure=episode)
        message = bytes(size)
        sent = 0
        schedule = time.monotonic()
        try:
            while True:
                if rate:
                    delay = schedule + sent / rate - time.monotonic()
                    if delay > 0.001:
                        time.sleep(delay)
                    elif delay < -0.1:  # a wait set it back: start the schedule again
                        schedule, sent = time.monotonic(), 0
                try:
                    result = publication.offer(message)
                except BackPressuredError:  # policy=error, or block's timeout
                    time.sleep(0.001)
                    continue
                if result == CLOSED:
                    return
                sent += 1
                if result < 0 and policy != "drop-newest":
                    time.sleep(0.0001)  # no policy, or rate-limit refusing
        except DriverNotRunningError:
            return


def _slow_subscriber(directory: str) -> None:
    """Reads at full speed for 2 s, then 1,000 messages a second for 2 s, and so on."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with Client.connect(directory) as client:
        subscription = client.add_subscription(SLOW_CHANNEL, SLOW_STREAM_ID)
        try:
            while True:
                if int(time.monotonic() / 2) % 2:
                    subscription.poll(lambda *_: None, 10)
                    time.sleep(0.01)
                else:
                    subscription.receive(lambda *_: None, 256, timeout=0.1)
        except DriverNotRunningError:
            return


def _subscriber(directory: str, channel: str) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    expected = [None]

    def handler(data: memoryview, header: object) -> None:
        sequence = int.from_bytes(data[:8], "little")
        if expected[0] is not None and sequence != expected[0]:
            print(f"subscriber on {channel}: expected message {expected[0]}, got {sequence}",
                  flush=True)
        expected[0] = sequence + 1

    with Client.connect(directory) as client:
        subscription = client.add_subscription(channel, STREAM_ID)
        try:
            while True:
                subscription.receive(handler, 256, timeout=1.0)
        except DriverNotRunningError:
            return  # the driver is gone: so is the demo


def run_demo(directory: str | None = None, rate: int = 100_000, size: int = 64,
             duration: float = 0.0, slow_consumer: bool = False,
             policy: str | None = None) -> int:
    """Run the demo until Ctrl-C (or ``duration`` s of streaming, counted once every stream
    carries messages); everything stops cleanly.
    ``slow_consumer``: the third stream (module doc), under ``policy`` (None: ``block``;
    refused without ``slow_consumer``).  Returns 0.

    Raises :class:`InvalidArgumentError` for an argument out of range
    (:func:`check_arguments`), before anything starts; :class:`DriverError` when the demo's
    driver ends on its own (it was killed or stopped), and :class:`SlipstreamError` when a
    publisher or subscriber process does (its traceback, if any, is above): the rest is
    stopped first."""
    check_arguments(rate, size, duration, slow_consumer)
    if policy is not None and not slow_consumer:
        raise InvalidArgumentError("policy", "is the policy of --slow-consumer's stream, which "
                                             "only --slow-consumer starts: give both")
    if slow_consumer:
        policy = policy or "block"
        try:
            parse_policy(policy)  # a bad policy fails here, before anything starts
        except ChannelError as e:
            raise InvalidArgumentError("policy", e.problem) from None
    path = Path(directory) if directory else default_directory()
    context = multiprocessing.get_context("spawn")
    print(f"slipstream demo: driver in {path}; {size} B messages at "
          f"{'full speed' if not rate else f'{rate:,}/s'} on {IPC_CHANNEL} and on "
          f"{UDP_CHANNEL} (1 % of its datagrams dropped on purpose); Ctrl-C stops", flush=True)
    # SIGTERM (systemctl stop, kill) stops the demo as cleanly as Ctrl-C: driver included.
    previous = signal.signal(signal.SIGTERM, _interrupt)
    if slow_consumer:
        print(f"slipstream demo: and a slow consumer on {SLOW_CHANNEL} stream {SLOW_STREAM_ID}, "
              f"its publisher under policy={policy}", flush=True)
    try:
        return _run(path, context, rate, size, duration, policy if slow_consumer else None)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _run(path: Path, context: Any, rate: int, size: int, duration: float,
         slow_policy: str | None) -> int:
    with MediaDriver.launch(directory=path, debug_receive_data_loss=DEMO_LOSS) as driver:
        started = time.monotonic()  # the report's times and the episodes' count from here
        subscribers = [context.Process(target=_subscriber, args=(str(path), channel),
                                       daemon=True) for channel in (IPC_CHANNEL, UDP_CHANNEL)]
        publishers = [context.Process(target=_publisher, args=(str(path), channel, rate, size),
                                      daemon=True) for channel in (IPC_CHANNEL, UDP_CHANNEL)]
        if slow_policy is not None:
            subscribers.append(context.Process(target=_slow_subscriber, args=(str(path),),
                                               daemon=True))
            publishers.append(context.Process(target=_slow_publisher,
                                              args=(str(path), slow_policy, rate, size,
                                                    int(started * 1e9)), daemon=True))
        for process in subscribers:
            process.start()
        time.sleep(0.5)
        for process in publishers:
            process.start()
        channels = (IPC_CHANNEL, UDP_CHANNEL, SLOW_CHANNEL)[:len(publishers)]
        children = {**{process: f"subscriber on {channel}" for process, channel
                       in zip(subscribers, channels, strict=True)},
                    **{process: f"publisher on {channel}" for process, channel
                       in zip(publishers, channels, strict=True)}}
        try:
            _report(driver, duration, size, started, slow=slow_policy is not None,
                    children=children)
        except KeyboardInterrupt:
            pass
        finally:
            for process in (*publishers, *subscribers):
                process.terminate()
                process.join(5)
        print("slipstream demo: stopped", flush=True)
    return 0


def _check_alive(driver: MediaDriver, children: dict[Any, str]) -> None:
    """Raise when the demo cannot go on: :class:`DriverError` when its driver ended,
    :class:`SlipstreamError` naming a publisher or subscriber process (multiprocessing
    ``Process``, by what it does) that ended.  A stopping driver tells its clients first, so a
    child's end is put down to the driver when the driver ends soon after: within 2 s, or
    within its drain timeout and 2 s when every child that ended returned (status 0), as
    they do when their driver closes them."""
    ended = [(what, process) for process, what in children.items()
             if process.exitcode is not None]
    if ended:
        # A child returns (status 0) only when its driver closed it: the driver is stopping,
        # and its drain may take up to its drain timeout before it ends.
        stopping = all(process.exitcode == 0 for _, process in ended)
        grace = _DRIVER_END_GRACE_S + (driver.drain_timeout_s if stopping else 0.0)
        with contextlib.suppress(subprocess.TimeoutExpired):
            driver.process.wait(grace)
    status = driver.process.poll()
    if status is not None:
        how = f"signal {-status}" if status < 0 else f"status {status}"
        raise DriverError(f"the demo's driver (pid {driver.pid}) in {driver.directory} ended "
                          f"with {how}, so the demo stopped: its log is above; start the "
                          f"demo again")
    if ended:
        what, process = ended[0]
        raise SlipstreamError(f"the demo's {what} (pid {process.pid}) ended with status "
                              f"{process.exitcode}, so the demo stopped: its traceback, if "
                              f"any, is above")


def _report(driver: MediaDriver, duration: float, size: int, started: float,
            slow: bool = False, children: dict[Any, str] | None = None) -> None:
    """Print the rates and counters every second for ``duration`` s (0: until interrupted),
    counted from when every stream has carried a message; until then a line a second says
    how many streams move.  Raises as :func:`_check_alive` once the driver or one of
    ``children`` ended, and :class:`SlipstreamError` when the streams have not all moved
    within :data:`START_TIMEOUT_S`."""
    counters = CountersFile(driver.directory / "counters.dat", writable=False)
    frame = align(HEADER_LENGTH + size, FRAME_ALIGNMENT)  # bytes of log per message
    start, last_time = started, time.monotonic()
    streaming_since: float | None = None  # when every stream had carried a message
    kinds = ("ipc", "udp", "slow") if slow else ("ipc", "udp")
    last: dict[tuple[int, int], tuple[str, float]] = {}  # the last sample's positions
    try:
        while (not duration or streaming_since is None
               or time.monotonic() - streaming_since < duration):
            time.sleep(1.0)
            # Its counters stay mapped after it is gone: without this the lines go on, zeros.
            _check_alive(driver, children or {})
            now = time.monotonic()
            # The subscribers' positions are exact, so the rates shown are what arrived.
            received = {"ipc": 0.0, "udp": 0.0, "slow": 0.0}
            # Each subscriber's messages, by its counter (id and registration: a freed id may
            # come back as another's): a rate counts those read in both samples (a stopping
            # driver frees a subscriber's counter between them).
            positions: dict[tuple[int, int], tuple[str, float]] = {}
            send_position = send_limit = 0
            pressure: dict[str, int] = {}
            for info in counters:
                kind = "udp" if "aeron:udp" in info.label else "ipc"
                if info.stream_id == SLOW_STREAM_ID:
                    kind = "slow"
                    if info.type_id in _PRESSURE_KINDS:
                        pressure[_PRESSURE_KINDS[info.type_id]] = info.value
                if info.type_id == CounterType.SUBSCRIBER_POSITION:
                    received[kind] += info.value / frame
                    positions[info.counter_id, info.registration_id] = (kind,
                                                                        info.value / frame)
                elif info.type_id == CounterType.SENDER_POSITION:
                    send_position = info.value
                elif info.type_id == CounterType.SENDER_LIMIT:
                    send_limit = info.value
            if streaming_since is None:
                moving = sum(1 for kind in kinds if received[kind] > 0)
                if moving < len(kinds):
                    if now - started > START_TIMEOUT_S:
                        raise SlipstreamError(
                            f"the demo's streams did not all start within "
                            f"{START_TIMEOUT_S:.0f} s ({moving} of {len(kinds)} carried a "
                            f"message): is the host overloaded?")
                    print(f"[{now - start:6.1f} s] starting: {moving} of {len(kinds)} streams "
                          f"carry messages (its processes are connecting)", flush=True)
                    last, last_time = positions, now
                    continue
                streaming_since = now
            elapsed = now - last_time
            rates = {"ipc": 0.0, "udp": 0.0, "slow": 0.0}
            for key, (kind, value) in positions.items():
                if key in last:
                    rates[kind] += (value - last[key][1]) / elapsed
            print(f"[{now - start:6.1f} s] ipc {received['ipc']:>12,.0f} msgs "
                  f"({rates['ipc']:>9,.0f}/s)   udp {received['udp']:>12,.0f} msgs "
                  f"({rates['udp']:>9,.0f}/s)"
                  f"   NAKs {counters.get(SystemCounter.NAK_MESSAGES_SENT):,}"
                  f"  retransmits {counters.get(SystemCounter.RETRANSMITS_SENT):,}"
                  f"  flow-control window {(send_limit - send_position) / 1024:,.0f} KiB"
                  f"  back-pressure {counters.get(SystemCounter.BACK_PRESSURE_EVENTS):,}"
                  f"  governor step {counters.get(SystemCounter.GOVERNOR_STEP)}"
                  f" (pressure {counters.get(SystemCounter.GOVERNOR_PRESSURE) / 1000:.2f})",
                  flush=True)
            if slow:
                print(f"         slow {received['slow']:>12,.0f} msgs ({rates['slow']:>9,.0f}/s)"
                      f"   episodes {pressure.get('bp-episodes', 0):,}"
                      f" ({pressure.get('bp-time', 0) / 1e9:.1f} s in them)"
                      f"  depth {pressure.get('bp-depth', 0):,} B"
                      f"  peak {pressure.get('bp-peak', 0):,} B"
                      f"  dropped {pressure.get('pub-drops', 0):,}", flush=True)
            last, last_time = positions, now
    finally:
        counters.close()
