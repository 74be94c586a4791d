"""Recording one image: its blocks of frames into segment files (Aeron Archive's
``RecordingWriter`` and ``RecordingSession``).

:class:`SegmentWriter` writes the blocks of one recording, front to back, into its segment
files and makes them durable by the sync policy; :class:`Recording` reads an image in blocks
(:meth:`Image.block_poll <slipstream.client.image.Image.block_poll>`: whole frames, per-frame
work in C) into a writer, and keeps the recording's descriptor in the catalog.  Both run on
the archive service's one thread.

:attr:`Recording.recorded_position` is the position reported outward (the durable one under
the sync policy; under ``none``, the written one); ``on_position(recording, position)`` is
called each time it moves (the service sets the recording's position counter there).

**The subscriber position never passes the recorded position.**  A recording reads ahead with
a private reader (:meth:`Image.reader_at <slipstream.client.image.Image.reader_at>`) and
moves its image's subscriber position (what holds an IPC or spied publisher, and what a
network stream's status messages report) only to the recorded position, after it was made
durable and after ``on_position`` was told.  So a publisher that sees the archive's position
pass a message knows the message is recorded under the archive's policy.  The publisher may
run at most its window ahead of that position: under ``segment`` and ``interval`` the
recording therefore also syncs whenever it has read everything the stream holds with bytes
not yet durable (the stream waits on it then; a group commit: under load the syncs come one
per window, with a trickle one per batch the archive finds).
"""

from __future__ import annotations

import errno
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from slipstream.archive.catalog import Catalog, EndReason, RecordingDescriptor
from slipstream.archive.segments import (
    WriteBehind,
    release_reserved,
    reserve,
    segment_base,
    segment_file_name,
    sync_directory,
)
from slipstream.archive.settings import SyncPolicy
from slipstream.client.errors import ClosedError
from slipstream.client.image import Image

log = logging.getLogger("slipstream.archive")

#: Blocks one :meth:`Recording.poll` writes at most before the service looks at its other
#: recordings (each up to the block length).
_BLOCKS_PER_POLL = 8


def epoch_ms() -> int:
    return time.time_ns() // 1_000_000


