"""A Spark read task's range read on a host that does not hold the log, against a local read of
the same range, in the same run.

    .venv/bin/python -m bench.spark_replay [--messages N] [--size B] [--runs R] [--pin] [--cpu]

Two drivers on this machine stand for two hosts: the holder's (an IPC log of N messages of B
bytes, held by a subscription that never reads, and a ReplayServer at 127.0.0.2, in a process
of its own as a holder is) and the executor's (its replays arrive at 127.0.0.1, the address
the kernel sends to 127.0.0.2 from, the same port).  Each run reads the range once with the
executor side of the Spark reader (``read_range``), in this process: locally, mapping the log,
and replayed, through the executor's driver; the figure is rows/s of the whole call, Arrow
batches included, and the ratio replayed / local.  The best of ``--runs``, with the time its
first batch took (for a replay, its set-up: the request, the holder's answer and the streams
between the two drivers), and the median of the runs beside it.

``--pin`` gives each "host" a CPU of its own: the holder's process and driver on CPU 1, this
process (the reader) and the executor's driver on CPU 0 (every thread, as ``taskset`` would).
Without it the scheduler places them on the machine's cores as it likes.  ``--cpu`` prints
where a replayed read's CPU goes: per thread of the four processes (the median of the runs, ms
of CPU from ``/proc/<pid>/task/<tid>/schedstat``, and its page faults).

It also prints what writing the range's bytes costs in this machine's shared memory, into fresh
pages and again into the same pages, resident: a replay writes its range into two new logs
(the holder's replay publication and the executor's image), a local read into none.
"""

from __future__ import annotations

import argparse
import mmap
import multiprocessing
import os
import shutil
import statistics
import threading
import time
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

from bench.ipc_throughput import machine
from slipstream.client import Client, Image
from slipstream.client.counters import CountersFile
from slipstream.client.replay import ReplayServer
from slipstream.daemon.driver import MediaDriver
from slipstream.spark_bridge.reader import SlipstreamPartition, driver_instance, read_range

PORT = 40195
CONTROL = 4242
STREAM = 77
HOLDER_CPU, READER_CPU = 1, 0  # with --pin


