"""Archived ranges planned as live ones, without a SparkSession: the planner called as Spark
calls it, on real drivers (one per "host", on this machine) and real ``slipstream-archive``
processes recording the stream.

maxMessagesPerTrigger and minPartitions cut a range the archives hold as they cut one the
log holds; startingTimestamp and startingOffsetsByTimestamp reach back as far as the archives
hold (through their time index, then the publishers' stamps); a batch read with ``archive``
and no ``holder`` reads a session that ended (docs/SPARK.md, "Reading older ranges from an
archive").
"""

from __future__ import annotations

import json
import time

import pytest
from helpers import wait_for
from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadMaxBytes, ReadMaxRows
from test_archive import recordings
from test_spark_archive import (  # noqa: F401  (archives, hosts: fixtures)
    MESSAGES_PER_TERM,
    Archive,
    archives,
    first_batches,
    numbers,
    planner,
)
from test_spark_session_ends import (  # noqa: F401  (hosts: a fixture)
    PAYLOAD,
    STREAM,
    TERM,
    Hosts,
    hosts,
)

from slipstream.client import ExclusivePublication, SlipstreamError
from slipstream.spark_bridge.options import parse_options
from slipstream.spark_bridge.reader import LAG, SlipstreamBatchReader, read_range

pytestmark = pytest.mark.timeout(240)


def publish_stamped(hosts: Hosts, count: int, publication=None) -> list[int]:  # noqa: F811
    """Offer ``count`` numbered messages on ``publication`` (default the hosts'), each
    stamped with the time it was offered (ns, the reserved value, as the slipstream writer
    stamps); their numbers."""
    publication = publication or hosts.publication
    numbers_sent = []
    for _ in range(count):
        data = f"{hosts.published:08d}".encode().ljust(PAYLOAD, b".")
        deadline = time.monotonic() + 10
        while publication.offer(data, reserved_value=time.time_ns()) < 0:
            assert time.monotonic() < deadline, "back pressure for 10 s"
            time.sleep(0.0005)
        numbers_sent.append(hosts.published)
        hosts.published += 1
    return numbers_sent


def batches(query, start: dict, hosts: Hosts, until: float, total: int,  # noqa: F811
            limit=None) -> tuple[list[int], list[list[int]], list[list]]:
    """Plan, read and commit batches as Spark does (``limit``: the trigger's read limit)
    until ``total`` messages were read; every message read, per batch, and the partitions."""
    read: list[int] = []
    per_batch: list[list[int]] = []
    planned: list[list] = []
    limit = limit or ReadAllAvailable()
    while time.monotonic() < until and len(read) < total:
        end = query.latestOffset(start, limit)
        if end != start:
            partitions = query.partitions(start, end)
            got = numbers(partitions, hosts, "ingest")
            per_batch.append(got)
            planned.append(partitions)
            read += got
            query.commit(end)
            start = end
        time.sleep(0.02)
    return read, per_batch, planned


def down_for_terms(hosts: Hosts, archives: list[Archive], terms: int  # noqa: F811
                   ) -> tuple[dict, int]:
    """A query read the first 200 messages and went; ``terms`` terms more were published
    (the archives kept the stream flowing); its committed offsets and the total."""
    hosts.publish_from("publisher")
    start, _ = first_batches(hosts, archives, 200)
    down = terms * MESSAGES_PER_TERM
    assert hosts.publish(down) == down
    return start, 200 + down


@pytest.mark.parametrize(("option", "budget"), [("maxMessagesPerTrigger", "300"),
                                                ("maxBytesPerTrigger", str(300 * PAYLOAD))])
