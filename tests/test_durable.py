"""durable=TAG/N (docs/CHANNELS.md §7.7): a publication's durable position is what N receivers
tagged gtag=TAG consumed, as their status messages report; real drivers on loopback.

Each driver has 64 KiB terms (a receiver window of 32 KiB), so the streams below cross several
terms and windows."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest
from helpers import (
    Collector,
    connect,
    counters_labelled,
    counters_of,
    free_port,
    message,
    run_stat,
    wait_for,
)
from test_archive import archive_process, recorded_messages, wait_for_recording
from test_encrypted_streams import KEY_A, write_keys

from slipstream.client import BufferClaim, Client, Publication, Subscription
from slipstream.client.errors import ChannelError, UsageError
from slipstream.client.publication import NotDurable
from slipstream.daemon.config import DriverSettings
from slipstream.daemon.driver import MediaDriver

SIZE = 1000  # bytes of each message: 1,056 with its header


def _counter(driver: MediaDriver, prefix: str) -> int:
    [info] = counters_labelled(driver, prefix)
    return info.value


def _offer(publication: Publication, first: int, count: int, size: int = SIZE) -> list[int]:
    """Offer messages ``first ..`` until ``count`` were taken: their positions."""
    positions = []
    deadline = time.monotonic() + 10
    while len(positions) < count:
        result = publication.offer(message(first + len(positions), size))
        if result > 0:
            positions.append(result)
        else:
            assert time.monotonic() < deadline, f"offer refused: {result}"
            time.sleep(0.0005)
    return positions


def _read_one(subscription: Subscription) -> None:
    """Poll until one message was read."""
    deadline = time.monotonic() + 5
    while not subscription.poll(lambda *_: None, 1):
        assert time.monotonic() < deadline, "no message came"


@contextlib.contextmanager
def unicast(launch, durable: str, gtag: str, publisher: dict | None = None,
            subscriber: dict | None = None) -> Iterator[
        tuple[MediaDriver, MediaDriver, Publication, Subscription]]:
    """A publisher's driver with ``durable`` and a subscriber's driver with ``gtag`` (either
    may be empty; each driver with the settings given), stream 3 connected."""
    port = free_port()
    a, b = launch(**(publisher or {})), launch(**(subscriber or {}))
    with Client.connect(a.directory) as ca, Client.connect(b.directory) as cb:
        subscription = cb.add_subscription(f"aeron:udp?endpoint=127.0.0.1:{port}{gtag}", 3)
        publication = ca.add_publication(f"aeron:udp?endpoint=127.0.0.1:{port}{durable}", 3)
        connect(publication, subscription)
        yield a, b, publication, subscription


def test_the_durable_position_follows_what_the_tagged_subscriber_consumed_not_received(
        launch) -> None:
    with unicast(launch, "|durable=7/1", "|gtag=7") as (a, b, publication, subscription):
        assert (publication.durable_position, publication.durable_receivers) == (0, 1)
        positions = _offer(publication, 0, 20)  # 21 KiB: inside the receiver's window
        wait_for(lambda: _counter(b, "rcv-pos") == positions[-1], what="all received")
        time.sleep(0.3)  # past the status-message timer (200 ms): an SM went meanwhile
        assert publication.durable_position == 0
        assert publication.why_not_durable(positions[0]) is NotDurable.BEHIND
        assert subscription.poll(lambda *_: None, 10) == 10
        assert publication.wait_durable(positions[9], 2.0)
        time.sleep(0.3)
        assert publication.durable_position == positions[9]  # no further: not consumed
        assert not publication.wait_durable(positions[10], 0.2)
        # The rest, and 400 more across six 64 KiB terms, each position waited for.
        collector = Collector(subscription)
        done = 10
        for i in range(20, 420, 20):
            positions += _offer(publication, i, 20)
            while done < len(positions):
                done += subscription.poll(lambda *_: None, 100)
            assert publication.wait_durable(positions[-1], 5.0)
        assert publication.durable_position == positions[-1] == publication.position
        assert positions[-1] > 6 * 65536
        assert run_stat(a).stdout.count("pub-durable: ") == 1
        assert _counter(a, "pub-durable: ") == positions[-1]
        del collector


def test_an_untagged_or_other_tagged_subscriber_makes_nothing_durable(launch) -> None:
    for gtag in ("", "|gtag=8"):
        with unicast(launch, "|durable=7/1", gtag) as (_, _, publication, subscription):
            positions = _offer(publication, 0, 50)
            done = 0
            while done < 50:
                done += subscription.poll(lambda *_: None, 100)
            started = time.monotonic()
            assert not publication.wait_durable(positions[-1], 0.5)
            assert time.monotonic() - started >= 0.5
            assert publication.durable_position == 0 and publication.durable_receivers == 0
            assert publication.why_not_durable(positions[-1]) is NotDurable.TOO_FEW_RECEIVERS


#: The status-message timer of the test drivers (the default), s.
SM_TIMER_S = DriverSettings().status_message_timeout / 1e9


def _under_the_timer_s(count: int, timer_s: float = SM_TIMER_S) -> float:
    """Seconds ``count`` offer-then-wait rounds take at most when the catch-up SM answers
    each: a quarter of what the status-message timer would make them take (nearly an
    interval each: the message is offered just after the SM that ended the last wait, and
    the timer counts from that SM), room for a loaded machine."""
    return count * timer_s / 4


def _offer_then_wait_each(publication: Publication, subscription: Subscription,
                          count: int) -> tuple[float, int]:
    """The loop a first program writes: offer a message, wait until it is durable, the next;
    the tagged subscriber reads each as it comes.  Seconds taken, and the last position."""
    started = time.monotonic()
    for i in range(count):
        [position] = _offer(publication, i, 1)
        _read_one(subscription)
        assert publication.wait_durable(position, 2.0), publication.why_not_durable(position)
    return time.monotonic() - started, position


def test_offer_then_wait_each_message_hears_the_catch_up_sm_not_the_timer(launch) -> None:
    # The subscriber's driver sends the SMs in C (a reliable unicast image).  Waiting for the
    # status-message timer (200 ms) each, 200 messages would take 40 s.
    with unicast(launch, "|durable=7/1", "|gtag=7") as (_, _, publication, subscription):
        elapsed, last = _offer_then_wait_each(publication, subscription, 200)
        assert elapsed < _under_the_timer_s(200), f"{elapsed:.2f} s for 200 messages"
        assert last > 3 * 65536  # across three term rotations
        assert publication.durable_position == last


@contextlib.contextmanager
def multicast(launch, params: str, gtags: list[str], **settings: object) -> Iterator[
        tuple[MediaDriver, list[MediaDriver], Publication, list[Subscription]]]:
    endpoint = f"224.0.1.{random.randrange(1, 250, 2)}:{free_port()}"
    uri = f"aeron:udp?endpoint={endpoint}|interface=127.0.0.1"
    publisher = launch(**settings)
    subscribers = [launch() for _ in gtags]
    with contextlib.ExitStack() as stack:
        pc = stack.enter_context(Client.connect(publisher.directory))
        clients = [stack.enter_context(Client.connect(d.directory)) for d in subscribers]
        subscriptions = [c.add_subscription(uri + gtag, 7) for c, gtag in
                         zip(clients, gtags, strict=True)]
        publication = pc.add_publication(f"{uri}|{params}", 7)
        connect(publication, *subscriptions)
        yield publisher, subscribers, publication, subscriptions


def test_with_two_required_the_durable_position_stops_at_the_subscriber_that_stopped(
        launch) -> None:
    # fc=tagged,g:7/2 holds the sender to the two tagged receivers, as durable= wants (a
    # receiver joining after data went out never counts).
    with multicast(launch, "durable=7/2|fc=tagged,g:7/2", ["|gtag=7", "|gtag=7", ""]) as (
            _, _, publication, subscriptions):
        polled = [0, 0, 0]

        def poll(which: list[int], until: int) -> None:
            deadline = time.monotonic() + 10
            while any(polled[i] < until for i in which):
                assert time.monotonic() < deadline, polled
                for i in which:
                    polled[i] += subscriptions[i].poll(lambda *_: None, until - polled[i])

        positions = _offer(publication, 0, 30)  # inside the unread receiver's 32 KiB window
        poll([0, 2], 30)
        assert not publication.wait_durable(positions[14], 0.3)  # one tagged receiver of two
        assert publication.why_not_durable(positions[14]) is NotDurable.BEHIND
        assert publication.durable_receivers == 2
        poll([1], 15)
        assert publication.wait_durable(positions[14], 2.0)
        time.sleep(0.3)
        assert publication.durable_position == positions[14]
        # The second stops at 15: offers go on within flow control (the sender is held to its
        # window, the publisher a window beyond), the others read what was sent (its window
        # past it), and the durable position stays.
        more = []
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline:
            result = publication.offer(message(30 + len(more), SIZE))
            if result > 0:
                more.append(result)
            for i in (0, 2):
                polled[i] += subscriptions[i].poll(lambda *_: None, 100)
            time.sleep(0)
        assert len(more) >= 10 and polled[0] == polled[2] >= 15 + 25
        assert publication.durable_position == positions[14]
        assert not publication.wait_durable(positions[15], 0.2)
        # It reads again: everything becomes durable, across several terms.
        positions += more
        poll([0, 1, 2], len(positions))
        assert publication.wait_durable(positions[-1], 5.0)
        while len(positions) < 500:
            positions += _offer(publication, len(positions), 20)
            poll([0, 1, 2], len(positions))
            assert publication.wait_durable(positions[-1], 5.0)
        assert publication.durable_position == positions[-1] > 6 * 65536


def test_offer_then_wait_each_over_multicast_hears_the_catch_up_sm(launch) -> None:
    # A multicast image is a group's: its SMs go from the Python half, which asks C's rule.
    with multicast(launch, "durable=7/1|fc=tagged,g:7/1", ["|gtag=7"]) as (
            _, _, publication, [subscription]):
        elapsed, last = _offer_then_wait_each(publication, subscription, 200)
        assert elapsed < _under_the_timer_s(200), f"{elapsed:.2f} s for 200 messages"
        assert last > 3 * 65536
        assert publication.durable_position == last


def test_catch_up_sms_go_at_most_once_an_interval_and_never_from_an_untagged_image(
        launch) -> None:
    # 100-byte messages, 10 ms apart, each read as it comes: the 25 % rule (8 KiB) never
    # fires in 40 of them, so every SM is the timer's (1 s here) or the catch-up rule's (at
    # most one each 50 ms, the one held back going at the interval's end).
    sms: dict[str, tuple[int, float]] = {}
    for gtag in ("", "|gtag=7"):
        with unicast(launch, "|durable=7/1", gtag,
                     publisher={"publication_connection_timeout": "5s"},
                     subscriber={"status_message_timeout": "1s",
                                 "status_message_catch_up_interval": "50ms"}) as (
                _, b, publication, subscription):
            time.sleep(0.1)  # the SMs of the connection went
            before = counters_of(b)["STATUS_MESSAGES_SENT"]
            started = time.monotonic()
            for i in range(40):
                [position] = _offer(publication, i, 1, size=100)
                _read_one(subscription)
                if gtag:
                    assert publication.wait_durable(position, 2.0)
                time.sleep(0.01)
            elapsed = time.monotonic() - started
            sms[gtag] = (counters_of(b)["STATUS_MESSAGES_SENT"] - before, elapsed)
    untagged, untagged_s = sms[""]
    assert untagged <= untagged_s / 1.0 + 1, sms  # the timer's alone
    tagged, tagged_s = sms["|gtag=7"]
    assert tagged >= 40, sms  # one per message: each was awaited
    # Each wait heard the catch-up SM, not the 1 s timer: the waits added less than that
    # timer would have to the same loop without them.
    assert tagged_s - untagged_s < _under_the_timer_s(40, 1.0), sms
    assert tagged <= tagged_s / 0.05 + 1, sms  # never two within the interval


def test_a_tagged_receiver_that_went_away_stops_counting_after_its_timeout(launch) -> None:
    with multicast(launch, "durable=7/1", ["|gtag=7"],
                   flow_control_receiver_timeout="1s") as (_, [subscriber], publication, [sub]):
        positions = _offer(publication, 0, 11)
        done = 0
        while done < 10:
            done += sub.poll(lambda *_: None, 10 - done)
        assert publication.wait_durable(positions[9], 2.0)
        os.kill(subscriber.pid, signal.SIGKILL)  # no EOS: it just goes silent
        subscriber.process.wait(timeout=10)
        gone = time.monotonic()
        wait_for(lambda: publication.durable_receivers == 0, timeout=5,
                 what="the silent receiver stopped counting")
        assert time.monotonic() - gone >= 0.7  # its timeout (1 s) less an SM interval
        assert not publication.wait_durable(positions[10], 0.3)
        assert publication.why_not_durable(positions[10]) is NotDurable.TOO_FEW_RECEIVERS
        assert publication.durable_position == positions[9]  # never goes back


FULL_SPEED = 2000  # messages of SIZE: 2 MiB, 32 rotations of the drivers' 64 KiB terms


def _offer_at_full_speed(publication: Publication, count: int, *, aborted_claims: bool = False
                         ) -> tuple[list[int], list[int]]:
    """Offer ``count`` messages as fast as the publication takes them, reading its
    ``durable_receivers`` after each attempt: (the positions, every count read that was not
    1).  ``aborted_claims``: each message after a claim of the longest payload, aborted (a
    padding frame of an MTU in mid-term, which the sender sends as its header alone)."""
    claim = BufferClaim()
    positions: list[int] = []
    lost: list[int] = []
    claimed = not aborted_claims  # before the next message
    deadline = time.monotonic() + 60
    while len(positions) < count:
        assert time.monotonic() < deadline, f"{len(positions)} of {count} offered"
        if not claimed and publication.try_claim(publication.max_payload_length, claim) > 0:
            claim.abort()
            claimed = True
        result = publication.offer(message(len(positions), SIZE)) if claimed else 0
        if result > 0:
            positions.append(result)
            claimed = not aborted_claims
        if publication.durable_receivers != 1:
            lost.append(publication.durable_receivers)
    return positions, lost


def test_an_archive_as_the_tagged_receiver_keeps_counting_at_full_speed(
        launch, tmp_path: Path) -> None:
    """A slipstream-archive process records the stream (a remote [[record]], gtag=7): it reads
    all it has at once, so its status messages move a whole receiver window at a time, at a
    term end past it by the padding frame the sender sent beyond its limit, and advertise the
    window its log cleaning allows.  Offered at full speed across 32 term rotations, it counts
    throughout, every message becomes durable, and the recording holds each."""
    archive_driver, publisher = launch(), launch()
    channel = f"aeron:udp?endpoint=127.0.0.1:{free_port()}"
    archive_dir = tmp_path / "archive"
    config = tmp_path / "archive.toml"
    config.write_text("\n".join([
        f'dir = "{archive_dir}"', f'driver_dir = "{archive_driver.directory}"',
        "control_port = 0", "[[record]]", f'channel = "{channel}|gtag=7"', "stream_id = 5",
        'source = "remote"']) + "\n")
    with archive_process(config, tmp_path / "archive.log"), \
            Client.connect(publisher.directory) as client:
        publication = client.add_publication(f"{channel}|durable=7/1", 5)
        wait_for(lambda: publication.durable_receivers == 1, timeout=20,
                 what="the archive's receiver counted")
        positions, lost = _offer_at_full_speed(publication, FULL_SPEED)
        assert publication.wait_durable(positions[-1], 10.0), \
            publication.why_not_durable(positions[-1])
        assert not lost, f"durable_receivers read {sorted(set(lost))} {len(lost)} times"
        assert publication.durable_receivers == 1
        assert positions[-1] > 30 * 65536
        publication.close()
        recording = wait_for_recording(archive_dir, ended=True, timeout=30)
    recorded = recorded_messages(recording, archive_dir)
    assert [position for _, position in recorded] == positions
    assert all(data == message(i, SIZE) for i, (data, _) in enumerate(recorded))


@pytest.mark.parametrize(("key", "aborted_claims"), [("", False), ("|key=k", False),
                                                     ("", True)],
                         ids=["plain", "sealed", "aborted-claims"])
def test_a_subscriber_reading_all_it_has_keeps_counting_at_full_speed(
        launch, tmp_path: Path, key: str, aborted_claims: bool) -> None:
    """The same without an archive, plain and sealed (key=, docs/CHANNELS.md §7.8): a tagged
    subscriber on another driver that polls everything its image holds, on a thread of its
    own, while the publisher offers at full speed across 32 term rotations; and with an
    aborted claim before each message, whose padding frame stands for an MTU in mid-term."""
    write_keys(tmp_path / "keys", "k", [(1, KEY_A)])
    drivers = {"keys_dir": str(tmp_path / "keys")}
    with unicast(launch, f"|durable=7/1{key}", f"|gtag=7{key}", drivers, drivers) as (
            _, _, publication, subscription):
        stop = threading.Event()
        read = [0]

        def consume() -> None:
            while not stop.is_set():
                read[0] += subscription.poll(lambda *_: None, 1 << 20)

        reader = threading.Thread(target=consume, daemon=True)
        reader.start()
        try:
            positions, lost = _offer_at_full_speed(publication, FULL_SPEED,
                                                   aborted_claims=aborted_claims)
            assert publication.wait_durable(positions[-1], 10.0), \
                publication.why_not_durable(positions[-1])
        finally:
            stop.set()
            reader.join(5)
        assert not lost, f"durable_receivers read {sorted(set(lost))} {len(lost)} times"
        assert read[0] == FULL_SPEED and positions[-1] > 30 * 65536


@pytest.mark.anyio
async def test_wait_durable_async_parks_without_blocking_the_loop(launch) -> None:
    """Under trio and asyncio alike (tests/loops.py): the waiting task parks while the loop
    runs another, returns True once the receivers hold the position, and False after its
    timeout for one they never will."""
    with unicast(launch, "|durable=7/1", "|gtag=7") as (_, _, publication, subscription):
        positions = _offer(publication, 0, 30)
        async with anyio.create_task_group() as tasks:
            results: list[bool] = []

            async def waiter() -> None:
                results.append(await publication.wait_durable_async(positions[-1], 5.0))

            tasks.start_soon(waiter)
            await anyio.sleep(0.2)
            assert not results  # parked, the loop free: this task ran
            done = 0
            while done < 30:
                done += subscription.poll(lambda *_: None, 30)
        started = time.monotonic()
        late = await publication.wait_durable_async(positions[-1] + 1, 0.3)
        assert results == [True] and not late and time.monotonic() - started >= 0.3


def test_durable_keys_are_refused_by_name(launch) -> None:
    port = free_port()
    driver = launch()
    with Client.connect(driver.directory) as client:
        for uri in (f"aeron:udp?endpoint=127.0.0.1:{port}|durable=7/1",
                    f"aeron:udp?endpoint=127.0.0.1:{port}|gtag=7|durable=7/1"):
            with pytest.raises(ChannelError, match="durable") as raised:
                client.add_subscription(uri, 1)
            assert raised.value.part == "durable"
        for uri, problem in (
                ("aeron:ipc?durable=7/1", "aeron:udp only"),
                (f"aeron:udp?endpoint=127.0.0.1:{port}|durable=2", "<group tag>/<receivers>"),
                (f"aeron:udp?endpoint=127.0.0.1:{port}|durable=7/0", "out of range"),
                (f"aeron:udp?endpoint=127.0.0.1:{port}|durable=/1", "no group tag"),
                (f"aeron:udp?endpoint=127.0.0.1:{port}|durable=x/1", "not an integer"),
                (f"aeron:udp?endpoint=127.0.0.1:{port}|durable=7/1025", "out of range")):
            with pytest.raises(ChannelError, match=problem) as raised:
                client.add_publication(uri, 1)
            assert raised.value.part == "durable"
        # A second publisher of the shared publication cannot ask for another.
        first = client.add_publication(f"aeron:udp?endpoint=127.0.0.1:{port}|durable=7/1", 2)
        with pytest.raises(ChannelError, match="durable"):
            client.add_publication(f"aeron:udp?endpoint=127.0.0.1:{port}|durable=7/2", 2)
        plain = client.add_publication(f"aeron:udp?endpoint=127.0.0.1:{port}", 4)
        assert plain.durable_position is None and plain.durable_receivers is None
        with pytest.raises(UsageError, match="no durable= key"):
            plain.wait_durable(1, 0.1)
        first.close()


def test_the_driver_refuses_durable_on_a_subscription_from_any_client() -> None:
    from slipstream.client.channel import parse_channel
    from slipstream.daemon.conductor.conductor import _carried

    with pytest.raises(ChannelError) as raised:
        _carried(parse_channel("aeron:udp?endpoint=127.0.0.1:9|durable=1/1"), subscription=True)
    assert raised.value.part == "durable"


@pytest.mark.spark
def test_the_spark_writer_commits_a_task_only_once_its_last_message_is_durable(
        launch) -> None:
    import threading

    import pyarrow as pa

    from slipstream.spark_bridge import runtime
    from slipstream.spark_bridge.options import OptionError, parse_options
    from slipstream.spark_bridge.writer import (
        DurableTimeoutError,
        SlipstreamWriter,
        wait_until_durable,
    )

    with pytest.raises(OptionError, match=r"'durableTimeoutMs'.*no durable= key"):
        parse_options({"streamId": "1", "channel": "aeron:udp?endpoint=127.0.0.1:9",
                       "durableTimeoutMs": "100"}).check_direction("write")
    with pytest.raises(OptionError, match=r"'durableTimeoutMs'.*negative"):
        parse_options({"streamId": "1", "durableTimeoutMs": "-1"})
    options = parse_options({"streamId": "1", "durableTimeoutMs": "250",
                             "channel": "aeron:udp?endpoint=127.0.0.1:9|durable=7/1"})
    options.check_direction("write")
    assert options.durable_timeout_ms == 250

    def writer(directory: object, channel: str, timeout_ms: int) -> SlipstreamWriter:
        """The writer a Spark task runs (SlipstreamWriter.write), publishing on the
        fixture's channel through the publisher's driver (its publication's session)."""
        return SlipstreamWriter(parse_options({
            "streamId": "3", "channel": channel, "directory": str(directory),
            "durableTimeoutMs": str(timeout_ms)}))

    with unicast(launch, "|durable=7/1", "|gtag=7") as (a, _, publication, subscription):
        channel = publication.channel
        batch = pa.RecordBatch.from_pydict({"value": [message(i, SIZE) for i in range(20)]})
        polling = threading.Event()
        stopped = threading.Event()

        def consume() -> None:
            while not stopped.is_set():
                if not polling.is_set() or not subscription.poll(lambda *_: None, 20):
                    time.sleep(0.001)

        consumer = threading.Thread(target=consume, daemon=True)
        consumer.start()
        try:
            # Not consumed: the task fails (it is not committed, Spark retries it).
            with pytest.raises(DurableTimeoutError, match="durableTimeoutMs=250 ms: the "
                                                          "tagged receivers have not "
                                                          "consumed"):
                writer(a.directory, channel, 250).write(iter([batch]))
            last = publication.position  # the writer's messages are this session's
            assert last >= 20 * SIZE
            polling.set()
            wait_until_durable(publication, last, 5_000)
            assert publication.durable_position == last
            # Consumed as it goes: the task returns once its last message is durable.
            published = writer(a.directory, channel, 5_000).write(iter([batch]))
            assert published.rows == 20 and published.last_position > last
            assert publication.durable_position >= published.last_position
        finally:
            stopped.set()
            consumer.join(5)
            runtime.close_all()


def test_a_receiver_that_comes_back_as_a_new_image_counts_only_from_where_it_joined() -> None:
    """The rule's own bookkeeping (daemon/streams/durable.py): a tagged receiver heard again
    after its timeout, or further on than its window let it receive since its last status
    message (a new image of it: left behind, or rejoined), holds nothing of what lay between,
    so its first status message after that does not move the durable position past it."""
    from slipstream.client.channel import DurableSpec
    from slipstream.daemon.streams.durable import DurablePosition

    source = ("10.0.0.2", 40123)
    term = 131072  # an image takes up to half a term (64 KiB) past its last SM
    durable = DurablePosition(DurableSpec(7, 1), receiver_timeout_ns=1_000, start=0,
                              term_length=term, mtu=1408)
    assert durable.on_status_message(1, source, 7, 0, False, 0)  # heard from the start
    assert durable.on_status_message(1, source, 7, 4096, False, 1)
    assert durable.position == 4096
    # Further on than its image could take since its last SM: a new image, joined at 200k.
    durable.on_status_message(1, source, 7, 200_000, False, 10)
    assert durable.position == 4096 and durable.receiver_count == 0
    # Heard again after its timeout: the same.
    durable.expire(2_000)
    durable.on_status_message(1, source, 7, 300_000, False, 2_001)
    assert durable.position == 4096 and durable.receiver_count == 0
    # A receiver heard from the start moves it, up to half a term at once.
    other = ("10.0.0.3", 40123)
    assert durable.on_status_message(2, other, 7, 0, False, 2_002)
    assert durable.on_status_message(2, other, 7, 60_000, False, 2_003)
    assert durable.position == 60_000
    assert durable.on_status_message(2, other, 7, 60_000 + term // 2, False, 2_004)
    assert durable.position == 60_000 + term // 2 and durable.receiver_count == 1


def test_an_image_that_read_through_a_padding_frame_past_half_a_term_still_counts() -> None:
    """A sender sends a padding frame whose header fits under its limit as its header alone,
    though it stands for its whole length (the rest of a term, or an aborted claim), and a
    receiver takes it if the header ends within its over-run bound (half a term past its last
    SM).  So a receiver that reads all it has (an archive) reports up to the end of such a
    padding: the same image.  A position further on is a new image's."""
    from slipstream.client.channel import DurableSpec
    from slipstream.client.layout import max_message_length
    from slipstream.daemon.streams.durable import DurablePosition

    term, mtu, half = 65536, 1408, 32768
    # The longest padding: a term's rest that the longest message (8 KiB in six fragments,
    # each with its 32-byte header) did not fit in, 32 bytes less than the message.
    fragments = -(-max_message_length(term) // (mtu - 32))
    longest_padding = max_message_length(term) + 32 * fragments - 32
    assert longest_padding > mtu  # longer than an aborted claim's
    source = ("10.0.0.2", 40123)
    for last, position, same in [
            (32736, 65536, True),  # a padding of 64 bytes from 65472 (the limit 65504)
            (32000, 32000 + half - 32 + mtu, True),  # an aborted claim's, in mid-term
            # The longest padding, its header right under the bound; 32 bytes further: not.
            (2 * term - longest_padding - half + 32, 2 * term, True),
            (2 * term - longest_padding - half, 2 * term, False),
            (32768, 32768 + half, True),  # half a term of frames
            (32768, 2 * term, False),  # far past the bound
            (0, 300_000, False)]:
        durable = DurablePosition(DurableSpec(7, 1), receiver_timeout_ns=10**9, start=last,
                                  term_length=term, mtu=mtu)
        durable.on_status_message(1, source, 7, last, False, 1)  # heard from the start
        durable.on_status_message(1, source, 7, position, False, 2)
        assert durable.receiver_count == int(same), (last, position)
        assert durable.position == (position if same else last), (last, position)
