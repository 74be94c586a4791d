"""Where an encrypted stream's time goes (docs/PROTOCOL.md §7.8): the CPU every thread of a
1 KiB UDP stream between two drivers on loopback takes per message, plain and encrypted in
alternating pairs of runs, with the first program's loops (``offer`` / ``poll``, the client's
idle strategy).  Per run: the rate, then ns per message of the sending and the receiving
driver's network thread (``ss-network``: the seals, the opens), each driver's other threads
(its conductor: ``snd driver``, ``rcv driver``), the publisher's and the subscriber's loops
(their CPU from the first offer and the first poll to their last), and the sum.  At the end,
the medians and what encryption adds to each.  On two cores the stream keeps both busy, so
its rate follows the sum: the ratio of the sums is the ratio of the rates, and the
differences say which thread costs what.

    .venv/bin/python -m bench.encrypted_cpu [--messages N] [--pairs P] [--idle yield|sleep]
        [--set KEY=VALUE ...]

``--idle sleep``: the clients sleep ``SLEEP_S`` instead of yielding once 16 calls in a row
did nothing (the client's own idle strategy off), to see what their idling costs the stream.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from bench.ipc_throughput import (
    driver_setting,
    join_run,
    machine,
    positive_int,
    scratch_directory,
)
from bench.spy_cost import cpu_ns, network_task
from bench.udp_throughput import DEFAULT_SETTINGS, free_port

if TYPE_CHECKING:
    from slipstream.daemon.driver import MediaDriver

SIZE = 1024
SPINS = 16  # calls that did nothing before idling, as the client's DEFAULT_SPINS_BEFORE_YIELD
SLEEP_S = 20e-6  # --idle sleep: the clients' sleep once idle (about 70 µs with timer slack)
#: The columns of a run's line and of the medians, in ns per message.
COLUMNS = ("snd network", "rcv network", "snd driver", "rcv driver", "publisher", "subscriber",
           "sum")


def _publisher(directory: str, channel: str, stream_id: int, count: int, idle: str, start,
               out) -> None:
    from slipstream.client import Client

    with Client.connect(directory, spins_before_yield=None if idle == "sleep" else SPINS
                        ) as client:
        publication = client.add_publication(channel, stream_id)
        while not publication.is_connected:
            time.sleep(0.001)
        start.wait()
        message, offer, sent, misses = bytes(SIZE), publication.offer, 0, 0
        began = time.process_time()
        if idle == "sleep":
            while sent < count:
                if offer(message) > 0:
                    sent, misses = sent + 1, 0
                else:
                    misses += 1
                    if misses > SPINS:
                        time.sleep(SLEEP_S)
        else:
            while sent < count:
                if offer(message) > 0:
                    sent += 1
        out[0] = time.process_time() - began
        out[2] = publication.position


def _subscriber(directory: str, channel: str, stream_id: int, count: int, idle: str, ready,
                out) -> None:
    from slipstream.client import Client

    with Client.connect(directory, spins_before_yield=None if idle == "sleep" else SPINS
                        ) as client:
        subscription = client.add_subscription(channel, stream_id)
        ready.set()
        while not subscription.images:
            time.sleep(0.0001)
        received = [0]

        def handler(data: memoryview, header: object) -> None:
            received[0] += 1

        poll, misses, first, began = subscription.poll, 0, 0.0, 0.0
        while received[0] < count:
            if poll(handler, 1000):
                misses = 0
                if not first:
                    first, began = time.perf_counter(), time.process_time()
            elif idle == "sleep":
                misses += 1
                if misses > SPINS:
                    time.sleep(SLEEP_S)
        out[1] = time.process_time() - began
        out[3] = subscription.images[0].position
        out[4] = received[0] / (time.perf_counter() - first)


def _process_ns(pid: int) -> float:
    """CPU ns (user + system) process ``pid`` has used so far, all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * 1e9 / os.sysconf("SC_CLK_TCK")


