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

import atexit
import contextlib
import contextvars
import ctypes
import errno
import fcntl
import functools
import logging
import os
import re
import select
import signal
import stat
import struct
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import trio
import zmq

from slipstream.client import control
from slipstream.client._native import lib
from slipstream.client.channel import MAX_URI_LENGTH, Channel, parse_channel
from slipstream.client.client import default_directory as client_default_directory
from slipstream.client.counters import CountersFile, SystemCounter
from slipstream.client.errors import (
    ChannelError,
    ClosedError,
    ConfigurationError,
    DriverAlreadyRunningError,
    DriverDirectoryError,
    DriverError,
    UsageError,
)
from slipstream.client.layout import (
    LOG_META_DATA_LENGTH,
    META_CORRELATION_ID,
    META_TERM_LENGTH,
    PARTITION_COUNT,
    TERM_MAX_LENGTH,
    TERM_MIN_LENGTH,
)
from slipstream.client.logbuffer import (
    check_page_size,
    compute_log_length,
    term_length_of_file,
)
from slipstream.daemon._network import lib as network_lib
from slipstream.daemon.agents.thread import (
    MAX_PARK_S,
    NetworkThread,
    new_duty_loop,
    open_doorbell,
)
from slipstream.daemon.cli import EXIT_ALREADY_RUNNING, EXIT_DIRECTORY_REFUSED
from slipstream.daemon.conductor.conductor import DriverConductor, Outgoing
from slipstream.daemon.conductor.network import NetworkConductor
from slipstream.daemon.config import DriverSettings, load_settings
from slipstream.daemon.media import names
from slipstream.daemon.media.udp import UdpTransports
from slipstream.daemon.ops.systemd import Notifier, Watchdog, park_bound_s, watchdog_interval_ns
from slipstream.daemon.pressure.governor import recent_lag_ns
from slipstream.daemon.reports.error_log import FILE as ERROR_LOG_FILE
from slipstream.daemon.reports.error_log import PREVIOUS_FILE as PREVIOUS_ERROR_LOG_FILE
from slipstream.daemon.reports.error_log import TEMPORARY_FILE as ERROR_LOG_TEMPORARY_FILE
from slipstream.daemon.reports.error_log import ErrorLogHandler
from slipstream.daemon.reports.loss_report import FILE as LOSS_REPORT_FILE

log = logging.getLogger("slipstream.driver")

ACTIVE_CYCLE_S = 0.001
IDLE_PARK_MAX_S = 1.0
#: How often an embedded driver's duty cycle looks for commands, ns (a poll of zmq's FD, a
#: µs; a command's answer may wait this long).
COMMAND_CHECK_NS = 1_000_000
#: How often it asks zmq itself (a few µs), whatever the FD says: a safety net, as the
#: daemon's duty cycle asks on each of its cycles.
COMMAND_SAFETY_CHECK_NS = 100_000_000


class ConductorPacing:
    """When the conductor's next cycle is due without news: :data:`ACTIVE_CYCLE_S` after a
    cycle that did work, then twice as long after each idle cycle in a row, up to
    :data:`IDLE_PARK_MAX_S` (its own deadline, a command or an agent's event comes sooner).
    The daemon's trio loop and an embedded driver pace their conductor alike."""

    __slots__ = ("idle_cycles",)

    def __init__(self) -> None:
        self.idle_cycles = 0

    def delay_s(self, work: int) -> float:
        """The delay after a cycle that did ``work``, s."""
        if work:
            self.idle_cycles = 0
            return ACTIVE_CYCLE_S
        self.idle_cycles += 1
        return min(ACTIVE_CYCLE_S * (1 << min(self.idle_cycles, 10)), IDLE_PARK_MAX_S)


