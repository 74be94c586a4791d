"""Kafka's columns on the ``slipstream`` source: ``key`` and ``headers`` in an envelope,
``timestampType``, routing by ``stream_id``, and the columns a writer refuses; a real
SparkSession (local[2]) and real drivers."""

from __future__ import annotations

import re
import time

import pytest
from test_spark_bridge import (
    Collector,
    Drainer,
    offer,
    read_query,
    running_driver,
    wait_connected,
)
from test_spark_executor import Hosts
from test_spark_executor import two_drivers as two_drivers

from slipstream.client.layout import RESERVED_VALUE_ENVELOPE_BIT, RESERVED_VALUE_TIME_MASK
from slipstream.spark_bridge.envelope import decode_message, encode_message
from slipstream.spark_bridge.read_task import read_range

pytestmark = [pytest.mark.spark, pytest.mark.timeout(300)]

HEADERS = "array<struct<key: string, value: binary>>"


def frame_rows(count: int) -> list[tuple[bytes, bytes | None, list | None]]:
    """(value, key, headers) rows covering every case: empty and null keys, empty and null
    headers, null header values, unicode header keys, every byte value, and every 40th value
    100 KB long (about 70 IPC frames: fragmented)."""
    rows = []
    for i in range(count):
        body = bytes(range(256)) * 400 if i % 40 == 0 else bytes([i % 256, 0, 255])
        value = f"{i:05}|".encode() + body
        key = [None, b"", f"key-{i}".encode(), bytes([0, i % 256])][i % 4]
        headers = [None, [], [("trace", f"t{i}".encode())],
                   [("ключ", b"\x00\xff"), ("🔑", None), ("", b"")]][i % 5 % 4]
        rows.append((value, key, headers))
    return rows


def written(spark, rows, directory, **options: str) -> None:
    """Write ``rows`` (value, key, headers) in one task: the other core of local[2] is left
    to the read queries, whose batches return the writer's credit."""
    frame = spark.createDataFrame(rows, schema=f"value binary, key binary, headers {HEADERS}")
    writer = frame.coalesce(1).write.format("slipstream").option("directory", str(directory))
    for key, value in options.items():
        writer = writer.option(key, value)
    writer.mode("append").save()


def as_tuples(row) -> tuple:
    headers = None if row.headers is None else [(h.key, None if h.value is None else
                                                 bytes(h.value)) for h in row.headers]
    return (bytes(row.value), None if row.key is None else bytes(row.key), headers)


def test_keys_and_headers_round_trip_through_a_write_and_a_read(spark, tmp_path) -> None:
    """Rows with keys and headers written by Spark come back whole to a reader with
    includeHeaders=true, and without the headers column to one without it (the key column
    is always there); each stamped by its publisher (timestampType 0).  400 rows, 10 of
    them 100 KB (fragmented): 1 MB through 512 KiB windows (half a 1 MiB term)."""
    rows = frame_rows(400)
    with running_driver("1m") as (directory, client):
        with_headers, without = Collector(), Collector()
        queries = [read_query(spark, directory, 3001, with_headers, str(tmp_path / "a"),
                              includeHeaders="true"),
                   read_query(spark, directory, 3001, without, str(tmp_path / "b"))]
        try:
            wait_connected(client.add_publication("aeron:ipc", 3001))
            time.sleep(1.0)  # both queries subscribed: the probe saw one of them
            before = time.time()
            written(spark, rows, directory, streamId="3001")
            with_headers.wait_for(len(rows))
            without.wait_for(len(rows))
        finally:
            for query in queries:
                query.stop()
    got = with_headers.rows()
    assert sorted(as_tuples(row) for row in got) == sorted(rows)
    assert {row.timestampType for row in got} == {0}
    assert min(row.timestamp.timestamp() for row in got) >= before - 1
    plain = without.rows()
    assert "headers" not in plain[0].asDict()
    assert sorted((bytes(r.value), None if r.key is None else bytes(r.key)) for r in plain) \
        == sorted((value, key) for value, key, _ in rows)


