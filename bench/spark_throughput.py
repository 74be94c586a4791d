"""Spark bridge throughput against Spark's own sinks and sources and against Python data
sources that do no work, in the same run.

    .venv/bin/python -m bench.spark_throughput [--rows N] [--read-rows N] [--cores C]
                                               [--rounds R]

Run it from the repository root: the two Python peers below are classes of this module, and
Spark's Python workers import them as ``bench.spark_throughput`` (they start in the driver's
working directory, which is on their ``sys.path``, as ``slipstream`` is through the editable
install; :func:`register_peers` registers the module's own classes, not those of
``__main__``, so that they are pickled by name).

* write: ``spark.range(N)`` as 100-byte binary values, written with ``format("slipstream")``
  (a client drains the stream meanwhile), and as the peers with ``format("bench_discard")``
  (:class:`DiscardArrowWriter`: a Python ``DataSourceArrowWriter``, the API the slipstream
  writer uses, that iterates over its Arrow batches and drops them, the ceiling of a Python
  sink) and with Spark's ``format("noop")``; rows/s of the whole job (the second of two runs),
  and per executor core.  Printed: slipstream / discard (target >= 0.8) and slipstream / noop.
* read: N messages of 100 B published beforehand, read by one ``availableNow`` micro-batch
  into a noop sink.  Peers: ``format("bench_arrow_memory")`` (:class:`ArrowMemoryStreamReader`:
  a Python ``DataSourceStreamReader``, the API the slipstream reader uses, with the same
  schema and rows, one partition and Arrow record batches of the size slipstream's reader
  yields; its worker yields batches built in memory before the measurement, the ceiling of a
  Python source), read the same way; and the ``rate-micro-batch`` source with
  ``rowsPerBatch=N`` into a noop sink.  Micro-batch overhead is excluded by subtracting the
  trigger time of a one-row batch of the same source from that of the N-row batch
  (``triggerExecution`` in the query progress).  Printed: slipstream / in-memory Arrow source
  without the overhead (target >= 0.6), and slipstream / rate-micro-batch.
  Before either Python source is measured, one N-row batch of each is read as a warm-up: the
  first N-row reads of a session run several times slower whichever Python source they read
  (the JVM side warms up), and a 10-row warm-up does not cover that.  The ready batches live
  in the Python worker that built them (the in-memory warm-up): a measured query whose task
  ran in another worker (it reports so, and built them while timed) is discarded and run
  again; the output says which query counted.  A figure without the overhead is the
  difference of two single triggers, whose one-row part alone varies by 200-300 ms between
  queries on 2 busy cores: ``--rounds R`` (default 3) adds R rounds alternating the two
  Python sources, a one-row and an N-row trigger each, and prints the medians beside the
  single samples.

The load average is printed at the start and the end: the ratios are only meaningful when
nothing else competes for the cores.  A run takes two to three minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path

from pyspark.sql.datasource import (
    DataSource,
    DataSourceArrowWriter,
    DataSourceStreamReader,
    InputPartition,
    WriterCommitMessage,
)
from pyspark.sql.streaming.datasource import SupportsTriggerAvailableNow

from bench.ipc_throughput import machine
from slipstream.client import ADMIN_ACTION, Client
from slipstream.client.image import _MAX_SCAN
from slipstream.client.layout import FRAME_ALIGNMENT, HEADER_LENGTH
from slipstream.daemon.driver import MediaDriver
from slipstream.spark_bridge import SCHEMA, session
from slipstream.spark_bridge.read_task import _ROWS_PER_BATCH

PAYLOAD = 100
FRAME = (HEADER_LENGTH + PAYLOAD + FRAME_ALIGNMENT - 1) & -FRAME_ALIGNMENT  # position step
# The rows of one record batch of the slipstream reader: it asks poll_gathered for
# _ROWS_PER_BATCH messages, which copies at most _MAX_SCAN per call.
READ_BATCH = min(_ROWS_PER_BATCH, _MAX_SCAN)


# -- the Python peers (imported by Spark's workers as bench.spark_throughput) --------------------

_READY: dict[tuple[int, int, int], list] = {}
"""Per Python worker process: the record batches of (start, end, rows per batch), built once."""


def ready_batches(start: int, end: int, batch_rows: int) -> list:
    """Rows [start, end) as slipstream's reader makes them (``_arrow_batch``) for N messages of
    PAYLOAD bytes from position 0, ``batch_rows`` to a record batch: the same schema, values
    and positions, the columns built the same way (session and stream ids are stand-ins)."""
    import numpy as np
    import pyarrow as pa

    from slipstream.spark_bridge.read_task import _schema

    schema = _schema()
    now = int(time.time_ns() // 1000)
    batches = []
    for low in range(start, end, batch_rows):
        n = min(batch_rows, end - low)
        offsets = np.arange(0, (n + 1) * PAYLOAD, PAYLOAD, dtype=np.int32)
        values = pa.Array.from_buffers(pa.binary(), n, [None, pa.py_buffer(offsets),
                                                        pa.py_buffer(b"m" * (n * PAYLOAD))])
        columns = [
            values,
            pa.array(np.full(n, 1, dtype=np.int32)),
            pa.array(np.full(n, 8002, dtype=np.int32)),
            pa.array(np.arange(low + 1, low + n + 1, dtype=np.int64) * FRAME),
            pa.array(np.full(n, now, dtype=np.int64)).view(pa.timestamp("us", tz="UTC")),
        ]
        batches.append(pa.RecordBatch.from_arrays(columns, schema=schema))
    return batches


class ArrowMemoryStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Offsets ``{"row": n}``; every batch up to ``rows`` rows is one partition, read from
    :data:`_READY`.  With the option ``report`` (a file path), ``read`` writes there whether
    its worker had the batches ready (``hit``) or built them (``miss``)."""

    def __init__(self, options: Mapping[str, str]) -> None:
        self.rows = int(options["rows"])
        self.batch_rows = int(options["batchRows"])
        self.report = options.get("report")

    def initialOffset(self) -> dict:
        return {"row": 0}

    def prepareForTriggerAvailableNow(self) -> None:
        """The rows are all there from the start: nothing to record."""

    def latestOffset(self, start: dict, limit: object) -> dict:
        return {"row": self.rows}

    def partitions(self, start: dict, end: dict) -> list[InputPartition]:
        if end["row"] <= start["row"]:
            return []
        return [InputPartition((start["row"], end["row"]))]

    def read(self, partition: InputPartition) -> Iterator[object]:  # type: ignore[override]
        key = (*partition.value, self.batch_rows)
        batches = _READY.get(key)
        if self.report:
            Path(self.report).write_text("miss" if batches is None else "hit")
        if batches is None:
            batches = _READY[key] = ready_batches(*key)
        return iter(batches)

    def commit(self, end: dict) -> None:
        """Nothing to release."""


