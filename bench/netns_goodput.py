"""Goodput under loss between two test hosts (network namespaces on a bridge, a driver in
each): slipstream over UDP against pyzmq PUB/SUB over TCP through the same link, at 0 %, 1 %
and 5 % random loss on the receiving host (``iptables -m statistic``).  Needs root.

    sudo .venv/bin/python -m bench.netns_goodput [--messages N] [--size BYTES] [--losses 0,1,5]
                                                 [--repeat N]

Goodput is the payload the subscriber received per second, from its first message to its last.
A slipstream run counts only if every message arrived (the subscriber's final position equal
to the publisher's); the NAKs and retransmissions the drivers counted are reported with it.
The publisher, when back-pressured, yields and then sleeps 100 µs between offers (an
application that spins takes a core from the sender thread it waits for).  Four processes
share two cores here, so one run moves by ±10 % with where the scheduler puts the drivers'
threads: slipstream runs ``--repeat`` rounds of every loss in turn (each round starts one loss
later, so no loss always runs first), and the summary gives each loss's median and its share
of the lossless median (pyzmq runs once per loss, in the first round).
"""

from __future__ import annotations

import argparse
import ctypes
import multiprocessing
import os
import statistics
import sys
import time
from typing import Any

from bench.ipc_throughput import (
    add_driver_settings,
    bench_parser,
    print_header,
    run_slipstream,
)

#: A 4 MiB window in a 4 MiB socket buffer (the most net.core.rmem_max grants here; a gap holds
#: the window until it is repaired, and at 5 % loss a window holds about 200 gaps: 1 and 2 MiB
#: keep less in flight), and NAK timers for a LAN: a lost retransmission is asked for again
#: after 1 ms instead of Aeron's 10 ms (which suits a WAN).  docs/FLOW.md, How large a
#: window, says why.
DEFAULT_SETTINGS = {"rcv_initial_window_length": "4m", "socket_so_rcvbuf": "4m",
                    "nak_unicast_retry_delay_ratio": "10", "retransmit_unicast_linger": "1ms"}
#: A back-pressured publisher yields, then sleeps this long between offers (bench/
#: ipc_throughput.py back_pressured): the drivers' threads need both cores.
PUBLISHER_BACKOFF_S = 100e-6
PORT = 40200


