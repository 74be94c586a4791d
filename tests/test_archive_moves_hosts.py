"""An archive named by host name moves to another host, and its caller follows the name
(docs/CHANNELS.md §7.2, "Names that follow their peer"; docs/ARCHIVE.md, "Calls by host
name"), on namespace hosts.

Host 1 is the caller's (tests/archive_caller.py, a process inside the host, through its
driver); its hosts file names the archive (``NamespaceHosts.set_names``), as a pod resolves a
StatefulSet's headless Service.  The archive runs on host 2 and records a stream; it stops,
and starts on host 3 from the same directory (the volume follows the pod).  Host 3 is
re-addressed first, into a subnet of its own that host 1 also has an address in: host 3
cannot reach host 1's first address, so the caller's reply channel must move too.  The
name's record is rewritten to host 3's new address once the archive there takes calls; the
same ArchiveClient then lists and replays again, either at once or only once its driver has
followed the name: its driver resolved the name again (the link was out of contact), the
link worked out its reply channel again (this host's address towards the new place), and
the replay holds every message once, in order."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import NETWORK_SETTINGS, counters_of, readdress
from test_archive import archive_process, publish, wait_for_recording, write_config

from slipstream.archive import ArchiveClient
from slipstream.client import Client

pytestmark = pytest.mark.timeout(120)

CALLER = Path(__file__).with_name("archive_caller.py")
CONTROL_PORT = 40331
PROBE_PORT = 40336  # the readiness probe's reply endpoint on host 3
CONTROL_STREAM = 10
STREAM = 71
MESSAGES = 500
#: The name is resolved again at the first check after the change (the default interval).
INTERVAL_S = 1.0


@pytest.mark.parametrize("hosts", [3], indirect=True)
@pytest.mark.parametrize("call", ["waiting", "after_the_driver_followed"])
def test_a_caller_follows_an_archive_whose_name_moves_to_a_re_addressed_host(
        hosts, tmp_path: Path, call: str) -> None:
    """``call``: the caller calls as the name moves (its call waits while its driver follows
    the name), or only once its driver followed the name and the link is connected again."""
    name = f"archive-{hosts.net}.test"
    hosts.set_names(1, {name: hosts[2].address})
    caller_driver, old_driver = (hosts.start_driver(i, **NETWORK_SETTINGS) for i in (1, 2))
    archive_dir = tmp_path / "archive"
    settings = {"control_address": "0.0.0.0"}  # the control stream: the default, 10
    old_config = write_config(tmp_path / "old.toml", archive_dir, old_driver.directory,
                              [("aeron:ipc", STREAM)], control_port=CONTROL_PORT, **settings)
    with archive_process(old_config, tmp_path / "old.log", hosts[2].prefix()) as old:
        with Client.connect(old_driver.directory) as publisher:
            publication = publisher.add_publication("aeron:ipc", STREAM)
            wait_for_recording(archive_dir)
            publish(publication, MESSAGES)
            publication.close()
        wait_for_recording(archive_dir, ended=True)
        caller = hosts[1].popen(sys.executable, str(CALLER), str(caller_driver.directory),
                                name, str(CONTROL_PORT), str(CONTROL_STREAM), "20",
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            assert caller.stdout is not None and caller.stdin is not None
            before = json.loads(caller.stdout.readline() or "{}")
            # The archive's pod goes, and starts on another host, with a new address.
            old.send_signal(signal.SIGTERM)
            assert old.wait(timeout=20) == 0
            new_address = readdress(hosts, 3, 1, keep=False)
            readdress(hosts, 1, 1, keep=True)
            new_driver = hosts.start_driver(3, **NETWORK_SETTINGS)
            new_config = write_config(tmp_path / "new.toml", archive_dir,
                                      new_driver.directory, [("aeron:ipc", STREAM)],
                                      control_port=CONTROL_PORT, **settings)
            with archive_process(new_config, tmp_path / "new.log", hosts[3].prefix()) as new, \
                    Client.connect(new_driver.directory) as local:
                with ArchiveClient(local, new_address, CONTROL_PORT, CONTROL_STREAM,
                                   reply_address=new_address, reply_port=PROBE_PORT) as probe:
                    assert probe.await_connected(30), "the archive on host 3 takes no calls"
                hosts.set_names(1, {name: new_address})
                moved = time.monotonic()
                if call == "after_the_driver_followed":
                    deadline = moved + 20
                    while counters_of(caller_driver)["RESOLUTION_CHANGES"] < 1:
                        assert time.monotonic() < deadline, "the caller's driver stayed"
                        time.sleep(0.05)
                    time.sleep(INTERVAL_S)  # its control publication connected there
                    moved = time.monotonic()
                caller.stdin.write("moved\n")
                caller.stdin.flush()
                after = json.loads(caller.stdout.readline() or "{}")
                working_s = time.monotonic() - moved
                assert caller.wait(timeout=20) == 0
                new.send_signal(signal.SIGTERM)
                assert new.wait(timeout=20) == 0
        finally:
            if caller.poll() is None:
                caller.kill()
            caller.wait(timeout=10)
        changes = counters_of(caller_driver)["RESOLUTION_CHANGES"]

    assert before["messages"] == MESSAGES and before["in_order"], before
    assert before["reply_channel"] == f"aeron:udp?endpoint={hosts[1].address}:{CONTROL_PORT}"
    # After the move: the same client, a reply channel at host 1's address towards the new
    # place (the old one is unreachable from there), every message once and in order.
    assert after["reply_channel"] == (f"aeron:udp?endpoint=10.{hosts.net}.1.1:"
                                      f"{CONTROL_PORT}"), after
    assert after["messages"] == MESSAGES and after["in_order"], after
    assert after["failed_calls"] == 0, after
    # The name resolved again at the next check, the connection cycle, the call's round trip
    # (once the driver followed the name: the call's round trip and the reply's subscription).
    assert after["answered_s"] < INTERVAL_S + 2.0, after
    assert changes == 1
    print(f"\narchive by name: the first call after the name moved was answered "
          f"{after['answered_s']:.2f} s after the change (the replay of {MESSAGES} messages "
          f"done {working_s:.2f} s after it)")
