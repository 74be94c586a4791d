"""Protected calls on namespace hosts (docs/ARCHIVE.md, "Protected calls"; issue 68): host 1
publishes on ``key=k1`` to host 2, where ``slipstream-archive run`` records it and takes calls
on its cluster address, on a plain endpoint and one keyed k1.  Host 3, an outsider with a
driver of its own and no key, calls the archive as any caller does
(tests/archive_outsider.py) and reads nothing of the stream through any operation: each call
about it is refused and counted, ``list`` shows nothing, no replay reaches it, and its calls
to the keyed endpoint are dropped unopened.  Host 1's keyed caller still replays every
message.

Needs root and iproute2 (CI runs as root); without root these tests skip, except under
CI=true, where they fail.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
from helpers import NETWORK_SETTINGS, SEQUENCE, counters_of, message, wait_for
from test_archive import archive_process, wait_for_recording
from test_encrypted_streams import KEY_A, write_keys

from slipstream.archive import ArchiveClient
from slipstream.archive.control import REFUSAL_CAUSES, UNAUTHORIZED, read_calls_refused
from slipstream.client import Client
from slipstream.client.control import COUNTERS_FILE
from slipstream.client.counters import CountersFile

pytestmark = pytest.mark.timeout(180)

LIVE_PORT = 40421  # the recorded stream's endpoint, on host 2
CONTROL_PORT = 40422  # the archive's plain control endpoint, on host 2
KEYED_PORT = 40424  # its k1 control endpoint
STREAM = 1001
CONTROL_STREAM = 10
MESSAGES = 2_000  # 1 KiB each: a second of stream, over 30 terms of 64 KiB
OUTSIDER = Path(__file__).with_name("archive_outsider.py")
#: The outsider's operations that name the recording or the held stream (the rest: list,
#: replays and stop_replay of a replay not its own, the stream named without its key).
NAMING = ("describe", "recording_position", "view", "start_replay", "replay", "state",
          "ended", "release", "held_view", "replay_held")


@pytest.mark.parametrize("hosts", [3], indirect=True)
def test_an_outsider_reads_nothing_of_a_keyed_stream_through_the_archive(
        hosts, tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    write_keys(keys, "k1", [(1, KEY_A)])
    keyed = {**NETWORK_SETTINGS, "keys_dir": str(keys)}
    publisher = hosts.start_driver(1, **keyed)
    archive_driver = hosts.start_driver(2, **keyed)
    outsider = hosts.start_driver(3, **NETWORK_SETTINGS)  # no keys_dir: it holds no key
    one, two = hosts[1].address, hosts[2].address
    channel = f"aeron:udp?endpoint={two}:{LIVE_PORT}|key=k1"
    archive_dir = tmp_path / "archive"
    config = tmp_path / "archive.toml"
    config.write_text("\n".join([
        f'dir = "{archive_dir}"', f'driver_dir = "{archive_driver.directory}"',
        f'control_address = "{two}"', f"control_port = {CONTROL_PORT}",
        f"control_keys = {{ k1 = {KEYED_PORT} }}",
        "[[record]]", f'channel = "{channel}"', f"stream_id = {STREAM}",
        'source = "remote"']) + "\n")
    with archive_process(config, tmp_path / "archive.log", hosts[2].prefix()), \
            Client.connect(publisher.directory) as local:
        publication = local.add_publication(channel, STREAM)
        wait_for(lambda: publication.is_connected, timeout=20, what="the archive subscribed")
        sent = 0
        while sent < MESSAGES:
            if publication.offer(message(sent, 1024)) > 0:
                sent += 1
            else:
                time.sleep(0.0005)
        publication.close()
        recording = wait_for_recording(archive_dir, ended=True, timeout=30)
        crypto_before = counters_of(archive_driver)["CRYPTO_PLAIN_DROPS"]

        ran = hosts[3].run(sys.executable, str(OUTSIDER), str(outsider.directory), two,
                           str(CONTROL_PORT), str(KEYED_PORT), str(CONTROL_STREAM), channel,
                           str(STREAM), timeout=120)
        seen = json.loads(ran.stdout.strip().splitlines()[-1])
        assert seen["received"] == 0, seen
        assert seen["list"] == seen["list_all"] == {"status": "ok", "result": "[]"}, seen
        for op in NAMING:
            assert seen[op]["status"] == "error" and seen[op]["reason"] == UNAUTHORIZED and \
                seen[op]["cause"] == "call-without-key", (op, seen[op])
        assert "is of key=k1" in seen["describe"]["message"]
        assert seen["replays"] == {"status": "ok", "result": "[]"}
        assert seen["stop_replay"]["status"] == "ok"  # no replay 1: nothing stopped
        for op in ("state_unkeyed", "ended_unkeyed", "release_unkeyed"):
            # The stream named without its key is not the stream: nothing of it answers.
            assert seen[op]["status"] == "error" or seen[op]["result"] in ("False", "{}"), \
                (op, seen[op])
        assert seen["keyed_port_in_plain"]["status"] == "error" and \
            "did not take the call" in seen["keyed_port_in_plain"]["message"], seen
        assert counters_of(archive_driver)["CRYPTO_PLAIN_DROPS"] > crypto_before

        counters = CountersFile(Path(archive_driver.directory) / COUNTERS_FILE,
                                writable=False)
        expected = {**dict.fromkeys(REFUSAL_CAUSES, 0), "call-without-key": len(NAMING)}
        wait_for(lambda: read_calls_refused(counters, str(archive_dir)) == expected,
                 what=f"every refusal counted: {expected}")

        # Host 1, with the key, still replays everything.
        got: list[int] = []
        with ArchiveClient(local, two, KEYED_PORT, CONTROL_STREAM, key="k1", timeout_s=10,
                           reply_address=one) as archive:
            assert [r.recording_id for r in archive.list_recordings()] == \
                [recording.recording_id]
            with archive.replay(recording.recording_id) as replay:
                replay.read_all(lambda d, _h: got.append(SEQUENCE.unpack_from(d)[0]),
                                timeout_s=30)
        assert got == list(range(MESSAGES))
