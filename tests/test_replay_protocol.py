"""The replay exchange without I/O: a reader's :class:`ReplayExchange` fed the bytes a holder's
answers are (:meth:`ReplayRequest.answer`, as the server writes them), with the time as an
argument."""

from __future__ import annotations

import pytest

from slipstream.client.logbuffer import LogIdentity
from slipstream.client.replay.protocol import (
    COMPLETE,
    LOST,
    REFUSED,
    REPLAYING,
    ReaderState,
    ReplayError,
    ReplayExchange,
    ReplayLostError,
    ReplayRequest,
)

LOG = LogIdentity(7, 100, 1 << 16)


def exchange(request_id: int | None = 42, deadline: float = 10.0) -> ReplayExchange:
    request = ReplayRequest(9, LOG, 1024, 8192, "aeron:udp?endpoint=10.0.0.2:40190", 11, 12,
                            request_id=request_id)
    return ReplayExchange(request, "10.0.0.1", 40190, 5, deadline)


def test_the_request_reaches_the_holder_as_it_was_sent() -> None:
    asking = exchange()
    assert ReplayRequest.decode(asking.request_data()) == asking.request


def test_replaying_then_complete_leaves_the_replay_whole_and_its_stream_kept() -> None:
    reader = exchange()
    reader.request_sent()
    reader.receive(reader.request.answer(REPLAYING, start=2048, lost=[1024, 2048],
                                         session_id=-3), 1024)
    assert reader.state is ReaderState.REPLAYING
    assert (reader.start, reader.lost, reader.session_id) == (2048, (1024, 2048), -3)
    assert reader.names_request
    reader.receive(reader.request.answer(COMPLETE, end=8000), 4096)
    assert reader.state is ReaderState.REPLAYING and reader.complete_at == 8000


def test_answers_to_another_request_change_nothing() -> None:
    reader = exchange()
    other = exchange(request_id=43).request
    reader.receive(other.answer(LOST, message="old", lost=[0, 64]), 1024)
    assert reader.state is ReaderState.ASKING
    reader.receive(reader.request.answer(REPLAYING, start=1024), 1024)
    reader.receive(other.answer(REFUSED, message="old"), 2048)
    assert reader.state is ReaderState.REPLAYING


def test_an_answer_that_names_no_request_is_taken_but_the_stream_is_not_kept() -> None:
    reader = exchange()
    unnamed = exchange(request_id=None).request
    reader.receive(unnamed.answer(REPLAYING, start=1024), 1024)
    assert reader.state is ReaderState.REPLAYING and not reader.names_request


def test_lost_fails_the_exchange_naming_the_holders_range_else_the_rest() -> None:
    reader = exchange()
    with pytest.raises(ReplayLostError, match="no longer holds") as lost:
        reader.receive(reader.request.answer(LOST, message="no longer holds it",
                                             lost=[1024, 4096]), 1024)
    assert lost.value.lost == (1024, 4096) and reader.state is ReaderState.FAILED
    replaying = exchange()
    replaying.receive(replaying.request.answer(REPLAYING, start=1024), 1024)
    with pytest.raises(ReplayLostError) as lost:
        replaying.receive(replaying.request.answer(LOST, message="lapped"), 3072)
    assert lost.value.lost == (3072, 8192) and replaying.state is ReaderState.FAILED


@pytest.mark.parametrize("before", [False, True])
def test_a_refusal_fails_the_exchange_with_the_holders_reason(before: bool) -> None:
    reader = exchange()
    if before:
        reader.receive(reader.request.answer(REPLAYING, start=1024), 1024)
    with pytest.raises(ReplayError, match="padding inside a term"):
        reader.receive(reader.request.answer(REFUSED, message="padding inside a term"), 1024)
    assert reader.state is ReaderState.FAILED


def test_time_runs_out_only_while_asking_and_says_what_went_unanswered() -> None:
    reader = exchange(deadline=10.0)
    assert not reader.expired(10.0) and reader.expired(10.5)
    assert "did not answer within 3 s: is the process" in str(reader.timed_out(3))
    reader.request_sent()
    assert "took the request for [1024, 8192) but did not answer" in str(reader.timed_out(3))
    reader.receive(reader.request.answer(REPLAYING, start=1024), 1024)
    assert not reader.expired(99.0)
