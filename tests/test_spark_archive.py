"""A read query on an archived stream, without a SparkSession: the planner called as Spark
calls it, on real drivers (one per "host", on this machine) and real ``slipstream-archive``
processes recording the stream.

A range the live log no longer holds (the query was down for longer than a term, its
session's log went) is read from an archive: in place on the archive's host, replayed to
the task's host elsewhere, from the next archive when the first stops answering.  Every
message once, in order; what no archive recorded is reported as loss naming how the
recording ended (docs/SPARK.md, "Reading older ranges from an archive").
"""

from __future__ import annotations

import contextlib
import itertools
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import free_port, wait_for
from hypothesis import given
from hypothesis import strategies as st
from pyspark.sql.streaming.datasource import ReadAllAvailable
from test_archive import recorded_messages, recordings
from test_spark_session_ends import (  # noqa: F401  (hosts: a fixture)
    FRAME,
    STREAM,
    TERM,
    Hosts,
    hosts,
    standing_planner,
    start_holder,
    stop_holder,
)

from slipstream.archive import EndReason
from slipstream.client.counters import SystemCounter, read_system_counters
from slipstream.spark_bridge.options import parse_options
from slipstream.spark_bridge.reader import (
    SlipstreamDataLossError,
    SlipstreamStreamReader,
    read_range,
)

pytestmark = pytest.mark.timeout(180)

MESSAGES_PER_TERM = TERM // FRAME


class Archive:
    """A ``slipstream-archive run`` process beside the ingest driver, recording the stream
    as it arrives there (source remote) in segments of ``segment_length``, with a control
    stream on a port of its own."""

    def __init__(self, hosts: Hosts, directory: Path,  # noqa: F811
                 segment_length: str = "128k") -> None:
        self.directory = directory / "recordings"
        self.port = free_port()
        self.config = directory / "archive.toml"
        self.config.write_text("\n".join([
            f'dir = "{self.directory}"', f'driver_dir = "{hosts.directories["ingest"]}"',
            f'segment_length = "{segment_length}"', f"control_port = {self.port}", "[[record]]",
            f'channel = "{hosts.channel}"', f"stream_id = {STREAM}", 'source = "remote"',
        ]) + "\n")
        self.log = directory / "archive.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        with open(self.log, "ab") as log_file:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "slipstream.archive.cli", "run", "--config",
                 str(self.config)], stdout=log_file, stderr=subprocess.STDOUT)

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()


@pytest.fixture
def archives(hosts: Hosts, tmp_path: Path) -> Iterator[list[Archive]]:  # noqa: F811
    made: list[Archive] = []
    with contextlib.ExitStack() as stack:
        for name in ("first", "second"):
            (tmp_path / name).mkdir()
            archive = Archive(hosts, tmp_path / name)
            stack.callback(archive.kill)
            made.append(archive)
        yield made


def planner(hosts: Hosts, archives: list[Archive], *, in_place: bool,  # noqa: F811
            **options: str) -> SlipstreamStreamReader:
    """The query's planner on the ingest host (the Spark driver placed beside the archive),
    holding the stream itself; ``in_place``: tasks there read recordings in place."""
    given = {"streamId": str(STREAM), "channel": hosts.channel,
             "directory": str(hosts.directories["ingest"]), "replayTimeoutMs": "3000",
             "holderAddress": "127.0.0.1",
             "archive": ",".join(archive.endpoint for archive in archives), **options}
    if in_place:
        given["archiveDir"] = str(archives[0].directory)
    return SlipstreamStreamReader(parse_options(given))


def numbers(partitions: list, hosts: Hosts, archived_on: str) -> list[int]:  # noqa: F811
    """The message numbers the partitions hold: live ranges read by tasks on the ingest host,
    archived ones by tasks on ``archived_on``."""
    found = []
    for partition in partitions:
        host = archived_on if partition.archived is not None else "ingest"
        partition.directory = str(hosts.directories[host])
        for batch in read_range(partition):
            found += [int(value[:8]) for value in batch.column("value").to_pylist()]
    return found


def run_batches(query: SlipstreamStreamReader, start: dict, read: list[int],
                hosts: Hosts, archived_on: str, until: float, *,  # noqa: F811
                stop_when: int | None = None, sources: list[str] | None = None) -> dict:
    """Plan, read and commit batches as Spark does until ``until`` (or ``stop_when``
    messages were read); returns the last committed offsets."""
    while time.monotonic() < until and (stop_when is None or len(read) < stop_when):
        end = query.latestOffset(start, ReadAllAvailable())
        if end != start:
            partitions = query.partitions(start, end)
            if sources is not None:
                sources += ["archive" if p.archived is not None else "log" for p in partitions]
            read += numbers(partitions, hosts, archived_on)
            query.commit(end)
            start = end
        time.sleep(0.05)
    return start


