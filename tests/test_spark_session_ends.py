"""A read query whose sessions end or whose logs are made anew, without a SparkSession: the
planner called as Spark calls it, on real drivers (one per "host", on this machine).

Every way a session leaves a query's offsets is either complete (read to its end-of-stream
mark) or reported as loss naming how it ended and what went: never in silence, never as a
failed call, never with another cause.  And a planner on the holder's own host reaches it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from helpers import NETWORK_SETTINGS, free_port, start_holding_archive, wait_for
from pyspark.sql.streaming.datasource import ReadAllAvailable

from slipstream.archive.client import ArchiveClient
from slipstream.archive.service import ArchiveService
from slipstream.archive.settings import DEFAULT_CONTROL_STREAM_ID, ArchiveSettings, HoldSpec
from slipstream.client import Client
from slipstream.client.counters import SystemCounter, read_system_counters
from slipstream.client.holding import HolderLink
from slipstream.daemon.driver import MediaDriver
from slipstream.spark_bridge.options import parse_options
from slipstream.spark_bridge.reader import (
    SlipstreamDataLossError,
    SlipstreamStreamReader,
    position_of,
    read_range,
)

pytestmark = pytest.mark.timeout(120)

STREAM = 5501
PAYLOAD = 100
FRAME = 160  # a message's frame: 100 bytes and the 32-byte header, aligned to 32
TERM = 64 * 1024


class Hosts:
    """Drivers standing for hosts: ``ingest`` (where the stream is sent and held),
    ``publisher`` (killable: the publishing host's driver) and ``spark`` (the planner's)."""

    def __init__(self, stack: contextlib.ExitStack) -> None:
        self._stack = stack
        self.directories: dict[str, Path] = {}
        self.drivers: dict[str, MediaDriver] = {}
        self.start("ingest", "publisher", "spark")
        self.port = free_port()
        self.channel = f"aeron:udp?endpoint=127.0.0.1:{self.port}"
        self.published = 0
        self.publisher: Client | None = None
        self.publication = None

    def start(self, *names: str) -> None:
        """Start the drivers of ``names``, side by side (each start waits for a process)."""
        launches = {name: MediaDriver.launch(directory=self.directories.setdefault(
            name, Path("/dev/shm") / f"slipstream-ends-{uuid.uuid4().hex[:6]}-{name}"),
            **NETWORK_SETTINGS) for name in names}
        with ThreadPoolExecutor(len(names)) as pool:
            starts = {name: pool.submit(launch.__enter__) for name, launch in launches.items()}
        failed = None
        for name, started in starts.items():  # the stack stops each one that started
            if started.exception() is None:
                self.drivers[name] = started.result()
                self._stack.push(launches[name])
            else:
                failed = failed or started.exception()
        if failed is not None:
            raise failed

    def publish_from(self, name: str) -> None:
        self.publisher = self._stack.enter_context(Client.connect(self.directories[name]))
        self.publication = self.publisher.add_publication(
            f"{self.channel}|term-length={TERM}", STREAM)

    def publish(self, count: int, *, timeout_s: float = 10.0) -> int:
        """Offer ``count`` numbered messages; how many went before ``timeout_s`` of back
        pressure (or of no subscriber)."""
        assert self.publication is not None
        for went in range(count):
            deadline = time.monotonic() + timeout_s
            data = f"{self.published:08d}".encode().ljust(PAYLOAD, b".")
            while self.publication.offer(data) < 0:
                if time.monotonic() > deadline:
                    return went
                time.sleep(0.0005)
            self.published += 1
        return count


@pytest.fixture
def hosts() -> Iterator[Hosts]:
    with contextlib.ExitStack() as stack:
        made = Hosts(stack)
        try:
            yield made
        finally:
            stack.close()
            for directory in made.directories.values():
                shutil.rmtree(directory, ignore_errors=True)


def start_holder(hosts: Hosts, port: int) -> subprocess.Popen[str]:
    """The ingest host's archive holding streams beside the ingest driver, its control
    stream at 127.0.0.2:``port`` (its directory kept across restarts)."""
    archive = hosts.directories.setdefault(
        "archive", Path("/dev/shm") / f"slipstream-ends-{uuid.uuid4().hex[:6]}-archive")
    return start_holding_archive(hosts.directories["ingest"], "127.0.0.2", port, archive)


def stop_holder(process: subprocess.Popen[str]) -> None:
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    assert process.stdout is not None
    print(process.stdout.read())


@pytest.fixture
def holder(hosts: Hosts) -> Iterator[int]:
    """The standing holder process beside the ingest driver, at 127.0.0.2; its port."""
    port = free_port()
    process = start_holder(hosts, port)
    try:
        yield port
    finally:
        stop_holder(process)


def numbers(partitions: list, directory: Path) -> list[int]:
    """The message numbers ``partitions`` hold, read by tasks on the host of ``directory``."""
    found = []
    for partition in partitions:
        partition.directory = str(directory)
        for batch in read_range(partition):
            found += [int(value[:8]) for value in batch.column("value").to_pylist()]
    return found


def run_batches(planner: SlipstreamStreamReader, start: dict, read: list[int],
                directory: Path, until: float,
                done: Callable[[dict], bool] | None = None) -> dict:
    """Plan, read and commit batches as Spark does until ``until`` (monotonic) or, given
    ``done``, until it holds for the committed offsets (``until`` then only bounds the wait);
    returns the last committed offsets.  Raises what the planner raises."""
    while time.monotonic() < until:
        end = planner.latestOffset(start, ReadAllAvailable())
        if end != start:
            read += numbers(planner.partitions(start, end), directory)
            planner.commit(end)
            start = end
        if done is not None and done(start):
            break
        time.sleep(0.05)
    return start


def standing_planner(hosts: Hosts, port: int, **options: str) -> SlipstreamStreamReader:
    return SlipstreamStreamReader(parse_options({
        "streamId": str(STREAM), "channel": f"aeron:udp?endpoint=127.0.0.2:{hosts.port}",
        "directory": str(hosts.directories["spark"]), "holder": f"127.0.0.2:{port}",
        "replayTimeoutMs": "10000", **options}))


@pytest.mark.parametrize("fail_on_data_loss", [True, False])
def test_a_session_whose_publishing_driver_died_while_the_query_was_down_is_reported(
        hosts: Hosts, holder: int, fail_on_data_loss: bool) -> None:
    """A standing holder holds the stream while the query is down; the publisher goes on
    until it is held back, then its host's driver is killed (what its log held past the
    holder's window is gone with it) and started again.  The restarted query reads what the
    holder received, once, and then reports the session as ended without its end-of-stream
    mark: failOnDataLoss=true fails naming it, false counts a skip and goes on.  Never does
    the session just leave the offsets."""
    hosts.channel = f"aeron:udp?endpoint=127.0.0.2:{hosts.port}"
    hosts.publish_from("publisher")
    planner = standing_planner(hosts, holder, failOnDataLoss=str(fail_on_data_loss).lower())
    read: list[int] = []
    try:
        start = planner.initialOffset()
        wait_for(lambda: planner._images(), what="the session at the holder")
        assert hosts.publish(200) == 200
        deadline = time.monotonic() + 10
        while len(read) < 200:
            start = run_batches(planner, start, read, hosts.directories["spark"],
                                time.monotonic() + 0.1)
            assert time.monotonic() < deadline, "the first messages were not read"
    finally:
        planner.stop()
    # Down: the holder keeps the position; the publisher gets one window in, then waits.
    held_back = hosts.publish(10_000, timeout_s=1.0)
    assert held_back < 10_000, "the holder did not hold the publisher back"
    assert hosts.publication is not None
    session = str(hosts.publication.session_id)
    hosts.drivers["publisher"].kill()
    hosts.start("publisher")
    skips_before = read_system_counters(hosts.directories["spark"])[
        SystemCounter.DATA_LOSS_SKIPS]
    planner = standing_planner(hosts, holder, failOnDataLoss=str(fail_on_data_loss).lower())
    try:
        if fail_on_data_loss:
            with pytest.raises(SlipstreamDataLossError) as failed:
                start = run_batches(planner, start, read, hosts.directories["spark"],
                                    time.monotonic() + 15)
            message = str(failed.value)
            assert f"session {session}" in message
            assert "without the stream's end-of-stream mark" in message
            assert "whatever its publisher accepted after position" in message
        else:
            start = run_batches(planner, start, read, hosts.directories["spark"],
                                time.monotonic() + 15, lambda offsets: session not in offsets)
            assert session not in start
            assert read_system_counters(hosts.directories["spark"])[
                SystemCounter.DATA_LOSS_SKIPS] == skips_before + 1
    finally:
        planner.stop()
    # What reached the holder was read, once, in order: the first 200 and some of the rest.
    assert read == list(range(len(read)))
    assert 200 < len(read) < 200 + held_back


def test_a_publisher_that_ends_normally_leaves_the_offsets_in_silence(
        hosts: Hosts, holder: int) -> None:
    """The publisher closes its publication mid-query: the query reads every message once,
    the session leaves the offsets once its image goes at the holder, and a view taken
    before it went still moves its position (to the end, where there is nothing left to
    hold) without failing the batch."""
    hosts.channel = f"aeron:udp?endpoint=127.0.0.2:{hosts.port}"
    hosts.publish_from("publisher")
    planner = standing_planner(hosts, holder)
    read: list[int] = []
    try:
        start = planner.initialOffset()
        wait_for(lambda: planner._images(), what="the session at the holder")
        assert hosts.publish(300) == 300
        assert hosts.publication is not None
        session = str(hosts.publication.session_id)
        start = run_batches(planner, start, read, hosts.directories["spark"],
                            time.monotonic() + 10, lambda _: len(read) >= 300)
        stale = planner._images()[session]  # the state as a batch saw it
        hosts.publication.close()
        start = run_batches(planner, start, read, hosts.directories["spark"],
                            time.monotonic() + 1)  # the session still in the offsets
        assert read == list(range(300))
        wait_for(lambda: session not in planner._images(), timeout=10,
                 what="the session's image gone at the holder")
        assert stale.advance_to(position_of(start[session])) is None
        start = run_batches(planner, start, read, hosts.directories["spark"],
                            time.monotonic() + 10, lambda offsets: session not in offsets)
        assert session not in start
    finally:
        planner.stop()
    assert read == list(range(300))


def test_a_log_made_anew_after_the_query_went_names_that_cause_and_the_whole_range(
        hosts: Hosts) -> None:
    """No standing holder: the query's own subscription is what holds the stream.  The
    planner goes (its Spark driver died), its image goes with it, and a new one joins where
    the publisher is when the query comes back.  The loss is reported as that, naming the
    range from the committed offset to where the new log begins: at planning for a batch
    planned before (Spark runs it again), and in latestOffset."""
    hosts.publish_from("publisher")
    options = {"streamId": str(STREAM), "channel": hosts.channel,
               "directory": str(hosts.directories["spark"]), "holderAddress": "127.0.0.1"}
    planner = SlipstreamStreamReader(parse_options(options))
    read: list[int] = []
    try:
        start = planner.initialOffset()
        wait_for(lambda: planner._images(), what="the session at the planner's host")
        hosts.publish(100)
        start = run_batches(planner, start, read, hosts.directories["spark"],
                            time.monotonic() + 10, lambda _: len(read) >= 100)
        assert read == list(range(100))
        hosts.publish(50)
        wait_for(lambda: all(v.available_position() > position_of(start[s])
                             for s, v in planner._images().items()), what="more to read")
        in_flight = planner.latestOffset(start, ReadAllAvailable())  # planned, not run
        assert in_flight != start
    finally:
        planner.stop()
    session = next(iter(start))
    committed = position_of(start[session])
    hosts.publish(400, timeout_s=3.0)  # into the publisher's log, nowhere else
    hosts.publish(10, timeout_s=0.1)
    planner = SlipstreamStreamReader(parse_options(options))
    try:
        # As Spark restarts a query: the batch planned before first, at once (its image is
        # not there yet), then the next.
        with pytest.raises(SlipstreamDataLossError) as again:
            planner.partitions(start, in_flight)
        image = planner._images()[session]
        joined = image.join_position
        assert joined > committed
        with pytest.raises(SlipstreamDataLossError) as latest:
            planner.latestOffset(start, ReadAllAvailable())
    finally:
        planner.stop()
    for failure in (again, latest):
        message = str(failure.value)
        assert f"[{committed}, {joined})" in message, message
        assert "made anew" in message and "fell further behind" not in message


def test_a_restarted_query_waits_for_its_sessions_images_before_calling_them_gone(
        hosts: Hosts) -> None:
    """A query restarted (its own hold) asks at once with offsets whose session has no image
    yet (the publishing host's driver is stalled, so none comes for 2 s): the session stays
    where it is, not reported gone, and is read on once its image comes, every message once."""
    hosts.publish_from("publisher")
    options = {"streamId": str(STREAM), "channel": hosts.channel,
               "directory": str(hosts.directories["spark"]), "holderAddress": "127.0.0.1"}
    first = SlipstreamStreamReader(parse_options(options))
    read: list[int] = []
    try:
        start = first.initialOffset()
        wait_for(lambda: first._images(), what="the session")
        hosts.publish(50)
        start = run_batches(first, start, read, hosts.directories["spark"],
                            time.monotonic() + 10, lambda _: len(read) >= 50)
        assert read == list(range(50))
    finally:
        first.stop()
    time.sleep(3)  # the image with no subscriber goes (image liveness 1 s, its linger)
    publisher_pid = hosts.drivers["publisher"].pid
    os.kill(publisher_pid, signal.SIGSTOP)
    second = SlipstreamStreamReader(parse_options(options))
    try:
        stalled_until = time.monotonic() + 2
        while time.monotonic() < stalled_until:
            assert second.latestOffset(start, ReadAllAvailable()) == start  # kept, not gone
            time.sleep(0.1)
        os.kill(publisher_pid, signal.SIGCONT)
        hosts.publish(50)
        start = run_batches(second, start, read, hosts.directories["spark"],
                            time.monotonic() + 10, lambda _: len(read) >= 100)
    finally:
        os.kill(publisher_pid, signal.SIGCONT)
        second.stop()
    assert read == list(range(100))

@pytest.mark.parametrize("listen", ["127.0.0.1", "0.0.0.0"])
def test_a_planner_and_a_replay_reader_on_the_holders_own_host_reach_it(
        hosts: Hosts, listen: str) -> None:
    """A holder listening at this host's address (or at every address), and a caller and a
    replay reader on this same host, through the same driver: they get their answers at a
    port of their own, not at the holder's endpoint (whose receive window is not a reply
    endpoint's, or which no other endpoint may share)."""
    ingest = hosts.directories["ingest"]
    port = free_port()
    settings = ArchiveSettings(dir=hosts.directories.setdefault(
        "archive", Path("/dev/shm") / f"slipstream-ends-{uuid.uuid4().hex[:6]}-archive"),
        driver_dir=ingest, control_address=listen, control_port=port,
        holds=(HoldSpec(hosts.channel, STREAM),))
    with Client.connect(ingest) as holding, Client.connect(ingest) as calling:
        archive = ArchiveService(settings, client=holding)
        try:
            held = archive.holds.hold(hosts.channel, STREAM)  # the settings' hold
            assert archive.holds.held == [(hosts.channel, STREAM, "spark")]
            with Client.connect(hosts.directories["publisher"]) as publishing:
                publication = publishing.add_publication(f"{hosts.channel}|term-length={TERM}",
                                                         STREAM)
                wait_for(lambda: (archive.do_work(), publication.is_connected)[1],
                         what="the archive's image")
                while publication.offer(b"x" * PAYLOAD) < 0:
                    archive.do_work()
                wait_for(lambda: (archive.do_work(), held.subscription.images and
                                  held.subscription.images[0].available_position() > 0)[1],
                         what="a message at the archive")
                link = HolderLink(calling, "127.0.0.1", port, DEFAULT_CONTROL_STREAM_ID,
                                  timeout_s=10)
                answers = []
                caller = threading.Thread(target=lambda: answers.append(link.call(
                    "state", channel=hosts.channel, stream_id=STREAM, group="spark")))
                caller.start()
                while caller.is_alive():
                    archive.do_work()
                link.close()
                assert answers and list(answers[0]["sessions"]) == [
                    str(publication.session_id)]
                image = held.subscription.images[0]
                replays = []
                reader_link = ArchiveClient(calling, "127.0.0.1", port, timeout_s=10)
                reader = threading.Thread(target=lambda: replays.append(
                    reader_link.replay_held(
                        {"channel": hosts.channel, "stream_id": STREAM, "group": "spark"},
                        image.session_id, image.identity.framing, image.join_position,
                        image.available_position())))
                reader.start()
                while reader.is_alive():
                    archive.do_work()
                assert replays
                with replays[0] as replay:
                    deadline = time.monotonic() + 10
                    while not replay.done:
                        archive.do_work()
                        replay.poll(lambda data, header: None)
                        assert time.monotonic() < deadline
                reader_link.close()
        finally:
            archive.stop()


def test_a_restarted_holder_is_given_time_to_hold_again_and_its_loss_named_so(
        hosts: Hosts) -> None:
    """The standing holder restarts while the query is down: its new subscription has no
    image yet when the restarted query asks at once, then joins where the stream is.  The
    query waits for the image (the session is not called gone) and then reports the loss
    as the holder's: its subscription joined after the query's last commit."""
    hosts.channel = f"aeron:udp?endpoint=127.0.0.2:{hosts.port}"
    hosts.publish_from("publisher")
    port = free_port()
    holder = start_holder(hosts, port)
    read: list[int] = []
    try:
        planner = standing_planner(hosts, port)
        try:
            start = planner.initialOffset()
            wait_for(lambda: planner._images(), what="the session at the holder")
            hosts.publish(100)
            start = run_batches(planner, start, read, hosts.directories["spark"],
                                time.monotonic() + 10, lambda _: len(read) >= 100)
            assert read == list(range(100))
        finally:
            planner.stop()
        assert hosts.publish(50) == 50  # into the holder's log, not read
        wait_for(lambda: not hosts.publication.is_connected or  # type: ignore[union-attr]
                 hosts.publication.position >= 150 * FRAME,  # type: ignore[union-attr]
                 what="the 50 sent")
        stop_holder(holder)
        time.sleep(3)  # the image with no subscriber goes (image liveness 1 s, its linger)
        holder = start_holder(hosts, port)
        planner = standing_planner(hosts, port)
        try:
            deadline = time.monotonic() + 20
            with pytest.raises(SlipstreamDataLossError) as lost:
                while time.monotonic() < deadline:
                    assert planner.latestOffset(start, ReadAllAvailable()) == start
                    hosts.publish(1, timeout_s=0.01)
                    time.sleep(0.1)
        finally:
            planner.stop()
    finally:
        stop_holder(holder)
    message = str(lost.value)
    assert "the archive holding the stream on" in message and \
        "holds it only from position" in message
    assert f"[{100 * FRAME}, " in message and "has no log" not in message


def test_many_ended_sessions_never_outgrow_the_holders_answers(hosts: Hosts,
                                                             holder: int) -> None:
    """80 publishers of a stream come and go at a standing holder: its state answer stays
    the size of the live sessions (the ends are asked for by session, a few dozen a call),
    and a planner asking how each ended gets every one."""
    hosts.channel = f"aeron:udp?endpoint=127.0.0.2:{hosts.port}"
    planner = standing_planner(hosts, holder)
    sessions = []
    try:
        planner.initialOffset()
        with Client.connect(hosts.directories["publisher"]) as publishing:
            for _ in range(80):
                publication = publishing.add_exclusive_publication(
                    f"{hosts.channel}|term-length={TERM}", STREAM)
                sessions.append(str(publication.session_id))
                wait_for(lambda p=publication: p.is_connected, what="the holder's image")
                while publication.offer(b"x" * PAYLOAD) < 0:
                    time.sleep(0.001)
        start = {}
        deadline = time.monotonic() + 60
        while True:  # each session enters, is read, and goes
            end = planner.latestOffset(start, ReadAllAvailable())
            planner.commit(end)
            start = end
            if not planner._images() and time.monotonic() > deadline - 55:
                break
            assert time.monotonic() < deadline, "the sessions never went"
            time.sleep(0.2)
        assert planner._hold is not None
        ends = planner._hold.ended(sessions)
    finally:
        planner.stop()
    assert sorted(ends) == sorted(sessions)
    assert all(end.complete for end in ends.values())
