"""The loss report: per image, the gaps its receiver found (Aeron's LossReport, read by LossStat).

A file in the driver directory (``loss-report.dat``), mapped by the driver and read by
``slipstream stat``, which shows it in every snapshot as its "loss report" section (and as
``loss_report`` in ``--json``; ``--match stream=N`` keeps stream N's entries)::

    [header 64 B: magic, version, capacity, entries used][entries: capacity x 256 B]

An entry: observations (gaps seen, int64), bytes lost (the gaps' lengths, int64), first and last
observation (epoch ns), session id, stream id, and a label (channel and source, 200 bytes at
most).  The conductor adds an entry when it makes an image; the receiver thread counts into it
(atomic adds on the mapped file), and the entry stays after the image goes, so the report
keeps the history of the driver's life.  When the file is full, new images are not reported.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Any

import attrs

from slipstream.client import control
from slipstream.client._native import ffi
from slipstream.client.mapping import map_shared, unmap
from slipstream.daemon._network import lib as network

FILE = "loss-report.dat"
MAGIC = 0x534C5252  # "SLRR"
VERSION = 1
HEADER_LENGTH = 64
ENTRY_LENGTH = 256
LABEL_MAX_LENGTH = 200
DEFAULT_CAPACITY = 4096
_HEADER = struct.Struct("<iiii")  # magic, version, capacity, used
_ENTRY = struct.Struct("<qqqqiii")  # observations, bytes, first, last, session, stream, label len


@attrs.frozen
class LossObservation:
    """One entry of the report, as read."""

    observations: int
    bytes_lost: int
    first_ns: int  # epoch ns
    last_ns: int
    session_id: int
    stream_id: int
    label: str


class LossEntry:
    """A writer's handle on one entry (the receiver thread counts into it)."""

    __slots__ = ("_base",)

    def __init__(self, base: Any) -> None:  # cffi uint8_t *
        self._base = base

    @property
    def address(self) -> Any:  # cffi uint8_t *
        """The entry in the mapped file (a C half records into it too)."""
        return self._base

    def record(self, length: int, count: int = 1) -> None:
        """``count`` gaps of ``length`` bytes in all were found (``ss_loss_record``)."""
        network.ss_loss_record(self._base, length, count)


class LossReport:
    """The driver's mapped report (see the module docstring)."""

    def __init__(self, path: str | os.PathLike[str], capacity: int = DEFAULT_CAPACITY,
                 mode: int = 0o600) -> None:
        """Create the report at ``path`` with ``mode`` (:func:`control.file_mode`)."""
        self.path = Path(path)
        self.capacity = capacity
        size = HEADER_LENGTH + capacity * ENTRY_LENGTH
        fd = control.create_file(self.path, os.O_RDWR | os.O_TRUNC, mode)
        try:
            os.ftruncate(fd, size)
            self._map = map_shared(fd, size, writable=True)
        finally:
            os.close(fd)
        _HEADER.pack_into(self._map, 0, MAGIC, VERSION, capacity, 0)
        self._cdata = ffi.from_buffer("uint8_t[]", self._map)
        self._used = 0

    def add(self, session_id: int, stream_id: int, label: str) -> LossEntry | None:
        """A new entry for an image (conductor thread), or None when the report is full."""
        if self._used >= self.capacity:
            return None
        offset = HEADER_LENGTH + self._used * ENTRY_LENGTH
        encoded = label.encode("utf-8", "replace")[:LABEL_MAX_LENGTH]
        _ENTRY.pack_into(self._map, offset, 0, 0, 0, 0, session_id, stream_id, len(encoded))
        self._map[offset + _ENTRY.size:offset + _ENTRY.size + len(encoded)] = encoded
        self._used += 1
        struct.pack_into("<i", self._map, 12, self._used)
        return LossEntry(self._cdata + offset)

    def close(self) -> None:
        unmap(self._map, self._cdata)


def read_loss_report(directory: str | os.PathLike[str]) -> list[LossObservation]:
    """The entries with at least one observation, from the report in a driver directory
    (empty when there is none)."""
    path = Path(directory) / FILE
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    if len(data) < HEADER_LENGTH:
        return []
    magic, version, capacity, used = _HEADER.unpack_from(data, 0)
    if magic != MAGIC or version != VERSION:
        return []
    entries = []
    for i in range(min(used, capacity)):
        offset = HEADER_LENGTH + i * ENTRY_LENGTH
        if offset + ENTRY_LENGTH > len(data):
            break
        observations, lost, first, last, session, stream, length = _ENTRY.unpack_from(
            data, offset)
        if observations:
            label = data[offset + _ENTRY.size:offset + _ENTRY.size
                         + min(length, LABEL_MAX_LENGTH)].decode("utf-8", "replace")
            entries.append(LossObservation(observations, lost, first, last, session, stream,
                                           label))
    return entries