class DriverDirectory:
    """The driver directory: one driver per directory, held by an flock on ``driver.lock``.

    The driver takes a directory only if it is absent, empty, or already a slipstream driver
    directory (its lock file starts with :data:`control.DIRECTORY_MARKER`); anything else is refused
    with :class:`DriverDirectoryError`.  It removes only the entries it makes, by name
    (:data:`DRIVER_FILES`), and the logs of :data:`LOG_FOLDERS` a driver made (named
    ``<registration id>.logbuffer`` and carrying that id in their metadata), never an unknown
    entry, and removes the directory at stop only if a
    slipstream driver created it (and the missing parents it made for it, if empty).  So
    ``--dir ~`` typed by mistake is refused, and a user's file
    or another driver's nested directory is never touched.

    With a ``group`` (the ``client_group`` setting's gid) the directory and its log folders
    are that group's and :data:`control.SHARED_DIRECTORY_MODE` (setgid: whatever is made in
    them takes the group; its members may read and enter, never add or remove a name), and
    its files take :func:`control.file_mode`'s shared modes; without one it is
    :data:`control.PRIVATE_DIRECTORY_MODE` when a driver made it.
    """

    def __init__(self, path: str | os.PathLike[str], group: int | None = None) -> None:
        self.path = Path(path)
        self.group = group
        self._lock_fd: int | None = None
        self._created = False  # whether a slipstream driver made the directory itself
        self._made_parents: list[Path] = []  # missing parents this driver made, outermost first

    def acquire(self) -> None:
        """Create (mode 0700) or adopt and lock the directory; clean what a dead driver left
        behind.  Raises :class:`DriverAlreadyRunningError` if a live driver holds it and
        :class:`DriverDirectoryError` if it holds anything that is not a driver's, or another
        user could change it.  A ``group`` this process is not in is a
        :class:`ConfigurationError` naming ``client_group``."""
        self._check_socket_paths()
        self._check_group()
        self._made_parents = []
        created = False
        refused_in: Path | None = None  # where the last attempt found ENOENT with a parent
        try:
            for _ in range(_LOCK_ATTEMPTS):
                try:
                    # A parent may go meanwhile: another driver that made it removes it at
                    # stop.
                    _make_missing_parents(self.path, self._made_parents)
                    self.path.mkdir(mode=0o700)
                    created = True
                except FileExistsError:
                    pass
                except FileNotFoundError as e:
                    refused = Path(e.filename) if e.filename else self.path
                    # Its parent is there and still refuses it: twice in a row (a parent
                    # another driver removed and made again between is not that) is a
                    # filesystem that holds no directories of ours (/proc).
                    if refused.parent.is_dir() and refused_in == refused.parent:
                        raise DriverDirectoryError(
                            f"{refused}: cannot be made in {refused.parent}: {e.strerror}; "
                            f"give the driver another directory with --dir") from None
                    refused_in = refused.parent if refused.parent.is_dir() else None
                    continue
                except OSError as e:  # a file on the way, no permission, a read-only mount
                    raise DriverDirectoryError(
                        f"{e.filename or self.path}: {e.strerror}: cannot make the driver "
                        f"directory {self.path}; give the driver another one with --dir"
                    ) from None
                break
            else:
                raise DriverDirectoryError(
                    f"{self.path}: its parent directories kept disappearing while this driver "
                    f"made them; is another process removing them?")
            self._check_owner(created)
            for _ in range(_LOCK_ATTEMPTS):
                fd = self._open_lock(created)
                if fd is not None:
                    break
            else:
                raise DriverDirectoryError(
                    f"{self.path}: its {control.LOCK_FILE} kept changing while this driver "
                    f"took it; is another driver starting and stopping there?")
        except BaseException:  # refused before it held anything: only what it just made goes
            self._remove_made_directories(created)
            raise
        self._lock_fd = fd
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, control.lock_text(self._created, os.getpid()).encode(), 0)
            os.fchmod(fd, self.file_mode(clients_write=False))  # clients probe it (flock)
            if self.group is not None:
                os.fchown(fd, -1, self.group)  # made before the directory was the group's
                self._share(self.path)
            elif self._created:
                os.chmod(self.path, control.PRIVATE_DIRECTORY_MODE)
            # A stale driver's files: it died without cleaning up.  Its error log is kept
            # for the operator (slipstream stat shows it).
            with contextlib.suppress(FileNotFoundError):
                os.replace(self.path / ERROR_LOG_FILE, self.path / PREVIOUS_ERROR_LOG_FILE)
            with contextlib.suppress(OSError):  # stat's readers: the group's, if it has one
                _chmod_file(self.path / PREVIOUS_ERROR_LOG_FILE,
                            self.file_mode(clients_write=False))
            self._remove_own_entries(keep=(PREVIOUS_ERROR_LOG_FILE,))
            for folder in LOG_FOLDERS:
                (self.path / folder).mkdir(mode=control.PRIVATE_DIRECTORY_MODE, exist_ok=True)
                if self.group is not None:
                    self._share(self.path / folder)
        except BaseException:
            self.release()
            raise

    def file_mode(self, *, clients_write: bool) -> int:
        """The mode of a file the driver makes here (:func:`control.file_mode`)."""
        return control.file_mode(self.group is not None, clients_write=clients_write)

    def _check_group(self) -> None:
        """The driver may give its files to ``group`` only as one of its members."""
        if self.group is None or os.geteuid() == 0:
            return
        if self.group != os.getegid() and self.group not in os.getgroups():
            user = control.describe_user(os.geteuid())
            group = control.describe_group(self.group)
            raise ConfigurationError(
                "client_group", f"this driver runs as {user}, which is not in {group}, so it "
                f"cannot make its files that group's: add it (usermod -aG "
                f"{control.group_name(self.group)} {control.user_name(os.geteuid())}, or "
                f"SupplementaryGroups= in its unit) or name one of its groups")

    def _share(self, path: Path) -> None:
        """Give the directory ``path`` (the driver's own, or a log folder in it) to the group."""
        os.chown(path, -1, self.group)
        os.chmod(path, control.SHARED_DIRECTORY_MODE)

    def _check_socket_paths(self) -> None:
        """The unix sockets the driver makes in the directory (the control socket, the
        doorbells) need their paths to fit ``sun_path``; refuse before anything is made."""
        limits = {control.CONDUCTOR_SOCKET: MAX_ZMQ_IPC_PATH,
                  control.SENDER_DOORBELL: MAX_UNIX_SOCKET_PATH,
                  control.RECEIVER_DOORBELL: MAX_UNIX_SOCKET_PATH}
        for name, limit in limits.items():
            length = len(os.fsencode(self.path / name))
            if length > limit:
                raise DriverDirectoryError(
                    f"{self.path} is too long for the unix sockets the driver makes in it: "
                    f"{self.path / name} is {length} bytes, and its path may have at most "
                    f"{limit}; give it a shorter directory with --dir")

    def _check_owner(self, created: bool) -> None:
        """The directory is one this user owns and nobody else may write to: another user who
        made ``/dev/shm/slipstream-<user>`` first could otherwise swap the driver's files."""
        try:
            info = os.stat(self.path)
        except OSError as e:
            raise DriverDirectoryError(f"{self.path}: {e.strerror}") from None
        if not stat.S_ISDIR(info.st_mode):
            raise DriverDirectoryError(
                f"{self.path} is not a directory: give the driver a directory with --dir")
        if created:
            return
        if info.st_uid != os.geteuid():
            raise DriverDirectoryError(
                f"{self.path} belongs to uid {info.st_uid}, not to this user ({os.geteuid()}): "
                f"the driver takes only a directory of its own user; give it another with --dir")
        if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise DriverDirectoryError(
                f"{self.path} is writable by other users (mode {stat.S_IMODE(info.st_mode):o}): "
                f"they could change the driver's files; make it 0700 or give the driver another "
                f"directory with --dir")

    def _open_lock(self, created: bool) -> int | None:
        """Open and lock ``driver.lock`` (made here if the directory is empty), set
        :attr:`_created`; None if the lock file changed meanwhile (try again)."""
        lock_path = self.path / control.LOCK_FILE
        try:
            fd = os.open(lock_path, _LOCK_FLAGS)
        except FileNotFoundError:
            if any(not _is_lock_in_making(entry.name) for entry in self.path.iterdir()):
                if os.path.lexists(lock_path):
                    return None  # another driver named its lock meanwhile: look again
                raise DriverDirectoryError(
                    f"{self.path} is not empty and is not a slipstream driver directory (it "
                    f"has no {control.LOCK_FILE}): the driver takes only an absent or empty "
                    f"directory, or one a driver made, and never removes what it did not "
                    f"make; give it another directory with --dir") from None
            return self._make_lock(created)
        except OSError as e:  # a link, or no permission: nothing of ours
            raise DriverDirectoryError(
                f"{self.path}: cannot open its {control.LOCK_FILE} ({e.strerror}); give the "
                f"driver another directory with --dir") from None
        try:
            _flock(fd, self.path)
            if not _same_file(fd, lock_path):  # unlinked by a driver that stopped meanwhile
                os.close(fd)
                return None
            self._created = self._check_lock(fd)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _make_lock(self, created: bool) -> int | None:
        """A new ``driver.lock``, whole and locked before it has its name: written and locked
        as ``driver.lock.<pid>.<thread>``, then linked, so no driver ever finds it empty or
        unlocked.  None if another driver linked its own first."""
        lock_path = self.path / control.LOCK_FILE
        making = self.path / f"{control.LOCK_FILE}.{os.getpid()}.{threading.get_ident()}"
        fd = control.create_file(making, _LOCK_FLAGS | os.O_EXCL,
                                 self.file_mode(clients_write=False))
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.pwrite(fd, control.lock_text(created, os.getpid()).encode(), 0)
            try:
                os.link(making, lock_path)
            except (FileExistsError, FileNotFoundError):  # another driver's lock came first
                os.close(fd)
                return None
        except BaseException:
            with contextlib.suppress(OSError):
                os.close(fd)
            raise
        finally:
            making.unlink(missing_ok=True)
        self._created = created
        return fd

    def _check_lock(self, fd: int) -> bool:
        """Whether a driver wrote the locked ``driver.lock`` (else DriverDirectoryError);
        returns whether a driver created the directory."""
        marker, _, was_created = _read_lock(fd)
        if marker:
            return was_created
        if _is_legacy_lock(fd) and all(_is_driver_entry(entry) for entry in self.path.iterdir()):
            # Maybe an earlier release's (its lock held a pid alone, or nothing yet), maybe a
            # user's folder whose names are a driver's: nothing tells them apart, and taking it
            # would clean (and at stop remove) files the driver may not have made.
            raise DriverDirectoryError(
                f"{self.path} holds only a driver's file names, but its {control.LOCK_FILE} "
                f"has no driver's marker (an earlier slipstream release wrote a pid alone): "
                f"the driver never removes what it cannot tell it made; if an earlier release "
                f"made this directory, remove it yourself, or give the driver another "
                f"directory with --dir")
        raise DriverDirectoryError(
            f"{self.path} is not a slipstream driver directory: its {control.LOCK_FILE} was not "
            f"written by a driver; the driver never removes what it did not make, so give it "
            f"another directory with --dir")

    def _remove_own_entries(self, *, keep: tuple[str, ...] = ()) -> None:
        """Remove the driver's files by name; unknown entries stay where they are."""
        for name in DRIVER_FILES + LEGACY_FILES:
            if name not in keep and name != control.LOCK_FILE:
                _remove_file(self.path / name)
        for entry in self.path.iterdir():
            if _is_lock_in_making(entry.name):  # a start that died before naming its lock
                _remove_file(entry)
        for folder in LOG_FOLDERS:
            path = self.path / folder
            if path.is_symlink() or not path.is_dir():
                _remove_file(path)
                continue
            for entry in path.iterdir():
                if _is_driver_log(entry):
                    _remove_file(entry)
            with contextlib.suppress(OSError):  # not empty: something that is not ours
                path.rmdir()

    def release(self) -> None:
        """Remove the driver's files, and the directory if a driver created it and nothing
        else is left in it, then unlock."""
        if self._lock_fd is None:
            return
        self._remove_own_entries()
        (self.path / control.LOCK_FILE).unlink(missing_ok=True)
        os.close(self._lock_fd)
        self._lock_fd = None
        self._remove_made_directories(self._created)

    def _remove_made_directories(self, created: bool) -> None:
        """The directory if a driver ``created`` it, and the parents this one made (``--dir
        /tmp/a/b`` made ``/tmp/a``), each only if nothing else is left in it."""
        for made in ([self.path] if created else []) + self._made_parents[::-1]:
            with contextlib.suppress(OSError):  # not empty: something that is not ours
                made.rmdir()
        self._made_parents = []


