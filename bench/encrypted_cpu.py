"""Where an encrypted stream's time goes, and how near it runs to what the cipher allows
(docs/CHANNELS.md §7.8): a UDP stream between two drivers on loopback, plain and encrypted in
alternating pairs of runs, at 1 KiB and 64 KiB (``mtu=65440`` for both streams of 64 KiB),
with the first program's loops (``offer`` / ``poll``, the client's idle strategy).

Per run: the rate, then ns of CPU per message of the sending and the receiving driver's
network thread (``ss-network``: the seals, the opens), each driver's other threads (its
conductor: ``snd driver``, ``rcv driver``), the publisher's and the subscriber's loops (their
CPU from the first offer and the first poll to their last), and the sum.  Then, per size, the
medians, what encryption adds to each, and **the limit**: on the same cores, a stream that
spent per message plain's CPU and one bare seal and one bare open (bench/aes_gcm_rate.c's C
loops of OpenSSL's EVP sequence, run after each pair of runs: their medians) would run at
plain's rate times plain's CPU over that sum.  The encrypted rate is printed as a ratio of
that limit (the target: at least 0.9x) and of plain's rate, and so are the CPU a message (the
limit's sum over encrypted's): on a machine shared with other work the CPU a message moves
less than the rates do.  On two cores the stream keeps
both busy, so its rate follows the sum: the ratio of the sums is the ratio of the rates, and
the differences say which thread costs what.

Last, the time to a stream's first message, keyed and plain (``--first N`` of each, in
turns): from the publication's add on one driver to the message's arrival at a subscription
that waits on the other, with whatever exchange a keyed stream makes before it carries data;
with the first program's clients (their idle strategy: a loop that finds nothing yields),
and with loops that never yield (``spins_before_yield=None``).  A loop that never yields
keeps the GIL: the subscriber's client thread, which hands the image over, then gets it a
switch interval (5 ms) at a time, once per call of its own that lets it go.

    .venv/bin/python -m bench.encrypted_cpu [--sizes 1024,65536] [--bytes N] [--pairs P]
        [--idle park,yield,sleep] [--first N] [--set KEY=VALUE ...]

``--idle``: how the clients idle once 16 calls in a row did nothing, one or more of
``park`` (the client's default: a short yield, then a park on the log until the driver brings
the credit or the data), ``yield`` (the loop yields the CPU at every further call, the client's
own strategy off) and ``sleep`` (the loop sleeps ``SLEEP_S``); several are run in turns, to see
what their idling costs the stream in the same run.
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

from bench.encrypted_throughput import LARGE_MTU, aes_gcm_rates, key_directory
from bench.ipc_throughput import (
    add_driver_settings,
    bench_parser,
    join_run,
    positive_int,
    print_header,
    scratch_directory,
)
from bench.spy_cost import cpu_ns, network_task
from bench.udp_throughput import DEFAULT_SETTINGS, free_port

if TYPE_CHECKING:
    from slipstream.daemon.driver import MediaDriver

SPINS = 16  # calls that did nothing before idling, as the client's DEFAULT_SPINS_BEFORE_YIELD
SLEEP_S = 20e-6  # --idle sleep: the clients' sleep once idle (about 70 µs with timer slack)
IDLE_MODES = ("park", "yield", "sleep")
#: The columns of a run's line and of the medians, in ns per message.
COLUMNS = ("snd network", "rcv network", "snd driver", "rcv driver", "publisher", "subscriber",
           "sum")
#: What each of the C loops seals or opens after each pair of runs, bytes (about 0.1-0.2 s).
BARE_LOOP_BYTES = 256 * 1024 * 1024
#: The longest a stream's first message may take before a trial counts as failed, s.
FIRST_MESSAGE_TIMEOUT_S = 10.0


def _idle_modes(text: str) -> tuple[str, ...]:
    modes = tuple(mode.strip() for mode in text.split(",") if mode.strip())
    unknown = [mode for mode in modes if mode not in IDLE_MODES]
    if not modes or unknown:
        raise argparse.ArgumentTypeError(f"--idle takes {', '.join(IDLE_MODES)} (comma-"
                                         f"separated), not {text!r}")
    return modes


def _connect(directory: str, idle: str):  # -> Client
    from slipstream.client import Client

    # park: the client's defaults; the others idle in the loop, the client's strategy off.
    return Client.connect(directory, **({} if idle == "park" else {"spins_before_yield": None}))


def _idle_in_loop(idle: str, misses: int) -> None:
    """The loop's own idling for ``yield`` and ``sleep``, after ``misses`` calls in a row that
    did nothing (``park`` idles inside the client's calls)."""
    if misses > SPINS:
        if idle == "yield":
            os.sched_yield()
        elif idle == "sleep":
            time.sleep(SLEEP_S)


def _publisher(directory: str, channel: str, stream_id: int, size: int, count: int, idle: str,
               start, out) -> None:
    with _connect(directory, idle) as client:
        publication = client.add_publication(channel, stream_id)
        while not publication.is_connected:
            time.sleep(0.001)
        start.wait()
        message, offer, sent, misses = bytes(size), publication.offer, 0, 0
        began = time.process_time()
        if idle == "park":
            while sent < count:
                if offer(message) > 0:
                    sent += 1
        else:
            while sent < count:
                if offer(message) > 0:
                    sent, misses = sent + 1, 0
                else:
                    misses += 1
                    _idle_in_loop(idle, misses)
        out[0] = time.process_time() - began
        out[2] = publication.position


def _subscriber(directory: str, channel: str, stream_id: int, count: int, idle: str, ready,
                out) -> None:
    with _connect(directory, idle) as client:
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
            elif idle != "park":
                misses += 1
                _idle_in_loop(idle, misses)
        out[1] = time.process_time() - began
        out[3] = subscription.images[0].position
        out[4] = received[0] / (time.perf_counter() - first)


def _process_ns(pid: int) -> float:
    """CPU ns (user + system) process ``pid`` has used so far, all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * 1e9 / os.sysconf("SC_CLK_TCK")


def run(a: MediaDriver, b: MediaDriver, size: int, count: int, stream_id: int, channel: str,
        idle: str) -> tuple[float, list[float]] | None:
    """One run: (messages/s, ns per message of each of COLUMNS), None when it did not
    arrive whole."""
    context = multiprocessing.get_context("spawn")
    ready, start, out = context.Event(), context.Event(), context.Array("d", 5)
    subscriber = context.Process(target=_subscriber, args=(
        str(b.directory), channel, stream_id, count, idle, ready, out))
    publisher = context.Process(target=_publisher, args=(
        str(a.directory), channel, stream_id, size, count, idle, start, out))
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


def limit_lines(mode: str, runs: dict[str, list[tuple[float, list[float]]]],
                bare: tuple[float, float] | None) -> list[str]:
    """The medians of one idle mode's runs, what encryption adds, and the encrypted rate
    against the cipher's limit and against plain."""
    if not runs["plain"] or not runs["encrypted"]:
        return [f"{mode:<6} no whole pair of runs"]
    medians = {name: [statistics.median(r[1][i] for r in kind) for i in range(len(COLUMNS))]
               for name, kind in runs.items()}
    rates = {name: statistics.median(r[0] for r in kind) for name, kind in runs.items()}
    lines = [f"{mode:<6} median    {rates[name] / 1e6:7.3f} M  "
             + "  ".join(f"{c:11,.0f}" for c in medians[name]) + f"  {name}"
             for name in ("plain", "encrypted")]
    lines.append(f"{mode:<6} encrypted adds    " + "  ".join(
        f"{e - p:+11,.0f}" for p, e in zip(medians["plain"], medians["encrypted"], strict=True)))
    to_plain = rates["encrypted"] / rates["plain"]
    cpu_ratio = medians["plain"][-1] / medians["encrypted"][-1]
    if bare is None:
        lines.append(f"{mode:<6} encrypted / plain {to_plain:.2f}x (CPU a message "
                     f"{cpu_ratio:.2f}x, inverse); no C loop: no limit")
        return lines
    plain_cpu, seal, open_ = medians["plain"][-1], 1e9 / bare[0], 1e9 / bare[1]
    limit = rates["plain"] * plain_cpu / (plain_cpu + seal + open_)
    lines.append(f"{mode:<6} limit: plain {plain_cpu:,.0f} ns a message + bare seal {seal:,.0f}"
                 f" + bare open {open_:,.0f} = {plain_cpu + seal + open_:,.0f} ns: "
                 f"{limit / 1e6:.3f} M msg/s on these cores")
    lines.append(f"{mode:<6} encrypted {rates['encrypted'] / 1e6:.3f} M msg/s: "
                 f"**{rates['encrypted'] / limit:.2f}x the limit** (target 0.9x), "
                 f"{to_plain:.2f}x plain; CPU a message: the limit's over encrypted's "
                 f"**{(plain_cpu + seal + open_) / medians['encrypted'][-1]:.2f}x**, plain's "
                 f"{cpu_ratio:.2f}x")
    return lines


def first_messages(a: MediaDriver, b: MediaDriver, trials: int, stream_id: int, *,
                   spin: bool = False) -> dict[str, list[float]]:
    """Seconds from a publication's add (on ``a``) to its first message's arrival at a
    subscription already waiting (on ``b``), ``trials`` keyed and plain streams in turns;
    the clients' loops yield as the first program's do, or (``spin``) never."""
    from slipstream.client import Client

    times: dict[str, list[float]] = {"plain": [], "encrypted": []}
    got: list[int] = []

    def handler(data: memoryview, header: object) -> None:
        got.append(len(data))

    loops = {"spins_before_yield": None} if spin else {}
    with Client.connect(a.directory, **loops) as publisher, \
            Client.connect(b.directory, **loops) as subscriber:
        for _ in range(trials):
            for name, key in (("plain", ""), ("encrypted", "|key=bench")):
                stream_id += 1
                channel = f"aeron:udp?endpoint=127.0.0.1:{free_port()}{key}"
                subscription = subscriber.add_subscription(channel, stream_id)
                began = time.monotonic()
                publication = publisher.add_publication(channel, stream_id)
                got.clear()
                offered = False
                while not got and time.monotonic() - began < FIRST_MESSAGE_TIMEOUT_S:
                    if not offered:
                        offered = publication.offer(b"first") > 0
                    subscription.poll(handler, 1)
                if got:
                    times[name].append(time.monotonic() - began)
                else:
                    print(f"# {name}: no first message within {FIRST_MESSAGE_TIMEOUT_S:g} s",
                          flush=True)
                publication.close()
                subscription.close()
    return times


def main() -> int:
    parser = bench_parser(__doc__, sizes=("1024,65536", "message sizes in bytes"),
                          bytes=(1_536_000_000, "bytes per run (each size sends this many)"))
    parser.add_argument("--pairs", type=positive_int, default=3,
                        help="pairs of runs, plain then encrypted, per size and idle mode")
    parser.add_argument("--idle", type=_idle_modes, default=("park",),
                        help="the clients' idling, one or more of park (the client's "
                             "default), yield, sleep, comma-separated")
    parser.add_argument("--first", type=int, default=5,
                        help="trials of the time to a stream's first message (0: none)")
    add_driver_settings(parser)
    args = parser.parse_args()

    from slipstream.daemon.driver import MediaDriver

    settings = {**DEFAULT_SETTINGS, **dict(args.settings)}
    print_header("CPU per message of a UDP stream, plain and encrypted", "bench.encrypted_cpu",
                 settings, f"clients idle by {', '.join(args.idle)}; load "
                           f"{' '.join(Path('/proc/loadavg').read_text().split()[:3])}")
    scratch = scratch_directory()
    directory = Path(scratch.name)
    keys = key_directory(directory)
    whole = True
    with MediaDriver.launch(directory=directory / "a", keys_dir=str(keys), **settings) as a, \
            MediaDriver.launch(directory=directory / "b", keys_dir=str(keys), **settings) as b:
        stream_id = 3000
        for size in args.sizes:
            count = max(1, args.bytes // size)
            mtu = f"|mtu={LARGE_MTU}" if size > 16 * 1024 else ""
            print(f"# {size} B, {count:,} messages a run{mtu and ', mtu ' + str(LARGE_MTU)}")
            print("#                      " + "  ".join(f"{c:>11}" for c in COLUMNS)
                  + "  (ns a message)", flush=True)
            results = {mode: {"plain": [], "encrypted": []} for mode in args.idle}
            bares: list[tuple[float, float]] = []  # the C loops' (seals/s, opens/s)
            for _ in range(args.pairs):
                for mode in args.idle:
                    for name, key in (("plain", ""), ("encrypted", "|key=bench")):
                        stream_id += 1
                        channel = f"aeron:udp?endpoint=127.0.0.1:{free_port()}{mtu}{key}"
                        result = run(a, b, size, count, stream_id, channel, mode)
                        if result is None:
                            continue
                        results[mode][name].append(result)
                        rate, costs = result
                        print(f"{mode:<6} {name:<9} {rate / 1e6:7.3f} M  "
                              + "  ".join(f"{c:11,.0f}" for c in costs), flush=True)
                # The C loops between the pairs, as loaded as the runs around them.
                rates = aes_gcm_rates(directory, size, max(1, BARE_LOOP_BYTES // size))
                if rates is not None:
                    bares.append(rates)
                    print(f"bare   C loops     {1e9 / rates[0]:,.0f} ns a seal, "
                          f"{1e9 / rates[1]:,.0f} ns an open", flush=True)
            bare = (statistics.median(r[0] for r in bares),
                    statistics.median(r[1] for r in bares)) if bares else None
            for mode in args.idle:
                lines = limit_lines(mode, results[mode], bare)
                whole = whole and "no whole pair" not in lines[0]
                print("\n".join(lines), flush=True)
        for loops, spin in (("the first program's loops", False),
                            ("loops that never yield", True)) if args.first > 0 else ():
            stream_id += 1000
            times = first_messages(a, b, args.first, stream_id, spin=spin)
            if all(times.values()):
                plain, keyed = (statistics.median(times[n]) * 1e3 for n in ("plain", "encrypted"))
                print(f"time to the first message, {loops} (medians of {args.first}): plain "
                      f"{plain:.2f} ms, keyed {keyed:.2f} ms, keyed / plain {keyed / plain:.2f}x "
                      f"(plain {min(times['plain']) * 1e3:.2f}-"
                      f"{max(times['plain']) * 1e3:.2f} ms, keyed "
                      f"{min(times['encrypted']) * 1e3:.2f}-"
                      f"{max(times['encrypted']) * 1e3:.2f} ms)", flush=True)
            else:
                whole = False
    scratch.cleanup()
    print(f"# load {' '.join(Path('/proc/loadavg').read_text().split()[:3])}", flush=True)
    return 0 if whole else 1


if __name__ == "__main__":
    sys.exit(main())
