"""Replay from the archive against real driver processes and real segment files: a stopped
recording replayed whole, in part and from a time, across segments and term boundaries, at
the recorded positions; a live recording followed and stopped; a range not held refused by
name; the local reader, the same as a replay and never past the recorded position
(docs/ARCHIVE.md, "Replay")."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers import free_port, message, wait_for
from test_archive import (
    SEGMENT,
    TERM,
    archive_process,
    publish,
    size_of,
    wait_for_recording,
    write_config,
)

from slipstream.archive import EndReason, segment_files
from slipstream.archive.client import ArchiveClient
from slipstream.archive.reading import RecordingLostError, RecordingReader
from slipstream.client import Client
from slipstream.client.control import COUNTERS_FILE
from slipstream.client.counters import CountersFile, CounterType
from slipstream.archive.service import recording_position_key

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


def test_a_stopped_recording_is_replayed_whole_in_part_and_from_a_time(
        driver, tmp_path: Path) -> None:
    """An IPC stream of mixed sizes (fragmented ones too) recorded over 8+ segments of two
    terms; replayed whole, then a middle range from a message inside one segment to one in a
    later segment, then from a time taken between two bursts: the payloads and positions are
    the published ones, from the exact message."""
    archive_dir = tmp_path / "archive"
    port, process = start_archive(tmp_path, driver.directory, [("aeron:ipc", 10)])
    with Client.connect(driver.directory) as client, process:
        publication = client.add_publication("aeron:ipc", 10)
        wait_for_recording(archive_dir)
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
