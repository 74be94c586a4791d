"""The streaming reader's planning side without a SparkSession: its offsets, read limits and
Trigger.AvailableNow, called as Spark calls them, on a real driver's streams."""

from __future__ import annotations

import itertools
import re
import shutil
import socket
import time
import uuid
from pathlib import Path

import pytest
from helpers import FAST_DRIVER_SETTINGS, free_port, wait_for
from hypothesis import given
from hypothesis import strategies as st
from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadMaxBytes, ReadMaxRows

from slipstream.client import Client
from slipstream.client.counters import CounterType
from slipstream.daemon.driver import MediaDriver
from slipstream.spark_bridge.options import (
    MAX_READER_STREAMS,
    OptionError,
    describe_stream_ids,
    parse_options,
    parse_stream_ids,
)
from slipstream.spark_bridge.reader import (
    SlipstreamDataLossError,
    SlipstreamStreamReader,
    log_of,
    position_of,
    read_range,
    shares,
)

STREAM = 3301
FRAME = 128  # a 96-byte message with its header


@given(st.integers(0, 10_000), st.dictionaries(st.text(max_size=3), st.integers(0, 1 << 40),
                                               max_size=8))
def test_shares_never_exceed_the_budget_and_follow_the_backlogs(
        budget: int, backlogs: dict[str, int]) -> None:
    result = shares(budget, backlogs)
    assert set(result) == set(backlogs)
    assert sum(result.values()) <= budget
    assert all(value >= 0 for value in result.values())
    waiting = [sid for sid, size in backlogs.items() if size > 0]
    if budget >= len(waiting):
        assert all(result[sid] >= 1 for sid in waiting), "a session with a backlog starved"
    total = sum(backlogs.values())
    if total and budget >= 2 * len(waiting):
        for sid in waiting:  # proportional, but for the rounding and the one-each floor
            assert abs(result[sid] - budget * backlogs[sid] / total) <= len(waiting) + 1


def publish(publication, count: int, first: int = 0) -> None:
    for i in range(first, first + count):
        deadline = time.monotonic() + 10
        while publication.offer(f"{i:08d}".encode().ljust(FRAME - 32, b".")) < 0:
            assert time.monotonic() < deadline
            time.sleep(0.001)


def reader(driver_dir, **options: str) -> SlipstreamStreamReader:
    return SlipstreamStreamReader(parse_options({
        "streamId": str(STREAM), "directory": str(driver_dir), "holderAddress": "127.0.0.1",
        **options}))


@pytest.fixture
def two_sessions(driver, driver_dir, client):
    """Two clients whose publications of one stream are two sessions: UDP publications from
    this driver and from a second one, to one endpoint this driver subscribes to (the
    planner's channel)."""
    channel = f"aeron:udp?endpoint=127.0.0.1:{free_port()}"
    other_dir = Path("/dev/shm") / f"slipstream-planning-{uuid.uuid4().hex[:8]}"
    with MediaDriver.launch(directory=other_dir, **FAST_DRIVER_SETTINGS), \
            Client.connect(other_dir) as other:
        yield channel, client, other
    shutil.rmtree(other_dir, ignore_errors=True)


