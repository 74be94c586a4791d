"""UDP throughput on loopback: slipstream (per-message and batch API, publisher and subscriber
each on its own driver, so every message crosses UDP) against pyzmq PUB/SUB over tcp and a
stock Aeron driver (Java 1.15.1, SHARED threading: StreamingPublisher -> RateSubscriber),
measured in the same run.  Prints messages/s, MB/s and the ratios.

    .venv/bin/python -m bench.udp_throughput [--messages N] [--sizes 32,1024,65536]
        [--repeat R] [--set KEY=VALUE ...] [--no-aeron] [--no-first-program]

Besides the benchmark's loops (pinned, yielding when nothing moved, the client's own idle
strategy off), it runs the loops a first program writes ("first"): no pinning, no idle
strategy but the client's default (``Client.connect(spins_before_yield=16)``).

Aeron runs in both topologies, one driver for both samples and one driver each, and its best
is the peer (its spinning agents collapse with two drivers on 2 cores).  Each figure is the
best of R runs.  A slipstream run counts only if the stream arrived whole (every message; the
subscriber's final position equal to the publisher's).

Settings: slipstream's drivers run with ``--set`` values (default: a 2 MiB receiver window
and a 4 MiB socket buffer, see docs/PERFORMANCE.md for why), Aeron with the same window and
buffer.  64 KiB messages go with ``mtu=65504`` on both sides (the loopback MTU allows it; at
1408 B a sender is held to the kernel's ~300k datagrams/s).
"""

from __future__ import annotations

import contextlib
import socket
import sys
from pathlib import Path

from bench.ipc_throughput import (
    add_driver_settings,
    bench_parser,
    print_header,
    run_slipstream,
    run_zmq,
    scratch_directory,
)
from slipstream.client.layout import MAX_UDP_PAYLOAD_LENGTH, max_message_length
from slipstream.daemon.config import DriverSettings, check_setting

DEFAULT_SETTINGS = {"rcv_initial_window_length": "2m", "socket_so_rcvbuf": "4m"}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_tcp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def mtu_for(size: int) -> int | None:
    return MAX_UDP_PAYLOAD_LENGTH if size > 16 * 1024 else None


def run_aeron(size: int, count: int, *, two_drivers: bool, settings: dict[str, str]) -> float:
    """StreamingPublisher -> RateSubscriber; the subscriber's mean rate while traffic flowed."""
    from slipstream.client.units import parse_size
    from tests import aeron_peer

    uri = f"aeron:udp?endpoint=127.0.0.1:{free_port()}"
    if mtu_for(size):
        uri += f"|mtu={mtu_for(size)}"
    properties = {
        "aeron.rcv.initial.window.length": parse_size(settings["rcv_initial_window_length"]),
        "aeron.socket.so_rcvbuf": parse_size(settings["socket_so_rcvbuf"]),
    }
    with contextlib.ExitStack() as stack:
        publisher_driver = stack.enter_context(aeron_peer.AeronDriver(
            properties=properties, fast_timeouts=False))
        subscriber_driver = publisher_driver if not two_drivers else stack.enter_context(
            aeron_peer.AeronDriver(properties=properties, fast_timeouts=False))
        subscriber = stack.enter_context(aeron_peer.rate_subscriber(subscriber_driver, uri, 10))
        aeron_peer.streaming_publisher(publisher_driver, uri, 10, message_length=size,
                                       messages=count, timeout=300)
        subscriber.wait_for_total(count, timeout=120)
        return subscriber.msgs_per_sec


