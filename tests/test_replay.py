"""Replay of a log range to another host (client/replay/): a holder on host 1 serves ranges
of a log its subscription holds; a reader on host 2 asks through its own driver and receives
them over UDP between real drivers in network namespaces, with the kernel dropping datagrams.

The replayed messages must be the log's: same payloads, positions and reserved values, across
term rotations and fragmented messages; a range the log no longer holds is answered ``lost``
(or skipped to the first held position on request); bad requests are refused and counted, and
the holder goes on serving.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
from helpers import NETWORK_SETTINGS, wait_for

from slipstream.client import Client, Image
from slipstream.client.replay import (
    LogIdentity,
    ReplayError,
    ReplayLostError,
    ReplayServer,
    first_retained,
    request_replay,
)

pytestmark = pytest.mark.timeout(120)

PORT = 40191
STREAM = 71
CONTROL_STREAM = 9001
TERM = 64 * 1024


class Holder:
    """A ReplayServer on host 1 on a thread of its own, serving the logs in ``logs``."""

    def __init__(self, directory: str, address: str) -> None:
        self.logs: dict[int, Image] = {}
        self.client = Client.connect(directory)
        self.server = ReplayServer(self.client, address, PORT, CONTROL_STREAM,
                                   lambda stream, session: self.logs.get(session))
        self._stop = False
        self._thread = threading.Thread(target=self.server.run, args=(lambda: self._stop,))
        self._thread.start()

    def close(self) -> None:
        self._stop = True
        self._thread.join(10)
        self.client.close()


@pytest.fixture
def two_hosts(hosts) -> Iterator[tuple[object, object, Holder]]:
    """Drivers on hosts 1 and 2, and a holder on host 1."""
    one = hosts.start_driver(1, **NETWORK_SETTINGS)
    two = hosts.start_driver(2, **NETWORK_SETTINGS)
    holder = Holder(str(one.directory), hosts[1].address)
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


def read_all(replay, timeout: float = 30.0) -> list[tuple[bytes, int, int]]:
    rows: list[tuple[bytes, int, int]] = []
    deadline = time.monotonic() + timeout
    while not replay.done:
        if replay.poll(lambda d, h: rows.append((bytes(d), h.position, h.reserved_value))) == 0:
            assert time.monotonic() < deadline, f"the replay stalled at {replay.position}"
            replay.wait(0.01)
    return rows


def messages(count: int) -> list[tuple[bytes, int]]:
    """Sizes from 1 B to 3 KiB (several frames at the 1408-byte MTU), reserved value i+1."""
    return [(bytes([i % 251]) * (1 + (i * 377) % 3000), i + 1) for i in range(count)]


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
        holder.logs[image.session_id] = Image.detached(image.log_path, 0)
        # Three quarters of a term behind the keeper: not cleaned, and the range is more
        # than a term long, so it crosses a term boundary.
        start = first_retained(image, image.position - 3 * TERM // 4, image.position)
        end = image.available_position()
        assert start // TERM < (end - 1) // TERM
        replay = request_replay(remote, hosts[1].address, PORT, CONTROL_STREAM, STREAM,
                                image.identity, start, end,
                                reply_address=hosts[2].address)
        with replay:
            got = read_all(replay)
        assert got == source_rows(image, start, end)
        assert [row[2] for row in got] == list(range(len(sent) - len(got) + 1, len(sent) + 1))
        assert any(len(row[0]) > publication.max_payload_length for row in got)
        wait_for(lambda: holder.server.served == 1, what="the replay counted as served")


def test_a_range_the_log_no_longer_holds_is_answered_lost_or_skipped_to_what_it_holds(
        hosts, two_hosts) -> None:
    """The log has moved four terms past position 0: asking from 0 is answered ``lost`` with
    the range; with skip_lost the replay begins at the first position still held."""
    one, two, holder = two_hosts
    with Client.connect(one.directory) as local, Client.connect(two.directory) as remote:
        publication = local.add_publication(f"aeron:ipc?term-length={TERM // 1024}k", STREAM)
        keeper = local.add_subscription("aeron:ipc", STREAM)
        wait_for(lambda: keeper.images, what="the holder's image")
        image = keeper.images[0]
        holder.logs[image.session_id] = Image.detached(image.log_path, 0)
        sent = [(bytes(1000), i) for i in range(6 * TERM // 1024)]
        for chunk in range(0, len(sent), 16):  # the keeper consumes: the cleaner follows it
            publish(publication, sent[chunk:chunk + 16])
            while keeper.poll(lambda d, h: None, 1000):
                pass
        end = image.available_position()
        with pytest.raises(ReplayLostError) as lost:
            request_replay(remote, hosts[1].address, PORT, CONTROL_STREAM, STREAM,
                           image.identity, 0, end, reply_address=hosts[2].address)
        assert lost.value.lost == (0, end)
        assert "no longer holds position 0" in str(lost.value)
        with request_replay(remote, hosts[1].address, PORT, CONTROL_STREAM, STREAM,
                            image.identity, 0, end, skip_lost=True,
                            reply_address=hosts[2].address) as replay:
            assert replay.lost[0] == 0 and 0 < replay.lost[1] <= replay.start < end
            got = read_all(replay)
        assert got == source_rows(image, replay.start, end)


def test_bad_requests_are_refused_and_counted_and_the_holder_serves_the_next(
        hosts, two_hosts) -> None:
    """A request naming another log of the session, a malformed one, and one for a session
    the holder does not hold: each refused with a reason (or dropped and counted); then a good
    request is served."""
    one, two, holder = two_hosts
    with Client.connect(one.directory) as local, Client.connect(two.directory) as remote:
        publication = local.add_publication("aeron:ipc", STREAM)
        keeper = local.add_subscription("aeron:ipc", STREAM)
        wait_for(lambda: keeper.images, what="the holder's image")
        publish(publication, [(b"x" * 100, 7)] * 10)
        image = keeper.images[0]
        holder.logs[image.session_id] = Image.detached(image.log_path, 0)
        end = image.available_position()
        identity = image.identity
        other = LogIdentity(identity.session_id, identity.initial_term_id + 1,
                            identity.term_length)
        with pytest.raises(ReplayError, match="log of that session is another one"):
            request_replay(remote, hosts[1].address, PORT, CONTROL_STREAM, STREAM, other, 0,
                           end, reply_address=hosts[2].address)
        control = remote.add_publication(f"aeron:udp?endpoint={hosts[1].address}:{PORT}",
                                         CONTROL_STREAM)
        wait_for(lambda: control.is_connected, what="the control stream")
        for garbage in (b"\xff\xfe", b"[1, 2]", b'{"version": 1, "start": -5}'):
            assert control.offer(garbage) > 0
        wait_for(lambda: holder.server.refused == 4, what="the malformed requests counted")
        unknown = LogIdentity(identity.session_id + 1, identity.initial_term_id,
                              identity.term_length)
        with pytest.raises(ReplayLostError, match="holds no log of that session"):
            request_replay(remote, hosts[1].address, PORT, CONTROL_STREAM, STREAM, unknown, 0,
                           end, reply_address=hosts[2].address)
        with request_replay(remote, hosts[1].address, PORT, CONTROL_STREAM, STREAM, identity,
                            0, end, reply_address=hosts[2].address) as replay:
            assert read_all(replay) == source_rows(image, 0, end)
        assert holder.server.refused == 5


def test_a_holder_that_does_not_answer_is_named_after_the_timeout(hosts) -> None:
    """No holder listens at host 1: the request fails after its timeout, naming the holder's
    address and port and what to check."""
    two = hosts.start_driver(2, **NETWORK_SETTINGS)
    with Client.connect(two.directory) as remote:
        began = time.monotonic()
        with pytest.raises(ReplayError, match=f"{hosts[1].address}:{PORT}.*did not answer "
                                              f"within 1 s.*UDP port {PORT} open"):
            request_replay(remote, hosts[1].address, PORT, CONTROL_STREAM, STREAM,
                           LogIdentity(1, 0, TERM), 0, 64, timeout_s=1.0,
                           reply_address=hosts[2].address)
        assert time.monotonic() - began < 5
