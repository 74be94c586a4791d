"""slipstream.spark_bridge: the ``slipstream`` PySpark data source (Spark 4.2 or later).

Executors publish and subscribe through their host's media driver in shared memory: no broker,
no socket on the data path.

>>> from slipstream.spark_bridge import session
>>> spark = session()                                  # local[2], data source registered
>>> (spark.readStream.format("slipstream").option("streamId", "1001").load()
...     .writeStream.format("slipstream").option("streamId", "1002")
...     .option("checkpointLocation", "/tmp/cp").start())

``register(spark)`` registers the source on an existing session.  Options, guarantees and
limits: docs/SPARK.md.  Reading: :mod:`slipstream.spark_bridge.reader` (what its planner
decides: :mod:`~slipstream.spark_bridge.planning`; what its executors' tasks run:
:mod:`~slipstream.spark_bridge.read_task`); writing: :mod:`slipstream.spark_bridge.writer`.

Needs pyspark 4.2 or later (``pip install 'slipstream[spark]'``): with a missing or older one,
importing this package raises an ImportError naming the version needed
(:class:`~slipstream.spark_bridge._requirements.PysparkVersionError`).
"""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
from collections.abc import Mapping

# Before the first pyspark name: a missing or older pyspark is refused with the version the
# bridge needs (spark_bridge/_requirements.py); the imports below would fail on a name it
# lacks, saying nothing of versions.
from slipstream.spark_bridge import _requirements  # noqa: F401

# isort: split
from pyspark.sql import SparkSession
from pyspark.sql.datasource import DataSource
from pyspark.sql.streaming import StreamingQuery
from pyspark.sql.types import StructType

from slipstream.spark_bridge.envelope import MalformedEnvelopeError
from slipstream.spark_bridge.options import OptionError, SourceOptions, parse_options
from slipstream.spark_bridge.read_task import (
    SCHEMA,
    SlipstreamDataLossError,
    SlipstreamPartition,
    schema_text,
)
from slipstream.spark_bridge.reader import SlipstreamBatchReader, SlipstreamStreamReader
from slipstream.spark_bridge.writer import (
    ColumnError,
    OfferTimeoutError,
    SlipstreamStreamWriter,
    SlipstreamWriter,
    ValueColumnError,
    check_schema,
)

__all__ = [
    "SCHEMA",
    "ColumnError",
    "MalformedEnvelopeError",
    "OfferTimeoutError",
    "OptionError",
    "SlipstreamBatchReader",
    "SlipstreamDataLossError",
    "SlipstreamDataSource",
    "SlipstreamPartition",
    "SlipstreamStreamReader",
    "SlipstreamStreamWriter",
    "SlipstreamWriter",
    "SourceOptions",
    "ValueColumnError",
    "configure_environment",
    "local_cores",
    "register",
    "run_until_stopped",
    "session",
]


class SlipstreamDataSource(DataSource):
    """The ``slipstream`` format.  Options are validated as soon as Spark creates the source
    (``load()``, ``start()``, ``save()``): an unknown option or a bad value raises
    :class:`OptionError` naming it."""

    def __init__(self, options: Mapping[str, str]) -> None:
        super().__init__(options)  # type: ignore[arg-type]
        self.parsed = parse_options(options)

    @classmethod
    def name(cls) -> str:
        return "slipstream"

    def schema(self) -> str:
        """The read schema (Spark asks only readers): with ``headers`` when
        ``includeHeaders`` is set."""
        self.parsed.require_stream_id()
        return schema_text(self.parsed.include_headers)

    def streamReader(self, schema: StructType) -> SlipstreamStreamReader:
        self.parsed.check_direction("read")
        self.parsed.check_read_kind(streaming=True)
        return SlipstreamStreamReader(self.parsed)

    def reader(self, schema: StructType) -> SlipstreamBatchReader:
        self.parsed.check_direction("read")
        self.parsed.check_read_kind(streaming=False)
        return SlipstreamBatchReader(self.parsed)

    def writer(self, schema: StructType, overwrite: bool) -> SlipstreamWriter:
        self.parsed.check_direction("write")
        check_schema(schema, self.parsed)
        return SlipstreamWriter(self.parsed)

    def streamWriter(self, schema: StructType, overwrite: bool
                     ) -> SlipstreamStreamWriter:
        self.parsed.check_direction("write")
        check_schema(schema, self.parsed)
        return SlipstreamStreamWriter(self.parsed)


