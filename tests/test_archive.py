"""The archive service against real driver processes: streams recorded across segments and
term rotations, byte for byte at their positions; killed mid-recording and recovered; its
command line (docs/ARCHIVE.md)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

import pytest
from helpers import Collector, free_port, message, wait_for

from slipstream.archive import (
    Catalog,
    EndReason,
    RecordingDescriptor,
    segment_base,
    segment_file_name,
    segment_files,
)
from slipstream.archive.catalog import CATALOG_FILE
from slipstream.archive.catalog import HEADER_LENGTH as CATALOG_HEADER_LENGTH
from slipstream.archive.recovery import verify
from slipstream.archive.service import ArchiveService, recording_position_key
from slipstream.archive.settings import ArchiveSettings, RecordSpec, SyncPolicy
from slipstream.client import Client
from slipstream.client.control import COUNTERS_FILE
from slipstream.client.counters import CountersFile, CounterType
from slipstream.client.layout import (
    BEGIN_FLAG,
    DATA_HEADER,
    END_FLAG,
    FRAME_ALIGNMENT,
    HDR_TYPE_PAD,
    HEADER_LENGTH,
    align,
)

TERM = 64 * 1024  # the test drivers' term length (helpers.FAST_DRIVER_SETTINGS, NETWORK_...)
SEGMENT = 2 * TERM


def write_config(path: Path, archive_dir: Path, driver_dir: Path,
                 records: Sequence[tuple[str, int] | tuple[str, int, dict[str, str]]], *,
                 control_port: int = 0, **settings: str) -> Path:
    """An archive's settings; no control stream unless ``control_port`` (tests run in
    parallel: each takes a free port).  A record may carry keys of its own (a dict)."""
    lines = [f'dir = "{archive_dir}"', f'driver_dir = "{driver_dir}"',
             f'segment_length = "{SEGMENT // 1024}k"', f"control_port = {control_port}"]
    lines += [f'{key} = "{value}"' for key, value in settings.items()]
    for channel, stream_id, *own in records:
        lines += ["[[record]]", f'channel = "{channel}"', f"stream_id = {stream_id}"]
        lines += [f'{key} = "{value}"' for keys in own for key, value in keys.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


@contextmanager
def archive_process(config: Path | None, log_path: Path, prefix: Sequence[str] = (),
                    args: Sequence[str] = (), env: Mapping[str, str] | None = None
                    ) -> Iterator[subprocess.Popen[bytes]]:
    """``slipstream-archive run --config`` (none when ``config`` is None) with ``args``, a
    real process (run through ``prefix``: a test host's, ``Host.prefix()``; in ``env``),
    stopped (SIGKILL) if a test left it running."""
    with open(log_path, "ab") as log_file:
        process = subprocess.Popen(
            [*prefix, sys.executable, "-m", "slipstream.archive.cli", "run",
             *(("--config", str(config)) if config is not None else ()), *args],
            stdout=log_file, stderr=subprocess.STDOUT, env=env)
    try:
        yield process
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=10)


def recordings(archive_dir: Path) -> list[RecordingDescriptor]:
    path = archive_dir / CATALOG_FILE
    # Made but not yet written: the service creates the file, then writes its header.
    if not path.exists() or path.stat().st_size < CATALOG_HEADER_LENGTH:
        return []
    with Catalog.open(archive_dir, writable=False) as catalog:
        return catalog.recordings()


def wait_for_recording(archive_dir: Path, index: int = 0, timeout: float = 20.0,
                       ended: bool = False) -> RecordingDescriptor:
    found: list[RecordingDescriptor] = []

    def there() -> bool:
        found[:] = recordings(archive_dir)
        return len(found) > index and (not ended or not found[index].is_active)

    wait_for(there, timeout=timeout, what=f"recording {index} {'ended' if ended else 'made'}")
    return found[index]


def recorded_messages(descriptor: RecordingDescriptor, archive_dir: Path
                      ) -> list[tuple[bytes, int]]:
    """Every whole message the recording holds, from its segment files, with the stream
    position after it: the frames walked from the start position (a reader of the format,
    written apart from the archive's)."""
    out: list[tuple[bytes, int]] = []
    position = descriptor.start_position
    assembling: bytearray | None = None
    segment_length = descriptor.segment_length
    while position < descriptor.stop_position:
        base = segment_base(descriptor.start_position, position, descriptor.term_length,
                            segment_length)
        data = (archive_dir / segment_file_name(descriptor.recording_id, base)).read_bytes()
        while position < min(descriptor.stop_position, base + segment_length):
            at = position - base
            (length, _, flags, frame_type, term_offset, session, stream,
             term_id, _) = DATA_HEADER.unpack_from(data, at)
            assert term_offset == position % descriptor.term_length
            assert term_id == descriptor.initial_term_id + position // descriptor.term_length
            assert (session, stream) == (descriptor.session_id, descriptor.stream_id)
            position += align(length, FRAME_ALIGNMENT)
            if frame_type == HDR_TYPE_PAD:
                continue
            payload = data[at + HEADER_LENGTH:at + length]
            if flags & BEGIN_FLAG:
                assembling = bytearray()
            assert assembling is not None, f"a middle fragment at {position}"
            assembling += payload
            if flags & END_FLAG:
                out.append((bytes(assembling), position))
                assembling = None
    return out


def size_of(seq: int) -> int:
    """Sizes from 8 bytes to beyond the MTU: some messages are fragmented."""
    return 8 + (seq * 97) % 2600


def publish(publication, count: int, collectors: list[Collector] = (), first: int = 0,
            timeout: float = 60.0) -> list[int]:
    """Offer messages ``first ..`` while polling ``collectors``; the position after each."""
    positions = []
    deadline = time.monotonic() + timeout
    seq = first
    while seq < first + count:
        assert time.monotonic() < deadline, f"{seq - first} of {count} offered"
        result = publication.offer(message(seq, size_of(seq)))
        if result > 0:
            positions.append(result)
            seq += 1
        else:
            time.sleep(0)
        for collector in collectors:
            collector.poll()
    return positions


def publish_to_the_end(publication, receiver: Collector, archive_dir: Path,
                       count: int) -> tuple[list[int], RecordingDescriptor]:
    """Publish ``count`` messages while ``receiver`` polls, until it read them all (30 s at
    most), then close ``publication``: the positions after each message and the recording's
    descriptor once it ended."""
    positions = publish(publication, count, [receiver])
    wait_for(lambda: receiver.poll() >= 0 and len(receiver.seen) >= count, timeout=30,
             what="the receiver read everything")
    publication.close()
    return positions, wait_for_recording(archive_dir, ended=True)


def check_recording(descriptor: RecordingDescriptor, archive_dir: Path,
                    positions: list[int], first: int = 0,
                    sizes: Callable[[int], int] = size_of) -> None:
    """The recording holds exactly messages ``first ..`` (of ``sizes(seq)`` bytes) at their
    positions."""
    got = recorded_messages(descriptor, archive_dir)
    assert len(got) == len(positions), f"{len(got)} messages recorded of {len(positions)}"
    for i, ((data, position), expected) in enumerate(zip(got, positions, strict=True)):
        assert data == message(first + i, sizes(first + i)), f"message {i} differs"
        assert position == expected, f"message {i} ends at {position}, published to {expected}"


def test_an_ipc_stream_is_recorded_across_segments_and_terms_byte_for_byte(
        driver, tmp_path: Path) -> None:
    """An IPC stream recorded from its log: 12 segments of two terms, every message at the
    position the publisher got for it; the publisher's close ends the recording at end of
    stream, and verify finds every frame whole."""
    archive_dir = tmp_path / "archive"
    config = write_config(tmp_path / "archive.toml", archive_dir, driver.directory,
                          [("aeron:ipc", 10)])
    with Client.connect(driver.directory) as client, \
            archive_process(config, tmp_path / "archive.log") as archive:
        publication = client.add_publication("aeron:ipc", 10)
        wait_for_recording(archive_dir)
        positions = publish(publication, 2400)
        publication.close()
        descriptor = wait_for_recording(archive_dir, ended=True)
        assert archive.poll() is None
    assert descriptor.end_reason is EndReason.END_OF_STREAM
    assert (descriptor.start_position, descriptor.stop_position) == (0, positions[-1])
    assert positions[-1] > 12 * SEGMENT
    assert len(segment_files(archive_dir, 0)) == positions[-1] // SEGMENT + 1
    check_recording(descriptor, archive_dir, positions)
    report = verify(descriptor, archive_dir)
    assert report.ok, report.problems
    cli = subprocess.run([sys.executable, "-m", "slipstream.archive.cli", "verify", "0",
                          "--dir", str(archive_dir)], capture_output=True, text=True,
                         timeout=60)
    assert cli.returncode == 0 and "recording 0: ok" in cli.stdout, cli
    listing = subprocess.run([sys.executable, "-m", "slipstream.archive.cli", "list",
                              "--dir", str(archive_dir)], capture_output=True, text=True,
                             timeout=60)
    assert "end_of_stream" in listing.stdout and "aeron:ipc" in listing.stdout, listing


def test_a_local_udp_stream_is_recorded_through_a_spy(launch, tmp_path: Path) -> None:
    """A UDP publication of this host recorded from its own log through an aeron-spy:
    subscription, while a receiver reads it over the network: both get every message; the
    recording holds them at their positions across segments and term rotations."""
    driver = launch()
    channel = f"aeron:udp?endpoint=127.0.0.1:{free_port()}"
    archive_dir = tmp_path / "archive"
    config = write_config(tmp_path / "archive.toml", archive_dir, driver.directory,
                          [(channel, 20)])
    with Client.connect(driver.directory) as client, \
            archive_process(config, tmp_path / "archive.log"):
        publication = client.add_publication(channel, 20)
        receiver = Collector(client.add_subscription(channel, 20))
        wait_for(lambda: publication.is_connected, what="the receiver connected")
        descriptor = wait_for_recording(archive_dir)
        assert descriptor.source_identity  # the spy's image names its source
        positions, descriptor = publish_to_the_end(publication, receiver, archive_dir, 1500)
    receiver.assert_exactly(1500)
    assert descriptor.end_reason is EndReason.END_OF_STREAM
    assert descriptor.stop_position == positions[-1] > 8 * SEGMENT
    check_recording(descriptor, archive_dir, positions)


def test_killed_mid_recording_the_archive_recovers_to_its_last_whole_frame(
        driver, tmp_path: Path) -> None:
    """kill -9 of the archive while it records; at its next start it ends the recording at
    the last whole frame its segments hold (RECOVERED), and those frames are exactly the
    first messages published, at their positions; SIGTERM then stops it cleanly."""
    archive_dir = tmp_path / "archive"
    config = write_config(tmp_path / "archive.toml", archive_dir, driver.directory,
                          [("aeron:ipc", 30)])
    with Client.connect(driver.directory) as client:
        with archive_process(config, tmp_path / "archive.log") as archive:
            publication = client.add_publication("aeron:ipc", 30)
            wait_for_recording(archive_dir)
            positions = publish(publication, 600)
            # Still publishing while it dies: frames in flight.
            killed = threading.Event()

            def publish_on() -> None:
                seq = 600
                while not killed.is_set():
                    result = publication.offer(message(seq, size_of(seq)))
                    if result > 0:
                        positions.append(result)
                        seq += 1

            publisher = threading.Thread(target=publish_on)
            publisher.start()
            deadline = time.monotonic() + 30
            while sum(p.stat().st_size for _, p in segment_files(archive_dir, 0)) < 3 * SEGMENT:
                assert time.monotonic() < deadline
                time.sleep(0.001)
            os.kill(archive.pid, signal.SIGKILL)
            archive.wait(timeout=10)
            time.sleep(0.05)  # the publisher goes on a little past the kill
            killed.set()
            publisher.join(10)
        publication.close()
        assert recordings(archive_dir)[0].is_active  # it died with the recording open
        restart = write_config(tmp_path / "restart.toml", archive_dir, driver.directory, [])
        with archive_process(restart, tmp_path / "archive.log") as archive:
            descriptor = wait_for_recording(archive_dir, ended=True)
            archive.send_signal(signal.SIGTERM)
            assert archive.wait(timeout=20) == 0
    assert descriptor.end_reason is EndReason.RECOVERED
    # A whole frame ends at a message's end, or at a term's end: the padding that closes a
    # term its messages did not fill is a frame, and the recording may stop after it.
    frame_ends = set(positions) | {p - p % TERM for p in positions}
    assert descriptor.stop_position in frame_ends, "not at a frame boundary"
    recorded = [p for p in positions if p <= descriptor.stop_position]
    assert 3 * SEGMENT <= descriptor.stop_position < positions[-1]
    check_recording(descriptor, archive_dir, recorded)
    assert verify(descriptor, archive_dir).ok
    # The blocks the dead archive had reserved past the last segment's end are given back.
    last = segment_files(archive_dir, 0)[-1][1]
    assert os.stat(last).st_blocks * 512 <= align(last.stat().st_size, 4096)
    log = (tmp_path / "archive.log").read_text()
    assert "recovered, stopped at position" in log


def test_a_second_archive_on_the_same_directory_is_refused(driver, tmp_path: Path) -> None:
    archive_dir = tmp_path / "archive"
    config = write_config(tmp_path / "archive.toml", archive_dir, driver.directory, [])
    with archive_process(config, tmp_path / "one.log") as first:
        wait_for(lambda: (archive_dir / CATALOG_FILE).exists(), what="the first started")
        second = subprocess.run([sys.executable, "-m", "slipstream.archive.cli", "run",
                                 "--config", str(config)], capture_output=True, text=True,
                                timeout=60)
        assert second.returncode == 1
        assert "another archive process holds" in second.stderr
        purge = subprocess.run([sys.executable, "-m", "slipstream.archive.cli", "purge", "0",
                                "--dir", str(archive_dir)], capture_output=True, text=True,
                               timeout=60)
        assert purge.returncode == 1 and "another archive process holds" in purge.stderr
        assert first.poll() is None


def test_the_command_line_refuses_a_bad_setting_by_name(tmp_path: Path) -> None:
    config = tmp_path / "archive.toml"
    config.write_text('dir = "/tmp/x"\nsync = "sometimes"\n')
    run = subprocess.run([sys.executable, "-m", "slipstream.archive.cli", "run", "--config",
                          str(config)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2
    assert "archive setting 'sync'" in run.stderr and "sometimes" in run.stderr


def test_a_recordings_position_is_a_counter_while_it_records(driver, tmp_path: Path) -> None:
    """While a recording is active its recorded position is a RECORDING_POSITION counter in
    the driver's counters file, found by recording, session and stream id, and it reaches
    what the publisher published; it is freed when the recording ends."""
    archive_dir = tmp_path / "archive"
    config = write_config(tmp_path / "archive.toml", archive_dir, driver.directory,
                          [("aeron:ipc", 40)])
    counters = CountersFile(Path(driver.directory) / COUNTERS_FILE, writable=False)
    try:
        with Client.connect(driver.directory) as client, \
                archive_process(config, tmp_path / "archive.log"):
            publication = client.add_publication("aeron:ipc", 40)
            wait_for_recording(archive_dir)
            positions = publish(publication, 300)
            key = recording_position_key(0, publication.session_id, 40, archive_dir)
            wait_for(lambda: counters.find(CounterType.RECORDING_POSITION, key) is not None,
                     what="the recording's counter")
            info = counters.find(CounterType.RECORDING_POSITION, key)
            assert info is not None and info.label.startswith("rec-pos: 0 ")
            position = counters.reader(info.counter_id, info.registration_id)
            wait_for(lambda: position.get() == positions[-1], what="the recorded position")
            publication.close()
            wait_for(lambda: not position.is_allocated, what="the counter freed at the end")
            assert wait_for_recording(archive_dir, ended=True).stop_position == positions[-1]
    finally:
        counters.close()


@pytest.mark.parametrize("sync", ["none", "segment", "interval"])
def test_the_subscriber_position_never_passes_what_the_recording_made_durable(
        driver, tmp_path: Path, sync: str) -> None:
    """The archive's subscriber position (what holds the IPC publisher, read from the
    driver's counters file) never passes the recording's position counter, which under
    ``segment`` and ``interval`` moves only when the segment was synced (to a segment's end,
    or to all the archive had read when it caught up with the stream) and under ``none`` is
    what was written.  The service's passes are the test's, so every state between two
    passes is looked at; the stream crosses five segments with a publisher window (half a
    64 KiB term) smaller than a segment, which holding it to synced segments alone would
    deadlock."""
    settings = ArchiveSettings(
        dir=tmp_path / "archive", driver_dir=Path(driver.directory), segment_length=SEGMENT,
        sync=SyncPolicy(sync), sync_interval=50_000_000, block_length=4096,
        records=(RecordSpec("aeron:ipc", 50),))
    counters = CountersFile(Path(driver.directory) / COUNTERS_FILE, writable=False)
    service = ArchiveService(settings)
    try:
        with Client.connect(driver.directory) as client:
            publication = client.add_publication("aeron:ipc", 50)
            deadline = time.monotonic() + 20
            while not service.recordings:
                assert time.monotonic() < deadline, "no recording"
                service.do_work()
            recording = next(iter(service.recordings.values()))
            key = recording_position_key(recording.recording_id, publication.session_id, 50,
                                         settings.dir)
            recorded_info = counters.find(CounterType.RECORDING_POSITION, key)
            subscriber_info = next(i for i in counters if i.stream_id == 50 and
                                   i.type_id == CounterType.SUBSCRIBER_POSITION)
            assert recorded_info is not None
            recorded = counters.reader(recorded_info.counter_id, recorded_info.registration_id)
            subscriber = counters.reader(subscriber_info.counter_id,
                                         subscriber_info.registration_id)
            positions: list[int] = []
            ahead_of_durable = 0
            durable_moves: list[tuple[int, int]] = []  # (durable position, read position)
            seq = 0
            while seq < 700 or recording.reader.position < positions[-1]:
                assert time.monotonic() < deadline, f"{seq} offered, held at {subscriber.get()}"
                while seq < 700:  # fill the window the archive leaves the publisher
                    result = publication.offer(message(seq, 1000))
                    if result < 0:
                        break
                    positions.append(result)
                    seq += 1
                before = recorded.get()
                service.do_work()
                # The subscriber first, then the recording: it may only have moved further.
                at_subscriber, at_recorded = subscriber.get(), recorded.get()
                assert at_subscriber <= at_recorded == recording.recorded_position
                written = recording.writer.position
                if sync == "none":
                    assert at_subscriber == at_recorded == written
                elif written > at_recorded:
                    ahead_of_durable += 1
                if at_recorded != before:
                    durable_moves.append((at_recorded, recording.reader.position))
            # The segment being written has its blocks reserved ahead of the writes.
            writing = recording.writer.segment_path
            assert writing is not None and os.stat(writing).st_blocks * 512 >= SEGMENT
            if sync != "none":
                assert ahead_of_durable > 10, "never a written byte that was not yet durable"
                for durable, read in durable_moves:  # a segment's end, or all it had read
                    assert durable % SEGMENT == 0 or durable == read, (durable, read)
            publication.close()
            while recording.is_active:
                assert time.monotonic() < deadline, "no end of stream"
                service.do_work()
    finally:
        service.stop()
        counters.close()
    descriptor = recordings(settings.dir)[0]
    assert descriptor.stop_position == positions[-1] > 5 * SEGMENT
    assert len(segment_files(settings.dir, 0)) == positions[-1] // SEGMENT + 1
    check_recording(descriptor, settings.dir, positions, sizes=lambda seq: 1000)
    # What was reserved past the last segment's end was given back when it closed.
    last = segment_files(settings.dir, 0)[-1][1]
    assert os.stat(last).st_blocks * 512 <= align(last.stat().st_size, 4096) < SEGMENT


def test_each_recorded_stream_is_cut_to_its_own_retention_bound(driver,
                                                                tmp_path: Path) -> None:
    """Two IPC streams recorded with different [[record]] bounds, 2 and 4 segments, each
    published past 8: each is cut to its own bound in whole segments from its start, the
    other's bound and the (absent) total leaving it be."""
    archive_dir = tmp_path / "archive"
    bounds = {21: 2 * SEGMENT, 22: 4 * SEGMENT}
    config = write_config(tmp_path / "archive.toml", archive_dir, driver.directory,
                          [("aeron:ipc", stream_id, {"retention_max_bytes": f"{bound // 1024}k"})
                           for stream_id, bound in bounds.items()],
                          retention_check_interval="50ms")

    def segment_bytes(recording_id: int) -> int:
        total = 0
        for _, path in segment_files(archive_dir, recording_id):
            try:
                total += path.stat().st_size
            except FileNotFoundError:  # the retention removed it since it was listed
                pass
        return total

    with Client.connect(driver.directory) as client, \
            archive_process(config, tmp_path / "archive.log") as archive:
        stops = {}
        for index, stream_id in enumerate(bounds):
            publication = client.add_publication("aeron:ipc", stream_id)
            wait_for_recording(archive_dir, index)
            positions = publish(publication, 900)
            assert positions[-1] > 8 * SEGMENT  # the bound crossed by several segments
            publication.close()
            stops[stream_id] = positions[-1]
        for index, (stream_id, bound) in enumerate(bounds.items()):
            descriptor = wait_for_recording(archive_dir, index, ended=True)
            assert descriptor.stream_id == stream_id
            wait_for(lambda rid=descriptor.recording_id, b=bound: segment_bytes(rid) <= b,
                     timeout=20, what=f"stream {stream_id} cut to {bound} bytes")
        assert archive.poll() is None
        for index, (stream_id, bound) in enumerate(bounds.items()):
            descriptor = recordings(archive_dir)[index]
            kept = segment_files(archive_dir, descriptor.recording_id)
            assert descriptor.stop_position == stops[stream_id]
            # Whole segments from the start, no more than the bound asks: one more segment
            # would have been over it.
            assert descriptor.start_position == kept[0][0] > 0
            assert descriptor.start_position % SEGMENT == 0
            assert segment_bytes(descriptor.recording_id) + SEGMENT > bound
            assert len(kept) == (stops[stream_id] - descriptor.start_position - 1) // SEGMENT + 1


def test_a_recorded_streams_age_bound_removes_only_its_own_old_segments(
        driver, tmp_path: Path) -> None:
    """Stream 23 keeps 1 s, stream 24 has no bound: once both recordings stopped and a
    second passed, 23's segments are all gone (its start at its stop), 24's all kept."""
    archive_dir = tmp_path / "archive"
    config = write_config(tmp_path / "archive.toml", archive_dir, driver.directory,
                          [("aeron:ipc", 23, {"retention_max_age": "1s"}), ("aeron:ipc", 24)],
                          retention_check_interval="50ms")
    with Client.connect(driver.directory) as client, \
            archive_process(config, tmp_path / "archive.log"):
        for index, stream_id in enumerate((23, 24)):
            publication = client.add_publication("aeron:ipc", stream_id)
            wait_for_recording(archive_dir, index)
            assert publish(publication, 400)[-1] > 3 * SEGMENT
            publication.close()
            wait_for_recording(archive_dir, index, ended=True)
        aged, kept = recordings(archive_dir)
        wait_for(lambda: not segment_files(archive_dir, aged.recording_id), timeout=20,
                 what="stream 23's segments gone by age")
        aged, kept = recordings(archive_dir)
    assert aged.start_position == aged.stop_position
    assert kept.start_position == 0
    assert len(segment_files(archive_dir, kept.recording_id)) == \
        (kept.stop_position - 1) // SEGMENT + 1
