"""Back-pressure policies, measured against the plain offer in the same run, and a
back-pressure episode as a user sees it (the figures: docs/PERFORMANCE.md).

    .venv/bin/python -m bench.backpressure [--repeat R] [--messages N]

1. **What ``policy=block`` costs while credit is there.**
   * *offer cost*: one process offers N 32-byte messages into a window that holds them all
     (64 MiB terms), ``policy=block`` against no policy, alternating, best of R; IPC, and UDP
     over loopback to the same driver.
   * *streaming*: the first program's loops (bench.ipc_throughput's ``first_program``:
     ``if pub.offer(m) > 0: sent += 1`` against a subscriber in another process polling),
     with and without ``policy=block`` in the channel, default settings; IPC on one driver,
     UDP between two.  Under block the loop never sees a code: an offer that finds no credit
     parks instead of returning.
2. **A blocked publisher** (IPC, another process, ``policy=block``): its CPU while held for
   3 s by a subscriber that reads nothing; then, while the subscriber reads one message every
   2 ms, how long after the driver moved pub-lmt the publisher's offer returned (the driver
   stamps the move in the log: ``LogBuffer.limit_moved_ns``), p50/p99/p99.9, and its CPU.
3. **The episodes** the publisher's ``on_back_pressure`` callback saw, and the stream's
   back-pressure counters, as ``slipstream stat`` shows them.
4. **Priority bands** (``--hosts``, root): two streams on one send socket through a 100 Mbit/s
   tbf (a 50 ms queue, a 64 KiB socket buffer: the socket fills before the queue drops),
   ``priority=800`` (band 4) against ``priority=0`` (band 1), then both at priority 0 (the
   peer: one band, shared evenly): band 4's share, and band 1's longest wait between two
   deliveries.
5. **The pressure governor** (``--hosts``): the same link, ``priority=-500`` against
   ``priority=800``, offering all they can for 6 s, then nothing: the ladder's steps over time,
   and what each stream moved at the top step.
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
import time
from pathlib import Path

from bench.ipc_throughput import (
    bench_parser,
    positive_float,
    positive_int,
    print_header,
    run_slipstream,
    scratch_directory,
)
from bench.udp_throughput import free_port

SIZE = 32


# -- 1. offer cost ------------------------------------------------------------------------------
def offer_cost(directory: Path, channel: str, count: int, repeat: int,
               stream_id: int) -> dict[str, float]:
    """Best offers/s of each policy (None, "block") over ``repeat`` alternating rounds; the
    subscriber reads everything between rounds, so every round starts with a whole window."""
    from slipstream.client import Client

    best = {"plain": 0.0, "block": 0.0}
    message = bytes(SIZE)
    with Client.connect(directory) as client:
        pairs = {}
        for offset, name in enumerate(best):
            pub = client.add_publication(channel, stream_id + offset,
                                         policy="block" if name == "block" else None)
            # A network subscription takes terms this long only when it says so.
            sub = client.add_subscription(
                channel.replace("term-length=", "max-term-length=") if "udp" in channel
                else channel, stream_id + offset)
            while not (pub.is_connected and sub.images):
                time.sleep(0.001)
            pairs[name] = (pub, sub)
        for _ in range(repeat):
            for name, (pub, sub) in pairs.items():
                offer = pub.offer
                start_position = pub.position
                while pub.publication_limit - start_position < count * 64:  # a whole window
                    time.sleep(0.001)
                started = time.perf_counter()
                for _ in range(count):
                    offer(message)
                elapsed = time.perf_counter() - started
                expected = start_position + count * 64  # 32 B + the 32-byte header
                if pub.position != expected:
                    print(f"# {name}: {pub.position - start_position} of {count * 64} bytes "
                          f"went in: the window was not whole", flush=True)
                    continue
                best[name] = max(best[name], count / elapsed)
                while sub.images[0].position < pub.position:  # credit back for the next round
                    if not sub.poll(lambda *_: None, 100_000):
                        time.sleep(0.0001)
    return best


# -- 2. a blocked publisher ---------------------------------------------------------------------
def _blocked_publisher(directory: str, channel: str, stream_id: int, filled, held_done,
                       trickle_done, results) -> None:
    from slipstream.client import Client

    episodes = []
    with Client.connect(directory) as client:
        pub = client.add_publication(channel, stream_id, policy="block,timeout:60s",
                                     on_back_pressure=episodes.append)
        while not pub.is_connected:
            time.sleep(0.001)
        log_buffer = pub._log
        message = bytes(SIZE)
        window = pub.publication_limit - pub.position
        while pub.position < pub.publication_limit:  # fill it: the next offer waits
            pub.offer(message)
        filled.set()
        # Held: one offer parks until the subscriber reads (after the held phase).
        cpu = time.process_time()
        started = time.monotonic()
        pub.offer(message)
        held_s = time.monotonic() - started
        held_cpu = time.process_time() - cpu
        held_done.set()
        # Trickle: each offer waits for the next move of the limit.
        latencies = []
        cpu = time.process_time()
        started = time.monotonic()
        while not trickle_done.is_set():
            asked = time.monotonic_ns()
            pub.offer(message)
            resumed = time.monotonic_ns()
            moved = log_buffer.limit_moved_ns()
            if moved > asked:  # it waited, and the driver's move released it
                latencies.append(resumed - moved)
        trickle_s = time.monotonic() - started
        trickle_cpu = time.process_time() - cpu
        time.sleep(0.2)  # the last episode's end reaches the callback
        results.put({"window": window, "held_s": held_s, "held_cpu": held_cpu,
                     "trickle_s": trickle_s, "trickle_cpu": trickle_cpu,
                     "latencies": latencies,
                     "episodes": [(e.started, e.at_ns, e.depth, e.duration_ns, e.episodes)
                                  for e in episodes]})


def blocked_publisher(directory: Path, hold_s: float, trickle_s: float) -> dict:
    """Run section 2 against a publisher in another process; returns what it measured and
    the stream's back-pressure counters."""
    from slipstream.client import Client
    from slipstream.client.counters import BACK_PRESSURE_TYPES

    channel, stream_id = "aeron:ipc", 77
    context = multiprocessing.get_context("spawn")
    filled, held_done, trickle_done = context.Event(), context.Event(), context.Event()
    results = context.Queue()
    with Client.connect(directory) as client:
        sub = client.add_subscription(channel, stream_id)
        publisher = context.Process(target=_blocked_publisher, args=(
            str(directory), channel, stream_id, filled, held_done, trickle_done, results))
        publisher.start()
        assert filled.wait(30), "the publisher did not fill its window"
        time.sleep(hold_s)
        count = [0]

        def handler(_data: memoryview, _header: object) -> None:
            count[0] += 1

        sub.poll(handler, 1)  # releases the held offer
        assert held_done.wait(10)
        ends = time.monotonic() + trickle_s
        while time.monotonic() < ends:
            sub.poll(handler, 1)
            time.sleep(0.002)
        trickle_done.set()
        while publisher.is_alive() and results.empty():  # its last offer waits for one more
            sub.poll(handler, 100)
            time.sleep(0.001)
        measured = results.get(timeout=30)
        publisher.join(30)
        kinds = {type_id: name for type_id, name in BACK_PRESSURE_TYPES}
        measured["counters"] = {kinds[info.type_id]: info.value for info in client.counters
                                if info.type_id in kinds and info.stream_id == stream_id}
    return measured


