"""The ``slipstream`` source as a Kafka source's user expects it: the same option by either
name, Kafka's JSON offsets, Kafka-only options refused naming what to use here, and the lag
behind latest in the query's progress.  The parsing tests need nothing; the planning tests
run a real driver's streams (test_spark_bridge.py shows the lag in a real query's
progress)."""

from __future__ import annotations

import json
import re

import pytest
from helpers import free_port, wait_for
from pyspark.sql.streaming.datasource import ReadAllAvailable
from test_spark_planning import FRAME, STREAM, publish, reader

from slipstream.spark_bridge import reader as reader_module
from slipstream.spark_bridge.options import (
    EARLIEST,
    LATEST,
    OptionError,
    parse_options,
)
from slipstream.spark_bridge.reader import LAG, position_of, read_range


@pytest.mark.parametrize(("kafka", "ours", "value", "field", "parsed"), [
    ("startingOffsets", "startingPosition", "earliest", "starting_position", "earliest"),
    ("endingOffsets", "endingPosition", "latest", "ending_position", "latest"),
    ("maxOffsetsPerTrigger", "maxMessagesPerTrigger", "250", "max_messages_per_trigger", 250),
    ("minOffsetsPerTrigger", "minMessagesPerTrigger", "40", "min_messages_per_trigger", 40),
])
def test_a_kafka_option_name_sets_the_same_option_as_ours_and_both_may_agree(
        kafka: str, ours: str, value: str, field: str, parsed: object) -> None:
    # Spark hands the keys over lower-cased.
    by_kafka = parse_options({"streamid": "7", kafka.lower(): value})
    by_ours = parse_options({"streamid": "7", ours.lower(): value})
    by_both = parse_options({"streamid": "7", kafka.lower(): value, ours.lower(): f" {value}"})
    assert getattr(by_kafka, field) == getattr(by_ours, field) == getattr(by_both, field) \
        == parsed
    assert ours in by_kafka.given and ours in by_both.given


@pytest.mark.parametrize(("options", "named", "other"), [
    ({"maxOffsetsPerTrigger": "10", "maxMessagesPerTrigger": "11"}, "maxOffsetsPerTrigger",
     "maxMessagesPerTrigger"),
    ({"startingOffsets": "earliest", "startingPosition": "latest"}, "startingOffsets",
     "startingPosition"),
    ({"startingOffsets": '{"7": {"1": 64}}', "startingPosition": '{"1": 96}'},
     "startingOffsets", "startingPosition"),
])
def test_two_names_of_one_option_with_different_values_are_refused_naming_both(
        options: dict[str, str], named: str, other: str) -> None:
    with pytest.raises(OptionError, match=f"option '{named}': and {other} are one option"):
        parse_options({"streamId": "7", **options})


def test_same_json_by_both_names_is_one_value() -> None:
    options = parse_options({"streamId": "7", "startingOffsets": '{"7": {"1": 64}}',
                             "startingPosition": '{"7" : {"1" : 64}}'})
    assert options.starting_position == {"1": 64}


def test_kafka_json_offsets_map_topic_to_stream_and_partition_to_session() -> None:
    """{"STREAM": {"SESSION": POSITION}} with -2 earliest and -1 latest, as Kafka's
    startingOffsets; keyed as the offsets key sessions (bare for one stream)."""
    one = parse_options({"streamId": "7", "startingOffsets":
                         json.dumps({"7": {"-5": 64, "12": EARLIEST, "13": LATEST}})})
    assert one.starting_position == {"-5": 64, "12": EARLIEST, "13": LATEST}
    two = parse_options({"streamId": "7,8", "startingOffsets":
                         json.dumps({"7": {"1": 32}, "8": {"1": EARLIEST}})})
    assert two.starting_position == {"7:1": 32, "8:1": EARLIEST}
    ending = parse_options({"streamId": "7,8", "endingOffsets":
                            json.dumps({"8": {"3": LATEST, "4": 4096}})})
    assert ending.ending_position == {"8:3": LATEST, "8:4": 4096}


