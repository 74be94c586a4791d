"""A client's resource linger (``Client.connect(resource_linger_s=...)``, Aeron's
``resourceLingerDurationNs``), at real driver and archive processes over loopback:

* with 0, a closed publication's and subscription's logs are unmapped by close() itself
  (``/proc/self/maps``), so the driver zeroes their files and hands them to the next logs of
  their length at once (LOGS_REUSED), where the default 3 s linger keeps them mapped;
* the default linger keeps a thread that is inside an offer, a claim or a poll on another
  thread when the stream closes from faulting: it sees CLOSED (or nothing more to read); a
  linger-0 client's own close() lingers too (it may come from any thread) — hammered in
  child processes, where a touch of an unmapped page would kill the child;
* back-to-back replays from the archive (whose client lingers 0) to a reader whose client
  lingers 0 get their logs from the files of the replay before.
"""

from __future__ import annotations

import functools
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import Collector, connect, counters_of, free_port, stream, wait_for
from test_archive import SEGMENT, archive_process, publish, wait_for_recording, write_config
from test_log_reuse import REUSE, is_ready, kept_ready, ready_count, released

from slipstream.archive.client import ArchiveClient
from slipstream.client import Client, control
from slipstream.client.client import RESOURCE_LINGER_S
from slipstream.client.errors import InvalidArgumentError

STREAM = 71
TERM = 64 * 1024


def mapped(paths: list[Path]) -> set[Path]:
    """Which of ``paths`` this process maps now (``/proc/self/maps``; an unlinked file shows
    with `` (deleted)``)."""
    maps = Path("/proc/self/maps").read_text()
    return {p for p in paths if str(p) in maps}


