"""Back-pressure policies, measured against the plain offer in the same run (issue 22's
targets), and a back-pressure episode as a user sees it.

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
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
import time
from pathlib import Path

from bench.ipc_throughput import machine, run_slipstream, scratch_directory
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
            sub = client.add_subscription(channel, stream_id + offset)
            while not (pub.is_connected and sub.images):
                time.sleep(0.001)
            pairs[name] = (pub, sub)
        for _ in range(repeat):
            for name, (pub, sub) in pairs.items():
                offer = pub.offer
                start_position = pub.position
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


def percentile(values: list[int], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))] if ordered else 0.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=400_000,
                        help="offers per round of the offer cost (each fits the window)")
    parser.add_argument("--stream-messages", type=int, default=2_000_000,
                        help="messages per streaming run")
    parser.add_argument("--repeat", type=int, default=5, help="rounds; best kept")
    parser.add_argument("--hold", type=float, default=3.0, help="seconds the publisher is held")
    parser.add_argument("--trickle", type=float, default=3.0,
                        help="seconds of one message read every 2 ms")
    args = parser.parse_args()

    from slipstream.daemon.driver import MediaDriver

    print(f"# back pressure, {machine()}")
    print(f"# command: python -m bench.backpressure {' '.join(sys.argv[1:])}")
    scratch = scratch_directory()
    directory = Path(scratch.name)
    big = "term-length=64m"
    with MediaDriver.launch(directory=directory / "a") as a, \
            MediaDriver.launch(directory=directory / "b") as b:
        print("\n1. policy=block while credit is there (ratio: block / no policy)")
        for name, channel in (("IPC", f"aeron:ipc?{big}"),
                              ("UDP", f"aeron:udp?endpoint=127.0.0.1:{free_port()}|{big}")):
            best = offer_cost(a.directory, channel, args.messages, args.repeat, 100)
            print(f"   offer cost {name}: no policy {best['plain'] / 1e6:.3f} M offers/s, "
                  f"block {best['block'] / 1e6:.3f} M offers/s, "
                  f"ratio {best['block'] / best['plain']:.3f}", flush=True)
        stream_id = 200
        for name, channel, subscriber in (
                ("IPC", "aeron:ipc", None),
                ("UDP", f"aeron:udp?endpoint=127.0.0.1:{free_port()}", b.directory)):
            separator = "?" if name == "IPC" else "|"
            best = {"plain": 0.0, "block": 0.0}
            for _ in range(max(1, args.repeat // 2)):
                for policy in best:
                    stream_id += 1
                    uri = channel + (f"{separator}policy=block" if policy == "block" else "")
                    best[policy] = max(best[policy], run_slipstream(
                        a.directory, SIZE, args.stream_messages, False, stream_id,
                        channel=uri, subscriber_directory=subscriber, first_program=True))
            print(f"   streaming {name} (first program, {args.stream_messages:,} x {SIZE} B): "
                  f"no policy {best['plain'] / 1e6:.3f} M msg/s, block "
                  f"{best['block'] / 1e6:.3f} M msg/s, ratio "
                  f"{best['block'] / best['plain']:.3f}", flush=True)

        print("\n2. a blocked publisher (IPC, another process, policy=block)")
        measured = blocked_publisher(a.directory, args.hold, args.trickle)
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
    scratch.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
