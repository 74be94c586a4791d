"""A read in place on the archive's host finds its recording through the catalog, read once,
against a real driver and a real ``slipstream-archive`` process (docs/ARCHIVE.md, "Reading
a session across recordings").

The archive holds hundreds of recordings; the session read is the last one, still live.
:func:`~slipstream.archive.locate.read_session` given only the archive directory reads it
whole from its segment files: the catalog opened once (no probe per recording id), no
counters file (a live recording is read up to where its time index says it is recorded),
no archive link.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from helpers import message, wait_for
from test_archive import TERM, archive_process, publish, recordings, size_of, write_config

from slipstream.archive.catalog import CATALOG_FILE
from slipstream.archive.locate import read_session
from slipstream.archive.reading import indexed_position
from slipstream.client import Client
from slipstream.client.control import COUNTERS_FILE

pytestmark = pytest.mark.timeout(240)

STREAM = 30
SESSIONS = 300  # recordings before the one read


def test_an_in_place_read_finds_a_live_recording_among_hundreds_in_one_catalog_read(
        driver, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Hundreds of sessions recorded, then a live one across several terms: its range read
    in place is every message at its recorded positions, with one open of the catalog, none
    of the counters file, and only the read recording's segment files opened."""
    archive_dir = tmp_path / "archive"
    config = write_config(tmp_path / "archive.toml", archive_dir, driver.directory,
                          [("aeron:ipc", STREAM)])
    with archive_process(config, tmp_path / "archive.log"), \
            Client.connect(driver.directory) as client:
        wait_for(lambda: (archive_dir / CATALOG_FILE).exists(), timeout=20,
                 what="the archive's catalog")
        for first in range(SESSIONS):
            other = client.add_exclusive_publication("aeron:ipc", STREAM)
            wait_for(lambda p=other: p.is_connected, timeout=10, what="the archive's image")
            publish(other, 1, first=first)
            wait_for(lambda n=first: len(recordings(archive_dir)) > n, timeout=10,
                     what=f"recording {first}")
            other.close()
        publication = client.add_exclusive_publication("aeron:ipc", STREAM)
        wait_for(lambda: publication.is_connected, timeout=10, what="the archive's image")
        positions = publish(publication, 3 * TERM // 800, first=SESSIONS)
        end = positions[-1]
        wait_for(lambda: len(recordings(archive_dir)) == SESSIONS + 1, timeout=10,
                 what="the last recording")
        descriptor = recordings(archive_dir)[-1]
        assert descriptor.is_active and descriptor.session_id == publication.session_id
        wait_for(lambda: indexed_position(archive_dir, descriptor) >= end, timeout=10,
                 what="the time index past the last message")

        opened: list[str] = []
        real_open = os.open

        def counting_open(path, *args, **kwargs):  # the real open, each one noted
            opened.append(os.fspath(path))
            return real_open(path, *args, **kwargs)

        monkeypatch.setattr(os, "open", counting_open)
        got = []
        for chunk in read_session([], STREAM, publication.session_id,
                                  (publication.initial_term_id, publication.term_length),
                                  0, end, directory=archive_dir):
            got += [(bytes(chunk.data[chunk.offsets[i]:chunk.offsets[i + 1]]),
                     chunk.positions[i]) for i in range(len(chunk))]
        monkeypatch.undo()
        publication.close()
    assert got == [(message(SESSIONS + i, size_of(SESSIONS + i)), p)
                   for i, p in enumerate(positions)]
    assert end > 2 * TERM  # across term ends, into a second segment
    assert sum(Path(path).name == CATALOG_FILE for path in opened) == 1, opened
    assert not any(Path(path).name == COUNTERS_FILE for path in opened), opened
    segments = [Path(path).name for path in opened if path.endswith(".rec")]
    assert segments and all(name.startswith(f"{descriptor.recording_id}-")
                            for name in segments), segments
