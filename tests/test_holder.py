"""The ingest host's archive holding a stream for read queries (``slipstream-archive run``,
the calls of :mod:`slipstream.archive.holding`) and a query planned through it, without a
SparkSession: the planner and the read tasks are on another "host".

Two drivers on this machine stand for two hosts: the ingest host's (the archive runs beside
it as the real console script, its control stream at 127.0.0.2) and the Spark driver's, which
also publishes the stream over UDP to the ingest host.  The planner reaches the holder only through
its own driver; its tasks read the ranges by replay (another driver) or in place (the ingest
driver's directory: the same driver run as the holder's).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import FAST_DRIVER_SETTINGS, free_port, start_holding_archive, wait_for
from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadMaxRows

from slipstream.archive.client import ArchiveClient
from slipstream.archive.reading import RecordingLostError
from slipstream.archive.settings import (
    DEFAULT_CONTROL_STREAM_ID,
    ArchiveSettingsError,
    HoldSpec,
    load_settings,
)
from slipstream.client import BufferClaim, Client, SlipstreamError
from slipstream.client.counters import SystemCounter, read_system_counters
from slipstream.client.holding import CallError, HolderLink, small_channel
from slipstream.client.logbuffer import LogIdentity
from slipstream.daemon.driver import MediaDriver
from slipstream.spark_bridge.options import OptionError, parse_options
from slipstream.spark_bridge.reader import (
    SlipstreamBatchReader,
    SlipstreamDataLossError,
    SlipstreamPartition,
    SlipstreamStreamReader,
    position_of,
    read_range,
)

pytestmark = pytest.mark.timeout(180)

# Drawn free, not fixed: other checkouts' tests may run on this machine at the same time.
HOLDER_PORT = free_port()
DATA_PORT = next(port for port in iter(free_port, None) if port != HOLDER_PORT)
STREAM = 4401
CHANNEL = f"aeron:udp?endpoint=127.0.0.2:{DATA_PORT}"
PAYLOAD = 100
FRAME = 160  # a message's frame: 100 bytes and the 32-byte header, aligned to 32
TERM = 64 * 1024  # the publication's: its receiver window is half of it


class Ingest:
    """The ingest host's driver and its archive holding streams (``holder``: the process),
    and the Spark host's driver with a publisher sending the stream to the ingest host."""

    def __init__(self, ingest_dir: Path, spark_dir: Path, archive_dir: Path,
                 **settings: Any) -> None:
        self.ingest_dir, self.spark_dir = ingest_dir, spark_dir
        self.holder = start_holding_archive(ingest_dir, "127.0.0.2", HOLDER_PORT, archive_dir,
                                            **settings)
        self.client = Client.connect(spark_dir)
        self.publication = self.client.add_publication(f"{CHANNEL}|term-length={TERM}",
                                                       STREAM)
        self.published = 0

    def options(self, **extra: str) -> dict[str, str]:
        return {"streamId": str(STREAM), "channel": CHANNEL, "directory": str(self.spark_dir),
                "holder": f"127.0.0.2:{HOLDER_PORT}", "replayTimeoutMs": "10000", **extra}

    def publish(self, count: int, *, timeout_s: float = 10.0) -> int:
        """Offer ``count`` messages (numbered on from the last); returns how many went before
        ``timeout_s`` of back pressure."""
        for went in range(count):
            deadline = time.monotonic() + timeout_s
            message = f"{self.published:08d}".encode().ljust(PAYLOAD, b".")
            stamp = (self.published + 1) * 1000  # ns: message n is stamped n + 1 µs
            while self.publication.offer(message, reserved_value=stamp) < 0:
                if time.monotonic() > deadline:
                    return went
                time.sleep(0.0005)
            self.published += 1
        return count

    def close(self) -> None:
        self.client.close()
        if self.holder.poll() is None:
            self.holder.send_signal(signal.SIGTERM)
            try:
                self.holder.wait(10)
            except subprocess.TimeoutExpired:
                self.holder.kill()
                self.holder.wait()