def _make_missing_parents(path: Path, made: list[Path]) -> None:
    """Make the parents of ``path`` that do not exist (as ``mkdir -p``), appending each as it
    is made to ``made``, outermost first (one another process made meanwhile is not among
    them): whatever is raised, ``made`` holds every directory this call made."""
    missing = [parent for parent in reversed(path.parents) if not parent.exists()]
    for parent in missing:
        try:
            parent.mkdir()
        except FileExistsError:
            continue
        except FileNotFoundError:
            if parent.parent.is_dir():  # its parent is there and refuses it (/proc): say so
                raise
            break  # its own parent went meanwhile: the caller tries again
        made.append(parent)


#: The longest path of a unix socket, bytes (Linux's sun_path; Python's bind needs no NUL).
MAX_UNIX_SOCKET_PATH = 108
#: zmq's ipc:// endpoints keep a NUL in sun_path: one byte less.
MAX_ZMQ_IPC_PATH = MAX_UNIX_SOCKET_PATH - 1
#: Every file a driver makes at the top of its directory.
DRIVER_FILES = (control.CONDUCTOR_SOCKET, control.COUNTERS_FILE, control.SENDER_DOORBELL,
                control.RECEIVER_DOORBELL, ERROR_LOG_FILE, ERROR_LOG_TEMPORARY_FILE,
                PREVIOUS_ERROR_LOG_FILE, LOSS_REPORT_FILE, control.LOCK_FILE)
