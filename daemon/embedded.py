"""A driver inside the application's process, in invoker mode (:class:`EmbeddedDriver`,
made by :meth:`MediaDriver.embedded`): the same core as a driver process's
(:class:`~slipstream.daemon.core._DriverCore`), with no thread of its own; the application's
calls to :meth:`EmbeddedDriver.do_work` run it."""

from __future__ import annotations

import atexit
import contextvars
import functools
import logging
import os
import select
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq

from slipstream.client import control
from slipstream.client._native import lib
from slipstream.client.counters import SystemCounter
from slipstream.client.errors import ClosedError, UsageError
from slipstream.daemon._network import lib as network_lib
from slipstream.daemon.agents.thread import new_duty_loop
from slipstream.daemon.conductor.image_logs import LogMaking
from slipstream.daemon.config import DriverSettings
from slipstream.daemon.core import ACTIVE_CYCLE_S, ConductorPacing, _DriverCore
from slipstream.daemon.reports.error_log import ErrorLogHandler

log = logging.getLogger("slipstream.driver")

#: How often an embedded driver's duty cycle looks for commands, ns (a poll of zmq's FD, a
#: µs; a command's answer may wait this long).
COMMAND_CHECK_NS = 1_000_000
#: How often it asks zmq itself (a few µs), whatever the FD says: a safety net, as the
#: daemon's duty cycle asks on each of its cycles.
COMMAND_SAFETY_CHECK_NS = 100_000_000
#: How long a closing embedded driver's drain sleeps after a cycle that did nothing, s.
DRAIN_IDLE_S = 0.0002
#: The embedded driver whose Python work runs in this thread now: its error log takes only
#: the records logged meanwhile (two embedded drivers of one process share the logger).
_running_embedded: contextvars.ContextVar[EmbeddedDriver | None] = contextvars.ContextVar(
    "slipstream_running_embedded", default=None)


