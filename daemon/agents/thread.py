"""The threads that run the network agents (docs/ARCHITECTURE.md, Threads; Aeron's modes).

``threading_mode = "shared_network"`` (the default, for small machines): one thread runs the
receiver's and the sender's duty cycles together.  ``"dedicated"``: one thread each, for hosts
with cores to spare.  The conductor runs apart, on the driver's trio thread.

The loop is C (``ss_duty_loop_run``, without the GIL): duty cycles of the agents' C halves
(:mod:`slipstream.daemon.agents.agent`) while there is work; then it polls, yielding the CPU
between duty cycles (on a small machine the application it serves may need the core); after
``network_idle_spin`` ns without any work it parks in ``epoll`` on its sockets, its doorbell
socket and a wake-up eventfd, for at most the agents' next deadline.  Before it parks it asks
the clients to ring the doorbell: publishers when they append (the sender has new data),
subscribers when they reach the position where a status message is due.  So an idle driver
costs ~0 % CPU and still moves within one wake-up when traffic comes.  The loop comes back to
Python only when an agent's Python half is due, and goes on after it.  The conductor wakes a
thread with :meth:`NetworkThread.wake` after it hands over work.
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
from typing import Any, Final

from slipstream.client._native import lib as native
from slipstream.client.counters import CountersFile, SystemCounter
from slipstream.daemon._network import ffi as network_ffi
from slipstream.daemon._network import lib as network
from slipstream.daemon.agents.receiver import Receiver
from slipstream.daemon.agents.sender import Sender

log = logging.getLogger("slipstream.driver")

#: The longest park: a safety net (every timer is a deadline anyway).
MAX_PARK_S: Final = 1.0


def open_doorbell(path: str, mode: int = 0o600) -> socket.socket:
    """The driver's end of a doorbell: a non-blocking unix datagram socket bound at ``path``
    with ``mode`` (:func:`control.file_mode`: clients ring it, so they write it)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.setblocking(False)
    sock.bind(path)
    os.chmod(path, mode)
    return sock


