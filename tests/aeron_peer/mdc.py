"""Our own line-driven Java programs (``java/*.java``), each holding one Aeron 1.15.1 resource
and acting on command: ``MdcPublisher``, a publication (typically a manual
multi-destination-cast, MDC, channel) that adds and removes destinations and offers messages;
``MdsSubscriber``, a subscription (typically a multi-destination one, ``control-mode=manual``)
that adds and removes destinations and counts what it reads.  Aeron's 1.15.1 samples never call
``addDestination``; ``scripts/ensure-aeron`` compiles these programs (``javac --release 11``)
into ``.venv/aeron/classes/``.

    with AeronDriver() as driver, \\
            MdcPublisher(driver, "aeron:udp?control-mode=manual|control=127.0.0.1:40500") as pub:
        pub.add("aeron:udp?endpoint=127.0.0.1:40501")   # waits for the driver's answer
        pub.send(100)                                   # messages 0..99, retried until offered
        pub.remove("aeron:udp?endpoint=127.0.0.1:40501")

Payload of message i: i as a little-endian i64 in the first 8 bytes, zeros up to
``message_length`` (like StreamingPublisher, so ``BasicSubscriber.sequence_numbers`` reads it);
the index counts on across ``send`` calls.  A command the program answers with ``error <message>``
(e.g. ``addDestination`` on a channel without ``control=``) raises ``SampleFailed``.

Aeron 1.15.1 facts (see the Aeron source, ``SendChannelEndpoint``/``MultiDestination``): manual
control needs ``control=HOST:PORT`` (``control-mode=manual`` alone is refused: "control channel does
not allow manual control"); the publication's socket is bound to the control address; adding a
destination twice makes it receive everything twice, and removing an unknown one succeeds
silently.
"""

from __future__ import annotations

import contextlib
import re
import threading
from pathlib import Path
from typing import NamedTuple

from .driver import AeronDriver
from .errors import SampleFailed
from .install import peer_classes
from .process import START_TIMEOUT_S, JavaProcess, Properties, PropertyValue
from .samples import DEFAULT_STREAM_ID, _client_props

_READY = re.compile(r"ready sessionId=(-?\d+) streamId=(-?\d+) registrationId=(-?\d+)$")
MAIN_CLASS = "MdcPublisher"
_MDS_READY = re.compile(r"ready registrationId=(-?\d+)$")
_MDS_STATUS = re.compile(r"status received=(\d+) first=(-?\d+) last=(-?\d+) wrong=(\d+) "
                         r"images=(\d+)$")


class _CommandProgram(JavaProcess):
    """One of our line-driven Java programs: a command a line, one answer a line."""

    def request(self, line: str, timeout: float = 10.0) -> str:
        """Send one command line, wait for its one-line answer and return it; an ``error ...``
        answer raises ``SampleFailed``."""
        with self._command_lock:
            with self._cond:
                index = len(self.lines)
            self.write_line(line)
            self.wait_until(lambda: len(self.lines) > index, timeout, f"answer to {line!r}")
            with self._cond:
                answer = self.lines[index]
        if answer.startswith("error "):
            raise self.fail(f"{self.name}: {line!r} failed: {answer[6:]}")
        return answer

    def _ready(self, ready: re.Pattern[str], timeout: float) -> re.Match[str]:
        """The program's first line, matched by ``ready``, within ``timeout`` s; the program
        is killed if it does not come or does not match."""
        try:
            self.wait_until(lambda: bool(self.lines), timeout, "ready line")
            match = ready.match(self.lines[0])
            if match is None:
                raise self.fail(f"{self.name}: expected a ready line, got {self.lines[0]!r}")
        except BaseException:
            self.kill()
            raise
        return match

    def _expect(self, line: str, expected: str, timeout: float) -> None:
        answer = self.request(line, timeout)
        if answer != expected:
            raise self.fail(f"{self.name}: {line!r} answered {answer!r}, expected {expected!r}")

    def add(self, uri: str, timeout: float = 10.0) -> None:
        """``addDestination(uri)``, e.g. ``aeron:udp?endpoint=127.0.0.1:40501``."""
        self._expect(f"add {uri}", f"added {uri}", timeout)

    def remove(self, uri: str, timeout: float = 10.0) -> None:
        """``removeDestination(uri)``."""
        self._expect(f"remove {uri}", f"removed {uri}", timeout)

    def close(self, timeout: float = 5.0) -> int:
        """``quit``: the program closes its resources and client and exits; kill it if it
        does not within ``timeout`` s.  Returns the exit code."""
        if self.alive():
            try:
                self.write_line("quit")
            except Exception:  # it is going anyway
                return self.stop(1.0)
            try:
                return self.wait_exit(timeout, check=False)
            except Exception:  # wait_exit killed it
                return self.kill()
        return self.kill()

    def __exit__(self, *exc: object) -> None:
        self.close()


