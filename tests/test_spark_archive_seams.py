"""A recording seam inside a message, read by the Spark read path (the planner called as Spark
calls it, tasks' ``read_range``), on real drivers and real ``slipstream-archive`` processes.

The stream carries 60 KiB messages (about 44 frames each), and the preferred archive is
killed and started again while they flow: its first recording ends inside a message and its
second begins inside one.  Where the other archive holds such a message whole, the query
reads it whole, once; where no archive does, the loss is reported naming the message's
positions, stream and session (``failOnDataLoss``: an error, or a warning and the driver's
data loss skips counter), and every other message is read once.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import wait_for
from pyspark.sql.streaming.datasource import ReadAllAvailable
from test_archive import recordings
from test_spark_archive import Archive
from test_spark_session_ends import STREAM, Hosts, hosts  # noqa: F401  (hosts: a fixture)

from slipstream.client import Client
from slipstream.client.counters import SystemCounter, read_system_counters
from slipstream.spark_bridge.options import parse_options
from slipstream.spark_bridge.reader import (
    SlipstreamDataLossError,
    SlipstreamStreamReader,
    read_range,
)

pytestmark = pytest.mark.timeout(240)

TERM = 512 * 1024
SIZE = 60 * 1024  # about 44 frames at the default MTU: a seam almost surely cuts one


def payload(number: int) -> bytes:
    return f"{number:08d}".encode() + bytes([number % 251]) * (SIZE - 8)


#: The archives' segments here hold the stream's 512 KiB terms.
SEGMENT_LENGTH = "1m"


class Stream:
    """The publisher: numbered 60 KiB messages, the position after each kept."""

    def __init__(self, hosts: Hosts, stack: contextlib.ExitStack) -> None:  # noqa: F811
        client = stack.enter_context(Client.connect(hosts.directories["publisher"]))
        self.publication = client.add_publication(f"{hosts.channel}|term-length={TERM}",
                                                  STREAM)
        self.ends: list[int] = []
        self._running = threading.Event()
        self._thread: threading.Thread | None = None

    def offer(self, count: int) -> None:
        for _ in range(count):
            data = payload(len(self.ends))
            deadline = time.monotonic() + 10
            while (position := self.publication.offer(data)) < 0:
                assert time.monotonic() < deadline, "back pressure for 10 s"
                time.sleep(0.0005)
            self.ends.append(position)

    def flowing(self) -> contextlib.AbstractContextManager[None]:
        """Messages offered one after the other, paced a little, while the block runs."""

        @contextlib.contextmanager
        def flow() -> Iterator[None]:
            self._running.set()

            def run() -> None:
                while self._running.is_set():
                    self.offer(1)
                    time.sleep(0.002)

            self._thread = threading.Thread(target=run, daemon=True)
            self._thread.start()
            try:
                yield
            finally:
                self._running.clear()
                self._thread.join(20)

        return flow()

    def span(self, number: int) -> tuple[int, int]:
        """Message ``number``'s positions: where it begins (after the padding to its term's
        start when the one before ended in an earlier term), where it ends."""
        end = self.ends[number]
        term_start = end - 1 - (end - 1) % TERM
        return max(self.ends[number - 1] if number else 0, term_start), end

    def cut_at(self, position: int) -> int | None:
        """The message that ``position`` lies inside (not at its start), or None."""
        for number in range(len(self.ends)):
            begin, end = self.span(number)
            if begin < position < end:
                return number
        return None


def planner(hosts: Hosts, archives: list[Archive], *, in_place: bool,  # noqa: F811
            **options: str) -> SlipstreamStreamReader:
    given = {"streamId": str(STREAM), "channel": hosts.channel,
             "directory": str(hosts.directories["ingest"]), "replayTimeoutMs": "5000",
             "holderAddress": "127.0.0.1",
             "archive": ",".join(archive.endpoint for archive in archives), **options}
    if in_place:
        given["archiveDir"] = str(archives[0].directory)
    return SlipstreamStreamReader(parse_options(given))


def read_batches(query: SlipstreamStreamReader, start: dict, hosts: Hosts,  # noqa: F811
                 archived_on: str, want: int, *, partitions: list | None = None,
                 timeout: float = 60.0) -> tuple[list[int], dict]:
    """Plan, read and commit batches as Spark does until ``want`` messages were read (or
    nothing more comes): the message numbers, each value checked whole, and the last
    committed offsets."""
    read: list[int] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and len(read) < want:
        end = query.latestOffset(start, ReadAllAvailable())
        if end != start:
            planned = query.partitions(start, end)
            if partitions is not None:
                partitions += planned
            for partition in planned:
                host = archived_on if partition.archived is not None else "ingest"
                partition.directory = str(hosts.directories[host])
                for batch in read_range(partition):
                    for value in batch.column("value").to_pylist():
                        number = int(value[:8])
                        assert value == payload(number), f"message {number} is not whole"
                        read.append(number)
            query.commit(end)
            start = end
        time.sleep(0.05)
    return read, start


def down_with_a_seam(hosts: Hosts, archives: list[Archive], stream: Stream,  # noqa: F811
                     in_place: bool, **options: str) -> tuple[dict, list[tuple[int, int]]]:
    """A query reads the first messages and goes; meanwhile the first archive is killed and
    started again while 60 KiB messages flow, until one of its seams cuts a message (most
    often the first: a recording that begins joins the stream where it is), and the stream
    goes on for more than the log holds.  Returns the committed offsets and the first
    archive's seams: each recording's stop and the next one's start."""
    query = planner(hosts, archives, in_place=in_place, **options)
    try:
        start = query.initialOffset()
        wait_for(lambda: query._images(), what="the session at the query's subscription")
        for archive in archives:
            wait_for(lambda a=archive: recordings(a.directory), timeout=20,
                     what="the archives recording")
        stream.offer(5)
        read, start = read_batches(query, start, hosts, "ingest", 5, timeout=20)
        assert read == list(range(5))
    finally:
        query.stop()
    first = archives[0]
    seams: list[tuple[int, int]] = []
    with stream.flowing():
        while len(seams) < 5 and not any(stream.cut_at(p) is not None
                                         for seam in seams for p in seam):
            time.sleep(0.5)
            first.kill()
            time.sleep(0.5)
            first.start()
            wait_for(lambda: len(recordings(first.directory)) == len(seams) + 2, timeout=20,
                     what="the first archive recording again")
            time.sleep(0.5)
            held = recordings(first.directory)
            seams.append((held[-2].stop_position, held[-1].start_position))
    stream.offer(4 * TERM // SIZE)  # past what the log holds
    return start, seams


@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "replayed"])
def test_a_message_cut_by_an_archive_restart_is_read_whole_from_the_other_archive(
        hosts: Hosts, tmp_path: Path, in_place: bool) -> None:  # noqa: F811
    """Both archives record the stream; the first, preferred, is killed and started again
    mid-message.  The restarted query's pieces meet inside a message (the first archive's
    recording ends, or its next begins, between its fragments); the task whose range that
    message begins in reads it whole from the second archive, and the next skips its rest:
    every message once, whole, in order."""
    with contextlib.ExitStack() as stack:
        archives = []
        for name in ("first", "second"):
            (tmp_path / name).mkdir()
            archive = Archive(hosts, tmp_path / name, SEGMENT_LENGTH)
            stack.callback(archive.kill)
            archives.append(archive)
        stream = Stream(hosts, stack)
        start, seams = down_with_a_seam(hosts, archives, stream, in_place)
        assert any(stream.cut_at(p) is not None for seam in seams for p in seam), seams
        query = planner(hosts, archives, in_place=in_place)
        partitions: list = []
        try:
            read, _ = read_batches(query, start, hosts, "ingest" if in_place else "spark",
                                   len(stream.ends) - 5, partitions=partitions)
        finally:
            query.stop()
    missing = sorted(set(range(5, len(stream.ends))) - set(read))
    assert read == list(range(5, len(stream.ends))), (
        missing, [stream.span(n) for n in missing], seams,
        [(p.start, p.end, p.archived and (p.archived.archive[1], p.archived.recording_id))
         for p in partitions], [(d.start_position, d.stop_position)
                                for a in archives for d in recordings(a.directory)])
    # The planner cut a range inside a message, and the tasks read that message whole.
    inside = [p for p in partitions if p.archived is not None
              and stream.cut_at(p.end) is not None and p.end < partitions[-1].end]
    assert inside, [(p.start, p.end) for p in partitions]


