"""A replay's block append (``ss_append_block``, client/native_block_appender.c): a range of
one log copied frame for frame into another that starts at the same position, as a replay
session sends a range (archive/replayer.py).  The copy must read back as the source does
(payloads, positions, reserved values, fragments, the padding that ends a term), stop where a
block cannot go, and take nothing from a source frame it has not checked.  Where a range the
log no longer holds resumes (``first_retained``) is found among the terms the log can still
hold, and a query's replay server (the archive's control stream over its own logs) answers
every way a replay of a live log ends."""

from __future__ import annotations

import json
import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest
from helpers import FAST_DRIVER_SETTINGS, free_port, wait_for
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from slipstream.archive import control
from slipstream.archive.client import ArchiveClient
from slipstream.archive.holding import driver_instance
from slipstream.archive.reading import RecordingLostError
from slipstream.archive.replayer import LogSource
from slipstream.client import BufferClaim, Client, SlipstreamError, retention
from slipstream.client._native import ffi, lib
from slipstream.client.counters import CountersFile
from slipstream.client.holding import CallError, small_channel
from slipstream.client.image import Image
from slipstream.client.layout import (
    BEGIN_FLAG,
    DATA_HEADER,
    END_FLAG,
    FRAME_ALIGNMENT,
    HDR_TYPE_DATA,
    HDR_TYPE_PAD,
    HEADER_LENGTH,
    INT32_MAX,
    INT32_MIN,
    TERM_MIN_LENGTH,
)
from slipstream.client.logbuffer import LogBuffer, index_by_position, new_appender
from slipstream.client.publication import ADMIN_ACTION, BACK_PRESSURED, Publication
from slipstream.client.retention import first_retained
from slipstream.client.subscription import Subscription
from slipstream.daemon.driver import MediaDriver
from slipstream.spark_bridge import archived, runtime
from slipstream.spark_bridge.planning import _Holder
from slipstream.spark_bridge.read_task import (
    SlipstreamDataLossError,
    SlipstreamPartition,
    read_range,
)

TERM = TERM_MIN_LENGTH  # 64 KiB
INITIAL_TERM_ID = 7
UNLIMITED = 1 << 62
FIXTURE_OK = [HealthCheck.function_scoped_fixture]