def test_a_per_trigger_limit_is_shared_by_backlog_so_a_small_session_is_not_starved(
        driver_dir, two_sessions) -> None:
    """Two sessions with 90 and 10 messages waiting and maxMessagesPerTrigger=20: the batch
    takes 18 and 2, not 20 from the first in session-id order; the same by bytes."""
    channel, client, other = two_sessions
    one, two = client.add_publication(channel, STREAM), other.add_publication(channel, STREAM)
    planner = reader(driver_dir, channel=channel, maxMessagesPerTrigger="20")
    try:
        start = planner.initialOffset()
        wait_for(lambda: len(planner._images()) == 2, what="both sessions")
        entered = planner.latestOffset(start, planner.getDefaultReadLimit())
        big, small = (str(one.session_id), str(two.session_id))
        assert set(entered) == {big, small}
        publish(one, 90)
        publish(two, 10)
        wait_for(lambda: all(image.available_position() - position_of(entered[sid]) ==
                             (90 if sid == big else 10) * FRAME
                             for sid, image in planner._images().items()),
                 what="every message at the planner's host")

        def taken(end: dict) -> dict[str, int]:
            return {sid: (position_of(end[sid]) - position_of(entered[sid])) // FRAME
                    for sid in end}

        assert taken(planner.latestOffset(entered, ReadMaxRows(20))) == {big: 18, small: 2}
        assert taken(planner.latestOffset(entered, ReadMaxBytes(10 * (FRAME - 32)))) == \
            {big: 9, small: 1}
        assert taken(planner.latestOffset(entered, ReadAllAvailable())) == {big: 90, small: 10}
    finally:
        planner.stop()


def test_available_now_stops_at_what_existed_when_it_started(driver, driver_dir,
                                                             two_sessions) -> None:
    """Trigger.AvailableNow: messages published and sessions that appear after it starts are
    not read, however many triggers it takes."""
    channel, client, other = two_sessions
    first = client.add_publication(channel, STREAM)
    planner = reader(driver_dir, channel=channel)
    try:
        wait_for(lambda: planner._images(), what="the first session")
        start = planner.latestOffset(planner.initialOffset(), ReadAllAvailable())
        sid = str(first.session_id)
        publish(first, 30)
        wait_for(lambda: planner._images()[sid].available_position() ==
                 position_of(start[sid]) + 30 * FRAME, what="the messages")
        planner.prepareForTriggerAvailableNow()
        publish(first, 5)
        late = other.add_publication(channel, STREAM)
        publish(late, 5)
        wait_for(lambda: str(late.session_id) in planner._images(), what="the late session")
        end = planner.latestOffset(start, ReadAllAvailable())
        assert set(end) == {sid}
        assert position_of(end[sid]) == position_of(start[sid]) + 30 * FRAME
        assert planner.latestOffset(end, ReadAllAvailable()) == end  # the target holds
    finally:
        planner.stop()


def test_a_trigger_waits_for_min_messages_until_the_max_delay_passes(
        driver, driver_dir, client) -> None:
    """minMessagesPerTrigger=100, maxTriggerDelay=1500ms: the first batch of a run reads at
    once (as Kafka's); then with 60 messages waiting the batch waits (the offsets stay), and
    reads them once the delay since the last read passed; with 100 it reads at once, and the
    delay counts again from there."""
    channel = f"aeron:udp?endpoint=127.0.0.1:{free_port()}"
    publication = client.add_publication(channel, STREAM)
    planner = reader(driver_dir, channel=channel, minMessagesPerTrigger="100",
                     maxTriggerDelay="1500ms")
    try:
        start = planner.initialOffset()
        wait_for(lambda: planner._images(), what="the session")
        start = planner.latestOffset(start, ReadAllAvailable())  # it enters, unread
        sid = str(publication.session_id)
        publish(publication, 10)
        wait_for(lambda: planner._images()[sid].available_position() ==
                 position_of(start[sid]) + 10 * FRAME, what="the first messages")
        start = planner.latestOffset(start, ReadAllAvailable())  # the first batch: at once
        assert position_of(start[sid]) == 10 * FRAME
        first_look = time.monotonic()
        publish(publication, 60, first=10)
        wait_for(lambda: planner._images()[sid].available_position() ==
                 position_of(start[sid]) + 60 * FRAME, what="the messages")
        while time.monotonic() - first_look < 1.2:
            assert planner.latestOffset(start, ReadAllAvailable()) == start
            time.sleep(0.1)
        deadline = time.monotonic() + 5
        while (end := planner.latestOffset(start, ReadAllAvailable())) == start:
            assert time.monotonic() < deadline, "the delay passed and nothing was read"
            time.sleep(0.05)
        assert time.monotonic() - first_look >= 1.5
        assert position_of(end[sid]) == position_of(start[sid]) + 60 * FRAME
        publish(publication, 100)
        wait_for(lambda: planner._images()[sid].available_position() ==
                 position_of(end[sid]) + 100 * FRAME, what="a hundred more")
        later = planner.latestOffset(end, ReadAllAvailable())
        assert position_of(later[sid]) == position_of(end[sid]) + 100 * FRAME
        publish(publication, 10)
        assert planner.latestOffset(later, ReadAllAvailable()) == later  # waits again
    finally:
        planner.stop()


