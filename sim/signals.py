"""SIGTERM as Ctrl-C for the simulator's and the benchmarks' command lines: ``timeout``,
``kill`` and a CI cancel end them with SIGTERM, whose default action leaves their /dev/shm
directories and network namespaces behind."""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator


def exit_on_sigterm() -> None:
    """SIGTERM raises SystemExit in the main thread (once it runs Python again), so that
    context managers and finalizers clean up as on Ctrl-C.  Only over the default action,
    from the main thread: for a program's whole life (the benchmarks)."""
    if threading.current_thread() is threading.main_thread() and \
            signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))


@contextlib.contextmanager
def exiting_on_sigterm() -> Iterator[None]:
    """:func:`exit_on_sigterm` for a block, then the action before it again: for a run that a
    caller may make in its own process (``slipstream.cli.main(["sim", ...])``)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)
    exit_on_sigterm()
    try:
        yield
    finally:
        if previous is not None:  # None: not set from Python, and it cannot be put back
            signal.signal(signal.SIGTERM, previous)