def run(a: MediaDriver, b: MediaDriver, count: int, stream_id: int, channel: str,
        idle: str) -> tuple[float, list[float]] | None:
    """One run: (messages/s, ns per message of each of COLUMNS), None when it did not
    arrive whole."""
    context = multiprocessing.get_context("spawn")
    ready, start, out = context.Event(), context.Event(), context.Array("d", 5)
    subscriber = context.Process(target=_subscriber, args=(
        str(b.directory), channel, stream_id, count, idle, ready, out))
    publisher = context.Process(target=_publisher, args=(
        str(a.directory), channel, stream_id, count, idle, start, out))
    tasks = (network_task(a), network_task(b))
    subscriber.start()
    assert ready.wait(60), "subscriber did not start"
    publisher.start()
    time.sleep(0.2)
    before = [cpu_ns(t) for t in tasks] + [_process_ns(a.pid), _process_ns(b.pid)]
    start.set()
    whole = join_run(publisher, subscriber)
    after = [cpu_ns(t) for t in tasks] + [_process_ns(a.pid), _process_ns(b.pid)]
    if not whole or out[2] != out[3] or out[2] <= 0:
        print(f"# run not whole: publisher at {out[2]:.0f}, subscriber at {out[3]:.0f}",
              flush=True)
        return None
    sender, receiver, driver_a, driver_b = ((x - y) / count
                                            for x, y in zip(after, before, strict=True))
    clients = [out[0] * 1e9 / count, out[1] * 1e9 / count]
    costs = [sender, receiver, driver_a - sender, driver_b - receiver, *clients]
    return out[4], [*costs, sender + receiver + (driver_a - sender) + (driver_b - receiver)
                    + sum(clients)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=positive_int, default=1_500_000,
                        help="1 KiB messages per run")
    parser.add_argument("--pairs", type=positive_int, default=3,
                        help="pairs of runs, plain then encrypted")
    parser.add_argument("--idle", choices=("yield", "sleep"), default="yield",
                        help="the clients' idling: the client's default (yield) or a sleep")
    parser.add_argument("--set", dest="settings", action="append", default=[],
                        type=driver_setting, metavar="KEY=VALUE",
                        help="a slipstream driver setting (repeatable)")
    args = parser.parse_args()

    from slipstream.daemon.driver import MediaDriver

    settings = {**DEFAULT_SETTINGS, **dict(args.settings)}
    print(f"# CPU per message of a 1 KiB UDP stream, plain and encrypted, {machine()}")
    print(f"# command: python -m bench.encrypted_cpu {' '.join(sys.argv[1:])}")
    print(f"# slipstream settings: {settings}; clients idle by {args.idle}; "
          f"load {' '.join(Path('/proc/loadavg').read_text().split()[:3])}", flush=True)
    scratch = scratch_directory()
    directory = Path(scratch.name)
    keys = directory / "keys"
    keys.mkdir(mode=0o750)
    (keys / "bench.key").write_text(f"1 {os.urandom(32).hex()}\n")
    (keys / "bench.key").chmod(0o640)
    results: dict[str, list[tuple[float, list[float]]]] = {"plain": [], "encrypted": []}
    with MediaDriver.launch(directory=directory / "a", keys_dir=str(keys), **settings) as a, \
            MediaDriver.launch(directory=directory / "b", keys_dir=str(keys), **settings) as b:
        stream_id = 3000
        print("#                " + "  ".join(f"{c:>11}" for c in COLUMNS) + "  (ns a message)")
        for _ in range(args.pairs):
            for name, key in (("plain", ""), ("encrypted", "|key=bench")):
                stream_id += 1
                channel = f"aeron:udp?endpoint=127.0.0.1:{free_port()}{key}"
                result = run(a, b, args.messages, stream_id, channel, args.idle)
                if result is None:
                    continue
                results[name].append(result)
                rate, costs = result
                print(f"{name:<9} {rate / 1e6:6.3f} M  "
                      + "  ".join(f"{c:11,.0f}" for c in costs), flush=True)
    scratch.cleanup()
    if not results["plain"] or not results["encrypted"]:
        print("# no whole pair of runs", flush=True)
        return 1
    medians = {name: [statistics.median(r[1][i] for r in runs) for i in range(len(COLUMNS))]
               for name, runs in results.items()}
    rates = {name: statistics.median(r[0] for r in runs) for name, runs in results.items()}
    for name in ("plain", "encrypted"):
        print(f"median    {rates[name] / 1e6:6.3f} M  "
              + "  ".join(f"{c:11,.0f}" for c in medians[name]) + f"  {name}")
    print("encrypted adds   " + "  ".join(
        f"{e - p:+11,.0f}" for p, e in zip(medians["plain"], medians["encrypted"], strict=True)))
    print(f"encrypted / plain: rate {rates['encrypted'] / rates['plain']:.2f}x, "
          f"CPU per message {medians['plain'][-1] / medians['encrypted'][-1]:.2f}x (inverse)")
    print(f"# load {' '.join(Path('/proc/loadavg').read_text().split()[:3])}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
