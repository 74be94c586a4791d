"""The counters file: allocation, freeing and the reuse delay."""

from __future__ import annotations

import contextlib
import fcntl
import gc
import os
import select
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import keepalive_threads, voluntary_switches
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slipstream.client import counters as counters_module
from slipstream.client._native import ffi, lib
from slipstream.client.counters import (
    KEY_MAX_LENGTH,
    LABEL_MAX_LENGTH,
    METADATA_LENGTH,
    CountersFile,
    CountersFullError,
    CounterType,
    SystemCounter,
)
from slipstream.client.errors import InvalidArgumentError


@pytest.fixture
def counters(shm: Path) -> Iterator[CountersFile]:
    file = CountersFile.create(shm / "counters.dat", capacity=len(SystemCounter) + 2)  # 2 free
    yield file
    file.close()


def test_a_freed_counter_is_not_handed_out_again_at_once(counters: CountersFile,
                                                         monkeypatch) -> None:
    """A process that has not yet learned its counter was freed may still write it: the slot
    waits before it can carry someone else's position."""
    first = counters.allocate(CounterType.CLIENT_HEARTBEAT, "a", registration_id=1)
    second = counters.allocate(CounterType.SUBSCRIBER_POSITION, "b", registration_id=2)
    counters.free(first)
    assert counters.info(first) is None
    with pytest.raises(CountersFullError, match="counters are in use or freed less than 1 s ago"):
        counters.allocate(CounterType.SUBSCRIBER_POSITION, "c")
    monkeypatch.setattr(counters_module, "FREE_TO_REUSE_TIMEOUT_NS", 0)
    counters.free(second)
    assert counters.allocate(CounterType.SUBSCRIBER_POSITION, "d", registration_id=4) == second