@dataclasses.dataclass
class Discarded(WriterCommitMessage):
    """What one task dropped."""

    rows: int


class DiscardArrowWriter(DataSourceArrowWriter):
    """Takes every Arrow batch of its task and drops it; the job fails unless the tasks saw
    ``expected`` rows in all (when it is not 0)."""

    def __init__(self, expected: int) -> None:
        self.expected = expected

    def write(self, iterator: Iterator[object]) -> Discarded:  # type: ignore[override]
        return Discarded(sum(batch.num_rows for batch in iterator))  # type: ignore[attr-defined]

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        rows = sum(m.rows for m in messages if isinstance(m, Discarded))
        if self.expected and rows != self.expected:
            raise RuntimeError(f"discard writer: {rows} rows written, {self.expected} expected")

    def abort(self, messages: list[WriterCommitMessage | None]) -> None:
        """Nothing to undo."""


class ArrowMemorySource(DataSource):
    """``format("bench_arrow_memory")``: options ``rows``, ``batchRows`` and ``report``
    (:class:`ArrowMemoryStreamReader`)."""

    @classmethod
    def name(cls) -> str:
        return "bench_arrow_memory"

    def schema(self) -> str:
        return SCHEMA

    def streamReader(self, schema: object) -> ArrowMemoryStreamReader:  # type: ignore[override]
        return ArrowMemoryStreamReader(self.options)


class DiscardSink(DataSource):
    """``format("bench_discard")``, option ``rows`` (the rows expected, checked at commit)."""

    @classmethod
    def name(cls) -> str:
        return "bench_discard"

    def writer(self, schema: object, overwrite: bool) -> DiscardArrowWriter:  # type: ignore[override]
        return DiscardArrowWriter(int(self.options.get("rows", "0")))


def register_peers(spark) -> None:
    """Register the peers as classes of ``bench.spark_throughput``: run with ``-m``, this file
    is ``__main__``, whose classes cloudpickle would copy by value into every task (and with
    them a fresh :data:`_READY`), instead of importing them by name in the workers."""
    import importlib

    module = importlib.import_module("bench.spark_throughput")
    spark.dataSource.register(module.ArrowMemorySource)
    spark.dataSource.register(module.DiscardSink)