def test_an_archived_range_is_cut_by_max_messages_per_trigger_over_several_triggers(
        hosts: Hosts, archives: list[Archive], option: str, budget: str) -> None:  # noqa: F811
    """Six terms went by while the query was down: the restarted query reads them from the
    archive in batches of exactly the budget (300 messages, or their payload bytes), the
    batch at the seam going on into the live log with what is left of it (unless the
    archive's part ended at a batch's end), then the live log: every message once, in
    order."""
    start, total = down_for_terms(hosts, archives, 6)
    query = planner(hosts, archives, in_place=True, **{option: budget})
    try:
        session = str(hosts.publication.session_id)  # type: ignore[union-attr]
        view = query._images()[session]
        committed = int(start[session]["position"])
        assert not view.is_retained(committed), "the log still holds the committed offset"
        # The log's part, after the query's join: within the window its commits hold open.
        assert hosts.publish(150) == 150
        total += 150
        limit = query.getDefaultReadLimit()
        assert isinstance(limit, ReadMaxRows if option == "maxMessagesPerTrigger"
                          else ReadMaxBytes)
        read, per_batch, planned = batches(query, start, hosts, time.monotonic() + 60,
                                           total - 200, limit)
    finally:
        query.stop()
    assert read == list(range(200, total))
    assert all(0 < len(batch) <= 300 for batch in per_batch)
    kinds = [{p.archived is not None for p in partitions} for partitions in planned]
    archived_only = [len(b) for b, kind in zip(per_batch, kinds, strict=True) if kind == {True}]
    assert len(archived_only) >= 6  # over 2,000 archived messages, 300 a trigger
    assert archived_only == [300] * len(archived_only)
    # The seam: the archive's last messages, and the log's with what is left of the budget
    # (as far as the log holds now: the publisher is a window ahead of the query's commits);
    # none where the archive's part ended at a batch's end (seen beside a CPU hog).  Then
    # the log alone.
    seam = len(archived_only)
    mixed = kinds[seam:seam + 1] == [{True, False}]
    assert kinds == ([{True}] * seam + [{True, False}] * int(mixed)
                     + [{False}] * (len(kinds) - seam - int(mixed))), (kinds, per_batch)
    if mixed:
        assert any(p.archived is None and p.end > p.start for p in planned[seam])


def second_session(hosts: Hosts, archives: list[Archive]) -> ExclusivePublication:  # noqa: F811
    """Publishing from the publisher host, recorded by the first archive, and a second
    session of the stream there (an exclusive publication of its own)."""
    hosts.publish_from("publisher")
    wait_for(lambda: recordings(archives[0].directory), timeout=20, what="the recording")
    assert hosts.publisher is not None
    return hosts.publisher.add_exclusive_publication(f"{hosts.channel}|term-length={TERM}",
                                                     STREAM)


def test_min_partitions_splits_an_archived_range_at_message_boundaries(
        hosts: Hosts, archives: list[Archive]) -> None:  # noqa: F811
    """minPartitions=4 on a batch that is mostly archived: its archived range is cut into
    about four partitions of about equal length, at message boundaries (each reads whole
    messages, every message once)."""
    start, total = down_for_terms(hosts, archives, 6)
    query = planner(hosts, archives, in_place=True, minPartitions="4")
    try:
        end = query.latestOffset(start, ReadAllAvailable())
        partitions = query.partitions(start, end)
        archived = [p for p in partitions if p.archived is not None]
        assert 3 <= len(archived) <= 5, [(p.start, p.end) for p in partitions]
        lengths = [p.end - p.start for p in archived]
        assert max(lengths) < 2 * min(lengths)
        read = numbers(partitions, hosts, "ingest")
        query.commit(end)
        # What the ingest host's log had not received yet when the batch was planned (the
        # last 6 messages, beside a CPU hog) comes in the next.
        more, _, _ = batches(query, end, hosts, time.monotonic() + 60, total - 200 - len(read))
        read += more
    finally:
        query.stop()
    assert read == list(range(200, total))


