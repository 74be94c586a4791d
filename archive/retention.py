"""Retention by size and by age, the archive's in all and each recorded stream's, and the
purge of one recording.

Only whole segment files go, and only files the archive made: a name of its pattern
(``<recording id>-<base>.rec``) whose recording is in its catalog.  A recording loses its
segments from its start, oldest first, so what is left is one contiguous range; the
descriptor's start position moves past a segment before the file is removed (a crash between
leaves a file behind its start, which the next pass removes).  A live recording's segment being
written is never removed.  Order: segments older than their bound (the archive's
``max_age``, or their stream's when that is shorter) go first; then, stream by stream, while
its recordings' segments take more than its ``retention_max_bytes``, and then while the whole
archive's take more than ``max_bytes``: the oldest (by last write) of stopped recordings'
first segments, and only then live recordings' older ones.  A stream's recordings are those of
its ``[[record]]`` table (:func:`~slipstream.archive.settings.spec_of`).  A recording active
in the catalog but not recorded by this service (recovery's to end) is neither cut nor counted
in its stream's bound; the log says so once.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from slipstream.archive.catalog import Catalog, RecordingDescriptor, RecordingState
from slipstream.archive.reading import time_index_path
from slipstream.archive.segments import segment_files, sync_directory
from slipstream.archive.settings import RecordSpec, spec_of

log = logging.getLogger("slipstream.archive")


@dataclass(frozen=True)
class _Segment:
    base: int
    path: Path
    size: int
    mtime_ns: int


def _segments(descriptor: RecordingDescriptor, directory: Path) -> list[_Segment]:
    found = []
    for base, path in segment_files(directory, descriptor.recording_id):
        try:
            stat = path.stat()
        except FileNotFoundError:
            continue
        found.append(_Segment(base, path, stat.st_size, stat.st_mtime_ns))
    return found


def _remove(catalog: Catalog, descriptor: RecordingDescriptor, segment: _Segment
            ) -> RecordingDescriptor:
    """The descriptor's start past ``segment`` (its file is removed by the caller once the
    catalog is synced: a crash never leaves the catalog naming a file that is gone)."""
    end = segment.base + descriptor.segment_length
    if descriptor.start_position < end:
        new_start = end if descriptor.is_active else min(end, descriptor.stop_position)
        descriptor = descriptor.evolve(start_position=new_start)
        catalog.update(descriptor)
    log.info("retention: removing %s (%d bytes); recording %d starts at %d",
             segment.path.name, segment.size, descriptor.recording_id,
             descriptor.start_position)
    return descriptor


def apply_retention(catalog: Catalog, directory: Path, *, max_bytes: int, max_age_ns: int,
                    live: Mapping[int, int], now_ns: int,
                    streams: Sequence[RecordSpec] = ()) -> list[Path]:
    """Remove segments by age (older than ``max_age_ns``, or their stream's
    ``retention_max_age_ns`` when shorter, by their last write; 0: no bound) and then by
    size (each of ``streams`` above its ``retention_max_bytes``, then the whole archive above
    ``max_bytes``; 0: no bound), as the module says.  ``live`` maps each live recording's id
    to the base of the segment it writes, which stays (and so does everything after it).
    ``now_ns`` is epoch ns.  Returns the files removed."""
    removed: list[Path] = []
    unlink_after_sync: list[Path] = []  # the segments whose descriptors moved past them
    queues: dict[int, list[_Segment]] = {}
    descriptors: dict[int, RecordingDescriptor] = {}
    total = 0
    stream_of: dict[int, RecordSpec] = {}  # recording id -> its stream's [[record]]
    stream_bytes: dict[RecordSpec, int] = {}  # the bytes of each stream's segments
    age_of: dict[int, int] = {}  # recording id -> its age bound, ns (0: none)
    for descriptor in catalog.recordings():
        segments = _segments(descriptor, directory)
        size = sum(s.size for s in segments)
        total += size
        spec = spec_of(streams, descriptor.stream_id, descriptor.channel)
        writing = live.get(descriptor.recording_id)
        if writing is None and descriptor.is_active:
            # Active in the catalog, not in this service: recovery's, not ours.  Its bytes
            # are left out of its stream's bound, which cannot take them: counted, they would
            # cut the stream's other recordings for nothing.
            if spec is not None and spec.retention_max_bytes > 0:
                _report_outside(directory, descriptor, size)
            continue
        if spec is not None:
            stream_of[descriptor.recording_id] = spec
            stream_bytes[spec] = stream_bytes.get(spec, 0) + size
        candidates = [s for s in segments if writing is None or s.base < writing]
        descriptors[descriptor.recording_id] = descriptor
        queues[descriptor.recording_id] = candidates
        bounds = [b for b in (max_age_ns, spec.retention_max_age_ns if spec else 0) if b > 0]
        age_of[descriptor.recording_id] = min(bounds, default=0)
    # Left behind a start (a crash between the catalog's update and the removal): gone first.
    for recording_id, queue in queues.items():
        descriptor = descriptors[recording_id]
        while queue and queue[0].base + descriptor.segment_length <= descriptor.start_position \
                and descriptor.start_position > queue[0].base:
            segment = queue.pop(0)
            segment.path.unlink(missing_ok=True)
            total -= segment.size
            _count_out(stream_of, stream_bytes, recording_id, segment.size)
            removed.append(segment.path)
    for recording_id, queue in queues.items():
        max_age = age_of[recording_id]
        while max_age and queue and now_ns - queue[0].mtime_ns > max_age:
            segment = queue.pop(0)
            descriptors[recording_id] = _remove(catalog, descriptors[recording_id], segment)
            total -= segment.size
            _count_out(stream_of, stream_bytes, recording_id, segment.size)
            unlink_after_sync.append(segment.path)
    for spec, size in stream_bytes.items():
        if spec.retention_max_bytes > 0:
            ids = [rid for rid in queues if stream_of.get(rid) == spec]
            total -= _trim(catalog, queues, descriptors, ids, live, size,
                           spec.retention_max_bytes, unlink_after_sync)
    if max_bytes > 0:
        _trim(catalog, queues, descriptors, queues, live, total, max_bytes, unlink_after_sync)
    if unlink_after_sync:
        catalog.sync()
        for path in unlink_after_sync:
            path.unlink(missing_ok=True)
        removed += unlink_after_sync
    if removed:
        sync_directory(directory)
    return removed


#: (archive directory, recording id) of the recordings :func:`_report_outside` told of.
_reported_outside: set[tuple[Path, int]] = set()


def _report_outside(directory: Path, descriptor: RecordingDescriptor, size: int) -> None:
    """Log, once per recording, that a recording retention may not act on is outside its
    stream's size bound (which it may keep the stream's disk use over)."""
    key = (directory, descriptor.recording_id)
    if key not in _reported_outside:
        _reported_outside.add(key)
        log.warning("retention: recording %d (stream %d) is active in the catalog but not "
                    "recorded by this service: its %d bytes are outside its stream's size "
                    "bound, which the stream may stay over until it stops",
                    descriptor.recording_id, descriptor.stream_id, size)


def _count_out(stream_of: Mapping[int, RecordSpec], stream_bytes: dict[RecordSpec, int],
               recording_id: int, size: int) -> None:
    """``size`` bytes of recording ``recording_id`` gone: out of its stream's total."""
    spec = stream_of.get(recording_id)
    if spec is not None:
        stream_bytes[spec] -= size