#: What a driver of an earlier release also made there (its error log's temporary name, also
#: in directories whose lock has the marker).
LEGACY_FILES = ("errors.tmp",)
#: The folders of the driver's log buffers: only ``<registration id>.logbuffer`` files.
LOG_FOLDERS = (control.PUBLICATIONS_DIR, control.IMAGES_DIR)
_LOG_NAME = re.compile(r"-?[0-9]+\.logbuffer")


_LOCK_FLAGS = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
_LOCK_ATTEMPTS = 10
_LOCK_IN_MAKING = re.compile(re.escape(control.LOCK_FILE) + r"\.[0-9]+\.[0-9]+")


#: How long a starting driver waits for clients' probes of the lock to let go (they hold it
#: shared for microseconds, each client every keepalive), and how often it looks.
_PROBE_WAIT_S = 0.5
_PROBE_RETRY_S = 0.001


def _flock(fd: int, path: Path) -> None:
    """Take the driver lock, or DriverAlreadyRunningError naming the holder.  A running
    driver holds it exclusively for its whole life; a client looking for a driver
    (client.py, native.c) holds it shared for a moment, which is waited out."""
    deadline = time.monotonic() + _PROBE_WAIT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
        try:  # only a driver's lock refuses a shared one too
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            break
        fcntl.flock(fd, fcntl.LOCK_UN)
        if time.monotonic() >= deadline:
            raise DriverDirectoryError(
                f"{path}: other processes kept its {control.LOCK_FILE} locked shared for "
                f"{_PROBE_WAIT_S} s (clients hold it so only for a moment); find them with "
                f"fuser, or give the driver another directory with --dir")
        time.sleep(_PROBE_RETRY_S)
    marker, pid, _ = _read_lock(fd)
    if not marker and _is_legacy_lock(fd):
        # Read again: the driver that holds it may have written its marker since.
        legacy = os.pread(fd, 64, 0).decode("ascii", "replace").strip()
        pid = int(legacy) if legacy.isdigit() else _read_lock(fd)[1]
    raise DriverAlreadyRunningError(
        f"a slipstream driver (pid {pid or '?'}) is already running in {path}; stop it "
        f"first or give this one another directory with --dir")