def test_a_starting_timestamp_older_than_the_live_log_reads_every_message_after_it_once(
        hosts: Hosts, archives: list[Archive]) -> None:  # noqa: F811
    """Messages stamped before and after a time T, then ten terms more (the log's term
    rotated many times, so it holds nothing near T), and a session that published after T
    and ended: a new query started at T reads every message stamped at or after T once, in
    order, from the archive and then the log, the ended session's from the archive (how long
    finding the start takes is a benchmark's figure: bench/spark_archive_read.py --part plan)."""
    ended = second_session(hosts, archives)
    publish_stamped(hosts, 300)
    publish_stamped(hosts, 50, ended)
    time.sleep(0.05)
    at_ms = time.time_ns() // 1_000_000 + 1
    time.sleep(0.01)
    ended_after = publish_stamped(hosts, 80, ended)
    ended.close()
    after = publish_stamped(hosts, 10 * MESSAGES_PER_TERM)
    wait_for(lambda: any(not r.is_active for r in recordings(archives[0].directory)),
             timeout=20, what="the ended session's recording stopped")
    query = planner(hosts, archives[:1], in_place=True, startingTimestamp=str(at_ms))
    try:
        start = query.initialOffset()
        session = str(hosts.publication.session_id)  # type: ignore[union-attr]
        view = query._images()[session]
        position = int(start[session]["position"])
        assert position == 300 * 160  # the first message stamped at or after T
        assert view.earliest_position() > position + 5 * TERM, "the log still holds T"
        assert int(start[str(ended.session_id)]["position"]) == 50 * 160
        read, _, planned = batches(query, start, hosts, time.monotonic() + 60,
                                   len(after) + len(ended_after))
    finally:
        query.stop()
    assert sorted(read) == sorted(after + ended_after)  # once each
    live, gone = set(after), set(ended_after)
    assert [n for n in read if n in live] == after  # each session in order
    assert [n for n in read if n in gone] == ended_after
    assert any(p.archived is not None for partitions in planned for p in partitions)


@pytest.mark.parametrize("strategy", ["error", "latest"])
def test_starting_offsets_by_timestamp_start_each_session_at_its_own_time(
        hosts: Hosts, archives: list[Archive], strategy: str) -> None:  # noqa: F811
    """Two sessions named by startingOffsetsByTimestamp, each at a time of its own, older
    than the live log: the first starts at its first message at or after its time (in the
    archive); the second has none after its time: with the strategy error the query fails
    naming it, with latest it starts at its last message and reads nothing of it."""
    other = second_session(hosts, archives)
    publish_stamped(hosts, 100)
    publish_stamped(hosts, 100, other)
    time.sleep(0.05)
    second_ms = time.time_ns() // 1_000_000 + 1
    time.sleep(0.01)
    publish_stamped(hosts, 200)
    time.sleep(0.05)
    first_ms = time.time_ns() // 1_000_000 + 1
    time.sleep(0.01)
    after = publish_stamped(hosts, 6 * MESSAGES_PER_TERM)
    session = hosts.publication.session_id  # type: ignore[union-attr]
    by_time = {str(STREAM): {str(session): first_ms, str(other.session_id): second_ms}}
    query = planner(hosts, archives[:1], in_place=True,
                    startingOffsetsByTimestamp=json.dumps(by_time),
                    startingOffsetsByTimestampStrategy=strategy)
    try:
        if strategy == "error":
            with pytest.raises(SlipstreamError, match=f"session {other.session_id}: no "
                                                      f"message stamped at or after "
                                                      f"{second_ms} ms"):
                query.initialOffset()
            return
        start = query.initialOffset()
        assert int(start[str(session)]["position"]) == 300 * 160
        assert int(start[str(other.session_id)]["position"]) == 100 * 160
        read, _, _ = batches(query, start, hosts, time.monotonic() + 60, len(after))
    finally:
        query.stop()
        other.close()
    assert read == after


