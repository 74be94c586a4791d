"""The archive's parts without a driver: the checked scan of a recorded segment (recovery's),
the catalog's file, the settings, retention and purge (docs/ARCHIVE.md)."""

from __future__ import annotations

import mmap
import os
import tomllib
from pathlib import Path

import cffi
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slipstream.archive import (
    ArchiveSettings,
    ArchiveSettingsError,
    Catalog,
    CatalogError,
    EndReason,
    RecordingState,
    load_settings,
    scan_segment,
    segment_base,
    segment_file_name,
)
from slipstream.archive.catalog import CATALOG_FILE, DESCRIPTOR_LENGTH, HEADER_LENGTH
from slipstream.archive.recorder import SegmentWriter
from slipstream.archive.recovery import recover, verify
from slipstream.archive.retention import apply_retention, purge
from slipstream.archive.segments import (
    SCAN_END,
    SCAN_INVALID,
    SCAN_TORN,
    WRITE_BEHIND_DEPTH,
    WriteBehind,
)
from slipstream.archive.settings import (
    SETTINGS,
    SyncPolicy,
    format_settings,
    render_default_config,
)
from slipstream.client.layout import (
    DATA_HEADER,
    FRAME_ALIGNMENT,
    HDR_TYPE_DATA,
    HDR_TYPE_PAD,
    UNFRAGMENTED,
    align,
)
from slipstream.client.layout import (
    HEADER_LENGTH as FRAME_HEADER_LENGTH,
)

TERM = 64 * 1024
# Every byte of each identifying field is non-zero, so zeros over any of them change it.
SESSION, STREAM, INITIAL_TERM_ID = 0x1A2B3C4D, 0x21324354, 0x11223344
ROOT = Path(__file__).resolve().parent.parent

_mincore_ffi = cffi.FFI()
_mincore_ffi.cdef("int mincore(void *addr, size_t length, unsigned char *vec);")
_libc = _mincore_ffi.dlopen(None)


def recorded_frames(base: int, payload_lengths: list[int]) -> tuple[bytearray, list[int]]:
    """A segment as the archive writes it from ``base`` (a term boundary): DATA frames of
    these payload lengths back to back, a padding frame where one would cross its term's end;
    and the aligned end offset of every frame (padding included)."""
    data = bytearray()
    ends = []
    for payload in payload_lengths:
        length = FRAME_HEADER_LENGTH + payload
        offset = len(data)
        term_offset = (base + offset) % TERM
        if term_offset + align(length, FRAME_ALIGNMENT) > TERM:
            pad = TERM - term_offset
            data += _header(base, offset, pad, HDR_TYPE_PAD).ljust(pad, b"\0")
            ends.append(len(data))
            offset = len(data)
        body = bytes((offset + i) % 251 + 1 for i in range(payload))  # never zero
        data += (_header(base, offset, length, HDR_TYPE_DATA) + body).ljust(
            align(length, FRAME_ALIGNMENT), b"\xee")
        ends.append(len(data))
    return data, ends


def _header(base: int, offset: int, length: int, frame_type: int) -> bytes:
    position = base + offset
    return DATA_HEADER.pack(length, 0, UNFRAGMENTED, frame_type, position % TERM, SESSION,
                            STREAM, INITIAL_TERM_ID + position // TERM, 0x0102030405060708)


def _scan(path: Path, base: int, from_offset: int = 0):
    return scan_segment(path, from_offset, base, term_length=TERM,
                        initial_term_id=INITIAL_TERM_ID, session_id=SESSION, stream_id=STREAM)


frames_strategy = st.lists(st.integers(0, 3000), min_size=1, max_size=120)


@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lengths=frames_strategy, base_terms=st.integers(0, 5), cut=st.floats(0, 1))
def test_a_segment_cut_anywhere_scans_to_exactly_its_last_whole_frame(
        tmp_path: Path, lengths: list[int], base_terms: int, cut: float) -> None:
    """A write cut by a kill leaves the file ending inside a frame: the scan stops at the end
    of the last frame wholly in the file, never past it."""
    base = base_terms * 2 * TERM
    data, ends = recorded_frames(base, lengths)
    at = int(cut * len(data))
    path = tmp_path / "0-0.rec"
    path.write_bytes(data[:at])
    result = _scan(path, base)
    expected = max([end for end in ends if end <= at], default=0)
    assert result.end == expected
    assert result.frames == sum(1 for end in ends if end <= at)
    assert result.reason == (SCAN_END if at == expected else SCAN_TORN)