def test_a_plain_publisher_is_read_with_null_key_and_headers(spark, checkpoint) -> None:
    """Messages of a publisher that writes no envelope (any Aeron publisher) are read whole,
    key and headers null, with includeHeaders=true; timestampType is 0 where the publisher
    stamped the reserved value, -1 (Kafka's NO_TIMESTAMP_TYPE) where the timestamp is the
    read time; an envelope offered by a client beside them is decoded."""
    stamp = time.time_ns()
    with running_driver("64k") as (directory, client):
        publication = client.add_publication("aeron:ipc", 3002)
        collector = Collector()
        query = read_query(spark, directory, 3002, collector, checkpoint,
                           includeHeaders="true")
        try:
            wait_connected(publication)
            offer(publication, b"\x01\xff\xff\xff\xff")  # an envelope's bytes, unmarked
            while publication.offer(b"stamped", reserved_value=stamp) < 0:
                time.sleep(0.001)
            while publication.offer(encode_message(b"v", b"k", [("h", b"x")]),
                                    reserved_value=stamp + RESERVED_VALUE_ENVELOPE_BIT) < 0:
                time.sleep(0.001)
            collector.wait_for(3)
        finally:
            query.stop()
    first, second, third = collector.rows()
    assert as_tuples(first) == (b"\x01\xff\xff\xff\xff", None, None)
    assert first.timestampType == -1
    assert as_tuples(second) == (b"stamped", None, None) and second.timestampType == 0
    assert as_tuples(third) == (b"v", b"k", [("h", b"x")]) and third.timestampType == 0
    assert second.timestamp == third.timestamp
    assert int(third.timestamp.timestamp() * 1_000_000) == stamp // 1000


def test_an_enveloped_message_read_by_a_plain_subscription_shows_its_envelope(spark) -> None:
    """A plain subscriber (as any Aeron subscriber) sees an enveloped message's envelope as
    its payload, and the envelope bit above the publish time in its reserved value; a row of
    the same frame with neither key nor headers is a plain message."""
    with running_driver("64k") as (directory, client):
        consumer = Drainer(client.add_subscription("aeron:ipc", 3003))
        before = time.time_ns()
        written(spark, [(b"value", b"key", [("h", b"1")]), (b"plain", None, None)], directory,
                streamId="3003")
        got = consumer.wait_for(2)
    assert got == [encode_message(b"value", b"key", [("h", b"1")]), b"plain"]
    decoded = decode_message(got[0])
    assert (decoded.key, decoded.headers, decoded.value) == (b"key", [("h", b"1")], b"value")
    reserved, plain = consumer.reserved_values
    assert reserved < 0 and before <= reserved & RESERVED_VALUE_TIME_MASK <= time.time_ns()
    assert plain == reserved & RESERVED_VALUE_TIME_MASK  # one offer_batch call: one time


def test_rows_are_routed_by_their_stream_id_column(spark) -> None:
    """Without the streamId option each row goes to its stream_id column's stream (one
    publication per stream per task), and a null one is refused naming the column; with
    the option every row goes to its stream (the option overrides the column, as Kafka's
    topic option does, so that a query passing read rows through writes where it says)."""
    with running_driver("64k") as (directory, client):
        consumers = {sid: Drainer(client.add_subscription("aeron:ipc", sid))
                     for sid in (3011, 3012)}
        frame = spark.range(3_000, numPartitions=2).selectExpr(
            "cast(cast(id as string) as binary) as value",
            "case when id % 2 = 0 then 3011 else 3012 end as stream_id")
        (frame.write.format("slipstream").option("directory", str(directory))
         .mode("append").save())
        got = {sid: consumer.wait_for(1_500) for sid, consumer in consumers.items()}
        assert sorted(got[3011], key=int) == [str(i).encode() for i in range(0, 3_000, 2)]
        assert sorted(got[3012], key=int) == [str(i).encode() for i in range(1, 3_000, 2)]

        overridden = Drainer(client.add_subscription("aeron:ipc", 3013))
        (frame.write.format("slipstream").option("directory", str(directory))
         .option("streamId", "3013").mode("append").save())
        assert sorted(overridden.wait_for(3_000), key=int) == \
            [str(i).encode() for i in range(3_000)]

        with_nulls = frame.selectExpr("value", "if(value = '7', null, stream_id) as stream_id")
        with pytest.raises(Exception, match=re.escape("has a null 'stream_id' column, and the "
                                                      "writer has no streamId option")):
            (with_nulls.write.format("slipstream").option("directory", str(directory))
             .mode("append").save())
        with pytest.raises(Exception, match="option 'streamId': is required unless"):
            (frame.select("value").write.format("slipstream")
             .option("directory", str(directory)).mode("append").save())