def first_batches(hosts: Hosts, archives: list[Archive], count: int, **options: str  # noqa: F811
                  ) -> tuple[dict, list[int]]:
    """A query that reads the first ``count`` messages and stops (its Spark driver went)."""
    query = planner(hosts, archives, in_place=True, **options)
    read: list[int] = []
    try:
        start = query.initialOffset()
        wait_for(lambda: query._images(), what="the session at the query's subscription")
        for archive in archives:
            wait_for(lambda a=archive: recordings(a.directory), timeout=20,
                     what="the archives recording")
        assert hosts.publish(count) == count
        start = run_batches(query, start, read, hosts, "ingest", time.monotonic() + 20,
                            stop_when=count)
    finally:
        query.stop()
    assert read == list(range(count))
    return start, read


@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "replayed"])
def test_a_query_down_for_several_terms_reads_the_gap_from_the_archive_exactly_once(
        hosts: Hosts, archives: list[Archive], in_place: bool) -> None:  # noqa: F811
    """The query goes; the archives' subscriptions keep the stream flowing for several terms,
    so the log no longer holds the committed offset when it comes back.  The restarted query
    reads that range from the archive (in place on its host, or replayed to a task's host)
    and the rest from the log: every message once, in order."""
    hosts.publish_from("publisher")
    start, read = first_batches(hosts, archives, 200)
    down = 6 * MESSAGES_PER_TERM
    assert hosts.publish(down) == down  # the archives keep the publisher going
    total = 200 + down
    query = planner(hosts, archives, in_place=in_place)
    sources: list[str] = []
    try:
        view = query._images()[str(hosts.publication.session_id)]  # type: ignore[union-attr]
        committed = int(start[str(hosts.publication.session_id)]["position"])  # type: ignore[union-attr]
        assert not view.is_retained(committed), "the log still holds the committed offset"
        assert hosts.publish(100) == 100  # and the stream goes on meanwhile
        total += 100
        start = run_batches(query, start, read, hosts, "ingest" if in_place else "spark",
                            time.monotonic() + 30, stop_when=total, sources=sources)
    finally:
        query.stop()
    assert read == list(range(total))
    assert "archive" in sources and "log" in sources


@pytest.mark.parametrize("ending", ["closed", "host died"])
def test_a_session_gone_while_the_query_was_down_is_read_from_the_archive_to_its_end(
        hosts: Hosts, archives: list[Archive], ending: str) -> None:  # noqa: F811
    """The session's publisher goes while the query is down (its publication closed, or its
    host's driver killed) and its image goes at the ingest host with what it held.  The
    restarted query reads the session from the archive up to where it was recorded; then a
    session closed normally leaves the offsets in silence, and one whose publisher died is
    reported as loss past the recorded position, naming how the recording ended."""
    hosts.publish_from("publisher")
    start, read = first_batches(hosts, archives, 200)
    session = str(hosts.publication.session_id)  # type: ignore[union-attr]
    down = 3 * MESSAGES_PER_TERM
    assert hosts.publish(down) == down
    total = 200 + down
    if ending == "closed":
        hosts.publication.close()  # type: ignore[union-attr]
    else:
        hosts.drivers["publisher"].kill()
    for archive in archives:
        wait_for(lambda a=archive: not recordings(a.directory)[0].is_active, timeout=20,
                 what="the recording ended")
    reason = recordings(archives[0].directory)[0].end_reason
    assert reason == (EndReason.END_OF_STREAM if ending == "closed" else
                      EndReason.ENDED_ABRUPTLY)
    skips_before = read_system_counters(hosts.directories["ingest"])[
        SystemCounter.DATA_LOSS_SKIPS]
    if ending != "closed":  # what its driver had not sent yet went with it
        total = len(recorded_messages(recordings(archives[0].directory)[0],
                                      archives[0].directory))
    query = planner(hosts, archives, in_place=True, failOnDataLoss="false")
    try:
        deadline = time.monotonic() + 12
        while not (isinstance(start.get(session), dict) and start[session].get("finished")) \
                and time.monotonic() < deadline:
            start = run_batches(query, start, read, hosts, "ingest", time.monotonic() + 0.2)
        # Finished: remembered (never read again) while the archives hold it.
        assert start[session]["finished"] is True
        if ending == "closed":
            # Archives that do not answer forget nothing: the session stays finished, and
            # is not read again once they answer again.
            for archive in archives:
                archive.kill()
            start = run_batches(query, start, read, hosts, "ingest", time.monotonic() + 8)
            assert start[session]["finished"] is True
            for archive in archives:
                archive.start()
            query._archives._silent.clear()  # asked again at once, not after the back-off
            start = run_batches(query, start, read, hosts, "ingest", time.monotonic() + 4)
            assert start[session]["finished"] is True
    finally:
        query.stop()
    assert read == list(range(total))
    skips = read_system_counters(hosts.directories["ingest"])[
        SystemCounter.DATA_LOSS_SKIPS] - skips_before
    assert skips == (0 if ending == "closed" else 1)