# -- the benchmark ----------------------------------------------------------------------------


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
        frame.write.format("bench_discard").option("rows", str(rows)).mode("append").save()
        results["discard"] = rows / (time.perf_counter() - started)
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
             .option("streamId", str(stream_id)).option("startingOffsets", "earliest").load()
             .writeStream.format("noop").option("checkpointLocation", checkpoint)
             .trigger(availableNow=True).start())
    query.awaitTermination(300)
    count, ms = _trigger_ms(query)
    assert count == rows, (count, rows)
    hold.close()
    publication.close()
    return count, ms


def _memory_batch(spark, rows: int, checkpoint: str, batch_rows: int = READ_BATCH
                  ) -> tuple[int, float, bool]:
    """(rows, trigger ms, whether the task's worker had the batches ready)."""
    report = f"{checkpoint}.report"
    query = (spark.readStream.format("bench_arrow_memory").option("rows", str(rows))
             .option("batchRows", str(batch_rows)).option("report", report).load()
             .writeStream.format("noop").option("checkpointLocation", checkpoint)
             .trigger(availableNow=True).start())
    query.awaitTermination(300)
    count, ms = _trigger_ms(query)
    assert count == rows, (count, rows)
    return count, ms, Path(report).read_text() == "hit"


def _memory_ready_batch(spark, rows: int, checkpoints: Iterator[str], attempts: int = 6
                        ) -> tuple[int, float, int]:
    """:func:`_memory_batch` until its task ran in a worker that had the batches ready (the
    others built them while timed); returns (rows, trigger ms, queries run)."""
    for attempt in range(1, attempts + 1):
        count, ms, ready = _memory_batch(spark, rows, next(checkpoints))
        if ready:
            return count, ms, attempt
    raise RuntimeError(f"in {attempts} queries no task of bench_arrow_memory ran in a Python "
                       f"worker that had its batches ready (workers not reused?)")


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