def test_a_batch_read_with_no_holder_returns_an_ended_session_whole_from_the_archive(
        hosts: Hosts, archives: list[Archive]) -> None:  # noqa: F811
    """A session publishes several terms and ends; no holder holds anything.  A batch read
    naming only the archive returns that session whole, in order (and the live session's
    recorded range beside it), from startingPosition earliest to its end."""
    ended = second_session(hosts, archives)
    sent = publish_stamped(hosts, 3 * MESSAGES_PER_TERM, ended)
    ended.close()
    wait_for(lambda: any(not r.is_active for r in recordings(archives[0].directory)),
             timeout=20, what="the ended session's recording stopped")
    live = publish_stamped(hosts, 50)
    wait_for(lambda: all(r.is_active or r.stop_position > 0
                         for r in recordings(archives[0].directory)), what="recorded")
    options = parse_options({"streamId": str(STREAM), "channel": hosts.channel,
                             "directory": str(hosts.directories["ingest"]),
                             "archive": archives[0].endpoint,
                             "archiveDir": str(archives[0].directory),
                             "replayTimeoutMs": "3000"})
    options.check_read_kind(streaming=False)
    reader = SlipstreamBatchReader(options)
    partitions = reader.partitions()
    by_session: dict[int, list[int]] = {}
    for partition in partitions:
        assert partition.archived is not None
        partition.directory = str(hosts.directories["ingest"])
        for batch in read_range(partition):
            by_session.setdefault(partition.session_id, []).extend(
                int(value[:8]) for value in batch.column("value").to_pylist())
    assert by_session[ended.session_id] == sent
    recorded_live = by_session[hosts.publication.session_id]  # type: ignore[union-attr]
    assert recorded_live == sorted(recorded_live) and set(recorded_live) <= set(live)


def test_a_batch_read_needs_a_holder_or_an_archive(hosts: Hosts) -> None:  # noqa: F811
    """Neither named: refused naming both options."""
    options = parse_options({"streamId": str(STREAM)})
    with pytest.raises(ValueError, match=r"'holder': is required by a batch read .* no 'archive'"):
        options.check_read_kind(streaming=False)


@pytest.mark.parametrize(("given", "said"), [
    ({"startingOffsetsByTimestamp": "{10: 5}"}, "is not JSON"),
    ({"startingOffsetsByTimestamp": "{}"}, "is not accepted"),
    ({"startingOffsetsByTimestamp": '{"77": {"1": 5}}'}, "stream 77 is not one this reader"),
    ({"startingOffsetsByTimestamp": f'{{"{STREAM}": {{"x": 5}}}}'}, "'x' is not a session"),
    ({"startingOffsetsByTimestamp": f'{{"{STREAM}": {{"1": -5}}}}'}, "-5 is not accepted"),
    ({"startingOffsetsByTimestampStrategy": "earliest"}, "accepted: error, latest"),
])
def test_bad_starting_times_are_refused_naming_the_option(given: dict[str, str], said: str
                                                          ) -> None:
    """A starting time per session that is not Kafka's form or names a stream the reader
    does not read; a strategy not known: refused naming it."""
    from slipstream.spark_bridge.options import OptionError

    name = "startingOffsetsByTimestampStrategy" if "Strategy" in next(iter(given)) \
        else "startingOffsetsByTimestamp"
    with pytest.raises(OptionError, match=f"'{name}'.*{said}"):
        parse_options({"streamId": str(STREAM), **given}).check_read_kind(streaming=True)


def test_starting_times_per_session_are_keyed_by_stream_and_session() -> None:
    """Kafka's form, topic to partition to ms: here stream id to session id to ms."""
    options = parse_options({"streamId": f"{STREAM},7", "startingOffsetsByTimestamp":
                             json.dumps({str(STREAM): {"-3": 1000}, "7": {"4": 2000}})})
    assert options.starting_timestamps_ns == {(STREAM, -3): 1000 * 10**6, (7, 4): 2000 * 10**6}
    assert options.timestamp_strategy == "error"


@pytest.mark.spark
def test_spark_read_with_only_an_archive_returns_an_ended_session_whole(
        spark, hosts: Hosts, archives: list[Archive]) -> None:  # noqa: F811
    """The user's path: spark.read.format("slipstream") with `archive` (and archiveDir) and
    no holder, after a session ended, in a local[2] Spark session: its rows, whole and in
    order, with its session id and publisher stamps."""
    ended = second_session(hosts, archives)
    sent = publish_stamped(hosts, 2 * MESSAGES_PER_TERM, ended)
    ended.close()
    wait_for(lambda: any(not r.is_active for r in recordings(archives[0].directory)),
             timeout=20, what="the ended session's recording stopped")
    rows = (spark.read.format("slipstream").option("streamId", str(STREAM))
            .option("channel", hosts.channel)
            .option("directory", str(hosts.directories["ingest"]))
            .option("archive", archives[0].endpoint)
            .option("archiveDir", str(archives[0].directory))
            .option("replayTimeoutMs", "5000").load()
            .where(f"session_id = {ended.session_id}")
            .orderBy("position").select("value").collect())
    assert [int(bytes(row.value)[:8]) for row in rows] == sent


