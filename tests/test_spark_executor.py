"""The streaming reader's executor side without a SparkSession: a read task's range read from
the log on the holder's host, or replayed to a task on another host.

Two drivers on this machine stand for two hosts: the holder's (replays served at 127.0.0.2)
and the executor's (its replays arrive at 127.0.0.1, the address the kernel sends to
127.0.0.2 from).  A task is on the holder's host when its driver is the one the partition
names, whatever its directory's path.
"""

from __future__ import annotations

import inspect
import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import FAST_DRIVER_SETTINGS, free_port, wait_for

from slipstream.archive.client import ArchiveClient, ArchiveReplay
from slipstream.archive.holding import driver_instance
from slipstream.client import BufferClaim, Client
from slipstream.client.counters import CountersFile
from slipstream.client.retention import earliest_position
from slipstream.daemon.driver import MediaDriver
from slipstream.spark_bridge import planning
from slipstream.spark_bridge.options import parse_options
from slipstream.spark_bridge.reader import (
    SlipstreamDataLossError,
    SlipstreamPartition,
    read_range,
)

pytestmark = pytest.mark.timeout(120)

PORT = free_port()
STREAM = 88
TERM = 64 * 1024
PAYLOAD = 200


class Hosts:
    """The holder's driver with a replay server, the executor's driver, and a stream whose
    log the holder's subscription holds."""

    def __init__(self, holder_dir: Path, executor_dir: Path) -> None:
        self.holder_dir, self.executor_dir = holder_dir, executor_dir
        self.client = Client.connect(holder_dir)
        self.publication = self.client.add_publication(
            f"aeron:ipc?term-length={TERM // 1024}k", STREAM)
        self.keeper = self.client.add_subscription("aeron:ipc", STREAM)
        wait_for(lambda: self.keeper.images, what="the holder's image")
        self.image = self.keeper.images[0]
        self.server = planning._Holder(str(holder_dir), "127.0.0.2", PORT)
        self.server.holds.publish({(STREAM, self.image.session_id): (self.image.log_path, 0, None)})
        counters = CountersFile(holder_dir / "counters.dat")
        self.driver = driver_instance(counters)
        counters.close()

    def publish(self, count: int, first: int = 0, consume: bool = False,
                size: int = PAYLOAD) -> None:
        for i in range(first, first + count):
            deadline = time.monotonic() + 10
            while self.publication.offer(f"{i:08d}".encode().ljust(size, b"."),
                                         reserved_value=(i + 1) * 1000) < 0:
                assert time.monotonic() < deadline
                time.sleep(0.0005)
            if consume:
                self.keeper.poll(lambda d, h: None, 100)

    def partition(self, directory: Path, start: int, end: int, *, fail: bool = True,
                  holder: bool = True) -> SlipstreamPartition:
        return SlipstreamPartition(
            self.image.session_id, STREAM, self.image.log_path, start, end, str(directory),
            fail, "holder-host", log=self.image.identity, driver=self.driver,
            holder=self.server.address if holder else None, replay_timeout_ms=5000,
            held={"channel": "aeron:ipc", "stream_id": STREAM, "group": "query"})

    def close(self) -> None:
        self.server.close()
        self.client.close()


@pytest.fixture
def two_drivers() -> Iterator[Hosts]:
    directories = [Path("/dev/shm") / f"slipstream-exec-{uuid.uuid4().hex[:6]}-{n}"
                   for n in ("holder", "executor")]
    try:
        with MediaDriver.launch(directory=directories[0], **FAST_DRIVER_SETTINGS), \
                MediaDriver.launch(directory=directories[1], **FAST_DRIVER_SETTINGS):
            hosts = Hosts(*directories)
            try:
                yield hosts
            finally:
                hosts.close()
    finally:
        for directory in directories:
            shutil.rmtree(directory, ignore_errors=True)


def rows(partition: SlipstreamPartition) -> list[tuple[bytes, int, int]]:
    return [(value, position, stamp)
            for batch in read_range(partition)
            for value, position, stamp in zip(
                batch.column("value").to_pylist(), batch.column("position").to_pylist(),
                batch.column("timestamp").cast("int64").to_pylist(), strict=True)]


