"""One driver per directory: what a driver makes in its directory, what it takes over,
what it refuses and leaves untouched (a user's files, a lock it did not write, another
user's directory), what it cleans after a crash, and what it removes at stop."""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import lacking, wait_for

from slipstream.client import (
    NOT_CONNECTED,
    Client,
    DriverAlreadyRunningError,
    DriverDirectoryError,
    DriverError,
    DriverNotRunningError,
)
from slipstream.client.logbuffer import LogBuffer, compute_log_length
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


@pytest.mark.unit
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


@pytest.mark.unit
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
        with monkeypatch.context() as patch:  # told at once, not after the probe's wait
            patch.setattr(directory_module, "_PROBE_WAIT_S", 10.0)
            started = time.monotonic()
            with pytest.raises(DriverAlreadyRunningError):
                _flock(starting, tmp_path)
            assert time.monotonic() - started < 10.0 / 4
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


@pytest.mark.unit
def test_a_lock_file_a_driver_did_not_write_is_refused(tmp_path: Path) -> None:
    (tmp_path / "driver.lock").write_text("my own lock file\n")
    (tmp_path / "counters.dat").write_text("my counters")
    before = _tree(tmp_path)
    with pytest.raises(DriverDirectoryError, match="not written by a driver"):
        DriverDirectory(tmp_path).acquire()
    assert _tree(tmp_path) == before


@pytest.mark.unit
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


@pytest.mark.unit
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


@pytest.mark.unit
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


@pytest.mark.hosts
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


@pytest.mark.unit
def test_a_lock_file_that_is_a_link_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.write_text("slipstream driver directory\n")
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "driver.lock").symlink_to(target)
    with pytest.raises(DriverDirectoryError, match=r"cannot open its driver\.lock"):
        DriverDirectory(tmp_path / "dir").acquire()
    assert target.read_text() == "slipstream driver directory\n"


@pytest.mark.unit
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

