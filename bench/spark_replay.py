"""A Spark read task's range read on a host that does not hold the log, against a local read of
the same range, in the same run.

    .venv/bin/python -m bench.spark_replay [--messages N] [--size B] [--runs R]

Two drivers on this machine stand for two hosts: the holder's (an IPC log of N messages of B
bytes, held by a subscription that never reads, and a ReplayServer on a thread at 127.0.0.2)
and the executor's (its replays arrive at 127.0.0.1, the address the kernel sends to
127.0.0.2 from, the same port).  Each run reads the
range once with the executor side of the Spark reader (``read_range``): locally, mapping the
log, and replayed, through the executor's driver; the figure is rows/s of the whole call,
Arrow batches included, and the ratio replayed / local.  The best of ``--runs``, with the time
its first batch took (for a replay, its set-up: the request, the holder's answer and the
streams between the two drivers).
"""

from __future__ import annotations

import argparse
import shutil
import threading
import time
import uuid
from pathlib import Path

from bench.ipc_throughput import machine
from slipstream.client import Client, Image
from slipstream.client.counters import CountersFile
from slipstream.client.replay import ReplayServer
from slipstream.daemon.driver import MediaDriver
from slipstream.spark_bridge.reader import SlipstreamPartition, driver_instance, read_range

PORT = 40195
CONTROL = 4242
STREAM = 77


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=200_000,
                        help="at most what half a 128 MiB term holds (a receiver's longest)")
    parser.add_argument("--size", type=int, default=100)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    # Twice the data: an IPC publication may run half a term ahead of its slowest subscriber.
    term = 1 << max(16, (args.messages * (args.size + 32 + 31)).bit_length() + 1)
    directories = [Path("/dev/shm") / f"slipstream-bench-replay-{uuid.uuid4().hex[:6]}-{n}"
                   for n in ("holder", "executor")]
    drivers = [MediaDriver.launch(directory=d) for d in directories]
    try:
        for driver in drivers:
            driver.__enter__()
        holder_dir, executor_dir = (str(d) for d in directories)
        with Client.connect(holder_dir) as local, Client.connect(holder_dir) as server_client:
            publication = local.add_publication(f"aeron:ipc?term-length={term}", STREAM)
            keeper = local.add_subscription("aeron:ipc", STREAM)  # holds the range
            while not keeper.images:
                time.sleep(0.01)
            payload = bytes(args.size)
            for _ in range(args.messages):
                while publication.offer(payload) < 0:
                    time.sleep(0.0001)
            image = keeper.images[0]
            end = image.available_position()
            logs = {image.session_id: Image.detached(image.log_path, 0)}
            server = ReplayServer(server_client, "127.0.0.2", PORT, CONTROL,
                                  lambda _stream, session: logs.get(session))
            stop = threading.Event()
            thread = threading.Thread(target=server.run, args=(stop.is_set,), daemon=True)
            thread.start()
            counters = CountersFile(Path(holder_dir) / "counters.dat")
            holder_driver = driver_instance(counters)
            counters.close()

            def partition(directory: str) -> SlipstreamPartition:
                return SlipstreamPartition(
                    image.session_id, STREAM, image.log_path, image.position, end, directory,
                    True, "holder", initial_term_id=image.initial_term_id,
                    term_length=image.term_length, driver=holder_driver,
                    holder=("127.0.0.2", PORT, CONTROL), replay_timeout_ms=30_000)

            try:
                local_best = replayed_best = 0.0
                local_first = replayed_first = 0.0
                for _ in range(args.runs):
                    rows, seconds, first = rows_of(partition(holder_dir))
                    assert rows == args.messages, rows
                    if rows / seconds > local_best:
                        local_best, local_first = rows / seconds, first
                    rows, seconds, first = rows_of(partition(executor_dir))
                    assert rows == args.messages, rows
                    if rows / seconds > replayed_best:
                        replayed_best, replayed_first = rows / seconds, first
            finally:
                stop.set()
                thread.join(5)
                server.close()
        print(f"machine: {machine()}")
        print(f"range: {args.messages} messages of {args.size} B ({end} bytes of log)")
        print(f"local read   : {local_best / 1e6:.3f} M rows/s (first batch after "
              f"{local_first * 1e3:.1f} ms)")
        print(f"replayed read: {replayed_best / 1e6:.3f} M rows/s (first batch after "
              f"{replayed_first * 1e3:.1f} ms: the request, the answer and the streams)")
        print(f"ratio replayed / local: {replayed_best / local_best:.2f}")
    finally:
        for driver in reversed(drivers):
            driver.__exit__(None, None, None)
        for directory in directories:
            shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