def _same_file(fd: int, path: Path) -> bool:
    try:
        named = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (held.st_dev, held.st_ino) == (named.st_dev, named.st_ino)


def _is_lock_in_making(name: str) -> bool:
    """``driver.lock.<pid>.<thread>``: a lock file a starting driver writes before it names
    it."""
    return _LOCK_IN_MAKING.fullmatch(name) is not None


def _read_lock(fd: int) -> tuple[bool, int | None, bool]:
    """:func:`control.parse_lock` of the lock file open at ``fd``."""
    return control.parse_lock(os.pread(fd, control.LOCK_TEXT_MAX, 0))


def _is_legacy_lock(fd: int) -> bool:
    """A lock file as an earlier release wrote it: a pid alone (or nothing yet)."""
    text = os.pread(fd, 64, 0).decode("ascii", "replace").strip()
    return text == "" or text.isdigit()


def _is_log_name(name: str) -> bool:
    return _LOG_NAME.fullmatch(name) is not None


def _is_driver_log(path: Path) -> bool:
    """Whether ``path`` is a log a driver made: named ``<registration id>.logbuffer``, a
    regular file whose length is a log's and whose metadata names that registration id and
    that term length, or is still all zero (a driver died making it, before
    :meth:`LogBuffer.create` wrote it).  A file a user named so, or anything else, is not."""
    if not _is_log_name(path.name):
        return False
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            return False
        registration_id = int(path.name.removesuffix(".logbuffer"))
        if info.st_size < compute_log_length(TERM_MIN_LENGTH):
            return False
        term_length = term_length_of_file(info.st_size)
        if term_length > TERM_MAX_LENGTH:
            return False
        meta = os.pread(fd, LOG_META_DATA_LENGTH, PARTITION_COUNT * term_length)
        if meta == bytes(LOG_META_DATA_LENGTH):  # made, never initialised
            return compute_log_length(term_length) == info.st_size
        (correlation_id,) = struct.unpack_from("<q", meta, META_CORRELATION_ID)
        named_length, page_size = struct.unpack_from("<ii", meta, META_TERM_LENGTH)
        if named_length != term_length or correlation_id != registration_id:
            return False
        try:
            check_page_size(page_size)
        except ValueError:
            return False
        return compute_log_length(term_length, page_size) == info.st_size
    except OSError:
        return False
    finally:
        os.close(fd)


