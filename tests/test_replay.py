"""Replay of a live log's range to another host: a query's replay server on host 1 (the
archive's control stream over the logs its subscription holds, ``planning._Holder``) serves
ranges of them; a reader on host 2 asks through its own driver (``ArchiveClient.replay_held``)
and receives them over UDP between real drivers in network namespaces, with the kernel
dropping datagrams.

The replayed messages must be the log's: same payloads, positions and reserved values, across
term rotations and fragmented messages; a range the log no longer holds is refused ``lost``
with what it holds (from which it is replayed); bad calls are refused or dropped and counted,
and the server goes on serving.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from helpers import NETWORK_SETTINGS, wait_for

from slipstream.archive.client import ArchiveClient, ArchiveReplay
from slipstream.archive.reading import RecordingLostError
from slipstream.client import Client, Image
from slipstream.client.holding import CallError, small_channel
from slipstream.client.retention import first_retained
from slipstream.spark_bridge.planning import _Holder

pytestmark = pytest.mark.timeout(120)

PORT = 40191
STREAM = 71
TERM = 64 * 1024
KEY = {"channel": "aeron:ipc", "stream_id": STREAM, "group": "query"}


@pytest.fixture
def two_hosts(hosts) -> Iterator[tuple[Any, Any, _Holder]]:
    """Drivers on hosts 1 and 2, and a query's replay server on host 1."""
    one = hosts.start_driver(1, **NETWORK_SETTINGS)
    two = hosts.start_driver(2, **NETWORK_SETTINGS)
    holder = _Holder(str(one.directory), hosts[1].address, PORT)
    try:
        yield one, two, holder
    finally:
        holder.close()


def publish(publication, messages: list[tuple[bytes, int]]) -> None:
    for payload, reserved in messages:
        deadline = time.monotonic() + 20
        while publication.offer(payload, reserved_value=reserved) < 0:
            assert time.monotonic() < deadline, "the offer found no credit for 20 s"
            time.sleep(0.0005)


def source_rows(image: Image, start: int, end: int) -> list[tuple[bytes, int, int]]:
    rows: list[tuple[bytes, int, int]] = []
    image.peek(start, lambda d, h: rows.append((bytes(d), h.position, h.reserved_value)), end)
    return rows


def read_all(replay: ArchiveReplay, timeout: float = 30.0) -> list[tuple[bytes, int, int]]:
    rows: list[tuple[bytes, int, int]] = []
    deadline = time.monotonic() + timeout
    with replay:
        while not replay.done:
            if replay.poll(lambda d, h: rows.append((bytes(d), h.position,
                                                     h.reserved_value))) == 0:
                assert time.monotonic() < deadline, f"the replay stalled at {replay.position}"
                replay.wait(0.01)
    return rows


def messages(count: int) -> list[tuple[bytes, int]]:
    """Sizes from 1 B to 3 KiB (several frames at the 1408-byte MTU), reserved value i+1."""
    return [(bytes([i % 251]) * (1 + (i * 377) % 3000), i + 1) for i in range(count)]


def held(holder: _Holder, image: Image) -> None:
    """The query's logs, as its planning thread gives them to its replay server."""
    holder.holds.publish({(STREAM, image.session_id): (image.log_path, image.join_position, None)})