def test_a_recording_that_ended_abruptly_fails_the_query_naming_the_recorded_position(
        hosts: Hosts, archives: list[Archive]) -> None:  # noqa: F811
    """failOnDataLoss=true: the query reads what the archive recorded, then fails saying the
    messages after the recorded position will never be read, and why."""
    hosts.publish_from("publisher")
    start, read = first_batches(hosts, archives, 100)
    assert hosts.publish(MESSAGES_PER_TERM) == MESSAGES_PER_TERM
    hosts.drivers["publisher"].kill()
    wait_for(lambda: not recordings(archives[0].directory)[0].is_active, timeout=20,
             what="the recording ended")
    recording = recordings(archives[0].directory)[0]
    stop = recording.stop_position
    query = planner(hosts, archives, in_place=True)
    try:
        with pytest.raises(SlipstreamDataLossError) as failed:
            run_batches(query, start, read, hosts, "ingest", time.monotonic() + 12)
    finally:
        query.stop()
    # All that was recorded, once (its driver died with what it had not sent yet).
    assert read == list(range(len(recorded_messages(recording, archives[0].directory))))
    message = str(failed.value)
    assert f"whatever its publisher accepted after position {stop}" in message
    assert "without the stream's end-of-stream mark" in message


def test_a_task_falls_over_to_the_second_archive_when_the_first_stops_answering(
        hosts: Hosts, archives: list[Archive]) -> None:  # noqa: F811
    """Both archives record the stream; the first (preferred) is killed after the batch was
    planned from it: the tasks get the range replayed by the second, and the next triggers
    plan from the second alone.  Every message once, in order."""
    hosts.publish_from("publisher")
    start, read = first_batches(hosts, archives, 200)
    down = 4 * MESSAGES_PER_TERM
    assert hosts.publish(down) == down
    total = 200 + down
    query = planner(hosts, archives, in_place=False)
    try:
        end = query.latestOffset(start, ReadAllAvailable())
        partitions = query.partitions(start, end)
        first = archives[0].endpoint
        assert any(p.archived is not None and f"{p.archived.archive[0]}:"
                   f"{p.archived.archive[1]}" == first for p in partitions)
        archives[0].kill()
        read += numbers(partitions, hosts, "spark")
        query.commit(end)
        assert hosts.publish(50) == 50
        total += 50
        run_batches(query, end, read, hosts, "spark", time.monotonic() + 20, stop_when=total)
    finally:
        query.stop()
    assert read == list(range(total))


@pytest.mark.parametrize("kafka_json", [False, True], ids=["earliest", "json-minus-2"])
def test_earliest_starts_a_new_query_at_the_archive_s_first_position(
        hosts: Hosts, archives: list[Archive], kafka_json: bool) -> None:  # noqa: F811
    """startingPosition=earliest, or startingOffsets naming the session at -2 (Kafka's
    earliest), the log having rotated several terms: a new query reads the session from the
    first position the archive recorded, not the log's oldest."""
    hosts.publish_from("publisher")  # the archive is the stream's receiver
    wait_for(lambda: recordings(archives[0].directory), timeout=20, what="the recording")
    total = 4 * MESSAGES_PER_TERM
    assert hosts.publish(total) == total
    session = recordings(archives[0].directory)[0].session_id
    starting = {"startingOffsets": json.dumps({str(STREAM): {str(session): -2}})} \
        if kafka_json else {"startingPosition": "earliest"}
    query = planner(hosts, archives[:1], in_place=True, **starting)
    read: list[int] = []
    try:
        start = query.initialOffset()
        assert int(next(iter(start.values()))["position"]) == 0
        run_batches(query, start, read, hosts, "ingest", time.monotonic() + 20,
                    stop_when=total)
    finally:
        query.stop()
    assert read == list(range(total))


