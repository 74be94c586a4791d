"""Protected calls (docs/ARCHIVE.md, "Protected calls"; issue 68): an archive that records a
``key=k1`` stream and takes calls on a plain endpoint and on endpoints keyed k1 and k2, each
caller a driver process of its own.  A plain caller and a k2 caller learn nothing of the k1
recording or of a held k1 stream through any operation: each call is refused, named and
counted by cause (in the archive and in its driver's counters file); ``list`` leaves the
recording out.  The k1 caller is served, its replays sealed under k1 whatever channel it
names: a plain subscriber at that channel gets nothing, a k1 one every message.  An archive
restricted to subnets answers no call from outside them, and counts each."""

from __future__ import annotations

import contextlib
import json
import logging
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import (
    SEQUENCE,
    Collector,
    counters_of,
    free_port,
    message,
    run_stat,
    running_archive,
    wait_for,
)
from test_archive import archive_process, recorded_messages, recordings, wait_for_recording
from test_encrypted_streams import KEY_A, KEY_B, write_keys

from slipstream.archive.client import ArchiveClient
from slipstream.archive.control import (
    REFUSAL_CAUSES,
    UNAUTHORIZED,
    calls_refused_key,
    read_calls_refused,
)
from slipstream.archive.service import ArchiveService
from slipstream.archive.settings import ArchiveSettings, load_settings
from slipstream.client import Client
from slipstream.client.channel import channel_with_key
from slipstream.client.control import COUNTERS_FILE
from slipstream.client.counters import CountersFile, CounterType
from slipstream.client.holding import CallError
from slipstream.spark_bridge.options import OptionError
from slipstream.spark_bridge.planning import _Holder

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


@contextlib.contextmanager
def callers(keyed_archive, *keys: str | None,
            timeout_s: float = 10) -> Iterator[list[ArchiveClient]]:
    """An ArchiveClient of the ``keyed_archive`` for each of ``keys`` (k1, k2, or None: plain),
    each through the client of its own driver, calling the endpoint of its key."""
    _, ports, k1_driver, plain_driver, k2_driver, _, _ = keyed_archive
    drivers = {"k1": k1_driver, None: plain_driver, "k2": k2_driver}
    with contextlib.ExitStack() as stack:
        clients = [stack.enter_context(Client.connect(drivers[key].directory)) for key in keys]
        yield [stack.enter_context(ArchiveClient(client, "127.0.0.1", ports[key],
                                                 CONTROL_STREAM, key=key, timeout_s=timeout_s))
               for client, key in zip(clients, keys, strict=True)]


