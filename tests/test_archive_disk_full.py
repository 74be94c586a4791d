"""The archive on a full disk (a small tmpfs, mounted as root): the recording stops with a
clear error at its last whole frame, the archive keeps running, and the live stream is
unharmed: its publisher goes on at full rate to its other subscriber (docs/ARCHIVE.md)."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import Collector, lacking, message, small_tmpfs, wait_for
from test_archive import (
    archive_process,
    publish,
    recorded_messages,
    wait_for_recording,
    write_config,
)
from test_archive_replication import CONTROL_STREAM, peered_archives

from slipstream.archive import ArchiveClient, EndReason
from slipstream.archive.catalog import Catalog
from slipstream.archive.recorder import SegmentWriter
from slipstream.archive.recovery import verify
from slipstream.archive.settings import SyncPolicy
from slipstream.client import Client

SIZE = 1024  # 1 KiB messages


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs, unmounted afterwards."""
    with small_tmpfs(tmp_path / "disk", 2**20) as mount_point:
        yield mount_point


class FailingWriteBack:
    """An ext4 file system (no journal) on a loop device whose backing file lies on a small
    tmpfs: :meth:`fail_unwritten` punches out of the backing file the blocks a file has
    reserved but not yet written, then fills the tmpfs, so that the disk's write-back of
    those blocks fails (ENOSPC from the loop device) while the file system's own blocks,
    already written, stay writable.  A real write-back error on a real file: the kernel
    reports it once (fdatasync or sync_file_range) and clears it, so the next fdatasync of
    the same file succeeds."""

    def __init__(self, tmp_path: Path) -> None:
        for tool in ("mount", "losetup", "mkfs.ext4", "filefrag", "fallocate"):
            if os.geteuid() != 0 or shutil.which(tool) is None:
                lacking(f"needs root and {tool}, for a disk whose write-back fails")
        self.backing = tmp_path / "backing"
        self.mount_point = tmp_path / "disk"
        self.backing.mkdir()
        self.mount_point.mkdir()
        self.loop: str | None = None
        self._run("mount", "-t", "tmpfs", "-o", "size=40m", "tmpfs", str(self.backing))
        image = self.backing / "image"
        image.write_bytes(bytes(32 << 20))  # every block there: only punched ones fail
        self._run("mkfs.ext4", "-q", "-F", "-b", "4096", "-O", "^has_journal", "-E", "nodiscard",
                  str(image))
        self.loop = self._run("losetup", "-f", "--show", str(image)).strip()
        self._run("mount", "-o", "errors=continue", self.loop, str(self.mount_point))

    def _run(self, *command: str) -> str:
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            lacking(f"{' '.join(command)} failed: {done.stderr.strip()}")
        return done.stdout

    def fail_unwritten(self, path: Path) -> int:
        """Make the write-back of ``path``'s reserved, unwritten blocks fail; returns how
        many blocks."""
        listed = subprocess.run(["filefrag", "-v", "-b4096", str(path)], check=True,
                                capture_output=True, text=True).stdout
        blocks = 0
        for extent in re.finditer(r"\d+\.\.\s*\d+:\s+(\d+)\.\.\s*(\d+):.*unwritten",
                                  listed):
            first, last = int(extent.group(1)), int(extent.group(2))
            subprocess.run(["fallocate", "-p", "-o", str(first * 4096), "-l",
                            str((last - first + 1) * 4096), str(self.backing / "image")],
                           check=True)
            blocks += last - first + 1
        subprocess.run(["dd", "if=/dev/zero", f"of={self.backing / 'filler'}", "bs=64k"],
                       capture_output=True, check=False)  # ends at ENOSPC
        return blocks

    def close(self) -> None:
        subprocess.run(["umount", str(self.mount_point)], check=False)
        if self.loop is not None:
            subprocess.run(["losetup", "-d", self.loop], check=False)
        subprocess.run(["umount", "-l", str(self.backing)], check=False)