@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lengths=frames_strategy, cut=st.floats(0, 1), zeros=st.booleans(),
       mask=st.integers(1, 255))
def test_what_follows_a_cut_is_never_taken_for_a_frame(
        tmp_path: Path, lengths: list[int], cut: float, zeros: bool, mask: int) -> None:
    """The bytes from a cut on replaced by zeros (a preallocated or sparse file) or by other
    bytes (garbage): the scan never passes the frame the cut is in, and stops exactly at its
    start when the cut falls on a frame's start or in the fields that name its place (term
    offset, session, stream, term id).  Past those, only a checksum could tell a body that
    was replaced (docs/ARCHIVE.md, "Recovery")."""
    data, ends = recorded_frames(0, lengths)
    at = int(cut * len(data))
    tail = bytes(len(data) - at) if zeros else bytes(b ^ mask for b in data[at:])
    path = tmp_path / "0-0.rec"
    path.write_bytes(data[:at] + tail)
    result = _scan(path, 0)
    starts = [0, *ends[:-1]]
    containing = next((i for i, end in enumerate(ends) if end > at), None)
    if containing is None:  # the cut is at the end: nothing was replaced
        assert result.end == len(data)
        return
    start, end = starts[containing], ends[containing]
    assert result.end <= end
    if at - start < DATA_HEADER.size - 8:  # before the reserved value: a field changed
        assert result.end == start
        assert result.reason in (SCAN_END, SCAN_INVALID)


def test_the_scan_stops_at_a_frame_of_another_place(tmp_path: Path) -> None:
    """A frame of another session, or one whose term id is not its position's, is no frame
    of this recording."""
    data, ends = recorded_frames(0, [100, 200, 300])
    bad = bytearray(data)
    DATA_HEADER.pack_into(bad, ends[0], *(DATA_HEADER.unpack_from(data, ends[0])[:5]),
                          SESSION + 1, STREAM, INITIAL_TERM_ID, 0)
    path = tmp_path / "0-0.rec"
    path.write_bytes(bad)
    result = _scan(path, 0)
    assert (result.end, result.reason, result.frames) == (ends[0], SCAN_INVALID, 1)
    path.write_bytes(data)
    assert _scan(path, TERM).reason == SCAN_INVALID  # the term ids are term 0's
    assert _scan(path, 0, ends[1]).end == ends[2]


def test_segments_follow_each_other_from_the_first_terms_start() -> None:
    """Aeron's segmentFileBasePosition: the grid starts at the start position's term."""
    segment = 4 * TERM
    start = 3 * TERM + 4096
    assert segment_base(start, start, TERM, segment) == 3 * TERM
    assert segment_base(start, 7 * TERM - 32, TERM, segment) == 3 * TERM
    assert segment_base(start, 7 * TERM, TERM, segment) == 7 * TERM
    assert segment_file_name(5, 7 * TERM) == f"5-{7 * TERM}.rec"


# -- the catalog ---------------------------------------------------------------------------


def _add(catalog: Catalog, start: int = 0, segment_length: int = 2 * TERM,
         channel: str = "aeron:ipc", stream_id: int = STREAM):
    return catalog.add(start_position=start, start_time_ms=1_700_000_000_000,
                       initial_term_id=INITIAL_TERM_ID, term_length=TERM,
                       segment_length=segment_length, mtu=1408, session_id=SESSION,
                       stream_id=stream_id, channel=channel, source_identity="aeron:ipc")


