"""The driver process: one per directory, clean start and stop, clear errors, idle cost."""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import fcntl
import json
import os
import resource
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import FAST_DRIVER_SETTINGS, counters_of, lacking, wait_for

from slipstream.client import (
    NOT_CONNECTED,
    BufferClaim,
    ChannelError,
    Client,
    ClosedError,
    ConfigurationError,
    DriverAlreadyRunningError,
    DriverDirectoryError,
    DriverError,
    DriverNotRunningError,
    DriverTimeoutError,
    MessageTooLongError,
    RegistrationError,
    SlipstreamError,
)
from slipstream.client.counters import CountersFile, CounterType, SystemCounter
from slipstream.client.logbuffer import LogBuffer, compute_log_length
from slipstream.client.publication import Publication
from slipstream.daemon.directory import DriverDirectory
from slipstream.daemon.driver import MediaDriver

SLIPSTREAM = [sys.executable, "-m", "slipstream.daemon.cli"]


def test_the_driver_directory_is_private_and_holds_its_files(driver) -> None:
    mode = stat.S_IMODE(os.stat(driver.directory).st_mode)
    assert mode == 0o700
    names = {p.name for p in Path(driver.directory).iterdir()}
    assert {"driver.lock", "counters.dat", "conductor.sock", "publications", "images"} <= names
    # Every file 0600, the control socket too (zmq makes it with the umask).
    for entry in Path(driver.directory).iterdir():
        if not entry.is_dir():
            assert stat.S_IMODE(entry.stat().st_mode) == 0o600, entry


def test_a_driver_removes_the_parents_it_made_for_its_directory(short_tmp: Path) -> None:
    """``--dir /tmp/a/b/driver`` makes /tmp/a and /tmp/a/b as ``mkdir -p`` would; at stop they
    go too (if empty), and a parent that already existed stays."""
    existing = short_tmp
    directory = existing / "made" / "also-made" / "driver"
    with MediaDriver.launch(directory=directory):
        assert directory.is_dir()
    assert not (existing / "made").exists()
    assert existing.is_dir()
    # One the user filled meanwhile is theirs now: it stays, with what they put there.
    with MediaDriver.launch(directory=directory):
        (existing / "made" / "notes.txt").write_text("mine")
    assert (existing / "made" / "notes.txt").read_text() == "mine"
    assert not (existing / "made" / "also-made").exists()


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A directory with a short path (pytest's tmp_path leaves little of a unix socket's 107
    bytes)."""
    import tempfile

    path = Path(tempfile.mkdtemp(prefix="ss-", dir="/tmp"))
    try:
        yield path
    finally:
        import shutil

        shutil.rmtree(path, ignore_errors=True)


def test_a_parent_another_driver_removes_meanwhile_is_made_again(
        short_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two drivers under one missing parent: the one that made it removes it at stop (if
    empty), possibly just before the other makes its own directory in it."""
    import slipstream.daemon.directory as directory_module

    make = directory_module._make_missing_parents
    calls = []

    def make_then_lose_it(path: Path, made: list[Path]) -> None:
        before = len(made)
        make(path, made)
        calls.append(made[before:])
        if len(calls) == 1:
            path.parent.rmdir()  # the other driver stopped

    monkeypatch.setattr(directory_module, "_make_missing_parents", make_then_lose_it)
    directory = DriverDirectory(short_tmp / "shared-parent" / "driver")
    directory.acquire()
    try:
        assert (short_tmp / "shared-parent" / "driver" / "driver.lock").exists()
        assert len(calls) == 2
    finally:
        directory.release()
    assert not (short_tmp / "shared-parent").exists()  # it made it the second time