@settings(max_examples=200, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(key=st.binary(max_size=KEY_MAX_LENGTH), label=st.text(max_size=LABEL_MAX_LENGTH + 40),
       neighbour=st.binary(min_size=KEY_MAX_LENGTH, max_size=KEY_MAX_LENGTH))
def test_a_counters_key_and_label_read_back_and_never_spill_into_the_next(
        counters: CountersFile, monkeypatch, key: bytes, label: str, neighbour: bytes) -> None:
    """Any key the record holds reads back whole, a label cut to LABEL_MAX_LENGTH bytes (never
    into the next record), and the next counter's full key and label stay its own."""
    # The slots are reused at once between examples (the delay is for other processes).
    monkeypatch.setattr(counters_module, "FREE_TO_REUSE_TIMEOUT_NS", 0)
    first = counters.allocate(1100, label, registration_id=1, key=key)
    second = counters.allocate(1101, "z" * (LABEL_MAX_LENGTH + 1), registration_id=2,
                               key=neighbour)
    try:
        info = counters.info(first)
        assert info.key == key
        assert info.label.encode()[:LABEL_MAX_LENGTH] == info.label.encode()
        assert label.encode().startswith(info.label.encode().rstrip(b"\xef\xbf\xbd"))
        assert (counters.info(second).key, counters.info(second).label) == (
            neighbour, "z" * LABEL_MAX_LENGTH)
        assert counters.find(1100, key) == info
    finally:
        counters.free(first)
        counters.free(second)


def test_a_key_longer_than_the_record_is_refused(counters: CountersFile) -> None:
    with pytest.raises(InvalidArgumentError, match=f"exceed the counters file's {KEY_MAX_LENGTH}"):
        counters.allocate(1100, "k", key=bytes(KEY_MAX_LENGTH + 1))


def test_a_damaged_records_lengths_read_within_the_record(counters: CountersFile) -> None:
    """The file is every client's to write: lengths past the record, or negative, are cut to
    it rather than read into the next record."""
    counter_id = counters.allocate(1100, "label", registration_id=1, key=b"key")
    offset = counters_module.HEADER_LENGTH + counter_id * METADATA_LENGTH
    counters._map[offset + 32:offset + 40] = (10_000).to_bytes(4, "little", signed=True) + (
        -5).to_bytes(4, "little", signed=True)
    info = counters.info(counter_id)
    assert info.key == b"" and len(info.label.encode()) <= LABEL_MAX_LENGTH
    assert info.label.startswith("label")


def test_a_reader_sees_its_counter_freed_and_its_slot_given_to_another(
        counters: CountersFile, monkeypatch) -> None:
    counter_id = counters.allocate(1100, "first", registration_id=10)
    counters.allocate(1100, "the other free slot", registration_id=9)
    kept = counters.reader(counter_id, 10)
    counters.set(counter_id, 5)
    assert kept.is_allocated and kept.get() == 5
    monkeypatch.setattr(counters_module, "FREE_TO_REUSE_TIMEOUT_NS", 0)
    counters.free(counter_id)
    assert not kept.is_allocated
    assert counters.allocate(1100, "second", registration_id=11) == counter_id
    assert not kept.is_allocated  # the same slot, another registration
    assert counters.reader(counter_id, 11).is_allocated
    assert counters.find(1100, registration_id=10) is None
    assert counters.find(1100, registration_id=11).label == "second"
    with pytest.raises(IndexError):
        counters.reader(counters.capacity, 11)


@pytest.fixture
def driver_lock(shm: Path) -> Iterator[Path]:
    """A driver's lock file, held (as a live driver holds it) until the test lets it go."""
    path = shm / "driver.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    yield path
    os.close(fd)  # lets the lock go, if the test has not


@pytest.fixture
def notices() -> Iterator[tuple[int, int]]:
    read_end, write_end = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
    yield read_end, write_end
    os.close(read_end)
    os.close(write_end)


@contextlib.contextmanager
def _keeping(counters: CountersFile, lock_path: Path, notify_fd: int, *,
             interval_ns: int = 10_000_000, driver_timeout_ns: int = 0) -> Iterator[int]:
    """A client heartbeat (registration 1) kept by a keepalive thread while in the block;
    yields the heartbeat's counter id."""
    heartbeat = counters.allocate(CounterType.CLIENT_HEARTBEAT, "h", registration_id=1)
    stop = counters.start_heartbeat_keeper(
        heartbeat, 1, interval_ns=interval_ns, driver_timeout_ns=driver_timeout_ns,
        lock_path=lock_path, notify_fd=notify_fd)
    try:
        yield heartbeat
    finally:
        stop()


def _notice(read_end: int, timeout_s: float) -> bytes:
    """The keeper's notice within timeout_s, or b"" when there is none."""
    readable, _, _ = select.select([read_end], [], [], timeout_s)
    return os.read(read_end, 16) if readable else b""


def test_the_keepalive_thread_beats_only_into_the_clients_own_heartbeat(
        counters: CountersFile, driver_lock: Path, notices: tuple[int, int],
        monkeypatch) -> None:
    """A driver that timed the client out frees its heartbeat, and may hand the slot to
    someone else's position: the keeper stops writing it at once."""
    monkeypatch.setattr(counters_module, "FREE_TO_REUSE_TIMEOUT_NS", 0)
    heartbeat = counters.allocate(CounterType.CLIENT_HEARTBEAT, "client-heartbeat: 7",
                                  registration_id=7)
    other = counters.allocate(CounterType.CLIENT_HEARTBEAT, "client-heartbeat: 8",
                              registration_id=8)
    stops = [counters.start_heartbeat_keeper(
        counter_id, registration_id, interval_ns=5_000_000, driver_timeout_ns=0,
        lock_path=driver_lock, notify_fd=notices[1])
        for counter_id, registration_id in ((heartbeat, 7), (other, 9))]
    try:
        started = time.monotonic_ns()
        deadline = time.monotonic() + 5
        while counters.get(heartbeat) < started:  # beats at start, then every 5 ms
            assert time.monotonic() < deadline
            time.sleep(0.001)
        first = counters.get(heartbeat)
        time.sleep(0.05)
        assert counters.get(heartbeat) > first
        assert counters.get(other) == 0  # registration 8's slot, not 9's
        counters.free(heartbeat)
        time.sleep(0.05)  # a beat that had passed its look at the slot has landed by now
        reused = counters.allocate(CounterType.SUBSCRIBER_POSITION, "sub-pos", registration_id=7)
        assert reused == heartbeat
        counters.set(reused, 1234)
        time.sleep(0.05)  # ten intervals
        assert counters.get(reused) == 1234
        assert _notice(notices[0], 0) == b""  # the driver is there
    finally:
        for stop in stops:
            stop()


def test_the_keepalive_thread_says_when_the_driver_lets_its_lock_go(
        counters: CountersFile, shm: Path, notices: tuple[int, int]) -> None:
    """The keeper looks at the driver's lock at each beat, so it tells at its next beat after
    the lock goes: counted in the keeper's sleeps (its voluntary switches, one a beat), which
    a loaded machine does not add to, not in seconds."""
    lock_path = shm / "driver.lock"
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    before = keepalive_threads()
    with _keeping(counters, lock_path, notices[1]):
        [keeper] = keepalive_threads() - before
        assert _notice(notices[0], 0.1) == b""  # ten looks at a held lock: no notice
        asleep = voluntary_switches(os.getpid(), keeper)
        os.close(fd)  # the driver exits (or crashes): the kernel lets its lock go
        beats = 0
        deadline = time.monotonic() + 5
        while not (notice := _notice(notices[0], 0.001)) and time.monotonic() < deadline:
            with contextlib.suppress(OSError):  # the keeper ends as it tells
                beats = voluntary_switches(os.getpid(), keeper) - asleep
        assert notice == bytes([lib.SS_KEEPER_DRIVER_EXITED])
        assert beats <= 2  # the sleep it was in, and at most one it began as the lock went
        assert _notice(notices[0], 0.05) == b""  # one notice, then it ends


def test_the_keepalive_thread_says_when_the_drivers_heartbeat_stops(
        counters: CountersFile, driver_lock: Path, notices: tuple[int, int]) -> None:
    counters.beat(time.time_ns())
    with _keeping(counters, driver_lock, notices[1], driver_timeout_ns=300_000_000):
        deadline = time.monotonic() + 1.0  # three timeouts
        while time.monotonic() < deadline:  # a driver that beats is alive
            counters.beat(time.time_ns())
            assert _notice(notices[0], 0.01) == b""
        last_beat = time.time_ns()  # then it hangs, still holding its lock
        counters.beat(last_beat)
        assert _notice(notices[0], 5) == bytes([lib.SS_KEEPER_DRIVER_STOPPED])
        assert time.time_ns() - last_beat > 300_000_000  # never before driver_timeout


def test_the_keepalive_thread_says_when_a_new_driver_took_the_directory(
        counters: CountersFile, driver_lock: Path, notices: tuple[int, int]) -> None:
    """A driver that crashed and was restarted between two beats holds the lock again: its
    new counters file is what shows the client's are no one's any more."""
    with _keeping(counters, driver_lock, notices[1]):
        assert _notice(notices[0], 0.1) == b""
        # The new driver cleans the dead one's files and makes its own (here in one step, so
        # no look finds the path empty between the two).
        fresh = counters.path.with_name("new-counters.dat")
        CountersFile.create(fresh, capacity=len(SystemCounter)).close()
        fresh.rename(counters.path)
        assert _notice(notices[0], 5) == bytes([lib.SS_KEEPER_DRIVER_REPLACED])


def test_the_keepalive_thread_says_the_driver_exited_when_its_counters_file_is_gone(
        counters: CountersFile, driver_lock: Path, notices: tuple[int, int]) -> None:
    with _keeping(counters, driver_lock, notices[1]):
        counters.path.unlink()
        assert _notice(notices[0], 5) == bytes([lib.SS_KEEPER_DRIVER_EXITED])


def test_stopping_the_keepalive_thread_does_not_wait_for_its_next_beat(
        counters: CountersFile, driver_lock: Path, notices: tuple[int, int]) -> None:
    heartbeat = counters.allocate(CounterType.CLIENT_HEARTBEAT, "h", registration_id=1)
    interval_ns = 60_000_000_000
    stop = counters.start_heartbeat_keeper(
        heartbeat, 1, interval_ns=interval_ns, driver_timeout_ns=0, lock_path=driver_lock,
        notify_fd=notices[1])
    time.sleep(0.01)
    started = time.monotonic()
    stop()
    assert time.monotonic() - started < interval_ns / 1e9 / 2  # not at its next beat
    stop()  # once only: a second call does nothing
    lib.ss_keeper_stop(ffi.NULL)  # nothing to stop: a no-op


def _threads() -> set[str]:
    return set(os.listdir("/proc/self/task"))


def test_a_keepalive_thread_ends_with_its_counters_file_closed_or_collected(
        shm: Path, driver_lock: Path, notices: tuple[int, int]) -> None:
    """The thread writes into the file's mapping: it never outlives it, also when the file is
    dropped without close() (as a client that failed half-way through connecting)."""
    for collect in (False, True):
        counters = CountersFile.create(shm / f"counters-{collect}.dat", capacity=256)
        heartbeat = counters.allocate(CounterType.CLIENT_HEARTBEAT, "h", registration_id=1)
        before = _threads()
        counters.start_heartbeat_keeper(
            heartbeat, 1, interval_ns=1_000_000, driver_timeout_ns=0, lock_path=driver_lock,
            notify_fd=notices[1])
        [keeper] = _threads() - before
        if collect:
            del counters
            gc.collect()
        else:
            counters.close()
        assert keeper not in _threads()  # joined: gone at once


def test_a_keepalive_thread_with_a_bad_interval_is_refused(
        counters: CountersFile, driver_lock: Path, notices: tuple[int, int]) -> None:
    heartbeat = counters.allocate(CounterType.CLIENT_HEARTBEAT, "h", registration_id=1)
    with pytest.raises(OSError, match=r"keepalive thread: Invalid argument"):
        counters.start_heartbeat_keeper(heartbeat, 1, interval_ns=0, driver_timeout_ns=0,
                                        lock_path=driver_lock, notify_fd=notices[1])
