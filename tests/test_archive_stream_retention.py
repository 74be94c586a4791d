"""Retention per recorded stream: each ``[[record]]`` table's ``retention_max_bytes`` and
``retention_max_age`` bound that stream's recordings together, within the archive's total
bounds (docs/ARCHIVE.md, "Retention").  On a catalog and segment files of the archive's own
format, without a service (test_archive.py crosses the bounds with a real archive)."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_archive_units import TERM, _recorded

from slipstream.archive import Catalog, segment_file_name
from slipstream.archive.retention import apply_retention
from slipstream.archive.settings import ArchiveSettingsError, RecordSpec, load_settings

SEGMENT = 2 * TERM  # test_archive_units._recorded's
S = 10**9  # ns in a second


def _kept(directory: Path, recording_id: int) -> list[int]:
    """The segment bases of ``recording_id`` still on disk, in order."""
    prefix = f"{recording_id}-"
    return sorted(int(p.stem[len(prefix):]) for p in directory.glob(f"{prefix}*.rec"))


def test_each_stream_is_cut_to_its_own_size_bound_and_no_further(tmp_path: Path) -> None:
    """Stream 21 (2 segments) and 22 (5 segments), each two stopped recordings of 3
    segments: 21 loses 4 segments and 22 one, the oldest by last write of each stream, from
    each recording's start; neither bound touches the other stream."""
    a = RecordSpec("aeron:ipc", 21, retention_max_bytes=2 * SEGMENT)
    b = RecordSpec("aeron:ipc", 22, retention_max_bytes=5 * SEGMENT)
    with Catalog.open(tmp_path) as catalog:
        a_old = _recorded(catalog, tmp_path, 3, stream_id=21, stopped=True, mtime_s=1_000)
        b_old = _recorded(catalog, tmp_path, 3, stream_id=22, stopped=True, mtime_s=900)
        a_new = _recorded(catalog, tmp_path, 3, stream_id=21, stopped=True, mtime_s=2_000)
        b_new = _recorded(catalog, tmp_path, 3, stream_id=22, stopped=True, mtime_s=2_100)
        removed = apply_retention(catalog, tmp_path, max_bytes=0, max_age_ns=0, live={},
                                  now_ns=3_000 * S, streams=[a, b])
        assert len(removed) == 5
        assert _kept(tmp_path, a_old) == [] and _kept(tmp_path, a_new) == [SEGMENT, 2 * SEGMENT]
        assert _kept(tmp_path, b_old) == [SEGMENT, 2 * SEGMENT]
        assert _kept(tmp_path, b_new) == [0, SEGMENT, 2 * SEGMENT]
        assert catalog.get(a_new).start_position == SEGMENT
        assert catalog.get(b_old).start_position == SEGMENT
        # At its bound now: a second pass removes nothing.
        assert apply_retention(catalog, tmp_path, max_bytes=0, max_age_ns=0, live={},
                               now_ns=3_000 * S, streams=[a, b]) == []


def test_a_streams_bound_never_takes_the_segment_a_live_recording_writes(
        tmp_path: Path) -> None:
    """Over its bound with only a live recording: its older segments go, stopped ones of the
    stream first; the one it writes stays though the stream stays over its bound."""
    spec = RecordSpec("aeron:ipc", 21, retention_max_bytes=SEGMENT)
    with Catalog.open(tmp_path) as catalog:
        live = _recorded(catalog, tmp_path, 4, stream_id=21, stopped=False, mtime_s=500)
        stopped = _recorded(catalog, tmp_path, 2, stream_id=21, stopped=True, mtime_s=1_000)
        removed = apply_retention(catalog, tmp_path, max_bytes=0, max_age_ns=0,
                                  live={live: 3 * SEGMENT}, now_ns=2_000 * S, streams=[spec])
        names = [p.name for p in removed]
        assert names[:2] == [segment_file_name(stopped, 0), segment_file_name(stopped, SEGMENT)]
        assert _kept(tmp_path, live) == [3 * SEGMENT]
        assert catalog.get(live).start_position == 3 * SEGMENT


def test_a_streams_age_bound_applies_to_its_recordings_and_the_shorter_bound_wins(
        tmp_path: Path) -> None:
    """Stream 21 keeps 100 s, stream 22 has no age bound of its own, the archive keeps
    1000 s: 21's segments older than 100 s go, 22's only those older than 1000 s."""
    short = RecordSpec("aeron:ipc", 21, retention_max_age_ns=100 * S)
    plain = RecordSpec("aeron:ipc", 22)
    with Catalog.open(tmp_path) as catalog:
        a = _recorded(catalog, tmp_path, 4, stream_id=21, stopped=True, mtime_s=1_000)
        b = _recorded(catalog, tmp_path, 4, stream_id=22, stopped=True, mtime_s=1_000)
        # now 1_102.5: segments written at 1000, 1001, 1002 are over 100 s old; none over 1000.
        apply_retention(catalog, tmp_path, max_bytes=0, max_age_ns=1_000 * S, live={},
                        now_ns=1_102_500_000_000, streams=[short, plain])
        assert _kept(tmp_path, a) == [3 * SEGMENT]
        assert _kept(tmp_path, b) == [0, SEGMENT, 2 * SEGMENT, 3 * SEGMENT]
        # The archive's bound, shorter than a stream's, holds for that stream too.
        long = RecordSpec("aeron:ipc", 22, retention_max_age_ns=10_000 * S)
        apply_retention(catalog, tmp_path, max_bytes=0, max_age_ns=1_000 * S, live={},
                        now_ns=2_001_500_000_000, streams=[short, long])
        assert _kept(tmp_path, b) == [2 * SEGMENT, 3 * SEGMENT]


