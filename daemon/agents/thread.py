"""The threads that run the network agents (docs/ARCHITECTURE.md, Threads; Aeron's modes).

``threading_mode = "shared_network"`` (the default, for small machines): one thread runs the
receiver's and the sender's duty cycles together.  ``"dedicated"``: one thread each, for hosts
with cores to spare.  The conductor runs apart, on the driver's trio thread.

A thread works while there is work; then it polls, yielding the CPU between duty cycles (on a
small machine the application it serves may need the core); after ``network_idle_spin`` ns
without any work it parks in
``epoll`` on its sockets, its doorbell socket and a wake-up eventfd, for at most the agents'
next deadline.  Before it parks each agent asks the clients to ring the doorbell
(``prepare_to_park``): publishers when they append (the sender has new data), subscribers when
they reach the position where a status message is due.  So an idle driver costs ~0 % CPU and
still moves within one wake-up when traffic comes.  The conductor wakes a thread with
:meth:`NetworkThread.wake` after it hands over work.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import socket
import threading
import time
from collections.abc import Sequence
from typing import Final

from slipstream.client.counters import CountersFile, SystemCounter
from slipstream.daemon.agents.receiver import Receiver
from slipstream.daemon.agents.sender import Sender

log = logging.getLogger("slipstream.driver")

#: The longest park: a safety net (every timer is a deadline anyway).
MAX_PARK_S: Final = 1.0


def open_doorbell(path: str) -> socket.socket:
    """The driver's end of a doorbell: a non-blocking unix datagram socket bound at ``path``
    (mode 0600 by the umask of the 0700 driver directory)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.setblocking(False)
    sock.bind(path)
    os.chmod(path, 0o600)
    return sock


class NetworkThread:
    """One thread running ``agents`` (see the module docstring)."""

    def __init__(self, name: str, agents: Sequence[Sender | Receiver],
                 doorbells: Sequence[socket.socket], counters: CountersFile,
                 idle_spin_ns: int, max_park_s: float = MAX_PARK_S) -> None:
        """``max_park_s``: the longest park (shorter under a systemd watchdog)."""
        self.name = name
        self.agents = list(agents)
        self.doorbells = list(doorbells)
        self.counters = counters
        self.idle_spin_ns = idle_spin_ns
        self.max_park_s = max_park_s
        self._wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._epoll = select.epoll()
        self._epoll.register(self._wake_fd, select.EPOLLIN)
        for doorbell in self.doorbells:
            self._epoll.register(doorbell.fileno(), select.EPOLLIN)
        self._registered: dict[int, int] = {}  # id(transport) -> fd
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.cycles = 0
        self.parks = 0
        #: When the loop last began a duty cycle (monotonic ns): the systemd watchdog's
        #: evidence that this thread is not stuck (it cycles at least every max_park_s).
        self.last_cycle_ns = time.monotonic_ns()
        self._next_failure_log_ns = 0

    def start(self) -> None:
        self._thread.start()

    def wake(self) -> None:
        """Make the thread run a duty cycle soon (any thread)."""
        with contextlib.suppress(OSError):
            os.eventfd_write(self._wake_fd, 1)

    def stop(self, timeout: float = 5.0) -> None:
        self._stopping = True
        self.wake()
        if self._thread.is_alive():
            self._thread.join(timeout)
        self._epoll.close()
        os.close(self._wake_fd)

    # -- the loop ---------------------------------------------------------------------------
    def _run(self) -> None:
        agents = self.agents
        last_work_ns = time.monotonic_ns()
        while not self._stopping:
            now = time.monotonic_ns()
            try:
                work = 0
                for agent in agents:
                    work += agent.do_work(now)
                self.last_cycle_ns = now  # only a cycle that worked: a failing loop is stuck
                self.cycles += 1
                if work:
                    last_work_ns = now
                elif now - last_work_ns >= self.idle_spin_ns:
                    self._park(now)
                    # Woken with nothing to do (a timer, a stray ring): park again at once.
                    last_work_ns = -(1 << 62)
                else:
                    # Aeron's backoff between spinning and parking: another thread of this
                    # host (an application, the other driver) may need the core more.
                    os.sched_yield()
            except Exception:  # a bug, or epoll out of room: counted and logged; never a
                # silent end of the thread that moves the data
                self.counters.add(SystemCounter.ERRORS)
                if now >= self._next_failure_log_ns:  # every failure counted, one logged a second
                    self._next_failure_log_ns = now + 1_000_000_000
                    log.exception("%s: a duty cycle failed", self.name)
                time.sleep(0.001)  # never a hot loop of failures

    def _park(self, now_ns: int) -> None:
        self._sync_sockets()
        try:
            may_park = True
            for agent in self.agents:
                may_park &= agent.prepare_to_park()
            if not may_park:
                return
            deadline = min(agent.next_deadline_ns() for agent in self.agents)
            timeout = min(max(0, deadline - time.monotonic_ns()) / 1e9, self.max_park_s)
            if timeout <= 0:
                return
            self.parks += 1
            events = self._epoll.poll(timeout)
        finally:
            for agent in self.agents:
                agent.unpark()
        for fd, _ in events:
            if fd == self._wake_fd:
                with contextlib.suppress(BlockingIOError):
                    os.eventfd_read(self._wake_fd)
        for doorbell in self.doorbells:  # ringing is a wake-up, not a message: drain it
            with contextlib.suppress(BlockingIOError, OSError):
                while doorbell.recv(64):
                    pass

    def _sync_sockets(self) -> None:
        """Register the sockets of the agents' current endpoints with epoll (they come and go
        by the conductor's commands, run on this thread)."""
        wanted: dict[int, int] = {}
        for agent in self.agents:
            for endpoint in agent.endpoints:
                fd = getattr(endpoint.transport, "fd", None)
                if fd is not None:
                    wanted[id(endpoint.transport)] = fd
        if wanted == self._registered:
            return
        for key, fd in self._registered.items():
            if wanted.get(key) != fd:
                with contextlib.suppress(OSError, ValueError):
                    self._epoll.unregister(fd)
        for key, fd in wanted.items():
            if self._registered.get(key) != fd:
                with contextlib.suppress(FileExistsError):
                    self._epoll.register(fd, select.EPOLLIN)
        self._registered = wanted
