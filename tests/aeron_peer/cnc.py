"""Reading what a running Aeron 1.15.1 driver shares in its directory: the CnC file (its
header, the driver conductor's heartbeat, the counters) and the connected flag of a
publication's log buffer.

CnC layout (1.15.1): version i32@0, to-driver length i32@4, to-clients length i32@8, counters
metadata length i32@12, counters values length i32@16, error log length i32@20, client
liveness timeout i64@24, start timestamp i64@32, pid i64@40; buffers from offset 128 in that
order; the ring-buffer trailer (768 bytes) ends the to-driver buffer with the heartbeat at
trailer+640.  Counters: metadata records of 512 bytes (state i32@0, type id i32@4, label
length i32@128, label@132), values every 128 bytes.

The connected flag is an i32 at offset 136 of a log buffer's metadata (its last 4096 bytes);
the stream id is in the default frame header at 320+16.  These are slipstream's own log
offsets too, so they are taken from :mod:`slipstream.client.layout`.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from slipstream.client.layout import (
    LOG_META_DATA_LENGTH,
    META_DEFAULT_FRAME_HEADER,
    META_IS_CONNECTED,
    STREAM_ID_FIELD,
)

from .errors import AeronError

# cnc.dat (CncFileDescriptor, CNC_VERSION 15) and the Agrona ring-buffer trailer.
_CNC_VERSION = 15
_CNC_END_OF_METADATA = 128
_CNC_HEADER = struct.Struct("<6iqqq")  # version, 5 buffer lengths, liveness ns, start ms, pid
_RB_TRAILER_LENGTH = 768
_RB_CONSUMER_HEARTBEAT = 640
# Counters (Agrona CountersReader).
_COUNTER_METADATA_LENGTH = 512
_COUNTER_VALUE_LENGTH = 128
_COUNTER_LABEL_OFFSET = 128
_RECORD_UNUSED, _RECORD_ALLOCATED = 0, 1


@dataclass(frozen=True)
class Counter:
    id: int
    type_id: int
    label: str
    value: int


@dataclass(frozen=True)
class CncInfo:
    version: int
    pid: int
    start_timestamp_ms: int
    heartbeat_ms: int
    client_liveness_timeout_ns: int


@contextlib.contextmanager
def _mapped_cnc(directory: Path) -> Iterator[mmap.mmap | None]:
    """cnc.dat mapped read-only (no copy), or None while it is absent or incomplete."""
    try:
        with open(directory / "cnc.dat", "rb") as file:
            size = os.fstat(file.fileno()).st_size
            if size < _CNC_END_OF_METADATA:
                yield None
                return
            mapped = mmap.mmap(file.fileno(), size, access=mmap.ACCESS_READ)
    except (FileNotFoundError, ValueError, OSError):
        yield None
        return
    with mapped:
        (version, to_driver, to_clients, meta, values, errors) = struct.unpack_from(
            "<6i", mapped, 0)
        complete = _CNC_END_OF_METADATA + to_driver + to_clients + meta + values + errors
        yield mapped if version == _CNC_VERSION and complete <= size else None


def read_cnc(directory: Path) -> CncInfo | None:
    """The cnc.dat header and the conductor heartbeat, or None while not (yet) readable."""
    with _mapped_cnc(directory) as mapped:
        if mapped is None:
            return None
        (version, to_driver, _, _, _, _,
         liveness, start, pid) = _CNC_HEADER.unpack_from(mapped, 0)
        heartbeat_at = (_CNC_END_OF_METADATA + to_driver - _RB_TRAILER_LENGTH
                        + _RB_CONSUMER_HEARTBEAT)
        (heartbeat,) = struct.unpack_from("<q", mapped, heartbeat_at)
        return CncInfo(version, pid, start, heartbeat, liveness)


def read_counters(directory: Path | str) -> list[Counter]:
    """The driver's allocated counters (system counters, channel status, positions)."""
    with _mapped_cnc(Path(directory)) as data:
        if data is None:
            raise AeronError(f"no readable cnc.dat in {directory}")
        _, to_driver, to_clients, meta_length, values_length = struct.unpack_from(
            "<5i", data, 0)
        meta_at = _CNC_END_OF_METADATA + to_driver + to_clients
        values_at = meta_at + meta_length
        counters = []
        for counter_id in range(min(meta_length // _COUNTER_METADATA_LENGTH,
                                    values_length // _COUNTER_VALUE_LENGTH)):
            record = meta_at + counter_id * _COUNTER_METADATA_LENGTH
            state, type_id = struct.unpack_from("<ii", data, record)
            if state == _RECORD_UNUSED:
                break
            if state != _RECORD_ALLOCATED:
                continue
            (label_length,) = struct.unpack_from("<i", data, record + _COUNTER_LABEL_OFFSET)
            label_at = record + _COUNTER_LABEL_OFFSET + 4
            label = data[label_at:label_at + max(0, min(label_length, 380))].decode("latin-1")
            (value,) = struct.unpack_from(
                "<q", data, values_at + counter_id * _COUNTER_VALUE_LENGTH)
            counters.append(Counter(counter_id, type_id, label, value))
        return counters


def has_connected_publication(directory: Path, stream_id: int, ignore: set[str]) -> bool:
    """Whether a publication log buffer of ``stream_id`` (not in ``ignore``) is connected."""
    for log in (directory / "publications").glob("*.logbuffer"):
        if log.name in ignore:
            continue
        try:
            with open(log, "rb") as file:
                size = os.fstat(file.fileno()).st_size
                if size < LOG_META_DATA_LENGTH:
                    continue
                file.seek(size - LOG_META_DATA_LENGTH)
                meta = file.read(LOG_META_DATA_LENGTH)
        except OSError:
            continue
        (connected,) = struct.unpack_from("<i", meta, META_IS_CONNECTED)
        (log_stream,) = struct.unpack_from(
            "<i", meta, META_DEFAULT_FRAME_HEADER + STREAM_ID_FIELD)
        if log_stream == stream_id and connected == 1:
            return True
    return False
