"""A driver reuses the files of the logs it released (``log_reuse_bytes``), at real driver
processes over loopback, in /dev/shm:

* a released publication's and image's log is kept, and the next log of its length is made
  from it (the same inode, LOGS_REUSED), and its stream reads as on a fresh log: every
  message of the new stream exactly once, nothing of the old one, at any offset the old
  stream had reached (several term rotations, offsets drawn by hypothesis);
* a released log that a process still maps is neither zeroed nor handed out until it is
  unmapped, so no mapping of an old stream can ever see a new stream's data; the check is
  the kernel's (a write lease), held while the file is zeroed and handed out: a file a
  process opens meanwhile is deleted, not handed out;
* the pool keeps at most ``log_reuse_bytes`` (the oldest go first), no more than the logs in
  use leave of ``log_buffer_memory_limit``, and deletes a file kept ``log_reuse_timeout``; 0
  keeps none; a bad value names its key;
* the kept files give way on the logs' filesystem too: a log that finds too little room
  there has the oldest deleted (a small /dev/shm), and a log made in a kept file needs no
  room for the pages it brings;
* a large kept file is zeroed in pieces, between which the image log worker makes new
  logs;
* an image whose stream ended and whose last subscriber went is released at once, so
  back-to-back replays' images are made from the file the one before released;
* the driver's directory clean-up removes kept files.
"""

from __future__ import annotations