def _trim(catalog: Catalog, queues: dict[int, list[_Segment]],
          descriptors: dict[int, RecordingDescriptor], ids: Iterable[int],
          live: Mapping[int, int], total: int, max_bytes: int,
          unlink_after_sync: list[Path]) -> int:
    """Remove the first segments of the recordings ``ids`` (stopped recordings' first, the
    oldest by last write first) while ``total`` less what went is above ``max_bytes``;
    returns the bytes that went (their files are added to ``unlink_after_sync``)."""
    freed = 0
    heap = [(recording_id in live, queues[recording_id][0].mtime_ns, recording_id)
            for recording_id in ids if queues[recording_id]]
    heapq.heapify(heap)
    while heap and total - freed > max_bytes:
        is_live, _, recording_id = heapq.heappop(heap)
        queue = queues[recording_id]
        segment = queue.pop(0)
        descriptors[recording_id] = _remove(catalog, descriptors[recording_id], segment)
        freed += segment.size
        unlink_after_sync.append(segment.path)
        if queue:
            heapq.heappush(heap, (is_live, queue[0].mtime_ns, recording_id))
    return freed


def purge(catalog: Catalog, directory: Path, recording_id: int) -> list[Path]:
    """Remove recording ``recording_id``: its descriptor marked deleted (its id is never
    reused), then its segment files.  Raises ``KeyError`` naming an id the catalog does not
    hold (or holds deleted).  The caller holds the archive lock: no service records it."""
    descriptor = catalog.get(recording_id)
    if descriptor is None or descriptor.state != RecordingState.VALID:
        raise KeyError(f"no recording {recording_id} in {catalog.path}")
    catalog.update(descriptor.evolve(state=RecordingState.DELETED))
    catalog.sync()
    removed = []
    for _, path in segment_files(directory, recording_id):
        path.unlink(missing_ok=True)
        removed.append(path)
    index = time_index_path(directory, recording_id)  # the archive's own, named by the id
    if index.exists():
        index.unlink()
        removed.append(index)
    if removed:
        sync_directory(directory)
    return removed
