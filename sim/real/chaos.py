"""Chaos on one host: publishers, subscribers and the driver itself killed with SIGKILL at
random points of a long run, and replaced.

Publishers (processes) append numbered messages to IPC streams, by ``offer`` and by
``try_claim`` with a pause between claim and commit (so that kills land inside claims);
subscribers (processes) check what they receive.  A chaos loop kills one of them at random
every ``kill_interval`` on average, and starts a replacement; every ``driver_kill_interval``
it kills the driver and starts a new one in the same directory.  Clients of a dead driver see
``CLOSED`` / :class:`~slipstream.client.DriverNotRunningError` and reconnect.

What must hold, and what :func:`run_chaos` reports:

* every subscriber sees each publication's messages exactly once and in order: within one
  session, a publisher's numbers only go up by one (a publisher killed inside a claim never
  committed it, so nothing it accepted is skipped); a gap is a lost message;
* nothing leaks: once everything is stopped, the driver directory is gone and /dev/shm holds
  no file of the run (logs, counters); no process of the run is left;
* the driver unblocks publications whose publisher died inside a claim (its counter), and a
  restarted driver cleans up after the killed one (no file of the old one is left).
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import random
import signal
import struct
import time
import uuid
from pathlib import Path
from typing import Any

import attrs

from slipstream.client import CLOSED, BufferClaim, Client, DriverNotRunningError
from slipstream.client.counters import SystemCounter, read_system_counters

_MESSAGE = struct.Struct("<iq")  # publisher id, sequence number
#: Per subscriber slot (int64): messages, sequence errors (duplicate, reorder or gap), sessions.
_SLOT = 3


@attrs.define
class ChaosReport:
    seconds: float
    publisher_kills: int = 0
    subscriber_kills: int = 0
    driver_kills: int = 0
    accepted: int = 0  # messages publishers were told were appended
    delivered: int = 0  # messages subscribers received (each counts its own)
    sequence_errors: int = 0  # duplicates, reorders or gaps within a session
    unblocked: int = 0  # claims of killed publishers the driver unblocked
    leaked: list[str] = attrs.Factory(list)

    @property
    def ok(self) -> bool:
        return self.sequence_errors == 0 and not self.leaked and self.delivered > 0

    def format_text(self) -> str:
        return "\n".join([
            f"run            {self.seconds:.0f} s",
            f"kills          {self.publisher_kills} publishers, {self.subscriber_kills} "
            f"subscribers, {self.driver_kills} drivers (SIGKILL)",
            f"messages       {self.accepted:,} accepted by publishers, {self.delivered:,} "
            f"received by subscribers",
            f"sequence       {self.sequence_errors} duplicates, reorders or gaps in a session",
            f"unblocked      {self.unblocked} claims of killed publishers (driver counter)",
            f"leaks          {', '.join(self.leaked) or 'none'}",
            f"result         {'ok' if self.ok else 'FAILED'}",
        ])


def _connect(directory: str, stop: Any) -> Any:
    while not stop.value:
        try:
            return Client.connect(directory, timeout=2.0)
        except (DriverNotRunningError, OSError, TimeoutError):
            time.sleep(0.05)
        except Exception:  # the driver died half-way through the handshake
            time.sleep(0.05)
    return None


def _publisher(directory: str, publisher_id: int, stream_id: int, accepted: Any,
               stop: Any) -> None:
    rng = random.Random(publisher_id)
    sequence = 0
    claim = BufferClaim()
    while not stop.value:
        client = _connect(directory, stop)
        if client is None:
            return
        try:
            publication = client.add_publication("aeron:ipc", stream_id)
            while not stop.value:
                data = _MESSAGE.pack(publisher_id, sequence)
                if rng.random() < 0.05:
                    result = publication.try_claim(len(data) + 16, claim)
                    if result > 0:
                        claim.buffer[:len(data)] = data
                        time.sleep(0.001)  # a kill may land here: the claim stays open
                        claim.commit()
                else:
                    result = publication.offer(data + bytes(16))
                if result > 0:
                    sequence += 1
                    accepted.value = sequence
                elif result == CLOSED:
                    break  # the driver is gone: reconnect
                else:
                    time.sleep(0.0002)
        except DriverNotRunningError:
            pass
        except Exception:  # the driver died mid-command
            time.sleep(0.05)
        finally:
            with contextlib.suppress(Exception):
                client.close()


def _subscriber(directory: str, stream_id: int, slot: Any, stop: Any) -> None:
    last: dict[tuple[int, int], int] = {}  # (session, publisher) -> last sequence

    def on_message(data: memoryview, header: Any) -> None:
        publisher_id, sequence = _MESSAGE.unpack_from(data)
        key = (header.session_id, publisher_id)
        before = last.get(key)
        # A subscriber joins a session mid-stream: its first message may be any number.
        if before is not None and sequence != before + 1:
            slot[1] += 1
        last[key] = sequence
        slot[0] += 1

    while not stop.value:
        client = _connect(directory, stop)
        if client is None:
            return
        last.clear()  # a new driver: new sessions
        slot[2] += 1
        try:
            subscription = client.add_subscription("aeron:ipc", stream_id)
            while not stop.value:
                subscription.receive(on_message, 256, timeout=0.05)
        except DriverNotRunningError:
            pass
        except Exception:
            time.sleep(0.05)
        finally:
            with contextlib.suppress(Exception):
                client.close()


def _die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when the chaos loop dies (no orphans)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _run_target(target: Any, *args: Any) -> None:
    _die_with_parent()
    target(*args)


def run_chaos(seconds: float, *, publishers: int = 3, subscribers: int = 2, streams: int = 2,
              kill_interval: float = 0.5, driver_kill_interval: float = 10.0, seed: int = 1,
              settings: dict[str, Any] | None = None) -> ChaosReport:
    """Run the chaos (module docstring) for ``seconds`` and report."""
    # The children this module spawns import it too, and run no driver.
    from slipstream.daemon.driver import MediaDriver

    rng = random.Random(seed)
    context = multiprocessing.get_context("spawn")
    # A flag without a lock: a child SIGKILLed while holding an Event's lock would leave the
    # lock taken and every other process waiting on it for ever.
    stop = context.RawValue("b", 0)
    directory = Path("/dev/shm") / f"slipstream-chaos-{uuid.uuid4().hex[:8]}"
    shm_before = set(os.listdir("/dev/shm"))
    settings = {"client_liveness_timeout": "1s", "client_keepalive_interval": "100ms",
                "publication_unblock_timeout": "1500ms", "publication_linger_timeout": "200ms",
                "timer_interval": "100ms", "ipc_term_buffer_length": "64k",
                "driver_timeout": "1s", **(settings or {})}
    report = ChaosReport(seconds=seconds)
    accepted = [context.Value("q", 0, lock=False) for _ in range(10_000)]
    slots = [context.Array("q", _SLOT, lock=False) for _ in range(10_000)]
    next_publisher = next_subscriber = 0
    running: list[tuple[str, int, int, Any]] = []  # (kind, index, stream id, process)

    def start_publisher() -> None:
        nonlocal next_publisher
        index = next_publisher
        next_publisher += 1
        stream_id = 1 + index % streams
        process = context.Process(target=_run_target, args=(
            _publisher, str(directory), index, stream_id, accepted[index], stop), daemon=True)
        process.start()
        running.append(("publisher", index, stream_id, process))

    def start_subscriber(stream_id: int) -> None:
        nonlocal next_subscriber
        index = next_subscriber
        next_subscriber += 1
        process = context.Process(target=_run_target, args=(
            _subscriber, str(directory), stream_id, slots[index], stop), daemon=True)
        process.start()
        running.append(("subscriber", index, stream_id, process))

    def unblocked() -> int:
        with contextlib.suppress(OSError, ValueError):
            return read_system_counters(directory)[SystemCounter.UNBLOCKED_PUBLICATIONS]
        return 0

    def launch() -> Any:
        return MediaDriver.start(directory, {"dir": str(directory), **settings})

    driver = launch()
    started = time.monotonic()
    try:
        for stream in range(1, streams + 1):
            for _ in range(subscribers):
                start_subscriber(stream)
        for _ in range(publishers):
            start_publisher()
        next_kill = started + rng.expovariate(1 / kill_interval)
        next_driver_kill = started + driver_kill_interval
        while time.monotonic() - started < seconds:
            now = time.monotonic()
            if now >= next_driver_kill:
                report.unblocked += unblocked()
                driver.kill()  # SIGKILL: no clean-up
                report.driver_kills += 1
                driver = launch()
                next_driver_kill = now + driver_kill_interval
            elif now >= next_kill:
                kind, _, stream_id, process = running.pop(rng.randrange(len(running)))
                with contextlib.suppress(ProcessLookupError):  # it may have died on its own
                    os.kill(process.pid, signal.SIGKILL)
                process.join()
                if kind == "publisher":
                    report.publisher_kills += 1
                    start_publisher()
                else:
                    report.subscriber_kills += 1
                    start_subscriber(stream_id)
                next_kill = now + rng.expovariate(1 / kill_interval)
            time.sleep(0.01)
    finally:
        report.unblocked += unblocked()
        stop.value = 1
        for _, _, _, process in running:
            process.join(10)
            if process.is_alive():
                process.kill()
                process.join()
        driver.stop()
    report.seconds = time.monotonic() - started
    report.accepted = sum(v.value for v in accepted[:next_publisher])
    report.delivered = sum(s[0] for s in slots[:next_subscriber])
    report.sequence_errors = sum(s[1] for s in slots[:next_subscriber])
    if directory.exists():
        report.leaked.append(f"{directory} ({len(list(directory.rglob('*')))} entries)")
    for name in sorted(set(os.listdir("/dev/shm")) - shm_before):
        if name.startswith(("slipstream-chaos", "sem.mp-")):
            report.leaked.append(f"/dev/shm/{name}")
    return report