import mmap
import os
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers import (
    NETWORK_SETTINGS,
    Collector,
    connect,
    counters_of,
    free_port,
    hold_populate_steps,
    resize_tmpfs,
    small_tmpfs,
    stream,
    wait_for,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slipstream.client import Client, control
from slipstream.client.errors import ConfigurationError
from slipstream.client.layout import LOG_META_DATA_LENGTH, META_MTU_LENGTH
from slipstream.client.logbuffer import LogBuffer, compute_log_length
from slipstream.daemon.conductor import log_pool
from slipstream.daemon.conductor.image_logs import ImageLogMaker, LogJob, LogMaking
from slipstream.daemon.conductor.log_pool import LogPool, is_unshared
from slipstream.daemon.config import DriverSettings
from slipstream.daemon.driver import MediaDriver

KIB = 1024
STREAM = 67
TERM = 64 * KIB
LOG_LENGTH = compute_log_length(TERM)
#: Logs go soon after their stream closes, and stay kept for the test's length.
REUSE = {"publication_linger_timeout": "100ms", "log_reuse_timeout": "30s"}


def released(driver: MediaDriver) -> list[Path]:
    """The kept files, in the order their logs were made (registration ids)."""
    return sorted((driver.directory / control.RELEASED_LOGS_DIR).glob("*.logbuffer"),
                  key=lambda p: int(p.stem))


def leases_of(path: Path) -> list[str]:
    """The kernel's lines (/proc/locks) of the leases on the file at ``path``."""
    inode = path.stat().st_ino
    with open("/proc/locks") as locks:
        return [line for line in locks if "LEASE" in line and f":{inode} " in line]


def is_ready(path: Path) -> bool:
    """Whether the kept file at ``path`` holds what the pool writes when it zeroed it (its
    metadata, written last, holds the term length but no MTU).  Opens the file: only for a
    file the pool cannot be zeroing now (one this process maps, or one a pool this test
    drives holds, or one the driver counts ready), since an open while the pool holds its
    lease has the pool delete the file."""
    try:
        if leases_of(path):  # a pool this test drives is zeroing it
            return False
        with open(path, "rb") as f:
            f.seek(3 * TERM)
            meta = f.read(LOG_META_DATA_LENGTH)
    except FileNotFoundError:
        return False
    mtu, term_length = struct.unpack_from("<ii", meta, META_MTU_LENGTH)
    return mtu == 0 and term_length == TERM


def ready_count(driver: MediaDriver) -> int:
    """The kept files ``driver`` has zeroed (RELEASED_LOGS_READY): told without opening
    one, which would have the pool delete a file it is zeroing."""
    return counters_of(driver)["RELEASED_LOGS_READY"]


def kept_ready(driver: MediaDriver, count: int) -> bool:
    """``count`` files kept, all zeroed, and no log in use."""
    return (len(released(driver)) == count and ready_count(driver) == count
            and not logs(driver))


def logs(driver: MediaDriver) -> list[Path]:
    return [*(driver.directory / control.PUBLICATIONS_DIR).glob("*.logbuffer"),
            *(driver.directory / control.IMAGES_DIR).glob("*.logbuffer")]


def run_stream(client: Client, uri: str, count: int, first: int = 0) -> None:
    """``count`` messages of 1 KiB from a new publication to a new subscription of ``uri``,
    each read exactly once, in order; both closed after."""
    subscription = client.add_subscription(uri, STREAM)
    publication = client.add_publication(uri, STREAM)
    try:
        connect(publication, subscription)
        collector = Collector(subscription)
        stream(publication, [collector], count, lambda i: 1000, first=first)
        collector.assert_exactly(count, first)
    finally:
        publication.close()
        subscription.close()


def test_a_released_publication_and_image_log_make_the_next_logs_of_their_length(
        launch) -> None:
    """The first stream (30 terms of messages: its logs written all over) leaves its two
    logs in the pool, zeroed; the next stream's publication and image are made from those
    very files (their inodes) and it reads exactly its own messages."""
    driver = launch(**REUSE)
    uri = f"aeron:udp?endpoint=127.0.0.1:{free_port()}"
    with Client.connect(driver.directory) as client:
        run_stream(client, uri, 30 * TERM // 1024)
        wait_for(lambda: kept_ready(driver, 2), timeout=10, what="both logs kept")
        kept = {p.stat().st_ino for p in released(driver)}
        for path in released(driver):
            with open(path, "rb") as f:
                assert f.read(3 * TERM) == bytes(3 * TERM), f"{path.name} not zeroed"
        wait_for(lambda: counters_of(driver)["RELEASED_LOG_BYTES"] > 0,
                 what="the pool's bytes shown")
        assert counters_of(driver)["RELEASED_LOG_BYTES"] == sum(
            p.stat().st_blocks * 512 for p in released(driver))

        subscription = client.add_subscription(uri, STREAM)
        publication = client.add_publication(uri, STREAM)
        connect(publication, subscription)
        assert {p.stat().st_ino for p in logs(driver)} == kept
        assert released(driver) == []
        collector = Collector(subscription)
        stream(publication, [collector], 5 * TERM // 1024, lambda i: 1000, first=10**6)
        collector.assert_exactly(5 * TERM // 1024, 10**6)
        wait_for(lambda: counters_of(driver)["LOGS_REUSED"] == 2, what="two logs reused")
        assert counters_of(driver)["RELEASED_LOG_BYTES"] == 0


@settings(max_examples=6, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(messages=st.integers(min_value=1, max_value=4 * TERM // 1024))
def test_a_reused_log_reads_as_a_fresh_one_wherever_the_old_stream_stopped(
        launch, messages: int) -> None:
    """The old stream stops at any offset (up to four terms: rotations, every partition
    written); the new stream on its file reads exactly its own messages, and its log's terms
    are zero beyond what it wrote, as a fresh log's."""
    driver = launch(**REUSE)
    uri = f"aeron:udp?endpoint=127.0.0.1:{free_port()}"
    with Client.connect(driver.directory) as client:
        run_stream(client, uri, messages)
        wait_for(lambda: kept_ready(driver, 2), timeout=10, what="both logs kept")
        subscription = client.add_subscription(uri, STREAM)
        publication = client.add_publication(uri, STREAM)
        connect(publication, subscription)
        assert released(driver) == []
        for path in logs(driver):
            log = LogBuffer(path, writable=False)
            try:
                start = log.producer_position()
                index = (start >> log.position_bits) % 3
                offset = start & (TERM - 1)
                term = bytes(log.term_view(index))
                assert term[offset:] == bytes(TERM - offset), path.name
                for other in {0, 1, 2} - {index}:
                    assert bytes(log.term_view(other)) == bytes(TERM), path.name
                assert log.end_of_stream_position == 2**63 - 1
            finally:
                log.close()
        collector = Collector(subscription)
        stream(publication, [collector], 3, lambda i: 1000, first=10**6)
        collector.assert_exactly(3, 10**6)
        publication.close()
        subscription.close()


def test_a_log_still_mapped_by_a_process_is_never_handed_out(launch) -> None:
    """A process that still maps an image's log when the driver frees it (here: a second
    mapping the test holds, as a client's lingers) keeps reading its own stream's bytes: the
    file is kept but neither zeroed nor given to the next stream while the mapping lives, so
    no mapping of an old stream ever sees a new stream's data; once unmapped, it is."""
    driver = launch(**REUSE)
    uri = f"aeron:udp?endpoint=127.0.0.1:{free_port()}"
    with Client.connect(driver.directory) as client:
        subscription = client.add_subscription(uri, STREAM)
        publication = client.add_publication(uri, STREAM)
        connect(publication, subscription)
        collector = Collector(subscription)
        stream(publication, [collector], 10, lambda i: 1000)
        (image_log,) = (driver.directory / control.IMAGES_DIR).glob("*.logbuffer")
        fd = os.open(image_log, os.O_RDONLY)
        held = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
        os.close(fd)
        inode = os.stat(image_log).st_ino
        try:
            before = bytes(held[:TERM])
            assert before != bytes(TERM)
            publication.close()
            subscription.close()
            wait_for(lambda: len(released(driver)) == 2 and not logs(driver)
                     and ready_count(driver) == 1, timeout=10,
                     what="the publication's log kept, zeroed")
            (held_file,) = [p for p in released(driver) if p.stat().st_ino == inode]
            assert not is_ready(held_file)
            for i in range(2):  # more streams of that length while it is held
                run_stream(client, uri, 3 * TERM // 1024, first=10**6 * (i + 1))
                wait_for(lambda: not logs(driver), timeout=10, what="the logs freed")
                assert bytes(held[:TERM]) == before  # its own stream, untouched
                assert held_file.exists() and not is_ready(held_file)
        finally:
            held.close()
        wait_for(lambda: ready_count(driver) == len(released(driver)), timeout=10,
                 what="the file zeroed once unmapped")
        assert is_ready(held_file)
        with open(held_file, "rb") as f:
            assert f.read(3 * TERM) == bytes(3 * TERM)


def test_is_unshared_tells_a_mapped_file(shm: Path) -> None:
    """The kernel's answer the pool relies on: a file mapped (by this process, its
    descriptor closed) is not unshared; once unmapped, it is."""
    path = shm / "1.logbuffer"
    path.write_bytes(bytes(8192))
    fd = os.open(path, os.O_RDWR)
    mapped = mmap.mmap(fd, 8192)
    os.close(fd)
    fd = os.open(path, os.O_RDWR)
    try:
        assert not is_unshared(fd)
        mapped.close()
        assert is_unshared(fd)
    finally:
        os.close(fd)


def test_the_pool_keeps_at_most_its_bytes(launch) -> None:
    """Room for two logs of 64 KiB terms written through (each holds its whole file): a
    stream after a stream reuses the two kept; two streams at once, two of their logs made
    in the kept files and two new, release four into that room, and two stay kept."""
    driver = launch(**{**REUSE, "log_reuse_bytes": str(2 * LOG_LENGTH + 1)})
    with Client.connect(driver.directory) as client:
        batches = []
        for i in range(2):
            uri = f"aeron:udp?endpoint=127.0.0.1:{free_port()}"
            run_stream(client, uri, 4 * TERM // 1024, first=i * 1000)
            wait_for(lambda: kept_ready(driver, 2), timeout=10, what="two logs kept")
            batches.append({p.stat().st_ino for p in released(driver)})
        assert counters_of(driver)["RELEASED_LOG_BYTES"] == 2 * LOG_LENGTH
        # The second stream took the first's files; a third stream and its image, as the
        # pool holds two, make two fresh logs, and then four are released into room for two.
        subscription = client.add_subscription(uri, STREAM)
        publication = client.add_publication(uri, STREAM)
        other_uri = f"aeron:udp?endpoint=127.0.0.1:{free_port()}"
        other_subscription = client.add_subscription(other_uri, STREAM)
        other_publication = client.add_publication(other_uri, STREAM)
        connect(publication, subscription)
        connect(other_publication, other_subscription)
        for pub, sub in ((publication, subscription), (other_publication, other_subscription)):
            collector = Collector(sub)
            stream(pub, [collector], 4 * TERM // 1024, lambda i: 1000)
        in_use = {p.stat().st_ino for p in logs(driver)}
        assert len(in_use) == 4 and len(in_use & batches[1]) == 2
        for closable in (publication, subscription, other_publication, other_subscription):
            closable.close()
        wait_for(lambda: kept_ready(driver, 2), timeout=10, what="two of four kept")
        time.sleep(0.3)  # no third one comes
        assert len(released(driver)) == 2
        assert counters_of(driver)["RELEASED_LOG_BYTES"] <= 2 * LOG_LENGTH + 1


def test_kept_files_give_way_to_new_logs_within_log_buffer_memory_limit(launch) -> None:
    """The kept files share log_buffer_memory_limit with the logs in use: a stream of
    longer terms, whose two logs leave room for one kept file, has one of the two kept ones
    deleted, and is made and read whole."""
    longer = compute_log_length(2 * TERM)
    limit = 2 * longer + LOG_LENGTH
    driver = launch(**{**REUSE, "log_buffer_memory_limit": str(limit)})
    with Client.connect(driver.directory) as client:
        run_stream(client, f"aeron:udp?endpoint=127.0.0.1:{free_port()}", 4 * TERM // 1024)
        wait_for(lambda: kept_ready(driver, 2), timeout=10, what="both logs kept")
        kept = set(released(driver))
        uri = f"aeron:udp?endpoint=127.0.0.1:{free_port()}|term-length={2 * TERM}"
        subscription = client.add_subscription(uri, STREAM)
        publication = client.add_publication(uri, STREAM)
        connect(publication, subscription)
        wait_for(lambda: len(released(driver)) == 1, what="a kept file deleted")
        assert set(released(driver)) < kept
        wait_for(lambda: counters_of(driver)["RELEASED_LOG_BYTES"] <= limit - 2 * longer,
                 what="the pool within what the logs in use leave")
        collector = Collector(subscription)
        stream(publication, [collector], 8 * TERM // 1024, lambda i: 1000)
        collector.assert_exactly(8 * TERM // 1024)
        publication.close()
        subscription.close()


def free_bytes(folder: Path) -> int:
    usage = os.statvfs(folder)
    return usage.f_bavail * usage.f_frsize


def used_bytes(folder: Path) -> int:
    usage = os.statvfs(folder)
    return (usage.f_blocks - usage.f_bfree) * usage.f_frsize


def test_kept_files_give_way_to_a_new_log_on_a_full_filesystem(tmp_path: Path) -> None:
    """On a small tmpfs (as Docker's 64 MiB /dev/shm) where the two kept logs of a stream
    leave too little room for a stream of longer terms, the longer logs are made, not
    refused: one kept file (the oldest) is deleted for the room, the other stays, and the new
    stream is read whole."""
    longer = compute_log_length(2 * TERM)
    with small_tmpfs(tmp_path / "shm", 64 * 2**20) as shm, MediaDriver.launch(
            directory=shm / "driver", **{**NETWORK_SETTINGS, **REUSE}) as driver, \
            Client.connect(driver.directory) as client:
        run_stream(client, f"aeron:udp?endpoint=127.0.0.1:{free_port()}", 4 * TERM // 1024)
        wait_for(lambda: kept_ready(driver, 2), timeout=10, what="both logs kept")
        kept = released(driver)
        kept_bytes = sum(p.stat().st_blocks * 512 for p in kept)
        assert kept_bytes == 2 * LOG_LENGTH  # written through
        # Room for the two longer logs but a quarter of what the kept files hold.
        resize_tmpfs(shm, used_bytes(shm) + 2 * longer - kept_bytes // 4)
        assert free_bytes(shm) < 2 * longer
        uri = f"aeron:udp?endpoint=127.0.0.1:{free_port()}|term-length={2 * TERM}"
        subscription = client.add_subscription(uri, STREAM)
        publication = client.add_publication(uri, STREAM)
        connect(publication, subscription)
        remaining = released(driver)
        assert len(remaining) == 1 and set(remaining) < set(kept)
        collector = Collector(subscription)
        stream(publication, [collector], 8 * TERM // 1024, lambda i: 1000)
        collector.assert_exactly(8 * TERM // 1024)
        assert counters_of(driver)["LOGS_REUSED"] == 0
        publication.close()
        subscription.close()


def test_a_log_made_in_a_kept_file_needs_room_only_for_pages_it_lacks(
        tmp_path: Path) -> None:
    """On a tmpfs with less free than a log's length, a stream whose logs' length the pool
    keeps is made in the kept files (their pages there already), not refused."""
    with small_tmpfs(tmp_path / "shm", 64 * 2**20) as shm, MediaDriver.launch(
            directory=shm / "driver", **{**NETWORK_SETTINGS, **REUSE}) as driver, \
            Client.connect(driver.directory) as client:
        run_stream(client, f"aeron:udp?endpoint=127.0.0.1:{free_port()}", 4 * TERM // 1024)
        wait_for(lambda: kept_ready(driver, 2), timeout=10, what="both logs kept")
        kept = {p.stat().st_ino for p in released(driver)}
        resize_tmpfs(shm, used_bytes(shm) + LOG_LENGTH // 2)
        assert free_bytes(shm) < LOG_LENGTH
        run_stream(client, f"aeron:udp?endpoint=127.0.0.1:{free_port()}", 4 * TERM // 1024,
                   first=1000)
        assert counters_of(driver)["LOGS_REUSED"] == 2
        wait_for(lambda: kept_ready(driver, 2), timeout=10, what="both logs kept again")
        assert {p.stat().st_ino for p in released(driver)} == kept


def test_a_kept_file_is_deleted_after_log_reuse_timeout(launch) -> None:
    """An idle driver gives the memory back: the kept files go by themselves."""
    driver = launch(**{**REUSE, "log_reuse_timeout": "5s"})
    with Client.connect(driver.directory) as client:
        run_stream(client, f"aeron:udp?endpoint=127.0.0.1:{free_port()}", 10)
        released_at = time.monotonic()
        wait_for(lambda: kept_ready(driver, 2), timeout=10, what="both logs kept")
        wait_for(lambda: counters_of(driver)["RELEASED_LOG_BYTES"] > 0,
                 what="the pool's bytes shown")
        wait_for(lambda: released(driver) == [], timeout=10, what="the kept files deleted")
        assert time.monotonic() - released_at > 4
        wait_for(lambda: counters_of(driver)["RELEASED_LOG_BYTES"] == 0,
                 what="the pool's bytes shown as none")


def test_log_reuse_bytes_zero_keeps_nothing(launch) -> None:
    driver = launch(**{**REUSE, "log_reuse_bytes": "0"})
    with Client.connect(driver.directory) as client:
        uri = f"aeron:udp?endpoint=127.0.0.1:{free_port()}"
        run_stream(client, uri, 10)
        wait_for(lambda: not logs(driver), what="the logs freed")
        run_stream(client, uri, 10, first=100)
        wait_for(lambda: not logs(driver), what="the logs freed again")
        assert released(driver) == []
        assert counters_of(driver)["LOGS_REUSED"] == 0


@pytest.mark.parametrize(("key", "value"), [("log_reuse_bytes", "lots"),
                                            ("log_reuse_bytes", "-1"),
                                            ("log_reuse_timeout", "0")])
def test_a_bad_reuse_setting_names_its_key(key: str, value: str) -> None:
    with pytest.raises(ConfigurationError, match=key):
        DriverSettings.from_mapping({key: value})


def test_a_stopping_driver_deletes_its_kept_files(shm: Path) -> None:
    directory = shm / "driver"
    uri = f"aeron:udp?endpoint=127.0.0.1:{free_port()}"
    with MediaDriver.launch(directory=directory, term_buffer_length="64k",
                            **REUSE) as driver, Client.connect(driver.directory) as client:
        run_stream(client, uri, 10)
        wait_for(lambda: kept_ready(driver, 2), timeout=10, what="both logs kept")
    assert not (directory / control.RELEASED_LOGS_DIR).exists() or \
        list((directory / control.RELEASED_LOGS_DIR).iterdir()) == []


def test_a_crashed_drivers_kept_files_are_removed_by_the_next_driver(shm: Path) -> None:
    """A driver killed while it keeps two files, one zeroed and one still mapped (here by
    the test), leaves them; the next driver in its directory knows both for its own and
    removes them, and the mapping keeps its own stream's bytes."""
    directory = shm / "driver"
    uri = f"aeron:udp?endpoint=127.0.0.1:{free_port()}"
    settings = {"term_buffer_length": "64k", **REUSE}
    with MediaDriver.launch(directory=directory, **settings) as crashed, \
            Client.connect(directory) as client:
        subscription = client.add_subscription(uri, STREAM)
        publication = client.add_publication(uri, STREAM)
        connect(publication, subscription)
        stream(publication, [Collector(subscription)], 10, lambda i: 1000)
        (image_log,) = (directory / control.IMAGES_DIR).glob("*.logbuffer")
        fd = os.open(image_log, os.O_RDONLY)
        held = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
        os.close(fd)
        before = bytes(held[:TERM])
        publication.close()
        subscription.close()
        wait_for(lambda: len(released(crashed)) == 2 and not logs(crashed)
                 and ready_count(crashed) == 1, timeout=10,
                 what="one file kept zeroed, one kept mapped")
        crashed.kill()
    try:
        with MediaDriver.launch(directory=directory, **settings):
            assert list((directory / control.RELEASED_LOGS_DIR).iterdir()) == []
        assert bytes(held[:TERM]) == before
    finally:
        held.close()


def a_kept_log(shm: Path) -> tuple[LogPool, Path]:
    """A pool in ``shm``, and a log file of a stream written in ``shm`` and closed, for the
    pool to keep: (the pool, the file's path once the pool keeps it)."""
    folder = shm / control.RELEASED_LOGS_DIR
    folder.mkdir()
    pool = LogPool(folder, 1 << 30, 10**10)
    log = LogBuffer.create(shm / "7.logbuffer", term_length=TERM, initial_term_id=3,
                           session_id=1, stream_id=2, mtu=1408, correlation_id=7)
    log.term_view(1)[:5] = b"hello"
    log.close()
    return pool, folder / log.path.name


def test_the_pool_hands_out_only_a_file_of_the_length_asked(shm: Path) -> None:
    """A kept file of another length is not taken; one of the length is, under the new
    name, its terms zero, and the log made in it is byte for byte a fresh log's."""
    pool, kept = a_kept_log(shm)
    path = shm / kept.name
    assert pool.keep(path)
    assert not path.exists() and pool.count == 1
    assert not pool.take(shm / "8.logbuffer", compute_log_length(2 * TERM))
    assert pool.take(shm / "8.logbuffer", LOG_LENGTH)
    assert (shm / "8.logbuffer").read_bytes()[:3 * TERM] == bytes(3 * TERM)
    assert pool.count == 0 and pool.reused == 1
    made = {"term_length": TERM, "initial_term_id": 9, "session_id": 4, "stream_id": 5,
            "mtu": 1408, "correlation_id": 8, "initial_term_count": 1,
            "initial_term_offset": 4096}
    LogBuffer.create(shm / "8.logbuffer", reused=True, **made).close()
    LogBuffer.create(shm / "9.logbuffer", **made).close()
    assert (shm / "8.logbuffer").read_bytes() == (shm / "9.logbuffer").read_bytes()


def open_in_another_process(path: Path) -> subprocess.Popen:
    """A process that opens ``path`` for reading (held until the pool drops its lease),
    and waits until the kernel shows the break of the pool's lease it begins."""
    opener = subprocess.Popen([sys.executable, "-c",
                               "import os, sys; os.close(os.open(sys.argv[1], os.O_RDONLY))",
                               str(path)])
    wait_for(lambda: any("BREAKING" in line for line in leases_of(path)),
             what="the pool's lease breaking")
    return opener


def test_a_kept_file_opened_while_it_is_zeroed_is_deleted(shm: Path, monkeypatch) -> None:
    """A process that opens a released file while the pool zeroes it (here: as the zeros
    are written) could keep it open, and read a later stream's data: the pool sees the
    break of its lease and deletes the file rather than keep it."""
    pool, kept = a_kept_log(shm)
    zero_pages = log_pool.zero_pages
    openers = []

    def zero_and_open(fd: int, length: int, start: int, most: int | None) -> int:
        reached = zero_pages(fd, length, start, most)
        openers.append(open_in_another_process(kept))
        return reached

    monkeypatch.setattr(log_pool, "zero_pages", zero_and_open)
    assert pool.keep(shm / kept.name)
    assert openers[0].wait(timeout=10) == 0  # it did open the file
    assert pool.count == 0 and not kept.exists()
    assert not pool.take(shm / "8.logbuffer", LOG_LENGTH)


def test_a_kept_file_opened_while_it_is_taken_is_not_handed_out(shm: Path,
                                                                  monkeypatch) -> None:
    """A process that opens a kept file by its pool name as the pool hands it out (here:
    once it is linked under the new log's name) makes the pool delete it instead: no file
    is handed out, the new name does not exist, and the next take makes a log as new."""
    pool, kept = a_kept_log(shm)
    assert pool.keep(shm / kept.name) and pool.count == 1
    link = os.link
    openers = []

    def link_and_open(source: Path, target: Path) -> None:
        link(source, target)
        openers.append(open_in_another_process(kept))

    monkeypatch.setattr(os, "link", link_and_open)
    assert not pool.take(shm / "8.logbuffer", LOG_LENGTH)
    assert openers[0].wait(timeout=10) == 0
    assert pool.count == 0 and pool.reused == 0
    assert not kept.exists() and not (shm / "8.logbuffer").exists()


def test_a_large_kept_file_is_zeroed_in_pieces_between_new_logs(shm: Path) -> None:
    """A released log of more pages than the pool zeroes at a time (here its step is a
    term) is zeroed over several of the image log worker's steps: a log asked for after it
    is released is made at the next step, before the kept file is ready, and the file is
    ready, its terms zero, after as many steps as its pieces."""
    folder = shm / control.RELEASED_LOGS_DIR
    folder.mkdir()
    pool = LogPool(folder, 1 << 30, 10**10)
    pool.zero_step = TERM
    maker = ImageLogMaker(making=LogMaking.DEFERRED, pool=pool)
    old = LogBuffer.create(shm / "7.logbuffer", term_length=TERM, initial_term_id=3,
                           session_id=1, stream_id=2, mtu=1408, correlation_id=7)
    for index in range(3):
        old.term_view(index)[:] = b"\xff" * TERM
    gone = []
    maker.discard(old, lambda: gone.append(True))
    made = {"term_length": 2 * TERM, "initial_term_id": 9, "session_id": 4, "stream_id": 5,
            "mtu": 1408, "correlation_id": 8}
    job = LogJob(shm / "8.logbuffer", compute_log_length(2 * TERM), made, request=None)
    maker.submit(job)
    maker.step()  # the release, and one piece zeroed
    assert maker.take_gone() and pool.count == 1
    maker.step()  # the new log
    (done,) = maker.take_done()
    assert isinstance(done.result, LogBuffer)
    done.result.close()
    kept = folder / "7.logbuffer"
    assert not is_ready(kept)
    steps = 0
    while not is_ready(kept):
        assert maker.has_done
        maker.step()
        steps += 1
    assert steps >= 2  # three terms and the metadata page, a term at a time
    assert kept.read_bytes()[:3 * TERM] == bytes(3 * TERM)
    assert pool.take(shm / "9.logbuffer", LOG_LENGTH)
    maker.close()


def test_the_worker_hands_a_log_out_before_it_maps_the_logs_pages_in_place(
        shm: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A driver's worker makes a dense log without its pages mapped in place, hands it out
    (the conductor attaches the image then), and maps them after: held at its first step of
    that, the log is already taken, none of it mapped; let go, all of it is mapped.  A log
    the conductor made itself (a network publication's) is mapped there the same way."""
    stepping, go_on = hold_populate_steps(monkeypatch)
    woken = threading.Event()
    maker = ImageLogMaker(making=LogMaking.THREADED, wake=woken.set)
    assert maker.populates_behind
    kwargs = {"term_length": TERM, "initial_term_id": 1, "session_id": 3, "stream_id": 5,
              "mtu": 1408, "correlation_id": 9, "sparse": False}
    ours = LogBuffer.create(shm / "2.logbuffer", behind=True, **kwargs)
    made: LogBuffer | None = None
    try:
        maker.submit(LogJob(shm / "1.logbuffer", LOG_LENGTH, kwargs, request=None))
        assert woken.wait(30)
        (done,) = maker.take_done()
        assert isinstance(done.result, LogBuffer)
        made = done.result
        maker.populate_behind(ours)
        assert stepping.wait(30)
        assert made.unpopulated == made.length and ours.unpopulated == ours.length
        go_on.set()
        deadline = time.monotonic() + 30
        while (made.unpopulated or ours.unpopulated) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert made.unpopulated == 0 and ours.unpopulated == 0
    finally:
        go_on.set()
        maker.close()
        ours.close()
        if made is not None:
            made.close()


def test_the_maker_takes_each_sources_logs_in_turn(shm: Path) -> None:
    """A host that queued many logs (a flood of SETUPs) delays another host's by the log
    being made and one more at most, not by all of its own: the maker takes the sources in
    rotation, each in its own order, a source that comes later too."""
    maker = ImageLogMaker(making=LogMaking.DEFERRED)
    submitted = 0

    def submit(name: str, source: str) -> None:
        nonlocal submitted
        kwargs = {"term_length": TERM, "initial_term_id": 1, "session_id": submitted,
                  "stream_id": 5, "mtu": 1408, "correlation_id": submitted, "sparse": True}
        submitted += 1
        maker.submit(LogJob(shm / f"{name}.logbuffer", LOG_LENGTH, kwargs, request=name,
                            source=source))

    order: list[str] = []

    def step() -> None:
        maker.step()
        for job in maker.take_done():
            assert isinstance(job.result, LogBuffer)
            job.result.close()
            order.append(job.request)

    for name, source in [("a0", "10.0.0.9"), ("a1", "10.0.0.9"), ("a2", "10.0.0.9"),
                         ("a3", "10.0.0.9"), ("b0", "10.0.0.2"), ("a4", "10.0.0.9"),
                         ("b1", "10.0.0.2"), ("c0", "10.0.0.3")]:
        submit(name, source)
    while maker.has_done:
        step()
    assert order == ["a0", "b0", "c0", "a1", "b1", "a2", "a3", "a4"]
    # A host that asks while the flood's logs are being made: the one being made, then one
    # more of the flood's at most, then its own.
    for k in range(5, 10):
        submit(f"a{k}", "10.0.0.9")
    step()
    submit("d0", "10.0.0.4")
    while maker.has_done:
        step()
    assert order[8:] == ["a5", "a6", "d0", "a7", "a8", "a9"]
    maker.close()


def test_back_to_back_ended_streams_make_the_readers_image_logs_from_released_files(
        launch) -> None:
    """A replay's shape: a stream of several terms from one driver to another, ended by its
    publisher (EOS), read to its end by a subscription that then closes while the channel
    stays open, and the next such stream right after.  The reader's driver lets the ended
    image go as soon as its last subscriber went, not after the drain wait (5
    status-message timeouts: 5 s here), so its log is kept well within that wait and every
    next stream's image is made from the file the one before released (the reader's
    LOGS_REUSED)."""
    sender = launch(**REUSE, publication_connection_timeout="5s")
    reader = launch(**REUSE, status_message_timeout="1s")
    drain_wait_s = 5 * 1.0
    uri = f"aeron:udp?endpoint=127.0.0.1:{free_port()}"
    runs = 3
    with Client.connect(sender.directory) as publishing, \
            Client.connect(reader.directory, resource_linger_s=0) as reading:
        # The channel stays open, as a reply endpoint does for its control stream: closing
        # its last subscription would close the endpoint and its images with it.
        standing = reading.add_subscription(uri, STREAM + 1)
        kept = None  # the inode of the file the last stream's image released
        for run in range(runs):
            subscription = reading.add_subscription(uri, STREAM)
            publication = publishing.add_publication(uri, STREAM)
            connect(publication, subscription)
            if run > 0:
                assert [p.stat().st_ino for p in logs(reader)] == [kept], \
                    "the image's log is not the file the last stream's released"
            collector = Collector(subscription)
            count = 5 * TERM // 1024
            stream(publication, [collector], count, lambda i: 1000, first=run * 10**6)
            collector.assert_exactly(count, run * 10**6)
            publication.close()
            [image] = subscription.images
            wait_for(lambda image=image: image.is_end_of_stream,
                     what="the end of the stream read")
            subscription.close()
            wait_for(lambda: kept_ready(reader, 1), timeout=drain_wait_s / 2,
                     what="the ended image's log kept, before the drain wait")
            [path] = released(reader)
            kept = path.stat().st_ino
        assert counters_of(reader)["LOGS_REUSED"] == runs - 1
        standing.close()