class EmbeddedDriver(_DriverCore):
    """A driver inside the application's process in invoker mode (Aeron's embedded media
    driver with ``ThreadingMode.INVOKER``): it has no thread of its own; its conductor and
    network agents work when the application calls :meth:`do_work`, which a client connected
    with ``Client.connect(driver.directory, invoker=driver.do_work)`` also calls while it
    waits (a command's answer, ``receive``) and from ``client.do_work()``.  So a message
    crosses only the kernel's UDP path between two such applications.

    It is a whole driver: the same directory, counters, conductor, agents and wire protocol as
    the daemon's, and other processes of the host may attach to its directory, as long as the
    application keeps calling :meth:`do_work` (its heartbeat stops otherwise, and they time
    it out).  Host names in a channel are resolved on threads the driver starts: a command
    that names one waits for the answer while the calls serve every other.  Make it with
    :meth:`MediaDriver.embedded`; :meth:`close` removes what it made (a normal exit of the
    process that made it does too, if the application did not).
    """

    def __init__(self, settings: DriverSettings) -> None:
        super().__init__(settings)
        self.driver_directory.acquire()
        self._conductor_due = True
        self._next_conductor_ns = 0
        self._conductor_pacing = ConductorPacing()
        #: Between cycles paced apart (idle), the conductor is a driver waiter as the daemon's
        #: parked conductor is: a back-pressured publisher then bumps the driver signal, and
        #: the next call runs the conductor.  The signal's value when it began waiting.
        self._conductor_waiting = False
        self._signal_seen = 0
        self._driver_signal: Any = None
        self._next_command_check_ns = 0
        self._next_command_safety_check_ns = 0
        self._command_poll = select.poll()
        self._conductor_deadline_ns = 0  # its next_deadline_ns() when it last ran
        #: When the Python side is next due without news (0: at the next call): the command
        #: check, the conductor's cycle and its deadline, whichever is first.
        self._python_due_ns = 0
        self._next_failure_log_ns = 0
        #: Held by the thread in a duty cycle or in close().  Reentrant only so that its
        #: owner can be known (``_is_owned``): see :meth:`_take_back_interrupted_hold`.
        self._working = threading.RLock()
        self._in_cycle = False  # written by the holder of _working only
        self._closed = False
        self._at_exit: Callable[[], None] | None = None
        self._error_log: ErrorLogHandler | None = None
        self._loop: Any = None  # the C duty loop, once made
        try:
            # No thread of its own: image logs are made one per conductor cycle.
            network = self._open(wake_network=lambda: None, wake_conductor=self._post,
                                 image_logs=LogMaking.DEFERRED)
            self._agents = (network.receiver, network.sender)
            # The application runs these cycles, as often and as densely as its loop calls:
            # the time they take says how busy the application is, not whether the driver
            # keeps up, so the pressure governor's busy ratio leaves them out.
            self._loop, self._loop_agents = new_duty_loop(self._agents, self.counters,
                                                          count_busy=False)
            self._driver_signal = self.counters.driver_signal
            self._bind_commands()
            # zmq's FD turns readable when the socket's events may have changed (a command
            # came); every send is followed by a full look (_process_commands), which keeps
            # an edge a send consumed from going unseen.
            self._command_poll.register(self.sock.getsockopt(zmq.FD), select.POLLIN)
            # The driver's own log only: the application's clients log under
            # slipstream.client, which is not the driver's to report.
            self._error_log = ErrorLogHandler(
                self.driver_directory.path, self.driver_directory.file_mode(clients_write=False))
            self._error_log.addFilter(lambda _record: _running_embedded.get() is self)
            logging.getLogger("slipstream.driver").addHandler(self._error_log)
            self._start_metrics()
            self.do_work()  # the heartbeat: clients may connect from here on
        except BaseException:
            self.close()
            raise
        # An application that forgets close() (or ends on an exception outside a with block)
        # still leaves no directory behind at a normal exit.
        self._at_exit = functools.partial(_close_at_exit, self, os.getpid())
        atexit.register(self._at_exit)

    @property
    def directory(self) -> Path:
        """The driver directory, for ``Client.connect`` (here or in another process)."""
        return self.driver_directory.path

    def _post(self) -> None:
        """The agents posted events for the conductor: its duty cycle runs at the next call."""
        self._conductor_due = True
        self._python_due_ns = 0

    def do_work(self) -> int:
        """One duty cycle of the driver: both network agents' C halves (one C call, without
        the GIL), their Python halves when due, the commands waiting (looked for every
        millisecond) and the conductor's duty cycle when there is news for it or when it is due
        (:class:`ConductorPacing`, as the daemon's).  Returns the work done (0: idle).  Safe
        from any thread; a call while another thread is inside returns 0, and so does one
        after :meth:`close` (a client's wait may still run it: its clients were told), and so
        does one made from inside a cycle."""
        working = self._working
        if working._is_owned() and not self._take_back_interrupted_hold():
            return 0
        acquired = False
        try:
            acquired = working.acquire(blocking=False)
            if not acquired:
                return 0
            self._in_cycle = True
            return 0 if self._closed else self._cycle()
        finally:
            if acquired:
                self._in_cycle = False  # first: a store has no signal check, a call has
                working.release()

    def _take_back_interrupted_hold(self) -> bool:
        """With ``_working`` held by this thread: True (and released) when no cycle or close
        holds it, that is an interrupt (KeyboardInterrupt from Ctrl-C, any exception a signal
        handler raises, which Python runs after a call returns) came between an acquire and
        the store that records it, or between a release's last store and the release; False
        when this call comes from inside the thread's own cycle.  Without this, one unlucky
        Ctrl-C left every later do_work() idle and close() waiting forever.  (A hold an
        interrupt left in another thread only that thread can take back.)"""
        if self._in_cycle:
            return False
        self._working.release()
        return True

    def _cycle(self) -> int:
        """:meth:`do_work`'s cycle, with ``_working`` held."""
        loop = self._loop
        work = network_lib.ss_duty_loop_once(loop)
        now = loop.now_ns
        # A publisher refused while the paced conductor waits: limits to move.
        refused = self._conductor_waiting and lib.ss_load_acquire_i32(
            self._driver_signal) != self._signal_seen
        if loop.due or refused or now >= self._python_due_ns:
            running = _running_embedded.set(self)
            try:
                work += self._python_cycle(now, loop.due, refused)
            except Exception:  # as the daemon's threads: counted, logged once a second,
                # and never raised into the application's call that ran the driver
                self.counters.add(SystemCounter.ERRORS)
                if now >= self._next_failure_log_ns:
                    self._next_failure_log_ns = now + 1_000_000_000
                    log.exception("the embedded driver's duty cycle failed")
                self._conductor_due = True
                self._python_due_ns = 0
            finally:
                _running_embedded.reset(running)
        return work

    def _python_cycle(self, now: int, due: int, refused: bool) -> int:
        """What of the duty cycle is Python: the agents' Python halves that are due (``due``:
        the C cycle's SS_DUE_* bits), the commands, the conductor (due at once when a
        publisher was ``refused``)."""
        work = 0
        counters = self.counters
        if refused:
            self._conductor_due = True
        if due:
            for agent in self._agents:
                if agent.c.due:
                    work += agent.do_python_work(now)
            counters.add(SystemCounter.NETWORK_PYTHON_PASSES)
        if now >= self._next_command_check_ns:  # commands are rare: look every ms
            self._next_command_check_ns = now + COMMAND_CHECK_NS
            if self._command_poll.poll(0) or now >= self._next_command_safety_check_ns:
                self._next_command_safety_check_ns = now + COMMAND_SAFETY_CHECK_NS
                work += self._process_commands()
        conductor = self.conductor
        work += self._take_names()  # the resolver's answers, and commands waiting too long
        if (self._conductor_due or now >= self._next_conductor_ns
                or now >= self._conductor_deadline_ns):
            self._conductor_due = False
            # Before the cycle: a refusal while it runs is news for the next one.
            self._signal_seen = lib.ss_load_acquire_i32(self._driver_signal)
            started = time.monotonic_ns()
            conductor_work = self._conductor_cycle(started)
            self._record_cycle_time(time.monotonic_ns() - started)
            delay = self._conductor_pacing.delay_s(conductor_work)
            # The heartbeat is this cycle's: as the daemon's, an idle conductor still beats
            # four times within driver_timeout, or attached processes deem the driver dead.
            self._next_conductor_ns = now + min(int(delay * 1e9),
                                                self.settings.driver_timeout // 4)
            self._wait_for_signal(delay > ACTIVE_CYCLE_S)
            # Its deadline moves only when it runs (or a command ran: it is due then).
            self._conductor_deadline_ns = conductor.next_deadline_ns()
            work += conductor_work
        if any(agent.c.commands for agent in self._agents):
            # What the commands and the conductor handed the agents (an image to add, a
            # publication to send) is done in this call, and what it sends goes out: an
            # application that stops calling once its client sees an image has still sent
            # that image's first SM (a peer would otherwise wait for its next call).
            # At the time now, not the call's start: what the conductor made is due from
            # its own clock (a publication's first SETUP, an image's first SM).
            handed_ns = time.monotonic_ns()
            for agent in self._agents:
                if agent.c.commands:
                    work += agent.do_python_work(handed_ns)
            work += network_lib.ss_duty_loop_once(self._loop)
        self._python_due_ns = 0 if self._conductor_due else min(
            self._next_command_check_ns, self._next_conductor_ns, self._conductor_deadline_ns)
        return work

    def _commands_handled(self) -> None:
        # Here or after a send of the conductor's cycle: resources changed.
        self._conductor_due = True
        self._python_due_ns = 0

    def _wait_for_signal(self, waiting: bool) -> None:
        """Be a driver waiter (``waiting``) or not (publishers refused bump the driver signal
        only while it has waiters)."""
        if waiting != self._conductor_waiting:
            lib.ss_get_and_add_i32(self.counters.driver_waiters, 1 if waiting else -1)
            self._conductor_waiting = waiting

    def close(self, *, timeout: float | None = None) -> None:
        """Drain (:meth:`_drain`: up to ``drain_timeout``, and with ``timeout`` at most that
        long), tell the clients the driver goes, free everything, remove what it made.  Waits
        for a :meth:`do_work` another thread is in; with ``timeout`` (seconds) at most that
        long, and then leaves everything as it is."""
        started_ns = time.monotonic_ns()
        timeout = control.check_timeout("timeout", timeout)
        working = self._working
        if working._is_owned() and not self._take_back_interrupted_hold():
            raise UsageError("close() was called from inside the embedded driver's duty cycle")
        if not working.acquire(timeout=-1 if timeout is None else timeout):
            log.warning("the embedded driver in %s was busy for %.1f s: not closed",
                        self.directory, timeout)
            return
        try:
            self._in_cycle = True  # a do_work() from what close() runs is a reentrant call
            running = _running_embedded.set(self)
            try:
                self._close_held(started_ns, timeout)
            finally:
                _running_embedded.reset(running)
        finally:
            self._in_cycle = False  # first: a store has no signal check, a call has
            working.release()

    def _close_held(self, started_ns: int, timeout: float | None) -> None:
        """:meth:`close`'s work, with ``_working`` held."""
        if self._closed:
            return
        self._closed = True
        if self._at_exit is not None:
            atexit.unregister(self._at_exit)
        interrupted: BaseException | None = None
        try:
            if "conductor" in self._opened and self._loop is not None:
                limit_ns = self.settings.drain_timeout
                if timeout is not None:
                    limit_ns = min(limit_ns, started_ns + int(timeout * 1e9)
                                   - time.monotonic_ns())
                try:
                    self._drain(limit_ns)
                except KeyboardInterrupt as e:  # the clients are still told, then it goes
                    log.warning("interrupted while draining: closing at once")
                    interrupted = e
            if self._conductor_waiting:
                self._wait_for_signal(False)
            if "conductor" in self._opened:
                self._send(self.conductor.shutdown_events())
                self._told_clients = True
        finally:
            self._stop_metrics()
            self._close()
            if self._error_log is not None:
                logging.getLogger("slipstream.driver").removeHandler(self._error_log)
                self._error_log.close()
            self.driver_directory.release()
        if interrupted is not None:
            raise interrupted

    def _drain(self, timeout_ns: int) -> None:
        """Before it closes, as the daemon at its first SIGTERM: no new credit; what its logs
        hold is sent and taken by their subscribers, then the streams end; for at most
        ``timeout_ns`` (0 or less: not at all).  Closing used to drop what offer() had
        accepted but not yet sent.  The subscribers of this process (IPC ones, and this
        driver's own UDP receivers) are not waited for: the application that would read them
        is the one closing.  Those of other processes that attached are."""
        if timeout_ns <= 0:
            return
        started = time.monotonic_ns()
        self.conductor.begin_drain(started)
        while True:
            now = time.monotonic_ns()
            if self.conductor.drain(now, closing_process=control.process_token()):
                log.info("drained in %.2f s", (now - started) / 1e9)
                return
            if now - started >= timeout_ns:
                log.warning("drain_timeout passed before the receivers took everything: "
                            "closing anyway")
                return
            self._conductor_due = True  # the drain's progress is the conductor's to see
            if not self._cycle():
                time.sleep(DRAIN_IDLE_S)

    def __enter__(self) -> EmbeddedDriver:
        if self._closed:
            raise ClosedError(f"the embedded driver in {self.directory} is closed")
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def _close_at_exit(driver: EmbeddedDriver, pid: int) -> None:
    """atexit: close an embedded driver its application left open, in the process that made
    it only (a forked child that exits must not tear down its parent's driver), and without
    waiting long for a do_work that an interrupt left holding its lock."""
    if os.getpid() == pid:
        driver.close(timeout=2.0)
