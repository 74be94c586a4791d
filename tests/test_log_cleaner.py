"""The log cleaner's rule (daemon/protocol/log_cleaner.py, ``ss_clean_toward`` in C, which
both halves of a network agent and the conductor's IPC publications use): what it zeroes,
where it stops and the limit it allows, against a model in Python's integers, for any
consumer position a client may write."""

from __future__ import annotations

import uuid
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slipstream.client.layout import FRAME_ALIGNMENT, PARTITION_COUNT
from slipstream.client.logbuffer import LogBuffer
from slipstream.daemon._network import ffi as network_ffi
from slipstream.daemon.protocol.log_cleaner import LogCleaner

TERM_LENGTH = 64 * 1024
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def _model(position: int, consumer: int, chunk: int) -> tuple[int, int]:
    """(position, target) after one call, in Python's integers (no wrap-around)."""
    target = consumer - TERM_LENGTH
    if target <= position:
        return position, position
    term_end = (position // TERM_LENGTH + 1) * TERM_LENGTH
    return min(target, term_end, position + chunk), target


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(chunk=st.sampled_from([4096, 10_016, 1 << 20]),
       # Consumers stop at frame boundaries (the 32-byte alignment); the hostile values
       # need not.
       consumers=st.lists(st.one_of(st.integers(0, 12 * TERM_LENGTH // FRAME_ALIGNMENT)
                                    .map(lambda n: n * FRAME_ALIGNMENT),
                                    st.sampled_from([INT64_MIN, INT64_MIN + 1, -1,
                                                     INT64_MAX - TERM_LENGTH])),
                          min_size=1, max_size=40))
def test_the_cleaner_zeroes_toward_one_term_behind_its_consumer_a_chunk_a_call(
        shm: Path, chunk: int, consumers: list[int]) -> None:
    log = LogBuffer.create(shm / uuid.uuid4().hex, term_length=TERM_LENGTH, initial_term_id=7,
                           session_id=1, stream_id=2, mtu=1408, correlation_id=3)
    try:
        terms = network_ffi.buffer(log.address, PARTITION_COUNT * TERM_LENGTH)
        terms[:] = b"\xff" * len(terms)  # old frames everywhere
        cleaner = LogCleaner(log, 0, chunk)
        position = 0
        for consumer in consumers:
            before = cleaner.position
            expected, target = _model(position, consumer, chunk)
            zeroed = cleaner.clean_toward(consumer)
            assert (cleaner.position, zeroed) == (expected, expected > before), consumer
            assert cleaner.is_behind == (expected < target)
            # The frame-length word of every frame slot of what it cleaned reads empty (in
            # the partitions a writer finds there), and nothing past it was touched.
            for slot in range(before, expected, FRAME_ALIGNMENT):
                offset = (slot // TERM_LENGTH % PARTITION_COUNT) * TERM_LENGTH \
                    + slot % TERM_LENGTH
                assert terms[offset:offset + 4] == b"\0\0\0\0", slot
            if expected < PARTITION_COUNT * TERM_LENGTH:  # a slot no call has reached yet
                assert terms[expected:expected + 4] == b"\xff" * 4, expected
            position = expected
            terms_end = -(-position // TERM_LENGTH) * TERM_LENGTH
            assert cleaner.reusable_limit() == terms_end + (PARTITION_COUNT - 1) * TERM_LENGTH
    finally:
        log.close()


def test_a_consumer_position_near_the_int64_limit_cleans_nothing(shm: Path) -> None:
    """A client writes its own position cell: one near INT64_MIN (a bug, or hostile) must not
    wrap the cleaner's target past the log and zero frames nobody has read yet."""
    log = LogBuffer.create(shm / "log", term_length=TERM_LENGTH, initial_term_id=7,
                           session_id=1, stream_id=2, mtu=1408, correlation_id=3)
    try:
        terms = network_ffi.buffer(log.address, PARTITION_COUNT * TERM_LENGTH)
        terms[:] = b"\xff" * len(terms)
        cleaner = LogCleaner(log, 2 * TERM_LENGTH)
        for consumer in (INT64_MIN, INT64_MIN + TERM_LENGTH - 1, -TERM_LENGTH):
            assert not cleaner.clean_toward(consumer)
            assert cleaner.position == 2 * TERM_LENGTH and not cleaner.is_behind
        assert terms[:] == b"\xff" * len(terms)
    finally:
        log.close()
