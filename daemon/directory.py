"""The driver directory (docs/ARCHITECTURE.md, "The driver directory"): the flock on
``driver.lock`` that keeps one driver per directory, how a driver makes or adopts a directory and
cleans what a dead driver left there, and the names it makes (:data:`DRIVER_FILES`,
:data:`LOG_FOLDERS`), the only ones it ever removes."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import signal
import stat
import struct
import threading
import time
from pathlib import Path

from slipstream.client import control
from slipstream.client.errors import (
    ConfigurationError,
    DriverAlreadyRunningError,
    DriverDirectoryError,
)
from slipstream.client.layout import (
    LOG_META_DATA_LENGTH,
    META_CORRELATION_ID,
    META_TERM_LENGTH,
    PARTITION_COUNT,
    TERM_MAX_LENGTH,
    TERM_MIN_LENGTH,
)
from slipstream.client.logbuffer import check_page_size, compute_log_length, term_length_of_file
from slipstream.daemon.reports.error_log import FILE as ERROR_LOG_FILE
from slipstream.daemon.reports.error_log import PREVIOUS_FILE as PREVIOUS_ERROR_LOG_FILE
from slipstream.daemon.reports.error_log import TEMPORARY_FILE as ERROR_LOG_TEMPORARY_FILE
from slipstream.daemon.reports.loss_report import FILE as LOSS_REPORT_FILE

#: Exit statuses that say why a driver process (``slipstream driver``) refused to start, so
#: that its launcher (:meth:`~slipstream.daemon.driver.MediaDriver.start`) raises the same
#: error as the process did; any other error of slipstream's, of any command, is 2.
EXIT_ALREADY_RUNNING = 3  # DriverAlreadyRunningError: a live driver holds the directory
EXIT_DIRECTORY_REFUSED = 4  # DriverDirectoryError: the directory is not the driver's to use

#: The signal that has a driver process print every thread's Python stack to its stderr (the
#: journal under systemd) and go on, as a JVM's thread dump: what a driver that does not
#: start, or hangs, is doing.  Its launcher sends it to one that is not up in time.
STACK_DUMP_SIGNAL = signal.SIGUSR1


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
    are that group's and :data:`control.SHARED_DIRECTORY_MODE` (its members may read and
    enter, never add or remove a name), setgid when the group is not the driver's own (so
    what is made in them takes the group), and its files take :func:`control.file_mode`'s
    shared modes; without one it is :data:`control.PRIVATE_DIRECTORY_MODE` when a driver made
    it.  A driver whose own group is ``group`` (a service's) neither sets the setgid bit nor
    changes a group, so a unit may refuse both (``RestrictSUIDSGID=``, ``@chown``).
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
            self._give(fd, clients_write=False)  # clients probe it (flock)
            if self.group is not None:
                self._share(self.path)
            elif self._created:
                os.chmod(self.path, control.PRIVATE_DIRECTORY_MODE)
            # A stale driver's files: it died without cleaning up.  Its error log is kept
            # for the operator (slipstream stat shows it).
            with contextlib.suppress(FileNotFoundError):
                os.replace(self.path / ERROR_LOG_FILE, self.path / PREVIOUS_ERROR_LOG_FILE)
            with contextlib.suppress(OSError):  # stat's readers: the group's, if it has one
                previous = os.open(self.path / PREVIOUS_ERROR_LOG_FILE,
                                   os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
                try:
                    self._give(previous, clients_write=False)
                finally:
                    os.close(previous)
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

    def _give(self, fd: int, *, clients_write: bool) -> None:
        """Give a file the driver made before its directory was shared (the lock, a dead
        driver's error log) the group and the mode its others have: the group first, so the
        mode never opens it to another group."""
        if self.group is not None and os.fstat(fd).st_gid != self.group:
            os.fchown(fd, -1, self.group)
        os.fchmod(fd, self.file_mode(clients_write=clients_write))

    def _share(self, path: Path) -> None:
        """Give the directory ``path`` (the driver's own, or a log folder in it) to the group:
        what this process makes is its own group's anyway, any other's through setgid."""
        if os.stat(path).st_gid != self.group:
            os.chown(path, -1, self.group)
        inherit = stat.S_ISGID if self.group != os.getegid() else 0
        os.chmod(path, control.SHARED_DIRECTORY_MODE | inherit)

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
#: The folders of the driver's log buffers: only ``<registration id>.logbuffer`` files (in
#: ``released/``, ``<n>.logbuffer``: the files its log pool keeps, :mod:`.conductor.log_pool`).
LOG_FOLDERS = (control.PUBLICATIONS_DIR, control.IMAGES_DIR, control.RELEASED_LOGS_DIR)
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
    (client.py, native_keeper.c) holds it shared for a moment, which is waited out."""
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


def _remove_file(path: Path) -> None:
    """Unlink one of the driver's names (a file, a socket or a link, never a directory)."""
    with contextlib.suppress(FileNotFoundError, IsADirectoryError, PermissionError):
        path.unlink()