def new_duty_loop(agents: Sequence[Sender | Receiver], counters: CountersFile, *,
                  count_busy: bool = True) -> tuple[Any, Any]:
    """The C loop's state (``ss_duty_loop_t``) over ``agents``' C halves, counting in
    ``counters`` its duty cycles, those that did work and (``count_busy``) the time they
    took, the pressure governor's busy ratio; and the array of agents it points at, to keep
    alive with it.  No epoll and no doorbells: :class:`NetworkThread` adds them to park; an
    embedded driver runs ``ss_duty_loop_once`` and never parks."""
    c = network_ffi.new("ss_duty_loop_t *")
    agents_c = network_ffi.new("ss_agent_t *[]", [a.c for a in agents])
    c.agents = agents_c
    c.agent_count = len(agents)
    c.epoll_fd = c.wake_fd = -1
    c.last_cycle_ns = c.last_work_ns = time.monotonic_ns()
    c.cycles = counters.address(SystemCounter.NETWORK_DUTY_CYCLES)
    c.work_cycles = counters.address(SystemCounter.NETWORK_WORK_CYCLES)
    c.busy_ns = (counters.address(SystemCounter.NETWORK_BUSY_NS) if count_busy
                 else network_ffi.NULL)
    c.endpoint_reads = counters.address(SystemCounter.NETWORK_ENDPOINT_READS)
    return c, agents_c


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
        self._wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._epoll = select.epoll()
        self._epoll.register(self._wake_fd, select.EPOLLIN)
        for doorbell in self.doorbells:
            self._epoll.register(doorbell.fileno(), select.EPOLLIN)
        self._registered: dict[object, int] = {}  # id(transport) (or a socket of one) -> fd
        #: Each endpoint's sockets as _sync_sockets last found them, by id(endpoint), and
        #: whether they may change (a multi-destination subscription's).
        self._endpoint_sockets: dict[int, tuple[object, dict[object, int], bool]] = {}
        #: The endpoints whose sockets _sync_sockets has yet to register or unregister, and
        #: those whose sockets may change, which it looks at every call (by id).
        self._pending_endpoints: dict[int, object] = {}
        self._changing_endpoints: dict[int, object] = {}
        for agent in self.agents:
            self._pending_endpoints.update(agent.track_endpoint_changes())
        self._told_unregistered = False  # the warning that epoll refused a socket, once
        self._poll_events: Any = None  # the loop's poll array (ss_duty_loop_t.poll_events)
        #: The C loop (ss_duty_loop_t): its agents' C halves, the idle strategy and the park.
        c, self._agents_c = new_duty_loop(self.agents, counters)
        self.c = c
        self._doorbell_fds = network_ffi.new("int32_t[]", [d.fileno() for d in doorbells] or 1)
        c.epoll_fd = self._epoll.fileno()
        c.wake_fd = self._wake_fd
        c.doorbell_fds = self._doorbell_fds
        c.doorbell_count = len(self.doorbells)
        c.idle_spin_ns = idle_spin_ns
        c.max_park_ns = int(max_park_s * 1e9)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._next_failure_log_ns = 0
        self._failing_since_ns: int | None = None

    @property
    def last_cycle_ns(self) -> int:
        """When the loop last began a duty cycle (monotonic ns): the systemd watchdog's
        evidence that this thread is not stuck (it cycles at least every max_park_s).  While
        the Python half keeps failing, the loop is stuck however fast its C half cycles."""
        if self._failing_since_ns is not None:
            return self._failing_since_ns
        return self.c.last_cycle_ns

    @property
    def parks(self) -> int:
        return self.c.parks

    @property
    def lag(self) -> tuple[int, int]:
        """How late this thread's timed wake-ups come, smoothed, ns, and when it last woke on
        its timer, monotonic ns (words the thread writes: a sample's worth)."""
        c = self.c
        return c.lag_ns, c.lag_sampled_ns

    def start(self) -> None:
        self._thread.start()

    def wake(self) -> None:
        """Make the thread run a duty cycle soon (any thread)."""
        with contextlib.suppress(OSError):
            os.eventfd_write(self._wake_fd, 1)

    def stop(self, timeout: float = 5.0) -> None:
        self.c.stopping = 1
        self.wake()
        if self._thread.is_alive():
            self._thread.join(timeout)
        if self._thread.is_alive():  # stuck: its descriptors stay open (their numbers could
            log.error("%s did not stop within %.1f s", self.name, timeout)  # be reused)
            return
        self._epoll.close()
        os.close(self._wake_fd)

    # -- the loop ---------------------------------------------------------------------------
    def _run(self) -> None:
        native.ss_name_thread(self.name.encode())
        c = self.c
        agents = self.agents
        now = time.monotonic_ns()
        for agent in agents:  # the C halves start from a current view
            agent.c.due = network.SS_DUE_TIMER
        commands_seen = -1
        while True:
            try:
                work = 0
                for agent in agents:
                    if agent.c.due:
                        work += agent.do_python_work(now)
                self.counters.add(SystemCounter.NETWORK_PYTHON_PASSES)
                # The endpoints and their sockets change by the agents' commands alone: the
                # endpoints added or removed have their sockets registered or unregistered
                # after one that may have changed them, and until epoll took them all.
                member_commands = sum(agent.member_commands for agent in agents)
                if member_commands != commands_seen and self._sync_sockets():
                    commands_seen = member_commands
                self._failing_since_ns = None
                if work:  # else the loop parks once its own half has been idle long enough
                    c.last_work_ns = now
            except Exception:  # a bug, or epoll out of room: counted and logged; never a
                # silent end of the thread that moves the data
                self.counters.add(SystemCounter.ERRORS)
                if self._failing_since_ns is None:
                    self._failing_since_ns = now
                if now >= self._next_failure_log_ns:  # every failure counted, one logged a second
                    self._next_failure_log_ns = now + 1_000_000_000
                    log.exception("%s: a duty cycle failed", self.name)
                time.sleep(0.001)  # never a hot loop of failures
            due = network.ss_duty_loop_run(c)  # without the GIL until Python is due
            if due & network.SS_DUE_STOP:
                return
            now = c.now_ns

    def _sync_sockets(self) -> bool:
        """Register with epoll the sockets of the endpoints the agents added since the last
        call, and unregister those of the endpoints they removed (they come and go by the
        conductor's commands, run on this thread); a multi-destination subscription's, whose
        destinations come and go, are looked at every call.  Adding a stream costs no look
        at every endpoint.  False when epoll refused one: the loop reads every socket
        meanwhile, and the next call tries again."""
        pending = self._pending_endpoints
        for agent in self.agents:
            pending.update(agent.take_endpoint_changes())
        known, changing = self._endpoint_sockets, self._changing_endpoints
        for key, endpoint in changing.items():
            pending.setdefault(key, endpoint)
        if not pending:
            return True
        registered = self._registered
        unregister: dict[object, int] = {}
        # Each endpoint's sockets as they are to be (None: it is gone).
        wanted: dict[int, tuple[object, dict[object, int], bool] | None] = {}
        for key, endpoint in pending.items():
            entry = known.get(key)
            sockets: dict[object, int] = {}
            wanted[key] = None
            if any(agent.serves(endpoint) for agent in self.agents):
                sockets, may_change = _sockets_of(endpoint.transport)  # type: ignore[attr-defined]
                wanted[key] = (endpoint, sockets, may_change)
            if entry is not None:
                unregister.update((k, fd) for k, fd in entry[1].items() if sockets.get(k) != fd)
        # Room for every registered descriptor's event in the loop's poll (ss_duty_loop_t),
        # and one more: a poll that fills the array reads every socket.
        capacity = (len(registered) + sum(len(w[1]) for w in wanted.values() if w is not None)
                    + len(self.doorbells) + 2)
        if capacity > self.c.poll_capacity:
            capacity *= 2
            self._poll_events = network_ffi.new("uint8_t[]",
                                                capacity * network.ss_epoll_event_size())
            self.c.poll_events, self.c.poll_capacity = self._poll_events, capacity
        for key, fd in unregister.items():  # first: a descriptor may be reused below
            if registered.get(key) == fd:
                del registered[key]
            with contextlib.suppress(OSError, ValueError):
                self._epoll.unregister(fd)
        unregistered: OSError | None = None
        for key, entry in wanted.items():
            known.pop(key, None)
            changing.pop(key, None)
            if entry is None:
                continue
            endpoint, sockets, may_change = entry
            for socket_key, fd in sockets.items():
                if registered.get(socket_key) == fd:
                    continue
                try:
                    self._epoll.register(fd, select.EPOLLIN)
                except FileExistsError:
                    pass
                except OSError as e:  # ENOSPC (max_user_watches), ENOMEM
                    unregistered = e
                    continue
                registered[socket_key] = fd
            # What epoll took of them: the next call registers the rest.
            known[key] = (endpoint, {k: fd for k, fd in sockets.items()
                                     if registered.get(k) == fd}, may_change)
            if may_change:
                changing[key] = endpoint
        if unregistered is not None:
            # A socket epoll does not watch would never be marked readable: without the
            # poll's array the loop reads every socket each cycle, as below
            # SS_POLL_ENDPOINTS_MIN endpoints, and the next call registers them again.
            self._poll_events = None
            self.c.poll_events, self.c.poll_capacity = network_ffi.NULL, 0
            if not self._told_unregistered:
                self._told_unregistered = True
                log.warning("epoll refused a socket (%s): the network thread reads every "
                            "socket each cycle until it takes them all", unregistered)
            # Those not taken whole are looked at again by the next call.
            for key in [k for k, w in wanted.items()
                        if w is None or len(known[k][1]) == len(w[1])]:
                del pending[key]
            return False
        pending.clear()
        return True


def _sockets_of(transport: object) -> tuple[dict[object, int], bool]:
    """An endpoint transport's sockets (see NetworkThread._sync_sockets), and whether they
    may change (a multi-destination subscription's)."""
    sockets: dict[object, int] = {}
    fd = getattr(transport, "fd", None)
    if fd is not None:
        sockets[id(transport)] = fd
    fds = getattr(transport, "fds", None)
    if fds is None:
        return sockets, False
    generation = getattr(transport, "generation", None)
    for fd in fds:
        sockets[(id(transport), generation, fd)] = fd
    return sockets, True