def test_the_catalog_keeps_descriptors_in_place_and_cuts_a_torn_append(tmp_path: Path) -> None:
    with Catalog.open(tmp_path) as catalog:
        first = _add(catalog)
        second = _add(catalog, channel="aeron:udp?endpoint=127.0.0.1:40123")
        catalog.update(first.evolve(stop_position=4096, stop_time_ms=1_700_000_000_500,
                                    end_reason=EndReason.END_OF_STREAM))
    path = tmp_path / CATALOG_FILE
    assert path.stat().st_size == HEADER_LENGTH + 2 * DESCRIPTOR_LENGTH
    with open(path, "ab") as file:  # an append a crash cut
        file.write(b"\x02\0\0\0\0\0\0\0\x01" + bytes(100))
    with Catalog.open(tmp_path) as catalog:
        assert [d.recording_id for d in catalog.recordings()] == [0, 1]
        assert catalog.get(0).stop_position == 4096
        assert catalog.get(0).end_reason is EndReason.END_OF_STREAM
        assert catalog.get(1) == second and second.is_active
        assert _add(catalog).recording_id == 2
    assert path.stat().st_size == HEADER_LENGTH + 3 * DESCRIPTOR_LENGTH


def test_a_file_that_is_not_a_catalog_is_refused(tmp_path: Path) -> None:
    (tmp_path / CATALOG_FILE).write_bytes(b"hello, this is not a catalog" + bytes(100))
    with pytest.raises(CatalogError, match="not a slipstream archive catalog"):
        Catalog.open(tmp_path)
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    with Catalog.open(fresh) as catalog, pytest.raises(CatalogError, match="descriptor holds"):
        _add(catalog, channel="aeron:udp?x=" + "y" * 2000)


# -- recovery of active recordings --------------------------------------------------------


def test_recovery_ends_an_active_recording_at_its_last_whole_frame(tmp_path: Path) -> None:
    """The archive died mid-recording: recovery scans the last segment, cuts what follows
    the last whole frame (a torn one) and says RECOVERED; verify then finds it whole."""
    data, ends = recorded_frames(0, [1000] * 200)  # 3 terms and more: two segments
    segment = 2 * TERM
    with Catalog.open(tmp_path) as catalog:
        descriptor = _add(catalog, segment_length=segment)
        (tmp_path / segment_file_name(0, 0)).write_bytes(data[:segment])
        torn = ends[150] + 500  # inside the frame after
        (tmp_path / segment_file_name(0, segment)).write_bytes(data[segment:torn])
        assert not verify(descriptor, tmp_path).ok
        recovered = recover(catalog, tmp_path)
    assert [d.stop_position for d in recovered] == [ends[150]]
    assert recovered[0].end_reason is EndReason.RECOVERED
    assert (tmp_path / segment_file_name(0, segment)).stat().st_size == ends[150] - segment
    report = verify(recovered[0], tmp_path)
    assert report.ok, report.problems
    assert report.frames == 151  # padding frames included


# -- write-behind ---------------------------------------------------------------------------


