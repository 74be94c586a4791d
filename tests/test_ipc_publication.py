"""The driver's side of an IPC log, sans-I/O: limits, cleaning and partition reuse.

These run one IpcPublication with a publisher's appender and a subscriber's Image in one
process, calling the duty cycle by hand, so cleaning can be made to lag on purpose.
"""

from __future__ import annotations

import random
import struct
import uuid
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slipstream.client._native import lib
from slipstream.client.channel import parse_channel
from slipstream.client.counters import CountersFile
from slipstream.client.image import Image
from slipstream.client.layout import (
    FRAME_ALIGNMENT,
    META_ACTIVE_TERM_COUNT,
    META_TAIL_COUNTERS,
    PARTITION_COUNT,
    TERM_MIN_LENGTH,
)
from slipstream.client.logbuffer import (
    compute_term_offset,
    index_by_position,
    new_appender,
    pack_tail,
)
from slipstream.client.publication import ADMIN_ACTION
from slipstream.daemon.conductor.conductor import Subscription
from slipstream.daemon.conductor.ipc import IpcPublication

SEQUENCE = struct.Struct("<q")


def make_publication(directory: Path, *, term_length: int, clean_chunk_length: int,
                     initial_term_offset: int = 0) -> tuple[IpcPublication, CountersFile]:
    counters = CountersFile.create(directory / "counters", capacity=256)
    publication = IpcPublication.create(
        path=str(directory / "stream.logbuffer"), registration_id=1, stream_id=1001,
        session_id=42, initial_term_id=5, channel="aeron:ipc", counters=counters,
        term_length=term_length, mtu=1408, term_window_length=term_length // 2,
        unblock_timeout_ns=10**12, linger_timeout_ns=10**9, now_ns=0,
        initial_term_offset=initial_term_offset, clean_chunk_length=clean_chunk_length)
    return publication, counters


def subscription(registration_id: int, client_id: int = 1) -> Subscription:
    """A client's IPC subscription of the stream :func:`make_publication` makes."""
    return Subscription(registration_id, client_id, f"client-{client_id}".encode(),
                        parse_channel("aeron:ipc"), 1001)


def move_producer(publication: IpcPublication, position: int) -> None:
    """The log's tail at ``position``, as if publishers had written that far (a subscriber's
    position past the producer's is taken at the producer's)."""
    log = publication.log
    term_count = position >> log.position_bits
    log.set_meta_i64(META_TAIL_COUNTERS + 8 * (term_count % PARTITION_COUNT),
                     pack_tail(log.initial_term_id + term_count,
                               position & (log.term_length - 1)))
    log.set_meta_i32(META_ACTIVE_TERM_COUNT, term_count)


def assert_reachable_memory_is_clean(publication: IpcPublication, counters: CountersFile) -> None:
    """Every frame slot a publisher could claim under the current limit, and the first slot of
    the term it could rotate into, reads as empty: whatever the interleaving of publishers, a
    reader can then never find an old frame past the tail."""
    log = publication.log
    term_length = log.term_length
    producer = log.producer_position()
    limit = counters.get(publication.publisher_limit_id)
    # A claim needs a position below the limit and stays in its term, or rotates out of it.
    reachable_end = (max(limit, producer) + term_length - 1) & ~(term_length - 1)
    position = producer
    while position <= reachable_end:
        index = index_by_position(position, log.position_bits)
        offset = compute_term_offset(position, term_length)
        words = log.term_view(index).cast("i")
        stop = min(offset + (reachable_end - position), term_length - FRAME_ALIGNMENT)
        dirty = [o for o in range(offset, stop + 1, FRAME_ALIGNMENT) if words[o // 4] != 0]
        assert not dirty, (f"partition {index} holds old frames at offsets {dirty[:4]} that a "
                           f"publisher may reach (tail {producer}, limit {limit}, "
                           f"cleaned to {publication.cleaner.position})")
        position += term_length - offset


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1),
       clean_chunk_length=st.sampled_from([1024, 4096, 10_016]),
       initial_term_offset=st.sampled_from([0, 4096, 40_000]))