def _is_driver_entry(entry: Path) -> bool:
    if entry.name in DRIVER_FILES or entry.name in LEGACY_FILES or _is_lock_in_making(entry.name):
        return True
    if entry.name in LOG_FOLDERS and entry.is_dir() and not entry.is_symlink():
        return all(_is_driver_log(log_file) for log_file in entry.iterdir())
    return False


def _chmod_file(path: Path, mode: int) -> None:
    """Set the mode of one of the driver's files, never of what a link there points to."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        os.fchmod(fd, mode)
    finally:
        os.close(fd)


def _remove_file(path: Path) -> None:
    """Unlink one of the driver's names (a file, a socket or a link, never a directory)."""
    with contextlib.suppress(FileNotFoundError, IsADirectoryError, PermissionError):
        path.unlink()


class _DriverCore:
    """What every driver does between its command socket, its conductor and its counters,
    whoever runs it: the trio shell of a driver process (:class:`_DriverShell`) or an embedded
    driver in invoker mode (:class:`EmbeddedDriver`)."""

    def __init__(self, settings: DriverSettings) -> None:
        self.settings = settings
        self.driver_directory = DriverDirectory(settings.directory, settings.client_gid)
        self._told_clients = False
        self.doorbells: list[Any] = []
        self._opened: list[str] = []  # what _open made so far: _close closes just that
        self._exporter: Any = None  # the metrics server (metrics_address), while it serves

    def _start_metrics(self) -> None:
        """Serve the counters at ``metrics_address`` (if set) from a thread of its own."""
        endpoint = self.settings.metrics_endpoint
        if endpoint is not None:
            from slipstream.daemon.ops.metrics import metrics_url, start_exporter

            self._exporter, _ = start_exporter(self.driver_directory.path, *endpoint)
            log.info("metrics at %s", metrics_url(self._exporter))

    def _stop_metrics(self) -> None:
        if self._exporter is not None:
            self._exporter.shutdown()
            self._exporter.server_close()
            self._exporter = None

    def _open(self, *, wake_network: Callable[[], object],
              wake_conductor: Callable[[], object]) -> NetworkConductor:
        """The command socket (not bound yet), the counters file, the doorbells and the
        conductor over UDP transports; returns the conductor's network side."""
        self.context = zmq.Context()
        self._opened.append("context")
        self.sock = sock = self.context.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        # Only processes of the driver's own user may talk to it (SO_PEERCRED): the 0700
        # directory keeps others out too, but not root, nor a directory someone opened up.
        sock.setsockopt(zmq.IPC_FILTER_UID, os.geteuid())
        directory = self.driver_directory
        if directory.group is not None:
            # And the members of client_group: libzmq admits a peer whose gid is the group's
            # or whom the group database lists as a member.
            sock.setsockopt(zmq.IPC_FILTER_GID, directory.group)
        shared_mode = directory.file_mode(clients_write=True)
        self.counters = counters = CountersFile.create(
            directory.path / control.COUNTERS_FILE, self.settings.counters_capacity, shared_mode)
        self._opened.append("counters")
        for name in (control.SENDER_DOORBELL, control.RECEIVER_DOORBELL):
            self.doorbells.append(open_doorbell(str(directory.path / name), shared_mode))
        self.conductor = DriverConductor(
            self.settings, self.driver_directory.path, counters,
            transports=UdpTransports(self.settings, counters),
            wake_network=wake_network, wake_conductor=wake_conductor)
        self._opened.append("conductor")
        assert self.conductor.network is not None
        return self.conductor.network

    def _close(self) -> None:
        """What :meth:`_open` made (all of it, or as far as it came): the conductor's
        resources, the sockets, the counters."""
        opened = self._opened
        for doorbell in self.doorbells:
            doorbell.close()
        self.doorbells = []
        if "conductor" in opened:
            self.conductor.close(time.monotonic_ns())
        if "context" in opened:
            # The shutdown events are queued: give them a moment to reach the clients.
            self.sock.close(200 if self._told_clients else 0)
            self.context.term()
        if "counters" in opened:
            self.counters.close()
        opened.clear()

    def _bind_commands(self) -> None:
        """Bind the command socket, with the mode of every file clients write in the directory
        (zmq makes it with the process's umask, and an adopted directory may be 0755)."""
        self.sock.bind(control.conductor_endpoint(self.driver_directory.path))
        os.chmod(self.driver_directory.path / control.CONDUCTOR_SOCKET,
                 self.driver_directory.file_mode(clients_write=True))

    def _send(self, out: Outgoing) -> None:
        for key, message in out:
            try:
                self.sock.send_multipart([key, control.encode(message)], zmq.NOBLOCK)
            except zmq.ZMQError as e:  # the client is gone; its liveness timeout cleans up
                log.debug("dropping %s for a vanished client: %s", message.get("type"), e)

    def _process_commands(self) -> int:
        """Handle every waiting command; returns how many.  zmq's FD is edge-triggered and any
        send can consume the edge of a command that arrived meanwhile, so this runs after every
        send too."""
        sock = self.sock
        handled = 0
        while sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            frames = sock.recv_multipart(zmq.NOBLOCK)
            handled += 1
            if len(frames) != 2:
                self.counters.add(SystemCounter.ERRORS)
                continue
            key, frame = frames
            try:
                message = control.decode(frame)
            except ValueError as e:
                log.warning("a malformed control message from a client: %s", e)
                self._send(self.conductor.on_malformed(key, e))
                continue
            channel = _channel_of(message)
            if channel is not None and names.needs_prefetch(channel):
                self._command_after_names(key, message, channel)
                continue
            self._handle_command(key, message)
        return handled

    def _command_after_names(self, key: bytes, message: dict[str, Any],
                             channel: Channel) -> None:
        """A command whose channel names hosts: resolve them first (see the subclasses)."""
        raise NotImplementedError

    def _handle_command(self, key: bytes, message: dict[str, Any]) -> None:
        started = time.monotonic_ns()
        out = self.conductor.on_command(key, message, started)
        # A command is conductor work as a duty cycle is (creating a log takes tens of ms):
        # the max cycle time shows it, before the client hears the answer.
        self._record_cycle_time(time.monotonic_ns() - started)
        self._send(out)

    def _record_cycle_time(self, cycle_ns: int) -> None:
        counters = self.counters
        if cycle_ns > counters.get(SystemCounter.CONDUCTOR_MAX_CYCLE_TIME_NS):
            counters.set(SystemCounter.CONDUCTOR_MAX_CYCLE_TIME_NS, cycle_ns)
        timeout_ns = self.settings.driver_timeout
        if cycle_ns > timeout_ns // 4:
            # The heartbeat's promise (four beats within driver_timeout) is broken: say so
            # where an operator looks, not only in a counter.
            log.warning("a conductor cycle took %.1f s, past driver_timeout / 4 (%.1f s); "
                        "clients deem the driver gone after driver_timeout (%.1f s) without "
                        "a heartbeat", cycle_ns / 1e9, timeout_ns / 4e9, timeout_ns / 1e9)

    def _conductor_cycle(self, started: int) -> int:
        """The conductor's duty cycle at ``started`` (monotonic ns), its messages sent, the
        heartbeat clients watch; returns the work done."""
        work, out = self.conductor.do_work(started)
        if out:
            self._send(out)
            self._process_commands()
        self.counters.beat(time.time_ns())
        self.counters.add(SystemCounter.CONDUCTOR_CYCLES)
        return work


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
                             wake_conductor=lambda: self._wake_from_thread(token))
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

    def _process_commands(self) -> int:
        if self._told_clients:  # stopping: a task resumed after _stop_now takes no command
            return 0
        handled = super()._process_commands()
        if handled:
            self._wake.set()  # resources changed: let the duty cycle look at once
        return handled

    def _command_after_names(self, key: bytes, message: dict[str, Any],
                             channel: Channel) -> None:
        # Its host names resolve in a thread first: never a blocked loop.
        self._nursery.start_soon(self._resolve_then_handle, key, message, channel)

    async def _resolve_then_handle(self, key: bytes, message: dict[str, Any],
                                   channel: Channel) -> None:
        hosts = [host for _, host in names.names_of(channel)]
        with trio.move_on_after(names.PREFETCH_TIMEOUT_S) as waited:
            await trio.to_thread.run_sync(names.resolve, hosts, abandon_on_cancel=True)
        if waited.cancelled_caught:
            self._send(self.conductor.on_unresolved(
                key, message, f"{channel}: the resolver did not answer for "
                              f"{', '.join(hosts)} within {names.PREFETCH_TIMEOUT_S:g} s"))
        else:
            self._handle_command(key, message)
        self._wake.set()
        self._process_commands()  # the sends may have taken the socket's edge

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


