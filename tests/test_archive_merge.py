"""A replay merge hands on what it replays as the live stream would: every message once, in
order, with the header the stream gave it (the replayed part is read through the archives'
one failover reader, which hands over copies, not frames)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from helpers import free_port, message
from test_archive import archive_process, size_of, wait_for_recording
from test_archive_replication import CONTROL_STREAM, archive_config

from slipstream.archive import ArchiveClient, MergeState, ReplayMerge
from slipstream.client import Client
from slipstream.client.messages import Header

pytestmark = pytest.mark.timeout(180)

STREAM = 20
#: The most messages a poll of the merge may hand on in this test.
LIMIT = 7


def fields(header: Header) -> tuple[int, ...]:
    return (header.position, header.term_id, header.term_offset, header.frame_length,
            header.flags, header.reserved_value, header.session_id, header.stream_id)


def test_a_replay_merge_hands_on_replayed_messages_with_the_headers_the_live_stream_gives(
        driver, tmp_path: Path) -> None:
    """An archive records an IPC stream of 64k terms; messages from 8 bytes to past the MTU
    (fragmented), each with its own reserved value, fill several terms before a subscriber
    joins late and merges from position 0, then as many again while it catches up.  Each
    message it gets, replayed or live, has the bytes and every header field (position, term
    id, term offset, last frame's length and flags, reserved value, session, stream) that a
    subscriber reading from the start got; no poll hands on more than its limit."""
    port = free_port()
    config = archive_config(tmp_path / "a.toml", tmp_path / "a", driver.directory, port,
                            [("aeron:ipc", STREAM, "local")])
    with Client.connect(driver.directory) as client, \
            archive_process(config, tmp_path / "a.log"):
        publication = client.add_publication("aeron:ipc", STREAM)
        reference = client.add_subscription("aeron:ipc", STREAM)
        wait_for_recording(tmp_path / "a")
        seen: list[tuple[bytes, tuple[int, ...]]] = []

        def read_reference() -> None:
            reference.poll(lambda d, h: seen.append((bytes(d), fields(h))), 256)

        total = 800
        sent = 0

        def offer_more(count: int) -> None:
            nonlocal sent
            for _ in range(count):
                if sent >= total:
                    return
                if publication.offer(message(sent, size_of(sent)), sent * 7919 - 3) < 0:
                    return
                sent += 1

        deadline = time.monotonic() + 60
        while sent < total // 2:
            assert time.monotonic() < deadline, f"{sent} offered"
            offer_more(16)
            read_reference()
        assert publication.position > 4 * publication.term_length, "not several terms"
        live = client.add_subscription("aeron:ipc", STREAM)
        merged: list[tuple[bytes, tuple[int, ...]]] = []
        polls = []
        with ArchiveClient(client, "127.0.0.1", port, CONTROL_STREAM, timeout_s=5) as archive:
            recording = archive.list_recordings(stream_id=STREAM)[0]
            merge = ReplayMerge(archive, live, recording.recording_id, 0)
            replayed = 0
            while len(merged) < total:
                assert time.monotonic() < deadline, (len(merged), sent, merge.state)
                offer_more(4)
                read_reference()
                count = merge.poll(lambda d, h: merged.append((bytes(d), fields(h))), LIMIT)
                polls.append(count)
                if not merge.is_live:
                    replayed = len(merged)
                if count == 0:
                    time.sleep(0.0005)
            assert merge.state is MergeState.LIVE
            merge.close()
        while len(seen) < total:
            assert time.monotonic() < deadline
            read_reference()
    assert max(polls) == LIMIT
    assert 0 < replayed < total, "the switch to live was not mid-stream"
    assert merged == seen
    assert [data for data, _ in merged] == [message(seq, size_of(seq)) for seq in range(total)]
    assert any(h[4] != 0xC0 for _, h in merged[:replayed]), "no fragmented message replayed"