@contextlib.contextmanager
def two_hosts(archive_dir: Path, **settings: Any) -> Iterator[Ingest]:
    """The two hosts, the archive given ``settings`` (:func:`helpers.start_holding_archive`'s
    ``holds``, ``release_after_s``)."""
    directories = [Path("/dev/shm") / f"slipstream-hold-{uuid.uuid4().hex[:6]}-{n}"
                   for n in ("ingest", "spark")]
    try:
        with MediaDriver.launch(directory=directories[0], **FAST_DRIVER_SETTINGS), \
                MediaDriver.launch(directory=directories[1], **FAST_DRIVER_SETTINGS):
            hosts = Ingest(*directories, archive_dir, **settings)
            try:
                yield hosts
            finally:
                hosts.close()
                if hosts.holder.stdout is not None and not hosts.holder.stdout.closed:
                    print(hosts.holder.stdout.read())
    finally:
        for directory in directories:
            shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def ingest(tmp_path: Path) -> Iterator[Ingest]:
    with two_hosts(tmp_path / "archive") as hosts:
        yield hosts


@pytest.fixture
def held_from_start(tmp_path: Path) -> Iterator[Ingest]:
    """The archive holds the stream from its start (``[[hold]]``), releasing an idle group
    after 2 s."""
    with two_hosts(tmp_path / "archive", holds=((CHANNEL, STREAM),),
                   release_after_s=2.0) as hosts:
        yield hosts


@contextlib.contextmanager
def holding_archive_calls(ingest: Ingest) -> Iterator[tuple[HolderLink, ArchiveClient]]:
    """From the Spark host: a call link to the holding archive and its archive client."""
    client = Client.connect(ingest.spark_dir)
    link = HolderLink(client, "127.0.0.2", HOLDER_PORT, DEFAULT_CONTROL_STREAM_ID,
                      timeout_s=10)
    archive = ArchiveClient(client, "127.0.0.2", HOLDER_PORT, timeout_s=10)
    try:
        yield link, archive
    finally:
        archive.close()
        link.close()
        client.close()


def values(partitions: list, directory: Path | None = None) -> list[tuple[bytes, int, int]]:
    """The rows of ``partitions`` read by tasks on the host of ``directory`` (the partition's
    own directory when None): value, position, reserved value (the publisher's stamp, µs)."""
    rows = []
    for partition in partitions:
        if directory is not None:
            partition.directory = str(directory)
        for batch in read_range(partition):
            rows.extend(zip(batch.column("value").to_pylist(),
                            batch.column("position").to_pylist(),
                            batch.column("timestamp").cast("int64").to_pylist(), strict=True))
    return rows


def numbers(rows: list[tuple[bytes, int, int]]) -> list[int]:
    return [int(value[:8]) for value, _, _ in rows]


