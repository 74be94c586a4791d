"""The catalog: one file of fixed-size recording descriptors, updated in place (Aeron
Archive's ``Catalog``).

Layout (little-endian; docs/ARCHIVE.md, "The catalog"): a 64-byte header (magic
``SLPSCATL``, format version, header length, descriptor length), then one
:data:`DESCRIPTOR_LENGTH`-byte descriptor per recording, recording id ``n`` at offset
``header + n * DESCRIPTOR_LENGTH``.  Ids are never reused: a purged recording's descriptor
stays, marked deleted.  A descriptor is written with one ``pwrite``; one whose state is not a
known one, or whose id is not its index (an append a crash cut), ends the catalog, and opening
it for writing cuts such a tail off.

The catalog is one writer's (the archive service, or ``slipstream-archive purge`` while the
service is stopped: the archive lock says which); readers (``list``, ``describe``, a later
replay, a read in place on the archive's host) open it read-only, read it in one go, and see
each descriptor as its last write left it.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from slipstream.client.closing import ClosedOnExit
from slipstream.client.logbuffer import LogIdentity

CATALOG_FILE: Final = "archive.catalog"
MAGIC: Final = b"SLPSCATL"
#: Version 1: the layout below.  A catalog of another version is refused, naming both.
CATALOG_VERSION: Final = 1
_HEADER: Final = struct.Struct("<8siii")  # magic version header_length descriptor_length
HEADER_LENGTH: Final = 64
DESCRIPTOR_LENGTH: Final = 1024
#: recording_id state end_reason start_position stop_position start_time_ms stop_time_ms
#: initial_term_id term_length segment_length mtu session_id stream_id channel_length
#: source_identity_length, then the channel and the source identity (UTF-8), back to back.
_DESCRIPTOR: Final = struct.Struct("<qiiqqqqiiqiiiHH")
#: The longest channel and source identity together (UTF-8 bytes).
MAX_STRINGS_LENGTH: Final = DESCRIPTOR_LENGTH - _DESCRIPTOR.size
#: The stop position (and time) of a recording still being written (Aeron's NULL_POSITION).
NULL_POSITION: Final = -1
NULL_TIME: Final = -1


class CatalogError(Exception):
    """The catalog file is not one this archive can read or write (named in the message)."""


class RecordingState(enum.IntEnum):
    """A descriptor's state; 0 is no descriptor (an append a crash cut)."""

    VALID = 1
    DELETED = 2  # purged: its segments are gone, its id is never reused


class EndReason(enum.IntEnum):
    """How a recording ended (or that it has not)."""

    ACTIVE = 0  # being recorded (or the archive died: recovery at the next start decides)
    END_OF_STREAM = 1  # the publisher closed and everything it wrote was recorded
    ENDED_ABRUPTLY = 2  # the image went without end of stream: stops at the last recorded
    RECOVERED = 3  # the archive died while recording; recovery found the last whole frame
    STOPPED = 4  # the archive stopped it (shut down): everything read was written
    WRITE_FAILED = 5  # a write failed (disk full, I/O error): stops at the last whole frame