def test_a_querys_lag_is_a_labelled_counter_of_the_bytes_past_its_commit(
        driver, driver_dir, client) -> None:
    """The planner's lag counter (SPARK_READ_LAG, labelled with the reader's queryName):
    the bytes the sessions hold past the committed offsets, as of each latestOffset; freed
    when the query stops."""
    channel = f"aeron:udp?endpoint=127.0.0.1:{free_port()}"
    publication = client.add_publication(channel, STREAM)
    planner = reader(driver_dir, channel=channel, queryName="alerts")
    counters = client.counters
    try:
        start = planner.latestOffset(planner.initialOffset(), ReadAllAvailable())
        wait_for(lambda: planner._images(), what="the session")
        start = planner.latestOffset(start, ReadAllAvailable())
        sid = str(publication.session_id)
        publish(publication, 40)
        wait_for(lambda: planner._images()[sid].available_position() ==
                 position_of(start[sid]) + 40 * FRAME, what="the messages")
        end = planner.latestOffset(start, ReadAllAvailable())
        info = counters.find(CounterType.SPARK_READ_LAG)
        assert info is not None and info.label.startswith("spark-read-lag: alerts ")
        assert counters.get(info.counter_id) == 40 * FRAME
        planner.commit(end)
        planner.latestOffset(end, ReadAllAvailable())
        assert counters.get(info.counter_id) == 0
        lag = counters.reader(info.counter_id, info.registration_id)
    finally:
        planner.stop()
    assert not lag.is_allocated


def test_a_stream_from_a_timestamp_starts_each_session_at_its_first_message_then(
        driver, driver_dir, client) -> None:
    """startingTimestamp on a stream: the initial offsets start each session at its first
    message stamped at or after it, read at once, and the messages before are not read."""
    channel = f"aeron:udp?endpoint=127.0.0.1:{free_port()}"
    publication = client.add_publication(channel, STREAM)
    base_ms = 1_700_000_000_000
    holder = reader(driver_dir, channel=channel)  # holds the stream from the first message
    try:
        holder.initialOffset()
        wait_for(lambda: holder._images(), what="the session")
        for i in range(100):  # message i stamped i ms after base
            data = f"{i:08d}".encode().ljust(FRAME - 32, b".")
            while publication.offer(data, reserved_value=(base_ms + i) * 1_000_000) < 0:
                time.sleep(0.001)
        sid = str(publication.session_id)
        wait_for(lambda: holder._images()[sid].available_position() == 100 * FRAME,
                 what="the messages")
        # With startingPosition too, the timestamp decides, as in Kafka's source.
        planner = reader(driver_dir, channel=channel, startingTimestamp=str(base_ms + 40),
                         startingPosition="earliest")
        planner.options.check_read_kind(streaming=True)
        try:
            start = planner.initialOffset()
            assert position_of(start[sid]) == 40 * FRAME
            end = planner.latestOffset(start, ReadAllAvailable())
            rows = [int(bytes(v)[:8]) for p in planner.partitions(start, end)
                    for batch in read_range(p) for v in batch.column("value").to_pylist()]
            assert rows == list(range(40, 100))
        finally:
            planner.stop()
    finally:
        holder.stop()