@pytest.mark.parametrize("fail", [False, True], ids=["skip", "fail"])
def test_a_message_no_archive_holds_whole_is_reported_as_loss_naming_its_range(
        hosts: Hosts, tmp_path: Path, fail: bool,  # noqa: F811
        caplog: pytest.LogCaptureFixture) -> None:
    """One archive, killed and started again mid-message: the message a recording ends in
    and the one the next begins in are held whole by none.  Read with failOnDataLoss=false,
    every other message is read once and each seam's loss is reported as contiguous ranges
    (the planner's hole between the recordings, the tasks' cut messages) from the first
    lost message's start to where the first message after the last one begins, each naming
    the stream and session and counted; with failOnDataLoss=true the first task that meets
    a cut message fails naming its range."""
    with contextlib.ExitStack() as stack:
        (tmp_path / "only").mkdir()
        archive = Archive(hosts, tmp_path / "only", SEGMENT_LENGTH)
        stack.callback(archive.kill)
        stream = Stream(hosts, stack)
        start, seams = down_with_a_seam(hosts, [archive], stream, True,
                                        failOnDataLoss="false")
        # Each seam loses from the start of the message a recording ends in (or its stop)
        # to where the message after the one the next begins in begins (or its start).
        ranges = []
        for stopped, restarted in seams:
            first_lost, last_lost = stream.cut_at(stopped), stream.cut_at(restarted)
            ranges.append((stream.span(first_lost)[0] if first_lost is not None else stopped,
                           restarted if last_lost is None else stream.span(last_lost + 1)[0]))
        lost = {n for n in range(len(stream.ends))
                if any(stream.span(n)[0] < end and stream.span(n)[1] > begin
                       for begin, end in ranges)}
        session = stream.publication.session_id
        skips_before = read_system_counters(hosts.directories["ingest"])[
            SystemCounter.DATA_LOSS_SKIPS]
        query = planner(hosts, [archive], in_place=True, failOnDataLoss="false")
        caplog.set_level(logging.WARNING, logger="slipstream.spark_bridge")
        try:
            if fail:
                final = query.latestOffset(start, ReadAllAvailable())
                partitions = query.partitions(start, final)
                for partition in partitions:
                    partition.fail_on_data_loss = True
                with pytest.raises(SlipstreamDataLossError) as failed:
                    for partition in partitions:
                        list(read_range(partition))
            else:
                read, _ = read_batches(query, start, hosts, "ingest",
                                       len(stream.ends) - 5 - len(lost))
        finally:
            query.stop()
    if fail:
        # The first task that meets a cut message names it: the message a recording ends in
        # (up to its stop), else the rest of the one the next begins in (the hole before it
        # is the planner's to report).
        message = str(failed.value)
        assert f"slipstream stream {STREAM} session {session}" in message
        (begin, end), (stopped, restarted) = next(
            (r, seam) for r, seam in zip(ranges, seams, strict=True)
            if stream.cut_at(seam[0]) is not None or stream.cut_at(seam[1]) is not None)
        if stream.cut_at(stopped) is not None:
            assert f"positions [{begin}, {stopped})" in message
            assert "lie across the seam of two recordings" in message
        else:
            assert f"positions [{restarted}, {end})" in message
            assert "the rest of a message whose start no archive holds" in message
        return
    assert read == [n for n in range(5, len(stream.ends)) if n not in lost]
    reported = sorted(
        (int(text.split("positions [")[1].split(",")[0]),
         int(text.split("positions [")[1].split(",")[1].split(")")[0]))
        for text in caplog.messages
        if f"slipstream stream {STREAM} session {session}" in text and "positions [" in text)
    # No overlap; joined where they meet, each seam's whole range.
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(reported)), reported
    joined: list[tuple[int, int]] = []
    for begin, end in reported:
        if joined and joined[-1][1] == begin:
            joined[-1] = (joined[-1][0], end)
        else:
            joined.append((begin, end))
    assert joined == ranges, (reported, seams)
    skips = read_system_counters(hosts.directories["ingest"])[
        SystemCounter.DATA_LOSS_SKIPS] - skips_before
    assert skips == len(reported)
