"""The control plane between clients and the driver's conductor (docs/ARCHITECTURE.md).

A pyzmq ROUTER socket in the driver directory (``ipc://<dir>/conductor.sock``) takes client
commands; each client holds one DEALER.  Messages are single JSON frames with a ``type``;
requests carry a ``correlation_id`` that the answer repeats.  This is never on the data path:
it creates resources and announces images.  Clients keep alive through a heartbeat counter
(as in Aeron): a timestamp the client writes into the counters file and the driver reads, so
staying alive costs neither a message nor a wake-up of the driver.

Commands (client → driver): CONNECT, ADD_PUBLICATION, ADD_EXCLUSIVE_PUBLICATION,
REMOVE_PUBLICATION, ADD_SUBSCRIPTION, REMOVE_SUBSCRIPTION, CLOSE_CLIENT, ADD_DESTINATION,
REMOVE_DESTINATION (a ``control-mode=manual`` publication's destinations), ADD_RCV_DESTINATION,
REMOVE_RCV_DESTINATION (a ``control-mode=manual`` subscription's), ADD_COUNTER,
REMOVE_COUNTER (a counter the client owns: Aeron's, with CounterMessageFlyweight's type id,
key and label; the key as hex, since messages are JSON).  An exclusive
publication's command is its own type, as in Aeron, so that a driver that does not know it
refuses it by name rather than hand out a shared log to a writer that claims without atomics.
Answers and events (driver → client): CONNECTED, PUBLICATION_READY, SUBSCRIPTION_READY,
COUNTER_READY, OPERATION_SUCCESS, ERROR, AVAILABLE_IMAGE, UNAVAILABLE_IMAGE, CLIENT_TIMEOUT,
DRIVER_SHUTDOWN, BACK_PRESSURE_EPISODE, PUBLICATION_REFUSED.  PUBLICATION_READY and
SUBSCRIPTION_READY carry ``images_following``: the AVAILABLE_IMAGE events queued right behind
them for the same client (of the IPC stream just joined), which the client reads before the
call returns.
"""

from __future__ import annotations

import contextlib
import fcntl
import grp
import json
import os
import pwd
import secrets
import stat
from pathlib import Path
from typing import Any, Final, Literal, overload

from slipstream.client.channel import MAX_URI_LENGTH
from slipstream.client.counter_record import (
    check_client_type_id,
    decode_counter_key,
    encode_counter_label,
)
from slipstream.client.errors import DriverError, DriverNotRunningError, InvalidArgumentError
from slipstream.client.layout import INT32_MAX, INT32_MIN, INT64_MAX, INT64_MIN

PROTOCOL_VERSION = 5  # 5: client counters, and the counters file's version 2

CONDUCTOR_SOCKET = "conductor.sock"
COUNTERS_FILE = "counters.dat"
LOCK_FILE = "driver.lock"
PUBLICATIONS_DIR = "publications"
IMAGES_DIR = "images"
#: The driver's released logs kept for reuse (its own: clients never open them).
RELEASED_LOGS_DIR = "released"
#: Unix datagram sockets a client rings to wake the driver's parked network thread: new data
#: for the sender, a subscriber that reached the position where a status message is due.
SENDER_DOORBELL = "sender.doorbell"
RECEIVER_DOORBELL = "receiver.doorbell"

# Commands.
CONNECT = "CONNECT"
ADD_PUBLICATION = "ADD_PUBLICATION"
ADD_EXCLUSIVE_PUBLICATION = "ADD_EXCLUSIVE_PUBLICATION"
REMOVE_PUBLICATION = "REMOVE_PUBLICATION"
ADD_SUBSCRIPTION = "ADD_SUBSCRIPTION"
REMOVE_SUBSCRIPTION = "REMOVE_SUBSCRIPTION"
CLOSE_CLIENT = "CLOSE_CLIENT"
ADD_DESTINATION = "ADD_DESTINATION"
REMOVE_DESTINATION = "REMOVE_DESTINATION"
#: A control-mode=manual subscription's receive destinations (Aeron's
#: ADD_RCV_DESTINATION / REMOVE_RCV_DESTINATION).
ADD_RCV_DESTINATION = "ADD_RCV_DESTINATION"
REMOVE_RCV_DESTINATION = "REMOVE_RCV_DESTINATION"
#: A counter the client owns (Aeron's ADD_COUNTER / REMOVE_COUNTER): the driver allocates it,
#: answers COUNTER_READY, and frees it on REMOVE_COUNTER or when the client goes.
ADD_COUNTER = "ADD_COUNTER"
REMOVE_COUNTER = "REMOVE_COUNTER"

