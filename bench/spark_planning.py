"""What planning a micro-batch costs a Spark read query over many streams.

    .venv/bin/python -m bench.spark_planning [--streams 1,10,100,300] [--batches N]

One driver (a process of its own, IPC terms of 64 KiB); one client publishes on K streams
(``aeron:ipc``, ids 1000 to 1000+K-1, one publication each); a streaming reader named
``streamId=1000-<1000+K-1>`` (the range syntax) plans batches as Spark's streaming-source
runner calls it, in this process: per batch ``latestOffset`` (Spark's admission-control
call, with everything available), ``reportLatestOffset`` (the query's progress),
``partitions`` and ``commit``.  Before each batch every stream gets one 100-byte message,
so every session has something to read: the worst case, one partition per stream.  The
reader's replay holder (the thread that serves read tasks on other hosts) runs when this
host has a non-loopback address, as it does in a query on a cluster.

Printed per K: the median and p99 of the planning time per batch (the four calls, ms), of
each call, and the median's ratio to the one-stream reader's in the same run; and the
planning thread's CPU time per batch (median and p99), which other processes competing for
the cores inflate less than the time.  No Spark
session: the calls are the reader's own, timed without Spark's RPC to its Python runner
(about a millisecond a call on top, the same at any K).

The load average is printed at the start and the end: the figures are only comparable to
each other within a run, and only meaningful when nothing else competes for the cores.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import time
import uuid
from pathlib import Path

from pyspark.sql.streaming.datasource import ReadAllAvailable

from bench.ipc_throughput import machine
from slipstream.client import Client
from slipstream.daemon.driver import MediaDriver
from slipstream.spark_bridge.options import describe_stream_ids, parse_options
from slipstream.spark_bridge.reader import SlipstreamStreamReader

FIRST_STREAM = 1000
PAYLOAD = b"x" * 100
CALLS = ("latestOffset", "reportLatestOffset", "partitions", "commit")


def host_address() -> str:
    """This host's address towards the network (no datagram is sent), else 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("198.51.100.1", 9))
            return str(probe.getsockname()[0])
        except OSError:
            return "127.0.0.1"


def free_udp_port(address: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.bind((address, 0))
        return int(probe.getsockname()[1])


def percentile(samples: list[float], fraction: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


def measure(streams: int, batches: int, warmup: int) -> dict[str, list[float]]:
    """Per call (and ``plan``, their sum), its time in each of ``batches`` batches, ms."""
    directory = Path("/dev/shm") / f"slipstream-bench-planning-{uuid.uuid4().hex[:8]}"
    stream_ids = list(range(FIRST_STREAM, FIRST_STREAM + streams))
    address = host_address()
    try:
        with MediaDriver.launch(directory=directory, ipc_term_buffer_length="64k",
                                counters_capacity=max(4096, 16 * streams + 256)), \
                Client.connect(directory) as client:
            publications = [client.add_publication("aeron:ipc", stream_id)
                            for stream_id in stream_ids]
            planner = SlipstreamStreamReader(parse_options({
                "streamId": describe_stream_ids(stream_ids), "directory": str(directory),
                "holderAddress": address, "replayPort": str(free_udp_port(address))}))
            try:
                start = planner.initialOffset()
                deadline = time.monotonic() + 30
                while len(planner._images()) < streams:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"{len(planner._images())} of {streams} images")
                    time.sleep(0.01)
                start = planner.latestOffset(start, ReadAllAvailable())  # sessions enter
                times: dict[str, list[float]] = {name: [] for name in (*CALLS, "plan", "cpu")}
                for batch in range(warmup + batches):
                    for publication in publications:
                        while publication.offer(PAYLOAD) < 0:
                            time.sleep(0.0001)
                    took = {}
                    cpu = time.thread_time()
                    began = time.perf_counter()
                    end = planner.latestOffset(start, ReadAllAvailable())
                    took["latestOffset"] = time.perf_counter() - began
                    began = time.perf_counter()
                    planner.reportLatestOffset()
                    took["reportLatestOffset"] = time.perf_counter() - began
                    began = time.perf_counter()
                    partitions = planner.partitions(start, end)
                    took["partitions"] = time.perf_counter() - began
                    began = time.perf_counter()
                    planner.commit(end)
                    took["commit"] = time.perf_counter() - began
                    cpu = time.thread_time() - cpu
                    if len(partitions) != streams:
                        raise RuntimeError(f"batch {batch}: {len(partitions)} partitions for "
                                           f"{streams} streams")
                    start = end
                    if batch >= warmup:
                        for name, seconds in took.items():
                            times[name].append(seconds * 1000)
                        times["plan"].append(sum(took.values()) * 1000)
                        times["cpu"].append(cpu * 1000)
                return times
            finally:
                planner.stop()
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", default="1,10,100,300",
                        help="comma-separated stream counts (the first is the ratios' base)")
    parser.add_argument("--batches", type=int, default=100, help="measured batches per count")
    parser.add_argument("--warmup", type=int, default=5, help="batches before measuring")
    args = parser.parse_args()
    counts = [int(part) for part in args.streams.split(",")]
    print(f"machine: {machine()}")
    print(f"load average at start: {os.getloadavg()}")
    print(f"replay holder at {host_address()} (127.0.0.1: none)")
    base: float | None = None
    cpu_base: float | None = None
    for streams in counts:
        times = measure(streams, args.batches, args.warmup)
        median = statistics.median(times["plan"])
        base = median if base is None else base
        calls = "  ".join(f"{name} {statistics.median(times[name]):.2f}/"
                          f"{percentile(times[name], 0.99):.2f}" for name in CALLS)
        cpu = statistics.median(times["cpu"])
        cpu_base = cpu if cpu_base is None else cpu_base
        print(f"{streams:>5} streams: plan per batch median {median:7.2f} ms, p99 "
              f"{percentile(times['plan'], 0.99):7.2f} ms, {median / base:6.1f}x the "
              f"{counts[0]}-stream median, {median / streams:.3f} ms a stream; CPU median "
              f"{cpu:6.2f} ms, p99 {percentile(times['cpu'], 0.99):6.2f} ms, "
              f"{cpu / cpu_base:6.1f}x   (median/p99 ms: {calls})", flush=True)
    print(f"load average at end: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
