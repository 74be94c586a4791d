"""The controlled poll (Aeron's ``ControlledFragmentHandler``) over real shared-memory logs:
ABORT delivers the same message again, BREAK stops, COMMIT moves the position the publishers'
flow control reads before the next message, CONTINUE moves it at the latest at the end of the
poll; across term boundaries, fragmented messages and several images; a handler that closes
its subscription is handed no further message."""

from __future__ import annotations

import itertools
import struct
from collections.abc import Callable

import pytest
from helpers import connect, free_port, offer_until, wait_for
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slipstream.client import (
    ADMIN_ACTION,
    BACK_PRESSURED,
    Client,
    ControlledPollAction,
    UsageError,
    control,
)
from slipstream.client.counters import CountersFile, CounterType
from slipstream.client.layout import FRAME_ALIGNMENT, HEADER_LENGTH, align

ABORT, BREAK, COMMIT, CONTINUE = (ControlledPollAction.ABORT, ControlledPollAction.BREAK,
                                  ControlledPollAction.COMMIT, ControlledPollAction.CONTINUE)
TERM = 64 * 1024  # the test driver's IPC terms; the window is half a term
MTU_PAYLOAD = 1408 - HEADER_LENGTH  # past this a message is fragmented
_stream_ids = itertools.count(20_000)


def _message(index: int, size: int) -> bytes:
    """Message ``index`` of ``size`` bytes (at least 4): its index, then a filler."""
    return struct.pack("<I", index) + bytes([index % 251]) * (size - 4)


def _index(data: memoryview) -> int:
    return struct.unpack_from("<I", data)[0]


def _frame_length(size: int) -> int:
    """The bytes an unfragmented message of ``size`` takes in the log."""
    return align(HEADER_LENGTH + size, FRAME_ALIGNMENT)


class _SubscriberPosition:
    """The subscriber's position counter as the driver reads it: through a read-only map of
    the counters file of its own, as `slipstream stat` reads it."""

    def __init__(self, client: Client, subscription_registration_id: int) -> None:
        self._counters = CountersFile(client.directory / control.COUNTERS_FILE, writable=False)
        self._id = next(info.counter_id for info in self._counters
                        if info.type_id == CounterType.SUBSCRIBER_POSITION
                        and info.registration_id == subscription_registration_id)

    def __call__(self) -> int:
        return self._counters.get(self._id)

    def close(self) -> None:
        self._counters.close()


def _ipc_stream(client: Client, start_offset: int = 0, *, offered: int = 0):
    """A new IPC stream whose log starts ``start_offset`` bytes into its first term, messages
    0 .. ``offered`` - 1 (60 bytes) offered on it; returns its publication, subscription,
    image and subscriber position counter."""
    stream_id = next(_stream_ids)
    channel = (f"aeron:ipc?term-length=64k|init-term-id=7|term-id=7|term-offset={start_offset}"
               if start_offset else "aeron:ipc?term-length=64k")
    publication = client.add_publication(channel, stream_id)
    subscription = client.add_subscription("aeron:ipc", stream_id)
    connect(publication, subscription)
    [image] = subscription.images
    for i in range(offered):
        offer_until(publication, _message(i, 60))
    return publication, subscription, image, _SubscriberPosition(client,
                                                                 subscription.registration_id)


# -- the model: any sizes, actions and limits -------------------------------------------------

_SIZES = st.one_of(st.integers(4, 200), st.integers(1000, MTU_PAYLOAD),
                   st.integers(MTU_PAYLOAD + 1, 5000))  # the last: fragmented