@pytest.mark.parametrize(("column", "said"), [
    ("id as colour", "column 'colour' would not be written (drop it"),
    ("'orders' as topic", "column 'topic' would not be written (slipstream routes"),
    ("id as stream_id", "'stream_id' column is bigint; it must be int"),
    ("id as key", "'key' column is bigint"),
    ("array(named_struct('key', 'k', 'value', 'v')) as headers",
     "'headers' column is array<struct<key:string,value:string>>"),
])
def test_a_column_the_writer_would_not_write_is_refused_by_name_before_any_task(
        spark, column: str, said: str) -> None:
    frame = spark.range(3).selectExpr("cast('x' as binary) as value", column)
    with pytest.raises(Exception, match=re.escape(said)) as refused:
        frame.write.format("slipstream").option("streamId", "1").mode("append").save()
    assert "PythonException" not in type(refused.value).__name__


def test_the_read_schemas_stream_assigned_columns_are_ignored_by_the_writer(spark) -> None:
    """session_id, position, timestamp and timestampType, which a query passing read rows
    through carries, are the stream's to assign: written rows carry only their values."""
    with running_driver("64k") as (directory, client):
        consumer = Drainer(client.add_subscription("aeron:ipc", 3021))
        frame = spark.range(10).selectExpr(
            "cast(cast(id as string) as binary) as value", "7 as session_id",
            "cast(id as long) as position", "current_timestamp() as timestamp",
            "0 as timestampType")
        (frame.write.format("slipstream").option("directory", str(directory))
         .option("streamId", "3021").mode("append").save())
        assert sorted(consumer.wait_for(10), key=int) == [str(i).encode() for i in range(10)]
    assert min(consumer.reserved_values) > 0  # plain messages: no envelope bit


def test_a_malformed_envelope_fails_the_read_naming_its_position(spark, checkpoint) -> None:
    """A message marked as enveloped that does not decode is never read as garbage: the
    query fails naming its stream, session, position and what is wrong."""
    with running_driver("64k") as (directory, client):
        publication = client.add_publication("aeron:ipc", 3031)
        query = read_query(spark, directory, 3031, Collector(), checkpoint)
        try:
            wait_connected(publication)
            while publication.offer(b"\x01\x40\x00\x00\x00abc",
                                    reserved_value=RESERVED_VALUE_ENVELOPE_BIT) < 0:
                time.sleep(0.001)
            position = publication.position
            with pytest.raises(Exception) as failed:
                query.awaitTermination(120)
        finally:
            query.stop()
    said = str(failed.value)
    assert f"slipstream stream 3031 session {publication.session_id}" in said
    assert f"ending at position {position}" in said
    assert "its key length 64 does not fit in the message" in said


def test_include_headers_takes_true_or_false_only(spark) -> None:
    with pytest.raises(Exception, match="option 'includeHeaders': 'yes' is not accepted"):
        (spark.readStream.format("slipstream").option("streamId", "1")
         .option("includeHeaders", "yes").load())


