"""Exclusive publications (``Client.add_exclusive_publication``, Aeron's ExclusivePublication):
one writer, a claim by a release store of the term's tail rather than an atomic add, a
publication, session and log of its own per add; the frames, positions and codes of a shared
publication.  Over real shared-memory logs (one in-process check that the two appenders write
the same bytes, then real drivers: IPC, and UDP between two drivers)."""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing
import struct
import threading
import time
from array import array
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import IPC_CHANNEL, SEQUENCE, Collector, connect, free_port, message, stream, wait_for
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slipstream.client import (
    ADMIN_ACTION,
    BACK_PRESSURED,
    MAX_POSITION_EXCEEDED,
    BufferClaim,
    ChannelError,
    Client,
    ExclusivePublication,
    Publication,
    Subscription,
    control,
)
from slipstream.client._native import ffi, lib
from slipstream.client.counters import CountersFile, CounterType
from slipstream.client.errors import InvalidArgumentError
from slipstream.client.layout import (
    FRAME_ALIGNMENT,
    HDR_TYPE_DATA,
    HDR_TYPE_PAD,
    HEADER_LENGTH,
    META_LIMIT_HIT_TIME,
    TERM_MIN_LENGTH,
    UNFRAGMENTED,
)
from slipstream.client.logbuffer import LogBuffer, new_appender

FIXTURE_OK = [HealthCheck.function_scoped_fixture]
_STREAMS = itertools.count(5000)  # hypothesis runs every example in one driver


# -- the appender: the same bytes as a shared one's ------------------------------------------
OFFER = st.tuples(st.just("offer"), st.integers(0, 3000), st.integers(-2**63, 2**63 - 1))
BATCH = st.tuples(st.just("batch"), st.lists(st.integers(0, 1500), min_size=1, max_size=40),
                  st.booleans())
CLAIM = st.tuples(st.just("claim"), st.integers(0, 1376), st.booleans())
LIMIT = st.tuples(st.just("limit"), st.integers(0, 3 * TERM_MIN_LENGTH))


@pytest.mark.unit
@settings(max_examples=60, deadline=None, suppress_health_check=FIXTURE_OK)
@given(steps=st.lists(st.one_of(OFFER, BATCH, CLAIM, LIMIT), min_size=1, max_size=120),
       start_term_count=st.sampled_from([0, 5, 2**31 - 2]),
       start_offset=st.sampled_from([0, 4096, TERM_MIN_LENGTH - 64]))