def test_a_query_planned_through_the_holder_reads_every_message_once_across_a_restart(
        ingest: Ingest) -> None:
    """Ten receiver windows (five terms) published to the ingest host, read by a planner on
    another host through the holder: every message once, in order, with the publisher's
    stamps.  A planner stopped mid-stream and made anew from the last committed offsets (a
    Spark driver restarted elsewhere) goes on where it stopped, and nothing published
    meanwhile is lost: the holder's position held the stream, so the publisher got one window
    (and its own half term) in, then waited."""
    total = 10 * (TERM // 2) // FRAME
    planner = SlipstreamStreamReader(parse_options(ingest.options(maxMessagesPerTrigger="150")))
    start = planner.initialOffset()
    sent = threading.Thread(target=ingest.publish, args=(total // 2, ), kwargs={"timeout_s": 60})
    sent.start()
    read: list[tuple[bytes, int, int]] = []
    try:
        while len(read) < total // 2:
            end = planner.latestOffset(start, ReadMaxRows(150))
            partitions = planner.partitions(start, end)
            read.extend(values(partitions, ingest.spark_dir))  # replayed: another host
            planner.commit(end)
            start = end
        sent.join(60)
        assert not sent.is_alive()
    finally:
        planner.stop()
    assert numbers(read) == list(range(total // 2))
    # Down: the holder holds the stream; the publisher gets one window in, then waits.
    in_while_down = ingest.publish(total, timeout_s=1.0)
    assert 0 < in_while_down < total // 3, in_while_down
    planner = SlipstreamStreamReader(parse_options(ingest.options()))
    try:
        rest_thread = threading.Thread(target=ingest.publish,
                                       args=(total - total // 2 - in_while_down,),
                                       kwargs={"timeout_s": 60})
        rest_thread.start()
        while len(read) < total:
            end = planner.latestOffset(start, ReadAllAvailable())
            partitions = planner.partitions(start, end)
            # Half the tasks on the ingest host (in place), half elsewhere (replayed).
            for i, partition in enumerate(partitions):
                read.extend(values([partition], ingest.ingest_dir if i % 2 else
                                   ingest.spark_dir))
            planner.commit(end)
            start = end
        rest_thread.join(60)
    finally:
        planner.stop()
    assert numbers(read) == list(range(total))
    positions = [position for _, position, _ in read]
    assert positions == sorted(set(positions))
    assert [stamp for _, _, stamp in read] == [n + 1 for n in range(total)]


def test_a_batch_read_reads_the_held_range_between_its_positions(ingest: Ingest) -> None:
    """``spark.read`` through the holder: earliest to latest by default, or the per-session
    positions given; an ending position past what the log holds, a session the holder has
    not, and a stream it does not hold are refused naming them."""
    with pytest.raises(Exception, match=f"stream {STREAM} on .* is not held here"):
        SlipstreamBatchReader(parse_options(ingest.options())).partitions()
    planner = SlipstreamStreamReader(parse_options(ingest.options()))
    try:
        planner.initialOffset()  # the query holds the stream at the holder
        assert ingest.publish(50) == 50
        wait_for(lambda: planner.reportLatestOffset(), what="the session at the holder")
        sid = next(iter(planner.reportLatestOffset()))
        wait_for(lambda: planner.reportLatestOffset()[sid] == 50 * FRAME,
                 what="all 50 at the holder")
        whole = values(SlipstreamBatchReader(parse_options(ingest.options())).partitions())
        assert numbers(whole) == list(range(50))
        middle = (whole[9][1], whole[19][1])
        given = SlipstreamBatchReader(parse_options(ingest.options(
            startingPosition=json.dumps({sid: middle[0]}),
            endingPosition=json.dumps({sid: middle[1]}))))
        assert numbers(values(given.partitions(), ingest.ingest_dir)) == list(range(10, 20))
        # Kafka's JSON: the stream's session, -2 earliest and -1 latest.
        for starting, ending, expected in ((-2, -1, range(50)), (middle[0], -1, range(10, 50)),
                                           (-1, -1, range(0))):
            kafka = SlipstreamBatchReader(parse_options(ingest.options(
                startingOffsets=json.dumps({str(STREAM): {sid: starting}}),
                endingOffsets=json.dumps({str(STREAM): {sid: ending}}))))
            assert numbers(values(kafka.partitions(), ingest.ingest_dir)) == list(expected)
        with pytest.raises(Exception, match=r"endingPosition .* is past the last whole message"):
            SlipstreamBatchReader(parse_options(ingest.options(
                endingPosition=json.dumps({sid: whole[-1][1] + 4096})))).partitions()
        with pytest.raises(Exception, match="no session 12345 at the holder"):
            SlipstreamBatchReader(parse_options(ingest.options(
                startingPosition=json.dumps({"12345": 0})))).partitions()
    finally:
        planner.stop()
    with pytest.raises(OptionError, match="'holder': is required by a batch read"):
        parse_options({"streamId": "1"}).check_read_kind(streaming=False)


def test_a_batch_read_between_two_timestamps_reads_the_messages_stamped_between(
        ingest: Ingest) -> None:
    """startingTimestamp / endingTimestamp (ms since the epoch) on a batch read: each session
    from its first message stamped at or after the start to its first at or after the end,
    with their position options given too (the timestamps decide)."""
    planner = SlipstreamStreamReader(parse_options(ingest.options()))
    base_ms = 1_700_000_000_000
    try:
        planner.initialOffset()
        for i in range(150):  # message i stamped i ms after base
            data = f"{i:08d}".encode().ljust(PAYLOAD, b".")
            deadline = time.monotonic() + 10
            while ingest.publication.offer(data, reserved_value=(base_ms + i) * 10**6) < 0:
                assert time.monotonic() < deadline
                time.sleep(0.001)
        wait_for(lambda: next(iter((planner.reportLatestOffset() or {0: 0}).values())) ==
                 150 * FRAME, what="all at the holder")
        between = SlipstreamBatchReader(parse_options(ingest.options(
            startingTimestamp=str(base_ms + 40), endingTimestamp=str(base_ms + 90))))
        assert numbers(values(between.partitions())) == list(range(40, 90))
        # With their position options too, the timestamps decide, as in Kafka's source.
        both = SlipstreamBatchReader(parse_options(ingest.options(
            startingTimestamp=str(base_ms + 40), startingPosition="earliest",
            endingTimestamp=str(base_ms + 90), endingPosition="latest")))
        both.options.check_read_kind(streaming=False)
        assert numbers(values(both.partitions())) == list(range(40, 90))
        with pytest.raises(OptionError, match="'endingTimestamp': applies to batch reads"):
            parse_options(ingest.options(endingTimestamp="1")).check_read_kind(streaming=True)
    finally:
        planner.stop()


def test_a_group_that_joins_later_reads_from_earliest_what_the_log_still_holds(
        ingest: Ingest) -> None:
    """One group holds the stream from its first message; a second group joins after 50, its
    query starting at ``earliest``: the holder answers its questions about positions before
    its own join (the log holds them: the first group's position keeps them), and its first
    batch reads those 50 and the 20 after, once, in order."""
    first = SlipstreamStreamReader(parse_options(ingest.options()))
    try:
        first.initialOffset()
        assert ingest.publish(50) == 50
        wait_for(lambda: list(first.reportLatestOffset().values()) == [50 * FRAME],
                 what="the 50 at the holder")
        second = SlipstreamStreamReader(parse_options(ingest.options(
            holderGroup="audit", startingPosition="earliest")))
        try:
            start = second.initialOffset()
            assert [position_of(entry) for entry in start.values()] == [0]
            assert ingest.publish(20) == 20
            wait_for(lambda: list(second.reportLatestOffset().values()) == [70 * FRAME],
                     what="the 70 at the holder for the second group")
            end = second.latestOffset(start, ReadAllAvailable())
            assert numbers(values(second.partitions(start, end), ingest.spark_dir)) == \
                list(range(70))
        finally:
            second.stop()
    finally:
        first.stop()


def test_a_query_asking_more_pieces_than_the_holder_splits_into_reads_every_message_once(
        ingest: Ingest) -> None:
    """``minPartitions`` over the most pieces a holder splits a session's range into (256):
    the planner asks for that many, and the batch reads every message once, in order."""
    planner = SlipstreamStreamReader(parse_options(ingest.options(minPartitions="300")))
    try:
        start = planner.initialOffset()
        assert ingest.publish(150) == 150
        wait_for(lambda: list(planner.reportLatestOffset().values()) == [150 * FRAME],
                 what="the 150 at the holder")
        read: list[tuple[bytes, int, int]] = []
        tasks = []
        deadline = time.monotonic() + 30
        while len(read) < 150:  # the session enters in the first batch, is read in the next
            assert time.monotonic() < deadline, f"read {len(read)} of 150"
            end = planner.latestOffset(start, ReadAllAvailable())
            partitions = planner.partitions(start, end)
            tasks.append(len(partitions))
            read.extend(values(partitions, ingest.spark_dir))
            planner.commit(end)
            start = end
        assert numbers(read) == list(range(150)) and max(tasks) > 1
    finally:
        planner.stop()


def test_the_holder_refuses_a_question_about_another_log_and_drops_a_malformed_call(
        ingest: Ingest) -> None:
    """A view question naming another log of the session is answered with an error naming
    both logs; one whose position is no frame boundary of the held log, or that asks for too
    many pieces, is refused, and one about a stream not held makes no hold; a call that is not
    JSON, or lacks its fields, is dropped (counted in the holder's log) and the holder goes on
    answering."""
    client = Client.connect(ingest.spark_dir)
    link = HolderLink(client, "127.0.0.2", HOLDER_PORT, DEFAULT_CONTROL_STREAM_ID,
                      timeout_s=10)
    try:
        key = {"channel": CHANNEL, "stream_id": STREAM, "group": "audit"}
        link.call("state", **key)
        ingest.publish(5)
        wait_for(lambda: link.call("state", **key)["sessions"], what="the session")
        sid, state = next(iter(link.call("state", **key)["sessions"].items()))
        with pytest.raises(CallError, match=r"initial term id .* not \[1, 2\]"):
            link.call("view", **key, session_id=int(sid), log=[1, 2], method="is_retained",
                      args={"position": 0})
        with pytest.raises(CallError, match="method 'unlink' is not one of"):
            link.call("view", **key, session_id=int(sid),
                      log=[state["initial_term_id"], state["term_length"]], method="unlink",
                      args={})
        identity = [state["initial_term_id"], state["term_length"]]
        with pytest.raises(CallError, match="position 13 is not a frame boundary"):
            link.call("view", **key, session_id=int(sid), log=identity,
                      method="is_retained", args={"position": 13})
        with pytest.raises(CallError, match="10000 pieces, over 256"):
            link.call("view", **key, session_id=int(sid), log=identity,
                      method="split_points", args={"begin": 0, "stop": 32, "pieces": 10_000})
        stranger = {**key, "group": "nobody"}
        for _ in range(2):  # a question about a stream not held makes no hold
            with pytest.raises(CallError, match="is not held here for group 'nobody'"):
                link.call("view", **stranger, session_id=int(sid), log=identity,
                          method="is_retained", args={"position": 0})
        with pytest.raises(CallError, match="is not held here for group 'nobody'"):
            link.call("state", **stranger, hold=False)
        control = client.add_publication(small_channel(
            f"aeron:udp?endpoint=127.0.0.2:{HOLDER_PORT}"), DEFAULT_CONTROL_STREAM_ID)
        wait_for(lambda: control.is_connected, what="the holder's control stream")
        for junk in (b"\xff\x00 not json", b'{"kind": "call", "version": 1}', b"[]"):
            while control.offer(junk) < 0:
                time.sleep(0.001)
        assert link.call("state", **key)["sessions"][sid]["stream_id"] == STREAM
        control.close()
    finally:
        link.close()
        client.close()
    ingest.holder.send_signal(signal.SIGTERM)
    output, _ = ingest.holder.communicate(timeout=10)
    # Logged once for the caller in the interval (the others held back, counted).
    assert output.count("malformed, dropped") == 1, output
    assert ingest.holder.returncode == 0


def test_a_stream_held_by_the_settings_holds_its_publisher_until_released_when_idle(
        held_from_start: Ingest) -> None:
    """A ``[[hold]]`` holds the stream from the archive's start, before any query asked: the
    publisher gets one receiver window (and its own half term) in, then waits.  No query
    calls for ``release_after`` (2 s): the group is released, and a state call that makes no
    hold is answered that the stream is not held, naming what is."""
    ingest = held_from_start
    client = Client.connect(ingest.spark_dir)
    link = HolderLink(client, "127.0.0.2", HOLDER_PORT, DEFAULT_CONTROL_STREAM_ID,
                      timeout_s=10)
    try:
        key = {"channel": CHANNEL, "stream_id": STREAM, "group": "spark"}
        total = 4 * TERM // FRAME  # four terms: eight receiver windows
        went = ingest.publish(total, timeout_s=1.0)
        assert 0 < went < total // 2, went  # one window, and the publisher's half term
        time.sleep(4.0)  # idle past release_after, and the next housekeeping pass
        with pytest.raises(CallError, match="is not held here for group 'spark' "
                                            r"\(held: none\)"):
            link.call("state", **key, hold=False)
    finally:
        link.close()
        client.close()


def test_a_replay_of_a_range_the_live_log_no_longer_holds_is_refused_lost_or_skipped(
        ingest: Ingest) -> None:
    """The group commits past four terms of the stream, so the live log no longer holds its
    first messages.  A replay asked from position 0 is refused ``lost`` with what the log
    holds, from its first whole message; a read task on another host fails with
    ``failOnDataLoss=true``, naming the range, and with ``false`` skips to that message,
    reads every message from there once, and counts the skip."""
    with holding_archive_calls(ingest) as (link, archive):
        key = {"channel": CHANNEL, "stream_id": STREAM, "group": "spark"}
        link.call("state", **key)
        total = 4 * TERM // FRAME
        while ingest.published < total:
            ingest.publish(min(100, total - ingest.published), timeout_s=0.2)
            sessions = link.call("state", **key)["sessions"]
            for sid, state in sessions.items():
                link.call("view", **key, session_id=int(sid),
                          log=[state["initial_term_id"], state["term_length"]],
                          method="advance_to", args={"position": state["available"]})
        sid = str(ingest.publication.session_id)
        state = link.call("state", **key)["sessions"][sid]
        framing = (state["initial_term_id"], state["term_length"])
        identity = LogIdentity(int(sid), *framing, stream_id=STREAM, mtu=state["mtu"])
        end = state["available"]  # every message (and the padding that ends each term)
        assert end >= total * FRAME, state
        with pytest.raises(RecordingLostError, match="no longer holds position 0") as lost:
            archive.replay_held(key, int(sid), framing, 0, end)
        first = lost.value.held[0]
        assert 0 < first < end - TERM and first % 32 == 0, lost.value.held

        def task(fail_on_data_loss: bool) -> SlipstreamPartition:
            return SlipstreamPartition(
                int(sid), STREAM, state["log_path"], 0, end, str(ingest.spark_dir),
                fail_on_data_loss, "127.0.0.2", log=identity,
                driver="another driver run", holder=("127.0.0.2", HOLDER_PORT,
                                                     DEFAULT_CONTROL_STREAM_ID),
                replay_timeout_ms=10_000, held=key)

        # The driver's cleaner may have gone on behind the group's position since: what is
        # lost reaches at least as far.
        with pytest.raises(SlipstreamDataLossError, match=r"positions \[0, \d+\)") as failed:
            values([task(True)])
        assert int(str(failed.value).split("positions [0, ")[1].split(")")[0]) >= first
        skips_before = read_system_counters(ingest.spark_dir)[SystemCounter.DATA_LOSS_SKIPS]
        rows = values([task(False)])
        assert rows[0][1] - FRAME >= first  # from the first message the log held
        assert numbers(rows) == list(range(numbers(rows)[0], total))
        assert read_system_counters(ingest.spark_dir)[SystemCounter.DATA_LOSS_SKIPS] == \
            skips_before + 1


def test_a_replay_of_a_session_the_holding_archive_no_longer_has_is_lost_not_an_error(
        ingest: Ingest) -> None:
    """A read task asks the holding archive for a session whose log is no longer there (it
    ended and its image went; here one the stream never had): the archive refuses it
    ``lost``, naming the session, so a task with ``failOnDataLoss=false`` skips the range and
    counts it, and one with ``true`` fails naming it, as for any range the log lost."""
    with holding_archive_calls(ingest) as (link, archive):
        key = {"channel": CHANNEL, "stream_id": STREAM, "group": "spark"}
        link.call("state", **key)
        assert ingest.publish(10) == 10
        wait_for(lambda: link.call("state", **key)["sessions"], timeout=10,
                 what="the held session")
        state = next(iter(link.call("state", **key)["sessions"].values()))
        framing = (state["initial_term_id"], state["term_length"])
        gone = ingest.publication.session_id + 1
        identity = LogIdentity(gone, *framing, stream_id=STREAM, mtu=state["mtu"])
        with pytest.raises(RecordingLostError, match=f"has no session {gone}"):
            archive.replay_held(key, gone, framing, 0, 10 * FRAME)

        def task(fail_on_data_loss: bool) -> SlipstreamPartition:
            return SlipstreamPartition(
                gone, STREAM, state["log_path"], 0, 10 * FRAME, str(ingest.spark_dir),
                fail_on_data_loss, "127.0.0.2", log=identity,
                driver="another driver run", holder=("127.0.0.2", HOLDER_PORT,
                                                     DEFAULT_CONTROL_STREAM_ID),
                replay_timeout_ms=10_000, held=key)

        with pytest.raises(SlipstreamDataLossError, match=rf"positions \[0, {10 * FRAME}\)"):
            values([task(True)])
        skips_before = read_system_counters(ingest.spark_dir)[SystemCounter.DATA_LOSS_SKIPS]
        assert values([task(False)]) == []
        assert read_system_counters(ingest.spark_dir)[SystemCounter.DATA_LOSS_SKIPS] == \
            skips_before + 1


def test_a_held_range_with_aborted_claims_padding_is_replayed_around_it(
        ingest: Ingest) -> None:
    """Aborted claims leave padding inside a term, which a replay cannot reproduce: one
    between messages and one at the range's end (an IPC stream on the ingest host, whose log
    is the publisher's own).  A read task on another host gets the same rows as one on the
    archive's host (a replay up to the padding, then one from the next message), and a range
    of nothing but padding is read as empty."""
    client = Client.connect(ingest.spark_dir)
    publishing = Client.connect(ingest.ingest_dir)
    link = HolderLink(client, "127.0.0.2", HOLDER_PORT, DEFAULT_CONTROL_STREAM_ID,
                      timeout_s=10)
    try:
        key = {"channel": "aeron:ipc", "stream_id": STREAM, "group": "spark"}
        link.call("state", **key)
        publication = publishing.add_publication("aeron:ipc", STREAM)
        wait_for(lambda: publication.is_connected, what="the archive's hold")
        sid = str(publication.session_id)
        claim = BufferClaim()
        for first in (0, 10):
            for n in range(first, first + 10):
                while publication.offer(f"{n:08d}".encode().ljust(PAYLOAD, b".")) < 0:
                    time.sleep(0.001)
            while publication.try_claim(200, claim) < 0:
                time.sleep(0.001)
            claim.abort()
        end = publication.position
        # The publication is connected once the archive's subscription took its log; the
        # archive's client lists the image a moment later.
        wait_for(lambda: sid in link.call("state", **key)["sessions"], timeout=10,
                 what="the archive's image of the session")
        answer = link.call("state", **key)
        state = answer["sessions"][sid]
        framing = (state["initial_term_id"], state["term_length"])
        identity = LogIdentity(int(sid), *framing, stream_id=STREAM, mtu=state["mtu"])

        def task(directory: Path, start: int) -> list[tuple[bytes, int, int]]:
            return values([SlipstreamPartition(
                int(sid), STREAM, state["log_path"], start, end, str(directory), True,
                "127.0.0.2", log=identity, driver=answer["driver"],
                holder=("127.0.0.2", HOLDER_PORT, DEFAULT_CONTROL_STREAM_ID),
                replay_timeout_ms=10_000, held=key)])

        in_place = task(ingest.ingest_dir, 0)
        assert numbers(in_place) == list(range(20))
        # Not stamped: the timestamp is each read's time.
        assert [row[:2] for row in task(ingest.spark_dir, 0)] == [row[:2] for row in in_place]
        assert task(ingest.spark_dir, in_place[-1][1]) == []  # the padding only
    finally:
        link.close()
        publishing.close()
        client.close()


def test_the_holder_command_names_the_archive_settings_that_replace_it(tmp_path: Path
                                                                     ) -> None:
    """``slipstream-holder`` is refused (exit 2), printing the ``slipstream-archive`` settings
    that hold what its arguments held; those settings load, and the archive they run says
    why it cannot start with no driver in the directory (exit 1, naming it)."""
    missing = f"/dev/shm/slipstream-none-{uuid.uuid4().hex[:6]}"
    result = subprocess.run([str(Path(sys.executable).parent / "slipstream-holder"), "--dir",
                             missing, "--port", "40999", "--hold", CHANNEL, str(STREAM),
                             "--release-after", "30"], capture_output=True, text=True,
                            timeout=30, env={**os.environ})
    assert result.returncode == 2, result
    assert "slipstream-archive run --config" in result.stderr
    toml = result.stderr.split("(config/archive.toml documents every key):")[1]
    toml = toml.split("Spark's holder=")[0].replace("/var/lib/slipstream-archive",
                                                     str(tmp_path / "archive"))
    config = tmp_path / "holder.toml"
    config.write_text(toml)
    settings = load_settings(config)
    assert (settings.control_port, settings.control_address) == (40999, "0.0.0.0")
    assert settings.holds == (HoldSpec(CHANNEL, STREAM, "spark"),)
    assert settings.release_after == 30 * 10**9
    assert settings.driver_dir == Path(missing)
    run = subprocess.run([str(Path(sys.executable).parent / "slipstream-archive"), "run",
                          "--config", str(config)], capture_output=True, text=True,
                         timeout=30)
    assert run.returncode == 1, run
    assert missing in run.stderr


def test_a_held_stream_in_the_settings_is_checked_by_key(tmp_path: Path) -> None:
    """``[[hold]]`` entries are refused naming the key that is wrong."""
    for body, key in (('[[hold]]\nchannel = "aeron:udp?endpoint=x:1"\nstream_id = "7"',
                       "hold.stream_id"),
                      ('[[hold]]\nchannel = 7\nstream_id = 7', "hold.channel"),
                      (f'[[hold]]\nchannel = "{CHANNEL}"\nstream_id = 7\ngroup = ""',
                       "hold.group"),
                      (f'[[hold]]\nchannel = "{CHANNEL}"\nstream_id = 7\nsize = 1',
                       "hold.size"),
                      ('release_after = "-1s"', "release_after"),
                      # Nothing would move a held position with no control stream.
                      (f'control_port = 0\n[[hold]]\nchannel = "{CHANNEL}"\nstream_id = 7',
                       "hold")):
        config = tmp_path / "bad.toml"
        config.write_text(body + "\n")
        with pytest.raises(ArchiveSettingsError) as raised:
            load_settings(config)
        assert raised.value.key == key, (body, raised.value)


def test_holder_options_are_checked() -> None:
    assert parse_options({"streamId": "1", "holder": "10.1.2.3"}).holder == ("10.1.2.3", 40190)
    assert parse_options({"streamId": "1", "holder": "ingest:4000",
                          "replayPort": "5000"}).holder == ("ingest", 4000)
    with pytest.raises(OptionError, match=r"'holder'.*not a UDP port"):
        parse_options({"streamId": "1", "holder": "10.1.2.3:99999"})
    with pytest.raises(OptionError, match=r"'holderAddress'.*remove one"):
        parse_options({"streamId": "1", "holder": "10.1.2.3",
                       "holderAddress": "10.1.2.4"}).check_read_kind(streaming=True)
    with pytest.raises(OptionError, match="'endingPosition': applies to batch reads only"):
        parse_options({"streamId": "1", "endingPosition": "latest"}
                      ).check_read_kind(streaming=True)
    with pytest.raises(OptionError, match=r"'startingPosition'.*not a stream position"):
        parse_options({"streamId": "1", "startingPosition": '{"7": 13}'})
    with pytest.raises(OptionError, match="'maxMessagesPerTrigger': applies to streaming"):
        parse_options({"streamId": "1", "holder": "h", "maxMessagesPerTrigger": "5"}
                      ).check_read_kind(streaming=False)
    assert SlipstreamDataLossError  # the batch reader's loss error is the stream's
    assert position_of({"position": 64}) == 64


def test_a_batch_read_through_the_holder_refuses_an_archive_that_does_not_answer(
        ingest: Ingest) -> None:
    """A batch read naming the holder and an archive that does not answer: refused naming the
    archive (the sessions only it recorded would be missing), not read short in silence."""
    planner = SlipstreamStreamReader(parse_options(ingest.options()))
    try:
        planner.initialOffset()  # the query holds the stream at the holder
        assert ingest.publish(50) == 50
        wait_for(lambda: planner.reportLatestOffset(), what="the session at the holder")
        silent = f"127.0.0.1:{free_port()}"
        with pytest.raises(SlipstreamError, match=f"the archive {silent} did not answer "
                                                  f"within replayTimeoutMs .*sessions only "
                                                  f"it recorded"):
            SlipstreamBatchReader(parse_options(ingest.options(
                archive=silent, replayTimeoutMs="1000"))).partitions()
    finally:
        planner.stop()
