"""Replay merge between two hosts (network namespaces, real drivers) with the kernel dropping
5 % of what arrives at the subscriber's host: a subscriber that joins the live stream late
catches up from the archive's replay and goes on live, every message once, in order, at the
positions the live stream has (docs/ARCHIVE.md, "Replay merge")."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from helpers import NETWORK_SETTINGS, counters_of, message, wait_for
from test_archive import archive_process, wait_for_recording

from slipstream.archive.client import ArchiveClient
from slipstream.archive.merge import MergeState, ReplayMerge
from slipstream.client import Client

pytestmark = pytest.mark.timeout(240)

CONTROL_PORT = 40193
LIVE_PORT = 40194
STREAM = 50
CONTROL_STREAM = 10
TOTAL = 3000


def size_of(seq: int) -> int:
    """Mixed sizes, some past the MTU: fragmented messages cross the switch too."""
    return 16 + (seq * 131) % 3000


def test_replay_merge_under_loss_delivers_every_message_once_in_order(
        hosts, tmp_path: Path) -> None:
    """Host 1 publishes to host 2 and its archive records the stream (through a spy); a
    subscriber on host 2 reads it from the start (the reference).  After a third of the
    messages a second subscription joins live on host 2 and merges: replay from position 0,
    then live.  With 5 % of host 2's UDP input dropped, the merged subscriber gets every
    message once, in order, with the reference's positions, and ends live; when the
    publisher closes, the merge reports the stream's end."""
    one = hosts.start_driver(1, **NETWORK_SETTINGS)
    two = hosts.start_driver(2, **NETWORK_SETTINGS)
    channel = f"aeron:udp?endpoint={hosts[2].address}:{LIVE_PORT}"
    archive_dir = tmp_path / "archive"
    config = tmp_path / "archive.toml"
    config.write_text(
        f'dir = "{archive_dir}"\ndriver_dir = "{one.directory}"\nsegment_length = "128k"\n'
        f'control_address = "{hosts[1].address}"\ncontrol_port = {CONTROL_PORT}\n'
        f'control_stream_id = {CONTROL_STREAM}\n'
        f'[[record]]\nchannel = "{channel}"\nstream_id = {STREAM}\n')
    hosts.drop(2, probability=0.05)
    with archive_process(config, tmp_path / "archive.log"), \
            Client.connect(one.directory) as local, Client.connect(two.directory) as remote:
        reference = remote.add_subscription(channel, STREAM)
        publication = local.add_publication(channel, STREAM)
        wait_for(lambda: publication.is_connected, timeout=20, what="the reference connected")
        wait_for_recording(archive_dir, timeout=20)
        seen: list[tuple[bytes, int]] = []
        published = threading.Event()
        sent = [0]

        def publish() -> None:
            for seq in range(TOTAL):
                while publication.offer(message(seq, size_of(seq))) < 0:
                    time.sleep(0.0005)
                sent[0] = seq + 1
                if seq % 50 == 0:
                    time.sleep(0.002)  # a stream, not one burst: the merge joins mid-way
            published.set()

        publisher = threading.Thread(target=publish, daemon=True)
        publisher.start()

        def read_reference() -> None:
            reference.poll(lambda d, h: seen.append((bytes(d), h.position)), 256)

        deadline = time.monotonic() + 120
        while sent[0] < TOTAL // 3:
            assert time.monotonic() < deadline
            read_reference()
        live = remote.add_subscription(channel, STREAM)
        merged: list[tuple[bytes, int]] = []
        with ArchiveClient(remote, hosts[1].address, CONTROL_PORT, CONTROL_STREAM,
                           reply_address=hosts[2].address) as archive:
            recording = archive.list_recordings(stream_id=STREAM)[0]
            merge = ReplayMerge(archive, live, recording.recording_id, 0)
            while len(merged) < TOTAL:
                assert time.monotonic() < deadline, (f"merged {len(merged)} of {TOTAL}, "
                                                    f"{merge.state}")
                read_reference()
                if merge.poll(lambda d, h: merged.append((bytes(d), h.position)), 256) == 0:
                    time.sleep(0.0005)
            assert merge.state is MergeState.LIVE
            assert merge.join_position is not None and merge.join_position > 0
            assert merge.switch_position is not None
            assert published.wait(30)
            publisher.join(10)
            while len(seen) < TOTAL:
                assert time.monotonic() < deadline
                read_reference()
            # The publisher closes: the live image ends with the stream, and the merge says
            # so rather than fail (its image went, with nothing lost).
            publication.close()
            while not merge.is_end_of_stream:
                assert time.monotonic() < deadline, merge.state
                read_reference()
                assert merge.poll(lambda d, h: merged.append((bytes(d), h.position))) == 0
                time.sleep(0.01)
            assert merge.poll(lambda d, h: merged.append((bytes(d), h.position))) == 0
            merge.close()
        naks = counters_of(two)["NAK_MESSAGES_SENT"]
    assert naks > 0, "no loss was repaired: the test did not cross what it guards"
    assert [m for m, _ in merged] == [message(seq, size_of(seq)) for seq in range(TOTAL)]
    assert merged == seen
    # The switch was mid-stream: the replay delivered messages, and so did the live image.
    switch = merge.switch_position
    assert 0 < sum(1 for _, p in merged if p <= switch) < TOTAL