def test_a_subscriber_never_reads_old_frames_while_cleaning_lags(
        shm: Path, seed: int, clean_chunk_length: int, initial_term_offset: int) -> None:
    """Cleaning a bounded chunk per duty cycle falls behind a fast publisher; the limit must
    then hold the publisher back so that it never writes into a partition whose old frames
    the subscriber could still find past the new ones."""
    rng = random.Random(seed)
    term_length = TERM_MIN_LENGTH
    example = shm / uuid.uuid4().hex  # hypothesis runs every example in one fixture
    example.mkdir()
    publication, counters = make_publication(
        example, term_length=term_length, clean_chunk_length=clean_chunk_length,
        initial_term_offset=initial_term_offset)
    try:
        subscriber = publication.add_subscriber(subscription(7), label="test")
        position_ptr = counters.address(subscriber.counter_id)
        image = Image(publication.log, position_ptr, join_position=publication.join_position())
        limit_ptr = counters.address(publication.publisher_limit_id)
        appender = new_appender(publication.log, limit_ptr)
        received = 0
        next_sequence = 0

        def on_message(data: memoryview, header: object) -> None:
            nonlocal received
            sequence = SEQUENCE.unpack_from(data)[0]
            assert sequence == received, f"read message {sequence} where {received} was due"
            received += 1

        # Many term rotations: every partition is reused with old frames left in it.
        end = publication.log.producer_position() + 12 * PARTITION_COUNT * term_length
        stalled_cycles = 0
        while (producer := publication.log.producer_position()) < end:
            publication.update_limits(now_ns=0)
            assert_reachable_memory_is_clean(publication, counters)
            for _ in range(rng.randrange(1, 1000)):
                message = SEQUENCE.pack(next_sequence) + bytes(rng.choice((0, 24, 100, 500)))
                result = lib.ss_offer(appender, message, len(message))
                if result == ADMIN_ACTION:
                    continue
                if result < 0:
                    break
                next_sequence += 1
            for _ in range(1000):  # bounded: a reader following old frames may never stop
                if not image.poll(on_message, rng.randrange(1, 500)):
                    break
            assert image.position <= publication.log.producer_position(), "read past the tail"
            stalled_cycles = stalled_cycles + 1 if producer == image.position else 0
            assert stalled_cycles < 1000, f"stuck at {producer}: {publication.cleaner.position=}"
        assert received == next_sequence
    finally:
        publication.close()
        counters.close()


def test_cleaning_is_bounded_per_duty_cycle_and_asks_for_the_next_at_once(shm: Path) -> None:
    term_length = 1 << 20
    chunk = 64 * 1024
    publication, counters = make_publication(shm, term_length=term_length,
                                             clean_chunk_length=chunk)
    try:
        subscriber = publication.add_subscriber(subscription(7), label="test")
        # The subscriber is far ahead (as after a catch-up): two terms are cleanable.
        move_producer(publication, 3 * term_length)
        counters.set(subscriber.counter_id, 3 * term_length)
        cycles = 0
        while True:
            before = publication.cleaner.position
            publication.update_limits(now_ns=0)
            cycles += 1
            assert publication.cleaner.position - before <= chunk
            if not publication.cleaner.is_behind:
                break
        assert publication.cleaner.position == 2 * term_length
        assert cycles == 2 * term_length // chunk
    finally:
        publication.close()
        counters.close()


def test_a_subscriber_position_past_the_producer_is_taken_at_the_producer(shm: Path) -> None:
    """A client writes its subscriber position: one two terms past what was published would
    have the log cleaned ahead of the producer and pub-lmt raised past a window beyond it."""
    term_length = 1 << 20
    publication, counters = make_publication(shm, term_length=term_length,
                                             clean_chunk_length=64 * 1024)
    try:
        subscriber = publication.add_subscriber(subscription(7), label="test")
        move_producer(publication, term_length)
        counters.set(subscriber.counter_id, 3 * term_length)
        for _ in range(64):
            publication.update_limits(now_ns=0)
        assert publication.consumer_position() == term_length
        assert publication.cleaner.position <= term_length
        assert counters.get(publication.publisher_limit_id) == term_length + term_length // 2
        assert publication.is_consumed()
        counters.set(subscriber.counter_id, -4096)
        assert publication.consumer_position() == 0 and not publication.is_consumed()
    finally:
        publication.close()
        counters.close()


def test_a_lagging_cleaner_stops_asking_for_cycles_when_the_last_subscriber_leaves(
        shm: Path) -> None:
    term_length = 1 << 20
    publication, counters = make_publication(shm, term_length=term_length,
                                             clean_chunk_length=64 * 1024)
    try:
        subscriber = publication.add_subscriber(subscription(7), label="test")
        move_producer(publication, 3 * term_length)
        counters.set(subscriber.counter_id, 3 * term_length)
        publication.update_limits(now_ns=0)
        assert publication.cleaner.is_behind
        publication.remove_subscriber(7)
        publication.update_limits(now_ns=0)
        assert not publication.cleaner.is_behind  # or the driver would cycle forever
    finally:
        publication.close()
        counters.close()