class MdsStatus(NamedTuple):
    """What an MdsSubscriber read: messages, first and last index (-1: none), how many were
    out of sequence (missing, repeated, reordered), and its images now."""

    received: int
    first: int
    last: int
    wrong: int
    images: int


class MdsSubscriber(_CommandProgram):
    """The ``MdsSubscriber`` Java program (``java/MdsSubscriber.java``): one Aeron 1.15.1
    subscription, typically ``aeron:udp?control-mode=manual`` (a multi-destination
    subscription), whose destinations it adds and removes on command, polled on its own
    thread, checking that the message indexes follow each other.  A context manager."""

    def __init__(self, directory: Path | str | AeronDriver, channel: str,
                 stream_id: int = DEFAULT_STREAM_ID, *,
                 start_timeout: float = START_TIMEOUT_S) -> None:
        self.channel = channel
        self.stream_id = stream_id
        self._command_lock = threading.Lock()
        props: dict[str, PropertyValue] = _client_props(directory, {
            "mds.channel": channel, "mds.streamId": stream_id})
        super().__init__(f"MdsSubscriber[{channel} {stream_id}]", "MdsSubscriber", props,
                         classpath=[peer_classes("MdsSubscriber")], interactive=True)
        self.registration_id = int(self._ready(_MDS_READY, start_timeout).group(1))

    def status(self) -> MdsStatus:
        answer = self.request("status")
        match = _MDS_STATUS.match(answer)
        if match is None:
            raise self.fail(f"{self.name}: status answered {answer!r}")
        return MdsStatus(*map(int, match.groups()))


class MdcPublisher(_CommandProgram):
    """The ``MdcPublisher`` Java program on ``channel``/``stream_id``: a context manager; leaving
    it sends ``quit`` (the publication and client close cleanly), then SIGTERM/SIGKILL."""

    def __init__(self, directory: Path | str | AeronDriver, channel: str,
                 stream_id: int = DEFAULT_STREAM_ID, *, message_length: int = 32,
                 exclusive: bool = False, offer_timeout: float = 10.0,
                 start_timeout: float = START_TIMEOUT_S,
                 properties: Properties | None = None) -> None:
        if message_length < 8:
            raise ValueError("MdcPublisher needs messages of at least 8 bytes")
        self.channel = channel
        self.stream_id = stream_id
        self.message_length = message_length
        self.next_index = 0
        self._command_lock = threading.Lock()
        props: dict[str, PropertyValue] = _client_props(directory, {
            "mdc.channel": channel, "mdc.streamId": stream_id,
            "mdc.messageLength": message_length, "mdc.exclusive": exclusive,
            "mdc.offerTimeoutMs": int(offer_timeout * 1000), **(properties or {})})
        super().__init__(f"MdcPublisher[{channel} {stream_id}]", MAIN_CLASS, props,
                         classpath=[peer_classes(MAIN_CLASS)], interactive=True)
        match = self._ready(_READY, start_timeout)
        self.session_id = int(match.group(1))
        self.registration_id = int(match.group(3))

    # -- commands ----------------------------------------------------------------------------
    def send(self, count: int, timeout: float | None = None, *, abort_every: int = 0) -> range:
        """Offer ``count`` messages (retrying back pressure and "not connected" up to the
        offer timeout per message); return the range of message indexes sent.  With
        ``abort_every``, a claim of ``1 + (index * 37) % 700`` bytes is aborted before each
        message whose index it divides (``BufferClaim.abort``: padding of the claim's frame
        length, 32 + payload bytes, in the log)."""
        limit = timeout if timeout is not None else 30.0 + count / 20_000
        command = f"send {count} {abort_every}" if abort_every else f"send {count}"
        try:
            self._expect(command, f"sent {count}", limit)
        except SampleFailed:
            if self.alive():  # some may have gone: continue from where the program is
                with contextlib.suppress(SampleFailed):
                    self.next_index = int(self.request("next").split()[1])
            raise
        sent = range(self.next_index, self.next_index + count)
        self.next_index += count
        return sent

    def is_connected(self) -> bool:
        return self.request("connected") == "connected true"

    def position(self) -> int:
        answer = self.request("position")
        return int(answer.split()[1])
