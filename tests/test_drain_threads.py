"""The drain's questions (is every network publication flushed, has every one ended its
stream) are asked on the conductor's thread while the sender's thread serves the
publications: receivers join and leave there.  The answers must come from what the sender
publishes for the conductor (counters and its status snapshot), never from the sender's own
objects mid-change."""

from __future__ import annotations

import random
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from slipstream.client import control
from slipstream.client.channel import parse_channel
from slipstream.client.counters import CountersFile
from slipstream.client.frames import StatusMessage
from slipstream.daemon.conductor.conductor import DriverConductor
from slipstream.daemon.config import DriverSettings

TERM = 64 * 1024
EOS_FLAG = 0x40  # a status message's end-of-stream flag: the receiver leaves
SOURCE = ("127.0.0.1", 40500)
RECEIVERS = 64  # live receivers of each publication


class _SendTransport:
    """A send transport without a socket whose control input is a crowd of receivers of
    every publication attached: on each pass of the sender's Python half, more join (their
    status messages) and the oldest leave (EOS-flagged ones)."""

    def __init__(self) -> None:
        self._streams: list[tuple[int, int, int]] = []  # (session, stream, initial term)
        self._next_receiver = 1
        self._joined: list[int] = []
        self.passes = 0
        #: Set once a whole pass with receivers ended (the second began).
        self.served = threading.Event()

    def attach(self, publication: Any) -> None:
        self._streams.append((publication.session_id, publication.stream_id,
                              publication.initial_term_id))

    def attach_channel(self, channel: Any) -> None:
        pass

    def dispatch(self, channel: Any, now_ns: int) -> int:
        if not self._streams:
            return 0
        self.passes += 1
        if self.passes == 2:
            self.served.set()
        joining = []
        for _ in range(16):
            joining.append(self._next_receiver)
            self._next_receiver += 1
        self._joined.extend(joining)
        leaving = self._joined[:-RECEIVERS]
        del self._joined[:-RECEIVERS]
        frames = [StatusMessage(session_id, stream_id, term_id, 0, 32 * 1024, receiver, flags)
                  for session_id, stream_id, term_id in self._streams
                  for receivers, flags in ((joining, 0), (leaving, EOS_FLAG))
                  for receiver in receivers]
        for frame in frames:
            channel.on_control(frame.encode(), SOURCE, now_ns)
        return len(frames)

    def send(self, datagrams: list) -> None:
        pass

    def on_notice(self, publication: Any) -> None:
        pass

    def close(self) -> None:
        pass


class _Transports:
    def __init__(self) -> None:
        self.send = _SendTransport()

    def open_send(self, channel: Any, destination: Any) -> _SendTransport:
        return self.send

    def open_receive(self, channel: Any, bind: Any) -> Any:
        raise OSError("no receive side in this test")

    def open_multi_destination_receive(self, channel: Any) -> Any:
        raise OSError("no receive side in this test")

    def local_addresses(self) -> list:
        return []

    def reload_keys(self, now_ns: int) -> None:
        pass


@pytest.fixture
def fast_switching() -> Iterator[None]:
    """Threads take turns every microsecond: what a loaded 2-core machine does now and then."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(interval)


def test_the_drain_asks_while_receivers_join_and_leave_on_the_senders_thread(
        tmp_path: Path, fast_switching: None) -> None:
    for directory in (control.PUBLICATIONS_DIR, control.IMAGES_DIR):
        (tmp_path / directory).mkdir()
    counters = CountersFile.create(tmp_path / control.COUNTERS_FILE, 4096)
    settings = DriverSettings(term_buffer_length=TERM)
    conductor = DriverConductor(settings, tmp_path, counters, rng=random.Random(7),
                                transports=_Transports())
    network = conductor.network
    assert network is not None
    transports = network.transports
    assert isinstance(transports, _Transports)
    network.add_publication(b"client", parse_channel("aeron:udp?endpoint=127.0.0.1:40501"),
                            1001, time.monotonic_ns())
    conductor.begin_drain(time.monotonic_ns())  # the sender stops the credit: the drain
    sender = network.sender
    stop = threading.Event()
    sender_errors: list[BaseException] = []

    def serve() -> None:  # the network thread: the sender's Python half, pass after pass
        try:
            while not stop.is_set():
                sender.do_python_work(time.monotonic_ns())
        except BaseException as e:  # handed to the test's thread
            sender_errors.append(e)

    thread = threading.Thread(target=serve, name="ss-sender-test", daemon=True)
    thread.start()
    answers = 0
    try:
        assert transports.send.served.wait(5.0)
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline and not sender_errors:
            # The drain's questions, on this thread (the conductor's); a live receiver is
            # always there and no EOS heartbeat went: the streams have not ended.
            network.is_flushed()
            assert not network.has_ended_streams()
            answers += 1
    finally:
        stop.set()
        thread.join(5.0)
    assert not sender_errors, sender_errors
    assert answers > 100
