"""Positions on IPC streams: peeks that hold credit until the commit, positions set by hand,
messages cut by a limit, overwritten data, batches across term rotations."""

from __future__ import annotations

import multiprocessing
import time

import pytest
from helpers import IPC_CHANNEL, connected_ipc, offer_until

from slipstream.client import (
    BACK_PRESSURED,
    BufferClaim,
    Client,
    ClosedError,
    InvalidArgumentError,
)


def _read_range(log_path: str, start: int, end: int, out) -> None:
    from slipstream.client import Image

    reader = Image.detached(log_path, start)
    got: list[bytes] = []
    reader.peek(start, lambda d, h: got.append(bytes(d)), end)
    out.put(got)


def test_peek_holds_credit_until_the_position_is_committed(client: Client) -> None:
    publication, subscription = connected_ipc(client, 1015)
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

    channel = "aeron:ipc?term-length=64k"
    publication, subscription = connected_ipc(client, 1030, channel)
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
    publication, subscription = connected_ipc(client, 1032)
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

    publication, subscription = connected_ipc(client, 1016)
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

    publication = client.add_publication(IPC_CHANNEL, 1017)
    client.add_subscription(IPC_CHANNEL, 1017)
    with pytest.raises(InvalidArgumentError, match="add up to 96 bytes"):
        publication.offer_batch(b"x" * 64, [32, 32, 32])
    # A negative length is named as such, not as a message too long.
    with pytest.raises(InvalidArgumentError, match=r"lengths\[1\] is -1"):
        publication.offer_batch(b"x" * 100, [1, -1, 100])
    with pytest.raises(InvalidArgumentError, match="a claim of -1 bytes"):
        publication.try_claim(-1, BufferClaim())


def test_batches_across_many_term_rotations_keep_every_message(client: Client) -> None:
    publication, subscription = connected_ipc(client, 1018)
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
