"""Encrypted channels' keys, and the C contexts that seal and open their endpoints'
datagrams (docs/CHANNELS.md §7.8).

A channel's ``key=NAME`` names the file ``NAME.key`` in the driver's ``keys_dir``: one or two
lines ``<id> <64 hex digits>`` (an id 0-255, a 32-byte key), ``#`` comments and blank lines
aside.  The first line's key seals what the driver sends; both open what it receives, so a
key is rotated with no loss in three edits of the file on every host, each taken up within
``keys_reload_interval``: add the new key as the second line (every receiver accepts it),
swap the lines (senders seal with it, receivers still open the old), remove the old line.

A key file is read only if it is a regular file (not a link, a device or a directory) that
no one but its owner and group may read: anything else is refused, naming the file and why.
:class:`KeyRing` reads the files, keeps a context (:class:`Sealing`, an ``ss_crypto_t``) per
endpoint, and reads each named file again when it changed (:meth:`KeyRing.reload`, on the
conductor's timer); a file that went bad keeps the keys it last gave, and the driver's log
says why, once per change.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import stat
import weakref
from pathlib import Path
from typing import Final

from slipstream.client.counters import CountersFile, SystemCounter
from slipstream.client.errors import ChannelError
from slipstream.daemon._network import ffi as network_ffi
from slipstream.daemon._network import lib as network

log = logging.getLogger("slipstream.driver")

#: A key file's name is the key's name with this suffix.
KEY_FILE_SUFFIX: Final = ".key"
#: Bytes of a key (AES-256).
KEY_LENGTH: Final = network.SS_CRYPTO_KEY_LENGTH
#: Keys a file may hold: the one that seals, and one more that opens (rotation).
MAX_KEYS: Final = network.SS_CRYPTO_KEYS_MAX
_LINE: Final = re.compile(r"(\d{1,3})\s+([0-9A-Fa-f]{64})")


class KeyFileError(ValueError):
    """A key file that cannot be used; the message names the file and why."""


def read_key_file(path: Path) -> list[tuple[int, bytes]]:
    """The keys of ``path`` as (id, 32 bytes), the sealing key first.  KeyFileError names the
    file and the cause: missing, not a regular file (a link too), owned by another user than
    the driver's (or root), readable by others, or a line that is not ``<id 0-255> <64 hex
    digits>``, more than two keys, or an id twice."""
    return _read_key_file(path)[0]


def _read_key_file(path: Path) -> tuple[list[tuple[int, bytes]], os.stat_result]:
    """:func:`read_key_file`'s keys, and the file's status as it was read (from the open
    descriptor: a file swapped in after the read is not mistaken for the one read)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise KeyFileError(f"{path} is a symbolic link: a key file must be a regular "
                               f"file") from None
        raise KeyFileError(f"{path} cannot be read: {e.strerror}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise KeyFileError(f"{path} is not a regular file")
        if info.st_uid not in (0, os.geteuid()):
            # Whoever owns it could change it: a user who may write to keys_dir must not
            # be able to plant the keys a root driver then trusts.
            raise KeyFileError(f"{path} is owned by uid {info.st_uid}: a key file must be the "
                               f"driver's user's (uid {os.geteuid()}) or root's")
        if info.st_mode & 0o007:
            raise KeyFileError(f"{path} may be read by others (mode {info.st_mode & 0o777:o}): "
                               f"a key file is for the driver's user and group alone (chmod "
                               f"o-rwx)")
        text = os.read(fd, 64 * 1024).decode("ascii", errors="replace")
    finally:
        os.close(fd)
    keys: list[tuple[int, bytes]] = []
    for number, line in enumerate(text.splitlines(), start=1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        match = _LINE.fullmatch(line)
        if match is None or int(match[1]) > 255:
            raise KeyFileError(f"{path}:{number} is not '<id 0-255> <64 hex digits>'")
        key_id = int(match[1])
        if any(key_id == other for other, _ in keys):
            raise KeyFileError(f"{path}:{number}: key id {key_id} is given twice")
        keys.append((key_id, bytes.fromhex(match[2])))
    if not keys:
        raise KeyFileError(f"{path} holds no key")
    if len(keys) > MAX_KEYS:
        raise KeyFileError(f"{path} holds {len(keys)} keys: at most {MAX_KEYS} (the one that "
                           f"seals, and one more that opens)")
    return keys, info


def _identity(info: os.stat_result) -> tuple[int, ...]:
    return (info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)


class Sealing:
    """One endpoint's C context (``ss_crypto_t *`` in :attr:`c`): its keys, its sender id and
    counter, the senders it opened.  Freed with the object."""

    def __init__(self, name: str, counters: CountersFile | None) -> None:
        c = network.ss_crypto_new()
        if c == network_ffi.NULL:
            raise MemoryError("ss_crypto_new: no memory or no randomness")
        self.c = network_ffi.gc(c, network.ss_crypto_free)
        self.name = name
        if counters is not None:
            cells = network.ss_crypto_counters(self.c)
            cells.plain_drops = counters.address(SystemCounter.CRYPTO_PLAIN_DROPS)
            cells.unknown_key_drops = counters.address(SystemCounter.CRYPTO_UNKNOWN_KEY_DROPS)
            cells.auth_drops = counters.address(SystemCounter.CRYPTO_AUTH_DROPS)
            cells.replay_drops = counters.address(SystemCounter.CRYPTO_REPLAY_DROPS)
            cells.senders_full_drops = counters.address(SystemCounter.CRYPTO_SENDERS_FULL_DROPS)
            cells.seal_failures = counters.address(SystemCounter.CRYPTO_SEAL_REFUSED)
            cells.awaiting_handshake_drops = counters.address(
                SystemCounter.CRYPTO_AWAITING_HANDSHAKE_DROPS)
            cells.handshake_failed_drops = counters.address(
                SystemCounter.CRYPTO_HANDSHAKE_FAILED_DROPS)
            cells.handshake_unmatched_drops = counters.address(
                SystemCounter.CRYPTO_HANDSHAKE_UNMATCHED_DROPS)
            cells.handshake_limited_drops = counters.address(
                SystemCounter.CRYPTO_HANDSHAKE_LIMITED_DROPS)
            cells.handshakes = counters.address(SystemCounter.CRYPTO_HANDSHAKES)

    def set_keys(self, keys: list[tuple[int, bytes]]) -> None:
        """The keys (the sealing one first), taken up by the data path at its next datagram."""
        if not 1 <= len(keys) <= MAX_KEYS or any(len(k) != KEY_LENGTH for _, k in keys):
            raise ValueError(f"1 or 2 keys of {KEY_LENGTH} bytes")
        ids = bytes(key_id for key_id, _ in keys)
        if network.ss_crypto_set_keys(self.c, ids, b"".join(k for _, k in keys),
                                      len(keys)) != 0:
            raise ValueError("two keys with one id")

    def seal(self, plain: bytes) -> bytes:
        """``plain`` sealed as the endpoint would send it (tests, tools)."""
        out = network_ffi.new("uint8_t[]", len(plain) + network.SS_SEALED_OVERHEAD)
        length = network.ss_crypto_seal(self.c, plain, len(plain), out, len(out))
        if length < 0:
            raise ValueError("no key to seal with")
        return bytes(network_ffi.buffer(out, length))

    def open(self, sealed: bytes, source: bytes | None = None) -> bytes | int:
        """The frames of a sealed datagram from ``source`` (a ``struct sockaddr``'s bytes;
        None: no exchange is started), or the ``SS_OPEN_*`` verdict (< 0) that dropped or took
        it (tests, tools; the data path opens in C).  Handshake datagrams it sends in turn
        wait in :meth:`take_handshakes`."""
        buffer = network_ffi.new("uint8_t[]", sealed)
        length = network.ss_crypto_open(self.c, buffer, len(sealed),
                                        source if source is not None else network_ffi.NULL,
                                        len(source) if source is not None else 0)
        if length < 0:
            return length
        start = network.SS_SEALED_HEADER_LENGTH
        return bytes(network_ffi.buffer(buffer, start + length))[start:]


    def take_handshakes(self) -> list[tuple[bytes, bytes]]:
        """The handshake datagrams the endpoint would send now, as (datagram, the ``struct
        sockaddr`` bytes it goes to), oldest first; taken, so sent once."""
        out = network_ffi.new("uint8_t[]", network.SS_HANDSHAKE_ANSWER_LENGTH)
        address = network_ffi.new("uint8_t[]", network.SS_SOCKADDR_MAX)
        address_length = network_ffi.new("int32_t *")
        taken = []
        while (length := network.ss_crypto_take_handshake(self.c, out, len(out), address,
                                                          address_length)) > 0:
            taken.append((bytes(network_ffi.buffer(out, length)),
                          bytes(network_ffi.buffer(address, address_length[0]))))
        return taken

    def set_handshake_address(self, address: bytes) -> None:
        """Where the endpoint's handshake datagrams go (a ``struct sockaddr``'s bytes) rather
        than to their peer's source: a multicast endpoint's, whose socket is bound to a group
        that no unicast datagram reaches."""
        network.ss_crypto_set_handshake_address(self.c, address, len(address))


class KeyRing:
    """The driver's named keys (``keys_dir``) and the contexts of its encrypted endpoints."""

    def __init__(self, keys_dir: str | None, counters: CountersFile | None) -> None:
        self.keys_dir = Path(keys_dir) if keys_dir else None
        self.counters = counters
        #: Each name's file as last read: (identity, keys); identity (inode, size, mtime,
        #: ctime: a chmod changes the last).
        self._files: dict[str, tuple[tuple[int, ...], list[tuple[int, bytes]]]] = {}
        self._contexts: dict[str, weakref.WeakSet[Sealing]] = {}
        self._complaints: dict[str, str] = {}

    def path_of(self, name: str) -> Path:
        assert self.keys_dir is not None
        return self.keys_dir / f"{name}{KEY_FILE_SUFFIX}"

    def sealing_for(self, channel_text: str, name: str) -> Sealing:
        """A new endpoint's context for key ``name``, with its keys.  ChannelError naming
        ``key`` when there is no keys_dir or the file cannot be used (and why)."""
        if self.keys_dir is None:
            raise ChannelError(channel_text, "key", "this driver has no keys_dir setting: an "
                                                    "encrypted channel needs its key file there")
        try:
            keys = self._read(name)
        except KeyFileError as e:
            raise ChannelError(channel_text, "key", str(e)) from None
        sealing = Sealing(name, self.counters)
        sealing.set_keys(keys)
        self._contexts.setdefault(name, weakref.WeakSet()).add(sealing)
        return sealing

    def _read(self, name: str) -> list[tuple[int, bytes]]:
        keys, info = _read_key_file(self.path_of(name))
        self._files[name] = (_identity(info), keys)
        return keys

    def reload(self) -> int:
        """Read again each key file in use that changed, and hand its keys to its endpoints'
        contexts.  Returns how many files gave new keys.  A file gone bad keeps its old keys
        and is logged (once per cause)."""
        changed = 0
        for name, contexts in list(self._contexts.items()):
            if not contexts:
                del self._contexts[name]
                self._files.pop(name, None)
                continue
            path = self.path_of(name)
            try:
                info = path.stat(follow_symlinks=False)
                if name in self._files and self._files[name][0] == _identity(info):
                    continue
                before = self._files.get(name, (None, None))[1]
                keys = self._read(name)
            except (KeyFileError, OSError) as e:
                reason = str(e) if isinstance(e, KeyFileError) else f"{path}: {e.strerror}"
                if self._complaints.get(name) != reason:
                    self._complaints[name] = reason
                    log.error("key %s kept as it was: %s", name, reason)
                continue
            self._complaints.pop(name, None)
            if keys == before:
                continue
            for sealing in contexts:
                sealing.set_keys(keys)
            changed += 1
            log.info("key %s: %s (ids %s; %d seals)", name, path,
                     ", ".join(str(i) for i, _ in keys), keys[0][0])
        return changed