def bench_read(spark, directory: Path, client: Client, rows: int, scratch: str,
               rounds: int = 0) -> dict[str, tuple[float, ...]]:
    """{source: (rows/s with the micro-batch overhead, rows/s without it)}; the in-memory
    source's entry adds the queries its N-row measurement took (see _memory_ready_batch)."""
    cp = iter(f"{scratch}/cp{i}" for i in itertools.count())
    # Warm-up, N rows of each Python source: the first N-row reads of a session are several
    # times slower than the later ones whichever source they read (the JVM side of a Python
    # source's read warms up), so a source measured first would pay for it.  The in-memory
    # warm-up also builds its batches in one worker.
    _memory_batch(spark, rows, next(cp))
    _slipstream_batch(spark, directory, client, 8000, rows, next(cp))
    _, small = _slipstream_batch(spark, directory, client, 8001, 1, next(cp))
    count, big = _slipstream_batch(spark, directory, client, 8002, rows, next(cp))
    results: dict[str, tuple[float, ...]] = {
        "slipstream": (count / big * 1000, count / max(big - small, 1) * 1000)}
    _, small, _ = _memory_ready_batch(spark, 1, cp)
    count, big, queries = _memory_ready_batch(spark, rows, cp)
    results["memory"] = (count / big * 1000, count / max(big - small, 1) * 1000, queries)
    _, small = _rate_batch(spark, 1, next(cp))
    count, big = _rate_batch(spark, rows, next(cp))
    results["rate"] = (count / big * 1000, count / max(big - small, 1) * 1000)
    # The figures above rest on one 1-row and one N-row trigger each: on these 2 vCPUs a
    # 1-row trigger alone moves by 200-500 ms from query to query, as much as the N-row
    # read it is subtracted from.  Rounds alternating the two sources give medians as well.
    triggers: dict[str, tuple[list[float], list[float]]] = {"slipstream": ([], []),
                                                            "memory": ([], [])}
    stream_id = 8100
    for round_ in range(rounds):
        for source in ("slipstream", "memory") if round_ % 2 == 0 else ("memory", "slipstream"):
            if source == "slipstream":
                small = _slipstream_batch(spark, directory, client, stream_id, 1, next(cp))[1]
                big = _slipstream_batch(spark, directory, client, stream_id + 1, rows,
                                        next(cp))[1]
                stream_id += 2
            else:
                small = _memory_ready_batch(spark, 1, cp)[1]
                big = _memory_ready_batch(spark, rows, cp)[1]
            triggers[source][0].append(small)
            triggers[source][1].append(big)
    for source, (smalls, bigs) in triggers.items():
        if smalls:
            small, big = statistics.median(smalls), statistics.median(bigs)
            results[f"{source} median"] = (rows / big * 1000, rows / max(big - small, 1) * 1000)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000, help="rows written")
    parser.add_argument("--read-rows", type=int, default=600_000, help="rows read in one batch")
    parser.add_argument("--arrow-batch", type=int, default=10_000,
                        help="spark.sql.execution.arrow.maxRecordsPerBatch (Spark's default)")
    parser.add_argument("--cores", type=int, default=2, help="local[N] executor cores")
    parser.add_argument("--rounds", type=int, default=3,
                        help="read rounds alternating the two Python sources, for medians")
    args = parser.parse_args()
    command = ["python", "-m", "bench.spark_throughput", *sys.argv[1:]]
    print(f"command: {' '.join(command)}")
    print(f"machine: {machine()}")
    print("load average at start: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))
    directory = Path("/dev/shm") / f"slipstream-bench-{uuid.uuid4().hex[:8]}"
    scratch = tempfile.mkdtemp(prefix="slipstream-bench-")
    arrow_batch = str(args.arrow_batch)
    spark = session(master=f"local[{args.cores}]", app_name="slipstream-bench",
                    config={"spark.sql.execution.arrow.maxRecordsPerBatch": arrow_batch})
    register_peers(spark)
    import pyspark

    print(f"spark: pyspark {pyspark.__version__}, local[{args.cores}], {PAYLOAD}-byte values, "
          f"arrow batches of {arrow_batch} rows")
    try:
        # 256 MiB terms: one read batch of --read-rows messages fits in the window.
        with MediaDriver.launch(directory=directory, ipc_term_buffer_length="256m"), \
                Client.connect(directory) as client:
            write = bench_write(spark, directory, client, args.rows, args.cores)
            read = bench_read(spark, directory, client, args.read_rows, scratch, args.rounds)
    finally:
        spark.stop()
        shutil.rmtree(directory, ignore_errors=True)
        shutil.rmtree(scratch, ignore_errors=True)
    print("load average at end:   {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))
    per_core = write["slipstream"] / args.cores
    print(f"\nwrite {args.rows:,} rows ({args.cores} executor cores):")
    print(f"  slipstream           {write['slipstream']:>12,.0f} rows/s  = {per_core:,.0f} rows/s "
          f"per executor core (target >= 200,000)")
    print(f"  discard Arrow writer {write['discard']:>12,.0f} rows/s  ratio slipstream/discard "
          f"{write['slipstream'] / write['discard']:.2f} (target >= 0.8)")
    print(f"  noop                 {write['noop']:>12,.0f} rows/s  ratio slipstream/noop "
          f"{write['slipstream'] / write['noop']:.2f}")
    print(f"\nread one micro-batch of {args.read_rows:,} rows into a noop sink "
          f"(with / without the micro-batch overhead):")
    s_with, s_without = read["slipstream"]
    m_with, m_without, queries = read["memory"]
    r_with, r_without = read["rate"]
    print(f"  slipstream          {s_with:>12,.0f} / {s_without:>12,.0f} rows/s (target >= "
          f"200,000 without)")
    print(f"  in-memory Arrow     {m_with:>12,.0f} / {m_without:>12,.0f} rows/s  ratio "
          f"slipstream/in-memory {s_without / m_without:.2f} without (target >= 0.6), "
          f"{s_with / m_with:.2f} with")
    print(f"    (its N-row figure: query {queries} of the N-row ones, the first whose worker "
          f"had the batches ready)")
    print(f"  rate-micro-batch    {r_with:>12,.0f} / {r_without:>12,.0f} rows/s  ratio "
          f"slipstream/rate {s_without / r_without:.2f}")
    if "slipstream median" in read:
        s_with, s_without = read["slipstream median"]
        m_with, m_without = read["memory median"]
        print(f"  medians of {args.rounds} alternating rounds (1-row and N-row trigger each):")
        print(f"  slipstream          {s_with:>12,.0f} / {s_without:>12,.0f} rows/s")
        print(f"  in-memory Arrow     {m_with:>12,.0f} / {m_without:>12,.0f} rows/s  ratio "
              f"slipstream/in-memory {s_without / m_without:.2f} without (target >= 0.6), "
              f"{s_with / m_with:.2f} with")


if __name__ == "__main__":
    main()