@dataclass(frozen=True)
class RecordingDescriptor:
    """One recording as the catalog holds it.  Positions are stream positions (bytes);
    times are epoch milliseconds; ``stop_position`` is :data:`NULL_POSITION` while active."""

    recording_id: int
    state: RecordingState
    end_reason: EndReason
    start_position: int
    stop_position: int
    start_time_ms: int
    stop_time_ms: int
    initial_term_id: int
    term_length: int
    segment_length: int
    mtu: int
    session_id: int
    stream_id: int
    channel: str
    source_identity: str

    @property
    def is_active(self) -> bool:
        """Still being recorded (or recovery has not yet looked at it)."""
        return self.stop_position == NULL_POSITION

    @property
    def identity(self) -> LogIdentity:
        """What names the recorded log and frames its positions."""
        return LogIdentity(self.session_id, self.initial_term_id, self.term_length,
                           stream_id=self.stream_id, mtu=self.mtu)

    def evolve(self, **changes: object) -> RecordingDescriptor:
        return dataclasses.replace(self, **changes)

    def encode(self) -> bytes:
        channel = self.channel.encode()
        source = self.source_identity.encode()
        if len(channel) + len(source) > MAX_STRINGS_LENGTH:
            raise CatalogError(f"channel and source identity take {len(channel) + len(source)}"
                               f" bytes; a descriptor holds {MAX_STRINGS_LENGTH}")
        fixed = _DESCRIPTOR.pack(
            self.recording_id, self.state, self.end_reason, self.start_position,
            self.stop_position, self.start_time_ms, self.stop_time_ms, self.initial_term_id,
            self.term_length, self.segment_length, self.mtu, self.session_id, self.stream_id,
            len(channel), len(source))
        return (fixed + channel + source).ljust(DESCRIPTOR_LENGTH, b"\0")

    @classmethod
    def decode(cls, data: bytes | memoryview) -> RecordingDescriptor | None:
        """The descriptor in ``data`` (DESCRIPTOR_LENGTH bytes), or None where none was
        written whole (an unknown state or end reason, strings past the descriptor)."""
        fields = _DESCRIPTOR.unpack_from(data)
        state, end_reason, channel_length, source_length = (fields[1], fields[2], fields[13],
                                                            fields[14])
        if state not in RecordingState._value2member_map_ or \
                end_reason not in EndReason._value2member_map_ or \
                channel_length + source_length > MAX_STRINGS_LENGTH:
            return None
        at = _DESCRIPTOR.size
        try:
            channel = bytes(data[at:at + channel_length]).decode()
            source = bytes(data[at + channel_length:at + channel_length + source_length]).decode()
        except UnicodeDecodeError:
            return None
        return cls(fields[0], RecordingState(state), EndReason(end_reason), *fields[3:13],
                   channel, source)


