"""Recovery at start and verification: the recorded frames checked, in C, frame by frame.

:func:`recover` runs as the service starts, with the archive lock held: each recording the
catalog still has active (the archive died while recording it) ends where its last segment's
last whole valid frame ends; anything past that in the segment (a torn frame, garbage, zeros)
is cut off, and the descriptor says RECOVERED.  :func:`verify` checks every segment of a
recording the same way and changes nothing.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from slipstream.archive.catalog import Catalog, EndReason, RecordingDescriptor
from slipstream.archive.recorder import epoch_ms
from slipstream.archive.segments import (
    SCAN_END,
    ScanResult,
    release_reserved,
    scan_segment,
    segment_base,
    segment_file_name,
    segment_files,
)

log = logging.getLogger("slipstream.archive")


def _scan(descriptor: RecordingDescriptor, path: Path, base: int) -> ScanResult:
    """Scan one segment of ``descriptor`` from where its data begins (its start position in
    the first segment, else the segment's start)."""
    return scan_segment(path, max(descriptor.start_position - base, 0), base,
                        term_length=descriptor.term_length,
                        initial_term_id=descriptor.initial_term_id,
                        session_id=descriptor.session_id, stream_id=descriptor.stream_id)


def recovered_stop_position(descriptor: RecordingDescriptor, directory: Path
                            ) -> tuple[int, Path | None, ScanResult | None]:
    """Where an active recording's whole frames end: ``(stop position, its last segment,
    the scan of it)``; with no segment, its start position.  Changes nothing."""
    files = [(base, path) for base, path in segment_files(directory, descriptor.recording_id)
             if base + descriptor.segment_length > descriptor.start_position]
    if not files:
        return descriptor.start_position, None, None
    base, path = files[-1]
    result = _scan(descriptor, path, base)
    return base + result.end, path, result


def recover(catalog: Catalog, directory: Path) -> list[RecordingDescriptor]:
    """End every active recording of ``catalog`` at its last whole frame (see the module);
    returns the recovered descriptors.  Cuts only the last segment of such a recording, a
    file whose name is the archive's and whose recording is in its catalog."""
    recovered = []
    for descriptor in catalog.recordings():
        if not descriptor.is_active:
            continue
        stop, path, result = recovered_stop_position(descriptor, directory)
        if path is not None:
            # What the archive reserved past the segment's size when it died: given back.
            with open(path, "r+b") as file:
                release_reserved(file.fileno())
        if path is not None and result is not None and result.size > result.end:
            # A torn frame, or whatever lies past the last whole one: never served, so gone.
            with open(path, "r+b") as file:
                os.ftruncate(file.fileno(), result.end)
                os.fdatasync(file.fileno())
            log.warning("recording %d: %s cut from %d to %d bytes (%s after the last whole "
                        "frame)", descriptor.recording_id, path.name, result.size, result.end,
                        "a torn frame" if result.reason != SCAN_END else "zeros")
        updated = descriptor.evolve(stop_position=stop, stop_time_ms=epoch_ms(),
                                    end_reason=EndReason.RECOVERED)
        catalog.update(updated)
        recovered.append(updated)
        log.warning("recording %d was active when the archive stopped: recovered, stopped at "
                    "position %d", descriptor.recording_id, stop)
    if recovered:
        catalog.sync()
    return recovered


@dataclass
class VerifyReport:
    """What :func:`verify` found of one recording: the frames checked and the problems, each
    a sentence naming its segment and position (none: every recorded frame is whole)."""

    recording_id: int
    frames: int = 0
    segments: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def verify(descriptor: RecordingDescriptor, directory: Path) -> VerifyReport:
    """Scan every segment of ``descriptor`` frame by frame: each must hold whole valid frames
    from where its data begins to where the catalog says it ends (the segment's end, the stop
    position, or for an active recording whatever was written).  Changes nothing."""
    report = VerifyReport(descriptor.recording_id)
    start, stop = descriptor.start_position, descriptor.stop_position
    files = dict(segment_files(directory, descriptor.recording_id))
    if descriptor.is_active:
        last = max(files) if files else start
        end = None
    else:
        last = segment_base(start, max(stop - 1, start), descriptor.term_length,
                            descriptor.segment_length)
        end = stop
    if not descriptor.is_active and stop == start:
        return report  # nothing recorded (or retention took it all)
    base = segment_base(start, start, descriptor.term_length, descriptor.segment_length)
    while base <= last:
        path = files.get(base)
        name = segment_file_name(descriptor.recording_id, base)
        expected = min(descriptor.segment_length, end - base) if end is not None else \
            descriptor.segment_length if base < last else None
        if path is None:
            report.problems.append(f"{name}: missing (positions {max(base, start)} on)")
            base += descriptor.segment_length
            continue
        result = _scan(descriptor, path, base)
        report.segments += 1
        report.frames += result.frames
        if expected is not None and result.end < expected:
            report.problems.append(
                f"{name}: whole frames end at position {base + result.end} ({result.reason}"
                f" frame there), the recording holds up to {base + expected}")
        elif expected is None and not result.clean:
            report.problems.append(f"{name}: a {result.reason} frame at position "
                                   f"{base + result.end}")
        base += descriptor.segment_length
    return report
