"""IPC throughput between two processes: slipstream (per-message and batch API) vs pyzmq
PUB/SUB over ipc://, measured in the same run.  Prints messages/s and the ratios.

    .venv/bin/python -m bench.ipc_throughput [--messages N] [--sizes 32,1024] [--repeat R]

Each figure is the subscriber's receive rate: messages received divided by the time from the
first to the last, with publisher and subscriber in separate processes.  Both applications
idle by yielding the CPU (``sched_yield``) when they have nothing to do (back-pressured,
nothing to poll), as Aeron's YieldingIdleStrategy: on two cores a spinning application takes
the core its driver needs.  The best of R runs is
reported for every contender, so background noise penalises none of them in particular.  A
slipstream run counts only if the stream arrived whole: every message, and the subscriber's
final position equal to the publisher's.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import platform
import sys
import tempfile
import time
from array import array
from collections.abc import Callable
from pathlib import Path
from typing import Any

from slipstream.client.errors import ConfigurationError
from slipstream.client.layout import TERM_MAX_LENGTH, max_message_length
from slipstream.daemon.cli import int_at_least
from slipstream.daemon.config import DriverSettings, check_setting

BATCH = 256  # messages per offer_batch call


def back_pressured(idle: int, backoff_s: float | None) -> None:
    """The publisher's idle strategy after ``idle`` offers in a row found no room: yield the
    core (the driver may need it); with ``backoff_s``, from the 16th such offer on sleep that
    long instead, as Aeron's BackoffIdleStrategy parks (a spinning publisher on a two-core
    machine takes the core from the sender thread it waits for)."""
    if backoff_s is None or idle < 16:
        os.sched_yield()
    else:
        time.sleep(backoff_s)


def pin(cpu: int) -> None:
    """Publisher on one core, subscriber on the other (every contender alike)."""
    if hasattr(os, "sched_setaffinity") and (os.cpu_count() or 1) > 1:
        os.sched_setaffinity(0, {cpu % (os.cpu_count() or 1)})


def offer_count(publication: Any, message: bytes, count: int, batch: bool,
                backoff_s: float | None = None, *, busy: bool = False) -> None:
    """Offers ``count`` copies of ``message`` on ``publication``: an ``offer`` each, or with
    ``batch`` an ``offer_batch`` of BATCH at a time (the last one: exactly ``count`` in all).
    A refused offer is tried again at once with ``busy`` (the loop a first program writes:
    ``while sent < count: if offer(m) > 0: sent += 1``), else after :func:`back_pressured`
    (``backoff_s``)."""
    sent = 0
    if batch:
        size = len(message)
        data, lengths = message * BATCH, array("i", [size] * BATCH)
        idle = 0
        while sent < count:
            if count - sent < BATCH:
                data, lengths = data[:(count - sent) * size], lengths[:count - sent]
            n = publication.offer_batch(data, lengths)
            if n > 0:
                sent += n
                idle = 0
            elif not busy:
                idle += 1
                back_pressured(idle, backoff_s)
        return
    offer = publication.offer
    if busy:
        while sent < count:
            if offer(message) > 0:
                sent += 1
        return
    idle = 0
    while sent < count:
        if offer(message) > 0:
            sent += 1
            idle = 0
        else:
            idle += 1
            back_pressured(idle, backoff_s)


def first_image(subscription: Any, ready: Any) -> Any:
    """Sets ``ready`` (the publisher creates the stream once the subscription exists) and
    returns ``subscription``'s first image once the stream arrives: the caller keeps it, since
    the driver may retire an image once it is drained."""
    ready.set()
    while not subscription.images:
        time.sleep(0.0001)
    return subscription.images[0]


# -- slipstream ------------------------------------------------------------------------------
def _ss_publisher(directory: str, channel: str, stream_id: int, size: int, count: int,
                  batch: bool, start, positions, backoff_s: float | None = None) -> None:
    from slipstream.client import Client

    pin(0)
    # The loop idles itself (back_pressured, sched_yield): the client's strategy stays off.
    with Client.connect(directory, spins_before_yield=None) as client:
        publication = client.add_publication(channel, stream_id)
        while not publication.is_connected:
            time.sleep(0.001)
        start.wait()
        offer_count(publication, bytes(size), count, batch, backoff_s)
        positions[0] = publication.position


def _ss_subscriber(directory: str, channel: str, stream_id: int, count: int, batch: bool,
                   ready, result, positions) -> None:
    from slipstream.client import Client

    pin(1)
    # The loop idles itself (back_pressured, sched_yield): the client's strategy stays off.
    with Client.connect(directory, spins_before_yield=None) as client:
        subscription = client.add_subscription(channel, stream_id)
        image = first_image(subscription, ready)
        received = 0
        first = 0.0
        if batch:
            poll_batch = subscription.poll_batch
            while received < count:
                got = poll_batch(4096)
                if got is not None:
                    if not first:
                        first = time.perf_counter()
                    received += len(got)
                else:
                    os.sched_yield()  # the idle strategy: the driver may need this core
        else:
            counter = [0]

            def handler(data: memoryview, header: object) -> None:
                counter[0] += 1

            poll = subscription.poll
            while counter[0] < count:
                if poll(handler, 4096):
                    if not first:
                        first = time.perf_counter()
                else:
                    os.sched_yield()  # the idle strategy: the driver may need this core
            received = counter[0]
        result.value = received / (time.perf_counter() - first)
        positions[1] = image.position
        positions[2] = received


def run_slipstream(directory: Path, size: int, count: int, batch: bool, stream_id: int, *,
                   channel: str = "aeron:ipc", subscriber_directory: Path | None = None,
                   backoff_s: float | None = None, first_program: bool = False) -> float:
    """One run; the subscriber's client uses ``subscriber_directory`` (another driver, for a
    network channel) when given; ``backoff_s``: the publisher's idle strategy
    (:func:`back_pressured`); ``first_program``: the loops a first program writes instead
    (:func:`_first_program_publisher`)."""
    context = multiprocessing.get_context("spawn")
    ready, start, result = context.Event(), context.Event(), context.Value("d", 0.0)
    positions = context.Array("q", 3)  # publisher's end, subscriber's end, messages received
    subscriber_args = (str(subscriber_directory or directory), channel, stream_id, count, batch,
                       ready, result, positions)
    publisher_args = (str(directory), channel, stream_id, size, count, batch, start, positions)
    if first_program:
        subscriber = context.Process(target=_first_program_subscriber, args=subscriber_args)
        publisher = context.Process(target=_first_program_publisher, args=publisher_args)
    else:
        subscriber = context.Process(target=_ss_subscriber, args=subscriber_args)
        publisher = context.Process(target=_ss_publisher, args=(*publisher_args, backoff_s))
    subscriber.start()
    assert ready.wait(60), "subscriber did not start"
    publisher.start()
    time.sleep(0.2)
    start.set()
    rate = _finish(publisher, subscriber, result)
    published_to, received_to, received = positions[:]
    if rate and (received != count or received_to != published_to):
        # A rate only counts when the stream arrived whole: same count, same end position.
        print(f"# stream corrupted: {received} of {count} messages received, subscriber at "
              f"{received_to}, publisher at {published_to}", flush=True)
        return 0.0
    return rate


RUN_TIMEOUT_S = 120.0


# -- the loops a first program writes ----------------------------------------------------------
def _first_program_publisher(directory: str, channel: str, stream_id: int, size: int,
                             count: int, batch: bool, start, positions) -> None:
    """``while sent < count: if offer(m) > 0: sent += 1``: the client's defaults, no pinning
    and no idle strategy of its own (the loop of docs/PERFORMANCE.md's first-program rows)."""
    from slipstream.client import Client

    with Client.connect(directory) as client:
        publication = client.add_publication(channel, stream_id)
        while not publication.is_connected:
            time.sleep(0.001)
        start.wait()
        offer_count(publication, bytes(size), count, batch, busy=True)
        positions[0] = publication.position


def _first_program_subscriber(directory: str, channel: str, stream_id: int, count: int,
                              batch: bool, ready, result, positions) -> None:
    """``while received < count: sub.poll(handler, 1000)`` (or ``poll_batch``), nothing else."""
    from slipstream.client import Client

    with Client.connect(directory) as client:
        subscription = client.add_subscription(channel, stream_id)
        image = first_image(subscription, ready)
        counter = [0]
        first = 0.0
        if batch:
            while counter[0] < count:
                got = subscription.poll_batch(4096)
                if got is not None:
                    if not first:
                        first = time.perf_counter()
                    counter[0] += len(got)
        else:
            def handler(data: memoryview, header: object) -> None:
                counter[0] += 1

            while counter[0] < count:
                if subscription.poll(handler, 1000) and not first:
                    first = time.perf_counter()
        result.value = counter[0] / (time.perf_counter() - first)
        positions[1] = image.position
        positions[2] = counter[0]


def join_run(publisher, subscriber, timeout_s: float = RUN_TIMEOUT_S) -> bool:
    """Join both sides within ``timeout_s``; whether both finished and exited 0.  A run that
    does not finish has its processes stopped and is reported, so a benchmark never hangs."""
    deadline = time.monotonic() + timeout_s
    for process in (publisher, subscriber):
        process.join(max(0.0, deadline - time.monotonic()))
    stuck = [p for p in (publisher, subscriber) if p.is_alive()]
    for process in stuck:
        process.terminate()
        process.join(5)
    if stuck or publisher.exitcode or subscriber.exitcode:
        print(f"# run did not finish: publisher exit {publisher.exitcode}, subscriber exit "
              f"{subscriber.exitcode}", flush=True)
        return False
    return True


def _finish(publisher, subscriber, result) -> float:
    """The run's result once both sides finished (:func:`join_run`), else 0."""
    return result.value if join_run(publisher, subscriber) else 0.0


# -- pyzmq -----------------------------------------------------------------------------------
def _zmq_publisher(endpoint: str, size: int, count: int, start) -> None:
    import zmq

    pin(0)
    context = zmq.Context()
    socket = context.socket(zmq.PUB)
    socket.setsockopt(zmq.SNDHWM, 0)  # never drop: the fair comparison to a reliable stream
    socket.bind(endpoint)
    start.wait()
    message = bytes(size)
    send = socket.send
    for _ in range(count):
        send(message)
    time.sleep(1.0)
    socket.close(linger=-1)
    context.term()


def _zmq_subscriber(endpoint: str, count: int, ready, result) -> None:
    import zmq

    pin(1)
    context = zmq.Context()
    socket = context.socket(zmq.SUB)
    socket.setsockopt(zmq.RCVHWM, 0)
    socket.setsockopt(zmq.SUBSCRIBE, b"")
    socket.connect(endpoint)
    time.sleep(0.3)  # PUB/SUB joins are asynchronous
    ready.set()
    recv = socket.recv
    recv()
    first = time.perf_counter()
    for _ in range(count - 1):
        recv()
    result.value = (count - 1) / (time.perf_counter() - first)
    socket.close(0)
    context.term()


def run_zmq(directory: Path, size: int, count: int, endpoint: str | None = None) -> float:
    """pyzmq PUB/SUB over ``endpoint`` (default ipc:// in ``directory``)."""
    endpoint = endpoint or f"ipc://{directory}/bench-{size}.sock"
    context = multiprocessing.get_context("spawn")
    ready, start, result = context.Event(), context.Event(), context.Value("d", 0.0)
    publisher = context.Process(target=_zmq_publisher, args=(endpoint, size, count, start))
    publisher.start()
    time.sleep(0.2)
    subscriber = context.Process(target=_zmq_subscriber, args=(endpoint, count, ready, result))
    subscriber.start()
    assert ready.wait(60)
    start.set()
    return _finish(publisher, subscriber, result)


def scratch_directory() -> tempfile.TemporaryDirectory[str]:
    """A benchmark's directory in /dev/shm for its drivers and sockets, removed with all in it
    by ``cleanup()`` or at exit, also when a run fails or is ended by SIGTERM (``timeout``,
    ``kill``): nothing is left in /dev/shm."""
    from slipstream.sim.signals import exit_on_sigterm  # not in the spawned children

    exit_on_sigterm()
    return tempfile.TemporaryDirectory(prefix="slipstream-bench-", dir="/dev/shm",
                                       ignore_cleanup_errors=True)


#: An argparse type: an integer of at least 1 (a count, a rate, a size).
positive_int = int_at_least(1)


def positive_float(text: str) -> float:
    """An argparse type: a finite number above 0 (a duration in seconds)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text} is not above 0")
    return value


def driver_setting(text: str) -> tuple[str, str]:
    """An argparse type for ``--set KEY=VALUE``: a driver setting and a value it takes,
    checked here rather than when a driver starts, mid-run."""
    key, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE")
    try:
        check_setting(key, value)
    except ConfigurationError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return key, value


def sizes_up_to(term_length: int, what: str) -> Callable[[str], list[int]]:
    """An argparse type: comma-separated message sizes, each 1 byte to the largest message of
    a log of ``term_length`` (``what``: which log, for the error)."""
    largest = max_message_length(term_length)

    def size_list(text: str) -> list[int]:
        sizes = [positive_int(part) for part in text.split(",")]
        for size in sizes:
            if size > largest:
                raise argparse.ArgumentTypeError(
                    f"{size} is over {largest} bytes, the largest message of {what}")
        return sizes

    return size_list


def bench_parser(doc: str, **options: tuple[float | str, str]) -> argparse.ArgumentParser:
    """A benchmark's command line: ``doc`` (its module's docstring, with the command it
    documents) is the help's description, kept as written; ``options`` the run options it
    takes of :data:`RUN_OPTIONS`, each ``name=(default, help)``, in that order."""
    parser = argparse.ArgumentParser(description=doc,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, (default, text) in options.items():
        if name not in RUN_OPTIONS:
            raise TypeError(f"bench_parser: {name!r} is not one of {', '.join(RUN_OPTIONS)}")
        parser.add_argument(f"--{name}", type=RUN_OPTIONS[name], default=default, help=text)
    return parser


#: The options of a run that benchmarks share, each with its argparse type: counts (messages,
#: bytes, rounds), a message size in bytes, message sizes (each fits some log), a rate per
#: second, a duration in seconds.
RUN_OPTIONS: dict[str, Callable[[str], object]] = {
    "messages": positive_int, "bytes": positive_int, "size": positive_int,
    "sizes": sizes_up_to(TERM_MAX_LENGTH, "any log"), "rate": positive_int,
    "seconds": positive_float, "repeat": positive_int}


def add_driver_settings(parser: argparse.ArgumentParser,
                        help: str = "a slipstream driver setting (repeatable)") -> None:
    """``--set KEY=VALUE``, repeatable: ``args.settings``, a list of (key, value) pairs each
    checked by :func:`driver_setting`."""
    parser.add_argument("--set", dest="settings", action="append", default=[],
                        type=driver_setting, metavar="KEY=VALUE", help=help)


def print_header(title: str, module: str, settings: dict[str, str] | None = None,
                 note: str = "") -> None:
    """A benchmark's first lines: what it measures (``title``) on which machine, the command
    (``python -m module`` with this run's arguments) that runs it again and, given
    ``settings``, the drivers' settings (and ``note``, how the run goes)."""
    print(f"# {title}, {machine()}")
    print(f"# command: python -m {module} {' '.join(sys.argv[1:])}")
    if settings is not None:
        print(f"# slipstream settings: {settings}" + (f"; {note}" if note else ""), flush=True)


def machine() -> str:
    cpu = "unknown cpu"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (f"{os.cpu_count()} vCPU {cpu}, Linux {platform.release()}, "
            f"Python {platform.python_version()}")


def main() -> int:
    parser = bench_parser(__doc__,
                          messages=(10_000_000, "messages per run for 32 B, at least 8 (1 KiB "
                                    "runs use a quarter); the default passes through a 64 "
                                    "MiB-term log three times or more, so cleaning and "
                                    "partition reuse are part of every figure"),
                          repeat=(3, "runs per contender; best kept"))
    parser.add_argument("--sizes", default="32,1024",
                        type=sizes_up_to(DriverSettings().ipc_term_buffer_length,
                                         "a default IPC log"),
                        help="message sizes in bytes")
    args = parser.parse_args()
    if args.messages < 8:  # a rate needs a first and a last message, in a quarter of them
        parser.error(f"--messages: {args.messages} is under 8 (sizes over 64 B send a "
                     f"quarter, and a rate needs two messages)")

    from slipstream.daemon.driver import MediaDriver

    print_header("IPC throughput", "bench.ipc_throughput")
    scratch = scratch_directory()
    directory = Path(scratch.name)
    with MediaDriver.launch(directory=directory / "driver") as driver:
        stream_id = 1000
        for size in args.sizes:
            count = args.messages if size <= 64 else args.messages // 4
            best = {"zmq": 0.0, "offer/poll": 0.0, "batch": 0.0}
            for _ in range(args.repeat):
                best["zmq"] = max(best["zmq"], run_zmq(directory, size, count))
                stream_id += 1
                best["offer/poll"] = max(best["offer/poll"], run_slipstream(
                    driver.directory, size, count, False, stream_id))
                stream_id += 1
                best["batch"] = max(best["batch"], run_slipstream(
                    driver.directory, size, count, True, stream_id))
            print(f"{size:>6} B  pyzmq PUB/SUB {best['zmq'] / 1e6:7.2f} M msg/s   "
                  f"slipstream offer/poll {best['offer/poll'] / 1e6:7.2f} M msg/s "
                  f"({best['offer/poll'] / best['zmq']:5.1f}x)   "
                  f"batch {best['batch'] / 1e6:7.2f} M msg/s ({best['batch'] / best['zmq']:5.1f}x)",
                  flush=True)
    scratch.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
