"""Protected calls (docs/ARCHIVE.md, "Protected calls"; issue 68): an archive that records a
``key=k1`` stream and takes calls on a plain endpoint and on endpoints keyed k1 and k2, each
caller a driver process of its own.  A plain caller and a k2 caller learn nothing of the k1
recording or of a held k1 stream through any operation: each call is refused, named and
counted by cause (in the archive and in its driver's counters file); ``list`` leaves the
recording out.  The k1 caller is served, its replays sealed under k1 whatever channel it
names: a plain subscriber at that channel gets nothing, a k1 one every message.  An archive
restricted to subnets answers no call from outside them, and counts each."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers import (
    SEQUENCE,
    Collector,
    counters_of,
    free_port,
    message,
    run_stat,
    wait_for,
)
from test_archive import archive_process, recorded_messages, recordings, wait_for_recording
from test_encrypted_streams import KEY_A, KEY_B, write_keys

from slipstream.archive.client import ArchiveClient
from slipstream.archive.control import REFUSAL_CAUSES, UNAUTHORIZED, read_calls_refused
from slipstream.archive.service import ArchiveService
from slipstream.archive.settings import ArchiveSettings, load_settings
from slipstream.client import Client
from slipstream.client.control import COUNTERS_FILE
from slipstream.client.counters import CountersFile
from slipstream.client.holding import CallError

STREAM = 1001
HELD_STREAM = 1002
CONTROL_STREAM = 10
MESSAGES = 300  # over several 64 KiB terms (1 KiB each)


def publish_all(publication, count: int) -> None:
    sent = 0
    deadline = time.monotonic() + 30
    while sent < count:
        assert time.monotonic() < deadline, f"{sent} of {count} offered"
        if publication.offer(message(sent, 1024)) > 0:
            sent += 1
        else:
            time.sleep(0.0005)


def refusal(call, cause: str) -> CallError:
    """``call()`` is refused as unauthorized for ``cause``; the error."""
    with pytest.raises(CallError) as raised:
        call()
    answer = raised.value.answer or {}
    assert answer.get("reason") == UNAUTHORIZED and answer.get("cause") == cause, answer
    return raised.value


@pytest.fixture
def keyed_archive(launch, tmp_path: Path):
    """The archive's driver (keys k1, k2) and process, recording ``key=k1`` stream STREAM
    from the publisher's driver (key k1) until it ended; the callers' drivers: plain, k1 and
    k2.  Yields (archive driver, ports by key, the k1, plain and k2 drivers, the archive's
    directory, the recorded channel)."""
    keys = tmp_path / "keys"
    write_keys(keys, "k1", [(1, KEY_A)])
    write_keys(keys, "k2", [(2, KEY_B)])
    only_k1, only_k2 = tmp_path / "keys-k1", tmp_path / "keys-k2"
    write_keys(only_k1, "k1", [(1, KEY_A)])
    write_keys(only_k2, "k2", [(2, KEY_B)])
    archive_driver = launch(keys_dir=str(keys))
    k1_driver = launch(keys_dir=str(only_k1))
    plain_driver = launch()
    k2_driver = launch(keys_dir=str(only_k2))
    ports = {None: free_port(), "k1": free_port(), "k2": free_port()}
    recorded = f"aeron:udp?endpoint=127.0.0.1:{free_port()}|key=k1"
    archive_dir = tmp_path / "archive"
    config = tmp_path / "archive.toml"
    config.write_text("\n".join([
        f'dir = "{archive_dir}"', f'driver_dir = "{archive_driver.directory}"',
        f"control_port = {ports[None]}",
        f"control_keys = {{ k1 = {ports['k1']}, k2 = {ports['k2']} }}",
        "[[record]]", f'channel = "{recorded}"', f"stream_id = {STREAM}",
        'source = "remote"']) + "\n")
    load_settings(config)  # a setting the archive refuses fails here, naming it
    with archive_process(config, tmp_path / "archive.log"), \
            Client.connect(k1_driver.directory) as publisher_client:
        publication = publisher_client.add_publication(recorded, STREAM)
        wait_for(lambda: publication.is_connected, timeout=20, what="the archive subscribed")
        publish_all(publication, MESSAGES)
        publication.close()
        wait_for_recording(archive_dir, ended=True, timeout=30)
        yield archive_driver, ports, k1_driver, plain_driver, k2_driver, archive_dir, recorded


def test_a_keyed_recording_is_answered_only_to_its_key_and_replays_leave_sealed(
        keyed_archive, tmp_path: Path) -> None:
    archive_driver, ports, k1_driver, plain_driver, k2_driver, archive_dir, recorded = \
        keyed_archive
    held = {"channel": f"aeron:udp?endpoint=127.0.0.1:{free_port()}|key=k1",
            "stream_id": HELD_STREAM, "group": "spark"}
    with Client.connect(k1_driver.directory) as k1_client, \
            Client.connect(plain_driver.directory) as plain_client, \
            Client.connect(k2_driver.directory) as k2_client, \
            ArchiveClient(k1_client, "127.0.0.1", ports["k1"], CONTROL_STREAM, key="k1",
                          timeout_s=10) as k1, \
            ArchiveClient(plain_client, "127.0.0.1", ports[None], CONTROL_STREAM,
                          timeout_s=10) as plain, \
            ArchiveClient(k2_client, "127.0.0.1", ports["k2"], CONTROL_STREAM, key="k2",
                          timeout_s=10) as k2:
        # The right key: served, and its replay to its own (k1) endpoint reads everything.
        listed = k1.list_recordings()
        assert [r.descriptor.channel for r in listed] == [recorded]
        recording_id = listed[0].recording_id
        assert k1.describe(recording_id).recorded_position == listed[0].recorded_position
        assert k1.recording_position(recording_id)[1] is False
        collector: list[int] = []
        with k1.replay(recording_id) as replay:
            replay.read_all(lambda d, _h: collector.append(SEQUENCE.unpack_from(d)[0]),
                            timeout_s=30)
        assert collector == list(range(MESSAGES))
        k1._link.call("state", **held)  # holds the k1 stream for the group
        with pytest.raises(CallError, match="a spy is not held for callers"):
            k1._link.call("state", **{**held, "channel": "aeron-spy:" + recorded.replace(
                "|key=k1", "")})

        # A plain caller and a k2 caller: every operation refused, named and counted.
        expected = dict.fromkeys(REFUSAL_CAUSES, 0)
        plain_channel = f"aeron:udp?endpoint=127.0.0.1:{free_port()}"
        for caller, cause in ((plain, "call-without-key"), (k2, "call-with-other-key")):
            assert caller.list_recordings() == []  # not even that it exists
            assert caller.list_all_recordings(stream_id=STREAM) == []
            error = refusal(lambda c=caller: c.describe(recording_id), cause)
            assert f"recording {recording_id} is of key=k1; call on a control channel keyed " \
                   f"k1" in str(error)
            refusal(lambda c=caller: c.recording_position(recording_id), cause)
            refusal(lambda c=caller: c.view(recording_id, "is_retained", {"position": 0}),
                    cause)
            refusal(lambda c=caller: c.start_replay(recording_id, plain_channel, 5), cause)
            refusal(lambda c=caller: c.replay(recording_id), cause)
            for op in ("state", "ended", "release"):
                refusal(lambda c=caller, o=op: c._link.call(o, **held, sessions=[1]), cause)
            refusal(lambda c=caller: c._link.call(
                "view", **held, session_id=1, log=[0, 65536], method="is_retained",
                args={"position": 0}), cause)
            refusal(lambda c=caller: c.replay_held(held, 1, (0, 65536), 0, 32), cause)
            expected[cause] += 10
        # A replay the k1 caller runs: not another caller's to see or stop.
        follow = k1.start_replay(recording_id, plain_channel, 7)
        for caller, cause in ((plain, "call-without-key"), (k2, "call-with-other-key")):
            assert all(r["replay_id"] != follow.replay_id for r in caller._call("replays"))
            refusal(lambda c=caller: c.stop_replay(follow.replay_id), cause)
            expected[cause] += 1
        k1.stop_replay(follow.replay_id)

        # A replay the k1 caller asks to a plain channel leaves sealed under k1: a plain
        # subscriber there gets nothing, a k1 subscriber at another gets every message.
        plain_subscriber = plain_client.add_subscription(plain_channel, 21)
        sealed_port = free_port()
        keyed_subscriber = k1_client.add_subscription(
            f"aeron:udp?endpoint=127.0.0.1:{sealed_port}|key=k1", 22)
        dropped_before = counters_of(plain_driver)["CRYPTO_SEALED_AT_PLAIN_DROPS"]
        to_plain = k1.start_replay(recording_id, plain_channel, 21)
        to_keyed = k1.start_replay(recording_id, f"aeron:udp?endpoint=127.0.0.1:{sealed_port}",
                                   22)
        keyed = Collector(keyed_subscriber)
        deadline = time.monotonic() + 30
        while len(keyed.seen) < MESSAGES and time.monotonic() < deadline:
            keyed.poll()
            time.sleep(0.001)
        keyed.assert_exactly(MESSAGES)
        wait_for(lambda: counters_of(plain_driver)["CRYPTO_SEALED_AT_PLAIN_DROPS"]
                 > dropped_before, timeout=10, what="the sealed replay dropped at plain")
        time.sleep(0.5)
        plain_got = Collector(plain_subscriber)
        plain_got.poll()
        assert plain_got.seen == [] and not plain_subscriber.images
        assert to_plain.replay_id and to_keyed.replay_id
        # Naming another key, or IPC, for a k1 recording: refused by name, counted.
        error = refusal(lambda: k1.start_replay(
            recording_id, f"aeron:udp?endpoint=127.0.0.1:{free_port()}|key=k2", 23),
            "replay-to-other-key")
        assert "key=k1" in str(error) and "key=k2" in str(error)
        refusal(lambda: k1.start_replay(recording_id, "aeron:ipc", 23), "replay-to-other-key")
        expected["replay-to-other-key"] += 2

        # Every refusal counted, in the archive's counters where `slipstream stat` shows them.
        counters = CountersFile(Path(archive_driver.directory) / COUNTERS_FILE, writable=False)
        wait_for(lambda: read_calls_refused(counters, str(archive_dir)) == expected,
                 what=f"the refusals counted {expected}")
        shown = {line.split("calls-refused: ")[1].split()[0]: line.split()[2]
                 for line in run_stat(archive_driver).stdout.splitlines()
                 if "calls-refused: " in line}
        assert shown == {cause: f"{count:,}" for cause, count in expected.items()}, shown

    # The command line calls as any caller: through the k1 endpoint with --key k1.
    cli = [sys.executable, "-m", "slipstream.archive.cli", "replay", str(recording_id),
           "--config", str(tmp_path / "archive.toml")]
    keyed = subprocess.run([*cli, "--key", "k1"], capture_output=True, text=True, timeout=60)
    assert keyed.returncode == 0, keyed.stderr
    assert len(keyed.stdout.splitlines()[2:]) == MESSAGES
    plain = subprocess.run(cli, capture_output=True, text=True, timeout=60)
    assert plain.returncode == 1 and "is of key=k1" in plain.stderr, plain
    unknown = subprocess.run([*cli, "--key", "k9"], capture_output=True, text=True, timeout=60)
    assert unknown.returncode == 2 and "'--key'" in unknown.stderr and "k9" in unknown.stderr, \
        unknown


def test_an_archive_restricted_to_subnets_answers_no_call_from_outside_and_counts_it(
        launch, tmp_path: Path) -> None:
    """control_subnets that leave loopback out: a loopback caller's calls go unanswered
    (the answer would go where a host outside said), each counted; inside, answered."""
    driver = launch()
    for subnets, answered in (("10.255.0.0/16", False), ("127.0.0.0/8", True)):
        port = free_port()
        settings = ArchiveSettings.from_mapping({
            "dir": str(tmp_path / f"archive-{answered}"), "driver_dir": str(driver.directory),
            "control_port": port, "control_subnets": subnets})
        stopping = threading.Event()
        with ArchiveService(settings) as service:
            runner = threading.Thread(target=service.run, args=(stopping.is_set,))
            runner.start()
            try:
                with Client.connect(driver.directory) as client, \
                        ArchiveClient(client, "127.0.0.1", port, CONTROL_STREAM,
                                      timeout_s=2) as caller:
                    for _ in range(3):
                        if answered:
                            assert caller.list_recordings() == []
                        else:
                            with pytest.raises(CallError, match="did not answer"):
                                caller.list_recordings()
                    assert service.control is not None
                    assert service.control.refused["call-outside-subnets"] == \
                        (0 if answered else 3)
                    counters = CountersFile(Path(driver.directory) / COUNTERS_FILE,
                                            writable=False)
                    assert read_calls_refused(counters, str(settings.dir))[
                        "call-outside-subnets"] == (0 if answered else 3)
            finally:
                stopping.set()
                runner.join(10)


@pytest.mark.parametrize(("values", "key", "why"), [
    ({"control_keys": {"k1": 70000}}, "control_keys", "not a UDP port"),
    ({"control_keys": {"a/b": 8012}}, "control_keys", "not a key name"),
    ({"control_keys": {"k1": 8012, "k2": 8012}}, "control_keys", "two keys on one port"),
    ({"control_keys": {"k1": 8010}}, "control_keys", "control_port"),
    ({"control_subnets": "10.0.0.1/8"}, "control_subnets", "not a subnet"),
    ({"control_keyz": {}}, "control_keyz", "unknown key"),
    ({"peers": ["10.0.0.2:8012|key=k1"], "control_keys": {"k1": 8012}}, "replication_port",
     "port 8012, one of this archive's control ports"),
    ({"peers": ["10.0.0.2:8012|kee=k1"]}, "peers", "only key=NAME"),
])
def test_a_protected_calls_setting_the_archive_cannot_act_on_is_refused_by_name(
        values: dict, key: str, why: str) -> None:
    with pytest.raises(ValueError, match=why) as raised:
        ArchiveSettings.from_mapping(values)
    assert getattr(raised.value, "key", None) == key


def test_a_keyed_recording_replicates_over_keyed_calls_and_never_over_plain_ones(
        keyed_archive, tmp_path: Path) -> None:
    """A second archive whose peer entry is the first's plain endpoint fetches nothing of
    the k1 recording (it is not listed to it); one whose entry is the k1 endpoint
    (``|key=k1``) holds every message of it, fetched over a replay sealed under k1."""
    archive_driver, ports, _, _, _, archive_dir, _ = keyed_archive
    # The same key and stream at an endpoint of its own (with MDC each host has its own).
    own = f"aeron:udp?endpoint=127.0.0.1:{free_port()}|key=k1"
    for peer, replicated in ((f"127.0.0.1:{ports[None]}", False),
                             (f"127.0.0.1:{ports['k1']}|key=k1", True)):
        b_dir = tmp_path / f"b-{replicated}"
        config = tmp_path / f"b-{replicated}.toml"
        config.write_text("\n".join([
            f'dir = "{b_dir}"', f'driver_dir = "{archive_driver.directory}"',
            "control_port = 0", f'peers = ["{peer}"]', 'replication_interval = "300ms"',
            f"replication_port = {free_port()}",
            "[[record]]", f'channel = "{own}"', f"stream_id = {STREAM}",
            'source = "remote"']) + "\n")
        load_settings(config)
        with archive_process(config, tmp_path / f"b-{replicated}.log"):
            if replicated:
                replica = wait_for_recording(b_dir, ended=True, timeout=30)
                original = wait_for_recording(archive_dir, ended=True)
                assert recorded_messages(replica, b_dir) == \
                    recorded_messages(original, archive_dir)
                assert len(recorded_messages(replica, b_dir)) == MESSAGES
                assert replica.channel == own
                assert replica.source_identity.startswith("replica of recording 0 at ")
            else:
                time.sleep(3)  # ten looks at the peer
                assert recordings(b_dir) == []