class SegmentWriter:
    """Writes one recording's bytes, from its start position on, into its segment files in
    ``directory``.  ``position`` is how far it has written (the page cache has it);
    ``durable_position`` how far the sync policy has made durable (under ``none``: the
    written position, durable against the archive's death but not the machine's)."""

    def __init__(self, directory: Path, descriptor: RecordingDescriptor, sync: SyncPolicy,
                 sync_interval_ns: int, position: int | None = None,
                 write_behind: int = 0) -> None:
        self.directory = directory
        self.recording_id = descriptor.recording_id
        self.start_position = descriptor.start_position
        self.term_length = descriptor.term_length
        self.segment_length = descriptor.segment_length
        self.sync = sync
        self.sync_interval_ns = sync_interval_ns
        self.position = descriptor.start_position if position is None else position
        self.durable_position = self.position
        self._fd = -1
        self._reserved = False  # blocks past what was written are reserved (segments.reserve)
        self._base = 0
        self._segment_end = 0
        self._synced_at_ns = time.monotonic_ns()
        #: ``write_behind`` bytes a chunk (segments.WriteBehind); 0: the page cache keeps all.
        self._behind = WriteBehind(write_behind) if write_behind else None
        #: The disk reported an error writing back this file's bytes (fdatasync or
        #: write-behind's sync_file_range): the kernel cleared the file's error mark as it
        #: reported it, so no later sync may be taken as making anything durable.
        self.writeback_failed = False

    @property
    def writing_base(self) -> int | None:
        """The base position of the segment being written, if one is open."""
        return self._base if self._fd >= 0 else None

    @property
    def segment_path(self) -> Path | None:
        """The segment file being written, if one is open."""
        if self._fd < 0:
            return None
        return self.directory / segment_file_name(self.recording_id, self._base)

    def write(self, block: memoryview, position: int) -> None:
        """Write ``block`` (whole frames, within one term) at stream ``position``, which must
        be where the last write ended.  Raises :class:`OSError` when the write fails (the
        bytes of the block that did land stay past :attr:`position`: see :meth:`cut_back`)."""
        if position != self.position:
            raise ValueError(f"recording {self.recording_id}: a block at {position}, "
                             f"the recording is at {self.position}")
        if self._fd < 0 or position >= self._segment_end:
            self._next_segment(position)
        offset = position - self._base
        length = len(block)
        done = 0
        while done < length:  # a regular file writes whole or raises; loop for a signal's cut
            done += os.pwrite(self._fd, block[done:], offset + done)
        self.position = position + length
        if self._behind is not None:
            try:
                self._behind.written(offset + length)
            except OSError:
                self.writeback_failed = True
                raise
        if self.sync is SyncPolicy.NONE:
            self.durable_position = self.position

    def _next_segment(self, position: int) -> None:
        if self._fd >= 0:
            self._close_segment()
        self._base = segment_base(self.start_position, position, self.term_length,
                                  self.segment_length)
        self._segment_end = self._base + self.segment_length
        path = self.directory / segment_file_name(self.recording_id, self._base)
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o640)
        # The file system allocates the segment's blocks at once, not per page as the page
        # cache takes the writes: a third less of the archive's CPU per byte here.
        self._reserved = reserve(self._fd, self.segment_length)
        if self._behind is not None:
            self._behind.restart(self._fd, position - self._base)
        if self.sync is not SyncPolicy.NONE:
            sync_directory(self.directory)  # the new file's name, durable

    def _close_segment(self) -> None:
        """A full segment (or the last at stop): durable first under segment and interval;
        the blocks reserved past what was written given back."""
        if self.sync is not SyncPolicy.NONE and self.durable_position < self.position:
            self._fdatasync()
            self.durable_position = self.position
            self._synced_at_ns = time.monotonic_ns()
        if self._behind is not None:
            try:
                self._behind.finish(self.position - self._base)
            except OSError:
                self.writeback_failed = True
                raise
        self._release_reserved()
        os.close(self._fd)
        self._fd = -1

    def _release_reserved(self) -> None:
        if self._reserved:
            self._reserved = False
            release_reserved(self._fd)

    def make_durable(self) -> bool:
        """Make what was written durable now (fdatasync of the segment being written) unless
        the policy is ``none`` or it is already; returns whether the durable position moved."""
        if self.sync is SyncPolicy.NONE or self._fd < 0 or \
                self.durable_position >= self.position:
            return False
        self._fdatasync()
        self.durable_position = self.position
        self._synced_at_ns = time.monotonic_ns()
        return True

    def tick(self, now_ns: int) -> bool:
        """Sync under ``interval`` when the interval has passed and something is not yet
        durable; returns whether the durable position moved."""
        if self.sync is not SyncPolicy.INTERVAL or self._fd < 0 or \
                self.durable_position >= self.position or \
                now_ns - self._synced_at_ns < self.sync_interval_ns:
            return False
        self._fdatasync()
        self.durable_position = self.position
        self._synced_at_ns = now_ns
        return True

    def cut_back(self) -> None:
        """After a failed write: drop whatever the segment holds past :attr:`position` (a
        partial block), so the file ends at the last whole frame written."""
        if self._fd >= 0:
            os.ftruncate(self._fd, self.position - self._base)

    def _fdatasync(self) -> None:
        try:
            os.fdatasync(self._fd)
        except OSError:
            self.writeback_failed = True
            raise

    def salvage(self) -> None:
        """After a failed write: the segment cut to the last whole frame written and, unless
        the policy is ``none``, synced, so :attr:`durable_position` covers it.  After a
        write-back error (:attr:`writeback_failed`), or when that sync fails, nothing is
        synced again: the segment is cut back to what the disk last confirmed (the last
        successful sync; under ``none``, what write-behind last saw written, if it runs),
        and :attr:`position` and :attr:`durable_position` are that.  Under ``none`` without
        write-behind what was written whole is what is recorded."""
        if self._fd < 0:
            if self.sync is SyncPolicy.NONE and not self.writeback_failed:
                self.durable_position = self.position
            return
        if not self.writeback_failed:
            try:
                self.cut_back()
                if self.sync is not SyncPolicy.NONE:
                    self._fdatasync()
                self.durable_position = self.position
                return
            except OSError as e:
                log.error("recording %d: the segment could not be made durable after the "
                          "failed write (%s)", self.recording_id, e)
        confirmed = self.durable_position
        if self.sync is SyncPolicy.NONE and self._behind is not None:
            confirmed = min(confirmed, self._base + self._behind.confirmed)
        log.error("recording %d: the disk failed to write back what was written; the "
                  "recording ends at %d, the last position the disk confirmed",
                  self.recording_id, confirmed)
        self.position = self.durable_position = confirmed
        if self.position >= self._base:
            try:
                os.ftruncate(self._fd, self.position - self._base)
            except OSError:
                pass  # recovery is not needed: the descriptor stops at durable_position

    def close(self) -> None:
        """Close the segment being written, durable first unless the policy is ``none``."""
        if self._fd >= 0:
            self._close_segment()

    def abandon(self) -> None:
        """Close without syncing (after a failed write)."""
        if self._fd >= 0:
            try:
                self._release_reserved()
            except OSError as e:
                log.error("recording %d: the segment's reserved blocks could not be given "
                          "back: %s", self.recording_id, e)
            os.close(self._fd)
            self._fd = -1


