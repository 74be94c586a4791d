"""The per-message offer of an exclusive publication against a shared publication's (IPC,
32 B by default), measured in the same run; prints each rate and their ratio.

    .venv/bin/python -m bench.exclusive_offer [--messages N] [--size 32] [--repeat R]

An exclusive publication (``Client.add_exclusive_publication``) claims with a release store of
the term's tail where a shared one takes an atomic add (``claim`` in client/native_appender.c);
the rest of an offer is the same code.  Each figure is the publisher's rate, offers taken per
second of the publisher's own loop (its ns per offer beside it), with ``offer(message)`` called
from Python, once per message:

* **burst**: one process, the subscriber idle while the publisher offers 25.6 MB, what the
  window holds (the driver's term window is half a 64 MiB term), in ``for _ in range(n):
  offer(m)``, then drained untimed: the offer alone, nobody else touching the log's cache
  lines; the best of 3 bursts per run.
* **stream, tight loop**: publisher and subscriber in two processes pinned to a core each, the
  publisher's loop retrying at once and yielding the CPU when refused (``sched_yield``, the
  client's own strategy off), ``--messages`` through the log, so its terms rotate and are
  cleaned; the subscriber drains with ``poll_batch`` so that it never holds the publisher
  back: the offer is what is measured, not the read.
* **stream, first program**: the same with the loop a first program writes and the client's
  defaults (``while sent < count: if offer(m) > 0: sent += 1``, nothing pinned).
* **interpreter floor**: the burst's loop around ``id(m)``, a C builtin of one argument that
  touches no memory and returns a fresh int as an offer returns its position: what any offer
  called once per message from Python costs before it does anything.  ``shared / floor`` is
  the most an exclusive offer could gain on the shared one's if its own work cost nothing.
* **C loop**: ``ss_offer`` itself in a loop of C calls (bench/exclusive_offer.c, built with
  the system's C compiler and the client's C files an offer runs), 64 MiB terms, no reader:
  what the store saves with no interpreter in the way.  Skipped without a compiler.

Shared and exclusive runs alternate, ``--repeat`` times each; the best rate of each kind is
reported (background load penalises neither in particular), and the median beside it.  A
stream counts only if it arrived whole: every message, the subscriber's end position equal to
the publisher's.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.ipc_throughput import (
    bench_parser,
    first_image,
    join_run,
    offer_count,
    pin,
    print_header,
    scratch_directory,
)

CHANNEL = "aeron:ipc"
SOURCE = Path(__file__).with_name("exclusive_offer.c")
CLIENT = Path(__file__).resolve().parent.parent / "client"
#: Messages of one burst: 400k of 32 B take 25.6 MB of a default IPC log's 32 MiB window.
BURST_WINDOW_BYTES = 25_600_000
RUN_TIMEOUT_S = 180.0


def _add(client, stream_id: int, exclusive: bool):  # -> Publication
    if exclusive:
        return client.add_exclusive_publication(CHANNEL, stream_id)
    return client.add_publication(CHANNEL, stream_id)


def burst(directory: Path, size: int, exclusive: bool, stream_id: int, rounds: int) -> float:
    """Offers/s of the best of ``rounds`` bursts into an idle subscriber's window (this
    process, pinned to core 0)."""
    cores = os.sched_getaffinity(0)
    pin(0)
    try:
        return _bursts(directory, size, exclusive, stream_id, rounds)
    finally:
        os.sched_setaffinity(0, cores)  # the stream runs' processes inherit it


def _bursts(directory: Path, size: int, exclusive: bool, stream_id: int, rounds: int) -> float:
    from slipstream.client import Client

    aligned = ((size + 32 + 31) // 32) * 32
    count = BURST_WINDOW_BYTES // aligned
    best = 0.0
    with Client.connect(directory, spins_before_yield=None) as client:
        subscription = client.add_subscription(CHANNEL, stream_id)
        publication = _add(client, stream_id, exclusive)
        while not (subscription.images and publication.is_connected):
            time.sleep(0.001)
        offer = publication.offer
        message = bytes(size)
        for _ in range(rounds):
            while publication.publication_limit - publication.position < count * aligned:
                subscription.poll_batch(65536)  # the window back, untimed
                time.sleep(0.001)
            before = publication.position
            started = time.perf_counter()
            for _ in range(count):
                offer(message)
            elapsed = time.perf_counter() - started
            # Counted from the positions, not in the loop: the offers taken (the one that met
            # the end of a term, ADMIN_ACTION, was not; its padding is under one message).
            taken = (publication.position - before) // aligned
            best = max(best, taken / elapsed)
            while subscription.poll_batch(65536) is not None:
                pass
        publication.close()
        subscription.close()
    return best


def interpreter_floor(size: int, rounds: int) -> float:
    """Calls/s of the burst's loop around ``id(message)`` (pinned to core 0), the best of
    ``rounds``: the interpreter's share of an offer, with no offer in it."""
    aligned = ((size + 32 + 31) // 32) * 32
    count = BURST_WINDOW_BYTES // aligned
    message = bytes(size)
    call = id  # a fresh int per call, as offer() returns a position (an int past 2**30)
    cores = os.sched_getaffinity(0)
    pin(0)
    try:
        best = 0.0
        for _ in range(rounds):
            started = time.perf_counter()
            for _ in range(count):
                call(message)
            best = max(best, count / (time.perf_counter() - started))
        return best
    finally:
        os.sched_setaffinity(0, cores)


def _publisher(directory: str, stream_id: int, size: int, count: int, exclusive: bool,
               first_program: bool, start, rate, positions) -> None:
    """Offers ``count`` messages; stores its offers/s in ``rate`` and its end position."""
    from slipstream.client import Client

    if not first_program:
        pin(0)
    # The tight loop idles itself (back_pressured); the first program keeps the defaults.
    spins = {} if first_program else {"spins_before_yield": None}
    with Client.connect(directory, **spins) as client:
        publication = _add(client, stream_id, exclusive)
        while not publication.is_connected:
            time.sleep(0.001)
        start.wait()
        message = bytes(size)
        started = time.perf_counter()
        offer_count(publication, message, count, False, busy=first_program)
        rate.value = count / (time.perf_counter() - started)
        positions[0] = publication.position


def _subscriber(directory: str, stream_id: int, count: int, first_program: bool, ready,
                positions) -> None:
    """Drains the stream with ``poll_batch`` (fast enough never to hold the publisher)."""
    from slipstream.client import Client

    if not first_program:
        pin(1)
    with Client.connect(directory) as client:
        subscription = client.add_subscription(CHANNEL, stream_id)
        image = first_image(subscription, ready)
        received = 0
        poll_batch = subscription.poll_batch
        while received < count:
            got = poll_batch(65536)
            if got is not None:
                received += len(got)
        positions[1] = image.position
        positions[2] = received


def stream(directory: Path, size: int, count: int, exclusive: bool, first_program: bool,
           stream_id: int) -> float:
    """One stream of ``count`` messages between two processes: the publisher's offers/s, or
    0.0 when the run failed or the stream did not arrive whole."""
    context = multiprocessing.get_context("spawn")
    ready, start, rate = context.Event(), context.Event(), context.Value("d", 0.0)
    positions = context.Array("q", 3)  # publisher's end, subscriber's end, messages received
    subscriber = context.Process(target=_subscriber, args=(
        str(directory), stream_id, count, first_program, ready, positions))
    subscriber.start()
    assert ready.wait(60), "subscriber did not start"
    publisher = context.Process(target=_publisher, args=(
        str(directory), stream_id, size, count, exclusive, first_program, start, rate,
        positions))
    publisher.start()
    time.sleep(0.2)
    start.set()
    if not join_run(publisher, subscriber, RUN_TIMEOUT_S):
        return 0.0
    published_to, received_to, received = positions[:]
    if received != count or received_to != published_to:
        print(f"# stream corrupted: {received} of {count} messages received, subscriber at "
              f"{received_to}, publisher at {published_to}", flush=True)
        return 0.0
    return rate.value


def c_loop(size: int, repeat: int) -> tuple[float, float] | None:
    """(shared, exclusive) ns per ``ss_offer`` in a C loop (bench/exclusive_offer.c, pinned
    to core 0), the best of ``repeat`` rounds each; None without a C compiler."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None
    with tempfile.TemporaryDirectory(prefix="slipstream-bench-") as directory:
        binary = Path(directory) / "exclusive_offer"
        subprocess.run([compiler, "-O2", "-std=gnu11", f"-I{CLIENT}", "-o", str(binary),
                        str(SOURCE), "-lpthread"], check=True)
        out = subprocess.run([str(binary), "26", str(size), "5000000", str(repeat)],
                             check=True, capture_output=True, text=True,
                             preexec_fn=lambda: pin(0)).stdout
    shared, exclusive = (float(field) for field in out.split())
    return shared, exclusive


def _line(name: str, rates: dict[bool, list[float]]) -> str:
    shared, exclusive = max(rates[False]), max(rates[True])
    if not shared or not exclusive:
        return f"{name:<28} a run failed: shared {rates[False]}, exclusive {rates[True]}"
    median_shared, median_exclusive = (statistics.median(rates[False]),
                                       statistics.median(rates[True]))
    return (f"{name:<28} shared {shared / 1e6:6.2f} M offers/s ({1e9 / shared:5.0f} ns)   "
            f"exclusive {exclusive / 1e6:6.2f} M offers/s ({1e9 / exclusive:5.0f} ns)   "
            f"ratio {exclusive / shared:4.2f}x (medians {median_exclusive / median_shared:4.2f}x)")


def main() -> int:
    parser = bench_parser(__doc__,
                          messages=(5_000_000, "messages per stream run (the default passes "
                                               "through a default 192 MiB IPC log more than "
                                               "once at 32 B)"),
                          size=(32, "message size in bytes, at most the MTU's payload (1376)"),
                          repeat=(5, "runs of each kind, alternating; the best is kept"))
    args = parser.parse_args()
    if args.size > 1376:
        parser.error(f"--size: {args.size} is over 1376, a default MTU's payload: the offer "
                     f"would be fragmented")

    from slipstream.daemon.driver import MediaDriver

    print_header(f"exclusive vs shared offer, IPC, {args.size} B", "bench.exclusive_offer")
    scratch = scratch_directory()
    directory = Path(scratch.name)
    with MediaDriver.launch(directory=directory / "driver") as driver:
        stream_id = 3000
        rates: dict[str, dict[bool, list[float]]] = {
            name: {False: [], True: []}
            for name in ("burst", "stream, tight loop", "stream, first program")}
        floors: list[float] = []
        for _ in range(args.repeat):
            for exclusive in (False, True):
                stream_id += 1
                rates["burst"][exclusive].append(
                    burst(driver.directory, args.size, exclusive, stream_id, rounds=3))
            floors.append(interpreter_floor(args.size, rounds=3))
        for name, first_program in (("stream, tight loop", False),
                                    ("stream, first program", True)):
            for _ in range(args.repeat):
                for exclusive in (False, True):
                    stream_id += 1
                    rates[name][exclusive].append(stream(
                        driver.directory, args.size, args.messages, exclusive, first_program,
                        stream_id))
        for name, kinds in rates.items():
            print(_line(name, kinds), flush=True)
        floor, shared = max(floors), max(rates["burst"][False])
        if shared:
            print(f"{'interpreter floor':<28} {floor / 1e6:6.2f} M calls/s "
                  f"({1e9 / floor:5.0f} ns; median {1e9 / statistics.median(floors):5.0f} ns)"
                  f"   an offer of no cost at most {floor / shared:4.2f}x the shared burst",
                  flush=True)
    costs = c_loop(args.size, 2 * args.repeat)
    if costs is None:
        print("C loop                       skipped: no C compiler (cc, gcc or $CC)")
    else:
        shared, exclusive = costs
        print(f"{'C loop':<28} shared {1e3 / shared:6.2f} M offers/s ({shared:5.1f} ns)   "
              f"exclusive {1e3 / exclusive:6.2f} M offers/s ({exclusive:5.1f} ns)   "
              f"ratio {shared / exclusive:4.2f}x", flush=True)
    scratch.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