def run_and_close(client: Client, driver, uri: str, first: int) -> tuple[Path, Path, bool]:
    """A UDP stream over five terms (its logs written all over) from a new publication to a
    new subscription of ``client``, read exactly once, then both closed; their logs' paths
    and whether both were unmapped as each close() returned.  The subscription closes first:
    an image whose stream ended while its subscription was open (the EOS comes as soon as the
    closed publication drained) is retired unlingered, at the subscription's next read or
    close, whatever the client's linger."""
    subscription = client.add_subscription(uri, STREAM)
    publication = client.add_publication(uri, STREAM)
    connect(publication, subscription)
    collector = Collector(subscription)
    stream(publication, [collector], 5 * TERM // 1024, lambda i: 1000, first=first)
    collector.assert_exactly(5 * TERM // 1024, first)
    (publication_log,) = (driver.directory / control.PUBLICATIONS_DIR).glob("*.logbuffer")
    (image_log,) = (driver.directory / control.IMAGES_DIR).glob("*.logbuffer")
    assert mapped([publication_log, image_log]) == {publication_log, image_log}
    subscription.close()
    image_gone = image_log not in mapped([image_log])
    publication.close()
    publication_gone = publication_log not in mapped([publication_log])
    return publication_log, image_log, publication_gone and image_gone


def test_a_linger_zero_client_unmaps_closed_logs_at_once_and_the_driver_reuses_them(
        launch) -> None:
    """Closed by a default client, a stream's two logs stay mapped, and the driver may not
    zero their files while the linger lasts; closed by a linger-0 client, neither is mapped
    as close() returns, both files are kept zeroed before the linger would have ended, and
    the next stream is made from them (LOGS_REUSED) and reads exactly its own messages."""
    driver = launch(**REUSE)
    uri = f"aeron:udp?endpoint=127.0.0.1:{free_port()}"
    with Client.connect(driver.directory) as lingering:
        *_, unmapped = run_and_close(lingering, driver, uri, 0)
        assert not unmapped
        wait_for(lambda: len(released(driver)) == 2, timeout=RESOURCE_LINGER_S,
                 what="the driver released both logs")
        assert not any(map(is_ready, released(driver)))  # mapped here: not handed out
    with Client.connect(driver.directory, resource_linger_s=0) as client:
        wait_for(lambda: kept_ready(driver, 2), timeout=10, what="the lingered logs kept")
        *_, unmapped = run_and_close(client, driver, uri, 10**6)  # made from those two
        closed = time.monotonic()
        assert unmapped
        wait_for(lambda: kept_ready(driver, 2), timeout=RESOURCE_LINGER_S - 0.5,
                 what="both logs kept, zeroed, before a linger would have ended")
        assert time.monotonic() - closed < RESOURCE_LINGER_S
        before = counters_of(driver)["LOGS_REUSED"]
        run_and_close(client, driver, uri, 2 * 10**6)
        assert counters_of(driver)["LOGS_REUSED"] == before + 2


@pytest.mark.parametrize("value", [-1, float("nan"), "3", None, True])
def test_a_bad_resource_linger_names_its_key(driver, value: object) -> None:
    with pytest.raises(InvalidArgumentError, match="resource_linger_s"):
        Client.connect(driver.directory, resource_linger_s=value)  # type: ignore[arg-type]


_HAMMER = """
import sys, threading
from slipstream.client import BufferClaim, Client
directory, mode, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
CLOSED = -4
for r in range(rounds):
    client = Client.connect(directory, resource_linger_s=0 if mode == "client" else 3.0)
    uri = "aeron:ipc"
    publication = client.add_exclusive_publication(uri, 81 + r % 2)
    subscription = client.add_subscription(uri, 81 + r % 2)
    started = threading.Event()
    seen = []

    def offer():
        data, lengths = b"m" * 16384, [256] * 64  # long in C: a wide window
        claim = BufferClaim()
        result = 0
        while result != CLOSED:
            started.set()
            result = publication.offer(b"x" * 100)
            if result == CLOSED:
                break
            result = publication.offer_batch(data, lengths)
            if result == CLOSED:
                break
            result = publication.try_claim(64, claim)
            if result > 0:
                claim.buffer[:8] = b"claimed!"
                claim.commit()
        seen.append("offer CLOSED")

    def poll():
        started.set()
        while not subscription.is_closed:
            try:
                subscription.poll(lambda data, header: None, 100)
            except Exception as e:  # a closed client's poll raises: the end of the loop
                seen.append(type(e).__name__)
                return
        seen.append("poll ended")

    threads = [threading.Thread(target=offer), threading.Thread(target=poll)]
    for t in threads:
        t.start()
    started.wait()
    if mode == "client":
        client.close()
    else:
        publication.close()
        subscription.close()
    for t in threads:
        t.join(10)
        assert not t.is_alive(), "a loop never saw the close"
    assert "offer CLOSED" in seen, seen
    client.close()
print("rounds", rounds, flush=True)
"""


@pytest.mark.parametrize("mode", ["streams", "client"])
def test_a_thread_inside_offers_and_polls_at_close_sees_closed_and_never_faults(
        driver, mode: str) -> None:
    """Rounds of an exclusive publication offered to (offer, offer_batch, try_claim) and its
    subscription polled, each on a thread of its own, while the main thread closes them
    (``streams``: a default client's publication and subscription) or a linger-0 client
    (``client``: its close() lingers as the default does): every offer loop ends on CLOSED,
    every poll loop ends, and the child process never faults."""
    rounds = 300  # a linger-0 stream closed under such offers faults within ~300
    result = subprocess.run([sys.executable, "-c", _HAMMER, str(driver.directory), mode,
                             str(rounds)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, (result.returncode, result.stderr[-3000:].splitlines())
    assert f"rounds {rounds}" in result.stdout


def test_back_to_back_replays_make_their_logs_from_the_replay_before(launch,
                                                                    tmp_path: Path) -> None:
    """A stopped recording of several segments replayed to this host twice, the second
    asked for as soon as the first was read and closed: the archive (its client lingers 0)
    and the reader (a linger-0 client) let the first replay's logs go at once, so the
    driver keeps both files before a linger would have ended and makes the second replay's
    publication and image from them; both replays read every message."""
    driver = launch(**REUSE)
    archive_dir = tmp_path / "archive"
    port = free_port()
    config = write_config(tmp_path / "archive.toml", archive_dir, driver.directory,
                          [("aeron:ipc", 12)], control_port=port)
    with Client.connect(driver.directory, resource_linger_s=0) as client, \
            archive_process(config, tmp_path / "archive.log"):
        publication = client.add_publication("aeron:ipc", 12)
        wait_for_recording(archive_dir)
        positions = publish(publication, 800)
        publication.close()
        descriptor = wait_for_recording(archive_dir, ended=True)
        assert descriptor.stop_position == positions[-1] > 4 * SEGMENT
        with ArchiveClient(client, "127.0.0.1", port, 10) as archive:
            reused = []
            for _ in range(2):
                before = counters_of(driver)["LOGS_REUSED"]
                got: list[int] = []
                on_message = functools.partial(lambda into, data, header:
                                               into.append(header.position), got)
                with archive.replay(0) as replay:
                    deadline = time.monotonic() + 60
                    while not replay.done:
                        replay.poll(on_message, 1000)
                        assert time.monotonic() < deadline, f"replay at {replay.position}"
                    reused.append(counters_of(driver)["LOGS_REUSED"] - before)
                ended = time.monotonic()
                assert got == positions
                # The driver lets the replay's logs go (its image once the liveness timeout
                # ends, 1 s here); no mapping of them lingers, so they are kept, zeroed, as
                # the driver lets them go.
                wait_for(lambda: len(released(driver)) == 2 and ready_count(driver) == 2,
                         timeout=RESOURCE_LINGER_S, what="the replay's two logs kept, zeroed")
                assert time.monotonic() - ended < RESOURCE_LINGER_S
            assert reused[1] == 2, reused