def batch_read(hosts: Hosts, archives: list[Archive], **given: str  # noqa: F811
               ) -> dict[int, list[int]]:
    """A batch read with ``archive`` (and archiveDir) and no holder, planned and read as
    Spark does: the numbers read, per session."""
    options = parse_options({"streamId": str(STREAM), "channel": hosts.channel,
                             "directory": str(hosts.directories["ingest"]),
                             "archive": archives[0].endpoint,
                             "archiveDir": str(archives[0].directory),
                             "replayTimeoutMs": "3000", **given})
    options.check_read_kind(streaming=False)
    by_session: dict[int, list[int]] = {}
    for partition in SlipstreamBatchReader(options).partitions():
        partition.directory = str(hosts.directories["ingest"])
        for batch in read_range(partition):
            by_session.setdefault(partition.session_id, []).extend(
                int(value[:8]) for value in batch.column("value").to_pylist())
    return by_session


def test_a_batch_read_at_a_starting_timestamp_leaves_out_a_session_that_ended_before_it(
        hosts: Hosts, archives: list[Archive]) -> None:  # noqa: F811
    """A session recorded over two terms ended before T; the live one published before and
    after T.  A batch read from the archive at startingTimestamp T (strategy error) reads the
    live session's messages from T and leaves the ended one out, as a stream started at T
    does; named by startingOffsetsByTimestamp, that session still fails the read."""
    ended = second_session(hosts, archives)
    publish_stamped(hosts, 2 * MESSAGES_PER_TERM, ended)
    ended.close()
    publish_stamped(hosts, 100)
    wait_for(lambda: any(not r.is_active for r in recordings(archives[0].directory)),
             timeout=20, what="the ended session's recording stopped")
    time.sleep(0.05)
    at_ms = time.time_ns() // 1_000_000 + 1
    time.sleep(0.01)
    after = publish_stamped(hosts, 60)
    live = hosts.publication.session_id  # type: ignore[union-attr]
    read: dict[int, list[int]] = {}

    def all_recorded() -> bool:
        read.clear()
        read.update(batch_read(hosts, archives, startingTimestamp=str(at_ms)))
        return read.get(live, [])[-1:] == after[-1:]

    wait_for(all_recorded, timeout=20, what="the live session's messages recorded")
    assert set(read) <= {live, ended.session_id}
    assert read.get(ended.session_id, []) == []
    assert read[live] == after
    by_time = {str(STREAM): {str(ended.session_id): at_ms}}
    with pytest.raises(SlipstreamError, match=f"session {ended.session_id}: no message "
                                              f"stamped at or after {at_ms} ms"):
        batch_read(hosts, archives, startingOffsetsByTimestamp=json.dumps(by_time))


def test_a_read_task_closed_early_stops_its_archive_replay_at_once(
        hosts: Hosts, archives: list[Archive]) -> None:  # noqa: F811
    """A task reading an ended session's six terms replayed from the archive (on a host
    without the archive's directory) is closed after its first batch, as Spark closes a
    cancelled task's iterator: the archive's replay stops then, not when the garbage
    collector happens to find the reader (collection is off while this is checked)."""
    import gc

    from slipstream.archive.client import ArchiveClient
    from slipstream.archive.settings import DEFAULT_CONTROL_STREAM_ID
    from slipstream.client import Client

    ended = second_session(hosts, archives)
    publish_stamped(hosts, 6 * MESSAGES_PER_TERM, ended)
    ended.close()
    wait_for(lambda: any(not r.is_active for r in recordings(archives[0].directory)),
             timeout=20, what="the ended session's recording stopped")
    options = parse_options({"streamId": str(STREAM), "channel": hosts.channel,
                             "directory": str(hosts.directories["ingest"]),
                             "archive": archives[0].endpoint, "replayTimeoutMs": "3000"})
    partition = next(p for p in SlipstreamBatchReader(options).partitions()
                     if p.session_id == ended.session_id)
    partition.directory = str(hosts.directories["spark"])
    with Client.connect(hosts.directories["ingest"]) as client, \
            ArchiveClient(client, "127.0.0.1", archives[0].port,
                          DEFAULT_CONTROL_STREAM_ID, timeout_s=5) as archive:
        rows = read_range(partition)
        gc.disable()
        try:
            first = next(rows)
            assert first.num_rows > 0
            assert archive._call("replays"), "no replay under way after the first batch"
            rows.close()
            wait_for(lambda: not archive._call("replays"), timeout=3,
                     what="the replay stopped")
        finally:
            gc.enable()


