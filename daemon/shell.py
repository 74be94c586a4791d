"""The media driver process: a thin trio shell around the conductor.

Tasks: the command loop (zmq ROUTER → conductor → replies), the duty cycle (limits, cleaning,
liveness, the network agents' events), a signal watcher (the first SIGINT, SIGTERM or SIGHUP
drains, :meth:`DriverConductor.begin_drain`, for at most ``drain_timeout``; the second stops) and
a futex watcher thread that turns a client's wake-up into a trio wake-up.  The network agents
run on their own thread(s) (:mod:`slipstream.daemon.agents.thread`), over UDP sockets
(:mod:`slipstream.daemon.media.udp`).  Under systemd the duty cycle also sends the notify
protocol's states and watchdog pings (:mod:`slipstream.daemon.ops.systemd`).

Idling: while positions move the duty cycle runs every millisecond; with nothing to do it backs
off to ``IDLE_PARK_MAX_S`` (bounded by the next timer) and parks, registered as a waiter on the
driver eventcount in the counters file.  A publisher that meets its limit signals that
eventcount, so a parked driver still raises limits within a wake-up (~50-100 µs) and an idle
driver costs ~0 % CPU.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import stat
import sys
import threading
import time
from typing import Any

import trio
import zmq

from slipstream.client._native import lib
from slipstream.client.counters import SystemCounter
from slipstream.client.errors import DriverError
from slipstream.daemon.agents.thread import MAX_PARK_S, NetworkThread
from slipstream.daemon.conductor.image_logs import LogMaking
from slipstream.daemon.config import DriverSettings
from slipstream.daemon.core import ACTIVE_CYCLE_S, ConductorPacing, _DriverCore
from slipstream.daemon.ops.systemd import Notifier, Watchdog, park_bound_s, watchdog_interval_ns
from slipstream.daemon.pressure.governor import recent_lag_ns
from slipstream.daemon.reports.error_log import ErrorLogHandler

log = logging.getLogger("slipstream.driver")


class _DriverShell(_DriverCore):
    """Runs the conductor under trio; see the module docstring."""

    def __init__(self, settings: DriverSettings, *, stop_when_stdin_closes: bool = False
                 ) -> None:
        super().__init__(settings)
        self._stop_when_stdin_closes = stop_when_stdin_closes
        self._wake = trio.Event()
        self._stopping = False
        self.notifier = Notifier()
        self.watchdog: Watchdog | None = None
        self._status = ""
        self._next_status_ns = 0
        self._drain_deadline_ns: int | None = None  # set by the first SIGTERM
        self._cancel_scope = trio.CancelScope()

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        self.driver_directory.acquire()
        try:
            await self._serve(task_status)
        finally:
            self.driver_directory.release()  # once more if the start failed; it is idempotent

    async def _serve(self, task_status: Any) -> None:
        token = trio.lowlevel.current_trio_token()
        threads: list[NetworkThread] = []
        network = self._open(wake_network=lambda: [thread.wake() for thread in threads],
                             wake_conductor=lambda: self._wake_from_thread(token),
                             image_logs=LogMaking.THREADED)
        counters, doorbells = self.counters, self.doorbells
        spin = self.settings.network_idle_spin
        interval_ns = watchdog_interval_ns()
        park = park_bound_s(interval_ns, MAX_PARK_S)
        if self.settings.threading_mode == "dedicated":
            threads += [NetworkThread("slipstream-sender", [network.sender], doorbells[:1],
                                      counters, spin, park),
                        NetworkThread("slipstream-receiver", [network.receiver], doorbells[1:],
                                      counters, spin, park)]
        else:
            threads.append(NetworkThread("slipstream-network", [network.receiver,
                                                                network.sender],
                                         doorbells, counters, spin, park))
        if interval_ns is not None:
            self.watchdog = Watchdog(self.notifier, interval_ns,
                                     [lambda t=t: t.last_cycle_ns for t in threads])
        watcher: threading.Thread | None = None
        error_log = ErrorLogHandler(self.driver_directory.path,
                                    self.driver_directory.file_mode(clients_write=False))
        logging.getLogger("slipstream").addHandler(error_log)
        try:
            self._start_metrics()
            for thread in threads:
                thread.start()
            self._bind_commands()
            watcher = threading.Thread(target=self._watch_futex, args=(token,),
                                       name="slipstream-driver-futex", daemon=True)
            watcher.start()
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                # Signals first: the duty cycle's first heartbeat is what tells a launcher
                # (MediaDriver.start) that the driver is up, and a SIGTERM from then on must
                # drain it, not kill it with Python's default action.
                await nursery.start(self._watch_signals, nursery.cancel_scope)
                if self._stop_when_stdin_closes:
                    nursery.start_soon(self._watch_stdin)
                nursery.start_soon(self._command_loop)
                nursery.start_soon(self._duty_cycle, threads)
                if self.settings.debug_conductor_gil_hold:
                    nursery.start_soon(self._hold_the_gil, self.settings.debug_conductor_gil_hold)
                log.info("slipstream driver %d running in %s", os.getpid(),
                         self.driver_directory.path)
                self.notifier.notify("READY=1")
                task_status.started()
        finally:
            # Cleaning up: a third Ctrl-C or SIGTERM must not cut it short (the signal
            # receiver that took the first two is gone, and Python's defaults are back).
            ignored = _ignore_stop_signals()
            self._stopping = True
            counters.wake_driver()
            lib.ss_futex_wake(counters.driver_signal, 1 << 30)
            if watcher is not None:
                # The watcher waits without a timeout; bump the word so it returns now.
                lib.ss_get_and_add_i32(counters.driver_signal, 1)
                lib.ss_futex_wake(counters.driver_signal, 1 << 30)
                watcher.join(timeout=2)
            if self._drain_deadline_ns is None:
                self.notifier.notify("STOPPING=1")
            self.notifier.notify("STATUS=stopping")
            self._stop_metrics()
            for thread in threads:
                thread.stop()
            self._close()
            logging.getLogger("slipstream").removeHandler(error_log)
            error_log.close()
            self.driver_directory.release()
            self.notifier.close()
            _restore_signals(ignored)
            log.info("slipstream driver stopped")

    def _wake_from_thread(self, token: trio.lowlevel.TrioToken) -> None:
        """The network agents posted events: run a duty cycle soon (any thread)."""
        with contextlib.suppress(trio.RunFinishedError):
            token.run_sync_soon(self._set_wake)

    def _set_wake(self) -> None:
        self._wake.set()

    async def _watch_signals(self, cancel_scope: trio.CancelScope, *,
                             task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """The first SIGTERM/SIGINT/SIGHUP drains (``drain_timeout``; 0: stops at once), the
        second stops at once."""
        self._cancel_scope = cancel_scope
        timeout_ns = self.settings.drain_timeout
        with trio.open_signal_receiver(*_stop_signals()) as signals:
            task_status.started()
            async for signum in signals:
                name = signal.Signals(signum).name
                if self._drain_deadline_ns is not None or timeout_ns == 0:
                    log.info("received %s: stopping", name)
                    self._stop_now()
                    return
                log.info("received %s: draining for at most %.1f s (again: stop at once)",
                         name, timeout_ns / 1e9)
                self._begin_drain()

    def _begin_drain(self) -> None:
        """The first stop signal (or the end of standard input): drain for drain_timeout."""
        now_ns = time.monotonic_ns()
        self._drain_deadline_ns = now_ns + self.settings.drain_timeout
        self.conductor.begin_drain(now_ns)
        self.notifier.notify("STOPPING=1")
        self.notifier.notify("STATUS=draining: no new credit, sending what the logs hold")
        self._wake.set()

    async def _watch_stdin(self) -> None:
        """Once standard input (a pipe: :func:`run_driver` checks) ends, drain as at the
        first SIGTERM, unless a drain is under way already (it is not cut short): the process
        that started this driver (MediaDriver.launch) holds the pipe's other end, and its
        death, SIGKILL included, closes it.  What is written to it is read and ignored."""
        fd = sys.stdin.fileno()
        while True:
            await trio.lowlevel.wait_readable(fd)
            if os.read(fd, 4096):  # a pipe said readable: this does not block
                continue
            if self._drain_deadline_ns is not None:
                return
            if self.settings.drain_timeout == 0:
                log.warning("standard input ended: the process that started this driver is "
                            "gone; stopping")
                self._stop_now()
                return
            log.warning("standard input ended: the process that started this driver is gone; "
                        "draining for at most %.1f s", self.settings.drain_timeout / 1e9)
            self._begin_drain()
            return

    def _stop_now(self) -> None:
        """Tell every client the driver goes, then leave the nursery (the shell cleans up)."""
        self._send(self.conductor.shutdown_events())
        self._told_clients = True
        self._cancel_scope.cancel()

    def _watch_futex(self, token: trio.lowlevel.TrioToken) -> None:
        """Thread: block on the driver eventcount and wake trio when a client signals it."""
        lib.ss_name_thread(threading.current_thread().name.encode())
        signal_word = self.counters.driver_signal
        seen = lib.ss_load_acquire_i32(signal_word)
        while not self._stopping:
            lib.ss_futex_wait(signal_word, seen, -1)  # the stop bumps the word and wakes it
            current = lib.ss_load_acquire_i32(signal_word)
            if current != seen and not self._stopping:
                seen = current
                with contextlib.suppress(trio.RunFinishedError):
                    token.run_sync_soon(self._wake.set)

    def _commands_handled(self) -> None:
        self._wake.set()  # resources changed: let the duty cycle look at once

    def _names_deadline(self, deadline_s: float) -> None:
        self._nursery.start_soon(self._wake_at, deadline_s)

    async def _wake_at(self, deadline_s: float) -> None:
        """A duty cycle at ``deadline_s`` (monotonic): a command still waiting for its names
        is refused then (:meth:`_take_names`)."""
        await trio.sleep(max(0.0, deadline_s - time.monotonic()))
        self._wake.set()

    async def _command_loop(self) -> None:
        # No timer of its own: each duty cycle looks for commands too, and a cycle comes at
        # least every IDLE_PARK_MAX_S.
        fd = self.sock.getsockopt(zmq.FD)
        while True:
            self._process_commands()
            await trio.lowlevel.wait_readable(fd)

    def _tell_systemd(self, now_ns: int) -> None:
        """The watchdog ping, and a STATUS= line when what the driver serves changed (at
        most once a second)."""
        if self.watchdog is not None:
            self.watchdog.on_duty_cycle(now_ns)
        if self.notifier.enabled and now_ns >= self._next_status_ns:
            self._next_status_ns = now_ns + 1_000_000_000
            self.notifier.retry()
            status = self.conductor.status_line()
            if status != self._status and self.notifier.notify(f"STATUS={status}"):
                self._status = status
        if self.notifier.dropped:
            self.counters.set(SystemCounter.NOTIFY_DROPS, self.notifier.dropped)

    async def _hold_the_gil(self, hold_ns: int) -> None:
        """The debug_conductor_gil_hold hook: a C call through ctypes.PyDLL keeps the GIL
        (usleep, so it costs no CPU), every 100 ms."""
        usleep = ctypes.PyDLL(None).usleep
        while True:
            await trio.sleep(0.1)
            usleep(hold_ns // 1000)

    async def _duty_cycle(self, threads: list[NetworkThread]) -> None:
        pacing = ConductorPacing()
        counters = self.counters
        while True:
            # Commands first (also the safety net for an edge of zmq's FD that a send
            # consumed), so this cycle sees them; news during the cycle (a command handled
            # after one of its sends) ends the wait below at once.
            self._process_commands()
            self._take_names()
            self._wake = trio.Event()
            started = time.monotonic_ns()
            # The governor's lag is the data path's: the network threads' own timer lateness.
            self.conductor.network_lag_ns = max(
                (recent_lag_ns(*t.lag, started) for t in threads), default=0)
            work = self._conductor_cycle(started)
            if self._drain_deadline_ns is not None:
                if self.conductor.drain(started):
                    log.info("drained in %.2f s", (started - self._drain_deadline_ns
                                                   + self.settings.drain_timeout) / 1e9)
                    self._stop_now()
                elif started >= self._drain_deadline_ns:
                    log.warning("drain_timeout passed before subscribers and receivers took "
                                "everything: stopping anyway")
                    self._stop_now()
                work += 1  # a drain is short: keep the cycle brisk
            self._tell_systemd(started)
            self._record_cycle_time(time.monotonic_ns() - started)
            delay = pacing.delay_s(work)
            # The heartbeat is this cycle's: an idle conductor still beats four times within
            # its clients' driver_timeout, or they would deem it dead.
            deadline = min(self.conductor.next_deadline_ns(),
                           started + self.settings.driver_timeout // 4)
            if self.watchdog is not None:
                deadline = min(deadline, self.watchdog.next_ping_ns)
            delay = max(0.0, min(delay, (deadline - time.monotonic_ns()) / 1e9))
            # Registered as a waiter only for a real park: while active the cycle comes within a
            # millisecond anyway, and a wake-up per back-pressured offer would cost more CPU on
            # a small machine than it saves.
            parked = delay > ACTIVE_CYCLE_S
            if parked:
                lib.ss_get_and_add_i32(counters.driver_waiters, 1)
            try:
                with trio.move_on_after(delay):
                    await self._wake.wait()
            finally:
                if parked:
                    lib.ss_get_and_add_i32(counters.driver_waiters, -1)


#: What stops a driver, first by draining: Ctrl-C, a service manager's stop, and the hangup of
#: the terminal a driver runs in the foreground of (an SSH session that drops); Python's
#: default for SIGHUP killed it, leaving its logs in /dev/shm until the next start.  A SIGHUP
#: the driver was started ignoring (nohup, tmux, a parent's choice) stays ignored.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _stop_signals() -> tuple[signal.Signals, ...]:
    """The :data:`STOP_SIGNALS` this process watches: all but a SIGHUP it inherited ignored
    (main thread only: others have no say over signals)."""
    if threading.current_thread() is not threading.main_thread():
        return ()
    return tuple(signum for signum in STOP_SIGNALS
                 if signum != signal.SIGHUP or signal.getsignal(signum) is not signal.SIG_IGN)


def _ignore_stop_signals() -> dict[int, Any]:
    """Ignore the stop signals (main thread only); returns what to restore."""
    return {signum: signal.signal(signum, signal.SIG_IGN) for signum in _stop_signals()}


def _restore_signals(previous: dict[int, Any]) -> None:
    for signum, handler in previous.items():
        signal.signal(signum, handler)


def run_driver(settings: DriverSettings, *, stop_when_stdin_closes: bool = False) -> None:
    """Run a driver in the foreground until SIGINT, SIGTERM or SIGHUP (:data:`STOP_SIGNALS`),
    or (``stop_when_stdin_closes``) until its standard input, which must then be a pipe, ends,
    which it takes as the first SIGTERM."""
    if stop_when_stdin_closes:
        try:
            is_pipe = stat.S_ISFIFO(os.fstat(sys.stdin.fileno()).st_mode)
        except (AttributeError, OSError, ValueError):  # no stdin, or it is closed
            is_pipe = False
        if not is_pipe:
            raise DriverError("--stop-when-stdin-closes: standard input is not a pipe; it is "
                              "for a driver whose starter holds a pipe to it")
    trio.run(_DriverShell(settings, stop_when_stdin_closes=stop_when_stdin_closes).run)
