"""IPC streams through a real driver process: offer/poll, limits, batches, claims, waiting."""

from __future__ import annotations

import logging
import multiprocessing
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from array import array
from pathlib import Path

import pytest
from helpers import wait_for

from slipstream.client import (
    BACK_PRESSURED,
    CLOSED,
    NOT_CONNECTED,
    BufferClaim,
    ChannelWarning,
    Client,
    ClosedError,
    InvalidArgumentError,
    MessageBatch,
    MessageTooLongError,
    RegistrationError,
    UsageError,
)
from slipstream.client.client import RESOURCE_LINGER_S
from slipstream.client.counters import (
    CountersFile,
    CounterType,
    SystemCounter,
    read_system_counters,
)
from slipstream.client.layout import INT32_MAX, INT32_MIN, INT64_MAX, INT64_MIN
from slipstream.client.logbuffer import LogBuffer
from slipstream.client.subscription import Image
from slipstream.daemon.driver import MediaDriver

CHANNEL = "aeron:ipc"
WINDOW = 32 * 1024  # 64 KiB IPC terms in the test driver: the window is half a term


def offer_until(publication, message: bytes, timeout: float = 5.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = publication.offer(message)
        if result > 0:
            return result
        time.sleep(0.0005)
    raise AssertionError(f"offer did not succeed within {timeout} s (last result {result})")


def test_offer_without_a_subscriber_is_not_connected(client: Client) -> None:
    publication = client.add_publication(CHANNEL, 1001)
    assert not publication.is_connected
    assert publication.offer(b"nobody listens") == NOT_CONNECTED


def test_messages_arrive_whole_and_in_order_including_fragmented_ones(client: Client) -> None:
    subscription = client.add_subscription(CHANNEL, 1002)
    publication = client.add_publication(CHANNEL, 1002)
    wait_for(lambda: subscription.images and publication.is_connected)
    sent = [bytes([i % 251]) * (i * 97 % 5000) for i in range(300)]  # > mtu: fragmented
    received: list[bytes] = []
    headers: list[tuple[int, int]] = []

    def handler(data: memoryview, header) -> None:
        received.append(bytes(data))
        headers.append((header.session_id, header.stream_id))

    for message in sent:
        offer_until(publication, message)
        subscription.poll(handler, 10)
    while len(received) < len(sent):
        assert subscription.receive(handler, 100, timeout=5.0) > 0
    assert received == sent
    assert set(headers) == {(publication.session_id, 1002)}


def test_a_subscriber_that_does_not_poll_back_pressures_after_one_window(client: Client) -> None:
    subscription = client.add_subscription(CHANNEL, 1003)
    publication = client.add_publication(CHANNEL, 1003)
    wait_for(lambda: subscription.images and publication.is_connected)
    message = b"w" * 992  # 1 KiB frames
    accepted = 0
    while publication.offer(message) > 0:
        accepted += 1
    assert publication.offer(message) == BACK_PRESSURED
    assert accepted == WINDOW // 1024
    assert publication.publication_limit == subscription.images[0].position + WINDOW
    counters = client.counters
    assert counters.get(4) >= 1  # back-pressure events (SystemCounter.BACK_PRESSURE_EVENTS)
    # Consuming returns credit: the driver raises the limit and offers succeed again.
    assert subscription.poll(lambda d, h: None, 1000) == accepted
    offer_until(publication, message, timeout=2.0)


def test_publishers_of_one_stream_share_a_log_and_a_session(client: Client) -> None:
    first = client.add_publication(CHANNEL, 1004)
    second = client.add_publication(CHANNEL, 1004)
    assert first.session_id == second.session_id
    subscription = client.add_subscription(CHANNEL, 1004)
    wait_for(lambda: first.is_connected)
    offer_until(first, b"one")
    offer_until(second, b"two")
    received: list[bytes] = []
    subscription.receive(lambda d, h: received.append(bytes(d)), 10, timeout=2.0)
    assert received == [b"one", b"two"]


@pytest.mark.parametrize("subscription_first", [True, False])
def test_an_offer_as_soon_as_both_ends_are_added_is_taken(client: Client,
                                                         subscription_first: bool) -> None:
    """The README's first program offers right after adding both ends: the driver gives the
    credit as it attaches the subscriber, not at its next duty cycle (the offer got
    NOT_CONNECTED now and then, and the program printed nothing)."""
    for stream_id in range(2000, 2100):
        if subscription_first:
            subscription = client.add_subscription(CHANNEL, stream_id)
            publication = client.add_publication(CHANNEL, stream_id)
        else:
            publication = client.add_publication(CHANNEL, stream_id)
            subscription = client.add_subscription(CHANNEL, stream_id)
        assert publication.offer(b"hello") > 0, stream_id
        got: list[bytes] = []
        assert subscription.poll(lambda d, h, got=got: got.append(bytes(d)), 10) == 1, stream_id
        assert got == [b"hello"]
        publication.close()
        subscription.close()


def test_a_late_subscriber_joins_at_the_current_position(client: Client) -> None:
    early = client.add_subscription(CHANNEL, 1005)
    publication = client.add_publication(CHANNEL, 1005)
    wait_for(lambda: publication.is_connected)
    for i in range(10):
        offer_until(publication, f"before-{i}".encode())
    late = client.add_subscription(CHANNEL, 1005)
    wait_for(lambda: bool(late.images))
    assert late.images[0].join_position == publication.position
    offer_until(publication, b"after")
    got: list[bytes] = []
    late.receive(lambda d, h: got.append(bytes(d)), 10, timeout=2.0)
    assert got == [b"after"]
    assert early.poll(lambda d, h: None, 100) == 11


def test_try_claim_fills_in_place_and_abort_leaves_padding(client: Client) -> None:
    subscription = client.add_subscription(CHANNEL, 1006)
    publication = client.add_publication(CHANNEL, 1006)
    wait_for(lambda: publication.is_connected)
    claim = BufferClaim()
    assert publication.try_claim(5, claim) > 0
    claim.buffer[:] = b"hello"
    claim.commit()
    assert publication.try_claim(7, claim) > 0
    claim.abort()
    with pytest.raises(ValueError, match="boom"):
        assert publication.try_claim(3, claim) > 0
        with claim:
            raise ValueError("boom")  # the claim is aborted, never half-published
    got: list[bytes] = []
    subscription.receive(lambda d, h: got.append(bytes(d)), 10, timeout=2.0)
    assert got == [b"hello"]


def test_batches_move_many_messages_per_call_each_way(client: Client) -> None:
    subscription = client.add_subscription(CHANNEL, 1007)
    publication = client.add_publication(CHANNEL, 1007)
    wait_for(lambda: subscription.images and publication.is_connected)
    messages = [i.to_bytes(4, "little") * 8 for i in range(64)]
    assert publication.offer_batch(b"".join(messages), [32] * 64) == 64
    batch = subscription.poll_batch(1000)
    assert isinstance(batch, MessageBatch)
    assert [bytes(m) for m in batch] == messages
    assert batch.lengths == [32] * 64
    assert subscription.poll_batch(1000) is None
    # A batch larger than the window stops at the limit and says how far it got.  The
    # conductor raises pub-lmt for the poll above on its own cycle: the room is read once
    # it has settled (a CI run once read 28 before the offer found 32).
    big = [b"b" * 992] * 64
    room, deadline = -1, time.monotonic() + 5
    while room != (room := (publication.publication_limit - publication.position) // 1024):
        assert time.monotonic() < deadline, "pub-lmt did not settle"
        time.sleep(0.05)
    done = publication.offer_batch(b"".join(big), [992] * 64)
    assert 0 < done == room < 64


def test_poll_batch_hands_over_each_fragmented_message_once(client: Client) -> None:
    subscription = client.add_subscription(CHANNEL, 1017)
    publication = client.add_publication(CHANNEL, 1017)
    wait_for(lambda: subscription.images and publication.is_connected)
    messages = [bytes([i]) * 5000 for i in range(5)]  # each four frames of a 1408-byte MTU
    assert publication.offer_batch(b"".join(messages), [5000] * 5) == 5
    got = []
    while (batch := subscription.poll_batch(1000)) is not None:
        got.extend(bytes(m) for m in batch)
    assert got == messages


def test_poll_gathered_copies_out_what_peek_delivers_across_terms_and_fragments(
        client: Client) -> None:
    """Messages of 0 B to 5 KiB (fragmented ones too) with reserved values, over four 64 KiB
    terms: a detached reader's poll_gathered, never past its limit, gives exactly the payloads,
    positions and reserved values a peek delivers, the offsets and lengths agreeing."""
    subscription = client.add_subscription(CHANNEL, 1019)
    publication = client.add_publication(f"{CHANNEL}?term-length=64k", 1019)
    wait_for(lambda: subscription.images and publication.is_connected)
    image = subscription.images[0]
    reader = Image.detached(image.log_path, image.position)
    expected: list[tuple[bytes, int, int]] = []
    got: list[tuple[bytes, int, int]] = []
    sizes = [(i * 911) % 5200 for i in range(160)]
    for chunk in range(0, len(sizes), 4):  # at most 21 KB: within the 32 KiB window
        for i in range(chunk, chunk + 4):
            deadline = time.monotonic() + 10  # the driver raises the limit after a poll
            while publication.offer(bytes([i % 256]) * sizes[i], reserved_value=-i) < 0:
                assert time.monotonic() < deadline
                time.sleep(0.0005)
        limit = image.available_position()
        image.peek(reader.position, lambda d, h: expected.append(
            (bytes(d), h.position, h.reserved_value)), limit)
        while (batch := reader.poll_gathered(5, limit)) is not None:
            assert len(batch.offsets) == len(batch) + 1 and batch.offsets[0] == 0
            assert list(batch.lengths) == [batch.offsets[k + 1] - batch.offsets[k]
                                           for k in range(len(batch))]
            assert len(batch.data) == batch.offsets[-1]
            got.extend((bytes(batch.data[batch.offsets[k]:batch.offsets[k + 1]]),
                        batch.positions[k], batch.reserved_values[k])
                       for k in range(len(batch)))
            assert batch.positions[-1] <= limit
        assert reader.position == limit
        while subscription.images[0].position < limit:  # credit for the next chunk
            subscription.poll(lambda d, h: None, 100)
    assert reader.position > 4 * 64 * 1024
    assert got == expected and len(got) == len(sizes)
    assert [row[2] for row in got] == [-i for i in range(len(sizes))]


@pytest.mark.parametrize("kind", ["list", "array", "int32 numpy", "int64 numpy"])
def test_batch_lengths_may_be_any_sequence_of_ints(client: Client, kind: str) -> None:
    import numpy as np

    stream_id = 1020 + ["list", "array", "int32 numpy", "int64 numpy"].index(kind)
    subscription = client.add_subscription(CHANNEL, stream_id)
    publication = client.add_publication(CHANNEL, stream_id)
    wait_for(lambda: subscription.images and publication.is_connected)
    sizes = [0, 1, 31, 32, 100, 7]
    lengths = {"list": sizes, "array": array("i", sizes),
               "int32 numpy": np.array(sizes, dtype=np.int32),
               "int64 numpy": np.array(sizes, dtype=np.int64)}[kind]
    messages = [bytes([i]) * size for i, size in enumerate(sizes)]
    assert publication.offer_batch(b"".join(messages), lengths) == len(sizes)
    batch = subscription.poll_batch(1000)
    assert [bytes(m) for m in batch] == messages
    with pytest.raises(ValueError, match="add up to 171 bytes"):
        publication.offer_batch(b"x" * 170, lengths)


def reserved(i: int) -> int:
    """A reserved value for message ``i``, anywhere in the int64 range (negatives too)."""
    return (i * 0x9E3779B97F4A7C15) % 2**64 - 2**63


def test_the_reserved_value_a_publisher_sets_is_the_one_its_subscribers_headers_show(
        client: Client) -> None:
    """offer's reserved_value (by keyword or position), offer_batch's reserved_values (a list,
    array('q'), int64 numpy arrays, contiguous or not) and a claim's reserved_value reach the
    subscriber's header in poll and in peek, also for messages fragmented over several frames;
    0 when none is given."""
    import numpy as np

    subscription = client.add_subscription(CHANNEL, 1030)
    publication = client.add_publication(CHANNEL, 1030)
    wait_for(lambda: subscription.images and publication.is_connected)
    [image] = subscription.images
    start = image.position
    big = publication.max_payload_length * 3 + 5  # four frames
    expected: list[tuple[bytes, int]] = []
    for i, size in enumerate([0, 32, big, 1000, publication.max_payload_length + 1]):
        data, value = bytes([i]) * size, reserved(i)
        if i % 2:
            assert publication.offer(data, value) > 0
        else:
            assert publication.offer(data, reserved_value=value) > 0
        expected.append((data, value))
    for value in (INT64_MIN, INT64_MAX, -1, np.int64(-3)):
        assert publication.offer(b"edge", reserved_value=value) > 0
        expected.append((b"edge", int(value)))
    assert publication.offer(b"none") > 0
    expected.append((b"none", 0))
    sizes = [10, big, 0, 300]
    for form in ("list", "array", "numpy", "strided numpy"):
        first = 100 * len(expected)
        values = [reserved(first + k) for k in range(len(sizes))]
        given = {"list": values, "array": array("q", values),
                 "numpy": np.array(values, dtype=np.int64),
                 "strided numpy": np.array(values, dtype=np.int64).repeat(2)[::2]}[form]
        messages = [bytes([k + 1]) * size for k, size in enumerate(sizes)]
        assert publication.offer_batch(b"".join(messages), sizes, given) == len(sizes)
        expected += zip(messages, values, strict=True)
    claim = BufferClaim()
    assert publication.try_claim(6, claim) > 0
    assert claim.reserved_value == 0
    claim.reserved_value = reserved(7)
    claim.buffer[:] = b"claim!"
    assert claim.reserved_value == reserved(7)
    claim.commit()
    expected.append((b"claim!", reserved(7)))
    with pytest.raises(UsageError, match="nothing claimed"):
        claim.reserved_value = 1  # committed: the frame is the readers' now

    def reader(into: list[tuple[bytes, int]]):
        return lambda data, header: into.append((bytes(data), header.reserved_value))

    polled: list[tuple[bytes, int]] = []
    while subscription.poll(reader(polled), 100):
        pass
    assert polled == expected
    peeked: list[tuple[bytes, int]] = []
    assert image.peek(start, reader(peeked), image.position) == image.position
    assert peeked == expected


def test_a_bad_reserved_value_is_refused_by_name_and_appends_nothing(client: Client) -> None:
    import numpy as np

    subscription = client.add_subscription(CHANNEL, 1031)
    publication = client.add_publication(CHANNEL, 1031)
    wait_for(lambda: subscription.images and publication.is_connected)
    before = publication.position
    for bad in (1.5, "7", None, True, 2**63, -2**63 - 1, np.float64(2)):
        with pytest.raises(InvalidArgumentError, match=r"^reserved_value: "):
            publication.offer(b"x", reserved_value=bad)
        with pytest.raises(InvalidArgumentError, match=r"^reserved_value: "):
            publication.offer(b"x", bad)
    with pytest.raises(TypeError, match="reserved_value=0"):
        publication.offer(b"x", reserved=1)
    with pytest.raises(TypeError, match="twice"):
        publication.offer(b"x", 1, reserved_value=2)
    with pytest.raises(TypeError, match="positional"):
        publication.offer(b"x", 1, 2)
    with pytest.raises(InvalidArgumentError, match=r"^reserved_values: 2 values for 3 messages"):
        publication.offer_batch(b"abc", [1, 1, 1], [5, 6])
    with pytest.raises(InvalidArgumentError, match=r"^reserved_values: 4 values for 3 messages"):
        publication.offer_batch(b"abc", [1, 1, 1], np.arange(4))
    for bad_values in ([1, 2, 2**63], [1.5, 2, 3], b"\x00" * 24, "abc", np.ones(3), 7):
        with pytest.raises(InvalidArgumentError, match=r"^reserved_values: "):
            publication.offer_batch(b"abc", [1, 1, 1], bad_values)
    claim = BufferClaim()
    with pytest.raises(UsageError, match="nothing claimed"):
        claim.reserved_value = 1
    with pytest.raises(UsageError, match="nothing claimed"):
        _ = claim.reserved_value
    assert publication.try_claim(4, claim) > 0
    for bad in (1.5, 2**63, None):
        with pytest.raises(InvalidArgumentError, match=r"^reserved_value: "):
            claim.reserved_value = bad
    assert claim.reserved_value == 0
    claim.abort()
    assert publication.position == before + 64  # the aborted claim's padding, nothing else
    assert subscription.poll(lambda data, header: pytest.fail("nothing was published"), 10) == 0


def test_receive_waits_for_data_and_times_out(client: Client) -> None:
    subscription = client.add_subscription(CHANNEL, 1008)
    publication = client.add_publication(CHANNEL, 1008)
    wait_for(lambda: publication.is_connected)
    started = time.monotonic()
    assert subscription.receive(lambda d, h: None, 10, timeout=0.2) == 0
    assert 0.19 <= time.monotonic() - started < 1.0
    offer_until(publication, b"wake up")
    assert subscription.receive(lambda d, h: None, 10, timeout=2.0) == 1
    # A wait that may take no message would spin a core until its timeout: refused.
    from slipstream.client import InvalidArgumentError

    for limit in (0, -1):
        with pytest.raises(InvalidArgumentError, match="fragment_limit"):
            subscription.receive(lambda d, h: None, limit, timeout=1.0)
        with pytest.raises(InvalidArgumentError, match="fragment_limit"):
            subscription.messages(limit)


def test_closing_a_subscription_wakes_a_receive_parked_on_its_image(client: Client) -> None:
    """A receive parked on an image's futex returns as the subscription closes (from another
    thread), not when its park slice (_PARK_SLICE_NS, 1 s) ends."""
    subscription = client.add_subscription(CHANNEL, 1031)
    publication = client.add_publication(CHANNEL, 1031)
    wait_for(lambda: subscription.images and publication.is_connected)
    returned: list[float] = []

    def receive() -> None:
        subscription.receive(lambda d, h: None, 10, timeout=10.0)
        returned.append(time.monotonic())

    waiter = threading.Thread(target=receive)
    waiter.start()
    time.sleep(0.3)  # spun, then parked on the image
    closed = time.monotonic()
    subscription.close()
    waiter.join(5)
    assert returned and returned[0] - closed < 0.2, returned


def _idle_receiver(directory: str, ready, cpu) -> None:
    with Client.connect(directory) as client:
        subscription = client.add_subscription(CHANNEL, 1009)
        while not subscription.images:
            time.sleep(0.01)
        subscription.receive(lambda d, h: None, 10, timeout=0.2)  # settle
        ready.set()
        start = resource.getrusage(resource.RUSAGE_SELF)
        subscription.receive(lambda d, h: None, 10, timeout=2.0)
        end = resource.getrusage(resource.RUSAGE_SELF)
        cpu.value = (end.ru_utime + end.ru_stime) - (start.ru_utime + start.ru_stime)


def test_a_waiting_subscriber_uses_almost_no_cpu(driver_dir: Path) -> None:
    context = multiprocessing.get_context("spawn")
    ready, cpu = context.Event(), context.Value("d", -1.0)
    # The default timers: the test drivers' 100 ms keepalives alone cost ~1 % of a core here.
    with MediaDriver.launch(directory=driver_dir, ipc_term_buffer_length="64k") as driver, \
            Client.connect(driver.directory) as client:
        client.add_publication(CHANNEL, 1009)
        process = context.Process(target=_idle_receiver, args=(str(driver.directory), ready, cpu))
        process.start()
        assert ready.wait(30)
        process.join(30)
    assert process.exitcode == 0
    assert 0 <= cpu.value < 0.04, f"waiting 2 s cost {cpu.value:.4f} s of CPU (over 2 %)"


def _resident_kib(pid: int, file_name: str) -> list[int]:
    """The resident KiB of each mapping of ``pid`` of a file named ``file_name``."""
    resident, inside = [], False
    with open(f"/proc/{pid}/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5:  # a mapping's first line
                inside = len(fields) >= 6 and os.path.basename(fields[5]) == file_name
            elif inside and fields[0] == "Rss:":
                resident.append(int(fields[1]))
    return resident


def test_a_dense_ipc_log_is_reserved_not_faulted_into_the_drivers_mapping(
        driver, client: Client) -> None:
    """The driver's view of an IPC log carries no data path: its pages are reserved (a dense
    log, sparse=false), and the publisher maps its own, but the conductor does not spend CPU
    faulting them into its own mapping (154 against 56 ms for a default 192 MiB log)."""
    publication = client.add_publication(f"{CHANNEL}?term-length=16m|sparse=false", 55)
    log_name = publication._log.path.name  # which file is its log
    in_driver = _resident_kib(driver.pid, log_name)
    in_client = _resident_kib(os.getpid(), log_name)
    assert in_driver and in_client, (in_driver, in_client)
    assert sum(in_client) >= 48 * 1024  # the publisher's mapping: every page, up front
    assert sum(in_driver) < 1024, in_driver  # the driver's: what it touched (metadata)


def test_closed_publication_returns_closed_and_never_touches_its_log(client: Client) -> None:
    publication = client.add_publication(CHANNEL, 1010)
    client.add_subscription(CHANNEL, 1010)
    wait_for(lambda: publication.is_connected)
    offer_until(publication, b"one")
    position = publication.position
    publication.close()
    assert publication.offer(b"late") == CLOSED
    assert publication.offer_batch(b"xx", [1, 1]) == CLOSED
    assert publication.try_claim(1, BufferClaim()) == CLOSED
    assert publication.is_closed and not publication.is_connected
    assert publication.position == position  # the log is unmapped: no read of it
    assert "position=" in repr(publication)


def test_the_image_goes_when_the_last_publisher_leaves(client: Client) -> None:
    gone: list[int] = []
    kept: list = []

    def went(image) -> None:
        gone.append(image.session_id)
        kept.append(image)

    subscription = client.add_subscription(CHANNEL, 1011, on_unavailable_image=went)
    publication = client.add_publication(CHANNEL, 1011)
    wait_for(lambda: publication.is_connected)
    offer_until(publication, b"last words")
    session_id = publication.session_id
    publication.close()
    got: list[bytes] = []
    subscription.receive(lambda d, h: got.append(bytes(d)), 10, timeout=2.0)
    assert got == [b"last words"]  # drained before the image went away
    wait_for(lambda: gone == [session_id])
    assert subscription.images == ()
    [image] = kept
    assert not image.is_closed  # a poll may still be inside it: the polling thread unmaps it
    subscription.poll(lambda d, h: None, 10)
    assert image.is_closed  # at its next poll, not when the subscription closes


@pytest.mark.parametrize("subscription_channel", [
    CHANNEL,
    # Untethered, and a window behind for longer than its window limit timeout: it was left
    # behind while the log drained, and lost it all the same.
    f"{CHANNEL}?tether=false|untethered-window-limit-timeout=1s",
])
def test_a_subscriber_that_reads_lingers_after_the_last_publisher_left_gets_it_all(
        driver, client: Client, subscription_channel: str) -> None:
    """The log of a stream whose last publisher closed stays until its subscribers read it,
    however long they take (here three linger timeouts: it was deleted at the first, and a
    subscriber that read 7 s after its publisher closed got none of 10,000 messages, told of
    nothing).  Then it goes."""
    subscription = client.add_subscription(subscription_channel, 1012)
    publication = client.add_publication("aeron:ipc?term-length=1m", 1012)
    wait_for(lambda: publication.is_connected)
    sent = 0
    while publication.offer(b"%07d" % sent) > 0:  # a term window: it does not read yet
        sent += 1
    assert sent > 5000
    publication.close()
    time.sleep(3 * 0.5)  # FAST_DRIVER_SETTINGS' publication_linger_timeout, thrice
    got: list[bytes] = []
    while len(got) < sent:
        assert subscription.poll(lambda d, h: got.append(bytes(d)), 1000) > 0, len(got)
    assert got == [b"%07d" % i for i in range(sent)]
    wait_for(lambda: subscription.images == ())  # read it all: the log went
    assert list((Path(driver.directory) / "publications").iterdir()) == []


def test_linger_on_an_ipc_publication_is_warned_of(client: Client) -> None:
    """Aeron's URIs may carry it; an IPC log has nothing to linger for (it goes once read)."""
    with pytest.warns(ChannelWarning, match="linger does nothing on aeron:ipc"):
        client.add_publication("aeron:ipc?linger=30s", 1013)


def _subscribe_and_hang(directory: str, stream_id: int, ready) -> None:
    client = Client.connect(directory)
    subscription = client.add_subscription(CHANNEL, stream_id)
    while not subscription.images:
        time.sleep(0.01)
    ready.set()
    time.sleep(3600)  # never polls; killed by the test


def test_a_killed_subscriber_stops_holding_back_the_publisher(driver) -> None:
    context = multiprocessing.get_context("spawn")
    ready = context.Event()
    with Client.connect(driver.directory) as client:
        publication = client.add_publication(CHANNEL, 1012)
        live = client.add_subscription(CHANNEL, 1012)
        victim = context.Process(target=_subscribe_and_hang,
                                 args=(str(driver.directory), 1012, ready))
        victim.start()
        assert ready.wait(30)
        message = b"k" * 992
        while publication.offer(message) > 0:
            live.poll(lambda d, h: None, 100)
        assert publication.offer(message) == BACK_PRESSURED  # the silent subscriber holds it
        victim.kill()
        victim.join()
        # After the client liveness timeout (1 s here) its position no longer counts.
        deadline = time.monotonic() + 5
        while publication.offer(message) < 0:
            live.poll(lambda d, h: None, 100)
            assert time.monotonic() < deadline, "the dead subscriber still holds the publisher"
            time.sleep(0.01)
        counters = CountersFile(driver.directory / "counters.dat", writable=False)
        positions = [c for c in counters if c.type_id == CounterType.SUBSCRIBER_POSITION]
        assert len(positions) == 1  # only the live subscriber's counter is left
        assert counters.get(3) == 1  # client timeouts
        counters.close()


def _claim_and_die(directory: str, stream_id: int, ready) -> None:
    client = Client.connect(directory)
    publication = client.add_publication(CHANNEL, stream_id)
    while not publication.is_connected:
        time.sleep(0.01)
    claim = BufferClaim()
    assert publication.try_claim(100, claim) > 0
    ready.set()
    time.sleep(3600)  # killed between claim and commit


def test_a_publisher_killed_between_claim_and_commit_is_unblocked(driver) -> None:
    context = multiprocessing.get_context("spawn")
    ready = context.Event()
    with Client.connect(driver.directory) as client:
        subscription = client.add_subscription(CHANNEL, 1013)
        publication = client.add_publication(CHANNEL, 1013)
        victim = context.Process(target=_claim_and_die, args=(str(driver.directory), 1013, ready))
        victim.start()
        assert ready.wait(30)
        offer_until(publication, b"behind the claim")
        victim.kill()
        victim.join()
        got: list[bytes] = []
        assert subscription.poll(lambda d, h: got.append(bytes(d)), 10) == 0  # blocked
        # The unblock timeout is 1.5 s in the test driver.
        subscription.receive(lambda d, h: got.append(bytes(d)), 10, timeout=5.0)
        assert got == [b"behind the claim"]
        counters = CountersFile(Path(driver.directory) / "counters.dat", writable=False)
        assert counters.get(5) == 1  # unblocked publications
        counters.close()


def test_a_blocked_claim_is_unblocked_while_a_slow_subscriber_lags_behind_it(driver) -> None:
    """The fastest subscriber is the one held at the dead claim; a slow one that has not read
    what came before it must not stop the unblock (Aeron unblocks at the fastest)."""
    context = multiprocessing.get_context("spawn")
    ready = context.Event()
    with Client.connect(driver.directory) as client:
        fast = client.add_subscription(CHANNEL, 1014)
        slow = client.add_subscription(CHANNEL, 1014)  # never polled until the end
        publication = client.add_publication(CHANNEL, 1014)
        for i in range(10):
            offer_until(publication, f"before {i}".encode())
        victim = context.Process(target=_claim_and_die, args=(str(driver.directory), 1014, ready))
        victim.start()
        assert ready.wait(30)
        offer_until(publication, b"behind the claim")
        victim.kill()
        victim.join()
        got: list[bytes] = []
        deadline = time.monotonic() + 10  # the unblock timeout is 1.5 s in the test driver
        while b"behind the claim" not in got and time.monotonic() < deadline:
            fast.receive(lambda d, h: got.append(bytes(d)), 10, timeout=0.2)
        assert got == [f"before {i}".encode() for i in range(10)] + [b"behind the claim"]
        lagging: list[bytes] = []
        slow.poll(lambda d, h: lagging.append(bytes(d)), 100)
        assert lagging == got  # the padded claim is skipped by every subscriber


@pytest.mark.parametrize(("second", "part"), [
    ("aeron:ipc?term-length=128k", "term-length"),
    ("aeron:ipc?mtu=4096", "mtu"),
    ("aeron:ipc?session-id=77", "session-id"),
])
def test_a_second_publisher_asking_for_another_log_or_session_is_refused_by_name(
        client: Client, second: str, part: str) -> None:
    first = client.add_publication("aeron:ipc?term-length=64k|mtu=1408|session-id=76", 1015)
    with pytest.raises(RegistrationError,
                       match=f"{part}: .* differs from the existing publication's .* stream 1015"):
        client.add_publication(second, 1015)
    same = client.add_publication("aeron:ipc?term-length=64k", 1015)  # a match shares it
    assert same.session_id == first.session_id == 76
    first.close()
    same.close()


def test_a_commit_after_the_driver_gave_the_claim_up_says_so_and_does_not_block(
        client: Client) -> None:
    subscription = client.add_subscription(CHANNEL, 1016)
    publication = client.add_publication(CHANNEL, 1016)
    # The driver links the subscriber on its own cycle: a claim before that is NOT_CONNECTED.
    wait_for(lambda: publication.is_connected, what="the subscriber linked")
    claim = BufferClaim()
    assert publication.try_claim(64, claim) > 0
    claim.buffer[:] = b"c" * 64
    offer_until(publication, b"after the claim")
    got: list[bytes] = []
    deadline = time.monotonic() + 10  # the unblock timeout is 1.5 s in the test driver
    while not got and time.monotonic() < deadline:
        subscription.receive(lambda d, h: got.append(bytes(d)), 10, timeout=0.2)
    assert got == [b"after the claim"]  # the claim became padding
    assert claim.commit() is False  # too late: not published, and it says so
    offer_until(publication, b"still flowing")
    subscription.receive(lambda d, h: got.append(bytes(d)), 10, timeout=5)
    assert got == [b"after the claim", b"still flowing"]
    on_time = BufferClaim()
    assert publication.try_claim(8, on_time) > 0
    on_time.buffer[:] = b"in time!"
    assert on_time.commit() is True


def test_an_image_handler_that_raises_is_logged_and_the_client_lives_on(
        client: Client, caplog: pytest.LogCaptureFixture) -> None:
    def broken(image: object) -> None:
        raise ValueError("a bug in the application")

    subscription = client.add_subscription(CHANNEL, 1017, on_available_image=broken,
                                           on_unavailable_image=broken)
    publication = client.add_publication(CHANNEL, 1017)
    wait_for(lambda: subscription.images, what="the image")
    time.sleep(2.5)  # past the test driver's 1 s client liveness timeout: keepalives went on
    offer_until(publication, b"alive")
    got: list[bytes] = []
    subscription.receive(lambda d, h: got.append(bytes(d)), 10, timeout=5)
    assert got == [b"alive"]
    publication.close()
    wait_for(lambda: not subscription.images, what="the image went")

    def raised() -> list[logging.LogRecord]:
        return [r for r in caplog.records if "image handler" in r.getMessage()]

    # The handler runs just after the image leaves subscription.images (outside the lock
    # that a reader of images takes): the CI once read the log between the two.
    wait_for(lambda: len(raised()) >= 2, what="the unavailable image's handler ran")
    assert len(raised()) == 2 and "a bug in the application" in caplog.text
    assert client.counters.get(SystemCounter.CLIENT_TIMEOUTS) == 0


def _close_while_offering(directory: str, rounds: int) -> None:
    import threading

    with Client.connect(directory) as client:
        subscription = client.add_subscription(CHANNEL, 1018)
        lengths = array("i", [1000] * 8192)  # 8 MiB per call: milliseconds inside C
        data = bytes(1000 * 8192)
        for _ in range(rounds):
            publication = client.add_publication(f"{CHANNEL}?term-length=16m", 1018)
            results: list[int] = []

            def offer_batches(publication=publication, results=results) -> None:
                while True:
                    result = publication.offer_batch(data, lengths)
                    subscription.poll_batch(100_000)
                    if result == CLOSED:
                        results.append(result)
                        return

            offering = threading.Thread(target=offer_batches)
            offering.start()
            time.sleep(0.02)
            publication.close()  # while the other thread is inside offer_batch, GIL released
            offering.join(10)
            assert results == [CLOSED]


def test_closing_a_publication_while_another_thread_offers_never_faults(driver) -> None:
    """The log stays mapped for the resource linger after close: a thread still inside the C
    offer sees CLOSED at its next call, and never an unmapped page (a fault would kill the
    process: it runs in a child)."""
    context = multiprocessing.get_context("spawn")
    child = context.Process(target=_close_while_offering, args=(str(driver.directory), 30))
    child.start()
    child.join(120)
    assert child.exitcode == 0


def _publish_sequence(directory: str, stream_id: int, count: int) -> None:
    with Client.connect(directory) as client:
        publication = client.add_publication(CHANNEL, stream_id)
        for i in range(count):
            message = i.to_bytes(8, "little") * 4
            while publication.offer(message) < 0:
                pass


def test_a_stream_between_two_processes_loses_and_reorders_nothing(driver) -> None:
    count = 200_000
    context = multiprocessing.get_context("spawn")
    with Client.connect(driver.directory) as client:
        subscription = client.add_subscription(CHANNEL, 1014)
        publisher = context.Process(target=_publish_sequence,
                                    args=(str(driver.directory), 1014, count))
        publisher.start()
        expected = [0]

        def handler(data: memoryview, header) -> None:
            assert int.from_bytes(data[:8], "little") == expected[0]
            expected[0] += 1

        deadline = time.monotonic() + 60
        while expected[0] < count and time.monotonic() < deadline:
            subscription.receive(handler, 1000, timeout=1.0)
        publisher.join(30)
        assert expected[0] == count


def _read_range(log_path: str, start: int, end: int, out) -> None:
    from slipstream.client import Image

    reader = Image.detached(log_path, start)
    got: list[bytes] = []
    reader.peek(start, lambda d, h: got.append(bytes(d)), end)
    out.put(got)


def test_peek_holds_credit_until_the_position_is_committed(client: Client) -> None:
    subscription = client.add_subscription(CHANNEL, 1015)
    publication = client.add_publication(CHANNEL, 1015)
    wait_for(lambda: subscription.images and publication.is_connected)
    image = subscription.images[0]
    start = image.position
    message = b"c" * 992
    sent = 0
    while publication.offer(message) > 0:
        sent += 1
    end = image.available_position()
    assert end == start + sent * 1024
    # Another process reads the range through its own mapping, consuming nothing.
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    reader = context.Process(target=_read_range, args=(image.log_path, start, end, queue))
    reader.start()
    assert queue.get(timeout=30) == [message] * sent
    reader.join(10)
    assert image.position == start
    assert publication.offer(message) == BACK_PRESSURED  # credit still held
    image.position = end  # commit
    offer_until(publication, message, timeout=2.0)
    with pytest.raises(ValueError):
        image.position = start  # never backwards


def test_an_image_position_set_out_of_bounds_is_refused_and_never_unbinds_the_publisher(
        client: Client) -> None:
    """The subscriber's position bounds the publishers' limit: one set beyond what the log
    holds, on a closed image, or inside a frame must not move it anywhere (a position inside
    a fragmented message's frame once read payload bytes as a frame length and jumped 774 MB,
    taking the limit off the publisher)."""
    from slipstream.client import ClosedError, InvalidArgumentError

    channel = "aeron:ipc?term-length=64k"
    subscription = client.add_subscription(channel, 1030)
    publication = client.add_publication(channel, 1030)
    wait_for(lambda: subscription.images and publication.is_connected)
    [image] = subscription.images
    fragmented = b"x" * (publication.max_payload_length + 100)  # two frames
    for _ in range(3):
        offer_until(publication, fragmented)
    written = publication.position
    with pytest.raises(InvalidArgumentError, match="beyond what the log holds"):
        image.position = 3 * 64 * 1024  # three terms ahead: the same offset, another term
    with pytest.raises(InvalidArgumentError, match="not where a message begins"):
        image.position = 32  # aligned, inside the first frame
    image.position = written  # the end of what was written is a boundary
    subscription.close()
    with pytest.raises(ClosedError):  # at once: the driver frees its counter now
        image.position = written


def test_a_peek_whose_limit_cuts_a_message_returns_that_messages_start(
        client: Client) -> None:
    """The position a peek returns is a message boundary (a commit of it must not skip the
    message the limit cut in two)."""
    subscription = client.add_subscription(CHANNEL, 1032)
    publication = client.add_publication(CHANNEL, 1032)
    wait_for(lambda: subscription.images and publication.is_connected)
    [image] = subscription.images
    start = image.position
    offer_until(publication, b"a" * 100)
    middle = publication.position
    offer_until(publication, b"f" * 3000)  # three frames
    delivered: list[bytes] = []
    returned = image.peek(start, lambda data, header: delivered.append(bytes(data)),
                          middle + 1024)
    assert delivered == [b"a" * 100]
    assert returned == middle
    assert image.peek(start, lambda data, header: None,
                      image.available_position()) == publication.position


def test_peek_at_overwritten_data_is_data_loss(client: Client) -> None:
    from slipstream.client import DataLossError

    subscription = client.add_subscription(CHANNEL, 1016)
    publication = client.add_publication(CHANNEL, 1016)
    wait_for(lambda: subscription.images and publication.is_connected)
    image = subscription.images[0]
    start = image.position
    for _ in range(400):  # ~6 terms of 64 KiB: the start was reused long ago
        offer_until(publication, b"d" * 992)
        subscription.poll(lambda d, h: None, 10)
    while subscription.poll(lambda d, h: None, 100):
        pass
    with pytest.raises(DataLossError) as error:
        image.peek(start, lambda d, h: None, image.position)
    assert str(start) in str(error.value)


def test_a_batch_whose_lengths_exceed_its_data_is_refused(client: Client) -> None:
    from slipstream.client import BufferClaim, InvalidArgumentError

    publication = client.add_publication(CHANNEL, 1017)
    client.add_subscription(CHANNEL, 1017)
    with pytest.raises(InvalidArgumentError, match="add up to 96 bytes"):
        publication.offer_batch(b"x" * 64, [32, 32, 32])
    # A negative length is named as such, not as a message too long.
    with pytest.raises(InvalidArgumentError, match=r"lengths\[1\] is -1"):
        publication.offer_batch(b"x" * 100, [1, -1, 100])
    with pytest.raises(InvalidArgumentError, match="a claim of -1 bytes"):
        publication.try_claim(-1, BufferClaim())


def test_batches_across_many_term_rotations_keep_every_message(client: Client) -> None:
    subscription = client.add_subscription(CHANNEL, 1018)
    publication = client.add_publication(CHANNEL, 1018)
    wait_for(lambda: subscription.images and publication.is_connected)
    sizes = [(i * 53) % 1500 for i in range(97)]  # some fragment at mtu 1408
    data = b"".join(bytes([i % 256]) * size for i, size in enumerate(sizes))
    received: list[bytes] = []
    sent = 0
    deadline = time.monotonic() + 20
    while sent < 20 * len(sizes):  # ~10 rotations of a 64 KiB term
        assert time.monotonic() < deadline
        start = sent % len(sizes)
        chunk = data[sum(sizes[:start]):]
        done = publication.offer_batch(chunk, sizes[start:])
        if done > 0:
            sent += done
        subscription.poll(lambda d, h: received.append(bytes(d)), 1000)
    while len(received) < sent:
        assert subscription.receive(lambda d, h: received.append(bytes(d)), 1000, timeout=5) > 0
    expected = [bytes([i % 256]) * size for i, size in enumerate(sizes)] * 20
    assert received == expected


def test_logs_are_dense_unless_the_uri_asks_for_sparse(client: Client) -> None:
    dense = client.add_publication("aeron:ipc?term-length=64k", 1030)
    sparse = client.add_publication("aeron:ipc?term-length=64k|sparse=true", 1031)
    assert not dense._log.is_sparse
    assert sparse._log.is_sparse


def test_the_time_a_command_takes_counts_in_the_conductors_max_cycle_time(
        driver: MediaDriver, client: Client, monkeypatch: pytest.MonkeyPatch) -> None:
    # Creating a 192 MiB log (64 MiB terms) is the conductor's longest work; it is done in a
    # command, outside the duty cycle, and must show in the counter operators read (the driver
    # records it before it answers).  The driver's share of the add is the request's round
    # trip; the client then maps and populates the log itself (3x as long on AMD EPYC).
    request = client._request
    waited: list[float] = []

    def timed_request(*args, **kwargs):
        started = time.monotonic()
        try:
            return request(*args, **kwargs)
        finally:
            waited.append(time.monotonic() - started)

    monkeypatch.setattr(client, "_request", timed_request)
    publication = client.add_publication(CHANNEL + "?term-length=64m", 1018)
    longest = read_system_counters(driver.directory)[SystemCounter.CONDUCTOR_MAX_CYCLE_TIME_NS]
    publication.close()
    assert longest >= waited[0] * 1e9 / 2, (longest, waited)


@pytest.mark.parametrize("spins", [16, None])
def test_a_loop_that_retries_at_once_yields_the_cpu_after_the_clients_spins(
        driver: MediaDriver, monkeypatch: pytest.MonkeyPatch, spins: int | None) -> None:
    yields = [0]
    real_yield = os.sched_yield

    def counted_yield() -> None:
        yields[0] += 1
        real_yield()

    monkeypatch.setattr(os, "sched_yield", counted_yield)  # offer_batch's and the polls'

    def yields_of(calls) -> int:
        before = yields[0]
        calls()
        return yields[0] - before

    with Client.connect(driver.directory, spins_before_yield=spins) as client:
        publication = client.add_publication(CHANNEL, 1019)  # nobody subscribes: no credit
        subscription = client.add_subscription(CHANNEL, 1020)  # nobody publishes: nothing
        message = bytes(32)
        for _ in range(200):
            assert publication.offer(message) == NOT_CONNECTED
        offers = publication.offer.yields  # offer() yields in C: it counts them itself
        batches = yields_of(lambda: [publication.offer_batch(message, [32])
                                     for _ in range(200)])
        polls = yields_of(lambda: [subscription.poll(lambda d, h: None, 10)
                                   for _ in range(200)])
        batch_polls = yields_of(lambda: [subscription.poll_batch() for _ in range(200)])
        # Credit resets the count: the next misses spin again first.
        peer = client.add_subscription(CHANNEL, 1019)
        wait_for(lambda: publication.is_connected, timeout=5, what="connected")
        assert publication.offer(message) > 0
        yielded = publication.offer.yields
        while publication.offer(message) > 0:  # the window fills: back-pressured from here
            pass
        for _ in range(15):
            publication.offer(message)
        after_credit = publication.offer.yields - yielded
        peer.close()
    if spins is None:
        assert (offers, batches, polls, batch_polls, after_credit) == (0, 0, 0, 0, 0)
    else:  # 200 misses: 16 spins, then 184 yields (poll_batch continues poll's count: 200);
        # after credit, spinning again
        assert (offers, batches, polls, batch_polls, after_credit) == (184, 184, 184, 200, 0)


def test_a_bad_spins_before_yield_names_itself(driver: MediaDriver) -> None:
    for bad in (-1, 1.5, 2**31):
        with pytest.raises(ValueError, match="spins_before_yield"):
            Client.connect(driver.directory, spins_before_yield=bad)


def test_bad_arguments_are_refused_by_name_before_anything_is_sent(
        driver: MediaDriver, client: Client) -> None:
    """Each raises InvalidArgumentError (or MessageTooLongError) naming the argument, at the
    call, not a TypeError or OverflowError from deep inside, nor a DriverTimeoutError that
    blames the driver, nor a byte buffer read as raw int32 lengths."""
    for bad in (0, -1, float("nan"), float("inf"), 1e300, "5", None):
        with pytest.raises(InvalidArgumentError, match=r"^timeout: "):
            Client.connect(driver.directory, timeout=bad)
    for bad in ("x", 1.5, -1, 10**30):
        with pytest.raises(InvalidArgumentError, match=r"^idle_spin_ns: "):
            Client.connect(driver.directory, idle_spin_ns=bad)
    with pytest.raises(InvalidArgumentError, match=r"^on_available_image: 3 is not callable"):
        client.add_subscription(CHANNEL, 29, on_available_image=3)
    with pytest.raises(InvalidArgumentError, match=r"^on_back_pressure: "):
        client.add_publication(CHANNEL, 29, on_back_pressure=5)
    publication = client.add_publication(CHANNEL, 29)
    subscription = client.add_subscription(CHANNEL, 29)
    for bad in (-1, float("nan"), "1"):
        with pytest.raises(InvalidArgumentError, match=r"^timeout: "):
            subscription.receive(lambda data, header: None, 10, timeout=bad)
    # inf is no limit, as None: it waits for the message that comes 0.2 s later (it raised
    # OverflowError once it came to wait)
    later = threading.Timer(0.2, offer_until, (publication, b"x"))
    later.start()
    try:
        assert subscription.receive(lambda data, header: None, 10, timeout=float("inf")) == 1
    finally:
        later.join()
    for lengths in (b"\x03\x00\x00\x00\x05\x00\x00\x00", bytearray([1, 1, 1, 1]), [2**31]):
        with pytest.raises(InvalidArgumentError, match=r"^lengths: "):
            publication.offer_batch(b"abcdefgh", lengths)
    claim = BufferClaim()
    with pytest.raises(MessageTooLongError):
        publication.try_claim(2**31, claim)
    with pytest.raises(InvalidArgumentError, match=r"^length: "):
        publication.try_claim("8", claim)
    publication.close()
    subscription.close()


def test_an_image_that_arrives_as_its_subscription_closes_is_unmapped_not_kept(
        client: Client) -> None:
    """The client's conductor saw the subscription open and mapped a new image's log; the
    application closed the subscription before the image was added: the closed subscription
    gets no image, and the log is unmapped (the linger of the others may be over)."""
    subscription = client.add_subscription("aeron:ipc", 28)
    publication = client.add_publication("aeron:ipc", 28)
    wait_for(lambda: subscription.images, what="the image")
    [image] = subscription.images
    late = Image(LogBuffer(image.log_path), client.counters.address(0), join_position=0,
                 correlation_id=image.correlation_id + 1, subscription=subscription)
    subscription.close()
    subscription._add_image(late)  # as the conductor thread would, a moment too late
    assert subscription.images == ()
    assert late._log.closed and late.is_closed
    publication.close()


def test_a_closed_subscriptions_image_logs_stay_mapped_for_the_resource_linger(
        client: Client) -> None:
    """close() may come from any thread (an image handler too) while a poll of the
    subscription runs in C on the polling thread: its images' logs are unmapped after the
    client's resource linger, as a closed publication's log, not at once under that poll."""
    from slipstream.client.client import RESOURCE_LINGER_S

    subscription = client.add_subscription("aeron:ipc", 27)
    publication = client.add_publication("aeron:ipc", 27)
    wait_for(lambda: subscription.images, what="the image")
    [image] = subscription.images
    subscription.close()
    assert not image._log.closed
    time.sleep(RESOURCE_LINGER_S + 0.5)
    assert image._log.closed  # not left to a poll that may never come
    publication.close()


def test_when_the_reserved_range_leaves_few_session_ids_the_last_free_ones_are_used_then_refused(
        driver_dir: Path) -> None:
    """Two ids outside the reserved range: two publications take them, a third is refused by
    name (the conductor used to draw at random for ever), and one freed is taken again."""
    with MediaDriver.launch(directory=driver_dir, ipc_term_buffer_length="64k",
                            publication_reserved_session_id_low=INT32_MIN,
                            publication_reserved_session_id_high=INT32_MAX - 2) as driver, \
            Client.connect(driver_dir) as client:
        first = client.add_publication("aeron:ipc", 1)
        second = client.add_publication("aeron:ipc", 2)
        assert {first.session_id, second.session_id} == {INT32_MAX - 1, INT32_MAX}
        with pytest.raises(RegistrationError, match="no session id is free"):
            client.add_publication("aeron:ipc", 3)
        freed = first.session_id
        first.close()
        # Freed once the driver has let the closed publication go (a cycle or so later).
        deadline = time.monotonic() + 10
        while True:
            try:
                third = client.add_publication("aeron:ipc", 3)
                break
            except RegistrationError:
                assert time.monotonic() < deadline, "the freed session id was never taken"
                time.sleep(0.05)
        assert third.session_id == freed
        third.close()
        second.close()
        assert driver.stop() == 0


def test_an_image_kept_after_its_subscription_closed_reads_nothing_and_never_crashes(
        client: Client) -> None:
    """A user may hold an Image past the client's resource linger, when its log is unmapped:
    poll and poll_batch find nothing and is_end_of_stream answers as it was (they used to
    read the unmapped log and kill the process with SIGSEGV); peek and available_position
    raise ClosedError."""
    publication = client.add_publication(CHANNEL, 1018)
    subscription = client.add_subscription(CHANNEL, 1018)
    wait_for(lambda: publication.is_connected and subscription.images, what="the image")
    offer_until(publication, b"one")
    image = subscription.images[0]
    subscription.close()
    wait_for(lambda: image.is_closed, timeout=RESOURCE_LINGER_S + 5, what="the image unmapped")
    assert image.poll(lambda data, header: None, 10) == 0
    assert image.poll_batch(10) is None
    assert image.is_end_of_stream is False
    with pytest.raises(ClosedError, match="the image is gone"):
        image.available_position()
    with pytest.raises(ClosedError, match="the image is gone"):
        image.peek(0, lambda data, header: None, 64)
    publication.close()


_CLOSE_IN_HANDLER = """
import sys, time
import slipstream.client.client as client_module
from slipstream.client import Client
client_module.RESOURCE_LINGER_S = 0.1  # the counters are unmapped while the handler sleeps
directory, size = sys.argv[1], int(sys.argv[2])
client = Client.connect(directory)
publication = client.add_publication("aeron:ipc", 61)
subscription = client.add_subscription("aeron:ipc", 61)
while not (publication.is_connected and subscription.is_connected):
    time.sleep(0.01)
for _ in range(3):
    while publication.offer(b"m" * size) < 0:
        pass
def handler(data, header):
    client.close()
    time.sleep(1.0)  # ten lingers: the unmap has surely run
print(subscription.poll(handler, 10), flush=True)
print(subscription.poll(handler, 10), flush=True)
"""


@pytest.mark.parametrize("size", [100, 3000], ids=["whole", "fragmented"])
def test_a_handler_that_closes_its_client_and_runs_past_the_linger_ends_its_poll_cleanly(
        driver, size: int) -> None:
    """A handler may close the client (or another thread may) while a poll runs: the poll
    ends cleanly (the messages its scan took are still handed over, from the log their views
    keep mapped; a fragmented message's assembly stops), stores nothing into the counters the
    linger unmapped meanwhile (it crashed with SIGSEGV; a fragmented message raised
    IndexError), and the next poll finds nothing."""
    result = subprocess.run([sys.executable, "-c", _CLOSE_IN_HANDLER, str(driver.directory),
                             str(size)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr[-2000:]
    expected = ["3", "0"] if size == 100 else ["1", "0"]
    assert result.stdout.split() == expected, (result.stdout, result.stderr[-2000:])


def test_a_claim_into_no_buffer_claim_or_an_open_one_is_refused_before_claiming(
        client: Client) -> None:
    """``try_claim(n, None)`` and a second claim into a BufferClaim still open used to claim
    the frame first and then lose it: every reader of the stream waited for the driver to
    give it up (15 s).  Both are refused before anything is claimed."""
    publication = client.add_publication("aeron:ipc", 62)
    subscription = client.add_subscription("aeron:ipc", 62)
    wait_for(lambda: publication.is_connected, what="connected")
    with pytest.raises(InvalidArgumentError, match="claim"):
        publication.try_claim(10, None)  # type: ignore[arg-type]
    claim = BufferClaim()
    assert publication.try_claim(5, claim) > 0
    with pytest.raises(UsageError, match="not yet committed"):
        publication.try_claim(5, claim)
    claim.buffer[:] = b"first"
    assert claim.commit()
    with pytest.raises(UsageError):
        claim.commit()
    assert publication.offer(b"second") > 0
    got: list[bytes] = []
    wait_for(lambda: subscription.poll(lambda data, _h: got.append(bytes(data)), 10) >= 0
             and len(got) == 2, timeout=5, what="both messages, well within the 15 s stall")
    assert got == [b"first", b"second"]


def test_a_forked_child_may_not_use_its_parents_client_and_its_close_does_nothing(
        client: Client) -> None:
    """The child shares the parent's socket to the driver and its locks (one the conductor
    thread held at the fork stays held): a request hung past its timeout, and close() with
    it.  Now a request raises UsageError at once, close() of the client or of one of its
    publications leaves the parent's alone, and the parent goes on."""
    publication = client.add_publication("aeron:ipc", 63)
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:  # the child: report, then leave without the parent's atexit hooks
        outcome = b"?"
        try:
            try:
                client.add_subscription("aeron:ipc", 63)
                outcome = b"no error"
            except UsageError:
                outcome = b"UsageError"
            publication.close()  # the parent's: nothing to tell the driver from here
            client.close()
        finally:
            os.write(write_end, outcome)
            os._exit(0)
    os.close(write_end)
    deadline = time.monotonic() + 10
    while (status := os.waitpid(child, os.WNOHANG))[0] == 0:
        if time.monotonic() > deadline:
            os.kill(child, signal.SIGKILL)
            os.waitpid(child, 0)
            pytest.fail("the child hung on its parent's client")
        time.sleep(0.01)
    status = status[1]
    with os.fdopen(read_end, "rb") as reader:
        assert reader.read() == b"UsageError" and status == 0
    subscription = client.add_subscription("aeron:ipc", 63)  # the parent's client still works
    wait_for(lambda: publication.is_connected and subscription.is_connected, what="connected")