def test_one_query_reads_several_streams_each_session_keyed_by_its_stream(
        driver, driver_dir, client) -> None:
    """streamId=A,B: one subscription each on the channel; the offsets key each session as
    STREAM:SESSION (a session id names a publication of one stream), every message of both
    streams is read once, each row with its stream id; a writer refuses a list."""
    channel = f"aeron:udp?endpoint=127.0.0.1:{free_port()}"
    first = client.add_publication(channel, STREAM)
    second = client.add_publication(channel, STREAM + 1)
    planner = reader(driver_dir, channel=channel, streamId=f"{STREAM},{STREAM + 1}",
                     startingPosition="earliest")
    try:
        start = planner.initialOffset()
        wait_for(lambda: len(planner._images()) == 2, what="both streams' sessions")
        publish(first, 30)
        publish(second, 20)
        keys = {f"{STREAM}:{first.session_id}", f"{STREAM + 1}:{second.session_id}"}
        wait_for(lambda: sum(v.available_position() for v in planner._images().values()) ==
                 50 * FRAME, what="the messages")
        rows: dict[int, list[int]] = {STREAM: [], STREAM + 1: []}
        deadline = time.monotonic() + 10
        while sum(map(len, rows.values())) < 50:
            end = planner.latestOffset(start, ReadAllAvailable())
            for partition in planner.partitions(start, end):
                for batch in read_range(partition):
                    for value, stream in zip(batch.column("value").to_pylist(),
                                             batch.column("stream_id").to_pylist(), strict=True):
                        rows[stream].append(int(bytes(value)[:8]))
            planner.commit(end)
            start = end
            assert time.monotonic() < deadline
        assert set(start) == keys
        assert rows == {STREAM: list(range(30)), STREAM + 1: list(range(20))}
        keeper = client.add_subscription(channel, STREAM)  # keeps the image meanwhile
        wait_for(lambda: keeper.images, what="the keeper's image")
    finally:
        planner.stop()
    # The list shrinks to the first stream: the checkpoint's entry of it reads on under its
    # key now (a bare session id), the other stream's is left out; no session is lost.
    alone = reader(driver_dir, channel=channel)
    try:
        wait_for(lambda: alone._images(), what="the image")
        publish(first, 5, first=30)
        deadline = time.monotonic() + 10
        while True:
            end = alone.latestOffset(start, ReadAllAvailable())
            if position_of(end.get(str(first.session_id), 0)) == 35 * FRAME:
                break
            assert time.monotonic() < deadline, end
            time.sleep(0.05)
        assert set(end) == {str(first.session_id)}
        got = [int(bytes(v)[:8]) for p in alone.partitions(start, end)
               for batch in read_range(p) for v in batch.column("value").to_pylist()]
        assert got == list(range(30, 35))
    finally:
        alone.stop()
        keeper.close()
    options = parse_options({"streamId": f"{STREAM},{STREAM + 1}", "channel": channel})
    with pytest.raises(Exception, match="'streamId': a writer publishes to one stream"):
        options.check_direction("write")


@pytest.mark.unit
@pytest.mark.parametrize(("text", "stream_ids"), [
    ("1000-1099", tuple(range(1000, 1100))),
    ("1,5-9", (1, 5, 6, 7, 8, 9)),
    (" 12 , 3 - 4 ,7", (12, 3, 4, 7)),
    ("-10--8,-1-1", (-10, -9, -8, -1, 0, 1)),
    ("2147483646-2147483647", (2147483646, 2147483647)),
    ("-5", (-5,)),
    ("8-8", (8,)),
])
def test_stream_ids_are_read_from_lists_and_inclusive_ranges_in_the_order_named(
        text: str, stream_ids: tuple[int, ...]) -> None:
    assert parse_stream_ids(text) == stream_ids
    options = parse_options({"streamid": text})
    assert options.stream_ids == stream_ids and options.stream_id == stream_ids[0]