def configure_environment(*, local: bool = True) -> None:
    """Point Spark's Python workers at this interpreter (``PYSPARK_PYTHON`` and
    ``PYSPARK_DRIVER_PYTHON``, when unset), and for local sessions bind to the loopback
    (``SPARK_LOCAL_IP=127.0.0.1``, when unset).  Call before the SparkContext starts."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    if local:
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")


def register(spark: SparkSession) -> None:
    """Register the ``slipstream`` format on ``spark``.

    When ``PYSPARK_PYTHON`` was not set, the session's workers would start ``python3`` from the
    PATH, which may lack slipstream: the context is pointed at this interpreter instead (on a
    cluster, set ``PYSPARK_PYTHON`` to the executors' interpreter yourself).
    """
    context = spark.sparkContext
    if "PYSPARK_PYTHON" not in os.environ and context.pythonExec == "python3":
        context.pythonExec = sys.executable
        os.environ["PYSPARK_PYTHON"] = sys.executable
    spark.dataSource.register(SlipstreamDataSource)


def local_cores(master: str) -> int | None:
    """The executor cores of a ``local``, ``local[N]``, ``local[*]`` or ``local[N,F]`` master
    (F: the tries a task gets), as shuffle partitions: 4 for ``*``; None for any other
    master (a cluster's, ``local-cluster[...]``)."""
    found = re.fullmatch(r"local(?:\[\s*(\d+|\*)\s*(?:,\s*\d+\s*)?\])?", master.strip())
    if found is None:
        return None
    cores = found.group(1) or "1"
    return 4 if cores == "*" else int(cores)


def session(master: str = "local[2]", app_name: str = "slipstream",
            config: Mapping[str, str] | None = None, log_level: str = "WARN") -> SparkSession:
    """A SparkSession set up for slipstream, with the data source registered.

    Sets the worker interpreter (:func:`configure_environment`), keeps the UI off and the
    shuffle partitions at the core count for ``local[N]`` masters; ``config`` overrides any
    of these (``{"spark.ui.enabled": "true"}``).
    """
    local = master.startswith("local")
    configure_environment(local=local)
    settings = {"spark.ui.enabled": "false", "spark.sql.session.timeZone": "UTC"}
    if local:
        cores = local_cores(master)
        if cores is not None:
            settings["spark.sql.shuffle.partitions"] = str(cores)
        settings["spark.driver.host"] = "127.0.0.1"
        settings["spark.driver.bindAddress"] = "127.0.0.1"
    settings.update(config or {})
    builder = SparkSession.builder.master(master).appName(app_name)
    for key, value in settings.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel(log_level)
    register(spark)
    return spark


def run_until_stopped(query: StreamingQuery, *, poll_s: float = 0.5) -> None:
    """Wait for a streaming query until it ends or the process gets SIGINT (Ctrl-C) or
    SIGTERM, then stop it cleanly; re-raises the query's own failure.

    PySpark's SIGINT handler cancels jobs through the JVM gateway while the main thread is
    blocked in it (``awaitTermination``), which ends in a wall of reentrant-call tracebacks;
    this handler only records the signal, and the loop stops the query between two waits.
    Call it from the main thread; the previous handlers are restored afterwards.
    """
    stop = threading.Event()
    previous = {number: signal.signal(number, lambda *_: stop.set())
                for number in (signal.SIGINT, signal.SIGTERM)}
    try:
        while not stop.is_set() and query.isActive:
            query.awaitTermination(poll_s)
    finally:
        try:
            if query.isActive:
                query.stop()
        finally:
            for number, handler in previous.items():
                signal.signal(number, handler)
    if not stop.is_set():
        query.awaitTermination()  # raises StreamingQueryException if it failed