def offer_numbered(publication, first: int, count: int) -> None:
    for number in range(first, first + count):
        data = f"{number:08d}".encode().ljust(100, b".")
        deadline = time.monotonic() + 10
        while publication.offer(data) < 0:
            assert time.monotonic() < deadline, "back pressure for 10 s"
            time.sleep(0.0005)


def test_sessions_that_began_while_the_query_was_down_are_read_from_their_first_message(
        hosts: Hosts, archives: list[Archive]) -> None:  # noqa: F811
    """While the query is down a session begins and ends (only the archives hold it), and
    another begins and goes on.  The restarted query reads both from their first message,
    and the first session's rest, once each; triggers after that bring nothing back."""
    hosts.publish_from("publisher")
    start, read = first_batches(hosts, archives, 200)
    assert hosts.publisher is not None
    ended = hosts.publisher.add_exclusive_publication(f"{hosts.channel}|term-length={TERM}",
                                                      STREAM)
    offer_numbered(ended, 100_000, 2 * MESSAGES_PER_TERM)
    ended.close()
    going = hosts.publisher.add_exclusive_publication(f"{hosts.channel}|term-length={TERM}",
                                                      STREAM)
    offer_numbered(going, 200_000, 3 * MESSAGES_PER_TERM)
    assert hosts.publish(100) == 100
    wait_for(lambda: any(not r.is_active for r in recordings(archives[0].directory)),
             timeout=20, what="the ended session's recording stopped")
    query = planner(hosts, archives, in_place=True)
    expected = (list(range(300)) + list(range(100_000, 100_000 + 2 * MESSAGES_PER_TERM))
                + list(range(200_000, 200_000 + 3 * MESSAGES_PER_TERM)))
    try:
        start = run_batches(query, start, read, hosts, "ingest", time.monotonic() + 30,
                            stop_when=len(expected))
        start = run_batches(query, start, read, hosts, "ingest", time.monotonic() + 3)
    finally:
        query.stop()
        going.close()
    assert sorted(read) == expected  # once each
    for first in (0, 100_000, 200_000):  # each session in order
        ours = [n for n in read if first <= n < first + 100_000]
        assert ours == sorted(ours)


def _listed(recording_id: int, session_id: int, framing: tuple[int, int], start: int,
            stop: int, active: bool):
    from slipstream.archive.catalog import RecordingDescriptor, RecordingState
    from slipstream.archive.client import ListedRecording

    descriptor = RecordingDescriptor(
        recording_id, RecordingState.VALID,
        EndReason.ACTIVE if active else EndReason.END_OF_STREAM, start,
        -1 if active else stop, 0, -1 if active else 1, framing[0], framing[1], 4 * TERM,
        1408, session_id, STREAM, "aeron:ipc", "test")
    return ListedRecording(descriptor, stop)


@st.composite
def archives_listed(draw):
    """Per archive (one to three), recordings of session 7 of the log (5, TERM) at random
    aligned ranges, some of another session or log among them."""
    listed = []
    recording_id = 0
    for rank in range(draw(st.integers(1, 3))):
        recordings = []
        for _ in range(draw(st.integers(0, 4))):
            start = draw(st.integers(0, 64)) * 32
            stop = start + draw(st.integers(1, 64)) * 32
            session, framing = draw(st.sampled_from([(7, (5, TERM)), (7, (5, TERM)),
                                                     (8, (5, TERM)), (7, (6, TERM))]))
            recordings.append(_listed(recording_id, session, framing, start, stop,
                                      draw(st.booleans())))
            recording_id += 1
        listed.append(((f"10.0.0.{rank + 1}", 8010, 10), recordings))
    return listed


@given(archives_listed(), st.integers(0, 80).map(lambda n: n * 32),
       st.one_of(st.none(), st.integers(1, 80).map(lambda n: n * 32)))
