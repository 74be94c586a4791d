"""IPC streams through a real driver process: offer/poll, limits, batches, claims, reserved
values, waiting."""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
from array import array
from pathlib import Path

import pytest
from helpers import IPC_CHANNEL, connected_ipc, offer_until, runnable_s, wait_for

from slipstream.client import (
    BACK_PRESSURED,
    NOT_CONNECTED,
    BufferClaim,
    Client,
    InvalidArgumentError,
    MessageBatch,
    UsageError,
)
from slipstream.client.image import Image
from slipstream.client.layout import HEADER_LENGTH, INT64_MAX, INT64_MIN
from slipstream.client.subscription import _PARK_SLICE_NS
from slipstream.daemon.driver import MediaDriver

WINDOW = 32 * 1024  # 64 KiB IPC terms in the test driver: the window is half a term


def test_offer_without_a_subscriber_is_not_connected(client: Client) -> None:
    publication = client.add_publication(IPC_CHANNEL, 1001)
    assert not publication.is_connected
    assert publication.offer(b"nobody listens") == NOT_CONNECTED


def test_messages_arrive_whole_and_in_order_including_fragmented_ones(client: Client) -> None:
    publication, subscription = connected_ipc(client, 1002)
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
    publication, subscription = connected_ipc(client, 1003)
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
    first = client.add_publication(IPC_CHANNEL, 1004)
    second = client.add_publication(IPC_CHANNEL, 1004)
    assert first.session_id == second.session_id
    subscription = client.add_subscription(IPC_CHANNEL, 1004)
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
            subscription = client.add_subscription(IPC_CHANNEL, stream_id)
            publication = client.add_publication(IPC_CHANNEL, stream_id)
        else:
            publication = client.add_publication(IPC_CHANNEL, stream_id)
            subscription = client.add_subscription(IPC_CHANNEL, stream_id)
        assert publication.offer(b"hello") > 0, stream_id
        got: list[bytes] = []
        assert subscription.poll(lambda d, h, got=got: got.append(bytes(d)), 10) == 1, stream_id
        assert got == [b"hello"]
        publication.close()
        subscription.close()


def test_a_late_subscriber_joins_at_the_current_position(client: Client) -> None:
    early = client.add_subscription(IPC_CHANNEL, 1005)
    publication = client.add_publication(IPC_CHANNEL, 1005)
    wait_for(lambda: publication.is_connected)
    for i in range(10):
        offer_until(publication, f"before-{i}".encode())
    late = client.add_subscription(IPC_CHANNEL, 1005)
    wait_for(lambda: bool(late.images))
    assert late.images[0].join_position == publication.position
    offer_until(publication, b"after")
    got: list[bytes] = []
    late.receive(lambda d, h: got.append(bytes(d)), 10, timeout=2.0)
    assert got == [b"after"]
    assert early.poll(lambda d, h: None, 100) == 11


def test_try_claim_fills_in_place_and_abort_leaves_padding(client: Client) -> None:
    subscription = client.add_subscription(IPC_CHANNEL, 1006)
    publication = client.add_publication(IPC_CHANNEL, 1006)
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
    publication, subscription = connected_ipc(client, 1007)
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
    publication, subscription = connected_ipc(client, 1017)
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
    publication, subscription = connected_ipc(client, 1019,
                                              publication_channel=f"{IPC_CHANNEL}?term-length=64k")
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


def test_an_images_questions_answer_as_a_new_reader_would_after_a_peek_cut_a_message(
        client: Client) -> None:
    """available_position and peek reuse the readers they make: after a peek whose limit cut
    a fragmented message in two (its reader left mid-message), each answer on the same image
    is a fresh detached reader's, again and again, as messages arrive."""
    publication, subscription = connected_ipc(client, 1024)
    image = subscription.images[0]
    start = image.position
    sent = [b"a" * 32, b"b" * 5000, b"c" * 100]
    for message in sent:
        offer_until(publication, message)
    fragmented = start + (HEADER_LENGTH + 32 + 31 & -32)
    first_frame = image.frame_header(fragmented)[0]
    inside = fragmented + (first_frame + 31 & -32)  # after its first fragment, before its end

    def peeked(limit: int, on: Image) -> tuple[list[bytes], int]:
        got: list[bytes] = []
        reached = on.peek(start, lambda data, header: got.append(bytes(data)), limit)
        return got, reached

    for round_ in range(3):
        fresh = Image.detached(image.log_path, start)
        try:
            assert peeked(inside, image) == peeked(inside, fresh) == ([sent[0]], fragmented)
            assert image.available_position() == fresh.available_position() > inside
            assert peeked(image.available_position(), image) == \
                peeked(fresh.available_position(), fresh) == (sent, fresh.available_position())
        finally:
            fresh.close()
        offer_until(publication, bytes([round_]) * 40)
        sent.append(bytes([round_]) * 40)


@pytest.mark.parametrize("kind", ["list", "array", "int32 numpy", "int64 numpy"])
def test_batch_lengths_may_be_any_sequence_of_ints(client: Client, kind: str) -> None:
    import numpy as np

    stream_id = 1020 + ["list", "array", "int32 numpy", "int64 numpy"].index(kind)
    publication, subscription = connected_ipc(client, stream_id)
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

    publication, subscription = connected_ipc(client, 1030)
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