@pytest.mark.unit
@pytest.mark.parametrize(("text", "said"), [
    ("10-", "'10-' is not a stream id or a range of them"),
    ("a-b", "'a-b' is not a stream id"),
    ("1-2-3", "'1-2-3' is not a stream id"),
    ("1..5", "'1..5' is not a stream id"),
    ("1,,2", "'1,,2' has an empty part"),
    ("", "'' has an empty part"),
    ("1099-1000", "'1099-1000': the range's first stream id 1099 is after its last, 1000"),
    ("1,5-2147483648", "'5-2147483648': 2147483648 is out of range"),
    ("-2147483649-0", "'-2147483649-0': -2147483649 is out of range"),
    ("1-5,3", "3 is named twice (by '1-5' and '3')"),
    ("1-5,4-9", "4 is named twice (by '1-5' and '4-9')"),
    (f"0-{MAX_READER_STREAMS}", f"'0-{MAX_READER_STREAMS}': names {MAX_READER_STREAMS + 1} "
                                f"streams, which makes {MAX_READER_STREAMS + 1} in all, over "
                                f"MAX_READER_STREAMS, the {MAX_READER_STREAMS} one reader"),
    (f"1-{MAX_READER_STREAMS - 1},-3--2", f"'-3--2': names 2 streams, which makes "
                                          f"{MAX_READER_STREAMS + 1} in all, over "
                                          f"MAX_READER_STREAMS"),
    ("0-4294967295", "'0-4294967295': 4294967295 is out of range"),
])
def test_a_bad_stream_list_or_range_is_refused_naming_the_option_and_the_part(
        text: str, said: str) -> None:
    with pytest.raises(OptionError, match=f"option 'streamId': {re.escape(said)}"):
        parse_options({"streamId": text})


@pytest.mark.unit
def test_as_many_streams_as_the_bound_are_read_and_one_more_is_refused() -> None:
    assert len(parse_stream_ids(f"1-{MAX_READER_STREAMS}")) == MAX_READER_STREAMS
    assert len(parse_stream_ids(f"1-{MAX_READER_STREAMS - 1},-7")) == MAX_READER_STREAMS
    with pytest.raises(OptionError, match="MAX_READER_STREAMS"):
        parse_stream_ids(f"1-{MAX_READER_STREAMS - 1},-7,-9")


@pytest.mark.unit
@given(st.lists(st.integers(-30, 30) | st.integers(-2**31, 2**31 - 1), min_size=1,
                max_size=40, unique=True))
def test_a_list_written_back_compactly_names_the_same_streams_in_the_same_order(
        stream_ids: list[int]) -> None:
    described = describe_stream_ids(stream_ids)
    assert parse_stream_ids(described) == tuple(stream_ids)
    assert len(described.split(",")) <= len(stream_ids)


@pytest.mark.unit
@given(st.integers(-2**31, 2**31 - 200), st.integers(0, 150), st.integers(0, 5))
def test_a_range_names_every_id_from_its_first_to_its_last(first: int, span: int,
                                                           gap: int) -> None:
    """FIRST-LAST, and a list of it with ids either side, name exactly those ids."""
    last = first + span
    assert parse_stream_ids(f"{first}-{last}") == tuple(range(first, last + 1))
    after = last + 1 + gap
    assert parse_stream_ids(f"{first}-{last},{after}") == (*range(first, last + 1), after)
    assert describe_stream_ids(range(first, last + 1)) == \
        (str(first) if span == 0 else f"{first},{last}" if span == 1 else f"{first}-{last}")


@pytest.mark.unit
def test_a_writer_refuses_a_range_of_streams_but_takes_a_range_of_one() -> None:
    with pytest.raises(OptionError, match="'streamId': a writer publishes to one stream"):
        parse_options({"streamId": "10-12"}).check_direction("write")
    parse_options({"streamId": "10-10"}).check_direction("write")


