"""The launcher (:class:`MediaDriver`): a driver in a child process (:meth:`MediaDriver.launch`,
:meth:`MediaDriver.start`), which goes with the process that started it, or one embedded in this
process (:meth:`MediaDriver.embedded`).

The driver itself: :mod:`slipstream.daemon.shell` runs a driver process (``slipstream
driver``), :mod:`slipstream.daemon.embedded` a driver in invoker mode, both around
:mod:`slipstream.daemon.core`, in the directory :mod:`slipstream.daemon.directory` takes.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from slipstream.client import control
from slipstream.client.client import default_directory as client_default_directory
from slipstream.client.counters import CountersFile
from slipstream.client.errors import (
    ConfigurationError,
    DriverAlreadyRunningError,
    DriverDirectoryError,
    DriverError,
)
from slipstream.daemon.config import load_settings
from slipstream.daemon.directory import (
    EXIT_ALREADY_RUNNING,
    EXIT_DIRECTORY_REFUSED,
    STACK_DUMP_SIGNAL,
)
from slipstream.daemon.embedded import EmbeddedDriver

#: Settings of the daemon's threads (how many network threads, how long they spin idle): an
#: embedded driver has none.
THREAD_SETTINGS = ("threading_mode", "network_idle_spin")


def _program_settings(directory: str | os.PathLike[str] | None,
                      settings: Mapping[str, Any]) -> dict[str, Any]:
    """The settings of a driver a program starts (:meth:`MediaDriver.launch`,
    :meth:`MediaDriver.embedded`): its arguments alone (the environment's ``SLIPSTREAM_*`` are
    the CLI's), in ``directory``, else where ``Client.connect()`` looks for one
    (``$SLIPSTREAM_DIR``, else ``/dev/shm/slipstream-<user>``), so the two meet."""
    overrides = dict(settings)
    if directory is not None:
        overrides["dir"] = str(directory)
    elif "dir" not in overrides:
        overrides["dir"] = str(client_default_directory())
    return overrides


#: Drivers this process launched: a forked child closes its copies of their stdin pipes (the
#: driver goes with its starter, not with the last of the starter's forked children).
_LAUNCHED: weakref.WeakSet[MediaDriver] = weakref.WeakSet()


def _close_inherited_launch_pipes() -> None:
    # Not the stderr reader: the parent's thread that reads it held its lock at the fork,
    # and a close here would wait for that lock for ever.
    for driver in list(_LAUNCHED):
        driver._close_stdin()
    _LAUNCHED.clear()


os.register_at_fork(after_in_child=_close_inherited_launch_pipes)

#: How much of the stderr of a driver not up in time its error carries, in lines.
STARTUP_STDERR_LINES = 80
#: A start past its ``startup_timeout`` whose threads are still being scheduled (running, or
#: runnable and waiting for a CPU: a machine too busy rather than a hung child) or are in a
#: disk wait is given more time, up to this many times ``startup_timeout`` in all.
STARTUP_PATIENCE = 5
#: The interval over which a start is found still being scheduled, and how often one past
#: its ``startup_timeout`` is looked at again, in seconds.
STARTUP_RECHECK_S = 1.0
#: The share of that interval its threads must have spent running or runnable (summed), if
#: none is runnable or in a disk wait at the look: a hung child whose timer thread wakes
#: now and then is not being scheduled.
STARTUP_BUSY_SHARE = 0.1


def _threads(pid: int) -> list[tuple[str, str, str]]:
    """Each thread of process ``pid``: its name, its scheduler state (R running or runnable,
    S sleeping, D in an uninterruptible wait: a disk, a page fault) and the kernel function
    it waits in; OSError when /proc does not show the process."""
    threads = []
    for tid in sorted(os.listdir(f"/proc/{pid}/task"), key=int):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                stat = f.read()
            with open(f"/proc/{pid}/task/{tid}/wchan") as f:
                wchan = f.read().strip() or "-"
        except OSError:
            continue  # it ended meanwhile
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        state = stat[stat.rindex(")") + 2:].split(" ", 1)[0]
        threads.append((name, state, wchan))
    return threads


def _thread_states(pid: int) -> str:
    """:func:`_threads` as a line for an error."""
    try:
        threads = _threads(pid)
    except OSError as e:
        return f"none to read ({e.strerror})"
    return ", ".join(f"{name} {state} in {wchan}" for name, state, wchan in threads) or "none"


def _scheduled_ns(pid: int) -> dict[int, int]:
    """Each thread of process ``pid`` (by thread id): the time it has spent on a CPU or
    runnable and waiting for one (its ``schedstat``), in ns.  It grows while the thread runs
    or a busy machine keeps it from running, not while it sleeps; none where /proc does not
    say."""
    scheduled = {}
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError, ValueError):
                with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                    on_cpu, waiting = f.read().split()[:2]
                scheduled[int(tid)] = int(on_cpu) + int(waiting)
    return scheduled


def _start_idle(pid: int, before: dict[int, int], after: dict[int, int],
                elapsed_s: float) -> str | None:
    """None while process ``pid`` is still being scheduled: its threads ran or waited for a
    CPU :data:`STARTUP_BUSY_SHARE` of the ``elapsed_s`` between two :func:`_scheduled_ns`
    samples or more (summed over its threads; one new since the first counts whole, one
    gone does not), or one is runnable now (``R``: a thread kept on a run queue shows that
    wait only once it runs) or in a disk wait (``D``).  Else what it did, for an error."""
    grown = sum(ns - before.get(tid, 0) for tid, ns in after.items())
    share = grown / (elapsed_s * 1e9) if elapsed_s > 0 else 0.0
    if share >= STARTUP_BUSY_SHARE:
        return None
    try:
        if any(state in ("R", "D") for _, state, _ in _threads(pid)):
            return None
    except OSError:
        pass
    if not after:
        return "its threads' scheduling could not be read"
    return (f"its threads ran or waited for a CPU {int(share * 100)}% of the last "
            f"{elapsed_s:.1f} s, and none was runnable or waiting on a disk")


def _catches(pid: int, signum: int) -> bool:
    """Whether process ``pid`` has a handler of its own for ``signum`` (its ``SigCgt``)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            caught = next(line for line in f if line.startswith("SigCgt:"))
    except (OSError, StopIteration):
        return False
    return bool(int(caught.split()[1], 16) >> (signum - 1) & 1)


def _machine_state() -> str:
    """The load average and the share of the last 10 s some task waited for the CPU, I/O or
    memory (the kernel's pressure stall information), and the memory available."""
    parts = []
    with contextlib.suppress(OSError), open("/proc/loadavg") as f:
        parts.append("load " + " ".join(f.read().split()[:3]))
    for resource in ("cpu", "io", "memory"):
        with contextlib.suppress(OSError, ValueError, IndexError), \
                open(f"/proc/pressure/{resource}") as f:
            some = f.readline().split()  # some avg10=… avg60=… avg300=… total=…
            parts.append(f"{resource} stalled {some[1].split('=')[1]} %")
    with contextlib.suppress(OSError, StopIteration), open("/proc/meminfo") as f:
        available = next(line for line in f if line.startswith("MemAvailable:"))
        parts.append(f"{int(available.split()[1]) // 1024} MiB available")
    return ", ".join(parts)


class MediaDriver:
    """A driver in a child process, for tests, demos and Spark executors.

    >>> with MediaDriver.launch(directory="/dev/shm/my-test") as driver:
    ...     with Client.connect(driver.directory) as client: ...

    Settings are :class:`DriverSettings` field names with native values (ns, bytes) or strings
    with units (``client_liveness_timeout="2s"``).

    ``directory`` is the driver's directory as the driver names it, what a client connects
    to; ``view`` the same directory as this process reaches it, to read its files (the
    directory itself, unless the driver runs in a mount namespace of its own:
    :meth:`start`).
    """

    def __init__(self, directory: Path, process: subprocess.Popen[bytes],
                 drain_timeout_s: float = 10.0, view: Path | None = None) -> None:
        self.directory = directory
        self.process = process
        self.drain_timeout_s = drain_timeout_s
        self.view = directory if view is None else view

    @property
    def pid(self) -> int:
        return self.process.pid

    @classmethod
    @contextlib.contextmanager
    def launch(cls, directory: str | os.PathLike[str] | None = None, *,
               startup_timeout: float = 20.0, **settings: Any) -> Iterator[MediaDriver]:
        overrides = _program_settings(directory, settings)
        resolved = load_settings(env={}, overrides=overrides)  # validate here, fail fast
        driver = cls.start(resolved.directory, overrides, startup_timeout=startup_timeout)
        try:
            yield driver
        finally:
            driver.stop()

    @classmethod
    def embedded(cls, directory: str | os.PathLike[str] | None = None,
                 **settings: Any) -> EmbeddedDriver:
        """A driver in this process, in invoker mode (:class:`EmbeddedDriver`): settings as
        for :meth:`launch`, but those of the daemon's threads (:data:`THREAD_SETTINGS`) are
        refused with a :class:`ConfigurationError` naming the key: it has no threads, and a
        setting it would ignore is a promise it does not keep."""
        for key in THREAD_SETTINGS:
            if key in settings:
                raise ConfigurationError(key, "does not apply to an embedded driver: it has no "
                                              "threads of its own (the application's calls "
                                              "run it); leave it out")
        return EmbeddedDriver(load_settings(env={}, overrides=_program_settings(directory,
                                                                                settings)))

    @classmethod
    def start(cls, directory: Path, overrides: Mapping[str, Any], *,
              startup_timeout: float = 20.0, prefix: Sequence[str] = (),
              view: Path | None = None) -> MediaDriver:
        """Start the child and wait until it accepts clients (its heartbeat is in its
        counters file); :class:`DriverError` (:class:`DriverAlreadyRunningError`,
        :class:`DriverDirectoryError` for those refusals) with its stderr when it exits
        first, or naming ``startup_timeout`` (s) when it is not ready by then; nothing is
        left running.  A child still being scheduled then (its threads running, or runnable
        and kept from a CPU by a busy machine, :data:`STARTUP_BUSY_SHARE` of the last
        :data:`STARTUP_RECHECK_S` or more, or one runnable or in a disk wait at the look) is
        given more, looked at again each :data:`STARTUP_RECHECK_S`, up to
        :data:`STARTUP_PATIENCE` times ``startup_timeout`` in all; one whose threads sleep
        is stopped at its timeout.  ValueError, before any child exists, for a
        ``startup_timeout`` that is not a positive number of seconds.
        ``prefix``: the command it runs under, which must exec it (same pid), e.g. ``ip
        netns exec NAME`` (a network namespace) or ``nsenter`` into a host's namespaces;
        ``view``: where this process sees ``directory`` when the driver runs with a mount
        namespace of its own (default: ``directory`` itself).  Its stderr is passed through
        to this process's, each line marked with its pid."""
        if not startup_timeout > 0:  # NaN too
            raise ValueError(f"startup_timeout must be a positive number of seconds, not "
                             f"{startup_timeout!r}")
        # It stops as at SIGTERM when its standard input ends: this process holds the pipe,
        # and when it dies, killed or not, the driver drains and goes with it.
        args = [*prefix, sys.executable, "-m", "slipstream.daemon.cli", "driver",
                "--dir", str(directory), "--stop-when-stdin-closes"]
        for key, value in overrides.items():
            if key == "dir":
                continue
            if isinstance(value, bool):
                value = "true" if value else "false"
            args += ["--set", f"{key}={value}"]
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLIPSTREAM_")}
        # Before the child exists: a bad override raises here, leaving nothing running.
        drain_timeout_s = load_settings(env={}, overrides=overrides).drain_timeout / 1e9
        # Its own session: a Ctrl-C at the terminal reaches the starter, whose stop() then
        # drains it once; had the SIGINT reached it too, that SIGTERM would be a second stop.
        process = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.PIPE, env=env, start_new_session=True)
        driver = cls(Path(directory), process, drain_timeout_s, view)
        _LAUNCHED.add(driver)
        try:
            started = time.monotonic()
            deadline = started + startup_timeout
            patience = started + STARTUP_PATIENCE * startup_timeout
            # The first look compares with a sample a recheck before the timeout (or at the
            # start, if the timeout is shorter), not with the interpreter's own start-up: a
            # child hung by then is stopped at its timeout.
            window = min(STARTUP_RECHECK_S, startup_timeout)
            checked = deadline - window
            scheduled: dict[int, int] | None = None
            while True:
                if process.poll() is not None:
                    driver._close_stdin()
                    err = (process.stderr.read().decode(errors="replace") if process.stderr
                           else "")
                    error = {EXIT_ALREADY_RUNNING: DriverAlreadyRunningError,
                             EXIT_DIRECTORY_REFUSED: DriverDirectoryError}.get(
                                 process.returncode, DriverError)
                    raise error(f"the driver exited with {process.returncode}: {err.strip()}")
                if driver._ready():
                    threading.Thread(target=driver._drain_stderr, daemon=True).start()
                    return driver
                now = time.monotonic()
                if scheduled is None and now >= checked:
                    scheduled, checked = _scheduled_ns(process.pid), now
                if now >= deadline and now - checked < window / 2 < patience - now:
                    # The sample came late (this process was held up too): the child's
                    # share is read over an interval, not an instant.
                    deadline = checked + window
                elif now >= deadline:
                    was, scheduled = scheduled or {}, _scheduled_ns(process.pid)
                    idle = _start_idle(process.pid, was, scheduled, now - checked)
                    if idle is None and now < patience:
                        checked, deadline = now, min(now + STARTUP_RECHECK_S, patience)
                    elif process.poll() is None:  # else the next look reports its exit
                        if idle is None:
                            why = (f"nor in the {STARTUP_PATIENCE * startup_timeout:.1f} s "
                                   f"({STARTUP_PATIENCE}x) it was given while it was still "
                                   "running or waiting for a CPU or a disk")
                        elif now - started > startup_timeout + STARTUP_RECHECK_S / 2:
                            why = f"{idle}, {now - started:.1f} s after it was started"
                        else:
                            why = idle
                        raise DriverError(f"the driver did not start within {startup_timeout} "
                                          f"s in {directory} ({why}); "
                                          f"{driver._why_not_started()}")
                time.sleep(0.01)
        except BaseException:  # a Ctrl-C while it starts too: nothing is left running
            driver.stop(timeout=2.0)
            raise

    def _why_not_started(self) -> str:
        """What a child not up in time was doing, for its error: its threads' states, the
        machine's load and pressure, and the end of its stderr, with every thread's Python
        stack (it prints them at :data:`STACK_DUMP_SIGNAL`).  It is stopped."""
        pid = self.process.pid
        threads = _thread_states(pid)
        printer = _catches(pid, STACK_DUMP_SIGNAL)
        if printer:  # not before: the signal's default action would kill it, printing nothing
            with contextlib.suppress(OSError):
                self.process.send_signal(STACK_DUMP_SIGNAL)
            time.sleep(0.5)  # its handler writes at once, in C: no interpreter is needed
        self.stop(timeout=2.0)
        stderr = self.process.stderr.read().decode(errors="replace") if self.process.stderr \
            else ""
        tail = "\n".join(stderr.strip().splitlines()[-STARTUP_STDERR_LINES:])
        stacks = (f"at {STACK_DUMP_SIGNAL.name} it printed its stacks" if printer else
                  f"it had not reached its {STACK_DUMP_SIGNAL.name} stack printer yet")
        return (f"its threads: {threads}; this machine: {_machine_state()}; the end of its "
                f"stderr ({stacks}):\n{tail}")

    def _ready(self) -> bool:
        counters_path = self.view / control.COUNTERS_FILE
        if not (self.view / control.CONDUCTOR_SOCKET).exists() or not counters_path.exists():
            return False
        try:
            counters = CountersFile(counters_path, writable=False)
        except (OSError, ValueError):
            return False
        try:
            return counters.driver_pid == self.process.pid and counters.driver_heartbeat_ns > 0
        finally:
            counters.close()

    def _drain_stderr(self) -> None:
        # Keep the pipe from filling; pass the driver's log through to ours.
        assert self.process.stderr is not None
        for line in self.process.stderr:
            sys.stderr.write(f"[driver {self.process.pid}] {line.decode(errors='replace')}")

    def stop(self, timeout: float | None = None) -> int:
        """SIGTERM (the driver drains, up to its ``drain_timeout``), wait up to ``timeout``
        (default: the drain timeout and 10 s), SIGKILL if it does not stop; returns the exit
        code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(self.drain_timeout_s + 10 if timeout is None else timeout)
            except subprocess.TimeoutExpired:
                self.kill()
            except BaseException:
                # A second Ctrl-C while it drains: its second SIGTERM stops it at once (in
                # its own session, it does not get the terminal's SIGINT itself).
                with contextlib.suppress(OSError):
                    self.process.send_signal(signal.SIGTERM)
                raise
        self._close_stdin()
        return self.process.returncode

    def kill(self) -> None:
        """SIGKILL: a crash, leaving its files behind for the next driver to clean."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self._close_stdin()

    def _close_stdin(self) -> None:
        if self.process.stdin is not None:
            with contextlib.suppress(OSError):
                self.process.stdin.close()