# Answers and events.
CONNECTED = "CONNECTED"
PUBLICATION_READY = "PUBLICATION_READY"
SUBSCRIPTION_READY = "SUBSCRIPTION_READY"
COUNTER_READY = "COUNTER_READY"
OPERATION_SUCCESS = "OPERATION_SUCCESS"
ERROR = "ERROR"
AVAILABLE_IMAGE = "AVAILABLE_IMAGE"
UNAVAILABLE_IMAGE = "UNAVAILABLE_IMAGE"
CLIENT_TIMEOUT = "CLIENT_TIMEOUT"
DRIVER_SHUTDOWN = "DRIVER_SHUTDOWN"
BACK_PRESSURE_EPISODE = "BACK_PRESSURE_EPISODE"
PUBLICATION_REFUSED = "PUBLICATION_REFUSED"

# Error codes carried by ERROR (with ``code`` and ``message``).  An ERR_INVALID_CHANNEL from a
# check of the driver's also names the channel's ``uri``, the ``part`` and the ``problem``.
ERR_GENERIC = "generic"
ERR_INVALID_CHANNEL = "invalid_channel"
ERR_UNKNOWN_PUBLICATION = "unknown_publication"
ERR_UNKNOWN_SUBSCRIPTION = "unknown_subscription"
ERR_UNKNOWN_COUNTER = "unknown_counter"
ERR_UNKNOWN_CLIENT = "unknown_client"
ERR_RESOURCE = "resource"
ERR_UNSUPPORTED = "unsupported"
ERR_INVALID_ARGUMENT = "invalid_argument"

#: A command carries at most one URI (<= 4095 characters) and a few numbers; anything longer is
#: refused before it is parsed, so a hostile client cannot make the conductor parse megabytes.
MAX_FRAME_LENGTH = 16 * 1024


def default_driver_directory() -> Path:
    """``/dev/shm/slipstream-<user>``: tmpfs, so mapped log buffers never touch a disk.  The
    driver's default ``dir`` and the client's fallback when ``$SLIPSTREAM_DIR`` is unset.

    ``<user>`` is the name of the effective uid in the password database, or the uid itself
    when it has no entry there (a container's arbitrary uid).  Not ``$USER`` or ``$LOGNAME``:
    the directory is made 0700 for, and its control socket answers only, the effective uid,
    so a name another process could have set would send a client to a driver it cannot use."""
    uid = os.geteuid()
    try:
        user = pwd.getpwuid(uid).pw_name
    except KeyError:
        user = str(uid)
    return Path("/dev/shm") / f"slipstream-{user}"


#: A driver directory's mode: its user's alone, or shared with the driver's ``client_group``,
#: which may read and enter it but never add, rename or remove a name (so no member can plant
#: a link for the driver).  A group that is not the driver's own also takes the setgid bit,
#: so that what is made in it is the group's.
PRIVATE_DIRECTORY_MODE: Final = 0o700
SHARED_DIRECTORY_MODE: Final = 0o750


def file_mode(shared: bool, *, clients_write: bool) -> int:
    """The mode of a file the driver makes in its directory: 0600, its user's alone; in a
    directory ``shared`` with a group, 0660 for what clients write (logs, counters, sockets)
    and 0640 for what they only read (the lock, the error log, the loss report)."""
    if not shared:
        return 0o600
    return 0o660 if clients_write else 0o640