def test_a_directory_too_long_for_its_unix_sockets_is_refused_before_anything_is_made(
        tmp_path: Path) -> None:
    directory = tmp_path / ("d" * 40) / ("e" * 40) / "driver"
    result = subprocess.run([*SLIPSTREAM, "driver", "--dir", str(directory)],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 4  # EXIT_DIRECTORY_REFUSED
    assert "too long for the unix sockets" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_second_driver_on_the_same_directory_is_refused(driver) -> None:
    result = subprocess.run([*SLIPSTREAM, "driver", "--dir", str(driver.directory)],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 3  # EXIT_ALREADY_RUNNING
    assert f"already running in {driver.directory}" in result.stderr
    assert str(driver.pid) in result.stderr
    with pytest.raises(DriverAlreadyRunningError, match=str(driver.pid)), \
            MediaDriver.launch(directory=driver.directory):
        pass
    with pytest.raises(DriverAlreadyRunningError):
        from slipstream.daemon.directory import DriverDirectory

        DriverDirectory(driver.directory).acquire()


def test_sigterm_stops_the_driver_and_removes_its_files(driver_dir: Path) -> None:
    with MediaDriver.launch(directory=driver_dir) as driver:
        with Client.connect(driver_dir) as client:
            client.add_publication("aeron:ipc", 7)
        assert driver.stop() == 0
    assert not driver_dir.exists()


def test_a_driver_stopped_as_soon_as_it_is_up_drains_and_exits_cleanly(driver_dir: Path) -> None:
    """Up (its first heartbeat, what MediaDriver.start waits for) means its signals are
    handled: a SIGTERM sent the moment the heartbeat shows drains and exits 0, never Python's
    default death by the signal."""
    for _ in range(5):
        process = subprocess.Popen([*SLIPSTREAM, "driver", "--dir", str(driver_dir)],
                                   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 20
            while not _heartbeat_shows(driver_dir / "counters.dat", process.pid):
                assert time.monotonic() < deadline and process.poll() is None
            process.send_signal(signal.SIGTERM)
            assert process.wait(20) == 0
        finally:
            process.kill()
            process.wait()
        assert not driver_dir.exists()


def _heartbeat_shows(path: Path, pid: int) -> bool:
    try:
        counters = CountersFile(path, writable=False)
    except (OSError, ValueError):
        return False
    try:
        return counters.driver_pid == pid and counters.driver_heartbeat_ns > 0
    finally:
        counters.close()


def test_sigint_stops_the_driver_too(driver_dir: Path) -> None:
    with MediaDriver.launch(directory=driver_dir) as driver:
        driver.process.send_signal(signal.SIGINT)
        assert driver.process.wait(10) == 0
    assert not driver_dir.exists()


def test_a_crashed_drivers_directory_is_cleaned_by_the_next_driver(driver_dir: Path) -> None:
    with MediaDriver.launch(directory=driver_dir) as crashed:
        with Client.connect(driver_dir) as client:
            client.add_publication("aeron:ipc", 8)
            client.add_subscription("aeron:ipc", 8)
            crashed.kill()
    leftovers = list((driver_dir / "publications").iterdir())
    assert leftovers  # a crash leaves its logs behind
    with pytest.raises(DriverNotRunningError, match=str(driver_dir)):
        Client.connect(driver_dir)
    with MediaDriver.launch(directory=driver_dir):
        assert list((driver_dir / "publications").iterdir()) == []
        with Client.connect(driver_dir) as client:
            assert client.add_publication("aeron:ipc", 8).offer(b"x") == NOT_CONNECTED


def test_a_driver_restarting_while_a_client_probes_its_lock_takes_it(tmp_path: Path,
                                                                     monkeypatch) -> None:
    """A client's keepalive (and connect) looks for a driver by taking the lock shared for a
    moment; a driver starting meanwhile (systemd restarting a crashed one) waits that moment
    out instead of refusing to start as if a driver ran.  A driver's own lock is exclusive,
    and it still refuses at once."""
    from slipstream.daemon import directory as directory_module
    from slipstream.daemon.directory import _flock

    lock = tmp_path / "driver.lock"
    lock.write_text("slipstream driver directory\n")
    probe, starting = os.open(lock, os.O_RDONLY), os.open(lock, os.O_RDWR)
    try:
        fcntl.flock(probe, fcntl.LOCK_SH | fcntl.LOCK_NB)
        let_go = threading.Timer(0.03, fcntl.flock, (probe, fcntl.LOCK_UN))
        let_go.start()
        with monkeypatch.context() as patch:  # a loaded machine may fire the timer late
            patch.setattr(directory_module, "_PROBE_WAIT_S", 10.0)
            _flock(starting, tmp_path)  # taken once the probe let go
        let_go.join()
        fcntl.flock(starting, fcntl.LOCK_UN)
        fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)  # now a driver holds it
        started = time.monotonic()
        with pytest.raises(DriverAlreadyRunningError):
            _flock(starting, tmp_path)
        assert time.monotonic() - started < 0.3  # not the 0.5 s a probe is waited out
        fcntl.flock(probe, fcntl.LOCK_SH)  # held shared for good: said so, after a while
        with pytest.raises(DriverDirectoryError, match="locked shared"):
            _flock(starting, tmp_path)
    finally:
        os.close(probe)
        os.close(starting)


def _exchange_one(directory: Path, payload: bytes) -> None:
    """One message through an IPC stream of the driver in ``directory``."""
    received: list[bytes] = []
    with Client.connect(directory) as client:
        pub = client.add_publication("aeron:ipc", 3)
        sub = client.add_subscription("aeron:ipc", 3)
        wait_for(lambda: pub.offer(payload) > 0, what="an offer")
        assert sub.receive(lambda data, header: received.append(bytes(data)), timeout=5) == 1
    assert received == [payload]


def _tree(path: Path) -> dict[str, str]:
    """Every entry under ``path`` with the text of each file ("" for a folder; bytes that
    are not UTF-8 as escapes)."""
    return {str(p.relative_to(path)): (p.read_text(errors="backslashreplace") if p.is_file()
                                       else "")
            for p in sorted(path.rglob("*"))}


def test_a_directory_holding_a_users_files_is_refused_and_left_untouched(tmp_path: Path) -> None:
    users = tmp_path / "work"
    (users / "sub").mkdir(parents=True)
    (users / "notes.txt").write_text("precious")
    (users / "sub" / "a.txt").write_text("x")
    before = _tree(users)
    result = subprocess.run([*SLIPSTREAM, "driver", "--dir", str(users)],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 4  # EXIT_DIRECTORY_REFUSED
    assert f"{users} is not empty and is not a slipstream driver directory" in result.stderr
    assert _tree(users) == before
    with pytest.raises(DriverDirectoryError, match="not a slipstream driver directory"), \
            MediaDriver.launch(directory=users):
        pass
    assert _tree(users) == before
    with pytest.raises(DriverDirectoryError, match=str(users)):
        DriverDirectory(users).acquire()
    assert _tree(users) == before


def test_a_lock_file_a_driver_did_not_write_is_refused(tmp_path: Path) -> None:
    (tmp_path / "driver.lock").write_text("my own lock file\n")
    (tmp_path / "counters.dat").write_text("my counters")
    before = _tree(tmp_path)
    with pytest.raises(DriverDirectoryError, match="not written by a driver"):
        DriverDirectory(tmp_path).acquire()
    assert _tree(tmp_path) == before


def test_a_file_in_place_of_the_directory_is_refused(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("data")
    with pytest.raises(DriverDirectoryError, match="is not a directory"):
        DriverDirectory(tmp_path / "file").acquire()
    assert (tmp_path / "file").read_text() == "data"


@pytest.mark.parametrize(("under", "said"), [
    ("file/driver", "file/driver: Not a directory"),
    ("file/deeper/driver", "file/deeper: Not a directory"),
])
def test_a_file_on_the_way_to_the_directory_is_named_in_a_refusal(
        tmp_path: Path, under: str, said: str) -> None:
    """A regular file among the directory's parents: the CLI's refusal (exit 4) names it,
    where a traceback of NotADirectoryError came out."""
    (tmp_path / "file").write_text("data")
    result = subprocess.run([*SLIPSTREAM, "driver", "--dir", str(tmp_path / under)],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 4, result.stderr  # EXIT_DIRECTORY_REFUSED
    assert f"{tmp_path}/{said}" in result.stderr and "Traceback" not in result.stderr
    assert (tmp_path / "file").read_text() == "data"


def test_a_directory_a_filesystem_will_not_hold_is_refused_at_once() -> None:
    """/proc refuses a new entry with ENOENT although it is there: that is said, not taken
    for parents that another process kept removing."""
    with pytest.raises(DriverDirectoryError, match="cannot be made in /proc: No such file"):
        DriverDirectory(Path("/proc/slipstream-test")).acquire()


def test_an_empty_directory_the_user_made_is_used_and_left_in_place(tmp_path: Path) -> None:
    users = tmp_path / "empty"
    users.mkdir(mode=0o755)
    with MediaDriver.launch(directory=users) as driver:
        _exchange_one(users, b"x")
        assert driver.stop() == 0
    assert users.is_dir() and list(users.iterdir()) == []


def test_a_stale_drivers_files_are_cleaned_but_what_a_user_added_stays(
        driver_dir: Path) -> None:
    with MediaDriver.launch(directory=driver_dir) as crashed:
        with Client.connect(driver_dir) as client:
            client.add_publication("aeron:ipc", 8)
            crashed.kill()
    (driver_dir / "notes.txt").write_text("precious")
    (driver_dir / "publications" / "keep.me").write_text("mine")
    # Named as a driver's log, but not one: its content is not a log's.
    (driver_dir / "publications" / "7.logbuffer").write_text("mine too")
    # A log's length and layout, but made for another registration id than its name says.
    # A log a driver died making: its length, its metadata not yet written: it goes.
    with open(driver_dir / "publications" / "5.logbuffer", "wb") as cut_short:
        cut_short.truncate(compute_log_length(64 * 1024))
    lookalike = driver_dir / "images" / "8.logbuffer"
    LogBuffer.create(lookalike, term_length=64 * 1024, initial_term_id=0, session_id=1,
                     stream_id=2, mtu=1408, correlation_id=9).close()
    lookalike_bytes = lookalike.read_bytes()
    with MediaDriver.launch(directory=driver_dir) as driver:
        assert sorted(p.name for p in (driver_dir / "publications").iterdir()) == [
            "7.logbuffer", "keep.me"]
        assert driver.stop() == 0
    assert lookalike.read_bytes() == lookalike_bytes
    lookalike.unlink()
    assert _tree(driver_dir) == {"notes.txt": "precious", "publications": "",
                                 "publications/keep.me": "mine",
                                 "publications/7.logbuffer": "mine too", "images": ""}


def test_a_directory_with_a_drivers_names_but_no_drivers_lock_is_refused_untouched(
        driver_dir: Path) -> None:
    """Before the marker a driver's lock file held its pid alone.  Such a directory is
    refused, not taken: a user's folder holding a ``driver.lock`` with a number, a text
    ``counters.dat`` and an ``errors.json`` looks the same, and taking it removed the folder
    at stop.  The error says what to do."""
    (driver_dir / "publications").mkdir(parents=True)
    LogBuffer.create(driver_dir / "publications" / "12.logbuffer", term_length=64 * 1024,
                     initial_term_id=0, session_id=1, stream_id=2, mtu=1408,
                     correlation_id=12).close()
    (driver_dir / "counters.dat").write_text("my counts\n")
    (driver_dir / "errors.json").write_text('{"mine": 1}')
    (driver_dir / "driver.lock").write_text("4242\n")
    before = _tree(driver_dir)
    with pytest.raises(DriverDirectoryError, match="remove it yourself"):
        DriverDirectory(driver_dir).acquire()
    process = subprocess.run([*SLIPSTREAM, "driver", "--dir", str(driver_dir)],
                             capture_output=True, text=True, timeout=60)
    assert process.returncode != 0 and "remove it yourself" in process.stderr
    assert _tree(driver_dir) == before
    (driver_dir / "thesis.tex").write_text("precious")
    with pytest.raises(DriverDirectoryError):
        DriverDirectory(driver_dir).acquire()
    assert (driver_dir / "thesis.tex").read_text() == "precious"


def test_a_driver_directory_nested_in_another_is_never_removed(driver_dir: Path) -> None:
    """A driver nested in another's directory, or in its log folder: stopping the outer one
    removes only its own files; the inner one keeps serving, and stops cleanly after."""
    with MediaDriver.launch(directory=driver_dir) as outer:
        inner_dirs = [driver_dir / "inner", driver_dir / "images" / "inner"]
        inners = [MediaDriver.start(path, {}) for path in inner_dirs]
        try:
            assert outer.stop() == 0
            assert all(path.is_dir() for path in inner_dirs)
            for path in inner_dirs:
                _exchange_one(path, b"still here")
        finally:
            for inner in inners:
                assert inner.stop() == 0
    assert not inner_dirs[0].exists() and not inner_dirs[1].exists()
    # The outer directory was left because it was not empty at its stop; a driver created it.
    assert _tree(driver_dir) == {"images": ""}


def test_of_two_drivers_starting_at_once_on_a_new_directory_one_runs(driver_dir: Path) -> None:
    """Both find no lock; the one whose lock gets its name first runs, the other is told a
    driver runs there (never that the directory is not a driver's), in every round."""
    for _ in range(50):
        barrier = threading.Barrier(2)
        outcomes: list[object] = []

        def start(barrier: threading.Barrier = barrier, outcomes: list[object] = outcomes) -> None:
            directory = DriverDirectory(driver_dir)
            barrier.wait()
            try:
                directory.acquire()
                outcomes.append(directory)
            except DriverError as e:
                outcomes.append(e)

        threads = [threading.Thread(target=start) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        [winner] = [o for o in outcomes if isinstance(o, DriverDirectory)]
        [loser] = [o for o in outcomes if not isinstance(o, DriverDirectory)]
        assert isinstance(loser, DriverAlreadyRunningError), loser
        winner.release()
        # Empty: the directory stays only when the driver that made it lost the race.
        assert list(driver_dir.iterdir()) == [] if driver_dir.exists() else True
        with contextlib.suppress(FileNotFoundError):
            driver_dir.rmdir()


def test_a_directory_another_user_owns_or_may_write_is_refused(tmp_path: Path) -> None:
    if os.geteuid() != 0:  # making a directory another user owns takes root
        lacking("needs root to give a directory to another user")
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, 65534, 65534)  # nobody
    with pytest.raises(DriverDirectoryError, match="belongs to uid 65534"):
        DriverDirectory(theirs).acquire()
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(DriverDirectoryError, match="writable by other users"):
        DriverDirectory(shared).acquire()
    assert list(theirs.iterdir()) == [] and list(shared.iterdir()) == []


def test_a_lock_file_that_is_a_link_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.write_text("slipstream driver directory\n")
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "driver.lock").symlink_to(target)
    with pytest.raises(DriverDirectoryError, match=r"cannot open its driver\.lock"):
        DriverDirectory(tmp_path / "dir").acquire()
    assert target.read_text() == "slipstream driver directory\n"


def test_an_empty_lock_among_a_drivers_names_is_refused_untouched(driver_dir: Path) -> None:
    """An empty lock: a driver of an earlier release killed before it wrote it, or a user's
    empty file; nothing tells them apart, so nothing is taken or removed."""
    driver_dir.mkdir()
    (driver_dir / "driver.lock").write_text("")
    (driver_dir / "counters.dat").write_bytes(bytes(64))
    (driver_dir / "driver.lock.4242.77").write_text("")  # a start that died before naming it
    before = _tree(driver_dir)
    with pytest.raises(DriverDirectoryError, match="remove it yourself"):
        DriverDirectory(driver_dir).acquire()
    assert _tree(driver_dir) == before


def test_no_driver_is_a_clear_error_naming_the_directory(driver_dir: Path) -> None:
    with pytest.raises(DriverNotRunningError) as error:
        Client.connect(driver_dir)
    assert str(driver_dir) in str(error.value)
    assert "slipstream driver --dir" in str(error.value)
    assert isinstance(error.value, SlipstreamError)


def test_a_bad_channel_uri_names_the_bad_part(client: Client) -> None:
    with pytest.raises(ChannelError) as error:
        client.add_publication("aeron:ipc?term-length=1000", 1)
    assert "term-length" in str(error.value)
    with pytest.raises(ChannelError) as error:
        client.add_subscription("aeron:tcp?endpoint=x:1", 1)
    assert "media" in str(error.value) or "tcp" in str(error.value)


def test_spy_subscriptions_are_refused_by_name(client: Client) -> None:
    with pytest.raises(RegistrationError, match="spy"):
        client.add_subscription("aeron-spy:aeron:udp?endpoint=127.0.0.1:40123", 1)


def test_a_message_too_long_gives_the_limit(client: Client) -> None:
    publication = client.add_publication("aeron:ipc", 9)
    client.add_subscription("aeron:ipc", 9)
    limit = publication.max_message_length
    assert limit == 64 * 1024 // 8  # 64 KiB terms in the test driver
    with pytest.raises(MessageTooLongError) as error:
        publication.offer(bytes(limit + 1))
    assert str(limit) in str(error.value)
    frame_limit = publication.max_payload_length
    with pytest.raises(MessageTooLongError) as error:
        publication.try_claim(frame_limit + 1, BufferClaim())
    assert str(frame_limit) in str(error.value) and "offer() fragments" in str(error.value)


def test_a_log_the_host_has_no_room_for_is_a_clear_error_and_leaves_nothing(
        driver, client: Client) -> None:
    # The kernel refuses files over RLIMIT_FSIZE, as a full /dev/shm refuses the allocation.
    _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.prlimit(driver.pid, resource.RLIMIT_FSIZE, (1 << 20, hard))
    with pytest.raises(RegistrationError) as error:
        client.add_publication("aeron:ipc?term-length=1m", 77)
    message = str(error.value)
    assert "cannot create the log of stream 77 (3 MiB in" in message
    assert "File too large" in message and "term-length=" in message
    assert list((Path(driver.directory) / "publications").iterdir()) == []
    # The driver carries on: a log that fits is created.
    publication = client.add_publication("aeron:ipc", 78)
    assert publication.stream_id == 78
    assert driver.process.poll() is None


@pytest.fixture
def small_tmpfs() -> Iterator[Path]:
    """A 32 MiB tmpfs mounted for the test (as Docker's small /dev/shm), unmounted after:
    needs root; skips without, fails under CI=true."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        lacking("mounting a tmpfs needs root and mount(8)")
    mount_point = Path(tempfile.mkdtemp(prefix="slipstream-small-shm-"))
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32m,mode=0700", "tmpfs",
                    str(mount_point)], check=True)
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "--lazy", str(mount_point)], check=False)
        mount_point.rmdir()


def test_a_sparse_log_that_would_not_fit_is_refused_and_the_driver_lives_on(
        small_tmpfs: Path) -> None:
    """A sparse log takes its pages as it is written: one larger than the free space would
    kill its writer with SIGBUS once the filesystem ran out (the driver, with every stream;
    tried: exit 135, nothing logged).  It is refused when it is made."""
    with MediaDriver.launch(directory=small_tmpfs / "driver", **FAST_DRIVER_SETTINGS) as driver, \
            Client.connect(driver.directory) as client:
        with pytest.raises(RegistrationError) as error:
            client.add_publication("aeron:ipc?sparse=true|term-length=16m", 77)
        message = str(error.value)
        assert "cannot create the log of stream 77 (48 MiB in" in message
        assert "free for a log of 48" in message and "term-length=" in message
        assert list((Path(driver.directory) / "publications").iterdir()) == []
        # Two that fit one at a time but not together: the first has written nothing yet,
        # and the free space alone said the second fit too, sparse or dense (a review's
        # finds: writing the first then ended in SIGBUS).
        client.add_publication("aeron:ipc?sparse=true|term-length=8m", 76)
        for sparse in ("true", "false"):
            with pytest.raises(RegistrationError, match=r"sparse logs may still take 2\d"):
                client.add_publication(f"aeron:ipc?sparse={sparse}|term-length=8m", 75)
        assert len(list((Path(driver.directory) / "publications").iterdir())) == 1
        # One that fits is made, written through a term rotation, and read.
        publication = client.add_publication("aeron:ipc?sparse=true|term-length=1m", 78)
        subscription = client.add_subscription("aeron:ipc", 78)
        got = []
        for i in range(3000):
            while publication.offer(message_of(i)) < 0:
                subscription.poll(lambda data, _header: got.append(bytes(data)), 100)
        while len(got) < 3000:
            subscription.poll(lambda data, _header: got.append(bytes(data)), 100)
        assert got == [message_of(i) for i in range(3000)]
        assert driver.process.poll() is None


def message_of(i: int) -> bytes:
    return i.to_bytes(4, "little") * 256


def test_a_bad_configuration_value_names_the_key(driver_dir: Path) -> None:
    with pytest.raises(ConfigurationError) as error, \
            MediaDriver.launch(directory=driver_dir, mtu_length=1000):
        pass
    assert "mtu_length" in str(error.value)
    result = subprocess.run([*SLIPSTREAM, "driver", "--dir", str(driver_dir),
                             "--set", "ipc_term_buffer_length=3m"],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 2
    assert "ipc_term_buffer_length" in result.stderr
    assert not driver_dir.exists()


def test_print_config_shows_the_resolved_values(driver_dir: Path) -> None:
    env = {**os.environ, "SLIPSTREAM_MTU_LENGTH": "4096"}
    result = subprocess.run([*SLIPSTREAM, "driver", "--dir", str(driver_dir), "--print-config",
                             "--set", "client_liveness_timeout=3s"],
                            capture_output=True, text=True, timeout=30, env=env)
    assert result.returncode == 0, result.stderr
    assert 'mtu_length = "4k"  # env' in result.stdout
    assert 'client_liveness_timeout = "3s"' in result.stdout
    assert not driver_dir.exists()  # printing the configuration starts nothing


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_an_idle_driver_uses_under_two_percent_of_a_core(driver_dir: Path) -> None:
    with MediaDriver.launch(directory=driver_dir) as driver, Client.connect(driver_dir) as client:
        publication = client.add_publication("aeron:ipc", 10)
        client.add_subscription("aeron:ipc", 10)
        while not publication.is_connected:
            time.sleep(0.01)
        time.sleep(1.0)  # let it settle into its idle back-off
        before, started = _cpu_seconds(driver.pid), time.monotonic()
        time.sleep(3.0)
        used = (_cpu_seconds(driver.pid) - before) / (time.monotonic() - started)
    assert used < 0.02, f"an idle driver used {used:.1%} of a core"


def _thread_named(pid: int, name: str) -> int:
    """The one thread of ``pid`` called ``name`` (threads that end meanwhile are skipped)."""
    found = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):
            if Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip() == name:
                found.append(int(tid))
    [tid] = found
    return tid


def _voluntary_switches(pid: int, tid: int) -> int:
    status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
    return int(status.split("\nvoluntary_ctxt_switches:")[1].split()[0])


def test_a_calm_driver_wakes_only_for_its_conductor_cycles(driver_dir: Path) -> None:
    """A wake-up of the driver's main thread costs ~0.5 ms of Python (trio's loop and the
    cycle), which a busy data path on a small machine feels: calm, it wakes for its conductor
    cycles only (the command loop keeps no timer of its own), the thread that watches the
    clients' futex sleeps until one rings, and the client's conductor thread until the driver
    tells it something (or its safety net, every EVENTS_SAFETY_NET_S)."""
    from slipstream.client.client import EVENTS_SAFETY_NET_S

    with MediaDriver.launch(directory=driver_dir) as driver, Client.connect(driver_dir) as client:
        publication = client.add_publication("aeron:ipc", 12)
        client.add_subscription("aeron:ipc", 12)
        wait_for(lambda: publication.is_connected, what="the IPC publication connected")
        time.sleep(1.0)
        watched = [(driver.pid, driver.pid),
                   (driver.pid, _thread_named(driver.pid, "ss-driver-futex")),
                   (os.getpid(), client._thread.native_id)]
        before = [_voluntary_switches(*thread) for thread in watched]
        cycles_before = counters_of(driver)["CONDUCTOR_CYCLES"]
        time.sleep(4.0)
        main, watcher, client_thread = (_voluntary_switches(*thread) - then
                                        for thread, then in zip(watched, before, strict=True))
        cycles = counters_of(driver)["CONDUCTOR_CYCLES"] - cycles_before
    # Calm, about 4 cycles (timer_interval 1 s); a loaded machine may move the pressure
    # governor, whose samples are cycles too.  Before, a command-loop timer added one wake-up
    # a second of its own: 8 for 4 cycles.  The margin: a wait for the GIL of a network
    # thread's Python pass.
    assert cycles >= 3, f"{cycles} conductor cycles in 4 s"
    assert main <= cycles + 2, f"the main thread woke {main} times for {cycles} cycles"
    assert watcher == 0, f"the futex watcher woke {watcher} times"
    assert client_thread <= 4.0 // EVENTS_SAFETY_NET_S + 1, (
        f"the client's thread woke {client_thread} times")


def test_stat_prints_the_counters(driver) -> None:
    with Client.connect(driver.directory) as client:
        client.add_publication("aeron:ipc", 11)
        client.add_subscription("aeron:ipc", 11)
        result = subprocess.run([*SLIPSTREAM, "stat", "--dir", str(driver.directory), "--once"],
                                capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    for label in ("bytes sent", "client timeouts", "back pressure events", "pub-lmt: aeron:ipc",
                  "sub-pos: aeron:ipc"):
        assert label in result.stdout
    [heartbeat] = [line for line in result.stdout.splitlines()
                   if f"client-heartbeat: {client.client_id} " in line]
    age_ms = int(heartbeat.split("ms ago")[0].split()[-1].replace(",", ""))
    assert 0 <= age_ms < 1000  # the test driver's keepalive interval is 100 ms


def test_stat_without_a_driver_says_so(driver_dir: Path) -> None:
    result = subprocess.run([*SLIPSTREAM, "stat", "--dir", str(driver_dir), "--once"],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 2
    assert f"no slipstream driver is running in {driver_dir}" in result.stderr


def test_stat_shows_the_error_log_and_the_last_counters_after_the_driver_died(
        driver_dir: Path) -> None:
    with MediaDriver.launch(directory=driver_dir, log_buffer_memory_limit="1m") as driver:
        with Client.connect(driver_dir) as client:
            for stream_id in (20, 21):
                with pytest.raises(DriverError, match="log_buffer_memory_limit"):
                    client.add_publication("aeron:ipc?term-length=1m", stream_id)
            deadline = time.monotonic() + 5  # a repeat is written within a second
            while True:
                result = subprocess.run([*SLIPSTREAM, "stat", "--dir", str(driver_dir),
                                         "--json"], capture_output=True, text=True, timeout=30)
                assert result.returncode == 0, result.stderr
                [error] = json.loads(result.stdout)["errors"]  # one distinct error
                if error["count"] == 2 or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            assert error["count"] == 2 and "stream 21" in error["message"]
            driver.kill()  # SIGKILL: no clean-up, the error log stays for the operator
        result = subprocess.run([*SLIPSTREAM, "stat", "--dir", str(driver_dir), "--once"],
                                capture_output=True, text=True, timeout=30)
    assert result.returncode == 1, result.stderr
    # Its last counters too, under a header that says it died (it said only "no driver").
    assert "DEAD: no driver holds the lock" in result.stdout
    assert "client-heartbeat: " in result.stdout
    assert "errors (1 distinct)" in result.stdout
    assert "log_buffer_memory_limit" in result.stdout
    # systemd restarts a crashed driver at once: the new one keeps the dead one's log.
    with MediaDriver.launch(directory=driver_dir):
        result = subprocess.run([*SLIPSTREAM, "stat", "--dir", str(driver_dir), "--json"],
                                capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    snapshot = json.loads(result.stdout)
    assert snapshot["errors"] == []
    [previous] = snapshot["previous_errors"]
    assert previous["count"] == 2 and "log_buffer_memory_limit" in previous["message"]


def test_an_idle_client_stays_alive_through_its_heartbeat_counter(driver, client: Client) -> None:
    def heartbeat() -> int:
        [info] = [c for c in client.counters
                  if c.type_id == CounterType.CLIENT_HEARTBEAT and c.owner_id == client.client_id]
        return info.value

    first = heartbeat()
    time.sleep(2.5)  # 2.5 x the test driver's client liveness timeout, with no command sent
    assert heartbeat() > first
    assert client.add_publication("aeron:ipc", 79).stream_id == 79
    assert CountersFile(Path(driver.directory) / "counters.dat").get(
        SystemCounter.CLIENT_TIMEOUTS) == 0


def test_a_client_stays_alive_while_its_application_thread_holds_the_gil(
        driver, client: Client) -> None:
    """The keepalives do not wait for the GIL: a C call that keeps it 2.5 s (2.5 x the test
    driver's client liveness timeout) does not get the client timed out."""
    ctypes.PyDLL(None).usleep(2_500_000)  # PyDLL: the GIL stays held through the call
    assert client.add_publication("aeron:ipc", 80).stream_id == 80
    assert CountersFile(Path(driver.directory) / "counters.dat").get(
        SystemCounter.CLIENT_TIMEOUTS) == 0


def test_a_client_notices_when_its_driver_dies(driver_dir: Path) -> None:
    with MediaDriver.launch(directory=driver_dir, driver_timeout="500ms",
                            client_keepalive_interval="100ms") as driver:
        client = Client.connect(driver_dir)
        publication = client.add_publication("aeron:ipc", 12)
        driver.kill()
        deadline = time.monotonic() + 5
        while not client.is_closed:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert publication.offer(b"x") == -4  # CLOSED
        with pytest.raises(DriverError):
            client.add_publication("aeron:ipc", 13)
        client.close()


def test_a_publication_cut_off_by_its_drivers_death_is_still_unmapped_on_close(
        driver_dir: Path) -> None:
    """Losing the driver makes offers say CLOSED at once, but the log stays mapped (a thread
    may be inside an offer): close(), of the publication or of the client, still unmaps it
    after the resource linger, or an application that reconnects after each restart of its
    driver leaks a log (192 MiB for IPC) per publication per restart."""
    from slipstream.client.client import RESOURCE_LINGER_S

    with MediaDriver.launch(directory=driver_dir, driver_timeout="500ms",
                            client_keepalive_interval="100ms") as driver:
        client = Client.connect(driver_dir)
        closed_alone = client.add_publication("aeron:ipc", 16)
        closed_with_the_client = client.add_publication("aeron:ipc", 17)
        driver.kill()
        wait_for(lambda: client.is_closed, timeout=5, what="the client noticed")
        assert closed_alone.is_closed and not closed_alone._log.closed
        closed_alone.close()
        client.close()
        time.sleep(RESOURCE_LINGER_S + 0.5)
        assert closed_alone._log.closed and closed_with_the_client._log.closed


_TIMED_OUT_CLIENT = """
import os, signal, sys, time
from slipstream.client import Client, DriverNotRunningError
client = Client.connect(sys.argv[1])
os.kill(os.getpid(), signal.SIGSTOP)  # the test continues it after client_liveness_timeout
deadline = time.monotonic() + 10
while not client.is_closed and time.monotonic() < deadline:
    time.sleep(0.01)
try:
    client.add_publication("aeron:ipc", 5)
except DriverNotRunningError as e:
    print(e)
"""


def test_a_client_the_driver_timed_out_is_told_to_connect_again_not_to_start_a_driver(
        driver) -> None:
    """A client stopped for longer than client_liveness_timeout (SIGSTOP) comes back to a
    driver that still runs and has timed it out: the error says so, and that a new client
    is the fix (it told the user to start a driver, which then refused: one was running)."""
    child = subprocess.Popen([sys.executable, "-c", _TIMED_OUT_CLIENT, str(driver.directory)],
                             stdout=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: _process_state(child.pid) == "T", what="the client stopped itself")
        wait_for(lambda: counters_of(driver)["CLIENT_TIMEOUTS"] == 1, timeout=10,
                 what="the driver timed the client out")
        os.kill(child.pid, signal.SIGCONT)
        output, _ = child.communicate(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert "no longer serves this client" in output and "timed this client out" in output
    assert "connect again" in output and "start one" not in output


@pytest.mark.parametrize("forks", [False, True])
def test_a_launched_driver_goes_with_the_process_that_started_it_even_killed(
        driver_dir: Path, forks: bool) -> None:
    """MediaDriver.launch's driver outlived a starter that was SIGKILLed (a test or a Spark
    executor on timeout), holding its directory for good.  It now drains and stops when its
    standard input, a pipe its starter holds, ends; a child the starter forked (as
    multiprocessing does) does not keep it (its copy of the pipe is closed at the fork)."""
    code = ("import os, sys, time\n"
            "from slipstream.daemon.driver import MediaDriver\n"
            f"launched = MediaDriver.launch(directory={str(driver_dir)!r})\n"
            "driver = launched.__enter__()\n"
            f"child = os.fork() if {forks} else -1\n"
            "if child == 0:\n"
            "    time.sleep(60)\n"
            "    os._exit(0)\n"
            "print(driver.pid, child, flush=True)\n"
            "time.sleep(120)\n")
    starter = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    child_pid = -1
    try:
        driver_pid, child_pid = map(int, starter.stdout.readline().split())
        time.sleep(0.5)
        assert _process_state(driver_pid) not in ("Z", "X", "")
        starter.kill()
        starter.wait()
        wait_for(lambda: _process_state(driver_pid) in ("Z", "X", ""), timeout=20,
                 what="the driver stopped")
        assert not driver_dir.exists()  # it made the directory, and removed it as it stopped
    finally:
        if starter.poll() is None:
            starter.kill()
            starter.wait()
        if child_pid > 0:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child_pid, signal.SIGKILL)


def test_a_launched_driver_whose_starter_dies_while_it_drains_drains_on(
        driver_dir: Path) -> None:
    """The end of its standard input is the first stop, not the second: a drain under way
    (SIGTERM, here with a subscriber that never reads: until drain_timeout) is not cut short
    (it stopped 0.11 s after its starter died, with 7 s of drain left: a review's find)."""
    with MediaDriver.launch(directory=driver_dir, drain_timeout="3s") as driver:
        with Client.connect(driver_dir) as client:
            subscription = client.add_subscription("aeron:ipc", 31)
            publication = client.add_publication("aeron:ipc", 31)
            assert publication.offer(b"unread") > 0 and subscription.images
            driver.process.send_signal(signal.SIGTERM)
            # Draining: the credit stopped (offers took more until then).
            wait_for(lambda: publication.offer(b"probe") < 0, what="the drain began")
            driver._close_stdin()  # as the starter's death closes it
            time.sleep(1.0)
            assert driver.process.poll() is None, "the drain was cut short"
            driver.process.wait(10)
            assert publication.offer(b"more") < 0


_CTRL_C_STARTER = """
import sys, time
from slipstream.client import Client
from slipstream.daemon.driver import MediaDriver
with MediaDriver.launch(directory=sys.argv[1], drain_timeout="20s") as driver:
    client = Client.connect(driver.directory)
    subscription = client.add_subscription("aeron:ipc", 5)  # never reads: the drain waits
    assert client.add_publication("aeron:ipc", 5).offer(b"unread") > 0
    print(driver.pid, flush=True)
    time.sleep(60)
"""


def test_a_second_ctrl_c_stops_a_launched_driver_at_once(driver_dir: Path) -> None:
    """The first Ctrl-C drains it (its starter's stop()), the second stops it at once, as
    for a driver in the foreground.  In its own session it never sees the terminal's SIGINT:
    the second came to nothing, and it drained on for its drain_timeout, alone."""
    starter = subprocess.Popen([sys.executable, "-c", _CTRL_C_STARTER, str(driver_dir)],
                               stdout=subprocess.PIPE, text=True)
    try:
        driver_pid = int(starter.stdout.readline())
        starter.send_signal(signal.SIGINT)  # the first: stop() sends SIGTERM, it drains
        time.sleep(1.0)
        assert _process_state(driver_pid) not in ("Z", "X", ""), "it did not drain"
        starter.send_signal(signal.SIGINT)  # the second
        wait_for(lambda: _process_state(driver_pid) in ("Z", "X", ""), timeout=5,
                 what="the driver stopped at the second Ctrl-C")
    finally:
        if starter.poll() is None:
            starter.kill()
        starter.wait()


def test_stop_when_stdin_closes_refuses_a_stdin_that_is_not_a_pipe(driver_dir: Path) -> None:
    """/dev/null would end at once (the driver stopping as it starts); a terminal never."""
    result = subprocess.run([*SLIPSTREAM, "driver", "--dir", str(driver_dir),
                             "--stop-when-stdin-closes"], stdin=subprocess.DEVNULL,
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 2
    assert "--stop-when-stdin-closes: standard input is not a pipe" in result.stderr
    assert not driver_dir.exists()


def test_the_process_token_is_one_per_process_and_new_in_a_forked_child() -> None:
    """What CONNECT carries to tell an application's clients from another process's."""
    from slipstream.client import control

    tokens: list[int] = []
    threads = [threading.Thread(target=lambda: tokens.append(control.process_token()))
               for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert set(tokens) == {control.process_token()}
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:
        try:
            os.write(write_end, control.process_token().to_bytes(8, "little"))
        finally:
            os._exit(0)
    os.close(write_end)
    try:
        wait_for(lambda: os.waitpid(child, os.WNOHANG)[0] == child, timeout=10,
                 what="the forked child exited")
        assert int.from_bytes(os.read(read_end, 8), "little") != control.process_token()
    finally:
        os.close(read_end)
        with contextlib.suppress(ChildProcessError, ProcessLookupError):
            os.kill(child, signal.SIGKILL)
            os.waitpid(child, 0)


def _process_state(pid: int) -> str:
    """The state letter in /proc/<pid>/stat (T: stopped, Z: a zombie; "": no such process)."""
    try:
        with open(f"/proc/{pid}/stat") as stat_file:
            return stat_file.read().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        return ""


def test_a_client_notices_when_its_driver_hangs(driver_dir: Path) -> None:
    """A driver that stops (SIGSTOP) keeps its lock: its clients notice its heartbeat stopped,
    after driver_timeout and within a keepalive interval of it."""
    with MediaDriver.launch(directory=driver_dir, driver_timeout="500ms",
                            client_keepalive_interval="100ms") as driver:
        client = Client.connect(driver_dir)
        publication = client.add_publication("aeron:ipc", 15)
        os.kill(driver.pid, signal.SIGSTOP)
        try:
            stopped = time.monotonic()
            deadline = stopped + 5
            while not client.is_closed:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            # Never before driver_timeout: the last beat, frozen since, is older than that.
            assert time.time_ns() - client.counters.driver_heartbeat_ns > 500_000_000
            assert publication.offer(b"x") == -4  # CLOSED
            with pytest.raises(DriverNotRunningError, match="no heartbeat for"):
                client.add_publication("aeron:ipc", 16)
            # A new client is not told that no driver runs: one holds the lock, and starting
            # another would be refused.
            with pytest.raises(DriverTimeoutError, match="holds its lock but did not answer"):
                Client.connect(driver_dir, timeout=0.5)
        finally:
            os.kill(driver.pid, signal.SIGCONT)
        client.close()


def test_a_client_notices_when_its_driver_is_restarted_between_two_keepalives(
        driver_dir: Path) -> None:
    """systemd restarts a crashed driver at once: the new one may hold the lock again before
    the client next looks. The client still notices within a keepalive interval (its
    counters file is no longer the driver's), not after driver_timeout (10 s)."""
    settings = {"client_keepalive_interval": "3s", "client_liveness_timeout": "10s"}
    with MediaDriver.launch(directory=driver_dir, **settings) as driver:
        client = Client.connect(driver_dir)  # its keepalive thread looks now, then every 3 s
        driver.kill()
    with MediaDriver.launch(directory=driver_dir, **settings):
        restarted = time.monotonic()
        deadline = restarted + 8
        while not client.is_closed:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert time.monotonic() - restarted < 3.5
        # Either reason ("the driver exited", and "..., and a new one took its directory"
        # when it was restarted before the client's next look): in time either way.
        with pytest.raises(DriverNotRunningError, match="the driver exited"):
            client.add_publication("aeron:ipc", 17)
        client.close()


def test_a_request_to_a_driver_that_hangs_ends_when_the_client_notices(
        driver_dir: Path) -> None:
    """The request does not wait for its own timeout (30 s here): the driver's heartbeat
    stopped, and the client says so within driver_timeout and a keepalive interval."""
    with MediaDriver.launch(directory=driver_dir, driver_timeout="500ms",
                            client_keepalive_interval="100ms") as driver:
        client = Client.connect(driver_dir, timeout=30)
        os.kill(driver.pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            with pytest.raises(DriverNotRunningError, match="no heartbeat for"):
                client.add_publication("aeron:ipc", 18)
            assert time.monotonic() - started < 5
        finally:
            os.kill(driver.pid, signal.SIGCONT)
        client.close()


@pytest.fixture
def no_thread_errors(monkeypatch) -> Iterator[None]:
    """Fails the test on an exception that ends a thread it started (pytest would only warn;
    its own hook is installed once a session from pytest 8.4, which pyproject.toml asks for):
    a pipe end closed twice raises EBADF on the client's conductor thread.  Threads left by
    earlier tests (their linger timers) are not its business."""
    earlier = set(threading.enumerate())
    errors: list[str] = []

    def record(args: threading.ExceptHookArgs) -> None:
        if args.thread not in earlier:
            errors.append(f"{args.thread.name if args.thread else '?'}: " + "".join(
                traceback.format_exception(args.exc_type, args.exc_value, args.exc_traceback)))

    monkeypatch.setattr(threading, "excepthook", record)
    yield
    assert not errors, "\n".join(errors)


def _keepalive_threads() -> set[str]:
    """The thread ids of this process's keepalive threads."""
    found = set()
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            if (task / "comm").read_text().strip() == "ss-keepalive":
                found.add(task.name)
    return found


def _open_fds() -> dict[str, str]:
    """This process's open fds and what each is (listdir's own fd is gone when read)."""
    found = {}
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            found[fd] = os.readlink(f"/proc/self/fd/{fd}")
    return found


def test_closing_a_client_ends_its_threads_at_once(driver) -> None:
    before = _keepalive_threads()  # other tests' clients may still be ending theirs
    client = Client.connect(driver.directory)
    [keeper] = _keepalive_threads() - before  # named by its creator: there at once
    started = time.monotonic()
    client.close()
    assert time.monotonic() - started < 1  # not the conductor thread's 5 s safety net
    assert not [t for t in threading.enumerate()
                if t.name == f"slipstream-client-{client.client_id}"]
    wait_for(lambda: keeper not in _keepalive_threads(), what="the keepalive thread's end",
             timeout=1)
    client.close()  # again: nothing to do


def test_a_client_closed_from_its_own_image_handler_ends_its_threads_and_leaves(
        driver, caplog, no_thread_errors) -> None:
    """The handler runs on the client's conductor thread, which close() must not join."""
    before = _keepalive_threads()
    client = Client.connect(driver.directory)
    [keeper] = _keepalive_threads() - before
    closed = threading.Event()

    def close_on_image(image: object) -> None:
        client.close()
        closed.set()

    subscription = client.add_subscription("aeron:ipc", 21, on_available_image=close_on_image)
    with Client.connect(driver.directory) as other:
        other.add_publication("aeron:ipc", 21)
        assert closed.wait(5), "the image handler's close() did not return"
        wait_for(lambda: not [t for t in threading.enumerate()
                              if t.name == f"slipstream-client-{client.client_id}"],
                 what="the conductor thread's end", timeout=2)
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")]
    assert client.is_closed and subscription.is_closed
    wait_for(lambda: keeper not in _keepalive_threads(), what="the keepalive thread's end",
             timeout=1)
    assert client._socket.closed  # the socket is let go, not left to the collector
    # The driver let the client go (CLOSE_CLIENT), not only after its liveness timeout.
    stat = subprocess.run([*SLIPSTREAM, "stat", "--dir", str(driver.directory), "--once"],
                          capture_output=True, text=True, timeout=30)
    assert f"client-heartbeat: {client.client_id} " not in stat.stdout


def test_a_client_closed_from_a_handler_its_own_request_runs_ends_without_waiting(
        driver, caplog, no_thread_errors) -> None:
    """Handlers also run on a thread waiting for an answer (it holds the client's lock, which
    the conductor thread then waits for): close() there must neither join that thread nor
    close the socket the wait still reads."""
    before = _keepalive_threads()
    client = Client.connect(driver.directory)
    [keeper] = _keepalive_threads() - before
    ran_on: list[threading.Thread] = []

    def close_on_image(image: object) -> None:
        ran_on.append(threading.current_thread())
        client.close()

    client.add_subscription("aeron:ipc", 24, on_available_image=close_on_image)
    with Client.connect(driver.directory) as other:
        with client._lock:  # the conductor thread cannot take the image event: a request will
            other.add_publication("aeron:ipc", 24)
            time.sleep(0.2)  # the event waits in the client's socket
            started = time.monotonic()
            with pytest.raises(ClosedError):
                client.add_subscription("aeron:ipc", 25)
            assert time.monotonic() - started < 1.5  # not the conductor thread's 2 s join
            assert not client._socket.closed  # left to the thread, which needs the lock
        assert ran_on == [threading.current_thread()]
        wait_for(lambda: not [t for t in threading.enumerate()
                              if t.name == f"slipstream-client-{client.client_id}"],
                 what="the conductor thread's end", timeout=2)
    assert client._socket.closed
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")]
    wait_for(lambda: keeper not in _keepalive_threads(), what="the keepalive thread's end",
             timeout=1)


def test_a_close_from_within_the_first_close_returns(driver, monkeypatch,
                                                     no_thread_errors) -> None:
    """A handler that the first close() runs (its requests' waits run them) may close the
    client again: that returns at once, it does not wait for the close it is part of."""
    client = Client.connect(driver.directory)
    client.add_publication("aeron:ipc", 26)
    original_close = Publication.close

    def close_again(self: Publication) -> None:
        client.close()
        original_close(self)

    monkeypatch.setattr(Publication, "close", close_again)
    closer = threading.Thread(target=client.close, daemon=True)
    closer.start()
    closer.join(5)
    assert not closer.is_alive(), "close() waited for itself"
    assert client.is_closed


def test_a_conductor_thread_that_first_runs_after_close_leaves_no_pipe_open(
        driver, monkeypatch, no_thread_errors) -> None:
    """Its first step finds the client closed: the pipe's read end, which it would have
    closed as it ended, is closed all the same."""
    original_run = Client._run_conductor

    def late_run(self: Client) -> None:
        deadline = time.monotonic() + 5
        while not self._closed and time.monotonic() < deadline:
            time.sleep(0.001)
        original_run(self)

    monkeypatch.setattr(Client, "_run_conductor", late_run)
    client = Client.connect(driver.directory)
    pipe = os.readlink(f"/proc/self/fd/{client._notices}")
    client.close()
    wait_for(lambda: pipe not in _open_fds().values(), what="the pipe's read end closed",
             timeout=3)
    assert client._socket.closed


def test_a_second_close_returns_only_once_the_first_has_closed_the_client(
        driver, monkeypatch, no_thread_errors) -> None:
    client = Client.connect(driver.directory)
    client.add_publication("aeron:ipc", 22)
    original_close = Publication.close
    closing = threading.Event()

    def slow_close(self: Publication) -> None:
        closing.set()
        time.sleep(0.5)
        original_close(self)

    monkeypatch.setattr(Publication, "close", slow_close)
    first = threading.Thread(target=client.close)
    first.start()
    assert closing.wait(5)
    client.close()
    assert client._closed and not client._thread.is_alive()  # all of close() had run
    first.join(5)


@pytest.mark.parametrize("thread_first", [True, False], ids=["thread-ran", "thread-late"])
def test_an_interrupt_as_connect_starts_its_thread_leaves_no_thread_or_fd(
        driver, monkeypatch, no_thread_errors, thread_first: bool) -> None:
    """Ctrl-C right after the conductor thread started, whether or not it ran yet: each pipe
    end is closed once (by the thread, or by connect() if the thread never took charge)."""
    from slipstream.client import client as client_module

    Client.connect(driver.directory).close()  # zmq's context and its fds exist from here on
    threads_before = set(threading.enumerate())
    keepers_before = _keepalive_threads()
    original_start, original_run = threading.Thread.start, Client._run_conductor
    made: list[Client] = []
    pipes: set[str] = set()

    def start_then_interrupt(thread: threading.Thread) -> None:
        if not thread.name.startswith("slipstream-client-"):
            return original_start(thread)
        client = thread._target.__self__  # type: ignore[attr-defined]
        made.append(client)
        pipes.update(os.readlink(f"/proc/self/fd/{fd}")
                     for fd in (client._notices, client._notices_in))
        original_start(thread)
        while thread_first and client._thread_stage != client_module._THREAD_RUNNING:
            time.sleep(0.001)
        raise KeyboardInterrupt

    def run_late(self: Client) -> None:  # its first step comes after connect() gave up
        deadline = time.monotonic() + 5
        while not thread_first and not self._closed and time.monotonic() < deadline:
            time.sleep(0.001)
        original_run(self)

    with monkeypatch.context() as patch, pytest.raises(KeyboardInterrupt):
        patch.setattr(threading.Thread, "start", start_then_interrupt)
        patch.setattr(Client, "_run_conductor", run_late)
        Client.connect(driver.directory)
    [client] = made
    wait_for(lambda: set(threading.enumerate()) <= threads_before | {
        t for t in threading.enumerate() if isinstance(t, threading.Timer)},
        what="the conductor thread's end", timeout=3)
    assert client._thread_stage == (client_module._THREAD_ENDED if thread_first
                                    else client_module._THREAD_SKIPPED)
    wait_for(lambda: not _keepalive_threads() - keepers_before,
             what="the keepalive thread's end", timeout=1)
    wait_for(lambda: not pipes & set(_open_fds().values()), what="the pipe's ends closed",
             timeout=3)
    assert client._socket.closed


def test_a_client_whose_driver_exited_raises_at_once_and_never_spins(driver_dir: Path) -> None:
    with MediaDriver.launch(directory=driver_dir) as driver:  # default timers: a 10 s timeout
        client = Client.connect(driver_dir)
        subscription = client.add_subscription("aeron:ipc", 14)
        publication = client.add_publication("aeron:ipc", 14)
        while not publication.is_connected:
            time.sleep(0.01)
        woke: list[BaseException] = []

        def wait() -> None:
            try:
                subscription.receive(lambda d, h: None, 10, timeout=30)
            except BaseException as e:
                woke.append(e)

        waiter = threading.Thread(target=wait)
        waiter.start()
        started = time.monotonic()
        driver.stop()
        waiter.join(5)
        # The driver let go of its lock: noticed within a keepalive interval (500 ms), not
        # after the 10 s driver timeout, and the parked receive was woken to say so.
        assert time.monotonic() - started < 3
        assert [type(e) for e in woke] == [DriverNotRunningError]
        with pytest.raises(DriverNotRunningError):
            subscription.poll(lambda d, h: None)
        assert publication.offer(b"x") == -4  # CLOSED, as Aeron's
        before = resource.getrusage(resource.RUSAGE_SELF)
        time.sleep(1.0)
        after = resource.getrusage(resource.RUSAGE_SELF)
        used = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
        assert used < 0.05, f"the orphaned client used {used:.2f} s of CPU in 1 s"
        client.close()


def test_a_close_that_is_interrupted_still_ends_the_clients_threads(driver,
                                                                  monkeypatch) -> None:
    """Ctrl-C in the middle of close(): the client is closed all the same, and its keepalives
    stop (the driver then times it out and reclaims what it held)."""
    before = _keepalive_threads()
    client = Client.connect(driver.directory)
    [keeper] = _keepalive_threads() - before
    publication = client.add_publication("aeron:ipc", 19)

    def interrupted(self: object) -> None:
        raise KeyboardInterrupt

    subscription = client.add_subscription("aeron:ipc", 19)
    monkeypatch.setattr(Publication, "close", interrupted)
    with pytest.raises(KeyboardInterrupt):
        client.close()
    assert client.is_closed
    time.sleep(3.5)  # past the resource linger: the counters file is unmapped
    assert publication.offer(b"x") == -4  # CLOSED, not a write into an unmapped page
    with pytest.raises(ClosedError):
        subscription.poll(lambda data, header: None)
    wait_for(lambda: keeper not in _keepalive_threads(), what="the keepalive thread's end",
             timeout=1)


def test_sigterm_stops_the_demo_and_its_driver(driver_dir: Path) -> None:
    demo = subprocess.Popen([*SLIPSTREAM, "demo", "--dir", str(driver_dir), "--rate", "1000"],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert "slipstream demo" in (demo.stdout.readline() if demo.stdout else "")
        deadline = time.monotonic() + 20
        while not (driver_dir / "counters.dat").exists():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(1.0)
        demo.send_signal(signal.SIGTERM)
        assert demo.wait(20) == 0
    finally:
        if demo.poll() is None:
            demo.kill()
    assert not driver_dir.exists()  # the driver stopped and removed its directory


def test_the_demo_streams_and_stops_cleanly(driver_dir: Path) -> None:
    result = subprocess.run([*SLIPSTREAM, "demo", "--dir", str(driver_dir), "--duration", "3",
                             "--rate", "20000"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    rates = [line for line in result.stdout.splitlines() if line.startswith("[")]
    assert rates and "(        0/s)" not in rates[-1]  # both streams, IPC and UDP, move
    assert "NAKs 0 " not in rates[-1]  # the UDP stream's loss is repaired
    assert "expected message" not in result.stdout  # both arrived whole and in order
    assert "slipstream demo: stopped" in result.stdout
    assert not driver_dir.exists()


def test_the_slow_consumer_demo_shows_episodes_live(driver_dir: Path) -> None:
    result = subprocess.run([*SLIPSTREAM, "demo", "--dir", str(driver_dir), "--duration", "7",
                             "--rate", "20000", "--slow-consumer"],
                            capture_output=True, text=True, timeout=90)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    # Its subscriber slows down from 2 s to 4 s: the publisher's callback hears the episode.
    assert "slow stream: back-pressure episode 1 began (depth 524,288 bytes" in out, out
    assert "slow stream: episode 1 ended after" in out, out
    slow = [line for line in out.splitlines() if line.lstrip().startswith("slow ")]
    assert slow and "episodes 0 " not in slow[-1] and "peak 524,288 B" in slow[-1]
    assert "slipstream demo: stopped" in out


def _sub_commands(parser: argparse.ArgumentParser) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield f"{parser.prog} {name}".removeprefix("slipstream "), sub
                yield from _sub_commands(sub)


def test_every_sub_commands_help_says_what_it_does_and_shows_its_defaults() -> None:
    from slipstream.daemon.cli import build_parser

    commands = dict(_sub_commands(build_parser()))
    assert {"driver", "stat", "metrics", "demo", "sim", "sim relay", "sim hosts"} <= set(commands)
    for name, parser in commands.items():
        assert parser.description, f"slipstream {name} --help does not say what it does"
        for action in parser._actions:
            if action.option_strings and action.default not in (None, False, [], "==SUPPRESS=="):
                assert "default" in (action.help or ""), (
                    f"slipstream {name} {action.option_strings[0]} does not show its default")
