"""The archive on a full disk (a small tmpfs, mounted as root): the recording stops with a
clear error at its last whole frame, the archive keeps running, and the live stream is
unharmed: its publisher goes on at full rate to its other subscriber (docs/ARCHIVE.md)."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import Collector, lacking, message, wait_for
from test_archive import archive_process, recorded_messages, wait_for_recording, write_config

from slipstream.archive import EndReason
from slipstream.archive.recovery import verify
from slipstream.client import Client

SIZE = 1024  # 1 KiB messages


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs, unmounted afterwards."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        lacking("needs root and mount, for a small tmpfs")
    mount_point = tmp_path / "disk"
    mount_point.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount_point)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        lacking(f"mount -t tmpfs failed: {done.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


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
