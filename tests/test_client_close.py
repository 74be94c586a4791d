"""Closing a client ends its threads and fds at once: from any thread, from its own
handlers, twice at once, when interrupted, and when Ctrl-C comes as connect() starts."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Iterator

import pytest
from helpers import keepalive_threads, wait_for

from slipstream.client import Client, ClosedError
from slipstream.client import conductor as conductor_module
from slipstream.client.conductor import (
    EVENTS_SAFETY_NET_S,
    THREAD_JOIN_TIMEOUT_S,
    ClientConductor,
)
from slipstream.client.publication import Publication

SLIPSTREAM = [sys.executable, "-m", "slipstream.daemon.cli"]


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


def _open_fds() -> dict[str, str]:
    """This process's open fds and what each is (listdir's own fd is gone when read)."""
    found = {}
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            found[fd] = os.readlink(f"/proc/self/fd/{fd}")
    return found


def test_closing_a_client_ends_its_threads_at_once(driver) -> None:
    before = keepalive_threads()  # other tests' clients may still be ending theirs
    client = Client.connect(driver.directory)
    [keeper] = keepalive_threads() - before  # named by its creator: there at once
    started = time.monotonic()
    client.close()
    # Not the conductor thread's safety net (its next look without events), with room.
    assert time.monotonic() - started < EVENTS_SAFETY_NET_S / 2
    assert not [t for t in threading.enumerate()
                if t.name == f"slipstream-client-{client.client_id}"]
    wait_for(lambda: keeper not in keepalive_threads(), what="the keepalive thread's end",
             timeout=1)
    client.close()  # again: nothing to do


def test_a_client_closed_from_its_own_image_handler_ends_its_threads_and_leaves(
        driver, caplog, no_thread_errors) -> None:
    """The handler runs on the client's conductor thread, which close() must not join."""
    before = keepalive_threads()
    client = Client.connect(driver.directory)
    [keeper] = keepalive_threads() - before
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
    wait_for(lambda: keeper not in keepalive_threads(), what="the keepalive thread's end",
             timeout=1)
    assert client._conductor._socket.closed  # the socket is let go, not left to the collector
    # The driver let the client go (CLOSE_CLIENT), not only after its liveness timeout.
    stat = subprocess.run([*SLIPSTREAM, "stat", "--dir", str(driver.directory), "--once"],
                          capture_output=True, text=True, timeout=30)
    assert f"client-heartbeat: {client.client_id} " not in stat.stdout