def test_the_session_forms_of_positions_keep_working() -> None:
    assert parse_options({"streamId": "7", "startingPosition": '{"1": 64, "7:2": 32}'}
                         ).starting_position == {"1": 64, "2": 32}
    assert parse_options({"streamId": "7,8", "startingOffsets": '{"1": 64, "8:2": -2}'}
                         ).starting_position == {"7:1": 64, "8:2": EARLIEST}


@pytest.mark.parametrize(("option", "value", "said"), [
    ("startingOffsets", '{"9": {"1": 64}}', "stream 9 (of session '9:1') is not read"),
    ("endingOffsets", '{"7": {"1": -2}}', "or -1 (latest)"),
    ("startingOffsets", '{"7": {"1": -3}}', "or -2 (earliest) or -1 (latest)"),
    ("startingOffsets", '{"7": {"1": 65}}', "not a stream position"),
    ("startingOffsets", '{"7": {"x": 64}}', "not a session id"),
    ("startingOffsets", '{"7": {"1": 64}, "1": 96}', "named twice"),
    ("maxOffsetsPerTrigger", "0", "is not >= 1"),
    ("minOffsetsPerTrigger", "many", "is not an integer"),
])
def test_a_bad_value_is_named_by_the_name_it_was_given(option: str, value: str,
                                                        said: str) -> None:
    with pytest.raises(OptionError, match=f"option '{option}': .*{re.escape(said)}"):
        parse_options({"streamId": "7", option.lower(): value})


def test_min_over_max_names_both_by_the_names_given() -> None:
    with pytest.raises(OptionError, match="option 'minOffsetsPerTrigger': 50 is over "
                                          "maxOffsetsPerTrigger 10"):
        parse_options({"streamId": "7", "minOffsetsPerTrigger": "50",
                       "maxOffsetsPerTrigger": "10"})


@pytest.mark.parametrize(("option", "instead"), [
    ("kafka.bootstrap.servers", "'channel'"),
    ("subscribe", "'streamId'"),
    ("subscribePattern", "'streamId'"),
    ("assign", "'streamId'"),
    ("topic", "'streamId'"),
    ("groupIdPrefix", "'holderGroup'"),
    ("kafkaConsumer.pollTimeoutMs", "'replayTimeoutMs'"),
    ("fetchOffset.numRetries", "shared memory"),
    ("kafka.group.id", "channel, streamId"),
    ("kafka.security.protocol", "channel, streamId"),
])
def test_a_kafka_only_option_is_refused_naming_what_to_use_instead(option: str,
                                                                   instead: str) -> None:
    with pytest.raises(OptionError, match=f"option '{option}': is the Kafka source's and has "
                                          f"no meaning here: .*{instead}"):
        parse_options({"streamid": "7", option.lower(): "x"})


def test_a_stream_takes_json_starting_offsets_and_a_reader_of_either_kind_names_the_option(
        ) -> None:
    options = parse_options({"streamId": "7", "startingOffsets": '{"7": {"1": 64}}'})
    options.check_read_kind(streaming=True)  # accepted on a stream now
    batch_only = parse_options({"streamId": "7", "endingOffsets": "latest"})
    with pytest.raises(OptionError, match="option 'endingOffsets': applies to batch reads"):
        batch_only.check_read_kind(streaming=True)
    stream_only = parse_options({"streamId": "7", "maxOffsetsPerTrigger": "5",
                                 "holder": "10.0.0.1"})
    with pytest.raises(OptionError, match="option 'maxOffsetsPerTrigger': applies to "
                                          "streaming reads only"):
        stream_only.check_read_kind(streaming=False)