def _channel_of(message: dict[str, Any]) -> Channel | None:
    """The channel an ADD command names, parsed (None for any other message, or one that
    does not parse: the conductor answers that)."""
    if message.get("type") not in (control.ADD_PUBLICATION, control.ADD_SUBSCRIPTION):
        return None
    uri = message.get("channel")
    if not isinstance(uri, str) or len(uri) > MAX_URI_LENGTH:
        return None
    try:
        return parse_channel(uri)
    except ChannelError:
        return None


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


#: How long a closing embedded driver's drain sleeps after a cycle that did nothing, s.
DRAIN_IDLE_S = 0.0002
#: The embedded driver whose Python work runs in this thread now: its error log takes only
#: the records logged meanwhile (two embedded drivers of one process share the logger).
_running_embedded: contextvars.ContextVar[EmbeddedDriver | None] = contextvars.ContextVar(
    "slipstream_running_embedded", default=None)


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
    it out).  Host names in a channel are resolved in the caller's thread.  Make it with
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
            network = self._open(wake_network=lambda: None, wake_conductor=self._post)
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

    def _process_commands(self) -> int:
        if self._told_clients:  # stopping: a task resumed after _stop_now takes no command
            return 0
        handled = super()._process_commands()
        if handled:  # here or after a send of the conductor's cycle: resources changed
            self._conductor_due = True
            self._python_due_ns = 0
        return handled

    def _wait_for_signal(self, waiting: bool) -> None:
        """Be a driver waiter (``waiting``) or not (publishers refused bump the driver signal
        only while it has waiters)."""
        if waiting != self._conductor_waiting:
            lib.ss_get_and_add_i32(self.counters.driver_waiters, 1 if waiting else -1)
            self._conductor_waiting = waiting

    def _command_after_names(self, key: bytes, message: dict[str, Any],
                             channel: Channel) -> None:
        """Resolve in a thread, waiting at most the daemon's PREFETCH_TIMEOUT_S (the
        caller's thread waits: an embedded driver has no other)."""
        hosts = [host for _, host in names.names_of(channel)]
        resolver = threading.Thread(target=names.resolve, args=(hosts,), daemon=True)
        resolver.start()
        resolver.join(names.PREFETCH_TIMEOUT_S)
        if resolver.is_alive():
            self._send(self.conductor.on_unresolved(
                key, message, f"{channel}: the resolver did not answer for "
                              f"{', '.join(hosts)} within {names.PREFETCH_TIMEOUT_S:g} s"))
        else:
            self._handle_command(key, message)

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