def test_the_archives_total_bound_still_holds_over_streams_within_their_own(
        tmp_path: Path) -> None:
    """Each stream within its own bound, the archive over its total: the oldest segments
    of any stream go, as without stream bounds; a recording of a stream no [[record]]
    table names is under the total bound only."""
    a = RecordSpec("aeron:ipc", 21, retention_max_bytes=10 * SEGMENT)
    b = RecordSpec("aeron:ipc", 22, retention_max_bytes=10 * SEGMENT)
    with Catalog.open(tmp_path) as catalog:
        first = _recorded(catalog, tmp_path, 3, stream_id=21, stopped=True, mtime_s=1_000)
        second = _recorded(catalog, tmp_path, 3, stream_id=22, stopped=True, mtime_s=2_000)
        other = _recorded(catalog, tmp_path, 3, stream_id=23, stopped=True, mtime_s=500)
        apply_retention(catalog, tmp_path, max_bytes=5 * SEGMENT, max_age_ns=0, live={},
                        now_ns=3_000 * S, streams=[a, b])
        # 9 segments to 5: other's three (the oldest), then first's first.
        assert _kept(tmp_path, other) == []
        assert _kept(tmp_path, first) == [SEGMENT, 2 * SEGMENT]
        assert _kept(tmp_path, second) == [0, SEGMENT, 2 * SEGMENT]


def test_two_tables_of_one_stream_id_bound_their_own_channels_recordings(
        tmp_path: Path) -> None:
    one = RecordSpec("aeron:udp?endpoint=10.0.0.1:40001", 21, retention_max_bytes=SEGMENT)
    two = RecordSpec("aeron:udp?endpoint=10.0.0.1:40002", 21)
    with Catalog.open(tmp_path) as catalog:
        bound = _recorded(catalog, tmp_path, 3, stream_id=21, stopped=True, mtime_s=1_000,
                          channel=one.channel)
        free = _recorded(catalog, tmp_path, 3, stream_id=21, stopped=True, mtime_s=500,
                         channel=two.channel)
        apply_retention(catalog, tmp_path, max_bytes=0, max_age_ns=0, live={},
                        now_ns=3_000 * S, streams=[one, two])
        assert _kept(tmp_path, bound) == [2 * SEGMENT]
        assert _kept(tmp_path, free) == [0, SEGMENT, 2 * SEGMENT]


def test_record_tables_take_retention_keys(tmp_path: Path) -> None:
    path = tmp_path / "archive.toml"
    path.write_text('retention_max_bytes = "10g"\n'
                    '[[record]]\nchannel = "aeron:ipc"\nstream_id = 1\n'
                    'retention_max_bytes = "2g"\nretention_max_age = "168h"\n'
                    '[[record]]\nchannel = "aeron:ipc"\nstream_id = 2\n')
    settings = load_settings(path)
    assert settings.retention_max_bytes == 10 * 2**30
    first, second = settings.records
    assert (first.retention_max_bytes, first.retention_max_age_ns) == (2 * 2**30,
                                                                        7 * 86_400 * S)
    assert (second.retention_max_bytes, second.retention_max_age_ns) == (0, 0)


@pytest.mark.parametrize(("text", "key"), [
    ('retention_max_bytes = "lots"', "record.retention_max_bytes"),
    ("retention_max_bytes = -1", "record.retention_max_bytes"),
    ('retention_max_age = "a week"', "record.retention_max_age"),
    ("retention_max_ages = 5", "record.retention_max_ages"),
])
def test_a_bad_record_retention_key_is_refused_by_name(tmp_path: Path, text: str,
                                                         key: str) -> None:
    path = tmp_path / "archive.toml"
    path.write_text(f'[[record]]\nchannel = "aeron:ipc"\nstream_id = 1\n{text}\n')
    with pytest.raises(ArchiveSettingsError) as raised:
        load_settings(path)
    assert raised.value.key == key
    assert "record #1" in str(raised.value)


def test_a_recording_active_elsewhere_neither_is_cut_nor_cuts_its_streams_others(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Stream 21, bound at 3 segments: a recording active in the catalog but not this
    service's (4 segments, which retention may not touch) and a stopped one of 3.  The stopped
    one is at the bound on its own, so it keeps every segment (counting the other's 4 would
    take all 3 for nothing); the other keeps its 4, and the log says once that it is outside
    the bound."""
    spec = RecordSpec("aeron:ipc", 21, retention_max_bytes=3 * SEGMENT)
    with Catalog.open(tmp_path) as catalog:
        elsewhere = _recorded(catalog, tmp_path, 4, stream_id=21, stopped=False, mtime_s=500)
        stopped = _recorded(catalog, tmp_path, 3, stream_id=21, stopped=True, mtime_s=1_000)
        with caplog.at_level("WARNING", logger="slipstream.archive"):
            for _ in range(2):
                assert apply_retention(catalog, tmp_path, max_bytes=0, max_age_ns=0, live={},
                                       now_ns=2_000 * S, streams=[spec]) == []
        assert _kept(tmp_path, stopped) == [0, SEGMENT, 2 * SEGMENT]
        assert _kept(tmp_path, elsewhere) == [0, SEGMENT, 2 * SEGMENT, 3 * SEGMENT]
        told = [r.getMessage() for r in caplog.records if "outside" in r.getMessage()]
        assert len(told) == 1 and f"recording {elsewhere} " in told[0], told
        # Over the bound by its own segments: cut to it, as any stream.
        _recorded(catalog, tmp_path, 1, stream_id=21, stopped=True, mtime_s=1_500)
        removed = apply_retention(catalog, tmp_path, max_bytes=0, max_age_ns=0, live={},
                                  now_ns=2_000 * S, streams=[spec])
        assert [p.name for p in removed] == [segment_file_name(stopped, 0)]
