"""Running Java processes of the Aeron jar (a driver or a sample), their output read by threads.

Every Java process runs in its own session (process group); leaving a ``with`` block, an
error, the interpreter's exit (atexit) or, for processes started from the main thread, even
a SIGKILL of this interpreter (``setpriv --pdeathsig KILL``) ends the whole group.  SIGINT (a
clean close) only reaches a sample when this interpreter does not ignore SIGINT (a background
job of a non-interactive shell does; then SIGTERM).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import IO, Self

from .errors import SampleFailed
from .install import aeron_jar, java_binary

PropertyValue = str | int | float | bool
Properties = Mapping[str, PropertyValue]
#: How long a sample's JVM may take to start and reach its driver, s: seconds on a loaded
#: 2-core machine, whatever the timeout the test gives what comes after.
START_TIMEOUT_S = 15.0

# Serial GC: the driver and samples allocate next to nothing once running, and it keeps GC
# threads off small machines.  Agrona maps files through sun.nio.ch reflection: open that to
# it rather than have Java 11 print an "illegal reflective access" warning on every start.
_JVM_ARGS = (
    "-XX:+UseSerialGC",
    "--add-opens=java.base/sun.nio.ch=ALL-UNNAMED",
    "--add-opens=java.base/java.nio=ALL-UNNAMED",
)


_LIVE: set[JavaProcess] = set()
_LIVE_LOCK = threading.Lock()


@atexit.register
def _kill_all_left() -> None:
    with _LIVE_LOCK:
        left = list(_LIVE)
    for process in left:
        process.kill()


def _format_props(props: Properties) -> list[str]:
    def text(value: PropertyValue) -> str:
        if isinstance(value, bool):
            return "true" if value else "false"
        return str(value)

    return [f"-D{name}={text(value)}" for name, value in props.items()]


_MAIN_DIED = b'Exception in thread "main"'
_TAIL_BYTES = 256 * 1024


def _tail(text: str, limit: int = 3000) -> str:
    text = text.strip()
    return text if len(text) <= limit else "..." + text[-limit:]


class JavaProcess:
    """One java process (a driver or a sample) in its own process group, its stdout and
    stderr read by threads.  stdout is split into lines (decoded Latin-1) unless a subclass
    parses the raw bytes; everything is kept for error messages."""

    graceful_signal: signal.Signals = signal.SIGTERM

    def __init__(self, name: str, main_class: str, props: Properties, *,
                 stdin: bytes | None = None, jvm_args: Sequence[str] = (),
                 classpath: Sequence[os.PathLike[str] | str] = (),
                 interactive: bool = False) -> None:
        """``stdin`` is written and closed at start; ``interactive`` instead keeps stdin open
        for ``write_line``.  ``classpath`` entries come before the Aeron jar."""
        self.name = name
        self.lines: list[str] = []
        self._stdout = bytearray()  # not yet parsed
        self._stdout_tail = bytearray()  # the last _TAIL_BYTES, for messages
        self._stderr = bytearray()
        self._cond = threading.Condition()
        self._eof = False
        command = [str(java_binary()), *_JVM_ARGS, *jvm_args, *_format_props(props),
                   "-cp", os.pathsep.join([*map(str, classpath), str(aeron_jar())]), main_class]
        # The group dies with us even on SIGKILL; PDEATHSIG follows the forking *thread*, so
        # only from the main thread (a pool thread may exit long before the test does).
        if shutil.which("setpriv") and threading.current_thread() is threading.main_thread():
            command = ["setpriv", "--pdeathsig", "KILL", "--", *command]
        self.command = command
        self.started = time.time()
        self._proc = subprocess.Popen(
            command,
            stdin=subprocess.PIPE if stdin is not None or interactive else subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        with _LIVE_LOCK:
            _LIVE.add(self)
        self._readers = [
            threading.Thread(target=self._read_stdout, name=f"{name}-stdout", daemon=True),
            threading.Thread(target=self._read, args=(self._proc.stderr, self._stderr.extend),
                             name=f"{name}-stderr", daemon=True)]
        for reader in self._readers:
            reader.start()
        if stdin is not None:
            assert self._proc.stdin is not None
            try:
                self._proc.stdin.write(stdin)
                self._proc.stdin.close()
            except BrokenPipeError:
                pass

    def write_line(self, line: str) -> None:
        """Send one line to an ``interactive`` process's stdin."""
        if self._proc.stdin is None or self._proc.stdin.closed:
            raise self.fail(f"{self.name}: stdin is not open (not interactive, or closed)")
        try:
            self._proc.stdin.write(line.encode() + b"\n")
            self._proc.stdin.flush()
        except (BrokenPipeError, ValueError) as exc:
            raise self.fail(f"{self.name}: cannot write {line!r} to stdin ({exc})") from exc

    # -- output ------------------------------------------------------------------------------
    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def returncode(self) -> int | None:
        return self._proc.poll()

    def alive(self) -> bool:
        return self._proc.poll() is None

    @property
    def stdout(self) -> str:
        """The end of what it printed (parsed output is in ``lines`` and subclasses)."""
        with self._cond:
            return self._stdout_tail.decode("latin-1")

    @property
    def stderr(self) -> str:
        with self._cond:
            return self._stderr.decode("utf-8", "replace")

    def _read(self, pipe: IO[bytes] | None, take: Callable[[bytes], object]) -> None:
        """Read ``pipe`` to its end, handing each chunk to ``take`` under the lock and waking
        the waiters."""
        assert pipe is not None
        fd = pipe.fileno()
        while chunk := os.read(fd, 65536):
            with self._cond:
                take(chunk)
                self._cond.notify_all()

    def _read_stdout(self) -> None:
        self._read(self._proc.stdout, self._take_stdout)
        with self._cond:
            self._parse(eof=True)
            self._eof = True
            self._cond.notify_all()

    def _take_stdout(self, chunk: bytes) -> None:
        self._stdout_tail += chunk
        del self._stdout_tail[:-_TAIL_BYTES]
        self._stdout += chunk
        self._parse(eof=False)

    def _main_died(self) -> bool:
        """The sample's main thread threw: its other (non-daemon) threads may keep it alive."""
        return _MAIN_DIED in self._stderr

    def _parse(self, eof: bool) -> None:
        """Consume complete lines from ``self._stdout`` (under the lock)."""
        while (end := self._stdout.find(b"\n")) >= 0:
            line = bytes(self._stdout[:end]).decode("latin-1").rstrip("\r")
            del self._stdout[:end + 1]
            self._on_line(line)
        if eof and self._stdout:
            line = bytes(self._stdout).decode("latin-1")
            self._stdout.clear()
            self._on_line(line)

    def _on_line(self, line: str) -> None:
        self.lines.append(line)

    def describe(self) -> str:
        code = self._proc.poll()
        state = "running" if code is None else f"exit code {code}"
        return (f"{self.name} (pid {self.pid}, {state})\n--- stdout:\n{_tail(self.stdout)}"
                f"\n--- stderr:\n{_tail(self.stderr)}")

    def fail(self, what: str) -> SampleFailed:
        return SampleFailed(f"{what}\n{self.describe()}")

    def wait_until(self, predicate: Callable[[], bool], timeout: float, what: str) -> None:
        """Block until ``predicate()`` (called under the output lock) holds; fail with the
        output when the process ends first or ``timeout`` s pass."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not predicate():
                if self._eof and self._proc.poll() is not None:
                    raise self.fail(f"{self.name} exited before {what}")
                if self._main_died():
                    raise self.fail(f"{self.name} failed before {what}")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise self.fail(f"{self.name}: no {what} within {timeout:g} s")
                self._cond.wait(min(remaining, 0.1))

    def wait_exit(self, timeout: float, *, check: bool = True) -> int:
        """Wait for the process to end by itself; kill it and fail after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while (code := self._proc.poll()) is None:
            with self._cond:
                died = self._main_died()
            if died:
                time.sleep(0.2)  # let the stack trace arrive whole
                self.kill()
                raise self.fail(f"{self.name} failed")
            if time.monotonic() > deadline:
                self.kill()
                raise self.fail(f"{self.name} did not finish within {timeout:g} s")
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(0.05)
        self._join_readers()
        with _LIVE_LOCK:
            _LIVE.discard(self)
        if check and code != 0:
            raise self.fail(f"{self.name} failed")
        return code

    # -- ending ------------------------------------------------------------------------------
    def _signal_group(self, sig: signal.Signals) -> None:
        if self._proc.poll() is None:  # never signal a reaped (maybe reused) group id
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self._proc.pid, sig)

    def stop(self, grace: float = 3.0) -> int:
        """End the process: its graceful signal, then SIGTERM, then SIGKILL, to the group."""
        sigs: list[signal.Signals] = [self.graceful_signal]
        if self.graceful_signal == signal.SIGINT and (
                signal.getsignal(signal.SIGINT) == signal.SIG_IGN):
            sigs = []  # SIGINT ignored here, so ignored in the child too: the JVM keeps it
        if signal.SIGTERM not in sigs:
            sigs.append(signal.SIGTERM)
        for sig in sigs:
            self._signal_group(sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(grace)
                break
        return self.kill()

    def kill(self) -> int:
        self._signal_group(signal.SIGKILL)
        code = self._proc.wait()
        self._join_readers()
        with _LIVE_LOCK:
            _LIVE.discard(self)
        return code

    def _join_readers(self) -> None:
        for reader in self._readers:
            if reader is not threading.current_thread():
                reader.join(5.0)
        for pipe in (self._proc.stdout, self._proc.stderr, self._proc.stdin):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