# -- a stream started at Kafka's JSON offsets, on a real driver -------------------------------
@pytest.mark.timeout(120)
def test_a_stream_started_at_json_offsets_reads_each_named_session_from_its_position(
        driver, driver_dir, client) -> None:
    """startingOffsets {"STREAM": {"A": 20 messages in, "B": -2}}: A is read from its 21st
    message, B from its first, and a session it does not name from where the query joined
    it (latest), not its older messages."""
    channel = f"aeron:udp?endpoint=127.0.0.1:{free_port()}"
    holder = reader(driver_dir, channel=channel)  # holds the stream from the first message
    try:
        holder.initialOffset()
        a = client.add_publication(channel, STREAM)
        b = client.add_exclusive_publication(channel, STREAM)
        c = client.add_exclusive_publication(channel, STREAM)
        sessions = {str(p.session_id): p for p in (a, b, c)}
        wait_for(lambda: set(holder._images()) == set(sessions), what="three sessions")
        publish(a, 50, 0)
        publish(b, 50, 100)
        publish(c, 50, 200)
        wait_for(lambda: all(view.available_position() == 50 * FRAME
                             for view in holder._images().values()), what="the messages")
        offsets = {str(STREAM): {str(a.session_id): 20 * FRAME, str(b.session_id): EARLIEST}}
        planner = reader(driver_dir, channel=channel, startingOffsets=json.dumps(offsets))
        try:
            start = planner.initialOffset()
            assert {sid: position_of(entry) for sid, entry in start.items()} == \
                {str(a.session_id): 20 * FRAME, str(b.session_id): 0}
            wait_for(lambda: len(planner._images()) == 3, what="the planner's three images")
            end = planner.latestOffset(start, ReadAllAvailable())
            rows = sorted(int(bytes(v)[:8]) for p in planner.partitions(start, end)
                          for batch in read_range(p) for v in batch.column("value").to_pylist())
            assert rows == [*range(20, 50), *range(100, 150)]
            assert position_of(end[str(c.session_id)]) == 50 * FRAME  # entered, unread
            publish(c, 5, 250)
            wait_for(lambda: planner._images()[str(c.session_id)].available_position() ==
                     55 * FRAME, what="c's new messages")
            later = planner.latestOffset(end, ReadAllAvailable())
            rows = [int(bytes(v)[:8]) for p in planner.partitions(end, later)
                    for batch in read_range(p) for v in batch.column("value").to_pylist()]
            assert rows == list(range(250, 255))
        finally:
            planner.stop()
        offsets = {str(STREAM): {str(c.session_id): 56 * FRAME}}
        planner = reader(driver_dir, channel=channel, startingOffsets=json.dumps(offsets))
        try:
            wait_for(lambda: str(c.session_id) in planner._images(), what="c's image")
            with pytest.raises(Exception, match=f"session {c.session_id}: startingOffsets "
                                                f"{56 * FRAME} is past the last whole message "
                                                f"its log holds \\({55 * FRAME}\\)"):
                planner.initialOffset()
        finally:
            planner.stop()
    finally:
        holder.stop()


@pytest.mark.timeout(120)
def test_the_reported_latest_offset_holds_each_sessions_lag_and_kafkas_min_max_avg(
        driver, driver_dir, client, monkeypatch) -> None:
    """Two sessions 100 and 30 messages behind, maxOffsetsPerTrigger=40 (31 and 9 taken):
    after the batch, 69 and 21 behind, in messages and bytes, min / max / avg over them;
    counted exactly, then estimated when a session is behind by more than is counted;
    0 once a batch reads everything."""
    channel = f"aeron:udp?endpoint=127.0.0.1:{free_port()}"
    planner = reader(driver_dir, channel=channel, maxOffsetsPerTrigger="40")
    try:
        start = planner.initialOffset()
        assert planner.reportLatestOffset() in ({}, None)  # nothing planned, nothing to lag
        a = client.add_publication(channel, STREAM)
        b = client.add_exclusive_publication(channel, STREAM)
        wait_for(lambda: len(planner._images()) == 2, what="both sessions")
        start = planner.latestOffset(start, planner.getDefaultReadLimit())  # they enter
        publish(a, 100, 0)
        publish(b, 30, 100)
        wait_for(lambda: sum(view.available_position() for view in
                             planner._images().values()) == 130 * FRAME, what="the messages")
        end = planner.latestOffset(start, planner.getDefaultReadLimit())
        latest = planner.reportLatestOffset()
        assert latest is not None
        sa, sb = str(a.session_id), str(b.session_id)
        assert (latest[sa], latest[sb]) == (100 * FRAME, 30 * FRAME)
        lag = latest[LAG]
        assert lag["sessions"] == {sa: {"messages": 69, "bytes": 69 * FRAME},
                                   sb: {"messages": 21, "bytes": 21 * FRAME}}
        assert (lag["minOffsetsBehindLatest"], lag["maxOffsetsBehindLatest"],
                lag["avgOffsetsBehindLatest"], lag["offsetsBehindLatest"]) == (21, 69, 45, 90)
        assert (lag["minBytesBehindLatest"], lag["maxBytesBehindLatest"],
                lag["bytesBehindLatest"]) == (21 * FRAME, 69 * FRAME, 90 * FRAME)
        assert lag["estimated"] is False
        # Past the counted bound: estimated from the messages counted (all alike here).
        monkeypatch.setattr(reader_module, "_LAG_COUNTED", 10)
        lag = planner.reportLatestOffset()[LAG]
        assert lag["estimated"] is True
        assert lag["sessions"][sa] == {"messages": 69, "bytes": 69 * FRAME}
        planner.latestOffset(end, ReadAllAvailable())
        lag = planner.reportLatestOffset()[LAG]
        assert lag["maxOffsetsBehindLatest"] == lag["bytesBehindLatest"] == 0
        assert lag["sessions"] == {sa: {"messages": 0, "bytes": 0},
                                   sb: {"messages": 0, "bytes": 0}}
    finally:
        planner.stop()