#: Called with a recording and its new recorded position (the counters' seam).
PositionListener = Callable[["Recording", int], object]


class Recording:
    """One image recorded: its descriptor in the catalog, its writer, its state.  Made by the
    service as the image becomes available; :meth:`poll` records what is there; it ends with
    :meth:`stop` (the service stops it), at end of stream, when its image goes, or when a
    write fails (:attr:`error` says why)."""

    def __init__(self, catalog: Catalog, directory: Path, image: Image, channel: str, *,
                 segment_length: int, sync: SyncPolicy, sync_interval_ns: int,
                 block_length: int, on_position: PositionListener | None = None,
                 write_behind: int = 0, source_identity: str | None = None,
                 stops_at_end_of_stream: bool = True) -> None:
        """``source_identity``: the catalog's (default the image's: where its frames came
        from); ``stops_at_end_of_stream`` False: the owner stops the recording at the image's
        end of stream with a reason of its own (a replica, :mod:`.replication`)."""
        self._catalog = catalog
        self._stops_at_end_of_stream = stops_at_end_of_stream
        self.image = image
        self.channel = channel
        self.block_length = block_length
        self._on_position = on_position
        # Aeron's rule: a segment holds one term at least.
        segment_length = max(segment_length, image.term_length)
        descriptor = catalog.add(
            start_position=image.position, start_time_ms=epoch_ms(),
            initial_term_id=image.initial_term_id, term_length=image.term_length,
            segment_length=segment_length, mtu=image.mtu, session_id=image.session_id,
            stream_id=image.stream_id, channel=channel,
            source_identity=image.source_identity if source_identity is None else
            source_identity)
        if sync is not SyncPolicy.NONE:
            try:
                catalog.sync()
            except OSError:
                # Not left active in the catalog with nothing behind it (a reader, and the
                # catch-up, would take it for a recording of what comes).
                try:
                    catalog.update(descriptor.evolve(
                        stop_position=descriptor.start_position, stop_time_ms=epoch_ms(),
                        end_reason=EndReason.WRITE_FAILED))
                except OSError:
                    pass  # the next start's recovery ends it
                raise
        self.recording_id = descriptor.recording_id
        self.writer = SegmentWriter(directory, descriptor, sync, sync_interval_ns,
                                    write_behind=write_behind)
        #: Reads the image ahead of its subscriber position (see the module's docstring).
        self.reader = image.reader_at(image.position)
        self.error: str | None = None
        self._ended = False
        self._reported = self.writer.durable_position
        log.info("recording %d: %s stream %d session %d from position %d",
                 self.recording_id, channel, image.stream_id, image.session_id,
                 descriptor.start_position)

    @property
    def descriptor(self) -> RecordingDescriptor:
        """The recording's descriptor as the catalog holds it now (retention may have moved
        its start)."""
        descriptor = self._catalog.get(self.recording_id)
        assert descriptor is not None
        return descriptor

    @property
    def is_active(self) -> bool:
        """Not yet ended (by stop, end of stream, its image going, a failed write)."""
        return not self._ended

    @property
    def recorded_position(self) -> int:
        """The position reported outward: durable under the sync policy (under ``none``:
        written to the page cache)."""
        return self.writer.durable_position

    def poll(self) -> int:
        """Record what the image holds now, up to a few blocks; returns the bytes written.
        Then the recorded position moves (under ``segment`` and ``interval``: synced first if
        everything the image holds was read) and the image's subscriber position follows it.
        A failed write stops the recording (:attr:`error`, the catalog says WRITE_FAILED at
        the last whole frame written); the image at end of stream stops it too."""
        if not self.is_active or self.image.is_closed:  # closed: the reader's log is unmapped
            return 0
        written = 0
        write = self.writer.write
        block_poll = self.reader.block_poll
        per_block = self.writer.sync is SyncPolicy.NONE
        try:
            for _ in range(_BLOCKS_PER_POLL):
                length = block_poll(write, self.block_length)
                if length == 0:
                    break
                written += length
                if per_block:  # durable as written: the publisher's credit flows per block
                    self._report()
            if written == 0:
                # Everything the image holds is read: its publisher may be waiting on the
                # durable position (it runs at most its window ahead of it), so sync now.
                self.writer.make_durable()
        except OSError as e:
            self._write_failed(e)
            return written
        self._report()
        if written == 0 and self.image.is_end_of_stream and self._stops_at_end_of_stream:
            self.stop(EndReason.END_OF_STREAM)
        return written

    def tick(self, now_ns: int) -> None:
        """The sync policy's timer (``interval``)."""
        if not self.is_active:
            return
        try:
            if self.writer.tick(now_ns):
                self._report()
        except OSError as e:
            self._write_failed(e)

    def _report(self, release: bool = True) -> None:
        """Tell ``on_position`` (the counter) where the recorded position is, then, with
        ``release``, move the image's subscriber position to it: never the other way round,
        so that whoever reads both never sees the subscriber ahead of the recording."""
        position = self.writer.durable_position
        if position != self._reported:
            self._reported = position
            if self._on_position is not None:
                self._on_position(self, position)
        image = self.image
        if release and position > image.position and not image.is_closed:
            try:
                image.position = position
            except ClosedError:
                pass  # the image went meanwhile: its position is no longer this subscriber's

    def _write_failed(self, error: OSError) -> None:
        reason = "the disk is full" if error.errno == errno.ENOSPC else \
            f"{error.strerror or error} (errno {error.errno})"
        failed_at = self.writer.position
        # The recorded position: what is durable now (the subscriber position stays where it
        # was; the service closes the subscription).
        self.writer.salvage()
        self.writer.abandon()
        self.error = (f"recording {self.recording_id} ({self.channel} stream "
                      f"{self.image.stream_id} session {self.image.session_id}): a write "
                      f"failed at position {failed_at}: {reason}; stopped at the last whole "
                      f"frame recorded, {self.writer.position}")
        log.error("%s", self.error)
        self._finish(EndReason.WRITE_FAILED, release=False)

    def stop(self, reason: EndReason = EndReason.STOPPED) -> None:
        """End the recording at what it has written: the segment made durable (unless the
        policy is ``none``), then the descriptor's stop position, time and reason, then the
        catalog synced (likewise)."""
        if not self.is_active:
            return
        try:
            self.writer.close()
        except OSError as e:
            self._write_failed(e)
            return
        self._finish(reason)

    def _finish(self, reason: EndReason, release: bool = True) -> None:
        self._ended = True
        descriptor = self.descriptor.evolve(
            stop_position=self.writer.position, stop_time_ms=epoch_ms(), end_reason=reason)
        try:
            self._catalog.update(descriptor)
            if self.writer.sync is not SyncPolicy.NONE:
                self._catalog.sync()
        except OSError as e:
            log.error("recording %d: the catalog could not be updated (%s); the next start "
                      "recovers it", self.recording_id, e)
        self._report(release)
        self.reader.close()  # lets go of the image's mapping, which stays the image's
        log.info("recording %d ended (%s) at position %d", self.recording_id,
                 reason.name.lower(), self.writer.position)