def test_a_time_searched_before_an_end_older_than_the_log_is_not_found_past_that_end(
        hosts: Hosts, archives: list[Archive]) -> None:  # noqa: F811
    """The first message stamped at or after T is the 100th; ten terms later the log holds
    nothing near it.  Searched before an end at the 50th message (older than the log), the
    time has no message there: the archives are not searched past that end."""
    from slipstream.spark_bridge.planning import position_at_time

    hosts.publish_from("publisher")
    wait_for(lambda: recordings(archives[0].directory), timeout=20, what="the recording")
    publish_stamped(hosts, 100)
    time.sleep(0.05)
    at_ns = time.time_ns()
    time.sleep(0.01)
    publish_stamped(hosts, 10 * MESSAGES_PER_TERM)
    query = planner(hosts, archives[:1], in_place=True)
    try:
        query.initialOffset()
        session = hosts.publication.session_id  # type: ignore[union-attr]
        view = query._images()[str(session)]
        framing = view.identity.framing
        assert view.earliest_position() > 100 * 160 + 5 * TERM, "the log still holds T"
        wait_for(lambda: position_at_time(view, query._archives, STREAM, session, framing,
                                          at_ns) == 100 * 160,
                 timeout=20, what="T found in the archive")
        assert position_at_time(view, query._archives, STREAM, session, framing, at_ns,
                                50 * 160) is None
        assert position_at_time(view, query._archives, STREAM, session, framing, at_ns,
                                150 * 160) == 100 * 160
    finally:
        query.stop()


def test_a_stream_started_at_json_offsets_reads_a_named_session_only_the_archive_holds(
        hosts: Hosts, archives: list[Archive], caplog) -> None:  # noqa: F811
    """A session published two terms and ended; the archive holds it, the log does not.  A
    stream whose startingOffsets names it at its 100th message reads it from there to its
    end from the archive, once each, in order; a session named that nobody has is waited
    for, with a warning naming it; one named past the ended session's end is refused."""
    ended = second_session(hosts, archives)
    sent = publish_stamped(hosts, 2 * MESSAGES_PER_TERM, ended)
    ended.close()
    wait_for(lambda: any(not r.is_active for r in recordings(archives[0].directory)),
             timeout=20, what="the ended session's recording stopped")
    nobody = 4711
    offsets = {str(STREAM): {str(ended.session_id): 100 * 160, str(nobody): 0}}
    query = planner(hosts, archives[:1], in_place=True, startingOffsets=json.dumps(offsets))
    try:
        wait_for(lambda: str(ended.session_id) not in query._images(), timeout=30,
                 what="the ended session's image gone from the log")
        with caplog.at_level("WARNING", logger="slipstream.spark_bridge"):
            start = query.initialOffset()
        assert int(start[str(ended.session_id)]["position"]) == 100 * 160
        assert str(nobody) not in start
        assert f"session {nobody}: startingOffsets 0: no session {nobody}" in caplog.text
        read, _, planned = batches(query, start, hosts, time.monotonic() + 60,
                                   len(sent) - 100)
    finally:
        query.stop()
    assert read == sent[100:]
    assert all(p.archived is not None for partitions in planned for p in partitions
               if p.session_id == ended.session_id)
    past = {str(STREAM): {str(ended.session_id): (len(sent) + 10) * 160}}
    query = planner(hosts, archives[:1], in_place=True, startingOffsets=json.dumps(past))
    try:
        wait_for(lambda: str(ended.session_id) not in query._images(), timeout=30,
                 what="the ended session's image gone from the log")
        with pytest.raises(SlipstreamError, match=f"session {ended.session_id}: "
                                                  f"startingOffsets {(len(sent) + 10) * 160} "
                                                  f"is past what the archives recorded"):
            query.initialOffset()
    finally:
        query.stop()