def test_a_headers_fields_are_read_only(client: Client) -> None:
    """A handler reads the message's header; it cannot rewrite what the next message's
    header says (its session and stream are the image's)."""
    publication, subscription = connected_ipc(client, 1032)
    assert publication.offer(b"one") > 0 and publication.offer(b"two") > 0
    seen: list[tuple[int, int]] = []

    def handler(_data: memoryview, header) -> None:
        seen.append((header.session_id, header.stream_id))
        for field in ("session_id", "stream_id", "position", "reserved_value", "term_id"):
            with pytest.raises(AttributeError):
                setattr(header, field, 0)

    while len(seen) < 2:
        subscription.poll(handler, 10)
    assert seen == [(publication.session_id, 1032)] * 2


def test_a_bad_reserved_value_is_refused_by_name_and_appends_nothing(client: Client) -> None:
    import numpy as np

    publication, subscription = connected_ipc(client, 1031)
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
    subscription = client.add_subscription(IPC_CHANNEL, 1008)
    publication = client.add_publication(IPC_CHANNEL, 1008)
    wait_for(lambda: publication.is_connected)
    started = time.monotonic()
    assert subscription.receive(lambda d, h: None, 10, timeout=0.2) == 0
    # It waited its timeout, and returned at it, not at the end of a park slice (1 s).
    assert 0.19 <= time.monotonic() - started < _PARK_SLICE_NS / 1e9
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
    _, subscription = connected_ipc(client, 1031)
    returned: list[float] = []

    def receive() -> None:
        subscription.receive(lambda d, h: None, 10, timeout=10.0)
        returned.append(time.monotonic())

    waiter = threading.Thread(target=receive)
    started = time.monotonic()
    waiter.start()
    time.sleep(0.3)  # spun, then parked on the image
    subscription.close()
    waiter.join(5)
    # Its park began after ``started``: unwoken, it would have returned a slice after it.
    assert returned and returned[0] - started < _PARK_SLICE_NS / 1e9, returned


def _idle_receiver(directory: str, ready, runnable) -> None:
    with Client.connect(directory) as client:
        subscription = client.add_subscription(IPC_CHANNEL, 1009)
        while not subscription.images:
            time.sleep(0.01)
        subscription.receive(lambda d, h: None, 10, timeout=0.2)  # settle
        ready.set()
        start = runnable_s()
        subscription.receive(lambda d, h: None, 10, timeout=2.0)
        runnable.value = runnable_s() - start


def test_a_waiting_subscriber_uses_almost_no_cpu(driver_dir: Path) -> None:
    """A receive that waits 2 s for a message that never comes parks: its thread is
    runnable (on a CPU, or waiting for one) under a tenth of the wait, where a wait that
    spun would be all of it, however loaded the machine."""
    context = multiprocessing.get_context("spawn")
    ready, runnable = context.Event(), context.Value("d", -1.0)
    with MediaDriver.launch(directory=driver_dir, ipc_term_buffer_length="64k") as driver, \
            Client.connect(driver.directory) as client:
        client.add_publication(IPC_CHANNEL, 1009)
        process = context.Process(target=_idle_receiver,
                                  args=(str(driver.directory), ready, runnable))
        process.start()
        assert ready.wait(30)
        process.join(30)
    assert process.exitcode == 0
    assert 0 <= runnable.value < 2.0 / 10, f"waiting 2 s, runnable {runnable.value:.4f} s"


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
    publication = client.add_publication(f"{IPC_CHANNEL}?term-length=16m|sparse=false", 55)
    log_name = publication._log.path.name  # which file is its log
    in_driver = _resident_kib(driver.pid, log_name)
    in_client = _resident_kib(os.getpid(), log_name)
    assert in_driver and in_client, (in_driver, in_client)
    # The publisher's mapping: its pages, up front.  Not every one: the host's reclaim (DAMON
    # here) may unmap a few cold pages of it again at any time, and a later touch maps them back.
    assert sum(in_client) >= 44 * 1024, in_client
    assert sum(in_driver) < 1024, in_driver  # the driver's: what it touched (metadata)


def test_a_live_claim_on_a_stream_idle_past_the_unblock_timeout_is_not_padded(client: Client):
    publication, subscription = connected_ipc(client, 1077)
    assert publication.offer(b"first") > 0
    got: list[bytes] = []
    wait_for(lambda: subscription.poll(lambda d, h: got.append(bytes(d)), 10) or got)
    time.sleep(2.5)  # idle past publication_unblock_timeout (1.5 s)
    claim = BufferClaim()
    assert publication.try_claim(5, claim) > 0
    time.sleep(0.5)  # a live publisher writing its claim, well under the timeout
    claim.buffer[:] = b"hello"
    claim.commit()
    assert publication.offer(b"after") > 0
    wait_for(lambda: subscription.poll(lambda d, h: got.append(bytes(d)), 10) or len(got) >= 3,
             timeout=5)
    assert got == [b"first", b"hello", b"after"]