def test_stitched_pieces_hold_exactly_what_the_archives_hold_preferring_the_first(
        listed, start: int, length: int | None) -> None:
    """The pieces are in order, meet or leave holes only where no recording of the session's
    log holds a position (a live one holds a bounded range to its end: it will), each lies
    in its recording, and each begins in the first archive that holds its start."""
    from slipstream.spark_bridge.archived import stitch

    end = None if length is None else start + length
    pieces = stitch(listed, 7, (5, TERM), start, end)
    ours = [(rank, archive, r) for rank, (archive, recordings) in enumerate(listed)
            for r in recordings
            if r.descriptor.session_id == 7 and r.descriptor.initial_term_id == 5]

    def reach(r) -> int:  # a live recording will hold what a bounded range asks for
        return end if end is not None and r.descriptor.is_active else r.recorded_position

    held = {p for _, _, r in ours
            for p in range(r.descriptor.start_position, max(reach(r), 0), 32)
            if p >= start and (end is None or p < end)}
    covered = {p for piece in pieces for p in range(piece.start, piece.end, 32)}
    assert covered == held
    for a, b in itertools.pairwise(pieces):
        assert a.end <= b.start
    by_id = {r.recording_id: (rank, r) for rank, _, r in ours}
    for piece in pieces:
        rank, recording = by_id[piece.recording_id]
        assert listed[rank][0] == piece.archive
        assert recording.descriptor.start_position <= piece.start < piece.end \
            <= reach(recording)
        assert not any(other < rank and r.descriptor.start_position <= piece.start
                       < reach(r) for other, _, r in ours)


def test_a_standing_holder_restarted_while_the_query_was_down_is_bridged_by_the_archive(
        hosts: Hosts, tmp_path: Path) -> None:  # noqa: F811
    """The stream is held by the ingest host's standing holder and recorded by an archive
    there.  While the query is down the holder is restarted (it forgets its group's
    position), the archive keeps the stream flowing for several terms, and the new hold
    joins where the publisher is.  The restarted query reads the range between its
    checkpoint and that join from the archive (replayed to the planner's host) and the
    rest through the holder: every message once, in order, no loss reported."""
    hosts.channel = f"aeron:udp?endpoint=127.0.0.2:{hosts.port}"
    archive = Archive(hosts, tmp_path)
    port = free_port()
    holder = start_holder(hosts, port)
    options = {"archive": archive.endpoint, "replayTimeoutMs": "3000"}
    try:
        hosts.publish_from("publisher")
        query = standing_planner(hosts, port, **options)
        read: list[int] = []
        try:
            start = query.initialOffset()
            wait_for(lambda: query._images(), what="the session at the holder")
            wait_for(lambda: recordings(archive.directory), timeout=20, what="the recording")
            assert hosts.publish(200) == 200
            start = run_batches(query, start, read, hosts, "spark", time.monotonic() + 20,
                                stop_when=200)
        finally:
            query.stop()
        stop_holder(holder)
        down = 6 * MESSAGES_PER_TERM
        assert hosts.publish(down) == down  # the archive keeps the publisher going
        holder = start_holder(hosts, port)
        total = 200 + down
        query = standing_planner(hosts, port, **options)
        sources: list[str] = []
        try:
            assert hosts.publish(100) == 100
            total += 100
            start = run_batches(query, start, read, hosts, "spark", time.monotonic() + 30,
                                stop_when=total, sources=sources)
        finally:
            query.stop()
    finally:
        stop_holder(holder)
        archive.kill()
    assert read == list(range(total))
    assert "archive" in sources


def test_two_archives_on_one_driver_have_a_position_counter_each(
        hosts: Hosts, archives: list[Archive]) -> None:  # noqa: F811
    """Both archives record the stream through the ingest driver, each as its recording 0:
    each has a position counter of its own, told apart by the archive's identity in its key,
    so a reader of one archive's segment files never follows the other's position."""
    from slipstream.archive.reading import live_positions, recording_position_key
    from slipstream.client.control import COUNTERS_FILE
    from slipstream.client.counters import CountersFile, CounterType

    hosts.publish_from("publisher")
    for archive in archives:
        wait_for(lambda a=archive: recordings(a.directory), timeout=20, what="recording")
    assert hosts.publish(100) == 100
    assert hosts.publication is not None
    session = hosts.publication.session_id
    ingest = hosts.directories["ingest"]
    for archive in archives:
        wait_for(lambda a=archive: 0 in live_positions(ingest, a.directory), timeout=10,
                 what="the archive's counter")
    counters = CountersFile(ingest / COUNTERS_FILE, writable=False)
    try:
        found = [counters.find(CounterType.RECORDING_POSITION,
                               recording_position_key(0, session, STREAM, archive.directory))
                 for archive in archives]
    finally:
        counters.close()
    assert all(found) and found[0].counter_id != found[1].counter_id
