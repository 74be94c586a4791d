"""The untethered subscription's states and timers (daemon/streams/tether.py) and its check
(daemon/conductor/untethered.py), the one rule of IPC publications, spies and network images;
here through an IPC publication, sans-I/O."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_ipc_publication import make_publication, move_producer, subscription

from slipstream.client.channel import parse_channel
from slipstream.client.control import UNAVAILABLE_IMAGE
from slipstream.client.counters import CountersFullError, SystemCounter
from slipstream.client.layout import TERM_MIN_LENGTH
from slipstream.daemon.config import DriverSettings
from slipstream.daemon.streams.tether import (
    Subscriber,
    Tether,
    TetherState,
    untethered_window_end,
)

MS = 1_000_000
WINDOW_END = 1000  # a position at or below it holds the stream back


def test_a_subscriber_near_the_window_end_lingers_then_rests_then_rejoins() -> None:
    tether = Tether(window_limit_timeout_ns=50 * MS, resting_timeout_ns=100 * MS, since_ns=0)
    assert tether.check(WINDOW_END, WINDOW_END, 50 * MS) is None  # not past the timeout yet
    assert tether.check(WINDOW_END, WINDOW_END, 50 * MS + 1) is TetherState.LINGER
    assert tether.lingering
    # Lingering, its position holds the stream whatever it is, for the timeout again.
    assert tether.check(WINDOW_END + 500, WINDOW_END, 100 * MS + 1) is None
    assert tether.check(WINDOW_END + 500, WINDOW_END, 100 * MS + 2) is TetherState.RESTING
    assert not tether.rested(200 * MS + 1)
    assert tether.rested(200 * MS + 2)
    assert tether.state is TetherState.ACTIVE and tether.since_ns == 200 * MS + 2
    assert not tether.rested(10**12)  # once


def test_a_subscriber_clear_of_the_window_end_starts_its_timer_again() -> None:
    tether = Tether(window_limit_timeout_ns=50 * MS, resting_timeout_ns=0, since_ns=0)
    assert tether.check(WINDOW_END, WINDOW_END, 40 * MS) is None
    assert tether.check(WINDOW_END + 1, WINDOW_END, 45 * MS) is None  # clear: from 45 ms
    assert tether.check(WINDOW_END, WINDOW_END, 95 * MS) is None
    assert tether.check(WINDOW_END, WINDOW_END, 95 * MS + 1) is TetherState.LINGER


@given(st.lists(st.tuples(st.integers(0, 2 * WINDOW_END), st.integers(0, 30 * MS)),
                max_size=60))
def test_states_follow_the_cycle_and_never_skip_one(steps: list[tuple[int, int]]) -> None:
    """Whatever the positions and times: ACTIVE -> LINGER -> RESTING -> ACTIVE, each step
    only after its timeout, and a subscriber clear of the window's end never leaves ACTIVE."""
    tether = Tether(window_limit_timeout_ns=20 * MS, resting_timeout_ns=10 * MS, since_ns=0)
    now = 0
    following = {TetherState.ACTIVE: TetherState.LINGER, TetherState.LINGER: TetherState.RESTING}
    for position, elapsed in steps:
        now += elapsed
        before, since = tether.state, tether.since_ns
        if before is TetherState.RESTING:
            rejoined = tether.rested(now)
            assert rejoined == (now - since >= 10 * MS)
            continue
        entered = tether.check(position, WINDOW_END, now)
        if entered is None:
            assert tether.state is before
        else:
            assert entered is following[before] and tether.state is entered
            assert now - since > 20 * MS
            assert not (before is TetherState.ACTIVE and position > WINDOW_END)


def test_the_uris_timeouts_stand_before_the_settings() -> None:
    settings = DriverSettings()
    given_ = Tether.of(parse_channel("aeron:ipc?tether=false|untethered-window-limit-timeout=7ms"
                                     "|untethered-resting-timeout=9ms"), settings, 5)
    assert (given_.window_limit_timeout_ns, given_.resting_timeout_ns, given_.since_ns) == (
        7 * MS, 9 * MS, 5)
    default = Tether.of(parse_channel("aeron:ipc?tether=false"), settings, 0)
    assert (default.window_limit_timeout_ns, default.resting_timeout_ns) == (
        settings.untethered_window_limit_timeout, settings.untethered_resting_timeout)


def _ipc_with_an_untethered_subscriber(shm: Path):  # -> (IpcPublication, CountersFile, link)
    directory = shm / uuid.uuid4().hex
    directory.mkdir()
    publication, counters = make_publication(directory, term_length=TERM_MIN_LENGTH,
                                             clean_chunk_length=4096)
    subscriber = publication.add_subscriber(
        subscription(7), label="untethered",
        tether=Tether(window_limit_timeout_ns=10 * MS, resting_timeout_ns=10 * MS, since_ns=0))
    return publication, counters, subscriber


class _Relinks:
    """The conductor's side of a rejoin: records the subscriptions linked anew."""

    def __init__(self) -> None:
        self.subscriptions: list[Subscriber] = []

    def __call__(self, subscription: Subscriber) -> tuple[bytes, dict[str, Any]]:
        self.subscriptions.append(subscription)
        return subscription.client_key, {"type": "available"}


