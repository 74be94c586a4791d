"""Encrypted UDP throughput on loopback (docs/CHANNELS.md §7.8): the same stream between two
drivers with ``key=`` and without, the loops a first program writes (``offer`` / ``poll``,
the client's defaults, no pinning), against pyzmq PUB/SUB over tcp and the machine's
AES-256-GCM rate (bench/aes_gcm_rate.c: a C loop sealing the same bytes through OpenSSL's
EVP), all measured in the same run.  Prints messages/s, MB/s and the ratios.  The target is
stated against what the cipher allows on the same cores (at least 0.9x of that limit), which
bench.encrypted_cpu prints beside encrypted / plain.

    .venv/bin/python -m bench.encrypted_throughput [--sizes 1024,65536] [--bytes N]
        [--repeat R] [--set KEY=VALUE ...] [--latency-rate 10000] [--latency-seconds 5]

Then the round trip: bench/udp_latency.py's paced ping-pong (32-byte messages, pinger on one
driver, ponger on the other) encrypted and plain, R runs each in turns, their medians
compared (the target: p99 encrypted <= 1.1x plain); --latency-seconds 0 leaves it out.

Then the time to a first message: from a new publication on one driver (its subscription
waiting on the other) to the subscriber's first message, encrypted (its handshake included:
one round trip, then the next SETUP) and plain, unicast, multicast and dynamic
multi-destination-cast, N times each in turns (--first-messages N), their medians; 0 leaves
it out.

Each figure is the best of R runs (their medians follow), and a slipstream run counts only
if the stream arrived whole.  Where the time goes: the CPU each driver's network thread
(``ss-network``: the sender's seals, the receiver's opens) spent per message, plain and
encrypted (medians of the R runs), beside the C loop's time per seal.

Both streams use the same MTU: 64 KiB messages go with the largest MTU an encrypted datagram
leaves room for (65440: 65504 less the 48 bytes of the seal, aligned to 32).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from bench.ipc_throughput import (
    add_driver_settings,
    bench_parser,
    positive_int,
    print_header,
    run_slipstream,
    run_zmq,
    scratch_directory,
)
from bench.spy_cost import cpu_ns, network_task
from bench.udp_throughput import DEFAULT_SETTINGS, free_port, free_tcp_port
from slipstream.client.layout import SEALED_MTU_MAX

SOURCE = Path(__file__).with_name("aes_gcm_rate.c")
#: The largest MTU of an encrypted channel: used by both streams of large messages.
LARGE_MTU = SEALED_MTU_MAX


def aes_gcm_rate(directory: Path, size: int, count: int) -> float | None:
    """Messages/s of the C sealing loop (None: no C compiler or no libcrypto to link)."""
    rates = aes_gcm_rates(directory, size, count)
    return None if rates is None else rates[0]


def aes_gcm_rates(directory: Path, size: int, count: int) -> tuple[float, float] | None:
    """(seals/s, opens/s) of the C loops, a bare seal's and a bare open's EVP sequence for a
    message of ``size`` bytes (None: no C compiler or no libcrypto to link)."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None
    binary = directory / "aes_gcm_rate"
    if not binary.exists():
        built = subprocess.run([compiler, "-O2", "-o", str(binary), str(SOURCE), "-lcrypto"],
                               capture_output=True, text=True)
        if built.returncode != 0:
            print(f"# aes_gcm_rate.c did not build: {built.stderr.strip()}", flush=True)
            return None
    out = subprocess.run([str(binary), str(size), str(count)], check=True, capture_output=True,
                         text=True)
    seals, _, opens = (float(field) for field in out.stdout.split())
    return seals, opens


def key_directory(directory: Path) -> Path:
    """``directory``/keys, made, holding one random key (bench.key, key id 1) with the modes
    a driver's keys_dir requires: the drivers' ``keys_dir`` of an encrypted run."""
    keys = directory / "keys"
    keys.mkdir(mode=0o750)
    (keys / "bench.key").write_text(f"1 {os.urandom(32).hex()}\n")
    (keys / "bench.key").chmod(0o640)
    return keys