@pytest.fixture
def failing_write_back(tmp_path: Path) -> Iterator[FailingWriteBack]:
    """A :class:`FailingWriteBack` in ``tmp_path``, its mounts undone after the test."""
    with contextlib.closing(FailingWriteBack(tmp_path)) as disk:
        yield disk


@pytest.mark.parametrize("sync, write_behind", [(SyncPolicy.SEGMENT, 0),
                                                (SyncPolicy.INTERVAL, 64 * 1024),
                                                (SyncPolicy.NONE, 64 * 1024)])
def test_a_write_back_error_cuts_the_recording_back_to_what_the_disk_confirmed(
        failing_write_back: FailingWriteBack, sync: SyncPolicy, write_behind: int) -> None:
    """The disk fails to write back a recording's bytes (reported once by fdatasync or by
    write-behind's waiting sync_file_range, then cleared by the kernel): the writer claims
    nothing past the last position the disk confirmed, although a sync after the error
    succeeds, and the segment is cut back to it."""
    directory = failing_write_back.mount_point
    with Catalog.open(directory) as catalog:
        descriptor = catalog.add(
            start_position=0, start_time_ms=1_700_000_000_000, initial_term_id=7,
            term_length=1 << 20, segment_length=16 << 20, mtu=1408, session_id=1,
            stream_id=40, channel="aeron:ipc", source_identity="aeron:ipc")
    writer = SegmentWriter(directory, descriptor, sync, 0, write_behind=write_behind)
    block = memoryview(bytes(range(256)) * 256)  # 64 KiB
    position = 0
    for _ in range(8):  # under write-behind: more chunks than its depth, all waited for
        writer.write(block, position)
        position += len(block)
    if sync is not SyncPolicy.NONE:
        assert writer.make_durable()
    confirmed = position if sync is not SyncPolicy.NONE else writer.durable_position
    segment = writer.segment_path
    assert segment is not None
    assert failing_write_back.fail_unwritten(segment) > 0
    with pytest.raises(OSError):
        for _ in range(64):  # 4 MiB more: the write-behind's wait, or the sync, fails
            writer.write(block, position)
            position += len(block)
        writer.make_durable()
    assert writer.writeback_failed
    writer.salvage()
    writer.abandon()
    if sync is SyncPolicy.NONE:
        # What write-behind saw written before the failure, no more.
        assert writer.durable_position <= confirmed
    else:
        assert writer.durable_position == confirmed
    assert writer.position == writer.durable_position
    assert segment.stat().st_size == writer.position
    assert segment.read_bytes() == bytes(block) * (writer.position // len(block))


def stream_to(publication, collector: Collector, first: int, count: int) -> float:
    """Messages ``first ..`` offered and read by ``collector``; the seconds it took."""
    started = time.monotonic()
    seq = first
    deadline = started + 60
    while len(collector.seen) < first + count:
        assert time.monotonic() < deadline, f"{len(collector.seen)} read of {first + count}"
        while seq < first + count and publication.offer(message(seq, SIZE)) > 0:
            seq += 1
        if not collector.poll():
            time.sleep(0)
    return time.monotonic() - started


def test_a_full_disk_stops_the_recording_not_the_stream(driver, small_disk: Path,
                                                        tmp_path: Path) -> None:
    archive_dir = small_disk / "archive"
    config = write_config(tmp_path / "archive.toml", archive_dir, driver.directory,
                          [("aeron:ipc", 40)])
    with Client.connect(driver.directory) as client, \
            archive_process(config, tmp_path / "archive.log") as archive:
        publication = client.add_publication("aeron:ipc", 40)
        reader = Collector(client.add_subscription("aeron:ipc", 40))
        wait_for(lambda: reader.subscription.images, what="the reader's image")
        descriptor = wait_for_recording(archive_dir)
        # 4 MiB through a 1 MiB disk: the recording fails on the way.
        stream_to(publication, reader, 0, 4096)
        descriptor = wait_for_recording(archive_dir, ended=True)
        assert archive.poll() is None, "the archive went down with its disk"
        # The archive's subscription is closed: it no longer holds the publisher.  The same
        # amount again, as fast as the publisher and its reader go, and then with the archive
        # recording nothing, for comparison.
        after = stream_to(publication, reader, 4096, 4096)
        archive.terminate()
        assert archive.wait(timeout=20) == 0
        alone = stream_to(publication, reader, 8192, 4096)
    reader.assert_exactly(3 * 4096)
    log = (tmp_path / "archive.log").read_text()
    assert "a write failed" in log and "the disk is full" in log, log
    assert descriptor.end_reason is EndReason.WRITE_FAILED
    assert 0 < descriptor.stop_position < 4096 * (SIZE + 32)
    got = recorded_messages(descriptor, archive_dir)
    assert [data for data, _ in got] == [message(i, SIZE) for i in range(len(got))]
    assert got[-1][1] == descriptor.stop_position  # the last whole frame, nothing torn
    assert verify(descriptor, archive_dir).ok
    # Full rate: within a factor of the publisher alone (2 shared cores: lenient).
    assert after < 3 * alone + 0.5, f"{after:.3f} s after the failure, {alone:.3f} s alone"


def test_a_full_disk_ends_a_fetch_not_the_archive_and_its_recordings(
        driver, small_disk: Path, tmp_path: Path) -> None:
    """B (its directory on a 1 MiB tmpfs) records a live session and would fetch from A a
    session it missed, but its disk is full when it looks: the replica's descriptor cannot
    be added to the catalog (the fourth crosses into a page the tmpfs has no room for).  The
    fetch ends with the error logged, B keeps running and its live recording records on
    (into its segment's reserved blocks)."""
    _, port_b, config_a, config_b = peered_archives(tmp_path, driver.directory,
                                                    small_disk / "b")
    # B's first look at A comes after its disk is full.
    config_b.write_text(config_b.read_text().replace('replication_interval = "300ms"',
                                                     'replication_interval = "4s"'))
    with Client.connect(driver.directory) as client, \
            archive_process(config_a, tmp_path / "a.log"):
        missed = client.add_exclusive_publication("aeron:ipc", 20)
        wait_for_recording(tmp_path / "a")
        publish(missed, 50)
        missed.close()
        wait_for_recording(tmp_path / "a", ended=True)
        with archive_process(config_b, tmp_path / "b.log") as process_b:
            for index in range(2):  # B's descriptors 0 and 1: ended sessions
                ended = client.add_exclusive_publication("aeron:ipc", 20)
                wait_for_recording(small_disk / "b", index=index)
                publish(ended, 10)
                ended.close()
                wait_for_recording(small_disk / "b", index=index, ended=True)
            live = client.add_exclusive_publication("aeron:ipc", 20)
            wait_for_recording(small_disk / "b", index=2)  # descriptor 2, live
            log_path = tmp_path / "b.log"
            with ArchiveClient(client, "127.0.0.1", port_b, CONTROL_STREAM,
                               timeout_s=5) as archive_b:
                def recorded() -> int:
                    listed = archive_b.list_recordings(stream_id=20)
                    return next(r.recorded_position for r in listed
                                if r.descriptor.session_id == live.session_id)

                # Its segment is opened, and its blocks reserved, by its first write: the
                # disk fills only once that is done.
                positions = publish(live, 10)
                wait_for(lambda: recorded() == positions[-1], timeout=30,
                         what="B recording the first messages")
                with open(small_disk / "filler", "wb", buffering=0) as filler:
                    try:
                        while True:
                            filler.write(bytes(4096))
                    except OSError:
                        pass  # the disk is full
                wait_for(lambda: "its replica could not be made here" in log_path.read_text(),
                         timeout=20, what="B's fetch ended by its full disk")
                assert process_b.poll() is None, log_path.read_text()
                before = recorded()
                positions = publish(live, 10, first=10)
                wait_for(lambda: recorded() == positions[-1], timeout=30, what="B recording on")
                assert before < positions[-1]
                listed = archive_b.list_recordings(stream_id=20)
            assert process_b.poll() is None, log_path.read_text()
    assert len(listed) == 3  # no replica half made