# -- 4. and 5. on namespace hosts ---------------------------------------------------------------
LINK = {"mbit": 100, "queue_ms": 50, "sender_settings": {"socket_so_sndbuf": "64k"},
        "receiver_settings": {"rcv_initial_window_length": "2m", "socket_so_rcvbuf": "4m"}}


def bands_on_hosts(seconds: float) -> None:
    from slipstream.sim.real.on_hosts import share_one_link

    for name, params in (("band 4 against band 1", ("priority=0", "priority=800")),
                         ("one band (the peer)", ("priority=0", "priority=0"))):
        result = share_one_link(("", ""), seconds, publication_params=params, **LINK)
        low, high = (series[10:] for series in result["bins"])  # after the first second
        longest = 0
        run = 0
        for delivered in low:
            run = run + 1 if delivered == 0 else 0
            longest = max(longest, run)
        print(f"   {name}: stream 2 {sum(high) / (len(high) / 10) / 1e6:.2f} MB/s, stream 1 "
              f"{sum(low) / (len(low) / 10) / 1e6:.2f} MB/s, stream 2's share "
              f"{sum(high) / (sum(high) + sum(low)):.3f}; stream 1's longest spell without a "
              f"delivery: {'under 100 ms' if not longest else f'{longest * 100} ms'}; "
              f"losses {result['losses']}", flush=True)