def create_file(path: str | os.PathLike[str], flags: int, mode: int) -> int:
    """``os.open(path, flags | O_CREAT | O_NOFOLLOW | O_CLOEXEC, mode)`` with the file's mode
    exactly ``mode`` whatever the umask (a unit's ``UMask=0077`` takes the group's bits)."""
    fd = os.open(path, flags | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        os.fchmod(fd, mode)
    except BaseException:
        os.close(fd)
        raise
    return fd


def user_name(uid: int) -> str:
    """The name of ``uid`` in the password database, else the number."""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def group_name(gid: int) -> str:
    """The name of ``gid`` in the group database, else the number."""
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


def describe_user(uid: int) -> str:
    """``name (uid N)``, or ``uid N`` when the password database has no entry for it."""
    name = user_name(uid)
    return f"uid {uid}" if name == str(uid) else f"{name} (uid {uid})"


def describe_group(gid: int) -> str:
    """``group name (gid N)``, or ``group gid N`` when the group database has none."""
    name = group_name(gid)
    return f"group gid {gid}" if name == str(gid) else f"group {name} (gid {gid})"


def shared_group(directory: str | os.PathLike[str]) -> int | None:
    """The gid of the group a driver directory is shared with (its group may enter it and
    others may not: :data:`SHARED_DIRECTORY_MODE`, the driver's ``client_group``), else
    None."""
    try:
        info = os.stat(directory)
    except OSError:
        return None
    entered = stat.S_IRGRP | stat.S_IXGRP
    shared = info.st_mode & entered == entered and not info.st_mode & stat.S_IRWXO
    return info.st_gid if shared else None


def _membership(gid: int) -> tuple[bool, bool]:
    """(whether this process holds group ``gid``, whether the driver's control socket admits
    its effective uid by that group: its primary group or a member in the group database, the
    rule of libzmq's IPC_FILTER_GID)."""
    holds = gid == os.getegid() or gid in os.getgroups()
    try:
        listed = user_name(os.geteuid()) in grp.getgrgid(gid).gr_mem
    except KeyError:
        listed = False
    # libzmq compares the peer's gid (SO_PEERCRED: its effective gid), then the group's
    # member list; a primary group is neither when the process runs under another (sg).
    return holds, listed or gid == os.getegid()


def foreign_directory_error(directory: str | os.PathLike[str], uid: int) -> DriverError:
    """The error for a driver directory of user ``uid`` that this process may not use: a
    driver answers only processes of its own user, and the members of its ``client_group``
    when it has one (its directory is 0700, or the group's 0750, its control socket checks
    SO_PEERCRED).  The message says what would let this process in."""
    me = describe_user(os.geteuid())
    gid = shared_group(directory)
    if uid == os.geteuid():  # our own, closed to us by its mode: not another user's
        return DriverError(
            f"the driver directory {directory} or its {LOCK_FILE} is not readable by its own "
            f"user, {describe_user(uid)}: its mode was changed; a driver makes it 0700 "
            f"(rwx for its user; 0750 with a client_group)")
    owner = describe_user(uid)
    if gid is not None:
        group, name, user = describe_group(gid), group_name(gid), user_name(os.geteuid())
        serves = f"the driver directory {directory} serves {owner} and the members of {group}"
        holds, admitted = _membership(gid)
        if admitted and not holds:
            return DriverError(
                f"{serves}; {me} is a member, but this process does not hold the group (it "
                f"was started before {user} joined it): start it from a new login session, "
                f"or under `sg {name}`")
        if holds and admitted:  # a member in every way: a file is not the group's
            return DriverError(
                f"{serves}, and this process holds the group, but the directory or its "
                f"{LOCK_FILE} is not the group's to read: its mode or group was changed; a "
                f"driver gives them to the group when it starts, so restart it")
        if holds and not admitted:
            return DriverError(
                f"{serves}; this process holds the group, but the group database does not "
                f"list {me} as a member, and the driver's control socket admits only listed "
                f"members (or a primary group's): add it (`sudo usermod -aG {name} {user}`), "
                f"or make {group} this process's primary group (in a container, whose group "
                f"database is its image's: `--user UID:{gid}`)")
        return DriverError(
            f"{serves}, and this process runs as {me}, which is not in it: add it to the group "
            f"(`sudo usermod -aG {name} {user}`, then log in again), or use a driver of your "
            f"own (--dir, or SLIPSTREAM_DIR)")
    try:
        sudo_user = pwd.getpwuid(uid).pw_name
    except KeyError:
        sudo_user = f"'#{uid}'"  # sudo's form for a uid without a name
    return DriverError(
        f"the driver directory {directory} belongs to {owner} and this process runs as "
        f"{me}: a driver serves only its own user's processes unless its client_group "
        f"setting names a group to share with; run this as that user (e.g. `sudo -u "
        f"{sudo_user}`), or use a driver of your own (--dir, or SLIPSTREAM_DIR)")


def check_directory_access(directory: str | os.PathLike[str]) -> None:
    """Raise :func:`foreign_directory_error`'s :class:`DriverError` when ``directory`` exists
    but this process may not read it or its lock: another user's driver directory.  Nothing
    when it is missing (the caller says no driver runs there) or usable."""
    path = Path(directory)
    try:
        owner = os.stat(path).st_uid
    except OSError:
        return
    lock = path / LOCK_FILE
    # The effective uid's rights, as the opens that follow have them (not the real uid's).
    if not os.access(path, os.R_OK | os.X_OK, effective_ids=True) or (
            os.path.lexists(lock) and not os.access(lock, os.R_OK, effective_ids=True)):
        raise foreign_directory_error(path, owner)


#: The first line of a driver's lock file: what marks a directory as a driver's.
DIRECTORY_MARKER = "slipstream driver directory"
#: The longest lock file a driver writes, bytes: what a reader reads of one.
LOCK_TEXT_MAX = 256


def lock_text(created: bool, pid: int) -> str:
    """What a driver writes into its ``driver.lock``: the marker, whether it created the
    directory, its pid."""
    return f"{DIRECTORY_MARKER}\ncreated: {'yes' if created else 'no'}\npid: {pid}\n"


def parse_lock(data: bytes) -> tuple[bool, int | None, bool]:
    """(whether a driver wrote it, the pid it names or None, whether that driver created the
    directory) of a lock file's first :data:`LOCK_TEXT_MAX` bytes."""
    lines = data[:LOCK_TEXT_MAX].decode("ascii", "replace").splitlines()
    if not lines or lines[0] != DIRECTORY_MARKER:
        return False, None, False
    fields = dict(line.partition(": ")[::2] for line in lines[1:])
    pid = fields.get("pid", "")
    return True, int(pid) if pid.isdigit() else None, fields.get("created") == "yes"


def driver_holds_lock(directory: Path) -> bool:
    """Whether a live process holds the driver lock (a crashed driver's lock is released).
    Raises :class:`DriverError` naming the directory's owner when this process may not open
    the lock: another user's driver (:func:`foreign_directory_error`)."""
    try:
        fd = os.open(directory / LOCK_FILE, os.O_RDONLY)
    except FileNotFoundError:
        return False
    except PermissionError:
        owner = None
        for path in (directory, directory.parent):  # the parent: when even the directory
            with contextlib.suppress(OSError):      # cannot be looked at
                owner = os.stat(path).st_uid
                break
        if owner is None:
            raise DriverNotRunningError(str(directory), "this process may not look into it "
                                                        "(permission denied)") from None
        raise foreign_directory_error(directory, owner) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def lock_holder_pid(directory: str | os.PathLike[str]) -> int | None:
    """The pid a driver wrote into the directory's lock, or None when there is no lock or it
    names none.  Whether that process still holds the lock is another question
    (``_driver_holds_lock`` in client.py)."""
    try:
        with open(Path(directory) / LOCK_FILE, "rb") as lock:
            return parse_lock(lock.read(LOCK_TEXT_MAX))[1]
    except OSError:
        return None


def socket_refusal(directory: str | os.PathLike[str]) -> DriverError | None:
    """Why the directory's control socket drops this process's connection unread, or None
    when it admits it: it answers its owner's effective uid and, in a directory shared with a
    group, the members libzmq's IPC_FILTER_GID admits (:func:`_membership`)."""
    try:
        info = os.stat(Path(directory) / CONDUCTOR_SOCKET)
    except OSError:
        return None
    if info.st_uid == os.geteuid():
        return None
    if info.st_mode & stat.S_IWGRP and _membership(info.st_gid)[1]:
        return None
    return foreign_directory_error(directory, info.st_uid)


def conductor_endpoint(directory: str | Path) -> str:
    """The zmq endpoint of the conductor for a driver directory."""
    return f"ipc://{Path(directory) / CONDUCTOR_SOCKET}"


def check_int32(field: str, value: object) -> int:
    """``value`` if it is an int (not a bool) in the int32 range, else
    :class:`InvalidArgumentError`.  Stream and session ids are int32 on the wire and in the log
    (docs/PROTOCOL.md §1.2)."""
    return _check_int(field, value, (INT32_MIN, INT32_MAX))


#: The longest timeout in seconds whose nanoseconds an int64 holds (about 292 years).
MAX_TIMEOUT_S: Final = INT64_MAX / 1e9


@overload
def check_timeout(field: str, value: object, *, forever: Literal[False],
                  zero: bool = True) -> float: ...
@overload
def check_timeout(field: str, value: object, *, forever: bool = True,
                  zero: bool = True) -> float | None: ...
def check_timeout(field: str, value: object, *, forever: bool = True,
                  zero: bool = True) -> float | None:
    """A timeout argument in seconds: a finite number >= 0 (> 0 unless ``zero``), or, where
    ``forever``, None or infinity for no limit (returned as None); else
    :class:`InvalidArgumentError` naming ``field``."""
    if value is None and forever:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidArgumentError(field, f"{value!r} is not a number of seconds")
    if value > MAX_TIMEOUT_S and forever:  # longer than int64 nanoseconds reach: no limit
        return None
    if not (0 <= value <= MAX_TIMEOUT_S) or (value == 0 and not zero):
        limit = ">= 0" if zero else "> 0"
        raise InvalidArgumentError(field, f"{value!r} is not a number of seconds {limit} and "
                                          f"at most {MAX_TIMEOUT_S:.3g}"
                                          f"{' (None: no limit)' if forever else ''}")
    return float(value)


def check_int64(field: str, value: object, *, low: int = INT64_MIN) -> int:
    """``value`` if it is an int (not a bool) in ``low``..int64 max, else
    :class:`InvalidArgumentError`."""
    return _check_int(field, value, (low, INT64_MAX))


def check_channel(field: str, value: object) -> str:
    """``value`` if it is a string of at most :data:`MAX_URI_LENGTH` characters."""
    if not isinstance(value, str):
        raise InvalidArgumentError(field, f"{value!r} is not a string")
    if len(value) > MAX_URI_LENGTH:
        raise InvalidArgumentError(field, f"{len(value)} characters exceed the URI limit of "
                                  f"{MAX_URI_LENGTH}")
    return value


def _check_int(field: str, value: object, bounds: tuple[int, int]) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgumentError(field, f"{value!r} is not an integer")
    low, high = bounds
    if not low <= value <= high:
        raise InvalidArgumentError(field, f"{value} is outside {low}..{high}")
    return value


def _int64(field: str, value: object) -> object:
    return check_int64(field, value)


def _pid(field: str, value: object) -> object:
    return _check_int(field, value, (0, INT32_MAX))


_process_token = secrets.randbits(63)


def _draw_process_token() -> None:
    global _process_token
    _process_token = secrets.randbits(63)


os.register_at_fork(after_in_child=_draw_process_token)


def process_token() -> int:
    """A random 63-bit number naming this process, drawn at import and anew in a forked
    child.  CONNECT carries it, so a driver tells an application's own clients from another
    process's: a pid cannot, since processes in two pid namespaces that share /dev/shm may
    have the same one."""
    return _process_token


#: The fields of every command and how each is checked.  Fields not listed are ignored (a newer
#: client may send more); a listed field that is missing or wrong is refused, naming it.
COMMAND_FIELDS: dict[str, dict[str, Any]] = {
    CONNECT: {"correlation_id": _int64, "version": _int64, "pid": _pid, "process": _int64},
    ADD_PUBLICATION: {"correlation_id": _int64, "channel": check_channel,
                      "stream_id": check_int32},
    ADD_EXCLUSIVE_PUBLICATION: {"correlation_id": _int64, "channel": check_channel,
                                "stream_id": check_int32},
    REMOVE_PUBLICATION: {"correlation_id": _int64, "registration_id": _int64},
    ADD_SUBSCRIPTION: {"correlation_id": _int64, "channel": check_channel,
                       "stream_id": check_int32},
    REMOVE_SUBSCRIPTION: {"correlation_id": _int64, "registration_id": _int64},
    CLOSE_CLIENT: {"correlation_id": _int64},
    ADD_DESTINATION: {"correlation_id": _int64, "registration_id": _int64,
                      "channel": check_channel},
    REMOVE_DESTINATION: {"correlation_id": _int64, "registration_id": _int64,
                         "channel": check_channel},
    ADD_RCV_DESTINATION: {"correlation_id": _int64, "registration_id": _int64,
                          "channel": check_channel},
    REMOVE_RCV_DESTINATION: {"correlation_id": _int64, "registration_id": _int64,
                             "channel": check_channel},
    ADD_COUNTER: {"correlation_id": _int64, "type_id": check_client_type_id,
                  "label": encode_counter_label, "key": decode_counter_key},
    REMOVE_COUNTER: {"correlation_id": _int64, "registration_id": _int64},
}


def check_command(message: dict[str, Any]) -> None:
    """Raise :class:`InvalidArgumentError` unless ``message`` is a known command whose every
    field has the right type and range.  Runs before the conductor reads any field."""
    kind = message["type"]
    fields = COMMAND_FIELDS.get(kind)
    if fields is None:
        raise InvalidArgumentError("type", f"unknown command {kind[:64]!r}")
    for name, check in fields.items():
        if name not in message:
            raise InvalidArgumentError(name, "missing")
        check(name, message[name])


def encode(message: dict[str, Any]) -> bytes:
    """One message as a JSON frame."""
    return json.dumps(message, separators=(",", ":")).encode()


class MalformedMessageError(ValueError):
    """A control frame that is not a message; ``correlation_id`` is the frame's own when it
    is a JSON object that names one (an integer), so that its sender can be answered."""

    def __init__(self, problem: str, correlation_id: int | None = None) -> None:
        super().__init__(problem)
        self.correlation_id = correlation_id


def decode(frame: bytes) -> dict[str, Any]:
    """Parse a JSON frame; raises :class:`MalformedMessageError` (a ``ValueError``) when it
    is not a flat message object (a ``type`` string and scalar values) of at most
    :data:`MAX_FRAME_LENGTH` bytes."""
    if len(frame) > MAX_FRAME_LENGTH:
        raise ValueError(f"a control message of {len(frame)} bytes exceeds {MAX_FRAME_LENGTH}")
    try:
        message = json.loads(frame)
    except RecursionError:
        raise ValueError("a control message nested too deeply") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"a control message is not UTF-8: {e}") from None
    if not isinstance(message, dict):
        raise MalformedMessageError("a control message is a JSON object")
    correlation_id = message.get("correlation_id")
    if isinstance(correlation_id, bool) or not isinstance(correlation_id, int):
        correlation_id = None
    if not isinstance(message.get("type"), str):
        raise MalformedMessageError("type: a control message has a string 'type'",
                                    correlation_id)
    for key, value in message.items():
        if isinstance(value, dict | list):
            raise MalformedMessageError(f"{str(key)[:64]}: a control message holds scalars "
                                        f"only, not {type(value).__name__}s", correlation_id)
    return message