@pytest.mark.timeout(120)
def test_a_malformed_envelope_read_by_a_task_raises_the_packages_one_error_class(
        driver, driver_dir, client) -> None:
    """A read task that meets a message marked as enveloped that does not decode raises the
    one MalformedEnvelopeError the package exports (envelope.py's), so that a user's
    ``except`` catches it whichever layer found it."""
    from slipstream.client.layout import RESERVED_VALUE_ENVELOPE_BIT
    from slipstream.spark_bridge import MalformedEnvelopeError, envelope

    assert MalformedEnvelopeError is envelope.MalformedEnvelopeError
    channel = f"aeron:udp?endpoint=127.0.0.1:{free_port()}"
    planner = reader(driver_dir, channel=channel, startingOffsets="earliest")
    try:
        start = planner.initialOffset()
        publication = client.add_publication(channel, STREAM)
        wait_for(lambda: len(planner._images()) == 1, what="the session")
        start = planner.latestOffset(start, ReadAllAvailable())
        wait_for(lambda: publication.offer(b"\x01\x40\x00\x00\x00abc",
                                           reserved_value=RESERVED_VALUE_ENVELOPE_BIT) > 0,
                 what="the malformed message offered")
        wait_for(lambda: next(iter(planner._images().values())).available_position() > 0,
                 what="the message")
        end = planner.latestOffset(start, ReadAllAvailable())
        with pytest.raises(envelope.MalformedEnvelopeError,
                           match=f"session {publication.session_id}: the message ending at"):
            for partition in planner.partitions(start, end):
                list(read_range(partition))
    finally:
        planner.stop()


@pytest.mark.timeout(120)
def test_a_session_named_in_starting_offsets_that_appears_later_starts_at_its_position(
        driver, driver_dir, client) -> None:
    """startingOffsets names a session that has no publisher when the query starts, at a
    position past its first messages: when it appears, a few messages short of that
    position, it enters there (the query does not fail), and is read from there on once its
    publisher passes it; messages before the position are never read."""
    channel = f"aeron:udp?endpoint=127.0.0.1:{free_port()}"
    session_id = 424242
    named = 30 * FRAME
    offsets = {str(STREAM): {str(session_id): named}}
    planner = reader(driver_dir, channel=channel, startingOffsets=json.dumps(offsets))
    try:
        start = planner.initialOffset()
        assert str(session_id) not in start
        late = client.add_exclusive_publication(f"{channel}|session-id={session_id}", STREAM)
        wait_for(lambda: str(session_id) in planner._images(), what="the late session")
        publish(late, 10, 0)
        wait_for(lambda: planner._images()[str(session_id)].available_position() ==
                 10 * FRAME, what="its first messages")
        end = planner.latestOffset(start, ReadAllAvailable())
        assert position_of(end[str(session_id)]) == named
        planner.commit(end)
        start = end
        publish(late, 40, 10)
        wait_for(lambda: planner._images()[str(session_id)].available_position() ==
                 50 * FRAME, what="its next messages")
        end = planner.latestOffset(start, ReadAllAvailable())
        read = [int(bytes(v)[:8]) for p in planner.partitions(start, end)
                for batch in read_range(p) for v in batch.column("value").to_pylist()]
        assert read == list(range(30, 50))
    finally:
        planner.stop()


