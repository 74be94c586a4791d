"""The Spark query: slipstream stream 1001 → parse JSON → 5 s windows per sensor → stream 1002.

    .venv/bin/python examples/spark_pipeline/pipeline.py [--dir DIR] [--checkpoint PATH]

Stop it with Ctrl-C and start it again: it resumes from its checkpoint, without losing or
repeating an event, as long as the driver's log still holds where it stopped.
"""

from __future__ import annotations

import argparse

from slipstream.spark_bridge import run_until_stopped, session


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", default=None, help="driver directory (default: the client's)")
    parser.add_argument("--checkpoint", default="/tmp/slipstream-pipeline-checkpoint")
    parser.add_argument("--input", default="1001", help="stream id of the events")
    parser.add_argument("--output", default="1002", help="stream id of the aggregates")
    args = parser.parse_args()

    from pyspark.sql import functions as F

    spark = session(master="local[2]", app_name="slipstream-pipeline")
    directory = {"directory": args.dir} if args.dir else {}
    events = (spark.readStream.format("slipstream").options(**directory)
              .option("channel", "aeron:ipc").option("streamId", args.input)
              .option("maxOffsetsPerTrigger", "100000").load()
              .select(F.from_json(F.col("value").cast("string"),
                                  "ts long, sensor string, value double").alias("e"))
              .select((F.col("e.ts") / 1000).cast("timestamp").alias("event_time"),
                      "e.sensor", "e.value"))
    aggregates = (events.withWatermark("event_time", "2 seconds")
                  .groupBy(F.window("event_time", "5 seconds"), "sensor")
                  .agg(F.count("*").alias("events"), F.avg("value").alias("mean"),
                       F.max("value").alias("max"))
                  .select(F.to_json(F.struct(
                      F.date_format("window.start", "yyyy-MM-dd HH:mm:ss").alias("window_start"),
                      F.date_format("window.end", "yyyy-MM-dd HH:mm:ss").alias("window_end"),
                      "sensor", "events", "mean", "max")).alias("value")))
    query = (aggregates.writeStream.format("slipstream").options(**directory)
             .option("streamId", args.output).option("checkpointLocation", args.checkpoint)
             .outputMode("append").trigger(processingTime="1 second").start())
    print(f"query running: stream {args.input} -> 5 s windows -> stream {args.output} "
          f"(checkpoint {args.checkpoint})", flush=True)
    try:
        run_until_stopped(query)  # Ctrl-C or SIGTERM: stop the query, then the session
    finally:
        spark.stop()
    print("query stopped", flush=True)


if __name__ == "__main__":
    main()