def test_the_lag_counts_what_the_archives_hold_of_the_sessions_they_catch_up(
        hosts: Hosts, archives: list[Archive]) -> None:  # noqa: F811
    """A query read 200 messages and went; six terms went by, and a session published a
    term and a half and ended.  The restarted query's first batch (maxOffsetsPerTrigger=300)
    reads 300 from the archive: the progress then shows the live session behind by every
    message after them, counted through the archive and the log, and the ended session,
    which only the archive holds, behind by all of its messages: counted, not estimated."""
    start, total = down_for_terms(hosts, archives, 6)
    assert hosts.publisher is not None
    ended = hosts.publisher.add_exclusive_publication(f"{hosts.channel}|term-length={TERM}",
                                                      STREAM)
    gone = publish_stamped(hosts, MESSAGES_PER_TERM + MESSAGES_PER_TERM // 2, ended)
    ended.close()
    wait_for(lambda: any(not r.is_active for r in recordings(archives[0].directory)),
             timeout=20, what="the ended session's recording stopped")
    query = planner(hosts, archives[:1], in_place=True, maxMessagesPerTrigger="300")
    try:
        live, other = str(hosts.publication.session_id), str(ended.session_id)  # type: ignore[union-attr]
        wait_for(lambda: other not in query._images(), timeout=30,
                 what="the ended session's image gone from the log")
        end = query.latestOffset(start, query.getDefaultReadLimit())
        read = numbers(query.partitions(start, end), hosts, "ingest")
        assert read == list(range(200, 500))
        latest = query.reportLatestOffset()
    finally:
        query.stop()
    assert latest is not None
    lag = latest[LAG]
    behind = {sid: int(latest[sid]) - int(end[sid]["position"]) for sid in (live, other)}
    assert behind[other] > MESSAGES_PER_TERM * 160  # all of it: entered, unread
    assert lag["sessions"] == {live: {"messages": total - 500, "bytes": behind[live]},
                               other: {"messages": len(gone), "bytes": behind[other]}}
    assert lag["estimated"] is False
    assert lag["maxOffsetsBehindLatest"] == max(total - 500, len(gone))


@pytest.mark.parametrize(("given", "call_key"), [
    ({"channel": "aeron:udp?endpoint=10.0.0.2:40123|key=k1"}, "k1"),
    ({"channel": "aeron:udp?endpoint=10.0.0.2:40123|key=k1", "archiveKey": "k1"}, "k1"),
    ({"channel": "aeron:udp?endpoint=10.0.0.2:40123", "archiveKey": "k2"}, "k2"),
    ({"channel": "aeron:udp?endpoint=10.0.0.2:40123"}, None),
])
def test_the_calls_key_is_the_streams_or_archive_key_for_a_plain_stream(
        given: dict[str, str], call_key: str | None) -> None:
    """The archives' and holder's calls are sealed under a keyed stream's key (its
    recordings are answered under no other); a plain stream's under archiveKey, if given."""
    assert parse_options({"streamId": str(STREAM), "archive": "10.0.0.3:8012",
                          **given}).call_key == call_key


@pytest.mark.parametrize(("given", "said"), [
    ({"channel": "aeron:udp?endpoint=10.0.0.2:40123|key=k1", "archiveKey": "k2"},
     "the stream is of key=k1"),
    ({"archiveKey": "a/b"}, "is not a key name"),
])
def test_an_archive_key_the_archive_would_refuse_is_refused_naming_archive_key(
        given: dict[str, str], said: str) -> None:
    from slipstream.spark_bridge.options import OptionError

    with pytest.raises(OptionError, match=f"'archiveKey'.*{said}"):
        parse_options({"streamId": str(STREAM), **given})
