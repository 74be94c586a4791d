"""The driver as a systemd service: the notify protocol and the watchdog (sd_notify(3),
systemd.service(5) ``Type=notify`` and ``WatchdogSec=``), without libsystemd.

systemd hands a service ``$NOTIFY_SOCKET`` (a unix datagram socket; ``@`` names an abstract
one) and, with ``WatchdogSec=``, ``$WATCHDOG_USEC`` (and ``$WATCHDOG_PID``, the process it is
meant for).  The driver sends ``READY=1`` once it accepts clients, ``STATUS=`` lines an
operator sees in ``systemctl status``, ``STOPPING=1`` when it begins to stop, and
``WATCHDOG=1`` from its conductor's duty cycle at half the watchdog interval, but only while
every network thread has also cycled within that half: a driver whose loop is stuck stops
pinging and systemd kills and restarts it (``Restart=on-failure``).  An idle driver is not
stuck: under a watchdog the conductor parks no longer than the next ping and each network
thread no longer than a quarter of the interval (:func:`park_bound_s`).
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable, Sequence

log = logging.getLogger("slipstream.systemd")

NOTIFY_SOCKET = "NOTIFY_SOCKET"
WATCHDOG_USEC = "WATCHDOG_USEC"
WATCHDOG_PID = "WATCHDOG_PID"


class Notifier:
    """Sends notify-protocol states to ``$NOTIFY_SOCKET``; does nothing without one.

    A send never waits: systemd busy (or any reader that falls behind) fills the socket, and a
    duty cycle blocked on it would stop the driver's heartbeats and its signal handling.  What
    the socket does not take is counted in :attr:`dropped` (the first drop is logged); the
    states systemd acts on (``READY=1``, ``STOPPING=1``) are kept and sent again by
    :meth:`retry` until the socket takes them, the others are dropped."""

    #: States systemd must get, sent again until it does (without READY=1 it kills the
    #: service at TimeoutStartSec).
    KEPT = ("READY=1", "STOPPING=1")

    def __init__(self, environ: dict[str, str] | None = None) -> None:
        self._name = (environ if environ is not None else os.environ).get(NOTIFY_SOCKET, "")
        self._address = "\0" + self._name[1:] if self._name.startswith("@") else self._name
        self._socket: socket.socket | None = None
        self._kept: list[str] = []
        #: States the socket refused (full, gone, or not a socket), since the start.
        self.dropped = 0
        if self._address:
            self._socket = socket.socket(
                socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK)

    @property
    def enabled(self) -> bool:
        return self._socket is not None

    def notify(self, state: str) -> bool:
        """Send ``state`` (``READY=1``, ``STATUS=...``, ...) without waiting; whether the
        socket took it.  systemd gone or the socket full is not the driver's failure."""
        if self._send(state):
            return True
        if state in self.KEPT and state not in self._kept:
            self._kept.append(state)
        return False

    def retry(self) -> None:
        """Send the kept states again, in order, while the socket takes them."""
        while self._kept and self._send(self._kept[0]):
            self._kept.pop(0)

    def _send(self, state: str) -> bool:
        if self._socket is None:
            return False
        try:
            self._socket.sendto(state.encode(), socket.MSG_DONTWAIT, self._address)
        except OSError as e:
            self.dropped += 1
            if self.dropped == 1:
                log.warning("the notify socket %s did not take %r (%s): the driver goes on "
                            "without waiting, sends READY and STOPPING again until taken and "
                            "drops the rest (counted as 'notify drops')",
                            self._name, state, e.strerror or e)
            return False
        return True

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None


def watchdog_interval_ns(environ: dict[str, str] | None = None) -> int | None:
    """The watchdog interval systemd asked for, ns; None without ``WatchdogSec=`` or when the
    variables are meant for another process (``$WATCHDOG_PID``) or malformed."""
    env = environ if environ is not None else os.environ
    try:
        usec = int(env.get(WATCHDOG_USEC, ""))
        pid = env.get(WATCHDOG_PID)
        if pid is not None and int(pid) != os.getpid():
            return None
    except ValueError:
        return None
    return usec * 1000 if usec > 0 else None


def park_bound_s(interval_ns: int | None, default_s: float) -> float:
    """The longest a network thread may park: ``default_s``, or a quarter of the watchdog
    interval when that is shorter (so an idle thread is never taken for a stuck one)."""
    return default_s if interval_ns is None else min(default_s, interval_ns / 4e9)


class Watchdog:
    """Pings ``WATCHDOG=1`` every half interval while the conductor's loop calls
    :meth:`on_duty_cycle` and every loop in ``liveness`` (the last cycle time of each network
    thread, monotonic ns) has cycled within that half interval."""

    def __init__(self, notifier: Notifier, interval_ns: int,
                 liveness: Sequence[Callable[[], int]]) -> None:
        self.notifier = notifier
        self.interval_ns = interval_ns
        self.liveness = list(liveness)
        self.next_ping_ns = 0
        self.pings = 0

    def on_duty_cycle(self, now_ns: int) -> None:
        if now_ns < self.next_ping_ns:
            return
        stale_ns = self.interval_ns // 2
        if any(now_ns - last_cycle_ns() > stale_ns for last_cycle_ns in self.liveness):
            # A stuck network thread: let systemd's timer run out; look again a little later
            # (not at once: a conductor spinning here would hold the GIL from the thread).
            self.next_ping_ns = now_ns + self.interval_ns // 20
            return
        self.notifier.notify("WATCHDOG=1")
        self.pings += 1
        self.next_ping_ns = now_ns + self.interval_ns // 2