def test_a_task_off_the_holders_host_reads_the_same_rows_as_one_on_it(two_drivers) -> None:
    """Two windows' worth of messages: the replayed rows (another driver) are the local rows,
    values, positions and publisher timestamps (the reserved values, µs) alike."""
    hosts = two_drivers
    hosts.publish(120)
    start, end = hosts.image.position, hosts.image.available_position()
    local = rows(hosts.partition(hosts.holder_dir, start, end))
    replayed = rows(hosts.partition(hosts.executor_dir, start, end))
    assert len(local) == 120
    assert replayed == local
    assert [stamp for _, _, stamp in replayed] == [i + 1 for i in range(120)]
    wait_for(lambda: hosts.server.control.served == 1, what="the replay counted as served")


def test_a_range_the_holder_no_longer_holds_is_data_loss_naming_it_or_skipped(
        two_drivers) -> None:
    """The holder's log moved four terms on (its subscriber read it all): a task off its host
    asked for position 0 fails naming the range lost (up to the oldest message still held)
    and the holder; with failOnDataLoss=false it reads from that message."""
    hosts = two_drivers
    hosts.publish(4 * TERM // (PAYLOAD + 32), consume=True)
    while hosts.keeper.poll(lambda d, h: None, 1000):
        pass
    end = hosts.image.available_position()
    with pytest.raises(SlipstreamDataLossError,
                       match=r"positions \[0, \d+\) are no longer in the log.*holder"):
        rows(hosts.partition(hosts.executor_dir, 0, end))
    lenient = rows(hosts.partition(hosts.executor_dir, 0, end, fail=False))
    oldest = earliest_position(hosts.image)
    assert lenient and lenient[-1][1] == end
    assert lenient == rows(hosts.partition(hosts.holder_dir, oldest, end))


def test_a_task_off_the_holders_host_without_a_holder_address_says_to_set_one(
        two_drivers) -> None:
    """A query whose holder found no address other hosts reach: a task elsewhere fails
    saying so and naming the option, not reporting data loss."""
    hosts = two_drivers
    hosts.publish(3)
    start, end = hosts.image.position, hosts.image.available_position()
    with pytest.raises(Exception, match="set the reader's holderAddress option") as error:
        rows(hosts.partition(hosts.executor_dir, start, end, holder=False))
    assert not isinstance(error.value, SlipstreamDataLossError)


def test_a_range_that_ends_after_a_terms_padding_is_replayed_whole(two_drivers) -> None:
    """1000-byte messages fill a 64 KiB term to 65,472; the range [0, 65536) ends after the
    term's 64 bytes of padding (copied with the term's frames): the task reads the same 62
    rows as on the holder's host, and the replay ends where the range does."""
    hosts = two_drivers
    for first in (0, 25):  # consumed (credit for the rest), but less than a term: not cleaned
        hosts.publish(25, first=first, size=1000)
        while hosts.keeper.poll(lambda d, h: None, 100):
            pass
    hosts.publish(20, first=50, size=1000)
    assert hosts.image.available_position() > TERM
    local = rows(hosts.partition(hosts.holder_dir, 0, TERM))
    assert len(local) == 62 and local[-1][1] == 62 * 1056
    assert rows(hosts.partition(hosts.executor_dir, 0, TERM)) == local


def test_a_range_that_ends_with_an_aborted_claims_padding_is_read_whole(
        two_drivers, monkeypatch: pytest.MonkeyPatch) -> None:
    """An aborted claim leaves padding inside a term at the end of the range, which a replay
    cannot reproduce: the holder's replay ends before it, and asked again from there, the
    holder answers that no message begins before the range's end (no replay stream): the
    task reads the same rows as on the holder's host, with one replay."""
    hosts = two_drivers
    hosts.publish(10)
    claim = BufferClaim()
    assert hosts.publication.try_claim(200, claim) > 0
    claim.abort()
    end = hosts.publication.position
    local = rows(hosts.partition(hosts.holder_dir, 0, end))
    assert len(local) == 10 and local[-1][1] < end
    asked: list[tuple[int, int, int]] = []
    ask = ArchiveClient.replay_held

    def counted(*args: object, **kwargs: object) -> ArchiveReplay:
        call = inspect.signature(ask).bind(*args, **kwargs).arguments
        replay = ask(*args, **kwargs)  # type: ignore[arg-type]
        asked.append((call["start"], call["end"], replay.replay_id))
        return replay

    monkeypatch.setattr(ArchiveClient, "replay_held", counted)
    assert rows(hosts.partition(hosts.executor_dir, 0, end)) == local
    assert [(start, stop) for start, stop, _ in asked] == [(0, end), (local[-1][1], end)]
    assert asked[1][2] == 0  # nothing to replay: no stream


def test_a_range_of_a_session_gone_at_planning_is_data_loss_on_the_holders_host_too(
        two_drivers) -> None:
    """A batch planned after its session's image went (a query restarted after the publisher
    closed) has no log path, only the log its offsets name: a task on the holder's host
    reports data loss naming the range, or skips it with failOnDataLoss=false, as a task
    elsewhere is told by the holder (not an error about the path)."""
    hosts = two_drivers
    hosts.publish(3)
    end = hosts.image.available_position()
    gone = hosts.partition(hosts.holder_dir, 0, end)
    gone.log_path = ""  # as planned for a session with no image: the offsets' log only
    with pytest.raises(SlipstreamDataLossError,
                       match=rf"positions \[0, {end}\).*no log of this session"):
        rows(gone)
    skipped = hosts.partition(hosts.holder_dir, 0, end, fail=False)
    skipped.log_path = ""
    assert rows(skipped) == []


def test_the_querys_holder_unmaps_a_replayed_log_once_its_session_ended(
        two_drivers) -> None:
    """The query's holder maps a log to replay it; once the session leaves the query's logs
    (its image went) and no replay reads it, the mapping is dropped within about a second,
    without waiting for another request (the file is gone: the mapping was all that kept its
    memory)."""
    hosts = two_drivers
    hosts.publish(20)
    end = hosts.image.available_position()
    holder = planning._Holder(str(hosts.holder_dir), "127.0.0.2", free_port())
    try:
        holder.holds.publish({(hosts.image.stream_id, hosts.image.session_id):
                              (hosts.image.log_path, 0, None)})
        gone = hosts.partition(hosts.executor_dir, 0, end)
        gone.holder = holder.address
        assert len(rows(gone)) == 20
        assert holder.holds.mapped == [hosts.image.log_path]
        holder.holds.publish({})  # the planning thread saw the session's image go
        wait_for(lambda: not holder.holds.mapped, timeout=5,
                 what="the ended session's log unmapped")
    finally:
        holder.close()


def test_a_query_whose_hold_fails_to_start_leaves_no_client_behind(
        two_drivers, monkeypatch: pytest.MonkeyPatch) -> None:
    """The query's own hold fails after its client connected (here its replay holder raises
    what is not a slipstream error): the error goes up and the client is closed at once, not
    left for the driver to time out."""
    hosts = two_drivers
    made: list[Client] = []
    connect = Client.connect

    def recorded(*args: object, **kwargs: object) -> Client:
        made.append(connect(*args, **kwargs))
        return made[-1]

    def holder_fails(*args: object) -> None:
        raise OSError("no such interface")

    monkeypatch.setattr(planning.Client, "connect", recorded)
    monkeypatch.setattr(planning, "_Holder", holder_fails)
    monkeypatch.setattr(planning, "holder_address", lambda options: "127.0.0.2")
    options = parse_options({"streamId": str(STREAM), "channel": "aeron:ipc",
                             "directory": str(hosts.holder_dir)})
    with pytest.raises(OSError, match="no such interface"):
        planning._OwnHold(options)
    assert len(made) == 1 and made[0].is_closed