def pin_process(pid: int, cpu: int) -> None:
    """Every thread of process ``pid`` on ``cpu`` (threads it starts later inherit it)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), {cpu})
        except ProcessLookupError:  # a thread that ended meanwhile
            pass


def thread_cpu(pids: dict[str, int]) -> dict[tuple[str, str], tuple[int, int]]:
    """CPU ns and minor page faults so far of every thread of ``pids`` (label -> pid), by
    (label, thread name with its id)."""
    seen: dict[tuple[str, str], tuple[int, int]] = {}
    for label, pid in pids.items():
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                    ns = int(f.read().split()[0])
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            name = stat[stat.index("(") + 1:stat.rindex(")")]
            faults = int(stat[stat.rindex(")") + 2:].split()[7])
            seen[(label, f"{name}/{tid}")] = (ns, faults)
    return seen


def page_cost(directory: Path, length: int, runs: int = 3) -> tuple[float, float]:
    """Seconds to write ``length`` bytes in 1 MiB blocks into a new file's fresh shared-memory
    pages in ``directory``, and to write them again into the same pages (resident, mapped):
    the medians of ``runs``."""
    block = b"\x01" * (1 << 20)
    fresh: list[float] = []
    resident: list[float] = []
    path = directory / f"page-cost-{uuid.uuid4().hex[:6]}"
    for _ in range(runs):
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, length)
            with mmap.mmap(fd, length) as mapped:
                for times in (fresh, resident):
                    began = time.perf_counter()
                    for offset in range(0, length, len(block)):
                        mapped[offset:offset + len(block)] = block[:length - offset]
                    times.append(time.perf_counter() - began)
        finally:
            os.close(fd)
            path.unlink()
    return statistics.median(fresh), statistics.median(resident)


def rows_of(partition: SlipstreamPartition) -> tuple[int, float, float]:
    """Rows read, seconds for all of them, and seconds to the first batch (a replay's set-up:
    its request, answer and streams)."""
    began = time.perf_counter()
    rows, first = 0, 0.0
    for batch in read_range(partition):
        if not rows:
            first = time.perf_counter() - began
        rows += batch.num_rows
    return rows, time.perf_counter() - began, first


def hold(connection: Any, holder_dir: str, messages: int, size: int, term: int,
         cpu: int | None) -> None:
    """The holder's process: publish the range into an IPC log, hold it with a subscription
    that never reads, send its description to ``connection`` and serve replays of it until
    ``connection`` says to stop."""
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    with Client.connect(holder_dir) as local, Client.connect(holder_dir) as server_client:
        publication = local.add_publication(f"aeron:ipc?term-length={term}", STREAM)
        keeper = local.add_subscription("aeron:ipc", STREAM)  # holds the range
        while not keeper.images:
            time.sleep(0.01)
        payload = bytes(size)
        for _ in range(messages):
            while publication.offer(payload) < 0:
                time.sleep(0.0001)
        image = keeper.images[0]
        logs = {image.session_id: Image.detached(image.log_path, 0)}
        server = ReplayServer(server_client, "127.0.0.2", PORT, CONTROL,
                              lambda _stream, session: logs.get(session))
        stop = threading.Event()
        thread = threading.Thread(target=server.run, args=(stop.is_set,), daemon=True)
        thread.start()
        connection.send({"session_id": image.session_id, "log_path": image.log_path,
                         "start": image.position, "end": image.available_position(),
                         "initial_term_id": image.initial_term_id,
                         "term_length": image.term_length})
        connection.recv()  # stop
        stop.set()
        thread.join(5)
        server.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=200_000,
                        help="at most what half a 128 MiB term holds (a receiver's longest)")
    parser.add_argument("--size", type=int, default=100)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--pin", action="store_true",
                        help="the holder's side on CPU 1, the reader's on CPU 0")
    parser.add_argument("--cpu", action="store_true",
                        help="print the CPU of each thread per replayed read")
    args = parser.parse_args()
    if args.pin and not {HOLDER_CPU, READER_CPU} <= os.sched_getaffinity(0):
        parser.error(f"--pin needs CPUs {READER_CPU} and {HOLDER_CPU} (this process may run on "
                     f"{sorted(os.sched_getaffinity(0))})")
    # Twice the data: an IPC publication may run half a term ahead of its slowest subscriber.
    term = 1 << max(16, (args.messages * (args.size + 32 + 31)).bit_length() + 1)
    directories = [Path("/dev/shm") / f"slipstream-bench-replay-{uuid.uuid4().hex[:6]}-{n}"
                   for n in ("holder", "executor")]
    if args.pin:
        os.sched_setaffinity(0, {READER_CPU})
    launches = [MediaDriver.launch(directory=d) for d in directories]
    spawn = multiprocessing.get_context("spawn")
    here, there = spawn.Pipe()
    holder: Any = None
    try:
        drivers = [launch.__enter__() for launch in launches]
        if args.pin:
            pin_process(drivers[0].pid, HOLDER_CPU)
            pin_process(drivers[1].pid, READER_CPU)
        holder_dir, executor_dir = (str(d) for d in directories)
        holder = spawn.Process(target=hold, args=(there, holder_dir, args.messages, args.size,
                                                  term, HOLDER_CPU if args.pin else None),
                               daemon=True)
        holder.start()
        while not here.poll(1.0):  # the holder publishes the range first
            if not holder.is_alive():
                raise SystemExit(f"the holder's process ended ({holder.exitcode}) before it "
                                 f"held the range")
        log = here.recv()
        counters = CountersFile(Path(holder_dir) / "counters.dat")
        holder_driver = driver_instance(counters)
        counters.close()
        pids = {"reader": os.getpid(), "holder": holder.pid, "holder's driver": drivers[0].pid,
                "reader's driver": drivers[1].pid}

        def partition(directory: str) -> SlipstreamPartition:
            return SlipstreamPartition(
                log["session_id"], STREAM, log["log_path"], log["start"], log["end"],
                directory, True, "holder", initial_term_id=log["initial_term_id"],
                term_length=log["term_length"], driver=holder_driver,
                holder=("127.0.0.2", PORT, CONTROL), replay_timeout_ms=30_000)

        local_runs: list[tuple[float, float]] = []
        replayed_runs: list[tuple[float, float]] = []
        cpu: dict[tuple[str, str], list[tuple[int, int]]] = defaultdict(list)
        for _ in range(args.runs):
            rows, seconds, first = rows_of(partition(holder_dir))
            assert rows == args.messages, rows
            local_runs.append((rows / seconds, first))
            before = thread_cpu(pids)
            rows, seconds, first = rows_of(partition(executor_dir))
            after = thread_cpu(pids)
            assert rows == args.messages, rows
            replayed_runs.append((rows / seconds, first))
            for thread, (ns, faults) in after.items():
                ns0, faults0 = before.get(thread, (0, 0))
                cpu[thread].append((ns - ns0, faults - faults0))
        here.send("stop")
        holder.join(10)
        log_bytes = log["end"] - log["start"]
        local_best, local_first = max(local_runs)
        replayed_best, replayed_first = max(replayed_runs)
        local_median = statistics.median(rate for rate, _ in local_runs)
        replayed_median = statistics.median(rate for rate, _ in replayed_runs)
        print(f"machine: {machine()}")
        print(f"load average (1 min) at the end: {os.getloadavg()[0]:.2f}")
        layout = "pinned: the holder's side on CPU 1, the reader's on CPU 0"
        print(f"layout: {layout if args.pin else 'unpinned'}")
        print(f"range: {args.messages} messages of {args.size} B ({log_bytes} bytes of log)")
        print(f"local read   : {local_best / 1e6:.3f} M rows/s (first batch after "
              f"{local_first * 1e3:.1f} ms; median {local_median / 1e6:.3f})")
        print(f"replayed read: {replayed_best / 1e6:.3f} M rows/s (first batch after "
              f"{replayed_first * 1e3:.1f} ms: the request, the answer and the streams; median "
              f"{replayed_median / 1e6:.3f})")
        print(f"ratio replayed / local: {replayed_best / local_best:.2f} (medians "
              f"{replayed_median / local_median:.2f})")
        fresh_s, resident_s = page_cost(directories[1], log_bytes)
        print(f"shared memory, the range's bytes written once: into fresh pages "
              f"{fresh_s * 1e3:.1f} ms, again into the same pages {resident_s * 1e3:.1f} ms "
              f"(a replay fills two new logs; the best local read took "
              f"{args.messages / local_best * 1e3:.1f} ms)")
        if args.cpu:
            print("CPU per replayed read (median of the runs; minor page faults):")
            for (label, name), samples in sorted(cpu.items()):
                ms = statistics.median(ns for ns, _ in samples) / 1e6
                faults = statistics.median(f for _, f in samples)
                if ms >= 0.5:
                    print(f"  {label:16} {name:24} {ms:7.1f} ms {faults:8.0f} faults")
    finally:
        if holder is not None and holder.is_alive():
            holder.kill()
        for launch in reversed(launches):
            launch.__exit__(None, None, None)
        here.close()
        there.close()
        for directory in directories:
            shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