def test_envelopes_replayed_to_another_host_read_as_they_read_in_place(
        two_drivers: Hosts) -> None:
    """The read paths share one decoding: a range of enveloped and plain messages read in
    place on the holder's host and replayed to another driver gives the same keys, headers,
    values and publisher times (more than a window: 150 messages of about 250 bytes through
    32 KiB windows)."""
    hosts = two_drivers
    start = hosts.image.position
    sent = []
    for i in range(150):
        key = None if i % 3 == 0 else f"k{i}".encode()
        headers = None if i % 4 == 0 else [("n", str(i).encode()), ("é", None)]
        value = f"{i:08d}".encode().ljust(200, b".")
        enveloped = i % 5 != 0
        payload = encode_message(value, key, headers) if enveloped else value
        mark = RESERVED_VALUE_ENVELOPE_BIT if enveloped else 0
        deadline = time.monotonic() + 10
        while hosts.publication.offer(payload, reserved_value=(i + 1) * 1000 + mark) < 0:
            assert time.monotonic() < deadline
            time.sleep(0.0005)
        hosts.keeper.poll(lambda data, header: None, 100)  # the holder's credit, returned
        sent.append((value, key if enveloped else None, headers if enveloped else None,
                     i + 1))
    end = hosts.image.available_position()

    def read(directory) -> list[tuple]:
        partition = hosts.partition(directory, start, end)
        partition.include_headers = True
        got = []
        for batch in read_range(partition):
            for row in batch.to_pylist():
                headers = row["headers"]
                got.append((row["value"], row["key"],
                            None if headers is None else
                            [(h["key"], h["value"]) for h in headers],
                            int(row["timestamp"].timestamp() * 1_000_000)))
        return got

    local = read(hosts.holder_dir)
    assert local == sent
    assert read(hosts.executor_dir) == local


def test_a_starting_timestamp_finds_enveloped_messages_by_their_time(two_drivers: Hosts
                                                                     ) -> None:
    """The envelope bit is no part of a message's time: the search for the first message
    stamped at or after a time finds an enveloped one (its reserved value negative)."""
    from slipstream.client.logview import ImageView

    hosts = two_drivers
    start = hosts.image.position
    positions = []
    for i in range(20):
        mark = RESERVED_VALUE_ENVELOPE_BIT if i % 2 else 0
        deadline = time.monotonic() + 10
        while hosts.publication.offer(encode_message(b"v") if mark else b"v",
                                      reserved_value=(i + 1) * 1_000_000 + mark) < 0:
            assert time.monotonic() < deadline
            time.sleep(0.0005)
        positions.append(hosts.publication.position)
    end = hosts.image.available_position()
    view = ImageView(hosts.image)
    # Message i is stamped (i + 1) ms and begins where message i - 1 ended.
    assert view.position_at_time(start, end, 8 * 1_000_000) == positions[6]  # message 7
    assert view.position_at_time(start, end, 7 * 1_000_000 + 1) == positions[6]
    assert view.position_at_time(start, end, 21 * 1_000_000) == end


def test_a_query_passing_read_rows_through_writes_plain_messages_where_its_option_says(
        spark, checkpoint) -> None:
    """Read rows written as they are (every read column: the ones the stream assigns are
    ignored, the null keys ask for no envelope, the streamId option overrides stream_id):
    the output stream gets the plain values, and nothing goes back to the input stream."""
    with running_driver("64k") as (directory, client):
        publication = client.add_publication("aeron:ipc", 3041)
        output = Drainer(client.add_subscription("aeron:ipc", 3042))
        query = (spark.readStream.format("slipstream").option("directory", str(directory))
                 .option("streamId", "3041").option("includeHeaders", "true").load()
                 .writeStream.format("slipstream").option("directory", str(directory))
                 .option("streamId", "3042").option("checkpointLocation", checkpoint)
                 .trigger(processingTime="100 milliseconds").start())
        try:
            wait_connected(publication)  # the query subscribed
            back = Drainer(client.add_subscription("aeron:ipc", 3041))  # joins before any
            messages = [f"m{i}".encode() * 50 for i in range(2_000)]  # 2,000 x 100-300 B
            for message in messages:
                offer(publication, message)
            query.processAllAvailable()
            assert output.wait_for(2_000) == messages
        finally:
            query.stop()
        time.sleep(0.5)
        assert back.wait_for(2_001, timeout=1.0) == messages  # its own messages only
    assert min(output.reserved_values) > 0  # plain: no envelope bit