def governor_on_hosts(load_s: float) -> None:
    from slipstream.client import Client
    from slipstream.client.counters import CountersFile, SystemCounter
    from slipstream.sim.real.hosts import NamespaceHosts
    from slipstream.sim.scenario import UNICAST_PORT

    with NamespaceHosts(2) as hosts:
        hosts.rate_limit(1, LINK["mbit"], latency_ms=LINK["queue_ms"])
        sender = hosts.start_driver(1, log_level="warning", **LINK["sender_settings"])
        receiver = hosts.start_driver(2, log_level="warning", **LINK["receiver_settings"])
        uri = f"aeron:udp?endpoint={hosts[2].address}:{UNICAST_PORT}"
        with Client.connect(sender.directory) as a, Client.connect(receiver.directory) as b:
            subscriptions = [b.add_subscription(uri, k) for k in (1, 2)]
            publications = [a.add_publication(f"{uri}|priority=-500", 1),
                            a.add_publication(f"{uri}|priority=800", 2)]
            while not (all(p.is_connected for p in publications)
                       and all(s.images for s in subscriptions)):
                time.sleep(0.01)
            counters = CountersFile(sender.directory / "counters.dat", writable=False)
            message = bytes(1024)
            got = [0, 0]

            def counted(k: int):
                def on_message(_data: memoryview, _header: object) -> None:
                    got[k] += 1
                return on_message

            handlers = [counted(0), counted(1)]
            steps = [(0.0, 0, 0)]
            top: tuple[float, list[int]] | None = None  # when step 4 came, what had arrived
            load_end: tuple[float, list[int]] | None = None
            started = time.monotonic()
            next_look = started
            while (now := time.monotonic()) - started < load_s + 8:
                loading = now - started < load_s
                if not loading and load_end is None:
                    load_end = (now - started, got[:])
                for k, publication in enumerate(publications):
                    if loading:
                        for _ in range(32):
                            if publication.offer(message) < 0:
                                break
                    subscriptions[k].poll(handlers[k], 256)
                if now >= next_look:
                    next_look += 0.01
                    step = counters.get(SystemCounter.GOVERNOR_STEP)
                    if step != steps[-1][1]:
                        steps.append((now - started, step,
                                      counters.get(SystemCounter.GOVERNOR_PRESSURE)))
                        if step == 4 and top is None and loading:
                            top = (now - started, got[:])
                    if not loading and step == 0:
                        break
                if not loading:
                    time.sleep(0.0005)
            counters.close()
    print("   the ladder (time after the load began: step, pressure):")
    print("   " + "  ".join(f"{t:.2f} s: {step} ({pressure / 1000:.2f})"
                            for t, step, pressure in steps[1:]))
    if top is not None and load_end is not None and load_end[0] > top[0]:
        span = load_end[0] - top[0]
        rates = [(load_end[1][k] - top[1][k]) * 1024 / span / 1e6 for k in (0, 1)]
        print(f"   at the top step, until the load stopped ({span:.1f} s): priority -500 "
              f"{rates[0]:.2f} MB/s (refused), priority 800 {rates[1]:.2f} MB/s")
    print(f"   messages delivered in all: priority -500 {got[0]:,}, priority 800 {got[1]:,}")


def percentile(values: list[int], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))] if ordered else 0.0