def test_an_ipc_subscriber_left_behind_holds_the_log_while_it_lingers_then_lets_go(
        shm: Path) -> None:
    """As Aeron's IpcPublication: the subscriber is told it is left behind (its image goes)
    but its position holds the publishers for the window limit timeout again, so its client
    stops writing a counter before the driver frees it; then the limit no longer counts it,
    and after its rest it rejoins."""
    publication, counters, subscriber = _ipc_with_an_untethered_subscriber(shm)
    relink = _Relinks()
    window = publication.term_window_length
    producer = window - window // 4  # it never read: at the end of the window
    move_producer(publication, producer)
    publication.update_limits(0)
    assert counters.get(publication.publisher_limit_id) == window  # it holds the publishers
    [(key, gone)] = publication.check_untethered(relink, 10 * MS + 1)
    assert key == subscriber.subscription.client_key and gone["type"] == UNAVAILABLE_IMAGE
    assert (gone["subscription_registration_id"], gone["lost_from"], gone["lost_to"]) == (
        7, 0, producer)
    assert counters.get(SystemCounter.UNTETHERED_SKIPS) == 1
    assert counters.get(SystemCounter.UNTETHERED_SKIPPED_BYTES) == producer
    publication.update_limits(10 * MS + 1)
    # Still, while it lingers (unheld, the limit would be the producer's position).
    assert publication.subscribers == [subscriber] and publication.consumer_position() == 0
    assert counters.get(publication.publisher_limit_id) == window
    assert publication.check_untethered(relink, 20 * MS + 2) == []
    assert publication.subscribers == [] and publication.resting == [subscriber]
    assert counters.info(subscriber.counter_id) is None  # freed
    publication.update_limits(20 * MS + 2)  # no subscriber left: offers are NOT_CONNECTED
    assert counters.get(publication.publisher_limit_id) == producer
    assert not publication.log.is_connected
    assert publication.check_untethered(relink, 30 * MS + 2) == [(b"client-1",
                                                                  {"type": "available"})]
    assert publication.resting == [] and relink.subscriptions == [subscriber.subscription]
    publication.close()


@pytest.mark.parametrize("behind", [0, 1])
def test_the_window_ends_a_quarter_of_a_window_above_head_less_the_window(
        shm: Path, behind: int) -> None:
    """The one window rule (Aeron's since 1.30, for IPC, spies and images alike): a subscriber
    three quarters of a window behind the head holds the stream and is left behind; one a byte
    nearer is clear (it never is, however long)."""
    publication, _, subscriber = _ipc_with_an_untethered_subscriber(shm)
    window = publication.term_window_length
    move_producer(publication, window - window // 4 - behind)
    assert untethered_window_end(publication.log.producer_position(), window) == -behind
    left = publication.check_untethered(_Relinks(), 10 * MS + 1)
    assert len(left) == (1 if behind == 0 else 0)
    assert subscriber.lingering == (behind == 0)
    publication.close()


def test_a_subscriber_removed_while_it_lingers_or_rests_goes_for_good(shm: Path) -> None:
    """Its client closes it: a lingering one's counter is freed once (by the removal, not
    again by the timer), and a resting one never rejoins."""
    publication, counters, subscriber = _ipc_with_an_untethered_subscriber(shm)
    relink = _Relinks()
    move_producer(publication, publication.term_window_length)
    publication.check_untethered(relink, 10 * MS + 1)  # lingering
    assert publication.remove_subscriber(7) is subscriber
    assert counters.info(subscriber.counter_id) is None
    assert publication.check_untethered(relink, 40 * MS) == []
    again = publication.add_subscriber(
        subscription(8), label="untethered",
        tether=Tether(window_limit_timeout_ns=10 * MS, resting_timeout_ns=10 * MS,
                      since_ns=40 * MS))
    move_producer(publication, 2 * publication.term_window_length)  # it joined at the first
    publication.check_untethered(relink, 50 * MS + 1)
    publication.check_untethered(relink, 60 * MS + 2)
    assert publication.resting == [again]
    assert publication.remove_subscriber(8) is again
    assert publication.check_untethered(relink, 10**12) == []
    assert relink.subscriptions == []
    publication.close()


def test_a_rejoin_the_counters_have_no_room_for_rests_again(shm: Path) -> None:
    """Linking anew failed (no counter free): an error is counted and the subscriber rests
    for another resting timeout, then tries again."""
    publication, counters, subscriber = _ipc_with_an_untethered_subscriber(shm)
    move_producer(publication, publication.term_window_length)
    publication.check_untethered(_Relinks(), 10 * MS + 1)
    publication.check_untethered(_Relinks(), 20 * MS + 2)  # resting

    def full(_subscription: Subscriber) -> None:
        raise CountersFullError("no counter free")

    errors = counters.get(SystemCounter.ERRORS)
    assert publication.check_untethered(full, 30 * MS + 2) == []
    assert counters.get(SystemCounter.ERRORS) == errors + 1
    assert publication.resting == [subscriber]
    relink = _Relinks()
    assert publication.check_untethered(relink, 40 * MS + 1) == []  # not at once
    assert len(publication.check_untethered(relink, 40 * MS + 2)) == 1
    assert publication.resting == [] and relink.subscriptions == [subscriber.subscription]
    publication.close()


@pytest.mark.parametrize("drain", ["the last publisher leaves", "the driver drains"])
def test_a_draining_ipc_log_does_not_wait_for_a_subscriber_left_behind(
        shm: Path, drain: str) -> None:
    """A lingering subscriber's client stopped reading: a log whose last publisher left, or
    whose driver drains, must not wait for it to be read, nor a resting one rejoin it."""
    publication, counters, subscriber = _ipc_with_an_untethered_subscriber(shm)
    move_producer(publication, publication.term_window_length)
    publication.update_limits(0)
    assert publication.check_untethered(_Relinks(), 10 * MS + 1)
    if drain == "the driver drains":
        publication.stop_credit()
        assert publication.is_consumed()
    publication.start_draining()
    assert publication.subscribers == [] and publication.resting == []
    assert counters.info(subscriber.counter_id) is None
    assert publication.is_drained()
    publication.close()