def _resident_bytes(path: Path) -> int:
    """How many bytes of ``path`` the page cache holds now (mincore on a mapping of it, which
    faults nothing in)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        with mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as view:
            pages = -(-size // mmap.PAGESIZE)
            vec = _mincore_ffi.new("unsigned char[]", pages)
            with _mincore_ffi.from_buffer(view) as address:
                assert _libc.mincore(address, size, vec) == 0
            return sum(vec[i] & 1 for i in range(pages)) * mmap.PAGESIZE


def _file_system_type(path: Path) -> str:
    mounts = {}
    for line in Path("/proc/mounts").read_text().splitlines():
        fields = line.split()
        mounts[fields[1]] = fields[2]
    while str(path) not in mounts:
        path = path.parent
    return mounts[str(path)]


@pytest.mark.parametrize("write_behind", [0, 64 * 1024])
def test_write_behind_keeps_a_few_chunks_of_a_segment_in_the_page_cache(
        tmp_path: Path, write_behind: int) -> None:
    """With write-behind a segment being written (four of 1 MiB, in 64 KiB blocks) keeps at
    most its depth and one more of 64 KiB chunks in the page cache, and one closed keeps
    none; all read back whole.  Without it the page cache keeps all of each (the control:
    what the test tells apart)."""
    if _file_system_type(tmp_path) in ("tmpfs", "ramfs"):
        from tests.helpers import lacking
        lacking(f"{tmp_path} is on a file system without writeback: its pages cannot leave")
    segment = 16 * TERM  # 1 MiB: twice what write-behind holds
    assert (WRITE_BEHIND_DEPTH + 1) * 64 * 1024 <= segment // 2
    data, _ = recorded_frames(0, [1000] * 3900)  # 3.9 segments and more
    data = data[:len(data) - len(data) % TERM]  # whole terms: each block one term
    with Catalog.open(tmp_path) as catalog:
        descriptor = _add(catalog, segment_length=segment)
    writer = SegmentWriter(tmp_path, descriptor, SyncPolicy.NONE, 0, write_behind=write_behind)
    most_while_written = 0
    for offset in range(0, len(data), TERM):
        writer.write(memoryview(data)[offset:offset + TERM], offset)
        assert writer.segment_path is not None
        most_while_written = max(most_while_written, _resident_bytes(writer.segment_path))
    writer.close()
    if write_behind:
        assert most_while_written <= (WRITE_BEHIND_DEPTH + 1) * write_behind
    full = [tmp_path / segment_file_name(0, base)
            for base in range(0, len(data) - segment + 1, segment)]
    assert len(full) == 3
    for path in full:
        resident = _resident_bytes(path)
        if write_behind:
            assert resident == 0, (path.name, resident)  # closed: nothing left behind
        else:
            assert resident >= segment - 4 * TERM, (path.name, resident)
    read = b"".join((tmp_path / segment_file_name(0, base)).read_bytes()
                    for base in range(0, len(data), segment))
    assert read == data


def test_write_behind_turns_itself_off_on_a_file_that_cannot_sync_by_range() -> None:
    """sync_file_range refused (a pipe: ESPIPE, as some file systems refuse it) is no write
    error: the writes go on, write-behind off."""
    read_end, write_end = os.pipe()
    try:
        behind = WriteBehind(64 * 1024)
        behind.restart(write_end, 0)
        for end in range(16 * 1024, 256 * 1024 + 1, 16 * 1024):  # past several chunks
            behind.written(end)
        assert not behind.active
    finally:
        os.close(read_end)
        os.close(write_end)


# -- settings -----------------------------------------------------------------------------


def test_the_shipped_settings_file_names_every_key_at_its_default() -> None:
    text = (ROOT / "config" / "archive.toml").read_text()
    values = tomllib.loads(text)
    assert set(values) == set(SETTINGS)
    assert load_settings(ROOT / "config" / "archive.toml") == ArchiveSettings()


def test_archive_toml_is_generated_from_the_table() -> None:
    assert (ROOT / "config" / "archive.toml").read_text() == render_default_config(), (
        "config/archive.toml is stale: make config")


def test_the_environment_outranks_the_file_and_the_command_line_outranks_both(
        tmp_path: Path) -> None:
    path = tmp_path / "archive.toml"
    path.write_text('sync = "segment"\ncontrol_port = 9001\nblock_length = "64k"\n')
    env = {"SLIPSTREAM_ARCHIVE_CONTROL_PORT": "9002", "SLIPSTREAM_ARCHIVE_BLOCK_LENGTH": "128k",
           "SLIPSTREAM_ARCHIVE_PEERS": "10.0.0.2:8010,10.0.0.3:9000/12|key=k1",
           "SLIPSTREAM_ARCHIVE_CONTROL_KEYS": "k1=9010",
           "SLIPSTREAM_DIR": "/dev/shm/the-clients-not-the-archives"}
    settings = load_settings(path, env, {"block_length": "256k", "release_after": "30s"})
    assert (settings.sync, settings.control_port, settings.block_length,
            settings.release_after) == (SyncPolicy.SEGMENT, 9002, 256 * 1024, 30 * 10**9)
    assert [str(peer) for peer in settings.peers] == ["10.0.0.2:8010/10",
                                                      "10.0.0.3:9000/12|key=k1"]
    assert dict(settings.control_keys) == {"k1": 9010}
    assert settings.driver_dir is None  # SLIPSTREAM_DIR is the client's, not a setting here
    assert {key: settings.sources.get(key, "default") for key in
            ("sync", "control_port", "block_length", "peers", "dir")} == {
        "sync": "file", "control_port": "env", "block_length": "cli", "peers": "env",
        "dir": "default"}


@pytest.mark.parametrize(("env", "overrides", "key", "where"), [
    ({"SLIPSTREAM_ARCHIVE_SEGMENT_LENGTH": "96k"}, {}, "segment_length",
     "from $SLIPSTREAM_ARCHIVE_SEGMENT_LENGTH"),
    ({"SLIPSTREAM_ARCHIVE_SEGMNT_LENGTH": "1m"}, {}, "SLIPSTREAM_ARCHIVE_SEGMNT_LENGTH",
     "did you mean SLIPSTREAM_ARCHIVE_SEGMENT_LENGTH?"),
    ({"SLIPSTREAM_ARCHIVE_CONTROL_KEYS": "k1=8010"}, {}, "control_keys", "control_port's"),
    ({"SLIPSTREAM_ARCHIVE_PEERS": "10.0.0.2"}, {}, "peers", "is not \"host:port\""),
    ({}, {"control_port": "70000"}, "control_port", "by override"),
    ({}, {"sync": "interval", "sync_interval": "0"}, "sync_interval", "by override"),
    ({}, {"record": "aeron:ipc"}, "record", "is a table"),
    ({}, {"segmnt_length": "1m"}, "segmnt_length", "did you mean 'segment_length'?"),
])
def test_a_bad_setting_from_the_environment_or_command_line_names_its_key_and_where(
        env: dict[str, str], overrides: dict[str, str], key: str, where: str) -> None:
    with pytest.raises(ArchiveSettingsError) as raised:
        load_settings(None, env, overrides)
    assert raised.value.key == key
    assert f"archive setting {key!r}" in str(raised.value) and where in str(raised.value)


def test_the_archives_variables_are_passed_over_by_the_driver() -> None:
    """Both read SLIPSTREAM_*: none of the archive's variables is taken by the driver for a
    misspelling of one of its own keys (which it would refuse)."""
    from slipstream.daemon.config import load_settings as load_driver_settings
    env = {f"SLIPSTREAM_ARCHIVE_{key.upper()}": "0" for key in SETTINGS}
    assert load_driver_settings(env=env) == load_driver_settings(env={})


def test_the_resolved_settings_print_as_a_file_that_loads_to_them(tmp_path: Path) -> None:
    path = tmp_path / "archive.toml"
    path.write_text(
        'sync = "interval"\npeers = ["10.0.0.2:8012/10|key=k1"]\n'
        'control_keys = { k1 = 8012, "k.2" = 8014 }\ncontrol_subnets = "127.0.0.0/8"\n'
        'replication_port = 8020\nreplication_address = "10.0.0.1"\n'
        '[[record]]\nchannel = "aeron:ipc"\nstream_id = 7\nretention_max_age = "1h"\n'
        '[[hold]]\nchannel = "aeron:udp?endpoint=127.0.0.1:40456"\nstream_id = 10\n'
        'group = "etl"\n')
    settings = load_settings(path, {"SLIPSTREAM_ARCHIVE_DRIVER_DIR": "/dev/shm/d"},
                             {"dir": str(tmp_path / "a")})
    text = format_settings(settings)
    assert 'driver_dir = "/dev/shm/d"  # env' in text and 'sync = "interval"  # file' in text
    printed = tmp_path / "printed.toml"
    printed.write_text(text)
    assert load_settings(printed, {}) == settings
    assert settings.records[0].retention_max_age_ns == 3600 * 10**9
    assert settings.holds[0].group == "etl"


def test_peers_are_read_with_their_control_stream_defaulting_to_10(tmp_path: Path) -> None:
    path = tmp_path / "archive.toml"
    path.write_text('peers = ["10.0.0.2:8010", "10.0.0.3:9000/12", "Archive-B.Archive:8010"]'
                    '\nreplication_port = 8020\n')
    settings = load_settings(path)
    # A host name is kept as a name (lowercased): the link to the peer follows it.
    assert [str(p) for p in settings.peers] == ["10.0.0.2:8010/10", "10.0.0.3:9000/12",
                                                "archive-b.archive:8010/10"]
    assert settings.replication_port == 8020 and settings.replication_address is None


@pytest.mark.parametrize(("text", "key"), [
    ('segmnt_length = "1m"', "segmnt_length"),
    ('segment_length = "96k"', "segment_length"),
    ('segment_length = "2g"', "segment_length"),
    ('sync = "always"', "sync"),
    ('sync = "interval"\nsync_interval = 0', "sync_interval"),
    ('retention_max_age = "ten days"', "retention_max_age"),
    ('block_length = "1k"', "block_length"),
    ('write_behind = "4k"', "write_behind"),
    ('write_behind = "2g"', "write_behind"),
    ('dir = 5', "dir"),
    ('[[record]]\nchannel = "aeron:ipc"\nstream_id = "one"', "record.stream_id"),
    ('[[record]]\nchannel = "aeron:tcp"\nstream_id = 1', "record.channel"),
    ('[[record]]\nchannel = "aeron-spy:aeron:udp?endpoint=127.0.0.1:4000"\nstream_id = 1',
     "record.channel"),
    ('[[record]]\nchannel = "aeron:ipc"\nstream_id = 1\nsource = "remote"', "record.source"),
    ('[[record]]\nchannel = "aeron:ipc"\nstream_id = 1\nstreamid = 2', "record.streamid"),
    # A recorded stream's bounds are parsed and checked as the archive-wide keys are.
    ('[[record]]\nchannel = "aeron:ipc"\nstream_id = 1\nretention_max_bytes = 1.5',
     "record.retention_max_bytes"),
    ('[[record]]\nchannel = "aeron:ipc"\nstream_id = 1\nretention_max_bytes = [1]',
     "record.retention_max_bytes"),
    ('[[record]]\nchannel = "aeron:ipc"\nstream_id = 1\nretention_max_age = 2.0',
     "record.retention_max_age"),
    ('[[record]]\nchannel = "aeron:ipc"\nstream_id = 1\nretention_max_age = "20y"',
     "record.retention_max_age"),
    ('control_address = "localhost:8010"', "control_address"),
    ('control_port = 70000', "control_port"),
    ('control_port = "eighty"', "control_port"),
    ('control_stream_id = 2147483648', "control_stream_id"),
    ('peers = 8010', "peers"),
    ('peers = "10.0.0.2:8010,10.0.0.3"', "peers"),
    ('peers = ["archive b:8010"]', "peers"),
    ('peers = ["[::1]:8010"]', "peers"),
    ('peers = ["10.0.0.2"]', "peers"),
    ('peers = ["10.0.0.2:0"]', "peers"),
    ('peers = ["10.0.0.2:8010/x"]', "peers"),
    ('peers = ["10.0.0.2:8010|mtu=1408"]', "peers"),  # no channel keys spliced in
    ('peers = ["archive-b:8010|ttl=3/12"]', "peers"),
    ('replication_interval = 0', "replication_interval"),
    ('replication_address = "b"', "replication_address"),
    ('replication_port = 65536', "replication_port"),
    ('segment_length = "1m"\nwrite_behind = "1m"', "write_behind"),
])
def test_a_bad_setting_is_refused_by_name(tmp_path: Path, text: str, key: str) -> None:
    path = tmp_path / "archive.toml"
    path.write_text(text + "\n")
    with pytest.raises(ArchiveSettingsError) as raised:
        load_settings(path)
    assert raised.value.key == key
    assert repr(key) in str(raised.value)


# -- retention and purge ------------------------------------------------------------------


def _recorded(catalog: Catalog, directory: Path, segments: int, *, stopped: bool,
              mtime_s: float, stream_id: int = STREAM, channel: str = "aeron:ipc") -> int:
    """A recording of ``segments`` full segments of 2 terms, segment i last written at
    ``mtime_s + i``."""
    segment = 2 * TERM
    descriptor = _add(catalog, segment_length=segment, channel=channel, stream_id=stream_id)
    for i in range(segments):
        path = directory / segment_file_name(descriptor.recording_id, i * segment)
        path.write_bytes(bytes(segment))
        os.utime(path, (mtime_s + i, mtime_s + i))
    if stopped:
        catalog.update(descriptor.evolve(stop_position=segments * segment, stop_time_ms=1,
                                         end_reason=EndReason.STOPPED))
    return descriptor.recording_id


def test_retention_by_size_takes_the_oldest_segments_of_stopped_recordings_first(
        tmp_path: Path) -> None:
    """Over the size limit: whole segments, from each recording's start, of stopped
    recordings before a live one's, never the live one's segment being written; files that
    are not the archive's own (another name, a recording not in the catalog) stay."""
    segment = 2 * TERM
    foreign = [tmp_path / "notes.txt", tmp_path / "99-0.rec", tmp_path / "0-0.rec.bak"]
    for path in foreign:
        path.write_bytes(b"not the archive's")
    with Catalog.open(tmp_path) as catalog:
        old = _recorded(catalog, tmp_path, 3, stopped=True, mtime_s=1_000)
        live = _recorded(catalog, tmp_path, 3, stopped=False, mtime_s=500)  # older, but live
        newer = _recorded(catalog, tmp_path, 2, stopped=True, mtime_s=2_000)
        removed = apply_retention(catalog, tmp_path, max_bytes=4 * segment, max_age_ns=0,
                                  live={live: 2 * segment}, now_ns=3_000 * 10**9)
        # 8 segments; down to 4: old's three, then newer's first (stopped ones first).
        assert [p.name for p in removed] == [
            segment_file_name(old, 0), segment_file_name(old, segment),
            segment_file_name(old, 2 * segment), segment_file_name(newer, 0)]
        assert catalog.get(old).start_position == catalog.get(old).stop_position
        assert catalog.get(newer).start_position == segment
        assert catalog.get(live).start_position == 0
        removed = apply_retention(catalog, tmp_path, max_bytes=segment, max_age_ns=0,
                                  live={live: 2 * segment}, now_ns=3_000 * 10**9)
        # Then the live one's older segments, never the one it writes.
        assert segment_file_name(live, 2 * segment) not in [p.name for p in removed]
        assert (tmp_path / segment_file_name(live, 2 * segment)).exists()
        assert catalog.get(live).start_position == 2 * segment
    assert all(path.exists() for path in foreign)


