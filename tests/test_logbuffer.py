"""Log buffer: append, fragmentation, padding, rotation, reading, cleaning (docs/PROTOCOL.md §2)."""

from __future__ import annotations

import multiprocessing
import os
import resource
import struct
import threading
import time
import uuid
import zlib
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from slipstream.client._native import ffi, lib
from slipstream.client.errors import ClosedError
from slipstream.client.image import Image
from slipstream.client.layout import (
    BEGIN_FLAG,
    CURRENT_VERSION,
    DATA_HEADER,
    END_FLAG,
    FRAME_ALIGNMENT,
    FRAME_HEADER,
    HDR_TYPE_DATA,
    HDR_TYPE_PAD,
    HEADER_LENGTH,
    INT32_MAX,
    INT32_MIN,
    INT64_MAX,
    INT64_MIN,
    META_ACTIVE_TERM_COUNT,
    PARTITION_COUNT,
    TERM_MIN_LENGTH,
    UNFRAGMENTED,
)
from slipstream.client.logbuffer import (
    POPULATE_STEP,
    LogBuffer,
    LogIdentity,
    compute_log_length,
    compute_position,
    compute_term_id,
    compute_term_offset,
    index_by_position,
    max_message_length,
    max_possible_position,
    new_appender,
    unblock,
)
from slipstream.client.publication import ADMIN_ACTION, BACK_PRESSURED, MAX_POSITION_EXCEEDED
from slipstream.daemon.protocol.log_cleaner import LogCleaner

UNLIMITED = 1 << 62


def make_log(directory: Path, term_length: int = TERM_MIN_LENGTH, mtu: int = 1408,
             initial_term_id: int = 7, **kwargs: int) -> LogBuffer:
    log = LogBuffer.create(directory / f"{uuid.uuid4().hex}.logbuffer", term_length=term_length,
                           initial_term_id=initial_term_id, session_id=42, stream_id=1001,
                           mtu=mtu, correlation_id=1, **kwargs)
    log.is_connected = True  # as a driver marks it once a subscriber exists
    return log


def offer(appender, message: bytes) -> int:
    """Offer as a publisher does: retry after the term rotation."""
    while True:
        result = lib.ss_offer(appender, message, len(message))
        if result != ADMIN_ACTION:
            return result


def read_all(log: LogBuffer, start: int = 0) -> list[bytes]:
    image = Image(log, ffi.new("int64_t *", start), join_position=start)
    messages: list[bytes] = []
    while image.poll(lambda data, header: messages.append(bytes(data)), 1000) or \
            image.position < log.producer_position():
        pass
    return messages


def test_layout_matches_the_aeron_descriptor(shm: Path) -> None:
    log = make_log(shm, term_length=1 << 16, initial_term_id=-5)
    assert log.length == compute_log_length(1 << 16) == 3 * (1 << 16) + 4096
    assert log.initial_term_id == -5 and log.mtu == 1408 and log.term_length == 1 << 16
    # Initial tails: the active partition holds the initial term, the others term_id - 3 + i.
    assert log.raw_tail(0) >> 32 == -5
    assert log.raw_tail(1) >> 32 == -5 + 1 - 3
    assert log.raw_tail(2) >> 32 == -5 + 2 - 3
    assert log.meta_i32(META_ACTIVE_TERM_COUNT) == 0
    assert log.end_of_stream_position == INT64_MAX
    assert max_message_length(1 << 16) == 8192
    assert max_message_length(1 << 30) == 16 * 1024 * 1024
    log.close()


@given(term_id=st.integers(INT32_MIN, INT32_MAX), initial=st.integers(INT32_MIN, INT32_MAX),
       offset=st.integers(0, (1 << 16) - 1).map(lambda v: v & -FRAME_ALIGNMENT))
def test_position_arithmetic_round_trips(term_id: int, initial: int, offset: int) -> None:
    bits = 16
    position = compute_position(term_id, offset, bits, initial)
    if position < 0:  # term ids before the initial one are not positions
        return
    assert compute_term_id(position, bits, initial) == term_id
    assert compute_term_offset(position, 1 << bits) == offset
    assert index_by_position(position, bits) == ((term_id - initial) & 0xFFFFFFFF) % PARTITION_COUNT


def test_a_message_is_header_plus_payload_aligned_to_32(shm: Path) -> None:
    log = make_log(shm)
    appender = new_appender(log, ffi.new("int64_t *", UNLIMITED))
    assert offer(appender, b"x" * 14) == 64  # 46 bytes of frame in a 64-byte slot, as on the wire
    header = log.frame_header(0, 0)
    assert header[:8] == (46, 0, 0xC0, 1, 0, 42, 1001, 7)
    assert offer(appender, b"") == 96
    log.close()