@settings(max_examples=40, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(sizes=st.lists(_SIZES, min_size=1, max_size=40),
       actions=st.lists(st.sampled_from(list(ControlledPollAction)), max_size=80),
       limits=st.lists(st.integers(1, 12), max_size=40),
       start=st.integers((TERM - 8192) // 32, TERM // 32 - 1).map(lambda n: n * 32))
def test_every_message_is_consumed_once_in_order_whatever_the_handler_answers(
        client: Client, sizes: list[int], actions: list[ControlledPollAction],
        limits: list[int], start: int) -> None:
    """A stream that starts within 8 KiB of its term's end (so it crosses into the next term),
    read by controlled polls whose handler answers with ``actions`` (then CONTINUE) and whose
    fragment limits are ``limits`` (then 10).  Every message is consumed exactly once and in
    order, an aborted one is the next one delivered, a BREAK ends the poll, and the position
    the driver reads is never past the message being handled nor behind the last COMMIT."""
    publication, subscription, image, seen = _ipc_stream(client, start)
    answers, poll_limits = list(actions), list(limits)
    consumed = 0  # messages consumed so far
    poll: dict[str, int] = {}
    handled_positions: dict[int, int] = {}  # message index -> the position after it

    def handler(data: memoryview, header) -> ControlledPollAction:
        assert not poll["stopped"], "handed a message after ABORT or BREAK"
        index = _index(data)
        assert index == consumed + poll["consumed"], "out of order, or one skipped"
        assert bytes(data) == _message(index, sizes[index])
        # What flow control reads: at least the last COMMIT, never past this message.
        assert poll["committed"] <= seen() < header.position
        handled_positions[index] = header.position
        action = answers.pop(0) if answers else CONTINUE
        if action is not ABORT:
            poll["consumed"] += 1
        if action in (ABORT, BREAK):
            poll["stopped"] = 1
        if action is COMMIT:
            poll["committed"] = header.position
        return action

    sent = 0
    deadline_polls = 20_000
    for _ in range(deadline_polls):
        if consumed == len(sizes):
            break
        while sent < len(sizes):
            result = publication.offer(_message(sent, sizes[sent]))
            if result > 0:
                sent += 1
            elif result != ADMIN_ACTION:
                assert result == BACK_PRESSURED, result
                break
        poll.update(consumed=0, stopped=0, committed=image.position)
        returned = subscription.controlled_poll(handler, poll_limits.pop(0) if poll_limits
                                                else 10)
        assert returned == poll["consumed"]
        consumed += returned
        assert seen() == image.position  # the poll's end published what it consumed
        if consumed:
            assert image.position >= handled_positions[consumed - 1]
        if consumed < len(sizes) and consumed in handled_positions:  # aborted: not consumed
            assert image.position < handled_positions[consumed]
            if sizes[consumed] <= MTU_PAYLOAD:  # unfragmented: the position is on its frame
                assert image.position == (handled_positions[consumed]
                                          - _frame_length(sizes[consumed]))
    else:
        pytest.fail(f"{consumed} of {len(sizes)} consumed after {deadline_polls} polls")
    assert image.position == publication.position
    if sum(_frame_length(min(size, MTU_PAYLOAD)) for size in sizes) > TERM - start:
        assert image.position > TERM  # it crossed into the next term
    seen.close()
    subscription.close()
    publication.close()


# -- each action, by example -------------------------------------------------------------------

def _answering(*actions: ControlledPollAction, then: ControlledPollAction = CONTINUE,
               got: list[bytes] | None = None) -> Callable[[memoryview, object],
                                                           ControlledPollAction]:
    """A handler that answers ``actions`` in turn, then ``then``; it records what it is
    given in ``got``."""
    answers = list(actions)

    def handler(data: memoryview, _header: object) -> ControlledPollAction:
        if got is not None:
            got.append(bytes(data))
        return answers.pop(0) if answers else then

    return handler


def test_an_aborted_message_is_delivered_again_by_the_next_poll_of_either_kind(
        client: Client) -> None:
    publication, subscription, image, seen = _ipc_stream(client)
    small, fragmented = _message(0, 100), _message(1, 4000)
    offer_until(publication, small)
    offer_until(publication, fragmented)
    got: list[bytes] = []
    assert subscription.controlled_poll(_answering(ABORT, got=got), 10) == 0
    assert image.position == 0 and seen() == 0
    assert subscription.controlled_poll(_answering(ABORT, got=got), 10) == 0
    # The scan stops at the fragmented message: a poll of its own.
    assert subscription.controlled_poll(_answering(got=got), 10) == 1
    assert image.position == seen() == _frame_length(100)
    assert subscription.controlled_poll(_answering(ABORT, got=got), 10) == 0
    # The fragmented message's first fragments are consumed; its last is not.
    held = image.position
    assert _frame_length(100) < held < publication.position
    assert subscription.controlled_poll(_answering(ABORT, got=got), 10) == 0
    assert image.position == seen() == held
    plain: list[bytes] = []
    assert subscription.poll(lambda data, _h: plain.append(bytes(data)), 10) == 1
    assert got == [small, small, small, fragmented, fragmented]
    assert plain == [fragmented]
    assert image.position == publication.position == seen()
    seen.close()


def test_break_consumes_the_message_and_ends_the_poll(client: Client) -> None:
    _publication, subscription, image, seen = _ipc_stream(client, offered=5)
    got: list[bytes] = []
    assert subscription.controlled_poll(_answering(CONTINUE, BREAK, got=got), 10) == 2
    assert [_index(m) for m in got] == [0, 1]
    assert image.position == seen() == 2 * _frame_length(60)
    assert subscription.controlled_poll(_answering(got=got), 10) == 3
    assert [_index(m) for m in got] == [0, 1, 2, 3, 4]
    seen.close()


def test_commit_moves_the_position_before_the_next_message_and_continue_at_the_end(
        client: Client) -> None:
    _publication, subscription, image, seen = _ipc_stream(client, offered=4)
    frame = _frame_length(60)
    positions: list[int] = []

    def handler(_data: memoryview, _header: object) -> ControlledPollAction:
        positions.append(seen())
        return [CONTINUE, COMMIT, CONTINUE, CONTINUE][len(positions) - 1]

    assert subscription.controlled_poll(handler, 10) == 4
    # CONTINUE moved nothing yet; COMMIT (the second message) moved it past both at once.
    assert positions == [0, 0, 2 * frame, 2 * frame]
    assert seen() == image.position == 4 * frame
    seen.close()


def test_a_commit_gives_the_publisher_credit_while_the_poll_still_runs(
        client: Client) -> None:
    """The publisher's limit follows the committed position: a handler that commits one
    message and waits in the next finds its publisher able to offer again."""
    publication, subscription, _image, seen = _ipc_stream(client)
    message = _message(0, 992)  # 1 KiB frames
    sent = 0
    while (result := publication.offer(message)) != BACK_PRESSURED:
        assert result > 0 or result == ADMIN_ACTION, result
        sent += result > 0
    offered_in_handler: list[int] = []

    def handler(_data: memoryview, _header: object) -> ControlledPollAction:
        if not offered_in_handler:
            offered_in_handler.append(0)
            return COMMIT  # 1 KiB of credit, now
        if len(offered_in_handler) == 1:
            offered_in_handler.append(offer_until(publication, message, timeout=5.0))
            return BREAK
        return CONTINUE

    assert subscription.controlled_poll(handler, 10) == 2
    assert offered_in_handler[1] > 0
    seen.close()


def test_a_handler_that_raises_or_answers_no_action_has_consumed_its_message(
        client: Client) -> None:
    publication, subscription, image, seen = _ipc_stream(client, offered=3)
    offer_until(publication, _message(3, 3000))  # fragmented
    offer_until(publication, _message(4, 60))

    def raising(_data: memoryview, _header: object) -> ControlledPollAction:
        raise KeyError("the handler failed")

    with pytest.raises(KeyError):
        subscription.controlled_poll(raising, 10)
    assert image.position == seen() == _frame_length(60)
    with pytest.raises(UsageError, match="returned None, not a ControlledPollAction"):
        subscription.controlled_poll(lambda _d, _h: None, 10)  # type: ignore[arg-type, return-value]
    assert image.position == seen() == 2 * _frame_length(60)
    got: list[bytes] = []
    assert subscription.controlled_poll(_answering(CONTINUE, got=got), 1) == 1
    with pytest.raises(UsageError, match="returned 1"):
        subscription.controlled_poll(lambda _d, _h: 1, 10)  # type: ignore[arg-type, return-value]
    assert subscription.controlled_poll(_answering(got=got), 10) == 1
    assert [_index(m) for m in got] == [2, 4]
    assert image.position == seen() == publication.position
    seen.close()


@pytest.mark.parametrize("answer", [CONTINUE, COMMIT])
@pytest.mark.parametrize("size", [60, 3000], ids=["whole", "fragmented"])
def test_a_handler_that_closes_its_subscription_is_handed_no_further_message(
        client: Client, answer: ControlledPollAction, size: int) -> None:
    """Closing the subscription in a handler ends the read at once, whatever the handler
    answers: the scan's other messages (one C call for the whole scan) are not handed over."""
    publication, subscription, image, seen = _ipc_stream(client)
    seen.close()  # the counter goes with the subscription
    for i in range(5):
        offer_until(publication, _message(i, size))
    got: list[int] = []

    def handler(data: memoryview, _header: object) -> ControlledPollAction:
        got.append(_index(data))
        if len(got) == 2:
            subscription.close()
        return answer

    assert subscription.controlled_poll(handler, 100) == 2
    assert got == [0, 1]
    assert subscription.controlled_poll(handler, 100) == 0
    assert image.controlled_poll(handler, 100) == 0
    assert got == [0, 1]


def test_the_term_boundary_and_its_padding_are_crossed_and_abort_holds_there(
        client: Client) -> None:
    """A stream 160 bytes before its term's end: one 96-byte frame fits, the next goes to
    the next term after 64 bytes of padding.  An ABORT of the first message of the new term
    leaves the position at the term's start, past the padding."""
    publication, subscription, image, seen = _ipc_stream(client, TERM - 160)
    for i in range(6):
        offer_until(publication, _message(i, 60))  # 96-byte frames
    got: list[bytes] = []
    # The scan reads one term: the message in it, then the padding.
    assert subscription.controlled_poll(_answering(got=got), 10) == 1
    assert image.position == TERM
    assert subscription.controlled_poll(_answering(ABORT, got=got), 10) == 0
    assert image.position == seen() == TERM
    assert subscription.controlled_poll(_answering(COMMIT, BREAK, got=got), 10) == 2
    assert image.position == seen() == TERM + 2 * _frame_length(60)
    assert subscription.controlled_poll(_answering(got=got), 10) == 3
    assert [_index(m) for m in got] == [0, 1, 1, 2, 3, 4, 5]
    assert image.position == publication.position == TERM + 5 * _frame_length(60)
    seen.close()


def test_a_break_ends_the_read_of_its_image_only(launch) -> None:
    """As Aeron's Subscription.controlledPoll: the other images are still read."""
    driver = launch()
    uri = f"aeron:udp?endpoint=127.0.0.1:{free_port()}"
    with Client.connect(driver.directory) as client:
        subscription = client.add_subscription(uri, 7)
        publications = [client.add_publication(f"{uri}|session-id={session}", 7)
                        for session in (1001, 1002)]
        for publication in publications:
            connect(publication, subscription)
        wait_for(lambda: len(subscription.images) == 2, what="two images")
        for publication in publications:
            for i in range(3):
                offer_until(publication, _message(i, 60))
        wait_for(lambda: all(image.available_position() >= image.position
                             + 3 * _frame_length(60) for image in subscription.images),
                 what="both images' data")
        sessions: list[int] = []

        def handler(_data: memoryview, header) -> ControlledPollAction:
            sessions.append(header.session_id)
            return BREAK

        assert subscription.controlled_poll(handler, 10) == 2
        assert sorted(sessions) == [1001, 1002]