def main() -> int:
    parser = bench_parser(__doc__,
                          bytes=(1 << 30, "bytes per run (each size sends this many)"),
                          sizes=("1024,65536", "message sizes in bytes"),
                          repeat=(3, "runs per contender; best kept"))
    parser.add_argument("--latency-rate", type=positive_int, default=10_000,
                        help="round trips per second of the ping-pong")
    parser.add_argument("--latency-seconds", type=float, default=5.0,
                        help="measured seconds of each ping-pong (0: none)")
    parser.add_argument("--first-messages", type=int, default=5,
                        help="new streams timed to their first message, plain and encrypted "
                             "each (0: none)")
    add_driver_settings(parser)
    args = parser.parse_args()

    from slipstream.daemon.driver import MediaDriver

    settings = {**DEFAULT_SETTINGS, **dict(args.settings)}
    print_header("encrypted UDP throughput over loopback", "bench.encrypted_throughput",
                 settings, "first program's loops (offer/poll)")
    scratch = scratch_directory()
    directory = Path(scratch.name)
    keys = key_directory(directory)
    with MediaDriver.launch(directory=directory / "a", keys_dir=str(keys), **settings) as a, \
            MediaDriver.launch(directory=directory / "b", keys_dir=str(keys), **settings) as b:
        stream_id = 2000
        tasks = (network_task(a), network_task(b))
        for size in args.sizes:
            count = max(1, args.bytes // size)
            mtu = f"|mtu={LARGE_MTU}" if size > 16 * 1024 else ""
            rates: dict[str, list[float]] = {"plain": [], "encrypted": [], "zmq": []}
            # ns of CPU per message of the sending and the receiving driver's network thread
            network: dict[str, list[tuple[float, float]]] = {"plain": [], "encrypted": []}
            for _ in range(args.repeat):
                rates["zmq"].append(run_zmq(
                    directory, size, count, f"tcp://127.0.0.1:{free_tcp_port()}"))
                for name, key in (("plain", ""), ("encrypted", "|key=bench")):
                    stream_id += 1
                    uri = f"aeron:udp?endpoint=127.0.0.1:{free_port()}{mtu}{key}"
                    before = [cpu_ns(task) for task in tasks]
                    rates[name].append(run_slipstream(
                        a.directory, size, count, False, stream_id, channel=uri,
                        subscriber_directory=b.directory, first_program=True))
                    sender, receiver = (cpu_ns(task) - ns
                                        for task, ns in zip(tasks, before, strict=True))
                    if rates[name][-1] > 0:  # a run that did not arrive whole says nothing
                        network[name].append((sender / count, receiver / count))
            best = {name: max(runs) for name, runs in rates.items()}
            middle = {name: statistics.median(runs) for name, runs in rates.items()}
            crypto = aes_gcm_rate(directory, size, count)
            lines = [f"{size:>6} B  ({count:,} messages{mtu and ', mtu ' + str(LARGE_MTU)})"]
            rows = [*best.items(), *([("aes-gcm C loop", crypto)] if crypto else [])]
            for name, rate in rows:
                lines.append(f"    {name:<16} {rate / 1e6:8.3f} M msg/s "
                             f"{rate * size / 1e6:9.1f} MB/s")
            ratios = [f"encrypted / plain {best['encrypted'] / best['plain']:.2f}x"
                      if best["plain"] else "",
                      f"encrypted / pyzmq tcp {best['encrypted'] / best['zmq']:.2f}x"
                      if best["zmq"] else "",
                      f"encrypted / aes-gcm loop {best['encrypted'] / crypto:.2f}x"
                      if crypto else ""]
            lines.append("    " + "   ".join(r for r in ratios if r))
            if middle["plain"]:
                lines.append(f"    medians of {args.repeat}: plain {middle['plain'] / 1e6:.3f}, "
                             f"encrypted {middle['encrypted'] / 1e6:.3f} M msg/s, "
                             f"encrypted / plain {middle['encrypted'] / middle['plain']:.2f}x")
            lines.append("    " + network_line(network, crypto))
            print("\n".join(lines), flush=True)
        if args.first_messages > 0:
            first_messages(a.directory, b.directory, args.first_messages)
        if args.latency_seconds > 0:
            round_trips(a.directory, b.directory, args)
    scratch.cleanup()
    return 0


def network_line(network: dict[str, list[tuple[float, float]]], crypto: float | None) -> str:
    """Where the time goes: the network threads' CPU per message, plain and encrypted
    (medians), and what encryption adds to each, beside the C loop's time per seal."""
    if not all(network.values()):
        return "network thread CPU per message: no run of one kind arrived whole"
    sender = {name: statistics.median(s for s, _ in runs) for name, runs in network.items()}
    receiver = {name: statistics.median(r for _, r in runs) for name, runs in network.items()}
    return (f"network thread CPU per message (medians): sender {sender['plain']:,.0f} ns "
            f"plain, {sender['encrypted']:,.0f} encrypted "
            f"(+{sender['encrypted'] - sender['plain']:,.0f}); receiver "
            f"{receiver['plain']:,.0f} plain, {receiver['encrypted']:,.0f} encrypted "
            f"(+{receiver['encrypted'] - receiver['plain']:,.0f})"
            + (f"; the C loop {1e9 / crypto:,.0f} ns a seal" if crypto else ""))


def first_messages(publisher_directory: Path, subscriber_directory: Path, runs: int) -> None:
    """Seconds from add_publication to the first message read, plain and encrypted in turns,
    unicast, multicast (loopback) and dynamic multi-destination-cast: the subscription waits
    first, the publisher offers until a message goes."""
    import random
    import time

    from slipstream.client import Client

    def channels(key: str) -> dict[str, tuple[str, str]]:
        """(publication, subscription) URIs of each kind."""
        unicast = f"aeron:udp?endpoint=127.0.0.1:{free_port()}{key}"
        group = (f"aeron:udp?endpoint=224.0.1.{random.randrange(1, 250, 2)}:{free_port()}"
                 f"|interface=127.0.0.1{key}")
        control = f"127.0.0.1:{free_port()}"
        return {"unicast": (unicast, unicast), "multicast": (group, group),
                "dynamic mdc": (f"aeron:udp?control={control}|control-mode=dynamic{key}",
                                f"aeron:udp?endpoint=127.0.0.1:{free_port()}"
                                f"|control={control}{key}")}

    seconds: dict[tuple[str, str], list[float]] = {}
    with Client.connect(publisher_directory) as a, Client.connect(subscriber_directory) as b:
        stream_id = 3000
        for _ in range(runs):
            for name, key in (("plain", ""), ("encrypted", "|key=bench")):
                for kind, (publish, subscribe) in channels(key).items():
                    stream_id += 1
                    subscription = b.add_subscription(subscribe, stream_id)
                    got: list[bytes] = []
                    take = got.append
                    start = time.monotonic()
                    publication = a.add_publication(publish, stream_id)
                    while not got and time.monotonic() < start + 10:
                        publication.offer(b"first")
                        subscription.poll(lambda data, header, take=take: take(bytes(data)), 1)
                    if got:
                        seconds.setdefault((kind, name), []).append(time.monotonic() - start)
                    publication.close()
                    subscription.close()
    print(f"time to a first message, new stream (medians of {runs}): " + "; ".join(
        f"{kind} {name} {statistics.median(s) * 1e3:.1f} ms"
        for (kind, name), s in sorted(seconds.items())), flush=True)


def round_trips(ping_directory: Path, pong_directory: Path, args: argparse.Namespace) -> None:
    """The paced ping-pong between the two drivers, plain and encrypted in turns."""
    from bench.ipc_latency import WARMUP, _run, _ss_pinger, _ss_ponger, percentile_line

    rounds = WARMUP + int(args.latency_rate * args.latency_seconds)
    runs: dict[str, list] = {"plain": [], "encrypted": []}
    for _ in range(args.repeat):
        for name, key in (("plain", ""), ("encrypted", "|key=bench")):
            ping = f"aeron:udp?endpoint=127.0.0.1:{free_port()}{key}"
            pong = f"aeron:udp?endpoint=127.0.0.1:{free_port()}{key}"
            idle = multiprocessing.get_context("spawn").Value("d", -1.0)  # not measured
            runs[name].append(_run(_ss_pinger, _ss_ponger,
                                   (str(ping_directory), rounds, args.latency_rate),
                                   (str(pong_directory), rounds, idle), (ping, pong)))
    print(f"# round trips at {args.latency_rate:,}/s, 32 B, {args.latency_seconds:g} s each",
          flush=True)
    for name, histograms in runs.items():
        for histogram in histograms:
            print(percentile_line(f"{name} aeron:udp", histogram))

    def median(name: str, percentile: float) -> float:
        return statistics.median(h.get_value_at_percentile(percentile) for h in runs[name])

    print("    encrypted / plain (medians of " + str(args.repeat) + " runs): " + ", ".join(
        f"p{p:g} {median('encrypted', p) / median('plain', p):.2f}x" for p in (50, 99, 99.9)),
        flush=True)


if __name__ == "__main__":
    sys.exit(main())