def test_retention_by_age_removes_segments_not_written_for_longer(tmp_path: Path) -> None:
    segment = 2 * TERM
    (tmp_path / "7-0.rec").write_bytes(b"x")  # no recording 7 in the catalog: not ours
    os.utime(tmp_path / "7-0.rec", (1, 1))
    with Catalog.open(tmp_path) as catalog:
        first = _recorded(catalog, tmp_path, 3, stopped=True, mtime_s=1_000)
        removed = apply_retention(catalog, tmp_path, max_bytes=0, max_age_ns=1_500 * 10**9,
                                  live={}, now_ns=2_501_500_000_000)
        # Written at 1000, 1001, 1002: at 2501.5 the first two are older than 1500 s.
        assert [p.name for p in removed] == [segment_file_name(first, 0),
                                             segment_file_name(first, segment)]
        assert catalog.get(first).start_position == 2 * segment
    assert (tmp_path / "7-0.rec").exists()


def test_purge_removes_one_recordings_segments_and_marks_it_deleted(tmp_path: Path) -> None:
    with Catalog.open(tmp_path) as catalog:
        gone = _recorded(catalog, tmp_path, 2, stopped=True, mtime_s=1_000)
        kept = _recorded(catalog, tmp_path, 1, stopped=True, mtime_s=1_000)
        assert len(purge(catalog, tmp_path, gone)) == 2
        with pytest.raises(KeyError, match="no recording 0"):
            purge(catalog, tmp_path, gone)
    with Catalog.open(tmp_path, writable=False) as catalog:
        assert catalog.get(gone).state is RecordingState.DELETED
        assert [d.recording_id for d in catalog.recordings()] == [kept]
    assert sorted(p.name for p in tmp_path.glob("*.rec")) == [segment_file_name(kept, 0)]