def section_block_cost(directory: Path, other: Path, args: argparse.Namespace) -> None:
    big = "term-length=64m"
    for name, channel in (("IPC", f"aeron:ipc?{big}"),
                          ("UDP", f"aeron:udp?endpoint=127.0.0.1:{free_port()}|{big}")):
        best = offer_cost(directory, channel, args.messages, args.repeat, 100)
        print(f"   offer cost {name}: no policy {best['plain'] / 1e6:.3f} M offers/s, "
              f"block {best['block'] / 1e6:.3f} M offers/s, "
              f"ratio {best['block'] / best['plain']:.3f}", flush=True)
    stream_id = 200
    for name, channel, subscriber in (
            ("IPC", "aeron:ipc", None),
            ("UDP", f"aeron:udp?endpoint=127.0.0.1:{free_port()}", other)):
        separator = "?" if name == "IPC" else "|"
        best = {"plain": 0.0, "block": 0.0}
        for _ in range(max(1, args.repeat // 2)):
            for policy in best:
                stream_id += 1
                uri = channel + (f"{separator}policy=block" if policy == "block" else "")
                best[policy] = max(best[policy], run_slipstream(
                    directory, SIZE, args.stream_messages, False, stream_id,
                    channel=uri, subscriber_directory=subscriber, first_program=True))
        print(f"   streaming {name} (first program, {args.stream_messages:,} x {SIZE} B): "
              f"no policy {best['plain'] / 1e6:.3f} M msg/s, block "
              f"{best['block'] / 1e6:.3f} M msg/s, ratio "
              f"{best['block'] / best['plain']:.3f}", flush=True)


def section_blocked(directory: Path, args: argparse.Namespace) -> None:
    print("\n2. a blocked publisher (IPC, another process, policy=block)")
    measured = blocked_publisher(directory, args.hold, args.trickle)
    latencies = measured["latencies"]
    print(f"   held {measured['held_s']:.2f} s: {measured['held_cpu'] * 1e3:.1f} ms of CPU "
          f"= {100 * measured['held_cpu'] / measured['held_s']:.2f} % of a core")
    print(f"   one message read every 2 ms for {measured['trickle_s']:.1f} s: "
          f"{len(latencies):,} resumes; from the limit's move to the offer's return "
          f"p50 {percentile(latencies, 0.5) / 1e3:.1f} us, "
          f"p99 {percentile(latencies, 0.99) / 1e3:.1f} us, "
          f"p99.9 {percentile(latencies, 0.999) / 1e3:.1f} us; CPU "
          f"{100 * measured['trickle_cpu'] / measured['trickle_s']:.2f} % of a core")
    print("\n3. episodes the publisher's on_back_pressure saw "
          f"(window {measured['window']:,} bytes)")
    events = measured["episodes"]
    first_ns = events[0][1] if events else 0
    for started, at_ns, depth, duration_ns, count in events[:6]:
        what = (f"episode {count} began" if started
                else f"episode {count} ended after {duration_ns / 1e6:.1f} ms")
        print(f"   +{(at_ns - first_ns) / 1e6:9.1f} ms  {what}, depth {depth:,} bytes")
    if len(events) > 6:
        print(f"   ... {len(events)} events in all")
    counters = measured["counters"]
    print(f"   counters: bp-episodes {counters.get('bp-episodes')}, bp-time "
          f"{counters.get('bp-time', 0) / 1e9:.3f} s, bp-depth {counters.get('bp-depth')}, "
          f"bp-peak {counters.get('bp-peak')}, pub-drops {counters.get('pub-drops')}")


def main() -> int:
    parser = bench_parser(__doc__,
                          messages=(200_000, "offers per round of the offer cost (each fits "
                                             "the window)"),
                          repeat=(5, "rounds; best kept"))
    parser.add_argument("--stream-messages", type=positive_int, default=2_000_000,
                        help="messages per streaming run")
    parser.add_argument("--hold", type=positive_float, default=3.0,
                        help="seconds the publisher is held")
    parser.add_argument("--trickle", type=positive_float, default=3.0,
                        help="seconds of one message read every 2 ms")
    parser.add_argument("--hosts", action="store_true",
                        help="also sections 4 and 5, on namespace hosts (root)")
    parser.add_argument("--only", type=int, default=0, choices=range(1, 6), metavar="1..5",
                        help="run only this section (1-5; 4 and 5 need root)")
    args = parser.parse_args()
    wanted = ({args.only} if args.only else {1, 2, 3, *((4, 5) if args.hosts else ())})

    from slipstream.daemon.driver import MediaDriver

    print_header("back pressure", "bench.backpressure")
    scratch = scratch_directory()
    directory = Path(scratch.name)
    with MediaDriver.launch(directory=directory / "a") as a, \
            MediaDriver.launch(directory=directory / "b") as b:
        if 1 in wanted:
            print("\n1. policy=block while credit is there (ratio: block / no policy)")
            section_block_cost(a.directory, b.directory, args)
        if wanted & {2, 3}:
            section_blocked(a.directory, args)
    scratch.cleanup()
    if 4 in wanted:
        print("\n4. priority bands through a 100 Mbit/s tbf (after the first second of 6)")
        bands_on_hosts(6.0)
    if 5 in wanted:
        print("\n5. the pressure governor through the same link")
        governor_on_hosts(6.0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