def test_offsets_name_their_log_and_a_checkpoint_of_another_log_is_refused(
        driver, driver_dir, client) -> None:
    """An offset's entry names its log (initial term id, term length); a checkpoint naming
    another log of the same session id is refused however far the new log has grown, or read
    from the oldest held message with failOnDataLoss=false.  Bare positions (older
    checkpoints) are still read."""
    publication = client.add_publication("aeron:ipc?session-id=7", STREAM)
    planner = reader(driver_dir)
    try:
        start = planner.latestOffset(planner.initialOffset(), ReadAllAvailable())
        publish(publication, 20)
        end = planner.latestOffset(start, ReadAllAvailable())
        assert log_of(end["7"]) == (publication.initial_term_id, publication.term_length)
        assert end["7"]["holder"].startswith(socket.gethostname() + "/")
        foreign = {"7": {**end["7"], "log": [publication.initial_term_id + 1,
                                             publication.term_length]}}
        with pytest.raises(Exception, match=r"is not a position of that session.s log.*"
                                            "initial term id"):
            planner.latestOffset(foreign, ReadAllAvailable())
        bare = {"7": position_of(end["7"])}
        assert position_of(planner.latestOffset(bare, ReadAllAvailable())["7"]) == \
            position_of(end["7"])
    finally:
        planner.stop()
    lenient = reader(driver_dir, failOnDataLoss="false")
    try:
        lenient.initialOffset()
        again = lenient.latestOffset(foreign, ReadAllAvailable())
        assert log_of(again["7"]) == (publication.initial_term_id, publication.term_length)
    finally:
        lenient.stop()


def test_min_partitions_splits_a_long_range_at_message_boundaries_read_exactly_once(
        driver_dir, client) -> None:
    """One session, 3000 messages in a batch, minPartitions=4: four ranges that meet end to
    end at message boundaries; read by the executor side, they give every message once."""
    publication = client.add_publication("aeron:ipc?term-length=1m", STREAM)  # 384 KB: within
    planner = reader(driver_dir, minPartitions="4")                       # the credit
    try:
        start = planner.latestOffset(planner.initialOffset(), ReadAllAvailable())
        sid = str(publication.session_id)
        publish(publication, 3000)
        end = planner.latestOffset(start, ReadAllAvailable())
        begin = position_of(start[sid])
        assert position_of(end[sid]) - begin == 3000 * FRAME
        batch_start = start
        parts = planner.partitions(batch_start, end)
        assert len(parts) == 4
        assert parts[0].start == begin and parts[-1].end == position_of(end[sid])
        assert all(a.end == b.start for a, b in itertools.pairwise(parts))
        values = [value for part in parts for batch in read_range(part)
                  for value in batch.column("value").to_pylist()]
        assert values == [f"{i:08d}".encode().ljust(FRAME - 32, b".") for i in range(3000)]
    finally:
        planner.stop()


def test_a_batch_planned_again_over_another_log_is_refused_not_read(driver_dir,
                                                                    client) -> None:
    """A restarted query plans its uncommitted batch again from the offset log, without a
    latestOffset: a range naming another log of the session is refused (data loss), and with
    failOnDataLoss=false skipped, never read from the new log."""
    publication = client.add_publication("aeron:ipc?session-id=8", STREAM)
    planner = reader(driver_dir)
    try:
        start = planner.latestOffset(planner.initialOffset(), ReadAllAvailable())
        publish(publication, 10)
        end = planner.latestOffset(start, ReadAllAvailable())
        other = [publication.initial_term_id + 1, publication.term_length]
        start_x, end_x = ({"8": {**entry["8"], "log": other}} for entry in (start, end))
        with pytest.raises(SlipstreamDataLossError, match="is of the log with initial term id"):
            planner.partitions(start_x, end_x)
        assert len(planner.partitions(start, end)) == 1
    finally:
        planner.stop()
    lenient = reader(driver_dir, failOnDataLoss="false")
    try:
        lenient.initialOffset()
        assert lenient.partitions(start_x, end_x) == []
    finally:
        lenient.stop()