def test_an_exclusive_appender_writes_byte_for_byte_what_a_shared_one_writes(
        shm: Path, steps: list[tuple], start_term_count: int, start_offset: int) -> None:
    """Offers (fragmented too, with reserved values), batches, claims committed and aborted,
    back pressure, term rotations and the stream's last term (MAX_POSITION_EXCEEDED): the
    exclusive appender returns what the shared one returns and leaves the same log, tail
    counters and term count included."""
    logs, appenders = [], []
    limit = ffi.new("int64_t *")
    start = start_term_count * TERM_MIN_LENGTH + start_offset
    limit[0] = start + TERM_MIN_LENGTH
    for exclusive in (0, 1):
        log = LogBuffer.create(shm / f"{exclusive}-{time.monotonic_ns()}.logbuffer",
                               term_length=TERM_MIN_LENGTH, initial_term_id=-7,
                               session_id=11, stream_id=12, mtu=1408, correlation_id=1,
                               initial_term_count=start_term_count,
                               initial_term_offset=start_offset)
        log.is_connected = True
        appender = new_appender(log, limit)
        appender.exclusive = exclusive
        logs.append(log)
        appenders.append(appender)
    results: list[list[object]] = [[], []]
    offset = ffi.new("int64_t *")
    batch_result = ffi.new("int64_t *")
    try:
        for number, step in enumerate(steps):
            if step[0] == "limit":
                limit[0] = logs[0].producer_position() + step[1]
                continue
            for side, (log, appender) in enumerate(zip(logs, appenders, strict=True)):
                if step[0] == "offer":
                    data = bytes([number % 251]) * step[1]
                    result = lib.ss_offer_rv(appender, data, len(data), step[2])
                elif step[0] == "batch":
                    lengths = array("i", step[1])
                    values = array("q", [number * 1000 + k for k in range(len(lengths))])
                    data = bytes(range(256)) * (sum(lengths) // 256 + 1)
                    with ffi.from_buffer("int32_t[]", lengths) as sizes, \
                            ffi.from_buffer("int64_t[]", values) as reserved:
                        done = lib.ss_offer_batch_rv(appender, data, len(data), sizes,
                                                     reserved if step[2] else ffi.NULL,
                                                     len(lengths), batch_result)
                    result = (done, batch_result[0])
                else:  # a claim, committed or aborted
                    result = lib.ss_try_claim(appender, step[1], offset)
                    if result > 0:
                        frame = log.address + offset[0]
                        log.view[offset[0] + 32:offset[0] + 32 + step[1]] = bytes(
                            [number % 251]) * step[1]
                        if step[2]:
                            assert lib.ss_commit(appender, frame, 32 + step[1]) == 1
                        else:
                            assert lib.ss_abort(appender, frame, 32 + step[1]) == 1
                results[side].append(result)
            assert results[0][-1] == results[1][-1], f"step {number} {step[0]}"
        contents = [bytearray(log.view) for log in logs]
        for content in contents:  # when the limit was last hit: a clock's reading, not data
            hit_time = 3 * TERM_MIN_LENGTH + META_LIMIT_HIT_TIME
            content[hit_time:hit_time + 8] = bytes(8)
        assert contents[0] == contents[1]
    finally:
        for log in logs:
            log.close()


@pytest.mark.unit
def test_the_last_term_ends_an_exclusive_stream_with_max_position_exceeded(shm: Path) -> None:
    log = LogBuffer.create(shm / "last.logbuffer", term_length=TERM_MIN_LENGTH,
                           initial_term_id=0, session_id=1, stream_id=2, mtu=1408,
                           correlation_id=1, initial_term_count=2**31 - 1)
    log.is_connected = True
    appender = new_appender(log, ffi.new("int64_t *", 1 << 62))
    appender.exclusive = 1
    data = bytes(992)
    taken = 0
    while (result := lib.ss_offer(appender, data, len(data))) > 0:
        taken += 1
    assert taken == TERM_MIN_LENGTH // 1024
    assert result == MAX_POSITION_EXCEEDED
    assert lib.ss_offer(appender, data, len(data)) == MAX_POSITION_EXCEEDED  # and stays so
    assert log.producer_position() == TERM_MIN_LENGTH << 31
    log.close()


# -- through a driver: sessions, images, the stream ------------------------------------------
def test_two_exclusive_adds_are_two_sessions_and_a_shared_add_joins_neither(
        client: Client) -> None:
    subscription = client.add_subscription(IPC_CHANNEL, 1101)
    first = client.add_exclusive_publication(IPC_CHANNEL, 1101)
    second = client.add_exclusive_publication(IPC_CHANNEL, 1101)
    shared = client.add_publication(IPC_CHANNEL, 1101)
    joined = client.add_publication(IPC_CHANNEL, 1101)
    assert isinstance(first, ExclusivePublication) and not isinstance(shared, ExclusivePublication)
    assert isinstance(first, Publication)
    assert len({first.session_id, second.session_id, shared.session_id}) == 3
    assert joined.session_id == shared.session_id
    assert repr(first).startswith("ExclusivePublication(")
    wait_for(lambda: len(subscription.images) == 3)
    assert {i.session_id for i in subscription.images} == {
        first.session_id, second.session_id, shared.session_id}
    late = client.add_subscription(IPC_CHANNEL, 1101)  # joins every publication of the stream
    assert {i.session_id for i in late.images} == {
        first.session_id, second.session_id, shared.session_id}
    late.close()  # (it would hold every publisher back a window on)
    got: dict[int, list[int]] = {}

    def handler(data: memoryview, header) -> None:
        got.setdefault(header.session_id, []).append(SEQUENCE.unpack_from(data)[0])

    publications = (first, second, shared, joined)
    deadline = time.monotonic() + 30
    for seq in range(300):
        for publication in publications:
            while publication.offer(message(seq, 40)) < 0:
                assert time.monotonic() < deadline, f"message {seq} not taken"
                subscription.poll(handler, 100)
    while subscription.poll(handler, 100):
        pass
    assert got[first.session_id] == list(range(300))
    assert got[second.session_id] == list(range(300))
    shared_seen = got[shared.session_id]  # two publishers, one log: each message once
    assert sorted(shared_seen) == sorted(list(range(300)) * 2)


def test_a_session_id_an_open_publication_of_the_stream_has_is_refused_by_name(
        client: Client) -> None:
    """Aeron's session clash: an exclusive publication never shares its session, nor does a
    shared one take an exclusive one's; another session, or another stream, is free."""
    client.add_exclusive_publication("aeron:ipc?session-id=4242", 1102)
    for add in (client.add_exclusive_publication, client.add_publication):
        with pytest.raises(ChannelError, match="session-id") as refused:
            add("aeron:ipc?session-id=4242", 1102)
        assert refused.value.part == "session-id"
    assert client.add_exclusive_publication("aeron:ipc?session-id=4243", 1102).session_id == 4243
    assert client.add_exclusive_publication("aeron:ipc?session-id=4242", 1103).session_id == 4242
    shared = client.add_publication("aeron:ipc?session-id=4244", 1102)
    with pytest.raises(ChannelError, match="session-id"):
        client.add_exclusive_publication(f"{IPC_CHANNEL}?session-id=4244", 1102)
    assert client.add_publication(f"{IPC_CHANNEL}?session-id=4244", 1102).session_id == \
        shared.session_id  # a shared add still joins


@pytest.mark.parametrize("uri", [
    "aeron:ipc?term-length=128k|mtu=4096",
    "aeron:ipc?sparse=true|policy=drop-newest",
    "aeron:ipc?init-term-id=5|term-id=7|term-offset=1024",
    "aeron:udp?endpoint=127.0.0.1:{port}|linger=0|eos=false|term-length=64k",
    "aeron:udp?endpoint=127.0.0.1:{port}|term-length=64k|init-term-id=-3|term-id=-1|"
    "term-offset=64|pub-wnd=16k",
    "aeron:udp?endpoint=224.0.1.1:{port}|fc=min|term-length=64k|ttl=0",
])
def test_an_exclusive_add_takes_every_uri_a_shared_add_takes(client: Client, uri: str) -> None:
    uri = uri.format(port=free_port())
    shared = client.add_publication(uri, 1104)
    exclusive = client.add_exclusive_publication(uri, 1104)
    assert exclusive.session_id != shared.session_id
    assert (exclusive.term_length, exclusive.max_payload_length, exclusive.position) == (
        shared.term_length, shared.max_payload_length, shared.position)
    if "init-term-id" in uri:  # else each draws its own
        assert exclusive.initial_term_id == shared.initial_term_id


OFFER_STEP = st.tuples(st.just("offer"), st.integers(8, 5000), st.integers(-2**63, 2**63 - 1))
BATCH_STEP = st.tuples(st.just("batch"), st.lists(st.integers(8, 2000), min_size=1, max_size=50))
CLAIM_STEP = st.tuples(st.just("claim"), st.integers(8, 1376), st.booleans())
FILL_STEP = st.tuples(st.just("fill"), st.sampled_from([8, 100, 992, 3000]))
POLL_STEP = st.tuples(st.just("poll"), st.integers(1, 200))


class _Reader:
    """A subscriber's view: (sequence, reserved value) in arrival order, and torn messages."""

    def __init__(self, subscription) -> None:
        self.subscription = subscription
        self.seen: list[tuple[int, int]] = []
        self.torn = 0

    def on_message(self, data: memoryview, header) -> None:
        seq = SEQUENCE.unpack_from(data)[0]
        self.torn += SEQUENCE.unpack_from(data, len(data) - 4)[0] != seq
        self.seen.append((seq, header.reserved_value))

    def poll(self, limit: int) -> int:
        return self.subscription.poll(self.on_message, limit)


@contextlib.contextmanager
def _exclusive_ipc_stream(client: Client) -> Iterator[tuple[ExclusivePublication, Subscription]]:
    """An exclusive publication on IPC_CHANNEL and a subscription of it, on a stream of their
    own, connected: (publication, subscription); both closed at the end."""
    stream_id = next(_STREAMS)
    subscription = client.add_subscription(IPC_CHANNEL, stream_id)
    publication = client.add_exclusive_publication(IPC_CHANNEL, stream_id)
    try:
        connect(publication, subscription)
        yield publication, subscription
    finally:
        publication.close()
        subscription.close()


@settings(max_examples=25, deadline=None, suppress_health_check=FIXTURE_OK)
@given(steps=st.lists(st.one_of(OFFER_STEP, BATCH_STEP, CLAIM_STEP, FILL_STEP, POLL_STEP),
                      min_size=1, max_size=40))
def test_an_exclusive_publications_messages_arrive_exactly_once_and_in_order(
        client: Client, steps: list[tuple]) -> None:
    """Offers (fragmented ones too), batches, claims committed and aborted, reserved values,
    and runs to the back-pressured limit (the test driver's IPC terms are 64 KiB, its window
    32 KiB, so the terms rotate and every partition is reused): a subscriber reads each
    message once, in order, whole, with its reserved value."""
    with _exclusive_ipc_stream(client) as (publication, subscription):
        reader = _Reader(subscription)
        expected: list[tuple[int, int]] = []

        def offered(result: int, seq: int, value: int) -> None:
            if result > 0:
                expected.append((seq, value))

        claim = BufferClaim()
        start = publication.position
        # Whatever the steps: then nine fills to the limit, each read to its end, so that
        # every example rotates the terms and reuses a partition.
        tail = [("fill", 333), ("poll", 10_000), ("fill", 1000), ("poll", 10_000),
                ("fill", 2000), ("poll", 10_000)] * 3
        for step in [*steps, *tail]:
            seq = len(expected)
            if step[0] == "offer":
                while (result := publication.offer(message(seq, step[1]), step[2])) \
                        == ADMIN_ACTION:
                    pass
                offered(result, seq, step[2])
            elif step[0] == "batch":
                data = b"".join(message(seq + k, size) for k, size in enumerate(step[1]))
                values = [seq + k for k in range(len(step[1]))]
                done = publication.offer_batch(data, step[1], values)
                for k in range(max(done, 0)):
                    expected.append((seq + k, seq + k))
            elif step[0] == "claim":
                while (result := publication.try_claim(step[1], claim)) == ADMIN_ACTION:
                    pass
                if result > 0:
                    claim.buffer[:] = message(seq, step[1])
                    claim.reserved_value = -seq
                    if step[2]:
                        claim.commit()
                        expected.append((seq, -seq))
                    else:
                        claim.abort()
            elif step[0] == "fill":  # to the limit, nobody reading
                while True:
                    seq = len(expected)
                    limit = publication.publication_limit  # (the driver may raise it after)
                    result = publication.offer(message(seq, step[1]))
                    if result == ADMIN_ACTION:
                        continue
                    if result < 0:
                        break
                    expected.append((seq, 0))
                assert result == BACK_PRESSURED
                assert publication.position >= limit
            elif step[1] <= 1000:  # poll, up to step[1] fragments
                reader.poll(step[1])
            else:  # the tail's: read to the end, then the credit back before the next step
                wait_for(lambda: (reader.poll(1000),
                                  subscription.images[0].position >= publication.position)[1],
                         what="the subscriber at the end of the stream")
                wait_for(lambda: publication.publication_limit > publication.position,
                         what="the driver raised the limit")
        assert publication.position - start > 3 * publication.term_length
        deadline = time.monotonic() + 10
        while len(reader.seen) < len(expected):
            assert time.monotonic() < deadline, f"{len(reader.seen)} of {len(expected)}"
            subscription.receive(reader.on_message, 1000, timeout=0.5)
        assert reader.poll(1000) == 0
        assert reader.torn == 0
        assert reader.seen == expected


def test_a_claim_commits_and_aborts_on_an_exclusive_publication(client: Client) -> None:
    subscription = client.add_subscription(IPC_CHANNEL, 1105)
    publication = client.add_exclusive_publication(IPC_CHANNEL, 1105)
    connect(publication, subscription)
    got: list[tuple[bytes, int]] = []

    def handler(data: memoryview, header) -> None:
        got.append((bytes(data), header.reserved_value))

    claim = BufferClaim()
    with claim:
        assert publication.try_claim(5, claim) > 0
        claim.buffer[:] = b"first"
        claim.reserved_value = 77
    assert publication.try_claim(7, claim) > 0
    claim.buffer[:] = b"dropped"
    claim.abort()
    before = publication.position
    assert publication.try_claim(4, claim) == before + 64
    claim.buffer[:] = b"last"
    assert claim.commit()
    while subscription.poll(handler, 10):
        pass
    assert got == [(b"first", 77), (b"last", 0)]
    assert subscription.images[0].position == publication.position


# -- resources -------------------------------------------------------------------------------
def _logs(directory: Path) -> list[Path]:
    return list((directory / control.PUBLICATIONS_DIR).iterdir())


def _publisher_limits(directory: Path) -> int:
    counters = CountersFile(directory / control.COUNTERS_FILE, writable=False)
    try:
        return sum(1 for c in counters if c.type_id == CounterType.PUBLISHER_LIMIT)
    finally:
        counters.close()


def _publish_and_hang(directory: str, uri: str, ready) -> None:
    client = Client.connect(directory)
    for publication in (client.add_exclusive_publication(IPC_CHANNEL, 1107),
                        client.add_exclusive_publication(uri, 1107)):
        publication.offer(b"nobody reads this")
    ready.set()
    time.sleep(3600)  # killed here


def test_closing_an_exclusive_publication_or_killing_its_client_frees_its_log(launch) -> None:
    driver = launch()
    uri = f"aeron:udp?endpoint=127.0.0.1:{free_port()}"
    with Client.connect(driver.directory) as client:
        subscription = client.add_subscription(IPC_CHANNEL, 1106)
        publication = client.add_exclusive_publication(IPC_CHANNEL, 1106)
        network = client.add_exclusive_publication(uri, 1106)
        connect(publication, subscription)
        assert len(_logs(driver.directory)) == 2
        for n in range(100):
            assert publication.offer(message(n, 100)) > 0
        publication.close()
        network.close()
        collector = Collector(subscription)
        wait_for(lambda: (collector.poll(), len(collector.seen) >= 100)[1],
                 what="the subscriber read the closed publication to its end")
        collector.assert_exactly(100)
        wait_for(lambda: not _logs(driver.directory), what="the closed publications' logs freed")
        assert _publisher_limits(driver.directory) == 0
        # A client that dies holding them (and an open claim): timed out, its logs freed.
        context = multiprocessing.get_context("spawn")
        ready = context.Event()
        victim = context.Process(target=_publish_and_hang,
                                 args=(str(driver.directory), uri, ready))
        victim.start()
        try:
            assert ready.wait(30)
            assert len(_logs(driver.directory)) == 2
        finally:
            victim.kill()
            victim.join()
        wait_for(lambda: not _logs(driver.directory), timeout=10,
                 what="the dead client's exclusive logs freed")
        assert _publisher_limits(driver.directory) == 0


# -- UDP -------------------------------------------------------------------------------------
def test_over_udp_exclusive_publications_reach_a_real_subscriber_exactly_once_in_order(
        launch) -> None:
    """Two drivers on loopback, 64 KiB terms: one exclusive publication's stream checked
    message by message (small, MTU-sized and fragmented messages, many term rotations), then
    a second exclusive add of the same channel: a second session and image."""
    uri = f"aeron:udp?endpoint=127.0.0.1:{free_port()}"
    a, b = launch(), launch()
    with Client.connect(a.directory) as ca, Client.connect(b.directory) as cb:
        subscription = cb.add_subscription(uri, 1201)
        first = ca.add_exclusive_publication(uri, 1201)
        connect(first, subscription)
        collector = Collector(subscription)
        stream(first, [collector], 20_000, lambda i: (32, 1376, 5000, 200)[i % 4])
        collector.assert_exactly(20_000)
        second = ca.add_exclusive_publication(uri, 1201)
        assert second.session_id != first.session_id
        wait_for(lambda: len(subscription.images) == 2 and second.is_connected,
                 what="the second session's image")
        got: dict[int, list[int]] = {}

        def handler(data: memoryview, header) -> None:
            got.setdefault(header.session_id, []).append(SEQUENCE.unpack_from(data)[0])

        sent = {first.session_id: 20_000, second.session_id: 0}
        deadline = time.monotonic() + 30
        while len(got.get(second.session_id, ())) < 5000:
            assert time.monotonic() < deadline, {k: len(v) for k, v in got.items()}
            for publication in (first, second):
                while sent[publication.session_id] < 25_000 and publication.offer(
                        message(sent[publication.session_id], 300)) > 0:
                    sent[publication.session_id] += 1
            if not subscription.poll(handler, 1000):
                time.sleep(0)
        assert got[second.session_id][:5000] == list(range(5000))
        assert got[first.session_id] == list(range(20_000, 20_000 + len(got[first.session_id])))


# -- offer_block ----------------------------------------------------------------------------
_DATA_HEADER = struct.Struct("<iBBHiiiiq")  # docs/PROTOCOL.md §1.2


def _block(publication: ExclusivePublication, messages: list[tuple[int, int]], *,
           pad_to_term_end: bool = False, session_id: int | None = None,
           offset_error: int = 0) -> bytes:
    """Whole frames at the publication's position: each (sequence, size) a DATA frame with
    the sequence as its reserved value, then (``pad_to_term_end``) padding to the term's end."""
    term_length = publication.term_length
    position = publication.position
    offset = position & (term_length - 1)
    log = publication._log
    term_id = log.initial_term_id + (position >> log.position_bits)
    session = publication.session_id if session_id is None else session_id
    out = bytearray()
    for seq, size in messages:
        payload = message(seq, size)
        length = HEADER_LENGTH + len(payload)
        frame = bytearray(_DATA_HEADER.pack(
            length, 0, UNFRAGMENTED, HDR_TYPE_DATA, offset + len(out) + offset_error, session,
            publication.stream_id, term_id, seq)) + payload
        out += frame + bytes(-len(frame) % FRAME_ALIGNMENT)
    if pad_to_term_end:
        at = offset + len(out)
        out += _DATA_HEADER.pack(term_length - at, 0, UNFRAGMENTED, HDR_TYPE_PAD, at, session,
                                 publication.stream_id, term_id, 0)
        out += bytes(term_length - at - HEADER_LENGTH)
    return bytes(out)


def test_offer_block_appends_whole_frames_over_term_rotations(client: Client) -> None:
    """Blocks of frames written by the caller, each at the publication's position, the last
    of each term padded to its end: a subscriber reads every message once, in order, with the
    reserved value each frame carries; the terms (64 KiB) rotate several times."""
    with _exclusive_ipc_stream(client) as (publication, subscription):
        reader = _Reader(subscription)
        seq = 0
        start = publication.position
        while publication.position - start < 4 * publication.term_length:
            offset = publication.position & (publication.term_length - 1)
            sizes = [(seq + k, 100 + (seq + k) % 900) for k in range(8)]
            block = _block(publication, sizes)
            end_of_term = offset + len(block) + 2048 > publication.term_length
            if end_of_term:  # a message, then padding to the term's end
                sizes = sizes[:1]
                block = _block(publication, sizes, pad_to_term_end=True)
            while (result := publication.offer_block(block)) == BACK_PRESSURED:
                reader.poll(1000)
            assert result > 0 and result == publication.position
            seq += len(sizes)
            reader.poll(1000)
        wait_for(lambda: reader.poll(1000) >= 0 and len(reader.seen) == seq,
                 what="every message read")
        assert reader.torn == 0 and reader.seen == [(k, k) for k in range(seq)]


def test_offer_block_refuses_a_block_that_is_not_whole_frames_of_its_own(client: Client,
                                                                         ) -> None:
    """Another session, a frame at the wrong term offset, a cut frame, padding inside the
    term, a block past the term's end: refused by name, nothing appended, and a good block
    then goes (a shared publication, many writers, has no offer_block)."""
    with _exclusive_ipc_stream(client) as (publication, subscription):
        position = publication.position
        good = _block(publication, [(0, 200), (1, 300)])
        first = _block(publication, [(0, 200)])
        term_id = _DATA_HEADER.unpack_from(first)[7]
        pad_inside = first + _DATA_HEADER.pack(
            64, 0, UNFRAGMENTED, HDR_TYPE_PAD, (position & (publication.term_length - 1))
            + len(first), publication.session_id, publication.stream_id, term_id, 0) + bytes(32)
        too_long = _block(publication, [(0, publication._log.mtu - HEADER_LENGTH + 8)])
        for bad in (_block(publication, [(0, 200)], session_id=publication.session_id + 1),
                    _block(publication, [(0, 200)], offset_error=32), good[:-32], good[:40],
                    pad_inside, too_long, _block(publication, [(k, 1000) for k in range(70)])):
            with pytest.raises(InvalidArgumentError) as refused:
                publication.offer_block(bad)
            assert refused.value.field == "block"
            assert publication.position == position
        shared = client.add_publication(IPC_CHANNEL, publication.stream_id)
        assert not hasattr(shared, "offer_block")
        assert publication.offer_block(good) == position + len(good)
        reader = _Reader(subscription)
        wait_for(lambda: reader.poll(10) >= 0 and len(reader.seen) == 2, what="the block read")
        assert reader.seen == [(0, 0), (1, 1)]


def test_await_credit_parks_until_the_subscriber_frees_the_window(client: Client) -> None:
    """A back-pressured publication (a subscriber that reads nothing, the window full
    across several offers) has no credit, and await_credit waits out its timeout; once the
    subscriber reads, the driver moves the limit and wakes the wait long before its
    timeout (the archive's replays wait for their credit so, not by polling)."""
    subscription = client.add_subscription("aeron:ipc", 4001)
    publication = client.add_exclusive_publication("aeron:ipc", 4001)
    connect(publication, subscription)
    payload = bytes(1000)
    offers = 0
    while publication.offer(payload) > 0:
        offers += 1
    assert offers > 3
    assert not publication.has_credit
    started = time.monotonic()
    assert not publication.await_credit(50_000_000)
    assert time.monotonic() - started >= 0.045
    reader = threading.Timer(0.1, lambda: subscription.poll(lambda *a: None, 1 << 20))
    reader.start()
    started = time.monotonic()
    try:
        assert publication.await_credit(10_000_000_000)
    finally:
        reader.join()
    assert time.monotonic() - started < 5.0
    assert publication.has_credit
    for bad in (-1, 1.5, True, None):
        with pytest.raises(InvalidArgumentError) as refused:
            publication.await_credit(bad)  # type: ignore[arg-type]
        assert refused.value.field == "timeout_ns"
    publication.close()
    assert publication.has_credit and publication.await_credit(1)