class MediaDriver:
    """A driver in a child process, for tests, demos and Spark executors.

    >>> with MediaDriver.launch(directory="/dev/shm/my-test") as driver:
    ...     with Client.connect(driver.directory) as client: ...

    Settings are :class:`DriverSettings` field names with native values (ns, bytes) or strings
    with units (``client_liveness_timeout="2s"``).
    """

    def __init__(self, directory: Path, process: subprocess.Popen[bytes],
                 drain_timeout_s: float = 10.0) -> None:
        self.directory = directory
        self.process = process
        self.drain_timeout_s = drain_timeout_s

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
              startup_timeout: float = 20.0, netns: str | None = None) -> MediaDriver:
        """Start the child and wait until it accepts clients; ``netns``: inside that network
        namespace (``ip netns exec``, which execs the driver: same pid)."""
        # It stops as at SIGTERM when its standard input ends: this process holds the pipe,
        # and when it dies, killed or not, the driver drains and goes with it.
        args = [sys.executable, "-m", "slipstream.daemon.cli", "driver", "--dir", str(directory),
                "--stop-when-stdin-closes"]
        if netns is not None:
            args = ["ip", "netns", "exec", netns, *args]
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
        driver = cls(Path(directory), process, drain_timeout_s)
        _LAUNCHED.add(driver)
        try:
            deadline = time.monotonic() + startup_timeout
            while time.monotonic() < deadline:
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
                time.sleep(0.01)
            raise DriverError(f"the driver did not start within {startup_timeout} s in "
                              f"{directory}")
        except BaseException:  # a Ctrl-C while it starts too: nothing is left running
            driver.stop(timeout=2.0)
            raise

    def _ready(self) -> bool:
        counters_path = self.directory / control.COUNTERS_FILE
        if not (self.directory / control.CONDUCTOR_SOCKET).exists() or not counters_path.exists():
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