def test_a_keyed_recording_is_answered_only_to_its_key_and_replays_leave_sealed(
        keyed_archive, tmp_path: Path) -> None:
    archive_driver, _, _, plain_driver, _, archive_dir, recorded = keyed_archive
    held = {"channel": f"aeron:udp?endpoint=127.0.0.1:{free_port()}|key=k1",
            "stream_id": HELD_STREAM, "group": "spark"}
    with callers(keyed_archive, "k1", None, "k2") as (k1, plain, k2):
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
        missing = recording_id + 1000
        for caller, cause in ((plain, "call-without-key"), (k2, "call-with-other-key")):
            assert caller.list_recordings() == []  # not even that it exists
            assert caller.list_all_recordings(stream_id=STREAM) == []
            # Every call about the recording is answered as about one that is not there
            # (its text with the id the only difference): the key is named in no answer.
            for ask in (lambda c, r: c.describe(r), lambda c, r: c.recording_position(r),
                        lambda c, r: c.view(r, "is_retained", {"position": 0}),
                        lambda c, r: c.start_replay(r, plain_channel, 5),
                        lambda c, r: c.replay(r)):
                answers = []
                for asked in (recording_id, missing):
                    with pytest.raises(CallError) as raised:
                        ask(caller, asked)
                    answers.append((str(raised.value).replace(f"recording {asked}",
                                                              "recording N"),
                                    raised.value.answer))
                assert answers[0][0] == answers[1][0] and "k1" not in answers[0][0], answers
                assert {**answers[0][1], "id": 0, "message": ""} == \
                    {**answers[1][1], "id": 0, "message": ""}, answers
            for op in ("state", "ended", "release"):
                refusal(lambda c=caller, o=op: c._link.call(o, **held, sessions=[1]), cause)
            refusal(lambda c=caller: c._link.call(
                "view", **held, session_id=1, log=[0, 65536], method="is_retained",
                args={"position": 0}), cause)
            refusal(lambda c=caller: c.replay_held(held, 1, (0, 65536), 0, 32), cause)
            expected[cause] += 10
        # A replay the k1 caller runs: not another caller's to see or stop (answered as one
        # not running), whether of its recording or of a plain one.
        follow = k1.start_replay(recording_id, plain_channel, 7)
        for caller, cause in ((plain, "call-without-key"), (k2, "call-with-other-key")):
            assert all(r["replay_id"] != follow.replay_id for r in caller._call("replays"))
            assert caller.stop_replay(follow.replay_id) is \
                caller.stop_replay(follow.replay_id + 1000) is False
            expected[cause] += 1
        assert [r["replay_id"] for r in k1._call("replays")] == [follow.replay_id]
        assert k1.stop_replay(follow.replay_id) is True

        # A replay the k1 caller asks to a plain channel leaves sealed under k1: a plain
        # subscriber there gets nothing, a k1 subscriber at another gets every message.
        plain_subscriber = plain.client.add_subscription(plain_channel, 21)
        sealed_port = free_port()
        keyed_subscriber = k1.client.add_subscription(
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
    assert plain.returncode == 1 and f"no recording {recording_id}" in plain.stderr, plain
    unknown = subprocess.run([*cli, "--key", "k9"], capture_output=True, text=True, timeout=60)
    assert unknown.returncode == 2 and "'--key'" in unknown.stderr and "k9" in unknown.stderr, \
        unknown


def test_an_archive_restricted_to_subnets_answers_no_call_from_outside_and_counts_it(
        launch, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """control_subnets that leave loopback out: a loopback caller's calls go unanswered
    (the answer would go where a host outside said), each counted, and logged once for the
    caller in the interval, its text escaped; inside, answered."""
    caplog.set_level(logging.WARNING, logger="slipstream.archive")
    driver = launch()
    for subnets, answered in (("10.255.0.0/16", False), ("127.0.0.0/8", True)):
        caplog.clear()
        port = free_port()
        settings = ArchiveSettings.from_mapping({
            "dir": str(tmp_path / f"archive-{answered}"), "driver_dir": str(driver.directory),
            "control_port": port, "control_subnets": subnets})
        with running_archive(settings) as service:
            with Client.connect(driver.directory) as client, \
                    ArchiveClient(client, "127.0.0.1", port, CONTROL_STREAM,
                                  timeout_s=2) as caller:
                for _ in range(3):
                    if answered:
                        assert caller.list_recordings() == []
                    else:
                        with pytest.raises(CallError, match="did not answer"):
                            caller._link.call("list\nforged log line")
                refusals = [r.getMessage() for r in caplog.records
                            if "call-outside-subnets" in r.getMessage()]
                assert len(refusals) == (0 if answered else 1), refusals
                assert all("\n" not in line and "forged log line" in line
                           for line in refusals), refusals
                assert service.control is not None
                assert service.control.refused["call-outside-subnets"] == \
                    (0 if answered else 3)
                counters = CountersFile(Path(driver.directory) / COUNTERS_FILE,
                                        writable=False)
                assert read_calls_refused(counters, str(settings.dir))[
                    "call-outside-subnets"] == (0 if answered else 3)


@pytest.mark.parametrize(("values", "key", "why"), [
    ({"control_keys": {"k1": 70000}}, "control_keys", "not a UDP port"),
    ({"control_keys": {"a/b": 8012}}, "control_keys", "not a key name"),
    ({"control_keys": {"k1": 8012, "k2": 8012}}, "control_keys", "two keys on one port"),
    ({"control_keys": {"k1": 8010}}, "control_keys", "control_port"),
    ({"control_subnets": "10.0.0.1/8"}, "control_subnets", "not a subnet"),
    ({"control_keyz": {}}, "control_keyz", "unknown setting; did you mean 'control_keys'"),
    ({"peers": ["10.0.0.2:8012|key=k1"], "control_keys": {"k1": 8012}}, "replication_port",
     "port 8012, one of this archive's control ports"),
    ({"peers": ["10.0.0.2:8012|kee=k1"]}, "peers", "only key=NAME"),
    ({"peers": ["10.0.0.2:8010"], "control_port": 8010, "control_keys": {"k1": 8011}},
     "replication_port", "plain peers would come at port 8011"),
    ({"peers": ["10.0.0.2:8012|key=k1"], "control_port": 0, "replication_port": 0,
      "control_keys": {"k1": 8012}}, "replication_port", "peers keyed k1 need a port"),
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
        settings = load_settings(config)
        if replicated:
            with archive_process(config, tmp_path / f"b-{replicated}.log"):
                replica = wait_for_recording(b_dir, ended=True, timeout=30)
                original = wait_for_recording(archive_dir, ended=True)
                assert recorded_messages(replica, b_dir) == \
                    recorded_messages(original, archive_dir)
                assert len(recorded_messages(replica, b_dir)) == MESSAGES
                assert replica.channel == own
                assert replica.source_identity.startswith("replica of recording 0 at ")
            continue
        # In this process, to count its looks at the peer: ten lists of its recordings
        # answered, none of them naming the k1 recording, so nothing fetched.
        with running_archive(settings) as service:
            replicator = service.replicator
            assert replicator is not None
            wait_for(lambda r=replicator: r.looked >= 10, timeout=30,
                     what="ten looks at the peer")
            assert recordings(b_dir) == [] and replicator.fetched == 0


def test_a_local_record_without_key_of_a_keyed_publication_is_a_recording_of_its_key(
        launch, tmp_path: Path) -> None:
    """A ``[[record]]`` that names no key, read through a spy on a ``key=k1`` publication
    of the archive's own host (which runs with no subscriber: ``ssc=true``): the spy names no
    key, yet the recording is catalogued under k1 (the driver says the stream's key with the
    spy's image), so a plain caller learns nothing of it and the k1 caller reads it all.  A
    replay the k1 caller runs of a plain recording is the k1 caller's: a plain caller
    neither sees it in ``replays`` nor stops it."""
    keys = tmp_path / "keys"
    write_keys(keys, "k1", [(1, KEY_A)])
    driver = launch(keys_dir=str(keys))
    endpoint = f"127.0.0.1:{free_port()}"
    ports = {None: free_port(), "k1": free_port()}
    settings = ArchiveSettings.from_mapping({
        "dir": str(tmp_path / "archive"), "driver_dir": str(driver.directory),
        "control_port": ports[None], "control_keys": {"k1": ports["k1"]},
        "record": [{"channel": f"aeron:udp?endpoint={endpoint}", "stream_id": STREAM},
                   {"channel": "aeron:ipc", "stream_id": HELD_STREAM}]})
    with running_archive(settings):
        with Client.connect(driver.directory) as client:
            publication = client.add_publication(
                f"aeron:udp?endpoint={endpoint}|ssc=true|key=k1", STREAM)
            wait_for(lambda: publication.is_connected, timeout=20,
                     what="the archive's spy joined")
            publish_all(publication, MESSAGES)
            publication.close()
            descriptor = wait_for_recording(settings.dir, ended=True, timeout=30)
            plain_publication = client.add_publication("aeron:ipc", HELD_STREAM)
            wait_for(lambda: plain_publication.is_connected, timeout=20,
                     what="the archive subscribed to the plain stream")
            publish_all(plain_publication, 10)
            plain_recording = wait_for_recording(settings.dir, index=1)
            assert descriptor.channel == f"aeron:udp?endpoint={endpoint}|key=k1"
            assert len(recorded_messages(descriptor, settings.dir)) == MESSAGES
            with ArchiveClient(client, "127.0.0.1", ports[None], CONTROL_STREAM,
                               timeout_s=10) as plain, \
                    ArchiveClient(client, "127.0.0.1", ports["k1"], CONTROL_STREAM,
                                  key="k1", timeout_s=10) as k1:
                assert [r.recording_id for r in plain.list_recordings()] == \
                    [plain_recording.recording_id]
                with pytest.raises(CallError, match=f"no recording {descriptor.recording_id}"):
                    plain.replay(descriptor.recording_id)
                assert [r.recording_id for r in k1.list_recordings(stream_id=STREAM)] == \
                    [descriptor.recording_id]
                collector: list[int] = []
                with k1.replay(descriptor.recording_id) as replay:
                    replay.read_all(
                        lambda d, _h: collector.append(SEQUENCE.unpack_from(d)[0]),
                        timeout_s=30)
                assert collector == list(range(MESSAGES))
                follow = k1.start_replay(plain_recording.recording_id,
                                         f"aeron:udp?endpoint=127.0.0.1:{free_port()}", 7)
                assert [r["replay_id"] for r in plain._call("replays")] == []
                assert plain.stop_replay(follow.replay_id) is False
                assert [r["replay_id"] for r in k1._call("replays")] == [follow.replay_id]
                assert k1.stop_replay(follow.replay_id) is True
                # Nor is a plain caller's replay the k1 caller's to see or stop.
                plain_follow = plain.start_replay(
                    plain_recording.recording_id,
                    f"aeron:udp?endpoint=127.0.0.1:{free_port()}", 8)
                assert [r["replay_id"] for r in k1._call("replays")] == []
                assert k1.stop_replay(plain_follow.replay_id) is False
                assert plain.stop_replay(plain_follow.replay_id) is True
            plain_publication.close()


def test_a_plain_call_naming_a_keyed_callers_reply_address_does_not_stop_its_answers(
        keyed_archive) -> None:
    """A plain caller sends a call whose ``reply_channel`` is the k1 caller's reply endpoint:
    the archive answers it there in plain text (the k1 endpoint drops that), and the k1
    caller's answers and replays, sealed, still reach it: each key's publications to an
    address leave from an endpoint of their own."""
    recorded = keyed_archive[-1]
    with callers(keyed_archive, "k1", None) as (k1, plain):
        assert plain.list_recordings() == []
        link = k1._link
        hijack = json.dumps({"version": 1, "kind": "call", "id": 999, "op": "list",
                             "args": {}, "reply_channel": link.reply_channel,
                             "response_stream_id": link.response_stream_id}).encode()
        deadline = time.monotonic() + 10
        while plain._link.control.offer(hijack) <= 0:
            assert time.monotonic() < deadline, "the plain call was not taken"
            time.sleep(0.001)
        # Taken after the hijack on the same image: the archive has answered it by now.
        assert plain.list_recordings() == []
        listed = k1.list_recordings()
        assert [r.descriptor.channel for r in listed] == [recorded]
        got: list[int] = []
        with k1.replay(listed[0].recording_id) as replay:
            replay.read_all(lambda d, _h: got.append(SEQUENCE.unpack_from(d)[0]), timeout_s=30)
        assert got == list(range(MESSAGES))


def test_a_query_holders_replay_is_sealed_under_the_logs_key_whatever_channel_names_it(
        launch, tmp_path: Path) -> None:
    """A Spark query's replay holder (keyed k1) holds the log of a ``key=k1`` stream; a k1
    caller asks a replay of it naming the stream by its plain channel (the holder finds a
    log by stream and session) to a plain channel: the replay leaves sealed under k1, the
    log's own key, so a k1 subscriber there reads every message (a plain one would drop)."""
    keys = tmp_path / "keys"
    write_keys(keys, "k1", [(1, KEY_A)])
    driver = launch(keys_dir=str(keys))
    plain_channel = f"aeron:udp?endpoint=127.0.0.1:{free_port()}"
    holder = _Holder(str(driver.directory), "127.0.0.1", free_port(), key="k1")
    try:
        with Client.connect(driver.directory) as client:
            subscription = client.add_subscription(plain_channel + "|key=k1", STREAM)
            publication = client.add_publication(plain_channel + "|key=k1", STREAM)
            wait_for(lambda: subscription.images and publication.is_connected, timeout=20,
                     what="the keyed stream connected")
            publish_all(publication, 20)  # within the receive window: nothing reads them
            image = subscription.images[0]
            wait_for(lambda: image.producer_position() == publication.position,
                     what="every message in the subscriber's log")
            assert image.channel_key == "k1"
            holder.holds.publish({(STREAM, image.session_id):
                                  (image.log_path, image.join_position, image.channel_key)})
            with ArchiveClient(client, "127.0.0.1", holder.address[1], holder.address[2],
                               key="k1", timeout_s=10) as k1:
                destination = f"aeron:udp?endpoint=127.0.0.1:{free_port()}"
                keyed = Collector(client.add_subscription(destination + "|key=k1", 77))
                held = {"channel": plain_channel, "stream_id": STREAM, "group": "query"}
                started = k1._call("replay", held=held, session_id=image.session_id,
                                   log=[image.initial_term_id, image.term_length],
                                   start=image.join_position, end=image.producer_position(),
                                   channel=destination, stream_id=77)
                assert started["replay_id"]
                deadline = time.monotonic() + 20
                while len(keyed.seen) < 20 and time.monotonic() < deadline:
                    keyed.poll()
                    time.sleep(0.001)
                got = keyed.seen
                assert got == list(range(20))
    finally:
        holder.close()


def test_a_held_stream_call_cannot_make_the_archive_subscribe_towards_a_host_it_names(
        launch, tmp_path: Path) -> None:
    """``state`` naming a channel whose ``control=`` is outside the control subnets is
    refused and counted (the archive's subscription would send status messages there); one
    with ``control=``/``control-mode=`` inside them is refused by name (only a [[hold]] of
    the settings may); an endpoint outside them is refused too; a plain unicast one inside
    is held."""
    driver = launch()
    port = free_port()
    settings = ArchiveSettings.from_mapping({
        "dir": str(tmp_path / "archive"), "driver_dir": str(driver.directory),
        "control_port": port, "control_subnets": "127.0.0.0/8"})
    with running_archive(settings) as service:
        with Client.connect(driver.directory) as client, \
                ArchiveClient(client, "127.0.0.1", port, CONTROL_STREAM,
                              timeout_s=10) as caller:
            local = f"127.0.0.1:{free_port()}"
            for channel in (f"aeron:udp?endpoint={local}|control=10.9.9.9:4000|"
                            f"control-mode=dynamic",
                            f"aeron:udp?endpoint=10.9.9.9:{free_port()}"):
                refusal(lambda c=channel: caller._link.call(
                    "state", channel=c, stream_id=STREAM, group="g"),
                    "call-outside-subnets")
            with pytest.raises(CallError, match="takes no control= or control-mode="):
                caller._link.call("state", channel=f"aeron:udp?control=127.0.0.1:"
                                  f"{free_port()}|control-mode=dynamic",
                                  stream_id=STREAM, group="g")
            assert "sessions" in caller._link.call(
                "state", channel=f"aeron:udp?endpoint={local}", stream_id=STREAM,
                group="g")
            assert service.control is not None
            assert service.control.refused["call-outside-subnets"] == 2


def test_a_plain_and_a_keyed_query_holder_on_one_port_are_refused_naming_replay_port(
        launch, tmp_path: Path) -> None:
    """Two Spark queries' replay holders on one host and ``replayPort``, one plain and one
    keyed k1: the second cannot listen there (one endpoint, one key), and its error names
    ``replayPort`` and the way out, another port.  At a port of its own it listens, its
    refusal counters labelled with that port."""
    keys = tmp_path / "keys"
    write_keys(keys, "k1", [(1, KEY_A)])
    driver = launch(keys_dir=str(keys))
    port = free_port()
    plain = _Holder(str(driver.directory), "127.0.0.1", port)
    try:
        with pytest.raises(OptionError, match="replayPort") as raised:
            _Holder(str(driver.directory), "127.0.0.1", port, key="k1")
        assert "set another replayPort" in str(raised.value)
        keyed_port = free_port()
        keyed = _Holder(str(driver.directory), "127.0.0.1", keyed_port, key="k1")
        try:
            # Its refusals are counted under its own port (its one endpoint is keyed).
            counters = CountersFile(Path(driver.directory) / COUNTERS_FILE, writable=False)
            identity = f"replays at 127.0.0.1:{keyed_port}/{keyed.address[2]}"
            assert all(counters.find(CounterType.CALLS_REFUSED,
                                     calls_refused_key(cause, identity)) is not None
                       for cause in REFUSAL_CAUSES)
        finally:
            keyed.close()
    finally:
        plain.close()


def parked(thread: threading.Thread) -> bool:
    """Whether ``thread`` is in a park: its innermost Python frame is ``await_frames`` (in
    the C park) or an event's wait."""
    frame = sys._current_frames().get(thread.ident or 0)
    return frame is not None and frame.f_code.co_name in ("await_frames", "wait")


def test_a_callers_first_image_on_any_control_endpoint_ends_the_wait_for_a_call(
        launch, tmp_path: Path) -> None:
    """An archive with a plain and a k1 endpoint waits for a call for far longer than the
    test waits: a k1 caller's stream coming (no image anywhere yet) ends the wait, and so
    does a plain caller's coming while the wait parks on the k1 caller's image."""
    keys = tmp_path / "keys"
    write_keys(keys, "k1", [(1, KEY_A)])
    driver = launch(keys_dir=str(keys))
    ports = {None: free_port(), "k1": free_port()}
    settings = ArchiveSettings.from_mapping({
        "dir": str(tmp_path / "archive"), "driver_dir": str(driver.directory),
        "control_port": ports[None], "control_keys": {"k1": ports["k1"]}})
    with ArchiveService(settings) as service, Client.connect(driver.directory) as client:
        control = service.control
        assert control is not None
        for key in ("k1", None):
            waiting = threading.Thread(target=control.wait_for_call, args=(600 * 10**9,))
            waiting.start()
            # Parked (on no image, or on the k1 caller's) before the caller comes: an image
            # there before the wait began is one to wait on for a call, not a call's coming.
            # On an image, parked once the C park counts itself among the log's waiters: a
            # caller's image that comes before that wakes no one (the service parks 10 ms at
            # a time, so such a one is seen within that).
            wait_for(lambda t=waiting: parked(t) and all(
                image.waiters[0] > 0 for image in control.call_images()), what="the wait parked")
            client.add_publication(channel_with_key(
                f"aeron:udp?endpoint=127.0.0.1:{ports[key]}", key), CONTROL_STREAM)
            waiting.join(20)
            assert not waiting.is_alive(), f"a {key or 'plain'} caller's image did not wake it"
            assert len(control.call_images()) == (1 if key else 2)