def enter_netns(name: str) -> None:
    """Move this (single-threaded, just started) process into network namespace ``name``."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, 0x40000000) != 0:  # CLONE_NEWNET
            raise OSError(ctypes.get_errno(), f"setns into {name} failed")
    finally:
        os.close(fd)


def _zmq_publisher(netns: str, endpoint: str, size: int, count: int, start: Any) -> None:
    enter_netns(netns)
    import zmq

    context = zmq.Context()
    socket = context.socket(zmq.PUB)
    socket.setsockopt(zmq.SNDHWM, 0)
    socket.bind(endpoint)
    start.wait()
    message = bytes(size)
    for _ in range(count):
        socket.send(message)
    time.sleep(2.0)
    socket.close(linger=-1)
    context.term()


def _zmq_subscriber(netns: str, endpoint: str, count: int, ready: Any, result: Any) -> None:
    enter_netns(netns)
    import zmq

    context = zmq.Context()
    socket = context.socket(zmq.SUB)
    socket.setsockopt(zmq.RCVHWM, 0)
    socket.setsockopt(zmq.SUBSCRIBE, b"")
    socket.connect(endpoint)
    time.sleep(0.5)
    ready.set()
    socket.recv()
    first = time.perf_counter()
    for _ in range(count - 1):
        socket.recv()
    result.value = (count - 1) / (time.perf_counter() - first)
    socket.close(0)
    context.term()


def run_zmq(hosts: Any, size: int, count: int) -> float:
    endpoint = f"tcp://{hosts[1].address}:{PORT + 1}"
    context = multiprocessing.get_context("spawn")
    ready, start, result = context.Event(), context.Event(), context.Value("d", 0.0)
    publisher = context.Process(target=_zmq_publisher, args=(
        hosts[1].namespace, endpoint, size, count, start))
    subscriber = context.Process(target=_zmq_subscriber, args=(
        hosts[2].namespace, endpoint, count, ready, result))
    publisher.start()
    time.sleep(0.3)
    subscriber.start()
    assert ready.wait(60)
    start.set()
    subscriber.join(300)
    publisher.join(30)
    for process in (publisher, subscriber):
        if process.is_alive():
            process.kill()
    return result.value


def _losses(text: str) -> list[float]:
    """An argparse type: comma-separated loss percentages, each in [0, 100)."""
    losses = []
    for part in text.split(","):
        try:
            loss = float(part)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{part!r} is not a number") from None
        if not 0 <= loss < 100:
            raise argparse.ArgumentTypeError(f"{part} is not a loss in 0..100 %")
        losses.append(loss)
    return losses


def udp_receive_buffer_drops(host: Any) -> int:
    """Datagrams the kernel of ``host`` dropped for a full socket receive buffer
    (``RcvbufErrors`` of /proc/net/snmp, which each network namespace keeps): losses that
    iptables did not make."""
    lines = [line.split() for line in host.run("cat", "/proc/net/snmp").stdout.splitlines()
             if line.startswith("Udp:")]
    return int(lines[1][lines[0].index("RcvbufErrors")])


def main() -> int:
    parser = bench_parser(__doc__,
                          messages=(1_000_000, "messages per run (shorter runs are dominated "
                                               "by their start)"),
                          size=(1024, "message size, bytes"),
                          repeat=(5, "rounds of slipstream runs over every loss (medians "
                                     "reported)"))
    parser.add_argument("--losses", type=_losses, default="0,1,5",
                        help="loss percentages to run (0 up to 100)")
    add_driver_settings(parser)
    parser.add_argument("--first-program", action="store_true",
                        help="the driver's default settings and the loops a first program "
                             "writes (busy offer, busy poll, no back-off of their own)")
    parser.add_argument("--no-pyzmq", action="store_true",
                        help="skip the pyzmq peer (TCP at 5 %% loss moves ~3 MB/s: a long run "
                             "of --messages takes minutes)")
    args = parser.parse_args()

    from slipstream.client.counters import SystemCounter, read_system_counters
    from slipstream.sim.real.hosts import namespace_hosts

    def counter(driver: Any, which: SystemCounter) -> int:
        return read_system_counters(driver.directory)[which]

    tuned = {} if args.first_program else DEFAULT_SETTINGS
    settings = {**tuned, **dict(args.settings)}
    losses = args.losses
    print_header("goodput between two namespace hosts under loss", "bench.netns_goodput")
    print(f"# {args.messages:,} messages of {args.size} B; slipstream settings {settings}; "
          f"loss dropped by iptables on the receiving host (UDP for slipstream, TCP for zmq)")
    runs: dict[float, list[float]] = {loss: [] for loss in losses}
    zmq: dict[float, float] = {}
    with namespace_hosts(2) as hosts:
        a = hosts.start_driver(1, **settings)
        b = hosts.start_driver(2, **settings)
        uri = f"aeron:udp?endpoint={hosts[2].address}:{PORT}"
        stream_id = 3000
        for round_ in range(args.repeat):
            shift = round_ % len(losses)
            for loss in losses[shift:] + losses[:shift]:
                hosts.clear_faults(2)
                if loss:
                    hosts.drop(2, probability=loss / 100, protocol="udp")
                    hosts.drop(2, probability=loss / 100, protocol="tcp")
                naks, retransmits = (counter(b, SystemCounter.NAK_MESSAGES_SENT),
                                     counter(a, SystemCounter.RETRANSMITS_SENT))
                passes = [counter(d, SystemCounter.NETWORK_PYTHON_PASSES) for d in (a, b)]
                overflows = udp_receive_buffer_drops(hosts[2])
                stream_id += 1
                rate = run_slipstream(a.directory, args.size, args.messages, True, stream_id,
                                      channel=uri, subscriber_directory=b.directory,
                                      backoff_s=None if args.first_program
                                      else PUBLISHER_BACKOFF_S,
                                      first_program=args.first_program)
                naks = counter(b, SystemCounter.NAK_MESSAGES_SENT) - naks
                retransmits = counter(a, SystemCounter.RETRANSMITS_SENT) - retransmits
                passes = [counter(d, SystemCounter.NETWORK_PYTHON_PASSES) - before
                          for d, before in zip((a, b), passes, strict=True)]
                overflows = udp_receive_buffer_drops(hosts[2]) - overflows
                goodput = rate * args.size / 1e6
                runs[loss].append(goodput)
                line = (f"round {round_ + 1} loss {loss:4.1f} %   slipstream {goodput:8.1f} MB/s "
                        f"({naks:,} NAKs, {retransmits:,} retransmits, "
                        f"{overflows:,} dropped by a full socket buffer, "
                        f"Python passes {passes[0]:,} sending, {passes[1]:,} receiving, "
                        f"whole: {'yes' if rate else 'NO'})")
                if round_ == 0 and not args.no_pyzmq:
                    zmq[loss] = run_zmq(hosts, args.size, args.messages) * args.size / 1e6
                    line += f"   pyzmq tcp {zmq[loss]:8.1f} MB/s"
                print(line, flush=True)
        hosts.clear_faults(2)
    lossless = statistics.median(runs[0.0]) if 0.0 in runs else 0.0
    for loss in losses:
        median = statistics.median(runs[loss])
        share = f"{100 * median / lossless:5.1f} % of lossless" if lossless else "-"
        zmq_share = (f"{100 * zmq[loss] / zmq[0.0]:5.1f} %" if zmq.get(0.0) else "-")
        peer = (f"   pyzmq tcp {zmq[loss]:8.1f} MB/s ({zmq_share})" if loss in zmq else "")
        print(f"loss {loss:4.1f} %   slipstream median {median:8.1f} MB/s ({share}; runs "
              f"{', '.join(f'{x:.0f}' for x in runs[loss])}){peer}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
