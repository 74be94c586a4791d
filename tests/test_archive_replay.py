"""Replay from the archive against real driver processes and real segment files: a stopped
recording replayed whole, in part and from a time, across segments and term boundaries, at
the recorded positions; a live recording followed and stopped; a range not held refused by
name; the local reader, the same as a replay and never past the recorded position
(docs/ARCHIVE.md, "Replay")."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import free_port, message, wait_for
from loops import another_task
from test_archive import (
    SEGMENT,
    archive_process,
    publish,
    size_of,
    wait_for_recording,
    write_config,
)

from slipstream.archive import ArchiveSettings, RecordSpec, segment_files
from slipstream.archive.client import ArchiveClient
from slipstream.archive.locate import read_session
from slipstream.archive.reading import RecordingLostError, RecordingReader
from slipstream.archive.service import _IDLE_PARK_NS, ArchiveService
from slipstream.client import Client, Publication, control
from slipstream.client.holding import CallError, small_channel
from slipstream.client.layout import (
    DATA_HEADER,
    FRAME_ALIGNMENT,
    HDR_TYPE_DATA,
    HEADER_LENGTH,
    UNFRAGMENTED,
    align,
)

CONTROL_STREAM = 10


def replayed(replay, timeout: float = 60.0) -> list[tuple[bytes, int]]:
    """Every message of ``replay`` (an ArchiveReplay or a RecordingReader) until it is done,
    with the position after each."""
    got: list[tuple[bytes, int]] = []
    deadline = time.monotonic() + timeout
    while not replay.done:
        if replay.poll(lambda data, header: got.append((bytes(data), header.position)),
                       1000) == 0:
            assert time.monotonic() < deadline, f"replay at {replay.position} after {timeout} s"
            time.sleep(0.001)
    return got


def expected(first: int, positions: list[int]) -> list[tuple[bytes, int]]:
    return [(message(first + i, size_of(first + i)), p) for i, p in enumerate(positions)]


def start_archive(tmp_path: Path, driver_dir: Path, records: list[tuple[str, int]],
                  **settings: str):
    port = free_port()
    config = write_config(tmp_path / "archive.toml", tmp_path / "archive", driver_dir,
                          records, control_port=port, **settings)
    return port, archive_process(config, tmp_path / "archive.log")


@contextlib.contextmanager
def recording_ipc(tmp_path: Path, driver_dir: Path, stream_id: int,
                  **settings: str) -> Iterator[tuple[int, Client, Publication]]:
    """An archive process (in ``tmp_path / "archive"``, with ``settings``) recording IPC
    stream ``stream_id`` of the driver at ``driver_dir``, a client of that driver and its
    publication of the stream: (the archive's control port, the client, the publication),
    once the recording began."""
    port, process = start_archive(tmp_path, driver_dir, [("aeron:ipc", stream_id)], **settings)
    with Client.connect(driver_dir) as client, process:
        publication = client.add_publication("aeron:ipc", stream_id)
        wait_for_recording(tmp_path / "archive")
        yield port, client, publication


def test_a_stopped_recording_is_replayed_whole_in_part_and_from_a_time(
        driver, tmp_path: Path) -> None:
    """An IPC stream of mixed sizes (fragmented ones too) recorded over 8+ segments of two
    terms; replayed whole, then a middle range from a message inside one segment to one in a
    later segment, then from a time taken between two bursts: the payloads and positions are
    the published ones, from the exact message."""
    archive_dir = tmp_path / "archive"
    with recording_ipc(tmp_path, driver.directory, 10) as (port, client, publication):
        positions = publish(publication, 1200)
        wait_for(lambda: sum(p.stat().st_size for _, p in segment_files(archive_dir, 0))
                 >= positions[-1], timeout=20, what="the first burst recorded")
        time.sleep(0.3)  # three time index intervals between the bursts
        between_ms = time.time_ns() // 1_000_000
        time.sleep(0.3)
        positions += publish(publication, 600, first=1200)
        publication.close()
        descriptor = wait_for_recording(archive_dir, ended=True)
        assert descriptor.stop_position == positions[-1] > 8 * SEGMENT
        with ArchiveClient(client, "127.0.0.1", port, CONTROL_STREAM) as archive:
            listed = archive.list_recordings(stream_id=10)
            assert [r.recording_id for r in listed] == [0]
            assert listed[0].recorded_position == positions[-1]
            with archive.replay(0) as replay:
                assert replayed(replay) == expected(0, positions)
            first, last = 150, 1000  # from inside segment 1 to inside a later one
            assert (positions[first] // SEGMENT) < (positions[last] // SEGMENT) - 2
            with archive.replay(0, start=positions[first - 1], end=positions[last]) as replay:
                assert replayed(replay) == expected(first, positions[first:last + 1])
            with archive.replay(0, from_time_ms=between_ms) as replay:
                assert replay.start == positions[1199]
                assert replayed(replay) == expected(1200, positions[1200:])


def test_a_replay_read_to_its_end_frees_its_image_as_its_stream_ends(launch,
                                                                      tmp_path: Path) -> None:
    """A read of a recording through a replay closes its subscription once the replay's
    stream ended (the archive's publication sends its EOS as soon as it drained), and its
    driver frees the image then, three reads in a row: an image whose subscription went
    before the EOS waits five status-message timeouts for its sender (5 s here), holding its
    log, which counts against the replaying host's image_source_memory_limit."""
    driver = launch(status_message_timeout="1s", publication_connection_timeout="5s",
                    image_liveness_timeout="5s", log_reuse_bytes="0")
    archive_dir = tmp_path / "archive"
    images = driver.directory / control.IMAGES_DIR
    with recording_ipc(tmp_path, driver.directory, 10) as (port, client, publication):
        positions = publish(publication, 900)
        framing = (publication.initial_term_id, publication.term_length)
        publication.close()
        descriptor = wait_for_recording(archive_dir, ended=True)
        assert descriptor.stop_position == positions[-1] > 3 * SEGMENT
        with ArchiveClient(client, "127.0.0.1", port, CONTROL_STREAM) as archive:
            archive.list_recordings(stream_id=10)  # linked: its answers' images are there
            answers = set(images.glob("*.logbuffer"))
            for _ in range(3):
                got = [chunk.positions[-1] for chunk in read_session(
                    [archive], 10, descriptor.session_id, framing, 0, positions[-1])]
                assert got[-1] == positions[-1]
                wait_for(lambda: set(images.glob("*.logbuffer")) == answers, timeout=2.0,
                         what="the replay's image freed before a drain's wait")


def test_a_live_recording_is_followed_until_it_stops_and_stop_replay_ends_a_replay(
        driver, tmp_path: Path) -> None:
    """A replay with no end follows the recording while the publisher goes on, across term
    and segment boundaries, and ends with it at its stop position; a second one, stopped by
    stop_replay mid-stream, ends early with exactly a prefix of the messages."""
    archive_dir = tmp_path / "archive"
    with recording_ipc(tmp_path, driver.directory, 11) as (port, client, publication):
        positions = publish(publication, 100)
        with ArchiveClient(client, "127.0.0.1", port, CONTROL_STREAM) as archive:
            assert archive.recording_position(0)[1] is True
            follow = archive.replay(0)
            stopped = archive.replay(0)
            got: list[tuple[bytes, int]] = []
            cut: list[tuple[bytes, int]] = []
            for seq in range(100, 1300, 100):  # the replays read while the publisher goes on
                positions += publish(publication, 100, first=seq)
                follow.poll(lambda d, h: got.append((bytes(d), h.position)), 1000)
                if seq == 300:  # mid-stream: once it delivered some (a loaded host is slow)
                    deadline = time.monotonic() + 20
                    while not stopped.poll(lambda d, h: cut.append((bytes(d), h.position)),
                                           1000):
                        assert time.monotonic() < deadline, "the second replay began"
                        stopped.wait(0.01)
                    assert archive.stop_replay(stopped.replay_id) is True
            assert not follow.done
            publication.close()
            stop = wait_for_recording(archive_dir, ended=True).stop_position
            assert stop == positions[-1] > 5 * SEGMENT
            while not follow.done:
                follow.poll(lambda d, h: got.append((bytes(d), h.position)), 1000)
            assert got == expected(0, positions)
            with pytest.raises(Exception, match="ended at position"):
                deadline = time.monotonic() + 20
                while time.monotonic() < deadline:
                    stopped.poll(lambda d, h: cut.append((bytes(d), h.position)), 1000)
            assert 0 < len(cut) < len(positions)
            assert cut == expected(0, positions[:len(cut)])
            follow.close()
            stopped.close()


def test_a_range_not_held_is_refused_as_lost_naming_what_is_held(
        driver, tmp_path: Path) -> None:
    """Retention removed the recording's first segments: a replay from 0 is refused
    ``lost`` with the range the archive holds, and so is one past the stop; what is held
    replays."""
    archive_dir = tmp_path / "archive"
    with recording_ipc(tmp_path, driver.directory, 12,
                       retention_max_bytes=f"{3 * SEGMENT // 1024}k",
                       retention_check_interval="50ms") as (port, client, publication):
        positions = publish(publication, 1000)
        publication.close()
        stop = wait_for_recording(archive_dir, ended=True).stop_position
        wait_for(lambda: wait_for_recording(archive_dir).start_position > stop - 3 * SEGMENT,
                 timeout=10, what="retention moved the start")
        start = wait_for_recording(archive_dir).start_position
        assert start % SEGMENT == 0
        with ArchiveClient(client, "127.0.0.1", port, CONTROL_STREAM) as archive:
            with pytest.raises(RecordingLostError, match=f"holds \\[{start}, {stop}\\)") as lost:
                archive.start_replay(0, "aeron:ipc", 99, start=0)
            assert lost.value.held == (start, stop)
            with pytest.raises(RecordingLostError) as lost:
                archive.start_replay(0, "aeron:ipc", 99, start=start, end=stop + 32)
            assert lost.value.held == (start, stop)
            first = next(i for i, p in enumerate(positions) if p > start)
            with archive.replay(0, start=start) as replay:
                got = replayed(replay)
            # The segment began inside a message or at one: whole messages from the first
            # that begins at or after it.
            assert got[-len(positions[first + 1:]):] == expected(first + 1,
                                                                 positions[first + 1:])
        with pytest.raises(RecordingLostError):
            RecordingReader(archive_dir, 0, start=0)


def test_the_local_reader_reads_what_a_replay_does_and_never_past_the_recorded_position(
        driver, tmp_path: Path) -> None:
    """sync = "interval": the local reader follows a live recording and is never past the
    recorded position (the counter: what was synced; the recording moves it only after a
    sync), reading as the publisher goes on; once the recording stops it has read every
    message, the same as a replay, payloads and positions."""
    archive_dir = tmp_path / "archive"
    with recording_ipc(tmp_path, driver.directory, 13, sync="interval",
                       sync_interval="50ms") as (port, client, publication):
        positions = publish(publication, 60)
        with RecordingReader(archive_dir, 0, driver_dir=driver.directory) as reader:
            assert reader.position <= reader.recorded_position
            positions += publish(publication, 600, first=60)  # fills segments: synced
            got: list[tuple[bytes, int]] = []
            deadline = time.monotonic() + 20
            while reader.position < 2 * SEGMENT:
                assert time.monotonic() < deadline
                reader.poll(lambda d, h: got.append((bytes(d), h.position)), 100)
                assert reader.position <= reader.recorded_position
            publication.close()
            wait_for_recording(archive_dir, ended=True)
            got += replayed(reader)
        assert got == expected(0, positions)
        with ArchiveClient(client, "127.0.0.1", port, CONTROL_STREAM) as archive, \
                archive.replay(0) as replay:
            assert replayed(replay) == got
        gathered = []
        with RecordingReader(archive_dir, 0) as reader:
            while not reader.done:
                chunk = reader.poll_gathered(50)
                if chunk is not None:
                    gathered += [(bytes(chunk.data[chunk.offsets[i]:chunk.offsets[i + 1]]),
                                  chunk.positions[i]) for i in range(len(chunk))]
        assert gathered == got


def test_the_command_line_lists_live_positions_and_prints_or_forwards_a_replay(
        driver, tmp_path: Path) -> None:
    """``list`` shows a live recording's recorded position from its counter; ``replay``
    prints a range's messages with their positions, and ``--channel/--stream`` has the
    archive send it to a subscriber there; a range past a stopped recording's stop is
    refused, exit status 1, naming it lost."""
    archive_dir = tmp_path / "archive"
    config = tmp_path / "archive.toml"
    cli = [sys.executable, "-m", "slipstream.archive.cli"]
    with recording_ipc(tmp_path, driver.directory, 14) as (port, client, publication):
        positions = publish(publication, 40)
        with ArchiveClient(client, "127.0.0.1", port, CONTROL_STREAM) as archive:
            wait_for(lambda: archive.recording_position(0) == (positions[-1], True),
                     what="recorded")
        listing = subprocess.run([*cli, "list", "--config", str(config)], capture_output=True,
                                 text=True, timeout=60)
        assert listing.returncode == 0, listing.stderr
        row = listing.stdout.splitlines()[1].split()
        assert row[0] == "0" and row[6] == "-" and row[7] == str(positions[-1]), listing.stdout
        printed = subprocess.run([*cli, "replay", "0", "--config", str(config), "--from",
                                  str(positions[4]), "--to", str(positions[14])],
                                 capture_output=True, text=True, timeout=60)
        assert printed.returncode == 0, printed.stderr
        rows = [line.split() for line in printed.stdout.splitlines()[2:]]
        assert [int(r[0]) for r in rows] == positions[5:15]
        assert [int(r[1]) for r in rows] == [size_of(seq) for seq in range(5, 15)]
        target = client.add_subscription("aeron:ipc", 77)
        forwarded = subprocess.run([*cli, "replay", "0", "--config", str(config), "--to",
                                    str(positions[-1]), "--channel", "aeron:ipc", "--stream",
                                    "77"], capture_output=True, text=True, timeout=60)
        assert forwarded.returncode == 0, forwarded.stderr
        assert "replay 2: recording 0 from 0" in forwarded.stdout
        got: list[tuple[bytes, int]] = []
        wait_for(lambda: target.poll(lambda d, h: got.append((bytes(d), h.position)), 100)
                 >= 0 and len(got) == 40, timeout=20, what="the forwarded replay")
        assert got == expected(0, positions)
        publication.close()
        wait_for_recording(archive_dir, ended=True)  # stopped: nothing past its stop is held
        lost = subprocess.run([*cli, "replay", "0", "--config", str(config), "--from", "0",
                               "--to", str(positions[-1] + 4096)], capture_output=True,
                              text=True, timeout=60)
        assert lost.returncode == 1 and "lost" in lost.stderr, lost


def test_bad_calls_are_counted_or_answered_naming_their_cause(driver, tmp_path: Path) -> None:
    """A control message that is not a call is counted and dropped, and the archive answers
    the next call; an unknown operation, a replay channel that sets the recording's framing
    and a recording that does not exist are answered with errors naming them."""
    port = free_port()
    settings = ArchiveSettings(dir=tmp_path / "archive", driver_dir=driver.directory,
                               control_port=port)
    stopping = threading.Event()
    with ArchiveService(settings) as service:
        runner = threading.Thread(target=service.run, args=(stopping.is_set,))
        runner.start()
        try:
            with Client.connect(driver.directory) as client:
                # As a caller's link publishes its calls (one publication of the channel).
                garbage = client.add_publication(
                    small_channel(f"aeron:udp?endpoint=127.0.0.1:{port}"), CONTROL_STREAM)
                wait_for(lambda: garbage.offer(b"\xffnot json") > 0, what="garbage offered")
                with ArchiveClient(client, "127.0.0.1", port, CONTROL_STREAM) as archive:
                    assert archive.list_recordings() == []
                    with pytest.raises(CallError, match="no operation 'replay_all'"):
                        archive._call("replay_all")
                    with pytest.raises(CallError, match="no recording 5"):
                        archive.start_replay(5, "aeron:ipc", 1)
                    with pytest.raises(CallError, match="term-length"):
                        archive._link.call("replay", recording_id=0, stream_id=1,
                                           channel="aeron:ipc?term-length=64k")
                assert service.control is not None and service.control.malformed == 1
                garbage.close()
        finally:
            stopping.set()
            runner.join(10)


def test_a_call_wakes_an_idle_archive_at_once_not_after_its_park(driver,
                                                                   tmp_path: Path) -> None:
    """An archive recording a stream that is quiet parks on the recording's log; a call that
    arrives on the control stream ends the park at once (each idle wait with a call waiting
    returns in well under the park), and the call is then taken."""
    port = free_port()
    settings = ArchiveSettings(dir=tmp_path / "archive", driver_dir=driver.directory,
                               control_port=port, records=(RecordSpec("aeron:ipc", 15),))
    with ArchiveService(settings) as service, Client.connect(driver.directory) as client:
        publication = client.add_publication("aeron:ipc", 15)
        wait_for(lambda: service.do_work() >= 0 and bool(service.recordings),
                 what="the quiet stream recorded")
        caller = client.add_publication(
            small_channel(f"aeron:udp?endpoint=127.0.0.1:{port}"), CONTROL_STREAM)
        wait_for(lambda: caller.offer(b"\xffnot json") > 0, what="a call offered")
        assert service.control is not None
        control = service.control
        wait_for(lambda: any(i.available_position() > i.position
                             for i in control.call_images()), what="the call arrived")
        waits = []
        for _ in range(5):
            began = time.monotonic_ns()
            service.idle()
            waits.append(time.monotonic_ns() - began)
        assert sorted(waits)[2] < _IDLE_PARK_NS // 4, waits
        service.do_work()
        assert control.malformed == 1
        caller.close()
        publication.close()


def test_the_local_reader_never_reads_a_frame_past_the_recorded_stop(driver,
                                                                    tmp_path: Path) -> None:
    """A whole, valid frame lies in the segment file just past where the recording stopped
    (as a write past the recorded position would leave it): the local reader reads every
    recorded message and stops at the stop position, never delivering that frame."""
    archive_dir = tmp_path / "archive"
    with recording_ipc(tmp_path, driver.directory, 14) as (_, _, publication):
        positions = publish(publication, 40)
        publication.close()
        descriptor = wait_for_recording(archive_dir, ended=True)
    stop = descriptor.stop_position
    assert stop == positions[-1]
    base, path = next((b, p) for b, p in segment_files(archive_dir, 0)
                      if b <= stop < b + max(SEGMENT, descriptor.term_length))
    payload = message(40, 8)
    term_id = descriptor.initial_term_id + stop // descriptor.term_length
    frame = DATA_HEADER.pack(HEADER_LENGTH + len(payload), 0, UNFRAGMENTED, HDR_TYPE_DATA,
                             stop % descriptor.term_length, descriptor.session_id,
                             descriptor.stream_id, term_id, 0) + payload
    with open(path, "r+b") as segment:
        segment.seek(stop - base)
        segment.write(frame.ljust(align(len(frame), FRAME_ALIGNMENT), b"\0"))
    with RecordingReader(archive_dir, 0) as reader:
        got = replayed(reader)
        assert reader.position == stop
    assert got == expected(0, positions)


@pytest.mark.anyio  # under trio and asyncio (tests/loops.py)
async def test_a_replay_is_read_from_a_trio_or_asyncio_task_and_its_wait_cancelled_at_once(
        driver, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``read_all_async`` reads a recording of 600 mixed-size messages (several segments)
    whole while another task of the loop keeps running; on a followed live recording with
    nothing more to come it parks, and a cancellation frees its thread from the futex (the
    park slices far longer than the wait for it: only the wake frees it).  Once the recording
    stops, a followed replay's check of its stop is the archive call's async form (which
    waits without blocking the loop: tests/test_archive_async.py), never the blocking one."""
    import anyio

    from slipstream.client import aio
    from slipstream.client.layout import META_READER_WAITERS

    monkeypatch.setattr(aio, "PARK_SLICE_NS", 30_000_000_000)

    with recording_ipc(tmp_path, driver.directory, 10) as (port, client, publication):
        positions = publish(publication, 600)
        assert positions[-1] > 2 * SEGMENT
        with ArchiveClient(client, "127.0.0.1", port, CONTROL_STREAM) as archive:
            wait_for(lambda: archive.recording_position(0)[0] >= positions[-1],
                     what="the messages recorded")
            got: list[tuple[bytes, int]] = []
            async with another_task(0.001) as ticks:
                with archive.replay(0, end=positions[-1]) as replay:
                    await replay.read_all_async(
                        lambda data, header: got.append((bytes(data), header.position)), 30)
            assert got == expected(0, positions)
            assert ticks.count > 0
            with archive.replay(0) as followed:  # live: it ends only when the recording stops
                with anyio.move_on_after(1.0) as scope:
                    await followed.read_all_async(lambda data, header: None, 60)
                assert scope.cancelled_caught and followed.position == positions[-1]
                image = followed.image()
                assert image is not None
                wait_for(lambda: image._log.meta_i32(META_READER_WAITERS) == 0,
                         what="the worker thread off the futex")

            publication.close()  # the recording stops: a followed replay ends there
            wait_for(lambda: not archive.recording_position(0)[1], what="the recording stopped")
            asked = archive.recording_position_async
            checks = 0

            async def recording_position_async(recording_id: int) -> tuple[int, bool]:
                nonlocal checks
                checks += 1
                return await asked(recording_id)

            def recording_position(recording_id: int) -> tuple[int, bool]:
                raise AssertionError("the stop's check blocked the loop with a blocking call")

            monkeypatch.setattr(archive, "recording_position_async", recording_position_async)
            monkeypatch.setattr(archive, "recording_position", recording_position)
            with archive.replay(0) as followed:
                got.clear()
                await followed.read_all_async(
                    lambda data, header: got.append((bytes(data), header.position)), 30)
                assert followed.done
            assert got == expected(0, positions) and checks == 1