def test_a_replayed_range_has_the_logs_messages_positions_and_reserved_values_under_loss(
        hosts, two_hosts) -> None:
    """Mixed-size messages (fragmented ones too) over seven 64 KiB terms; the range the log
    still holds, from a message inside a term to the end in a later one, is replayed with 5 %
    of host 2's replay datagrams dropped: the same payloads, positions and reserved values."""
    one, two, holder = two_hosts
    hosts.drop(2, port=PORT, probability=0.05)
    with Client.connect(one.directory) as local, Client.connect(two.directory) as remote:
        publication = local.add_publication(f"aeron:ipc?term-length={TERM // 1024}k", STREAM)
        keeper = local.add_subscription("aeron:ipc", STREAM)  # its credit holds the log
        wait_for(lambda: keeper.images, what="the holder's image")
        sent = messages(300)
        for chunk in range(0, 285, 5):  # consumed: the driver cleans one term behind it
            publish(publication, sent[chunk:chunk + 5])
            while keeper.poll(lambda d, h: None, 1000):
                pass
        publish(publication, sent[285:])  # not consumed: less than the 32 KiB window
        image = keeper.images[0]
        assert image.position > 6 * TERM
        held(holder, image)
        # Three quarters of a term behind the keeper: not cleaned, and the range is more
        # than a term long, so it crosses a term boundary.
        start = first_retained(image, image.position - 3 * TERM // 4, image.position)
        end = image.available_position()
        assert start // TERM < (end - 1) // TERM
        with ArchiveClient(remote, hosts[1].address, PORT, holder.address[2], timeout_s=10,
                           reply_address=hosts[2].address) as link:
            got = read_all(link.replay_held(KEY, image.session_id, image.identity.framing,
                                            start, end))
        assert got == source_rows(image, start, end)
        assert [row[2] for row in got] == list(range(len(sent) - len(got) + 1, len(sent) + 1))
        assert any(len(row[0]) > publication.max_payload_length for row in got)
        wait_for(lambda: holder.control.served == 1, what="the replay counted as served")


def test_a_range_the_log_no_longer_holds_is_refused_lost_naming_what_it_holds(
        hosts, two_hosts) -> None:
    """The log has moved four terms past position 0: asking from 0 is refused ``lost`` with
    what the log holds, from the first whole message; asked from there, the replay is the
    log's."""
    one, two, holder = two_hosts
    with Client.connect(one.directory) as local, Client.connect(two.directory) as remote:
        publication = local.add_publication(f"aeron:ipc?term-length={TERM // 1024}k", STREAM)
        keeper = local.add_subscription("aeron:ipc", STREAM)
        wait_for(lambda: keeper.images, what="the holder's image")
        image = keeper.images[0]
        held(holder, image)
        sent = [(bytes(1000), i) for i in range(6 * TERM // 1024)]
        for chunk in range(0, len(sent), 16):  # the keeper consumes: the cleaner follows it
            publish(publication, sent[chunk:chunk + 16])
            while keeper.poll(lambda d, h: None, 1000):
                pass
        end = image.available_position()
        with ArchiveClient(remote, hosts[1].address, PORT, holder.address[2], timeout_s=10,
                           reply_address=hosts[2].address) as link:
            with pytest.raises(RecordingLostError) as lost:
                link.replay_held(KEY, image.session_id, image.identity.framing, 0, end)
            assert "no longer holds position 0" in str(lost.value)
            first = lost.value.held[0]
            assert 0 < first < end and lost.value.held[1] == end
            got = read_all(link.replay_held(KEY, image.session_id, image.identity.framing,
                                            first, end))
        assert got == source_rows(image, first, end)


def test_bad_calls_are_refused_or_dropped_and_counted_and_the_server_serves_the_next(
        hosts, two_hosts) -> None:
    """A replay naming another log of the session is refused naming both; malformed calls are
    dropped and counted; one for a session the server holds no log of is refused ``lost``,
    and a recording's call refused (it has none); then a good one is served."""
    one, two, holder = two_hosts
    with Client.connect(one.directory) as local, Client.connect(two.directory) as remote:
        publication = local.add_publication("aeron:ipc", STREAM)
        keeper = local.add_subscription("aeron:ipc", STREAM)
        wait_for(lambda: keeper.images, what="the holder's image")
        publish(publication, [(b"x" * 100, 7)] * 10)
        image = keeper.images[0]
        held(holder, image)
        end = image.available_position()
        initial_term_id, term_length = image.identity.framing
        with ArchiveClient(remote, hosts[1].address, PORT, holder.address[2], timeout_s=10,
                           reply_address=hosts[2].address) as link:
            with pytest.raises(CallError, match=rf"log here has .*, not "
                                                rf"\[{initial_term_id + 1}, {term_length}\]"):
                link.replay_held(KEY, image.session_id, (initial_term_id + 1, term_length),
                                 0, end)
            control = remote.add_publication(
                small_channel(f"aeron:udp?endpoint={hosts[1].address}:{PORT}"),
                holder.address[2])
            wait_for(lambda: control.is_connected, what="the control stream")
            for garbage in (b"\xff\xfe", b"[1, 2]", b'{"version": 1, "kind": "call"}'):
                assert control.offer(garbage) > 0
            wait_for(lambda: holder.control.malformed == 3, what="the malformed calls counted")
            control.close()
            with pytest.raises(RecordingLostError, match="holds no log of that session"):
                link.replay_held(KEY, image.session_id + 1, image.identity.framing, 0, end)
            with pytest.raises(CallError, match="has no recordings: it replays a query's"):
                link.list_recordings()
            got = read_all(link.replay_held(KEY, image.session_id, image.identity.framing,
                                            0, end))
        assert got == source_rows(image, 0, end)
        wait_for(lambda: holder.control.served == 1, what="the good replay served")


def test_a_holder_that_does_not_answer_is_named_after_the_timeout(hosts) -> None:
    """No holder listens at host 1: the replay call fails after its timeout, naming the
    holder's address and port and what to check."""
    two = hosts.start_driver(2, **NETWORK_SETTINGS)
    with Client.connect(two.directory) as remote, \
            ArchiveClient(remote, hosts[1].address, PORT, 9001, timeout_s=1.0,
                          reply_address=hosts[2].address) as link:
        with pytest.raises(CallError, match=f"{hosts[1].address}:{PORT}.*did not take the "
                                            f"call 'replay' within 1 s.*UDP port {PORT} open"):
            link.replay_held(KEY, 1, (0, TERM), 0, 64)