def make_log(directory: Path, *, mtu: int = 1408, session_id: int = 42, stream_id: int = 1001,
             position: int = 0) -> LogBuffer:
    """A log of 64 KiB terms starting at ``position`` (a replay's publication starts where its
    range does)."""
    log = LogBuffer.create(directory / f"{uuid.uuid4().hex}.logbuffer", term_length=TERM,
                           initial_term_id=INITIAL_TERM_ID, session_id=session_id,
                           stream_id=stream_id, mtu=mtu, correlation_id=1,
                           initial_term_count=position // TERM, initial_term_offset=position % TERM)
    log.is_connected = True
    return log


def publish(log: LogBuffer, sizes: list[int], stop: int) -> None:
    """Messages of ``sizes`` (message i carries byte i and reserved value 1000 i - 3), until the
    log reaches ``stop``: fewer than three terms, so that nothing is reused."""
    appender = new_appender(log, ffi.new("int64_t *", UNLIMITED))
    for i, size in enumerate(sizes):
        if log.producer_position() >= stop:
            break
        while (result := lib.ss_offer_rv(appender, bytes([i % 251]) * size, size,
                                         1000 * i - 3)) == ADMIN_ACTION:
            pass
        assert result > 0


def frames(log: LogBuffer, start: int, end: int) -> list[tuple[int, tuple[int, ...], bytes]]:
    """(position, header, payload) of each frame in [start, end); a PAD's payload is not read."""
    found = []
    position = start
    while position < end:
        index, offset = index_by_position(position, log.position_bits), position % TERM
        header = log.frame_header(index, offset)
        assert header[0] >= HEADER_LENGTH, (position, header)
        base = index * TERM + offset
        payload = bytes(log.view[base + HEADER_LENGTH:base + header[0]]) \
            if header[3] == HDR_TYPE_DATA else b""
        found.append((position, header, payload))
        position += (header[0] + FRAME_ALIGNMENT - 1) & -FRAME_ALIGNMENT
    assert position == end
    return found


def read(log: LogBuffer, start: int, end: int) -> list[tuple[bytes, int, int]]:
    """What a subscriber reads of [start, end): payload, position, reserved value."""
    image = Image(log, ffi.new("int64_t *", start), join_position=start)
    got: list[tuple[bytes, int, int]] = []
    assert image.peek(start, lambda data, header: got.append(
        (bytes(data), header.position, header.reserved_value)), end) == end
    return got


def replay_appender(replay: LogBuffer, limit: object):  # -> cffi ss_appender_t *
    """The appender of a replay's log: an exclusive publication's (a block copy writes past
    the tail before it claims it, which only a log's one writer may)."""
    appender = new_appender(replay, limit)
    appender.exclusive = 1
    return appender


def copy_range(source: LogBuffer, replay: LogBuffer, start: int, end: int, block: int,
               window: int) -> int:
    """Copy [start, end) block by block under a publication limit ``window`` past the replay's
    position (raised whenever it holds the copy back); returns the C calls made."""
    limit = ffi.new("int64_t *", start + window)
    appender = replay_appender(replay, limit)
    result = ffi.new("int64_t *")
    position, calls = start, 0
    while position < end:
        calls += 1
        assert calls < 100_000
        term = source.term_address(index_by_position(position, source.position_bits))
        copied = lib.ss_append_block(appender, term, TERM, position, end, block, result)
        if copied > 0:
            assert result[0] == position + copied <= end
            first = source.frame_header(index_by_position(position, source.position_bits),
                                        position % TERM)[0]
            assert copied <= max(block, (first + FRAME_ALIGNMENT - 1) & -FRAME_ALIGNMENT)
            assert position // TERM == (result[0] - 1) // TERM  # a block stays in its term
            position = result[0]
            assert replay.producer_position() == position
        elif result[0] == BACK_PRESSURED:
            assert position >= limit[0]
            limit[0] = position + window
        else:
            assert result[0] == ADMIN_ACTION, result[0]  # the replay rotated into the next term
            assert position % TERM == 0
    return calls


def boundaries(log: LogBuffer, end: int) -> tuple[list[int], list[int]]:
    """Where messages begin in [0, end), and where a range may end (after a message's last
    frame, or after padding)."""
    starts, ends = [], []
    for position, header, _ in frames(log, 0, end):
        length, flags, kind = header[0], header[2], header[3]
        after = position + ((length + FRAME_ALIGNMENT - 1) & -FRAME_ALIGNMENT)
        if kind == HDR_TYPE_DATA and flags & BEGIN_FLAG:
            starts.append(position)
        if kind == HDR_TYPE_PAD or flags & END_FLAG:
            ends.append(after)
    return starts, ends


@settings(max_examples=60, deadline=None, suppress_health_check=FIXTURE_OK)
@given(sizes=st.lists(st.integers(0, 3000), min_size=1, max_size=120),
       mtu=st.sampled_from([256, 1408]), wider=st.booleans(), data=st.data(),
       block=st.integers(1, 1 << 17), window=st.integers(1, 1 << 16))
@example(sizes=[1000] * 70, mtu=1408, wider=False, data=None, block=1 << 20, window=1 << 20)
def test_a_range_copied_in_blocks_reads_back_as_the_source_frame_for_frame(
        shm: Path, sizes: list[int], mtu: int, wider: bool, data: st.DataObject | None,
        block: int, window: int) -> None:
    """Any range of messages (fragmented ones too) over up to three terms, with the padding that
    ends a term: copied in blocks of any size under any publication limit, into a log of the
    same or a larger MTU, every frame is the source's but for its session and stream id, and a
    subscriber reads the same payloads, positions and reserved values."""
    source = make_log(shm, mtu=mtu)
    publish(source, sizes, 2 * TERM + TERM // 2)
    produced = source.producer_position()
    starts, ends = boundaries(source, produced)
    if data is None:  # the example: 62 messages of 1000 B fill a term to 65,472, then 64 of PAD
        start, end = starts[30], TERM + 5 * 1056
        assert end in ends and TERM in ends
    else:
        start = data.draw(st.sampled_from(starts))
        end = data.draw(st.sampled_from([e for e in ends if e > start]))
    replay = make_log(shm, mtu=4096 if wider else mtu, session_id=-9, stream_id=5,
                      position=start)
    calls = copy_range(source, replay, start, end, block << 5, window << 5)
    assert calls >= 1
    copied, original = frames(replay, start, end), frames(source, start, end)
    assert [(position, header[:5] + header[7:], payload)
            for position, header, payload in copied] == \
        [(position, header[:5] + header[7:], payload) for position, header, payload in original]
    assert {header[5:7] for _, header, _ in copied} == {(-9, 5)}
    assert read(replay, start, end) == read(source, start, end)
    # Nothing past the end: the next frame of the replay is not there.
    index = index_by_position(end, replay.position_bits)
    if end % TERM:
        assert replay.frame_header(index, end % TERM)[0] == 0
    source.close()
    replay.close()


def test_a_block_stops_before_padding_inside_a_term_and_copies_nothing_there(shm: Path) -> None:
    """An aborted claim leaves padding inside the term: the block ends before it, and a block
    asked for at the padding copies nothing and says so with no code (the caller looks)."""
    source = make_log(shm)
    appender = new_appender(source, ffi.new("int64_t *", UNLIMITED))
    for _ in range(3):
        assert lib.ss_offer(appender, b"a" * 100, 100) > 0
    frame_offset = ffi.new("int64_t *")
    assert lib.ss_try_claim(appender, 200, frame_offset) > 0
    assert lib.ss_abort(appender, source.address + frame_offset[0], 232) == 1
    assert lib.ss_offer(appender, b"b" * 100, 100) > 0
    end = source.producer_position()
    replay = make_log(shm, session_id=1, stream_id=2)
    block_appender = replay_appender(replay, ffi.new("int64_t *", UNLIMITED))
    result = ffi.new("int64_t *")
    term = source.term_address(0)
    assert lib.ss_append_block(block_appender, term, TERM, 0, end, 1 << 20, result) == 3 * 160
    assert result[0] == 3 * 160
    assert lib.ss_append_block(block_appender, term, TERM, 3 * 160, end, 1 << 20, result) == 0
    assert result[0] == 0
    assert replay.producer_position() == 3 * 160
    assert replay.frame_header(0, 3 * 160)[0] == 0
    assert read(replay, 0, 3 * 160) == read(source, 0, 3 * 160)
    source.close()
    replay.close()


def test_a_block_refuses_a_replay_elsewhere_and_waits_for_credit(shm: Path) -> None:
    """The replay must be at the block's position (else SS_INVALID_BATCH, nothing written); at
    its limit it is back-pressured; the first frame goes whenever the position is below the
    limit, as a claim does; a source of another term length is refused."""
    source = make_log(shm)
    publish(source, [1000] * 10, TERM)
    end = source.producer_position()
    replay = make_log(shm, session_id=1, stream_id=2, position=1056)
    limit = ffi.new("int64_t *", 1056)
    appender = replay_appender(replay, limit)
    result = ffi.new("int64_t *")
    term = source.term_address(0)
    assert lib.ss_append_block(appender, term, TERM, 0, end, 1 << 20, result) == 0
    assert result[0] == lib.SS_INVALID_BATCH
    assert lib.ss_append_block(appender, term, 2 * TERM, 1056, end, 1 << 20, result) == 0
    assert result[0] == lib.SS_INVALID_BATCH
    assert lib.ss_append_block(appender, term, TERM, 1056, 1056, 1 << 20, result) == 0
    assert result[0] == lib.SS_INVALID_BATCH
    assert lib.ss_append_block(appender, term, TERM, 1056, end, 1 << 20, result) == 0
    assert result[0] == BACK_PRESSURED
    limit[0] = 1056 + 32  # room for less than one frame: the first goes, as a claim's would
    assert lib.ss_append_block(appender, term, TERM, 1056, end, 1 << 20, result) == 1056
    limit[0] = UNLIMITED
    assert lib.ss_append_block(appender, term, TERM, 2 * 1056, end, 3000, result) == 2 * 1056
    assert lib.ss_append_block(appender, term, TERM, 4 * 1056, end, 1 << 20, result) == 6 * 1056
    assert result[0] == end == replay.producer_position()
    assert read(replay, 1056, end) == read(source, 1056, end)
    source.close()
    replay.close()


def test_a_block_is_refused_on_a_shared_log_and_at_an_unaligned_end(shm: Path) -> None:
    """A block writes past the tail before it claims it: a shared publication's log (other
    writers may claim meanwhile) is refused, and so is an end that is no frame boundary;
    nothing is written either way."""
    source = make_log(shm)
    appender = new_appender(source, ffi.new("int64_t *", UNLIMITED))
    for _ in range(3):
        assert lib.ss_offer(appender, b"a" * 100, 100) > 0
    end = source.producer_position()
    replay = make_log(shm, session_id=1, stream_id=2)
    result = ffi.new("int64_t *")
    term = source.term_address(0)
    shared = new_appender(replay, ffi.new("int64_t *", UNLIMITED))
    assert lib.ss_append_block(shared, term, TERM, 0, end, 1 << 20, result) == 0
    assert result[0] == lib.SS_INVALID_BATCH
    exclusive = replay_appender(replay, ffi.new("int64_t *", UNLIMITED))
    assert lib.ss_append_block(exclusive, term, TERM, 0, end - 8, 1 << 20, result) == 0
    assert result[0] == lib.SS_INVALID_BATCH
    assert replay.producer_position() == 0 and replay.frame_header(0, 0)[0] == 0
    assert lib.ss_append_block(exclusive, term, TERM, 0, end, 1 << 20, result) == end
    source.close()
    replay.close()


def test_a_source_frame_of_another_term_is_not_copied(shm: Path) -> None:
    """A frame whose term id or term offset is not its place's (a lapped or torn log) ends the
    block before it; at the block's first frame nothing is copied and the replay is as it was."""
    source = make_log(shm)
    publish(source, [100] * 4, TERM)
    view = source.view
    DATA_HEADER.pack_into(view, 2 * 160, *source.frame_header(0, 2 * 160)[:7],
                          INITIAL_TERM_ID + 3, 0)
    replay = make_log(shm, session_id=1, stream_id=2)
    appender = replay_appender(replay, ffi.new("int64_t *", UNLIMITED))
    result = ffi.new("int64_t *")
    term = source.term_address(0)
    assert lib.ss_append_block(appender, term, TERM, 0, 4 * 160, 1 << 20, result) == 2 * 160
    assert lib.ss_append_block(appender, term, TERM, 2 * 160, 4 * 160, 1 << 20, result) == 0
    assert result[0] == 0 and replay.producer_position() == 2 * 160
    assert bytes(replay.view[2 * 160:4 * 160]) == bytes(2 * 160)
    source.close()
    replay.close()


@settings(max_examples=200, deadline=None, suppress_health_check=FIXTURE_OK)
@given(length=st.one_of(st.integers(0, 1500), st.none(), st.integers(INT32_MIN, INT32_MAX),
                       st.integers(-64, 2 * TERM)),
       kind=st.sampled_from([HDR_TYPE_DATA, HDR_TYPE_PAD, 2, 3]), flags=st.integers(0, 255),
       offset_right=st.sampled_from([True, True, False]),
       term_right=st.sampled_from([True, True, False]),
       at=st.integers(0, TERM // FRAME_ALIGNMENT - 1).map(lambda v: v * FRAME_ALIGNMENT),
       end_frames=st.integers(1, TERM // FRAME_ALIGNMENT))
def test_a_block_takes_no_frame_whose_header_it_cannot_trust(
        shm: Path, length: int | None, kind: int, flags: int, offset_right: bool,
        term_right: bool, at: int, end_frames: int) -> None:
    """Whatever header another process left at ``at`` (None: a length to the end of the term),
    after valid frames: the copy stays in the range and the term, and what it copied is a chain
    of whole frames a reader can walk."""
    source = make_log(shm)
    publish(source, [50] * 400, at)  # 96-byte frames up to about ``at``
    at = source.producer_position()
    if at >= TERM:
        return
    if length is None:
        length = TERM - at
    DATA_HEADER.pack_into(source.view, at, length, 0, flags, kind, at if offset_right else at + 32,
                          42, 1001, INITIAL_TERM_ID if term_right else INITIAL_TERM_ID + 1, 0)
    end = min(TERM, end_frames * FRAME_ALIGNMENT)
    if end <= 0:
        return
    replay = make_log(shm, session_id=1, stream_id=2)
    appender = replay_appender(replay, ffi.new("int64_t *", UNLIMITED))
    result = ffi.new("int64_t *")
    copied = lib.ss_append_block(appender, source.term_address(0), TERM, 0, end, INT32_MAX,
                                 result)
    assert 0 <= copied <= end
    if copied:
        assert result[0] == copied == replay.producer_position()
        frames(replay, 0, copied)  # whole frames, ending exactly where the copy does
        event("copied past the crafted header" if copied > at else "stopped before it")
        if copied > at:  # the header at ``at`` was one a block may copy
            header = replay.frame_header(0, at)
            assert header[0] == length and header[3] in (HDR_TYPE_DATA, HDR_TYPE_PAD)
            assert offset_right and term_right
            assert at + length <= end
            assert header[3] == HDR_TYPE_DATA or at + ((length + 31) & -32) == TERM
    assert replay.frame_header(0, copied % TERM)[0] == 0 or copied == TERM
    source.close()
    replay.close()


def write_terms(log: LogBuffer, sizes: list[int], stop: int) -> None:
    """Messages of ``sizes``, over and over, until the log reaches ``stop`` (past three terms):
    each partition is zeroed before the log rotates into it again, as the driver's cleaner
    leaves a partition a publisher enters."""
    appender = new_appender(log, ffi.new("int64_t *", UNLIMITED))
    i = 0
    while log.producer_position() < stop:
        size = sizes[i % len(sizes)]
        result = lib.ss_offer_rv(appender, bytes([i % 251]) * size, size, i)
        if result == ADMIN_ACTION:  # rotated: the partition it enters holds a term 3 back
            position = log.producer_position()
            if position >= 3 * TERM:
                log.term_view(index_by_position(position, log.position_bits))[:] = bytes(TERM)
            continue
        assert result > 0
        i += 1


@settings(max_examples=40, deadline=None, suppress_health_check=FIXTURE_OK)
@given(sizes=st.lists(st.integers(0, 3000), min_size=1, max_size=20),
       stop=st.integers(3 * TERM + 1, 4 * TERM - 4096), cut=st.integers(0, TERM // 32),
       start_at=st.floats(0, 1))
@example(sizes=[100], stop=3 * TERM + 5000, cut=TERM // 32, start_at=0.0)
def test_the_first_position_held_is_found_among_the_terms_the_log_can_still_hold(
        shm: Path, monkeypatch: pytest.MonkeyPatch, sizes: list[int], stop: int, cut: int,
        start_at: float) -> None:
    """Past three terms, the oldest term the log holds is cleaned up to ``cut`` (32-byte
    units): from any start, ``first_retained`` returns the first frame boundary after it that
    the log still holds (the producer's position when none), and never looks into a term
    that was written over, which could only cost time (a Python scan of it took seconds)."""
    log = make_log(shm)
    try:
        write_terms(log, sizes, stop)
        producer = log.producer_position()
        held = [position for position, _, _ in frames(log, TERM, producer)]
        oldest = log.term_view(index_by_position(TERM, log.position_bits))
        oldest[:cut * FRAME_ALIGNMENT] = bytes(cut * FRAME_ALIGNMENT)
        image = Image(log, ffi.new("int64_t *", producer), join_position=0)
        looked_at: list[int] = []
        scan = retention._first_frame_in_term

        def recorded(image: Image, start: int, end: int) -> int | None:
            looked_at.append(start)
            return scan(image, start, end)

        monkeypatch.setattr(retention, "_first_frame_in_term", recorded)
        start = int(start_at * (producer - FRAME_ALIGNMENT)) & -FRAME_ALIGNMENT
        expected = min((p for p in held if p > start and p >= TERM + cut * FRAME_ALIGNMENT),
                       default=producer)
        assert first_retained(image, start, producer) == expected
        assert all(position >= TERM for position in looked_at), looked_at
    finally:
        log.close()


# -- through two drivers -------------------------------------------------------------------------
STREAM = 89
KEY = {"channel": "aeron:ipc", "stream_id": STREAM, "group": "query"}


@attrs.define
class TwoDrivers:
    """The holder's driver, whose subscription (``keeper``) holds an IPC log of 64 KiB terms
    and whose query's replay server answers at 127.0.0.2, and the reader's (at 127.0.0.1)."""

    publication: Publication
    keeper: Subscription
    remote: Client
    image: Image
    holder: _Holder
    holder_dir: Path
    reader_dir: Path
    driver: str

    def partition(self, start: int, end: int, *, fail: bool = True,
                  directory: Path | None = None) -> SlipstreamPartition:
        """A read task's partition of ``[start, end)``, read on the reader's host (or on the
        host of ``directory``)."""
        return SlipstreamPartition(
            self.image.session_id, STREAM, self.image.log_path, start, end,
            str(directory or self.reader_dir), fail, "holder-host", log=self.image.identity,
            driver=self.driver, holder=self.holder.address, replay_timeout_ms=10_000,
            held=KEY)

    def link(self) -> ArchiveClient:
        """The reader's link to the replay server, as its read tasks use it."""
        return archived.archive_client_for(runtime.client_for(str(self.reader_dir)),
                                           str(self.reader_dir), self.holder.address, 10.0)


@pytest.fixture
def holder_and_reader() -> Iterator[TwoDrivers]:
    directories = [Path("/dev/shm") / f"slipstream-block-{uuid.uuid4().hex[:6]}-{n}"
                   for n in ("holder", "reader")]
    try:
        with MediaDriver.launch(directory=directories[0], **FAST_DRIVER_SETTINGS), \
                MediaDriver.launch(directory=directories[1], **FAST_DRIVER_SETTINGS), \
                Client.connect(directories[0]) as local, \
                Client.connect(directories[1]) as remote:
            publication = local.add_publication("aeron:ipc?term-length=64k", STREAM)
            keeper = local.add_subscription("aeron:ipc", STREAM)
            wait_for(lambda: keeper.images, what="the holder's image")
            image = keeper.images[0]
            holder = _Holder(str(directories[0]), "127.0.0.2", free_port())
            holder.holds.publish({(STREAM, image.session_id): (image.log_path, 0, None)})
            counters = CountersFile(directories[0] / "counters.dat")
            driver = driver_instance(counters)
            counters.close()
            try:
                yield TwoDrivers(publication, keeper, remote, image, holder, *directories,
                                 driver)
            finally:
                holder.close()
    finally:
        for directory in directories:
            shutil.rmtree(directory, ignore_errors=True)


def source_rows(image: Image, start: int, end: int) -> list[tuple[bytes, int, int]]:
    """(bytes, position, reserved value / 1000: the timestamp column, µs) of the log."""
    rows: list[tuple[bytes, int, int]] = []
    image.peek(start, lambda d, h: rows.append((bytes(d), h.position,
                                                h.reserved_value // 1000)), end)
    return rows


def task_rows(partition: SlipstreamPartition) -> list[tuple[bytes, int, int]]:
    """What a read task returns: (value, position, timestamp µs) of each row."""
    return [row for batch in read_range(partition)
            for row in zip(batch.column("value").to_pylist(),
                           batch.column("position").to_pylist(),
                           batch.column("timestamp").cast("int64").to_pylist(), strict=True)]


def offer(publication: Publication, count: int, first: int = 0, size: int = 100) -> None:
    """Messages ``first``.. of ``size`` bytes, message i carrying byte i and reserved value
    1000 (i + 1) (the writer's stamp: i + 1 µs)."""
    for i in range(first, first + count):
        deadline = time.monotonic() + 10
        while publication.offer(bytes([i % 251]) * size, reserved_value=(i + 1) * 1000) < 0:
            assert time.monotonic() < deadline, "no credit for 10 s"
            time.sleep(0.001)


@pytest.mark.sockets
def test_padding_inside_a_term_is_replayed_around_and_a_terms_end_padding_read_through(
        holder_and_reader: TwoDrivers) -> None:
    """An aborted claim leaves padding inside a term, which a replay cannot reproduce: a task
    on the reader's host reads a range across it with the log's positions and stamps (a
    replay up to the padding, then one from the next message), as do ranges that end with it
    or start after it.  A range across a term's end reads to its end, the padding that ends
    the term copied with the term's frames."""
    hosts = holder_and_reader
    offer(hosts.publication, 10)
    pad_at = hosts.publication.position
    claim = BufferClaim()
    assert hosts.publication.try_claim(200, claim) > 0
    claim.abort()
    after_pad = hosts.publication.position
    assert after_pad == pad_at + 256
    offer(hosts.publication, 10, first=10)
    end = hosts.publication.position
    local = source_rows(hosts.image, 0, end)
    assert task_rows(hosts.partition(0, end, directory=hosts.holder_dir)) == local
    assert task_rows(hosts.partition(0, end)) == local
    assert task_rows(hosts.partition(0, after_pad)) == local[:10]
    assert task_rows(hosts.partition(after_pad, end)) == local[10:]
    # 1000-byte messages: a term ends with 64 bytes of padding, which a block copies.  The
    # keeper reads for credit, less than a term past the range: none of it is cleaned.
    deadline = time.monotonic() + 10
    n = 20
    while hosts.publication.position < TERM + 3 * 1056:
        while hosts.publication.offer(bytes(1000), reserved_value=(n + 1) * 1000) < 0:
            if hosts.keeper.poll(lambda d, h: None, 10) == 0:  # the driver raises the limit
                assert time.monotonic() < deadline, "no credit for 10 s"
                time.sleep(0.001)
        n += 1
    assert hosts.image.position - after_pad < TERM
    end = hosts.publication.position
    assert task_rows(hosts.partition(after_pad, end)) == source_rows(hosts.image, after_pad,
                                                                     end)


@pytest.mark.sockets
def test_replays_share_the_readers_link_and_pass_over_an_answer_to_another_call(
        holder_and_reader: TwoDrivers) -> None:
    """Replays one after the other in one worker share its link to the replay server (its
    control and response streams), and the server its answer publication: only each
    replay's data stream is new.  An answer on the response stream to another call (a late
    answer to one that timed out) is read and passed over."""
    hosts = holder_and_reader
    offer(hosts.publication, 50)
    end = hosts.publication.position
    local = source_rows(hosts.image, 0, end)
    assert task_rows(hosts.partition(0, end)) == local
    link = hosts.link()
    late = hosts.remote.add_publication(small_channel(link.reply_channel),
                                        link._link.response_stream_id)
    wait_for(lambda: late.is_connected, what="the late answer's stream")
    assert late.offer(json.dumps({"id": 10**9, "status": "error",
                                  "message": "not yours"}).encode()) > 0
    assert task_rows(hosts.partition(0, end)) == local
    assert hosts.link() is link
    late.close()
    wait_for(lambda: hosts.holder.control.served == 2, what="two replays served")
    assert len(hosts.holder.control._answers._publications) == 1  # one for both


@pytest.mark.sockets
def test_a_replays_waits_park_and_never_spin(holder_and_reader: TwoDrivers,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Every wait of a replay, the server's for calls, the reader's for the call's answer and
    for the replay's data, parks at once (``spin_ns`` 0): what they wait for takes
    milliseconds, and a spinning waiter takes the core the drivers that bring it need."""
    hosts = holder_and_reader
    offer(hosts.publication, 50)
    end = hosts.publication.position
    spins: dict[str, list[int | None]] = {"holder": [], "reader": []}
    wait_for_data = Subscription.wait_for_data
    await_frames = control.await_frames

    def recorded(self: Subscription, timeout_ns: int, spin_ns: int | None = None) -> bool:
        spins["reader"].append(spin_ns)
        return wait_for_data(self, timeout_ns, spin_ns)

    def served(images: list[Image], timeout_ns: int, spin_ns: int = 0) -> bool:
        spins["holder"].append(spin_ns)
        return await_frames(images, timeout_ns, spin_ns)

    monkeypatch.setattr(Subscription, "wait_for_data", recorded)
    monkeypatch.setattr(control, "await_frames", served)
    assert task_rows(hosts.partition(0, end)) == source_rows(hosts.image, 0, end)
    wait_for(lambda: spins["holder"], what="the server waiting for its next call")
    assert spins["reader"] and set(spins["reader"]) == {0}, spins["reader"]
    assert set(spins["holder"]) == {0}, spins["holder"]


@pytest.mark.sockets
def test_a_range_the_cleaner_takes_while_the_server_looks_for_its_start_is_refused_lost(
        holder_and_reader: TwoDrivers, monkeypatch: pytest.MonkeyPatch) -> None:
    """The server finds the range's start held, then the cleaner zeroes it while the server
    walks to where a message begins: the answer is ``lost`` (a frame zeroed reads as not
    written yet, and the range would have been answered as empty and read as complete,
    nothing lost), with what the log holds from the next message; asked from there, the
    replay is the log's."""
    hosts = holder_and_reader
    publication, keeper, image = hosts.publication, hosts.keeper, hosts.image
    deadline = time.monotonic() + 10
    while image.position < 7 * TERM // 4:  # the keeper reads, a few messages at a time
        while publication.offer(bytes(1000), reserved_value=5000) > 0:
            pass
        if keeper.poll(lambda d, h: None, 8) == 0:
            assert time.monotonic() < deadline, "no credit for 10 s"
            time.sleep(0.001)
    offered = time.monotonic()
    while time.monotonic() - offered < 0.2:  # then the publisher runs half a term ahead
        if publication.offer(bytes(1000), reserved_value=6000) > 0:
            offered = time.monotonic()
        else:
            time.sleep(0.001)
    start, end = TERM, publication.position  # not cleaned, a whole term behind the producer
    assert end - start >= TERM and image.position - start < TERM
    writable = LogBuffer(image.log_path)
    walk = retention.message_start
    zeroed: list[int] = []

    def cleaner_passes(image: Image, position: int, end: int) -> int:
        if not zeroed:
            index = index_by_position(position, writable.position_bits)
            writable.term_view(index)[position % TERM:position % TERM + HEADER_LENGTH] = \
                bytes(HEADER_LENGTH)
            zeroed.append(position)
        return walk(image, position, end)

    monkeypatch.setattr(control, "message_start", cleaner_passes)
    try:
        with pytest.raises(RecordingLostError, match=f"no longer holds position {start}"
                           ) as lost:
            hosts.link().replay_held(KEY, image.session_id, image.identity.framing, start,
                                     end)
        assert zeroed == [start] and lost.value.held == (start + 1056, end)
        assert task_rows(hosts.partition(start + 1056, end)) == \
            source_rows(image, start + 1056, end)
    finally:
        writable.close()


@pytest.mark.sockets
def test_a_loss_while_replaying_is_data_loss_naming_the_range(
        holder_and_reader: TwoDrivers, monkeypatch: pytest.MonkeyPatch) -> None:
    """The log stops holding the range after the replay began (the cleaner passed it): the
    replay's stream ends early, and asked again from where it ended, the server says what the
    log holds now; the task fails with the loss naming the range (``failOnDataLoss=true``),
    or skips to what is held and reads it (``false``), not failing as if the stream merely
    ended."""
    hosts = holder_and_reader
    offer(hosts.publication, 20)
    end = hosts.publication.position
    cleaned_to = source_rows(hosts.image, 0, end)[9][1]  # the first ten messages go
    copy, held = LogSource.copy, LogSource.held
    lost: list[int] = []

    def cleaned(self: LogSource, publication: Publication, position: int, block_end: int
                ) -> tuple[int, int]:
        if position < cleaned_to:
            lost.append(position)
            raise RecordingLostError(f"{self.name}: the live log no longer holds position "
                                     f"{position}", (cleaned_to, block_end))
        return copy(self, publication, position, block_end)

    def held_now(self: LogSource, start: int, stop: int) -> tuple[int, int]:
        return (max(start, cleaned_to), stop) if lost else held(self, start, stop)

    monkeypatch.setattr(LogSource, "copy", cleaned)
    monkeypatch.setattr(LogSource, "held", held_now)
    with pytest.raises(SlipstreamDataLossError, match=rf"positions \[0, {cleaned_to}\)"):
        task_rows(hosts.partition(0, end))
    assert lost
    assert task_rows(hosts.partition(0, end, fail=False)) == \
        source_rows(hosts.image, cleaned_to, end)


@pytest.mark.sockets
def test_a_server_that_fails_serving_a_replay_says_so_and_serves_the_next(
        holder_and_reader: TwoDrivers, monkeypatch: pytest.MonkeyPatch) -> None:
    """An exception at the server while it looks the log up is answered to the reader with
    its reason, at once (not after the reader's timeout, as if the server were not there);
    one while it sends the range fails that replay (logged with its cause at the server, its
    stream ended early: the task fails naming where), never the server, which serves the
    next replay."""
    hosts = holder_and_reader
    offer(hosts.publication, 20)
    end = hosts.publication.position
    replay_source = hosts.holder.holds.replay_source

    def lookup_fails(*args: object) -> Image:
        raise RuntimeError("the lookup broke")

    hosts.holder.holds.replay_source = lookup_fails  # type: ignore[method-assign]
    # Answered by the archive, naming the cause: not the call's timeout.
    with pytest.raises(CallError, match=r"failed at the archive \(RuntimeError: the lookup"):
        task_rows(hosts.partition(0, end))
    hosts.holder.holds.replay_source = replay_source  # type: ignore[method-assign]
    copy = LogSource.copy

    def send_fails(*args: object) -> tuple[int, int]:
        raise RuntimeError("the copy broke")

    monkeypatch.setattr(LogSource, "copy", send_fails)
    with pytest.raises(SlipstreamError, match=r"ended at position 0, before \d+"):
        task_rows(hosts.partition(0, end))
    monkeypatch.setattr(LogSource, "copy", copy)
    assert task_rows(hosts.partition(0, end)) == source_rows(hosts.image, 0, end)
    wait_for(lambda: hosts.holder.control.served == 1, what="the third replay served")