def main() -> int:
    parser = bench_parser(__doc__,
                          messages=(10_000_000, "messages per run of sizes up to 64 B"),
                          bytes=(4 << 30, "bytes per run of larger sizes (runs of several "
                                          "seconds: Aeron's RateSubscriber reports once a second)"),
                          sizes=("32,1024,65536", "message sizes in bytes, up to the largest "
                                 "message of the UDP log (term_buffer_length: 2 MiB for the "
                                 "default 16 MiB terms)"),
                          repeat=(2, "runs per contender; best kept"))
    add_driver_settings(parser)
    parser.add_argument("--no-aeron", action="store_true", help="leave the Aeron peer out")
    parser.add_argument("--no-first-program", action="store_true",
                        help="leave out the loops a first program writes (unpinned, the "
                             "client's default idle strategy only)")
    args = parser.parse_args()

    from slipstream.daemon.driver import MediaDriver

    settings = {**DEFAULT_SETTINGS, **dict(args.settings)}
    term_length = check_setting("term_buffer_length", settings.get(
        "term_buffer_length", DriverSettings().term_buffer_length))
    for size in args.sizes:  # the log the streams use: --set may change it
        if size > max_message_length(term_length):
            parser.error(f"argument --sizes: {size} is over {max_message_length(term_length)} "
                         f"bytes, the largest message of a log of {term_length}-byte terms")
    print_header("UDP throughput over loopback", "bench.udp_throughput", settings)
    scratch = scratch_directory()
    directory = Path(scratch.name)
    with MediaDriver.launch(directory=directory / "a", **settings) as a, \
            MediaDriver.launch(directory=directory / "b", **settings) as b:
        stream_id = 1000
        for size in args.sizes:
            count = args.messages if size <= 64 else max(1, args.bytes // size)
            uri = f"aeron:udp?endpoint=127.0.0.1:{free_port()}"
            if mtu_for(size):
                uri += f"|mtu={mtu_for(size)}"
            best = {"zmq": 0.0, "offer/poll": 0.0, "batch": 0.0, "first offer/poll": 0.0,
                    "first batch": 0.0, "aeron 1 driver": 0.0, "aeron 2 drivers": 0.0}
            for _ in range(args.repeat):
                best["zmq"] = max(best["zmq"], run_zmq(
                    directory, size, count, f"tcp://127.0.0.1:{free_tcp_port()}"))
                for batch, first, name in ((False, False, "offer/poll"),
                                           (True, False, "batch"),
                                           (False, True, "first offer/poll"),
                                           (True, True, "first batch")):
                    if first and args.no_first_program:
                        continue
                    stream_id += 1
                    best[name] = max(best[name], run_slipstream(
                        a.directory, size, count, batch, stream_id, channel=uri,
                        subscriber_directory=b.directory, first_program=first))
                if not args.no_aeron:
                    for two, name in ((False, "aeron 1 driver"), (True, "aeron 2 drivers")):
                        try:
                            best[name] = max(best[name], run_aeron(
                                size, count, two_drivers=two, settings=settings))
                        except Exception as e:  # a failed peer run is reported, not fatal
                            print(f"# {name} failed: {e}", flush=True)
            aeron = max(best["aeron 1 driver"], best["aeron 2 drivers"])
            mtu = f", mtu {mtu_for(size)}" if mtu_for(size) else ""
            line = [f"{size:>6} B  ({count:,} messages{mtu})"]
            for name, rate in best.items():
                if name.startswith("first") and args.no_first_program:
                    continue
                line.append(f"    {name:<16} {rate / 1e6:8.3f} M msg/s {rate * size / 1e6:9.1f} "
                            f"MB/s")
            ratios = [f"slipstream batch / aeron {best['batch'] / aeron:.2f}x" if aeron else "",
                      f"offer/poll / aeron {best['offer/poll'] / aeron:.2f}x" if aeron else "",
                      f"offer/poll / pyzmq tcp {best['offer/poll'] / best['zmq']:.2f}x"
                      if best["zmq"] else "",
                      f"batch / pyzmq tcp {best['batch'] / best['zmq']:.2f}x"
                      if best["zmq"] else "",
                      f"first offer/poll / aeron {best['first offer/poll'] / aeron:.2f}x"
                      if aeron and best["first offer/poll"] else "",
                      f"first batch / aeron {best['first batch'] / aeron:.2f}x"
                      if aeron and best["first batch"] else "",
                      "first offer/poll / yielding "
                      f"{best['first offer/poll'] / best['offer/poll']:.2f}x"
                      if best["offer/poll"] and best["first offer/poll"] else "",
                      f"first batch / yielding {best['first batch'] / best['batch']:.2f}x"
                      if best["batch"] and best["first batch"] else ""]
            line.append("    " + "   ".join(r for r in ratios if r))
            print("\n".join(line), flush=True)
    scratch.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