class Catalog(ClosedOnExit):
    """The catalog file of an archive directory.  Not thread-safe: the service's one thread
    writes it."""

    def __init__(self, path: Path, fd: int, writable: bool,
                 descriptors: list[RecordingDescriptor]) -> None:
        self.path = path
        self._fd = fd
        self._writable = writable
        self._descriptors = descriptors

    @classmethod
    def open(cls, directory: Path, *, writable: bool = True) -> Catalog:
        """The catalog of ``directory``, made empty there if absent and ``writable``.  Raises
        :class:`CatalogError` for a file that is not a catalog or of another version, and
        :class:`FileNotFoundError` for a missing one opened read-only."""
        path = Path(directory) / CATALOG_FILE
        if writable:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o640)
        else:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            size = os.fstat(fd).st_size
            if size == 0 and writable:
                header = _HEADER.pack(MAGIC, CATALOG_VERSION, HEADER_LENGTH, DESCRIPTOR_LENGTH)
                os.pwrite(fd, header.ljust(HEADER_LENGTH, b"\0"), 0)
                os.fdatasync(fd)
                size = HEADER_LENGTH
            data = os.pread(fd, size, 0)
            descriptors = cls._read(path, data)
            end = HEADER_LENGTH + len(descriptors) * DESCRIPTOR_LENGTH
            if writable and size > end:
                os.ftruncate(fd, end)  # an append a crash cut: never a whole descriptor
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd, writable, descriptors)

    @staticmethod
    def _read(path: Path, data: bytes) -> list[RecordingDescriptor]:
        if len(data) < _HEADER.size:
            raise CatalogError(f"{path}: {len(data)} bytes, shorter than a catalog's header")
        magic, version, header_length, descriptor_length = _HEADER.unpack_from(data)
        if magic != MAGIC:
            raise CatalogError(f"{path} is not a slipstream archive catalog (magic {magic!r})")
        if version != CATALOG_VERSION:
            raise CatalogError(f"{path}: catalog format version {version}; this archive "
                               f"reads version {CATALOG_VERSION}")
        if header_length != HEADER_LENGTH or descriptor_length != DESCRIPTOR_LENGTH:
            raise CatalogError(f"{path}: header length {header_length}, descriptor length "
                               f"{descriptor_length}; version {CATALOG_VERSION} has "
                               f"{HEADER_LENGTH} and {DESCRIPTOR_LENGTH}")
        descriptors = []
        view = memoryview(data)
        at = HEADER_LENGTH
        while at + DESCRIPTOR_LENGTH <= len(data):
            descriptor = RecordingDescriptor.decode(view[at:at + DESCRIPTOR_LENGTH])
            if descriptor is None or descriptor.recording_id != len(descriptors):
                if at + DESCRIPTOR_LENGTH < len(data):
                    # Not the last: a crash cuts only the last append, so this is damage, and
                    # cutting it off would lose every recording after it.
                    raise CatalogError(
                        f"{path}: the descriptor of recording {len(descriptors)} (at byte "
                        f"{at}) is damaged, and recordings follow it: nothing was changed; "
                        f"restore the catalog from a copy")
                break  # the last append, torn by a crash: opened writable, it is cut off
            descriptors.append(descriptor)
            at += DESCRIPTOR_LENGTH
        return descriptors

    def _check_writable(self) -> None:
        if not self._writable:
            raise CatalogError(f"{self.path} is open read-only")

    def add(self, *, start_position: int, start_time_ms: int, initial_term_id: int,
            term_length: int, segment_length: int, mtu: int, session_id: int, stream_id: int,
            channel: str, source_identity: str) -> RecordingDescriptor:
        """A new active recording's descriptor, written; its id is the next one."""
        self._check_writable()
        descriptor = RecordingDescriptor(
            len(self._descriptors), RecordingState.VALID, EndReason.ACTIVE, start_position,
            NULL_POSITION, start_time_ms, NULL_TIME, initial_term_id, term_length,
            segment_length, mtu, session_id, stream_id, channel, source_identity)
        self._write(descriptor)
        self._descriptors.append(descriptor)
        return descriptor

    def update(self, descriptor: RecordingDescriptor) -> None:
        """Write ``descriptor`` over the one of its id, in place."""
        self._check_writable()
        if not 0 <= descriptor.recording_id < len(self._descriptors):
            raise CatalogError(f"no recording {descriptor.recording_id} in {self.path}")
        self._write(descriptor)
        self._descriptors[descriptor.recording_id] = descriptor

    def _write(self, descriptor: RecordingDescriptor) -> None:
        data = descriptor.encode()
        offset = HEADER_LENGTH + descriptor.recording_id * DESCRIPTOR_LENGTH
        written = os.pwrite(self._fd, data, offset)
        if written != len(data):  # a regular file writes it all or raises (ENOSPC)
            raise OSError(f"{self.path}: wrote {written} of a descriptor's {len(data)} bytes")

    def get(self, recording_id: int) -> RecordingDescriptor | None:
        """The descriptor of ``recording_id`` (deleted ones too), or None."""
        if 0 <= recording_id < len(self._descriptors):
            return self._descriptors[recording_id]
        return None

    def recordings(self, *, include_deleted: bool = False) -> list[RecordingDescriptor]:
        return [d for d in self._descriptors
                if include_deleted or d.state == RecordingState.VALID]

    def recordings_of(self, stream_id: int, session_id: int, framing: tuple[int, int]
                      ) -> list[RecordingDescriptor]:
        """The valid recordings of one session's log (``framing``: its initial term id and
        term length; a log made anew with the same session id is another), in id order."""
        return [d for d in self._descriptors
                if d.state == RecordingState.VALID and d.stream_id == stream_id
                and d.session_id == session_id
                and (d.initial_term_id, d.term_length) == tuple(framing)]

    def sync(self) -> None:
        """Make the descriptors written so far durable (fdatasync)."""
        os.fdatasync(self._fd)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
