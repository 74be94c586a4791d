"""Spark bridge throughput against Spark's own rate source, in the same run.

    .venv/bin/python -m bench.spark_throughput [--rows N] [--cores C]

* write: ``spark.range(N)`` as 100-byte binary values, written with ``format("slipstream")``
  (a client drains the stream meanwhile) and, as the peer, with ``format("noop")``;
  rows/s of the whole job, and per executor core.
* read: N messages of 100 B published beforehand, read by one ``availableNow`` micro-batch
  into a noop sink; the peer is the ``rate-micro-batch`` source with ``rowsPerBatch=N`` into
  a noop sink.  Micro-batch overhead is excluded by subtracting the trigger time of a one-row
  batch of the same source from that of the N-row batch (``triggerExecution`` in the
  query progress).

A run takes about two minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

from bench.ipc_throughput import machine
from slipstream.client import ADMIN_ACTION, Client
from slipstream.daemon.driver import MediaDriver
from slipstream.spark_bridge import session

PAYLOAD = 100


class Drain(threading.Thread):
    """A consumer counting messages with poll_batch."""

    def __init__(self, subscription) -> None:
        super().__init__(daemon=True)
        self.subscription = subscription
        self.count = 0
        self.running = True
        self.start()

    def run(self) -> None:
        while self.running:
            batch = self.subscription.poll_batch(4096)
            if batch is None:
                self.subscription.wait_for_data(1_000_000)
            else:
                self.count += len(batch)

    def stop(self, expected: int, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while self.count < expected and time.monotonic() < deadline:
            time.sleep(0.01)
        self.running = False
        self.join()


def bench_write(spark, directory: Path, client: Client, rows: int, cores: int) -> dict[str, float]:
    frame = spark.range(rows, numPartitions=cores).selectExpr(
        f"cast(rpad(cast(id as string), {PAYLOAD}, 'x') as binary) as value")
    results = {}
    stream_id = 7000  # one long-lived stream: the warm-up maps its log in every worker
    for _attempt in ("warm-up", "measured"):
        # The consumer parks instead of spinning: on 2 cores a spinning reader would take
        # CPU from the executors it is measuring.
        quiet = Client.connect(directory, idle_spin_ns=0)
        drain = Drain(quiet.add_subscription("aeron:ipc", stream_id))
        started = time.perf_counter()
        (frame.write.format("slipstream").option("directory", str(directory))
         .option("streamId", str(stream_id)).mode("append").save())
        elapsed = time.perf_counter() - started
        drain.stop(rows)
        quiet.close()
        assert drain.count == rows, (drain.count, rows)
        results["slipstream"] = rows / elapsed
        started = time.perf_counter()
        frame.write.format("noop").mode("overwrite").save()
        results["noop"] = rows / (time.perf_counter() - started)
    return results


def _trigger_ms(query) -> tuple[int, float]:
    progress = [p for p in query.recentProgress if p["numInputRows"]]
    last = progress[-1]
    return last["numInputRows"], float(last["durationMs"]["triggerExecution"])


def _slipstream_batch(spark, directory: Path, client: Client, stream_id: int, rows: int,
                      checkpoint: str) -> tuple[int, float]:
    publication = client.add_publication("aeron:ipc", stream_id)
    hold = client.add_subscription("aeron:ipc", stream_id)  # keeps the messages in the log
    while not publication.is_connected:
        time.sleep(0.01)
    message = b"m" * PAYLOAD
    sent = 0
    while sent < rows:
        result = publication.offer(message)
        if result > 0:
            sent += 1
        elif result != ADMIN_ACTION:
            raise RuntimeError(f"publishing {rows} messages needs a larger term ({result})")
    query = (spark.readStream.format("slipstream").option("directory", str(directory))
             .option("streamId", str(stream_id)).option("startingPosition", "earliest").load()
             .writeStream.format("noop").option("checkpointLocation", checkpoint)
             .trigger(availableNow=True).start())
    query.awaitTermination(300)
    count, ms = _trigger_ms(query)
    assert count == rows, (count, rows)
    hold.close()
    publication.close()
    return count, ms


def _rate_batch(spark, rows: int, checkpoint: str) -> tuple[int, float]:
    query = (spark.readStream.format("rate-micro-batch").option("rowsPerBatch", str(rows))
             .load().writeStream.format("noop").option("checkpointLocation", checkpoint)
             .trigger(processingTime="0 seconds").start())
    deadline = time.monotonic() + 120
    while len([p for p in query.recentProgress if p["numInputRows"]]) < 3:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    query.stop()
    return _trigger_ms(query)


def bench_read(spark, directory: Path, client: Client, rows: int, scratch: str
               ) -> dict[str, tuple[float, float]]:
    """{source: (rows/s with the micro-batch overhead, rows/s without it)}."""
    cp = iter(f"{scratch}/cp{i}" for i in range(100))
    _slipstream_batch(spark, directory, client, 8000, 10, next(cp))  # warm-up
    _, small = _slipstream_batch(spark, directory, client, 8001, 1, next(cp))
    count, big = _slipstream_batch(spark, directory, client, 8002, rows, next(cp))
    results = {"slipstream": (count / big * 1000, count / max(big - small, 1) * 1000)}
    _, small = _rate_batch(spark, 1, next(cp))
    count, big = _rate_batch(spark, rows, next(cp))
    results["rate"] = (count / big * 1000, count / max(big - small, 1) * 1000)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000, help="rows written")
    parser.add_argument("--read-rows", type=int, default=600_000, help="rows read in one batch")
    parser.add_argument("--arrow-batch", type=int, default=10_000,
                        help="spark.sql.execution.arrow.maxRecordsPerBatch (Spark's default)")
    parser.add_argument("--cores", type=int, default=2, help="local[N] executor cores")
    args = parser.parse_args()
    command = ["python", "-m", "bench.spark_throughput", *sys.argv[1:]]
    print(f"command: {' '.join(command)}")
    print(f"machine: {machine()}")
    directory = Path("/dev/shm") / f"slipstream-bench-{uuid.uuid4().hex[:8]}"
    scratch = tempfile.mkdtemp(prefix="slipstream-bench-")
    arrow_batch = str(args.arrow_batch)
    spark = session(master=f"local[{args.cores}]", app_name="slipstream-bench",
                    config={"spark.sql.execution.arrow.maxRecordsPerBatch": arrow_batch})
    import pyspark

    print(f"spark: pyspark {pyspark.__version__}, local[{args.cores}], {PAYLOAD}-byte values, "
          f"arrow batches of {arrow_batch} rows")
    try:
        # 256 MiB terms: one read batch of --read-rows messages fits in the window.
        with MediaDriver.launch(directory=directory, ipc_term_buffer_length="256m"), \
                Client.connect(directory) as client:
            write = bench_write(spark, directory, client, args.rows, args.cores)
            read = bench_read(spark, directory, client, args.read_rows, scratch)
    finally:
        spark.stop()
        shutil.rmtree(directory, ignore_errors=True)
        shutil.rmtree(scratch, ignore_errors=True)
    per_core = write["slipstream"] / args.cores
    print(f"\nwrite {args.rows:,} rows ({args.cores} executor cores):")
    print(f"  slipstream  {write['slipstream']:>12,.0f} rows/s  = {per_core:,.0f} rows/s per "
          f"executor core (target >= 200,000)")
    print(f"  noop (peer) {write['noop']:>12,.0f} rows/s  ratio slipstream/noop "
          f"{write['slipstream'] / write['noop']:.2f}")
    print(f"\nread one micro-batch of {args.read_rows:,} rows into a noop sink "
          f"(with / without the micro-batch overhead):")
    s_with, s_without = read["slipstream"]
    r_with, r_without = read["rate"]
    print(f"  slipstream       {s_with:>12,.0f} / {s_without:>12,.0f} rows/s (target >= 200,000"
          f" without)")
    print(f"  rate-micro-batch {r_with:>12,.0f} / {r_without:>12,.0f} rows/s  ratio "
          f"{s_without / r_without:.2f}")


if __name__ == "__main__":
    main()