FIXTURE_OK = [HealthCheck.function_scoped_fixture]


@settings(max_examples=40, deadline=None, suppress_health_check=FIXTURE_OK)
@given(sizes=st.lists(st.integers(0, 8192), min_size=1, max_size=300),
       mtu=st.sampled_from([64, 256, 1408, 4096]))
@example(sizes=[8192] * 100, mtu=1408)  # 800 KiB: 13 terms, round the log's partitions 4 times
@example(sizes=[8100, 0, 33, 8192] * 40, mtu=256)
# The last message begins a term, after the padding that closes the one before.
@example(sizes=[0, 0, 0, 417, 481, 481, 769, 2049, 3297, 3361, 6017, 7425, 8129, 353, 353, 417,
                417, 833, 1089, 3361, 4257, 5377, 7873], mtu=64)
def test_any_sequence_of_messages_reads_back_whole_and_in_order(
        shm: Path, sizes: list[int], mtu: int) -> None:
    """Appended under a publisher's limit (half a term past the reader, never past what the
    cleaner allows), read as it goes and cleaned behind the reader as a driver does, so a long
    sequence rotates terms and reuses every partition."""
    log = make_log(shm, mtu=mtu)
    limit = ffi.new("int64_t *", 0)
    appender = new_appender(log, limit)
    reader = Image(log, ffi.new("int64_t *", 0), join_position=0)
    cleaner = LogCleaner(log, 0)
    received: list[bytes] = []

    def catch_up() -> None:
        # A poll that only steps over a term's padding reads no message, as Aeron's does: on
        # to the producer's position, not to the first poll that returns 0.
        while reader.poll(lambda data, header: received.append(bytes(data)), 1000) or \
                reader.position < log.producer_position():
            pass
        while cleaner.clean_toward(reader.position):
            pass
        limit[0] = min(reader.position + log.term_length // 2, cleaner.reusable_limit())

    sent = [os.urandom(4) * (size // 4) + bytes(size % 4) for size in sizes]
    last = 0
    catch_up()
    for message in sent:
        while (position := offer(appender, message)) == BACK_PRESSURED:
            catch_up()
        assert position > last
        last = position
    catch_up()
    assert received == sent
    log.close()


def test_fragments_carry_begin_and_end_flags_and_fill_the_mtu(shm: Path) -> None:
    log = make_log(shm, mtu=128)
    appender = new_appender(log, ffi.new("int64_t *", UNLIMITED))
    offer(appender, bytes(range(250)))  # max payload 96: 96 + 96 + 58
    flags = [log.frame_header(0, off)[2] for off in (0, 128, 256)]
    lengths = [log.frame_header(0, off)[0] for off in (0, 128, 256)]
    assert flags == [0x80, 0x00, 0x40]
    assert lengths == [128, 128, 90]
    log.close()


def test_every_frame_of_a_message_carries_its_reserved_value(shm: Path) -> None:
    """ss_offer_rv writes the value into each fragment's header; ss_offer_batch_rv one value per
    message (in a run claimed at once, and in a fragmented message of the batch); ss_offer,
    ss_offer_batch and ss_offer_batch_rv without values write 0.  Readers' headers show it."""
    log = make_log(shm, mtu=128)  # 96 payload bytes a frame
    appender = new_appender(log, ffi.new("int64_t *", UNLIMITED))
    assert lib.ss_offer_rv(appender, bytes(250), 250, -5) > 0  # 3 frames
    assert lib.ss_offer(appender, b"zero", 4) > 0
    lengths = [10, 200, 0, 20]  # 200: 3 frames
    values = [INT64_MAX, INT64_MIN, 7, -1]
    batch = bytes(sum(lengths))
    result = ffi.new("int64_t *")
    assert lib.ss_offer_batch_rv(appender, batch, len(batch), ffi.new("int32_t[]", lengths),
                                 ffi.new("int64_t[]", values), 4, result) == 4
    assert lib.ss_offer_batch_rv(appender, batch[:30], 30, ffi.new("int32_t[]", [10, 20]),
                                 ffi.NULL, 2, result) == 2
    assert lib.ss_offer_batch(appender, batch[:10], 10, ffi.new("int32_t[]", [10]), 1,
                              result) == 1
    frames = []
    offset = 0
    while (header := log.frame_header(0, offset))[0] > 0:
        frames.append((header[2], header[8]))  # flags, reserved value
        offset += (header[0] + FRAME_ALIGNMENT - 1) & -FRAME_ALIGNMENT
    assert frames == [(BEGIN_FLAG, -5), (0, -5), (END_FLAG, -5), (UNFRAGMENTED, 0),
                      (UNFRAGMENTED, INT64_MAX), (BEGIN_FLAG, INT64_MIN), (0, INT64_MIN),
                      (END_FLAG, INT64_MIN), (UNFRAGMENTED, 7), (UNFRAGMENTED, -1),
                      (UNFRAGMENTED, 0), (UNFRAGMENTED, 0), (UNFRAGMENTED, 0)]
    seen: list[int] = []
    image = Image(log, ffi.new("int64_t *", 0), join_position=0)
    while image.poll(lambda data, header: seen.append(header.reserved_value), 1000):
        pass
    assert seen == [-5, 0, INT64_MAX, INT64_MIN, 7, -1, 0, 0, 0]
    log.close()


def test_the_writer_that_crosses_the_term_end_pads_and_rotates(shm: Path) -> None:
    log = make_log(shm)
    appender = new_appender(log, ffi.new("int64_t *", UNLIMITED))
    message = b"m" * 1000  # 1056 aligned: 62 fit in 65536 with 64 bytes left
    for _ in range(62):
        assert lib.ss_offer(appender, message, 1000) > 0
    assert lib.ss_offer(appender, message, 1000) == ADMIN_ACTION
    pad = log.frame_header(0, 62 * 1056)
    assert pad[0] == 65536 - 62 * 1056 and pad[3] == HDR_TYPE_PAD and pad[7] == 7
    assert log.active_term_count == 1
    assert log.raw_tail(1) >> 32 == 8
    assert lib.ss_offer(appender, message, 1000) == 65536 + 1056
    assert len(read_all(log)) == 63
    log.close()


@settings(max_examples=5, deadline=None, suppress_health_check=FIXTURE_OK)
@given(size=st.integers(4, 3000))
def test_many_term_rotations_with_cleaning_behind_the_reader(shm: Path, size: int) -> None:
    log = make_log(shm)
    limit = ffi.new("int64_t *", 0)
    appender = new_appender(log, limit)
    image = Image(log, ffi.new("int64_t *", 0), join_position=0)
    received: list[int] = []

    def record(data: memoryview, header: object) -> None:
        received.append(int.from_bytes(data[:4], "little"))

    sent = 0
    clean_position = 0
    while log.active_term_count < 25:  # many rotations of a 64 KiB term
        limit[0] = image.position + log.term_length // 2
        result = lib.ss_offer(appender, sent.to_bytes(4, "little") * (size // 4 + 1), size)
        assert result in (BACK_PRESSURED, ADMIN_ACTION) or result > 0
        if result > 0:
            sent += 1
        elif result == BACK_PRESSURED:
            image.poll(record, 100)
            # Clean as the driver does: the term behind the reader.
            target = image.position - log.term_length
            while clean_position < target:
                step = min(target, (clean_position | (log.term_length - 1)) + 1) - clean_position
                log.clean(clean_position, step)
                clean_position += step
    while image.poll(record, 100):
        pass
    assert received == list(range(sent))
    log.close()


def resident_kib(path: Path) -> list[int]:
    """Resident size of each of this process's mappings of ``path`` (/proc/self/smaps)."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    sizes = []
    for i, line in enumerate(lines):
        if line.endswith(str(path)):
            rss = next(entry for entry in lines[i + 1:] if entry.startswith("Rss:"))
            sizes.append(int(rss.split()[1]))
    return sizes


@pytest.mark.parametrize("sparse", [False, True])
def test_a_dense_log_is_mapped_with_its_pages_in_place_and_a_sparse_one_lazily(
        shm: Path, sparse: bool) -> None:
    term_length = 1 << 20
    created = make_log(shm, term_length=term_length, sparse=sparse)
    log = LogBuffer(created.path)  # as a client maps it
    try:
        resident = resident_kib(created.path)  # the driver's mapping and the client's
        assert len(resident) == 2
        if sparse:
            assert max(resident) < 64  # the metadata page, at most a few more
        else:
            assert min(resident) * 1024 >= PARTITION_COUNT * term_length
        assert LogBuffer(created.path, populate=False).is_sparse is sparse
    finally:
        log.close()
        created.close()


def thread_faults() -> int:
    """Minor page faults of the calling thread so far."""
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt


def test_the_pages_a_sparse_logs_file_holds_are_mapped_in_bulk_for_a_writer_and_a_reader(
        shm: Path) -> None:
    # A sparse log made in a file that holds pages already (a released log's, reused): each
    # view has them mapped as it maps the log, 16 pages a fault (fault-around), and the
    # writer's entries are writable: it writes every held page without a fault.
    term_length = 4 << 20
    created = make_log(shm, term_length=term_length, sparse=True)
    held = 2 * term_length + term_length // 2  # past a term's end: two ranges' worth
    fd = os.open(created.path, os.O_WRONLY)
    try:
        os.pwrite(fd, bytes(held), 0)
    finally:
        os.close(fd)
    pages = held // 4096
    ones = b"\x01" * held  # its pages written: reading it takes no fault
    before = thread_faults()
    writer = LogBuffer(created.path)
    reader = LogBuffer(created.path)  # as a subscriber maps its image
    mapped_in = thread_faults() - before
    try:
        resident = sorted(resident_kib(created.path))  # the creator's mapped none of them
        assert len(resident) == 3 and all(kib * 1024 >= held for kib in resident[1:]), resident
        assert mapped_in < 2 * pages // 8, (mapped_in, pages)
        before = thread_faults()
        writer.view[:held] = ones
        assert thread_faults() - before == 0
    finally:
        reader.close()
        writer.close()
        created.close()


def read_pages(log: LogBuffer, start: int, end: int) -> int:
    """Minor faults this thread takes reading a byte of each page of ``[start, end)``."""
    view = log.view
    before = thread_faults()
    for offset in range(start, end, 4096):
        view[offset]
    return thread_faults() - before


def test_a_log_mapped_behind_maps_its_pages_in_steps_the_active_term_first(
        shm: Path) -> None:
    # A dense log whose active term is its second: mapped behind, none of its pages is in
    # place until a step maps them, the active term's first, a step's bytes at a time.
    term_length = POPULATE_STEP
    created = make_log(shm, term_length=term_length, sparse=False, initial_term_count=1)
    log = LogBuffer(created.path, behind=True)
    try:
        assert log.unpopulated == log.length
        # This view: none of its terms, but the pages around its metadata that the kernel
        # maps with its first read (fault-around: 64 KiB, at the last term's end).
        assert min(resident_kib(created.path)) < 128
        assert log.populate_step()  # one step: the active term, whole
        assert log.unpopulated == log.length - term_length
        assert read_pages(log, term_length, 2 * term_length) == 0
        assert read_pages(log, 0, term_length) > 0  # still to map: the reader faults
        while log.populate_step():
            pass
        assert log.unpopulated == 0 and not log.populate_step()
        assert min(resident_kib(created.path)) * 1024 >= log.length
        assert read_pages(log, 2 * term_length, log.length) == 0
    finally:
        log.close()
        created.close()


def test_a_log_closed_before_its_pages_are_mapped_behind_has_none_left_to_map(
        shm: Path) -> None:
    created = make_log(shm, term_length=1 << 20, sparse=False)
    log = LogBuffer(created.path, behind=True)
    borrowed = log.borrowed()
    try:
        assert log.unpopulated == log.length
        assert borrowed.unpopulated == 0  # a borrowed handle leaves it to the owner
        log.close()
        assert log.unpopulated == 0 and not log.populate_step()
    finally:
        created.close()


def test_max_position_exceeded_at_the_last_term(shm: Path) -> None:
    # Start in the last term a 64 KiB log can reach: term count 2^31 - 1.
    log = make_log(shm, initial_term_count=INT32_MAX)
    appender = new_appender(log, ffi.new("int64_t *", UNLIMITED))
    assert log.producer_position() == max_possible_position(log.term_length) - log.term_length
    message = b"z" * 4000
    results = [lib.ss_offer(appender, message, len(message)) for _ in range(20)]
    assert MAX_POSITION_EXCEEDED in results
    assert all(r > 0 for r in results[:results.index(MAX_POSITION_EXCEEDED)])
    log.close()


def test_a_negative_term_count_another_process_wrote_refuses_appends_and_writes_nothing(
        shm: Path) -> None:
    """Every process of a stream maps its metadata writable: a negative active term count
    (no log has one) would index the partition before the first, and the 8 bytes there (the
    last of partition 2, ordinary log data) can be made to pass the term-id check."""
    log = make_log(shm, initial_term_id=7)
    appender = new_appender(log, ffi.new("int64_t *", UNLIMITED))
    assert offer(appender, b"before") > 0
    ffi.cast("int32_t *", log.meta + META_ACTIVE_TERM_COUNT)[0] = -1
    lying_tail = ffi.cast("int64_t *", log.meta - 8)
    lying_tail[0] = 6 << 32  # term id initial - 1 at offset 0: "term count -1"
    assert lib.ss_offer(appender, b"x" * 100, 100) == MAX_POSITION_EXCEEDED
    batch = b"y" * 300
    lengths = ffi.new("int32_t[3]", [100, 100, 100])
    result = ffi.new("int64_t *")
    assert lib.ss_offer_batch(appender, batch, len(batch), lengths, 3, result) == 0
    assert result[0] == MAX_POSITION_EXCEEDED
    assert lib.ss_try_claim(appender, 100, ffi.new("int64_t *")) == MAX_POSITION_EXCEEDED
    assert lying_tail[0] == 6 << 32  # no claim moved it
    log.close()


def test_term_ids_wrap_past_int32_max_as_the_appender_rotates(shm: Path) -> None:
    """An initial term id is random, so a stream may rotate from term id 2^31 - 1 to -2^31."""
    log = make_log(shm, initial_term_id=INT32_MAX - 1)
    appender = new_appender(log, ffi.new("int64_t *", UNLIMITED))
    per_term = log.term_length // 3040  # 3000 B and the header, aligned
    messages = [bytes([i]) * 3000 for i in range(2 * per_term + 5)]  # no partition reused
    for message in messages:
        assert offer(appender, message) > 0
    assert log.active_term_count == 2  # terms 2^31 - 2, 2^31 - 1, -2^31
    assert log.raw_tail(2) >> 32 == INT32_MIN  # the tail counter's term id, signed
    assert read_all(log) == messages
    log.close()


def test_a_dead_claimer_is_unblocked_with_padding(shm: Path) -> None:
    log = make_log(shm)
    appender = new_appender(log, ffi.new("int64_t *", UNLIMITED))
    offset = ffi.new("int64_t *")
    assert lib.ss_try_claim(appender, 100, offset) > 0  # claimed, never committed
    assert offer(appender, b"after") > 0
    assert read_all_available(log) == []  # readers wait behind the open claim
    assert unblock(log, 0, log.producer_position())
    assert read_all(log) == [b"after"]
    log.close()


def test_a_claimer_that_died_before_writing_its_header_is_unblocked(shm: Path) -> None:
    log = make_log(shm)
    tail = ffi.cast("int64_t *", log.meta)
    lib.ss_get_and_add_i64(tail, 96)  # claimed 96 bytes and died at once
    appender = new_appender(log, ffi.new("int64_t *", UNLIMITED))
    assert offer(appender, b"next") > 0
    assert unblock(log, 0, log.producer_position())
    assert read_all(log) == [b"next"]
    log.close()



def test_a_fragmented_message_whose_publisher_died_between_fragments_is_dropped(
        shm: Path) -> None:
    """The publisher claimed three fragments and died after writing the first: the unblock
    pads the rest, and what follows is read.  The half message is never delivered, and the
    reader no longer counts itself inside it (its available position reaches the end)."""
    log = make_log(shm, mtu=96)  # 64 B of payload per fragment
    tail = ffi.cast("int64_t *", log.meta)
    fragment = 96
    lib.ss_get_and_add_i64(tail, 3 * fragment)  # one message of three fragments, claimed
    struct.pack_into(DATA_HEADER.format, log.view, 0, fragment, CURRENT_VERSION, BEGIN_FLAG,
                     HDR_TYPE_DATA, 0, log.session_id, log.stream_id, log.initial_term_id, 0)
    appender = new_appender(log, ffi.new("int64_t *", UNLIMITED))
    assert offer(appender, b"next") > 0
    assert unblock(log, fragment, log.producer_position())  # the two fragments never written
    image = Image(log, ffi.new("int64_t *", 0), join_position=0)
    assert image.available_position() == log.producer_position()
    assert read_all(log) == [b"next"]
    log.close()

@pytest.mark.parametrize("read", ["poll", "poll_batch"])
def test_a_message_whose_lost_fragment_an_unreliable_image_padded_is_dropped_not_spliced(
        shm: Path, read: str) -> None:
    """An unreliable image (reliable=false) fills a gap it gives up on with padding.  A reader
    inside a message whose middle fragment was lost must drop it at that padding: the fast
    path skipped the padding without a word and appended the message's last fragment, or the
    next message, to the half-built one (an audit saw 5,000-byte messages delivered as 3,624
    and 7,752 bytes)."""
    log = make_log(shm, mtu=96)  # 64 B of payload per fragment
    fragment = 96
    lib.ss_get_and_add_i64(ffi.cast("int64_t *", log.meta), 5 * fragment)

    def write(offset: int, flags: int, fill: bytes, frame_type: int = HDR_TYPE_DATA) -> None:
        log.view[offset + 32:offset + fragment] = fill * (fragment - 32)
        struct.pack_into(DATA_HEADER.format, log.view, offset, fragment, CURRENT_VERSION, flags,
                         frame_type, offset, log.session_id, log.stream_id,
                         log.initial_term_id, 0)

    write(0, BEGIN_FLAG, b"a")  # message a: BEGIN, a middle fragment lost (96), END
    write(2 * fragment, END_FLAG, b"a")
    write(3 * fragment, BEGIN_FLAG, b"b")  # message b, whole
    write(4 * fragment, END_FLAG, b"b")
    image = Image(log, ffi.new("int64_t *", 0), join_position=0)
    got: list[bytes] = []

    def read_once() -> None:
        if read == "poll":
            image.poll(lambda data, header: got.append(bytes(data)), 10)
        else:
            batch = image.poll_batch(10)
            if batch is not None:
                got.extend(bytes(m) for m in batch)

    read_once()  # takes a's BEGIN and stops at the gap
    assert got == [] and image.position == fragment
    write(fragment, UNFRAGMENTED, b"\0", HDR_TYPE_PAD)  # the image gives the gap up
    for _ in range(10):
        read_once()
    assert got == [b"b" * 128]
    assert image.position == 5 * fragment
    log.close()


def test_a_peek_across_a_term_end_stops_at_its_limit_amid_fragmented_messages(
        shm: Path) -> None:
    """peek cuts its limit per term; the cold path (fragments) read on into the next term
    past it, to the next unfragmented frame (a Spark batch then had rows of the next
    batch: duplicates)."""
    log = make_log(shm)  # 64 KiB terms, mtu 1408: 3,000 bytes are three fragments
    appender = new_appender(log, ffi.new("int64_t *", UNLIMITED))
    messages = [bytes([i]) * 3000 for i in range(40)]
    ends = [offer(appender, message) and log.producer_position() for message in messages]
    start, limit = ends[17], ends[24]
    assert start < log.term_length < limit  # the range crosses the end of term 0
    image = Image(log, ffi.new("int64_t *", 0), join_position=0)
    got: list[bytes] = []
    assert image.peek(start, lambda data, header: got.append(bytes(data)), limit) == limit
    assert got == messages[18:25]
    log.close()


def read_all_available(log: LogBuffer) -> list[bytes]:
    image = Image(log, ffi.new("int64_t *", 0), join_position=0)
    out: list[bytes] = []
    image.poll(lambda data, header: out.append(bytes(data)), 1000)
    return out


def _append_from_process(path: str, writer: int, count: int, positions_path: str) -> None:
    log = LogBuffer(path)
    positions = []
    appender = new_appender(log, ffi.new("int64_t *", UNLIMITED))
    for sequence in range(count):
        size = 8 + (sequence * 37 + writer * 101) % 3000  # some fragment at mtu 1408
        body = struct.pack("<ii", writer, sequence) + bytes([writer]) * (size - 12)
        message = body + struct.pack("<I", zlib.crc32(body))
        while True:
            result = lib.ss_offer(appender, message, len(message))
            if result > 0:
                positions.append(result)
                break
            assert result == ADMIN_ACTION
    Path(positions_path).write_text(" ".join(map(str, positions)))
    log.close()


def test_concurrent_appends_from_several_processes_never_corrupt_or_lose_a_frame(shm: Path) -> None:
    writers, per_writer = 4, 3000
    log = make_log(shm, term_length=16 << 20)  # ~18 MB in all: no wrap without a reader
    context = multiprocessing.get_context("fork")
    position_files = [str(shm / f"positions-{w}") for w in range(writers)]
    processes = [context.Process(target=_append_from_process,
                                 args=(str(log.path), w, per_writer, position_files[w]))
                 for w in range(writers)]
    for p in processes:
        p.start()
    for p in processes:
        p.join(60)
        assert p.exitcode == 0
    messages = read_all(log)
    assert len(messages) == writers * per_writer
    # Each offer returned the position just after its own frame: all distinct, all frame ends.
    returned = [int(p) for f in position_files for p in Path(f).read_text().split()]
    frame_ends: list[int] = []
    image = Image(log, ffi.new("int64_t *", 0), join_position=0)
    while image.poll(lambda data, header: frame_ends.append(header.position), 1000):
        pass
    assert sorted(returned) == frame_ends
    next_sequence = [0] * writers
    for message in messages:
        body, crc = message[:-4], struct.unpack("<I", message[-4:])[0]
        assert zlib.crc32(body) == crc, "a frame was corrupted"
        writer, sequence = struct.unpack_from("<ii", body)
        assert sequence == next_sequence[writer], "a writer's messages were lost or reordered"
        next_sequence[writer] += 1
    log.close()


@pytest.mark.parametrize("frame_length", [0x7FFFFFF0, 0x7FFFFFFF, TERM_MIN_LENGTH + 32])
@pytest.mark.parametrize("frame_type", [HDR_TYPE_DATA, HDR_TYPE_PAD])
def test_a_lying_frame_length_in_a_log_stops_every_scan_and_never_wraps(
        frame_length: int, frame_type: int) -> None:
    """Frame lengths in a log come from another process: a scan stops at one that would
    cross the term's end (near 2^31 it would overflow align32 and run backwards)."""
    term = bytearray(TERM_MIN_LENGTH)
    FRAME_HEADER.pack_into(term, 64, frame_length, CURRENT_VERSION, UNFRAGMENTED, frame_type)
    # one good frame before it
    FRAME_HEADER.pack_into(term, 0, 64, CURRENT_VERSION, UNFRAGMENTED, HDR_TYPE_DATA)
    pointer = ffi.from_buffer(term)
    padding = ffi.new("int32_t *")
    assert lib.ss_scan_for_availability(pointer, 0, 1408, TERM_MIN_LENGTH, padding) == 64
    assert lib.ss_scan_for_availability(pointer, 64, 1408, TERM_MIN_LENGTH, padding) == 0
    starts, ends, next_offset = (ffi.new("int32_t[8]"), ffi.new("int32_t[8]"),
                                 ffi.new("int32_t *"))
    assert lib.ss_term_read(pointer, 0, TERM_MIN_LENGTH, 8, starts, ends, next_offset) == 1
    assert next_offset[0] == 64
    # Started at the lying frame itself: the caller's cold path (-1), which checks it again.
    assert lib.ss_term_read(pointer, 64, TERM_MIN_LENGTH, 8, starts, ends, next_offset) == -1
    assert next_offset[0] == 64
    gap_length = ffi.new("int32_t *")
    assert lib.ss_scan_gap(pointer, 0, TERM_MIN_LENGTH, gap_length) == 64


def test_filling_a_dense_logs_pages_leaves_the_processs_other_threads_running(
        shm: Path) -> None:
    # The driver creates logs on its conductor thread while its network thread moves data:
    # the page fill must not hold the GIL (it did, through mmap.madvise: 60 ms per 192 MiB).
    stamps: list[int] = []
    done = threading.Event()

    def ticker() -> None:
        while not done.is_set():
            stamps.append(time.monotonic_ns())
            time.sleep(0.0002)

    thread = threading.Thread(target=ticker)
    thread.start()
    try:
        time.sleep(0.01)
        started = time.monotonic_ns()
        log = LogBuffer.create(shm / "dense.log", term_length=64 * 1024 * 1024,
                               initial_term_id=0, session_id=1, stream_id=1, mtu=1408,
                               correlation_id=1, sparse=False)
        took = time.monotonic_ns() - started
        log.close()
    finally:
        done.set()
        thread.join()
    during = [t for t in stamps if started <= t <= started + took]
    gaps = [b - a for a, b in zip([started, *during], [*during, started + took], strict=True)]
    # Held, the GIL stopped the other thread for about half of the creation (the page fill;
    # fallocate is the rest); released, its longest pause is the scheduler's (< 5 %).
    assert max(gaps) < took / 4, (f"the other thread stood still {max(gaps) / 1e6:.1f} ms of "
                                  f"the {took / 1e6:.1f} ms the log took")


def test_a_borrowed_handle_reads_the_same_mapping_and_closing_it_leaves_the_mapping(
        shm: Path) -> None:
    log = make_log(shm)
    appender = new_appender(log, ffi.new("int64_t *", UNLIMITED))
    assert offer(appender, b"first") > 0
    borrowed = log.borrowed()
    assert borrowed.address == log.address  # one mapping: the pages are held once
    image = Image(borrowed, ffi.new("int64_t *", 0), join_position=0)
    seen: list[bytes] = []
    image.poll(lambda data, header: seen.append(bytes(data)), 10)
    image.close()  # as a reader whose image went: the owner's mapping stays
    assert borrowed.closed and not log.closed
    assert offer(appender, b"second") > 0
    assert seen == [b"first"] and read_all(log) == [b"first", b"second"]
    log.close()


def test_a_term_read_that_starts_at_a_fragment_says_so_and_one_that_reaches_it_stops_before():
    """ss_term_read returns -1 only when the frame at its start is committed but not one it
    takes (a fragment: the poll's cold path assembles it); a scan that reaches a fragment
    after whole frames or padding returns what it read and stops there."""
    term = bytearray(TERM_MIN_LENGTH)
    FRAME_HEADER.pack_into(term, 0, 40, CURRENT_VERSION, UNFRAGMENTED, HDR_TYPE_DATA)
    FRAME_HEADER.pack_into(term, 64, 64, CURRENT_VERSION, 0, HDR_TYPE_PAD)
    FRAME_HEADER.pack_into(term, 128, 96, CURRENT_VERSION, BEGIN_FLAG, HDR_TYPE_DATA)
    pointer = ffi.from_buffer(term)
    starts, ends, next_offset = (ffi.new("int32_t[8]"), ffi.new("int32_t[8]"),
                                 ffi.new("int32_t *"))
    assert lib.ss_term_read(pointer, 0, TERM_MIN_LENGTH, 8, starts, ends, next_offset) == 1
    assert (starts[0], ends[0], next_offset[0]) == (32, 40, 128)
    assert lib.ss_term_read(pointer, 64, TERM_MIN_LENGTH, 8, starts, ends, next_offset) == 0
    assert next_offset[0] == 128  # over the padding, stopped before the fragment
    assert lib.ss_term_read(pointer, 128, TERM_MIN_LENGTH, 8, starts, ends, next_offset) == -1
    assert next_offset[0] == 128
    assert lib.ss_term_read(pointer, 128, TERM_MIN_LENGTH, 0, starts, ends, next_offset) == 0
    assert lib.ss_term_read(pointer, 224, TERM_MIN_LENGTH, 8, starts, ends, next_offset) == 0


def test_an_image_says_what_its_log_is_and_where_its_frames_are(shm: Path) -> None:
    """What retention and replay read of an image: its log's identity, the producer
    position, a frame's header by position, a reader of its own position, and a detached
    image's mapping, which closing it releases."""
    log = make_log(shm, initial_term_id=-5)
    appender = new_appender(log, ffi.new("int64_t *", UNLIMITED))
    first = offer(appender, b"x" * 2000)  # fragmented with an MTU of 1408
    assert offer(appender, b"second") > first
    image = Image.detached(str(log.path), 0)
    try:
        assert image.identity == LogIdentity(42, -5, TERM_MIN_LENGTH, stream_id=1001, mtu=1408)
        assert image.identity.framing == (-5, TERM_MIN_LENGTH)
        assert image.producer_position() == log.producer_position()
        length, _, _, _, term_offset, session, stream, term_id = image.frame_header(first)[:8]
        assert (length, term_offset, session, stream, term_id) == (
            HEADER_LENGTH + len(b"second"), first, 42, 1001, -5)
        reader = image.reader_at(first)
        reader.poll(lambda data, header: None, 10)
        assert reader.position == log.producer_position() and image.position == 0
        image.poll(lambda data, header: None, 1)  # the first fragment only
        assert not image.at_message_boundary
        image.check_retained(first)
    finally:
        image.close()
    assert image.log_buffer.closed and not log.closed
    log.close()


def test_an_image_refuses_reads_once_closed_and_its_readers_leave_its_mapping(
        shm: Path) -> None:
    """A closed image's log is unmapped: what reads it raises ClosedError (the producer
    position read the unmapped page and crashed the process); a reader_at() reader borrows the
    mapping, and closing it leaves the image's alone."""
    log = make_log(shm)
    appender = new_appender(log, ffi.new("int64_t *", UNLIMITED))
    offer(appender, b"first")
    image = Image.detached(str(log.path), 0)
    reader = image.reader_at(0)
    reader.close()
    assert not image.log_buffer.closed
    assert image.frame_header(0)[0] == HEADER_LENGTH + len(b"first")
    image.close()
    for read in (image.producer_position, lambda: image.frame_header(0),
                 lambda: image.check_retained(0)):
        with pytest.raises(ClosedError):
            read()
    log.close()