def test_a_client_closed_from_a_handler_its_own_request_runs_ends_without_waiting(
        driver, caplog, no_thread_errors) -> None:
    """Handlers also run on a thread waiting for an answer (it holds the client's lock, which
    the conductor thread then waits for): close() there must neither join that thread nor
    close the socket the wait still reads."""
    before = keepalive_threads()
    client = Client.connect(driver.directory)
    [keeper] = keepalive_threads() - before
    ran_on: list[threading.Thread] = []

    def close_on_image(image: object) -> None:
        ran_on.append(threading.current_thread())
        client.close()

    client.add_subscription("aeron:ipc", 24, on_available_image=close_on_image)
    with Client.connect(driver.directory) as other:
        # The conductor thread cannot take the image event: a request will
        with client._conductor._lock:
            other.add_publication("aeron:ipc", 24)
            time.sleep(0.2)  # the event waits in the client's socket
            started = time.monotonic()
            with pytest.raises(ClosedError):
                client.add_subscription("aeron:ipc", 25)
            # A join would wait all its timeout: the thread cannot end while this holds the
            # lock.  No join takes one request's round trip, however loaded the machine.
            assert time.monotonic() - started < THREAD_JOIN_TIMEOUT_S
            assert not client._conductor._socket.closed  # left to the thread, which needs the lock
        assert ran_on == [threading.current_thread()]
        wait_for(lambda: not [t for t in threading.enumerate()
                              if t.name == f"slipstream-client-{client.client_id}"],
                 what="the conductor thread's end", timeout=2)
    assert client._conductor._socket.closed
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")]
    wait_for(lambda: keeper not in keepalive_threads(), what="the keepalive thread's end",
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
    original_run = ClientConductor._run_conductor

    def late_run(self: ClientConductor) -> None:
        deadline = time.monotonic() + 5
        while not self._closed and time.monotonic() < deadline:
            time.sleep(0.001)
        original_run(self)

    monkeypatch.setattr(ClientConductor, "_run_conductor", late_run)
    client = Client.connect(driver.directory)
    pipe = os.readlink(f"/proc/self/fd/{client._conductor._notices}")
    client.close()
    wait_for(lambda: pipe not in _open_fds().values(), what="the pipe's read end closed",
             timeout=3)
    assert client._conductor._socket.closed


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
    conductor = client._conductor
    assert conductor._closed and not conductor._thread.is_alive()  # all of close() had run
    first.join(5)


@pytest.mark.parametrize("thread_first", [True, False], ids=["thread-ran", "thread-late"])
def test_an_interrupt_as_connect_starts_its_thread_leaves_no_thread_or_fd(
        driver, monkeypatch, no_thread_errors, thread_first: bool) -> None:
    """Ctrl-C right after the conductor thread started, whether or not it ran yet: each pipe
    end is closed once (by the thread, or by connect() if the thread never took charge)."""
    Client.connect(driver.directory).close()  # zmq's context and its fds exist from here on
    threads_before = set(threading.enumerate())
    keepers_before = keepalive_threads()
    original_start, original_run = threading.Thread.start, ClientConductor._run_conductor
    made: list[ClientConductor] = []
    pipes: set[str] = set()

    def start_then_interrupt(thread: threading.Thread) -> None:
        if not thread.name.startswith("slipstream-client-"):
            return original_start(thread)
        conductor = thread._target.__self__  # type: ignore[attr-defined]
        made.append(conductor)
        pipes.update(os.readlink(f"/proc/self/fd/{fd}")
                     for fd in (conductor._notices, conductor._notices_in))
        original_start(thread)
        while thread_first and conductor._thread_stage != conductor_module._THREAD_RUNNING:
            time.sleep(0.001)
        raise KeyboardInterrupt

    def run_late(self: ClientConductor) -> None:  # its first step comes after connect() gave up
        deadline = time.monotonic() + 5
        while not thread_first and not self._closed and time.monotonic() < deadline:
            time.sleep(0.001)
        original_run(self)

    with monkeypatch.context() as patch, pytest.raises(KeyboardInterrupt):
        patch.setattr(threading.Thread, "start", start_then_interrupt)
        patch.setattr(ClientConductor, "_run_conductor", run_late)
        Client.connect(driver.directory)
    [conductor] = made
    wait_for(lambda: set(threading.enumerate()) <= threads_before | {
        t for t in threading.enumerate() if isinstance(t, threading.Timer)},
        what="the conductor thread's end", timeout=3)
    assert conductor._thread_stage == (conductor_module._THREAD_ENDED if thread_first
                                       else conductor_module._THREAD_SKIPPED)
    wait_for(lambda: not keepalive_threads() - keepers_before,
             what="the keepalive thread's end", timeout=1)
    wait_for(lambda: not pipes & set(_open_fds().values()), what="the pipe's ends closed",
             timeout=3)
    assert conductor._socket.closed


def test_a_close_that_is_interrupted_still_ends_the_clients_threads(driver,
                                                                  monkeypatch) -> None:
    """Ctrl-C in the middle of close(): the client is closed all the same, and its keepalives
    stop (the driver then times it out and reclaims what it held)."""
    before = keepalive_threads()
    client = Client.connect(driver.directory)
    [keeper] = keepalive_threads() - before
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
    wait_for(lambda: keeper not in keepalive_threads(), what="the keepalive thread's end",
             timeout=1)