@pytest.mark.parametrize("streaming", [True, False], ids=["stream", "batch"])
def test_timestamp_options_take_precedence_over_offsets_as_in_kafkas_source(
        streaming: bool) -> None:
    """Kafka's source takes startingTimestamp over startingOffsetsByTimestamp and
    startingOffsets, and endingTimestamp over endingOffsets: a Kafka query giving both runs
    unchanged, the timestamp deciding (each option given is still checked)."""
    offsets = json.dumps({str(STREAM): {"7": 256}})
    given = {"streamId": str(STREAM), "archive": "127.0.0.1:8010",
             "startingOffsets": offsets, "startingTimestamp": "1700000000000",
             "startingOffsetsByTimestamp": json.dumps({str(STREAM): {"7": 1600000000000}})}
    if not streaming:
        given |= {"endingOffsets": offsets, "endingTimestamp": "1800000000000"}
    options = parse_options(given)
    options.check_read_kind(streaming=streaming)
    assert options.starting_timestamp_ns == 1700000000000 * 10**6
    assert options.starting_timestamps_ns == {}
    assert options.starting_position == "latest"
    if not streaming:
        assert options.ending_timestamp_ns == 1800000000000 * 10**6
        assert options.ending_position == "latest"
    by_time = parse_options({"streamId": str(STREAM), "startingOffsets": offsets,
                             "startingOffsetsByTimestamp": json.dumps(
                                 {str(STREAM): {"7": 1600000000000}})})
    by_time.check_read_kind(streaming=True)
    assert by_time.starting_timestamps_ns == {(STREAM, 7): 1600000000000 * 10**6}
    with pytest.raises(OptionError, match="'startingTimestamp'"):
        parse_options({**given, "startingTimestamp": "soon"})


@pytest.mark.timeout(120)
def test_a_stream_given_starting_offsets_and_a_timestamp_starts_at_the_timestamp(
        driver, driver_dir, client) -> None:
    """startingOffsets=earliest with startingTimestamp T, as a Kafka query may give them: the
    session starts at its first message stamped at or after T, not at its oldest."""
    import time

    from slipstream.spark_bridge import SlipstreamDataSource

    channel = f"aeron:udp?endpoint=127.0.0.1:{free_port()}"
    holder = reader(driver_dir, channel=channel)  # holds the stream from the first message
    try:
        holder.initialOffset()
        publication = client.add_publication(channel, STREAM)
        wait_for(lambda: len(holder._images()) == 1, what="the session")

        def stamped(count: int, first: int) -> None:
            for i in range(first, first + count):
                data = f"{i:08d}".encode().ljust(FRAME - 32, b".")
                wait_for(lambda d=data: publication.offer(
                    d, reserved_value=time.time_ns()) > 0, what="an offer")

        stamped(20, 0)
        time.sleep(0.05)
        at_ms = time.time_ns() // 1_000_000 + 1
        time.sleep(0.01)
        stamped(20, 20)
        wait_for(lambda: next(iter(holder._images().values())).available_position() ==
                 40 * FRAME, what="the messages")
        planner = SlipstreamDataSource({
            "streamId": str(STREAM), "directory": str(driver_dir), "channel": channel,
            "holderAddress": "127.0.0.1", "startingOffsets": "earliest",
            "startingTimestamp": str(at_ms)}).streamReader(None)  # as Spark makes it
        try:
            start = planner.initialOffset()
            assert position_of(start[str(publication.session_id)]) == 20 * FRAME
        finally:
            planner.stop()
    finally:
        holder.stop()
